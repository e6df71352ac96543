"""Where a decode step's time goes, at 1..N threads, against what this machine's memory gives.

Per decode step of a GGUF file (after a ~--context-token prompt, nothing cached, greedy): the time in each product
(qkv, o, gate_up, down), attention, norms and residual adds, RoPE, the MLP's activation, the caller's wait for its
workers after its own share (layer_stack.h's and pool.h's counters, read from C), the LM head, the embedding and
final norm, the Python of a pass outside those, picking the token, and proposing a draft from the prompt (what the
engine's draft proposer does each step). Then the bytes a step reads (every weight once, the KV it attends) against
the read rate of 1..N threads over memory (membw.c, a STREAM-like read and copy): the floor memory sets a step, and
how near the step comes to it. With --llama, llama.cpp's decode on the same file and thread counts, side by side.

With --rows 1,2,4,8 also the batched pass: a decode pass of N rows (N requests on one prompt) against N single-row
passes, per part.

Usage: simllm-bench decode_profile --file model.gguf [--threads 1,2] [--steps 32] [--context 450] [--llama]
       [--rows 1,2,4,8]
       simllm-bench decode_profile --shape qwen2.5-1.5b --quant Q4_K_M   (a file of that shape, as gguf_models makes)
       simllm-bench decode_profile --shape qwen2.5-0.5b --quant random   (random Q4_K/Q6_K blocks, no llama.cpp)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from simllm_ros.request import QueryRequest
from simllm_ros.settings import Settings
from .shared import QUESTIONS, SHAPES, TIED, VOCAB, bulletin, make_file, run_worker_process, use_test_helpers


class _Timed:
    """A callable of the runner's (LM head, norm, embedding, C layers) that adds its wall time to `ns`."""

    def __init__(self, inner):
        self.inner, self.ns = inner, 0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter_ns()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.ns += time.perf_counter_ns() - t0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @classmethod
    def over(cls, owner, name: str) -> _Timed:
        """Puts a _Timed of owner.<name> in its place (an instance attribute, over a method too) and returns it."""
        timed = cls(getattr(owner, name))
        setattr(owner, name, timed)
        return timed


def random_file(shape: str, folder: str) -> str:
    """A file of `shape` (gguf_models.SHAPES) with random Q4_K projections, Q6_K attn_v / ffn_down and a Q6_K
    embedding (Q4_K_M's mix), written without llama.cpp."""
    use_test_helpers()
    # local: a test helper, importable once use_test_helpers() put test/ on sys.path
    from random_gguf import write_llama

    layers, hidden, inter, heads, kv, arch, head_dim = SHAPES[shape]
    if hidden % 256 or inter % 256:
        raise SystemExit(f"{shape}: rows of {hidden} / {inter} are not in K-quant super-blocks of 256; "
                         "use --quant Q4_K_M (llama.cpp's quantizer picks other types for those)")
    path = os.path.join(folder, f"randblocks-{shape}-{arch}-q4k-mix.gguf")
    if not os.path.exists(path):
        write_llama(path + ".tmp", layers=layers, hidden=hidden, inter=inter, heads=heads, kv_heads=kv,
                    default="Q4_K", types={"attn_v": "Q6_K", "ffn_down": "Q6_K"}, embed="Q6_K",
                    output=None if shape in TIED else "Q6_K", arch=arch, head_dim=head_dim,
                    pad_vocab=VOCAB.get(shape))
        os.replace(path + ".tmp", path)
    return path


def weight_bytes(runner) -> int:
    """Bytes of every weight a decode step reads once: the projections' packed blocks and the LM head's."""
    def nbytes(proj) -> int:
        if getattr(proj, "parts", None):
            return sum(blob.nbytes for _, blob, _ in proj.parts)
        return proj.blob.nbytes  # Head8

    return sum(nbytes(p) for layer in runner.layers for p in (layer[1], layer[2], layer[4], layer[5])) \
        + nbytes(getattr(runner.lm_head, "inner", runner.lm_head))


