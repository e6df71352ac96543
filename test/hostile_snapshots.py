"""Hostile pool snapshots, each made from a real snapshot file: what an attacker or an unlucky operator
could leave at persist_path/kv_pool.safetensors.

`VARIANTS` is a list of (name, make) where make(folder, good) builds the variant in `folder` from the
good snapshot file `good`. Manifest edits recompute the (key-less) sha256, as an attacker would, so the
value checks behind the checksum are what is exercised. Used by test_persistence.py (engine level) and
test_reliability_hostile.py (through the real node).
"""
from __future__ import annotations

import json
import os
import re
import socket
import struct

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from simllm_ros.cache import persistence


def target(folder) -> str:
    return persistence.snapshot_path(str(folder))


def read_good(good: str) -> tuple[dict, dict]:
    with safe_open(good, framework="pt") as f:
        meta = f.metadata()
    return json.loads(meta["manifest"]), load_file(good)


def write_snapshot(path: str, manifest_text: str, tensors: dict, fix_checksum: bool = True) -> None:
    meta = {"manifest": manifest_text}
    if fix_checksum:
        meta["sha256"] = persistence.checksum(manifest_text, tensors)
    if os.path.lexists(path):
        os.unlink(path)
    save_file({k: t.contiguous() for k, t in tensors.items()}, path, metadata=meta)


def edit(mutate_manifest=None, mutate_tensors=None, raw_text=None, fix_checksum=True):
    """A variant that edits the manifest (a dict, or its JSON text via raw_text) and/or the tensors."""
    def make(folder, good):
        manifest, tensors = read_good(good)
        if mutate_manifest:
            mutate_manifest(manifest)
        if mutate_tensors:
            mutate_tensors(tensors)
        text = json.dumps(manifest)  # writes Infinity / NaN for non-finite floats, as Python's json does
        if raw_text:
            text = raw_text(text)
        write_snapshot(target(folder), text, tensors, fix_checksum)
    return make


def first_hits(literal):
    """Replace the first entry's hits with a literal JSON token (1e400, NaN, ...)."""
    return lambda text: re.sub(r'"hits": -?\d+', f'"hits": {literal}', text, count=1)


def entry_value(field, value, index=0):
    def m(man):
        man["entries"][index][field] = value
    return edit(m)


def raw_file(data_fn):
    def make(folder, good):
        with open(good, "rb") as f:
            data = f.read()
        with open(target(folder), "wb") as f:
            f.write(data_fn(data))
    return make


def with_header(header_fn):
    """Rewrite the safetensors JSON header itself (keeps the data bytes)."""
    def fn(data):
        n = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8:8 + n])
        header = header_fn(header)
        text = json.dumps(header).encode()
        return struct.pack("<Q", len(text)) + text + data[8 + n:]
    return raw_file(fn)


def _overlap(h):
    names = [k for k in h if k != "__metadata__"]
    a, b = names[0], names[1]
    h[b]["data_offsets"] = list(h[a]["data_offsets"])
    h[b]["shape"], h[b]["dtype"] = h[a]["shape"], h[a]["dtype"]
    return h


def _negative_shape(h):
    name = next(k for k in h if k != "__metadata__")
    h[name]["shape"] = [-1] + h[name]["shape"][1:]
    return h


def _unknown_dtype(h):
    name = next(k for k in h if k != "__metadata__")
    h[name]["dtype"] = "F128"
    return h


def huge_header_claim(folder, good):
    with open(target(folder), "wb") as f:
        f.write(struct.pack("<Q", 2**62) + b"{}")


