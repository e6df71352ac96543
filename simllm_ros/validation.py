"""Checks on a request's own fields before any model work, and text normalization for fingerprints.

Why it exists: a robot's request may come from speech-to-text, a web UI or
another node; garbage (control characters, invisible-only prompts, odd cache
scopes, absurd token counts) must be refused with a message a user can act on,
never crash the node or poison the cache. Real text (emoji, accents, CJK, a few
right-to-left marks) must pass. `normalize_text` removes invisible format
characters so that zero-width tricks cannot give a prompt a new fingerprint.

Token-count limits need the tokenizer and are checked by the engine.
"""
from __future__ import annotations

import re
import unicodedata

from simllm_ros.request import ROLES, QueryRequest

_ALLOWED_CONTROLS = {"\n", "\t", "\r"}
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_TEMPERATURE = 5.0
_SCOPE_RE = re.compile(r"[A-Za-z0-9_.:/-]*")
# Letters and symbols that render as nothing (Hangul fillers, braille blank).
_INVISIBLE_NON_CF = {"\u115f", "\u1160", "\u3164", "\uffa0", "\u2800"}
_BLACK_FLAG = "\U0001f3f4"


def _is_control(ch: str) -> bool:
    """C0 (U+0000-U+001F), DEL and C1 (U+0080-U+009F), except newline, tab and carriage return."""
    o = ord(ch)
    return ch not in _ALLOWED_CONTROLS and (o < 0x20 or 0x7F <= o <= 0x9F)


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


def _is_invisible(ch: str) -> bool:
    return ch.isspace() or ch in _INVISIBLE_NON_CF or unicodedata.category(ch) in ("Cf", "Cc", "Zs", "Zl", "Zp")


def _char_code(ch: str) -> str:
    name = unicodedata.name(ch, "")
    return f"U+{ord(ch):04X}" + (f" ({name})" if name else "")


def check_text_field(field: str, text: str) -> str | None:
    """Why a text field is refused (not a string, control characters, unpaired surrogates), or None."""
    return _check_text_field(field, text)


def is_blank(text: str) -> bool:
    """Empty, or only whitespace and invisible characters."""
    return _is_blank(text)


def _check_text_field(field: str, text: str) -> str | None:
    if not isinstance(text, str):
        return f"{field} must be a string, got {type(text).__name__}"
    for i, ch in enumerate(text):
        if _is_control(ch):
            return f"{field} contains control character {_char_code(ch)} at position {i}; only \\n, \\t and \\r are allowed"
        if unicodedata.category(ch) == "Cs":
            return f"{field} contains an unpaired surrogate {_char_code(ch)} at position {i}; text must be valid Unicode"
    return None


def validate_scope(scope: str, max_scope_length: int) -> str | None:
    """Empty scope is fine (it means 'default')."""
    if not isinstance(scope, str):
        return f"cache_scope must be a string, got {type(scope).__name__}"
    if len(scope) > max_scope_length:
        return f"cache_scope is {len(scope)} characters long; at most {max_scope_length} are allowed"
    if not _SCOPE_RE.fullmatch(scope):
        bad = next(ch for ch in scope if not _SCOPE_RE.fullmatch(ch))
        return (f"cache_scope contains {_char_code(bad)!s}; only letters A-Z a-z, digits and _ . : / - are allowed")
    return None


def _is_blank(text: str) -> bool:
    return not text or all(_is_invisible(ch) for ch in text)


def _check_question(field: str, text: str) -> str | None:
    n_format = _suspicious_format_count(text)
    if n_format * 2 > len(text):
        return (f"{field} is mostly invisible formatting characters ({n_format} of {len(text)} are "
                "zero-width, direction marks or similar)")
    return None


def validate_messages(req: QueryRequest) -> str | None:
    """Roles, contents and order of a conversation (messages, then the prompt as the last user turn)."""
    for i, turn in enumerate(req.messages):
        field = f"messages[{i}]"
        if turn.role not in ROLES:
            return f"{field}.role {turn.role!r} is not one of {', '.join(ROLES)}"
        err = _check_text_field(f"{field}.content", turn.content)
        if err:
            return err
        if _is_blank(turn.content):
            return f"{field}.content is empty (only whitespace or invisible characters)"
        if turn.role == "system" and i > 0:
            return f"{field}: a system turn may only come first"
    turns = req.turns()
    if turns[-1].role != "user":
        return (f"the conversation ends with a {turns[-1].role} turn; the last turn must be the user's "
                "(give the new question as prompt or as a final user message)")
    return _check_question("the last user turn", turns[-1].content)


def validate_request(req: QueryRequest, *, max_scope_length: int, max_new_tokens_limit: int) -> str | None:
    """Return a human-readable reason the request is refused, or None when it is acceptable."""
    for field in ("prompt", "context", "json_schema"):
        err = _check_text_field(field, getattr(req, field))
        if err:
            return err
    prompt = req.prompt
    if not req.messages:
        if _is_blank(prompt):
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
        err = _check_text_field(f"stop[{i}]", s)
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
    return None


_WS_RE = re.compile(r"\s+")


def normalize_text(s: str) -> str:
    """Drop format (Cf) and invisible filler characters, collapse whitespace runs to one space, strip the ends."""
    kept = "".join(ch for ch in s if unicodedata.category(ch) != "Cf" and ch not in _INVISIBLE_NON_CF)
    return _WS_RE.sub(" ", kept).strip()
