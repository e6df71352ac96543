"""Exact pruning for the matcher's large scopes: rows grouped around fixed centres.

A lookup needs every row whose score could reach the k-th best. For a group with centre c and radius r (no
member is farther than r from c), every member x has q.x = q.c + q.(x - c) <= q.c + |q| r (Cauchy-Schwarz),
and a score is never above its cosine (recency only subtracts). So the groups with the highest bounds are
scored exactly first, and then every group whose bound is below the k-th best score found is skipped: the
ranking is still the exact one, it is only cheaper where fingerprints cluster (requests do: by intent, by
place, by robot task). Where they do not and the bounds admit a large share of the scope, `candidates` says
so and the matcher scans as before.

Centres come from a few rounds of k-means on a sample and then stay fixed: a new row joins the group of its
nearest centre and widens that radius if needed; a removed row leaves the radius as it was (still an upper
bound). The matcher rebuilds the groups when the scope has doubled since they were built, so that the
groups stay about sqrt(n) rows each.
"""
from __future__ import annotations

import numpy as np
import torch

BOUND_SLACK = 1e-4  # float32 rounding of q.c, |q| r and q.x is ~1e-6 here; the bound keeps well clear of it
SCAN_SHARE = 0.125  # more than this share of the scope admitted by the bounds: not worth it, scan instead
FIRST_ROWS = 256  # rows scored before the bounds are compared with the k-th best score


