"""Tool calls: the ROS services and actions a model may call, their JSON schemas, and every check before a call is sent.

Why a module of its own, without rclpy: what a call may hold is decided from the ROS interface types alone (rosidl's
generated classes: SLOT_TYPES and the constants), so the schema, the bounds and the conversion to a message can be
built and tested without a running node; the ROS layer (ros/tool_executor.py) only sends what this module passed.

A tools file (YAML, the node's `tools` parameter) lists each tool: name, description, `service:` or `action:` (its
ROS name), `type:` (pkg/srv/Name or pkg/action/Name), `executable:` (false unless set), `timeout_s`, `rate_limit`
({calls, per_s}), `fields:` (bounds per field path: minimum, maximum, allowed, max_length, max_items; a path goes
through nested messages and arrays: "target", "pose.position.x") and `fixed:` (field path -> value the node fills;
left out of the schema, e.g. header.frame_id). The schema of a tool's arguments is its request (service) or goal
(action) message: nested messages as objects, fixed arrays with their size, bounded sequences and strings with
their bound, integers within their type's range, a field with constants named FIELD_* as an enum of them, all
fields required and nothing else allowed, then narrowed by the bounds. A call is checked against that schema and
again, field by field, against the bounds, then again on the message it becomes (`to_message`).

The answer format is generic (one JSON object, constrained by xgrammar): a call is {"name": ..., "arguments": {...}},
and under tool_choice "auto" the model may instead answer {"text": "..."}. Chat templates' own tool formats are
not used: one format for every model keeps the grammar, the cache key and the checks the same.
"""
from __future__ import annotations

import collections
import dataclasses
import importlib
import json
import math
import re
import threading
import time

CHOICES = ("auto", "none", "required")
MAX_TOOLS = 64
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_ROS_NAME_RE = re.compile(r"/?[A-Za-z_~][A-Za-z0-9_/]*")
_TYPE_RE = re.compile(r"([A-Za-z0-9_]+)/(srv|action)/([A-Za-z0-9_]+)")
_TOOL_KEYS = {"name", "description", "service", "action", "type", "executable", "timeout_s", "rate_limit", "fields",
              "fixed"}
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


def interface(type_name: str):
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


def _fields(cls):
    """(field name, its rosidl_parser type) of a message class, in declaration order."""
    return list(zip(cls.get_fields_and_field_types().keys(), cls.SLOT_TYPES))


def _base(t):
    """(the element type, the array kind: None | 'fixed' | 'bounded' | 'unbounded', its size or bound)."""
    d = _defn()
    if isinstance(t, d.Array):
        return t.value_type, "fixed", t.size
    if isinstance(t, d.BoundedSequence):
        return t.value_type, "bounded", t.maximum_size
    if isinstance(t, d.UnboundedSequence):
        return t.value_type, "unbounded", None
    return t, None, None


def _kind(t) -> str:
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
    elem: object  # rosidl_parser type of the element
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
        fields = dict(_fields(owner))
        if part not in fields:
            where = ".".join(parts[:i]) or "the arguments"
            raise ToolError(f"field path {path!r}: {where} has no field {part!r} (fields: {', '.join(fields)})")
        elem, array, size = _base(fields[part])
        kind = _kind(elem)
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
    for name, t in _fields(cls):
        path = f"{prefix}.{name}" if prefix else name
        if path in fixed:
            continue
        elem, array, size = _base(t)
        kind = _kind(elem)
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


# ----------------------------------------------------------------------------- the tools file
def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_bounds(cls, path: str, raw) -> Bounds:
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
        if v is not None and not _number(v):
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
            err = _value_error(info, v, Bounds(b.minimum, b.maximum, None, b.max_length))
            if err:
                raise ToolError(f"{where}: allowed value {v!r}: {err}")
    return b


def _value_error(info: FieldInfo, v, b: Bounds) -> str | None:
    """Why one element value cannot go into the field under the bounds, or None."""
    kind = info.kind
    if kind == "boolean":
        ok = isinstance(v, bool)
    elif kind in ("string", "char"):
        ok = isinstance(v, str)
    elif kind == "integer":
        ok = isinstance(v, int) and not isinstance(v, bool)
    elif kind == "float":
        ok = _number(v)
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

    def call_schema(self) -> dict:
        return {"type": "object", "properties": {"name": {"const": self.name}, "arguments": self.schema},
                "required": ["name", "arguments"], "additionalProperties": False}


