"""Commands reused by meaning: a paraphrase of a command may be served the call a verified run gave a similar one.

Why a module of its own: a call is not free text. "go to the dock" and "head over to the charging dock please" map to
one call, so serving a neighbour's call is right far more often than serving its text; but "dock 2" / "dock 3" or
"0.5 m/s" / "5 m/s" look alike to an embedder and must never share a call. So a cached call is served for a new
command only where all three say yes:
  1. a neighbour: the most similar command (cosine of the engine's question fingerprints, the matcher's own) of the
     same scope, tools, tool_choice, context and system prompt whose exact run gave a call that validated;
  2. the slot guard (`slot_conflict`): answer_guard's checks (numbers with their units, negation, opposite words,
     dates, named entities, places after to/at/in, quoted text), robot-command opposites (engage/release, ...),
     and the known slot values (every string an enum or `allowed` of the offered tools' schemas holds, and every
     string argument of the cached call): a value named in one command and not in the other refuses;
  3. the error bound (approx_error_bound δ, tier "call" of the engine's ErrorBound): its 95% upper bound on the
     chance that the neighbour's call differs from the model's own at that similarity is at most δ. Its labels
     come from the node's own exact runs: whenever a command is answered exactly and its call validates, the
     neighbour that passed the guard is labelled "same call" (name and arguments equal) or "different call".
     No labels: bound 1, nothing served. 10% of the hits the bound allows are run exactly anyway (exploration).
Identical commands never take this path: the engine's exact memo answers them, bitwise the model's own call.
A served call is reported approximate (`exact: false`, cache_result ANSWER, `error_estimate`: the bound) and goes
through the same gate as any call (schema, bounds, executable, tools_execute, rate limit).
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import re
import threading
import time
from collections.abc import Callable

import numpy as np

from ..cache import answer_guard
from ..cache.error_bound import NO_DATA, ErrorBound, Estimate
from ..request import CacheResult, QueryRequest, QueryResult
from ..validation import normalize_text
from .approx_gate import LABEL_MIN_SIMILARITY, request_bound
from .request_pipeline import task_digest
from .tool_call_checks import Call
from .tool_output_formats import CallPlan, write_call
from .tool_schemas import ToolError
from .toolbox import Toolbox

TIER = "call"
MAX_CALLS = 4096  # verified commands kept (newest); each a fingerprint (384 floats) and a short call
MAX_LABELLED = 20000  # command pairs already labelled: a pair asked again adds no new evidence

# Verbs of robot commands whose two sides set one slot to opposite values (a boolean the prompt names by a verb).
COMMAND_OPPOSITES = tuple((frozenset(a.split()), frozenset(b.split())) for a, b in (
    ("engage engaged engaging apply set", "release released releasing disengage disengaged"),
    ("grab grasp grip pick", "drop place put release"),
    ("arm armed", "disarm disarmed"),
    ("dock docking", "undock undocking"),
    ("forward forwards ahead", "backward backwards back reverse"),
    ("clockwise", "counterclockwise anticlockwise"),
    ("extend", "retract"),
    ("tighten", "loosen"),
    ("fold", "unfold"),
    ("charge charging", "discharge"),
))


def slot_values(plan: CallPlan, call: Call | None = None) -> set[str]:
    """The strings a command may name as a slot: enum / allowed strings of the plan's tools' schemas and the string
    arguments of `call` (lower case, at most 8 words each)."""
    out: set[str] = set()

    def walk(node):
        if isinstance(node, dict):
            for v in node.get("enum", ()):
                if isinstance(v, str):
                    out.add(v)
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    for tool in plan.tools:
        walk(tool.schema)
    if call is not None:
        _strings(call.arguments, out)
    return {v.lower().strip() for v in out if v.strip() and len(v.split()) <= 8}


def _strings(v, out: set[str]) -> None:
    if isinstance(v, str):
        out.add(v)
    elif isinstance(v, dict):
        for x in v.values():
            _strings(x, out)
    elif isinstance(v, list):
        for x in v:
            _strings(x, out)


def _words(text: str) -> str:
    return " " + " ".join(re.findall(r"[a-z0-9_.]+", text.lower())) + " "


def slot_conflict(new: str, cached: str, values: set[str]) -> str | None:
    """Why the cached command's call must not answer the new one (a slot that may differ), or None."""
    ok, why = answer_guard.answers_compatible(new, cached)
    if not ok:
        return why
    wa, wb = set(_words(new).split()), set(_words(cached).split())
    for side1, side2 in COMMAND_OPPOSITES:
        a1, a2, b1, b2 = bool(wa & side1), bool(wa & side2), bool(wb & side1), bool(wb & side2)
        if (a1 and not a2 and b2 and not b1) or (a2 and not a1 and b1 and not b2):
            return f"opposite command words: '{sorted(wa & (side1 | side2))[0]}' vs '{sorted(wb & (side1 | side2))[0]}'"
    ta, tb = _words(new), _words(cached)
    for v in sorted(values):
        w = _words(v)
        if w.strip() and (w in ta) != (w in tb):
            return f"slot value '{v}' is named in only one command"
    return None


