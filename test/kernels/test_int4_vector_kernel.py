"""The float32 4-bit / 8-bit product kernel for CPUs without AMX (int4_vector_kernel): what the weights say, a
row's bits whatever rows, threads or path come with it, bad input refused, and the embedded model on it with
lossless reuse (the load-time invariance probe passes).

Skipped where it cannot be built (no C compiler): float32 then has no lossless 4-bit path."""
from __future__ import annotations

import threading

import pytest
import torch

from simllm_ros.kernels import int4_vector_kernel
from simllm_ros.kernels import build, vector_blobs
from simllm_ros.model.runner_weights import int4_codes, int4_dequantized, Proj, q8_codes

KERNEL = int4_vector_kernel.load()
pytestmark = pytest.mark.skipif(KERNEL is None, reason=f"vector kernel: {int4_vector_kernel.why_not()}")


def _weights(n: int, k: int, seed: int = 0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    codes, sz = int4_codes(w)
    return codes, sz, int4_dequantized(codes, sz)


@pytest.mark.parametrize("n,k", [(48, 96), (960, 576), (576, 1536)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 33, 70])
def test_products_are_what_the_weights_say(n, k, m):
    codes, sz, w = _weights(n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    got = KERNEL.mm(x, KERNEL.pack(codes, sz), n).double()
    want = x.double() @ w.double().t()
    assert (got - want).abs().max() <= 2e-5 * want.abs().max()  # float32 sums of ~1000 terms
    q8, d = q8_codes(w)
    got8 = KERNEL.mm8(x, KERNEL.pack8(q8, d), n).double()
    want8 = x.double() @ (q8.double().reshape(n, -1, 32) * d.double()[..., None]).reshape(n, k).t()
    assert (got8 - want8).abs().max() <= 2e-5 * want8.abs().max()


@pytest.mark.parametrize("eight", [False, True])
def test_a_row_gets_the_same_bits_whatever_rows_paths_and_threads_come_with_it(monkeypatch, eight):
    """Fewer than 12 rows take the register path (6 or 3 at a time, then 2 or 1, each block's weights decoded once for
    them), more the decoded-group path in chunks of 36 rows, 6 or 3 at a time and the rest one by one: every cut
    below mixes them, and must not change a row."""
    codes, sz, w = _weights(1344, 576, seed=3)
    if eight:
        blob, mm = KERNEL.pack8(*q8_codes(w)), KERNEL.mm8
    else:
        blob, mm = KERNEL.pack(codes, sz), KERNEL.mm
    x = torch.randn(75, 576, generator=torch.Generator().manual_seed(1))
    whole = mm(x, blob, 1344)
    for a, b in ((0, 1), (7, 9), (3, 6), (10, 14), (20, 25), (30, 41), (50, 62), (16, 33), (40, 73), (74, 75), (0, 32),
                 (1, 36)):
        assert torch.equal(mm(x[a:b], blob, 1344), whole[a:b]), (a, b)
    strided = torch.randn(75, 700)
    strided[:, :576] = x
    assert torch.equal(mm(strided[:, :576], blob, 1344), whole)  # rows read in place with their stride
    monkeypatch.setattr(int4_vector_kernel, "THREAD_MIN_MACS", 0)
    threads = torch.get_num_threads()
    try:
        for t in (2, 3):
            torch.set_num_threads(t)
            assert torch.equal(mm(x, blob, 1344), whole)  # threads split the outputs, never a sum
            assert torch.equal(mm(x[5:6], blob, 1344), whole[5:6])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name, blob_bytes, group", [
    ("mm4k8", vector_blobs.BLOB4K8, 256), ("mm5k8", vector_blobs.BLOB5K8, 256), ("mm3k8", vector_blobs.BLOB3K, 256),
    ("mm6k8", vector_blobs.BLOB6K, 256), ("mm8r", vector_blobs.BLOB8R, 32), ("mm5r", vector_blobs.BLOB5R, 32),
    ("mm4r", vector_blobs.BLOB4R, 32), ("mm51r", vector_blobs.BLOB51R, 32), ("mmiq4r", vector_blobs.BLOBIQ4, 32),
    ("mmiq4xs", vector_blobs.BLOBIQ4XS, 256)])
