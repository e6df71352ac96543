"""The AMX 4-bit product kernel (int4_kernel): what the weights say, bitwise the same for a row whatever rows,
threads or pass come with it, bad input refused, and the model's projections on it.

Skipped where the kernel cannot run (no AMX-BF16, no compiler): the runner then keeps ATen's kernel."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from simllm_ros.kernels import int4_kernel
from simllm_ros.model.runner_weights import int4_codes, int4_dequantized, Proj

KERNEL = int4_kernel.load()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason=f"int4 kernel: {int4_kernel.why_not()}")


def _weights(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    codes, sz = int4_codes(w)
    return codes, sz, int4_dequantized(codes, sz)


@needs_kernel
@pytest.mark.parametrize("n,k", [(48, 96), (960, 576), (576, 1536)])
@pytest.mark.parametrize("m", [1, 5, 16, 17, 37])
def test_products_are_what_the_4bit_weights_say(n, k, m):
    codes, sz, w = _weights(n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    got = KERNEL.mm(x, KERNEL.pack(codes, sz), n).float()
    want = x.float() @ w.t()  # float64-free reference: float32 products of the same dequantized weights
    # bf16 output rounding (2^-8 relative) plus float32 sums: well inside 1% of the largest output
    assert (got - want).abs().max() <= 0.01 * want.abs().max()
    assert (got - want).abs().mean() <= 0.004 * want.abs().mean()


@needs_kernel
def test_a_row_gets_the_same_bits_whatever_rows_and_threads_come_with_it(monkeypatch):
    codes, sz, _ = _weights(960, 576, seed=3)
    blob = KERNEL.pack(codes, sz)
    x = torch.randn(41, 576, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    whole = KERNEL.mm(x, blob, 960)
    for a, b in ((0, 1), (7, 8), (3, 19), (16, 33), (40, 41), (0, 16), (0, 17)):  # tile blocks of 16 cut differently
        assert torch.equal(KERNEL.mm(x[a:b], blob, 960), whole[a:b]), (a, b)
    strided = torch.randn(41, 700, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    strided[:, :576] = x
    assert torch.equal(KERNEL.mm(strided[:, :576], blob, 960), whole)  # rows read in place with their stride
    monkeypatch.setattr(int4_kernel, "THREAD_MIN_MACS", 0)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        assert torch.equal(KERNEL.mm(x, blob, 960), whole)  # threads split the outputs, never a sum
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_products_from_two_threads_at_once_do_not_mix(monkeypatch):
    """Two engines in one process (the concurrency benchmark) call the kernel at once: one uses the worker
    threads, the other computes alone meanwhile; both get their own, exact results."""
    import threading

    monkeypatch.setattr(int4_kernel, "THREAD_MIN_MACS", 0)
    codes, sz, _ = _weights(960, 576, seed=6)
    blob = KERNEL.pack(codes, sz)
    xs = [torch.randn(m, 576, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16) for m in (1, 7)]
    want = [KERNEL.mm(x, blob, 960) for x in xs]
    bad = []
    threads = torch.get_num_threads()
    torch.set_num_threads(2)

    def hammer(i):
        for _ in range(200):
            if not torch.equal(KERNEL.mm(xs[i], blob, 960), want[i]):
                bad.append(i)

    try:
        ts = [threading.Thread(target=hammer, args=(i,)) for i in (0, 1)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in ts), "a product never finished"
    finally:
        torch.set_num_threads(threads)
    assert not bad


@needs_kernel
def test_bad_input_is_refused():
    codes, sz, _ = _weights(48, 96)
    blob = KERNEL.pack(codes, sz)
    with pytest.raises(ValueError, match="bf16 rows"):
        KERNEL.mm(torch.randn(3, 96), blob, 48)  # float32 input
    with pytest.raises(ValueError, match="bf16 rows"):
        KERNEL.mm(torch.randn(3, 64).to(torch.bfloat16), blob, 48)  # input size the weights were not packed for
    with pytest.raises(ValueError, match="bf16 rows"):
        KERNEL.mm(torch.randn(96, 3).to(torch.bfloat16).t(), blob, 48)  # columns not contiguous
    with pytest.raises(ValueError, match="outputs in 16s"):
        KERNEL.pack(codes[:40], sz[:, :40])


@needs_kernel
def test_the_model_projections_run_on_it_and_agree_with_aten():
    """The default model (4-bit bf16) holds its projections in the kernel's layout, and a projection of real
    weights gives what ATen's int4 kernel gives up to rounding (~1 element in 10^6 differs by one bf16 step)."""
    from core_fixtures import shared_engine

    b = shared_engine(dtype="bfloat16", kv_bits=0).backend
    if b.weight_bits != 4:
        pytest.skip("the default model is not 4-bit here")
    r = b.runner
    assert r.int4 is KERNEL and b.int4_kind == "amx" and KERNEL.path in b.int4_path
    assert all(layer[i].blob is not None and layer[i].w4 is None for layer in r.layers for i in (1, 2, 4, 5))
    w = int4_dequantized(*int4_codes(torch.randn(1536, 576).to(torch.bfloat16))).to(torch.bfloat16)
    ours, aten = Proj(w, None, 4, KERNEL), Proj(w, None, 4, None)
    assert ours.blob is not None and aten.w4 is not None
    x = torch.randn(23, 576).to(torch.bfloat16)
    a, o = aten(x).float(), ours(x).float()
    assert (a - o).abs().max() <= 0.01 * a.abs().max()
    assert (a == o).float().mean() >= 0.99


