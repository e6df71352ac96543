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
HERMES_SEPARATOR = "\n"  # between two <tool_call> blocks, as Qwen's templates join an assistant turn's calls
LIST_OPEN, LIST_SEPARATOR, LIST_CLOSE = "[", ", ", "]"  # Llama 3's several calls: a JSON list
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
THINK_CHARS = 2000  # the longest reasoning block the grammar allows before a call (Qwen3, SmolLM3 thinking)
RESULT_ROLES = ("tool", "ipython")  # tried in order: the first the template renders as a tool's result


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
    from transformers.utils.chat_template_utils import render_jinja_template  # deferred: transformers is slow to import

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


def _empty():
    import xgrammar as xgr  # deferred: xgrammar loads its native library

    return xgr.Grammar.from_ebnf('root ::= ""')


def _repeated(item, sep: str, lo: int, hi: int):
    """item (sep item){lo-1, hi-1}: lo..hi items, each a copy of the item's grammar (xgrammar repeats rules, not
    grammars)."""
    import xgrammar as xgr  # deferred: xgrammar loads its native library

    tail = _empty()
    for k in range(hi - lo):  # (sep item)? nested: the optional items after the required ones
        tail = xgr.Grammar.union(_empty(), xgr.Grammar.concat(_literal(sep), item, tail)) if k else \
            xgr.Grammar.union(_empty(), xgr.Grammar.concat(_literal(sep), item))
    parts = [item]
    for _ in range(lo - 1):
        parts += [_literal(sep), item]
    return xgr.Grammar.concat(*parts, tail) if hi > lo else (xgr.Grammar.concat(*parts) if len(parts) > 1 else item)


def call_starts(name: str, max_calls: int = 1) -> str:
    """The characters a call's answer starts with (a text reply may start with none of them)."""
    fmt = FORMATS[name]
    return fmt.call_starts + (LIST_OPEN if name == LLAMA3_JSON and max_calls > 1 else "")


def grammar(name: str, schema_text: str, text_allowed: bool, max_calls: int = 1, think_chars: int = 0):
    """The xgrammar Grammar of an answer in format `name`: 1..max_calls calls (JSON under schema_text, each in its
    frame: hermes blocks one after another, Llama 3's several as a JSON list), or where text_allowed a text reply
    (not starting with a call's first character or white space). think_chars > 0: a reasoning block
    <think>...</think> of at most that many characters may come first (the template lets the model think)."""
    import xgrammar as xgr  # deferred: xgrammar loads its native library

    fmt = FORMATS[name]
    call = xgr.Grammar.from_json_schema(schema_text, any_whitespace=False, strict_mode=True)
    parts = ([_literal(fmt.prefix)] if fmt.prefix else []) + [call] + ([_literal(fmt.suffix)] if fmt.suffix else [])
    one = xgr.Grammar.concat(*parts) if len(parts) > 1 else call
    if max_calls <= 1:
        out = one
    elif name == HERMES:
        out = _repeated(one, HERMES_SEPARATOR, 1, max_calls)
    else:  # one call alone, or 2..max_calls as a list
        listed = xgr.Grammar.concat(_literal(LIST_OPEN), _repeated(one, LIST_SEPARATOR, 2, max_calls),
                                    _literal(LIST_CLOSE))
        out = xgr.Grammar.union(one, listed)
    if text_allowed:
        first = "".join("\\" + c if c in "]\\^-" else c for c in call_starts(name, max_calls))
        out = xgr.Grammar.union(out, xgr.Grammar.from_ebnf(f"root ::= [^{first} \\t\\n\\r] [^]*"))
    if think_chars > 0:
        think = xgr.Grammar.from_ebnf(f'root ::= "" | "{THINK_OPEN}" [^<]{{0,{int(think_chars)}}} "{THINK_CLOSE}" '
                                      '[ \\n]{0,4}')
        out = xgr.Grammar.concat(think, out)
    return out


@dataclasses.dataclass
class Reading:
    """An answer read in a template's format: its text reply (no calls), or its calls' JSON texts in order; and
    the reasoning of a <think> block before them ("" without one)."""

    text: str
    calls: list[str]
    reasoning: str = ""


