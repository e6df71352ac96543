"""How a loaded engine starts warm: the pool snapshot (restore at load, save on demand and in checkpoints) and
warm-up requests (warmup_queries: a JSON Lines file, or the N most-used tasks of the semantic log and the fleet),
with the key ranges of a quantized pool calibrated on the warm-up prompts. WarmStart holds what this needs between
calls (whether warm-up runs now, the pool's mutations at the last save); the engine owns one.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch

from .. import path_checks
from ..cache import persistence, semantic_log as semantic_log_mod
from ..request import QueryRequest
from ..safe_io import read_regular
from ..cache.semantic_log import request_from_record, request_record
from ..request import QueryResult
from .engine_parts import EngineCore
from .thermal import ThermalLevel


def read_requests_jsonl(path: str) -> list[QueryRequest]:
    """Requests from JSON Lines ({prompt, context?, scope?, max_new_tokens?}); used for warm-up and replay."""
    out = []
    text = read_regular(path, path_checks.MAX_WARMUP_BYTES).decode("utf-8")  # never blocks on a FIFO
    for n, line in enumerate(text.split("\n"), 1):
        line = line.strip()
        if not line:
            continue
        try:
            d = json.loads(line)
            out.append(QueryRequest(prompt=str(d["prompt"]), context=str(d.get("context", "")),
                                    cache_scope=str(d.get("scope", d.get("cache_scope", ""))),
                                    max_new_tokens=int(d.get("max_new_tokens", 0)),
                                    allow_approximate=bool(d.get("allow_approximate", True)),
                                    request_id=str(d.get("request_id", f"{os.path.basename(path)}:{n}"))))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{n}: not a request ({e})") from None
    return out


class WarmStart:
    """Snapshot restore/save and warm-up; owned by engine.Engine, reading its load through `core` and asking the
    warm-up requests through `handle` (the engine's, as any request)."""

    def __init__(self, core: EngineCore, handle: Callable[[QueryRequest], QueryResult]):
        self.core = core
        self._handle = handle
        self.warming = False  # requests now are warm-up: the semantic log marks them so they do not count
        self._saved_mutations = -1  # the pool's mutations at the last save or restore

    def identity(self) -> dict:
        """What a snapshot must match to be loaded: the pool's layout, the model, the embedder, the numerics."""
        core = self.core
        backend = core.loaded_backend()
        return persistence.identity(core.loaded_pool(), backend.identity, core.settings.embedder, backend.numerics)

    def warm_up(self, spec: str, progress, restored: int = 0) -> int:
        """warmup_queries: a JSON Lines file of requests, or an integer N: the N most-used tasks of the
        semantic log that the snapshot did not already bring back (`restored`: the tasks it did)."""
        self.warming = True
        try:
            if spec.strip().isdigit():
                return self._warm_up_most_used(int(spec), progress, restored)
            return self._warm_up_file(spec, progress)
        finally:
            self.warming = False

    def _warm_up_most_used(self, n: int, progress, restored: int) -> int:
        s, fleet = self.core.settings, self.core.fleet
        pool, backend = self.core.loaded_pool(), self.core.loaded_backend()
        if not s.semantic_log_path and fleet is None:
            progress(f"warm-up: the {n} most-used tasks need the semantic log (semantic_log_path is empty) or a "
                     f"fleet store; only the {restored} tasks restored from the snapshot are warm")
            return 0
        tasks = semantic_log_mod.most_used(s.semantic_log_path, n) if s.semantic_log_path else []
        if fleet is not None and len(tasks) < n:  # then what the fleet asks most
            seen = {json.dumps(request_record(r), sort_keys=True) for r in tasks}
            for rec in fleet.most_asked(n):
                try:
                    r = request_from_record(rec, f"warmup:fleet:{len(tasks) + 1}")
                except (ValueError, TypeError, KeyError):
                    continue
                if json.dumps(request_record(r), sort_keys=True) not in seen and len(tasks) < n:
                    seen.add(json.dumps(request_record(r), sort_keys=True))
                    tasks.append(r)
        todo = [r for r in tasks if pool.find(r.scope, backend.chat_ids(s.system_prompt, r.context, r.turns())) is None]
        source = " and ".join(x for x in (s.semantic_log_path, "the fleet store" if fleet else "") if x)
        progress(f"warm-up: the {len(tasks)} most-used tasks of {source} ({n} asked): "
                 f"{len(tasks) - len(todo)} already in the pool from the snapshot, computing {len(todo)}")
        return self._run_warm_up(todo, progress)

    def _warm_up_file(self, path: str, progress) -> int:
        reqs = read_requests_jsonl(path)
        progress(f"warm-up: {len(reqs)} requests from {path}")
        s, backend = self.core.settings, self.core.loaded_backend()
        calibrate = s.enable_quant_calibration and self.core.loaded_pool().quantized
        if calibrate:
            self._calibrate([backend.prompt_ids(s.system_prompt, r.context, r.prompt) for r in reqs])
        return self._run_warm_up(reqs, progress)

    def _run_warm_up(self, reqs: list[QueryRequest], progress) -> int:
        done = 0
        for r in reqs:
            if self.core.thermal_level >= ThermalLevel.WARN:
                progress("warm-up stopped early: running hot")
                break
            res = self._handle(r)
            if not res.success:
                self.core.log.warning(f"warm-up request {r.request_id} failed: {res.error}")
            done += res.success
        return done

    @torch.inference_mode()
    def _calibrate(self, prompts: list[list[int]]) -> None:
        """Fix per-channel key ranges from the warm-up prompts (enable_quant_calibration)."""
        lo = hi = None
        backend = self.core.loaded_backend()
        for ids in prompts:
            _, cache = backend.prefill(ids)
            k, _ = backend.cache_tensors(cache)
            kl, kh = k.float().amin(dim=2, keepdim=True), k.float().amax(dim=2, keepdim=True)
            lo = kl if lo is None else torch.minimum(lo, kl)
            hi = kh if hi is None else torch.maximum(hi, kh)
        if lo is not None:
            self.core.loaded_pool().set_key_calibration(lo, hi)

    def restore(self, progress: Callable[[str], None] | None = None) -> tuple[int, str]:
        """Load the snapshot in persist_path into the (empty) pool; never raises. Returns (the tasks restored, the
        load report's word on the snapshot: "loaded" or why not). A bad snapshot is logged with its path and the
        reason, and the pool stays empty."""
        core = self.core
        pool, folder, log = core.loaded_pool(), core.settings.persist_path, core.log
        try:
            n = persistence.load(pool, folder, self.identity())
            snapshot = "loaded"
            (progress or log.info)(f"restored {n} cached tasks from {folder}")
        except Exception as e:  # SnapshotSkipped, or anything unforeseen: a snapshot never stops a start
            n = 0
            pool.clear()
            snapshot = str(e) if isinstance(e, persistence.SnapshotSkipped) else \
                f"snapshot in {folder} not loaded: {type(e).__name__}: {e}"
            log.warning(f"pool snapshot skipped: {snapshot}")
        self._saved_mutations = pool.mutations  # what was just loaded needs no checkpoint
        try:
            labels = core.error_bound.load(folder, core.loaded_backend().numerics)
            if labels:
                (progress or log.info)(f"restored {labels} error-bound labels from {folder}")
        except Exception as e:  # damaged, foreign, too large: no labels (lossless until relearnt)
            log.warning(f"error-bound labels not loaded: {e if isinstance(e, ValueError) else repr(e)}")
        return n, snapshot

    def save(self, only_if_changed: bool = False) -> str | None:
        """Write the pool to persist_path (atomic). Does not wait for a running generation: the pool lock
        is held only while the tensors are copied. only_if_changed: skip when nothing changed since the
        last save or restore (background checkpoints)."""
        core = self.core
        pool, backend, s, bound = core.pool, core.backend, core.settings, core.error_bound
        if pool is None or backend is None or not s.persist_path:
            return None
        mutations = pool.mutations
        if only_if_changed and mutations == self._saved_mutations and not bound.changes:
            return None
        ident = persistence.identity(pool, backend.identity, s.embedder, backend.numerics)
        path = persistence.save(pool, s.persist_path, ident)
        if len(bound):
            bound.save(s.persist_path, backend.numerics)
        self._saved_mutations = mutations
        return path
