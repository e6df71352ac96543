"""Chat templates' own tool-call formats (model/tool_call_formats.py, serving/tool_output_formats.py): the format read
from real templates (test/chat_templates/: Qwen2.5, Qwen3, Llama 3.2, SmolLM3 and Qwen3-Coder as llama.cpp ships
them; the embedded SmolLM2's own), the grammar around the call, answers read back into the same Call records, and
the embedded model answering through Qwen2.5's template (ChatML, as SmolLM2's own)."""
from __future__ import annotations

import json
import os

import pytest
import xgrammar as xgr

from conftest import REPO
from core_fixtures import fresh, shared_engine
from simllm_ros.model import tool_call_formats as formats
from simllm_ros.request import QueryRequest
from simllm_ros.serving.tool_call_checks import Call
from simllm_ros.serving.tool_output_formats import constrained_request, parse_answer, write_call, write_calls
from simllm_ros.serving.tool_schemas import ToolError
from simllm_ros.serving.toolbox import Toolbox

TEMPLATES = os.path.join(REPO, "test", "chat_templates")
TOKENS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
TOOLS = [
    {"name": "set_brake", "description": "Engage (true) or release (false) the parking brake.",
     "service": "/set_brake", "type": "std_srvs/srv/SetBool"},
    {"name": "navigate_to", "description": "Drive the robot to a named place at a speed.",
     "action": "/navigate_to", "type": "simllm_ros/action/NavigateTo",
     "fields": {"speed": {"minimum": 0.1, "maximum": 1.0}},
     "fixed": {"target": [0.0, 0.0], "avoid_zones": [], "note": ""}},
]


def template(name: str) -> str:
    with open(os.path.join(TEMPLATES, name + ".jinja"), encoding="utf-8") as f:
        return f.read()


@pytest.fixture(scope="module")
def toolbox():
    pytest.importorskip("std_srvs.srv")
    return Toolbox.from_list(TOOLS)


@pytest.mark.parametrize("name, expected", [
    ("Qwen-Qwen2.5-7B-Instruct", formats.HERMES),
    ("Qwen-Qwen3-0.6B", formats.HERMES),
    ("meta-llama-Llama-3.2-3B-Instruct", formats.LLAMA3_JSON),
    ("HuggingFaceTB-SmolLM3-3B", formats.GENERIC),  # llama.cpp's copy (Unsloth's edit) drops the tools
    ("HuggingFaceTB-SmolLM3-3B-hf", formats.GENERIC),  # HF's own: tools only under xml_tools, never `tools`
    ("Qwen3-Coder", formats.GENERIC),  # <function=...> XML: a format not known here
])
def test_the_format_is_read_from_the_template(name, expected):
    got, why = formats.detect(template(name), TOKENS)
    assert got == expected, why


def test_templates_without_tools_get_the_generic_format():
    assert formats.detect(None)[0] == formats.GENERIC
    assert formats.detect("{{ messages[0]['content'] }}")[0] == formats.GENERIC  # never shows the tools
    backend = shared_engine().backend
    fmt, why = backend.tool_format  # the embedded SmolLM2: its template has no tools
    assert fmt == formats.GENERIC and "does not show" in why, why


@pytest.mark.parametrize("fmt", [formats.HERMES, formats.LLAMA3_JSON])
def test_grammar_takes_a_call_in_the_format_or_text_under_auto_only(toolbox, fmt):
    accepts = xgr.testing._is_grammar_accept_string
    spec = formats.FORMATS[fmt]
    for choice in ("auto", "required", "set_brake"):
        plan = toolbox.plan(["set_brake", "navigate_to"] if choice != "set_brake" else [], choice, fmt)
        g = formats.grammar(fmt, plan.schema_text, plan.text_allowed)
        call = write_call(plan, Call("set_brake", {"data": True}))
        assert call.startswith(spec.prefix) and f'"{spec.args_key}": {{"data": true}}' in call
        assert accepts(g, call)
        assert not accepts(g, call.replace("true", "1"))  # the schema inside the frame
        assert not accepts(g, call.replace("set_brake", "set_brakes"))
        assert accepts(g, "The brake is on.") == (choice == "auto")
        assert not accepts(g, " The brake is on.")  # no leading white space: the answer reads back as it was
        assert not accepts(g, spec.call_starts + "oops")  # a text reply cannot start a call
    plan = toolbox.plan(["navigate_to"], "navigate_to", fmt)
    g = formats.grammar(fmt, plan.schema_text, False)
    nav = write_call(plan, Call("navigate_to", {"place": "dock", "speed": 0.5}))
    assert accepts(g, nav)
    assert not accepts(g, nav.replace('"dock"', '"garage"'))  # the PLACE_* enum


