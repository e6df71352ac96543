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
        gap_recompute_tokens: int, strict_layers: int) -> SemanticPrefill:
    n = len(tokens)
    src_k, src_v = pool.entry_kv(plan.source_key)
    device = src_k.device
    new_pos = torch.tensor([p for p, _ in plan.pairs], dtype=torch.long, device=device)
    src_pos = torch.tensor([q for _, q in plan.pairs], dtype=torch.long, device=device)
    # Layered reuse + selection: fresh KV of the first layers for all tokens (their reused keys are not rotated).
    strict = min(strict_layers, src_k.shape[0])
    k = torch.empty((src_k.shape[0], src_k.shape[1], len(plan.pairs), src_k.shape[3]), dtype=src_k.dtype, device=device)
    k[strict:] = backend.rotate_keys(src_k[strict:][:, :, src_pos], new_pos - src_pos)
    v = src_v[:, :, src_pos].clone()
    # Layer-0 KV depends on the token alone (a reused token's layer-0 values equal fresh ones), so the
    # deviation is measured at layer 1 or deeper: two fresh layers at least, even for strict_layers=1.
    n_fresh = min(max(strict, 2), k.shape[0])
    keep = torch.ones(len(plan.pairs), dtype=torch.bool)
    recompute: list[int] = []  # positions to recompute, ascending: chosen by pick()

    def pick(fk: torch.Tensor, fv: torch.Tensor) -> list[int]:
        """The tokens to recompute, chosen from the fresh KV of the early layers. Only their hidden rows are
        needed after the early pass (and only where it covers the strict layers): it finishes its last
        layer for them alone."""
        dev = (fv[n_fresh - 1][:, new_pos].float() - v[n_fresh - 1].float()).norm(dim=(0, 2)).cpu()  # [reused]
        # Tokens right after each gap saw a different left context most recently: recompute them.
        pos = new_pos.cpu()
        idx = torch.arange(len(pos))
        gap = (pos != torch.cat([pos.new_tensor([-1]), pos[:-1]]) + 1) & (idx >= plan.exact_lead)
        for o in range(gap_recompute_tokens):  # the first gap_recompute_tokens pairs from each gap on
            keep[(idx[gap] + o)[idx[gap] + o < len(pos)]] = False
        # The most deviating of the approximate (non-exact-lead) reused tokens.
        approx_idx = torch.arange(plan.exact_lead, len(plan.pairs))
        n_sel = int(round(recompute_ratio * len(approx_idx)))
        if n_sel > 0:
            order = torch.argsort(dev[approx_idx], descending=True)[:n_sel]
            keep[approx_idx[order]] = False
        redo = torch.ones(n, dtype=torch.bool)
        redo[pos[keep]] = False
        recompute.extend(redo.nonzero()[:, 0].tolist())
        return recompute if strict == n_fresh and keep.any() else []

    fk, fv, fh = backend.early_layers(tokens, n_fresh, pick)
    fk, fv = fk.to(device, k.dtype), fv.to(device, v.dtype)
    k[:strict] = fk[:strict][:, :, new_pos]
    v[:strict] = fv[:strict][:, :, new_pos]

    if not keep.any():  # nothing survives the repair: a plain prefill is the same work
        logits, cache = backend.prefill(tokens)
        return SemanticPrefill(logits, cache, reused=0, recomputed=n)
    keep_d = keep.to(device)
    kept_pos = new_pos[keep_d].cpu()
    cache = backend.cache_from_tensors(k[:, :, keep_d], v[:, :, keep_d])
    q_pos = torch.tensor(recompute, dtype=torch.long)
    kv_pos = torch.cat([kept_pos, q_pos])
    mask = kv_pos[None, :] <= q_pos[:, None]  # [q, kv]: each recomputed token sees what precedes it (run() moves it)
    ids = [tokens[p] for p in recompute]
    if strict == n_fresh:  # the early pass already ran the recomputed tokens through every strict layer
        rec = q_pos.to(device)  # fh holds exactly these rows (pick's answer)
        logits = backend.resume_prefill(ids, cache, recompute, mask, fh, fk[:, :, rec], fv[:, :, rec])
    else:  # its last layer saw reused KV of the other tokens: the recomputed ones start from the bottom
        logits, cache = backend.prefill(ids, cache, positions=recompute, mask=mask)
    K, V = backend.cache_tensors(cache)
    order = torch.argsort(kv_pos).to(K.device)
    cache = backend.cache_from_tensors(K[:, :, order], V[:, :, order])
    return SemanticPrefill(logits, cache, reused=int(keep.sum()), recomputed=len(recompute))