def profile_ours(args) -> dict:
    # local: torch and our model code load in the worker that profiles ours, not in the llama.cpp one
    import torch

    from simllm_ros.kernels import compute_threads, memory_rate
    from simllm_ros.model.decoding import Sampler
    from simllm_ros.model.draft_proposer import DraftProposer
    from simllm_ros.serving.engine import Engine

    threads = [int(t) for t in args.threads.split(",")]
    torch.set_num_threads(max(threads))
    e = Engine(Settings.from_overrides(model=args.file, model_cache_dir=args.cache, weight_bits=0, cache_size="1GB",
                                       enable_semantic_reuse=False))
    e.load()
    b = e.loaded_backend()
    runner = b.runner
    if runner is None or runner.fused is None or runner.int4 is None:
        raise SystemExit(f"{args.file}: its layers do not run in one C call here (layers {b.layers_kind}); "
                         "this profile reads their counters")
    ids = b.prompt_ids("", bulletin(args.context), QUESTIONS[0])
    L, Hkv, D = len(runner.layers), runner.n_kv, runner.head_dim
    weights = weight_bytes(runner)
    rate = memory_rate.load()
    out = {"file": os.path.basename(args.file), "how": f"{b.dtype_name}, layers {b.layers_kind}",
           "prompt_tokens": len(ids), "prompt_ids": ids, "weight_mb": weights / 1e6, "rows": []}
    timed = {"head": _Timed.over(runner, "lm_head"), "norm": _Timed.over(runner, "norm"),
             "embed": _Timed.over(runner, "embed"), "layers": _Timed.over(runner.fused, "run")}
    proposer = DraftProposer(prompt=ids, max_tokens=8)
    greedy = Sampler()
    for n in threads:
        torch.set_num_threads(n)
        with compute_threads.kernels_own_cores(b.kernels_do_the_work):
            cache = b.new_cache(len(ids) + args.steps + args.warmup + 2)
            logits = b.run(ids, cache, logits="last")
            kv_bytes = 0
            for step in range(args.warmup + args.steps):
                if step == args.warmup:  # counting from here
                    for t in timed.values():
                        t.ns = 0
                    runner.fused.profiling(True)
                    runner.int4.pool_profile(True)
                    pick_ns = draft_ns = 0
                    generated: list[int] = []
                    t_start = time.perf_counter_ns()
                t0 = time.perf_counter_ns()
                tok = greedy.pick(logits.reshape(-1, logits.shape[-1])[-1], step)  # the engine's greedy pick
                t1 = time.perf_counter_ns()
                if step >= args.warmup:
                    generated.append(tok)
                    proposer.propose(generated, 8)
                    t2 = time.perf_counter_ns()
                    pick_ns += t1 - t0
                    draft_ns += t2 - t1
                    kv_bytes += cache.length * L * 2 * Hkv * D * runner.dtype.itemsize
                logits = b.run([tok], cache, logits="last")
            total_ns = time.perf_counter_ns() - t_start
            if runner.fused.profile is None:
                raise SystemExit("the layer kernel's step counters are off: nothing was profiled (--steps 0?)")
            steps_c = runner.fused.profile.tolist()
            pool = runner.int4.pool_profile(False)
            runner.fused.profiling(False)
        k = args.steps
        ms = lambda ns, k=k: ns / k / 1e6
        # local: layer_kernel imports torch (profile_ours' worker only)
        from simllm_ros.kernels.layer_kernel import PROFILE_STEPS

        row = {"threads": n, "step_ms": ms(total_ns)}
        row.update({name: ms(v) for name, v in zip(PROFILE_STEPS, steps_c)})
        row["wait_for_workers"] = pool["wait_ms"] / k
        row["dispatches"] = pool["dispatches"] / k
        row["woke_sleeper"] = pool["woke_sleeper"] / k
        row["layers_python"] = ms(timed["layers"].ns - sum(steps_c))  # Layers.run's own arguments and the call
        row["lm_head"] = ms(timed["head"].ns)
        row["embed_and_norm"] = ms(timed["embed"].ns + timed["norm"].ns)
        row["pick"] = ms(pick_ns)
        row["draft_propose"] = ms(draft_ns)
        row["pass_python"] = row["step_ms"] - sum(row[x] for x in (*PROFILE_STEPS, "layers_python", "lm_head",
                                                                  "embed_and_norm", "pick", "draft_propose"))
        row["mb_per_token"] = (weights + kv_bytes / k) / 1e6
        row["effective_gbs"] = row["mb_per_token"] / row["step_ms"]
        if rate is not None:
            row["memory_read_gbs"] = rate.measure(n)
            row["floor_ms"] = row["mb_per_token"] / row["memory_read_gbs"]
        out["rows"].append(row)
    out["greedy_tail"] = generated[-4:]
    if args.rows:
        out["batched"] = profile_batched(b, runner, timed, ids, threads, [int(r) for r in args.rows.split(",")], args)
    e.unload()
    if args.answers:
        out["answers"] = answers_with_and_without_drafts(e.settings, threads, args)
    return out


