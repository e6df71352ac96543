"""A GGUF's first conversion one tensor at a time: the copy a skeleton load reads (config, tokenizer, the
float tensors the runner keeps in Python: norms, biases) and the check that every projection is the file's own
blocks (gguf_weights.Rows), without the dense model ever in memory.

Why: transformers' GGUF load dequantizes the whole model to float32 (~4x the file) and the check then compared
every projection against it, so a first load peaked at 5.3 GB for a 0.5B Q4_K_M and 10.2 GB for a 1.5B one: more
than an 8 GB robot computer has (the real Gemma 3 270M Q4_K_M: 4.0 GB). Here each tensor is dequantized as
transformers' loader does it (gguf's `dequantize`, then transformers' per-architecture processing: Llama's q/k row
order, Gemma's norm offset), compared bit for bit with our decoding of the same bytes, and dropped; the token
embedding and LM head in slices of rows.
Nothing runs on a tensor that was not checked: where any projection is not the file's own (a format our kernels do
not take, other values) this returns None and the caller converts the whole model as before.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from . import gguf_checks, gguf_weights, skeleton
from .llama_runner import LlamaRunner
from .gguf_blocks import DECODED
from .gguf_weights import KINDS, PROJECTIONS, Rows, Tensor

# transformers' tensor processors are keyed by the GGUF architecture; the model types the runner takes map to these
_GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
              "gemma3_text": "gemma3",
              "smollm3": "llama",  # llama.cpp's converter writes SmolLM3's q/k rows in Llama's order
              "phi3": "phi3"}  # its q/k rows as transformers has them (llama.cpp rotates them NEOX-style)
SAMPLE_ROWS = 64  # rows of each projection, embedding and LM head compared with gguf's dequantization


# Llama 3.1-3.3's RoPE scaling parameters besides its factor (every release has these); llama.cpp's converter bakes
# them into the rope_freqs.weight tensor, and they are read back from it by checking these give its values
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def complete_config(cfg, meta: dict, tensors: dict[str, Tensor]) -> None:
    """Sets in `cfg` what the file says (its metadata `meta`, its tensors) and transformers' GGUF reader drops, as
    llama.cpp reads it: without it a Llama 3.2 or Gemma 3 4B file would run with plain RoPE, another model than the
    file's (Llama 3.2 1B: 15 of 32 frequencies turning up to 32x too fast). RoPE: linear scaling
    ({arch}.rope.scaling.*; Gemma 3: its full-attention layers, as llama.cpp applies it) and Llama 3.1+'s scaling,
    which llama.cpp's converter writes as per-frequency divisors (`rope_freqs.weight`), read back by checking that
    llama3 scaling with LLAMA3_ROPE gives them, and YaRN (long-context Qwen files); GGUFError for any other scaling
    (a clear refusal, not a silently different model). Gemma 2's and 3's attention scale: 1/sqrt(head_dim) as
    llama.cpp has it (the 27B's hidden/heads aside), where transformers would take its config default (256), which
    only equals head_dim in the releases whose heads are 256 wide; Gemma 2's soft-capping of attention scores and
    logits from the file's keys, where transformers keeps its defaults (50 and 30, the released models' values)."""
    arch = meta.get("general.architecture", "")
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = float(meta.get(f"{arch}.rope.scaling.factor", 1.0)) or 1.0  # 0: none, as llama.cpp reads it
    gemma = cfg.model_type == "gemma3_text"
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    if cfg.model_type == "gemma2":
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if f"{arch}.{name}" in meta:
                setattr(cfg, name, float(meta[f"{arch}.{name}"]) or None)
    if kind == "linear" and factor != 1.0:
        if gemma:
            params["full_attention"] = {**params["full_attention"], "rope_type": "linear", "factor": factor}
        else:
            params.update(rope_type="linear", factor=factor)
        cfg.rope_parameters = params
    elif kind == "yarn" and factor > 1.0 and not gemma:
        params.update(_yarn(arch, meta, factor, cfg.max_position_embeddings))
        cfg.rope_parameters = params
    elif kind not in ("none", "linear") and not (kind == "yarn" and factor <= 1.0):
        raise gguf_weights.GGUFError(f"RoPE scaling '{kind}' ({arch}.rope.scaling.type) in a {cfg.model_type} file is "
                                     "not supported yet: running the file without it would compute another model")
    _llama3_rope(cfg, tensors.get("rope_freqs.weight"))
    _longrope(cfg, meta, tensors)
    _rotated_part(cfg, meta)
    if cfg.model_type in skeleton.GEMMA:  # llama.cpp's rule: the 27Bs (Gemma 2: 46 layers, 3: 62) scale by
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads  # hidden / heads
        cfg.query_pre_attn_scalar = cfg.hidden_size // cfg.num_attention_heads \
            if cfg.num_hidden_layers == (62 if gemma else 46) else head_dim


def _longrope(cfg, meta: dict, tensors: dict[str, Tensor]) -> None:
    """LongRoPE (Phi-3.5-mini, Phi-3 128k, Phi-4-mini files), which transformers' GGUF reader drops: per-frequency
    divisors for short contexts and for long ones (`rope_factors_short` / `_long`), and cos/sin scaled by
    `rope.scaling.attn_factor`. llama.cpp takes the short ones while its context is within the original
    (`rope.scaling.original_context_length`); so does this package, whose table is fixed at load: the backend refuses
    positions past the original context (ModelBackend.max_positions), where llama.cpp would turn to the long ones.
    GGUFError for a file with one set only, or factors not one per frequency."""
    arch = meta.get("general.architecture", "")
    found = {w: tensors.get(f"rope_factors_{w}.weight") for w in ("short", "long")}
    if not any(found.values()):
        return
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rotated = int(meta.get(f"{arch}.rope.dimension_count") or head_dim)
    if any(t is None or t.ggml != "F32" or tuple(t.shape) != (rotated // 2,) for t in found.values()):
        raise gguf_weights.GGUFError(f"LongRoPE factors in a {arch} file that are not a float32 pair (short, long) of "
                                     f"{rotated // 2} per head: not LongRoPE as llama.cpp reads it")
    key = f"{arch}.rope.scaling."
    original = int(meta.get(key + "original_context_length") or meta.get(f"{arch}.context_length")
                   or cfg.max_position_embeddings)
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    params.update(rope_type="longrope", original_max_position_embeddings=original,
                  attention_factor=float(meta.get(key + "attn_factor", 1.0)),
                  **{f"{w}_factor": [float(v) for v in t.read().view(np.float32)] for w, t in found.items()
                     if t is not None})
    cfg.rope_parameters = params
    cfg.original_max_position_embeddings = original  # Phi3Config's own field, which its RoPE check reads


def _rotated_part(cfg, meta: dict) -> None:
    """RoPE on a part of each head (`rope.dimension_count` below the head's width: Phi-4-mini's 96 of 128), which
    transformers' GGUF reader drops: set as the config's partial_rotary_factor for Phi-3 files, whose classes and our
    runner rotate the first dimensions in pairs (d, d + rotated / 2), as llama.cpp does; GGUFError for other
    architectures or a count that is not an even part of the head. Dropped, it would be another model."""
    arch = meta.get("general.architecture", "")
    rotated = meta.get(f"{arch}.rope.dimension_count")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    params = getattr(cfg, "rope_parameters", None)
    if rotated is None or int(rotated) == skeleton.rope_dims(cfg):
        return
    if cfg.model_type != "phi3" or not isinstance(params, dict) or int(rotated) % 2 or not 0 < int(rotated) < head_dim:
        raise gguf_weights.GGUFError(f"{arch}.rope.dimension_count {rotated} of heads {head_dim} wide: RoPE on part "
                                     "of each head is not supported yet for this file (running every dimension "
                                     "rotated would compute another model)")
    cfg.rope_parameters = {**params, "partial_rotary_factor": int(rotated) / head_dim}
    cfg.partial_rotary_factor = int(rotated) / head_dim


# YaRN's settings besides factor, base and original context that llama.cpp reads from some files (DeepSeek's attention
# factors and log multiplier); a file with any of them set otherwise is refused rather than run as another model
_YARN_DEFAULTS = {"attn_factor": 1.0, "yarn_ext_factor": 1.0, "yarn_attn_factor": 1.0, "yarn_log_multiplier": 0.0}


def _yarn(arch: str, meta: dict, factor: float, context: int) -> dict:
    """YaRN as llama.cpp runs a file that says `{arch}.rope.scaling.type` yarn (Qwen2.5 / Qwen3 files made for long
    contexts): frequencies between interpolation (/ factor) and extrapolation on a ramp over the dimensions that
    turn beta_slow..beta_fast times in the original context, and cos/sin scaled by 1 + 0.1 ln(factor); the same
    formulas transformers' "yarn" RoPE computes. The original context defaults to the file's, as in llama.cpp."""
    key = f"{arch}.rope.scaling."
    for name, default in _YARN_DEFAULTS.items():
        if float(meta.get(key + name, default)) != default:
            raise gguf_weights.GGUFError(f"YaRN with {key + name} = {meta[key + name]} is not supported yet: running "
                                         "the file without it would compute another model")
    return {"rope_type": "yarn", "factor": factor,
            "original_max_position_embeddings": int(meta.get(key + "original_context_length") or context),
            "beta_fast": float(meta.get(key + "yarn_beta_fast", 32.0)),
            "beta_slow": float(meta.get(key + "yarn_beta_slow", 1.0))}


def _llama3_rope(cfg, t: Tensor | None) -> None:
    if t is None:
        return
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if t.ggml != "F32" or tuple(t.shape) != (head_dim // 2,) or cfg.model_type not in ("llama", "mistral") or \
            params.get("rope_type", "default") != "default":
        raise gguf_weights.GGUFError(f"rope_freqs.weight ({t.ggml} {list(t.shape)}) in a {cfg.model_type} file with "
                                     f"RoPE {params.get('rope_type')}: not Llama 3's RoPE scaling")
    divisors = torch.from_numpy(t.read().view(np.float32).copy())
    if torch.all(divisors == 1):
        return
    want = {"rope_type": "llama3", "rope_theta": params["rope_theta"], "factor": float(divisors.max()), **LLAMA3_ROPE}
    trial = copy.deepcopy(cfg)
    trial.rope_parameters = want
    inv, _ = skeleton.rope_inv_freq(trial)  # transformers' llama3 scaling
    plain, _ = skeleton.rope_inv_freq(cfg)
    if not torch.allclose(inv.float(), plain / divisors, rtol=1e-5, atol=0):
        raise gguf_weights.GGUFError(f"rope_freqs.weight is not Llama 3's RoPE scaling (factor {want['factor']}, "
                                     f"{LLAMA3_ROPE}); other RoPE frequency divisors are not supported")
    cfg.rope_parameters = want


def read_config(src: str, meta: dict, tensors: dict[str, Tensor]):
    """The model config GGUF `src` describes (its metadata `meta`, its tensors), completed as llama.cpp reads the
    file (complete_config): transformers' GGUF reader, or ours for the architectures it does not read (SmolLM3)."""
    own = own_reader(meta)
    cfg = own(src, meta, tensors) if own is not None else _transformers_config(src)
    complete_config(cfg, meta, tensors)
    return cfg


