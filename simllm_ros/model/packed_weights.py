"""A GGUF's projections as the vector kernel reads them (its packed blobs), written once beside the converted model
and memory-mapped at later loads.

Why: packing decodes every K-quant block in numpy and lays the codes out for the kernel: most of a 1.5B model's load
(benchmark/results/load_times.md), and a transient second copy of the codes that set the load's peak memory. Mapped
from a file, the blobs are read in no time and live in the page cache, as llama.cpp's memory-mapped GGUF does: shared
between processes on one robot and evictable under pressure. The blobs are the bytes the kernel would have packed (the
packing code and the kernel's source name the file's layout: change either and the file is written again), and the
file is bound to its GGUF by the same content stamp as the converted copy; each blob's CRC-32 is checked at load, so a
damaged file is packed again rather than run. The format is safetensors (a JSON header, raw bytes), read here without
copying: nothing in it is executed.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from safetensors.torch import save_file

from ..kernels import compute_threads, vector_blobs
from ..mapped_safetensors import MappedSafetensors

PACKED_FILE = "simllm_packed.safetensors"
PROGRESS_S = 5.0  # at most one progress line this often while packing
PACK_THREADS = 4  # parts packed at once at most: each holds its decoded codes meanwhile (~0.2 GB for a 3B MLP)

Parts = list[tuple[str, torch.Tensor, int]]  # (kind, blob, outputs), as runner_weights.file_parts returns


def layout_id() -> str:
    """What the blobs' layout depends on: the packing module's code (kernels/vector_blobs.py) and the kernel's C
    sources that read them (not the rest of the kernel's Python: a comment there must not repack every model)."""
    h = hashlib.sha256()
    here = os.path.dirname(os.path.abspath(vector_blobs.__file__))
    for source in ("vector_blobs.py", "int4_vector.c", "int8_rows.h", "int8_rows32.h"):
        with open(os.path.join(here, source), "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def _threads(jobs: int, most: int | None = None) -> int:
    """Threads for `jobs` independent jobs: one a CPU this process may use, at most `most`, at least one."""
    return max(1, min(jobs, len(compute_threads.usable_cpus()), most or jobs))


class PackedStore:
    """The packed parts of one GGUF's projections by key ("3.qkv", "head", ...): those found in the file are
    memory-mapped; the others are built and kept, and `save` writes the whole set once."""

    def __init__(self, folder: str, stamp: dict, int8_rows: bool = False, progress: Callable[[str], None] | None = None,
                 expected: int = 0):
        """progress: told how packing goes (every PROGRESS_S at most) where `expected` parts are to be packed."""
        self.path = os.path.join(folder, PACKED_FILE)
        self.progress, self.expected = progress, expected
        self._started = self._told = 0.0
        self.meta = {"stamp": json.dumps(stamp, sort_keys=True), "layout": layout_id(),
                     "rows": "int8" if int8_rows else "float32"}  # Q4_K's blob kind follows it
        self.mapped: dict[str, Parts] = {}
        self.built: dict[str, Parts] = {}
        self.why_not = ""  # why the file on disk was not used ("" where it was, or none was there)
        self._map: MappedSafetensors | None = None
        if os.path.isfile(self.path):
            try:
                self.mapped = self._open()
            except (OSError, ValueError, KeyError, TypeError) as e:
                self.mapped, self.why_not = {}, f"{PACKED_FILE} unreadable ({e}); packing again"

    def parts(self, key: str, build: Callable[[], Parts]) -> Parts:
        got = self.mapped.get(key) or self.built.get(key)
        if got is None:
            self._started = self._started or time.monotonic()
            got = self.built[key] = build()
            self._tell(time.monotonic())
        return got

    def build_all(self, builds: dict[str, Callable[[], Parts]]) -> None:
        """Packs every part of `builds` the file did not hold, on up to PACK_THREADS of this process's CPUs
        (numpy and torch let go of the GIL over whole tensors), so that `parts` finds them built."""
        missing = [(key, build) for key, build in builds.items() if key not in self.mapped and key not in self.built]
        if len(missing) < 2:
            return
        self._started = self._started or time.monotonic()
        lock = threading.Lock()

        def pack(job):
            key, build = job
            got = build()
            with lock:
                self.built[key] = got
                self._tell(time.monotonic())

        with ThreadPoolExecutor(_threads(len(missing), PACK_THREADS)) as pool:
            list(pool.map(pack, missing))

    def _tell(self, now: float) -> None:
        if self.progress is None or not self.expected:
            return
        done = len(self.built)
        if now - self._told >= PROGRESS_S or done == self.expected:
            self._told = now
            self.progress(f"packing the file's blocks for our kernel: {done}/{self.expected} parts "
                          f"({100 * done // self.expected}%), {now - self._started:.0f} s")

    @property
    def complete(self) -> bool:
        """Whether every part came from the file (nothing was packed at this load)."""
        return bool(self.mapped) and not self.built

    def save(self) -> bool:
        """Writes every part (mapped and built) atomically where anything was built; False if nothing was."""
        if not self.built:
            return False

        tensors, index = {}, {}
        for key, parts in {**self.mapped, **self.built}.items():
            index[key] = [[kind, n, zlib.crc32(blob.contiguous().view(torch.uint8).numpy())]
                          for kind, blob, n in parts]
            for i, (_, blob, _) in enumerate(parts):
                tensors[f"{key}/{i}"] = blob.contiguous()
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            save_file(tensors, tmp, metadata={**self.meta, "index": json.dumps(index)})
            os.replace(tmp, self.path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        return True

    def _open(self) -> dict[str, Parts]:
        """The file's parts as views of one private mapping (copy-on-write: pages stay the file's unless written,
        which nothing does); ValueError if it is another file's, another layout's, damaged, or does not add up."""
        mapped = MappedSafetensors(self.path)
        if any(mapped.meta.get(k) != v for k, v in self.meta.items()):
            raise ValueError("written for another file or kernel layout")
        index = json.loads(mapped.meta["index"])
        self._map = mapped
        names = [(f"{key}/{i}", crc) for key, kinds in index.items() for i, (_, _, crc) in enumerate(kinds)]
        # zlib lets go of the GIL over a large buffer: the blobs' CRCs on every CPU
        with ThreadPoolExecutor(_threads(len(names))) as crcs:
            damaged = [name for (name, crc), got in zip(names, crcs.map(lambda nc: zlib.crc32(mapped.raw(nc[0]).data),
                                                                      names)) if got != crc]
        if damaged:
            raise ValueError(f"tensor {damaged[0]} is damaged (CRC-32)")
        return {key: [(str(kind), mapped.tensor(f"{key}/{i}"), int(outputs))
                      for i, (kind, outputs, _) in enumerate(kinds)] for key, kinds in index.items()}
