"""Many users at once (`simllm-bench concurrency`): closed-loop clients against the request server.

Systems, each behind its own RequestServer (the node's admission queue and worker thread, no ROS):
  batched        simllm_ros engine (its own fork: shared model, own pool), max_batch 8 (continuous batching)
  one-at-a-time  the same engine settings with max_batch 1: today's engine, one request after another
  no-cache       plain transformers `generate` on the full prompt, one request after another
  llama-cpp      llama-cpp-python on the same GGUF, one after another (only where it is installed)

Phases; the systems take turns round by round (the order rotates), so load from elsewhere on a shared
machine falls on all of them alike, and the report gives ratios measured side by side:
1. closed loop: for 1, 2, 4, 8 clients, each client sends its next request as soon as it has the answer to
   the last one. Round r serves the same requests, in the same order of issue, at every client count, each
   from the same pool (emptied, then the untimed warm requests), so the client counts compare. Throughput
   (answers per second), TTFT (from submission, queueing included) p50/p95 and latency per system and client
   count; the sustained rate within the TTFT target is the highest
   throughput measured with p95 TTFT <= --ttft-target-ms.
2. four at once: four requests of up to 48 tokens submitted together to the batched server, against the
   same four one after another on the one-at-a-time server (each measurement on a pool holding only the
   context, so the tiers match).
3. identity: every request served by both batched and one-at-a-time is compared; where both are exact
   (MISS, lossless EXACT_PREFIX, verified drafts) the answers must be equal, and the count is reported;
   approximate (SEMANTIC) answers are counted apart.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import threading
import time

from .. import workloads as wl
from ..request import QueryRequest, QueryResult
from ..serving.request_server import RequestServer
from ..settings import Settings
from .metrics import mean, percentile

log = logging.getLogger("simllm_ros.bench.concurrency")

DEFAULT_OUT = os.path.join("benchmark", "concurrency")
SMOKE_OUT = os.path.join("build", "bench-concurrency-smoke")
BATCH = 8


class Served:
    """One system behind a RequestServer: ask(row) blocks like a service call and returns (QueryResult, s)."""

    def __init__(self, name: str, server, engine=None, reset=None):
        self.name, self.server, self.engine, self._reset = name, server, engine, reset
        server.start()
        server.open()

    def ask(self, row: dict, max_new: int, rid: str):
        req = QueryRequest(prompt=row["prompt"], context=row["context"], cache_scope=row.get("scope", ""),
                           max_new_tokens=max_new, request_id=rid)
        t0 = time.perf_counter()
        res = self.server.wait(self.server.submit(req))
        return res, time.perf_counter() - t0

    def reset(self) -> None:
        """Empty the pool (engine systems)."""
        if self.engine is not None:
            self.engine.clear_pool()
        if self._reset is not None:
            self._reset()

    def close(self) -> None:
        self.server.stop()


def _engine_system(name: str, engine, max_batch: int) -> Served:
    e = engine.fork(engine.settings.replace(max_batch=max_batch))
    server = RequestServer(e, state=lambda: "bench", queue_limit=64, max_batch=max_batch)
    return Served(name, server, engine=e)


def _serial_system(name: str, generate, backend, system_prompt: str) -> Served:
    """A one-at-a-time peer: generate(ids, row) -> (text, ms from its start to the first token)."""
    class Serial:
        """The peer as the request server serves it (request_server.ServedEngine): one request at a time."""

        settings = Settings().replace(max_batch=1)

        def prepare(self, req):
            return req, time.perf_counter()

        def execute(self, p, on_progress=None, should_stop=None):
            r, t_arrival = p
            t_exec = time.perf_counter()
            ids = backend.prompt_ids(system_prompt, r.context, r.prompt)
            text, first_ms = generate(ids, r)
            t1 = time.perf_counter()
            return QueryResult(success=True, answer=text, prompt_tokens=len(ids),
                               ttft_ms=(t_exec - t_arrival) * 1000 + first_ms, total_ms=(t1 - t_arrival) * 1000)

        def begin(self, p, on_progress=None, should_stop=None):
            raise NotImplementedError("one request at a time")

        def step(self, flights):
            raise NotImplementedError("one request at a time")

        def has_idle_work(self) -> bool:
            return False

        def idle_work(self) -> bool:
            return False

        def record_rejected_busy(self) -> None:
            pass

    server = RequestServer(Serial(), state=lambda: "bench", queue_limit=64, max_batch=1)
    return Served(name, server)


def make_systems(engine, max_new: int, threads: int, want_llama: bool, want_peers: bool = True
                 ) -> tuple[dict, dict]:
    # local: .systems imports torch; this module's --help and report code run without it
    from .systems import PlainGenerate

    s = engine.settings
    systems = {"batched": _engine_system("batched", engine, BATCH),
               "one-at-a-time": _engine_system("one-at-a-time", engine, 1)}
    status = {"batched": {"status": "ok", "max_batch": BATCH, "prefill_chunk_tokens": s.prefill_chunk_tokens,
                          "drafts": s.enable_drafts},
              "one-at-a-time": {"status": "ok", "max_batch": 1, "drafts": s.enable_drafts}}
    if not want_peers:
        status["no-cache"] = status["llama-cpp"] = {"status": "skipped", "error": "skipped: --engines-only"}
        return systems, status
    plain = PlainGenerate(engine.backend, s.system_prompt, max_new)

    def hf(ids, r):
        t0 = time.perf_counter()
        text, _, t_first = plain.generate_ids(ids)
        return text, ((t_first or time.perf_counter()) - t0) * 1000

    systems["no-cache"] = _serial_system("no-cache", hf, engine.backend, s.system_prompt)
    status["no-cache"] = {"status": "ok"}
    if not want_llama:
        status["llama-cpp"] = {"status": "skipped", "error": "skipped: --no-llama"}
    elif importlib.util.find_spec("llama_cpp") is None:
        status["llama-cpp"] = {"status": "not installed", "error": "not installed (pip install llama-cpp-python, "
                               "requirements-bench.txt; builds from source)"}
    else:
        try:
            # local: .systems imports torch (see make_systems' first import)
            from .systems import LlamaCppSystem

            lc = LlamaCppSystem("llama-cpp", engine.backend, s.system_prompt, max_new, threads, 0, use_cache=False)
            lc.begin("concurrency")

            def llama(ids, r):
                rec = lc.run(0, {"prompt": r.prompt, "context": r.context})
                return rec.answer, rec.ttft_ms

            systems["llama-cpp"] = _serial_system("llama-cpp", llama, engine.backend, s.system_prompt)
            status["llama-cpp"] = {"status": "ok", "config": lc.config}
        except Exception as e:  # pragma: no cover - depends on the peer
            status["llama-cpp"] = {"status": "error", "error": f"failed to set up: {type(e).__name__}: {e}"}
    return systems, status


def warm_up(system: Served, rows: list[dict], warm: int, max_new: int) -> None:
    """The pool emptied, then the first `warm` rows asked untimed: every timed round starts from this state."""
    system.reset()
    for i in range(min(warm, len(rows))):
        system.ask(rows[i], max_new, f"warm-{i}")


def closed_loop(system: Served, rows: list[dict], start: int, n: int, clients: int, max_new: int) -> dict:
    """`clients` threads, each sending its next request when the last one is answered, until n are sent."""
    lock = threading.Lock()
    state = {"next": 0}
    recs: list[dict] = []

    def client() -> None:
        while True:
            with lock:
                i = state["next"]
                if i >= n:
                    return
                state["next"] += 1
            k = start + i
            res, dt = system.ask(rows[k % len(rows)], max_new, f"{system.name}-{k}")
            with lock:
                recs.append({"k": k, "ok": res.success, "error": res.error, "ttft_ms": res.ttft_ms,
                             "latency_ms": dt * 1000, "tier": res.cache_result.name if res.success else "ERROR",
                             "exact": res.exact, "answer": res.answer, "tokens": res.generated_tokens,
                             "t_done": time.perf_counter()})

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    batcher = getattr(system.engine, "batcher", None) if system.name == "batched" else None
    trace: list | None = None
    if batcher is not None:
        trace = batcher.trace = []
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = max((r["t_done"] for r in recs), default=t0) - t0
    if batcher is not None:
        batcher.trace = None
    for r in recs:
        del r["t_done"]
    return {"wall_s": wall, "recs": sorted(recs, key=lambda r: r["k"]),
            "steps": step_breakdown(trace, wall) if trace else None}


def four_at_once(systems: dict, rows: list[dict], trials: int, max_new: int) -> dict:
    """Four requests on one context submitted together (batched) against one after another (one-at-a-time);
    each measurement starts from a pool that holds only the context (one untimed request on it)."""
    by_ctx: dict[str, list[dict]] = {}
    for r in rows:  # the context with the most distinct prompts
        same = by_ctx.setdefault(r["context"], [])
        if r["prompt"] not in {x["prompt"] for x in same}:
            same.append(r)
    four = max(by_ctx.values(), key=len)
    warm, four = four[0], four[1:5]
    if len(four) < 4:
        raise ValueError("the workload has fewer than five distinct prompts on its first context")
    out: dict = {"prompts": [r["prompt"] for r in four], "max_new_tokens": max_new, "runs": []}
    modes = [("batched", "together"), ("one-at-a-time", "one after another"), ("one-at-a-time", "together")]
    for t in range(trials):
        for name, how in modes[t % 3:] + modes[:t % 3]:
            s = systems[name]
            s.reset()
            s.ask(warm, max_new, f"warm-{t}")
            trace: list | None = None
            if name == "batched" and s.engine is not None:
                trace = s.engine.batcher.trace = []
            t0 = time.perf_counter()
            if how == "together":
                jobs = []
                for i, r in enumerate(four):
                    jobs.append(s.server.submit(QueryRequest(prompt=r["prompt"], context=r["context"],
                                                             cache_scope=r.get("scope", ""), max_new_tokens=max_new,
                                                             request_id=f"four-{t}-{i}")))
                results = [s.server.wait(j) for j in jobs]
            else:
                results = [s.ask(r, max_new, f"four-{t}-{i}")[0] for i, r in enumerate(four)]
            wall = time.perf_counter() - t0
            if trace is not None:
                s.engine.batcher.trace = None
            out["runs"].append({"trial": t, "system": name, "how": how, "wall_s": wall,
                                "steps": step_breakdown(trace, wall) if trace else None,
                                "answers": [r.answer for r in results], "ok": all(r.success for r in results),
                                "tiers": [r.cache_result.name for r in results], "exact": [r.exact for r in results],
                                "tokens": [r.generated_tokens for r in results]})
    return out


def step_breakdown(trace: list, wall_s: float) -> dict:
    """Where a batched run's wall time went, from the batcher's step trace (batching.StepRecord), in seconds:
    forward passes that only decoded, passes that prefilled while no flight decoded, passes that prefilled while
    others decoded (their decode rows wait for the prefill), each step's Python outside its pass (per flight:
    plans, draft checks, finishing), and the rest of the wall time outside steps (admission, begin, answering: the
    scheduler's gaps). Also the decode passes' mean flights and rows (rows beyond one a flight are draft tokens)."""
    decode = [r for r in trace if r.decoding and not r.prefill_tokens]
    alone = [r for r in trace if r.prefill_tokens and not r.decoding]
    mixed = [r for r in trace if r.prefill_tokens and r.decoding]
    passes = lambda rs: sum(r.t_pass_end - r.t_pass for r in rs)
    in_steps = sum(r.t_end - r.t_start for r in trace)
    n_dec = len(decode) or 1
    return {"steps": len(trace), "decode_passes": len(decode), "decode_s": passes(decode),
            "prefill_alone_s": passes(alone), "prefill_with_decoding_s": passes(mixed),
            "prefill_tokens": sum(r.prefill_tokens for r in trace),
            "step_python_s": in_steps - passes(trace), "between_steps_s": wall_s - in_steps,
            "decode_flights_mean": sum(r.decoding for r in decode) / n_dec,
            "decode_rows_mean": sum(r.decode_rows for r in decode) / n_dec,
            "draft_rows": sum(r.decode_rows - r.decoding for r in trace),
            "decode_ms_per_pass": passes(decode) / n_dec * 1000,
            "waiting_steps": sum(1 for r in trace if r.waiting)}


def breakdown_text(b: dict) -> str:
    return (f"{b['steps']} steps: decode {b['decode_s']:.2f} s in {b['decode_passes']} passes "
            f"({b['decode_ms_per_pass']:.1f} ms, {b['decode_flights_mean']:.1f} flights, {b['decode_rows_mean']:.1f} "
            f"rows each), prefill alone {b['prefill_alone_s']:.2f} s, prefill with decoding waiting "
            f"{b['prefill_with_decoding_s']:.2f} s ({b['prefill_tokens']} tokens), Python in steps "
            f"{b['step_python_s']:.2f} s, between steps {b['between_steps_s']:.2f} s, draft rows {b['draft_rows']}")


def summarize(runs: list[dict], ttft_target_ms: float) -> dict:
    """Per system and client count: throughput over all rounds, TTFT and latency percentiles."""
    out: dict = {}
    for run in runs:
        d = out.setdefault(run["system"], {}).setdefault(str(run["clients"]), {"wall_s": 0.0, "recs": []})
        d["wall_s"] += run["wall_s"]
        d["recs"].extend(run["recs"])
    for by_c in out.values():
        for d in by_c.values():
            ok = [r for r in d["recs"] if r["ok"]]
            ttft = [r["ttft_ms"] for r in ok]
            d.update(n=len(d["recs"]), errors=len(d["recs"]) - len(ok), throughput_rps=len(ok) / d["wall_s"]
                     if d["wall_s"] else 0.0, ttft_p50_ms=percentile(ttft, 50), ttft_p95_ms=percentile(ttft, 95),
                     latency_p50_ms=percentile([r["latency_ms"] for r in ok], 50),
                     latency_p95_ms=percentile([r["latency_ms"] for r in ok], 95),
                     tokens_mean=mean([r["tokens"] for r in ok]),
                     tiers={t: sum(r["tier"] == t for r in ok) for t in sorted({r["tier"] for r in ok})})
            del d["recs"]
        within = [(d["throughput_rps"], int(c)) for c, d in by_c.items()
                  if d["ttft_p95_ms"] is not None and d["ttft_p95_ms"] <= ttft_target_ms]
        best = max(within, default=(0.0, 0))
        by_c["within_target"] = {"throughput_rps": best[0], "clients": best[1]}
    return out


def identity(runs: list[dict], four: dict | None) -> dict:
    """Answers to the same request (its row index k), request by request: batched against one-at-a-time at each
    client count and round, and across client counts (every system's answer at c clients against one-at-a-time's
    at the fewest clients, the reference)."""
    by: dict[tuple[str, int, int], dict] = {}  # (system, clients, k) -> record (the last round serving k)
    for run in runs:
        if run["system"] in ("batched", "one-at-a-time"):
            for r in run["recs"]:
                by[(run["system"], run["clients"], r["k"])] = r
    exact_same = exact_diff = approx_same = approx_diff = across_same = across_diff = 0
    diffs = []
    least = min((c for _, c, _ in by), default=0)
    for (system, c, k), b in sorted(by.items(), key=lambda x: (x[0][1], x[0][2], x[0][0])):
        pairs = []
        if system == "batched":
            pairs.append(("one-at-a-time", c, "same clients"))
        if c != least:
            pairs.append(("one-at-a-time", least, "across clients"))
        for other, oc, how in pairs:
            a = by.get((other, oc, k))
            if a is None or not (a["ok"] and b["ok"]):
                continue
            same = a["answer"] == b["answer"]
            exact = a["exact"] and b["exact"]
            if how == "across clients":
                if exact:
                    across_same += same
                    across_diff += not same
            elif exact:
                exact_same += same
                exact_diff += not same
            else:
                approx_same += same
                approx_diff += not same
            if exact and not same:
                diffs.append({"request": k, "a": [system, c], "b": [other, oc], "answer_a": b["answer"],
                              "answer_b": a["answer"], "tiers": [b["tier"], a["tier"]]})
    out = {"closed_loop": {"exact_compared": exact_same + exact_diff, "exact_identical": exact_same,
                           "approximate_compared": approx_same + approx_diff, "approximate_identical": approx_same,
                           "across_clients_compared": across_same + across_diff,
                           "across_clients_identical": across_same, "exact_differences": diffs[:10]}}
    if four is not None:
        ref = {}
        for run in four["runs"]:
            if run["system"] == "one-at-a-time" and run["how"] == "one after another":
                ref[run["trial"]] = run
        n = same = 0
        for run in four["runs"]:
            if run["system"] == "batched" and run["trial"] in ref:
                for x, y in zip(run["answers"], ref[run["trial"]]["answers"]):
                    n += 1
                    same += x == y
        out["four_at_once"] = {"compared": n, "identical": same}
    return out


def run(args) -> dict:
    # local: the engine and .runner import torch: loaded when a run starts, not on --help
    from ..serving.engine import Engine
    from .runner import machine_info, set_threads

    t_start = time.monotonic()
    threads, blas = set_threads(args.threads)
    clients = [int(c) for c in args.clients.split(",")]
    max_new = args.max_new_tokens or (8 if args.smoke else 32)
    model = {"model": args.model} if args.model else {}
    settings = Settings.from_overrides(cache_size="256MB", max_new_tokens=max(max_new, args.four_max_new_tokens),
                                       max_batch=BATCH, enable_drafts=not args.no_drafts, **model,
                                       **({"prefill_chunk_tokens": args.prefill_chunk_tokens}
                                          if args.prefill_chunk_tokens else {}))
    engine = Engine(settings, log=logging.getLogger("simllm_ros.engine"))
    engine.load(progress=lambda m: log.info(m))
    backend = engine.loaded_backend()
    rows = wl.generate(args.workload, n=None, seed=args.seed)
    systems, status = make_systems(engine, max_new, threads, want_llama=not args.no_llama and not args.smoke,
                                   want_peers=not args.engines_only)
    names = list(systems)
    log.info(f"systems: {names}; exact batching: {backend.batches_exactly}")
    runs = []
    progress = not args.no_progress
    for c in clients:
        for r in range(args.rounds):
            # Round r serves the same requests at every client count (rows[warm + r * requests ...], issued in
            # that order), each system from the same pool: emptied, then the warm requests (the context in the
            # pool before anything is timed, as on a running node). So answers/s at 1 and 8 clients are of one
            # set of requests, and every request's answers compare one by one (identity).
            offset = args.warm + r * args.requests
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                warm_up(systems[name], rows, args.warm, max_new)
                res = closed_loop(systems[name], rows, offset, args.requests, c, max_new)
                runs.append({"system": name, "clients": c, "round": r, **res})
                if progress:
                    d = res["recs"]
                    ok = [x for x in d if x["ok"]]
                    print(f"  {name:14s} clients {c}  round {r}: {len(ok)}/{len(d)} in {res['wall_s']:.1f} s "
                          f"({len(ok) / res['wall_s']:.2f}/s), TTFT p95 "
                          f"{percentile([x['ttft_ms'] for x in ok], 95) or 0:.0f} ms"
                          + (f"\n    ({breakdown_text(res['steps'])})" if res.get("steps") else ""), flush=True)
    four = None
    if args.four_trials:
        four = four_at_once(systems, rows, args.four_trials, args.four_max_new_tokens)
        if progress:
            for run_ in four["runs"]:
                print(f"  four at once, trial {run_['trial']}: {run_['system']:14s} {run_['how']:18s} "
                      f"{run_['wall_s']:.1f} s" + (f"  ({breakdown_text(run_['steps'])})" if run_.get("steps") else ""),
                      flush=True)
    for s in systems.values():
        s.close()
    summary = summarize(runs, args.ttft_target_ms)
    res = {"smoke": bool(args.smoke), "argv": args.argv, "machine": machine_info(threads), "status": status,
           "exact_batching": backend.batches_exactly, "dtype": backend.dtype_name,
           "kv_bits": engine.kv_bits, "workload": args.workload, "clients": clients, "rounds": args.rounds,
           "requests_per_round": args.requests, "max_new_tokens": max_new, "ttft_target_ms": args.ttft_target_ms,
           "summary": summary, "identity": identity(runs, four), "four_at_once": four,
           "runs": [{k: v for k, v in r.items()} for r in runs], "wall_s": time.monotonic() - t_start}
    res["headline"] = headline(res)
    del blas
    return res


def headline(res: dict) -> dict:
    sm = res["summary"]
    h = {}
    top = str(max(res["clients"]))
    b, one = sm.get("batched", {}), sm.get("one-at-a-time", {})
    if top in b and top in one and one[top]["throughput_rps"]:
        h[f"throughput_ratio_at_{top}_clients"] = b[top]["throughput_rps"] / one[top]["throughput_rps"]
    least = str(min(res["clients"]))
    if top != least and top in b and least in one and one[least]["throughput_rps"]:  # the same requests
        h[f"batched_{top}_clients_vs_one_at_a_time_{least}"] = b[top]["throughput_rps"] / one[least]["throughput_rps"]
    wb, wo = b.get("within_target", {}), one.get("within_target", {})
    if wo.get("throughput_rps"):
        h["rate_within_ttft_target_ratio"] = wb.get("throughput_rps", 0.0) / wo["throughput_rps"]
    elif wb.get("throughput_rps"):
        h["rate_within_ttft_target_ratio"] = float("inf")
    four = res.get("four_at_once")
    if four:
        def med(name, how):
            xs = [r["wall_s"] for r in four["runs"] if r["system"] == name and r["how"] == how]
            return percentile(xs, 50)
        tog, seq, one_tog = med("batched", "together"), med("one-at-a-time", "one after another"), \
            med("one-at-a-time", "together")
        if tog and seq:
            h["four_together_vs_one_after_another"] = tog / seq
        if one_tog and seq:
            h["four_together_one_at_a_time_engine"] = one_tog / seq
    return h


def write_report(res: dict, out: str) -> list[str]:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(res, f, indent=1, default=float)
    lines = [f"# Many users at once: {res['workload']}, {res['dtype']}, kv_bits {res['kv_bits']}",
             "",
             f"Machine: {res['machine']['cpu']}, {res['machine']['cores']} cores, torch threads "
             f"{res['machine']['torch_threads']}, load average at start {res['machine']['loadavg_start']}. "
             f"Batched forward exact on this machine: {res['exact_batching']}. Clients {res['clients']}, "
             f"{res['rounds']} rounds x {res['requests_per_round']} requests per system and client count, systems "
             f"interleaved; max_new_tokens {res['max_new_tokens']}; drafts "
             f"{'on' if res['status']['batched'].get('drafts', True) else 'off (--no-drafts)'}. Wall time "
             f"{res['wall_s']:.0f} s.",
             "",
             "| system | clients | answers | throughput (/s) | TTFT p50 ms | TTFT p95 ms | latency p95 ms | tiers |",
             "|---|---|---|---|---|---|---|---|"]
    for s, by_c in res["summary"].items():
        for c in res["clients"]:
            d = by_c.get(str(c))
            if d is None:
                continue
            lines.append(f"| {s} | {c} | {d['n'] - d['errors']}/{d['n']} | {d['throughput_rps']:.3f} | "
                         f"{d['ttft_p50_ms'] or 0:.0f} | {d['ttft_p95_ms'] or 0:.0f} | "
                         f"{d['latency_p95_ms'] or 0:.0f} | "
                         f"{', '.join(f'{k} {v}' for k, v in d['tiers'].items())} |")
    lines += ["", f"Sustained rate with p95 TTFT <= {res['ttft_target_ms']:.0f} ms (best client count):"]
    for s, by_c in res["summary"].items():
        w = by_c["within_target"]
        lines.append(f"- {s}: {w['throughput_rps']:.3f}/s" + (f" at {w['clients']} clients" if w["clients"] else
                                                                " (no client count met the target)"))
    lines += ["", "Headline ratios:"] + [f"- {k}: {v:.2f}" for k, v in res["headline"].items()]
    idn = res["identity"]
    cl = idn["closed_loop"]
    lines += ["", f"Identity, batched vs one-at-a-time, same requests: {cl['exact_identical']}/{cl['exact_compared']} "
              f"exact answers identical; approximate (SEMANTIC on either side) {cl['approximate_identical']}/"
              f"{cl['approximate_compared']} identical; each request at more clients against one-at-a-time at the "
              f"fewest: {cl.get('across_clients_identical', 0)}/{cl.get('across_clients_compared', 0)} identical."]
    if "four_at_once" in idn:
        lines.append(f"Four at once: {idn['four_at_once']['identical']}/{idn['four_at_once']['compared']} answers "
                     "identical to the same four one after another.")
    loops = [r for r in res["runs"] if r.get("steps")]
    if loops:
        lines += ["", "Closed loop, batched, where the time went (batcher's step trace):"]
        lines += [f"- {r['clients']} clients, round {r['round']}, {r['wall_s']:.2f} s: {breakdown_text(r['steps'])}"
                  for r in loops]
    steps = [r for r in (res.get("four_at_once") or {}).get("runs", []) if r.get("steps")]
    if steps:
        lines += ["", "Four at once, batched, where the time went (batcher's step trace):"]
        lines += [f"- trial {r['trial']}, {r['wall_s']:.2f} s: {breakdown_text(r['steps'])}" for r in steps]
    lines += ["", "Peers: " + "; ".join(f"{k}: {v['status']}" + (f" ({v['error']})" if v.get("error") else "")
                                       for k, v in res["status"].items())]
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    paths = [os.path.join(out, "results.json"), os.path.join(out, "results.md")]
    try:
        paths.append(plot(res, out))
    except ImportError:  # pragma: no cover - matplotlib is in requirements
        pass
    return paths


def plot(res: dict, out: str) -> str:
    # local: matplotlib is heavy and only the plot needs it
    import matplotlib

    matplotlib.use("Agg")
    # local: pyplot after matplotlib.use("Agg") (the backend is chosen first)
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    for s, by_c in res["summary"].items():
        cs = [c for c in res["clients"] if str(c) in by_c]
        ax1.plot(cs, [by_c[str(c)]["throughput_rps"] for c in cs], marker="o", label=s)
        ax2.plot(cs, [by_c[str(c)]["ttft_p95_ms"] or 0 for c in cs], marker="o", label=s)
    ax1.set_xlabel("closed-loop clients")
    ax1.set_ylabel("answers per second")
    ax1.set_title("throughput")
    ax2.axhline(res["ttft_target_ms"], color="grey", ls="--", lw=1)
    ax2.set_xlabel("closed-loop clients")
    ax2.set_ylabel("TTFT p95 (ms)")
    ax2.set_yscale("log")
    ax2.set_title("time to first token, p95")
    for ax in (ax1, ax2):
        ax.set_xticks(res["clients"])
        ax.grid(alpha=0.3)
    ax1.legend()
    fig.suptitle(f"{res['workload']}, max_new_tokens {res['max_new_tokens']}, {res['machine']['torch_threads']} "
                 f"torch thread(s), {res['dtype']}")
    fig.tight_layout()
    path = os.path.join(out, "throughput_vs_clients.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_arguments(ap) -> None:
    ap.add_argument("--smoke", action="store_true", help="1 and 2 clients, a few requests (for CI)")
    ap.add_argument("--out", default=None, help=f"output folder (default {DEFAULT_OUT}; with --smoke {SMOKE_OUT})")
    ap.add_argument("--clients", default="", help="comma-separated client counts (default 1,2,4,8)")
    ap.add_argument("--rounds", type=int, default=0, help="rounds per client count (default 2)")
    ap.add_argument("--requests", type=int, default=0, help="requests per system per round (default 16)")
    ap.add_argument("--warm", type=int, default=4, help="untimed requests per system first")
    ap.add_argument("--workload", default="edge-bulletin", choices=("edge-bulletin", "robot-state", "mixed"))
    ap.add_argument("--max-new-tokens", type=int, default=0, help="answer length in the closed loop (default 32)")
    ap.add_argument("--four-max-new-tokens", type=int, default=48)
    ap.add_argument("--four-trials", type=int, default=-1, help="trials of the four-at-once phase (default 3)")
    ap.add_argument("--ttft-target-ms", type=float, default=1000.0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the machine is shared)")
    ap.add_argument("--model", default="", help="the engines' model (a GGUF path; default the embedded one); "
                    "peers other than the engines need --engines-only then")
    ap.add_argument("--no-llama", action="store_true", help="leave llama-cpp out even where it is installed")
    ap.add_argument("--engines-only", action="store_true", help="only batched and one-at-a-time (no peers)")
    ap.add_argument("--no-drafts", action="store_true",
                    help="both engines without drafts (enable_drafts off): every answer token decoded one step at "
                         "a time, the memory-bound case batching is for")
    ap.add_argument("--prefill-chunk-tokens", type=int, default=0,
                    help="the batched engine's prefill_chunk_tokens (default: the setting's default)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--no-progress", action="store_true")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="simllm-bench concurrency", description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args.argv = ["concurrency"] + list(argv)
    args.clients = args.clients or ("1,2" if args.smoke else "1,2,4,8")
    args.rounds = args.rounds or (1 if args.smoke else 2)
    args.requests = args.requests or (4 if args.smoke else 16)
    if args.four_trials < 0:
        args.four_trials = 1 if args.smoke else 3
    if args.smoke:
        args.four_max_new_tokens = min(args.four_max_new_tokens, 8)
    out = args.out or (SMOKE_OUT if args.smoke else DEFAULT_OUT)
    res = run(args)
    paths = write_report(res, out)
    print(f"wrote {', '.join(paths)} (wall time {res['wall_s']:.0f} s)")
    for k, v in res["headline"].items():
        print(f"  {k}: {v:.2f}")
    idn = res["identity"]["closed_loop"]
    print(f"  identical exact answers, batched vs one-at-a-time: {idn['exact_identical']}/{idn['exact_compared']}; "
          f"across client counts: {idn['across_clients_identical']}/{idn['across_clients_compared']}")
    if "four_at_once" in res["identity"]:
        f = res["identity"]["four_at_once"]
        print(f"  four at once, identical answers: {f['identical']}/{f['compared']}")
    return 0
