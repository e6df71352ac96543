"""Verified decoding and lossless reuse: the cache never changes an answer.

Real model (SmolLM2 in this CPU's lossless default: bfloat16 on AMX, else float32 on the 4-bit vector kernel),
real drafts, real pool. The claims:
- the backend is batch-invariant here: a token's logits and KV are bitwise the same however the
  sequence is cut into passes (this is what makes reuse and draft checking exact);
- decoding with drafts gives token for token what plain decoding gives, whatever the drafts are
  (right, wrong, partly right, longer than the answer), greedy and sampled;
- through the engine, every answer equals the answer the same request gets from an empty pool,
  with drafts from stored answers, and one-word "trap" questions never receive the other question's
  answer on the verified path.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

from simllm_ros.model.decoding import Sampler
from simllm_ros.model.draft_proposer import DraftProposer, DraftStats
from simllm_ros.request import CacheResult, QueryRequest

from core_fixtures import BULLETIN, BULLETIN_REVISED, LOSSLESS, NATIVE_BF16, clinc_by_intent, fresh, shared_engine
from draft_sources import FixedDrafts

needs_native_bf16 = pytest.mark.skipif(not NATIVE_BF16, reason="this CPU has no native bfloat16 (oneDNN's bf16 "
                                       "products are what this checks)")


@pytest.fixture(scope="module")
def engine():
    e = shared_engine(**LOSSLESS)
    if not e.backend.exact_chunking:
        pytest.skip("the load-time invariance probe failed on this machine: reuse is approximate here, and the "
                    "engine reports it so")
    return e


def _prompt(engine, question: str, context: str = BULLETIN) -> list[int]:
    return engine.backend.prompt_ids(engine.settings.system_prompt, context, question)


def _decode(engine, ids, max_new, drafts=None, temperature=0.0, seed=0):
    b = engine.backend
    logits, cache = b.prefill(ids, reserve=max_new + 40)
    return b.decode(logits, cache, max_new, temperature, seed, drafts=drafts)


def test_backend_is_batch_invariant_on_a_real_prompt(engine):
    b = engine.backend
    assert b.exact_chunking, "the load-time invariance probe failed on this machine"
    ids = _prompt(engine, "Which road is closed today, and until when?")
    whole = b.new_cache(len(ids) + 4)
    ref = b.run(ids, whole, logits="all")
    rng = random.Random(3)
    for _ in range(3):
        cuts = sorted(rng.sample(range(1, len(ids)), 5)) + [len(ids) - 1]  # the last pass: one token alone
        cache, outs, s = b.new_cache(len(ids) + 4), [], 0
        for c in sorted(set(cuts)) + [len(ids)]:
            outs.append(b.run(ids[s:c], cache, logits="all"))
            s = c
        assert torch.equal(torch.cat(outs), ref), f"logits depend on the cut {cuts}"
        k1, v1 = b.cache_tensors(cache)
        k0, v0 = b.cache_tensors(whole)
        assert torch.equal(k1, k0) and torch.equal(v1, v0), f"KV depends on the cut {cuts}"
    # The first answer token is picked from a prefill's last-token logits: same bits after any cached prefix.
    for n in (1, 2, 17, len(ids) - 1):
        cache = b.new_cache(len(ids) + 4)
        b.run(ids[:n], cache, logits="none")
        assert torch.equal(b.run(ids[n:], cache, logits="last"), ref[-1]), f"last logits after a {n}-token prefix"


def test_probe_rejects_an_attention_whose_rounding_follows_the_cut(engine, monkeypatch):
    """The load-time probe is what keeps reuse lossless on hardware nobody tested. A float32 attention for a
    bf16 model (faster here, tried and dropped) changes a real prompt's last logits after some prefixes;
    the probe must then say no. On a CPU where it changes nothing, the probe must say yes."""
    from simllm_ros.model.runner_layers import LayerSteps

    def float32_attention(self, q, k, v, blocked, first=0, causal_m=0):
        assert not causal_m  # the runner builds masks for this path (no kernel, below)
        s = torch.matmul(q.float(), k.float().transpose(-1, -2))
        if blocked is not None:
            s[..., first:].masked_fill_(blocked, float("-inf"))
        return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(v.dtype)

    b = engine.backend
    monkeypatch.setattr(LayerSteps, "attention", float32_attention)
    monkeypatch.setattr(b.runner, "kernel", None)  # the torch path's masks, which the float32 attention reads
    ids = b.prompt_ids("You are a helpful robot.", "Riverside bulletin: Elm Street closed 9-17.",
                       "Which road is closed today, and until when?")
    last = b.run(ids, b.new_cache(len(ids) + 4), logits="last")
    changed = []
    for n in list(range(1, 17)) + [len(ids) // 2, len(ids) - 1]:
        cache = b.new_cache(len(ids) + 4)
        b.run(ids[:n], cache, logits="none")
        if not torch.equal(b.run(ids[n:], cache, logits="last"), last):
            changed.append(n)
    verdict = b.invariance_probe()
    print(f"\n[probe] float32 attention: last logits changed after prefixes {changed}; probe says invariant: {verdict}")
    assert verdict == (not changed)


QUESTIONS = ["is it going to rain today", "which bus line runs late tonight", "where can i get diesel",
             "is the pharmacy open now", "how bad is traffic on route 9", "can i mail a letter today"]


@pytest.mark.parametrize("temperature,seed", [(0.0, 0), (0.9, 11)])
def test_verified_equals_plain_whatever_the_drafts(engine, temperature, seed):
    vocab = len(engine.backend.tokenizer)
    rng = random.Random(5)
    passes_plain = passes_right = 0
    for q in QUESTIONS:
        ids = _prompt(engine, q)
        plain = _decode(engine, ids, 20, temperature=temperature, seed=seed)
        assert plain.tokens, q
        t = plain.tokens
        wrong = [rng.randrange(100, vocab) for _ in range(40)]
        j = len(t) // 2
        variants = {
            "right": FixedDrafts(t),
            "all wrong": FixedDrafts([], wrong),
            "partly right": FixedDrafts(t[:j] + [(t[j] + 1) % vocab] + t[j + 1:], wrong),
            "longer than the answer": FixedDrafts(t + wrong),
            "prompt lookup": DraftProposer(prompt=ids, max_tokens=8),
            "prompt lookup, lengths by pass costs": DraftProposer(prompt=ids, max_tokens=8,
                                                                  costs=engine.backend.pass_costs, stats=DraftStats()),
        }
        for name, drafts in variants.items():
            got = _decode(engine, ids, 20, drafts=drafts, temperature=temperature, seed=seed)
            assert got.tokens == t, f"{q!r}, drafts {name}: {got.text!r} != plain {plain.text!r}"
            if name == "right":
                passes_right += got.forward_passes
                assert got.draft_accepted == got.draft_proposed
        passes_plain += plain.forward_passes
    print(f"\n[verified decoding T={temperature}] {len(QUESTIONS)} prompts x 6 draft kinds identical to plain; "
          f"decode passes with right drafts {passes_right} vs plain {passes_plain}")
    assert passes_right * 3 <= passes_plain


def test_sampler_draws_from_the_softmax():
    torch.manual_seed(0)
    logits = torch.randn(6) * 1.5
    temperature = 0.7
    probs = torch.softmax(logits / temperature, dim=-1)
    n = 6000
    counts = torch.zeros(6)
    for seed in range(n):
        counts[Sampler(temperature, seed).pick(logits, step=seed % 7)] += 1
    expected = probs * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # 5 degrees of freedom: chi2 above 20.5 happens with probability 0.001 for a correct sampler.
    assert chi2 < 20.5, (counts.tolist(), expected.tolist(), chi2)
    # ...and one (seed, step) always gives the same token, whatever else ran before.
    assert Sampler(temperature, 3).pick(logits, 4) == Sampler(temperature, 3).pick(logits, 4)


def _references(engine, requests, max_new):
    """Each request's answer from an empty pool without drafts: the model's own answer."""
    fresh(engine, enable_drafts=False, enable_semantic_reuse=False)
    out = []
    for r in requests:
        engine.clear_pool()
        res = engine.handle(r)
        assert res.success and res.cache_result == CacheResult.MISS and res.exact, res
        out.append(res.answer)
    return out


def test_engine_answers_equal_the_empty_pool_answers(engine):
    qs = clinc_by_intent(3)
    questions = ([q for q in qs["weather"][:2]] + [qs["gas"][0], qs["traffic"][0]] + [qs["weather"][0]] * 2)
    reqs = [QueryRequest(prompt=q, context=ctx, cache_scope="robot", max_new_tokens=16, allow_approximate=False,
                         request_id=str(i))
            for i, (q, ctx) in enumerate([(q, BULLETIN) for q in questions] + [(questions[0], BULLETIN_REVISED)])]
    refs = _references(engine, reqs, 16)
    fresh(engine)
    tiers, accepted = [], 0
    for r, ref in zip(reqs, refs):
        res = engine.handle(r)
        assert res.success and res.exact, res
        assert res.answer == ref, f"{r.prompt!r}: cached {res.answer!r} != empty-pool {ref!r} ({res.cache_result.name})"
        tiers.append(res.cache_result.name)
        accepted += res.draft_tokens_accepted
    repeat = engine.handle(reqs[0])
    assert repeat.answer == refs[0] and repeat.generated_tokens > 1
    assert repeat.decode_passes <= 2, f"a repeated question should be checked in one or two passes: {repeat}"
    print(f"\n[lossless engine] {len(reqs)} requests identical to empty-pool answers; tiers {tiers}; "
          f"{accepted} draft tokens accepted; repeat: {repeat.generated_tokens} tokens in {repeat.decode_passes} passes")
    assert "EXACT_PREFIX" in tiers


# One-word edits that change what the right answer is. The stored answer of the first question is a
# tempting draft for the second; verified decoding must still give the model's own answer.
TRAPS = [
    ("is the pharmacy on oak avenue open", "is the pharmacy on oak avenue unopened"),
    ("is elm street open to traffic", "is elm street not open to traffic"),
    ("how long is the drive from mill road to king street", "how long is the drive from king street to mill road"),
    ("is regular fuel under 1.60 per litre", "is regular fuel over 1.60 per litre"),
    ("will it rain within the hour", "will it rain after the hour"),
    ("is the post office open full-time today", "is the post office open part-time today"),
    ("does bus 12 run every 15 minutes", "does bus 12 run every 40 minutes"),
    ("is diesel cheaper than regular", "is diesel more expensive than regular"),
    ("is the harbour bridge fully open", "is the harbour bridge partially open"),
    ("is the station on oak avenue a legal place to stop", "is the station on oak avenue an illegal place to stop"),
]


def test_trap_pairs_get_their_own_answer(engine):
    pairs = TRAPS
    seconds = [QueryRequest(prompt=b, context=BULLETIN, cache_scope="traps", max_new_tokens=16,
                            allow_approximate=False) for _, b in pairs]
    refs = _references(engine, seconds, 16)
    fresh(engine)
    served_other = unverified_hits = 0
    for (a, b), req, ref in zip(pairs, seconds, refs):
        engine.clear_pool()
        first = engine.handle(QueryRequest(prompt=a, context=BULLETIN, cache_scope="traps", max_new_tokens=16))
        res = engine.handle(req)
        assert res.success and res.exact and res.answer == ref, (b, res.answer, ref)
        served_other += res.answer == first.answer and first.answer != ref
    # The unverified answer tier (opt-in) on the same pairs, at its defaults: measured, not asserted.
    for (a, b), ref in zip(pairs, refs):
        fresh(engine, enable_answer_cache=True)
        first = engine.handle(QueryRequest(prompt=a, context=BULLETIN, cache_scope="traps", max_new_tokens=16))
        res = engine.handle(QueryRequest(prompt=b, context=BULLETIN, cache_scope="traps", max_new_tokens=16,
                                         allow_approximate=True))
        if res.cache_result == CacheResult.ANSWER:
            assert not res.exact
            unverified_hits += res.answer != ref
    fresh(engine)
    print(f"\n[answer drafts on {len(pairs)} trap pairs] verified: 0 wrong answers served "
          f"({served_other} would have matched the other question's answer); unverified answer tier: "
          f"{unverified_hits} wrong answers served")


def test_damaged_and_foreign_draft_sources_are_harmless(engine):
    fresh(engine)
    q = "is it going to rain today"
    req = QueryRequest(prompt=q, context=BULLETIN, cache_scope="mine", max_new_tokens=16, allow_approximate=False)
    (ref,) = _references(engine, [req], 16)
    fresh(engine)
    secret = "The vault code is 4471 and the guard leaves at noon."
    fp = engine.fingerprinter.embed([q])[0]
    kv = torch.zeros(30, 3, 4, 64)
    first = _prompt(engine, q)[0]
    lead = 7 if first != 7 else 8  # these fake entries' (zero) KV must share no prefix with real prompts
    # Another scope's entry for the very same question, with a secret as its answer...
    engine.pool.insert(scope="theirs", tokens=[lead, 2, 3, 4], k=kv, v=kv, fingerprint=fp, question=q,
                       context_digest="x", answer=secret)
    # ...and damaged answers in our own scope: empty, blank, control bytes, huge, invisible-only.
    for i, junk in enumerate(["", "   ", "\x00\x01\x02" * 50, "lorem " * 2000, "\u202e\ufeff" * 30]):
        engine.pool.insert(scope="mine", tokens=[lead, 2, 3, 5 + i], k=kv, v=kv, fingerprint=fp, question=q,
                           context_digest="x", answer=junk)
    engine.pool.check_consistency()
    res = engine.handle(req)
    assert res.success and res.answer == ref, res
    drafts = engine.memory.draft_source(req, _prompt(engine, q), engine.fingerprinter.embed([q])[0], 0.0)
    secret_ids = engine.backend.tokenize_answer(secret)
    assert all(a != secret_ids for a in drafts.answers), "another scope's answer was offered as a draft"
    fresh(engine)


def test_lossless_request_is_planned_and_prefilled_before_its_fingerprint_arrives(engine):
    """A lossless request (allow_approximate false, the default) does not wait for MiniLM: it is prepared and
    planned, and its prompt prefilled, while the embedder is held busy here; its drafts, reported similarity
    and pool entry use the fingerprint once it comes, and the answer is the model's own."""
    import threading

    fresh(engine)
    fp = engine.fingerprinter
    first = QueryRequest(prompt="Is the pharmacy open today?", context=BULLETIN, cache_scope="late", max_new_tokens=12)
    assert engine.handle(first).success
    req = QueryRequest(prompt="When does the post office close today?", context=BULLETIN, cache_scope="late",
                       max_new_tokens=12, allow_approximate=False)

    def in_thread(fn, wait_s):
        box = []
        t = threading.Thread(target=lambda: box.append(fn()), daemon=True)
        t.start()
        t.join(wait_s)
        return t, box

    fp._lock.acquire()  # the embedder is busy: nothing can be fingerprinted until it is released
    try:
        t, box = in_thread(lambda: engine.prepare(req), 30)
        assert box, "prepare waited for the fingerprint"
        p = box[0]
        assert not p.fingerprints.done()
        t, box = in_thread(lambda: engine.begin(p), 30)
        assert box, "the plan waited for the fingerprint"
        f = box[0]
        assert f.plan.tier == CacheResult.EXACT_PREFIX and f.similarity_pending and f.drafts is None
        # The prefill runs now; the first token waits for the drafts, which need the fingerprint.
        stepper, out = in_thread(lambda: engine.step([f]), 5)
        assert stepper.is_alive(), "the first token waits for the fingerprint"
        assert engine.backend.cache_len(f.cache) == len(f.tokens), "the prompt is prefilled meanwhile"
    finally:
        fp._lock.release()
    stepper.join(timeout=60)
    results = out[0]
    while results[0] is None:
        results = engine.step([f])
    res = results[0]
    assert res.success and res.exact and not f.similarity_pending and f.drafts is not None
    cos = float(p.fingerprint @ fp.embed([first.prompt])[0])  # the scope's only other task
    assert 0.0 < res.similarity == pytest.approx(min(1.0, cos), abs=1e-5)
    entry = engine.pool.find("late", f.tokens)
    assert entry is not None and entry.answer == res.answer
    assert res.answer == fresh(engine).handle(req).answer


