"""CacheStatsRecorder with real QueryResult objects."""
import math
import threading

import numpy as np
import pytest

from simllm_ros.cache.cache_stats import STATS_FIELDS, CacheStatsRecorder
from simllm_ros.request import CacheResult, QueryResult

POOL = dict(pool_bytes_used=0, pool_bytes_budget=0, entries=0, blocks_used=0, evictions_total=0,
            bytes_saved_quantization=0, queue_depth=0)

EXPECTED_KEYS = [
    "entries", "blocks_used", "bytes_used", "bytes_budget", "budget_use", "hit_rate_exact_recent",
    "hit_rate_semantic_recent", "hit_rate_answer_recent", "hit_rate_any_recent", "hit_rate_exact_total",
    "hit_rate_semantic_total", "hit_rate_answer_total", "hit_rate_any_total", "window_size", "requests_total",
    "misses_total", "ttft_hit_mean_ms", "ttft_hit_p95_ms", "ttft_miss_mean_ms", "ttft_miss_p95_ms",
    "evictions_total", "bytes_saved_quantization", "queue_depth", "rejected_busy_total", "errors_total",
    "draft_acceptance_recent", "draft_tokens_proposed_total", "draft_tokens_accepted_total",
    "decode_passes_saved_total", "approximate_total",
]


def ok(tier, ttft):
    return QueryResult(success=True, answer="x", cache_result=tier, ttft_ms=ttft, total_ms=ttft + 10)


def test_empty_snapshot_is_all_zero_and_finite():
    s = CacheStatsRecorder().snapshot(**POOL)
    assert list(s) == EXPECTED_KEYS and tuple(s) == STATS_FIELDS
    for k, v in s.items():
        assert isinstance(v, (int, float)) and math.isfinite(v) and v == 0, k


def test_pool_figures_passed_through():
    s = CacheStatsRecorder().snapshot(pool_bytes_used=250, pool_bytes_budget=1000, entries=7, blocks_used=12,
                                      evictions_total=3, bytes_saved_quantization=4096, queue_depth=2)
    assert (s["bytes_used"], s["bytes_budget"], s["entries"], s["blocks_used"]) == (250, 1000, 7, 12)
    assert s["budget_use"] == pytest.approx(0.25)
    assert (s["evictions_total"], s["bytes_saved_quantization"], s["queue_depth"]) == (3, 4096, 2)


def test_hit_rates_and_ttft():
    rec = CacheStatsRecorder(window=100)
    tiers = [CacheResult.MISS] * 4 + [CacheResult.EXACT_PREFIX] * 3 + [CacheResult.SEMANTIC] * 2 + [CacheResult.ANSWER]
    ttfts = [200.0, 210.0, 190.0, 400.0, 20.0, 25.0, 30.0, 60.0, 70.0, 1.0]
    for t, ms in zip(tiers, ttfts):
        rec.record(ok(t, ms))
    s = rec.snapshot(**POOL)
    assert s["hit_rate_exact_recent"] == pytest.approx(0.3)
    assert s["hit_rate_semantic_recent"] == pytest.approx(0.2)
    assert s["hit_rate_answer_recent"] == pytest.approx(0.1)
    assert s["hit_rate_any_recent"] == pytest.approx(0.6)
    assert s["hit_rate_any_total"] == pytest.approx(0.6)
    assert s["misses_total"] == 4 and s["requests_total"] == 10 and s["window_size"] == 10
    hits = [20.0, 25.0, 30.0, 60.0, 70.0, 1.0]
    misses = [200.0, 210.0, 190.0, 400.0]
    assert s["ttft_hit_mean_ms"] == pytest.approx(np.mean(hits))
    assert s["ttft_hit_p95_ms"] == pytest.approx(np.percentile(hits, 95))
    assert s["ttft_miss_mean_ms"] == pytest.approx(250.0)
    assert s["ttft_miss_p95_ms"] == pytest.approx(np.percentile(misses, 95))
    assert s["ttft_miss_p95_ms"] > 350


