"""Draft tokens for verified decoding, taken from what the pool and the prompt already hold.

Sources, strongest first:
1. Stored answers of similar cached requests in the same scope ("anchored"): while
   the answer so far equals the start of a stored answer, the rest of that answer is
   the draft. A repeated question is then checked in one pass instead of decoded
   token by token; a different question's answer is simply rejected where the model
   disagrees (this is what makes the answer tier safe).
2. Suffix match (prompt lookup, SuffixDecoding's idea on a small scale): the longest
   suffix of the answer so far (at least `min_match` tokens) found in the stored
   answers, in the scope's recent answers or in the prompt; its continuation there is
   the draft. Answers are preferred over the prompt, later occurrences over earlier.
3. When nothing longer matches, a one-token guess from a one-token match.

How long a draft to check is a question of cost: every draft row is paid for whether
the model accepts it or not, and what a row costs depends on the kernels (a 16-bit
single token runs padded to two rows, so one guessed token is free; at 4 bits a second
row costs ~13% of a pass and five rows ~70%). Where the backend measured its pass
costs (`ModelBackend.pass_costs`), the proposer checks the draft length d that
maximises the expected tokens per cost, (1 + a + a^2 + ... + a^d) / cost(1 + d), a
being the acceptance rate of tokens of that kind of draft (the stored answer of this
very prompt, a similar request's answer, suffix match, one-token guess) learnt across
requests (`DraftStats`); d = 0, no draft, when no
length pays. Without costs the length adapts as before: it doubles after a fully
accepted draft and falls back to what was accepted plus one after a rejection
(within [2, max_tokens]). The length never changes the answer, only the passes.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence

from .decoding import DraftSource

KINDS = ("repeat", "answer", "suffix", "guess")


class DraftStats:
    """How often each kind of draft token was accepted, shared by the requests of one engine: a rate per
    kind (a token counts once it was checked: accepted, or the first rejected one), starting from a prior
    and forgetting old requests slowly, so that it follows the workload."""

    PRIOR = {"repeat": 0.99, "answer": 0.7, "suffix": 0.5, "guess": 0.3}
    PRIOR_WEIGHT = 4.0  # the prior counts as this many checked tokens
    DECAY = 0.995  # per checked draft: about the last few hundred drafts count
    EXPLORE_EVERY = 16  # a kind whose drafts do not pay is still tried once in this many chances

    def __init__(self):
        self._lock = threading.Lock()
        self._acc = {k: self.PRIOR[k] * self.PRIOR_WEIGHT for k in KINDS}
        self._seen = {k: self.PRIOR_WEIGHT for k in KINDS}
        self._declined = {k: 0 for k in KINDS}

    def rate(self, kind: str) -> float:
        with self._lock:
            return self._acc[kind] / self._seen[kind]

    def explore(self, kind: str) -> bool:
        """Whether to check one token of a kind whose drafts do not pay now: without a try now and then, its
        rate could never recover when the workload changes."""
        with self._lock:
            self._declined[kind] += 1
            return self._declined[kind] % self.EXPLORE_EVERY == 0

    def record(self, kind: str, proposed: int, accepted: int) -> None:
        checked = accepted + (1 if accepted < proposed else 0)
        with self._lock:
            self._acc[kind] = self._acc[kind] * self.DECAY + accepted
            self._seen[kind] = self._seen[kind] * self.DECAY + checked


# A draft must promise this much more than plain decoding per unit of cost before it is checked: rates and costs are
# estimates, and a draft that only breaks even on paper costs time where the estimate is off (issue 55: drafts at
# 2 threads that were rarely accepted made decode slower than none). A repeated answer (rate ~1) clears it by far.
DRAFT_MARGIN = 0.03


def best_length(rate: float, costs, available: int, rows: int = 1) -> int:
    """The draft length d in 0..available with the most expected tokens per cost of its pass:
    (rows - 1 + 1 + rate + ... + rate^d) / costs[rows + d], where the pass already decodes `rows` tokens (this
    answer's and, batched, one of each other answer decoding with it); the shorter one on a tie, and 0 unless it
    beats plain decoding by DRAFT_MARGIN. Batched, a draft row slows every answer in the pass, and where the pass is
    already several rows (compute-bound) a row costs about 1/rows of it: only drafts that are usually accepted pay."""
    rows = max(1, int(rows))
    if rows >= len(costs):
        return 0
    plain = rows / costs[rows]
    best, best_value, expected, p = 0, plain, float(rows), 1.0
    for d in range(1, min(available, len(costs) - 1 - rows) + 1):
        p *= rate
        expected += p
        value = expected / costs[rows + d]
        if value > best_value * (1 + 1e-9) and value > plain * (1 + DRAFT_MARGIN):
            best, best_value = d, value
    return best


class DraftProposer(DraftSource):
    def __init__(self, *, answers: Sequence[Sequence[int]] = (), history: Sequence[Sequence[int]] = (),
                 prompt: Sequence[int] = (), max_tokens: int = 32, min_match: int = 2, max_match: int = 8,
                 start_tokens: int = 8, costs=None, stats: DraftStats | None = None, repeat: Sequence[int] = ()):
        # `repeat`: the stored answer of this very prompt (same configuration: usually the answer itself),
        # checked before the answers of similar requests and counted as its own kind of draft.
        self.n_repeat = 1 if repeat else 0
        self.answers = ([list(repeat)] if repeat else []) + [list(a) for a in answers if a and list(a) != list(repeat)]
        # References searched by suffix match, in preference order (earlier = preferred on ties).
        self.refs = self.answers + [list(h) for h in history if h] + ([list(prompt)] if prompt else [])
        self.max_tokens = max(1, int(max_tokens))
        self.min_match = max(1, int(min_match))
        self.max_match = max(self.min_match, int(max_match))
        self.length = max(2, min(int(start_tokens), self.max_tokens))
        # Cost-aware lengths: pass costs by rows (None: the adaptive length) and the acceptance rates.
        self.costs = costs
        self.stats = stats if stats is not None else DraftStats()
        self._kind = ""  # the kind of the last draft proposed, for feedback
        self._index: dict[int, list[tuple[int, int]]] = {}  # token -> [(ref, pos)] for suffix search
        for r, ref in enumerate(self.refs):
            for pos, t in enumerate(ref[:-1]):  # a token with something after it
                self._index.setdefault(t, []).append((r, pos))

    def propose(self, generated: list[int], limit: int, rows: int = 1) -> list[int]:
        limit = min(limit, self.max_tokens)
        if limit <= 0:
            return []
        n = len(generated)
        for i, a in enumerate(self.answers):  # 1. a stored answer that the model has followed so far
            if len(a) > n and a[:n] == generated:
                kind = "repeat" if i < self.n_repeat else "answer"
                return self._take(kind, a[n:], min(limit, max(self.length, self.max_tokens)), limit, rows)
        ref, end, length = self._longest_suffix_match(generated)
        if ref < 0:
            return []
        cont = self.refs[ref][end + 1:]
        if length < self.min_match:  # 3. a weak guess: one token
            return self._take("guess", cont, 1, 1, rows)
        return self._take("suffix", cont, min(limit, self.length), limit, rows)  # 2. continuation of the longest match

    def _take(self, kind: str, cont: list[int], adaptive: int, limit: int, rows: int) -> list[int]:
        """The draft from continuation `cont`: as long as the costs say pays (up to `limit`) in a pass of `rows`
        decoded tokens, or without costs the adaptive length."""
        if self.costs is None:
            n = adaptive
        else:
            n = best_length(self.stats.rate(kind), self.costs, min(limit, len(cont)), rows)
            if n == 0 and cont and self.stats.explore(kind):
                n = 1
        self._kind = kind if n > 0 else ""
        return cont[:n]

    def feedback(self, proposed: int, accepted: int) -> None:
        if self._kind and proposed > 0:
            self.stats.record(self._kind, proposed, accepted)
        if accepted >= proposed:
            self.length = min(self.max_tokens, self.length * 2)
        else:
            self.length = max(2, min(self.max_tokens, accepted + 1))

    def _longest_suffix_match(self, generated: list[int]) -> tuple[int, int, int]:
        """(ref, position of the match's last token, match length) of the longest suffix match of
        `generated` in any reference; (-1, -1, 0) when even its last token occurs nowhere."""
        if not generated:
            return -1, -1, 0
        best = (-1, -1, 0)
        for r, pos in self._index.get(generated[-1], ()):
            ref = self.refs[r]
            length = 1
            while (length < self.max_match and length < len(generated) and pos - length >= 0
                   and ref[pos - length] == generated[-1 - length]):
                length += 1
            # Longer wins; on a tie the preferred reference (lower r), then the later occurrence.
            if length > best[2] or (length == best[2] and (r < best[0] or (r == best[0] and pos > best[1]))):
                best = (r, pos, length)
        return best
