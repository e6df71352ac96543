#!/usr/bin/env python3
"""Load times of a GGUF, two checkouts side by side: each run loads the file with `Engine.load()` in a fresh
process, first into an empty `model_cache_dir` (convert, check, pack: a first load), then again from that folder
(the packed file mapped: a later load); the checkouts alternate (A, B, A, B, ...) at each thread count, so both
see the same moments of a shared machine. Per load: wall seconds from after the imports, the process's CPU
seconds, peak RSS (VmHWM), and the seconds between the load's progress lines (where the time went).

    .venv/bin/python scripts/load_times.py --file F.gguf --old /path/to/old-checkout --new . \
        [--threads 1,2] [--runs 2] [--packed-only] [--profile out.prof]

--packed-only: the first load runs once per checkout (untimed), then only later loads are compared.
--profile: each first load of --new under cProfile, its stats written there (one file per run).
Prints a markdown table of the figures and, per load, its progress lines with their times.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

WORKER = r"""
import json, os, resource, sys, time
t_import = time.perf_counter()
import torch
torch.set_num_threads(int(sys.argv[3]))
from simllm_ros.serving.engine import Engine
from simllm_ros.settings import Settings
lines = []
t0 = time.perf_counter()
cpu0 = time.process_time()
def progress(msg):
    lines.append((round(time.perf_counter() - t0, 2), msg))
    print(f"[{lines[-1][0]:7.2f}] {msg}", file=sys.stderr, flush=True)
e = Engine(Settings.from_overrides(model=sys.argv[1], model_cache_dir=sys.argv[2], compute_threads=int(sys.argv[3]),
                                   cache_size="256MB", enable_semantic_reuse=False))
prof = sys.argv[4] if len(sys.argv) > 4 else ""
if prof:
    import cProfile
    p = cProfile.Profile()
    p.enable()
e.load(progress)
if prof:
    p.disable()
    p.dump_stats(prof)
wall = time.perf_counter() - t0
cpu = time.process_time() - cpu0
peak = 0
with open("/proc/self/status") as f:
    for line in f:
        if line.startswith("VmHWM:"):
            peak = int(line.split()[1]) // 1024
print("RESULT " + json.dumps({"wall": wall, "cpu": cpu, "peak_mb": peak, "imports": t0 - t_import,
                              "digest": e.backend.numerics, "exact": e.backend.exact_chunking, "lines": lines}),
      flush=True)
"""


def run_load(tree: str, model: str, cache: str, threads: int, profile: str = "") -> dict:
    env = dict(os.environ, PYTHONPATH=tree, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [sys.executable, "-c", WORKER, model, cache, str(threads)] + ([profile] if profile else [])
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree)
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"load in {tree} failed (rc {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")


def load_average() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", required=True)
    ap.add_argument("--old", required=True, help="the checkout to compare against (a git worktree of main)")
    ap.add_argument("--new", default=".")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--packed-only", action="store_true")
    ap.add_argument("--profile", default="")
    ap.add_argument("--keep", default="", help="a folder for the model_cache_dirs (kept); a temporary one else")
    args = ap.parse_args()
    trees = {"old": os.path.abspath(args.old), "new": os.path.abspath(args.new)}
    for name, tree in trees.items():
        commit = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", tree, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        print(f"{name}: {tree} at {commit}{' (with uncommitted changes)' if dirty else ''}", flush=True)
    base = args.keep or tempfile.mkdtemp(prefix="load_times-")
    rows = []
    packed_dirs: dict[str, str] = {}
    if args.packed_only:
        for name, tree in trees.items():
            packed_dirs[name] = os.path.join(base, f"{name}-packed")
            shutil.rmtree(packed_dirs[name], ignore_errors=True)
            run_load(tree, args.file, packed_dirs[name], 1)
    for threads in [int(t) for t in args.threads.split(",")]:
        for run in range(1, args.runs + 1):
            for name, tree in trees.items():
                row = {"tree": name, "threads": threads, "run": run, "load_before": load_average()}
                if not args.packed_only:
                    cache = os.path.join(base, f"{name}-t{threads}-r{run}")
                    shutil.rmtree(cache, ignore_errors=True)
                    prof = f"{args.profile}.t{threads}.r{run}" if args.profile and name == "new" else ""
                    row["first"] = run_load(tree, args.file, cache, threads, prof)
                else:
                    cache = packed_dirs[name]
                row["packed"] = run_load(tree, args.file, cache, threads)
                row["load_after"] = load_average()
                rows.append(row)
                with open(os.path.join(base, "rows.jsonl"), "a") as f:  # what a cut-short run leaves
                    f.write(json.dumps(row) + "\n")
                first = row.get("first")
                print(f"{name} t{threads} r{run}: "
                      + (f"first {first['wall']:.1f} s (cpu {first['cpu']:.1f}, {first['peak_mb']} MB), " if first
                         else "")
                      + f"packed {row['packed']['wall']:.2f} s (cpu {row['packed']['cpu']:.1f}, "
                      f"{row['packed']['peak_mb']} MB); load average {row['load_before']} -> {row['load_after']}",
                      flush=True)
                if not args.keep and not args.packed_only:
                    shutil.rmtree(cache, ignore_errors=True)
    if not args.keep:  # the packed copies (GBs each) and rows.jsonl: only a cut-short run leaves them
        shutil.rmtree(base, ignore_errors=True)
    digests = {(r["tree"], r["packed"]["digest"], r["packed"]["exact"]) for r in rows}
    print(f"\nnumerics digests (tree, digest, exact): {sorted(digests)}")
    print(f"\n{os.path.basename(args.file)} ({os.path.getsize(args.file) / 2**20:.0f} MiB); seconds from after the "
          "imports; old / new")
    print("| threads | run | first load (s) | its CPU (s) | packed load (s) | its CPU (s) | peak RSS first (MB) | "
          "load average |\n|---|---|---|---|---|---|---|---|")
    for threads in sorted({r["threads"] for r in rows}):
        for run in range(1, args.runs + 1):
            pair = {r["tree"]: r for r in rows if r["threads"] == threads and r["run"] == run}
            if len(pair) < 2:
                continue
            o, n = pair["old"], pair["new"]
            def f(k: str, part: str, fmt: str, o: dict = o, n: dict = n) -> str:
                return f"{o[part][k]:{fmt}} / {n[part][k]:{fmt}}" if part in o else "-"

            print(f"| {threads} | {run} | {f('wall', 'first', '.1f')} | {f('cpu', 'first', '.1f')} | "
                  f"{f('wall', 'packed', '.2f')} | {f('cpu', 'packed', '.1f')} | {f('peak_mb', 'first', 'd')} | "
                  f"{o['load_before']} / {n['load_before']} |")
    for r in rows:
        for part in ("first", "packed"):
            if part in r:
                print(f"\n{r['tree']} t{r['threads']} r{r['run']} {part}:")
                prev = 0.0
                for t, msg in r[part]["lines"]:
                    print(f"  {t:7.2f} (+{t - prev:5.2f}) {msg[:150]}")
                    prev = t


if __name__ == "__main__":
    main()
