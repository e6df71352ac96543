"""Helpers shared by the core (ROS-free) tests: real engines, a local bulletin, CLINC150 phrasings, metrics.

Loaded engines are cached per process (a model load costs seconds), so test modules share them;
every user starts from `fresh(engine, ...)`, which clears the pool and resets live settings.
"""
from __future__ import annotations

import collections
import contextlib
import json
import os

import torch

from simllm_ros.serving.engine import RELOAD_PARAMS, Engine
from simllm_ros.model.model_backend import auto_dtype, native_bf16
from simllm_ros.settings import Settings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from simllm_ros.workloads import find_clinc  # noqa: E402

CLINC_TRAIN = find_clinc()  # <repo>/../shared/data/clinc150 (CI), else the workplace copy

# A local bulletin a delivery robot might be handed as context (a few hundred tokens).
BULLETIN = """Riverside district bulletin, Tuesday 14 May.
Roads: Elm Street is closed between 3rd Avenue and Mill Road from 09:00 to 17:00 for water main repairs; use Oak Avenue instead. The Harbour Bridge has one lane open until 06:30 tomorrow. Traffic on Route 9 northbound is heavy, with delays of about 25 minutes near exit 14.
Weather: cloudy this morning with a high of 18 C, light rain expected after 15:00, wind from the west at 20 km/h.
Fuel: the Shell station on Mill Road sells regular at 1.62 per litre and diesel at 1.71; the station on Oak Avenue is closed for refurbishment until Friday.
Transit: bus line 12 runs every 15 minutes until 20:00, then every 40 minutes.
Services: the pharmacy on Oak Avenue opens at 08:30 and closes at 19:00. The post office at 22 King Street is open 09:00-12:30 today only.
"""

# The same bulletin revised in a few places (numbers and times), as a later edition would be.
BULLETIN_REVISED = (BULLETIN
                    .replace("from 09:00 to 17:00 for water main", "from 10:00 to 18:30 for water main")
                    .replace("delays of about 25 minutes", "delays of about 40 minutes")
                    .replace("high of 18 C", "high of 21 C")
                    .replace("regular at 1.62 per litre", "regular at 1.58 per litre")
                    .replace("runs every 15 minutes", "runs every 12 minutes"))
assert BULLETIN_REVISED.count("\n") == BULLETIN.count("\n") and BULLETIN_REVISED != BULLETIN

# Intents whose questions a street robot with this bulletin plausibly gets.
ROBOT_INTENTS = ("weather", "traffic", "directions", "gas", "gas_type", "distance", "time", "date",
                 "uber", "current_location", "timer", "how_busy", "restaurant_suggestion", "next_holiday",
                 "calendar", "reminder", "alarm", "tire_pressure", "oil_change_when", "meeting_schedule",
                 "travel_suggestion", "car_rental", "flight_status", "timezone", "jump_start")

# SIMLLM_TEST_DEVICE=cuda runs the core tests on a GPU (scripts/gpu_check.sh); the default is the CPU.
BASE = dict(cache_size="768MB", dtype="float32", kv_bits=32, device=os.environ.get("SIMLLM_TEST_DEVICE", "cpu"),
            approx_error_bound=1.0)
# This CPU's lossless default configuration, which the identity tests check: what dtype auto picks for the
# embedded 4-bit model (bf16 where our AMX kernels run, else float32 on the vector kernel: then the same settings
# as BASE, one engine).
NATIVE_BF16 = native_bf16()
LOSSLESS = dict(dtype="bfloat16", kv_bits=0) if auto_dtype("cpu")[0] == "bfloat16" else dict(dtype="float32", kv_bits=32)


def clinc_by_intent(limit_per_intent: int | None = None) -> dict[str, list[str]]:
    out: dict[str, list[str]] = collections.defaultdict(list)
    with open(CLINC_TRAIN, encoding="utf-8") as f:
        for line in f:
            d = json.loads(line)
            lst = out[d["intent"]]
            if limit_per_intent is None or len(lst) < limit_per_intent:
                lst.append(d["text"])
    return dict(out)


_ENGINES: dict[tuple, Engine] = {}


def shared_engine(**overrides) -> Engine:
    """A loaded engine for these (reload-time) settings, loaded once per process."""
    key = tuple(sorted({**BASE, **overrides}.items()))
    e = _ENGINES.get(key)
    if e is None or not e.loaded:
        e = Engine(Settings.from_overrides(**dict(key)))
        e.load()
        _ENGINES[key] = e
    return e


