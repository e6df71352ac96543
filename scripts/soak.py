#!/usr/bin/env python3
"""Soak test: thousands of requests through a real simllm_node, watching resident memory.

Starts the lifecycle node in this process (as test/conftest.py's RosHarness does: a node and a client
node spun by one MultiThreadedExecutor, talking over DDS on an isolated ROS domain), sends requests
drawn from CLINC150 (crowd-sourced assistant requests) with several bulletin contexts and cache
scopes, through the ~/query service and the ~/requests topic, a few at a time. Every --sample-every
answers it reads VmRSS from /proc/self/status. It prints RSS after warm-up vs at the end, the totals
(answered / busy / errors / lost / duplicates) and pool bytes vs budget.

Exit status 0 only if: no request was lost or answered twice, RSS grew at most --max-rss-growth
(fraction) from the end of warm-up to the end, no request failed with "internal error", and every
CacheStats sample and the final pool check stayed within the byte budget.

    .venv/bin/python scripts/soak.py --requests 2000
    .venv/bin/python scripts/soak.py --requests 60 --sample-every 10      # a quick check
"""
from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import random
import sys
import tempfile
import threading
import time
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

BULLETINS = [
    "",
    "Shift bulletin: the lab closes at 6 pm today; the charging dock is in room 2.",
    "Visitor notice: guests must sign in at the front desk and wear a badge at all times.",
    "Maintenance: the north elevator is out of service until Friday; use the stairs or the east lift.",
    "Kitchen: the coffee machine was descaled this morning; the fridge is cleared every Thursday.",
]
SCOPES = ["", "robot-1", "robot-2", "lab/arm:1", "visitor-desk"]


def data_dir() -> str:
    for d in (os.path.join(REPO, "..", "shared", "data", "clinc150"), "/work/shared/data/clinc150"):
        if os.path.isfile(os.path.join(d, "train.jsonl")):
            return os.path.abspath(d)
    raise SystemExit("CLINC150 not found: looked in <repo>/../shared/data/clinc150 and /work/shared/data/clinc150")


def load_texts(d: str) -> list[str]:
    out = []
    for name in ("train.jsonl", "val.jsonl", "oos_train.jsonl"):
        p = os.path.join(d, name)
        if os.path.exists(p):
            with open(p, encoding="utf-8") as f:
                out += [json.loads(line)["text"] for line in f if line.strip()]
    return out


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


_LIBC = None


def settled_rss() -> tuple[int, int]:
    """(raw, settled) VmRSS in KiB: raw after gc.collect(); settled after glibc malloc_trim(0) too, which
    hands back the free memory each allocator arena keeps (threads get their own arenas), so that
    what remains is memory in use. A leak shows in both."""
    global _LIBC
    gc.collect()
    raw = rss_kib()
    try:
        if _LIBC is None:
            import ctypes
            _LIBC = ctypes.CDLL("libc.so.6")
        _LIBC.malloc_trim(0)
    except (OSError, AttributeError):
        return raw, raw
    return raw, rss_kib()


def census() -> tuple[int, collections.Counter]:
    gc.collect()
    objs = gc.get_objects()
    return len(objs), collections.Counter(type(o).__name__ for o in objs)


def isolate_ros() -> None:
    """Unless the caller chose, a ROS domain nobody on this host uses, discovery limited to this host."""
    os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if "ROS_DOMAIN_ID" not in os.environ:
        from simllm_ros.ros.domain import pick_domain

        os.environ["ROS_DOMAIN_ID"] = str(pick_domain(os.getpid() + 101))


