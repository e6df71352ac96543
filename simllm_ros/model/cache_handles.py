"""The caches a ModelBackend hands out: a KVBuffer where the batch-invariant runner computes the passes, else
transformers' DynamicCache. The engine only passes a cache between these methods and the backend's passes; what
it keeps of one (the pool's entries) it takes as tensors [L, H, n, D]. CacheHandles is a part ModelBackend
(model_backend.py) owns: it knows only the KV shape, dtype and device, and whether a runner computes the passes.
"""
from __future__ import annotations

from typing import Any

import torch

from ..cache.block_store import KVShape
from .kv_buffer import KVBuffer


class CacheHandles:
    """ModelBackend's caches: KVBuffers of `kv_shape` in `dtype` on `device` where `buffers` (the batch-invariant
    runner computes the passes), else transformers' DynamicCache."""

    def __init__(self, buffers: bool, kv_shape: KVShape, dtype: torch.dtype, device: str):
        self.buffers = buffers
        self.kv_shape = kv_shape
        self.dtype = dtype
        self.device = device

    def new_cache(self, capacity: int = 256) -> Any:
        """An empty cache with room for `capacity` tokens (a KVBuffer; a DynamicCache grows)."""
        if self.buffers:
            L, H, D = self.kv_shape.layers, self.kv_shape.kv_heads, self.kv_shape.head_dim
            return KVBuffer.allocate(L, H, D, capacity, self.dtype, self.device)
        from transformers import DynamicCache  # deferred: transformers takes seconds to import

        # Every layer keeps every token (no config: no sliding-window layers, which drop what left their window and so
        # cannot be cropped back to an accepted draft); the model's own masks still apply each layer's window.
        return DynamicCache()

    def cache_from_tensors(self, k: torch.Tensor, v: torch.Tensor, reserve: int = 0) -> Any:
        """k, v: [L, H, n, D] -> a cache holding them, with room for `reserve` more tokens."""
        if self.buffers:
            need = k.shape[2] + max(reserve, 2)
            k, v = k.to(self.device, self.dtype), v.to(self.device, self.dtype)  # no-ops when they match
            cache = KVBuffer.adopt(k, v, need)  # a pool read with room: decode on in place
            if cache is None:
                cache = self.new_cache(need)
                cache.load(k, v)
            return cache
        cache = self.new_cache()
        for layer in range(k.shape[0]):
            cache.update(k[layer:layer + 1].to(self.device, self.dtype), v[layer:layer + 1].to(self.device, self.dtype),
                         layer)
        return cache

    @staticmethod
    def cache_storage(cache) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The whole storage [L, H, capacity, D] behind a KVBuffer's keys and values (None for other caches)."""
        return (cache.k, cache.v) if isinstance(cache, KVBuffer) else None

    def cache_tensors(self, cache) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache's KV as k, v [L, H, n, D] (views where possible: copy before the cache changes)."""
        if isinstance(cache, KVBuffer):
            return cache.view()
        k = torch.stack([layer.keys[0] for layer in cache.layers])
        v = torch.stack([layer.values[0] for layer in cache.layers])
        return k, v

    @staticmethod
    def cache_len(cache) -> int:
        return cache.length if isinstance(cache, KVBuffer) else cache.get_seq_length()

    @staticmethod
    def truncate(cache, n: int) -> None:
        if isinstance(cache, KVBuffer):
            cache.truncate(n)
        else:
            extra = cache.get_seq_length() - n
            if extra > 0:
                cache.crop(-extra)

    def same_prefix(self, a, b, n: int) -> int:
        """How many first slots (of at most n, in whole 32s) KV caches a and b hold with the same bits, keys and
        values of every layer: what attention may read once for both. Bits, not tokens: two copies of one pool
        entry are equal; a prefill and an 8-bit copy of the same tokens are not (and -0 is not +0)."""
        n = min(n, self.cache_len(a), self.cache_len(b)) // 32 * 32
        if n == 0 or not isinstance(a, KVBuffer) or not isinstance(b, KVBuffer) or a.k.shape[:2] != b.k.shape[:2] \
                or a.k.dtype != b.k.dtype:
            return 0
        differ = torch.zeros(n, dtype=torch.bool, device=a.k.device)
        for x, y in ((a.k, b.k), (a.v, b.v)):
            differ |= (x[:, :, :n].view(torch.uint8) != y[:, :, :n].view(torch.uint8)).any(-1).any(1).any(0)
        first = int(differ.nonzero()[0, 0]) if bool(differ.any()) else n
        return first // 32 * 32
