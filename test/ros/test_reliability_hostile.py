"""Issue 11 through the REAL node (rclpy over DDS, the real model, real files, FIFOs and sysfs look-alike):
hostile snapshots at configure, failing thermal sensors at CRITICAL, huge and invisible prompts, the
reserved scope, topic request ids, path parameters, undeclared parameters, and what other participants
can see (~/responses per scope, ~/cache_map without scope names).

One node for the module; tests run in file order, each bringing the node to the state it needs.
"""
import os
import shutil
import time
import uuid

import pytest
from diagnostic_msgs.msg import DiagnosticStatus

import hostile_snapshots
from conftest import EDGE_YAML, cpu_gpu_zones, wait_until
from simllm_ros.cache import persistence

NODE = "simllm_rel_hostile"
N = f"/{NODE}"
T, D, S, M, R = f"{N}/thermal", "/diagnostics", f"{N}/cache_stats", f"{N}/cache_map", f"{N}/responses"
DIAG_NAME = f"{NODE}: LLM service"  # "<node's full name without the leading slash>: <task>"
TIMEOUT = 300.0


@pytest.fixture(scope="module")
def thermal(tmp_path_factory):
    return cpu_gpu_zones(tmp_path_factory.mktemp("sys") / "thermal")


@pytest.fixture(scope="module")
def h(ros_harness_factory, thermal, tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    harness = ros_harness_factory(NODE, [EDGE_YAML], overrides={
        "cache_size": "16MB", "thermal_root": thermal.root, "telemetry_period_s": 0.2,
        "persist_path": str(d / "pool"), "persist_interval_s": 0.0, "max_new_tokens": 4,
        "ttft_warn_ms": 600000.0, "queue_limit": 8})
    harness.dir = d
    return harness


def diag(msg):
    return next((s for s in msg.status if s.name == DIAG_NAME), None)


# ----------------------------------------------------------------------------------------- parameters
def test_undeclared_parameter_refusal_names_it(h):
    res = h.set_params(cache_treshold=0.5)[0]
    assert not res.successful and "cache_treshold" in res.reason and "did you mean cache_threshold" in res.reason
    assert "[]" not in res.reason


def test_unusable_paths_refused_when_set(h, tmp_path):
    assert h.state() == "unconfigured"
    res = h.set_params(persist_path="/")[0]
    assert not res.successful and "persist_path" in res.reason and "a folder of its own" in res.reason
    foreign = tmp_path / "notes.txt"
    foreign.write_text("my own notes\n")
    res = h.set_params(semantic_log_path=str(foreign))[0]
    assert not res.successful and "semantic_log_path" in res.reason and "not a simllm_ros decision log" in res.reason
    assert foreign.read_text() == "my own notes\n"
    fifo = tmp_path / "warm.jsonl"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    res = h.set_params(warmup_queries=str(fifo))[0]
    assert not res.successful and "FIFO" in res.reason and time.monotonic() - t0 < 5
    assert h.get_param("persist_path") == str(h.dir / "pool")  # unchanged by the refusals


def test_path_broken_after_set_fails_configure_with_its_reason(h, tmp_path):
    """persist_path accepted when set, then replaced by a regular file: configure fails at once, naming it
    (before: 'no snapshot at ...' at configure and the error only at cleanup, with the pool lost)."""
    p = tmp_path / "pool"
    assert h.set_params(persist_path=str(p))[0].successful
    p.write_text("a file where the folder should be")
    t0 = time.monotonic()
    assert h.change_state("configure", timeout=TIMEOUT) is False
    assert time.monotonic() - t0 < 30, "the path check must come before the model load"
    assert h.state() == "unconfigured"
    assert h.set_params(persist_path=str(h.dir / "pool"))[0].successful


# ------------------------------------------------------------------------------------ request checks
def test_four_megabyte_prompt_refused_fast(h):
    h.ensure_active()
    big = "robot " * (4 * 2**20 // 6)
    times = []
    for _ in range(2):  # best of two: one pause of this shared machine (up to ~0.7 s seen) is not the cost
        t0 = time.monotonic()
        r = h.query(big, max_new_tokens=4, timeout=60)
        times.append(time.monotonic() - t0)
        assert not r.success and "characters" in r.error and "nothing is truncated" in r.error
    dt = min(times)
    print(f"\n4 MB prompt refused in {dt * 1000:.0f} ms (round trip, DDS included; best of 2)")
    assert dt < 2.0, f"{dt:.1f} s (tokenizing it first took ~6 s)"
    assert h.query("Name a colour.", max_new_tokens=2).success


@pytest.mark.parametrize("prompt", ["\u034f", "\ufe0f\ufe0f\ufe0f", " \u17b4 \u17b5 ", "\n\u17b5\n\u034f\n",
                                    "\u115f\u2800\u200b", "\u0301\u20dd"])
def test_invisible_prompts_refused(h, prompt):
    h.ensure_active()
    r = h.query(prompt, max_new_tokens=2)
    assert not r.success and "prompt is empty" in r.error and r.generated_tokens == 0


def test_scope_default_is_reserved_and_empty_scope_is_separate_from_named(h):
    h.ensure_active()
    r = h.query("Where is the station?", scope="default", max_new_tokens=2)
    assert not r.success and "reserved" in r.error
    q = "Which bus goes to the harbour?"
    assert h.query(q, scope="", max_new_tokens=2).success
    r = h.query(q, scope="Default", max_new_tokens=2)  # another scope: sees nothing of ""
    assert r.success and r.similarity == 0.0 and r.reused_tokens == 0


def test_topic_request_ids_empty_or_duplicate_in_flight_refused(h):
    h.ensure_active()
    n0 = len(h.messages(R))
    rid = f"dup-{uuid.uuid4().hex[:8]}"
    for i in range(3):  # sent at once: the first is in flight while the others arrive
        h.publish_request(rid, f"Tell me about the number {i}.", max_new_tokens=24)
    h.publish_request("", "Tell me about the number four.", max_new_tokens=2)
    got = wait_until(lambda: [m for m in h.messages(R)[n0:] if m.request_id == rid][2:] or None, 120)
    assert got is not None, "three answers for the three dup requests"
    time.sleep(1.0)
    mine = [m for m in h.messages(R)[n0:] if m.request_id == rid]
    assert len(mine) == 3
    ok = [m for m in mine if m.success]
    dups = [m for m in mine if not m.success]
    assert len(ok) == 1 and len(dups) == 2 and all("already in flight" in m.error for m in dups), \
        [(m.success, m.error) for m in mine]
    empty = [m for m in h.messages(R)[n0:] if m.request_id == ""]
    assert len(empty) == 1 and not empty[0].success and "request_id is empty" in empty[0].error


# --------------------------------------------------------------------------------- failing sensors
STALL_S = 15.0  # how long three telemetry periods (0.6 s) may take on a paused shared machine
FAULTS = ["abc", "", "nan", "inf", "deleted", "fifo", "deleted_zone"]


def _apply(thermal, fault):
    d = os.path.join(thermal.root, "thermal_zone1")
    temp = os.path.join(d, "temp")
    if os.path.lexists(temp) and not os.path.isdir(temp):
        os.unlink(temp)
    if fault == "deleted":
        return
    if fault == "deleted_zone":
        shutil.rmtree(d)
        return
    if fault == "fifo":
        os.mkfifo(temp)
        return
    thermal.set(1, raw=fault)


def test_sensor_faults_at_critical_keep_shedding_and_telemetry(h, thermal):
    h.ensure_active()
    n = len(h.messages(T))
    thermal.set(1, 95.0)
    assert h.wait_message(T, lambda m: m.throttle_state == m.THROTTLE_CRITICAL, timeout=10, after=n)
    r = h.query("Say hello.", max_new_tokens=2)
    assert not r.success and r.error.startswith("overheated:")
    rows = []
    try:
        for fault in FAULTS:
            _apply(thermal, fault)
            time.sleep(0.5)  # a few telemetry periods with the fault in place
            nt, nd, ns = len(h.messages(T)), len(h.messages(D)), len(h.messages(S))
            # A stall (a sensor read that blocks) publishes nothing at all, for as long as the read hangs. A
            # fixed 2 s window is not used: this shared VM pauses the whole process for up to ~1.5 s at times
            # (measured: 50 ms sleeps overshooting by 0.1-0.7 s with the process idle), so the test waits
            # up to STALL_S for a few messages of each kind, far below what a hung read would allow.
            t0 = time.monotonic()
            fresh = wait_until(lambda: all(len(h.messages(t)) - n >= 3 for t, n in ((T, nt), (D, nd), (S, ns))),
                               STALL_S)
            waited = time.monotonic() - t0
            th, dg, st = h.messages(T)[nt:], h.messages(D)[nd:], h.messages(S)[ns:]
            assert fresh, f"{fault!r}: telemetry stalled ({len(th)}/{len(dg)}/{len(st)} msgs in {STALL_S:.0f} s)"
            assert all(m.throttle_state == m.THROTTLE_CRITICAL for m in th), f"{fault!r}: level fell"
            assert all(diag(m).level == DiagnosticStatus.ERROR for m in dg if diag(m) is not None)
            assert all(m.hottest_zone == "gpu-thermal" and m.hottest_c == pytest.approx(95.0) for m in th)
            gpu = [z for z, on in zip(th[-1].zone_names, th[-1].zone_online) if z == "gpu-thermal"]
            assert gpu and not th[-1].zone_online[list(th[-1].zone_names).index("gpu-thermal")]
            r = h.query("Say hello.", max_new_tokens=2)
            assert not r.success and r.error.startswith("overheated:") and "unreadable" in r.error, r.error
            rows.append(f"{fault!r}: 3 thermal / diagnostics / stats msgs in {waited:.1f} s (period 0.2 s), "
                        "CRITICAL held, request refused")
        # every zone unreadable: still CRITICAL, and /diagnostics says so
        os.unlink(os.path.join(thermal.root, "thermal_zone0", "temp"))
        nd = len(h.messages(D))
        m = h.wait_message(D, lambda m: diag(m) is not None and "no thermal data" in diag(m).message, timeout=10,
                           after=nd)
        assert m is not None and diag(m).level == DiagnosticStatus.ERROR and "overheated" in diag(m).message
    finally:
        thermal.add(0, "cpu-thermal", 45.0)
        thermal.add(1, "gpu-thermal", 50.0)  # a valid cool reading
    n = len(h.messages(T))
    assert h.wait_message(T, lambda m: m.throttle_state == m.THROTTLE_NONE, timeout=10, after=n)
    assert h.query("Say hello.", max_new_tokens=2).success
    print("\nsensor faults at CRITICAL:\n  " + "\n  ".join(rows))


def test_no_thermal_data_warns_by_default_and_errors_when_asked(h, thermal):
    h.ensure_active()
    assert h.change_state("deactivate") and h.change_state("activate")  # clears the recent-errors window
    os.unlink(os.path.join(thermal.root, "thermal_zone0", "temp"))
    os.unlink(os.path.join(thermal.root, "thermal_zone1", "temp"))
    try:
        n = len(h.messages(D))
        m = h.wait_message(D, lambda m: diag(m) is not None and "no thermal data" in diag(m).message, timeout=10,
                           after=n)
        assert m is not None and diag(m).level == DiagnosticStatus.WARN, diag(m).message
        assert h.set_params(thermal_no_data_level="error")[0].successful
        n = len(h.messages(D))
        m = h.wait_message(D, lambda m: diag(m) is not None and diag(m).level == DiagnosticStatus.ERROR, timeout=10,
                           after=n)
        assert m is not None and "no thermal data" in diag(m).message
    finally:
        assert h.set_params(thermal_no_data_level="warn")[0].successful
        thermal.set(0, 45.0)
        thermal.set(1, 50.0)
    n = len(h.messages(D))
    assert h.wait_message(D, lambda m: diag(m) is not None and diag(m).level == DiagnosticStatus.OK, timeout=10,
                          after=n)


# ---------------------------------------------------------------------------------- hostile snapshots
# Each of these also activates and serves; SIMLLM_HOSTILE_ALL=1 runs every variant of hostile_snapshots
# through configure (about 2 s each). A directory at the snapshot path is left out: no snapshot could
# ever be saved there, so that is a configure error by design (test_path_checks.py).
SERVE_VARIANTS = ["hits_infinity", "hits_minus_1e12", "fifo", "symlink_loop", "last_used_1e300"]
ALL = os.environ.get("SIMLLM_HOSTILE_ALL") == "1"
NODE_VARIANTS = [n for n, _ in hostile_snapshots.VARIANTS if n != "directory"] if ALL else SERVE_VARIANTS


def test_hostile_snapshots_configure_and_serve(h):
    """A real snapshot from this node, then each variant at persist_path: configure succeeds within seconds,
    the reason names the file, the pool is empty, telemetry (cache_map included) runs, requests are served."""
    h.ensure_active()
    for q, scope in (("What colour is the sky?", ""), ("Where is the bakery?", "kiosk_a"), ("Is it raining?", "")):
        assert h.query(q, scope=scope, max_new_tokens=2).success  # the variants edit entries 0 to 2
    assert h.change_state("deactivate") and h.change_state("cleanup", timeout=TIMEOUT)
    pool = h.dir / "pool"
    good = h.dir / "good.safetensors"
    shutil.copy(persistence.snapshot_path(str(pool)), good)
    makers = dict(hostile_snapshots.VARIANTS)
    rows, times = [], []
    for name in NODE_VARIANTS:
        shutil.rmtree(pool)
        pool.mkdir()
        makers[name](pool, str(good))
        t0 = time.monotonic()
        assert h.change_state("configure", timeout=TIMEOUT), f"{name}: configure failed"
        secs = time.monotonic() - t0
        times.append(secs)
        engine = h.node._engine
        report = engine.load_report["snapshot"]
        assert engine.load_report["restored"] == 0 and str(pool) in report and len(engine.pool) == 0, (name, report)
        if name in SERVE_VARIANTS:
            assert h.change_state("activate")
            n = len(h.messages(M))
            assert h.query("Is the park open today?", max_new_tokens=2).success
            assert h.wait_message(M, lambda m: len(m.markers) >= 2, timeout=10, after=n), f"{name}: no cache_map"
            assert h.change_state("deactivate")
        rows.append(f"{name}: configure {secs:.1f} s, {report[report.index('kv_pool'):][:90]}")
        assert h.change_state("cleanup", timeout=TIMEOUT)
    print(f"\nhostile snapshots through the node: {len(rows)} variants, 0 failed configures, configure "
          f"{min(times):.1f}-{max(times):.1f} s\n  " + "\n  ".join(rows))


# ------------------------------------------------------------------------------------------- privacy
def test_responses_per_scope_and_cache_map_without_scope_names(h):
    """With responses_per_scope, a subscriber of one scope's topic sees only that scope's answers, and
    the shared ~/responses carries none; cache_map namespaces never name a scope."""
    from simllm_ros.msg import QueryResponse
    assert h.state() == "unconfigured"
    assert h.set_params(responses_per_scope=True)[0].successful
    got = {"kiosk_a": [], "default": [], "kiosk_b": []}
    subs = [h.client.create_subscription(QueryResponse, f"{N}/responses/{k}", lambda m, k=k: got[k].append(m), 100)
            for k in got]
    try:
        h.ensure_active()
        n0, nm = len(h.messages(R)), len(h.messages(M))
        time.sleep(1.0)  # discovery of the per-scope publishers happens on first use; give DDS a moment
        ids = {"kiosk_a": f"a-{uuid.uuid4().hex[:6]}", "": f"d-{uuid.uuid4().hex[:6]}"}
        for scope, rid in ids.items():
            h.publish_request(rid, f"The door code for {scope or 'everyone'} is 4711. Repeat it.",
                              max_new_tokens=4, cache_scope=scope)
        assert wait_until(lambda: got["kiosk_a"] and got["default"], 60), {k: len(v) for k, v in got.items()}
        assert [m.request_id for m in got["kiosk_a"]] == [ids["kiosk_a"]]
        assert [m.request_id for m in got["default"]] == [ids[""]]
        bad = f"bad-{uuid.uuid4().hex[:6]}"
        h.publish_request(bad, "Hello.", max_new_tokens=2, cache_scope="kiosk-3")  # '-' cannot name a topic
        m = h.wait_message(R, lambda m: m.request_id == bad, timeout=30, after=n0)
        assert m is not None and not m.success and "cannot name a topic" in m.error
        time.sleep(0.5)
        shared = [m for m in h.messages(R)[n0:]]
        assert [m.request_id for m in shared] == [bad], "an answer reached the shared ~/responses"
        assert got["kiosk_b"] == []
        cm = h.wait_message(M, lambda m: len(m.markers) >= 3, timeout=10, after=nm)
        spaces = {mk.ns for mk in cm.markers[1:]}
        assert spaces and all(s.startswith("scope-") for s in spaces), spaces
        assert not any(word in s for s in spaces for word in ("kiosk", "default"))
    finally:
        for s in subs:
            h.client.destroy_subscription(s)
        if h.state() == "active":
            assert h.change_state("deactivate") and h.change_state("cleanup", timeout=TIMEOUT)
        assert h.set_params(responses_per_scope=False)[0].successful
