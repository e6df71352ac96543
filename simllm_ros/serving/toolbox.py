"""The node's tools: the tools file read and checked (each tool's ROS type, bounds, fixed fields, rate limit,
executable), and the checks of a request's tools and tool_choice, and of the calls its answer holds, against them.

Why here and without rclpy: a tools file is refused at configure with the reason, before anything runs; the schemas
come from tool_schemas, the answer's format from tool_output_formats, the checks of a call from tool_call_checks.

A tools file (YAML, the node's `tools` parameter) lists each tool: name, description, `service:` or `action:` (its
ROS name), `type:` (pkg/srv/Name or pkg/action/Name), `executable:` (false unless set), `timeout_s`, `rate_limit`
({calls, per_s}), `fields:` (bounds per field path) and `fixed:` (field path -> value the node fills; left out of
the schema, e.g. header.frame_id).
"""
from __future__ import annotations

import re

import yaml

from .tool_call_checks import Call, check_arguments, set_fixed
from .tool_output_formats import GENERIC, CallPlan, Parsed, make_plan, parse_answer
from .tool_schemas import Tool, ToolError, check_bounds, find_field, interface, is_number, message_schema

CHOICES = ("auto", "none", "required")
MAX_TOOLS = 64
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_ROS_NAME_RE = re.compile(r"/?[A-Za-z_~][A-Za-z0-9_/]*")
_TOOL_KEYS = {"name", "description", "service", "action", "type", "executable", "timeout_s", "rate_limit", "fields",
              "fixed"}


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
    if not is_number(timeout_s) or not 0 < timeout_s <= 3600:
        raise ToolError(f"{where}: timeout_s must be a number in (0, 3600], got {timeout_s!r}")
    rate = raw.get("rate_limit") or {}
    if not isinstance(rate, dict) or set(rate) - {"calls", "per_s"} or (rate and set(rate) != {"calls", "per_s"}):
        raise ToolError(f"{where}: rate_limit must be {{calls: N, per_s: seconds}}")
    calls, per_s = rate.get("calls", 0), rate.get("per_s", 0.0)
    if rate and (isinstance(calls, bool) or not isinstance(calls, int) or calls < 1 or not is_number(per_s)
                 or per_s <= 0):
        raise ToolError(f"{where}: rate_limit needs calls >= 1 and per_s > 0, got {rate!r}")
    fields = raw.get("fields") or {}
    fixed = raw.get("fixed") or {}
    if not isinstance(fields, dict) or not isinstance(fixed, dict):
        raise ToolError(f"{where}: fields and fixed must be mappings from a field path")
    try:
        bounds = {str(p): check_bounds(args_class, str(p), b) for p, b in fields.items()}
        for p in fixed:
            find_field(args_class, str(p))
        tool = Tool(name, desc, kind, ros_name, raw["type"], iface, args_class, executable, float(timeout_s),
                    int(calls), float(per_s), bounds, {str(p): v for p, v in fixed.items()})
        for p in tool.fixed:
            if p in tool.bounds:
                raise ToolError(f"field {p!r} is both fixed and bounded")
        set_fixed(args_class(), tool.fixed)  # a fixed value the message cannot hold is refused here
        tool.schema = message_schema(args_class, bounds, tool.fixed)
    except ToolError as e:
        raise ToolError(f"{where}: {e}") from None
    return tool


def load_tools(path: str) -> "Toolbox":
    """The tools of a tools file (YAML: a list, or a mapping with key `tools:`); ToolError names the problem."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except OSError as e:
        raise ToolError(f"tools file {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ToolError(f"tools file {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    return Toolbox.from_list(doc.get("tools") if isinstance(doc, dict) else doc, source=path)



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

    def plan(self, names: list[str], choice: str, fmt: str = GENERIC, max_calls: int = 1,
             think_chars: int = 0) -> CallPlan | None:
        """The plan for a request's tools and tool_choice in answer format `fmt` (the model's: tool_output_formats);
        None where the answer is plain text (no tools, or tool_choice none); ToolError for an unknown tool or
        choice. max_calls, think_chars: a template format's answer (tool_output_formats.make_plan)."""
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
        return make_plan([self.tools[n] for n in names], choice, fmt, max_calls, think_chars)

    def parse(self, plan: CallPlan, answer: str) -> tuple[str, list[Call]]:
        """(the text reply, the calls) of a constrained answer; ToolError if it holds no valid reply or any of its
        calls is invalid."""
        parsed = self.read(plan, answer)
        for call in parsed.calls:
            self.check_offered(plan, call)
        return parsed.text, parsed.calls

    def read(self, plan: CallPlan, answer: str) -> Parsed:
        """The answer read in the plan's format (text, calls in order, reasoning), the calls not yet checked;
        ToolError if it is neither a reply nor calls."""
        return parse_answer(plan, answer)

    def check_offered(self, plan: CallPlan, call: Call) -> None:
        """ToolError unless the call names a tool the request offers and is valid under its schema and bounds."""
        if call.name not in {t.name for t in plan.tools}:
            raise ToolError(f"the answer calls {str(call.name)[:64]!r}, which this request does not offer")
        self.check(call)

    def check(self, call: Call) -> None:
        """ToolError unless the call names a tool of the node and its arguments are valid under the tool's schema
        and bounds (checked twice: by jsonschema, and field by field here)."""
        tool = self.tools.get(call.name) if isinstance(call.name, str) else None
        if tool is None:
            raise ToolError(f"unknown tool {str(call.name)[:64]!r}; the node's tools are: "
                            f"{', '.join(sorted(self.tools)) or 'none'}")
        check_arguments(tool, call)
