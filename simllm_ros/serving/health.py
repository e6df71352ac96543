"""The service's health, from its statistics and thermal state: OK, WARN or ERROR with the reasons.

Why it exists: an operator watching /diagnostics needs one level and a sentence that says what to
do; deciding it is policy, not ROS, so it is a pure function here and the node only publishes it.
Error and busy counts are judged over a recent window (RateWindow), never since start, so a node
recovers its OK once a burst is over. ServiceHealth is what the node publishes each telemetry tick:
assess's level and values plus the model and the kernels it computes with (BackendFacts).
"""
from __future__ import annotations

import collections
import dataclasses
import enum
import math
import socket

from ..kernels.build import CONTRACT as NUMERICS_CONTRACT
from .thermal import ThermalLevel, ThermalReading, ThermalState

WINDOW_S = 30.0  # errors and busy refusals are counted over this window
ERROR_SHARE_FOR_ERROR = 0.5  # this share of recent requests failing ...
MIN_ERRORS_FOR_ERROR = 3  # ... and at least this many of them: ERROR
MIN_LABELS_FOR_WARN = 20  # approximate answers checked before their observed rate can raise a WARN
MAX_APPROX_VALUES = 8  # tier/scope groups shown on /diagnostics
ERROR_SHARE_FOR_WARN = 0.1  # more than this share failing ...
MIN_ERRORS_FOR_WARN = 2  # ... and at least this many (one bad request is noise): WARN
BUDGET_SHARE_FOR_WARN = 0.98  # KV pool bytes above this share of the budget: WARN

# CacheStats fields shown as key-values, in this order.
REPORTED_STATS = (
    "entries", "bytes_used", "bytes_budget", "budget_use", "hit_rate_exact_recent",
    "hit_rate_semantic_recent", "hit_rate_answer_recent", "hit_rate_any_recent", "hit_rate_any_total",
    "requests_total", "errors_total", "rejected_busy_total", "queue_depth", "evictions_total",
    "ttft_hit_mean_ms", "ttft_hit_p95_ms", "ttft_miss_mean_ms", "ttft_miss_p95_ms")


# CacheStats energy figures shown as key-values (energy_source comes from the meter itself).
ENERGY_STATS = ("energy_mean_j_miss", "energy_mean_j_exact", "energy_mean_j_semantic", "energy_mean_j_answer",
                "energy_saved_j_exact", "energy_saved_j_semantic", "energy_saved_j_answer")


class HealthLevel(enum.IntEnum):
    """The same numbers as diagnostic_msgs/DiagnosticStatus OK, WARN, ERROR."""

    OK = 0
    WARN = 1
    ERROR = 2


@dataclasses.dataclass(frozen=True)
class RecentCounts:
    """Requests answered, failed and refused as busy within the window."""

    requests: int
    errors: int
    busy: int


@dataclasses.dataclass(frozen=True)
class Health:
    level: HealthLevel
    message: str
    values: tuple[tuple[str, str], ...]
    hardware_id: str = ""  # the robot or computer (ServiceHealth: the hardware_id parameter, else the host name)


@dataclasses.dataclass(frozen=True)
class BackendFacts:
    """What the loaded model computes with, as /diagnostics shows it: an operator comparing two robots sees
    what dtype / weight_bits "auto" chose, the numerics digest and kernel contract (one digest, the same bits),
    and which kernels run the passes (the fast path or not). Empty kinds are not shown."""

    precision: str  # "bfloat16, 4-bit weights"
    numerics: str  # "<digest> (<kernel contract>)"
    attention: str  # kernel, torch or transformers
    attention_arithmetic: str = ""  # amx tiles or vector code
    int4_products: str = ""  # amx, vector or aten
    layers: str = ""  # a pass's layers in one C call (c) or from Python
    lossless: bool | None = None  # the load-time batch-invariance probe passed (assess's `lossless`)

    @classmethod
    def of(cls, backend) -> "BackendFacts | None":
        """The facts of a ModelBackend (None: no model loaded)."""
        if backend is None:
            return None
        return cls(precision=f"{backend.dtype_name}, {backend.weight_bits}-bit weights",
                   numerics=f"{getattr(backend, 'numerics', '')} ({NUMERICS_CONTRACT})",
                   attention=backend.attention_kind, attention_arithmetic=backend.attention_arithmetic,
                   int4_products=backend.int4_kind, layers=backend.layers_kind, lossless=backend.exact_chunking)

    def values(self) -> tuple[tuple[str, str], ...]:
        shown = (("precision", self.precision), ("numerics", self.numerics), ("attention", self.attention))
        kinds = (("attention_arithmetic", self.attention_arithmetic), ("int4_products", self.int4_products),
                 ("layers", self.layers))
        return shown + tuple((k, v) for k, v in kinds if v)


