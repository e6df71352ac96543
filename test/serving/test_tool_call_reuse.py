"""Commands reused by meaning (serving/tool_call_reuse.py): the slot guard, the labels from exact runs, the error
bound deciding, and identical commands identical with and without the cache. The embedded model, no node."""
from __future__ import annotations

import dataclasses
import json

import pytest

from core_fixtures import fresh, shared_engine
from simllm_ros.cache.error_bound import ErrorBound
from simllm_ros.request import CacheResult, QueryRequest
from simllm_ros.serving.tool_call_checks import Call
from simllm_ros.serving.tool_call_reuse import CallReuse, slot_conflict, slot_values
from simllm_ros.serving.tool_output_formats import constrained_request
from simllm_ros.serving.toolbox import Toolbox

TOOLS = [
    {"name": "navigate_to", "description": "Drive the robot to a named place (dock, kitchen, door) at a speed.",
     "action": "/navigate_to", "type": "simllm_ros/action/NavigateTo",
     "fields": {"speed": {"minimum": 0.1, "maximum": 5.0}},
     "fixed": {"target": [0.0, 0.0], "avoid_zones": [], "note": ""}},
    {"name": "set_brake", "description": "Engage (true) or release (false) the parking brake.",
     "service": "/set_brake", "type": "std_srvs/srv/SetBool"},
]


@pytest.fixture(scope="module")
def toolbox():
    pytest.importorskip("std_srvs.srv")  # the tools are ROS interface types (without ROS: skipped, as test/ros)
    return Toolbox.from_list(TOOLS)


@pytest.mark.parametrize("new, cached, words", [
    ("go to dock 2", "go to dock 3", "numbers"),
    ("slow down to 0.5 m/s", "slow down to 5 m/s", "numbers"),
    ("drive to the kitchen", "drive to the door", "kitchen"),
    ("engage the parking brake", "release the parking brake", "opposite"),
    ('note "bay alpha" and go', 'note "bay bravo" and go', "quoted"),
    ("pick up the box", "drop the box", "opposite"),
])
def test_slot_guard_refuses_slot_swaps(toolbox, new, cached, words):
    values = slot_values(toolbox.plan(["navigate_to", "set_brake"], "required"))
    why = slot_conflict(new, cached, values)
    assert why is not None and words in why, why


def test_slot_guard_lets_paraphrases_through_and_knows_the_call_s_strings(toolbox):
    plan = toolbox.plan(["navigate_to"], "navigate_to")
    values = slot_values(plan)
    assert {"dock", "kitchen", "door", "point"} <= values  # NavigateTo's PLACE_* constants
    assert slot_conflict("go to the charging dock", "head over to the charging dock please", values) is None
    assert slot_conflict("drive to dock two at 0.5 m/s", "please drive to dock 2 at 0.5 m/s", values) is None
    # a free string the cached call holds ("red box") must be named by both commands
    call = Call("navigate_to", {"place": "dock", "speed": 0.5, "note": "red box"})
    with_call = slot_values(plan, call)
    assert "red box" in with_call
    assert "red box" in slot_conflict("bring the blue box to the dock", "bring the red box to the dock", with_call)


def _asked(q, scope, **kw):
    kw.setdefault("allow_approximate", True)
    return QueryRequest(prompt=q, cache_scope=scope, max_new_tokens=48, **kw)


def test_labels_from_exact_runs_bound_opens_only_on_them_and_slot_swaps_never_share(toolbox):
    e = fresh(shared_engine(), approx_error_bound=0.1, temperature=0.0)
    bound = ErrorBound(seed=3)
    reuse = CallReuse(e, toolbox, bound=bound)
    plan = toolbox.plan(["navigate_to"], "navigate_to")
    runs = []

    def run(req):
        runs.append(req.prompt)
        return e.handle(req)

    def ask(q, scope="robot", **kw):
        asked = _asked(q, scope, **kw)
        return reuse.answer(asked, constrained_request(asked, plan), plan, run)

    cmd = "Drive to the kitchen at 0.5 m/s."
    first = ask(cmd)
    again = ask(cmd)
    assert first.success and again.success, (first.error, again.error)
    assert first.exact and first.cache_result == CacheResult.MISS
    assert again.exact and again.cache_result == CacheResult.EXACT_PREFIX  # the exact memo, not the reuse:
    assert again.decode_passes == 0 and again.reused_tokens == again.prompt_tokens  # no model pass
    assert again.answer == first.answer and again.generated_tokens == first.generated_tokens
    fresh(e, approx_error_bound=0.1, temperature=0.0)  # no cache: the same call
    alone = e.handle(constrained_request(_asked(cmd, "robot"), plan))
    assert alone.cache_result == CacheResult.MISS and alone.answer == first.answer
    toolbox.parse(plan, first.answer)  # a valid call

    # a paraphrase with no labels yet: answered exactly, and its own exact run labels the neighbour
    para = "Please drive over to the kitchen at 0.5 m/s."
    r = ask(para)
    assert r.success and r.exact, r.error
    assert reuse.counts["served"] == 0 and len(bound) == 1
    label = bound.summary()["call/robot"]
    assert label["labels"] == 1 and label["served"] == 0
    same = json.loads(r.answer) == json.loads(first.answer)
    assert label["observed"] == (0.0 if same else 1.0)

    # measured evidence in the scope (here: another 40 commands' labels, all "same call"): the bound opens
    for i in range(40):
        bound.record("call", "robot", f"other{i}", 0.99, False)
    n_runs = len(runs)
    served = ask("Could you drive to the kitchen at 0.5 m/s?")
    if not same:  # the neighbour proved wrong at that similarity or above: never served there again
        assert served.exact and len(runs) == n_runs + 1 and reuse.counts["served"] == 0
        return
    assert served.success and not served.exact and served.cache_result == CacheResult.ANSWER
    assert 0 < served.error_estimate <= 0.1 and len(runs) == n_runs  # no model run
    assert json.loads(served.answer) == json.loads(first.answer)
    toolbox.parse(plan, served.answer)

    # a slot swap is never served, whatever the labels say; nor anything at δ 0
    asked = _asked("Drive to the kitchen at 5 m/s.", "robot")
    look = reuse.lookup(asked, constrained_request(asked, plan), plan)
    assert look.served is None and "numbers" in look.refused, look.refused
    asked = _asked("Could you drive to the kitchen at 0.5 m/s?", "robot", approx_error_bound=0.0)
    assert reuse.lookup(asked, constrained_request(asked, plan), plan).served is None
    asked = _asked("Could you drive to the kitchen at 0.5 m/s?", "robot", allow_approximate=False)
    assert reuse.lookup(asked, constrained_request(asked, plan), plan).served is None
