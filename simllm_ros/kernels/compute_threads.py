"""Who gets the cores while the model runs: our C kernels' workers, not torch's threads.

Where the runner's products and attention are our kernels (int4_kernel's AMX or int4_vector_kernel's products,
attention_kernel), a pass is C calls that split their work over worker threads, with some torch ops around them. At torch's default
thread count, torch's own worker threads then burn a core between and during our kernels' work (measured on a
2-core box, SEMANTIC hits: a torch worker thread used ~17 ms of CPU per hit, ~5 with this; hit 43 vs 50 ms).
So the thread that runs the model sets torch to one thread for the while (`kernels_own_cores`) and the kernels
use the count torch had (`kernel_threads`). Setting only OpenMP's per-thread count, or MKL's too, did not do it
(measured: no change; why torch's own setting does is not understood); torch.set_num_threads does, and it also
sets the count that threads use when they first run torch code, so threads that compute other things with
torch (the fingerprinter's) set their own count when they start (`own_count`). Threads change no bit of any
kernel's result (they split outputs, never a sum), so answers do not depend on this. `SIMLLM_CORES=torch` (or `ENABLED = False`, for side-by-side runs) leaves torch
its threads.
"""
from __future__ import annotations

import contextlib
import os
import threading

import torch

_local = threading.local()
ENABLED = os.environ.get("SIMLLM_CORES", "").lower() != "torch"


def kernel_threads() -> int:
    """The worker count our kernels use in the calling thread: torch's count, or, inside `kernels_own_cores`,
    the count torch had before it was set to one."""
    n = getattr(_local, "n", None)
    return torch.get_num_threads() if n is None else n


def hands_over(active: bool = True) -> bool:
    """Whether `kernels_own_cores(active)` changes anything in this thread: on, for kernels that do the work
    (`active`), with more than one thread to give."""
    return active and ENABLED and torch.get_num_threads() > 1


@contextlib.contextmanager
def kernels_own_cores(active: bool = True):
    """While inside: torch runs one thread and our kernels get the cores it had. A no-op where `hands_over` says
    no (the runner's products are torch's, it is off, one thread anyway), and when nested."""
    if not hands_over(active) or getattr(_local, "n", None) is not None:
        yield
        return
    n = torch.get_num_threads()
    _local.n = n
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
        _local.n = None


@contextlib.contextmanager
def kernels_alone():
    """While inside: our kernels compute in the calling thread alone, leaving the other cores to work another
    thread does meanwhile (the engine's early pass while the fingerprinter's threads compute a fingerprint)."""
    before = getattr(_local, "n", None)
    _local.n = 1
    try:
        yield
    finally:
        _local.n = before


def own_count(n: int):
    """A thread initializer: this thread runs torch with n threads, whatever the model's thread set meanwhile."""
    def init() -> None:
        torch.get_num_threads()  # torch sets a thread up on its first use, from the count set last anywhere:
        torch.set_num_threads(max(1, n))  # after that, this thread's own count holds
    return init
