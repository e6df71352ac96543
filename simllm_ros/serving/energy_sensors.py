"""Power sensors in Linux sysfs: Jetson INA3221 rails, RAPL energy counters (powercap) and hwmon power sensors.

Why it exists: a robot runs on a battery, and what an answer costs in joules is only known where the platform
measures power; each platform exposes it differently, and energy.EnergyMeter (sampling, integration, attribution
to requests) should not care which. A source is either a power source (`read` gives watts now) or a counter
source (`read` gives the joules since its previous good read); both raise SensorError with the file and the
reason when a value is missing, not a number or implausible, so that no wrong figure is ever integrated.

Layouts read here (all below one root, "/sys" on a real machine; tests point it at a written tree):
- Jetson INA3221, older driver: bus/i2c/drivers/ina3221x/<dev>/iio:device<N>/rail_name_<i> and
  in_power<i>_input (milliwatts);
- Jetson INA3221, hwmon driver (JetPack 5.1+ / 6): bus/i2c/drivers/ina3221/<dev>/hwmon/hwmon<N>/in<i>_label,
  in<i>_input (bus millivolts) and curr<i>_input (milliamperes), or the same folder under class/hwmon with
  `name` ina3221;
- RAPL: class/powercap/intel-rapl:<N>[:<M>]/name, energy_uj (microjoules, wrapping at max_energy_range_uj);
- hwmon: class/hwmon/hwmon<N>/power<i>_input (microwatts; power<i>_average where there is no _input), with an
  optional power<i>_label.
Which sensors are summed: the named ones (`rails`), else the whole: Jetson's input rail (VDD_IN, POM_5V_IN) where
the module has one (its other rails are parts of it), else every rail; RAPL's psys zone where there is one (the
platform), else every package and dram zone; hwmon: every power sensor.
"""
from __future__ import annotations

import glob
import os
import re
import time
from typing import Iterable

from ..safe_io import describe_error, read_regular

SOURCES = ("ina3221", "rapl", "hwmon")  # auto tries them in this order
INPUT_RAILS = ("VDD_IN", "POM_5V_IN")  # a Jetson module's total input: its other rails are parts of it
MAX_PLAUSIBLE_W = 5000.0  # a reading above this (one sensor, or a counter's rate) is garbage, not power
NEGATIVE_TOLERANCE_W = 1.0  # INA3221 shunt offsets read a few milliwatts below zero on idle rails: clamped to 0
_RAPL_DIR_RE = re.compile(r"^intel-rapl:\d+(:\d+)?$")


class SensorError(Exception):
    """A sensor could not be read now, or read a value that is not a plausible power or energy."""


def _read_int(path: str) -> int:
    try:
        text = read_regular(path, 64).decode("ascii").strip()
    except PermissionError:
        raise SensorError(f"{path}: permission denied") from None
    except OSError as e:
        raise SensorError(f"{path}: {describe_error(e)}") from None
    except ValueError:
        raise SensorError(f"{path}: not ASCII text") from None
    if not re.fullmatch(r"-?\d+", text):
        raise SensorError(f"{path}: not an integer: {text[:20]!r}")
    return int(text)


def _read_label(path: str) -> str | None:
    try:
        return read_regular(path, 256).decode("ascii", errors="replace").strip() or None
    except (OSError, ValueError):
        return None


def _plausible_w(path: str, watts: float) -> float:
    if watts < -NEGATIVE_TOLERANCE_W or watts > MAX_PLAUSIBLE_W:
        raise SensorError(f"{path}: {watts:.3f} W is not a plausible power reading")
    return max(watts, 0.0)


def _names(rails: str | Iterable[str] | None) -> tuple[str, ...]:
    items = rails.split(",") if isinstance(rails, str) else list(rails or ())
    return tuple(dict.fromkeys(s.strip() for s in items if str(s).strip()))


# (label, files, scale): a sensor's watts are the product of its files' integers times scale
Sensor = tuple[str, tuple[str, ...], float]


class PowerSource:
    """Sensors read as power: watts now, summed over the chosen sensors."""

    kind = "power"

    def __init__(self, name: str, sensors: list[Sensor], description: str):
        self.name = name  # ina3221 or hwmon
        self.sensors = sensors
        self.description = description

    def read(self) -> float:
        total = 0.0
        for _, files, scale in self.sensors:
            value = scale
            for f in files:
                value *= _read_int(f)
            total += _plausible_w(files[-1], value)
        return _plausible_w(self.name, total)


