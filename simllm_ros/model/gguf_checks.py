"""A GGUF's header held to what its model needs, before anything is allocated from it: counts in their ranges
(layers, heads, vocabulary, context), block_count the layers the file has, every tensor the architecture needs
present with its shape, tensor data aligned, inside the file and not overlapping, numeric metadata finite and in
range, and the small float tensors (norms, RoPE factors) finite. Each problem is a GGUFError naming the key or
tensor: a file that fails here would otherwise be run as another model (a missing tensor initialised, a NaN scale
answering "") or fail later on a generic error (a ZeroDivisionError, an array of size 0, a hang on 1000 layers).
Block scales and the dense float tensors are checked where they are decoded (`finite`, gguf_weights.decode and the
conversions), not in another pass over the file.
"""
from __future__ import annotations

import math
from typing import NoReturn

import numpy as np
import torch

MAX_LAYERS = 4096
MAX_HEADS = 4096
MAX_WIDTH = 1 << 20  # hidden size, feed-forward width, head width
MAX_VOCAB = 1 << 22
MAX_CONTEXT = 1 << 24
# The Llama-family architectures whose tensors are checked by name and shape (others: counts and layout only)
CHECKED_ARCHS = {"llama", "qwen2", "qwen3", "smollm3", "phi3", "gemma2", "gemma3", "stablelm"}


class Bad:
    """Raises the caller's error type (gguf_weights.GGUFError; imported there, not here); the callers name the
    model file in their message."""

    def __init__(self, path: str, error: type[Exception]):
        self.path, self.error = path, error

    def __call__(self, why: str) -> NoReturn:
        raise self.error(why)


def finite(values, what: str, error: type[Exception]) -> None:
    """`error` naming `what` where a float array or tensor holds a NaN or an infinity."""
    if isinstance(values, torch.Tensor):
        ok = bool(torch.isfinite(values).all()) if values.is_floating_point() else True
    else:
        arr = np.asarray(values)
        ok = bool(np.isfinite(arr).all()) if arr.dtype.kind == "f" else True
    if not ok:
        raise error(f"{what} holds non-finite values (NaN or infinity): the file is damaged")


def check_layout(bad: Bad, spans: list[tuple[str, int, int]], data_start: int, size: int, align: int) -> None:
    """Tensor data (name, offset from the data section, bytes) aligned to general.alignment, inside the file and
    disjoint."""
    for name, offset, n in spans:
        if offset % align:
            bad(f"tensor {name}'s data offset {offset} is not a multiple of general.alignment {align}")
        if data_start + offset + n > size:
            bad(f"the file is truncated: tensor {name} needs bytes up to {data_start + offset + n}, "
                f"the file has {size}")
    ordered = sorted(spans, key=lambda s: s[1])
    for (a, a_off, a_n), (b, b_off, _) in zip(ordered, ordered[1:]):
        if b_off < a_off + a_n:
            bad(f"tensors {a} and {b} overlap (bytes {a_off}..{a_off + a_n} and from {b_off} of the data section)")


def check_metadata(bad: Bad, meta: dict) -> None:
    """Every float value finite; epsilons, RoPE bases and factors, soft-caps in their ranges."""
    for key, v in meta.items():
        if isinstance(v, float) and not math.isfinite(v):
            bad(f"metadata {key} is {v}")
    for key, v in meta.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            continue
        if key.endswith(("layer_norm_rms_epsilon", "layer_norm_epsilon")) and not 0 < v < 1:
            bad(f"metadata {key} is {v}, not an epsilon in (0, 1)")
        if key.endswith((".rope.freq_base", ".rope.freq_base_swa")) and not 0 < v <= 1e12:
            bad(f"metadata {key} is {v}, not a positive RoPE base")
        if key.endswith(".rope.scaling.factor") and not 0 <= v <= 1e6:  # 0: no scaling, as llama.cpp reads it
            bad(f"metadata {key} is {v}, not a RoPE scaling factor")
        if key.endswith("softcapping") and v < 0:
            bad(f"metadata {key} is {v}, a negative soft-cap")


def _count(bad: Bad, meta: dict, key: str, lo: int, hi: int, default=None) -> int | None:
    v = meta.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        bad(f"metadata {key} is {v!r}, not an integer")
    if not lo <= v <= hi:
        bad(f"metadata {key} is {v}, outside {lo}..{hi}")
    return v


