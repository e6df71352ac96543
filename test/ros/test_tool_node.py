"""Tool calls through simllm_node end to end: the real model constrained to a call, real rclpy over DDS, and a real
server node (std_srvs services, the package's NavigateTo action) that counts what reaches it. No mocks.

One node for the module; tests run in file order (tools_execute is switched live where a test needs it).
"""
import json
import threading
import time

import pytest
from action_msgs.msg import GoalStatus
from rclpy.action import ActionServer, CancelResponse
from rclpy.callback_groups import ReentrantCallbackGroup
from std_msgs.msg import String
from std_srvs.srv import SetBool, Trigger

from conftest import EDGE_YAML, wait_future, wait_until
from simllm_ros.action import Generate, NavigateTo
from simllm_ros.request import CacheResult, QueryResult
from simllm_ros.srv import Query

NODE = "simllm_node"
AUDIT = f"/{NODE}/tool_audit"
NS = "/tooltest"
NAV_FIXED = "fixed: {target: [0.0, 0.0], avoid_zones: [], note: ''}"
TOOLS = f"""
tools:
  - {{name: stop_motors, description: Stop all motors now., service: {NS}/stop, type: std_srvs/srv/Trigger,
     executable: true, timeout_s: 5, rate_limit: {{calls: 2, per_s: 600}}}}
  - {{name: set_brake, description: Engage (true) or release (false) the parking brake., service: {NS}/brake,
     type: std_srvs/srv/SetBool}}
  - {{name: stop_slow, description: Stop slowly., service: {NS}/slow, type: std_srvs/srv/Trigger, executable: true,
     timeout_s: 1}}
  - {{name: stop_missing, description: Stop via a server that is not running., service: {NS}/nobody,
     type: std_srvs/srv/Trigger, executable: true, timeout_s: 2}}
  - {{name: go_dock, description: Drive to the charging dock., action: {NS}/nav_quick,
     type: simllm_ros/action/NavigateTo, executable: true, timeout_s: 20,
     fields: {{place: {{allowed: [dock]}}, speed: {{minimum: 0.1, maximum: 0.5}}}}, {NAV_FIXED}}}
  - {{name: go_far, description: Drive to the far dock., action: {NS}/nav_long, type: simllm_ros/action/NavigateTo,
     executable: true, timeout_s: 60, fields: {{place: {{allowed: [dock]}}, speed: {{minimum: 0.1, maximum: 0.5}}}},
     {NAV_FIXED}}}
  - {{name: navigate_to, description: "Drive the robot to a named place (dock, kitchen, door) or to a point.",
     action: {NS}/navigate_to, type: simllm_ros/action/NavigateTo, executable: true, timeout_s: 120,
     fields: {{speed: {{minimum: 0.1, maximum: 0.2}}, target: {{minimum: -20.0, maximum: 20.0}},
              avoid_zones: {{maximum: 9, max_items: 2}}, note: {{max_length: 16}}}}}}
  - {{name: go_door, description: Drive to the door., action: {NS}/nav_abort, type: simllm_ros/action/NavigateTo,
     executable: true, timeout_s: 20, fields: {{place: {{allowed: [door]}}, speed: {{minimum: 0.1, maximum: 0.5}}}},
     {NAV_FIXED}}}
"""


