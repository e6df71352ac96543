"""simllm_node end to end: real rclpy over DDS, the real model, a fake sysfs thermal tree; no mocks.

One node for the module (the model loads a few times: failed+fixed configure, cleanup+configure).
Tests run in file order and each one brings the node to the state it needs.
"""
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest
from diagnostic_msgs.msg import DiagnosticStatus
from visualization_msgs.msg import Marker

from conftest import EDGE_YAML, REPO, cpu_gpu_zones, pick_domain, wait_future, wait_until
from simllm_ros.request import CacheResult
from simllm_ros.settings import DEFAULT_MODEL

NODE = "simllm_node"
N = f"/{NODE}"
BUDGET = 32_000_000
PROMPT = "What is the capital of France?"
DIAG_NAME = "simllm_node: LLM service"  # "<node's full name without the leading slash>: <task>"


@pytest.fixture(scope="module")
def thermal(tmp_path_factory):
    t = cpu_gpu_zones(tmp_path_factory.mktemp("sys") / "thermal")
    t.add(2, "cv0-thermal", raw="-256000")  # powered-down Jetson zone: offline, NaN
    return t


@pytest.fixture(scope="module")
def h(ros_harness_factory, thermal, tmp_path_factory):
    d = tmp_path_factory.mktemp("node")
    test_yaml = d / "test.yaml"
    test_yaml.write_text(
        f"{NODE}:\n  ros__parameters:\n"
        f"    cache_size: \"32MB\"\n"
        f"    persist_path: \"{d / 'pool'}\"\n"
        f"    thermal_root: \"{thermal.root}\"\n"
        f"    energy_sysfs_root: \"{d / 'no_power_sensors'}\"\n"  # no sensor: answers say so, never 0 J
        f"    telemetry_period_s: 0.2\n"
        f"    max_new_tokens: 12\n"
        f"    queue_limit: 4\n"
        f"    ttft_warn_ms: 600000.0\n"  # a slow shared CI box must not turn the thermal checks WARN
        f"    lfu_weight: 0.65\n"
        f"    recency_half_life_s: 900\n")  # an int for a double parameter: accepted as 900.0
    harness = ros_harness_factory(NODE, [EDGE_YAML, str(test_yaml)],
                                  overrides={"semantic_log_path": str(d / "semantic.jsonl")})
    harness.dir = d
    return harness


def diag_status(msg):
    for st in msg.status:
        if st.name == DIAG_NAME:
            return st
    return None


def diag_level(msg):
    st = diag_status(msg)
    return None if st is None else st.level


def test_parameters_from_yaml_with_descriptors(h):
    assert h.state() == "unconfigured"
    assert h.get_param("lfu_weight") == pytest.approx(0.65)  # test.yaml beats edge.yaml
    assert h.get_param("cache_size") == "32MB"
    v = h.get_param("recency_half_life_s")
    assert isinstance(v, float) and v == 900.0
    assert h.get_param("cache_threshold") == pytest.approx(0.8)  # edge.yaml
    assert h.get_param("system_prompt").startswith("You are a helpful assistant")
    assert h.get_param("semantic_log_path").endswith("semantic.jsonl")  # parameter_overrides
    d = h.describe("cache_threshold")
    assert d.floating_point_range[0].from_value == 0.0 and d.floating_point_range[0].to_value == 1.0
    assert "changes live" in d.additional_constraints and d.description
    assert "one of: 0, 8, 16, 32" in h.describe("kv_bits").additional_constraints
    d = h.describe("block_tokens")
    assert (d.integer_range[0].from_value, d.integer_range[0].to_value) == (4, 256)
    assert "needs reconfigure" in h.describe("model").additional_constraints


def test_failed_configure_stays_unconfigured_then_fixed(h):
    missing = str(h.dir / "no-such-model")
    assert h.set_params(model=missing)[0].successful  # reload parameters are accepted while unconfigured
    t0 = time.monotonic()
    assert h.change_state("configure") is False
    assert h.state() == "unconfigured"
    assert time.monotonic() - t0 < 60
    assert h.set_params(model=DEFAULT_MODEL)[0].successful
    assert h.change_state("configure") is True
    assert h.state() == "inactive"


