"""Settings: one typed, frozen field per SPECS row, validated once when made."""
import dataclasses

import pytest

from simllm_ros.settings import SPECS, SettingError, Settings


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
