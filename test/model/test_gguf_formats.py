"""A user's GGUF (issue 30, item 1, first step): Llama-family Q4_K_M and Q8_0 files run their projections and LM head
on the float32 vector kernel at the file's own bits (gguf_weights), losslessly: the products are what the file's
blocks say (against gguf's own dequantize and a float64 product), a row's bits do not depend on the rows beside it,
the load-time invariance probe passes, and the engine's cached answers are its empty-pool answers, exact.

The files (test/gguf_files.py) have random blocks and the embedded SmolLM2's tokenizer (random_gguf): no download.
Loading and load errors: test_gguf_loading; what a file says of its architecture and RoPE: test_gguf_architectures."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from gguf_files import file_backend, ours_and_transformers
from random_gguf import blocks, write_llama
from simllm_ros.model import gguf_weights
from simllm_ros.kernels import int4_vector_kernel
from simllm_ros.model.model_backend import ModelBackend
from simllm_ros.model.model_files import ModelLoadError

KERNEL = int4_vector_kernel.load()
pytestmark = pytest.mark.skipif(KERNEL is None, reason=f"vector kernel: {int4_vector_kernel.why_not()}")


def _tensor(ggml: str, n: int, k: int, seed: int = 0):
    raw = blocks(np.random.default_rng(seed), ggml, n, k)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[ggml]).reshape(n, k)
    return gguf_weights.decode(ggml, raw, (n, k)), torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32))


@pytest.mark.parametrize("ggml", ["Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL",
                                  "IQ4_XS"])
def test_blocks_decode_to_what_gguf_dequantizes(ggml):
    n, k = 48, 512
    if ggml in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):  # gguf-py quantizes these itself
        w = np.random.default_rng(1).standard_normal((n, k)).astype(np.float32) * 0.05
        raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[ggml])
        fw = gguf_weights.decode(ggml, raw, (n, k))
        ref = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[ggml]).reshape(n, k).copy())
    else:
        fw, ref = _tensor(ggml, n, k)
    assert torch.equal(fw.dequantized(), ref)  # bit for bit: the kernel's step * code + base is the file's weight
    assert fw.kind == gguf_weights.KINDS[ggml]


@pytest.mark.parametrize("ggml", ["Q3_K", "Q4_K", "Q6_K", "Q8_0", "Q5_0", "IQ4_NL", "IQ4_XS"])
def test_products_are_the_files_weights_and_row_invariant(ggml):
    n, k = 96, 768
    fw, w = _tensor(ggml, n, k, seed=3)
    kind, blob, outs = fw.pack(KERNEL)
    mm = KERNEL.product(kind)
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(5))
    whole = mm(x, blob, outs)
    want = x.double() @ w.double().t()
    assert (whole.double() - want).abs().max() <= 2e-5 * want.abs().max()  # float32 sums of ~800 terms
    for r0, r1 in ((0, 1), (1, 3), (3, 7), (7, 30), (30, 37), (5, 6)):  # one-row and buffered paths
        assert torch.equal(mm(x[r0:r1].contiguous(), blob, outs), whole[r0:r1]), (ggml, r0, r1)
    if ggml == "Q4_K":  # its own layout (4.75 bits a weight) computes the bits of the 4-bit blob of its steps and bases
        assert kind == "q4k" and blob.numel() * 8 / (n * k) == 4.75
        assert torch.equal(whole, KERNEL.mm(x, KERNEL.pack_affine(fw.codes, fw.step, fw.base), outs))


@pytest.mark.parametrize("ggml,kind,bits", [("Q3_K", "q3k8", 4.625), ("Q4_K", "q4k8", 4.5), ("Q5_K", "q5k8", 5.5),
                                           ("Q6_K", "q6k8", 6.625), ("Q8_0", "q8r", 8.5), ("Q5_0", "q5r", 5.5),
                                           ("Q4_0", "q4r", 4.5), ("IQ4_NL", "iq4r", 4.5), ("IQ4_XS", "iq4xs", 4.3125),
                                           ("Q5_1", "q51r", 6.0)])
def test_k_quants_on_8bit_rows_are_the_files_weights_times_the_quantized_rows_and_row_invariant(ggml, kind, bits):
    """activation_bits 8: the integer product is exactly (to float32 rounding of its few float steps) the file's
    weights times the rows as quantized (int4_vector_kernel.rows_as_8bit), one row alone or among others; against
    float32 rows it differs by the rows' rounding to 8 bits, about a percent of the largest output here."""
    n, k = 96, 768
    fw, w = _tensor(ggml, n, k, seed=3)
    got_kind, blob, outs = fw.pack(KERNEL, int8_rows=True)
    assert got_kind == kind and blob.numel() * 8 / (n * k) == bits
    mm = KERNEL.product(kind)
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(5))
    x[4] = 0  # a row of zeros: scale 0, codes 0
    x[6, 5] = 1e4  # an outlier takes its block's range
    whole = mm(x, blob, outs)
    want = int4_vector_kernel.rows_as_8bit(x, 32 if kind in ("q8r", "q5r", "q51r", "q4r", "iq4r", "iq4xs") else 256) \
        @ w.double().t()
    assert (whole.double() - want).abs().max() <= 2e-6 * want.abs().max()
    assert torch.equal(whole[4], torch.zeros(n))
    for r0, r1 in ((0, 1), (1, 3), (3, 7), (7, 30), (30, 37), (5, 6), (6, 11)):
        assert torch.equal(mm(x[r0:r1].contiguous(), blob, outs), whole[r0:r1]), (r0, r1)
    exact = x.double() @ w.double().t()
    rows = [r for r in range(37) if r != 6]
    assert (whole.double() - exact)[rows].abs().max() <= 0.03 * exact[rows].abs().max()


