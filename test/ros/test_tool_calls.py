"""Tool calls without a node: schemas from real ROS interface types, the tools file's checks, calls checked against
schema and bounds, and the message a call becomes (serving/tool_schemas.py, toolbox.py, tool_call_checks.py). No
model, no DDS."""
import json
import os

import jsonschema
import pytest

from conftest import REPO
from simllm_ros.serving.tool_call_checks import Call, RateLimiter, message_to_dict, to_message
from simllm_ros.serving.tool_schemas import ToolError, message_schema
from simllm_ros.serving.toolbox import load_tools

EXAMPLE = os.path.join(REPO, "config", "tools.example.yaml")


def write(tmp_path, text: str) -> str:
    p = tmp_path / "tools.yaml"
    p.write_text(text)
    return str(p)


def test_schema_nested_message_with_int_ranges():
    from geometry_msgs.msg import PoseStamped
    s = message_schema(PoseStamped)
    stamp = s["properties"]["header"]["properties"]["stamp"]["properties"]
    assert stamp["sec"] == {"type": "integer", "minimum": -2**31, "maximum": 2**31 - 1}
    assert stamp["nanosec"] == {"type": "integer", "minimum": 0, "maximum": 2**32 - 1}
    pos = s["properties"]["pose"]["properties"]["position"]
    assert pos["required"] == ["x", "y", "z"] and pos["additionalProperties"] is False
    assert pos["properties"]["x"] == {"type": "number"}  # float64: any JSON number fits
    ok = {"header": {"stamp": {"sec": 1, "nanosec": 2}, "frame_id": "map"},
          "pose": {"position": {"x": 1.0, "y": 2, "z": 0}, "orientation": {"x": 0, "y": 0, "z": 0, "w": 1}}}
    jsonschema.validate(ok, s)
    with pytest.raises(jsonschema.ValidationError):  # nanosec is a uint32
        jsonschema.validate({**ok, "header": {"stamp": {"sec": 1, "nanosec": -1}, "frame_id": "map"}}, s)


def test_schema_arrays_bounded_strings_and_enum_from_constants():
    from geometry_msgs.msg import Polygon

    from simllm_ros.action import NavigateTo
    poly = message_schema(Polygon)["properties"]["points"]
    assert poly["type"] == "array" and "maxItems" not in poly  # unbounded sequence of Point32
    assert poly["items"]["properties"]["x"]["maximum"] == pytest.approx(3.4028234663852886e38)  # float32
    goal = message_schema(NavigateTo.Goal)["properties"]
    assert goal["target"] == {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 2}
    assert goal["avoid_zones"] == {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255},
                                   "maxItems": 4}  # uint8[<=4]
    assert goal["note"] == {"type": "string", "maxLength": 32}  # string<=32
    assert goal["place"]["enum"] == ["dock", "kitchen", "door", "point"]  # PLACE_* constants
    assert "PLACE_DOCK='dock'" in goal["place"]["description"]
    from action_msgs.msg import GoalStatus
    assert message_schema(GoalStatus)["properties"]["status"]["enum"] == [0, 1, 2, 3, 4, 5, 6]


def test_example_tools_file_narrows_the_schema():
    box = load_tools(EXAMPLE)
    assert set(box.tools) == {"navigate_to", "set_brake", "stop_motors"}
    nav = box.tools["navigate_to"]
    assert nav.kind == "action" and nav.executable and nav.rate_calls == 2
    p = nav.schema["properties"]
    assert (p["speed"]["minimum"], p["speed"]["maximum"]) == (0.1, 1.0)
    assert p["target"]["items"] == {"type": "number", "minimum": -20.0, "maximum": 20.0}
    assert p["avoid_zones"]["maxItems"] == 2 and p["avoid_zones"]["items"]["maximum"] == 9
    assert p["note"]["maxLength"] == 16
    assert box.tools["set_brake"].executable is False and box.tools["set_brake"].kind == "service"
    assert box.tools["stop_motors"].schema["properties"] == {}  # Trigger's request is empty


