"""4-bit weight products on Intel AMX for the CPU runner: row-invariant like ATen's int4 kernel, faster
from a few rows up (benchmark/results/verified_decoding_notes.md).

Why our own: a pass of several rows (a verification block of drafts, a batched step of several requests, a
prefill) multiplies every 4-bit weight by each row. ATen's CPU kernel (`_weight_int4pack_mm_for_cpu`) does that
with AVX-512 bf16 dot products and gains nothing per row from 4 rows on, so a pass of four flights costs
four times one in its products. AMX tiles multiply a 16-row block by a 32x16 weight block in one
instruction; dequantizing the weights once per pass is then what a pass costs.

Arithmetic, per output row and 16 outputs, group by group of 32 inputs (the grid of the 4-bit codes): the tile
product of the row's bf16 inputs with the codes minus 8 (exact in bf16) in float32, then
out = fma(step, product, out) and out = fma(zero, sum of the group's inputs, out); the result rounded to bf16
once. A row's bits depend on nothing but its own inputs: the tile computes each row on its own, whatever the
rows with it, and rows are cut into blocks of 16, a tile's height; threads split the outputs, not the sum.
ModelBackend.invariance_probe checks the whole model at load as before. It rounds differently from ATen's
kernel (~1 element in 10^6 differs), so the numerics digest differs and pool snapshots of the ATen path are
refused once. C in kernels/int4_amx.c, built by kernels/build.py; used only where the
compiler targets AMX-BF16 and the kernel grants the tile state; `SIMLLM_INT4=aten` keeps ATen's kernel.
"""
from __future__ import annotations

import ctypes

import torch

from . import compute_threads
from .product_kernel import MM8_ARGS, MM_ARGS, POOL_SIGNATURES, Loader, ProductKernel, compare

GROUP = 32  # inputs per 4-bit group (INT4_GROUP in llama_runner)
BLOB = 320  # bytes per 16 outputs x one group: 256 of codes, 16 steps and 16 zeros in bf16
BLOB8 = 576  # 8-bit: 512 bytes of codes, 16 float32 scales
# Below this many multiply-adds a product runs in the caller's thread alone; above it, on torch's thread count
# (the kernel's own workers, kept between products): at 2 threads a one-row product of SmolLM2's shapes is already
# faster on both (benchmark/results/verified_decoding_notes.md).
THREAD_MIN_MACS = 250_000


