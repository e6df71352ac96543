"""Preallocated paged KV storage: a fixed number of fixed-size token blocks.

All blocks live in a few large tensors allocated once, so entries coming and
going never fragment memory, and the pool's footprint is known up front (as in
vLLM's block pool). This module only stores and loads tensors; which block
belongs to whom is block_pool's job.
"""
from __future__ import annotations

import dataclasses

import torch

from . import kv_quant


@dataclasses.dataclass(frozen=True)
class KVShape:
    """Geometry of one model's KV cache."""

    layers: int
    kv_heads: int
    head_dim: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def storage_dtype(kv_bits: int, model_dtype: torch.dtype) -> torch.dtype:
    if kv_bits == 8:
        return torch.uint8
    if kv_bits == 16:
        return model_dtype if model_dtype in (torch.bfloat16, torch.float16) else torch.float16
    return torch.float32


class BlockStore:
    def __init__(self, shape: KVShape, block_tokens: int, num_blocks: int, kv_bits: int,
                 model_dtype: torch.dtype, device: str = "cpu"):
        if num_blocks < 1:
            raise ValueError("the KV pool budget is smaller than one block")
        self.shape = shape
        self.block_tokens = block_tokens
        self.num_blocks = num_blocks
        self.kv_bits = kv_bits
        self.model_dtype = model_dtype
        self.device = device
        L, H, D, T = shape.layers, shape.kv_heads, shape.head_dim, block_tokens
        self.dtype = storage_dtype(kv_bits, model_dtype)
        # torch.empty: on CPU untouched pages cost no resident memory until a block is written.
        self.k = torch.empty((num_blocks, L, H, T, D), dtype=self.dtype, device=device)
        self.v = torch.empty((num_blocks, L, H, T, D), dtype=self.dtype, device=device)
        if self.quantized:
            self.k_scale = torch.empty((num_blocks, L, H, 1, D), dtype=torch.float16, device=device)
            self.k_zero = torch.empty_like(self.k_scale)
            self.v_scale = torch.empty((num_blocks, L, H, T, 1), dtype=torch.float16, device=device)
            self.v_zero = torch.empty_like(self.v_scale)
        self.key_calibration: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def quantized(self) -> bool:
        return self.kv_bits == 8

    @staticmethod
    def bytes_per_block_for(shape: KVShape, block_tokens: int, kv_bits: int, model_dtype: torch.dtype) -> int:
        L, H, D, T = shape.layers, shape.kv_heads, shape.head_dim, block_tokens
        elem = torch.empty((), dtype=storage_dtype(kv_bits, model_dtype)).element_size()
        data = 2 * L * H * T * D * elem
        if kv_bits == 8:
            data += 2 * (L * H * D + L * H * T) * 2  # fp16 scale + zero: keys per channel, values per token
        return data

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_block_for(self.shape, self.block_tokens, self.kv_bits, self.model_dtype)

    @property
    def bytes_per_block_16bit(self) -> int:
        """What a block would take at 16 bits: the reference for 'bytes saved by quantization'."""
        return self.bytes_per_block_for(self.shape, self.block_tokens, 16, torch.float16)

    def write(self, block_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [L, H, n, D] with n <= block_tokens (a partial last block is zero-padded)."""
        n = k.shape[2]
        if n < self.block_tokens:
            pad = self.block_tokens - n
            k = torch.nn.functional.pad(k, (0, 0, 0, pad))
            v = torch.nn.functional.pad(v, (0, 0, 0, pad))
        if self.quantized:
            # Padding rows must not widen a partial block's key range: quantise the real rows only.
            qk, ks, kz = kv_quant.quantize_keys(k[:, :, :n], self.key_calibration)
            qk = torch.nn.functional.pad(qk, (0, 0, 0, self.block_tokens - n))
            qv, vs, vz = kv_quant.quantize_values(v)
            self.k[block_id].copy_(qk)
            self.k_scale[block_id].copy_(ks)
            self.k_zero[block_id].copy_(kz)
            self.v[block_id].copy_(qv)
            self.v_scale[block_id].copy_(vs)
            self.v_zero[block_id].copy_(vz)
        else:
            self.k[block_id].copy_(k.to(self.dtype))
            self.v[block_id].copy_(v.to(self.dtype))

    def read(self, block_ids: list[int], n_tokens: int, dtype: torch.dtype,
             capacity: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks concatenated along tokens, cut to n_tokens: k, v [L, H, n_tokens, D].

        They are views of the first n_tokens slots of contiguous [L, H, max(capacity, n_tokens), D]
        tensors, so a caller that asked for capacity can decode into the rest without copying the
        prefix again (on an exact hit this copy is the only one between the pool and the model).
        """
        L, H, D, T = self.shape.layers, self.shape.kv_heads, self.shape.head_dim, self.block_tokens
        k = torch.empty((L, H, max(capacity, n_tokens), D), dtype=dtype, device=self.device)
        v = torch.empty_like(k)
        for out, which in ((k, "k"), (v, "v")):
            for i, b in enumerate(block_ids):
                a = i * T
                t = min(T, n_tokens - a)
                if t <= 0:
                    break
                out[:, :, a:a + t].copy_(self._block(which, b, dtype)[:, :, :t])
        return k[:, :, :n_tokens], v[:, :, :n_tokens]

    def _block(self, which: str, b: int, dtype: torch.dtype) -> torch.Tensor:
        """Block b's keys ("k") or values ("v") [L, H, T, D], dequantized when stored in 8 bits. Block by
        block: dequantizing every block at once and then reshaping was slower (benchmark/results/reuse_quality.md),
        the float32 intermediate of the whole prefix being the cost."""
        codes = getattr(self, which)[b]
        if not self.quantized:
            return codes
        return kv_quant.dequantize(codes, getattr(self, f"{which}_scale")[b], getattr(self, f"{which}_zero")[b], dtype)

    def tensors_for(self, block_ids: list[int]) -> dict[str, torch.Tensor]:
        """Raw stored tensors of some blocks, for persistence."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        out = {"k": self.k[idx].cpu(), "v": self.v[idx].cpu()}
        if self.quantized:
            out.update(k_scale=self.k_scale[idx].cpu(), k_zero=self.k_zero[idx].cpu(),
                       v_scale=self.v_scale[idx].cpu(), v_zero=self.v_zero[idx].cpu())
        return out

    def load_raw(self, block_id: int, tensors: dict[str, torch.Tensor], row: int) -> None:
        for name, t in tensors.items():
            getattr(self, name)[block_id].copy_(t[row])