def parse_range(s: str) -> tuple[int, int]:
    a, _, b = s.partition("-")
    lo, hi = int(a), int(b or a)
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"bad range {s!r}")
    return lo, hi


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--max-new-tokens", type=parse_range, default=(2, 4), metavar="LO-HI")
    ap.add_argument("--concurrency", type=int, default=4, help="requests outstanding at a time")
    ap.add_argument("--topic-share", type=float, default=0.25, help="fraction sent on ~/requests")
    ap.add_argument("--cache-size", default="8MB")
    ap.add_argument("--queue-limit", type=int, default=8)
    ap.add_argument("--sample-every", type=int, default=100, help="read VmRSS every N answers")
    ap.add_argument("--warmup", type=int, default=0,
                    help="answers before the RSS baseline (default: a quarter, at least 20): the allocator's "
                         "per-thread arenas and torch's caches grow to their working size first")
    ap.add_argument("--max-rss-growth", type=float, default=0.05, help="allowed RSS growth after warm-up")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for any one answer")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--thermal-root", default="", help="default: a fake cool sysfs tree (no throttling)")
    ap.add_argument("--param", action="append", default=[], metavar="NAME=VALUE", help="extra node parameter")
    args = ap.parse_args(argv)
    warmup = args.warmup or max(20, args.requests // 4)
    if args.requests <= warmup:
        ap.error(f"--requests must exceed the warm-up ({warmup})")

    isolate_ros()
    import rclpy
    from rclpy.context import Context
    from rclpy.executors import ExternalShutdownException
    from rclpy.parameter import Parameter
    from rclpy.qos import QoSProfile, ReliabilityPolicy

    from simllm_ros.msg import CacheStats, QueryRequest, QueryResponse
    from simllm_ros.ros.node import SimLLMNode, make_executor
    from simllm_ros.ros.qos import CLIENT_QOS
    from simllm_ros.srv import Query

    texts = load_texts(data_dir())
    rng = random.Random(args.seed)
    tmp = tempfile.TemporaryDirectory(prefix="simllm_soak_")
    thermal_root = args.thermal_root
    if not thermal_root:
        thermal_root = os.path.join(tmp.name, "thermal")
        os.makedirs(os.path.join(thermal_root, "thermal_zone0"))
        with open(os.path.join(thermal_root, "thermal_zone0", "type"), "w") as f:
            f.write("cpu-thermal\n")
        with open(os.path.join(thermal_root, "thermal_zone0", "temp"), "w") as f:
            f.write("40000\n")
    overrides = {"cache_size": args.cache_size, "queue_limit": args.queue_limit, "thermal_root": thermal_root,
                 "max_new_tokens": args.max_new_tokens[1], "telemetry_period_s": 0.5}
    for p in args.param:
        k, _, v = p.partition("=")
        try:
            overrides[k] = json.loads(v)
        except ValueError:
            overrides[k] = v

    name = "simllm_soak"
    ctx = Context()
    rclpy.init(context=ctx)
    node = SimLLMNode(name, context=ctx,
                      cli_args=["--ros-args", "--params-file", os.path.join(REPO, "config", "edge.yaml")],
                      parameter_overrides=[Parameter(k, value=v) for k, v in overrides.items()])
    client = rclpy.create_node(f"soak_client_{os.getpid()}", context=ctx)
    executor = make_executor(node, context=ctx)
    executor.add_node(node)
    executor.add_node(client)

    def spin():
        try:
            executor.spin()
        except ExternalShutdownException:
            pass
    spin_thread = threading.Thread(target=spin, daemon=True)
    spin_thread.start()

    lock = threading.Condition()
    answers: dict[str, int] = {}  # topic request id -> responses received (more than one = a duplicate)
    stats_over = []
    n_stats = [0]
    last_stats = [None]

    def on_response(m):
        with lock:
            if m.request_id not in answers:
                return
            answers[m.request_id] += 1
            first = answers[m.request_id] == 1
        if first:
            record(m.request_id, m)

    def on_stats(m):
        with lock:
            n_stats[0] += 1
            last_stats[0] = m
            if m.bytes_used > m.bytes_budget:
                stats_over.append((m.bytes_used, m.bytes_budget))

    reliable = QoSProfile(depth=500, reliability=ReliabilityPolicy.RELIABLE)
    client.create_subscription(QueryResponse, f"/{name}/responses", on_response, reliable)
    client.create_subscription(CacheStats, f"/{name}/cache_stats", on_stats, 10)
    pub = client.create_publisher(QueryRequest, f"/{name}/requests", reliable)
    cli = client.create_client(Query, f"/{name}/query", qos_profile=CLIENT_QOS)

    from lifecycle_msgs.msg import Transition
    from lifecycle_msgs.srv import ChangeState

    def transition(tid: int) -> bool:
        c = client.create_client(ChangeState, f"/{name}/change_state")
        assert c.wait_for_service(timeout_sec=30), "lifecycle service missing"
        fut = c.call_async(ChangeState.Request(transition=Transition(id=tid)))
        done = threading.Event()
        fut.add_done_callback(lambda _f: done.set())
        if not done.wait(600):
            return False
        return fut.result().success

    rc = 1
    t_start = time.monotonic()
    try:
        print(f"soak: ROS_DOMAIN_ID={os.environ.get('ROS_DOMAIN_ID')} requests={args.requests} "
              f"max_new_tokens={args.max_new_tokens[0]}-{args.max_new_tokens[1]} concurrency={args.concurrency} "
              f"cache_size={args.cache_size} queue_limit={args.queue_limit} ({len(texts)} CLINC150 texts)",
              flush=True)
        if not (transition(1) and transition(3)):  # configure, activate
            print("soak: the node did not come up", file=sys.stderr)
            return 1
        assert cli.wait_for_service(timeout_sec=30)
        if not _wait(lambda: pub.get_subscription_count() >= 1, 30):
            print("soak: ~/requests has no subscriber", file=sys.stderr)
            return 1
        rss_start = rss_kib()

        slots = threading.Semaphore(args.concurrency)
        results: dict[str, bool] = {}  # service ids answered (id + "#dup" for a second answer)
        sent_at: dict[str, float] = {}
        done_count = [0]
        totals = {"answered": 0, "busy": 0, "refused": 0, "internal": 0}
        hits = {}
        latencies = []
        rss_samples = []  # (answers, KiB)
        rss_warm = [None]
        rss_warm_raw = [None]
        objs_warm = None

        def record(rid: str, res) -> None:
            with lock:
                done_count[0] += 1
                latencies.append(time.monotonic() - sent_at.pop(rid))
                if res.success:
                    totals["answered"] += 1
                    hits[res.cache_result] = hits.get(res.cache_result, 0) + 1
                elif res.error.startswith("busy:"):
                    totals["busy"] += 1
                elif res.error.startswith("internal error"):
                    totals["internal"] += 1
                    print(f"soak: {rid}: {res.error}", file=sys.stderr)
                else:
                    totals["refused"] += 1
                    print(f"soak: {rid}: {res.error}", file=sys.stderr)
                lock.notify_all()
            slots.release()

        topic_ids = []
        for i in range(args.requests):
            if not slots.acquire(timeout=args.timeout):
                print(f"soak: no answer for {args.timeout:.0f} s; giving up at request {i}", file=sys.stderr)
                break
            prompt = rng.choice(texts)
            context = rng.choice(BULLETINS)
            scope = rng.choice(SCOPES)
            mnt = rng.randint(*args.max_new_tokens)
            approx = rng.random() < 0.9
            rid = f"soak-{i}-{uuid.uuid4().hex[:8]}"
            with lock:
                sent_at[rid] = time.monotonic()
            if rng.random() < args.topic_share:
                with lock:
                    answers[rid] = 0
                topic_ids.append(rid)
                pub.publish(QueryRequest(request_id=rid, prompt=prompt, context=context, cache_scope=scope,
                                         max_new_tokens=mnt, allow_approximate=approx))
            else:
                fut = cli.call_async(Query.Request(prompt=prompt, context=context, cache_scope=scope,
                                                   max_new_tokens=mnt, allow_approximate=approx))

                def on_done(f, rid=rid):
                    with lock:
                        dup = rid in results
                        results[rid + "#dup" if dup else rid] = True
                    if not dup:
                        record(rid, f.result())
                fut.add_done_callback(on_done)
            with lock:
                n = done_count[0]
            if rss_warm[0] is None and n >= warmup:
                raw, rss_warm[0] = settled_rss()
                rss_warm_raw[0] = raw
                rss_samples.append((n, rss_warm[0]))
                objs_warm = census()
                print(f"soak: warm-up done after {n} answers: RSS {rss_warm[0] / 1024:.1f} MiB "
                      f"(raw {raw / 1024:.1f}), {objs_warm[0]} Python objects", flush=True)
            elif rss_samples and n - rss_samples[-1][0] >= args.sample_every:
                raw, settled = settled_rss()
                rss_samples.append((n, settled))
                el = time.monotonic() - t_start
                print(f"soak: {n} answered or refused, RSS {settled / 1024:.1f} MiB (raw {raw / 1024:.1f}), "
                      f"{n / el:.2f} req/s", flush=True)

        # wait for everything outstanding
        with lock:
            lock.wait_for(lambda: done_count[0] >= args.requests, timeout=args.timeout)
        time.sleep(1.0)  # a duplicate answer would arrive now
        rss_end_raw, rss_end = settled_rss()
        objs_end = census()
        if rss_warm[0] is None:
            rss_warm[0], rss_warm_raw[0] = rss_end, rss_end_raw
        elapsed = time.monotonic() - t_start
        with lock:
            n_done = done_count[0]
            dup = sum(1 for k in results if k.endswith("#dup")) + sum(max(0, c - 1) for c in answers.values())
            lost_topic = sum(1 for rid in topic_ids if answers[rid] == 0)
            n_service = args.requests - len(topic_ids)
            lost_service = n_service - sum(1 for k in results if not k.endswith("#dup"))
            st = last_stats[0]
        lost = lost_topic + lost_service
        engine = node._engine
        pool_ok = True
        try:
            engine.pool.check_consistency()
        except AssertionError as e:
            pool_ok = False
            print(f"soak: pool inconsistent: {e}", file=sys.stderr)
        growth = (rss_end - rss_warm[0]) / rss_warm[0]
        mid = rss_samples[len(rss_samples) // 2][1] if rss_samples else rss_warm[0]
        growth_late = (rss_end - mid) / mid
        lat = sorted(latencies)

        def pct(q):
            return lat[min(len(lat) - 1, int(q * (len(lat) - 1)))] if lat else 0.0
        names = {0: "MISS", 1: "EXACT_PREFIX", 2: "SEMANTIC", 3: "ANSWER"}
        print(f"soak: {args.requests} requests ({n_service} service, {len(topic_ids)} topic) in {elapsed:.0f} s "
              f"({args.requests / elapsed:.2f} req/s)")
        print(f"soak: answered {totals['answered']}, busy {totals['busy']}, refused {totals['refused']}, "
              f"internal errors {totals['internal']}, lost {lost}, duplicates {dup}")
        print(f"soak: tiers {', '.join(f'{names.get(k, k)} {v}' for k, v in sorted(hits.items()))}; "
              f"latency p50 {pct(.5):.2f} s, p95 {pct(.95):.2f} s, max {pct(1.0):.2f} s")
        print(f"soak: RSS start {rss_start / 1024:.1f} MiB, after warm-up ({warmup} answers) "
              f"{rss_warm[0] / 1024:.1f} MiB, end {rss_end / 1024:.1f} MiB: growth {100 * growth:+.2f}% "
              f"(limit {100 * args.max_rss_growth:.1f}%), second half {100 * growth_late:+.2f}%; "
              "samples (answers:MiB): "
              + " ".join(f"{n}:{k / 1024:.0f}" for n, k in rss_samples))
        print(f"soak: raw RSS (without malloc_trim) after warm-up {rss_warm_raw[0] / 1024:.1f} MiB, end "
              f"{rss_end_raw / 1024:.1f} MiB ({100 * (rss_end_raw - rss_warm_raw[0]) / rss_warm_raw[0]:+.2f}%)")
        if objs_warm is not None:
            grown = (objs_end[1] - objs_warm[1]).most_common(5)
            print(f"soak: Python objects after warm-up {objs_warm[0]}, end {objs_end[0]}"
                  + (f"; most grown types: {', '.join(f'{t} +{c}' for t, c in grown)}" if grown else ""))
        print(f"soak: pool {engine.pool.bytes_used} of {engine.pool.budget_bytes} bytes, {len(engine.pool)} entries"
              + (f", {st.evictions_total} evictions" if st is not None else "")
              + f"; {n_stats[0]} CacheStats samples, {len(stats_over)} over budget; consistency "
              + ("ok" if pool_ok else "FAILED"))
        failures = []
        if lost or n_done < args.requests:
            failures.append(f"{lost} lost")
        if dup:
            failures.append(f"{dup} duplicates")
        if growth > args.max_rss_growth:
            failures.append(f"RSS grew {100 * growth:.1f}%")
        if totals["internal"]:
            failures.append(f"{totals['internal']} internal errors")
        if stats_over or not pool_ok or engine.pool.bytes_used > engine.pool.budget_bytes:
            failures.append("pool over budget or inconsistent")
        print("soak: " + ("PASS" if not failures else "FAIL: " + ", ".join(failures)), flush=True)
        rc = 0 if not failures else 1
    finally:
        try:
            node.trigger_shutdown()
        except Exception:
            pass
        executor.shutdown(timeout_sec=10)
        spin_thread.join(timeout=30)
        client.destroy_node()
        node.destroy_node()
        rclpy.shutdown(context=ctx)
        tmp.cleanup()
    return rc


def _wait(pred, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


if __name__ == "__main__":
    sys.exit(main())
