"""semantic_reuse.run builds its cache where the entry was read (slot = position) and recomputes tokens at their
slots: what it keeps must be the entry's KV moved with its tokens, and what it recomputes must be what a cold
prefill computes. Real models (the embedded one at bf16 4-bit; a random Gemma 3 with sliding-window layers, whose
recomputed tokens read only their window there), KV stored at the model's precision, real pool."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from core_fixtures import BULLETIN, LOSSLESS, shared_engine
from random_gemma import gemma_backend
from simllm_ros.serving import semantic_reuse
from simllm_ros.cache.kv_pool import KVPool
from simllm_ros.request import CacheResult
from simllm_ros.cache.reuse_planner import ReusePlan, align

SYSTEM = "You are a helpful city assistant. Answer briefly."
QUESTION = "Which road is closed this afternoon, and where can I park?"


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def backend(request):
    """The embedded model (full attention) and a random Gemma 3 (sliding-window layers with their own RoPE base,
    bf16 on the attention kernel: batch-invariant), each repair checked on both."""
    if request.param == "gemma3":
        return gemma_backend("bfloat16")
    return shared_engine(**LOSSLESS).backend


def _pool_with(backend, ids: list[int]) -> tuple[KVPool, int]:
    """A pool holding one entry: ids and their KV from a cold prefill."""
    pool = KVPool(backend.kv_shape, block_tokens=16, budget_bytes=64 * 2**20, kv_bits=0, model_dtype=backend.dtype,
                  fingerprint_dim=4)
    _, cache = backend.prefill(ids)
    k, v = backend.cache_tensors(cache)
    key = pool.insert(scope="s", tokens=ids, k=k, v=v, fingerprint=np.ones(4, dtype=np.float32), question="q",
                      context_digest="d", answer="")
    assert key is not None
    return pool, key


def _plan(source: list[int], target: list[int], key: int) -> ReusePlan:
    pairs = align(source, target, len(target) - 1)
    lead = 0
    while lead < len(pairs) and pairs[lead] == (lead, lead):
        lead += 1
    return ReusePlan(CacheResult.SEMANTIC, "test", 0.9, key, pairs=pairs, exact_lead=lead)


def _prompts(backend, before: str, after: str, question: str = QUESTION) -> tuple[list[int], list[int]]:
    return (backend.prompt_ids(SYSTEM, before, QUESTION), backend.prompt_ids(SYSTEM, after, question))


# Target contexts against the bulletin: words inserted early (every later token moves right), a sentence cut
# (later tokens move left; the entry is longer than the new prompt plus its room), and both at once.
EDITS = {
    "inserted": lambda b: b.replace("Riverside", "Riverside (north bank, by the old mill)", 1),
    "cut": lambda b: b[: len(b) // 3] + b[len(b) // 3 + 160:],
    "both": lambda b: (b[: len(b) // 4] + " Extra notice: the ferry runs late tonight." + b[len(b) // 4:])[:-120],
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_kept_tokens_hold_the_entry_kv_moved_with_them(backend, edit):
    """recompute_ratio 0 and no gap tokens: every aligned token keeps the entry's KV in the deeper layers (keys
    rotated by how far it moved, values as stored), the strict layers hold the early pass's fresh KV."""
    source, target = _prompts(backend, BULLETIN, EDITS[edit](BULLETIN))
    pool, key = _pool_with(backend, source)
    plan = _plan(source, target, key)
    shifts = {p - q for p, q in plan.pairs}
    assert len(shifts) > 1, "the edit should move some tokens"
    sp = semantic_reuse.run(backend, pool, plan, target, recompute_ratio=0.0, gap_recompute_tokens=0,
                            strict_layers=2, reserve=0, lossless_kv=True)
    n = len(target)
    k, v = backend.cache_tensors(sp.cache)
    assert k.shape[2] == n and backend.cache_len(sp.cache) == n
    src_k, src_v = pool.entry_kv(key)
    fk, fv, _ = backend.early_layers(target, 2)
    assert torch.equal(k[:2], fk) and torch.equal(v[:2], fv)
    kept = [(p, q) for p, q in plan.pairs if p not in set(_recomputed(sp, plan, n))]
    assert len(kept) == sp.reused
    new = torch.tensor([p for p, _ in kept])
    old = torch.tensor([q for _, q in kept])
    assert torch.equal(v[2:, :, new], src_v[2:, :, old])
    want = backend.rotate_keys(src_k[2:, :, old], new - old, first_layer=2)
    assert torch.allclose(k[2:, :, new].float(), want.float(), atol=1e-2, rtol=1e-2)
    same = new == old
    assert torch.equal(k[2:, :, new[same]], src_k[2:, :, old[same]])  # unmoved keys: the stored bits


