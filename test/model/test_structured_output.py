"""Structured output: JSON-schema grammars (xgrammar) in the verified decode loop.

Real model (SmolLM2 bf16, shared with test_verified_decoding), real xgrammar, a real validator (jsonschema).
The claims:
- a json_schema request returns JSON that validates, also when its prompt's KV and answer come from the pool;
- the grammar masks every row the loop picks from, draft rows included: with any drafts (right, wrong,
  free text the grammar forbids, prompt lookup) the constrained answer is token for token the
  constrained answer without drafts, greedy and sampled;
- a schema that is not JSON, not an object, or not usable by xgrammar gets a clear error and nothing runs.
"""
from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from simllm_ros.model.draft_proposer import DraftProposer
from simllm_ros.request import CacheResult, QueryRequest
from simllm_ros.model.structured_output import SchemaError

from core_fixtures import BULLETIN, LOSSLESS, fresh, shared_engine
from draft_sources import FixedDrafts

SCHEMA = {
    "type": "object",
    "properties": {
        "road": {"type": "string", "enum": ["Elm Street", "Oak Avenue", "Route 9", "Harbour Bridge"]},
        "closed": {"type": "boolean"},
        "until": {"type": "string", "enum": ["06:30", "17:00", "19:00", "20:00"]},
    },
    "required": ["road", "closed", "until"],
}
QUESTION = "Which road is closed today, and until when? Reply in JSON with road, closed and until."


@pytest.fixture(scope="module")
def engine():
    return shared_engine(**LOSSLESS)


def _ids(engine, question=QUESTION):
    return engine.backend.prompt_ids(engine.settings.system_prompt, BULLETIN, question)


def _decode(engine, ids, max_new, constraint=None, drafts=None, temperature=0.0, seed=0):
    b = engine.backend
    logits, cache = b.prefill(ids, reserve=max_new + 40)
    return b.decode(logits, cache, max_new, temperature, seed, drafts=drafts, constraint=constraint)


def test_json_schema_answers_validate_from_an_empty_and_a_warm_pool(engine):
    fresh(engine, answer_memo=False)  # a repeat through verified drafts (the memo would skip the model)
    req = QueryRequest(prompt=QUESTION, context=BULLETIN, json_schema=json.dumps(SCHEMA), max_new_tokens=48)
    first = engine.handle(req)
    assert first.success, first.error
    jsonschema.validate(json.loads(first.answer), SCHEMA)
    assert first.stop_reason == "eos" and first.exact
    again = engine.handle(req)  # prompt KV from the pool, the stored answer as a draft
    assert again.success and again.cache_result == CacheResult.EXACT_PREFIX and again.exact
    assert again.answer == first.answer
    assert again.draft_tokens_accepted > 0 and again.decode_passes < first.decode_passes
    # A free-text request on the same prompt shares the pool entry, never the JSON grammar.
    free = engine.handle(QueryRequest(prompt=QUESTION, context=BULLETIN, max_new_tokens=24))
    assert free.success and not free.answer.startswith("{")
    print(f"\n[structured output] {first.answer}  ({first.generated_tokens} tokens, {first.decode_passes} passes; "
          f"warm: {again.decode_passes} passes, {again.draft_tokens_accepted} draft tokens accepted)")
    fresh(engine)  # the memo on: the identical schema request gets the stored JSON without a model pass
    assert engine.handle(req).answer == first.answer
    memo = engine.handle(req)
    assert memo.success and memo.decode_passes == 0 and memo.exact and memo.answer == first.answer
    assert engine.handle(QueryRequest(prompt=QUESTION, context=BULLETIN, max_new_tokens=24)).answer == free.answer


@pytest.mark.parametrize("temperature,seed", [(0.0, 0), (0.8, 7)])
def test_grammar_with_any_drafts_equals_grammar_without(engine, temperature, seed):
    compiled = engine.backend.grammars.compile(json.dumps(SCHEMA))
    ids = _ids(engine)
    plain = _decode(engine, ids, 40, compiled.constraint(), temperature=temperature, seed=seed)
    jsonschema.validate(json.loads(plain.text), SCHEMA)
    free = _decode(engine, ids, 24, temperature=temperature, seed=seed)  # what the model says unconstrained
    assert not compiled.constraint().allowed(0)[free.tokens[0]], "the free-text answer's first token is allowed"
    vocab = engine.backend.vocab_size
    rng = random.Random(1)
    wrong = [rng.randrange(100, vocab) for _ in range(40)]
    t = plain.tokens
    variants = {
        "right": FixedDrafts(t),
        "all wrong": FixedDrafts([], wrong),
        "free text the grammar forbids": FixedDrafts(free.tokens),
        "right, then a forbidden token": FixedDrafts(t[:3] + free.tokens, wrong),
        "prompt lookup": DraftProposer(prompt=ids, max_tokens=8),
    }
    for name, drafts in variants.items():
        got = _decode(engine, ids, 40, compiled.constraint(), drafts=drafts, temperature=temperature, seed=seed)
        assert got.tokens == t, f"drafts {name}: {got.text!r} != {plain.text!r}"
        if name == "right":
            assert got.draft_accepted == got.draft_proposed and got.forward_passes * 3 <= plain.forward_passes
        if name == "free text the grammar forbids":
            assert got.draft_accepted == 0


def test_the_mask_only_lets_grammar_tokens_through(engine):
    c = engine.backend.grammars.compile(json.dumps(SCHEMA)).constraint()
    logits = torch.zeros(engine.backend.vocab_size)
    allowed = c.allowed(0)
    assert 0 < int(allowed.sum()) < 100  # '{' and its few spellings
    masked = c.mask(logits, 0)
    assert torch.isinf(masked[~allowed]).all() and torch.equal(masked[allowed], logits[allowed])
    with pytest.raises(RuntimeError, match="step 1 after 0"):
        c.mask(logits, 1)


@pytest.mark.parametrize("schema, reason", [
    ("not json", "json_schema is not valid JSON: Expecting value: line 1 column 1 (char 0)"),
    ("[1, 2]", "json_schema must be a JSON object (a schema), got list"),
    ('{"type": "nonsense"}', "json_schema is not a valid schema at /type: 'nonsense' is not valid"),
    ('{"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}',
     "json_schema '$ref' '#/nowhere' at /properties/a does not point into this schema"),
])
def test_a_bad_schema_gets_a_clear_error_and_nothing_runs(engine, schema, reason):
    with pytest.raises(SchemaError) as e:
        engine.backend.grammars.compile(schema)
    assert str(e.value).startswith(reason), str(e.value)
    before = engine.stats()["errors_total"]
    res = engine.handle(QueryRequest(prompt=QUESTION, json_schema=schema))
    assert not res.success and res.error.startswith(reason) and res.generated_tokens == 0
    assert engine.stats()["errors_total"] == before + 1