def _transformers_config(src: str):
    """The config transformers' GGUF reader makes of GGUF `src`."""
    from transformers import AutoConfig  # deferred: transformers takes seconds to import

    where, name = os.path.split(src)
    return AutoConfig.from_pretrained(where, gguf_file=name)


def read_tokenizer(src: str, meta: dict):
    """GGUF `src`'s tokenizer as transformers reads it. Its AutoTokenizer first reads the file's config, and so
    refuses the architectures its GGUF reader does not know; the tokenizer itself is read by its kind (gpt2 BPE,
    sentencepiece), whatever the architecture, which the plain fast class does without the config."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # deferred: transformers takes seconds to import

    where, name = os.path.split(src)
    cls = PreTrainedTokenizerFast if meta.get("general.architecture") in OWN_CONFIGS else AutoTokenizer
    return cls.from_pretrained(where, gguf_file=name)


def _smollm3_config(src: str, meta: dict, tensors: dict[str, Tensor]):
    """SmolLM3: Llama's layers, but every fourth (layers 3, 7, 11, ...) attends without RoPE (NoPE). llama.cpp
    fixes that interval in its code (`n_no_rope_layer_step = 4`; the file has no key for it), and so does this."""
    from transformers import SmolLM3Config  # deferred: transformers takes seconds to import

    key = lambda name: meta[f"smollm3.{name}"]
    heads = int(key("attention.head_count"))
    head_dim = int(meta.get("smollm3.attention.key_length", key("embedding_length") // heads))
    if head_dim * heads != key("embedding_length") or meta.get("smollm3.rope.dimension_count", head_dim) != head_dim:
        raise gguf_weights.GGUFError(f"a SmolLM3 file with heads {head_dim} wide or partial RoPE: SmolLM3's heads are "
                                     "hidden / heads wide, every dimension rotated")
    vocab = meta.get("smollm3.vocab_size") or tensors["token_embd.weight"].shape[0]
    return SmolLM3Config(
        vocab_size=int(vocab), hidden_size=int(key("embedding_length")),
        intermediate_size=int(key("feed_forward_length")), num_hidden_layers=int(key("block_count")),
        num_attention_heads=heads, num_key_value_heads=int(key("attention.head_count_kv")),
        max_position_embeddings=int(key("context_length")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_parameters={"rope_type": "default", "rope_theta": float(key("rope.freq_base"))},
        no_rope_layer_interval=4, use_sliding_window=False,
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"))


def _llama_config(src: str, meta: dict, tensors: dict[str, Tensor]):
    """A llama file as llama.cpp runs it. transformers' GGUF reader takes one whose general.name is "mistral" for a
    Mistral model, with MistralConfig's default 4096-token sliding window (which llama.cpp does not apply), and
    then cannot name its tensors (gguf-py has no mistral architecture): its fields, as a Llama config."""
    from transformers import LlamaConfig  # deferred: transformers takes seconds to import

    fields = _transformers_config(src).to_dict()
    dropped = ("model_type", "sliding_window", "architectures", "transformers_version")
    return LlamaConfig.from_dict({k: v for k, v in fields.items() if k not in dropped})


def own_reader(meta: dict) -> Callable | None:
    """How this package reads the config of a file (src, meta, tensors) that transformers' GGUF reader refuses
    (SmolLM3) or reads as another model than llama.cpp runs (a llama file named "mistral"); None where its reader
    is right."""
    arch = meta.get("general.architecture", "")
    if arch == "llama" and meta.get("general.name") == "mistral":
        return _llama_config
    return OWN_CONFIGS.get(arch)


# GGUF architectures whose config transformers' GGUF reader does not build (it refuses the file): read here
OWN_CONFIGS = {"smollm3": _smollm3_config}


class HeaderFields:
    """A GGUF's metadata as transformers' GGUF parse reads it from gguf's GGUFReader (`fields`: key -> a field
    whose `parts[i]` for i in `data` are its values, `types` the GGUF value types; `tensors` with their names),
    read by our bounded header reader (gguf_weights.read_header). Why: gguf's reader makes a numpy view of every
    string of a vocabulary (~0.3 M for a 150k-token file) and transformers then turns each view into a list of
    numpy scalars: most of a first conversion's time. Each value here is what transformers' parse of gguf's field
    gives (a string its bytes, a number a 1-tuple of its value): test_gguf_loading compares the two parses."""

    class Field:
        __slots__ = ("name", "types", "parts", "data")

        def __init__(self, name: str, types: list[int], parts: list):
            self.name, self.types, self.parts, self.data = name, types, parts, range(len(parts))

    class Named:
        __slots__ = ("name",)

        def __init__(self, name: str):
            self.name = name

    def __init__(self, path: str, mode: str = "r"):
        fields: list = []
        _, listed = gguf_weights.read_header(path, fields)
        self.fields = {key: self.Field(key, types, parts) for key, types, parts in fields}
        # the names transformers' parse reads (is output.weight there); Phi-3's fused tensors as read_header unfuses
        # them, which changes no such answer
        self.tensors = [self.Named(t.name) for t in listed]


@contextlib.contextmanager
def _one_metadata_parse():
    """While inside: transformers' GGUF metadata parse (load_gguf_checkpoint without tensors) runs once a file,
    where its config and its tokenizer each parse the whole file again, each caller getting its own copy of the
    result, and reads the header through HeaderFields rather than gguf's reader (the same values, without a numpy
    object per vocabulary string); and gguf's tensor name map is made once an architecture, where transformers'
    weights map made it again for each of a model's ~370 modules. Read-only lookups of the file and the
    architecture."""
    import gguf  # deferred: gguf is slow to import
    from transformers import modeling_gguf_pytorch_utils as mgu  # deferred: transformers takes seconds to import

    parse, seen = mgu.load_gguf_checkpoint, {}
    name_map = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)

    def once(path, return_tensors=False, **kwargs):
        if return_tensors or kwargs:
            return parse(path, return_tensors=return_tensors, **kwargs)
        key = os.path.realpath(path)
        if key not in seen:
            with _header_fields():
                seen[key] = parse(path, return_tensors=False)
        return copy.deepcopy(seen[key])

    mgu.load_gguf_checkpoint = once
    try:
        yield
    finally:
        mgu.load_gguf_checkpoint = parse
        gguf.get_tensor_name_map = name_map


@contextlib.contextmanager
def _header_fields():
    """While inside, gguf's GGUFReader is HeaderFields (load_gguf_checkpoint imports it from gguf at each call)."""
    import gguf  # deferred: gguf is slow to import

    reader = gguf.GGUFReader
    gguf.GGUFReader = HeaderFields
    try:
        yield
    finally:
        gguf.GGUFReader = reader


