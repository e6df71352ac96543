"""RoPE repair is exact for layer 0: a moved token's re-rotated key equals a fresh computation at its new place.

A layer-0 key depends only on the token and its position (no attention before it), so a token moved by d
positions must have key R(d)·k_old exactly; without the rotation the stored key is wrong. The embedded model and a
random Gemma 3 (sliding-window layers with their own RoPE base) both; the repair's passes on both too.
"""
import pytest
import torch

from core_fixtures import BULLETIN, BULLETIN_REVISED, shared_backend, shared_engine
from random_gemma import gemma_backend

MOVED = "Is Elm Street open between 3rd Avenue and Mill Road this afternoon?"


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def backend(request):
    """float32: the embedded model, and a random Gemma 3 (its layer 0 is a sliding layer, on its own RoPE base)."""
    return gemma_backend("float32") if request.param == "gemma3" else shared_backend()


def _model_backend(model: str, dtype: str):
    if model == "gemma3":
        return gemma_backend(dtype)
    return shared_backend() if dtype == "float32" else shared_engine(dtype="bfloat16", kv_bits=0).backend


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


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_resuming_above_the_early_layers_equals_running_them_again(model, dtype, path):
    """Semantic repair's recomputed tokens run at the slots of their positions, among the other tokens' KV,
    starting above the strict layers from the early pass's hidden rows and KV. With every other token's KV
    fresh, that is the same computation as a full pass: scattered tokens, run from the bottom or resumed,
    give the whole pass's last-token logits and KV (bitwise where the runner is batch-invariant), and the same
    next token."""
    backend = _model_backend(model, dtype)
    runner, kernel = backend.runner, backend.runner.kernel
    if path == "torch":
        runner.kernel = None
    elif kernel is None:
        pytest.skip("no attention kernel on this machine")
    try:
        _resume_and_rerun(backend)
    finally:
        runner.kernel = kernel


def _resume_and_rerun(backend):
    ids = backend.tokenizer(BULLETIN[:900] + " " + MOVED, add_special_tokens=False)["input_ids"]
    n = len(ids)
    redo = sorted(set(range(40, n, 9)) | {n - 1})  # tokens to recompute, scattered, the last one included
    full = backend.new_cache(n + 2)
    whole = backend.run(ids, full, logits="last")
    fk, fv, fh = backend.early_layers(ids, 2)
    assert fh.shape == (n, backend.model.config.hidden_size)
    rec = torch.tensor(redo)

    def others_only():  # the full cache with the recomputed tokens' slots spoiled in every layer
        c = backend.cache_from_tensors(full.k[:, :, :n].clone(), full.v[:, :, :n].clone(), reserve=4)
        c.k[:, :, rec] = 3e38  # no key or value is near it: a slot left unwritten would show
        c.v[:, :, rec] = -3e38
        return c

    again_cache = others_only()
    again = backend.run([ids[p] for p in redo], again_cache, positions=redo)
    resumed_cache = others_only()
    resumed_cache.k[:2, :, rec] = fk[:, :, rec]  # the strict layers' KV of every token: the early pass's
    resumed_cache.v[:2, :, rec] = fv[:, :, rec]
    resumed = backend.resume_prefill([ids[p] for p in redo], resumed_cache, redo, fh[rec], 2)
    for out, cache in ((again, again_cache), (resumed, resumed_cache)):
        assert cache.length == n
        if backend.exact_chunking:  # a batch-invariant runner: bitwise the whole pass
            assert torch.equal(out, whole)
            assert torch.equal(cache.k[:, :, :n], full.k[:, :, :n]) and torch.equal(cache.v[:, :, :n], full.v[:, :, :n])
        assert int(out.argmax()) == int(whole.argmax())
        assert (out - whole).abs().max() <= 0.05 * whole.abs().max()
        assert float(cache.k[2:, :, rec].abs().max()) < 1e37  # every deeper layer recomputed


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_an_early_pass_finished_for_some_tokens_gives_their_rows_bitwise(model, dtype, path):
    """Semantic repair picks its recomputed tokens from the last early layer's KV and finishes that layer for
    them alone: their hidden rows and every token's KV must be those of the whole early pass (the recompute
    starts from them), for scattered picks, one token, and none: bitwise where the runner is batch-invariant
    (the default 4-bit models, with our attention kernel), else to float32 rounding (the torch path's float32
    attention products, MKL's, change with row count; the load-time probe checked the kernel path)."""
    backend = _model_backend(model, dtype)
    exact = backend.exact_chunking and not (path == "torch" and dtype == "float32")
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
        for rows in (sorted({0, 3, n - 1} | set(range(40, n, 7))), [n - 1], [17], [0], []):
            seen = {}

            def pick(k, v, rows=rows):
                seen["k"], seen["v"] = k.clone(), v.clone()
                return rows
            pk, pv, ph = backend.early_layers(ids, 2, pick)
            assert torch.equal(seen["k"], fk) and torch.equal(seen["v"], fv)  # pick sees the fresh KV
            assert torch.equal(pk, fk) and torch.equal(pv, fv)
            assert ph.shape == (len(rows), fh.shape[1])
            want = fh[torch.tensor(rows, dtype=torch.long)]
            if exact:
                assert torch.equal(ph, want)
            elif rows:
                assert (ph - want).abs().max() <= 1e-4 * max(float(want.abs().max()), 1.0)
        # An exact prefix's KV given (what semantic repair takes from its source entry at the model's precision):
        # its tokens do not run, and the rest is the same.
        lead = 40
        for rows in (sorted({lead, n - 1} | set(range(50, n, 7))), [n - 1]):
            pk, pv, ph = backend.early_layers(ids, 2, lambda k, v, rows=rows: rows,
                                              prefix=(fk[:, :, :lead].clone(), fv[:, :, :lead].clone()))
            want = fh[torch.tensor(rows, dtype=torch.long)]
            if exact:
                assert torch.equal(pk, fk) and torch.equal(pv, fv) and torch.equal(ph, want)
            else:
                assert torch.equal(pk[:, :, :lead], fk[:, :, :lead])
                assert (pk - fk).abs().max() <= 1e-4 * max(float(fk.abs().max()), 1.0)
                assert (ph - want).abs().max() <= 1e-4 * max(float(want.abs().max()), 1.0)
        with pytest.raises(ValueError, match="prefix"):
            backend.early_layers(ids, 2, lambda k, v: [lead - 1, lead], prefix=(fk[:, :, :lead], fv[:, :, :lead]))
    finally:
        runner.kernel = kernel
