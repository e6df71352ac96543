"""Our C attention kernel (simllm_ros.attention_kernel): compiled here with the system compiler, called on real
tensors, checked against a float64 reference and for what makes reuse lossless: a query row's result is
bitwise the same whatever other rows, masked keys or buffer layout come with it."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from simllm_ros import attention_kernel

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNEL = attention_kernel.load()
pytestmark = pytest.mark.skipif(KERNEL is None, reason=f"no attention kernel here: {attention_kernel.why_not()}")


def _reference(q, k, v, allowed):
    """float64 attention of the same (already rounded) inputs; allowed [H, R, T] bool."""
    s = torch.einsum("hrd,htd->hrt", q.double(), k.double()).masked_fill(~allowed, float("-inf"))
    return torch.einsum("hrt,htd->hrd", torch.softmax(s, dim=-1), v.double())


def _inputs(dtype, H=3, R=6, T=50, D=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    # keys and values as slices of a bigger [L, H, C, D] buffer, like the runner's KVBuffer
    buf = torch.randn(2, 4, H, T + 7, D, generator=g).to(dtype)
    q = (torch.randn(H, R, D, generator=g) * D ** -0.5).to(dtype)
    return q, buf[0, 1, :, :T], buf[1, 1, :, :T]


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
def test_matches_a_float64_reference_in_every_mode(dtype, tol):
    H, M, G, T = 3, 4, 2, 50
    R, start = G * M, T - M
    q, k, v = _inputs(dtype, H=H, R=R, T=T)
    every = torch.ones(H, R, T, dtype=torch.bool)
    m = torch.arange(R) % M
    causal = (torch.arange(T)[None, :] <= (start + m)[:, None]).expand(H, R, T)
    rng = torch.Generator().manual_seed(3)
    allowed = torch.rand(R, T, generator=rng) > 0.4
    allowed[:, 0] = True  # every row attends at least one key
    for got, want in ((KERNEL(q, k, v), every),
                      (KERNEL(q, k, v, first=start, causal_m=M), causal),
                      (KERNEL(q, k, v, ~allowed, 0), allowed.expand(H, R, T)),
                      (KERNEL(q, k, v, ~allowed[:, 10:], 10), (allowed | (torch.arange(T) < 10)).expand(H, R, T))):
        ref = _reference(q, k, v, want)
        assert got.dtype == dtype and got.shape == q.shape
        err = (got.double() - ref).abs().max().item()
        assert err <= tol * ref.abs().max().item(), err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_row_gets_the_same_bits_whatever_runs_with_it(dtype):
    """A prefill's causal pass, the same tokens one at a time (a decode), a pass with an explicit mask over
    extra keys, and contiguous copies of the keys: each query row bitwise the same in all of them."""
    H, M, D = 3, 37, 64
    T = 100
    start = T - M
    q, k, v = _inputs(dtype, H=H, R=M, T=T + 30, D=D, seed=1)
    whole = KERNEL(q, k[:, :T], v[:, :T], first=start, causal_m=M)
    own = torch.arange(start, T)
    blocked = own[None, :] > own[:, None]  # the same causality as a mask
    masked = KERNEL(q, k[:, :T], v[:, :T], blocked, start)
    assert torch.equal(whole, masked)
    # keys past the pass, masked off: the rows must not notice them
    extra = torch.cat([blocked, torch.ones(M, 30, dtype=torch.bool)], dim=1)
    assert torch.equal(KERNEL(q, k, v, extra, start), whole)
    for m in (0, 1, 15, 16, 17, M - 1):  # around the kernel's 16-key vectors and 8-row blocks
        one = KERNEL(q[:, m:m + 1].contiguous(), k[:, :start + m + 1], v[:, :start + m + 1])
        assert torch.equal(one, whole[:, m:m + 1]), m
        copy = KERNEL(q[:, m:m + 1].contiguous(), k[:, :start + m + 1].contiguous(), v[:, :start + m + 1].contiguous())
        assert torch.equal(copy, one), m
    # rows in another order and company (two query heads of a group sharing keys): same bits
    pair = torch.cat([q[:, 5:6], q[:, 20:21]], dim=1).contiguous()
    got = KERNEL(pair, k[:, :start + 21], v[:, :start + 21], first=start + 5, causal_m=0,
                 blocked=torch.tensor([[False] * 1 + [True] * 15, [False] * 16])[:, :16])
    assert torch.equal(got[:, 0], whole[:, 5]) and torch.equal(got[:, 1], whole[:, 20])


def test_bad_shapes_and_dtypes_are_refused():
    q, k, v = _inputs(torch.bfloat16)
    with pytest.raises(ValueError, match="mask"):
        KERNEL(q, k, v, torch.zeros(q.shape[1], 3, dtype=torch.bool), 0)
    with pytest.raises(ValueError, match="dtype"):
        KERNEL(q, k.float(), v)
    assert not KERNEL.supports(torch.float16, 64, "cpu") and not KERNEL.supports(torch.bfloat16, 72, "cpu")
    assert not KERNEL.supports(torch.bfloat16, 64, "meta") and KERNEL.supports(torch.bfloat16, 64, "cpu")


def test_torch_path_when_asked_and_a_cached_build_is_reused():
    code = ("from simllm_ros import attention_kernel as a; k = a.load(); "
            "print(k is None, a.why_not(), k.path if k else '')")
    env = {**os.environ, "PYTHONPATH": REPO}
    off = subprocess.run([sys.executable, "-c", code], env={**env, "SIMLLM_ATTENTION": "torch"},
                         capture_output=True, text=True, timeout=120)
    assert off.returncode == 0, off.stderr
    assert off.stdout.startswith("True SIMLLM_ATTENTION=torch"), off.stdout
    on = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert on.returncode == 0, on.stderr
    assert on.stdout.split()[-1] == KERNEL.path  # the library built once per machine is the one loaded


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