def test_iq4_nl_on_its_table_product_computes_the_8bit_products_bits():
    """IQ4_NL's indices looked up in registers (4.5 bits a weight) give bitwise Q8_0's product of the table's values
    with the same float16 scales (8.5 bits): one number per weight either way, and the same integer sums and float
    steps."""
    fw, _ = _tensor("IQ4_NL", 64, 512, seed=7)
    x = torch.randn(11, 512, generator=torch.Generator().manual_seed(2))
    kind, blob, outs = fw.pack(KERNEL, int8_rows=True)
    assert kind == "iq4r"
    assert torch.equal(KERNEL.mmiq4r(x, blob, outs), KERNEL.mm8r(x, KERNEL.pack_q8r(fw.codes, fw.step), outs))
    with pytest.raises(ValueError, match="table values"):
        KERNEL.pack_iq4r(fw.codes.clamp(-100, 100), fw.step)  # -127 and 113 clamped: not the table's


def test_iq4_xs_keeps_its_sub_scales_and_computes_the_bits_of_its_scales_per_32():
    """IQ4_XS at the file's sub-scales and d (4.3125 bits a weight; it was 5 with a float32 scale per 32): the kernel
    works out d * (sub-scale - 32) exactly, so the bits are those of the table product given that float32 scale per
    32, which float16 cannot hold (the IQ4_NL product where it can: sub-scales of 1). Bad sub-scales are refused."""
    fw, w = _tensor("IQ4_XS", 64, 512, seed=9)
    x = torch.randn(11, 512, generator=torch.Generator().manual_seed(4))
    kind, blob, outs = fw.pack(KERNEL, int8_rows=True)
    assert kind == "iq4xs" and blob.numel() * 8 / w.numel() == 4.3125
    sub, d = fw.raw
    assert torch.equal(d.repeat_interleave(8, dim=1) * sub.float(), fw.step)  # the file's scales, exactly
    want = int4_vector_kernel.rows_as_8bit(x, 32) @ w.double().t()
    got = KERNEL.mmiq4xs(x, blob, outs)
    assert (got.double() - want).abs().max() <= 2e-6 * want.abs().max()
    ones = KERNEL.pack_iq4xs(fw.codes, torch.ones_like(sub), d)
    assert torch.equal(KERNEL.mmiq4xs(x, ones, outs),
                       KERNEL.mmiq4r(x, KERNEL.pack_iq4r(fw.codes, d.repeat_interleave(8, dim=1)), outs))
    with pytest.raises(ValueError, match="-32..31"):
        KERNEL.pack_iq4xs(fw.codes, sub + 40, d)
    with pytest.raises(ValueError, match="float16"):
        KERNEL.pack_iq4xs(fw.codes, sub, d * (1 + 2 ** -20))


