"""What a fleet of nodes shares through Redis: answers (drafts), exact-prefix KV blocks, the tasks asked most.

Sharing is safe because nothing shared is trusted blindly:
- an answer from the store is only a draft for verified decoding: the model checks every token, so a wrong,
  stale or foreign answer costs a pass, never a wrong answer;
- a KV block is used only where the writer's numerics digest (model, dtype, kernels: the bits) is this node's,
  and its blob's MAC checks out for this very key: the MAC covers the key, the header and the payload, so a
  damaged, truncated, foreign-digest or other-scope blob is refused (and counted, with a log line).
Scope walls: every key of a scope sits under a tag that is an HMAC of the scope with the fleet secret, so a
scope's keys are reachable only by a node that knows both, and Redis ACLs can limit a user to its tags.

The store never makes a node worse: every call is bounded by fleet_timeout_ms (socket timeouts, no retries),
a failed call opens a breaker (the next calls skip the store at once; the writer thread pings it again after
a pause of 0.25 s growing to 2 s), and writes run on a background thread with a bounded queue (dropped, and counted, when it is full).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from .fleet_blob import DEFAULT_SECRET, BlobRefused, read_secret, scope_tag, seal, unseal

BLOCK_TOKENS = 32  # tokens per shared KV block: the granularity of shared prefixes across prompts
MAX_QUEUE = 64
RECENT_PER_SCOPE = 256  # answers with fingerprints listed per scope: other nodes' drafts for similar questions
MIRROR_REFRESH_S = 2.0  # a scope's listed answers are read again this often while the node asks in it
MIRROR_SCOPES = 64  # scopes mirrored at most (those asked in most recently)
_BACKOFF_S = (0.25, 0.5, 1.0, 2.0)


def _ids_bytes(tokens) -> bytes:
    return np.asarray(tokens, dtype="<i4").tobytes()


def _redact(url: str) -> str:
    """The URL without a password (never logged)."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"
    return url


@dataclass
class FleetPrefix:
    """KV of the first n_tokens of a prompt, fetched from the fleet (bitwise what this node would compute)."""
    k: torch.Tensor  # [L, H, n, D] (views of buffers with room for `capacity` tokens)
    v: torch.Tensor
    n_tokens: int
    fetch_ms: float
    entry_keys: tuple = ()
    source_question: str = "(fleet)"

    @property
    def source_key(self):
        return None


@dataclass
class FleetCounters:
    answers_found: int = 0
    answers_missed: int = 0
    kv_fetches: int = 0
    kv_tokens_fetched: int = 0
    kv_skipped_slower: int = 0
    refused: int = 0
    published_answers: int = 0
    published_blocks: int = 0
    writes_dropped: int = 0
    errors: int = 0  # failed calls on a request's path (each cost it at most fleet_timeout_ms)
    write_errors: int = 0  # failed calls of the background writer


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


