"""The package's lint and type checks, as tests: ruff (ruff.toml) over simllm_ros/ and mypy (mypy.ini, the
sub-packages it names) must be clean.

Each check is also run once on a small file with a known fault, so a check that stopped looking (a config that
excludes everything, a tool that no longer runs) fails here too. mypy keeps its cache in tmp/.mypy_cache (ignored by
git): a cold run reads the third-party stubs once, later runs only what changed.
"""
import glob
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MYPY_CACHE = os.path.join(REPO, "tmp", ".mypy_cache")


def _run(*args: str, cwd: str = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True, timeout=600)


def _ruff(*targets: str) -> subprocess.CompletedProcess:
    return _run("ruff", "check", "--config", os.path.join(REPO, "ruff.toml"), "--output-format", "concise", *targets)


def _mypy(*targets: str) -> subprocess.CompletedProcess:
    return _run("mypy", "--config-file", os.path.join(REPO, "mypy.ini"), "--cache-dir", MYPY_CACHE, *targets)


def test_ruff_is_clean():
    r = _ruff("simllm_ros")
    assert r.returncode == 0, f"ruff found problems in simllm_ros/ (ruff.toml):\n{r.stdout}{r.stderr}"
    listed = _run("ruff", "check", "--config", os.path.join(REPO, "ruff.toml"), "--show-files", "simllm_ros")
    ours = glob.glob(os.path.join(REPO, "simllm_ros", "**", "*.py"), recursive=True)
    read = [line for line in listed.stdout.splitlines() if line.endswith(".py")]
    assert len(read) == len(ours), f"ruff does not read every module:\n{listed.stdout}"


def test_ruff_fails_on_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\n\ndef f(x):\n    return y" + " " * 120 + "\n")
    r = _ruff(str(bad))
    assert r.returncode == 1, r.stdout + r.stderr
    for code in ("F401", "F821", "E501", "W291"):
        assert code in r.stdout, f"ruff did not report {code}:\n{r.stdout}"


def test_mypy_is_clean():
    r = _mypy()  # the files mypy.ini names
    assert r.returncode == 0, f"mypy found problems (mypy.ini):\n{r.stdout}{r.stderr}"
    checked = int(re.search(r"in (\d+) source files", r.stdout).group(1))
    assert checked >= len(glob.glob(os.path.join(REPO, "simllm_ros", "cache", "*.py"))), r.stdout


def test_mypy_fails_on_a_violation(tmp_path):
    bad = tmp_path / "bad_types.py"
    bad.write_text("def half(n: int) -> int:\n    return n / 2\n")
    r = _mypy(str(bad))
    assert r.returncode == 1 and "bad_types.py:2: error" in r.stdout, r.stdout + r.stderr
