"""Fidelity: how often do different ways of running the same model file give the same greedy answer?

No cache anywhere (empty pool, drafts off): this measures the arithmetic, not the cache. The embedded
model is a Q4_1 GGUF; float32 with its dequantized weights is the most precise way to run it, so each
configuration is compared with float32 (and with every other): identical answers, and the share of
tokens before the first difference. The questions are the first CLINC150 question of every N-th
intent (all 150 intents, not the benchmark's robot intents), asked about the same bulletin.

Run: .venv/bin/simllm-bench fidelity [--questions 24] [--max-new-tokens 32] [--threads 1] [--smoke]
"""
from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch

from simllm_ros.cache.block_pool import common_prefix
from simllm_ros.workloads import find_clinc

from .shared import RESULTS_DIR, LlamaCpp, SimSystem, finish_report, offline

offline()

CONFIGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("float32", dict(dtype="float32")),
    ("bf16, 16-bit weights", dict(dtype="bfloat16", weight_bits=16)),
    ("defaults (bf16, weight_bits auto)", dict()),
    ("bf16, int8 weights", dict(dtype="bfloat16", weight_bits=8)))


def spread_questions(n: int) -> list[str]:
    first: dict[str, str] = {}
    with open(find_clinc(), encoding="utf-8") as f:
        for line in f:
            d = json.loads(line)
            first.setdefault(d["intent"], d["text"])
    qs = list(first.values())
    return qs[::max(1, len(qs) // n)][:n]


def prefix_share(a: list[int], b: list[int]) -> float:
    return common_prefix(a, b) / max(len(a), len(b), 1)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--questions", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, "fidelity.md"))
    ap.add_argument("--smoke", action="store_true", help="2 questions, 4 tokens, float32 and defaults, no llama.cpp, "
                    "no report file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.smoke:
        args.questions, args.max_new_tokens = 2, 4
    configs = [c for c in CONFIGS if not args.smoke or c[0] in ("float32", "defaults (bf16, weight_bits auto)")]
    qs = spread_questions(args.questions)
    t0 = time.monotonic()
    answers: dict[str, list[list[int]]] = {}
    last: SimSystem | None = None
    for name, overrides in configs:
        if last is not None:
            last.engine.unload()  # one model in memory at a time
        last = SimSystem(name, **overrides)
        backend = last.engine.loaded_backend()
        if not overrides:
            name = f"defaults ({backend.dtype_name}, weight_bits auto: {backend.weight_bits})"
        answers[name] = [backend.tokenizer.encode(last.reference(q, args.max_new_tokens), add_special_tokens=False)
                         for q in qs]
        print(f"{name}: {time.monotonic() - t0:.0f} s", flush=True)
    if last is None:
        raise SystemExit("no configuration was run")
    backend = last.engine.loaded_backend()
    tokenizer = backend.tokenizer
    try:
        if args.smoke:
            raise ImportError("--smoke")
        llama = LlamaCpp(backend, last.engine.settings.system_prompt, args.threads)
        answers["llama.cpp (same GGUF)"] = [tokenizer.encode(llama.reference(q, args.max_new_tokens),
                                                             add_special_tokens=False) for q in qs]
    except ImportError as e:
        print(f"llama.cpp skipped ({e}); pip install -r requirements-bench.txt")
    names = list(answers)
    lines = [f"# Fidelity: same model file, different arithmetic ({time.strftime('%Y-%m-%d')})", "",
             f"{len(qs)} CLINC150 questions (one per {150 // max(1, len(qs))} intents) on the bulletin, up to "
             f"{args.max_new_tokens} new tokens, greedy, empty pool, drafts off, {args.threads} thread(s). "
             "Cell: identical answers / share of tokens before the first difference (mean).", "",
             "| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for a in names:
        cells = []
        for b in names:
            same = sum(x == y for x, y in zip(answers[a], answers[b]))
            share = sum(prefix_share(x, y) for x, y in zip(answers[a], answers[b])) / len(qs)
            cells.append(f"{same}/{len(qs)}, {share:.2f}")
        lines.append(f"| {a} | " + " | ".join(cells) + " |")
    finish_report(lines, t0, None if args.smoke else args.out)


if __name__ == "__main__":
    main()
