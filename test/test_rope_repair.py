"""RoPE repair is exact for layer 0: a moved token's re-rotated key equals a fresh computation at its new place.

A layer-0 key depends only on the token and its position (no attention before it), so a token moved by d
positions must have key R(d)·k_old exactly; without the rotation the stored key is wrong.
"""
import pytest
import torch

from core_fixtures import BULLETIN, BULLETIN_REVISED, shared_backend, shared_engine

MOVED = "Is Elm Street open between 3rd Avenue and Mill Road this afternoon?"


@pytest.fixture(scope="module")
def backend():
    return shared_backend()


def _layer0_keys(backend, ids):
    k, _, _ = backend.early_layers(ids, 1)
    return k  # [1, H, n, D]


@pytest.mark.parametrize("d", [1, 7, 64, 250, -1, -5, -48, -250])
def test_layer0_key_rotation_matches_fresh(backend, d):
    tok = backend.tokenizer
    moved = tok(MOVED, add_special_tokens=False)["input_ids"]
    filler = tok(BULLETIN + BULLETIN_REVISED, add_special_tokens=False)["input_ids"]
    base = 255  # the moved tokens start here in the "old" sequence
    assert len(filler) >= base + max(0, d), "bulletin too short for this shift"
    old_ids = filler[:base] + moved
    new_ids = filler[:base + d] + moved  # same tokens, d positions later (earlier for d < 0)
    k_old = _layer0_keys(backend, old_ids)[:, :, base:]
    k_new = _layer0_keys(backend, new_ids)[:, :, base + d:]
    assert k_old.dtype == torch.float32 and k_old.shape == k_new.shape

    delta = torch.full((len(moved),), d, dtype=torch.long)
    rotated = backend.rotate_keys(k_old, delta)
    err = float((rotated - k_new).abs().max())
    stale = float((k_old - k_new).abs().max())
    print(f"\nrope d={d:+4d}: max|rotated - fresh| = {err:.2e}, max|unrotated - fresh| = {stale:.2e}")
    assert err < 1e-4
    assert stale > 1e-2, "without rotation the key must differ (else this test could not fail)"
    # Values carry no position: they are equal without any repair.
    _, v_old, _ = backend.early_layers(old_ids, 1)
    _, v_new, _ = backend.early_layers(new_ids, 1)
    assert float((v_old[:, :, base:] - v_new[:, :, base + d:]).abs().max()) < 1e-5


def test_rotation_per_token_deltas(backend):
    """Different tokens moved by different amounts in one call (what the SEMANTIC tier does)."""
    tok = backend.tokenizer
    filler = tok(BULLETIN, add_special_tokens=False)["input_ids"]
    ids = filler[:120]
    k = _layer0_keys(backend, ids)
    # Reference: the same tokens placed at positions 40 later, computed fresh.
    k_shift = _layer0_keys(backend, filler[120:160] + ids)[:, :, 40:]
    deltas = torch.full((len(ids),), 40, dtype=torch.long)
    deltas[::2] = 0  # every other token is not moved: its key must stay as it was
    rotated = backend.rotate_keys(k, deltas)
    assert float((rotated[:, :, 1::2] - k_shift[:, :, 1::2]).abs().max()) < 1e-4
    assert torch.equal(rotated[:, :, ::2], k[:, :, ::2]) or float((rotated[:, :, ::2] - k[:, :, ::2]).abs().max()) < 1e-6


def test_resuming_above_the_early_layers_equals_running_them_again(backend):
    """Semantic repair's recomputed tokens start above the strict layers from the early pass's hidden rows
    and KV. With every other token's KV fresh, that is the same computation as a full pass of those tokens:
    scattered tokens (masked, out of order) get the same last-token logits either way (bitwise where the
    runner is batch-invariant), and the same next token."""
    ids = backend.tokenizer(BULLETIN[:900] + " " + MOVED, add_special_tokens=False)["input_ids"]
    n = len(ids)
    redo = sorted(set(range(40, n, 9)) | {n - 1})  # tokens to recompute, scattered, the last one included
    keep = [p for p in range(n) if p not in set(redo)]
    full = backend.new_cache(n + 2)
    backend.run(ids, full, logits="none")
    fk, fv, fh = backend.early_layers(ids, 2)
    assert fh.shape == (n, backend.model.config.hidden_size)
    kv_pos = torch.tensor(keep + redo)
    mask = kv_pos[None, :] <= torch.tensor(redo)[:, None]

    def cache_of_kept():
        return backend.cache_from_tensors(full.k[:, :, keep].clone(), full.v[:, :, keep].clone())

    again = backend.run([ids[p] for p in redo], cache_of_kept(), redo, mask)
    rec = torch.tensor(redo)
    resumed_cache = cache_of_kept()
    resumed = backend.resume_prefill([ids[p] for p in redo], resumed_cache, redo, mask, fh[rec], fk[:, :, rec], fv[:, :, rec])
    if backend.exact_chunking:  # a batch-invariant runner: bitwise the same
        assert torch.equal(resumed, again)
    assert int(resumed.argmax()) == int(again.argmax())
    assert (resumed - again).abs().max() <= 0.05 * again.abs().max()
    # The strict layers' KV of the recomputed tokens is the early pass's, the deeper layers' their own.
    assert torch.equal(resumed_cache.k[:2, :, len(keep):n], fk[:, :, rec])
    assert not torch.equal(resumed_cache.k[2:, :, len(keep):n], torch.zeros_like(resumed_cache.k[2:, :, len(keep):n]))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_an_early_pass_finished_for_some_tokens_gives_their_rows_bitwise(dtype, path):
    """Semantic repair picks its recomputed tokens from the last early layer's KV and finishes that layer for
    them alone: their hidden rows and every token's KV must be those of the whole early pass (the recompute
    starts from them), for scattered picks, one token, and none: bitwise where the runner is batch-invariant
    (the default bf16 4-bit model), else to float32 rounding (MKL's float32 products change with row count)."""
    backend = shared_backend() if dtype == "float32" else shared_engine(dtype="bfloat16", kv_bits=0).backend
    ids = backend.tokenizer(BULLETIN[:900] + " " + MOVED, add_special_tokens=False)["input_ids"]
    n = len(ids)
    runner = backend.runner
    kernel = runner.kernel
    if path == "torch":
        runner.kernel = None
    elif kernel is None:
        pytest.skip("no attention kernel on this machine")
    try:
        fk, fv, fh = backend.early_layers(ids, 2)
        for rows in (sorted({0, 3, n - 1} | set(range(40, n, 7))), [n - 1], [17], []):
            seen = {}

            def pick(k, v, rows=rows):
                seen["k"], seen["v"] = k.clone(), v.clone()
                return rows
            pk, pv, ph = backend.early_layers(ids, 2, pick)
            assert torch.equal(seen["k"], fk) and torch.equal(seen["v"], fv)  # pick sees the fresh KV
            assert torch.equal(pk, fk) and torch.equal(pv, fv)
            assert ph.shape == (len(rows), fh.shape[1])
            want = fh[torch.tensor(rows, dtype=torch.long)]
            if backend.exact_chunking:
                assert torch.equal(ph, want)
            elif rows:
                assert (ph - want).abs().max() <= 1e-4 * max(float(want.abs().max()), 1.0)
    finally:
        runner.kernel = kernel
