"""A json_schema is a promise: every answer with success=true is valid under its schema (checked here with the
`jsonschema` package), and every other schema gets a clear error that names the reason, before the model runs.

Unit tests of the ROS-free check (schema_check), then a fixed-seed fuzz of hostile schema classes through the
real engine (real model, real xgrammar), and the grammar's last-line checks (a dead end mid-answer, the answer
validated after decoding, the compile budget). test_interfaces drives the same classes over DDS."""
from __future__ import annotations

import json
import time

import jsonschema
import pytest

from simllm_ros.model import schema_check
from simllm_ros.request import QueryRequest
from simllm_ros.model.structured_output import SchemaError

from core_fixtures import BULLETIN, LOSSLESS, fresh, shared_engine
from schema_cases import ACCEPTED, REFUSED, fuzz_cases

QUESTION = "Describe the closed road as JSON."


@pytest.mark.parametrize("text, reason", REFUSED)
def test_each_refusal_names_its_reason_without_recursing(text, reason):
    with pytest.raises(schema_check.SchemaRefused) as e:
        doc = schema_check.parse(text)
        schema_check.check(doc)
        if "no token is allowed" in reason:  # only the grammar can tell: the engine test below
            raise schema_check.SchemaRefused(reason)
    assert str(e.value).startswith(reason), str(e.value)


@pytest.mark.parametrize("text", ACCEPTED)
def test_schemas_the_grammar_honours_pass_the_check(text):
    schema_check.check(schema_check.parse(text))


def test_answers_are_validated_with_jsonschema():
    doc = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert schema_check.answer_error('{"a": 3}', doc) is None
    assert schema_check.answer_error('{"a": "x"}', doc).startswith("the answer breaks the schema at /a")
    assert schema_check.answer_error("", doc).startswith("the answer is not JSON")


@pytest.fixture(scope="module")
def engine():
    e = shared_engine(**LOSSLESS)
    fresh(e)
    return e


def test_fuzz_every_reply_is_a_clear_refusal_or_a_valid_answer(engine, caplog):
    """Through the engine: no internal error, no ERROR log, a refusal before any token, every success valid
    under its schema with jsonschema, and no reply longer than the compile budget plus one answer's time."""
    budget = engine.settings.schema_compile_timeout_s
    for text, reason in fuzz_cases():
        t0 = time.perf_counter()
        res = engine.handle(QueryRequest(prompt=QUESTION, context=BULLETIN, json_schema=text, max_new_tokens=40))
        took = time.perf_counter() - t0
        if reason is not None:
            assert not res.success and res.error.startswith(reason) and res.generated_tokens <= 1, (text[:80],
                                                                                                   res.error)
        elif res.success:
            jsonschema.validate(json.loads(res.answer), json.loads(text))
        else:  # an accepted schema may still run out of tokens: said as such, never an internal error
            assert res.error.startswith("json_schema: the answer reached max_new_tokens"), res.error
        assert "internal error" not in res.error
        assert took < budget + 30, (text[:80], took)
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_a_grammar_dead_end_mid_answer_is_a_clear_error(engine, caplog):
    """A nested pattern nothing matches passes the up-front checks (its first token is '{'); the grammar then
    allows no token: the request fails with that reason, logged as a warning without a traceback, and the
    engine answers the next request."""
    text = '{"type": "object", "properties": {"a": {"type": "string", "pattern": "[^\\\\s\\\\S]"}}, "required": ["a"]}'
    res = engine.handle(QueryRequest(prompt=QUESTION, context=BULLETIN, json_schema=text, max_new_tokens=40))
    assert not res.success and "admits no value" in res.error, res.error
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    ok = engine.handle(QueryRequest(prompt="Is Elm Street closed?", context=BULLETIN, max_new_tokens=8))
    assert ok.success


def test_a_stop_string_that_cuts_the_json_is_named(engine):
    res = engine.handle(QueryRequest(prompt=QUESTION, context=BULLETIN, json_schema=ACCEPTED[0],
                                     max_new_tokens=40, stop=[":"]))
    assert not res.success and res.stop_reason == "stop"
    assert res.error.startswith("json_schema: a stop string ended the answer before the JSON was complete")


def test_a_slow_compile_is_cut_at_its_budget_and_refused_at_once_after(engine):
    """A big (legal) schema against a tiny budget: a clear error within about the budget; asked again, refused
    without compiling; a request without a schema is not held up meanwhile."""
    props = {f"field_{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1},{i % 5 + 9}}}[0-9]+$"}
             for i in range(300)}
    text = json.dumps({"type": "object", "properties": props, "required": list(props)[:40]})
    grammars = engine.backend.grammars
    t0 = time.perf_counter()
    with pytest.raises(SchemaError, match="longer than 0.01 s to compile"):
        grammars.compile(text, timeout_s=0.01)
    assert time.perf_counter() - t0 < 2.0
    t0 = time.perf_counter()
    with pytest.raises(SchemaError, match="to compile before"):
        grammars.compile(text, timeout_s=0.01)
    assert time.perf_counter() - t0 < 0.5
    plain = engine.handle(QueryRequest(prompt="Is Elm Street closed?", context=BULLETIN, max_new_tokens=4))
    assert plain.success