def test_lifecycle_transitions(h):
    if h.state() == "unconfigured":
        assert h.change_state("configure")
    assert h.state() == "inactive"
    assert h.change_state("activate") and h.state() == "active"
    assert h.change_state("configure") is False and h.state() == "active"  # not a transition from active
    assert h.change_state("deactivate") and h.state() == "inactive"
    assert h.change_state("activate") and h.state() == "active"
    # configure told how the load went on ~/load_progress while the node was between states
    lines = [m.data for m in h.messages(f"{N}/load_progress")]
    assert any(line.startswith("loading model ") for line in lines), lines
    assert any("compute threads:" in line for line in lines), lines


def test_query_answered_by_real_model(h):
    h.ensure_active()
    r = h.query(PROMPT, max_new_tokens=12)
    assert r.success, r.error
    assert r.answer.strip()
    assert r.prompt_tokens > 0 and r.generated_tokens > 0
    assert 0 < r.ttft_ms <= r.total_ms
    assert r.cache_result == CacheResult.MISS and r.recomputed_tokens == r.prompt_tokens
    assert math.isnan(r.energy_j) and r.energy_source.startswith("none: ina3221: no INA3221 rail"), r.energy_source


def test_repeated_query_reuses_cache(h):
    h.ensure_active()
    ctx = "The robot is in the kitchen. The fridge is to its left and the sink is ahead."
    first = h.query("Where is the sink?", context=ctx, max_new_tokens=12)
    assert first.success, first.error
    again = h.query("Where is the sink?", context=ctx, max_new_tokens=12)
    assert again.success, again.error
    assert again.cache_result in (CacheResult.EXACT_PREFIX, CacheResult.ANSWER)
    assert again.reused_tokens > 0
    assert again.similarity == pytest.approx(1.0, abs=1e-3)
    # The default keeps KV at the model's precision on a batch-invariant backend: reuse is lossless, so a
    # caller that forbids approximate reuse still gets it, and the same answer, reported exact.
    strict = h.query("Where is the sink?", context=ctx, max_new_tokens=12, allow_approximate=False)
    assert strict.success and strict.reused_tokens > 0 and strict.cache_result == CacheResult.EXACT_PREFIX, strict
    assert strict.exact and strict.answer == first.answer and first.exact


def test_topic_request_response(h):
    h.ensure_active()
    topic = f"{N}/responses"
    rid = f"topic-{uuid.uuid4()}"
    h.publish_request(rid, "Name one colour of the sky.", max_new_tokens=8)
    m = h.wait_message(topic, lambda m: m.request_id == rid, timeout=60)
    assert m is not None, "no QueryResponse with our request_id"
    assert m.success, m.error
    assert m.answer.strip() and m.prompt_tokens > 0 and m.ttft_ms > 0


