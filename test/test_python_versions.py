"""The package on the robots' Pythons: JetPack 6 runs 3.10 (Humble), Ubuntu 24.04 3.12 (Jazzy). Where such an
interpreter is on this machine (PATH or pyenv), every module compiles under it, and the stdlib-only parts (settings,
request records, thermal zones, energy sensors) import and run there. The whole ROS-free suite needs torch and the
pinned packages for that Python (README: install per platform)."""
import glob
import os
import shutil
import subprocess

import pytest

from conftest import REPO


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
