"""The engine's parts reach it through small typed interfaces rather than its private methods: every part through
engine_parts.EngineCore, an idle-time audit through approx_gate.AuditHost, the request server through
request_server.ServedEngine, the batcher through the pipeline's public phases. An Engine that stops satisfying one
(a member renamed, made private, its parameters changed) fails here, before any request runs, and so does a part
that reaches into another's private members."""
from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from simllm_ros.serving import approx_gate, batching, engine_parts, request_memory, request_pipeline, request_server
from simllm_ros.serving import warm_start
from simllm_ros.serving.batching import Batcher
from simllm_ros.serving.request_pipeline import RequestPipeline
from simllm_ros.serving.engine import Engine
from simllm_ros.serving import engine as engine_mod
from simllm_ros.settings import Settings


@pytest.mark.parametrize("interface", [engine_parts.EngineCore, approx_gate.AuditHost, request_server.ServedEngine])
def test_the_engine_satisfies_each_interface_its_parts_reach_it_through(interface):
    engine = Engine(Settings())  # not loaded: the members exist all the same
    members = {name: m for name, m in vars(interface).items() if not name.startswith("_")}
    assert members, interface
    for name, member in members.items():
        assert hasattr(engine, name), f"Engine lacks {interface.__name__}.{name}"
        if isinstance(member, property):
            continue
        want = list(inspect.signature(member).parameters)[1:]  # without self
        got = list(inspect.signature(getattr(engine, name)).parameters)
        assert got == want, f"Engine.{name}{got} does not take {interface.__name__}.{name}'s parameters {want}"


def _public_calls_on(cls, owner: str) -> set[str]:
    """The names a class's own source reads of self.<owner> (self.pipeline.plan_flight: plan_flight)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute)
            and n.value.attr == owner and isinstance(n.value.value, ast.Name) and n.value.value.id == "self"}


def test_batching_runs_a_flight_through_the_pipelines_public_phases_only():
    """batching.py drives request_pipeline's phases (plan_flight, prefill_flight, start_decoding, conclude; and
    memo_answer_for, which serves a twin of an answered flight) and none of the pipeline's private methods: a change
    inside the pipeline does not reach into the batcher."""
    used = _public_calls_on(Batcher, "pipeline")
    assert used == {"plan_flight", "prefill_flight", "start_decoding", "conclude", "memo_answer_for"}, used
    for phase in used:
        assert callable(getattr(RequestPipeline, phase)) and getattr(RequestPipeline, phase).__doc__


PARTS = {"core", "pipeline", "memory", "batcher", "warm_start"}  # what the engine's parts call one another by


@pytest.mark.parametrize("module", [engine_mod, request_pipeline, request_memory, batching, warm_start])
def test_no_part_reaches_into_another_parts_private_members(module):
    """A part uses another only through its public members (self.pipeline.conclude, never self.pipeline._refresh):
    the engine's state is read through EngineCore, a part's own through its methods."""
    tree = ast.parse(inspect.getsource(module))
    bad = sorted(f"line {n.lineno}: self.{n.value.attr}.{n.attr}" for n in ast.walk(tree)
                 if isinstance(n, ast.Attribute) and n.attr.startswith("_") and isinstance(n.value, ast.Attribute)
                 and n.value.attr in PARTS and isinstance(n.value.value, ast.Name) and n.value.value.id == "self")
    assert not bad, bad
