"""Conversations, stop strings, streaming, cancellation and embeddings in the engine (no ROS).

Real model (SmolLM2 bf16, lossless reuse, shared with test_verified_decoding) and real embedder. The claims:
- a conversation's earlier turns are an exact token prefix the pool reuses turn after turn, and every
  turn's answer is bitwise what an empty pool gives;
- a stop string ends the answer before it; progress reports are prefixes of the answer, at most one per 50 ms;
- a cancel ends generation within one decode pass; the prompt's KV may be pooled, the partial answer never
  becomes a stored answer or a draft source;
- bad conversations, stop strings, temperatures and embedding inputs get a clear error.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from simllm_ros.request import CANCELLED_ERROR, CacheResult, ChatTurn, QueryRequest

from core_fixtures import BULLETIN, LOSSLESS, fresh, shared_engine


@pytest.fixture(scope="module")
def engine():
    return shared_engine(**LOSSLESS)


QUESTIONS = ["Which road is closed today?", "What should I use instead?", "And when does it open again?"]


def test_conversation_turns_reuse_the_earlier_turns_exactly(engine):
    fresh(engine)
    turns: list[ChatTurn] = []
    prev_tokens = 0
    got = []
    for q in QUESTIONS:
        req = QueryRequest(prompt="", context=BULLETIN, cache_scope="chat", max_new_tokens=16,
                           messages=turns + [ChatTurn("user", q)])
        res = engine.handle(req)
        assert res.success, res.error
        assert res.exact
        if prev_tokens:
            assert res.cache_result == CacheResult.EXACT_PREFIX
            assert res.reused_tokens >= prev_tokens, (res.reused_tokens, prev_tokens)  # all of the last turn's prompt
        got.append((req, res))
        prev_tokens = res.prompt_tokens
        turns = req.messages + [ChatTurn("assistant", res.answer)]
    assert got[-1][1].prompt_tokens > got[0][1].prompt_tokens + 20
    for req, res in got:  # the cache never changes an answer
        fresh(engine)
        alone = engine.handle(req)
        assert alone.cache_result == CacheResult.MISS and alone.answer == res.answer


def test_a_system_turn_replaces_the_system_prompt_and_prompt_is_the_last_user_turn(engine):
    fresh(engine)
    b = engine.backend
    ids = b.chat_ids("ignored", "ctx", [ChatTurn("system", "You are a tour guide."), ChatTurn("user", "hi")])
    assert ids == b.prompt_ids("You are a tour guide.", "ctx", "hi")
    a = engine.handle(QueryRequest(prompt="Where can I park?", context=BULLETIN, max_new_tokens=8))
    fresh(engine)
    c = engine.handle(QueryRequest(prompt="", messages=[ChatTurn("user", "Where can I park?")], context=BULLETIN,
                                   max_new_tokens=8))
    assert a.answer == c.answer and a.prompt_tokens == c.prompt_tokens


def test_stop_strings_end_the_answer_before_them(engine):
    fresh(engine)
    base = QueryRequest(prompt="Describe the weather and the traffic today.", context=BULLETIN, max_new_tokens=40)
    full = engine.handle(base)
    assert full.success and len(full.answer) > 20, full.answer
    words = full.answer.split()
    stop = " " + words[len(words) // 2]
    cut = full.answer[:full.answer.find(stop)].rstrip()
    fresh(engine)
    res = engine.handle(QueryRequest(prompt=base.prompt, context=BULLETIN, max_new_tokens=40, stop=["@@@", stop]))
    assert res.success and res.stop_reason == "stop" and res.answer == cut
    assert res.generated_tokens < full.generated_tokens
    assert full.stop_reason in ("eos", "length")


def test_progress_is_a_growing_prefix_at_most_every_50_ms(engine):
    fresh(engine)
    seen = []
    p = engine.prepare(QueryRequest(prompt="Tell me about the buses tonight.", context=BULLETIN, max_new_tokens=24))
    res = engine.execute(p, on_progress=lambda pr: seen.append((time.monotonic(), pr)))
    assert res.success and len(seen) >= 3
    texts = [pr.text for _, pr in seen]
    assert texts[-1] == res.answer and seen[-1][1].generated_tokens == res.generated_tokens
    assert all(res.answer.startswith(t) for t in texts)
    assert [pr.generated_tokens for _, pr in seen] == sorted(pr.generated_tokens for _, pr in seen)
    gaps = [b[0] - a[0] for a, b in zip(seen[:-2], seen[1:-1])]  # the last one is sent whatever the throttle
    assert min(gaps) >= 0.045, gaps
    assert all(pr.cache_result == CacheResult.MISS for _, pr in seen)


def test_a_cancel_stops_within_one_pass_and_leaves_no_partial_answer(engine):
    fresh(engine)
    req = QueryRequest(prompt="Tell me everything in the bulletin.", context=BULLETIN, cache_scope="c",
                       max_new_tokens=48)
    tokens = engine.backend.chat_ids(engine.settings.system_prompt, req.context, req.turns())
    calls = []

    def should_stop():
        calls.append(1)
        return len(calls) > 3

    p = engine.prepare(req)
    recent = {k: list(v) for k, v in engine.memory.recent_answers.items()}
    errors = engine.stats()["errors_total"]
    res = engine.execute(p, should_stop=should_stop)
    assert not res.success and res.error == CANCELLED_ERROR and res.stop_reason == "cancel"
    assert 3 <= res.generated_tokens <= 4 and res.answer  # the partial answer comes back to the caller
    entry = engine.pool.find("c", tokens)
    assert entry is not None and entry.answer == ""  # the prompt's KV is pooled, the partial answer is not
    assert {k: list(v) for k, v in engine.memory.recent_answers.items()} == recent
    assert engine.stats()["errors_total"] == errors  # a cancel is not a fault
    full = engine.handle(req)
    assert full.success and full.answer.startswith(res.answer) and full.cache_result == CacheResult.EXACT_PREFIX
    assert engine.pool.find("c", tokens).answer == full.answer
    # Cancelled before it started: nothing runs.
    before = engine.pool.stats().entries
    res = engine.execute(engine.prepare(QueryRequest(prompt="Anything else?", context=BULLETIN)),
                         should_stop=lambda: True)
    assert res.stop_reason == "cancel" and res.generated_tokens == 0 and engine.pool.stats().entries == before


def test_per_request_temperature_and_seed(engine):
    fresh(engine)
    req = dict(prompt="Say something about the weather.", context=BULLETIN, max_new_tokens=16)
    a = engine.handle(QueryRequest(**req, temperature=1.0, seed=3))
    b = engine.handle(QueryRequest(**req, temperature=1.0, seed=3))
    greedy = engine.handle(QueryRequest(**req, temperature=0.0))
    others = {engine.handle(QueryRequest(**req, temperature=1.0, seed=s)).answer for s in (4, 5, 6)}
    assert a.answer == b.answer and a.exact and b.exact
    assert len(others | {a.answer, greedy.answer}) >= 3  # sampling does sample


@pytest.mark.parametrize("kw, reason", [
    (dict(prompt=""), "prompt is empty (only whitespace or invisible characters) and no messages were given"),
    (dict(prompt="", messages=[ChatTurn("robot", "hi")]), "messages[0].role 'robot' is not one of system, user, assistant"),
    (dict(prompt="", messages=[ChatTurn("user", "  ")]), "messages[0].content is empty"),
    (dict(prompt="", messages=[ChatTurn("user", "hi"), ChatTurn("system", "be terse")]),
     "messages[1]: a system turn may only come first"),
    (dict(prompt="", messages=[ChatTurn("user", "hi"), ChatTurn("assistant", "hello")]),
     "the conversation ends with a assistant turn; the last turn must be the user's"),
    (dict(prompt="", messages=[ChatTurn("system", "be terse")]), "the conversation ends with a system turn"),
    (dict(prompt="hi", messages=[ChatTurn("user", "a\x07b")]), "messages[0].content contains control character U+0007"),
    (dict(prompt="hi", stop=[""]), "stop[0] is empty"),
    (dict(prompt="hi", stop=["x"] * 17), "stop has 17 strings; at most 16 are allowed"),
    (dict(prompt="hi", temperature=9.0), "temperature must be between 0 and 5.0"),
    (dict(prompt="hi", seed=-5), "seed must be an integer >= 0"),
])
def test_bad_generation_options_get_a_clear_error(engine, kw, reason):
    res = engine.prepare(QueryRequest(**kw))
    assert not getattr(res, "success", True) and res.error.startswith(reason), getattr(res, "error", res)


def test_embeddings_on_the_loaded_minilm(engine):
    v = engine.embed(["is it going to rain today", "will it rain this afternoon", "where can I buy diesel"])
    assert v.shape == (3, engine.fingerprinter.dim) and v.dtype == np.float32
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert float(v[0] @ v[1]) > float(v[0] @ v[2]) + 0.2
    assert np.allclose(v[0], engine.fingerprinter.embed(["is it going to rain today"])[0], atol=1e-5)  # the same model
    for texts, reason in (([], "texts is empty"), (["ok", " \u200b "], "texts[1] is empty"),
                          (["x"] * 257, "257 texts; at most 256"), (["bad\x01"], "texts[0] contains control"),
                          (["word " * 400], "texts[0] is 402 tokens; the embedder reads at most 256")):
        with pytest.raises(ValueError) as e:
            engine.embed(texts)
        assert str(e.value).startswith(reason), str(e.value)
