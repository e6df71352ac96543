"""The matcher at 10k / 100k / 1M fingerprints: the exact scan against the coarse index, side by side.

Per size (clustered unit vectors, 384-d, one scope, best 4 with recency): median lookup by scanning (the
int8 prefilter + exact float32 ranking) and through the coarse index (faiss IVF, the default above
matcher.INDEX_ROWS), the index's build time (in the background in a running node), a lookup right after an
add, the add itself (its nearest-neighbour pass over the scope, for eviction), and how often the index's
best equals the exact best. Then the index's recall on real data: MiniLM fingerprints of CLINC150's 15,000
training sentences as the scope, its validation sentences as queries, each checked against the exact best.

Run: .venv/bin/simllm-bench matcher [--sizes 10000,100000,1000000] [--queries 300]
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

from simllm_ros.cache.fingerprint import Fingerprinter
from simllm_ros.workloads import find_clinc
from .shared import (HALF_LIFE, NOW, RECENCY, exact_best, loaded_matcher, matcher_report, matcher_scaling,
                     offline)

offline()


def real_recall(queries: int, threshold: float = 0.8) -> dict:
    """The index over MiniLM fingerprints of CLINC150 (forced on at this size) against the exact best."""
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
            if got != exact_best(X, last_used, Q[i]):
                out.append(round(float(best_cos[i]), 3))
        return sorted(out)

    m = loaded_matcher(X, last_used, index_rows=len(X) - 1)
    m.build_index("s")
    m.wait_for_index()
    res = {"rows": len(X), "queries": len(Q), "lists": m.index_state("s")["lists"], "threshold": threshold,
           "queries_at_threshold": int((best_cos >= threshold).sum()), "embed_s": round(embed_s, 1)}
    res["miss_best_cosines"] = misses(m, range(len(Q)))
    res["misses"] = len(res["miss_best_cosines"])
    res["misses_at_threshold"] = sum(c >= threshold for c in res["miss_best_cosines"])
    # Drift: the index trained on the first 100 intents only, then the other 50 arrive through add() (filed in
    # lists trained on other topics; the newest INDEX_TAIL_ROWS rows are scanned exactly as in a node).
    intents = sorted({r["intent"] for r in train_rows})
    old_topics = set(intents[:100])
    first = np.array([r["intent"] in old_topics for r in train_rows])
    order = np.concatenate([np.flatnonzero(first), np.flatnonzero(~first)])
    X, last_used = X[order], last_used[order]
    n_first = int(first.sum())
    m = loaded_matcher(X[:n_first], last_used[:n_first], index_rows=n_first - 1)
    m.build_index("s")
    m.wait_for_index()
    for key in range(n_first, len(X) - 1):  # one short of 1.5x: the old index is still in use
        m.add(key, X[key], "s", float(last_used[key]))
    state = m.index_state("s")
    assert not state["building"] and state["trained_rows"] == n_first
    X, last_used = X[:-1], last_used[:-1]
    new_q = [i for i, r in enumerate(val_rows) if r["intent"] not in old_topics]
    drift = misses(m, new_q)
    at = best_cos[new_q] >= threshold
    res["drift"] = {"queries": len(new_q), "misses": len(drift), "queries_at_threshold": int(at.sum()),
                    "misses_at_threshold": sum(c >= threshold for c in drift), "miss_best_cosines": drift}
    print(json.dumps(res), flush=True)
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--queries", type=int, default=300,
                    help="CLINC150 validation queries for the recall check (0: skip)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.monotonic()
    rows = matcher_scaling([int(x) for x in args.sizes.split(",") if x])
    real = real_recall(args.queries) if args.queries else None
    print("\n".join(matcher_report(rows, real) + ["", f"Wall time {time.monotonic() - t0:.0f} s."]))


if __name__ == "__main__":
    main()
