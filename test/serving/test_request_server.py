"""RequestServer without ROS: admission, refusals, the worker, idle work, drain/stop, exactly-once answers.

The engine served here is a small real one (it answers with the prompt reversed), gated by an event
where a test needs requests to pile up; the server is the thing under test.
"""
import threading
import time

import pytest

from simllm_ros.request import CacheResult, Progress, QueryRequest, QueryResult
from simllm_ros.serving.request_server import STOPPED_ERROR, RequestServer
from simllm_ros.settings import Settings

WAIT_S = 10.0


class OneAtATime:
    """What every engine served one job at a time here has: the settings, and no batch (max_batch 1 never begins
    or steps a job)."""

    settings = Settings().replace(max_batch=1)  # one job at a time

    def begin(self, p, on_progress=None, should_stop=None):
        raise AssertionError("max_batch 1: no job is begun")

    def step(self, flights):
        raise AssertionError("max_batch 1: no step")

    def has_idle_work(self) -> bool:
        return False

    def idle_work(self) -> bool:
        return False

    def record_rejected_busy(self) -> None:
        pass


class Backend(OneAtATime):
    """A served engine (request_server.ServedEngine) with counters; `gate` holds the worker inside execute until
    set."""

    def __init__(self, gated: bool = False):
        self.gate = threading.Event()
        if not gated:
            self.gate.set()
        self.executed: list[str] = []
        self.running = threading.Event()
        self.busy_count = 0
        self.idle_left = 0
        self.idle_runs = 0

    def prepare(self, req: QueryRequest):
        if not req.prompt:
            return QueryResult.failure("empty prompt")
        if req.prompt == "explode in prepare":
            raise ValueError("bad fingerprint")
        return req, req.prompt.upper()

    def execute(self, p, on_progress=None, should_stop=None) -> QueryResult:
        req, text = p
        self.running.set()
        assert self.gate.wait(WAIT_S)
        if req.prompt == "explode":
            raise RuntimeError("injected")
        self.executed.append(req.request_id)
        return QueryResult(success=True, answer=text[::-1])

    def record_rejected_busy(self) -> None:
        self.busy_count += 1

    def has_idle_work(self) -> bool:
        return self.idle_left > 0

    def idle_work(self):
        self.idle_left -= 1
        self.idle_runs += 1


def make(backend: Backend, queue_limit: int = 4, **kw) -> RequestServer:
    server = RequestServer(backend, state=lambda: "inactive", queue_limit=queue_limit, **kw)
    server.start()
    return server


@pytest.fixture
def served():
    made = []

    def factory(backend, **kw):
        s = make(backend, **kw)
        made.append((s, backend))
        return s
    yield factory
    for s, b in made:
        b.gate.set()
        s.stop()


def req(i, prompt=None):
    return QueryRequest(prompt=prompt if prompt is not None else f"question {i}", request_id=f"r{i}")


def test_answers_in_order_with_request_ids(served):
    b = Backend()
    s = served(b, queue_limit=5)
    s.open()
    jobs = [s.submit(req(i)) for i in range(5)]
    results = [s.wait(j) for j in jobs]
    assert [r.answer for r in results] == [f"QUESTION {i}"[::-1] for i in range(5)]
    assert [r.request_id for r in results] == [f"r{i}" for i in range(5)]
    assert b.executed == [f"r{i}" for i in range(5)]
    assert s.inflight == 0 and s.queue_depth == 0


def test_closed_server_refuses_with_the_owner_state(served):
    b = Backend()
    s = served(b)
    r = s.wait(s.submit(req(1)))
    assert not r.success and r.error == "node is not active (state: inactive)" and r.request_id == "r1"
    assert b.executed == [] and s.inflight == 0


def test_full_queue_refuses_busy_and_counts_it(served):
    b = Backend(gated=True)
    s = served(b, queue_limit=2)
    s.open()
    first = s.submit(req(0))
    assert b.running.wait(WAIT_S)  # the worker holds job 0; the queue is empty again
    queued = [s.submit(req(i)) for i in (1, 2)]
    refused = s.submit(req(3))
    assert refused.done.is_set()
    assert refused.result.error == "busy: 2 requests already waiting (queue_limit 2); retry later"
    assert b.busy_count == 1 and s.queue_depth == 2 and s.inflight == 3
    s.set_queue_limit(3)  # live change: one more fits
    more = s.submit(req(4))
    assert not more.done.is_set()
    b.gate.set()
    assert all(s.wait(j).success for j in [first, *queued, more])
    assert b.executed == ["r0", "r1", "r2", "r4"]


