"""Runs a SEMANTIC plan: reuse aligned KV of a similar prompt, then repair it (CacheBlend / EPIC style).

1. Take the source entry's KV of every aligned token and rotate its keys by
   how far the token moved (keys are stored after RoPE).
2. One cheap pass through the first `strict_layers` layers gives fresh KV for
   every token there (layered reuse: strict in the early layers) and shows
   which reused tokens deviate most from their cached values (CacheBlend's
   selection); the top recompute_ratio of them are recomputed in full.
3. Every new or changed token, the first gap_recompute_tokens after each gap
   and the selected tokens are run through the model at their true positions,
   attending (through an explicit mask) to reused tokens before them. They
   start above the strict layers, from the early pass's hidden rows and KV:
   those layers saw fresh KV of every token there, so the early pass already
   computed exactly what the recompute would (~2/30 of its cost saved). The tokens are chosen between the
   last early layer's KV and the rest of that layer, which then runs for them alone (it is most of the
   layer's cost, and no other token's hidden row is used).
The result is a position-ordered cache ready for decoding.

Devices: the stored KV lives on the pool's device (the model's). Index tensors are built on that device;
the per-token bookkeeping (which tokens to keep) stays on the CPU and is moved where it indexes KV.
"""
from __future__ import annotations

import dataclasses

import torch

from .kv_pool import KVPool
from .model_backend import ModelBackend
from .reuse_planner import ReusePlan


@dataclasses.dataclass
class SemanticPrefill:
    logits: torch.Tensor
    cache: object
    reused: int
    recomputed: int


def run(backend: ModelBackend, pool: KVPool, plan: ReusePlan, tokens: list[int], *, recompute_ratio: float,
        gap_recompute_tokens: int, strict_layers: int, reserve: int = 0) -> SemanticPrefill:
    """The repaired cache (position order, room for `reserve` more tokens) and the last token's logits."""
    n = len(tokens)
    src_k, src_v = pool.entry_kv(plan.source_key)
    device, L = src_k.device, src_k.shape[0]
    new_pos = torch.tensor([p for p, _ in plan.pairs], dtype=torch.long)
    src_pos = torch.tensor([q for _, q in plan.pairs], dtype=torch.long)
    strict = min(strict_layers, L)
    # Layer-0 KV depends on the token alone (a reused token's layer-0 values equal fresh ones), so the
    # deviation is measured at layer 1 or deeper: two fresh layers at least, even for strict_layers=1.
    n_fresh = min(max(strict, 2), L)
    probe_v = src_v[n_fresh - 1][:, src_pos.to(device)]  # [H, pairs, D]: the reused values the deviation is of
    keep = torch.ones(len(plan.pairs), dtype=torch.bool)
    recompute: list[int] = []  # positions to recompute, ascending: chosen by pick()

    def pick(fk: torch.Tensor, fv: torch.Tensor) -> list[int]:
        """The tokens to recompute, chosen from the fresh KV of the early layers. Only their hidden rows are
        needed after the early pass (and only where it covers the strict layers): it finishes its last
        layer for them alone."""
        dev = (fv[n_fresh - 1][:, new_pos.to(fv.device)].float() - probe_v.to(fv.device).float()).norm(dim=(0, 2)).cpu()
        # Tokens right after each gap saw a different left context most recently: recompute them.
        idx = torch.arange(len(new_pos))
        gap = (new_pos != torch.cat([new_pos.new_tensor([-1]), new_pos[:-1]]) + 1) & (idx >= plan.exact_lead)
        for o in range(gap_recompute_tokens):  # the first gap_recompute_tokens pairs from each gap on
            keep[(idx[gap] + o)[idx[gap] + o < len(new_pos)]] = False
        # The most deviating of the approximate (non-exact-lead) reused tokens.
        approx_idx = torch.arange(plan.exact_lead, len(plan.pairs))
        n_sel = int(round(recompute_ratio * len(approx_idx)))
        if n_sel > 0:
            order = torch.argsort(dev[approx_idx], descending=True)[:n_sel]
            keep[approx_idx[order]] = False
        redo = torch.ones(n, dtype=torch.bool)
        redo[new_pos[keep]] = False
        recompute.extend(redo.nonzero()[:, 0].tolist())
        return recompute if strict == n_fresh and keep.any() else []

    fk, fv, fh = backend.early_layers(tokens, n_fresh, pick)
    if not keep.any():  # nothing survives the repair: a plain prefill is the same work
        logits, cache = backend.prefill(tokens, reserve=reserve)
        return SemanticPrefill(logits, cache, reused=0, recomputed=n)
    # The kept tokens' KV, read once from the entry into the buffer the repair runs in: fresh KV of the strict
    # layers (layered reuse), the entry's deeper, keys moved with their tokens (stored after RoPE).
    kept_pos, kept_src = new_pos[keep], src_pos[keep]
    nk, nr = len(kept_pos), len(recompute)
    work = backend.new_cache(nk + nr + 2)
    wk, wv = backend.cache_storage(work)
    at_src = kept_src.to(device)
    wk[:strict, :, :nk] = fk[:strict].index_select(2, kept_pos.to(fk.device))  # (index_select + copy: ~2x
    wv[:strict, :, :nk] = fv[:strict].index_select(2, kept_pos.to(fv.device))  # faster than indexed assignment)
    wk[strict:, :, :nk] = src_k[strict:].index_select(2, at_src)
    wv[strict:, :, :nk] = src_v[strict:].index_select(2, at_src)
    moved = (kept_pos != kept_src).nonzero()[:, 0]
    if len(moved):
        at = moved.to(device)
        wk[strict:, :, at] = backend.rotate_keys(wk[strict:][:, :, at], (kept_pos - kept_src)[moved])
    work.length = nk
    q_pos = torch.tensor(recompute, dtype=torch.long)
    kv_pos = torch.cat([kept_pos, q_pos])
    mask = kv_pos[None, :] <= q_pos[:, None]  # [q, kv]: each recomputed token sees what precedes it (run() moves it)
    ids = [tokens[p] for p in recompute]
    if strict == n_fresh:  # the early pass already ran the recomputed tokens through every strict layer
        rec = q_pos.to(fk.device)  # fh holds exactly these rows (pick's answer)
        logits = backend.resume_prefill(ids, work, recompute, mask, fh, fk[:, :, rec], fv[:, :, rec])
    else:  # its last layer saw reused KV of the other tokens: the recomputed ones start from the bottom
        logits, work = backend.prefill(ids, work, positions=recompute, mask=mask)
    # Slot = position from here on (decoding appends in order): one scatter of the repaired KV.
    cache = backend.new_cache(n + max(reserve, 2))
    ck, cv = backend.cache_storage(cache)
    wk, wv = backend.cache_storage(work)
    order = torch.argsort(kv_pos).to(device)
    ck[:, :, :n] = wk[:, :, :n].index_select(2, order)
    cv[:, :, :n] = wv[:, :, :n].index_select(2, order)
    cache.length = n
    return SemanticPrefill(logits, cache, reused=nk, recomputed=nr)