def convert(src: str, header: tuple[dict, list[Tensor]], folder: str, stamp: dict,
            progress: Callable[[str], None]) -> Rows | None:
    """Writes into `folder` the slim copy of GGUF `src` (its `header`: gguf_weights.read_header; content `stamp`)
    with its checked rows, and returns them; None (folder left for the caller to clear) where the runner does not
    take this model or a projection is not the file's own blocks."""
    with _one_metadata_parse():
        return _convert(src, header, folder, stamp, progress)


def _convert(src: str, header: tuple[dict, list[Tensor]], folder: str, stamp: dict,
             progress: Callable[[str], None]) -> Rows | None:
    name = os.path.basename(src)
    meta, listed = header
    tensors = {t.name: t for t in listed}
    cfg = read_config(src, meta, tensors)
    if cfg.model_type not in _GGUF_ARCH:
        return _whole(progress, f"the runner does not take {cfg.model_type} models")
    keys = {_hf_guess(t.name) for t in listed}  # which biases and q/k norms the skeleton declares
    with torch.device("meta"):
        model = skeleton.build(cfg, keys)
    sliding = skeleton.has_sliding_layers(cfg)
    if model is None or not LlamaRunner.supports(model) or (sliding and cfg.model_type not in skeleton.GEMMA):
        return _whole(progress, f"the runner does not take this {cfg.model_type} model's layout")
    ref = _Dequantized(cfg, model)
    progress(f"checking {name}'s blocks one tensor at a time against gguf's dequantization (no dense model)")
    perms = _projection_rows(model, tensors, ref, progress)
    if perms is None:
        return None
    emb_t, head_t = tensors.get("token_embd.weight"), tensors.get("output.weight")
    tied = head_t is None
    vocab, hidden = model.model.embed_tokens.num_embeddings, model.model.embed_tokens.embedding_dim
    embed = emb_t is not None and emb_t.ggml in DECODED and tuple(emb_t.shape) == (vocab, hidden) \
        and ref.same_rows(emb_t)
    head_src = emb_t if tied else head_t
    head = head_src is not None and head_src.ggml in KINDS and tuple(head_src.shape) == (vocab, hidden) and (
        embed if tied else ref.same_rows(head_src))
    skip = skeleton.skipped_tensors(cfg, head, embed)
    # norms and biases; the embedding / head where they are not the file's own blocks
    state = {ref.to_hf[t.name]: ref(t, finite=True) for t in listed if ref.to_hf.get(t.name) not in skip | {None}}
    missing = [k for k in model.state_dict() if k not in state and k not in skip
               and not (k == "lm_head.weight" and tied)]
    if missing:
        return _whole(progress, f"the file lacks {missing[:3]}")
    _save(folder, state, cfg, src, meta)
    del state
    rows = Rows(stamp, perms, head, embed)
    gguf_weights.save_rows(folder, rows)
    with open(os.path.join(folder, skeleton.SLIM_FILE), "w") as f:
        json.dump({"dropped": sorted(skip)[:3] + ["..."], "head": head, "embed": embed, "streamed": True}, f)
    return rows


