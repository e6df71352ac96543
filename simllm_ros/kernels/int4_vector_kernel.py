"""4-bit weight products (and the 8-bit LM head) in float32 on CPU vector units: the lossless fast path for CPUs
without AMX: 16 output lanes per instruction with AVX-512, 8 with AVX2, NEON on aarch64 (a Jetson's Cortex-A78AE),
GCC's vector extensions with libm's fmaf elsewhere; every build computes the same bits (kernels/build.py's
numerics contract, test_numerics_contract).

Why our own: on such a CPU the model runs in float32 (no native bf16), and torch's float32 products (MKL, oneDNN)
pick kernels by row count, so a token's bits depend on how many tokens ran with it: the load-time invariance probe
fails, and no reuse or draft is lossless (on an AVX2 EPYC every hit was approximate). ATen's int4 kernel needs bf16
activations, which such CPUs emulate slowly.

Arithmetic, per output and group of 32 inputs (the grid of the file's Q4 codes): acc = sum of x[k] * code[k] in
input order, one fused multiply-add at a time from zero; then out = fma(step, acc, out) and
out = fma(base, sum of the group's x, out), groups in order from out = 0 (8-bit: out = fma(scale, acc, out)). The
weights are step * code + base (base = zero - 8 * step), float32 out; GGUF's Q4_K keeps its own layout (`pack_q4k`:
sub-scales, sub-mins, d and dmin), from which the kernel works out the same steps and bases exactly. Every path (1-6
rows with up to four 16-output blocks in registers, the weights decoded once for them, or blocks of rows over a group
decoded once into a float buffer) performs exactly these operations for each output, and threads split output
blocks, never a sum: a row's bits depend on its inputs only, whatever rows ran with it. ModelBackend.invariance_probe
checks the whole model at load as for the AMX kernel.

GGUF's Q3_K, Q4_K, Q5_K, Q6_K, Q8_0, Q5_0, Q5_1, Q4_0, IQ4_NL and IQ4_XS can also take their rows quantized to 8 bits
(activation_bits 8, the default on such files: `mm3k8`, `mm4k8`, `mm5k8`, `mm6k8`, `mm8r`, `mm5r`, `mm51r`, `mm4r`,
`mmiq4r`, `mmiq4xs`;
Q5_K and Q5_1 have no float32-row product, Q3_K's is the 16-input 8-bit one at 8 bits a weight): per row
and 256 inputs (32 for Q8_0/Q5_0/Q4_0) one float32 scale and int8 codes (`rows_as_8bit`), integer dot products with
the file's codes as llama.cpp computes them times Q8_K (Q8_0) (VNNI, AVX2, NEON's sdot or plain C: exact int32 sums,
so every build agrees), then a few float32 steps in a fixed order per super-block. Faster than float32 rows
(benchmark/results/verified_decoding_notes.md), and row-invariant alike: the answer is the 8-bit rows' own, never a mix.
C in kernels/int4_vector.c, int8_rows.h and int8_rows32.h, built by kernels/build.py; `SIMLLM_INT4=aten` turns it off
with the AMX one.
"""
from __future__ import annotations

import ctypes

import torch

from . import compute_threads, vector_blobs
from .product_kernel import MM8_ARGS, MM_ARGS, POOL_SIGNATURES, Loader, ProductKernel, compare
from .vector_blobs import (BLOB, BLOB3K, BLOB4K, BLOB4K8, BLOB4R, BLOB5K8, BLOB5R, BLOB6, BLOB6K, BLOB8, BLOB8R,
                           BLOB51R, BLOBIQ4, BLOBIQ4XS, GROUP, GROUP6, IQ4_VALUES, SB4K)

