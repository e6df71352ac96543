"""The engine's parts reach it through small typed interfaces rather than its private methods: an idle-time audit
through approx_gate.AuditHost, the request server through request_server.ServedEngine. An Engine that stops
satisfying one (a member renamed, made private, its parameters changed) fails here, before any request runs."""
from __future__ import annotations

import inspect

import pytest

from simllm_ros.serving import approx_gate, request_server
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

