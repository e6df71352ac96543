"""Chat templates' own tool-call formats: which one a model's template speaks (read from the template, rendered with
a probe tool), the grammar of an answer in it (the call's JSON schema inside the format's frame, or a text reply),
and an answer read back into its text or its call.

Why from the template and not from the model's name: a GGUF or a fine-tune carries whatever template it was given,
and a template that never shows the tools to the model gives it no format to follow. Known formats:
- `hermes` (Qwen2.5, Qwen3, Hermes): the template lists the tools in <tools></tools> and asks for
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
- `llama3_json` (Llama 3.1/3.2/3.3): the template asks for `{"name": ..., "parameters": {...}}`.
Any other template (SmolLM2's, Gemma's, the SmolLM3 template llama.cpp ships, which drops the tools) gets the
node's generic format (serving/tool_output_formats.py).
"""
from __future__ import annotations

import dataclasses
import json

GENERIC = "generic"
HERMES = "hermes"
LLAMA3_JSON = "llama3_json"

PROBE_NAME = "probe_tool_3f9a"
PROBE_TOOL = {"type": "function", "function": {
    "name": PROBE_NAME, "description": "A probe of the chat template's tool format.",
    "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
PROBE_CONVERSATION = [{"role": "system", "content": "You are a robot."}, {"role": "user", "content": "Go."}]


@dataclasses.dataclass(frozen=True)
class TemplateFormat:
    """A chat template's tool-call format: the call's JSON ({"name", args_key}) between prefix and suffix; a text
    reply may not start with a character of `call_starts` (it would start a call) nor with white space."""

    name: str
    args_key: str
    prefix: str
    suffix: str
    call_starts: str
    description: str


FORMATS = {
    HERMES: TemplateFormat(HERMES, "arguments", "<tool_call>\n", "\n</tool_call>", "<",
                           'the chat template\'s <tool_call>{"name", "arguments"}</tool_call>'),
    LLAMA3_JSON: TemplateFormat(LLAMA3_JSON, "parameters", "", "", "{",
                                'the chat template\'s JSON {"name", "parameters"}'),
}
GENERIC_DESCRIPTION = 'the generic JSON {"name", "arguments"} or {"text"}, tools described before the context'


def describe(name: str) -> str:
    """A format's name and what the model is asked to write, for the load log."""
    fmt = FORMATS.get(name)
    return f"{name} ({fmt.description if fmt else GENERIC_DESCRIPTION})"


def detect(template: str | None, tokens: dict | None = None) -> tuple[str, str]:
    """(the format's name, why) of a chat template: rendered with a probe tool, the text it gives the model says
    which format it asks for. GENERIC where there is no template, it does not show the tool, or asks in a format
    not known here."""
    if not isinstance(template, str) or not template:
        return GENERIC, "the model has no chat template"
    # deferred: transformers takes seconds to import
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        text = render_jinja_template(conversations=[PROBE_CONVERSATION], tools=[PROBE_TOOL], chat_template=template,
                                     add_generation_prompt=True, **(tokens or {}))[0][0]
    except Exception as e:  # noqa: BLE001 - the template's own refusal of tools: it has no format to follow
        return GENERIC, f"the chat template fails when given tools ({type(e).__name__}: {str(e)[:80]})"
    if PROBE_NAME not in text:
        return GENERIC, "the chat template does not show the tools to the model"
    if "<tool_call>" in text and '"arguments"' in text:
        return HERMES, "the chat template asks for <tool_call> with name and arguments"
    if '"parameters": dictionary' in text or '"name": function name, "parameters"' in text:
        return LLAMA3_JSON, "the chat template asks for JSON with name and parameters"
    return GENERIC, "the chat template shows the tools but asks for a format not known here"


def _literal(text: str):
    import xgrammar as xgr  # deferred: xgrammar loads its native library

    return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")


def grammar(name: str, schema_text: str, text_allowed: bool):
    """The xgrammar Grammar of an answer in format `name`: the call (JSON under schema_text) in its frame, or
    where text_allowed a text reply (not starting with a call's first character or white space)."""
    import xgrammar as xgr  # deferred: xgrammar loads its native library

    fmt = FORMATS[name]
    call = xgr.Grammar.from_json_schema(schema_text, any_whitespace=False, strict_mode=True)
    parts = ([_literal(fmt.prefix)] if fmt.prefix else []) + [call] + ([_literal(fmt.suffix)] if fmt.suffix else [])
    out = xgr.Grammar.concat(*parts) if len(parts) > 1 else call
    if text_allowed:
        first = "".join("\\" + c if c in "]\\^-" else c for c in fmt.call_starts)
        out = xgr.Grammar.union(out, xgr.Grammar.from_ebnf(f"root ::= [^{first} \\t\\n\\r] [^]*"))
    return out


def read_answer(name: str, answer: str, text_allowed: bool) -> tuple[str, str | None]:
    """(the text reply, None) or ("", the call's JSON text) of an answer in format `name`; ValueError where it is
    neither (a call cut short, or text where a call is required)."""
    fmt = FORMATS[name]
    a = answer.strip()
    opening = fmt.prefix.strip() or fmt.call_starts
    if a.startswith(opening):
        body = a[len(fmt.prefix.strip()):]
        closing = fmt.suffix.strip()
        if closing:
            if not body.rstrip().endswith(closing):
                raise ValueError(f"the call does not end with {closing}")
            body = body.rstrip()[:-len(closing)]
        return "", body.strip()
    if text_allowed:
        return a, None
    raise ValueError(f"the answer is not a call in the {name} format (it does not start with {opening!r})")


def write_call(name: str, tool: str, arguments: dict) -> str:
    """A call as the model writes it in format `name` (the grammar's separators)."""
    fmt = FORMATS[name]
    return fmt.prefix + json.dumps({"name": tool, fmt.args_key: arguments}, ensure_ascii=False) + fmt.suffix
