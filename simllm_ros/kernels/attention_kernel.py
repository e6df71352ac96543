"""A small C attention kernel for the CPU runner: fast for one query row, and row-invariant by construction.

Why our own: on the CPU a decode step's attention is two tiny bf16 products per layer (3 query rows against
~600 keys for SmolLM2), and oneDNN's fixed cost for them, over 30 layers, was several times what reading the keys
and values costs (benchmark/results/verified_decoding_notes.md). torch's fused CPU attention is no
way out: its result changes with the key count, which would make a cached prefix give other bits than a
whole prefill (llama_runner's module doc). This kernel computes each query row on its own, in a fixed
order that depends on nothing but that row's keys, so a row gets the same bits whatever rows and how many
masked keys run with it; `ModelBackend.invariance_probe` still checks that on the model at load.

Arithmetic, per query row: scores in float32 (dot products with 16 fixed lanes over the head dimension,
summed in a fixed tree), the softmax's exponentials from a fixed polynomial, and the weighted sum of values
accumulated in float32 in key order, divided by the sum once at the end. Keys a row may not attend are
skipped. Compiled once per machine with the system C compiler into ~/.cache/simllm_ros/kernels
($SIMLLM_KERNEL_DIR; a private temporary directory where that cannot be written),
loaded with ctypes (no torch headers, no Python extension build). Where there is no compiler, or the
shapes do not fit (head_dim not a multiple of 16, dtype other than bf16/float32, not on the CPU), the
runner keeps its torch path; `SIMLLM_ATTENTION=torch` chooses that path explicitly. The two paths round
differently, so a pool snapshot records which one computed it (`ModelBackend.numerics_digest`).

Where the compiler targets AMX-BF16 and Linux grants the tile state, bf16 passes run on AMX tiles instead, 16
query rows at a time (kernels/attention.c, amx_part; faster from a few rows, at par for one row), with their own
roundings and the same row invariance; `SIMLLM_ATTENTION=vector` keeps the vector code. There, sequences whose
buffers begin with the same bits (one context, several requests: `plan`'s lead and shared) have those slots
read once per pass for all of them.
"""
from __future__ import annotations

import ctypes
import dataclasses
import os
import threading

import torch

from . import abi, build, compute_threads

MAX_HEAD_DIM = 256  # the kernel's per-row buffers
_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
_ARGS = [_P, _L, _L, _P, _L, _L, _P, _L, _L, _P, _I, _I, _I, ctypes.c_float, ctypes.c_float, _I, _P, _I, _P, _I, _P,
         _L, _I]
# Every entry bound here: name -> (argtypes, restype), checked against attention_api.h (kernels/abi.py)
SIGNATURES: abi.Signatures = {"simllm_attend_bf16": (_ARGS, None), "simllm_attend_f32": (_ARGS, None),
              "simllm_attend_amx_bf16": (_ARGS, None), "simllm_attend_amx_init": ([], _I),
              "simllm_attend_set_pool": ([_P], None)}
# Below this many multiply-adds a pass runs in the caller's thread: a decode step (~0.7M) and a verification
# pass of up to ~40 rows: threads started per layer made a 17-row pass slower than one thread (measured at 2
# threads: benchmark/results/verified_decoding_notes.md).
THREAD_MIN_MACS = 30_000_000
# The same on the 4-bit kernel's kept workers (use_pool): one row over a few dozen keys gains nothing from them
# (measured at 2 threads: benchmark/results/verified_decoding_notes.md).
POOL_THREAD_MIN_MACS = 100_000


@dataclasses.dataclass
class PassPlan:
    """The sequences of one pass, as the kernel reads them: built once per pass, used for every layer."""

    table: torch.Tensor  # [nseq, 14] int64 (see kernels/attention.c)
    rows: int  # query rows in the pass
    longest: int  # the most keys any sequence attends
    pairs: int  # (query token, key) pairs of the pass, at most: what its cost grows with
    dtype: torch.dtype
    buffers: list  # the KV tensors the table points into, kept alive for the pass
    slots: int = 0  # the most slots (rounded up to 32, summed over its members) a group has: paired values


