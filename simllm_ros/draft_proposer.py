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
3. When nothing matches, a one-token guess from a one-token match: a single token is
   padded to two rows by the model runner anyway, so the guess costs nothing.

The draft length adapts: it doubles after a fully accepted draft and falls back to
what was accepted plus one after a rejection (within [2, max_tokens]).
"""
from __future__ import annotations

from .decoding import DraftSource


class DraftProposer(DraftSource):
    def __init__(self, *, answers: list[list[int]] = (), history: list[list[int]] = (), prompt: list[int] = (),
                 max_tokens: int = 32, min_match: int = 2, max_match: int = 8, start_tokens: int = 8):
        self.answers = [list(a) for a in answers if a]
        # References searched by suffix match, in preference order (earlier = preferred on ties).
        self.refs = self.answers + [list(h) for h in history if h] + ([list(prompt)] if prompt else [])
        self.max_tokens = max(1, int(max_tokens))
        self.min_match = max(1, int(min_match))
        self.max_match = max(self.min_match, int(max_match))
        self.length = max(2, min(int(start_tokens), self.max_tokens))
        self._index: dict[int, list[tuple[int, int]]] = {}  # token -> [(ref, pos)] for suffix search
        for r, ref in enumerate(self.refs):
            for pos, t in enumerate(ref[:-1]):  # a token with something after it
                self._index.setdefault(t, []).append((r, pos))

    def propose(self, generated: list[int], limit: int) -> list[int]:
        limit = min(limit, self.max_tokens)
        if limit <= 0:
            return []
        n = len(generated)
        for a in self.answers:  # 1. a stored answer that the model has followed so far
            if len(a) > n and a[:n] == generated:
                return a[n:n + min(limit, max(self.length, self.max_tokens))]
        ref, end, length = self._longest_suffix_match(generated)
        if ref < 0:
            return []
        cont = self.refs[ref][end + 1:]
        if length < self.min_match:  # 3. a weak guess: one token, free in a padded pass
            return cont[:1]
        return cont[:min(limit, self.length)]  # 2. continuation of the longest suffix match

    def feedback(self, proposed: int, accepted: int) -> None:
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
