"""Saves and restores the KV pool across restarts: safetensors for tensors, JSON for the rest, no pickles.

One file holds both (the JSON manifest sits in the safetensors header
metadata), so a snapshot is replaced by a single atomic rename: write a temp
file in the same folder, fsync it, rename it over the old one, fsync the
folder. A kill -9 at any moment leaves either the old or the new snapshot.
A missing, truncated, corrupt or foreign (other model, other format) file is
reported and skipped, never fatal; safetensors parses only a JSON header and
raw arrays, so a hostile file cannot run code.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .kv_pool import KVPool, PoolSnapshot

FORMAT = "simllm_ros.kv_pool"
FORMAT_VERSION = 1
FILENAME = "kv_pool.safetensors"
PARTIAL_DIR = ".partial"  # in-progress writes (ours and safetensors' own temp file); cleared at load


def snapshot_path(folder: str) -> str:
    return os.path.join(folder, FILENAME)


def identity(pool: KVPool, model_identity: dict, embedder: str) -> dict:
    return {"format": FORMAT, "version": FORMAT_VERSION, "model": model_identity, "embedder": embedder,
            "kv_bits": pool.kv_bits, "block_tokens": pool.block_tokens,
            "store_dtype": str(pool.store_dtype)}


def save(pool: KVPool, folder: str, ident: dict) -> str:
    snap = pool.snapshot()
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
    """Delete what a save killed midway left behind (only inside our own .partial folder)."""
    partial = os.path.join(folder, PARTIAL_DIR)
    removed = 0
    if os.path.isdir(partial):
        for name in os.listdir(partial):
            try:
                os.unlink(os.path.join(partial, name))
                removed += 1
            except OSError:
                pass
    return removed


class SnapshotSkipped(Exception):
    """The snapshot was not loaded; the message says why (for the log)."""


def load(pool: KVPool, folder: str, ident: dict) -> int:
    """Restore entries into an empty pool; returns how many were restored. Raises SnapshotSkipped."""
    path = snapshot_path(folder)
    remove_partial_writes(folder)
    if not os.path.exists(path):
        raise SnapshotSkipped(f"no snapshot at {path}")
    try:
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
        manifest = json.loads(meta["manifest"])
        tensors = load_file(path)
    except (SafetensorError, OSError, KeyError, ValueError, RuntimeError) as e:
        raise SnapshotSkipped(f"unreadable snapshot {path}: {type(e).__name__}: {e}") from None
    if meta.get("sha256") != checksum(meta["manifest"], tensors):
        raise SnapshotSkipped(f"unreadable snapshot {path}: checksum mismatch (corrupted or not written by this node)")
    got = manifest.get("identity", {}) if isinstance(manifest, dict) else {}
    if got != ident:
        diff = sorted(k for k in set(got) | set(ident) if got.get(k) != ident.get(k))
        raise SnapshotSkipped(f"snapshot {path} is from another setup (differs in: {', '.join(diff) or 'format'})")
    try:
        entries = manifest["entries"]
        fps = tensors["fingerprints"].numpy() if entries else np.zeros((0, 0), np.float32)
        calib = (tensors["calib_lo"], tensors["calib_hi"]) if "calib_lo" in tensors else None
        restored = pool.restore(PoolSnapshot(entries, tensors, fps, calib))
    except (KeyError, ValueError, TypeError, IndexError, RuntimeError) as e:
        pool.clear()
        raise SnapshotSkipped(f"snapshot {path} is inconsistent ({type(e).__name__}: {e}); starting empty") from None
    pool.check_consistency()
    return restored
