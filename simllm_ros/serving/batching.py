"""Continuous batching: several requests in flight together (the request server's worker, max_batch > 1).

Batcher's `begin()` admits a prepared request (its plan, its prefill set up; a SEMANTIC repair runs whole), and each
`step()` advances every flight in ONE forward pass: a decode step of each decoding flight and the next prefill
chunks. A fault fails only its own flight (`_run_isolated`); flights answering on one context read its KV once
per step (`_shared_prefixes`). The phases themselves are request_pipeline's public ones (plan_flight,
prefill_flight, start_decoding, conclude): a Batcher holds the pipeline it runs them on, and the engine
owns one.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from ..request import CANCELLED_ERROR, CacheResult, Progress, QueryResult
from .engine_parts import EngineCore, Flight, Prepared, fault_result
from .request_pipeline import RequestPipeline


@dataclasses.dataclass
class StepRecord:
    """One step of the batch, for a trace: perf_counter times of its start, its forward pass and its end; the
    flights in it, the decoding ones and their rows (last token + drafts), prefill tokens run, flights that waited
    (for a leader's prefix, or for prefill budget)."""

    t_start: float
    t_pass: float
    t_pass_end: float
    t_end: float
    flights: int
    decoding: int
    decode_rows: int
    prefill_tokens: int
    waiting: int


class Batcher:
    """begin/step over flights, through the pipeline's public phases; owned by engine.Engine, which holds the model's
    turn, the energy spans and the statistics around each call."""

    def __init__(self, core: EngineCore, pipeline: RequestPipeline):
        self.core = core
        self.pipeline = pipeline
        # Where a caller sets a list, each step appends what it ran and when (StepRecord): the concurrency bench
        # reads where a batched run's time goes (prefill, decode, waits, the gaps between steps).
        self.trace: list[StepRecord] | None = None

    def begin(self, p: Prepared, on_progress: Callable[[Progress], None] | None = None,
              should_stop: Callable[[], bool] | None = None, energy_token: int | None = None
              ) -> QueryResult | Flight:
        """Admit a prepared request into the batch: its plan, and its prefill set up (run in the next steps,
        chunked); a SEMANTIC repair runs here, whole. Returns the result at once (ANSWER tier, a refusal), else a
        Flight for step() that carries `energy_token`. A fault raises (the engine fails the request)."""
        f = self.pipeline.plan_flight(p, on_progress, should_stop)
        if isinstance(f, QueryResult):
            return f
        f.energy_token = energy_token
        if f.plan.tier == CacheResult.SEMANTIC:
            logits = self.pipeline.prefill_flight(f)
            result = self.pipeline.start_decoding(f, logits)
            return result or f
        backend = self.core.loaded_backend()
        prefix = f.plan.prefix if f.plan.tier == CacheResult.EXACT_PREFIX else None
        n = prefix.n_tokens if prefix is not None else 0
        f.res.reused_tokens, f.res.recomputed_tokens = n, len(f.tokens) - n
        if prefix is not None and n:
            f.cache = backend.cache_from_tensors(prefix.k, prefix.v, reserve=len(f.tokens) - n + f.reserve)
        else:
            f.cache = backend.new_cache(len(f.tokens) + max(f.reserve, 2))
        f.todo = len(f.tokens) - n
        return f

    def step(self, flights: list[Flight]) -> list[QueryResult | None]:
        """One step of every flight, in ONE forward pass: a decode step (the last token and its draft) of each
        decoding flight and the next prefill chunks (at most prefill_chunk_tokens tokens in all, oldest flight
        first). Returns, per flight, its result when it finished in this step (done, or failed: a fault fails
        its own flight only), else None."""
        t_start = time.perf_counter()
        out: list[QueryResult | None] = [None] * len(flights)
        backend = self.core.loaded_backend()
        settings = self.core.settings
        budget = settings.prefill_chunk_tokens if backend.exact_chunking else None  # None: whole prompts
        work = []  # (flight index, tokens, logits mode, cache length before)
        # A pass costs about its row count once rows outnumber a few (benchmark/results/batching_notes.md):
        # decoding together, each flight's draft gets a share.
        n_decoding = sum(1 for f in flights if f.decoder is not None and not f.decoder.done)
        cap = None if n_decoding <= 1 else max(1, settings.max_draft_tokens // n_decoding)
        for i, f in enumerate(flights):
            try:
                if f.decoder is None and f.watch.should_stop():  # cancelled before its prompt was in
                    out[i] = QueryResult(success=False, error=CANCELLED_ERROR, stop_reason="cancel",
                                         request_id=f.p.req.request_id)
                elif f.decoder is None and self._follows_twin(f, flights[:i]):
                    continue  # an identical request ahead of it answers for both (served after its end)
                elif f.decoder is None and backend.exact_chunking and self._waits_for_leader(f, flights[:i]):
                    continue  # its prompt's start is being prefilled by an earlier flight: taken from it later
                elif f.decoder is not None:
                    f.decoder.draft_cap = cap
                    f.decoder.batch_rows = max(1, n_decoding)
                    work.append((i, f.decoder.inputs(), "all", backend.cache_len(f.cache)))
                elif budget is None or budget > 0:
                    done = len(f.tokens) - f.todo
                    n = f.todo if budget is None else min(f.todo, budget)
                    work.append((i, f.tokens[done:done + n], "last" if n == f.todo else "none", done))
                    budget = None if budget is None else budget - n
            except Exception as e:
                out[i] = self._fault(f.p, e)
        dec = [len(ids) for i, ids, _, _ in work if flights[i].decoder is not None]  # before the pass: for the trace
        t0 = time.perf_counter()
        outs = self._run_isolated(flights, work, out)
        t1 = time.perf_counter()
        if work and len(dec) == len(work):  # a decode pass: its cost per rows
            self.core.observe_pass(sum(dec), t1 - t0)
        for (i, ids, _, base), rows in zip(work, outs):
            if out[i] is not None:
                continue
            f = flights[i]
            try:
                if f.decoder is not None:
                    backend.finish_step(f.decoder, f.cache, base, rows)
                else:
                    f.todo -= len(ids)
                    if not f.todo:
                        out[i] = self.pipeline.start_decoding(f, rows)
                if out[i] is None and f.decoder is not None and f.decoder.done:
                    out[i] = self.pipeline.conclude(f, f.decoder.gen)
            except Exception as e:
                out[i] = self._fault(f.p, e)
        self._serve_twins(flights, out)
        if self.trace is not None:
            self.trace.append(StepRecord(t_start, t0, t1, time.perf_counter(), len(flights), len(dec), sum(dec),
                                         sum(len(ids) for _, ids, _, _ in work) - sum(dec), len(flights) - len(work)))
        return out

    def _fault(self, p: Prepared, e: BaseException) -> QueryResult:
        return fault_result(p, e, self.core.log)

    # A leader's prefix is waited for only where it saves at least this many prompt tokens of this flight's prefill.
    LEADER_MIN_TOKENS = 32

    def _waits_for_leader(self, f: Flight, earlier: list[Flight]) -> bool:
        """Requests that arrive together often share a long start (one system prompt, one bulletin) that no pool
        entry holds yet: each would prefill it in full, N times the work of one (8 robots asking about a new
        bulletin at 1.5B: every answer waited for eight prefills). A flight whose prompt shares at least
        LEADER_MIN_TOKENS more leading tokens with an earlier flight of its scope than it reused waits while that
        leader prefills them, then takes their KV: the leader's bits, which it would have computed itself
        (exact chunking: a token's KV does not depend on the passes its prefix ran in). Whether it waits now."""
        if not f.batch.leader_checked:
            f.batch.leader_checked = True
            have = len(f.tokens) - f.todo
            for other in earlier:
                if other.p.req.scope != f.p.req.scope or other.batch.leader is not None or other.batch.twin is not None:
                    continue
                n, limit = 0, min(len(other.tokens), len(f.tokens) - 1)  # the last token is run for its logits
                while n < limit and other.tokens[n] == f.tokens[n]:
                    n += 1
                if n >= have + self.LEADER_MIN_TOKENS and n > f.batch.leader_tokens:
                    f.batch.leader, f.batch.leader_tokens = other, n
        g = f.batch.leader
        if g is None:
            return False
        if not any(x is g for x in earlier) or g.cache is None:  # the leader ended (or failed) first: prefill alone
            f.batch.leader = None
            return False
        if len(g.tokens) - (g.todo if g.decoder is None else 0) < f.batch.leader_tokens:
            return True  # not yet
        n = f.batch.leader_tokens
        k, v = self.core.loaded_backend().cache_tensors(g.cache)
        f.cache = self.core.loaded_backend().cache_from_tensors(k[:, :, :n].clone(), v[:, :, :n].clone(),
                                                              reserve=len(f.tokens) - n + f.reserve)
        f.todo = len(f.tokens) - n
        f.res.reused_tokens, f.res.recomputed_tokens = n, f.todo
        if f.res.cache_result == CacheResult.MISS:
            f.res.cache_result = CacheResult.EXACT_PREFIX
        f.batch.leader = None
        return False

    def _follows_twin(self, f: Flight, earlier: list[Flight]) -> bool:
        """Requests sent together are often the same request (eight robots asking one question about one
        bulletin): each would be prefilled and decoded in full, for one answer. A flight whose scope, prompt tokens
        and answer settings equal those of a flight admitted before it, itself no follower, waits for that one's
        answer and takes it from the answer memo (_serve_twins): what it would have been served arriving a moment
        later, the same bits (the memo serves only exact answers). Only where the memo serves (answer_memo, a
        batch-invariant backend) and for a request that does not stream (a streaming client gets its tokens as
        they come). Whether it waits now; checked once, before its prompt is prefilled."""
        if not f.batch.twin_checked:
            f.batch.twin_checked = True
            if f.asked.streaming or f.todo != len(f.tokens) - f.res.reused_tokens or not (
                    self.core.settings.answer_memo and self.core.loaded_backend().exact_chunking):
                return False
            key = self._twin_key(f)
            f.batch.twin = next((g for g in earlier if g.batch.twin is None and self._twin_key(g) == key), None)
        g = f.batch.twin
        return g is not None

    @staticmethod
    def _twin_key(f: Flight) -> tuple:
        req, a = f.p.req, f.asked
        return (req.scope, f.tokens, a.max_new, a.temperature, a.seed, tuple(req.stop), req.json_schema)

    def _serve_twins(self, flights: list[Flight], out: list) -> None:
        """Followers (_follows_twin) whose twin ended in this step or before: the memo's answer; where it has
        none (the twin failed, was cancelled, or its answer was not stored), the follower is prefilled itself from
        the next step on."""
        index = {id(g): j for j, g in enumerate(flights)}
        for i, f in enumerate(flights):
            g = f.batch.twin
            if g is None or out[i] is not None:
                continue
            j = index.get(id(g))
            if j is not None and out[j] is None:
                continue  # still answering
            try:
                out[i] = self.pipeline.memo_answer_for(f)
            except Exception as e:
                out[i] = self._fault(f.p, e)
            f.batch.twin = None

    def _run_isolated(self, flights: list[Flight], work: list, out: list) -> list:
        """The work's forward pass, all together; if it raises, each flight's part alone, so that a fault fails
        only the flight it belongs to (a failed pass leaves nothing behind: every step rewrites its KV slots)."""
        backend = self.core.loaded_backend()
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
        flights answering on one context read its keys and values once per step. A flight looks for a lead (comparing
        the bits) once when it starts decoding and again only when its lead has gone; each group
        shares the slots all its members share."""
        leads: dict[int, int] = {}  # id(lead flight) -> work item
        groups: dict[int, list[int]] = {}  # lead item -> member items (the lead first)
        slots: dict[int, int] = {}  # item -> slots it shares with its lead
        for j, (i, _, _, base) in enumerate(work):
            f = flights[i]
            if f.decoder is None:
                continue
            lead = None
            if f.batch.share is not None:
                lf, n, lc, oc = f.batch.share
                if id(lf) in leads and lf.cache is lc and f.cache is oc and n <= base:
                    lead = leads[id(lf)]
                else:
                    f.batch.share, f.batch.share_checked = None, False
            if lead is None and not f.batch.share_checked:
                f.batch.share_checked = True
                for k in leads.values():
                    lf = flights[work[k][0]]
                    common = next((t for t, (x, y) in enumerate(zip(lf.tokens, f.tokens)) if x != y),
                                  min(len(lf.tokens), len(f.tokens)))
                    n = self.core.loaded_backend().same_prefix(lf.cache, f.cache, min(common, base, work[k][3]))
                    if n:
                        f.batch.share, lead = (lf, n, lf.cache, f.cache), k
                        break
            if lead is None:
                leads[id(f)] = j
                groups[j] = [j]
            else:
                groups[lead].append(j)
                slots[j] = f.batch.share[1]
        out: list[tuple[int, int] | None] = [None] * len(work)
        for lead, members in groups.items():
            if len(members) > 1:
                n = min(slots[j] for j in members[1:])
                for j in members:
                    out[j] = (lead, n)
        return out
