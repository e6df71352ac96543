"""Decoder layers in one C call each pass, for the CPU runner's 4-bit configurations (bf16 on AMX products; float32
on int4_vector_kernel's products, portable C, since stop 27).

Why: with the products, attention and norms in C, a decode step of SmolLM2-135M still spent a quarter of its
time between them (benchmark/results/verified_decoding_notes.md): ~12 Python calls and tensor ops per layer (wrappers,
ctypes, views, RoPE's seven ops, SiLU, residual adds). Here the same kernels run back to back from C: the
norm kernel, the 4-bit products and the attention kernel (their own libraries, called through the addresses
ctypes gives), with RoPE, SiLU-and-multiply and the residual adds written here.

Arithmetic: RoPE and the residual adds round each product and sum to bf16 as torch's bf16 ops do (bitwise
the tensor expressions of llama_runner). SiLU is ours (x / (1 + exp(-x)), exp by a Cephes polynomial), not
torch's code, so the runner's 4-bit AMX configuration uses `silu_mul` below wherever a layer's MLP runs in
Python too (the early pass's last layer): every pass computes alike whatever torch does. After the bf16
rounding it gave torch's bits on every one of 11.9M real activations (a 290-token prefill), and the numerics
digest stayed the same. Gemma 3's tanh GELU (float32 layers) is ours likewise: gelu(x) = x / (1 + exp(-2z)),
z = sqrt(2/pi) (x + 0.044715 x^3), the same polynomial; as close to the exact function as torch's float32 GELU,
the same bits on every CPU. All of it is elementwise or per row: a row's bits do not depend on the other rows
(row-invariant, as the products and attention are).
"""
from __future__ import annotations

import ctypes
import threading

import torch

from . import abi, build, int4_kernel

_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float


class _Pass(ctypes.Structure):
    _fields_ = [("norm", _P), ("mm", _P), ("attend", _P), ("E", _I), ("Hq", _I), ("Hkv", _I), ("D", _I), ("I", _I),
                ("scale", _F), ("softcap", _F), ("nseq", _I), ("table", _P), ("awork", _P), ("astride", _L),
                ("athreads", _I),
                ("xsum", _P), ("scratch", _P), ("per_thread", _L), ("threads", _I), ("thread_min_macs", _L),
                ("pool", _P), ("glue_min_rows", _I),
                ("wnseq", _I), ("wtable", _P), ("wawork", _P), ("wastride", _L), ("wathreads", _I), ("act", _I),
                ("rot", _I), ("prof", _P)]

_ROWS = [_P, _L, _I, _I, _P, _L]  # simllm_silu_mul_*, simllm_gelu_tanh_mul_f32: gu, its stride, M, I, a, its stride
_STACK = [ctypes.POINTER(_Pass), _P, _I, _I, _I, _P, _P, _P, _P, _P]  # simllm_layers_*: the pass, h, M, ...
# Every entry bound here: name -> (argtypes, restype), checked against layers_api.h (kernels/abi.py)
SIGNATURES: abi.Signatures = {"simllm_silu_mul_f32": (_ROWS, None), "simllm_silu_mul_bf16": (_ROWS, None),
              "simllm_gelu_tanh_mul_f32": (_ROWS, None), "simllm_layers_f32": (_STACK, None),
              "simllm_layers_bf16": (_STACK, None), "simllm_layers_available": ([], _I),
              "simllm_argmax_f32": ([_P, _L], _L)}

# layer_stack.h's PROF_* slots: what a profiled pass's steps add their nanoseconds to, in this order
PROFILE_STEPS = ("qkv", "attention", "o", "gate_up", "down", "norms", "rope", "activation")


ACT_SILU, ACT_GELU_TANH = 0, 1  # layers.c's activations of the MLP's gate
# the activation modules each computes in their place (tanh GELU: Gemma 3's)
_ACTS = {"SiLUActivation": ACT_SILU, "SiLU": ACT_SILU, "GELUTanh": ACT_GELU_TANH,
         "NewGELUActivation": ACT_GELU_TANH}


# From this many rows a pass's norms, residual adds, RoPE and SiLU are split by rows over the 4-bit kernel's kept
# workers (at 2 threads they were ~6% of a 56-row SEMANTIC repair's time, on one core while the other waited).
GLUE_MIN_ROWS = 8


