"""cos and sin of RoPE's angles with the same bits on every CPU.

torch's float32 cos/sin run SLEEF's vector code, whose last bit differs between AVX-512, AVX2 and NEON builds (seen:
the same angles gave other cos/sin bits on aarch64 than on an AVX-512 x86, and every layer's keys differed after
position 0). Here the angle is reduced and the polynomial evaluated in float64 with only IEEE adds and multiplies,
each its own torch op (no fused multiply-add, no library call), so every CPU computes the same float64 value; its
rounding to float32 is then the same everywhere too, and within half an ulp of the true value but for an error of
~1e-16 before the rounding.
"""
from __future__ import annotations

import torch

# pi/2 as a 33-bit head and its tail: k * _PIO2_HI is exact for |k| < 2**20 (angles up to ~1.6e6 rad).
_PIO2_HI = 1.57079632673412561417e00
_PIO2_LO = 6.07710050650619224932e-11
_TWO_OVER_PI = 6.36619772367581382433e-01
# Minimax polynomials of sin and cos on [-pi/4, pi/4] (the classic fdlibm kernel coefficients).
_SIN = (-1.66666666666666324348e-01, 8.33333333332248946124e-03, -1.98412698298579493134e-04,
        2.75573137070700676789e-06, -2.50507602534068634195e-08, 1.58969099521155010221e-10)
_COS = (4.16666666666666019037e-02, -1.38888888888741095749e-03, 2.48015872894767294178e-05,
        -2.75573143513906633035e-07, 2.08757232129817482790e-09, -1.13596475577881948265e-11)
MAX_ANGLE = 1.5e6


def _horner(z: torch.Tensor, coefficients: tuple[float, ...]) -> torch.Tensor:
    acc = torch.full_like(z, coefficients[-1])
    for c in reversed(coefficients[:-1]):
        acc = acc * z + c
    return acc


def max_position(inv_freq: torch.Tensor) -> int:
    """The largest position whose angles (position x inverse frequency) stay within MAX_ANGLE for this table: a
    caller that keeps its positions to it has bounded every angle once (float32's rounding of the product adds at
    most one part in 2**24, well inside the exact reduction's ~1.6e6)."""
    top = float(inv_freq.abs().max()) if inv_freq.numel() else 0.0
    return int(MAX_ANGLE / top) if top > 0 else 2**62


def check_positions(positions: torch.Tensor, most: int) -> None:
    """ValueError where a position lies beyond `most` (max_position of the table): its angles could leave the
    exact reduction's range."""
    if positions.numel() and int(positions.abs().max()) > most:
        raise ValueError(f"RoPE angle above {MAX_ANGLE:g} rad (position {int(positions.abs().max())} past {most}): "
                         "outside the exact reduction's range")


def rope_cos_sin(angles: torch.Tensor, bounded: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of float32 `angles` as float32, bitwise the same on every CPU (see the module's docstring).
    `bounded`: the caller kept its positions to max_position (check_positions), so no angle is looked at here."""
    x = angles.to(torch.float64)
    if not bounded and x.numel() and float(x.abs().max()) > MAX_ANGLE:
        raise ValueError(f"RoPE angle above {MAX_ANGLE:g} rad: outside the exact reduction's range")
    k = torch.round(x * _TWO_OVER_PI)
    r = (x - k * _PIO2_HI) - k * _PIO2_LO
    z = r * r
    s = r + (r * z) * _horner(z, _SIN)
    c = (1.0 - 0.5 * z) + (z * z) * _horner(z, _COS)
    q = k.to(torch.int64) & 3
    sin = torch.where(q == 0, s, torch.where(q == 1, c, torch.where(q == 2, -s, -c)))
    cos = torch.where(q == 0, c, torch.where(q == 1, -s, torch.where(q == 2, -c, s)))
    return cos.to(torch.float32), sin.to(torch.float32)