class RobotServers:
    """The robot side: services and NavigateTo action servers that record every request and goal they get."""

    def __init__(self, context):
        import rclpy
        self.node = rclpy.create_node("robot_servers", context=context)
        self.got = {"stop": [], "brake": [], "slow": [], "nav_quick": [], "nav_long": [], "nav_abort": []}
        self.cancelled = threading.Event()
        self.long_running = threading.Event()
        g = ReentrantCallbackGroup()
        n = self.node
        n.create_service(Trigger, f"{NS}/stop", self._stop, callback_group=g)
        n.create_service(SetBool, f"{NS}/brake", self._brake, callback_group=g)
        n.create_service(Trigger, f"{NS}/slow", self._slow, callback_group=g)
        self.actions = [ActionServer(n, NavigateTo, f"{NS}/{name}", execute_callback=lambda gh, k=name: self._nav(k, gh),
                                     cancel_callback=lambda gh: CancelResponse.ACCEPT, callback_group=g)
                        for name in ("nav_quick", "nav_long", "nav_abort")]

    def _stop(self, req, res):
        self.got["stop"].append(req)
        res.success, res.message = True, "motors stopped"
        return res

    def _brake(self, req, res):
        self.got["brake"].append(req)
        res.success = True
        return res

    def _slow(self, req, res):
        self.got["slow"].append(req)
        time.sleep(3.0)
        res.success = True
        return res

    def _nav(self, kind, gh):
        self.got[kind].append(gh.request)
        gh.publish_feedback(NavigateTo.Feedback(distance_remaining=12.5))
        if kind == "nav_abort":
            gh.abort()
            return NavigateTo.Result(success=False, message="door is blocked")
        if kind == "nav_long":
            self.long_running.set()
            t0 = time.monotonic()
            while time.monotonic() - t0 < 30:
                if gh.is_cancel_requested:
                    self.cancelled.set()
                    gh.canceled()
                    return NavigateTo.Result(success=False, message="cancelled", distance_m=1.0)
                gh.publish_feedback(NavigateTo.Feedback(distance_remaining=10.0))
                time.sleep(0.05)
            gh.abort()
            return NavigateTo.Result(success=False, message="never cancelled")
        time.sleep(0.3)
        gh.succeed()
        return NavigateTo.Result(success=True, message="docked", distance_m=3.0)


@pytest.fixture(scope="module")
def h(ros_harness_factory, tmp_path_factory):
    d = tmp_path_factory.mktemp("tools")
    (d / "tools.yaml").write_text(TOOLS)
    (d / "test.yaml").write_text(
        f"{NODE}:\n  ros__parameters:\n    cache_size: \"32MB\"\n    max_new_tokens: 64\n    queue_limit: 4\n"
        f"    telemetry_period_s: 0.3\n    ttft_warn_ms: 600000.0\n    tools: \"{d / 'tools.yaml'}\"\n"
        "    tools_execute: true\n")
    harness = ros_harness_factory(NODE, [EDGE_YAML, str(d / "test.yaml")])
    harness.robot = RobotServers(harness.context)
    harness.executor.add_node(harness.robot.node)
    harness.received[AUDIT] = []
    harness.client.create_subscription(String, AUDIT, lambda m: harness._store(AUDIT, m), 200)
    return harness


def query(h, prompt, tools, choice="", timeout=180, **kw):
    kw.setdefault("max_new_tokens", 64)
    return h.call(h.query_cli, Query.Request(prompt=prompt, tools=tools, tool_choice=choice, **kw), timeout)


def audit_events(h, request_id=None):
    out = [json.loads(m.data) for m in h.messages(AUDIT)]
    return out if request_id is None else [e for e in out if e["request_id"] == request_id]


def events_for(h, tool, n_after=0, want=0):
    """(event, reason) of a tool's audit messages after the first n_after; waits (5 s) for `want` of them."""
    def found():
        got = [(e["event"], e["reason"]) for e in audit_events(h)[n_after:] if e["tool"] == tool]
        return got if len(got) >= want else None
    return wait_until(found, 5) or found() or []


def test_bad_tools_file_fails_configure_before_the_model_loads(ros_harness_factory, tmp_path):
    (tmp_path / "tools.yaml").write_text(f"- {{name: a, service: {NS}/a, type: std_srvs/srv/NoSuch}}\n")
    (tmp_path / "p.yaml").write_text(f"bad_tools_node:\n  ros__parameters:\n    tools: \"{tmp_path / 'tools.yaml'}\"\n")
    bad = ros_harness_factory("bad_tools_node", [EDGE_YAML, str(tmp_path / "p.yaml")])
    t0 = time.monotonic()
    assert bad.change_state("configure") is False and bad.state() == "unconfigured"
    assert time.monotonic() - t0 < 20  # refused before the model loads


