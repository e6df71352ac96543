"""`simllm-query`: ask a running simllm_node through its Query service and print the answer as JSON.

    simllm-query "prompt" [--context TEXT | --context-file F] [--scope S] [--max-new-tokens N]
                 [--no-approximate] [--timeout S] [--node /simllm_node] [--ros-args ...]

Prints every response field (cache_result by name). Exit code 0 on success, 1 when the node
answers success=false or nothing answers within --timeout, 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="simllm-query", description="Query the simllm_ros LLM node.")
    p.add_argument("prompt")
    ctx = p.add_mutually_exclusive_group()
    ctx.add_argument("--context", default="", help="shared context placed before the prompt")
    ctx.add_argument("--context-file", metavar="F", help="read the context from a file ('-' for stdin)")
    p.add_argument("--scope", default="", help="cache namespace (default scope when empty)")
    p.add_argument("--max-new-tokens", type=int, default=0, metavar="N", help="0: the node's default")
    p.add_argument("--no-approximate", action="store_true", help="exact reuse only (no SEMANTIC / ANSWER)")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S",
                   help="seconds to wait for the service and the answer (default 60)")
    p.add_argument("--node", default="/simllm_node", help="node name (default /simllm_node)")
    return p


def response_to_dict(resp) -> dict:
    from simllm_ros.request import CacheResult
    d = {}
    for field in resp.get_fields_and_field_types():
        v = getattr(resp, field)
        if isinstance(v, float):
            v = round(v, 3) if math.isfinite(v) else None
        d[field] = v
    try:
        d["cache_result"] = CacheResult(resp.cache_result).name
    except ValueError:
        d["cache_result"] = f"UNKNOWN({resp.cache_result})"
    return d


def main(argv: list[str] | None = None) -> int:
    from rclpy.utilities import remove_ros_args

    argv = list(sys.argv[1:] if argv is None else argv)
    own = remove_ros_args(["simllm-query"] + argv)[1:]
    parser = build_parser()
    args = parser.parse_args(own)
    if args.max_new_tokens < 0 or args.max_new_tokens > 2**32 - 1:
        parser.error("--max-new-tokens must be >= 0")
    if args.timeout <= 0:
        parser.error("--timeout must be > 0")
    context = args.context
    if args.context_file:
        try:
            context = sys.stdin.read() if args.context_file == "-" else open(args.context_file, encoding="utf-8").read()
        except OSError as e:
            parser.error(f"--context-file: {e}")
    node_name = "/" + args.node.strip("/")

    import rclpy
    from rclpy.executors import ExternalShutdownException

    from simllm_ros.ros.qos import CLIENT_QOS
    from simllm_ros.srv import Query

    rclpy.init(args=["simllm-query"] + argv)
    node = rclpy.create_node(f"simllm_query_{os.getpid()}")
    code = 1
    try:
        client = node.create_client(Query, f"{node_name}/query", qos_profile=CLIENT_QOS)
        deadline = time.monotonic() + args.timeout
        if not client.wait_for_service(timeout_sec=args.timeout):
            print(json.dumps({"success": False, "error": f"timeout: service {node_name}/query not available "
                                                        f"after {args.timeout:g} s (is the node active?)"}))
            return 1
        req = Query.Request(prompt=args.prompt, context=context, cache_scope=args.scope,
                            max_new_tokens=args.max_new_tokens, allow_approximate=not args.no_approximate)
        future = client.call_async(req)
        rclpy.spin_until_future_complete(node, future, timeout_sec=max(0.1, deadline - time.monotonic()))
        if not future.done() or future.result() is None:
            print(json.dumps({"success": False, "error": f"timeout: no answer from {node_name}/query within "
                                                        f"{args.timeout:g} s"}))
            return 1
        resp = future.result()
        print(json.dumps(response_to_dict(resp), ensure_ascii=False, indent=2))
        code = 0 if resp.success else 1
    except (KeyboardInterrupt, ExternalShutdownException):
        code = 1
    finally:
        node.destroy_node()
        rclpy.try_shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