def fresh(engine: Engine, **live) -> Engine:
    """Empty pool and default live settings (plus `live`): a test starts from a known state. The approximate
    tiers run on their fixed thresholds (approx_error_bound 1: no bound asked) unless a test asks for one;
    the bound itself is tested in test_error_bound.py."""
    live.setdefault("approx_error_bound", 1.0)
    base = engine.settings.as_dict()
    defaults = Settings.from_overrides(**{k: base[k] for k in RELOAD_PARAMS})
    engine.update_settings(defaults.replace(**live))
    engine.clear_pool()
    engine.pool.check_consistency()
    return engine


def shared_backend():
    """The float32 model backend of the shared float32 engine."""
    return shared_engine().backend


@contextlib.contextmanager
def capture_generations(engine: Engine):
    """Records every Generation the engine's backend.decode returns (a spy: decode itself runs unchanged)."""
    got = []
    backend = engine.backend
    original = backend.decode

    def spy(*a, **kw):
        g = original(*a, **kw)
        got.append(g)
        return g

    backend.decode = spy
    try:
        yield got
    finally:
        del backend.decode  # back to the class method


def kl_div(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(p_ref || p) of two next-token distributions, in nats."""
    lp = torch.log_softmax(ref_logits.double(), -1)
    lq = torch.log_softmax(logits.double(), -1)
    return float((lp.exp() * (lp - lq)).sum())


def agreement(ref: list[int], got: list[int], n: int) -> tuple[float, float]:
    """(share of the first n positions equal before the first divergence, share equal position by position)."""
    a, b = list(ref[:n]), list(got[:n])
    width = max(len(a), len(b), 1)
    prefix = 0
    for x, y in zip(a, b):
        if x != y:
            break
        prefix += 1
    if len(a) == len(b) == prefix:
        prefix = width
    overall = sum(x == y for x, y in zip(a, b)) / width
    return prefix / width, overall


def python_in_new_process(code: str, env: dict | None = None, timeout: float = 300) -> list[str]:
    """The stdout lines of `code` run by this Python in a new process (this checkout's simllm_ros, `env` added):
    what a fresh process imports, loads or builds, apart from what this test process already holds."""
    import subprocess
    import sys

    full = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__))), **(env or {})}
    out = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().split("\n")


def kernel_in_new_process(module: str, env: dict | None = None) -> tuple[bool, str, str]:
    """(not loaded, why not, library path) of `simllm_ros.kernels.<module>.load()` in a new Python process with `env`
    added: a kernel switched off by its environment variable, or the library built once per machine."""
    code = (f"from simllm_ros.kernels import {module} as k; kern = k.load(); "
            "print(kern is None, '|', k.why_not(), '|', kern.path if kern else '')")
    off, why, path = (x.strip() for x in "\n".join(python_in_new_process(code, env, timeout=120)).split("|"))
    return off == "True", why, path


def semantic_tier_is_reported(engine: Engine, min_reused: int) -> None:
    """A paraphrased question over an edited context (words inserted: the later tokens move) takes the SEMANTIC
    tier when the caller allows approximate reuse, reported `exact: false` with more than `min_reused` tokens reused
    and some recomputed; without that permission the same request is lossless; the pool stays consistent."""
    from simllm_ros.request import CacheResult, QueryRequest

    ctx = ("Robot R2 is in the east wing. The charging dock is in room 12. Corridor B is closed for cleaning "
           "until noon. The lift on level 3 is out of service; use the stairs by the kitchen. Deliveries arrive "
           "at the north gate at nine and at four.")
    edited = ctx.replace("The charging dock", "Since Monday, the new charging dock")
    first = engine.handle(QueryRequest(prompt="Where is the charging dock?", context=ctx, max_new_tokens=8))
    assert first.success and first.cache_result == CacheResult.MISS and first.exact
    ask = lambda approx: QueryRequest(prompt="Where can I find the charging dock?", context=edited,  # noqa: E731
                                      max_new_tokens=8, allow_approximate=approx)
    r = engine.handle(ask(True))
    assert r.success and r.cache_result == CacheResult.SEMANTIC, r
    assert not r.exact and r.reused_tokens > min_reused and r.recomputed_tokens > 0, r
    engine.pool.check_consistency()
    lossless = engine.handle(ask(False))
    assert lossless.success and lossless.exact and lossless.cache_result != CacheResult.SEMANTIC
