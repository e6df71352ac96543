"""What a finished request leaves for later ones, and how a later request reads it back as drafts.

Its prompt's exact KV goes into the pool (`update_pool`: at once, or, for a SEMANTIC repair whose KV is
approximate, as a `PendingInsert` that the engine's idle work computes exactly), its buffer may become the
pool's live prefix (`keep_live`), its answer joins the scope's recent answers (token ids kept per answer text),
and the fleet store gets its share (`publish`). `draft_source` gathers all these into a request's drafts.
RequestMemory holds these (the pending inserts, the recent answers, the drafts' acceptance); the engine owns one
and the pipeline calls it when a request ends.
"""
from __future__ import annotations

import collections
import dataclasses

import numpy as np

from ..model.decoding import Generation
from ..model.draft_proposer import DraftProposer, DraftStats
from ..request import CacheResult, QueryRequest
from ..cache.semantic_log import request_record
from .engine_parts import EngineCore, Flight, Prepared


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
    """The pool update after a request, the fleet's share, and the answers kept as drafts; owned by engine.Engine,
    reading the model, pool and fleet of its current load through `core`."""

    def __init__(self, core: EngineCore):
        self.core = core
        # Prompts served by SEMANTIC reuse, waiting for an exact prefill at idle time.
        self.pending_inserts: collections.deque[PendingInsert] = collections.deque(maxlen=PENDING_INSERTS_MAX)
        # Recent answers per scope (token ids), a draft source for verified decoding.
        self.recent_answers: dict[str, collections.deque[list[int]]] = {}
        self._answer_tokens: collections.OrderedDict[str, list[int]] = collections.OrderedDict()
        # How often each kind of draft is accepted (learnt over requests): with the backend's pass costs it
        # decides how long a draft is checked.
        self.draft_stats = DraftStats()

    def clear(self) -> None:
        """Forget the deferred exact prefills and the recent answers kept as drafts (the pool was cleared)."""
        self.pending_inserts.clear()
        self.recent_answers.clear()

    def pool_exact(self, scope: str, tokens: list[int], cache, fingerprint, question: str, digest: str,
                   answer: str, now: float | None = None) -> int | None:
        k, v = self.core.loaded_backend().cache_tensors(cache)
        return self.core.loaded_pool().insert(scope=scope, tokens=tokens, k=k[:, :, :len(tokens)],
                                            v=v[:, :, :len(tokens)], fingerprint=fingerprint, question=question,
                                            context_digest=digest, answer=answer, now=now)

    def update_pool(self, p: Prepared, plan, tokens, cache, digest: str, answer: str | None, now: float,
                    poolable: bool) -> None:
        """Exact KV only: a repaired SEMANTIC cache is approximate and would poison exact reuse, so its exact
        KV is computed at idle time (idle_work) and the next request on that context is an EXACT_PREFIX hit.
        answer None: no finished answer (cancelled, cut short): the prompt's KV only, a stored answer stays."""
        req = p.req
        if plan.source_key is not None:
            self.core.loaded_pool().touch([plan.source_key], now)
        if not poolable:
            return
        if answer is None:
            if self.core.loaded_pool().find(req.scope, tokens) is not None:
                return
            answer = ""
        if plan.tier == CacheResult.SEMANTIC:
            self.pending_inserts.append(PendingInsert(req.scope, tokens, p.fingerprint, p.question, digest, answer))
        elif plan.tier in (CacheResult.MISS, CacheResult.EXACT_PREFIX):
            key = self.pool_exact(req.scope, tokens, cache, p.fingerprint, p.question, digest, answer, now)
            if key is None:
                self.core.log.warning(f"request {req.request_id!r}: {len(tokens)} tokens do not fit in the KV pool "
                                      "budget")

    def publish(self, f: Flight, gen: Generation, exact: bool) -> None:
        """Share what this request computed exactly (off its path: the fleet's writer does the I/O)."""
        scope, tokens, core, fleet = f.p.req.scope, f.tokens, self.core, self.core.fleet
        if fleet is None:  # no fleet store (the pipeline publishes only where there is one)
            return
        kv_exact = f.poolable and core.lossless_reuse and f.plan.tier in (CacheResult.MISS, CacheResult.EXACT_PREFIX)
        fleet.publish(scope, tokens, answer_ids=list(gen.tokens) if exact else None, question=f.p.question,
                      task=None if core.warming else request_record(f.p.req),
                      read_kv=(lambda n: core.loaded_pool().read_prefix(scope, tokens, n)) if kv_exact else None,
                      fingerprint=f.p.fingerprint)

    def keep_live(self, f: Flight) -> None:
        """The request's buffer becomes the pool's live prefix (next exact hit in its scope: no copy) when its
        prompt KV is exact and at the pool's precision (a SEMANTIC repair's is not)."""
        storage = self.core.loaded_backend().cache_storage(f.cache)
        if (storage is not None and f.poolable and self.core.lossless_reuse
                and f.plan.tier in (CacheResult.MISS, CacheResult.EXACT_PREFIX)
                and self.core.loaded_backend().cache_len(f.cache) >= len(f.tokens)):
            self.core.loaded_pool().keep_live(f.p.req.scope, f.tokens, *storage)

    def draft_source(self, req: QueryRequest, tokens: list[int], fingerprint, now: float,
                     fleet_answer: list[int] | None = None) -> DraftProposer:
        """Drafts for this request: answers of the same prompt and of similar tasks in its scope (most
        similar first), the scope's recent answers, and the prompt itself."""
        s, pool = self.core.settings, self.core.loaded_pool()
        answers = []
        same = pool.find(req.scope, tokens)
        repeat = same.answer if same is not None and same.answer else ""
        repeat_ids = self.answer_ids(repeat) if repeat else []
        repeat_ids = repeat_ids or fleet_answer or []  # else another node's answer to this very prompt
        for m in pool.best_matches(fingerprint, req.scope, now, k=4, recency_weight=0.0,
                                   half_life_s=s.recency_half_life_s):
            if m.cosine >= s.draft_min_similarity and m.entry.answer and m.entry.answer not in answers:
                answers.append(m.entry.answer)
        ids = [self.answer_ids(a) for a in answers]
        if self.core.fleet is not None:  # then other nodes' answers to similar questions in this scope
            ids += [a for a in self.core.fleet.similar_answers(req.scope, fingerprint, s.draft_min_similarity)
                    if a not in ids and a != repeat_ids]
        return DraftProposer(answers=ids, repeat=repeat_ids,
                             history=list(self.recent_answers.get(req.scope, ())),
                             prompt=tokens, max_tokens=s.max_draft_tokens,
                             costs=self.core.pass_costs(), stats=self.draft_stats)

    def answer_ids(self, text: str) -> list[int]:
        ids = self._answer_tokens.get(text)
        if ids is None:
            ids = self.core.loaded_backend().tokenize_answer(text)
            self.keep_answer_ids(text, ids)
        return ids

    def keep_answer_ids(self, text: str, ids: list[int]) -> None:
        """An answer's token ids for drafts, the most recent 512 answers."""
        self._answer_tokens[text] = ids
        self._answer_tokens.move_to_end(text)
        if len(self._answer_tokens) > 512:
            self._answer_tokens.popitem(last=False)

    def remember_answer(self, scope: str, tokens: list[int]) -> None:
        if tokens:
            self.recent_answers.setdefault(scope, collections.deque(maxlen=16)).append(list(tokens))
            if len(self.recent_answers) > 256:  # scopes are caller-chosen: keep the table bounded
                self.recent_answers.pop(next(iter(self.recent_answers)))
