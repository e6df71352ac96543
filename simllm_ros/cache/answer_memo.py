"""The cheapest exact answer: an identical request's finished answer, returned without a model pass.

Why it is exact: on a batch-invariant backend (the load-time probe) the model's answer is a function of the prompt's
tokens and the decoding settings alone: greedy, or sampling seeded per step by (seed, step) (decoding.Sampler). The
same tokens in the same scope with the same temperature, seed, stop strings and schema get the very tokens the
first request got, so a repeat needs neither a prefill nor a verification pass; a shorter max_new_tokens gets their
first tokens (each step depends only on the steps before it).

A memo belongs to one pool entry (the prompt's exact-prefix KV): it is found through the pool and valid only while
the pool holds that entry with that answer, so clearing, evicting or refreshing the pool forgets it too. It lives
in this process only: its bits are this process's arithmetic (the numerics digest), and after a restart a repeat
takes the verified-draft path again."""
from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass(frozen=True)
class Signature:
    """What, besides the prompt's tokens, decides the answer's tokens."""

    temperature: float
    seed: int | None  # None when greedy: the seed does not matter then
    stop: tuple[str, ...]
    json_schema: str

    @classmethod
    def of(cls, temperature: float, seed: int, stop, json_schema: str) -> "Signature":
        return cls(float(temperature), int(seed) if temperature > 0 else None, tuple(stop), json_schema)


@dataclasses.dataclass(frozen=True)
class Memo:
    """A finished answer: its text, the token ids the model chose, why it ended ("eos", "stop" or "length")."""

    signature: Signature
    text: str
    tokens: tuple[int, ...]
    stop_reason: str


@dataclasses.dataclass(frozen=True)
class Served:
    text: str
    tokens: int
    stop_reason: str


class AnswerMemo:
    """Memos by pool entry key, the most recent `capacity` (each a few hundred bytes)."""

    def __init__(self, capacity: int = 1024):
        self.capacity = capacity
        self._memos: collections.OrderedDict[int, Memo] = collections.OrderedDict()
        self.hits = 0

    def __len__(self) -> int:
        return len(self._memos)

    def remember(self, key: int, memo: Memo) -> None:
        if memo.stop_reason not in ("eos", "stop", "length") or not memo.tokens:
            return
        self._memos[key] = memo
        self._memos.move_to_end(key)
        while len(self._memos) > self.capacity:
            self._memos.popitem(last=False)

    def forget(self, key: int) -> None:
        self._memos.pop(key, None)

    def clear(self) -> None:
        self._memos.clear()

    def answer(self, key: int, pool_answer: str, signature: Signature, max_new: int,
               detokenize) -> Served | None:
        """The answer for a request whose prompt is pool entry `key` (now holding `pool_answer`), or None.

        The whole answer where the request allows at least as many tokens as it took (or, cut at max_new_tokens,
        exactly as many); its first max_new tokens where it allows fewer and nothing but the token count ends it
        (no stop strings, no schema: those decide the end by what the text is)."""
        m = self._memos.get(key)
        if m is None or m.signature != signature or m.text != pool_answer:
            return None
        n = len(m.tokens)
        if (m.stop_reason in ("eos", "stop") and max_new >= n) or (m.stop_reason == "length" and max_new == n):
            served = Served(m.text, n, m.stop_reason)
        elif max_new < n and not signature.stop and not signature.json_schema:
            served = Served(detokenize(list(m.tokens[:max_new])), max_new, "length")
        else:
            return None
        self._memos.move_to_end(key)
        self.hits += 1
        return served
