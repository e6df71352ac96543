"""Decoding with verified drafts: the model's own answer, in fewer forward passes.

A proposer (draft_proposer) guesses how the answer goes on: a stored answer of a
similar request, a recent answer in the scope, or a span of the prompt. The model
checks a block of guessed tokens in one pass and keeps the longest run that equals
what it would have picked itself, plus its own pick at the first difference, so a
pass always yields at least one token (SpecInfer / prompt-lookup / SuffixDecoding).

Why the output is exactly plain decoding's:
- a token is picked by a function of (logits, step index) alone: argmax for greedy,
  and for temperature > 0 the Gumbel-max trick with noise drawn from a generator
  seeded by (seed, step). That samples exactly softmax(logits / T) and does not
  depend on how many tokens were checked together (standard speculative sampling
  would consume random numbers differently per draft and change the text);
- the logits themselves do not depend on it either when the backend is
  batch-invariant (`ModelBackend.exact_chunking`, checked at load). Where it is not,
  the engine verifies drafts only for callers that allow approximate reuse.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch


class Sampler:
    """Picks token `step` of an answer from its logits: greedy, or Gumbel-max with per-step noise."""

    def __init__(self, temperature: float = 0.0, seed: int = 0):
        self.temperature = float(temperature)
        self.seed = int(seed)

    def pick(self, logits: torch.Tensor, step: int) -> int:
        if self.temperature <= 0:
            return int(torch.argmax(logits))
        g = torch.Generator(device="cpu").manual_seed((self.seed * 1_000_003 + step) & 0x7FFF_FFFF_FFFF_FFFF)
        u = torch.rand(logits.shape[-1], generator=g, dtype=torch.float64).clamp_(1e-300, 1.0 - 1e-16)
        gumbel = -torch.log(-torch.log(u))
        return int(torch.argmax(logits.detach().double().cpu() / self.temperature + gumbel))


@dataclasses.dataclass
class Generation:
    tokens: list[int]
    text: str
    ttft_s: float
    first_logits: torch.Tensor
    draft_proposed: int = 0
    draft_accepted: int = 0
    forward_passes: int = 0  # decode passes after the prefill
    stopped: str = ""  # "eos", "length", "cancel" or "" (still unknown)

    @property
    def plain_passes(self) -> int:
        """Passes plain decoding needs for the same tokens: one per token, and one to see the end of
        the answer unless the length limit (or a cancel) ended it."""
        return max(0, len(self.tokens) - (0 if self.stopped == "eos" else 1))


class Constraint:
    """What the decoder needs from an output grammar (structured_output.JsonConstraint): the pick stays a
    function of (masked logits, step), so constrained answers are as exact as plain ones."""

    def mask(self, logits: torch.Tensor, step: int) -> torch.Tensor:
        return logits

    def accept(self, token: int) -> None:
        pass

    def is_terminated(self) -> bool:
        return False


class DraftSource:
    """What the decoder needs from a proposer."""

    def propose(self, generated: list[int], limit: int) -> list[int]:
        return []

    def feedback(self, proposed: int, accepted: int) -> None:
        pass


def generate(step: Callable[[list[int]], torch.Tensor], truncate: Callable[[int], None], cache_len: Callable[[], int],
             first_logits: torch.Tensor, max_new_tokens: int, *, sampler: Sampler, stop_ids: set[int],
             drafts: DraftSource | None = None, t_start: float | None = None,
             on_token: Callable[[list[int]], None] | None = None,
             should_stop: Callable[[], bool] | None = None, constraint: Constraint | None = None) -> Generation:
    """Decode up to max_new_tokens after `first_logits` (the prompt's last-token logits).

    step(tokens) runs tokens at the end of the cache and returns logits for each of them;
    truncate(n) forgets cache entries past n. on_token(tokens so far) is called as tokens are
    committed; should_stop() is polled after every committed token (cancellation, stop strings).
    constraint (an output grammar) masks every row a token is picked from, draft rows included,
    and accepts each committed token.
    """
    tokens: list[int] = []
    gen = Generation(tokens, "", 0.0, first_logits)
    logits = first_logits

    def pick(row: torch.Tensor) -> int:
        return sampler.pick(row if constraint is None else constraint.mask(row, len(tokens)), len(tokens))

    def commit(t: int) -> None:
        if constraint is not None:
            constraint.accept(t)
        if t not in stop_ids:
            tokens.append(t)
            if on_token is not None:
                on_token(tokens)

    while True:
        tok = pick(logits)
        if not tokens and not gen.ttft_s:
            gen.ttft_s = time.perf_counter() - (t_start or time.perf_counter())
        commit(tok)
        if tok in stop_ids:
            gen.stopped = "eos"
            break
        if len(tokens) >= max_new_tokens:
            gen.stopped = "length"
            break
        if should_stop is not None and should_stop():
            gen.stopped = "cancel"
            break
        # Tokens after `tok` that may still be emitted: drafts beyond that would be wasted.
        room = max_new_tokens - len(tokens)
        guess = drafts.propose(tokens, room) if drafts is not None else []
        guess = guess[:room]
        base = cache_len()
        out = step([tok] + guess)  # [1 + len(guess), vocab]
        gen.forward_passes += 1
        accepted = 0
        stopped = ""
        for j, d in enumerate(guess):
            if pick(out[j]) != d:
                break
            commit(d)
            if d in stop_ids:  # the model itself would stop here
                stopped = "eos"
                break
            accepted += 1
            if len(tokens) >= max_new_tokens:
                stopped = "length"
                break
            if should_stop is not None and should_stop():
                stopped = "cancel"
                break
        if guess:
            gen.draft_proposed += len(guess)
            gen.draft_accepted += accepted
            drafts.feedback(len(guess), accepted)
        truncate(base + 1 + accepted)  # KV of tok and of the accepted drafts
        if stopped:
            gen.stopped = stopped
            break
        logits = out[accepted]
    return gen