@needs_native_bf16
def test_packed_weights_are_the_model_bitwise_and_held_once():
    """weight_bits=16: the runner packs bf16 weights once for oneDNN (a decode step reads them faster) and
    the HF modules' dense copies are released; asking for the HF model unpacks them, bitwise the checkpoint's."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from simllm_ros.model.model_files import resolve_model

    engine = shared_engine(dtype="bfloat16", kv_bits=0, weight_bits=16)
    b = engine.backend
    r = b.runner
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build: weights stay dense")
    assert all(layer[i].packed is not None for layer in r.layers for i in (1, 2, 4, 5)) and r.lm_head.packed is not None
    att = b.model.model.layers[0].self_attn
    assert att.q_proj.weight.numel() == 0, "the dense copy is still held next to the packed one"
    # Same bits as F.linear on the dense weight, for a lone (padded) row and for a prefill's many rows.
    ln1, qkv, o, ln2, gate_up, down, act = r.layers[3]
    for proj in (qkv, o, gate_up, down, r.lm_head):
        w = proj.dense()
        for m in (2, 7, 64):
            x = torch.randn(1, m, w.shape[1], generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
            assert torch.equal(proj(x), F.linear(x, w)), (w.shape, m)
    ids = _prompt(engine, "is the pharmacy open now")
    before = _decode(engine, ids, 8).tokens
    path = resolve_model(engine.settings.model, engine.settings.model_cache_dir, lambda msg: None)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, local_files_only=True).state_dict()
    got = b.hf_model.state_dict()
    assert att.q_proj.weight.shape == (r.q_size, att.q_proj.in_features)
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    assert _decode(engine, ids, 8).tokens == before, "the runner answers differently once the HF weights are back"


def test_default_weights_are_the_files_own_4_bit_ones_and_reuse_stays_lossless(engine):
    """weight_bits 0 (auto, the default) picks 4 bits for the embedded model on a bf16 CPU: each group of
    32 weights becomes 16 levels of one step, and the model is a Q4_1 GGUF, so its layers already sit on
    such a grid and the 4-bit codes give the file's weights back (to a small part of a step); the LM head
    is not 4-bit (16-bit, or the file's Q8_0 codes on our kernels). A weight off that grid keeps auto at 16 bits
    (no second quantization). float32 takes 4 bits too where our vector kernel runs (its products are
    row-invariant; torch's float32 ones are not). The 4-bit kernels are row-invariant, so cached answers still
    equal the same configuration's empty-pool answers, drafts included."""
    from transformers import AutoModelForCausalLM

    from simllm_ros.model.runner_weights import INT4_GROUP, int4_codes, int4_dequantized, int4_kernel_error, \
        on_int4_grid
    from simllm_ros.model.model_files import resolve_model

    from simllm_ros.kernels import int4_vector_kernel

    f32 = shared_engine().backend
    assert f32.weight_bits == (4 if int4_vector_kernel.load() is not None else 16), "float32 auto weight bits"
    assert f32.weight_bits == 16 or f32.int4_kind == "vector"
    if engine.backend.dtype == torch.bfloat16 and int4_kernel_error() is not None:
        assert engine.backend.weight_bits == 16
        pytest.skip(int4_kernel_error())
    e4 = engine
    assert e4.settings.weight_bits == 0 and e4.backend.weight_bits == 4, "auto did not pick the file's 4 bits"
    r = e4.backend.runner
    assert all(layer[i].four_bit for layer in r.layers for i in (1, 2, 4, 5))
    if r.file is not None:  # float32 on the file's own blocks: its LM head is the file's Q8_0 codes
        assert r.lm_head.ggml == "Q8_0" and r.lm_head.bits == 8
    else:  # 16-bit, or the file's Q8_0 codes found again from the dense weights
        assert not getattr(r.lm_head, "four_bit", False) and getattr(r.lm_head, "w8", None) is None
    att = e4.backend.model.model.layers[0].self_attn
    assert att.q_proj.weight.numel() == 0, "the dense weights are still held next to the 4-bit ones"
    with pytest.raises(RuntimeError, match="4-bit"):
        r.hf_model()  # the runner cannot give dense weights back ...
    dense = e4.backend.hf_model  # ... so the backend loads a separate dense copy for reference runs
    assert dense is not e4.backend.model and dense.model.layers[0].self_attn.q_proj.weight.numel() > 0
    assert att.q_proj.weight.numel() == 0 and all(layer[1].four_bit for layer in r.layers)
    path = resolve_model(e4.settings.model, e4.settings.model_cache_dir, lambda msg: None)
    dtype = e4.backend.dtype
    sd = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).state_dict()
    w = torch.cat([sd[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv"])  # the file's fused qkv rows
    q, sz = int4_codes(w)
    deq = int4_dequantized(q, sz)
    off = (deq - w.float()).abs().reshape(w.shape[0], -1, INT4_GROUP) / sz[..., 0].float().t()[..., None]
    assert off.max() < 0.1, f"4-bit weights are {off.max():.3f} of a step away from the file's (not its Q4 grid?)"
    assert on_int4_grid(w)
    moved = w.clone()
    moved[5, 40] += 0.3 * sz[1, 5, 0]  # one weight a third of a step off its group's grid
    assert not on_int4_grid(moved), "a weight off the grid would be quantized a second time"
    assert not on_int4_grid(torch.randn(64, 128).to(dtype))
    x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(1)).to(dtype)
    want = x.float() @ deq.t()
    got = r.layers[0][1](x).float()
    assert (got - want).abs().max() <= 0.02 * want.abs().max(), "the runner's 4-bit product is not its weights'"
    assert e4.backend.exact_chunking, "the 4-bit model failed the load-time invariance probe on this CPU"
    qs = clinc_by_intent(3)
    questions = [qs["weather"][0], qs["gas"][0], qs["traffic"][0], qs["weather"][0]]
    reqs = [QueryRequest(prompt=q, context=BULLETIN, cache_scope="robot", max_new_tokens=16, allow_approximate=False,
                         request_id=str(i)) for i, q in enumerate(questions)]
    refs = _references(e4, reqs, 16)
    fresh(e4)
    tiers = []
    for req, ref in zip(reqs, refs):
        res = e4.handle(req)
        assert res.success and res.exact, res
        assert res.answer == ref, f"{req.prompt!r}: cached {res.answer!r} != empty-pool {ref!r} ({res.cache_result.name})"
        tiers.append(res.cache_result.name)
    print(f"\n[4-bit weights] {len(reqs)} answers identical to their empty-pool answers; tiers {tiers}")
    assert "EXACT_PREFIX" in tiers


def test_four_bit_weights_refuse_what_the_kernel_cannot_run():
    from simllm_ros.model.model_backend import ModelBackend
    from simllm_ros.model.model_files import ModelLoadError
    from simllm_ros.model.cache_records import default_cache_dir
    from simllm_ros.settings import DEFAULT_MODEL

    with pytest.raises(ModelLoadError, match="weight_bits=4 .*bfloat16"):
        ModelBackend(DEFAULT_MODEL, dtype="float16", cache_dir=default_cache_dir(), weight_bits=4)


def test_live_prefix_skips_the_copy_and_changes_no_answer(engine):
    """After a lossless request, the pool keeps its KV buffer as the live prefix: the next exact hit in the
    same scope decodes in it instead of copying the prefix out of the blocks. Its answer is the empty-pool
    answer; the blocks it did not read still give the same answer later; another scope, a SEMANTIC repair
    and clear_pool never hand it out."""
    qs = clinc_by_intent(3)
    q1, q2, q3 = qs["weather"][0], qs["gas"][0], qs["traffic"][0]
    req = lambda q, scope="robot", approx=False: QueryRequest(  # noqa: E731
        prompt=q, context=BULLETIN, cache_scope=scope, max_new_tokens=12, allow_approximate=approx)
    refs = _references(engine, [req(q2), req(q3)], 12)
    e = fresh(engine, enable_drafts=False, enable_semantic_reuse=False)
    assert e.lossless_reuse, "the bf16 backend failed the invariance probe on this CPU"
    pool = e.pool
    assert e.handle(req(q1)).success and pool.live_bytes > 0
    saved = pool.live_reads_saved
    r2 = e.handle(req(q2))
    assert r2.cache_result == CacheResult.EXACT_PREFIX and r2.exact and pool.live_reads_saved == saved + 1
    assert r2.answer == refs[0]
    pool.check_consistency()
    # The live buffer now holds q2's prompt; a read from the blocks (the buffer taken by another scope's
    # lookup) gives q3 the same answer the live path would.
    e.handle(req(q1, scope="elsewhere"))  # a miss in its own scope: the live buffer is now that scope's
    r3 = e.handle(req(q3))
    assert r3.cache_result == CacheResult.EXACT_PREFIX and pool.live_reads_saved == saved + 1, "crossed scopes"
    assert r3.answer == refs[1]
    e.clear_pool()
    assert pool.live_bytes == 0
    # A SEMANTIC repair's KV is approximate: it never becomes the live prefix.
    fresh(engine, enable_drafts=False)
    e.handle(req(q1))
    sem = e.handle(QueryRequest(prompt=q1, context=BULLETIN_REVISED, cache_scope="robot", max_new_tokens=4,
                                allow_approximate=True))
    assert sem.cache_result == CacheResult.SEMANTIC, sem
    sem_tokens = tuple(e.backend.prompt_ids(e.settings.system_prompt, BULLETIN_REVISED, q1))
    assert pool._live is None or pool._live.tokens != sem_tokens, "a SEMANTIC repair's KV became the live prefix"
    fresh(engine)


def test_a_lone_token_runs_as_one_row_only_where_that_is_bitwise_the_padded_pass(engine):
    """A plain decode step is one token. 16-bit oneDNN products round one row differently, so there it is
    padded to two rows; with 4-bit weights the load-time check found one row bitwise the same, and runs it
    alone. Checked here again on a real prompt, at positions the load check did not use."""
    from simllm_ros.model.kv_buffer import KVBuffer

    if NATIVE_BF16:
        e16 = shared_engine(dtype="bfloat16", kv_bits=0, weight_bits=16)
        assert not e16.backend.runner.single_rows, "16-bit products round one row differently: it must be padded"
    r = engine.backend.runner
    if engine.backend.weight_bits != 4:
        pytest.skip("weight_bits auto did not pick 4 bits here")
    assert r.single_rows, "the 4-bit int4 kernel is row-invariant on this CPU: a lone token should run alone"
    ids = torch.tensor(_prompt(engine, "is the pharmacy open now"))
    n = len(ids)
    kv = KVBuffer.allocate(len(r.layers), r.n_kv, r.head_dim, n + 4, r.dtype, "cpu")
    r.forward(ids[:n - 8], torch.arange(n - 8), kv, 0, logits="none")
    try:
        for p in range(n - 8, n):
            got = []
            for single in (True, False):
                r.single_rows = single
                kv.length = p
                out = r.forward(ids[p:p + 1], torch.tensor([p]), kv, p)
                got.append((out, kv.k[:, :, p].clone(), kv.v[:, :, p].clone()))
            assert all(torch.equal(a, b) for a, b in zip(*got)), f"position {p}: one row != padded pass"
    finally:
        r.single_rows = True


def test_onednn_is_capped_below_amx_unless_the_user_chose():
    """On AMX CPUs oneDNN's bf16 kernels round by row count (the probe fails there); llama_runner caps the ISA at
    import, but a value the user set is kept. Checked in fresh interpreters: the cap only works before oneDNN's
    first product, and this process has run many."""
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = "import os, simllm_ros.model.llama_runner as r; print(os.environ.get('ONEDNN_MAX_CPU_ISA'), r.ONEDNN_ISA_CAP)"
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")}
    got, cap = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              check=True, cwd=repo).stdout.split()
    assert got == cap == "AVX512_CORE_BF16"
    env["ONEDNN_MAX_CPU_ISA"] = "ALL"
    got, _ = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                            check=True, cwd=repo).stdout.split()
    assert got == "ALL"