def huge_header_real(folder, good):
    """A genuine 70 MB header (valid JSON padded with spaces): refused by size before parsing."""
    text = b'{"__metadata__": {"manifest": "{}"}}' + b" " * (70 * 2**20)
    with open(target(folder), "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)


def deep_nesting(folder, good):
    _, tensors = read_good(good)
    write_snapshot(target(folder), "[" * 200_000 + "]" * 200_000, tensors)


def duplicate_entry(folder, good):
    manifest, tensors = read_good(good)
    manifest["entries"].append(dict(manifest["entries"][0]))
    fps = tensors["fingerprints"]
    tensors["fingerprints"] = torch.cat([fps, fps[:1]])
    write_snapshot(target(folder), json.dumps(manifest), tensors)


def fifo(folder, good):
    os.mkfifo(target(folder))


def symlink_loop(folder, good):
    os.symlink(persistence.FILENAME, target(folder))  # points at itself


def symlink_loop_pair(folder, good):
    os.symlink("b", os.path.join(str(folder), "a"))
    os.symlink("a", os.path.join(str(folder), "b"))
    os.symlink("a", target(folder))


def dangling_symlink(folder, good):
    os.symlink(os.path.join(str(folder), "nowhere"), target(folder))


def directory(folder, good):
    os.mkdir(target(folder))


def char_device(folder, good):
    os.symlink("/dev/zero", target(folder))


def random_device(folder, good):
    os.symlink("/dev/urandom", target(folder))


def symlink_to_fifo(folder, good):
    os.mkfifo(os.path.join(str(folder), "pipe"))
    os.symlink("pipe", target(folder))


def unix_socket(folder, good):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(target(folder))
    s.close()  # the socket file stays


def unreadable(folder, good):
    raw_file(lambda d: d)(folder, good)
    os.chmod(target(folder), 0)


def partial_symlink(folder, good):
    """`.partial` planted as a symlink to a folder with a precious file: load must not delete it, and the
    (otherwise good) snapshot still loads. Listed with the variants but expected to load."""
    victim = os.path.join(str(folder), "victim")
    os.mkdir(victim)
    with open(os.path.join(victim, "precious.txt"), "w") as f:
        f.write("keep me")
    os.symlink(victim, os.path.join(str(folder), persistence.PARTIAL_DIR))
    raw_file(lambda d: d)(folder, good)


def foreign_identity(field, value):
    def m(man):
        man["identity"][field] = value
    return edit(m)


def _nan_k(ts):
    """NaN in the keys (float KV) or in their scales (8-bit KV)."""
    name = "k_scale" if ts["k"].dtype == torch.uint8 else "k"
    ts[name].view(-1)[0] = float("nan")


def _inf_v(ts):
    name = "v_zero" if ts["v"].dtype == torch.uint8 else "v"
    ts[name].view(-1)[-1] = float("inf")


VARIANTS = [
    # non-finite and out-of-range manifest values (checksum recomputed)
    ("hits_infinity", entry_value("hits", float("inf"))),
    ("hits_nan", entry_value("hits", float("nan"))),
    ("hits_minus_1e12", entry_value("hits", -1e12)),
    ("hits_negative", entry_value("hits", -1)),
    ("hits_1e400", edit(raw_text=first_hits("1e400"))),
    ("hits_2_pow_64", entry_value("hits", 2**64)),
    ("hits_float", entry_value("hits", 2.5)),
    ("hits_string", entry_value("hits", "7")),
    ("hits_bool", entry_value("hits", True)),
    ("last_used_infinity", entry_value("last_used", float("inf"))),
    ("last_used_negative", entry_value("last_used", -5.0)),
    ("last_used_1e300", entry_value("last_used", 1e300)),
    ("created_nan", entry_value("created", float("nan"))),
    ("created_string", entry_value("created", "yesterday")),
    ("token_negative", edit(lambda m: m["entries"][0]["tokens"].__setitem__(3, -1))),
    ("token_past_vocab", edit(lambda m: m["entries"][0]["tokens"].__setitem__(3, m["identity"]["model"]["vocab"]))),
    ("token_2_pow_63", edit(lambda m: m["entries"][0]["tokens"].__setitem__(3, 2**63))),
    ("token_float", edit(lambda m: m["entries"][0]["tokens"].__setitem__(3, 1.0))),
    ("tokens_empty", entry_value("tokens", [])),
    ("rows_too_many", edit(lambda m: m["entries"][0]["rows"].append(0))),
    ("rows_past_end", edit(lambda m: m["entries"][1]["rows"].__setitem__(-1, 10_000))),
    ("rows_null", entry_value("rows", None)),
    ("scope_with_space", entry_value("scope", "kiosk 3")),
    ("scope_empty", entry_value("scope", "")),
    ("scope_10k_chars", entry_value("scope", "x" * 10_000)),
    ("scope_not_string", entry_value("scope", 42)),
    ("digest_not_hex", entry_value("context_digest", "zz" * 16)),
    ("question_null", entry_value("question", None)),
    ("answer_number", entry_value("answer", 42)),
    ("entry_missing_hits", edit(lambda m: m["entries"][0].pop("hits"))),
    ("entry_extra_key", edit(lambda m: m["entries"][0].__setitem__("__class__", "os.system"))),
    ("entry_not_object", edit(lambda m: m["entries"].__setitem__(0, [1, 2, 3]))),
    ("entries_not_list", edit(lambda m: m.__setitem__("entries", {"0": 1}))),
    ("duplicate_entry", duplicate_entry),
    ("manifest_is_list", edit(raw_text=lambda t: "[" + t + "]")),
    ("manifest_nan_literal", edit(raw_text=first_hits("NaN"))),
    ("manifest_deep_nesting", deep_nesting),
    # foreign identity
    ("identity_other_model", foreign_identity("model", {"model": "someone/else", "vocab": 10})),
    ("identity_other_kv_bits", edit(lambda m: m["identity"].__setitem__("kv_bits", 16 if m["identity"]["kv_bits"] == 8 else 8))),
    ("identity_other_format", foreign_identity("format", "evil.pool")),
    ("identity_missing", edit(lambda m: m.pop("identity"))),
    # tensors inconsistent with the manifest or the pool
    ("fingerprints_nan", edit(mutate_tensors=lambda ts: ts["fingerprints"].__setitem__((0, 0), float("nan")))),
    ("fingerprints_zero", edit(mutate_tensors=lambda ts: ts["fingerprints"].__setitem__(1, 0.0))),
    ("fingerprints_wrong_dim", edit(mutate_tensors=lambda ts: ts.__setitem__("fingerprints", ts["fingerprints"][:, :100]))),
    ("kv_nan", edit(mutate_tensors=_nan_k)),
    ("kv_inf", edit(mutate_tensors=_inf_v)),
    ("kv_wrong_dtype", edit(mutate_tensors=lambda ts: ts.__setitem__("k", ts["k"].double()))),
    ("kv_wrong_shape", edit(mutate_tensors=lambda ts: ts.__setitem__("k", ts["k"][:, :, :, :8]))),
    ("tensor_extra", edit(mutate_tensors=lambda ts: ts.__setitem__("payload", torch.zeros(4)))),
    ("tensor_missing_v", edit(mutate_tensors=lambda ts: ts.pop("v"))),
    # the container itself
    ("header_offsets_overlap", with_header(_overlap)),
    ("header_negative_shape", with_header(_negative_shape)),
    ("header_unknown_dtype", with_header(_unknown_dtype)),
    ("header_not_json", raw_file(lambda d: d[:8] + b"\xff" * (len(d) - 8))),
    ("header_is_array", raw_file(lambda d: struct.pack("<Q", 2) + b"[]")),
    ("huge_header_claim", huge_header_claim),
    ("huge_header_real", huge_header_real),
    ("truncated", raw_file(lambda d: d[:int(len(d) * 0.6)])),
    ("empty_file", raw_file(lambda d: b"")),
    ("seven_bytes", raw_file(lambda d: d[:7])),
    ("checksum_missing", edit(raw_text=first_hits("5"), fix_checksum=False)),
    # what sits at the path is not a regular file
    ("fifo", fifo),
    ("symlink_to_fifo", symlink_to_fifo),
    ("symlink_loop", symlink_loop),
    ("symlink_loop_pair", symlink_loop_pair),
    ("dangling_symlink", dangling_symlink),
    ("directory", directory),
    ("char_device_dev_zero", char_device),
    ("char_device_dev_urandom", random_device),
    ("unix_socket", unix_socket),
]
if os.geteuid() != 0:  # root reads a mode-000 file
    VARIANTS.append(("unreadable_mode_000", unreadable))

def symlink_to_good(folder, good):
    raw_file(lambda d: d)(folder, good)
    os.rename(target(folder), os.path.join(str(folder), "real.safetensors"))
    os.symlink("real.safetensors", target(folder))


# Not refused, but must do no harm: the good snapshot loads, nothing outside .partial is deleted.
HARMLESS = [("partial_is_symlink", partial_symlink), ("symlink_to_good_snapshot", symlink_to_good)]
