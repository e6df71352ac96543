"""validate_request and normalize_text on real and hostile inputs."""
import math

import pytest
from hypothesis import given, settings, strategies as st

from simllm_ros.request import QueryRequest
from simllm_ros.validation import normalize_text, validate_request

LIMITS = dict(max_scope_length=64, max_new_tokens_limit=512)


def check(**fields):
    fields.setdefault("prompt", "what is the weather like in denver")
    return validate_request(QueryRequest(**fields), **LIMITS)


@pytest.mark.parametrize("prompt", [
    "what is the weather like in denver",
    "Wie spät ist es in München? Ça va très bien, merci.",
    "明天东京的天气怎么样？",
    "set a timer for 5 minutes 🍪⏲️",
    "family 👨\u200d👩\u200d👧\u200d👦",          # emoji ZWJ sequence
    "👨\u200d👩\u200d👧",                         # only an emoji ZWJ sequence
    "🏴\U000e0067\U000e0062\U000e0073\U000e0063\U000e0074\U000e007f",  # flag of Scotland (tag sequence)
    "مرحبا \u200fكيف حالك\u200f؟",                # RTL marks in normal Arabic text
    "line one\nline two\ttabbed\r\n",
    "é",                                          # one accented char (combining form)
])
def test_real_text_accepted(prompt):
    assert check(prompt=prompt) is None


@pytest.mark.parametrize("prompt", ["", "   ", "\n\t\r\n", "\u200b\u200b", "\u200b \u200c\u2060\ufeff", "\u3164\u3164", "\u00a0\u2003"])
def test_empty_or_invisible_prompt_refused(prompt):
    err = check(prompt=prompt)
    assert err and "prompt is empty" in err


# Found by probing: these rendered nothing and were served (U+034F combining grapheme joiner, U+FE0F
# variation selector 16, U+17B4/U+17B5 Khmer inherent vowels), plus others by the same properties.
_INVISIBLES = ["\u034f", "\ufe0f", "\u17b4", "\u17b5", "\ufe00", "\U000e0100", "\u180b", "\u115f", "\uffa0",
               "\u00ad", "\u061c", "\u2064", "\U000e0001", "\U000e0041", "\u0301", "\u20dd", "\u1160", "\u2800"]


@pytest.mark.parametrize("ch", _INVISIBLES, ids=[f"U+{ord(c):04X}" for c in _INVISIBLES])
@pytest.mark.parametrize("shape", ["alone", "repeated", "spaces", "newlines", "mixed"])
def test_invisible_only_prompts_refused_by_property(ch, shape):
    prompt = {"alone": ch, "repeated": ch * 7, "spaces": f" {ch} {ch}  ", "newlines": f"\n{ch}\n\n{ch}\n",
              "mixed": ch + "\u200b \u034f\ufe0f\u17b4\u17b5\n" + ch}[shape]
    err = check(prompt=prompt)
    assert err and "prompt is empty" in err, (prompt, err)


def test_marks_on_a_letter_are_text():
    assert check(prompt="e\u0301") is None and check(prompt="\u2764\ufe0f") is None  # é; red heart emoji


def test_long_prompt_refused_by_length_before_any_scan():
    """A 4 MB prompt is refused by one length comparison (the engine passes max_chars), not after a scan."""
    import time
    big = "a" * (4 * 2**20)
    dt = math.inf
    for _ in range(5):  # best of five: a pause of this shared machine is not the check's cost
        t0 = time.perf_counter()
        err = validate_request(QueryRequest(prompt=big, context="x"), **LIMITS, max_chars=100_000)
        dt = min(dt, time.perf_counter() - t0)
    assert err and "4194305 characters" in err and "100000" in err and "nothing is truncated" in err
    assert dt < 0.01, f"{dt * 1000:.1f} ms"
    assert validate_request(QueryRequest(prompt="a" * 1000, context="b" * 1000), **LIMITS, max_chars=2000) is None


def test_mostly_format_chars_refused():
    err = check(prompt="hi\u200b\u200b\u200b")  # 3 of 5 are zero-width spaces
    assert err and "invisible formatting" in err and "3 of 5" in err
    assert check(prompt="hi!\u200b\u200b") is None  # 2 of 5: not more than half


def test_interleaved_zero_width_refused():
    assert check(prompt="\u200b".join("hello") + "\u200b" * 2) is not None


@pytest.mark.parametrize("field", ["prompt", "context"])
@pytest.mark.parametrize("ch,code", [("\x00", "U+0000"), ("\x07", "U+0007"), ("\x1b", "U+001B"),
                                     ("\x7f", "U+007F"), ("\x85", "U+0085"), ("\x9f", "U+009F")])
