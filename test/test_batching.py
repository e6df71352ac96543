"""Continuous batching: several requests decoded in one forward pass per step give the answers they get alone.

Real model (SmolLM2, bfloat16 as by default), real runner, real engine, real request server thread. Claims:
- the batched forward gives every sequence bitwise the logits and KV of running it alone (ragged lengths,
  drafts, single tokens, prefill chunks), on this batch-invariant platform;
- decoders stepped together (drafts, greedy and sampled) produce the tokens of decode() one at a time.
"""
from __future__ import annotations

import random

import pytest
import torch

from simllm_ros.decoding import DraftSource
from simllm_ros.draft_proposer import DraftProposer
from simllm_ros.llama_runner import Seq

from core_fixtures import BULLETIN, shared_engine

NATIVE_BF16 = bool(getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)())
pytestmark = pytest.mark.skipif(not NATIVE_BF16, reason="no native bfloat16 here: the platform is not batch-"
                                "invariant, and the backend runs a batch one sequence after another")


@pytest.fixture(scope="module")
def engine():
    e = shared_engine(dtype="bfloat16", kv_bits=0)
    assert e.backend.batches_exactly, "the load-time invariance probe failed on this machine"
    return e


def _ids(engine, question, context=BULLETIN):
    return engine.backend.prompt_ids(engine.settings.system_prompt, context, question)


def test_batched_forward_equals_one_at_a_time_bitwise(engine):
    b = engine.backend
    rng = random.Random(11)
    vocab = len(b.tokenizer)
    checked = singles = 0
    for trial in range(8):
        n = rng.randint(1, 6)
        prefixes = [[rng.randrange(100, vocab) for _ in range(rng.randint(1, 80))] for _ in range(n)]
        # decode steps (one token), verification passes (token + draft), prefill chunks; an empty one too
        feeds = [[rng.randrange(100, vocab) for _ in range(rng.choice([0, 1, 1, 1, 2, 5, 9, 33]))] for _ in range(n)]
        if trial == 0:
            feeds = [[7]] + [[] for _ in feeds[1:]]  # one row in the whole pass
        if not any(feeds):
            feeds[0] = [5]
        modes = [rng.choice(["all", "last", "none"]) for _ in range(n)]
        alone, together = [], []
        for p, f in zip(prefixes, feeds):
            for caches in (alone, together):
                c = b.new_cache(len(p) + len(f) + 2)
                b.run(p, c, logits="none")
                caches.append(c)
        refs = [b.runner.forward(torch.tensor(f), torch.arange(len(p), len(p) + len(f)), c, len(p), logits=m)
                if f else None for p, f, c, m in zip(prefixes, feeds, alone, modes)]
        outs = b.runner.forward_batch([Seq(torch.tensor(f, dtype=torch.long), torch.arange(len(p), len(p) + len(f)),
                                           c, len(p), m) for p, f, c, m in zip(prefixes, feeds, together, modes)])
        for i, (p, f, m) in enumerate(zip(prefixes, feeds, modes)):
            where = f"trial {trial}, sequence {i}: prefix {len(p)}, {len(f)} tokens, logits {m!r}, feeds " \
                    f"{[len(x) for x in feeds]}"
            if f and m != "none":
                assert outs[i] is not None and torch.equal(outs[i], refs[i]), where
            else:
                assert outs[i] is None, where
            end = len(p) + len(f)
            assert together[i].length == alone[i].length == end, where
            assert torch.equal(together[i].k[:, :, :end], alone[i].k[:, :, :end]), where
            assert torch.equal(together[i].v[:, :, :end], alone[i].v[:, :, :end]), where
            checked += 1
            singles += len(f) == 1
    assert singles >= 3
    print(f"\n[batched forward] {checked} sequences in 8 ragged passes bitwise equal to one at a time "
          f"({singles} single tokens)")


class FixedDrafts(DraftSource):
    def __init__(self, seq, fallback=()):
        self.seq, self.fallback = list(seq), list(fallback)

    def propose(self, generated, limit):
        n = len(generated)
        if self.seq[:n] == generated and len(self.seq) > n:
            return self.seq[n:n + limit]
        return self.fallback[:limit]


@pytest.mark.parametrize("temperature,seed", [(0.0, 0), (0.9, 5)])
def test_decoders_stepped_together_equal_decode_alone(engine, temperature, seed):
    b = engine.backend
    questions = ["is it going to rain today", "which bus line runs late tonight", "where can i get diesel",
                 "is the pharmacy open now"]
    prompts = [_ids(engine, q) for q in questions]
    max_new = 14
    plain = []
    for ids in prompts:
        logits, cache = b.prefill(ids, reserve=max_new + 40)
        plain.append(b.decode(logits, cache, max_new, temperature, seed).tokens)
    rng = random.Random(2)
    wrong = [rng.randrange(100, len(b.tokenizer)) for _ in range(40)]
    drafts = [FixedDrafts(plain[0]), FixedDrafts([], wrong), DraftProposer(prompt=prompts[2], max_tokens=8), None]
    work = []
    for ids, d in zip(prompts, drafts):
        logits, cache = b.prefill(ids, reserve=max_new + 40)
        work.append((b.decoder(logits, max_new, temperature, seed, drafts=d), cache))
    steps = widest = 0
    while any(not dec.done for dec, _ in work):
        live = [(dec, c) for dec, c in work if not dec.done]
        bases = [b.cache_len(c) for _, c in live]
        outs = b.run_batch([(dec.inputs(), c, "all") for dec, c in live])
        widest = max(widest, sum(len(dec.inputs()) for dec, _ in live))
        for (dec, c), base, rows in zip(live, bases, outs):
            b.finish_step(dec, c, base, rows)
        steps += 1
    for q, (dec, _), ref in zip(questions, work, plain):
        assert dec.gen.tokens == ref, f"{q!r}: stepped together {dec.gen.tokens} != alone {ref}"
    assert steps < sum(len(t) for t in plain)
    print(f"\n[decoders together T={temperature}] 4 answers identical to decode() alone in {steps} shared passes "
          f"(widest {widest} rows)")
