"""Benchmark workloads as JSON Lines: generated contexts, real user phrasings (CLINC150).

One request per line:

    {"t": 12.5,                # seconds since the workload started (simulated arrival time)
     "scope": "edge",          # cache_scope of the request
     "context": "...",         # context block placed after the system prompt
     "prompt": "...",          # what the user asked (a real CLINC150 phrasing)
     "intent": "weather",      # optional: the CLINC150 intent of the phrasing
     "rev": 3}                 # optional: revision number of the context

Only t, scope, context and prompt are read by the benchmark; `t` orders the
requests and is reported, but the benchmark replays them back to back (it does
not sleep through simulated minutes).

Workloads (deterministic for a given seed):
- edge-bulletin: a local bulletin of a few hundred tokens (weather, traffic,
  events, parking) revised every few simulated minutes (its clock, numbers, a
  road closing or opening), and questions about it drawn with repeats from a
  few intents (ten phrasings each, Zipf-weighted): exact repeats, paraphrases,
  and the same question after a revision.
- robot-state: a robot state block (clock, pose, battery, task) that changes a
  little on every request, and questions a robot is asked.
- mixed: unrelated intents from all 150, each request with its own short
  context: reuse should rarely fire beyond the shared system prompt.

Contexts are generated; every question is a CLINC150 phrasing (Larson et al.
2019, CC BY 3.0), read from ../shared/data/clinc150/train.jsonl or a path given
with --clinc.

    python -m simllm_ros.workloads --out benchmark/workloads [--seed 7] [--clinc PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
from collections import defaultdict

DEFAULT_CLINC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data",
                             "clinc150", "train.jsonl")
CLINC_CANDIDATES = (os.environ.get("SIMLLM_CLINC150", ""), DEFAULT_CLINC, "/work/shared/data/clinc150/train.jsonl")

SIZES = {"edge-bulletin": 72, "robot-state": 60, "mixed": 50}

EDGE_INTENTS = {  # intent: weight (how often users ask it)
    "weather": 6, "traffic": 6, "directions": 3, "distance": 3, "how_busy": 2, "date": 1, "time": 1, "calendar": 1,
}
ROBOT_INTENTS = {
    "current_location": 5, "distance": 3, "directions": 2, "gas": 3, "time": 2, "todo_list": 3, "timer": 1,
    "change_speed": 1, "reminder": 1,
}
# Words after " in "/" at " that do not name a far-away place: a phrasing naming another city is left out
# of the local workloads (the bulletin and the robot know nothing about tampa).
_LOCAL_WORDS = {"the", "my", "a", "an", "here", "this", "today", "tomorrow", "town", "downtown", "area", "traffic",
                "minutes", "min", "hour", "hours", "time", "it", "me", "now", "our", "your", "front", "line"}
_PLACE_RE = re.compile(r"\b(?:in|at|to|for|from|near|around|on)\s+([a-z][a-z'.-]*)")


def find_clinc(path: str = "") -> str:
    for p in ((path,) if path else CLINC_CANDIDATES):
        if p and os.path.isfile(p):
            return p
    raise FileNotFoundError("CLINC150 train.jsonl not found; pass --clinc or set SIMLLM_CLINC150")


def load_clinc(path: str = "") -> dict[str, list[str]]:
    by_intent: dict[str, list[str]] = defaultdict(list)
    with open(find_clinc(path), encoding="utf-8") as f:
        for line in f:
            if line.strip():
                d = json.loads(line)
                by_intent[d["intent"]].append(d["text"].strip())
    return dict(by_intent)


_CITIES = {"orlando", "tampa", "pittsburgh", "sarasota", "chicago", "la", "houston", "boston", "miami", "denver",
           "seattle", "paris", "london", "tokyo", "dallas", "austin", "phoenix", "atlanta", "portland", "vegas",
           "nyc", "york", "florida", "texas", "california", "china", "japan", "france", "italy", "germany", "spain"}


def is_local(text: str) -> bool:
    """True for phrasings that do not name a specific far-away place (heuristic)."""
    words = set(re.findall(r"[a-z']+", text.lower()))
    if words & _CITIES or "," in text or "zone" in text:
        return False
    for m in _PLACE_RE.finditer(text.lower()):
        w = m.group(1)
        if w not in _LOCAL_WORDS and w not in {"get", "go", "work", "home", "school", "office", "airport", "mall",
                                               "store", "park", "beach", "dock", "station", "parking", "lot",
                                               "leave", "be", "set", "walk", "drive", "arrive", "reach", "do",
                                               "know", "check", "find", "tell", "see"}:
            return False
    return True


def phrasing_pool(rng: random.Random, clinc: dict[str, list[str]], intent: str, n: int, local: bool) -> list[str]:
    texts = [t for t in clinc[intent] if not local or is_local(t)]
    if len(texts) < n:  # keep the workload full even if the filter is strict for this intent
        texts += [t for t in clinc[intent] if t not in texts]
    texts = sorted(set(texts))
    rng.shuffle(texts)
    return texts[:n]


def _weighted(rng: random.Random, weights: dict[str, int]) -> str:
    keys = sorted(weights)
    return rng.choices(keys, weights=[weights[k] for k in keys])[0]


def _question_stream(rng: random.Random, clinc: dict[str, list[str]], weights: dict[str, int], n: int,
                     per_intent: int = 6, repeat_p: float = 0.35) -> list[tuple[str, str]]:
    """n (intent, phrasing): a few phrasings per intent, with exact repeats of recent questions."""
    pools = {i: phrasing_pool(rng, clinc, i, per_intent, local=True) for i in weights}
    out: list[tuple[str, str]] = []
    for _ in range(n):
        if out and rng.random() < repeat_p:
            out.append(rng.choice(out[-8:]))  # the same question again (another user, or asked again)
            continue
        intent = _weighted(rng, weights)
        # Zipf: the first phrasings of an intent are the common ones, the others are paraphrases of them
        pool = pools[intent]
        k = rng.choices(range(len(pool)), weights=[1.0 / (j + 1) for j in range(len(pool))])[0]
        out.append((intent, pool[k]))
    return out


# ---- edge-bulletin -------------------------------------------------------------------------------------------
ROADS = ["Harbor Road", "Main Street", "Route 9", "Mill Lane bridge", "Station Avenue"]
LOTS = ["Market Square", "Central Station", "Riverside", "Library"]
EVENTS = [("Farmers market", "Market Square"), ("Jazz in the park", "Elm Park"), ("Library book fair", "Library"),
          ("5K charity run", "Riverside path"), ("Open-air cinema", "Harbor pier")]
SKY = ["sunny", "partly cloudy", "cloudy", "light rain", "showers", "overcast"]
WINDS = ["N", "NE", "E", "SE", "S", "SW", "W", "NW"]


def _clock(minutes: float) -> str:
    m = int(minutes) % (24 * 60)
    return f"{m // 60:02d}:{m % 60:02d}"


def bulletin_text(state: dict) -> str:
    lines = [f"LOCAL BULLETIN - Lakeside district - updated {_clock(state['clock'])} (revision {state['rev']})", "",
             "WEATHER",
             f"Now {state['temp']} C, {state['sky']}, wind {state['wind_dir']} {state['wind']} km/h, "
             f"humidity {state['hum']}%. Chance of rain this afternoon: {state['rain']}%. "
             f"Tonight low {state['low']} C. Tomorrow high {state['high']} C.", "",
             "TRAFFIC"]
    for road in ROADS:
        st = state["roads"][road]
        if st == "closed":
            lines.append(f"- {road}: CLOSED ({state['closure_reason'][road]}); use the signed detour.")
        elif st == 0:
            lines.append(f"- {road}: moving freely.")
        else:
            lines.append(f"- {road}: slow, delays of about {st} minutes.")
    lines += ["", "EVENTS TODAY"]
    for (name, place), when in zip(EVENTS, state["event_times"]):
        lines.append(f"- {name} at {place}, {when}.")
    lines += ["", "PARKING (free spaces)"]
    lines.append("; ".join(f"{lot}: {state['lots'][lot]}" for lot in LOTS) + ".")
    lines.append(f"Shuttle bus every {state['shuttle']} minutes from Central Station to the harbor.")
    return "\n".join(lines)


def _edge_initial(rng: random.Random) -> dict:
    return {
        "rev": 1, "clock": 8 * 60 + rng.randint(0, 50), "temp": rng.randint(11, 19), "sky": rng.choice(SKY),
        "wind_dir": rng.choice(WINDS), "wind": rng.randint(5, 25), "hum": rng.randint(45, 85),
        "rain": rng.choice(range(0, 90, 10)), "low": rng.randint(4, 10), "high": rng.randint(16, 24),
        "roads": {r: rng.choice([0, 0, 5, 10]) for r in ROADS},
        "closure_reason": {r: rng.choice(["accident", "road works", "flooding", "parade"]) for r in ROADS},
        "event_times": [f"{h}:00 to {h + d}:00" for h, d in
                        ((rng.randint(8, 11), 4), (rng.randint(17, 19), 3), (10, 6), (rng.randint(7, 9), 2), (21, 2))],
        "lots": {lot: rng.randint(5, 240) for lot in LOTS}, "shuttle": rng.choice([10, 12, 15, 20]),
    }


def _edge_revise(rng: random.Random, s: dict, minutes: float) -> dict:
    s = json.loads(json.dumps(s))
    s["rev"] += 1
    s["clock"] += minutes
    s["temp"] += rng.choice([-1, 0, 0, 1])
    s["wind"] = max(0, s["wind"] + rng.randint(-4, 4))
    s["hum"] = min(99, max(20, s["hum"] + rng.randint(-5, 5)))
    if rng.random() < 0.3:
        s["rain"] = min(100, max(0, s["rain"] + rng.choice([-20, -10, 10, 20])))
    if rng.random() < 0.15:
        s["sky"] = rng.choice(SKY)
    for road in rng.sample(ROADS, 2):  # delays drift; now and then a road closes or reopens
        cur = s["roads"][road]
        if cur == "closed":
            s["roads"][road] = 10 if rng.random() < 0.5 else "closed"
        elif rng.random() < 0.12:
            s["roads"][road] = "closed"
        else:
            s["roads"][road] = max(0, cur + rng.choice([-5, 0, 5, 10]))
    for lot in LOTS:
        s["lots"][lot] = max(0, s["lots"][lot] + rng.randint(-25, 20))
    return s


def edge_bulletin(clinc: dict[str, list[str]], n: int, seed: int) -> list[dict]:
    rng = random.Random(f"edge-bulletin:{seed}")
    state = _edge_initial(rng)
    t, last_rev, next_rev = 0.0, 0.0, rng.uniform(90, 240)
    out = []
    for intent, q in _question_stream(rng, clinc, EDGE_INTENTS, n, per_intent=10, repeat_p=0.25):
        t += rng.uniform(8, 45)
        while t >= next_rev:  # the bulletin is revised every 1.5-4 simulated minutes
            state = _edge_revise(rng, state, (next_rev - last_rev) / 60.0)
            last_rev, next_rev = next_rev, next_rev + rng.uniform(90, 240)
        out.append({"t": round(t, 1), "scope": "edge", "context": bulletin_text(state), "prompt": q,
                    "intent": intent, "rev": state["rev"]})
    return out


# ---- robot-state ---------------------------------------------------------------------------------------------
TASKS = [("deliver parcel P-1184 to dock 4", ["load parcel", "leave bay", "navigate to dock 4", "hand over",
                                              "return to bay"]),
         ("inventory scan of aisles 10-14", ["navigate to aisle 10", "scan shelves", "upload report"]),
         ("escort visitor to meeting room B", ["meet visitor at lobby", "walk to room B", "return to lobby"])]


def robot_text(s: dict) -> str:
    task, steps = TASKS[s["task"]]
    return "\n".join([
        f"ROBOT STATE at {_clock(s['clock'])}:{int(s['sec']):02d}",
        "robot: rover-7 (warehouse B, level 0)",
        f"pose: x={s['x']:.2f} m, y={s['y']:.2f} m, heading {s['yaw']:.0f} deg",
        f"speed: {s['v']:.2f} m/s (limit {s['vmax']:.1f} m/s)",
        f"battery: {s['bat']}% ({'charging' if s['charging'] else 'discharging'}), "
        f"about {s['bat'] * 3 // 2} min of driving left",
        f"task: {task}, step {s['step'] + 1} of {len(steps)}: {steps[s['step']]}",
        f"next waypoint: {s['wp']} ({s['wp_dist']:.1f} m away)",
        f"payload: {s['payload']:.1f} kg; obstacles within 2 m: {s['obst']}",
        f"todo after this task: {', '.join(s['todo'])}",
        "faults: none" if not s["fault"] else f"faults: {s['fault']}",
    ])


def robot_state(clinc: dict[str, list[str]], n: int, seed: int) -> list[dict]:
    rng = random.Random(f"robot-state:{seed}")
    s: dict = {"clock": 14 * 60 + rng.randint(0, 30), "sec": 0, "x": rng.uniform(-20, 20), "y": rng.uniform(-20, 20),
         "yaw": rng.uniform(0, 360), "v": 0.4, "vmax": 1.2, "bat": rng.randint(60, 95), "charging": False, "task": 0,
         "step": 0, "wp": "aisle 12", "wp_dist": rng.uniform(5, 30), "payload": 4.2, "obst": 0,
         "todo": ["charge at bay 2", "scan aisle 7", "report to operator"], "fault": ""}
    out, t = [], 0.0
    for intent, q in _question_stream(rng, clinc, ROBOT_INTENTS, n, per_intent=5, repeat_p=0.3):
        dt = rng.uniform(5, 30)
        t += dt
        s["sec"] += dt
        s["clock"] += s["sec"] // 60
        s["sec"] %= 60
        s["x"] += rng.uniform(-1.5, 1.5)
        s["y"] += rng.uniform(-1.5, 1.5)
        s["yaw"] = (s["yaw"] + rng.uniform(-20, 20)) % 360
        s["v"] = round(min(s["vmax"], max(0.0, s["v"] + rng.uniform(-0.2, 0.2))), 2)
        s["wp_dist"] = max(0.5, s["wp_dist"] - rng.uniform(0, 4))
        s["obst"] = rng.choice([0, 0, 0, 1, 2])
        if rng.random() < 0.25:
            s["bat"] = max(5, s["bat"] - 1)
        if s["wp_dist"] <= 0.5 or rng.random() < 0.08:  # next step, next waypoint
            steps = TASKS[s["task"]][1]
            s["step"] += 1
            if s["step"] >= len(steps):
                s["task"], s["step"] = (s["task"] + 1) % len(TASKS), 0
            s["wp"] = rng.choice(["aisle 12", "dock 4", "lobby", "bay 2", "aisle 10", "room B"])
            s["wp_dist"] = rng.uniform(5, 30)
        s["fault"] = "left bumper pressed" if rng.random() < 0.05 else ""
        out.append({"t": round(t, 1), "scope": "robot", "context": robot_text(s), "prompt": q, "intent": intent})
    return out


# ---- mixed ---------------------------------------------------------------------------------------------------
def _mixed_context(rng: random.Random, i: int) -> str:
    kind = rng.choice(["note", "list", "account", "calendar"])
    if kind == "note":
        who = rng.choice(['Ana', 'Ben', 'Chen', 'Dara', 'Eli'])  # drawn in this order: the workload stays the same
        what = rng.choice(['the kitchen light flickers', 'the printer needs toner',
                           'guests arrive at ' + str(rng.randint(4, 8)) + ' pm',
                           'the dog was fed at ' + str(rng.randint(6, 9)) + ' am'])
        return f"Note {i} from {who}: {what}."
    if kind == "list":
        items = rng.sample(["milk", "eggs", "bread", "rice", "apples", "coffee", "soap", "batteries", "tea"], 4)
        return f"Shopping list {i}: " + ", ".join(items) + "."
    if kind == "account":
        return (f"Account summary {i}: balance {rng.randint(100, 9000)} dollars, next bill due in "
                f"{rng.randint(2, 28)} days, {rng.randint(0, 5)} pending transfers.")
    return (f"Calendar {i}: {rng.choice(['dentist', 'team meeting', 'yoga', 'school pickup'])} at "
            f"{rng.randint(8, 18)}:{rng.choice(['00', '15', '30', '45'])}, "
            f"{rng.choice(['call mom', 'pay rent', 'gym'])} later.")


def mixed(clinc: dict[str, list[str]], n: int, seed: int) -> list[dict]:
    rng = random.Random(f"mixed:{seed}")
    intents = sorted(clinc)
    rng.shuffle(intents)
    out, t = [], 0.0
    for i in range(n):
        intent = intents[i % len(intents)]
        t += rng.uniform(5, 60)
        out.append({"t": round(t, 1), "scope": "mixed", "context": _mixed_context(rng, i + 1),
                    "prompt": rng.choice(clinc[intent]), "intent": intent})
    return out


GENERATORS = {"edge-bulletin": edge_bulletin, "robot-state": robot_state, "mixed": mixed}


def generate(name: str, n: int | None = None, seed: int = 7, clinc_path: str = "") -> list[dict]:
    return GENERATORS[name](load_clinc(clinc_path), n or SIZES[name], seed)


def write_jsonl(path: str, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def read_jsonl(path: str) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                d = json.loads(line)
                for k in ("scope", "context", "prompt"):
                    if not isinstance(d.get(k), str):
                        raise ValueError(f"{path}:{n}: '{k}' must be a string")
                d["t"] = float(d.get("t", 0.0))
                rows.append(d)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="generate the benchmark workloads (JSON Lines)")
    ap.add_argument("--out", default="benchmark/workloads")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--clinc", default="", help="CLINC150 train.jsonl")
    ap.add_argument("--only", nargs="*", choices=sorted(GENERATORS))
    args = ap.parse_args(argv)
    clinc = load_clinc(args.clinc)
    for name in args.only or GENERATORS:
        rows = GENERATORS[name](clinc, SIZES[name], args.seed)
        path = os.path.join(args.out, f"{name}.jsonl")
        write_jsonl(path, rows)
        print(f"{path}: {len(rows)} requests")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