class Int4Kernel(ProductKernel):
    """The compiled kernel, called on torch tensors: `pack` once per weight, `mm` per product."""

    kind = "amx"
    dtype = torch.bfloat16
    label = "kernel"
    library = "int4_amx"
    SIGNATURES = {**POOL_SIGNATURES, "simllm_int4_mm": (MM_ARGS, None), "simllm_int8_mm": (MM8_ARGS, None),
                  "simllm_int4_init": ([], ctypes.c_int)}

    def __init__(self, path: str):
        super().__init__(path, mm="simllm_int4_mm", mm8="simllm_int8_mm")
        self._init = self._entry("simllm_int4_init")

    def granted(self) -> bool:
        """Whether this process may use AMX (asks Linux once; harmless to repeat)."""
        return self._init() == 0

    @staticmethod
    def pack(codes: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
        """codes [N, K] (0..15) and scales_and_zeros [K/32, N, 2] (step, zero; bf16) -> the kernel's weight blob
        [N/16, K/32, 320] uint8: per 16 outputs and group, byte t*32 + 2*lane + e holds the codes of inputs
        4t + e (low nibble) and 4t + 2 + e (high nibble) of output `lane`, then the 16 steps and 16 zeros."""
        n, k = codes.shape
        if n % 16 or k % GROUP:
            raise ValueError(f"int4 kernel: weights [{n}, {k}] need outputs in 16s and inputs in {GROUP}s")
        g = k // GROUP
        q = codes.to(torch.uint8).reshape(n // 16, 16, g, 8, 2, 2)  # block, lane, group, t, high?, e
        byte = (q[..., 0, :] | (q[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).reshape(n // 16, g, 256)
        sz = scales_and_zeros.to(torch.bfloat16)
        step = sz[..., 0].t().reshape(n // 16, 16, g).permute(0, 2, 1)
        zero = sz[..., 1].t().reshape(n // 16, 16, g).permute(0, 2, 1)
        sb = torch.cat([step, zero], dim=-1).contiguous().view(torch.uint8)  # [blocks, groups, 64]
        return torch.cat([byte, sb], dim=-1).contiguous()

    @staticmethod
    def pack8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """codes [N, K] (-127..127) and scales [N, K/32] (float32) -> [N/16, K/32, 576] uint8: per 16 outputs and
        group, byte 32j + 2*lane + e holds the code of input 2j + e of output `lane`, then the 16 scales."""
        n, k = codes.shape
        if n % 16 or k % GROUP:
            raise ValueError(f"int8 kernel: weights [{n}, {k}] need outputs in 16s and inputs in {GROUP}s")
        g = k // GROUP
        q = codes.to(torch.int8).reshape(n // 16, 16, g, 16, 2).permute(0, 2, 3, 1, 4).reshape(n // 16, g, 512)
        d = scales.float().reshape(n // 16, 16, g).permute(0, 2, 1).contiguous().view(torch.uint8)  # [b, g, 64]
        return torch.cat([q.view(torch.uint8), d], dim=-1).contiguous()

    def mm8(self, x: torch.Tensor, blob: torch.Tensor, n: int) -> torch.Tensor:
        """x [M, K] bf16 (rows contiguous) times 8-bit weights packed by pack8 -> [M, n] float32."""
        m, k, threads, per_thread, _, aligned = self._prepare(x, blob, n, BLOB8, "int8")
        y = torch.empty((m, n), dtype=torch.float32)
        self._mm8(x.data_ptr(), x.stride(0), blob.data_ptr(), y.data_ptr(), n, m, n, k, aligned, per_thread, threads)
        return y

    def buffers(self, m: int, k: int) -> tuple[int, int, int, int]:
        """(group sums buffer, 64-byte aligned tile scratch, scratch bytes per thread, threads) for products of
        m rows and up to k inputs called from C (layer_kernel), kept per calling thread like `mm`'s."""
        threads = compute_threads.kernel_threads()
        work, aligned, per_thread = self._buffers(m, k, threads)
        return work.data_ptr(), aligned, per_thread, threads

    def _buffers(self, m: int, k: int, threads: int) -> tuple[torch.Tensor, int, int]:
        """This thread's group sums buffer and aligned tile scratch, grown to fit (the call runs without the GIL)."""
        per_thread = max(k // GROUP, 4) * 1024 + 4096  # kernels/int4_amx.c's bbuf and cbuf
        s = self._scratch
        if getattr(s, "work", None) is None or s.work.numel() < m * (k // GROUP) or \
                s.tiles.numel() < threads * per_thread + 64:
            s.work = torch.empty(max(m * (k // GROUP), 4096), dtype=torch.float32)
            s.tiles = torch.empty(max(threads * per_thread, 2 * per_thread) + 64, dtype=torch.uint8)
        return s.work, (s.tiles.data_ptr() + 63) // 64 * 64, per_thread

    def _prepare(self, x: torch.Tensor, blob: torch.Tensor, n: int, blob_bytes: int, what: str):
        """The checks and buffers of a product: (M, K, threads, scratch bytes per thread, group sums buffer,
        64-byte aligned tile scratch); bad input raises ValueError."""
        m, k, threads = self._check(x, blob, n, blob_bytes, what, GROUP, THREAD_MIN_MACS)
        work, aligned, per_thread = self._buffers(m, k, threads)
        return m, k, threads, per_thread, work, aligned

    def mm(self, x: torch.Tensor, blob: torch.Tensor, n: int) -> torch.Tensor:
        """x [M, K] bf16 (rows contiguous) times the packed weights -> [M, n] bf16."""
        m, k, threads, per_thread, work, aligned = self._prepare(x, blob, n, BLOB, "int4")
        y = torch.empty((m, n), dtype=torch.bfloat16)
        self._mm(x.data_ptr(), x.stride(0), blob.data_ptr(), y.data_ptr(), n, m, n, k, work.data_ptr(), aligned,
                 per_thread, threads)
        return y


def _granted(kernel: Int4Kernel) -> str | None:
    """Checked first: without Linux's grant of the tile state an AMX instruction faults the process."""
    return None if kernel.granted() else "no AMX-BF16 here (CPU, compiler target or kernel permission)"


def _self_check(kernel: Int4Kernel) -> str | None:
    """None if the kernel computes what 4-bit weights say (against a float32 product of the same weights, 1 and
    19 rows), else why not: a new CPU or compiler should fall back, not answer wrongly."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (48, 96), generator=g, dtype=torch.int32)
    sz = (torch.rand(3, 48, 2, generator=g) * torch.tensor([0.1, 1.0]) - torch.tensor([0.0, 0.5])).to(torch.bfloat16)
    step, zero = sz[..., 0].float().t(), sz[..., 1].float().t()  # [N, K/32]
    w = ((codes.float().reshape(48, 3, GROUP) - 8) * step[..., None] + zero[..., None]).reshape(48, 96)
    x = torch.randn(19, 96, generator=g).to(torch.bfloat16)
    want = x.float() @ w.t()
    err, alone = compare(kernel.mm, x, kernel.pack(codes, sz), 48, want, rows=((3, 1),))
    bound = 0.02 * want.abs().max().item() + 1e-3
    if err > bound or not alone:
        return f"the int4 kernel is off by {err:.3g} (allowed {bound:.3g}) or not row-invariant here"
    return None


_LOADER = Loader("SIMLLM_INT4", "aten", "int4_amx", Int4Kernel, checks=(_granted, _self_check))


def load() -> "Int4Kernel | None":
    """The kernel for this process (built on first use), or None with `why_not()` saying why."""
    return _LOADER.load()


def why_not() -> str | None:
    return _LOADER.why_not


def loaded():
    """The kernel if this process has loaded it already (nothing is built or checked here), else None."""
    return _LOADER.kernel
