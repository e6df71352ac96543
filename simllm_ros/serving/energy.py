"""Energy per answer: a power source sampled on a thread, integrated over each request's time, shared among the
requests in flight; and the per-tier means and savings the node publishes.

Why it exists: on a robot's battery what an answer costs in joules matters as much as how long it takes, and the
cache's worth is partly energy. No figure is better than a wrong one: where there is no sensor, or a sensor fails
or reads garbage during a request, that request's figure is NaN and its source says "none: <why>" (never 0).

How: EnergyMeter samples its source (energy_sensors) every `period_s` on a daemon thread. Between two good samples
power is taken as linear (a power source: the trapezoid of the two readings) or constant (a counter: its joules
over the interval). A request is in flight from `begin` (the engine starts running it) to `end` (its result);
each instant's power is split equally among the requests in flight then, so the figures of overlapping requests
add up to what the computer drew while they ran (the idle draw included: it is what the answers cost the
battery). `end` asks the thread for a sample at once and waits at most `wait_s` for it, so a short answer gets
its figure without waiting a period, and a sensor read that hangs costs a request at most that wait.

EnergyTally keeps the figures by reuse tier over a recent window (CacheStats: mean joules per answer by tier) and
estimates what the cache saved: a hit's estimated miss cost is the recent misses' joules per token (prompt and
generated tokens) times its own tokens, and its saving is that estimate minus what it drew.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import threading
import time
import weakref

from ..request import CacheResult, QueryResult
from .energy_sensors import CounterSource, PowerSource, SensorError, open_source

WAIT_S = 0.25  # end() waits at most this for the sample that closes a request


@dataclasses.dataclass(frozen=True)
class EnergyFigure:
    """One answer's energy: joules, or NaN with source "none: <why>"."""

    joules: float
    source: str


@dataclasses.dataclass
class _Span:
    begin: float
    end: float | None = None
    joules: float = 0.0
    invalid: str = ""  # why the figure is unknown ("" while it is good)
    done: bool = False
    discarded: bool = False  # its owner was collected without end(): dropped once its last interval is shared


@dataclasses.dataclass
class _Sample:
    t: float
    power_w: float | None  # a power source's reading, or a counter's mean power since the previous sample
    why: str = ""  # why the sample (and the intervals on either side) cannot be used


