"""ThermalMonitor against a fake sysfs tree written in tmp_path."""
import math
import os
import shutil
import time

import pytest

from simllm_ros.serving.thermal import ThermalLevel, ThermalMonitor, parse_zone_filter, scan_zones


def write_zone(root, index, zone_type, temp=None):
    d = root / f"thermal_zone{index}"
    d.mkdir(exist_ok=True)
    (d / "type").write_text(zone_type + "\n")
    if temp is not None:
        (d / "temp").write_text(f"{temp}\n")
    return d


def set_temp(root, index, milli):
    (root / f"thermal_zone{index}" / "temp").write_text(f"{milli}\n")


@pytest.fixture
def jetson(tmp_path):
    write_zone(tmp_path, 0, "cpu-thermal", 45500)
    write_zone(tmp_path, 1, "gpu-thermal", 47000)
    write_zone(tmp_path, 2, "tj-thermal", 48250)
    # not zones: must be ignored
    (tmp_path / "cooling_device0").mkdir()
    (tmp_path / "cooling_device0" / "type").write_text("fan\n")
    return tmp_path


def zone_map(reading):
    return {z.name: z for z in reading.zones}


def test_reads_all_zones_in_degrees(jetson):
    r = ThermalMonitor(str(jetson)).read()
    zones = zone_map(r)
    assert list(zones) == ["cpu-thermal", "gpu-thermal", "tj-thermal"]
    assert zones["cpu-thermal"].temp_c == pytest.approx(45.5)
    assert zones["gpu-thermal"] == ("gpu-thermal", 47.0, True)
    assert r.hottest_name == "tj-thermal" and r.hottest_c == pytest.approx(48.25)
    assert r.available and r.level == ThermalLevel.OK and r.level_name == "ok"


def test_zones_sorted_by_numeric_index(tmp_path):
    write_zone(tmp_path, 10, "ten", 10000)
    write_zone(tmp_path, 2, "two", 2000)
    assert [z.name for z in scan_zones(str(tmp_path))] == ["two", "ten"]


def test_missing_temp_file_is_offline_not_zero(jetson):
    os.remove(jetson / "thermal_zone1" / "temp")
    zones = zone_map(ThermalMonitor(str(jetson)).read())
    gpu = zones["gpu-thermal"]
    assert gpu.online is False and math.isnan(gpu.temp_c)
    assert zones["cpu-thermal"].online


@pytest.mark.parametrize("content", ["", "garbage", "45.5C", "0x1f", "\x00\x01", "12 34"])
def test_garbage_temp_is_offline(jetson, content):
    (jetson / "thermal_zone0" / "temp").write_text(content)
    cpu = zone_map(ThermalMonitor(str(jetson)).read())["cpu-thermal"]
    assert cpu == ("cpu-thermal", cpu.temp_c, False) and math.isnan(cpu.temp_c)


def test_non_ascii_temp_is_offline(jetson):
    (jetson / "thermal_zone0" / "temp").write_bytes(b"\xff\xfe45000")
    assert not zone_map(ThermalMonitor(str(jetson)).read())["cpu-thermal"].online


def test_jetson_powered_down_placeholder_is_offline(jetson):
    set_temp(jetson, 2, -256000)  # what Orin reports for a zone whose cluster is off
    r = ThermalMonitor(str(jetson)).read()
    assert not zone_map(r)["tj-thermal"].online
    assert r.hottest_name == "gpu-thermal"


def test_negative_but_plausible_temperature_is_online(tmp_path):
    write_zone(tmp_path, 0, "outdoor", -12500)
    r = ThermalMonitor(str(tmp_path)).read()
    assert r.zones == [("outdoor", -12.5, True)]


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root can read mode-000 files")
def test_permission_denied_is_offline(jetson):
    p = jetson / "thermal_zone0" / "temp"
    p.chmod(0)
    try:
        assert not zone_map(ThermalMonitor(str(jetson)).read())["cpu-thermal"].online
    finally:
        p.chmod(0o644)


def test_temp_is_a_directory_is_offline(jetson):
    os.remove(jetson / "thermal_zone0" / "temp")
    (jetson / "thermal_zone0" / "temp").mkdir()
    assert not zone_map(ThermalMonitor(str(jetson)).read())["cpu-thermal"].online


def test_missing_type_uses_directory_name(tmp_path):
    d = tmp_path / "thermal_zone3"
    d.mkdir()
    (d / "temp").write_text("30000")
    assert scan_zones(str(tmp_path)) == [("thermal_zone3", 30.0, True)]


def test_duplicate_types_are_disambiguated(tmp_path):
    write_zone(tmp_path, 0, "acpitz", 30000)
    write_zone(tmp_path, 1, "acpitz", 31000)
    names = [z.name for z in scan_zones(str(tmp_path))]
    assert names == ["acpitz/thermal_zone0", "acpitz/thermal_zone1"]


