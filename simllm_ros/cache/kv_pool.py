"""The semantic KV pool: cached tasks (tokens, KV blocks, fingerprint, answer) under a hard byte budget.

Storage (block_store), block books (block_pool), similarity (matcher) and the
eviction policy (eviction) are separate modules; the pool ties them together
under one lock and is the only place that decides whether something fits.
Bytes counted against the budget: every used KV block plus each entry's own
metadata (token ids, fingerprint, question and answer text).

Callers see a narrow API with read-only results (as vLLM's KVCacheManager hides
its blocks): best_matches, longest_prefix, entry_kv, find, insert, touch, remove,
stats, describe_entries, snapshot/restore. Nothing outside reads the parts.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from . import eviction
from .block_pool import BlockPool
from .block_store import BlockStore, KVShape
from .matcher import Matcher

RAW_BLOCK_TENSORS = ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero")


def task_id(scope: str, tokens) -> str:
    return hashlib.sha256(json.dumps([scope, list(tokens)]).encode()).hexdigest()[:16]


@dataclasses.dataclass
class _Entry:
    key: int
    scope: str
    tokens: tuple[int, ...]
    block_ids: list[int]
    question: str
    context_digest: str
    answer: str
    created: float
    last_used: float
    hits: int = 0

    @property
    def meta_bytes(self) -> int:
        return 8 * len(self.tokens) + 4 * len(self.block_ids) + len(self.question.encode()) + len(
            self.answer.encode()) + len(self.scope) + 256


@dataclasses.dataclass(frozen=True)
class EntryInfo:
    """A read-only view of one cached task."""

    key: int
    scope: str
    tokens: tuple[int, ...]
    question: str
    context_digest: str
    answer: str
    created: float
    last_used: float
    hits: int
    n_blocks: int
    bytes: int  # its blocks (shared ones counted in full) plus its metadata
    fingerprint: np.ndarray = dataclasses.field(compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class Match:
    """A cached task similar to a request: its cosine, its ranking score, and what the planner reads."""

    key: int
    cosine: float
    score: float
    entry: EntryInfo


@dataclasses.dataclass(frozen=True)
class _Live:
    scope: str
    tokens: tuple[int, ...]
    k: torch.Tensor  # [L, H, C, D], slots 0..len(tokens)-1 filled
    v: torch.Tensor

    def covers(self, scope: str, tokens: list[int], n: int, capacity: int) -> bool:
        return (scope == self.scope and n <= len(self.tokens) and self.k.shape[2] >= max(capacity, n)
                and tuple(tokens[:n]) == self.tokens[:n])


@dataclasses.dataclass(frozen=True)
class PrefixHit:
    k: torch.Tensor  # [L, H, n, D]
    v: torch.Tensor
    n_tokens: int
    entry_keys: tuple[int, ...]  # entries holding the last matched block
    source_question: str = ""  # the first of them's question (for the decision log)

    @property
    def source_key(self) -> int | None:
        return self.entry_keys[0] if self.entry_keys else None


@dataclasses.dataclass(frozen=True)
class PoolStats:
    entries: int
    num_blocks: int
    blocks_used: int
    block_tokens: int
    kv_bits: int
    bytes_per_block: int
    bytes_per_block_16bit: int
    meta_bytes: int
    bytes_used: int
    budget_bytes: int
    bytes_saved_quantization: int
    evictions_total: int

    @property
    def blocks_free(self) -> int:
        return self.num_blocks - self.blocks_used


@dataclasses.dataclass
class PoolSnapshot:
    """Everything needed to rebuild the pool: one record per entry (its blocks as rows of `blocks`),
    the raw stored block tensors, the fingerprints (row i = entries[i]) and the key calibration."""

    entries: list[dict]
    blocks: dict[str, torch.Tensor]
    fingerprints: np.ndarray
    key_calibration: tuple[torch.Tensor, torch.Tensor] | None = None


class KVPool:
    def __init__(self, shape: KVShape, *, block_tokens: int, budget_bytes: int, kv_bits: int,
                 model_dtype: torch.dtype, fingerprint_dim: int, device: str = "cpu"):
        self.shape = shape
        self.block_tokens = block_tokens
        self.budget_bytes = int(budget_bytes)
        self.kv_bits = kv_bits
        self.model_dtype = model_dtype
        self.fingerprint_dim = fingerprint_dim
        self.device = device
        per_block = BlockStore.bytes_per_block_for(shape, block_tokens, kv_bits, model_dtype)
        num_blocks = self.budget_bytes // per_block
        if num_blocks < 2:
            raise ValueError(f"cache_size {budget_bytes} B holds fewer than 2 KV blocks of {per_block} B")
        self._store = BlockStore(shape, block_tokens, num_blocks, kv_bits, model_dtype, device)
        self._blocks = BlockPool(num_blocks, block_tokens)
        self._matcher = Matcher(fingerprint_dim)
        self._entries: dict[int, _Entry] = {}
        self._by_tokens: dict[tuple[str, tuple[int, ...]], int] = {}
        self._entries_of_block: dict[int, set[int]] = {}
        self._meta_bytes = 0
        self._next_key = 1
        self._evictions_total = 0
        self._mutations = 0  # every change a snapshot would show (checkpoints skip an unchanged pool)
        self._lock = threading.RLock()
        self._live: _Live | None = None  # the last finished request's KV buffer (keep_live)
        self.live_reads_saved = 0  # exact hits served from it instead of a copy out of the blocks
        # eviction policy (live: set_eviction_policy)
        self._lfu_weight = 0.7
        self._diversity_weight = 0.3
        self._half_life_s = 600.0

    def empty_like(self) -> "KVPool":
        """A new, empty pool with the same geometry, precision and budget."""
        return KVPool(self.shape, block_tokens=self.block_tokens, budget_bytes=self.budget_bytes,
                      kv_bits=self.kv_bits, model_dtype=self.model_dtype, fingerprint_dim=self.fingerprint_dim,
                      device=self.device)

    # ---- properties and accounting ---------------------------------------------
    @property
    def quantized(self) -> bool:
        return self._store.quantized

    @property
    def store_dtype(self) -> torch.dtype:
        return self._store.dtype

    @property
    def key_calibration(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self._store.key_calibration

    def set_key_calibration(self, lo: torch.Tensor, hi: torch.Tensor) -> None:
        """Fixed per-channel key ranges for 8-bit storage (enable_quant_calibration)."""
        with self._lock:
            self._store.key_calibration = (lo, hi)

    def set_eviction_policy(self, *, lfu_weight: float, diversity_weight: float, half_life_s: float) -> None:
        with self._lock:
            self._lfu_weight, self._diversity_weight, self._half_life_s = lfu_weight, diversity_weight, half_life_s

    @property
    def bytes_used(self) -> int:
        return self._blocks.num_used * self._store.bytes_per_block + self._meta_bytes

    @property
    def bytes_saved_quantization(self) -> int:
        return max(0, self._blocks.num_used * (self._store.bytes_per_block_16bit - self._store.bytes_per_block))

    @property
    def evictions_total(self) -> int:
        return self._evictions_total

    @property
    def mutations(self) -> int:
        """Counts inserts, refreshes, touches and removals: equal values mean an equal snapshot."""
        return self._mutations

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> PoolStats:
        """A consistent picture of the books (taken under the lock)."""
        with self._lock:
            return PoolStats(len(self._entries), self._store.num_blocks, self._blocks.num_used, self.block_tokens,
                             self.kv_bits, self._store.bytes_per_block, self._store.bytes_per_block_16bit,
                             self._meta_bytes, self.bytes_used, self.budget_bytes, self.bytes_saved_quantization,
                             self._evictions_total)

    # ---- reads -----------------------------------------------------------------
    def _info(self, e: _Entry, fingerprint: np.ndarray) -> EntryInfo:
        return EntryInfo(e.key, e.scope, e.tokens, e.question, e.context_digest, e.answer, e.created, e.last_used,
                         e.hits, len(e.block_ids), len(e.block_ids) * self._store.bytes_per_block + e.meta_bytes,
                         fingerprint)

    def best_matches(self, fingerprint: np.ndarray, scope: str, now: float, *, k: int, recency_weight: float,
                     half_life_s: float) -> list[Match]:
        """The k most similar tasks of `scope`, best score first (matcher.Matcher.best's ranking)."""
        with self._lock:
            found = self._matcher.best(fingerprint, scope, now, k=k, recency_weight=recency_weight,
                                       half_life_s=half_life_s)
            if not found:
                return []
            fps = self._matcher.fingerprints([key for key, _, _ in found])
            return [Match(key, cos, score, self._info(self._entries[key], fp))
                    for (key, cos, score), fp in zip(found, fps)]

    def longest_prefix(self, scope: str, tokens: list[int], limit: int, capacity: int = 0) -> PrefixHit | None:
        """KV of the longest cached prefix of tokens[:limit] in scope (limit keeps at least one token to compute).
        capacity: token slots to allocate behind the returned views (BlockStore.read), so the model can
        continue in them without another copy."""
        with self._lock:
            ids, n = self._blocks.longest_prefix(scope, tokens[:limit])
            if n == 0:
                return None
            live, self._live = self._live, None  # handed out at most once: the caller writes behind its prefix
            if live is not None and live.covers(scope, tokens, n, capacity):
                k, v = live.k[:, :, :n], live.v[:, :, :n]
                self.live_reads_saved += 1
            else:
                k, v = self._store.read(ids, n, self.model_dtype, capacity)
            owners = tuple(sorted(self._entries_of_block.get(ids[-1], ())))
            question = self._entries[owners[0]].question if owners else ""
            return PrefixHit(k, v, n, owners, question)

    def read_prefix(self, scope: str, tokens: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A copy of the KV of tokens[:n] from the blocks, or None unless all n are cached; unlike
        longest_prefix it never hands out the live prefix (for readers beside the request path)."""
        with self._lock:
            ids, m = self._blocks.longest_prefix(scope, tokens[:n])
            if m < n:
                return None
            return self._store.read(ids, n, self.model_dtype)

    def keep_live(self, scope: str, tokens: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep a finished request's KV buffer, k, v [L, H, C, D] holding `tokens` in slots 0..len-1, for the
        next exact hit in the same scope: its prefix is then used in place, not copied out of the blocks
        (a 1200-token prefix is ~28 MB of 16-bit KV to copy). One buffer, the newest;
        it is working memory like an in-flight request's, outside the pool's block budget.

        Only for KV that is bitwise what the blocks hold for the same tokens: exact KV computed at the
        pool's own precision on a batch-invariant backend (the engine's `lossless_reuse`). The prefix used
        is never longer than the blocks' own match, so eviction keeps the usual meaning."""
        if k.dim() != 4 or k.shape != v.shape or k.shape[2] < len(tokens) or k.dtype != self.model_dtype \
                or self._store.dtype != self.model_dtype or not (k.is_contiguous() and v.is_contiguous()):
            return
        with self._lock:
            self._live = _Live(scope, tuple(tokens), k, v)

    @property
    def live_bytes(self) -> int:
        live = self._live
        return 0 if live is None else 2 * live.k.numel() * live.k.element_size()

    def entry_kv(self, key: int, capacity: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """An entry's KV [L, H, n, D], fresh tensors (views of [L, H, max(capacity, n), D]: room to work in)."""
        with self._lock:
            e = self._entries[key]
            return self._store.read(e.block_ids, len(e.tokens), self.model_dtype, capacity)

    def task_id(self, key: int | None) -> str:
        """A name of a cached task that outlives its key (the same after a restart or a re-insert): its scope
        and tokens hashed; "" for a key not in the pool."""
        with self._lock:
            e = self._entries.get(key) if key is not None else None
            return task_id(e.scope, e.tokens) if e is not None else ""

    def find(self, scope: str, tokens: list[int]) -> EntryInfo | None:
        """The task with exactly these tokens in scope, if cached."""
        with self._lock:
            key = self._by_tokens.get((scope, tuple(tokens)))
            if key is None:
                return None
            return self._info(self._entries[key], self._matcher.fingerprints([key])[0])

    def describe_entries(self) -> list[EntryInfo]:
        """Every entry, in insertion order."""
        with self._lock:
            keys = list(self._entries)
            fps = self._matcher.fingerprints(keys) if keys else np.zeros((0, self.fingerprint_dim), np.float32)
            return [self._info(self._entries[k], fp) for k, fp in zip(keys, fps)]

    # ---- writes ----------------------------------------------------------------
    def touch(self, keys: list[int], now: float | None = None) -> None:
        now = time.time() if now is None else now
        with self._lock:
            for key in keys:
                e = self._entries.get(key)
                if e is not None:
                    self._mutations += 1
                    e.hits += 1
                    e.last_used = now
                    self._matcher.touch(key, now)

    def insert(self, *, scope: str, tokens: list[int], k: torch.Tensor, v: torch.Tensor, fingerprint: np.ndarray,
               question: str, context_digest: str, answer: str, now: float | None = None,
               created: float | None = None, hits: int = 0) -> int | None:
        """Add a task (k, v: [L, H, >= len(tokens), D]); returns its key, or None if it cannot fit even in an
        empty pool. The same scope and tokens again refresh the task instead."""
        def write(bid, start, end):
            self._store.write(bid, k[:, :, start:end], v[:, :, start:end])
        return self._insert(scope, tokens, fingerprint, question, context_digest, answer, now, created, hits, write)

    def _insert(self, scope: str, tokens: Sequence[int], fingerprint: np.ndarray, question: str, context_digest: str,
                answer: str, now: float | None, created: float | None, hits: int,
                write: Callable[[int, int, int], None]) -> int | None:
        """insert() with `write(block_id, start, end)` filling each new block (restore writes raw rows)."""
        now = time.time() if now is None else now
        tokens = tuple(tokens)
        with self._lock:
            self._mutations += 1
            existing = self._by_tokens.get((scope, tokens))
            if existing is not None:  # same task again: refresh what it says, keep its blocks
                e = self._entries[existing]
                self._meta_bytes -= e.meta_bytes
                e.answer, e.question, e.context_digest, e.last_used = answer, question, context_digest, now
                self._meta_bytes += e.meta_bytes
                self._matcher.add(existing, fingerprint, scope, now)
                self._enforce_budget(protect=existing)
                if self.bytes_used > self.budget_bytes:  # alone it no longer fits (e.g. a much longer answer)
                    self.remove(existing)
                return existing if existing in self._entries else None
            entry = _Entry(self._next_key, scope, tokens, [], question, context_digest, answer,
                           created if created is not None else now, now, hits)
            n_blocks = -(-len(tokens) // self.block_tokens)
            meta = entry.meta_bytes + 4 * n_blocks  # its block table is not filled in yet
            per_block = self._store.bytes_per_block
            if n_blocks * per_block + meta > self.budget_bytes or n_blocks > self._store.num_blocks:
                return None
            # Make room: evict until the whole entry would fit even if it shared no block.
            while (self._blocks.num_free < n_blocks or
                   self.bytes_used + n_blocks * per_block + meta > self.budget_bytes):
                if not self._evict_one():
                    return None
            ids, _ = self._blocks.acquire_chain(scope, tokens, write)
            entry.block_ids = ids
            self._next_key += 1
            self._entries[entry.key] = entry
            self._by_tokens[(scope, tokens)] = entry.key
            for bid in ids:
                self._entries_of_block.setdefault(bid, set()).add(entry.key)
            self._meta_bytes += entry.meta_bytes
            self._matcher.add(entry.key, fingerprint, scope, now)
            assert self.bytes_used <= self.budget_bytes, "KV pool over budget after insert"
            return entry.key

    def remove(self, key: int) -> None:
        with self._lock:
            self._mutations += 1
            e = self._entries.pop(key)
            del self._by_tokens[(e.scope, e.tokens)]
            for bid in e.block_ids:
                owners = self._entries_of_block[bid]
                owners.discard(key)
                if not owners:
                    del self._entries_of_block[bid]
            self._blocks.release(e.block_ids)
            self._meta_bytes -= e.meta_bytes
            self._matcher.remove(key)

    def _enforce_budget(self, protect: int | None = None) -> None:
        while self.bytes_used > self.budget_bytes:
            if not self._evict_one(protect):
                break

    def _evict_one(self, protect: int | None = None) -> bool:
        keys = [k for k in self._entries if k != protect]
        if not keys:
            return False
        now = time.time()
        es = [self._entries[k] for k in keys]
        scores = eviction.keep_scores(
            np.array([e.hits for e in es]), np.array([now - e.last_used for e in es]),
            self._matcher.redundancy(keys), lfu_weight=self._lfu_weight,
            diversity_weight=self._diversity_weight, half_life_s=self._half_life_s)
        victim = eviction.eviction_order(keys, scores)[0]
        self.remove(victim)
        self._evictions_total += 1
        return True

    def drop_older_than(self, max_age_s: float, now: float | None = None) -> int:
        """Refresh: forget tasks created more than max_age_s ago (their KV or answer may be stale)."""
        now = time.time() if now is None else now
        with self._lock:
            old = [k for k, e in self._entries.items() if now - e.created > max_age_s]
            for k in old:
                self.remove(k)
            return len(old)

    def clear(self) -> None:
        with self._lock:
            self._live = None
            for k in list(self._entries):
                self.remove(k)

    # ---- persistence -------------------------------------------------------------
    def snapshot(self) -> PoolSnapshot:
        """The whole pool as plain records and tensors (copies: the pool may change right after)."""
        with self._lock:
            entries = sorted(self._entries.values(), key=lambda e: e.key)
            used = sorted({b for e in entries for b in e.block_ids})
            row = {b: i for i, b in enumerate(used)}
            blocks = self._store.tensors_for(used) if used else {}
            keys = [e.key for e in entries]
            fps = self._matcher.fingerprints(keys) if keys else np.zeros((0, self.fingerprint_dim), np.float32)
            calib = self._store.key_calibration
            records = [{"scope": e.scope, "tokens": list(e.tokens), "rows": [row[b] for b in e.block_ids],
                        "question": e.question, "context_digest": e.context_digest, "answer": e.answer,
                        "created": e.created, "last_used": e.last_used, "hits": e.hits} for e in entries]
        return PoolSnapshot(records, blocks, fps, None if calib is None else (calib[0].cpu(), calib[1].cpu()))

    def restore(self, snap: PoolSnapshot) -> int:
        """Insert a snapshot's entries, most valuable first (a snapshot larger than today's budget keeps what
        matters); returns how many fit. Raises ValueError, KeyError, TypeError, IndexError or RuntimeError for
        a malformed snapshot, after which the caller should clear() the pool."""
        if snap.key_calibration is not None:
            self.set_key_calibration(*snap.key_calibration)
        raw = {k: t for k, t in snap.blocks.items() if k in RAW_BLOCK_TENSORS}
        T = self.block_tokens
        entries = snap.entries
        order = sorted(range(len(entries)), key=lambda i: (-entries[i]["hits"], -entries[i]["last_used"]))
        restored = 0
        for i in order:
            e = entries[i]
            rows = [int(r) for r in e["rows"]]
            tokens = [int(t) for t in e["tokens"]]
            if len(rows) != -(-len(tokens) // T) or (rows and (max(rows) >= raw["k"].shape[0] or min(rows) < 0)):
                raise ValueError("block table does not match tokens")

            def write(bid, start, end, rows=rows):
                self._store.load_raw(bid, raw, rows[start // T])

            key = self._insert(str(e["scope"]), tokens, snap.fingerprints[i], str(e["question"]),
                               str(e["context_digest"]), str(e["answer"]), float(e["last_used"]), float(e["created"]),
                               int(e["hits"]), write)
            restored += key is not None
        return restored

    def check_consistency(self) -> None:
        with self._lock:
            self._blocks.check_consistency()
            assert self.bytes_used <= self.budget_bytes, "over budget"
            refs: dict[int, int] = {}
            for e in self._entries.values():
                for bid in e.block_ids:
                    refs[bid] = refs.get(bid, 0) + 1
            for bid, info in self._blocks.blocks.items():
                assert refs.get(bid, 0) == info.refcount, \
                    f"block {bid}: refcount {info.refcount} != {refs.get(bid, 0)} users"
            assert len(self._matcher) == len(self._entries), "matcher and entries disagree"
            self._matcher.check_consistency()
            assert self._meta_bytes == sum(e.meta_bytes for e in self._entries.values()), "metadata bytes drifted"
