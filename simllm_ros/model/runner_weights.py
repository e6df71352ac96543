"""LlamaRunner's weights and which kernel runs each product (split from llama_runner, whose module doc says why
every path is row-invariant):

- packing: oneDNN's blocked bf16 layout (`_pack`), 4-bit codes in groups of 32 (`int4_codes`, `on_int4_grid`),
  Q8_0 codes (`q8_codes`, `on_q8_grid`), and whether ATen's int4 kernel computes what its weights say here
  (`int4_kernel_error`);
- `Proj`: one projection, on oneDNN, ATen's int8/int4 kernels or ours (int4_kernel, int4_vector_kernel; a GGUF's
  own blocks: `file_parts`); `Head8`: the LM head as 8-bit groups on ours; `Norm`: RMSNorm on norm_kernel or
  the transformers module;
- the HF modules' side: their weights pointed at the fused ones or released (`hand_out`, `return_freed_heap`),
  Gemma 3's layout (`gemma_layout`) and its file embedding scaled (`ScaledRows`).
"""
from __future__ import annotations

import ctypes
from typing import Any

import torch
import torch.nn.functional as F

from ..kernels import norm_kernel
from ..kernels.int4_kernel import Int4Kernel
from ..kernels.int4_vector_kernel import VectorKernel


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked layout of a bf16 CPU weight, or None where that does not apply.

    F.linear hands oneDNN a plain bf16 weight and oneDNN reorders it into its blocked layout on every call.
    Packed once, the same kernel runs on the same data: bitwise the F.linear result (checked for 1..599
    rows on every projection shape of SmolLM2), and a decode step of SmolLM2-135M is faster
    (benchmark/results/verified_decoding_notes.md). float32 is left to MKL: packed, it decoded slower, and the
    model still failed the invariance probe in float32 (attention with few keys).
    """
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 2)
    except (RuntimeError, AttributeError, NotImplementedError):
        return None


INT4_GROUP = 32  # weights per 4-bit group: GGUF's Q4_0/Q4_1 block size


def _quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-wise asymmetric 4-bit weights for ATen's CPU kernel: (packed, scales_and_zeros [K/32, N, 2]).

    Each group of 32 input weights of one output row gets its own step and minimum (min/max of the
    group). A model that came from a Q4_1 GGUF already holds at most 16 values per such group, on that
    grid: min/max finds the grid again, so the 4-bit weights are the file's own (to bf16 rounding of the
    step), not a second quantization of them. The kernel computes (q - 8) * step + zero."""
    q, scales_and_zeros = int4_codes(weight)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 8), scales_and_zeros


