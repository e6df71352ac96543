"""Admission and the generation worker: every request is answered exactly once, without ROS.

Why it exists: the node's transport (service, topic, later an action) only adapts messages; what
happens to a request between arrival and answer lives here so it can be tested without DDS.

  submit()  : refuse at once ("node is not active (state: ...)", "overheated: ...", "busy: ...")
              or admit into a bounded queue (queue_limit counts admitted requests not yet picked up
              by the worker). prepare() (validation + fingerprint) runs in the caller's thread, so
              several callers fingerprint while the worker generates.
  worker    : one thread runs the jobs in arrival order. With max_batch 1 each job runs alone
              through the engine's execute(). With max_batch > 1 it keeps up to
              max_batch jobs in flight (continuous batching): between steps it admits waiting jobs
              (begin(): plan, prefill set-up; or a result at once), then runs step(handles), one
              forward pass that advances every job in flight, and finishes those that are done. A
              new job therefore waits at most one step while there is room in the batch. When
              nothing is in flight or waiting and the server is open it runs idle work (deferred
              exact prefills).
  close()   : refuse new requests; drain() waits for the admitted ones; stop() lets the worker
              finish what is queued, then ends it. A job the worker can no longer reach is
              finished with an error, never left waiting.

A job may carry per-job callbacks for a streaming transport (the action): on_progress(Progress) with the
answer so far, and should_stop() (cancellation); execute() hands them to the engine. Every transport
(service, topic, action) goes through the same submit(), so the same queue_limit and refusals hold.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from ..request import CANCELLED_ERROR, Progress, QueryRequest, QueryResult
from ..settings import Settings

DRAIN_TIMEOUT_S = 300.0  # drain and stop wait at most this long for in-flight requests
IDLE_POLL_S = 1.0  # the worker re-checks for idle work at least this often


def not_active_error(state: str) -> str:
    return f"node is not active (state: {state})"


def overheated_error(reason: str) -> str:
    return f"overheated: {reason}; shedding load, retry when cooler"


def busy_error(waiting: int, limit: int) -> str:
    return f"busy: {waiting} requests already waiting (queue_limit {limit}); retry later"


def internal_error(e: BaseException) -> str:
    return f"internal error: {type(e).__name__}: {e}"


STOPPED_ERROR = "node stopped before answering"
EMPTY_ID_ERROR = ("request_id is empty: a topic request needs an id that is unique among your requests in flight "
                  "(e.g. a UUID), or its answer cannot be matched")


def duplicate_id_error(request_id: str) -> str:
    return (f"request_id {request_id!r} is already in flight: ids must be unique among requests in flight "
            "(this refusal carries the same id; the earlier request is still answered)")


class Job:
    """One admitted request; finished exactly once (result set, `done` set, on_done called)."""

    __slots__ = ("request", "prepared", "on_done", "on_progress", "should_stop", "result", "done", "_finished",
                 "_id_held")

    def __init__(self, request: QueryRequest, on_done: Callable[[QueryResult], None] | None = None,
                 on_progress: Callable[[Progress], None] | None = None,
                 should_stop: Callable[[], bool] | None = None):
        self.request = request
        self.prepared: Any = None
        self.on_done = on_done
        self.on_progress = on_progress
        self.should_stop = should_stop
        self.result: QueryResult | None = None
        self.done = threading.Event()
        self._finished = False
        self._id_held = False  # its request_id is registered as in flight


class ServedEngine(Protocol):
    """What a RequestServer needs of the engine it serves (serving.engine.Engine is one): a request's phases (prepare,
    then execute alone, or begin and step in a batch), its idle work, a count of busy refusals, and the settings
    that size the queue and the batch. Handles (what prepare and begin return) are the engine's own."""

    @property
    def settings(self) -> Settings: ...

    def prepare(self, req: QueryRequest) -> Any: ...

    def execute(self, p: Any, on_progress: Callable[[Progress], None] | None = None,
                should_stop: Callable[[], bool] | None = None) -> QueryResult: ...

    def begin(self, p: Any, on_progress: Callable[[Progress], None] | None = None,
              should_stop: Callable[[], bool] | None = None) -> Any: ...

    def step(self, flights: list[Any]) -> list[QueryResult | None]: ...

    def has_idle_work(self) -> bool: ...

    def idle_work(self) -> bool: ...

    def record_rejected_busy(self) -> None: ...