class LayerKernel:
    """The compiled library: `silu_mul` for a layer's MLP run in Python, `Layers` for a runner's whole stack."""

    def __init__(self, path: str):
        lib = ctypes.CDLL(path)
        self.path = path

        def entry(name):
            return abi.bind(lib, "layers", SIGNATURES, name)

        self._silu = {torch.float32: entry("simllm_silu_mul_f32")}
        self._gelu = entry("simllm_gelu_tanh_mul_f32")
        self._stack = {torch.float32: entry("simllm_layers_f32")}
        self._argmax = entry("simllm_argmax_f32")
        if entry("simllm_layers_available")():  # the bf16 layers (AVX-512); float32 always
            self._silu[torch.bfloat16] = entry("simllm_silu_mul_bf16")
            self._stack[torch.bfloat16] = entry("simllm_layers_bf16")

    def takes(self, dtype: torch.dtype) -> bool:
        """Whether this build runs layers of this dtype: float32 anywhere, bf16 where it targets AVX-512."""
        return dtype in self._stack

    def argmax(self, logits: torch.Tensor) -> int:
        """torch.argmax(logits) of float32 logits on the CPU (the first largest; the first NaN if any), in C."""
        if logits.dtype != torch.float32 or logits.device.type != "cpu" or not logits.numel():
            raise ValueError("argmax: float32 logits on the CPU")
        flat = logits.reshape(-1)
        if flat.stride(0) != 1:
            flat = flat.contiguous()
        return int(self._argmax(flat.data_ptr(), flat.numel()))

    def silu_mul(self, gu: torch.Tensor, inter: int, act: int = ACT_SILU) -> torch.Tensor:
        """gu [..., 2 * inter] (bf16 or float32) -> silu(gate) * up [..., inter], as the C layers compute it; with
        act ACT_GELU_TANH (float32 only) tanh GELU(gate) * up instead."""
        fn = self._silu.get(gu.dtype) if act == ACT_SILU else self._gelu if gu.dtype == torch.float32 else None
        if fn is None or gu.shape[-1] != 2 * inter or inter % 16:
            raise ValueError(f"silu_mul: bf16 or float32 rows of 2 x {inter} (a multiple of 16; GELU: float32)")
        rows = gu.reshape(-1, 2 * inter)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty((rows.shape[0], inter), dtype=gu.dtype)
        fn(rows.data_ptr(), rows.stride(0), rows.shape[0], inter, out.data_ptr(), inter)
        return out.view(*gu.shape[:-1], inter)


