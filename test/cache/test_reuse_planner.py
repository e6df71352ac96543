"""reuse_planner.plan's decision table, on a real but tiny KV pool (random KV, no model).

Token layout of a request: a system block (1..8), a context (100..159) and a question; the
fingerprints are built at a chosen cosine to the request's, so each row of the table is reached on
purpose. The `similarity` contract of Query.srv is checked for every tier.
"""
import numpy as np
import pytest
import torch

from simllm_ros.cache import reuse_planner
from simllm_ros.cache.block_store import BlockStore, KVShape
from simllm_ros.cache.kv_pool import KVPool
from simllm_ros.request import CacheResult
from simllm_ros.settings import Settings

SHAPE = KVShape(layers=2, kv_heads=1, head_dim=4)
DIM = 16
NOW = 10_000.0
SYSTEM = list(range(1, 9))
CONTEXT = list(range(100, 160))
QUESTION = [200, 201, 202, 203, 204, 205]
CACHED = SYSTEM + CONTEXT + QUESTION
# The context revised in one place, and another question: an exact prefix of 18 tokens, then aligned runs.
REVISED = SYSTEM + CONTEXT[:10] + [999] + CONTEXT[11:] + [300, 301, 302, 303, 304, 305]

Q = np.eye(DIM, dtype=np.float32)[0]  # the request's fingerprint


def at_cosine(c: float) -> np.ndarray:
    """A unit fingerprint whose cosine to Q is exactly c."""
    v = c * Q + np.sqrt(max(0.0, 1 - c * c)) * np.eye(DIM, dtype=np.float32)[1]
    return v.astype(np.float32)


def make_pool(kv_bits=32):
    per = BlockStore.bytes_per_block_for(SHAPE, 4, kv_bits, torch.float32)
    return KVPool(SHAPE, block_tokens=4, budget_bytes=200 * per, kv_bits=kv_bits, model_dtype=torch.float32,
                  fingerprint_dim=DIM)


def cache(pool, tokens=CACHED, cos=0.9, scope="s", question="is elm street open today", answer="Yes, until 17:00.",
          digest="ctx-1", created=NOW):
    k = torch.randn(SHAPE.layers, SHAPE.kv_heads, len(tokens), SHAPE.head_dim)
    return pool.insert(scope=scope, tokens=tokens, k=k, v=k.clone(), fingerprint=at_cosine(cos), question=question,
                       context_digest=digest, answer=answer, now=created, created=created)


def plan(pool, tokens=REVISED, *, scope="s", question="is elm street open today", digest="ctx-1",
         allow_approximate=True, semantic_supported=True, use_kv=True, lossless_kv=None, **settings):
    s = Settings.from_overrides(**settings)
    return reuse_planner.plan(pool, tokens=tokens, scope=scope, fingerprint=Q, question=question,
                              context_digest=digest, allow_approximate=allow_approximate, settings=s,
                              semantic_supported=semantic_supported, now=NOW, use_kv=use_kv, lossless_kv=lossless_kv)


# ------------------------------------------------------------------------------------------ MISS
def test_empty_scope_is_a_miss_with_similarity_zero():
    pool = make_pool()
    cache(pool, scope="other", cos=1.0)  # another scope's twin is invisible
    p = plan(pool)
    assert p.tier == CacheResult.MISS and p.similarity == 0.0 and p.source_key is None
    assert p.reason == "no cached prefix; no semantic: best cosine 0.000 below threshold 0.8"


def test_miss_reports_the_best_cosine_of_the_scope():
    pool = make_pool()
    cache(pool, tokens=[50, 51, 52, 53, 54], cos=0.42)  # nothing in common but the scope
    p = plan(pool)
    assert p.tier == CacheResult.MISS and p.similarity == pytest.approx(0.42, abs=1e-6)
    assert p.reason.endswith("best cosine 0.420 below threshold 0.8")


