"""Text to the loaded model's token ids and back (the ~/tokenize and ~/detokenize services).

Why here and not in the ROS layer: what is refused (empty or oversized text, control characters, ids outside the
vocabulary) is the same whatever asks; the engine's backend holds the tokenizer. Neither touches the model or the
pool, so they run beside requests, not in their queue.
"""
from __future__ import annotations

from ..validation import check_text_field

MAX_IDS = 65536


def tokenize(engine, text: str) -> tuple[list[int], list[str]]:
    """(ids, each id's own text) of text as the model reads it, without chat template or special tokens;
    ValueError with the reason for bad input."""
    backend = _backend(engine)
    err = check_text_field("text", text)
    if err:
        raise ValueError(err)
    if not text:
        raise ValueError("text is empty")
    limit = engine.max_prompt_chars()
    if limit is not None and len(text) > limit:
        raise ValueError(f"text is {len(text)} characters: more than the {limit} that can fit in max_prompt_tokens")
    tok = backend.tokenizer
    ids = [int(i) for i in tok(text, add_special_tokens=False)["input_ids"]]
    return ids, [tok.decode([i]) for i in ids]


def detokenize(engine, ids: list[int], skip_special_tokens: bool = False) -> str:
    """The text of token ids; ValueError for an empty list, too many ids, or an id outside the vocabulary."""
    backend = _backend(engine)
    if not ids:
        raise ValueError("tokens is empty")
    if len(ids) > MAX_IDS:
        raise ValueError(f"{len(ids)} tokens; at most {MAX_IDS} per call")
    vocab = len(backend.tokenizer)
    bad = next((i for i, t in enumerate(ids) if not 0 <= int(t) < vocab), None)
    if bad is not None:
        raise ValueError(f"tokens[{bad}] = {ids[bad]} is outside the vocabulary (0..{vocab - 1})")
    return backend.tokenizer.decode([int(t) for t in ids], skip_special_tokens=bool(skip_special_tokens))


def _backend(engine):
    backend = getattr(engine, "backend", None) if engine is not None else None
    if backend is None or getattr(backend, "tokenizer", None) is None:
        raise ValueError("engine is not loaded")
    return backend
