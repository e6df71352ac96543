"""A KV prefix fetched from the fleet, checked against this node's own arithmetic before it is used as exact.

A block's seal says which fleet wrote it, not that it is right: a robot with a bad RAM bit or a bug seals wrong
values as readily as right ones. So the last positions of a fetched prefix are computed again here, on top of the
fetched rest, and must equal the fetched ones bit for bit (KV is shared only where the backend is batch-invariant:
the same bits however a prompt is split). The last positions read every earlier position's KV at every layer, so
a wrong value anywhere in the prefix shows in theirs, save one in the last layer that nothing after it reads.
"""
from __future__ import annotations

import torch

VERIFY_TOKENS = 4  # positions recomputed at the end of a fetched prefix (a short pass over the prefix's KV)


def prefix_differs(backend, tokens: list[int], prefix) -> str:
    """Why the fetched prefix (FleetPrefix: k, v [L, H, n, D]) is not what this node computes for tokens[:n],
    or "" when its last positions match bit for bit."""
    n = prefix.n_tokens
    m = min(VERIFY_TOKENS, n - 1)
    if m <= 0:
        return ""
    want_k, want_v = prefix.k[:, :, n - m:n].clone(), prefix.v[:, :, n - m:n].clone()
    # the cache may adopt the prefix's buffer: the recompute then writes its slots n-m..n again (same bits or dropped)
    cache = backend.cache_from_tensors(prefix.k[:, :, :n - m], prefix.v[:, :, :n - m], reserve=m)
    backend.run(tokens[n - m:n], cache, logits="none")
    got_k, got_v = backend.cache_tensors(cache)
    for name, got, want in (("K", got_k[:, :, n - m:n], want_k), ("V", got_v[:, :, n - m:n], want_v)):
        got = got.to(want.device, want.dtype)
        if not torch.equal(got, want):
            bad = (got != want).nonzero()
            layer, pos = int(bad[0, 0]), n - m + int(bad[0, 2])
            return f"{name} differs at layer {layer}, position {pos} ({len(bad)} values of the last {m} positions)"
    return ""
