"""Per-request records and the figures computed from them: latency percentiles, agreement with a reference.

Why it exists: every system, ours or a peer, is judged by the same arithmetic; keeping it apart from
the systems and the runner makes the figures easy to check and to reuse on saved results.
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Rec:
    """One request served by one system."""

    i: int
    tier: str = "MISS"  # MISS / EXACT_PREFIX / SEMANTIC / ANSWER (simllm), HIT / MISS (peers)
    hit: bool = False
    ttft_ms: float = 0.0
    total_ms: float = 0.0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    answer: str = ""
    error: str = ""
    first_logits: object = None  # torch tensor [vocab] or None (not kept in the JSON)
    timing: dict = dataclasses.field(default_factory=dict)  # engine overhead parts, ms
    # quality against the reference (filled later)
    agreement: float | None = None
    identical: bool | None = None
    rouge_l: float | None = None
    kl: float | None = None

    def row(self) -> dict:
        d = {"i": self.i, "tier": self.tier, "hit": self.hit, "ttft_ms": round(self.ttft_ms, 2),
             "total_ms": round(self.total_ms, 2), "prompt_tokens": self.prompt_tokens,
             "reused_tokens": self.reused_tokens, "answer": self.answer}
        for k in ("agreement", "rouge_l", "kl"):
            v = getattr(self, k)
            d[k] = None if v is None else round(float(v), 5)
        d["identical"] = self.identical
        if self.timing:
            d["timing_ms"] = {k: round(v, 3) for k, v in self.timing.items()}
        if self.error:
            d["error"] = self.error
        return d


def percentile(xs, q) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(np.percentile(xs, q)) if xs else None


def mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(np.mean(xs)) if xs else None


def token_agreement(ref: list[int], hyp: list[int]) -> float:
    """Share of positions where the greedy tokens agree, over the longer of the two answers."""
    n = max(len(ref), len(hyp))
    if n == 0:
        return 1.0
    return sum(a == b for a, b in zip(ref, hyp)) / n


def kl_first_token(ref_logits, hyp_logits) -> float | None:
    """KL(p_ref || p_hyp) of the first next-token distributions, in nats."""
    # local: torch for this measure only; concurrency and the reports import this module without it
    import torch

    if ref_logits is None or hyp_logits is None:
        return None
    r = torch.as_tensor(ref_logits).double().flatten()
    h = torch.as_tensor(hyp_logits).double().flatten()
    if r.shape != h.shape:
        return None
    lp, lq = torch.log_softmax(r, -1), torch.log_softmax(h, -1)
    return float((lp.exp() * (lp - lq)).sum().clamp(min=0.0))


def score(recs: list[Rec], refs: list[Rec], tok) -> None:
    # local: rouge_score (with nltk and absl) loads only when answers are scored
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
    for rec in recs:
        if rec.error or rec.i >= len(refs) or refs[rec.i].error:
            continue
        ref = refs[rec.i]
        a = tok(ref.answer, add_special_tokens=False)["input_ids"]
        b = tok(rec.answer, add_special_tokens=False)["input_ids"]
        rec.agreement = token_agreement(a, b)
        rec.identical = ref.answer == rec.answer
        if not ref.answer.strip() and not rec.answer.strip():
            rec.rouge_l = 1.0
        else:
            rec.rouge_l = scorer.score(ref.answer, rec.answer)["rougeL"].fmeasure
        rec.kl = kl_first_token(ref.first_logits, rec.first_logits)


def summarize(recs: list[Rec]) -> dict:
    ok = [r for r in recs if not r.error]
    out: dict = {"n": len(recs), "errors": len(recs) - len(ok)}
    if recs and not ok:
        out["first_error"] = recs[0].error
    if not ok:
        return out
    out.update({
        "ttft_p50_ms": percentile([r.ttft_ms for r in ok], 50), "ttft_p95_ms": percentile([r.ttft_ms for r in ok], 95),
        "total_p50_ms": percentile([r.total_ms for r in ok], 50),
        "total_p95_ms": percentile([r.total_ms for r in ok], 95),
        "hit_rate": sum(r.hit for r in ok) / len(ok),
        "reused_token_share": sum(r.reused_tokens for r in ok) / max(1, sum(r.prompt_tokens for r in ok)),
        "agreement": mean([r.agreement for r in ok]), "identical": mean([r.identical for r in ok]),
        "rouge_l": mean([r.rouge_l for r in ok]), "kl_mean": mean([r.kl for r in ok]),
        "kl_p95": percentile([r.kl for r in ok], 95),
    })
    tiers = {}
    for t in sorted({r.tier for r in ok}):
        rs = [r for r in ok if r.tier == t]
        tiers[t] = {"n": len(rs), "rate": len(rs) / len(ok),
                    "ttft_p50_ms": percentile([r.ttft_ms for r in rs], 50),
                    "ttft_p95_ms": percentile([r.ttft_ms for r in rs], 95),
                    "total_p50_ms": percentile([r.total_ms for r in rs], 50),
                    "reused_token_share": sum(r.reused_tokens for r in rs) / max(1, sum(r.prompt_tokens for r in rs)),
                    "agreement": mean([r.agreement for r in rs]), "identical": mean([r.identical for r in rs]),
                    "rouge_l": mean([r.rouge_l for r in rs]), "kl_mean": mean([r.kl for r in rs])}
    out["tiers"] = tiers
    timed = [r.timing for r in ok if r.timing]
    if timed:
        out["timing_p50_ms"] = {k: percentile([t.get(k) for t in timed], 50) for k in timed[0]}
    return out
