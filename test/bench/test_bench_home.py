"""One benchmark home: every benchmark is a module of simllm_ros/bench run as `simllm-bench <name>`, and none
reaches into simllm_ros's private fields."""
import ast
import os
import subprocess
import sys

from simllm_ros.cli.bench import BENCHMARKS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "simllm_ros", "bench")
LIBRARY = {"__init__", "metrics", "report", "runner", "shared", "systems"}  # simllm-bench's own run and helpers


def _modules() -> dict[str, ast.Module]:
    return {f[:-3]: ast.parse(open(os.path.join(BENCH, f), encoding="utf-8").read())
            for f in sorted(os.listdir(BENCH)) if f.endswith(".py")}


def test_every_benchmark_module_is_a_subcommand_with_a_main():
    mods = _modules()
    assert set(BENCHMARKS) == set(mods) - LIBRARY
    for name in BENCHMARKS:
        assert any(isinstance(n, ast.FunctionDef) and n.name == "main" and n.args.args for n in mods[name].body), name


def test_no_benchmark_imports_another_or_a_private_name():
    for name, tree in _modules().items():
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and n.level == 1 and name not in LIBRARY:
                assert n.module in LIBRARY, f"{name} imports .{n.module}: share it through shared.py"
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("simllm_ros"):
                assert not [a.name for a in n.names if a.name.startswith("_")], (name, n.module)


def test_a_benchmark_runs_through_the_dispatcher():
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    run = lambda *a: subprocess.run([sys.executable, "-m", "simllm_ros.cli.bench", *a], cwd=ROOT, env=env,  # noqa: E731
                                    capture_output=True, text=True, timeout=300)
    listed = run("--list")
    assert listed.returncode == 0 and [line.split()[0] for line in listed.stdout.splitlines()] == list(BENCHMARKS)
    p = run("matcher", "--sizes", "2000", "--queries", "0")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "| 2,000 |" in p.stdout and "20/20" in p.stdout, p.stdout  # the index's best is the exact best
    assert run("no-such-benchmark").returncode != 0
