"""The KV buffer a runner's passes write into (split from llama_runner): `KVBuffer`, one request's keys and values
preallocated and filled up to a length, and `Seq`, one sequence of a batched pass over its own buffer."""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class KVBuffer:
    """One request's KV: [layers, kv_heads, capacity, head_dim] keys and values, filled up to `length`."""

    k: torch.Tensor
    v: torch.Tensor
    length: int = 0

    @classmethod
    def allocate(cls, layers: int, kv_heads: int, head_dim: int, capacity: int, dtype, device) -> "KVBuffer":
        shape = (layers, kv_heads, capacity, head_dim)
        return cls(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))

    @classmethod
    def adopt(cls, k: torch.Tensor, v: torch.Tensor, capacity: int) -> "KVBuffer | None":
        """A buffer over the storage behind k, v [L, H, n, D] when they are the leading n slots of contiguous
        [L, H, C, D] tensors with C >= capacity (what BlockStore.read returns when asked for room): the
        prefix is not copied again. None when they are not such views."""
        for t in (k, v):
            b = t._base
            if (b is None or b.dim() != 4 or not b.is_contiguous() or b.data_ptr() != t.data_ptr()
                    or b.shape[:2] != t.shape[:2] or b.shape[3] != t.shape[3] or b.shape[2] < capacity
                    or b.stride() != t.stride()):
                return None
        buf = cls(k._base, v._base)
        buf.length = k.shape[2]
        return buf

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def ensure_capacity(self, n: int) -> None:
        """Grow (copying what is held) when n tokens would not fit."""
        if n <= self.capacity:
            return
        cap = max(n, 2 * self.capacity)
        L, H, _, D = self.k.shape
        k = torch.empty((L, H, cap, D), dtype=self.k.dtype, device=self.k.device)
        v = torch.empty_like(k)
        k[:, :, :self.length].copy_(self.k[:, :, :self.length])
        v[:, :, :self.length].copy_(self.v[:, :, :self.length])
        self.k, self.v = k, v

    def load(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Put a cached prefix [L, H, n, D] at the start of the buffer."""
        n = k.shape[2]
        self.k[:, :, :n].copy_(k)
        self.v[:, :, :n].copy_(v)
        self.length = n

    def view(self, n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.length if n is None else n
        return self.k[:, :, :n], self.v[:, :, :n]

    def truncate(self, n: int) -> None:
        """Forget everything after token n (rejected draft tokens): their slots are simply overwritten later."""
        self.length = min(self.length, n)


@dataclasses.dataclass
class Seq:
    """One sequence of a batched pass (`LlamaRunner.forward_batch`): tokens `ids` [M] at `positions` [M],
    written at slots start..start+M-1 of its own `kv` and attending causally by slot; which logits to return."""

    ids: torch.Tensor
    positions: torch.Tensor
    kv: KVBuffer
    start: int
    logits: str = "all"  # "all", "last" or "none"
    # Slots [0, shared) of `kv` hold the same bits as those of seqs[lead] (an earlier sequence of the pass that
    # leads itself with the same `shared`): attention reads them once for both (attention_kernel.plan).
    lead: int = -1
    shared: int = 0

