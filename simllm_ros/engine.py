"""The request pipeline: request -> fingerprint -> match -> plan reuse -> run model -> update pool -> respond.

Two phases so the ROS node can overlap them in different callback groups:
`prepare()` (validate, fingerprint; thread-safe, no model) and `execute()`
(plan reuse, run the model, update the pool; one request at a time). A
request's own fault never raises: it comes back as success=False with an error.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from . import path_checks, persistence, reuse_planner, semantic_reuse
from .cache_stats import CacheStatsRecorder
from .draft_proposer import DraftProposer
from .fingerprint import Fingerprinter, context_digest
from .kv_pool import KVPool, PrefixHit
from .model_backend import ModelBackend, ModelLoadError
from .request import CacheResult, QueryRequest, QueryResult
from .safe_io import read_regular
from .semantic_log import SemanticLog
from .settings import SPECS, SettingError, Settings, parse_size
from .thermal import ThermalLevel
from .validation import normalize_text, validate_request

RELOAD_PARAMS = {s.name for s in SPECS if not s.live}


class EngineLoadError(RuntimeError):
    pass


@dataclasses.dataclass
class Prepared:
    req: QueryRequest
    fingerprint: np.ndarray
    question: str
    t_arrival: float  # perf_counter when the request reached the engine: TTFT counts from here


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
        self._owns_models = True  # False for a fork(): the backend belongs to another engine
        # Prompts served by SEMANTIC reuse, waiting for an exact prefill at idle time.
        self.pending_inserts: collections.deque[PendingInsert] = collections.deque(maxlen=PENDING_INSERTS_MAX)
        # Called with an Observation after every executed request (the benchmark's hook); None: nobody.
        self.observer: Callable[[Observation], None] | None = None

    # ---- lifecycle -------------------------------------------------------------
    @property
    def loaded(self) -> bool:
        return self.backend is not None

    def load(self, progress: Callable[[str], None] | None = None) -> None:
        progress = progress or (lambda m: self.log.info(m))
        s = self.settings
        try:
            t0 = time.monotonic()
            path_checks.check_all(s, create=True)  # before the model: a path that cannot work fails now
            progress(f"loading model {s.model} ({s.dtype}, {s.device})")
            self.backend = ModelBackend(s.model, s.device, s.dtype, s.model_cache_dir, progress, s.weight_bits)
            progress(f"model in {self.backend.dtype_name}, weights at {s.weight_bits} bits; batch-invariant "
                     f"execution {'verified: exact-prefix reuse and drafts are lossless' if self.backend.exact_chunking else 'NOT verified on this machine: reuse and drafts are approximate'}")
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
        reload = sorted(self.settings.changed_from(settings) & RELOAD_PARAMS)
        if reload:
            raise SettingError(f"a fork shares the loaded model: {', '.join(reload)} cannot differ")
        other = Engine(settings, log=self.log)
        other.backend, other.fingerprinter, other.kv_bits = self.backend, self.fingerprinter, self.kv_bits
        other._token_bytes = self._token_bytes
        other.pool = self.pool.empty_like()
        other._apply_pool_knobs()
        other._owns_models = False
        return other

    def _prime(self) -> None:
        """One throwaway pass through both models: torch's first call is slow, and no user should pay for it."""
        ids = self.backend.prompt_ids(self.settings.system_prompt, "", "hello")
        logits, cache = self.backend.prefill(ids)
        self.backend.decode(logits, cache, 2)
        self.fingerprinter.embed(["hello"])

    def _identity(self) -> dict:
        return persistence.identity(self.pool, self.backend.identity, self.settings.embedder)

    def _warm_up(self, path: str, progress) -> int:
        reqs = read_requests_jsonl(path)
        progress(f"warm-up: {len(reqs)} requests from {path}")
        calibrate = self.settings.enable_quant_calibration and self.pool.quantized
        if calibrate:
            self._calibrate([self.backend.prompt_ids(self.settings.system_prompt, r.context, r.prompt) for r in reqs])
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
        return n

    def save(self, only_if_changed: bool = False) -> str | None:
        """Write the pool to persist_path (atomic). Does not wait for a running generation: the pool lock
        is held only while the tensors are copied. only_if_changed: skip when nothing changed since the
        last save or restore (background checkpoints)."""
        pool, backend = self.pool, self.backend
        if pool is None or backend is None or not self.settings.persist_path:
            return None
        mutations = pool.mutations
        if only_if_changed and mutations == self._saved_mutations:
            return None
        ident = persistence.identity(pool, backend.identity, self.settings.embedder)
        path = persistence.save(pool, self.settings.persist_path, ident)
        self._saved_mutations = mutations
        return path

    def unload(self) -> None:
        with self._exec_lock:
            if self.backend is not None and self._owns_models:
                self.backend.release()
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
        """Forget every cached task and every deferred exact prefill."""
        with self._exec_lock:
            self.pending_inserts.clear()
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
            if err is not None:
                self.recorder.record_error()
                out[i] = QueryResult.failure(err, r.request_id)
            else:
                todo.append(i)
        if todo:
            fps = self.fingerprinter.embed([reqs[i].prompt for i in todo])
            for j, i in enumerate(todo):
                out[i] = Prepared(reqs[i], fps[j], normalize_text(reqs[i].prompt), t0)
        return out

    def max_prompt_chars(self) -> int | None:
        """No prompt + context longer than this (characters) fits in max_prompt_tokens: each token stands for
        at most _token_bytes bytes of text, and each character is at least one byte. None before load."""
        return self.settings.max_prompt_tokens * self._token_bytes if self._token_bytes else None

    def handle(self, req: QueryRequest) -> QueryResult:
        p = self.prepare(req)
        return p if isinstance(p, QueryResult) else self.execute(p)

    def execute(self, p: Prepared) -> QueryResult:
        with self._exec_lock:
            if not self.loaded:
                self.recorder.record_error()
                return QueryResult.failure("engine is not loaded", p.req.request_id)
            try:
                result = self._execute(p)
            except Exception as e:  # a fault inside generation fails this request only
                self.log.exception(f"request {p.req.request_id!r} failed inside the engine")
                result = QueryResult.failure(f"internal error: {type(e).__name__}: {e}", p.req.request_id)
            if result.success:
                self.recorder.record(result)
            else:
                self.recorder.record_error()
            return result

    def _execute(self, p: Prepared) -> QueryResult:
        s, req, backend, pool = self.settings, p.req, self.backend, self.pool
        tokens = backend.prompt_ids(s.system_prompt, req.context, req.prompt)
        if len(tokens) > s.max_prompt_tokens:
            return QueryResult.failure(f"prompt and context are {len(tokens)} tokens; max_prompt_tokens is "
                                       f"{s.max_prompt_tokens} (nothing is truncated)", req.request_id)
        max_new = self._answer_length(req)
        now = time.time()
        self._refresh(now)
        digest = context_digest(req.context)
        # A sliding-window layer keeps only its window: past it, the cache no longer holds every token's KV.
        poolable = not backend.sliding_window or len(tokens) + max_new <= backend.sliding_window
        lossless = self.lossless_reuse
        t_plan = time.perf_counter()
        plan = reuse_planner.plan(pool, tokens=tokens, scope=req.scope, fingerprint=p.fingerprint,
                                  question=p.question, context_digest=digest,
                                  allow_approximate=req.allow_approximate, settings=s,
                                  semantic_supported=backend.semantic_supported, now=now, use_kv=poolable,
                                  lossless_kv=lossless)
        plan_ms = (time.perf_counter() - t_plan) * 1000
        res = QueryResult(success=True, cache_result=plan.tier, similarity=plan.similarity,
                          prompt_tokens=len(tokens), request_id=req.request_id)
        if plan.tier == CacheResult.ANSWER:  # unverified stored answer (opt-in): approximate
            pool.touch([plan.source_key], now)
            res.answer = plan.answer
            res.reused_tokens = len(tokens)
            res.ttft_ms = res.total_ms = (time.perf_counter() - p.t_arrival) * 1000
            self._log_decision(req, digest, plan, res)
            self._observe(req, plan, plan_ms, 0.0, None)
            return res
        reserve = max_new + s.max_draft_tokens + 2  # room in the KV buffer for the answer and a draft
        logits, cache = self._prefill(plan, tokens, res, reserve)
        # Drafts are checked by the model; they keep the answer exact only on a batch-invariant backend.
        use_drafts = s.enable_drafts and (backend.exact_chunking or req.allow_approximate)
        drafts = self._draft_source(req, tokens, p.fingerprint, now) if use_drafts else None
        gen = backend.decode(logits, cache, max_new, s.temperature, s.seed, t_start=p.t_arrival, drafts=drafts)
        res.answer = gen.text
        res.generated_tokens = len(gen.tokens)
        res.ttft_ms = gen.ttft_s * 1000
        res.draft_tokens_proposed, res.draft_tokens_accepted = gen.draft_proposed, gen.draft_accepted
        res.decode_passes = gen.forward_passes
        res.decode_passes_saved = max(0, gen.plain_passes - gen.forward_passes)
        res.exact = (plan.tier == CacheResult.MISS or (plan.tier == CacheResult.EXACT_PREFIX and lossless)) and \
            (drafts is None or backend.exact_chunking)
        self._remember_answer(req.scope, gen.tokens)
        t_insert = time.perf_counter()
        self._update_pool(p, plan, tokens, cache, digest, res.answer, now, poolable)
        insert_ms = (time.perf_counter() - t_insert) * 1000
        res.total_ms = (time.perf_counter() - p.t_arrival) * 1000
        self._log_decision(req, digest, plan, res)
        self._observe(req, plan, plan_ms, insert_ms, gen.first_logits)
        return res

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

    def _prefill(self, plan: reuse_planner.ReusePlan, tokens: list[int], res: QueryResult, reserve: int):
        """Logits of the last prompt token and the prompt's cache (with room for `reserve` more tokens), built
        as the plan says; counts the reused and recomputed tokens in res."""
        if plan.tier == CacheResult.SEMANTIC:
            s = self.settings
            sp = semantic_reuse.run(self.backend, self.pool, plan, tokens, recompute_ratio=s.recompute_ratio,
                                    gap_recompute_tokens=s.gap_recompute_tokens, strict_layers=s.strict_layers)
            res.reused_tokens, res.recomputed_tokens = sp.reused, sp.recomputed
            return sp.logits, sp.cache
        n = plan.prefix.n_tokens if plan.tier == CacheResult.EXACT_PREFIX else 0
        res.reused_tokens, res.recomputed_tokens = n, len(tokens) - n
        return self._prefill_exact(tokens, plan.prefix if n else None, reserve)

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

    def _update_pool(self, p: Prepared, plan, tokens, cache, digest: str, answer: str, now: float,
                     poolable: bool) -> None:
        """Exact KV only: a repaired SEMANTIC cache is approximate and would poison exact reuse, so its exact
        KV is computed at idle time (idle_work) and the next request on that context is an EXACT_PREFIX hit."""
        req = p.req
        if plan.source_key is not None:
            self.pool.touch([plan.source_key], now)
        if not poolable:
            return
        if plan.tier == CacheResult.SEMANTIC:
            self.pending_inserts.append(PendingInsert(req.scope, tokens, p.fingerprint, p.question, digest, answer))
        elif plan.tier in (CacheResult.MISS, CacheResult.EXACT_PREFIX):
            key = self._pool_exact(req.scope, tokens, cache, p.fingerprint, p.question, digest, answer, now)
            if key is None:
                self.log.warning(f"request {req.request_id!r}: {len(tokens)} tokens do not fit in the KV pool budget")

    def _observe(self, req: QueryRequest, plan, plan_ms: float, insert_ms: float, first_logits) -> None:
        if self.observer is not None:
            self.observer(Observation(req.request_id, plan, plan_ms, plan.match_ms, insert_ms, first_logits))

    @property
    def lossless_reuse(self) -> bool:
        """Stored KV reused gives bitwise what a full prefill gives: stored at the model's own precision,
        on a backend whose results do not depend on how a sequence is cut into passes."""
        b = self.backend
        return b is not None and b.exact_chunking and self.pool.store_dtype == b.dtype

    def _draft_source(self, req: QueryRequest, tokens: list[int], fingerprint, now: float) -> DraftProposer:
        """Drafts for this request: answers of the same prompt and of similar tasks in its scope (most
        similar first), the scope's recent answers, and the prompt itself."""
        s, pool = self.settings, self.pool
        answers = []
        same = pool.find(req.scope, tokens)
        if same is not None and same.answer:
            answers.append(same.answer)
        for m in pool.best_matches(fingerprint, req.scope, now, k=4, recency_weight=0.0,
                                   half_life_s=s.recency_half_life_s):
            if m.cosine >= s.draft_min_similarity and m.entry.answer and m.entry.answer not in answers:
                answers.append(m.entry.answer)
        return DraftProposer(answers=[self._answer_ids(a) for a in answers],
                             history=list(self._recent_answers.get(req.scope, ())),
                             prompt=tokens, max_tokens=s.max_draft_tokens)

    def _answer_ids(self, text: str) -> list[int]:
        ids = self._answer_tokens.get(text)
        if ids is None:
            ids = self.backend.tokenize_answer(text)
            self._answer_tokens[text] = ids
            if len(self._answer_tokens) > 512:
                self._answer_tokens.popitem(last=False)
        return ids

    def _remember_answer(self, scope: str, tokens: list[int]) -> None:
        if tokens:
            self._recent_answers.setdefault(scope, collections.deque(maxlen=16)).append(list(tokens))
            if len(self._recent_answers) > 256:  # scopes are caller-chosen: keep the table bounded
                self._recent_answers.pop(next(iter(self._recent_answers)))

    def has_idle_work(self) -> bool:
        return self.pool is not None and bool(self.pending_inserts) and self.thermal_level == ThermalLevel.OK

    def idle_work(self) -> bool:
        """Compute and pool the exact KV of one prompt that SEMANTIC reuse served; returns whether it did.
        Skipped while running hot. Called by the request server's worker when no request waits."""
        with self._exec_lock:
            if not self.has_idle_work():
                return False
            job = self.pending_inserts.popleft()
            if self.pool.find(job.scope, job.tokens) is not None:
                return False
            try:
                # Built on the longest pooled prefix, exactly as an EXACT_PREFIX request's KV is.
                prefix = self.pool.longest_prefix(job.scope, job.tokens, len(job.tokens) - 1)
                _, cache = self._prefill_exact(job.tokens, prefix)
                self._pool_exact(job.scope, job.tokens, cache, job.fingerprint, job.question, job.context_digest,
                                 job.answer)
            except Exception:
                self.log.exception("idle-time exact prefill failed")
                return False
            return True

    def _log_decision(self, req, digest, plan, res) -> None:
        if self.semantic_log is None:
            return
        self.semantic_log.write({
            "request_id": req.request_id, "scope": req.scope, "question": req.prompt[:200],
            "context_digest": digest, "tier": CacheResult(plan.tier).name, "similarity": round(plan.similarity, 4),
            "source_key": plan.source_key, "source_question": plan.source_question[:200],
            "reason": plan.reason, "prompt_tokens": res.prompt_tokens, "reused_tokens": res.reused_tokens,
            "recomputed_tokens": res.recomputed_tokens, "ttft_ms": round(res.ttft_ms, 2)})

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
