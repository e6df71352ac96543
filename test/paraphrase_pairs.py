"""The CLINC150 paraphrase pairs of the SEMANTIC tier's tests and benchmark (test_semantic_quality,
test_semantic_repair, simllm-bench semantic_ttft): real paraphrases under the robot-relevant intents."""
from core_fixtures import ROBOT_INTENTS, clinc_by_intent

N_PAIRS = 20
PAIR_COS = (0.82, 0.95)  # real paraphrases: clearly above the 0.8 threshold, not near-duplicates


def select_pairs(fingerprinter, per_intent: int = 12):
    """First pair (file order) of each robot-relevant intent whose fingerprints' cosine is in PAIR_COS."""
    by = clinc_by_intent(limit_per_intent=per_intent)
    pairs = []
    for intent in ROBOT_INTENTS:
        qs = by[intent]
        e = fingerprinter.embed(qs)
        sims = e @ e.T
        hit = next(((qs[i], qs[j], float(sims[i, j])) for i in range(len(qs)) for j in range(i + 1, len(qs))
                    if PAIR_COS[0] <= sims[i, j] <= PAIR_COS[1]), None)
        if hit:
            pairs.append((intent, *hit))
    return pairs[:N_PAIRS]
