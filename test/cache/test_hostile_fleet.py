"""A hostile fleet store (issue 56, F1-F5) on a real redis-server: entries forged or damaged by another writer (a
header nested 50000 deep, ids [Infinity], the same item twice in a recent list, a 50 MB item, a non-UTF-8 member of
the asked-most set, forged KV without a secret, NaN or wrong KV with one). Every answer equals the model's own with
an empty pool and no store, the writer thread lives on (and is started again, with a WARN, if it is killed),
configure with warmup_queries succeeds, and the store is never taken for unreachable."""
from __future__ import annotations

import ctypes
import hashlib
import hmac
import logging
import struct
import time

import pytest
import torch

from core_fixtures import BULLETIN, fresh
from fleet_fixtures import Q, ask, base, redis_server, robot, robots, secret_file  # noqa: F401 - fixtures
from redis_server import RedisServer
from simllm_ros.cache import fleet_store
from simllm_ros.cache.fleet_blob import DEFAULT_SECRET, MAGIC, seal, unseal
from simllm_ros.request import CacheResult, QueryRequest
from simllm_ros.serving.engine import Engine
from simllm_ros.serving.health import HealthLevel, ThermalState, assess

Q2 = "When does the pharmacy open?"


def forged(secret: bytes, key: str, header: bytes, payload: bytes = b"") -> bytes:
    """A blob sealed as a writer holding `secret` would seal it, with a header of any bytes (seal() could not
    even write a header 50000 deep: json.dumps recurses)."""
    body = MAGIC + struct.pack("<I", len(header)) + header + payload
    return body + hmac.new(secret, key.encode() + b"\0" + body, hashlib.sha256).digest()


@pytest.fixture(scope="module")
def alone(base):
    """The model's own answers: an empty pool, no store."""
    e = base.fork()
    cache = {}

    def answer(prompt=Q, context=BULLETIN):  # the scope is not in the prompt: one answer for every scope
        if (prompt, context) not in cache:
            fresh(e, enable_semantic_reuse=False)
            cache[prompt, context] = ask(e, prompt, "", context).answer
        return cache[prompt, context]
    yield answer
    e.unload()


def prompt_ids(engine, prompt=Q):
    return engine.backend.chat_ids(engine.settings.system_prompt, BULLETIN, QueryRequest(prompt=prompt).turns())


def healthy(engine) -> None:
    """The writer thread runs and the store was never taken for unreachable."""
    f = engine.fleet
    assert f.writer_alive and f.counters.thread_restarts == 0
    assert f.state == "connected" and f.counters.errors == f.counters.write_errors == 0, f.breaker.last_error


def test_a_sealed_answer_with_a_deep_header_or_bad_ids_is_a_miss_not_a_failed_request(robots, alone, redis_server):
    _, robot2 = robots
    f, r = robot2.fleet, redis_server.client()
    scope_headers = {
        "deep": b'{"kind":"answer","digest":"%s","ids":' % f.digest.encode() + b"[" * 50000 + b"]" * 50000 + b"}",
        "inf": b'{"kind":"answer","digest":"%s","ids":[Infinity]}' % f.digest.encode(),
        "nan": b'{"kind":"answer","digest":"%s","ids":[1, NaN]}' % f.digest.encode(),
        "huge": b'{"kind":"answer","digest":"%s","ids":[1e308]}' % f.digest.encode(),
        "neg": b'{"kind":"answer","digest":"%s","ids":[-7]}' % f.digest.encode(),
        "str": b'{"kind":"answer","digest":"%s","ids":"abc"}' % f.digest.encode(),
    }
    for scope, header in scope_headers.items():
        key = f._answer_key(scope, prompt_ids(robot2))
        r.set(key, forged(f.secret, key, header))
        refused = f.counters.refused
        got = ask(robot2, scope=scope)  # was: internal error: RecursionError / OverflowError
        assert got.answer == alone() and got.exact  # the scope is not in the prompt: one reference answer
        assert f.counters.refused == refused + 1 and f.counters.answers_found == 0, scope
    # a 50 MB value at the answer key: read up to its bound only, refused by its size
    key = f._answer_key("big", prompt_ids(robot2))
    r.set(key, b"x" * (50 * 2**20))
    t0 = time.perf_counter()
    got = ask(robot2, scope="big")
    assert got.answer == alone() and f.counters.oversized == 1
    assert time.perf_counter() - t0 < 30
    # a key of another type where an answer should be: a miss, the store still reachable
    key = f._answer_key("typed", prompt_ids(robot2))
    r.rpush(key, b"a", b"b")
    assert ask(robot2, scope="typed").answer == alone()
    healthy(robot2)


