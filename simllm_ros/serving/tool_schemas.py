"""Tool schemas from ROS interface types: what a call's arguments may hold, read from rosidl's generated classes
(SLOT_TYPES and the constants), and the bounds a tools file narrows each field to.

Why without rclpy: the schema and the bounds are decided from the interface types alone, so they can be built and
tested without a running node. A tool's arguments are its request (service) or goal (action) message: nested
messages as objects, fixed arrays with their size, bounded sequences and strings with their bound, integers within
their type's range, float32 within float32, a field with constants named FIELD_* as an enum of them, all fields
required and nothing else allowed, then narrowed by the tools file's bounds (minimum, maximum, allowed, max_length,
max_items, per field path through nested messages and arrays: "target", "pose.position.x"). `value_error` is the
one check of a value against its field's type and bounds, used by the tools file, the calls and the messages.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import math
import re
from typing import Any

_TYPE_RE = re.compile(r"([A-Za-z0-9_]+)/(srv|action)/([A-Za-z0-9_]+)")
_BOUND_KEYS = {"minimum", "maximum", "allowed", "max_length", "max_items"}
INT_RANGES = {"int8": (-2**7, 2**7 - 1), "uint8": (0, 2**8 - 1), "int16": (-2**15, 2**15 - 1),
              "uint16": (0, 2**16 - 1), "int32": (-2**31, 2**31 - 1), "uint32": (0, 2**32 - 1),
              "int64": (-2**63, 2**63 - 1), "uint64": (0, 2**64 - 1), "octet": (0, 255), "byte": (0, 255)}
FLOAT_TYPES = ("float", "double", "long double")
FLOAT32_MAX = 3.4028234663852886e38


class ToolError(ValueError):
    """A tools file, a request's tools or a call that cannot be used; the message names the problem."""


# ----------------------------------------------------------------------------- ROS types, by introspection
def _defn():
    # local: rosidl_parser is ROS: the tool modules import without it (the ROS-free suite)
    from rosidl_parser import definition
    return definition


def message_class(namespaces, name: str):
    """The generated Python class of pkg/msg/Name (namespaces ['pkg', 'msg'])."""
    module = ".".join(namespaces)
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise ToolError(f"unknown message type {'/'.join([*namespaces, name])}: is its package built and "
                        "installed in this environment?") from None


def interface(type_name: str | None):
    """(kind 'service' | 'action', the interface class, the class of its arguments: Request or Goal)."""
    m = _TYPE_RE.fullmatch(type_name or "")
    if m is None:
        raise ToolError(f"type {type_name!r} is not pkg/srv/Name or pkg/action/Name")
    pkg, kind, name = m.groups()
    try:
        cls = getattr(importlib.import_module(f"{pkg}.{kind}"), name)
    except (ImportError, AttributeError):
        raise ToolError(f"unknown interface type {type_name}: is package {pkg} built and installed in this "
                        "environment?") from None
    return ("service", cls, cls.Request) if kind == "srv" else ("action", cls, cls.Goal)


def constants(cls) -> dict:
    """The constants a rosidl message class declares (name -> value)."""
    for k, v in type(cls).__dict__.items():
        if k.endswith("__constants") and isinstance(v, dict):
            return dict(v)
    return {}


def message_fields(cls):
    """(field name, its rosidl_parser type) of a message class, in declaration order."""
    return list(zip(cls.get_fields_and_field_types().keys(), cls.SLOT_TYPES))


def element_of(t):
    """(the element type, the array kind: None | 'fixed' | 'bounded' | 'unbounded', its size or bound)."""
    d = _defn()
    if isinstance(t, d.Array):
        return t.value_type, "fixed", t.size
    if isinstance(t, d.BoundedSequence):
        return t.value_type, "bounded", t.maximum_size
    if isinstance(t, d.UnboundedSequence):
        return t.value_type, "unbounded", None
    return t, None, None


