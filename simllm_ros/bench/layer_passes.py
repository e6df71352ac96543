"""A pass's layers in one C call (layer_kernel) against the same layers run one by one from Python.

The default model (bf16, 4-bit AMX products) on one engine: decode steps at a ~300-token context (one token
each, as a plain decode step runs), a 33-row pass (a verification block), and prefills of 57 and 295 tokens
(a SEMANTIC repair's recomputed tokens, a cold prompt). The two ways alternate round by round; the figure is
each one's fastest round, and the ratio C / Python. Both compute the same bits (test_layer_kernel.py); this
checks that too on every pass it times.

Run: .venv/bin/simllm-bench layer_passes [--threads 1] [--rounds 5]
"""
from __future__ import annotations

import argparse
import time

from .shared import offline

offline()

import torch  # noqa: E402

from simllm_ros.serving.engine import Engine  # noqa: E402
from simllm_ros.model.kv_buffer import KVBuffer  # noqa: E402
from simllm_ros.settings import Settings  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.monotonic()
    e = Engine(Settings.from_overrides(cache_size="256MB"))
    e.load(progress=lambda m: None)
    b = e.loaded_backend()
    r = b.runner
    if r is None or r.fused is None:
        print(f"the layers do not run in C here: {b.layers_path}")
        return
    L, H, D = len(r.layers), r.n_kv, r.head_dim
    ids = torch.randint(0, len(b.tokenizer), (340,), generator=torch.Generator().manual_seed(0))
    ctx = 300

    def buffer():
        return KVBuffer.allocate(L, H, D, 360, torch.bfloat16, "cpu")

    def decode_steps(n=20):
        kv = buffer()
        r.forward(ids[:ctx], torch.arange(ctx), kv, 0, logits="none")
        out, t0 = [], time.perf_counter()
        for i in range(n):
            out.append(r.forward(ids[ctx + i:ctx + i + 1], torch.tensor([ctx + i]), kv, ctx + i, logits="last"))
        return (time.perf_counter() - t0) / n * 1000, torch.stack(out)

    def block(m=33):
        kv = buffer()
        r.forward(ids[:ctx], torch.arange(ctx), kv, 0, logits="none")
        t0 = time.perf_counter()
        out = r.forward(ids[ctx:ctx + m], torch.arange(ctx, ctx + m), kv, ctx, logits="all")
        return (time.perf_counter() - t0) * 1000, out

    def prefill(m):
        kv = buffer()
        t0 = time.perf_counter()
        out = r.forward(ids[:m], torch.arange(m), kv, 0, logits="last")
        return (time.perf_counter() - t0) * 1000, out

    cases = [("decode step (1 token, 300-token context)", decode_steps), ("33-row pass (300-token context)", block),
             ("57-token prefill", lambda: prefill(57)), ("295-token prefill", lambda: prefill(295))]
    best = {(name, c): float("inf") for name, _ in cases for c in (True, False)}
    same = {name: True for name, _ in cases}
    for rnd in range(args.rounds + 1):  # round 0 warms up
        for name, fn in cases:
            got = {}
            for in_c in ((True, False) if rnd % 2 else (False, True)):
                r.layers_in_c = in_c
                ms, got[in_c] = fn()
                if rnd:
                    best[(name, in_c)] = min(best[(name, in_c)], ms)
            same[name] = same[name] and torch.equal(got[True], got[False])
    r.layers_in_c = True
    print(f"layers in one C call vs from Python, {b.dtype_name}, {b.weight_bits}-bit weights, {args.threads} "
          f"thread(s), fastest of {args.rounds} rounds:")
    for name, _ in cases:
        c, p = best[(name, True)], best[(name, False)]
        print(f"  {name:42s} C {c:8.2f} ms   Python {p:8.2f} ms   ratio {c / p:.2f}x   same bits: {same[name]}")
    print(f"Wall time {time.monotonic() - t_start:.0f} s.")


if __name__ == "__main__":
    main()
