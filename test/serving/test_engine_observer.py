"""The engine's observer hook (what the benchmark reads instead of patching) and fork() (one model, own pool)."""
from core_fixtures import BULLETIN, capture_generations, fresh, shared_engine

from simllm_ros.request import CacheResult, QueryRequest


def test_observer_sees_plan_timings_and_first_logits():
    e = fresh(shared_engine())
    seen = []
    e.observer = seen.append
    try:
        q = dict(context=BULLETIN, cache_scope="obs", max_new_tokens=3)
        with capture_generations(e) as gens:
            miss = e.handle(QueryRequest(prompt="is elm street open", request_id="a", **q))
            hit = e.handle(QueryRequest(prompt="is the harbour bridge open", request_id="b", **q))
    finally:
        e.observer = None
    assert [o.request_id for o in seen] == ["a", "b"]
    assert [o.plan.tier for o in seen] == [miss.cache_result, hit.cache_result] == [CacheResult.MISS,
                                                                                 CacheResult.EXACT_PREFIX]
    for o in seen:
        assert 0 <= o.match_ms <= o.plan_ms and o.insert_ms > 0
        assert o.first_logits is not None and o.first_logits.shape[-1] == len(e.backend.tokenizer)
    for o, g in zip(seen, gens):  # greedy decoding: the first answer token is the arg-max of the observed logits
        assert int(o.first_logits.flatten().argmax()) == g.tokens[0]


def test_fork_has_its_own_pool_and_leaves_the_model_loaded():
    e = fresh(shared_engine())
    e.handle(QueryRequest(prompt="is elm street open", context=BULLETIN, cache_scope="p", max_new_tokens=2))
    f = e.fork(e.settings.replace(enable_semantic_reuse=False))
    assert len(f.pool) == 0 and len(e.pool) == 1 and not f.settings.enable_semantic_reuse
    r = f.handle(QueryRequest(prompt="is elm street open", context=BULLETIN, cache_scope="p", max_new_tokens=2))
    assert r.success and r.cache_result == CacheResult.MISS  # the parent's entry is not the fork's
    assert len(f.pool) == 1 and len(e.pool) == 1
    f.unload()
    assert e.loaded and e.backend.model is not None
    assert e.handle(QueryRequest(prompt="hello", max_new_tokens=1)).success