def kind_of(t) -> str:
    """'message' | 'string' | 'boolean' | 'float' | 'integer' | 'char' for an element type."""
    d = _defn()
    if isinstance(t, d.NamespacedType):
        return "message"
    if isinstance(t, d.AbstractGenericString):
        return "string"
    name = t.typename
    if name == "boolean":
        return "boolean"
    if name in FLOAT_TYPES:
        return "float"
    if name in ("char", "wchar"):
        return "char"
    return "integer"


def _string_bound(t) -> int | None:
    size = getattr(t, "maximum_size", None)
    return int(size) if isinstance(size, int) else None


@dataclasses.dataclass(frozen=True)
class Bounds:
    """What the tools file narrows one field to (on an array: each item; max_items: the array)."""

    minimum: float | None = None
    maximum: float | None = None
    allowed: tuple | None = None
    max_length: int | None = None
    max_items: int | None = None


@dataclasses.dataclass
class FieldInfo:
    """One field of a tool's arguments, found by its path: the element type and how it is held."""

    path: str
    elem: Any  # rosidl_parser's type of the element (untyped; what it has depends on `kind`)
    kind: str  # see _kind
    array: str | None
    size: int | None
    owner: type  # the message class that declares it (its constants)
    name: str


def find_field(cls, path: str) -> FieldInfo:
    """The field at a dotted path ("pose.position.x"; arrays of messages are gone through), or ToolError."""
    parts = path.split(".")
    owner = cls
    for i, part in enumerate(parts):
        fields = dict(message_fields(owner))
        if part not in fields:
            where = ".".join(parts[:i]) or "the arguments"
            raise ToolError(f"field path {path!r}: {where} has no field {part!r} (fields: {', '.join(fields)})")
        elem, array, size = element_of(fields[part])
        kind = kind_of(elem)
        if i == len(parts) - 1:
            return FieldInfo(path, elem, kind, array, size, owner, part)
        if kind != "message":
            raise ToolError(f"field path {path!r}: {'.'.join(parts[:i + 1])} is not a message")
        owner = message_class(elem.namespaces, elem.name)
    raise ToolError(f"empty field path {path!r}")


def _enum_constants(info: FieldInfo) -> dict:
    """Constants of the declaring message named FIELD_* whose values fit the field: the field's enum."""
    prefix = info.name.upper() + "_"
    out = {}
    for k, v in constants(info.owner).items():
        if not k.startswith(prefix):
            continue
        if info.kind == "string" and isinstance(v, str) or \
                info.kind == "integer" and isinstance(v, int) and not isinstance(v, bool):
            out[k] = v
    return out


def _elem_schema(info_elem, kind: str, path: str, bounds: dict, fixed: dict, owner, name: str) -> dict:
    """The schema of one element (an item of an array, or the field itself)."""
    b = bounds.get(path, Bounds())
    if kind == "message":
        return message_schema(message_class(info_elem.namespaces, info_elem.name), bounds, fixed, path)
    out: dict = {}
    if kind == "boolean":
        out["type"] = "boolean"
    elif kind == "string":
        out["type"] = "string"
        limit = _string_bound(info_elem)
        if b.max_length is not None:
            limit = b.max_length if limit is None else min(limit, b.max_length)
        if limit is not None:
            out["maxLength"] = limit
    elif kind == "char":
        out.update(type="string", minLength=1, maxLength=1)
    elif kind == "float":
        out["type"] = "number"
        lo, hi = ((-FLOAT32_MAX, FLOAT32_MAX) if info_elem.typename == "float" else (None, None))
        lo = b.minimum if b.minimum is not None else lo
        hi = b.maximum if b.maximum is not None else hi
        if lo is not None:
            out["minimum"] = lo
        if hi is not None:
            out["maximum"] = hi
    else:
        lo, hi = INT_RANGES[info_elem.typename]
        out.update(type="integer", minimum=int(max(lo, b.minimum if b.minimum is not None else lo)),
                   maximum=int(min(hi, b.maximum if b.maximum is not None else hi)))
    if b.allowed is not None:
        out = {"enum": list(b.allowed)}
    elif kind in ("string", "integer"):
        named = _enum_constants(FieldInfo(path, info_elem, kind, None, None, owner, name))
        if named:
            values = [v for v in named.values() if _within(v, kind, b, out)]
            out = {"enum": values, "description": "one of " + ", ".join(f"{k}={v!r}" for k, v in named.items()
                                                                        if v in values)}
    return out