class RateWindow:
    """Running totals sampled over time; `update` returns what changed within the last window_s."""

    def __init__(self, window_s: float = WINDOW_S):
        self.window_s = window_s
        self._samples: collections.deque[tuple[float, int, int, int]] = collections.deque()

    def clear(self) -> None:
        self._samples.clear()

    def update(self, now: float, stats: dict) -> RecentCounts:
        self._samples.append((now, int(stats.get("requests_total", 0)), int(stats.get("errors_total", 0)),
                              int(stats.get("rejected_busy_total", 0))))
        while len(self._samples) > 1 and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()
        _, r0, e0, b0 = self._samples[0]
        _, r1, e1, b1 = self._samples[-1]
        return RecentCounts(r1 - r0, e1 - e0, b1 - b0)


def assess(stats: dict | None, thermal: ThermalState, recent: RecentCounts | None, *, ttft_warn_ms: float,
           queue_limit: int, window_s: float = WINDOW_S, state: str = "",
           reading: ThermalReading | None = None, no_data_level: HealthLevel = HealthLevel.WARN,
           lossless: bool | None = None, fleet: dict | None = None, approx: dict | None = None,
           approx_bound: float = 1.0, energy: tuple[tuple[str, str], ...] = ()) -> Health:
    """Level and message from the statistics (None: unavailable), thermal state and recent counts.
    A reading with no readable zone (no sensors, or all failing) adds "no thermal data" at no_data_level
    (the thermal_no_data_level parameter): unknown is never reported as fine. `lossless`: whether the
    model's load-time batch-invariance probe passed on this machine (None: no model loaded); where it
    failed, reuse is approximate-only and lossless callers get misses, which is a WARN, not a silent
    slowdown (measured: a CPU with AMX failed it until oneDNN was capped below AMX). `fleet`: the fleet
    store's status (FleetStore.status), None when there is none; unreachable is a WARN (requests go on
    without it, each waiting on it at most fleet_timeout_ms). `approx`: ErrorBound.summary() per tier and scope;
    a group whose served approximate answers differ from the model's own more often than approx_bound (the
    lower end of the 95% interval above it) is a WARN (the bound then keeps the tier back on its own). `energy`: the
    energy meter's key-values (EnergyMeter.status); a sensor that fails now (energy_error) is a WARN: answers get
    no energy figure meanwhile. No sensor at all is only a value (energy_source "none: <why>")."""
    level, reasons = _judge(stats, thermal, recent, ttft_warn_ms, queue_limit, window_s)
    if lossless is False:
        level = max(level, HealthLevel.WARN)
        reasons.append("batch-invariance probe failed on this machine: no lossless reuse (exact-prefix hits and "
                       "drafts only for callers that allow approximation)")
    if reading is not None and not reading.available:
        why = ("the sensor read timed out" if reading.timed_out else
               f"{len(reading.zones)} zone(s) found, none readable" if reading.zones else "no thermal zones found")
        level = max(level, no_data_level)
        reasons.append(f"no thermal data ({why})")
    if fleet is not None and fleet.get("fleet_store") != "connected":
        level = max(level, HealthLevel.WARN)
        reasons.append(f"fleet store unreachable ({fleet.get('fleet_last_error', '')}): serving without it")
    if fleet is not None and fleet.get("fleet_thread_warning"):
        level = max(level, HealthLevel.WARN)
        reasons.append(str(fleet["fleet_thread_warning"]))
    for group, g in (approx or {}).items():
        if g["served"] and g["labels"] >= MIN_LABELS_FOR_WARN and g["low"] > approx_bound:
            level = max(level, HealthLevel.WARN)
            reasons.append(f"approximate answers ({group}) differ from the model's own in {100 * g['observed']:.0f}% "
                           f"of checks, above approx_error_bound {approx_bound:g}: the tier holds back")
    energy_values = dict(energy)
    if energy_values.get("energy_error"):
        level = max(level, HealthLevel.WARN)
        reasons.append(f"energy sensor failing, answers have no energy figure: {energy_values['energy_error']}")
    values = _values(stats, thermal, queue_limit, state, reading)
    values += tuple(energy_values.items())
    for k in ENERGY_STATS:
        if stats is not None and k in stats:
            v = float(stats[k])
            values += ((k, "nan" if math.isnan(v) else f"{v:.4g}"),)
    for group, g in list((approx or {}).items())[:MAX_APPROX_VALUES]:
        values += ((f"approx[{group}]", f"served {g['served']}, checked {g['labels']}, differ {g['observed']:.3f} "
                                        f"[{g['low']:.3f}, {g['high']:.3f}]"),)
    if lossless is not None:
        values += (("lossless_reuse", "true" if lossless else "false"),)
    if fleet is not None:
        values += tuple((k, str(v)) for k, v in fleet.items())
    return Health(level, "; ".join(reasons) if reasons else "ok", values)


