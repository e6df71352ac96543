"""8-bit KV storage after KIVI (Liu et al., 2024): keys per channel, values per token.

Keys carry a few large outlier channels, so a scale per channel (shared by the
tokens of a block) keeps the small channels precise; values have no such
channels and are quantised per token. Both are asymmetric (scale + zero point)
uint8. An optional calibration fixes the key range per layer/head/channel from
a warm-up set, so one outlier token cannot widen a block's whole range.
"""
from __future__ import annotations

import torch

LEVELS = 255.0


def quantize_keys(k: torch.Tensor, calib: tuple[torch.Tensor, torch.Tensor] | None = None):
    """k: [..., tokens, dim] -> (uint8 codes, scale, zero), range over the tokens axis (per channel)."""
    k = k.float()
    if calib is None:
        lo = k.amin(dim=-2, keepdim=True)
        hi = k.amax(dim=-2, keepdim=True)
    else:
        lo, hi = calib
        lo = torch.minimum(lo, k.amin(dim=-2, keepdim=True))  # never clip: widen where the data goes past calibration
        hi = torch.maximum(hi, k.amax(dim=-2, keepdim=True))
    return _quantize(k, lo, hi)


def quantize_values(v: torch.Tensor):
    """v: [..., tokens, dim] -> (uint8 codes, scale, zero), range over the channel axis (per token)."""
    v = v.float()
    return _quantize(v, v.amin(dim=-1, keepdim=True), v.amax(dim=-1, keepdim=True))


def _quantize(x, lo, hi):
    scale = ((hi - lo) / LEVELS).clamp_min(1e-8)
    q = torch.round((x - lo) / scale).clamp_(0, LEVELS).to(torch.uint8)
    return q, scale.to(torch.float16), lo.to(torch.float16)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.float() + zero.float()).to(dtype)


def error_report(x: torch.Tensor, x_hat: torch.Tensor) -> dict:
    """Max abs and relative (Frobenius) error of a reconstruction."""
    x = x.float()
    x_hat = x_hat.float()
    diff = (x - x_hat).abs()
    return {
        "max_abs": float(diff.max()),
        "relative": float(torch.linalg.vector_norm(x - x_hat) / torch.linalg.vector_norm(x).clamp_min(1e-12)),
    }
