"""Every core, the same bits: a row's logits and KV do not depend on how many threads compute it, or on the rows
beside it in a batch; the compute workers end with the engine; compute_threads is checked at configure.

Files large enough that the products, attention and LM head of a decode step run on several threads (below
THREAD_MIN_MACS a product computes alone, and a thread test would test nothing)."""
from __future__ import annotations

import hashlib
import os
import threading

import pytest
import torch

from random_gguf import Q4_K_M, write_llama
from simllm_ros.kernels import compute_threads, int4_vector_kernel, kernel_pool
from simllm_ros.model.model_backend import ModelBackend
from simllm_ros.request import QueryRequest
from simllm_ros.serving.engine import Engine, EngineLoadError
from simllm_ros.settings import Settings

SHAPE = dict(layers=2, hidden=512, inter=1024, heads=8, kv_heads=2)
PROMPTS = [[(7 * i + 3) % 4000 + 10 for i in range(37)], [(11 * i + 5) % 4000 + 10 for i in range(23)]]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cores")
    return {"q4_k_m": write_llama(str(d / "q4km.gguf"), types=Q4_K_M, seed=21, **SHAPE),
            "q8_0": write_llama(str(d / "q80.gguf"), default="Q8_0", embed="Q8_0", output=None, seed=22, **SHAPE),
            "cache": str(d / "models")}


@pytest.fixture(scope="module")
def backends(files):
    return {name: ModelBackend(files[name], dtype="float32", weight_bits=0, cache_dir=files["cache"])
            for name in ("q4_k_m", "q8_0")}


@pytest.fixture
def threads_restored():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _bits(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()


def _answers(b: ModelBackend, threads: int, batched: bool) -> dict:
    """Per prompt: the prompt's logits, 8 greedy steps' logits and the KV after them, at `threads` threads; batched:
    both prompts' steps in one pass each (run_batch), else one prompt at a time. Plus the numerics digest."""
    torch.set_num_threads(threads)
    out: dict = {}
    with compute_threads.kernels_own_cores(b.kernels_do_the_work):
        out["digest"] = b.numerics_digest()
        caches = [b.new_cache(64) for _ in PROMPTS]
        logits = [b.run(p, c, logits="last") for p, c in zip(PROMPTS, caches)]
        seen = [[_bits(x)] for x in logits]
        for _ in range(8):
            toks = [[int(x.argmax())] for x in logits]
            if batched:
                logits = b.run_batch([(t, c, "last") for t, c in zip(toks, caches)])
            else:
                logits = [b.run(t, c, logits="last") for t, c in zip(toks, caches)]
            for s, x in zip(seen, logits):
                s.append(_bits(x))
        out["steps"] = seen
        out["kv"] = [_bits(torch.cat([t.flatten() for t in b.cache_tensors(c)])) for c in caches]
    return out


@pytest.mark.parametrize("name", ["q4_k_m", "q8_0"])
def test_the_same_bits_at_1_2_and_3_threads_alone_and_batched(backends, name, threads_restored):
    b = backends[name]
    assert b.runner is not None and b.runner.fused is not None and b.exact_chunking, "the C layers must run here"
    assert b.batches_exactly
    want = _answers(b, 1, batched=False)
    for threads, batched in ((2, False), (3, False), (2, True), (3, True), (1, True)):
        got = _answers(b, threads, batched)
        assert got == want, f"{name}: {threads} threads{' batched' if batched else ''} changed bits"


def test_a_step_is_split_over_the_workers_at_two_threads(backends, threads_restored):
    """The bits test above would pass with every product on one thread: here the kept workers do run."""
    b = backends["q4_k_m"]
    kernel = b.runner.int4
    torch.set_num_threads(2)
    with compute_threads.kernels_own_cores(b.kernels_do_the_work):
        cache = b.new_cache(64)
        logits = b.run(PROMPTS[0], cache, logits="last")
        kernel.pool_profile(True)
        b.run([int(logits.argmax())], cache, logits="last")
        counts = kernel.pool_profile(False)
    assert counts["dispatches"] >= 2 * 4, counts  # the products of two layers at least
    assert kernel.workers() >= 1


def _pool_threads() -> int:
    """Threads of this process named as the kept workers name themselves (pool.h)."""
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                n += f.read().strip() == "simllm-pool"
        except OSError:
            pass
    return n


def test_the_workers_end_with_the_engine(files, threads_restored):
    e = Engine(Settings.from_overrides(model=files["q4_k_m"], model_cache_dir=files["cache"],
                                       compute_threads=min(2, len(compute_threads.usable_cpus())),
                                       cache_size="64MB"))
    e.load()
    try:
        r = e.handle(QueryRequest(prompt="Which road is closed?", context="Main street is closed until noon.",
                                  max_new_tokens=4))
        assert r.success, r.error
        assert kernel_pool.workers() >= 1 and _pool_threads() >= 1
    finally:
        e.unload()
    assert kernel_pool.workers() == 0 and _pool_threads() == 0
    assert not [t for t in threading.enumerate() if t.name == "simllm-pass-costs"], "the pass-cost timing ended too"


def test_compute_threads_beyond_the_cores_is_refused_at_configure(tmp_path):
    cpus = len(compute_threads.usable_cpus())
    e = Engine(Settings.from_overrides(compute_threads=cpus + 1, cache_size="64MB"))
    with pytest.raises(EngineLoadError, match=rf"compute_threads {cpus + 1}: this process may run on {cpus} CPU"):
        e.load()
    assert e.backend is None
    with pytest.raises(Exception, match="compute_threads"):
        Settings.from_overrides(compute_threads=-1)


def test_auto_counts_physical_cores_from_the_topology(tmp_path):
    """Four CPUs on two cores (two hardware threads each): one per core first, the second threads after."""
    for cpu, core in ((0, 0), (1, 1), (2, 0), (3, 1)):
        d = tmp_path / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "core_id").write_text(f"{core}\n")
        (d / "physical_package_id").write_text("0\n")
    assert compute_threads.by_core([0, 1, 2, 3], str(tmp_path)) == ([0, 1, 2, 3], 2)
    assert compute_threads.by_core([0, 2, 1, 3], str(tmp_path)) == ([0, 1, 2, 3], 2)
    n, why = compute_threads.choose(3, [0, 1, 2, 3], str(tmp_path))
    assert n == 3 and "2 physical cores" in why
    assert int4_vector_kernel.loaded() is not None or int4_vector_kernel.why_not() is None


