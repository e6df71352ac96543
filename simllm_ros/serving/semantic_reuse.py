"""Runs a SEMANTIC plan: reuse aligned KV of a similar prompt, then repair it (CacheBlend / EPIC style).

1. One cheap pass through the first `strict_layers` layers gives fresh KV for
   every token there (layered reuse: strict in the early layers) and shows
   which reused tokens deviate most from their cached values (CacheBlend's
   selection); the top recompute_ratio of them are recomputed in full.
2. The repaired cache holds slot = position from the start: the strict layers' fresh KV of every token,
   and in the deeper layers the source entry's KV of every kept token, its keys rotated by how far the
   token moved (keys are stored after RoPE). It is sized for the answer, which decodes on in place.
3. Every new or changed token, the first gap_recompute_tokens after each gap
   and the selected tokens run through the model at their true positions and slots, each
   attending to every slot before it (reused or recomputed, causal by slot: no mask). They
   start above the strict layers, from the early pass's hidden rows:
   those layers saw fresh KV of every token there, so the early pass already
   computed exactly what the recompute would (~2/30 of its cost saved). The tokens are chosen between the
   last early layer's KV and the rest of that layer, which then runs for them alone (it is most of the
   layer's cost, and no other token's hidden row is used).

Devices: the stored KV lives on the pool's device (the model's). Index tensors are built on that device;
the per-token bookkeeping (which tokens to keep) stays on the CPU and is moved where it indexes KV.
"""
from __future__ import annotations

import dataclasses

import torch

from ..cache.kv_pool import KVPool
from ..model.model_backend import ModelBackend
from ..model.semantic_passes import EarlyStart
from ..cache.reuse_planner import ReusePlan


@dataclasses.dataclass
class SemanticPrefill:
    logits: torch.Tensor
    cache: object
    reused: int
    recomputed: int


def fresh_layers(strict_layers: int, n_layers: int) -> int:
    """How many layers the early pass runs. Layer-0 KV depends on the token alone (a reused token's layer-0
    values equal fresh ones), so the deviation is measured at layer 1 or deeper: two fresh layers at least, even
    for strict_layers=1."""
    return min(max(strict_layers, 2), n_layers)


def entry_capacity(n_tokens: int, reserve: int) -> int:
    """Token slots of the buffer a repair reads its source entry into (it becomes the repaired cache): the
    prompt and room for `reserve` more, at least 2."""
    return n_tokens + max(reserve, 2)


@dataclasses.dataclass
class Ahead:
    """What a repair can do before its plan is known (the engine does it while the fingerprint is computed):
    the early pass up to the choice of tokens, and the read of the entry it will most likely take."""

    early: EarlyStart
    source_key: int | None = None  # the entry read, and into what (run() takes it when its plan names it)
    capacity: int = 0
    source_kv: tuple[torch.Tensor, torch.Tensor] | None = None


def ahead(backend: ModelBackend, pool: KVPool, tokens: list[int], *, strict_layers: int, reserve: int = 0,
          prefix: tuple[torch.Tensor, torch.Tensor] | None = None, guess: int | None = None) -> Ahead:
    """The early pass up to the choice of tokens, which needs only the prompt, and the read of entry `guess`
    (None: none) as run() would read it. `prefix`: the KV of an exact prefix, bitwise what the pass computes
    (lossless_kv), which then does not run."""
    out = Ahead(backend.early_head(tokens, fresh_layers(strict_layers, backend.kv_shape.layers), prefix))
    if guess is not None:
        out.source_key, out.capacity = guess, entry_capacity(len(tokens), reserve)
        out.source_kv = pool.entry_kv(guess, capacity=out.capacity)
    return out


