"""approx_error_bound: an approximate answer only where the learnt chance that it differs from the model's own is
at most δ. The bound itself (ErrorBound, no model), then the engine: labels come from verified requests, one-word
edit traps are not served wrong beyond the bound, the labels survive a restart and a damaged file is refused."""
from __future__ import annotations

import json
import os

import pytest

from core_fixtures import BULLETIN, BULLETIN_REVISED, LOSSLESS, fresh, shared_engine
from simllm_ros.cache.error_bound import FILE_NAME, MIN_LABELS, ErrorBound, wilson_upper
from simllm_ros.serving import approx_gate
from simllm_ros.request import CacheResult, QueryRequest
from simllm_ros.cache.reuse_planner import ReusePlan


def test_the_upper_bound_is_conservative_and_tightens_with_data():
    assert wilson_upper(0, 0) == 1.0
    assert wilson_upper(0, 10) > 0.15  # ten clean labels promise little
    assert wilson_upper(0, 200) < 0.02 < wilson_upper(0, 100)
    assert wilson_upper(5, 100) > 0.05 and wilson_upper(5, 1000) < 0.011
    for n in (20, 50, 500):
        assert wilson_upper(n // 10, n) > (n // 10) / n


def test_estimates_come_from_the_entry_then_the_scope_then_all_and_a_wrong_entry_is_refused():
    b = ErrorBound()
    assert b.estimate("answer", "s", "e1", 0.9).upper == 1.0  # cold start: no promise possible
    for i in range(300):
        b.record("answer", "s", f"e{i % 30}", 0.95, wrong=False)
    est = b.estimate("answer", "s", "e1", 0.9)
    assert est.level == "scope" and est.n == 300 and est.upper < 0.02 and est.allows(0.02)
    assert not est.allows(0.0)
    assert b.estimate("answer", "other", "x", 0.9).level == "all"  # another scope borrows from all scopes
    assert b.estimate("answer", "s", "e1", 0.97).upper == 1.0  # no labels at that similarity or above
    assert b.estimate("semantic", "s", "e1", 0.9).upper == 1.0  # tiers do not share labels
    b.record("answer", "s", "e7", 0.93, wrong=True)
    for sim in (0.93, 0.90, 0.5):  # an entry that was wrong at 0.93 is never served at 0.93 or below again
        est = b.estimate("answer", "s", "e7", sim)
        assert est.level == "entry" and not est.allows(0.5)
    assert b.estimate("answer", "s", "e7", 0.96).upper == 1.0 or b.estimate("answer", "s", "e7", 0.96).level != "entry"
    assert b.estimate("answer", "s", "e8", 0.93).allows(0.05)  # its neighbours keep their own record


def test_labels_survive_a_save_and_a_damaged_or_foreign_file_is_refused(tmp_path):
    b = ErrorBound()
    for i in range(MIN_LABELS + 5):
        b.record("semantic", "kiosk", f"t{i}", 0.85 + i / 1000, wrong=i % 7 == 0)
    b.save(str(tmp_path), "digest-a")
    again = ErrorBound()
    assert again.load(str(tmp_path), "digest-a") == MIN_LABELS + 5
    assert again.estimate("semantic", "kiosk", "t3", 0.85) == b.estimate("semantic", "kiosk", "t3", 0.85)
    with pytest.raises(ValueError, match="other bits"):
        ErrorBound().load(str(tmp_path), "digest-b")
    path = tmp_path / FILE_NAME
    data = json.loads(path.read_text())
    for bad in ('{"format": 1, "digest": "digest-a", "labels": [["answer", "s", "e", 2.5, 0]]}',
                '{"format": 1, "digest": "digest-a", "labels": [["tier?", "s", "e", 0.5, 0]]}',
                path.read_text()[:50], "[]", '{"format": 9}'):
        path.write_text(bad)
        kept = ErrorBound()
        kept.record("answer", "s", "e", 0.9, False)
        with pytest.raises(ValueError):
            kept.load(str(tmp_path), "digest-a")
        assert len(kept) == 1  # a refused file leaves what was there
    assert data["digest"] == "digest-a"


def _labels_file(tmp_path, rows: int, scope: str = "kiosk") -> str:
    """An error-bound file of `rows` labels written as save() writes them (the last rows newest)."""
    labels = ",".join(f'["answer","{scope}","t{i}",0.9,{int(i % 5 == 0)}]' for i in range(rows))
    (tmp_path / FILE_NAME).write_text('{"format":1,"digest":"digest-a","labels":[' + labels + "]}")
    return str(tmp_path)


def test_a_deeply_nested_or_oversized_labels_file_is_refused_by_name(tmp_path):
    for doc in ('{"format": 1, "digest": "digest-a", "labels": ' + "[" * 50000 + "]" * 50000 + "}",
                '{"format": 1, "digest": "digest-a", "labels": [[' + "[" * 3000 + "]" * 3000 + "]]}"):
        (tmp_path / FILE_NAME).write_text(doc)
        with pytest.raises(ValueError, match="nests more than"):  # was RecursionError: the node did not start
            ErrorBound().load(str(tmp_path), "digest-a")
    with open(tmp_path / FILE_NAME, "wb") as f:  # 60 MB: refused by its size, before it is read whole
        f.write(b'{"format":1,"digest":"digest-a","labels":[' + b'["answer","s","t",0.9,0],' * 2_500_000)
    with pytest.raises(ValueError, match="larger than"):
        ErrorBound().load(str(tmp_path), "digest-a")
    for bad_row in ('["answer","s","t",NaN,0]', '["answer","s","t",Infinity,0]', '["answer","s","t",true,0]',
                    '["answer","' + "s" * 300 + '","t",0.5,0]', '["answer","s","t",0.5,1.0]'):
        (tmp_path / FILE_NAME).write_text('{"format":1,"digest":"digest-a","labels":[' + bad_row + "]}")
        with pytest.raises(ValueError):
            ErrorBound().load(str(tmp_path), "digest-a")


def test_a_labels_file_keeps_the_newest_rows_up_to_the_cap_in_the_memory_the_cap_needs(tmp_path):
    import tracemalloc

    folder = _labels_file(tmp_path, 150_000)  # ~6 MB: within the file bound, 7.5 times the cap
    size = os.path.getsize(tmp_path / FILE_NAME)
    tracemalloc.start()
    try:
        b = ErrorBound(max_labels=20_000)
        assert b.load(folder, "digest-a") == 20_000
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # the text (bytes, then str) and 20000 labels; json.loads of the whole file took ~12 times its size
    assert peak < 2 * size + 20_000 * 400, (peak, size)
    kept = b._labels
    assert kept[0].entry == "t130000" and kept[-1].entry == "t149999"  # the newest, in order
    assert b.totals()["approx_checks_differ"] == 4000


def test_a_labels_file_written_by_hand_with_spaces_and_fields_in_another_order_loads(tmp_path):
    (tmp_path / FILE_NAME).write_text('{ "labels" : [ [ "semantic", "s", "t1", 0.5, 1 ] ,\n ["answer","s","t2",1,0] ],'
                                      ' "extra": {"x": [1]}, "digest": "digest-a", "format": 1 }\n')
    b = ErrorBound()
    assert b.load(str(tmp_path), "digest-a") == 2
    assert [lb.entry for lb in b._labels] == ["t1", "t2"] and b._labels[0].wrong
    for bad in ('{"labels": [["answer","s","t",0.5,0]] "digest": "digest-a"}', '{"format":1} []',
                '{"format":1,"digest":"digest-a","labels":[["answer","s","t",0.5,0],]}'):
        (tmp_path / FILE_NAME).write_text(bad)
        with pytest.raises(ValueError):
            ErrorBound().load(str(tmp_path), "digest-a")


# ---- the engine ---------------------------------------------------------------------------------------
TRAPS = [("Can I park on Elm Street today?", "Can I not park on Elm Street today?"),
         ("Is the pharmacy on Oak Avenue open at 08:30?", "Is the pharmacy on Oak Avenue closed at 08:30?"),
         ("Does bus line 12 run every 15 minutes?", "Does bus line 12 run every 40 minutes?"),
         ("Is regular fuel 1.62 per litre at the Shell station?", "Is diesel fuel 1.62 per litre at the Shell station?"),
         ("Is Elm Street closed between 3rd Avenue and Mill Road?", "Is Oak Avenue closed between 3rd Avenue and Mill Road?"),
         ("Will it rain after 15:00?", "Will it rain before 15:00?"),
         ("Is the post office open until 12:30?", "Is the post office open after 12:30?"),
         ("Is Route 9 northbound heavy?", "Is Route 9 southbound heavy?")]


@pytest.fixture(scope="module")
def engine():
    e = shared_engine(**LOSSLESS)
    yield e
    e.error_bound = ErrorBound()
    fresh(e)


def ask(e, q, scope="traps", **kw):
    r = e.handle(QueryRequest(prompt=q, context=BULLETIN, cache_scope=scope, max_new_tokens=12, **kw))
    assert r.success, r.error
    return r


def test_one_word_edit_traps_are_not_served_wrong_beyond_the_bound(engine):
    """The ANSWER tier on at a loose fixed threshold (0.8) serves a trap the first question's answer; under
    δ = 0.05 the same stream is answered by the model wherever the labels cannot promise it."""
    alone = {}
    fresh(engine, enable_semantic_reuse=False, answer_memo=False)
    for a, b in TRAPS:  # the model's own answers, one request at a time on an empty pool
        for q in (a, b):
            fresh(engine, enable_semantic_reuse=False, answer_memo=False)
            alone[q] = ask(engine, q).answer
    fresh(engine, enable_semantic_reuse=False, enable_answer_cache=True, answer_threshold=0.8, answer_max_age_s=1e6)
    loose = [ask(engine, q) for pair in TRAPS for q in pair]
    wrong_loose = sum(r.cache_result == CacheResult.ANSWER and r.answer != alone[q]
                      for r, q in zip(loose, [q for p in TRAPS for q in p]))
    engine.error_bound = ErrorBound()
    fresh(engine, enable_semantic_reuse=False, enable_answer_cache=True, answer_threshold=0.8, answer_max_age_s=1e6,
          approx_error_bound=0.05)
    served = wrong = 0
    for _ in range(3):  # the stream again and again: labels pile up from the verified requests
        for a, b in TRAPS:
            for q in (a, b):
                r = ask(engine, q)
                if r.cache_result == CacheResult.ANSWER:
                    served += 1
                    wrong += r.answer != alone[q]
                    assert 0 < r.error_estimate <= 0.05 and not r.exact
                else:
                    assert r.exact and r.answer == alone[q] and r.error_estimate == 0.0
    print(f"\nloose fixed threshold: {wrong_loose} of {len(loose)} trap answers wrong; "
          f"under δ=0.05: {served} approximate, {wrong} wrong; labels {len(engine.error_bound)}")
    assert wrong_loose >= 1, "the traps must catch the fixed threshold, or they test nothing"
    assert wrong <= 0.05 * 3 * 2 * len(TRAPS)
    assert len(engine.error_bound) >= len(TRAPS)  # labels from the verified requests, at no extra request


def test_zero_means_never_one_means_no_bound_and_the_request_field_overrides_the_node(engine):
    b = ErrorBound(seed=3)
    for i in range(400):  # a history that allows anything at 0.9 and above
        b.record("answer", "ovr", f"t{i}", 0.99, wrong=False)
    plan = ReusePlan(CacheResult.ANSWER, "test", similarity=0.99, source_key=1, answer="x")
    assert approx_gate.request_bound(-1.0, 0.02) == 0.02 and approx_gate.request_bound(0.3, 0.02) == 0.3
    assert approx_gate.gate(b, plan, "ovr", "t1", 0.0)[0] is False  # δ = 0: never approximate
    assert approx_gate.gate(b, plan, "other", "t1", 0.05)[2].level == "all"
    kept = [approx_gate.gate(b, plan, "ovr", "t1", 0.05) for _ in range(200)]
    explored = sum(x[1] for x in kept)
    assert sum(x[0] for x in kept) + explored == 200 and 5 < explored < 40  # ~10% verified anyway
    assert all(x[2].upper <= 0.05 for x in kept)
    assert approx_gate.gate(ErrorBound(), plan, "ovr", "t1", 1.0)[0] is True  # δ = 1: no bound asked
    fresh(engine, enable_semantic_reuse=False, enable_answer_cache=True, answer_threshold=0.5, cache_threshold=0.5,
          answer_max_age_s=1e6, answer_memo=False, approx_error_bound=0.0)
    engine.error_bound = b
    ask(engine, TRAPS[0][0], scope="ovr")
    r = ask(engine, TRAPS[0][1], scope="ovr")
    assert r.cache_result != CacheResult.ANSWER and r.exact  # the node's δ = 0
    engine.error_bound = ErrorBound()


def test_the_labels_survive_a_restart_and_a_damaged_file_starts_empty(engine, tmp_path):
    engine.error_bound = ErrorBound()
    for i in range(30):
        engine.error_bound.record("answer", "kiosk", f"t{i}", 0.9, wrong=i == 3)
    settings = engine.settings.replace(persist_path=str(tmp_path / "snap"))
    a = engine.fork(settings)
    a.error_bound = engine.error_bound
    fresh(a, enable_semantic_reuse=False)
    ask(a, "When does the pharmacy open?", scope="kiosk")
    a.save()
    assert os.path.isfile(tmp_path / "snap" / FILE_NAME)
    b = engine.fork(settings)
    b.restore()
    assert len(b.error_bound) == len(a.error_bound) >= 30
    assert b.error_bound.estimate("answer", "kiosk", "t3", 0.9).level == "entry"
    (tmp_path / "snap" / FILE_NAME).write_text('{"format": 1, "digest": "')
    c = engine.fork(settings)
    c.restore()  # never raises: the pool comes back, the labels start empty (lossless until relearnt)
    assert len(c.error_bound) == 0 and len(c.pool) == len(b.pool) > 0
    for x in (a, b, c):
        x.unload()
    engine.error_bound = ErrorBound()


def test_a_would_be_semantic_hit_is_answered_exactly_and_audited_at_idle_time(engine):
    """Cold start under a bound: the SEMANTIC plan is turned down (no labels), the request gets the exact answer,
    and idle time runs the SEMANTIC reuse it would have used to learn whether it would have been right."""
    engine.error_bound = ErrorBound()
    fresh(engine, approx_error_bound=0.05)
    q = dict(cache_scope="kiosk", max_new_tokens=6)
    first = engine.handle(QueryRequest(prompt="what is the weather going to be like today", context=BULLETIN, **q))
    assert first.cache_result == CacheResult.MISS
    second = engine.handle(QueryRequest(prompt="what will the weather be like today", context=BULLETIN_REVISED, **q))
    assert second.success and second.exact and second.cache_result != CacheResult.SEMANTIC
    assert len(engine.audits) == 1 and engine.audits[0].served_exact and engine.audits[0].tier == "semantic"
    before = len(engine.error_bound)
    while engine.has_idle_work():
        engine.idle_work()
    assert len(engine.error_bound) == before + 1
    assert engine.error_bound.summary()["semantic/kiosk"]["labels"] == 1
    engine.error_bound = ErrorBound()


def test_totals_for_cache_stats():
    b = ErrorBound()
    assert b.totals() == {"approx_checks": 0, "approx_checks_differ": 0, "approx_differ_high": 1.0}
    for i in range(40):
        b.record("answer", "s", f"t{i}", 0.9, wrong=i < 4)
    t = b.totals()
    assert t["approx_checks"] == 40 and t["approx_checks_differ"] == 4 and 0.1 < t["approx_differ_high"] < 0.25


def test_a_served_semantic_answer_is_checked_against_the_exact_answer_at_idle_time(engine):
    """With a history that allows SEMANTIC at this scope, the hit is served approximately; idle time pools its exact
    KV, then computes the exact answer on it and labels the decision: differed or not, as an empty pool says."""
    engine.error_bound = ErrorBound(seed=5)  # its first draw (0.62) serves rather than explores
    for i in range(400):  # clean checks at every similarity up to 1
        engine.error_bound.record("semantic", "kiosk", f"t{i}", 1.0, wrong=False)
    fresh(engine, approx_error_bound=0.05)
    q = dict(cache_scope="kiosk", max_new_tokens=6)
    engine.handle(QueryRequest(prompt="what is the weather going to be like today", context=BULLETIN, **q))
    second = QueryRequest(prompt="what will the weather be like today", context=BULLETIN_REVISED, **q)
    r = engine.handle(second)
    assert r.cache_result == CacheResult.SEMANTIC and not r.exact and 0 < r.error_estimate <= 0.05
    assert len(engine.audits) == 1 and not engine.audits[0].served_exact
    while engine.has_idle_work():
        engine.idle_work()
    got = [lb for lb in engine.error_bound._labels if lb.similarity != 1.0]
    assert [lb.tier for lb in got] == ["semantic"]  # the served answer labels nothing else: it is not the model's
    fresh(engine, approx_error_bound=0.05)
    exact = engine.handle(QueryRequest(prompt=second.prompt, context=second.context, allow_approximate=False, **q))
    assert got[0].wrong == (r.answer != exact.answer)
    engine.error_bound = ErrorBound()
