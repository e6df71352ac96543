"""Aggregates per-request results into the numbers published on cache_stats.

Why it exists: operators tune thresholds and cache size by watching hit rates
and time-to-first-token in rqt_plot; those must be cheap to compute, safe to
read from the telemetry timer while requests finish on other threads, and
always finite (0.0 for "no data yet", never NaN, which rqt_plot cannot graph).

Counting rules: only successful results count toward hit rates and TTFT (a hit
is any cache_result other than MISS); failed results count in errors_total;
requests refused because the queue is full count in rejected_busy_total.
requests_total counts answered requests (hits + misses), as CacheStats.msg says. "recent" figures are over the last
`window` successful results; window_size is how many results that window holds now.
"""
from __future__ import annotations

import collections
import math
import threading

import numpy as np

from simllm_ros.request import CacheResult, QueryResult

STATS_FIELDS = (
    "entries", "blocks_used", "bytes_used", "bytes_budget", "budget_use",
    "hit_rate_exact_recent", "hit_rate_semantic_recent", "hit_rate_answer_recent", "hit_rate_any_recent",
    "hit_rate_exact_total", "hit_rate_semantic_total", "hit_rate_answer_total", "hit_rate_any_total",
    "window_size", "requests_total", "misses_total",
    "ttft_hit_mean_ms", "ttft_hit_p95_ms", "ttft_miss_mean_ms", "ttft_miss_p95_ms",
    "evictions_total", "bytes_saved_quantization", "queue_depth", "rejected_busy_total", "errors_total",
    "draft_acceptance_recent", "draft_tokens_proposed_total", "draft_tokens_accepted_total",
    "decode_passes_saved_total", "approximate_total",
)


def _rate(n: int, d: int) -> float:
    return float(n) / d if d else 0.0


def _mean_p95(values: list[float]) -> tuple[float, float]:
    vals = [v for v in values if math.isfinite(v)]
    if not vals:
        return 0.0, 0.0
    a = np.asarray(vals, dtype=np.float64)
    return float(a.mean()), float(np.percentile(a, 95))


class CacheStatsRecorder:
    def __init__(self, window: int = 100):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self._lock = threading.Lock()
        self._recent: collections.deque[tuple[CacheResult, float]] = collections.deque(maxlen=window)
        self._recent_drafts: collections.deque[tuple[int, int]] = collections.deque(maxlen=window)
        self._drafts = [0, 0]  # proposed, accepted
        self._passes_saved = 0
        self._approximate = 0
        self._tier_totals = {t: 0 for t in CacheResult}
        self._rejected_busy = 0
        self._errors = 0

    def record(self, result: QueryResult) -> None:
        with self._lock:
            if not result.success:
                self._errors += 1
                return
            tier = CacheResult(result.cache_result)
            self._tier_totals[tier] += 1
            self._recent.append((tier, float(result.ttft_ms)))
            proposed, accepted = int(result.draft_tokens_proposed), int(result.draft_tokens_accepted)
            self._recent_drafts.append((proposed, accepted))
            self._drafts[0] += proposed
            self._drafts[1] += accepted
            self._passes_saved += int(result.decode_passes_saved)
            self._approximate += not result.exact

    def record_rejected_busy(self) -> None:
        with self._lock:
            self._rejected_busy += 1

    def record_error(self) -> None:
        with self._lock:
            self._errors += 1

    def snapshot(self, pool_bytes_used: int, pool_bytes_budget: int, entries: int, blocks_used: int,
                 evictions_total: int, bytes_saved_quantization: int, queue_depth: int) -> dict:
        """All CacheStats.msg fields as a dict (ints for counts, floats for rates and times)."""
        with self._lock:
            recent = list(self._recent)
            totals = dict(self._tier_totals)
            rejected, errors = self._rejected_busy, self._errors
            recent_prop = sum(p for p, _ in self._recent_drafts)
            recent_acc = sum(a for _, a in self._recent_drafts)
            drafts, saved, approx = list(self._drafts), self._passes_saved, self._approximate
        n_recent = len(recent)
        recent_counts = collections.Counter(t for t, _ in recent)
        n_total = sum(totals.values())
        hit_ttft = [ms for t, ms in recent if t != CacheResult.MISS]
        miss_ttft = [ms for t, ms in recent if t == CacheResult.MISS]
        hit_mean, hit_p95 = _mean_p95(hit_ttft)
        miss_mean, miss_p95 = _mean_p95(miss_ttft)
        budget = int(pool_bytes_budget)
        used = int(pool_bytes_used)
        snap = {
            "entries": int(entries),
            "blocks_used": int(blocks_used),
            "bytes_used": used,
            "bytes_budget": budget,
            "budget_use": _rate(used, budget) if budget > 0 else 0.0,
            "hit_rate_exact_recent": _rate(recent_counts[CacheResult.EXACT_PREFIX], n_recent),
            "hit_rate_semantic_recent": _rate(recent_counts[CacheResult.SEMANTIC], n_recent),
            "hit_rate_answer_recent": _rate(recent_counts[CacheResult.ANSWER], n_recent),
            "hit_rate_any_recent": _rate(n_recent - recent_counts[CacheResult.MISS], n_recent),
            "hit_rate_exact_total": _rate(totals[CacheResult.EXACT_PREFIX], n_total),
            "hit_rate_semantic_total": _rate(totals[CacheResult.SEMANTIC], n_total),
            "hit_rate_answer_total": _rate(totals[CacheResult.ANSWER], n_total),
            "hit_rate_any_total": _rate(n_total - totals[CacheResult.MISS], n_total),
            "window_size": n_recent,
            "requests_total": n_total,
            "misses_total": totals[CacheResult.MISS],
            "ttft_hit_mean_ms": hit_mean,
            "ttft_hit_p95_ms": hit_p95,
            "ttft_miss_mean_ms": miss_mean,
            "ttft_miss_p95_ms": miss_p95,
            "evictions_total": int(evictions_total),
            "bytes_saved_quantization": int(bytes_saved_quantization),
            "queue_depth": int(queue_depth),
            "rejected_busy_total": rejected,
            "errors_total": errors,
            "draft_acceptance_recent": _rate(recent_acc, recent_prop),
            "draft_tokens_proposed_total": drafts[0],
            "draft_tokens_accepted_total": drafts[1],
            "decode_passes_saved_total": saved,
            "approximate_total": approx,
        }
        assert tuple(snap) == STATS_FIELDS
        return snap
