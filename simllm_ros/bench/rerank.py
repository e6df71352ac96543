"""The ~/rerank service's ranking quality on a public set: clinc150 (real requests to an assistant, 150 intents).

Queries are the validation split's requests; candidates come from the train split, so no query is its own
candidate. A candidate is relevant when its intent is the query's. Two tasks, each through the service's own
code (simllm_ros.serving.rerank.rerank on the node's embedder, all-MiniLM-L6-v2 by default):
  exemplars   150 candidates, one train request per intent (the same for every query): rank 1 right = the
              intent found by its nearest exemplar
  same-domain 20 candidates: one other request of the query's intent and 19 of other intents of the same
              domain (banking, travel, auto_and_commute, ...): near misses, drawn per query
Printed per task: MRR (mean of 1 / rank of the relevant candidate), top-1 and top-5 accuracy, beside two
baselines on the same candidates: a random order (its expected MRR, exact) and TF-IDF cosine (words alone).
Also timed: one call of 150 fresh documents (the embedder remembers nothing of them) and one whose documents
were embedded before.

Usage: .venv/bin/simllm-bench rerank [--per-intent 20] [--pool 20] [--seed 7] [--out benchmark/results/rerank.md]"""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
import platform
import random
import re
import statistics
import time

from simllm_ros.serving.rerank import rerank
from simllm_ros.settings import DEFAULT_EMBEDDER
from simllm_ros.workloads import find_clinc
from .shared import RESULTS_DIR, finish_report, offline

offline()

SAME_DOMAIN_CANDIDATES = 20


def clinc_split(name: str, path: str = "") -> dict[str, list[str]]:
    """intent -> requests of the clinc150 split `name` ("train" or "val"), next to the train file found."""
    folder = os.path.dirname(find_clinc(path))
    out: dict[str, list[str]] = collections.defaultdict(list)
    with open(os.path.join(folder, f"{name}.jsonl"), encoding="utf-8") as f:
        for line in f:
            if line.strip():
                d = json.loads(line)
                out[d["intent"]].append(d["text"].strip())
    return dict(out)


def clinc_domains(path: str = "") -> dict[str, str]:
    """intent -> its domain (clinc150's domains.json)."""
    with open(os.path.join(os.path.dirname(find_clinc(path)), "domains.json"), encoding="utf-8") as f:
        return {intent: domain for domain, intents in json.load(f).items() for intent in intents}


def make_tasks(train: dict[str, list[str]], val: dict[str, list[str]], domains: dict[str, str],
               per_intent: int, seed: int, pool: int = 0) -> dict[str, list[tuple[str, list[str], list[bool]]]]:
    """task name -> [(query, candidates, relevant per candidate)], drawn with `seed` from the first `pool` train
    requests of each intent (0: all of them)."""
    rng = random.Random(seed)
    intents = sorted(set(train) & set(val))
    train = {i: train[i][:pool] if pool else train[i] for i in intents}
    exemplars = [(rng.choice(train[i]), i) for i in intents]
    by_domain: dict[str, list[str]] = collections.defaultdict(list)
    for i in intents:
        by_domain[domains[i]].append(i)
    tasks: dict[str, list] = {"exemplars": [], "same-domain": []}
    for intent in intents:
        for q in val[intent][:per_intent]:
            tasks["exemplars"].append((q, [t for t, _ in exemplars], [i == intent for _, i in exemplars]))
            others = [t for i in by_domain[domains[intent]] if i != intent for t in train[i]]
            negatives = rng.sample(others, min(len(others), SAME_DOMAIN_CANDIDATES - 1))
            docs = negatives + [rng.choice(train[intent])]
            rel = [False] * len(negatives) + [True]
            order = list(range(len(docs)))
            rng.shuffle(order)
            tasks["same-domain"].append((q, [docs[k] for k in order], [rel[k] for k in order]))
    return tasks


def first_relevant_rank(order: list[int], relevant: list[bool]) -> int:
    """1-based rank of the first relevant candidate in `order`."""
    return next(r for r, k in enumerate(order, 1) if relevant[k])


def random_mrr(n: int, m: int) -> float:
    """Expected 1 / rank of the first of m relevant among n candidates in a random order (exact)."""
    # P(first relevant at rank r) = C(n - r, m - 1) / C(n, m)
    total = math.comb(n, m)
    return sum(math.comb(n - r, m - 1) / total / r for r in range(1, n - m + 2))


_WORD = re.compile(r"[a-z0-9']+")


class Tfidf:
    """TF-IDF cosine over lowercased words, idf from the train split: a lexical baseline."""

    def __init__(self, corpus: list[str]):
        df: collections.Counter = collections.Counter()
        for t in corpus:
            df.update(set(_WORD.findall(t.lower())))
        self.idf = {w: math.log((1 + len(corpus)) / (1 + c)) + 1 for w, c in df.items()}
        self.default_idf = math.log(1 + len(corpus)) + 1

    def vector(self, text: str) -> dict[str, float]:
        tf = collections.Counter(_WORD.findall(text.lower()))
        v = {w: c * self.idf.get(w, self.default_idf) for w, c in tf.items()}
        norm = math.sqrt(sum(x * x for x in v.values())) or 1.0
        return {w: x / norm for w, x in v.items()}

    def order(self, query: str, docs: list[str]) -> list[int]:
        q = self.vector(query)
        scores = [sum(q.get(w, 0.0) * x for w, x in self.vector(d).items()) for d in docs]
        return sorted(range(len(docs)), key=lambda k: -scores[k])  # stable: ties keep the documents' order