def _counted(b, runner, timed: dict, work, steps: int) -> dict:
    """`work()` run `steps` times with the layers' and the pool's counters on: ms per call in total and per part
    (PROFILE_STEPS, the LM head, embedding + norm, the layers' Python, the pass's Python outside those)."""
    # local: layer_kernel imports torch (profile_ours' worker only)
    from simllm_ros.kernels.layer_kernel import PROFILE_STEPS

    for t in timed.values():
        t.ns = 0
    runner.fused.profiling(True)
    runner.int4.pool_profile(True)
    t0 = time.perf_counter_ns()
    for _ in range(steps):
        work()
    total_ns = time.perf_counter_ns() - t0
    steps_c = runner.fused.profile.tolist()
    pool = runner.int4.pool_profile(False)
    runner.fused.profiling(False)
    ms = lambda ns: ns / steps / 1e6  # noqa: E731
    row = {"pass_ms": ms(total_ns), **{name: ms(v) for name, v in zip(PROFILE_STEPS, steps_c)},
           "wait_for_workers": pool["wait_ms"] / steps, "layers_python": ms(timed["layers"].ns - sum(steps_c)),
           "lm_head": ms(timed["head"].ns), "embed_and_norm": ms(timed["embed"].ns + timed["norm"].ns)}
    row["pass_python"] = row["pass_ms"] - sum(row[x] for x in (*PROFILE_STEPS, "layers_python", "lm_head",
                                                              "embed_and_norm"))
    return row


