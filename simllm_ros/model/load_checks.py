"""The load-time checks and their cache: whether single rows and any cut of a sequence into passes give the
same bits (the invariance probe), what a pass of m rows costs, and the numerics digest of this model, these
settings, kernels and CPU. Measured once and kept in the cache folder (LOAD_CHECKS_FILE) under a key naming
model content, settings, kernel builds, torch and CPU (the pass costs also the thread count); taken again only
where the digest still holds. A thread count's pass costs not kept yet are timed after the load, in the background.
LoadChecks is a part ModelBackend (model_backend.py) owns: it runs passes through the backend's `run` and
`new_cache` (ModelPasses) and reads the runner's single-row switch and the kernel paths.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import threading
import time
from collections.abc import Callable
from typing import Any, ContextManager, Protocol

import torch

from ..kernels import compute_threads, kernel_pool
from ..kernels.build import CONTRACT
from .cache_records import default_cache_dir, read_records, try_cache_write, update_record
from .kernel_paths import KernelPaths
from .llama_runner import LlamaRunner

LOAD_CHECKS_FILE = "load_checks.json"


def cpu_identity() -> str:
    """The CPU's model name and feature flags: what decides which kernel paths run."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f.read().splitlines() if ln.split(":")[0].strip() in ("model name", "flags",
                                                                                       "Features", "CPU part")]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


MAX_PASS_ROWS = 257  # a decode pass: the last token and a draft of up to 256 (max_draft_tokens' range)


class _Stopped(Exception):
    """time_pass_costs was asked to stop."""


def _costs_prior(data: dict, key: str, digest: str) -> list[float] | None:
    """The pass costs a load starts from at a thread count not timed yet: those kept for the nearest other thread
    count of this model and numerics (None: none kept). Costs steer how many rows a pass checks, never a token."""
    threads = torch.get_num_threads()
    timed = []
    for k, v in data.items():
        if k.startswith(f"{key}/threads=") and isinstance(v, dict) and v.get("digest") == digest and v.get("costs"):
            try:
                timed.append((abs(int(k.rsplit("=", 1)[1]) - threads), [float(c) for c in v["costs"]]))
            except ValueError:
                continue
    timed = [t for t in timed if len(t[1]) == MAX_PASS_ROWS + 1]
    return min(timed, key=lambda t: t[0])[1] if timed else None


class ModelPasses(Protocol):
    """What the checks run passes through (ModelBackend's run and new_cache)."""

    def run(self, ids: list[int], cache: Any, positions: list[int] | None = None, logits: str = "last"
            ) -> torch.Tensor | None: ...

    def new_cache(self, capacity: int = 256) -> Any: ...


