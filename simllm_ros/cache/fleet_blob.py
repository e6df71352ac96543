"""The fleet store's sealed blobs and scope tags: what makes a shared value safe to use.

A blob is a magic, a JSON header, a payload and an HMAC-SHA256 over the key it is stored under, the header and
the payload, keyed with the fleet secret: a value damaged, truncated, written with another secret or copied under
another key (another scope, another place in a prompt) does not unseal.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import struct

from .. import bounded_json

MAGIC = b"SIMLLMF1"
MAC_BYTES = 32
DEFAULT_SECRET = b"simllm-fleet-default-secret"  # without fleet_secret_file: scopes are walled by name only
MAX_HEADER_BYTES = 256 * 1024  # an answer's header: its question (500 characters) and up to MAX_IDS token ids
MAX_HEADER_DEPTH = 6  # what seal writes nests 4 deep at most (a task's messages: [[role, content]])
MAX_IDS = 16384  # token ids in one header
MAX_ID = 2**31 - 1  # token ids are int32 everywhere


class BlobRefused(ValueError):
    """A blob that must not be used: damaged, truncated, foreign digest, wrong key or scope."""


def _mac(secret: bytes, key: str, body: bytes) -> bytes:
    return hmac.new(secret, key.encode() + b"\0" + body, hashlib.sha256).digest()


def seal(secret: bytes, key: str, header: dict, payload: bytes) -> bytes:
    """A blob for `key`: magic, header length, JSON header, payload, then a MAC over the key and all of it."""
    h = json.dumps(header, separators=(",", ":")).encode()
    body = MAGIC + struct.pack("<I", len(h)) + h + payload
    return body + _mac(secret, key, body)


def unseal(secret: bytes, key: str, blob: bytes, max_header: int = MAX_HEADER_BYTES) -> tuple[dict, bytes]:
    """The header and payload of a blob stored under `key`, or BlobRefused saying why (the header parsed within
    max_header bytes and MAX_HEADER_DEPTH levels, finite numbers only)."""
    if not isinstance(blob, (bytes, bytearray)) or len(blob) < len(MAGIC) + 4 + MAC_BYTES:
        raise BlobRefused("truncated blob")
    body, mac = bytes(blob[:-MAC_BYTES]), bytes(blob[-MAC_BYTES:])
    if body[:len(MAGIC)] != MAGIC:
        raise BlobRefused("not a simllm fleet blob")
    if not hmac.compare_digest(mac, _mac(secret, key, body)):
        raise BlobRefused("MAC mismatch (damaged, truncated, written under another key or scope, or another secret)")
    (n,) = struct.unpack_from("<I", body, len(MAGIC))
    start = len(MAGIC) + 4
    if start + n > len(body):
        raise BlobRefused("header runs past the blob")
    if n > max_header:
        raise BlobRefused(f"header of {n} bytes, more than {max_header}")
    try:  # bounded: a sealed blob is only as trustworthy as the least careful node holding the secret
        header = bounded_json.loads(body[start:start + n], max_bytes=max_header, max_depth=MAX_HEADER_DEPTH)
    except ValueError as e:
        raise BlobRefused(f"unreadable header: {e}") from None
    if not isinstance(header, dict):
        raise BlobRefused("header is not an object")
    return header, body[start + n:]


def token_ids(value, what: str = "ids", max_len: int = MAX_IDS) -> list[int]:
    """A header's token ids, checked: a list of at most max_len int32 ids >= 0; BlobRefused naming the problem."""
    if not isinstance(value, list):
        raise BlobRefused(f"{what} is not a list")
    if len(value) > max_len:
        raise BlobRefused(f"{what} holds {len(value)} ids, more than {max_len}")
    for t in value:
        if type(t) is not int or not 0 <= t <= MAX_ID:
            raise BlobRefused(f"{what} holds {str(t)[:20]!r}, not a token id")
    return value


def scope_tag(secret: bytes, scope: str) -> str:
    """The key tag of a scope: an HMAC of its name, so the name is not in Redis and other scopes' tags cannot be
    derived from one's own (docs/fleet.md: for an ACL rule)."""
    return hmac.new(secret, b"scope\0" + scope.encode(), hashlib.sha256).hexdigest()[:20]


def read_secret(path: str) -> bytes:
    """The fleet secret from a file (its bytes, stripped); the default when no file is given."""
    if not path:
        return DEFAULT_SECRET
    with open(path, "rb") as f:
        data = f.read().strip()
    if len(data) < 16:
        raise ValueError(f"fleet_secret_file {path}: at least 16 bytes of secret expected")
    return data
