"""A small random-weight Gemma 3 (sliding-window layers with their own RoPE base) written by the tests themselves,
with the embedded SmolLM2's tokenizer (read from its GGUF): no download. Written and loaded once per process, as
core_fixtures shares its engines, so that every test module that runs Gemma 3 shares it."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import torch

from random_gguf import tokenizer_source
from simllm_ros.model.model_backend import ModelBackend

WINDOW = 16  # every prompt the tests run is longer
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def write_gemma(folder: str, **overrides) -> str:
    """A random-weight Gemma3ForCausalLM with the SmolLM2 tokenizer saved in `folder`."""
    from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

    src = tokenizer_source()
    tok = AutoTokenizer.from_pretrained(os.path.dirname(src), gguf_file=os.path.basename(src))
    cfg = Gemma3TextConfig(**{**dict(
        vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=WINDOW, layer_types=LAYER_TYPES,
        query_pre_attn_scalar=48, max_position_embeddings=4096,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id or 0),
        **overrides})
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # Gemma's norm weights start at 0 (a factor of 1): random ones make each norm matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0, 0.3)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


_DIR: dict[str, str] = {}
_BACKENDS: dict[str, ModelBackend] = {}


def gemma_dir() -> dict[str, str]:
    """The shared model's folder and its model cache folder (a temporary folder, removed at exit)."""
    if not _DIR:
        root = tempfile.mkdtemp(prefix="simllm-gemma3-")
        atexit.register(shutil.rmtree, root, True)
        _DIR.update(model=write_gemma(os.path.join(root, "model")), cache=os.path.join(root, "cache"))
    return _DIR


def gemma_backend(dtype: str) -> ModelBackend:
    """The shared model loaded at `dtype` (16-bit weights), once per process."""
    if dtype not in _BACKENDS:
        d = gemma_dir()
        _BACKENDS[dtype] = ModelBackend(d["model"], dtype=dtype, weight_bits=16, cache_dir=d["cache"])
    return _BACKENDS[dtype]
