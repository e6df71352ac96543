"""A GGUF tensor's blocks, byte by byte, as the codes, scales and bases they hold (one decoder per GGUF type).

Why apart from gguf_weights: these read llama.cpp's block layouts (ggml-common.h) and nothing else; each is checked
bit for bit against the `gguf` package's dequantize (test_gguf_formats), while gguf_weights maps the results onto our
kernels' products. A decoder takes a [blocks, bytes] uint8 array and returns (codes, step, base, *raw) per block,
flattened: step and base per 32 inputs (per 16 for Q6_K/Q3_K), raw what a product keeps of the file's own layout.
"""
from __future__ import annotations

import numpy as np
import torch


def _f16(b: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(b).view(np.float16).astype(np.float32))


def _q4_k(blocks: np.ndarray):
    """144-byte blocks of 256: d, dmin (f16), 12 bytes of eight 6-bit scales and mins, 128 bytes of codes (byte i of
    chunk c: code i of sub-block 2c in its low nibble, of 2c+1 in its high). Byte arithmetic in numpy on one copy
    out of the file's map (torch int32 ops on the mapped slices were much slower)."""
    b = np.array(blocks)
    nb = b.shape[0]
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    lo, hi, mix = b[:, 4:8], b[:, 8:12], b[:, 12:16]
    sc = np.concatenate([lo & 63, (mix & 15) | ((lo >> 2) & 48)], axis=1)  # sub-blocks 0-3, then 4-7
    mn = np.concatenate([hi & 63, (mix >> 4) | ((hi >> 2) & 48)], axis=1)
    qs = b[:, 16:144].reshape(nb, 4, 1, 32)
    codes = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(nb, 256)
    step = d * sc.astype(np.float32)  # exact: an 11-bit significand times 6 bits
    base = -(dmin * mn.astype(np.float32))
    raw = (torch.from_numpy(sc), torch.from_numpy(mn), torch.from_numpy(d[:, 0]), torch.from_numpy(dmin[:, 0]))
    return torch.from_numpy(codes), torch.from_numpy(step), torch.from_numpy(base), raw


def _q5_k(blocks: np.ndarray):
    """176-byte blocks of 256: Q4_K's d, dmin and 12 bytes of sub-scales and sub-mins, then 32 bytes of fifth bits
    (bit 2c of byte i: code i of sub-block 2c's, bit 2c + 1: of sub-block 2c + 1's), then Q4_K's 128 bytes of low
    nibbles. Weight d * sc * code - dmin * mn with codes 0..31."""
    b = np.array(blocks)
    nb = b.shape[0]
    codes, step, base, raw = _q4_k(np.concatenate([b[:, :16], b[:, 48:176]], axis=1))
    qh = b[:, 16:48]  # [nb, 32]
    high = np.stack([(qh >> s) & 1 for s in range(8)], axis=1).reshape(nb, 256)  # sub-block s, position i
    codes = codes.numpy() | (high.astype(np.uint8) << 4)
    return torch.from_numpy(codes), step, base, raw


def _q6_k(blocks: np.ndarray):
    """210-byte blocks of 256: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, d (f16)."""
    b = np.array(blocks)
    nb = b.shape[0]
    ql = b[:, 0:128].reshape(nb, 2, 1, 64)
    qh = b[:, 128:192].reshape(nb, 2, 1, 32)
    low = np.concatenate([ql & 15, ql >> 4], axis=2).reshape(nb, 2, 4, 32)  # half, quarter, position
    high = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)  # [nb, 2, 4, 32]
    codes = ((low | (high << 4)).view(np.int8) - np.int8(32)).reshape(nb, 256)
    sc8 = b[:, 192:208].view(np.int8)
    sc = sc8.astype(np.float32)
    d = b[:, 208:210].copy().view(np.float16).astype(np.float32)
    step = d * sc  # exact: 11 bits times 7, times 6 still in 24
    return (torch.from_numpy(codes), torch.from_numpy(step), None,
            (torch.from_numpy(sc8.copy()), torch.from_numpy(d[:, 0])))


