"""The whole answer on a cache hit: simllm_ros against llama.cpp on the same GGUF, side by side.

Workload: a ~560-token prompt (system prompt + a local bulletin + a question), real CLINC150
questions, 32-token answers, greedy. For each question, in this order, interleaved across systems:
  hit    - a new question on a context the system has already seen (the context is cached)
  repeat - the same question again (for simllm_ros: its stored answer becomes a verified draft)
  miss   - (each system's references, run first) the question alone on an empty pool, no drafts
Systems: simllm_ros at its defaults (dtype auto: bf16 where our AMX kernels run, else float32; weight_bits auto:
the file's own 4-bit weights; lossless KV, verified drafts), the same without drafts, with 16-bit weights
(weight_bits=16), where the default is bf16 with int8 weights (weight_bits=8) and in float32, and where float32
was chosen over a native bf16 (AVX512_BF16 without AMX) in bf16 (4- and 8-bit weights); llama.cpp (llama-cpp-python,
same GGUF file, its prompt cache), if installed. Every simllm_ros configuration is also run with an empty pool and
no drafts, and its cached answers are compared with those (identical-answer share).

Also measured: the exact-hit overhead over the model's own limit (prefilling only the uncached
tokens into a KV buffer that already holds the prefix) at 250 / 500 / 1000-token contexts, and the
matcher at 10k / 100k / 1M fingerprints (simllm-bench matcher's scan against index).

Run: .venv/bin/simllm-bench verified_decoding [--threads 1] [--questions 8] [--smoke]
Writes benchmark/results/verified_decoding.md (and prints it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from simllm_ros.serving.engine import Engine
from simllm_ros.model.model_backend import native_bf16
from simllm_ros.request import QueryRequest
from simllm_ros.workloads import find_clinc

from .shared import (BULLETIN, RESULTS_DIR, LlamaCpp, SimSystem, finish_report, matcher_report, matcher_scaling,
                     offline)

offline()

INTENTS = ("weather", "traffic", "directions", "gas", "distance", "uber", "restaurant_suggestion", "how_busy",
           "timer", "current_location", "calendar", "travel_suggestion")


def questions(n: int) -> list[str]:
    by = {}
    with open(find_clinc(), encoding="utf-8") as f:
        for line in f:
            d = json.loads(line)
            if d["intent"] in INTENTS and d["intent"] not in by:
                by[d["intent"]] = d["text"]
    return [by[i] for i in INTENTS if i in by][:n]


def ms_per_token(rows) -> float:
    vals = [(r["total"] - r["ttft"]) / (r["n"] - 1) for r in rows if r["n"] > 1]
    return statistics.median(vals) if vals else float("nan")


def med(rows, key) -> float:
    return statistics.median(r[key] for r in rows) if rows else float("nan")


OVERHEAD_QUESTIONS = ("is it going to rain today", "where can I park my car", "when does the pharmacy open",
                      "how late does bus 12 run", "is the harbour bridge open")


def hit_overhead(engine: Engine, sizes=(250, 500, 1000), reps: int = 5,
                 allow_approximate: bool = False) -> list[tuple[int, float, float]]:
    """Exact-hit TTFT minus the model's own limit (prefilling only the new tokens on a KV buffer that
    already holds the cached prefix), per context size. allow_approximate False is the ROS default: the plan
    does not wait for the fingerprint; True: it does (SEMANTIC and ANSWER need it)."""
    b, out = engine.loaded_backend(), []
    words = (BULLETIN * 4).split()
    for size in sizes:
        ctx = " ".join(words[:int(size * 0.7)])
        engine.clear_pool()
        engine.settings = engine.settings.replace(max_prompt_tokens=4096, enable_drafts=False)
        engine.handle(QueryRequest(prompt="hello there", context=ctx, cache_scope="o", max_new_tokens=1))
        hits, limits = [], []
        for rep in range(reps):
            # A question not asked before in this process: its fingerprint is computed, not remembered.
            q = f"{OVERHEAD_QUESTIONS[rep % len(OVERHEAD_QUESTIONS)]} ({size} words, {rep}, {allow_approximate})"
            r = engine.handle(QueryRequest(prompt=q, context=ctx, cache_scope="o", max_new_tokens=1,
                                           allow_approximate=allow_approximate))
            engine.clear_pool()
            engine.handle(QueryRequest(prompt="hello there", context=ctx, cache_scope="o", max_new_tokens=1))
            hits.append(r.ttft_ms)
            ids = b.prompt_ids(engine.settings.system_prompt, ctx, q)
            n = r.reused_tokens  # 0 where nothing could be reused exactly: the limit is then a whole prefill
            logits, cache = b.prefill(ids[:n], reserve=len(ids)) if n else (None, b.new_cache(len(ids) + 2))
            t0 = time.perf_counter()
            logits, _ = b.prefill(ids[n:], cache)
            int(torch.argmax(logits))
            limits.append((time.perf_counter() - t0) * 1000)
        out.append((len(b.prompt_ids(engine.settings.system_prompt, ctx, q)), statistics.median(hits),
                    statistics.median(limits)))
    engine.settings = engine.settings.replace(max_prompt_tokens=1024, enable_drafts=True)
    engine.clear_pool()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--smoke", action="store_true", help="two questions, 8 tokens, defaults only, no peers")
    ap.add_argument("--device", default="cpu", help="the model's device (cuda: scripts/gpu_check.sh)")
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, "verified_decoding.md"))
    args = ap.parse_args(argv)

    def sim(name: str, **overrides) -> SimSystem:
        return SimSystem(name, device=args.device, **overrides)

    torch.set_num_threads(args.threads)
    nq, max_new = (2, 8) if args.smoke else (args.questions, args.max_new_tokens)
    qs = questions(nq)
    t_start = time.monotonic()
    default = sim("simllm_ros defaults")
    systems: list[SimSystem | LlamaCpp] = [default]
    b = default.engine.loaded_backend()
    default.name = f"simllm_ros defaults ({b.dtype_name}, {b.weight_bits}-bit weights, drafts)"
    if not args.smoke:
        systems += [sim("simllm_ros, drafts off", enable_drafts=False),
                    sim("simllm_ros, 16-bit weights", weight_bits=16)]
        if b.dtype_name != "float32":  # a bf16 default; on a CPU without native bf16 the default is float32 already,
            # and int8 weights need bf16
            systems += [sim("simllm_ros, int8 weights", weight_bits=8), sim("simllm_ros, float32", dtype="float32")]
        elif native_bf16():  # float32 chosen over a native bf16 (no AMX): show what bf16 would give here
            systems += [sim("simllm_ros, bfloat16", dtype="bfloat16", kv_bits=0),
                        sim("simllm_ros, bfloat16, int8 weights", dtype="bfloat16", kv_bits=0, weight_bits=8)]
        try:
            systems.append(LlamaCpp(b, default.engine.settings.system_prompt, args.threads))
        except ImportError as err:
            print(f"llama.cpp column skipped ({err}); pip install -r requirements-bench.txt")
    for s in systems:
        for q in qs:
            s.reference(q, max_new)
    rows: dict[str, dict[str, list[dict]]] = {s.name: {"hit": [], "repeat": []} for s in systems}
    warm = "what is happening in town today"
    for s in systems:
        s.ask(warm, max_new)  # the context is now cached (simllm pool / llama.cpp prompt cache and live KV)
    for q in qs:
        for kind in ("hit", "repeat"):
            for s in systems:
                r = s.ask(q, max_new)
                r["same"] = r["answer"] == s.ref[q]
                rows[s.name][kind].append(r)
    lines = [f"# Verified decoding: whole answers on cache hits ({time.strftime('%Y-%m-%d')})", "",
             f"{len(qs)} CLINC150 questions on a {rows[systems[0].name]['hit'][0]['prompt']}-token prompt, "
             f"up to {max_new} new tokens, greedy, {args.threads} thread(s), interleaved request by request; "
             f"medians. Machine: {os.cpu_count()} cores, shared, so compare within a row set, not across runs.", "",
             "| system | hit TTFT | hit total | repeat total | miss total | decode ms/token (hit) "
             "| tokens per pass (hit / repeat) | identical to its own no-cache answer |",
             "|---|---|---|---|---|---|---|---|"]
    for s in systems:
        h, rp = rows[s.name]["hit"], rows[s.name]["repeat"]
        tpp = lambda rr: sum(r["n"] for r in rr) / max(1, sum(max(r["passes"], 1) for r in rr))
        same = sum(r["same"] for r in h + rp)
        lines.append(f"| {s.name} | {med(h, 'ttft'):.0f} ms | {med(h, 'total'):.0f} ms | {med(rp, 'total'):.0f} ms "
                     f"| {statistics.median(s.miss):.0f} ms | {ms_per_token(h):.1f} | {tpp(h):.2f} / {tpp(rp):.2f} "
                     f"| {same}/{len(h + rp)} |")
    if any(isinstance(s, LlamaCpp) for s in systems):
        base = rows[systems[-1].name]
        lines += ["", "Ratios to llama.cpp (lower is better):", ""]
        for s in systems[:-1]:
            h, rp = rows[s.name]["hit"], rows[s.name]["repeat"]
            lines.append(f"- {s.name}: hit total {med(h, 'total') / med(base['hit'], 'total'):.2f}x, repeat total "
                         f"{med(rp, 'total') / med(base['repeat'], 'total'):.2f}x, decode ms/token "
                         f"{ms_per_token(h) / ms_per_token(base['hit']):.2f}x, miss total "
                         f"{statistics.median(s.miss) / statistics.median(systems[-1].miss):.2f}x")
    sims = [s for s in systems if isinstance(s, SimSystem)]
    sixteen = next((s for s in sims if s.engine.loaded_backend().weight_bits == 16
                    and s.engine.loaded_backend().dtype_name != "float32"), None)
    others = [s for s in sims if s.engine.loaded_backend().weight_bits != 16]
    if sixteen is not None and others:
        lines += ["", f"Answers with other weights against {sixteen.name}'s (no-cache answers, same questions): a "
                  "different arithmetic, not a cache effect (simllm-bench fidelity compares each with float32):", ""]
        for s in others:
            same16 = sum(s.ref[q] == sixteen.ref[q] for q in qs)
            lines.append(f"- {s.name}: {same16}/{len(qs)} identical")
    e = default.engine
    d = rows[systems[0].name]
    acc = sum(r["accepted"] for r in d["hit"] + d["repeat"])
    prop = sum(r["proposed"] for r in d["hit"] + d["repeat"])
    lines += ["", f"Defaults: {acc}/{prop} draft tokens accepted; every answer reported exact: "
              f"{all(r['exact'] for r in d['hit'] + d['repeat'])}; "
              f"backend batch-invariant: {e.loaded_backend().exact_chunking}."]
    if not args.smoke:
        lines += ["", "Exact-hit overhead over the model's limit (defaults, drafts off, 1 new token, "
                  "a new question each time):", "",
                  "| caller | prompt tokens | hit TTFT | limit (prefill of the new tokens only) | overhead |",
                  "|---|---|---|---|---|"]
        for approx in (False, True):
            who = "approximate allowed (plan waits for the fingerprint)" if approx else "lossless only (ROS default)"
            for n, hit, limit in hit_overhead(e, allow_approximate=approx):
                lines.append(f"| {who} | {n} | {hit:.1f} ms | {limit:.1f} ms | {hit - limit:.1f} ms |")
        lines += [""] + matcher_report(matcher_scaling((10_000, 100_000, 1_000_000)), None)
        lines += ["", "(The index's recall on real fingerprints: simllm-bench matcher.)"]
    finish_report(lines, t_start, None if args.smoke else args.out)


if __name__ == "__main__":
    main()
