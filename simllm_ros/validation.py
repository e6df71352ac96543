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

import re
import unicodedata

import regex

from simllm_ros.request import DEFAULT_SCOPE, QueryRequest

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


def _check_text_field(field: str, text: str) -> str | None:
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


def validate_request(req: QueryRequest, *, max_scope_length: int, max_new_tokens_limit: int,
                     max_chars: int | None = None) -> str | None:
    """Return a human-readable reason the request is refused, or None when it is acceptable.
    max_chars: prompt + context longer than this (in characters) is refused before any per-character work."""
    for field in ("prompt", "context"):
        if not isinstance(getattr(req, field), str):
            return f"{field} must be a string, got {type(getattr(req, field)).__name__}"
    n_chars = len(req.prompt) + len(req.context)
    if max_chars is not None and n_chars > max_chars:
        return (f"prompt and context are {n_chars} characters: more than the {max_chars} that can fit in "
                "max_prompt_tokens (nothing is truncated)")
    for field in ("prompt", "context"):
        err = _check_text_field(field, getattr(req, field))
        if err:
            return err
    prompt = req.prompt
    if is_invisible_only(prompt):
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
    """Drop default-ignorable and format characters, collapse whitespace runs to one space, strip the ends."""
    return _WS_RE.sub(" ", _DROP_RE.sub("", s)).strip()
