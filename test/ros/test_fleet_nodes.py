"""Two namespaced nodes and a real redis-server (real rclpy over DDS, the real model in each node): robot2 answers
the question robot1 answered with robot1's context KV and answer as a verified draft, and gives the same answer
robot1 computed with an empty pool; /diagnostics shows the store's state and turns WARN while Redis is down, and
no request fails because of it."""
import time

import pytest
from diagnostic_msgs.msg import DiagnosticStatus

from conftest import EDGE_YAML
from redis_server import redis_server  # noqa: F401 - the fixture
from simllm_ros.request import CacheResult

NODE = "simllm_node"
CONTEXT = ("Depot bulletin: gate 3 is closed for resurfacing until Friday; trucks use gate 5. The charging bays "
           "B1-B4 are reserved for the night shift after 22:00. Forklift inspections run on Tuesday mornings. ") * 3
Q = "Which gate should trucks use this week?"


@pytest.fixture(scope="module")
def robots(ros_harness_factory, tmp_path_factory, redis_server):
    d = tmp_path_factory.mktemp("fleet_nodes")
    secret = d / "fleet.secret"
    secret.write_bytes(b"depot-fleet-secret-0123456789abcdef")
    params = d / "fleet.yaml"
    params.write_text(
        "/**:\n  ros__parameters:\n"
        f"    fleet_store_url: \"{redis_server.url}\"\n    fleet_secret_file: \"{secret}\"\n"
        "    fleet_timeout_ms: 200.0\n    telemetry_period_s: 0.3\n    ttft_warn_ms: 600000.0\n"
        "    max_new_tokens: 16\n")
    return [ros_harness_factory(NODE, [EDGE_YAML, str(params)], namespace=ns) for ns in ("robot1", "robot2")]


def fleet_value(robot, key, want, timeout=15.0):
    """The newest /diagnostics value `key` of this robot, once it equals `want` (or the last seen)."""
    name = f"{robot.fqn.lstrip('/')}: LLM service"
    seen = [None, None]

    def match(m):
        for st in m.status:
            if st.name == name:
                values = {kv.key: kv.value for kv in st.values}
                seen[0], seen[1] = values.get(key), st
                return seen[0] == want
        return False
    robot.wait_message("/diagnostics", match, timeout=timeout, after=len(robot.messages("/diagnostics")))
    return seen


def test_robot2_gives_robot1s_answer_through_the_store_and_diagnostics_follow_redis(robots, redis_server):
    r1, r2 = robots
    for r in robots:
        r.ensure_active()
    a = r1.query(Q, context=CONTEXT, max_new_tokens=16)
    assert a.success and a.cache_result == CacheResult.MISS and a.exact
    client = redis_server.client()
    deadline = time.monotonic() + 15
    blocks = (a.prompt_tokens - 1) // 32
    while time.monotonic() < deadline and not (  # robot1's writer works off the request's path
            client.keys("simllm:s:*:ans:*") and len(client.keys("simllm:s:*:kv:*")) >= blocks):
        time.sleep(0.05)
    b = r2.query(Q, context=CONTEXT, max_new_tokens=16)
    assert b.success and b.exact and b.answer == a.answer
    assert b.cache_result == CacheResult.EXACT_PREFIX and b.reused_tokens >= 32  # robot1's context KV
    # robot1's answer, checked by the model as drafts: every one proposed is accepted, and they carry most of the
    # answer (how many a pass verifies follows the pass costs measured at load, so not an exact count)
    assert b.draft_tokens_proposed == b.draft_tokens_accepted >= b.generated_tokens // 2 > 0
    value, _ = fleet_value(r2, "fleet_store", "connected")
    assert value == "connected"

    redis_server.kill()
    c = r2.query("Where are the charging bays?", context=CONTEXT, max_new_tokens=8)
    assert c.success, c.error
    value, status = fleet_value(r2, "fleet_store", "unreachable")
    assert value == "unreachable" and status.level == DiagnosticStatus.WARN
    assert "fleet store unreachable" in status.message
    redis_server.start()
    value, status = fleet_value(r2, "fleet_store", "connected", timeout=20)
    assert value == "connected"