@pytest.mark.parametrize("body, words", [
    ("- {name: a, service: /a, type: std_srvs/srv/NoSuch}", "unknown interface type std_srvs/srv/NoSuch"),
    ("- {name: a, service: /a, type: nosuch_pkg/srv/X}", "is package nosuch_pkg built"),
    ("- {name: a, service: /a, type: simllm_ros/action/NavigateTo}", "is a action type, but the tool names a service"),
    ("- {name: a, action: /a, service: /b, type: simllm_ros/action/NavigateTo}", "exactly one of service"),
    ("- {name: a, action: /a, type: simllm_ros/action/NavigateTo, fields: {speed: {minimum: 2, maximum: 1}}}",
     "minimum 2 is above maximum 1"),
    ("- {name: a, action: /a, type: simllm_ros/action/NavigateTo, fields: {note: {minimum: 0}}}",
     "do not apply to a string field"),
    ("- {name: a, action: /a, type: simllm_ros/action/NavigateTo, fields: {avoid_zones: {maximum: 300}}}",
     "300 is not a uint8"),
    ("- {name: a, action: /a, type: simllm_ros/action/NavigateTo, fields: {target: {max_items: 1}}}",
     "max_items on a fixed-size array"),
    ("- {name: a, action: /a, type: simllm_ros/action/NavigateTo, fields: {place: {allowed: [3]}}}",
     "allowed value 3: expected a string"),
    ("- {name: a, action: /a, type: simllm_ros/action/NavigateTo, fields: {wheels: {maximum: 3}}}",
     "has no field 'wheels'"),
    ("- {name: a, action: /a, type: simllm_ros/action/NavigateTo, fields: {speed: {top: 3}}}",
     "unknown bound 'top'"),
    ("- {name: a, action: /a, type: simllm_ros/action/NavigateTo, fixed: {avoid_zones: [1, 2, 3, 4, 5]}}",
     "fixed avoid_zones: the message cannot hold 5 items (bounded array of 4)"),
    ("- {name: a, service: /a, type: std_srvs/srv/SetBool, executable: yes please}", "executable must be true"),
    ("- {name: a, service: /a, type: std_srvs/srv/SetBool, colour: red}", "unknown key 'colour'"),
    ("- {name: a, service: /a, type: std_srvs/srv/SetBool, rate_limit: {calls: 0, per_s: 1}}", "calls >= 1"),
    ("- {name: a, service: /a, type: std_srvs/srv/SetBool}\n- {name: a, service: /b, type: std_srvs/srv/SetBool}",
     "given twice"),
    ("- {name: 9a, service: /a, type: std_srvs/srv/SetBool}", "name '9a'"),
    ("tools: [unclosed", "not valid YAML"),
])
def test_bad_tools_file_gives_the_reason(tmp_path, body, words):
    with pytest.raises(ToolError) as e:
        load_tools(write(tmp_path, body))
    assert words in str(e.value)


def nav_box(tmp_path, extra: str = ""):
    return load_tools(write(tmp_path, (
        "- name: nav\n  description: drive\n  action: /nav\n  type: simllm_ros/action/NavigateTo\n"
        "  fields: {speed: {minimum: 0.1, maximum: 0.3}, target: {minimum: -5, maximum: 5}, avoid_zones: "
        "{max_items: 2}, note: {allowed: [ok, fine]}}\n" + extra)))


GOOD = {"place": "dock", "target": [1.0, -2.0], "speed": 0.3, "avoid_zones": [1], "note": "ok"}


def test_calls_checked_against_schema_and_bounds(tmp_path):
    box = nav_box(tmp_path)
    box.check(Call("nav", GOOD))
    cases = [({**GOOD, "speed": 0.5}, "0.5 is greater than the maximum of 0.3"),
             ({**GOOD, "target": [1.0, 9.0]}, "target/1: 9.0 is greater than the maximum of 5"),
             ({**GOOD, "target": [1.0]}, "is too short"),
             ({**GOOD, "place": "moon"}, "'moon' is not one of"),
             ({**GOOD, "avoid_zones": [1, 2, 3]}, "is too long"),
             ({**GOOD, "note": "go"}, "'go' is not one of"),
             ({**GOOD, "wheels": 4}, "Additional properties are not allowed"),
             ({k: v for k, v in GOOD.items() if k != "speed"}, "'speed' is a required property")]
    for args, words in cases:
        with pytest.raises(ToolError) as e:
            box.check(Call("nav", args))
        assert words in str(e.value), (args, str(e.value))
    with pytest.raises(ToolError, match="unknown tool 'fly'"):
        box.check(Call("fly", GOOD))


def test_bounds_checked_again_without_the_schema(tmp_path):
    """The field-by-field check and the message check stand on their own: a schema that would let a value
    through (as if the grammar or jsonschema missed it) still cannot get it past them."""
    box = nav_box(tmp_path)
    tool = box.tools["nav"]
    tool.schema = {"type": "object"}  # no schema at all
    with pytest.raises(ToolError, match="speed: 0.5 is above the maximum 0.3"):
        box.check(Call("nav", {**GOOD, "speed": 0.5}))
    with pytest.raises(ToolError, match="speed on the message: 0.9 is above the maximum 0.3"):
        to_message(tool, Call("nav", {**GOOD, "speed": 0.9}))
    with pytest.raises(ToolError, match="avoid_zones: the message cannot hold 5 items"):
        to_message(tool, Call("nav", {**GOOD, "avoid_zones": [1, 2, 3, 4, 5]}))  # uint8[<=4]