@dataclasses.dataclass(frozen=True)
class Verified:
    """A command whose exact run gave a call that validated."""
    question: str  # normalized
    fingerprint: np.ndarray
    call: Call
    task: str  # its id in the error bound's labels
    created: float


@dataclasses.dataclass
class Neighbour:
    verified: Verified
    similarity: float


@dataclasses.dataclass
class Lookup:
    """What the reuse found for one request: `served` (the cached call, approximate), or what to label once the exact
    run is in (`neighbour`, None where none passed the guard). key None: the request is not one this reuse handles."""
    key: str | None = None
    scope: str = ""
    question: str = ""
    fingerprint: np.ndarray | None = None
    neighbour: Neighbour | None = None
    refused: str = ""  # the guard's reason for the nearest neighbour, when it refused
    estimate: Estimate = NO_DATA
    served: QueryResult | None = None
    plan: CallPlan | None = None


class CallReuse:
    """The verified commands of one engine, and the decisions and labels above. Thread-safe (requests of a node
    come from several threads). `bound`: the engine's ErrorBound unless given (labels persist with it)."""

    def __init__(self, engine, toolbox: Toolbox, bound: ErrorBound | None = None, max_calls: int = MAX_CALLS):
        self.engine, self.toolbox = engine, toolbox
        self.bound = bound if bound is not None else engine.error_bound
        self._calls: dict[tuple[str, str], collections.OrderedDict[str, Verified]] = {}
        self._count = 0
        self._max = max_calls
        self._labelled: collections.OrderedDict[tuple, None] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.counts = collections.Counter({"served": 0, "explored": 0, "guard_refused": 0, "labels": 0})

    # ------------------------------------------------------------------ the request path
    def answer(self, asked: QueryRequest, req: QueryRequest, plan: CallPlan | None,
               run: Callable[[QueryRequest], QueryResult]) -> QueryResult:
        """The result of a request with tools: the cached call where the reuse may serve it, else run(req) (the
        engine's exact answer), which then labels the neighbour and joins the verified commands."""
        look = self.lookup(asked, req, plan)
        if look.served is not None:
            return look.served
        result = run(req)
        self.learn(look, result)
        return result

    def lookup(self, asked: QueryRequest, req: QueryRequest, plan: CallPlan | None) -> Lookup:
        """asked: the request as the caller sent it (its allow_approximate, δ, question); req: the constrained
        request the engine would answer (tools text, schema)."""
        t0 = time.perf_counter()
        engine = self.engine
        s = engine.settings
        temperature = s.temperature if asked.temperature is None else asked.temperature
        if plan is None or temperature != 0 or asked.stop or len(asked.turns()) != 1 or not engine.loaded:
            return Lookup()
        question = normalize_text(asked.question)
        try:
            fp = engine.embed([asked.question])[0]
        except Exception:  # noqa: BLE001 - bad input (the engine refuses it with the reason) or an embedder fault:
            return Lookup()  # either way the request goes the exact way, without reuse
        key = hashlib.sha1(f"{task_digest(req)}\x1f{s.system_prompt}\x1f{req.max_new_tokens}\x1f{plan.format}"
                           f"\x1f{plan.choice}".encode()).hexdigest()
        look = Lookup(key, asked.scope, question, fp, plan=plan)
        near = self._nearest(asked.scope, key, question, fp, time.time() - s.answer_max_age_s)
        if near is None:
            return look
        why = slot_conflict(question, near.verified.question, slot_values(plan, near.verified.call))
        if why:
            look.refused = why
            with self._lock:
                self.counts["guard_refused"] += 1
            return look
        look.neighbour = near
        delta = request_bound(asked.approx_error_bound, s.approx_error_bound)
        if not asked.allow_approximate or delta <= 0:
            return look
        if delta >= 1.0:  # no bound asked: the fixed threshold alone
            if near.similarity < s.answer_threshold:
                return look
        else:
            look.estimate = self.bound.estimate(TIER, asked.scope, near.verified.task, near.similarity)
            if not look.estimate.allows(delta):
                return look
            if self.bound.explore():
                self.bound.explored[TIER, asked.scope] += 1
                with self._lock:
                    self.counts["explored"] += 1
                return look
        self.bound.served[TIER, asked.scope] += 1
        with self._lock:
            self.counts["served"] += 1
        call = near.verified.call
        ms = (time.perf_counter() - t0) * 1000
        look.served = QueryResult(
            success=True, answer=write_call(plan, call),
            cache_result=CacheResult.ANSWER, similarity=near.similarity, request_id=req.request_id, exact=False,
            error_estimate=look.estimate.upper if look.estimate.n else 0.0, ttft_ms=ms, total_ms=ms,
            stop_reason="stop")
        return look

    def learn(self, look: Lookup, result: QueryResult) -> None:
        """After the exact run: the neighbour's label (same call or not) and the command joins the verified ones.
        Only an exact, successful answer that parses as a valid reply (a call, or text under auto) counts."""
        plan, fingerprint = look.plan, look.fingerprint  # set with the key
        if look.key is None or plan is None or fingerprint is None or not (result.success and result.exact):
            return
        try:
            _, calls = self.toolbox.parse(plan, result.answer)
        except ToolError:
            return  # not a verified parse: no label, nothing kept
        call = calls[0] if len(calls) == 1 else None
        task = hashlib.sha1(f"{look.key}\x1f{look.question}".encode()).hexdigest()[:16]
        if look.neighbour is not None:
            cached = look.neighbour.verified
            pair = (look.scope, look.key, look.question, cached.question)
            with self._lock:
                fresh = pair not in self._labelled
                if fresh:
                    self._labelled[pair] = None
                    if len(self._labelled) > MAX_LABELLED:
                        self._labelled.popitem(last=False)
                    self.counts["labels"] += 1
            if fresh:
                same = call is not None and same_call(call, cached.call)
                self.bound.record(TIER, look.scope, cached.task, look.neighbour.similarity, not same)
        if call is not None:
            self._keep(look.scope, look.key, Verified(look.question, fingerprint, call, task, time.time()))

    # ------------------------------------------------------------------ the verified commands
    def _nearest(self, scope: str, key: str, question: str, fp: np.ndarray, oldest: float) -> Neighbour | None:
        with self._lock:
            group = self._calls.get((scope, key))
            items = [v for v in group.values() if v.question != question and v.created >= oldest] if group else []
        if not items:
            return None
        sims = np.stack([v.fingerprint for v in items]) @ fp
        i = int(np.argmax(sims))
        sim = float(sims[i])
        return Neighbour(items[i], sim) if sim >= LABEL_MIN_SIMILARITY else None

    def _keep(self, scope: str, key: str, v: Verified) -> None:
        with self._lock:
            group = self._calls.setdefault((scope, key), collections.OrderedDict())
            self._count += v.question not in group
            group.pop(v.question, None)
            group[v.question] = v
            while self._count > self._max:  # the oldest group's oldest command goes
                g_key = next(iter(self._calls))
                g = self._calls[g_key]
                g.popitem(last=False)
                self._count -= 1
                if not g:
                    del self._calls[g_key]

    def __len__(self) -> int:
        return self._count

    def clear(self) -> None:
        with self._lock:
            self._calls.clear()
            self._labelled.clear()
            self._count = 0

    def diagnostic_values(self) -> list[tuple[str, str]]:
        with self._lock:
            return [(f"tool_calls_reuse_{k}", str(v)) for k, v in sorted(self.counts.items())] + \
                [("tool_calls_verified_commands", str(self._count))]


def same_call(a: Call, b: Call) -> bool:
    """The same tool with the same arguments (as JSON values: 0.5 == 0.5, key order aside)."""
    return a.name == b.name and a.arguments_json == b.arguments_json
