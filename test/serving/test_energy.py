"""Energy per answer (serving/energy.py, energy_sensors.py) on sysfs trees written by the test: a Jetson's INA3221
rails in both driver layouts, x86 RAPL powercap counters (with a wrap), hwmon power sensors; and this machine's own
powercap where it is readable.

The meter is driven sample by sample with the test's clock where a figure is compared with the integral worked out
by hand (in the comments); one test runs its sampler thread on the real clock."""
import math
import os
import threading
import time

import pytest

from simllm_ros.request import CacheResult, QueryResult
from simllm_ros.serving import health
from simllm_ros.serving.energy import EnergyMeter, EnergyTally
from simllm_ros.serving.energy_sensors import open_source
from simllm_ros.serving.thermal import ThermalState
from simllm_ros.settings import SettingError, Settings


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(f"{text}\n")
    os.replace(tmp, path)


def jetson_iio(root, rails=(("VDD_IN", 4000), ("VDD_CPU_GPU_CV", 1500), ("VDD_SOC", 1200))):
    """JetPack 4/5's ina3221x driver (Xavier NX, Orin NX): rail_name_<i> and in_power<i>_input in milliwatts."""
    dev = os.path.join(root, "bus/i2c/drivers/ina3221x/7-0040/iio:device0")
    for i, (name, mw) in enumerate(rails):
        write(os.path.join(dev, f"rail_name_{i}"), name)
        write(os.path.join(dev, f"in_power{i}_input"), mw)
        write(os.path.join(dev, f"in_voltage{i}_input"), 5000)
    return dev


def jetson_hwmon(root, rails):
    """JetPack 6's ina3221 hwmon driver: in<i>_label, in<i>_input (mV), curr<i>_input (mA); class/hwmon links it."""
    dev = os.path.join(root, "bus/i2c/drivers/ina3221/1-0040/hwmon/hwmon1")
    write(os.path.join(dev, "name"), "ina3221")
    for i, (name, mv, ma) in enumerate(rails, start=1):
        write(os.path.join(dev, f"in{i}_label"), name)
        write(os.path.join(dev, f"in{i}_input"), mv)
        write(os.path.join(dev, f"curr{i}_input"), ma)
    write(os.path.join(dev, "in7_input"), 30)  # the driver's sums of the three channels: not rails
    write(os.path.join(dev, "in7_label"), "sum of shunt voltages")
    write(os.path.join(dev, "curr4_input"), 9999)
    os.makedirs(os.path.join(root, "class/hwmon"), exist_ok=True)
    os.symlink(dev, os.path.join(root, "class/hwmon/hwmon1"))  # the same device, as sysfs links it
    return dev


def rapl(root, zones):
    """class/powercap/<dir>/{name, energy_uj, max_energy_range_uj}; zones: (dir, name, uj, max)."""
    base = os.path.join(root, "class/powercap")
    for d, name, uj, top in zones:
        write(os.path.join(base, d, "name"), name)
        write(os.path.join(base, d, "energy_uj"), uj)
        write(os.path.join(base, d, "max_energy_range_uj"), top)
    return base


def meter_on(kind, root, clock, rails=""):
    source, why = open_source(kind, str(root), rails, clock=clock)
    assert source is not None, why
    m = EnergyMeter(source, period_s=1.0, clock=clock)
    m.sample()
    return m


def at(clock, t):
    clock.t = t


