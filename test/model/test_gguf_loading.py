"""A user's GGUF, loading (issue 30, item 4): the first load converts a tensor at a time and ends as a later load
does, later loads take the checked and packed blocks without dense weights, kept rows and load checks are used only
for the same file and numerics, and a damaged, truncated or unfitting file is a clear load error. The tokenizers
converted from a file encode as transformers' own. Files: test/gguf_files.py (random weights, no download)."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from gguf_files import file_backend, whole_backend
from random_gguf import Q4_K_M, write_llama
from simllm_ros.model import gguf_weights
from simllm_ros.kernels import int4_vector_kernel
from simllm_ros.model.model_backend import ModelBackend
from simllm_ros.model.model_files import ModelLoadError

KERNEL = int4_vector_kernel.load()
pytestmark = pytest.mark.skipif(KERNEL is None, reason=f"vector kernel: {int4_vector_kernel.why_not()}")


def test_an_engines_first_load_of_a_gguf_ends_as_a_later_load(files, tmp_path):
    """A float32 load of a GGUF converted whole before (for a bf16 load here) reads the copy's dense weights, to check
    the file's blocks against them and pack them; the engine then loads again from the blocks it kept, so the node
    runs at a later load's footprint: on the skeleton, computing the bits of a first-load backend. A later engine
    load checks and reloads nothing."""
    from simllm_ros.serving.engine import Engine
    from simllm_ros.settings import Settings

    cache = str(tmp_path / "models")
    said: list[str] = []
    dense = ModelBackend(files["qwen2"], dtype="bfloat16", weight_bits=16, cache_dir=cache, progress=said.append)
    assert any(m.startswith("converting rand-qwen2.gguf to safetensors once") for m in said) and dense.runner is not None
    del dense
    settings = Settings.from_overrides(model=files["qwen2"], model_cache_dir=cache, dtype="float32", weight_bits=0,
                                       cache_size="64MB")
    for first in (True, False):
        said = []
        e = Engine(settings)
        e.load(progress=said.append)
        try:
            assert not any(m.startswith("converting") for m in said), said
            assert any(m.startswith("loading again") for m in said) == first, said
            b = e.backend
            assert b.skeleton and not b.reload_lighter and type(b.model).__module__ == "simllm_ros.model.skeleton"
            ref = file_backend(files, "qwen2")
            ids = b.prompt_ids("", "The charging dock is in room 12.", "Where is the charging dock?")
            ours, theirs = (x.run(ids, x.new_cache(len(ids) + 2), logits="all") for x in (b, ref))
            assert torch.equal(ours, theirs)
        finally:
            e.unload()


def test_a_truncated_gguf_is_a_clear_load_error(tmp_path):
    path = write_llama(str(tmp_path / "cut.gguf"), layers=1, truncate=4096)
    with pytest.raises(ModelLoadError, match="truncated"):
        ModelBackend(path, dtype="float32", weight_bits=0, cache_dir=str(tmp_path / "models"))


def test_a_gguf_with_an_unknown_tensor_type_is_a_clear_load_error(tmp_path):
    from random_gguf import write_llama

    path = write_llama(str(tmp_path / "rand-odd.gguf"), layers=1, types=Q4_K_M)
    t = gguf.GGUFReader(path).tensors[0]
    at = t.field.offset + 8 + len(t.name.encode()) + 4 + 8 * len(t.shape)  # name, dims, shape: then the type
    with open(path, "r+b") as f:
        f.seek(at)
        assert int.from_bytes(f.read(4), "little") == int(t.tensor_type)
        f.seek(at)
        f.write((99).to_bytes(4, "little"))
    with pytest.raises(ModelLoadError, match=f"tensor {t.name} has an unknown type 99"):
        ModelBackend(path, dtype="float32", weight_bits=0, cache_dir=str(tmp_path / "models"))


@pytest.mark.parametrize("dtype,bits", [("float32", 0), ("bfloat16", 16)])
def test_a_gguf_whose_tokenizer_outgrows_its_embedding_is_a_clear_load_error(tmp_path, dtype, bits):
    """A token embedding of fewer rows than the tokenizer has tokens (the parts of two files put together) is
    refused at load, as llama.cpp refuses it, rather than failing on the first request with a rare token; more rows
    than tokens (padded vocabularies, as Qwen's) load."""
    from random_gguf import write_llama

    short = write_llama(str(tmp_path / "rand-short.gguf"), layers=1, types=Q4_K_M, vocab=48000)
    with pytest.raises(ModelLoadError, match="49152 tokens but its token embedding 48000 rows"):
        ModelBackend(short, dtype=dtype, weight_bits=bits, cache_dir=str(tmp_path / "models"))
    padded = write_llama(str(tmp_path / "rand-padded.gguf"), layers=1, types=Q4_K_M, vocab=50000)
    b = ModelBackend(padded, dtype=dtype, weight_bits=bits, cache_dir=str(tmp_path / "models"))
    assert b.run([5, len(b.tokenizer) - 1], b.new_cache(4), logits="last").shape == (50000,)


def test_a_second_load_takes_the_checked_blocks_without_the_dense_weights(files):
    """The first load checks the file's blocks against its dequantized weights and keeps what it found (row orders)
    beside the converted model; the next load builds the model without its dense projection weights and takes the
    blocks again: the same bits, at a fraction of the memory."""
    import os

    from simllm_ros.model.model_files import conversion_stamp

    first = file_backend(files, "q4_k_m")
    folder = first._path
    assert os.path.isfile(os.path.join(folder, gguf_weights.ROWS_FILE))
    rows = gguf_weights.load_rows(folder, conversion_stamp(files["q4_k_m"]))
    assert rows is not None and rows.head and any(k.endswith("attn_q.weight") for k in rows.perms)  # q/k permuted
    second = ModelBackend(files["q4_k_m"], dtype="float32", weight_bits=0, cache_dir=files["cache"])
    assert second.skeleton and second.runner.file is not None and second.weight_bits == 4
    assert type(second.model).__module__ == "simllm_ros.model.skeleton"  # built without transformers' model classes
    # the token embedding is looked up from the file's Q4_K blocks; its float32 copy was never loaded
    assert rows.embed and isinstance(second.runner.embed, gguf_weights.FileEmbedding)
    assert second.model.model.embed_tokens.weight.numel() == 0 and "token embedding Q4_K" in second.int4_path
    ids = [int(t) for t in range(500, 500 + 21 * 37, 37)]
    assert torch.equal(first.run(ids, first.new_cache(24), logits="all"),
                       second.run(ids, second.new_cache(24), logits="all"))
    assert second.numerics == first.numerics and second.exact_chunking


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_a_second_load_of_qwen_files_computes_the_first_loads_bits(files, name):
    """Qwen2's q/k/v biases and Qwen3's per-head q/k norms on the skeleton (skeleton.py, not transformers' classes):
    the same logits as the first load's transformers model, and the same RoPE re-rotation SEMANTIC reuse uses."""
    first = whole_backend(files, name)
    second = ModelBackend(files[name], dtype="float32", weight_bits=0, cache_dir=files["cache"])
    assert second.skeleton and type(second.model).__module__ == "simllm_ros.model.skeleton"
    assert type(first.model).__module__.startswith("transformers.")
    if name == "qwen2":
        assert second.model.model.layers[0].self_attn.q_proj.bias is not None
        assert second.model.model.layers[0].self_attn.o_proj.bias is None
    else:
        assert second.runner.qk_norms[0] is not None
    ids = [int(t) for t in range(300, 300 + 19 * 41, 41)]
    assert torch.equal(first.run(ids, first.new_cache(24), logits="all"),
                       second.run(ids, second.new_cache(24), logits="all"))
    k = torch.randn(2, 2, 5, second.kv_shape.head_dim, generator=torch.Generator().manual_seed(3))
    delta = torch.tensor([1, 7, -3, 40, 0])
    assert torch.equal(first.rotate_keys(k, delta), second.rotate_keys(k, delta))
    assert second.numerics == first.numerics and second.stop_ids == first.stop_ids


def test_kept_rows_of_another_or_a_damaged_file_are_not_used(files, tmp_path):
    from simllm_ros.model.model_files import conversion_stamp

    b = file_backend(files, "q8_0")
    folder = b._path
    stamp = conversion_stamp(files["q8_0"])
    assert gguf_weights.load_rows(folder, stamp) is not None
    assert gguf_weights.load_rows(folder, dict(stamp, size=stamp["size"] + 1)) is None  # another file's content
    import shutil

    damaged = tmp_path / "copy"
    shutil.copytree(folder, damaged)
    p = damaged / gguf_weights.ROWS_FILE
    kept = gguf_weights.load_rows(folder, stamp)
    assert kept.perms, "the Llama file's q and k rows are permuted"
    name, perm = next(iter(kept.perms.items()))
    broken = perm.clone()
    broken[1] = broken[0]  # a whole, readable file whose row order is not one
    gguf_weights.save_rows(str(damaged), gguf_weights.Rows(stamp, {**kept.perms, name: broken}, kept.head, kept.embed))
    assert gguf_weights.load_rows(str(damaged), stamp) is None
    p.write_bytes(p.read_bytes()[:40])
    assert gguf_weights.load_rows(str(damaged), stamp) is None


def test_load_checks_are_kept_only_for_the_same_numerics(files, monkeypatch):
    """The load-time checks (invariance probe, single rows, pass costs) are kept under a key of everything that
    decides them, and taken only when the digest computed again matches: a record whose digest differs is measured
    again (shown by a doctored record: its 'exact: false' is ignored)."""
    import json
    import os

    from simllm_ros.model import load_checks, model_backend

    b = file_backend(files, "q8_0")
    store = os.path.join(files["cache"], load_checks.LOAD_CHECKS_FILE)
    data = json.loads(open(store).read())
    key = next(k for k, v in data.items() if v["digest"] == b.numerics and "exact" in v)
    for digest, want_exact in (("0" * 16, True), (b.numerics, False)):
        data[key] = dict(data[key], exact=False, digest=digest)
        with open(store, "w") as f:
            json.dump(data, f)
        monkeypatch.setattr(model_backend, "_PROBED", {})
        again = ModelBackend(files["q8_0"], dtype="float32", weight_bits=0, cache_dir=files["cache"])
        assert again.exact_chunking is want_exact, digest
        data = json.loads(open(store).read())
    # Another thread count: the bits are the kernels' whatever the threads (the doctored record, same digest, is
    # taken), and the pass costs (timings, never a token) start from those of the nearest thread count kept, timed
    # after the load (time_pass_costs: the engine's thread, in the model's turns) and kept under their own key.
    threads = torch.get_num_threads()
    other = 1 if threads > 1 else 2
    b.time_pass_costs()  # where this process's loads of it took a prior (a backend without an engine times none)
    monkeypatch.setattr(model_backend, "_PROBED", {})
    data = json.loads(open(store).read())
    data = {k: v for k, v in data.items() if not k.startswith(f"{key}/") or k == f"{key}/threads={threads}"}
    with open(store, "w") as f:
        json.dump(data, f)
    torch.set_num_threads(other)
    try:
        again = ModelBackend(files["q8_0"], dtype="float32", weight_bits=0, cache_dir=files["cache"])
        assert again.exact_chunking is False and again.numerics == b.numerics
        assert list(again.pass_costs) == data[f"{key}/threads={threads}"]["costs"] == list(b.pass_costs), \
            "the prior: the costs timed at another thread count"
        assert f"{key}/threads={other}" not in json.loads(open(store).read()), "nothing timed in the load"
        assert again.time_pass_costs() and not again.time_pass_costs(), "timed once"
    finally:
        torch.set_num_threads(threads)
    data = json.loads(open(store).read())
    assert data[f"{key}/threads={other}"] == {"digest": b.numerics, "costs": list(again.pass_costs)}
    assert data[f"{key}/threads={threads}"]["digest"] == b.numerics  # each thread count's costs apart
    assert model_backend._PROBED[next(iter(model_backend._PROBED))][2] == list(again.pass_costs)  # this process's
    data[key] = dict(data[key], exact=True)  # leave the true record for later loads
    with open(store, "w") as f:
        json.dump(data, f)


def test_the_file_embedding_is_the_files_rows(files):
    t = next(t for t in gguf.GGUFReader(files["q4_k_m"]).tensors if t.name == "token_embd.weight")
    w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
    tensor = next(x for x in gguf_weights.check_file(files["q4_k_m"]) if x.name == "token_embd.weight")
    emb = gguf_weights.FileEmbedding(tensor, *w.shape)
    ids = torch.tensor([[0, 5, w.shape[0] - 1], [77, 77, 3]])
    assert torch.equal(emb(ids), w[ids])  # bit for bit, any shape of ids
    with pytest.raises(IndexError, match="out of range"):
        emb(torch.tensor([w.shape[0]]))


def test_the_file_embedding_reads_its_rows_rather_than_mapping_the_file(files, tmp_path):
    """A mapped lookup brought ~128 KB of neighbours into the process per row (for a tied model a second copy of the
    LM head, growing with every new token); the rows are read instead: no map of the file stays with the embedding,
    its one descriptor goes with it, and a file cut short under a running model is a clear error, not a crash."""
    import gc
    import os
    import shutil

    path = str(tmp_path / "copy.gguf")
    shutil.copyfile(files["q4_k_m"], path)
    tensor = next(x for x in gguf_weights.check_file(path) if x.name == "token_embd.weight")
    w = torch.from_numpy(gguf.quants.dequantize(np.asarray(tensor.data), gguf.GGMLQuantizationType[tensor.ggml])
                         .astype(np.float32)).reshape(tensor.shape)
    emb = gguf_weights.FileEmbedding(tensor, *w.shape)
    del tensor
    gc.collect()
    fds = len(os.listdir("/proc/self/fd"))
    ids = torch.tensor([3, w.shape[0] - 1, 3, 40])
    assert torch.equal(emb(ids), w[ids])

    def mapped() -> bool:
        with open("/proc/self/maps") as f:
            return any(line.rstrip().endswith(path) for line in f)

    assert not mapped()  # the load's map of the file went; the lookups made none
    with open(path, "r+b") as f:
        f.truncate(emb.tensor.offset + (w.shape[0] - 1) * emb.row_bytes)  # the embedding's last row gone
    assert torch.equal(emb(torch.tensor([5])), w[5:6])
    with pytest.raises(gguf_weights.GGUFError, match="shorter than when it was loaded"):
        emb(torch.tensor([w.shape[0] - 1]))
    del emb
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == fds - 1  # its descriptor closed with it


def test_later_loads_map_the_packed_blocks_and_refuse_a_damaged_file(files, monkeypatch):
    """The first load packs the file's blocks for the kernel and keeps them (packed_weights); a later load maps them
    instead of packing again, with the same bits; a damaged file, or one packed for another kernel layout, is
    packed again, never run."""
    import os

    from simllm_ros.model import packed_weights

    first = file_backend(files, "q4_k_m")
    path = os.path.join(first._path, packed_weights.PACKED_FILE)
    assert os.path.isfile(path)
    ids = [int(t) for t in range(700, 700 + 19 * 41, 41)]
    ref = first.run(ids, first.new_cache(22), logits="all")

    def load():
        said: list[str] = []
        b = ModelBackend(files["q4_k_m"], dtype="float32", weight_bits=0, cache_dir=files["cache"],
                         progress=said.append)
        assert torch.equal(b.run(ids, b.new_cache(22), logits="all"), ref)
        return " | ".join(said)

    assert "mapped as packed at an earlier load" in load()
    good = open(path, "rb").read()
    damaged = bytearray(good)
    damaged[-100] ^= 0x40  # one bit of the last blob
    with open(path, "wb") as f:
        f.write(damaged)
    said = load()
    assert "damaged" in said and "packed for our kernel" in said and "mapped" not in said
    assert said.count(" parts (100%)") == 1, said  # progress as it packs; each part packed once
    assert "mapped as packed at an earlier load" in load()  # written again, whole
    with open(path, "wb") as f:
        f.write(good[: len(good) // 2])
    assert "unreadable" in load() and "mapped as packed at an earlier load" in load()
    monkeypatch.setattr(packed_weights, "layout_id", lambda: "another-layout")
    said = load()
    assert "another file or kernel layout" in said and "mapped" not in said


def test_a_long_prompt_runs_in_passes_of_pass_rows_with_the_same_bits(files, monkeypatch):
    """Past PASS_ROWS tokens a prompt is run in several passes (the layers' work buffers then hold PASS_ROWS rows,
    not the prompt): logits and KV bitwise those of one pass, as the invariance probe promises."""
    from simllm_ros.model import model_backend

    b = file_backend(files, "q4_k_m")
    assert b.exact_chunking
    ids = [int(t) for t in range(300, 300 + 45 * 53, 53)]
    passes, forward = [], b.runner.forward
    monkeypatch.setattr(b.runner, "forward", lambda ids, *a, **k: passes.append(len(ids)) or forward(ids, *a, **k))
    out = {}
    for rows in (10 ** 6, 7):
        monkeypatch.setattr(model_backend, "PASS_ROWS", rows)
        cache = b.new_cache(48)
        passes.clear()
        out[rows] = (b.run(ids, cache, logits="all"), b.run(ids[:30], b.new_cache(48), logits="last"), cache)
        assert passes == ([45, 30] if rows > 45 else [7] * 6 + [3] + [7] * 4 + [2])
    (whole, last, c1), (cut, last_cut, c2) = out[10 ** 6], out[7]
    assert whole.shape == cut.shape and torch.equal(whole, cut) and torch.equal(last, last_cut)
    assert torch.equal(c1.k[:, :, :45], c2.k[:, :, :45]) and torch.equal(c1.v[:, :, :45], c2.v[:, :, :45])


def test_the_converted_copy_drops_its_dense_projections_once_checked_and_packed(files, monkeypatch):
    """A GGUF's first conversion for our kernels keeps only what skeleton loads read (gguf_conversion: no dense
    float32 projections, ~4x the file). A load that needs them (bfloat16 here) converts the file whole; the float32
    load after it maps the packed blocks kept through that conversion with the same bits, and drops the dense
    projections again where they reach KEEP_DENSE_BELOW (set to 0 here, as for a model over 1 GiB): a copy under it
    (the embedded model's) stays whole, so switching paths again converts nothing."""
    import os

    from safetensors import safe_open

    from simllm_ros.model import model_files
    from simllm_ros.model.skeleton import SLIM_FILE

    first = file_backend(files, "q8_0")
    folder = first._path
    shard = os.path.join(folder, "model.safetensors")

    def dense_in_copy() -> bool:
        with safe_open(shard, "pt") as f:
            assert "model.norm.weight" in f.keys()
            return any(".self_attn." in k and k.endswith("proj.weight") for k in f.keys())

    assert os.path.isfile(os.path.join(folder, SLIM_FILE)) and not dense_in_copy()
    ids = [int(t) for t in range(900, 900 + 17 * 43, 43)]
    ref = first.run(ids, first.new_cache(20), logits="all")
    dense = ModelBackend(files["q8_0"], dtype="bfloat16", weight_bits=16, cache_dir=files["cache"])
    assert not os.path.isfile(os.path.join(folder, SLIM_FILE)) and dense.runner is not None and dense_in_copy()
    said: list[str] = []
    whole = ModelBackend(files["q8_0"], dtype="float32", weight_bits=0, cache_dir=files["cache"], progress=said.append)
    assert whole.skeleton and any("mapped as packed at an earlier load" in m for m in said), said
    assert torch.equal(whole.run(ids, whole.new_cache(20), logits="all"), ref)
    assert not os.path.isfile(os.path.join(folder, SLIM_FILE)) and dense_in_copy()  # small: kept whole
    monkeypatch.setattr(model_files, "KEEP_DENSE_BELOW", 0)
    said.clear()
    slim = ModelBackend(files["q8_0"], dtype="float32", weight_bits=0, cache_dir=files["cache"], progress=said.append)
    assert any("dropped the converted copy's dense projections" in m for m in said), said
    assert os.path.isfile(os.path.join(folder, SLIM_FILE)) and not dense_in_copy()
    assert torch.equal(slim.run(ids, slim.new_cache(20), logits="all"), ref)


@pytest.mark.parametrize("name", ["q4_k_m", "q8_0", "qwen2", "qwen3", "gemma3", "smollm3"])
def test_a_ggufs_first_conversion_checks_it_a_tensor_at_a_time(files, tmp_path, name):
    """A GGUF's first conversion for our kernels never holds the dense model (gguf_conversion): each projection
    checked against gguf's dequantization as transformers processes it (Llama's q/k row order, Gemma's norm offset),
    the embedding and LM head a slice of rows at a time. The copy equals what transformers' whole conversion and the
    check against its dense weights give (row orders, head and embedding flags, every tensor kept), and the backend
    on it computes the bits of a backend that checked the dense weights."""
    import os

    from safetensors import safe_open

    from random_gguf import write_llama
    from simllm_ros.model import model_files, skeleton

    path = files[name] if name != "gemma3" else write_llama(
        str(tmp_path / "rand-gemma3.gguf"), arch="gemma3", layers=7, heads=4, kv_heads=1, head_dim=64, types=Q4_K_M,
        embed="Q8_0", output=None, seed=4, sliding_window=16)
    ref = whole_backend(files, name, path)
    whole = gguf_weights.load_rows(ref._path, model_files.conversion_stamp(path))
    said: list[str] = []
    b = ModelBackend(path, dtype="float32", weight_bits=0, cache_dir=str(tmp_path / "streamed"), progress=said.append)
    assert any("one tensor at a time into" in m for m in said) and not any("safetensors once" in m for m in said), said
    assert b.skeleton and b.runner is not None and b.runner.file is not None and not b.reload_lighter
    rows = gguf_weights.load_rows(b._path, model_files.conversion_stamp(path))
    assert whole is not None and rows is not None and (rows.head, rows.embed) == (whole.head, whole.embed)
    assert rows.perms.keys() == whole.perms.keys() and all(torch.equal(rows.perms[k], whole.perms[k]) for k in rows.perms)
    if name == "q4_k_m":
        assert len(rows.perms) == 4  # Llama's q and k of both layers: rows in transformers' order
    with safe_open(os.path.join(b._path, "model.safetensors"), "pt") as f, \
            safe_open(os.path.join(ref._path, "model.safetensors"), "pt") as g:
        assert set(f.keys()) == set(g.keys()) - skeleton.skipped_tensors(ref.config, rows.head, rows.embed)
        assert all(torch.equal(f.get_tensor(k), g.get_tensor(k)) for k in f.keys())
    ids = [int(t) for t in range(900, 900 + 40 * 43, 43)]
    assert torch.equal(b.run(ids, b.new_cache(42), logits="all"), ref.run(ids, ref.new_cache(42), logits="all"))


def test_a_node_on_the_embedded_model_starts_without_transformers_model_classes():
    """Once converted, the embedded model loads on the skeleton (skeleton.py) and the fingerprint's MiniLM runs on
    bert_encoder: the engine process never imports transformers' modeling code (~1.5 s and ~100 MB of a start),
    and answers the same as the shared engine of the same settings."""
    from core_fixtures import BASE, python_in_new_process, shared_engine
    from simllm_ros.request import QueryRequest

    want = shared_engine().handle(QueryRequest(prompt="Where can I park near the station?", max_new_tokens=8))
    code = ("import sys; from simllm_ros.serving.engine import Engine; from simllm_ros.settings import Settings; "
            "from simllm_ros.request import QueryRequest; "
            f"e = Engine(Settings.from_overrides(**{BASE!r})); e.load(); "
            "r = e.handle(QueryRequest(prompt='Where can I park near the station?', max_new_tokens=8)); "
            "import gc; print(r.success, type(e.backend.model).__module__, 'transformers.modeling_utils' in sys.modules, "
            "gc.get_freeze_count() > 100000); "
            "print(repr(r.answer))")
    lines = python_in_new_process(code, timeout=600)
    # and what the load made is out of the cyclic collector's walks (Engine.load's gc.freeze)
    assert lines[-2] == "True simllm_ros.model.skeleton False True", lines
    assert want.success and lines[-1] == repr(want.answer)


def test_the_converted_tokenizer_keeps_its_added_tokens_and_encodes_the_same(files, tmp_path):
    """The converted copy's tokenizer_config.json lists the added tokens (model_files.keep_added_tokens), so a load
    does not parse the whole tokenizer.json again to find them; a copy converted before this is given them at its
    next load; and the tokenizer is the one transformers' own path builds: same ids, specials and decoding."""
    import json
    import os
    import shutil

    from transformers import AutoTokenizer

    from simllm_ros.model.model_files import resolve_model
    from simllm_ros.workloads import load_clinc

    folder = file_backend(files, "q4_k_m")._path
    with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
        assert json.load(f)["added_tokens_decoder"]
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(os.path.join(folder, name), legacy / name)
    with open(legacy / "tokenizer_config.json", encoding="utf-8") as f:
        cfg = json.load(f)
    del cfg["added_tokens_decoder"]
    with open(legacy / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    a, b = AutoTokenizer.from_pretrained(str(legacy)), AutoTokenizer.from_pretrained(folder)
    texts = [p for phrases in list(load_clinc().values())[:40] for p in phrases[:3]]
    texts += ["<|im_start|>system\nbulletin<|im_end|>\n<|im_start|>user\nwhere?<|im_end|>", "<|endoftext|> x"]
    for t in texts:
        assert a(t)["input_ids"] == b(t)["input_ids"], t
        ids = a(t, add_special_tokens=False)["input_ids"]
        assert a.decode(ids, skip_special_tokens=True) == b.decode(ids, skip_special_tokens=True)
    assert a.get_added_vocab() == b.get_added_vocab() and len(a.get_added_vocab()) > 3
    assert (a.eos_token_id, a.pad_token_id, a.unk_token_id, a.all_special_ids) == \
        (b.eos_token_id, b.pad_token_id, b.unk_token_id, b.all_special_ids)
    # a copy converted before: its next resolve writes them, and only once
    shutil.copy(legacy / "tokenizer_config.json", os.path.join(folder, "tokenizer_config.json"))
    said = []
    assert resolve_model(files["q4_k_m"], files["cache"], said.append) == folder
    with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
        assert json.load(f)["added_tokens_decoder"] == _added_tokens_of(folder)
    assert len(said) == 1 and "added tokens" in said[0]
    resolve_model(files["q4_k_m"], files["cache"], said.append)
    assert len(said) == 1


def test_the_served_tokenizer_keeps_no_python_tables_and_encodes_the_same(files, tmp_path):
    """The backend loads its tokenizer without the Python vocabulary dict and merge list that transformers' model
    tokenizer classes (Qwen2's, Llama's, Gemma's) keep after building the Rust tokenizer (model_files.load_tokenizer:
    ~180 MB resident for Gemma 3's 262,144 tokens); ids, chat prompts and decoding equal the tokenizer as
    transformers leaves it. The converted folder is loaded here as a Qwen2Tokenizer (what a Qwen GGUF converts to:
    the same byte-level BPE as the test files' SmolLM2 tokenizer)."""
    import json
    import os
    import shutil

    from transformers import AutoTokenizer

    from simllm_ros.model.model_files import load_tokenizer
    from simllm_ros.workloads import load_clinc

    backend = file_backend(files, "q4_k_m")
    for name in os.listdir(backend._path):
        if name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(os.path.join(backend._path, name), tmp_path / name)
    with open(tmp_path / "tokenizer_config.json", encoding="utf-8") as f:
        cfg = json.load(f)
    with open(tmp_path / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump({**cfg, "tokenizer_class": "Qwen2Tokenizer"}, f)
    served, full = load_tokenizer(str(tmp_path)), AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert type(served).__name__ == type(full).__name__ == "Qwen2Tokenizer"
    assert len(full._merges) > 1000 and len(full._vocab) == len(backend.tokenizer.get_vocab())
    assert not served._merges and not served._vocab
    texts = [p for phrases in list(load_clinc().values())[:40] for p in phrases[:3]]
    texts += ["<|im_start|>system\nbulletin<|im_end|>\n<|im_start|>user\nwhere?<|im_end|>",
              "<|endoftext|> x \u00e9\u4e2d"]
    for t in texts:
        assert served(t)["input_ids"] == full(t)["input_ids"] == backend.tokenizer(t)["input_ids"], t
        ids = full(t, add_special_tokens=False)["input_ids"]
        assert served.decode(ids, skip_special_tokens=True) == full.decode(ids, skip_special_tokens=True)
        assert served.convert_ids_to_tokens(ids) == full.convert_ids_to_tokens(ids)
    msgs = [{"role": "system", "content": "bulletin"}, {"role": "user", "content": texts[0]}]
    assert served.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True) == \
        full.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    assert len(served) == len(full) and served.get_vocab() == full.get_vocab()
    assert served.all_special_ids == full.all_special_ids and served.eos_token_id == full.eos_token_id


def _added_tokens_of(folder: str) -> dict:
    import json
    import os

    with open(os.path.join(folder, "tokenizer.json"), encoding="utf-8") as f:
        return {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in json.load(f)["added_tokens"]}


@pytest.mark.parametrize("name", ["qwen2", "q4_k_m"])
def test_the_header_fields_give_transformers_the_parse_of_ggufs_reader(files, name):
    """The first conversion's metadata parse reads the header through our bounded reader (HeaderFields) instead of
    gguf's GGUFReader: transformers' parse of the file (config, tokenizer and its config) must come out the same,
    value for value and type for type."""
    import pickle

    from transformers import modeling_gguf_pytorch_utils as mgu

    from simllm_ros.model import gguf_conversion

    theirs = mgu.load_gguf_checkpoint(files[name], return_tensors=False)
    with gguf_conversion._header_fields():
        ours = mgu.load_gguf_checkpoint(files[name], return_tensors=False)
    assert ours == theirs and pickle.dumps(ours) == pickle.dumps(theirs)
    assert len(ours["tokenizer"]["tokens"]) > 1000