def _within(v, kind, b: Bounds, schema: dict) -> bool:
    if kind == "string":
        return schema.get("maxLength") is None or len(v) <= schema["maxLength"]
    return schema.get("minimum", v) <= v <= schema.get("maximum", v)


def message_schema(cls, bounds: dict | None = None, fixed: dict | None = None, prefix: str = "") -> dict:
    """A JSON schema every value of which a message of `cls` can hold, narrowed by bounds (path -> Bounds);
    fields in `fixed` (path -> value) are left out (the node fills them)."""
    bounds, fixed = bounds or {}, fixed or {}
    props: dict = {}
    for name, t in message_fields(cls):
        path = f"{prefix}.{name}" if prefix else name
        if path in fixed:
            continue
        elem, array, size = element_of(t)
        kind = kind_of(elem)
        item = _elem_schema(elem, kind, path, bounds, fixed, cls, name)
        if array is None:
            props[name] = item
            continue
        arr: dict = {"type": "array", "items": item}
        b = bounds.get(path, Bounds())
        if array == "fixed":
            arr["minItems"] = arr["maxItems"] = size
        elif array == "bounded":
            arr["maxItems"] = size
        if b.max_items is not None:
            arr["maxItems"] = min(arr.get("maxItems", b.max_items), b.max_items)
        props[name] = arr
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


# ----------------------------------------------------------------------------- bounds from the tools file
def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_bounds(cls, path: str, raw) -> Bounds:
    """A field's bounds from the tools file, checked against the field's type; ToolError names the problem."""
    if not isinstance(raw, dict):
        raise ToolError(f"fields.{path}: expected a mapping of bounds ({', '.join(sorted(_BOUND_KEYS))})")
    unknown = sorted(set(raw) - _BOUND_KEYS)
    if unknown:
        raise ToolError(f"fields.{path}: unknown bound {unknown[0]!r} (known: {', '.join(sorted(_BOUND_KEYS))})")
    info = find_field(cls, path)
    b = Bounds(minimum=raw.get("minimum"), maximum=raw.get("maximum"),
               allowed=tuple(raw["allowed"]) if isinstance(raw.get("allowed"), list) else raw.get("allowed"),
               max_length=raw.get("max_length"), max_items=raw.get("max_items"))
    where = f"fields.{path}"
    if b.max_items is not None:
        if info.array is None:
            raise ToolError(f"{where}: max_items on a field that is not an array")
        if info.array == "fixed":
            raise ToolError(f"{where}: max_items on a fixed-size array ({info.size} items)")
        if isinstance(b.max_items, bool) or not isinstance(b.max_items, int) or b.max_items < 0:
            raise ToolError(f"{where}: max_items must be an integer >= 0, got {b.max_items!r}")
    if info.kind in ("message", "boolean", "char") and (b.minimum, b.maximum, b.max_length) != (None,) * 3:
        raise ToolError(f"{where}: minimum, maximum and max_length do not apply to a {info.kind} field")
    if info.kind == "message" and b.allowed is not None:
        raise ToolError(f"{where}: allowed does not apply to a message field; bound its fields")
    if info.kind == "string" and (b.minimum is not None or b.maximum is not None):
        raise ToolError(f"{where}: minimum/maximum do not apply to a string field (use allowed or max_length)")
    if info.kind in ("integer", "float") and b.max_length is not None:
        raise ToolError(f"{where}: max_length applies to strings only")
    for key in ("minimum", "maximum"):
        v = getattr(b, key)
        if v is not None and not is_number(v):
            raise ToolError(f"{where}: {key} must be a finite number, got {v!r}")
        if v is not None and info.kind == "integer":
            lo, hi = INT_RANGES[info.elem.typename]
            if v != int(v) or not lo <= v <= hi:
                raise ToolError(f"{where}: {key} {v!r} is not a {info.elem.typename} (range {lo}..{hi})")
    if b.minimum is not None and b.maximum is not None and b.minimum > b.maximum:
        raise ToolError(f"{where}: minimum {b.minimum} is above maximum {b.maximum}")
    if b.max_length is not None:
        if isinstance(b.max_length, bool) or not isinstance(b.max_length, int) or b.max_length < 0:
            raise ToolError(f"{where}: max_length must be an integer >= 0, got {b.max_length!r}")
    if b.allowed is not None:
        if not isinstance(b.allowed, tuple) or not b.allowed:
            raise ToolError(f"{where}: allowed must be a non-empty list")
        for v in b.allowed:
            err = value_error(info, v, Bounds(b.minimum, b.maximum, None, b.max_length))
            if err:
                raise ToolError(f"{where}: allowed value {v!r}: {err}")
    return b


