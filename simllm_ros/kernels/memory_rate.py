"""What this machine's memory gives (membw.c): the read and copy rate of 1..N threads over buffers far larger than
the caches. A decode step reads every weight once, so bytes per token over the read rate is the step's floor;
simllm-bench decode_profile sets each model against it."""
from __future__ import annotations

import ctypes

import torch

from . import abi, build


# src, dst, bytes, threads, reps, copy -> GB/s; checked against membw_api.h (kernels/abi.py)
SIGNATURES: abi.Signatures = {"simllm_memory_rate": (
    [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_int], ctypes.c_double)}


class MemoryRate:
    def __init__(self, path: str):
        self._rate = abi.bind(ctypes.CDLL(path), "membw", SIGNATURES, "simllm_memory_rate")

    def measure(self, threads: int, copy: bool = False, mib: int = 512, tries: int = 3) -> float:
        """GB/s (1e9 bytes a second) of `threads` threads reading (or copying: read plus written) `mib` MiB, the best
        of `tries` passes after one that touches the pages."""
        src = torch.ones(mib << 18, dtype=torch.int32)  # 4-byte words: mib MiB
        dst = torch.empty_like(src) if copy else src
        nbytes = src.numel() * 4
        self._rate(src.data_ptr(), dst.data_ptr(), nbytes, threads, 1, int(copy))  # the first touch
        best = max(self._rate(src.data_ptr(), dst.data_ptr(), nbytes, threads, 1, int(copy)) for _ in range(tries))
        if best < 0:
            raise RuntimeError(f"could not start {threads} threads")
        return best


_LOADER = build.Loader("SIMLLM_MEMBW", "off", "membw", MemoryRate, signatures=SIGNATURES)


def load() -> "MemoryRate | None":
    """The library for this process (built on first use), or None with `why_not()` saying why."""
    return _LOADER.load()


def why_not() -> str | None:
    return _LOADER.why_not
