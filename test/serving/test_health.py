"""health.assess and RateWindow: the /diagnostics policy, without ROS."""
import math

import pytest

from simllm_ros.serving import health
from simllm_ros.serving.health import HealthLevel, RateWindow, RecentCounts, ThermalState, assess
from simllm_ros.serving.thermal import ThermalLevel, ThermalReading, ZoneReading

OK_STATS = {"budget_use": 0.5, "requests_total": 10, "errors_total": 0, "rejected_busy_total": 0,
            "ttft_hit_p95_ms": 100.0, "ttft_miss_p95_ms": 300.0, "entries": 3}
QUIET = RecentCounts(requests=10, errors=0, busy=0)


def judge(stats=OK_STATS, thermal=ThermalState(), recent=QUIET, ttft_warn_ms=2000.0, **kw):
    return assess(stats, thermal, recent, ttft_warn_ms=ttft_warn_ms, queue_limit=4, **kw)


def test_quiet_service_is_ok_with_its_values():
    reading = ThermalReading([ZoneReading("cpu", 45.0, True)], "cpu", 45.0, ThermalLevel.OK, True, False)
    h = judge(state="active", reading=reading)
    assert h.level == HealthLevel.OK and h.message == "ok"
    values = dict(h.values)
    assert values["state"] == "active" and values["entries"] == "3" and values["budget_use"] == "0.5"
    assert values["queue_limit"] == "4" and values["thermal_level"] == "OK" and values["hottest_c"] == "45.0"
    assert values["requests_total"] == "10" and values["ttft_hit_p95_ms"] == "100"


def test_thermal_state_sets_the_level():
    h = judge(thermal=ThermalState(ThermalLevel.CRITICAL, "cpu at 95.0 C"))
    assert h.level == HealthLevel.ERROR and h.message == "overheated, shedding load: cpu at 95.0 C"
    h = judge(thermal=ThermalState(ThermalLevel.WARN, "cpu at 80.0 C"))
    assert h.level == HealthLevel.WARN and h.message == "running hot, shorter answers: cpu at 80.0 C"
    assert dict(h.values)["thermal_level"] == "WARN"


def test_missing_statistics_is_an_error():
    h = judge(stats=None, recent=None, thermal=ThermalState(ThermalLevel.WARN, "warm"))
    assert h.level == HealthLevel.ERROR
    assert h.message == "running hot, shorter answers: warm; cache statistics unavailable"
    assert "entries" not in dict(h.values)


@pytest.mark.parametrize("use, level", [(health.BUDGET_SHARE_FOR_WARN, HealthLevel.OK), (0.99, HealthLevel.WARN)])
def test_nearly_full_pool_warns(use, level):
    h = judge(stats=dict(OK_STATS, budget_use=use))
    assert h.level == level
    assert ("KV pool nearly full (99% of budget)" in h.message) == (level == HealthLevel.WARN)


@pytest.mark.parametrize("requests, errors, level", [
    (6, 3, HealthLevel.ERROR),   # half failed, 3 of them
    (4, 2, HealthLevel.WARN),    # half failed but only 2: not yet an error
    (6, 2, HealthLevel.WARN),
    (2, 1, HealthLevel.OK),      # one bad request is noise
    (20, 2, HealthLevel.OK),     # 10% is not above 10%
    (0, 0, HealthLevel.OK),
])
def test_recent_failures(requests, errors, level):
    h = judge(recent=RecentCounts(requests, errors, 0))
    assert h.level == level, h.message
    if level != HealthLevel.OK:
        assert h.message == f"{errors} of {requests} requests failed in the last 30 s"


def test_busy_refusals_warn_and_name_the_limit():
    h = judge(recent=RecentCounts(10, 0, 5))
    assert h.level == HealthLevel.WARN
    assert h.message == "5 requests refused as busy in the last 30 s (queue_limit 4)"


def test_latency_threshold_comes_from_the_caller():
    assert judge(ttft_warn_ms=300.0).level == HealthLevel.OK  # 300 is not above 300
    h = judge(ttft_warn_ms=250.0)
    assert h.level == HealthLevel.WARN
    assert h.message == "p95 time to first token 300 ms above ttft_warn_ms 250 ms"


