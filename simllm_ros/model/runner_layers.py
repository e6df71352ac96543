"""LlamaRunner's steps inside a layer, shared by its passes (llama_runner's module doc says why each is
row-invariant): the torch path's batched layers, attention and masks where the attention kernel does not run,
the kernel's plans for sliding windows, RoPE tables and rotation, per-head q/k norms, the MLP and the residuals
(Gemma's norms after attention and MLP), and the final logit soft-capping. LayerSteps is a part the runner owns,
made from the values of the model's layers it needs."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..kernels import attention_kernel, layer_kernel
from . import skeleton
from .kv_buffer import Seq
from .runner_weights import Norm, Proj


# The RoPE kind of a layer that attends without positions (SmolLM3's NoPE layers): its table leaves a row as it is
NO_ROPE = "no_rope"
# Positions whose RoPE tables a runner keeps (`rope_tables`; 8192 x D=128 floats, 4 MiB each of cos and sin)
ROPE_CACHE_POSITIONS = 8192


def _no_rotation(h: torch.Tensor, positions: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos 1 and sin 0 [1, M, D] for `positions`' rows: x * 1 + roll(x) * 0 is x (a zero's sign aside)."""
    shape = (1, positions.shape[0], dim)
    return torch.ones(shape, dtype=h.dtype, device=h.device), torch.zeros(shape, dtype=h.dtype, device=h.device)


# A layer as the runner holds it: input norm, fused q/k/v, o, the norm before the MLP, fused gate/up, down, activation
Layer = tuple[Norm, Proj, Proj, Norm, Proj, Proj, Callable[[torch.Tensor], torch.Tensor]]


