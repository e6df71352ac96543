"""4-bit weight products (and the 8-bit LM head) in float32 on CPU vector units: the lossless fast path for CPUs
without AMX: 16 output lanes per instruction with AVX-512, 8 with AVX2, NEON on aarch64 (a Jetson's Cortex-A78AE),
GCC's vector extensions with libm's fmaf elsewhere; every build computes the same bits (kernels/build.py's
numerics contract, test_numerics_contract).

Why our own: on such a CPU the model runs in float32 (no native bf16), and torch's float32 products (MKL, oneDNN)
pick kernels by row count, so a token's bits depend on how many tokens ran with it: the load-time invariance probe
fails, and no reuse or draft is lossless (measured on an AVX2 EPYC: every hit approximate, decode ~130 ms a token
for the 16-bit weights). ATen's int4 kernel needs bf16 activations, which such CPUs emulate slowly.

Arithmetic, per output and group of 32 inputs (the grid of the file's Q4 codes): acc = sum of x[k] * code[k] in
input order, one fused multiply-add at a time from zero; then out = fma(step, acc, out) and
out = fma(base, sum of the group's x, out), groups in order from out = 0 (8-bit: out = fma(scale, acc, out)). The
weights are step * code + base (base = zero - 8 * step), float32 out; GGUF's Q4_K keeps its own layout (`pack_q4k`:
sub-scales, sub-mins, d and dmin), from which the kernel works out the same steps and bases exactly. Every path (1-6
rows with up to four 16-output blocks in registers, the weights decoded once for them, or blocks of rows over a group
decoded once into a float buffer) performs exactly these operations for each output, and threads split output
blocks, never a sum: a row's bits depend on its inputs only, whatever rows ran with it. ModelBackend.invariance_probe checks the whole model at load as for the AMX kernel.

GGUF's Q3_K, Q4_K, Q5_K, Q6_K, Q8_0, Q5_0, Q5_1, Q4_0, IQ4_NL and IQ4_XS can also take their rows quantized to 8 bits
(activation_bits 8, the default on such files: `mm3k8`, `mm4k8`, `mm5k8`, `mm6k8`, `mm8r`, `mm5r`, `mm51r`, `mm4r`,
`mmiq4r`;
Q5_K and Q5_1 have no float32-row product, Q3_K's is the 16-input 8-bit one at 8 bits a weight): per row
and 256 inputs (32 for Q8_0/Q5_0/Q4_0) one float32 scale and int8 codes (`rows_as_8bit`), integer dot products with
the file's codes as llama.cpp computes them times Q8_K (Q8_0) (VNNI, AVX2, NEON's sdot or plain C: exact int32 sums,
so every build agrees), then a few float32 steps in a fixed order per super-block. ~1.5-3x faster than float32 rows
here, and row-invariant alike: the answer is the 8-bit rows' own, never a mix.
C in kernels/int4_vector.c, int8_rows.h and int8_rows32.h, built by kernels/build.py; `SIMLLM_INT4=aten` turns it off with the AMX
one.
"""
from __future__ import annotations

import ctypes

import torch

from . import compute_threads
from .product_kernel import MM_ARGS, Loader, ProductKernel, compare

