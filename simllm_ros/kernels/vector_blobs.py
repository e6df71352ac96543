"""The weight layouts the vector kernel's C products read: how each format's codes and scales are laid out in the
blobs `pack*` builds once per weight (int4_vector_kernel calls them; packed_weights keeps their output on disk).

Why a module of its own: the layouts are a file format. A model's packed blobs are written once and mapped at later
loads, named by this module's source and the C that reads them (packed_weights.layout_id): a change here repacks
every model, a change elsewhere in the kernel's Python does not.
"""
from __future__ import annotations

import torch

GROUP = 32  # inputs per group (INT4_GROUP in llama_runner)
BLOB = 384  # bytes per 16 outputs x one group, 4-bit: 256 of codes, 16 steps and 16 bases in float32
BLOB8 = 576  # 8-bit: 512 bytes of codes, 16 float32 scales
BLOB8R = 544  # 8-bit for 8-bit rows (`pack_q8r`): 512 bytes of codes, 16 float16 scales: 8.5 bits, as GGUF's Q8_0
BLOB5R = 352  # GGUF's Q5_0 for 8-bit rows (`pack_q5r`): 256 bytes of low nibbles, 64 of top bits, 16 float16 scales
BLOB4R = 288  # GGUF's Q4_0 for 8-bit rows (`pack_q4r`): the 256 bytes of nibbles, 16 float16 scales: 4.5 bits
BLOB51R = 384  # GGUF's Q5_1 for 8-bit rows (`pack_q51r`): Q5_0's, then 16 float16 mins: 6 bits, as the file
BLOBIQ4 = 288  # GGUF's IQ4_NL for 8-bit rows (`pack_iq4r`): 256 bytes of table indices, 16 float16 d: 4.5 bits
BLOBIQ4XS = 2208  # GGUF's IQ4_XS (`pack_iq4xs`): per 16 outputs x 256 inputs 16 float16 d, then per group of 32 the
#                   indices and 16 int8 sub-scales: 4.3125 bits a weight (the file's 4.25)
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


def _shape(codes: torch.Tensor, unit: int, what: str) -> tuple[int, int]:
    """codes' [N, K], checked to be whole blobs: outputs in 16s, inputs in `unit`s (a group or super-block)."""
    n, k = codes.shape
    if n % 16 or k % unit:
        raise ValueError(f"{what}: weights [{n}, {k}] need outputs in 16s and inputs in {unit}s")
    return n, k


def _within(codes: torch.Tensor, lo: int, hi: int, what: str) -> None:
    """codes all in lo..hi, the range the layout's bits hold; ValueError naming `what` otherwise."""
    if codes.numel() and (int(codes.min()) < lo or int(codes.max()) > hi):
        raise ValueError(f"{what} must lie in {lo}..{hi}")


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


