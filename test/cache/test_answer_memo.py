"""answer_memo: an identical request gets the stored finished answer with no model pass, and it is exactly the
answer the model gives that request with an empty pool. Identical means the same prompt tokens in the same scope
with the same temperature, seed, stop strings and schema; a shorter max_new_tokens gets the first tokens; anything
else, a cleared pool or the parameter off takes the model (verified drafts)."""
from __future__ import annotations

import pytest

from core_fixtures import BULLETIN, LOSSLESS, fresh, shared_engine
from simllm_ros.request import CacheResult, QueryRequest

Q = "Is the library open on Sunday?"


@pytest.fixture(scope="module")
def engine():
    e = fresh(shared_engine(**LOSSLESS), enable_semantic_reuse=False)
    assert e.backend.exact_chunking, "the memo is exact on a batch-invariant backend only"
    yield e
    fresh(e)


def ask(engine, prompt=Q, **kw):
    kw.setdefault("max_new_tokens", 24)
    r = engine.handle(QueryRequest(prompt=prompt, context=BULLETIN, **kw))
    assert r.success, r.error
    return r


def memo_served(r) -> bool:
    return r.cache_result == CacheResult.EXACT_PREFIX and r.decode_passes == 0 and r.draft_tokens_proposed == 0 \
        and r.exact and r.reused_tokens == r.prompt_tokens


def test_a_repeat_is_the_stored_answer_without_a_model_pass(engine):
    fresh(engine, enable_semantic_reuse=False)
    first = ask(engine)
    assert first.cache_result == CacheResult.MISS and first.decode_passes > 0
    hits = engine.memo.hits
    again = ask(engine)
    assert memo_served(again) and engine.memo.hits == hits + 1
    assert (again.answer, again.generated_tokens, again.stop_reason) == \
        (first.answer, first.generated_tokens, first.stop_reason)


def test_a_shorter_answer_is_the_first_tokens_as_the_model_gives_them(engine):
    fresh(engine, enable_semantic_reuse=False)
    ask(engine, max_new_tokens=24)
    short = ask(engine, max_new_tokens=6)
    assert memo_served(short) and short.generated_tokens == 6 and short.stop_reason == "length"
    engine.clear_pool()
    alone = ask(engine, max_new_tokens=6)  # the model on an empty pool
    assert alone.cache_result == CacheResult.MISS and alone.answer == short.answer


def test_seeded_sampling_repeats_exactly_and_other_settings_take_the_model(engine):
    fresh(engine, enable_semantic_reuse=False)
    sampled = ask(engine, temperature=0.8, seed=11)
    again = ask(engine, temperature=0.8, seed=11)
    assert memo_served(again) and again.answer == sampled.answer
    for kw in (dict(temperature=0.8, seed=12), dict(temperature=0.0), dict(stop=["zzz"], temperature=0.8, seed=11)):
        r = ask(engine, **kw)
        assert not memo_served(r) and r.decode_passes > 0, kw
    engine.clear_pool()
    alone = ask(engine, temperature=0.8, seed=11)
    assert alone.cache_result == CacheResult.MISS and alone.answer == sampled.answer


def test_scopes_a_cleared_pool_and_the_parameter_off_take_the_model(engine):
    fresh(engine, enable_semantic_reuse=False)
    ask(engine, cache_scope="robot_a")
    assert memo_served(ask(engine, cache_scope="robot_a"))
    other = ask(engine, cache_scope="robot_b")  # the same prompt in another scope: that scope's own pool
    assert other.cache_result == CacheResult.MISS
    engine.clear_pool()
    assert ask(engine, cache_scope="robot_a").cache_result == CacheResult.MISS
    fresh(engine, enable_semantic_reuse=False, answer_memo=False)
    ask(engine)
    r = ask(engine)
    assert not memo_served(r) and r.decode_passes > 0
    fresh(engine, enable_semantic_reuse=False)


def test_a_streamed_repeat_streams_the_answer(engine):
    fresh(engine, enable_semantic_reuse=False)
    first = ask(engine)
    seen = []
    p = engine.prepare(QueryRequest(prompt=Q, context=BULLETIN, max_new_tokens=24))
    r = engine.execute(p, on_progress=seen.append)
    assert memo_served(r) and seen and seen[-1].text == first.answer == r.answer


def test_a_repeat_in_a_batch_is_served_from_the_memo_beside_requests_that_run(engine):
    """Under continuous batching (max_batch 4) a repeat is answered at admission, the others decode together; each
    answer is what it is one at a time."""
    from simllm_ros.serving.request_server import RequestServer

    fresh(engine, enable_semantic_reuse=False)
    first = ask(engine)
    reqs = [QueryRequest(prompt=Q, context=BULLETIN, max_new_tokens=24, request_id="repeat"),
            QueryRequest(prompt="Which roads are closed?", context=BULLETIN, max_new_tokens=12, request_id="new"),
            QueryRequest(prompt=Q, context=BULLETIN, max_new_tokens=5, request_id="shorter")]
    server = RequestServer(engine, state=lambda: "inactive", queue_limit=8, max_batch=4)
    server.start()
    server.open()
    try:
        jobs = [server.submit(r, lambda r: None) for r in reqs]
        got = {j.request.request_id: server.wait(j) for j in jobs}
    finally:
        server.stop()
    assert memo_served(got["repeat"]) and got["repeat"].answer == first.answer
    assert memo_served(got["shorter"]) and got["shorter"].generated_tokens == 5
    assert got["new"].success and got["new"].decode_passes > 0
    engine.clear_pool()
    assert ask(engine, prompt="Which roads are closed?", max_new_tokens=12).answer == got["new"].answer
    engine.pool.check_consistency()