def value_error(info: FieldInfo, v, b: Bounds) -> str | None:
    """Why one element value cannot go into the field under the bounds, or None."""
    kind = info.kind
    if kind == "boolean":
        ok = isinstance(v, bool)
    elif kind in ("string", "char"):
        ok = isinstance(v, str)
    elif kind == "integer":
        ok = isinstance(v, int) and not isinstance(v, bool)
    elif kind == "float":
        ok = is_number(v)
    else:
        ok = isinstance(v, dict)
    if not ok:
        return f"expected a {kind}, got {json.dumps(v)[:60]}"
    if kind == "integer":
        lo, hi = INT_RANGES[info.elem.typename]
        if not lo <= v <= hi:
            return f"{v} is outside {info.elem.typename}'s range {lo}..{hi}"
    if kind == "float" and info.elem.typename == "float" and abs(v) > FLOAT32_MAX:
        return f"{v} does not fit a float32"
    if kind in ("integer", "float"):
        if b.minimum is not None and _lt(v, b.minimum, info):
            return f"{v} is below the minimum {b.minimum}"
        if b.maximum is not None and _lt(b.maximum, v, info):
            return f"{v} is above the maximum {b.maximum}"
    if kind == "string":
        limit = _string_bound(info.elem)
        if limit is not None and len(v) > limit:
            return f"{len(v)} characters, the type holds at most {limit}"
        if b.max_length is not None and len(v) > b.max_length:
            return f"{len(v)} characters, at most {b.max_length} allowed"
    if kind == "char" and len(v) != 1:
        return "a char is one character"
    if b.allowed is not None and v not in b.allowed:
        return f"{json.dumps(v)[:60]} is not one of the allowed values {list(b.allowed)}"
    return None


def _lt(a, b, info: FieldInfo) -> bool:
    """a < b, for a float32 field as float32 compares (a bound of 0.3 admits the float32 that 0.3 becomes)."""
    if info.kind == "float" and info.elem.typename == "float":
        # local: numpy (~0.1 s) for a float32 bound only: the tool modules import without it
        import numpy as np
        return bool(np.float32(a) < np.float32(b))
    return a < b


@dataclasses.dataclass
class Tool:
    """One tool of the node: a ROS service or action the model may call."""

    name: str
    description: str
    kind: str  # "service" | "action"
    ros_name: str
    type_name: str
    iface: type  # the srv or action class
    args_class: type  # its Request or Goal
    executable: bool = False
    timeout_s: float = 10.0
    rate_calls: int = 0  # 0: no rate limit
    rate_per_s: float = 0.0
    bounds: dict = dataclasses.field(default_factory=dict)  # path -> Bounds
    fixed: dict = dataclasses.field(default_factory=dict)  # path -> value
    schema: dict = dataclasses.field(default_factory=dict)  # of the arguments

    def call_schema(self, args_key: str = "arguments") -> dict:
        """The schema of a call of this tool: {"name": this tool, args_key: its arguments} (Llama 3's templates
        call the arguments "parameters")."""
        return {"type": "object", "properties": {"name": {"const": self.name}, args_key: self.schema},
                "required": ["name", args_key], "additionalProperties": False}

