"""Exact pruning of large matcher scopes by row groups (row_groups.py): a lookup that skips groups must still
return the exact ranking (cosine minus recency, ties by row order), through adds, removals, moves and
rebuilds, and must hand back to the scan where the data does not cluster. The threshold is lowered so that
the rows can be added through the real `add` (each add is O(scope) for the eviction bookkeeping)."""
from __future__ import annotations

import numpy as np
import pytest

from simllm_ros import matcher as matcher_mod
from simllm_ros.matcher import Matcher
from simllm_ros.row_groups import RowGroups

DIM = 384


@pytest.fixture
def low_threshold(monkeypatch):
    monkeypatch.setattr(matcher_mod, "GROUP_ROWS", 2000)


def _clustered(rng, n, centres=60, noise=0.5):
    c = rng.standard_normal((centres, DIM))
    x = c[rng.integers(0, centres, n)] + noise * rng.standard_normal((n, DIM))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def _want(fps, last_used, q, now, k, w=0.05, half_life=600.0):
    score = fps @ q - w * (1.0 - np.exp2(-np.maximum(now - last_used, 0.0) / half_life))
    return [int(i) for i in np.argsort(-score, kind="stable")[:k]]


def _check_groups(m: Matcher, scope: str):
    """Every row of the scope is in exactly one group's member list, where `group` and `pos` say."""
    s = m._scopes[scope]
    g = s.groups
    seen = np.zeros(s.n, dtype=int)
    for j in range(len(g.count)):
        for p, row in enumerate(g.members[j][:g.count[j]]):
            assert row < s.n and g.group[row] == j and g.pos[row] == p
            seen[row] += 1
            dist = np.linalg.norm(s.fp[row] - g.centres[j])
            assert dist <= g.radius[j] + 1e-5, "a member outside its group's radius: the bound would be wrong"
    assert (seen == 1).all()


def test_grouped_lookups_are_the_exact_ranking_through_adds_removals_and_rebuilds(low_threshold):
    rng = np.random.default_rng(3)
    n = 4000
    fps = _clustered(rng, n, centres=20)
    last = rng.uniform(0, 1000, n)
    m = Matcher(DIM)
    for key in range(n):
        m.add(key, fps[key], "s", now=float(last[key]))
    m.add(n, fps[0], "other", now=0.0)  # another scope's perfect match: never returned
    live = np.ones(n, dtype=bool)

    def check(queries=12, k=4):
        keys = np.flatnonzero(live)
        for _ in range(queries):
            q = fps[int(rng.choice(keys))] + 0.15 * rng.standard_normal(DIM)
            q = (q / np.linalg.norm(q)).astype(np.float32)
            want = [int(keys[i]) for i in _want(fps[keys], last[keys], q, 1000.0, k)]
            got = m.best(q, "s", now=1000.0, k=k, recency_weight=0.05, half_life_s=600.0)
            assert [key for key, _, _ in got] == want

    check()
    s = m._scopes["s"]
    assert s.groups is not None and s.groups.built_n == n
    _check_groups(m, "s")
    # The pruning prunes: a query near a stored row scores a small share of the scope.
    q = fps[17]
    picked = s.groups.candidates(q, 4, lambda r: s.fp[r] @ q, s.n)
    assert picked is not None and len(picked) < s.n / 8 and 17 in picked
    for key in rng.choice(n, 900, replace=False):  # removals fill holes with the last row
        m.remove(int(key))
        live[key] = False
    _check_groups(m, "s")
    check()
    extra = _clustered(rng, 5000, centres=20)
    fps, last = np.vstack([fps, extra]), np.concatenate([last, rng.uniform(0, 1000, 5000)])
    live = np.concatenate([live, np.ones(5000, dtype=bool)])
    for i in range(5000):  # the scope more than doubles: the next lookup rebuilds
        m.add(n + 1 + i, extra[i], "s", now=float(last[n + i]))
    # keys n+1.. hold fps[n..]: shift the reference by one key
    keys_to_row = {k: k for k in range(n)} | {n + 1 + i: n + i for i in range(5000)}
    before = s.groups
    for _ in range(8):
        q = extra[int(rng.integers(0, 5000))]
        rows = np.flatnonzero(live)
        want_rows = _want(fps[rows], last[rows], q, 1000.0, 4)
        got = m.best(q, "s", now=1000.0, k=4, recency_weight=0.05, half_life_s=600.0)
        assert [keys_to_row[key] for key, _, _ in got] == [int(rows[i]) for i in want_rows]
    assert s.groups is not before and s.groups.built_n == s.n
    _check_groups(m, "s")


def test_unclustered_rows_fall_back_to_the_scan_and_stay_exact(low_threshold):
    rng = np.random.default_rng(4)
    n = 3000
    fps = rng.standard_normal((n, DIM)).astype(np.float32)
    fps /= np.linalg.norm(fps, axis=1, keepdims=True)
    m = Matcher(DIM)
    for key in range(n):
        m.add(key, fps[key], "s", now=0.0)
    q = rng.standard_normal(DIM).astype(np.float32)
    q /= np.linalg.norm(q)
    got = m.best(q, "s", now=0.0, k=3)
    assert [key for key, _, _ in got] == [int(i) for i in np.argsort(-(fps @ q), kind="stable")[:3]]
    s = m._scopes["s"]
    assert s.groups.candidates(q, 3, lambda r: s.fp[r] @ q, s.n) is None, "random rows: bounds admit everything"


def test_small_scopes_are_not_grouped_and_groups_go_when_a_scope_shrinks(low_threshold):
    rng = np.random.default_rng(5)
    fps = _clustered(rng, 2600)
    m = Matcher(DIM)
    for key in range(1900):
        m.add(key, fps[key], "s", now=0.0)
    m.best(fps[0], "s", now=0.0)
    assert m._scopes["s"].groups is None
    for key in range(1900, 2600):
        m.add(key, fps[key], "s", now=0.0)
    assert m.best(fps[2500], "s", now=0.0)[0][0] == 2500
    assert m._scopes["s"].groups is not None
    for key in range(1700):
        m.remove(key)
    assert m.best(fps[2500], "s", now=0.0)[0][0] == 2500
    assert m._scopes["s"].groups is None


def test_groups_bound_every_member():
    rng = np.random.default_rng(6)
    fps = _clustered(rng, 5000, centres=20)
    g = RowGroups(fps, 5000)
    assert len(g.count) == round(np.sqrt(5000)) and g.count.sum() == 5000
    for j in range(len(g.count)):
        rows = g.members[j][:g.count[j]]
        if len(rows):
            assert (np.linalg.norm(fps[rows] - g.centres[j], axis=1) <= g.radius[j] + 1e-6).all()
