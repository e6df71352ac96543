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
from typing import Protocol

import torch

from ..kernels import layer_kernel


def _greedy(logits: torch.Tensor) -> int:
    """torch.argmax(logits): in C where the layers library is loaded and the logits are float32 on the CPU (the same
    index, sooner: a serial part of every decode step)."""
    kernel = layer_kernel.loaded()
    if kernel is not None and logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.numel():
        return kernel.argmax(logits)
    return int(torch.argmax(logits))


class Sampler:
    """Picks token `step` of an answer from its logits: greedy, or Gumbel-max with per-step noise."""

    def __init__(self, temperature: float = 0.0, seed: int = 0):
        self.temperature = float(temperature)
        self.seed = int(seed)

    def pick(self, logits: torch.Tensor, step: int) -> int:
        if self.temperature <= 0:
            return _greedy(logits)
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


class Constraint(Protocol):
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

    def propose(self, generated: list[int], limit: int, rows: int = 1) -> list[int]:
        """At most `limit` tokens to check after `generated`, in a pass that decodes `rows` tokens besides them
        (1, or one of each answer batched with this one: what a draft row costs depends on it)."""
        return []

    def feedback(self, proposed: int, accepted: int) -> None:
        pass


class Decoder:
    """One answer decoded step by step: the state of `generate` between forward passes.

    The owner runs the passes: `inputs()` are the tokens to run at the end of this request's cache
    this step ([last picked token] + draft), `consume(rows)` takes their logits [len(inputs), vocab]
    and returns whether the answer is finished; afterwards only the first `kept` of the step's tokens
    belong in the cache (the picked token and the accepted drafts). Because a pick is a function of
    (logits, step) alone, an owner may run many decoders' steps in one batched pass (the request
    server's continuous batching) and each answer is still the one `generate` gives.
    The first token is picked from `first_logits` when the decoder is made.
    """

    def __init__(self, first_logits: torch.Tensor, max_new_tokens: int, *, sampler: Sampler, stop_ids: set[int],
                 drafts: DraftSource | None = None, t_start: float | None = None,
                 on_token: Callable[[list[int]], None] | None = None,
                 should_stop: Callable[[], bool] | None = None, constraint: Constraint | None = None):
        self.max_new_tokens = max_new_tokens
        self.constraint = constraint
        self.sampler, self.stop_ids, self.drafts = sampler, stop_ids, drafts
        self.on_token, self.should_stop = on_token, should_stop
        self.tokens: list[int] = []
        self.gen = Generation(self.tokens, "", 0.0, first_logits)
        self.done = False
        self.kept = 0  # tokens of the last step's inputs whose KV stays
        # Longest draft for the next step, set by an owner that batches (None: the proposer's own length).
        # It changes how many tokens a pass checks, never which tokens are picked.
        self.draft_cap: int | None = None
        self.batch_rows = 1  # tokens the next pass decodes besides this answer's draft (its own and the batch's)
        self._feed: list[int] | None = None
        self._guess: list[int] = []
        self._t_start = t_start
        self._take(first_logits)

    def _pick(self, row: torch.Tensor) -> int:
        c = self.constraint
        return self.sampler.pick(row if c is None else c.mask(row, len(self.tokens)), len(self.tokens))

    def _commit(self, token: int) -> None:
        """The grammar sees every picked token, the answer every one but the end of the answer."""
        if self.constraint is not None:
            self.constraint.accept(token)
        if token not in self.stop_ids:
            self.tokens.append(token)
            if self.on_token is not None:
                self.on_token(self.tokens)

    def _take(self, logits: torch.Tensor) -> None:
        """Pick the next token from `logits` and commit it, or finish."""
        tok = self._pick(logits)
        if not self.tokens and not self.gen.ttft_s:
            self.gen.ttft_s = time.perf_counter() - (self._t_start or time.perf_counter())
        self._commit(tok)
        if tok in self.stop_ids:
            return self._end("eos")
        if len(self.tokens) >= self.max_new_tokens:
            return self._end("length")
        if self.should_stop is not None and self.should_stop():
            return self._end("cancel")
        self._feed = None

    def _end(self, why: str) -> None:
        self.gen.stopped = why
        self.done = True

    def inputs(self) -> list[int]:
        """This step's tokens: the last committed token, then a draft (the same list until consume())."""
        if self.done:
            raise RuntimeError("the answer is finished")
        if self._feed is None:
            # Tokens after the last one that may still be emitted: drafts beyond that would be wasted.
            room = self.max_new_tokens - len(self.tokens)
            if self.draft_cap is not None:
                room = min(room, self.draft_cap)
            guess = (self.drafts.propose(self.tokens, room, rows=self.batch_rows)
                     if self.drafts is not None and room > 0 else [])
            self._guess = list(guess[:room])
            self._feed = [self.tokens[-1]] + self._guess
        return self._feed

    def consume(self, rows: torch.Tensor) -> bool:
        """Logits of this step's inputs, one row each; returns whether the answer is finished."""
        self.inputs()
        guess = self._guess
        self.gen.forward_passes += 1
        accepted = 0
        ended = ""
        for j, d in enumerate(guess):
            if self._pick(rows[j]) != d:
                break
            self._commit(d)
            if d in self.stop_ids:  # the model itself would stop here
                ended = "eos"
                break
            accepted += 1
            if len(self.tokens) >= self.max_new_tokens:
                ended = "length"
                break
            if self.should_stop is not None and self.should_stop():
                ended = "cancel"
                break
        if guess and self.drafts is not None:  # (a guess comes from the drafts)
            self.gen.draft_proposed += len(guess)
            self.gen.draft_accepted += accepted
            self.drafts.feedback(len(guess), accepted)
        self.kept = 1 + accepted  # KV of the fed token and of the accepted drafts
        if ended:
            self._end(ended)
        else:
            self._take(rows[accepted])
        return self.done


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
    dec = Decoder(first_logits, max_new_tokens, sampler=sampler, stop_ids=stop_ids, drafts=drafts, t_start=t_start,
                  on_token=on_token, should_stop=should_stop, constraint=constraint)
    while not dec.done:
        base = cache_len()
        dec.consume(step(dec.inputs()))
        truncate(base + dec.kept)
    return dec.gen
