"""What the engine's parts (request_pipeline, request_memory, batching, warm_start) hand one another and read of the
engine: the records of a request on its way (Prepared, Flight) and EngineCore, the engine's state that changes over
its life (load, unload, fork, new settings), read through one typed interface rather than a shared `self`.

Its own module so that the parts import the records from one place and none imports another back.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ..cache import reuse_planner
from ..cache.error_bound import ErrorBound
from ..cache.fleet_store import FleetStore
from ..cache.kv_pool import KVPool
from ..cache.semantic_log import SemanticLog
from ..model.decoding import Constraint, Decoder
from ..model.draft_proposer import DraftProposer
from ..model.model_backend import ModelBackend
from ..model.pass_costs import PassCosts
from ..model.structured_output import CompiledSchema, NoValueLeft
from ..request import QueryRequest, QueryResult
from ..settings import Settings
from .streaming import AnswerWatcher
from .thermal import ThermalLevel

if TYPE_CHECKING:  # annotations only (the module imports neither at run time)
    from . import approx_gate, semantic_reuse


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


@dataclasses.dataclass
class Asked:
    """What a request asked, as its plan settles it (the request's own values, else the node's): the answer's
    length and sampling, whether it streams, its grammar, and the error bound an approximate answer is served under."""

    max_new: int
    temperature: float = 0.0
    seed: int = 0
    streaming: bool = False
    constraint: Constraint | None = None  # the json_schema's grammar
    delta: float = 1.0  # the approx_error_bound this request is served under


@dataclasses.dataclass
class BatchLinks:
    """How a flight takes KV from others in flight with it; batching.Batcher alone reads and writes these."""

    # (lead flight, slots, its cache, ours): our cache's first slots hold the lead's bits (ModelBackend.same_prefix),
    # which a batched step's attention reads once for both; None: not shared (share_checked: looked already).
    share: tuple | None = None
    share_checked: bool = False
    # A flight of the same scope admitted before this one whose prompt shares more leading tokens than this one
    # reused: this one waits until the leader has prefilled them, then takes their KV.
    leader: "Flight | None" = None
    leader_tokens: int = 0
    leader_checked: bool = False
    # An identical request (scope, prompt, answer settings) in flight before this one: this one waits for its
    # answer and takes it from the answer memo, as it would had it arrived a moment later (twin_checked: looked).
    twin: "Flight | None" = None
    twin_checked: bool = False


@dataclasses.dataclass
class Flight:
    """A request between its plan and its result: the engine's state for it while it is prefilled and decoded
    (alone in execute(), or among others in step()). What it asked is `asked`; how it shares KV in a batch, `batch`."""

    p: Prepared
    plan: reuse_planner.ReusePlan
    tokens: list[int]
    res: QueryResult  # filled in as it goes
    digest: str
    now: float
    poolable: bool
    lossless: bool
    plan_ms: float
    asked: Asked
    reserve: int  # KV room beyond the prompt: the answer and a draft
    watch: AnswerWatcher  # stop strings, streaming, cancel
    early: "semantic_reuse.Ahead | None" = None  # a SEMANTIC plan's early pass, run while the fingerprint was computed
    use_drafts: bool = False  # drafts are built once the prompt is in (after_prefill), with the fingerprint
    similarity_pending: bool = False  # planned without the fingerprint: res.similarity comes after the prefill
    drafts: DraftProposer | None = None
    on_token: Callable[[list[int]], None] | None = None
    cache: object = None
    todo: int = 0  # prompt tokens (the last ones) still to prefill
    decoder: Decoder | None = None
    fleet_answer: list[int] | None = None  # another node's answer to this prompt (fleet store): a draft
    candidate: "approx_gate.Candidate | None" = None  # the stored answer the ANSWER tier would have looked at
    refused: "reuse_planner.ReusePlan | None" = None  # an approximate plan the error bound turned down
    energy_token: int | None = None  # its span in the engine's EnergyMeter (begin() to its result)
    batch: BatchLinks = dataclasses.field(default_factory=BatchLinks)


class EngineNotLoaded(RuntimeError):
    """A part asked for the model or the pool of an engine that has none (the engine refuses requests before that;
    this is the error where that check was missed)."""


class EngineCore(Protocol):
    """What the engine's parts read of it, each time they need it (engine.Engine is one): the model, pool and fleet
    store of the current load, the settings now, the error bound (a caller may swap it), and the pass costs that
    draft lengths follow."""

    @property
    def settings(self) -> Settings: ...

    @property
    def backend(self) -> ModelBackend | None:
        """The current load's model; None while not loaded (for a part that may run then: a save)."""

    @property
    def pool(self) -> KVPool | None: ...

    def loaded_backend(self) -> ModelBackend:
        """backend, for a part that runs only on a loaded engine (a request's phases, warm-up, restore); raises
        EngineNotLoaded where there is none."""

    def loaded_pool(self) -> KVPool:
        """pool, as loaded_backend() is backend."""

    @property
    def fleet(self) -> FleetStore | None: ...

    @property
    def semantic_log(self) -> SemanticLog | None: ...

    @property
    def error_bound(self) -> ErrorBound: ...

    @property
    def log(self) -> logging.Logger: ...

    @property
    def thermal_level(self) -> ThermalLevel: ...

    @property
    def lossless_reuse(self) -> bool: ...

    @property
    def warming(self) -> bool:
        """Requests now are warm-up: the semantic log marks them, the fleet is not told their task."""

    @property
    def prefill_s_per_token(self) -> float:
        """Measured at load with a fleet store: whether fetching a prefix beats prefilling it."""

    def pass_costs(self) -> PassCosts | None: ...

    def observe_pass(self, rows: int, seconds: float) -> None: ...


def fault_result(p: Prepared, e: BaseException, log: logging.Logger) -> QueryResult:
    """A fault inside a request's generation as that request's failure (it fails this request only)."""
    if isinstance(e, NoValueLeft):  # the caller's schema, not our fault: a clear error, no traceback
        log.warning(f"request {p.req.request_id!r}: {e}")
        return QueryResult.failure(str(e), p.req.request_id)
    log.error(f"request {p.req.request_id!r} failed inside the engine", exc_info=e)
    return QueryResult.failure(f"internal error: {type(e).__name__}: {e}", p.req.request_id)
