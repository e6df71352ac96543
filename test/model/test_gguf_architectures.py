"""A user's GGUF, architectures (issue 30, item 2): what a file says of its model is read from it as llama.cpp reads
it: Mistral named files, RoPE scaling (Llama 3's rope_freqs, linear, YaRN, LongRoPE within the original context), RoPE
on part of each head (Phi), projections off our kernels converted whole, and an architecture the runner does not
take answering approximately and saying so. Files written here with random weights (random_gguf), no download."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from gguf_files import ours_and_transformers
from random_gguf import Q4_K_M
from simllm_ros.kernels import int4_vector_kernel
from simllm_ros.model.model_backend import ModelBackend
from simllm_ros.model.model_files import ModelLoadError

KERNEL = int4_vector_kernel.load()
pytestmark = pytest.mark.skipif(KERNEL is None, reason=f"vector kernel: {int4_vector_kernel.why_not()}")


@pytest.mark.parametrize("arch", ["llama", "smollm3"])
def test_a_gguf_with_projections_off_our_kernels_is_converted_whole(tmp_path, arch):
    """A file whose projections our kernels do not take (F16 here) is converted the whole way, saying why,
    and runs as before (16-bit weights, transformers' model on the dense copy); a SmolLM3 file, which transformers'
    GGUF reader refuses, by our dequantization of each tensor, to the values transformers' SmolLM3 then computes."""
    from random_gguf import write_llama

    path = write_llama(str(tmp_path / "rand-f16.gguf"), layers=4 if arch == "smollm3" else 1, default="F16",
                       embed="Q8_0", output=None, arch=arch)
    said: list[str] = []
    b = ModelBackend(path, dtype="float32", weight_bits=0, cache_dir=str(tmp_path / "models"), progress=said.append)
    assert any("not converting it a tensor at a time: blk.0.attn_q is F16" in m for m in said), said
    assert any("safetensors once" in m for m in said) and not b.skeleton and b.weight_bits == 16
    assert b.model_type == arch
    assert type(b.model).__name__ == ("SmolLM3" if arch == "smollm3" else "Llama") + "ForCausalLM"
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.ffn_up.weight")
    assert torch.equal(b.model.model.layers[0].mlp.up_proj.weight, torch.from_numpy(np.array(t.data, dtype=np.float32)))
    ids = [int(t) for t in range(700, 700 + 9 * 41, 41)]
    assert torch.isfinite(b.run(ids, b.new_cache(12), logits="all")).all()


def test_a_llama_file_named_mistral_runs_as_llama_cpp_runs_it(tmp_path):
    """transformers' GGUF reader takes a llama file whose general.name is "mistral" for a Mistral model with a
    4096-token sliding window llama.cpp does not apply, and its whole conversion then fails: both conversions read
    it as the llama model llama.cpp runs (full attention, on the runner), the dense one too."""
    from random_gguf import write_llama

    path = write_llama(str(tmp_path / "rand-mistral.gguf"), layers=1, types=Q4_K_M, name="mistral")
    for dtype, bits in (("float32", 0), ("bfloat16", 16)):
        b = ModelBackend(path, dtype=dtype, weight_bits=bits, cache_dir=str(tmp_path / dtype))
        assert b.model_type == "llama" and not b.has_sliding_layers and b.runner is not None
        assert b.skeleton == (dtype == "float32") and b.exact_chunking


def test_a_gguf_of_an_architecture_the_runner_does_not_take_answers_approximately_and_says_so(tmp_path):
    """StableLM 2 (LayerNorms with biases, RoPE on a quarter of each head: not the runner's) loads from its GGUF
    through transformers' whole conversion and answers through transformers' forward: every answer `exact: false`,
    no SEMANTIC tier, and the load log says why."""
    from random_gguf import write_llama
    from simllm_ros.request import QueryRequest
    from simllm_ros.serving.engine import Engine
    from simllm_ros.settings import Settings

    path = write_llama(str(tmp_path / "rand-stablelm.gguf"), arch="stablelm", layers=2, heads=4, kv_heads=4,
                       default="Q8_0", embed="Q8_0", output="Q8_0")
    said: list[str] = []
    e = Engine(Settings.from_overrides(model=path, model_cache_dir=str(tmp_path / "models"), dtype="float32",
                                       weight_bits=0, cache_size="64MB"))
    e.load(progress=said.append)
    try:
        b = e.backend
        assert b.model_type == "stablelm" and b.runner is None and not b.exact_chunking and not b.semantic_supported
        assert any("the runner does not take stablelm models" in m for m in said), said
        assert any("NOT verified: transformers' own forward runs this stablelm model" in m for m in said), said
        for q in ("Where is the charging dock?", "Where is the charging dock now?"):
            r = e.handle(QueryRequest(prompt=q, context="The dock is in room 12.", max_new_tokens=4))
            assert r.success and not r.exact and r.generated_tokens > 0, r
    finally:
        e.unload()


def test_llama3_rope_scaling_is_read_from_the_files_rope_freqs(tmp_path):
    """Llama 3.1+ files carry their RoPE scaling as per-frequency divisors (`rope_freqs.weight`, llama.cpp's
    converter), which transformers' GGUF reader drops: a Llama 3.2 file would run with plain RoPE, another model than
    the file's. Both conversions (a tensor at a time; whole, for a dense load) set llama3 scaling whose inverse
    frequencies are the plain ones divided by the file's divisors; divisors that are not llama3 scaling with Llama
    3's parameters are a clear load error, not a silently different model."""
    from random_gguf import llama3_rope_factors, write_llama

    l3 = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    shape = dict(layers=1, hidden=512, inter=1024, heads=8, kv_heads=2, default="Q8_0", embed="Q8_0", output=None,
                 rope_base=500000.0)
    path = write_llama(str(tmp_path / "rand-llama3.gguf"), llama3_rope=l3, **shape)
    divisors = torch.from_numpy(llama3_rope_factors(500000.0, 64, **l3))
    assert (divisors > 1).sum() >= 10 and (divisors == 1).sum() >= 10  # scaled and unscaled frequencies both
    plain = 1.0 / (500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float) / 64))
    said: list[str] = []
    streamed = ModelBackend(path, dtype="float32", weight_bits=0, cache_dir=str(tmp_path / "a"), progress=said.append)
    assert any("one tensor at a time into" in m for m in said) and streamed.skeleton
    dense = ModelBackend(path, dtype="float32", weight_bits=16, cache_dir=str(tmp_path / "b"))
    for b in (streamed, dense):
        rope = b.config.rope_parameters
        assert rope["rope_type"] == "llama3" and rope["factor"] == 32.0, rope
        assert torch.allclose(b.semantic.rope_inv_freqs()[0].float(), plain / divisors, rtol=1e-5, atol=0)
    other = write_llama(str(tmp_path / "rand-other-rope.gguf"), llama3_rope=dict(l3, low_freq_factor=2.0), **shape)
    with pytest.raises(ModelLoadError, match="not Llama 3's RoPE scaling"):
        ModelBackend(other, dtype="float32", weight_bits=0, cache_dir=str(tmp_path / "c"))


