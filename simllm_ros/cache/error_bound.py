"""How often an approximate answer differs from the model's own, learnt from the node's own verifications.

A fixed cosine threshold cannot know which neighbours are safe: the same similarity is safe for one cached
task and wrong for another. The node gets labels for free: every lossless request that had a stored answer
of a similar task within reach learns whether serving that answer (the ANSWER tier) would have given the
model's own answer, and idle-time audits learn the same for SEMANTIC reuse. An approximate answer is served
only where a one-sided 95% upper confidence bound on its chance of differing is at most the caller's bound δ
(approx_error_bound), estimated where the node has data: the entry itself first (an entry that was wrong at a
similarity is never served at that similarity or below again), then its scope, then all scopes; with too few
labels the bound is 1 and the request takes the lossless path (cold start = lossless). A share of the hits
that pass is still verified (exploration), so the estimate keeps learning.

Labels are a bounded list (newest kept), persisted as JSON with the numerics digest beside the pool snapshot and
read back within a size, a depth and the list's cap (a damaged or hostile file is refused by name, never a crash).
"""
from __future__ import annotations

import collections
import dataclasses
import math
import os
import random
import re
import sys
import threading

from .. import bounded_json
from ..safe_io import read_regular, write_json

TIERS = ("answer", "semantic", "call")  # call: a command served a similar one's call (serving/tool_call_reuse)
MAX_LABELS = 20000
MIN_LABELS = 20  # fewer labels at or above a similarity than this: no estimate at that level
EXPLORE_RATE = 0.1  # share of would-be approximate hits verified anyway (their labels keep the estimate honest)
Z95 = 1.6449  # one-sided 95%
FILE_NAME = "error_bound.json"
FORMAT = 1
MAX_NAME_CHARS = 256  # a label's scope (max_scope_length is at most 256) and its task id (16 hex)
MAX_FILE_BYTES = 8 * 2**20  # MAX_LABELS rows of the longest names fit; a larger file is not one this node wrote
MAX_DEPTH = 3  # {"labels": [[...], ...]}


def wilson_upper(wrong: int, n: int, z: float = Z95) -> float:
    """One-sided upper confidence bound of a binomial rate (Wilson score); 1.0 without data."""
    if n <= 0:
        return 1.0
    p = wrong / n
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return min(1.0, (centre + spread) / (1 + z * z / n))


@dataclasses.dataclass(frozen=True, slots=True)
class Label:
    tier: str
    scope: str
    entry: str  # the cached task's id (kv_pool.task_id): the same after a restart
    similarity: float
    wrong: bool


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The bound a decision was taken on: `upper` (the 95% upper bound on the chance of a different answer),
    the rate observed, the labels behind it and where they came from (entry, scope, all, none)."""
    upper: float
    observed: float
    n: int
    level: str

    def allows(self, delta: float) -> bool:
        return delta > 0 and self.upper <= delta


NO_DATA = Estimate(1.0, 0.0, 0, "none")


class ErrorBound:
    def __init__(self, max_labels: int = MAX_LABELS, seed: int = 0):
        self._labels: collections.deque[Label] = collections.deque(maxlen=max_labels)
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self.served: collections.Counter = collections.Counter()  # (tier, scope) -> approximate answers served
        self.explored: collections.Counter = collections.Counter()  # (tier, scope) -> would-be hits verified instead
        self.changes = 0  # labels recorded since the last save

    def __len__(self) -> int:
        return len(self._labels)

    def record(self, tier: str, scope: str, entry: str, similarity: float, wrong: bool) -> None:
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r}")
        with self._lock:
            self._labels.append(Label(tier, scope, str(entry), float(similarity), bool(wrong)))
            self.changes += 1

    def estimate(self, tier: str, scope: str, entry: str, similarity: float) -> Estimate:
        """The bound for serving `entry`'s reuse at `similarity`: from the labels of this tier at this similarity
        or above, the entry's own (a wrong one refuses), else the scope's, else all scopes'."""
        with self._lock:
            above = [lb for lb in self._labels if lb.tier == tier and lb.similarity >= similarity]
        own = [lb for lb in above if lb.scope == scope and lb.entry == entry]
        if any(lb.wrong for lb in own):
            wrong = sum(lb.wrong for lb in own)
            return Estimate(1.0, wrong / len(own), len(own), "entry")
        for level, labels in (("scope", [lb for lb in above if lb.scope == scope]), ("all", above)):
            if len(labels) >= MIN_LABELS:
                wrong = sum(lb.wrong for lb in labels)
                return Estimate(wilson_upper(wrong, len(labels)), wrong / len(labels), len(labels), level)
        return NO_DATA

    def explore(self) -> bool:
        """Whether to verify this would-be approximate hit anyway."""
        with self._lock:
            return self._rng.random() < EXPLORE_RATE

    def totals(self) -> dict:
        """The kept labels in all tiers and scopes: checks, how many differed, the 95% upper bound of the rate."""
        with self._lock:
            n, wrong = len(self._labels), sum(lb.wrong for lb in self._labels)
        return {"approx_checks": n, "approx_checks_differ": wrong, "approx_differ_high": wilson_upper(wrong, n, 1.96)}

    def summary(self) -> dict[str, dict]:
        """Per tier and scope: labels, observed rate of different answers with its 95% interval, served."""
        with self._lock:
            labels = list(self._labels)
            served, explored = dict(self.served), dict(self.explored)
        out: dict[str, dict] = {}
        groups: dict[tuple[str, str], list[Label]] = collections.defaultdict(list)
        for lb in labels:
            groups[lb.tier, lb.scope].append(lb)
        for key in sorted(set(groups) | set(served)):
            g = groups.get(key, [])
            wrong = sum(lb.wrong for lb in g)
            out[f"{key[0]}/{key[1]}"] = {
                "labels": len(g), "observed": wrong / len(g) if g else 0.0,
                "low": 1.0 - wilson_upper(len(g) - wrong, len(g), 1.96) if g else 0.0,
                "high": wilson_upper(wrong, len(g), 1.96) if g else 1.0,
                "served": served.get(key, 0), "explored": explored.get(key, 0)}
        return out

    # ---- persistence --------------------------------------------------------------------------------
    def save(self, folder: str, digest: str) -> str:
        """Write the labels atomically beside the pool snapshot; returns the path."""
        with self._lock:
            data = {"format": FORMAT, "digest": digest,
                    "labels": [[lb.tier, lb.scope, lb.entry, round(lb.similarity, 6), int(lb.wrong)]
                               for lb in self._labels]}
            self.changes = 0
        path = os.path.join(folder, FILE_NAME)
        os.makedirs(folder, exist_ok=True)
        write_json(path, data, separators=(",", ":"))
        return path

    def load(self, folder: str, digest: str) -> int:
        """Labels from a saved file of the same numerics digest; returns how many (the newest max_labels of the
        file). Raises ValueError with the reason for a file that is not ours, damaged, foreign, too large or too
        deep (and keeps the labels it had). Rows are parsed one at a time into the bounded list: the file's text
        and the kept labels are all the memory it takes."""
        path = os.path.join(folder, FILE_NAME)
        if not os.path.exists(path):
            return 0
        try:
            data = read_regular(path, MAX_FILE_BYTES)
            bounded_json.check_depth(data, MAX_DEPTH)
            text = data.decode("utf-8")
            del data
            fields, got = _read_file(text, path, self._labels.maxlen)
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: unreadable ({e})") from None
        except ValueError as e:
            raise ValueError(f"{path}: unreadable ({e})" if not str(e).startswith(path) else str(e)) from None
        if fields.get("format") != FORMAT or "labels" not in fields:
            raise ValueError(f"{path}: not an error-bound file of format {FORMAT}")
        if fields.get("digest") != digest:
            raise ValueError(f"{path}: written by a process computing other bits (digest {fields.get('digest')!r})")
        with self._lock:
            self._labels.clear()
            self._labels.extend(got)
            self.changes = 0
        return len(got)


