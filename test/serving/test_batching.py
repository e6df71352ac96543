"""Continuous batching: several requests decoded in one forward pass per step give the answers they get alone.

Real model (SmolLM2 in this CPU's lossless default: bfloat16 on AMX, else float32 on the 4-bit vector
kernel), real runner, real engine, real request server thread. Claims:
- the batched forward gives every sequence bitwise the logits and KV of running it alone (ragged lengths,
  drafts, single tokens, prefill chunks), on this batch-invariant platform;
- decoders stepped together (drafts, greedy and sampled) produce the tokens of decode() one at a time;
- through the request server with max_batch > 1, every request is answered once, with the answer (and
  tier) it gets with max_batch 1, on every tier;
- a long prompt's prefill is chunked: the others decode in every step meanwhile, and a new request joins
  within one step;
- a fault in one batched request fails that request only.
"""
from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from simllm_ros.model.draft_proposer import DraftProposer
from simllm_ros.model.kv_buffer import Seq
from simllm_ros.request import CacheResult, QueryRequest
from simllm_ros.serving.request_server import RequestServer

from core_fixtures import BULLETIN, BULLETIN_REVISED, LOSSLESS, fresh, shared_engine
from draft_sources import FixedDrafts

WAIT_S = 600.0


@pytest.fixture(scope="module")
def engine():
    e = shared_engine(**LOSSLESS)
    if not e.backend.batches_exactly:
        pytest.skip("the load-time invariance probe failed on this machine: the backend runs a batch one sequence "
                    "after another")
    return e


def _ids(engine, question, context=BULLETIN):
    return engine.backend.prompt_ids(engine.settings.system_prompt, context, question)


def test_batched_forward_equals_one_at_a_time_bitwise(engine):
    b = engine.backend
    rng = random.Random(11)
    vocab = len(b.tokenizer)
    checked = singles = 0
    for trial in range(8):
        n = rng.randint(1, 6)
        prefixes = [[rng.randrange(100, vocab) for _ in range(rng.randint(1, 80))] for _ in range(n)]
        # decode steps (one token), verification passes (token + draft), prefill chunks; an empty one too
        feeds = [[rng.randrange(100, vocab) for _ in range(rng.choice([0, 1, 1, 1, 2, 5, 9, 33]))] for _ in range(n)]
        if trial == 0:
            feeds = [[7]] + [[] for _ in feeds[1:]]  # one row in the whole pass
        if not any(feeds):
            feeds[0] = [5]
        modes = [rng.choice(["all", "last", "none"]) for _ in range(n)]
        alone, together = [], []
        for p, f in zip(prefixes, feeds):
            for caches in (alone, together):
                c = b.new_cache(len(p) + len(f) + 2)
                b.run(p, c, logits="none")
                caches.append(c)
        refs = [b.runner.forward(torch.tensor(f), torch.arange(len(p), len(p) + len(f)), c, len(p), logits=m)
                if f else None for p, f, c, m in zip(prefixes, feeds, alone, modes)]
        outs = b.runner.forward_batch([Seq(torch.tensor(f, dtype=torch.long), torch.arange(len(p), len(p) + len(f)),
                                           c, len(p), m) for p, f, c, m in zip(prefixes, feeds, together, modes)])
        for i, (p, f, m) in enumerate(zip(prefixes, feeds, modes)):
            where = f"trial {trial}, sequence {i}: prefix {len(p)}, {len(f)} tokens, logits {m!r}, feeds " \
                    f"{[len(x) for x in feeds]}"
            if f and m != "none":
                assert outs[i] is not None and torch.equal(outs[i], refs[i]), where
            else:
                assert outs[i] is None, where
            end = len(p) + len(f)
            assert together[i].length == alone[i].length == end, where
            assert torch.equal(together[i].k[:, :, :end], alone[i].k[:, :, :end]), where
            assert torch.equal(together[i].v[:, :, :end], alone[i].v[:, :, :end]), where
            checked += 1
            singles += len(f) == 1
    assert singles >= 3
    print(f"\n[batched forward] {checked} sequences in 8 ragged passes bitwise equal to one at a time "
          f"({singles} single tokens)")


