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
