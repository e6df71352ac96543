"""The package on the robots' Pythons: JetPack 6 runs 3.10 (Humble), Ubuntu 24.04 3.12 (Jazzy). Where such an
interpreter is on this machine (PATH or pyenv), every module compiles under it, and the stdlib-only parts (settings,
request records, thermal zones, energy sensors) import and run there. Where scripts/test_pythons.sh has made that
Python's venv (torch and the pins for it; scripts/setup.sh makes both), a part of the ROS-free suite (SUBSET) runs
under it as well; the whole ROS-free suite on 3.10 and 3.12 is scripts/test.sh --pythons (docs/install.md)."""
import ast
import glob
import hashlib
import os
import re
import shutil
import subprocess

import pytest

from conftest import REPO, ROS_TEST_DIR


def interpreter(version: str) -> str | None:
    """pyenv's build of that version, else one on PATH (not a pyenv shim: it answers for the active version)."""
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    paths = sorted(glob.glob(os.path.join(root, "versions", f"{version}.*", "bin", "python")))
    if paths:
        return paths[-1]
    found = shutil.which(f"python{version}")
    return found if found and "/shims/" not in found else None


CORE = """
import sys
sys.path.insert(0, {repo!r})
from simllm_ros.settings import Settings
from simllm_ros.request import QueryResult
from simllm_ros.serving.energy import EnergyMeter
from simllm_ros.serving.thermal import ThermalMonitor
assert Settings.from_overrides().energy_source == "auto"
assert EnergyMeter.open("auto", {tmp!r}).description.startswith("none: ")
assert ThermalMonitor({tmp!r}, "auto").read().zones == []
print(sys.version_info[:2], QueryResult(success=True).energy_source)
"""


@pytest.mark.parametrize("version", ["3.10", "3.12"])
def test_compiles_and_core_runs(version, tmp_path):
    python = interpreter(version)
    if python is None:
        pytest.skip(f"no python{version} on this machine (PATH or pyenv)")
    env = {**os.environ, "PYTHONPYCACHEPREFIX": str(tmp_path / "pycache")}  # nothing written into the tree
    r = subprocess.run([python, "-m", "compileall", "-q", os.path.join(REPO, "simllm_ros")], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run([python, "-c", CORE.format(repo=REPO, tmp=str(tmp_path))], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"({version.replace('.', ', ')})"), r.stdout


# The part of the ROS-free suite that the suite itself runs on 3.10 and 3.12 where their venvs exist: CI's form of
# "the ROS-free suite on each Python" (the whole of it there: scripts/test.sh --pythons, benchmark/results/
# python_versions.md). Chosen for what differs per Python: the kernels through ctypes and numpy, the pool and its
# persistence with the embedded model (torch, safetensors, transformers: 5.20.2 on 3.10, 5.24.0 on 3.12), the
# MiniLM fingerprints (sentence-transformers), the model skeleton from transformers' configs, and request validation
# under hypothesis (its pin differs on 3.10). Its time on each Python: benchmark/results/python_versions.md.
SUBSET = (  # kept short: it runs on each other Python inside the suite's time; the whole ROS-free suite is --pythons
    "test/kernels/test_kernel_abi.py",
    "test/kernels/test_norm_kernel.py",
    "test/cache/test_kv_pool.py",
    "test/cache/test_reuse_planner.py",
    "test/cache/test_cache_map.py",
    "test/cache/test_cache_stats.py",
    "test/cache/test_persistence.py",
    "test/model/test_skeleton.py",
    "test/serving/test_validation.py",
    "test/serving/test_settings.py",
)
# Where a Python's pins make a test's premise false, the test is left out there, with the reason (and
# benchmark/results/python_versions.md says so): not a behaviour of ours, an import cost of that transformers.
LEFT_OUT = {
    "3.10": {
        "test/model/test_skeleton.py::test_its_activations_are_transformers_and_building_imports_no_sympy":
            "with transformers 5.20.2 (3.10's pin) importing a Qwen2 or Gemma 3 config class (configuration_qwen2) "
            "imports transformers.models.auto.auto_factory, and with it generation code, torch.distributed.tensor "
            "and sympy",
    },
}
STACK = ("import platform, numpy, torch, transformers; print(platform.python_version().rsplit('.', 1)[0], "
         "torch.__version__.split('+')[0], transformers.__version__, numpy.__version__)")
VENVS = os.environ.get("SIMLLM_PY_VENVS", os.path.expanduser("~/.cache/simllm_ros"))


def venv_for(version: str) -> tuple[str | None, str]:
    """The venv scripts/test_pythons.sh made for that Python, if its pins are today's; else None and why not."""
    venv = os.path.join(VENVS, "py" + version.replace(".", ""))
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        return None, (f"no {venv}: scripts/setup.sh makes it (unless SIMLLM_SKIP_PYTHONS=1), or "
                      "scripts/test_pythons.sh --setup-only")
    constraints = f"constraints-py{version.replace('.', '')}.txt"
    digest = hashlib.sha256()
    for name in ("requirements.txt", "requirements-models.txt", constraints):  # what the script's stamp hashes
        with open(os.path.join(REPO, name), "rb") as f:
            digest.update(f.read())
    try:
        with open(os.path.join(venv, ".simllm_requirements.sha256"), encoding="utf-8") as f:
            stamp = f.read().strip()
    except OSError:
        stamp = ""
    if stamp != digest.hexdigest():
        return None, f"{venv} holds other pins than the checkout's: run scripts/test_pythons.sh --setup-only"
    return python, ""


def test_the_subset_is_ros_free_and_exists():
    for name in SUBSET:
        assert os.path.isfile(os.path.join(REPO, name)), name
        assert not os.path.abspath(os.path.join(REPO, name)).startswith(ROS_TEST_DIR + os.sep), name


@pytest.mark.parametrize("version", ["3.10", "3.12"])
def test_ros_free_subset_passes_in_that_pythons_venv(version):
    python, why = venv_for(version)
    if python is None:
        pytest.skip(why)
    # torch, transformers and numpy import on that Python, at the versions requirements.txt pins for it
    from test_install_paths import _pins
    pins = _pins("requirements.txt", version)
    r = subprocess.run([python, "-c", STACK], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == [version, pins["torch"], pins["transformers"], pins["numpy"]], r.stdout
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "OMP_NUM_THREADS"))}
    left_out = [a for test in LEFT_OUT.get(version, {}) for a in ("--deselect", test)]
    r = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", *SUBSET, *left_out],
                       cwd=REPO, env={**env, "PYTHONDONTWRITEBYTECODE": "1"}, capture_output=True, text=True,
                       timeout=1200)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    summary = r.stdout.strip().splitlines()[-1]
    assert re.search(r"\b\d+ passed\b", summary) and " failed" not in summary and " error" not in summary, summary