def test_sequences_on_one_context_share_its_kv_bitwise(engine):
    """Copies of one prefill's KV (what flights answering on one context hold): same_prefix finds the shared
    slots (by bits: a perturbed copy shares none), and a batched pass that reads them once gives every
    sequence the logits and KV it gets alone."""
    b = engine.backend
    prefix = _ids(engine, "")[:-3]
    base = b.new_cache(len(prefix) + 40)
    b.run(prefix, base, logits="none")
    feeds = [_ids(engine, q)[len(prefix):] for q in ("is elm street open", "when does the market open",
                                                    "what is the weather like")]
    feeds[1] = feeds[1] + [feeds[0][0]] * 4  # a verification-sized pass beside single-token ones

    def copies():
        out = []
        for _ in feeds:
            c = b.new_cache(len(prefix) + 40)
            c.k[:, :, :len(prefix)], c.v[:, :, :len(prefix)] = base.k[:, :, :len(prefix)], base.v[:, :, :len(prefix)]
            c.length = len(prefix)
            out.append(c)
        return out

    n = b.same_prefix(base, copies()[0], len(prefix))
    assert n == len(prefix) // 32 * 32 and n >= 64
    other = copies()[0]
    other.v[3, 1, 40, 5] += 1.0
    assert b.same_prefix(base, other, len(prefix)) == 32  # bits differ from slot 40 on: the first 32 slots remain
    other.k[0, 0, 0, 0] += 1.0
    assert b.same_prefix(base, other, len(prefix)) == 0
    alone, shared = copies(), copies()
    P = len(prefix)
    refs = [b.runner.forward(torch.tensor(f), torch.arange(P, P + len(f)), c, P, logits="all")
            for f, c in zip(feeds, alone)]
    outs = b.runner.forward_batch([Seq(torch.tensor(f), torch.arange(P, P + len(f)), c, P, "all", 0, n)
                                   for f, c in zip(feeds, shared)])
    for i in range(len(feeds)):
        assert torch.equal(outs[i], refs[i]), i
        assert torch.equal(shared[i].k[:, :, :P + len(feeds[i])], alone[i].k[:, :, :P + len(feeds[i])])


@pytest.mark.parametrize("temperature,seed", [(0.0, 0), (0.9, 5)])
def test_decoders_stepped_together_equal_decode_alone(engine, temperature, seed):
    b = engine.backend
    questions = ["is it going to rain today", "which bus line runs late tonight", "where can i get diesel",
                 "is the pharmacy open now"]
    prompts = [_ids(engine, q) for q in questions]
    max_new = 14
    plain = []
    for ids in prompts:
        logits, cache = b.prefill(ids, reserve=max_new + 40)
        plain.append(b.decode(logits, cache, max_new, temperature, seed).tokens)
    rng = random.Random(2)
    wrong = [rng.randrange(100, len(b.tokenizer)) for _ in range(40)]
    drafts = [FixedDrafts(plain[0]), FixedDrafts([], wrong), DraftProposer(prompt=prompts[2], max_tokens=8), None]
    work = []
    for ids, d in zip(prompts, drafts):
        logits, cache = b.prefill(ids, reserve=max_new + 40)
        work.append((b.decoder(logits, max_new, temperature, seed, drafts=d), cache))
    steps = widest = 0
    while any(not dec.done for dec, _ in work):
        live = [(dec, c) for dec, c in work if not dec.done]
        bases = [b.cache_len(c) for _, c in live]
        outs = b.run_batch([(dec.inputs(), c, "all") for dec, c in live])
        widest = max(widest, sum(len(dec.inputs()) for dec, _ in live))
        for (dec, c), base, rows in zip(live, bases, outs):
            b.finish_step(dec, c, base, rows)
        steps += 1
    for q, (dec, _), ref in zip(questions, work, plain):
        assert dec.gen.tokens == ref, f"{q!r}: stepped together {dec.gen.tokens} != alone {ref}"
    assert steps < sum(len(t) for t in plain)
    print(f"\n[decoders together T={temperature}] 4 answers identical to decode() alone in {steps} shared passes "
          f"(widest {widest} rows)")


