"""Who gets the cores while the model runs: our C kernels' workers, not torch's threads.

Where the runner's products and attention are our kernels (int4_kernel's AMX or int4_vector_kernel's products,
attention_kernel), a pass is C calls that split their work over worker threads, with some torch ops around them. At
torch's default thread count, torch's own worker threads then burn a core between and during our kernels' work.
So the thread that runs the model sets torch to one thread for the while (`kernels_own_cores`) and the kernels
use the count torch had (`kernel_threads`). Setting only OpenMP's per-thread count, or MKL's too, does not do it
(why torch's own setting does is not understood); torch.set_num_threads does, and it also
sets the count that threads use when they first run torch code, so threads that compute other things with
torch (the fingerprinter's) set their own count when they start (`own_count`). Threads change no bit of any
kernel's result (they split outputs, never a sum), so answers do not depend on this. `SIMLLM_CORES=torch`
(or `ENABLED = False`, for side-by-side runs) leaves torch its threads.
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


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity: a container's or taskset's share, not the machine's)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def _core_of(cpu: int, sysfs: str) -> str | None:
    try:
        with open(f"{sysfs}/cpu{cpu}/topology/core_id") as f:
            core = f.read().strip()
        with open(f"{sysfs}/cpu{cpu}/topology/physical_package_id") as f:
            return f.read().strip() + "/" + core
    except OSError:
        return None


def by_core(cpus: list[int], sysfs: str = "/sys/devices/system/cpu") -> tuple[list[int], int]:
    """(`cpus` ordered one per physical core first, then the cores' second hardware threads; the physical cores).
    Decode is memory-bound, and a core's second thread adds no bandwidth. Where the topology cannot be read: as
    they are, each its own core."""
    first: list[int] = []
    rest: list[int] = []
    seen = set()
    for cpu in cpus:
        core = _core_of(cpu, sysfs)
        if core is None:
            return list(cpus), len(cpus)
        (rest if core in seen else first).append(cpu)
        seen.add(core)
    return first + rest, len(first)


def choose(requested: int, cpus: list[int] | None = None, sysfs: str = "/sys/devices/system/cpu") -> tuple[int, str]:
    """The thread count a model computes with, and why (for the load log). `requested` (compute_threads) 0: torch's
    count, which is OMP_NUM_THREADS where set, else one thread per physical core; from 1 up to the CPUs this
    process may use: that many. More than those is refused: threads beyond the cores only wait on each other."""
    cpus = usable_cpus() if cpus is None else cpus
    _, physical = by_core(cpus, sysfs)
    if requested < 0 or requested > len(cpus):
        raise ValueError(f"compute_threads {requested}: this process may run on {len(cpus)} CPU(s) "
                         f"({_ranges(cpus)}); set 1..{len(cpus)}, or 0 for one thread per physical core")
    where = f"{len(cpus)} CPUs this process may use ({_ranges(cpus)}), {physical} physical cores"
    if requested:
        return requested, f"compute_threads {requested}; {where}"
    n = torch.get_num_threads()
    if os.environ.get("OMP_NUM_THREADS"):
        why = f"torch's count, from OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
    elif n == physical:
        why = "one per physical core"
    else:
        why = "torch's count as set in this process"
    return n, f"compute_threads 0 (auto): {why}; {where}"


def _ranges(cpus: list[int]) -> str:
    """0-3,6 for [0, 1, 2, 3, 6]."""
    out, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            out.append(f"{start}-{c}" if c != start else f"{c}")
            start = None
    return ",".join(out)


def own_count(n: int):
    """A thread initializer: this thread runs torch with n threads, whatever the model's thread set meanwhile."""
    def init() -> None:
        torch.get_num_threads()  # torch sets a thread up on its first use, from the count set last anywhere:
        torch.set_num_threads(max(1, n))  # after that, this thread's own count holds
    return init