def test_filter_keeps_only_named_zones(jetson):
    set_temp(jetson, 2, 99000)  # tj is hottest, but filtered out
    r = ThermalMonitor(str(jetson), zone_filter="cpu-thermal, gpu-thermal").read()
    assert [z.name for z in r.zones] == ["cpu-thermal", "gpu-thermal"]
    assert r.hottest_name == "gpu-thermal" and r.level == ThermalLevel.OK


def test_filter_as_list_and_missing_name_reported_offline(jetson):
    r = ThermalMonitor(str(jetson), zone_filter=["gpu-thermal", "cv0-thermal"]).read()
    zones = zone_map(r)
    assert list(zones) == ["gpu-thermal", "cv0-thermal"]
    assert zones["gpu-thermal"].online and not zones["cv0-thermal"].online
    assert math.isnan(zones["cv0-thermal"].temp_c)


def test_parse_zone_filter():
    assert parse_zone_filter("") == ()
    assert parse_zone_filter(None) == ()
    assert parse_zone_filter(" cpu-thermal ,,gpu-thermal,cpu-thermal") == ("cpu-thermal", "gpu-thermal")


def test_escalation_hysteresis_and_recovery(jetson):
    mon = ThermalMonitor(str(jetson), warn_c=75, critical_c=90, hysteresis_c=5)
    steps = [  # (tj milli-degC, expected level)
        (74999, ThermalLevel.OK),
        (75000, ThermalLevel.WARN),      # reaching the threshold escalates at once
        (71000, ThermalLevel.WARN),      # below 75 but not below 70: stays
        (90000, ThermalLevel.CRITICAL),
        (86000, ThermalLevel.CRITICAL),  # not below 85
        (84900, ThermalLevel.WARN),      # below 90-5: down one level only
        (70000, ThermalLevel.WARN),      # 70 is not below 70
        (69900, ThermalLevel.OK),        # recovered
        (74000, ThermalLevel.OK),        # going up again needs the threshold itself
    ]
    for milli, expected in steps:
        set_temp(jetson, 2, milli)
        r = mon.read()
        assert r.level == expected, (milli, r.level)
        assert r.hottest_name == "tj-thermal"


def test_jump_from_critical_straight_to_ok(jetson):
    mon = ThermalMonitor(str(jetson), warn_c=75, critical_c=90, hysteresis_c=5)
    set_temp(jetson, 2, 95000)
    assert mon.read().level == ThermalLevel.CRITICAL
    set_temp(jetson, 2, 50000)
    r = mon.read()
    assert r.level == ThermalLevel.OK and r.level_changed
    assert not mon.read().level_changed


def test_escalation_ignores_offline_hot_zone(jetson):
    mon = ThermalMonitor(str(jetson), warn_c=75, critical_c=90)
    (jetson / "thermal_zone2" / "temp").write_text("not a number")
    r = mon.read()
    assert r.level == ThermalLevel.OK and r.hottest_name == "gpu-thermal"


def test_set_thresholds_live(jetson):
    mon = ThermalMonitor(str(jetson), warn_c=75, critical_c=90, hysteresis_c=5)
    set_temp(jetson, 2, 60000)
    assert mon.read().level == ThermalLevel.OK
    mon.set_thresholds(warn_c=55, critical_c=59)
    assert mon.read().level == ThermalLevel.CRITICAL
    mon.set_thresholds(critical_c=70, hysteresis_c=2)  # 60 < 70-2 -> WARN
    assert mon.read().level == ThermalLevel.WARN
    with pytest.raises(ValueError):
        mon.set_thresholds(warn_c=80)  # would be above critical 70
    with pytest.raises(ValueError):
        mon.set_thresholds(hysteresis_c=-1)
    assert (mon.warn_c, mon.critical_c, mon.hysteresis_c) == (55.0, 70.0, 2.0)  # unchanged by refusals


def test_bad_thresholds_refused_at_construction(tmp_path):
    with pytest.raises(ValueError):
        ThermalMonitor(str(tmp_path), warn_c=90, critical_c=90)
    with pytest.raises(ValueError):
        ThermalMonitor(str(tmp_path), warn_c=float("nan"))


def test_empty_root_is_ok_but_unavailable(tmp_path):
    r = ThermalMonitor(str(tmp_path)).read()
    assert r.zones == [] and not r.available
    assert r.level == ThermalLevel.OK and r.hottest_name == "" and math.isnan(r.hottest_c)


def test_nonexistent_root_is_ok_but_unavailable(tmp_path):
    r = ThermalMonitor(str(tmp_path / "nope")).read()
    assert r.zones == [] and not r.available and r.level == ThermalLevel.OK


