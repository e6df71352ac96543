"""LlamaRunner's early passes: the first layers of a prompt with the last of them finished only for the rows
SEMANTIC repair recomputes, split in two (early_head, early_rows) so that the part before the rows are chosen runs
while the request's fingerprint is computed. EarlyPasses is a part the runner owns: it runs the runner's passes
(RunnerPass) and its layers' steps (LayerSteps)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import torch

from ..kernels import attention_kernel
from .kv_buffer import KVBuffer
from .runner_layers import LayerSteps


@dataclasses.dataclass
class EarlyHead:
    """An early pass before its rows are chosen (LlamaRunner.early_head): the last early layer's input rows
    and RoPE tables of tokens start..m-1, their keys and values, and their queries where the product could not
    be split (else early_rows computes the chosen rows' alone)."""

    n_layers: int
    start: int
    m: int
    h: torch.Tensor  # [1, m - start, E]: hidden rows entering the last early layer
    x: torch.Tensor  # [m - start, E]: the same after its input norm
    cos: torch.Tensor
    sin: torch.Tensor
    q: torch.Tensor | None
    k: torch.Tensor  # [m - start, Hkv, D], rotated
    v: torch.Tensor


class RunnerPass(Protocol):
    """What the early passes take of the runner: its forward pass, whether a lone row may run alone and its attention
    kernel (None: the torch path), as they are at the call."""

    single_rows: bool
    kernel: attention_kernel.AttentionKernel | None

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, kv: KVBuffer, start: int,
                slots: torch.Tensor | None = None, logits: str = "last", n_layers: int | None = None,
                hidden: torch.Tensor | None = None, first_layer: int = 0, _single: bool = False
                ) -> torch.Tensor | None: ...