def test_overheated_refuses_until_cleared(served):
    b = Backend()
    s = served(b)
    s.open()
    s.set_overheated("hottest zone cpu at 95.0 C (threshold 90.0 C)")
    r = s.wait(s.submit(req(1)))
    assert r.error == ("overheated: hottest zone cpu at 95.0 C (threshold 90.0 C); shedding load, "
                       "retry when cooler")
    s.set_overheated(None)
    assert s.wait(s.submit(req(2))).success


def test_prepare_refusal_and_fault_fail_that_request_only(served):
    b = Backend()
    s = served(b)
    s.open()
    empty = s.submit(req(1, ""))
    boom = s.submit(req(2, "explode in prepare"))
    fine = s.submit(req(3))
    assert s.wait(empty).error == "empty prompt"
    assert s.wait(boom).error == "internal error: ValueError: bad fingerprint"
    assert s.wait(fine).success
    assert b.executed == ["r3"] and s.inflight == 0 and s.queue_depth == 0


def test_fault_inside_execute_fails_that_request_only(served):
    b = Backend(gated=True)
    s = served(b)
    s.open()
    jobs = [s.submit(req(0)), s.submit(req(1, "explode")), s.submit(req(2))]
    b.gate.set()
    res = [s.wait(j) for j in jobs]
    assert res[0].success and res[2].success
    assert res[1].error == "internal error: RuntimeError: injected" and res[1].request_id == "r1"


def test_concurrent_submitters_each_answered_exactly_once(served):
    b = Backend()
    s = served(b, queue_limit=3)
    s.open()
    calls: dict[str, int] = {}
    lock = threading.Lock()

    def on_done(result):
        with lock:
            calls[result.request_id] = calls.get(result.request_id, 0) + 1

    def client(c):
        for i in range(25):
            s.submit(req(f"{c}-{i}"), on_done)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert s.drain("test") == 0
    assert len(calls) == 100 and set(calls.values()) == {1}
    assert len(b.executed) + b.busy_count == 100
    assert len(b.executed) > 0 and s.inflight == 0


def test_idle_work_only_while_open_and_nothing_waits(served):
    b = Backend()
    b.idle_left = 3
    s = served(b)
    time.sleep(0.3)
    assert b.idle_runs == 0  # closed: no idle work
    s.open()
    deadline = time.monotonic() + WAIT_S
    while b.idle_left and time.monotonic() < deadline:
        time.sleep(0.01)
    assert b.idle_runs == 3
    assert s.wait(s.submit(req(1))).success


def test_drain_waits_for_admitted_requests_then_close_refuses(served):
    b = Backend(gated=True)
    s = served(b)
    s.open()
    jobs = [s.submit(req(i)) for i in range(3)]
    s.close()
    late = s.submit(req(9))
    assert late.result.error.startswith("node is not active")
    threading.Timer(0.2, b.gate.set).start()
    assert s.drain("test") == 0
    assert all(j.result.success for j in jobs)


def test_stop_finishes_the_queue_then_refuses(served):
    b = Backend(gated=True)
    s = served(b)
    s.open()
    jobs = [s.submit(req(i)) for i in range(3)]
    threading.Timer(0.2, b.gate.set).start()
    s.stop()
    assert all(j.result.success for j in jobs)
    r = s.wait(s.submit(req(5)))
    assert r.error.startswith("node is not active") and not s.running


def test_a_stuck_worker_leaves_no_request_waiting(served):
    b = Backend(gated=True)
    s = served(b, drain_timeout_s=0.3)
    s.open()
    stuck = s.submit(req(0))
    assert b.running.wait(WAIT_S)
    queued = s.submit(req(1))
    s.stop()  # the worker cannot finish: stop gives up after drain_timeout_s
    assert queued.result.error == STOPPED_ERROR
    assert s.wait(stuck, poll_s=0.05).error == STOPPED_ERROR
    b.gate.set()  # the worker wakes up later: its answer must not count twice
    time.sleep(0.2)
    assert stuck.result.error == STOPPED_ERROR and s.inflight == 0


def test_per_job_callbacks_reach_the_executor(served):
    """The hooks a streaming transport needs: partial text out, cancellation in."""
    seen = []

    class Streaming(OneAtATime):
        def prepare(self, r):
            return r.prompt

        def execute(self, p, on_progress=None, should_stop=None):
            text = ""
            for n, word in enumerate(p.split(), 1):
                if should_stop():
                    return QueryResult(success=True, answer=text.strip(), generated_tokens=n - 1)
                text += word + " "
                on_progress(Progress(text.strip(), n, CacheResult.MISS))
            return QueryResult(success=True, answer=text.strip(), generated_tokens=n)

    s = RequestServer(Streaming(), state=lambda: "inactive")
    s.start()
    s.open()
    try:
        full = s.wait(s.submit(req(1, "one two three"), on_progress=lambda p: seen.append((p.text, p.generated_tokens)),
                               should_stop=lambda: False))
        streamed = []
        cut = s.wait(s.submit(req(2, "one two three"), on_progress=lambda p: streamed.append(p.generated_tokens),
                              should_stop=lambda: len(streamed) >= 1))
    finally:
        s.stop()
    assert full.answer == "one two three" and seen == [("one", 1), ("one two", 2), ("one two three", 3)]
    assert cut.generated_tokens == 1 and cut.answer == "one" and streamed == [1]