def test_linear_rope_scaling_and_gemmas_attention_scale_are_read_from_the_file(tmp_path):
    """What else transformers' GGUF reader leaves out, read as llama.cpp reads it: linear RoPE scaling in the
    metadata (all layers of a Llama; the full-attention layers of a Gemma 3, as in its 4B-27B releases), and Gemma
    3's attention scale 1/sqrt(head_dim) (transformers' default, 256, holds only for 256-wide heads). Any other
    scaling type is a clear load error. (Checked against llama.cpp's logits on such files by
    benchmark/results/gguf_models.md's probe: within 0.05-0.07 of ~3.5 with these, up to 1.5 without.)"""
    from random_gguf import write_llama

    plain = lambda base: 1.0 / (base ** (torch.arange(0, 64, 2, dtype=torch.float) / 64))  # noqa: E731
    shape = dict(hidden=256, inter=512, heads=4, kv_heads=2, head_dim=64, default="Q8_0", embed="Q8_0", output=None)
    llama = write_llama(str(tmp_path / "rand-linear.gguf"), layers=1, rope_scaling=("linear", 8.0), **shape)
    b = ModelBackend(llama, dtype="float32", weight_bits=0, cache_dir=str(tmp_path / "a"))
    assert b.config.rope_parameters == {"rope_type": "linear", "factor": 8.0, "rope_theta": 10000.0}
    assert torch.allclose(b.semantic.rope_inv_freqs()[0], plain(10000.0) / 8, rtol=1e-6, atol=0)
    gemma = write_llama(str(tmp_path / "rand-gemma-linear.gguf"), arch="gemma3", layers=6, rope_base=1e6,
                        rope_scaling=("linear", 8.0), **shape)
    g = ModelBackend(gemma, dtype="float32", weight_bits=0, cache_dir=str(tmp_path / "a"))
    rope = g.config.rope_parameters
    assert rope["full_attention"]["rope_type"] == "linear" and rope["full_attention"]["factor"] == 8.0
    assert rope["sliding_attention"]["rope_type"] == "default"
    tables = dict(zip(g.runner.rope_types, g.semantic.rope_inv_freqs()))
    assert torch.allclose(tables["full_attention"], plain(1e6) / 8, rtol=1e-6, atol=0)
    assert torch.allclose(tables["sliding_attention"], plain(10000.0), rtol=1e-6, atol=0)
    assert g.config.query_pre_attn_scalar == 64 and g.runner.scale == 64 ** -0.5
    other = write_llama(str(tmp_path / "rand-longrope.gguf"), layers=1, rope_scaling=("longrope", 4.0), **shape)
    with pytest.raises(ModelLoadError, match="RoPE scaling 'longrope'"):
        ModelBackend(other, dtype="float32", weight_bits=0, cache_dir=str(tmp_path / "a"))