class AttentionKernel:
    """The compiled kernel, called on torch tensors."""

    def __init__(self, path: str, amx: bool = True):
        lib = ctypes.CDLL(path)
        self.path = path
        self._fns = {torch.bfloat16: abi.bind(lib, "attention", SIGNATURES, "simllm_attend_bf16"),
                     torch.float32: abi.bind(lib, "attention", SIGNATURES, "simllm_attend_f32")}
        # bf16 on AMX tiles where the compiler targets them and Linux grants the tile state; SIMLLM_ATTENTION=vector
        # keeps the vector code for bf16 (the two round differently: the numerics digest tells them apart).
        self.amx = None
        init = abi.bind(lib, "attention", SIGNATURES, "simllm_attend_amx_init")
        amx_fn = abi.bind(lib, "attention", SIGNATURES, "simllm_attend_amx_bf16")  # None: not built here
        if amx and os.environ.get("SIMLLM_ATTENTION", "").lower() != "vector" and amx_fn is not None \
                and init() == 0:
            self.amx = amx_fn
        self._scratch = threading.local()
        self._set_pool = abi.bind(lib, "attention", SIGNATURES, "simllm_attend_set_pool")
        self.pooled = False

    def use_pool(self, pool_call: int | None) -> None:
        """Split passes on kept worker threads: `pool_call` is the address of int4_kernel's simllm_pool_call
        (None: threads started per pass again). Passes from POOL_THREAD_MIN_MACS on are then split."""
        self._set_pool(pool_call)
        self.pooled = pool_call is not None

    def uses_amx(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether a pass of this dtype and head size runs on AMX tiles (else the vector code)."""
        return self.amx is not None and dtype == torch.bfloat16 and head_dim % 64 == 0

    def supports(self, dtype: torch.dtype, head_dim: int, device) -> bool:
        return torch.device(device).type == "cpu" and dtype in self._fns and head_dim % 16 == 0 \
            and head_dim <= MAX_HEAD_DIM

    @staticmethod
    def plan(seqs: list[tuple]) -> PassPlan:
        """seqs: (row0, m, start, k, v[, lead, shared[, slots]]) per sequence: its query rows row0..row0+m-1 are
        tokens at slots start..start+m-1 of k, v [L, Hkv, C, D] (a KVBuffer's tensors; the kernel writes their
        new KV there). `lead`, `shared`: slots [0, shared) of this buffer hold the same bits as those of sequence
        `lead` (an earlier one, itself leading, whose own `shared` is the same): the AMX code reads them once for
        all. The caller vouches for the bits (ModelBackend.same_prefix compares them); shared is a multiple of 32,
        at most every member's and the lead's start. `slots` (int64 [m], non-decreasing; start is then ignored):
        the tokens' own slots instead, each attending every slot up to its own (tokens scattered among KV
        already there: semantic repair's recomputed ones, slot = position); a slot named twice gets the same
        KV twice."""
        rows, longest, pairs, dtype, keep = 0, 0, 0, None, []
        table: list[list[int]] = []
        group_slots: dict = {}
        for i, seq in enumerate(seqs):
            row0, m, start, k, v = seq[:5]
            lead, shared = (seq[5], seq[6]) if len(seq) > 5 else (i, 0)
            own = seq[7] if len(seq) > 7 else None
            if own is not None:
                own = own.to("cpu", torch.int64).contiguous()
                if own.shape != (m,) or m < 1 or int(own[0]) < 0 or bool((own[1:] < own[:-1]).any()):
                    raise ValueError(f"attention kernel: sequence {i}'s slots must be {m} non-decreasing slots >= 0")
                start = int(own[-1]) + 1 - m
                keep.append(own)
            if k.dim() != 4 or k.shape != v.shape or k.stride(3) != 1 or v.stride(3) != 1:
                raise ValueError("attention kernel: KV buffers must be [L, H, C, D] with a contiguous last dimension")
            if dtype not in (None, k.dtype) or v.dtype != k.dtype:
                raise ValueError("attention kernel: one dtype for every buffer of a pass")
            if (start < 0 and own is None) or m < 1 or start + m > k.shape[2]:
                raise ValueError(f"attention kernel: slots {start}..{start + m} do not fit a buffer of {k.shape[2]}")
            if not 0 <= lead <= i or shared < 0 or shared % 32 or shared > max(start, 0) \
                    or (own is not None and shared) or lead < i and (
                        table[lead][11] != lead or table[lead][12] != shared or k.shape != seqs[lead][3].shape):
                raise ValueError(f"attention kernel: sequence {i} cannot share {shared} slots with sequence {lead}")
            dtype = k.dtype
            table.append([row0, m, start, k.data_ptr(), v.data_ptr(), *k.stride()[:3], *v.stride()[:3], lead, shared,
                          0 if own is None else own.data_ptr()])
            rows, longest, pairs = max(rows, row0 + m), max(longest, start + m), pairs + m * (start + m)
            members, slots = group_slots.get(lead, (0, 0))
            if members == 64:
                raise ValueError(f"attention kernel: sequence {i} cannot share with sequence {lead}: 64 do already")
            group_slots[lead] = (members + 1, slots + -(-(start + m) // 32) * 32)
        return PassPlan(torch.tensor(table, dtype=torch.int64), rows, longest, pairs, dtype,
                        [t for s in seqs for t in s[3:5]] + keep, max(s for _, s in group_slots.values()))

    def pass_args(self, plan: PassPlan, Hq: int, D: int) -> tuple:
        """(entry point, work buffer, its stride per thread, threads) of a pass: the C function's last arguments,
        the same for each of the pass's layers (layer_kernel calls it from C)."""
        fn = self._fns[plan.dtype]
        least = min(THREAD_MIN_MACS, POOL_THREAD_MIN_MACS) if self.pooled else THREAD_MIN_MACS
        threads = compute_threads.kernel_threads() if plan.pairs * Hq * D * 2 >= least else 1
        if self.uses_amx(plan.dtype, D):
            fn, wm = self.amx, -(-plan.longest // 32) * 32  # kernels/attention.c's layout of a thread's work
            stride = 49 * wm + plan.slots * D // 2 + 32 * D + 2 * plan.table.shape[0] + 320
        else:
            stride = 8 * (plan.longest + 16)  # ROW_BLOCK rows of scores, padded to whole vectors, per thread
        work = getattr(self._scratch, "work", None)  # per calling thread: the call runs without the GIL
        if work is None or work.numel() < stride * threads:
            work = self._scratch.work = torch.empty(max(stride * threads, 8 * 1024), dtype=torch.float32)
        return fn, work, stride, threads

    def attend(self, plan: PassPlan, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
               scale: float, out: torch.Tensor | None = None, blocked: torch.Tensor | None = None,
               first: int = 0, softcap: float | None = None) -> torch.Tensor:
        """One layer: writes the rows' new keys and values k_new, v_new [N, Hkv, D] into each sequence's
        buffer, then attends q [N, Hq, D] (unscaled; strided views are read in place) -> out [N, Hq, D].
        Causal by slot; or `blocked` [m, T - first] (one sequence: True refuses key first + j, T = start + m).
        `softcap`: scores s become softcap * tanh(s / softcap) before the softmax (Gemma 2's)."""
        N, Hq, D = q.shape
        Hkv = k_new.shape[1]
        fn = self._fns.get(q.dtype)
        if fn is None or q.dtype != plan.dtype or k_new.dtype != q.dtype or v_new.dtype != q.dtype:
            raise ValueError("attention kernel: q, new KV and the buffers must share a dtype (bfloat16 or float32)")
        if N < plan.rows or k_new.shape != v_new.shape or k_new.shape[0] != N or Hq % Hkv or \
                min(q.stride(2), k_new.stride(2), v_new.stride(2)) != 1:
            raise ValueError("attention kernel: rows [N, heads, D] with a contiguous last dimension, N covering "
                             "the plan")
        if out is None:
            out = torch.empty((N, Hq, D), dtype=q.dtype)
        blk = None
        if blocked is not None:
            t = plan.table
            if t.shape[0] != 1 or blocked.shape != (int(t[0, 1]), int(t[0, 2] + t[0, 1]) - first):
                raise ValueError(f"attention kernel: mask {tuple(blocked.shape)} does not fit the pass")
            blk = blocked.contiguous().view(torch.uint8)
        fn, work, stride, threads = self.pass_args(plan, Hq, D)
        fn(q.data_ptr(), q.stride(0), q.stride(1), k_new.data_ptr(), k_new.stride(0), k_new.stride(1),
           v_new.data_ptr(), v_new.stride(0), v_new.stride(1), out.data_ptr(), Hq, Hkv, D, scale,
           float(softcap or 0.0), plan.table.shape[0], plan.table.data_ptr(), layer,
           None if blk is None else blk.data_ptr(), first,
           work.data_ptr(), stride, threads)
        return out


_LOADER = build.Loader("SIMLLM_ATTENTION", "torch", "attention", AttentionKernel, signatures=SIGNATURES)


def load() -> "AttentionKernel | None":
    """The kernel for this process (built on first use), or None with `why_not()` saying why."""
    return _LOADER.load()


def why_not() -> str | None:
    return _LOADER.why_not