def test_a_projection_of_mixed_parts_is_each_parts_product():
    """q/k in Q4_K and v in Q6_K fused into one projection: each output block is bitwise its own part's product."""
    from simllm_ros.model.runner_weights import file_parts, Proj

    pieces = [_tensor("Q4_K", 64, 512, 1), _tensor("Q4_K", 32, 512, 2), _tensor("Q6_K", 32, 512, 3)]
    proj = Proj(None, None, 4, KERNEL, parts=file_parts([fw for fw, _ in pieces], KERNEL))
    assert proj.kinds == "q4k+q6" and len(proj.parts) == 2 and proj.n == 128
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(0))
    y = proj(x)
    alone = torch.cat([KERNEL.product(fw.kind)(x, fw.pack(KERNEL)[1], fw.codes.shape[0]) for fw, _ in pieces], 1)
    assert torch.equal(y, alone)
    assert torch.equal(proj.columns(x, 80, 112), y[:, 80:112])  # across the Q4_K / Q6_K boundary


@pytest.mark.parametrize("name,activation_bits,layer_kinds,head", [
    ("q4_k_m", 0, [["q4k8+q6k8", "q4k8", "q4k8", "q6k8"], ["q4k8", "q4k8", "q4k8", "q6k8"]], "Q6_K"),
    ("q4_k_m", 32, [["q4k+q6", "q4k", "q4k", "q6"], ["q4k", "q4k", "q4k", "q6"]], "Q6_K"),
    ("q8_0", 0, [["q8r", "q8r", "q8r", "q8r"]] * 2, "Q8_0"),
    ("q8_0", 32, [["q8", "q8", "q8", "q8"]] * 2, "Q8_0"),
    ("q5_0", 0, [["q5r+q8r", "q5r", "q5r", "q6k8"]] * 2, "Q8_0"),
    ("q4_0", 0, [["q4r", "q4r", "q4r", "q4r"]] * 2, "Q8_0"),
    ("q4_k_s", 0, [["q4k8+q5k8", "q4k8", "q4k8", "q5k8"], ["q4k8", "q4k8", "q4k8", "q4k8"]], "Q6_K"),
    ("q3_k_m", 0, [["q3k8+q5k8", "q4k8", "q3k8", "q4k8"], ["q3k8+q51r", "q4k8", "q3k8", "q3k8"]], "Q6_K"),
    ("iq4_xs", 0, [["iq4xs+q5k8", "iq4xs", "iq4xs", "iq4xs"], ["iq4xs+iq4r", "iq4xs", "iq4xs", "iq4xs"]], "Q6_K"),
])
def test_the_file_runs_on_its_own_blocks_losslessly(files, name, activation_bits, layer_kinds, head):
    b = file_backend(files, name, activation_bits)
    r = b.runner
    assert b.weight_bits == 4 and b.int4_kind == "vector" and r.file is not None  # weight_bits auto picked it
    int8_kinds = ("q3k8", "q4k8", "q5k8", "q8r", "q5r", "q4r", "iq4r", "iq4xs")
    assert b.activation_bits == (8 if layer_kinds[0][1] in int8_kinds else 32)
    assert ("integer dot products" in b.int4_path) == (b.activation_bits == 8)
    assert [[p.kinds for p in (qkv, o, gu, down)] for _, qkv, o, _, gu, down, _ in r.layers] == layer_kinds
    assert r.lm_head.ggml == head and head in b.int4_path and "on the file's own blocks" in b.int4_path
    assert b.layers_kind == "c"
    assert b.exact_chunking, "the invariance probe must pass: reuse and drafts lossless"
    # The C layers and the Python layers (each part's product from Python) compute the same bits.
    ids = [int(t) for t in range(300, 300 + 13 * 31, 31)]
    c = b.run(ids, b.new_cache(16), logits="all")
    r.layers_in_c = False
    try:
        py = b.run(ids, b.new_cache(16), logits="all")
    finally:
        r.layers_in_c = True
    assert torch.equal(c, py)
    assert torch.isfinite(c).all()