def _q3_k(blocks: np.ndarray):
    """110-byte blocks of 256: 32 bytes of high bits (bit b of byte l: weight 32b + l's), 64 bytes of 2-bit codes (byte
    l of half c, bits 2t..2t+1: weight 128c + 32t + l's), 12 bytes of sixteen 6-bit sub-scales (low nibbles in bytes
    0-7, sub-scale g's in byte g % 8's nibble g // 8; top 2 bits in bytes 8-11, g's at bits 2(g // 4) of byte
    8 + g % 4), d (f16). Weight d * (sub-scale - 32) * code, code = low 2 bits less 4 where the high bit is 0: Q6_K's
    form with codes -4..3."""
    b = np.array(blocks)
    nb = b.shape[0]
    hmask, qs, sb = b[:, 0:32], b[:, 32:96], b[:, 96:108]
    low = np.stack([(qs.reshape(nb, 2, 32) >> s) & 3 for s in (0, 2, 4, 6)], axis=2).reshape(nb, 256)
    high = np.stack([(hmask >> s) & 1 for s in range(8)], axis=1).reshape(nb, 256)
    codes = low.astype(np.int8) - ((high ^ 1).astype(np.int8) << 2)
    lo = np.concatenate([sb[:, 0:8] & 15, sb[:, 0:8] >> 4], axis=1)  # [nb, 16]
    hi = np.concatenate([(sb[:, 8:12] >> s) & 3 for s in (0, 2, 4, 6)], axis=1)
    sc8 = ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.int8)
    d = b[:, 108:110].copy().view(np.float16).astype(np.float32)
    step = d * sc8.astype(np.float32)  # exact: 11 bits times 6
    return torch.from_numpy(codes), torch.from_numpy(step), None, (torch.from_numpy(sc8), torch.from_numpy(d[:, 0]))


def _q8_0(blocks: np.ndarray):
    """34-byte blocks of 32: d (f16), 32 int8 codes."""
    b = np.array(blocks)
    d = torch.from_numpy(b[:, 0:2].copy().view(np.float16).astype(np.float32))
    return torch.from_numpy(b[:, 2:34].copy().view(np.int8)), d, None


# IQ4_NL's 16 code values (llama.cpp's kvalues_iq4nl)
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def _iq4_nl(blocks: np.ndarray):
    """18-byte blocks of 32: d (f16), then Q4_0's 16 bytes of nibbles (codes i and i + 16 share byte i), each an index
    into IQ4_VALUES. Weight d * value: Q8_0's form with 8-bit codes from the table (on 8-bit rows the IQ4 product
    looks the table up itself, 4.5 bits a weight, as the file), as llama.cpp's Q3_K and IQ4_XS files fall
    back to it where rows are not in 256s (Qwen2.5-0.5B's 896)."""
    b = np.array(blocks)
    nb = b.shape[0]
    d = torch.from_numpy(b[:, 0:2].copy().view(np.float16).astype(np.float32))
    qs = b[:, 2:18]
    idx = np.concatenate([qs & 15, qs >> 4], axis=1)  # [nb, 32]
    return torch.from_numpy(IQ4_VALUES[idx].reshape(nb, 32)), d, None


