"""Finds the cached tasks most similar to a request, within its scope.

Score = cosine - recency_weight * (1 - 2^(-age / half_life)): an entry used
just now keeps its full cosine, an old one loses at most recency_weight, so
among near-equal matches the fresher task wins without recency ever beating a
clearly better match. Scope is a hard wall: each scope keeps its own compact
matrix, so a lookup reads only the rows of the request's scope and nothing
(not even a similarity value) comes from another scope.

How a scope is scanned: one float32 product per
lookup while a scope is small; above PREFILTER_ROWS rows an int8 copy of the
fingerprints (one scale per row; the query is quantized too and ATen's int8
product reads a quarter of the bytes) picks the candidates, and only those are
scored exactly in float32: every row whose approximate cosine is within the
recency weight plus the int8 error bound of the k-th best one (`_candidates`),
so the ranking is the exact one. The kernel is a private ATen op whose CPU paths
differ by instruction set, so it is checked once per process against float32 on
data of the prefilter's shape, and on every lookup on the rows it picked and 64
rows spread over the scope; where it disagrees (or is missing) every lookup
scans exactly in float32.

Above index_rows (INDEX_ROWS, 50,000 by default) a scan reads too much (N x 384 bytes a lookup; the figures
are simllm-bench matcher's), so a scope gets an inverted-file index (coarse_index, faiss) built in the
background once it passes the limit (and again when it has grown by half), kept up to date row by row after
that; a lookup scores exactly only the candidates the index hands back and the newest rows. That is the one approximate
step: a row filed far from the query may be missed (measured recall in the README). It never changes an
answer on the lossless paths: exact prefixes are found by token hashes, not here, and drafts are verified.

For eviction it also keeps each entry's redundancy (highest cosine to another
entry of its scope) up to date as entries come and go: an add costs one pass
over its scope, a remove one pass per entry whose nearest neighbour it was, so
an eviction never needs the all-pairs product.
"""
from __future__ import annotations

import threading

import numpy as np
import torch

from . import coarse_index

PREFILTER_ROWS = 8192  # scopes with more rows use the int8 prefilter
PREFILTER_MARGIN = 0.03  # bound on the int8 error of a cosine of unit vectors (both sides quantized; checked)
INDEX_ROWS = 50_000  # scopes with more rows are looked up through a coarse index (0: never)
INDEX_REBUILD_GROWTH = 1.5  # a scope this many times the rows its index was trained on gets a new one
INDEX_TAIL_ROWS = 2048  # the newest rows (at the end of the arrays) are scored exactly on every indexed lookup
INDEX_CANDIDATES = 64  # rows the index hands back per lookup (16 per wanted row at least), scored exactly


_INT8_KERNEL_OK: bool | None = None  # decided by _int8_kernel_ok() on first use


