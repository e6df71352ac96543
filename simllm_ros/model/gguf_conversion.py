"""A GGUF's first conversion one tensor at a time: the copy a skeleton load reads (config, tokenizer, the
float tensors the runner keeps in Python: norms, biases) and the check that every projection is the file's own
blocks (gguf_weights.Rows), without the dense model ever in memory.

Why: transformers' GGUF load dequantizes the whole model to float32 (~4x the file) and the check then compared
every projection against it, so a first load peaked at 5.3 GB for a 0.5B Q4_K_M and 10.2 GB for a 1.5B one: more
than an 8 GB robot computer has (the real Gemma 3 270M Q4_K_M, 4.0 GB). Here each tensor is dequantized as transformers' loader does it (gguf's
`dequantize`, then transformers' per-architecture processing: Llama's q/k row order, Gemma's norm offset), compared
bit for bit with our decoding of the same bytes, and dropped; the token embedding and LM head in slices of rows.
Nothing runs on a tensor that was not checked: where any projection is not the file's own (a format our kernels do
not take, other values) this returns None and the caller converts the whole model as before.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable

import numpy as np
import torch

from . import gguf_weights, skeleton
from .gguf_weights import KINDS, PROJECTIONS, Rows, Tensor

# transformers' tensor processors are keyed by the GGUF architecture; the model types the runner takes map to these
_GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}
EMBED_ROWS = 8192  # rows of the token embedding / LM head compared at a time (1536 wide: 48 MB in float32)


def convert(src: str, folder: str, stamp: dict, progress: Callable[[str], None]) -> Rows | None:
    """Writes into `folder` the slim copy of GGUF `src` (content `stamp`) with its checked rows, and returns them;
    None (folder left for the caller to clear) where the runner does not take this model or a projection is not the
    file's own blocks."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize
    from transformers import AutoConfig, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                          get_gguf_hf_weights_map)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from .llama_runner import LlamaRunner

    where, name = os.path.split(src)
    listed = gguf_weights.check_file(src)
    tensors = {t.name: t for t in listed}
    cfg = AutoConfig.from_pretrained(where, gguf_file=name)
    if cfg.model_type not in _GGUF_ARCH:
        return _whole(progress, f"the runner does not take {cfg.model_type} models")
    keys = {_hf_guess(t.name) for t in listed}  # which biases and q/k norms the skeleton declares
    with torch.device("meta"):
        model = skeleton.build(cfg, keys)
    sliding = bool(getattr(cfg, "sliding_window", None)) and any(
        t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ["sliding_attention"]))
    if model is None or not LlamaRunner.supports(model) or (sliding and cfg.model_type != "gemma3_text"):
        return _whole(progress, f"the runner does not take this {cfg.model_type} model's layout")
    processor = TENSOR_PROCESSORS.get(_GGUF_ARCH[cfg.model_type], TensorProcessor)(config=cfg.to_dict())
    to_hf = get_gguf_hf_weights_map(model, processor)

    def reference(t: Tensor, rows: slice | None = None) -> torch.Tensor:
        """The float32 values transformers' loader gives (rows of) this tensor."""
        block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[t.ggml]]
        shape = t.shape if rows is None else (rows.stop - rows.start, *t.shape[1:])
        per_row = int(np.prod(t.shape[1:])) // block * nbytes if len(t.shape) > 1 else None
        data = t.read() if rows is None else t.read(rows.start * per_row, rows.stop * per_row)
        data = data.reshape(*shape[:-1], shape[-1] // block * nbytes)
        w = dequantize(data, GGMLQuantizationType[t.ggml])
        w = processor.process(weights=w, name=t.name, tensor_key_mapping=to_hf, parsed_parameters={}).weights
        return torch.from_numpy(np.array(w, dtype=np.float32, copy=True)).reshape(shape)

    def same_rows(t: Tensor) -> bool:
        """Our decoding of `t` is transformers' values, row for row in the file's order, a slice at a time."""
        n, k = t.shape
        block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[t.ggml]]
        per_row = k // block * nbytes
        for r in range(0, n, EMBED_ROWS):
            part = slice(r, min(n, r + EMBED_ROWS))
            ours = gguf_weights.decode(t.ggml, t.read(part.start * per_row, part.stop * per_row),
                                       (part.stop - part.start, k)).dequantized()
            if not torch.equal(ours, reference(t, part)):
                return False
        return True

    progress(f"checking {name}'s blocks one tensor at a time against gguf's dequantization (no dense model)")
    perms: dict[str, torch.Tensor] = {}
    for i in range(cfg.num_hidden_layers):
        for gname, (sub, attr) in PROJECTIONS.items():
            t = tensors.get(f"blk.{i}.{gname}.weight")
            lin = getattr(getattr(model.model.layers[i], sub), attr)
            if t is None or t.ggml not in KINDS or lin.out_features % 16 or \
                    tuple(t.shape) != (lin.out_features, lin.in_features):
                return _whole(progress, f"blk.{i}.{gname} is {t.ggml if t is not None else 'missing'} "
                                        f"[{lin.out_features}, {lin.in_features}], not for our kernels")
            fw = gguf_weights.match(gguf_weights.decode(t.ggml, t.read(), tuple(t.shape)), reference(t))
            if fw is None:
                return _whole(progress, f"blk.{i}.{gname}: our decoding is not gguf's dequantization")
            if fw.perm is not None:
                perms[t.name] = fw.perm.to(torch.int32)
    emb_t, head_t = tensors.get("token_embd.weight"), tensors.get("output.weight")
    tied = head_t is None
    vocab, hidden = model.model.embed_tokens.num_embeddings, model.model.embed_tokens.embedding_dim
    embed = emb_t is not None and emb_t.ggml in gguf_weights.DECODED and tuple(emb_t.shape) == (vocab, hidden) \
        and same_rows(emb_t)
    head_src = emb_t if tied else head_t
    head = head_src is not None and head_src.ggml in KINDS and tuple(head_src.shape) == (vocab, hidden) and (
        embed if tied else same_rows(head_src))
    from .model_files import SLIM_FILE, _skeleton_skips

    skip = _skeleton_skips(cfg, head, embed)
    state = {}
    for t in listed:
        hf = to_hf.get(t.name)
        if hf is not None and hf not in skip:
            state[hf] = reference(t)  # norms and biases; the embedding / head where not the file's own blocks
    missing = [k for k in model.state_dict() if k not in state and k not in skip
               and not (k == "lm_head.weight" and tied)]
    if missing:
        return _whole(progress, f"the file lacks {missing[:3]}")
    from safetensors.torch import save_file

    save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    del state
    cfg.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(cfg.model_type, "")]
    cfg.dtype = torch.float32
    cfg.save_pretrained(folder)
    AutoTokenizer.from_pretrained(where, gguf_file=name).save_pretrained(folder)
    rows = Rows(stamp, perms, head, embed)
    gguf_weights.save_rows(folder, rows)
    with open(os.path.join(folder, SLIM_FILE), "w") as f:
        json.dump({"dropped": sorted(skip)[:3] + ["..."], "head": head, "embed": embed, "streamed": True}, f)
    return rows


def _whole(progress: Callable[[str], None], why: str) -> None:
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
