"""The rerank core (simllm_ros/serving/rerank.py) on the real MiniLM embedder, without ROS: documents ordered by
cosine to the query, best first, ties in document order; top_k; every bound refused with its reason before the
embedder runs; and a small clinc150 slice through the benchmark's own code ranks far above chance."""
import numpy as np
import pytest

from simllm_ros.bench import rerank as bench
from simllm_ros.cache.fingerprint import Fingerprinter
from simllm_ros.serving.rerank import MAX_DOCUMENTS, MAX_TEXT_CHARS, rank, rerank, rerank_on


@pytest.fixture(scope="module")
def fp():
    f = Fingerprinter()
    yield f
    f.close()


DOCS = ["The pharmacy on Oak Avenue closes at 19:00.", "Light rain is expected after three this afternoon.",
        "Bus line 12 runs every 15 minutes.", "Will it rain later today?"]


def test_documents_ordered_by_cosine_to_the_query(fp):
    q = "is it going to rain this afternoon"
    r = rerank(fp, q, DOCS)
    v = fp.embed([q] + DOCS)
    want = v[1:] @ v[0]
    assert sorted(r.indices) == [0, 1, 2, 3]
    assert set(r.indices[:2]) == {1, 3}, r  # the two rain documents first
    assert r.scores == sorted(r.scores, reverse=True)
    assert np.allclose(r.scores, want[r.indices], atol=1e-5)
    assert all(isinstance(s, float) and -1.0 <= s <= 1.0 for s in r.scores)
    top = rerank(fp, q, DOCS, top_k=2)
    assert top.indices == r.indices[:2] and top.scores == r.scores[:2]
    assert rerank(fp, q, DOCS, top_k=99).indices == r.indices  # more than there are: all


def test_equal_scores_keep_the_documents_order():
    q = np.array([1.0, 0.0], dtype=np.float32)
    d = np.array([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0], [1.0, 0.0]], dtype=np.float32)
    r = rank(q, d)
    assert r.indices == [1, 3, 0, 2] and r.scores == [1.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("query, docs, top_k, reason", [
    ("", ["a"], 0, "query is empty"),
    ("\u200b \n", ["a"], 0, "query is empty"),
    ("rain", [], 0, "documents is empty; give 1 to 256 documents"),
    ("rain", ["x"] * (MAX_DOCUMENTS + 1), 0, f"{MAX_DOCUMENTS + 1} documents; at most {MAX_DOCUMENTS} per call"),
    ("rain", ["fine", ""], 0, "documents[1] is empty"),
    ("rain", ["fine", "a\x07b"], 0, "documents[1] contains control character U+0007"),
    ("rain", ["fine", "\ud800"], 0, "documents[1] contains an unpaired surrogate"),
    ("rain", ["x" * (MAX_TEXT_CHARS + 1)], 0, f"documents[0] is {MAX_TEXT_CHARS + 1} characters; at most"),
    ("rain", ["fine", "word " * 400], 0, "documents[1] is 402 tokens; the embedder reads at most 256 (nothing"),
    ("word " * 300, ["fine"], 0, "query is 302 tokens"),
    ("rain", ["fine"], -1, "top_k must be a whole number >= 0"),
    ("rain", "fine", 0, "documents must be a list of strings"),
])
def test_bad_input_refused_with_the_reason(fp, query, docs, top_k, reason):
    batches = fp.batches
    with pytest.raises(ValueError) as e:
        rerank(fp, query, docs, top_k)
    assert str(e.value).startswith(reason), str(e.value)
    assert fp.batches == batches  # refused before the embedder ran
    assert rerank(fp, "rain", ["rain today"]).indices == [0]  # and the next call is answered


def test_no_engine_is_refused():
    with pytest.raises(ValueError, match="engine is not loaded"):
        rerank_on(None, "rain", ["a"])


def test_clinc150_slice_ranks_far_above_chance(fp):
    """The benchmark's tasks on one query per intent for the 30 intents of two domains, candidates drawn from 5
    train requests per intent; the exemplars task evaluated (60 texts to embed: the same-domain one embeds ~150
    more): the embedder ranks the relevant request well above a random order (the full figures, with TF-IDF
    beside them: simllm-bench rerank)."""
    train, val, domains = bench.clinc_split("train"), bench.clinc_split("val"), bench.clinc_domains()
    two = sorted(set(domains.values()))[:2]
    keep = sorted(i for i in train if domains[i] in two)
    tasks = bench.make_tasks({i: train[i] for i in keep}, {i: val[i] for i in keep}, domains, 1, 7, pool=5)
    assert len(tasks["exemplars"]) == 30 and len(tasks["exemplars"][0][1]) == 30
    for q, docs, rel in tasks["same-domain"]:
        assert len(docs) == 20 and sum(rel) == 1 and q not in docs
        assert len({domains[i] for i in keep for d in docs if d in train[i][:5]}) == 1  # one domain's requests
    res = bench.evaluate(fp, {"exemplars": tasks["exemplars"]}, bench.Tfidf([t for i in keep for t in train[i]]))
    ex = res["exemplars"]
    assert ex["random_mrr"] == pytest.approx(sum(1 / r for r in range(1, 31)) / 30)
    assert ex["embedder"]["mrr"] > 0.5 > 3 * ex["random_mrr"], res
