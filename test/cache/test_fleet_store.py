"""The fleet store on a real redis-server: two engines on one model ("robot1", "robot2", each with its own pool and
its own connection) share answers as verified drafts and exact-prefix KV blocks; every answer equals the one the
model gives with an empty pool and no store. Damaged, foreign-digest and other-scope blobs are refused; a killed
or paused Redis loses no request and the node reconnects on its own."""
from __future__ import annotations

import time

import pytest

from core_fixtures import BULLETIN, fresh
from fleet_fixtures import Q, ask, base, redis_server, robot, robots, secret_file  # noqa: F401 - fixtures
from simllm_ros.cache import fleet_store
from simllm_ros.cache.fleet_blob import BlobRefused, scope_tag, seal, unseal
from simllm_ros.request import CacheResult, QueryRequest


def test_a_blob_is_refused_when_damaged_truncated_moved_or_keyed_with_another_secret():
    secret, key = b"s" * 32, "simllm:s:abc:kv:0123"
    blob = seal(secret, key, {"kind": "kv", "digest": "d1"}, b"\x01\x02" * 100)
    header, payload = unseal(secret, key, blob)
    assert header == {"kind": "kv", "digest": "d1"} and payload == b"\x01\x02" * 100
    damaged = bytearray(blob)
    damaged[len(blob) // 2] ^= 1
    for bad, why in ((bytes(damaged), "MAC"), (blob[:-40], "MAC"), (blob[:10], "truncated")):
        with pytest.raises(BlobRefused, match=why):
            unseal(secret, key, bad)
    with pytest.raises(BlobRefused, match="MAC"):
        unseal(secret, "simllm:s:other:kv:0123", blob)  # the same bytes under another scope's key
    with pytest.raises(BlobRefused, match="MAC"):
        unseal(b"t" * 32, key, blob)
    assert scope_tag(secret, "a") != scope_tag(secret, "b")
    assert scope_tag(secret, "a") != scope_tag(b"t" * 32, "a")


@pytest.fixture(scope="module")
def alone(base):
    """The model's own answers: an empty pool, no store."""
    e = base.fork()
    cache = {}

    def answer(prompt=Q, scope="", context=BULLETIN):
        if (prompt, scope, context) not in cache:
            fresh(e, enable_semantic_reuse=False)
            cache[prompt, scope, context] = ask(e, prompt, scope, context).answer
        return cache[prompt, scope, context]
    yield answer
    e.unload()


def test_robot2_takes_robot1s_context_kv_and_answer_and_gives_the_models_own_answer(robots, alone):
    robot1, robot2 = robots
    first = ask(robot1)
    assert first.cache_result == CacheResult.MISS and first.answer == alone()
    assert robot1.fleet.flush() and robot1.fleet.counters.published_answers == 1
    assert robot1.fleet.counters.published_blocks >= first.prompt_tokens // fleet_store.BLOCK_TOKENS - 1
    second = ask(robot2)
    assert second.answer == alone() and second.exact
    assert second.cache_result == CacheResult.EXACT_PREFIX  # robot2's pool was empty: the prefix came from the fleet
    assert second.reused_tokens >= (first.prompt_tokens - 1) // fleet_store.BLOCK_TOKENS * fleet_store.BLOCK_TOKENS
    assert robot2.fleet.counters.kv_fetches == 1 and robot2.fleet.counters.answers_found == 1
    # robot1's answer, verified as drafts: every one proposed is accepted, and they carry most of the answer (how
    # many a pass verifies follows the pass costs measured at load: a busy machine's fresh clone proposed 17 of 20)
    assert second.draft_tokens_proposed == second.draft_tokens_accepted >= second.generated_tokens // 2 > 0
    # a new question on the same context: the context's blocks from the fleet, the model decodes on its own
    other = ask(robot2, "When does the pharmacy open?", scope="b2")
    assert other.answer == alone("When does the pharmacy open?", "b2")


def test_damaged_foreign_and_other_scope_blobs_are_never_used(robots, alone, redis_server):
    robot1, robot2 = robots
    ask(robot1, scope="alpha")
    assert robot1.fleet.flush()
    r = redis_server.client()
    tokens = robot1.backend.chat_ids(robot1.settings.system_prompt, BULLETIN, QueryRequest(prompt=Q).turns())
    keys = robot1.fleet.block_keys("alpha", tokens, 3)
    blob = r.get(keys[0])
    assert blob is not None
    damaged = bytearray(blob)
    damaged[len(damaged) // 3] ^= 0x40
    r.set(keys[0], bytes(damaged))
    refused = robot2.fleet.counters.refused
    got = ask(robot2, scope="alpha")
    assert got.answer == alone(scope="alpha") and robot2.fleet.counters.refused == refused + 1
    assert robot2.fleet.counters.kv_fetches == 0  # the first block was bad: nothing of the chain is used
    # a blob sealed with the right secret for the right key but another numerics digest
    fresh(robot2, enable_semantic_reuse=False)
    header, payload = unseal(robot1.fleet.secret, keys[1], r.get(keys[1]))
    r.set(keys[0], seal(robot1.fleet.secret, keys[0], {**header, "digest": "0" * 16}, payload))
    got = ask(robot2, scope="alpha")
    assert got.answer == alone(scope="alpha") and robot2.fleet.counters.refused == refused + 2
    # scope beta's keys hold scope alpha's blobs, copied byte for byte: their MACs name alpha's keys
    beta = robot1.fleet.block_keys("beta", tokens, 3)
    for a, b in zip(keys[1:], beta[1:]):
        r.set(b, r.get(a))
    r.set(beta[0], blob)
    got = ask(robot2, scope="beta")
    assert got.answer == alone(scope="beta") and robot2.fleet.counters.refused == refused + 3
    assert robot2.fleet.counters.kv_fetches == 0


def test_another_secret_sees_nothing_of_the_fleet(base, redis_server, secret_file, tmp_path, alone):
    redis_server.client().flushall()
    robot1 = robot(base, redis_server, secret_file)
    other_secret = tmp_path / "other"
    other_secret.write_bytes(b"another-deployment-secret-98765")
    stranger = robot(base, redis_server, str(other_secret))
    try:
        ask(robot1)
        assert robot1.fleet.flush()
        got = ask(stranger)
        assert got.answer == alone() and got.cache_result == CacheResult.MISS
        assert stranger.fleet.counters.answers_found == 0 and stranger.fleet.counters.kv_fetches == 0
    finally:
        robot1.unload()
        stranger.unload()


def test_a_killed_or_paused_redis_loses_no_request_and_the_node_reconnects(robots, alone, redis_server):
    robot1, robot2 = robots
    ask(robot1)
    assert robot1.fleet.flush()
    redis_server.pause()
    try:
        got = ask(robot2, scope="p1")
        assert got.answer == alone(scope="p1")
        assert robot2.fleet.state == "unreachable"
        assert robot2.fleet.counters.errors == 1, "after one failed call a request skips the store"
        got = ask(robot2, "When does the pharmacy open?", scope="p1")
        assert got.answer == alone("When does the pharmacy open?", "p1")
        assert robot2.fleet.counters.errors <= 2  # at most one bounded wait per request while the store is down
    finally:
        redis_server.resume()
    redis_server.kill()
    time.sleep(max(0.0, robot2.fleet.breaker.retry_at - time.monotonic()) + 0.05)
    got = ask(robot2, scope="k1")
    assert got.answer == alone(scope="k1") and robot2.fleet.state == "unreachable"
    redis_server.start()  # a fresh, empty server on the same port
    deadline = time.monotonic() + 15
    while robot2.fleet.state != "connected" and time.monotonic() < deadline:
        time.sleep(max(0.0, robot2.fleet.breaker.retry_at - time.monotonic()) + 0.05)
        ask(robot2, scope="k2")
    assert robot2.fleet.state == "connected" and robot2.fleet.reconnects
    ask(robot2, scope="k3")
    assert robot2.fleet.flush()
    assert robot2.fleet.counters.published_answers >= 1  # writing again after the restart


def test_a_new_robot_warms_up_with_what_the_fleet_asks_most(robots, base, redis_server, secret_file):
    robot1, _ = robots
    asked = ["When does the pharmacy open?", Q, "Is the post office open today?"]
    for q in (asked[0], asked[1], asked[1], asked[0], asked[0], asked[2]):
        ask(robot1, q, scope="kiosk")
    assert robot1.fleet.flush()
    tasks = robot1.fleet.most_asked(2)
    assert [t["prompt"] for t in tasks] == asked[:2] and all(t["scope"] == "kiosk" for t in tasks)
    new = robot(base, redis_server, secret_file)
    try:
        warmed = new.warm_start.warm_up("2", lambda m: None, new.load_report.get("restored", 0))
        assert warmed == 2
        tokens = new.backend.chat_ids(new.settings.system_prompt, BULLETIN,
                                      QueryRequest(prompt=asked[0]).turns())
        assert new.pool.find("kiosk", tokens) is not None
    finally:
        new.unload()


def test_a_similar_question_gets_the_fleets_answer_as_a_draft_and_the_models_own_answer(robots, alone):
    robot1, robot2 = robots
    para = "Instead of Elm Street, which road should I take?"
    ask(robot1, scope="para")
    assert robot1.fleet.flush()
    ask(robot2, "When does the pharmacy open?", scope="para")  # robot2 now asks in this scope: it mirrors it
    deadline = time.monotonic() + 15
    while robot2.fleet.mirrored("para") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert robot2.fleet.mirrored("para") == 2
    first = robot1.pool.find("para", robot1.backend.chat_ids(robot1.settings.system_prompt, BULLETIN,
                                                             QueryRequest(prompt=Q).turns()))
    drafts = robot2.fleet.similar_answers("para", robot2.embed([para])[0], robot2.settings.draft_min_similarity)
    assert drafts and robot1.backend.detokenize(drafts[0]) == first.answer  # robot1's answer to Q, as token ids
    got = ask(robot2, para, scope="para")  # whether the model takes any of it is the model's business
    assert got.answer == alone(para, "para") and got.exact
