"""What a json_schema must be before a grammar is compiled from it, and what an answer must be before it is a success.

Why: xgrammar compiles most of JSON Schema but ignores some keywords (`not`, `allOf`, contradictions between
`type` and `const`/`enum`, unsatisfiable patterns) and recurses on nesting, so a schema it cannot honour used to
give an answer that breaks it with success=true, or an internal error. Here a schema is checked first: nesting
and size within limits (counted without recursion), valid under its meta-schema (the `jsonschema` package),
no recursive `$ref`, no keyword the grammar would ignore, and no spot that admits no value at all; each refusal
names the keyword and its path in the schema. After decoding, `answer_error` validates the answer against the
schema with `jsonschema`, the last line of defence: an answer that fails it is never reported as a success.
"""
from __future__ import annotations

import json
import re
from typing import Any

MAX_DEPTH = 32  # nested objects/arrays in the schema document (a robot's schema is a few levels deep)
MAX_NODES = 5000  # JSON values in the schema document
# Keywords the grammar compiler would ignore (the answer would not honour them): refused by name.
UNSUPPORTED = ("not", "allOf", "if", "then", "else", "dependentSchemas", "dependentRequired", "dependencies",
               "unevaluatedProperties", "unevaluatedItems", "contains", "propertyNames", "patternProperties",
               "$dynamicRef", "$recursiveRef")
_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


class SchemaRefused(ValueError):
    """The schema cannot be promised; the message names the keyword and its path in the schema."""


def _path(parts) -> str:
    return "/" + "/".join(str(p) for p in parts) if parts else "/ (the root)"


def parse(text: str):
    """The schema document; refuses what is not JSON, too deep or too large before anything recurses on it."""
    depth = best = 0
    in_string = escaped = False
    for ch in text:  # nesting counted on the text: json.loads itself recurses
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            best = max(best, depth)
            if best > MAX_DEPTH:
                raise SchemaRefused(f"json_schema nests more than {MAX_DEPTH} objects or arrays deep")
        elif ch in "]}":
            depth -= 1
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise SchemaRefused(f"json_schema is not valid JSON: {e}") from None
    nodes, stack = 0, [doc]
    while stack:
        v = stack.pop()
        nodes += 1
        if nodes > MAX_NODES:
            raise SchemaRefused(f"json_schema has more than {MAX_NODES} values")
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    if not isinstance(doc, (dict, bool)):
        raise SchemaRefused(f"json_schema must be a JSON object (a schema), got {type(doc).__name__}")
    return doc


def _subschemas(schema: dict, path: tuple):
    """(subschema, its path) for every place a schema can hold schemas (the keywords the grammar reads)."""
    for key in ("properties", "$defs", "definitions"):
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                yield sub, (*path, key, name)
    for key in ("items", "additionalProperties"):
        # false here only forbids more keys or items (the object or array itself still has values)
        if isinstance(schema.get(key), dict) or schema.get(key) is True:
            yield schema[key], (*path, key)
    for key in ("anyOf", "oneOf", "prefixItems"):
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                yield sub, (*path, key, i)


def _resolve(doc, ref: str):
    """The schema a local `$ref` points to, or None where it is not a local pointer into this document."""
    if not ref.startswith("#"):
        return None
    node = doc
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _types(schema: dict):
    t = schema.get("type")
    return None if t is None else ([t] if isinstance(t, str) else list(t))


def _fits_type(value, types) -> bool:
    for t in types:
        if t == "integer" and isinstance(value, int) and not isinstance(value, bool):
            return True
        if t == "number" and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if t in _TYPES and isinstance(value, _TYPES[t]) and not (t != "boolean" and isinstance(value, bool)):
            return True
    return False


