"""simllm-replay: start the node (or use a running one) and replay a JSON Lines workload through its Query service.

This is the main job of the README's first command: it shows, per request, which
cache tier answered and how long the first token took, then the node's own
CacheStats, all over real DDS between two processes.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: rclpy is imported once the node is started
    from rclpy.client import Client

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIERS = {0: "MISS", 1: "EXACT_PREFIX", 2: "SEMANTIC", 3: "ANSWER"}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="simllm-replay", description=__doc__)
    ap.add_argument("workload", nargs="?", default=os.path.join(REPO, "config", "demo_workload.jsonl"),
                    help="JSON Lines requests: {prompt, context?, scope?, max_new_tokens?, request_id?}")
    ap.add_argument("--params-file", default=os.path.join(REPO, "config", "edge.yaml"))
    ap.add_argument("--node", default="/simllm_node", help="node name of the service to call")
    ap.add_argument("--no-start", action="store_true", help="use an already running node; do not start one")
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for each answer")
    ap.add_argument("--json-out", default="", help="also write every response as JSON Lines here")
    ap.epilog = "Arguments after '--' go to simllm-edge (e.g. -- --param persist_path=var/pool)."
    argv = list(sys.argv[1:] if argv is None else argv)
    node_args = argv[argv.index("--") + 1:] if "--" in argv else []
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.node_args = node_args
    return args


def start_node(args) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "simllm_ros.cli.edge"]
    cmd += args.node_args + ["--ros-args", "--params-file", args.params_file]
    print(f"[replay] starting node: {' '.join(cmd)}", flush=True)
    return subprocess.Popen(cmd, cwd=REPO, start_new_session=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    # local: warm_start imports torch (seconds): --help and argument errors answer without it
    from simllm_ros.serving.warm_start import read_requests_jsonl

    reqs = read_requests_jsonl(args.workload)
    proc = None if args.no_start else start_node(args)
    # local: ROS once the node is started: --help and argument errors answer without ROS
    import rclpy
    from rclpy.executors import SingleThreadedExecutor
    from simllm_ros.msg import CacheStats
    from simllm_ros.ros.qos import CLIENT_QOS
    from simllm_ros.srv import Query

    rclpy.init()
    node = rclpy.create_node("simllm_replay")
    client: Client[Any, Any] = node.create_client(Query, f"{args.node}/query", qos_profile=CLIENT_QOS)  # untyped srv
    last_stats: dict = {}

    def on_stats(msg):
        last_stats.clear()
        last_stats.update({f: getattr(msg, f) for f in msg.get_fields_and_field_types() if f != "stamp"})

    node.create_subscription(CacheStats, f"{args.node}/cache_stats", on_stats, 10)
    ex = SingleThreadedExecutor()
    ex.add_node(node)
    spin = threading.Thread(target=ex.spin, daemon=True)
    spin.start()
    rc = 0
    out = open(args.json_out, "w") if args.json_out else None
    try:
        t0 = time.monotonic()
        while not client.wait_for_service(timeout_sec=1.0):
            if proc is not None and proc.poll() is not None:
                print(f"[replay] the node exited with code {proc.returncode} before serving", flush=True)
                return 1
            if time.monotonic() - t0 > args.startup_timeout:
                print("[replay] no Query service within the startup timeout", flush=True)
                return 1
        print(f"[replay] service ready after {time.monotonic() - t0:.1f} s; replaying {len(reqs)} requests "
              f"from {os.path.relpath(args.workload)}", flush=True)
        print(f"{'#':>3} {'tier':<13} {'sim':>5} {'reused/prompt':>13} {'ttft ms':>8} {'total ms':>8}  "
              "question -> answer")
        ttft_by_prompt: dict[tuple, list[float]] = {}
        for i, r in enumerate(reqs):
            q = Query.Request(prompt=r.prompt, context=r.context, cache_scope=r.cache_scope,
                              max_new_tokens=r.max_new_tokens, allow_approximate=r.allow_approximate)
            fut = client.call_async(q)
            t_send = time.monotonic()
            while not fut.done() and time.monotonic() - t_send < args.timeout:
                time.sleep(0.005)
            if not fut.done():
                print(f"{i:>3} TIMEOUT after {args.timeout} s: {r.prompt[:50]}")
                rc = 1
                continue
            res = fut.result()
            if res is None or not res.success:
                print(f"{i:>3} ERROR {'no response' if res is None else res.error}")
                rc = 1
                continue
            tier = TIERS.get(res.cache_result, str(res.cache_result))
            print(f"{i:>3} {tier:<13} {res.similarity:5.2f} {res.reused_tokens:>6}/{res.prompt_tokens:<6} "
                  f"{res.ttft_ms:8.1f} {res.total_ms:8.1f}  {r.prompt[:40]!r} -> {res.answer[:60]!r}", flush=True)
            ttft_by_prompt.setdefault((r.prompt, r.context), []).append(res.ttft_ms)
            if out:
                out.write(json.dumps({"request_id": r.request_id, "prompt": r.prompt, "tier": tier,
                                      **{f: getattr(res, f) for f in res.get_fields_and_field_types()}}) + "\n")
        time.sleep(1.5)  # one more telemetry period, so the stats include the last request
        if last_stats:
            print("[replay] final CacheStats from the node:")
            for k, v in last_stats.items():
                print(f"    {k:<26} {v:.4g}" if isinstance(v, float) else f"    {k:<26} {v}")
        repeats = [(v[0], min(v[1:])) for v in ttft_by_prompt.values() if len(v) > 1]
        if repeats:
            first = sum(a for a, _ in repeats) / len(repeats)
            again = sum(b for _, b in repeats) / len(repeats)
            print(f"[replay] repeated requests: first run TTFT {first:.1f} ms, repeat {again:.1f} ms "
                  f"({first / max(again, 1e-6):.1f}x faster)")
    finally:
        if out:
            out.close()
        ex.shutdown()
        spin.join(timeout=5)
        node.destroy_node()
        rclpy.try_shutdown()
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    return rc


if __name__ == "__main__":
    sys.exit(main())