def test_forged_duplicated_and_50mb_recent_items_keep_the_writer_and_the_store_up(base, redis_server, secret_file,
                                                                                   alone):
    redis_server.client().flushall()
    made = [robot(base, redis_server, secret_file) for _ in range(2)]
    try:
        robot1, robot2 = made
        r, f = redis_server.client(), robot1.fleet
        ask(robot1, scope="mirror")
        assert f.flush()
        lkey = f._scope_key("mirror", "recent", f.digest)
        good, fp, d = r.lindex(lkey, 0), b"\0\x3c" * 384, f.digest.encode()
        assert good is not None and r.llen(lkey) == 1
        r.lpush(lkey, good)  # the same item twice (F2: the writer died)
        r.lpush(lkey, forged(f.secret, lkey, b'{"kind":"recent","digest":"%s","ids":[Infinity]}' % d, fp))
        r.lpush(lkey, forged(f.secret, lkey, b'{"kind":"recent","digest":"%s","ids":' % d + b"[" * 50000
                             + b"]" * 50000 + b"}", fp))
        r.lpush(lkey, forged(f.secret, lkey, b'{"kind":"recent","digest":"%s","ids":[5]}' % d, b"\0\x7c" * 384))
        r.lpush(lkey, b"junk", good)
        got = ask(robot2, Q2, scope="mirror")  # robot2 asks in the scope: its writer mirrors the list from now on
        assert got.answer == alone(Q2) and robot2.fleet.flush()  # and robot2's answer joins the list
        c2 = robot2.fleet.counters
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not (robot2.fleet.mirrored("mirror") == 2 and c2.refused >= 4):
            time.sleep(0.05)
        assert robot2.fleet.mirrored("mirror") == 2 and c2.refused >= 4  # the good answers once, the rest refused
        healthy(robot2)
        # F4: one 50 MB item: the list is measured on the server, never sent, and unlinked (the writers refill it);
        # both robots mirror the scope (both asked in it): the first to refresh finds it
        r.rpush(lkey, b"y" * (50 * 2**20))
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not (c2.oversized + f.counters.oversized):
            time.sleep(0.05)
        assert c2.oversized + f.counters.oversized == 1 and not r.exists(lkey)
        healthy(robot1)
        healthy(robot2)  # was: every read of the list timed out and the store flapped to unreachable
        para = "Instead of Elm Street, which road should I take?"
        ask(robot1, para, scope="mirror")
        assert f.flush() and r.llen(lkey) == 1
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and robot2.fleet.mirrored("mirror") != 1:  # its mirror of the old list
            time.sleep(0.05)  # (2 answers) is replaced at its next refresh
        assert robot2.fleet.mirrored("mirror") == 1  # mirrored again from the refilled list
        got = ask(robot2, Q, scope="mirror")
        assert got.answer == alone() and got.exact
        assert robot2.fleet.flush() and robot2.fleet.counters.published_answers >= 2  # writing on
        healthy(robot2)
    finally:
        for e in made:
            e.unload()