def test_answers_read_back_into_the_same_calls(toolbox):
    for fmt in (formats.HERMES, formats.LLAMA3_JSON, formats.GENERIC):
        plan = toolbox.plan(["set_brake", "navigate_to"], "auto", fmt)
        call = Call("navigate_to", {"place": "kitchen", "speed": 0.25})
        text, calls = toolbox.parse(plan, write_call(plan, call))
        assert text == "" and calls == [call], fmt
        if fmt != formats.GENERIC:
            assert toolbox.parse(plan, "Which dock?") == ("Which dock?", [])
    hermes = toolbox.plan(["set_brake"], "required", formats.HERMES)
    with pytest.raises(ToolError, match="does not end with </tool_call>"):
        parse_answer(hermes, '<tool_call>\n{"name": "set_brake", "arguments": {"data": tr')
    with pytest.raises(ToolError, match="not a call in the hermes format"):
        parse_answer(hermes, "Sure.")
    with pytest.raises(ToolError, match="maximum"):  # parsed, then checked against the bounds
        toolbox.parse(toolbox.plan(["navigate_to"], "required", formats.LLAMA3_JSON),
                      '{"name": "navigate_to", "parameters": {"place": "dock", "speed": 3.0}}')
    llama = toolbox.plan(["set_brake"], "required", formats.LLAMA3_JSON)
    with pytest.raises(ToolError, match="parameters"):  # Llama's key, not the generic one
        parse_answer(llama, '{"name": "set_brake", "arguments": {"data": true}}')


def test_the_request_carries_the_tools_to_the_template_and_the_choice_in_its_signature(toolbox):
    req = QueryRequest(prompt="engage the brake", context="the robot is parked")
    auto = constrained_request(req, toolbox.plan(["set_brake"], "auto", formats.HERMES))
    required = constrained_request(req, toolbox.plan(["set_brake"], "required", formats.HERMES))
    assert auto.context == req.context  # the template shows the tools; nothing is put before the context
    assert auto.tool_template.tools[0]["function"]["name"] == "set_brake"
    assert auto.tool_template.tools[0]["function"]["parameters"] == toolbox.tools["set_brake"].schema
    assert (auto.tool_template.text_allowed, required.tool_template.text_allowed) == (True, False)
    assert auto.json_schema != required.json_schema  # memo and cache keys tell auto from required
    assert not auto.allow_approximate
    generic = constrained_request(req, toolbox.plan(["set_brake"], "auto"))
    assert generic.tool_template is None and generic.context.endswith(req.context)


@pytest.mark.parametrize("name", ["Qwen-Qwen2.5-7B-Instruct", "meta-llama-Llama-3.2-3B-Instruct"])
def test_the_embedded_model_answers_in_the_template_s_format(toolbox, name):
    """SmolLM2 with another model's real template (the prompt as that template renders it, with the tools): the
    answer is a call in that template's format, read back into a valid Call."""
    e = shared_engine()
    tok = e.backend.tokenizer
    own = tok.chat_template
    try:
        tok.chat_template = template(name)
        e.backend.chat.template_changed()
        fmt, why = e.backend.tool_format
        assert fmt == formats.detect(template(name), TOKENS)[0], why
        fresh(e)
        plan = toolbox.plan(["set_brake"], "set_brake", fmt)
        req = constrained_request(QueryRequest(prompt="Engage the parking brake.", max_new_tokens=40), plan)
        ids = e.backend.chat_ids("", "", req.turns(), tools=req.tool_template.tools)
        assert "set_brake" in tok.decode(ids)  # the template showed the tool
        res = e.handle(req)
        assert res.success, res.error
        text, calls = toolbox.parse(plan, res.answer)
        assert text == "" and [c.name for c in calls] == ["set_brake"], res.answer
        assert isinstance(calls[0].arguments["data"], bool)
        assert res.answer.startswith(formats.FORMATS[fmt].prefix.strip() or "{"), res.answer
        json.loads(formats.read_answer(fmt, res.answer, False).calls[0])
    finally:
        tok.chat_template = own
        e.backend.chat.template_changed()
        fresh(e)