_WS = re.compile(r"[ \t\n\r]*")


def _label(row, path: str) -> Label:
    if (not isinstance(row, list) or len(row) != 5 or row[0] not in TIERS or not isinstance(row[1], str)
            or not isinstance(row[2], str) or len(row[1]) > MAX_NAME_CHARS or len(row[2]) > MAX_NAME_CHARS
            or isinstance(row[3], bool) or not isinstance(row[3], (int, float))
            or not 0.0 <= float(row[3]) <= 1.0 + 1e-6 or row[4] not in (0, 1) or isinstance(row[4], float)):
        raise ValueError(f"{path}: malformed label {str(row)[:80]}")
    return Label(row[0], sys.intern(row[1]), row[2], float(row[3]), bool(row[4]))  # scopes repeat: one copy


def _read_file(text: str, path: str, keep: int | None) -> tuple[dict, collections.deque]:
    """({field: value} of the top-level object, with "labels" present as True, the newest `keep` labels). The text
    is depth-checked already; each row is decoded alone, so no list of every row is ever built."""
    dec = bounded_json.decoder()
    fields: dict = {}
    labels: collections.deque = collections.deque(maxlen=keep)

    def at(i: int) -> tuple[int, str]:
        i = _WS.match(text, i).end()  # type: ignore[union-attr]  # [ \t\n\r]* matches at every position
        return i, text[i:i + 1]

    def expect(i: int, ch: str) -> int:
        i, c = at(i)
        if c != ch:
            raise ValueError(f"expected {ch!r} at character {i}, found {c or 'the end'!r}")
        return i + 1

    i = expect(0, "{")
    i, c = at(i)
    while c != "}":
        key, i = dec.raw_decode(text, i)
        if not isinstance(key, str):
            raise ValueError(f"a key that is not a string at character {i}")
        i, c = at(expect(i, ":"))
        if key == "labels" and c == "[":
            fields["labels"] = True
            i, c = at(i + 1)
            while c != "]":
                row, i = dec.raw_decode(text, i)
                labels.append(_label(row, path))
                i, c = at(i)
                if c == ",":
                    i, c = at(i + 1)
                    if c == "]":
                        raise ValueError(f"a trailing ',' at character {i}")
                elif c != "]":
                    raise ValueError(f"expected ',' or ']' at character {i}")
            i += 1
        else:
            fields[key], i = dec.raw_decode(text, i)
        i, c = at(i)
        if c == ",":
            i, c = at(i + 1)
            if c == "}":
                raise ValueError(f"a trailing ',' at character {i}")
        elif c != "}":
            raise ValueError(f"expected ',' or '}}' at character {i}")
    if at(i + 1)[1]:
        raise ValueError(f"text after the object at character {at(i + 1)[0]}")
    return fields, labels
