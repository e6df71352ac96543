"""The request pipeline: request -> fingerprint -> match -> plan reuse -> run model -> update pool -> respond.

Two phases so the ROS node can overlap them in different callback groups:
`prepare()` (validate, start the fingerprint; thread-safe, no model) and then either
`execute()` (plan reuse, run the model, update the pool; one request alone) or,
for several requests in flight together (continuous batching, max_batch > 1),
`begin()` (plan, set up the prefill) followed by `step()` calls that advance
every flight in one forward pass (prefill chunks and decode steps) until each
finishes with its result. A request's own fault never raises: it comes back as
success=False with an error, and fails only that request.

The engine, Engine, owns its parts, each an object with its own state that reads the engine's current load and
settings through one typed interface (engine_parts.EngineCore) and calls the others only through their public
methods:
- engine.py (here): its state, loading (load, fork, the fleet connection), settings and thermal level, the public
  request API (prepare, handle, execute, begin, step: each in the model's turn, with its energy span and
  statistics), idle work and telemetry;
- load_steps.py: the steps of a load that stand on their own (cores, opening and reporting the model, priming, the
  fleet store's connection), each handing back what it made;
- engine_parts.py: the records the parts hand one another (Prepared, Flight) and EngineCore;
- request_pipeline.py: RequestPipeline, one request's phases (plan, prefill, start decoding, conclude);
- request_memory.py: RequestMemory, what a finished request leaves for later ones (pool update, fleet share, drafts);
- batching.py: Batcher, continuous batching (begin, step) over the pipeline's phases;
- warm_start.py: WarmStart, snapshot restore/save and warm-up.
"""
from __future__ import annotations

import collections
import contextlib
import gc
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from . import approx_gate, load_steps
from ..kernels import compute_threads, kernel_pool
from .. import path_checks
from ..cache.answer_memo import AnswerMemo
from .batching import Batcher
from ..cache.cache_stats import CacheStatsRecorder
from ..model.pass_costs import PassCosts
from ..cache.error_bound import ErrorBound
from .energy import EnergyMeter, EnergyTally
from ..cache.fleet_store import FleetStore
from ..cache.fingerprint import Fingerprinter
from ..cache.kv_pool import KVPool, PrefixHit
from ..model.model_backend import ModelBackend
from ..model.model_files import ModelLoadError
from ..model.model_files import release_heap
from ..request import CANCELLED_ERROR, Progress, QueryRequest, QueryResult
from .engine_parts import EngineNotLoaded, Flight, Prepared, fault_result
from .request_memory import PendingInsert, RequestMemory
from .request_pipeline import Observation, RequestPipeline, prefill_exact
# Re-exported: what `from simllm_ros.serving.engine import ...` has always given.
from ..cache.semantic_log import SemanticLog
from ..settings import SPECS, SettingError, Settings, parse_size
from ..model.structured_output import SchemaError
from .thermal import ThermalLevel
from ..validation import check_text_field, is_invisible_only, normalize_text, validate_request
from .warm_start import WarmStart

RELOAD_PARAMS = {s.name for s in SPECS if not s.live}
# What a fork may set for itself: its own fleet connection, its own snapshot folder (restore() is the caller's) and
# its own energy meter.
FORK_OWN_PARAMS = {s.name for s in SPECS if s.name.startswith(("fleet_", "energy_"))} | {"persist_path"}


class EngineLoadError(RuntimeError):
    pass


EMBED_MAX_TEXTS = 256  # texts per ~/embed call


