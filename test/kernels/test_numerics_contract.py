"""The kernels' numerics contract (kernels/build.py): built with contraction off and explicit fused multiply-adds,
the same source gives the same bits on x86 with AVX-512, AVX2 or no vector FMA at all, and on aarch64 (NEON),
checked here by cross-compiling for aarch64 and running under qemu-aarch64; every kernel builds -Wall -Wextra
clean for each of those targets.

scripts/setup.sh installs the cross compiler and qemu (Debian's gcc-aarch64-linux-gnu, qemu-user) where it can;
elsewhere the aarch64 checks skip and say why, except in CI (CI=true), where a missing tool fails them."""
from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

from simllm_ros.kernels import int4_vector_kernel
from simllm_ros.kernels import build
from simllm_ros.model.runner_weights import int4_codes, int4_dequantized, q8_codes

HERE = os.path.dirname(os.path.abspath(__file__))
DRIVER = os.path.join(HERE, "native", "bitcheck.c")
CC = build.compiler()
CROSS = shutil.which("aarch64-linux-gnu-gcc")
QEMU = shutil.which("qemu-aarch64")
SYSROOT = "/usr/aarch64-linux-gnu"
AARCH64 = ("-march=armv8.2-a+fp16+dotprod",)  # Jetson Orin's Cortex-A78AE; a Raspberry Pi 5's A76 too
X86 = {"native": ("-march=native",), "avx2": ("-march=x86-64-v3",), "no-fma": ("-march=x86-64",),
       "avx512-no-vnni": ("-march=skylake-avx512",)}  # AVX-512 with byte ops but not VNNI's dot products
CHECKED = ("int4_vector", "rmsnorm", "layers", "attention")  # the float32 path's entry points the driver runs
IS_X86 = os.uname().machine in ("x86_64", "AMD64")

pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler")


def _need_aarch64_tools():
    if CROSS and QEMU and os.path.isdir(SYSROOT):
        return
    why = "aarch64 checks need gcc-aarch64-linux-gnu and qemu-user (scripts/setup.sh installs them with apt-get)"
    if os.environ.get("CI"):
        pytest.fail(f"{why}: missing in CI")
    pytest.skip(why)


