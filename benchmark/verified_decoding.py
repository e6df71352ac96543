"""The whole answer on a cache hit: simllm_ros against llama.cpp on the same GGUF, side by side.

Workload: a ~560-token prompt (system prompt + a local bulletin + a question), real CLINC150
questions, 32-token answers, greedy. For each question, in this order, interleaved across systems:
  hit    - a new question on a context the system has already seen (the context is cached)
  repeat - the same question again (for simllm_ros: its stored answer becomes a verified draft)
  miss   - (each system's references, run first) the question alone on an empty pool, no drafts
Systems: simllm_ros at its defaults (dtype auto: bf16 where our AMX kernels run, else float32; weight_bits auto:
the file's own 4-bit weights; lossless KV, verified drafts), the same without drafts, with 16-bit weights
(weight_bits=16), where the default is bf16 with int8 weights (weight_bits=8) and in float32, and where float32
was chosen over a native bf16 (AVX512_BF16 without AMX) in bf16 (4- and 8-bit weights); llama.cpp (llama-cpp-python, same
GGUF file, its prompt cache), if installed. Every simllm_ros configuration is also run with an empty pool and
no drafts, and its cached answers are compared with those (identical-answer share).

Also measured: the exact-hit overhead over the model's own limit (prefilling only the uncached
tokens into a KV buffer that already holds the prefix) at 250 / 500 / 1000-token contexts, and the
matcher at 10k / 100k / 1M fingerprints (benchmark/matcher.py's scan against index).

Run: .venv/bin/python benchmark/verified_decoding.py [--threads 1] [--questions 8] [--smoke]
Writes benchmark/results/verified_decoding.md (and prints it).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from simllm_ros.engine import Engine  # noqa: E402
from simllm_ros.model_backend import native_bf16  # noqa: E402
from simllm_ros.request import QueryRequest  # noqa: E402
from simllm_ros.settings import Settings  # noqa: E402
from simllm_ros.workloads import find_clinc  # noqa: E402

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
INTENTS = ("weather", "traffic", "directions", "gas", "distance", "uber", "restaurant_suggestion", "how_busy",
           "timer", "current_location", "calendar", "travel_suggestion")


def questions(n: int) -> list[str]:
    import json

    by = {}
    with open(find_clinc(), encoding="utf-8") as f:
        for line in f:
            d = json.loads(line)
            if d["intent"] in INTENTS and d["intent"] not in by:
                by[d["intent"]] = d["text"]
    return [by[i] for i in INTENTS if i in by][:n]


DEVICE = "cpu"  # --device: scripts/gpu_check.sh runs the smoke on cuda


class SimSystem:
    def __init__(self, name: str, **overrides):
        self.name = name
        self.engine = Engine(Settings.from_overrides(cache_size="512MB", device=DEVICE, **overrides))
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


def ms_per_token(rows) -> float:
    vals = [(r["total"] - r["ttft"]) / (r["n"] - 1) for r in rows if r["n"] > 1]
    return statistics.median(vals) if vals else float("nan")


def med(rows, key) -> float:
    return statistics.median(r[key] for r in rows) if rows else float("nan")


OVERHEAD_QUESTIONS = ("is it going to rain today", "where can I park my car", "when does the pharmacy open",
                      "how late does bus 12 run", "is the harbour bridge open")


def hit_overhead(engine: Engine, sizes=(250, 500, 1000), reps: int = 5,
                 allow_approximate: bool = False) -> list[tuple[int, float, float]]:
    """Exact-hit TTFT minus the model's own limit (prefilling only the new tokens on a KV buffer that
    already holds the cached prefix), per context size. allow_approximate False is the ROS default: the plan
    does not wait for the fingerprint; True: it does (SEMANTIC and ANSWER need it)."""
    b, out = engine.backend, []
    words = (BULLETIN * 4).split()
    for size in sizes:
        ctx = " ".join(words[:int(size * 0.7)])
        engine.clear_pool()
        engine.settings = engine.settings.replace(max_prompt_tokens=4096, enable_drafts=False)
        engine.handle(QueryRequest(prompt="hello there", context=ctx, cache_scope="o", max_new_tokens=1))
        hits, limits = [], []
        for rep in range(reps):
            # A question not asked before in this process: its fingerprint is computed, not remembered.
            q = f"{OVERHEAD_QUESTIONS[rep % len(OVERHEAD_QUESTIONS)]} ({size} words, {rep}, {allow_approximate})"
            r = engine.handle(QueryRequest(prompt=q, context=ctx, cache_scope="o", max_new_tokens=1,
                                           allow_approximate=allow_approximate))
            engine.clear_pool()
            engine.handle(QueryRequest(prompt="hello there", context=ctx, cache_scope="o", max_new_tokens=1))
            hits.append(r.ttft_ms)
            ids = b.prompt_ids(engine.settings.system_prompt, ctx, q)
            n = r.reused_tokens  # 0 where nothing could be reused exactly: the limit is then a whole prefill
            logits, cache = b.prefill(ids[:n], reserve=len(ids)) if n else (None, b.new_cache(len(ids) + 2))
            t0 = time.perf_counter()
            logits, _ = b.prefill(ids[n:], cache)
            int(torch.argmax(logits))
            limits.append((time.perf_counter() - t0) * 1000)
        out.append((len(b.prompt_ids(engine.settings.system_prompt, ctx, q)), statistics.median(hits),
                    statistics.median(limits)))
    engine.settings = engine.settings.replace(max_prompt_tokens=1024, enable_drafts=True)
    engine.clear_pool()
    return out


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--smoke", action="store_true", help="two questions, 8 tokens, defaults only, no peers")
    ap.add_argument("--device", default="cpu", help="the model's device (cuda: scripts/gpu_check.sh)")
    ap.add_argument("--out", default=os.path.join(REPO, "benchmark", "results", "verified_decoding.md"))
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    torch.set_num_threads(args.threads)
    nq, max_new = (2, 8) if args.smoke else (args.questions, args.max_new_tokens)
    qs = questions(nq)
    t_start = time.monotonic()
    systems = [SimSystem("simllm_ros defaults")]
    b = systems[0].engine.backend
    systems[0].name = f"simllm_ros defaults ({b.dtype_name}, {b.weight_bits}-bit weights, drafts)"
    if not args.smoke:
        systems += [SimSystem("simllm_ros, drafts off", enable_drafts=False),
                    SimSystem("simllm_ros, 16-bit weights", weight_bits=16)]
        if b.dtype_name != "float32":  # a bf16 default; on a CPU without native bf16 the default is float32 already,
            # and int8 weights need bf16
            systems += [SimSystem("simllm_ros, int8 weights", weight_bits=8), SimSystem("simllm_ros, float32", dtype="float32")]
        elif native_bf16():  # float32 chosen over a native bf16 (no AMX): show what bf16 would give here
            systems += [SimSystem("simllm_ros, bfloat16", dtype="bfloat16", kv_bits=0),
                        SimSystem("simllm_ros, bfloat16, int8 weights", dtype="bfloat16", kv_bits=0, weight_bits=8)]
        try:
            systems.append(LlamaCpp(systems[0].engine.backend, systems[0].engine.settings.system_prompt,
                                    args.threads))
        except ImportError as e:
            print(f"llama.cpp column skipped ({e}); pip install -r requirements-bench.txt")
    for s in systems:
        for q in qs:
            s.reference(q, max_new)
    rows = {s.name: {"hit": [], "repeat": []} for s in systems}
    warm = "what is happening in town today"
    for s in systems:
        s.ask(warm, max_new)  # the context is now cached (simllm pool / llama.cpp prompt cache and live KV)
    for q in qs:
        for kind in ("hit", "repeat"):
            for s in systems:
                r = s.ask(q, max_new)
                r["same"] = r["answer"] == s.ref[q]
                rows[s.name][kind].append(r)
    lines = [f"# Verified decoding: whole answers on cache hits ({time.strftime('%Y-%m-%d')})", "",
             f"{len(qs)} CLINC150 questions on a {rows[systems[0].name]['hit'][0]['prompt']}-token prompt, "
             f"up to {max_new} new tokens, greedy, {args.threads} thread(s), interleaved request by request; "
             f"medians. Machine: {os.cpu_count()} cores, shared, so compare within a row set, not across runs.", "",
             "| system | hit TTFT | hit total | repeat total | miss total | decode ms/token (hit) "
             "| tokens per pass (hit / repeat) | identical to its own no-cache answer |",
             "|---|---|---|---|---|---|---|---|"]
    for s in systems:
        h, rp = rows[s.name]["hit"], rows[s.name]["repeat"]
        tpp = lambda rr: sum(r["n"] for r in rr) / max(1, sum(max(r["passes"], 1) for r in rr))  # noqa: E731
        same = sum(r["same"] for r in h + rp)
        lines.append(f"| {s.name} | {med(h, 'ttft'):.0f} ms | {med(h, 'total'):.0f} ms | {med(rp, 'total'):.0f} ms "
                     f"| {statistics.median(s.miss):.0f} ms | {ms_per_token(h):.1f} | {tpp(h):.2f} / {tpp(rp):.2f} | {same}/{len(h + rp)} |")
    if any(isinstance(s, LlamaCpp) for s in systems):
        base = rows[systems[-1].name]
        lines += ["", "Ratios to llama.cpp (lower is better):", ""]
        for s in systems[:-1]:
            h, rp = rows[s.name]["hit"], rows[s.name]["repeat"]
            lines.append(f"- {s.name}: hit total {med(h, 'total') / med(base['hit'], 'total'):.2f}x, repeat total "
                         f"{med(rp, 'total') / med(base['repeat'], 'total'):.2f}x, decode ms/token "
                         f"{ms_per_token(h) / ms_per_token(base['hit']):.2f}x, miss total "
                         f"{statistics.median(s.miss) / statistics.median(systems[-1].miss):.2f}x")
    sims = [s for s in systems if isinstance(s, SimSystem)]
    sixteen = next((s for s in sims if s.engine.backend.weight_bits == 16 and s.engine.backend.dtype_name != "float32"),
                   None)
    others = [s for s in sims if s.engine.backend.weight_bits != 16]
    if sixteen is not None and others:
        lines += ["", f"Answers with other weights against {sixteen.name}'s (no-cache answers, same questions): a "
                  "different arithmetic, not a cache effect (benchmark/fidelity.py compares each with float32):", ""]
        for s in others:
            same16 = sum(s.ref[q] == sixteen.ref[q] for q in qs)
            lines.append(f"- {s.name}: {same16}/{len(qs)} identical")
    e = systems[0].engine
    d = rows[systems[0].name]
    acc = sum(r["accepted"] for r in d["hit"] + d["repeat"])
    prop = sum(r["proposed"] for r in d["hit"] + d["repeat"])
    lines += ["", f"Defaults: {acc}/{prop} draft tokens accepted; every answer reported exact: "
              f"{all(r['exact'] for r in d['hit'] + d['repeat'])}; backend batch-invariant: {e.backend.exact_chunking}."]
    if not args.smoke:
        lines += ["", "Exact-hit overhead over the model's limit (defaults, drafts off, 1 new token, a new question each "
                  "time):", "", "| caller | prompt tokens | hit TTFT | limit (prefill of the new tokens only) | overhead |",
                  "|---|---|---|---|---|"]
        for approx in (False, True):
            who = "approximate allowed (plan waits for the fingerprint)" if approx else "lossless only (ROS default)"
            for n, hit, limit in hit_overhead(e, allow_approximate=approx):
                lines.append(f"| {who} | {n} | {hit:.1f} ms | {limit:.1f} ms | {hit - limit:.1f} ms |")
        from matcher import report as matcher_report, scaling as matcher_scaling  # benchmark/matcher.py

        lines += [""] + matcher_report(matcher_scaling((10_000, 100_000, 1_000_000)), None)
        lines += ["", "(The index's recall on real fingerprints: benchmark/matcher.py.)"]
    finish_report(lines, t_start, None if args.smoke else args.out)


if __name__ == "__main__":
    main()