# Below this many multiply-adds a product runs in the caller's thread alone (as int4_kernel's).
THREAD_MIN_MACS = 250_000
# Every format's entry with simllm_vec_int4_mm's signature, by blob kind: what the C layers call (`entries`)
PRODUCTS = {"q4": "simllm_vec_int4_mm", "q8": "simllm_vec_int8_mmx", "q6": "simllm_vec_int8g16_mm",
            "q4k": "simllm_vec_int4k_mm", "q4k8": "simllm_vec_q4k8_mm", "q6k8": "simllm_vec_q6k8_mm",
            "q5k8": "simllm_vec_q5k8_mm", "q3k8": "simllm_vec_q3k8_mm", "q8r": "simllm_vec_q8r_mm",
            "q5r": "simllm_vec_q5r_mm", "q4r": "simllm_vec_q4r_mm", "q51r": "simllm_vec_q51r_mm",
            "iq4r": "simllm_vec_iq4r_mm", "iq4xs": "simllm_vec_iq4xs_mm"}


class VectorKernel(ProductKernel):
    """The compiled kernel, called on torch tensors: `pack`/`pack8` once per weight, `mm`/`mm8` per product. The
    same calls as int4_kernel.Int4Kernel, for float32 rows, so the runner holds either."""

    kind = "vector"
    dtype = torch.float32
    label = "vector kernel"
    library = "int4_vector"
    SIGNATURES = {**POOL_SIGNATURES, "simllm_vec_int8_mm": (MM8_ARGS, None),
                  "simllm_vec_buffer_floats": ([], ctypes.c_long),
                  **{name: (MM_ARGS, None) for name in PRODUCTS.values()}}

    def __init__(self, path: str):
        super().__init__(path, mm="simllm_vec_int4_mm", mm8="simllm_vec_int8_mm")
        self._mm6 = self._entry("simllm_vec_int8g16_mm")
        self._mm4k = self._entry("simllm_vec_int4k_mm")
        self._mm4k8 = self._entry("simllm_vec_q4k8_mm")
        self._mm6k8 = self._entry("simllm_vec_q6k8_mm")
        self._mm5k8 = self._entry("simllm_vec_q5k8_mm")
        self._mm3k8 = self._entry("simllm_vec_q3k8_mm")
        self._mm8r = self._entry("simllm_vec_q8r_mm")
        self._mm5r = self._entry("simllm_vec_q5r_mm")
        self._mm4r = self._entry("simllm_vec_q4r_mm")
        self._mm51r = self._entry("simllm_vec_q51r_mm")
        self._mmiq4r = self._entry("simllm_vec_iq4r_mm")
        self._mmiq4xs = self._entry("simllm_vec_iq4xs_mm")
        self.entries = {kind: self._address(name) for kind, name in PRODUCTS.items()}
        self._buf_floats = int(self._entry("simllm_vec_buffer_floats")())

    # the layouts (vector_blobs), where the kernel is at hand
    pack = staticmethod(vector_blobs.pack)
    pack_affine = staticmethod(vector_blobs.pack_affine)
    pack_q4k = staticmethod(vector_blobs.pack_q4k)
    pack_q4k8 = staticmethod(vector_blobs.pack_q4k8)
    pack_q5k8 = staticmethod(vector_blobs.pack_q5k8)
    pack_q6k8 = staticmethod(vector_blobs.pack_q6k8)
    pack_q3k8 = staticmethod(vector_blobs.pack_q3k8)
    pack_q8r = staticmethod(vector_blobs.pack_q8r)
    pack_q5r = staticmethod(vector_blobs.pack_q5r)
    pack_q51r = staticmethod(vector_blobs.pack_q51r)
    pack_iq4r = staticmethod(vector_blobs.pack_iq4r)
    pack_iq4xs = staticmethod(vector_blobs.pack_iq4xs)
    pack_q4r = staticmethod(vector_blobs.pack_q4r)
    pack6 = staticmethod(vector_blobs.pack6)
    pack8 = staticmethod(vector_blobs.pack8)

    def _prepare(self, x: torch.Tensor, blob: torch.Tensor, n: int, blob_bytes: int, what: str, group: int = GROUP):
        m, k, threads = self._check(x, blob, n, blob_bytes, what, group, THREAD_MIN_MACS)
        return (m, k, threads, *self._buffers(m, k, threads))

    def _buffers(self, m: int, k: int, threads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This thread's group sums and work buffers, grown to fit (the call runs without the GIL)."""
        s = self._scratch
        need = m * (k // 4 + k // 8)  # the group sums, or the rows quantized to 8 bits (simllm_vec_qrow_bytes)
        if getattr(s, "xsum", None) is None or s.xsum.numel() < need or s.buf.numel() < threads * self._buf_floats:
            s.xsum = torch.empty(max(need, 4096), dtype=torch.float32)
            s.buf = torch.empty(max(threads, 2) * self._buf_floats, dtype=torch.float32)
        return s.xsum, s.buf

    def buffers(self, m: int, k: int) -> tuple[int, int, int, int]:
        """(group sums buffer, work buffer, its floats per thread, threads) for products of m rows and up to k
        inputs called from C (layer_kernel), kept per calling thread like `mm`'s."""
        threads = max(1, compute_threads.kernel_threads())
        xsum, buf = self._buffers(m, k, threads)
        return xsum.data_ptr(), buf.data_ptr(), self._buf_floats, threads

    def _grouped(self, fn, x: torch.Tensor, blob: torch.Tensor, n: int, blob_bytes: int, what: str,
                 group: int = GROUP) -> torch.Tensor:
        """A product whose C entry takes simllm_vec_int4_mm's arguments (the group sums too)."""
        m, k, threads, xsum, buf = self._prepare(x, blob, n, blob_bytes, what, group)
        y = torch.empty((m, n), dtype=torch.float32)
        fn(x.data_ptr(), x.stride(0), blob.data_ptr(), y.data_ptr(), n, m, n, k, xsum.data_ptr(), buf.data_ptr(),
           self._buf_floats, threads)
        return y

    def mm(self, x: torch.Tensor, blob: torch.Tensor, n: int) -> torch.Tensor:
        """x [M, K] float32 (rows contiguous) times 4-bit weights packed by `pack` -> [M, n] float32."""
        return self._grouped(self._mm, x, blob, n, BLOB, "int4")

    def mm8(self, x: torch.Tensor, blob: torch.Tensor, n: int) -> torch.Tensor:
        """x [M, K] float32 (rows contiguous) times 8-bit weights packed by `pack8` -> [M, n] float32."""
        m, k, threads, _, buf = self._prepare(x, blob, n, BLOB8, "int8")
        y = torch.empty((m, n), dtype=torch.float32)
        self._mm8(x.data_ptr(), x.stride(0), blob.data_ptr(), y.data_ptr(), n, m, n, k, buf.data_ptr(),
                  self._buf_floats, threads)
        return y

    def mm6(self, x: torch.Tensor, blob: torch.Tensor, n: int) -> torch.Tensor:
        """x [M, K] float32 (rows contiguous) times 8-bit weights in groups of 16 packed by `pack6` -> [M, n]."""
        return self._grouped(self._mm6, x, blob, n, BLOB6, "16-input 8-bit", GROUP6)

    def mm4k(self, x: torch.Tensor, blob: torch.Tensor, n: int) -> torch.Tensor:
        """x [M, K] float32 (rows contiguous) times GGUF Q4_K weights packed by `pack_q4k` -> [M, n] float32."""
        return self._grouped(self._mm4k, x, blob, n, BLOB4K, "Q4_K", SB4K)

    def mm4k8(self, x: torch.Tensor, blob: torch.Tensor, n: int) -> torch.Tensor:
        """x [M, K] float32 (rows contiguous), quantized to 8 bits per 256 inputs, times GGUF Q4_K weights packed by
        `pack_q4k8` (integer dot products) -> [M, n] float32."""
        return self._grouped(self._mm4k8, x, blob, n, BLOB4K8, "Q4_K", SB4K)

    def mm5k8(self, x: torch.Tensor, blob: torch.Tensor, n: int) -> torch.Tensor:
        """x [M, K] float32 (quantized to 8 bits per 256 inputs as `mm4k8` does) times GGUF Q5_K weights packed by
        `pack_q5k8` (integer dot products) -> [M, n] float32."""
        return self._grouped(self._mm5k8, x, blob, n, BLOB5K8, "Q5_K", SB4K)

    def mm3k8(self, x: torch.Tensor, blob: torch.Tensor, n: int) -> torch.Tensor:
        """x [M, K] float32 (quantized to 8 bits per 256 inputs as `mm4k8` does) times GGUF Q3_K weights packed by
        `pack_q3k8` (integer dot products) -> [M, n] float32."""
        return self._grouped(self._mm3k8, x, blob, n, BLOB3K, "Q3_K", SB4K)

    def mm6k8(self, x: torch.Tensor, blob: torch.Tensor, n: int) -> torch.Tensor:
        """x [M, K] float32 (rows contiguous), quantized to 8 bits per 256 inputs, times GGUF Q6_K weights packed by
        `pack_q6k8` (integer dot products) -> [M, n] float32."""
        return self._grouped(self._mm6k8, x, blob, n, BLOB6K, "Q6_K", SB4K)

    def mm8r(self, x: torch.Tensor, blob: torch.Tensor, n: int) -> torch.Tensor:
        """x [M, K] float32 (rows contiguous), quantized to 8 bits per 32 inputs, times 8-bit codes packed by
        `pack_q8r` (integer dot products) -> [M, n] float32."""
        return self._grouped(self._mm8r, x, blob, n, BLOB8R, "8-bit", GROUP)

    def mm5r(self, x: torch.Tensor, blob: torch.Tensor, n: int) -> torch.Tensor:
        """x [M, K] float32 (rows contiguous), quantized to 8 bits per 32 inputs, times GGUF Q5_0 weights packed by
        `pack_q5r` (integer dot products; the same bits as `mm8r` of the same codes) -> [M, n] float32."""
        return self._grouped(self._mm5r, x, blob, n, BLOB5R, "Q5_0", GROUP)

    def mm4r(self, x: torch.Tensor, blob: torch.Tensor, n: int) -> torch.Tensor:
        """x [M, K] float32 (rows contiguous), quantized to 8 bits per 32 inputs, times GGUF Q4_0 weights packed by
        `pack_q4r` (integer dot products; the bits of `mm8r` of the same codes less 8) -> [M, n] float32."""
        return self._grouped(self._mm4r, x, blob, n, BLOB4R, "Q4_0", GROUP)

    def mm51r(self, x: torch.Tensor, blob: torch.Tensor, n: int) -> torch.Tensor:
        """x [M, K] float32 (rows contiguous), quantized to 8 bits per 32 inputs, times GGUF Q5_1 weights packed by
        `pack_q51r` (integer dot products, then the mins times the rows' code sums) -> [M, n] float32."""
        return self._grouped(self._mm51r, x, blob, n, BLOB51R, "Q5_1", GROUP)

    def mmiq4r(self, x: torch.Tensor, blob: torch.Tensor, n: int) -> torch.Tensor:
        """x [M, K] float32 (rows contiguous), quantized to 8 bits per 32 inputs, times GGUF IQ4_NL weights packed by
        `pack_iq4r` (the table looked up in registers, integer dot products; the bits of `mm8r` of the same values)
        -> [M, n] float32."""
        return self._grouped(self._mmiq4r, x, blob, n, BLOBIQ4, "IQ4", GROUP)

    def mmiq4xs(self, x: torch.Tensor, blob: torch.Tensor, n: int) -> torch.Tensor:
        """The same times GGUF IQ4_XS weights packed by `pack_iq4xs` (K in 256s): `mmiq4r`'s bits for the scales
        d * (sub-scale - 32)."""
        return self._grouped(self._mmiq4xs, x, blob, n, BLOBIQ4XS, "IQ4_XS", SB4K)

    def product(self, kind: str):
        """The product of a blob kind: "q4" (`pack`/`pack_affine`), "q4k" (`pack_q4k`), "q8" (`pack8`), "q6"
        (`pack6`), or one of the 8-bit-row kinds "q3k8", "q4k8", "q5k8", "q6k8", "q8r", "q5r", "q51r", "q4r",
        "iq4r", "iq4xs" (`pack_<kind>`)."""
        return {"q4": self.mm, "q4k": self.mm4k, "q4k8": self.mm4k8, "q5k8": self.mm5k8, "q8": self.mm8, "q6": self.mm6,
                "q3k8": self.mm3k8, "q6k8": self.mm6k8, "q51r": self.mm51r, "q8r": self.mm8r, "q5r": self.mm5r,
                "q4r": self.mm4r, "iq4r": self.mmiq4r, "iq4xs": self.mmiq4xs}[kind]


def rows_as_8bit(x: torch.Tensor, block: int = SB4K) -> torch.Tensor:
    """The rows [M, K] as `mm4k8`/`mm6k8` (block 256) or `mm8r`/`mm5r` (block 32) take them, in float64: per block,
    codes round-to-even(x * (127 / amax)) clamped to +-127, times the scale amax / 127 (both float32, as the kernel
    computes them)."""
    m, k = x.shape
    xb = x.float().reshape(m, k // block, block)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes = torch.round((xb * inv).clamp(-127, 127)).nan_to_num(0.0)
    return (codes.double() * (amax / 127).double()).reshape(m, k)


def q4k_dequantized(codes, sc, mn, d, dmin) -> torch.Tensor:
    """Q4_K (and Q5_K) weights [N, K] in float64: d * sub-scale * code - dmin * sub-min."""
    step = (d.double().repeat_interleave(8, dim=1) * sc.double()).repeat_interleave(GROUP, dim=1)
    base = (dmin.double().repeat_interleave(8, dim=1) * mn.double()).repeat_interleave(GROUP, dim=1)
    return step * codes.double() - base


def q6k_dequantized(codes, sc, d) -> torch.Tensor:
    """Q6_K weights [N, K] in float64: d * sub-scale * code."""
    return (d.double().repeat_interleave(16, dim=1) * sc.double()).repeat_interleave(GROUP6, dim=1) * codes.double()


def _self_check(kernel: VectorKernel) -> str | None:
    """None if the kernel computes what the weights say (against a float64 product of the same weights, 1-3 and
    19 rows: both paths) and a row's bits do not depend on the rows with it; else why not."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (80, 96), generator=g, dtype=torch.int32)
    sz = torch.rand(3, 80, 2, generator=g) * torch.tensor([0.1, 1.0]) - torch.tensor([0.0, 0.5])
    w = (codes.double().reshape(80, 3, GROUP) - 8) * sz[..., 0].double().t()[..., None] \
        + sz[..., 1].double().t()[..., None]
    q8 = torch.randint(-127, 128, (80, 96), generator=g, dtype=torch.int32)
    d = torch.rand(80, 3, generator=g) * 0.01
    w8 = (q8.double().reshape(80, 3, GROUP) * d.double()[..., None]).reshape(80, 96)
    q6 = torch.randint(-32, 32, (80, 96), generator=g, dtype=torch.int32)
    d6 = torch.rand(80, 6, generator=g) * 0.01
    w6 = (q6.double().reshape(80, 6, GROUP6) * d6.double()[..., None]).reshape(80, 96)
    x = torch.randn(19, 96, generator=g)
    # Q4_K's layout: bitwise the 4-bit product of the same steps and bases (2 super-blocks of 256 inputs)
    ck = torch.randint(0, 16, (32, 512), generator=g, dtype=torch.int32)
    sc, mn = (torch.randint(0, 64, (32, 16), generator=g, dtype=torch.int32) for _ in range(2))
    dk = (torch.rand(32, 2, generator=g) * 0.01).half().float()
    dmk = (torch.rand(32, 2, generator=g) * 0.01).half().float()
    step = dk.repeat_interleave(8, dim=1) * sc.float()
    base = -(dmk.repeat_interleave(8, dim=1) * mn.float())
    xk = torch.randn(7, 512, generator=g)
    got = kernel.mm4k(xk, kernel.pack_q4k(ck, sc, mn, dk, dmk), 32)
    if not torch.equal(got, kernel.mm(xk, kernel.pack_affine(ck, step, base), 32)) or \
            not torch.equal(kernel.mm4k(xk[2:3].contiguous(), kernel.pack_q4k(ck, sc, mn, dk, dmk), 32), got[2:3]):
        return "the Q4_K vector kernel does not compute the 4-bit kernel's bits here"
    # Q4_K on 8-bit rows: the float64 product of the same quantized rows, and a row's bits alone and among others
    want = rows_as_8bit(xk) @ q4k_dequantized(ck, sc, mn, dk, dmk).t()
    err, alone = compare(kernel.mm4k8, xk, kernel.pack_q4k8(ck, sc, mn, dk, dmk), 32, want,
                         rows=((2, 1), (1, 4), (6, 1)))
    if err > 1e-5 * want.abs().max().item() + 1e-6 or not alone:
        return f"the Q4_K x 8-bit rows kernel is off by {err:.3g} or not row-invariant here"
    c5 = torch.randint(0, 32, (32, 512), generator=g, dtype=torch.int32)  # Q5_K: Q4_K's form, codes 0..31
    want = rows_as_8bit(xk) @ q4k_dequantized(c5, sc, mn, dk, dmk).t()
    err, alone = compare(kernel.mm5k8, xk, kernel.pack_q5k8(c5, sc, mn, dk, dmk), 32, want,
                         rows=((2, 1), (1, 4), (6, 1)))
    if err > 1e-5 * want.abs().max().item() + 1e-6 or not alone:
        return f"the Q5_K x 8-bit rows kernel is off by {err:.3g} or not row-invariant here"
    c6 = torch.randint(-32, 32, (32, 512), generator=g, dtype=torch.int32)
    s6 = torch.randint(-128, 128, (32, 32), generator=g, dtype=torch.int32)
    want = rows_as_8bit(xk) @ q6k_dequantized(c6, s6, dk).t()
    err, alone = compare(kernel.mm6k8, xk, kernel.pack_q6k8(c6, s6, dk), 32, want, rows=((2, 1), (1, 4), (6, 1)))
    if err > 1e-5 * want.abs().max().item() + 1e-6 or not alone:
        return f"the Q6_K x 8-bit rows kernel is off by {err:.3g} or not row-invariant here"
    c3, s3 = c6.div(8, rounding_mode="floor"), s6.div(4, rounding_mode="floor")  # Q3_K: codes -4..3, scales -32..31
    want = rows_as_8bit(xk) @ q6k_dequantized(c3, s3, dk).t()
    err, alone = compare(kernel.mm3k8, xk, kernel.pack_q3k8(c3, s3, dk), 32, want, rows=((2, 1), (1, 4), (6, 1)))
    if err > 1e-5 * want.abs().max().item() + 1e-6 or not alone:
        return f"the Q3_K x 8-bit rows kernel is off by {err:.3g} or not row-invariant here"
    d16 = d.half().float()
    want = rows_as_8bit(x, GROUP) @ (q8.double().reshape(80, 3, GROUP) * d16.double()[..., None]).reshape(80, 96).t()
    err, alone = compare(kernel.mm8r, x, kernel.pack_q8r(q8, d16), 80, want, rows=((3, 1), (5, 2), (7, 3)))
    if err > 1e-5 * want.abs().max().item() + 1e-6 or not alone:
        return f"the 8-bit x 8-bit rows kernel is off by {err:.3g} or not row-invariant here"
    q5 = q8.div(8, rounding_mode="floor").clamp(-16, 15)
    if not torch.equal(kernel.mm5r(x, kernel.pack_q5r(q5, d16), 80), kernel.mm8r(x, kernel.pack_q8r(q5, d16), 80)):
        return "the Q5_0 x 8-bit rows kernel does not compute the 8-bit kernel's bits here"
    q4 = q8.div(16, rounding_mode="floor").clamp(-8, 7)
    if not torch.equal(kernel.mm4r(x, kernel.pack_q4r(q4 + 8, d16), 80), kernel.mm8r(x, kernel.pack_q8r(q4, d16), 80)):
        return "the Q4_0 x 8-bit rows kernel does not compute the 8-bit kernel's bits here"
    vi4 = torch.tensor(IQ4_VALUES)[q4 + 8]  # IQ4_NL: table values, float16 scales: the 8-bit kernel's bits
    if not torch.equal(kernel.mmiq4r(x, kernel.pack_iq4r(vi4, d16), 80), kernel.mm8r(x, kernel.pack_q8r(vi4, d16), 80)):
        return "the IQ4 x 8-bit rows kernel does not compute the 8-bit kernel's bits here"
    # IQ4_XS (2 super-blocks): scales d * (sub-scale - 32) against the float64 product; with sub-scales of one, the
    # bits of IQ4_NL's product of the same d
    vk = torch.tensor(IQ4_VALUES)[torch.randint(0, 16, (32, 512), generator=g)]
    subk = torch.randint(-32, 32, (32, 16), generator=g)
    sxs = dk.repeat_interleave(8, dim=1) * subk.float()  # exact in float32
    want = rows_as_8bit(xk, GROUP) @ (vk.double().reshape(32, 16, GROUP) * sxs.double()[..., None]).reshape(32, 512).t()
    err, alone = compare(kernel.mmiq4xs, xk, kernel.pack_iq4xs(vk, subk, dk), 32, want, rows=((2, 1), (1, 4), (6, 1)))
    if err > 1e-5 * want.abs().max().item() + 1e-6 or not alone:
        return f"the IQ4_XS x 8-bit rows kernel is off by {err:.3g} or not row-invariant here"
    if not torch.equal(kernel.mmiq4xs(xk, kernel.pack_iq4xs(vk, torch.ones_like(subk), dk), 32),
                       kernel.mmiq4r(xk, kernel.pack_iq4r(vk, dk.repeat_interleave(8, dim=1)), 32)):
        return "the IQ4_XS x 8-bit rows kernel does not compute the IQ4_NL kernel's bits here"
    q51 = q8.div(8, rounding_mode="floor").clamp(-16, 15) + 16  # Q5_1: codes 0..31, a min per 32
    m16 = (torch.rand(80, 3, generator=g) * -0.05).half().float()
    want = rows_as_8bit(x, GROUP) @ (q51.double().reshape(80, 3, GROUP) * d16.double()[..., None]
                                     + m16.double()[..., None]).reshape(80, 96).t()
    err, alone = compare(kernel.mm51r, x, kernel.pack_q51r(q51, d16, m16), 80, want, rows=((3, 1), (5, 2), (7, 3)))
    if err > 1e-5 * want.abs().max().item() + 1e-6 or not alone:
        return f"the Q5_1 x 8-bit rows kernel is off by {err:.3g} or not row-invariant here"
    for mm, blob, want, name in ((kernel.mm, kernel.pack(codes, sz), x.double() @ w.reshape(80, 96).t(), "int4"),
                                 (kernel.mm8, kernel.pack8(q8, d), x.double() @ w8.t(), "int8"),
                                 (kernel.mm6, kernel.pack6(q6, d6), x.double() @ w6.t(), "int8-16")):
        err, alone = compare(mm, x, blob, 80, want, rows=((3, 1), (5, 2), (7, 3)))
        bound = 1e-4 * want.abs().max().item() + 1e-5
        if err > bound:
            return f"the {name} vector kernel is off by {err:.3g} (allowed {bound:.3g}) here"
        if not alone:
            return f"the {name} vector kernel is not row-invariant here"
    return None


_LOADER = Loader("SIMLLM_INT4", "aten", "int4_vector", VectorKernel, checks=(_self_check,))


def load() -> "VectorKernel | None":
    """The kernel for this process (built on first use), or None with `why_not()` saying why."""
    return _LOADER.load()


def why_not() -> str | None:
    return _LOADER.why_not


def loaded():
    """The kernel if this process has loaded it already (nothing is built or checked here), else None."""
    return _LOADER.kernel
