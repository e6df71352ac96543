"""Turn-N time to first token of a conversation (`messages`) with the pool against a no-cache run.

A robot's dialogue: a local bulletin as context, then N user turns, each answered (greedy, 24 tokens) and
appended to the conversation, as a dialogue manager would send them. Turn k's prompt holds every earlier
turn, so with the pool its prefix up to turn k-1's generation prompt is reused exactly and only the last
answer and the new question are prefilled. The no-cache run answers the same messages from an empty pool
(a fork of the same engine: same model, own pool, cleared before every turn). Both run one after the other
per turn, on the same machine state; answers are compared (they must be identical: lossless reuse).

Run: .venv/bin/simllm-bench chat_turns [--turns 8] [--threads 1] [--repeats 3]
Writes benchmark/results/chat_turns.md (and prints it).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from .shared import RESULTS_DIR, offline, use_test_helpers

offline()
use_test_helpers()  # core_fixtures: the bulletin of the tests

import torch  # noqa: E402

from simllm_ros.serving.engine import Engine  # noqa: E402
from simllm_ros.request import ChatTurn, QueryRequest  # noqa: E402
from simllm_ros.settings import Settings  # noqa: E402

from core_fixtures import BULLETIN  # noqa: E402

QUESTIONS = [
    "Which road is closed today?", "What should I use instead?", "Is it going to rain later?",
    "Should I take an umbrella then?", "Where can I get diesel?", "How much does it cost?",
    "When does the pharmacy close?", "Is the post office open this afternoon?", "How often does bus 12 run?",
    "And after eight in the evening?", "Is the Harbour Bridge open?", "How bad is traffic on Route 9?",
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 avoids oversubscription on a shared box)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per turn and system; the median TTFT is reported")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, "chat_turns.md"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cached = Engine(Settings.from_overrides(cache_size="256MB", kv_bits=0, enable_drafts=False))
    cached.load()
    nocache = cached.fork()
    backend, pool = cached.loaded_backend(), cached.loaded_pool()
    print(f"model {backend.dtype_name}, batch-invariant: {backend.exact_chunking}, "
          f"torch threads {torch.get_num_threads()}", flush=True)
    turns: list[ChatTurn] = []
    rows = []
    for k, q in enumerate(QUESTIONS[:args.turns], 1):
        msgs = turns + [ChatTurn("user", q)]
        req = QueryRequest(prompt="", context=BULLETIN, cache_scope="dialogue", messages=msgs,
                           max_new_tokens=args.max_new_tokens)
        hot, cold = [], []
        for r in range(args.repeats):
            if r:  # later repeats: the pool as it was before this turn (drop the entry this turn just added)
                tokens = backend.chat_ids(cached.settings.system_prompt, req.context, req.turns())
                e = pool.find(req.scope, tokens)
                if e is not None:
                    pool.remove(e.key)
            res = cached.handle(req)
            hot.append(res)
            nocache.clear_pool()
            cold.append(nocache.handle(req))
        res, base = hot[0], cold[0]
        assert res.success and base.success, (res.error, base.error)
        rows.append((k, res.prompt_tokens, res.reused_tokens, statistics.median(r.ttft_ms for r in hot),
                     statistics.median(r.ttft_ms for r in cold), res.answer == base.answer and res.exact))
        print(f"turn {k}: {rows[-1]}", flush=True)
        turns = msgs + [ChatTurn("assistant", res.answer)]
    lines = [
        "# Turn-N TTFT of a conversation: pool vs no cache",
        "",
        f"`.venv/bin/simllm-bench chat_turns --turns {args.turns} --threads {args.threads} "
        f"--repeats {args.repeats}`; SmolLM2-135M {backend.dtype_name}, lossless KV (kv_bits 0), drafts off "
        f"(prefill only), greedy, {args.max_new_tokens}-token answers, median of {args.repeats} per turn; "
        f"{time.strftime('%Y-%m-%d')}, this project's build machine (2 shared x86_64 cores, no GPU).",
        "",
        "| turn | prompt tokens | reused | TTFT pool ms | TTFT no cache ms | ratio | same answer |",
        "|---|---|---|---|---|---|---|",
    ]
    for k, n, reused, hot_ms, cold_ms, same in rows:
        lines.append(f"| {k} | {n} | {reused} | {hot_ms:.0f} | {cold_ms:.0f} | {hot_ms / cold_ms:.2f} | "
                     f"{'yes' if same else 'NO'} |")
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)
    return 0 if all(r[-1] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