GROUP = 32  # inputs per group (INT4_GROUP in llama_runner)
BLOB = 384  # bytes per 16 outputs x one group, 4-bit: 256 of codes, 16 steps and 16 bases in float32
BLOB8 = 576  # 8-bit: 512 bytes of codes, 16 float32 scales
BLOB8R = 544  # 8-bit for 8-bit rows (`pack_q8r`): 512 bytes of codes, 16 float16 scales: 8.5 bits, as GGUF's Q8_0
BLOB5R = 352  # GGUF's Q5_0 for 8-bit rows (`pack_q5r`): 256 bytes of low nibbles, 64 of top bits, 16 float16 scales
BLOB4R = 288  # GGUF's Q4_0 for 8-bit rows (`pack_q4r`): the 256 bytes of nibbles, 16 float16 scales: 4.5 bits
BLOB51R = 384  # GGUF's Q5_1 for 8-bit rows (`pack_q51r`): Q5_0's, then 16 float16 mins: 6 bits, as the file
BLOBIQ4 = 320  # GGUF's IQ4_NL / IQ4_XS for 8-bit rows (`pack_iq4r`): 256 bytes of table indices, 16 float32 scales
# llama.cpp's kvalues_iq4nl: the 16 values an IQ4_NL or IQ4_XS index stands for (int8_rows32.h's IQ4_VALUES)
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
GROUP6 = 16  # inputs per group of the 16-input 8-bit format (GGUF's Q6_K)
BLOB6 = 320  # 16 outputs x one group of 16: 256 bytes of codes, 16 float32 scales
SB4K = 256  # inputs per GGUF Q4_K super-block: 8 groups of 32 sharing d and dmin
BLOB6K = 3392  # 16 outputs x one Q6_K super-block for 8-bit rows: 16 d (float32), then per group of 16 inputs 128
#                bytes of low nibbles, 64 of top bits and 16 int8 sub-scales: 6.625 bits a weight
BLOB4K8 = 2304  # the same for 8-bit rows (`pack_q4k8`): float16 d and dmin, 6-bit sub-scales and sub-mins: 4.5 bits
BLOB5K8 = 2816  # GGUF's Q5_K for 8-bit rows (`pack_q5k8`): Q4_K's, with 64 bytes of fifth bits per group: 5.5 bits
BLOB3K = 2368  # GGUF's Q3_K for 8-bit rows (`pack_q3k8`): Q6_K's d, 128 bytes of nibbles and 16 sub-scales per group of
#                16 inputs (no top bits): 4.625 bits a weight (the file's 3.4375)
BLOB4K = 2432  # 16 outputs x one super-block: 16 d and 16 dmin (float32), then per group BLOB's 256 bytes of codes,
#                16 sub-scales and 16 sub-mins (bytes): 4.75 bits a weight
# Below this many multiply-adds a product runs in the caller's thread alone (as int4_kernel's).
THREAD_MIN_MACS = 250_000