def test_all_zones_going_offline_holds_level(jetson):
    """Unknown is never cool: with every temp file gone the level stays CRITICAL, and the report says the
    hottest zone is held at its last valid reading."""
    mon = ThermalMonitor(str(jetson), warn_c=75, critical_c=90)
    set_temp(jetson, 2, 95000)
    assert mon.read().level == ThermalLevel.CRITICAL
    for i in range(3):
        os.remove(jetson / f"thermal_zone{i}" / "temp")
    r = mon.read()
    assert not r.available and r.level == ThermalLevel.CRITICAL and not r.level_changed
    assert all(not z.online for z in r.zones) and len(r.zones) == 3
    assert r.hottest_name == "tj-thermal" and r.hottest_c == pytest.approx(95.0) and "tj-thermal" in r.held


def _break(root, index, fault):
    d = root / f"thermal_zone{index}"
    temp = d / "temp"
    if fault == "deleted_zone":
        shutil.rmtree(d)
    elif fault == "deleted_temp":
        temp.unlink()
    elif fault == "fifo":
        temp.unlink()
        os.mkfifo(temp)
    elif fault == "fifo_type_and_temp":
        temp.unlink()
        os.mkfifo(temp)
        (d / "type").unlink()
        os.mkfifo(d / "type")
    elif fault == "directory":
        temp.unlink()
        temp.mkdir()
    elif fault == "symlink_loop":
        temp.unlink()
        os.symlink("temp", temp)
    elif fault == "dev_zero":
        temp.unlink()
        os.symlink("/dev/zero", temp)
    else:
        temp.write_text(fault)


SENSOR_FAULTS = ["abc", "", "\n", "nan", "NaN", "inf", "-inf", "1e9", "95000.5", "999999999999999999999",
                 "-256000", "deleted_temp", "deleted_zone", "fifo", "fifo_type_and_temp", "directory",
                 "symlink_loop", "dev_zero"]


@pytest.mark.parametrize("fault", SENSOR_FAULTS, ids=[repr(f) for f in SENSOR_FAULTS])
def test_hot_sensor_failing_at_critical_keeps_level_until_a_valid_cool_reading(jetson, fault):
    mon = ThermalMonitor(str(jetson), warn_c=75, critical_c=90, hysteresis_c=5)
    set_temp(jetson, 2, 95000)
    assert mon.read().level == ThermalLevel.CRITICAL
    _break(jetson, 2, fault)
    slow = 0
    for _ in range(3):  # the other zones read 45-47 C, validly: that is not a cool reading of the hot zone
        t0 = time.monotonic()
        r = mon.read()
        # A read that blocks hangs its scan for good: every later read times out too. A pause of this shared
        # machine (0.1-0.7 s measured) can slow one read, not all of them.
        slow += time.monotonic() - t0 >= 0.4 or r.timed_out
        assert r.level == ThermalLevel.CRITICAL, (fault, r)
        if r.timed_out:
            continue
        assert r.hottest_name == "tj-thermal" and r.held == ("tj-thermal",)
        assert r.available and not zone_map(r)["tj-thermal"].online
    assert slow <= 1, f"{fault!r}: a sensor read blocked ({slow} of 3 reads slow or timed out)"
    # The sensor comes back: the level falls only on valid readings, with hysteresis.
    if fault == "deleted_zone":
        write_zone(jetson, 2, "tj-thermal", 86000)
    else:
        shutil.rmtree(jetson / "thermal_zone2")
        write_zone(jetson, 2, "tj-thermal", 86000)
    assert mon.read().level == ThermalLevel.CRITICAL  # 86 is not below 90 - 5
    set_temp(jetson, 2, 84000)
    r = mon.read()
    assert r.level == ThermalLevel.WARN and r.held == ()
    set_temp(jetson, 2, 60000)
    assert mon.read().level == ThermalLevel.OK


def test_zone_never_read_is_unknown_not_cool(tmp_path):
    write_zone(tmp_path, 0, "cpu-thermal", "garbage")
    r = ThermalMonitor(str(tmp_path)).read()
    assert r.level == ThermalLevel.OK and not r.available and r.hottest_name == "" and r.held == ()


def test_real_sysfs_never_raises():
    r = ThermalMonitor("/sys/class/thermal").read()
    for z in r.zones:
        assert z.online == (not math.isnan(z.temp_c))
    assert r.available == any(z.online for z in r.zones)