def pack(codes: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """codes [N, K] (0..15) and scales_and_zeros [K/32, N, 2] (step, zero: weight = (code - 8) * step + zero)
    -> [N/16, K/32, 384] uint8: per 16 outputs and group, the codes (`_code_pairs`), then the 16 steps and 16
    bases (zero - 8 * step), float32."""
    n, k = _shape(codes, GROUP, "int4 vector kernel")
    g = k // GROUP
    byte = _code_pairs(codes)
    step = scales_and_zeros[..., 0].float()  # [g, N]
    base = scales_and_zeros[..., 1].float() - 8 * step
    sb = torch.cat([step.t().reshape(n // 16, 16, g), base.t().reshape(n // 16, 16, g)], dim=1)
    sb = sb.permute(0, 2, 1).contiguous().view(torch.uint8)  # [b, g, 128]
    return torch.cat([byte, sb], dim=-1).contiguous()

def pack_affine(codes: torch.Tensor, step: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """codes [N, K] (0..15), step and base [N, K/32] float32 (weight = step * code + base: a GGUF file's
    Q4_K, Q4_1 or Q4_0 groups as they are, no zero point to convert) -> `pack`'s layout."""
    n, k = _shape(codes, GROUP, "int4 vector kernel")
    g = k // GROUP
    byte = _code_pairs(codes)
    sb = torch.cat([step.float().reshape(n // 16, 16, g), base.float().reshape(n // 16, 16, g)], dim=1)
    sb = sb.permute(0, 2, 1).contiguous().view(torch.uint8)
    return torch.cat([byte, sb], dim=-1).contiguous()

def pack_q4k(codes: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor
             ) -> torch.Tensor:
    """GGUF Q4_K as its file holds it: codes [N, K] (0..15), sub-scales and sub-mins [N, K/32] (0..63), d and
    dmin [N, K/256] float32 (weight = d * sc * code - dmin * mn) -> [N/16, K/256, 2432] uint8: per 16 outputs
    and super-block, the 16 d then 16 dmin, then per group the codes as `pack_affine` lays them out, the 16
    sub-scales and the 16 sub-mins. The kernel works out d * sc and -(dmin * mn) exactly: the same numbers,
    and the same bits, as `pack_affine` of the dequantized steps and bases."""
    n, k = _shape(codes, SB4K, "Q4_K vector kernel")
    return _q4k_blob(_code_pairs(codes), sc, mn, d, dmin)

def pack_q4k8(codes: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor
              ) -> torch.Tensor:
    """GGUF Q4_K for the integer product with 8-bit rows (`mm4k8`), 4.5 bits a weight as in the file -> [N/16, K/256,
    2304] uint8: per 16 outputs and super-block the 16 d and 16 dmin (float16: the file's values, exact), the
    sub-scales' and sub-mins' low 4 bits (per group 16 bytes, byte j: output j's sub-scale low nibble, sub-min
    high), their top 2 bits (per group two 32-bit words, bits 2j..2j+1: output j's), then per group the codes in 4
    chunks of 64 bytes, chunk p's byte 4j + i holding output j's codes of inputs 8p + i (low nibble) and
    8p + 4 + i (high): four inputs of one output side by side, as a dot-product instruction (VNNI's vpdpbusd,
    NEON's sdot, AVX2's pmaddubsw) takes them."""
    n, k = _shape(codes, SB4K, "Q4_K vector kernel")
    byte = _nibble_chunks(codes.to(torch.uint8)).reshape(n // 16, k // SB4K, 2048)
    return torch.cat([_k8_head(sc, mn, d, dmin), byte], dim=-1).contiguous()

def pack_q5k8(codes: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor
              ) -> torch.Tensor:
    """GGUF Q5_K for the integer product with 8-bit rows (`mm5k8`): codes [N, K] (0..31), sub-scales and sub-mins
    [N, K/32] (0..63), d and dmin [N, K/256] (weight = d * sc * code - dmin * mn, Q4_K's form) -> [N/16, K/256,
    2816] uint8: `pack_q4k8`'s head, then per group the codes' low 4 bits as `pack_q4k8` lays them out and their
    fifth bits as `pack_q5r` does: 5.5 bits a weight, as the file."""
    n, k = _shape(codes, SB4K, "Q5_K vector kernel")
    _within(codes, 0, 31, "Q5_K vector kernel: codes")
    u = codes.to(torch.uint8)
    groups = torch.cat([_nibble_chunks(u & 15), _top_bits(u >> 4)], dim=-1)  # [b, g, 320]
    return torch.cat([_k8_head(sc, mn, d, dmin), groups.reshape(n // 16, k // SB4K, 8 * 320)], dim=-1).contiguous()

def pack_q6k8(codes: torch.Tensor, sc: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """GGUF Q6_K for the integer product with 8-bit rows (`mm6k8`): codes [N, K] (-32..31), int8 sub-scales
    [N, K/16], d [N, K/256] float32 (weight = d * sub-scale * code) -> [N/16, K/256, 3392] uint8: per 16 outputs
    and super-block the 16 d, then per group of 16 inputs (u = code + 32) u's low 4 bits in 2 chunks of 64 bytes
    (chunk p, byte 4j + i: output j's input 8p + i low, 8p + 4 + i high nibble), u's top 2 bits in 64 bytes
    (byte 4j + i, bits 2t..2t+1: output j's input 4t + i) and the 16 sub-scales: 6.625 bits a weight."""
    n, k = _shape(codes, SB4K, "Q6_K vector kernel")
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

def pack_q3k8(codes: torch.Tensor, sc: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """GGUF Q3_K for the integer product with 8-bit rows (`mm3k8`): codes [N, K] (-4..3), int8 sub-scales [N, K/16]
    (the file's 6-bit values less 32), d [N, K/256] float32 (weight = d * sub-scale * code) -> [N/16, K/256, 2368]
    uint8: `pack_q6k8`'s layout with u = code + 4 (0..7) in the nibbles and no plane of top bits."""
    n, k = _shape(codes, SB4K, "Q3_K vector kernel")
    _within(codes, -4, 3, "Q3_K vector kernel: codes")
    g, sb = k // GROUP6, k // SB4K
    u = (codes.to(torch.int16) + 4).to(torch.uint8).reshape(n // 16, 16, g, 2, 2, 4)  # b, j, group, p, high?, i
    nib = (u[..., 0, :] | (u[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).reshape(n // 16, g, 128)
    scales = sc.to(torch.int8).view(torch.uint8).reshape(n // 16, 16, g).permute(0, 2, 1)  # [b, g, 16]
    groups = torch.cat([nib, scales], dim=-1).reshape(n // 16, sb, 16 * 144)
    head = d.float().reshape(n // 16, 16, sb).permute(0, 2, 1).contiguous().view(torch.uint8)  # [b, sb, 64]
    return torch.cat([head, groups], dim=-1).contiguous()

def pack_q8r(codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """GGUF Q8_0 for the integer product with 8-bit rows (`mm8r`): codes [N, K] (-127..127) with a scale per 32
    [N, K/32] (float16 values: the file's) -> [N/16, K/32, 544] uint8: per 16 outputs and group, 8 chunks of 64
    bytes (chunk t, byte 4j + i: output j's code of input 4t + i), then the 16 scales (float16): 8.5 bits a
    weight, as the file."""
    n, k = _shape(codes, GROUP, "8-bit rows kernel")
    g = k // GROUP
    q = codes.to(torch.int8).reshape(n // 16, 16, g, 8, 4).permute(0, 2, 3, 1, 4).reshape(n // 16, g, 512)
    return torch.cat([q.view(torch.uint8), _f16_scales(d, n, g)], dim=-1).contiguous()

def pack_q5r(codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """GGUF Q5_0 for the integer product with 8-bit rows (`mm5r`): codes [N, K] (-16..15) with a scale per 32
    [N, K/32] (float16 values: the file's) -> [N/16, K/32, 352] uint8: per 16 outputs and group (u = code + 16)
    u's low 4 bits in 4 chunks of 64 bytes (chunk p, byte 4j + i: output j's input 8p + i low, 8p + 4 + i high
    nibble), u's top bits in 64 bytes (byte 4j + i, bit 2p: output j's input 8p + i, bit 2p + 1: 8p + 4 + i),
    then the 16 scales (float16): 5.5 bits a weight, as the file."""
    n, k = _shape(codes, GROUP, "Q5_0 rows kernel")
    _within(codes, -16, 15, "Q5_0 rows kernel: codes")
    g = k // GROUP
    u = (codes.to(torch.int16) + 16).to(torch.uint8)
    return torch.cat([_nibble_chunks(u & 15), _top_bits(u >> 4), _f16_scales(d, n, g)], dim=-1).contiguous()

def pack_q51r(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """GGUF Q5_1 for the integer product with 8-bit rows (`mm51r`): codes [N, K] (0..31), a scale and a min per 32
    [N, K/32] each (float16 values: the file's; weight d * code + m) -> [N/16, K/32, 384] uint8: `pack_q5r`'s
    layout of the codes as they are, its 16 scales, then the 16 mins: 6 bits a weight, as the file."""
    n, k = _shape(codes, GROUP, "Q5_1 rows kernel")
    _within(codes, 0, 31, "Q5_1 rows kernel: codes")
    g = k // GROUP
    u = codes.to(torch.uint8)
    return torch.cat([_nibble_chunks(u & 15), _top_bits(u >> 4), _f16_scales(d, n, g), _f16_scales(m, n, g)],
                     dim=-1).contiguous()

def _iq4_indices(values: torch.Tensor) -> torch.Tensor:
    """Weight values [N, K], each one of IQ4_VALUES (the file's indices looked up) -> their indices (uint8 0..15)."""
    table = torch.full((256,), -1, dtype=torch.int16)
    table[torch.tensor(IQ4_VALUES) + 128] = torch.arange(16, dtype=torch.int16)
    idx = table[values.long().clamp(-128, 127) + 128]
    if values.numel() and (int(values.min()) < -128 or int(values.max()) > 127 or int(idx.min()) < 0):
        raise ValueError("IQ4 rows kernel: every weight code must be one of IQ4_NL's 16 table values")
    return idx.to(torch.uint8)


def pack_iq4r(values: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """GGUF IQ4_NL for the integer product with 8-bit rows (`mmiq4r`): values [N, K] (each one of IQ4_VALUES: the
    file's indices looked up) with a scale per 32 [N, K/32] (float16 values: the file's d) -> [N/16, K/32, 288]
    uint8: the indices as `pack_q4r`'s nibbles, then the 16 scales (float16): 4.5 bits a weight, as the file."""
    n, k = _shape(values, GROUP, "IQ4 rows kernel")
    return torch.cat([_nibble_chunks(_iq4_indices(values)), _f16_scales(d, n, k // GROUP)], dim=-1).contiguous()


def pack_iq4xs(values: torch.Tensor, sub: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """GGUF IQ4_XS for the integer product with 8-bit rows (`mmiq4xs`): values [N, K] (each one of IQ4_VALUES), the
    sub-scales less 32 [N, K/32] (-32..31) and d [N, K/256] (float16 values: the file's; weight d * sub * value)
    -> [N/16, K/256, 2208] uint8: per 16 outputs and super-block the 16 d (float16), then per group of 32 the indices
    as `pack_iq4r` lays them out and the 16 sub-scales (int8): 4.3125 bits a weight. The kernel works out d * sub in
    float32, exactly: the scale `pack_iq4r`'s product would take, the same bits."""
    n, k = _shape(values, SB4K, "IQ4_XS rows kernel")
    _within(sub, -32, 31, "IQ4_XS rows kernel: sub-scales (less 32)")
    g, sb = k // GROUP, k // SB4K
    subs = sub.to(torch.int8).view(torch.uint8).reshape(n // 16, 16, g).permute(0, 2, 1)  # [b, g, 16]
    groups = torch.cat([_nibble_chunks(_iq4_indices(values)), subs], dim=-1).reshape(n // 16, sb, 8 * 272)
    return torch.cat([_f16_scales(d, n, sb), groups], dim=-1).contiguous()  # the 16 d per super-block first


def pack_q4r(codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """GGUF Q4_0 for the integer product with 8-bit rows (`mm4r`): codes [N, K] (0..15: the file's, weight d *
    (code - 8)) with a scale per 32 [N, K/32] (float16 values: the file's) -> [N/16, K/32, 288] uint8: `pack_q5r`'s
    nibbles of the codes, then the 16 scales (float16): 4.5 bits a weight, as the file."""
    n, k = _shape(codes, GROUP, "Q4_0 rows kernel")
    _within(codes, 0, 15, "Q4_0 rows kernel: codes")
    return torch.cat([_nibble_chunks(codes.to(torch.uint8)), _f16_scales(d, n, k // GROUP)], dim=-1).contiguous()

def pack6(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes [N, K] (int8; GGUF's Q6_K: -32..31) and scales [N, K/16] float32 -> [N/16, K/16, 320] uint8: per
    16 outputs and group of 16 inputs, byte 16k + j holds input k's code of output j, then the 16 scales."""
    n, k = _shape(codes, GROUP6, "16-input 8-bit vector kernel")
    g = k // GROUP6
    q = codes.to(torch.int8).reshape(n // 16, 16, g, GROUP6).permute(0, 2, 3, 1).reshape(n // 16, g, 256)
    d = scales.float().reshape(n // 16, 16, g).permute(0, 2, 1).contiguous().view(torch.uint8)
    return torch.cat([q.view(torch.uint8), d], dim=-1).contiguous()

def pack8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes [N, K] (-127..127) and scales [N, K/32] -> [N/16, K/32, 576] uint8: per 16 outputs and group,
    byte 16k + j holds input k's code of output j, then the 16 scales (float32)."""
    n, k = _shape(codes, GROUP, "int8 vector kernel")
    g = k // GROUP
    q = codes.to(torch.int8).reshape(n // 16, 16, g, GROUP).permute(0, 2, 3, 1).reshape(n // 16, g, 512)
    d = scales.float().reshape(n // 16, 16, g).permute(0, 2, 1).contiguous().view(torch.uint8)  # [b, g, 64]
    return torch.cat([q.view(torch.uint8), d], dim=-1).contiguous()