class LayerSteps:
    """The steps inside a layer of one model: `layers`; its heads (n_heads query heads of head_dim, n_kv KV heads,
    queries scaled by `scale`); `inter`, the MLP's width; `rotary` and its RoPE kinds (`rope_types`, layer li's
    `rope_of[li]`; `partner`: each dimension's RoPE pair where RoPE turns part of a head, None for the whole);
    `window` per layer (0: full attention); the per-head q/k norms and the norms after attention and MLP; the
    final and the attention scores' soft caps; the C layers (`fused`, for their activation) and the attention
    `kernel` (for window plans), either None."""

    def __init__(self, *, layers: list[Layer], n_heads: int, n_kv: int, head_dim: int, scale: float, inter: int,
                 rotary: Any, rope_types: list[str | None], rope_of: list[int], partner: torch.Tensor | None,
                 window: list[int], qk_norms: list[tuple[Norm, Norm] | None],
                 post_norms: list[tuple[Norm, Norm] | None], softcap: float | None, attn_softcap: float | None,
                 fused: layer_kernel.Layers | None, kernel: attention_kernel.AttentionKernel | None,
                 device: torch.device):
        self.layers = layers
        self.n_heads, self.n_kv, self.head_dim = n_heads, n_kv, head_dim
        self.group = n_heads // n_kv
        self.q_size, self.kv_size = n_heads * head_dim, n_kv * head_dim
        self.scale = scale
        self.inter = inter
        self.rotary = rotary
        self.rope_types = rope_types
        self.rope_of = rope_of
        self.partner = partner
        self.window = window
        self.windowed = any(window)
        self.qk_norms = qk_norms
        self.post_norms = post_norms
        self.softcap = softcap
        self.attn_softcap = attn_softcap
        self.fused = fused
        self.kernel = kernel
        self.device = device

    def _plan_kernel(self) -> attention_kernel.AttentionKernel:
        if self.kernel is None:
            raise RuntimeError("a window plan needs the attention kernel")
        return self.kernel

    def torch_batch_layers(self, seqs: list[Seq], spans: list[tuple[int, int]], h: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor, total: int) -> torch.Tensor:
        """forward_batch's layers without the kernel: attention per sequence through `attention`."""
        G, D, Hkv, Hq = self.group, self.head_dim, self.n_kv, self.n_heads
        blocked = []  # per sequence: True where a query may not attend (later slots, from column s.start on)
        windows: list[Any] = []  # per sequence, sliding layers: {window: mask over every slot} (None: no rows)
        for s, (a, b) in zip(seqs, spans):
            m, end = b - a, s.start + b - a
            if m > 1:  # causal by slot, as `forward` builds it; query heads grouped by KV head
                own = torch.arange(s.start, end, device=h.device)
                blocked.append((own[None, :] > own[:, None]).repeat(G, 1))
            else:
                blocked.append(None)
            windows.append(self.window_mask(s.start, m) if self.windowed and m else None)
        for li, (ln1, qkv_proj, o_proj, ln2, gate_up, down, act) in enumerate(self.layers):
            x = ln1(h)
            q, k, v = self.split_rotated(qkv_proj(x)[0], cos, sin, li)  # [Hq, N, D], [Hkv, N, D] x 2
            q = q * self.scale  # once for every sequence (elementwise: the same bits as per sequence)
            attn = h.new_empty(total, Hq, D)  # each sequence's attention output lands in its rows
            for s, (a, b), seq_blocked, seq_windows in zip(seqs, spans, blocked, windows):
                m = b - a
                if not m:
                    continue
                end = s.start + m
                s.kv.k[li, :, s.start:end] = k[:, a:b]
                s.kv.v[li, :, s.start:end] = v[:, a:b]
                qg = q[:, a:b].reshape(Hkv, G * m, D)
                if self.window[li]:
                    o = self.attention(qg, s.kv.k[li, :, :end], s.kv.v[li, :, :end], seq_windows[self.window[li]])
                else:
                    o = self.attention(qg, s.kv.k[li, :, :end], s.kv.v[li, :, :end], seq_blocked, s.start)
                attn[a:b] = o.view(Hq, m, D).transpose(0, 1)
            h = self.mlp(self.attended(h, o_proj(attn.view(1, total, Hq * D)), li), ln2, gate_up, down, act, li)
        return h

    def mlp(self, h: torch.Tensor, ln2, gate_up, down, act, li: int) -> torch.Tensor:
        """A layer's second half, residual included: the same ops for every pass (one fused gate/up product)."""
        gu = gate_up(ln2(h))
        if self.fused is not None:  # the C layers' SiLU (or GELU), so that this layer computes as theirs do
            y = down(self.fused.act_mul(gu))
        else:
            y = down(act_rows(act, gu[..., :self.inter]) * gu[..., self.inter:])
        post = self.post_norms[li]
        return h + (y if post is None else post[1](y))

    def attended(self, h: torch.Tensor, o: torch.Tensor, li: int) -> torch.Tensor:
        """The residual after layer li's attention output o (o_proj applied): Gemma normalizes o first."""
        post = self.post_norms[li]
        return h + (o if post is None else post[0](o))

    @staticmethod
    def shared_entries(seqs: list["Seq"], spans: list[tuple[int, int]]) -> list[tuple]:
        """The attention kernel's sequences of a pass (those with rows), with the shared prefixes that still hold:
        a sequence shares only with a lead that has rows in the pass and leads itself."""
        index: dict[int, int] = {}
        entries: list[tuple] = []
        for i, (s, (a, b)) in enumerate(zip(seqs, spans)):
            if b == a:
                continue
            e: tuple = (a, b - a, s.start, s.kv.k, s.kv.v)
            lead = index.get(s.lead) if s.shared and s.lead != i else None
            if s.shared and s.lead == i:
                e += (len(entries), s.shared)
            elif lead is not None and len(entries[lead]) > 5 and entries[lead][6] == s.shared:
                e += (lead, s.shared)
            index[i] = len(entries)
            entries.append(e)
        return entries

    def rotated_rows(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, li: int):
        """q [M, Hq, D], k, v [M, Hkv, D] of layer li's fused qkv product [M, q + 2kv], q and k rotated together (4
        ops instead of 14 per layer): row-major views, which the kernel reads in place (no transposes). Where the
        layer has per-head q/k norms (Qwen3), each head's row is normalized first, on its own."""
        M, D, Hq, Hkv = qkv.shape[0], self.head_dim, self.n_heads, self.n_kv
        qk = qkv[:, :self.q_size + self.kv_size].view(M, Hq + Hkv, D)
        if self.qk_norms[li] is not None:
            qk = torch.cat([self.head_norm(li, 0, qk[:, :Hq]), self.head_norm(li, 1, qk[:, Hq:])], dim=1)
        qk = self.rotate(qk, cos[self.rope_of[li]], sin[self.rope_of[li]])
        return qk[:, :Hq], qk[:, Hq:], qkv[:, self.q_size + self.kv_size:].view(M, Hkv, D)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on rows of heads x [M, H, D] with `rope_tables`' cos, sin [M, 1, D] (per element: a subset of the
        heads or rows gets the bits it gets with the others); on part of each head, each rotated dimension with its
        pair's (`partner`), the rest times cos 1 plus itself times sin 0."""
        other = x.roll(x.shape[-1] // 2, dims=-1) if self.partner is None else x[..., self.partner]
        return x * cos + other * sin

    def rope_tables(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, M, 1, D] for the rows' positions, one table per RoPE kind (T = 1 but for Gemma's sliding
        and full layers; layer li's is [rope_of[li]]), sin with its first half negated: then x * cos + roll(x,
        D/2) * sin is HF's x * cos + rotate_half(x) * sin, bitwise ((-a) * b == a * (-b)).

        Static RoPE (our RotaryEmbedding) on the CPU: rows of tables computed once for positions 0..P-1
        (`_rope_cached`), since a decode step's ~20 small float64 ops for one position were a serial part of every
        step. Every op of the tables is elementwise, so a position's row has the same bits computed alone or among
        others."""
        if h.device.type == "cpu" and isinstance(self.rotary, skeleton.RotaryEmbedding) and positions.numel() \
                and positions.device.type == "cpu":
            top = int(positions.max())
            if 0 <= int(positions.min()) and top < ROPE_CACHE_POSITIONS:
                cos, sin = self._rope_cached(h.dtype, top)
                return cos[:, positions], sin[:, positions]
        return self.rope_computed(h, positions)

    def _rope_cached(self, dtype: torch.dtype, top: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope_computed`'s tables [T, P, 1, D] of positions 0..P-1, P grown (by doubling, at least 512) past
        `top`."""
        cache = self.__dict__.setdefault("_rope_cache", {})
        have = cache.get(dtype)
        if have is None or have[0].shape[1] <= top:
            n = max(512, 1 << top.bit_length())
            have = cache[dtype] = self.rope_computed(torch.empty(0, dtype=dtype), torch.arange(n))
        return have

    def rope_computed(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope_tables`' tables, computed for these positions (h gives the dtype and device only)."""
        tables = [self.rotary(h, positions[None]) if t is None else _no_rotation(h, positions, self.head_dim)
                  if t == NO_ROPE else self.rotary(h, positions[None], t) for t in self.rope_types]  # each [1, M, w]
        cos, sin = [], []
        for c, s in tables:
            w, half = s.shape[-1], s.shape[-1] // 2
            s = torch.cat((-s[..., :half], s[..., half:]), dim=-1)
            if w < self.head_dim:  # RoPE on part of the head: the rest times 1, its partner (itself) times 0
                pad = self.head_dim - w
                c = torch.cat((c, c.new_ones(*c.shape[:-1], pad)), -1)
                s = torch.cat((s, s.new_zeros(*s.shape[:-1], pad)), -1)
            cos.append(c)
            sin.append(s)
        return torch.cat(cos)[:, :, None], torch.cat(sin)[:, :, None]

    def capped(self, logits: torch.Tensor) -> torch.Tensor:
        """Gemma's final soft-capping, cap * tanh(logits / cap), where the config sets one (row by row)."""
        if self.softcap is None:
            return logits
        cap = float(self.softcap)
        return act_rows(torch.tanh, logits / cap) * cap

    def window_plan(self, seqs: list[tuple]) -> "attention_kernel.PassPlan":
        """The attention kernel's plan for sliding-window layers, seqs (row0, m, start, k, v): a row at slot s
        reads slots s - window + 1 .. s only. Rows whose window begins at slot 0 run as their sequence's causal
        rows; each later one as a sequence of its own over a view of its buffer that begins where its window
        does (its keys in the same order whatever runs with it: row-invariant)."""
        W = max(self.window)
        entries = []
        for row0, m, start, k, v in seqs:
            head = max(0, min(m, W - start))  # rows at slots < W see every slot up to theirs
            if head:
                entries.append((row0, head, start, k, v))
            entries += [self._window_row(row0 + i, start + i, k, v) for i in range(head, m)]
        return self._plan_kernel().plan(entries)

    def window_plan_at(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> "attention_kernel.PassPlan":
        """`window_plan` for rows at their own slots (ascending; semantic repair's recomputed tokens): each row a
        sequence of its own, its window read as the whole pass reads it (the kernel writes every row's KV before
        any row attends, so a row sees the rows below it in this pass too)."""
        return self._plan_kernel().plan([self._window_row(i, int(s), k, v) for i, s in enumerate(slots.tolist())])

    def _window_row(self, row: int, slot: int, k: torch.Tensor, v: torch.Tensor) -> tuple:
        """One row at `slot` as a kernel sequence that attends its window only: below the window's size, the
        buffer's slots up to its own; past it, a view that begins where its window does."""
        W = max(self.window)
        if slot < W:
            return (row, 1, slot, k, v)
        lo = slot - W + 1
        return (row, 1, W - 1, k[:, :, lo:], v[:, :, lo:])

    def window_mask(self, start: int, m: int, slots: torch.Tensor | None = None, T: int | None = None
                     ) -> dict[int, torch.Tensor]:
        """The torch path's masks [G*m, T] for sliding layers, per window size: True where a row at slot start + i
        (or at its own `slots`[i]) may not attend (a later slot, or one window or more before its own). T: the
        keys the attention reads, by default up to the last row's slot."""
        own = (torch.arange(start, start + m, device=self.device) if slots is None else slots.to(self.device))[:, None]
        keys = torch.arange(int(own[-1, 0]) + 1 if T is None else T, device=self.device)[None, :]
        return {w: ((keys > own) | (keys <= own - w)).repeat(self.group, 1) for w in set(self.window) if w}

    def head_norm(self, li: int, which: int, x: torch.Tensor) -> torch.Tensor:
        """Layer li's per-head norm of q (which 0) or k (1) on heads x [R, H, D], each head's row on its own (so a
        subset of rows or heads gets the bits it gets with the others); x itself where the layer has none."""
        norms = self.qk_norms[li]
        if norms is None:
            return x
        R, H, D = x.shape
        return norms[which](x.reshape(R * H, D)).view(R, H, D)

    def split_rotated(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, li: int):
        """The torch path's layout of `rotated_rows`: q [Hq, M, D], k, v [Hkv, M, D] (head-major views)."""
        q, k, v = self.rotated_rows(qkv, cos, sin, li)
        return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)

    def slot_mask(self, slots: torch.Tensor, T: int) -> torch.Tensor:
        """The torch path's mask [G*M, T] for tokens at their own slots: each attends every slot up to its own."""
        return (torch.arange(T, device=slots.device)[None, :] > slots[:, None]).repeat(self.group, 1)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocked: torch.Tensor | None,
                   first: int = 0):
        """The torch path (no kernel): q [Hkv, G*M, D] (already scaled), k/v [Hkv, T, D] -> [Hkv, G*M, D].
        Scores and the weighted sum are plain batched products (bmm, not matmul's wrapper); the softmax runs in
        float32 and a masked key adds an exact zero. In float32 both products run in float64 and are rounded once:
        MKL's float32 kernels are chosen by row count on some CPUs (an AMD EPYC: the scattered rows of a repair
        differed from the whole pass), while float32 products are exact in float64 and the sums' order then
        matters only at a float32 rounding tie. `blocked` [G*M, T - first]: True where a query may not attend key
        first + j."""
        if q.dtype == torch.float32:  # (k @ q^T in MKL would also change with the key count below 3 keys)
            s = torch.bmm(q.double(), k.transpose(-1, -2).double()).float()
        else:
            # k @ q^T, transposed: k (a slice of the buffer) is read in place, where as the right operand
            # k^T it was first copied. Bitwise the same scores, sooner.
            s = torch.bmm(k, q.transpose(-1, -2)).transpose(-1, -2).float()
        if self.attn_softcap:  # Gemma 2's cap * tanh(s / cap), in float64 and rounded once (as the products)
            cap = float(self.attn_softcap)
            s = (torch.tanh(s.double() / cap) * cap).float()
        if blocked is not None:  # True: may not attend
            s[..., first:].masked_fill_(blocked, float("-inf"))
        p = torch.softmax(s, dim=-1).to(v.dtype)
        if p.dtype == torch.float32:
            return torch.bmm(p.double(), v.double()).float()
        return torch.bmm(p, v)


# torch's CPU GELU splits a call of more elements than this between threads, at points that need not fall on a
# row's start, and its vector and scalar code round tanh differently: a row's bits then depended on the rows run
# with it (measured: float32 rows of 200). Calls of at most this many elements run in one thread, each row alike.
_ONE_THREAD_ELEMENTS = 16384


def act_rows(act, x: torch.Tensor) -> torch.Tensor:
    """act(x) for rows x [..., I], in calls small enough to run in one thread: row-invariant."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1]) if x.dim() != 2 else x
    step = max(1, _ONE_THREAD_ELEMENTS // shape[-1])
    if rows.shape[0] <= step:
        return act(x)
    return torch.cat([act(rows[i:i + step]) for i in range(0, rows.shape[0], step)]).view(shape)