def test_unknown_tool_refused_with_the_reason_nothing_sent(h):
    h.ensure_active()
    n = len(audit_events(h))
    r = query(h, "fly to the moon", ["fly"])
    assert not r.success and "unknown tool 'fly'" in r.error and "stop_motors" in r.error
    assert not r.tool_calls and r.generated_tokens == 0
    assert events_for(h, "fly", n, 1)[0][0] == "refused"
    r = query(h, "stop", ["stop_motors"], "sometimes")
    assert not r.success and "tool_choice 'sometimes'" in r.error
    r = h.call(h.query_cli, Query.Request(prompt="stop", tools=["stop_motors"], json_schema='{"type": "object"}'))
    assert not r.success and "json_schema and tools cannot be combined" in r.error
    assert all(not v for v in h.robot.got.values())


def test_non_executable_tool_is_proposed_never_executed(h):
    h.ensure_active()
    n = len(audit_events(h))
    r = query(h, "Engage the parking brake.", ["set_brake"], "set_brake")
    assert r.success, r.error
    assert len(r.tool_calls) == 1 and r.tool_calls[0].name == "set_brake"
    c = r.tool_calls[0]
    assert c.status == "not_executable" and "not mark this tool executable" in c.error
    assert isinstance(json.loads(c.arguments)["data"], bool) and c.result == ""
    assert r.answer == "" and r.exact
    time.sleep(0.5)
    assert h.robot.got["brake"] == []  # nothing reached the server
    assert [e for e, _ in events_for(h, "set_brake", n, 2)] == ["proposed", "not_executable"]


def test_dry_run_checks_a_call_and_sends_nothing(h):
    h.ensure_active()
    assert h.set_params(tools_execute=False)[0].successful
    try:
        r = query(h, "Stop all motors now!", ["stop_motors"], "required")
        assert r.success, r.error
        assert [(c.name, c.status, c.arguments) for c in r.tool_calls] == [("stop_motors", "dry_run", "{}")]
        assert "tools_execute is false" in r.tool_calls[0].error
        time.sleep(0.5)
        assert h.robot.got["stop"] == []
    finally:
        assert h.set_params(tools_execute=True)[0].successful


def test_service_call_executed_then_rate_limited(h):
    h.ensure_active()
    n = len(audit_events(h))
    results = [query(h, "Stop all motors now!", ["stop_motors"], "stop_motors", cache_scope=f"rate{i}")
               for i in range(3)]
    for r in results[:2]:
        assert r.success, r.error
        c = r.tool_calls[0]
        assert c.status == "executed" and json.loads(c.result) == {"success": True, "message": "motors stopped"}
    assert len(h.robot.got["stop"]) == 2
    third = results[2]
    assert not third.success and third.tool_calls[0].status == "refused"
    assert "rate limit: stop_motors was sent 2 times" in third.error
    assert len(h.robot.got["stop"]) == 2  # the third never reached the server
    assert [e for e, _ in events_for(h, "stop_motors", n, 6)] == ["proposed", "executed"] * 2 + ["proposed", "refused"]


def test_missing_and_slow_servers_fail_clearly_and_the_node_stays_up(h):
    h.ensure_active()
    t0 = time.monotonic()
    r = query(h, "Stop.", ["stop_missing"], "required")
    assert not r.success and r.tool_calls[0].status == "failed"
    assert f"service {NS}/nobody is not available" in r.error
    r = query(h, "Stop.", ["stop_slow"], "required")
    assert not r.success and r.tool_calls[0].status == "failed"
    assert f"service {NS}/slow gave no response within 1 s" in r.error
    assert len(h.robot.got["slow"]) == 1
    assert time.monotonic() - t0 < 120
    ok = h.query("What is two plus two?", max_new_tokens=8)  # the node answers the next request
    assert ok.success and ok.answer