def _recomputed(sp, plan, n: int) -> list[int]:
    """The positions the repair recomputed: not aligned, or (ratio 0, no gaps) none else."""
    aligned = {p for p, _ in plan.pairs}
    out = [p for p in range(n) if p not in aligned]
    assert len(out) == sp.recomputed
    return out


@pytest.mark.parametrize("edit", list(EDITS))
def test_recomputing_every_changed_token_gives_the_cold_prefill(backend, edit):
    """recompute_ratio 1: only the exact lead is kept (its KV is exact), every other token runs at its slot
    from the strict layers up: the cache and the first-token logits are a cold prefill's, bitwise on a
    batch-invariant backend (the recomputed tokens attend keys in position order, as the cold pass does)."""
    source, target = _prompts(backend, BULLETIN, EDITS[edit](BULLETIN), "Where can I park near the stadium?")
    pool, key = _pool_with(backend, source)
    plan = _plan(source, target, key)
    assert 0 < plan.exact_lead < len(plan.pairs)
    sp = semantic_reuse.run(backend, pool, plan, target, recompute_ratio=1.0, gap_recompute_tokens=2,
                            strict_layers=2, reserve=40, lossless_kv=True)
    assert sp.reused == plan.exact_lead and sp.recomputed == len(target) - plan.exact_lead
    cold_logits, cold = backend.prefill(target)
    n = len(target)
    k, v = backend.cache_tensors(sp.cache)
    ck, cv = backend.cache_tensors(cold)
    assert sp.cache.capacity >= n + 40  # the answer decodes on in place
    if backend.exact_chunking:
        assert torch.equal(sp.logits, cold_logits)
        assert torch.equal(k, ck[:, :, :n]) and torch.equal(v, cv[:, :, :n])
    assert int(sp.logits.argmax()) == int(cold_logits.argmax())


