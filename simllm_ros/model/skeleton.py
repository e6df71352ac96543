"""The module tree of a converted GGUF for the runner, built without transformers' modeling code.

A load that takes a GGUF's checked blocks (gguf_weights.Rows) needs from the model only its shapes, norms, biases,
RoPE tables and activation: the runner packs or maps the projections itself. transformers' model classes cost
that load seconds and ~100 MB resident just to import (modeling_utils pulls in torch.distributed, scipy and
quantizer integrations), more than everything else the load does for a 0.5B model. This tree has the same names
(`model.layers[i].self_attn.q_proj`, `model.norm`, `lm_head`, ...) and computes what transformers' modules compute
for the pieces the runner calls (RMSNorm, the RoPE tables, the scaled embedding), with the same operations in the
same order, so a model runs to the same bits on either. Architectures or RoPE kinds it does not know return None
from `build`, and the load takes transformers' classes as before.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .gguf_weights import PROJECTIONS
from .rope_trig import check_positions, max_position, rope_cos_sin

# The runner's architectures (model_backend.FULL_ATTENTION_ARCHITECTURES | SLIDING_WINDOW_ARCHITECTURES)
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "smollm3", "phi3")
GEMMA = ("gemma2", "gemma3_text")  # four norms a layer, norms of x * (1 + w), rows scaled by sqrt(hidden)
# Projections transformers' own classes keep fused (Phi-3's): a dense copy of such a file names them so
FUSED_PROJECTIONS = (("self_attn", "qkv_proj"), ("mlp", "gate_up_proj"))
# Beside a converted copy that holds only what a skeleton load reads (skipped_tensors dropped or never written)
SLIM_FILE = "simllm_slim.json"


def skipped_tensors(cfg, skip_head: bool, skip_embed: bool) -> set[str]:
    """The converted model's tensors a skeleton load does without: every projection weight (fused ones too, as
    transformers' whole conversion of a Phi-3 file names them), the LM head if `skip_head`, the token embedding if
    `skip_embed` and nothing else needs it."""
    skip = {f"model.layers.{i}.{sub}.{attr}.weight" for i in range(cfg.num_hidden_layers)
            for sub, attr in (*PROJECTIONS.values(), *FUSED_PROJECTIONS)}
    if skip_head:
        skip.add("lm_head.weight")
    if skip_embed and (skip_head or not getattr(cfg, "tie_word_embeddings", False)):
        skip.add("model.embed_tokens.weight")
    return skip


class Linear(nn.Module):
    """A projection's shape, bias and (where loaded) weight. The weight is allocated, never written, until a state
    dict assigns it: the runner takes the file's blocks instead, so a skipped weight is never resident."""

    def __init__(self, n_in: int, n_out: int, bias: bool):
        super().__init__()
        self.in_features, self.out_features = n_in, n_out
        self.weight = nn.Parameter(torch.empty(n_out, n_in), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(n_out), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """Llama's, Mistral's and Qwen's RMSNorm: the float32 row normalised, cast back, times the weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.variance_epsilon = eps

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        dtype = h.dtype
        h = h.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


class SiLU(nn.Module):
    """transformers' SiLUActivation ("silu"): F.silu. Ours, as the activations below, because importing
    transformers.activations pulls in its weight-loading stack, torch.distributed and sympy (~50 MB resident)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x)


class GELUTanh(nn.Module):
    """transformers' GELUTanh ("gelu_pytorch_tanh", Gemma 3's): F.gelu with tanh's approximation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"silu": SiLU, "swish": SiLU, "gelu_pytorch_tanh": GELUTanh}


class OffsetRMSNorm(nn.Module):
    """Gemma 3's RMSNorm: x * (1 + w), all in float32, cast back once."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h.float()
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(h)


class Embedding(nn.Module):
    """The token embedding; Gemma's rows are scaled by sqrt(hidden) in the weight's dtype, as transformers does."""

    def __init__(self, vocab: int, dim: int, scale: float | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = vocab, dim
        self.weight = nn.Parameter(torch.empty(vocab, dim), requires_grad=False)
        if scale is not None:
            self.embed_scale = torch.tensor(scale)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self.weight)
        return rows * self.embed_scale.to(self.weight.dtype) if hasattr(self, "embed_scale") else rows


