"""The request pipeline: request -> fingerprint -> match -> plan reuse -> run model -> update pool -> respond.

Two phases so the ROS node can overlap them in different callback groups:
`prepare()` (validate, start the fingerprint; thread-safe, no model) and then either
`execute()` (plan reuse, run the model, update the pool; one request alone) or,
for several requests in flight together (continuous batching, max_batch > 1),
`begin()` (plan, set up the prefill) followed by `step()` calls that advance
every flight in one forward pass (prefill chunks and decode steps) until each
finishes with its result. A request's own fault never raises: it comes back as
success=False with an error, and fails only that request.
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from . import approx_gate, compute_threads, fleet_store, path_checks, persistence, reuse_planner, semantic_log as semantic_log_mod, semantic_reuse
from .answer_memo import AnswerMemo, Memo, Signature
from .cache_stats import CacheStatsRecorder
from .decoding import Constraint, Decoder, Generation
from .draft_proposer import DraftProposer, DraftStats
from .error_bound import ErrorBound
from .fleet_store import FleetStore
from .fingerprint import Fingerprinter, context_digest
from .kv_pool import KVPool, PrefixHit
from .llama_runner import ONEDNN_ISA_CAP
from .model_backend import ModelBackend, ModelLoadError
from .request import CANCELLED_ERROR, CacheResult, Progress, QueryRequest, QueryResult
from .safe_io import read_regular
from .semantic_log import SemanticLog, request_from_record, request_record
from .settings import SPECS, SettingError, Settings, parse_size
from .streaming import AnswerWatcher
from .structured_output import CompiledSchema, NoValueLeft, SchemaError
from .thermal import ThermalLevel
from .validation import check_text_field, is_invisible_only, normalize_text, validate_request

RELOAD_PARAMS = {s.name for s in SPECS if not s.live}
# What a fork may set for itself: its own fleet connection and its own snapshot folder (restore() is the caller's).
FORK_OWN_PARAMS = {s.name for s in SPECS if s.name.startswith("fleet_")} | {"persist_path"}


class EngineLoadError(RuntimeError):
    pass


@dataclasses.dataclass
class Prepared:
    req: QueryRequest
    fingerprints: concurrent.futures.Future  # [n, dim] of the batch this request was prepared in; row `row`
    question: str
    t_arrival: float  # perf_counter when the request reached the engine: TTFT counts from here
    schema: CompiledSchema | None = None  # the compiled json_schema, when the request has one
    row: int = 0

    @property
    def fingerprint(self) -> np.ndarray:
        """The question's fingerprint. It is computed while the request is planned and prefilled, so the
        first use may wait for it; an embedder failure raises here and fails this request."""
        return self.fingerprints.result()[self.row]



KV_SLOT_STEP = 128  # a request's KV buffer holds a multiple of this many token slots (<= 3 MB more at 16 bits)


def task_digest(req: QueryRequest) -> str:
    """What must be identical for a stored answer to fit a request (the ANSWER tier): the context, and for a
    conversation, structured output or stop strings also the earlier turns, the schema and the stops."""
    history = [[t.role, t.content] for t in req.turns()[:-1]]
    if not (history or req.json_schema or req.stop):
        return context_digest(req.context)
    extra = json.dumps({"history": history, "json_schema": req.json_schema, "stop": list(req.stop)},
                       ensure_ascii=False, sort_keys=True)
    return context_digest(req.context + "\x1f" + extra)


@dataclasses.dataclass
class MemoPlan:
    """What the decision log records for an answer from the memo: the prompt's own pool entry, exact."""

    source_key: int
    source_question: str
    tier: CacheResult = CacheResult.EXACT_PREFIX
    similarity: float = 1.0
    reason: str = "identical request: the stored answer (answer_memo)"


@dataclasses.dataclass
class Flight:
    """A request between its plan and its result: the engine's state for it while it is prefilled and decoded
    (alone in execute(), or among others in step())."""

    p: Prepared
    plan: reuse_planner.ReusePlan
    tokens: list[int]
    res: QueryResult  # filled in as it goes
    digest: str
    now: float
    poolable: bool
    lossless: bool
    plan_ms: float
    max_new: int
    reserve: int  # KV room beyond the prompt: the answer and a draft
    early: "semantic_reuse.Ahead | None" = None  # a SEMANTIC plan's early pass, run while the fingerprint was computed
    use_drafts: bool = False  # drafts are built once the prompt is in (_after_prefill), with the fingerprint
    similarity_pending: bool = False  # planned without the fingerprint: res.similarity comes after the prefill
    drafts: DraftProposer | None = None
    watch: AnswerWatcher | None = None  # stop strings, streaming, cancel
    on_token: Callable[[list[int]], None] | None = None
    constraint: Constraint | None = None  # the json_schema's grammar
    temperature: float = 0.0
    seed: int = 0
    streaming: bool = False
    cache: object = None
    todo: int = 0  # prompt tokens (the last ones) still to prefill
    decoder: Decoder | None = None
    # (lead flight, slots, its cache, ours): our cache's first slots hold the lead's bits (ModelBackend.same_prefix),
    # which a batched step's attention reads once for both; None: not shared (share_checked: looked already).
    share: tuple | None = None
    share_checked: bool = False
    fleet_answer: list[int] | None = None  # another node's answer to this prompt (fleet store): a draft
    candidate: "approx_gate.Candidate | None" = None  # the stored answer the ANSWER tier would have looked at
    refused: "reuse_planner.ReusePlan | None" = None  # an approximate plan the error bound turned down
    delta: float = 1.0  # the approx_error_bound this request is served under


@dataclasses.dataclass
class PendingInsert:
    """A prompt served approximately (SEMANTIC): its exact KV is computed later, when the engine is idle."""

    scope: str
    tokens: list[int]
    fingerprint: np.ndarray
    question: str
    context_digest: str
    answer: str


@dataclasses.dataclass
class Observation:
    """One executed request as an observer sees it (the benchmark): the plan, where the engine's own time
    went (ms), and the first-token logits (None for ANSWER)."""

    request_id: str
    plan: reuse_planner.ReusePlan
    plan_ms: float  # the whole reuse plan, match included
    match_ms: float  # matcher lookup inside the plan
    insert_ms: float  # pool update after generation
    first_logits: torch.Tensor | None


PENDING_INSERTS_MAX = 8  # deferred exact prefills kept (newest win): idle time is finite
EMBED_MAX_TEXTS = 256  # texts per ~/embed call


def device_memory_bytes(device: str) -> int:
    if device.startswith("cuda") and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


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


def max_token_bytes(tokenizer) -> int:
    """An upper bound on the bytes of text one token stands for: the longest vocabulary entry, in UTF-8 bytes
    of its token string (byte-level BPE writes each byte as one character of up to 2 UTF-8 bytes, so this
    can only overestimate)."""
    n = len(tokenizer)
    tokens = tokenizer.convert_ids_to_tokens(list(range(n)))
    return max([len(t.encode("utf-8", "surrogatepass")) for t in tokens if isinstance(t, str)] + [1])


