"""`warmup_queries: N`: the N most-used tasks of the semantic log, warmed at configure time.

Two real engine loads (this is load-time behaviour): the first answers requests (its semantic log counts
them) and saves a snapshot part-way; the second starts from that snapshot and log with warmup_queries "2".
"""
from __future__ import annotations

import json

from simllm_ros.cache import semantic_log
from simllm_ros.serving.engine import Engine
from simllm_ros.request import CacheResult, ChatTurn, QueryRequest
from simllm_ros.settings import Settings

from core_fixtures import BULLETIN

A = QueryRequest(prompt="Which road is closed today?", context=BULLETIN, cache_scope="kiosk", max_new_tokens=6)
B = QueryRequest(prompt="", context=BULLETIN, cache_scope="kiosk", max_new_tokens=6,
                 messages=[ChatTurn("user", "Is it going to rain?"), ChatTurn("assistant", "Yes, after 15:00."),
                           ChatTurn("user", "Should I take an umbrella?")])
C = QueryRequest(prompt="When does the pharmacy open?", context=BULLETIN, max_new_tokens=6)


def _settings(tmp_path, **kw):
    return Settings.from_overrides(cache_size="64MB", kv_bits=0, semantic_log_path=str(tmp_path / "semantic.jsonl"),
                                   persist_path=str(tmp_path / "pool"), **kw)


def test_the_most_used_tasks_are_warmed_and_the_snapshots_are_not_recomputed(tmp_path):
    first = Engine(_settings(tmp_path))
    first.load()
    try:
        for _ in range(3):
            assert first.handle(A).success
        assert first.save()  # the snapshot holds A only
        for req in (B, B, C):
            assert first.handle(req).success
    finally:
        first.unload()
    ranked = semantic_log.most_used(str(tmp_path / "semantic.jsonl"), 5)
    assert [(r.prompt, r.cache_scope, r.messages) for r in ranked] == [
        (A.prompt, "kiosk", []), ("", "kiosk", B.messages), (C.prompt, "", [])]

    said = []
    second = Engine(_settings(tmp_path, warmup_queries="2"))
    second.load(progress=said.append)
    try:
        assert second.load_report["restored"] == 1 and second.load_report["warmup"] == 1
        assert any("2 most-used tasks" in m and "1 already in the pool from the snapshot, computing 1" in m
                   for m in said), said
        b = second.handle(B)  # warmed: its whole prompt from the pool (and its answer: the memo, exact)
        assert b.cache_result == CacheResult.EXACT_PREFIX and b.reused_tokens >= b.prompt_tokens - 1 and b.exact
        c = second.handle(C)  # not among the 2 most used: only the shared system prompt is pooled
        assert c.reused_tokens < c.prompt_tokens - 20
    finally:
        second.unload()
    # The warm-up's own record is marked, so it never counts as an ask.
    with open(tmp_path / "semantic.jsonl", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    warm = [r for r in records if r.get("warmup")]
    assert len(records) == 9 and len(warm) == 1 and warm[0]["messages"][-1] == ["user", "Should I take an umbrella?"]
