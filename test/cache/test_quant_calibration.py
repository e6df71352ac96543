"""enable_quant_calibration: key ranges fitted on the warm-up set, measured against per-block ranges."""
import json
import os

import torch

from simllm_ros.cache import kv_quant
from simllm_ros.serving.engine import Engine
from simllm_ros.request import CacheResult, QueryRequest
from simllm_ros.settings import Settings

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(REPO, "config", "demo_workload.jsonl")


def test_calibration_is_fitted_on_warmup_and_error_is_reported(tmp_path):
    reqs = [json.loads(line) for line in open(DEMO)]
    warm = tmp_path / "warm.jsonl"
    warm.write_text("".join(json.dumps({**r, "max_new_tokens": 2}) + "\n" for r in reqs[:4]))
    e = Engine(Settings.from_overrides(cache_size="64MB", dtype="float32", kv_bits=8,
                                       enable_quant_calibration=True, warmup_queries=str(warm)))
    e.load()
    try:
        lo, hi = e.pool.key_calibration
        shape = e.backend.kv_shape
        assert lo.shape == hi.shape == (shape.layers, shape.kv_heads, 1, shape.head_dim)
        assert torch.all(hi >= lo)
        assert e.load_report["warmup"] == 4 and len(e.pool) >= 1
        # Held-out prompt: error of calibrated vs per-block key ranges, block by block.
        r = reqs[8]
        ids = e.backend.prompt_ids(e.settings.system_prompt, r["context"], r["prompt"])
        k, _ = e.backend.cache_tensors(e.backend.prefill(ids)[1])
        errs = {"per_block": [], "calibrated": []}
        for s in range(0, k.shape[2], 16):
            kb = k[:, :, s:s + 16]
            for name, cal in (("per_block", None), ("calibrated", (lo, hi))):
                q, sc, z = kv_quant.quantize_keys(kb, cal)
                errs[name].append(kv_quant.error_report(kb, kv_quant.dequantize(q, sc, z, torch.float32))["relative"])
        mean = {n: sum(v) / len(v) for n, v in errs.items()}
        print(f"\nkey relative error, held-out prompt: per-block {mean['per_block']:.5f}, "
              f"calibrated {mean['calibrated']:.5f}")
        assert mean["per_block"] < 0.01 and mean["calibrated"] < 0.01
        # Requests still work with calibrated storage and hit the warmed pool.
        res = e.handle(QueryRequest(prompt=r["prompt"], context=reqs[0]["context"], cache_scope=reqs[0]["scope"],
                                    max_new_tokens=4))
        assert res.success and res.cache_result != CacheResult.MISS and res.reused_tokens > 0
    finally:
        e.unload()