class Recorder:
    """The engine as the request server calls it (request_server.ServedEngine), logging what each step did."""

    def __init__(self, engine):
        self.engine = engine
        self.settings = engine.settings
        self.prepare, self.execute = engine.prepare, engine.execute
        self.record_rejected_busy = engine.record_rejected_busy
        self.steps: list[dict] = []  # per step: request id -> (phase before, prefill tokens left, passes)
        self.begun: dict[str, int] = {}  # request id -> steps run before its begin

    def has_idle_work(self) -> bool:
        return False  # no idle work between the steps logged: they are the requests' own

    def idle_work(self) -> bool:
        return False

    def begin(self, p, on_progress=None, should_stop=None):
        self.begun[p.req.request_id] = len(self.steps)
        return self.engine.begin(p, on_progress, should_stop)

    def step(self, flights):
        def state(f):
            return ("decode" if f.decoder is not None else "prefill", f.todo,
                    f.decoder.gen.forward_passes if f.decoder is not None else 0)
        before = {f.p.req.request_id: state(f) for f in flights}
        out = self.engine.step(flights)
        after = {f.p.req.request_id: state(f) for f in flights}
        self.steps.append({"before": before, "after": after})
        return out


def _serve(engine, reqs, max_batch, recorder=None):
    rec = recorder or Recorder(engine)
    server = RequestServer(rec, state=lambda: "inactive", queue_limit=64, max_batch=max_batch)
    answered: dict[str, int] = {}
    lock = threading.Lock()

    def done(r):
        with lock:
            answered[r.request_id] = answered.get(r.request_id, 0) + 1

    server.start()
    server.open()
    try:
        jobs = [server.submit(r, done) for r in reqs]
        results = [server.wait(j) for j in jobs]
    finally:
        server.stop()
    assert answered == {r.request_id: 1 for r in reqs}, answered
    assert server.inflight == 0
    return results, rec


def _warm_and_burst():
    """(warm-up requests, burst requests): one scope per case, so the burst requests cannot see each other's
    pool entries and each one's tier depends only on its own warm-up."""
    q = dict(max_new_tokens=16)
    warm = [
        QueryRequest(prompt="is elm street open", context=BULLETIN, cache_scope="prefix", **q),
        QueryRequest(prompt="what is the weather going to be like today", context=BULLETIN, cache_scope="sem", **q),
        QueryRequest(prompt="when does the pharmacy close", context=BULLETIN, cache_scope="answer", **q),
        QueryRequest(prompt="when does the post office open", context=BULLETIN, cache_scope="drafts", **q),
    ]
    burst = [
        QueryRequest(prompt="how bad is traffic on route 9", context=BULLETIN, cache_scope="miss", request_id="miss",
                     max_new_tokens=24),
        QueryRequest(prompt="where can i buy diesel", context=BULLETIN, cache_scope="prefix", request_id="prefix",
                     allow_approximate=False, **q),
        QueryRequest(prompt="what will the weather be like today", context=BULLETIN_REVISED, cache_scope="sem",
                     request_id="semantic", **q),
        QueryRequest(prompt="when does the pharmacy close", context=BULLETIN, cache_scope="answer",
                     request_id="answer", **q),
        # the stored answer of the same question is a draft: verified in the batch, rows = token + draft
        QueryRequest(prompt="when does the post office open", context=BULLETIN, cache_scope="drafts",
                     request_id="drafts", allow_approximate=False, **q),
        QueryRequest(prompt="hi", cache_scope="short", request_id="short", max_new_tokens=1),
    ]
    return warm, burst