def _f16_scales(d: torch.Tensor, n: int, g: int) -> torch.Tensor:
    """Scales [N, G] as float16 per 16 outputs and group -> [N/16, G, 32] uint8; a scale float16 cannot hold exactly
    (not a GGUF file's) is refused, since the kernel would compute with another number."""
    d16 = d.to(torch.float16)
    if not torch.equal(d16.float(), d.float()):
        raise ValueError("8-bit rows kernel: the scales must be float16 values (a GGUF block's d)")
    return d16.reshape(n // 16, 16, g).permute(0, 2, 1).contiguous().view(torch.uint8)


def _code_pairs(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [N, K] (0..15) -> [N/16, K/32, 256] uint8, the code bytes of `pack`'s groups: per 16 outputs,
    group and pair of inputs (2i, 2i + 1), 16 bytes at 16i, byte j holding output j's code of input 2i in its low
    nibble and of 2i + 1 in its high (the kernel widens the 16 bytes once and takes both inputs from them)."""
    n, k = codes.shape
    q = codes.to(torch.uint8).reshape(n // 16, 16, k // GROUP, GROUP // 2, 2)  # block, j, group, pair, which
    return (q[..., 0] | (q[..., 1] << 4)).permute(0, 2, 3, 1).reshape(n // 16, k // GROUP, 256)


def _nibble_chunks(u: torch.Tensor) -> torch.Tensor:
    """4-bit values [N, K] (uint8 0..15) -> [N/16, K/32, 256] uint8 as the 8-bit-row kernels of groups of 32 take
    them: per 16 outputs and group, 4 chunks of 64 bytes, chunk p's byte 4j + i holding output j's value of input
    8p + i (low nibble) and 8p + 4 + i (high): four inputs of one output side by side for a dot-product instruction."""
    n, k = u.shape
    q = u.reshape(n // 16, 16, k // GROUP, 4, 2, 4)  # block, j, group, p, high?, i
    return (q[..., 0, :] | (q[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).reshape(n // 16, k // GROUP, 256)


def _top_bits(top: torch.Tensor) -> torch.Tensor:
    """Fifth bits [N, K] (0 or 1) -> [N/16, K/32, 64] uint8: per 16 outputs and group, byte 4j + i holding output j's
    bit of input 8p + i at bit 2p and of input 8p + 4 + i at bit 2p + 1 (p = 0..3), beside `_nibble_chunks`' chunks."""
    n, k = top.shape
    t = top.reshape(n // 16, 16, k // GROUP, 4, 2, 4).to(torch.int32)  # [b, j, g, p, high?, i]
    shift = (2 * torch.arange(4, dtype=torch.int32)[:, None] + torch.arange(2, dtype=torch.int32))[..., None]
    bits = (t << shift).sum(dim=(3, 4)).to(torch.uint8)  # [b, j, g, i]
    return bits.permute(0, 2, 1, 3).reshape(n // 16, k // GROUP, 64)


def _k8_head(sc: torch.Tensor, mn: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor) -> torch.Tensor:
    """The part of a Q4_K / Q5_K blob for 8-bit rows before its codes -> [N/16, K/256, 256] uint8: per 16 outputs and
    super-block the 16 d and 16 dmin (float16: the file's values, exact), the sub-scales' and sub-mins' low 4 bits
    (per group 16 bytes, byte j: output j's sub-scale low nibble, sub-min high) and their top 2 bits (per group two
    32-bit words, bits 2j..2j+1: output j's)."""
    n, g = sc.shape
    nb, sb = n // 16, g // 8
    s6 = sc.to(torch.int32).reshape(nb, 16, sb, 8).permute(0, 2, 3, 1)  # [b, sb, group, j]
    m6 = mn.to(torch.int32).reshape(nb, 16, sb, 8).permute(0, 2, 3, 1)
    low = ((s6 & 15) | ((m6 & 15) << 4)).to(torch.uint8).reshape(nb, sb, 128)
    shift = 2 * torch.arange(16, dtype=torch.int64)
    words = torch.stack([((s6 >> 4).to(torch.int64) << shift).sum(-1), ((m6 >> 4).to(torch.int64) << shift).sum(-1)],
                        dim=-1)  # [b, sb, group, 2]: 32 bits each, as signed int32
    words = (words - ((words >> 31) << 32)).to(torch.int32)
    top = words.contiguous().view(torch.uint8).reshape(nb, sb, 64)
    head = torch.cat([d.half().reshape(nb, 16, sb), dmin.half().reshape(nb, 16, sb)], dim=1)
    head = head.permute(0, 2, 1).contiguous().view(torch.uint8)  # [b, sb, 64]
    return torch.cat([head, low, top], dim=-1)


def _q4k_blob(byte: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor
              ) -> torch.Tensor:
    """A Q4_K blob from its groups' code bytes [N/16, K/32, 256] in either code layout: per 16 outputs and
    super-block, the 16 d and 16 dmin (float32), then per group the codes, 16 sub-scales and 16 sub-mins."""
    nb, g, _ = byte.shape
    sb = g // 8
    small = torch.cat([sc.to(torch.uint8).reshape(nb, 16, g), mn.to(torch.uint8).reshape(nb, 16, g)],
                      dim=1).permute(0, 2, 1)  # [b, g, 32]
    groups = torch.cat([byte, small], dim=-1).reshape(nb, sb, 8 * 288)
    head = torch.cat([d.float().reshape(nb, 16, sb), dmin.float().reshape(nb, 16, sb)], dim=1)
    head = head.permute(0, 2, 1).contiguous().view(torch.uint8)  # [b, sb, 128]
    return torch.cat([head, groups], dim=-1).contiguous()


class VectorKernel(ProductKernel):
    """The compiled kernel, called on torch tensors: `pack`/`pack8` once per weight, `mm`/`mm8` per product. The
    same calls as int4_kernel.Int4Kernel, for float32 rows, so the runner holds either."""

    kind = "vector"
    dtype = torch.float32
    label = "vector kernel"

    def __init__(self, path: str):
        super().__init__(path, mm="simllm_vec_int4_mm", mm8="simllm_vec_int8_mm")
        self._mm6 = self._entry("simllm_vec_int8g16_mm", MM_ARGS)
        self._mm4k = self._entry("simllm_vec_int4k_mm", MM_ARGS)
        self._mm4k8 = self._entry("simllm_vec_q4k8_mm", MM_ARGS)
        self._mm6k8 = self._entry("simllm_vec_q6k8_mm", MM_ARGS)
        self._mm5k8 = self._entry("simllm_vec_q5k8_mm", MM_ARGS)
        self._mm3k8 = self._entry("simllm_vec_q3k8_mm", MM_ARGS)
        self._mm8r = self._entry("simllm_vec_q8r_mm", MM_ARGS)
        self._mm5r = self._entry("simllm_vec_q5r_mm", MM_ARGS)
        self._mm4r = self._entry("simllm_vec_q4r_mm", MM_ARGS)
        self._mm51r = self._entry("simllm_vec_q51r_mm", MM_ARGS)
        self._mmiq4r = self._entry("simllm_vec_iq4r_mm", MM_ARGS)
        # Every format's entry with simllm_vec_int4_mm's signature, by blob kind: what the C layers call.
        self.entries = {"q4": self._address("simllm_vec_int4_mm"), "q8": self._address("simllm_vec_int8_mmx"),
                        "q6": self._address("simllm_vec_int8g16_mm"), "q4k": self._address("simllm_vec_int4k_mm"),
                        "q4k8": self._address("simllm_vec_q4k8_mm"), "q6k8": self._address("simllm_vec_q6k8_mm"),
                        "q5k8": self._address("simllm_vec_q5k8_mm"), "q3k8": self._address("simllm_vec_q3k8_mm"),
                        "q8r": self._address("simllm_vec_q8r_mm"), "q5r": self._address("simllm_vec_q5r_mm"),
                        "q4r": self._address("simllm_vec_q4r_mm"), "q51r": self._address("simllm_vec_q51r_mm"),
                        "iq4r": self._address("simllm_vec_iq4r_mm")}
        self._buf_floats = int(self._entry("simllm_vec_buffer_floats", [], restype=ctypes.c_long)())

    @staticmethod
    def pack(codes: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
        """codes [N, K] (0..15) and scales_and_zeros [K/32, N, 2] (step, zero: weight = (code - 8) * step + zero)
        -> [N/16, K/32, 384] uint8: per 16 outputs and group, the codes (`_code_pairs`), then the 16 steps and 16
        bases (zero - 8 * step), float32."""
        n, k = codes.shape
        if n % 16 or k % GROUP:
            raise ValueError(f"int4 vector kernel: weights [{n}, {k}] need outputs in 16s and inputs in {GROUP}s")
        g = k // GROUP
        byte = _code_pairs(codes)
        step = scales_and_zeros[..., 0].float()  # [g, N]
        base = scales_and_zeros[..., 1].float() - 8 * step
        sb = torch.cat([step.t().reshape(n // 16, 16, g), base.t().reshape(n // 16, 16, g)], dim=1)
        sb = sb.permute(0, 2, 1).contiguous().view(torch.uint8)  # [b, g, 128]
        return torch.cat([byte, sb], dim=-1).contiguous()

    @staticmethod
    def pack_affine(codes: torch.Tensor, step: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """codes [N, K] (0..15), step and base [N, K/32] float32 (weight = step * code + base: a GGUF file's
        Q4_K, Q4_1 or Q4_0 groups as they are, no zero point to convert) -> `pack`'s layout."""
        n, k = codes.shape
        if n % 16 or k % GROUP:
            raise ValueError(f"int4 vector kernel: weights [{n}, {k}] need outputs in 16s and inputs in {GROUP}s")
        g = k // GROUP
        byte = _code_pairs(codes)
        sb = torch.cat([step.float().reshape(n // 16, 16, g), base.float().reshape(n // 16, 16, g)], dim=1)
        sb = sb.permute(0, 2, 1).contiguous().view(torch.uint8)
        return torch.cat([byte, sb], dim=-1).contiguous()

    @staticmethod
    def pack_q4k(codes: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor
                 ) -> torch.Tensor:
        """GGUF Q4_K as its file holds it: codes [N, K] (0..15), sub-scales and sub-mins [N, K/32] (0..63), d and
        dmin [N, K/256] float32 (weight = d * sc * code - dmin * mn) -> [N/16, K/256, 2432] uint8: per 16 outputs
        and super-block, the 16 d then 16 dmin, then per group the codes as `pack_affine` lays them out, the 16
        sub-scales and the 16 sub-mins. The kernel works out d * sc and -(dmin * mn) exactly: the same numbers,
        and the same bits, as `pack_affine` of the dequantized steps and bases."""
        n, k = codes.shape
        if n % 16 or k % SB4K:
            raise ValueError(f"Q4_K vector kernel: weights [{n}, {k}] need outputs in 16s and inputs in {SB4K}s")
        return _q4k_blob(_code_pairs(codes), sc, mn, d, dmin)

    @staticmethod
    def pack_q4k8(codes: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor
                  ) -> torch.Tensor:
        """GGUF Q4_K for the integer product with 8-bit rows (`mm4k8`), 4.5 bits a weight as in the file -> [N/16, K/256,
        2304] uint8: per 16 outputs and super-block the 16 d and 16 dmin (float16: the file's values, exact), the
        sub-scales' and sub-mins' low 4 bits (per group 16 bytes, byte j: output j's sub-scale low nibble, sub-min
        high), their top 2 bits (per group two 32-bit words, bits 2j..2j+1: output j's), then per group the codes in 4
        chunks of 64 bytes, chunk p's byte 4j + i holding output j's codes of inputs 8p + i (low nibble) and
        8p + 4 + i (high): four inputs of one output side by side, as a dot-product instruction (VNNI's vpdpbusd,
        NEON's sdot, AVX2's pmaddubsw) takes them."""
        n, k = codes.shape
        if n % 16 or k % SB4K:
            raise ValueError(f"Q4_K vector kernel: weights [{n}, {k}] need outputs in 16s and inputs in {SB4K}s")
        byte = _nibble_chunks(codes.to(torch.uint8)).reshape(n // 16, k // SB4K, 2048)
        return torch.cat([_k8_head(sc, mn, d, dmin), byte], dim=-1).contiguous()

    @staticmethod
    def pack_q5k8(codes: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor
                  ) -> torch.Tensor:
        """GGUF Q5_K for the integer product with 8-bit rows (`mm5k8`): codes [N, K] (0..31), sub-scales and sub-mins
        [N, K/32] (0..63), d and dmin [N, K/256] (weight = d * sc * code - dmin * mn, Q4_K's form) -> [N/16, K/256,
        2816] uint8: `pack_q4k8`'s head, then per group the codes' low 4 bits as `pack_q4k8` lays them out and their
        fifth bits as `pack_q5r` does: 5.5 bits a weight, as the file."""
        n, k = codes.shape
        if n % 16 or k % SB4K:
            raise ValueError(f"Q5_K vector kernel: weights [{n}, {k}] need outputs in 16s and inputs in {SB4K}s")
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 31):
            raise ValueError("Q5_K vector kernel: codes must lie in 0..31")
        u = codes.to(torch.uint8)
        groups = torch.cat([_nibble_chunks(u & 15), _top_bits(u >> 4)], dim=-1)  # [b, g, 320]
        return torch.cat([_k8_head(sc, mn, d, dmin), groups.reshape(n // 16, k // SB4K, 8 * 320)], dim=-1).contiguous()

    @staticmethod
    def pack_q6k8(codes: torch.Tensor, sc: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """GGUF Q6_K for the integer product with 8-bit rows (`mm6k8`): codes [N, K] (-32..31), int8 sub-scales
        [N, K/16], d [N, K/256] float32 (weight = d * sub-scale * code) -> [N/16, K/256, 3392] uint8: per 16 outputs
        and super-block the 16 d, then per group of 16 inputs (u = code + 32) u's low 4 bits in 2 chunks of 64 bytes
        (chunk p, byte 4j + i: output j's input 8p + i low, 8p + 4 + i high nibble), u's top 2 bits in 64 bytes
        (byte 4j + i, bits 2t..2t+1: output j's input 4t + i) and the 16 sub-scales: 6.625 bits a weight."""
        n, k = codes.shape
        if n % 16 or k % SB4K:
            raise ValueError(f"Q6_K vector kernel: weights [{n}, {k}] need outputs in 16s and inputs in {SB4K}s")
        g, sb = k // GROUP6, k // SB4K
        u = (codes.to(torch.int16) + 32).to(torch.uint8).reshape(n // 16, 16, g, 4, 4)  # block, j, group, quad, i
        low = (u & 15).reshape(n // 16, 16, g, 2, 2, 4)  # block, j, group, chunk p, high nibble?, i
        nib = (low[..., 0, :] | (low[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).reshape(n // 16, g, 128)
        top = u >> 4
        bits = (top[..., 0, :] | (top[..., 1, :] << 2) | (top[..., 2, :] << 4) | (top[..., 3, :] << 6))
        bits = bits.permute(0, 2, 1, 3).reshape(n // 16, g, 64)  # [b, g, j, i]
        scales = sc.to(torch.int8).view(torch.uint8).reshape(n // 16, 16, g).permute(0, 2, 1)  # [b, g, 16]
        groups = torch.cat([nib, bits, scales], dim=-1).reshape(n // 16, sb, 16 * 208)
        head = d.float().reshape(n // 16, 16, sb).permute(0, 2, 1).contiguous().view(torch.uint8)  # [b, sb, 64]
        return torch.cat([head, groups], dim=-1).contiguous()

    @staticmethod
    def pack_q3k8(codes: torch.Tensor, sc: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """GGUF Q3_K for the integer product with 8-bit rows (`mm3k8`): codes [N, K] (-4..3), int8 sub-scales [N, K/16]
        (the file's 6-bit values less 32), d [N, K/256] float32 (weight = d * sub-scale * code) -> [N/16, K/256, 2368]
        uint8: `pack_q6k8`'s layout with u = code + 4 (0..7) in the nibbles and no plane of top bits."""
        n, k = codes.shape
        if n % 16 or k % SB4K:
            raise ValueError(f"Q3_K vector kernel: weights [{n}, {k}] need outputs in 16s and inputs in {SB4K}s")
        if codes.numel() and (int(codes.min()) < -4 or int(codes.max()) > 3):
            raise ValueError("Q3_K vector kernel: codes must lie in -4..3")
        g, sb = k // GROUP6, k // SB4K
        u = (codes.to(torch.int16) + 4).to(torch.uint8).reshape(n // 16, 16, g, 2, 2, 4)  # b, j, group, p, high?, i
        nib = (u[..., 0, :] | (u[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).reshape(n // 16, g, 128)
        scales = sc.to(torch.int8).view(torch.uint8).reshape(n // 16, 16, g).permute(0, 2, 1)  # [b, g, 16]
        groups = torch.cat([nib, scales], dim=-1).reshape(n // 16, sb, 16 * 144)
        head = d.float().reshape(n // 16, 16, sb).permute(0, 2, 1).contiguous().view(torch.uint8)  # [b, sb, 64]
        return torch.cat([head, groups], dim=-1).contiguous()

    @staticmethod
    def pack_q8r(codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """GGUF Q8_0 for the integer product with 8-bit rows (`mm8r`): codes [N, K] (-127..127) with a scale per 32
        [N, K/32] (float16 values: the file's) -> [N/16, K/32, 544] uint8: per 16 outputs and group, 8 chunks of 64
        bytes (chunk t, byte 4j + i: output j's code of input 4t + i), then the 16 scales (float16): 8.5 bits a
        weight, as the file."""
        n, k = codes.shape
        if n % 16 or k % GROUP:
            raise ValueError(f"8-bit rows kernel: weights [{n}, {k}] need outputs in 16s and inputs in {GROUP}s")
        g = k // GROUP
        q = codes.to(torch.int8).reshape(n // 16, 16, g, 8, 4).permute(0, 2, 3, 1, 4).reshape(n // 16, g, 512)
        return torch.cat([q.view(torch.uint8), _f16_scales(d, n, g)], dim=-1).contiguous()

    @staticmethod
    def pack_q5r(codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """GGUF Q5_0 for the integer product with 8-bit rows (`mm5r`): codes [N, K] (-16..15) with a scale per 32
        [N, K/32] (float16 values: the file's) -> [N/16, K/32, 352] uint8: per 16 outputs and group (u = code + 16)
        u's low 4 bits in 4 chunks of 64 bytes (chunk p, byte 4j + i: output j's input 8p + i low, 8p + 4 + i high
        nibble), u's top bits in 64 bytes (byte 4j + i, bit 2p: output j's input 8p + i, bit 2p + 1: 8p + 4 + i),
        then the 16 scales (float16): 5.5 bits a weight, as the file."""
        n, k = codes.shape
        if n % 16 or k % GROUP:
            raise ValueError(f"Q5_0 rows kernel: weights [{n}, {k}] need outputs in 16s and inputs in {GROUP}s")
        if codes.numel() and (int(codes.min()) < -16 or int(codes.max()) > 15):
            raise ValueError("Q5_0 rows kernel: codes must lie in -16..15")
        g = k // GROUP
        u = (codes.to(torch.int16) + 16).to(torch.uint8)
        return torch.cat([_nibble_chunks(u & 15), _top_bits(u >> 4), _f16_scales(d, n, g)], dim=-1).contiguous()

    @staticmethod
    def pack_q51r(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """GGUF Q5_1 for the integer product with 8-bit rows (`mm51r`): codes [N, K] (0..31), a scale and a min per 32
        [N, K/32] each (float16 values: the file's; weight d * code + m) -> [N/16, K/32, 384] uint8: `pack_q5r`'s
        layout of the codes as they are, its 16 scales, then the 16 mins: 6 bits a weight, as the file."""
        n, k = codes.shape
        if n % 16 or k % GROUP:
            raise ValueError(f"Q5_1 rows kernel: weights [{n}, {k}] need outputs in 16s and inputs in {GROUP}s")
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 31):
            raise ValueError("Q5_1 rows kernel: codes must lie in 0..31")
        g = k // GROUP
        u = codes.to(torch.uint8)
        return torch.cat([_nibble_chunks(u & 15), _top_bits(u >> 4), _f16_scales(d, n, g), _f16_scales(m, n, g)],
                         dim=-1).contiguous()

    @staticmethod
    def pack_iq4r(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """GGUF IQ4_NL / IQ4_XS for the integer product with 8-bit rows (`mmiq4r`): values [N, K] (each one of
        IQ4_VALUES: the file's indices looked up) with a float32 scale per 32 [N, K/32] (IQ4_NL's d, IQ4_XS's
        d * (sub-scale - 32)) -> [N/16, K/32, 320] uint8: the values' indices as `pack_q4r`'s nibbles, then the 16
        scales (float32): 5 bits a weight (the files' 4.5 and 4.25)."""
        n, k = values.shape
        if n % 16 or k % GROUP:
            raise ValueError(f"IQ4 rows kernel: weights [{n}, {k}] need outputs in 16s and inputs in {GROUP}s")
        table = torch.full((256,), -1, dtype=torch.int16)
        table[torch.tensor(IQ4_VALUES) + 128] = torch.arange(16, dtype=torch.int16)
        idx = table[values.long().clamp(-128, 127) + 128]
        if values.numel() and (int(values.min()) < -128 or int(values.max()) > 127 or int(idx.min()) < 0):
            raise ValueError("IQ4 rows kernel: every weight code must be one of IQ4_NL's 16 table values")
        sc = scale.float().reshape(n // 16, 16, k // GROUP).permute(0, 2, 1).contiguous().view(torch.uint8)
        return torch.cat([_nibble_chunks(idx.to(torch.uint8)), sc], dim=-1).contiguous()

    @staticmethod
    def pack_q4r(codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """GGUF Q4_0 for the integer product with 8-bit rows (`mm4r`): codes [N, K] (0..15: the file's, weight d *
        (code - 8)) with a scale per 32 [N, K/32] (float16 values: the file's) -> [N/16, K/32, 288] uint8: `pack_q5r`'s
        nibbles of the codes, then the 16 scales (float16): 4.5 bits a weight, as the file."""
        n, k = codes.shape
        if n % 16 or k % GROUP:
            raise ValueError(f"Q4_0 rows kernel: weights [{n}, {k}] need outputs in 16s and inputs in {GROUP}s")
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 15):
            raise ValueError("Q4_0 rows kernel: codes must lie in 0..15")
        return torch.cat([_nibble_chunks(codes.to(torch.uint8)), _f16_scales(d, n, k // GROUP)], dim=-1).contiguous()

    @staticmethod
    def pack6(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """codes [N, K] (int8; GGUF's Q6_K: -32..31) and scales [N, K/16] float32 -> [N/16, K/16, 320] uint8: per
        16 outputs and group of 16 inputs, byte 16k + j holds input k's code of output j, then the 16 scales."""
        n, k = codes.shape
        if n % 16 or k % GROUP6:
            raise ValueError(f"16-input 8-bit vector kernel: weights [{n}, {k}] need outputs in 16s and inputs in "
                             f"{GROUP6}s")
        g = k // GROUP6
        q = codes.to(torch.int8).reshape(n // 16, 16, g, GROUP6).permute(0, 2, 3, 1).reshape(n // 16, g, 256)
        d = scales.float().reshape(n // 16, 16, g).permute(0, 2, 1).contiguous().view(torch.uint8)
        return torch.cat([q.view(torch.uint8), d], dim=-1).contiguous()

    @staticmethod
    def pack8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """codes [N, K] (-127..127) and scales [N, K/32] -> [N/16, K/32, 576] uint8: per 16 outputs and group,
        byte 16k + j holds input k's code of output j, then the 16 scales (float32)."""
        n, k = codes.shape
        if n % 16 or k % GROUP:
            raise ValueError(f"int8 vector kernel: weights [{n}, {k}] need outputs in 16s and inputs in {GROUP}s")
        g = k // GROUP
        q = codes.to(torch.int8).reshape(n // 16, 16, g, GROUP).permute(0, 2, 3, 1).reshape(n // 16, g, 512)
        d = scales.float().reshape(n // 16, 16, g).permute(0, 2, 1).contiguous().view(torch.uint8)  # [b, g, 64]
        return torch.cat([q.view(torch.uint8), d], dim=-1).contiguous()

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
        """x [M, K] float32 (rows contiguous), quantized to 8 bits per 32 inputs, times GGUF IQ4_NL / IQ4_XS weights
        packed by `pack_iq4r` (the table looked up in registers, integer dot products; the bits of `mm8r` of the same
        values where the scales are float16 values) -> [M, n] float32."""
        return self._grouped(self._mmiq4r, x, blob, n, BLOBIQ4, "IQ4", GROUP)

    def product(self, kind: str):
        """The product of a blob kind: "q4" (`pack`/`pack_affine`), "q4k" (`pack_q4k`), "q8" (`pack8`), "q6"
        (`pack6`), or one of the 8-bit-row kinds "q3k8", "q4k8", "q5k8", "q6k8", "q8r", "q5r", "q51r", "q4r",
        "iq4r" (`pack_<kind>`)."""
        return {"q4": self.mm, "q4k": self.mm4k, "q4k8": self.mm4k8, "q5k8": self.mm5k8, "q8": self.mm8, "q6": self.mm6,
                "q3k8": self.mm3k8, "q6k8": self.mm6k8, "q51r": self.mm51r, "q8r": self.mm8r, "q5r": self.mm5r,
                "q4r": self.mm4r, "iq4r": self.mmiq4r}[kind]


def rows_as_8bit(x: torch.Tensor, block: int = SB4K) -> torch.Tensor:
    """The rows [M, K] as `mm4k8`/`mm6k8` (block 256) or `mm8r`/`mm5r` (block 32) take them, in float64: per block, codes
    round-to-even(x * (127 / amax)) clamped to +-127, times the scale amax / 127 (both float32, as the kernel
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
    w = (codes.double().reshape(80, 3, GROUP) - 8) * sz[..., 0].double().t()[..., None] + sz[..., 1].double().t()[..., None]
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
    sxs = d16 * torch.randint(-32, 32, (80, 3), generator=g).float()  # IQ4_XS: d * (sub-scale - 32), exact
    want = rows_as_8bit(x, GROUP) @ (vi4.double().reshape(80, 3, GROUP) * sxs.double()[..., None]).reshape(80, 96).t()
    err, alone = compare(kernel.mmiq4r, x, kernel.pack_iq4r(vi4, sxs), 80, want, rows=((3, 1), (5, 2), (7, 3)))
    if err > 1e-5 * want.abs().max().item() + 1e-6 or not alone:
        return f"the IQ4 x 8-bit rows kernel is off by {err:.3g} or not row-invariant here"
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
