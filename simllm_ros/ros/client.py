"""A small rclpy client for simllm_node that cannot deadlock its caller.

Why: the most common rclpy mistake is a blocking `cli.call(req)` inside a callback: the response is delivered
by the executor that is busy running that very callback, so the call never returns. This client owns a node of
its own spun by its own executor thread: the node's responses, feedback and cancels are processed there, so a
caller may wait on a result from any thread, a timer or subscription callback of another node included.

    from simllm_ros.ros.client import SimllmClient
    client = SimllmClient()                              # rclpy.init() first; target /simllm_node
    future = client.query("Is Elm Street closed?", context=bulletin)     # a concurrent.futures.Future
    answer = future.result(timeout=60).answer            # blocking is safe, even inside a callback
    run = client.generate("Describe the town", on_feedback=lambda text: print(text))
    run.cancel()                                          # the goal ends CANCELED with the partial answer
    vectors = client.embed(["parking nearby"]).result(timeout=10)        # [n, 384] list of lists
    ranked = client.rerank("where can I charge", ["dock B", "the lift"], top_k=1).result(10)  # [(index, score)]
    client.close()

Each call takes the node's request fields as keywords (srv/Query.srv) and a timeout: past it the future fails with
TimeoutError. Until a service has answered this client once, a request it leaves unanswered for `resend_s` is sent
again, at most twice (the first answer settles the future): Fast DDS drops a service response when the node has not
yet matched a new client's response reader (rmw_fastrtps' "client will not receive response"), and neither side can
see that. After the first answer the path is known to work and nothing is sent twice; a resent question costs the
node at most a repeat of its work (an identical request: answered from its answer memo once the first is done). A
request the node refuses comes back as a response with success=false and the reason in error,
exactly as from the service. Futures complete on the client's thread: keep done-callbacks short.
"""
from __future__ import annotations

import concurrent.futures
import itertools
import os
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: rclpy is imported where a client is made (after rclpy.init)
    from rclpy.client import Client

_COUNT = itertools.count()
MAX_RESENDS = 2  # a dropped first response is the rmw's matching race: once matched, one more send arrives
RESEND_S = 10.0  # how long a first request waits for its answer before it is sent again


class GenerateRun:
    """A running Generate goal: `result` (a Future of Generate.Result) and `cancel()`."""

    def __init__(self, client: "SimllmClient"):
        self._client = client
        self.result: concurrent.futures.Future = concurrent.futures.Future()
        self._handle = None
        self._cancel_wanted = False
        self._lock = threading.Lock()

    def _accepted(self, handle) -> None:
        with self._lock:
            self._handle = handle
            wanted = self._cancel_wanted
        if wanted:
            self._client._call_soon(handle.cancel_goal_async)

    def cancel(self) -> None:
        """Ask the node to end the goal (it stops within one decode pass); safe from any thread, also before the
        goal was accepted. The result then has stop_reason "cancel" and the partial answer."""
        with self._lock:
            self._cancel_wanted = True
            handle = self._handle
        if handle is not None:
            self._client._call_soon(handle.cancel_goal_async)


