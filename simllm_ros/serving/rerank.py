"""Documents ranked by closeness in meaning to a query (the ~/rerank service): the cosine of the node's sentence
embedder vectors (the MiniLM that fingerprints requests), best first.

Why here and not in the ROS layer: what is refused (too many documents, empty or oversized text, control
characters) and how scores are ordered are the same whatever asks. The LLM does not run and the pool is not
touched, so a call runs beside requests, not in their queue. Texts are never truncated: a document longer than
the embedder reads would be ranked on its beginning alone, so it is refused with its length.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..validation import check_text_field, is_invisible_only

MAX_DOCUMENTS = 256  # documents per call (the ~/embed service's bound on texts)
# Characters per text, checked before the tokenizer walks it (a 4 MB document is refused at once); the token
# bound of the embedder (max_tokens, 256 word pieces for MiniLM) is checked after and is usually the tighter one.
MAX_TEXT_CHARS = 8192


@dataclass
class Ranking:
    indices: list[int]  # positions in the documents, best first
    scores: list[float]  # cosine of each to the query (float32 values), same order


def check_inputs(query: str, documents: list[str], top_k: int) -> None:
    """ValueError naming the first problem: query and documents as texts, the count, top_k."""
    _check_text("query", query)
    if not isinstance(documents, (list, tuple)):
        raise ValueError(f"documents must be a list of strings, got {type(documents).__name__}")
    if not documents:
        raise ValueError(f"documents is empty; give 1 to {MAX_DOCUMENTS} documents")
    if len(documents) > MAX_DOCUMENTS:
        raise ValueError(f"{len(documents)} documents; at most {MAX_DOCUMENTS} per call")
    for i, doc in enumerate(documents):
        _check_text(f"documents[{i}]", doc)
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
        raise ValueError(f"top_k must be a whole number >= 0 (0 = all), got {top_k!r}")


def _check_text(field: str, text: str) -> None:
    err = check_text_field(field, text)
    if err:
        raise ValueError(err)
    if is_invisible_only(text):
        raise ValueError(f"{field} is empty (only whitespace or invisible characters)")
    if len(text) > MAX_TEXT_CHARS:
        raise ValueError(f"{field} is {len(text)} characters; at most {MAX_TEXT_CHARS} (nothing is truncated)")


def rank(query_vector: np.ndarray, document_vectors: np.ndarray, top_k: int = 0) -> Ranking:
    """The documents by cosine to the query, best first; both unit vectors. Equal scores keep the documents'
    order (a stable sort), so a call's answer does not depend on the sort's whims."""
    scores = (np.asarray(document_vectors, dtype=np.float32) @ np.asarray(query_vector, dtype=np.float32))
    order = np.argsort(-scores, kind="stable")
    if top_k:
        order = order[:top_k]
    return Ranking([int(i) for i in order], [float(scores[i]) for i in order])


def rerank(embedder, query: str, documents: list[str], top_k: int = 0) -> Ranking:
    """`documents` ranked against `query` by `embedder` (a cache.fingerprint.Fingerprinter: embed or
    embed_async, count_tokens, max_tokens). ValueError with the reason for bad input; top_k 0 (or more than
    there are documents) returns them all."""
    if embedder is None:
        raise ValueError("engine is not loaded")
    check_inputs(query, documents, top_k)
    texts = [query] + list(documents)
    limit = int(embedder.max_tokens)
    for i, text in enumerate(texts):
        n = embedder.count_tokens(text)
        if n > limit:
            field = "query" if i == 0 else f"documents[{i - 1}]"
            raise ValueError(f"{field} is {n} tokens; the embedder reads at most {limit} (nothing is truncated)")
    # On the embedder's own threads where it has them (they keep their torch thread count; a model turn
    # meanwhile sets the caller's to one).
    run = getattr(embedder, "embed_async", None)
    vectors = run(texts).result() if run is not None else embedder.embed(texts)
    return rank(vectors[0], vectors[1:], int(top_k))


def rerank_on(engine, query: str, documents: list[str], top_k: int = 0) -> Ranking:
    """rerank() on a loaded engine's embedder (what the ~/rerank service calls)."""
    return rerank(getattr(engine, "fingerprinter", None) if engine is not None else None, query, documents, top_k)
