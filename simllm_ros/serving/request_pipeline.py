"""One request through the pipeline, alone or in a batch: plan -> prefill -> decode -> conclude.

`plan_flight` turns a prepared request (its fingerprint on the way) into the result at once (an identical
request's stored answer, the ANSWER tier, a refusal) or a `Flight`: the match and the reuse plan, the error bound's
word on an approximate plan, and the room its KV buffer needs. `prefill_flight` builds the prompt's cache as the
plan says (exact prefix, SEMANTIC repair, or a whole prefill), `start_decoding` adds what needed the fingerprint
(drafts, the reported similarity) and picks the first token, and `conclude` turns the generation into the result
and lets the pool, the memo, the fleet and the error bound learn from it (request_memory). These four, typed by
the Flight record, are the phases batching.py runs for several requests in one forward pass (with
`memo_answer_for`, the memo's answer to a flight whose identical twin was just answered); `execute` runs them
in a row for one request alone. RequestPipeline holds what the phases keep between requests (the early passes run,
the observer); the engine owns one and hands it its memory (request_memory), its answer memo and its audit queue,
and it reads the model, pool and settings of the current load through `core` (engine_parts.EngineCore).
"""
from __future__ import annotations

import collections
import dataclasses
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from . import approx_gate, fleet_checks, semantic_reuse
from ..kernels import compute_threads
from ..cache import reuse_planner
from ..cache.answer_memo import AnswerMemo, Memo, Signature
from ..model.decoding import Generation
from ..cache.fingerprint import context_digest
from ..cache.kv_pool import PrefixHit
from ..request import CANCELLED_ERROR, CacheResult, Progress, QueryRequest, QueryResult
from ..cache.semantic_log import request_record
from .engine_parts import Asked, EngineCore, Flight, Prepared
from .request_memory import RequestMemory
from .streaming import AnswerWatcher
from .thermal import ThermalLevel


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


@dataclasses.dataclass(frozen=True)
class AuditCase:
    """An approximate decision a request hands over to be checked at idle time (approx_gate.audit): what it
    served, the plan behind it (served_exact: the approximate plan the error bound turned down), and what computing
    the other side again takes."""

    p: Prepared
    tokens: list[int]
    digest: str  # task_digest(p.req)
    tier: str  # the approximate tier the label is for (approx_gate.TIER_NAMES)
    served_exact: bool  # True: the exact answer was served, the plan was turned down
    served: str  # the answer the request got
    plan: reuse_planner.ReusePlan
    max_new: int
    temperature: float
    seed: int
    delta: float  # the approx_error_bound the request was served under


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


def prefill_exact(backend, tokens: list[int], prefix: PrefixHit | None, reserve: int = 0) -> tuple[torch.Tensor, Any]:
    """Exact prefill, on top of a pooled prefix's KV when there is one (requests, idle work and the idle-time
    audits alike: approx_gate.AuditHost): the last token's logits and the cache, with room for `reserve`."""
    if prefix is None:
        return backend.prefill(tokens, reserve=reserve)
    cache = backend.cache_from_tensors(prefix.k, prefix.v, reserve=len(tokens) - prefix.n_tokens + reserve)
    return backend.prefill(tokens[prefix.n_tokens:], cache)