def test_jetson_input_rail_trapezoid_shared_between_requests_in_flight(tmp_path):
    clock = Clock()
    dev = jetson_iio(str(tmp_path))
    power = os.path.join(dev, "in_power0_input")
    m = meter_on("auto", tmp_path, clock)  # t=0: VDD_IN 4 W
    assert m.description == "ina3221: VDD_IN"  # the module's input rail alone: the others are parts of it
    at(clock, 1)
    a = m.begin()
    write(power, 6000)
    at(clock, 2)
    m.sample()  # [0,2]: 4 W -> 6 W; A in [1,2]: (5 + 6) / 2 = 5.5 J
    at(clock, 3)
    b = m.begin()
    write(power, 2000)
    at(clock, 4)
    m.sample()  # [2,4]: 6 W -> 2 W; A alone in [2,3]: (6 + 4) / 2 = 5 J; A and B in [3,4]: (4 + 2) / 2 / 2 = 1.5 J each
    at(clock, 5)
    fa = m.end(a)  # sampled at t=5 (still 2 W): [4,5] 2 J shared: 1 J each
    assert fa.source == "ina3221: VDD_IN"
    assert fa.joules == pytest.approx(5.5 + 5 + 1.5 + 1, abs=1e-9)
    write(power, 4000)
    at(clock, 6)
    fb = m.end(b)  # [5,6]: 2 W -> 4 W, B alone: 3 J
    assert fb.joules == pytest.approx(1.5 + 1 + 3, abs=1e-9)
    # the two figures add up to what the module drew from A's start to B's end
    assert fa.joules + fb.joules == pytest.approx(5.5 + (6 + 2) / 2 * 2 + 2 + 3, abs=1e-9)


def test_jetson_hwmon_layout_volts_times_amps_named_rails(tmp_path):
    clock = Clock()
    jetson_hwmon(str(tmp_path), [("VDD_IN", 5000, 1200), ("VDD_CPU_GPU_CV", 5000, 300), ("VDD_SOC", 5000, 200)])
    m = meter_on("ina3221", tmp_path, clock)
    assert m.description == "ina3221: VDD_IN"  # found once, though class/hwmon links the same folder
    at(clock, 1)
    t = m.begin()
    at(clock, 3)
    assert m.end(t).joules == pytest.approx(6.0 * 2, abs=1e-9)  # 5 V x 1.2 A for 2 s

    m = meter_on("ina3221", tmp_path, clock, rails="VDD_CPU_GPU_CV, VDD_SOC")
    assert m.description == "ina3221: VDD_CPU_GPU_CV, VDD_SOC"
    t = m.begin()
    at(clock, 7)
    assert m.end(t).joules == pytest.approx((1.5 + 1.0) * 4, abs=1e-9)
    source, why = open_source("ina3221", str(tmp_path), "VDD_GPU")
    assert source is None and "energy_rails VDD_GPU not found" in why and "VDD_SOC" in why


def test_jetson_without_input_rail_sums_every_rail(tmp_path):
    clock = Clock()
    # AGX Orin's first INA3221 names no VDD_IN
    jetson_hwmon(str(tmp_path), [("VDD_GPU_SOC", 5000, 1000), ("VDD_CPU_CV", 5000, 400), ("VIN_SYS_5V0", 5000, 600)])
    m = meter_on("auto", tmp_path, clock)
    assert m.description.startswith("ina3221: VDD_GPU_SOC, VDD_CPU_CV, VIN_SYS_5V0 (no input rail")
    t = m.begin()
    at(clock, 0.5)
    assert m.end(t).joules == pytest.approx(10.0 * 0.5, abs=1e-9)


def test_rapl_counters_difference_with_wrap(tmp_path):
    clock = Clock()
    top = 1_000_000
    base = rapl(str(tmp_path), [("intel-rapl:0", "package-0", 900_000, top), ("intel-rapl:0:0", "core", 5, top),
                                ("intel-rapl:0:2", "dram", 100_000, top)])
    m = meter_on("auto", tmp_path, clock)  # no Jetson rail: rapl
    assert m.description == "rapl: package-0, dram (powercap energy counters)"  # core is part of the package
    at(clock, 1)
    a = m.begin()
    write(os.path.join(base, "intel-rapl:0/energy_uj"), 100_000)  # wrapped: 100000 + 1000000 - 900000 = 0.2 J
    write(os.path.join(base, "intel-rapl:0:2/energy_uj"), 150_000)  # + 0.05 J
    write(os.path.join(base, "intel-rapl:0:0/energy_uj"), 999)  # not summed
    at(clock, 2)
    m.sample()  # [0,2]: 0.25 J, 0.125 W; A in [1,2]: 0.125 J
    write(os.path.join(base, "intel-rapl:0/energy_uj"), 300_000)  # + 0.2 J
    at(clock, 3)
    f = m.end(a)  # [2,3]: 0.2 J, all A's
    assert f.joules == pytest.approx(0.125 + 0.2, abs=1e-12) and f.source.startswith("rapl: ")