def test_server_with_max_batch_answers_as_one_at_a_time_on_every_tier(engine):
    warm, burst = _warm_and_burst()
    runs = {}
    for max_batch in (1, 4):
        # the memo off: an identical request would get its stored answer exactly, before the ANSWER tier
        # (test_answer_memo covers the memo under batching)
        fresh(engine, enable_answer_cache=True, answer_memo=False)
        for r in warm:
            assert engine.handle(r).success
        results, rec = _serve(engine, burst, max_batch)
        engine.pool.check_consistency()
        runs[max_batch] = (results, rec)
    fresh(engine)
    alone, batched = runs[1][0], runs[4][0]
    for r, a, b in zip(burst, alone, batched):
        assert a.success and b.success, (r.request_id, a.error, b.error)
        assert (a.cache_result, a.exact) == (b.cache_result, b.exact), r.request_id
        assert b.answer == a.answer, f"{r.request_id}: batched {b.answer!r} != one at a time {a.answer!r}"
        # Draft counts may differ: decoding together, each request's draft is capped at its share of the pass.
        assert b.generated_tokens == a.generated_tokens
    tiers = {r.request_id: b.cache_result for r, b in zip(burst, batched)}
    assert tiers["miss"] == CacheResult.MISS and tiers["prefix"] == CacheResult.EXACT_PREFIX
    assert tiers["semantic"] == CacheResult.SEMANTIC and tiers["answer"] == CacheResult.ANSWER
    drafts = batched[[r.request_id for r in burst].index("drafts")]
    assert drafts.draft_tokens_accepted > 0
    steps = runs[4][1].steps
    together = max(sum(1 for st in s["before"].values() if st[0] == "decode") for s in steps)
    assert runs[1][1].steps == [] and together >= 3, together
    print(f"\n[server max_batch 4] {len(burst)} requests ({', '.join(t.name for t in tiers.values())}) answered "
          f"once each, identical to max_batch 1; {len(steps)} steps, up to {together} decoding together")


def test_flights_on_one_context_share_it_and_answer_as_alone(engine):
    """Four exact-prefix hits on one context, decoded together: from their first decode step they read the
    context's KV once (a lead and three members, by bits), and answer as with max_batch 1."""
    reqs = [QueryRequest(prompt=q, context=BULLETIN, cache_scope="one", request_id=f"r{i}", max_new_tokens=20,
                         allow_approximate=False)
            for i, q in enumerate(("is elm street open", "when does the market open", "what is on at the library",
                                   "is it going to rain"))]
    runs, shared = {}, []

    class Sharing(Recorder):
        def step(self, flights):
            out = super().step(flights)
            shared.append(sum(1 for f in flights if f.batch.share is not None))
            return out

    for max_batch in (1, 4):
        fresh(engine)
        assert engine.handle(QueryRequest(prompt="hello", context=BULLETIN, cache_scope="one")).success
        runs[max_batch], _ = _serve(engine, reqs, max_batch, Sharing(engine))
    fresh(engine)
    for a, b in zip(runs[1], runs[4]):
        assert a.success and b.success and a.cache_result == b.cache_result == CacheResult.EXACT_PREFIX
        assert b.answer == a.answer, (b.request_id, b.answer, a.answer)
    assert max(shared) == 3, shared


def test_requests_arriving_together_prefill_their_common_start_once(engine):
    """Four questions on a bulletin no pool entry holds, sent together: the first prefills it, the other three
    wait for it and take its KV (reused tokens: the bulletin's), and every answer is the one max_batch 1 gives.
    Another scope's request never takes it (scopes are walled)."""
    qs = ("is elm street open", "when does the market open", "what is on at the library", "is it going to rain")
    reqs = [QueryRequest(prompt=q, context=BULLETIN_REVISED, cache_scope="herd", request_id=f"h{i}",
                         max_new_tokens=12, allow_approximate=False) for i, q in enumerate(qs)]
    reqs.append(QueryRequest(prompt=qs[0], context=BULLETIN_REVISED, cache_scope="other", request_id="h-other",
                             max_new_tokens=12, allow_approximate=False))
    waited = []

    class Waits(Recorder):
        def step(self, flights):
            waited.append(sum(1 for f in flights if f.batch.leader is not None))
            return super().step(flights)

    alone = {}  # one at a time, each on an empty pool
    for r in reqs:
        fresh(engine)
        alone[r.request_id] = engine.handle(r)
    fresh(engine)
    together, _ = _serve(engine, reqs, 8, Waits(engine))
    fresh(engine)
    by_id = {r.request_id: r for r in together}
    common = len(_ids(engine, qs[0], BULLETIN_REVISED)) - 12  # the start the four prompts share, about
    followers = [by_id[f"h{i}"] for i in range(1, 4)]
    for r in reqs:
        assert by_id[r.request_id].success and by_id[r.request_id].answer == alone[r.request_id].answer, r.request_id
    assert max(waited) >= 3, waited
    assert all(f.reused_tokens >= common for f in followers), [f.reused_tokens for f in followers]
    assert by_id["h-other"].reused_tokens < common and by_id["h0"].reused_tokens < common