def test_auto_dtype_runs_k_quant_files_at_their_own_bits_on_amx_too(files):
    """dtype auto: bf16 on an AMX CPU is for the AMX kernel's 4-bit groups of 32 (Q4_0/Q4_1 projections); a file of
    K-quants, Q8_0 or IQ4 would be dequantized to 16 bits there, so it takes float32 and the vector kernel at the
    file's own bits, as on every other CPU."""
    from simllm_ros.kernels import int4_kernel
    from simllm_ros.model.model_backend import auto_dtype, native_bf16

    amx = native_bf16() and int4_kernel.load() is not None
    for name in ("q4_k_m", "q8_0", "q3_k_m", "iq4_xs", "phi3"):
        dtype, why = auto_dtype("cpu", files[name])
        assert dtype == "float32" and (not amx or "at their own bits on our vector kernel" in why), (name, why)
    assert auto_dtype("cpu", files["q4_0"])[0] == ("bfloat16" if amx else "float32")  # the AMX kernel's own
    assert auto_dtype("cpu", None)[0] == ("bfloat16" if amx else "float32")


def test_q5_k_blocks_with_float32_rows_are_a_clear_load_error(files):
    """Q5_K has a product with 8-bit rows only: a Q4_K_S file asked for float32 rows is refused with the reason."""
    with pytest.raises(ModelLoadError, match="Q5_K blocks run on rows quantized to 8 bits only"):
        ModelBackend(files["q4_k_s"], dtype="float32", weight_bits=0, activation_bits=32,
                     cache_dir=files["cache"] + "-f32")