def test_reasons_add_up_and_the_worst_level_wins():
    h = judge(stats=dict(OK_STATS, budget_use=0.99), recent=RecentCounts(4, 3, 1),
              thermal=ThermalState(ThermalLevel.WARN, "warm"), ttft_warn_ms=10.0)
    assert h.level == HealthLevel.ERROR
    assert h.message.split("; ") == [
        "running hot, shorter answers: warm", "KV pool nearly full (99% of budget)",
        "3 of 4 requests failed in the last 30 s", "1 requests refused as busy in the last 30 s (queue_limit 4)",
        "p95 time to first token 300 ms above ttft_warn_ms 10 ms"]


def test_rate_window_forgets_what_is_older_than_the_window():
    w = RateWindow(window_s=30.0)
    s = {"requests_total": 0, "errors_total": 0, "rejected_busy_total": 0}
    assert w.update(0.0, s) == RecentCounts(0, 0, 0)
    assert w.update(10.0, dict(s, requests_total=10, errors_total=4, rejected_busy_total=2)) == RecentCounts(10, 4, 2)
    assert w.update(20.0, dict(s, requests_total=12, errors_total=4, rejected_busy_total=2)) == RecentCounts(12, 4, 2)
    # at t=45 the t=0 and t=10 samples are older than 30 s: only what happened since t=20 counts
    assert w.update(45.0, dict(s, requests_total=13, errors_total=4, rejected_busy_total=2)) == RecentCounts(1, 0, 0)
    w.clear()
    assert w.update(50.0, dict(s, requests_total=99)) == RecentCounts(0, 0, 0)


def test_nan_temperature_is_reported_as_nan():
    reading = ThermalReading([ZoneReading("cpu", math.nan, False)], "", math.nan, ThermalLevel.OK, False, False)
    assert dict(judge(reading=reading).values)["hottest_c"] == "nan"


@pytest.mark.parametrize("zones, why", [([], "no thermal zones found"),
                                        ([ZoneReading("cpu", math.nan, False)], "1 zone(s) found, none readable")])
def test_no_thermal_data_is_never_ok(zones, why):
    """No readable zone: WARN "no thermal data" by default, ERROR when thermal_no_data_level is error."""
    reading = ThermalReading(zones, "", math.nan, ThermalLevel.OK, False, False)
    h = judge(reading=reading)
    assert h.level == HealthLevel.WARN and h.message == f"no thermal data ({why})"
    assert judge(reading=reading, no_data_level=HealthLevel.ERROR).level == HealthLevel.ERROR
    timed_out = ThermalReading(zones, "", math.nan, ThermalLevel.OK, False, False, timed_out=True)
    assert "the sensor read timed out" in judge(reading=timed_out).message


def test_failed_hot_sensor_stays_error_and_says_no_data():
    reading = ThermalReading([ZoneReading("gpu", math.nan, False)], "gpu", 95.0, ThermalLevel.CRITICAL, False,
                             False, held=("gpu",))
    h = judge(reading=reading, thermal=ThermalState(ThermalLevel.CRITICAL, "gpu held at 95.0 C"))
    assert h.level == HealthLevel.ERROR and "overheated" in h.message and "no thermal data" in h.message


def test_a_failed_invariance_probe_is_a_warning_with_its_value():
    """Where the model's batch-invariance probe failed (an AMX CPU with oneDNN uncapped did), lossless callers
    get misses: /diagnostics says so instead of only getting slower."""
    h = judge(lossless=False)
    assert h.level == HealthLevel.WARN and "batch-invariance probe failed" in h.message
    assert dict(h.values)["lossless_reuse"] == "false"
    h = judge(lossless=True)
    assert h.level == HealthLevel.OK and h.message == "ok" and dict(h.values)["lossless_reuse"] == "true"
    assert "lossless_reuse" not in dict(judge().values)  # no model loaded: nothing claimed


