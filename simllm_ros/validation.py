"""Checks on a request's own fields before any model work, and text normalization for fingerprints.

Why it exists: a robot's request may come from speech-to-text, a web UI or
another node; garbage (control characters, invisible-only prompts, odd cache
scopes, absurd token counts) must be refused with a message a user can act on,
never crash the node or poison the cache. Real text (emoji, accents, CJK, a few
right-to-left marks) must pass. `normalize_text` removes invisible format
characters so that zero-width tricks cannot give a prompt a new fingerprint.

Invisible is decided by Unicode property, not by a list of code points:
Default_Ignorable_Code_Point (Hangul fillers, the combining grapheme joiner, the
Khmer inherent vowels, tags, ...), format characters (Cf), variation selectors,
non-spacing and enclosing combining marks (Mn, Me: a prompt of marks alone has
nothing to combine with), controls and White_Space. The one addition is U+2800
BRAILLE PATTERN BLANK, a symbol (So) that renders as nothing.

Order of the checks: types, then the length in characters (one comparison, so a
4 MB prompt is refused before anything walks over it), then character by
character. The exact token count needs the tokenizer and is checked by the engine;
`max_chars` is a bound the engine derives from it that no prompt within
max_prompt_tokens can exceed.
"""
from __future__ import annotations

import math
import re
import unicodedata

import regex

from simllm_ros.request import DEFAULT_SCOPE, ROLES, QueryRequest, ToolResultTurn

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_TEMPERATURE = 5.0

_SCOPE_RE = re.compile(r"[A-Za-z0-9_.:/-]*")
# Characters that show nothing on their own, by Unicode property (see the module docstring).
_INVISIBLE_CLASS = (r"\p{Default_Ignorable_Code_Point}\p{Cf}\p{Variation_Selector}\p{Mn}\p{Me}\p{White_Space}"
                    r"\p{Cc}\p{Zs}\p{Zl}\p{Zp}\u2800")
_INVISIBLE_ONLY_RE = regex.compile(f"[{_INVISIBLE_CLASS}]*")
# Dropped by normalize_text: what renders as nothing inside text (marks stay: they change letters).
_DROP_RE = regex.compile(r"[\p{Default_Ignorable_Code_Point}\p{Cf}\u2800]")
_BLACK_FLAG = "\U0001f3f4"


def _is_tag(ch: str) -> bool:
    return 0xE0020 <= ord(ch) <= 0xE007F


def _suspicious_format_count(text: str) -> int:
    """Count Cf characters, except tag characters of an emoji flag sequence (black flag + tags), which are real text."""
    n = 0
    in_flag = False
    for ch in text:
        if ch == _BLACK_FLAG:
            in_flag = True
            continue
        if in_flag and _is_tag(ch):
            continue
        in_flag = False
        if unicodedata.category(ch) == "Cf":
            n += 1
    return n


def is_invisible_only(text: str) -> bool:
    """True for '' and for text made only of invisible characters (by property)."""
    return _INVISIBLE_ONLY_RE.fullmatch(text) is not None


def _char_code(ch: str) -> str:
    name = unicodedata.name(ch, "")
    return f"U+{ord(ch):04X}" + (f" ({name})" if name else "")


_BAD_CHAR_RE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")


def check_text_field(field: str, text: str) -> str | None:
    """Why a text field is refused (not a string, control characters, unpaired surrogates), or None."""
    if not isinstance(text, str):
        return f"{field} must be a string, got {type(text).__name__}"
    m = _BAD_CHAR_RE.search(text)
    if m is None:
        return None
    ch, i = m.group(), m.start()
    if unicodedata.category(ch) == "Cs":
        return f"{field} contains an unpaired surrogate {_char_code(ch)} at position {i}; text must be valid Unicode"
    return f"{field} contains control character {_char_code(ch)} at position {i}; only \\n, \\t and \\r are allowed"


def validate_scope(scope: str, max_scope_length: int) -> str | None:
    """Empty scope is the shared default scope; the name "default" is reserved for it (refused), so that
    a caller who names a scope never shares entries with callers who send none."""
    if not isinstance(scope, str):
        return f"cache_scope must be a string, got {type(scope).__name__}"
    if len(scope) > max_scope_length:
        return f"cache_scope is {len(scope)} characters long; at most {max_scope_length} are allowed"
    if not _SCOPE_RE.fullmatch(scope):
        bad = next(ch for ch in scope if not _SCOPE_RE.fullmatch(ch))
        return (f"cache_scope contains {_char_code(bad)!s}; only letters A-Z a-z, digits and _ . : / - are allowed")
    if scope == DEFAULT_SCOPE:
        return (f'cache_scope "{DEFAULT_SCOPE}" is reserved: it names the shared scope of requests with an empty '
                'cache_scope. Send "" to use that scope, or choose another name')
    return None


def _check_question(field: str, text: str) -> str | None:
    n_format = _suspicious_format_count(text)
    if n_format * 2 > len(text):
        return (f"{field} is mostly invisible formatting characters ({n_format} of {len(text)} are "
                "zero-width, direction marks or similar)")
    return None