def _check_node(doc, schema, path: tuple) -> None:
    if schema is False:
        raise SchemaRefused(f"json_schema admits no value at {_path(path)} (the schema false)")
    if not isinstance(schema, dict):
        return
    for key in UNSUPPORTED:
        if key in schema:
            raise SchemaRefused(f"json_schema keyword '{key}' at {_path(path)} is not supported: the grammar "
                                "would not honour it")
    types = _types(schema)
    if types is not None and not types:
        raise SchemaRefused(f"json_schema admits no value at {_path((*path, 'type'))}: an empty type list")
    for key in ("anyOf", "oneOf"):
        if key in schema and not schema[key]:
            raise SchemaRefused(f"json_schema admits no value at {_path((*path, key))}: no alternatives")
    if "const" in schema and types is not None and not _fits_type(schema["const"], types):
        raise SchemaRefused(f"json_schema admits no value at {_path(path)}: 'const' {json.dumps(schema['const'])} "
                            f"is not of type {'/'.join(types)}")
    if "enum" in schema:
        values = schema["enum"]
        if not values:
            raise SchemaRefused(f"json_schema admits no value at {_path((*path, 'enum'))}: an empty enum")
        if types is not None and not any(_fits_type(v, types) for v in values):
            raise SchemaRefused(f"json_schema admits no value at {_path(path)}: no 'enum' value is of type "
                                f"{'/'.join(types)}")
    required = schema.get("required") or []
    props = schema["properties"] if isinstance(schema.get("properties"), dict) else {}
    for name in required:
        if props.get(name) is False or (name not in props and schema.get("additionalProperties") is False):
            raise SchemaRefused(f"json_schema admits no value at {_path(path)}: property '{name}' is required "
                                "and forbidden")
    if "pattern" in schema:
        try:
            re.compile(schema["pattern"])
        except re.error as e:
            raise SchemaRefused(f"json_schema 'pattern' at {_path(path)} is not a regular expression: {e}") from None


def check(doc) -> None:
    """Refuses (SchemaRefused) a parsed schema the grammar cannot honour; returns None for one it can."""
    if doc is True or doc == {}:
        return
    import jsonschema  # deferred: jsonschema is slow to import

    validator = jsonschema.validators.validator_for(doc if isinstance(doc, dict) else {})
    try:
        validator.check_schema(doc)
    except jsonschema.SchemaError as e:
        where = _path(tuple(e.absolute_path))
        raise SchemaRefused(f"json_schema is not a valid schema at {where}: {e.message[:200]}") from None
    # every node, iteratively; refs followed, and a ref reached again on its own path is recursion
    stack: list[tuple[Any, tuple, frozenset]] = [(doc, (), frozenset())]
    seen = 0
    while stack:
        schema, path, refs = stack.pop()
        seen += 1
        if seen > MAX_NODES:
            raise SchemaRefused(f"json_schema expands to more than {MAX_NODES} subschemas (through $ref)")
        _check_node(doc, schema, path)
        if not isinstance(schema, dict):
            continue
        ref = schema.get("$ref")
        if isinstance(ref, str):
            if ref in refs:
                raise SchemaRefused(f"json_schema '$ref' {ref!r} at {_path(path)} refers back to an enclosing "
                                    "schema: recursive schemas are not supported")
            target = _resolve(doc, ref)
            if target is None:
                raise SchemaRefused(f"json_schema '$ref' {ref!r} at {_path(path)} does not point into this schema")
            stack.append((target, (*path, "$ref"), refs | {ref}))
        for sub, sub_path in _subschemas(schema, path):
            if sub_path[len(path)] in ("$defs", "definitions"):
                continue  # checked where it is used: an unused definition costs nothing
            stack.append((sub, sub_path, refs))


def pattern_paths(doc) -> list[str]:
    """Where the schema has a 'pattern' (the usual reason a grammar allows no token mid-answer)."""
    out: list[str] = []
    stack: list[tuple[Any, tuple]] = [(doc, ())]
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                out.append(_path((*path, "pattern")))
            stack.extend((v, (*path, k)) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, (*path, i)) for i, v in enumerate(node))
    return sorted(out)


def answer_error(answer: str, doc) -> str | None:
    """None if the answer is JSON valid under the schema, else why not (the validation error, shortened)."""
    import jsonschema  # deferred: jsonschema is slow to import

    try:
        value = json.loads(answer)
    except ValueError as e:
        return f"the answer is not JSON: {e}"
    try:
        jsonschema.validate(value, doc)
    except jsonschema.ValidationError as e:
        return f"the answer breaks the schema at {_path(tuple(e.absolute_path))}: {e.message[:200]}"
    except RecursionError:
        return "the answer nests too deeply to validate"
    return None
