"""The fleet store's wire: one Redis connection whose every call is bounded, and reads bounded by size.

Why apart from the store (fleet_store): what to share, trust and refuse is the store's policy; how a call to Redis
is made so that it never makes a node worse is this module's job, the same for every call:
- bounded in time: socket timeouts of fleet_timeout_ms, no retries; a failed call opens a breaker (the next calls
  skip the store at once until a pause of 0.25 s growing to 2 s is over), counted and logged once;
- bounded in size: a value is measured on the server (MEMORY USAGE) or trimmed by a server-side script before it
  is sent, so one 50 MB item is never read; a key of another type reads as empty.
"""
from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

_BACKOFF_S = (0.25, 0.5, 1.0, 2.0)
# The highest members of a sorted set with those over a byte bound left out on the server (false -> nil): an
# oversized member is never sent. Where scripts are not allowed, MEMORY USAGE bounds the whole set instead.
_TOP_MEMBERS = """
local got = redis.call('ZREVRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1)
local limit = tonumber(ARGV[2])
local out = {}
for i, item in ipairs(got) do
  if string.len(item) <= limit then out[i] = item else out[i] = false end
end
return out
"""


def _redact(url: str) -> str:
    """The URL without a password (never logged)."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"
    return url


@dataclass
class _Breaker:
    """Skip the store at once after a failure; try again after a growing pause."""
    down_since: float = 0.0
    retry_at: float = 0.0
    failures: int = 0
    last_error: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def open(self) -> bool:
        return self.failures > 0 and time.monotonic() < self.retry_at

    def fail(self, e: BaseException) -> None:
        with self.lock:
            now = time.monotonic()
            if self.failures == 0:
                self.down_since = now
            self.retry_at = now + _BACKOFF_S[min(self.failures, len(_BACKOFF_S) - 1)]
            self.failures += 1
            self.last_error = f"{type(e).__name__}: {e}"[:200]

    def ok(self) -> float | None:
        """Mark a success; the seconds the store was down if it just came back."""
        with self.lock:
            if self.failures == 0:
                return None
            down = time.monotonic() - self.down_since
            self.failures, self.retry_at = 0, 0.0
            return down


class FleetLink:
    """The connection to `url`. `counters` (the store's FleetCounters) gets a failed call counted in `errors`
    (on a request's path) or `write_errors` (the background writer)."""

    def __init__(self, url: str, *, counters, password: str | None = None, timeout_ms: float = 50.0,
                 log: logging.Logger | None = None, client=None):
        # local: redis (~0.1 s, 200 modules) loads with a fleet store's connection, not with the module
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.log = log or logging.getLogger("simllm_ros.fleet_store")
        self.url, self.timeout_s, self.counters = _redact(url), timeout_ms / 1000.0, counters
        opts = dict(socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s,
                    retry=Retry(NoBackoff(), 0), retry_on_timeout=False, health_check_interval=0)
        if password:
            opts["password"] = password
        self.redis = client or redis.Redis.from_url(url, **opts)
        self.breaker = _Breaker()
        self.reconnects: list[float] = []  # seconds down, per recovery
        self._top_script = self.redis.register_script(_TOP_MEMBERS)
        self.scripts = True  # False once the server refused the script (ACL, scripting off): MEMORY USAGE then

    def call(self, what: str, fn: Callable, write: bool = False):
        """fn() against Redis, or None at once while the breaker is open / on any failure (logged, counted)."""
        # local: redis loads with the connection (see __init__)
        from redis.exceptions import ResponseError

        if self.breaker.open():
            return None
        try:
            out = fn()
        except ResponseError as e:  # the store answered: a refused command or a value of the wrong type
            if write:
                self.counters.write_errors += 1
            else:
                self.counters.errors += 1
            self.log.warning(f"fleet store: {what} refused by the server ({e}); skipped")
            return None
        except Exception as e:  # noqa: BLE001 - the store must never fail a request
            first = self.breaker.failures == 0
            self.breaker.fail(e)
            if write:
                self.counters.write_errors += 1
            else:
                self.counters.errors += 1
            if first:
                self.log.warning(f"fleet store {self.url} unreachable during {what} ({type(e).__name__}: {e}); "
                                 "requests go on without it; it is tried again after a pause")
            return None
        down = self.breaker.ok()
        if down is not None:
            self.reconnects.append(down)
            self.log.info(f"fleet store {self.url} reachable again after {down:.1f} s")
        return out

    @property
    def state(self) -> str:
        return "unreachable" if self.breaker.failures else "connected"

    def ping(self) -> bool:
        return bool(self.call("ping", self.redis.ping))

    def measure(self, namespace: str) -> tuple[float, float] | None:
        """(a round trip's seconds, bytes per second of a 1 MB read), timed on a key of its own under
        `namespace`; None where the store fails it."""
        key = ":".join((namespace, "probe", hashlib.sha256(str(time.time()).encode()).hexdigest()[:12]))
        blob = b"\0" * (1 << 20)

        def probe():
            self.redis.set(key, blob, ex=30)
            t0 = time.perf_counter()
            self.redis.ping()
            t1 = time.perf_counter()
            self.redis.get(key)
            t2 = time.perf_counter()
            self.redis.delete(key)
            return t1 - t0, t2 - t1
        got = self.call("link probe", probe)
        if not got:
            return None
        return max(got[0], 1e-5), max(len(blob) / max(got[1] - got[0], 1e-6), 1e6)

    # ---- reads bounded by size (run inside call(): a failure there is the breaker's) ---------------------
    def server_size(self, key: str) -> int | None:
        """The key's size as the server measures it (MEMORY USAGE: nothing is sent), or None where that is not
        allowed (ACL): then it is read as is, and the socket timeout still bounds the call."""
        # local: redis loads with the connection (see __init__)
        from redis.exceptions import ResponseError

        try:
            return self.redis.memory_usage(key, samples=0)
        except ResponseError:
            return None

    @staticmethod
    def read_typed(read) -> list:
        """read() as a list, where a key of another type (WRONGTYPE) reads as empty."""
        # local: redis loads with the connection (see __init__)
        from redis.exceptions import ResponseError

        try:
            return list(read())
        except ResponseError as e:
            if "WRONGTYPE" in str(e):
                return []
            raise

    def top_members(self, zkey: str, n: int, max_member: int, max_set: int,
                    oversized: Callable[[int], None]) -> list:
        """The n highest members of a sorted set, each as bytes, or None where it is over max_member bytes (left
        out by a server-side script: never sent). Where the server refuses scripts: the set read if MEMORY USAGE
        puts it within max_set, else nothing (oversized(size) is told). A key of another type reads as empty."""
        # local: redis loads with the connection (see __init__)
        from redis.exceptions import ResponseError

        if self.scripts:
            try:
                return list(self._top_script(keys=[zkey], args=[n, max_member]))
            except ResponseError as e:
                if "WRONGTYPE" in str(e):
                    return []
                self.scripts = False
                self.log.warning(f"fleet store: scripts refused ({e}); the asked-most set is bounded by MEMORY USAGE "
                                 "instead")
        size = self.server_size(zkey)
        if size is not None and size > max_set:
            oversized(size)
            return []
        return self.read_typed(lambda: self.redis.zrevrange(zkey, 0, n - 1))