def test_identical_requests_in_flight_are_answered_once(engine):
    """Three identical requests and another, sent together: the first of the three is decoded, the two others wait
    for its answer and take it from the answer memo (every prompt token reused, no decode pass of their own), and
    every answer is the one max_batch 1 gives each request alone. A streaming twin decodes itself."""
    q = dict(context=BULLETIN, cache_scope="twins", max_new_tokens=8, allow_approximate=False)
    reqs = [QueryRequest(prompt="is elm street open", request_id=f"t{i}", **q) for i in range(3)]
    reqs.append(QueryRequest(prompt="when does the market open", request_id="other", **q))
    alone = {}
    for r in (reqs[0], reqs[3]):  # t1 and t2 are t0's request
        fresh(engine)
        alone[r.request_id] = alone_answer = engine.handle(r)
        if r is reqs[0]:
            alone["t1"] = alone["t2"] = alone_answer
    fresh(engine)
    together, rec = _serve(engine, reqs, 8)
    for r, b in zip(reqs, together):
        assert b.success and b.exact and b.answer == alone[r.request_id].answer, (r.request_id, b.answer)
    assert [b.decode_passes for b in together[1:3]] == [0, 0] and together[0].decode_passes > 0
    assert all(b.reused_tokens == b.prompt_tokens for b in together[1:3])
    decoding = max(sum(1 for st in s["before"].values() if st[0] == "decode") for s in rec.steps)
    assert decoding == 2, decoding
    fresh(engine)
    heard = []
    streamed = QueryRequest(prompt="is elm street open", request_id="t-stream", **q)
    rec = Recorder(engine)
    server = RequestServer(rec, state=lambda: "inactive", queue_limit=8, max_batch=8)
    server.start()
    server.open()
    try:
        jobs = [server.submit(reqs[0]), server.submit(streamed, on_progress=heard.append)]
        first, second = [server.wait(j) for j in jobs]
    finally:
        server.stop()
    fresh(engine)
    assert first.answer == second.answer == alone["t0"].answer and second.decode_passes > 0 and heard