def convert_dense(src: str, header: tuple[dict, list[Tensor]], folder: str) -> None:
    """Writes into `folder` the whole model of GGUF `src` dequantized to float32, as transformers' whole conversion
    does, for the files its GGUF reader refuses or misreads (own_reader): the copy a dense load (bf16, a format off
    our kernels) reads. Holds the dense model once, as that conversion does."""
    with _one_metadata_parse():
        _convert_dense(src, header, folder)


def _convert_dense(src: str, header: tuple[dict, list[Tensor]], folder: str) -> None:
    meta, listed = header
    cfg = read_config(src, meta, {t.name: t for t in listed})
    with torch.device("meta"):
        model = skeleton.build(cfg, {_hf_guess(t.name) for t in listed})
    if model is None:
        raise gguf_weights.GGUFError(f"a {cfg.model_type} file with a layout this package does not read")
    ref = _Dequantized(cfg, model)
    state = {ref.to_hf[t.name]: ref(t, finite=True) for t in listed if ref.to_hf.get(t.name) is not None}
    missing = [k for k in model.state_dict()
               if k not in state and not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing:
        raise gguf_weights.GGUFError(f"the file lacks {missing[:3]}")
    _save(folder, state, cfg, src, meta)


def _save(folder: str, state: dict[str, torch.Tensor], cfg, src: str, meta: dict) -> None:
    """The converted copy's tensors, config (float32, its transformers class named) and tokenizer."""
    # deferred: transformers takes seconds to import
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    cfg.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(cfg.model_type, "")]
    cfg.dtype = torch.float32
    cfg.save_pretrained(folder)
    read_tokenizer(src, meta).save_pretrained(folder)


