"""Thermal zones from Linux sysfs, and a WARN/CRITICAL level with hysteresis.

Why it exists: an edge robot (e.g. a Jetson) that runs an LLM can overheat; the
node must see it, save work when warm and shed load when critical, without
flapping around a threshold.

An unreadable value is unknown, never cool. A zone whose `temp` is missing,
garbage, empty, 'nan', 'inf', out of the plausible range, not a regular file
(a FIFO is refused without being opened) or whose folder was deleted is reported
offline (temperature NaN), and for the level it keeps its last valid reading: the
level can only fall on a valid reading below the threshold minus the hysteresis.
So a sensor that dies at 95 C keeps the node shedding load until that zone reads
cool again (or the node is reconfigured). A machine without any readable zone
reads as OK with `available=False`; the node reports that as "no thermal data".

Reads never block the caller: each scan runs in a short-lived daemon thread and
read() waits at most `read_timeout_s` for it; a scan that hangs in a driver
leaves every zone unknown for that round (and no second scan is started while it
hangs).

sysfs layout read here: <root>/thermal_zone*/type (zone name, e.g. 'gpu-thermal')
and <root>/thermal_zone*/temp (milli-degrees Celsius as an integer).

Which zones: the filter "auto" (the default) watches the chip's own sensors by the names boards give them where
the board has such zones (Jetson JetPack 4/5: CPU-therm, GPU-therm, SOC0-therm, CV0-therm, Tj-therm, AUX-therm,
AO-therm, PLL-therm; JetPack 6: cpu-thermal, gpu-thermal, soc0-thermal, cv0-thermal, tj-thermal; Raspberry Pi:
cpu-thermal), else every zone except placeholders: Jetson's PMIC-Die reads a fixed 100 C on Nano, TX2 and Xavier
(watching it would shed every request) and thermal-fan-est is an estimate made from the other zones.

What the service does with a level is ThermalPolicy: shed load while CRITICAL and act
once on each change (the node only applies it to its request server, engine and log).
"""
from __future__ import annotations

import dataclasses
import enum
import math
import os
import re
import threading
from typing import Iterable, NamedTuple

from ..safe_io import read_regular

# Readings outside this range are sensor placeholders, not temperatures: Jetson
# reports -256000 for powered-down zones (e.g. cv0-thermal on Orin).
_PLAUSIBLE_MIN_C = -60.0
_PLAUSIBLE_MAX_C = 200.0

_ZONE_DIR_RE = re.compile(r"^thermal_zone(\d+)$")

AUTO = "auto"  # the zone filter that picks the chip's own sensors (see the module's docstring)
CHIP_ZONE_RE = re.compile(r"^(cpu|gpu|soc\d?|cv\d|tj|aux|ao|pll)-therm(al)?$", re.IGNORECASE)
PLACEHOLDER_ZONES = frozenset({"pmic-die", "thermal-fan-est"})  # lower case


def auto_zones(zone_types: Iterable[str]) -> set[str]:
    """The zone types "auto" watches among these: the chip's own sensors where there are any, else every
    type but the placeholders."""
    types = set(zone_types)
    chip = {t for t in types if CHIP_ZONE_RE.match(t)}
    return chip or {t for t in types if t.lower() not in PLACEHOLDER_ZONES}


class ThermalLevel(enum.IntEnum):
    OK = 0
    WARN = 1
    CRITICAL = 2


class ZoneReading(NamedTuple):
    name: str
    temp_c: float  # NaN when offline
    online: bool


@dataclasses.dataclass(frozen=True)
class ThermalReading:
    zones: list[ZoneReading]
    hottest_name: str  # the zone that sets the level; "" when no zone was ever read
    hottest_c: float  # its temperature (a held last valid reading when it is unreadable now); NaN when none
    level: ThermalLevel
    available: bool  # False when no zone is readable now
    level_changed: bool  # level differs from the previous read()
    held: tuple[str, ...] = ()  # unreadable zones whose last valid reading still counts for the level
    timed_out: bool = False  # the sysfs scan did not finish within read_timeout_s

    @property
    def level_name(self) -> str:
        """'ok', 'warn' or 'critical'."""
        return self.level.name.lower()


def parse_zone_filter(zone_filter: str | Iterable[str] | None) -> tuple[str, ...]:
    """'cpu-thermal, gpu-thermal' or ['cpu-thermal'] -> ('cpu-thermal', 'gpu-thermal'); empty -> ();
    'auto' -> ('auto',) (auto_zones decides at each scan)."""
    if zone_filter is None:
        return ()
    items = zone_filter.split(",") if isinstance(zone_filter, str) else list(zone_filter)
    out = []
    for item in items:
        name = str(item).strip()
        if name and name not in out:
            out.append(name)
    return tuple(out)


def _read_text(path: str) -> str | None:
    """A small sysfs file's text; None when it is missing, not a regular file (never blocks on a FIFO),
    not ASCII, or too long to be a sysfs value."""
    try:
        return read_regular(path, 4096).decode("ascii", errors="strict")
    except (OSError, ValueError):  # UnicodeDecodeError is a ValueError
        return None


