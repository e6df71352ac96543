"""One weight product at one row, per format a decode step uses, against what memory gives.

A decode step is a row times every weight matrix, so each format's product at M = 1 on one thread decides how
near the step comes to its memory floor. Per format: the fastest of many calls (robust to a shared machine) of
the C entry straight (no Python between), over matrices of the 1.5B gate_up shape cycled so the weights stream
from memory ("memory"), and over one matrix small enough for L2 ("cache": the kernel's own speed, no memory in
the way); in GB/s of weight bytes read and ns per 256 weights, with kernels/membw.c's read rate of one thread
beside them. Formats: q8r (Q8_0 x 8-bit rows), q4k8 (Q4_K x 8-bit rows), q6k8 (Q6_K x 8-bit rows), and the
float32-row products q8 (8-bit, scale per 32) and q4k (Q4_K).

Run: .venv/bin/simllm-bench product_rate [--reps 200] [--formats q8r,q4k8] [--threads 1] [--shape 17920,1536]
"""
from __future__ import annotations

import argparse
import ctypes
import time

import torch

from ..kernels import int4_vector_kernel, memory_rate
from ..kernels.product_kernel import MM_ARGS

GU_N, GU_K = 17920, 1536  # Qwen2.5-1.5B's gate_up: the step's largest product
CACHE_N, CACHE_K = 1024, 1536  # fits L2 (2 MB) for every format
FORMATS = ("q8r", "q4k8", "q6k8", "q8", "q4k")


def _blob(kernel, fmt: str, n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Random weights of format `fmt`, [n, k], packed for the kernel."""
    def ri(lo, hi, shape):
        return torch.randint(lo, hi, shape, generator=g, dtype=torch.int32)

    def f16(shape):
        return (torch.rand(shape, generator=g) * 0.01 + 1e-3).half().float()
    if fmt == "q8r":
        return kernel.pack_q8r(ri(-127, 128, (n, k)), f16((n, k // 32)))
    if fmt == "q4k8":
        return kernel.pack_q4k8(ri(0, 16, (n, k)), ri(0, 64, (n, k // 32)), ri(0, 64, (n, k // 32)),
                                f16((n, k // 256)), f16((n, k // 256)))
    if fmt == "q4k":
        return kernel.pack_q4k(ri(0, 16, (n, k)), ri(0, 64, (n, k // 32)), ri(0, 64, (n, k // 32)),
                               f16((n, k // 256)), f16((n, k // 256)))
    if fmt == "q6k8":
        return kernel.pack_q6k8(ri(-32, 32, (n, k)), ri(-128, 128, (n, k // 16)), f16((n, k // 256)))
    if fmt == "q8":
        return kernel.pack8(ri(-127, 128, (n, k)), f16((n, k // 32)))
    raise ValueError(fmt)


def _timer(kernel, fmt: str, blobs: list[torch.Tensor], n: int, k: int, threads: int):
    """A function that runs one product on the next blob and returns its seconds: the format's C entry (the one
    the C layers call, `entries`) straight, with the kernel's buffers for this thread."""
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(1))
    y = torch.empty(1, n)
    xsum, buf, floats, most = kernel.buffers(1, k)
    threads = min(threads, max(most, 2))  # the work buffer holds max(threads, 2) threads' parts
    fn = ctypes.CFUNCTYPE(None, *MM_ARGS)(kernel.entries[fmt])
    i = [0]

    def one() -> float:
        b = blobs[i[0] % len(blobs)]
        i[0] += 1
        t0 = time.perf_counter()
        fn(x.data_ptr(), k, b.data_ptr(), y.data_ptr(), n, 1, n, k, xsum, buf, floats, threads)
        return time.perf_counter() - t0
    return one


def measure(fmt: str, reps: int, threads: int, stream_mib: int = 256, shape: tuple[int, int] = (GU_N, GU_K)) -> dict:
    """{"memory": ..., "cache": ...}: each the fastest call's us, GB/s of weights, ns per 256 weights, bits a weight."""
    kernel = int4_vector_kernel.load()
    if kernel is None:
        raise SystemExit(f"no vector kernel here: {int4_vector_kernel.why_not()}")
    g = torch.Generator().manual_seed(0)
    out = {}
    for where, (n, k) in (("memory", shape), ("cache", (CACHE_N, shape[1]))):
        first = _blob(kernel, fmt, n, k, g)
        copies = max(1, (stream_mib << 20) // first.numel()) if where == "memory" else 1
        blobs = [first] + [first.clone() for _ in range(copies - 1)]  # clones: distinct memory, same numbers
        one = _timer(kernel, fmt, blobs, n, k, threads)
        for _ in range(3 * len(blobs)):
            one()
        best = min(one() for _ in range(reps if where == "memory" else reps * 5))
        nbytes = first.numel()
        out[where] = {"us": best * 1e6, "GB/s": nbytes / best / 1e9, "ns/256w": best * 1e9 / (n * k / 256),
                      "bits/w": nbytes * 8 / (n * k)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=200, help="calls per format and place (the fastest is kept)")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--shape", default=f"{GU_N},{GU_K}", help="outputs,inputs of the streamed matrix")
    ap.add_argument("--stream-mib", type=int, default=256, help="MiB of copies the memory case cycles through "
                                                                "(far above the last-level cache)")
    args = ap.parse_args(argv)
    n, k = (int(v) for v in args.shape.split(","))
    torch.set_num_threads(1)
    mr = memory_rate.load()
    read = mr.measure(args.threads, mib=args.stream_mib, tries=max(1, args.reps // 10)) if mr else float("nan")
    print(f"memory read rate, {args.threads} thread(s) (membw.c): {read:.1f} GB/s; {n} x {k} cycled over "
          f"{args.stream_mib} MiB, and {CACHE_N} x {k} in cache; M = 1, best of {args.reps}")
    print("| format | bits/weight | memory: us | GB/s | ns/256 w | / read rate | cache: us | GB/s | ns/256 w |")
    print("|---|---|---|---|---|---|---|---|---|")
    for fmt in args.formats.split(","):
        r = measure(fmt, args.reps, args.threads, args.stream_mib, (n, k))
        m, c = r["memory"], r["cache"]
        print(f"| {fmt} | {m['bits/w']:.3g} | {m['us']:.0f} | {m['GB/s']:.1f} | {m['ns/256w']:.1f} | "
              f"{m['GB/s'] / read:.2f} | {c['us']:.1f} | {c['GB/s']:.1f} | {c['ns/256w']:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