def read_answer(name: str, answer: str, text_allowed: bool, max_calls: int = 1, think: bool = False) -> Reading:
    """The text reply or the calls of an answer in format `name` (think: a leading <think> block is the
    reasoning, not the answer); ValueError where it is neither (a call cut short, more calls than max_calls, text
    after the calls, or text where a call is required)."""
    fmt = FORMATS[name]
    a = answer.strip()
    reasoning = ""
    if think and a.startswith(THINK_OPEN):
        end = a.find(THINK_CLOSE)
        if end < 0:
            raise ValueError(f"the reasoning is not closed ({THINK_CLOSE} is missing)")
        reasoning, a = a[len(THINK_OPEN):end].strip(), a[end + len(THINK_CLOSE):].strip()
    opening = fmt.prefix.strip() or fmt.call_starts
    if name == LLAMA3_JSON and max_calls > 1 and a.startswith(LIST_OPEN):
        try:
            items = json.loads(a)
        except ValueError as e:
            raise ValueError(f"the list of calls is not JSON: {e}") from None
        if not isinstance(items, list) or not items or not all(isinstance(x, dict) for x in items):
            raise ValueError("the list of calls must hold call objects")
        return Reading("", [json.dumps(x, ensure_ascii=False) for x in _at_most(items, max_calls)], reasoning)
    if not a.startswith(opening):
        if text_allowed:
            return Reading(a, [], reasoning)
        raise ValueError(f"the answer is not a call in the {name} format (it does not start with {opening!r})")
    if not fmt.prefix:
        return Reading("", [a], reasoning)
    closing = fmt.suffix.strip()
    bodies, rest = [], a
    decoder = json.JSONDecoder()
    while rest.startswith(opening):
        body = rest[len(opening):].lstrip()
        try:
            _, end = decoder.raw_decode(body)
        except ValueError:
            raise ValueError(f"the call is cut short: it does not end with {closing}") from None
        after = body[end:].lstrip()
        if not after.startswith(closing):
            raise ValueError(f"the call does not end with {closing}")
        bodies.append(body[:end])
        rest = after[len(closing):].strip()
    if rest:
        raise ValueError(f"text after the calls: {rest[:40]!r}")
    return Reading("", _at_most(bodies, max_calls), reasoning)


def _at_most(calls: list, max_calls: int) -> list:
    if len(calls) > max_calls:
        raise ValueError(f"the answer makes {len(calls)} calls; at most {max_calls} (tool_max_calls)")
    return calls


def write_call(name: str, tool: str, arguments: dict) -> str:
    """A call as the model writes it in format `name` (the grammar's separators)."""
    fmt = FORMATS[name]
    return fmt.prefix + json.dumps({"name": tool, fmt.args_key: arguments}, ensure_ascii=False) + fmt.suffix


def write_calls(name: str, calls: list[tuple[str, dict]]) -> str:
    """Calls as the model writes them in format `name`: one as write_call; several as the grammar allows them."""
    if len(calls) == 1:
        return write_call(name, *calls[0])
    if name == HERMES:
        return HERMES_SEPARATOR.join(write_call(name, t, a) for t, a in calls)
    return LIST_OPEN + LIST_SEPARATOR.join(write_call(name, t, a) for t, a in calls) + LIST_CLOSE


# ----------------------------------------------------------------------------- what else the template says
@dataclasses.dataclass(frozen=True)
class TemplateTraits:
    """What a chat template does around tools besides the call's format, read by rendering it: whether the model
    may open its answer with a <think> block, and the role a tool's result goes back in ("" : none the template
    maps: a user turn)."""

    thinks: bool = False
    result_role: str = ""
    why: str = ""


RESULT_MARK = "result_mark_7c1e"


def result_probe(role: str) -> list[dict]:
    """The conversation traits() renders to see how the template gives back a tool result in `role` (also rendered
    in the template box at load, within its budgets: model/template_box.TOOL_PROBES)."""
    call = {"role": "assistant", "content": json.dumps({"name": PROBE_NAME, "arguments": {"x": 1}})}
    return [*PROBE_CONVERSATION, call, {"role": role, "content": RESULT_MARK}]


def _render(template: str, conversation: list, tokens: dict | None) -> str | None:
    from transformers.utils.chat_template_utils import render_jinja_template  # deferred: transformers is slow to import

    try:
        return render_jinja_template(conversations=[conversation], tools=[PROBE_TOOL], chat_template=template,
                                     add_generation_prompt=True, **(tokens or {}))[0][0]
    except Exception:  # noqa: BLE001 - the template refuses this conversation: it has no such turn
        return None


def traits(template: str | None, fmt: str, tokens: dict | None = None) -> TemplateTraits:
    """The template's traits for format `fmt` (GENERIC: none; the generic format keeps its own words)."""
    if fmt == GENERIC or not isinstance(template, str) or not template:
        return TemplateTraits(why="the generic format: results go back as a user turn, no reasoning block")
    prompt = _render(template, PROBE_CONVERSATION, tokens) or ""
    closed = prompt.rstrip().endswith(THINK_CLOSE)  # the template closed an empty block: thinking is off
    thinks = THINK_OPEN in template and not closed
    said = "the model may think first (<think> in the template, not closed in the prompt)" if thinks else \
        "no reasoning block"
    as_user = _render(template, result_probe("user"), tokens)
    for role in RESULT_ROLES:
        text = _render(template, result_probe(role), tokens)
        if text is not None and RESULT_MARK in text and text != as_user:
            return TemplateTraits(thinks, role, f"{said}; tool results in the template's {role!r} role")
    return TemplateTraits(thinks, "", f"{said}; the template maps no tool role: results go back as a user turn")
