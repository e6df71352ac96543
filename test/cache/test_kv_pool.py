"""The KV pool with real tensors (random KV of the pool's shape: the pool is under test, not the model).

KV here is a deterministic function of the token prefix (as a causal model's would be), so entries
that share a prefix share identical KV, and every read can be checked against what was written.
"""
import dataclasses
import hashlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings as hsettings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from simllm_ros.cache import kv_quant
from simllm_ros.cache.block_store import BlockStore, KVShape
from simllm_ros.cache.kv_pool import KVPool
from simllm_ros.cache.matcher import Matcher
from simllm_ros.settings import SettingError, parse_size

SHAPE = KVShape(layers=2, kv_heads=2, head_dim=8)
T = 4  # tokens per block
DIM = 8  # fingerprint dimension


def kv_for(tokens, shape=SHAPE):
    """[L, H, n, D] keys and values; position i depends on tokens[:i+1] only."""
    L, H, D = shape.layers, shape.kv_heads, shape.head_dim
    k = torch.empty(L, H, len(tokens), D)
    v = torch.empty(L, H, len(tokens), D)
    for i in range(len(tokens)):
        seed = int.from_bytes(hashlib.blake2b(repr(tuple(tokens[:i + 1])).encode(), digest_size=4).digest(), "little")
        g = torch.Generator().manual_seed(seed)
        k[:, :, i] = torch.randn(L, H, D, generator=g) * 3
        v[:, :, i] = torch.randn(L, H, D, generator=g)
    return k, v


def unit(seed, dim=DIM):
    x = np.random.default_rng(seed).standard_normal(dim).astype(np.float32)
    return x / np.linalg.norm(x)


def make_pool(blocks=12, kv_bits=32, extra_bytes=1500, shape=SHAPE, block_tokens=T):
    per = BlockStore.bytes_per_block_for(shape, block_tokens, kv_bits, torch.float32)
    return KVPool(shape, block_tokens=block_tokens, budget_bytes=blocks * per + extra_bytes, kv_bits=kv_bits,
                  model_dtype=torch.float32, fingerprint_dim=DIM)


def put(pool, tokens, scope="a", fp=None, answer="", now=None, question="q"):
    k, v = kv_for(tokens, pool.shape)
    return pool.insert(scope=scope, tokens=tokens, k=k, v=v, fingerprint=unit(0) if fp is None else fp,
                       question=question, context_digest="d", answer=answer, now=now)


# --------------------------------------------------------------------------- property: random op sequences
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 20, 21, 22], [30, 31], []]


class PoolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = make_pool(blocks=12)
        self.clock = 1000.0

    @rule(scope=st.sampled_from(["a", "b", "c"]), prefix=st.sampled_from(PREFIXES),
          tail=st.lists(st.integers(0, 6), max_size=14), fp_seed=st.integers(0, 5),
          answer=st.text(max_size=300), dt=st.floats(0, 50))
    def insert(self, scope, prefix, tail, fp_seed, answer, dt):
        tokens = prefix + tail
        if not tokens:
            return
        self.clock += dt
        key = put(self.pool, tokens, scope, unit(fp_seed), answer=answer, now=self.clock)
        if key is not None:
            e = self.pool.find(scope, tokens)
            assert e.key == key and list(e.tokens) == tokens and e.scope == scope and e.answer == answer

    def keys(self):
        return sorted(e.key for e in self.pool.describe_entries())

    @precondition(lambda self: len(self.pool) > 0)
    @rule(data=st.data())
    def remove(self, data):
        key = data.draw(st.sampled_from(self.keys()))
        self.pool.remove(key)
        assert key not in self.keys()

    @rule(age=st.floats(0, 200))
    def drop_older(self, age):
        self.pool.drop_older_than(age, now=self.clock)
        assert all(self.clock - e.created <= age for e in self.pool.describe_entries())

    @invariant()
    def within_budget_and_consistent(self):
        assert self.pool.bytes_used <= self.pool.budget_bytes
        self.pool.check_consistency()

    @invariant()
    def every_entry_reads_back(self):
        for e in self.pool.describe_entries():
            assert self.pool.find(e.scope, e.tokens) == e
            hit = self.pool.longest_prefix(e.scope, e.tokens, len(e.tokens))
            assert hit is not None and hit.n_tokens == len(e.tokens)
            k, v = kv_for(e.tokens)
            assert torch.equal(hit.k, k) and torch.equal(hit.v, v)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = hsettings(max_examples=150, stateful_step_count=30, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("kv_bits", [8, 16])
def test_random_ops_budget_lossy_storage(kv_bits):
    """The same books hold with 8- and 16-bit storage (no exact read-back there)."""
    rng = np.random.default_rng(kv_bits)
    pool = make_pool(blocks=10, kv_bits=kv_bits)
    for step in range(300):
        op = rng.random()
        if op < 0.65:
            prefix = PREFIXES[rng.integers(len(PREFIXES))]
            tokens = prefix + list(rng.integers(0, 6, rng.integers(0, 15)))
            if tokens:
                put(pool, [int(t) for t in tokens], scope="abc"[rng.integers(3)], fp=unit(int(rng.integers(6))),
                    now=1000.0 + step)
        elif op < 0.9 and len(pool):
            pool.remove(int(rng.choice(sorted(e.key for e in pool.describe_entries()))))
        else:
            pool.drop_older_than(float(rng.uniform(0, 100)), now=1000.0 + step)
        assert pool.bytes_used <= pool.budget_bytes
        pool.check_consistency()


# --------------------------------------------------------------------------- prefix sharing and lookup
def test_prefix_sharing_uses_fewer_blocks():
    shared = list(range(100, 100 + 3 * T))  # exactly 3 full blocks
    a, b = shared + [1, 2, 3, 4, 5], shared + [7, 8, 9]
    together = make_pool(blocks=20)
    put(together, a)
    put(together, b)
    sep_a, sep_b = make_pool(blocks=20), make_pool(blocks=20)
    put(sep_a, a)
    put(sep_b, b)
    separate = sep_a.stats().blocks_used + sep_b.stats().blocks_used
    assert together.stats().blocks_used == separate - 3
    assert together.bytes_used < sep_a.bytes_used + sep_b.bytes_used
    ea, eb = together.describe_entries()
    assert ea.n_blocks + eb.n_blocks == together.stats().blocks_used + 3  # the 3 prefix blocks counted by both
    together.check_consistency()
    # Removing one keeps the shared blocks for the other.
    together.remove(ea.key)
    hit = together.longest_prefix("a", b, len(b))
    assert hit.n_tokens == len(b) and torch.equal(hit.k, kv_for(b)[0])
    together.check_consistency()


@pytest.mark.parametrize("query, expect", [
    # cached: [1..10] -> blocks [1-4][5-8][9,10]
    ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], 10),  # the whole entry incl. its partial last block
    ([1, 2, 3, 4, 5, 6, 7, 8, 9, 99], 9),  # one token into the partial block
    ([1, 2, 3, 4, 5, 6, 99, 98], 6),  # partial match inside a full block
    ([1, 2, 3, 4, 5, 6, 7, 8], 8),  # exactly two full blocks
    ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 10),
    ([99, 1, 2, 3], 0),
    ([1, 2, 9, 9, 9, 9], 2),
])
def test_longest_prefix_token_count(query, expect):
    pool = make_pool(blocks=10)
    put(pool, list(range(1, 11)))
    hit = pool.longest_prefix("a", query, len(query))
    n = hit.n_tokens if hit else 0
    assert n == expect
    if n:
        k, v = kv_for(query[:n])
        assert torch.equal(hit.k, k) and torch.equal(hit.v, v)
    # the limit is honoured: never more than `limit` tokens even if more match
    if expect >= 3:
        assert pool.longest_prefix("a", query, 3).n_tokens == 3


def test_longest_prefix_prefers_longest_sibling():
    pool = make_pool(blocks=10)
    put(pool, [1, 2, 3, 4, 5, 6])
    put(pool, [1, 2, 3, 4, 5, 6, 7])
    hit = pool.longest_prefix("a", [1, 2, 3, 4, 5, 6, 7, 8], 8)
    assert hit.n_tokens == 7