class Engine:
    """The model, the embedder and the KV pool, and every request's way through them. It owns its parts: the
    pipeline (request_pipeline.RequestPipeline), what finished requests leave (request_memory.RequestMemory) and
    the batcher (batching.Batcher) and the warm start (warm_start.WarmStart), which read its state through
    engine_parts.EngineCore. The state they read is set up here, in __init__ and load()."""

    def __init__(self, settings: Settings, log: logging.Logger | None = None):
        self.settings = settings
        self.log = log or logging.getLogger("simllm_ros.engine")
        self.backend: ModelBackend | None = None
        self.fingerprinter: Fingerprinter | None = None
        self.pool: KVPool | None = None
        self.semantic_log: SemanticLog | None = None
        self.recorder = CacheStatsRecorder(window=100)
        self.thermal_level = ThermalLevel.OK
        self._exec_lock = threading.Lock()
        self._token_bytes = 0  # longest vocabulary entry in UTF-8 bytes (an upper bound), set at load
        self.load_report: dict = {}
        self.kv_bits = 0
        self.memo = AnswerMemo()  # finished answers of identical requests (answer_memo)
        self._pass_costs: PassCosts | None = None  # the backend's pass costs, learnt from this engine's passes
        self._owns_models = True  # False for a fork(): the backend belongs to another engine
        self._pinned: list[int] = []  # the CPUs the compute workers keep to (compute_pinning), the caller's first
        self.fleet: FleetStore | None = None  # the shared fleet store (fleet_store_url), None when off
        # How often approximate answers differ from the model's own (approx_error_bound), and the idle-time
        # checks that teach it (approx_gate).
        self.error_bound = ErrorBound()
        self.audits: collections.deque[approx_gate.Audit] = collections.deque(maxlen=approx_gate.AUDITS_MAX)
        self._prefill_s_per_token = 0.0  # measured at load with a fleet store: the fetch-or-prefill estimate
        # Joules per answer (energy.py): the meter opens at load; the tally keeps the means per tier and the savings.
        self.energy = EnergyMeter(None, "the engine is not loaded")
        self.energy_tally = EnergyTally(window=100)
        # The parts (module docstring), each reading this engine's current state through EngineCore.
        self.memory = RequestMemory(self)
        self.pipeline = RequestPipeline(self, self.memory, self.memo, self.audits)
        self.batcher = Batcher(self, self.pipeline)
        self.warm_start = WarmStart(self, self.handle)

    # ---- what the parts read (engine_parts.EngineCore) and the parts' figures ------------------------------------
    @property
    def warming(self) -> bool:
        return self.warm_start.warming

    @property
    def prefill_s_per_token(self) -> float:
        return self._prefill_s_per_token

    def loaded_backend(self) -> ModelBackend:
        if self.backend is None:
            raise EngineNotLoaded("engine is not loaded")
        return self.backend

    def loaded_pool(self) -> KVPool:
        if self.pool is None:
            raise EngineNotLoaded("engine is not loaded")
        return self.pool

    @property
    def pending_inserts(self) -> collections.deque[PendingInsert]:
        """Prompts served by SEMANTIC reuse, waiting for an exact prefill at idle time (request_memory)."""
        return self.memory.pending_inserts

    @property
    def early_starts(self) -> int:
        """Early passes run while a fingerprint was computed (request_pipeline._early_start)."""
        return self.pipeline.early_starts

    @property
    def early_starts_used(self) -> int:
        """Early passes a SEMANTIC plan then used."""
        return self.pipeline.early_starts_used

    @property
    def observer(self) -> Callable[[Observation], None] | None:
        """Called with an Observation after every executed request (the benchmark's hook); None: nobody."""
        return self.pipeline.observer

    @observer.setter
    def observer(self, fn: Callable[[Observation], None] | None) -> None:
        self.pipeline.observer = fn

    # ---- lifecycle -------------------------------------------------------------
    @property
    def loaded(self) -> bool:
        return self.backend is not None

    @contextlib.contextmanager
    def _model_turn(self):
        """The model's turn: one caller at a time, and while it runs, the cores go to our kernels' workers rather
        than to torch's threads where the kernels do the work (compute_threads)."""
        with self._exec_lock:
            backend = self.backend
            with compute_threads.kernels_own_cores(backend is not None and backend.kernels_do_the_work):
                yield

    def pass_costs(self) -> PassCosts | None:
        """What a pass of m rows costs against one (draft lengths follow it): the backend's, timed at load, as the
        prior, then learnt from the decode passes this engine times (observe_pass). None where not measured."""
        prior = self.backend.pass_costs if self.backend is not None else None
        if prior is None:
            return None
        if self._pass_costs is None or self._pass_costs.prior is not prior:
            self._pass_costs = PassCosts(prior)
        return self._pass_costs

    def observe_pass(self, rows: int, seconds: float) -> None:
        """A decode pass of `rows` rows took `seconds` (a request's step, or a batch of decoding requests)."""
        costs = self.pass_costs()
        if costs is not None:
            costs.observe(rows, seconds)

    def load(self, progress: Callable[[str], None] | None = None) -> None:
        progress = progress or (lambda m: self.log.info(m))
        s = self.settings
        try:
            t0 = time.monotonic()
            path_checks.check_all(s, create=True)  # before the model: a path that cannot work fails now
            self._pinned = load_steps.arrange_cores(s, progress)
            progress(f"loading model {s.model} ({s.dtype}, {s.device})")
            self.backend = backend = load_steps.open_backend(s, progress)
            load_steps.report_backend(backend, progress)
            kernel_pool.pin_workers(self._pinned)
            self._token_bytes = load_steps.max_token_bytes(backend.tokenizer)
            progress(f"loading embedder {s.embedder}")
            self.fingerprinter = fingerprinter = Fingerprinter(s.embedder, backend.device)
            budget = parse_size(s.cache_size, load_steps.device_memory_bytes(backend.device))
            self.kv_bits = s.kv_bits or (32 if backend.dtype == torch.float32 else 16)
            self.pool = KVPool(backend.kv_shape, block_tokens=s.block_tokens, budget_bytes=budget,
                               kv_bits=self.kv_bits, model_dtype=backend.dtype,
                               fingerprint_dim=fingerprinter.dim, device=backend.device)
            self._apply_pool_knobs()
            load_steps.prime(backend, fingerprinter, s.system_prompt)
            self._open_energy(progress)
            self._open_fleet(progress)
            if s.semantic_log_path:
                self.semantic_log = SemanticLog(s.semantic_log_path)
            self.load_report = {"load_s": 0.0, "restored": 0, "snapshot": "", "warmup": 0}
            if s.persist_path:
                self.restore(progress)
            if s.warmup_queries:
                self.load_report["warmup"] = self.warm_start.warm_up(s.warmup_queries, progress,
                                                                     self.load_report.get("restored", 0))
            # What is loaded now lives as long as the engine: out of the cyclic collector's sight, a full collection
            # no longer walks it (a pause at a random decode step: docs/gguf.md), only what requests create.
            gc.collect()
            gc.freeze()
            self.load_report["load_s"] = time.monotonic() - t0
            backend.time_pass_costs_later(self._model_turn)  # where the load took a prior: timed now, in turns
            if not backend.semantic_supported:
                self.log.warning(f"model type '{backend.model_type}' is not supported by SEMANTIC reuse: "
                                 "only exact-prefix and answer reuse will be used")
        except Exception as e:  # configure must fail cleanly, whatever broke, and leave nothing half-loaded
            self.unload()
            msg = str(e) if isinstance(e, (ModelLoadError, SettingError, EngineLoadError)) \
                else f"{type(e).__name__}: {e}"
            raise EngineLoadError(msg) from e

    def fork(self, settings: Settings | None = None) -> "Engine":
        """A second engine on this one's loaded model and embedder, with its own empty pool, statistics and
        (live) settings: for side-by-side runs in one process, one request at a time. Unloading a fork
        leaves the shared models loaded."""
        settings = settings or self.settings
        reload = sorted(self.settings.changed_from(settings) & RELOAD_PARAMS - FORK_OWN_PARAMS)
        if reload:
            raise SettingError(f"a fork shares the loaded model: {', '.join(reload)} cannot differ")
        other = Engine(settings, log=self.log)
        other.backend, other.fingerprinter, other.kv_bits = self.backend, self.fingerprinter, self.kv_bits
        other._token_bytes = self._token_bytes
        other.pool = self.loaded_pool().empty_like()
        other._apply_pool_knobs()
        other._owns_models = False
        other._prefill_s_per_token = self._prefill_s_per_token
        other._open_energy(lambda m: other.log.info(m))
        other._open_fleet(lambda m: other.log.info(m))
        return other

    def _open_energy(self, progress) -> None:
        """The power source answers' energy is measured with (energy_source); none found is not an error: answers
        then say why they have no figure."""
        s = self.settings
        self.energy = EnergyMeter.open(s.energy_source, s.energy_sysfs_root, s.energy_rails,
                                       s.energy_sample_period_s)
        self.energy.start()
        progress(f"energy per answer: {self.energy.description}")

    def _open_fleet(self, progress) -> None:
        """Connect to the fleet store (fleet_store_url) if one is set (load_steps.open_fleet)."""
        s = self.settings
        if not s.fleet_store_url:
            return
        backend = self.loaded_backend()
        self._prefill_s_per_token = self._prefill_s_per_token or load_steps.prefill_seconds_per_token(backend)
        self.fleet = load_steps.open_fleet(s, backend, self.loaded_pool(), self.lossless_reuse, self.log)
        load_steps.report_fleet(self.fleet, s, self.lossless_reuse, self._prefill_s_per_token, self.log, progress)

    def unload(self) -> None:
        self.energy.stop()
        self.energy = EnergyMeter(None, "the engine is not loaded")
        if self.backend is not None and self._owns_models:
            self.backend.stop_timing()  # before the model's turn, which its pass-cost timing waits for
        with self._exec_lock:
            if self.fleet is not None:
                self.fleet.close()
                self.fleet = None
            owned = self.backend if self._owns_models else None  # the models to release: ours, where loaded
            if owned is not None:
                owned.release()
                if self.fingerprinter is not None:
                    self.fingerprinter.close()
                gc.unfreeze()  # what the load froze can be collected again (another engine's next load refreezes)
            self.backend = None
            self.fingerprinter = None
            self.pool = None
            self.memory.pending_inserts.clear()
            if self.semantic_log is not None:
                self.semantic_log.close()
                self.semantic_log = None
            if owned is not None:
                kernel_pool.stop_workers()  # no thread of ours outlives the model (the next load starts them)
                # the model's and the pool's freed heap handed back to the system: without it a cleaned-up node kept
                # much of it resident (glibc keeps freed pages) until its next load reused them
                release_heap()

    # ---- the snapshot (warm_start) ------------------------------------------------
    def restore(self, progress: Callable[[str], None] | None = None) -> int:
        """Load the snapshot in persist_path into the (empty) pool (warm_start.WarmStart.restore); never raises.
        Returns the tasks restored; the load report says what became of the snapshot."""
        n, snapshot = self.warm_start.restore(progress)
        self.load_report.update(restored=n, snapshot=snapshot)
        return n

    def save(self, only_if_changed: bool = False) -> str | None:
        """Write the pool to persist_path (atomic; warm_start.WarmStart.save); None where nothing was written."""
        return self.warm_start.save(only_if_changed)

    # ---- settings / thermal ------------------------------------------------
    def update_settings(self, settings: Settings) -> None:
        """Take new settings (valid by construction); while loaded only live parameters may differ."""
        reload = sorted(self.settings.changed_from(settings) & RELOAD_PARAMS)
        if reload and self.loaded:
            raise SettingError(f"{', '.join(reload)} need a reload: deactivate and clean up first")
        self.settings = settings
        if self.pool is not None:
            self._apply_pool_knobs()

    def apply_settings(self, changes: dict) -> None:
        """update_settings with some values changed; raises SettingError with a reason."""
        self.update_settings(self.settings.replace(**changes))

    def _apply_pool_knobs(self) -> None:
        s = self.settings
        self.loaded_pool().set_eviction_policy(lfu_weight=s.lfu_weight, diversity_weight=s.diversity_weight,
                                               half_life_s=s.recency_half_life_s)

    def clear_pool(self) -> None:
        """Forget every cached task, every deferred exact prefill and the recent answers kept as drafts."""
        with self._exec_lock:
            self.memory.clear()
            self.audits.clear()
            self.memo.clear()
            if self.pool is not None:
                self.pool.clear()

    def set_thermal_level(self, level: ThermalLevel) -> None:
        self.thermal_level = ThermalLevel(level)

    def record_rejected_busy(self) -> None:
        self.recorder.record_rejected_busy()

    # ---- the pipeline ------------------------------------------------------------
    def prepare(self, req: QueryRequest) -> Prepared | QueryResult:
        return self.prepare_batch([req])[0]

    def prepare_batch(self, reqs: list[QueryRequest]) -> list[Prepared | QueryResult]:
        t0 = time.perf_counter()
        s, backend, fingerprinter = self.settings, self.backend, self.fingerprinter
        out: dict[int, Prepared | QueryResult] = {}
        todo = []
        for i, r in enumerate(reqs):
            err = validate_request(r, max_scope_length=s.max_scope_length, max_new_tokens_limit=s.max_new_tokens_limit,
                                   max_chars=self.max_prompt_chars())
            if err is None and (backend is None or fingerprinter is None):
                err = "engine is not loaded"
            schema = None
            if err is None and r.json_schema and backend is not None:
                try:
                    wrap = None if r.tool_template is None else r.tool_template.frame
                    schema = backend.grammars.compile(r.json_schema, s.schema_compile_timeout_s, wrap)
                except SchemaError as e:
                    err = str(e)
            if err is not None:
                self.recorder.record_error()
                out[i] = QueryResult.failure(err, r.request_id)
            else:
                todo.append((i, schema))
        if todo and fingerprinter is not None:
            fps = fingerprinter.embed_async([reqs[i].question for i, _ in todo])
            for j, (i, schema) in enumerate(todo):
                out[i] = Prepared(reqs[i], fps, normalize_text(reqs[i].question), t0, schema, row=j)
        return [out[i] for i in range(len(reqs))]

    def embed(self, texts: list[str]) -> np.ndarray:
        """Unit vectors [len(texts), dim] from the loaded embedder (the ~/embed service); raises ValueError with
        the reason for bad input. Texts longer than the embedder reads are refused, never truncated."""
        fp = self.fingerprinter
        if fp is None:
            raise ValueError("engine is not loaded")
        if not texts:
            raise ValueError(f"texts is empty; give 1 to {EMBED_MAX_TEXTS} texts")
        if len(texts) > EMBED_MAX_TEXTS:
            raise ValueError(f"{len(texts)} texts; at most {EMBED_MAX_TEXTS} per call")
        for i, text in enumerate(texts):
            err = check_text_field(f"texts[{i}]", text)
            if err:
                raise ValueError(err)
            if is_invisible_only(text):
                raise ValueError(f"texts[{i}] is empty (only whitespace or invisible characters)")
            n = fp.count_tokens(text)
            if n > fp.max_tokens:
                raise ValueError(f"texts[{i}] is {n} tokens; the embedder reads at most {fp.max_tokens} "
                                 "(nothing is truncated)")
        return fp.embed_async(texts).result()  # on the fingerprinter's threads, which keep their torch threads

    def max_prompt_chars(self) -> int | None:
        """No prompt + context longer than this (characters) fits in max_prompt_tokens: each token stands for
        at most _token_bytes bytes of text, and each character is at least one byte. None before load."""
        return self.settings.max_prompt_tokens * self._token_bytes if self._token_bytes else None

    def handle(self, req: QueryRequest) -> QueryResult:
        p = self.prepare(req)
        return p if isinstance(p, QueryResult) else self.execute(p)

    def execute(self, p: Prepared, on_progress: Callable[[Progress], None] | None = None,
                should_stop: Callable[[], bool] | None = None) -> QueryResult:
        """One request from plan to result, alone (max_batch 1, warm-up, the benchmark's one-at-a-time runs).
        on_progress(Progress) streams the answer so far (at most every 50 ms); should_stop() returning True
        cancels it within one decode pass (success=False, stop_reason "cancel", the partial answer in `answer`;
        the prompt's KV may be pooled, the partial answer never is)."""
        with self._model_turn():
            if (refused := self._refused_unloaded(p)) is not None:
                return refused
            token = self.energy.begin(p)
            try:
                result = self._cancelled_while_waiting(p, should_stop) or self.pipeline.execute(p, on_progress,
                                                                                                 should_stop)
            except Exception as e:  # a fault inside generation fails this request only
                result = self._fault(p, e)
            result.request_id = p.req.request_id
            self._record(result, token)
            return result

    def _refused_unloaded(self, p: Prepared) -> QueryResult | None:
        """The refusal of a request that reached the model's turn after an unload (counted as an error), else None."""
        if self.loaded:
            return None
        self.recorder.record_error()
        return QueryResult.failure("engine is not loaded", p.req.request_id)

    @staticmethod
    def _cancelled_while_waiting(p: Prepared, should_stop: Callable[[], bool] | None) -> QueryResult | None:
        if should_stop is not None and should_stop():
            return QueryResult(success=False, error=CANCELLED_ERROR, stop_reason="cancel", request_id=p.req.request_id)
        return None

    def _fault(self, p: Prepared, e: BaseException) -> QueryResult:
        return fault_result(p, e, self.log)

    def begin(self, p: Prepared, on_progress: Callable[[Progress], None] | None = None,
              should_stop: Callable[[], bool] | None = None) -> QueryResult | Flight:
        """Admit a prepared request into the batch (batching.Batcher.begin): the result at once (ANSWER tier, a
        refusal, a fault), else a Flight for step()."""
        with self._model_turn():
            if (refused := self._refused_unloaded(p)) is not None:
                return refused
            token = self.energy.begin(p)
            try:
                result = self._cancelled_while_waiting(p, should_stop) or \
                    self.batcher.begin(p, on_progress, should_stop, token)
            except Exception as e:
                result = self._fault(p, e)
            if isinstance(result, QueryResult):
                self._record(result, token)
            return result

    def step(self, flights: list[Flight]) -> list[QueryResult | None]:
        """One step of every flight in one forward pass (batching.Batcher.step): per flight, its result when it
        finished in this step, else None."""
        with self._model_turn():
            if not self.loaded:
                out: list[QueryResult | None] = []
                for f in flights:
                    r = QueryResult.failure("engine is not loaded", f.p.req.request_id)
                    self._record(r, f.energy_token)
                    out.append(r)
                return out
            out = self.batcher.step(flights)
            for f, result in zip(flights, out):
                if result is not None:
                    self._record(result, f.energy_token)
        return out

    def prefill_exact(self, tokens: list[int], prefix: PrefixHit | None, reserve: int = 0
                      ) -> tuple[torch.Tensor, Any]:
        """Exact prefill as a request's is (request_pipeline.prefill_exact), for idle work and the idle-time
        audits (approx_gate.AuditHost)."""
        return prefill_exact(self.backend, tokens, prefix, reserve)

    def _record(self, result: QueryResult, energy_token: int | None = None) -> None:
        """Count the result in the statistics; with the request's energy span, its joules first."""
        figure = self.energy.end(energy_token)
        result.energy_j, result.energy_source = figure.joules, figure.source
        if result.success:
            self.recorder.record(result)
            self.energy_tally.record(result)
        elif result.stop_reason != "cancel":  # a cancel is the caller's choice, not a fault
            self.recorder.record_error()

    @property
    def lossless_reuse(self) -> bool:
        """Stored KV reused gives bitwise what a full prefill gives: stored at the model's own precision,
        on a backend whose results do not depend on how a sequence is cut into passes."""
        b, pool = self.backend, self.pool
        return b is not None and pool is not None and b.exact_chunking and pool.store_dtype == b.dtype

    # ---- idle work: deferred exact prefills and error-bound audits -----------------
    def has_idle_work(self) -> bool:
        return self.pool is not None and bool(self.memory.pending_inserts or self.audits) \
            and self.thermal_level == ThermalLevel.OK

    def idle_work(self) -> bool:
        """Compute and pool the exact KV of one prompt that SEMANTIC reuse served; returns whether it did.
        Skipped while running hot. Called by the request server's worker when no request waits."""
        with self._model_turn():
            if not self.has_idle_work():
                return False
            if not self.memory.pending_inserts:
                try:
                    return approx_gate.audit(self, self.audits.popleft())
                except Exception:
                    self.log.exception("idle-time audit failed")
                    return False
            job, pool = self.memory.pending_inserts.popleft(), self.loaded_pool()
            if pool.find(job.scope, job.tokens) is not None:
                return False
            try:
                # Built on the longest pooled prefix, exactly as an EXACT_PREFIX request's KV is.
                prefix = pool.longest_prefix(job.scope, job.tokens, len(job.tokens) - 1, len(job.tokens) + 2)
                _, cache = self.prefill_exact(job.tokens, prefix)
                self.memory.pool_exact(job.scope, job.tokens, cache, job.fingerprint, job.question, job.context_digest,
                                 job.answer)
            except Exception:
                self.log.exception("idle-time exact prefill failed")
                return False
            return True

    # ---- telemetry -------------------------------------------------------------
    def energy_stats(self) -> dict:
        """CacheStats' energy fields (energy.EnergyTally.snapshot): NaN where no answer has a figure."""
        return self.energy_tally.snapshot(self.energy.description)

    def stats(self, queue_depth: int = 0) -> dict:
        pool = self.pool
        if pool is None:
            return self.recorder.snapshot(0, 0, 0, 0, 0, 0, queue_depth)
        st = pool.stats()
        return self.recorder.snapshot(st.bytes_used, st.budget_bytes, st.entries, st.blocks_used, st.evictions_total,
                                      st.bytes_saved_quantization, queue_depth)

    def entries(self) -> list:
        """Summaries of the cached tasks (kv_pool.EntryInfo), for telemetry; empty when not loaded."""
        pool = self.pool
        return pool.describe_entries() if pool is not None else []
