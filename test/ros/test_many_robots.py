"""Many robots on one DDS domain: two namespaced nodes side by side, each taking the params file's values.

Real rclpy over DDS, the real model loaded by each node. The claims:
- a params file keyed `/**` (as config/edge.yaml is) reaches a node in any namespace, and a block keyed by a
  node's full name overrides it for that node only;
- the two nodes serve their own services and pools without seeing each other's requests;
- /diagnostics names each after its full name ("robot1/simllm_node: LLM service") with hardware_id from
  the parameter (default: the host name); the cache map frame carries the namespace.
"""
import socket

import pytest
import yaml

from conftest import EDGE_YAML
from simllm_ros.request import CacheResult

NODE = "simllm_node"


@pytest.fixture(scope="module")
def robots(ros_harness_factory, tmp_path_factory):
    d = tmp_path_factory.mktemp("robots")
    params = d / "fleet.yaml"
    params.write_text(
        "/**:\n  ros__parameters:\n"
        "    cache_size: \"24MB\"\n    max_new_tokens: 7\n    queue_limit: 3\n    telemetry_period_s: 0.3\n"
        "    cache_map_frame: \"llm_cache\"\n    ttft_warn_ms: 600000.0\n"
        "/robot2/simllm_node:\n  ros__parameters:\n    hardware_id: \"robot2-orin\"\n")
    return [ros_harness_factory(NODE, [EDGE_YAML, str(params)], namespace=ns) for ns in ("robot1", "robot2")]


def test_edge_yaml_is_keyed_for_any_node_name():
    with open(EDGE_YAML) as f:
        assert list(yaml.safe_load(f)) == ["/**"]


def test_both_namespaced_nodes_take_the_files_values(robots):
    r1, r2 = robots
    assert (r1.fqn, r2.fqn) == ("/robot1/simllm_node", "/robot2/simllm_node")
    for r in robots:
        assert r.get_param("max_new_tokens") == 7 and r.get_param("queue_limit") == 3
        assert r.get_param("cache_size") == "24MB" and r.get_param("cache_map_frame") == "llm_cache"
        assert r.get_param("system_prompt").startswith("You are a helpful assistant")  # edge.yaml's
    assert r1.get_param("hardware_id") == "" and r2.get_param("hardware_id") == "robot2-orin"


def test_side_by_side_each_with_its_own_pool_diagnostics_and_frame(robots):
    r1, r2 = robots
    for r in robots:
        r.ensure_active()
    a = r1.query("Where can I park near the station?", max_new_tokens=0)  # 0: the node's max_new_tokens (7)
    b = r2.query("Where can I park near the station?", max_new_tokens=0)
    assert a.success and b.success and a.generated_tokens <= 7 and b.generated_tokens <= 7
    assert a.cache_result == b.cache_result == CacheResult.MISS  # robot2 did not see robot1's request
    again = r1.query("Where can I park near the station?", max_new_tokens=0)
    assert again.cache_result == CacheResult.EXACT_PREFIX and again.answer == a.answer
    want = {"robot1/simllm_node: LLM service": socket.gethostname(), "robot2/simllm_node: LLM service": "robot2-orin"}
    seen = {}

    def statuses():
        for m in r1.messages("/diagnostics") + r2.messages("/diagnostics"):
            for st in m.status:
                seen[st.name] = st.hardware_id
        return set(want) <= set(seen)
    r1.wait_message("/diagnostics", lambda m: statuses(), timeout=15)
    assert {k: seen.get(k) for k in want} == want
    for r, frame in ((r1, "robot1/llm_cache"), (r2, "robot2/llm_cache")):
        cm = r.wait_message(f"{r.fqn}/cache_map", lambda m: len(m.markers) >= 2, timeout=15)
        assert cm is not None and {m.header.frame_id for m in cm.markers} == {frame}