def summarize(ranks: list[int]) -> dict:
    n = len(ranks)
    return {"queries": n, "mrr": sum(1 / r for r in ranks) / n, "top1": sum(r == 1 for r in ranks) / n,
            "top5": sum(r <= 5 for r in ranks) / n}


def evaluate(embedder, tasks: dict, tfidf: Tfidf | None = None) -> dict[str, dict]:
    """task -> {embedder: summary, tfidf: summary, random_mrr}; each query through rerank() as the service runs it."""
    out = {}
    for name, items in tasks.items():
        ours, lexical = [], []
        for q, docs, rel in items:
            ours.append(first_relevant_rank(rerank(embedder, q, docs).indices, rel))
            if tfidf is not None:
                lexical.append(first_relevant_rank(tfidf.order(q, docs), rel))
        n_docs, n_rel = len(items[0][1]), sum(items[0][2])
        out[name] = {"embedder": summarize(ours), "tfidf": summarize(lexical) if lexical else None,
                     "candidates": n_docs, "random_mrr": random_mrr(n_docs, n_rel)}
    return out


def time_calls(embedder, docs: list[str], queries: list[str]) -> dict:
    """Median ms of one rerank call of `docs`: fresh (the embedder remembers none of the texts) and remembered."""
    fresh, remembered = [], []
    for q in queries:
        embedder.forget()
        t = time.perf_counter()
        rerank(embedder, q, docs)
        fresh.append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        rerank(embedder, q + "?", docs)
        remembered.append((time.perf_counter() - t) * 1e3)
    return {"documents": len(docs), "fresh_ms": statistics.median(fresh),
            "remembered_ms": statistics.median(remembered)}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        name = ""
    return f"{name or platform.machine()} CPU"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="simllm-bench rerank", description=__doc__.split("\n")[0])
    ap.add_argument("--per-intent", type=int, default=20, help="validation requests per intent used as queries "
                                                                   "(20 = the whole split, 3000 queries)")
    ap.add_argument("--pool", type=int, default=20, help="train requests per intent the candidates are drawn from "
                                                        "(each is embedded once; 0 = all 100)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--embedder", default="", help="the embedder (default: the node's, all-MiniLM-L6-v2)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--timed-calls", type=int, default=5)
    ap.add_argument("--clinc", default="", help="clinc150 train.jsonl (default: ../shared/data/clinc150)")
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, "rerank.md"), help="report ('' = print only)")
    a = ap.parse_args(argv)

    # local: torch and the fingerprint model load when a run starts (the tests and --help go without)
    import torch

    torch.set_num_threads(a.threads)
    # local: fingerprint imports torch
    from simllm_ros.cache.fingerprint import Fingerprinter

    t0 = time.monotonic()
    train, val, domains = clinc_split("train", a.clinc), clinc_split("val", a.clinc), clinc_domains(a.clinc)
    tasks = make_tasks(train, val, domains, a.per_intent, a.seed, a.pool)
    # Remember every candidate: each is embedded once for the run (the service's memory holds 1024 texts).
    embedder = Fingerprinter(a.embedder or DEFAULT_EMBEDDER, remember=50_000)
    tfidf = Tfidf([t for texts in train.values() for t in texts])
    res = evaluate(embedder, tasks, tfidf)
    exemplar_docs = tasks["exemplars"][0][1]
    timing = time_calls(embedder, exemplar_docs, [q for q, _, _ in tasks["exemplars"][:a.timed_calls]])

    lines = [f"# ~/rerank on clinc150 ({time.strftime('%Y-%m-%d')})", "",
             (f"`simllm-bench rerank --per-intent {a.per_intent} --pool {a.pool} --seed {a.seed} "
              f"--threads {a.threads}`: "
              f"embedder {embedder.name} (the node's; cosine of its unit vectors, as the service ranks), "
              f"{cpu_name()}, {a.threads} torch thread(s). Queries: the validation split's requests "
              f"({a.per_intent} per intent); candidates: train-split requests (drawn from the first {a.pool or 100} of "
              f"each intent); relevant = same intent."), "",
             "| task | candidates | queries | MRR | top-1 | top-5 | TF-IDF MRR | TF-IDF top-1 | random MRR |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in res.items():
        e, t = r["embedder"], r["tfidf"]
        lines.append(f"| {name} | {r['candidates']} | {e['queries']} | {e['mrr']:.3f} | {e['top1']:.1%} | "
                     f"{e['top5']:.1%} | {t['mrr']:.3f} | {t['top1']:.1%} | {r['random_mrr']:.3f} |")
    lines += ["", ("exemplars: one train request per intent, the same 150 for every query (rank 1 right = the "
                   "intent found by its nearest exemplar). same-domain: one other request of the query's intent "
                   "among 19 requests of other intents of the same domain, drawn per query (near misses). Random "
                   "MRR: the expectation for a random order (exact)."), "",
              (f"One call of {timing['documents']} documents: {timing['fresh_ms']:.0f} ms fresh (every document "
               f"embedded), {timing['remembered_ms']:.0f} ms with the documents remembered (only the query "
               f"embedded); medians of {a.timed_calls} calls.")]
    finish_report(lines, t0, a.out or None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
