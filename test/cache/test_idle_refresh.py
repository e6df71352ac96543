"""After a SEMANTIC hit the exact KV of that prompt is computed at idle time, so the next request on the
same (revised) context reuses all of it exactly instead of repairing a stale entry again."""
from core_fixtures import BULLETIN, BULLETIN_REVISED, fresh, shared_engine

from simllm_ros.cache.block_pool import common_prefix
from simllm_ros.request import CacheResult, QueryRequest


def test_semantic_hit_is_pooled_exactly_at_idle_time():
    e = fresh(shared_engine())
    q = dict(cache_scope="kiosk", max_new_tokens=4)
    first = e.handle(QueryRequest(prompt="what is the weather going to be like today", context=BULLETIN, **q))
    assert first.success and first.cache_result == CacheResult.MISS
    semantic = e.handle(QueryRequest(prompt="what will the weather be like today", context=BULLETIN_REVISED, **q))
    assert semantic.success and semantic.cache_result == CacheResult.SEMANTIC
    assert e.has_idle_work() and len(e.pending_inserts) == 1
    n_before = len(e.pool)
    assert e.idle_work() is True
    assert not e.has_idle_work() and len(e.pool) == n_before + 1
    e.pool.check_consistency()

    follow = QueryRequest(prompt="how bad is traffic on route 9", context=BULLETIN_REVISED, **q)
    res = e.handle(follow)
    sys_prompt = e.settings.system_prompt
    t_sem = e.backend.prompt_ids(sys_prompt, BULLETIN_REVISED, "what will the weather be like today")
    t_follow = e.backend.prompt_ids(sys_prompt, BULLETIN_REVISED, follow.prompt)
    t_old = e.backend.prompt_ids(sys_prompt, BULLETIN, follow.prompt)
    shared_new = common_prefix(t_sem, t_follow)   # system + the whole revised bulletin
    shared_old = common_prefix(t_old, t_follow)   # only up to the first revision
    assert shared_new > shared_old + 50
    print(f"\nfollow-up on the revised bulletin: {res.cache_result.name}, reused {res.reused_tokens} of "
          f"{res.prompt_tokens} (exact prefix through the old entry alone: {shared_old})")
    assert res.success and res.cache_result == CacheResult.EXACT_PREFIX
    assert res.reused_tokens >= shared_new