class CounterSource:
    """RAPL's energy counters: the joules since the previous good read (None for the first one, and for the first
    one after a failure: an interval across a failed read is never trusted)."""

    kind = "counter"

    def __init__(self, zones: list[tuple[str, str, int]], description: str, clock=time.monotonic):
        self.name = "rapl"
        self.zones = zones  # (zone name, energy_uj path, max_energy_range_uj)
        self.description = description
        self._clock = clock
        self._last: tuple[float, list[int]] | None = None

    def read(self) -> float | None:
        now = self._clock()
        try:
            values = [_read_int(path) for _, path, _ in self.zones]
        except SensorError:
            self._last = None
            raise
        last, self._last = self._last, (now, values)
        if last is None:
            return None
        t0, before = last
        total_uj = 0
        for (_, path, max_range), old, new in zip(self.zones, before, values):
            if new < 0 or new > max_range:
                self._last = None
                raise SensorError(f"{path}: {new} is outside 0..max_energy_range_uj {max_range}")
            total_uj += new - old if new >= old else new + max_range - old  # the counter wrapped once
        joules = total_uj / 1e6
        dt = max(now - t0, 1e-9)
        if joules / dt > MAX_PLAUSIBLE_W:
            self._last = None
            raise SensorError(f"rapl: {joules:.3f} J in {dt:.3f} s is not a plausible energy reading")
        return joules


def _ina3221_sensors(root: str) -> tuple[list[Sensor], str]:
    """Every labelled INA3221 channel under root (both driver layouts), as (rail, files, scale)."""
    out: list[Sensor] = []
    for dev in sorted(glob.glob(os.path.join(root, "bus/i2c/drivers/ina3221x/*/iio:device*"))):
        for f in sorted(glob.glob(os.path.join(dev, "rail_name_*"))):
            i = f.rsplit("_", 1)[1]
            label = _read_label(f)
            power = os.path.join(dev, f"in_power{i}_input")
            if label and os.path.exists(power):
                out.append((label, (power,), 1e-3))  # milliwatts
    hwmons = sorted(glob.glob(os.path.join(root, "bus/i2c/drivers/ina3221/*/hwmon/hwmon*")))
    seen = {os.path.realpath(h) for h in hwmons}
    for h in sorted(glob.glob(os.path.join(root, "class/hwmon/hwmon*"))):
        if os.path.realpath(h) not in seen and _read_label(os.path.join(h, "name")) == "ina3221":
            hwmons.append(h)
    for h in hwmons:
        for f in sorted(glob.glob(os.path.join(h, "in*_label"))):
            m = re.fullmatch(r"in(\d+)_label", os.path.basename(f))
            if not m or not 1 <= int(m.group(1)) <= 3:
                continue  # channels 1-3 are the rails; in7 and curr4 are the driver's sums of them
            label = _read_label(f)
            volts, amps = os.path.join(h, f"in{m.group(1)}_input"), os.path.join(h, f"curr{m.group(1)}_input")
            if label and os.path.exists(volts) and os.path.exists(amps):
                out.append((label, (volts, amps), 1e-6))  # millivolts x milliamperes = microwatts
    return out, "" if out else "no INA3221 rail under bus/i2c/drivers/ina3221x or ina3221"


def _pick(found: list, rails: tuple[str, ...], key, whole) -> tuple[list, str]:
    """The named sensors (all must exist), else `whole(found)`; (chosen, why not) ."""
    if rails:
        missing = [r for r in rails if not any(r in key(s) for s in found)]
        if missing:
            have = sorted({key(s)[0] for s in found})
            return [], f"energy_rails {', '.join(missing)} not found (found: {', '.join(have) or 'none'})"
        return [s for s in found if any(r in key(s) for r in rails)], ""
    return whole(found), ""


def open_ina3221(root: str, rails: tuple[str, ...] = ()) -> tuple[PowerSource | None, str]:
    found, why = _ina3221_sensors(root)
    if not found:
        return None, why

    def whole(sensors):
        inputs = [s for s in sensors if s[0] in INPUT_RAILS]
        return inputs[:1] or sensors

    chosen, why = _pick(found, rails, lambda s: (s[0],), whole)
    if not chosen:
        return None, why
    labels = ", ".join(s[0] for s in chosen)
    extra = "" if rails or chosen[0][0] in INPUT_RAILS else " (no input rail: the sum of every rail)"
    return _checked(PowerSource("ina3221", chosen, f"ina3221: {labels}{extra}"))