def _int8_scores(q: np.ndarray, w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Approximate cosines of q with every int8 row: the query is quantized too and one int8 x int8
    product (ATen's _int_mm: oneDNN, VNNI where the CPU has it) is scaled back (it reads a quarter of the
    bytes of a float32 scan; simllm-bench matcher measures it)."""
    q8, qscale = _quantize(np.asarray(q, dtype=np.float32)[None])
    return torch._int_mm(q8, w8.t())[0].float() * (scale * qscale)


def _quantize(fp: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.from_numpy(fp)
    scale = (t.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    return torch.round(t / scale[:, None]).to(torch.int8).contiguous(), scale


def _candidates(a: np.ndarray, k: int, recency_weight: float) -> np.ndarray:
    """Rows that can be among the k best by score, from approximate cosines `a`.

    A true cosine is within PREFILTER_MARGIN / 2 of its approximation (checked on every lookup) and
    recency takes at most recency_weight off, so the k-th best score is at least a_k - margin/2 -
    recency_weight (a_k: the k-th largest approximation) and a row can reach it only if its own
    approximation is within recency_weight + margin of a_k. The k-th largest is found among the rows
    near the maximum when there are k of them (the usual case), else over all rows."""
    window = recency_weight + PREFILTER_MARGIN
    near = np.flatnonzero(a >= a.max() - window)
    pool = a[near] if len(near) >= k else a
    kth = np.partition(pool, len(pool) - k)[len(pool) - k]
    return np.flatnonzero(a >= kth - window)


def _int8_kernel_ok() -> bool:
    """Whether the int8 kernel's cosines stay within PREFILTER_MARGIN / 2 of float32 here."""
    global _INT8_KERNEL_OK
    if _INT8_KERNEL_OK is None:
        rng = np.random.default_rng(0)
        rows, dim = PREFILTER_ROWS + 1001, 384  # the prefilter's shapes, a row count that is no block multiple
        fp = rng.standard_normal((rows, dim)).astype(np.float32)
        fp /= np.linalg.norm(fp, axis=1, keepdims=True)
        try:
            ok = True
            for q in (fp[7], fp[rows - 1], -fp[123]):
                err = np.abs(_int8_scores(q, *_quantize(fp)).numpy() - fp @ q).max()
                ok = ok and bool(np.isfinite(err)) and err <= PREFILTER_MARGIN / 2
        except (RuntimeError, AttributeError, NotImplementedError):
            ok = False
        _INT8_KERNEL_OK = ok
    return _INT8_KERNEL_OK


def _distrust_int8_kernel() -> None:
    global _INT8_KERNEL_OK
    _INT8_KERNEL_OK = False


class _ScopeRows:
    """One scope's fingerprints, rows 0..n-1 used (a removal moves the last row into the hole)."""

    def __init__(self, dim: int, capacity: int):
        self.fp = np.zeros((capacity, dim), dtype=np.float32)
        self.keys = np.full(capacity, -1, dtype=np.int64)
        self.last_used = np.zeros(capacity, dtype=np.float64)
        self.nn_sim = np.full(capacity, -1.0, dtype=np.float32)  # cosine to the nearest other row
        self.nn_idx = np.full(capacity, -1, dtype=np.int64)  # that row, -1 when alone
        self.n = 0
        # int8 copy for the prefilter: rows below _q8_valid are current; an add or a removal marks from its
        # row on, so a lookup after an add quantizes one row, not the scope.
        self._q8: tuple[torch.Tensor, torch.Tensor] | None = None
        self._q8_valid = 0
        self.index: coarse_index.CoarseIndex | None = None  # above index_rows, once built
        self.building: threading.Thread | None = None  # a background build in flight
        self.changed_keys: set[int] = set()  # keys added, replaced or removed since that build's snapshot

    def grow(self) -> None:
        cap = self.fp.shape[0] * 2
        for name, fill in (("fp", 0.0), ("keys", -1), ("last_used", 0.0), ("nn_sim", -1.0), ("nn_idx", -1)):
            old = getattr(self, name)
            new = np.full((cap,) + old.shape[1:], fill, dtype=old.dtype)
            new[:self.n] = old[:self.n]
            setattr(self, name, new)

    def int8(self) -> tuple[torch.Tensor, torch.Tensor]:
        cap = self.fp.shape[0]
        if self._q8 is None or self._q8[0].shape[0] != cap:
            old, self._q8 = self._q8, (torch.zeros((cap, self.fp.shape[1]), dtype=torch.int8),
                                       torch.ones(cap, dtype=torch.float32))
            if old is not None:
                keep = min(self._q8_valid, old[0].shape[0])
                self._q8[0][:keep], self._q8[1][:keep] = old[0][:keep], old[1][:keep]
        if self._q8_valid < self.n:
            w8, scale = _quantize(self.fp[self._q8_valid:self.n])
            self._q8[0][self._q8_valid:self.n], self._q8[1][self._q8_valid:self.n] = w8, scale
            self._q8_valid = self.n
        return self._q8[0][:self.n], self._q8[1][:self.n]

    def changed(self, row: int) -> None:
        """Rows from `row` on are new or moved."""
        self._q8_valid = min(self._q8_valid, row)


class Matcher:
    def __init__(self, dim: int, capacity: int = 256, index_rows: int = INDEX_ROWS):
        self.dim = dim
        self._capacity = max(1, capacity)
        self.index_rows = index_rows if coarse_index.available() else 0
        self._scopes: dict[str, _ScopeRows] = {}
        self._where: dict[int, tuple[str, int]] = {}  # key -> (scope, row)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._where)

    def add(self, key: int, fingerprint: np.ndarray, scope: str, now: float) -> None:
        """Add a key, or replace its fingerprint and scope."""
        with self._lock:
            if key in self._where:
                self._remove(key)
            s = self._scopes.get(scope)
            if s is None:
                s = self._scopes[scope] = _ScopeRows(self.dim, self._capacity)
            if s.n == s.fp.shape[0]:
                s.grow()
            row = s.n
            s.n += 1
            s.fp[row] = fingerprint
            s.keys[row] = key
            s.last_used[row] = now
            s.changed(row)
            self._where[key] = (scope, row)
            self._link(s, row)
            if s.building is not None:
                s.changed_keys.add(key)
            if s.index is not None:
                s.index.add([key], s.fp[row:row + 1])
            self._maybe_index(scope, s)

    def touch(self, key: int, now: float) -> None:
        with self._lock:
            where = self._where.get(key)
            if where is not None:
                self._scopes[where[0]].last_used[where[1]] = now

    def remove(self, key: int) -> None:
        with self._lock:
            if key in self._where:
                self._remove(key)

    def _remove(self, key: int) -> None:
        scope, row = self._where.pop(key)
        s = self._scopes[scope]
        if s.building is not None:
            s.changed_keys.add(key)
        if s.index is not None:
            s.index.remove([key])
        last = s.n - 1
        orphans = np.nonzero(s.nn_idx[:s.n] == row)[0]
        if row != last:  # the last row fills the hole
            for name in ("fp", "keys", "last_used", "nn_sim", "nn_idx"):
                getattr(s, name)[row] = getattr(s, name)[last]
            self._where[int(s.keys[row])] = (scope, row)
            s.nn_idx[:last][s.nn_idx[:last] == last] = row
            orphans = np.where(orphans == last, row, orphans)  # the moved row may be an orphan too
        s.keys[last], s.nn_idx[last], s.nn_sim[last] = -1, -1, -1.0
        s.n = last
        s.changed(row)
        for other in orphans:  # rows whose nearest neighbour left look again
            if other < s.n:
                s.nn_idx[other], s.nn_sim[other] = self._nearest(s, int(other))
        if s.index is not None and s.n < self.index_rows // 2:
            s.index = None  # small enough to scan again; a new one is trained if it grows back
        if s.n == 0:
            del self._scopes[scope]

    # ---- the coarse index of a large scope; callers hold the lock ------------------------------------
    def _maybe_index(self, scope: str, s: _ScopeRows) -> None:
        """Starts a background build when the scope has passed index_rows and has no index (or has
        outgrown it): lookups keep scanning until it is ready."""
        if self.index_rows <= 0 or s.n <= self.index_rows or s.building is not None:
            return
        if s.index is not None and s.n < INDEX_REBUILD_GROWTH * s.index.trained_rows:
            return
        s.changed_keys = set()
        s.building = threading.Thread(target=self._build, args=(scope, s, s.fp[:s.n].copy(), s.keys[:s.n].copy()),
                                      name=f"matcher-index-{scope}", daemon=True)
        s.building.start()

    def _build(self, scope: str, s: _ScopeRows, fps: np.ndarray, keys: np.ndarray) -> None:
        """Trains an index on a snapshot off the lock, then replays what changed since under it."""
        try:
            index = coarse_index.CoarseIndex(self.dim, fps, keys)
        except (RuntimeError, MemoryError, ValueError) as e:  # faiss failed: this scope keeps scanning
            index = None
            print(f"[matcher] index for scope {scope!r} not built ({e}); lookups scan", flush=True)
        with self._lock:
            changed, s.changed_keys, s.building = s.changed_keys, set(), None
            if index is None or self._scopes.get(scope) is not s or s.n < self.index_rows // 2:
                return
            index.remove(np.fromiter(changed, np.int64, len(changed)))
            live = [k for k in changed if self._where.get(k, ("",))[0] == scope]
            if live:
                index.add(live, s.fp[[self._where[k][1] for k in live]])
            s.index = index

    def load_scope(self, scope: str, fingerprints: np.ndarray, last_used: np.ndarray) -> None:
        """Fills a new scope straight into its arrays, keys 0..n-1, without the nearest-neighbour links add()
        keeps for eviction: for measuring lookups at sizes that add() (O(N) each) would take hours to reach."""
        n = len(fingerprints)
        with self._lock:
            if scope in self._scopes or any(k in self._where for k in range(n)):
                raise ValueError(f"load_scope: scope {scope!r} or one of the keys 0..{n - 1} is in use")
            s = _ScopeRows(self.dim, n + 16)
            s.fp[:n], s.keys[:n], s.last_used[:n], s.n = fingerprints, np.arange(n), last_used, n
            self._scopes[scope] = s
            self._where.update((i, (scope, i)) for i in range(n))

    def build_index(self, scope: str) -> None:
        """Starts the scope's index build now where it is due (above index_rows), as the next add() would."""
        with self._lock:
            s = self._scopes.get(scope)
            if s is not None:
                self._maybe_index(scope, s)

    def index_state(self, scope: str) -> dict:
        """The scope's coarse index: built, its lists and trained rows (0 when none), a build in flight."""
        with self._lock:
            s = self._scopes.get(scope)
            index = s.index if s is not None else None
            return {"built": index is not None, "lists": index.lists if index is not None else 0,
                    "trained_rows": index.trained_rows if index is not None else 0,
                    "building": s is not None and s.building is not None}

    def wait_for_index(self, timeout: float | None = None) -> None:
        """Returns when no index build is in flight (tests and the benchmark; lookups never wait)."""
        while True:
            with self._lock:
                threads = [s.building for s in self._scopes.values() if s.building is not None]
            if not threads:
                return
            for t in threads:
                t.join(timeout)
                if t.is_alive():
                    raise TimeoutError("matcher index build still running")

    def check_consistency(self) -> None:
        with self._lock:
            for scope, s in self._scopes.items():
                if s.index is not None and s.building is None:
                    filed = s.index.keys()
                    assert len(filed) == s.n and set(filed.tolist()) == set(s.keys[:s.n].tolist()), \
                        f"scope {scope!r}: the index holds other keys than the scope"

    def _index_rows(self, s: _ScopeRows, scope: str, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(rows, exact cosines) of the index's candidates (the rows of highest approximate cosine in the
        probed lists, enough of them that recency can reorder the top k) and of the scope's last
        INDEX_TAIL_ROWS rows, which hold the newest tasks: those the centres were not trained on, which a
        new topic can file in lists its own queries do not probe (None: out of step, scan)."""
        keys, _ = s.index.candidates(q, max(INDEX_CANDIDATES, 16 * k))  # type: ignore[union-attr]  # best() checks
        where = [self._where.get(int(key)) for key in keys]
        if any(w is None or w[0] != scope for w in where):  # out of step: drop it, rebuild later
            s.index = None
            return None
        # may be empty: the tail remains; no w is None here (returned above)
        rows = np.fromiter((w[1] for w in where), np.int64, len(where))  # type: ignore[index]
        start = max(0, s.n - INDEX_TAIL_ROWS)
        rows = np.concatenate([rows[rows < start], np.arange(start, s.n)])
        return rows, np.concatenate([s.fp[rows[:len(rows) - (s.n - start)]] @ q, s.fp[start:s.n] @ q])

    # ---- nearest neighbours (redundancy); callers hold the lock --------------------------------------
    @staticmethod
    def _nearest(s: _ScopeRows, row: int, among: np.ndarray | None = None) -> tuple[int, float]:
        sims = s.fp[:s.n] @ s.fp[row]
        mask = np.ones(s.n, dtype=bool) if among is None else among.copy()
        mask[row] = False
        if not mask.any():
            return -1, -1.0
        masked = np.where(mask, sims, -np.inf)
        best = int(np.argmax(masked))
        return best, float(masked[best])

    @staticmethod
    def _link(s: _ScopeRows, row: int) -> None:
        """A row joined: find its neighbour, and become the neighbour of rows it is closer to."""
        if s.n == 1:
            s.nn_idx[row], s.nn_sim[row] = -1, -1.0
            return
        sims = s.fp[:s.n] @ s.fp[row]
        sims[row] = -np.inf
        best = int(np.argmax(sims))
        s.nn_idx[row], s.nn_sim[row] = best, sims[best]
        closer = sims > s.nn_sim[:s.n]
        closer[row] = False
        s.nn_idx[:s.n][closer] = row
        s.nn_sim[:s.n][closer] = sims[closer]

    # ---- lookups -------------------------------------------------------------------------------------
    def best(self, fingerprint: np.ndarray, scope: str, now: float, *, k: int = 1,
             recency_weight: float = 0.0, half_life_s: float = 600.0) -> list[tuple[int, float, float]]:
        """Top-k (key, cosine, score) in `scope`, best score first; empty if the scope has no entries."""
        with self._lock:
            s = self._scopes.get(scope)
            if s is None or s.n == 0 or k <= 0:
                return []
            q = np.asarray(fingerprint, dtype=np.float32)
            rows: np.ndarray
            cos: np.ndarray | None = None
            found = self._index_rows(s, scope, q, k) if s.index is not None else None
            if found is not None:
                rows, cos = found
            elif s.n > PREFILTER_ROWS and _int8_kernel_ok():
                a = _int8_scores(q, *s.int8()).numpy()
                picked = _candidates(a, min(k, s.n), recency_weight)
                cos = s.fp[picked] @ q
                spread = np.linspace(0, s.n - 1, 64).astype(np.int64)  # rows it did not pick are checked too
                if max(np.abs(a[picked] - cos).max(), np.abs(a[spread] - s.fp[spread] @ q).max()) \
                        <= PREFILTER_MARGIN / 2:
                    rows = picked
                else:  # the kernel misbehaved on these rows: never trust it again in this process
                    _distrust_int8_kernel()
                    cos = None
            if cos is None:
                rows = np.arange(s.n)
                cos = s.fp[:s.n] @ q
            score = cos
            if recency_weight > 0:
                age = np.maximum(now - s.last_used[rows], 0.0)
                score = cos - recency_weight * (1.0 - np.exp2(-age / half_life_s))
            k = min(k, len(rows))
            top = np.argpartition(-score, k - 1)[:k] if k < len(rows) else np.arange(len(rows))
            top = top[np.argsort(-score[top], kind="stable")]
            return [(int(s.keys[rows[i]]), float(cos[i]), float(score[i])) for i in top]

    def redundancy(self, keys: list[int]) -> np.ndarray:
        """For each key, the highest cosine to any other of `keys` in its scope (1.0 = a duplicate), >= 0.

        Read from the kept neighbours; only a key whose neighbour is not among `keys` (an entry the
        caller leaves out, such as one protected from eviction) is looked up again."""
        with self._lock:
            out = np.zeros(len(keys))
            chosen: dict[str, np.ndarray] = {}
            for key in keys:
                scope, row = self._where[key]
                mask = chosen.get(scope)
                if mask is None:
                    mask = chosen[scope] = np.zeros(self._scopes[scope].n, dtype=bool)
                mask[row] = True
            for i, key in enumerate(keys):
                scope, row = self._where[key]
                s, among = self._scopes[scope], chosen[scope]
                nn = s.nn_idx[row]
                if nn >= 0 and not among[nn]:
                    out[i] = self._nearest(s, row, among)[1]
                else:
                    out[i] = s.nn_sim[row]
            return out.clip(min=0.0)

    def fingerprints(self, keys: list[int]) -> np.ndarray:
        with self._lock:
            out = np.zeros((len(keys), self.dim), dtype=np.float32)
            for i, key in enumerate(keys):
                scope, row = self._where[key]
                out[i] = self._scopes[scope].fp[row]
            return out