def _tool_from(raw, i: int) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(raw, dict):
        raise ToolError(f"{where}: expected a mapping")
    unknown = sorted(set(raw) - _TOOL_KEYS)
    if unknown:
        raise ToolError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(_TOOL_KEYS))})")
    name = raw.get("name")
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ToolError(f"{where}: name {name!r} must be letters, digits and _ (at most 64, not starting with a digit)")
    where = f"tool {name!r}"
    desc = raw.get("description", "")
    if not isinstance(desc, str) or len(desc) > 1000:
        raise ToolError(f"{where}: description must be a string of at most 1000 characters")
    if ("service" in raw) == ("action" in raw):
        raise ToolError(f"{where}: give exactly one of service: (a service name) or action: (an action name)")
    kind = "service" if "service" in raw else "action"
    ros_name = raw[kind]
    if not isinstance(ros_name, str) or not _ROS_NAME_RE.fullmatch(ros_name) or "//" in ros_name:
        raise ToolError(f"{where}: {kind} {ros_name!r} is not a ROS name")
    try:
        got_kind, iface, args_class = interface(raw.get("type"))
    except ToolError as e:
        raise ToolError(f"{where}: {e}") from None
    if got_kind != kind:
        raise ToolError(f"{where}: type {raw.get('type')} is a {got_kind} type, but the tool names a {kind}")
    executable = raw.get("executable", False)
    if not isinstance(executable, bool):
        raise ToolError(f"{where}: executable must be true or false, got {executable!r}")
    timeout_s = raw.get("timeout_s", 10.0)
    if not _number(timeout_s) or not 0 < timeout_s <= 3600:
        raise ToolError(f"{where}: timeout_s must be a number in (0, 3600], got {timeout_s!r}")
    rate = raw.get("rate_limit") or {}
    if not isinstance(rate, dict) or set(rate) - {"calls", "per_s"} or (rate and set(rate) != {"calls", "per_s"}):
        raise ToolError(f"{where}: rate_limit must be {{calls: N, per_s: seconds}}")
    calls, per_s = rate.get("calls", 0), rate.get("per_s", 0.0)
    if rate and (isinstance(calls, bool) or not isinstance(calls, int) or calls < 1 or not _number(per_s)
                 or per_s <= 0):
        raise ToolError(f"{where}: rate_limit needs calls >= 1 and per_s > 0, got {rate!r}")
    fields = raw.get("fields") or {}
    fixed = raw.get("fixed") or {}
    if not isinstance(fields, dict) or not isinstance(fixed, dict):
        raise ToolError(f"{where}: fields and fixed must be mappings from a field path")
    try:
        bounds = {str(p): _check_bounds(args_class, str(p), b) for p, b in fields.items()}
        for p in fixed:
            find_field(args_class, str(p))
        tool = Tool(name, desc, kind, ros_name, raw["type"], iface, args_class, executable, float(timeout_s),
                    int(calls), float(per_s), bounds, {str(p): v for p, v in fixed.items()})
        for p in tool.fixed:
            if p in tool.bounds:
                raise ToolError(f"field {p!r} is both fixed and bounded")
        _set_fixed(args_class(), tool.fixed)  # a fixed value the message cannot hold is refused here
        tool.schema = message_schema(args_class, bounds, tool.fixed)
    except ToolError as e:
        raise ToolError(f"{where}: {e}") from None
    return tool


def load_tools(path: str) -> "Toolbox":
    """The tools of a tools file (YAML: a list, or a mapping with key `tools:`); ToolError names the problem."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except OSError as e:
        raise ToolError(f"tools file {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ToolError(f"tools file {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    return Toolbox.from_list(doc.get("tools") if isinstance(doc, dict) else doc, source=path)


# ----------------------------------------------------------------------------- calls
@dataclasses.dataclass
class Call:
    """A call the model made: a tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False, sort_keys=True)


