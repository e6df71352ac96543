"""Settings: a written-out frozen dataclass, one typed field per parameter, validated once when made; the parameter
table (SPECS), the ROS descriptors, docs/settings.md and config/edge.yaml agree with its fields."""
import dataclasses
import json
import os
import subprocess
import sys
import typing

import pytest
import yaml

from conftest import EDGE_YAML, REPO
from simllm_ros import settings_doc
from simllm_ros.settings import SPEC_BY_NAME, SPECS, SettingError, Settings


def test_one_typed_field_per_spec_with_its_default():
    fields = {f.name: f for f in dataclasses.fields(Settings)}
    assert list(fields) == [spec.name for spec in SPECS]
    s = Settings()
    for spec in SPECS:
        assert fields[spec.name].type is spec.type
        assert getattr(s, spec.name) == spec.default


def test_frozen_and_changed_only_through_replace():
    s = Settings.from_overrides(lfu_weight=0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.lfu_weight = 0.6
    t = s.replace(cache_threshold=0.85, queue_limit=3)
    assert (s.cache_threshold, t.cache_threshold, t.lfu_weight) == (0.8, 0.85, 0.5)
    assert t.changed_from(s) == {"cache_threshold", "queue_limit"} and s.changed_from(s) == set()
    assert t.as_dict()["queue_limit"] == 3


@pytest.mark.parametrize("kw, reason", [
    (dict(cache_threshold=1.5), "cache_threshold must be <= 1.0, got 1.5"),
    (dict(queue_limit=2.5), "queue_limit must be an integer, got 2.5"),
    (dict(enable_answer_cache=1), "enable_answer_cache must be a bool, got 1"),
    (dict(kv_bits=4), "kv_bits must be one of [0, 8, 16, 32], got 4"),
    (dict(cache_size="5 XB"), "cache_size '5 XB': expected bytes, e.g. '512MB', '5GB' or '30%'"),
    (dict(thermal_warn_c=95.0), "thermal_critical_c must be above thermal_warn_c"),
    (dict(answer_threshold=0.5), "answer_threshold must be at least cache_threshold (ANSWER is the stricter tier)"),
    (dict(max_new_tokens=600), "max_new_tokens must not exceed max_new_tokens_limit"),
    (dict(no_such_thing=1), "unknown parameter 'no_such_thing'"),
])
def test_invalid_values_are_refused_when_made(kw, reason):
    with pytest.raises(SettingError) as e:
        Settings.from_overrides(**kw)
    assert str(e.value) == reason
    with pytest.raises(SettingError):
        Settings().replace(**kw)
    if "no_such_thing" not in kw:
        with pytest.raises(SettingError):  # even built directly, a Settings is never invalid
            Settings(**kw)


def test_an_int_for_a_float_parameter_becomes_a_float():
    s = Settings.from_overrides(recency_half_life_s=900)
    assert isinstance(s.recency_half_life_s, float) and s.recency_half_life_s == 900.0


def test_the_fields_are_written_out_with_their_type_and_metadata():
    # a class a type checker reads: the annotations are in the class body, not made at run time
    hints = typing.get_type_hints(Settings)
    assert Settings.__module__ == "simllm_ros.settings" and "cache_threshold" in Settings.__dict__["__annotations__"]
    for f in dataclasses.fields(Settings):
        spec, m = SPEC_BY_NAME[f.name], f.metadata
        assert hints[f.name] is f.type is spec.type is type(f.default) and spec.default == f.default
        assert (m["live"], m["min"], m["max"], m["choices"], m["description"]) == (
            spec.live, spec.min, spec.max, spec.choices, spec.description)
        assert m["description"] and "\n" not in m["description"] and len(m["description"]) <= 110, f.name
    c = SPEC_BY_NAME["cache_threshold"]
    assert (c.type, c.default, c.min, c.max, c.live) == (float, 0.8, 0.0, 1.0, True)
    assert SPEC_BY_NAME["kv_bits"].choices == (0, 8, 16, 32) and not SPEC_BY_NAME["kv_bits"].live


def test_a_type_checker_sees_each_field_and_its_type(tmp_path):
    pytest.importorskip("mypy")
    (tmp_path / "use.py").write_text("from simllm_ros.settings import Settings\n"
                                     "s = Settings.from_overrides(cache_threshold=0.85)\n"
                                     "ok: float = s.cache_threshold\n"
                                     "bad: str = s.cache_threshold\n"
                                     "gone = s.cache_treshold\n")
    r = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"), "--follow-imports=silent",
                        "--no-error-summary", "--hide-error-context", str(tmp_path / "use.py")],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    errors = [line.split("use.py:", 1)[-1] for line in r.stdout.splitlines()]
    assert errors == ['4: error: Incompatible types in assignment (expression has type "float", variable has type '
                      '"str")  [assignment]',
                      '5: error: "Settings" has no attribute "cache_treshold"; maybe "cache_threshold"?  '
                      '[attr-defined]'], r.stdout + r.stderr


def test_ros_descriptors_carry_each_fields_range_choices_and_live_flag():
    pytest.importorskip("rcl_interfaces")
    from simllm_ros.ros.params import descriptor_for

    for spec in SPECS:
        d = descriptor_for(spec)
        assert d.name == spec.name and d.description == spec.description
        assert ("changes live" in d.additional_constraints) == spec.live
        ranges = list(d.floating_point_range) + list(d.integer_range)
        assert len(ranges) == (spec.min is not None)
        if ranges:
            assert (ranges[0].from_value, ranges[0].to_value) == (spec.min, spec.max)
        if spec.choices is not None:
            assert "one of: " + ", ".join(map(str, spec.choices)) in d.additional_constraints


def test_docs_table_is_the_one_the_fields_make():
    with open(os.path.join(REPO, "docs", "settings.md"), encoding="utf-8") as f:
        text = f.read()
    assert settings_doc.table_in(text) == settings_doc.table(), \
        "docs/settings.md is behind simllm_ros/settings.py: run python -m simllm_ros.settings_doc"
    for spec in SPECS:
        assert f"| `{spec.name}` | {spec.type.__name__} | `{json.dumps(spec.default)}` |" in text
    details = [line[4:] for line in text.split("## Details", 1)[1].splitlines() if line.startswith("### ")]
    assert details and set(details) <= set(SPEC_BY_NAME), set(details) - set(SPEC_BY_NAME)


def test_edge_yaml_sets_every_parameter_to_its_default():
    with open(EDGE_YAML, encoding="utf-8") as f:
        values = yaml.safe_load(f)["/**"]["ros__parameters"]
    secret = {"fleet_password"}  # a password does not belong in a shared file
    assert set(values) == set(SPEC_BY_NAME) - secret
    for name, value in values.items():
        spec = SPEC_BY_NAME[name]
        assert type(value) is spec.type and value == spec.default, (name, value, spec.default)