# --------------------------------------------------------------------------- scope isolation
def test_scope_isolation_in_pool_and_matcher():
    pool = make_pool(blocks=20)
    tokens = list(range(1, 14))
    fp = unit(3)
    put(pool, tokens, scope="A", fp=fp)
    assert pool.longest_prefix("B", tokens, len(tokens)) is None
    assert pool.find("B", tokens) is None
    assert pool.best_matches(fp, "B", 0.0, k=4, recency_weight=0.0, half_life_s=600.0) == []  # not even a score
    assert [m.key for m in pool.best_matches(fp, "A", 0.0, k=4, recency_weight=0.0, half_life_s=600.0)] == \
        [e.key for e in pool.describe_entries()]
    # B gets its own copy of the same tokens: separate blocks, never shared across scopes
    put(pool, tokens, scope="B", fp=fp)
    a, b = (pool.find(s, tokens) for s in ("A", "B"))
    assert pool.stats().blocks_used == a.n_blocks + b.n_blocks  # no block shared across scopes
    hits = pool.best_matches(fp, "B", 0.0, k=4, recency_weight=0.0, half_life_s=600.0)
    assert [m.key for m in hits] == [b.key] and hits[0].cosine == pytest.approx(1.0)
    # scope that had entries, now empty again
    pool.remove(b.key)
    assert pool.best_matches(fp, "B", 0.0, k=4, recency_weight=0.0, half_life_s=600.0) == []
    assert pool.longest_prefix("B", tokens, len(tokens)) is None
    pool.check_consistency()


def test_matcher_best_masks_other_scopes_with_many_entries():
    m = Matcher(DIM, capacity=2)  # grows past its first capacity
    for key in range(1, 40):
        m.add(key, unit(key), "A" if key % 3 else "B", now=0.0)
    q = unit(7)
    for scope in ("A", "B"):
        got = m.best(q, scope, now=0.0, k=50)
        want = {key for key in range(1, 40) if ("A" if key % 3 else "B") == scope}
        assert {k for k, _, _ in got} == want
    assert m.best(q, "C", now=0.0, k=5) == []


def brute_redundancy(fps: dict, scopes: dict, keys: list) -> np.ndarray:
    """The definition, all pairs: highest cosine to another of `keys` in the same scope, clipped at 0."""
    out = []
    for k in keys:
        sims = [float(fps[k] @ fps[o]) for o in keys if o != k and scopes[o] == scopes[k]]
        out.append(max(0.0, max(sims)) if sims else 0.0)
    return np.array(out)


def test_matcher_redundancy_is_kept_incrementally():
    """Adds, fingerprint/scope changes and removes, against the all-pairs definition after every step."""
    rng = np.random.default_rng(5)
    m = Matcher(DIM, capacity=2)  # grows on the way
    fps, scopes = {}, {}
    base = [unit(s) for s in range(4)]  # clusters, so near-duplicates and ties of neighbours occur
    for step in range(300):
        op = rng.random()
        if op < 0.55 or not fps:
            key = int(rng.integers(0, 60))  # an existing key is re-added with a new fingerprint and scope
            v = base[int(rng.integers(0, 4))] + rng.choice([0.0, 0.05, 0.5]) * rng.standard_normal(DIM)
            fps[key] = (v / np.linalg.norm(v)).astype(np.float32)
            scopes[key] = "abc"[int(rng.integers(0, 3))]
            m.add(key, fps[key], scopes[key], now=float(step))
        else:
            key = int(rng.choice(sorted(fps)))
            m.remove(key)
            del fps[key], scopes[key]
        keys = sorted(fps)
        assert np.allclose(m.redundancy(keys), brute_redundancy(fps, scopes, keys), atol=1e-6), step
        if len(keys) > 2:  # a caller may leave entries out (eviction protects one): neighbours among the rest
            subset = [k for k in keys if k != keys[step % len(keys)]]
            assert np.allclose(m.redundancy(subset), brute_redundancy(fps, scopes, subset), atol=1e-6), step
    assert len(m) == len(fps)