def test_phi_files_with_rope_on_part_of_each_head_run_as_transformers_and_llama_cpp_compute_them(tmp_path):
    """RoPE on the first dimensions of each head only (Phi-4-mini's 96 of 128; here 48 of 64), which transformers'
    GGUF reader drops: read from the file (`rope.dimension_count`), the runner turns those dimensions in pairs (d, d +
    48 / 2) and leaves the rest, in the C layers as in Python, to transformers' own forward (against llama.cpp's
    logits, gguf_models.md: 0.028-0.034 of ~2, 0.12-0.19 with every dimension rotated); SEMANTIC's key rotation
    moves the rotated part only. With LongRoPE's factors too (Phi-4-mini has both), the same. Another architecture
    with such a count is refused with the reason."""
    from random_gguf import write_llama

    ids = [int(t) for t in range(400, 400 + 17 * 53, 53)]
    for name, extra in (("part", {}), ("part-longrope", {"rope_factors": True})):
        path = write_llama(str(tmp_path / f"rand-{name}.gguf"), arch="phi3", layers=2, default="Q8_0", embed="Q8_0",
                           rope_dims=48, seed=5, **extra)
        b = ModelBackend(path, dtype="float32", weight_bits=0, activation_bits=32, cache_dir=str(tmp_path / name))
        assert b.config.rope_parameters["partial_rotary_factor"] == 0.75 and b.runner.rope_dims == 48
        assert b.layers_kind == "c" and b.exact_chunking and b.semantic_supported
        ours, ref = ours_and_transformers(b, ids)
        assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max(), (ours - ref).abs().max()
        k = torch.randn(2, 2, 5, 64, generator=torch.Generator().manual_seed(0))
        moved = b.rotate_keys(k, torch.tensor([1, 2, 3, 4, 5]))
        assert torch.equal(moved[..., 48:], k[..., 48:]) and not torch.allclose(moved[..., :48], k[..., :48])
    other = write_llama(str(tmp_path / "rand-qwen2-part.gguf"), arch="qwen2", layers=1, default="Q8_0", rope_dims=48)
    with pytest.raises(ModelLoadError, match="rope.dimension_count 48 of heads 64 wide"):
        ModelBackend(other, dtype="float32", weight_bits=0, cache_dir=str(tmp_path / "other"))