class SimllmClient:
    """Futures over a simllm_node's ~/query, ~/generate, ~/embed and ~/rerank, with the node's QoS."""

    def __init__(self, target: str = "/simllm_node", context=None, wait_s: float = 30.0, resend_s: float = RESEND_S):
        # local: rclpy.action, executors and the interfaces load with a client (simllm-query reads RESEND_S first)
        import rclpy
        from rclpy.action import ActionClient
        from rclpy.executors import SingleThreadedExecutor

        from simllm_ros.action import Generate
        from simllm_ros.ros.qos import CLIENT_QOS
        from simllm_ros.srv import Embed, Query, Rerank

        self._Query, self._Embed, self._Rerank, self._Generate = Query, Embed, Rerank, Generate
        self.target = "/" + target.strip("/")
        self.wait_s = wait_s
        self.resend_s = resend_s
        self.resends = 0  # requests sent again (see the module's docstring)
        self._answered: set[str] = set()  # services that have answered this client
        self._node = rclpy.create_node(f"simllm_client_{os.getpid()}_{next(_COUNT)}", context=context)
        # the generated interfaces are untyped: their requests and responses are Any here
        self._query: Client[Any, Any] = self._node.create_client(Query, f"{self.target}/query",
                                                                 qos_profile=CLIENT_QOS)
        self._embed: Client[Any, Any] = self._node.create_client(Embed, f"{self.target}/embed",
                                                                 qos_profile=CLIENT_QOS)
        self._rerank: Client[Any, Any] = self._node.create_client(Rerank, f"{self.target}/rerank",
                                                                  qos_profile=CLIENT_QOS)
        self._action: ActionClient[Any, Any, Any] = ActionClient(self._node, Generate, f"{self.target}/generate",
                                    goal_service_qos_profile=CLIENT_QOS, result_service_qos_profile=CLIENT_QOS,
                                    cancel_service_qos_profile=CLIENT_QOS)
        self._executor = SingleThreadedExecutor(context=context)
        self._executor.add_node(self._node)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._spin, name="simllm-client", daemon=True)
        self._thread.start()

    # ---- calls ------------------------------------------------------------------------------------------
    def query(self, prompt: str = "", timeout: float = 60.0, **fields) -> concurrent.futures.Future:
        """A Future of the Query response (success=false with the reason where the node refuses)."""
        return self._service(self._query, self._Query.Request(prompt=prompt, **_request_fields(fields)), timeout)

    def embed(self, texts: list[str], timeout: float = 30.0) -> concurrent.futures.Future:
        """A Future of the texts' unit vectors (a list of lists, 384 floats each); fails with ValueError carrying
        the node's reason where it refuses."""
        def rows(resp):
            v, d = list(resp.vectors), resp.dim
            return [v[i * d:(i + 1) * d] for i in range(len(texts))]

        return self._checked(self._service(self._embed, self._Embed.Request(texts=list(texts)), timeout), rows)

    def rerank(self, query: str, documents: list[str], top_k: int = 0,
               timeout: float = 30.0) -> concurrent.futures.Future:
        """A Future of the documents ranked by closeness in meaning to the query: (index in documents, cosine score)
        pairs, best first, top_k of them (0: all); fails with ValueError carrying the node's reason where it refuses
        (srv/Rerank.srv: 1-256 documents, none empty, none longer than the embedder reads)."""
        return self._checked(self._service(self._rerank, self._Rerank.Request(
            query=query, documents=list(documents), top_k=int(top_k)), timeout),
            lambda resp: [(int(i), float(s)) for i, s in zip(resp.indices, resp.scores)])

    def _checked(self, raw: concurrent.futures.Future, convert) -> concurrent.futures.Future:
        """A Future of convert(response), or ValueError with the node's reason where success is false."""
        out: concurrent.futures.Future = concurrent.futures.Future()

        def done(f):
            try:
                resp = f.result()
            except BaseException as e:  # handed to the caller's future
                out.set_exception(e)
                return
            if not resp.success:
                out.set_exception(ValueError(resp.error))
                return
            out.set_result(convert(resp))

        raw.add_done_callback(done)
        return out

    def generate(self, prompt: str = "", on_feedback=None, timeout: float = 300.0, on_tool_feedback=None,
                 **fields) -> GenerateRun:
        """A Generate goal: `on_feedback(text_so_far)` as the answer grows (on the client's thread), and with tools
        `on_tool_feedback(json)` as the tool's action reports; the run's `result` Future holds Generate.Result;
        `cancel()` ends it (and the tool's goal)."""
        run = GenerateRun(self)
        goal = self._Generate.Goal(prompt=prompt, **_request_fields(fields))

        def feedback(m) -> None:
            if m.feedback.tool_feedback:
                if on_tool_feedback is not None:
                    on_tool_feedback(m.feedback.tool_feedback)
            elif on_feedback is not None:
                on_feedback(m.feedback.text)

        def start():
            if not self._action.server_is_ready():
                if not self._action.wait_for_server(timeout_sec=self.wait_s):
                    run.result.set_exception(TimeoutError(f"{self.target}/generate not available"))
                    return
            sent = self._action.send_goal_async(
                goal, feedback_callback=feedback if (on_feedback or on_tool_feedback) else None)
            sent.add_done_callback(lambda f: accepted(f.result()))

        def accepted(handle):
            run._accepted(handle)
            handle.get_result_async().add_done_callback(lambda f: _settle(run.result, f.result().result))

        threading.Thread(target=start, daemon=True).start()  # waiting for the server must not hold the executor
        self._expire(run.result, timeout, f"{self.target}/generate")
        return run

    def close(self) -> None:
        """Stop the client's thread and destroy its node (its futures then fail or stay as they are)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._executor.shutdown(timeout_sec=2.0)
        self._thread.join(timeout=5.0)
        self._node.destroy_node()

    # ---- internals --------------------------------------------------------------------------------------
    def _spin(self) -> None:
        # local: rclpy loads with a client, not with this module (see __init__)
        from rclpy.executors import ExternalShutdownException

        try:
            while not self._closed.is_set():
                self._executor.spin_once(timeout_sec=0.1)
        except (ExternalShutdownException, RuntimeError):  # the context was shut down under us
            pass

    def _call_soon(self, fn) -> None:
        threading.Thread(target=fn, daemon=True).start()

    def _service(self, client, request, timeout: float) -> concurrent.futures.Future:
        out: concurrent.futures.Future = concurrent.futures.Future()

        sent: list = []

        def answered(f):
            if f.cancelled():
                return
            self._answered.add(client.srv_name)
            _settle(out, f.result())

        def forget_unanswered(_):  # a late answer to one of these is dropped by rclpy, not kept pending
            remove = getattr(client, "remove_pending_request", None)
            for f in list(sent) if remove is not None else ():
                if not f.done():
                    remove(f)

        def send():
            sent.append(client.call_async(request))
            sent[-1].add_done_callback(answered)

        def call():
            if not client.service_is_ready() and not client.wait_for_service(timeout_sec=min(self.wait_s, timeout)):
                _fail(out, TimeoutError(f"{client.srv_name} not available (is the node active?)"))
                return
            send()
            # before this service has answered once, a response may be dropped unseen: ask again
            while client.srv_name not in self._answered and not self._closed.is_set() and len(sent) <= MAX_RESENDS:
                try:
                    out.exception(timeout=self.resend_s)
                    break  # settled: answered, or timed out
                except concurrent.futures.TimeoutError:
                    if client.srv_name in self._answered or self._closed.is_set():
                        break
                    self.resends += 1
                    send()
            out.add_done_callback(forget_unanswered)

        threading.Thread(target=call, daemon=True).start()  # waiting for the service must not block the caller
        self._expire(out, timeout, client.srv_name)
        return out

    def _expire(self, fut: concurrent.futures.Future, timeout: float, what: str) -> None:
        def expire() -> None:
            if not fut.done():
                _fail(fut, TimeoutError(f"no answer from {what} within {timeout:g} s"))

        timer = threading.Timer(timeout, expire)
        timer.daemon = True
        timer.start()
        fut.add_done_callback(lambda f: timer.cancel())


def _request_fields(fields: dict) -> dict:
    """Keyword fields as the messages want them: messages as ChatMessage, stop as a list."""
    # local: the generated interfaces load with a client, not with this module
    from simllm_ros.msg import ChatMessage

    out = dict(fields)
    if "messages" in out:
        out["messages"] = [m if isinstance(m, ChatMessage) else ChatMessage(role=m[0], content=m[1])
                           for m in out["messages"]]
    if "stop" in out:
        out["stop"] = list(out["stop"])
    for name in ("temperature", "approx_error_bound"):
        if name in out:
            out[name] = float(out[name])
    return out


def _settle(fut: concurrent.futures.Future, value) -> None:
    if not fut.done():
        try:
            fut.set_result(value)
        except concurrent.futures.InvalidStateError:  # the timeout won the race
            pass


def _fail(fut: concurrent.futures.Future, e: BaseException) -> None:
    try:
        fut.set_exception(e)
    except concurrent.futures.InvalidStateError:
        pass