def test_generic_calls_name_the_tool_first_and_keep_the_message_s_field_order(toolbox):
    """The grammar writes properties in the schema's order: name first, then the arguments in the message's field
    order (as the prompt shows them). Sorted keys (arguments first, fields alphabetically) made the embedded model
    spell the forced keys a letter or two a token, and this command's call ran past 48 tokens (52)."""
    accepts = xgr.testing._is_grammar_accept_string
    from simllm_ros.bench import tool_calls as tb

    bench_tools = Toolbox.from_list(tb.TOOLS)
    plan = bench_tools.plan(["navigate_to", "set_brake", "set_lights"], "required")
    g = xgr.Grammar.from_json_schema(plan.schema_text, any_whitespace=False, strict_mode=True)
    assert accepts(g, '{"name": "navigate_to", "arguments": {"place": "dock", "speed": 2.0, "avoid_zones": [1]}}')
    assert not accepts(g, '{"arguments": {"avoid_zones": [1], "place": "dock", "speed": 2.0}, "name": "navigate_to"}')
    e = fresh(shared_engine())
    res = e.handle(constrained_request(QueryRequest(prompt="Disengage the brake please.", cache_scope="robot",
                                                    max_new_tokens=48), plan))
    assert res.success, (res.error, res.answer)
    assert bench_tools.parse(plan, res.answer)[1], res.answer


def test_several_calls_are_allowed_up_to_max_calls_and_read_back_in_order(toolbox):
    accepts = xgr.testing._is_grammar_accept_string
    brake, nav = Call("set_brake", {"data": True}), Call("navigate_to", {"place": "dock", "speed": 0.5})
    for fmt in (formats.HERMES, formats.LLAMA3_JSON):
        one = toolbox.plan(["set_brake", "navigate_to"], "required", fmt)
        plan = toolbox.plan(["set_brake", "navigate_to"], "required", fmt, max_calls=3)
        assert one.schema_text != plan.schema_text  # the answer's signature says how many calls it may make
        g = formats.grammar(fmt, plan.schema_text, False, 3)
        for calls in ([brake], [brake, nav], [nav, brake, nav]):
            answer = write_calls(fmt, calls)
            assert accepts(g, answer), answer
            assert toolbox.parse(plan, answer) == ("", calls)  # in order
        assert not accepts(g, write_calls(fmt, [brake, nav, brake, nav]))  # four: more than max_calls
        with pytest.raises(ToolError, match="at most 3"):
            parse_answer(plan, write_calls(fmt, [brake, nav, brake, nav]))
        assert not accepts(formats.grammar(fmt, one.schema_text, False), write_calls(fmt, [brake, nav]))
        bad = Call("navigate_to", {"place": "dock", "speed": 3.0})  # out of bounds: the whole answer is refused
        with pytest.raises(ToolError, match="maximum"):
            toolbox.parse(plan, write_calls(fmt, [brake, bad]))
    hermes = toolbox.plan(["set_brake"], "required", formats.HERMES, max_calls=3)
    with pytest.raises(ToolError, match="text after the calls"):
        parse_answer(hermes, write_calls(formats.HERMES, [brake]) + " done")
    assert formats.write_call(formats.HERMES, "set_brake", {"data": True}) == write_call(hermes, brake)


def test_a_think_block_before_the_call_is_reasoning_not_the_answer(toolbox):
    """Qwen3's template leaves the prompt's <think> open (thinking on by default): the grammar allows a bounded
    block before the call, the parse reports it as reasoning. Qwen2.5's and Llama's templates never think."""
    accepts = xgr.testing._is_grammar_accept_string
    qwen3 = formats.traits(template("Qwen-Qwen3-0.6B"), formats.HERMES, TOKENS)
    assert qwen3.thinks, qwen3.why
    for name, fmt in (("Qwen-Qwen2.5-7B-Instruct", formats.HERMES),
                      ("meta-llama-Llama-3.2-3B-Instruct", formats.LLAMA3_JSON)):
        assert not formats.traits(template(name), fmt, TOKENS).thinks, name
    plan = toolbox.plan(["set_brake"], "auto", formats.HERMES, max_calls=2, think_chars=200)
    g = formats.grammar(formats.HERMES, plan.schema_text, True, 2, 200)
    call = write_call(plan, Call("set_brake", {"data": True}))
    answer = "<think>\nThe user wants the brake on.\n</think>\n\n" + call
    assert accepts(g, answer) and accepts(g, call) and accepts(g, "<think>\nhm\n</think>\n\nThe brake is on.")
    assert not accepts(g, "<think>" + "x" * 201 + "</think>\n\n" + call)  # bounded
    parsed = toolbox.read(plan, answer)
    assert parsed.reasoning == "The user wants the brake on." and parsed.calls == [Call("set_brake", {"data": True})]
    assert parsed.text == ""
    text = toolbox.read(plan, "<think>\nhm\n</think>\n\nThe brake is on.")
    assert (text.text, text.reasoning, text.calls) == ("The brake is on.", "hm", [])
    with pytest.raises(ToolError, match="not closed"):
        toolbox.read(plan, "<think>\nhm " + call)
    no_think = toolbox.plan(["set_brake"], "required", formats.HERMES)
    with pytest.raises(ToolError):  # a plan without the block does not strip one
        parse_answer(no_think, answer)


