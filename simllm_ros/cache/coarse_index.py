"""An inverted-file index over one scope's fingerprints, for scopes too large to scan on every lookup.

Rows are filed under the nearest of ~sqrt(N) centres (k-means on a sample); a lookup scans only the lists
of the centres nearest the query (1/16 of them), in 8-bit codes, and hands back candidate keys that the
matcher then scores exactly. It is approximate: a row filed under a centre far from the query is not seen.
Measured on MiniLM fingerprints of CLINC150 (15,000 training sentences, 300 validation queries; the matcher
adds its newest rows), the best match was missed for 5 of 300 queries, all with a best cosine of 0.40-0.67,
under the SEMANTIC threshold (0.8); simllm-bench matcher measures it, the README has the figures.

faiss (IVF with an 8-bit scalar quantizer, inner product) does the filing and scanning; ids are the
matcher's keys, kept in a hash map so a removal does not scan the lists. faiss runs on one thread here: a
lookup sits on a request's path beside the model, and a build runs in the background. OpenMP's thread count
is per calling thread, so every entry point sets it (a thread that did not ran each one-row add as a
parallel region on every core, hundreds of times slower, and its idle workers slowed the caller's numpy).
"""
from __future__ import annotations

import numpy as np

try:
    import faiss
except ImportError:  # the matcher scans exactly without it
    faiss = None

PROBE_SHARE = 1 / 16  # share of the lists a lookup scans
SAMPLE_PER_LIST = 40  # training rows per centre (faiss warns under 39)


def available() -> bool:
    return faiss is not None


def lists_for(rows: int) -> int:
    """A power of two near sqrt(rows), at least 16: lists of ~sqrt(N) rows keep both scans short."""
    return max(16, 1 << int(round(np.log2(max(rows, 1)) / 2)))


class CoarseIndex:
    def __init__(self, dim: int, fps: np.ndarray, keys: np.ndarray, seed: int = 0):
        """Trains the centres on a sample of `fps` and files every row; seconds at 100k+ rows (run off the
        matcher's lock)."""
        faiss.omp_set_num_threads(1)  # this thread's OpenMP regions; see the module docstring
        self.trained_rows = len(fps)
        self.lists = lists_for(len(fps))
        self._quantizer = faiss.IndexFlatIP(dim)
        self._index = faiss.IndexIVFScalarQuantizer(self._quantizer, dim, self.lists,
                                                   faiss.ScalarQuantizer.QT_8bit, faiss.METRIC_INNER_PRODUCT)
        self._index.cp.seed = seed
        rng = np.random.default_rng(seed)
        sample = min(len(fps), self.lists * SAMPLE_PER_LIST)
        pick = np.sort(rng.choice(len(fps), sample, replace=False))
        self._index.train(np.ascontiguousarray(fps[pick], dtype=np.float32))
        self._index.set_direct_map_type(faiss.DirectMap.Hashtable)
        self._index.nprobe = max(1, int(self.lists * PROBE_SHARE))
        self.add(keys, fps)

    def __len__(self) -> int:
        return int(self._index.ntotal)

    def add(self, keys: np.ndarray | list[int], fps: np.ndarray) -> None:
        faiss.omp_set_num_threads(1)
        if len(keys):
            self._index.add_with_ids(np.ascontiguousarray(fps, dtype=np.float32).reshape(len(keys), -1),
                                     np.asarray(keys, dtype=np.int64))

    def remove(self, keys) -> int:
        faiss.omp_set_num_threads(1)
        keys = np.asarray(keys, dtype=np.int64).ravel()
        return int(self._index.remove_ids(faiss.IDSelectorArray(len(keys), faiss.swig_ptr(keys)))) if len(keys) else 0

    def keys(self) -> np.ndarray:
        """Every key filed (consistency checks)."""
        lists = self._index.invlists
        parts = [faiss.rev_swig_ptr(lists.get_ids(i), lists.list_size(i)).copy() for i in range(self.lists)
                 if lists.list_size(i)]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def stored(self, key: int) -> np.ndarray:
        """The 8-bit approximation of a key's fingerprint as filed."""
        return self._index.reconstruct(int(key))

    def candidates(self, q: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(keys, approximate cosines) of up to `count` rows, the highest first, among the probed lists."""
        faiss.omp_set_num_threads(1)
        sims, ids = self._index.search(np.ascontiguousarray(q, dtype=np.float32).reshape(1, -1), count)
        keep = ids[0] >= 0
        return ids[0][keep], sims[0][keep]
