"""A sentence-transformers folder of the common shape (Transformer -> mean or CLS Pooling -> Normalize) run on our
BERT forward (bert_encoder) or, for other models, transformers' AutoModel directly: the same tokenizer call,
batches sorted by length as SentenceTransformer.encode sorts them, the same pooling and normalisation steps, so
the same bits (test_sentence_encoder checks it against sentence-transformers). Why: importing sentence_transformers
pulls scikit-learn and more, seconds and ~60 MB of every node's start; the node only ever encodes text. Any other
folder shape returns None and the caller falls back to SentenceTransformer itself."""
from __future__ import annotations

import json
import os

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .bert_encoder import BertEncoder

_TRANSFORMER = "sentence_transformers.models.Transformer"
_POOLING = "sentence_transformers.models.Pooling"
_NORMALIZE = "sentence_transformers.models.Normalize"


def _read_json(path: str) -> dict | list | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _tokenizer(path: str):
    """The folder's tokenizer, as AutoTokenizer reads it. A BERT one (MiniLM) is built from its own module:
    AutoTokenizer imports transformers' model registry and generation code first (5-12 s against 2 s here, and
    scikit-learn with transformers 5.20.2, Python 3.10's pin), which a node that only encodes text never uses."""
    config = _read_json(os.path.join(path, "tokenizer_config.json"))
    if isinstance(config, dict) and config.get("tokenizer_class") == "BertTokenizer":
        # local: transformers takes seconds to import; fingerprint imports this module without it
        from transformers.models.bert.tokenization_bert import BertTokenizer

        return BertTokenizer.from_pretrained(path, local_files_only=True)
    # local: transformers takes seconds to import; fingerprint imports this module without it
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


class SentenceEncoder:
    """encode(texts) -> [n, dim] float32 unit vectors; `tokenizer`, `max_seq_length` and `dim` as the caller reads
    them from a SentenceTransformer."""

    @classmethod
    def open(cls, path: str, device: str = "cpu") -> "SentenceEncoder | None":
        """The encoder for a folder of the shape above, else None (the folder is not checked further here: a broken
        one fails in transformers with its own error)."""
        modules = _read_json(os.path.join(path, "modules.json"))
        if not isinstance(modules, list) or not modules:
            return None
        types = [m.get("type") for m in modules if isinstance(m, dict)]
        if types not in ([_TRANSFORMER, _POOLING], [_TRANSFORMER, _POOLING, _NORMALIZE]) or modules[0].get("path"):
            return None
        pooling = _read_json(os.path.join(path, modules[1].get("path", ""), "config.json"))
        if not isinstance(pooling, dict):
            return None
        modes = [k for k, v in pooling.items() if k.startswith("pooling_mode_") and v]
        if modes not in (["pooling_mode_mean_tokens"], ["pooling_mode_cls_token"]):
            return None
        config = _read_json(os.path.join(path, "sentence_bert_config.json")) or {}
        if not isinstance(config, dict) or config.get("do_lower_case") or set(config) - {"max_seq_length",
                                                                                            "do_lower_case"}:
            return None
        return cls(path, device, modes[0] == "pooling_mode_mean_tokens", len(types) == 3, config.get("max_seq_length"))

    def __init__(self, path: str, device: str, mean: bool, normalize_module: bool, max_seq_length: int | None):
        self.tokenizer = _tokenizer(path)
        # A plain BERT (MiniLM) on torch alone (bert_encoder); any other model on transformers' AutoModel
        self.bert = BertEncoder.open(path) if device == "cpu" else None
        if self.bert is not None:
            self.model: Any = None
            positions, self.dim = self.bert.max_positions, self.bert.hidden
        else:
            # local: transformers takes seconds to import (a non-BERT or non-CPU encoder only)
            from transformers import AutoModel

            self.model = AutoModel.from_pretrained(path, local_files_only=True).to(device).eval()
            positions, self.dim = self.model.config.max_position_embeddings, int(self.model.config.hidden_size)
        self.device = device
        self.mean = mean
        self.normalize_module = normalize_module  # the folder's Normalize, before encode's own normalisation
        self.max_seq_length = int(max_seq_length or min(self.tokenizer.model_max_length, positions))

    def encode(self, texts: list[str], batch_size: int = 32) -> np.ndarray:
        order = np.argsort([-len(t) for t in texts])  # as SentenceTransformer.encode: longest first
        rows: list = [None] * len(texts)
        for start in range(0, len(texts), batch_size):
            idx = order[start:start + batch_size]
            feats = self.tokenizer([texts[i] for i in idx], padding=True, truncation="longest_first",
                                   max_length=self.max_seq_length, return_tensors="pt").to(self.device)
            with torch.inference_mode():
                h = self.bert(**feats) if self.bert is not None else self.model(**feats).last_hidden_state
            if self.mean:
                mask = feats["attention_mask"].unsqueeze(-1).to(h.dtype)
                v = (h * mask).sum(dim=1, dtype=h.dtype) / torch.clamp(mask.sum(dim=1, dtype=h.dtype), min=1e-9)
            else:
                v = h[:, 0]
            if self.normalize_module:
                v = F.normalize(v, p=2, dim=1)
            v = F.normalize(v, p=2, dim=1).float().cpu()
            for j, i in enumerate(idx):
                rows[i] = v[j]
        if not rows:
            return np.zeros((0, self.dim), dtype=np.float32)
        return torch.stack(rows).numpy()


class _SentenceTransformerEncoder:
    """Any other folder, through sentence-transformers itself, behind the same small API (imported only here)."""

    def __init__(self, path: str, device: str):
        # local: sentence-transformers (with scikit-learn) only for a folder the others cannot read
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(path, device=device, local_files_only=True)
        self.tokenizer = self.model.tokenizer
        self.max_seq_length = int(getattr(self.model, "max_seq_length", 0) or 256)
        dim = self.model.get_embedding_dimension() if hasattr(self.model, "get_embedding_dimension") \
            else self.model.get_sentence_embedding_dimension()
        self.dim = int(dim)  # type: ignore[arg-type]  # None (a model without a fixed dimension) fails the load here

    def encode(self, texts: list[str], batch_size: int = 32) -> np.ndarray:
        return self.model.encode(texts, batch_size=batch_size, convert_to_numpy=True, normalize_embeddings=True,
                                 show_progress_bar=False)


def open_encoder(path: str, device: str = "cpu") -> "SentenceEncoder | _SentenceTransformerEncoder":
    """The encoder for an embedder folder: SentenceEncoder where the folder has its shape,
    else sentence-transformers."""
    return SentenceEncoder.open(path, device) or _SentenceTransformerEncoder(path, device)
