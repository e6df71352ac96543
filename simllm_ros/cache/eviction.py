"""Which entry to give up when the pool is full.

keep = lfu_weight * frequency + (1 - lfu_weight) * recency - diversity_weight * redundancy

frequency = log(1+hits) / log(1+max hits), recency = 2^(-idle / half_life), and
redundancy = the highest cosine to another entry of the same scope. An entry
in a dense cluster of near-identical tasks is cheap to lose (its neighbours
still serve the topic); the last entry of a topic is not.
"""
from __future__ import annotations

import numpy as np


def keep_scores(hits: np.ndarray, idle_s: np.ndarray, redundancy: np.ndarray, *, lfu_weight: float,
                diversity_weight: float, half_life_s: float) -> np.ndarray:
    hits = np.asarray(hits, dtype=np.float64)
    denom = np.log1p(hits.max()) if len(hits) and hits.max() > 0 else 1.0
    frequency = np.log1p(hits) / denom
    recency = np.exp2(-np.maximum(np.asarray(idle_s, dtype=np.float64), 0.0) / half_life_s)
    return lfu_weight * frequency + (1.0 - lfu_weight) * recency - diversity_weight * np.asarray(redundancy)


def eviction_order(keys: list[int], scores: np.ndarray) -> list[int]:
    """Keys from the first to evict to the last."""
    return [keys[i] for i in np.argsort(scores, kind="stable")]
