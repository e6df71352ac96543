"""Where the engine asks the error bound before serving an approximate answer, and where it gets its labels.

- gate(): a plan of an approximate tier (ANSWER, SEMANTIC) is kept only where the bound allows it for the
  request's δ; otherwise, or when the draw says explore, the request is planned again lossless.
- answer_candidate(): on every lossless request, the scope's most similar other task with a stored answer;
  when the request ends, label(): would serving that answer have given the model's own? (free: the model
  computed its answer anyway).
- Audits, run when the engine is idle (audit()): an approximate answer that was served is checked against the
  exact answer (prefill + decode of the same request), and a would-be SEMANTIC hit that was verified instead
  is run through SEMANTIC reuse and compared with the exact answer it got.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Protocol

import numpy as np
import torch

from ..cache import reuse_planner
from . import semantic_reuse
from ..cache.error_bound import NO_DATA, ErrorBound, Estimate
from ..cache.kv_pool import KVPool, PrefixHit, task_id
from ..model.model_backend import ModelBackend
from ..request import CacheResult
from ..settings import Settings

TIER_NAMES = {CacheResult.ANSWER: "answer", CacheResult.SEMANTIC: "semantic"}
LABEL_MIN_SIMILARITY = 0.5  # candidates less similar than this are too far for any tier to consider
AUDITS_MAX = 64


@dataclasses.dataclass
class Candidate:
    """The stored answer the ANSWER tier would have considered for a request."""
    task: str  # kv_pool.task_id
    similarity: float
    answer: str


@dataclasses.dataclass
class Audit:
    """An answer to check at idle time: `served` is what the request got; the audit computes the other side
    (the exact answer when an approximate one was served; the SEMANTIC answer when the exact one was)."""
    tier: str  # the approximate tier the label is for
    served_exact: bool  # True: the exact answer was served (compute the SEMANTIC one)
    scope: str
    tokens: list[int]
    fingerprint: np.ndarray
    question: str
    context_digest: str
    served: str
    max_new: int
    temperature: float
    seed: int
    source_task: str  # kv_pool.task_id of the reused task
    similarity: float
    plan: reuse_planner.ReusePlan | None = None  # the SEMANTIC plan turned down (served_exact), run again as made


class AuditHost(Protocol):
    """What an idle-time audit needs of its engine (engine.Engine is one): the model and pool it runs on, the
    settings of a SEMANTIC repair, the bound it teaches, and an exact prefill built as a request's is."""

    @property
    def backend(self) -> ModelBackend | None: ...

    @property
    def pool(self) -> KVPool | None: ...

    @property
    def settings(self) -> Settings: ...

    @property
    def error_bound(self) -> ErrorBound: ...

    @property
    def log(self) -> logging.Logger: ...

    @property
    def lossless_reuse(self) -> bool: ...

    def prefill_exact(self, tokens: list[int], prefix: PrefixHit | None, reserve: int = 0
                      ) -> tuple[torch.Tensor, Any]: ...


def comparable(req, temperature: float) -> bool:
    """Whether an answer to this request can be compared with another's: plain greedy text (stop strings, a
    schema or sampling make answers that another request's settings would not reproduce)."""
    return temperature == 0 and not req.stop and not req.json_schema


def request_bound(req_bound: float, node_bound: float) -> float:
    """The δ a request is served under: its own (approx_error_bound >= 0), else the node's."""
    return node_bound if req_bound is None or req_bound < 0 else float(req_bound)


def gate(bound: ErrorBound, plan, scope: str, task: str, delta: float) -> tuple[bool, bool, Estimate]:
    """(keep the approximate plan, explored, the estimate it was judged on). δ >= 1: no promise asked, kept
    as planned (the fixed thresholds alone); δ == 0: never."""
    tier = TIER_NAMES[CacheResult(plan.tier)]
    if delta >= 1.0:
        return True, False, NO_DATA
    est = bound.estimate(tier, scope, task, plan.similarity)
    if not est.allows(delta):
        return False, False, est
    if bound.explore():
        bound.explored[tier, scope] += 1
        return False, True, est
    bound.served[tier, scope] += 1
    return True, False, est


def answer_candidate(pool, fingerprint, scope: str, tokens: list[int], now: float, settings) -> Candidate | None:
    """The scope's most similar other task that holds an answer (what the ANSWER tier would look at)."""
    for m in reuse_planner.ranked_matches(pool, fingerprint, scope, now, settings, k=3):
        e = m.entry
        if e.answer and tuple(e.tokens) != tuple(tokens) and m.cosine >= LABEL_MIN_SIMILARITY:
            return Candidate(task_id(e.scope, e.tokens), float(m.cosine), e.answer)
    return None


def label(bound: ErrorBound, scope: str, cand: Candidate, answer: str) -> None:
    bound.record("answer", scope, cand.task, cand.similarity, cand.answer != answer)


def audit(engine: AuditHost, job: Audit) -> bool:
    """Compute the other side of one audit and record its label; returns whether a label was recorded."""
    backend, pool, s = engine.backend, engine.pool, engine.settings
    if backend is None or pool is None:
        return False  # not loaded: nothing to run the audit on
    if job.served_exact:
        plan = job.plan
        if plan is None or pool.task_id(plan.source_key) != job.source_task:
            return False  # the source task is gone (evicted, refreshed)
        sp = semantic_reuse.run(backend, pool, plan, job.tokens, recompute_ratio=s.recompute_ratio,
                                gap_recompute_tokens=s.gap_recompute_tokens, strict_layers=s.strict_layers,
                                reserve=job.max_new + 2, lossless_kv=engine.lossless_reuse)
        other = backend.decode(sp.logits, sp.cache, job.max_new, job.temperature, job.seed).text
        task, sim = pool.task_id(plan.source_key), plan.similarity
    else:  # the exact answer, on the pool's exact prefix where reusing it is lossless (the pending insert put it there)
        n = len(job.tokens)
        prefix = pool.longest_prefix(job.scope, job.tokens, n - 1, n + job.max_new + 2) if engine.lossless_reuse \
            else None
        logits, cache = engine.prefill_exact(job.tokens, prefix, reserve=job.max_new + 2)
        other = backend.decode(logits, cache, job.max_new, job.temperature, job.seed).text
        task, sim = job.source_task, job.similarity
    wrong = other != job.served
    engine.error_bound.record(job.tier, job.scope, task, sim, wrong)
    if wrong and not job.served_exact:
        engine.log.warning(f"a {job.tier.upper()} answer served in scope {job.scope!r} at similarity {sim:.3f} "
                           "differed from the model's own (idle-time check): "
                           "that task is not served at this similarity again")
    return True