@pytest.mark.parametrize("activation_bits", [0, 32])
def test_the_head_is_the_files_weights(files, activation_bits):
    """The Q6_K LM head's logits against a float64 product of gguf's dequantized output.weight (and of the rows as
    quantized to 8 bits, where they are)."""
    b = file_backend(files, "q4_k_m", activation_bits)
    t = next(t for t in gguf.GGUFReader(files["q4_k_m"]).tensors if t.name == "output.weight")
    w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
    x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(2))
    got = b.runner.lm_head(x).double()
    rows = int4_vector_kernel.rows_as_8bit(x) if b.activation_bits == 8 else x.double()
    assert b.activation_bits == (32 if activation_bits == 32 else 8)
    want = rows @ w.double().t()
    assert (got - want).abs().max() <= 2e-5 * want.abs().max()


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "smollm3", "phi3", "gemma2"])
def test_qwen_smollm3_phi3_and_gemma2_files_run_on_their_own_blocks_as_transformers_computes_them(files, name):
    """Qwen2 (q/k/v biases), Qwen3 (per-head q/k norms before RoPE, head_dim 128 beside a hidden size of 256),
    SmolLM3 (NoPE layers; transformers' GGUF reader refuses the file, its dense copy is ours), Phi-3 (fused q/k/v
    and gate/up tensors, taken as views of their rows) and Gemma 2 (soft-capped attention scores and logits, sliding
    layers): the runner at the file's own bits, lossless, and what it computes is what transformers' own forward of
    the same file computes (float32 rows, to rounding: the arithmetic is ours, the model the same)."""
    b = file_backend(files, name, activation_bits=32)
    assert b.model_type == name and b.weight_bits == 4 and b.runner.file is not None and b.exact_chunking
    assert b.semantic_supported
    if name == "qwen3":
        assert all(n is not None for n in b.runner.qk_norms)
    if name == "smollm3":
        assert [b.runner.rope_types[r] for r in b.runner.rope_of] == [None, None, None, "no_rope"]
    if name == "gemma2":  # the file's caps, one RoPE table, layers 0 and 2 sliding
        assert (b.runner.attn_softcap, b.runner.softcap, b.runner.rope_types) == (20.0, 10.0, [None])
        assert b.runner.window == [16, 0, 16, 0] and b.config.query_pre_attn_scalar == 64
        assert b.hf_model.config._attn_implementation == "eager"  # sdpa drops the cap (transformers 5.20.2's pick)
    assert b.layers_kind == "c"  # the float32 C layers take the biases and the q/k norms
    ids = [int(t) for t in range(400, 400 + 17 * 53, 53)]
    ours, ref = ours_and_transformers(b, ids)
    assert (ours - ref).abs().max() <= 1e-3 * ref.abs().max(), (ours - ref).abs().max()
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    if name in ("smollm3", "phi3", "gemma2"):
        assert type(b.hf_model).__name__ == {"smollm3": "SmolLM3", "phi3": "Phi3", "gemma2": "Gemma2"}[name] + \
            "ForCausalLM"
    if name == "gemma2":  # the caps matter here: without them the runner computes another model
        b.runner.steps.attn_softcap, b.runner.fused.softcap = None, 0.0
        try:
            assert (b.run(ids, b.new_cache(20), logits="all") - ref).abs().max() > 0.1 * ref.abs().max()
        finally:
            b.runner.steps.attn_softcap, b.runner.fused.softcap = 20.0, 20.0
        # bf16 (AMX CPUs' default): transformers' Gemma2 classes on the runner, the invariance probe passed, and as
        # close to the float32 model as transformers' own bf16 forward is (its bf16 tanh is coarser)
        bf = ModelBackend(files[name], dtype="bfloat16", weight_bits=16, cache_dir=files["cache"] + "-bf16")
        assert bf.runner is not None and bf.runner.attn_softcap == 20.0 and bf.exact_chunking
        with torch.inference_mode():
            theirs = bf.hf_model(torch.tensor([ids])).logits[0].float()
        assert (bf.run(ids, bf.new_cache(20), logits="all") - ours).abs().max() < (theirs - ours).abs().max()
    if name == "phi3":  # a later load reads the skeleton beside that dense copy (its fused projections skipped)
        again = ModelBackend(files[name], dtype="float32", weight_bits=0, activation_bits=32,
                             cache_dir=files["cache"] + "-f32")
        assert again.skeleton and torch.equal(again.run(ids, again.new_cache(20), logits="all"), ours)


def test_an_iq4_xs_file_runs_on_its_own_blocks_as_transformers_computes_it(tmp_path):
    """IQ4_XS projections (and an IQ4_NL attn_v, its fallback) on float32 rows: what the runner computes from the
    file's table indices and sub-scales is what transformers' forward of the same file computes, to rounding."""
    from random_gguf import write_llama

    path = write_llama(str(tmp_path / "rand-iq4_xs-f32.gguf"), default="IQ4_XS", embed="IQ4_XS", seed=15,
                       per_layer={(1, "attn_v"): "IQ4_NL"})
    b = ModelBackend(path, dtype="float32", weight_bits=0, cache_dir=str(tmp_path / "models"), activation_bits=32)
    assert b.runner.file is not None and b.exact_chunking and b.layers_kind == "c"
    assert {p.kinds for _, qkv, o, _, gu, down, _ in b.runner.layers for p in (qkv, o, gu, down)} == {"q8"}
    ids = [int(t) for t in range(400, 400 + 17 * 53, 53)]
    ours, ref = ours_and_transformers(b, ids)
    assert (ours - ref).abs().max() <= 1e-3 * ref.abs().max(), (ours - ref).abs().max()
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_semantic_answers_on_a_gemma2_file_are_approximate_and_reported(files):
    """Gemma 2's SEMANTIC repair (early passes and recomputed tokens attend with its soft-capped scores, windows on
    sliding layers): a paraphrased question over an edited context takes the SEMANTIC tier where the caller allows
    approximate reuse, reported `exact: false` with its reused and recomputed counts; without that permission the
    same request is lossless. The pool stays consistent."""
    from core_fixtures import semantic_tier_is_reported
    from simllm_ros.serving.engine import Engine
    from simllm_ros.settings import Settings

    file_backend(files, "gemma2")
    e = Engine(Settings.from_overrides(model=files["gemma2"], model_cache_dir=files["cache"], dtype="float32",
                                       weight_bits=0, cache_size="256MB", answer_memo=False, approx_error_bound=1.0,
                                       cache_threshold=0.5))
    e.load()
    try:
        assert e.backend.semantic_supported and e.backend.runner.attn_softcap == 20.0
        semantic_tier_is_reported(e, 32)
    finally:
        e.unload()


