"""SEMANTIC time to first token against a cold run of the same request, at the default settings but the error bound.

The 20 CLINC150 paraphrase pairs of test/cache/test_semantic_quality.py (cosine 0.82-0.95): the first phrasing
runs with the bulletin, then the second with the revised bulletin (times and numbers changed) in the same
scope (a SEMANTIC hit, `allow_approximate`), and the second once more in a scope of its own (a cold run).
Each pair is measured twice in fresh scopes, interleaved (hit, cold, hit, cold), and its ratio is the median
hit over the median cold, so that a slow moment of this shared machine does not land on one side only.
Hit and cold start from the same fingerprint state, in two rounds: "new question" (the embedder's memory is
cleared before each: both compute the question's fingerprint, as a question never seen before does) and
"remembered" (the fingerprint is remembered for both: the repair against the prefill alone).
Also printed: tokens reused and recomputed, and greedy token agreement of the hit with the cold answer.

Run: .venv/bin/simllm-bench semantic_ttft [--threads 1] [--pairs 20] [--tokens 8] [--model PATH]
(--model: a GGUF or model folder instead of the embedded model, e.g. the real Gemma 3 270M file)
"""
from __future__ import annotations

import argparse
import statistics
import time

from .shared import offline, use_test_helpers

offline()
use_test_helpers()  # the pairs and bulletins of the quality test

import torch  # noqa: E402

from core_fixtures import BULLETIN, BULLETIN_REVISED  # noqa: E402
from simllm_ros.serving.engine import Engine  # noqa: E402
from simllm_ros.request import CacheResult, QueryRequest  # noqa: E402
from simllm_ros.settings import Settings  # noqa: E402
from paraphrase_pairs import select_pairs  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pairs", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--model", default="", help="a GGUF file or model folder (default: the embedded model)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.monotonic()
    # The tier on its fixed thresholds (approx_error_bound 1): with the default bound, a node without verified
    # labels yet serves every request losslessly; the bound has its own benchmark (error_bound).
    e = Engine(Settings.from_overrides(cache_size="512MB", approx_error_bound=1.0,
                                       **({"model": args.model} if args.model else {})))
    e.load(progress=lambda m: None)
    pairs = select_pairs(e.fingerprinter)[:args.pairs]

    def ask(q, ctx, scope, **kw):
        return e.handle(QueryRequest(prompt=q, context=ctx, cache_scope=scope, max_new_tokens=args.tokens, **kw))

    def timed(q2, scope, mode):
        """One timed request, from the fingerprint state `mode` names."""
        if mode == "new question":
            e.fingerprinter.forget()
        else:
            e.fingerprinter.embed([q2])
        return ask(q2, BULLETIN_REVISED, scope, allow_approximate=True)

    summary = {}
    for mode in ("new question", "remembered"):
        print(f"\n-- fingerprint: {mode}", flush=True)
        rows = []
        for i, (intent, q1, q2, cos) in enumerate(pairs):
            hits, colds = [], []
            for rep in range(2):
                scope = f"{mode[:3]}-pair{i}-{rep}"
                ask(q1, BULLETIN, scope)
                hits.append(timed(q2, scope, mode))
                colds.append(timed(q2, f"{mode[:3]}-cold{i}-{rep}", mode))
            if any(h.cache_result != CacheResult.SEMANTIC for h in hits) or \
                    any(c.cache_result != CacheResult.MISS for c in colds):
                print(f"{intent:22s} not a SEMANTIC hit: {[h.cache_result.name for h in hits]}", flush=True)
                continue
            ratio = statistics.median(h.ttft_ms for h in hits) / statistics.median(c.ttft_ms for c in colds)
            same = sum(a == b for a, b in zip(hits[0].answer.split(), colds[0].answer.split()))
            rows.append((intent, ratio, hits[0].reused_tokens, hits[0].recomputed_tokens,
                         statistics.median(h.ttft_ms for h in hits), statistics.median(c.ttft_ms for c in colds),
                         hits[0].answer == colds[0].answer))
            print(f"{intent:22s} cos {cos:.2f}  hit {rows[-1][4]:6.1f} ms  cold {rows[-1][5]:6.1f} ms  "
                  f"ratio {ratio:.3f}  reused {rows[-1][2]}  recomputed {rows[-1][3]}  same answer {rows[-1][6]} "
                  f"({same} words alike)", flush=True)
        ratios = [r[1] for r in rows]
        summary[mode] = (f"median {statistics.median(ratios):.3f}, mean {statistics.mean(ratios):.3f}, range "
                         f"{min(ratios):.3f}-{max(ratios):.3f} (hit ~{statistics.median(r[4] for r in rows):.0f} ms, "
                         f"cold ~{statistics.median(r[5] for r in rows):.0f} ms); same answer as cold: "
                         f"{sum(r[6] for r in rows)}/{len(rows)}")
    backend = e.loaded_backend()
    print(f"\nSEMANTIC TTFT / cold TTFT over {len(pairs)} pairs, {backend.model_type}, "
          f"weights {backend.weight_bits}-bit, "
          f"{backend.dtype}, {args.threads} thread(s):")
    for mode, line in summary.items():
        print(f"  fingerprint {mode:12s}: {line}")
    print(f"Wall time {time.monotonic() - t_start:.0f} s.")

if __name__ == "__main__":
    main()