def _judge(stats, thermal, recent, ttft_warn_ms, queue_limit, window_s) -> tuple[HealthLevel, list[str]]:
    level, reasons = HealthLevel.OK, []

    def add(lvl: HealthLevel, reason: str) -> None:
        nonlocal level
        level = max(level, lvl)
        reasons.append(reason)

    if thermal.level == ThermalLevel.CRITICAL:
        add(HealthLevel.ERROR, f"overheated, shedding load: {thermal.reason}")
    elif thermal.level == ThermalLevel.WARN:
        add(HealthLevel.WARN, f"running hot, shorter answers: {thermal.reason}")
    if stats is None:
        add(HealthLevel.ERROR, "cache statistics unavailable")
        return level, reasons
    budget_use = float(stats.get("budget_use", 0.0))
    if budget_use > BUDGET_SHARE_FOR_WARN:
        add(HealthLevel.WARN, f"KV pool nearly full ({100 * budget_use:.0f}% of budget)")
    if recent is not None:
        if recent.errors > 0 and recent.requests > 0:
            share = recent.errors / recent.requests
            failed = f"{recent.errors} of {recent.requests} requests failed in the last {window_s:.0f} s"
            if share >= ERROR_SHARE_FOR_ERROR and recent.errors >= MIN_ERRORS_FOR_ERROR:
                add(HealthLevel.ERROR, failed)
            elif share > ERROR_SHARE_FOR_WARN and recent.errors >= MIN_ERRORS_FOR_WARN:
                add(HealthLevel.WARN, failed)
        if recent.busy > 0:
            add(HealthLevel.WARN, f"{recent.busy} requests refused as busy in the last {window_s:.0f} s "
                                  f"(queue_limit {queue_limit})")
    p95 = max(float(stats.get("ttft_hit_p95_ms", 0.0)), float(stats.get("ttft_miss_p95_ms", 0.0)))
    if p95 > ttft_warn_ms:
        add(HealthLevel.WARN, f"p95 time to first token {p95:.0f} ms above ttft_warn_ms {ttft_warn_ms:.0f} ms")
    return level, reasons


def _values(stats, thermal, queue_limit, state, reading) -> tuple[tuple[str, str], ...]:
    kv: list[tuple[str, object]] = [("state", state)]
    if stats is not None:
        kv += [(k, stats.get(k, 0)) for k in REPORTED_STATS]
    kv.append(("queue_limit", queue_limit))
    kv.append(("thermal_level", thermal.level.name))
    if reading is not None:
        kv.append(("hottest_zone", reading.hottest_name))
        kv.append(("hottest_c", "nan" if math.isnan(reading.hottest_c) else f"{reading.hottest_c:.1f}"))
    return tuple((k, f"{v:.4g}" if isinstance(v, float) else str(v)) for k, v in kv)


class ServiceHealth:
    """The node's /diagnostics content, one telemetry tick at a time: keeps the recent window, reads the
    thresholds from the settings and adds the model's key-values to assess's. Why here: the node only turns
    the Health into a DiagnosticStatus."""

    def __init__(self, window_s: float = WINDOW_S):
        self.window = RateWindow(window_s)

    def clear(self) -> None:
        """Forget the recent counts (a new activation starts its window afresh)."""
        self.window.clear()

    def report(self, now: float, stats: dict | None, thermal: ThermalState, reading: ThermalReading | None,
               settings, backend: BackendFacts | None, *, queue_limit: int, state: str,
               fleet: dict | None = None, approx: dict | None = None,
               energy: tuple[tuple[str, str], ...] = ()) -> Health:
        """Health from this tick's statistics (None: unavailable) and thermal state; `settings` gives
        ttft_warn_ms, thermal_no_data_level, model and hardware_id."""
        recent = self.window.update(now, stats) if stats is not None else None
        h = assess(stats, thermal, recent, ttft_warn_ms=settings.ttft_warn_ms, queue_limit=queue_limit,
                   window_s=self.window.window_s, state=state, reading=reading,
                   no_data_level=HealthLevel.ERROR if settings.thermal_no_data_level == "error" else HealthLevel.WARN,
                   lossless=backend.lossless if backend is not None else None, fleet=fleet, approx=approx,
                   approx_bound=settings.approx_error_bound, energy=energy)
        values = h.values + (("model", str(settings.model)),) + (backend.values() if backend is not None else ())
        return Health(h.level, h.message, values, settings.hardware_id or socket.gethostname())
