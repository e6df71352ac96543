"""approx_error_bound against fixed thresholds, side by side in one run on the embedded model.

Workload from ../shared/data/clinc150: phrasings of one intent asked one after another (paraphrases: the
ANSWER and SEMANTIC tiers' chance), and one-word edits of them (traps: "today" -> "tomorrow", "can" ->
"cannot", ...), in a shuffled stream asked twice. The model's own answer to every question (empty pool, the
same settings) is the reference. Each configuration starts with an empty pool and no labels, and the engine
does its idle work (pending exact prefills, audits) between requests, as a node does when no request waits:
  lossless         approx_error_bound 0: never approximate
  fixed 0.90/0.95  approx_error_bound 1 (no bound): the fixed thresholds alone (answer_threshold 0.90/0.95,
                   cache_threshold 0.8), as before the bound existed
  bound δ          approx_error_bound δ in 0.01, 0.02, 0.05, 0.1 with loose thresholds (0.6): the bound decides
  per-entry        a vCache-style policy outside the engine: each cached task learns its own threshold from
                   checks (its answer against the model's answer to a request it was the candidate for), serves
                   its answer at or above it once 3 checks agreed there, and explores 10% of those hits
Printed per configuration: share served approximately, the observed share of approximate answers that differ
from the model's own with its 95% interval, the share of all answers that differ, mean and p95 total time.

Usage: .venv/bin/simllm-bench error_bound [--intents 8] [--per-intent 4] [--new 16]"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import time

from simllm_ros.cache.error_bound import ErrorBound
from simllm_ros.request import CacheResult, QueryRequest
from simllm_ros.settings import Settings
from .shared import REPO_ROOT as ROOT, RESULTS_DIR, offline

offline()

SWAPS = [("today", "tomorrow"), ("tomorrow", "today"), ("morning", "evening"), ("before", "after"),
         ("after", "before"), ("can", "cannot"), ("open", "closed"), ("my", "your"), ("left", "right"),
         ("more", "less"), ("cheapest", "most expensive"), ("add", "remove"), ("on", "off"), ("up", "down"),
         ("first", "last"), ("buy", "sell"), ("increase", "decrease"), ("start", "stop")]


def trap_of(text: str) -> str | None:
    """A one-word edit that changes the meaning, or None where no swap applies."""
    for a, b in SWAPS:
        new, n = re.subn(rf"\b{a}\b", b, text, count=1, flags=re.IGNORECASE)
        if n:
            return new
    return None


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return 0.0, 1.0
    p = k / n
    c, s = p + z * z / (2 * n), z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5)
    d = 1 + z * z / n
    return max(0.0, (c - s) / d), min(1.0, (c + s) / d)


class PerEntryThreshold:
    """A vCache-style decision: a threshold per cached task from its own checks, no error bound across tasks."""

    def __init__(self, seed: int = 1, min_agreed: int = 3, explore: float = 0.1):
        self.checks: dict[str, list[tuple[float, bool]]] = {}
        self.rng, self.min_agreed, self.explore = random.Random(seed), min_agreed, explore

    def serve(self, task: str, sim: float) -> bool:
        got = self.checks.get(task, [])
        if any(not ok and s >= sim for s, ok in got):  # it was wrong at this similarity or above
            return False
        agreed = sum(ok and s <= sim for s, ok in got)  # it was right at this similarity or below
        return agreed >= self.min_agreed and self.rng.random() >= self.explore

    def record(self, task: str, sim: float, ok: bool) -> None:
        self.checks.setdefault(task, []).append((sim, ok))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="simllm-bench error_bound", description=__doc__.split("\n")[0])
    ap.add_argument("--intents", type=int, default=8)
    ap.add_argument("--per-intent", type=int, default=4)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, "error_bound.json"))
    a = ap.parse_args(argv)

    # local: torch and the engine load when a run starts: --help goes without them
    import torch

    torch.set_num_threads(a.threads)
    # local: the engine, kv_pool and model_backend import torch (loaded when a run starts)
    from simllm_ros.serving.engine import Engine
    from simllm_ros.cache.kv_pool import task_id
    from simllm_ros.model.model_backend import auto_dtype

    lossless = dict(dtype="bfloat16", kv_bits=0) if auto_dtype("cpu")[0] == "bfloat16" else \
        dict(dtype="float32", kv_bits=32)
    path = os.path.join(ROOT, "..", "shared", "data", "clinc150", "train.jsonl")
    by_intent: dict[str, list[str]] = {}
    with open(path) as f:
        for line in f:
            d = json.loads(line)
            by_intent.setdefault(d["intent"], []).append(d["text"])
    rng = random.Random(7)
    intents = [i for i in sorted(by_intent) if sum(trap_of(t) is not None for t in by_intent[i]) >= 2]
    rng.shuffle(intents)
    questions, kinds = [], {}
    for intent in intents[:a.intents]:
        phr = [t for t in by_intent[intent] if len(t.split()) >= 4][:a.per_intent]
        for t in phr:
            questions.append(t)
            kinds[t] = "paraphrase"
        for trap in [swapped for swapped in map(trap_of, by_intent[intent]) if swapped][:2]:
            questions.append(trap)
            kinds[trap] = "trap"
    stream = questions + rng.sample(questions, len(questions))

    base = Engine(Settings.from_overrides(cache_size="512MB", **lossless))
    base.load(lambda m: None)

    def req(q):
        return QueryRequest(prompt=q, cache_scope="kiosk", max_new_tokens=a.new, allow_approximate=True)

    ref_engine = base.fork(base.settings.replace(approx_error_bound=0.0, answer_memo=False))
    reference = {}
    for q in sorted(set(stream)):
        ref_engine.clear_pool()
        reference[q] = ref_engine.handle(req(q)).answer
    ref_engine.unload()

    configs = [("lossless", dict(approx_error_bound=0.0))]
    for threshold in (0.9, 0.95):
        configs.append((f"fixed {threshold:.2f}", dict(approx_error_bound=1.0, answer_threshold=threshold,
                                                       cache_threshold=0.8)))
    for d in (0.01, 0.02, 0.05, 0.1):
        configs.append((f"bound {d:g}", dict(approx_error_bound=d, answer_threshold=0.6, cache_threshold=0.6)))
    rows: list[dict] = []
    for name, kw in configs:
        e = base.fork(base.settings.replace(enable_answer_cache=True, answer_max_age_s=1e6, **kw))
        e.error_bound = ErrorBound(seed=1)
        approx = differ_approx = differ_all = 0
        trap_wrong = 0
        times = []
        for q in stream:
            r = e.handle(req(q))
            assert r.success, r.error
            times.append(r.total_ms)
            wrong = r.answer != reference[q]
            differ_all += wrong
            if r.cache_result in (CacheResult.SEMANTIC, CacheResult.ANSWER):
                approx += 1
                differ_approx += wrong
                trap_wrong += wrong and kinds[q] == "trap"
            while e.has_idle_work():
                e.idle_work()
        lo, hi = wilson(differ_approx, approx)
        rows.append({"config": name, "requests": len(stream), "approximate": approx,
                     "approx_share": approx / len(stream), "approx_differ": differ_approx,
                     "approx_differ_rate": differ_approx / approx if approx else 0.0, "ci95": [lo, hi],
                     "all_differ": differ_all, "traps_served_wrong": trap_wrong,
                     "mean_ms": statistics.mean(times), "p95_ms": sorted(times)[int(0.95 * (len(times) - 1))],
                     "labels": len(e.error_bound)})
        print(json.dumps(rows[-1]), flush=True)
        e.unload()

    # the vCache-style per-entry policy: the engine answers exactly (no approximate tier of its own), the policy
    # serves a candidate's stored answer where its task's own checks allow
    e = base.fork(base.settings.replace(approx_error_bound=0.0))
    pool = e.loaded_pool()
    policy = PerEntryThreshold()
    approx = differ_approx = differ_all = trap_wrong = 0
    times = []
    for q in stream:
        t0 = time.perf_counter()
        fp = e.embed([q])[0]
        cand = next((m for m in pool.best_matches(fp, "kiosk", time.time(), k=3, recency_weight=0.0,
                                                   half_life_s=600.0)
                     if m.entry.answer and m.cosine >= 0.6), None)
        task = task_id(cand.entry.scope, cand.entry.tokens) if cand is not None else ""
        if cand is not None and policy.serve(task, cand.cosine):
            answer = cand.entry.answer
            times.append((time.perf_counter() - t0) * 1000)
            approx += 1
            wrong = answer != reference[q]
            differ_approx += wrong
            trap_wrong += wrong and kinds[q] == "trap"
        else:
            r = e.handle(req(q))
            assert r.success, r.error
            times.append((time.perf_counter() - t0) * 1000)  # the policy's fingerprint and match, then the model
            answer = r.answer
            wrong = answer != reference[q]
            if cand is not None:
                policy.record(task, cand.cosine, cand.entry.answer == r.answer)
        differ_all += wrong
        while e.has_idle_work():
            e.idle_work()
    lo, hi = wilson(differ_approx, approx)
    rows.append({"config": "per-entry (vCache-style)", "requests": len(stream), "approximate": approx,
                 "approx_share": approx / len(stream), "approx_differ": differ_approx,
                 "approx_differ_rate": differ_approx / approx if approx else 0.0, "ci95": [lo, hi],
                 "all_differ": differ_all, "traps_served_wrong": trap_wrong,
                 "mean_ms": statistics.mean(times), "p95_ms": sorted(times)[int(0.95 * (len(times) - 1))],
                 "labels": sum(len(v) for v in policy.checks.values())})
    print(json.dumps(rows[-1]), flush=True)
    e.unload()
    base.unload()
    report = {"questions": len(questions), "traps": sum(k == "trap" for k in kinds.values()),
              "stream": len(stream), "new_tokens": a.new, "rows": rows}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    print("\n| config | approximate | differ among approximate (95% CI) | all answers differing | traps served wrong "
          "| mean ms | p95 ms |\n|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['config']} | {row['approximate']}/{row['requests']} | {row['approx_differ']} "
              f"({100 * row['approx_differ_rate']:.0f}%, {100 * row['ci95'][0]:.0f}-{100 * row['ci95'][1]:.0f}%) "
              f"| {row['all_differ']} | {row['traps_served_wrong']} | {row['mean_ms']:.0f} | {row['p95_ms']:.0f} |")


if __name__ == "__main__":
    main()