@dataclasses.dataclass
class CallPlan:
    """What a request's tools and tool_choice ask of the answer: the schema it is constrained to and the text that
    tells the model about the tools (put before the request's context)."""

    tools: list
    choice: str  # auto | required | a tool's name
    schema: dict
    prompt_text: str

    @property
    def schema_text(self) -> str:
        return json.dumps(self.schema, sort_keys=True, separators=(",", ":"))


def constrained_request(req, plan: CallPlan):
    """The request the engine answers for a plan: its answer constrained to the calls' schema, the tools described
    before the context, and exact reuse only (an approximate call is served only by tool_call_reuse, under the
    error bound and the slot guard)."""
    context = plan.prompt_text + ("\n\n" + req.context if req.context else "")
    return dataclasses.replace(req, json_schema=plan.schema_text, context=context, allow_approximate=False)


class Toolbox:
    """The node's tools by name, and the checks of requests and calls against them."""

    def __init__(self, tools: list[Tool]):
        self.tools = {t.name: t for t in tools}

    @classmethod
    def from_list(cls, raw, source: str = "tools") -> "Toolbox":
        if raw is None:
            raw = []
        if not isinstance(raw, list):
            raise ToolError(f"{source}: expected a list of tools (or a mapping with key tools:)")
        if len(raw) > MAX_TOOLS:
            raise ToolError(f"{source}: {len(raw)} tools; at most {MAX_TOOLS}")
        tools = [_tool_from(t, i) for i, t in enumerate(raw)]
        names = [t.name for t in tools]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup:
            raise ToolError(f"{source}: tool name {dup!r} is given twice")
        return cls(tools)

    def plan(self, names: list[str], choice: str) -> CallPlan | None:
        """The plan for a request's tools and tool_choice; None where the answer is plain text (no tools, or
        tool_choice none); ToolError for an unknown tool or choice."""
        choice = choice or "auto"
        if choice == "none" or (not names and choice == "auto"):
            return None
        if len(set(names)) != len(names):
            raise ToolError("tools names a tool twice")
        for n in names:
            if n not in self.tools:
                known = ", ".join(sorted(self.tools)) or "none (the node's tools parameter names no tools file)"
                raise ToolError(f"unknown tool {n!r}; the node's tools are: {known}")
        if choice not in CHOICES:
            if choice not in self.tools:
                raise ToolError(f"tool_choice {choice!r} is not auto, none, required or one of the node's tools")
            if names and choice not in names:
                raise ToolError(f"tool_choice {choice!r} is not one of the request's tools ({', '.join(names)})")
            names = [choice]
        if not names:
            raise ToolError(f"tool_choice {choice!r} needs tools: name the tools the model may call")
        tools = [self.tools[n] for n in names]
        calls = [t.call_schema() for t in tools]
        if choice == "auto":
            text = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"],
                    "additionalProperties": False}
            schema = {"anyOf": [text, *calls]}
        else:
            schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return CallPlan(tools, choice, schema, _prompt_text(tools, choice))

    def parse(self, plan: CallPlan, answer: str) -> tuple[str, list[Call]]:
        """(the text reply, the calls) of a constrained answer; ToolError if it holds no valid reply."""
        try:
            doc = json.loads(answer)
        except ValueError as e:
            raise ToolError(f"the answer is not JSON: {e}") from None
        if not isinstance(doc, dict):
            raise ToolError("the answer is not a JSON object")
        if "text" in doc and plan.choice == "auto" and set(doc) == {"text"} and isinstance(doc["text"], str):
            return doc["text"], []
        if set(doc) != {"name", "arguments"}:
            raise ToolError(f"the answer is neither a call {{name, arguments}} nor a text reply: keys {sorted(doc)}")
        call = Call(doc["name"], doc["arguments"])
        if call.name not in {t.name for t in plan.tools}:
            raise ToolError(f"the answer calls {call.name!r}, which this request does not offer")
        self.check(call)
        return "", [call]

    def check(self, call: Call) -> None:
        """ToolError unless the call names a tool of the node and its arguments are valid under the tool's schema
        and bounds (checked twice: by jsonschema, and field by field here)."""
        tool = self.tools.get(call.name) if isinstance(call.name, str) else None
        if tool is None:
            raise ToolError(f"unknown tool {str(call.name)[:64]!r}; the node's tools are: "
                            f"{', '.join(sorted(self.tools)) or 'none'}")
        if not isinstance(call.arguments, dict):
            raise ToolError(f"{tool.name}: arguments must be a JSON object")
        import jsonschema

        try:
            jsonschema.validate(call.arguments, tool.schema)
        except jsonschema.ValidationError as e:
            where = "/".join(str(p) for p in e.absolute_path) or "the arguments"
            raise ToolError(f"{tool.name}: {where}: {e.message[:200]}") from None
        _check_values(tool, tool.args_class, call.arguments, "")