class Layers:
    """A runner's decoder layers as C sees them: the weights' addresses (the runner keeps the tensors), the
    kernels' entry points, and per-calling-thread buffers. `run` is one pass through layers first..last-1."""

    def __init__(self, kernel: LayerKernel, layers: list, int4, norms, attention, E: int, Hq: int, Hkv: int, D: int,
                 inter: int, scale: float, qk_norms: list | None = None, post_norms: list | None = None,
                 rope_of: list[int] | None = None, window: list[int] | None = None, softcap: float | None = None,
                 rope_dims: int | None = None):
        self.kernel, self.int4, self.attention = kernel, int4, attention
        self.rot = rope_dims or D  # RoPE's rotated dimensions of a head (the float32 layers; bf16: all)
        self.softcap = float(softcap or 0.0)  # the attention scores' soft-capping (Gemma 2's), 0: none
        self.act = _ACTS[type(layers[0][6]).__name__]
        self.dtype = int4.dtype  # bf16 (AMX products) or float32 (vector products)
        self.E, self.Hq, self.Hkv, self.D, self.inter, self.scale = E, Hq, Hkv, D, inter, scale
        if self.dtype == torch.float32:  # each projection as a list of parts (layers.c, product32)
            self._parts = [torch.tensor([len(p.parts)] + [v for kind, blob, n in p.parts
                                                          for v in (int4.entries[kind], blob.data_ptr(), n)],
                                        dtype=torch.int64)
                           for ln1, qkv, o, ln2, gu, down, _ in layers for p in (qkv, o, gu, down)]
            projs = [t.data_ptr() for t in self._parts]
        else:
            projs = [p.blob.data_ptr() for ln1, qkv, o, ln2, gu, down, _ in layers for p in (qkv, o, gu, down)]
        self.weights = torch.tensor([[ln1.weight.data_ptr(), ln2.weight.data_ptr(), *projs[4 * i:4 * i + 4]]
                                     for i, (ln1, qkv, o, ln2, gu, down, _) in enumerate(layers)], dtype=torch.int64)
        self.eps = torch.tensor([[ln1.eps, ln2.eps] for ln1, _, _, ln2, _, _, _ in layers], dtype=torch.float32)
        if self.dtype == torch.float32:  # [L][13] and [L][5] (layers.c): the qkv bias and the per-head q/k norms,
            # the RoPE table, Gemma 3's norms of the attention and MLP outputs and its sliding layers (0 if none)
            L = len(layers)
            qk, post = qk_norms or [None] * L, post_norms or [None] * L
            rope, win = rope_of or [0] * L, window or [0] * L
            self.tables, self.windowed = max(rope) + 1, any(win)
            extra = [[qkv.bias.data_ptr() if qkv.bias is not None else 0,
                      n[0].weight.data_ptr() if n else 0, n[1].weight.data_ptr() if n else 0, rope[li],
                      pn[0].weight.data_ptr() if pn else 0, pn[1].weight.data_ptr() if pn else 0, int(bool(win[li]))]
                     for li, ((_, qkv, *_), n, pn) in enumerate(zip(layers, qk, post))]
            self.weights = torch.cat([self.weights, torch.tensor(extra, dtype=torch.int64)], dim=1).contiguous()
            self.eps = torch.cat([self.eps, torch.tensor([[n[0].eps if n else 0.0, pn[0].eps if pn else 0.0,
                                                           pn[1].eps if pn else 0.0] for n, pn in zip(qk, post)])],
                                 1).contiguous()
        elif self.act != ACT_SILU:
            raise ValueError("the bf16 C layers compute SiLU only")
        else:
            self.tables, self.windowed = 1, False
        addr = lambda fn: ctypes.cast(fn, ctypes.c_void_p).value
        self._norm, self._mm = addr(norms._fns[self.dtype]), addr(int4._mm)
        self._pool = int4.pool_call  # simllm_pool_call: the steps between products split on its workers
        self._ws = threading.local()
        self.widest = max(E, Hq * D, inter)  # the longest input row of a product
        self.profile: torch.Tensor | None = None  # float64 [PROFILE_STEPS]: nanoseconds per step, while profiled

    def profiling(self, on: bool) -> None:
        """Start (zeroed) or stop adding each pass step's wall time to `profile` (simllm-bench decode_profile)."""
        self.profile = torch.zeros(len(PROFILE_STEPS), dtype=torch.float64) if on else None

    def act_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """The MLP's activation times up, as these layers compute it, for a layer's MLP run from Python."""
        return self.kernel.silu_mul(gu, self.inter, self.act)

    @staticmethod
    def applies(runner) -> bool:
        """Whether a runner's layers fit: 4-bit products on our kernel everywhere (AMX in bf16, vector in float32),
        the C norms, SiLU, no biases, full attention, sizes the vector code covers. The float32 layers also take
        q/k/v biases (Qwen2), per-head q/k norms (Qwen3) and Gemma 3's layers: norms of x * (1 + w), norms of the
        attention and MLP outputs, tanh GELU, sliding windows and a RoPE table per layer type."""
        if runner.int4 is None or runner.kernel is None or runner.dtype != runner.int4.dtype:
            return False
        f32 = runner.int4.dtype == torch.float32
        gemma = getattr(runner, "windowed", False) or any(p is not None for p in getattr(runner, "post_norms", ())) \
            or any(layer[0].offset or layer[3].offset for layer in runner.layers) \
            or len(getattr(runner, "rope_types", ())) > 1
        if gemma and (not f32 or any(p is not None and (p[0].kernel is None or p[1].kernel is None)
                                     for p in runner.post_norms)):
            return False
        if any(n is not None for n in runner.qk_norms) and (not f32 or any(
                n is not None and (n[0].kernel is None or n[1].kernel is None) for n in runner.qk_norms)):
            return False
        if runner.head_dim % 32 or runner.inter % 16 or runner.hidden % 16:
            return False
        if getattr(runner, "rope_dims", runner.head_dim) != runner.head_dim and not f32:
            return False  # RoPE on part of each head: the float32 layers only
        for ln1, qkv, o, ln2, gu, down, act in runner.layers:
            kind = _ACTS.get(type(act).__name__)
            if ln1.kernel is None or ln2.kernel is None or kind is None or (kind != ACT_SILU and not f32):
                return False
            if any(p.parts is None for p in (qkv, o, gu, down)) or any(p.bias is not None for p in (o, gu, down)):
                return False
            if qkv.bias is not None and (not f32 or qkv.bias.dtype != torch.float32 or not qkv.bias.is_contiguous()):
                return False
            if runner.int4.dtype != torch.float32 and any(p.blob is None for p in (qkv, o, gu, down)):
                return False  # the bf16 layers take 4-bit blobs only
        return True

    def _workspace(self, M: int) -> torch.Tensor:
        need = M * (2 * self.E + 2 * (self.Hq + 2 * self.Hkv) * self.D + self.Hq * self.D + 3 * self.inter)
        ws = getattr(self._ws, "buf", None)
        if ws is None or ws.numel() < need:
            ws = self._ws.buf = torch.empty(need, dtype=self.dtype)
        return ws

    def run(self, h: torch.Tensor, first: int, last: int, plan, cos: torch.Tensor, sin: torch.Tensor,
            window_plan=None) -> None:
        """Layers first..last-1 over h [M, E] (contiguous; updated in place) with the attention pass `plan`
        (attention_kernel.plan: the KV buffers the layers write and read), and `window_plan` for sliding-window
        layers (the runner's `_window_plan`; needed where a layer has a window); cos, sin [T, M, 1, D] (the
        runner's RoPE tables: layer li rotates by its rope_of[li])."""
        M = h.shape[0]
        if h.dtype != self.dtype or not h.is_contiguous() or h.shape[1] != self.E:
            raise ValueError(f"layers: contiguous {self.dtype} rows of {self.E}")
        if cos.numel() < self.tables * M * self.D or sin.numel() != cos.numel():
            raise ValueError(f"layers: {self.tables} RoPE tables of {M} rows needed")
        if window_plan is None and self.windowed:
            raise ValueError("layers: sliding-window layers need the window plan")
        c, s = cos.reshape(-1, M, self.D).contiguous(), sin.reshape(-1, M, self.D).contiguous()
        # the window plan's arguments first: both share the calling thread's work buffer, which the second call
        # leaves large enough for both
        wargs = self.attention.pass_args(window_plan, self.Hq, self.D) if window_plan is not None else None
        fn, work, stride, athreads = args = self.attention.pass_args(plan, self.Hq, self.D)
        wp, (_, _, wstride, wthreads) = (window_plan, wargs) if wargs else (plan, args)
        xsum, tiles, per_thread, threads = self.int4.buffers(M, self.widest)
        P = _Pass(self._norm, self._mm, ctypes.cast(fn, ctypes.c_void_p).value, self.E, self.Hq, self.Hkv, self.D,
                  self.inter, self.scale, self.softcap, plan.table.shape[0], plan.table.data_ptr(), work.data_ptr(),
                  stride, athreads, xsum, tiles, per_thread, threads, int4_kernel.THREAD_MIN_MACS,
                  self._pool, GLUE_MIN_ROWS, wp.table.shape[0], wp.table.data_ptr(), work.data_ptr(), wstride,
                  wthreads, self.act, self.rot, self.profile.data_ptr() if self.profile is not None else 0)
        ws = self._workspace(M)
        self.kernel._stack[self.dtype](ctypes.byref(P), h.data_ptr(), M, first, last, self.weights.data_ptr(),
                            self.eps.data_ptr(), c.data_ptr(), s.data_ptr(), ws.data_ptr())


_LOADER = build.Loader("SIMLLM_LAYERS", "python", "layers", LayerKernel, signatures=SIGNATURES)


def load() -> "LayerKernel | None":
    """The library for this process (built on first use), or None with `why_not()` saying why."""
    return _LOADER.load()


def loaded() -> "LayerKernel | None":
    """The library if this process has loaded it already (never builds it)."""
    return _LOADER.kernel


def why_not() -> str | None:
    return _LOADER.why_not