@needs_kernel
def test_each_groups_input_sum_is_added_in_input_order():
    """The zero point multiplies a group's input sum, computed 16 groups to a vector; each sum must be the one
    added input by input in order, as for a group alone. Codes of 8 (a weight of 0) and zero 1 make the output
    that sum: inputs of 2^25, ones and -2^25, where float32 loses each 1 added after the big value, tell the order
    (a tree or another order keeps some of them)."""
    n, k, groups = 16, 576, 18  # 16 groups in the vector code, 2 after it
    blob = KERNEL.pack(torch.full((n, k), 8, dtype=torch.int32),
                       torch.stack([torch.full((groups, n), 0.5), torch.ones(groups, n)], dim=-1).to(torch.bfloat16))
    x = torch.ones(3, k)
    for r in range(3):
        for g in range(groups):
            at = (5 * g + 3 * r) % 31  # where the big value sits: the ones before it count, the ones after it do not
            x[r, g * 32 + at] = 2.0 ** 25
            x[r, g * 32 + 31] = -(2.0 ** 25)
    x = x.to(torch.bfloat16)
    want = torch.empty(3, groups)
    for r in range(3):
        for g in range(groups):
            s = np.float32(0)
            for v in x[r, g * 32:(g + 1) * 32].float().numpy():
                s = np.float32(s + v)
            want[r, g] = float(s)
    got = KERNEL.mm(x, blob, n)  # every output of a row: 1 x each group's input sum, added group by group
    assert torch.equal(got, _sequential_over_groups(want).expand(3, n).to(torch.bfloat16))
    one_group = KERNEL.pack(torch.full((n, 32), 8, dtype=torch.int32),
                            torch.stack([torch.full((1, n), 0.5), torch.ones(1, n)], dim=-1).to(torch.bfloat16))
    for g in range(groups):  # and each group's sum alone, through a one-group product of the same inputs
        alone = KERNEL.mm(x[:, g * 32:(g + 1) * 32].contiguous(), one_group, n)
        assert torch.equal(alone[:, 0].float(), want[:, g].to(torch.bfloat16).float()), g


def _sequential_over_groups(sums: torch.Tensor) -> torch.Tensor:
    """The kernel's own order over groups: out = fma(1, sum_g, out) from g = 0 on, in float32."""
    out = np.zeros(sums.shape[0], dtype=np.float32)
    for g in range(sums.shape[1]):
        out = (out + sums[:, g].numpy().astype(np.float32)).astype(np.float32)
    return torch.from_numpy(out)[:, None]


