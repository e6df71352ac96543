"""The engine's parts reach it through small typed interfaces rather than its private methods: an idle-time audit
through approx_gate.AuditHost, the request server through request_server.ServedEngine, the batcher through the
pipeline's public phases. An Engine that stops satisfying one (a member renamed, made private, its parameters
changed) fails here, before any request runs."""
from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from simllm_ros.serving import approx_gate, request_server
from simllm_ros.serving.batching import Batching
from simllm_ros.serving.request_pipeline import RequestPipeline
from simllm_ros.serving.engine import Engine
from simllm_ros.settings import Settings


@pytest.mark.parametrize("interface", [approx_gate.AuditHost, request_server.ServedEngine])
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


def _private_self_calls(cls) -> set[str]:
    """The self._name attributes a class's own source reads (its methods, not the ones it inherits)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == "self" and n.attr.startswith("_") and not n.attr.startswith("__")}


def test_batching_runs_a_flight_through_the_pipelines_public_phases_only():
    """batching.py drives request_pipeline's phases (plan_flight, prefill_flight, start_decoding, conclude) and none
    of the pipeline's private methods: a change inside the pipeline does not reach into the batcher."""
    pipeline_private = {name for name in vars(RequestPipeline) if name.startswith("_") and not name.startswith("__")}
    assert pipeline_private  # the pipeline has private helpers; the batcher must not use them
    assert not _private_self_calls(Batching) & pipeline_private
    for phase in ("plan_flight", "prefill_flight", "start_decoding", "conclude"):
        assert callable(getattr(RequestPipeline, phase)) and getattr(RequestPipeline, phase).__doc__
