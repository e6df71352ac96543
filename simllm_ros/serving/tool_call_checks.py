"""Call validation: a call the model made, checked against its tool's schema and bounds, turned into the tool's ROS
message with the bounds checked once more on the message's own values, and the rate limit of sends.

Why apart from the schemas and the answer formats: whatever format the model answered in (the generic JSON or its
chat template's own), a call is the same record here, and nothing is sent that did not pass every check in this
module; the ROS layer (ros/tool_executor.py) only sends what passed.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import math
import threading
import time

from .tool_schemas import (Bounds, FieldInfo, Tool, ToolError, element_of, find_field, kind_of, message_class,
                           message_fields, value_error)


@dataclasses.dataclass
class Call:
    """A call the model made: a tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False, sort_keys=True)


def check_arguments(tool: Tool, call: Call) -> None:
    """ToolError unless the call's arguments are valid under the tool's schema and bounds (checked twice: by
    jsonschema, and field by field here)."""
    if not isinstance(call.arguments, dict):
        raise ToolError(f"{tool.name}: arguments must be a JSON object")
    # local: jsonschema is slow to import (~0.1 s, 120 modules): a call's check only
    import jsonschema

    try:
        jsonschema.validate(call.arguments, tool.schema)
    except jsonschema.ValidationError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "the arguments"
        raise ToolError(f"{tool.name}: {where}: {e.message[:200]}") from None
    _check_values(tool, tool.args_class, call.arguments, "")


def _check_values(tool: Tool, cls, args: dict, prefix: str) -> None:
    """Every value of the arguments against its field's type and bounds (the schema's check, made again here)."""
    fields = dict(message_fields(cls))
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
            err = value_error(info, item, b)
            if err:
                raise ToolError(f"{tool.name}: {path}: {err}")



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
        if info.array == "fixed" and len(v) != info.size or info.array == "bounded" and info.size is not None \
                and len(v) > info.size:
            raise ToolError(f"{info.path}: the message cannot hold {len(v)} items ({info.array} array of {info.size})")
    else:
        items = [v]
    for item in items:
        if info.kind != "message":
            err = value_error(info, item, Bounds())
            if err:
                raise ToolError(f"{info.path}: the message cannot hold {json.dumps(item)[:60]}: {err}")


def _fill(msg, args: dict):
    for name, t in message_fields(type(msg)):
        if name not in args:
            continue
        elem, array, size = element_of(t)
        info = FieldInfo(name, elem, kind_of(elem), array, size, type(msg), name)
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


def set_fixed(msg, fixed: dict) -> None:
    """The node's fixed values (path -> value) set on a message; ToolError where the message cannot hold one."""
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
    set_fixed(msg, tool.fixed)
    for path, b in tool.bounds.items():
        info = find_field(tool.args_class, path)
        if info.kind == "message":
            continue
        for v in _get(msg, path):
            if getattr(info.elem, "typename", "") == "octet" and isinstance(v, bytes):
                v = v[0]
            if hasattr(v, "item"):
                v = v.item()
            err = value_error(info, v, Bounds(b.minimum, b.maximum, b.allowed, b.max_length))
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

    def __init__(self) -> None:
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