def profile_batched(b, runner, timed: dict, ids: list[int], threads: list[int], counts: list[int], args) -> list:
    """A decode pass of N rows (N requests on one prompt, one new token each, reading the prompt's KV once as the
    batcher arranges it) against N single-row passes of the same requests, per part, at each thread count: what
    a step shared by N decoding clients costs, and where the rows add time."""
    # local: torch (through compute_threads too) in the worker that profiles ours only
    import torch

    from simllm_ros.kernels import compute_threads

    out = []
    base = b.new_cache(len(ids) + 2)
    first = b.run(ids, base, logits="last")
    k0, v0 = (x.clone() for x in b.cache_tensors(base))
    tok = int(first.reshape(-1, first.shape[-1])[-1].argmax())
    for n in threads:
        torch.set_num_threads(n)
        with compute_threads.kernels_own_cores(b.kernels_do_the_work):
            for rows in counts:
                caches = [b.cache_from_tensors(k0.clone(), v0.clone(), reserve=2) for _ in range(rows)]
                toks = [(tok + j) % b.vocab_size for j in range(rows)]  # N requests, N different next tokens
                shares = [(0, len(ids) // 32 * 32)] * rows if rows > 1 else None

                def batched(toks=toks, caches=caches, shares=shares):
                    b.run_batch([([t], c, "last") for t, c in zip(toks, caches)], shares)
                    for c in caches:
                        b.truncate(c, len(ids))

                def singles(toks=toks, caches=caches):
                    for t, c in zip(toks, caches):
                        b.run([t], c, logits="last")
                        b.truncate(c, len(ids))

                for _ in range(args.warmup):
                    batched()
                    singles()
                one = _counted(b, runner, timed, batched, args.steps)
                alone = _counted(b, runner, timed, singles, args.steps)
                out.append({"threads": n, "rows": rows, "batched": one, "singles": alone,
                            "batched_vs_singles": one["pass_ms"] / alone["pass_ms"]})
    return out


def answers_with_and_without_drafts(settings, threads: list[int], args) -> list[dict]:
    """Whole requests through the engine at each thread count, with the defaults (verified drafts on) and with
    drafts off, interleaved: decode ms a token after the first (total - TTFT over the tokens after it). A new
    scope and question each, so nothing but the bulletin's exact prefix is reused, and the drafts are what the
    prompt and recent answers offer. An engine loaded at each thread count (`compute_threads`), as a node runs:
    the pass costs that size its drafts are timed and learnt at that count, not at another one's."""
    # local: torch (and the engine, which imports it) in the worker that profiles ours only, not in the llama.cpp one
    import torch

    from simllm_ros.serving.engine import Engine

    ctx = bulletin(args.context)
    rows = []
    k = 0
    for n in threads:
        torch.set_num_threads(n)
        e = Engine(settings.replace(compute_threads=n))
        e.load()
        base = e.settings
        took: dict[bool, list[float]] = {True: [], False: []}
        drafted = {True: [0, 0], False: [0, 0]}
        for _ in range(args.answers):
            for drafts in (True, False):
                k += 1
                e.update_settings(base.replace(enable_drafts=drafts))
                r = e.handle(QueryRequest(prompt=f"Question {k}: what changes on route {k % 7} tonight?",
                                          context=ctx, cache_scope=f"profile-{k}", max_new_tokens=args.steps))
                if not r.success or r.generated_tokens < 2:
                    raise SystemExit(f"request failed or too short: {r.error or r.generated_tokens}")
                took[drafts].append((r.total_ms - r.ttft_ms) / (r.generated_tokens - 1))
                drafted[drafts][0] += r.draft_tokens_proposed
                drafted[drafts][1] += r.draft_tokens_accepted
        e.unload()
        on, off = sorted(took[True])[len(took[True]) // 2], sorted(took[False])[len(took[False]) // 2]
        rows.append({"threads": n, "drafts_ms": on, "no_drafts_ms": off, "ratio": on / off,
                     "mean_ratio": sum(took[True]) / sum(took[False]),
                     "proposed": drafted[True][0], "accepted": drafted[True][1]})
    return rows


def profile_llama(args) -> dict:
    """llama.cpp's decode ms/token on the same file and prompt length at each thread count (a process of its own)."""
    # local: llama_cpp is optional (requirements-bench.txt): the llama.cpp worker only
    from llama_cpp import Llama

    with open(args.ids) as f:
        ids = json.load(f)
    rows = []
    for n in [int(t) for t in args.threads.split(",")]:
        llm = Llama(model_path=args.file, n_ctx=2048, n_threads=n, n_threads_batch=n, n_batch=512, verbose=False)
        llm.eval(ids)
        n_vocab = llm.n_vocab()
        for _ in range(args.warmup):
            llm.eval([int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))))])
        t0 = time.perf_counter()
        for _ in range(args.steps):
            llm.eval([int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))))])
        rows.append({"threads": n, "step_ms": (time.perf_counter() - t0) / args.steps * 1000})
        del llm
    return {"rows": rows}


def _worker(kind: str, args) -> dict | None:
    cmd = [sys.executable, "-m", __spec__.name, "--worker", kind, "--file", args.file, "--threads", args.threads,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--context", str(args.context),
           "--cache", args.cache, "--ids", args.ids, "--answers", str(args.answers), "--rows", args.rows]
    return run_worker_process(kind, cmd)


COLUMNS = ("qkv", "o", "gate_up", "down", "attention", "norms", "rope", "activation", "wait_for_workers",
           "layers_python", "lm_head", "embed_and_norm", "pass_python", "pick", "draft_propose")