class RowGroups:
    def __init__(self, fp: np.ndarray, n: int, seed: int = 0):
        """Groups for rows 0..n-1 of `fp` (unit fingerprints, float32)."""
        self.built_n = n
        n_groups = int(np.clip(round(np.sqrt(n)), 8, 4096))
        rng = np.random.default_rng(seed)
        sample = fp[np.sort(rng.choice(n, size=min(n, 16 * n_groups), replace=False))]
        centres = _seeds(sample, n_groups, rng)
        for _ in range(4):  # Lloyd's k-means on the sample: any centres keep the bound valid, good ones keep it tight
            assign = self._nearest_of(sample, centres)
            sums = torch.zeros(centres.shape).index_add_(0, torch.from_numpy(assign), torch.from_numpy(sample)).numpy()
            counts = np.bincount(assign, minlength=n_groups)
            empty = counts == 0
            centres = np.where(empty[:, None], sample[rng.choice(len(sample), size=n_groups)],
                               sums / np.maximum(counts, 1)[:, None]).astype(np.float32)
        self.centres = centres
        self._half_norm2 = 0.5 * (centres * centres).sum(axis=1)
        self.radius = np.zeros(n_groups, dtype=np.float32)
        self.group = np.full(max(n, 1), -1, dtype=np.int32)  # per row: its group
        self.pos = np.zeros(max(n, 1), dtype=np.int32)  # per row: its place in the group's member list
        self.members = [np.zeros(16, dtype=np.int64) for _ in range(n_groups)]
        self.count = np.zeros(n_groups, dtype=np.int64)
        step = 65536
        for a in range(0, n, step):
            b = min(n, a + step)
            assign = self._nearest_of(fp[a:b], centres)
            dist = np.linalg.norm(fp[a:b] - centres[assign], axis=1)
            np.maximum.at(self.radius, assign, dist.astype(np.float32))
            for g, rows in _split_by(assign, np.arange(a, b)):
                self._append(g, rows)

    @staticmethod
    def _nearest_of(x: np.ndarray, centres: np.ndarray) -> np.ndarray:
        """The nearest centre of each row (float32 products and argmax in slices: ~10 s for 1M rows and 1000
        centres on one core here, where bf16 took 17 s). Rounding may put a row in a near-nearest group:
        that only widens the group's radius, which is computed from the rows themselves."""
        cs = torch.from_numpy(centres)
        neg_half = torch.from_numpy(-0.5 * (centres * centres).sum(axis=1))[None]
        out = np.empty(len(x), dtype=np.int64)
        for a in range(0, len(x), 8192):  # in slices whose score matrix stays in cache
            xs = torch.from_numpy(np.ascontiguousarray(x[a:a + 8192]))
            out[a:a + 8192] = torch.argmax(torch.addmm(neg_half, xs, cs.t()), dim=1).numpy()
        return out

    def _append(self, g: int, rows: np.ndarray) -> None:
        c, need = int(self.count[g]), int(self.count[g]) + len(rows)
        if need > len(self.members[g]):
            grown = np.zeros(max(need, 2 * len(self.members[g])), dtype=np.int64)
            grown[:c] = self.members[g][:c]
            self.members[g] = grown
        self.members[g][c:need] = rows
        self.group[rows] = g
        self.pos[rows] = np.arange(c, need)
        self.count[g] = need

    def add(self, row: int, x: np.ndarray) -> None:
        """Row `row` (fingerprint x) is new: it joins the nearest centre's group."""
        if row >= len(self.group):
            size = max(row + 1, 2 * len(self.group))
            self.group = np.concatenate([self.group, np.full(size - len(self.group), -1, dtype=np.int32)])
            self.pos = np.concatenate([self.pos, np.zeros(size - len(self.pos), dtype=np.int32)])
        g = int(np.argmax(self.centres @ x - self._half_norm2))
        self.radius[g] = max(self.radius[g], float(np.linalg.norm(x - self.centres[g])))
        self._append(g, np.array([row]))

    def remove(self, row: int) -> None:
        """Row `row` leaves (its group's radius stays: still an upper bound)."""
        g, i = int(self.group[row]), int(self.pos[row])
        last = int(self.count[g]) - 1
        moved = int(self.members[g][last])
        self.members[g][i] = moved
        self.pos[moved] = i
        self.count[g] = last
        self.group[row] = -1

    def move(self, src: int, dst: int) -> None:
        """The row at `src` now lives at `dst` (the matcher fills a hole with its last row)."""
        g = int(self.group[src])
        self.members[g][self.pos[src]] = dst
        self.group[dst], self.pos[dst] = g, self.pos[src]
        self.group[src] = -1

    def candidates(self, q: np.ndarray, k: int, scores, n: int) -> np.ndarray | None:
        """Rows (ascending) that hold every row able to reach the k best scores, or None when the bounds admit
        more than SCAN_SHARE of the n rows. `scores(rows)` gives the exact scores of rows."""
        live = self.count > 0
        bound = self.centres @ q + float(np.linalg.norm(q)) * self.radius + BOUND_SLACK
        bound[~live] = -np.inf
        order = np.argsort(-bound, kind="stable")
        order = order[live[order]]
        csum = np.cumsum(self.count[order])
        first = int(np.searchsorted(csum, min(max(k, FIRST_ROWS), int(csum[-1])))) + 1
        rows = self._rows(order[:first])
        s = scores(rows)
        kth = np.partition(s, len(s) - k)[len(s) - k] if len(s) >= k else -np.inf
        more = order[first:][bound[order[first:]] >= kth]
        if len(rows) + int(self.count[more].sum()) > SCAN_SHARE * n:
            return None
        return np.sort(np.concatenate([rows, self._rows(more)])) if len(more) else np.sort(rows)

    def _rows(self, groups: np.ndarray) -> np.ndarray:
        if not len(groups):
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([self.members[g][:self.count[g]] for g in groups])


def _seeds(x: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ seeding: each next centre drawn with probability proportional to the squared distance to
    the nearest centre so far (random seeds merged whole clusters into one wide group here)."""
    norms = (x * x).sum(axis=1)
    chosen = [int(rng.integers(len(x)))]
    d2 = np.maximum(norms + norms[chosen[0]] - 2 * (x @ x[chosen[0]]), 0)
    for _ in range(1, n):
        total = float(d2.sum())
        i = int(rng.choice(len(x), p=d2 / total)) if total > 0 else int(rng.integers(len(x)))
        chosen.append(i)
        np.minimum(d2, np.maximum(norms + norms[i] - 2 * (x @ x[i]), 0), out=d2)
    return x[chosen].astype(np.float32)


def _split_by(keys: np.ndarray, values: np.ndarray):
    """(key, values with that key) for each key present, values in their order."""
    order = np.argsort(keys, kind="stable")
    k, v = keys[order], values[order]
    cuts = np.flatnonzero(np.diff(k)) + 1
    for part_k, part_v in zip(np.split(k, cuts), np.split(v, cuts)):
        yield int(part_k[0]), part_v