def test_rapl_psys_is_the_platform(tmp_path):
    clock = Clock()
    rapl(str(tmp_path), [("intel-rapl:0", "package-0", 0, 10**9), ("intel-rapl:1", "psys", 0, 10**9)])
    assert meter_on("rapl", tmp_path, clock).description == "rapl: psys (powercap energy counters)"
    assert meter_on("rapl", tmp_path, clock, rails="package-0").description.startswith("rapl: package-0 ")


def test_hwmon_power_sensors_in_microwatts(tmp_path):
    clock = Clock()
    gpu = os.path.join(str(tmp_path), "class/hwmon/hwmon2")
    write(os.path.join(gpu, "name"), "amdgpu")
    write(os.path.join(gpu, "power1_average"), 15_000_000)  # 15 W
    psu = os.path.join(str(tmp_path), "class/hwmon/hwmon3")
    write(os.path.join(psu, "name"), "corsairpsu")
    write(os.path.join(psu, "power1_input"), 90_000_000)
    write(os.path.join(psu, "power1_label"), "power total")
    m = meter_on("hwmon", tmp_path, clock, rails="amdgpu")
    assert m.description == "hwmon: amdgpu/power1"
    t = m.begin()
    at(clock, 2)
    assert m.end(t).joules == pytest.approx(30.0, abs=1e-9)
    assert meter_on("auto", tmp_path, clock).description == "hwmon: amdgpu/power1, corsairpsu/power total"


@pytest.mark.parametrize("fault", ["vanish", "garbage", "implausible"])
def test_sensor_failing_mid_request_gives_nan_and_a_diagnostics_line(tmp_path, fault):
    clock = Clock()
    dev = jetson_iio(str(tmp_path))
    power = os.path.join(dev, "in_power0_input")
    m = meter_on("auto", tmp_path, clock)
    at(clock, 1)
    a = m.begin()
    at(clock, 2)
    m.sample()
    if fault == "vanish":
        os.remove(power)
    else:
        write(power, "12abc" if fault == "garbage" else 99_000_000)  # 99 kW from a module: not a reading
    at(clock, 3)
    m.sample()
    why = {"vanish": "No such file", "garbage": "not an integer", "implausible": "not a plausible power"}[fault]
    assert why in m.error and power in m.error
    h = health.assess({}, ThermalState(), None, ttft_warn_ms=1e9, queue_limit=8, energy=m.status())
    assert h.level == health.HealthLevel.WARN and "energy sensor failing" in h.message and why in h.message
    write(power, 4000)
    at(clock, 4)
    f = m.end(a)
    assert math.isnan(f.joules) and f.source.startswith("none: ina3221 sensor failed during the request")
    assert why in f.source
    assert m.error == "" and dict(m.status())["energy_answers_without_figure"] == "1"
    at(clock, 5)
    b = m.begin()  # after the sensor came back: a figure again
    at(clock, 6)
    assert m.end(b).joules == pytest.approx(4.0, abs=1e-9)