# ---- continuous batching: several jobs in flight, one step at a time --------------------------------------
class Stepper:
    """A served engine for the batched worker: a job "decodes" its prompt one word per step, so a job of n words
    takes n steps; every step is logged with the jobs it advanced. Alone (max_batch 1) it answers "alone"."""

    settings = Settings()  # batched() gives max_batch and queue_limit

    def __init__(self):
        self.steps: list[list[str]] = []  # request ids advanced by each step
        self.begun: list[tuple[str, int]] = []  # (request id, steps run before its begin)
        self.gate = threading.Event()
        self.gate.set()
        self.idle_runs = 0
        self.idle_left = 0
        self.step_s = 0.0  # how long a step takes

    def prepare(self, r):
        return r

    def execute(self, p, on_progress=None, should_stop=None):
        return QueryResult(success=True, answer="alone")

    def record_rejected_busy(self) -> None:
        pass

    def begin(self, p, on_progress=None, should_stop=None):
        self.begun.append((p.request_id, len(self.steps)))
        if p.prompt == "explode in begin":
            raise RuntimeError("begin fault")
        if p.prompt == "at once":
            return QueryResult(success=True, answer="now")
        return {"id": p.request_id, "words": p.prompt.split(), "done": []}

    def step(self, handles):
        assert self.gate.wait(WAIT_S)
        if any(w == "crash" for h in handles for w in h["words"][:1]):
            raise RuntimeError("step fault")
        time.sleep(self.step_s)
        self.steps.append([h["id"] for h in handles])
        out = []
        for h in handles:
            word = h["words"].pop(0)
            if word == "fail":
                out.append(QueryResult.failure("its own fault"))
                continue
            h["done"].append(word)
            out.append(None if h["words"] else QueryResult(success=True, answer=" ".join(h["done"])))
        return out

    def has_idle_work(self):
        return self.idle_left > 0

    def idle_work(self):
        self.idle_left -= 1
        self.idle_runs += 1


def batched(stepper: Stepper, max_batch: int, queue_limit: int = 16) -> RequestServer:
    s = RequestServer(stepper, state=lambda: "inactive", queue_limit=queue_limit, max_batch=max_batch)
    s.start()
    s.open()
    return s


def test_batched_jobs_share_steps_and_each_is_answered_once():
    st = Stepper()
    st.gate.clear()
    s = batched(st, max_batch=3)
    calls: dict[str, int] = {}
    try:
        jobs = [s.submit(req(i, " ".join(f"w{k}" for k in range(n))), lambda r: calls.__setitem__(
            r.request_id, calls.get(r.request_id, 0) + 1)) for i, n in enumerate([4, 1, 6, 2, 3])]
        st.gate.set()
        res = [s.wait(j) for j in jobs]
    finally:
        s.stop()
    assert [r.answer for r in res] == [" ".join(f"w{k}" for k in range(n)) for n in [4, 1, 6, 2, 3]]
    assert calls == {f"r{i}": 1 for i in range(5)} and s.inflight == 0
    assert max(len(ids) for ids in st.steps) == 3  # max_batch jobs in one step, never more
    assert st.steps[0] == ["r0", "r1", "r2"]
    # r1 finished in the first step: r3 joined at the very next one, while r0 and r2 were still decoding.
    assert st.steps[1] == ["r0", "r2", "r3"]
    assert len(st.steps) < 4 + 1 + 6 + 2 + 3


def test_batched_new_job_waits_at_most_one_step_behind_a_long_one():
    st = Stepper()
    st.step_s = 0.005
    s = batched(st, max_batch=4)
    try:
        long_job = s.submit(req(0, " ".join(["w"] * 400)))
        deadline = time.monotonic() + WAIT_S
        while len(st.steps) < 5 and time.monotonic() < deadline:
            time.sleep(0.001)
        n_before = len(st.steps)
        short = s.wait(s.submit(req(1, "a b")))
        assert short.success and short.answer == "a b"
        assert not long_job.done.is_set()  # the short one finished while the long one was still decoding
        begun_at = dict(st.begun)["r1"]
        assert begun_at - n_before <= 1, (n_before, begun_at)
    finally:
        s.stop()
    assert s.wait(long_job).success