def test_bounds_gate_refuses_an_answer_the_grammar_would_not_give(h):
    """The node's last gate, given an answer out of bounds as a model without the grammar could write it: the
    call is refused with the field named, audited, and nothing is sent even with tools_execute on."""
    runner = h.node._tools
    n = len(audit_events(h))
    plan = runner.toolbox.plan(["go_dock"], "go_dock")
    for args, words in (({"place": "dock", "speed": 3.0}, "speed: 3.0 is greater than the maximum of 0.5"),
                        ({"place": "kitchen", "speed": 0.2}, "'kitchen' is not one of ['dock']")):
        answer = json.dumps({"name": "go_dock", "arguments": args})
        out = runner.conclude(plan, QueryResult(success=True, answer=answer), "gate-test")
        assert not out.success and "tool call refused (nothing sent)" in out.error and words in out.error
        assert out.tool_calls[0].status == "refused"
    out = runner.conclude(plan, QueryResult(success=True, answer='{"name": "launch", "arguments": {}}'), "gate-test")
    assert not out.success and "does not offer" in out.error
    time.sleep(0.5)
    assert h.robot.got["nav_quick"] == []
    assert wait_until(lambda: len(audit_events(h, "gate-test")) == 6, 5)
    assert [e["event"] for e in audit_events(h, "gate-test")] == ["proposed", "refused"] * 3
    assert len(audit_events(h)) - n == 6


def test_action_goal_executed_with_feedback_relayed_and_a_failing_goal_reported(h):
    h.ensure_active()
    fb = []
    gh = wait_future(h.generate_cli.send_goal_async(Generate.Goal(
        prompt="Go to the charging dock.", tools=["go_dock"], tool_choice="required", max_new_tokens=64),
        feedback_callback=lambda m: fb.append(m.feedback)), 20)
    res = wait_future(gh.get_result_async(), 180)
    assert res.status == GoalStatus.STATUS_SUCCEEDED, res.result.error
    c = res.result.tool_calls[0]
    assert c.status == "executed" and json.loads(c.result)["message"] == "docked"
    goal = h.robot.got["nav_quick"][0]
    assert goal.place == "dock" and 0.1 <= goal.speed <= 0.5 and list(goal.target) == [0.0, 0.0]
    assert wait_until(lambda: any(f.tool_feedback for f in fb), 5)
    assert json.loads(next(f.tool_feedback for f in fb if f.tool_feedback)) == {"distance_remaining": 12.5}
    r = query(h, "Go to the door.", ["go_door"], "required")
    assert not r.success and r.tool_calls[0].status == "failed" and "the goal ended aborted" in r.error
    assert json.loads(r.tool_calls[0].result)["message"] == "door is blocked"


def test_cancel_of_the_generate_goal_cancels_the_tools_goal(h):
    h.ensure_active()
    gh = wait_future(h.generate_cli.send_goal_async(Generate.Goal(
        prompt="Drive to the far dock.", tools=["go_far"], tool_choice="go_far", max_new_tokens=64)), 20)
    assert h.robot.long_running.wait(180), "the tool's goal never started"
    wait_future(gh.cancel_goal_async(), 10)
    res = wait_future(gh.get_result_async(), 30)
    assert h.robot.cancelled.is_set()
    assert res.status == GoalStatus.STATUS_CANCELED and res.result.stop_reason == "cancel"
    assert res.result.tool_calls[0].status == "canceled"
    assert json.loads(res.result.tool_calls[0].result)["message"] == "cancelled"


def test_identical_commands_give_identical_calls_with_and_without_the_cache(h):
    """Greedy: the same command gives the same call from a fresh scope (no cache), again (the exact memo) and with
    allow_approximate set (a request with tools is served exactly only: no approximate call)."""
    h.ensure_active()
    cmd = "Please release the parking brake so we can move."
    first = query(h, cmd, ["set_brake", "go_dock"], "required", cache_scope="same1")
    again = query(h, cmd, ["set_brake", "go_dock"], "required", cache_scope="same1", allow_approximate=True)
    fresh = query(h, cmd, ["set_brake", "go_dock"], "required", cache_scope="same2")
    para = query(h, "Please release the parking brake so we can go.", ["set_brake", "go_dock"], "required",
                 cache_scope="same1", allow_approximate=True)
    calls = [[(c.name, c.arguments) for c in r.tool_calls] for r in (first, again, fresh)]
    assert all(r.success for r in (first, again, fresh, para)), [r.error for r in (first, again, fresh, para)]
    assert calls[0] == calls[1] == calls[2] and len(calls[0]) == 1
    assert first.cache_result == CacheResult.MISS and again.cache_result == CacheResult.EXACT_PREFIX
    assert again.generated_tokens == first.generated_tokens and again.exact  # the memo: no model pass
    assert fresh.cache_result == CacheResult.MISS
    assert para.exact and para.cache_result in (CacheResult.MISS, CacheResult.EXACT_PREFIX)  # never approximate


