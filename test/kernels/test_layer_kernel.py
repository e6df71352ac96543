"""A pass's layers in one C call (layer_kernel): bitwise what the same layers give run one by one from Python,
for every kind of pass the engine makes (prefill, decode steps, tokens at their own slots, resumed rows,
several sequences at once), on this CPU's lossless default where it runs (bf16 on 4-bit AMX products; float32 on
the 4-bit vector kernel, portable C), and on a Gemma 3 GGUF's own blocks (float32: norms of x * (1 + w), norms of
the attention and MLP outputs, tanh GELU, 16-token windows on most layers, a RoPE table per layer type)."""
from __future__ import annotations

import os

import pytest
import torch

from simllm_ros.kernels import layer_kernel
from simllm_ros.model.kv_buffer import KVBuffer, Seq

KERNEL = layer_kernel.load()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason=f"layer kernel: {layer_kernel.why_not()}")


_GEMMA = {}


def _gemma_runner():
    """A random Gemma 3 GGUF (7 layers, the sixth full attention, the rest 16-token windows; the full layers' RoPE
    base 1,000,000 as Gemma 3's, the sliding ones' 10,000) on its own Q4_K_M blocks in float32, once per process."""
    if not _GEMMA:
        import atexit
        import shutil
        import tempfile

        from random_gguf import Q4_K_M, write_llama
        from simllm_ros.model.model_backend import ModelBackend

        root = tempfile.mkdtemp(prefix="simllm-gemma3-layers-")
        atexit.register(shutil.rmtree, root, True)
        path = write_llama(os.path.join(root, "rand-gemma3.gguf"), arch="gemma3", layers=7, hidden=256, inter=512,
                           heads=4, kv_heads=1, head_dim=64, types=Q4_K_M, embed="Q8_0", output=None, seed=9,
                           sliding_window=16, rope_base=1e6)
        _GEMMA["backend"] = ModelBackend(path, dtype="float32", weight_bits=0, cache_dir=os.path.join(root, "models"))
    return _GEMMA["backend"].runner


def _runner(model="embedded"):
    if model == "gemma3":
        r = _gemma_runner()
        assert r.fused is not None, "the C layers take Gemma 3 in float32"
        assert r.windowed and 0 in r.window and len(r.rope_types) == 2
        return r
    from core_fixtures import LOSSLESS, shared_engine

    r = shared_engine(**LOSSLESS).backend.runner
    if r is None or r.fused is None:
        pytest.skip("the default model does not run its layers in C here (not a 4-bit configuration on our kernels)")
    return r


MODELS = pytest.mark.parametrize("model", ["embedded", "gemma3"])


def _both(r, fn):
    """fn() with the layers in C, then from Python: both results (restores the runner)."""
    out = []
    try:
        for in_c in (True, False):
            r.layers_in_c = in_c
            out.append(fn())
    finally:
        r.layers_in_c = True
    return out


def _buffer(r, capacity):
    return KVBuffer.allocate(len(r.layers), r.n_kv, r.head_dim, capacity, r.dtype, "cpu")


def _ids(n, seed=0):
    return torch.randint(0, 40000, (n,), generator=torch.Generator().manual_seed(seed))


@needs_kernel
@MODELS
@pytest.mark.parametrize("n", [1, 2, 17, 57, 130])
def test_prefill_and_decode_steps_equal_the_python_layers(model, n):
    r = _runner(model)
    ids = _ids(n + 3, n)

    def run():
        kv = _buffer(r, n + 8)
        logits = [r.forward(ids[:n], torch.arange(n), kv, 0, logits="all")]
        for i in range(n, n + 3):  # decode steps, one token each (single rows where the runner allows them)
            logits.append(r.forward(ids[i:i + 1], torch.tensor([i]), kv, i, logits="last"))
        return logits, kv.k[:, :, :n + 3].clone(), kv.v[:, :, :n + 3].clone()

    (lc, kc, vc), (lp, kp, vp) = _both(r, run)
    assert all(torch.equal(a, b) for a, b in zip(lc, lp))
    assert torch.equal(kc, kp) and torch.equal(vc, vp)


