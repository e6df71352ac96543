"""The matcher's coarse index (faiss IVF) for large scopes: built in the background, kept in step with every
add, removal and replacement (also those made while it is being built), dropped when the scope shrinks, and
its lookups agree with the exact scan for queries close to a stored task."""
import threading

import numpy as np
import pytest

from simllm_ros.cache import coarse_index
from simllm_ros.cache import matcher as matcher_mod
from simllm_ros.cache.matcher import Matcher

pytestmark = pytest.mark.skipif(not coarse_index.available(), reason="faiss not installed")

DIM = 384
INDEX_ROWS = 3000


def clustered(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((60, DIM))
    fps = centres[rng.integers(0, 60, n)] + 0.5 * rng.standard_normal((n, DIM))
    return (fps / np.linalg.norm(fps, axis=1, keepdims=True)).astype(np.float32)


def near(fp: np.ndarray, rng, noise: float = 0.02) -> np.ndarray:
    q = fp + noise * rng.standard_normal(DIM)
    return (q / np.linalg.norm(q)).astype(np.float32)


def test_index_lookups_agree_with_the_exact_scan_near_stored_tasks():
    fps = clustered(2 * INDEX_ROWS, seed=1)
    now = np.arange(len(fps), dtype=np.float64) % 500
    m = Matcher(DIM, index_rows=INDEX_ROWS)
    for key, (fp, t) in enumerate(zip(fps, now)):
        m.add(key, fp, "s", now=float(t))
    m.wait_for_index(timeout=120)
    m.check_consistency()
    s = m._scopes["s"]
    assert s.index is not None and len(s.index) == len(fps)
    rng = np.random.default_rng(2)
    tail = len(fps) - matcher_mod.INDEX_TAIL_ROWS
    for i in rng.integers(0, tail, 30):  # rows the index must find (the newest rows are scanned anyway)
        q = near(fps[i], rng)
        rows, _ = m._index_rows(s, "s", q, 4)
        assert (rows < tail).sum() <= matcher_mod.INDEX_CANDIDATES, "the lookup did not go through the index"
        score = fps @ q - 0.05 * (1.0 - np.exp2(-(500.0 - now) / 600.0))
        got = m.best(q, "s", now=500.0, k=4, recency_weight=0.05, half_life_s=600.0)
        assert got[0][0] == int(np.argmax(score))
        assert got[0][2] == pytest.approx(float(score.max()), abs=1e-5)


def test_index_follows_every_change_made_during_and_after_its_build(monkeypatch):
    both = clustered(INDEX_ROWS + 401, seed=3)  # new tasks on the same topics (drift: the benchmark, real data)
    fps, extra = both[:INDEX_ROWS + 1], both[INDEX_ROWS + 1:]
    go = threading.Event()

    class HeldIndex(coarse_index.CoarseIndex):  # the real index, trained only once the changes below are made
        def __init__(self, *a, **kw):
            assert go.wait(60)
            super().__init__(*a, **kw)

    monkeypatch.setattr(coarse_index, "CoarseIndex", HeldIndex)
    m = Matcher(DIM, index_rows=INDEX_ROWS)
    for key, fp in enumerate(fps):
        m.add(key, fp, "s", now=0.0)
    s = m._scopes["s"]
    assert s.building is not None, "passing index_rows starts a build"
    # While it builds: new rows, removals, a replacement, and a key that moves to another scope.
    for j in range(200):
        m.add(10_000 + j, extra[j], "s", now=0.0)
    removed = list(range(0, 300, 3))
    for key in removed:
        m.remove(key)
    m.add(5, extra[300], "s", now=0.0)  # key 5 gets another fingerprint
    m.add(7, fps[7], "other", now=0.0)  # key 7 leaves the scope
    assert s.building is not None and s.index is None and len(s.changed_keys) == 200 + len(removed) + 2
    go.set()
    m.wait_for_index(timeout=120)
    # And after it: the index is kept up to date row by row.
    for j in range(200, 300):
        m.add(10_000 + j, extra[j], "s", now=0.0)
    m.remove(10_000)
    m.add(11, extra[301], "s", now=0.0)
    assert s.index is not None
    m.check_consistency()

    for key, now_fp, old_fp in ((5, extra[300], fps[5]), (11, extra[301], fps[11])):  # filed as they are now
        assert float(s.index.stored(key) @ now_fp) > float(s.index.stored(key) @ old_fp) + 0.5
    assert float(s.index.stored(13) @ fps[13]) > 0.99
    rng = np.random.default_rng(5)
    for key in removed[1:]:  # a removed task is never found, not even by its own fingerprint
        assert all(k != key for k, _, _ in m.best(fps[key], "s", now=0.0, k=4))
    for key, fp in ((5, extra[300]), (11, extra[301]), (10_150, extra[150]), (10_250, extra[250])):
        assert m.best(near(fp, rng), "s", now=0.0, k=1)[0][0] == key
    assert m.best(fps[5], "s", now=0.0, k=1)[0][0] != 5  # found by its new fingerprint only
    assert m.best(fps[7], "s", now=0.0, k=1)[0][0] != 7
    assert m.best(fps[7], "other", now=0.0, k=1)[0][0] == 7
    assert m.best(extra[0], "s", now=0.0, k=1)[0][0] != 10_000


def test_a_shrinking_scope_drops_its_index_and_scans_exactly():
    fps = clustered(INDEX_ROWS + 500, seed=6)
    m = Matcher(DIM, index_rows=INDEX_ROWS)
    for key, fp in enumerate(fps):
        m.add(key, fp, "s", now=0.0)
    m.wait_for_index(timeout=120)
    s = m._scopes["s"]
    assert s.index is not None
    keep = INDEX_ROWS // 2 - 1
    for key in range(len(fps) - keep):
        m.remove(key)
    assert s.n == keep < INDEX_ROWS // 2 and s.index is None
    for key in range(len(fps) - keep, len(fps), 97):
        assert m.best(fps[key], "s", now=0.0, k=1)[0][0] == key
    m.check_consistency()


def test_a_loaded_scope_gives_the_same_best_as_one_filled_by_add():
    """load_scope (the benchmark's way to reach 1M rows) holds what add() would for lookups; build_index and
    index_state show the index, and add() after it keeps index and scope in step."""
    fps = clustered(INDEX_ROWS + 200, seed=5)
    last_used = np.random.default_rng(6).uniform(0, 500, len(fps))
    loaded, added = Matcher(DIM, index_rows=INDEX_ROWS), Matcher(DIM, index_rows=INDEX_ROWS)
    loaded.load_scope("s", fps, last_used)
    for key, (fp, t) in enumerate(zip(fps, last_used)):
        added.add(key, fp, "s", now=float(t))
    added.wait_for_index(timeout=120)
    assert len(loaded) == len(fps) and loaded.index_state("s") == {"built": False, "lists": 0, "trained_rows": 0,
                                                                    "building": False}
    with pytest.raises(ValueError):
        loaded.load_scope("s", fps[:2], last_used[:2])
    loaded.build_index("s")
    loaded.wait_for_index(timeout=120)
    state = loaded.index_state("s")
    assert state["built"] and state["trained_rows"] == len(fps) and state["lists"] > 0 and not state["building"]
    loaded.add(len(fps), fps[0], "s", now=500.0)
    loaded.check_consistency()
    rng = np.random.default_rng(7)
    for i in rng.integers(0, len(fps), 20):
        q = near(fps[i], rng)
        a = loaded.best(q, "s", now=500.0, k=4, recency_weight=0.05, half_life_s=600.0)
        b = added.best(q, "s", now=500.0, k=4, recency_weight=0.05, half_life_s=600.0)
        assert a[0][0] in (b[0][0], len(fps)) and a[0][2] == pytest.approx(b[0][2], abs=1e-5)
    assert loaded.index_state("absent")["built"] is False
