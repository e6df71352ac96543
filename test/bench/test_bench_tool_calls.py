"""simllm-bench tool_calls: its workload (deterministic, traps that change a slot) and a smoke run on the shared
embedded engine (no cache, the cache at δ 0, llama.cpp's grammar side where llama-cpp-python is there; the δ
configurations run the same code as δ 0, and test_tool_call_reuse covers their decisions)."""
from __future__ import annotations

import collections
import importlib.util
import re

import pytest

from core_fixtures import fresh, shared_engine
from simllm_ros.bench import tool_calls as tb


def test_workload_is_deterministic_with_paraphrases_repeats_and_slot_swap_traps():
    w = tb.workload(300, seed=11)
    assert w == tb.workload(300, seed=11) and w != tb.workload(300, seed=12)
    kinds = collections.Counter(c.kind for c in w)
    assert len(w) == 300 and len({c.intent for c in w}) == len(tb.INTENTS) >= 20
    assert kinds["paraphrase"] >= 50 and kinds["trap"] >= 20 and kinds["repeat"] >= 50
    traps = {c.text for c in w if c.kind == "trap"}
    own = [c for c in w if c.kind in ("first", "paraphrase")]
    assert not traps & {c.text for c in own}  # a trap is no other filling's command (a repeat may repeat a trap)
    slot = re.compile(r"\b(dock|kitchen|door|\d+(\.\d+)?)\b")
    for trap in traps:  # the same phrasing of one of its intent's commands, a slot value changed
        assert any(slot.sub("#", c.text) == slot.sub("#", trap) for c in own), trap


def test_smoke_on_the_embedded_model(tmp_path):
    pytest.importorskip("std_srvs.srv")  # the bench's tools are ROS interface types
    e = fresh(shared_engine())
    stream = [tb.Command("Stop all motors now.", "stop", "first"),
              tb.Command("Stop all motors now.", "stop", "repeat"),
              tb.Command("Halt the motors immediately.", "stop", "paraphrase")]
    from simllm_ros.model.model_files import gguf_source

    gguf = gguf_source(e.settings.model) if importlib.util.find_spec("llama_cpp") else None
    ref = str(tmp_path / "reference.json")
    report = tb.bench(e, stream, [], gguf, threads=1, max_new=32, log=lambda s: None,
                      tools=["set_brake", "stop_motors"], reference_file=ref)  # short calls: within 32 tokens
    rows = {r["config"]: r for r in report["rows"]}
    fresh(e)
    nocache, exact = rows["no cache"], rows["cache, exact (δ 0)"]
    assert nocache["commands"] == exact["commands"] == 3
    assert exact["equal_to_no_cache"] == 3 and exact["approximate"] == 0 and exact["memo"] >= 1
    assert exact["valid"] == nocache["valid"] == 3
    if gguf:
        assert rows["llama.cpp + LlamaGrammar"]["commands"] == 3
    text = "\n".join(tb.markdown(dict(report, model="embedded")))
    assert "| cache, exact (δ 0) | " in text
    # the no-cache rows are kept by text and read back, not computed again, by a later run of the same plan
    from simllm_ros.serving.toolbox import Toolbox
    toolbox = Toolbox.from_list(tb.TOOLS)
    plan = toolbox.plan(["set_brake", "stop_motors"], "required")
    said = []
    again = tb._reference_rows(e, toolbox, plan, [c.text for c in stream[::2]], 32, said.append, ref)
    assert said == [f"  no-cache rows of 2 texts read from {ref}"]
    assert all(isinstance(r["call"], tuple) and r["call"][0] in ("set_brake", "stop_motors") for r in again.values())


def test_llama_only_resumes_after_the_rows_it_kept(tmp_path):
    """--llama-only writes llama.cpp's rows by text; a later run on the same path, file, tools and max_new computes
    only the texts still missing (a stopped full-size run goes on), and other tools start again."""
    pytest.importorskip("std_srvs.srv")  # the bench's tools are ROS interface types
    import json

    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (requirements-bench.txt)")
    from simllm_ros.model.model_files import gguf_source

    e = shared_engine()
    gguf = gguf_source(e.settings.model)
    stream = [tb.Command("Stop all motors now.", "stop", "first"),
              tb.Command("Engage the parking brake.", "brake", "first")]
    path, said = str(tmp_path / "llama.json"), []
    tools = ["set_brake", "stop_motors"]
    tb.llama_only(e, stream[:1], gguf, 1, path, max_new=32, tools=tools, log=said.append)
    first = json.load(open(path))
    assert list(first["rows"]) == ["Stop all motors now."] and not any("resuming" in s for s in said)
    said.clear()
    tb.llama_only(e, stream, gguf, 1, path, max_new=32, tools=tools, log=said.append)
    both = json.load(open(path))
    assert said[0].endswith(f"resuming after the 1 texts kept in {path}")
    assert list(both["rows"]) == ["Stop all motors now.", "Engage the parking brake."]
    assert both["rows"]["Stop all motors now."] == first["rows"]["Stop all motors now."], "kept, not computed again"
    said.clear()
    tb.llama_only(e, stream[:1], gguf, 1, path, max_new=32, tools=["stop_motors"], log=said.append)
    assert not any("resuming" in s for s in said) and list(json.load(open(path))["rows"]) == ["Stop all motors now."]
