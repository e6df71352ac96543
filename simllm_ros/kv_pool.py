"""The semantic KV pool: cached tasks (tokens, KV blocks, fingerprint, answer) under a hard byte budget.

Storage (block_store), block books (block_pool), similarity (matcher) and the
eviction policy (eviction) are separate modules; the pool ties them together
under one lock and is the only place that decides whether something fits.
Bytes counted against the budget: every used KV block plus each entry's own
metadata (token ids, fingerprint, question and answer text).
"""
from __future__ import annotations

import collections
import dataclasses
import threading
import time

import numpy as np
import torch

from . import eviction
from .block_pool import BlockPool
from .block_store import BlockStore, KVShape
from .matcher import Matcher


@dataclasses.dataclass
class Entry:
    key: int
    scope: str
    tokens: list[int]
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


@dataclasses.dataclass
class PendingInsert:
    """A prompt served approximately (SEMANTIC): its exact KV is computed later, when the node is idle."""

    scope: str
    tokens: list[int]
    fingerprint: np.ndarray
    question: str
    context_digest: str
    answer: str


@dataclasses.dataclass(frozen=True)
class EntryInfo:
    """A read-only summary of one cached task (for telemetry, the benchmark and tests)."""

    key: int
    scope: str
    n_tokens: int
    n_blocks: int
    bytes: int  # its own blocks (shared ones counted in full) plus its metadata
    hits: int
    created: float
    last_used: float
    fingerprint: np.ndarray


@dataclasses.dataclass
class PrefixHit:
    k: torch.Tensor  # [L, H, n, D]
    v: torch.Tensor
    n_tokens: int
    entry_keys: list[int]


