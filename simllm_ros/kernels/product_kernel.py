"""What the two weight-product kernels share: int4_kernel (bf16 on AMX tiles) and int4_vector_kernel (float32
on vector units) are the same kind of ctypes wrapper over their C library, loaded once per process the same way.

Why one base: the library's entries, the per-thread scratch, the checks and thread count of a product, and
load-once-then-self-check were written twice and had started to drift. Only plumbing lives here: each kernel
keeps its own packing, buffer sizes, entry signatures and self-check numbers, so its arithmetic (and the bits
it computes) is its own.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Callable, Sequence, TypeVar

import torch

from . import abi, build, compute_threads, kernel_pool

P, L, I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int  # noqa: E741 - C type shorthands for the signature rows below
# simllm_*_mm: x, x row stride, weight blob, y, y row stride, M, N, K, group sums, scratch, scratch per thread, threads
MM_ARGS = [P, L, P, P, L, I, I, I, P, P, L, I]
# simllm_*int8_mm (the LM head): the same without the group sums
MM8_ARGS = [P, L, P, P, L, I, I, I, P, L, I]
# pool.h's entries, which both product libraries export (pool_api.h): name -> (argtypes, restype)
POOL_SIGNATURES: abi.Signatures = {"simllm_pool_call": ([P, P, L, I], None), "simllm_pool_profile": ([I, P], None),
                   "simllm_pool_stop": ([], None), "simllm_pool_tune": ([L], None), "simllm_pool_pin": ([P, I], None),
                   "simllm_pool_workers": ([], ctypes.c_int)}
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "float32"}  # as refusals name the rows


class ProductKernel:
    """A compiled product library called on torch tensors: `pack*` once per weight, `mm*` per product.

    Subclasses set `kind`, `dtype` and `label` (how refusals name the kernel), `library` (the built library's
    name) and `SIGNATURES` (every entry they bind: name -> (argtypes, restype), checked against the library's
    header by kernels/abi.py), name their 4-bit (`mm`) and 8-bit (`mm8`) entries and bind any other with
    `_entry`; `pool_call` is the library's worker pool entry, lent to AttentionKernel.use_pool."""

    kind = ""
    library = ""
    SIGNATURES: abi.Signatures = {}
    dtype = torch.float32
    label = "product kernel"  # "int4 kernel: ..." / "int4 vector kernel: ..." in refusals

    def __init__(self, path: str, mm: str, mm8: str):
        self._lib = ctypes.CDLL(path)
        self.path = path
        self._mm = self._entry(mm)
        self._mm8 = self._entry(mm8)
        self.pool_call = self._address("simllm_pool_call")
        self._pool_profile = self._entry("simllm_pool_profile")
        self._pool_stop = self._entry("simllm_pool_stop")
        self._pool_pin = self._entry("simllm_pool_pin")
        self._pool_tune = self._entry("simllm_pool_tune")
        self._pool_workers = self._entry("simllm_pool_workers")
        self._scratch = threading.local()  # per calling thread: a product runs without the GIL

    def stop_workers(self) -> None:
        """End the kept workers (an engine's unload); the next threaded product starts them again."""
        self._pool_stop()

    def workers(self) -> int:
        """Kept workers running now."""
        return int(self._pool_workers())

    def pin_workers(self, cpus: Sequence[int]) -> None:
        """Worker i on cpus[i % len(cpus)] (the caller's CPU first, so worker 1 takes cpus[1]); [] unpinned."""
        arr = (ctypes.c_int * max(1, len(cpus)))(*cpus)
        self._pool_pin(arr, len(cpus))

    def spin_workers(self, microseconds: float) -> None:
        """How long an idle worker spins before it sleeps."""
        self._pool_tune(int(microseconds * 1000))

    def pool_profile(self, on: bool) -> dict[str, float]:
        """The kept workers' counts since the last call (pool.h), counting from now on while `on`: dispatches, how
        many found a worker asleep, the caller's wait for its workers (ms), products computed alone (workers busy)."""
        out = (ctypes.c_double * 4)()
        self._pool_profile(int(on), out)
        return {"dispatches": out[0], "woke_sleeper": out[1], "wait_ms": out[2] / 1e6, "alone": out[3]}

    def _entry(self, name: str):
        """The library's function `name`, typed as SIGNATURES says (checked against the header: abi.bind)."""
        return abi.bind(self._lib, self.library, self.SIGNATURES, name)

    def _address(self, name: str) -> int:
        """The address of the library's function `name`, for C callers (the C layers, attention's pool): a
        declared entry too, whose signature SIGNATURES states for those callers."""
        address = ctypes.cast(self._entry(name), ctypes.c_void_p).value
        if address is None:
            raise abi.AbiMismatch(f"{name}: the library gives no address for it")
        return address

    def _check(self, x: torch.Tensor, blob: torch.Tensor, n: int, blob_bytes: int, what: str, group: int,
               min_macs: int) -> tuple[int, int, int]:
        """(M, K, threads) of a product of rows x [M, K] with a blob of n outputs in groups of `group` inputs;
        below `min_macs` multiply-adds it runs in the caller's thread alone. Bad input raises ValueError."""
        m, k = x.shape
        if x.dtype != self.dtype or x.stride(1) != 1 or blob.shape != (n // 16, k // group, blob_bytes):
            raise ValueError(f"{what} {self.label}: {_DTYPE_NAMES[self.dtype]} rows [M, K] with contiguous inputs, "
                             "and weights packed for them")
        threads = max(1, compute_threads.kernel_threads()) if m * n * k >= min_macs else 1
        return m, k, threads


def compare(mm: Callable, x: torch.Tensor, blob: torch.Tensor, n: int, want: torch.Tensor,
            rows: Sequence[tuple[int, int]]) -> tuple[float, bool]:
    """A self-check's measurements: (the largest error of the product of all rows against `want`, in want's
    dtype; whether each slice (first row, count) of `rows` computed alone gives the same bits as among all)."""
    got = mm(x, blob, n)
    err = (got.to(want.dtype) - want).abs().max().item()
    return err, all(torch.equal(mm(x[i:i + r].contiguous(), blob, n), got[i:i + r]) for i, r in rows)


PK = TypeVar("PK", bound=ProductKernel)


class Loader(build.Loader[PK]):
    """build.Loader for a product kernel class `make` (its SIGNATURES checked against the library's header): one that
    passes its checks lends its workers to attention."""

    def __init__(self, env: str, off: str, library: str, make: type[PK], checks: Sequence[Callable[[PK], str | None]]):
        super().__init__(env, off, library, make, checks,
                         then=lambda kernel: kernel_pool.lend_to_attention(kernel.pool_call),
                         signatures=make.SIGNATURES)
