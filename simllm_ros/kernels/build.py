"""Builds our C kernels (the .c files beside this module) with the system C compiler and keeps them by content.

Why here and nowhere else: the bits a kernel computes depend on its source, its headers, the compiler and the
flags, so one place decides all four and names the built library after them. A library is built once per
machine into ~/.cache/simllm_ros/kernels ($SIMLLM_KERNEL_DIR; a private temporary directory where that cannot
be written) and loaded with ctypes: no torch headers, no Python extension build, a few seconds at first use.

The numerics contract (README, "Numerics"): every kernel is compiled with -ffp-contract=off, so no `c + a*b`
becomes a fused multiply-add behind the code's back; where the arithmetic wants one it says so (intrinsics or
fmaf). The same source then rounds the same way on x86 (AVX2, AVX-512) and aarch64 (NEON), whatever the
compiler's contraction default. CONTRACT names this arithmetic; the model's numerics digest includes it.
"""
from __future__ import annotations

import atexit
import functools
import glob
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from typing import Callable, Generic, Sequence, TypeVar

from . import abi

SOURCE_DIR = os.path.dirname(os.path.abspath(__file__))
# What the kernels' arithmetic promises (module doc): a new value wherever a change gives other bits by design.
CONTRACT = "fma-explicit-1"
# -ffp-contract=off: the contract above. -std=gnu11: GCC's vector extensions and intrinsics.
# -Wno-psabi: GCC notes that 32-byte vectors pass differently without AVX; only static functions take them.
FLAGS = ("-O3", "-fPIC", "-shared", "-std=gnu11", "-ffp-contract=off", "-fno-math-errno", "-pthread",
         "-Wall", "-Wextra", "-Wno-psabi")
KERNELS = ("attention", "int4_amx", "int4_vector", "layers", "membw", "rmsnorm")
K = TypeVar("K")  # a wrapper's kernel class


def kernel_dir() -> str:
    """Where built kernels are kept: $SIMLLM_KERNEL_DIR, else ~/.cache/simllm_ros/kernels."""
    return os.environ.get("SIMLLM_KERNEL_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "simllm_ros",
                                                               "kernels")


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def source_path(name: str) -> str:
    path = os.path.join(SOURCE_DIR, f"{name}.c")
    if name not in KERNELS or not os.path.isfile(path):
        raise RuntimeError(f"no kernel source {name}.c in {SOURCE_DIR}")
    return path


def source_text(name: str) -> str:
    """The kernel's source and every header beside it: what its bits depend on, besides compiler and flags."""
    parts = [open(source_path(name), encoding="utf-8").read()]
    for header in sorted(glob.glob(os.path.join(SOURCE_DIR, "*.h"))):
        with open(header, encoding="utf-8") as f:
            parts.append(f"// {os.path.basename(header)}\n{f.read()}")
    return "\n".join(parts)


def command(name: str, cc: str, output: str, extra_flags: tuple[str, ...] = (), target_flags=("-march=native",)):
    """The compiler's command line for one kernel: the only place that knows flags."""
    return [cc, *FLAGS, *target_flags, *extra_flags, f"-I{SOURCE_DIR}", source_path(name), "-o", output, "-lm"]


@functools.lru_cache(maxsize=None)
def _compiler_version(cc: str) -> str:
    """`cc --version`, asked once a process (a model's load builds or finds ~6 kernels: a process each)."""
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def library_path(name: str, cc: str, extra_flags: tuple[str, ...] = (), tag: str = "") -> str:
    """Where build() keeps this kernel: its name carries the key of source, flags, compiler and machine. A library
    built elsewhere for this machine (scripts/aarch64_engine.py: a cross compiler of the same version) is used
    only when placed here under this name."""
    flags = " ".join(command(name, "cc", "out", extra_flags))
    key = hashlib.sha256("\0".join([source_text(name), flags, _compiler_version(cc), platform.machine(),
                                    platform.node()]).encode()).hexdigest()[:16]
    return os.path.join(kernel_dir(), f"{name}{'-' + tag if tag else ''}-{key}.so")


def build(name: str, cc: str | None = None, extra_flags: tuple[str, ...] = (), tag: str = "") -> str:
    """The shared library for this kernel, compiler, flags and machine: built once, atomically, then reused.
    `extra_flags` (tests): e.g. ("-mno-avx512f",) builds the portable C on an AVX-512 machine; `tag` names it."""
    cc = cc or compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) found")
    target = library_path(name, cc, extra_flags, tag)
    os.makedirs(kernel_dir(), exist_ok=True)
    if os.path.exists(target):
        return target
    with tempfile.TemporaryDirectory(dir=kernel_dir()) as tmp:
        lib = os.path.join(tmp, f"{name}.so")
        done = subprocess.run(command(name, cc, lib, extra_flags), capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{os.path.basename(cc)} failed: {done.stderr.strip()[-400:]}")
        os.replace(lib, target)  # atomic: another process building the same key gets a whole file either way
    return target


def build_anywhere(cc: str, name: str) -> str:
    """build(), and where the kernel dir cannot be written (a read-only home on a robot) the same in a private
    temporary directory, which later kernels of this process then use too, removed when the process ends (every
    start left one behind, and a node restarts many times; a loaded library stays mapped after its file goes)."""
    try:
        return build(name, cc)
    except OSError as e:
        try:
            private = tempfile.mkdtemp(prefix="simllm-kernels-")
            atexit.register(shutil.rmtree, private, ignore_errors=True)
            os.environ["SIMLLM_KERNEL_DIR"] = private
            return build(name, cc)
        except OSError as e2:
            raise OSError(f"{e}; then {e2}") from e2


def load_kernel(env: str, off: str, name: str, make: Callable[[str], K]) -> tuple[K | None, str | None]:
    """(make(path of the built library), None), or (None, why not): `env`=`off` asked for the torch path, there
    is no compiler, or the build failed."""
    if os.environ.get(env, "").lower() == off:
        return None, f"{env}={off}"
    cc = compiler()
    if cc is None:
        return None, "no C compiler (cc, gcc or clang) found"
    try:
        return make(build_anywhere(cc, name)), None
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
        return None, f"could not build the {name} kernel: {e}"


class Loader(Generic[K]):
    """One kernel per process, the same way for every wrapper: built on first use (load_kernel), then every
    check in order (a new CPU or compiler falls back, it does not answer wrongly); the first complaint is
    `why_not` and stands, so a refused kernel is not built or checked again. `then(kernel)` runs once on a kernel
    that passed (the product kernels lend attention their workers). `signatures` (name -> (argtypes, restype)):
    the wrapper's bindings, checked against the library's header before it is built (abi.check): a mismatch
    raises abi.AbiMismatch, a programming error, not a reason to fall back."""

    def __init__(self, env: str, off: str, name: str, make: Callable[[str], K],
                 checks: Sequence[Callable[[K], str | None]] = (), then: Callable[[K], None] | None = None,
                 signatures: abi.Signatures | None = None):
        self._args = (env, off, name, make)
        self._checks = checks
        self._then = then
        self._signatures = signatures
        self.kernel: K | None = None
        self.why_not: str | None = None

    def load(self) -> K | None:
        """The kernel, or None with `why_not` saying why."""
        if self.kernel is not None or self.why_not is not None:
            return self.kernel
        if self._signatures is not None:
            abi.check(self._args[2], self._signatures)
        kernel, self.why_not = load_kernel(*self._args)
        if kernel is None:
            return None
        for check in self._checks:
            self.why_not = check(kernel)
            if self.why_not:
                return None
        self.kernel = kernel
        if self._then is not None:
            self._then(kernel)
        return kernel
