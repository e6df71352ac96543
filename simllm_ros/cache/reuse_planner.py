"""Decides how much of a request can come from the pool, and how: ANSWER, SEMANTIC, EXACT_PREFIX or MISS.

The planner only reads the pool and returns a plan with the reason for it;
running the plan is the engine's job. Choice, best first:
- ANSWER: a stored answer, only under a stricter threshold, the same context
  digest, a fresh entry and the answer guard (negations, numbers, entities).
- SEMANTIC: the best-aligned similar entry's KV for all matching token runs,
  when that leaves clearly less to compute than the exact prefix does.
- EXACT_PREFIX: the longest cached token prefix (lossless at kv_bits >= the model's).
- MISS.
"""
from __future__ import annotations

import dataclasses
import time
from typing import cast

try:  # difflib's algorithm in C: the same matching blocks (test_reuse_planner checks), faster
    from cydifflib import SequenceMatcher
except ImportError:  # a platform without its wheel: the standard library's, slower
    from difflib import SequenceMatcher

from . import answer_guard
from .kv_pool import KVPool, PrefixHit
from ..request import CacheResult

MIN_RUN_TOKENS = 4  # shorter aligned runs are coincidences (a shared 'the'), their KV saw another context
SEMANTIC_GAIN = 0.8  # SEMANTIC must leave at most this share of what EXACT_PREFIX would compute
UNREAD = object()  # plan(prefix=...): the caller has not read the longest prefix (the planner reads it)


@dataclasses.dataclass
class ReusePlan:
    tier: CacheResult
    reason: str
    # Cosine of the prompt to the reused task (ANSWER, SEMANTIC) or to the most similar task of the
    # scope (EXACT_PREFIX, MISS), in 0..1; 0.0 when the scope has no task. Query.srv says the same.
    similarity: float = 0.0
    source_key: int | None = None
    prefix: PrefixHit | None = None
    # SEMANTIC: aligned (new position, source position) pairs, and how many leading ones are an exact prefix
    pairs: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    exact_lead: int = 0
    answer: str = ""
    source_question: str = ""
    match_ms: float = 0.0  # time spent in the matcher (the benchmark reports it)


def reported_similarity(cos: float) -> float:
    """Query.srv's `similarity`: the cosine clipped to 0..1 (float error can leave it just outside)."""
    return min(max(float(cos), 0.0), 1.0)


def align(source: list[int], target: list[int], limit: int) -> list[tuple[int, int]]:
    """(target position, source position) of tokens in matching runs of at least MIN_RUN_TOKENS,
    never including target positions >= limit."""
    sm = SequenceMatcher(None, source, target, autojunk=False)
    pairs = []
    for a, b, size in sm.get_matching_blocks():
        if size < MIN_RUN_TOKENS:
            continue
        for i in range(size):
            if b + i < limit:
                pairs.append((b + i, a + i))
    return pairs


def ranked_matches(pool: KVPool, fingerprint, scope: str, now: float, settings, k: int = 4) -> list:
    """The scope's most similar tasks, ranked as the planner ranks them (cosine, weighted toward recent)."""
    return pool.best_matches(fingerprint, scope, now, k=k, recency_weight=settings.recency_weight,
                             half_life_s=settings.recency_half_life_s)