def test_telemetry_cache_stats_thermal_diagnostics_map(h, thermal):
    h.ensure_active()
    after = {t: len(h.messages(t)) for t in (f"{N}/cache_stats", f"{N}/thermal", "/diagnostics", f"{N}/cache_map")}
    st = h.wait_message(f"{N}/cache_stats", lambda m: m.requests_total >= 3, timeout=10,
                        after=after[f"{N}/cache_stats"])
    assert st is not None
    assert st.bytes_budget == BUDGET
    assert 0 < st.bytes_used <= st.bytes_budget
    assert 0.0 < st.budget_use <= 1.0
    assert st.entries >= 2 and st.blocks_used >= 1
    assert st.hit_rate_any_total > 0 and st.hit_rate_exact_total > 0
    assert st.ttft_miss_mean_ms > 0 and st.ttft_miss_p95_ms >= st.ttft_miss_mean_ms * 0.5
    assert st.queue_depth == 0 and st.stamp.sec > 0
    assert st.approx_checks >= st.approx_checks_differ and 0.0 < st.approx_differ_high <= 1.0  # error_bound totals
    assert st.energy_source.startswith("none: ") and math.isnan(st.energy_mean_j_miss)  # no sensor: not 0 J

    th = h.wait_message(f"{N}/thermal", timeout=10, after=after[f"{N}/thermal"])
    assert list(th.zone_names) == ["cpu-thermal", "gpu-thermal", "cv0-thermal"]
    assert th.temperatures_c[0] == pytest.approx(45.0) and th.temperatures_c[1] == pytest.approx(50.0)
    assert math.isnan(th.temperatures_c[2])
    assert list(th.zone_online) == [True, True, False]
    assert th.hottest_zone == "gpu-thermal" and th.hottest_c == pytest.approx(50.0)
    assert th.throttle_state == th.THROTTLE_NONE
    assert th.warn_c == pytest.approx(75.0) and th.critical_c == pytest.approx(90.0)

    dg = h.wait_message("/diagnostics", lambda m: diag_status(m) is not None, timeout=10, after=after["/diagnostics"])
    s = diag_status(dg)
    assert s.level == DiagnosticStatus.OK, s.message
    assert s.hardware_id == socket.gethostname()  # hardware_id parameter empty: the host name
    kv = {v.key: v.value for v in s.values}
    assert kv["model"] == DEFAULT_MODEL
    assert kv["precision"].split(", ")[0] in ("float32", "bfloat16", "float16") and \
        kv["precision"].split(", ")[1] in ("4-bit weights", "8-bit weights", "16-bit weights"), kv["precision"]
    assert int(kv["entries"]) >= 2 and kv["hottest_zone"] == "gpu-thermal" and kv["thermal_level"] == "OK"
    assert "ttft_miss_p95_ms" in kv and "hit_rate_any_recent" in kv
    assert kv["energy_source"].startswith("none: ") and kv["energy_mean_j_miss"] == "nan"
    assert kv["lossless_reuse"] == "true"  # the load-time batch-invariance probe passed on this machine
    from simllm_ros.kernels.build import CONTRACT
    digest, contract = kv["numerics"].split()
    assert len(digest) == 16 and contract == f"({CONTRACT})", kv["numerics"]  # which arithmetic, for the fleet
    from simllm_ros.kernels import attention_kernel
    assert kv["attention"] == ("kernel" if attention_kernel.load() is not None else "torch")
    if kv["attention"] == "kernel":  # bf16 on AMX where this CPU and Linux allow it, else the vector code
        amx = attention_kernel.load().amx is not None and kv["precision"].startswith("bfloat16")
        assert kv["attention_arithmetic"] == ("amx" if amx else "vector")
    if kv["precision"].endswith("4-bit weights"):  # bf16: AMX or ATen's kernel; float32: our vector kernel
        from simllm_ros.kernels import int4_kernel
        want = "vector" if kv["precision"].startswith("float32") else \
            "amx" if int4_kernel.load() is not None else "aten"
        assert kv["int4_products"] == want
    else:
        assert "int4_products" not in kv
    # a pass's layers in one C call exactly in the 4-bit configurations on our kernels, else from Python
    from simllm_ros.kernels import layer_kernel
    fused = kv.get("int4_products") in ("amx", "vector") and kv["attention"] == "kernel" and \
        layer_kernel.load() is not None
    assert kv["layers"] == ("c" if fused else "python")

    cm = h.wait_message(f"{N}/cache_map", lambda m: len(m.markers) >= 3, timeout=10, after=after[f"{N}/cache_map"])
    assert cm is not None
    assert cm.markers[0].action == Marker.DELETEALL
    spheres = cm.markers[1:]
    assert all(m.type == Marker.SPHERE and m.header.frame_id == "simllm_cache" for m in spheres)
    assert all(m.scale.x > 0 and m.color.a > 0 for m in spheres)
    assert len({m.id for m in spheres}) == len(spheres)


def test_thermal_warn_with_hysteresis_then_ok(h, thermal):
    h.ensure_active()
    T, D = f"{N}/thermal", "/diagnostics"
    try:
        n = len(h.messages(T))
        thermal.set(0, 80.0)
        m = h.wait_message(T, lambda m: m.throttle_state == m.THROTTLE_WARN, timeout=10, after=n)
        assert m is not None and m.hottest_zone == "cpu-thermal" and m.hottest_c == pytest.approx(80.0)
        n = len(h.messages(D))
        dg = h.wait_message(D, lambda m: diag_level(m) == DiagnosticStatus.WARN, timeout=10, after=n)
        assert dg is not None and "cpu-thermal" in diag_status(dg).message
        r = h.query("Say hello.", max_new_tokens=8)  # WARN still serves (shorter answers)
        assert r.success, r.error

        thermal.set(0, 72.0)  # below warn, but not below warn - hysteresis: stays WARN
        n = len(h.messages(T))
        ms = wait_until(lambda: [m for m in h.messages(T)[n:] if m.hottest_c == pytest.approx(72.0)][2:], 10)
        assert ms and all(m.throttle_state == m.THROTTLE_WARN for m in ms)

        thermal.set(0, 69.0)  # below 75 - 5
        n = len(h.messages(T))
        m = h.wait_message(T, lambda m: m.throttle_state == m.THROTTLE_NONE, timeout=10, after=n)
        assert m is not None and m.hottest_c == pytest.approx(69.0)
        n = len(h.messages(D))
        dg = h.wait_message(D, lambda m: diag_level(m) == DiagnosticStatus.OK, timeout=10, after=n)
        last = h.messages(D)[-1] if h.messages(D) else None
        assert dg is not None, f"never OK after cooling; last: {diag_status(last).message if last else None}"
    finally:
        thermal.set(0, 45.0)


