"""The engine's answers and numerics on fixed prompts, recorded so that two machines can be compared bit for bit.

`run` loads the engine (float32, the model's 4-bit weights: the lossless path on x86 and aarch64 alike), records
the numerics digest's own 16-token pass tensor by tensor (the logits of each position, each layer's keys and values
at each position), then asks fixed requests through the pool: a miss, an exact-prefix hit (same context, another
question) and a repeat that the stored answer drafts (answer_memo off, so the model checks the draft). For each
request it keeps the token ids and every model pass (the ids fed, a hash of each logits row). Draft lengths follow
the proposer's adaptive rule (tokens only), not the timed pass costs, so that both machines run the same passes.

`compare` takes two such records and says whether they are equal, else where they first differ: the tensor and
position of the digest pass, the request and step of the answers. Only the standard library is needed for it.

    python scripts/engine_probe.py run --model embedded:smollm2-135m-instruct --out x86.json
    python scripts/engine_probe.py compare x86.json arm.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import time

# Short context and questions: every token costs ~30x its x86 time under the emulator.
CONTEXT = ("Riverside district bulletin. Elm Street is closed between 3rd Avenue and Mill Road from 09:00 to 17:00 "
           "for water main repairs; use Oak Avenue instead. Light rain is expected after 15:00.")
REQUESTS = (  # (name, question, what the pool should give it)
    ("miss", "Which street is closed today?", "MISS"),
    ("exact_prefix", "When is rain expected?", "EXACT_PREFIX"),
    ("drafts", "Which street is closed today?", "EXACT_PREFIX"),  # its stored answer is the draft
)
MAX_NEW = 12


def _sha(t) -> str:
    return hashlib.sha256(t.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def _digest_trace(backend) -> dict:
    """The numerics digest's 16-token pass (load_checks.numerics_digest), tensor by tensor: the logits of each
    position, each layer's keys and values at each position; and the digest recomputed from these logits."""
    from simllm_ros.kernels.build import CONTRACT

    ids = [int(t) % max(len(backend.tokenizer), 1) for t in range(211, 211 + 16 * 89, 89)]
    cache = backend.new_cache(len(ids) + 2)
    logits = backend.run(ids, cache, logits="all")
    k, v = backend.cache_tensors(cache)  # [L, H, n, D]
    data = CONTRACT.encode() + b"\0" + logits.detach().float().cpu().contiguous().numpy().tobytes()
    tensors = {"logits": [_sha(logits[i]) for i in range(len(ids))]}
    for layer in range(k.shape[0]):
        tensors[f"layer{layer}.k"] = [_sha(k[layer, :, i]) for i in range(len(ids))]
        tensors[f"layer{layer}.v"] = [_sha(v[layer, :, i]) for i in range(len(ids))]
    return {"ids": ids, "digest": hashlib.sha256(data).hexdigest()[:16], "tensors": tensors,
            "argmax": [int(i) for i in logits.argmax(-1)]}


def scale_budgets(factor: float) -> None:
    """Multiplies the package's wall-clock budgets at load by `factor`: under an emulator (~10-50x slower, and
    slower again on a shared machine) the chat template box's child start (60 s) and render (5 s) and a kernel
    build (300 s) run out though nothing is wrong. Their checks still run; only the clock is scaled."""
    from simllm_ros.kernels import build
    from simllm_ros.model import template_box

    template_box.START_SECONDS *= factor
    defaults = template_box.check_template.__defaults__
    template_box.check_template.__defaults__ = defaults[:-1] + (defaults[-1] * factor,)
    real = build.subprocess

    class Slow:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def run(*a, timeout=None, **kw):
            return real.run(*a, timeout=None if timeout is None else timeout * factor, **kw)

    build.subprocess = Slow()


def cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (under qemu-user: the emulator's own, on the host)."""
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def build_kernels(names: list[str], time_scale: float = 1.0) -> dict:
    """The package's own first-use build (kernels/build.build: this machine's compiler, flags and cache key) of
    `names`, all at once: the same libraries the load would build one after another, ahead of it."""
    from concurrent.futures import ThreadPoolExecutor

    from simllm_ros.kernels import build

    if time_scale != 1.0:
        scale_budgets(time_scale)

    def one(name):
        t = time.monotonic()
        path = build.build(name)
        print(f"[kernel] {name}: {os.path.basename(path)} in {time.monotonic() - t:.1f} s", flush=True)
        return name, path

    with ThreadPoolExecutor(len(names)) as pool:
        built = dict(pool.map(one, names))
    print(f"[kernel] CPU seconds: {cpu_seconds():.1f}", flush=True)
    return built


def kernel_plan(names: list[str]) -> dict:
    """For each kernel: the library path the load looks for (kernels/build.library_path: this machine's compiler,
    flags and key) and the compiler's command line for it. scripts/aarch64_engine.py builds that command with a
    cross compiler of the same version and places the library there, so the load finds it as if built here."""
    from simllm_ros.kernels import build

    cc = build.compiler()
    if cc is None:
        raise SystemExit("no C compiler here: the plan names the compiler whose key the load uses")
    return {"cc": cc, "version": build._compiler_version(cc),
            "kernels": {n: {"path": build.library_path(n, cc), "command": build.command(n, cc, "OUT")}
                        for n in names}}


def run(model: str, out: str, threads: int, time_scale: float = 1.0, digest_only: bool = False,
        given_checks: tuple[bool, bool] | None = None) -> dict:
    """The record (module doc). `digest_only`: the digest pass alone, without the load-time checks and the requests:
    under a starved emulator the checks take most of the CPU; the digest pass's bits do not depend on them (it is
    a 16-row pass; the checks decide single-row passes and whether chunked passes and drafts may run).
    `given_checks`: (single rows, invariance probe) taken as given (the other machine's verdicts) instead of measured:
    the requests then run the same kinds of passes, and their logits rows are compared pass by pass, but that this
    machine passes the checks itself is not shown (the record says so)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch

    from simllm_ros.request import QueryRequest
    from simllm_ros.serving.engine import Engine
    from simllm_ros.settings import Settings

    torch.set_num_threads(threads)
    if time_scale != 1.0:
        scale_budgets(time_scale)
    if digest_only or given_checks:
        from simllm_ros.model.load_checks import LoadChecks

        single, exact = given_checks or (False, False)
        LoadChecks._load_checks = lambda self, cache_dir, stamp: (single, exact, None, self.numerics_digest())
    t0 = time.monotonic()
    engine = Engine(Settings.from_overrides(model=model, dtype="float32", weight_bits=0, kv_bits=0,
                                            cache_size="256MB", compute_threads=threads, answer_memo=False,
                                            enable_semantic_reuse=False, approx_error_bound=1.0))
    engine.load(progress=lambda m: print(f"[load {time.monotonic() - t0:6.1f}s] {m}", flush=True))
    load_s = time.monotonic() - t0
    b = engine.backend
    # Draft lengths by the adaptive rule, not by the pass costs: those are timings (the load's and every pass's),
    # so where they decide, two runs check other drafts in other passes though every bit is the same (two x86 runs
    # of the embedded model proposed 5 and 6 drafts on the miss; aarch64 under qemu 11, x86 0 on the Q4_K_M
    # repeat). The rule doubles after an accepted draft and shrinks after a rejection: tokens only.
    b.pass_costs = None
    rec = {"machine": platform.machine(), "python": platform.python_version(), "torch": torch.__version__,
           "model": model, "load_s": round(load_s, 1), "dtype": str(b.dtype).replace("torch.", ""),
           "weight_bits": b.weight_bits, "numerics": b.numerics, "exact_chunking": bool(b.exact_chunking),
           "kernels_do_the_work": bool(b.kernels_do_the_work), "time_scale": time_scale,
           "draft_lengths": "adaptive (pass costs set aside)", "digest_only": digest_only,
           "load_checks": "given: single rows %s, invariance probe %s" % given_checks if given_checks else
           ("skipped" if digest_only else "measured")}
    t = time.monotonic()
    rec["digest_pass"] = _digest_trace(b)
    rec["digest_pass"]["seconds"] = round(time.monotonic() - t, 2)

    passes: list[dict] = []
    gens: list = []
    run_orig, decode_orig = b.run, b.decode

    def run_spy(ids, cache, positions=None, logits="last"):
        rows = run_orig(ids, cache, positions, logits)
        if rows is not None:
            r = rows if rows.dim() == 2 else rows.unsqueeze(0)
            passes.append({"ids": [int(i) for i in ids], "logits": [_sha(r[i]) for i in range(r.shape[0])]})
        else:
            passes.append({"ids": [int(i) for i in ids], "logits": []})
        return rows

    def decode_spy(*a, **kw):
        g = decode_orig(*a, **kw)
        gens.append(g)
        return g

    b.run, b.decode = run_spy, decode_spy
    rec["requests"] = []
    try:
        for name, question, want in () if digest_only else REQUESTS:
            passes.clear()
            gens.clear()
            t = time.monotonic()
            res = engine.handle(QueryRequest(prompt=question, context=CONTEXT, cache_scope="probe",
                                             max_new_tokens=MAX_NEW, allow_approximate=False, request_id=name))
            if not res.success:
                raise RuntimeError(f"request {name} failed: {res.error}")
            rec["requests"].append({
                "name": name, "want": want, "cache_result": res.cache_result.name, "exact": bool(res.exact),
                "tokens": [int(x) for x in gens[-1].tokens] if gens else [], "answer": res.answer,
                "reused_tokens": res.reused_tokens, "draft_proposed": res.draft_tokens_proposed,
                "draft_accepted": res.draft_tokens_accepted, "seconds": round(time.monotonic() - t, 2),
                "passes": list(passes)})
            print(f"[{name}] {res.cache_result.name} exact={res.exact} reused={res.reused_tokens} "
                  f"drafts {res.draft_tokens_accepted}/{res.draft_tokens_proposed} "
                  f"{time.monotonic() - t:.1f}s tokens {rec['requests'][-1]['tokens']}", flush=True)
    finally:
        del b.run, b.decode
    print(f"numerics digest {b.numerics} (digest pass recomputed: {rec['digest_pass']['digest']})", flush=True)
    rec["cpu_s"] = round(cpu_seconds(), 1)
    tmp = out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(rec, f, indent=1)
    os.replace(tmp, out)
    engine.unload()
    return rec


def _first_diff(a: list, b: list) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(a: dict, b: dict) -> list[str]:
    """Where two records differ, in words (empty: equal in every recorded bit). The digest pass by tensor and
    position (the earliest layer first: where a difference starts), then each request by step (pass)."""
    diffs = []
    if a.get("numerics") != b.get("numerics"):
        diffs.append(f"numerics digest: {a.get('numerics')} != {b.get('numerics')}")
    ta, tb = a["digest_pass"]["tensors"], b["digest_pass"]["tensors"]

    def order(name):
        return (0, int(name[5:].split(".")[0]), name) if name.startswith("layer") else (1, 0, name)

    for name in sorted(set(ta) | set(tb), key=order):
        if name not in ta or name not in tb:
            diffs.append(f"digest pass: tensor {name} only in {'first' if name in ta else 'second'} record")
            continue
        bad = [i for i, (x, y) in enumerate(zip(ta[name], tb[name])) if x != y]
        if bad or len(ta[name]) != len(tb[name]):
            diffs.append(f"digest pass: tensor {name} differs at positions {bad or 'beyond the shorter'}")
    if a.get("digest_only") or b.get("digest_only"):
        return diffs  # one side ran the digest pass alone (run --digest-only): no requests to compare
    ra, rb = a["requests"], b["requests"]
    if [r["name"] for r in ra] != [r["name"] for r in rb]:
        diffs.append(f"requests: {[r['name'] for r in ra]} != {[r['name'] for r in rb]}")
    for x, y in zip(ra, rb):
        n = x["name"]
        for key in ("cache_result", "exact", "reused_tokens", "draft_proposed", "draft_accepted"):
            if x[key] != y[key]:
                diffs.append(f"request {n}: {key} {x[key]} != {y[key]}")
        i = _first_diff(x["tokens"], y["tokens"])
        if i is not None:
            diffs.append(f"request {n}: token ids differ from step {i}: "
                         f"{x['tokens'][i:i + 4]} != {y['tokens'][i:i + 4]}")
        for s, (p, q) in enumerate(zip(x["passes"], y["passes"])):
            if p["ids"] != q["ids"]:
                diffs.append(f"request {n}: pass {s} fed other ids ({len(p['ids'])} vs {len(q['ids'])} tokens)")
                break
            j = _first_diff(p["logits"], q["logits"])
            if j is not None:
                diffs.append(f"request {n}: pass {s} ({len(p['ids'])} rows): logits differ from row {j}")
                break
        if len(x["passes"]) != len(y["passes"]):
            diffs.append(f"request {n}: {len(x['passes'])} passes != {len(y['passes'])}")
    return diffs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the fixed requests and write the record")
    r.add_argument("--model", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply the load's wall-clock budgets (template box, kernel build) by this: an emulator")
    r.add_argument("--digest-only", action="store_true",
                   help="the digest pass alone: no load-time checks, no requests (a starved emulator)")
    r.add_argument("--given-checks", metavar="SINGLE,EXACT",
                   help="take the load-time checks' verdicts as given (e.g. 1,1: another machine's), not measured")
    k = sub.add_parser("build-kernels", help="build these kernels at once, as the load would build them")
    k.add_argument("names", nargs="+")
    k.add_argument("--time-scale", type=float, default=1.0)
    p = sub.add_parser("kernel-plan", help="print where the load looks for these kernels and how it builds them")
    p.add_argument("names", nargs="+")
    c = sub.add_parser("compare", help="compare two records: exit 0 equal, 1 different")
    c.add_argument("first")
    c.add_argument("second")
    args = ap.parse_args(argv)
    if args.cmd == "run":
        given = tuple(v.strip() == "1" for v in args.given_checks.split(",")) if args.given_checks else None
        run(args.model, args.out, args.threads, args.time_scale, args.digest_only, given)
        return 0
    if args.cmd == "build-kernels":
        build_kernels(args.names, args.time_scale)
        return 0
    if args.cmd == "kernel-plan":
        print(json.dumps(kernel_plan(args.names)))
        return 0
    with open(args.first, encoding="utf-8") as f1, open(args.second, encoding="utf-8") as f2:
        diffs = compare(json.load(f1), json.load(f2))
    print("equal" if not diffs else "\n".join(diffs))
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