ROS_USE = re.compile(r"^\s*(from|import)\s+(rclpy|\w+_(msgs|srvs))\b|\bsimllm_ros\.(ros|msg|srv|action)\b|"
                     r"from simllm_ros import (msg|srv|action)\b|\bros_harness_factory\b|\bRosHarness\b", re.M)


def _unguarded(source: str) -> str:
    """The source less the test functions that skip themselves where ROS is missing (pytest.importorskip first):
    those run, skipped, in a venv without ROS."""
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.body and "importorskip(" in ast.unparse(node.body[0]):
            for i in range(node.lineno - 1, node.end_lineno or node.lineno):
                lines[i] = ""
    return "\n".join(lines)


def test_the_ros_test_files_are_listed():
    """test/ros/ (conftest.ROS_TEST_DIR) is what a venv without ROS leaves out: every test file that uses ROS
    (outside test functions that skip themselves without it) is in it, and every file in it uses ROS (a file there
    that needs none would be hidden from the ROS-free suite)."""
    tests = os.path.dirname(ROS_TEST_DIR)
    using, ros_folder = set(), set()
    for path in glob.glob(os.path.join(tests, "**", "test_*.py"), recursive=True):
        name = os.path.relpath(path, tests)
        if os.path.dirname(path) == ROS_TEST_DIR:
            ros_folder.add(name)
        with open(path, encoding="utf-8") as f:
            if ROS_USE.search(_unguarded(f.read())):
                using.add(name)
    using.discard(os.path.relpath(__file__, tests))  # this file names the patterns only
    assert ros_folder and len(using) >= len(ros_folder)  # the scan sees files at all
    assert using - ros_folder == set(), "use ROS but are not in test/ros/"
    assert ros_folder - using == set(), "in test/ros/ but use no ROS"
