"""The aarch64 comparison's logic (scripts/engine_probe.py compare) on a recorded x86 run of scripts/aarch64_engine.py:
a record equals itself, and a difference planted in one tensor at one position, or in one request's tokens and pass,
is reported by that tensor, position, request and step. The emulated run itself takes many minutes and is not part
of the suite (scripts/aarch64_engine.py --short)."""
from __future__ import annotations

import copy
import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECORDS = os.path.join(ROOT, "benchmark", "results", "aarch64_engine")


def _probe():
    spec = importlib.util.spec_from_file_location("engine_probe", os.path.join(ROOT, "scripts", "engine_probe.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _record(name):
    path = os.path.join(RECORDS, name)
    if not os.path.isfile(path):
        pytest.fail(f"{path} is missing: scripts/aarch64_engine.py writes it")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def test_a_planted_difference_is_reported_by_tensor_position_request_and_step():
    compare = _probe().compare
    base = _record("x86-q4_k_m.json")
    assert base["machine"] == "x86_64" and compare(base, base) == []
    other = copy.deepcopy(base)
    t = other["digest_pass"]["tensors"]
    t["layer1.v"][7] = "0" * 16
    t["layer0.k"][5] = "0" * 16
    t["logits"][5] = "0" * 16
    other["numerics"] = "f" * 16
    req = other["requests"][2]
    req["tokens"][3] += 1
    req["passes"][1]["logits"][0] = "0" * 16
    diffs = compare(base, other)
    assert diffs[0] == f"numerics digest: {base['numerics']} != {'f' * 16}"
    # the earliest layer first (where a difference starts), the logits last
    assert diffs[1:4] == ["digest pass: tensor layer0.k differs at positions [5]",
                          "digest pass: tensor layer1.v differs at positions [7]",
                          "digest pass: tensor logits differs at positions [5]"]
    name = req["name"]
    assert any(d.startswith(f"request {name}: token ids differ from step 3:") for d in diffs), diffs
    assert f"request {name}: pass 1 ({len(req['passes'][1]['ids'])} rows): logits differ from row 0" in diffs
    assert len(diffs) == 6, diffs


def test_the_committed_comparison_still_describes_this_checkout(tmp_path):
    """The short form that fits the suite (the emulated run takes many minutes and a root file system): the x86
    half of the committed comparison run again on this checkout. Its numerics (the digest and every tensor of the
    digest pass) must equal the committed record's, else the aarch64 record no longer speaks for these kernels and
    `scripts/aarch64_engine.py --short` must be run again. The requests are compared too and reported, not failed
    on: a change of the draft policy changes their passes without touching the numerics."""
    import subprocess
    import sys

    sys.path.insert(0, os.path.join(ROOT, "test"))
    from random_gguf import Q4_K_M, write_llama

    model = write_llama(str(tmp_path / "rand-q4_k_m.gguf"), types=Q4_K_M, per_layer={(1, "attn_v"): "Q4_K"})
    out = tmp_path / "x86.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "engine_probe.py"), "run", "--model", model,
                           "--out", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    with open(out, encoding="utf-8") as f:
        now = json.load(f)
    committed = _record("x86-q4_k_m.json")
    diffs = _probe().compare(committed, now)
    numerics = [d for d in diffs if d.startswith(("numerics digest", "digest pass"))]
    assert not numerics, ("the numerics changed since the aarch64 comparison was committed: run "
                          f"scripts/aarch64_engine.py --short again; {numerics}")
    if diffs:
        print("requests differ from the committed x86 record (rerun scripts/aarch64_engine.py --short):", diffs)
