"""CPU an active node spends while nobody asks it anything (target: under 1% of a core).

A robot's computer runs the node all day between questions; a worker pool that spins, or a timer that wakes too
often, costs battery and thermal headroom the robot's own stack needs. This starts `simllm_node` (the embedded
model, config/edge.yaml, the kernels' workers on every core), sends a few real questions so that every worker thread,
timer and publisher has started, waits --settle seconds, then reads the process's CPU time (all threads, from
/proc) over --seconds of idle, and again over a burst of questions for scale.

Run: .venv/bin/simllm-bench idle_cpu [--seconds 30]
Prints one line per phase; writes nothing else.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import Any

from .shared import REPO_ROOT as REPO


def cpu_seconds(pid: int) -> float:
    """User + system time of the process and all its threads, in seconds."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--settle", type=float, default=5.0)
    args = ap.parse_args(argv)

    os.environ.setdefault("ROS_DOMAIN_ID", str(70 + os.getpid() % 100))
    os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    node = subprocess.Popen([sys.executable, "-m", "simllm_ros.cli.edge", "--param", "persist_path=", "--ros-args",
                             "--params-file", os.path.join(REPO, "config", "edge.yaml")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    try:
        # local: ROS only when this benchmark runs (simllm-bench's other benchmarks work without ROS)
        import rclpy
        from rclpy.client import Client
        from rclpy.node import Node

        from simllm_ros.srv import Query

        rclpy.init()
        me = Node("idle_cpu_probe")
        cli: Client[Any, Any] = me.create_client(Query, "/simllm_node/query")  # Query is generated, untyped
        if not cli.wait_for_service(timeout_sec=240):
            print("the node's query service did not appear within 240 s")
            return 1

        def ask(prompt: str) -> None:
            req = Query.Request(prompt=prompt, context="Riverside bulletin: Elm Street closed 09:00-17:00.",
                                max_new_tokens=16)
            fut = cli.call_async(req)
            rclpy.spin_until_future_complete(me, fut, timeout_sec=300)

        questions = ["is elm street open", "when does elm street reopen", "is elm street open",
                     "what is closed today"]
        for q in questions:  # every thread, timer and publisher starts
            ask(q)
        time.sleep(args.settle)
        c0, t0 = cpu_seconds(node.pid), time.monotonic()
        time.sleep(args.seconds)
        idle = (cpu_seconds(node.pid) - c0) / (time.monotonic() - t0)
        c0, t0 = cpu_seconds(node.pid), time.monotonic()
        for q in questions:
            ask(q)
        busy = (cpu_seconds(node.pid) - c0) / (time.monotonic() - t0)
        print(f"{os.cpu_count()} cores: idle {100 * idle:.2f}% of one core over {args.seconds:.0f} s "
              f"(target < 1%); answering {len(questions)} questions {100 * busy:.0f}% of one core")
        me.destroy_node()
        rclpy.shutdown()
        return 0
    finally:
        node.terminate()
        try:
            node.wait(timeout=30)
        except subprocess.TimeoutExpired:
            node.kill()


if __name__ == "__main__":
    sys.exit(main())