class FleetStore:
    """One node's view of the fleet store. `digest` names the arithmetic (the numerics digest with the dtype and
    KV geometry): answers and KV are shared only between nodes with the same one."""

    def __init__(self, url: str, *, digest: str, kv_shape, dtype: torch.dtype, namespace: str = "simllm",
                 secret: bytes = DEFAULT_SECRET, password: str | None = None, timeout_ms: float = 50.0,
                 share_kv: bool = True, log: logging.Logger | None = None, client=None):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.log = log or logging.getLogger("simllm_ros.fleet_store")
        self.url, self.namespace, self.digest = _redact(url), namespace, digest
        self.secret, self.timeout_s, self.share_kv = secret, timeout_ms / 1000.0, share_kv
        self.kv_shape, self.dtype = kv_shape, dtype
        self._elem = torch.empty((), dtype=dtype).element_size()
        L, H, D = kv_shape.layers, kv_shape.kv_heads, kv_shape.head_dim
        self.bytes_per_token = 2 * L * H * D * self._elem
        opts = dict(socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s,
                    retry=Retry(NoBackoff(), 0), retry_on_timeout=False, health_check_interval=0)
        if password:
            opts["password"] = password
        self.redis = client or redis.Redis.from_url(url, **opts)
        self.counters = FleetCounters()
        self.breaker = _Breaker()
        self.reconnects: list[float] = []  # seconds down, per recovery
        # Transfer model for the fetch-or-prefill decision: a round trip, and bytes per second (learnt).
        self.rtt_s, self.bytes_per_s = 0.0005, 200e6
        # Other nodes' answers per scope with their fingerprints, read in the background (no wait on a request).
        self._mirror: dict[str, tuple[float, np.ndarray, list[list[int]]]] = {}
        self._wanted: dict[str, float] = {}  # scope -> when this node last asked for its similar answers
        self._mirror_lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=MAX_QUEUE)
        self._closing = threading.Event()
        self._writer = threading.Thread(target=self._write_loop, name="fleet-writer", daemon=True)
        self._writer.start()

    # ---- keys ---------------------------------------------------------------------------------------
    def _scope_key(self, scope: str, *parts: str) -> str:
        return ":".join((self.namespace, "s", scope_tag(self.secret, scope), *parts))

    def _answer_key(self, scope: str, tokens: list[int]) -> str:
        return self._scope_key(scope, "ans", self.digest, hashlib.sha256(_ids_bytes(tokens)).hexdigest()[:32])

    def block_keys(self, scope: str, tokens: list[int], n_blocks: int) -> list[str]:
        """Keys of the first n_blocks full blocks: a hash chained over the digest and every token before."""
        h = hmac.new(self.secret, b"kv\0" + self.digest.encode() + b"\0" + scope.encode(), hashlib.sha256).digest()
        keys = []
        for i in range(n_blocks):
            h = hashlib.sha256(h + _ids_bytes(tokens[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS])).digest()
            keys.append(self._scope_key(scope, "kv", h.hex()[:40]))
        return keys

    # ---- calls with a bound -------------------------------------------------------------------------
    def _call(self, what: str, fn: Callable, write: bool = False):
        """fn() against Redis, or None at once while the breaker is open / on any failure (logged, counted)."""
        if self.breaker.open():
            return None
        try:
            out = fn()
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
        return bool(self._call("ping", self.redis.ping))

    def measure_link(self) -> None:
        """A round trip and a 1 MB read, timed: the starting point of the fetch-or-prefill estimate."""
        key = ":".join((self.namespace, "probe", hashlib.sha256(str(time.time()).encode()).hexdigest()[:12]))
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
        got = self._call("link probe", probe)
        if got:
            self.rtt_s = max(got[0], 1e-5)
            self.bytes_per_s = max(len(blob) / max(got[1] - got[0], 1e-6), 1e6)

    # ---- reads on a request's path: one round trip, then the blocks worth fetching ----------------------
    def lookup(self, scope: str, tokens: list[int], *, have: int, limit: int, capacity: int,
               prefill_s_per_token: float, want_kv: bool) -> tuple[FleetPrefix | None, list[int] | None]:
        """What the fleet holds for this prompt: (KV of a prefix longer than the `have` tokens this node holds,
        within tokens[:limit], fetched where that is estimated faster than prefilling it; token ids of another
        node's answer to exactly this prompt, a draft). One round trip asks for both; a store that fails it
        is skipped for the rest of the request (the breaker)."""
        akey = self._answer_key(scope, tokens)
        n_blocks = limit // BLOCK_TOKENS if (want_kv and self.share_kv) else 0
        first = have // BLOCK_TOKENS  # whole blocks this node holds (a partial one is fetched again)
        keys = self.block_keys(scope, tokens, n_blocks) if n_blocks > first else []

        def ask():
            pipe = self.redis.pipeline(transaction=False)
            pipe.get(akey)
            for k in keys[first:]:
                pipe.exists(k)
            return pipe.execute()
        t0 = time.perf_counter()
        got = self._call("lookup", ask)
        if got is None:
            return None, None
        answer = self._answer_ids(akey, got[0])
        run = first
        for e in got[1:]:
            if not e:
                break
            run += 1
        prefix = None
        if run * BLOCK_TOKENS > have:
            prefix = self._fetch_blocks(tokens, keys[:run], have, capacity, prefill_s_per_token, t0)
        return prefix, answer

    def _answer_ids(self, key: str, blob) -> list[int] | None:
        if blob is None:
            self.counters.answers_missed += 1
            return None
        try:
            header, _ = unseal(self.secret, key, blob)
            if header.get("kind") != "answer" or header.get("digest") != self.digest:
                raise BlobRefused("not an answer of this model")
            ids = [int(t) for t in header["ids"]]
        except (BlobRefused, KeyError, TypeError, ValueError) as e:
            self._refuse(key, e)
            return None
        self.counters.answers_found += 1
        return ids

    def similar_answers(self, scope: str, fingerprint, min_cosine: float, k: int = 2) -> list[list[int]]:
        """Token ids of the fleet's answers to the k questions of this scope most similar to this one (cosine
        at least min_cosine), from the background mirror: no wait on the store. Drafts, checked by the model."""
        now = time.monotonic()
        with self._mirror_lock:
            self._wanted[scope] = now
            if len(self._wanted) > MIRROR_SCOPES:
                self._wanted.pop(min(self._wanted, key=self._wanted.get))
            got = self._mirror.get(scope)
        if got is None or not len(got[2]):
            return []
        fp = np.asarray(fingerprint, dtype=np.float32).reshape(-1)
        if got[1].shape[1] != fp.shape[0]:
            return []
        cos = got[1] @ fp
        order = np.argsort(-cos)[:k]
        return [got[2][i] for i in order if cos[i] >= min_cosine]

    def mirrored(self, scope: str) -> int:
        """How many of the fleet's answers this node holds for a scope's similar-question drafts."""
        with self._mirror_lock:
            got = self._mirror.get(scope)
        return len(got[2]) if got else 0

    def _refresh_mirrors(self) -> None:
        now = time.monotonic()
        with self._mirror_lock:
            todo = [sc for sc, t in self._wanted.items() if now - t < 60.0
                    and now - self._mirror.get(sc, (0.0,))[0] >= MIRROR_REFRESH_S]
            for sc in [sc for sc in self._mirror if sc not in self._wanted]:
                del self._mirror[sc]
        for scope in todo:
            lkey = self._scope_key(scope, "recent", self.digest)
            items = self._call("answers read", lambda: self.redis.lrange(lkey, 0, RECENT_PER_SCOPE - 1), write=True)
            if items is None:
                return
            fps, ids, seen = [], [], set()
            for item in items:
                try:
                    header, payload = unseal(self.secret, lkey, item)
                    if header.get("kind") != "recent" or header.get("digest") != self.digest:
                        raise BlobRefused("not an answer of this model")
                    answer = tuple(int(t) for t in header["ids"])
                    fp = np.frombuffer(payload, dtype="<f2").astype(np.float32)
                except (BlobRefused, KeyError, TypeError, ValueError) as e:
                    self._refuse(lkey, e)
                    continue
                if answer in seen or (fps and fp.shape != fps[0].shape):
                    continue
                seen.add(answer)
                fps.append(fp)
                ids.append(list(answer))
            with self._mirror_lock:
                self._mirror[scope] = (time.monotonic(), np.stack(fps) if fps else np.zeros((0, 0), np.float32), ids)

    def _fetch_blocks(self, tokens: list[int], keys: list[str], have: int, capacity: int,
                      prefill_s_per_token: float, t0: float) -> FleetPrefix | None:
        """The blocks behind `keys` (a run from the prompt's start), where fetching them is estimated faster than
        prefilling the tokens they add; stops early, keeping the blocks fetched, when the fetch runs past that
        estimate. A refused block ends the run there."""
        run = len(keys)
        block_bytes = BLOCK_TOKENS * self.bytes_per_token
        est_fetch = self.rtt_s + (run * block_bytes) / self.bytes_per_s
        est_prefill = (run * BLOCK_TOKENS - have) * prefill_s_per_token
        if est_fetch >= est_prefill:
            self.counters.kv_skipped_slower += 1
            return None
        L, H, D = self.kv_shape.layers, self.kv_shape.kv_heads, self.kv_shape.head_dim
        k = torch.empty((L, H, max(capacity, run * BLOCK_TOKENS), D), dtype=self.dtype)
        v = torch.empty_like(k)
        n, t_fetch = 0, time.perf_counter()
        per_round = max(1, int(8 * 2**20 // block_bytes))  # ~8 MB a round trip
        for start in range(0, run, per_round):
            batch = keys[start:start + per_round]
            blobs = self._call("kv fetch", lambda: self.redis.mget(batch))
            if not blobs:
                break
            for i, (key, blob) in enumerate(zip(batch, blobs)):
                b = start + i
                sl = slice(b * BLOCK_TOKENS, (b + 1) * BLOCK_TOKENS)
                try:
                    kb, vb = self._block_tensors(key, blob, tokens[sl])
                except BlobRefused as e:
                    self._refuse(key, e)
                    break
                k[:, :, sl], v[:, :, sl] = kb, vb
                n = (b + 1) * BLOCK_TOKENS
            if n < (start + len(batch)) * BLOCK_TOKENS or time.perf_counter() - t0 > est_prefill:
                break
        if n > 0:
            dt = time.perf_counter() - t_fetch
            self.bytes_per_s = 0.7 * self.bytes_per_s + 0.3 * max(n * self.bytes_per_token / max(dt, 1e-6), 1e6)
        if n <= have:
            return None
        self.counters.kv_fetches += 1
        self.counters.kv_tokens_fetched += n - have
        return FleetPrefix(k[:, :, :n], v[:, :, :n], n, (time.perf_counter() - t0) * 1000)

    def _block_tensors(self, key: str, blob, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        if blob is None:
            raise BlobRefused("gone (evicted between lookup and fetch)")
        header, payload = unseal(self.secret, key, blob)
        L, H, D = self.kv_shape.layers, self.kv_shape.kv_heads, self.kv_shape.head_dim
        if header.get("kind") != "kv" or header.get("digest") != self.digest:
            raise BlobRefused(f"foreign numerics digest {header.get('digest')!r} (this node: {self.digest})")
        if header.get("tokens") != list(tokens):
            raise BlobRefused("tokens differ from the prompt's")
        if len(payload) != 2 * L * H * BLOCK_TOKENS * D * self._elem:
            raise BlobRefused(f"payload of {len(payload)} bytes, expected {2 * L * H * BLOCK_TOKENS * D * self._elem}")
        t = torch.frombuffer(bytearray(payload), dtype=self.dtype).view(2, L, H, BLOCK_TOKENS, D)
        return t[0], t[1]

    def _refuse(self, key: str, e: BaseException) -> None:
        self.counters.refused += 1
        self.log.warning(f"fleet store: refused {key.rsplit(':', 1)[-1][:12]}: {e}")

    # ---- writes (background) ------------------------------------------------------------------------
    def publish(self, scope: str, tokens: list[int], *, answer_ids: list[int] | None, question: str,
                task: dict | None, read_kv: Callable[[int], tuple[torch.Tensor, torch.Tensor] | None] | None,
                fingerprint=None) -> None:
        """After a finished exact answer, off the request's path: the answer (a draft for the fleet), the
        prompt's full KV blocks (read_kv(n) gives this node's exact KV of tokens[:n], or None), and one more ask
        of the task. Dropped (counted) when the writer is behind or the store is down."""
        if self.breaker.open():
            self.counters.writes_dropped += 1
            return
        try:
            self._queue.put_nowait((scope, list(tokens), answer_ids, question, task, read_kv, fingerprint))
        except queue.Full:
            self.counters.writes_dropped += 1

    def _write_loop(self) -> None:
        """The writer; while the store is down it also pings it when the pause is over, so the node sees the
        store back without waiting for a request."""
        while not self._closing.is_set():
            try:
                job = self._queue.get(timeout=0.05)
            except queue.Empty:
                if self.breaker.failures and not self.breaker.open():
                    self._call("ping", self.redis.ping, write=True)
                elif not self.breaker.failures:
                    self._refresh_mirrors()
                continue
            if job is None:
                self._queue.task_done()
                break
            try:
                self._write(*job)
            except Exception as e:  # noqa: BLE001 - a write failure must not end the writer
                self.log.warning(f"fleet store write failed: {type(e).__name__}: {e}")
            finally:
                self._queue.task_done()

    def _write(self, scope, tokens, answer_ids, question, task, read_kv, fingerprint) -> None:
        if self.breaker.open():
            self.counters.writes_dropped += 1
            return
        if answer_ids:
            key = self._answer_key(scope, tokens)
            blob = seal(self.secret, key, {"kind": "answer", "digest": self.digest, "ids": list(answer_ids),
                                           "question": question[:500]}, b"")

            lkey = self._scope_key(scope, "recent", self.digest)

            def put():
                pipe = self.redis.pipeline(transaction=False)
                pipe.set(key, blob)
                if fingerprint is not None:
                    fp = np.asarray(fingerprint, dtype="<f2").reshape(-1).tobytes()
                    pipe.lpush(lkey, seal(self.secret, lkey, {"kind": "recent", "digest": self.digest,
                                                              "ids": list(answer_ids)}, fp))
                    pipe.ltrim(lkey, 0, RECENT_PER_SCOPE - 1)
                return pipe.execute()
            if self._call("answer write", put, write=True) is not None:
                self.counters.published_answers += 1
        if task is not None:
            tid = hashlib.sha256(json.dumps(task, sort_keys=True).encode()).hexdigest()[:24]
            tag = scope_tag(self.secret, scope)
            tkey = self._scope_key(scope, "task", tid)
            tblob = seal(self.secret, tkey, {"kind": "task", "task": task}, b"")

            def count():
                pipe = self.redis.pipeline(transaction=False)
                pipe.set(tkey, tblob)
                pipe.zincrby(f"{self.namespace}:asked", 1, f"{tag}:{tid}")
                return pipe.execute()
            self._call("task count", count, write=True)
        if read_kv is not None and self.share_kv:
            self._write_blocks(scope, tokens, read_kv)

    def _write_blocks(self, scope, tokens, read_kv) -> None:
        n_blocks = (len(tokens) - 1) // BLOCK_TOKENS  # a fetcher keeps the last prompt token to compute
        if n_blocks == 0:
            return
        keys = self.block_keys(scope, tokens, n_blocks)

        def exists():
            pipe = self.redis.pipeline(transaction=False)
            for k in keys:
                pipe.exists(k)
            return pipe.execute()
        have = self._call("kv lookup", exists, write=True)
        if have is None:
            return
        missing = [i for i, e in enumerate(have) if not e]
        if not missing:
            return
        kv = read_kv(n_blocks * BLOCK_TOKENS)
        if kv is None:
            return
        k, v = kv
        for start in range(0, len(missing), 8):
            pipe = self.redis.pipeline(transaction=False)
            for b in missing[start:start + 8]:
                sl = slice(b * BLOCK_TOKENS, (b + 1) * BLOCK_TOKENS)
                payload = torch.stack((k[:, :, sl], v[:, :, sl])).contiguous().view(torch.uint8).numpy().tobytes()
                pipe.set(keys[b], seal(self.secret, keys[b], {"kind": "kv", "digest": self.digest,
                                                              "tokens": list(tokens[sl])}, payload))
            if self._call("kv write", pipe.execute, write=True) is None:
                return
            self.counters.published_blocks += min(8, len(missing) - start)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until the writer has nothing queued (tests, benchmarks, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    # ---- the tasks the fleet asks most ----------------------------------------------------------------
    def most_asked(self, n: int) -> list[dict]:
        """The n tasks asked most across the fleet (this node's readable scopes), most asked first."""
        top = self._call("most asked", lambda: self.redis.zrevrange(f"{self.namespace}:asked", 0, max(0, 4 * n - 1)))
        out = []
        for member in top or []:
            tag, _, tid = member.decode().partition(":")
            key = ":".join((self.namespace, "s", tag, "task", tid))
            blob = self._call("task read", lambda: self.redis.get(key))
            if blob is None:
                continue
            try:
                header, _ = unseal(self.secret, key, blob)
                task = header["task"]
                if not isinstance(task, dict):
                    raise BlobRefused("task is not an object")
            except (BlobRefused, KeyError) as e:
                self._refuse(key, e)
                continue
            out.append(task)
            if len(out) >= n:
                break
        return out

    # ---- telemetry / shutdown -----------------------------------------------------------------------
    def status(self) -> dict:
        """Plain values for /diagnostics (no password: the URL is redacted)."""
        c = self.counters
        return {"fleet_store": self.state, "fleet_url": self.url, "fleet_last_error": self.breaker.last_error,
                "fleet_answers_found": c.answers_found, "fleet_kv_fetches": c.kv_fetches,
                "fleet_kv_tokens_fetched": c.kv_tokens_fetched, "fleet_refused_blobs": c.refused,
                "fleet_published_answers": c.published_answers, "fleet_published_blocks": c.published_blocks,
                "fleet_writes_dropped": c.writes_dropped, "fleet_errors": c.errors + c.write_errors}

    def close(self) -> None:
        self._closing.set()
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
        self._writer.join(timeout=2.0)
        try:
            self.redis.close()
        except Exception:  # noqa: BLE001
            pass


def read_password(password: str, path: str) -> str | None:
    if path:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    return password or None



def node_digest(numerics: str, dtype: torch.dtype, kv_shape, store_dtype: torch.dtype) -> str:
    """What decides the bits of this node's KV and answers: the numerics digest (model, kernels, arithmetic),
    the compute dtype, the KV geometry and the pool's storage precision."""
    what = json.dumps([numerics, str(dtype), kv_shape.to_dict(), str(store_dtype)], sort_keys=True)
    return hashlib.sha256(what.encode()).hexdigest()[:16]


def open_store(settings, *, digest: str, kv_shape, dtype: torch.dtype, share_kv: bool,
               log: logging.Logger | None = None) -> FleetStore:
    """The store the settings name (fleet_*); raises ValueError for an unreadable secret or password file."""
    s = settings
    try:
        secret = read_secret(s.fleet_secret_file)
        password = read_password(s.fleet_password, s.fleet_password_file)
    except OSError as e:
        raise ValueError(f"fleet store: {e}") from None
    return FleetStore(s.fleet_store_url, digest=digest, kv_shape=kv_shape, dtype=dtype,
                      namespace=s.fleet_namespace, secret=secret, password=password,
                      timeout_ms=s.fleet_timeout_ms, share_kv=s.fleet_share_kv and share_kv, log=log)