@needs_kernel
@MODELS
def test_own_slots_resumed_rows_and_batches_equal_the_python_layers(model):
    r = _runner(model)
    n = 60
    ids = _ids(n, 3)
    slots = torch.tensor([5, 6, 19, 33, 34, 35, 59])

    def run():
        kv = _buffer(r, n + 4)
        r.forward(ids, torch.arange(n), kv, 0, logits="none")
        scattered = r.forward(ids[slots], slots, kv, 0, slots=slots, logits="all")  # tokens at their own slots
        hidden = r.forward(ids[slots], slots, kv, 0, slots=slots, logits="none", n_layers=2)  # early layers only
        kept = hidden.clone()
        resumed = r.forward(ids[slots], slots, kv, 0, slots=slots, logits="last", hidden=hidden, first_layer=2)
        assert torch.equal(hidden, kept)  # the caller's rows are not written over
        a, b = _buffer(r, 40), _buffer(r, 40)
        batch = r.forward_batch([Seq(ids[:30], torch.arange(30), a, 0, logits="all"),
                                 Seq(ids[30:51], torch.arange(21), b, 0, logits="last")])
        return [scattered, hidden, resumed, *batch, kv.k[:, :, :n].clone(), a.k[:, :, :30].clone(),
                b.v[:, :, :21].clone()]

    c, p = _both(r, run)
    assert all(torch.equal(x, y) for x, y in zip(c, p))


@needs_kernel
@MODELS
def test_the_early_pass_finishes_its_last_layer_as_the_c_layers_do(model):
    """The early pass runs its last layer's MLP from Python: with the C layers' SiLU (GELU), its rows are bitwise a
    whole pass's (the semantic repair resumes from them)."""
    r = _runner(model)
    n = 50
    ids = _ids(n, 5)
    whole = _buffer(r, n + 2)
    h_whole = r.forward(ids, torch.arange(n), whole, 0, logits="none", n_layers=2)
    kv = _buffer(r, n + 2)
    rows, h = r.early.early_pass(ids, kv, 2, lambda k, v: [3, 17, 49])
    assert rows.tolist() == [3, 17, 49]
    assert torch.equal(h, h_whole[rows])
    assert torch.equal(kv.k[:2, :, :n], whole.k[:2, :, :n]) and torch.equal(kv.v[:2, :, :n], whole.v[:2, :, :n])


@pytest.mark.skipif(KERNEL is None or not KERNEL.takes(torch.bfloat16), reason="no bf16 C layers here")
def test_silu_mul_is_close_to_torch_and_refuses_bad_rows():
    g = torch.Generator().manual_seed(0)
    gu = (torch.randn(37, 2 * 1536, generator=g) * 4).to(torch.bfloat16)
    ours = KERNEL.silu_mul(gu, 1536).float()
    ref = (torch.nn.functional.silu(gu[:, :1536]) * gu[:, 1536:]).float()
    step = ref.abs().clamp(min=1e-3) * 2 ** -7  # one bf16 step, twice rounded
    assert ((ours - ref).abs() <= 2 * step).all()
    assert (ours == ref).float().mean() > 0.99  # measured: all equal here (0 of 11.9M real activations differ)
    assert torch.equal(KERNEL.silu_mul(gu[5:6], 1536), KERNEL.silu_mul(gu, 1536)[5:6])  # row-invariant
    with pytest.raises(ValueError):
        KERNEL.silu_mul(gu.half(), 1536)
    with pytest.raises(ValueError):
        KERNEL.silu_mul(gu[:, :100], 50)


@needs_kernel
def test_float32_silu_mul_is_close_to_torch_and_row_invariant():
    g = torch.Generator().manual_seed(1)
    gu = torch.randn(37, 2 * 1536, generator=g) * 4
    ours = KERNEL.silu_mul(gu, 1536)
    ref = torch.nn.functional.silu(gu[:, :1536]) * gu[:, 1536:]
    assert ours.dtype == torch.float32 and (ours - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert torch.equal(KERNEL.silu_mul(gu[5:6], 1536), ours[5:6])


@needs_kernel
def test_kept_rope_tables_are_the_computed_ones():
    """The RoPE rows a runner keeps per position (runner_layers.LayerSteps.rope_tables) have the bits of tables computed for
    the pass's positions alone: Gemma 3's two tables (sliding and full layers), positions across the kept blocks'
    growth and beyond what is kept."""
    from simllm_ros.model.runner_layers import ROPE_CACHE_POSITIONS

    r = _gemma_runner()
    h = torch.empty(1, 1, 8, dtype=r.dtype)
    for pos in ([0], [511], [512], [700, 3, 9], list(range(0, 1500, 7)), [ROPE_CACHE_POSITIONS - 1],
                [ROPE_CACHE_POSITIONS + 5]):
        p = torch.tensor(pos)
        got, want = r.steps.rope_tables(h, p), r.steps.rope_computed(h, p)
        assert got[0].shape == want[0].shape == (2, len(pos), 1, r.head_dim)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), pos


