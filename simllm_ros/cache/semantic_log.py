"""A rotating JSON Lines log of every reuse decision, so a wrong answer can be traced to the cached task it came from.

Each record holds the request itself (prompt, context, messages), so the log also tells which tasks are asked
most: `most_used()` reads it back for `warmup_queries: N` (records written by a warm-up say so and do not count).
"""
from __future__ import annotations

import collections
import json
import logging
import logging.handlers
import os
import time

from ..request import ChatTurn, QueryRequest

BACKUPS = 3


class SemanticLog:
    def __init__(self, path: str, max_bytes: int = 5 * 2**20, backups: int = BACKUPS):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._logger = logging.Logger(f"simllm_ros.semantic_log.{id(self)}")
        self._handler = logging.handlers.RotatingFileHandler(path, maxBytes=max_bytes, backupCount=backups,
                                                             encoding="utf-8")
        self._handler.setFormatter(logging.Formatter("%(message)s"))
        self._logger.addHandler(self._handler)
        self._logger.propagate = False
        self._logger.setLevel(logging.INFO)

    def write(self, record: dict) -> None:
        self._logger.info(json.dumps({"time": round(time.time(), 3), **record}, ensure_ascii=False))

    def close(self) -> None:
        self._handler.close()
        self._logger.removeHandler(self._handler)


def request_record(req: QueryRequest) -> dict:
    """The task a request asks (scope, context, conversation, prompt), as the log and the fleet store keep it."""
    return {"scope": req.scope, "prompt": req.prompt, "context": req.context,
            **({"messages": [[t.role, t.content] for t in req.messages]} if req.messages else {})}


def request_from_record(d: dict, request_id: str) -> QueryRequest:
    """The request back from its record (ValueError, TypeError, KeyError on a malformed one)."""
    messages = [ChatTurn(str(r), str(c)) for r, c in d.get("messages", [])]
    scope = str(d.get("scope", ""))
    return QueryRequest(prompt=str(d["prompt"]), context=str(d.get("context", "")),
                        cache_scope="" if scope == "default" else scope, messages=messages, request_id=request_id)


def most_used(path: str, n: int, backups: int = BACKUPS) -> list[QueryRequest]:
    """The n tasks asked most often in the log at `path` (and its rotated files), most asked first, ties by
    the latest ask; a task is (scope, context, conversation, prompt). Warm-up records do not count; records
    of older versions without the request's text are skipped. Unreadable files or lines are skipped."""
    counts: collections.Counter = collections.Counter()
    last: dict[str, float] = {}
    requests: dict[str, QueryRequest] = {}
    for p in [f"{path}.{i}" for i in range(backups, 0, -1)] + [path]:
        try:
            f = open(p, encoding="utf-8")
        except OSError:
            continue
        with f:
            for line in f:
                try:
                    d = json.loads(line)
                    if d.get("warmup") or "prompt" not in d:
                        continue
                    key = json.dumps([d.get("scope", ""), d.get("context", ""), d.get("messages", []), d["prompt"]],
                                     ensure_ascii=False)
                    if key not in requests:
                        requests[key] = request_from_record(d, f"warmup:{len(requests) + 1}")
                    counts[key] += 1
                    last[key] = float(d.get("time", 0.0))
                except (ValueError, TypeError, KeyError, AttributeError):
                    continue
    order = sorted(counts, key=lambda k: (-counts[k], -last[k]))
    return [requests[k] for k in order[:max(0, int(n))]]
