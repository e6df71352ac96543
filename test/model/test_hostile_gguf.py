"""Hostile model files (issue 56, G1-G7): each written here from a small real GGUF (random_gguf) with one thing
wrong, and each refused at load with a ModelLoadError naming the problem, within seconds and without a large
allocation; and two files with one name, size and first MiB answering each with its own weights.
"""
import json
import os
import resource
import struct
import time

import numpy as np
import pytest
import torch

from random_gguf import write_llama
from simllm_ros.model import file_digest, gguf_weights, template_box
from simllm_ros.model.model_backend import ModelBackend
from simllm_ros.model.model_files import ModelLoadError

SMALL = dict(layers=2, hidden=128, inter=256, heads=4, kv_heads=2, default="Q8_0", embed="Q8_0", output="Q8_0")
QUICK_S = 10.0  # a refusal reads the header only: well under a second alone, this leaves room for a shared machine
PEAK_MB = 200  # what a refusal may add to the process's peak memory
CONVERSION_S = 120.0  # a refusal at the conversion: transformers reads the file's tokenizer twice first (~5-40 s)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return write_llama(str(tmp_path_factory.mktemp("good") / "rand-small.gguf"), **SMALL)


def copy_of(src: str, dst) -> str:
    with open(src, "rb") as f, open(dst, "wb") as g:
        g.write(f.read())
    return str(dst)


def key_value_at(path: str, key: str) -> int:
    """Where the value type of metadata `key` is in the file (its value follows)."""
    with open(path, "rb") as f:
        head = f.read(8 << 20)
    enc = key.encode()
    at = head.index(struct.pack("<Q", len(enc)) + enc)
    return at + 8 + len(enc)


def tensor_info_at(path: str, name: str) -> int:
    """Where tensor `name`'s dimension count is in the header (dims, shape, type, offset follow)."""
    with open(path, "rb") as f:
        head = f.read(8 << 20)
    enc = name.encode()
    at = head.rindex(struct.pack("<Q", len(enc)) + enc)  # the tensor infos come after the metadata
    return at + 8 + len(enc)


def patch(path: str, at: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)


def tensor_data_at(path: str, name: str) -> int:
    """Where tensor `name`'s data starts (`path` a copy of the good file, read before it is damaged)."""
    return next(t.offset for t in gguf_weights.read_header(path)[1] if t.name == name)


