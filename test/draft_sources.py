"""A draft source for the tests of verified decoding (test_verified_decoding, test_structured_output,
test_batching): it proposes what the test chose, right or wrong."""
from simllm_ros.model.decoding import DraftSource


class FixedDrafts(DraftSource):
    """Proposes continuations of one fixed token sequence while the answer follows it, else `fallback`."""

    def __init__(self, seq: list[int], fallback: list[int] = ()):
        self.seq, self.fallback = list(seq), list(fallback)

    def propose(self, generated, limit, rows=1):
        n = len(generated)
        if self.seq[:n] == generated and len(self.seq) > n:
            return self.seq[n:n + limit]
        return self.fallback[:limit]
