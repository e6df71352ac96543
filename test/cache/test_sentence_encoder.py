"""The embedder without sentence-transformers (cache/sentence_encoder.py): the same bits as SentenceTransformer.encode
on the embedded MiniLM, a folder of another shape left to sentence-transformers, and a node's Fingerprinter that
never imports it."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from core_fixtures import python_in_new_process
from simllm_ros.cache.fingerprint import Fingerprinter, resolve_embedder_path
from simllm_ros.cache.sentence_encoder import SentenceEncoder
from simllm_ros.settings import DEFAULT_EMBEDDER
from simllm_ros.workloads import load_clinc

PATH = resolve_embedder_path(DEFAULT_EMBEDDER)


@pytest.fixture(scope="module")
def texts():
    by_intent = load_clinc()
    picked = [phrases[i] for n, phrases in enumerate(by_intent.values()) for i in (0, n % 7) if n % 3 == 0]
    # an empty text, one character, one past the 256-token cut, and ties in length (their order sets the batches)
    return picked + ["", "a", "traffic " * 300, "where to park", "when do we eat"]


def test_the_embedded_folder_gives_sentence_transformers_bits(texts):
    from sentence_transformers import SentenceTransformer

    ours = SentenceEncoder.open(PATH)
    assert ours is not None and ours.mean and ours.normalize_module and ours.max_seq_length == 256 and ours.dim == 384
    assert ours.bert is not None and ours.model is None  # MiniLM runs on our BERT forward (bert_encoder)
    st = SentenceTransformer(PATH, device="cpu", local_files_only=True)
    want = st.encode(texts, batch_size=32, convert_to_numpy=True, normalize_embeddings=True, show_progress_bar=False)
    got = ours.encode(texts, batch_size=32)
    assert got.dtype == np.float32 and got.shape == (len(texts), 384) and len(texts) > 64  # several batches
    assert np.array_equal(got, want)
    for one in (texts[:1], texts[-3:-2], []):
        assert np.array_equal(ours.encode(one), st.encode(one, convert_to_numpy=True, normalize_embeddings=True,
                                                          show_progress_bar=False).reshape(len(one), 384))


def test_a_bert_variant_runs_on_transformers_with_the_same_bits(tmp_path, texts):
    """A BERT our forward does not compute (another activation) goes to transformers' AutoModel, still with
    sentence-transformers' bits: the fallback inside SentenceEncoder is checked too."""
    from sentence_transformers import SentenceTransformer

    folder = tmp_path / "relu"
    shutil.copytree(PATH, folder)
    with open(folder / "config.json", encoding="utf-8") as f:
        cfg = json.load(f)
    with open(folder / "config.json", "w", encoding="utf-8") as f:
        json.dump({**cfg, "hidden_act": "relu"}, f)
    ours = SentenceEncoder.open(str(folder))
    assert ours is not None and ours.bert is None and ours.model is not None
    st = SentenceTransformer(str(folder), device="cpu", local_files_only=True)
    some = texts[:40] + texts[-5:]
    want = st.encode(some, batch_size=16, convert_to_numpy=True, normalize_embeddings=True, show_progress_bar=False)
    got = ours.encode(some, batch_size=16)
    assert np.array_equal(got, want)
    assert not np.array_equal(got, SentenceEncoder.open(PATH).encode(some, batch_size=16))  # relu: other vectors


def test_another_folder_shape_goes_to_sentence_transformers(tmp_path):
    folder = tmp_path / "dense"
    shutil.copytree(PATH, folder)
    with open(folder / "modules.json", encoding="utf-8") as f:
        modules = json.load(f)
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    with open(folder / "modules.json", "w", encoding="utf-8") as f:
        json.dump(modules, f)
    assert SentenceEncoder.open(str(folder)) is None
    cls_folder = tmp_path / "cls"
    shutil.copytree(PATH, cls_folder)
    with open(cls_folder / "1_Pooling" / "config.json", "w", encoding="utf-8") as f:
        json.dump({"word_embedding_dimension": 384, "pooling_mode_cls_token": True,
                   "pooling_mode_mean_tokens": True}, f)  # two modes at once: not this module's shape
    assert SentenceEncoder.open(str(cls_folder)) is None
    fp = Fingerprinter(str(cls_folder), remember=0)  # sentence-transformers takes it: CLS and mean side by side
    assert not isinstance(fp.model, SentenceEncoder) and fp.dim == 768 and fp.max_tokens == 256
    v = fp.embed(["nearest parking lot"])
    assert v.shape == (1, 768) and abs(float(np.linalg.norm(v[0])) - 1) < 1e-5


def test_a_node_fingerprinter_does_not_import_sentence_transformers_or_modeling_code():
    code = ("import sys; from simllm_ros.cache.fingerprint import Fingerprinter; f = Fingerprinter(); "
            "v = f.embed(['nearest parking lot', 'parking spaces nearby']); "
            "print(v.shape, float(v[0] @ v[1]) > 0.5, 'sentence_transformers' in sys.modules, 'sklearn' in sys.modules, "
            "'transformers.modeling_utils' in sys.modules)")
    assert python_in_new_process(code)[-1] == "(2, 384) True False False False"


def test_the_fingerprinter_embeds_through_it():
    fp = Fingerprinter(remember=0)
    assert isinstance(fp.model, SentenceEncoder) and fp.dim == 384 and fp.max_tokens == 256
    v = fp.embed(["nearest parking lot", "parking spaces nearby", "nearest parking lot"])
    assert np.array_equal(v[0], v[2]) and np.allclose(np.linalg.norm(v, axis=1), 1, atol=1e-6)
    assert fp.count_tokens("nearest parking lot") == 5  # [CLS] nearest parking lot [SEP]


def test_the_bert_tokenizer_is_the_one_autotokenizer_reads():
    """SentenceEncoder builds a BERT folder's tokenizer from its own module (AutoTokenizer's imports cost seconds):
    the same class and the same ids, masks and truncation as AutoTokenizer's, on real requests and odd text."""
    from transformers import AutoTokenizer

    ours, theirs = SentenceEncoder.open(PATH).tokenizer, AutoTokenizer.from_pretrained(PATH, local_files_only=True)
    assert type(ours) is type(theirs) and ours.model_max_length == theirs.model_max_length
    texts = [t for group in load_clinc().values() for t in group[:2]] + [
        "Ça coûte combien ? Ünïcödé, 東京, emoji 🚗", "", " " * 3, "word " * 400]
    for kw in ({}, {"padding": True, "truncation": "longest_first", "max_length": 256}):
        assert ours(texts, **kw)["input_ids"] == theirs(texts, **kw)["input_ids"]