def _compile(cc, name, out, target_flags):
    done = subprocess.run(build.command(name, cc, out, ("-Werror",), target_flags), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"{name} {target_flags}: {done.stderr[-2000:]}"


def test_the_build_turns_contraction_off_and_names_the_contract():
    cmd = build.command("int4_vector", "cc", "out.so")
    assert "-ffp-contract=off" in cmd and "-Wall" in cmd and "-Wextra" in cmd
    assert build.CONTRACT


@pytest.mark.skipif(not IS_X86, reason="x86 targets")
@pytest.mark.parametrize("target", sorted(X86))
@pytest.mark.parametrize("name", build.KERNELS)
def test_every_kernel_builds_warning_free_on_x86(tmp_path, name, target):
    _compile(CC, name, str(tmp_path / f"{name}.so"), X86[target])


@pytest.mark.parametrize("name", build.KERNELS)
def test_every_kernel_builds_warning_free_for_aarch64(tmp_path, name):
    if not CROSS:
        _need_aarch64_tools()
    _compile(CROSS, name, str(tmp_path / f"{name}.so"), AARCH64)


def _bf16_bits(t: torch.Tensor) -> bytes:
    return t.to(torch.bfloat16).view(torch.int16).numpy().tobytes()


def _case(path, seed=0):
    """Inputs for the driver (test/kernels/native/bitcheck.c): real packed weights from the package's own packers."""
    g = torch.Generator().manual_seed(seed)
    m, n, k, e, inter, h, d = 14, 96, 768, 576, 1536, 3, 64  # k in 256s: a Q4_K super-block; m past ROWS_AT_ONCE
    w = torch.randn(n, k, generator=g) * 0.05
    codes, sz = int4_codes(w)
    kernel = int4_vector_kernel.VectorKernel  # packing is plain torch: no library needed
    files = {
        "shape.i32": np.array([m, n, k, e, inter, h, d], dtype=np.int32).tobytes(),
        "x.f32": torch.randn(m, k, generator=g).numpy().tobytes(),
        "w4.u8": kernel.pack(codes, sz).numpy().tobytes(),
        "w8.u8": kernel.pack8(*q8_codes(int4_dequantized(codes, sz))).numpy().tobytes(),
        "w6.u8": kernel.pack6(torch.randint(-32, 32, (n, k), generator=g),  # Q6_K's codes, a scale per 16
                              torch.rand(n, k // 16, generator=g) * 0.01).numpy().tobytes(),
        "w4k.u8": kernel.pack_q4k(torch.randint(0, 16, (n, k), generator=g),  # Q4_K's own layout
                                  torch.randint(0, 64, (n, k // 32), generator=g),
                                  torch.randint(0, 64, (n, k // 32), generator=g),
                                  (torch.rand(n, k // 256, generator=g) * 0.01).half().float(),
                                  (torch.rand(n, k // 256, generator=g) * 0.01).half().float()).numpy().tobytes(),
        "w4k8.u8": kernel.pack_q4k8(torch.randint(0, 16, (n, k), generator=g),  # Q4_K for 8-bit rows
                                    torch.randint(0, 64, (n, k // 32), generator=g),
                                    torch.randint(0, 64, (n, k // 32), generator=g),
                                    (torch.rand(n, k // 256, generator=g) * 0.01).half().float(),
                                    (torch.rand(n, k // 256, generator=g) * 0.01).half().float()).numpy().tobytes(),
        "w5k8.u8": kernel.pack_q5k8(torch.randint(0, 32, (n, k), generator=g),  # Q5_K for 8-bit rows
                                    torch.randint(0, 64, (n, k // 32), generator=g),
                                    torch.randint(0, 64, (n, k // 32), generator=g),
                                    (torch.rand(n, k // 256, generator=g) * 0.01).half().float(),
                                    (torch.rand(n, k // 256, generator=g) * 0.01).half().float()).numpy().tobytes(),
        "w6k8.u8": kernel.pack_q6k8(torch.randint(-32, 32, (n, k), generator=g),  # Q6_K for 8-bit rows
                                    torch.randint(-128, 128, (n, k // 16), generator=g),
                                    (torch.rand(n, k // 256, generator=g) * 0.01).half().float()).numpy().tobytes(),
        "w8r.u8": kernel.pack_q8r(torch.randint(-127, 128, (n, k), generator=g),  # Q8_0 for 8-bit rows per 32
                                  (torch.rand(n, k // 32, generator=g) * 0.01).half().float()).numpy().tobytes(),
        "w5r.u8": kernel.pack_q5r(torch.randint(-16, 16, (n, k), generator=g),  # Q5_0 for 8-bit rows per 32
                                  (torch.rand(n, k // 32, generator=g) * 0.01).half().float()).numpy().tobytes(),
        "w4r.u8": kernel.pack_q4r(torch.randint(0, 16, (n, k), generator=g),  # Q4_0 for 8-bit rows per 32
                                  (torch.rand(n, k // 32, generator=g) * 0.01).half().float()).numpy().tobytes(),
        "w3k8.u8": kernel.pack_q3k8(torch.randint(-4, 4, (n, k), generator=g),  # Q3_K for 8-bit rows
                                    torch.randint(-32, 32, (n, k // 16), generator=g),
                                    (torch.rand(n, k // 256, generator=g) * 0.01).half().float()).numpy().tobytes(),
        "w51r.u8": kernel.pack_q51r(torch.randint(0, 32, (n, k), generator=g),  # Q5_1 for 8-bit rows per 32
                                    (torch.rand(n, k // 32, generator=g) * 0.01).half().float(),
                                    (torch.rand(n, k // 32, generator=g) * -0.1).half().float()).numpy().tobytes(),
        "wiq4r.u8": kernel.pack_iq4r(  # IQ4_NL for 8-bit rows per 32: table values, a float16 d per 32
            torch.tensor(int4_vector_kernel.IQ4_VALUES)[torch.randint(0, 16, (n, k), generator=g)],
            (torch.rand(n, k // 32, generator=g) * 0.01).half().float()).numpy().tobytes(),
        "wiq4xs.u8": kernel.pack_iq4xs(  # IQ4_XS: table values, sub-scales less 32 per 32, d per 256
            torch.tensor(int4_vector_kernel.IQ4_VALUES)[torch.randint(0, 16, (n, k), generator=g)],
            torch.randint(-32, 32, (n, k // 32), generator=g),
            (torch.rand(n, k // 256, generator=g) * 0.01).half().float()).numpy().tobytes(),
        "nx.f32": (torch.randn(m, e, generator=g) * 3).numpy().tobytes(),
        "nw.f32": torch.randn(e, generator=g).numpy().tobytes(),
        "nx.bf16": _bf16_bits(torch.randn(m, e, generator=g) * 3),
        "nw.bf16": _bf16_bits(torch.randn(e, generator=g)),
        "gu.f32": _activation_inputs(torch.randn(m, 2 * inter, generator=g) * 6).numpy().tobytes(),
        "rx.f32": torch.randn(m, h * d, generator=g).numpy().tobytes(),
        "cos.f32": torch.rand(m, d, generator=g).numpy().tobytes(),
        "sin.f32": torch.rand(m, d, generator=g).numpy().tobytes(),
        "ak.f32": torch.randn(m, d, generator=g).numpy().tobytes(),  # attention's keys and values (one KV head)
        "av.f32": torch.randn(m, d, generator=g).numpy().tobytes(),
    }
    os.makedirs(path, exist_ok=True)
    for name, data in files.items():
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)
    return m, n


# The driver's products, each run on row cuts at 1 and 2 threads (its outputs <product>_t<threads>_<r0>_<r1>.f32)
PRODUCTS = ("mm3k8", "mm4", "mm4k", "mm4k8", "mm5k8", "mm6", "mm6k8", "mm8", "mm8r", "mm5r", "mm51r", "mm4r",
            "mmiq4r", "mmiq4xs")


def _activation_inputs(gu: torch.Tensor) -> torch.Tensor:
    """The MLP's gate inputs with what the clamps and the 16-lane form must treat as the scalar one does: beyond the
    clamps both ways, infinities, NaN, signed zeros and subnormals, spread over the first row's vector lanes."""
    special = torch.tensor([100.0, -100.0, 88.5, -87.5, float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-40,
                            -1e-40, 3e38, -3e38, 1e-3, -1e-3, 20.0, -20.0, 50.0])
    gu[0, :special.numel()] = special
    gu[-1, 5:5 + special.numel()] = special.flip(0)
    return gu


def _outputs(path) -> dict[str, bytes]:
    out = {}
    for name in os.listdir(path):
        if name.startswith(tuple(f"{kind}_" for kind in PRODUCTS) + ("norm_", "silu_", "gelu_", "rope_", "att_")):
            with open(os.path.join(path, name), "rb") as f:
                out[name] = f.read()
    return out


def _run(tmp_path, label, cc, target_flags, runner=()):
    """Build the checked kernels and the driver for one target, run the driver on a fresh case: its outputs."""
    libs, case = tmp_path / f"{label}-libs", tmp_path / f"{label}-case"
    libs.mkdir()
    for name in CHECKED:
        _compile(cc, name, str(libs / f"{name}.so"), target_flags)
    exe = str(tmp_path / f"bitcheck-{label}")
    # -O1: aarch64 gcc 12.2 has failed with an internal error on a driver like this at -O2 (PLATFORM.md)
    done = subprocess.run([cc, "-O1", "-Wall", "-Wextra", "-Werror", DRIVER, "-o", exe, "-ldl"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    m, n = _case(str(case))
    done = subprocess.run([*runner, exe, str(libs), str(case)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.stdout, done.stderr[-2000:])
    return _outputs(str(case)), m, n


def _rows_do_not_depend_on_their_neighbours(out, m, n):
    """The driver ran row cuts at 1 and 2 threads: each cut equals those rows of the whole product."""
    for kind in PRODUCTS:
        whole = np.frombuffer(out[f"{kind}_t1_0_{m}.f32"], dtype=np.float32).reshape(m, n)
        for name, data in out.items():
            if name.startswith(kind + "_"):
                r0, r1 = (int(v) for v in name[:-4].split("_")[2:])
                assert np.array_equal(np.frombuffer(data, dtype=np.float32).reshape(-1, n), whole[r0:r1]), name
    # attention: a row's output is the same in one pass or two, at 1 or 2 threads; soft-capping changes it
    for cap in (0, 1):
        whole = out[f"att_c{cap}_t1_p{m}.f32"]
        assert all(out[f"att_c{cap}_t{t}_p{p}.f32"] == whole for t in (1, 2) for p in (5, m))
    assert out[f"att_c0_t1_p{m}.f32"] != out[f"att_c1_t1_p{m}.f32"]


@pytest.mark.skipif(not IS_X86, reason="x86 targets")
def test_x86_with_and_without_vector_fma_gives_the_same_bits(tmp_path):
    """AVX-512 (where the CPU has it, and without VNNI where it has AVX512BW), AVX2+FMA and baseline x86-64 (SSE2,
    fmaf from libm) compute alike."""
    native, m, n = _run(tmp_path, "native", CC, X86["native"])
    _rows_do_not_depend_on_their_neighbours(native, m, n)
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        flags = f.read()
    for label in ("avx2", "no-fma") + (("avx512-no-vnni",) if " avx512bw" in flags else ()):
        other, _, _ = _run(tmp_path, label, CC, X86[label])
        assert other.keys() == native.keys()
        differ = [k for k in native if other[k] != native[k]]
        assert not differ, f"{label} differs from native in {differ}"


def test_aarch64_under_qemu_gives_this_machines_bits(tmp_path):
    _need_aarch64_tools()
    native, m, n = _run(tmp_path, "native", CC, ("-march=native",) if IS_X86 else AARCH64)
    arm, _, _ = _run(tmp_path, "aarch64", CROSS, AARCH64, runner=(QEMU, "-L", SYSROOT))
    _rows_do_not_depend_on_their_neighbours(arm, m, n)
    # every product at 2 thread counts x 6 row cuts, and the 14 outputs of the norm, SiLU, GELU, RoPE and attention
    assert arm.keys() == native.keys() and len(arm) == 12 * len(PRODUCTS) + 14
    differ = [k for k in native if arm[k] != native[k]]
    assert not differ, f"aarch64 differs from this machine in {differ}"