class _Dequantized:
    """A tensor as transformers' GGUF loader gives it: gguf's `dequantize`, then the architecture's processor (Llama's
    q/k row order, Gemma's norm offset), in float32; `to_hf` names it as the model does."""

    def __init__(self, cfg, model):
        # deferred: transformers takes seconds to import
        from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                              get_gguf_hf_weights_map)

        self.processor = TENSOR_PROCESSORS.get(_GGUF_ARCH[cfg.model_type], TensorProcessor)(config=cfg.to_dict())
        self.to_hf = get_gguf_hf_weights_map(model, self.processor)

    def __call__(self, t: Tensor, rows: slice | None = None, finite: bool = False) -> torch.Tensor:
        """Rows `rows` (all by default) of tensor `t`; `finite`: GGUFError naming it where a value is not finite
        (a tensor kept in the converted copy: checked as it is made)."""
        from gguf import GGMLQuantizationType, dequantize  # deferred: gguf is slow to import

        shape = t.shape if rows is None else (rows.stop - rows.start, *t.shape[1:])
        per_row = _row_bytes(t)
        data = t.read() if rows is None else t.read(rows.start * per_row, rows.stop * per_row)
        w = dequantize(data.reshape(*shape[:-1], -1), GGMLQuantizationType[t.ggml])
        w = self.processor.process(weights=w, name=t.name, tensor_key_mapping=self.to_hf, parsed_parameters={}).weights
        out = torch.from_numpy(np.array(w, dtype=np.float32, copy=True)).reshape(shape)
        if finite:
            gguf_checks.finite(out, f"tensor {t.name}", gguf_weights.GGUFError)
        return out

    def same_rows(self, t: Tensor) -> bool:
        """Our decoding of `t` is these values, row for row in the file's order, on SAMPLE_ROWS rows spread over it
        (a decoder computes every block alike, so a wrong one shows in any row; a block whose scale is not finite
        is refused where every block is decoded, gguf_weights.decode)."""
        rows = sampled_rows(t.shape[0])
        return torch.equal(_decoded_rows(t, rows), torch.cat([self(t, slice(r, r + 1)) for r in rows]))

    def row_order(self, t: Tensor) -> np.ndarray | None:
        """order with the model's row i the file's row order[i], where the architecture's processing of `t` only
        reorders its rows (Llama's q and k, for RoPE): read off the processing of the row numbers, and held to
        random values; None where it does anything else."""
        n = t.shape[0]
        process = lambda w: np.asarray(self.processor.process(  # noqa: E731
            weights=w, name=t.name, tensor_key_mapping=self.to_hf, parsed_parameters={}).weights)
        order = process(np.arange(n, dtype=np.float32)[:, None].repeat(2, axis=1)).reshape(n, 2)[:, 0]
        if not np.array_equal(np.sort(order), np.arange(n, dtype=np.float32)):
            return None
        order = order.astype(np.int64)
        probe = np.random.default_rng(0).standard_normal((n, 2)).astype(np.float32)
        return order if np.array_equal(process(probe.copy()).reshape(n, 2), probe[order]) else None

    @staticmethod
    def file_rows(t: Tensor, raw: np.ndarray) -> torch.Tensor:
        """gguf's dequantization of the file's rows whose bytes are `raw` [rows, row bytes] (no processing: the
        file's order)."""
        from gguf import GGMLQuantizationType, dequantize  # deferred: gguf is slow to import

        w = dequantize(raw, GGMLQuantizationType[t.ggml])
        return torch.from_numpy(np.array(w, dtype=np.float32, copy=True)).reshape(raw.shape[0], -1)


