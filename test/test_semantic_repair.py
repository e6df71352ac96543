"""semantic_reuse.run builds its cache where the entry was read (slot = position) and recomputes tokens at their
slots: what it keeps must be the entry's KV moved with its tokens, and what it recomputes must be what a cold
prefill computes. Real model (bf16 4-bit, KV stored at the model's precision), real pool."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from core_fixtures import BULLETIN, shared_engine
from simllm_ros import semantic_reuse
from simllm_ros.kv_pool import KVPool
from simllm_ros.request import CacheResult
from simllm_ros.reuse_planner import ReusePlan, align

SYSTEM = "You are a helpful city assistant. Answer briefly."
QUESTION = "Which road is closed this afternoon, and where can I park?"


@pytest.fixture(scope="module")
def backend():
    return shared_engine(dtype="bfloat16", kv_bits=0).backend


def _pool_with(backend, ids: list[int]) -> tuple[KVPool, int]:
    """A pool holding one entry: ids and their KV from a cold prefill."""
    pool = KVPool(backend.kv_shape, block_tokens=16, budget_bytes=64 * 2**20, kv_bits=0, model_dtype=backend.dtype,
                  fingerprint_dim=4)
    _, cache = backend.prefill(ids)
    k, v = backend.cache_tensors(cache)
    key = pool.insert(scope="s", tokens=ids, k=k, v=v, fingerprint=np.ones(4, dtype=np.float32), question="q",
                      context_digest="d", answer="")
    assert key is not None
    return pool, key


def _plan(source: list[int], target: list[int], key: int) -> ReusePlan:
    pairs = align(source, target, len(target) - 1)
    lead = 0
    while lead < len(pairs) and pairs[lead] == (lead, lead):
        lead += 1
    return ReusePlan(CacheResult.SEMANTIC, "test", 0.9, key, pairs=pairs, exact_lead=lead)


def _prompts(backend, before: str, after: str, question: str = QUESTION) -> tuple[list[int], list[int]]:
    return (backend.prompt_ids(SYSTEM, before, QUESTION), backend.prompt_ids(SYSTEM, after, question))


# Target contexts against the bulletin: words inserted early (every later token moves right), a sentence cut
# (later tokens move left; the entry is longer than the new prompt plus its room), and both at once.
EDITS = {
    "inserted": lambda b: b.replace("Riverside", "Riverside (north bank, by the old mill)", 1),
    "cut": lambda b: b[: len(b) // 3] + b[len(b) // 3 + 160:],
    "both": lambda b: (b[: len(b) // 4] + " Extra notice: the ferry runs late tonight." + b[len(b) // 4:])[:-120],
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_kept_tokens_hold_the_entry_kv_moved_with_them(backend, edit):
    """recompute_ratio 0 and no gap tokens: every aligned token keeps the entry's KV in the deeper layers (keys
    rotated by how far it moved, values as stored), the strict layers hold the early pass's fresh KV."""
    source, target = _prompts(backend, BULLETIN, EDITS[edit](BULLETIN))
    pool, key = _pool_with(backend, source)
    plan = _plan(source, target, key)
    shifts = {p - q for p, q in plan.pairs}
    assert len(shifts) > 1, "the edit should move some tokens"
    sp = semantic_reuse.run(backend, pool, plan, target, recompute_ratio=0.0, gap_recompute_tokens=0,
                            strict_layers=2, reserve=0, lossless_kv=True)
    n = len(target)
    k, v = backend.cache_tensors(sp.cache)
    assert k.shape[2] == n and backend.cache_len(sp.cache) == n
    src_k, src_v = pool.entry_kv(key)
    fk, fv, _ = backend.early_layers(target, 2)
    assert torch.equal(k[:2], fk) and torch.equal(v[:2], fv)
    kept = [(p, q) for p, q in plan.pairs if p not in set(_recomputed(sp, plan, n))]
    assert len(kept) == sp.reused
    new = torch.tensor([p for p, _ in kept])
    old = torch.tensor([q for _, q in kept])
    assert torch.equal(v[2:, :, new], src_v[2:, :, old])
    want = backend.rotate_keys(src_k[2:, :, old], new - old)
    assert torch.allclose(k[2:, :, new].float(), want.float(), atol=1e-2, rtol=1e-2)
    same = new == old
    assert torch.equal(k[2:, :, new[same]], src_k[2:, :, old[same]])  # unmoved keys: the stored bits


def _recomputed(sp, plan, n: int) -> list[int]:
    """The positions the repair recomputed: not aligned, or (ratio 0, no gaps) none else."""
    aligned = {p for p, _ in plan.pairs}
    out = [p for p in range(n) if p not in aligned]
    assert len(out) == sp.recomputed
    return out


@pytest.mark.parametrize("edit", list(EDITS))
def test_recomputing_every_changed_token_gives_the_cold_prefill(backend, edit):
    """recompute_ratio 1: only the exact lead is kept (its KV is exact), every other token runs at its slot
    from the strict layers up: the cache and the first-token logits are a cold prefill's, bitwise on a
    batch-invariant backend (the recomputed tokens attend keys in position order, as the cold pass does)."""
    source, target = _prompts(backend, BULLETIN, EDITS[edit](BULLETIN), "Where can I park near the stadium?")
    pool, key = _pool_with(backend, source)
    plan = _plan(source, target, key)
    assert 0 < plan.exact_lead < len(plan.pairs)
    sp = semantic_reuse.run(backend, pool, plan, target, recompute_ratio=1.0, gap_recompute_tokens=2,
                            strict_layers=2, reserve=40, lossless_kv=True)
    assert sp.reused == plan.exact_lead and sp.recomputed == len(target) - plan.exact_lead
    cold_logits, cold = backend.prefill(target)
    n = len(target)
    k, v = backend.cache_tensors(sp.cache)
    ck, cv = backend.cache_tensors(cold)
    assert sp.cache.capacity >= n + 40  # the answer decodes on in place
    if backend.exact_chunking:
        assert torch.equal(sp.logits, cold_logits)
        assert torch.equal(k, ck[:, :, :n]) and torch.equal(v, cv[:, :, :n])
    assert int(sp.logits.argmax()) == int(cold_logits.argmax())