def test_diagnostics_count_every_call(h):
    names = ("proposed", "refused", "executed", "failed", "canceled", "dry_run", "not_executable")

    def audited():
        events = audit_events(h)
        return {f"tool_calls_{e}": str(sum(1 for x in events if x["event"] == e)) for e in names}

    def counted():
        for m in reversed(h.messages("/diagnostics")):
            for st in m.status:
                vals = {kv.key: kv.value for kv in st.values}
                if "tool_calls_proposed" in vals:
                    return {f"tool_calls_{e}": vals[f"tool_calls_{e}"] for e in names}
        return None
    assert wait_until(lambda: counted() == audited(), 10), (counted(), audited())
    assert int(audited()["tool_calls_executed"]) >= 3 and int(audited()["tool_calls_canceled"]) >= 1

def test_tokenize_and_detokenize_services(h):
    """~/tokenize and ~/detokenize (item 6 of the issue) on the same node: the model's own tokenizer, round trip,
    and clear refusals for bad input."""
    from simllm_ros.ros.qos import CLIENT_QOS
    from simllm_ros.srv import Detokenize, Tokenize
    h.ensure_active()
    tok = h.client.create_client(Tokenize, f"/{NODE}/tokenize", qos_profile=CLIENT_QOS)
    detok = h.client.create_client(Detokenize, f"/{NODE}/detokenize", qos_profile=CLIENT_QOS)
    text = "Go to the charging dock, then stop."
    r = h.call(tok, Tokenize.Request(text=text), 30)
    assert r.success, r.error
    assert len(r.tokens) == len(r.pieces) > 3 and "".join(r.pieces) == text
    assert list(r.tokens) == h.node._engine.backend.tokenizer(text, add_special_tokens=False)["input_ids"]
    back = h.call(detok, Detokenize.Request(tokens=list(r.tokens)), 30)
    assert back.success and back.text == text
    for req, words in ((Tokenize.Request(text=""), "text is empty"),
                       (Tokenize.Request(text="a\x07b"), "control character U+0007")):
        bad = h.call(tok, req, 30)
        assert not bad.success and words in bad.error
    bad = h.call(detok, Detokenize.Request(tokens=[1, 10**9]), 30)
    assert not bad.success and "tokens[1] = 1000000000 is outside the vocabulary" in bad.error
    assert h.query("What is two plus two?", max_new_tokens=4).success  # the node goes on


def test_topic_request_with_tools_and_auto_choice(h):
    """~/requests -> ~/responses carries calls too (checked on a thread of their own); under tool_choice auto the
    answer is a text reply or a call, either one checked."""
    h.ensure_active()
    n = len(h.messages(f"/{NODE}/responses"))
    h.publish_request("tools-topic-1", "Engage the parking brake.", max_new_tokens=64, tools=["set_brake"],
                      tool_choice="set_brake")
    h.publish_request("tools-topic-2", "Engage the parking brake.", max_new_tokens=64, tools=["set_brake"],
                      tool_choice="auto")
    got = {}
    for rid in ("tools-topic-1", "tools-topic-2"):
        got[rid] = h.wait_message(f"/{NODE}/responses", lambda m, r=rid: m.request_id == r, timeout=180, after=n)
        assert got[rid] is not None and got[rid].success, rid
    one = got["tools-topic-1"]
    assert [(c.name, c.status) for c in one.tool_calls] == [("set_brake", "not_executable")]
    auto = got["tools-topic-2"]
    assert (auto.tool_calls and auto.tool_calls[0].status == "not_executable") or \
        (not auto.tool_calls and auto.answer)
    assert h.robot.got["brake"] == []


