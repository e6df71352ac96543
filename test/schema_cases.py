"""The hostile json_schema classes and the accepted schemas, shared by test_schema_promise (through the engine) and
test_interfaces (over DDS)."""
import random


def deep(n: int, open_: str, close: str, leaf: str = "{}") -> str:
    return open_ * n + leaf + close * n


# (schema text, the start of the refusal) for the classes a hostile caller tried; None: must be accepted
REFUSED = [
    ('{"not": {}}', "json_schema keyword 'not' at / (the root) is not supported"),
    ('{"allOf": [{"type": "string"}, {"type": "integer"}]}', "json_schema keyword 'allOf' at / (the root)"),
    ('{"type": []}', "json_schema is not a valid schema at /type"),
    ('{"anyOf": []}', "json_schema is not a valid schema at /anyOf"),
    ('{"type": "object", "properties": {"a": false}, "required": ["a"]}',
     "json_schema admits no value at / (the root): property 'a' is required and forbidden"),
    ('{"type": "object", "additionalProperties": false, "required": ["b"]}',
     "json_schema admits no value at / (the root): property 'b' is required and forbidden"),
    ('{"type": "string", "const": 5}', "json_schema admits no value at / (the root): 'const' 5 is not of type"),
    ('{"type": "string", "enum": [1, 2]}', "json_schema admits no value at / (the root): no 'enum' value"),
    ('{"type": "object", "properties": {"x": {"type": "integer", "enum": []}}}',
     "json_schema admits no value at /properties/x/enum: an empty enum"),
    ('{"$ref": "#"}', "json_schema '$ref' '#' at /$ref refers back to an enclosing schema"),
    ('{"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}', "json_schema '$ref' '#/$defs/a'"),
    ('{"$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}}, "b": {"type": "object", '
     '"properties": {"a": {"$ref": "#/$defs/a"}}}}, "$ref": "#/$defs/a"}', "json_schema '$ref' '#/$defs/a'"),
    ('{"type": "string", "pattern": "[^\\\\s\\\\S]"}',
     "json_schema admits no value: no token is allowed after 1 tokens of the answer (check 'pattern' at /pattern)"),
    ('{"type": "object", "properties": {"a": {"type": "string", "pattern": "("}}}',
     "json_schema is not a valid schema at /properties/a/pattern"),
    (deep(600, '{"type": "object", "properties": {"a": ', "}}"), "json_schema nests more than 32"),
    (deep(1200, '{"type": "array", "items": ', "}"), "json_schema nests more than 32"),
    (deep(900, '{"anyOf": [', "]}"), "json_schema nests more than 32"),
    ('{"enum": ' + deep(5000, "[", "]", "1") + "}", "json_schema nests more than 32"),
    ("[1, 2]", "json_schema must be a JSON object"),
    ("{oops", "json_schema is not valid JSON"),
    ('{"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}', "json_schema '$ref' '#/nowhere'"),
]
ACCEPTED = [
    '{"type": "object", "properties": {"road": {"type": "string"}, "closed": {"type": "boolean"}}, '
    '"required": ["road", "closed"]}',
    '{"$defs": {"t": {"type": "string", "enum": ["09:00", "17:00"]}}, "type": "object", '
    '"properties": {"until": {"$ref": "#/$defs/t"}}, "required": ["until"]}',
    '{"type": "string", "enum": ["Elm Street", "Oak Avenue"]}',
    '{"type": "integer", "minimum": 0, "maximum": 24}',
    '{"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}',
    '{"anyOf": [{"type": "integer"}, {"type": "boolean"}]}',
    '{"type": "string", "pattern": "^[A-Z][a-z]+ Street$"}',
    '{"type": "string", "const": "Elm Street"}',
    '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": false}',
    '{"type": "array", "items": false, "maxItems": 0}',
]


def fuzz_cases(seed=7, n=30):
    """A fixed-seed mix of the refused classes and accepted schemas, in random order."""
    rng = random.Random(seed)
    cases = [(t, r) for t, r in REFUSED] + [(t, None) for t in ACCEPTED]
    return rng.sample(cases, k=min(n, len(cases)))