class EarlyPasses:
    """The early passes of `runner`'s model, with its layers' `steps`."""

    def __init__(self, runner: RunnerPass, steps: LayerSteps):
        self.runner = runner
        self.steps = steps

    @torch.inference_mode()
    def early_pass(self, ids: torch.Tensor, kv: KVBuffer, n_layers: int,
                   pick: Callable[[torch.Tensor, torch.Tensor], "torch.Tensor | list[int]"], start: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `n_layers` layers over a whole prompt (positions 0..M-1, slots 0..M-1 of `kv`), finishing
        the last of them only for the rows `pick` asks for: returns (those rows [R] sorted, hidden [R, E]).
        Slots 0..start-1 may already hold those layers' KV of the first tokens (an exact prefix: bitwise what
        the pass computes), which then run no more; pick's rows are then all >= start.

        `pick(k, v)` sees every token's fresh KV of those layers ([n_layers, Hkv, M, D]); its rows are the
        only ones whose hidden state is used later (semantic repair's recomputed tokens), and the last layer's
        attention output and MLP are most of its cost. Each picked row attends its own prefix, so the rows
        and KV are bitwise those of the whole pass (row-invariant kernels; kernel or torch path alike)."""
        head = self.early_head(ids, kv, n_layers, start)
        M = ids.shape[0]
        rows = torch.as_tensor(pick(kv.k[:n_layers, :, :M], kv.v[:n_layers, :, :M]), dtype=torch.long).sort().values
        return rows, self.early_rows(head, kv, rows)

    @torch.inference_mode()
    def early_head(self, ids: torch.Tensor, kv: KVBuffer, n_layers: int, start: int = 0) -> "EarlyHead":
        """early_pass up to the choice of rows: every token's KV of the first n_layers layers written to `kv`
        (slots start..M-1; 0..start-1 must hold them already) and what early_rows needs to finish the last
        layer for the rows chosen from that KV. Split off so that it can run before the choice is known (while
        a request's fingerprint is computed, speculatively)."""
        M = ids.shape[0]
        positions = torch.arange(start, M, device=ids.device)
        st = self.steps
        first = self.runner.forward(ids[start:], positions, kv, start, logits="none", n_layers=n_layers - 1)
        assert first is not None  # n_layers: the hidden rows
        h = first[None]  # [1, M', E]
        li = n_layers - 1
        ln1, qkv_proj = st.layers[li][:2]
        cos, sin = st.rope_tables(h, positions)
        x = ln1(h)[0]
        # Every token needs only its keys and values here (pick reads them); queries only the picked rows do.
        # Our kernel computes those outputs alone, bitwise as the whole product does; RoPE is per element.
        q = None
        if qkv_proj.parts is not None:
            Hkv, D = st.n_kv, st.head_dim
            kv_rows = qkv_proj.columns(x, st.q_size, st.q_size + 2 * st.kv_size)  # [M', 2 kv]
            k = st.rotate(st.head_norm(li, 1, kv_rows[:, :st.kv_size].view(-1, Hkv, D)),
                          cos[st.rope_of[li]], sin[st.rope_of[li]])
            v = kv_rows[:, st.kv_size:].view(-1, Hkv, D)
        else:
            q, k, v = st.rotated_rows(qkv_proj(x), cos, sin, li)  # [M', Hq, D], [M', Hkv, D] x 2
        kv.k[li, :, start:M] = k.transpose(0, 1)
        kv.v[li, :, start:M] = v.transpose(0, 1)
        kv.length = max(kv.length, M)
        return EarlyHead(n_layers, start, M, h, x, cos, sin, q, k, v)

    @torch.inference_mode()
    def early_rows(self, head: "EarlyHead", kv: KVBuffer, rows: torch.Tensor) -> torch.Tensor:
        """The hidden rows [R, E] after early_head's last layer of `rows` (ascending positions >= head.start),
        that layer finished for them alone; `kv` is the buffer early_head wrote."""
        start, M, h, x, cos, sin = head.start, head.m, head.h, head.x, head.cos, head.sin
        if rows.numel() == 0:
            return h.new_empty(0, h.shape[-1])
        if int(rows[0]) < start:
            raise ValueError(f"early pass: row {int(rows[0])} is in the {start}-token prefix it did not run")
        st, kernel = self.steps, self.runner.kernel
        li = head.n_layers - 1
        _, qkv_proj, o_proj, ln2, gate_up, down, act = st.layers[li]
        cos, sin = cos[st.rope_of[li]], sin[st.rope_of[li]]
        as_is = rows.numel() > 1 or self.runner.single_rows  # one row is padded to two unless single rows may be
        run = rows - start if as_is else torch.cat([rows, rows]) - start
        R, D = run.numel(), st.head_dim
        if head.q is None:
            q = st.rotate(st.head_norm(li, 0, qkv_proj.columns(x[run], 0, st.q_size).view(R, st.n_heads, D)),
                          cos[run], sin[run])
        else:
            q = head.q[run]
        if kernel is not None:
            # The rows at their own slots (their new KV is what the slots hold: the same bits written again),
            # each attending the slots up to its own: the keys and values it attends in the whole pass, read once
            # for all rows rather than once per row, the same bits.
            # On a sliding layer each row reads its window, as in the whole pass.
            plan = st.window_plan_at(run + start, kv.k, kv.v) if st.window[li] else \
                kernel.plan([(0, R, 0, kv.k, kv.v, 0, 0, run + start)])
            o = kernel.attend(plan, li, q, head.k[run], head.v[run], st.scale, softcap=st.attn_softcap)
        else:
            G, at = st.group, (run + start).to(x.device)
            qg = (q * st.scale).transpose(0, 1).reshape(st.n_kv, G * R, D)
            # (over the whole pass's M keys, as it reads them; a sliding layer's rows their window of them)
            blocked = st.window_mask(0, R, at, M)[st.window[li]] if st.window[li] else st.slot_mask(at, M)
            o = st.attention(qg, kv.k[li, :, :M], kv.v[li, :, :M], blocked)
            o = o.reshape(st.n_heads, R, D).transpose(0, 1)
        out = st.mlp(st.attended(h[:, run], o_proj(o.reshape(1, R, st.n_heads * D)), li),
                     ln2, gate_up, down, act, li)
        return out[0, :rows.numel()]