@needs_kernel
def test_argmax_is_torchs_index_with_ties_nans_and_infinities():
    """Greedy's pick in C (decoding.Sampler uses it where the library is loaded): torch.argmax's index on every
    case where an index could differ: ties (the first), NaNs (the first, wherever), all -inf, +-0, every tail length
    around the 16-lane vectors, and a 151,936-logit vocabulary; a torch.argmax-equal greedy pick either way."""
    from simllm_ros.model.decoding import Sampler

    g = torch.Generator().manual_seed(3)
    cases = []
    for n in (1, 2, 15, 16, 17, 33, 1000, 151936):
        x = torch.randn(n, generator=g)
        cases += [x, torch.round(torch.randn(n, generator=g) * 2), torch.full((n,), float("-inf")), torch.zeros(n),
                  -torch.zeros(n), torch.randint(0, 3, (n,), generator=g).float()]
        for at in {0, n // 2, n - 1}:
            for v in (float("nan"), float("inf")):
                w = x.clone()
                w[at] = v
                cases.append(w)
        two = x.clone()
        two[n // 3], two[-1] = float("nan"), float("nan")
        cases.append(two)
    assert [KERNEL.argmax(c) for c in cases] == [int(torch.argmax(c)) for c in cases]
    row = torch.randn(1, 151936, generator=g)
    assert Sampler().pick(row[0], 0) == KERNEL.argmax(row[:, ::1]) == int(torch.argmax(row))
    assert KERNEL.argmax(row.t()) == int(torch.argmax(row))  # a strided view is read as its values
    with pytest.raises(ValueError):
        KERNEL.argmax(row.double())


@needs_kernel
def test_float32_gelu_mul_is_close_to_torch_and_row_invariant():
    """Gemma 3's tanh GELU as the C layers compute it (x / (1 + exp(-2z))): as close to the float64 function as
    torch's float32 gelu(approximate="tanh") is, over the range activations take (the tails included; measured:
    1.6e-7 vs torch's 1.4e-7 of |gate * up| at most), the same bits alone and among rows; bf16 has none."""
    from simllm_ros.kernels.layer_kernel import ACT_GELU_TANH

    g = torch.Generator().manual_seed(2)
    gu = torch.randn(37, 2 * 1536, generator=g) * 4
    gu[0, :1536] = torch.linspace(-30, 30, 1536)
    ours = KERNEL.silu_mul(gu, 1536, ACT_GELU_TANH)
    exact = torch.nn.functional.gelu(gu[:, :1536].double(), approximate="tanh") * gu[:, 1536:].double()
    size = (gu[:, :1536] * gu[:, 1536:]).abs().double().clamp(min=1e-30)
    torch32 = torch.nn.functional.gelu(gu[:, :1536], approximate="tanh") * gu[:, 1536:]
    worst = lambda y: float(((y.double() - exact).abs() / size).max())  # noqa: E731
    assert ours.dtype == torch.float32 and worst(ours) <= max(3e-7, 2 * worst(torch32)), (worst(ours), worst(torch32))
    assert torch.equal(KERNEL.silu_mul(gu[5:6], 1536, ACT_GELU_TANH), ours[5:6])
    assert not torch.equal(ours, KERNEL.silu_mul(gu, 1536))
    with pytest.raises(ValueError):
        KERNEL.silu_mul(gu.bfloat16(), 1536, ACT_GELU_TANH)


def test_other_configurations_keep_the_python_layers():
    """16-bit weights: no C layers, torch's SiLU, and the load log says so."""
    from core_fixtures import shared_engine

    b = shared_engine(weight_bits=16).backend
    if b.runner is not None:
        assert b.runner.fused is None and b.layers_kind == "python"
        assert b.layers_path.startswith("Python")


def test_the_python_layers_can_be_chosen():
    """SIMLLM_LAYERS=python keeps the layer-by-layer loop (and torch's SiLU); a new process loads the same
    library otherwise."""
    from core_fixtures import kernel_in_new_process

    off, why, _ = kernel_in_new_process("layer_kernel", {"SIMLLM_LAYERS": "python"})
    assert off and why == "SIMLLM_LAYERS=python", why
    off, why, path = kernel_in_new_process("layer_kernel")
    if KERNEL is None:
        assert off, path
    else:
        assert path == KERNEL.path


@needs_kernel
@MODELS
@pytest.mark.parametrize("n", [7, 8, 9, 57, 130])
def test_the_steps_between_products_split_over_threads_change_no_bit(model, n):
    """From GLUE_MIN_ROWS rows the norms, residual adds, RoPE and SiLU run split by rows over the 4-bit kernel's
    kept workers: at 2 and 3 threads the C layers give the bits of one thread and of the Python layers."""
    r = _runner(model)
    ids = _ids(n, 40 + n)
    before = torch.get_num_threads()

    def run():
        kv = _buffer(r, n + 2)
        return r.forward(ids, torch.arange(n), kv, 0, logits="all"), kv.k[:, :, :n].clone(), kv.v[:, :, :n].clone()
    try:
        got = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            got.append(run())
        r.layers_in_c = False
        python = run()
    finally:
        r.layers_in_c = True
        torch.set_num_threads(before)
    for g in got[1:] + [python]:
        assert all(torch.equal(a, b) for a, b in zip(got[0], g))