class RotaryEmbedding(nn.Module):
    """cos and sin of RoPE for positions: one inverse-frequency table, or one per layer type (Gemma 3's sliding
    and full layers have their own bases). Static RoPE kinds only (default, linear, llama3, yarn, and LongRoPE at its
    short factors: ModelBackend.max_positions keeps sequences within the original context, where transformers and
    llama.cpp take those too): `build` declines the dynamic ones, whose tables change with the sequence length."""

    def __init__(self, config, layer_types: list[str] | None):
        super().__init__()
        self.tables: dict[str | None, tuple[torch.Tensor, float]] = {}
        types: list[str | None] = list(layer_types) if layer_types else [None]
        for t in types:
            self.tables[t] = rope_inv_freq(config, t)
        self.max_position = -1  # positions past it leave rope_trig's exact range (set at the first pass: the
        # tables may be built on the meta device and filled in at the load)
        if None in self.tables:
            self.inv_freq, self.attention_scaling = self.tables[None]

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None):
        inv_freq, scaling = self.tables[layer_type]
        freqs = position_ids[..., None].float() * inv_freq.to(device=x.device, dtype=torch.float)
        if self.max_position < 0:  # once: the positions are checked, not every pass's angles
            self.max_position = min(max_position(inv) for inv, _ in self.tables.values())
        check_positions(position_ids, self.max_position)
        cos, sin = rope_cos_sin(torch.cat((freqs, freqs), dim=-1), bounded=True)  # the same bits on every CPU
        return (cos * scaling).to(dtype=x.dtype), (sin * scaling).to(dtype=x.dtype)


def has_sliding_layers(cfg) -> bool:
    """Whether some layer of this config attends over a window (Gemma 3's, a Mistral with sliding_window set)."""
    return bool(getattr(cfg, "sliding_window", None)) and any(
        t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ["sliding_attention"]))


def rope_per_layer_type(config) -> bool:
    """Whether the config's RoPE has a table per layer type (Gemma 3's; Gemma 2's layer types share one)."""
    params, types = getattr(config, "rope_parameters", None), getattr(config, "layer_types", None)
    if not types or not isinstance(params, dict):
        return False
    return "rope_type" not in params and set(types) <= params.keys()


def rope_dims(config) -> int:
    """RoPE's rotated dimensions of a head: all, or its partial_rotary_factor of them (Phi-4-mini's 96 of 128), counted
    as transformers counts them."""
    params = getattr(config, "rope_parameters", None)
    part = float((params.get("partial_rotary_factor") if isinstance(params, dict) else None)
                 or getattr(config, "partial_rotary_factor", None) or 1.0)
    return int((getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads) * part)


def _rope_parameters(config, layer_type: str | None) -> dict | None:
    params = getattr(config, "rope_parameters", None)
    if layer_type is not None and isinstance(params, dict):
        params = params.get(layer_type)
    return params


def rope_inv_freq(config, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, attention scaling) of `config`'s RoPE, for one layer type where it has several."""
    params = _rope_parameters(config, layer_type)
    assert params is not None, "a RoPE kind build takes: the config has its rope_parameters"
    kind = params["rope_type"]
    if kind == "default":  # over the rotated part of a head (Phi-4-mini's 96 of 128), as transformers computes it
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
        return 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # deferred: transformers (no modeling code)

    if layer_type is None:
        return ROPE_INIT_FUNCTIONS[kind](config)
    return ROPE_INIT_FUNCTIONS[kind](config, None, layer_type=layer_type)


class Attention(nn.Module):
    def __init__(self, cfg, head_dim: int, biases: set[str], norm):
        super().__init__()
        h, q, kv = cfg.hidden_size, cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
        self.q_proj = Linear(h, q, "q_proj" in biases)
        self.k_proj = Linear(h, kv, "k_proj" in biases)
        self.v_proj = Linear(h, kv, "v_proj" in biases)
        self.o_proj = Linear(q, h, "o_proj" in biases)
        if norm is not None:  # Qwen3's and Gemma 3's per-head norms of q and k
            self.q_norm, self.k_norm = norm(head_dim), norm(head_dim)