def _check_values(tool: Tool, cls, args: dict, prefix: str) -> None:
    """Every value of the arguments against its field's type and bounds (the schema's check, made again here)."""
    fields = dict(_fields(cls))
    for name, v in args.items():
        path = f"{prefix}.{name}" if prefix else name
        if name not in fields:
            raise ToolError(f"{tool.name}: {path}: no such field")
        if path in tool.fixed:
            raise ToolError(f"{tool.name}: {path}: the node fills this field; a call may not set it")
        info = find_field(tool.args_class, path)
        b = tool.bounds.get(path, Bounds())
        items = v
        if info.array is not None:
            if not isinstance(v, list):
                raise ToolError(f"{tool.name}: {path}: expected an array")
            if info.array == "fixed" and len(v) != info.size:
                raise ToolError(f"{tool.name}: {path}: {len(v)} items, the array holds exactly {info.size}")
            limit = info.size if info.array == "bounded" else None
            if b.max_items is not None:
                limit = b.max_items if limit is None else min(limit, b.max_items)
            if limit is not None and len(v) > limit:
                raise ToolError(f"{tool.name}: {path}: {len(v)} items, at most {limit} allowed")
        else:
            items = [v]
        for item in items:
            if info.kind == "message":
                if not isinstance(item, dict):
                    raise ToolError(f"{tool.name}: {path}: expected an object")
                _check_values(tool, message_class(info.elem.namespaces, info.elem.name), item, path)
                continue
            err = _value_error(info, item, b)
            if err:
                raise ToolError(f"{tool.name}: {path}: {err}")


