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