class KVPool:
    def __init__(self, shape: KVShape, *, block_tokens: int, budget_bytes: int, kv_bits: int,
                 model_dtype: torch.dtype, fingerprint_dim: int, device: str = "cpu"):
        self.block_tokens = block_tokens
        self.budget_bytes = int(budget_bytes)
        per_block = BlockStore.bytes_per_block_for(shape, block_tokens, kv_bits, model_dtype)
        num_blocks = self.budget_bytes // per_block
        if num_blocks < 2:
            raise ValueError(f"cache_size {budget_bytes} B holds fewer than 2 KV blocks of {per_block} B")
        self.store = BlockStore(shape, block_tokens, num_blocks, kv_bits, model_dtype, device)
        self.blocks = BlockPool(num_blocks, block_tokens)
        self.matcher = Matcher(fingerprint_dim)
        self.entries: dict[int, Entry] = {}
        self._by_tokens: dict[tuple[str, tuple[int, ...]], int] = {}
        self._entries_of_block: dict[int, set[int]] = {}
        self._meta_bytes = 0
        self._next_key = 1
        self.evictions_total = 0
        # Prompts served by SEMANTIC reuse, waiting for an exact prefill at idle time (bounded: newest kept).
        self.pending_inserts: collections.deque[PendingInsert] = collections.deque(maxlen=8)
        self.lock = threading.RLock()
        # eviction policy knobs (live)
        self.lfu_weight = 0.7
        self.diversity_weight = 0.3
        self.half_life_s = 600.0

    # ---- accounting ----------------------------------------------------------
    @property
    def bytes_used(self) -> int:
        return self.blocks.num_used * self.store.bytes_per_block + self._meta_bytes

    @property
    def bytes_saved_quantization(self) -> int:
        return max(0, self.blocks.num_used * (self.store.bytes_per_block_16bit - self.store.bytes_per_block))

    def __len__(self) -> int:
        return len(self.entries)

    # ---- reads -----------------------------------------------------------------
    def longest_prefix(self, scope: str, tokens: list[int], limit: int) -> PrefixHit | None:
        """KV of the longest cached prefix of tokens[:limit] in scope (limit keeps at least one token to compute)."""
        with self.lock:
            ids, n = self.blocks.longest_prefix(scope, tokens[:limit])
            if n == 0:
                return None
            k, v = self.store.read(ids, n, self.store.model_dtype)
            owners = sorted(self._entries_of_block.get(ids[-1], ()))
            return PrefixHit(k, v, n, owners)

    def entry_kv(self, key: int) -> tuple[torch.Tensor, torch.Tensor]:
        with self.lock:
            e = self.entries[key]
            return self.store.read(e.block_ids, len(e.tokens), self.store.model_dtype)

    def describe_entries(self) -> list[EntryInfo]:
        """Every entry's summary, in insertion order."""
        with self.lock:
            keys = list(self.entries)
            fps = self.matcher.fingerprints(keys) if keys else []
            per_block = self.store.bytes_per_block
            return [EntryInfo(k, e.scope, len(e.tokens), len(e.block_ids), len(e.block_ids) * per_block + e.meta_bytes,
                              e.hits, e.created, e.last_used, fp)
                    for k, e, fp in ((k, self.entries[k], fp) for k, fp in zip(keys, fps))]

    def find(self, scope: str, tokens: list[int]) -> Entry | None:
        with self.lock:
            key = self._by_tokens.get((scope, tuple(tokens)))
            return self.entries.get(key) if key is not None else None

    def touch(self, keys: list[int], now: float | None = None) -> None:
        now = time.time() if now is None else now
        with self.lock:
            for key in keys:
                e = self.entries.get(key)
                if e is not None:
                    e.hits += 1
                    e.last_used = now
                    self.matcher.touch(key, now)

    # ---- writes ----------------------------------------------------------------
    def insert(self, *, scope: str, tokens: list[int], k: torch.Tensor, v: torch.Tensor, fingerprint: np.ndarray,
               question: str, context_digest: str, answer: str, now: float | None = None,
               created: float | None = None, hits: int = 0, write=None) -> int | None:
        """Add a task; returns its key, or None if it cannot fit even in an empty pool.
        `write(block_id, start, end)` overrides how block contents are filled (persistence restores raw blocks)."""
        now = time.time() if now is None else now
        with self.lock:
            existing = self._by_tokens.get((scope, tuple(tokens)))
            if existing is not None:  # same task again: refresh what it says, keep its blocks
                e = self.entries[existing]
                self._meta_bytes -= e.meta_bytes
                e.answer, e.question, e.context_digest, e.last_used = answer, question, context_digest, now
                self._meta_bytes += e.meta_bytes
                self.matcher.add(existing, fingerprint, scope, now)
                self._enforce_budget(protect=existing)
                if self.bytes_used > self.budget_bytes:  # alone it no longer fits (e.g. a much longer answer)
                    self.remove(existing)
                return existing if existing in self.entries else None
            entry = Entry(self._next_key, scope, list(tokens), [], question, context_digest, answer,
                          created if created is not None else now, now, hits)
            T = self.block_tokens
            n_blocks = -(-len(tokens) // T)
            meta = entry.meta_bytes + 4 * n_blocks  # its block table is not filled in yet
            if n_blocks * self.store.bytes_per_block + meta > self.budget_bytes or n_blocks > self.store.num_blocks:
                return None
            if write is None:
                def write(bid, start, end):
                    self.store.write(bid, k[:, :, start:end], v[:, :, start:end])
            # Make room: evict until the whole entry would fit even if it shared no block.
            while (self.blocks.num_free < n_blocks or
                   self.bytes_used + n_blocks * self.store.bytes_per_block + meta > self.budget_bytes):
                if not self._evict_one():
                    return None
            ids, _ = self.blocks.acquire_chain(scope, tokens, write)
            entry.block_ids = ids
            self._next_key += 1
            self.entries[entry.key] = entry
            self._by_tokens[(scope, tuple(tokens))] = entry.key
            for bid in ids:
                self._entries_of_block.setdefault(bid, set()).add(entry.key)
            self._meta_bytes += entry.meta_bytes
            self.matcher.add(entry.key, fingerprint, scope, now)
            assert self.bytes_used <= self.budget_bytes, "KV pool over budget after insert"
            return entry.key

    def remove(self, key: int) -> None:
        with self.lock:
            e = self.entries.pop(key)
            del self._by_tokens[(e.scope, tuple(e.tokens))]
            for bid in e.block_ids:
                owners = self._entries_of_block[bid]
                owners.discard(key)
                if not owners:
                    del self._entries_of_block[bid]
            self.blocks.release(e.block_ids)
            self._meta_bytes -= e.meta_bytes
            self.matcher.remove(key)

    def _enforce_budget(self, protect: int | None = None) -> None:
        while self.bytes_used > self.budget_bytes:
            if not self._evict_one(protect):
                break

    def _evict_one(self, protect: int | None = None) -> bool:
        keys = [k for k in self.entries if k != protect]
        if not keys:
            return False
        now = time.time()
        es = [self.entries[k] for k in keys]
        scores = eviction.keep_scores(
            np.array([e.hits for e in es]), np.array([now - e.last_used for e in es]),
            self.matcher.redundancy(keys), lfu_weight=self.lfu_weight,
            diversity_weight=self.diversity_weight, half_life_s=self.half_life_s)
        victim = eviction.eviction_order(keys, scores)[0]
        self.remove(victim)
        self.evictions_total += 1
        return True

    def drop_older_than(self, max_age_s: float, now: float | None = None) -> int:
        """Refresh: forget tasks created more than max_age_s ago (their KV or answer may be stale)."""
        now = time.time() if now is None else now
        with self.lock:
            old = [k for k, e in self.entries.items() if now - e.created > max_age_s]
            for k in old:
                self.remove(k)
            return len(old)

    def clear(self) -> None:
        with self.lock:
            self.pending_inserts.clear()
            for k in list(self.entries):
                self.remove(k)

    def check_consistency(self) -> None:
        with self.lock:
            self.blocks.check_consistency()
            assert self.bytes_used <= self.budget_bytes, "over budget"
            refs: dict[int, int] = {}
            for e in self.entries.values():
                for bid in e.block_ids:
                    refs[bid] = refs.get(bid, 0) + 1
            for bid, info in self.blocks.blocks.items():
                assert refs.get(bid, 0) == info.refcount, f"block {bid}: refcount {info.refcount} != {refs.get(bid, 0)} users"
            assert len(self.matcher) == len(self.entries), "matcher and entries disagree"
            assert self._meta_bytes == sum(e.meta_bytes for e in self.entries.values()), "metadata bytes drifted"
