"""The matcher at 10k / 100k / 1M fingerprints: the exact scan against the coarse index, side by side.

Per size (clustered unit vectors, 384-d, one scope, best 4 with recency): median lookup by scanning (the
int8 prefilter + exact float32 ranking) and through the coarse index (faiss IVF, the default above
matcher.INDEX_ROWS), the index's build time (in the background in a running node), a lookup right after an
add, the add itself (its nearest-neighbour pass over the scope, for eviction), and how often the index's
best equals the exact best. Then the index's recall on real data: MiniLM fingerprints of CLINC150's 15,000
training sentences as the scope, its validation sentences as queries, each checked against the exact best.

Run: .venv/bin/python benchmark/matcher.py [--sizes 10000,100000,1000000] [--queries 300]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from simllm_ros import matcher as matcher_mod  # noqa: E402
from simllm_ros.matcher import Matcher, _ScopeRows  # noqa: E402

RECENCY, HALF_LIFE, NOW = 0.05, 600.0, 1000.0


def _loaded(fps: np.ndarray, last_used: np.ndarray, index_rows: int) -> Matcher:
    """A matcher whose one scope holds `fps`, loaded straight into its arrays: filling 1M through add()
    would take hours (each add is O(N) for the neighbour bookkeeping), and only lookups are measured."""
    n, dim = fps.shape
    m = Matcher(dim, index_rows=index_rows)
    rows = _ScopeRows(dim, n + 16)
    rows.fp[:n], rows.keys[:n], rows.n = fps, np.arange(n), n
    rows.last_used[:n] = last_used
    m._scopes["s"] = rows
    m._where.update((i, ("s", i)) for i in range(n))
    return m


def _exact_best(fps, last_used, q) -> int:
    return int(np.argmax(fps @ q - RECENCY * (1.0 - np.exp2(-(NOW - last_used) / HALF_LIFE))))


def scaling(sizes, dim: int = 384, queries: int = 20) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for n in sizes:
        centres = rng.standard_normal((200, dim))
        fps = (centres[rng.integers(0, 200, n)] + 0.5 * rng.standard_normal((n, dim))).astype(np.float32)
        fps /= np.linalg.norm(fps, axis=1, keepdims=True)
        last_used = rng.uniform(0, NOW, n)
        qs = fps[rng.integers(0, n, queries)] + 0.05 * rng.standard_normal((queries, dim)).astype(np.float32)
        qs = (qs / np.linalg.norm(qs, axis=1, keepdims=True)).astype(np.float32)
        m = _loaded(fps, last_used, index_rows=min(n - 1, matcher_mod.INDEX_ROWS))
        s = m._scopes["s"]

        def lookups():
            times, best = [], []
            for q in qs:
                t0 = time.perf_counter()
                top = m.best(q, "s", NOW, k=4, recency_weight=RECENCY, half_life_s=HALF_LIFE)
                times.append((time.perf_counter() - t0) * 1000)
                best.append(top[0][0])
            return statistics.median(times), best

        m.best(qs[0], "s", NOW, k=4)  # warm: the int8 copy is made once
        scan_ms, scan_best = lookups()
        t0 = time.perf_counter()
        m._maybe_index("s", s)
        m.wait_for_index()
        build_s = time.perf_counter() - t0
        assert s.index is not None, "the index was not built"
        index_ms, index_best = lookups()
        exact = [_exact_best(fps, last_used, q) for q in qs]
        assert scan_best == exact, "the scan must return the exact best"
        after, add = [], []
        for i in range(5):
            t0 = time.perf_counter()
            m.add(n + i, fps[i], "s", NOW)
            add.append((time.perf_counter() - t0) * 1000)
            t0 = time.perf_counter()
            m.best(qs[i], "s", NOW, k=4, recency_weight=RECENCY, half_life_s=HALF_LIFE)
            after.append((time.perf_counter() - t0) * 1000)
        out.append({"n": n, "scan_ms": scan_ms, "index_ms": index_ms, "build_s": build_s, "lists": s.index.lists,
                    "after_add_ms": statistics.median(after), "add_ms": statistics.median(add),
                    "same_best": sum(a == b for a, b in zip(index_best, exact)), "queries": queries})
        print(json.dumps(out[-1]), flush=True)
        del m, s
    return out


def real_recall(queries: int, threshold: float = 0.8) -> dict:
    """The index over MiniLM fingerprints of CLINC150 (forced on at this size) against the exact best."""
    from simllm_ros.fingerprint import Fingerprinter
    from simllm_ros.workloads import find_clinc

    folder = os.path.dirname(find_clinc())
    read = lambda name: [json.loads(line) for line in open(os.path.join(folder, name), encoding="utf-8")]
    train_rows, val_rows = read("train.jsonl"), read("val.jsonl")[:queries]
    train, val = [r["text"] for r in train_rows], [r["text"] for r in val_rows]
    fp = Fingerprinter()
    t0 = time.perf_counter()
    X = np.vstack([fp.embed(train[i:i + 256]) for i in range(0, len(train), 256)]).astype(np.float32)
    Q = np.vstack([fp.embed(val[i:i + 256]) for i in range(0, len(val), 256)]).astype(np.float32)
    embed_s = time.perf_counter() - t0
    last_used = np.random.default_rng(1).uniform(0, NOW, len(X))
    best_cos = (Q @ X.T).max(axis=1)

    def misses(m, queries) -> list[float]:
        out = []
        for i in queries:
            got = m.best(Q[i], "s", NOW, k=4, recency_weight=RECENCY, half_life_s=HALF_LIFE)[0][0]
            if got != _exact_best(X, last_used, Q[i]):
                out.append(round(float(best_cos[i]), 3))
        return sorted(out)

    m = _loaded(X, last_used, index_rows=len(X) - 1)
    m._maybe_index("s", m._scopes["s"])
    m.wait_for_index()
    res = {"rows": len(X), "queries": len(Q), "lists": m._scopes["s"].index.lists, "threshold": threshold,
           "queries_at_threshold": int((best_cos >= threshold).sum()), "embed_s": round(embed_s, 1)}
    res["miss_best_cosines"] = misses(m, range(len(Q)))
    res["misses"], res["misses_at_threshold"] = len(res["miss_best_cosines"]), sum(c >= threshold for c in res["miss_best_cosines"])
    # Drift: the index trained on the first 100 intents only, then the other 50 arrive through add() (filed in
    # lists trained on other topics; the newest INDEX_TAIL_ROWS rows are scanned exactly as in a node).
    intents = sorted({r["intent"] for r in train_rows})
    old_topics = set(intents[:100])
    first = np.array([r["intent"] in old_topics for r in train_rows])
    order = np.concatenate([np.flatnonzero(first), np.flatnonzero(~first)])
    X, last_used = X[order], last_used[order]
    n_first = int(first.sum())
    m = _loaded(X[:n_first], last_used[:n_first], index_rows=n_first - 1)
    m._maybe_index("s", m._scopes["s"])
    m.wait_for_index()
    for key in range(n_first, len(X) - 1):  # one short of 1.5x: the old index is still in use
        m.add(key, X[key], "s", float(last_used[key]))
    assert m._scopes["s"].building is None and m._scopes["s"].index.trained_rows == n_first
    X, last_used = X[:-1], last_used[:-1]
    new_q = [i for i, r in enumerate(val_rows) if r["intent"] not in old_topics]
    drift = misses(m, new_q)
    at = best_cos[new_q] >= threshold
    res["drift"] = {"queries": len(new_q), "misses": len(drift), "queries_at_threshold": int(at.sum()),
                    "misses_at_threshold": sum(c >= threshold for c in drift), "miss_best_cosines": drift}
    print(json.dumps(res), flush=True)
    return res


def report(rows: list[dict], real: dict | None) -> list[str]:
    lines = ["Matcher (best 4 of N clustered fingerprints, 384-d, one scope, recency on; scan = int8 prefilter + "
             f"exact ranking, index = coarse index, the default above {matcher_mod.INDEX_ROWS:,} rows):", "",
             "| N | scan | index | index ratio | index best = exact best | index build | lookup after an add | the add |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['n']:,} | {r['scan_ms']:.2f} ms | {r['index_ms']:.2f} ms | {r['index_ms'] / r['scan_ms']:.2f}x "
                     f"| {r['same_best']}/{r['queries']} | {r['build_s']:.1f} s ({r['lists']} lists) "
                     f"| {r['after_add_ms']:.2f} ms | {r['add_ms']:.2f} ms |")
    if real:
        lines += ["", f"Index recall on real fingerprints (MiniLM, CLINC150: {real['rows']:,} training sentences, "
                  f"{real['queries']} validation queries, {real['lists']} lists, index forced on): best differs from the "
                  f"exact best for {real['misses']}/{real['queries']} queries, {real['misses_at_threshold']}/"
                  f"{real['queries_at_threshold']} among queries whose best cosine is >= {real['threshold']} "
                  f"(cache_threshold); best cosines of the misses: {real['miss_best_cosines']}."]
        d = real["drift"]
        lines += ["", f"Drift (the index trained on 100 intents, the other 50 added after it): best differs for "
                  f"{d['misses']}/{d['queries']} queries on the new intents, {d['misses_at_threshold']}/"
                  f"{d['queries_at_threshold']} at cosine >= {real['threshold']}; misses' best cosines: "
                  f"{d['miss_best_cosines']} (measured one row before the scope has grown by half, when a new index is trained)."]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--queries", type=int, default=300, help="CLINC150 validation queries for the recall check (0: skip)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.monotonic()
    rows = scaling([int(x) for x in args.sizes.split(",") if x])
    real = real_recall(args.queries) if args.queries else None
    print("\n".join(report(rows, real) + ["", f"Wall time {time.monotonic() - t0:.0f} s."]))


if __name__ == "__main__":
    main()
