"""What a finished request leaves for later ones, and how a later request reads it back as drafts.

Its prompt's exact KV goes into the pool (`_update_pool`: at once, or, for a SEMANTIC repair whose KV is
approximate, as a `PendingInsert` that the engine's idle work computes exactly), its buffer may become the
pool's live prefix (`_keep_live`), its answer joins the scope's recent answers (token ids kept per answer text),
and the fleet store gets its share (`_publish`). `_draft_source` gathers all these into a request's drafts.
Mixed into engine.Engine.
"""
from __future__ import annotations

import collections
import dataclasses

import numpy as np

from ..model.decoding import Generation
from ..model.draft_proposer import DraftProposer
from ..request import CacheResult, QueryRequest
from .request_pipeline import Flight, Prepared
from ..cache.semantic_log import request_record


@dataclasses.dataclass
class PendingInsert:
    """A prompt served approximately (SEMANTIC): its exact KV is computed later, when the engine is idle."""

    scope: str
    tokens: list[int]
    fingerprint: np.ndarray
    question: str
    context_digest: str
    answer: str


PENDING_INSERTS_MAX = 8  # deferred exact prefills kept (newest win): idle time is finite



class RequestMemory:
    """The pool update after a request, the fleet's share, and the answers kept as drafts; part of engine.Engine."""

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

    def _keep_live(self, f: Flight) -> None:
        """The request's buffer becomes the pool's live prefix (next exact hit in its scope: no copy) when its
        prompt KV is exact and at the pool's precision (a SEMANTIC repair's is not)."""
        storage = self.backend.cache_storage(f.cache)
        if (storage is not None and f.poolable and self.lossless_reuse
                and f.plan.tier in (CacheResult.MISS, CacheResult.EXACT_PREFIX)
                and self.backend.cache_len(f.cache) >= len(f.tokens)):
            self.pool.keep_live(f.p.req.scope, f.tokens, *storage)

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
                             costs=self.pass_costs(), stats=self._draft_stats)

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