def test_junk_in_the_asked_most_set_does_not_stop_configure_with_warmup(base, redis_server, secret_file, robots):
    robot1, _ = robots
    for q in (Q2, Q2, Q):
        ask(robot1, q, scope="kiosk")
    assert robot1.fleet.flush()
    r = redis_server.client()
    zkey = "simllm:asked"
    r.zadd(zkey, {b"\xff\xfe\xfd:\x80abc": 100, b"0" * 20 + b":" + b"\xc3" * 24: 99, b"not-ours": 98,
                  b"z" * (2 * 2**20): 97, b"a" * 20 + b":" + b"b" * 24: 96})  # the last: no task under it
    s = base.settings.replace(fleet_store_url=redis_server.url, fleet_secret_file=secret_file,
                              fleet_timeout_ms=200.0, warmup_queries="2")
    node = Engine(s)
    try:
        node.load()  # configure: was exit 1 (UnicodeDecodeError) for every node with warmup_queries and the fleet
        assert node.load_report["warmup"] == 2
        assert node.pool.find("kiosk", prompt_ids(node, Q2)) is not None
        assert node.pool.find("kiosk", prompt_ids(node, Q)) is not None
        assert node.fleet.counters.refused >= 4 and node.fleet.counters.oversized >= 1
        healthy(node)
    finally:
        node.unload()


def test_where_the_server_refuses_scripts_the_asked_most_set_is_bounded_by_its_memory(base, secret_file):
    server = RedisServer(("--rename-command", "EVAL", "", "--rename-command", "EVALSHA", ""))
    b = base.backend
    store = fleet_store.FleetStore(server.url, digest="d" * 16, kv_shape=b.kv_shape, dtype=b.dtype,
                                   secret=open(secret_file, "rb").read().strip(), timeout_ms=200.0)
    try:
        task = {"scope": "kiosk", "prompt": Q2, "context": ""}
        store.publish("kiosk", [1, 2, 3], answer_ids=None, question="", task=task, read_kv=None)
        assert store.flush()
        r = server.client()
        r.zadd("simllm:asked", {b"\xff\xfe:\x80": 50, b"not-ours": 40})
        assert store.most_asked(2) == [task]
        assert not store.link.scripts and store.counters.refused == 2
        r.zadd("simllm:asked", {b"z" * (20 * 2**20): 60})  # the set is now over its bound: not read
        assert store.most_asked(2) == [] and store.counters.oversized == 1
        assert store.state == "connected" and store.writer_alive
    finally:
        store.close()
        server.close()


def test_without_a_secret_no_kv_is_shared_and_a_forged_block_is_never_used(base, redis_server, alone, caplog):
    redis_server.client().flushall()
    with caplog.at_level(logging.WARNING):
        made = [robot(base, redis_server, "") for _ in range(2)]
    try:
        robot1, robot2 = made
        assert not robot1.fleet.share_kv and robot1.fleet.status()["fleet_kv_shared"] is False
        assert any("KV blocks are not shared" in m and "fleet_secret_file" in m for m in caplog.messages)
        first = ask(robot1)
        assert robot1.fleet.flush() and robot1.fleet.counters.published_blocks == 0
        assert robot1.fleet.counters.published_answers == 1
        # a forger with the built-in secret writes the prompt's first blocks: zeros, sealed as a node would
        f, r = robot2.fleet, redis_server.client()
        tokens = prompt_ids(robot2)
        keys = f.block_keys("default", tokens, 4)  # the scope of an empty cache_scope
        payload = bytes(f.bytes_per_token * fleet_store.BLOCK_TOKENS)
        for i, key in enumerate(keys):
            r.set(key, seal(DEFAULT_SECRET, key, {"kind": "kv", "digest": f.digest,
                                                  "tokens": tokens[i * 32:(i + 1) * 32]}, payload))
        got = ask(robot2)
        assert got.answer == alone() == first.answer and got.exact
        assert got.cache_result == CacheResult.MISS and f.counters.kv_fetches == 0
        assert f.counters.answers_found == 1  # answers are still shared: drafts the model checks
        healthy(robot2)
    finally:
        for e in made:
            e.unload()