class LoadChecks:
    """ModelBackend's load-time checks: passes through `passes`, on `runner` (None: transformers' forward, which
    gets the probe and digest only), token ids below `vocab`, the key naming `paths`' kernels; `progress` hears
    what runs."""

    def __init__(self, passes: ModelPasses, runner: LlamaRunner | None, vocab: int, paths: KernelPaths,
                 progress: Callable[[str], None]):
        self.passes = passes
        self.runner = runner
        self.vocab = vocab
        self.paths = paths
        self.progress = progress
        self.costs_pending: tuple[str, str] | None = None  # (store, key) where pass costs are still to be timed
        self.numerics = ""  # the digest the pass costs are kept under (set by the owner after measure)
        self.on_costs: Callable[[list[float]], None] = lambda costs: None  # told the costs timed after the load
        self._costs_thread: threading.Thread | None = None
        self._costs_stop = threading.Event()

    def _logits(self, ids: list[int], cache: Any, logits: str) -> torch.Tensor:
        out = self.passes.run(ids, cache, logits=logits)
        assert out is not None, logits
        return out

    def measure(self, cache_dir: str, stamp: dict | None, path: str, device: str, dtype_name: str) -> tuple:
        """(single rows, invariance probe, pass costs, numerics digest, pass costs still to time) for this model,
        these settings and kernels on this CPU. Measured once and kept in the cache folder under a key naming
        everything that decides them (model content, settings, kernel builds, torch, CPU model and flags); a later
        load takes them only where the numerics digest it computes again (one 16-token pass) is the one they were
        measured with: same kernels, same CPU, same bits. Otherwise measured again, on every CPU this process may use
        (`_measure_checks`). The pass costs are timings (by thread count) that steer draft lengths and batching and
        never a token: timed at a model's first load; a thread count not timed before starts from another's
        (`_costs_prior`) and is timed after the load, in the model's turns (`time_pass_costs`); the fifth value
        says where to keep them then (None: nothing left to time). `path`: the model's folder (what names it
        without a content `stamp`)."""
        if self.runner is None:
            return False, self.invariance_probe(), None, self.numerics_digest(), None
        runner, paths = self.runner, self.paths
        ident = json.dumps(stamp, sort_keys=True) if stamp else os.path.abspath(path)
        what = [ident, device, dtype_name, paths.weight_bits, paths.activation_bits, CONTRACT, paths.int4_path,
                paths.attention_path, paths.layers_path, paths.norm_path, torch.__version__, cpu_identity()]
        key = hashlib.sha256(json.dumps(what, default=str).encode()).hexdigest()[:24]
        costs_key = f"{key}/threads={torch.get_num_threads()}"
        store = os.path.join(cache_dir or default_cache_dir(), LOAD_CHECKS_FILE)
        data = read_records(store)
        kept, kept_costs = data.get(key), data.get(costs_key)
        bits = None
        if isinstance(kept, dict) and kept.get("digest"):
            runner.single_rows = bool(kept.get("single"))
            digest = self.numerics_digest()
            if digest == kept["digest"]:
                bits = bool(kept["single"]), bool(kept["exact"]), digest
        if bits is None:
            bits = self._measure_checks(runner)
            record = {"single": bits[0], "exact": bits[1], "digest": bits[2]}
            try_cache_write(lambda: update_record(store, key, record, keep=64), self.progress)
        elif isinstance(kept_costs, dict) and kept_costs.get("digest") == bits[2] and kept_costs.get("costs"):
            return bits[0], bits[1], [float(c) for c in kept_costs["costs"]], bits[2], None
        prior = _costs_prior(data, key, bits[2])
        if prior is not None:  # another thread count's: this one's timed after the load (time_pass_costs_later)
            return bits[0], bits[1], prior, bits[2], (store, costs_key)
        t0 = time.monotonic()  # none timed yet (a first load): timed now, as the engine's turns run passes
        self.progress(f"timing a pass's cost by its rows at {torch.get_num_threads()} threads (once per model; "
                      "another thread count is timed after its load)")
        with compute_threads.kernels_own_cores(self.paths.kernels_do_the_work):
            costs = runner.pass_costs(MAX_PASS_ROWS)
        self.progress(f"pass costs timed in {time.monotonic() - t0:.1f} s")
        try_cache_write(lambda: update_record(store, costs_key, {"digest": bits[2], "costs": costs}, keep=64),
                        self.progress)
        return bits[0], bits[1], costs, bits[2], None

    def _measure_checks(self, runner: LlamaRunner) -> tuple[bool, bool, str]:
        """(single rows, invariance probe, numerics digest), measured: the probe's ~60 passes on every CPU this
        process may use, the digest also at the thread count the model serves at. A kernel's bits do not depend on
        its thread count (the numerics contract: threads split outputs, never a sum), so a probe passed on more
        threads passed on fewer; the two digests, equal, show it for this model on this CPU, and where they are not
        the probe runs again at the serving count (and the serving count's digest is the one kept either way)."""
        t0 = time.monotonic()
        wide = max(torch.get_num_threads(), len(compute_threads.usable_cpus()))
        self.progress(f"load-time checks: single rows, the invariance probe and the numerics digest on {wide} "
                      f"thread{'s' if wide > 1 else ''} (once per model, settings, kernels and CPU; kept for later "
                      "loads)")
        with self._every_core(wide):
            single = runner.check_single_rows()
            exact = self.invariance_probe()  # the probe runs with single rows as decided
            wide_digest = self.numerics_digest()
        with compute_threads.kernels_own_cores(self.paths.kernels_do_the_work):
            digest = self.numerics_digest()
            if digest != wide_digest:  # bits that change with the thread count: the probe at the serving count
                self.progress(f"the numerics digest differs on {wide} threads ({wide_digest}) and "
                              f"{torch.get_num_threads()} ({digest}): the probe again at {torch.get_num_threads()}")
                single = runner.check_single_rows()
                exact = self.invariance_probe()
        verdict = "passed" if exact else "failed: no chunked prefill, drafts or answer memo"
        self.progress(f"load-time checks done in {time.monotonic() - t0:.1f} s: invariance probe {verdict}")
        return single, exact, digest

    @contextlib.contextmanager
    def _every_core(self, threads: int):
        """While inside: this thread's passes on `threads` of our kernels' workers (torch on one, as the engine's
        turns run them); the kept workers beyond the serving count are ended after (started again if asked for)."""
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            with compute_threads.kernels_own_cores(self.paths.kernels_do_the_work):
                yield
        finally:
            torch.set_num_threads(before)
            if threads > before:
                kernel_pool.stop_workers()

    def time_pass_costs(self, turn: Callable[[], ContextManager] = contextlib.nullcontext,
                        stop: threading.Event | None = None) -> bool:
        """Time the pass costs at this thread count where the load took a prior (LlamaRunner.pass_costs, each pass
        in a `turn` of the model: the engine's, so requests wait at most one pass), keep them in the cache folder and
        make them `pass_costs`; False where nothing was to time or `stop` was set first."""
        pending, runner = self.costs_pending, self.runner
        if pending is None or runner is None:
            return False

        @contextlib.contextmanager
        def checked_turn():
            with turn():
                if (stop is not None and stop.is_set()) or self.runner is None:
                    raise _Stopped
                yield

        t0 = time.monotonic()
        try:
            costs = runner.pass_costs(MAX_PASS_ROWS, turn=checked_turn)
        except _Stopped:
            return False
        store, costs_key = pending
        try_cache_write(lambda: update_record(store, costs_key, {"digest": self.numerics, "costs": costs}, keep=64),
                        self.progress)
        self.costs_pending = None
        self.on_costs(costs)  # the owner's new prior: the engine's PassCosts starts again from it
        self.progress(f"pass costs timed at {torch.get_num_threads()} threads in {time.monotonic() - t0:.1f} s "
                      "(after the load, in the model's turns; kept for later loads)")
        return True

    def time_pass_costs_later(self, turn: Callable[[], ContextManager]) -> None:
        """`time_pass_costs` in a thread of its own, started now (the node serves meanwhile, on the prior);
        `stop_timing` ends it."""
        if self.costs_pending is None or self._costs_thread is not None:
            return
        self._costs_stop = threading.Event()
        self._costs_thread = threading.Thread(target=self.time_pass_costs, args=(turn, self._costs_stop),
                                              name="simllm-pass-costs", daemon=True)
        self._costs_thread.start()

    def stop_soon(self) -> None:
        """`time_pass_costs_later`'s thread stops before its next pass (not waited for: stop_timing joins it)."""
        self._costs_stop.set()

    def stop_timing(self) -> None:
        """End `time_pass_costs_later`'s thread (it stops before its next pass); call it outside the model's turn."""
        thread, self._costs_thread = self._costs_thread, None
        if thread is not None:
            self._costs_stop.set()
            thread.join()

    def invariance_probe(self) -> bool:
        """Whether a token's logits and KV are bitwise the same however the sequence is cut into passes.

        This is what makes exact-prefix reuse and draft verification lossless (see llama_runner). Checked
        on this machine, at load (once per model and settings in a process), on a 48-token probe cut four
        ways (whole, 17+1+12+18, ...), last-token logits after three prefixes, and a 24-token probe cut after
        each of its first 16 tokens."""
        if self.runner is None:
            return False
        ids = [int(t) % max(self.vocab, 1) for t in range(101, 101 + 48 * 97, 97)]
        whole = self.passes.new_cache(52)
        ref = self._logits(ids, whole, "all")
        for cuts in ((17, 18, 30), (1, 2, 3, 47), (24,), (40, 41, 42, 43, 44, 45, 46, 47)):
            cache = self.passes.new_cache(52)
            outs, s = [], 0
            for c in list(cuts) + [len(ids)]:
                outs.append(self._logits(ids[s:c], cache, "all"))
                s = c
            if not torch.equal(torch.cat(outs), ref) or not torch.equal(cache.k[:, :, :48], whole.k[:, :, :48]) \
                    or not torch.equal(cache.v[:, :, :48], whole.v[:, :, :48]):
                return False
        # A prefill's last-token logits (what the first answer token is picked from) take the same path.
        for n in (47, 30, 1):  # the last n tokens in one pass, after the others in another
            cache = self.passes.new_cache(52)
            self.passes.run(ids[:48 - n], cache, logits="none")
            if not torch.equal(self._logits(ids[48 - n:], cache, "last"), ref[-1]):
                return False
        # Every cut of a short sequence after 1..16 tokens: kernels switch paths at small row and key counts.
        # (A float32 attention passed every check above, yet changed the last logits after 11-15 of 24
        # tokens here, and after a 2-token prefix of a real prompt.)
        short = ids[:24]
        last = self._logits(short, self.passes.new_cache(28), "last")
        for p in range(1, 17):
            cache = self.passes.new_cache(28)
            self.passes.run(short[:p], cache, logits="none")
            if not torch.equal(self._logits(short[p:], cache, "last"), last):
                return False
        return True

    def numerics_digest(self) -> str:
        """A digest of the logits this process computes for a fixed 16-token sequence: the arithmetic of this
        model, these settings, these kernels and this CPU. The same model gives other bits elsewhere (measured:
        the same 4-bit model with oneDNN allowed AMX changed it; the thread count did not), and KV cached by
        one arithmetic is not what another computes: a pool snapshot carries the digest, and a process whose
        digest differs does not load it (persistence), so a lossless hit never serves another machine's KV. The
        kernels' numerics contract (kernels/build.py CONTRACT) is hashed in: two machines with one digest run one
        contract, and may share KV losslessly."""
        ids = [int(t) % max(self.vocab, 1) for t in range(211, 211 + 16 * 89, 89)]
        logits = self._logits(ids, self.passes.new_cache(len(ids) + 2), "all")
        data = CONTRACT.encode() + b"\0" + logits.detach().float().cpu().contiguous().numpy().tobytes()
        return hashlib.sha256(data).hexdigest()[:16]
