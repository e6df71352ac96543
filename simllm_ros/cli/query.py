"""`simllm-query`: ask a running simllm_node and print the answer as JSON.

    simllm-query "prompt" [--context TEXT | --context-file F] [--scope S] [--max-new-tokens N]
                 [--no-approximate] [--json-schema SCHEMA|@FILE] [--message ROLE:TEXT ...] [--stop S ...]
                 [--temperature T] [--seed N] [--stream] [--timeout S] [--resend S] [--node /simllm_node]
                 [--ros-args ...]
    simllm-query --embed "text" ["text" ...]

The Query service by default; --stream uses the Generate action (text on stdout as it grows, the result JSON
on stderr, Ctrl-C cancels the goal); --embed the Embed service. Prints every response field (cache_result by
name). Exit code 0 on success, 1 when the node answers success=false or nothing answers within --timeout,
130 after a Ctrl-C cancel, 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
import time
from typing import Any

import rclpy
from rclpy.signals import SignalHandlerOptions
from rclpy.utilities import remove_ros_args

from simllm_ros.request import CacheResult
from simllm_ros.ros.client import MAX_RESENDS, RESEND_S
from simllm_ros.ros.qos import CLIENT_QOS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="simllm-query", description="Query the simllm_ros LLM node.")
    p.add_argument("prompt", nargs="*", help="the prompt (words are joined); with --embed, the texts to embed")
    ctx = p.add_mutually_exclusive_group()
    ctx.add_argument("--context", default="", help="shared context placed before the prompt")
    ctx.add_argument("--context-file", metavar="F", help="read the context from a file ('-' for stdin)")
    p.add_argument("--scope", default="", help="cache namespace (default scope when empty)")
    p.add_argument("--max-new-tokens", type=int, default=0, metavar="N", help="0: the node's default")
    p.add_argument("--no-approximate", action="store_true", help="exact reuse only (no SEMANTIC / ANSWER)")
    p.add_argument("--json-schema", metavar="SCHEMA", default="",
                   help="constrain the answer to JSON valid under this schema (its text, or @FILE)")
    p.add_argument("--message", action="append", default=[], metavar="ROLE:TEXT",
                   help="a conversation turn before the prompt (system, user or assistant); repeatable, in order")
    p.add_argument("--tool", action="append", default=[], metavar="NAME",
                   help="a tool (from the node's tools file) the model may call; repeatable")
    p.add_argument("--tool-choice", default="", metavar="C",
                   help="auto (default with --tool), none, required, or a tool's name")
    p.add_argument("--stop", action="append", default=[], metavar="S", help="end the answer before S; repeatable")
    p.add_argument("--temperature", type=float, default=-1.0, metavar="T", help="sampling temperature; "
                   "negative: the node's")
    p.add_argument("--seed", type=int, default=-1, help="sampling seed; negative: the node's")
    p.add_argument("--approx-error-bound", type=float, default=-1.0, metavar="D",
                   help="δ: an approximate answer only where its learnt chance of differing is <= D; "
                        "negative: the node's")
    p.add_argument("--stream", action="store_true",
                   help="use the ~/generate action: the answer is printed as it grows (stdout), the result JSON "
                        "goes to stderr; Ctrl-C cancels the goal")
    p.add_argument("--embed", action="store_true", help="embed the texts with the node's embedder (~/embed)")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S",
                   help="seconds to wait for the service and the answer (default 60)")
    p.add_argument("--resend", type=float, default=None, metavar="S",
                   help="send the question again (at most twice) after S seconds without an answer (default 10): "
                        "Fast DDS can drop the first answer to a client the node has only just seen")
    p.add_argument("--node", default="/simllm_node", help="node name (default /simllm_node)")
    return p


def _fields(args, parser, context: str) -> dict:
    """The request fields the options say, shared by the service and the action."""
    # local: the generated interfaces load after argument parsing (--help goes without them)
    from simllm_ros.msg import ChatMessage

    schema = args.json_schema
    if schema.startswith("@"):
        try:
            with open(schema[1:], encoding="utf-8") as f:
                schema = f.read()
        except OSError as e:
            parser.error(f"--json-schema: {e}")
    messages = []
    for m in args.message:
        role, sep, text = m.partition(":")
        if not sep or role not in ("system", "user", "assistant"):
            parser.error(f"--message {m!r}: expected ROLE:TEXT with ROLE system, user or assistant")
        messages.append(ChatMessage(role=role, content=text))
    return dict(prompt=" ".join(args.prompt), context=context, cache_scope=args.scope,
                max_new_tokens=args.max_new_tokens, allow_approximate=not args.no_approximate, messages=messages,
                json_schema=schema, stop=list(args.stop), temperature=float(args.temperature), seed=int(args.seed),
                approx_error_bound=float(args.approx_error_bound), tools=list(args.tool), tool_choice=args.tool_choice)


def response_to_dict(resp) -> dict:
    d = {}
    for field in resp.get_fields_and_field_types():
        v = getattr(resp, field)
        if isinstance(v, float):
            v = round(v, 3) if math.isfinite(v) else None
        elif field == "tool_calls":
            v = [{f: getattr(c, f) for f in c.get_fields_and_field_types()} for c in v]
        d[field] = v
    try:
        d["cache_result"] = CacheResult(resp.cache_result).name
    except ValueError:
        d["cache_result"] = f"UNKNOWN({resp.cache_result})"
    return d


def _spin_until(node, future, deadline: float) -> bool:
    rclpy.spin_until_future_complete(node, future, timeout_sec=max(0.1, deadline - time.monotonic()))
    return future.done() and future.result() is not None


def _call_service(node, srv_type, name: str, request, timeout: float,
                  resend_s: float | None = None) -> tuple[Any | None, str]:
    """(response, "") or (None, why not) for one service call within `timeout` seconds. The request is sent again
    (at most twice) after each `resend_s` (RESEND_S) without an answer: this process's client is new, and Fast DDS
    drops a response to a client whose response reader the node has not matched yet (simllm_ros.ros.client)."""
    resend_s = RESEND_S if resend_s is None else resend_s
    client = node.create_client(srv_type, name, qos_profile=CLIENT_QOS)
    deadline = time.monotonic() + timeout
    if not client.wait_for_service(timeout_sec=timeout):
        return None, f"timeout: service {name} not available after {timeout:g} s (is the node active?)"
    sent, last_sent = [client.call_async(request)], time.monotonic()
    while True:
        answered = [f for f in sent if f.done() and f.result() is not None]
        if answered:
            return answered[0].result(), ""
        now = time.monotonic()
        if now >= deadline:
            return None, f"timeout: no answer from {name} within {timeout:g} s"
        if len(sent) <= MAX_RESENDS and now - last_sent >= resend_s:
            print(f"no answer from {name} after {now - last_sent:.2f} s: asking again ({len(sent)}/{MAX_RESENDS})",
                  file=sys.stderr)
            sent.append(client.call_async(request))
            last_sent = now
        wait = min(0.1, deadline - now, resend_s - (now - last_sent) if len(sent) <= MAX_RESENDS else 0.1)
        rclpy.spin_once(node, timeout_sec=max(0.0, wait))


def _stream(node, name: str, fields: dict, timeout: float) -> int:
    """The Generate action: the answer printed as it grows, the result as JSON on stderr; Ctrl-C cancels."""
    # local: rclpy.action and the generated interfaces for --stream only, after argument parsing
    from rclpy.action import ActionClient

    from simllm_ros.action import Generate

    client: ActionClient[Any, Any, Any] = ActionClient(  # Generate is generated, untyped
        node, Generate, name, goal_service_qos_profile=CLIENT_QOS, result_service_qos_profile=CLIENT_QOS,
        cancel_service_qos_profile=CLIENT_QOS)
    deadline = time.monotonic() + timeout
    if not client.wait_for_server(timeout_sec=timeout):
        print(json.dumps({"success": False, "error": f"timeout: action {name} not available after {timeout:g} s"}),
              file=sys.stderr)
        return 1
    shown = [""]

    def feedback(msg):
        text = msg.feedback.text
        if text.startswith(shown[0]):
            sys.stdout.write(text[len(shown[0]):])
            sys.stdout.flush()
            shown[0] = text

    # Ctrl-C as a flag the loops read: a KeyboardInterrupt raised inside an executor callback (the feedback being
    # printed) is caught by rclpy's task and lost, and the answer then ran to its end
    interrupted = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: interrupted.set())
    try:
        sent = client.send_goal_async(Generate.Goal(**fields), feedback_callback=feedback)
        handle = sent.result() if _spin_until(node, sent, deadline) else None
        if handle is None:
            print(json.dumps({"success": False, "error": f"timeout: {name} took no goal within {timeout:g} s"}),
                  file=sys.stderr)
            return 1
        done = handle.get_result_async()
        while not done.done() and not interrupted.is_set() and time.monotonic() < deadline:
            rclpy.spin_until_future_complete(node, done, timeout_sec=0.1)
        if interrupted.is_set():
            cancel = handle.cancel_goal_async()
            _spin_until(node, cancel, time.monotonic() + 5)
            print(file=sys.stdout)
            print(json.dumps({"success": False, "error": "cancelled (Ctrl-C)"}), file=sys.stderr)
            return 130
        final = done.result() if done.done() else None
        if final is None:
            handle.cancel_goal_async()
            print(json.dumps({"success": False, "error": f"timeout: no result within {timeout:g} s"}), file=sys.stderr)
            return 1
    finally:
        signal.signal(signal.SIGINT, previous)
    result = final.result
    rest = result.answer[len(shown[0]):] if result.answer.startswith(shown[0]) else ""
    sys.stdout.write(rest + "\n")
    print(json.dumps(response_to_dict(result), ensure_ascii=False, indent=2), file=sys.stderr)
    return 0 if result.success else 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own = remove_ros_args(["simllm-query"] + argv)[1:]
    parser = build_parser()
    args = parser.parse_args(own)
    if args.max_new_tokens < 0 or args.max_new_tokens > 2**32 - 1:
        parser.error("--max-new-tokens must be >= 0")
    if args.timeout <= 0:
        parser.error("--timeout must be > 0")
    if args.embed and (args.stream or not args.prompt):
        parser.error("--embed takes one or more texts and no --stream")
    context = args.context
    if args.context_file:
        try:
            context = sys.stdin.read() if args.context_file == "-" else open(args.context_file, encoding="utf-8").read()
        except OSError as e:
            parser.error(f"--context-file: {e}")
    node_name = "/" + args.node.strip("/")

    # local: rclpy.executors and the generated interfaces load after argument parsing (not on --help)
    from rclpy.executors import ExternalShutdownException

    from simllm_ros.srv import Embed, Query

    fields = {} if args.embed else _fields(args, parser, context)
    # Ctrl-C stays a KeyboardInterrupt with the context alive, so that --stream can still send the cancel
    rclpy.init(args=["simllm-query"] + argv, signal_handler_options=SignalHandlerOptions.NO)
    node = rclpy.create_node(f"simllm_query_{os.getpid()}")
    code = 1
    try:
        if args.stream:
            return _stream(node, f"{node_name}/generate", fields, args.timeout)
        if args.embed:
            resp, why = _call_service(node, Embed, f"{node_name}/embed", Embed.Request(texts=list(args.prompt)),
                                      args.timeout, args.resend)
            out = {"success": False, "error": why} if resp is None else {
                "success": resp.success, "error": resp.error, "dim": resp.dim,
                "vectors": [[round(float(v), 6) for v in resp.vectors[i * resp.dim:(i + 1) * resp.dim]]
                            for i in range(len(args.prompt))] if resp.success else []}
        else:
            resp, why = _call_service(node, Query, f"{node_name}/query", Query.Request(**fields), args.timeout,
                                      args.resend)
            out = {"success": False, "error": why} if resp is None else response_to_dict(resp)
        print(json.dumps(out, ensure_ascii=False, indent=2))
        code = 0 if out["success"] else 1
    except (KeyboardInterrupt, ExternalShutdownException):
        code = 1
    finally:
        node.destroy_node()
        rclpy.try_shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