TOOL_RESULT_ROLES = ("tool", "ipython")  # a node-made ToolResultTurn's roles (model/tool_call_formats.RESULT_ROLES)


def validate_messages(req: QueryRequest) -> str | None:
    """Roles, contents and order of a conversation (messages, then the prompt as the last user turn)."""
    for i, turn in enumerate(req.messages):
        field = f"messages[{i}]"
        if turn.role not in ROLES and not (isinstance(turn, ToolResultTurn) and turn.role in TOOL_RESULT_ROLES):
            return f"{field}.role {turn.role!r} is not one of {', '.join(ROLES)}"
        err = check_text_field(f"{field}.content", turn.content)
        if err:
            return err
        if is_invisible_only(turn.content):
            return f"{field}.content is empty (only whitespace or invisible characters)"
        if turn.role == "system" and i > 0:
            return f"{field}: a system turn may only come first"
    turns = req.turns()
    if turns[-1].role != "user" and not isinstance(turns[-1], ToolResultTurn):  # the model answers a tool's result
        return (f"the conversation ends with a {turns[-1].role} turn; the last turn must be the user's "
                "(give the new question as prompt or as a final user message)")
    return _check_question("the last user turn", turns[-1].content)


def validate_request(req: QueryRequest, *, max_scope_length: int, max_new_tokens_limit: int,
                     max_chars: int | None = None) -> str | None:
    """Return a human-readable reason the request is refused, or None when it is acceptable.
    max_chars: prompt, context and conversation longer than this (in characters) are refused before any
    per-character work."""
    for field in ("prompt", "context", "json_schema"):
        if not isinstance(getattr(req, field), str):
            return f"{field} must be a string, got {type(getattr(req, field)).__name__}"
    n_chars = len(req.prompt) + len(req.context) + sum(len(t.content) for t in req.messages
                                                       if isinstance(t.content, str))
    if max_chars is not None and n_chars > max_chars:
        return (f"prompt, context and messages are {n_chars} characters: more than the {max_chars} that can fit "
                "in max_prompt_tokens (nothing is truncated)")
    for field in ("prompt", "context", "json_schema"):
        err = check_text_field(field, getattr(req, field))
        if err:
            return err
    prompt = req.prompt
    if not req.messages:
        if is_invisible_only(prompt):
            return "prompt is empty (only whitespace or invisible characters) and no messages were given"
        err = _check_question("prompt", prompt)
    else:
        err = validate_messages(req)
    if err:
        return err
    err = validate_scope(req.cache_scope, max_scope_length)
    if err:
        return err
    mnt = req.max_new_tokens
    if isinstance(mnt, bool) or not isinstance(mnt, int):
        return f"max_new_tokens must be an integer, got {mnt!r}"
    if mnt < 0:
        return f"max_new_tokens must be >= 0 (0 means the default), got {mnt}"
    if mnt > max_new_tokens_limit:
        return f"max_new_tokens {mnt} is above the limit of {max_new_tokens_limit}"
    return validate_generation(req)


def validate_generation(req: QueryRequest) -> str | None:
    """Stop strings, temperature and seed (the JSON schema is checked by the engine, which compiles it)."""
    if len(req.stop) > MAX_STOP_STRINGS:
        return f"stop has {len(req.stop)} strings; at most {MAX_STOP_STRINGS} are allowed"
    for i, s in enumerate(req.stop):
        err = check_text_field(f"stop[{i}]", s)
        if err:
            return err
        if not s:
            return f"stop[{i}] is empty"
        if len(s) > MAX_STOP_CHARS:
            return f"stop[{i}] is {len(s)} characters long; at most {MAX_STOP_CHARS} are allowed"
    t = req.temperature
    if t is not None and not (isinstance(t, (int, float)) and not isinstance(t, bool) and 0.0 <= t <= MAX_TEMPERATURE):
        return f"temperature must be between 0 and {MAX_TEMPERATURE} (negative: the node's default), got {t!r}"
    seed = req.seed
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        return f"seed must be an integer >= 0 (negative: the node's default), got {seed!r}"
    return check_error_bound(req.approx_error_bound)


def check_error_bound(bound) -> str | None:
    """approx_error_bound: a chance, 0 to 1; negative (finite) asks for the node's; NaN, infinities, more than 1
    and non-numbers are refused (a NaN would compare false everywhere and slip past every bound)."""
    if isinstance(bound, bool) or not isinstance(bound, (int, float)):
        return f"approx_error_bound must be a number, got {type(bound).__name__}"
    if not math.isfinite(bound) or bound > 1.0:
        return (f"approx_error_bound must be between 0 and 1 (the largest chance an approximate answer may differ "
                f"from the model's own; negative: the node's default), got {bound!r}")
    return None


_WS_RE = re.compile(r"\s+")


def normalize_text(s: str) -> str:
    """Drop default-ignorable and format characters, collapse whitespace runs to one space, strip the ends."""
    return _WS_RE.sub(" ", _DROP_RE.sub("", s)).strip()
