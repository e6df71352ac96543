"""The kernels' declared C ABI (kernels/abi.py): each library's *_api.h declares what it exports; the sources include
it, so the compiler checks every definition; every Python binding is checked against it before the library is
built, and a mismatch fails there, naming the function; the headers compile on their own."""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess

import pytest

from simllm_ros.kernels import (abi, attention_kernel, build, int4_kernel, int4_vector_kernel, layer_kernel,
                                memory_rate, norm_kernel)
from simllm_ros.model.load_checks import cpu_identity

CC = build.compiler()
BINDINGS = {"attention": attention_kernel.SIGNATURES, "int4_amx": int4_kernel.Int4Kernel.SIGNATURES,
            "int4_vector": int4_vector_kernel.VectorKernel.SIGNATURES, "layers": layer_kernel.SIGNATURES,
            "rmsnorm": norm_kernel.SIGNATURES, "membw": memory_rate.SIGNATURES}
# the public headers, and the two that were text fragments of int4_vector.c
HEADERS = sorted(name for name in os.listdir(build.SOURCE_DIR) if name.endswith(abi.HEADER_SUFFIX)) + \
    ["int8_rows.h", "int8_rows32.h"]


def test_every_library_has_a_header_and_every_binding_matches_it():
    assert sorted(BINDINGS) == sorted(build.KERNELS)
    for library, signatures in BINDINGS.items():
        abi.check(library, signatures)
        declared = abi.declared(library)
        assert set(signatures) <= set(declared)
    # the product libraries' pool entries come from the header they include
    assert abi.declared("int4_vector")["simllm_pool_call"].header == "pool_api.h"
    # entries some builds lack say which ([tag]); the Python side binds them as optional
    assert abi.declared("attention")["simllm_attend_amx_bf16"].tag == "amx"
    assert abi.declared("layers")["simllm_layers_bf16"].tag == "avx512"


def _headers_copy(tmp_path):
    for name in os.listdir(build.SOURCE_DIR):
        if name.endswith((".h", ".c")):
            shutil.copy(os.path.join(build.SOURCE_DIR, name), tmp_path / name)
    return tmp_path


def _edit(path, old, new):
    text = path.read_text()
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new))


@pytest.mark.parametrize("old, new, says", [
    # the last argument widened in the header: the binding still passes an int
    ("float *xsum, float *buf, long buf_per_thread, int nthreads);\n/* Q5_K",
     "float *xsum, float *buf, long buf_per_thread, long nthreads);\n/* Q5_K",
     "simllm_vec_q4k8_mm: argument 12 is bound as c_int, int4_vector_api.h declares c_long"),
    # an argument dropped
    ("void simllm_vec_q8r_mm(const float *x, long x_stride,", "void simllm_vec_q8r_mm(const float *x,",
     "simllm_vec_q8r_mm: the binding passes 12 arguments, int4_vector_api.h declares 11"),
    # a return value where the binding expects none
    ("long simllm_vec_buffer_floats(void);", "int simllm_vec_buffer_floats(void);",
     "simllm_vec_buffer_floats: returns c_long in the binding, int4_vector_api.h declares c_int"),
    # in the included pool header
    ("void simllm_pool_pin(const int *cpus, int n);", "void simllm_pool_pin(const int *cpus, long n);",
     "simllm_pool_pin: argument 2 is bound as c_int, pool_api.h declares c_long"),
    # renamed: the binding names an entry the header no longer declares
    ("void simllm_vec_iq4xs_mm(", "void simllm_vec_iq4xs_mm2(",
     "simllm_vec_iq4xs_mm: bound for the int4_vector library, but int4_vector_api.h does not declare it"),
])
def test_a_changed_header_fails_the_check_naming_the_function(tmp_path, old, new, says):
    src = _headers_copy(tmp_path)
    _edit(src / ("pool_api.h" if "pool" in old else "int4_vector_api.h"), old, new)
    with pytest.raises(abi.AbiMismatch) as e:
        abi.check("int4_vector", int4_vector_kernel.VectorKernel.SIGNATURES, source_dir=str(src))
    assert str(e.value) == says