def test_snapshot_restore_round_trip_without_files():
    pool = make_pool(blocks=20)
    keys = [put(pool, list(range(1, 14)), answer="a", fp=unit(1), now=10.0),
            put(pool, list(range(1, 9)) + [50, 51], scope="b", fp=unit(2), now=20.0)]
    pool.touch([keys[1]], now=30.0)
    snap = pool.snapshot()
    again = pool.empty_like()
    assert again.restore(snap) == 2
    again.check_consistency()
    for e in pool.describe_entries():
        f = again.find(e.scope, e.tokens)
        assert (f.answer, f.hits, f.created, f.last_used, f.n_blocks) == (e.answer, e.hits, e.created, e.last_used,
                                                                          e.n_blocks)
        assert np.array_equal(f.fingerprint, e.fingerprint)
        assert all(torch.equal(a, b) for a, b in zip(again.entry_kv(f.key), pool.entry_kv(e.key)))
    assert again.stats().blocks_used == pool.stats().blocks_used
    bad = dataclasses.replace(snap, entries=[dict(snap.entries[0], rows=[0])])  # block table too short
    with pytest.raises(ValueError):
        pool.empty_like().restore(bad)


# --------------------------------------------------------------------------- eviction
def test_eviction_prefers_a_redundant_entry():
    fp_dup = unit(11)
    near = fp_dup + 0.01 * unit(12)
    near /= np.linalg.norm(near)
    other = unit(13)
    assert float(fp_dup @ near) > 0.99 and abs(float(fp_dup @ other)) < 0.9
    evicted = []
    for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):  # insertion order must not decide
        pool = make_pool(blocks=6, extra_bytes=1000)  # room for exactly 3 entries of 2 blocks
        assert pool.stats().num_blocks == 6
        pool.set_eviction_policy(lfu_weight=0.7, diversity_weight=0.3, half_life_s=600.0)
        seqs = {0: list(range(10, 18)), 1: list(range(20, 28)), 2: list(range(30, 38))}  # 2 blocks each
        fps = {0: fp_dup, 1: near, 2: other}
        keys = {}
        for i in order:
            keys[i] = put(pool, seqs[i], fp=fps[i], now=1000.0)
        assert pool.stats().blocks_free == 0
        put(pool, list(range(40, 48)), fp=unit(14), now=1000.0)  # needs 2 blocks: one entry must go
        kept = {e.key for e in pool.describe_entries()}
        gone = [i for i in keys if keys[i] not in kept]
        assert len(gone) == 1
        evicted.append(gone[0])
        pool.check_consistency()
    assert all(g in (0, 1) for g in evicted), f"evicted {evicted}: the unique entry went first"


def test_failing_block_write_loses_no_block():
    """A write that raises halfway (as a bad snapshot row does on restore) leaves the books as they were.
    White-box: restore's private insert path with a write that fails on the second block."""
    pool = make_pool(blocks=12)
    put(pool, list(range(1, 9)))
    before = (pool.stats().blocks_free, pool.bytes_used, len(pool))
    calls = []

    def bad_write(bid, start, end):
        calls.append(bid)
        if len(calls) == 2:
            raise RuntimeError("shape mismatch")
        pool._store.write(bid, *(t[:, :, start:end] for t in kv_for(list(range(1, 5)) + [7] * 8)))

    with pytest.raises(RuntimeError):
        pool._insert("a", list(range(1, 5)) + [7] * 8, unit(1), "q", "d", "", None, None, 0, bad_write)
    assert (pool.stats().blocks_free, pool.bytes_used, len(pool)) == before
    pool.check_consistency()
    pool.clear()
    assert pool.stats().blocks_used == 0
    pool.check_consistency()


def test_insert_too_large_returns_none():
    pool = make_pool(blocks=3)
    assert put(pool, list(range((pool.stats().num_blocks + 1) * T))) is None
    assert len(pool) == 0 and pool.bytes_used == 0
    pool.check_consistency()


def test_reinsert_with_longer_answer_stays_within_budget():
    """Re-inserting a task with a larger answer must not push the pool over its budget."""
    pool = make_pool(blocks=4, extra_bytes=400)
    tokens = list(range(1, 9))
    key = put(pool, tokens, answer="short")
    assert key is not None
    put(pool, tokens, answer="x" * 5000)
    assert pool.bytes_used <= pool.budget_bytes
    pool.check_consistency()


