"""Saves and restores the KV pool across restarts: safetensors for tensors, JSON for the rest, no pickles.

One file holds both (the JSON manifest sits in the safetensors header
metadata), so a snapshot is replaced by a single atomic rename: write a temp
file in the same folder, fsync it, rename it over the old one, fsync the
folder. A kill -9 at any moment leaves either the old or the new snapshot.
Saves into one folder are serialised (a background checkpoint and the final
save never interleave), and each one holds the pool lock only while it copies
the tensors, not while it writes.

Loading treats the file as hostile, since anyone who can write persist_path can
put anything there. The snapshot is opened only if it is a regular file, and
without blocking (a FIFO, a device or a symlink loop is refused at once). The
safetensors header is parsed here, with a size cap, before any tensor is read.
Tensors are read with pread, so a file truncated mid-load is an error, not a
SIGBUS. Every manifest value is checked: types, finite and in range (hits,
timestamps, token ids against the model's vocabulary, block rows against the
tensors), consistent with the tensors (shapes, dtypes, finite KV, unit
fingerprints). Timestamps in the future (a robot whose clock restarted at 1970)
are clamped to now. Anything wrong skips the whole snapshot with a reason that
names the file, and the node starts empty. Nothing is parsed but JSON and raw
arrays, so a hostile file cannot run code.

The sha256 in the header is corruption detection only (a disk or copy error
flipping bits in the KV data, which safetensors itself does not check). It has no
key: whoever can write the file can recompute it, so it proves nothing about who
wrote the file. The checks above are what make a crafted file harmless.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
import tempfile
import threading
import time

import numpy as np
import torch
from safetensors.torch import save_file

from .kv_pool import KVPool, PoolSnapshot
from ..safe_io import describe_error, open_regular, pread_exact

FORMAT = "simllm_ros.kv_pool"
FORMAT_VERSION = 1
FILENAME = "kv_pool.safetensors"
PARTIAL_DIR = ".partial"  # in-progress writes (ours and safetensors' own temp file); cleared at load

# Limits on what a snapshot may claim before anything is allocated for it.
MAX_HEADER_BYTES = 64 * 2**20  # the JSON header (manifest included); safetensors' own cap is 100 MB
MAX_ENTRIES = 1_000_000
MAX_ENTRY_TOKENS = 1 << 20
MAX_TEXT_CHARS = 1 << 20  # question / answer
MAX_HITS = 2**53
MAX_TIME = 1e11  # seconds since 1970: year 5138
_DIGEST_RE = re.compile(r"[0-9a-f]{32}")
_SCOPE_RE = re.compile(r"[A-Za-z0-9_.:/-]{1,256}")
_ENTRY_KEYS = {"scope", "tokens", "rows", "question", "context_digest", "answer", "created", "last_used", "hits"}

_save_locks: dict[str, threading.Lock] = {}
_save_locks_guard = threading.Lock()


def _save_lock(folder: str) -> threading.Lock:
    key = os.path.realpath(folder)
    with _save_locks_guard:
        return _save_locks.setdefault(key, threading.Lock())


def snapshot_path(folder: str) -> str:
    return os.path.join(folder, FILENAME)


def identity(pool: KVPool, model_identity: dict, embedder: str, numerics: str = "") -> dict:
    """What a snapshot must match to be loaded. `numerics`: ModelBackend.numerics_digest, the arithmetic of
    the process that computed the KV (another CPU or kernel choice computes other bits)."""
    return {"format": FORMAT, "version": FORMAT_VERSION, "model": model_identity, "embedder": embedder,
            "kv_bits": pool.kv_bits, "block_tokens": pool.block_tokens,
            "store_dtype": str(pool.store_dtype), "numerics": numerics}


def save(pool: KVPool, folder: str, ident: dict) -> str:
    with _save_lock(folder):
        return _save(pool, folder, ident)


def _real_dir(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _save(pool: KVPool, folder: str, ident: dict) -> str:
    snap = pool.snapshot()  # copies, under the pool lock; the rest runs without it
    tensors = dict(snap.blocks)
    tensors["fingerprints"] = torch.from_numpy(snap.fingerprints) if snap.entries else torch.zeros(0)
    if snap.key_calibration is not None:
        tensors["calib_lo"], tensors["calib_hi"] = snap.key_calibration
    manifest = {"identity": ident, "entries": snap.entries}
    tensors = {k: t.contiguous() for k, t in tensors.items()}
    manifest_json = json.dumps(manifest)
    os.makedirs(folder, exist_ok=True)
    target = snapshot_path(folder)
    partial = os.path.join(folder, PARTIAL_DIR)
    if os.path.lexists(partial) and not _real_dir(partial):
        os.unlink(partial)  # a symlink or file planted as .partial: temp files go only into our own folder
    os.makedirs(partial, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="kv_pool.", suffix=".tmp", dir=partial)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"manifest": manifest_json, "sha256": checksum(manifest_json, tensors)})
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
        try:
            os.rmdir(partial)  # empty after a clean save; a leftover only marks a save that was killed
        except OSError:
            pass
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return target


def checksum(manifest_json: str, tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the manifest and every tensor's name, dtype, shape and bytes: safetensors itself
    checks only the header's structure, so flipped bits in the data would otherwise load as wrong KV."""
    h = hashlib.sha256(manifest_json.encode("utf-8"))
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"\0{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def remove_partial_writes(folder: str) -> int:
    """Delete what a save killed midway left behind (only inside our own .partial folder, never through a
    symlink, and only files: a planted `.partial -> /somewhere` deletes nothing there)."""
    partial = os.path.join(folder, PARTIAL_DIR)
    removed = 0
    if _real_dir(partial):
        for name in os.listdir(partial):
            p = os.path.join(partial, name)
            if _real_dir(p):
                continue
            try:
                os.unlink(p)
                removed += 1
            except OSError:
                pass
    return removed