def test_negative_cosine_is_reported_as_zero():
    pool = make_pool()
    cache(pool, tokens=[50, 51, 52, 53, 54], cos=-0.3)
    p = plan(pool)
    assert p.tier == CacheResult.MISS and p.similarity == 0.0


def test_lossy_kv_and_no_approximation_is_a_miss():
    pool = make_pool(kv_bits=8)
    cache(pool, tokens=REVISED, cos=1.0)  # the very same prompt is cached, but 8-bit
    p = plan(pool, allow_approximate=False)
    assert p.tier == CacheResult.MISS and p.similarity == pytest.approx(1.0)
    assert p.reason == ("stored KV reuse is not lossless here and caller forbids approximate reuse; "
                        "no semantic: caller forbids approximate reuse")


@pytest.mark.parametrize("kv_bits, lossless_kv, tier", [
    (32, False, CacheResult.MISS),          # the engine says stored KV is not bitwise (not batch-invariant)
    (8, True, CacheResult.EXACT_PREFIX),    # the engine's word wins over the pool's precision
    (32, None, CacheResult.EXACT_PREFIX),   # not told: 16 bits and more count as lossless
])
def test_the_engine_decides_whether_stored_kv_is_lossless(kv_bits, lossless_kv, tier):
    pool = make_pool(kv_bits=kv_bits)
    cache(pool, tokens=REVISED, cos=1.0)
    assert plan(pool, allow_approximate=False, lossless_kv=lossless_kv).tier == tier


def test_past_the_sliding_window_nothing_is_reused():
    pool = make_pool()
    cache(pool, cos=0.95)
    p = plan(pool, use_kv=False)
    assert p.tier == CacheResult.MISS and p.prefix is None
    assert p.reason.endswith("no semantic: prompt + answer exceed the sliding window")


# ------------------------------------------------------------------------------------------ SEMANTIC
def test_similar_prompt_with_a_revised_context_is_semantic():
    pool = make_pool()
    key = cache(pool, cos=0.9)
    p = plan(pool)
    assert p.tier == CacheResult.SEMANTIC and p.source_key == key
    assert p.similarity == pytest.approx(0.9, abs=1e-6)
    assert p.exact_lead == 18 and p.pairs[:18] == [(i, i) for i in range(18)]
    assert len(p.pairs) == 18 + 49 and (19, 19) in p.pairs and all(n < len(REVISED) - 1 for n, _ in p.pairs)
    assert p.reason == "cosine 0.900: 67 aligned tokens vs 18 exact-prefix"


def test_semantic_picks_the_candidate_that_aligns_best_not_the_most_similar():
    pool = make_pool()
    cache(pool, tokens=SYSTEM + list(range(400, 460)) + QUESTION, cos=0.97, question="other")
    key = cache(pool, cos=0.85)
    p = plan(pool)
    assert p.tier == CacheResult.SEMANTIC and p.source_key == key and p.similarity == pytest.approx(0.85, abs=1e-6)


# ------------------------------------------------------------------------------------------ EXACT_PREFIX
@pytest.mark.parametrize("kw, why", [
    (dict(enable_semantic_reuse=False), "semantic reuse disabled"),
    (dict(allow_approximate=False), "caller forbids approximate reuse"),
    (dict(semantic_supported=False), "architecture not supported by semantic reuse"),
    (dict(min_semantic_tokens=100), "prompt shorter than 100 tokens"),
    (dict(cache_threshold=0.95, answer_threshold=0.95), "best cosine 0.900 below threshold 0.95"),
])
def test_exact_prefix_when_semantic_is_ruled_out(kw, why):
    pool = make_pool()
    key = cache(pool, cos=0.9)
    p = plan(pool, **kw)
    assert p.tier == CacheResult.EXACT_PREFIX and p.prefix.n_tokens == 18 and p.source_key == key
    assert p.reason == f"18-token exact prefix; no semantic: {why}"
    assert p.similarity == pytest.approx(0.9, abs=1e-6)