def test_rapl_garbage_mid_request_and_recovery(tmp_path):
    clock = Clock()
    base = rapl(str(tmp_path), [("intel-rapl:0", "package-0", 1000, 10**6)])
    m = meter_on("rapl", tmp_path, clock)
    at(clock, 1)
    a = m.begin()
    write(os.path.join(base, "intel-rapl:0/energy_uj"), 5 * 10**6)  # above max_energy_range_uj
    at(clock, 2)
    m.sample()
    assert "outside 0..max_energy_range_uj" in m.error
    write(os.path.join(base, "intel-rapl:0/energy_uj"), 2000)
    at(clock, 3)
    fa = m.end(a)  # the first good read after a failure is a new baseline: no interval across the failure
    assert math.isnan(fa.joules) and "outside 0..max_energy_range_uj" in fa.source
    b = m.begin()
    write(os.path.join(base, "intel-rapl:0/energy_uj"), 502_000)
    at(clock, 4)
    assert m.end(b).joules == pytest.approx(0.5, abs=1e-12)


def test_no_sensor_says_why_never_zero(tmp_path):
    m = EnergyMeter.open("auto", str(tmp_path))
    f = m.end(m.begin())
    assert math.isnan(f.joules)
    assert f.source.startswith("none: ina3221: no INA3221 rail") and "rapl: no RAPL zone" in f.source
    assert "hwmon: no power sensor" in f.source
    assert EnergyMeter.open("off", str(tmp_path)).description == "none: energy_source is off"
    h = health.assess({}, ThermalState(), None, ttft_warn_ms=1e9, queue_limit=8, energy=m.status())
    assert h.level == health.HealthLevel.OK and dict(h.values)["energy_source"].startswith("none: ")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file without read permission")
def test_unreadable_rapl_says_permission(tmp_path):
    base = rapl(str(tmp_path), [("intel-rapl:0", "package-0", 1000, 10**6)])
    os.chmod(os.path.join(base, "intel-rapl:0/energy_uj"), 0)
    f = EnergyMeter.open("rapl", str(tmp_path)).description
    assert f.startswith("none: rapl: ") and "permission denied" in f


def test_sampler_thread_closes_each_answer_at_its_end(tmp_path):
    """The real clock and thread: 1 J added in the middle of a request is all its own; a request during which
    nothing was drawn has a true 0 (the sensor read), not an unknown."""
    base = rapl(str(tmp_path), [("intel-rapl:0", "package-0", 0, 10**9)])
    m = EnergyMeter.open("rapl", str(tmp_path), period_s=0.02)
    m.start()
    try:
        t = m.begin()
        time.sleep(0.3)
        write(os.path.join(base, "intel-rapl:0/energy_uj"), 1_000_000)
        time.sleep(0.3)
        f = m.end(t)
        assert f.joules == pytest.approx(1.0, abs=1e-9) and f.source.startswith("rapl: package-0")
        f = m.end(m.begin())
        assert f.joules == 0.0 and f.source.startswith("rapl: ")  # read, and nothing drawn: a true 0
    finally:
        m.stop()


def test_a_lost_request_stops_sharing(tmp_path):
    """A request whose owner is collected without end() (a fault lost it) stops taking a share."""
    clock = Clock()
    jetson_iio(str(tmp_path))
    m = meter_on("auto", tmp_path, clock)

    class Owner:
        pass

    lost = Owner()
    m.begin(lost)
    b = m.begin()
    at(clock, 1)
    del lost  # collected now: its span ends at t=1
    at(clock, 3)
    assert m.end(b).joules == pytest.approx(4.0 / 2 + 4.0 * 2, abs=1e-9)


OWN = "/sys/class/powercap/intel-rapl:0/energy_uj"


@pytest.mark.skipif(not os.path.exists(OWN), reason=f"this machine has no RAPL powercap ({OWN} is missing)")
def test_this_machines_powercap():
    if not os.access(OWN, os.R_OK):
        pytest.skip(f"{OWN} is not readable by this user (Linux lets only root read RAPL counters)")
    m = EnergyMeter.open("rapl", "/sys", period_s=0.02)
    assert m.source is not None, m.description
    m.start()
    try:
        t = m.begin()
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:
            sum(i * i for i in range(1000))
        f = m.end(t)
        assert math.isfinite(f.joules) and 0 < f.joules < 0.3 * 5000, f
    finally:
        m.stop()


