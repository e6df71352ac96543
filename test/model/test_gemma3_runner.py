"""Gemma 3 on the batch-invariant runner (issue 30, item 2): sliding-window layers with their own RoPE base, norms of
x * (1 + w) in float32, norms after attention and MLP, per-head q/k norms, GELU, the scaled embedding and
query_pre_attn_scalar. The runner must compute what transformers' own forward computes, a row's bits must not depend
on the rows beside it, and the engine's cached answers must be its empty-pool answers.

A small random-weight Gemma3ForCausalLM written by the tests (random_gemma: the embedded SmolLM2's tokenizer, read from
its GGUF; no download). Its window is 16 tokens, so every prompt below runs past it."""
from __future__ import annotations

import pytest
import torch

import random_gemma
from random_gemma import LAYER_TYPES, WINDOW, gemma_backend, write_gemma
from simllm_ros.model.llama_runner import LlamaRunner
from simllm_ros.model.kv_buffer import Seq
from simllm_ros.model.model_backend import ModelBackend


@pytest.fixture(scope="module")
def gemma_dir():
    return random_gemma.gemma_dir()


def _ids(n: int, step: int = 37, first: int = 300) -> list[int]:
    return [first + (i * step) % 40000 for i in range(n)]


def test_gelu_rows_are_the_same_alone_and_together():
    """Gemma's MLP activation (tanh GELU) on a layer's gate rows: each row's bits alone equal its bits among up to 300
    rows (torch's own call split a large one between threads where a row's tanh then took other code)."""
    import torch.nn.functional as F

    from simllm_ros.model.runner_layers import act_rows

    act = lambda x: F.gelu(x, approximate="tanh")  # noqa: E731
    for inter in (200, 512):
        gu = torch.randn(1, 300, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 3
        alone = torch.cat([act(gu[:, i:i + 1, :inter]) for i in range(300)], dim=1)
        for m in (2, 17, 64, 65, 129, 300):
            assert torch.equal(act_rows(act, gu[:, :m, :inter]), alone[:, :m]), (inter, m)


def test_the_runner_computes_what_transformers_computes():
    """float32: the runner's logits are transformers' own to rounding, same argmax, over a prompt 4x the window;
    without the window (every layer full attention) they are not, so the window is what makes them agree."""
    b = gemma_backend("float32")
    r = b.runner
    assert r is not None and LlamaRunner.supports(b.model) and b.model_type == "gemma3_text"
    assert r.windowed and r.window == [WINDOW, WINDOW, 0, WINDOW] and r.rope_of[0] != r.rope_of[2]
    assert all(p is not None for p in r.post_norms) and all(n is not None for n in r.qk_norms)
    assert r.fused is None and b.layers_kind != "c"  # the C layers do not take Gemma: Python layers
    assert b.semantic_supported and b.sliding_window == 0  # SEMANTIC too; the KV buffer keeps every token
    ids = _ids(4 * WINDOW)
    ours = b.run(ids, b.new_cache(len(ids) + 2), logits="all")
    with torch.inference_mode():
        ref = b.hf_model(torch.tensor([ids])).logits[0].float()
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max(), (ours - ref).abs().max()
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    r.window, r.windowed = [0] * len(LAYER_TYPES), False
    try:
        full = b.run(ids, b.new_cache(len(ids) + 2), logits="all")
    finally:
        r.window, r.windowed = [WINDOW, WINDOW, 0, WINDOW], True
    assert torch.equal(full[:WINDOW], ours[:WINDOW])  # within the window nothing differs
    assert (full[WINDOW:] - ref[WINDOW:]).abs().max() > 100 * (ours - ref).abs().max()


def test_bf16_is_batch_invariant_and_close_to_transformers():
    """bf16 on the attention kernel: the load-time probe passes, a row's bits are the same alone and in a batch of
    sequences of other lengths (past the window and not), and the runner is as close to float32 transformers as
    transformers' own bf16 forward is."""
    b = gemma_backend("bfloat16")
    assert b.runner is not None and b.exact_chunking, "the invariance probe must pass: reuse and drafts lossless"
    prompts = [_ids(50), _ids(9, 53, 700), _ids(33, 29, 900), _ids(1, 1, 1234)]
    alone = [b.run(p, b.new_cache(len(p) + 2), logits="all") for p in prompts]
    caches = [b.new_cache(len(p) + 2) for p in prompts]
    outs = b.runner.forward_batch([Seq(torch.tensor(p), torch.arange(len(p)), c, 0, "all")
                                   for p, c in zip(prompts, caches)])
    for p, a, o, c in zip(prompts, alone, outs, caches):
        assert torch.equal(a, o), len(p)
    # decode steps of several sequences together, each at its own length
    nxt = [[int(o[-1].argmax())] for o in outs]
    step = b.run_batch([(n, c, "last") for n, c in zip(nxt, caches)])
    for p, n, s in zip(prompts, nxt, step):
        kv = b.new_cache(len(p) + 3)
        b.run(p, kv, logits="none")
        assert torch.equal(b.run(n, kv, logits="last"), s)
    f32 = gemma_backend("float32")
    ids = prompts[0]
    with torch.inference_mode():
        ref = f32.hf_model(torch.tensor([ids])).logits[0].float()
        hf16 = b.hf_model(torch.tensor([ids])).logits[0].float()
    err_ours, err_hf = (alone[0] - ref).abs().max(), (hf16 - ref).abs().max()
    assert err_ours <= 2 * err_hf + 1e-3 * ref.abs().max(), (err_ours, err_hf)


def test_key_rotation_takes_each_layers_own_rope_table():
    """SEMANTIC repair moves stored keys with R(d): on Gemma 3 a full-attention layer's keys were rotated with the
    full layers' base and a sliding layer's with theirs, so rotate_keys must take each layer's table (first_layer
    says which layers it is given). Keys encoded by the runner's own RoPE at positions p, moved by d, equal the keys
    encoded at p + d under the right table, and not under the other."""
    b = gemma_backend("float32")
    r = b.runner
    full, sliding = LAYER_TYPES.index("full_attention"), LAYER_TYPES.index("sliding_attention")
    n, d = 40, 173
    x = torch.randn(n, r.n_kv, r.head_dim, generator=torch.Generator().manual_seed(5))  # keys before RoPE
    pos = torch.arange(30, 30 + n)
    h = torch.zeros(1, n, r.hidden)
    for li in (full, sliding):
        t = r.rope_of[li]
        at = [r.steps.rope_tables(h, p) for p in (pos, pos + d)]
        k_p, k_pd = (r.steps.rotate(x, cos[t], sin[t]).transpose(0, 1)[None] for cos, sin in at)  # [1, Hkv, n, D]
        delta = torch.full((n,), d, dtype=torch.long)
        right = b.rotate_keys(k_p, delta, first_layer=li)
        wrong = b.rotate_keys(k_p, delta, first_layer=sliding if li == full else full)
        assert (right - k_pd).abs().max() < 1e-4, li
        assert (wrong - k_pd).abs().max() > 1e-2, li
    # Several layers in one call, each on its own table
    k2 = torch.stack([r.steps.rotate(x, *(c[r.rope_of[li]] for c in r.steps.rope_tables(h, pos))).transpose(0, 1)
                      for li in range(len(LAYER_TYPES))])
    want = torch.stack([r.steps.rotate(x, *(c[r.rope_of[li]] for c in r.steps.rope_tables(h, pos + d))).transpose(0, 1)
                        for li in range(len(LAYER_TYPES))])
    assert (b.rotate_keys(k2[1:], delta, first_layer=1) - want[1:]).abs().max() < 1e-4


def test_semantic_answers_on_gemma3_are_approximate_and_reported(gemma_dir):
    """A paraphrased question over an edited context (words inserted: the later tokens move) takes the SEMANTIC tier
    when the caller allows approximate reuse: its answer is reported `exact: false` with the reused and recomputed
    counts; the same request without that permission is a lossless miss, exact. The pool stays consistent."""
    from core_fixtures import semantic_tier_is_reported
    from simllm_ros.serving.engine import Engine
    from simllm_ros.settings import Settings

    gemma_backend("bfloat16")
    e = Engine(Settings.from_overrides(model=gemma_dir["model"], model_cache_dir=gemma_dir["cache"], dtype="bfloat16",
                                       weight_bits=16, kv_bits=0, cache_size="256MB", answer_memo=False,
                                       approx_error_bound=1.0, cache_threshold=0.5))
    e.load()
    try:
        semantic_tier_is_reported(e, 2 * WINDOW)
    finally:
        e.unload()


@pytest.mark.parametrize("temperature,seed", [(0.0, 0), (0.9, 11)])
def test_engine_cached_answers_are_its_empty_pool_answers(gemma_dir, temperature, seed):
    """Exact-prefix hits past the window, a repeat served by verified drafts (memo off) and the same with sampling:
    every answer is bitwise the empty-pool answer, and exact."""
    from simllm_ros.serving.engine import Engine
    from simllm_ros.request import CacheResult, QueryRequest
    from simllm_ros.settings import Settings

    gemma_backend("bfloat16")  # loaded and probed once in this process
    e = Engine(Settings.from_overrides(model=gemma_dir["model"], model_cache_dir=gemma_dir["cache"], dtype="bfloat16",
                                       weight_bits=16, kv_bits=0, cache_size="256MB", answer_memo=False,
                                       temperature=temperature, seed=seed))
    e.load()
    try:
        assert e.backend.exact_chunking and e.backend.semantic_supported
        # Draft lengths follow the pass costs timed at load; on a busy machine those can say no draft pays, and the
        # repeat below would then decode plainly. Flat costs (a pass of m rows ~ one row) keep the drafts offered;
        # they decide only how many tokens are checked at once, never which tokens are kept.
        e.backend.pass_costs = (0.0,) + tuple(1.0 + 0.02 * m for m in range(1, 257))
        ctx = ("Robot R2 is in the east wing. The charging dock is in room 12. Corridor B is closed for cleaning "
               "until noon. The lift on level 3 is out of service; use the stairs by the kitchen.")
        qs = ["Where is the charging dock?", "Which corridor is closed?", "Where is robot R2?"]
        req = lambda q: QueryRequest(prompt=q, context=ctx, max_new_tokens=12)  # noqa: E731
        first = e.handle(req(qs[0]))
        assert first.success and first.cache_result == CacheResult.MISS and first.exact
        assert len(e.backend.prompt_ids(e.settings.system_prompt, ctx, qs[0])) > 3 * WINDOW
        served = []
        for q in qs[1:]:
            r = e.handle(req(q))
            assert r.success and r.cache_result == CacheResult.EXACT_PREFIX and r.reused_tokens > WINDOW, r
            assert r.exact
            served.append((q, r))
        again = e.handle(req(qs[0]))  # the stored answer drafted and verified
        assert again.success and again.exact and again.draft_tokens_accepted > 0, again
        served.append((qs[0], again))
        for q, r in served:
            e.pool.clear()
            m = e.handle(req(q))
            assert m.success and m.cache_result == CacheResult.MISS and m.exact
            assert m.answer == r.answer and m.answer, (q, r.cache_result)
    finally:
        e.unload()


@pytest.mark.parametrize("activation_bits", [32, 8])
def test_a_gemma3_gguf_runs_on_its_own_blocks_losslessly(tmp_path, activation_bits):
    """A Q4_K_M Gemma 3 GGUF (random blocks; every sixth layer full attention, the rest a 16-token window) as a user
    loads it: the file's own blocks on the vector kernel, the tied Q8_0 embedding looked up from the file and scaled
    as transformers scales it, the probe passing, transformers' own forward of the same file to rounding (float32
    rows; 8-bit rows into the Q4_K products: close, not to rounding: this random model amplifies their rounding at
    a few positions); a second load (no dense weights) computes the same bits."""
    from random_gguf import Q4_K_M, write_llama
    from simllm_ros.model.runner_weights import ScaledRows

    path = write_llama(str(tmp_path / "rand-gemma3.gguf"), arch="gemma3", layers=7, hidden=256, inter=512, heads=4,
                       kv_heads=1, head_dim=64, types=Q4_K_M, embed="Q8_0", output=None, seed=4,
                       sliding_window=WINDOW)
    cache = str(tmp_path / "models")
    b = ModelBackend(path, dtype="float32", weight_bits=0, cache_dir=cache, activation_bits=activation_bits)
    r = b.runner
    assert b.model_type == "gemma3_text" and b.weight_bits == 4 and r is not None and r.file is not None
    assert b.activation_bits == activation_bits
    assert r.window.count(0) == 1 and r.windowed and isinstance(r.embed, ScaledRows)
    assert b.exact_chunking and b.semantic_supported and b.layers_kind == "c"  # the C layers take Gemma 3 in float32
    ids = [int(t) for t in range(400, 400 + 3 * WINDOW * 53, 53)]
    ours = b.run(ids, b.new_cache(len(ids) + 2), logits="all")
    with torch.inference_mode():
        ref = b.hf_model(torch.tensor([ids])).logits[0].float()
    if activation_bits == 32:
        assert (ours - ref).abs().max() <= 1e-3 * ref.abs().max(), (ours - ref).abs().max()
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    else:
        assert (ours - ref).abs().median() <= 1e-2 * ref.abs().max(), (ours - ref).abs().median()
        assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75
    again = ModelBackend(path, dtype="float32", weight_bits=0, cache_dir=cache, activation_bits=activation_bits)
    assert again.skeleton and isinstance(again.runner.embed, ScaledRows)
    assert type(again.model).__module__ == "simllm_ros.model.skeleton"  # built without transformers' model classes
    assert torch.equal(again.run(ids, again.new_cache(len(ids) + 2), logits="all"), ours)
    assert again.numerics == b.numerics and again.exact_chunking


def test_a_gemma3_configs_attention_softcapping_is_left_out_as_transformers_leaves_it_out(tmp_path):
    """Gemma 3's config carries Gemma 2's attn_logit_softcapping field, which transformers' Gemma 3 attention (and
    llama.cpp's gemma3) never applies: such a model runs on the runner, without the cap, to transformers' logits
    (Gemma 2's cap, which both apply, is checked in test_gguf_formats)."""
    path = write_gemma(str(tmp_path / "capped"), attn_logit_softcapping=2.0)
    b = ModelBackend(path, dtype="float32", weight_bits=16, cache_dir=str(tmp_path / "cache"))
    assert LlamaRunner.supports(b.model) and b.runner is not None and b.runner.attn_softcap is None
    ids = _ids(4 * WINDOW)
    ours = b.run(ids, b.new_cache(len(ids) + 2), logits="all")
    b.hf_model.set_attn_implementation("eager")  # the attention that would apply a cap, had Gemma 3 one
    with torch.inference_mode():
        ref = b.hf_model(torch.tensor([ids])).logits[0].float()
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max(), (ours - ref).abs().max()


def test_what_the_runner_cannot_compute_keeps_transformers_forward(tmp_path):
    """Bidirectional attention (EmbeddingGemma's config flag) is not the runner's causal attention: such a model
    loads and answers through transformers' own forward, as an unknown architecture does, reuse approximate."""
    path = write_gemma(str(tmp_path / "bidirectional"), use_bidirectional_attention=True)
    b = ModelBackend(path, dtype="bfloat16", weight_bits=16, cache_dir=str(tmp_path / "cache"))
    assert not LlamaRunner.supports(b.model) and b.runner is None
    assert not b.exact_chunking and not b.semantic_supported and b.attention_kind == "transformers"
    logits, cache = b.prefill(_ids(2 * WINDOW))
    assert logits.shape == (b.vocab_size,) and torch.isfinite(logits).all()