def test_a_changed_binding_fails_the_build_before_compiling(tmp_path, monkeypatch):
    """Loader.load checks the bindings before it builds: a mismatch raises (it is no reason to fall back), and no
    compiler runs (SIMLLM_KERNEL_DIR is an empty folder that stays empty)."""
    monkeypatch.setenv("SIMLLM_KERNEL_DIR", str(tmp_path))
    wrong = dict(norm_kernel.SIGNATURES)
    args, restype = wrong["simllm_rmsnorm_f32"]
    wrong["simllm_rmsnorm_f32"] = (args[:-1] + [ctypes.c_double], restype)  # eps as a double
    loader = build.Loader("SIMLLM_NORM", "torch", "rmsnorm", norm_kernel.NormKernel, signatures=wrong)
    with pytest.raises(abi.AbiMismatch, match="simllm_rmsnorm_f32: argument 7 is bound as c_double, "
                                              "rmsnorm_api.h declares c_float"):
        loader.load()
    assert loader.kernel is None and os.listdir(tmp_path) == []


@pytest.mark.parametrize("old, new, says", [
    ("double simllm_memory_rate(", "unsigned short simllm_memory_rate(",
     "membw_api.h: simllm_memory_rate: type 'unsigned short' is not one kernels/abi.py reads"),
    ("times; -1: no threads */\n", "times; -1: no threads */\n#define SIMLLM_MEMBW_RATE\n",  # comment parted
     "membw_api.h: simllm_memory_rate: no comment above it saying why it is exported"),
])
def test_a_header_out_of_the_declared_form_is_refused(tmp_path, old, new, says):
    src = _headers_copy(tmp_path)
    _edit(src / "membw_api.h", old, new)
    with pytest.raises(abi.AbiMismatch, match=re.escape(says)):
        abi.check("membw", memory_rate.SIGNATURES, source_dir=str(src))


@pytest.mark.skipif(CC is None, reason="no C compiler")
def test_the_compiler_checks_each_definition_against_the_header(tmp_path):
    src = _headers_copy(tmp_path)
    cmd = [CC, "-fsyntax-only", "-std=gnu11", f"-I{src}", str(src / "rmsnorm.c")]
    assert subprocess.run(cmd, capture_output=True, text=True, timeout=60).returncode == 0
    _edit(src / "rmsnorm_api.h", "float *y, int M, int E, float eps);\n\n#endif",
          "float *y, int M, long E, float eps);\n\n#endif")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "conflicting types for" in done.stderr and "simllm_rmsnorm_f32" in done.stderr


@pytest.mark.skipif(CC is None, reason="no C compiler")
def test_the_headers_compile_on_their_own_and_the_rows_headers_define_their_parts(tmp_path):
    """A real header includes what it uses: each compiles alone (int8_rows.h with the vector layer it includes);
    int8_rows32.h defines every format's part of a product, which int4_vector.c's entries run."""
    parts = ("part6k8", "part3k8", "part4k8", "part5k8", "part8r", "part5r", "part51r", "part4r", "partiq4",
             "partiq4xs")
    for header in HEADERS:
        unit = tmp_path / f"{header}.c"
        body = f'#include "{header}"\n'
        if header == "int8_rows32.h":
            body += f"void *(*const parts[])(void *) = {{{', '.join(parts)}}};\n"
        unit.write_text(body)
        done = subprocess.run([CC, "-fsyntax-only", "-std=gnu11", "-march=native", f"-I{build.SOURCE_DIR}",
                               str(unit)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{header}: {done.stderr[-1500:]}"


def _exports(path):
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm to list a library's exports")
    out = subprocess.run([nm, "-D", "--defined-only", path], capture_output=True, text=True, timeout=60).stdout
    return {line.split()[-1] for line in out.splitlines() if " T " in line and "simllm_" in line}


@pytest.mark.skipif(CC is None, reason="no C compiler")
@pytest.mark.parametrize("library", build.KERNELS)
def test_each_library_exports_what_its_header_declares(library):
    """This machine's build (shared with the kernels' own tests: built once) exports every untagged declared entry
    and nothing undeclared; a tagged one only where its build has it."""
    exported = _exports(build.build(library))
    declared = abi.declared(library)
    assert exported - set(declared) == set()
    assert {name for name, p in declared.items() if not p.tag} <= exported


@pytest.mark.skipif(CC is None, reason="no C compiler")
def test_the_vector_and_norm_kernels_load_where_the_cpu_has_their_instructions():
    """Every product test skips where the vector kernel is None, and a kernel whose self-check fails (a wrong bit
    in a path of a few rows, say) is None: on a CPU with AVX2 (x86) or dot products (aarch64) that must fail here,
    not skip the model tests quietly."""
    flags = set(cpu_identity().split())  # the CPU's model name and feature flags
    if not ({"avx2", "fma"} <= flags or "asimddp" in flags):
        pytest.skip("neither AVX2 + FMA nor aarch64 dot products here")
    assert int4_vector_kernel.load() is not None, int4_vector_kernel.why_not()
    assert norm_kernel.load() is not None, norm_kernel.why_not()