def report(ours: dict, llama: dict | None) -> None:
    print(f"\n{ours['file']} ({ours['how']}), {ours['prompt_tokens']}-token prompt, greedy; ms per decode step "
          f"(wait_for_workers is inside the products and attention)")
    print("| threads | step | " + " | ".join(COLUMNS) + " | dispatches | woke a sleeper |\n|"
          + "---|" * (len(COLUMNS) + 4))
    for r in ours["rows"]:
        print(f"| {r['threads']} | {r['step_ms']:.2f} | " + " | ".join(f"{r[c]:.2f}" for c in COLUMNS)
              + f" | {r['dispatches']:.0f} | {r['woke_sleeper']:.0f} |")
    print("\nBytes and memory: MB read per token (weights once + the KV attended), the rate the step reaches, what "
          "1..N threads read from memory here (membw.c), the floor that sets a step, and llama.cpp's step")
    print("| threads | MB/token | step ms | effective GB/s | memory read GB/s | floor ms | step / floor | "
          "llama.cpp ms | ours / llama.cpp | speed-up from 1 thread |\n|" + "---|" * 10)
    base: dict[str, float] = {}
    for r in ours["rows"]:
        lr = next((x for x in (llama or {}).get("rows", []) if x["threads"] == r["threads"]), None)
        base.setdefault("ours", r["step_ms"])
        print(f"| {r['threads']} | {r['mb_per_token']:.0f} | {r['step_ms']:.2f} | {r['effective_gbs']:.1f} | "
              f"{r.get('memory_read_gbs', float('nan')):.1f} | {r.get('floor_ms', float('nan')):.2f} | "
              f"{r['step_ms'] / r.get('floor_ms', float('nan')):.2f} | "
              + (f"{lr['step_ms']:.2f} | {r['step_ms'] / lr['step_ms']:.2f}" if lr else "- | -")
              + f" | {base['ours'] / r['step_ms']:.2f} |")
    projection(ours["rows"], (llama or {}).get("rows", []))
    if ours.get("answers"):
        print("\nWhole requests through the engine (median decode ms a token after the first): the defaults (verified "
              "drafts) against drafts off")
        print("| threads | drafts on | drafts off | on / off (medians) | on / off (all tokens) | draft tokens proposed "
              "| accepted |\n|---|---|---|---|---|---|---|")
        for r in ours["answers"]:
            print(f"| {r['threads']} | {r['drafts_ms']:.2f} | {r['no_drafts_ms']:.2f} | {r['ratio']:.3f} | "
                  f"{r['mean_ratio']:.3f} | {r['proposed']} | {r['accepted']} |")
    if ours.get("batched"):
        report_batched(ours["batched"])
    if llama and len(llama["rows"]) > 1:
        one = llama["rows"][0]["step_ms"]
        print("llama.cpp speed-up from its first thread count: "
              + ", ".join(f"{x['threads']}: {one / x['step_ms']:.2f}x" for x in llama["rows"]))


BATCH_COLUMNS = ("qkv", "o", "gate_up", "down", "attention", "norms", "rope", "activation", "wait_for_workers",
                 "layers_python", "lm_head", "embed_and_norm", "pass_python")


def report_batched(rows: list[dict]) -> None:
    print("\nA decode pass of N rows (N requests on the prompt, a token each, its KV read once) against the same N "
          "rows as N single-row passes: ms per pass (batched) and per N passes (singles)")
    print("| threads | rows | how | pass | " + " | ".join(BATCH_COLUMNS) + " | batched / singles | batched / 1 row |\n|"
          + "---|" * (len(BATCH_COLUMNS) + 6))
    one = {r["threads"]: r["batched"]["pass_ms"] for r in rows if r["rows"] == 1}
    for r in rows:
        for how in ("batched", "singles"):
            x = r[how]
            tail = (f" | {r['batched_vs_singles']:.2f} | {x['pass_ms'] / one[r['threads']]:.2f} |"
                    if how == "batched" and r["threads"] in one else " | | |")
            print(f"| {r['threads']} | {r['rows']} | {how} | {x['pass_ms']:.2f} | "
                  + " | ".join(f"{x[c]:.2f}" for c in BATCH_COLUMNS) + tail)


