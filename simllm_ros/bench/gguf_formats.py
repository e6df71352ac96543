"""A user's kind of file at a real size: a Q4_K_M GGUF of a ~0.45B Llama shape (random blocks, SmolLM2's tokenizer;
test/random_gguf.py) on our float32 path at the file's own bits (gguf_weights: Q4_K, Q6_K blocks on the vector
kernel) against the 16-bit path the same file took before (dequantized float32 weights, torch's products), side by
side in one process; and llama.cpp (llama-cpp-python) on the same file where it is installed.

Measures a prefill of --prompt tokens and greedy decode ms/token over --new tokens, at --threads threads (1: the
issue's table). Usage: .venv/bin/simllm-bench gguf_formats [--layers 32 --hidden 1024 ...]"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from simllm_ros.model.model_backend import ModelBackend
from .shared import use_test_helpers

use_test_helpers()  # random_gguf: writes the file

import torch  # noqa: E402

from random_gguf import Q4_K_M, write_llama  # noqa: E402


def _ours(path, cache_dir, weight_bits, ids, new):
    t0 = time.perf_counter()
    b = ModelBackend(path, dtype="float32", weight_bits=weight_bits, cache_dir=cache_dir, progress=print)
    load = time.perf_counter() - t0
    label = f"simllm_ros weight_bits={b.weight_bits}" + (" (file's own blocks)" if b.runner and b.runner.file else "")
    print(f"{label}: loaded in {load:.1f} s; products: {b.int4_path}; exact={b.exact_chunking}", flush=True)
    best_prefill, best_decode, toks = float("inf"), float("inf"), None
    for _ in range(2):
        cache = b.new_cache(len(ids) + new + 2)
        t0 = time.perf_counter()
        logits = b.run(ids, cache, logits="last")
        best_prefill = min(best_prefill, time.perf_counter() - t0)
        out = []
        t0 = time.perf_counter()
        for _ in range(new):
            tok = int(logits.reshape(-1, logits.shape[-1])[-1].argmax())
            out.append(tok)
            logits = b.run([tok], cache, logits="last")
        best_decode = min(best_decode, (time.perf_counter() - t0) / new * 1000)
        toks = out
    del b
    print(f"{label}: prefill {best_prefill:.2f} s, decode {best_decode:.1f} ms/token", flush=True)
    return label, best_prefill, best_decode, toks


def _llama_cpp(path, ids, new, threads):
    # local: llama_cpp is optional (requirements-bench.txt); main reports it missing
    from llama_cpp import Llama

    t0 = time.perf_counter()
    llm = Llama(model_path=path, n_ctx=len(ids) + new + 8, n_batch=512, n_threads=threads, n_threads_batch=threads,
                verbose=False)
    load = time.perf_counter() - t0
    print(f"llama.cpp: loaded in {load:.1f} s", flush=True)
    best_prefill, best_decode, toks = float("inf"), float("inf"), None
    for _ in range(2):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        best_prefill = min(best_prefill, time.perf_counter() - t0)
        out = []
        t0 = time.perf_counter()
        for _ in range(new):
            tok = int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))  # last row
            out.append(tok)
            llm.eval([tok])
        best_decode = min(best_decode, (time.perf_counter() - t0) / new * 1000)
        toks = out
    return "llama.cpp", best_prefill, best_decode, toks


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=os.path.join(os.path.expanduser("~"), ".cache", "simllm_ros", "bench-gguf"))
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=2816)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-16bit", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.makedirs(args.dir, exist_ok=True)
    name = f"rand-llama-{args.layers}x{args.hidden}-{args.inter}-{args.heads}-{args.kv_heads}-q4_k_m.gguf"
    path = os.path.join(args.dir, name)
    if not os.path.exists(path):
        t0 = time.perf_counter()
        write_llama(path + ".tmp", layers=args.layers, hidden=args.hidden, inter=args.inter, heads=args.heads,
                    kv_heads=args.kv_heads, types=Q4_K_M)
        os.replace(path + ".tmp", path)
        print(f"wrote {path} ({os.path.getsize(path) / 2**20:.0f} MiB) in {time.perf_counter() - t0:.1f} s")
    ids = [(101 + 97 * i) % 49000 + 10 for i in range(args.prompt)]
    rows = [_ours(path, os.path.join(args.dir, "models"), 0, ids, args.new)]
    if not args.skip_16bit:
        rows.append(_ours(path, os.path.join(args.dir, "models"), 16, ids, args.new))
    try:
        import llama_cpp  # noqa: F401  (local: llama_cpp is optional; the row is left out where it is missing)
        rows.append(_llama_cpp(path, ids, args.new, args.threads))
    except ImportError:
        print("llama.cpp: llama-cpp-python is not installed")
    print(f"\n{os.path.basename(path)} ({os.path.getsize(path) / 2**20:.0f} MiB), {args.prompt}-token prompt, "
          f"{args.new} greedy tokens, {args.threads} thread(s)")
    print(f"{'path':48s} {'prefill s':>10s} {'decode ms/tok':>14s}  first tokens")
    for label, pre, dec, toks in rows:
        print(f"{label:48s} {pre:10.2f} {dec:14.1f}  {toks[:6]}")


if __name__ == "__main__":
    main()