def test_longrope_files_run_at_their_short_factors_within_the_original_context(tmp_path):
    """LongRoPE (Phi-3.5-mini, Phi-3 128k): per-frequency divisors for short and long contexts and an attention
    factor on cos/sin, all in the file and dropped by transformers' GGUF reader. Read as llama.cpp reads them: within
    the original context the short factors (llama.cpp's choice for a context that size; probe against its logits in
    gguf_models.md: 0.027-0.032 of ~1.9 with them, 0.085 without the attention factor), on the runner, to
    transformers' own forward of that config; a request past the original context is refused with the reason (the
    long factors would apply there), and the next one is answered. Both conversions read the same config."""
    import numpy as np
    from random_gguf import write_llama

    from simllm_ros.request import QueryRequest
    from simllm_ros.serving.engine import Engine
    from simllm_ros.settings import Settings

    path = write_llama(str(tmp_path / "rand-phi35.gguf"), arch="phi3", layers=2, default="Q8_0", embed="Q8_0",
                       rope_factors=True, metadata={"phi3.rope.scaling.attn_factor": 1.19}, seed=13)
    import gguf

    reader = gguf.GGUFReader(path)
    short = [t for t in reader.tensors if t.name == "rope_factors_short.weight"][0].data.astype(np.float64)
    b = ModelBackend(path, dtype="float32", weight_bits=0, activation_bits=32, cache_dir=str(tmp_path / "a"))
    rope = b.config.rope_parameters
    assert rope["rope_type"] == "longrope" and rope["original_max_position_embeddings"] == 2048
    assert abs(rope["attention_factor"] - 1.19) < 1e-6 and rope["short_factor"] == [float(v) for v in short]
    assert b.runner is not None and b.exact_chunking and b.max_positions == 2048
    plain = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float) / 64))
    assert torch.allclose(b.semantic.rope_inv_freqs()[0], plain / torch.tensor(short, dtype=torch.float), rtol=1e-6,
                          atol=0)
    ids = [int(t) for t in range(400, 400 + 17 * 53, 53)]
    ours = b.run(ids, b.new_cache(20), logits="all")
    with torch.inference_mode():
        ref = b.hf_model(torch.tensor([ids])).logits[0].float()
    assert (ours - ref).abs().max() <= 1e-3 * ref.abs().max(), (ours - ref).abs().max()
    dense = ModelBackend(path, dtype="bfloat16", weight_bits=16, cache_dir=str(tmp_path / "b"))
    assert dense.config.rope_parameters["short_factor"] == rope["short_factor"] and dense.max_positions == 2048
    # set up for 1024 + 512 positions: the short factors; max_prompt_tokens raised live cannot change them
    e = Engine(Settings.from_overrides(model=path, model_cache_dir=str(tmp_path / "a"), dtype="float32",
                                       weight_bits=0, cache_size="64MB", max_prompt_tokens=1024,
                                       max_new_tokens_limit=512))
    e.load()
    try:
        assert not e.backend.long_rope and "rope_factors" not in e.backend.identity
        e.apply_settings({"max_prompt_tokens": 4096})
        long = e.handle(QueryRequest(prompt="Summarise.", context="the dock is closed " * 600, max_new_tokens=4))
        assert not long.success and "past the 2048 positions this model runs at" in long.error, long
        assert "configure with more for the long ones" in long.error, long
        ok = e.handle(QueryRequest(prompt="Where is the dock?", context="The dock is in room 12.", max_new_tokens=4))
        assert ok.success and ok.exact and ok.generated_tokens > 0, ok
    finally:
        e.unload()