def test_thermal_critical_sheds_load(h, thermal):
    h.ensure_active()
    T, D = f"{N}/thermal", "/diagnostics"
    try:
        n, nd = len(h.messages(T)), len(h.messages(D))
        thermal.set(1, 95.0)
        assert h.wait_message(T, lambda m: m.throttle_state == m.THROTTLE_CRITICAL, timeout=10, after=n)
        dg = h.wait_message(D, lambda m: diag_level(m) == DiagnosticStatus.ERROR, timeout=10, after=nd)
        assert dg is not None and "overheated" in diag_status(dg).message
        r = h.query("Say hello.", max_new_tokens=8)
        assert not r.success and r.error.startswith("overheated:") and "gpu-thermal" in r.error
    finally:
        thermal.set(1, 50.0)
    n = len(h.messages(T))
    assert h.wait_message(T, lambda m: m.throttle_state == m.THROTTLE_NONE, timeout=10, after=n)
    r = h.query("Say hello.", max_new_tokens=8)
    assert r.success, r.error


def test_live_parameters_accepted_and_refused(h):
    h.ensure_active()
    res = h.set_params(cache_threshold=0.85)[0]
    assert res.successful, res.reason
    assert h.get_param("cache_threshold") == pytest.approx(0.85)
    assert h.node._engine.settings.cache_threshold == pytest.approx(0.85)  # reached the engine

    res = h.set_params(cache_threshold=1.5)[0]  # out of the descriptor's range
    assert not res.successful and res.reason
    assert h.get_param("cache_threshold") == pytest.approx(0.85)

    res = h.set_params(model=str(h.dir / "other-model"))[0]
    assert not res.successful
    assert "'model' needs a reconfigure: deactivate and cleanup first" in res.reason

    res = h.set_params(answer_threshold=0.5)[0]  # below cache_threshold: cross-check
    assert not res.successful and "answer_threshold" in res.reason
    res = h.set_params(thermal_warn_c=95.0)[0]  # above thermal_critical_c
    assert not res.successful and "thermal_critical_c" in res.reason
    res = h.set_params(cache_threshold="high")[0]  # wrong type
    assert not res.successful

    assert h.set_params(cache_threshold=0.8)[0].successful
    r = h.query("Say hello.", max_new_tokens=8)
    assert r.success, r.error


def test_invalid_requests_answered_with_error(h):
    h.ensure_active()
    r = h.query("", max_new_tokens=8)  # empty prompt
    assert not r.success and r.error
    r = h.query("hello", max_new_tokens=100000)  # above max_new_tokens_limit
    assert not r.success and "max_new_tokens" in r.error
    bad = f"bad-{uuid.uuid4()}"
    h.publish_request(bad, "", max_new_tokens=8)
    m = h.wait_message(f"{N}/responses", lambda m: m.request_id == bad, timeout=30)
    assert m is not None and not m.success and m.error


def test_deactivated_node_refuses_requests(h):
    h.ensure_active()
    assert h.change_state("deactivate") and h.state() == "inactive"
    r = h.query(PROMPT, max_new_tokens=8)
    assert not r.success and r.error == "node is not active (state: inactive)"
    rid = f"inactive-{uuid.uuid4()}"
    h.publish_request(rid, PROMPT)
    m = h.wait_message(f"{N}/responses", lambda m: m.request_id == rid, timeout=20)
    assert m is not None and not m.success and m.error == "node is not active (state: inactive)"
    assert h.change_state("activate")
    r = h.query(PROMPT, max_new_tokens=8)
    assert r.success, r.error


