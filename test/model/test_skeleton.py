"""skeleton.build: the module tree a converted model's later loads run on without transformers' model classes.
Its bits against transformers' classes are checked where files load twice (test_gguf_loading: Qwen2, Qwen3, the
embedded Llama; test_gemma3_runner: Gemma 3); here, what it declines and what it builds from a config."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config

from simllm_ros.model import skeleton
from simllm_ros.model.rope_trig import rope_cos_sin


def _llama(**kw) -> LlamaConfig:
    return LlamaConfig(**{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, **kw})


def test_it_declines_what_it_does_not_compute():
    assert skeleton.build(_llama(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), set()) is None
    cfg = _llama()
    cfg.model_type = "stablelm"
    assert skeleton.build(cfg, set()) is None
    partial = _llama()  # RoPE on half of each head (Phi-4-mini's kind): built, its table over the rotated half only
    partial.rope_parameters = {**partial.rope_parameters, "partial_rotary_factor": 0.5}
    assert skeleton.build(partial, set()).model.rotary_emb.inv_freq.shape == (16 // 2 // 2,)


def test_it_builds_the_names_and_biases_the_checkpoint_has():
    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100)
    keys = {f"model.layers.0.self_attn.{p}.bias" for p in ("q_proj", "k_proj", "v_proj")}
    m = skeleton.build(cfg, keys)
    att = m.model.layers[1].self_attn
    assert att.q_proj.bias is not None and att.o_proj.bias is None and not hasattr(att, "q_norm")
    assert (att.k_proj.out_features, att.k_proj.in_features) == (32, 64) and m.lm_head.out_features == 100
    assert m.generation_config is not None and m.config is cfg
    names = {n for n, _ in m.named_parameters()}
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
            "model.layers.1.mlp.down_proj.weight", "model.layers.1.post_attention_layernorm.weight"} <= names


def test_rope_and_norm_compute_what_their_formulas_say():
    m = skeleton.build(_llama(rope_theta=10000.0), set())
    rot = m.model.rotary_emb
    pos = torch.arange(5)[None]
    cos, sin = rot(torch.zeros(1, dtype=torch.float32), pos)
    inv = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float) / 16))
    f = pos[..., None].float() * inv
    want = rope_cos_sin(torch.cat((f, f), -1))
    assert torch.equal(cos, want[0]) and torch.equal(sin, want[1])
    # within one float32 ulp of torch's own cos / sin (SLEEF's, whose last bit depends on the CPU class)
    assert torch.allclose(cos, torch.cat((f, f), -1).cos(), rtol=0, atol=6e-8)
    assert torch.allclose(sin, torch.cat((f, f), -1).sin(), rtol=0, atol=6e-8)
    norm = skeleton.RMSNorm(8, 1e-6)
    norm.weight.data = torch.linspace(0.5, 2, 8)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(norm(x), norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)))


def test_its_activations_are_transformers_and_building_imports_no_sympy(tmp_path):
    """The skeleton's SiLU and tanh GELU compute what transformers' ACT2FN entries compute, bitwise; a fresh process
    that reads a Llama's, a Qwen2's and a Gemma 3's config.json (model_config.load_config) and builds their
    skeletons, as a load does, imports neither transformers.activations nor what it pulls in
    (torch.distributed.tensor, sympy: ~50 MB resident)."""
    from core_fixtures import python_in_new_process
    from transformers import Gemma3TextConfig
    from transformers.activations import ACT2FN

    x = torch.randn(7, 300, generator=torch.Generator().manual_seed(0)) * 5
    for name, ours in skeleton.ACTIVATIONS.items():
        assert torch.equal(ours()(x), ACT2FN[name](x)), name
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=100)
    _llama().save_pretrained(tmp_path / "llama")
    Qwen2Config(**kw).save_pretrained(tmp_path / "qwen2")
    Gemma3TextConfig(**kw, head_dim=16, layer_types=["sliding_attention", "full_attention"]).save_pretrained(
        tmp_path / "gemma")
    paths = [str(tmp_path / n) for n in ("llama", "qwen2", "gemma")]
    code = ("import sys; from simllm_ros.model import skeleton; from simllm_ros.model.model_config import load_config; "
            f"b = [skeleton.build(load_config(p), set()) for p in {paths!r}]; "
            "print(*(type(m.model.layers[0].mlp.act_fn).__name__ for m in b), "
            "*(m in sys.modules for m in ('transformers.activations', 'torch.distributed.tensor', 'sympy')))")
    got = python_in_new_process(code)[-1].split()
    assert got == ["SiLU", "SiLU", "GELUTanh", "False", "False", "False"]


@pytest.mark.parametrize("variant", [
    None,  # a hand-written config.json of the few keys a Llama needs: every other value a default
    {},
    {"tie_word_embeddings": True, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "bos_token_id": 0},
    {"head_dim": 32, "num_key_value_heads": 1, "attention_bias": True, "mlp_bias": True, "eos_token_id": [2, 7],
     "max_position_embeddings": 131072, "pad_token_id": 5},
    {"rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}, "rope_theta": 500000.0},
])
def test_a_llama_config_reads_as_transformers_reads_it(tmp_path, variant):
    """model_config's Llama fields (LlamaFields, read without LlamaConfig's module) against transformers' own
    LlamaConfig on the same config.json: every value alike, the RoPE parameters standardized alike, and the same
    skeleton and generation defaults built from either."""
    from transformers import AutoConfig

    from simllm_ros.model.model_config import LlamaFields, load_config

    if variant is None:
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64,
                                                           "num_attention_heads": 4, "vocab_size": 100}))
    else:
        _llama(**variant).save_pretrained(tmp_path)
    ours, theirs = load_config(str(tmp_path)), AutoConfig.from_pretrained(tmp_path)
    assert type(ours) is LlamaFields and type(theirs) is LlamaConfig
    assert ours.to_dict() == theirs.to_dict()
    for name in ("head_dim", "num_key_value_heads", "rope_parameters", "tie_word_embeddings", "eos_token_id"):
        assert getattr(ours, name) == getattr(theirs, name), name
    a, b = skeleton.build(ours, set()), skeleton.build(theirs, set())
    assert [(n, p.shape) for n, p in a.named_parameters()] == [(n, p.shape) for n, p in b.named_parameters()]
    assert a.generation_config.to_dict() == b.generation_config.to_dict()
    pos = torch.arange(9)[None]
    x = torch.zeros(1, dtype=torch.float32)
    assert all(torch.equal(u, v) for u, v in zip(a.model.rotary_emb(x, pos), b.model.rotary_emb(x, pos)))


def test_a_gemma2_tree_has_transformers_names_one_rope_table_and_gemmas_norms():
    """Gemma 2's layers are Gemma 3's without q/k norms and with one RoPE table for both layer types (its
    rope_parameters are not per type): the tree has the parameter names and shapes of transformers' Gemma2 model,
    its norms are x * (1 + w), its rows are scaled by sqrt(hidden), and its RoPE is transformers'."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=100)
    assert not skeleton.rope_per_layer_type(cfg) and set(cfg.layer_types) == {"sliding_attention", "full_attention"}
    ours, theirs = skeleton.build(cfg, set()), Gemma2ForCausalLM(cfg)
    assert sorted((n, p.shape) for n, p in ours.named_parameters(remove_duplicate=False)) == \
        sorted((n, p.shape) for n, p in theirs.named_parameters(remove_duplicate=False))
    assert type(ours.model.layers[0].input_layernorm).__name__ == "OffsetRMSNorm"
    assert type(ours.model.layers[0].mlp.act_fn).__name__ == "GELUTanh"
    assert float(ours.model.embed_tokens.embed_scale) == 64 ** 0.5
    pos, x = torch.arange(9)[None], torch.zeros(1, dtype=torch.float32)  # transformers' RoPE within one ulp
    assert all(torch.allclose(u, v, rtol=0, atol=6e-8)
               for u, v in zip(ours.model.rotary_emb(x, pos), theirs.model.rotary_emb(x, pos)))


