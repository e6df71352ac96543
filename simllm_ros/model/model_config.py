"""A converted model's config, read without the import that costs a Llama-family model ~52 MB resident.

transformers' LlamaConfig module validates `initializer_range` with a helper whose module imports
transformers.activations, which imports the hub-kernel integration, its weight-loading stack, torch.distributed
and sympy (~52 MB resident for the model's lifetime, none of it used by a skeleton load: the skeleton has its own
activations). SmolLM2 and Llama 3.x files are Llama-family, the embedded model too, so every such load paid it.
`LlamaFields` declares the same fields and defaults as transformers' LlamaConfig (a config.json saved by
transformers lists only the values that differ from them), with model_type "llama"; the base class does the rest
(RoPE parameters, generation defaults) as for transformers' own. test_skeleton checks that the two read every
field of a Llama config alike. The other architectures' configs import nothing heavy and come from AutoConfig.
"""
from __future__ import annotations

import json
import os

from huggingface_hub.dataclasses import strict
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters


@strict
class LlamaFields(PreTrainedConfig):
    """A Llama-family config.json's fields with transformers' defaults (LlamaConfig's, without its import)."""

    model_type = "llama"

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pretraining_tp: int | None = 1
    tie_word_embeddings: bool = False
    rope_parameters: RopeParameters | dict | None = None
    attention_bias: bool = False
    attention_dropout: int | float | None = 0.0
    mlp_bias: bool = False

    def __post_init__(self, **kwargs):
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        super().__post_init__(**kwargs)


def own_config(path: str) -> LlamaFields | None:
    """The config of the checkpoint folder `path` where it is Llama-family (read as `LlamaFields`), else None."""
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            kind = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None  # no config, or not ours to judge: transformers says what is wrong with the folder
    if kind != LlamaFields.model_type:
        return None
    cfg = LlamaFields.from_pretrained(path, local_files_only=True)
    cfg._name_or_path = path  # as AutoConfig names it
    return cfg


def load_config(path: str):
    """The config of the checkpoint folder `path`: a Llama-family one as `LlamaFields`, others from AutoConfig."""
    cfg = own_config(path)
    if cfg is not None:
        return cfg
    from transformers import AutoConfig  # deferred: transformers takes seconds to import

    return AutoConfig.from_pretrained(path, local_files_only=True)


def attention_for(cfg) -> dict:
    """from_pretrained's `attn_implementation` for `cfg`: eager where the model soft-caps its attention scores
    (Gemma 2). sdpa has no cap, and transformers before 5.24 (Python 3.10's pin) picked sdpa for Gemma 2 all the
    same: its forward then computed another model (logits off by up to 5 from the second position on)."""
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return {"attn_implementation": "eager"} if getattr(text, "attn_logit_softcapping", None) else {}


def longrope_original(cfg) -> int | None:
    """The original context of a LongRoPE config (Phi-3.5-mini, Phi-3 128k, Phi-4-mini), else None."""
    rope = getattr(cfg, "rope_parameters", None)
    if isinstance(rope, dict) and rope.get("rope_type") == "longrope":
        return int(rope["original_max_position_embeddings"])
    return None


def long_factors_for(cfg, context_length: int) -> bool:
    """Whether a load of LongRoPE config `cfg` set up for `context_length` positions takes the long factors."""
    original = longrope_original(cfg)
    return original is not None and context_length > original


def take_long_factors(cfg, context_length: int) -> bool:
    """LongRoPE's long factors at every position where the context a load is set up for (`context_length`: the
    longest prompt and answer it serves) passes the original one: llama.cpp's choice for its context size (n_ctx past
    the original: the long factors for the whole context), fixed at load so that a cached key never meets a table it
    was not rotated with (transformers' classes switch tables with each sequence's length). The short factors in
    `cfg` become the long ones, so transformers' classes compute the same at every length. Whether it did."""
    if not long_factors_for(cfg, context_length):
        return False
    cfg.rope_parameters = dict(cfg.rope_parameters, short_factor=list(cfg.rope_parameters["long_factor"]))
    return True
