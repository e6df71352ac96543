"""The node's tools at run time: a request's tools become its answer's constraint, the model's calls are checked, the
allowed ones sent (a service call or an action goal), and every step is published on `~/tool_audit`.

Why in the ROS layer: sending is ROS work (clients, goals, feedback, cancel); what a call may hold and whether it is
valid is decided in serving/ (toolbox, tool_schemas, tool_call_checks), which this module only applies. The gate,
in order: the call is valid under its tool's schema and bounds (else refused, nothing sent), it becomes the tool's
message with the bounds checked again there, the tools file marks the tool executable (else not_executable), the
node's tools_execute parameter is true (else dry_run), the tool's rate limit has room (else refused). Only then is
it sent, with the tool's timeout; a missing, slow or failing server gives the call status failed and the reason,
and the node goes on.

Every event (proposed, refused, dry_run, not_executable, executed, failed, canceled) is one std_msgs/String on
~/tool_audit, a JSON object: request_id, event, tool, arguments, reason, result, time (and reasoning, on a proposed
call after the model's <think> block); `counts` feed /diagnostics.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from action_msgs.msg import GoalStatus
from rclpy.action import ActionClient
from rclpy.callback_groups import ReentrantCallbackGroup
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
from std_msgs.msg import String

from simllm_ros.model.tool_call_formats import GENERIC, HERMES, THINK_CHARS, TemplateTraits
from simllm_ros.request import ChatTurn, QueryRequest, QueryResult, ToolCallRecord, ToolResultTurn
from simllm_ros.serving.tool_call_reuse import CallReuse
from simllm_ros.serving.tool_call_checks import Call, RateLimiter, message_to_dict, to_message
from simllm_ros.serving.tool_output_formats import CallPlan, constrained_request, write_calls
from simllm_ros.serving.tool_schemas import ToolError
from simllm_ros.serving.toolbox import Toolbox

if TYPE_CHECKING:  # annotations only
    from rclpy.client import Client

AUDIT_QOS = QoSProfile(depth=200, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.VOLATILE)
SERVER_WAIT_S = 1.0  # how long a call waits for its server to be discovered before it fails as missing
POLL_S = 0.05  # cancel checks while a tool runs
MAX_AUDIT_REASONING = 4000  # characters of a proposed call's reasoning on the audit topic
EVENTS = ("proposed", "refused", "dry_run", "not_executable", "executed", "failed", "canceled")



class LockedActionClient(ActionClient):
    """rclpy's ActionClient joins the node's wait set before it makes its lock (rclpy/action/client.py), so an
    executor spinning in another thread (this node makes its tool clients while it serves: configure) may ask it
    for its entities first and die on the missing lock, leaving the node deaf. Its lock is made before it joins."""

    def __init__(self, *args: Any, **kwargs: Any):
        self._lock = threading.Lock()
        super().__init__(*args, **kwargs)

class ToolRunner:
    """The tools of one configured node (`toolbox`), their clients, rate limits and audit publisher.
    `execute()` reads the node's tools_execute parameter at each call (it changes live); `reuse`: commands reused
    by meaning under the error bound (serving/tool_call_reuse), None for exact answers only; `tool_format`: the
    model's answer format (its chat template's own, or generic: model/tool_call_formats); `traits`: whether its
    template lets it think first and the role results go back in; `max_calls()`: the node's tool_max_calls (live)."""

    def __init__(self, node, toolbox: Toolbox, execute: Callable[[], bool], reuse: CallReuse | None = None,
                 tool_format: str = GENERIC, traits: TemplateTraits | None = None,
                 max_calls: Callable[[], int] = lambda: 1):
        self._node, self.toolbox, self._execute, self.reuse = node, toolbox, execute, reuse
        self.tool_format = tool_format
        self.traits = traits or TemplateTraits()
        self._max_calls = max_calls
        self._log = node.get_logger()
        self._group = ReentrantCallbackGroup()
        self._limiter = RateLimiter()
        self._lock = threading.Lock()
        self.counts: collections.Counter = collections.Counter({e: 0 for e in EVENTS})
        self._pub = node.create_publisher(String, "~/tool_audit", AUDIT_QOS)
        # per executable tool, by its name (a tool's interface is generated, untyped: Any here)
        self._service_clients: dict[str, Client[Any, Any]] = {}
        self._action_clients: dict[str, ActionClient[Any, Any, Any]] = {}
        for tool in toolbox.tools.values():
            if not tool.executable:
                continue  # never sent: no client
            if tool.kind == "service":
                self._service_clients[tool.name] = node.create_client(tool.iface, tool.ros_name,
                                                                      callback_group=self._group)
            else:
                self._action_clients[tool.name] = LockedActionClient(node, tool.iface, tool.ros_name,
                                                                     callback_group=self._group)

    def destroy(self) -> None:
        node = self._node
        for name, client in list(self._service_clients.items()):
            try:
                node.destroy_client(client)
            except Exception as e:
                self._log.warning(f"destroying the client of tool {name}: {e}")
        for name, action in list(self._action_clients.items()):
            try:
                action.destroy()
            except Exception as e:
                self._log.warning(f"destroying the client of tool {name}: {e}")
        self._service_clients.clear()
        self._action_clients.clear()
        try:
            node.destroy_publisher(self._pub)
        except Exception as e:
            self._log.warning(f"destroying ~/tool_audit: {e}")

    # ------------------------------------------------------------------ audit
    def audit(self, request_id: str, event: str, tool: str, arguments: str = "", reason: str = "",
              result: str = "", reasoning: str = "") -> None:
        """One event on ~/tool_audit (reasoning: a proposed call's <think> text, where the model wrote one)."""
        with self._lock:
            self.counts[event] += 1
        doc = {"request_id": request_id, "event": event, "tool": tool, "arguments": arguments, "reason": reason,
               "result": result, "time": time.time()}
        if reasoning:
            doc["reasoning"] = reasoning[:MAX_AUDIT_REASONING]
        try:
            self._pub.publish(String(data=json.dumps(doc, ensure_ascii=False)))
        except Exception as e:  # the node is shutting down: the call's own result still says what happened
            self._log.warning(f"tool audit: {type(e).__name__}: {e}")

    def diagnostic_values(self) -> list[tuple[str, str]]:
        with self._lock:
            out = [(f"tool_calls_{e}", str(self.counts[e])) for e in EVENTS]
        return out + (self.reuse.diagnostic_values() if self.reuse is not None else [])

    # ------------------------------------------------------------------ requests
    def prepare(self, req: QueryRequest, names: list[str], choice: str) -> tuple[QueryRequest, CallPlan | None]:
        """The request the engine answers: for tools, its answer constrained to the calls' schema, the tools
        described before the context, and exact reuse in the engine (an approximate call comes only from answer()).
        ToolError (audited as refused) for unknown tools, a bad tool_choice, or tools with a json_schema."""
        try:
            plan = self.toolbox.plan(names, choice, self.tool_format, int(self._max_calls()),
                                     THINK_CHARS if self.traits.thinks else 0)
            if plan is not None and req.json_schema:
                raise ToolError("json_schema and tools cannot be combined: the tools' schemas constrain the answer")
        except ToolError as e:
            self.audit(req.request_id, "refused", ",".join(names), reason=str(e))
            raise
        if plan is None:
            return req, None
        return constrained_request(req, plan), plan

    def answer(self, asked: QueryRequest, req: QueryRequest, plan: CallPlan | None,
               run: Callable[[QueryRequest], QueryResult]) -> QueryResult:
        """run(req) (the engine's exact answer), or a similar command's verified call where the reuse may serve it
        (asked: the request as sent: its allow_approximate and approx_error_bound decide)."""
        if self.reuse is None or plan is None:
            return run(req)
        return self.reuse.answer(asked, req, plan, run)

    def follow_up(self, req: QueryRequest, result: QueryResult) -> QueryRequest:
        """The request of the next step: the conversation so far, the calls as the assistant's turn (in the model's
        format), and each call's result as a turn in the role the chat template maps for tool results (Llama 3's
        ipython header, Qwen's <tool_response> in a user turn: model/tool_call_formats.traits); where it maps none,
        or in the generic format, the results as one user turn (hermes: in <tool_response> blocks)."""
        calls = [Call(c.name, json.loads(c.arguments or "{}")) for c in result.tool_calls]
        turns = [*req.turns(), ChatTurn("assistant", write_calls(self.tool_format, calls))]
        if self.tool_format != GENERIC and self.traits.result_role:
            turns += [ToolResultTurn(self.traits.result_role, c.result or "{}") for c in result.tool_calls]
        elif self.tool_format == HERMES:
            turns.append(ChatTurn("user", "\n".join(f"<tool_response>\n{c.result or '{}'}\n</tool_response>"
                                                     for c in result.tool_calls)))
        else:
            turns.append(ChatTurn("user", "Tool results: " + "; ".join(f"{c.name} returned {c.result or '{}'}"
                                                                       for c in result.tool_calls)
                                  + ". Reply to the user, or call another tool."))
        return dataclasses.replace(req, prompt="", messages=turns)

    def conclude(self, plan: CallPlan, result: QueryResult, request_id: str,
                 on_feedback: Callable[[str], None] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> QueryResult:
        """The answer's calls checked and, where allowed, sent in order; the result gains them (answer: the text
        reply; reasoning: a <think> block's text). Every call is checked before any is sent: one invalid call
        refuses them all. Sending stops at the first call not sent (refused, failed, canceled, or not executable
        while tools_execute is on): the calls after it are refused, nothing of them sent."""
        if not result.success:
            return result
        try:
            parsed = self.toolbox.read(plan, result.answer)
        except ToolError as e:
            name, args = _name_args(result.answer)
            self.audit(request_id, "proposed", name, args)
            self.audit(request_id, "refused", name, args, reason=str(e))
            result.tool_calls = [ToolCallRecord(name, args, "refused", error=str(e))]
            result.success, result.error = False, f"tool call refused (nothing sent): {e}"
            return result
        result.answer, result.reasoning = parsed.text, parsed.reasoning
        errors: list[str] = []
        for call in parsed.calls:
            self.audit(request_id, "proposed", str(call.name)[:64], _arguments_json(call), reasoning=parsed.reasoning)
            try:
                self.toolbox.check_offered(plan, call)
                errors.append("")
            except ToolError as e:
                errors.append(str(e))
        bad = next((i for i, err in enumerate(errors) if err), None)
        if bad is not None:
            for i, call in enumerate(parsed.calls):
                why = errors[i] or (f"not sent: call {bad + 1} of this answer ({str(parsed.calls[bad].name)[:64]}) "
                                    "is invalid, and an answer's calls are sent all valid or not at all")
                self.audit(request_id, "refused", str(call.name)[:64], _arguments_json(call), reason=why)
                result.tool_calls.append(ToolCallRecord(str(call.name)[:64], _arguments_json(call), "refused",
                                                        error=why))
            result.success = False
            result.error = f"tool call refused (nothing sent): {errors[bad]}"
            return result
        stopped: tuple[int, ToolCallRecord] | None = None
        for i, call in enumerate(parsed.calls):
            if stopped is not None:
                why = (f"not sent: call {stopped[0] + 1} of this answer ({stopped[1].name}) was {stopped[1].status}; "
                       "the calls after it are not sent")
                self.audit(request_id, "refused", call.name, call.arguments_json, reason=why)
                result.tool_calls.append(ToolCallRecord(call.name, call.arguments_json, "refused", error=why))
                continue
            rec = self._run(call, request_id, on_feedback, should_stop)
            result.tool_calls.append(rec)
            if rec.status in ("refused", "failed", "canceled") and result.success:
                result.success = False
                result.error = f"tool {call.name} {rec.status}: {rec.error}"
                if rec.status == "canceled":
                    result.stop_reason = "cancel"
            if rec.status in ("refused", "failed", "canceled") or (rec.status == "not_executable" and self._execute()):
                stopped = (i, rec)
        return result

    def _run(self, call: Call, request_id: str, on_feedback, should_stop) -> ToolCallRecord:
        tool = self.toolbox.tools[call.name]
        args = call.arguments_json

        def end(status: str, error: str = "", result: str = "") -> ToolCallRecord:
            self.audit(request_id, status, call.name, args, reason=error, result=result)
            return ToolCallRecord(call.name, args, status, result, error)

        try:
            msg = to_message(tool, call)
        except ToolError as e:
            return end("refused", str(e))
        if not tool.executable:
            return end("not_executable", "the tools file does not mark this tool executable; nothing was sent")
        if not self._execute():
            return end("dry_run", "tools_execute is false: the call was checked, not sent")
        why = self._limiter.take(tool)
        if why:
            return end("refused", why + "; nothing was sent")
        try:
            if tool.kind == "service":
                return end(*self._call_service(tool, msg, should_stop))
            return end(*self._send_goal(tool, msg, on_feedback, should_stop))
        except Exception as e:  # a fault while sending fails this call only
            self._log.error(f"tool {tool.name}: {type(e).__name__}: {e}")
            return end("failed", f"{type(e).__name__}: {e}")

    def _wait(self, future, timeout_s: float, should_stop) -> str:
        """'done', 'timeout' or 'cancel' for a future, waited for on this thread (the executor completes it)."""
        done = threading.Event()
        future.add_done_callback(lambda _f: done.set())
        deadline = time.monotonic() + timeout_s
        while not done.wait(POLL_S):
            if should_stop is not None and should_stop():
                return "cancel"
            if time.monotonic() >= deadline:
                return "timeout"
        return "done"

    def _call_service(self, tool, request, should_stop) -> tuple[str, str, str]:
        client = self._service_clients[tool.name]
        if not client.wait_for_service(timeout_sec=min(SERVER_WAIT_S, tool.timeout_s)):
            return "failed", f"service {tool.ros_name} is not available (no server answered discovery)", ""
        future = client.call_async(request)
        how = self._wait(future, tool.timeout_s, should_stop)
        if how != "done":
            client.remove_pending_request(future)
            if how == "cancel":
                return "canceled", "the request was cancelled while the service ran", ""
            return "failed", f"service {tool.ros_name} gave no response within {tool.timeout_s:g} s", ""
        if future.exception() is not None:
            return "failed", f"service {tool.ros_name}: {future.exception()}", ""
        return "executed", "", json.dumps(message_to_dict(future.result()), ensure_ascii=False)

    def _send_goal(self, tool, goal, on_feedback, should_stop) -> tuple[str, str, str]:
        client = self._action_clients[tool.name]
        if not client.wait_for_server(timeout_sec=min(SERVER_WAIT_S, tool.timeout_s)):
            return "failed", f"action server {tool.ros_name} is not available", ""

        def feedback(fb) -> None:
            if on_feedback is not None:
                try:
                    on_feedback(json.dumps(message_to_dict(fb.feedback), ensure_ascii=False))
                except Exception as e:
                    self._log.warning(f"tool {tool.name}: relaying feedback: {e}")

        t0 = time.monotonic()
        sent = client.send_goal_async(goal, feedback_callback=feedback)
        how = self._wait(sent, tool.timeout_s, None)
        if how != "done":
            return "failed", f"action server {tool.ros_name} did not answer the goal within {tool.timeout_s:g} s", ""
        handle = sent.result()
        if handle is None or not handle.accepted:
            return "failed", f"action server {tool.ros_name} rejected the goal", ""
        got = handle.get_result_async()
        how = self._wait(got, max(0.0, tool.timeout_s - (time.monotonic() - t0)), should_stop)
        if how != "done":
            handle.cancel_goal_async()
            self._wait(got, 5.0, None)  # the server's answer to the cancel: the goal's end
            if how == "cancel":
                return "canceled", "the Generate goal was cancelled: the tool's goal was cancelled", _result(got)
            return "failed", f"no result from {tool.ros_name} within {tool.timeout_s:g} s; the goal was cancelled", \
                _result(got)
        res = got.result()
        status = res.status if res is not None else GoalStatus.STATUS_UNKNOWN
        if status == GoalStatus.STATUS_SUCCEEDED:
            return "executed", "", _result(got)
        if status == GoalStatus.STATUS_CANCELED:
            return "canceled", f"the goal was cancelled by {tool.ros_name}", _result(got)
        return "failed", f"the goal ended {_STATUS.get(status, status)}", _result(got)


_STATUS = {GoalStatus.STATUS_ABORTED: "aborted", GoalStatus.STATUS_CANCELED: "canceled",
           GoalStatus.STATUS_UNKNOWN: "unknown"}


def _result(future) -> str:
    if not future.done() or future.result() is None:
        return ""
    return json.dumps(message_to_dict(future.result().result), ensure_ascii=False)


def _arguments_json(call: Call) -> str:
    """The call's arguments as JSON for the audit (also where they are not an object)."""
    return call.arguments_json if isinstance(call.arguments, dict) else json.dumps(call.arguments)[:1000]


def _name_args(answer: str) -> tuple[str, str]:
    """The name and arguments an invalid call tried (for the audit), as far as the answer gives them."""
    try:
        doc = json.loads(answer)
    except ValueError:
        return "", ""
    if not isinstance(doc, dict):
        return "", ""
    args = doc.get("arguments")
    return str(doc.get("name", ""))[:64], json.dumps(args, ensure_ascii=False, sort_keys=True) if args else ""