def test_rope_cos_sin_are_the_correctly_rounded_values_the_same_way_on_every_cpu():
    """RoPE's cos and sin come from float64 adds and multiplies (rope_trig), not torch's cos / sin, whose vector
    code gives other last bits on aarch64 than on x86: on 200k angles of Qwen2.5's table (positions to 3,200,
    theta 1e6) they are libm's float64 cos / sin rounded to float32, bit for bit; cos is even and sin odd; an angle
    past the exact reduction's range is refused."""
    import math

    import numpy as np

    inv = 1.0 / (1000000.0 ** (torch.arange(0, 128, 2, dtype=torch.float) / 128))
    angles = (torch.arange(0, 3200, dtype=torch.float)[:, None] * inv[None, :]).flatten()
    cos, sin = rope_cos_sin(angles)
    a64 = angles.double().tolist()
    assert np.array_equal(cos.numpy(), np.array([math.cos(a) for a in a64]).astype(np.float32))
    assert np.array_equal(sin.numpy(), np.array([math.sin(a) for a in a64]).astype(np.float32))
    neg = rope_cos_sin(-angles[:500])
    assert torch.equal(neg[0], cos[:500]) and torch.equal(neg[1], -sin[:500])
    with pytest.raises(ValueError, match="outside"):
        rope_cos_sin(torch.tensor([2e6]))
    # A pass's table checks its positions against the bound taken once from its largest inverse frequency, not its
    # angles: the same bits as the angles checked one by one, and a position past the bound refused
    from simllm_ros.model.rope_trig import check_positions, max_position

    most = max_position(inv)
    assert most == int(1.5e6 / float(inv.max()))
    pos = torch.arange(0, 3200)
    assert all(torch.equal(a, b) for a, b in zip(rope_cos_sin(angles, bounded=True), (cos, sin)))
    check_positions(pos, most)
    check_positions(torch.tensor([-most]), most)
    with pytest.raises(ValueError, match="outside"):
        check_positions(torch.tensor([most + 1]), most)