def amdahl(rows: list[dict]) -> tuple[float, float] | None:
    """(serial ms, parallel ms) of step = serial + parallel / threads, fitted by least squares to the measured rows
    (at least two thread counts), or None."""
    pts = [(1.0 / r["threads"], r["step_ms"]) for r in rows]
    if len({x for x, _ in pts}) < 2:
        return None
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    p = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    return my - p * mx, p


def projection(ours: list[dict], llama: list[dict]) -> None:
    """A model, not a measurement: the step at 4, 6 and 12 threads from the serial and parallel parts fitted to the
    thread counts measured here (Amdahl), beside the same fit of llama.cpp's steps. Memory bandwidth stops both
    sooner than this says on a machine whose memory the threads share (the floor column above); run this command
    on a machine with more cores (--threads 1,2,4,6,...) for the measured table."""
    fitted = [("simllm_ros", amdahl(ours)), ("llama.cpp", amdahl(llama) if llama else None)]
    fits = [(name, f) for name, f in fitted if f is not None]
    if not fits:
        return
    print("\nA model, not a measurement (Amdahl's law fitted to the thread counts above: step = serial + "
          "parallel / threads); memory bandwidth caps it sooner")
    print("| system | serial ms | parallel ms | 4 threads | 6 threads | 12 threads |\n|---|---|---|---|---|---|")
    for name, (serial, par) in fits:
        print(f"| {name} | {serial:.1f} | {par:.1f} | " + " | ".join(f"{serial + par / t:.1f}" for t in (4, 6, 12))
              + " |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", help="a GGUF file")
    ap.add_argument("--shape", help="or a shape of gguf_models (qwen2.5-1.5b, ...) ...")
    ap.add_argument("--quant", default="Q4_K_M", help="... quantized by llama.cpp (Q4_K_M, Q8_0), or 'random': "
                    "random Q4_K/Q6_K blocks written without llama.cpp")
    ap.add_argument("--dir", default=os.path.join(os.path.expanduser("~"), ".cache", "simllm_ros", "bench-models"))
    ap.add_argument("--threads", default="1,2", help="thread counts, in one process")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--context", type=int, default=450, help="prompt length in tokens (about)")
    ap.add_argument("--llama", action="store_true", help="llama.cpp's decode on the same file, side by side")
    ap.add_argument("--answers", type=int, default=0, help="also N whole requests per thread count through the "
                    "engine, with verified drafts (the default) and without, interleaved: what drafts cost or save")
    ap.add_argument("--rows", default="", help="also a decode pass of N rows (N requests on the prompt, a token "
                    "each) against N single-row passes, per part, for each N of this comma-separated list (1,2,4,8)")
    ap.add_argument("--json", default="", help="also write the figures to this file")
    ap.add_argument("--worker", choices=["ours", "llama"], help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        out = profile_ours(args) if args.worker == "ours" else profile_llama(args)
        print("RESULT " + json.dumps(out), flush=True)
        return
    os.makedirs(args.dir, exist_ok=True)
    if not args.file:
        if not args.shape:
            ap.error("--file or --shape")
        if args.quant == "random":
            args.file = random_file(args.shape, args.dir)
        else:
            args.file = make_file(args.shape, args.quant, args.dir)
    args.cache = os.path.join(args.dir, "models")
    args.ids = os.path.join(args.dir, "decode-profile-ids.json")
    ours = _worker("ours", args)
    if ours is None:
        raise SystemExit(1)
    llama = None
    if args.llama:
        with open(args.ids, "w") as f:
            json.dump(ours.pop("prompt_ids", None) or [], f)
        llama = _worker("llama", args)
    report(ours, llama)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ours": ours, "llama": llama}, f, indent=1)


if __name__ == "__main__":
    main()
