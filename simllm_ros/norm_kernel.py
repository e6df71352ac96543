"""RMSNorm in C for the CPU runner: one call instead of ~8 torch ops per norm.

Why: a decode step of SmolLM2-135M runs 61 norms, and transformers' LlamaRMSNorm is eight small ops (to
float32, pow, mean, add, rsqrt, mul, to bf16, mul by the weight): ~40 us a norm here, ~2.4 ms of a ~22 ms
step, measured with torch's profiler. Each row is computed alone in a fixed order (float32 squares summed in
16 lanes, the lanes in a fixed tree; 1/sqrt(mean + eps); x times that rounded to bf16, then times the weight
rounded to bf16, as transformers rounds), so a row's bits depend on nothing but the row: row-invariant like
the rest of the runner. Float32 rows (the 4-bit float32 runner) the same way, without the bf16 roundings. Built
and loaded like attention_kernel (system C compiler, ctypes); bf16 and float32 rows on the CPU, the transformers
module elsewhere. `SIMLLM_NORM=torch` keeps the module.
"""
from __future__ import annotations

import ctypes

import torch

from . import attention_kernel

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>

typedef uint16_t bf16;
static inline float f32(bf16 b) { uint32_t u = ((uint32_t)b) << 16; float f; memcpy(&f, &u, 4); return f; }
static inline bf16 to_bf16(float f) {  /* round to nearest even, as torch does */
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

/* 1 / sqrt(mean + eps) of a row's squares summed in 16 lanes: the lanes added in a fixed tree. */
static inline float inv_rms(float acc[16], int E, float eps) {
    for (int s = 8; s >= 1; s >>= 1)
        for (int l = 0; l < s; l++) acc[l] += acc[l + s];
    return 1.0f / sqrtf(acc[0] / (float)E + eps);
}

/* y[m] = w * bf16(x[m] / sqrt(mean(x[m]^2) + eps)), E a multiple of 16. x rows at x_stride (0: one row
   repeated), y rows contiguous. */
void simllm_rmsnorm_bf16(const bf16 *x, long x_stride, const bf16 *w, bf16 *y, int M, int E, float eps) {
    for (int m = 0; m < M; m++) {
        const bf16 *xr = x + (long)m * x_stride;
        bf16 *yr = y + (long)m * E;
        float acc[16] = {0};
        for (int k = 0; k < E; k += 16)
            for (int l = 0; l < 16; l++) { float v = f32(xr[k + l]); acc[l] += v * v; }
        const float r = inv_rms(acc, E, eps);
        for (int k = 0; k < E; k++) yr[k] = to_bf16(f32(w[k]) * f32(to_bf16(f32(xr[k]) * r)));
    }
}

/* The same in float32 (the 4-bit float32 runner: int4_vector_kernel): y[m] = w * (x[m] * r), the sum of squares
   in the same 16 lanes and tree. */
void simllm_rmsnorm_f32(const float *x, long x_stride, const float *w, float *y, int M, int E, float eps) {
    for (int m = 0; m < M; m++) {
        const float *xr = x + (long)m * x_stride;
        float *yr = y + (long)m * E;
        float acc[16] = {0};
        for (int k = 0; k < E; k += 16)
            for (int l = 0; l < 16; l++) acc[l] += xr[k + l] * xr[k + l];
        const float r = inv_rms(acc, E, eps);
        for (int k = 0; k < E; k++) yr[k] = w[k] * (xr[k] * r);
    }
}
"""

_loaded: "NormKernel | None" = None
_why_not: str | None = None


class NormKernel:
    def __init__(self, path: str):
        self.path = path
        lib = ctypes.CDLL(path)
        self._fns = {torch.bfloat16: lib.simllm_rmsnorm_bf16, torch.float32: lib.simllm_rmsnorm_f32}
        for fn in self._fns.values():
            fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                           ctypes.c_int, ctypes.c_float]
            fn.restype = None

    @staticmethod
    def takes(weight: torch.Tensor) -> bool:
        """Whether a norm of this weight runs here: bf16 or float32 on the CPU, a size that is a multiple of 16."""
        return weight.dtype in (torch.bfloat16, torch.float32) and weight.device.type == "cpu" and weight.dim() == 1 and \
            weight.shape[0] % 16 == 0 and weight.is_contiguous()

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [..., E] in the weight's dtype (bf16 or float32) on the CPU, rows evenly strided (a view is read in
        place) -> a new [..., E] tensor. The weight is checked once by `takes` (this is called 61 times per decode
        step: kept lean)."""
        e = x.shape[-1]
        if x.dtype != weight.dtype or e != weight.shape[0]:
            raise ValueError(f"norm kernel: {weight.dtype} rows of {weight.shape[0]} (got {x.dtype}, {e})")
        rows = x.reshape(-1, e)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        m = rows.shape[0]
        y = torch.empty((m, e), dtype=x.dtype)
        self._fns[x.dtype](rows.data_ptr(), rows.stride(0), weight.data_ptr(), y.data_ptr(), m, e, eps)
        return y.view(x.shape)


def load() -> "NormKernel | None":
    """The kernel for this process (built on first use), or None with `why_not()` saying why."""
    global _loaded, _why_not
    if _loaded is not None or _why_not is not None:
        return _loaded
    _loaded, _why_not = attention_kernel.load_kernel("SIMLLM_NORM", "torch", "rmsnorm", SOURCE, NormKernel)
    return _loaded


def why_not() -> str | None:
    return _why_not