FACTS = health.BackendFacts(precision="bfloat16, 4-bit weights", numerics="abc (contract 3)", attention="kernel",
                            int4_products="amx", lossless=True)


def test_service_health_adds_the_model_and_its_kernels_after_the_policy_values():
    """/diagnostics as the node publishes it: assess's values, then the model and the backend's facts (kinds
    that are empty are left out), the hardware_id parameter or else the host name."""
    import socket

    from simllm_ros.settings import Settings
    settings = Settings().replace(model="my-model.gguf", hardware_id="robot7")
    h = health.ServiceHealth().report(0.0, OK_STATS, ThermalState(), None, settings, FACTS, queue_limit=4,
                                      state="active")
    keys = [k for k, _ in h.values]
    assert keys[-6:] == ["lossless_reuse", "model", "precision", "numerics", "attention", "int4_products"]
    assert dict(h.values)["model"] == "my-model.gguf" and h.hardware_id == "robot7" and h.level == HealthLevel.OK
    bare = health.ServiceHealth().report(0.0, OK_STATS, ThermalState(), None, Settings(), None, queue_limit=4,
                                         state="inactive")
    assert bare.hardware_id == socket.gethostname() and [k for k, _ in bare.values][-1] == "model"


def test_service_health_judges_its_own_window_and_the_settings_thresholds():
    from simllm_ros.settings import Settings
    settings = Settings().replace(thermal_no_data_level="error", ttft_warn_ms=50.0)
    sh = health.ServiceHealth()
    assert sh.report(0.0, OK_STATS, ThermalState(), None, settings, None, queue_limit=4, state="").level == \
        HealthLevel.WARN  # p95 300 ms above 50
    failing = {**OK_STATS, "requests_total": 20, "errors_total": 10}
    h = sh.report(1.0, failing, ThermalState(), None, Settings(), None, queue_limit=4, state="")
    assert h.level == HealthLevel.ERROR and "10 of 10 requests failed" in h.message
    sh.clear()
    assert sh.report(2.0, failing, ThermalState(), None, Settings(), None, queue_limit=4, state="").level == \
        HealthLevel.OK
    no_zones = ThermalReading([], "", math.nan, ThermalLevel.OK, False, False)
    assert sh.report(3.0, failing, ThermalState(), no_zones, settings, None, queue_limit=4, state="").level == \
        HealthLevel.ERROR  # thermal_no_data_level=error


def test_an_unreachable_fleet_store_warns_and_its_values_are_shown():
    up = {"fleet_store": "connected", "fleet_last_error": "", "fleet_kv_fetches": 3}
    h = judge(fleet=up)
    assert h.level == HealthLevel.OK and dict(h.values)["fleet_kv_fetches"] == "3"
    down = {**up, "fleet_store": "unreachable", "fleet_last_error": "ConnectionError: refused"}
    h = judge(fleet=down)
    assert h.level == HealthLevel.WARN and "fleet store unreachable (ConnectionError: refused)" in h.message
    assert dict(h.values)["fleet_store"] == "unreachable"
    assert "fleet_store" not in dict(judge().values)  # no store: nothing about it


def test_approximate_answers_differing_above_the_bound_warn_and_each_group_is_shown():
    fine = {"answer/kiosk": {"labels": 120, "observed": 0.0, "low": 0.0, "high": 0.03, "served": 40, "explored": 4}}
    h = judge(approx=fine, approx_bound=0.02)
    assert h.level == HealthLevel.OK
    assert dict(h.values)["approx[answer/kiosk]"] == "served 40, checked 120, differ 0.000 [0.000, 0.030]"
    bad = {"semantic/lobby": {"labels": 60, "observed": 0.2, "low": 0.12, "high": 0.31, "served": 9, "explored": 1}}
    h = judge(approx=bad, approx_bound=0.05)
    assert h.level == HealthLevel.WARN and "approximate answers (semantic/lobby) differ" in h.message
    few = {"semantic/lobby": {**bad["semantic/lobby"], "labels": 5}}
    assert judge(approx=few, approx_bound=0.05).level == HealthLevel.OK  # too few checks to tell
