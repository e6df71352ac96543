"""The model cache folder and the small JSON records a load keeps there (load checks, file digests, checked chat
templates): each a map read whole and updated one key at a time, atomically. A record that cannot be written costs
the next load a check again, never this load (try_cache_write)."""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any, TypeVar

from ..safe_io import write_json

T = TypeVar("T")


def default_cache_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "simllm_ros", "models")


def read_records(path: str) -> dict:
    """The JSON map in `path`; empty where the file is missing, unreadable or not a map."""
    try:
        with open(path) as f:
            got = json.load(f)
        return got if isinstance(got, dict) else {}
    except (OSError, ValueError):
        return {}


def update_record(path: str, key: str, value: Any, keep: int) -> None:
    """Sets one key of a small JSON map (the newest `keep` entries), written atomically."""
    data = read_records(path)
    data.pop(key, None)
    data[key] = value
    data = dict(list(data.items())[-keep:])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_json(path, data)


def try_cache_write(fn: Callable[[], T], progress: Callable[[str], None]) -> T | None:
    """A cache write that may fail (read-only folder, full disk) without failing the load: fn's result, else None."""
    try:
        return fn()
    except OSError as e:
        progress(f"note: could not keep a cache file ({e}); the next load checks again")
        return None