def test_exact_prefix_when_alignment_gains_too_little():
    pool = make_pool()
    cache(pool, tokens=SYSTEM + CONTEXT[:10] + list(range(500, 556)), cos=0.9)  # only the start is shared
    p = plan(pool)
    assert p.tier == CacheResult.EXACT_PREFIX and p.prefix.n_tokens == 18
    assert p.reason == "18-token exact prefix; no semantic: alignment gains too little (18 aligned vs 18 exact-prefix tokens)"


def test_the_last_prompt_token_is_never_reused():
    pool = make_pool()
    cache(pool, tokens=REVISED, cos=1.0)
    p = plan(pool, enable_semantic_reuse=False)
    assert p.tier == CacheResult.EXACT_PREFIX and p.prefix.n_tokens == len(REVISED) - 1
    assert p.similarity == pytest.approx(1.0)


# ------------------------------------------------------------------------------------------ ANSWER
ANSWER_ON = dict(enable_answer_cache=True, answer_max_age_s=60.0)


def test_same_question_same_context_is_an_answer():
    pool = make_pool()
    key = cache(pool, tokens=REVISED, cos=0.97)
    p = plan(pool, **ANSWER_ON)
    assert p.tier == CacheResult.ANSWER and p.source_key == key and p.answer == "Yes, until 17:00."
    assert p.similarity == pytest.approx(0.97, abs=1e-6)
    assert p.reason == "answer of a task with cosine 0.970, same context"


@pytest.mark.parametrize("cached, kw", [
    (dict(digest="ctx-0"), {}),                                        # another context
    (dict(created=NOW - 61), {}),                                      # too old
    (dict(answer=""), {}),                                             # no stored answer
    (dict(question="is elm street closed today"), {}),                # the guard: opposite meaning
    (dict(cos=0.94), {}),                                              # below answer_threshold
    ({}, dict(allow_approximate=False)),                               # caller wants no approximation
])
def test_answer_is_refused(cached, kw):
    pool = make_pool()
    cache(pool, tokens=REVISED, **{"cos": 0.97, **cached})
    p = plan(pool, **ANSWER_ON, **kw)
    assert p.tier != CacheResult.ANSWER
    assert p.tier == CacheResult.EXACT_PREFIX  # the same tokens are cached: the prefix still serves


def test_answer_needs_the_answer_cache_enabled():
    pool = make_pool()
    cache(pool, tokens=REVISED, cos=0.99)
    assert plan(pool).tier == CacheResult.EXACT_PREFIX


def test_the_alignment_is_difflibs_whatever_matcher_runs_it():
    """align() runs cydifflib's SequenceMatcher where it is installed (difflib's otherwise): the pairs must be the
    ones the standard library's gives, on token lists like prompts (long shared runs with edits, repeated
    tokens, small and large vocabularies) and on random ones."""
    import difflib
    import random

    def reference(source, target, limit):
        pairs = []
        for a, b, size in difflib.SequenceMatcher(None, source, target, autojunk=False).get_matching_blocks():
            if size >= reuse_planner.MIN_RUN_TOKENS:
                pairs.extend((b + i, a + i) for i in range(size) if b + i < limit)
        return pairs

    rng = random.Random(7)
    for trial in range(600):
        vocab = rng.choice([2, 7, 60, 2000, 49152])
        source = [rng.randrange(vocab) for _ in range(rng.randint(0, 420))]
        if trial % 3:
            target = list(source)
            for _ in range(rng.randint(0, 25)):
                at = rng.randint(0, len(target))
                what = rng.random()
                if what < 0.4:
                    target[at:at] = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
                elif what < 0.8:
                    del target[at:at + rng.randint(1, 12)]
                elif target:
                    target[min(at, len(target) - 1)] = rng.randrange(vocab)
        else:
            target = [rng.randrange(vocab) for _ in range(rng.randint(0, 420))]
        limit = max(len(target) - rng.randint(0, 3), 0)
        assert reuse_planner.align(source, target, limit) == reference(source, target, limit), trial
