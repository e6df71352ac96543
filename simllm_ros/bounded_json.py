"""JSON from sources the node does not control (the fleet's Redis, label files), parsed within limits.

Why: `json.loads` recurses on nesting (a document 50000 brackets deep raises RecursionError, which callers that
expect ValueError do not catch), accepts NaN and Infinity (int(Infinity) raises OverflowError later), and
builds Python objects about ten times the size of the text. Here the size is bounded before parsing, the
nesting is counted on the text without recursion, and the non-standard constants are refused: every problem is
a ValueError that names it.
"""
from __future__ import annotations

import json

import numpy as np



def _no_constant(name: str):
    raise ValueError(f"non-finite number {name}")


def check_depth(data: bytes, max_depth: int, chunk: int = 1 << 16) -> None:
    """ValueError when the JSON text nests more than max_depth arrays or objects. Brackets inside strings do not
    count (a quote ends a string unless an odd run of backslashes comes before it). Vectorised over chunks: the
    memory it takes does not grow with the text."""
    depth, inside, slashes = 0, 0, 0  # carried over chunks: nesting, within a string, backslashes just before
    for start in range(0, len(data), chunk):
        a = np.frombuffer(data, np.uint8, count=min(chunk, len(data) - start), offset=start)
        idx = np.arange(len(a), dtype=np.int32)
        last_other = np.maximum.accumulate(np.where(a == 0x5C, -1, idx))  # last non-backslash at or before i
        run = idx - last_other + np.where(last_other < 0, slashes, 0)  # backslashes ending at i
        before = np.concatenate(([slashes], run[:-1]))  # ... ending just before i
        quotes = (a == 0x22) & (before % 2 == 0)
        in_string = ((np.cumsum(quotes, dtype=np.int32) + inside) & 1).astype(bool)
        step = (((a == 0x5B) | (a == 0x7B)) & ~in_string).astype(np.int32)
        step -= ((a == 0x5D) | (a == 0x7D)) & ~in_string
        level = np.cumsum(step, dtype=np.int64) + depth
        if int(level.max()) > max_depth:
            raise ValueError(f"nests more than {max_depth} arrays or objects deep")
        depth, inside, slashes = int(level[-1]), int(in_string[-1]), int(run[-1])


def loads(data: bytes | str, *, max_bytes: int, max_depth: int):
    """The JSON value of `data`: at most max_bytes, max_depth deep, finite numbers only; ValueError otherwise
    (UTF-8 errors included)."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    if len(data) > max_bytes:
        raise ValueError(f"{len(data)} bytes, more than the {max_bytes} allowed")
    check_depth(data, max_depth)
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except RecursionError:  # cannot happen after check_depth; kept as a ValueError for the callers
        raise ValueError("nests too deep") from None


def decoder() -> json.JSONDecoder:
    """A decoder that refuses NaN and Infinity (for raw_decode on text already depth-checked)."""
    return json.JSONDecoder(parse_constant=_no_constant)
