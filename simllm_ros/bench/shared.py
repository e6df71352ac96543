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
import sys
import time

import numpy as np


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
    test_semantic_quality): the files, bulletins and pairs the tests use."""
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
"""


class SimSystem:
    """simllm_ros on the embedded model (512 MB pool) asked about BULLETIN in one scope."""

    def __init__(self, name: str, device: str = "cpu", **overrides):
        from simllm_ros.serving.engine import Engine
        from simllm_ros.settings import Settings

        self.name = name
        self.engine = Engine(Settings.from_overrides(cache_size="512MB", device=device, **overrides))
        self.engine.load(progress=lambda m: None)
        self.ref: dict[str, str] = {}
        self.miss: list[float] = []  # the references' totals: a cold request (empty pool, no drafts)

    def reference(self, q: str, max_new: int) -> str:
        """The answer from an empty pool without drafts: what the cache must not change."""
        from simllm_ros.request import QueryRequest

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
        from simllm_ros.request import QueryRequest

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
        self.ref[q], _ = r["answer"], self.miss.append(r["total"])
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
    from simllm_ros.cache.matcher import Matcher

    m = Matcher(fps.shape[1], index_rows=index_rows)
    m.load_scope("s", fps, last_used)
    return m


def exact_best(fps, last_used, q) -> int:
    return int(np.argmax(fps @ q - RECENCY * (1.0 - np.exp2(-(NOW - last_used) / HALF_LIFE))))


def matcher_scaling(sizes, dim: int = 384, queries: int = 20) -> list[dict]:
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

        def lookups():
            times, best = [], []
            for q in qs:
                t0 = time.perf_counter()
                top = m.best(q, "s", NOW, k=4, recency_weight=RECENCY, half_life_s=HALF_LIFE)
                times.append((time.perf_counter() - t0) * 1000)
                best.append(top[0][0])
            return statistics.median(times), best

        m.best(qs[0], "s", NOW, k=4)  # warm: the int8 copy is made once
        scan_ms, scan_best = lookups()
        t0 = time.perf_counter()
        m.build_index("s")
        m.wait_for_index()
        build_s = time.perf_counter() - t0
        state = m.index_state("s")
        assert state["built"], "the index was not built"
        index_ms, index_best = lookups()
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
    from simllm_ros.cache.matcher import INDEX_ROWS

    lines = ["Matcher (best 4 of N clustered fingerprints, 384-d, one scope, recency on; scan = int8 prefilter + "
             f"exact ranking, index = coarse index, the default above {INDEX_ROWS:,} rows):", "",
             "| N | scan | index | index ratio | index best = exact best | index build | lookup after an add | the add |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['n']:,} | {r['scan_ms']:.2f} ms | {r['index_ms']:.2f} ms | {r['index_ms'] / r['scan_ms']:.2f}x "
                     f"| {r['same_best']}/{r['queries']} | {r['build_s']:.1f} s ({r['lists']} lists) "
                     f"| {r['after_add_ms']:.2f} ms | {r['add_ms']:.2f} ms |")
    if real:
        lines += ["", f"Index recall on real fingerprints (MiniLM, CLINC150: {real['rows']:,} training sentences, "
                  f"{real['queries']} validation queries, {real['lists']} lists, index forced on): best differs from the "
                  f"exact best for {real['misses']}/{real['queries']} queries, {real['misses_at_threshold']}/"
                  f"{real['queries_at_threshold']} among queries whose best cosine is >= {real['threshold']} "
                  f"(cache_threshold); best cosines of the misses: {real['miss_best_cosines']}."]
        d = real["drift"]
        lines += ["", f"Drift (the index trained on 100 intents, the other 50 added after it): best differs for "
                  f"{d['misses']}/{d['queries']} queries on the new intents, {d['misses_at_threshold']}/"
                  f"{d['queries_at_threshold']} at cosine >= {real['threshold']}; misses' best cosines: "
                  f"{d['miss_best_cosines']} (measured one row before the scope has grown by half, when a new index is trained)."]
    return lines


