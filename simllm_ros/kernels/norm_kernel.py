"""RMSNorm in C for the CPU runner: one call instead of ~8 torch ops per norm.

Why: a decode step of SmolLM2-135M runs 61 norms, and transformers' LlamaRMSNorm is eight small ops (to float32, pow,
mean, add, rsqrt, mul, to bf16, mul by the weight): a tenth of a step, measured with torch's profiler
(benchmark/results/verified_decoding_notes.md). Each row is computed alone in a fixed order (float32 squares summed in
16 lanes, the lanes in a fixed tree; 1/sqrt(mean + eps); x times that rounded to bf16, then times the weight rounded
to bf16, as transformers rounds), so a row's bits depend on nothing but the row: row-invariant like the rest of the
runner. Float32 rows (the 4-bit float32 runner) the same way, without the bf16 roundings. Built C in
kernels/rmsnorm.c, built by kernels/build.py and loaded with ctypes; bf16 and float32 rows on the CPU, the
transformers module elsewhere. `SIMLLM_NORM=torch` keeps the module.
"""
from __future__ import annotations

import ctypes

import torch

from . import abi, build


# x, x's row stride, w, y, M, E, eps; checked against rmsnorm_api.h (kernels/abi.py)
_ARGS = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_float]
SIGNATURES: abi.Signatures = {"simllm_rmsnorm_bf16": (_ARGS, None), "simllm_rmsnorm_f32": (_ARGS, None)}


class NormKernel:
    def __init__(self, path: str):
        self.path = path
        lib = ctypes.CDLL(path)
        self._fns = {torch.bfloat16: abi.bind(lib, "rmsnorm", SIGNATURES, "simllm_rmsnorm_bf16"),
                     torch.float32: abi.bind(lib, "rmsnorm", SIGNATURES, "simllm_rmsnorm_f32")}

    @staticmethod
    def takes(weight: torch.Tensor) -> bool:
        """Whether a norm of this weight runs here: bf16 or float32 on the CPU, a size that is a multiple of 16."""
        return weight.dtype in (torch.bfloat16, torch.float32) and weight.device.type == "cpu" \
            and weight.dim() == 1 and weight.shape[0] % 16 == 0 and weight.is_contiguous()

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


_LOADER = build.Loader("SIMLLM_NORM", "torch", "rmsnorm", NormKernel, signatures=SIGNATURES)


def load() -> "NormKernel | None":
    """The kernel for this process (built on first use), or None with `why_not()` saying why."""
    return _LOADER.load()


def why_not() -> str | None:
    return _LOADER.why_not