def run(backend: ModelBackend, pool: KVPool, plan: ReusePlan, tokens: list[int], *, recompute_ratio: float,
        gap_recompute_tokens: int, strict_layers: int, reserve: int = 0, lossless_kv: bool = False,
        early: Ahead | None = None) -> SemanticPrefill:
    """The repaired cache (position order, room for `reserve` more tokens) and the last token's logits.
    lossless_kv: the entry's KV is bitwise what a pass computes (the model's precision, a batch-invariant
    backend): then its exact lead also stands in for the early pass's, which skips those tokens. early: ahead()
    for these tokens, done before the plan was known (with a prefix only where lossless_kv)."""
    if plan.source_key is None:
        raise ValueError("a SEMANTIC plan names the entry it reuses (source_key)")
    n = len(tokens)
    capacity = entry_capacity(n, reserve)
    # Read into a buffer with room for this prompt and its answer: it becomes the repaired cache (slot = the
    # source's position, which is the new one wherever a token did not move).
    if early is not None and early.source_kv is not None and early.source_key == plan.source_key \
            and early.capacity == capacity:
        src_k, src_v = early.source_kv
    else:
        src_k, src_v = pool.entry_kv(plan.source_key, capacity=capacity)
    device, L = src_k.device, src_k.shape[0]
    new_pos = torch.tensor([p for p, _ in plan.pairs], dtype=torch.long)
    src_pos = torch.tensor([q for _, q in plan.pairs], dtype=torch.long)
    strict = min(strict_layers, L)
    n_fresh = fresh_layers(strict, L)
    probe_v = src_v[n_fresh - 1][:, src_pos.to(device)]  # [H, pairs, D]: the reused values the deviation is of
    keep = torch.ones(len(plan.pairs), dtype=torch.bool)
    recompute: list[int] = []  # positions to recompute, ascending: chosen by pick()

    def pick(fk: torch.Tensor, fv: torch.Tensor) -> list[int]:
        """The tokens to recompute, chosen from the fresh KV of the early layers. Only their hidden rows are
        needed after the early pass (and only where it covers the strict layers): it finishes its last
        layer for them alone."""
        fresh_v = fv[n_fresh - 1][:, new_pos.to(fv.device)].float()
        dev = (fresh_v - probe_v.to(fv.device).float()).norm(dim=(0, 2)).cpu()
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

    lead = (src_k[:n_fresh, :, :plan.exact_lead], src_v[:n_fresh, :, :plan.exact_lead]) if lossless_kv else None
    fk, fv, fh = backend.early_layers(tokens, n_fresh, pick, prefix=lead, head=None if early is None else early.early)
    if not keep.any():  # nothing survives the repair: a plain prefill is the same work
        logits, cache = backend.prefill(tokens, reserve=reserve)
        return SemanticPrefill(logits, cache, reused=0, recomputed=n)
    # The repaired cache, slot = position, in the buffer the entry was read into: the entry's KV of every
    # aligned token in the deeper layers (moved where the token moved, keys rotated with it: stored after RoPE),
    # fresh KV of the strict layers for every token (layered reuse; the recomputed tokens' too, which they
    # resume above). A recomputed token's deeper slots are written over by its pass.
    cut = torch.ones(len(new_pos), dtype=torch.bool)
    cut[1:] = (new_pos[1:] != new_pos[:-1] + 1) | (src_pos[1:] != src_pos[:-1] + 1)
    starts = cut.nonzero()[:, 0].tolist() + [len(new_pos)]
    moves = [(int(new_pos[i]), int(src_pos[i]), j - i) for i, j in zip(starts[:-1], starts[1:])
             if new_pos[i] != src_pos[i]]
    moved = [(a, b, m, src_k[strict:, :, b:b + m].clone(), src_v[strict:, :, b:b + m].clone()) for a, b, m in moves]
    cache = backend.cache_from_tensors(src_k, src_v, reserve=max(capacity - src_k.shape[2], 2))  # no copy: adopted
    storage = backend.cache_storage(cache)
    if storage is None:  # not reached: cache_from_tensors adopts the tensors into a buffer, whose storage this is
        raise TypeError(f"{type(cache).__name__} has no storage to repair in place")
    ck, cv = storage
    for a, b, m, k_run, v_run in moved:  # every run's source read before any is written
        ck[strict:, :, a:a + m] = backend.rotate_keys(k_run, torch.full((m,), a - b, dtype=torch.long, device=device),
                                                  first_layer=strict)
        cv[strict:, :, a:a + m] = v_run
    ck[:strict, :, :n] = fk[:strict]
    cv[:strict, :, :n] = fv[:strict]
    cache.length = n
    ids = [tokens[p] for p in recompute]
    if strict == n_fresh:  # the early pass already ran the recomputed tokens through every strict layer
        logits = backend.resume_prefill(ids, cache, recompute, fh, strict)  # fh: exactly these rows (pick's answer)
    else:  # its last layer saw reused KV of the other tokens: the recomputed ones start from the bottom
        logits = backend.run(ids, cache, positions=recompute)
    return SemanticPrefill(logits, cache, reused=int(keep.sum()), recomputed=len(recompute))
