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

from simllm_ros.request import QueryRequest

_ALLOWED_CONTROLS = {"\n", "\t", "\r"}
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


def validate_request(req: QueryRequest, *, max_scope_length: int, max_new_tokens_limit: int) -> str | None:
    """Return a human-readable reason the request is refused, or None when it is acceptable."""
    for field in ("prompt", "context"):
        err = _check_text_field(field, getattr(req, field))
        if err:
            return err
    prompt = req.prompt
    if not prompt or all(_is_invisible(ch) for ch in prompt):
        return "prompt is empty (only whitespace or invisible characters)"
    n_format = _suspicious_format_count(prompt)
    if n_format * 2 > len(prompt):
        return (f"prompt is mostly invisible formatting characters ({n_format} of {len(prompt)} are "
                "zero-width, direction marks or similar)")
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
    return None


_WS_RE = re.compile(r"\s+")


def normalize_text(s: str) -> str:
    """Drop format (Cf) and invisible filler characters, collapse whitespace runs to one space, strip the ends."""
    kept = "".join(ch for ch in s if unicodedata.category(ch) != "Cf" and ch not in _INVISIBLE_NON_CF)
    return _WS_RE.sub(" ", kept).strip()