def test_control_characters_refused_with_field_and_code(field, ch, code):
    err = check(**{field: f"abc{ch}def"})
    assert err is not None and err.startswith(field) and code in err and "position 3" in err


def test_context_may_be_empty_and_multiline():
    assert check(context="") is None
    assert check(context="The robot is in the kitchen.\nThe door is closed.") is None


def test_lone_surrogate_refused():
    err = check(prompt="abc\ud800")
    assert err and "surrogate" in err


@pytest.mark.parametrize("scope", ["", "Default", "default2", "robot_1/kitchen", "map:v2.1", "a-b_c.d:e/f", "x" * 64])
def test_scope_accepted(scope):
    assert check(cache_scope=scope) is None


def test_scope_default_is_reserved():
    """"" is the shared scope, which the pool calls "default": a caller may not name it, or it would
    share entries with every caller that sends no scope."""
    err = check(cache_scope="default")
    assert err and "reserved" in err and 'Send ""' in err
    assert QueryRequest(prompt="x", cache_scope="").scope == "default"


def test_scope_too_long():
    err = check(cache_scope="x" * 65)
    assert err and "cache_scope" in err and "65" in err and "64" in err


@pytest.mark.parametrize("scope,bad", [("kitchen robot", "U+0020"), ("küche", "U+00FC"), ("a;b", "U+003B"),
                                       ("a\x00b", "U+0000"), ("scope*", "U+002A")])
def test_scope_bad_characters(scope, bad):
    err = check(cache_scope=scope)
    assert err and "cache_scope" in err and bad in err and "only letters" in err


def test_max_new_tokens():
    assert check(max_new_tokens=0) is None
    assert check(max_new_tokens=512) is None
    err = check(max_new_tokens=513)
    assert err and "513" in err and "512" in err
    assert "max_new_tokens" in check(max_new_tokens=-1)


@pytest.mark.parametrize("bound", [0.0, 0.02, 1.0, 1, -1.0, -0.5])
def test_approx_error_bound_in_range_or_negative_for_the_nodes_accepted(bound):
    assert check(approx_error_bound=bound) is None


@pytest.mark.parametrize("bound", [math.nan, math.inf, -math.inf, 1.0000001, 2.0, 1e300, "0.1", None, True])
def test_approx_error_bound_nan_infinite_above_one_or_not_a_number_refused(bound):
    err = check(approx_error_bound=bound)
    assert err and "approx_error_bound" in err
    assert ("between 0 and 1" in err) if isinstance(bound, float) else ("must be a number" in err)


def test_limits_are_parameters():
    req = QueryRequest(prompt="hi", cache_scope="abcd", max_new_tokens=20)
    assert validate_request(req, max_scope_length=4, max_new_tokens_limit=20) is None
    assert validate_request(req, max_scope_length=3, max_new_tokens_limit=20) is not None
    assert validate_request(req, max_scope_length=4, max_new_tokens_limit=19) is not None


@settings(max_examples=400, deadline=None)
@given(prompt=st.text(), context=st.text(), scope=st.text(), mnt=st.integers(-10**6, 10**6),
       scope_len=st.integers(1, 256), limit=st.integers(1, 4096))
def test_never_raises(prompt, context, scope, mnt, scope_len, limit):
    req = QueryRequest(prompt=prompt, context=context, cache_scope=scope, max_new_tokens=mnt)
    err = validate_request(req, max_scope_length=scope_len, max_new_tokens_limit=limit)
    assert err is None or (isinstance(err, str) and err.strip())


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8", categories=["L", "N", "P", "S"],
                                     exclude_characters="\u115f\u1160\u3164\uffa0\u2800"), min_size=1))
def test_visible_text_always_accepted(prompt):
    """Letters, digits, punctuation, symbols: all accepted (minus the blank-looking fillers, tested above)."""
    assert check(prompt=prompt) is None


def test_normalize_text():
    assert normalize_text("  hello\u200b   wor\u200dld \n\t ") == "hello world"
    assert normalize_text("\ufeffis Elm\u2060 Street open?") == "is Elm Street open?"
    assert normalize_text("a\u00a0\u2003b") == "a b"
    assert normalize_text("\u200b\u200c") == ""
    assert normalize_text("明天 东京") == "明天 东京"


def test_zero_width_tricks_do_not_change_normalized_text():
    base = "what is the weather like in denver"
    tricked = "\u200b".join(base[:10]) + base[10:].replace(" ", " \u2060 ")
    assert tricked != base and normalize_text(tricked) == base


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_normalize_idempotent(s):
    once = normalize_text(s)
    assert normalize_text(once) == once