# --------------------------------------------------------------------------- 8-bit storage
def test_8bit_round_trip_error():
    shape = KVShape(layers=30, kv_heads=3, head_dim=64)  # SmolLM2-135M
    pool = make_pool(blocks=8, kv_bits=8, shape=shape, block_tokens=16)
    g = torch.Generator().manual_seed(0)
    n = 40  # 2 full blocks + a partial one
    k = torch.randn(30, 3, n, 64, generator=g)
    k[..., 5] *= 20  # an outlier channel, as real keys have
    v = torch.randn(30, 3, n, 64, generator=g) * 0.5
    key = pool.insert(scope="a", tokens=list(range(n)), k=k, v=v, fingerprint=unit(0), question="q",
                      context_digest="d", answer="")
    k2, v2 = pool.entry_kv(key)
    ek, ev = kv_quant.error_report(k, k2), kv_quant.error_report(v, v2)
    # the outlier channel's range must not swamp the others (keys quantised per channel)
    ek_small = kv_quant.error_report(k[..., :5], k2[..., :5])
    print(f"\n8-bit round trip: keys {ek}, keys without outlier channel {ek_small}, values {ev}; "
          f"saved {pool.bytes_saved_quantization} B vs 16-bit")
    assert ek["relative"] < 0.01 and ev["relative"] < 0.01
    assert ek_small["max_abs"] < 0.05
    assert pool.bytes_saved_quantization > 0
    assert pool.stats().bytes_per_block < pool.stats().bytes_per_block_16bit * 0.6


# --------------------------------------------------------------------------- settings.parse_size
@pytest.mark.parametrize("text, device, expect", [
    ("5GB", None, 5 * 10**9), ("512MB", None, 512 * 10**6), ("512MiB", None, 512 * 2**20),
    ("30%", 10**10, 3 * 10**9), ("100%", 1000, 1000), (" 1.5 GB ", None, 1_500_000_000), ("4096", None, 4096),
    (123456, None, 123456),
])
def test_parse_size_good(text, device, expect):
    assert parse_size(text, device) == expect


@pytest.mark.parametrize("text, device", [
    ("", 1), ("GB", 1), ("5 XB", 1), ("-5GB", 1), ("0", 1), ("0%", 100), ("101%", 100), ("abc%", 100),
    ("30%", None), ("5GB5", 1), ("1e9", 1), (0, 1), (-3, 1), ("5 G B", 1), ("nan%", 100),
])
def test_parse_size_bad(text, device):
    with pytest.raises(SettingError):
        parse_size(text, device)


