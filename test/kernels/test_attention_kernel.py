"""Our C attention kernel (simllm_ros.kernels.attention_kernel): compiled here with the system compiler, called on real
tensors, checked against a float64 reference and for what makes reuse lossless: a query row's result is
bitwise the same whatever other rows, masked keys or buffer layout come with it."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

from simllm_ros.kernels import attention_kernel
from simllm_ros.kernels import build

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KERNEL = attention_kernel.load()
pytestmark = pytest.mark.skipif(KERNEL is None, reason=f"no attention kernel here: {attention_kernel.why_not()}")


def _portable():
    """The kernel's portable C (what an aarch64 Jetson compiles), built here without AVX-512; None where this
    machine's build already is that."""
    if KERNEL is None or platform.machine() not in ("x86_64", "AMD64"):
        return None
    return attention_kernel.AttentionKernel(build.build("attention", extra_flags=("-mno-avx512f",), tag="portable"))


def _vector():
    """This build with bf16 on its vector code, where the native kernel runs bf16 on AMX tiles (CPUs without AMX
    run the vector code)."""
    if KERNEL is None or KERNEL.amx is None:
        return None
    return attention_kernel.AttentionKernel(KERNEL.path, amx=False)


PORTABLE, VECTOR = _portable(), _vector()
BUILDS = [pytest.param(KERNEL, id="native")] + ([pytest.param(PORTABLE, id="portable")] if PORTABLE else []) + \
    ([pytest.param(VECTOR, id="vector")] if VECTOR else [])


HQ, HKV, D = 6, 2, 64  # two query heads per KV head, as in grouped-query models