@pytest.mark.parametrize("edit", list(EDITS))
def test_an_early_pass_run_ahead_gives_the_same_repair(backend, edit):
    """The engine may run the early pass before the plan is known (semantic_reuse.ahead, while the fingerprint is
    computed), from no prefix or from the longest exact prefix the pool holds, which can end before or after the
    plan's exact lead, and read the entry it guesses the plan will take. The repair that takes them up must be
    bitwise the one that runs its own early pass and read: the same first-token logits and cache. A prefix past a
    token the repair recomputes makes the pass run again from that token; an early pass of other tokens and the
    read of another entry are not used."""
    source, target = _prompts(backend, BULLETIN, EDITS[edit](BULLETIN))
    pool, key = _pool_with(backend, source)
    _, other_cache = backend.prefill(target[:60])
    other = pool.insert(scope="s", tokens=target[:60], k=backend.cache_tensors(other_cache)[0],
                        v=backend.cache_tensors(other_cache)[1], fingerprint=np.ones(4, dtype=np.float32),
                        question="q2", context_digest="d2", answer="")
    plan = _plan(source, target, key)
    _, cold = backend.prefill(target)
    ck, cv = backend.cache_tensors(cold)
    reads = []
    entry_kv = pool.entry_kv

    def counted(k, capacity=0):
        reads.append(k)
        return entry_kv(k, capacity)
    pool.entry_kv = counted

    def repair(early=None):
        return semantic_reuse.run(backend, pool, plan, target, recompute_ratio=0.15, gap_recompute_tokens=2,
                                  strict_layers=2, reserve=8, lossless_kv=True, early=early)

    want = repair()
    wk, wv = backend.cache_tensors(want.cache)
    n = len(target)
    past_lead = plan.exact_lead + 40  # the target's own KV: bitwise what the pass computes, past the lead
    starts = {"none": None, "lead": plan.exact_lead // 2, "past the lead": past_lead}
    for name, p in starts.items():
        for guess in (key, other, None):
            prefix = None if p is None else (ck[:, :, :p].clone(), cv[:, :, :p].clone())
            early = semantic_reuse.ahead(backend, pool, target, strict_layers=2, reserve=8, prefix=prefix, guess=guess)
            reads.clear()
            got = repair(early)
            assert reads == ([] if guess == key else [key])  # the entry read ahead is taken, another read again
            k, v = backend.cache_tensors(got.cache)
            assert torch.equal(got.logits, want.logits), (name, guess)
            assert torch.equal(k[:, :, :n], wk[:, :, :n]) and torch.equal(v[:, :, :n], wv[:, :, :n]), name
            assert (got.reused, got.recomputed) == (want.reused, want.recomputed)
            assert early.early.reran == (name == "past the lead"), name  # it recomputes tokens after the lead
    elsewhere = semantic_reuse.ahead(backend, pool, source, strict_layers=2)
    got = repair(elsewhere)
    assert torch.equal(got.logits, want.logits) and not elsewhere.early.reran


@pytest.mark.parametrize("config", [LOSSLESS, {}], ids=["lossless", "float32"])
def test_the_engine_runs_the_early_pass_while_a_new_question_is_fingerprinted(config):
    """Through the engine: a new question (its fingerprint not remembered) in a scope that holds a prefix of its
    prompt, with at least min_semantic_tokens after it, runs the early pass while its fingerprint is computed; a
    SEMANTIC plan takes it up, any other plan drops it, and the answers are those with early_pass_ahead off (from a prefix where the stored KV is the
    model's own bits, bf16 here; from the first token in float32, whose KV is not). A remembered question waits
    for nothing, and nothing runs ahead."""
    from core_fixtures import BULLETIN_REVISED, capture_generations, fresh
    from simllm_ros.request import QueryRequest
    from paraphrase_pairs import select_pairs

    e = shared_engine(**config)
    _, q1, q2, _ = select_pairs(e.fingerprinter)[0]
    unlike = "How do I reset the ticket machine at the ferry pier?"
    seen = {}
    for ahead in (True, False):
        fresh(e, early_pass_ahead=ahead)
        e.handle(QueryRequest(prompt=q1, context=BULLETIN, cache_scope="s", max_new_tokens=10))
        starts, used = e.early_starts, e.early_starts_used
        out = []
        # A paraphrase on the revised bulletin (SEMANTIC: the pass ahead is used), another question on it (the
        # pass is dropped), another question on the cached bulletin (~15 tokens after the prefix: none runs).
        for q, ctx, tier in ((q2, BULLETIN_REVISED, CacheResult.SEMANTIC),
                             (unlike, BULLETIN_REVISED, CacheResult.EXACT_PREFIX),
                             ("Is the pool at the sports centre open late?", BULLETIN, CacheResult.EXACT_PREFIX)):
            e.fingerprinter.forget()
            with capture_generations(e) as gens:
                r = e.handle(QueryRequest(prompt=q, context=ctx, cache_scope="s", max_new_tokens=10,
                                          allow_approximate=True))
            assert r.success and r.cache_result == tier, (r.cache_result, r.error)
            out.append((r.answer, gens[0].tokens, r.reused_tokens, r.recomputed_tokens))
        assert (e.early_starts - starts, e.early_starts_used - used) == ((2, 1) if ahead else (0, 0))
        # Remembered: the fingerprint is there at once, so the plan does not wait and nothing runs ahead.
        e.fingerprinter.embed([q2])
        r = e.handle(QueryRequest(prompt=q2, context=BULLETIN_REVISED, cache_scope="s", max_new_tokens=4,
                                  allow_approximate=True))
        assert r.success and e.early_starts - starts == (2 if ahead else 0)
        e.pool.check_consistency()
        seen[ahead] = out
    assert seen[True] == seen[False]


def test_a_fault_in_the_early_pass_ahead_costs_only_the_head_start(monkeypatch, caplog):
    """The pass ahead is speculative: if it fails, the request is still planned and served (the repair runs its
    own early pass), the failure is logged, and the answer is the one without it."""
    from core_fixtures import BULLETIN_REVISED, fresh
    from simllm_ros.request import QueryRequest
    from paraphrase_pairs import select_pairs

    e = shared_engine(**LOSSLESS)
    _, q1, q2, _ = select_pairs(e.fingerprinter)[1]
    answers = []
    for broken in (False, True):
        fresh(e, early_pass_ahead=broken)
        e.handle(QueryRequest(prompt=q1, context=BULLETIN, cache_scope="f", max_new_tokens=8))
        if broken:
            def fail(*a, **kw):
                raise RuntimeError("no memory for the early pass")
            monkeypatch.setattr(semantic_reuse, "ahead", fail)
        starts = e.early_starts
        e.fingerprinter.forget()
        with caplog.at_level("WARNING", logger="simllm_ros.engine"):
            r = e.handle(QueryRequest(prompt=q2, context=BULLETIN_REVISED, cache_scope="f", max_new_tokens=8,
                                      allow_approximate=True))
        assert r.success and r.cache_result == CacheResult.SEMANTIC, (r.cache_result, r.error)
        assert e.early_starts == starts
        answers.append(r.answer)
        e.pool.check_consistency()
    assert "early pass ahead failed (RuntimeError: no memory for the early pass)" in caplog.text
    assert answers[0] == answers[1]