def test_concurrent_fingerprints_share_batches():
    """Requests fingerprinted at the same time are embedded together, and each gets its own rows."""
    import threading

    from simllm_ros.cache.fingerprint import Fingerprinter

    fp = Fingerprinter(remember=0)  # every call embeds: this test is about the batching
    texts = [f"how long will it take to drive to the park in west county number {i}" for i in range(24)]
    alone = fp.embed(texts)
    before = (fp.batches, fp.batched_texts)
    out = [None] * len(texts)
    start = threading.Barrier(len(texts))

    def one(i):
        start.wait()
        out[i] = fp.embed([texts[i]])[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    passes = fp.batches - before[0]
    assert fp.batched_texts - before[1] == len(texts)
    assert passes < len(texts), "no two concurrent requests shared a batch"
    for i in range(len(texts)):
        assert np.allclose(out[i], alone[i], atol=1e-5), f"request {i} got another request's fingerprint"
    print(f"\n{len(texts)} concurrent fingerprints took {passes} embedding passes")


def test_matcher_large_scope_prefilter_finds_the_exact_best():
    """Above PREFILTER_ROWS a scope is searched through an int8 copy first: the answers must still be the
    exact float32 ranking (real-looking data: clustered unit vectors, queries near stored ones)."""
    from simllm_ros.cache import matcher as matcher_mod

    rng = np.random.default_rng(11)
    n = matcher_mod.PREFILTER_ROWS + 3000
    centres = rng.standard_normal((40, DIM))
    fps = centres[rng.integers(0, 40, n)] + 0.35 * rng.standard_normal((n, DIM))
    fps = (fps / np.linalg.norm(fps, axis=1, keepdims=True)).astype(np.float32)
    m = Matcher(DIM)
    for key in range(n):
        m.add(key, fps[key], "big", now=float(key % 97))
    m.add(n, fps[0], "other", now=0.0)  # another scope with a perfect match: never returned
    for i in range(25):
        q = fps[int(rng.integers(0, n))] + 0.2 * rng.standard_normal(DIM)
        q = (q / np.linalg.norm(q)).astype(np.float32)
        score = fps @ q - 0.05 * (1.0 - np.exp2(-np.maximum(100.0 - np.arange(n) % 97, 0) / 600.0))
        want = list(np.argsort(-score, kind="stable")[:4])
        got = m.best(q, "big", now=100.0, k=4, recency_weight=0.05, half_life_s=600.0)
        assert [k for k, _, _ in got] == want, i
    for key in range(0, n, 3):  # removals move rows around; lookups stay exact
        m.remove(key)
    rest = np.array([k for k in range(n) if k % 3])
    q = fps[rest[5]]
    assert m.best(q, "big", now=0.0, k=1)[0][0] == rest[5]


def test_matcher_prefilter_keeps_every_row_recency_can_lift_into_the_top_k():
    """k > 1 with recency: the candidates are taken around the k-th best approximate cosine, not the best.
    One exact duplicate of the query (cosine 1) and 600 rows at cosine 0.86-0.89, where the closest 500 are
    old and the farthest 100 fresh: the 2nd-5th best scores belong to fresh rows 500 places down the cosine
    ranking (a fixed-size candidate list around the best cosine missed them)."""
    from simllm_ros.cache import matcher as matcher_mod

    rng = np.random.default_rng(11)
    dim, n_far, n_near = 384, matcher_mod.PREFILTER_ROWS + 100, 600
    q = rng.standard_normal(dim).astype(np.float32)
    q /= np.linalg.norm(q)
    far = rng.standard_normal((n_far, dim)).astype(np.float32)
    far /= np.linalg.norm(far, axis=1, keepdims=True)
    ortho = rng.standard_normal((n_near, dim)).astype(np.float32)
    ortho -= np.outer(ortho @ q, q)
    ortho /= np.linalg.norm(ortho, axis=1, keepdims=True)
    target = np.linspace(0.89, 0.86, n_near).astype(np.float32)  # row i of the cluster: cosine target[i]
    near = target[:, None] * q + np.sqrt(1 - target[:, None] ** 2) * ortho
    fps = np.vstack([q[None], near, far]).astype(np.float32)
    now, half_life = 10_000.0, 600.0
    # The closest 500 of the cluster are old (score ~ cosine - 0.05), the farthest 100 fresh (score = cosine).
    last_used = np.concatenate([[now], np.full(n_near - 100, now - 20_000), np.full(100, now), np.zeros(n_far)])
    m = Matcher(dim)
    for key, (fp, t) in enumerate(zip(fps, last_used)):
        m.add(key, fp, "s", now=float(t))
    assert m._scopes["s"].n > matcher_mod.PREFILTER_ROWS and matcher_mod._int8_kernel_ok()
    score = fps @ q - 0.05 * (1.0 - np.exp2(-(now - last_used) / half_life))
    want = [int(i) for i in np.argsort(-score, kind="stable")[:5]]
    assert min(want[1:]) > 300, "the case needs top rows far down the cosine ranking"
    got = m.best(q, "s", now=now, k=5, recency_weight=0.05, half_life_s=half_life)
    assert [key for key, _, _ in got] == want
    assert [s for _, _, s in got] == pytest.approx([float(score[i]) for i in want], abs=1e-5)


def test_matcher_prefilter_distrusts_a_wrong_int8_kernel(monkeypatch):
    """The int8 kernel is a private op with per-ISA paths (CI once ranked garbage first on another CPU):
    if its cosines disagree with float32 on the rows it picked, the lookup falls back to the exact scan
    and the kernel is not used again in the process."""
    from simllm_ros.cache import matcher as matcher_mod

    rng = np.random.default_rng(5)
    n = matcher_mod.PREFILTER_ROWS + 500
    fps = rng.standard_normal((n, DIM)).astype(np.float32)
    fps /= np.linalg.norm(fps, axis=1, keepdims=True)
    m = Matcher(DIM)
    for key in range(n):
        m.add(key, fps[key], "big", now=0.0)
    real = matcher_mod._int8_scores

    def broken(q, w8, scale):  # a kernel that ranks a block of unrelated rows first
        out = real(q, w8, scale).clone()
        out[7000:7300] += 1.0
        return out

    monkeypatch.setattr(matcher_mod, "_int8_scores", broken)
    monkeypatch.setattr(matcher_mod, "_INT8_KERNEL_OK", True)
    for i in (3, 4000, n - 1):
        assert m.best(fps[i], "big", now=0.0, k=1)[0][0] == i
    assert matcher_mod._INT8_KERNEL_OK is False

    def sinks(q, w8, scale):  # a kernel that buries a block of rows, the right one among them
        out = real(q, w8, scale).clone()
        out[3000:3400] -= 1.0
        return out

    monkeypatch.setattr(matcher_mod, "_int8_scores", sinks)
    monkeypatch.setattr(matcher_mod, "_INT8_KERNEL_OK", True)
    assert m.best(fps[3100], "big", now=0.0, k=1)[0][0] == 3100
    assert matcher_mod._INT8_KERNEL_OK is False


def test_repeated_texts_skip_the_embedder_and_get_the_same_vector():
    """A text embedded recently is answered from memory: no forward pass, the same vector, and a caller
    changing its array does not change what the next caller gets; the memory is bounded (LRU)."""
    from simllm_ros.cache.fingerprint import Fingerprinter

    fp = Fingerprinter(remember=3)
    first = fp.embed(["where can I park near the market", "is the pharmacy open"])
    passes = fp.batches
    again = fp.embed(["is the pharmacy open", "where can I park near the market"])
    assert fp.batches == passes and fp.remembered_hits == 2
    assert np.array_equal(again, first[::-1])
    again[:] = 0.0  # the caller's array is its own
    assert np.array_equal(fp.embed(["is the pharmacy open"])[0], first[1])
    mixed = fp.embed(["is the pharmacy open", "when does bus 12 stop running", "is the pharmacy open"])
    assert fp.batches == passes + 1 and fp.batched_texts == 3, "only the new text is embedded, once"
    assert np.array_equal(mixed[0], first[1]) and np.array_equal(mixed[2], first[1])
    assert abs(np.linalg.norm(mixed[1]) - 1) < 1e-5
    fp.embed(["a", "b", "c"])  # three new texts push the oldest out of a memory of three
    passes = fp.batches
    fp.embed(["where can I park near the market"])
    assert fp.batches == passes + 1, "forgotten text is embedded again"
    assert fp.embed([]).shape == (0, fp.dim)


@pytest.mark.parametrize("kv_bits", [32, 8])
def test_prefix_read_with_room_is_adopted_by_the_model_buffer_without_a_copy(kv_bits):
    """An exact hit reads the pooled prefix once, into a buffer with room for the answer: the views it returns
    hold the stored KV, and KVBuffer.adopt decodes on in that storage. Tensors without room are copied."""
    from simllm_ros.model.kv_buffer import KVBuffer

    pool = make_pool(kv_bits=kv_bits)
    tokens = list(range(1, 11))  # 10 tokens: two full blocks and a partial one
    put(pool, tokens)
    plain = pool.longest_prefix("a", tokens, 9)
    roomy = pool.longest_prefix("a", tokens, 9, capacity=32)
    assert plain.n_tokens == roomy.n_tokens == 9 and roomy.k.shape == plain.k.shape == (2, 2, 9, 8)
    assert torch.equal(roomy.k, plain.k) and torch.equal(roomy.v, plain.v)
    if kv_bits == 32:
        k, v = kv_for(tokens)
        assert torch.equal(roomy.k, k[:, :, :9]) and torch.equal(roomy.v, v[:, :, :9])
    buf = KVBuffer.adopt(roomy.k, roomy.v, capacity=20)
    assert buf is not None and buf.length == 9 and buf.capacity == 32
    assert buf.k.data_ptr() == roomy.k.data_ptr() and buf.v.data_ptr() == roomy.v.data_ptr()
    assert torch.equal(buf.view()[0], plain.k)
    assert KVBuffer.adopt(roomy.k, roomy.v, capacity=33) is None, "not enough room"
    assert KVBuffer.adopt(plain.k, plain.v, capacity=11) is None, "a read without room leaves none"
    assert KVBuffer.adopt(plain.k.clone(), plain.v.clone(), capacity=9) is None, "not a view"
    assert KVBuffer.adopt(roomy.k[:, :, 1:], roomy.v[:, :, 1:], capacity=9) is None, "not the leading slots"