def test_with_a_secret_nan_or_wrong_kv_blocks_are_refused_or_caught_by_the_recompute(robots, alone, redis_server):
    robot1, robot2 = robots
    r = redis_server.client()
    # an honest prefix passes the recompute bit for bit and is used
    first = ask(robot1, scope="honest")
    assert robot1.fleet.flush() and robot1.fleet.counters.published_blocks >= 3
    got = ask(robot2, scope="honest")
    assert got.answer == alone() == first.answer and got.cache_result == CacheResult.EXACT_PREFIX
    assert robot2.fleet.counters.kv_verified == 1 and robot2.fleet.counters.kv_mismatches == 0
    tokens = prompt_ids(robot1)
    for scope in ("nan", "wrong"):
        fresh(robot1, enable_semantic_reuse=False)
        fresh(robot2, enable_semantic_reuse=False)
        ask(robot1, scope=scope)
        assert robot1.fleet.flush()
        f = robot2.fleet
        keys = f.block_keys(scope, tokens, 3)
        honest = r.get(keys[0])
        header, payload = unseal(f.secret, keys[0], honest)
        L, H, D = f.kv_shape.layers, f.kv_shape.kv_heads, f.kv_shape.head_dim
        t = torch.frombuffer(bytearray(payload), dtype=f.dtype).view(2, L, H, fleet_store.BLOCK_TOKENS, D).clone()
        if scope == "nan":  # one robot's fault, sealed with the fleet's secret: a NaN in its first block
            t[0, 3, 0, 5, 7] = float("nan")
        else:  # finite but wrong: layer 0's keys of the first block moved a little
            t[0, 0] += 0.25
        r.set(keys[0], seal(f.secret, keys[0], header, t.contiguous().view(torch.uint8).numpy().tobytes()))
        refused, mismatches = f.counters.refused, f.counters.kv_mismatches
        got = ask(robot2, scope=scope)
        assert got.answer == alone() and got.exact  # was: "" or ",,,,," with exact: true
        assert got.cache_result == CacheResult.MISS and got.reused_tokens == 0
        if scope == "nan":
            assert f.counters.refused == refused + 1 and f.counters.kv_mismatches == mismatches
        else:  # caught by the recompute: dropped, counted, deleted from the store
            assert f.counters.kv_mismatches == mismatches + 1 and f.counters.kv_verified >= 2
            assert f.status()["fleet_kv_mismatches"] == mismatches + 1
            assert f.flush() and r.get(keys[0]) in (None, honest)  # gone, or written again by an honest node
            fresh(robot2, enable_semantic_reuse=False)
            fetches = f.counters.kv_fetches
            got = ask(robot2, scope=scope)  # asked again: the distrusted blocks are not fetched again
            assert got.answer == alone() and f.counters.kv_mismatches == mismatches + 1
            assert f.counters.kv_fetches == fetches
    healthy(robot2)


def test_a_killed_writer_is_started_again_with_a_warn(robots, alone, caplog):
    robot1, _ = robots
    f = robot1.fleet
    old = f._writer
    # end the real thread from outside, as an unforeseen error in it would
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(old.ident), ctypes.py_object(SystemExit))
    old.join(timeout=10)
    assert not old.is_alive()
    with caplog.at_level(logging.WARNING):
        got = ask(robot1, scope="restart")  # the request's publish finds the writer dead and starts it again
    assert got.answer == alone()
    assert f.writer_alive and f._writer is not old and f.counters.thread_restarts == 1
    assert any("fleet-writer thread died" in m and "SystemExit" in m for m in caplog.messages)
    assert f.flush() and f.counters.published_answers >= 1  # the new writer publishes
    status = f.status()
    assert status["fleet_thread_restarts"] == 1 and "restarted" in status["fleet_thread_warning"]
    h = assess(None, ThermalState(), None, ttft_warn_ms=1000.0, queue_limit=4, fleet=status)
    assert h.level >= HealthLevel.WARN and "fleet-writer thread died" in h.message