class EnergyMeter:
    """Samples a power source and attributes its energy to requests (see the module's docstring).

    `source` None: no figures ("none: " + why_none). The thread runs between start() and stop(); without it
    end() samples in the caller's thread (the tests drive samples one by one with their own clock)."""

    def __init__(self, source: PowerSource | CounterSource | None, why_none: str = "", period_s: float = 0.1,
                 clock=time.monotonic, wait_s: float = WAIT_S):
        self.source = source
        self.why_none = why_none or "no power source"
        self.period_s = float(period_s)
        self.wait_s = float(wait_s)
        self._clock = clock
        self._cv = threading.Condition()
        self._spans: dict[int, _Span] = {}
        self._next_token = 0
        self._last: _Sample | None = None
        self._first_t: float | None = None
        self._wake = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._reading_since: float | None = None  # when the sample being read began (a hung read shows here)
        self.failing_since: float | None = None  # the sensor's first failed read of the current failure
        self.last_error = ""
        self.failed_answers = 0  # answers left without a figure because the sensor failed

    @classmethod
    def open(cls, kind: str, root: str = "/sys", rails: str = "", period_s: float = 0.1) -> "EnergyMeter":
        source, why = open_source(kind, root, rails)
        return cls(source, why, period_s)

    @property
    def description(self) -> str:
        """The source in words, or "none: <why>"."""
        return self.source.description if self.source is not None else f"none: {self.why_none}"

    # ---- the sampler -------------------------------------------------------------------------
    def start(self) -> None:
        if self.source is None or self._thread is not None:
            return
        self._stopping = False
        self.sample()
        self._thread = threading.Thread(target=self._loop, name="simllm-energy", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        thread, self._thread = self._thread, None
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if thread is not None:
            thread.join(timeout=1.0)

    def _loop(self) -> None:
        while True:
            with self._cv:
                if not self._wake and not self._stopping:
                    self._cv.wait(self.period_s)
                if self._stopping:
                    return
                self._wake = False
            self.sample()

    def sample(self) -> None:
        """Read the source once and attribute the interval since the previous sample."""
        source = self.source
        if source is None:
            return
        t0 = self._clock()
        with self._cv:
            self._reading_since = t0
        why, value = "", None
        try:
            value = source.read()
        except SensorError as e:
            why = str(e)
        except Exception as e:  # a sensor never raises into serving
            why = f"{type(e).__name__}: {e}"
        t = self._clock()
        with self._cv:
            self._reading_since = None
            last = self._last
            if why:
                s = _Sample(t, None, why)
            elif value is None:  # only a counter reads nothing (a power sensor raises instead)
                s = _Sample(t, None, "the counter's first reading after a failure")
            elif source.kind == "counter":
                dt = t - last.t if last is not None else 0.0
                s = _Sample(t, value / dt if dt > 0 else None, "" if dt > 0 else "no interval")
            else:
                s = _Sample(t, float(value))
            if why:
                if self.failing_since is None:
                    self.failing_since = t
                self.last_error = why
            else:
                self.failing_since = None
            if last is not None:
                self._attribute(source, last, s)
            if self._first_t is None:
                self._first_t = t
            self._last = s
            self._cv.notify_all()

    def _attribute(self, source: PowerSource | CounterSource, a: _Sample, b: _Sample) -> None:
        """Share the energy of [a.t, b.t] among the spans in flight in it (called under the lock)."""
        counter = source.kind == "counter"
        bad = b.why or ("" if counter else a.why)
        if not bad and (b.power_w is None or (not counter and a.power_w is None)):
            bad = "no reading"
        p0, p1 = (b.power_w, b.power_w) if counter else (a.power_w, b.power_w)
        spans = [s for s in self._spans.values() if s.begin < b.t and (s.end is None or s.end > a.t)]
        cuts = sorted({a.t, b.t} | {s.begin for s in spans if a.t < s.begin < b.t} |
                      {s.end for s in spans if s.end is not None and a.t < s.end < b.t})
        if spans and bad:
            for s in spans:
                s.invalid = s.invalid or f"{source.name} sensor failed during the request ({bad})"
        elif spans:
            span_t = b.t - a.t

            def power(x):
                return p0 + (p1 - p0) * (x - a.t) / span_t

            for lo, hi in zip(cuts, cuts[1:]):
                inside = [s for s in spans if s.begin <= lo and (s.end is None or s.end >= hi)]
                if inside:
                    share = (power(lo) + power(hi)) / 2 * (hi - lo) / len(inside)
                    for s in inside:
                        s.joules += share
        for token, s in list(self._spans.items()):
            if s.end is not None and s.end <= b.t:
                s.done = True
                if s.discarded:
                    del self._spans[token]

    # ---- requests -------------------------------------------------------------------------------
    def begin(self, owner=None) -> int | None:
        """A request starts; returns its token (None without a source). With an owner, the span ends by itself
        when the owner is collected without end() (a request lost to a fault never dilutes the others)."""
        if self.source is None:
            return None
        with self._cv:
            token = self._next_token
            self._next_token += 1
            self._spans[token] = _Span(self._clock())
        if owner is not None:
            weakref.finalize(owner, self._discard, token)
        return token

    def _discard(self, token: int) -> None:
        with self._cv:
            span = self._spans.get(token)
            if span is not None and span.end is None:
                span.end, span.discarded = self._clock(), True

    def end(self, token: int | None) -> EnergyFigure:
        """The request's result is known: its energy (NaN and "none: <why>" where it cannot be known)."""
        if self.source is None:
            return EnergyFigure(math.nan, f"none: {self.why_none}")
        if token is None:
            return EnergyFigure(math.nan, "none: the request was not measured")
        with self._cv:
            span = self._spans.get(token)
            if span is None:
                return EnergyFigure(math.nan, "none: the request's energy span was lost")
            span.end = self._clock()
        if self._thread is None:
            self.sample()
        with self._cv:
            self._wake = True
            self._cv.notify_all()
            deadline = time.monotonic() + self.wait_s
            while not span.done:
                hung = self._reading_since is not None and self._clock() - self._reading_since > self.wait_s
                left = deadline - time.monotonic()
                if hung or left <= 0 or self._thread is None:
                    break
                self._cv.wait(left)
            del self._spans[token]
            if span.begin < (self._first_t if self._first_t is not None else math.inf) and not span.invalid:
                span.invalid = "the request began before the first power sample"
            if not span.done:
                span.invalid = span.invalid or f"the {self.source.name} sensor read took longer than {self.wait_s} s"
            if span.invalid:
                self.failed_answers += 1
                return EnergyFigure(math.nan, f"none: {span.invalid}")
        return EnergyFigure(span.joules, self.source.description)

    def status(self) -> tuple[tuple[str, str], ...]:
        """/diagnostics key-values: the source, and the sensor's failure while it lasts."""
        out = [("energy_source", self.description)]
        if self.source is not None:
            with self._cv:
                since, err, failed = self.failing_since, self.last_error, self.failed_answers
                hung = self._reading_since is not None and self._clock() - self._reading_since > self.wait_s
            if hung:
                out.append(("energy_error", f"the {self.source.name} sensor read has hung for "
                                            f"{self._clock() - self._reading_since:.1f} s"))
            elif since is not None:
                out.append(("energy_error", f"{err} (failing for {self._clock() - since:.1f} s)"))
            out.append(("energy_answers_without_figure", str(failed)))
        return tuple(out)

    @property
    def error(self) -> str:
        """Why the sensor is failing now ("" when it reads, or when there is none)."""
        return dict(self.status()).get("energy_error", "")


ENERGY_TIERS = (("miss", CacheResult.MISS), ("exact", CacheResult.EXACT_PREFIX),
                ("semantic", CacheResult.SEMANTIC), ("answer", CacheResult.ANSWER))


class EnergyTally:
    """Answers' energy by tier over the last `window` answers with a figure, and the cache's savings since start."""

    def __init__(self, window: int = 100):
        self._lock = threading.Lock()
        self._recent: collections.deque[tuple[CacheResult, float]] = collections.deque(maxlen=window)
        self._misses: collections.deque[tuple[float, int]] = collections.deque(maxlen=window)  # (J, tokens)
        self._saved = {t: 0.0 for _, t in ENERGY_TIERS[1:]}
        self._estimated = {t: 0 for _, t in ENERGY_TIERS[1:]}

    @staticmethod
    def _tokens(r: QueryResult) -> int:
        return int(r.prompt_tokens) + int(r.generated_tokens)

    def record(self, result: QueryResult) -> None:
        """A successful answer; one without a figure (NaN) is not counted."""
        if not result.success or not math.isfinite(result.energy_j):
            return
        tier = CacheResult(result.cache_result)
        with self._lock:
            self._recent.append((tier, float(result.energy_j)))
            if tier == CacheResult.MISS:
                self._misses.append((float(result.energy_j), self._tokens(result)))
                return
            tokens = sum(n for _, n in self._misses)
            if tokens > 0:
                per_token = sum(j for j, _ in self._misses) / tokens
                self._saved[tier] += per_token * self._tokens(result) - float(result.energy_j)
                self._estimated[tier] += 1

    def snapshot(self, source: str) -> dict:
        """CacheStats' energy fields: NaN means where no answer of the tier has a figure in the window."""
        with self._lock:
            recent = list(self._recent)
            saved, estimated = dict(self._saved), dict(self._estimated)
        out: dict = {"energy_source": source}
        for name, tier in ENERGY_TIERS:
            vals = [j for t, j in recent if t == tier]
            out[f"energy_mean_j_{name}"] = sum(vals) / len(vals) if vals else math.nan
        for name, tier in ENERGY_TIERS[1:]:
            out[f"energy_saved_j_{name}"] = saved[tier]
            out[f"energy_saved_answers_{name}"] = estimated[tier]
        return out