def test_longrope_files_take_their_long_factors_where_a_load_serves_past_the_original_context(tmp_path):
    """Set up for more positions than the original context (max_prompt_tokens + max_new_tokens_limit), a LongRoPE
    file takes its long factors at every position, as llama.cpp does for a context that size: the runner computes
    transformers' own forward of that config within and past the original context (1,024 here), the load says so,
    a request past the original context is answered, and its repeat and an empty pool's answer are the same bits.
    The identity says which factors (a snapshot of the short factors' KV is not this load's)."""
    import gguf
    from random_gguf import write_llama

    from simllm_ros.request import QueryRequest
    from simllm_ros.serving.engine import Engine
    from simllm_ros.settings import Settings

    path = write_llama(str(tmp_path / "rand-phi35-long.gguf"), arch="phi3", layers=2, default="Q8_0", embed="Q8_0",
                       rope_factors=True, seed=17, metadata={"phi3.rope.scaling.attn_factor": 1.19,
                                                             "phi3.rope.scaling.original_context_length": 1024})
    reader = gguf.GGUFReader(path)
    long = [t for t in reader.tensors if t.name == "rope_factors_long.weight"][0].data.astype(np.float64)
    said: list[str] = []
    b = ModelBackend(path, dtype="float32", weight_bits=0, activation_bits=32, cache_dir=str(tmp_path / "a"),
                     context_length=1536, progress=said.append)
    rope = b.config.rope_parameters
    assert rope["original_max_position_embeddings"] == 1024 and b.long_rope and b.max_positions == 2048
    assert rope["short_factor"] == [float(v) for v in long] and b.identity["rope_factors"] == "long"
    assert any("LongRoPE: the long factors at every position" in m for m in said), said
    plain = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float) / 64))
    assert torch.allclose(b.semantic.rope_inv_freqs()[0], plain / torch.tensor(long, dtype=torch.float), rtol=1e-6,
                          atol=0)
    for n in (17, 1100):  # within the original context and past it: the long factors both times
        ids = [int(400 + (53 * t) % 40000) for t in range(n)]
        ours = b.run(ids, b.new_cache(n + 3), logits="all")
        with torch.inference_mode():
            ref = b.hf_model(torch.tensor([ids])).logits[0].float()
        assert (ours - ref).abs().max() <= 1e-3 * ref.abs().max(), (n, (ours - ref).abs().max())
    short = ModelBackend(path, dtype="float32", weight_bits=0, activation_bits=32, cache_dir=str(tmp_path / "a"))
    assert not short.long_rope and short.max_positions == 1024 and short.identity != b.identity
    assert not torch.equal(short.run(ids[:17], short.new_cache(20), logits="all"),
                           b.run(ids[:17], b.new_cache(20), logits="all"))  # other tables, other numbers
    e = Engine(Settings.from_overrides(model=path, model_cache_dir=str(tmp_path / "a"), dtype="float32",
                                       weight_bits=0, cache_size="64MB", max_prompt_tokens=1536,
                                       max_new_tokens_limit=64))
    e.load()
    try:
        assert e.backend.long_rope
        q = QueryRequest(prompt="Summarise.", context="the dock is closed " * 250, max_new_tokens=6)
        first = e.handle(q)
        assert first.success and first.exact and first.prompt_tokens > 1024, first
        again = e.handle(q)
        assert again.success and again.exact and again.answer == first.answer, again
        e.clear_pool()
        assert e.handle(q).answer == first.answer
    finally:
        e.unload()


def test_yarn_rope_scaling_is_read_from_the_file_as_llama_cpp_runs_it(tmp_path):
    """YaRN (long-context Qwen2.5 / Qwen3 files): frequencies on a ramp between extrapolation and interpolation by the
    factor over the dimensions that turn 1-32 times in the original context, cos and sin scaled by 1 + 0.1 ln(factor),
    written out here from that description; YaRN with settings we do not implement is a clear load error. (Against
    llama.cpp's logits, benchmark/results/gguf_models.md: within 0.05-0.07 of ~3, 0.45-2.8 without the scaling.)"""
    import math

    from random_gguf import write_llama

    shape = dict(arch="qwen2", layers=1, hidden=256, inter=512, heads=4, kv_heads=2, head_dim=64, default="Q8_0",
                 embed="Q8_0", output=None, rope_base=1e6)
    path = write_llama(str(tmp_path / "rand-yarn.gguf"), rope_scaling=("yarn", 4.0, 512), **shape)
    b = ModelBackend(path, dtype="float32", weight_bits=0, cache_dir=str(tmp_path / "a"))
    assert b.config.rope_parameters["rope_type"] == "yarn" and b.exact_chunking
    dim, base, orig = 64, 1e6, 512
    turns = lambda n: dim * math.log(orig / (n * 2 * math.pi)) / (2 * math.log(base))  # noqa: E731 (dimension index)
    low, high = max(math.floor(turns(32)), 0), min(math.ceil(turns(1)), dim - 1)
    extrapolated = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    ramp = ((torch.arange(dim // 2, dtype=torch.float) - low) / max(high - low, 0.001)).clamp(0, 1)
    assert 0 < low < high < dim // 2 - 1  # some dimensions of each kind
    want = extrapolated / 4 * ramp + extrapolated * (1 - ramp)
    assert torch.allclose(b.semantic.rope_inv_freqs()[0], want, rtol=1e-5, atol=0)
    cos, _ = b.runner.steps.rope_tables(torch.zeros(1, 1, 256), torch.tensor([0]))
    assert torch.allclose(cos[0, 0, 0], torch.full((dim,), 1 + 0.1 * math.log(4)))  # cos(0) times YaRN's scale
    odd = write_llama(str(tmp_path / "rand-yarn-log.gguf"), rope_scaling=("yarn", 4.0, 512),
                      metadata={"qwen2.rope.scaling.yarn_log_multiplier": 0.1}, **shape)
    with pytest.raises(ModelLoadError, match="yarn_log_multiplier"):
        ModelBackend(odd, dtype="float32", weight_bits=0, cache_dir=str(tmp_path / "a"))
