"""Finds the cached tasks most similar to a request: one matrix product over all fingerprints.

Score = cosine - recency_weight * (1 - 2^(-age / half_life)): an entry used
just now keeps its full cosine, an old one loses at most recency_weight, so
among near-equal matches the fresher task wins without recency ever beating a
clearly better match. Scope is a hard mask: rows of other scopes score -inf,
so nothing (not even a similarity value) comes from another scope.

For eviction it also keeps each entry's redundancy (highest cosine to another entry of its scope)
up to date as entries come and go: an add costs one pass over the matrix (O(n*d)), a remove one pass
per entry whose nearest neighbour it was, so an eviction never needs the all-pairs product.
"""
from __future__ import annotations

import threading

import numpy as np


class Matcher:
    def __init__(self, dim: int, capacity: int = 256):
        self.dim = dim
        self._fp = np.zeros((capacity, dim), dtype=np.float32)
        self._scope = np.full(capacity, -1, dtype=np.int64)  # -1: empty row
        self._last_used = np.zeros(capacity, dtype=np.float64)
        self._nn_sim = np.full(capacity, -1.0, dtype=np.float32)  # cosine to the nearest same-scope row
        self._nn_row = np.full(capacity, -1, dtype=np.int64)  # that row, -1 when it has no neighbour
        self._row_of: dict[int, int] = {}
        self._key_of_row: dict[int, int] = {}
        self._free_rows: list[int] = list(range(capacity - 1, -1, -1))
        self._scope_ids: dict[str, int] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._row_of)

    def _scope_id(self, scope: str) -> int:
        sid = self._scope_ids.get(scope)
        if sid is None:
            sid = self._scope_ids[scope] = len(self._scope_ids)
        return sid

    def add(self, key: int, fingerprint: np.ndarray, scope: str, now: float) -> None:
        """Add a key, or replace its fingerprint and scope (it keeps its row)."""
        with self._lock:
            if key in self._row_of:
                row = self._row_of[key]
                self._unlink(row)
            else:
                if not self._free_rows:
                    self._grow()
                row = self._free_rows.pop()
                self._row_of[key] = row
                self._key_of_row[row] = key
            self._fp[row] = fingerprint
            self._scope[row] = self._scope_id(scope)
            self._last_used[row] = now
            self._link(row)

    def touch(self, key: int, now: float) -> None:
        with self._lock:
            row = self._row_of.get(key)
            if row is not None:
                self._last_used[row] = now

    def remove(self, key: int) -> None:
        with self._lock:
            row = self._row_of.pop(key, None)
            if row is None:
                return
            del self._key_of_row[row]
            self._unlink(row)
            self._free_rows.append(row)

    # ---- nearest neighbours (redundancy), kept incrementally; callers hold the lock --------------
    def _neighbours(self, row: int, among: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Cosines of row to every row, and the mask of rows that count as its neighbours."""
        sims = self._fp @ self._fp[row]
        mask = self._scope == self._scope[row]
        if among is not None:
            mask &= among
        mask[row] = False
        return sims, mask

    def _nearest(self, row: int, among: np.ndarray | None = None) -> tuple[int, float]:
        sims, mask = self._neighbours(row, among)
        if not mask.any():
            return -1, -1.0
        masked = np.where(mask, sims, -np.inf)
        best = int(np.argmax(masked))
        return best, float(masked[best])

    def _link(self, row: int) -> None:
        """A row joined (its scope and fingerprint are set): find its neighbour, be others' neighbour."""
        sims, mask = self._neighbours(row)
        if mask.any():
            masked = np.where(mask, sims, -np.inf)
            best = int(np.argmax(masked))
            self._nn_row[row], self._nn_sim[row] = best, masked[best]
            closer = mask & (sims > self._nn_sim)
            self._nn_row[closer] = row
            self._nn_sim[closer] = sims[closer]
        else:
            self._nn_row[row], self._nn_sim[row] = -1, -1.0

    def _unlink(self, row: int) -> None:
        """A row leaves (or changes): rows whose nearest neighbour it was look again."""
        self._scope[row] = -1
        self._nn_row[row], self._nn_sim[row] = -1, -1.0
        for other in np.nonzero(self._nn_row == row)[0]:
            nn, sim = self._nearest(int(other))
            self._nn_row[other], self._nn_sim[other] = nn, sim

    def _grow(self) -> None:
        old = self._fp.shape[0]
        new = old * 2
        self._fp = np.concatenate([self._fp, np.zeros((old, self.dim), np.float32)])
        self._scope = np.concatenate([self._scope, np.full(old, -1, np.int64)])
        self._last_used = np.concatenate([self._last_used, np.zeros(old)])
        self._nn_sim = np.concatenate([self._nn_sim, np.full(old, -1.0, np.float32)])
        self._nn_row = np.concatenate([self._nn_row, np.full(old, -1, np.int64)])
        self._free_rows.extend(range(new - 1, old - 1, -1))

    def best(self, fingerprint: np.ndarray, scope: str, now: float, *, k: int = 1,
             recency_weight: float = 0.0, half_life_s: float = 600.0) -> list[tuple[int, float, float]]:
        """Top-k (key, cosine, score) in `scope`, best score first; empty if the scope has no entries."""
        with self._lock:
            sid = self._scope_ids.get(scope)
            if sid is None or not self._row_of:
                return []
            cos = self._fp @ fingerprint.astype(np.float32)
            age = np.maximum(now - self._last_used, 0.0)
            score = cos - recency_weight * (1.0 - np.exp2(-age / half_life_s))
            score = np.where(self._scope == sid, score, -np.inf)
            k = min(k, len(self._row_of))
            if k <= 0:
                return []
            top = np.argpartition(-score, k - 1)[:k] if k < len(score) else np.arange(len(score))
            top = top[np.argsort(-score[top])]
            return [(self._key_of_row[int(r)], float(cos[r]), float(score[r]))
                    for r in top if np.isfinite(score[r])]

    def redundancy(self, keys: list[int]) -> np.ndarray:
        """For each key, the highest cosine to any other of `keys` in its scope (1.0 = a duplicate), >= 0.

        Read from the kept neighbours; only a key whose neighbour is not among `keys` (an entry the
        caller leaves out, such as one protected from eviction) is looked up again."""
        with self._lock:
            rows = np.array([self._row_of[k] for k in keys], dtype=np.int64)
            if len(rows) == 0:
                return np.zeros(0)
            out = self._nn_sim[rows].astype(np.float64)
            if len(rows) < len(self._row_of):
                among = np.zeros(len(self._scope), dtype=bool)
                among[rows] = True
                nn = self._nn_row[rows]
                for i in np.nonzero((nn >= 0) & ~among[np.maximum(nn, 0)])[0]:
                    out[i] = self._nearest(int(rows[i]), among)[1]
            return out.clip(min=0.0)

    def fingerprints(self, keys: list[int]) -> np.ndarray:
        with self._lock:
            return self._fp[[self._row_of[k] for k in keys]].copy()