def _int4_grid(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weights in groups [N, K/32, 32] (float32), each group's minimum and step [N, K/32, 1]: 16 levels
    from min to max, the grid both the 4-bit codes and the grid check use."""
    w = weight.float().reshape(weight.shape[0], -1, INT4_GROUP)
    lo = w.amin(dim=-1, keepdim=True)
    return w, lo, ((w.amax(dim=-1, keepdim=True) - lo) / 15).clamp(min=1e-12)


def int4_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes 0..15 [N, K] int32, scales_and_zeros [K/32, N, 2] in the weight's dtype)."""
    n, k = weight.shape
    if k % INT4_GROUP:
        raise ValueError(f"weight_bits=4 needs input sizes that are multiples of {INT4_GROUP} (got {k})")
    w, lo, step = _int4_grid(weight)
    q = torch.round((w - lo) / step).clamp(0, 15).to(torch.int32).reshape(n, k)
    lo, step = lo[..., 0], step[..., 0]
    zero = lo + 8 * step
    return q.contiguous(), torch.stack([step.t(), zero.t()], dim=-1).contiguous().to(weight.dtype)


def int4_dequantized(q: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """The float32 weights [N, K] that 4-bit codes stand for, as the kernel reads them: (q - 8) * step + zero."""
    n, k = q.shape
    step, zero = scales_and_zeros[..., 0].float().t(), scales_and_zeros[..., 1].float().t()  # [N, K/32]
    qg = q.float().reshape(n, k // INT4_GROUP, INT4_GROUP)
    return ((qg - 8) * step[..., None] + zero[..., None]).reshape(n, k)


def on_int4_grid(weight: torch.Tensor) -> bool:
    """Whether every group of 32 input weights of each output row already holds at most 16 levels of one step
    (a Q4_0/Q4_1/Q4_K GGUF layer): then 4-bit weights are the same weights, not a second quantization.
    Allowed: a tenth of a step (min/max finds the grid again; the bf16 rounding of the values is ~0.02 of
    a step on the embedded model) plus the value's own bf16 rounding."""
    if weight.dim() != 2 or weight.shape[1] % INT4_GROUP:
        return False
    w, lo, step = _int4_grid(weight)
    off = (w - lo) / step
    return bool(((off - off.round()).abs() * step <= 0.1 * step + w.abs() * 2.0 ** -8).all())


def q8_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes -127..127 [N, K] int8, scales [N, K/32] float32): GGUF's Q8_0, a scale per group of 32 weights
    (the group's largest magnitude / 127)."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // INT4_GROUP, INT4_GROUP)
    d = (w.abs().amax(dim=-1) / 127).clamp(min=1e-12)
    return torch.round(w / d[..., None]).clamp(-127, 127).to(torch.int8).reshape(n, k), d


def on_q8_grid(weight: torch.Tensor) -> bool:
    """Whether the weight already is Q8_0 (every group of 32 a multiple of one scale, to a tenth of a step
    plus the values' own bf16 rounding): the LM head tied to a Q8_0 embedding (SmolLM2's GGUF) is."""
    if weight.dim() != 2 or weight.shape[1] % INT4_GROUP:
        return False
    codes, d = q8_codes(weight)
    w = weight.float().reshape(codes.shape[0], -1, INT4_GROUP)
    off = (w - codes.float().reshape(w.shape) * d[..., None]).abs()
    return bool((off <= 0.1 * d[..., None] + w.abs() * 2.0 ** -8).all())


class Norm:
    """A layer's RMSNorm: our C kernel (norm_kernel: one call instead of ~8 ops) where it takes the weight and
    the module is a plain RMSNorm (the formula the kernel computes), else the transformers module itself."""

    # the last: skeleton's
    PLAIN = ("LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm", "Qwen3RMSNorm", "SmolLM3RMSNorm", "RMSNorm")
    # x * (1 + w), all in float32, rounded once to the rows' dtype: the kernel's float32 form w * (x * r) with the
    # weight 1 + w (as transformers computes it) is that formula, row by row
    OFFSET = ("Gemma2RMSNorm", "Gemma3RMSNorm", "OffsetRMSNorm")

    def __init__(self, module, kernel: "norm_kernel.NormKernel | None"):
        self.module = module
        name = type(module).__name__
        self.offset = name in self.OFFSET
        if self.offset:
            self.weight = 1.0 + module.weight.data.float()
            self.eps = float(module.eps)
        else:
            self.weight = module.weight.data
            self.eps = float(getattr(module, "variance_epsilon", 1e-6))
        self.kernel = kernel if kernel is not None and (self.offset or name in self.PLAIN and hasattr(
            module, "variance_epsilon")) and kernel.takes(self.weight) else None

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        if self.offset and self.kernel is not None:
            return self.kernel.rmsnorm(h.float(), self.weight, self.eps).to(h.dtype)
        if self.kernel is None or h.dtype != self.weight.dtype:
            return self.module(h)
        return self.kernel.rmsnorm(h, self.weight, self.eps)


class Head8:
    """The LM head as its file's own 8-bit groups on our 4-bit runner's kernel (`mm8`: AMX or vector): half the
    bytes a decode step reads for it (faster up to a few rows: benchmark/results/verified_decoding_notes.md), float32
    logits, row-invariant like the rest."""

    weight = packed = None  # the runner holds its own copy: the HF module's may be released
    bits = 8

    def __init__(self, weight: torch.Tensor, kernel: "Int4Kernel | VectorKernel"):
        self.kernel, self.n = kernel, weight.shape[0]
        self.blob = kernel.pack8(*q8_codes(weight))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self.kernel.mm8(x.reshape(-1, shape[-1]).contiguous(), self.blob, self.n)
        return y.reshape(*shape[:-1], self.n)


def int4_kernel_error() -> str | None:
    """None if ATen's int4 CPU kernel computes what its weights say on this machine, else why not. It is
    a private op with per-ISA code paths; checked against a float32 product of the same 4-bit weights."""
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(64, 128, generator=g).to(torch.bfloat16)
        x = torch.randn(3, 128, generator=g).to(torch.bfloat16)
        q, sz = int4_codes(w)
        got = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 8), INT4_GROUP, sz).float()
    except (RuntimeError, AttributeError, NotImplementedError, ValueError) as e:
        return f"torch's int4 CPU kernel is not usable here: {type(e).__name__}: {e}"
    want = x.float() @ int4_dequantized(q, sz).t()
    err = (got - want).abs().max().item()
    bound = 0.02 * want.abs().max().item() + 1e-3
    return None if err <= bound else f"torch's int4 CPU kernel is off by {err:.3g} (allowed {bound:.3g}) here"


class Proj:
    """One projection: oneDNN-packed weights (CPU), a dense weight (elsewhere), int8 weights with one
    scale per output channel (weight_bits=8), or 4-bit weights in groups of 32 (weight_bits=4).

    The int8 and int4 paths use ATen's weight-only kernels (`_weight_int8pack_mm`,
    `_weight_int4pack_mm_for_cpu`; bf16 activations), or for 4 bits our AMX kernel where the runner has
    it (`int4`). All are row-invariant (a row's result does not depend on the other rows), which the
    load-time probe checks for the whole model.
    """

    ggml: str | None = None  # the LM head's GGUF type where it runs on the file's own blocks
    bits = 16  # the LM head's bits where they are not 16 (the runner sets them)

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None, weight_bits: int,
                 int4: "Int4Kernel | VectorKernel | None" = None,
                 parts: list[tuple[str, torch.Tensor, int]] | None = None):
        self.bias = bias
        self.weight: torch.Tensor | None = None
        self.w8: torch.Tensor | None = None
        self.w4: torch.Tensor | None = None
        self.packed: torch.Tensor | None = None
        self.blob: torch.Tensor | None = None
        self.parts: list[tuple[str, torch.Tensor, int]] | None = None
        self.int4 = int4
        if parts is not None:  # a file's own formats on the vector kernel (gguf_weights): consecutive outputs each
            self.parts = parts  # (kind, blob, outputs)
            self.n = sum(n for _, _, n in parts)
            if len(parts) == 1 and parts[0][0] == "q4":
                self.blob = parts[0][1]
            return
        assert weight is not None  # a product's weight or its file's parts
        self.n = weight.shape[0]
        if weight_bits == 4 and int4 is not None:  # our kernel (int4_kernel or int4_vector_kernel): its own layout
            self.blob = int4.pack(*int4_codes(weight))  # steps and zeros inside the blob
            self.parts = [("q4", self.blob, self.n)]
        elif weight_bits == 8:
            w = weight.float()
            scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
            self.w8 = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
            self.scale = scale.to(weight.dtype)
        elif weight_bits == 4:
            self.w4, self.scale = _quantize_int4(weight)
        else:
            self.packed = _pack(weight)
            if self.packed is None:
                self.weight = weight

    @property
    def four_bit(self) -> bool:
        """Whether this projection holds 4-bit weights (for either kernel)."""
        return self.w4 is not None or self.parts is not None

    @property
    def kinds(self) -> str:
        """The blob kinds of our kernel's parts ("q4", "q4+q6", ...), "" off our kernel."""
        return "+".join(dict.fromkeys(k for k, _, _ in self.parts)) if self.parts else ""

    def dense(self) -> torch.Tensor | None:
        """The plain weight (unpacked again if packed: oneDNN's reorder back is exact); None for int8/int4."""
        if self.packed is not None:
            return self.packed.to_dense()
        return self.weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        if self.w8 is None and self.w4 is None and self.parts is None:
            return F.linear(x, self.weight, self.bias)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        if self.parts is not None:
            y = self._parts(x2, self.parts)
        elif self.w4 is not None:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.w4, INT4_GROUP, self.scale)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.w8, self.scale)
        y = y.reshape(*shape[:-1], self.n)
        return y if self.bias is None else y + self.bias

    def columns(self, x: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """Outputs a..b-1 (multiples of 16) of this product for rows x [M, K], on our 4-bit kernels only: they
        compute each block of 16 outputs on its own, so these are bitwise those columns of the whole product."""
        if self.parts is None or a % 16 or b % 16:
            raise ValueError("columns of a product: our 4-bit kernels' weights, outputs in 16s")
        cut, c0 = [], 0
        for kind, blob, n in self.parts:  # the parts' blocks of 16 outputs that fall in a..b-1
            lo, hi = max(a, c0), min(b, c0 + n)
            if lo < hi:
                cut.append((kind, blob[(lo - c0) // 16:(hi - c0) // 16], hi - lo))
            c0 += n
        y = self._parts(x.contiguous(), cut)
        return y if self.bias is None else y + self.bias[a:b]

    def _parts(self, x: torch.Tensor, parts) -> torch.Tensor:
        """x [M, K] times consecutive parts of outputs, each on its kind's product: every output computed as its
        own part's kernel computes it, whatever parts run beside it."""
        kernel: Any = self.int4  # the kernel that packed the parts (product(): the vector kernel's kinds)
        if len(parts) == 1 and parts[0][0] == "q4":
            return kernel.mm(x, parts[0][1], parts[0][2])
        ys = [kernel.product(kind)(x, blob, n) for kind, blob, n in parts]
        return ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)


def file_parts(weights: list, kernel, int8_rows: bool = False) -> list[tuple[str, torch.Tensor, int]]:
    """A fused projection's parts from its pieces' file weights (gguf_weights.FileWeight): neighbours of one kind
    share a blob, so an all-Q4_K q/k/v stays one product."""
    parts: list[tuple[str, torch.Tensor, int]] = []
    for fw in weights:
        kind, blob, n = fw.pack(kernel, int8_rows)
        if parts and parts[-1][0] == kind:
            parts[-1] = (kind, torch.cat([parts[-1][1], blob]), parts[-1][2] + n)
        else:
            parts.append((kind, blob, n))
    return parts


def return_freed_heap() -> None:
    """glibc keeps freed heap pages for reuse: without this the released dense weights stayed in the
    process's resident memory (measured: 1147 MB after loading SmolLM2-135M in bf16, 843 MB after the
    trim, against 788 MB before packing; the 55 MB left is the packed LM head, whose dense table is
    also the embedding). Elsewhere than glibc it does nothing."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def hand_out(fused: torch.Tensor, linears, attr: str) -> None:
    """Point each HF linear's weight (or bias) at its rows of a fused tensor, in order."""
    off = 0
    for lin in linears:
        getattr(lin, attr).data = fused[off:off + lin.out_features]
        off += lin.out_features


def cat_bias(*linears) -> torch.Tensor | None:
    biases = [lin.bias for lin in linears]
    return torch.cat([b.data for b in biases]) if all(b is not None for b in biases) else None


def bias_of(linear) -> torch.Tensor | None:
    return linear.bias.data if linear.bias is not None else None


def gemma_layout(model) -> bool:
    """Whether the model's layers are Gemma 2's or 3's (four norms per layer, norms of x * (1 + w))."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        return False
    return hasattr(layers[0], "pre_feedforward_layernorm") and type(layers[0].input_layernorm).__name__ in Norm.OFFSET


class ScaledRows:
    """A file's embedding rows times Gemma's embed_scale (in the model's dtype, as transformers multiplies)."""

    def __init__(self, rows, scale: torch.Tensor):
        self.rows, self.scale = rows, scale
        self.num_embeddings, self.embedding_dim = rows.num_embeddings, rows.embedding_dim

    def __getattr__(self, name):
        return getattr(self.rows, name)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows(ids) * self.scale