def test_results_go_back_to_the_model_up_to_tool_max_steps(h):
    """With tool_max_steps 2, an executed call's result is the next turn and the model answers again (text or
    another call); with 1 (the default) a request ends at its call. The second step's prompt holds the call and its
    result, so it is longer than the first's. What the 135M model says then is not under test: greedy, it starts a
    text reply that runs past max_new_tokens (the answer then fails as any cut-off JSON does, the executed call
    still listed)."""
    h.ensure_active()
    one = query(h, "Go to the charging dock.", ["go_dock"], "required", cache_scope="steps1")
    assert one.success and one.answer == "" and len(one.tool_calls) == 1
    assert h.set_params(tool_max_steps=2)[0].successful
    try:
        n = len(h.robot.got["nav_quick"])
        r = query(h, "Go to the charging dock.", ["go_dock"], "required", cache_scope="steps2", max_new_tokens=96)
    finally:
        assert h.set_params(tool_max_steps=1)[0].successful
    assert r.tool_calls[0].status == "executed" and json.loads(r.tool_calls[0].result)["message"] == "docked"
    assert r.prompt_tokens > one.prompt_tokens + 10  # the last step read the call and its result
    if r.success:
        assert r.answer or (len(r.tool_calls) == 2 and r.tool_calls[1].status == "executed"), (r.answer, r.tool_calls)
    else:
        assert "reached max_new_tokens (96)" in r.error and r.generated_tokens == 96
    assert len(h.robot.got["nav_quick"]) == n + len(r.tool_calls)