class SnapshotSkipped(Exception):
    """The snapshot was not loaded; the message says why and names the file (for the log)."""


class _Bad(ValueError):
    """A snapshot value failed a check; the message says which."""


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def _reject_constant(name: str):
    raise _Bad(f"non-finite number {name} in the manifest")


def _read_header(fd: int, size: int) -> tuple[int, dict]:
    """safetensors layout: u64 little-endian header length N, N bytes of JSON, then the raw data."""
    if size < 8:
        raise _Bad(f"{size} bytes: too short for a safetensors file")
    n = int.from_bytes(pread_exact(fd, 8, 0), "little")
    if n > MAX_HEADER_BYTES:
        raise _Bad(f"header of {n} bytes is over the {MAX_HEADER_BYTES} byte limit")
    if n > size - 8:
        raise _Bad(f"header of {n} bytes is longer than the file ({size} bytes)")
    try:
        header = json.loads(pread_exact(fd, n, 8).decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise _Bad(f"header is not JSON ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise _Bad("header is not a JSON object")
    return 8 + n, header


def _tensor_specs(header: dict, data_bytes: int) -> tuple[dict, dict]:
    """(metadata, {name: (dtype, shape, begin, end)}), every offset inside the data and no overlaps."""
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise _Bad("__metadata__ is not a map of strings")
    specs, spans = {}, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise _Bad(f"tensor {name!r}: malformed header entry")
        dtype = _DTYPES.get(info["dtype"])
        shape, offs = info["shape"], info["data_offsets"]
        if dtype is None:
            raise _Bad(f"tensor {name!r}: unknown dtype {info['dtype']!r}")
        if (not isinstance(shape, list) or len(shape) > 8 or
                not all(type(d) is int and 0 <= d <= 2**40 for d in shape)):
            raise _Bad(f"tensor {name!r}: bad shape {shape!r}")
        if not isinstance(offs, list) or len(offs) != 2 or not all(type(o) is int for o in offs):
            raise _Bad(f"tensor {name!r}: bad data_offsets")
        begin, end = offs
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if not 0 <= begin <= end <= data_bytes or end - begin != nbytes:
            raise _Bad(f"tensor {name!r}: data_offsets {offs} do not fit shape {shape} in {data_bytes} data bytes")
        specs[name] = (dtype, tuple(shape), begin, end)
        spans.append((begin, end, name))
    spans.sort()
    for (_, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise _Bad(f"tensors {n0!r} and {n1!r} overlap")
    return meta, specs


def _read_tensor(fd: int, data_start: int, dtype, shape, begin: int, end: int) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype)
    if end > begin:
        view = memoryview(t.view(-1).view(torch.uint8).numpy())
        pos = 0
        while pos < len(view):
            got = os.preadv(fd, [view[pos:]], data_start + begin + pos)
            if got <= 0:
                raise OSError(f"file ended inside tensor data at byte {data_start + begin + pos}")
            pos += got
    return t


def _expect(tensors: dict, name: str, dtype, shape: tuple) -> torch.Tensor:
    t = tensors.get(name)
    if t is None:
        raise _Bad(f"tensor {name!r} is missing")
    if t.dtype != dtype or tuple(t.shape) != tuple(shape):
        raise _Bad(f"tensor {name!r} is {t.dtype} {tuple(t.shape)}, expected {dtype} {tuple(shape)}")
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise _Bad(f"tensor {name!r} holds non-finite values")
    return t


def _check_tensors(tensors: dict, pool: KVPool, n_entries: int) -> int:
    """Shapes, dtypes and finiteness of every tensor against this pool; returns the number of block rows."""
    shape, store_dtype = pool.shape, pool.store_dtype
    L, H, D, T = shape.layers, shape.kv_heads, shape.head_dim, pool.block_tokens
    allowed = {"fingerprints", "calib_lo", "calib_hi", "k", "v"}
    if pool.quantized:
        allowed |= {"k_scale", "k_zero", "v_scale", "v_zero"}
    unknown = sorted(set(tensors) - allowed)
    if unknown:
        raise _Bad(f"unexpected tensors {unknown}")
    if n_entries:
        _expect(tensors, "fingerprints", torch.float32, (n_entries, pool.fingerprint_dim))
        norms = torch.linalg.vector_norm(tensors["fingerprints"], dim=1)
        if not bool(((norms > 0.99) & (norms < 1.01)).all()):
            raise _Bad("fingerprints are not unit vectors")
    rows = tensors["k"].shape[0] if "k" in tensors else 0
    if n_entries or "k" in tensors:
        _expect(tensors, "k", store_dtype, (rows, L, H, T, D))
        _expect(tensors, "v", store_dtype, (rows, L, H, T, D))
        if pool.quantized:
            for name, want in (("k_scale", (rows, L, H, 1, D)), ("k_zero", (rows, L, H, 1, D)),
                                ("v_scale", (rows, L, H, T, 1)), ("v_zero", (rows, L, H, T, 1))):
                _expect(tensors, name, torch.float16, want)
    if ("calib_lo" in tensors) != ("calib_hi" in tensors):
        raise _Bad("only one of calib_lo / calib_hi")
    if "calib_lo" in tensors:
        lo = _expect(tensors, "calib_lo", torch.float32, (L, H, 1, D))
        hi = _expect(tensors, "calib_hi", torch.float32, (L, H, 1, D))
        if not bool((lo <= hi).all()):
            raise _Bad("calib_lo above calib_hi")
    return rows


def _number(e: dict, name: str, lo: float, hi: float, integer: bool = False):
    v = e[name]
    if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
        raise _Bad(f"{name} is {type(v).__name__}, expected {'an integer' if integer else 'a number'}")
    if not math.isfinite(v) or not lo <= v <= hi:
        raise _Bad(f"{name} = {v!r} is outside [{lo:g}, {hi:g}]")
    return v


def _check_entries(manifest, pool: KVPool, ident: dict, rows: int, now: float) -> list[dict]:
    """Every manifest value checked; returns clean entries (plain Python types, times clamped to now)."""
    if not isinstance(manifest, dict) or set(manifest) != {"identity", "entries"}:
        raise _Bad("manifest is not {identity, entries}")
    entries = manifest["entries"]
    if not isinstance(entries, list) or len(entries) > MAX_ENTRIES:
        raise _Bad(f"entries is not a list of at most {MAX_ENTRIES}")
    model = ident.get("model") if isinstance(ident, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    vocab = vocab if type(vocab) is int and vocab > 0 else 2**31
    T = pool.block_tokens
    out, seen = [], set()
    for i, e in enumerate(entries):
        try:
            if not isinstance(e, dict) or set(e) != _ENTRY_KEYS:
                raise _Bad(f"keys are {sorted(e) if isinstance(e, dict) else type(e).__name__}, "
                           f"expected {sorted(_ENTRY_KEYS)}")
            scope = e["scope"]
            if not isinstance(scope, str) or not _SCOPE_RE.fullmatch(scope):
                raise _Bad(f"scope {str(scope)[:40]!r} is not a valid cache scope")
            tokens = e["tokens"]
            if not isinstance(tokens, list) or not 1 <= len(tokens) <= MAX_ENTRY_TOKENS:
                raise _Bad("tokens is not a non-empty list")
            if not all(type(t) is int and 0 <= t < vocab for t in tokens):
                raise _Bad(f"tokens hold a value that is not a token id in [0, {vocab})")
            blocks = e["rows"]
            if not isinstance(blocks, list) or len(blocks) != -(-len(tokens) // T):
                raise _Bad(f"block table of {len(blocks) if isinstance(blocks, list) else '?'} rows does not "
                           f"match {len(tokens)} tokens")
            if not all(type(r) is int and 0 <= r < rows for r in blocks):
                raise _Bad(f"block table points outside the {rows} stored rows")
            for name, limit in (("question", MAX_TEXT_CHARS), ("answer", MAX_TEXT_CHARS)):
                if not isinstance(e[name], str) or len(e[name]) > limit:
                    raise _Bad(f"{name} is not a string of at most {limit} characters")
            if not isinstance(e["context_digest"], str) or not _DIGEST_RE.fullmatch(e["context_digest"]):
                raise _Bad("context_digest is not 32 hex digits")
            hits = _number(e, "hits", 0, MAX_HITS, integer=True)
            created = min(float(_number(e, "created", 0.0, MAX_TIME)), now)
            last_used = min(float(_number(e, "last_used", 0.0, MAX_TIME)), now)
            key = (scope, tuple(tokens))
            if key in seen:
                raise _Bad("the same scope and tokens appear twice")
            seen.add(key)
        except _Bad as err:
            raise _Bad(f"entry {i}: {err}") from None
        out.append(dict(scope=scope, tokens=list(tokens), rows=list(blocks), question=e["question"],
                        context_digest=e["context_digest"], answer=e["answer"], created=created,
                        last_used=last_used, hits=int(hits), index=i))
    return out


def load(pool: KVPool, folder: str, ident: dict) -> int:
    """Restore entries into an empty pool; returns how many were restored. Raises SnapshotSkipped (and only
    that): the pool is then left empty and consistent."""
    path = snapshot_path(folder)
    try:
        remove_partial_writes(folder)
    except OSError:
        pass
    if not os.path.lexists(path):
        raise SnapshotSkipped(f"no snapshot at {path}")
    try:
        fd = open_regular(path)
    except OSError as e:
        raise SnapshotSkipped(f"unreadable snapshot {path}: {describe_error(e)}; starting empty") from None
    try:
        try:
            size = os.fstat(fd).st_size
            data_start, header = _read_header(fd, size)
            meta, specs = _tensor_specs(header, size - data_start)
            if "manifest" not in meta:
                raise _Bad("no manifest in the header metadata")
            manifest = json.loads(meta["manifest"], parse_constant=_reject_constant)
            tensors = {name: _read_tensor(fd, data_start, *spec) for name, spec in specs.items()}
        except (_Bad, OSError, ValueError, RecursionError, MemoryError, RuntimeError) as e:
            why = str(e) if isinstance(e, _Bad) else f"{type(e).__name__}: {e}"
            raise SnapshotSkipped(f"unreadable snapshot {path}: {why}; starting empty") from None
        if meta.get("sha256") != checksum(meta["manifest"], tensors):
            raise SnapshotSkipped(f"unreadable snapshot {path}: checksum mismatch (corrupted, or edited without "
                                  "recomputing it); starting empty")
        got = manifest.get("identity", {}) if isinstance(manifest, dict) else {}
        if got != ident:
            keys = set(got) | set(ident) if isinstance(got, dict) else set(ident)
            diff = sorted(k for k in keys if not isinstance(got, dict) or got.get(k) != ident.get(k))
            why = (" (numerics: the model computes other bits in this process, another CPU or kernel choice, so its "
                   "KV would not be what this process computes)") if diff == ["numerics"] else ""
            raise SnapshotSkipped(f"snapshot {path} is from another setup (differs in: {', '.join(diff) or 'format'})"
                                  f"{why}; starting empty")
        try:
            n = len(manifest.get("entries") or []) if isinstance(manifest.get("entries"), list) else 0
            rows = _check_tensors(tensors, pool, n)
            entries = _check_entries(manifest, pool, ident, rows, time.time())
        except (_Bad, KeyError, TypeError, ValueError, RuntimeError) as e:
            why = str(e) if isinstance(e, _Bad) else f"{type(e).__name__}: {e}"
            raise SnapshotSkipped(f"snapshot {path} is inconsistent ({why}); starting empty") from None
    finally:
        os.close(fd)
    try:
        return _restore(pool, entries, tensors)
    except Exception as e:  # checked above; anything left is a bug, and still must not stop the node
        pool.clear()
        raise SnapshotSkipped(f"snapshot {path} could not be restored ({type(e).__name__}: {e}); "
                              "starting empty") from None


def _restore(pool: KVPool, entries: list[dict], tensors: dict) -> int:
    """Checked entries (in file order, so row i of the fingerprints is entries[i]) into the pool."""
    fps = tensors["fingerprints"].numpy() if entries else np.zeros((0, pool.fingerprint_dim), np.float32)
    device = pool.device
    blocks = {k: t.to(device) for k, t in tensors.items() if k not in ("fingerprints", "calib_lo", "calib_hi")}
    calib = (tensors["calib_lo"].to(device), tensors["calib_hi"].to(device)) if "calib_lo" in tensors else None
    restored = pool.restore(PoolSnapshot(entries, blocks, fps, calib))
    pool.check_consistency()
    return restored