def _layer_needs(arch: str, hidden: int, heads: int, kv: int, hd: int, inter: int | None,
                 fused: bool) -> dict[str, tuple]:
    """Each layer's tensors (name within blk.N -> shape, outermost first; None: any width) for `arch`."""
    q, kvd = heads * hd, kv * hd
    need = {"attn_norm.weight": (hidden,), "attn_output.weight": (hidden, q), "ffn_down.weight": (hidden, inter)}
    if arch != "stablelm":  # StableLM 2's larger models run attention and MLP in parallel from one norm
        need["ffn_norm.weight"] = (hidden,)
    if fused:  # Phi-3's q/k/v in one tensor
        need["attn_qkv.weight"] = (q + 2 * kvd, hidden)
    else:
        need.update({"attn_q.weight": (q, hidden), "attn_k.weight": (kvd, hidden), "attn_v.weight": (kvd, hidden)})
    if arch == "phi3":  # gate and up in one tensor
        need["ffn_up.weight"] = (None if inter is None else 2 * inter, hidden)
    else:
        need.update({"ffn_gate.weight": (inter, hidden), "ffn_up.weight": (inter, hidden)})
    if arch == "qwen2":
        need.update({"attn_q.bias": (q,), "attn_k.bias": (kvd,), "attn_v.bias": (kvd,)})
    if arch in ("qwen3", "gemma3"):
        need.update({"attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,)})
    if arch in ("gemma2", "gemma3"):
        need.update({"post_attention_norm.weight": (hidden,), "post_ffw_norm.weight": (hidden,)})
    if arch == "stablelm":
        need["attn_norm.bias"] = (hidden,)
    return need


def _shape_ok(have: tuple, want: tuple) -> bool:
    return len(have) == len(want) and all(w is None or h == w for h, w in zip(have, want))


def check_model(bad: Bad, meta: dict, tensors: dict) -> None:
    """Counts in range, block_count the layers present, and (CHECKED_ARCHS) every tensor the model needs present
    with its shape; `tensors`: name -> object with .shape (outermost first)."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        bad("the file has no general.architecture")
    layers_seen: set[int] = set()
    for name in tensors:
        parts = name.split(".")
        if parts[0] == "blk":
            if len(parts) < 3 or not parts[1].isdigit():
                bad(f"tensor {name} is not named blk.<layer>.<kind>")
            layers_seen.add(int(parts[1]))
    blocks = _count(bad, meta, f"{arch}.block_count", 1, MAX_LAYERS)
    if blocks is not None:
        beyond = sorted(i for i in layers_seen if i >= blocks)
        if beyond:
            bad(f"the file has tensors of layer {beyond[0]} but {arch}.block_count {blocks}")
        absent = [i for i in range(blocks) if i not in layers_seen]
        if absent:
            bad(f"{arch}.block_count is {blocks} but the file has no tensors of layer {absent[0]} "
                f"({len(layers_seen)} layers present)")
    _count(bad, meta, f"{arch}.context_length", 1, MAX_CONTEXT)
    _count(bad, meta, f"{arch}.vocab_size", 1, MAX_VOCAB)
    hidden = _count(bad, meta, f"{arch}.embedding_length", 1, MAX_WIDTH)
    heads = _count(bad, meta, f"{arch}.attention.head_count", 1, MAX_HEADS)
    kv = _count(bad, meta, f"{arch}.attention.head_count_kv", 1, MAX_HEADS, default=heads)
    inter = _count(bad, meta, f"{arch}.feed_forward_length", 1, MAX_WIDTH)
    hd = _count(bad, meta, f"{arch}.attention.key_length", 1, MAX_WIDTH)
    if heads is not None and kv is not None and heads % kv:
        bad(f"{arch}.attention.head_count {heads} is not a multiple of head_count_kv {kv}")
    if hd is None and hidden is not None and heads is not None:
        if hidden % heads:
            bad(f"{arch}.embedding_length {hidden} is not a multiple of attention.head_count {heads}")
        hd = hidden // heads
    rope = _count(bad, meta, f"{arch}.rope.dimension_count", 1, MAX_WIDTH)
    if rope is not None and hd is not None and rope > hd:
        bad(f"{arch}.rope.dimension_count {rope} is wider than a head ({hd})")
    if arch not in CHECKED_ARCHS:
        return
    missing = [k for k, v in ((f"{arch}.block_count", blocks), (f"{arch}.embedding_length", hidden),
                              (f"{arch}.attention.head_count", heads)) if v is None]
    if missing or blocks is None or hidden is None or heads is None or kv is None or hd is None:
        bad(f"the file lacks the metadata {missing[0]}, which a {arch} model needs")  # kv, hd: heads' defaults
    embed = tensors.get("token_embd.weight")
    if embed is None:
        bad("the file lacks the tensor token_embd.weight")
    if len(embed.shape) != 2 or embed.shape[1] != hidden or not 1 <= embed.shape[0] <= MAX_VOCAB:
        bad(f"tensor token_embd.weight is {list(embed.shape)}, not [vocabulary, {hidden}]")
    vocab = embed.shape[0]
    if meta.get(f"{arch}.vocab_size", vocab) != vocab:
        bad(f"{arch}.vocab_size {meta[f'{arch}.vocab_size']} but token_embd.weight has {vocab} rows")
    globals_ = {"output_norm.weight": (hidden,), "output.weight": (vocab, hidden)}
    if arch == "stablelm":
        globals_["output_norm.bias"] = (hidden,)
    for name, want in globals_.items():
        t = tensors.get(name)
        if t is None and name != "output.weight":  # output.weight absent: the head tied to the embedding
            bad(f"the file lacks the tensor {name}")
        if t is not None and not _shape_ok(tuple(t.shape), want):
            bad(f"tensor {name} is {list(t.shape)}, not {list(want)}")
    fused = arch == "phi3" and "blk.0.attn_qkv.weight" in tensors
    needs = _layer_needs(arch, hidden, heads, kv, hd, inter, fused)
    for i in range(blocks):
        for kind, want in needs.items():
            t = tensors.get(f"blk.{i}.{kind}")
            if t is None:
                bad(f"the file lacks the tensor blk.{i}.{kind}, which a {arch} model needs")
            if not _shape_ok(tuple(t.shape), want):
                bad(f"tensor blk.{i}.{kind} is {list(t.shape)}, not {[w if w else '*' for w in want]}")


def check_small_floats(bad: Bad, tensors: list) -> None:
    """The one-dimensional float tensors (norms, biases, RoPE factors: a few KB a layer) finite."""
    for t in tensors:
        if len(t.shape) != 1 or t.ggml not in ("F32", "F16", "BF16"):
            continue
        raw = np.asarray(t.data)  # a few KB through the file's map
        if t.ggml == "BF16":
            vals = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            vals = raw.view(np.float32 if t.ggml == "F32" else np.float16)
        if not np.isfinite(vals).all():
            bad(f"tensor {t.name} holds non-finite values (NaN or infinity)")
