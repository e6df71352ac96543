"""What a fleet of nodes shares through Redis: answers (drafts), exact-prefix KV blocks, the tasks asked most.

Sharing is safe because nothing shared is trusted blindly:
- an answer from the store is only a draft for verified decoding: the model checks every token, so a wrong,
  stale or foreign answer costs a pass, never a wrong answer;
- a KV block is used only where the writer's numerics digest (model, dtype, kernels: the bits) is this node's,
  and its blob's MAC checks out for this very key: the MAC covers the key, the header and the payload, so a
  damaged, truncated, foreign-digest or other-scope blob is refused (and counted, with a log line).
Scope walls: every key of a scope sits under a tag that is an HMAC of the scope with the fleet secret, so a
scope's keys are reachable only by a node that knows both, and Redis ACLs can limit a user to its tags.

The store never makes a node worse: every call is bounded by fleet_timeout_ms and a breaker (fleet_link, the
wire; the writer thread pings the store again when the breaker's pause is over), and writes run on a background
thread with a bounded queue (dropped, and counted, when it is full).

Nor can what another writer put in Redis (a forged entry, a faulty robot's) stop or mislead a node: every value is
read with a size bound (GETRANGE, STRLEN, or a server-side script that leaves out list and set members over their
bound, so one 50 MB item is never sent), parsed with depth and type limits (fleet_blob), and a value that fails is
a refusal (counted, logged), never an exception on a request or the writer thread; the writer is restarted, with a
WARN, should it ever die. KV blocks, the one shared thing used as exact, need a secret of the fleet's own
(fleet_secret_file: without it no KV is sealed or accepted, as anyone who can write to Redis could forge them), hold
finite values only, and the engine recomputes the last positions of a share of the prefixes it fetches
(fleet_kv_verify_rate): a prefix that differs from this node's bits is dropped, distrusted and deleted.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import queue
import random
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .fleet_blob import DEFAULT_SECRET, MAX_HEADER_BYTES, BlobRefused, read_secret, scope_tag, seal, token_ids, unseal
from .fleet_link import FleetLink

BLOCK_TOKENS = 32  # tokens per shared KV block: the granularity of shared prefixes across prompts
MAX_QUEUE = 64
RECENT_PER_SCOPE = 256  # answers with fingerprints listed per scope: other nodes' drafts for similar questions
MIRROR_REFRESH_S = 2.0  # a scope's listed answers are read again this often while the node asks in it
MIRROR_SCOPES = 64  # scopes mirrored at most (those asked in most recently)
# Size bounds of what is read (an honest value is far below each): more is never read whole.
MAX_ANSWER_BLOB = MAX_HEADER_BYTES + 1024
MAX_RECENT_ITEM = MAX_HEADER_BYTES + 64 * 1024  # header and a float16 fingerprint
MAX_RECENT_LIST = 4 * 2**20  # a scope's whole recent list (MEMORY USAGE): 256 honest items take ~1 MB
MAX_ASKED_SET = 16 * 2**20  # the asked-most set, where the server refuses the script that bounds its members
MAX_TASK_BLOB = 4 * 2**20  # a task's record holds its context (max_prompt_tokens)
MAX_TASK_HEADER = MAX_TASK_BLOB - 1024
MAX_MEMBER = 64  # an asked-most member: "<scope tag 20 hex>:<task id 24 hex>"
MAX_DISTRUSTED = 4096  # KV keys this node no longer fetches (a recompute differed)
THREAD_WARN_S = 300.0  # a restarted writer shows in the health reasons this long
REFUSAL_LOG_S = 60.0  # the same refusal logged again after this long


def _ids_bytes(tokens) -> bytes:
    return np.asarray(tokens, dtype="<i4").tobytes()


@dataclass
class FleetPrefix:
    """KV of the first n_tokens of a prompt, fetched from the fleet (bitwise what this node would compute)."""
    k: torch.Tensor  # [L, H, n, D] (views of buffers with room for `capacity` tokens)
    v: torch.Tensor
    n_tokens: int
    fetch_ms: float
    entry_keys: tuple = ()  # (pool entries: none)
    source_question: str = "(fleet)"
    block_keys: tuple = ()  # the store's keys of the blocks fetched (dropped if the recompute differs)

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
    oversized: int = 0  # values left unread for their size (also counted in refused)
    kv_verified: int = 0  # fetched prefixes whose last positions this node recomputed
    kv_mismatches: int = 0  # ... and found different: dropped, distrusted, deleted
    thread_restarts: int = 0  # the writer died (a bug) and was started again


class FleetStore:
    """One node's view of the fleet store. `digest` names the arithmetic (the numerics digest with the dtype and
    KV geometry): answers and KV are shared only between nodes with the same one."""

    def __init__(self, url: str, *, digest: str, kv_shape, dtype: torch.dtype, namespace: str = "simllm",
                 secret: bytes = DEFAULT_SECRET, password: str | None = None, timeout_ms: float = 50.0,
                 share_kv: bool = True, verify_rate: float = 1.0, log: logging.Logger | None = None, client=None):
        self.log = log or logging.getLogger("simllm_ros.fleet_store")
        self.counters = FleetCounters()
        self.link = FleetLink(url, counters=self.counters, password=password, timeout_ms=timeout_ms, log=self.log,
                              client=client)
        self.redis, self.breaker, self.reconnects = self.link.redis, self.link.breaker, self.link.reconnects
        self.url, self.namespace, self.digest = self.link.url, namespace, digest
        self.secret, self.timeout_s = secret, self.link.timeout_s
        # KV is used as exact: only between holders of a secret of the fleet's own (the default one is public)
        self.kv_off_reason = ("" if secret != DEFAULT_SECRET else
                              "no fleet_secret_file: without a secret of the fleet's own anyone who can write to "
                              "Redis could forge KV blocks; answers are still shared as drafts the model checks")
        self.share_kv = share_kv and not self.kv_off_reason
        self.verify_rate, self._rng = verify_rate, random.Random()
        self._distrusted: dict[str, None] = {}  # KV keys not fetched again (insertion-ordered, bounded)
        self._logged: dict[str, float] = {}  # refusal line -> when it was last logged
        self.kv_shape, self.dtype = kv_shape, dtype
        self._elem = torch.empty((), dtype=dtype).element_size()
        L, H, D = kv_shape.layers, kv_shape.kv_heads, kv_shape.head_dim
        self.bytes_per_token = 2 * L * H * D * self._elem
        # Transfer model for the fetch-or-prefill decision: a round trip, and bytes per second (learnt).
        self.rtt_s, self.bytes_per_s = 0.0005, 200e6
        # Other nodes' answers per scope with their fingerprints, read in the background (no wait on a request).
        self._mirror: dict[str, tuple[float, np.ndarray, list[list[int]]]] = {}
        self._wanted: dict[str, float] = {}  # scope -> when this node last asked for its similar answers
        self._mirror_lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=MAX_QUEUE)
        self._closing = threading.Event()
        self._restart_lock = threading.Lock()
        self._writer_death, self._restarted_at = "", 0.0
        self._start_writer()

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

    # ---- calls with a bound (fleet_link) --------------------------------------------------------------
    def _call(self, what: str, fn: Callable, write: bool = False):
        """fn() against Redis, or None at once while the breaker is open / on any failure (logged, counted)."""
        return self.link.call(what, fn, write)

    @property
    def state(self) -> str:
        return self.link.state

    def ping(self) -> bool:
        return self.link.ping()

    def measure_link(self) -> None:
        """A round trip and a 1 MB read, timed: the starting point of the fetch-or-prefill estimate."""
        got = self.link.measure(self.namespace)
        if got:
            self.rtt_s, self.bytes_per_s = got

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
            pipe.getrange(akey, 0, MAX_ANSWER_BLOB)  # at most the bound + 1 byte, however large the value
            for k in keys[first:]:
                pipe.strlen(k)  # 0: not there; its size is checked before it is read
            return pipe.execute(raise_on_error=False)
        t0 = time.perf_counter()
        got = self._call("lookup", ask)
        if got is None:
            return None, None
        answer = self._answer_ids(akey, got[0])
        run, most = first, self._block_bound()
        for key, e in zip(keys[first:], got[1:]):
            if not isinstance(e, int) or e <= 0 or key in self._distrusted:
                break
            if e > most:
                self._refuse(key, BlobRefused(f"KV block of {e} bytes, more than {most}: not read"), oversized=True)
                break
            run += 1
        prefix = None
        if run * BLOCK_TOKENS > have:
            prefix = self._fetch_blocks(tokens, keys[:run], have, capacity, prefill_s_per_token, t0)
        return prefix, answer

    def _answer_ids(self, key: str, blob) -> list[int] | None:
        if not blob or not isinstance(blob, bytes):  # b"": no such key (GETRANGE); an error reply: a wrong type
            self.counters.answers_missed += 1
            return None
        if len(blob) > MAX_ANSWER_BLOB:
            self._refuse(key, BlobRefused(f"answer of more than {MAX_ANSWER_BLOB} bytes: not read"), oversized=True)
            return None
        try:
            header, _ = unseal(self.secret, key, blob)
            if header.get("kind") != "answer" or header.get("digest") != self.digest:
                raise BlobRefused("not an answer of this model")
            ids = list(token_ids(header.get("ids")))
        except BlobRefused as e:
            self._refuse(key, e)
            return None
        self.counters.answers_found += 1
        return ids

    def similar_answers(self, scope: str, fingerprint, min_cosine: float, k: int = 2) -> list[list[int]]:
        """Token ids of the fleet's answers to the k questions of this scope most similar to this one (cosine
        at least min_cosine), from the background mirror: no wait on the store. Drafts, checked by the model."""
        self._watch_writer()
        now = time.monotonic()
        with self._mirror_lock:
            self._wanted[scope] = now
            if len(self._wanted) > MIRROR_SCOPES:
                self._wanted.pop(min(self._wanted, key=lambda sc: self._wanted[sc]))
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
            items = self._call("answers read", lambda lkey=lkey: self._recent_items(lkey), write=True)
            if items is None:
                return
            fps: list[np.ndarray] = []
            ids, seen = [], set()
            for item in items:
                try:
                    if not isinstance(item, bytes) or len(item) > MAX_RECENT_ITEM:
                        raise BlobRefused(f"item of more than {MAX_RECENT_ITEM} bytes")
                    header, payload = unseal(self.secret, lkey, item)
                    if header.get("kind") != "recent" or header.get("digest") != self.digest:
                        raise BlobRefused("not an answer of this model")
                    answer = tuple(token_ids(header.get("ids")))
                    if len(payload) % 2 or not payload:
                        raise BlobRefused(f"fingerprint of {len(payload)} bytes")
                    fp = np.frombuffer(payload, dtype="<f2").astype(np.float32)
                    if not np.isfinite(fp).all():
                        raise BlobRefused("fingerprint with non-finite values")
                except BlobRefused as e:
                    self._refuse(lkey, e)
                    continue
                if answer in seen or (fps and fp.shape != fps[0].shape):
                    continue
                seen.add(answer)
                fps.append(fp)
                ids.append(list(answer))
            with self._mirror_lock:
                self._mirror[scope] = (time.monotonic(), np.stack(fps) if fps else np.zeros((0, 0), np.float32), ids)

    def _recent_items(self, lkey: str) -> list:
        """A scope's recent answers as bytes, read only when the whole list is within MAX_RECENT_LIST (MEMORY USAGE:
        the server walks its nodes, nothing is sent). A larger list is not one the fleet's writers left (they trim
        it to RECENT_PER_SCOPE small items): it is unlinked, counted and logged; its answers were only drafts and
        the writers fill it again. A key of another type reads as empty."""
        size = self.link.server_size(lkey)
        if size is not None and size > MAX_RECENT_LIST:
            self._refuse(lkey, BlobRefused(f"recent list of {size} bytes, more than {MAX_RECENT_LIST}: not read, "
                                           "unlinked"), oversized=True)
            self.redis.unlink(lkey)
            return []
        return self.link.read_typed(lambda: self.redis.lrange(lkey, 0, RECENT_PER_SCOPE - 1))

    def _top_members(self, zkey: str, n: int) -> list:
        """The n highest members of the asked-most set, each as bytes, or None where it is over MAX_MEMBER; where
        the server refuses scripts, nothing when the set is over MAX_ASKED_SET (counted)."""
        def oversized(size: int) -> None:
            self._refuse(zkey, BlobRefused(f"{size} bytes, more than {MAX_ASKED_SET}: not read"), oversized=True)
        return self.link.top_members(zkey, n, MAX_MEMBER, MAX_ASKED_SET, oversized)

    def _block_bound(self) -> int:
        """Most bytes a sealed KV block can take: its payload, a header of BLOCK_TOKENS ids, the seal."""
        return self.bytes_per_token * BLOCK_TOKENS + 4096

    def should_verify(self) -> bool:
        """Whether the engine recomputes this fetched prefix's last positions (fleet_kv_verify_rate)."""
        return self.verify_rate > 0 and self._rng.random() < self.verify_rate

    def distrust(self, prefix: "FleetPrefix", why: str) -> None:
        """A fetched prefix that differs from this node's own bits: never used, its blocks not fetched again by
        this node, and deleted from the store (an honest node writes them again)."""
        self.counters.kv_mismatches += 1
        keys = list(prefix.block_keys)
        for k in keys:
            self._distrusted[k] = None
        while len(self._distrusted) > MAX_DISTRUSTED:
            self._distrusted.pop(next(iter(self._distrusted)))
        self.log.warning(f"fleet store: a KV prefix of {prefix.n_tokens} tokens from the fleet differs from this "
                         f"node's recompute ({why}); dropped, its {len(keys)} blocks deleted")
        if keys:
            self._call("kv drop", lambda: self.redis.delete(*keys), write=True)

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
        most = self._block_bound()

        def fetch(batch):
            pipe = self.redis.pipeline(transaction=False)
            for key in batch:
                pipe.getrange(key, 0, most)  # bounded even if the value grew since its STRLEN
            return pipe.execute(raise_on_error=False)
        for start in range(0, run, per_round):
            batch = keys[start:start + per_round]
            blobs = self._call("kv fetch", lambda batch=batch: fetch(batch))
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
        return FleetPrefix(k[:, :, :n], v[:, :, :n], n, (time.perf_counter() - t0) * 1000,
                           block_keys=tuple(keys[have // BLOCK_TOKENS:n // BLOCK_TOKENS]))

    def _block_tensors(self, key: str, blob, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        if not blob or not isinstance(blob, bytes):
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
        if not bool(torch.isfinite(t).all()):
            raise BlobRefused("KV block with non-finite values")
        return t[0], t[1]

    def _refuse(self, key: str, e: BaseException, oversized: bool = False) -> None:
        """Count a value not used; log it, once a minute per key and reason (a bad item in a mirrored list is
        met again at every refresh)."""
        self.counters.refused += 1
        self.counters.oversized += oversized
        line = f"fleet store: refused {key.rsplit(':', 1)[-1][:12]}: {e}"
        now = time.monotonic()
        if now - self._logged.get(line, -REFUSAL_LOG_S) >= REFUSAL_LOG_S:
            if len(self._logged) >= 256:
                self._logged.clear()
            self._logged[line] = now
            self.log.warning(line)

    # ---- writes (background) ------------------------------------------------------------------------
    def publish(self, scope: str, tokens: list[int], *, answer_ids: list[int] | None, question: str,
                task: dict | None, read_kv: Callable[[int], tuple[torch.Tensor, torch.Tensor] | None] | None,
                fingerprint=None) -> None:
        """After a finished exact answer, off the request's path: the answer (a draft for the fleet), the
        prompt's full KV blocks (read_kv(n) gives this node's exact KV of tokens[:n], or None), and one more ask
        of the task. Dropped (counted) when the writer is behind or the store is down."""
        self._watch_writer()
        if self.breaker.open():
            self.counters.writes_dropped += 1
            return
        try:
            self._queue.put_nowait((scope, list(tokens), answer_ids, question, task, read_kv, fingerprint))
        except queue.Full:
            self.counters.writes_dropped += 1

    def _start_writer(self) -> None:
        self._writer = threading.Thread(target=self._write_loop, name="fleet-writer", daemon=True)
        self._writer.start()

    def _watch_writer(self) -> None:
        """Start the writer again should it have died (it survives any item: this is the net under that)."""
        if self._writer.is_alive() or self._closing.is_set():
            return
        with self._restart_lock:
            if self._writer.is_alive() or self._closing.is_set():
                return
            self.counters.thread_restarts += 1
            self._restarted_at = time.monotonic()
            self.log.warning(f"fleet store: the fleet-writer thread died ({self._writer_death or 'no reason seen'});"
                             f" started again (restart {self.counters.thread_restarts})")
            self._start_writer()

    def _write_loop(self) -> None:
        """The writer; while the store is down it also pings it when the pause is over, so the node sees the
        store back without waiting for a request. Nothing a job or the store does ends it."""
        try:
            self._write_jobs()
        except BaseException as e:  # noqa: BLE001 - the thread ends; recorded for the restart's WARN
            self._writer_death = f"{type(e).__name__}: {e}"[:200]

    def _write_jobs(self) -> None:
        while not self._closing.is_set():
            try:
                job = self._queue.get(timeout=0.05)
            except queue.Empty:
                try:
                    if self.breaker.failures and not self.breaker.open():
                        self._call("ping", self.redis.ping, write=True)
                    elif not self.breaker.failures:
                        self._refresh_mirrors()
                except Exception as e:  # noqa: BLE001 - a bad item must not end the writer
                    self.log.warning(f"fleet store mirror refresh failed: {type(e).__name__}: {e}")
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
        zkey = f"{self.namespace}:asked"
        top = self._call("most asked", lambda: self._top_members(zkey, max(1, 4 * n)))
        out = []
        for member in top or []:
            try:  # "<scope tag>:<task id>", both hex: anything else is not one of ours
                text = member.decode("ascii") if isinstance(member, bytes) else ""
                tag, _, tid = text.partition(":")
                if len(tag) != 20 or len(tid) != 24 or not all(c in "0123456789abcdef" for c in tag + tid):
                    raise ValueError
            except ValueError:
                self._refuse(zkey, BlobRefused(f"malformed member {bytes(member or b'')[:24]!r}"),
                             oversized=member is None)
                continue
            key = ":".join((self.namespace, "s", tag, "task", tid))
            blob = self._call("task read", lambda key=key: self.redis.getrange(key, 0, MAX_TASK_BLOB))
            if not blob:
                continue
            try:
                if len(blob) > MAX_TASK_BLOB:
                    raise BlobRefused(f"task of more than {MAX_TASK_BLOB} bytes: not read")
                header, _ = unseal(self.secret, key, blob, max_header=MAX_TASK_HEADER)
                task = header.get("task")
                if not isinstance(task, dict):
                    raise BlobRefused("task is not an object")
            except BlobRefused as e:
                self._refuse(key, e, oversized=len(blob) > MAX_TASK_BLOB)
                continue
            out.append(task)
            if len(out) >= n:
                break
        return out

    # ---- telemetry / shutdown -----------------------------------------------------------------------
    def status(self) -> dict:
        """Plain values for /diagnostics (no password: the URL is redacted)."""
        self._watch_writer()
        c = self.counters
        recent = self._restarted_at and time.monotonic() - self._restarted_at < THREAD_WARN_S
        return {"fleet_store": self.state, "fleet_url": self.url, "fleet_last_error": self.breaker.last_error,
                "fleet_answers_found": c.answers_found, "fleet_kv_fetches": c.kv_fetches,
                "fleet_kv_tokens_fetched": c.kv_tokens_fetched, "fleet_refused_blobs": c.refused,
                "fleet_published_answers": c.published_answers, "fleet_published_blocks": c.published_blocks,
                "fleet_writes_dropped": c.writes_dropped, "fleet_errors": c.errors + c.write_errors,
                "fleet_oversized_skipped": c.oversized, "fleet_kv_shared": self.share_kv,
                "fleet_kv_verified": c.kv_verified, "fleet_kv_mismatches": c.kv_mismatches,
                "fleet_thread_restarts": c.thread_restarts,
                "fleet_thread_warning": (f"fleet-writer thread died ({self._writer_death}) and was restarted"
                                         if recent else "")}

    @property
    def writer_alive(self) -> bool:
        return self._writer.is_alive()

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
                      timeout_ms=s.fleet_timeout_ms, share_kv=s.fleet_share_kv and share_kv,
                      verify_rate=s.fleet_kv_verify_rate, log=log)