def test_failures_count_as_errors_not_misses():
    rec = CacheStatsRecorder()
    rec.record(ok(CacheResult.EXACT_PREFIX, 10.0))
    rec.record(QueryResult.failure("prompt is empty", request_id="r1"))
    rec.record(QueryResult(success=False, error="model failed", cache_result=CacheResult.SEMANTIC, ttft_ms=999.0))
    rec.record_error()
    rec.record_rejected_busy()
    rec.record_rejected_busy()
    s = rec.snapshot(**POOL)
    assert s["errors_total"] == 3 and s["rejected_busy_total"] == 2
    assert s["hit_rate_any_total"] == 1.0 and s["hit_rate_semantic_total"] == 0.0
    assert s["misses_total"] == 0 and s["window_size"] == 1
    assert s["ttft_hit_mean_ms"] == 10.0  # the failed SEMANTIC's 999 ms is not counted
    assert s["requests_total"] == 1  # answered requests only (CacheStats.msg: hits + misses)


def test_recent_window_slides_totals_do_not():
    rec = CacheStatsRecorder(window=5)
    for _ in range(5):
        rec.record(ok(CacheResult.MISS, 300.0))
    for _ in range(5):
        rec.record(ok(CacheResult.SEMANTIC, 40.0))
    s = rec.snapshot(**POOL)
    assert s["window_size"] == 5
    assert s["hit_rate_semantic_recent"] == 1.0 and s["hit_rate_any_recent"] == 1.0
    assert s["hit_rate_semantic_total"] == 0.5 and s["hit_rate_any_total"] == 0.5
    assert s["ttft_miss_mean_ms"] == 0.0 and s["ttft_miss_p95_ms"] == 0.0  # all misses left the window
    assert s["misses_total"] == 5 and s["requests_total"] == 10


def test_nan_ttft_never_reaches_output():
    rec = CacheStatsRecorder()
    rec.record(ok(CacheResult.MISS, float("nan")))
    rec.record(ok(CacheResult.ANSWER, float("inf")))
    s = rec.snapshot(**POOL)
    assert all(math.isfinite(v) for v in s.values())
    assert s["hit_rate_answer_recent"] == 0.5


def test_cache_result_given_as_int():
    rec = CacheStatsRecorder()
    rec.record(ok(2, 5.0))  # the ROS layer may copy the raw uint8
    assert rec.snapshot(**POOL)["hit_rate_semantic_total"] == 1.0


def test_bad_window():
    with pytest.raises(ValueError):
        CacheStatsRecorder(window=0)


def test_thread_safety():
    rec = CacheStatsRecorder(window=50)
    tiers = list(CacheResult)
    n_threads, per_thread = 8, 2000

    def worker(k):
        for i in range(per_thread):
            rec.record(ok(tiers[(i + k) % 4], float(i % 100)))
            if i % 100 == 0:
                rec.record_rejected_busy()
                rec.snapshot(**POOL)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = rec.snapshot(**POOL)
    assert s["requests_total"] == n_threads * per_thread
    assert s["rejected_busy_total"] == n_threads * (per_thread // 100)
    assert s["misses_total"] == n_threads * per_thread // 4
    assert s["hit_rate_any_total"] == pytest.approx(0.75)
    assert s["window_size"] == 50


def test_draft_and_exactness_figures():
    rec = CacheStatsRecorder(window=2)
    for proposed, accepted, saved, exact in ((10, 10, 9, True), (8, 2, 1, False), (4, 0, 0, True)):
        r = ok(CacheResult.EXACT_PREFIX, 50.0)
        r.draft_tokens_proposed, r.draft_tokens_accepted, r.decode_passes_saved, r.exact = \
            proposed, accepted, saved, exact
        rec.record(r)
    rec.record(QueryResult.failure("bad input"))  # failures count nowhere here
    s = rec.snapshot(**POOL)
    assert s["draft_tokens_proposed_total"] == 22 and s["draft_tokens_accepted_total"] == 12
    assert s["draft_acceptance_recent"] == pytest.approx(2 / 12)  # window of 2: the last two results
    assert s["decode_passes_saved_total"] == 10 and s["approximate_total"] == 1