def _parse_temp(text: str | None) -> float:
    """Milli-degrees text -> degrees C, or NaN when missing, garbage or implausible."""
    if text is None:
        return math.nan
    s = text.strip()
    if not re.fullmatch(r"-?\d+", s):
        return math.nan
    c = int(s) / 1000.0
    if not _PLAUSIBLE_MIN_C <= c <= _PLAUSIBLE_MAX_C:
        return math.nan
    return c


def scan_zones(root: str, zone_filter: tuple[str, ...] = ()) -> list[ZoneReading]:
    """Read every thermal_zone* under root (sorted by index), keeping only filtered types if a filter is given.

    A filtered name with no matching zone is listed as offline, so a missing
    sensor shows up instead of silently disappearing.
    """
    return [z for _, z in _scan_keyed(root, zone_filter)]


def _scan_keyed(root: str, zone_filter: tuple[str, ...] = ()) -> list[tuple[str, ZoneReading]]:
    """(stable key, reading) per zone: the key is the zone's folder (or the filter name when missing)."""
    try:
        entries = os.listdir(root)
    except OSError:
        entries = []
    dirs = []
    for e in entries:
        m = _ZONE_DIR_RE.match(e)
        if m and os.path.isdir(os.path.join(root, e)):
            dirs.append((int(m.group(1)), e))
    dirs.sort()

    typed = [((_read_text(os.path.join(root, d, "type")) or "").strip() or d, d) for _, d in dirs]
    auto = zone_filter == (AUTO,)
    if auto:
        keep = auto_zones(t for t, _ in typed)
        typed = [(t, d) for t, d in typed if t in keep]
        zone_filter = ()
    raw = []  # (type name, dir name, temp)
    for zone_type, d in typed:
        if zone_filter and zone_type not in zone_filter and d not in zone_filter:
            continue
        raw.append((zone_type, d, _parse_temp(_read_text(os.path.join(root, d, "temp")))))

    counts: dict[str, int] = {}
    for zone_type, _, _ in raw:
        counts[zone_type] = counts.get(zone_type, 0) + 1
    zones = []
    for zone_type, d, temp in raw:
        name = zone_type if counts[zone_type] == 1 else f"{zone_type}/{d}"
        zones.append((d, ZoneReading(name, temp, not math.isnan(temp))))

    found = {t for t, _, _ in raw} | {d for _, d, _ in raw}
    for wanted in zone_filter:
        if wanted not in found:
            zones.append((wanted, ZoneReading(wanted, math.nan, False)))
    return zones