def test_queue_overflow_every_request_answered_once(h):
    h.ensure_active()
    assert h.set_params(queue_limit=1)[0].successful
    try:
        busy_before = h.wait_message(f"{N}/cache_stats", timeout=5, after=len(h.messages(f"{N}/cache_stats")))
        busy_before = busy_before.rejected_busy_total
        n_resp = len(h.messages(f"{N}/responses"))
        futures = [h.query_async(f"Give me a fact about the number {i}.", max_new_tokens=16) for i in range(8)]
        ids = [f"burst-{i}-{uuid.uuid4()}" for i in range(6)]
        for i, rid in enumerate(ids):
            h.publish_request(rid, f"Name an animal that starts with the letter {'ABCDEF'[i]}.", max_new_tokens=16)
        results = [wait_future(f, 180) for f in futures]

        def topic_answers():
            return [m for m in h.messages(f"{N}/responses")[n_resp:] if m.request_id in ids]
        assert wait_until(lambda: {m.request_id for m in topic_answers()} == set(ids), 180)
        time.sleep(1.0)  # would catch a second answer to the same id
        answers = topic_answers()
        assert sorted(m.request_id for m in answers) == sorted(ids), "a topic request was answered twice"
        everything = results + answers
        for r in everything:
            assert r.success or r.error.startswith("busy:"), r.error
        busy = [r for r in everything if not r.success]
        assert busy, "queue_limit=1 with 14 concurrent requests refused none"
        assert any(r.success for r in everything)
        assert all(r.answer.strip() for r in everything if r.success)
        st = h.wait_message(f"{N}/cache_stats", lambda m: m.rejected_busy_total >= busy_before + len(busy),
                            timeout=5, after=len(h.messages(f"{N}/cache_stats")))
        assert st is not None and st.queue_depth == 0
    finally:
        assert h.set_params(queue_limit=4)[0].successful


def test_cleanup_saves_pool_and_configure_restores_it(h):
    h.ensure_active()
    warm = h.query(PROMPT, max_new_tokens=8)
    assert warm.success
    assert h.change_state("deactivate") and h.change_state("cleanup")
    assert h.state() == "unconfigured"
    pool_dir = h.dir / "pool"
    assert pool_dir.is_dir() and any(pool_dir.iterdir()), "cleanup did not save the pool"
    assert (h.dir / "semantic.jsonl").stat().st_size > 0  # reload parameter given at start was used
    assert h.change_state("configure") and h.change_state("activate")
    n = len(h.messages(f"{N}/cache_stats"))
    st = h.wait_message(f"{N}/cache_stats", timeout=10, after=n)
    assert st.entries >= 1, "pool not restored"
    r = h.query(PROMPT, max_new_tokens=8)
    assert r.success and r.cache_result == CacheResult.EXACT_PREFIX and r.reused_tokens > 0


def test_shutdown_from_active(h):
    h.ensure_active()
    assert h.change_state("active_shutdown")
    assert h.state() == "finalized"
    assert wait_until(lambda: not h.query_cli.service_is_ready(), 10)