@pytest.mark.parametrize("name, fmt, role, shown", [
    # Llama's template writes a string result with tojson (quoted), as it does for every server passing strings
    ("meta-llama-Llama-3.2-3B-Instruct", formats.LLAMA3_JSON, "tool",
     "<|start_header_id|>ipython<|end_header_id|>\n\n" + '"{\\"ok\\": true}"'),
    ("Qwen-Qwen2.5-7B-Instruct", formats.HERMES, "tool", '<tool_response>\n{"ok": true}\n</tool_response>'),
    ("Qwen-Qwen3-0.6B", formats.HERMES, "tool", '<tool_response>\n{"ok": true}\n</tool_response>'),
])
def test_the_tool_result_role_is_read_from_the_template(name, fmt, role, shown):
    from transformers.utils.chat_template_utils import render_jinja_template

    got = formats.traits(template(name), fmt, TOKENS)
    assert got.result_role == role, got.why
    conv = [{"role": "user", "content": "Brake."}, {"role": "assistant", "content": "call"},
            {"role": got.result_role, "content": '{"ok": true}'}]
    text = render_jinja_template(conversations=[conv], chat_template=template(name), add_generation_prompt=True,
                                 **TOKENS)[0][0]
    assert shown in text  # Llama 3's ipython header, Qwen's <tool_response> in a user turn
    assert formats.traits(template(name), formats.GENERIC).result_role == ""  # the generic format: a user turn
    smol = formats.traits(template("HuggingFaceTB-SmolLM3-3B-hf"), formats.HERMES, TOKENS)
    assert smol.result_role == "" and smol.thinks, smol.why  # its "tool" turn is a plain user turn; thinks by default


def test_only_the_node_s_tool_result_turns_may_take_a_tool_role():
    from simllm_ros.request import ChatTurn, ToolResultTurn
    from simllm_ros.validation import validate_messages

    base = [ChatTurn("user", "Brake."), ChatTurn("assistant", "call")]
    assert validate_messages(QueryRequest(prompt="", messages=[*base, ToolResultTurn("ipython", "{}")])) is None
    assert validate_messages(QueryRequest(prompt="", messages=[*base, ToolResultTurn("tool", "{}")])) is None
    forged = validate_messages(QueryRequest(prompt="", messages=[*base, ChatTurn("tool", "{}")]))
    assert forged and "is not one of system, user, assistant" in forged
    assert "last turn must be the user's" in validate_messages(QueryRequest(prompt="", messages=base))


def test_the_embedded_model_makes_calls_under_max_calls_and_its_tool_results_render_in_the_template_s_role(toolbox):
    """SmolLM2 with Llama 3.2's template: the grammar of up to 4 calls compiles for the real tokenizer and the
    answer reads back into valid calls; a follow-up's results render as Llama's ipython turn."""
    from simllm_ros.request import ChatTurn, ToolResultTurn

    e = shared_engine()
    tok = e.backend.tokenizer
    own = tok.chat_template
    name = "meta-llama-Llama-3.2-3B-Instruct"
    try:
        tok.chat_template = template(name)
        e.backend.chat.template_changed()
        fmt = e.backend.tool_format[0]
        traits = e.backend.tool_traits
        assert (fmt, traits.result_role, traits.thinks) == (formats.LLAMA3_JSON, "tool", False), traits.why
        fresh(e)
        plan = toolbox.plan(["set_brake"], "required", fmt, max_calls=4)
        req = constrained_request(QueryRequest(prompt="Engage the parking brake.", max_new_tokens=40), plan)
        res = e.handle(req)
        assert res.success, res.error
        text, calls = toolbox.parse(plan, res.answer)
        assert text == "" and 1 <= len(calls) <= 4 and {c.name for c in calls} == {"set_brake"}, res.answer
        turns = [ChatTurn("user", "Engage the parking brake."), ChatTurn("assistant", res.answer),
                 ToolResultTurn(traits.result_role, '{"success": true}')]
        ids = e.backend.chat_ids("", "", turns, tools=req.tool_template.tools)
        assert '<|start_header_id|>ipython<|end_header_id|>\n\n"{\\"success\\": true}"' in tok.decode(ids)
    finally:
        tok.chat_template = own
        e.backend.chat.template_changed()
        fresh(e)