def test_8bit_row_products_give_a_row_the_same_bits_whatever_rows_come_with_it(monkeypatch, name, blob_bytes, group):
    """The 8-bit-row products take up to 4 rows over a block's weights, 5 to 16 (several requests' decode steps)
    unit by unit with the weights ahead prefetched, more again 4 at a time: every cut below mixes the paths and
    must not change a row's bits (random blobs: NaNs and all, compared as bits), at 1 and 2 threads."""
    g = torch.Generator().manual_seed(11)
    n, k = 96, 512
    blob = torch.randint(0, 256, (n // 16, k // group, blob_bytes), dtype=torch.uint8, generator=g)
    x = torch.randn(21, k, generator=g)
    mm = getattr(KERNEL, name)
    whole = mm(x, blob, n).view(torch.int32)
    monkeypatch.setattr(int4_vector_kernel, "THREAD_MIN_MACS", 0)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for a, b in ((0, 1), (0, 4), (0, 5), (3, 11), (2, 18), (0, 16), (0, 17), (4, 21), (20, 21), (5, 13)):
                assert torch.equal(mm(x[a:b].contiguous(), blob, n).view(torch.int32), whole[a:b]), (t, a, b)
    finally:
        torch.set_num_threads(threads)


def test_columns_are_those_of_the_whole_product_and_two_callers_do_not_mix(monkeypatch):
    codes, sz, w = _weights(960, 576, seed=5)
    p = Proj(w, None, 4, KERNEL)
    assert p.blob is not None and p.four_bit
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(2))
    whole = p(x)
    assert torch.equal(p.columns(x, 576, 960), whole[:, 576:960])
    monkeypatch.setattr(int4_vector_kernel, "THREAD_MIN_MACS", 0)
    xs = [torch.randn(m, 576, generator=torch.Generator().manual_seed(m)) for m in (1, 7)]
    want = [KERNEL.mm(x, p.blob, 960) for x in xs]
    bad, threads = [], torch.get_num_threads()
    torch.set_num_threads(2)

    def hammer(i):
        for _ in range(200):
            if not torch.equal(KERNEL.mm(xs[i], p.blob, 960), want[i]):
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


def test_bad_input_is_refused():
    codes, sz, _ = _weights(48, 96)
    blob = KERNEL.pack(codes, sz)
    with pytest.raises(ValueError, match="float32 rows"):
        KERNEL.mm(torch.randn(3, 96).to(torch.bfloat16), blob, 48)
    with pytest.raises(ValueError, match="float32 rows"):
        KERNEL.mm(torch.randn(3, 64), blob, 48)  # an input size the weights were not packed for
    with pytest.raises(ValueError, match="float32 rows"):
        KERNEL.mm(torch.randn(96, 3).t(), blob, 48)  # columns not contiguous
    with pytest.raises(ValueError, match="float32 rows"):
        KERNEL.mm8(torch.randn(3, 96), blob, 48)  # 4-bit weights to the 8-bit product
    with pytest.raises(ValueError, match="outputs in 16s"):
        KERNEL.pack(codes[:40], sz[:, :40])


def test_the_embedded_model_in_float32_runs_on_it_losslessly():
    """float32 with 4-bit weights: every projection and the LM head (the file's Q8_0 codes) on this kernel, norms
    in C, the invariance probe passes (exact-prefix reuse and drafts are lossless), and one token runs as one row;
    its logits are close to those of the same weights in dense float32 (transformers' forward)."""
    from simllm_ros.model.model_backend import ModelBackend
    from simllm_ros.settings import DEFAULT_MODEL

    b = ModelBackend(DEFAULT_MODEL, "cpu", "float32", weight_bits=4)
    r = b.runner
    assert b.int4_kind == "vector" and r.int4 is KERNEL and getattr(r.lm_head, "bits", 16) == 8
    assert all(layer[i].blob is not None for layer in r.layers for i in (1, 2, 4, 5))
    assert r.norm.kernel is not None and b.exact_chunking and r.single_rows
    ids = b.tokenizer("The weather in Riverside District: sunny, 21 C, light wind. Will it rain?")["input_ids"]
    ours = b.run(ids, b.new_cache(len(ids) + 2), logits="all")
    ref = b.hf_model(torch.tensor([ids])).logits[0].float()  # a dense float32 copy of the file
    assert torch.equal(ours.argmax(-1), ref.argmax(-1)) or (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    assert (ours - ref).abs().max() <= 0.05 * ref.abs().max()


def test_the_portable_c_without_avx2_computes_the_same_way():
    """Built without AVX2 and FMA (what a CPU without them, or aarch64, compiles: GCC's generic vectors), the
    kernel still computes what the weights say and a row's bits do not depend on the rows with it."""
    path = build.build("int4_vector", extra_flags=("-mno-avx2", "-mno-fma"), tag="portable")
    portable = int4_vector_kernel.VectorKernel(path)
    assert int4_vector_kernel._self_check(portable) is None
    codes, sz, w = _weights(96, 576, seed=8)
    blob = portable.pack(codes, sz)
    x = torch.randn(23, 576, generator=torch.Generator().manual_seed(4))
    whole = portable.mm(x, blob, 96)
    assert (whole.double() - x.double() @ w.double().t()).abs().max() <= 2e-5 * whole.abs().max()
    assert all(torch.equal(portable.mm(x[a:b].contiguous(), blob, 96), whole[a:b]) for a, b in ((0, 1), (2, 9), (20, 23)))


def test_a_kernel_is_loaded_once_and_the_first_complaint_stands(monkeypatch):
    """product_kernel.Loader (both product kernels load through it): the checks run in order on the built
    kernel, the first complaint is why_not, and a refused kernel is not built or checked again."""
    from simllm_ros.kernels.product_kernel import Loader
    seen = []

    def refuse(kernel):
        seen.append(kernel.path)
        return "refused on this machine"

    loader = Loader("SIMLLM_INT4", "aten", "int4_vector", int4_vector_kernel.VectorKernel,
                    checks=(int4_vector_kernel._self_check, refuse))
    assert loader.load() is None and loader.why_not == "refused on this machine"
    assert loader.load() is None and seen == [KERNEL.path]
    ok = Loader("SIMLLM_INT4", "aten", "int4_vector", int4_vector_kernel.VectorKernel,
                checks=(int4_vector_kernel._self_check,))
    assert ok.load() is ok.load() is not None and ok.why_not is None
    monkeypatch.setenv("SIMLLM_INT4", "aten")
    off = Loader("SIMLLM_INT4", "aten", "int4_vector", int4_vector_kernel.VectorKernel, checks=(refuse,))
    assert off.load() is None and off.why_not == "SIMLLM_INT4=aten" and len(seen) == 1
