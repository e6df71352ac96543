"""The node's request interfaces: service `~/query`, topic `~/requests` -> `~/responses`, action `~/generate`
and services `~/embed`, `~/tokenize`, `~/detokenize` and `~/rerank`.

Why a class of its own: the node's lifecycle decides when these exist and which request server and engine
stand behind them; what a callback does with a request is the same whatever the state, so it lives here, and
the node file keeps its transitions and telemetry. Every callback belongs to one reentrant group, so several
requests are prepared (validated, fingerprinted) while another one generates on the server's worker.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable

from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.callback_groups import ReentrantCallbackGroup
from rclpy.validate_full_topic_name import validate_full_topic_name

from simllm_ros.action import Generate
from simllm_ros.serving.engine import Engine
from simllm_ros.msg import QueryRequest as QueryRequestMsg, QueryResponse
from simllm_ros.request import Progress, QueryResult
from simllm_ros.serving.request_server import DRAIN_TIMEOUT_S, RequestServer, internal_error, not_active_error
from simllm_ros.ros.messages import fill_result, request_from, u32
from simllm_ros.ros.qos import REQUEST_QOS, RESPONSE_QOS
from simllm_ros.ros.tool_executor import ToolRunner
from simllm_ros.serving.tool_schemas import ToolError
from simllm_ros.serving import rerank, tokens
from simllm_ros.srv import Detokenize, Embed, Query, Rerank, Tokenize

GOAL_POLL_S = 0.1  # a goal cancelled while it waits in the queue is withdrawn within this
# How long an ended goal's result and status are kept (rclpy's default is 10 s): within it a cancel of an ended
# goal, e.g. one aborted as busy, gets ERROR_GOAL_TERMINATED as for any ended goal, not ERROR_UNKNOWN_GOAL_ID.
GOAL_RESULT_KEEP_S = 900


class RequestEndpoints:
    """The request entities of `node`, answering through the request server and engine the node holds now
    (`server()`, `engine()`: None refuses as not active, in `state()`).

    `create_responses` at configure (refusals reach topic clients while inactive too), `create` at the first
    activate (a client waiting for the service is never answered "not active" by a node merely configuring),
    `wait_for_replies` and `destroy` at cleanup."""

    def __init__(self, node, server: Callable[[], RequestServer | None], engine: Callable[[], Engine | None],
                 state: Callable[[], str], tools: Callable[[], "ToolRunner | None"] = lambda: None):
        self._node, self._server, self._engine, self._state = node, server, engine, state
        self._tools = tools  # the configured node's ToolRunner: requests with tools go through it
        self._log = node.get_logger()
        self._group = ReentrantCallbackGroup()
        self._scope_pubs: dict[str, object] = {}  # responses_per_scope: topic -> publisher
        self._scope_pubs_lock = threading.Lock()
        # Service and goal callbacks still running: rclpy sends their reply after they return.
        self._calls = threading.Condition()
        self._service_calls = 0
        # the entities, None until created (`node` is untyped: its entities are Any here)
        self._srv = self._embed_srv = self._sub = self._pub_responses = None
        self._tokenize_srv = self._detokenize_srv = self._rerank_srv = None
        self._action: ActionServer[Any, Any, Any] | None = None

    # ------------------------------------------------------------------ entities
    def create_responses(self) -> None:
        """~/responses, a plain publisher: refusals ("node is not active") reach topic clients while inactive."""
        self._pub_responses = self._node.create_publisher(QueryResponse, "~/responses", RESPONSE_QOS)

    def create(self) -> None:
        """The services, the action and the request subscription; they stay through deactivate, answering
        refusals, until cleanup."""
        node, group = self._node, self._group
        if self._srv is None:
            self._srv = node.create_service(Query, "~/query", self._on_query_service, qos_profile=REQUEST_QOS,
                                            callback_group=group)
        if self._embed_srv is None:
            self._embed_srv = node.create_service(Embed, "~/embed", self._on_embed_service, qos_profile=REQUEST_QOS,
                                                  callback_group=group)
        if self._tokenize_srv is None:
            self._tokenize_srv = node.create_service(Tokenize, "~/tokenize", self._on_tokenize_service,
                                                     qos_profile=REQUEST_QOS, callback_group=group)
            self._detokenize_srv = node.create_service(Detokenize, "~/detokenize", self._on_detokenize_service,
                                                       qos_profile=REQUEST_QOS, callback_group=group)
        if self._rerank_srv is None:
            self._rerank_srv = node.create_service(Rerank, "~/rerank", self._on_rerank_service,
                                                   qos_profile=REQUEST_QOS, callback_group=group)
        if self._action is None:
            self._action = ActionServer(node, Generate, "~/generate", execute_callback=self._on_goal,
                                        goal_callback=lambda goal: GoalResponse.ACCEPT,
                                        cancel_callback=lambda goal_handle: CancelResponse.ACCEPT,
                                        goal_service_qos_profile=REQUEST_QOS, result_service_qos_profile=REQUEST_QOS,
                                        cancel_service_qos_profile=REQUEST_QOS, callback_group=group,
                                        result_timeout=GOAL_RESULT_KEEP_S)
        if self._sub is None:
            self._sub = node.create_subscription(QueryRequestMsg, "~/requests", self._on_request_msg, REQUEST_QOS,
                                                 callback_group=group)

    def destroy(self) -> None:
        """Every entity, per-scope publishers first; a failure is logged, the others still go."""
        node = self._node
        with self._scope_pubs_lock:
            pubs, self._scope_pubs = list(self._scope_pubs.values()), {}
        for pub in pubs:
            try:
                node.destroy_publisher(pub)
            except Exception as e:
                self._log.warning(f"destroying a per-scope responses publisher: {e}")
        destroyers = {"_srv": node.destroy_service, "_embed_srv": node.destroy_service,
                      "_tokenize_srv": node.destroy_service, "_detokenize_srv": node.destroy_service,
                      "_rerank_srv": node.destroy_service,
                      "_action": lambda action: action.destroy(), "_sub": node.destroy_subscription,
                      "_pub_responses": node.destroy_publisher}
        for attr, destroy in destroyers.items():
            ent = getattr(self, attr)
            if ent is None:
                continue
            setattr(self, attr, None)
            try:
                destroy(ent)
            except Exception as e:
                self._log.warning(f"destroying {attr[1:]}: {e}")

    def wait_for_replies(self, why: str) -> None:
        """rclpy sends a service reply after the callback returns: destroying the service before that
        would lose the reply (InvalidHandle in the executor). Wait for running callbacks, then a grace."""
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        with self._calls:
            waited = self._service_calls > 0
            while self._service_calls and time.monotonic() < deadline:
                self._calls.wait(timeout=0.2)
            if self._service_calls:
                self._log.warning(f"{why}: {self._service_calls} service call(s) still running")
        if waited:
            time.sleep(0.2)

    @contextlib.contextmanager
    def _service_call(self):
        """A service or goal callback in progress: deactivate and cleanup wait for these to finish."""
        with self._calls:
            self._service_calls += 1
        try:
            yield
        finally:
            with self._calls:
                self._service_calls -= 1
                self._calls.notify_all()

    # ------------------------------------------------------------------ callbacks
    def _answer(self, what: str, make_request, msg, poll_s: float = 1.0,
                tool_feedback: Callable[[str], None] | None = None, **submit) -> QueryResult:
        """One request through the request server, waited for; a refusal or a fault as a failed result. With
        tools (msg.tools, msg.tool_choice) the answer is a checked call, sent where the node allows it."""
        try:
            req = make_request()
            server = self._server()
            if server is None:
                return QueryResult.failure(not_active_error(self._state()))
            asked = req
            req, plan = self._tool_plan(req, msg)
            if plan is None:
                return server.wait(server.submit(req, **submit), poll_s=poll_s)
            runner, engine = self._tools(), self._engine()
            if runner is None:  # the tools went (cleanup) since the plan was made
                return QueryResult.failure(not_active_error(self._state()))
            result = runner.answer(asked, req, plan, lambda r: server.wait(server.submit(r, **submit), poll_s=poll_s))
            max_steps = engine.settings.tool_max_steps if engine is not None else 1
            result = runner.conclude(plan, result, req.request_id, tool_feedback, submit.get("should_stop"))
            calls = list(result.tool_calls)
            for _ in range(max_steps - 1):  # the results as turns, the model answers again
                if not (result.success and result.tool_calls
                        and all(c.status == "executed" for c in result.tool_calls)):
                    break
                asked = runner.follow_up(asked, result)
                req, next_plan = runner.prepare(asked, [t.name for t in plan.tools], "auto")
                if next_plan is None:  # not reached: the same tools with "auto" always plan
                    break
                plan = next_plan
                result = server.wait(server.submit(req, **submit), poll_s=poll_s)
                result = runner.conclude(plan, result, req.request_id, tool_feedback, submit.get("should_stop"))
                calls += result.tool_calls
            result.tool_calls = calls
            return result
        except ToolError as e:
            return QueryResult.failure(str(e))
        except Exception as e:
            self._log.error(f"{what}: {type(e).__name__}: {e}")
            return QueryResult.failure(internal_error(e))

    def _tool_plan(self, req, msg):
        """(the request the engine answers, the tool plan or None); ToolError for tools the node cannot offer."""
        names, choice = list(msg.tools), str(msg.tool_choice)
        runner = self._tools()
        if runner is None:
            if names and choice != "none":
                raise ToolError("this node has no tools (its tools parameter names no tools file)")
            return req, None
        return runner.prepare(req, names, choice)

    def _on_query_service(self, request: Query.Request, response: Query.Response) -> Query.Response:
        with self._service_call():
            result = self._answer("query service", lambda: request_from(request), request)
        return fill_result(response, result)

    def _on_request_msg(self, msg: QueryRequestMsg) -> None:
        try:
            req = request_from(msg, msg.request_id)
            server, engine, scope = self._server(), self._engine(), req.cache_scope
            if server is None:
                self.publish_response(QueryResult.failure(not_active_error(self._state()), req.request_id), scope)
            elif engine is not None and engine.settings.responses_per_scope and self.scope_topic(scope) is None:
                self.publish_response(QueryResult.failure(
                    f"cache_scope {scope[:80]!r} cannot name a topic: with responses_per_scope, a scope must be a "
                    "ROS name (letters, digits, _ and /, no part starting with a digit)", req.request_id), scope)
            else:
                try:
                    req, plan = self._tool_plan(req, msg)
                except ToolError as e:
                    self.publish_response(QueryResult.failure(str(e), req.request_id), scope)
                    return
                done = (lambda r: self.publish_response(r, scope)) if plan is None else \
                    (lambda r: self._conclude_later(plan, r, scope))
                server.submit(req, done, unique_id=True)
        except Exception as e:
            self._log.error(f"request topic: {type(e).__name__}: {e}")
            self.publish_response(QueryResult.failure(internal_error(e), getattr(msg, "request_id", "")),
                                  getattr(msg, "cache_scope", ""))

    def _on_goal(self, goal_handle) -> Generate.Result:
        """One goal of ~/generate: through the same admission as the service; feedback as the answer grows;
        cancel ends it within one decode pass (or at once while it waits in the queue). A refusal or a bad
        goal is aborted with the reason in the result's error."""
        with self._service_call():
            result = self._answer(
                "generate action",
                lambda: request_from(goal_handle.request, "goal-" + bytes(goal_handle.goal_id.uuid).hex()[:8]),
                goal_handle.request, poll_s=GOAL_POLL_S, on_progress=lambda p: self._send_feedback(goal_handle, p),
                tool_feedback=lambda fb: goal_handle.publish_feedback(Generate.Feedback(tool_feedback=fb)),
                should_stop=lambda: goal_handle.is_cancel_requested)
        try:
            if result.stop_reason == "cancel" and goal_handle.is_cancel_requested:
                goal_handle.canceled()
            elif result.success:
                goal_handle.succeed()
            else:
                goal_handle.abort()
        except Exception as e:  # the goal may already be gone (node shutting down)
            self._log.warning(f"generate action: ending goal: {type(e).__name__}: {e}")
        return fill_result(Generate.Result(), result)

    def _conclude_later(self, plan, result: QueryResult, scope: str) -> None:
        """A topic request's calls are checked and sent on a thread of their own: the request server's worker,
        which hands the answer over, must not wait for a tool."""
        def run():
            try:
                out = self._tools().conclude(plan, result, result.request_id)
            except Exception as e:
                self._log.error(f"request topic, tools: {type(e).__name__}: {e}")
                out = QueryResult.failure(internal_error(e), result.request_id)
            self.publish_response(out, scope)
        threading.Thread(target=run, name="tool-call", daemon=True).start()

    @staticmethod
    def _send_feedback(goal_handle, p: Progress) -> None:
        goal_handle.publish_feedback(Generate.Feedback(text=p.text, generated_tokens=u32(p.generated_tokens),
                                                       cache_result=int(p.cache_result)))

    def _on_embed_service(self, request: Embed.Request, response: Embed.Response) -> Embed.Response:
        with self._service_call():
            try:
                engine = self._engine()
                if engine is None or self._state() != "active":
                    response.success, response.error = False, not_active_error(self._state())
                    return response
                try:
                    vectors = engine.embed(list(request.texts))
                except ValueError as e:
                    response.success, response.error = False, str(e)
                    return response
                response.success = True
                response.dim = u32(vectors.shape[1])
                response.vectors = vectors.reshape(-1).astype("float32").tolist()
            except Exception as e:
                self._log.error(f"embed service: {type(e).__name__}: {e}")
                response.success, response.error = False, internal_error(e)
        return response

    def _on_tokenize_service(self, request: Tokenize.Request, response: Tokenize.Response) -> Tokenize.Response:
        def run():
            response.tokens, response.pieces = tokens.tokenize(self._engine(), request.text)
        return self._tokenizer_call("tokenize", run, response)

    def _on_detokenize_service(self, request: Detokenize.Request,
                               response: Detokenize.Response) -> Detokenize.Response:
        def run():
            response.text = tokens.detokenize(self._engine(), list(request.tokens), request.skip_special_tokens)
        return self._tokenizer_call("detokenize", run, response)

    def _on_rerank_service(self, request: Rerank.Request, response: Rerank.Response) -> Rerank.Response:
        def run():
            ranking = rerank.rerank_on(self._engine(), request.query, list(request.documents), int(request.top_k))
            response.indices = [u32(i) for i in ranking.indices]
            response.scores = ranking.scores
        return self._tokenizer_call("rerank", run, response)

    def _tokenizer_call(self, what: str, run, response):
        """~/tokenize, ~/detokenize and ~/rerank: no queue (the model does not run); bad input gets the reason."""
        with self._service_call():
            try:
                if self._engine() is None or self._state() != "active":
                    response.success, response.error = False, not_active_error(self._state())
                    return response
                run()
                response.success = True
            except ValueError as e:
                response.success, response.error = False, str(e)
            except Exception as e:
                self._log.error(f"{what} service: {type(e).__name__}: {e}")
                response.success, response.error = False, internal_error(e)
        return response

    # ------------------------------------------------------------------ responses
    def _responses_publisher(self, scope: str):
        """The shared ~/responses, or with responses_per_scope ~/responses/<scope> (created on first use).
        A scope that is no valid ROS name part (it holds '.', ':' or '-', or a part starts with a digit)
        gets the shared topic; its request was refused (see _on_request_msg), so only an error goes there."""
        engine = self._engine()
        if engine is None or not engine.settings.responses_per_scope or self._pub_responses is None:
            return self._pub_responses
        topic = self.scope_topic(scope)
        if topic is None:
            return self._pub_responses
        with self._scope_pubs_lock:
            pub = self._scope_pubs.get(topic)
            if pub is None:
                pub = self._node.create_publisher(QueryResponse, topic, RESPONSE_QOS)
                self._scope_pubs[topic] = pub
            return pub

    def scope_topic(self, scope: str) -> str | None:
        """'/simllm_node/responses/kiosk_3' for scope 'kiosk_3' ('' -> .../default); None if not a valid name."""
        topic = f"{self._node.get_fully_qualified_name()}/responses/{scope or 'default'}"
        try:
            validate_full_topic_name(topic)
        except Exception:
            return None
        return topic

    def publish_response(self, result: QueryResult, scope: str = "") -> None:
        pub = self._responses_publisher(scope)
        if pub is None:
            self._log.warning(f"request {result.request_id!r}: no response publisher (node cleaned up)")
            return
        out = fill_result(QueryResponse(), result)
        out.request_id = str(result.request_id or "")
        pub.publish(out)
