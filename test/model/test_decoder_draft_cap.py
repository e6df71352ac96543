"""The batching owner caps a decoder's draft (Decoder.draft_cap): fewer tokens per pass, the same answer.
No model: a deterministic toy "model" whose next token is a function of the text so far."""
import torch

from simllm_ros.model.decoding import Decoder, DraftSource, Sampler

VOCAB = 50
STOP = 0


def next_token(text: list[int]) -> int:
    return STOP if len(text) >= 20 else (7 * len(text) + sum(text)) % (VOCAB - 1) + 1


def logits_for(token: int) -> torch.Tensor:
    row = torch.zeros(VOCAB)
    row[token] = 1.0
    return row


class Oracle(DraftSource):
    """Proposes the true continuation, except one wrong token every 5 (so some drafts are cut short)."""

    def propose(self, generated, limit, rows=1):
        out, text = [], list(generated)
        while len(out) < limit:
            t = next_token(text)
            if t == STOP:
                break
            out.append(t if (len(text) % 5) else (t % (VOCAB - 1)) + 1)
            text.append(t)
        return out


def run(cap):
    dec = Decoder(logits_for(next_token([])), 40, sampler=Sampler(), stop_ids={STOP}, drafts=Oracle())
    fed = []
    while not dec.done:
        dec.draft_cap = cap
        ids = dec.inputs()
        fed.append(len(ids))
        # the row for input j predicts what follows the committed text plus ids[1:j+1]
        rows = torch.stack([logits_for(next_token(dec.tokens + ids[1:j + 1])) for j in range(len(ids))])
        dec.consume(rows)
    return dec.tokens, fed


def test_capped_drafts_give_the_same_answer_in_smaller_passes():
    free, fed_free = run(None)
    assert free and free == [t for t in free if t != STOP]
    for cap in (0, 1, 3):
        tokens, fed = run(cap)
        assert tokens == free, cap
        assert max(fed) <= 1 + cap, (cap, fed)
    assert max(fed_free) > 4  # uncapped, the proposer's own length was used


def test_generate_reports_each_steps_whole_cost_with_its_rows():
    """Pass costs are learnt from what generate reports (on_pass): a step's whole cost, the draft's proposal and
    the check of its rows included, with the step's row count, so that a draft is priced by what its step costs."""
    import time

    from simllm_ros.model.decoding import generate

    class SlowOracle(Oracle):
        def propose(self, generated, limit, rows=1):
            time.sleep(0.02)  # a proposer's search that costs beside the pass
            return super().propose(generated, limit, rows)

    fed: list[int] = []  # the cache: tokens run and kept
    heard: list[tuple[int, float]] = []

    def run_step(ids):  # row j predicts what follows the cache plus ids[:j+1] (ids[0]: the token last picked)
        rows = torch.stack([logits_for(next_token(fed + list(ids[:j + 1]))) for j in range(len(ids))])
        fed.extend(ids)
        return rows

    def truncate(n):
        del fed[n:]

    gen = generate(run_step, truncate, lambda: len(fed), logits_for(next_token([])), 40, sampler=Sampler(),
                   stop_ids={STOP}, drafts=SlowOracle(), on_pass=lambda rows, s: heard.append((rows, s)))
    assert gen.tokens == run(None)[0] and heard and any(rows > 1 for rows, _ in heard)
    assert all(s >= 0.02 for _, s in heard), heard  # every step proposed: its 20 ms are in its cost