def _buffers(dtype, cap, seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(3, HKV, cap, D, generator=g).to(dtype)  # [L, Hkv, C, D], like a KVBuffer
    return k, torch.randn(3, HKV, cap, D, generator=g).to(dtype)


def _rows(dtype, m, seed):
    g = torch.Generator().manual_seed(seed)
    # q as a strided view of a wider row, as the runner's rotated qkv is read
    wide = torch.randn(m, HQ + HKV, D, generator=g).to(dtype)
    return wide[:, :HQ], wide[:, HQ:], torch.randn(m, HKV, D, generator=g).to(dtype)


def _pass(seqs, layer=1, blocked=None, first=0, kernel=None):
    """seqs: (start, q, k_new, v_new, k_buf, v_buf): one pass over all of them."""
    row0, entries = 0, []
    for start, q, *_rest, kb, vb in seqs:
        entries.append((row0, q.shape[0], start, kb, vb))
        row0 += q.shape[0]
    kernel = kernel or KERNEL
    plan = kernel.plan(entries)
    q = torch.cat([s[1] for s in seqs])
    kn, vn = torch.cat([s[2] for s in seqs]), torch.cat([s[3] for s in seqs])
    return kernel.attend(plan, layer, q, kn, vn, D ** -0.5, blocked=blocked, first=first)


def _reference(q, kb, vb, start, allowed, layer=1):
    """float64 attention of the same rounded inputs over the buffer (new rows already written); allowed [m, T]."""
    m, T = q.shape[0], start + q.shape[0]
    k = kb[layer, :, :T].double().repeat_interleave(HQ // HKV, dim=0)  # [Hq, T, D]
    v = vb[layer, :, :T].double().repeat_interleave(HQ // HKV, dim=0)
    s = torch.einsum("mhd,htd->hmt", q.double() * D ** -0.5, k).masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hmt,htd->mhd", torch.softmax(s, dim=-1), v)


@pytest.mark.parametrize("kernel", BUILDS)
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
def test_a_ragged_pass_matches_a_float64_reference(dtype, tol, kernel):
    """Two sequences of different lengths in one pass, and one with an explicit mask: new KV lands in the
    buffers, each row attends causally by slot (or as the mask says)."""
    (ka, va), (kb, vb) = _buffers(dtype, 80, 0), _buffers(dtype, 40, 1)
    qa, kna, vna = _rows(dtype, 5, 2)
    qb, knb, vnb = _rows(dtype, 1, 3)
    out = _pass([(60, qa, kna, vna, ka, va), (30, qb, knb, vnb, kb, vb)], kernel=kernel)
    assert torch.equal(ka[1, :, 60:65], kna.transpose(0, 1)) and torch.equal(vb[1, :, 30:31], vnb.transpose(0, 1))
    for got, (start, q, kbuf, vbuf) in ((out[:5], (60, qa, ka, va)), (out[5:], (30, qb, kb, vb))):
        m = q.shape[0]
        allowed = torch.arange(start + m)[None, :] <= (start + torch.arange(m))[:, None]
        ref = _reference(q, kbuf, vbuf, start, allowed)
        assert (got.double() - ref).abs().max().item() <= tol * ref.abs().max().item()
    rng = torch.Generator().manual_seed(4)
    allowed = torch.rand(5, 65, generator=rng) > 0.4
    allowed[:, 0] = True
    got = _pass([(60, qa, kna, vna, ka, va)], blocked=~allowed, kernel=kernel)
    ref = _reference(qa, ka, va, 60, allowed)
    assert (got.double() - ref).abs().max().item() <= tol * ref.abs().max().item()


@pytest.mark.parametrize("kernel", BUILDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_row_gets_the_same_bits_however_the_sequence_is_cut(dtype, kernel):
    """A 37-token prefill in one pass, token by token (a decode), cut 17 + 20, beside another sequence, and with
    the causal mask given explicitly: every row's output and the buffers' KV bitwise the same."""
    M, start = 37, 23
    q, kn, vn = _rows(dtype, M, 5)
    base = _buffers(dtype, 70, 6)

    def fresh():
        return base[0].clone(), base[1].clone()

    k1, v1 = fresh()
    whole = _pass([(start, q, kn, vn, k1, v1)], kernel=kernel)
    k2, v2 = fresh()
    one_by_one = torch.cat([_pass([(start + i, q[i:i + 1], kn[i:i + 1], vn[i:i + 1], k2, v2)], kernel=kernel)
                            for i in range(M)])
    assert torch.equal(one_by_one, whole) and torch.equal(k2, k1) and torch.equal(v2, v1)
    k3, v3 = fresh()
    cut = torch.cat([_pass([(start, q[:17], kn[:17], vn[:17], k3, v3)], kernel=kernel),
                     _pass([(start + 17, q[17:], kn[17:], vn[17:], k3, v3)], kernel=kernel)])
    assert torch.equal(cut, whole)
    k4, v4 = fresh()
    other = _rows(dtype, 9, 7)
    ko, vo = _buffers(dtype, 200, 8)
    beside = _pass([(150, *other, ko, vo), (start, q, kn, vn, k4, v4)], kernel=kernel)
    assert torch.equal(beside[9:], whole)
    k5, v5 = fresh()
    own = torch.arange(start, start + M)
    blocked = own[None, :] > own[:, None]  # [M, M]: columns from `start` on
    assert torch.equal(_pass([(start, q, kn, vn, k5, v5)], blocked=blocked, first=start, kernel=kernel), whole)


@pytest.mark.parametrize("kernel", BUILDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_at_their_own_slots_get_the_bits_of_the_whole_pass(dtype, kernel):
    """Tokens scattered among KV already in the buffer (semantic repair: slot = position), each at its own slot
    attending every slot up to it: the rows and the KV written are bitwise those of a causal pass over all
    tokens, for 23 scattered rows (blocks of 16 rows mix far-apart slots), one row, a slot given twice (the
    same KV written twice), and the first and last slots."""
    M = 57
    q, kn, vn = _rows(dtype, M, 21)
    k0, v0 = _buffers(dtype, M + 3, 22)
    whole = _pass([(0, q, kn, vn, k0, v0)], kernel=kernel)  # writes every token's KV
    for picked in ([0, 3, 4, 5, 9, 17, 18, 19, 20, 21, 22, 30, 31, 32, 33, 40, 41, 47, 50, 52, 53, 55, 56],
                   [29], [12, 12], [0, 56]):
        at = torch.tensor(picked)
        k, v = k0.clone(), v0.clone()
        k[1, :, at], v[1, :, at] = 0.5, -0.5  # spoiled: the pass must write them
        plan = kernel.plan([(0, len(picked), 0, k, v, 0, 0, at)])
        got = kernel.attend(plan, 1, q[at], kn[at], vn[at], D ** -0.5)
        assert torch.equal(got, whole[at]) and torch.equal(k, k0) and torch.equal(v, v0)
    with pytest.raises(ValueError, match="non-decreasing"):
        kernel.plan([(0, 2, 0, k0, v0, 0, 0, torch.tensor([5, 4]))])
    with pytest.raises(ValueError, match="share"):
        kernel.plan([(0, 2, 0, k0, v0, 0, 32, torch.tensor([40, 41]))])
    with pytest.raises(ValueError, match="fit"):
        kernel.plan([(0, 2, 0, k0, v0, 0, 0, torch.tensor([40, M + 3]))])


@pytest.mark.parametrize("kernel", BUILDS)
def test_random_slot_sets_match_the_whole_pass(kernel):
    """Many random sets of tokens at their own slots (1 to all of them, sequences of 1 to 97 tokens, with and
    without a repeated slot): each row and the buffers bitwise those of a causal pass over every token."""
    g = torch.Generator().manual_seed(31)
    for trial in range(40):
        M = int(torch.randint(1, 98, (1,), generator=g))
        q, kn, vn = _rows(torch.bfloat16, M, 100 + trial)
        k0, v0 = _buffers(torch.bfloat16, M + 2, 200 + trial)
        whole = _pass([(0, q, kn, vn, k0, v0)], kernel=kernel)
        n = int(torch.randint(1, M + 1, (1,), generator=g))
        at = torch.randperm(M, generator=g)[:n].sort().values
        if trial % 4 == 0:  # a slot named twice
            at = torch.cat([at, at[-1:]]).sort().values
        k, v = k0.clone(), v0.clone()
        k[1, :, at], v[1, :, at] = 0.25, -0.25
        got = kernel.attend(kernel.plan([(0, len(at), 0, k, v, 0, 0, at)]), 1, q[at], kn[at], vn[at], D ** -0.5)
        assert torch.equal(got, whole[at]), f"trial {trial}: {M} tokens, slots {at.tolist()}"
        assert torch.equal(k, k0) and torch.equal(v, v0)


@pytest.mark.parametrize("kernel", BUILDS)
def test_a_sequence_that_fills_the_last_layer_of_its_buffer(kernel):
    """Keys up to the very end of the buffer's memory (last layer, last head, every slot): nothing past it is
    read (the AMX path copies a last, partial block of keys), and 40 rows cross blocks of 16 rows."""
    k, v = _buffers(torch.bfloat16, 61, 11)
    q, kn, vn = _rows(torch.bfloat16, 40, 12)
    got = _pass([(21, q, kn, vn, k, v)], layer=2, kernel=kernel)
    allowed = torch.arange(61)[None, :] <= (21 + torch.arange(40))[:, None]
    ref = _reference(q, k, v, 21, allowed, layer=2)
    assert (got.double() - ref).abs().max().item() <= 1e-2 * ref.abs().max().item()


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("kernel", BUILDS)
def test_a_shared_prefix_changes_no_bit(kernel, threads, monkeypatch):
    """Five sequences whose buffers begin with the same 64 slots, in two interleaved groups (0 leads 1 and 3,
    2 leads 4): each row gets the bits it gets alone in its own pass, and the buffers the same new KV; the AMX
    code reads the shared slots once per group (the vector code reads each buffer: the same bits)."""
    g = torch.Generator().manual_seed(15)
    common = _buffers(torch.bfloat16, 200, 16)
    specs = [(70, 1), (90, 3), (66, 5), (100, 2), (80, 4)]  # (start, rows)
    bufs = []
    for _ in specs:
        k, v = (torch.randn(3, HKV, 200, D, generator=g).bfloat16() for _ in range(2))
        k[:, :, :64], v[:, :, :64] = common[0][:, :, :64], common[1][:, :, :64]
        bufs.append((k, v))
    rows = [_rows(torch.bfloat16, m, 17 + i) for i, (_, m) in enumerate(specs)]
    monkeypatch.setattr(attention_kernel, "THREAD_MIN_MACS", 0 if threads > 1 else attention_kernel.THREAD_MIN_MACS)
    before = torch.get_num_threads()

    def together(shares):
        fresh_bufs = [(k.clone(), v.clone()) for k, v in bufs]
        entries, row0 = [], 0
        for (start, m), (k, v), share in zip(specs, fresh_bufs, shares):
            entries.append((row0, m, start, k, v, *share))
            row0 += m
        q, kn, vn = (torch.cat([r[j] for r in rows]) for j in range(3))
        torch.set_num_threads(threads)  # blocks of one group split between threads: each pairs what it reads
        try:
            return kernel.attend(kernel.plan(entries), 1, q, kn, vn, D ** -0.5), fresh_bufs
        finally:
            torch.set_num_threads(before)

    alone = []
    for (start, m), (k, v), r in zip(specs, bufs, rows):
        alone.append(_pass([(start, *r, k.clone(), v.clone())], kernel=kernel))
    alone = torch.cat(alone)
    plain, plain_bufs = together([(i, 0) for i in range(5)])
    assert torch.equal(plain, alone)
    for shares in ([(0, 64), (0, 64), (2, 64), (0, 64), (2, 64)], [(0, 32), (0, 32), (2, 0), (0, 32), (4, 0)]):
        got, got_bufs = together(shares)
        assert torch.equal(got, alone), shares
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got_bufs, plain_bufs))


def test_a_bad_shared_prefix_is_refused():
    bufs = [_buffers(torch.bfloat16, 100, i) for i in range(3)]
    for bad in ([(0, 64), (0, 48), (2, 0)],  # not the lead's count
                [(0, 40), (0, 40), (2, 0)],  # not a multiple of 32
                [(0, 64), (0, 64), (1, 64)],  # a lead that does not lead
                [(1, 64), (1, 64), (2, 0)],  # a lead after its member
                [(0, 96), (0, 96), (2, 0)]):  # past a start
        with pytest.raises(ValueError, match="share"):
            KERNEL.plan([(i, 1, 90 - 5 * i, k, v, *sh) for i, ((k, v), sh) in enumerate(zip(bufs, bad))])
    KERNEL.plan([(i, 1, 90 - 5 * i, k, v, *sh) for i, ((k, v), sh) in enumerate(zip(bufs, [(0, 64), (0, 64), (0, 64)]))])
    k, v = bufs[0]
    with pytest.raises(ValueError, match="64 do already"):
        KERNEL.plan([(i, 1, 64 + i % 30, k, v, 0, 64) for i in range(66)])


def test_many_one_row_sequences_in_one_pass():
    """70 rows, each a one-token sequence at its own slot of one buffer (how the runner runs rows at scattered
    positions): the rows of one 70-token pass, bitwise."""
    q, kn, vn = _rows(torch.bfloat16, 70, 18)
    base = _buffers(torch.bfloat16, 100, 19)
    k1, v1 = base[0].clone(), base[1].clone()
    whole = _pass([(10, q, kn, vn, k1, v1)])
    k2, v2 = base[0].clone(), base[1].clone()
    _pass([(10, q, kn, vn, k2, v2)])  # the new KV in place first, as the runner writes it
    plan = KERNEL.plan([(i, 1, 10 + i, k2, v2) for i in range(70)])
    assert torch.equal(KERNEL.attend(plan, 1, q, kn, vn, D ** -0.5), whole)


def test_amx_and_vector_code_agree_and_differ():
    """bf16 on AMX tiles and on the vector code: the same attention up to rounding, but two arithmetics (the
    numerics digest tells them apart)."""
    if VECTOR is None:
        pytest.skip("no AMX here: bf16 runs on the vector code only")
    assert KERNEL.uses_amx(torch.bfloat16, 64) and not KERNEL.uses_amx(torch.float32, 64) and \
        not KERNEL.uses_amx(torch.bfloat16, 32) and not VECTOR.uses_amx(torch.bfloat16, 64)
    q, kn, vn = _rows(torch.bfloat16, 7, 13)
    base = _buffers(torch.bfloat16, 300, 14)
    a = _pass([(250, q, kn, vn, base[0].clone(), base[1].clone())], kernel=KERNEL)
    b = _pass([(250, q, kn, vn, base[0].clone(), base[1].clone())], kernel=VECTOR)
    assert not torch.equal(a, b) and (a.float() - b.float()).abs().max().item() <= 1e-2 * b.float().abs().max().item()


def test_bad_shapes_and_dtypes_are_refused():
    k, v = _buffers(torch.bfloat16, 20, 0)
    q, kn, vn = _rows(torch.bfloat16, 3, 1)
    with pytest.raises(ValueError, match="fit"):
        KERNEL.plan([(0, 3, 18, k, v)])
    plan = KERNEL.plan([(0, 3, 10, k, v)])
    with pytest.raises(ValueError, match="mask"):
        KERNEL.attend(plan, 0, q, kn, vn, 0.125, blocked=torch.zeros(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="dtype"):
        KERNEL.attend(plan, 0, q.float(), kn.float(), vn.float(), 0.125)
    with pytest.raises(ValueError, match="dtype"):
        KERNEL.plan([(0, 3, 0, k, v), (3, 1, 0, k.float(), v.float())])
    assert not KERNEL.supports(torch.float16, 64, "cpu") and not KERNEL.supports(torch.bfloat16, 72, "cpu")
    assert not KERNEL.supports(torch.bfloat16, 64, "meta") and KERNEL.supports(torch.bfloat16, 64, "cpu")


def test_torch_path_when_asked_and_a_cached_build_is_reused():
    code = ("from simllm_ros.kernels import attention_kernel as a; k = a.load(); "
            "print(k is None, a.why_not(), k.path if k else '')")
    env = {**os.environ, "PYTHONPATH": REPO}
    off = subprocess.run([sys.executable, "-c", code], env={**env, "SIMLLM_ATTENTION": "torch"},
                         capture_output=True, text=True, timeout=120)
    assert off.returncode == 0, off.stderr
    assert off.stdout.startswith("True SIMLLM_ATTENTION=torch"), off.stdout
    on = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert on.returncode == 0, on.stderr
    assert on.stdout.split()[-1] == KERNEL.path  # the library built once per machine is the one loaded
    vec = subprocess.run([sys.executable, "-c", code.replace("print(k is None", "print(k.amx is None")],
                         env={**env, "SIMLLM_ATTENTION": "vector"}, capture_output=True, text=True, timeout=120)
    assert vec.returncode == 0 and vec.stdout.startswith("True None "), (vec.stdout, vec.stderr)


def test_the_model_computes_the_same_attention_either_way():
    """The runner with our kernel and with its torch path: the same attention up to rounding (the two round
    differently; each is row-invariant on its own, which the load-time probe checks)."""
    from core_fixtures import shared_engine

    b = shared_engine(dtype="bfloat16", kv_bits=0).backend  # the engine other test files share
    if b.runner is None or b.runner.kernel is None:
        pytest.skip("the model does not run through the kernel here")
    ids = b.prompt_ids("You are a helpful robot.", "Riverside bulletin: Elm Street closed 9-17.",
                       "Which road is closed today, and until when?")
    ours = b.run(ids, b.new_cache(len(ids) + 2), logits="all")
    kernel, b.runner.kernel = b.runner.kernel, None
    try:
        theirs = b.run(ids, b.new_cache(len(ids) + 2), logits="all")
    finally:
        b.runner.kernel = kernel
    assert not torch.equal(ours, theirs)  # really two paths
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.9
    p, q = torch.log_softmax(theirs, -1), torch.log_softmax(ours, -1)
    kl = (p.exp() * (p - q)).sum(-1).mean().item()
    assert kl < 0.02, kl


def test_the_load_log_names_the_attention_path():
    from core_fixtures import shared_engine

    b = shared_engine(dtype="bfloat16", kv_bits=0).backend
    assert b.attention_path.startswith("simllm_ros C kernel") and KERNEL.path in b.attention_path


def test_threads_change_no_bit():
    """A pass big enough to be split between threads (a long prefill) gives the bits of one thread."""
    assert attention_kernel.THREAD_MIN_MACS < 300 * 320 * HQ * D * 2
    q, kn, vn = _rows(torch.bfloat16, 300, 9)
    base = _buffers(torch.bfloat16, 340, 10)
    before = torch.get_num_threads()
    try:
        got = []
        for n in (1, 3):
            torch.set_num_threads(n)
            k, v = base[0].clone(), base[1].clone()
            got.append((_pass([(20, q, kn, vn, k, v)]), k, v))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*got))


def test_passes_from_two_threads_at_once_do_not_mix():
    """Each calling thread has its own scratch (the call runs without the GIL): two engines in one process
    (the concurrency benchmark runs two), each behind its own lock, must not corrupt each other's scores.
    With one shared scratch buffer this produced nonsense answers there."""
    import threading

    jobs = []
    for seed in range(2):
        q, kn, vn = _rows(torch.bfloat16, 1, 20 + seed)
        jobs.append((q, kn, vn, _buffers(torch.bfloat16, 900, 30 + seed)))

    def run(job, start):
        q, kn, vn, (k, v) = job
        return _pass([(start, q, kn, vn, k, v)])

    want = [[run(job, start) for start in range(700, 860)] for job in jobs]
    got = [None, None]

    def worker(i):
        got[i] = [run(jobs[i], start) for start in range(700, 860)]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        assert all(torch.equal(a, b) for a, b in zip(got[i], want[i])), i


def test_an_unwritable_kernel_dir_falls_back_to_a_temporary_one(tmp_path):
    """A robot whose home cannot be written still gets the kernel, built in a private temporary directory.
    (The kernel dir lies under a plain file here: unwritable even for root, who ignores permissions.)"""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    code = ("import os; from simllm_ros.kernels import attention_kernel as a; k = a.load(); "
            "print(k is not None, a.why_not(), k.path if k else '')")
    env = {**os.environ, "PYTHONPATH": REPO, "SIMLLM_KERNEL_DIR": str(blocker / "kernels")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("True None") and "simllm-kernels-" in done.stdout, done.stdout
    private = os.path.dirname(done.stdout.split()[-1])
    assert not os.path.exists(private), private  # removed when the process ended: a restart leaves nothing behind


def test_passes_split_on_the_4bit_kernels_workers_give_the_bits_of_one_thread():
    """Where the 4-bit kernel is loaded, attention passes split their row blocks on its kept workers
    (simllm_pool_call) from a much smaller size than threads started per pass: short passes (one decode row, a
    hit's few dozen recomputed rows) as well as a prefill must give one thread's bits, and so must passes from two
    calling threads at once (the second finds the workers busy and computes alone)."""
    import threading

    from simllm_ros.kernels import int4_kernel

    if int4_kernel.load() is None:
        pytest.skip(f"no 4-bit kernel here: {int4_kernel.why_not()}")
    assert KERNEL.pooled  # connected when the 4-bit kernel loaded
    cases = [(1, 10), (1, 300), (2, 100), (17, 300), (56, 240), (300, 0)]
    before = torch.get_num_threads()
    try:
        for rows, start in cases:
            assert rows * (start + rows) * HQ * D * 2 >= attention_kernel.POOL_THREAD_MIN_MACS or rows == 1
            q, kn, vn = _rows(torch.bfloat16, rows, 40 + rows)
            base = _buffers(torch.bfloat16, start + rows + 8, 50 + rows)
            got = []
            for n in (1, 2, 3):
                torch.set_num_threads(n)
                k, v = base[0].clone(), base[1].clone()
                got.append((_pass([(start, q, kn, vn, k, v)]), k, v))
            assert all(torch.equal(a, b) for g in got[1:] for a, b in zip(got[0], g)), (rows, start)
        torch.set_num_threads(2)
        q, kn, vn = _rows(torch.bfloat16, 56, 61)
        base = _buffers(torch.bfloat16, 320, 62)
        want = _pass([(240, q, kn, vn, base[0].clone(), base[1].clone())])
        out, errors = [], []

        def run():
            try:
                for _ in range(30):
                    out.append(_pass([(240, q, kn, vn, base[0].clone(), base[1].clone())]))
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)
        threads = [threading.Thread(target=run) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and len(out) == 60 and all(torch.equal(o, want) for o in out)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(PORTABLE is None or KERNEL is None or KERNEL.amx is not None,
                    reason="needs an AVX-512 build without AMX beside the portable one")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_portable_c_gives_the_avx512_bits(dtype):
    """The numerics contract (kernels/build.py): the portable C an aarch64 computer compiles performs the AVX-512
    code's operations (explicit fused multiply-adds, the same exp polynomial, the same lane tree), so a pass
    gives the same bits on either."""
    outs = []
    for kernel in (KERNEL, PORTABLE):
        (ka, va), (kb, vb) = _buffers(dtype, 80, 0), _buffers(dtype, 40, 1)
        qa, kna, vna = _rows(dtype, 5, 2)
        qb, knb, vnb = _rows(dtype, 1, 3)
        outs.append(_pass([(60, qa, kna, vna, ka, va), (30, qb, knb, vnb, kb, vb)], kernel=kernel))
    assert torch.equal(outs[0], outs[1])