def answer(tier, joules, tokens):
    return QueryResult(success=True, cache_result=tier, prompt_tokens=tokens, generated_tokens=0, energy_j=joules)


def test_tally_means_per_tier_and_savings():
    t = EnergyTally(window=10)
    t.record(answer(CacheResult.EXACT_PREFIX, 1.0, 50))  # no miss measured yet: no estimate
    t.record(answer(CacheResult.MISS, 10.0, 100))
    t.record(answer(CacheResult.MISS, 30.0, 100))  # 0.2 J per token
    t.record(answer(CacheResult.EXACT_PREFIX, 2.0, 50))  # its miss: 10 J; saved 8
    t.record(answer(CacheResult.ANSWER, 0.5, 20))  # its miss: 4 J; saved 3.5
    t.record(answer(CacheResult.SEMANTIC, math.nan, 20))  # no figure: not counted
    s = t.snapshot("ina3221: VDD_IN")
    assert s["energy_source"] == "ina3221: VDD_IN"
    assert s["energy_mean_j_miss"] == pytest.approx(20.0) and s["energy_mean_j_exact"] == pytest.approx(1.5)
    assert s["energy_mean_j_answer"] == pytest.approx(0.5) and math.isnan(s["energy_mean_j_semantic"])
    assert s["energy_saved_j_exact"] == pytest.approx(8.0) and s["energy_saved_answers_exact"] == 1
    assert s["energy_saved_j_answer"] == pytest.approx(3.5) and s["energy_saved_j_semantic"] == 0.0


def test_settings():
    s = Settings.from_overrides()
    assert (s.energy_source, s.energy_sysfs_root, s.thermal_zones) == ("auto", "/sys", "auto")
    with pytest.raises(SettingError, match="energy_source must be one of"):
        Settings.from_overrides(energy_source="nvml")
    with pytest.raises(SettingError, match="energy_sample_period_s must be >="):
        Settings.from_overrides(energy_sample_period_s=0.0)


class CounterWriter:
    """Adds 10 mJ to a RAPL counter every 10 ms (about 1 W) until stopped."""

    def __init__(self, path):
        self.path, self.stop = path, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        uj = 0
        while not self.stop.wait(0.01):
            uj += 10_000
            write(self.path, uj)


def test_engine_answers_carry_their_energy(tmp_path):
    """A real engine (the embedded model) on a written powercap tree: each answer carries its joules and
    CacheStats' means per tier."""
    from core_fixtures import fresh, shared_engine

    base = rapl(str(tmp_path), [("intel-rapl:0", "package-0", 0, 10**12)])
    writer = CounterWriter(os.path.join(base, "intel-rapl:0/energy_uj"))
    engine = shared_engine()
    e = fresh(engine).fork(engine.settings.replace(energy_source="rapl", energy_sysfs_root=str(tmp_path)))
    try:
        from simllm_ros.request import QueryRequest
        miss = e.handle(QueryRequest(prompt="Name a colour.", max_new_tokens=8))
        hit = e.handle(QueryRequest(prompt="Name a colour.", max_new_tokens=8))
        assert miss.success and miss.cache_result == CacheResult.MISS
        assert miss.energy_source.startswith("rapl: package-0") and math.isfinite(miss.energy_j)
        # about 1 W while it ran (the writer's pace on a busy machine: loose bounds)
        assert 0.2 * miss.total_ms / 1000 < miss.energy_j < 5 * miss.total_ms / 1000 + 0.05, miss
        assert hit.success and math.isfinite(hit.energy_j) and hit.energy_source == miss.energy_source
        st = e.energy_stats()
        assert st["energy_mean_j_miss"] == pytest.approx(miss.energy_j)
        assert st["energy_source"] == miss.energy_source
    finally:
        writer.stop.set()
        e.unload()
    assert math.isnan(e.handle(QueryRequest(prompt="x")).energy_j)