def open_rapl(root: str, rails: tuple[str, ...] = (), clock=time.monotonic) -> tuple[CounterSource | None, str]:
    base = os.path.join(root, "class/powercap")
    try:
        dirs = sorted(d for d in os.listdir(base) if _RAPL_DIR_RE.match(d))
    except OSError:
        dirs = []
    if not dirs:
        return None, "no RAPL zone under class/powercap"
    found = []  # (zone name, dir)
    for d in dirs:
        found.append((_read_label(os.path.join(base, d, "name")) or d, d))

    def whole(zones):
        psys = [z for z in zones if z[0].startswith("psys")]
        return psys[:1] or [z for z in zones if z[1].count(":") == 1 or z[0] == "dram"]

    chosen, why = _pick(found, rails, lambda z: (z[0], z[1]), whole)
    if not chosen:
        return None, why
    zones = []
    for name, d in chosen:
        path = os.path.join(base, d, "energy_uj")
        try:
            max_range = _read_int(os.path.join(base, d, "max_energy_range_uj"))
            _read_int(path)
        except SensorError as e:
            if "permission denied" in str(e):
                return None, (f"{path} is not readable (permission denied: Linux lets only root read RAPL "
                              "counters; grant read access to use them)")
            return None, str(e)
        if max_range <= 0:
            return None, f"{os.path.join(base, d, 'max_energy_range_uj')}: {max_range} is not a counter range"
        zones.append((name, path, max_range))
    source = CounterSource(zones, f"rapl: {', '.join(z[0] for z in zones)} (powercap energy counters)", clock)
    source.read()  # the baseline
    return source, ""


def open_hwmon(root: str, rails: tuple[str, ...] = ()) -> tuple[PowerSource | None, str]:
    found = []  # (label, device/powerN, file)
    for h in sorted(glob.glob(os.path.join(root, "class/hwmon/hwmon*"))):
        name = _read_label(os.path.join(h, "name")) or os.path.basename(h)
        if name == "ina3221":
            continue  # its rails are the ina3221 source's
        indices = sorted({m.group(1) for f in os.listdir(h)
                          for m in [re.fullmatch(r"power(\d+)_(input|average)", f)] if m}, key=int)
        for i in indices:
            f = os.path.join(h, f"power{i}_input")
            if not os.path.exists(f):
                f = os.path.join(h, f"power{i}_average")
            label = _read_label(os.path.join(h, f"power{i}_label"))
            found.append((f"{name}/{label or f'power{i}'}", f"{name}/power{i}", name, f))
    if not found:
        return None, "no power sensor under class/hwmon"
    chosen, why = _pick(found, rails, lambda s: s[:3], lambda s: s)
    if not chosen:
        return None, why
    sensors: list[Sensor] = [(s[0], (s[3],), 1e-6) for s in chosen]  # microwatts
    return _checked(PowerSource("hwmon", sensors, f"hwmon: {', '.join(s[0] for s in sensors)}"))


def _checked(source: PowerSource) -> tuple[PowerSource | None, str]:
    """The source if it reads now; else None and why (a permission problem says so)."""
    try:
        source.read()
    except SensorError as e:
        return None, str(e)
    return source, ""


def open_source(kind: str, root: str = "/sys", rails: str | Iterable[str] = "",
                clock=time.monotonic) -> tuple[PowerSource | CounterSource | None, str]:
    """The power source of this kind ('auto': the first of SOURCES found), or (None, why none)."""
    names = _names(rails)
    if kind == "off":
        return None, "energy_source is off"
    kinds = SOURCES if kind == "auto" else (kind,)
    whys = []
    source: PowerSource | CounterSource | None
    for k in kinds:
        if k == "ina3221":
            source, why = open_ina3221(root, names)
        elif k == "rapl":
            source, why = open_rapl(root, names, clock)
        elif k == "hwmon":
            source, why = open_hwmon(root, names)
        else:
            raise ValueError(f"energy_source must be auto, off or one of {SOURCES}, got {kind!r}")
        if source is not None:
            return source, ""
        whys.append(f"{k}: {why}")
    return None, "; ".join(whys)
