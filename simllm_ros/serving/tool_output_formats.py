"""The constrained output of a request with tools: what its answer is constrained to, how the model is told about the
tools, and the answer parsed back into its text reply and calls (Call records, whatever the format).

Why a module of its own: how a model is asked to call a tool and how its answer reads is a format, separate from
what a call may hold (tool_schemas) and from the checks a call passes before it is sent (tool_call_checks).
Two kinds of format, chosen per model from its chat template (model/tool_call_formats.detect):
- the template's own (`hermes`: Qwen2.5/Qwen3; `llama3_json`: Llama 3.x): the tools go to the chat template
  (apply_chat_template(tools=...)), and the answer is constrained (xgrammar) to a call in the template's format,
  or under tool_choice "auto" to a text reply;
- `generic`, for every other model: one JSON object, a call {"name": ..., "arguments": {...}} or under "auto"
  {"text": "..."}, the tools described in a text put before the request's context.
"""
from __future__ import annotations

import dataclasses
import json

from ..model import tool_call_formats as formats
from ..request import ToolTemplate
from .tool_call_checks import Call
from .tool_schemas import Tool, ToolError

GENERIC = formats.GENERIC


@dataclasses.dataclass
class CallPlan:
    """What a request's tools and tool_choice ask of the answer: its format, the JSON schema it is constrained to
    (generic: the whole answer; a template format: the call inside the format's frame) and, for the generic format,
    the text that tells the model about the tools (put before the request's context)."""

    tools: list
    choice: str  # auto | required | a tool's name
    schema: dict
    prompt_text: str
    format: str = GENERIC
    max_calls: int = 1  # a template format's answer may make 1..max_calls calls (the generic format: one)
    think_chars: int = 0  # > 0: the template lets the model think first; a <think> block of at most this many

    @property
    def schema_text(self) -> str:
        """The schema as the grammar reads it, keys in their order: the grammar writes an object's properties in
        the schema's order, so a call is {"name", then the arguments} and the arguments in the message's field
        order, as the prompt shows them. (Sorted keys forced "arguments" before "name" and the fields
        alphabetically: the model, wanting another key there, spelled the forced ones a letter or two a token, and
        calls ran past max_new_tokens: benchmark/results/tool_calls.md.)"""
        return json.dumps(self.schema, separators=(",", ":"))

    @property
    def text_allowed(self) -> bool:
        return self.choice == "auto"

    def template_tools(self) -> tuple:
        """The tools as chat templates take them (OpenAI's function form)."""
        return tuple({"type": "function", "function": {"name": t.name, "description": t.description,
                                                       "parameters": t.schema}} for t in self.tools)


def constrained_request(req, plan: CallPlan):
    """The request the engine answers for a plan: its answer constrained to the plan's format, the tools given to the
    chat template (or, generic, described before the context), and exact reuse only (an approximate call is served
    only by tool_call_reuse, under the error bound and the slot guard)."""
    if plan.format != GENERIC:
        return dataclasses.replace(req, json_schema=plan.schema_text, allow_approximate=False,
                                   tool_template=ToolTemplate(plan.format, plan.template_tools(), plan.text_allowed,
                                                              plan.max_calls, plan.think_chars))
    context = plan.prompt_text + ("\n\n" + req.context if req.context else "")
    return dataclasses.replace(req, json_schema=plan.schema_text, context=context, allow_approximate=False)


def make_plan(tools: list[Tool], choice: str, fmt: str = GENERIC, max_calls: int = 1,
              think_chars: int = 0) -> CallPlan:
    """The plan of checked tools and a choice (auto, required or one tool's name) in format `fmt`: the answer is a
    call of one of the tools (a template format: 1..max_calls calls, after a <think> block where think_chars > 0),
    or under auto also a text reply."""
    if fmt != GENERIC:
        spec = formats.FORMATS[fmt]
        calls = [t.call_schema(spec.args_key) for t in tools]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        # says what the grammar wraps around it: the answer's signature (memo, cache keys) differs by choice,
        # number of calls and reasoning block (one call, no block: the words of a single call's plan as before)
        schema = {"description": f"a call in the chat template's {fmt} format"
                                 f"{f' (up to {max_calls} calls)' if max_calls > 1 else ''}"
                                 f"{f', after reasoning of up to {think_chars} characters' if think_chars else ''}"
                                 f"{', or a text reply' if choice == 'auto' else ''}", **schema}
        return CallPlan(tools, choice, schema, "", fmt, max(1, max_calls), max(0, think_chars))
    calls = [t.call_schema() for t in tools]
    if choice == "auto":
        text = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"],
                "additionalProperties": False}
        schema = {"anyOf": [text, *calls]}
    else:
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return CallPlan(tools, choice, schema, _prompt_text(tools, choice))


@dataclasses.dataclass
class Parsed:
    """An answer read in its plan's format: the text reply, the calls in order (not yet checked), and the
    reasoning of a <think> block before them (reported apart, never as the answer)."""

    text: str
    calls: list[Call]
    reasoning: str = ""


def parse_answer(plan: CallPlan, answer: str) -> Parsed:
    """The text reply, calls and reasoning an answer holds, read in the plan's format; ToolError if it holds
    neither a reply nor calls. The calls are not checked here (Toolbox.parse checks them)."""
    if plan.format != GENERIC:
        try:
            reading = formats.read_answer(plan.format, answer, plan.text_allowed, plan.max_calls,
                                          plan.think_chars > 0)
        except ValueError as e:
            raise ToolError(str(e)) from None
        calls = [_one_call(plan, body) for body in reading.calls]
        return Parsed(reading.text, calls, reading.reasoning)
    return _generic(plan, answer)


def _one_call(plan: CallPlan, body: str) -> Call:
    """One call's JSON text in a template format."""
    key = formats.FORMATS[plan.format].args_key
    try:
        doc = json.loads(body)
    except ValueError as e:
        raise ToolError(f"the call is not JSON: {e}") from None
    if not isinstance(doc, dict) or set(doc) != {"name", key}:
        got = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        raise ToolError(f"the answer is not a call {{name, {key}}}: keys {got}")
    return Call(doc["name"], doc[key])


def _generic(plan: CallPlan, answer: str) -> Parsed:
    try:
        doc = json.loads(answer)
    except ValueError as e:
        raise ToolError(f"the answer is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise ToolError("the answer is not a JSON object")
    if plan.choice == "auto" and set(doc) == {"text"} and isinstance(doc["text"], str):
        return Parsed(doc["text"], [])
    if set(doc) != {"name", "arguments"}:
        raise ToolError(f"the answer is neither a call {{name, arguments}} nor a text reply: keys {sorted(doc)}")
    return Parsed("", [Call(doc["name"], doc["arguments"])])


def write_call(plan: CallPlan, call: Call) -> str:
    """A call as the model writes it in the plan's format (a served call's answer, an assistant turn)."""
    if plan.format == GENERIC:
        return json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
    return formats.write_call(plan.format, call.name, call.arguments)


def write_calls(fmt: str, calls: list[Call]) -> str:
    """An answer's calls as the model writes them in format `fmt` (the assistant's turn of a follow-up step)."""
    if fmt == GENERIC:
        docs = [{"name": c.name, "arguments": c.arguments} for c in calls]
        return json.dumps(docs[0] if len(docs) == 1 else docs, ensure_ascii=False)
    return formats.write_calls(fmt, [(c.name, c.arguments) for c in calls])


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