class MLP(nn.Module):
    def __init__(self, cfg, biases: set[str], act):
        super().__init__()
        h, inter = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(h, inter, "gate_proj" in biases)
        self.up_proj = Linear(h, inter, "up_proj" in biases)
        self.down_proj = Linear(inter, h, "down_proj" in biases)
        self.act_fn = act


class Layer(nn.Module):
    def __init__(self, cfg, head_dim: int, biases: set[str], norm, qk_norm: bool, gemma: bool, act):
        super().__init__()
        h = cfg.hidden_size
        self.self_attn = Attention(cfg, head_dim, biases, norm if qk_norm else None)
        self.mlp = MLP(cfg, biases, act)
        self.input_layernorm = norm(h)
        self.post_attention_layernorm = norm(h)
        if gemma:
            self.pre_feedforward_layernorm = norm(h)
            self.post_feedforward_layernorm = norm(h)


class Body(nn.Module):
    def __init__(self, cfg, layers: list[Layer], gemma: bool, norm):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, cfg.hidden_size ** 0.5 if gemma else None)
        self.layers = nn.ModuleList(layers)
        self.norm = norm(cfg.hidden_size)
        self.rotary_emb = RotaryEmbedding(cfg, sorted(set(cfg.layer_types)) if rope_per_layer_type(cfg) else None)


class CausalLM(nn.Module):
    """`model` (embedding, layers, final norm, RoPE) and `lm_head`, with the config and generation config."""

    def __init__(self, cfg, body: Body):
        super().__init__()
        self.config = cfg
        self.model = body
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False)
        from transformers import GenerationConfig  # deferred: transformers (configuration code only)

        self.generation_config = GenerationConfig.from_model_config(cfg)


def static_rotary(cfg) -> RotaryEmbedding | None:
    """Our RoPE tables for `cfg` (rope_trig's bits on every CPU), or None where its RoPE is dynamic. The runner takes
    these over transformers' own module where a load built transformers' classes, so that both loads of one file
    compute the same bits."""
    types = sorted(set(cfg.layer_types)) if rope_per_layer_type(cfg) else None
    for t in types or [None]:
        params = _rope_parameters(cfg, t)
        if not isinstance(params, dict) or "dynamic" in params.get("rope_type", ""):
            return None
    return RotaryEmbedding(cfg, types)


def build(cfg, keys: set[str]) -> CausalLM | None:
    """The tree for config `cfg` whose checkpoint holds tensors `keys` (which biases and q/k norms exist), or None
    where this module does not know the architecture or its RoPE."""
    kind = getattr(cfg, "model_type", None)
    if kind not in ARCHITECTURES:
        return None
    gemma = kind in GEMMA
    types = sorted(set(cfg.layer_types)) if rope_per_layer_type(cfg) else [None]
    for t in types:
        params = _rope_parameters(cfg, t)
        if not isinstance(params, dict) or "dynamic" in params.get("rope_type", ""):
            return None
    act_name = getattr(cfg, "hidden_activation", None) if gemma else getattr(cfg, "hidden_act", None)
    if act_name in ACTIVATIONS:
        act = ACTIVATIONS[act_name]()
    else:  # transformers' own, for the rest (its module imports torch.distributed and sympy: ~50 MB resident)
        from transformers.activations import ACT2FN  # deferred: transformers takes seconds to import

        act = ACT2FN[act_name]
    eps = float(cfg.rms_norm_eps)

    def norm(dim: int) -> nn.Module:
        return OffsetRMSNorm(dim, eps) if gemma else RMSNorm(dim, eps)

    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    biases = {k.split(".")[-2] for k in keys if k.startswith("model.layers.0.") and k.endswith(".bias")}
    qk_norm = "model.layers.0.self_attn.q_norm.weight" in keys
    layers = [Layer(cfg, head_dim, biases, norm, qk_norm, gemma, act) for _ in range(cfg.num_hidden_layers)]
    return CausalLM(cfg, Body(cfg, layers, gemma, norm))
