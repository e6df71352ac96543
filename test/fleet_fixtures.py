"""What the fleet store's tests share (test_fleet_store, test_hostile_fleet): the lossless engine robots fork
from, the fleet's secret file, robots on a redis_server, and a question asked without approximate reuse.
Import the fixture names into the test module to use them (each module gets its own instances)."""
from __future__ import annotations

import pytest

from core_fixtures import BULLETIN, LOSSLESS, shared_engine
from redis_server import redis_server  # noqa: F401 - the fixture robots uses
from simllm_ros.request import QueryRequest
from simllm_ros.serving.engine import Engine

Q = "Which road should I take instead of Elm Street?"


@pytest.fixture(scope="module")
def base():
    e = shared_engine(**LOSSLESS)
    assert e.backend.exact_chunking, "the fleet's KV is lossless on a batch-invariant backend only"
    return e


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("fleet") / "secret"
    p.write_bytes(b"fleet-secret-for-tests-0123456789")
    return str(p)


def robot(base, server, secret_file, **kw) -> Engine:
    """A fork of `base` on the fleet store at `server` (200 ms timeouts unless kw says otherwise)."""
    s = base.settings.replace(fleet_store_url=server.url, fleet_secret_file=secret_file,
                              fleet_timeout_ms=kw.pop("fleet_timeout_ms", 200.0), **kw)
    return base.fork(s)


@pytest.fixture
def robots(base, redis_server, secret_file):  # noqa: F811 - the fixture imported above
    """Two robots on an emptied server."""
    redis_server.client().flushall()
    made = [robot(base, redis_server, secret_file) for _ in range(2)]
    yield made
    for r in made:
        r.unload()


def ask(engine, prompt=Q, scope="", context=BULLETIN, **kw):
    r = engine.handle(QueryRequest(prompt=prompt, context=context, cache_scope=scope, max_new_tokens=20,
                                   allow_approximate=False, **kw))
    assert r.success, r.error
    return r
