"""The passes SEMANTIC reuse runs besides a plain prefill: the first layers of a prompt for every token (their KV
and hidden rows, to choose which tokens to recompute), the rest of the layers for the chosen tokens at their own
slots, and the rotation of reused keys to new positions with each layer's own RoPE table. SemanticPasses is a part
ModelBackend (model_backend.py) owns; only the batch-invariant runner has the passes (the rotation needs only the
model's RoPE tables).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from .cache_handles import CacheHandles
from .kv_buffer import KVBuffer
from .llama_runner import LlamaRunner
from .rope_trig import rope_cos_sin
from .runner_early import EarlyHead
from .runner_layers import NO_ROPE


@dataclasses.dataclass
class EarlyStart:
    """ModelBackend.early_head's result: an early pass up to the choice of its rows (their KV in `cache`)."""

    ids: list[int]
    cache: KVBuffer
    part: EarlyHead  # its n_layers and start
    reran: bool = False  # early_layers ran it again from a lower token (pick named one of its prefix's)


class SemanticPasses:
    """ModelBackend's SEMANTIC passes: on its `runner` (None: none but rotate_keys), into caches from `caches`;
    `rotary`: the model's rotary embedding (its inverse frequencies), `head_dim` the KV heads' size."""

    def __init__(self, runner: LlamaRunner | None, caches: CacheHandles, rotary: Any, head_dim: int):
        self.runner = runner
        self.caches = caches
        self.rotary = rotary
        self.head_dim = head_dim
        self.layers = caches.kv_shape.layers
        self.device = caches.device

    def _runner(self) -> LlamaRunner:
        if self.runner is None:
            raise RuntimeError("early-layer KV needs the Llama runner")
        return self.runner

    @torch.inference_mode()
    def early_layers(self, ids: list[int], n_layers: int, pick: Callable[[torch.Tensor, torch.Tensor], list[int]]
                     | None = None, prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
                     head: "EarlyStart | None" = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(K, V [n_layers, H, n, D], hidden rows [R, E]) after the first n_layers, all tokens in order: fresh
        KV of the early layers at a fraction of a full prefill's cost. Hidden rows of every token, or only of
        the tokens `pick(K, V)` names (ascending positions): the last layer is then finished for those alone.
        With pick, `prefix` (k, v [>= n_layers, H, p, D]) may give the first p tokens' KV, bitwise what the pass
        would compute (an exact prefix at the model's precision): those tokens then do not run. `head`: an
        early_head of the same ids and layers computed before pick was known (it stands in for `prefix`); where
        pick then names a token of the prefix it took, the pass runs again from that token (the same bits)."""
        runner = self._runner()
        n_layers = min(n_layers, self.layers)
        if pick is None:
            cache = self.caches.new_cache(len(ids) + 2)
            h = runner.forward(torch.tensor(ids, device=self.device), torch.arange(len(ids), device=self.device),
                               cache, 0, logits="none", n_layers=n_layers)
            return cache.k[:n_layers, :, :len(ids)], cache.v[:n_layers, :, :len(ids)], h
        fits = head is not None and head.part.n_layers == n_layers and head.ids == list(ids)
        if head is None or not fits:
            head = self.early_head(ids, n_layers, prefix)
        cache, part, M = head.cache, head.part, len(ids)
        rows = torch.as_tensor(pick(cache.k[:n_layers, :, :M], cache.v[:n_layers, :, :M]), dtype=torch.long)
        rows = rows.sort().values
        if fits and rows.numel() and int(rows[0]) < part.start:  # slots below hold the prefix's KV: bitwise
            part = runner.early.early_head(torch.tensor(ids, device=self.device), cache, n_layers, int(rows[0]))
            head.reran = True
        h = runner.early.early_rows(part, cache, rows)
        return cache.k[:n_layers, :, :M], cache.v[:n_layers, :, :M], h

    @torch.inference_mode()
    def early_head(self, ids: list[int], n_layers: int, prefix: tuple[torch.Tensor, torch.Tensor] | None = None
                   ) -> "EarlyStart":
        """What early_layers computes before it asks pick: every token's KV of the first n_layers layers (the
        prefix's tokens taken from it, as there). It needs only the prompt, so the engine can run it while the
        fingerprint that decides whether a SEMANTIC plan follows is still being computed."""
        runner = self._runner()
        n_layers = min(n_layers, self.layers)
        cache = self.caches.new_cache(len(ids) + 2)
        ids_t = torch.tensor(ids, device=self.device)
        start = 0
        if prefix is not None:
            start = min(prefix[0].shape[2], len(ids) - 1)  # the last token always runs
            cache.k[:n_layers, :, :start] = prefix[0][:n_layers, :, :start]
            cache.v[:n_layers, :, :start] = prefix[1][:n_layers, :, :start]
            cache.length = start
        part = runner.early.early_head(ids_t, cache, n_layers, start)
        return EarlyStart(list(ids), cache, part)

    @torch.inference_mode()
    def resume_prefill(self, ids: list[int], cache, positions: list[int], hidden: torch.Tensor, first_layer: int
                       ) -> torch.Tensor:
        """Run `ids` at the slots of their `positions` (ascending) from layer `first_layer` on, from their hidden
        rows after the layers below (`hidden` [M, E], as an early pass over the same prompt computed them);
        returns the last token's logits. The cache holds every other position's KV and, in the layers below,
        these tokens' own. Semantic repair's recomputed tokens thus skip the layers its early pass already ran
        for every token."""
        pos = torch.tensor(positions, device=self.device)
        out = self._runner().forward(torch.tensor(ids, dtype=torch.long, device=self.device), pos, cache, 0, slots=pos,
                                  logits="last", hidden=hidden, first_layer=first_layer)
        return out[-1]

    def rotate_keys(self, k: torch.Tensor, delta: torch.Tensor, first_layer: int = 0) -> torch.Tensor:
        """Move post-RoPE keys [L, H, n, D] of layers first_layer.. by `delta` positions each ([n] ints):
        R(p+d) = R(d) R(p), each layer with its own RoPE table (Gemma 3's sliding and full layers have their own
        bases)."""
        tables = self.rope_inv_freqs()
        of = self.runner.rope_of[first_layer:first_layer + k.shape[0]] if self.runner is not None else [0] * k.shape[0]
        kf = k.float()
        rot = 2 * tables[0].shape[-1]  # RoPE's rotated part of a head (Phi-4-mini's 96 of 128): the rest stays
        if rot < kf.shape[-1] and all(2 * f.shape[-1] == rot for f in tables):
            return torch.cat((self.rotate_keys(k[..., :rot], delta, first_layer), k[..., rot:]), dim=-1)
        half = kf.shape[-1] // 2
        rotated_half = torch.cat((-kf[..., half:], kf[..., :half]), dim=-1)
        out = None
        for t, inv_freq in enumerate(tables):
            layers = [i for i, r in enumerate(of) if r == t]
            if not layers:
                continue
            freqs = delta.to(k.device, torch.float32)[:, None] * inv_freq.to(k.device, torch.float32)[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)  # [n, D]: every tensor on k's device
            cos, sin = rope_cos_sin(emb)  # the tables' own bits (skeleton.RotaryEmbedding), on every CPU
            # No attention_scaling here: it multiplied cos/sin once at encoding, and a relative rotation
            # of an already-encoded key must not apply it a second time.
            if len(layers) == len(of):
                return (kf * cos + rotated_half * sin).to(k.dtype)
            if out is None:
                out = torch.empty_like(k)
            at = torch.tensor(layers, device=k.device)
            out[at] = (kf[at] * cos + rotated_half[at] * sin).to(k.dtype)
        return out

    def rope_inv_freqs(self) -> list[torch.Tensor]:
        """The inverse frequencies of each RoPE table, in the runner's order (rope_types; one without a runner)."""
        rot = self.rotary
        types = self.runner.rope_types if self.runner is not None else [None]
        if types == [None]:
            return [rot.inv_freq]
        tables = getattr(rot, "tables", None)  # our skeleton's, else transformers' per-type buffers

        def inv_freq(t: str | None) -> torch.Tensor:
            if t == NO_ROPE:  # SmolLM3's layers without RoPE: a zero turn
                return torch.zeros(self.head_dim // 2)
            if tables is not None:
                return tables[t][0]
            return rot.inv_freq if t is None else getattr(rot, f"{t}_inv_freq")

        return [inv_freq(t) for t in types]