def _prompt_text(tools: list[Tool], choice: str) -> str:
    lines = ["You control a robot through tools. Answer with one JSON object."]
    if choice == "auto":
        lines.append('To call a tool: {"name": <tool>, "arguments": {...}}. To reply in words: {"text": "..."}.')
    else:
        lines.append('Call a tool: {"name": <tool>, "arguments": {...}}.')
    lines.append("Tools:")
    for t in tools:
        lines.append(f"- {t.name}: {t.description} Arguments: {json.dumps(t.schema, separators=(',', ':'))}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- messages
def _element(info: FieldInfo, v):
    if info.kind == "message":
        return _fill(message_class(info.elem.namespaces, info.elem.name)(), v)
    if info.kind == "float":
        return float(v)
    if getattr(info.elem, "typename", "") == "octet":
        return bytes([v])
    return v


def _fits(info: FieldInfo, v) -> None:
    """ToolError unless the message field can hold the value: array sizes and the type's own limits (rosidl's
    setters leave bounded sizes to serialization, where a failure would come too late)."""
    items = v
    if info.array is not None:
        if not isinstance(v, list):
            raise ToolError(f"{info.path}: expected an array")
        if info.array == "fixed" and len(v) != info.size or info.array == "bounded" and len(v) > info.size:
            raise ToolError(f"{info.path}: the message cannot hold {len(v)} items ({info.array} array of {info.size})")
    else:
        items = [v]
    for item in items:
        if info.kind != "message":
            err = _value_error(info, item, Bounds())
            if err:
                raise ToolError(f"{info.path}: the message cannot hold {json.dumps(item)[:60]}: {err}")


def _fill(msg, args: dict):
    for name, t in _fields(type(msg)):
        if name not in args:
            continue
        elem, array, size = _base(t)
        info = FieldInfo(name, elem, _kind(elem), array, size, type(msg), name)
        v = args[name]
        _fits(info, v)
        try:
            setattr(msg, name, [_element(info, x) for x in v] if array else _element(info, v))
        except (AssertionError, TypeError, ValueError) as e:
            raise ToolError(f"{name}: the message cannot hold {json.dumps(v)[:80]}: {e}".rstrip(": ")) from None
    return msg


def _get(msg, path: str):
    """The values at a dotted path of a message (a list: paths through arrays give every item's value)."""
    values = [msg]
    for part in path.split("."):
        nxt = []
        for m in values:
            v = getattr(m, part)
            if isinstance(v, (list, tuple)) or hasattr(v, "tolist") or type(v).__name__ == "array":
                nxt.extend(list(v))
            else:
                nxt.append(v)
        values = nxt
    return values


def _set_fixed(msg, fixed: dict) -> None:
    for path, v in fixed.items():
        *parents, last = path.split(".")
        target = msg
        for p in parents:
            target = getattr(target, p)
        info = find_field(type(msg), path)
        try:
            _fits(info, v)
        except ToolError as e:
            raise ToolError(f"fixed {e}") from None
        try:
            setattr(target, last, [_element(info, x) for x in v] if info.array else _element(info, v))
        except (AssertionError, TypeError, ValueError) as e:
            raise ToolError(f"fixed {path}: the message cannot hold {json.dumps(v)[:80]}: {e}".rstrip(": ")) from None


def to_message(tool: Tool, call: Call):
    """The call's arguments as the tool's Request or Goal message, fixed fields set, the bounds checked once more
    on the message's own values; ToolError names the field."""
    try:
        msg = _fill(tool.args_class(), call.arguments)
    except ToolError as e:
        raise ToolError(f"{tool.name}: {e}") from None
    _set_fixed(msg, tool.fixed)
    for path, b in tool.bounds.items():
        info = find_field(tool.args_class, path)
        if info.kind == "message":
            continue
        for v in _get(msg, path):
            if getattr(info.elem, "typename", "") == "octet" and isinstance(v, bytes):
                v = v[0]
            if hasattr(v, "item"):
                v = v.item()
            err = _value_error(info, v, Bounds(b.minimum, b.maximum, b.allowed, b.max_length))
            if err:
                raise ToolError(f"{tool.name}: {path} on the message: {err}")
        if b.max_items is not None:
            n = len(getattr(_parent(msg, path), path.split(".")[-1]))
            if n > b.max_items:
                raise ToolError(f"{tool.name}: {path} on the message: {n} items, at most {b.max_items}")
    return msg


def _parent(msg, path: str):
    for p in path.split(".")[:-1]:
        msg = getattr(msg, p)
        if isinstance(msg, (list, tuple)):  # max_items under an array of messages: checked by the schema
            return type("Empty", (), {path.split(".")[-1]: []})()
    return msg


def message_to_dict(msg) -> dict:
    """A message's fields as plain JSON values (nested messages as objects, arrays as lists)."""
    out = {}
    for name in msg.get_fields_and_field_types():
        out[name] = _plain(getattr(msg, name))
    return out


def _plain(v):
    if hasattr(v, "get_fields_and_field_types"):
        return message_to_dict(v)
    if isinstance(v, bytes):
        return list(v)
    if hasattr(v, "tolist"):
        return v.tolist()
    if isinstance(v, (list, tuple)) or type(v).__name__ == "array":
        return [_plain(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class RateLimiter:
    """At most `calls` sends of a tool per `per_s` seconds (a sliding window); thread-safe."""

    def __init__(self):
        self._sent: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self._lock = threading.Lock()

    def take(self, tool: Tool, now: float | None = None) -> str | None:
        """None and the send counted, or why the tool may not be sent now."""
        if tool.rate_calls <= 0:
            return None
        now = time.monotonic() if now is None else now
        with self._lock:
            q = self._sent[tool.name]
            while q and now - q[0] >= tool.rate_per_s:
                q.popleft()
            if len(q) >= tool.rate_calls:
                return (f"rate limit: {tool.name} was sent {len(q)} times in the last {tool.rate_per_s:g} s "
                        f"(at most {tool.rate_calls})")
            q.append(now)
            return None