class Engine:
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
        self._last_refresh = 0.0
        self._saved_mutations = -1
        self._token_bytes = 0  # longest vocabulary entry in UTF-8 bytes (an upper bound), set at load
        self.load_report: dict = {}
        self.kv_bits = 0
        # Recent answers per scope (token ids), a draft source for verified decoding.
        self._recent_answers: dict[str, collections.deque[list[int]]] = {}
        self._answer_tokens: collections.OrderedDict[str, list[int]] = collections.OrderedDict()
        self.memo = AnswerMemo()  # finished answers of identical requests (answer_memo)
        # How often each kind of draft is accepted (learnt over requests): with the backend's pass costs it
        # decides how long a draft is checked.
        self._draft_stats = DraftStats()
        self._owns_models = True  # False for a fork(): the backend belongs to another engine
        self._warming = False  # requests now are warm-up: the semantic log marks them so they do not count
        # Prompts served by SEMANTIC reuse, waiting for an exact prefill at idle time.
        self.pending_inserts: collections.deque[PendingInsert] = collections.deque(maxlen=PENDING_INSERTS_MAX)
        # Early passes run while a fingerprint was computed (see _early_start): how many, and how many a SEMANTIC
        # plan then used.
        self.early_starts = 0
        self.early_starts_used = 0
        # Called with an Observation after every executed request (the benchmark's hook); None: nobody.
        self.observer: Callable[[Observation], None] | None = None
        self.fleet: FleetStore | None = None  # the shared fleet store (fleet_store_url), None when off
        # How often approximate answers differ from the model's own (approx_error_bound), and the idle-time
        # checks that teach it (approx_gate).
        self.error_bound = ErrorBound()
        self.audits: collections.deque[approx_gate.Audit] = collections.deque(maxlen=approx_gate.AUDITS_MAX)
        self._prefill_s_per_token = 0.0  # measured at load with a fleet store: the fetch-or-prefill estimate

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

    def load(self, progress: Callable[[str], None] | None = None) -> None:
        progress = progress or (lambda m: self.log.info(m))
        s = self.settings
        try:
            t0 = time.monotonic()
            path_checks.check_all(s, create=True)  # before the model: a path that cannot work fails now
            progress(f"loading model {s.model} ({s.dtype}, {s.device})")
            self.backend = ModelBackend(s.model, s.device, s.dtype, s.model_cache_dir, progress, s.weight_bits)
            progress(f"model in {self.backend.dtype_name}, weights at {self.backend.weight_bits} bits; batch-invariant "
                     f"execution {'verified: exact-prefix reuse and drafts are lossless' if self.backend.exact_chunking else f'NOT verified on this machine: reuse and drafts are approximate (a oneDNN ISA above {ONEDNN_ISA_CAP}, e.g. ONEDNN_MAX_CPU_ISA=ALL, causes this on AMX CPUs)'}")
            progress(f"dtype {self.backend.dtype_name}: {self.backend.dtype_why}")
            progress(f"attention: {self.backend.attention_path}")
            progress(f"norms: {self.backend.norm_path}")
            progress(f"layers: {self.backend.layers_path}")
            if self.backend.int4_kind:
                progress(f"4-bit products: {self.backend.int4_path}")
            if compute_threads.hands_over(self.backend.kernels_do_the_work):
                progress(f"threads: {torch.get_num_threads()} for our kernels' workers while the model runs, "
                         "torch one (compute_threads)")
            self._token_bytes = max_token_bytes(self.backend.tokenizer)
            progress(f"loading embedder {s.embedder}")
            self.fingerprinter = Fingerprinter(s.embedder, self.backend.device)
            budget = parse_size(s.cache_size, device_memory_bytes(self.backend.device))
            self.kv_bits = s.kv_bits or (32 if self.backend.dtype == torch.float32 else 16)
            self.pool = KVPool(self.backend.kv_shape, block_tokens=s.block_tokens, budget_bytes=budget,
                               kv_bits=self.kv_bits, model_dtype=self.backend.dtype,
                               fingerprint_dim=self.fingerprinter.dim, device=self.backend.device)
            self._apply_pool_knobs()
            self._prime()
            self._open_fleet(progress)
            if s.semantic_log_path:
                self.semantic_log = SemanticLog(s.semantic_log_path)
            self.load_report = {"load_s": 0.0, "restored": 0, "snapshot": "", "warmup": 0}
            if s.persist_path:
                self.restore(progress)
            if s.warmup_queries:
                self.load_report["warmup"] = self._warm_up(s.warmup_queries, progress)
            self.load_report["load_s"] = time.monotonic() - t0
            if not self.backend.semantic_supported:
                self.log.warning(f"model type '{self.backend.model_type}' is not supported by SEMANTIC reuse: "
                                 "only exact-prefix and answer reuse will be used")
        except Exception as e:  # configure must fail cleanly, whatever broke, and leave nothing half-loaded
            self.unload()
            msg = str(e) if isinstance(e, (ModelLoadError, SettingError, EngineLoadError)) else f"{type(e).__name__}: {e}"
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
        other.pool = self.pool.empty_like()
        other._apply_pool_knobs()
        other._owns_models = False
        other._prefill_s_per_token = self._prefill_s_per_token
        other._open_fleet(lambda m: other.log.info(m))
        return other

    def _open_fleet(self, progress) -> None:
        """Connect to the fleet store (fleet_store_url) if one is set. Its digest is this node's arithmetic, so
        only nodes that compute the same bits share KV; answers are drafts, checked by the model."""
        s = self.settings
        if not s.fleet_store_url:
            return
        b = self.backend
        if not self._prefill_s_per_token:
            ids = list(range(100, 164))
            t0 = time.perf_counter()
            b.prefill(ids)
            self._prefill_s_per_token = (time.perf_counter() - t0) / len(ids)
        self.fleet = fleet_store.open_store(s, digest=fleet_store.node_digest(b.numerics, b.dtype, b.kv_shape,
                                                                              self.pool.store_dtype),
                                            kv_shape=b.kv_shape, dtype=b.dtype, share_kv=self.lossless_reuse,
                                            log=self.log)
        up = self.fleet.ping()
        if up:
            self.fleet.measure_link()
        progress(f"fleet store {self.fleet.url}: {'connected' if up else 'not reachable now (retried in the background)'}"
                 f"; digest {self.fleet.digest}; KV blocks {'shared' if self.fleet.share_kv else 'not shared (KV is not lossless here)'}"
                 f"; prefill {self._prefill_s_per_token * 1000:.2f} ms/token, link {self.fleet.bytes_per_s / 1e6:.0f} MB/s")

    def _prime(self) -> None:
        """One throwaway pass through both models: torch's first call is slow, and no user should pay for it."""
        ids = self.backend.prompt_ids(self.settings.system_prompt, "", "hello")
        logits, cache = self.backend.prefill(ids)
        self.backend.decode(logits, cache, 2)
        self.fingerprinter.embed(["hello"])

    def _identity(self) -> dict:
        return persistence.identity(self.pool, self.backend.identity, self.settings.embedder, self.backend.numerics)

    def _warm_up(self, spec: str, progress) -> int:
        """warmup_queries: a JSON Lines file of requests, or an integer N: the N most-used tasks of the
        semantic log that the snapshot did not already bring back."""
        self._warming = True
        try:
            if spec.strip().isdigit():
                return self._warm_up_most_used(int(spec), progress)
            return self._warm_up_file(spec, progress)
        finally:
            self._warming = False

    def _warm_up_most_used(self, n: int, progress) -> int:
        s, restored = self.settings, self.load_report.get("restored", 0)
        if not s.semantic_log_path and self.fleet is None:
            progress(f"warm-up: the {n} most-used tasks need the semantic log (semantic_log_path is empty) or a "
                     f"fleet store; only the {restored} tasks restored from the snapshot are warm")
            return 0
        tasks = semantic_log_mod.most_used(s.semantic_log_path, n) if s.semantic_log_path else []
        if self.fleet is not None and len(tasks) < n:  # then what the fleet asks most
            seen = {json.dumps(request_record(r), sort_keys=True) for r in tasks}
            for rec in self.fleet.most_asked(n):
                try:
                    r = request_from_record(rec, f"warmup:fleet:{len(tasks) + 1}")
                except (ValueError, TypeError, KeyError):
                    continue
                if json.dumps(request_record(r), sort_keys=True) not in seen and len(tasks) < n:
                    seen.add(json.dumps(request_record(r), sort_keys=True))
                    tasks.append(r)
        todo = [r for r in tasks if self.pool.find(
            r.scope, self.backend.chat_ids(s.system_prompt, r.context, r.turns())) is None]
        source = " and ".join(x for x in (s.semantic_log_path, "the fleet store" if self.fleet else "") if x)
        progress(f"warm-up: the {len(tasks)} most-used tasks of {source} ({n} asked): "
                 f"{len(tasks) - len(todo)} already in the pool from the snapshot, computing {len(todo)}")
        return self._run_warm_up(todo, progress)

    def _warm_up_file(self, path: str, progress) -> int:
        reqs = read_requests_jsonl(path)
        progress(f"warm-up: {len(reqs)} requests from {path}")
        calibrate = self.settings.enable_quant_calibration and self.pool.quantized
        if calibrate:
            self._calibrate([self.backend.prompt_ids(self.settings.system_prompt, r.context, r.prompt) for r in reqs])
        return self._run_warm_up(reqs, progress)

    def _run_warm_up(self, reqs: list[QueryRequest], progress) -> int:
        done = 0
        for r in reqs:
            if self.thermal_level >= ThermalLevel.WARN:
                progress("warm-up stopped early: running hot")
                break
            res = self.handle(r)
            if not res.success:
                self.log.warning(f"warm-up request {r.request_id} failed: {res.error}")
            done += res.success
        return done

    @torch.inference_mode()
    def _calibrate(self, prompts: list[list[int]]) -> None:
        """Fix per-channel key ranges from the warm-up prompts (enable_quant_calibration)."""
        lo = hi = None
        for ids in prompts:
            _, cache = self.backend.prefill(ids)
            k, _ = self.backend.cache_tensors(cache)
            kl, kh = k.float().amin(dim=2, keepdim=True), k.float().amax(dim=2, keepdim=True)
            lo = kl if lo is None else torch.minimum(lo, kl)
            hi = kh if hi is None else torch.maximum(hi, kh)
        if lo is not None:
            self.pool.set_key_calibration(lo, hi)

    def restore(self, progress: Callable[[str], None] | None = None) -> int:
        """Load the snapshot in persist_path into the (empty) pool; never raises. A bad snapshot is logged
        with its path and the reason, and the pool stays empty."""
        pool, folder = self.pool, self.settings.persist_path
        try:
            n = persistence.load(pool, folder, self._identity())
            self.load_report.update(restored=n, snapshot="loaded")
            (progress or self.log.info)(f"restored {n} cached tasks from {folder}")
        except Exception as e:  # SnapshotSkipped, or anything unforeseen: a snapshot never stops a start
            n = 0
            pool.clear()
            reason = str(e) if isinstance(e, persistence.SnapshotSkipped) else \
                f"snapshot in {folder} not loaded: {type(e).__name__}: {e}"
            self.load_report.update(restored=0, snapshot=reason)
            self.log.warning(f"pool snapshot skipped: {reason}")
        self._saved_mutations = pool.mutations  # what was just loaded needs no checkpoint
        try:
            labels = self.error_bound.load(folder, self.backend.numerics)
            if labels:
                (progress or self.log.info)(f"restored {labels} error-bound labels from {folder}")
        except ValueError as e:  # a damaged or foreign file: start without labels (lossless until relearnt)
            self.log.warning(f"error-bound labels not loaded: {e}")
        return n

    def save(self, only_if_changed: bool = False) -> str | None:
        """Write the pool to persist_path (atomic). Does not wait for a running generation: the pool lock
        is held only while the tensors are copied. only_if_changed: skip when nothing changed since the
        last save or restore (background checkpoints)."""
        pool, backend = self.pool, self.backend
        if pool is None or backend is None or not self.settings.persist_path:
            return None
        mutations = pool.mutations
        if only_if_changed and mutations == self._saved_mutations and not self.error_bound.changes:
            return None
        ident = persistence.identity(pool, backend.identity, self.settings.embedder, backend.numerics)
        path = persistence.save(pool, self.settings.persist_path, ident)
        if len(self.error_bound):
            self.error_bound.save(self.settings.persist_path, backend.numerics)
        self._saved_mutations = mutations
        return path

    def unload(self) -> None:
        with self._exec_lock:
            if self.fleet is not None:
                self.fleet.close()
                self.fleet = None
            if self.backend is not None and self._owns_models:
                self.backend.release()
                if self.fingerprinter is not None:
                    self.fingerprinter.close()
            self.backend = None
            self.fingerprinter = None
            self.pool = None
            self.pending_inserts.clear()
            if self.semantic_log is not None:
                self.semantic_log.close()
                self.semantic_log = None

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
        self.pool.set_eviction_policy(lfu_weight=s.lfu_weight, diversity_weight=s.diversity_weight,
                                      half_life_s=s.recency_half_life_s)

    def clear_pool(self) -> None:
        """Forget every cached task, every deferred exact prefill and the recent answers kept as drafts."""
        with self._exec_lock:
            self.pending_inserts.clear()
            self.audits.clear()
            self._recent_answers.clear()
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
        s = self.settings
        out: list[Prepared | QueryResult | None] = [None] * len(reqs)
        todo = []
        for i, r in enumerate(reqs):
            err = validate_request(r, max_scope_length=s.max_scope_length, max_new_tokens_limit=s.max_new_tokens_limit,
                                   max_chars=self.max_prompt_chars())
            if err is None and not self.loaded:
                err = "engine is not loaded"
            schema = None
            if err is None and r.json_schema:
                try:
                    schema = self.backend.grammars.compile(r.json_schema, s.schema_compile_timeout_s)
                except SchemaError as e:
                    err = str(e)
            if err is not None:
                self.recorder.record_error()
                out[i] = QueryResult.failure(err, r.request_id)
            else:
                todo.append((i, schema))
        if todo:
            fps = self.fingerprinter.embed_async([reqs[i].question for i, _ in todo])
            for j, (i, schema) in enumerate(todo):
                out[i] = Prepared(reqs[i], fps, normalize_text(reqs[i].question), t0, schema, row=j)
        return out

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
            if not self.loaded:
                self.recorder.record_error()
                return QueryResult.failure("engine is not loaded", p.req.request_id)
            try:
                result = self._cancelled_while_waiting(p, should_stop) or self._execute(p, on_progress, should_stop)
            except Exception as e:  # a fault inside generation fails this request only
                result = self._fault(p, e)
            result.request_id = p.req.request_id
            self._record(result)
            return result

    @staticmethod
    def _cancelled_while_waiting(p: Prepared, should_stop: Callable[[], bool] | None) -> QueryResult | None:
        if should_stop is not None and should_stop():
            return QueryResult(success=False, error=CANCELLED_ERROR, stop_reason="cancel", request_id=p.req.request_id)
        return None

    def _fault(self, p: Prepared, e: BaseException) -> QueryResult:
        if isinstance(e, NoValueLeft):  # the caller's schema, not our fault: a clear error, no traceback
            self.log.warning(f"request {p.req.request_id!r}: {e}")
            return QueryResult.failure(str(e), p.req.request_id)
        self.log.error(f"request {p.req.request_id!r} failed inside the engine", exc_info=e)
        return QueryResult.failure(f"internal error: {type(e).__name__}: {e}", p.req.request_id)

    def _record(self, result: QueryResult) -> None:
        if result.success:
            self.recorder.record(result)
        elif result.stop_reason != "cancel":  # a cancel is the caller's choice, not a fault
            self.recorder.record_error()

    def _execute(self, p: Prepared, on_progress: Callable[[Progress], None] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> QueryResult:
        f = self._plan(p, on_progress, should_stop)
        if isinstance(f, QueryResult):
            return f
        logits, f.cache = self._prefill(f.plan, f.tokens, f.res, f.reserve, f.early)
        self._after_prefill(f)
        gen = self.backend.decode(logits, f.cache, f.max_new, f.temperature, f.seed, t_start=p.t_arrival,
                                  drafts=f.drafts, on_token=f.on_token, should_stop=f.watch.should_stop,
                                  constraint=f.constraint)
        return self._conclude(f, gen)

    def _plan(self, p: Prepared, on_progress: Callable[[Progress], None] | None = None,
              should_stop: Callable[[], bool] | None = None) -> QueryResult | Flight:
        """A request's first phase: its prompt tokens and reuse plan; the result at once for the ANSWER tier
        or a refusal, else a Flight whose prefill and decoding are still to run."""
        s, req, backend, pool = self.settings, p.req, self.backend, self.pool
        tokens = backend.chat_ids(s.system_prompt, req.context, req.turns())
        if len(tokens) > s.max_prompt_tokens:
            return QueryResult.failure(f"prompt and context are {len(tokens)} tokens; max_prompt_tokens is "
                                       f"{s.max_prompt_tokens} (nothing is truncated)", req.request_id)
        max_new = self._answer_length(req)
        now = time.time()
        self._refresh(now)
        temperature = s.temperature if req.temperature is None else req.temperature
        seed = s.seed if req.seed is None else req.seed
        served = self._memo_answer(p, tokens, max_new, Signature.of(temperature, seed, req.stop, req.json_schema),
                                   now, on_progress)
        if served is not None:
            return served
        digest = task_digest(req)
        # A sliding-window layer keeps only its window: past it, the cache no longer holds every token's KV.
        poolable = not backend.sliding_window or len(tokens) + max_new <= backend.sliding_window
        lossless = self.lossless_reuse
        # Room in the KV buffer for the answer and a draft, the buffer sized in steps of KV_SLOT_STEP slots: the
        # pool keeps it as the live prefix, and the next question on that context (a few tokens longer) fits.
        reserve = -(-(len(tokens) + max_new + s.max_draft_tokens + 2) // KV_SLOT_STEP) * KV_SLOT_STEP - len(tokens)
        # A lossless plan (exact prefix or miss) does not use the fingerprint: the plan and the prefill go ahead
        # while it is computed, and what needs it (drafts, reported similarity, pool update) comes after.
        defer = not req.allow_approximate
        early, prefix = self._early_start(p, tokens, poolable, lossless, reserve)
        fleet_answer = None
        if self.fleet is not None:
            prefix, fleet_answer = self._fleet_lookup(req.scope, tokens, prefix, reserve,
                                                      want_kv=early is None and poolable and lossless)
        t_plan = time.perf_counter()
        plan = reuse_planner.plan(pool, tokens=tokens, scope=req.scope, fingerprint=None if defer else p.fingerprint,
                                  question=p.question, context_digest=digest,
                                  allow_approximate=req.allow_approximate, settings=s,
                                  semantic_supported=backend.semantic_supported, now=now, use_kv=poolable,
                                  lossless_kv=lossless, kv_capacity=len(tokens) + reserve, prefix=prefix)
        refused, estimate = None, 0.0
        delta = approx_gate.request_bound(req.approx_error_bound, s.approx_error_bound)
        if plan.tier in approx_gate.TIER_NAMES:
            keep, _, est = approx_gate.gate(self.error_bound, plan, req.scope, pool.task_id(plan.source_key), delta)
            estimate = est.upper if est.n else 0.0
            if not keep:  # lossless instead: verified drafts; the refused plan is audited at idle time
                refused, early = plan, None
                plan = reuse_planner.plan(pool, tokens=tokens, scope=req.scope, fingerprint=p.fingerprint,
                                          question=p.question, context_digest=digest, allow_approximate=False,
                                          settings=s, semantic_supported=backend.semantic_supported, now=now,
                                          use_kv=poolable, lossless_kv=lossless, kv_capacity=len(tokens) + reserve)
                estimate = 0.0
        plan_ms = (time.perf_counter() - t_plan) * 1000
        if plan.tier != CacheResult.SEMANTIC:
            early = None
        res = QueryResult(success=True, cache_result=plan.tier, similarity=plan.similarity,
                          prompt_tokens=len(tokens), request_id=req.request_id, error_estimate=estimate)
        if plan.tier == CacheResult.ANSWER:  # unverified stored answer (opt-in): approximate
            pool.touch([plan.source_key], now)
            res.answer = plan.answer
            res.reused_tokens = len(tokens)
            res.ttft_ms = res.total_ms = (time.perf_counter() - p.t_arrival) * 1000
            if on_progress is not None:
                AnswerWatcher(backend.detokenize, on_progress=on_progress,
                              cache_result=plan.tier).progress(res.answer, 0)
            self._audit_later(p, tokens, digest, "answer", False, res.answer, max_new, temperature, seed, plan, delta)
            self._log_decision(req, digest, plan, res)
            self._observe(req, plan, plan_ms, 0.0, None)
            return res
        # Drafts are checked by the model; they keep the answer exact only on a batch-invariant backend.
        use_drafts = s.enable_drafts and (backend.exact_chunking or req.allow_approximate)
        watch = AnswerWatcher(backend.detokenize, stop=req.stop, on_progress=on_progress, cancelled=should_stop,
                              cache_result=plan.tier)
        return Flight(p, plan, tokens, res, digest, now, poolable, lossless, plan_ms, max_new,
                      reserve=reserve, early=early, use_drafts=use_drafts, similarity_pending=defer, watch=watch,
                      on_token=watch.on_token if (req.stop or on_progress) else None,
                      constraint=p.schema.constraint() if p.schema is not None else None,
                      temperature=temperature, seed=seed, streaming=on_progress is not None, fleet_answer=fleet_answer,
                      refused=refused, delta=delta)

    def _fleet_lookup(self, scope: str, tokens: list[int], prefix, reserve: int, want_kv: bool):
        """(The longer of this pool's exact prefix and the fleet's, where fetching beats prefilling; another
        node's answer to this prompt, a draft, or None)."""
        if want_kv and prefix is reuse_planner.UNREAD:
            prefix = self.pool.longest_prefix(scope, tokens, len(tokens) - 1, len(tokens) + reserve)
        have = prefix.n_tokens if want_kv and prefix else 0
        got, answer = self.fleet.lookup(scope, tokens, have=have, limit=len(tokens) - 1,
                                        capacity=len(tokens) + reserve,
                                        prefill_s_per_token=self._prefill_s_per_token, want_kv=want_kv)
        return (got or prefix), answer

    def _memo_answer(self, p: Prepared, tokens: list[int], max_new: int, signature: Signature, now: float,
                     on_progress: Callable[[Progress], None] | None) -> QueryResult | None:
        """An identical request's stored answer (answer_memo), exact: no prefill, no decode pass. None if there
        is none for these tokens, this signature and max_new_tokens, or the backend is not batch-invariant."""
        req = p.req
        if not (self.settings.answer_memo and self.backend.exact_chunking) or not len(self.memo):
            return None
        same = self.pool.find(req.scope, tokens)
        if same is None or not same.answer:
            return None
        served = self.memo.answer(same.key, same.answer, signature, max_new, self.backend.detokenize)
        if served is None:
            return None
        self.pool.touch([same.key], now)
        res = QueryResult(success=True, cache_result=CacheResult.EXACT_PREFIX, similarity=1.0,
                          prompt_tokens=len(tokens), request_id=req.request_id, answer=served.text,
                          reused_tokens=len(tokens), generated_tokens=served.tokens, stop_reason=served.stop_reason,
                          exact=True)
        if on_progress is not None:
            AnswerWatcher(self.backend.detokenize, on_progress=on_progress,
                          cache_result=CacheResult.EXACT_PREFIX).progress(res.answer, served.tokens)
        res.ttft_ms = res.total_ms = (time.perf_counter() - p.t_arrival) * 1000
        self._log_decision(req, task_digest(req), MemoPlan(same.key, req.question), res)
        if self.fleet is not None and not self._warming:
            self.fleet.publish(req.scope, tokens, answer_ids=None, question="", task=request_record(req),
                               read_kv=None)
        return res

    def _conclude(self, f: Flight, gen: Generation) -> QueryResult:
        """A request's last phase: its result from the generation; the pool learns the prompt's KV."""
        req, res, backend, watch = f.p.req, f.res, self.backend, f.watch
        res.answer = watch.final_text(gen.text)
        if res.answer == gen.text and gen.tokens:  # the ids the model chose: a draft of this answer re-tokenized
            self._keep_answer_ids(res.answer, list(gen.tokens))  # from its text may differ (token boundaries)
        res.stop_reason = "stop" if watch.stop_hit else gen.stopped
        res.generated_tokens = len(gen.tokens)
        res.ttft_ms = gen.ttft_s * 1000
        res.draft_tokens_proposed, res.draft_tokens_accepted = gen.draft_proposed, gen.draft_accepted
        res.decode_passes = gen.forward_passes
        res.decode_passes_saved = max(0, gen.plain_passes - gen.forward_passes)
        res.exact = (f.plan.tier == CacheResult.MISS or (f.plan.tier == CacheResult.EXACT_PREFIX and f.lossless)) \
            and (f.drafts is None or backend.exact_chunking)
        # Only a finished answer is stored (a draft source, an ANSWER candidate): a cancelled one, or JSON that
        # max_new_tokens cut short, leaves the prompt's KV in the pool and nothing else.
        finished = True
        if watch.cancelled:
            res.success, res.error, finished = False, CANCELLED_ERROR, False
        elif f.constraint is not None and not f.constraint.is_terminated():
            res.success, finished = False, False
            res.error = ("json_schema: a stop string ended the answer before the JSON was complete; drop that stop "
                         "string for JSON answers" if watch.stop_hit else
                         f"json_schema: the answer reached max_new_tokens ({f.max_new}) before the JSON was "
                         "complete; raise max_new_tokens or simplify the schema")
        elif f.p.schema is not None and (bad := f.p.schema.answer_error(res.answer)) is not None:
            # the last line: the grammar should make this impossible; never report such an answer a success
            res.success, finished = False, False
            res.error = f"json_schema: {bad}"
            self.log.warning(f"request {req.request_id!r}: a constrained answer failed its schema: {bad}")
        if f.streaming:
            watch.progress(res.answer, len(gen.tokens))  # the last word, whatever the throttle held back
        if finished:
            self._remember_answer(req.scope, gen.tokens)
        t_insert = time.perf_counter()
        self._update_pool(f.p, f.plan, f.tokens, f.cache, f.digest, res.answer if finished else None, f.now,
                          f.poolable)
        if finished and res.success and res.exact and backend.exact_chunking and self.settings.answer_memo:
            same = self.pool.find(req.scope, f.tokens)  # the entry that now holds this answer
            if same is not None and same.answer == res.answer:
                self.memo.remember(same.key, Memo(Signature.of(f.temperature, f.seed, req.stop, req.json_schema),
                                                  res.answer, tuple(gen.tokens), res.stop_reason))
        if self.fleet is not None and finished and res.success:
            self._publish(f, gen, exact=res.exact)
        if finished and res.success and self._labels_from(f):
            if f.candidate is not None:  # would the stored answer of the most similar task have been right?
                approx_gate.label(self.error_bound, req.scope, f.candidate, res.answer)
            if f.refused is not None and f.refused.tier == CacheResult.SEMANTIC and res.exact:
                self._audit_later(f.p, f.tokens, f.digest, "semantic", True, res.answer, f.max_new, f.temperature,
                                  f.seed, f.refused, f.delta)
            elif f.plan.tier == CacheResult.SEMANTIC:
                self._audit_later(f.p, f.tokens, f.digest, "semantic", False, res.answer, f.max_new, f.temperature,
                                  f.seed, f.plan, f.delta)
        self._keep_live(f)
        insert_ms = (time.perf_counter() - t_insert) * 1000
        res.total_ms = (time.perf_counter() - f.p.t_arrival) * 1000
        self._log_decision(req, f.digest, f.plan, res)
        self._observe(req, f.plan, f.plan_ms, insert_ms, gen.first_logits)
        return res

    # ---- continuous batching: requests in flight together (the request server's worker) ----------------
    def begin(self, p: Prepared, on_progress: Callable[[Progress], None] | None = None,
              should_stop: Callable[[], bool] | None = None) -> QueryResult | Flight:
        """Admit a prepared request into the batch: its plan, and its prefill set up (run in the next steps,
        chunked); a SEMANTIC repair runs here, whole. Returns the result at once (ANSWER tier, a refusal, a
        fault), else a Flight for step()."""
        with self._model_turn():
            if not self.loaded:
                self.recorder.record_error()
                return QueryResult.failure("engine is not loaded", p.req.request_id)
            try:
                result = self._cancelled_while_waiting(p, should_stop)
                if result is not None:
                    self._record(result)
                    return result
                f = self._plan(p, on_progress, should_stop)
                if isinstance(f, QueryResult):
                    self._record(f)
                    return f
                if f.plan.tier == CacheResult.SEMANTIC:
                    logits, f.cache = self._prefill(f.plan, f.tokens, f.res, f.reserve, f.early)
                    result = self._start_decoding(f, logits)
                    if result is not None:
                        self._record(result)
                    return result or f
                n = f.plan.prefix.n_tokens if f.plan.tier == CacheResult.EXACT_PREFIX else 0
                f.res.reused_tokens, f.res.recomputed_tokens = n, len(f.tokens) - n
                if n:
                    f.cache = self.backend.cache_from_tensors(f.plan.prefix.k, f.plan.prefix.v,
                                                              reserve=len(f.tokens) - n + f.reserve)
                else:
                    f.cache = self.backend.new_cache(len(f.tokens) + max(f.reserve, 2))
                f.todo = len(f.tokens) - n
                return f
            except Exception as e:
                result = self._fault(p, e)
                self._record(result)
                return result

    def step(self, flights: list[Flight]) -> list[QueryResult | None]:
        """One step of every flight, in ONE forward pass: a decode step (the last token and its draft) of each
        decoding flight and the next prefill chunks (at most prefill_chunk_tokens tokens in all, oldest flight
        first). Returns, per flight, its result when it finished in this step (done, or failed: a fault fails
        its own flight only), else None."""
        out: list[QueryResult | None] = [None] * len(flights)
        with self._model_turn():
            if not self.loaded:
                for i, f in enumerate(flights):
                    out[i] = QueryResult.failure("engine is not loaded", f.p.req.request_id)
                    self.recorder.record_error()
                return out
            backend = self.backend
            budget = self.settings.prefill_chunk_tokens if backend.exact_chunking else None  # None: whole prompts
            work = []  # (flight index, tokens, logits mode, cache length before)
            # A pass costs about its row count once rows outnumber a few (1 row 53 ms, 8 x 1 row 105 ms, 8 x 33
            # rows 1110 ms measured on one core): decoding together, each flight's draft gets a share.
            n_decoding = sum(1 for f in flights if f.decoder is not None and not f.decoder.done)
            cap = None if n_decoding <= 1 else max(1, self.settings.max_draft_tokens // n_decoding)
            for i, f in enumerate(flights):
                try:
                    if f.decoder is None and f.watch.should_stop():  # cancelled before its prompt was in
                        out[i] = QueryResult(success=False, error=CANCELLED_ERROR, stop_reason="cancel",
                                             request_id=f.p.req.request_id)
                    elif f.decoder is not None:
                        f.decoder.draft_cap = cap
                        work.append((i, f.decoder.inputs(), "all", backend.cache_len(f.cache)))
                    elif budget is None or budget > 0:
                        done = len(f.tokens) - f.todo
                        n = f.todo if budget is None else min(f.todo, budget)
                        work.append((i, f.tokens[done:done + n], "last" if n == f.todo else "none", done))
                        budget = None if budget is None else budget - n
                except Exception as e:
                    out[i] = self._fault(f.p, e)
            outs = self._run_isolated(flights, work, out)
            for (i, ids, mode, base), rows in zip(work, outs):
                if out[i] is not None:
                    continue
                f = flights[i]
                try:
                    if f.decoder is not None:
                        backend.finish_step(f.decoder, f.cache, base, rows)
                    else:
                        f.todo -= len(ids)
                        if not f.todo:
                            out[i] = self._start_decoding(f, rows)
                    if out[i] is None and f.decoder is not None and f.decoder.done:
                        out[i] = self._conclude(f, f.decoder.gen)
                except Exception as e:
                    out[i] = self._fault(f.p, e)
            for r in out:
                if r is not None:
                    self._record(r)
        return out

    def _run_isolated(self, flights: list[Flight], work: list, out: list) -> list:
        """The work's forward pass, all together; if it raises, each flight's part alone, so that a fault fails
        only the flight it belongs to (a failed pass leaves nothing behind: every step rewrites its KV slots)."""
        backend = self.backend
        items = [(ids, flights[i].cache, mode) for i, ids, mode, _ in work]
        if not items:
            return []
        try:
            return backend.run_batch(items, self._shared_prefixes(flights, work))
        except Exception as e:
            if len(items) == 1:
                out[work[0][0]] = self._fault(flights[work[0][0]].p, e)
                return [None]
        res = []
        for (i, _, _, base), item in zip(work, items):
            backend.truncate(flights[i].cache, base)
            try:
                res.append(backend.run_batch([item])[0])
            except Exception as e:
                out[i] = self._fault(flights[i].p, e)
                res.append(None)
        return res

    def _shared_prefixes(self, flights: list[Flight], work: list) -> list[tuple[int, int] | None]:
        """Per work item, (lead item, slots) where its cache begins with the same KV bits as a decoding lead's:
        flights answering on one context read its keys and values once per step. A flight looks for a lead once
        (comparing the bits: ~1 ms) when it starts decoding and again only when its lead has gone; each group
        shares the slots all its members share."""
        leads: dict[int, int] = {}  # id(lead flight) -> work item
        groups: dict[int, list[int]] = {}  # lead item -> member items (the lead first)
        slots: dict[int, int] = {}  # item -> slots it shares with its lead
        for j, (i, ids, mode, base) in enumerate(work):
            f = flights[i]
            if f.decoder is None:
                continue
            lead = None
            if f.share is not None:
                lf, n, lc, oc = f.share
                if id(lf) in leads and lf.cache is lc and f.cache is oc and n <= base:
                    lead = leads[id(lf)]
                else:
                    f.share, f.share_checked = None, False
            if lead is None and not f.share_checked:
                f.share_checked = True
                for k in leads.values():
                    lf = flights[work[k][0]]
                    common = next((t for t, (x, y) in enumerate(zip(lf.tokens, f.tokens)) if x != y),
                                  min(len(lf.tokens), len(f.tokens)))
                    n = self.backend.same_prefix(lf.cache, f.cache, min(common, base, work[k][3]))
                    if n:
                        f.share, lead = (lf, n, lf.cache, f.cache), k
                        break
            if lead is None:
                leads[id(f)] = j
                groups[j] = [j]
            else:
                groups[lead].append(j)
                slots[j] = f.share[1]
        out: list[tuple[int, int] | None] = [None] * len(work)
        for lead, members in groups.items():
            if len(members) > 1:
                n = min(slots[j] for j in members[1:])
                for j in members:
                    out[j] = (lead, n)
        return out

    def _after_prefill(self, f: Flight) -> None:
        """What needs the fingerprint, which had the plan and prefill's time to arrive: the drafts (answers of
        similar tasks) and, for a plan made without it, the reported similarity (the most similar task of the
        scope now, ranked as the planner ranks)."""
        fp = f.p.fingerprint
        if f.similarity_pending:
            best = reuse_planner.ranked_matches(self.pool, fp, f.p.req.scope, f.now, self.settings, k=1)
            f.plan.similarity = f.res.similarity = reuse_planner.reported_similarity(best[0].cosine) if best else 0.0
            f.similarity_pending = False
        if f.use_drafts and f.drafts is None:
            f.drafts = self._draft_source(f.p.req, f.tokens, fp, f.now, f.fleet_answer)
        if self._labels_from(f):
            f.candidate = approx_gate.answer_candidate(self.pool, fp, f.p.req.scope, f.tokens, f.now, self.settings)

    def _start_decoding(self, f: Flight, logits: torch.Tensor) -> QueryResult | None:
        """The prompt is in the cache: pick the first token (TTFT); the result if that already ends the answer."""
        self._after_prefill(f)
        f.decoder = self.backend.decoder(logits, f.max_new, f.temperature, f.seed, t_start=f.p.t_arrival,
                                         drafts=f.drafts, on_token=f.on_token, should_stop=f.watch.should_stop,
                                         constraint=f.constraint)
        if f.decoder.done:
            f.decoder.gen.text = self.backend.detokenize(f.decoder.gen.tokens)
            return self._conclude(f, f.decoder.gen)
        return None

    def _answer_length(self, req: QueryRequest) -> int:
        """Tokens to generate: the request's, or the default; at most half the default while running hot."""
        s = self.settings
        max_new = req.max_new_tokens or s.max_new_tokens
        if self.thermal_level >= ThermalLevel.WARN:
            max_new = max(1, min(max_new, s.max_new_tokens // 2))
        return max_new

    def _refresh(self, now: float) -> None:
        """Drop entries older than refresh_period_s (their KV or answer may be stale), at most once a second."""
        period = self.settings.refresh_period_s
        if period > 0 and now - self._last_refresh > 1.0:
            self.pool.drop_older_than(period, now)
            self._last_refresh = now

    def _prefill(self, plan: reuse_planner.ReusePlan, tokens: list[int], res: QueryResult, reserve: int,
                 early: "semantic_reuse.Ahead | None" = None):
        """Logits of the last prompt token and the prompt's cache (with room for `reserve` more tokens), built
        as the plan says; counts the reused and recomputed tokens in res. early: see _early_start."""
        if plan.tier == CacheResult.SEMANTIC:
            s = self.settings
            sp = semantic_reuse.run(self.backend, self.pool, plan, tokens, recompute_ratio=s.recompute_ratio,
                                    gap_recompute_tokens=s.gap_recompute_tokens, strict_layers=s.strict_layers,
                                    reserve=reserve, lossless_kv=self.lossless_reuse, early=early)
            self.early_starts_used += early is not None
            res.reused_tokens, res.recomputed_tokens = sp.reused, sp.recomputed
            return sp.logits, sp.cache
        n = plan.prefix.n_tokens if plan.tier == CacheResult.EXACT_PREFIX else 0
        res.reused_tokens, res.recomputed_tokens = n, len(tokens) - n
        return self._prefill_exact(tokens, plan.prefix if n else None, reserve)

    def _early_start(self, p: Prepared, tokens: list[int], poolable: bool, lossless: bool, reserve: int
                     ) -> tuple["semantic_reuse.Ahead | None", "PrefixHit | None | object"]:
        """The early pass of a possible SEMANTIC plan, run while the question's fingerprint is still computed.

        A SEMANTIC plan needs the fingerprint (to find the similar task), and its repair begins with an early
        pass over the prompt that needs only the tokens. A new question's fingerprint takes the embedder ~10 ms
        on its own thread, during which the model's thread would wait: it runs the early pass then, on this
        thread alone (the fingerprint keeps the other cores: at 2 threads a dropped pass cost a miss +7 ms on
        both cores, nothing measurable on one), and reads the entry the repair will most likely take; a SEMANTIC
        plan takes both up, any other plan drops them. Only where a SEMANTIC plan can follow and is worth a head
        start: approximate reuse allowed and possible, the scope holds a prefix of this prompt, and the prompt runs
        on for at least min_semantic_tokens after it (a new question on a cached context leaves ~15 tokens, cheap to
        compute: there the pass ahead cost 1.3-2.4 ms at one thread, for nothing). The pass starts after that prefix
        where the prefix's KV is bitwise what a pass computes (lossless), so that it gives the bits the repair's
        own early pass would. Returns it and the prefix read (for the planner, which would read it anyway), or
        (None, reuse_planner.UNREAD). A fault here only costs the head start: the repair then runs its own."""
        s, req, pool, backend = self.settings, p.req, self.pool, self.backend
        if not (s.early_pass_ahead and req.allow_approximate and s.enable_semantic_reuse and backend.semantic_supported
                and poolable and len(tokens) >= s.min_semantic_tokens and not p.fingerprints.done()):
            return None, reuse_planner.UNREAD
        prefix = pool.longest_prefix(req.scope, tokens, len(tokens) - 1, len(tokens) + reserve)
        if prefix is None or len(tokens) - prefix.n_tokens < s.min_semantic_tokens:
            return None, prefix
        # The entry most likely to be the source: the newest holding the prefix (right where the scope has one
        # task on this context; else a guess, read in time the thread would have waited anyway).
        try:
            with compute_threads.kernels_alone():
                early = semantic_reuse.ahead(backend, pool, tokens, strict_layers=s.strict_layers, reserve=reserve,
                                             prefix=(prefix.k, prefix.v) if lossless else None,
                                             guess=max(prefix.entry_keys) if prefix.entry_keys else None)
        except Exception as e:  # noqa: BLE001 - speculative work: the plan goes on without it
            self.log.warning("early pass ahead failed (%s: %s); the repair runs its own", type(e).__name__, e)
            return None, prefix
        self.early_starts += 1
        return early, prefix

    def _prefill_exact(self, tokens: list[int], prefix: PrefixHit | None, reserve: int = 0):
        """Exact prefill, on top of a pooled prefix's KV when there is one (requests and idle work alike)."""
        if prefix is None:
            return self.backend.prefill(tokens, reserve=reserve)
        cache = self.backend.cache_from_tensors(prefix.k, prefix.v, reserve=len(tokens) - prefix.n_tokens + reserve)
        return self.backend.prefill(tokens[prefix.n_tokens:], cache)

    def _pool_exact(self, scope: str, tokens: list[int], cache, fingerprint, question: str, digest: str,
                    answer: str, now: float | None = None) -> int | None:
        k, v = self.backend.cache_tensors(cache)
        return self.pool.insert(scope=scope, tokens=tokens, k=k[:, :, :len(tokens)], v=v[:, :, :len(tokens)],
                                fingerprint=fingerprint, question=question, context_digest=digest, answer=answer,
                                now=now)

    def _update_pool(self, p: Prepared, plan, tokens, cache, digest: str, answer: str | None, now: float,
                     poolable: bool) -> None:
        """Exact KV only: a repaired SEMANTIC cache is approximate and would poison exact reuse, so its exact
        KV is computed at idle time (idle_work) and the next request on that context is an EXACT_PREFIX hit.
        answer None: no finished answer (cancelled, cut short): the prompt's KV only, a stored answer stays."""
        req = p.req
        if plan.source_key is not None:
            self.pool.touch([plan.source_key], now)
        if not poolable:
            return
        if answer is None:
            if self.pool.find(req.scope, tokens) is not None:
                return
            answer = ""
        if plan.tier == CacheResult.SEMANTIC:
            self.pending_inserts.append(PendingInsert(req.scope, tokens, p.fingerprint, p.question, digest, answer))
        elif plan.tier in (CacheResult.MISS, CacheResult.EXACT_PREFIX):
            key = self._pool_exact(req.scope, tokens, cache, p.fingerprint, p.question, digest, answer, now)
            if key is None:
                self.log.warning(f"request {req.request_id!r}: {len(tokens)} tokens do not fit in the KV pool budget")

    def _publish(self, f: Flight, gen: Generation, exact: bool) -> None:
        """Share what this request computed exactly (off its path: the fleet's writer does the I/O)."""
        scope, tokens = f.p.req.scope, f.tokens
        kv_exact = f.poolable and self.lossless_reuse and f.plan.tier in (CacheResult.MISS, CacheResult.EXACT_PREFIX)
        self.fleet.publish(scope, tokens, answer_ids=list(gen.tokens) if exact else None, question=f.p.question,
                           task=None if self._warming else request_record(f.p.req),
                           read_kv=(lambda n: self.pool.read_prefix(scope, tokens, n)) if kv_exact else None,
                           fingerprint=f.p.fingerprint)

    @staticmethod
    def _labels_from(f: Flight) -> bool:
        """Whether this request's answer can label a tier: plain greedy text (no stop strings, schema or
        sampling, whose answers another request's settings would not reproduce) of a request that allows
        approximation or could (labels come from everyone's traffic)."""
        req = f.p.req
        return f.temperature == 0 and not req.stop and not req.json_schema

    def _audit_later(self, p: Prepared, tokens, digest, tier: str, served_exact: bool, served: str, max_new: int,
                     temperature: float, seed: int, plan, delta: float) -> None:
        """An approximate decision to check at idle time (approx_gate.audit), where a bound was asked."""
        req = p.req
        if delta >= 1.0 or temperature != 0 or req.stop or req.json_schema:
            return
        self.audits.append(approx_gate.Audit(tier, served_exact, req.scope, list(tokens), p.fingerprint, p.question,
                                             digest, served, max_new, temperature, seed,
                                             self.pool.task_id(plan.source_key), plan.similarity,
                                             plan if served_exact else None))

    def _keep_live(self, f: Flight) -> None:
        """The request's buffer becomes the pool's live prefix (next exact hit in its scope: no copy) when its
        prompt KV is exact and at the pool's precision (a SEMANTIC repair's is not)."""
        storage = self.backend.cache_storage(f.cache)
        if (storage is not None and f.poolable and self.lossless_reuse
                and f.plan.tier in (CacheResult.MISS, CacheResult.EXACT_PREFIX)
                and self.backend.cache_len(f.cache) >= len(f.tokens)):
            self.pool.keep_live(f.p.req.scope, f.tokens, *storage)

    def _observe(self, req: QueryRequest, plan, plan_ms: float, insert_ms: float, first_logits) -> None:
        if self.observer is not None:
            self.observer(Observation(req.request_id, plan, plan_ms, plan.match_ms, insert_ms, first_logits))

    @property
    def lossless_reuse(self) -> bool:
        """Stored KV reused gives bitwise what a full prefill gives: stored at the model's own precision,
        on a backend whose results do not depend on how a sequence is cut into passes."""
        b = self.backend
        return b is not None and b.exact_chunking and self.pool.store_dtype == b.dtype

    def _draft_source(self, req: QueryRequest, tokens: list[int], fingerprint, now: float,
                      fleet_answer: list[int] | None = None) -> DraftProposer:
        """Drafts for this request: answers of the same prompt and of similar tasks in its scope (most
        similar first), the scope's recent answers, and the prompt itself."""
        s, pool = self.settings, self.pool
        answers = []
        same = pool.find(req.scope, tokens)
        repeat = same.answer if same is not None and same.answer else ""
        repeat_ids = self._answer_ids(repeat) if repeat else []
        repeat_ids = repeat_ids or fleet_answer or []  # else another node's answer to this very prompt
        for m in pool.best_matches(fingerprint, req.scope, now, k=4, recency_weight=0.0,
                                   half_life_s=s.recency_half_life_s):
            if m.cosine >= s.draft_min_similarity and m.entry.answer and m.entry.answer not in answers:
                answers.append(m.entry.answer)
        ids = [self._answer_ids(a) for a in answers]
        if self.fleet is not None:  # then other nodes' answers to similar questions in this scope
            ids += [a for a in self.fleet.similar_answers(req.scope, fingerprint, s.draft_min_similarity)
                    if a not in ids and a != repeat_ids]
        return DraftProposer(answers=ids, repeat=repeat_ids,
                             history=list(self._recent_answers.get(req.scope, ())),
                             prompt=tokens, max_tokens=s.max_draft_tokens,
                             costs=self.backend.pass_costs, stats=self._draft_stats)

    def _answer_ids(self, text: str) -> list[int]:
        ids = self._answer_tokens.get(text)
        if ids is None:
            ids = self.backend.tokenize_answer(text)
            self._keep_answer_ids(text, ids)
        return ids

    def _keep_answer_ids(self, text: str, ids: list[int]) -> None:
        """An answer's token ids for drafts, the most recent 512 answers."""
        self._answer_tokens[text] = ids
        self._answer_tokens.move_to_end(text)
        if len(self._answer_tokens) > 512:
            self._answer_tokens.popitem(last=False)

    def _remember_answer(self, scope: str, tokens: list[int]) -> None:
        if tokens:
            self._recent_answers.setdefault(scope, collections.deque(maxlen=16)).append(list(tokens))
            if len(self._recent_answers) > 256:  # scopes are caller-chosen: keep the table bounded
                self._recent_answers.pop(next(iter(self._recent_answers)))

    def has_idle_work(self) -> bool:
        return self.pool is not None and bool(self.pending_inserts or self.audits) \
            and self.thermal_level == ThermalLevel.OK

    def idle_work(self) -> bool:
        """Compute and pool the exact KV of one prompt that SEMANTIC reuse served; returns whether it did.
        Skipped while running hot. Called by the request server's worker when no request waits."""
        with self._model_turn():
            if not self.has_idle_work():
                return False
            if not self.pending_inserts:
                try:
                    return approx_gate.audit(self, self.audits.popleft())
                except Exception:
                    self.log.exception("idle-time audit failed")
                    return False
            job = self.pending_inserts.popleft()
            if self.pool.find(job.scope, job.tokens) is not None:
                return False
            try:
                # Built on the longest pooled prefix, exactly as an EXACT_PREFIX request's KV is.
                prefix = self.pool.longest_prefix(job.scope, job.tokens, len(job.tokens) - 1, len(job.tokens) + 2)
                _, cache = self._prefill_exact(job.tokens, prefix)
                self._pool_exact(job.scope, job.tokens, cache, job.fingerprint, job.question, job.context_digest,
                                 job.answer)
            except Exception:
                self.log.exception("idle-time exact prefill failed")
                return False
            return True

    def _log_decision(self, req, digest, plan, res) -> None:
        """One JSON line per answered request (a memo hit too: warmup_queries counts the tasks asked most)."""
        if self.semantic_log is None:
            return
        self.semantic_log.write({
            "request_id": req.request_id, "scope": req.scope, "question": req.question[:200],
            "context_digest": digest, "tier": CacheResult(plan.tier).name, "similarity": round(plan.similarity, 4),
            "source_key": plan.source_key, "source_question": plan.source_question[:200],
            "reason": plan.reason, "prompt_tokens": res.prompt_tokens, "reused_tokens": res.reused_tokens,
            "recomputed_tokens": res.recomputed_tokens, "ttft_ms": round(res.ttft_ms, 2),
            # the request itself, so that warmup_queries: N can replay the most-used tasks
            **request_record(req),
            **({"warmup": True} if self._warming else {})})

    # ---- telemetry -------------------------------------------------------------
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