def refused(path: str, tmp_path, match: str, dtype: str = "float32", bits: int = 0, quick_s: float = QUICK_S) -> str:
    """The load of `path` fails with a ModelLoadError matching `match`, in QUICK_S and within PEAK_MB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    with pytest.raises(ModelLoadError, match=match) as exc:
        ModelBackend(path, dtype=dtype, weight_bits=bits, cache_dir=str(tmp_path / "models"))
    took = time.monotonic() - t0
    assert took < quick_s, f"{took:.1f} s: {exc.value}"
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) / 1024 < PEAK_MB
    return str(exc.value)


def last_logits(b: ModelBackend) -> torch.Tensor:
    ids = [1, 17, 250, 3001, 42, 9]
    return b.run(ids, b.new_cache(len(ids) + 2), logits="last")


# ------------------------------------------------------------------------------------------------ G1
def test_two_files_with_one_name_size_and_first_mib_answer_each_with_their_own_weights(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = write_llama(str(tmp_path / "a" / "ggml-model-Q8_0.gguf"), seed=1, **SMALL)
    b = write_llama(str(tmp_path / "b" / "ggml-model-Q8_0.gguf"), seed=2, **SMALL)
    with open(a, "rb") as fa, open(b, "rb") as fb:
        da, db = fa.read(), fb.read()
    assert len(da) == len(db) and da[:1 << 20] == db[:1 << 20] and da != db  # what the old key could not tell apart
    alone = last_logits(ModelBackend(b, dtype="float32", weight_bits=0, cache_dir=str(tmp_path / "alone")))
    cache = str(tmp_path / "models")
    logits_a = last_logits(ModelBackend(a, dtype="float32", weight_bits=0, cache_dir=cache))
    said: list[str] = []
    second = ModelBackend(b, dtype="float32", weight_bits=0, cache_dir=cache, progress=said.append)
    assert any("converting" in m for m in said), said  # not the first file's copy
    assert torch.equal(last_logits(second), alone)  # b's own weights, as a load that never saw a
    assert not torch.equal(logits_a, alone)


def test_an_unchanged_file_is_not_read_again_for_its_digest(good, tmp_path, monkeypatch):
    record = str(tmp_path / "record")
    digest = file_digest.content_digest(good, record)
    file_digest._MEMO.clear()  # a later process: only the record is left

    def no_rehash(fd):
        raise AssertionError("the unchanged file was hashed again")

    monkeypatch.setattr(file_digest, "whole_digest", no_rehash)
    assert file_digest.content_digest(good, record) == digest
    monkeypatch.undo()
    changed = copy_of(good, tmp_path / "changed.gguf")
    with open(changed, "r+b") as f:  # one byte of the last tensor's data, same size
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    os.utime(changed, ns=(os.stat(good).st_atime_ns, os.stat(good).st_mtime_ns))
    os.replace(changed, str(tmp_path / "same.gguf"))
    copy_of(good, tmp_path / "same-before.gguf")
    assert file_digest.content_digest(str(tmp_path / "same-before.gguf"), record) == digest
    os.replace(str(tmp_path / "same.gguf"), str(tmp_path / "same-before.gguf"))  # replaced under one path
    assert file_digest.content_digest(str(tmp_path / "same-before.gguf"), record) != digest


# ------------------------------------------------------------------------------------------------ G2
@pytest.mark.parametrize("name,dtype,bits", [("output_norm.weight", "float32", 0),
                                             ("blk.1.ffn_up.weight", "float32", 0),
                                             ("blk.1.ffn_up.weight", "bfloat16", 16)])  # the dense conversion's
def test_a_missing_tensor_is_refused_by_name(good, tmp_path, name, dtype, bits):
    path = copy_of(good, tmp_path / "missing.gguf")
    at = tensor_info_at(path, name)
    other = name[:-len(".weight") - 1] + "X.weight"  # the same length: the header stays whole, the tensor is gone
    patch(path, at - len(name), other.encode())
    refused(path, tmp_path, f"lacks the tensor {name}", dtype, bits)


def test_a_transposed_tensor_is_refused_by_name(good, tmp_path):
    path = copy_of(good, tmp_path / "transposed.gguf")
    at = tensor_info_at(path, "blk.0.ffn_up.weight")
    assert struct.unpack_from("<IQQ", open(path, "rb").read(), at) == (2, 128, 256)
    patch(path, at + 4, struct.pack("<QQ", 256, 128))
    refused(path, tmp_path, r"blk\.0\.ffn_up\.weight is \[128, 256\], not \[256, 128\]")


# ------------------------------------------------------------------------------------------------ G3
@pytest.mark.parametrize("name,value", [("blk.0.attn_q.weight", np.nan), ("output.weight", np.inf)])
def test_a_non_finite_block_scale_is_refused_by_name(good, tmp_path, name, value):
    path = copy_of(good, tmp_path / "scale.gguf")
    at = tensor_data_at(path, name) + 34 * 3  # the fourth Q8_0 block's float16 d
    patch(path, at, np.array([value], dtype=np.float16).tobytes())
    # found as the blocks are checked at the conversion, after the file's config and tokenizer are read
    refused(path, tmp_path, f"tensor {name}'s Q8_0 block scales holds non-finite values", quick_s=CONVERSION_S)


def test_a_nan_norm_is_refused_by_name(good, tmp_path):
    path = copy_of(good, tmp_path / "norm.gguf")
    patch(path, tensor_data_at(path, "blk.1.attn_norm.weight") + 4 * 7, np.array([np.nan], np.float32).tobytes())
    refused(path, tmp_path, r"tensor blk\.1\.attn_norm\.weight holds non-finite values")


@pytest.mark.parametrize("key,value,match", [("llama.rope.freq_base", np.nan, "is nan"),
                                             ("llama.rope.freq_base", -1.0, "is -1.0, not a positive RoPE base"),
                                             ("llama.attention.layer_norm_rms_epsilon", np.inf, "is inf"),
                                             ("llama.attention.layer_norm_rms_epsilon", 0.0, "is 0.0, not an epsilon")])
def test_non_finite_or_out_of_range_metadata_is_refused_by_name(good, tmp_path, key, value, match):
    path = copy_of(good, tmp_path / "meta.gguf")
    at = key_value_at(path, key)
    assert struct.unpack_from("<I", open(path, "rb").read(), at)[0] == 6  # float32
    patch(path, at + 4, struct.pack("<f", value))
    refused(path, tmp_path, f"metadata {key} {match}")


# ------------------------------------------------------------------------------------------------ G4
def _offset_at(path: str, name: str) -> int:
    at = tensor_info_at(path, name)
    dims = struct.unpack_from("<I", open(path, "rb").read(), at)[0]
    return at + 4 + 8 * dims + 4


def test_a_misaligned_tensor_offset_is_refused(good, tmp_path):
    path = copy_of(good, tmp_path / "misaligned.gguf")
    at = _offset_at(path, "blk.0.attn_k.weight")
    (offset,) = struct.unpack_from("<Q", open(path, "rb").read(), at)
    patch(path, at, struct.pack("<Q", offset + 2))
    refused(path, tmp_path, r"blk\.0\.attn_k\.weight's data offset \d+ is not a multiple of general\.alignment 32")


def test_overlapping_tensors_are_refused(good, tmp_path):
    path = copy_of(good, tmp_path / "overlap.gguf")
    head = open(path, "rb").read()
    (q_offset,) = struct.unpack_from("<Q", head, _offset_at(path, "blk.0.attn_q.weight"))
    patch(path, _offset_at(path, "blk.0.attn_v.weight"), struct.pack("<Q", q_offset))  # v's bytes are q's
    refused(path, tmp_path, r"tensors blk\.0\.attn_\w\.weight and blk\.0\.attn_\w\.weight overlap")


def test_a_tensor_past_the_end_is_refused(good, tmp_path):
    path = copy_of(good, tmp_path / "past.gguf")
    patch(path, _offset_at(path, "blk.1.ffn_down.weight"), struct.pack("<Q", 1 << 40))
    refused(path, tmp_path, r"truncated: tensor blk\.1\.ffn_down\.weight needs bytes up to")


# ------------------------------------------------------------------------------------------------ G5
LOOPING = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
HUGE = "{{ 'x' * 20000000 }}"


@pytest.mark.parametrize("template,match", [(LOOPING, "took more than"), (HUGE, "renders 20000000 characters")])
def test_a_chat_template_past_its_budget_is_refused_at_load(tmp_path, template, match):
    path = write_llama(str(tmp_path / "template.gguf"), chat_template=template, **SMALL)
    t0 = time.monotonic()
    with pytest.raises(ModelLoadError, match=f"chat template of model '{path}' is refused: .*{match}"):
        ModelBackend(path, dtype="float32", weight_bits=0, cache_dir=str(tmp_path / "models"))
    budget = template_box.START_SECONDS + template_box.TEMPLATE_SECONDS
    assert time.monotonic() - t0 < budget + 60  # the conversion, then the box's own deadlines


def test_a_template_within_its_budget_renders_as_before_and_is_remembered(good, tmp_path):
    b = ModelBackend(good, dtype="float32", weight_bits=0, cache_dir=str(tmp_path / "models"))
    ids = b.prompt_ids("sys", "", "hello")
    assert b.tokenizer.decode(ids).count("hello") == 1
    with open(tmp_path / "models" / template_box.CHECKED_FILE) as f:
        assert list(json.load(f).values()) == [True]  # a later process's load does not render it again


# ------------------------------------------------------------------------------------------------ G6
@pytest.mark.parametrize("key,value,match", [
    ("llama.block_count", 1000, "block_count is 1000 but the file has no tensors of layer 2"),
    ("llama.attention.head_count", 0, "head_count is 0, outside"),
    ("llama.attention.head_count_kv", 0, "head_count_kv is 0, outside"),
    ("llama.attention.head_count_kv", 3, "head_count 4 is not a multiple of head_count_kv 3"),
    ("llama.context_length", 1 << 31, "context_length is 2147483648, outside"),
    ("llama.embedding_length", 0, "embedding_length is 0, outside")])
def test_counts_out_of_range_are_refused_at_once(good, tmp_path, key, value, match):
    path = copy_of(good, tmp_path / "counts.gguf")
    at = key_value_at(path, key)
    assert struct.unpack_from("<I", open(path, "rb").read(), at)[0] == 4  # uint32
    patch(path, at + 4, struct.pack("<I", value))
    refused(path, tmp_path, match)


# ------------------------------------------------------------------------------------------------ G7
@pytest.mark.parametrize("shape,match", [((128, 1 << 57), "needs more bytes than the file's"),  # 2^64 elements
                                         ((128, 1 << 61), "needs more bytes than the file's"),
                                         ((128, 0), r"has a dimension of 0")])
def test_wrapping_or_zero_dims_are_refused_by_name(good, tmp_path, shape, match):
    path = copy_of(good, tmp_path / "dims.gguf")
    patch(path, tensor_info_at(path, "blk.0.attn_q.weight") + 4, struct.pack("<QQ", *shape))
    refused(path, tmp_path, r"tensor blk\.0\.attn_q\.weight .*" + match)


def test_a_huge_dimension_count_is_refused_by_name(good, tmp_path):
    path = copy_of(good, tmp_path / "ndims.gguf")
    patch(path, tensor_info_at(path, "blk.0.attn_q.weight"), struct.pack("<I", 2**32 - 1))
    refused(path, tmp_path, r"tensor blk\.0\.attn_q\.weight has 4294967295 dimensions")


def test_alignment_zero_is_refused(tmp_path):
    path = write_llama(str(tmp_path / "align0.gguf"), metadata={"general.alignment": 0}, **SMALL)
    refused(path, tmp_path, r"general\.alignment 0 is not a power of two")


@pytest.mark.parametrize("key,etype,match", [("general.architecture", None, "unknown value type 13"),
                                             ("tokenizer.ggml.tokens", 9, "an array of arrays"),
                                             ("tokenizer.ggml.tokens", 13, "an array of an unknown value type 13")])
def test_unknown_value_types_are_refused_by_name(good, tmp_path, key, etype, match):
    path = copy_of(good, tmp_path / "vtype.gguf")
    at = key_value_at(path, key)
    if etype is None:
        patch(path, at, struct.pack("<I", 13))
    else:
        assert struct.unpack_from("<II", open(path, "rb").read(), at) == (9, 8)  # an array of strings
        patch(path, at + 4, struct.pack("<I", etype))
    refused(path, tmp_path, f"metadata {key} .*{match}")


@pytest.mark.parametrize("kind,match", [("dir", "a directory, not a regular file"),
                                        ("fifo", "FIFO, not a regular file"),
                                        ("loop", "symlink loop")])
def test_a_gguf_name_that_is_not_a_regular_file_is_named(tmp_path, kind, match):
    path = str(tmp_path / "model.gguf")
    if kind == "dir":
        os.mkdir(path)
    elif kind == "fifo":
        os.mkfifo(path)  # an open would block for ever
    else:
        os.symlink(str(tmp_path / "other.gguf"), path)
        os.symlink(path, str(tmp_path / "other.gguf"))
    refused(path, tmp_path, f"model file '{path}' .*{match}")