class RequestPipeline:
    """The phases of one request (see the module docstring): plan_flight, prefill_flight, start_decoding and
    conclude, the interface batching.py runs its flights through, and execute, the four in a row."""

    def __init__(self, core: EngineCore, memory: RequestMemory, memo: AnswerMemo,
                 audits: collections.deque[approx_gate.Audit]):
        self.core = core
        self.memory = memory
        self.memo = memo  # finished answers of identical requests (answer_memo)
        self.audits = audits  # approximate decisions to check at idle time (approx_gate.audit)
        self._last_refresh = 0.0
        # Early passes run while a fingerprint was computed (see _early_start): how many, and how many a SEMANTIC
        # plan then used.
        self.early_starts = 0
        self.early_starts_used = 0
        # Called with an Observation after every executed request (the benchmark's hook); None: nobody.
        self.observer: Callable[[Observation], None] | None = None

    def execute(self, p: Prepared, on_progress: Callable[[Progress], None] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> QueryResult:
        f = self.plan_flight(p, on_progress, should_stop)
        if isinstance(f, QueryResult):
            return f
        logits = self.prefill_flight(f)
        self._after_prefill(f)
        a = f.asked
        gen = self.core.loaded_backend().decode(logits, f.cache, a.max_new, a.temperature, a.seed,
                                                t_start=p.t_arrival, drafts=f.drafts, on_token=f.on_token,
                                                should_stop=f.watch.should_stop, constraint=a.constraint,
                                                on_pass=self.core.observe_pass)
        return self.conclude(f, gen)

    def plan_flight(self, p: Prepared, on_progress: Callable[[Progress], None] | None = None,
                    should_stop: Callable[[], bool] | None = None) -> QueryResult | Flight:
        """A request's first phase: its prompt tokens and reuse plan; the result at once for the ANSWER tier
        or a refusal, else a Flight whose prefill and decoding are still to run."""
        s, req, backend, pool = self.core.settings, p.req, self.core.loaded_backend(), self.core.loaded_pool()
        tokens = backend.chat_ids(s.system_prompt, req.context, req.turns(),
                                  tools=req.tool_template.tools if req.tool_template else None)
        if len(tokens) > s.max_prompt_tokens:
            return QueryResult.failure(f"prompt and context are {len(tokens)} tokens; max_prompt_tokens is "
                                       f"{s.max_prompt_tokens} (nothing is truncated)", req.request_id)
        max_new = self._answer_length(req)
        limit = getattr(backend, "max_positions", None)
        if limit and len(tokens) + max_new > limit:
            why = ("the model's longest context" if getattr(backend, "long_rope", False) else
                   "LongRoPE's short factors, chosen at configure for max_prompt_tokens + max_new_tokens_limit "
                   f"{getattr(backend, 'context_length', 0)}; configure with more for the long ones")
            return QueryResult.failure(f"prompt and context are {len(tokens)} tokens and the answer up to {max_new}: "
                                       f"past the {limit} positions this model runs at ({why}; nothing is truncated)",
                                       req.request_id)
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
        lossless = self.core.lossless_reuse
        # Room in the KV buffer for the answer and a draft, the buffer sized in steps of KV_SLOT_STEP slots: the
        # pool keeps it as the live prefix, and the next question on that context (a few tokens longer) fits.
        reserve = -(-(len(tokens) + max_new + s.max_draft_tokens + 2) // KV_SLOT_STEP) * KV_SLOT_STEP - len(tokens)
        # A lossless plan (exact prefix or miss) does not use the fingerprint: the plan and the prefill go ahead
        # while it is computed, and what needs it (drafts, reported similarity, pool update) comes after.
        defer = not req.allow_approximate
        early, prefix = self._early_start(p, tokens, poolable, lossless, reserve)
        fleet_answer = None
        if self.core.fleet is not None:
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
            keep, _, est = approx_gate.gate(self.core.error_bound, plan, req.scope, pool.task_id(plan.source_key),
                                            delta)
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
            if plan.source_key is not None:
                pool.touch([plan.source_key], now)
            res.answer = plan.answer
            res.reused_tokens = len(tokens)
            res.ttft_ms = res.total_ms = (time.perf_counter() - p.t_arrival) * 1000
            if on_progress is not None:
                AnswerWatcher(backend.detokenize, on_progress=on_progress,
                              cache_result=plan.tier).progress(res.answer, 0)
            self._audit_later(AuditCase(p, tokens, digest, "answer", served_exact=False, served=res.answer, plan=plan,
                                        max_new=max_new, temperature=temperature, seed=seed, delta=delta))
            self._log_decision(req, digest, plan, res)
            self._observe(req, plan, plan_ms, 0.0, None)
            return res
        # Drafts are checked by the model; they keep the answer exact only on a batch-invariant backend.
        use_drafts = s.enable_drafts and (backend.exact_chunking or req.allow_approximate)
        watch = AnswerWatcher(backend.detokenize, stop=req.stop, on_progress=on_progress, cancelled=should_stop,
                              cache_result=plan.tier)
        asked = Asked(max_new, temperature, seed, streaming=on_progress is not None,
                      constraint=p.schema.constraint() if p.schema is not None else None, delta=delta)
        return Flight(p, plan, tokens, res, digest, now, poolable, lossless, plan_ms, asked,
                      reserve=reserve, early=early, use_drafts=use_drafts, similarity_pending=defer, watch=watch,
                      on_token=watch.on_token if (req.stop or on_progress) else None, fleet_answer=fleet_answer,
                      refused=refused)

    def _answer_length(self, req: QueryRequest) -> int:
        """Tokens to generate: the request's, or the default; at most half the default while running hot."""
        s = self.core.settings
        max_new = req.max_new_tokens or s.max_new_tokens
        if self.core.thermal_level >= ThermalLevel.WARN:
            max_new = max(1, min(max_new, s.max_new_tokens // 2))
        return max_new

    def _refresh(self, now: float) -> None:
        """Drop entries older than refresh_period_s (their KV or answer may be stale), at most once a second."""
        period = self.core.settings.refresh_period_s
        if period > 0 and now - self._last_refresh > 1.0:
            self.core.loaded_pool().drop_older_than(period, now)
            self._last_refresh = now

    def memo_answer_for(self, f: Flight) -> QueryResult | None:
        """The answer memo's answer to a flight not yet prefilled (batching: an identical request in flight before
        it has just been answered), exactly as plan_flight would have served it; None where the memo has none."""
        req, a = f.p.req, f.asked
        return self._memo_answer(f.p, f.tokens, a.max_new, Signature.of(a.temperature, a.seed, req.stop,
                                                                       req.json_schema), time.time(), None)

    def _memo_answer(self, p: Prepared, tokens: list[int], max_new: int, signature: Signature, now: float,
                     on_progress: Callable[[Progress], None] | None) -> QueryResult | None:
        """An identical request's stored answer (answer_memo), exact: no prefill, no decode pass. None if there
        is none for these tokens, this signature and max_new_tokens, or the backend is not batch-invariant."""
        req = p.req
        if not (self.core.settings.answer_memo and self.core.loaded_backend().exact_chunking) or not len(self.memo):
            return None
        same = self.core.loaded_pool().find(req.scope, tokens)
        if same is None or not same.answer:
            return None
        served = self.memo.answer(same.key, same.answer, signature, max_new, self.core.loaded_backend().detokenize)
        if served is None:
            return None
        self.core.loaded_pool().touch([same.key], now)
        res = QueryResult(success=True, cache_result=CacheResult.EXACT_PREFIX, similarity=1.0,
                          prompt_tokens=len(tokens), request_id=req.request_id, answer=served.text,
                          reused_tokens=len(tokens), generated_tokens=served.tokens, stop_reason=served.stop_reason,
                          exact=True)
        if on_progress is not None:
            AnswerWatcher(self.core.loaded_backend().detokenize, on_progress=on_progress,
                          cache_result=CacheResult.EXACT_PREFIX).progress(res.answer, served.tokens)
        res.ttft_ms = res.total_ms = (time.perf_counter() - p.t_arrival) * 1000
        self._log_decision(req, task_digest(req), MemoPlan(same.key, req.question), res)
        if self.core.fleet is not None and not self.core.warming:
            self.core.fleet.publish(req.scope, tokens, answer_ids=None, question="", task=request_record(req),
                               read_kv=None)
        return res

    def _early_start(self, p: Prepared, tokens: list[int], poolable: bool, lossless: bool, reserve: int
                     ) -> tuple["semantic_reuse.Ahead | None", "PrefixHit | None | object"]:
        """The early pass of a possible SEMANTIC plan, run while the question's fingerprint is still computed.

        A SEMANTIC plan needs the fingerprint (to find the similar task), and its repair begins with an early
        pass over the prompt that needs only the tokens. A new question's fingerprint takes the embedder a while
        on its own thread, during which the model's thread would wait: it runs the early pass then, on this
        thread alone (the fingerprint keeps the other cores: a dropped pass would cost a miss on both), and reads
        the entry the repair will most likely take; a SEMANTIC plan takes both up, any other plan drops them. Only
        where a SEMANTIC plan can follow and is worth a head start: approximate reuse allowed and possible, the scope
        holds a prefix of this prompt, and the prompt runs on for at least min_semantic_tokens after it (a new
        question on a cached context leaves a few tokens, cheap to compute: there the pass ahead is spent for
        nothing; benchmark/results/reuse_quality.md has the figures). The pass starts after that prefix
        where the prefix's KV is bitwise what a pass computes (lossless), so that it gives the bits the repair's
        own early pass would. Returns it and the prefix read (for the planner, which would read it anyway), or
        (None, reuse_planner.UNREAD). A fault here only costs the head start: the repair then runs its own."""
        s, req, pool, backend = self.core.settings, p.req, self.core.loaded_pool(), self.core.loaded_backend()
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
        except Exception as e:  # speculative work: the plan goes on without it
            self.core.log.warning("early pass ahead failed (%s: %s); the repair runs its own", type(e).__name__, e)
            return None, prefix
        self.early_starts += 1
        return early, prefix

    def _fleet_lookup(self, scope: str, tokens: list[int], prefix, reserve: int, want_kv: bool):
        """(The longer of this pool's exact prefix and the fleet's, where fetching beats prefilling; another
        node's answer to this prompt, a draft, or None)."""
        fleet = self.core.fleet
        if fleet is None:
            return prefix, None
        if want_kv and prefix is reuse_planner.UNREAD:
            prefix = self.core.loaded_pool().longest_prefix(scope, tokens, len(tokens) - 1, len(tokens) + reserve)
        have = prefix.n_tokens if want_kv and prefix else 0
        got, answer = fleet.lookup(scope, tokens, have=have, limit=len(tokens) - 1, capacity=len(tokens) + reserve,
                                   prefill_s_per_token=self.core.prefill_s_per_token, want_kv=want_kv)
        if got is not None and fleet.should_verify():  # one robot's fault must not spread as exact
            try:
                why = fleet_checks.prefix_differs(self.core.loaded_backend(), tokens, got)
            except Exception as e:  # unverifiable: not used
                why = f"recompute failed: {type(e).__name__}: {e}"
            fleet.counters.kv_verified += 1
            if why:
                fleet.distrust(got, why)
                got = None
        return (got or prefix), answer

    def prefill_flight(self, f: Flight) -> torch.Tensor:
        """The prompt's cache built whole as the flight's plan says, into f.cache (with room for f.reserve more
        tokens); counts the reused and recomputed tokens in f.res; returns the last prompt token's logits. f.early:
        see _early_start."""
        plan, tokens, res = f.plan, f.tokens, f.res
        if plan.tier == CacheResult.SEMANTIC:
            s = self.core.settings
            sp = semantic_reuse.run(self.core.loaded_backend(), self.core.loaded_pool(), plan, tokens,
                                    recompute_ratio=s.recompute_ratio, gap_recompute_tokens=s.gap_recompute_tokens,
                                    strict_layers=s.strict_layers, reserve=f.reserve,
                                    lossless_kv=self.core.lossless_reuse, early=f.early)
            self.early_starts_used += f.early is not None
            res.reused_tokens, res.recomputed_tokens = sp.reused, sp.recomputed
            f.cache = sp.cache
            return sp.logits
        n = plan.prefix.n_tokens if plan.tier == CacheResult.EXACT_PREFIX and plan.prefix is not None else 0
        res.reused_tokens, res.recomputed_tokens = n, len(tokens) - n
        logits, f.cache = prefill_exact(self.core.loaded_backend(), tokens, plan.prefix if n else None, f.reserve)
        return logits

    def _after_prefill(self, f: Flight) -> None:
        """What needs the fingerprint, which had the plan and prefill's time to arrive: the drafts (answers of
        similar tasks) and, for a plan made without it, the reported similarity (the most similar task of the
        scope now, ranked as the planner ranks)."""
        fp = f.p.fingerprint
        if f.similarity_pending:
            best = reuse_planner.ranked_matches(self.core.loaded_pool(), fp, f.p.req.scope, f.now, self.core.settings,
                                                k=1)
            f.plan.similarity = f.res.similarity = reuse_planner.reported_similarity(best[0].cosine) if best else 0.0
            f.similarity_pending = False
        if f.use_drafts and f.drafts is None:
            f.drafts = self.memory.draft_source(f.p.req, f.tokens, fp, f.now, f.fleet_answer)
        if self._labels_from(f) and f.plan.tier != CacheResult.SEMANTIC:  # a SEMANTIC answer is not the model's own
            f.candidate = approx_gate.answer_candidate(self.core.loaded_pool(), fp, f.p.req.scope, f.tokens, f.now,
                                                       self.core.settings)

    def start_decoding(self, f: Flight, logits: torch.Tensor) -> QueryResult | None:
        """The prompt is in the cache: pick the first token (TTFT); the result if that already ends the answer."""
        self._after_prefill(f)
        a = f.asked
        f.decoder = self.core.loaded_backend().decoder(logits, a.max_new, a.temperature, a.seed,
                                                       t_start=f.p.t_arrival, drafts=f.drafts, on_token=f.on_token,
                                                       should_stop=f.watch.should_stop, constraint=a.constraint)
        if f.decoder.done:
            f.decoder.gen.text = self.core.loaded_backend().detokenize(f.decoder.gen.tokens)
            return self.conclude(f, f.decoder.gen)
        return None

    def conclude(self, f: Flight, gen: Generation) -> QueryResult:
        """A request's last phase: its result from the generation; the pool learns the prompt's KV."""
        req, res, backend, watch, a = f.p.req, f.res, self.core.loaded_backend(), f.watch, f.asked
        res.answer = watch.final_text(gen.text)
        if res.answer == gen.text and gen.tokens:  # the ids the model chose: a draft of this answer re-tokenized
            self.memory.keep_answer_ids(res.answer, list(gen.tokens))  # from its text may differ (token boundaries)
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
        elif a.constraint is not None and not a.constraint.is_terminated():
            res.success, finished = False, False
            res.error = ("json_schema: a stop string ended the answer before the JSON was complete; drop that stop "
                         "string for JSON answers" if watch.stop_hit else
                         f"json_schema: the answer reached max_new_tokens ({a.max_new}) before the JSON was "
                         "complete; raise max_new_tokens or simplify the schema")
        elif f.p.schema is not None and (bad := f.p.schema.answer_error(res.answer)) is not None:
            # the last line: the grammar should make this impossible; never report such an answer a success
            res.success, finished = False, False
            res.error = f"json_schema: {bad}"
            self.core.log.warning(f"request {req.request_id!r}: a constrained answer failed its schema: {bad}")
        if a.streaming:
            watch.progress(res.answer, len(gen.tokens))  # the last word, whatever the throttle held back
        if finished:
            self.memory.remember_answer(req.scope, gen.tokens)
        t_insert = time.perf_counter()
        self.memory.update_pool(f.p, f.plan, f.tokens, f.cache, f.digest, res.answer if finished else None, f.now,
                          f.poolable)
        if finished and res.success and res.exact and backend.exact_chunking and self.core.settings.answer_memo:
            same = self.core.loaded_pool().find(req.scope, f.tokens)  # the entry that now holds this answer
            if same is not None and same.answer == res.answer:
                self.memo.remember(same.key, Memo(Signature.of(a.temperature, a.seed, req.stop, req.json_schema),
                                                  res.answer, tuple(gen.tokens), res.stop_reason))
        if self.core.fleet is not None and finished and res.success:
            self.memory.publish(f, gen, exact=res.exact)
        if finished and res.success and self._labels_from(f):
            if f.candidate is not None and res.exact:  # would the most similar task's stored answer have been right?
                approx_gate.label(self.core.error_bound, req.scope, f.candidate, res.answer)
            if f.refused is not None and f.refused.tier == CacheResult.SEMANTIC and res.exact:
                self._audit_later(AuditCase(f.p, f.tokens, f.digest, "semantic", served_exact=True, served=res.answer,
                                            plan=f.refused, max_new=a.max_new, temperature=a.temperature, seed=a.seed,
                                            delta=a.delta))
            elif f.plan.tier == CacheResult.SEMANTIC:
                self._audit_later(AuditCase(f.p, f.tokens, f.digest, "semantic", served_exact=False, served=res.answer,
                                            plan=f.plan, max_new=a.max_new, temperature=a.temperature, seed=a.seed,
                                            delta=a.delta))
        self.memory.keep_live(f)
        insert_ms = (time.perf_counter() - t_insert) * 1000
        res.total_ms = (time.perf_counter() - f.p.t_arrival) * 1000
        self._log_decision(req, f.digest, f.plan, res)
        self._observe(req, f.plan, f.plan_ms, insert_ms, gen.first_logits)
        return res

    @staticmethod
    def _labels_from(f: Flight) -> bool:
        """Whether this request's answer can label a tier (labels come from everyone's traffic)."""
        return approx_gate.comparable(f.p.req, f.asked.temperature)

    def _audit_later(self, case: AuditCase) -> None:
        """An approximate decision to check at idle time (approx_gate.audit), where a bound was asked."""
        p, plan = case.p, case.plan
        if case.delta >= 1.0 or not approx_gate.comparable(p.req, case.temperature):
            return
        self.audits.append(approx_gate.Audit(
            tier=case.tier, served_exact=case.served_exact, scope=p.req.scope, tokens=list(case.tokens),
            fingerprint=p.fingerprint, question=p.question, context_digest=case.digest, served=case.served,
            max_new=case.max_new, temperature=case.temperature, seed=case.seed,
            source_task=self.core.loaded_pool().task_id(plan.source_key), similarity=plan.similarity,
            plan=plan if case.served_exact else None))

    def _observe(self, req: QueryRequest, plan, plan_ms: float, insert_ms: float, first_logits) -> None:
        if self.observer is not None:
            self.observer(Observation(req.request_id, plan, plan_ms, plan.match_ms, insert_ms, first_logits))

    def _log_decision(self, req, digest, plan, res) -> None:
        """One JSON line per answered request (a memo hit too: warmup_queries counts the tasks asked most)."""
        semantic_log = self.core.semantic_log
        if semantic_log is None:
            return
        semantic_log.write({
            "request_id": req.request_id, "scope": req.scope, "question": req.question[:200],
            "context_digest": digest, "tier": CacheResult(plan.tier).name, "similarity": round(plan.similarity, 4),
            "source_key": plan.source_key, "source_question": plan.source_question[:200],
            "reason": plan.reason, "prompt_tokens": res.prompt_tokens, "reused_tokens": res.reused_tokens,
            "recomputed_tokens": res.recomputed_tokens, "ttft_ms": round(res.ttft_ms, 2),
            # the request itself, so that warmup_queries: N can replay the most-used tasks
            **request_record(req),
            **({"warmup": True} if self.core.warming else {})})