def test_long_prefill_is_chunked_and_others_decode_every_step(engine):
    fresh(engine, prefill_chunk_tokens=32, enable_drafts=False)
    rec = Recorder(engine)
    long_ctx = BULLETIN + "\n" + BULLETIN_REVISED
    a = QueryRequest(prompt="say something about the weather", cache_scope="a", request_id="a", max_new_tokens=40)
    b = QueryRequest(prompt="summarise the road closures", context=long_ctx, cache_scope="b", request_id="b",
                     max_new_tokens=4)
    ref_b = engine.handle(b)  # its answer alone (then the pool is emptied again)
    ref_a = engine.handle(a)
    engine.clear_pool()
    server = RequestServer(rec, state=lambda: "inactive", queue_limit=8, max_batch=4)
    server.start()
    server.open()
    try:
        job_a = server.submit(a)
        deadline = time.monotonic() + WAIT_S
        while len(rec.steps) < 3 and time.monotonic() < deadline:  # a is decoding
            time.sleep(0.005)
        submitted_after = len(rec.steps)
        job_b = server.submit(b)
        res_a, res_b = server.wait(job_a), server.wait(job_b)
    finally:
        server.stop()
    fresh(engine)
    assert res_a.success and res_b.success and res_a.answer == ref_a.answer and res_b.answer == ref_b.answer
    n_b = res_b.prompt_tokens
    assert n_b > 4 * 32
    # b joined within one step of its arrival, although a was in the middle of a 40-token answer
    assert rec.begun["b"] - submitted_after <= 1, (submitted_after, rec.begun["b"])
    prefill_steps = [s for s in rec.steps if s["before"].get("b", ("",))[0] == "prefill"]
    assert len(prefill_steps) == -(-n_b // 32)  # chunks of at most prefill_chunk_tokens
    for s in prefill_steps:
        assert 0 < s["before"]["b"][1] - s["after"]["b"][1] <= 32
        if "a" in s["before"] and s["before"]["a"][0] == "decode":
            assert s["after"]["a"][2] == s["before"]["a"][2] + 1, "a did not decode while b was prefilling"
    decoded_meanwhile = sum(1 for s in prefill_steps if "a" in s["before"] and s["before"]["a"][0] == "decode")
    # a decodes in every chunk's step until its own answer ends (its length is the model's, not the test's):
    # one pass per token (drafts off), the first token from its prefill
    first = prefill_steps[0]["before"].get("a")
    a_left = 0 if first is None else res_a.generated_tokens - 1 - first[2]
    assert decoded_meanwhile >= min(len(prefill_steps), a_left) - 1, (decoded_meanwhile, a_left)
    print(f"\n[chunked prefill] a {n_b}-token prompt in {len(prefill_steps)} chunks of <= 32; the other request "
          f"decoded in {decoded_meanwhile} of those steps; the new request joined {rec.begun['b'] - submitted_after} "
          f"step(s) after arriving")


class _FaultyRunner:
    """The real runner, raising when any sequence of a pass has exactly `n` tokens (one prompt's prefill)."""

    def __init__(self, inner, n):
        self._inner, self._n = inner, n
        self.raised = 0

    def _check(self, lengths):
        if self._n in lengths:
            self.raised += 1
            raise RuntimeError(f"injected fault on a {self._n}-token prefill")

    def forward(self, ids, *a, **kw):
        self._check([ids.shape[-1]])
        return self._inner.forward(ids, *a, **kw)

    def forward_batch(self, seqs):
        self._check([s.ids.shape[-1] for s in seqs])
        return self._inner.forward_batch(seqs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_a_fault_in_one_batched_request_fails_only_it(engine):
    fresh(engine, prefill_chunk_tokens=4096)
    good = [QueryRequest(prompt=p, cache_scope=f"g{i}", request_id=f"good{i}", max_new_tokens=12)
            for i, p in enumerate(["name a big cat", "what is ice made of", "count to three"])]
    refs = [engine.handle(r) for r in good]
    engine.clear_pool()
    bad = QueryRequest(prompt="explain how a fuel cell works, step by step", cache_scope="bad", request_id="bad",
                       max_new_tokens=12)
    n_bad = len(_ids(engine, bad.prompt, ""))
    assert all(len(_ids(engine, r.prompt, "")) != n_bad for r in good)
    errors0 = engine.stats()["errors_total"]
    wrapper = _FaultyRunner(engine.backend.runner, n_bad)
    engine.backend.runner = wrapper
    try:
        results, rec = _serve(engine, [good[0], bad, good[1], good[2]], max_batch=4)
    finally:
        engine.backend.runner = wrapper._inner
    by_id = {r.request_id: r for r in results}
    assert not by_id["bad"].success and by_id["bad"].error.startswith("internal error: RuntimeError: injected fault")
    for r, ref in zip(good, refs):
        assert by_id[r.request_id].success and by_id[r.request_id].answer == ref.answer, by_id[r.request_id]
    assert wrapper.raised >= 1
    assert any(len(s["before"]) >= 2 and "bad" in s["before"] for s in rec.steps), "the fault was not in a batch"
    engine.pool.check_consistency()
    assert not any(e.scope == "bad" for e in engine.pool.describe_entries())
    assert engine.stats()["errors_total"] == errors0 + 1
    fresh(engine)