def _iq4_xs(blocks: np.ndarray):
    """136-byte blocks of 256: d (f16), 2 bytes of sub-scales' top 2 bits (bits 2s..2s+1: sub-block s's), 4 bytes of
    their low 4 bits (sub-block s's in byte s/2, low nibble where s is even), then 8 x IQ4_NL's 16 bytes of indices.
    Weight d * (sub-scale - 32) * value: IQ4_NL's form with a scale per 32 that float16 cannot hold but float32 holds
    exactly (11 bits times 6), as is each weight (and 7 bits more); raw: the sub-scales less 32 and d, as the file."""
    b = np.array(blocks)
    nb = b.shape[0]
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)  # [nb, 1]
    high = b[:, 2:4].copy().view("<u2").astype(np.int32)  # [nb, 1]
    sub = np.arange(8)
    low = (b[:, 4:8][:, sub // 2] >> (4 * (sub % 2))) & 15  # [nb, 8]
    ls = low.astype(np.int32) | (((high >> (2 * sub)) & 3) << 4)
    qs = b[:, 8:136].reshape(nb, 8, 16)
    idx = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(nb, 256)
    step = d * (ls - 32).astype(np.float32)
    raw = (torch.from_numpy((ls - 32).astype(np.int8)), torch.from_numpy(d[:, 0]))  # what the IQ4_XS product keeps
    return torch.from_numpy(IQ4_VALUES[idx]), torch.from_numpy(step), None, raw


def _q4_0_1(blocks: np.ndarray, with_min: bool):
    """Q4_0 (18-byte blocks: d, 16 bytes) or Q4_1 (20: d, m, 16 bytes) of 32; codes i and i + 16 share byte i."""
    nb = blocks.shape[0]
    d = _f16(blocks[:, 0:2])
    start = 4 if with_min else 2
    qs = torch.from_numpy(np.ascontiguousarray(blocks[:, start:start + 16])).to(torch.int32)
    codes = torch.cat([qs & 15, qs >> 4], dim=1).reshape(nb, 32)
    base = _f16(blocks[:, 2:4]) if with_min else -8 * d
    return codes, d, base


def _q5_1(blocks: np.ndarray):
    """24-byte blocks of 32: d, m (f16), 32 high bits, 16 bytes of low nibbles (Q5_0's layout after m). Weight
    d * code + m with codes 0..31, Q4_1's form (llama.cpp's Q5_K_M and Q3_K_M fall back to it for Q5_K tensors whose
    rows are not in 256s: Qwen2.5-0.5B's attn_v)."""
    b = np.array(blocks)
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    qh = b[:, 4:8].copy().view("<u4")  # [nb, 1]
    qs = b[:, 8:24]
    low = np.concatenate([qs & 15, qs >> 4], axis=1)
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
    return torch.from_numpy(low | high), d, m


def _q5_0(blocks: np.ndarray):
    """22-byte blocks of 32: d (f16), 32 high bits, 16 bytes of low nibbles; code i (0..15) and i + 16 share byte i,
    bit i of the high bits is code i's fifth. Weight d * (code - 16): the 16-input 8-bit product's form, with the
    block's scale for both of its halves (llama.cpp's Q4_K_M keeps Q5_0 where a row's length is not in 256s)."""
    b = np.array(blocks)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
    qh = b[:, 2:6].copy().view("<u4")  # [nb, 1]
    qs = b[:, 6:22]
    low = np.concatenate([qs & 15, qs >> 4], axis=1)  # [nb, 32]
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
    codes = ((low | high).view(np.int8) - np.int8(16))
    return torch.from_numpy(codes), torch.from_numpy(np.repeat(d, 2, axis=1)), None


# GGUF type -> (bytes a block, weights a block, its decoder)
BLOCKS = {"Q3_K": (110, 256, _q3_k), "Q4_K": (144, 256, _q4_k), "Q5_K": (176, 256, _q5_k), "Q6_K": (210, 256, _q6_k),
          "Q8_0": (34, 32, _q8_0), "Q5_0": (22, 32, _q5_0), "Q4_0": (18, 32, lambda b: _q4_0_1(b, False)),
          "Q4_1": (20, 32, lambda b: _q4_0_1(b, True)), "IQ4_NL": (18, 32, _iq4_nl), "Q5_1": (24, 32, _q5_1),
          "IQ4_XS": (136, 256, _iq4_xs)}
DECODED = frozenset(BLOCKS)  # the GGUF types gguf_weights.decode reads (the token embedding's too: FileEmbedding)
