"""Robot commands becoming tool calls: validity, the cache against no cache, calls reused by meaning under the error
bound, and llama.cpp's grammar-constrained output on the same GGUF, side by side.

The workload is written here (seeded, deterministic): ~20 intents over a robot's tools (NavigateTo goals with a
place, a speed and a zone to avoid; SetBool and Trigger services), each phrased several ways, their slots filled
from small sets, commands repeated as people repeat them, and slot-swap traps: a command asked again with one slot
changed ("at 0.5 m/s" -> "at 5 m/s", "avoiding zone 2" -> "zone 3", kitchen -> door), whose call must differ.
Per model (the embedded one; a GGUF with --model):
  no cache        the engine with an empty pool for every command: the reference call of each command
  cache, exact    approx_error_bound 0: every command through the pool and the exact memo (calls equal to no cache?)
  bound δ         δ in --deltas: paraphrases may be served a verified neighbour's call (serving/tool_call_reuse);
                  served, and wrong (not the reference call), per δ; δ 1: the fixed answer_threshold alone
  llama.cpp       llama_cpp.LlamaGrammar from the same JSON schema, the same prompt token ids, greedy, no prompt
                  cache (each text run once; a repeat counts that run's time)
Each configuration starts with an empty pool and no labels. Both sides answer in the generic format (the same JSON
schema for xgrammar and LlamaGrammar), whatever format the model's chat template has.

Usage: simllm-bench tool_calls [--model PATH.gguf] [--commands 300] [--intents 20] [--deltas 0.02,0.05,0.1,1]
                               [--no-llama]"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import random
import statistics
import time
from typing import Any

from simllm_ros.cache.error_bound import ErrorBound
from simllm_ros.request import CacheResult, QueryRequest
from simllm_ros.safe_io import write_json
from simllm_ros.serving.tool_output_formats import constrained_request
from simllm_ros.serving.tool_schemas import ToolError
from simllm_ros.serving.toolbox import Toolbox
from simllm_ros.settings import Settings
from .shared import RESULTS_DIR, offline

offline()

PLACES = ("dock", "kitchen", "door")
SPEEDS = (0.2, 0.5, 1, 2, 5)
ZONES = (1, 2, 3, 4, 7)
PROGRESS_EVERY = 20
NAV_FIXED = {"target": [0.0, 0.0], "note": ""}

TOOLS: list[dict[str, Any]] = [
    {"name": "navigate_to", "description": "Drive to a named place (dock, kitchen, door) at a speed in m/s.",
     "action": "/navigate_to", "type": "simllm_ros/action/NavigateTo",
     "fields": {"speed": {"minimum": 0.1, "maximum": 5.0}, "avoid_zones": {"maximum": 9, "max_items": 1}},
     "fixed": NAV_FIXED},
    *({"name": n, "description": d, "service": f"/{n}", "type": "std_srvs/srv/SetBool"} for n, d in (
        ("set_brake", "Engage (true) or release (false) the parking brake."),
        ("set_lights", "Switch the headlights on (true) or off (false)."),
        ("set_vacuum", "Switch the vacuum pump on (true) or off (false)."))),
    *({"name": n, "description": d, "service": f"/{n}", "type": "std_srvs/srv/Trigger"} for n, d in (
        ("stop_motors", "Stop all motors now."), ("take_photo", "Take a photo with the front camera."),
        ("start_mapping", "Start building a map."), ("save_map", "Save the current map."),
        ("open_gripper", "Open the gripper."), ("close_gripper", "Close the gripper."),
        ("beep", "Sound the horn once."), ("report_battery", "Report the battery level."))),
]

# intent -> (tool, the arguments' slots, phrasings); {place}, {speed}, {zone} are the slots
INTENTS = {
    "go_place": ("navigate_to", ("place", "speed"), (
        "Go to the {place} at {speed} m/s.", "Drive to the {place} at {speed} m/s.",
        "Head over to the {place} please, {speed} m/s.", "Please navigate to the {place} at {speed} m/s.",
        "Move to the {place}, speed {speed} m/s.")),
    "go_place_avoid": ("navigate_to", ("place", "speed", "zone"), (
        "Go to the {place} at {speed} m/s avoiding zone {zone}.",
        "Drive to the {place} at {speed} m/s and keep out of zone {zone}.",
        "Head to the {place}, {speed} m/s, stay out of zone {zone}.")),
    "brake_on": ("set_brake", (), ("Engage the parking brake.", "Put the parking brake on.", "Apply the brake.")),
    "brake_off": ("set_brake", (), ("Release the parking brake.", "Take the parking brake off.",
                                    "Disengage the brake please.")),
    "lights_on": ("set_lights", (), ("Turn the headlights on.", "Switch on the lights.", "Lights on please.")),
    "lights_off": ("set_lights", (), ("Turn the headlights off.", "Switch off the lights.", "Lights off please.")),
    "vacuum_on": ("set_vacuum", (), ("Start the vacuum pump.", "Turn the vacuum on.", "Switch on the suction.")),
    "vacuum_off": ("set_vacuum", (), ("Stop the vacuum pump.", "Turn the vacuum off.", "Switch off the suction.")),
    "stop": ("stop_motors", (), ("Stop all motors now.", "Emergency stop!", "Halt the motors immediately.",
                                 "Stop moving right now.")),
    "photo": ("take_photo", (), ("Take a photo.", "Snap a picture with the front camera.",
                                 "Capture an image please.")),
    "map_start": ("start_mapping", (), ("Start mapping.", "Begin building a map of this area.",
                                        "Start a new map.")),
    "map_save": ("save_map", (), ("Save the map.", "Store the current map please.", "Keep this map.")),
    "grip_open": ("open_gripper", (), ("Open the gripper.", "Release the gripper jaws.", "Open your hand.")),
    "grip_close": ("close_gripper", (), ("Close the gripper.", "Grab it with the gripper.", "Close your hand.")),
    "beep": ("beep", (), ("Beep once.", "Sound the horn.", "Honk the horn please.")),
    "battery": ("report_battery", (), ("What is the battery level?", "Report the battery.",
                                       "How much charge is left?")),
    "go_dock": ("navigate_to", ("speed",), ("Go back to the charging dock at {speed} m/s.",
                                            "Return to the dock, {speed} m/s.",
                                            "Head home to the charger at {speed} m/s.")),
    "go_kitchen_slow": ("navigate_to", ("zone",), ("Go to the kitchen slowly avoiding zone {zone}.",
                                                   "Drive slowly to the kitchen, stay out of zone {zone}.",
                                                   "Crawl to the kitchen and avoid zone {zone}.")),
    "go_door_fast": ("navigate_to", ("zone",), ("Rush to the door avoiding zone {zone}.",
                                               "Go to the door quickly, keep out of zone {zone}.",
                                               "Hurry to the door, stay clear of zone {zone}.")),
    "stop_and_brake": ("set_brake", (), ("Stop and hold the brake.", "Hold position with the brake on.",
                                         "Park and engage the brake.")),
}


@dataclasses.dataclass(frozen=True)
class Command:
    text: str
    intent: str
    kind: str  # first | repeat | paraphrase | trap


def _fill(template: str, slots: dict) -> str:
    return template.format(**{k: (f"{v:g}" if isinstance(v, float) else v) for k, v in slots.items()})


def workload(n: int = 300, seed: int = 11, intents: int = 0) -> list[Command]:
    """A stream of n commands: for each intent and slot filling, a first phrasing, then (shuffled) repeats of it,
    paraphrases of the same slots, and traps (the same phrasing with one slot swapped). Deterministic per seed.
    intents: only the first this many of INTENTS (0: all)."""
    chosen = list(INTENTS.items())[:intents or None]
    rng = random.Random(seed)
    items: list[Command] = []
    seen: set[str] = set()

    def add(text, intent, kind):
        if kind != "repeat" and text in seen:
            return
        seen.add(text)
        items.append(Command(text, intent, kind))

    fills_per_intent = max(1, n * len(chosen) // (50 * len(INTENTS)))  # fillings of an intent with slots
    values = {"place": PLACES, "speed": SPEEDS, "zone": ZONES}
    for intent, (_tool, slots, phrasings) in chosen:
        every = [dict(zip(slots, combo)) for combo in itertools.product(*(values[k] for k in slots))]
        fills = rng.sample(every, min(fills_per_intent, len(every)))  # distinct: a trap is no other fill's command
        others = [f for f in every if f not in fills]
        for fill in fills:
            order = rng.sample(phrasings, len(phrasings))
            add(_fill(order[0], fill), intent, "first")
            for p in order[1:]:
                add(_fill(p, fill), intent, "paraphrase")
            add(_fill(order[0], fill), intent, "repeat")
            swaps = [f for f in others if sum(f[k] != fill[k] for k in slots) == 1]  # one slot changed
            for i, swapped in enumerate(rng.sample(swaps, min(2, len(swaps)))):
                add(_fill(order[i % len(order)], swapped), intent, "trap")
                add(_fill(order[(i + 1) % len(order)], swapped), intent, "trap")
    firsts = [c for c in items if c.kind == "first"]
    rest = [c for c in items if c.kind != "first"]
    rng.shuffle(rest)
    stream = firsts + rest  # every intent seen once before its paraphrases and traps come
    while len(stream) < n:  # people repeat commands
        stream.append(dataclasses.replace(rng.choice(stream), kind="repeat"))
    return stream[:n]


def _call_of(toolbox, plan, answer: str):
    """(name, arguments JSON) of a valid call, or None."""
    try:
        _, calls = toolbox.parse(plan, answer)
    except ToolError:
        return None
    return (calls[0].name, calls[0].arguments_json) if len(calls) == 1 else None


def run_engine(engine, toolbox, plan, stream: list[Command], delta: float, scope: str = "robot",
               no_cache: bool = False, max_new: int = 48, log=None) -> list[dict]:
    """Every command of the stream through the reuse and the engine (no_cache: an empty pool for each); log: every
    PROGRESS_EVERY commands, how many are done and their mean wall time (a long run says how far it got)."""
    # local: tool_call_reuse imports torch: loaded when a run starts (the tests of this module go without)
    from simllm_ros.serving.tool_call_reuse import CallReuse

    engine.clear_pool()
    reuse = CallReuse(engine, toolbox, bound=ErrorBound(seed=1))
    rows = []
    for c in stream:
        asked = QueryRequest(prompt=c.text, cache_scope=scope, max_new_tokens=max_new, allow_approximate=delta > 0,
                             approx_error_bound=delta)
        req = constrained_request(asked, plan)
        t0 = time.perf_counter()
        if no_cache:
            engine.clear_pool()
            r = engine.handle(req)
        else:
            r = reuse.answer(asked, req, plan, engine.handle)
        ms = (time.perf_counter() - t0) * 1000
        rows.append({"text": c.text, "kind": c.kind, "ms": ms, "success": r.success, "exact": r.exact,
                     "approx": r.cache_result == CacheResult.ANSWER and not r.exact,
                     "memo": r.exact and r.cache_result == CacheResult.EXACT_PREFIX and r.generated_tokens > 0
                     and r.reused_tokens == r.prompt_tokens,
                     "call": _call_of(toolbox, plan, r.answer) if r.success else None, "error": r.error})
        if log is not None and len(rows) % PROGRESS_EVERY == 0:
            log(f"  {len(rows)}/{len(stream)} commands, mean {statistics.mean(x['ms'] for x in rows):.0f} ms")
    rows.append({"labels": len(reuse.bound), "counts": dict(reuse.counts)})
    return rows


def run_llama(gguf: str, backend, system_prompt: str, plan, toolbox, stream: list[Command], threads: int,
              max_new: int = 48) -> tuple[list[dict], dict]:
    """llama.cpp with a grammar from the same JSON schema on the same prompt ids; greedy, no prompt cache."""
    # local: llama_cpp is optional (requirements-bench.txt): the llama.cpp rows only
    from llama_cpp import Llama, LlamaGrammar

    llm = Llama(model_path=gguf, n_ctx=2048, n_batch=512, n_threads=threads, n_threads_batch=threads, seed=0,
                verbose=False)
    t0 = time.perf_counter()
    grammar = LlamaGrammar.from_json_schema(plan.schema_text, verbose=False)
    info = {"grammar_ms": (time.perf_counter() - t0) * 1000}
    rows: list[dict] = []
    done: dict[str, dict] = {}
    for c in stream:  # a repeat gives the same output (no prompt cache here): run once per text
        if c.text in done:
            rows.append(dict(done[c.text], kind=c.kind))
            continue
        req = constrained_request(QueryRequest(prompt=c.text, cache_scope="robot"), plan)
        ids = backend.chat_ids(system_prompt, req.context, req.turns())
        llm.reset()
        t0 = time.perf_counter()
        out = llm.create_completion(prompt=ids, max_tokens=max_new, temperature=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                    repeat_penalty=1.0, grammar=grammar)
        ms = (time.perf_counter() - t0) * 1000
        text = out["choices"][0]["text"]
        done[c.text] = {"text": c.text, "kind": c.kind, "ms": ms, "call": _call_of(toolbox, plan, text),
                        "finish": out["choices"][0]["finish_reason"]}
        rows.append(done[c.text])
    return rows, info


def summarize(name: str, rows: list[dict], reference: dict[str, tuple | None]) -> dict:
    rows = [r for r in rows if "text" in r]
    n = len(rows)
    valid = sum(r["call"] is not None for r in rows)
    equal = sum(r["call"] == reference.get(r["text"]) for r in rows)
    approx = [r for r in rows if r.get("approx")]
    wrong = [r for r in approx if r["call"] != reference.get(r["text"])]
    ms = sorted(r["ms"] for r in rows)
    return {"config": name, "commands": n, "valid": valid, "equal_to_no_cache": equal, "approximate": len(approx),
            "approximate_wrong": len(wrong), "traps_served": sum(r["kind"] == "trap" for r in approx),
            "memo": sum(bool(r.get("memo")) for r in rows), "mean_ms": statistics.mean(ms) if ms else 0.0,
            "p50_ms": ms[n // 2] if ms else 0.0, "p95_ms": ms[int(0.95 * (n - 1))] if ms else 0.0}


def bench(engine, stream: list[Command], deltas: list[float], gguf: str | None, threads: int,
          max_new: int = 48, log=print, tools: list[str] | None = None, checkpoint=None,
          reference_file: str = "", llama_rows: str = "") -> dict:
    """Every configuration on one loaded engine (its settings changed live); llama.cpp where gguf is given.
    tools: the names offered (default all of TOOLS); checkpoint(report so far) after each configuration, so a run
    stopped early keeps the configurations it finished. reference_file: the no-cache rows kept there (JSON, by
    text) and reused by a later run of the same model, tools and max_new (each text's no-cache answer computed
    once); llama_rows: llama.cpp's rows written by a separate `--llama-only` run, summarized here instead of running
    llama.cpp in this process (the part of the stream it finished)."""
    toolbox = Toolbox.from_list(TOOLS)
    plan = toolbox.plan(tools or [t["name"] for t in TOOLS], "required")
    if plan is None:
        raise SystemExit("no tools to call")
    base = engine.settings
    out: dict = {"commands": len(stream), "kinds": {k: sum(c.kind == k for c in stream) for k in
                                                      ("first", "repeat", "paraphrase", "trap")},
                 "intents": len({c.intent for c in stream}), "tools": len(plan.tools), "rows": []}
    engine.update_settings(base.replace(approx_error_bound=0.0, temperature=0.0))
    unique = list(dict.fromkeys(c.text for c in stream))
    by_text = _reference_rows(engine, toolbox, plan, unique, max_new, log, reference_file)
    reference = {t: (tuple(r["call"]) if r["call"] else None) for t, r in by_text.items()}
    nocache = [dict(by_text[c.text], kind=c.kind) for c in stream]  # each command's no-cache run (one per text)
    out["rows"].append(summarize("no cache", nocache, reference))
    log(json.dumps(out["rows"][-1]))
    if checkpoint is not None:
        checkpoint(out)
    if llama_rows:
        with open(llama_rows, encoding="utf-8") as f:
            got = json.load(f)
        rows = [dict(got["rows"][c.text], kind=c.kind) for c in stream if c.text in got["rows"]]
        for r in rows:
            r["call"] = tuple(r["call"]) if r["call"] else None
        row = summarize("llama.cpp + LlamaGrammar", rows, reference)
        row.update(got.get("info", {}))
        out["rows"].append(row)
        log(json.dumps(row))
    elif gguf:  # right after the reference: a run stopped early still has both sides
        try:
            rows, info = run_llama(gguf, engine.backend, base.system_prompt, plan, toolbox, stream, threads, max_new)
            row = summarize("llama.cpp + LlamaGrammar", rows, reference)
            row.update(info)
            out["rows"].append(row)
            log(json.dumps(row))
        except ImportError as e:
            out["llama_cpp"] = f"not installed: {e}"
        if checkpoint is not None:
            checkpoint(out)
    for delta in [0.0, *deltas]:
        engine.update_settings(base.replace(approx_error_bound=delta, temperature=0.0, answer_max_age_s=1e6))
        rows = run_engine(engine, toolbox, plan, stream, delta, max_new=max_new, log=log)
        row = summarize("cache, exact (δ 0)" if delta == 0 else
                        f"bound δ {delta:g}" if delta < 1 else "no bound (δ 1: answer_threshold)", rows, reference)
        row.update(rows[-1])
        out["rows"].append(row)
        log(json.dumps(row))
        if checkpoint is not None:
            checkpoint(out)
    engine.update_settings(base)
    return out


def _kept(path: str, key: dict) -> dict:
    """What a run with the same key wrote to path ({"key", "rows" by text, ...}: a stopped run goes on after its
    rows), else {}."""
    if not path or not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        kept = json.load(f)
    return kept if kept.get("key") == key else {}


def _reference_rows(engine, toolbox, plan, texts: list[str], max_new: int, log, path: str) -> dict[str, dict]:
    """Each text's no-cache row (the engine with an empty pool): read from path where a run of the same model,
    tools and max_new left it, the rest computed and added (written every PROGRESS_EVERY texts)."""
    key = {"model": engine.settings.model, "schema": plan.schema_text, "max_new": max_new}
    wanted = set(texts)
    done = {t: r for t, r in _kept(path, key).get("rows", {}).items() if t in wanted}
    if done:
        log(f"  no-cache rows of {len(done)} texts read from {path}")
    todo = [t for t in texts if t not in done]

    def save() -> None:
        if path:
            write_json(path, {"key": key, "rows": done})

    for i in range(0, len(todo), PROGRESS_EVERY):
        part = todo[i:i + PROGRESS_EVERY]
        rows = run_engine(engine, toolbox, plan, [Command(t, "", "first") for t in part], 0.0, no_cache=True,
                          max_new=max_new)
        done.update({r["text"]: r for r in rows if "text" in r})
        save()
        log(f"  no-cache: {len(done)}/{len(texts)} texts, mean {statistics.mean(r['ms'] for r in rows[:-1]):.0f} ms "
            "(this part)")
    return {t: dict(done[t], call=tuple(done[t]["call"]) if done[t]["call"] else None) for t in texts}


def llama_only(engine, stream: list[Command], gguf: str, threads: int, path: str, max_new: int = 48,
               tools: list[str] | None = None, log=print) -> None:
    """llama.cpp's side alone (a process of its own beside the engine's configurations): its rows by text, written
    to path every PROGRESS_EVERY texts (a later run on the same path resumes after them); `bench(llama_rows=path)`
    summarizes them against the no-cache calls."""
    toolbox = Toolbox.from_list(TOOLS)
    plan = toolbox.plan(tools or [t["name"] for t in TOOLS], "required")
    unique = [Command(t, "", "first") for t in dict.fromkeys(c.text for c in stream)]
    # the rows already at path for the same file, tools and max_new are kept: a stopped run resumes after them
    key = {"gguf": os.path.basename(gguf), "tools": sorted(tools or [t["name"] for t in TOOLS]), "max_new": max_new}
    kept = _kept(path, key)
    out: dict = {"rows": kept.get("rows", {}), "info": kept.get("info") or {}, "key": key}
    if out["rows"]:
        log(f"  llama.cpp: resuming after the {len(out['rows'])} texts kept in {path}")
    todo = [c for c in unique if c.text not in out["rows"]]
    for i in range(0, len(todo), PROGRESS_EVERY):
        rows, info = run_llama(gguf, engine.backend, engine.settings.system_prompt, plan, toolbox,
                               todo[i:i + PROGRESS_EVERY], threads, max_new)
        out["info"] = out["info"] or info
        out["rows"].update({r["text"]: r for r in rows})
        write_json(path, out)
        log(f"  llama.cpp: {len(out['rows'])}/{len(unique)} texts, mean "
            f"{statistics.mean(r['ms'] for r in out['rows'].values()):.0f} ms")


def merge_llama(report_path: str, reference_path: str, llama_path: str, stream: list[Command]) -> dict:
    """A finished (or checkpointed) report gains llama.cpp's row from a --llama-only run's rows, summarized against
    the no-cache calls of --reference (no model loaded); the part of the stream both sides finished."""
    with open(report_path, encoding="utf-8") as f:
        report = json.load(f)
    with open(reference_path, encoding="utf-8") as f:
        ref = json.load(f)["rows"]
    with open(llama_path, encoding="utf-8") as f:
        got = json.load(f)
    reference = {t: (tuple(r["call"]) if r["call"] else None) for t, r in ref.items()}
    rows = [dict(got["rows"][c.text], kind=c.kind, call=tuple(got["rows"][c.text]["call"])
                 if got["rows"][c.text]["call"] else None) for c in stream if c.text in got["rows"] and c.text in ref]
    row = summarize("llama.cpp + LlamaGrammar", rows, reference)
    row.update(got.get("info", {}))
    report["rows"] = [r for r in report["rows"] if r["config"] != row["config"]] + [row]
    write_json(report_path, report, indent=1)
    return report


def markdown(report: dict) -> list[str]:
    lines = [f"Model: {report.get('model', '?')}. {report['commands']} commands over {report['intents']} intents and "
             f"{report['tools']} tools (kinds: {report['kinds']}); greedy, max 48 new tokens, tool_choice required, "
             f"{report.get('threads', 1)} thread(s).", "",
             "| config | valid calls | equal to no cache | approximate served | approximate wrong | traps served "
             "| exact memo | mean ms | p50 ms | p95 ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['config']} | {r['valid']}/{r['commands']} | {r['equal_to_no_cache']} | {r['approximate']} "
                     f"| {r['approximate_wrong']} | {r['traps_served']} | {r['memo']} | {r['mean_ms']:.0f} "
                     f"| {r['p50_ms']:.0f} | {r['p95_ms']:.0f} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="simllm-bench tool_calls", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="", help="a .gguf file (default: the embedded model)")
    ap.add_argument("--commands", type=int, default=300)
    ap.add_argument("--deltas", default="0.02,0.05,0.1,1")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--intents", type=int, default=0,
                    help="only the first N intents, and only their tools offered (a shorter prompt; 0: all)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-llama", action="store_true", help="skip llama.cpp")
    ap.add_argument("--out", default="", help="JSON report (default benchmark/results/tool_calls_<model>.json)")
    ap.add_argument("--reference", default="", help="keep each text's no-cache row in this JSON file and reuse it")
    ap.add_argument("--llama-only", default="", metavar="PATH",
                    help="run llama.cpp's side alone, its rows to PATH (for --llama-rows of another run)")
    ap.add_argument("--llama-rows", default="", help="llama.cpp's rows from a --llama-only run, instead of running it")
    ap.add_argument("--merge-llama", action="store_true",
                    help="add --llama-rows to the report --out against --reference, and print it (no model loaded)")
    a = ap.parse_args(argv)
    if a.merge_llama:
        report = merge_llama(a.out, a.reference, a.llama_rows, workload(a.commands, a.seed, a.intents))
        print("\n".join(markdown(report)))
        return

    # local: torch, the engine and model_files load when a run starts (the tests of this module go without)
    import torch

    torch.set_num_threads(a.threads)
    # local: model_files and the engine import torch (after set_num_threads above)
    from simllm_ros.model.model_files import gguf_source
    from simllm_ros.serving.engine import Engine

    overrides = {"cache_size": "512MB"}
    if a.model:
        overrides["model"] = a.model
    engine = Engine(Settings.from_overrides(**overrides))
    t0 = time.perf_counter()
    engine.load(lambda m: None)
    print(f"loaded {engine.settings.model} in {time.perf_counter() - t0:.0f} s", flush=True)
    stream = workload(a.commands, a.seed, a.intents)
    gguf = None if a.no_llama else gguf_source(engine.settings.model)
    tools = list(dict.fromkeys(INTENTS[c.intent][0] for c in stream)) if a.intents else None
    model = os.path.basename(a.model) if a.model else engine.settings.model
    out = a.out or os.path.join(RESULTS_DIR, f"tool_calls_{os.path.splitext(model)[0]}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)

    def save(report: dict) -> None:
        report.update(model=model, threads=a.threads, seed=a.seed)
        write_json(out, report, indent=1)

    if a.llama_only:
        llama_gguf = gguf_source(engine.settings.model)
        if llama_gguf is None:
            raise SystemExit(f"--llama-only needs a GGUF file; {engine.settings.model} has none")
        llama_only(engine, stream, llama_gguf, a.threads, a.llama_only, tools=tools,
                   log=lambda m: print(m, flush=True))
        return
    report = bench(engine, stream, [float(x) for x in a.deltas.split(",") if x], gguf, a.threads, tools=tools,
                   checkpoint=save, log=lambda m: print(m, flush=True), reference_file=a.reference,
                   llama_rows=a.llama_rows)
    engine.unload()
    save(report)
    print(f"wrote {out}")
    print("\n".join(markdown(report)))


if __name__ == "__main__":
    main()