def test_the_robot_example_a_command_becomes_a_goal_and_cancel_stops_it(h):
    """README's robot example as written there: the client library sends a command with the navigate_to tool to
    ~/generate; the package's example server (examples/navigate_server.py) drives, its feedback comes back as the
    Generate goal's tool_feedback; cancelling the Generate goal stops the drive."""
    import importlib.util

    from conftest import REPO
    from simllm_ros.ros.client import SimllmClient
    spec = importlib.util.spec_from_file_location("navigate_server", f"{REPO}/examples/navigate_server.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    h.ensure_active()
    server = example.NavigateToServer(h.robot.node, f"{NS}/navigate_to", start=(8.0, 8.0))  # far from every place
    client = SimllmClient(f"/{NODE}", context=h.context)
    try:
        feedback = []
        run = client.generate("Go to the kitchen.", tools=["navigate_to"], tool_choice="navigate_to",
                              max_new_tokens=96, on_tool_feedback=feedback.append)
        assert server.running.wait(180), "the goal never started"
        assert wait_until(lambda: any(feedback), 10)
        run.cancel()
        result = run.result.result(timeout=30)
        assert result.stop_reason == "cancel" and not result.success
        call = result.tool_calls[0]
        assert call.name == "navigate_to" and call.status == "canceled"
        assert json.loads(call.result)["message"].startswith("stopped")
        assert server.outcomes == ["canceled"]
        assert "distance_remaining" in json.loads(next(f for f in feedback if f))
    finally:
        client.close()
        server.destroy()



def test_simllm_query_names_tools_and_prints_the_calls(h):
    """simllm-query --tool/--tool-choice as a process on the test's ROS domain: the calls come back as JSON."""
    import os
    import subprocess
    import sys

    from conftest import REPO
    h.ensure_active()
    q = subprocess.run([sys.executable, "-m", "simllm_ros.cli.query", "Engage the parking brake.", "--tool",
                        "set_brake", "--tool-choice", "set_brake", "--max-new-tokens", "64", "--timeout", "120"],
                       cwd=REPO, env=dict(os.environ), capture_output=True, text=True, timeout=180)
    assert q.returncode == 0, q.stderr[-2000:]
    out = json.loads(q.stdout)
    assert out["success"], out["error"]
    assert [(c["name"], c["status"]) for c in out["tool_calls"]] == [("set_brake", "not_executable")]
    assert isinstance(json.loads(out["tool_calls"][0]["arguments"])["data"], bool)


def test_several_calls_checked_then_sent_in_order_and_the_first_not_sent_stops_the_rest(h):
    """An answer with several calls in a template's format (hermes blocks, as Qwen writes them; given as the
    answer text, the node's gate under test): every call is checked before any is sent; they are sent in order;
    a call that fails stops the calls after it (refused, nothing of them sent); one invalid call refuses all."""
    from simllm_ros.model.tool_call_formats import HERMES, TemplateTraits
    from simllm_ros.request import QueryRequest, ToolResultTurn
    from simllm_ros.serving.tool_call_checks import Call
    from simllm_ros.serving.tool_output_formats import write_calls
    from simllm_ros.validation import validate_messages
    h.ensure_active()
    runner = h.node._tools
    own = runner.tool_format, runner.traits
    try:
        runner.tool_format, runner.traits = HERMES, TemplateTraits(result_role="tool")
        plan = runner.toolbox.plan(["go_dock", "go_door"], "required", HERMES, max_calls=4)
        dock = Call("go_dock", {"place": "dock", "speed": 0.2})
        n = len(h.robot.got["nav_quick"])
        ok = runner.conclude(plan, QueryResult(success=True, answer=write_calls(HERMES, [dock, dock])), "multi-ok")
        assert ok.success, ok.error
        assert [(c.name, c.status) for c in ok.tool_calls] == [("go_dock", "executed")] * 2
        assert len(h.robot.got["nav_quick"]) == n + 2
        # the results go back in the template's tool role, one turn per call, after the calls as one assistant turn
        asked = QueryRequest(prompt="Go to the dock twice.")
        nxt = runner.follow_up(asked, ok)
        assert [t.role for t in nxt.messages] == ["user", "assistant", "tool", "tool"]
        assert isinstance(nxt.messages[-1], ToolResultTurn) and json.loads(nxt.messages[-1].content)["success"]
        assert nxt.messages[1].content == write_calls(HERMES, [dock, dock]) and validate_messages(nxt) is None

        door, slow = Call("go_door", {"place": "door", "speed": 0.2}), Call("go_dock", {"place": "dock", "speed": 0.3})
        n_door = len(h.robot.got["nav_abort"])
        out = runner.conclude(plan, QueryResult(success=True, answer=write_calls(HERMES, [dock, door, slow])),
                              "multi-stop")
        assert not out.success and "tool go_door failed" in out.error
        assert [c.status for c in out.tool_calls] == ["executed", "failed", "refused"]
        assert "call 2 of this answer (go_door) was failed" in out.tool_calls[2].error
        assert len(h.robot.got["nav_quick"]) == n + 3 and len(h.robot.got["nav_abort"]) == n_door + 1
        assert [g.speed for g in h.robot.got["nav_quick"][-1:]] == [pytest.approx(0.2)]  # the 0.3 goal never sent

        bad = Call("go_dock", {"place": "dock", "speed": 3.0})
        out = runner.conclude(plan, QueryResult(success=True, answer=write_calls(HERMES, [dock, bad])), "multi-bad")
        assert not out.success and "tool call refused (nothing sent)" in out.error and "maximum" in out.error
        assert [c.status for c in out.tool_calls] == ["refused", "refused"]
        assert "call 2 of this answer (go_dock) is invalid" in out.tool_calls[0].error
        time.sleep(0.3)
        assert len(h.robot.got["nav_quick"]) == n + 3  # nothing of that answer was sent
        assert wait_until(lambda: [e["event"] for e in audit_events(h, "multi-stop")] ==
                          ["proposed"] * 3 + ["executed", "failed", "refused"], 5)
        assert [e["event"] for e in audit_events(h, "multi-bad")] == ["proposed"] * 2 + ["refused"] * 2
    finally:
        runner.tool_format, runner.traits = own


def test_a_tool_action_client_has_its_lock_when_it_joins_the_wait_set():
    """rclpy's ActionClient joins its node's wait set before it makes its lock: an executor spinning in another
    thread then may call get_num_entities on it and die (it did, in a fresh clone: the node configured, made its tool
    clients, and every later test of this file timed out). The node's tool clients have the lock first."""
    import rclpy
    from rclpy.action import ActionClient
    from rclpy.node import Node

    from simllm_ros.ros.tool_executor import LockedActionClient

    seen = []

    class Watching(Node):
        def add_waitable(self, waitable):
            if isinstance(waitable, ActionClient):  # the node's own waitables (its services) aside
                seen.append(hasattr(waitable, "_lock"))
            super().add_waitable(waitable)

    context = rclpy.Context()
    rclpy.init(context=context)
    try:
        node = Watching("lock_watch", context=context)
        client = LockedActionClient(node, NavigateTo, "/lock_watch/nav")
        assert seen == [True]
        client.destroy()
        node.destroy_node()
    finally:
        rclpy.shutdown(context=context)