class ThermalMonitor:
    """Reads the zones and keeps the OK/WARN/CRITICAL level.

    The level goes up as soon as the hottest zone reaches a threshold and comes
    down only once it is below that threshold minus the hysteresis. The hottest
    zone counts every readable zone, and every unreadable one at its last valid
    reading: a reading that fails never lowers the level.
    """

    def __init__(self, root: str = "/sys/class/thermal", zone_filter: str | Iterable[str] | None = None,
                 warn_c: float = 75.0, critical_c: float = 90.0, hysteresis_c: float = 5.0,
                 read_timeout_s: float = 0.5):
        self.root = root
        self.zone_filter = parse_zone_filter(zone_filter)
        self.read_timeout_s = float(read_timeout_s)
        self._lock = threading.Lock()
        self._level = ThermalLevel.OK
        self._held: dict[str, tuple[str, float]] = {}  # zone key -> (name, last valid temperature)
        self._scan_thread: threading.Thread | None = None
        self._check_thresholds(warn_c, critical_c, hysteresis_c)
        self.warn_c, self.critical_c, self.hysteresis_c = float(warn_c), float(critical_c), float(hysteresis_c)

    @staticmethod
    def _check_thresholds(warn_c: float, critical_c: float, hysteresis_c: float) -> None:
        for name, v in (("warn_c", warn_c), ("critical_c", critical_c), ("hysteresis_c", hysteresis_c)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        if critical_c <= warn_c:
            raise ValueError(f"critical_c ({critical_c}) must be above warn_c ({warn_c})")
        if hysteresis_c < 0:
            raise ValueError(f"hysteresis_c must be >= 0, got {hysteresis_c}")

    def set_thresholds(self, warn_c: float | None = None, critical_c: float | None = None,
                       hysteresis_c: float | None = None) -> None:
        """Change thresholds live (None keeps a value); applied from the next read(). Raises ValueError."""
        with self._lock:
            w = self.warn_c if warn_c is None else warn_c
            c = self.critical_c if critical_c is None else critical_c
            h = self.hysteresis_c if hysteresis_c is None else hysteresis_c
            self._check_thresholds(w, c, h)
            self.warn_c, self.critical_c, self.hysteresis_c = float(w), float(c), float(h)

    @property
    def level(self) -> ThermalLevel:
        return self._level

    def _next_level(self, level: ThermalLevel, t: float) -> ThermalLevel:
        thresholds = {ThermalLevel.WARN: self.warn_c, ThermalLevel.CRITICAL: self.critical_c}
        if t >= self.critical_c:
            target = ThermalLevel.CRITICAL
        elif t >= self.warn_c:
            target = ThermalLevel.WARN
        else:
            target = ThermalLevel.OK
        if target > level:
            return target
        while level > ThermalLevel.OK and t < thresholds[level] - self.hysteresis_c:
            level = ThermalLevel(level - 1)
        return level

    def _scan(self) -> list[tuple[str, ZoneReading]] | None:
        """The zones, or None when the scan did not finish within read_timeout_s (or an earlier one hangs)."""
        with self._lock:
            running = self._scan_thread
        if running is not None and running.is_alive():
            return None
        box: dict = {}

        def run():
            try:
                box["zones"] = _scan_keyed(self.root, self.zone_filter)
            except Exception:  # a scan never raises into telemetry; unknown this round
                box["zones"] = None

        t = threading.Thread(target=run, name="simllm-thermal-scan", daemon=True)
        with self._lock:
            self._scan_thread = t
        t.start()
        t.join(self.read_timeout_s)
        return box.get("zones") if not t.is_alive() else None

    def read(self) -> ThermalReading:
        scanned = self._scan()
        with self._lock:
            previous = self._level
            keyed = scanned if scanned is not None else []
            # A zone whose `type` became unreadable keeps the name it had.
            keyed = [(k, z._replace(name=self._held[k][0]) if z.name == k and k in self._held else z) for k, z in keyed]
            seen = {k for k, _ in keyed}
            zones = [z for _, z in keyed]
            # Zones known before that are gone now (folder deleted, or the scan timed out): offline.
            for key, (name, _) in self._held.items():
                if key not in seen:
                    zones.append(ZoneReading(name, math.nan, False))
            candidates, held = [], []
            for key, z in keyed:
                if z.online:
                    self._held[key] = (z.name, z.temp_c)
                    candidates.append((z.temp_c, z.name))
            for key, (name, temp) in self._held.items():
                now = next((z for k, z in keyed if k == key), None)
                if now is None or not now.online:
                    candidates.append((temp, name))
                    held.append(name)
            if candidates:
                temp, name = max(candidates)
                self._level = self._next_level(self._level, temp)
            else:
                name, temp = "", math.nan
            level = self._level
        return ThermalReading(zones=zones, hottest_name=name, hottest_c=temp, level=level,
                              available=any(z.online for z in zones), level_changed=level != previous,
                              held=tuple(held), timed_out=scanned is None)

    def explain(self, reading: ThermalReading) -> str:
        """Why the reading's level is not OK, in words for logs, refusals and diagnostics ("" when OK)."""
        if reading.level == ThermalLevel.OK:
            return ""
        limit = self.critical_c if reading.level == ThermalLevel.CRITICAL else self.warn_c
        held = " (its last valid reading: the sensor is unreadable now)" if reading.hottest_name in reading.held else ""
        return f"hottest zone {reading.hottest_name} at {reading.hottest_c:.1f} C{held} (threshold {limit:.1f} C)"


@dataclasses.dataclass(frozen=True)
class ThermalState:
    """The thermal level the service acts on, and why (empty when OK)."""

    level: ThermalLevel = ThermalLevel.OK
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class ThermalChange:
    """A level change the service acts on: the engine's answer lengths follow it and the log says it."""

    previous: ThermalLevel
    level: ThermalLevel
    reason: str

    @property
    def rising(self) -> bool:
        """Hotter than before: logged as a warning, a fall as info."""
        return self.level > self.previous

    @property
    def message(self) -> str:
        return f"thermal level {self.previous.name} -> {self.level.name}" + (f": {self.reason}" if self.reason else "")


class ThermalPolicy:
    """The service's thermal policy over a ThermalMonitor, one read at a time: requests are refused while the
    level is CRITICAL (`overheated` is the refusal's reason) and every level change is reported once (`read`).

    Why a class of its own: deciding this is not ROS; the node only applies it to its request server, engine
    and logger, and it is tested here against a fake sysfs tree.
    """

    def __init__(self, monitor: ThermalMonitor):
        self.monitor = monitor
        self.state = ThermalState()

    @property
    def overheated(self) -> str | None:
        """Why requests are refused now (the level is CRITICAL), else None."""
        return self.state.reason if self.state.level >= ThermalLevel.CRITICAL else None

    def read(self) -> tuple[ThermalReading, ThermalChange | None]:
        """A reading, and the change to act on when the level differs from the one acted on (or the monitor's)."""
        reading = self.monitor.read()
        previous = self.state.level
        self.state = ThermalState(reading.level, self.monitor.explain(reading))
        if reading.level != previous or reading.level_changed:
            return reading, ThermalChange(previous, reading.level, self.state.reason)
        return reading, None