def test_smollm3s_nope_layers_keep_their_keys_when_semantic_repair_moves_them(files):
    """SEMANTIC repair moves cached keys to new positions by rotating them with each layer's RoPE; a NoPE layer's
    keys carry no position, so they stay as they are, and the other layers' turn as RoPE says."""
    b = file_backend(files, "smollm3", activation_bits=32)
    k = torch.randn(4, 2, 5, 64, generator=torch.Generator().manual_seed(0))
    delta = torch.tensor([1, 2, 3, 4, 5])
    moved = b.rotate_keys(k, delta)
    assert torch.equal(moved[3], k[3])
    assert not torch.allclose(moved[:3], k[:3])
    assert torch.allclose(b.rotate_keys(moved, -delta)[:3], k[:3], atol=1e-5)
    assert torch.equal(b.rotate_keys(k[3:], delta, first_layer=3), k[3:])


@pytest.mark.parametrize("name", ["q4_k_m", "q4_k_s", "q3_k_m", "iq4_xs", "qwen3", "smollm3", "phi3", "gemma2",
                                  "gemma3-270m"])
def test_engine_cached_answers_are_its_empty_pool_answers(files, name):
    """Greedy and seeded sampled answers with the cache are the empty pool's, exact, on random Llama (Q4_K_M, Q4_K_S)
    / Qwen3 / SmolLM3 / Phi-3 / Gemma 2 files and the real Gemma 3 270M Q4_K_M file (converted a tensor at a time: its
    first load)."""
    from simllm_ros.serving.engine import Engine
    from simllm_ros.request import CacheResult, QueryRequest
    from simllm_ros.settings import Settings

    if files[name] is None:
        pytest.skip("the Gemma 3 270M packages are not installed (requirements-models.txt)")
    file_backend(files, name)  # loaded (converted, probed) once in this process
    e = Engine(Settings.from_overrides(model=files[name], model_cache_dir=files["cache"], dtype="float32",
                                       weight_bits=0, kv_bits=32, cache_size="256MB", enable_semantic_reuse=False))
    e.load()
    try:
        assert e.backend.exact_chunking and e.backend.runner.file is not None
        ctx = "Robot R2 is in the east wing. The charging dock is in room 12. Corridor B is closed for cleaning."
        qs = ["Where is the charging dock?", "Which corridor is closed?", "Where is robot R2?"]
        sampled = {"temperature": 0.9, "seed": 11}  # the third question: seeded sampling
        req = lambda q: QueryRequest(prompt=q, context=ctx, max_new_tokens=10,  # noqa: E731
                                     **(sampled if q == qs[2] else {}))
        assert e.handle(req(qs[0])).success
        cached = []
        for q in qs[1:]:
            r = e.handle(req(q))
            assert r.success and r.cache_result == CacheResult.EXACT_PREFIX and r.reused_tokens > 0, r
            assert r.exact
            cached.append(r)
        for q, r in zip(qs[1:], cached):
            e.pool.clear()
            m = e.handle(req(q))
            assert m.success and m.cache_result == CacheResult.MISS and m.exact
            assert m.answer == r.answer and m.answer
    finally:
        e.unload()