def test_batched_faults_fail_only_their_job_and_a_step_fault_fails_those_in_flight():
    st = Stepper()
    st.gate.clear()
    s = batched(st, max_batch=4)
    try:
        jobs = [s.submit(req(0, "a b c")), s.submit(req(1, "explode in begin")), s.submit(req(2, "x fail y")),
                s.submit(req(3, "at once"))]
        st.gate.set()
        res = [s.wait(j) for j in jobs]
        assert res[0].success and res[0].answer == "a b c"
        assert res[1].error == "internal error: RuntimeError: begin fault"
        assert res[2].error == "its own fault" and res[3].answer == "now"
        # A step that raises as a whole fails the jobs in flight with it; the server keeps serving.
        crash = [s.submit(req(4, "crash now")), s.submit(req(5, "q"))]
        out = [s.wait(j) for j in crash]
        assert all(r.error == "internal error: RuntimeError: step fault" for r in out)
        assert s.wait(s.submit(req(6, "still here"))).answer == "still here"
    finally:
        s.stop()
    assert s.inflight == 0 and s.queue_depth == 0


def test_batched_full_batch_queues_then_refuses_busy_and_drain_waits():
    st = Stepper()
    st.gate.clear()
    s = batched(st, max_batch=2, queue_limit=2)
    try:
        first = [s.submit(req(i, "a b")) for i in range(2)]
        deadline = time.monotonic() + WAIT_S
        while s.queue_depth and time.monotonic() < deadline:  # the worker takes both into the batch
            time.sleep(0.001)
        queued = [s.submit(req(i, "c")) for i in (2, 3)]
        refused = s.submit(req(4, "d"))
        assert refused.result.error == "busy: 2 requests already waiting (queue_limit 2); retry later"
        s.close()
        threading.Timer(0.2, st.gate.set).start()
        assert s.drain("test") == 0
        assert all(j.result.success for j in first + queued)
    finally:
        st.gate.set()
        s.stop()


def test_batched_idle_work_only_when_nothing_is_in_flight():
    st = Stepper()
    st.gate.clear()
    s = batched(st, max_batch=2)
    try:
        job = s.submit(req(0, "a b c"))
        st.idle_left = 2
        time.sleep(0.3)
        assert st.idle_runs == 0  # a job is in flight (its step is held): no idle work meanwhile
        st.gate.set()
        assert s.wait(job).success
        deadline = time.monotonic() + WAIT_S
        while st.idle_left and time.monotonic() < deadline:
            time.sleep(0.01)
        assert st.idle_runs == 2
    finally:
        s.stop()


def test_max_batch_one_runs_each_job_alone_through_execute():
    st = Stepper()
    s = batched(st, max_batch=1)
    try:
        assert s.wait(s.submit(req(0, "a b"))).answer == "alone" and st.steps == []
        s.set_max_batch(2)  # live: the next job goes through the batched worker
        assert s.wait(s.submit(req(1, "a b"))).answer == "a b" and len(st.steps) == 2
    finally:
        s.stop()


def test_topic_ids_must_be_unique_in_flight_and_non_empty(served):
    """Three "dup-1" requests: the first is answered, the two others refused at once; the id is free again
    once the first is answered. An empty id is refused."""
    from simllm_ros.serving.request_server import EMPTY_ID_ERROR
    b = Backend(gated=True)
    s = served(b, queue_limit=8)
    s.open()
    first = s.submit(QueryRequest(prompt="a", request_id="dup-1"), unique_id=True)
    dups = [s.submit(QueryRequest(prompt="b", request_id="dup-1"), unique_id=True) for _ in range(2)]
    for d in dups:
        assert d.done.is_set() and not d.result.success and d.result.request_id == "dup-1"
        assert "'dup-1' is already in flight" in d.result.error
    empty = s.submit(QueryRequest(prompt="c", request_id=""), unique_id=True)
    assert empty.done.is_set() and empty.result.error == EMPTY_ID_ERROR
    other = s.submit(QueryRequest(prompt="d", request_id="dup-2"), unique_id=True)  # another id: admitted
    b.gate.set()
    assert s.wait(first).success and s.wait(other).success
    again = s.wait(s.submit(QueryRequest(prompt="e", request_id="dup-1"), unique_id=True))
    assert again.success, again.error
    # Service requests (unique_id=False) carry no id and are not checked.
    assert s.wait(s.submit(QueryRequest(prompt="f"))).success
    assert s.inflight == 0 and b.executed == ["dup-1", "dup-2", "dup-1", ""]