def test_decode_profile_prints_where_a_step_goes(files, tmp_path):
    """simllm-bench decode_profile's smoke run: the step's parts at 1 and 2 threads, the memory floor, in its own
    process (the full run: README, benchmark/results/decode_profile.md)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    p = subprocess.run([sys.executable, "-m", "simllm_ros.cli.bench", "decode_profile", "--file", files["q4_k_m"],
                        "--threads", "1,2", "--steps", "3", "--warmup", "1", "--context", "40", "--dir", str(tmp_path),
                        "--rows", "1,2", "--answers", "1", "--json", str(tmp_path / "p.json")], cwd=root, env=env, capture_output=True,
                       text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "| threads | step | qkv |" in p.stdout and "floor ms" in p.stdout
    assert "A model, not a measurement" in p.stdout
    import json

    rows = json.load(open(tmp_path / "p.json"))["ours"]["rows"]
    assert [r["threads"] for r in rows] == [1, 2]
    assert all(r["gate_up"] > 0 and r["memory_read_gbs"] > 0 for r in rows)
    assert rows[1]["dispatches"] > 0 and rows[0]["dispatches"] == 0  # one thread: no worker ever woken
    batched = json.load(open(tmp_path / "p.json"))["ours"]["batched"]  # --rows: a pass of N rows against N of 1
    assert [(r["threads"], r["rows"]) for r in batched] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert all(r["batched"]["gate_up"] > 0 and r["singles"]["pass_ms"] > 0 for r in batched)
    assert "batched / singles" in p.stdout
    # --answers: whole requests, drafts on and off, on an engine loaded at each thread count
    answers = json.load(open(tmp_path / "p.json"))["ours"]["answers"]
    assert [r["threads"] for r in answers] == [1, 2]
    assert all(r["drafts_ms"] > 0 and r["no_drafts_ms"] > 0 and r["mean_ratio"] > 0 for r in answers)
    assert "on / off (all tokens)" in p.stdout


def test_product_rate_prints_each_format_against_memory(capsys):
    """simllm-bench product_rate's smoke run: one row times each decode format's weights, a table row per format
    with positive rates in memory and in cache (the full run: benchmark/results/decode_profile.md)."""
    if int4_vector_kernel.load() is None:
        pytest.skip(f"vector kernel: {int4_vector_kernel.why_not()}")
    from simllm_ros.bench import product_rate

    assert product_rate.main(["--reps", "2", "--stream-mib", "4", "--shape", "64,512"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| q")]
    assert [r[0].strip() for r in rows] == list(product_rate.FORMATS)
    assert all(float(v) > 0 for r in rows for v in r[1:])


def test_products_from_many_threads_at_once_keep_their_bits(threads_restored):
    """The kept workers serve one caller at a time (the others compute alone) and claim chunks by compare-and-swap:
    products from four Python threads at once, while another thread stops the workers now and then (an engine's
    unload beside a running one), each give the bits of the product computed alone."""
    import threading

    kernel = int4_vector_kernel.load()
    if kernel is None:
        pytest.skip(f"vector kernel: {int4_vector_kernel.why_not()}")
    g = torch.Generator().manual_seed(5)
    n, k = 2048, 512
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    step = torch.rand(n, k // 32, generator=g) * 0.01 + 0.001
    blob = kernel.pack_affine(codes, step, -8 * step)
    xs = [torch.randn(m, k, generator=g) for m in (1, 2, 3, 5)]
    torch.set_num_threads(1)
    want = [kernel.mm(x, blob, n) for x in xs]
    torch.set_num_threads(2)
    bad, stop = [], threading.Event()

    def caller(i):
        torch.set_num_threads(2)
        for _ in range(60):
            got = kernel.mm(xs[i], blob, n)
            if not torch.equal(got, want[i]):
                bad.append(i)

    def stopper():
        while not stop.is_set():
            kernel.stop_workers()
            stop.wait(0.005)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
    s = threading.Thread(target=stopper)
    s.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    stop.set()
    s.join(timeout=60)
    assert not bad, bad
    assert not any(t.is_alive() for t in threads)
    kernel.stop_workers()
    assert kernel.workers() == 0
