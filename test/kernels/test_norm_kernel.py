"""The C RMSNorm (norm_kernel): transformers' LlamaRMSNorm to the bit here, a row's result alone, rows read
in place (also a repeated row), bad input refused, and the torch module when asked."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from simllm_ros.kernels import norm_kernel

KERNEL = norm_kernel.load()
pytestmark = pytest.mark.skipif(KERNEL is None, reason=f"norm kernel: {norm_kernel.why_not()}")


def _norm(e=576, eps=1e-5, seed=0):
    n = LlamaRMSNorm(e, eps).to(torch.bfloat16)
    n.weight.data = (torch.rand(e, generator=torch.Generator().manual_seed(seed)) + 0.5).to(torch.bfloat16)
    return n


@pytest.mark.parametrize("scale", [1e-3, 1.0, 40.0])
def test_it_computes_what_transformers_computes(scale):
    n = _norm()
    x = (torch.randn(1, 41, 576, generator=torch.Generator().manual_seed(1)) * scale).to(torch.bfloat16)
    want, got = n(x), KERNEL.rmsnorm(x, n.weight.data, n.variance_epsilon)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    # the same formula and roundings; float32 sums in another order may move a value by one bf16 step
    assert (got.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()
    assert (got == want).float().mean() >= 0.99


def test_a_row_is_computed_alone_and_views_are_read_in_place():
    n = _norm(seed=2)
    x = torch.randn(1, 37, 576, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    whole = KERNEL.rmsnorm(x, n.weight.data, 1e-5)
    for a, b in ((0, 1), (5, 9), (36, 37), (0, 37)):
        assert torch.equal(KERNEL.rmsnorm(x[:, a:b], n.weight.data, 1e-5), whole[:, a:b])
    rep = x[0, 4].expand(2, -1)  # one row twice (stride 0), as the runner pads a lone token
    assert torch.equal(KERNEL.rmsnorm(rep, n.weight.data, 1e-5), whole[0, 4].expand(2, -1))
    wide = torch.randn(37, 700).to(torch.bfloat16)
    wide[:, :576] = x[0]
    assert torch.equal(KERNEL.rmsnorm(wide[:, :576], n.weight.data, 1e-5), whole[0])  # strided rows


def test_bad_input_is_refused_and_the_runner_uses_it_only_where_it_applies():
    n = _norm()
    with pytest.raises(ValueError, match="norm kernel"):
        KERNEL.rmsnorm(torch.randn(3, 576), n.weight.data, 1e-5)  # float32 rows
    with pytest.raises(ValueError, match="norm kernel"):
        KERNEL.rmsnorm(torch.randn(3, 512).to(torch.bfloat16), n.weight.data, 1e-5)  # another size
    assert not KERNEL.takes(torch.ones(72)) and not KERNEL.takes(torch.ones(72, dtype=torch.bfloat16))
    assert not KERNEL.takes(torch.ones(576, dtype=torch.float16))
    from simllm_ros.model.runner_weights import Norm

    assert Norm(n, KERNEL).kernel is KERNEL
    assert Norm(n.float(), KERNEL).kernel is KERNEL  # float32 too (the 4-bit float32 runner)
    assert Norm(n.half(), KERNEL).kernel is None  # float16 keeps the module


def test_the_module_when_asked():
    code = "from simllm_ros.kernels import norm_kernel as k; kern = k.load(); print(kern is None, k.why_not())"
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
           "SIMLLM_NORM": "torch"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("True SIMLLM_NORM=torch"), done.stdout


def test_float32_rows_compute_what_transformers_computes_and_a_row_alone():
    """The 4-bit float32 runner's norms: transformers' float32 formula up to the order of the sum of squares, and
    a row's bits whatever rows come with it (what lossless reuse in float32 rests on)."""
    n = _norm(seed=4).float()
    x = torch.randn(1, 41, 576, generator=torch.Generator().manual_seed(5)) * 3
    want, got = n(x), KERNEL.rmsnorm(x, n.weight.data, n.variance_epsilon)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    for a, b in ((0, 1), (3, 20), (40, 41)):
        assert torch.equal(KERNEL.rmsnorm(x[:, a:b], n.weight.data, n.variance_epsilon), got[:, a:b])
    with pytest.raises(ValueError, match="norm kernel"):
        KERNEL.rmsnorm(x.to(torch.bfloat16), n.weight.data, n.variance_epsilon)  # rows of another dtype