def test_policy_sheds_load_only_while_critical_and_reports_each_change_once(jetson):
    """ThermalPolicy, what the node applies: a change is reported once (rising as a warning), the refusal reason
    stands while CRITICAL and goes when the level falls."""
    from simllm_ros.serving.thermal import ThermalPolicy
    policy = ThermalPolicy(ThermalMonitor(str(jetson), warn_c=75, critical_c=90, hysteresis_c=5))
    reading, change = policy.read()
    assert reading.level == ThermalLevel.OK and change is None and policy.overheated is None
    set_temp(jetson, 2, 95000)
    _, change = policy.read()
    assert (change.previous, change.level, change.rising) == (ThermalLevel.OK, ThermalLevel.CRITICAL, True)
    assert change.message == ("thermal level OK -> CRITICAL: hottest zone tj-thermal at 95.0 C "
                              "(threshold 90.0 C)")
    assert policy.overheated == change.reason == policy.state.reason
    assert policy.read()[1] is None and policy.overheated  # still critical: no second report, still refusing
    set_temp(jetson, 2, 80000)
    _, change = policy.read()
    assert (change.level, change.rising) == (ThermalLevel.WARN, False) and policy.overheated is None
    set_temp(jetson, 2, 50000)
    _, change = policy.read()
    assert change.level == ThermalLevel.OK and change.message == "thermal level WARN -> OK" and policy.state.reason == ""


# --- "auto": the chip's own zones by the names real boards give them (recorded zone lists) ---
JETSON_XAVIER_NX = [("AO-therm", 36500), ("CPU-therm", 38000), ("GPU-therm", 37500), ("PMIC-Die", 100000),
                    ("AUX-therm", 37000), ("thermal-fan-est", 37800), ("Tboard_tegra", 33000),
                    ("Tdiode_tegra", 35000)]
JETSON_ORIN_JP6 = [("cpu-thermal", 47000), ("gpu-thermal", 45000), ("cv0-thermal", -256000),
                   ("cv1-thermal", -256000), ("cv2-thermal", -256000), ("soc0-thermal", 46000),
                   ("soc1-thermal", 44000), ("soc2-thermal", 45500), ("tj-thermal", 47500), ("tboard-thermal", 40000)]
JETSON_ORIN_JP5 = [("CPU-therm", 51000), ("GPU-therm", 49000), ("CV0-therm", -256000), ("SOC0-therm", 48000),
                   ("SOC1-therm", 47000), ("SOC2-therm", 47500), ("Tj-therm", 51500)]
RASPBERRY_PI_5 = [("cpu-thermal", 52000)]
X86 = [("acpitz", 27800), ("x86_pkg_temp", 56000), ("INT3400 Thermal", 20000), ("pch_cannonlake", 48000)]


def board(root, zones):
    root.mkdir(exist_ok=True)
    for i, (zone_type, milli) in enumerate(zones):
        write_zone(root, i, zone_type, milli)
    return root


@pytest.mark.parametrize("zones, watched, hottest", [
    (JETSON_XAVIER_NX, ["AO-therm", "CPU-therm", "GPU-therm", "AUX-therm"], ("CPU-therm", 38.0)),
    (JETSON_ORIN_JP6, ["cpu-thermal", "gpu-thermal", "cv0-thermal", "cv1-thermal", "cv2-thermal", "soc0-thermal",
                       "soc1-thermal", "soc2-thermal", "tj-thermal"], ("tj-thermal", 47.5)),
    (JETSON_ORIN_JP5, [t for t, _ in JETSON_ORIN_JP5], ("Tj-therm", 51.5)),
    (RASPBERRY_PI_5, ["cpu-thermal"], ("cpu-thermal", 52.0)),
    (X86, [t for t, _ in X86], ("x86_pkg_temp", 56.0)),
])
def test_auto_watches_the_chips_own_zones(tmp_path, zones, watched, hottest):
    r = ThermalMonitor(str(board(tmp_path, zones)), zone_filter="auto").read()
    assert [z.name for z in r.zones] == watched
    assert (r.hottest_name, r.hottest_c) == hottest and r.level == ThermalLevel.OK


def test_auto_leaves_out_the_jetson_pmic_placeholder(tmp_path):
    """Every zone (the filter "") would read PMIC-Die's fixed 100 C and shed every request."""
    root = board(tmp_path, JETSON_XAVIER_NX)
    assert ThermalMonitor(str(root), zone_filter="").read().level == ThermalLevel.CRITICAL
    assert ThermalMonitor(str(root), zone_filter="auto").read().level == ThermalLevel.OK
    # a board with no known chip zone: every zone but the placeholders
    other = board(root / "other", [("PMIC-Die", 100000), ("board", 30000)])
    assert [z.name for z in ThermalMonitor(str(other), zone_filter="auto").read().zones] == ["board"]


def test_auto_is_the_node_default_and_documented():
    from simllm_ros.settings import Settings

    assert Settings.from_overrides().thermal_zones == "auto"
    from conftest import EDGE_YAML as edge
    text = open(edge, encoding="utf-8").read()
    assert 'thermal_zones: "auto"' in text
    for name in ("CPU-therm", "GPU-therm", "SOC0-therm", "Tj-therm", "tj-thermal", "cv0-thermal", "PMIC-Die",
                 "Raspberry Pi 4/5: cpu-thermal"):
        assert name in text, name