@needs_kernel
def test_a_range_of_outputs_is_those_columns_of_the_whole_product():
    """The early pass of semantic repair computes keys and values for every token and queries for a few: a range
    of a projection's outputs must be bitwise those columns of the whole product, bias included."""
    w = (torch.randn(960, 576, generator=torch.Generator().manual_seed(5)) * 0.05).to(torch.bfloat16)
    bias = torch.randn(960, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    for b in (None, bias):
        proj = Proj(w, b, 4, KERNEL)
        for m in (1, 2, 17, 40):
            x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
            whole = proj(x)
            for a, e in ((576, 960), (0, 576), (16, 48), (944, 960)):
                assert torch.equal(proj.columns(x, a, e), whole[:, a:e]), (m, a, e)
    with pytest.raises(ValueError, match="16s"):
        proj.columns(x, 8, 64)
    with pytest.raises(ValueError, match="our 4-bit kernels"):  # aten's int4 product: no columns of its own
        Proj(w, None, 4, None).columns(x, 0, 16)


def test_aten_can_be_chosen_and_the_built_library_is_reused():
    from core_fixtures import kernel_in_new_process

    off, why, _ = kernel_in_new_process("int4_kernel", {"SIMLLM_INT4": "aten"})
    assert off and why == "SIMLLM_INT4=aten", why
    off, why, path = kernel_in_new_process("int4_kernel")
    if KERNEL is None:
        assert off, path  # no AMX here: the same answer in a new process
    else:
        assert path == KERNEL.path  # the library built once per machine is the one loaded


@needs_kernel
def test_8bit_products_are_what_the_codes_say_and_row_invariant():
    """The LM head's 8-bit groups (mm8): against float32 products of the same weights, rows cut any way."""
    from simllm_ros.model.runner_weights import q8_codes

    w = (torch.randn(4096, 576, generator=torch.Generator().manual_seed(4)) * 0.05).to(torch.bfloat16)
    codes, d = q8_codes(w)
    blob = KERNEL.pack8(codes, d)
    deq = (codes.float().reshape(4096, -1, 32) * d[..., None]).reshape(4096, 576)
    x = torch.randn(35, 576, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    got = KERNEL.mm8(x, blob, 4096)
    assert got.dtype == torch.float32
    want = x.float() @ deq.t()
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()  # float32 out: only the sums' rounding
    for a, b in ((0, 1), (1, 3), (5, 21), (16, 35), (0, 17)):
        assert torch.equal(KERNEL.mm8(x[a:b], blob, 4096), got[a:b]), (a, b)
    with pytest.raises(ValueError, match="int8 kernel"):
        KERNEL.mm8(x.float(), blob, 4096)
    with pytest.raises(ValueError, match="int8 kernel"):
        KERNEL.mm8(x, blob, 2048)  # weights packed for another size


def test_the_q8_grid_check_tells_the_files_embedding_from_other_weights():
    from core_fixtures import shared_engine
    from simllm_ros.model.runner_weights import Head8, on_q8_grid

    b = shared_engine(dtype="bfloat16", kv_bits=0).backend
    emb = b.runner.embed.weight.data
    assert on_q8_grid(emb)  # SmolLM2's GGUF keeps the (tied) embedding in Q8_0
    assert not on_q8_grid((torch.randn(64, 96) * 0.05).to(torch.bfloat16))  # arbitrary weights: not on a grid
    if KERNEL is not None and b.weight_bits == 4:
        assert isinstance(b.runner.lm_head, Head8)  # the head runs on the file's own 8-bit codes
        x = torch.randn(3, emb.shape[1]).to(torch.bfloat16)
        dense = x.float() @ emb.float().t()
        got = b.runner.lm_head(x)
        assert (got - dense).abs().max() <= 0.02 * dense.abs().max()  # the same weights to their bf16 rounding