def test_cli_edge_and_query_processes(tmp_path, thermal):
    """simllm-edge and simllm-query as processes (python -m from the repo), on their own ROS domain."""
    env = dict(os.environ)
    env["ROS_DOMAIN_ID"] = str(pick_domain(os.getpid() + 1, exclude={int(os.environ["ROS_DOMAIN_ID"])}))
    env["PYTHONUNBUFFERED"] = "1"
    edge = subprocess.Popen(
        [sys.executable, "-m", "simllm_ros.cli.edge", "--cache_size", "16MB", "--cache_threshold", "0.9",
         "--param", f"thermal_root={thermal.root}", "--param", "max_new_tokens=8",
         "--ros-args", "--params-file", EDGE_YAML, "-p", "queue_limit:=3"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    reader = threading.Thread(target=lambda: [lines.append(l) for l in edge.stdout], daemon=True)
    reader.start()
    try:
        assert wait_until(lambda: any("active: service" in l for l in lines) or edge.poll() is not None, 120)
        assert edge.poll() is None, "".join(lines)
        q = subprocess.run([sys.executable, "-m", "simllm_ros.cli.query", "What is two plus two?",
                            "--max-new-tokens", "8", "--timeout", "60"],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert q.returncode == 0, q.stdout + q.stderr
        import json
        d = json.loads(q.stdout)
        assert d["success"] and d["answer"] and d["cache_result"] == "MISS" and d["prompt_tokens"] > 0
        q = subprocess.run([sys.executable, "-m", "simllm_ros.cli.query", "", "--timeout", "30"],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        assert q.returncode == 1 and json.loads(q.stdout)["success"] is False
        _cli_options_reach_the_node(env)
        edge.send_signal(signal.SIGINT)
        assert edge.wait(timeout=60) == 0, "".join(lines)
        out = "".join(lines)
        assert "deactivating" in out and "cleaning up" in out and "stopped" in out
    finally:
        if edge.poll() is None:
            edge.kill()
            edge.wait()


def _cli(env, *args, timeout=120):
    return subprocess.run([sys.executable, "-m", "simllm_ros.cli.query", *args, "--timeout", "60"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _cli_options_reach_the_node(env):
    """simllm-query's options over DDS: a JSON schema, conversation turns, stop strings, sampling, the action's
    stream, the embedder, and the node's errors shown as such with exit code 1."""
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    q = _cli(env, "What is two plus two? Answer in JSON.", "--json-schema", json.dumps(schema), "--max-new-tokens",
             "12", "--resend", "0.01")
    assert "asking again (1/2)" in q.stderr and "(3/2)" not in q.stderr, q.stderr  # a schema's answer takes > 10 ms
    d = json.loads(q.stdout)
    if d["success"]:
        jsonschema.validate(json.loads(d["answer"]), schema)
    else:  # 8 tokens of the node's default may cut the JSON: said as such
        assert "json_schema" in d["error"] and q.returncode == 1
    q = _cli(env, "--json-schema", '{"not": {}}', "hello")
    assert q.returncode == 1 and "keyword 'not'" in json.loads(q.stdout)["error"]
    q = _cli(env, "And the next one?", "--message", "user:Name a colour.", "--message", "assistant:Red.",
             "--stop", ".", "--temperature", "0.7", "--seed", "3")
    d = json.loads(q.stdout)
    assert q.returncode == 0 and d["success"] and "." not in d["answer"] and d["prompt_tokens"] > 0
    again = json.loads(_cli(env, "And the next one?", "--message", "user:Name a colour.", "--message",
                            "assistant:Red.", "--stop", ".", "--temperature", "0.7", "--seed", "3").stdout)
    assert again["answer"] == d["answer"]  # the same seed, the same sample
    q = _cli(env, "--message", "robot:hi", "hello")
    assert q.returncode == 2 and "ROLE:TEXT" in q.stderr
    q = _cli(env, "Count from one to five.", "--stream", "--max-new-tokens", "8")
    result = json.loads(q.stderr[q.stderr.index("{"):])
    assert q.returncode == 0 and result["success"] and q.stdout.strip() == result["answer"].strip()
    # Ctrl-C while the answer streams: the goal is cancelled, exit code 130
    s = subprocess.Popen([sys.executable, "-m", "simllm_ros.cli.query", "Describe every road and shop in town.",
                          "--stream", "--max-new-tokens", "300", "--timeout", "60"], cwd=REPO, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = s.stdout.read(1)  # the first streamed character: the goal is running
    s.send_signal(signal.SIGINT)
    out, err = s.communicate(timeout=60)
    assert first and s.returncode == 130 and '"cancelled (Ctrl-C)"' in err, (s.returncode, err[-500:])
    q = _cli(env, "--embed", "is the road closed", "where can I park")
    d = json.loads(q.stdout)
    assert q.returncode == 0 and d["dim"] == 384 and len(d["vectors"]) == 2 and len(d["vectors"][0]) == 384


def test_cli_edge_configure_failure_exit_code(tmp_path):
    env = dict(os.environ)
    env["ROS_DOMAIN_ID"] = str(pick_domain(os.getpid() + 2, exclude={int(os.environ["ROS_DOMAIN_ID"])}))
    p = subprocess.run([sys.executable, "-m", "simllm_ros.cli.edge", "--model", str(tmp_path / "missing")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "configure failed" in p.stdout + p.stderr
    p = subprocess.run([sys.executable, "-m", "simllm_ros.cli.edge", "--help"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "--cache_threshold" in p.stdout and "--param NAME=VALUE" in p.stdout
    p = subprocess.run([sys.executable, "-m", "simllm_ros.cli.edge", "--cache_threshold", "3"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "cache_threshold" in p.stderr
