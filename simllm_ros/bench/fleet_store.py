"""The fleet store, side by side in one run on one machine: one redis-server, and engines on the embedded model in
one process, each with its own pool and its own Redis connection: robot1 (serves first), robot2 (a new robot, its
pool emptied before each measured request) and cold (no store, pool emptied: what robot2 would do alone).

  A. robot2's first request on a context robot1 has served (a question robot1 was not asked), and the very
     question robot1 answered: TTFT and total against cold, and whether the answers are identical;
  B. fetching a 250 / 1000 / 2000-token prefix's KV from Redis against prefilling it;
  C. Redis killed, paused (SIGSTOP) and restarted while 4 client threads send requests to robot2: requests lost,
     latency against the quiet run, time to reconnect.

Usage: .venv/bin/simllm-bench fleet_store [--questions 6] [--new 24] [--threads 1]"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import threading
import time

from simllm_ros.request import QueryRequest
from simllm_ros.settings import Settings
from .shared import REPO_ROOT as ROOT, RESULTS_DIR, offline, use_test_helpers

offline()
use_test_helpers()  # redis_server: the tests' redis-server launcher


def clinc_lines(every: int = 37) -> list[str]:
    path = os.path.join(ROOT, "..", "shared", "data", "clinc150", "train.jsonl")
    with open(path) as f:
        return [json.loads(line)["text"] for i, line in enumerate(f) if i % every == 0]


def context_of(tokenize, lines: list[str], n_tokens: int) -> str:
    """A bulletin of real assistant requests, about n_tokens long."""
    out, text = [], ""
    for line in lines:
        out.append(line.capitalize() + ".")
        text = " ".join(out)
        if len(tokenize(text)) >= n_tokens:
            break
    return text


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--questions", type=int, default=6)
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, "fleet_store.json"))
    a = ap.parse_args(argv)

    # local: torch and the engine load when a run starts: --help goes without them
    import torch

    torch.set_num_threads(a.threads)
    # local: redis_server is a test helper (use_test_helpers); the rest import torch
    from redis_server import RedisServer
    from simllm_ros.cache import fleet_store
    from simllm_ros.serving.engine import Engine
    from simllm_ros.model.model_backend import auto_dtype

    dtype = auto_dtype("cpu")[0]
    lossless = dict(dtype="bfloat16", kv_bits=0) if dtype == "bfloat16" else dict(dtype="float32", kv_bits=32)
    server = RedisServer()
    base = Engine(Settings.from_overrides(max_prompt_tokens=4096, cache_size="2GB", **lossless))
    base.load(lambda m: None)
    backend = base.loaded_backend()
    secret = os.path.join(server.dir, "fleet.secret")  # KV blocks are shared only with a secret of the fleet's own
    with open(secret, "w", encoding="utf-8") as f:
        f.write(secrets.token_hex(32))
    fleet = dict(fleet_store_url=server.url, fleet_timeout_ms=50.0, fleet_secret_file=secret)
    robot1 = base.fork(base.settings.replace(**fleet))
    robot2 = base.fork(base.settings.replace(**fleet))
    cold = base.fork()
    fleet1, fleet2 = robot1.fleet, robot2.fleet
    if fleet1 is None or fleet2 is None:
        raise SystemExit("the robots did not open the fleet store")
    tok = lambda t: backend.tokenizer(t, add_special_tokens=False)["input_ids"]
    lines = clinc_lines()
    questions = [lines[200 + 7 * i].capitalize() + "?" for i in range(2 * a.questions)]
    context = context_of(tok, lines, 600)
    report: dict = {"model": base.settings.model, "dtype": backend.dtype_name, "threads": a.threads,
                    "kv_bytes_per_token": fleet1.bytes_per_token, "block_tokens": fleet_store.BLOCK_TOKENS}

    def req(q, ctx=context, scope="", rid=""):
        return QueryRequest(prompt=q, context=ctx, cache_scope=scope, max_new_tokens=a.new, allow_approximate=False,
                            request_id=rid)

    def empty(e):
        e.clear_pool()

    # A: robot1 serves half the questions; robot2 then asks both kinds, each on an empty pool, against cold.
    rows: dict[str, list[dict]] = {"new question on a served context": [], "the question robot1 answered": []}
    for q in questions[:a.questions]:
        r = robot1.handle(req(q))
        assert r.success, r.error
    fleet1.flush(60)
    for kind, qs in (("the question robot1 answered", questions[:a.questions]),
                     ("new question on a served context", questions[a.questions:])):
        for q in qs:
            empty(cold)
            c = cold.handle(req(q))
            empty(robot2)
            r = robot2.handle(req(q))
            assert c.success and r.success, (c.error, r.error)
            rows[kind].append({"cold_ttft": c.ttft_ms, "cold_total": c.total_ms, "ttft": r.ttft_ms,
                               "total": r.total_ms, "same": r.answer == c.answer, "reused": r.reused_tokens,
                               "prompt": r.prompt_tokens, "accepted": r.draft_tokens_accepted,
                               "generated": r.generated_tokens})
    report["A"] = {k: {"n": len(v), "cold_ttft_ms": med([x["cold_ttft"] for x in v]),
                       "ttft_ms": med([x["ttft"] for x in v]), "cold_total_ms": med([x["cold_total"] for x in v]),
                       "total_ms": med([x["total"] for x in v]),
                       "ttft_ratio": med([x["ttft"] / x["cold_ttft"] for x in v]),
                       "total_ratio": med([x["total"] / x["cold_total"] for x in v]),
                       "identical": sum(x["same"] for x in v), "reused_tokens": med([x["reused"] for x in v]),
                       "prompt_tokens": med([x["prompt"] for x in v]),
                       "draft_accepted": med([x["accepted"] for x in v]),
                       "generated": med([x["generated"] for x in v])} for k, v in rows.items()}

    # B: a prefix's KV fetched from Redis against prefilled, at three lengths (robot1 publishes it first).
    report["B"] = []
    for n in (250, 1000, 2000):
        ctx = context_of(tok, lines[::-1], n + 40)
        r = robot1.handle(req("Summarize this.", ctx, scope=f"len{n}"))
        assert r.success, r.error
        fleet1.flush(120)
        tokens = robot2.loaded_backend().chat_ids(robot2.settings.system_prompt, ctx, req("Summarize this.").turns())
        keep = min(n, len(tokens) - 1) // fleet_store.BLOCK_TOKENS * fleet_store.BLOCK_TOKENS
        fetch, prefill = [], []
        for _ in range(3):
            t0 = time.perf_counter()
            got, _ = fleet2.lookup(f"len{n}", tokens, have=0, limit=keep + 1, capacity=keep + 64,
                                  prefill_s_per_token=1.0, want_kv=True)
            fetch.append((time.perf_counter() - t0) * 1000)
            assert got is not None and got.n_tokens == keep, "the fleet did not give the prefix"
            t0 = time.perf_counter()
            backend.prefill(tokens[:keep])
            prefill.append((time.perf_counter() - t0) * 1000)
        report["B"].append({"tokens": keep, "mbytes": keep * fleet2.bytes_per_token / 1e6,
                            "fetch_ms": min(fetch), "prefill_ms": min(prefill), "ratio": min(fetch) / min(prefill)})

    # C: 4 clients on robot2 while Redis is killed, paused and restarted.
    def run_clients(n_per_client: int, chaos: bool) -> dict:
        lat, lost, events = [], [0], {}
        lock = threading.Lock()
        done = [0]

        def client(c):
            for i in range(n_per_client):
                q = questions[(c * 3 + i) % len(questions)]
                t0 = time.perf_counter()
                r = robot2.handle(req(q, scope=f"c{c % 2}", rid=f"c{c}-{i}"))
                ms = (time.perf_counter() - t0) * 1000
                with lock:
                    done[0] += 1
                    if not r.success:
                        lost[0] += 1
                    lat.append(ms)
                if i % 3 == 2:
                    robot2.clear_pool()  # keep misses in the mix

        threads = [threading.Thread(target=client, args=(c,)) for c in range(4)]
        total = 4 * n_per_client
        for t in threads:
            t.start()
        if chaos:
            def at(frac):
                while done[0] < frac * total:
                    time.sleep(0.01)
            at(0.2)
            server.kill()
            at(0.4)
            server.start()
            t_up = time.monotonic()
            while fleet2.state != "connected" and time.monotonic() - t_up < 60:
                time.sleep(0.01)
            events["reconnect_s"] = time.monotonic() - t_up
            at(0.6)
            server.pause()
            time.sleep(2.0)
            server.resume()
        for t in threads:
            t.join()
        return {"requests": total, "lost": lost[0], "p50_ms": med(lat), "max_ms": max(lat), **events}

    robot2.clear_pool()
    quiet = run_clients(6, chaos=False)
    robot2.clear_pool()
    chaos = run_clients(6, chaos=True)
    report["C"] = {"quiet": quiet, "chaos": chaos, "errors": fleet2.counters.errors,
                   "reconnects_s": fleet2.reconnects}
    for e in (robot1, robot2, cold):
        e.unload()
    base.unload()
    server.close()
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