def test_call_becomes_the_goal_message_with_fixed_fields(tmp_path):
    from simllm_ros.action import NavigateTo
    box = load_tools(write(tmp_path, (
        "- name: nav\n  action: /nav\n  type: simllm_ros/action/NavigateTo\n"
        "  fields: {speed: {minimum: 0.1, maximum: 0.3}, target: {minimum: -5, maximum: 5}}\n"
        "  fixed: {note: fine}\n")))
    tool = box.tools["nav"]
    assert "note" not in tool.schema["properties"]
    with pytest.raises(ToolError, match="'note' was unexpected"):
        box.check(Call("nav", GOOD))
    args = {k: v for k, v in GOOD.items() if k != "note"}
    box.check(Call("nav", args))
    goal = to_message(tool, Call("nav", args))
    assert isinstance(goal, NavigateTo.Goal)
    assert goal.place == "dock" and list(goal.target) == [1.0, -2.0] and list(goal.avoid_zones) == [1]
    assert goal.note == "fine" and goal.speed == pytest.approx(0.3)  # 0.3 at the float32 bound is in
    assert message_to_dict(goal)["target"] == [1.0, -2.0]


def test_plan_choices_and_answers(tmp_path):
    box = load_tools(EXAMPLE)
    assert box.plan([], "auto") is None and box.plan(["navigate_to"], "none") is None
    auto = box.plan(["navigate_to", "set_brake"], "")
    assert auto.choice == "auto" and len(auto.schema["anyOf"]) == 3
    assert "navigate_to:" in auto.prompt_text and '{"text": "..."}' in auto.prompt_text
    assert box.parse(auto, '{"text": "hello"}') == ("hello", [])
    text, calls = box.parse(auto, '{"name": "set_brake", "arguments": {"data": true}}')
    assert text == "" and calls == [Call("set_brake", {"data": True})]
    named = box.plan(["navigate_to", "set_brake"], "set_brake")
    assert named.schema == box.tools["set_brake"].call_schema()
    with pytest.raises(ToolError, match="neither a call"):
        box.parse(named, '{"text": "hello"}')  # a name asks for a call only
    with pytest.raises(ToolError, match="does not offer"):
        box.parse(named, '{"name": "stop_motors", "arguments": {}}')
    req = box.plan(["stop_motors"], "required")
    assert req.schema["properties"]["name"] == {"const": "stop_motors"}
    for names, choice, words in ((["fly"], "auto", "unknown tool 'fly'"), (["set_brake"], "sometimes",
                                 "is not auto, none, required"), (["set_brake"], "stop_motors", "not one of the "
                                 "request's tools"), ([], "required", "needs tools"),
                                 (["set_brake", "set_brake"], "auto", "twice")):
        with pytest.raises(ToolError, match=words):
            box.plan(names, choice)
    assert json.loads(req.schema_text) == req.schema


def test_rate_limit_window():
    box = load_tools(EXAMPLE)
    nav, brake = box.tools["navigate_to"], box.tools["set_brake"]
    lim = RateLimiter()
    assert lim.take(nav, 100.0) is None and lim.take(nav, 101.0) is None
    assert "rate limit: navigate_to was sent 2 times in the last 10 s" in lim.take(nav, 105.0)
    assert lim.take(nav, 110.5) is None  # the first left the window
    assert all(lim.take(brake, 100.0) is None for _ in range(50))  # no limit set


def test_a_results_reasoning_and_calls_reach_every_response_type():
    """The service's, the topic's and the action's answers carry a <think> block's text in `reasoning` (apart from
    the answer) and the calls with their statuses, copied by the one function all three use."""
    from simllm_ros.action import Generate
    from simllm_ros.msg import QueryResponse
    from simllm_ros.request import QueryResult, ToolCallRecord
    from simllm_ros.ros.messages import fill_result
    from simllm_ros.srv import Query

    result = QueryResult(success=True, answer="", reasoning="The user wants the brake on.",
                         tool_calls=[ToolCallRecord("set_brake", '{"on": true}', "proposed")])
    for msg in (Query.Response(), QueryResponse(), Generate.Result()):
        fill_result(msg, result)
        assert msg.reasoning == "The user wants the brake on." and msg.answer == ""
        assert [(c.name, c.arguments, c.status) for c in msg.tool_calls] == [("set_brake", '{"on": true}', "proposed")]
    assert fill_result(QueryResponse(), QueryResult(success=True, answer="hi")).reasoning == ""