def sampled_rows(n: int) -> list[int]:
    """SAMPLE_ROWS row numbers spread evenly over n, the first and last among them."""
    if n <= SAMPLE_ROWS:
        return list(range(n))
    return sorted({round(i * (n - 1) / (SAMPLE_ROWS - 1)) for i in range(SAMPLE_ROWS)})


def _raw_rows(t: Tensor, rows: list[int]) -> np.ndarray:
    """The bytes of the file's rows `rows` [len(rows), row bytes], read (not mapped: Tensor.read) through one open
    file, where a read per row opened the file again for each."""
    per_row = _row_bytes(t)
    if not t.path:
        return np.stack([t.read(r * per_row, (r + 1) * per_row) for r in rows])
    out = np.empty((len(rows), per_row), dtype=np.uint8)
    fd = os.open(t.path, os.O_RDONLY)
    try:
        for i, r in enumerate(rows):
            if os.preadv(fd, [out[i]], t.offset + r * per_row) != per_row:
                raise gguf_weights.GGUFError(f"'{t.path}' is shorter than its header says (tensor {t.name})")
    finally:
        os.close(fd)
    return out


def _decoded_rows(t: Tensor, rows: list[int], raw: np.ndarray | None = None) -> torch.Tensor:
    """Our decoding of the file's rows `rows` (their bytes `raw` where read already), dequantized (float32)."""
    raw = _raw_rows(t, rows) if raw is None else raw
    return gguf_weights.decode(t.ggml, raw.reshape(-1), (len(rows), t.shape[1]), t.name).dequantized()