def plan(pool: KVPool, *, tokens: list[int], scope: str, fingerprint, question: str, context_digest: str,
         allow_approximate: bool, settings, semantic_supported: bool, now: float, use_kv: bool = True,
         lossless_kv: bool | None = None, kv_capacity: int = 0, prefix: PrefixHit | None | object = UNREAD
         ) -> ReusePlan:
    """fingerprint None: a lossless plan made without matching (the caller forbids approximate reuse); its
    similarity is then 0.0 and the engine reports it later. lossless_kv: whether reusing stored KV gives bitwise
    the KV a full prefill would (the engine knows: stored at the model's precision, on a batch-invariant
    backend). kv_capacity: token slots the request will need (prompt, answer, draft); an exact prefix is read
    into a buffer that size, copied once. prefix: pool.longest_prefix(scope, tokens, len(tokens) - 1, kv_capacity)
    where the caller has read it already (a read hands the pool's live prefix out once)."""
    s = settings
    if lossless_kv is None:
        lossless_kv = pool.kv_bits >= 16
    limit = len(tokens) - 1  # the last prompt token is always computed: its logits start the answer
    t_match = time.perf_counter()
    candidates = [] if fingerprint is None else ranked_matches(pool, fingerprint, scope, now, s)
    match_ms = (time.perf_counter() - t_match) * 1000
    best_cos = candidates[0].cosine if candidates else 0.0

    # --- tier 3: ANSWER
    if s.enable_answer_cache and allow_approximate:
        for m in candidates:
            key, cos, e = m.key, m.cosine, m.entry
            if cos < s.answer_threshold:
                break
            if not e.answer or e.context_digest != context_digest or now - e.created > s.answer_max_age_s:
                continue
            ok, why = answer_guard.answers_compatible(question, e.question)
            if ok:
                return ReusePlan(CacheResult.ANSWER, f"answer of a task with cosine {cos:.3f}, same context",
                                 reported_similarity(cos), key, answer=e.answer, source_question=e.question,
                                 match_ms=match_ms)

    # --- tier 1 candidate: EXACT_PREFIX
    if not (use_kv and (allow_approximate or lossless_kv)):
        prefix = None
    elif prefix is UNREAD:
        prefix = pool.longest_prefix(scope, tokens, limit, kv_capacity)
    prefix = cast("PrefixHit | None", prefix)  # UNREAD is read by now
    n_exact = prefix.n_tokens if prefix else 0

    # --- tier 2: SEMANTIC
    why_not = ""
    if not use_kv:
        why_not = "prompt + answer exceed the sliding window"
    elif not allow_approximate:
        why_not = "caller forbids approximate reuse"
    elif not s.enable_semantic_reuse:
        why_not = "semantic reuse disabled"
    elif not semantic_supported:
        why_not = "architecture not supported by semantic reuse"
    elif len(tokens) < s.min_semantic_tokens:
        why_not = f"prompt shorter than {s.min_semantic_tokens} tokens"
    elif not candidates or best_cos < s.cache_threshold:
        why_not = f"best cosine {best_cos:.3f} below threshold {s.cache_threshold}"
    else:
        best = None
        for m in candidates:
            key, cos, e = m.key, m.cosine, m.entry
            if cos < s.cache_threshold:
                break
            pairs = align(e.tokens, tokens, limit)
            if best is None or len(pairs) > len(best[2]):
                best = (key, cos, pairs, e)
        assert best is not None  # the first candidate is above the threshold (checked above)
        key, cos, pairs, e = best
        lead = 0
        while lead < len(pairs) and pairs[lead] == (lead, lead):
            lead += 1
        approx = len(pairs) - lead
        est_compute = len(tokens) - len(pairs) + int(s.recompute_ratio * approx)
        if approx > 0 and est_compute <= SEMANTIC_GAIN * (len(tokens) - n_exact):
            return ReusePlan(CacheResult.SEMANTIC,
                             f"cosine {cos:.3f}: {len(pairs)} aligned tokens vs {n_exact} exact-prefix",
                             reported_similarity(cos), key, prefix=None, pairs=pairs, exact_lead=lead,
                             source_question=e.question, match_ms=match_ms)
        why_not = f"alignment gains too little ({len(pairs)} aligned vs {n_exact} exact-prefix tokens)"

    if prefix is not None:
        return ReusePlan(CacheResult.EXACT_PREFIX, f"{n_exact}-token exact prefix; no semantic: {why_not}",
                         reported_similarity(best_cos), prefix.source_key, prefix=prefix,
                         source_question=prefix.source_question, match_ms=match_ms)
    reason = "no cached prefix" if (allow_approximate or lossless_kv) \
        else "stored KV reuse is not lossless here and caller forbids approximate reuse"
    return ReusePlan(CacheResult.MISS, f"{reason}; no semantic: {why_not}", reported_similarity(best_cos),
                     match_ms=match_ms)
