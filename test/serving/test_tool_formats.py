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
from simllm_ros.serving.tool_output_formats import constrained_request, parse_answer, write_call
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
        json.loads(formats.read_answer(fmt, res.answer, False)[1])
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