def _projection_rows(model, tensors: dict[str, Tensor], ref: _Dequantized, progress) -> dict[str, torch.Tensor] | None:
    """Each layer's projections checked, one tensor in memory at a time: the row orders where they differ from the
    file's (Llama's q and k), or None where one is not for our kernels or not the file's values."""
    perms: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(model.model.layers):
        for gname, (sub, attr) in PROJECTIONS.items():
            t = tensors.get(f"blk.{i}.{gname}.weight")
            lin = getattr(getattr(layer, sub), attr)
            if t is None or t.ggml not in KINDS or lin.out_features % 16 or \
                    tuple(t.shape) != (lin.out_features, lin.in_features):
                return _whole(progress, f"blk.{i}.{gname} is {t.ggml if t is not None else 'missing'} "
                                        f"[{lin.out_features}, {lin.in_features}], not for our kernels")
            order = ref.row_order(t)
            if order is None:  # a processing that is not a row order: the whole tensor compared, in its order
                shape = (lin.out_features, lin.in_features)  # the file's, as checked above
                fw = gguf_weights.match(gguf_weights.decode(t.ggml, t.read(), shape, t.name), ref(t))
                if fw is None:
                    return _whole(progress, f"blk.{i}.{gname}: our decoding is not gguf's dequantization")
                if fw.perm is not None:
                    perms[t.name] = fw.perm.to(torch.int32)
                continue
            rows = sampled_rows(t.shape[0])  # a decoder computes every block alike: a wrong one shows in any row
            raw = _raw_rows(t, rows)  # one read: both decoders are given the same bytes
            if not torch.equal(_decoded_rows(t, rows, raw), ref.file_rows(t, raw)):
                return _whole(progress, f"blk.{i}.{gname}: our decoding is not gguf's dequantization")
            if not np.array_equal(order, np.arange(len(order))):
                perms[t.name] = torch.from_numpy(order).to(torch.int32)
    return perms


def _row_bytes(t: Tensor) -> int:
    """Bytes of one row (the innermost dimension) of `t` in its GGUF type."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # deferred: gguf is slow to import

    block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[t.ggml]]
    return t.shape[-1] // block * nbytes


def _whole(progress: Callable[[str], None], why: str) -> Any:
    """Says why the file is not converted a tensor at a time; None, what its callers return then (Rows or a
    dict of tensors where they convert)."""
    progress(f"not converting it a tensor at a time: {why}")
    return None


def _hf_guess(gguf_name: str) -> str:
    """The transformers name of a layer-0 bias or q/k norm, enough for skeleton.build to declare them."""
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1] == "0":
        base = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}.get(parts[2])
        if base is None and parts[2] in PROJECTIONS:
            base = ".".join(PROJECTIONS[parts[2]])
        if base is not None:
            return f"model.layers.0.{base}.{parts[3]}"
    return gguf_name