class RequestServer:
    """Bounded admission queue plus one worker thread over an engine (ServedEngine).

    engine.prepare(request) -> prepared | QueryResult (a refusal); engine.execute(prepared, on_progress,
    should_stop) -> QueryResult (may raise: the job then fails with "internal error: ..."); begin/step for jobs in
    flight together; has_idle_work() / idle_work() for deferred work; record_rejected_busy() counts a busy refusal;
    state() names the owner's state for "not active" refusals. Why one object: a host (the node) wires one engine,
    not eight functions, and a type checker sees every member.
    """

    def __init__(self, engine: ServedEngine, *, state: Callable[[], str], queue_limit: int | None = None,
                 max_batch: int | None = None, log: logging.Logger | None = None,
                 drain_timeout_s: float = DRAIN_TIMEOUT_S):
        """queue_limit and max_batch: the engine's settings' unless given. begin(prepared, ...) -> QueryResult
        (finished at once) | a handle; step(handles) -> per handle its QueryResult when finished in this step, else
        None. Both may raise: begin fails its job, step fails every job in flight (the engine isolates its own
        per-job faults)."""
        self._engine = engine
        self._state = state
        self._max_batch = max(1, int(engine.settings.max_batch if max_batch is None else max_batch))
        self.log = log or logging.getLogger("simllm_ros.request_server")
        self.drain_timeout_s = drain_timeout_s
        self._cv = threading.Condition()
        self._open = False  # admitting requests
        self._queue_limit = int(engine.settings.queue_limit if queue_limit is None else queue_limit)
        self._overheated: str | None = None  # why, while the thermal level is critical
        self._waiting = 0  # admitted, not yet picked up by the worker
        self._inflight = 0  # admitted, not yet finished
        self._queue: collections.deque[Job] = collections.deque()
        self._ids_in_flight: set[str] = set()  # request_ids of admitted jobs submitted with unique_id
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ---- state ------------------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        with self._cv:
            return self._waiting

    @property
    def inflight(self) -> int:
        with self._cv:
            return self._inflight

    @property
    def queue_limit(self) -> int:
        with self._cv:
            return self._queue_limit

    @property
    def running(self) -> bool:
        return self._thread is not None

    def set_queue_limit(self, limit: int) -> None:
        with self._cv:
            self._queue_limit = int(limit)
            self._cv.notify_all()

    @property
    def max_batch(self) -> int:
        with self._cv:
            return self._max_batch

    def set_max_batch(self, n: int) -> None:
        """Live: jobs in flight beyond a lowered limit finish first; no new one joins until there is room."""
        with self._cv:
            self._max_batch = max(1, int(n))
            self._cv.notify_all()

    def set_overheated(self, reason: str | None) -> None:
        """A reason: refuse every new request with "overheated: <reason> ..."; None: admit again."""
        with self._cv:
            self._overheated = reason

    def open(self) -> None:
        with self._cv:
            self._open = True
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._open = False

    # ---- worker lifetime -----------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        with self._cv:
            self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="simllm-generation", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Close, let the worker finish the queue, end it; whatever it could not reach fails."""
        self.close()
        thread = self._thread
        if thread is None:
            return
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        thread.join(timeout=self.drain_timeout_s)
        if thread.is_alive():
            self.log.error("generation worker did not stop")
        self._thread = None
        with self._cv:
            orphans = list(self._queue)
            self._queue.clear()
            self._waiting -= len(orphans)
        for job in orphans:
            self._finish(job, QueryResult.failure(STOPPED_ERROR))

    def drain(self, why: str) -> int:
        """Wait until every admitted request is finished (at most drain_timeout_s); returns how many are left."""
        deadline = time.monotonic() + self.drain_timeout_s
        with self._cv:
            if self._inflight:
                self.log.info(f"{why}: waiting for {self._inflight} in-flight request(s)")
            while self._inflight and time.monotonic() < deadline:
                self._cv.wait(timeout=0.5)
            if self._inflight:
                self.log.warning(f"{why}: {self._inflight} request(s) still in flight after "
                                 f"{self.drain_timeout_s:.0f} s")
            return self._inflight

    # ---- requests ------------------------------------------------------------------------------
    def submit(self, request: QueryRequest, on_done: Callable[[QueryResult], None] | None = None, *,
               on_progress: Callable[[Progress], None] | None = None,
               should_stop: Callable[[], bool] | None = None, unique_id: bool = False) -> Job:
        """Admit (or refuse), prepare in this thread, queue for the worker. The returned job may already be
        finished (a refusal or a bad request); on_done is called once either way.
        unique_id: the request_id must be non-empty and not held by another request in flight (the topic
        transport matches answers by id)."""
        job = Job(request, on_done, on_progress, should_stop)
        refusal = self._admit(job if unique_id else None)
        if refusal is not None:
            self._finish(job, QueryResult.failure(refusal), counted=False)
            return job
        try:
            prepared = self._engine.prepare(request)
        except Exception as e:
            self.log.error(f"request {request.request_id!r}: prepare failed: {type(e).__name__}: {e}")
            prepared = QueryResult.failure(internal_error(e))
        if isinstance(prepared, QueryResult):
            with self._cv:
                self._waiting -= 1
            self._finish(job, prepared)
            return job
        job.prepared = prepared
        with self._cv:
            orphan = self._thread is None or self._stopping
            if orphan:
                self._waiting -= 1
            else:
                self._queue.append(job)
                self._cv.notify_all()
        if orphan:
            self._finish(job, QueryResult.failure(not_active_error(self._state())))
        return job

    def wait(self, job: Job, poll_s: float = 1.0) -> QueryResult:
        """Block until the job is finished; if the worker is gone meanwhile, finish it with an error. A job
        whose should_stop() turns true while it still waits in the queue is withdrawn at the next poll and
        finished as cancelled (once running, the executor sees should_stop itself)."""
        while not job.done.wait(timeout=poll_s):
            if self._thread is None:
                self._finish(job, QueryResult.failure(STOPPED_ERROR))
            elif job.should_stop is not None and job.should_stop():
                self.withdraw(job)
        assert job.result is not None  # set before `done`
        return job.result

    def withdraw(self, job: Job) -> bool:
        """Take a job out of the queue before the worker starts it, finishing it as cancelled; False when it
        is not waiting (already running or finished)."""
        with self._cv:
            try:
                self._queue.remove(job)
            except ValueError:
                return False
            self._waiting -= 1
        self._finish(job, QueryResult(success=False, error=CANCELLED_ERROR, stop_reason="cancel"))
        return True

    def _admit(self, unique: Job | None = None) -> str | None:
        """A refusal message, or None after counting the request as admitted (and, for `unique`, holding
        its request_id until it is finished)."""
        with self._cv:
            if not self._open:
                return not_active_error(self._state())
            if unique is not None:
                rid = unique.request.request_id
                if not rid:
                    return EMPTY_ID_ERROR
                if rid in self._ids_in_flight:
                    return duplicate_id_error(rid)
            if self._overheated is not None:
                return overheated_error(self._overheated)
            if self._waiting >= self._queue_limit:
                waiting, limit = self._waiting, self._queue_limit
            else:
                self._waiting += 1
                self._inflight += 1
                if unique is not None:
                    self._ids_in_flight.add(unique.request.request_id)
                    unique._id_held = True
                return None
        try:
            self._engine.record_rejected_busy()
        except Exception:
            pass
        return busy_error(waiting, limit)

    def _finish(self, job: Job, result: QueryResult, counted: bool = True) -> None:
        with self._cv:
            if job._finished:
                return
            job._finished = True
            if counted:
                self._inflight -= 1
            if job._id_held:
                self._ids_in_flight.discard(job.request.request_id)
            self._cv.notify_all()
        result.request_id = job.request.request_id
        job.result = result
        job.done.set()
        if job.on_done is not None:
            try:
                job.on_done(result)
            except Exception as e:
                self.log.error(f"request {job.request.request_id!r}: answering failed: {e}")

    # ---- the worker ------------------------------------------------------------------------------
    def _next(self, active: int) -> tuple[list[Job], bool]:
        """(jobs to start now, whether to run idle work); raises StopIteration when stopped with nothing
        left. With `active` jobs in flight it returns at once (possibly with no job: their next step)."""
        with self._cv:
            while not self._queue and not active and not self._stopping:
                if self._open and self._engine.has_idle_work():
                    return [], True
                self._cv.wait(timeout=IDLE_POLL_S)
            if not self._queue and not active:
                raise StopIteration
            room = self._max_batch - active if self._batching(active) else 1 - active
            take: list[Job] = []
            while self._queue and len(take) < room:
                take.append(self._queue.popleft())
            self._waiting -= len(take)
            return take, False

    def _batching(self, active: int) -> bool:
        return self._max_batch > 1 or active > 0

    def _loop(self) -> None:
        inflight: list[tuple[Job, Any]] = []  # (job, handle) in admission order
        while True:
            try:
                take, idle = self._next(len(inflight))
            except StopIteration:
                return
            if idle:
                try:
                    self._engine.idle_work()
                except Exception as e:
                    self.log.error(f"idle work failed: {type(e).__name__}: {e}")
                continue
            if not inflight and not self._batching(0):
                for job in take:
                    self._run(job)
                continue
            for job in take:
                self._start(job, inflight)
            if inflight:
                self._advance(inflight)

    def _run(self, job: Job) -> None:
        try:
            result = self._engine.execute(job.prepared, job.on_progress, job.should_stop)
        except Exception as e:
            self.log.error(f"request {job.request.request_id!r}: generation failed: {type(e).__name__}: {e}")
            result = QueryResult.failure(internal_error(e))
        self._finish(job, result)

    def _start(self, job: Job, inflight: list) -> None:
        try:
            handle = self._engine.begin(job.prepared, job.on_progress, job.should_stop)
        except Exception as e:
            self.log.error(f"request {job.request.request_id!r}: generation failed: {type(e).__name__}: {e}")
            handle = QueryResult.failure(internal_error(e))
        if isinstance(handle, QueryResult):
            self._finish(job, handle)
        else:
            inflight.append((job, handle))

    def _advance(self, inflight: list) -> None:
        """One step of every job in flight; the finished ones are answered and leave."""
        try:
            results = self._engine.step([h for _, h in inflight])
        except Exception as e:
            self.log.error(f"batched step failed: {type(e).__name__}: {e}")
            results = [QueryResult.failure(internal_error(e)) for _ in inflight]
        left = []
        for (job, handle), result in zip(inflight, results):
            if result is None:
                left.append((job, handle))
            else:
                self._finish(job, result)
        inflight[:] = left
