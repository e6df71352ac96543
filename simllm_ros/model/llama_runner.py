"""A lean forward pass for Llama-family models over a preallocated KV buffer.

Two reasons it exists:
1. Exactness. Reusing a cached prefix, or verifying draft tokens in one pass, feeds
   the model the same tokens in different chunks. For the answer to be the model's
   own, every token's result must not depend on how many tokens ran with it (batch
   invariance). Measured on this project's CPUs (oneDNN, avx512_bf16): bf16 matrix
   products are row-invariant for any M >= 2 rows, but a single row takes a GEMV
   path that rounds differently in ~8% of rows; float32 (MKL) changes with M from
   16 rows on; torch's fused CPU attention changes with the key length. So this
   runner (a) never runs one row alone: a single token is padded with a throwaway
   second row, (b) computes attention with our own kernel (attention_kernel: every query
   row alone, in a fixed order), or where that is unavailable as two plain products with a
   float32 softmax in between; either way a row does not depend on M or on masked keys. `ModelBackend`
   checks the property bitwise at load time (`invariance_probe`) and reports
   reuse as approximate where a platform fails it.
2. Speed. On a CPU the Hugging Face forward spends a large share of a decode step
   outside the matrix products (cache concatenation, mask building, dispatch through
   many modules). This runner reads the HF model's own weights (q/k/v and gate/up
   fused into one product each; the HF modules keep views, nothing is duplicated),
   writes KV in place into a preallocated `KVBuffer` (at consecutive slots, or at each token's own: semantic
   repair), and is causal by slot (the torch path builds a mask only when several tokens run at once). On
   CPUs with AMX, 4-bit products and the 8-bit LM head run on our own tile kernel in bf16 (int4_kernel); on
   other CPUs in float32 on our vector kernel (int4_vector_kernel: torch's float32 products are not
   row-invariant); RMSNorm is one C call (norm_kernel), and with either kernel a pass's layers are one C call
   (layer_kernel); all row-invariant.

Only for RoPE models whose HF module layout is Llama's (`supports` and `ModelBackend` decide): full attention (with
SmolLM3's layers without RoPE among them), or Gemma 2's and 3's layers (sliding-window layers, Gemma 3's with their
own RoPE base, norms of x * (1 + w), norms after attention and MLP, GELU; Gemma 2's soft-capped attention scores);
other models use the HF forward.

Its parts: kv_buffer (KVBuffer, Seq), runner_weights (weight packing and which kernel runs each product: Proj,
Head8, Norm), runner_layers (LayerSteps: the steps inside a layer and the torch attention path; the runner's
`steps`) and runner_early (EarlyPasses: SEMANTIC repair's early passes; the runner's `early`).
"""
from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from ..kernels import attention_kernel, int4_kernel, int4_vector_kernel, layer_kernel, norm_kernel
from ..kernels.int4_kernel import Int4Kernel
from ..kernels.int4_vector_kernel import VectorKernel
from ..kernels.norm_kernel import NormKernel
from . import skeleton
from .gguf_weights import ModelFile
from .kv_buffer import KVBuffer, Seq
from .packed_weights import PackedStore
from .runner_early import EarlyPasses
from .runner_layers import NO_ROPE, Layer, LayerSteps
from .runner_weights import bias_of, cat_bias, file_parts, gemma_layout, hand_out, Head8, Norm, Proj, \
    return_freed_heap, ScaledRows, on_q8_grid

# The highest instruction set oneDNN (torch's bf16 CPU products) may use in this process. With AMX (Sapphire
# Rapids and later Xeons) oneDNN switches kernels by row count, and they round differently: measured on such a
# CPU (torch 2.13), the LM head's logits of a row changed between passes of 17, 24 and 48 rows, and attention
# changed a layer's KV between a 44- and a 48-token pass, so the invariance probe failed and every lossless
# hit became a miss. Capped at AVX-512 with bf16 the probe passes there; it cost ~8% of a 4-bit decode step and
# ~10-20% of a prefill on that CPU. Only set when the user has not chosen (ONEDNN_MAX_CPU_ISA or
# DNNL_MAX_CPU_ISA): it must be in place before oneDNN's first product in the process, i.e. before a model
# loads. Below this level (no AMX) it changes nothing.
ONEDNN_ISA_CAP = "AVX512_CORE_BF16"
if not (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")):
    os.environ["ONEDNN_MAX_CPU_ISA"] = ONEDNN_ISA_CAP


class LlamaRunner:
    """The batch-invariant forward passes of one model; its parts: `steps` (LayerSteps, the steps inside a layer)
    and `early` (EarlyPasses, SEMANTIC repair's early passes)."""

    def __init__(self, model: Any, weight_bits: int = 16, file: ModelFile | None = None,
                 packed: PackedStore | None = None, int8_rows: bool = False):
        """`file` (gguf_weights.ModelFile, float32 with weight_bits 4 only): the projections and LM head run on the
        GGUF's own blocks on the vector kernel instead of 4-bit codes found again from the weights. `packed`
        (packed_weights.PackedStore): those blocks as packed at an earlier load, mapped instead of packed again.
        `int8_rows`: the file's Q4_K, Q6_K, Q8_0, Q5_0 and Q4_0 blocks take 8-bit rows (integer dot products)."""
        base = model.model
        cfg = model.config
        self.model = model
        self.weight_bits = weight_bits
        self.embed: Any = base.embed_tokens
        # What the model computes in and on, kept here: the embedding may be the file's blocks (FileEmbedding)
        self.dtype, self.device = base.embed_tokens.weight.dtype, base.embed_tokens.weight.device
        self.hidden, self.vocab = cfg.hidden_size, base.embed_tokens.num_embeddings
        norms = norm_kernel.load()
        self.norm = Norm(base.norm, norms)
        gemma = gemma_layout(model)
        attn_softcap = self._read_geometry(cfg, base, gemma)
        self.int4 = self._choose_int4(base)
        self.file = file if self.int4 is not None and self.int4.dtype == torch.float32 else None
        if file is not None and self.file is None:
            raise ValueError("a GGUF's own blocks run on the float32 vector kernel only")
        self._hf_released = False  # whether the HF modules' dense weights were given up for the runner's copies
        self._hf_views: list[tuple[Proj | Head8, tuple]] = []  # (projection, the HF linears of its weights)
        lm_w = model.lm_head.weight.data
        builds = self._file_builds(lm_w.shape[0] % 16 == 0, int8_rows) if self.file is not None else {}
        parts: Callable[[str, Callable[[], list]], list] = \
            packed.parts if packed is not None else (lambda key, build: build())
        self.lm_head = self._build_head(model.lm_head, parts, builds)
        if packed is not None:  # the layers' parts the file of packed blocks lacks, on every core; after the LM
            # head, packed alone first: its decoding (~1.5 GB at a 150k vocabulary) on top of the packed layers
            # would set the load's peak
            packed.build_all({key: build for key, build in builds.items() if key != "head"})
        # Rows the LM head takes at least: one on our kernels (a row's bits do not depend on the rows beside it,
        # test_numerics_contract; a second row would stream the whole head again), two on torch's 16-bit products.
        self._head_rows = 1 if isinstance(self.lm_head, Head8) or self.lm_head.parts is not None else 2
        self.qk_norms: list[tuple[Norm, Norm] | None] = []
        self.post_norms: list[tuple[Norm, Norm] | None] = []  # Gemma's norms of the attention and MLP outputs
        self.layers = [self._build_layer(li, layer, norms, gemma, parts, builds)
                       for li, layer in enumerate(base.layers)]
        # Our C attention (attention_kernel) where it applies: faster than the two oneDNN products for a
        # decode step; None: the torch path below. Chosen once per runner, so every pass uses the same one.
        kernel = attention_kernel.load()
        self.kernel = kernel if kernel is not None and kernel.supports(self.dtype, self.head_dim, self.device) \
            else None
        # Whether a lone token may run as one row (check_single_rows); else it is padded to two.
        self.single_rows = False
        self.inter = base.layers[0].mlp.gate_proj.out_features
        self.fused = self._choose_layers_kernel(norms, attn_softcap)
        self.layers_in_c = True  # False: the same arithmetic, layer by layer from Python (tests compare the two)
        self._take_file_embedding(base, model.lm_head)
        self._release_hf_weights(model.lm_head, base)
        self.steps = LayerSteps(layers=self.layers, n_heads=self.n_heads, n_kv=self.n_kv, head_dim=self.head_dim,
                                scale=self.scale, inter=self.inter, rotary=self.rotary, rope_types=self.rope_types,
                                rope_of=self.rope_of, partner=self._partner, window=self.window,
                                qk_norms=self.qk_norms, post_norms=self.post_norms, softcap=self.softcap,
                                attn_softcap=attn_softcap, fused=self.fused, kernel=self.kernel, device=self.device)
        self.early = EarlyPasses(self, self.steps)

    @property
    def attn_softcap(self) -> float | None:
        """Gemma 2's soft cap of the attention scores (None: none); the layers' steps hold it."""
        return self.steps.attn_softcap

    def _read_geometry(self, cfg: Any, base: Any, gemma: bool) -> float | None:
        """The heads, RoPE tables and kinds, windows and soft caps of the model's config; returns Gemma 2's soft cap
        of the attention scores (a Gemma 3 config has the field too, which neither transformers nor llama.cpp
        applies)."""
        # our tables (the same bits on every CPU, rope_trig) also where the load built transformers' classes
        ours = isinstance(base.rotary_emb, skeleton.RotaryEmbedding)
        self.rotary = base.rotary_emb if ours else (skeleton.static_rotary(cfg) or base.rotary_emb)
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.group = self.n_heads // self.n_kv
        self.scale = self.head_dim ** -0.5
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv * self.head_dim
        # RoPE on the first rope_dims of each head (Phi-4-mini's 96 of 128; all elsewhere), turning (d, d + rope_dims
        # / 2) together; the tables are padded to the head with cos 1, sin 0, so the rest stays as it is
        self.rope_dims = skeleton.rope_dims(cfg)
        half = self.rope_dims // 2
        self._partner = None if self.rope_dims == self.head_dim else torch.tensor(
            [d + half if d < half else d - half if d < self.rope_dims else d for d in range(self.head_dim)])
        # Gemma 2 and 3: queries scaled by query_pre_attn_scalar, a window of keys on sliding layers, norms after
        # attention and MLP, soft-capped logits; Gemma 3 a RoPE table per layer type (sliding layers have their own
        # base), Gemma 2 one table and soft-capped attention scores
        if gemma:
            self.scale = float(cfg.query_pre_attn_scalar) ** -0.5
        self.layer_types = list(getattr(cfg, "layer_types", None) or []) if gemma else []
        self.rope_types: list[str | None] = sorted(set(self.layer_types)) if skeleton.rope_per_layer_type(cfg) \
            else [None]
        self.rope_of = [self.rope_types.index(t) for t in self.layer_types] if self.rope_types != [None] \
            else [0] * len(base.layers)
        # SmolLM3's NoPE layers (no_rope_layers[i] 0) attend without RoPE: a table of their own that leaves a row
        # as it is (cos 1, sin 0), so that each path rotating layer li by rope_of[li] (the C layers, SEMANTIC's
        # re-rotation of keys) needs no case of its own
        nope = [i for i, r in enumerate(getattr(cfg, "no_rope_layers", None) or []) if not r]
        if nope:
            self.rope_types.append(NO_ROPE)
            for i in nope:
                self.rope_of[i] = len(self.rope_types) - 1
        self.window = [int(cfg.sliding_window) if t == "sliding_attention" else 0 for t in self.layer_types] \
            or [0] * len(base.layers)
        self.windowed = any(self.window)
        self.softcap = getattr(cfg, "final_logit_softcapping", None) if gemma else None
        return getattr(cfg, "attn_logit_softcapping", None) if cfg.model_type == "gemma2" else None

    def _choose_int4(self, base: Any) -> Int4Kernel | VectorKernel | None:
        """4-bit products on our own kernel, for every projection or none, so that every pass computes the same way:
        in bf16 on AMX (int4_kernel: faster than ATen's from a few rows up), in float32 on vector units elsewhere
        (int4_vector_kernel: row-invariant where torch's float32 products are not)."""
        int4: Int4Kernel | VectorKernel | None = None
        dtype, on_cpu = self.dtype, self.device.type == "cpu"
        if self.weight_bits == 4 and on_cpu and dtype in (torch.bfloat16, torch.float32):
            shapes = [(lin.out_features, lin.in_features) for layer in base.layers for lin in (
                layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)]
            if all(n % 16 == 0 and k % int4_kernel.GROUP == 0 for n, k in shapes):
                int4 = int4_kernel.load() if dtype == torch.bfloat16 else int4_vector_kernel.load()
            if int4 is None and dtype == torch.float32:
                raise ValueError(f"weight_bits=4 in float32 runs on our vector kernel only: "
                                 f"{int4_vector_kernel.why_not() or 'shapes not in 16s of outputs, 32s of inputs'}")
        return int4

    def _build_head(self, lm: Any, parts: Callable[[str, Callable[[], list]], list],
                    builds: dict[str, Callable[[], list]]) -> Proj | Head8:
        """The LM head. At 4 bits it is not 4-bit: it is usually tied to the embedding, which GGUF files keep above 4
        bits (SmolLM2's Q4_1 file: Q8_0, 32 distinct values in a group of 32), so 4 bits would re-quantize it.
        Where that embedding is Q8_0 and our kernel runs, its own 8-bit codes; else 16-bit."""
        lm_w = lm.weight.data
        if self.file is not None and self.file.head is not None and lm_w.shape[0] % 16 == 0:
            [(kind, blob, n)] = parts("head", builds["head"])
            head = Proj(None, None, 16, self.int4, parts=[(kind, blob, n)])
            head.ggml, head.bits = self.file.head.ggml, {
                "q4": 4, "q4k": 4, "q4k8": 4, "q5k8": 5, "q8": 8, "q6": 6, "q6k8": 6, "q3k8": 3, "q8r": 8,
                "q5r": 5, "q51r": 5, "q4r": 4, "iq4r": 4, "iq4xs": 4}[kind]
            return head
        if self.int4 is not None and lm.bias is None and lm_w.shape[0] % 16 == 0 and on_q8_grid(lm_w):
            return Head8(lm_w, self.int4)
        return Proj(lm_w, lm.bias.data if lm.bias is not None else None,
                     16 if self.weight_bits == 4 else self.weight_bits)

    def _build_layer(self, li: int, layer: Any, norms: NormKernel | None, gemma: bool,
                     parts: Callable[[str, Callable[[], list]], list], builds: dict[str, Callable[[], list]]) -> Layer:
        """Layer li's norms and fused products (the file's packed blocks, or the HF weights fused: the HF modules
        keep views into them); its q/k norms and norms after attention and MLP appended to qk_norms, post_norms."""
        att, mlp = layer.self_attn, layer.mlp
        weight_bits, int4 = self.weight_bits, self.int4
        if self.file is not None:
            def layer_parts(name: str) -> list:
                return parts(f"{li}.{name}", builds[f"{li}.{name}"])

            qkv = Proj(None, cat_bias(att.q_proj, att.k_proj, att.v_proj), 4, int4, parts=layer_parts("qkv"))
            gate_up = Proj(None, None, 4, int4, parts=layer_parts("gate_up"))
            o = Proj(None, bias_of(att.o_proj), 4, int4, parts=layer_parts("o"))
            down = Proj(None, bias_of(mlp.down_proj), 4, int4, parts=layer_parts("down"))
        else:
            qkv = Proj(*self._fuse(att.q_proj, att.k_proj, att.v_proj), weight_bits, int4)
            gate_up = Proj(*self._fuse(mlp.gate_proj, mlp.up_proj), weight_bits, int4)
            o = Proj(att.o_proj.weight.data, bias_of(att.o_proj), weight_bits, int4)
            down = Proj(mlp.down_proj.weight.data, bias_of(mlp.down_proj), weight_bits, int4)
        self._hf_views += [(qkv, (att.q_proj, att.k_proj, att.v_proj)), (gate_up, (mlp.gate_proj, mlp.up_proj)),
                           (o, (att.o_proj,)), (down, (mlp.down_proj,))]
        # Qwen3's per-head RMSNorms of q and k (before RoPE): row-invariant on the norm kernel like the others
        self.qk_norms.append((Norm(att.q_norm, norms), Norm(att.k_norm, norms)) if hasattr(att, "q_norm")
                             else None)
        if gemma:  # the norm before the MLP is pre_feedforward's; post_attention's is of the attention output
            ln2 = Norm(layer.pre_feedforward_layernorm, norms)
            self.post_norms.append((Norm(layer.post_attention_layernorm, norms),
                                    Norm(layer.post_feedforward_layernorm, norms)))
        else:
            ln2 = Norm(layer.post_attention_layernorm, norms)
            self.post_norms.append(None)
        return (Norm(layer.input_layernorm, norms), qkv, o, ln2, gate_up, down, mlp.act_fn)

    def _choose_layers_kernel(self, norms: NormKernel | None, attn_softcap: float | None
                              ) -> layer_kernel.Layers | None:
        """The layers in one C call per pass where every piece of them is ours (layer_kernel: a quarter of a decode
        step in Python and tensor ops otherwise); then the MLP's SiLU is its own wherever a layer runs in Python."""
        lk = layer_kernel.load() if self.int4 is not None and self.kernel is not None else None
        if lk is not None and self.int4 is not None and lk.takes(self.int4.dtype) and layer_kernel.Layers.applies(self):
            return layer_kernel.Layers(lk, self.layers, self.int4, norms, self.kernel, self.hidden,
                                       self.n_heads, self.n_kv, self.head_dim, self.inter, self.scale,
                                       self.qk_norms, self.post_norms, self.rope_of, self.window,
                                       attn_softcap, self.rope_dims)
        return None

    def _take_file_embedding(self, base: Any, lm: Any) -> None:
        """The token embedding looked up from the file's blocks where it has them (the dense one released unless
        the LM head still reads it); then the file's codes need not stay (packed)."""
        if self.file is not None and self.file.embed is not None:  # looked up from the file's blocks
            self.embed = self.file.embed
            if hasattr(base.embed_tokens, "embed_scale"):  # Gemma's rows times sqrt(hidden), as transformers does
                self.embed = ScaledRows(self.file.embed, base.embed_tokens.embed_scale.to(self.dtype))
            if lm.weight is not base.embed_tokens.weight or self.file.head is not None:
                base.embed_tokens.weight.data = base.embed_tokens.weight.data.new_empty((0, self.hidden))
                self._hf_released = True
        if self.file is not None:  # packed now: the codes need not stay
            self.file = self.file.formats_only()

    def _release_hf_weights(self, lm: Any, base: Any) -> None:
        """Packed or quantized weights are a second copy: the HF modules' dense ones are released (the model's
        weight memory stays 1x) and, if packed, unpacked again only if something asks for the HF model
        (`hf_model`). Quantized ones cannot be given back."""
        if lm.weight is not base.embed_tokens.weight:  # an untied lm_head: the runner's copy is the one used
            self._hf_views.append((self.lm_head, (lm,)))
        for proj, linears in self._hf_views:
            if proj.weight is None:  # packed or quantized: the runner holds its own copy
                for lin in linears:
                    lin.weight.data = lin.weight.data.new_empty((0, lin.in_features))
                self._hf_released = True
        if self._hf_released:
            return_freed_heap()

    FILE_PARTS = (("qkv", ("q_proj", "k_proj", "v_proj")), ("gate_up", ("gate_proj", "up_proj")), ("o", ("o_proj",)),
                  ("down", ("down_proj",)))

    def _file_builds(self, head: bool, int8_rows: bool) -> dict[str, Callable[[], list]]:
        """Every packed part of the file's blocks by key, as a function that packs it (the keys __init__ asks
        the store for): the LM head where it is the file's own, then each layer's fused projections."""
        file, int4 = self.file, self.int4
        assert file is not None and int4 is not None  # a file's blocks run on the vector kernel only
        builds: dict[str, Callable[[], list]] = {}
        if head and (file_head := file.head) is not None:
            builds["head"] = lambda: [file_head.pack(int4, int8_rows)]
        for li, fw in enumerate(file.layers):
            for name, projs in self.FILE_PARTS:
                def build(fw: dict = fw, projs: tuple[str, ...] = projs) -> list:
                    return file_parts([fw[p] for p in projs], int4, int8_rows)

                builds[f"{li}.{name}"] = build
        return builds

    def hf_model(self):
        """The HF model with dense weights, for code that runs its own forward (the benchmark's plain
        `generate` reference). Unpacks the released weights once (exact); costs their memory again."""
        if self._hf_released and self.weight_bits != 16:
            raise RuntimeError(f"the runner holds {self.weight_bits}-bit weights and released the dense ones: "
                               "transformers' own forward needs weight_bits 16")
        if self._hf_released:
            for proj, linears in self._hf_views:
                if isinstance(proj, Proj) and proj.packed is not None:
                    hand_out(proj.dense(), linears, "weight")
            self._hf_released = False
        return self.model

    def check_single_rows(self) -> bool:
        """Let a lone token (a plain decode step) run as one row where that gives bitwise what the padded
        two-row pass gives, and say whether it does.

        The 16-bit oneDNN products take a GEMV path for one row that rounds differently, so there a lone
        token is always padded. ATen's int4 kernel is row-invariant down to one row, and attention then
        reads one query row instead of two. Checked on the model itself, not assumed: a short sequence, then
        single tokens at several positions both ways, logits and KV compared bitwise. The LM head is
        16-bit and keeps its two rows either way."""
        self.single_rows = False
        if self.weight_bits != 4:
            return False
        dev = self.device
        L, H, D = len(self.layers), self.n_kv, self.head_dim
        kv = KVBuffer.allocate(L, H, D, 48, self.dtype, dev)
        ids = torch.randint(0, self.vocab, (41,), generator=torch.Generator().manual_seed(7))
        ids = ids.to(dev)
        self.forward(ids[:40], torch.arange(40, device=dev), kv, 0, logits="none")
        same = True
        for p in (0, 1, 2, 16, 40):
            got = []
            for single in (False, True):
                self.single_rows = single
                kv.length = p
                out = self.forward(ids[p:p + 1], torch.tensor([p], device=dev), kv, p)
                got.append((out, kv.k[:, :, p].clone(), kv.v[:, :, p].clone()))
            same = same and all(torch.equal(a, b) for a, b in zip(*got))
        self.single_rows = same
        return same

    def pass_costs(self, max_rows: int, context: int = 128, turn=contextlib.nullcontext) -> list[float]:
        """What a pass of m rows costs relative to one row, for m = 0..max_rows (index m; [0] is 0).

        Verified drafts pay for their rows whether the model accepts them or not, and what a row costs
        depends on the kernels: a 4-bit pass grows with its rows (ATen's int4 kernel is compute-bound from a
        few rows), while a 16-bit single token runs padded to two rows, so its second row is free. Timed on
        the model itself (each size's faster of two rounds), interpolated between the sizes timed and
        extended along the last slope beyond them. Each pass in a `turn()` of its own (the engine's model turn, where
        timed beside requests: they wait one pass at most)."""
        dev = self.device
        # a prior only (pass_costs.PassCosts learns each size's cost from the passes served): five sizes in two rounds,
        # where seven sizes twice took a first load's seconds; never a token's bits
        sizes = [m for m in (1, 2, 4, 8, 16) if m <= max(1, max_rows)]
        kv = KVBuffer.allocate(len(self.layers), self.n_kv, self.head_dim, context + sizes[-1], self.dtype, dev)
        ids = torch.randint(0, self.vocab, (context + sizes[-1],),
                            generator=torch.Generator().manual_seed(11)).to(dev)
        for a in range(0, context, 16):  # the context in short passes: a turn of its own each
            with turn():
                kv.length = a
                self.forward(ids[a:min(context, a + 16)], torch.arange(a, min(context, a + 16), device=dev), kv, a,
                             logits="none")
        # Each size's fastest of two rounds: a pause of the machine (another process, an interrupt) only adds time, and
        # a prior taken from one pause (kept for every later load) would make drafts look dear until relearnt.
        took: dict[int, float] = {}
        for _ in range(2):
            for m in sizes:
                kv.length = context
                pos = torch.arange(context, context + m, device=dev)
                with turn():
                    t0 = time.perf_counter()
                    self.forward(ids[context:context + m], pos, kv, context, logits="all")
                    dt = time.perf_counter() - t0
                took[m] = min(dt, took.get(m, dt))
        one = took[1]
        points = [(m, took[m] / one) for m in sizes]
        costs = [0.0]
        for m in range(1, max_rows + 1):
            lo = max((p for p in points if p[0] <= m), key=lambda p: p[0])
            hi = min((p for p in points if p[0] >= m), key=lambda p: p[0], default=None)
            if hi is None:  # beyond the sizes timed (so at least two were): the last slope
                (a, ca), (b, cb) = points[-2:]
                costs.append(cb + (m - b) * max(0.0, (cb - ca) / (b - a)))
            elif hi[0] == lo[0]:
                costs.append(lo[1])
            else:
                costs.append(lo[1] + (hi[1] - lo[1]) * (m - lo[0]) / (hi[0] - lo[0]))
        # More rows never cost less: timing noise must not make a longer draft look cheaper.
        for m in range(2, len(costs)):
            costs[m] = max(costs[m], costs[m - 1])
        return costs

    @staticmethod
    def _fuse(*linears) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One weight for several projections of the same input; the HF modules keep views into it."""
        w = torch.cat([lin.weight.data for lin in linears], dim=0).contiguous()
        biases = [lin.bias for lin in linears]
        b = torch.cat([x.data for x in biases], dim=0).contiguous() if all(x is not None for x in biases) else None
        hand_out(w, linears, "weight")
        if b is not None:
            hand_out(b, linears, "bias")
        return w, b

    @staticmethod
    def supports(model) -> bool:
        base = getattr(model, "model", None)
        layers = getattr(base, "layers", None)
        if layers is None or not len(layers) or getattr(base, "rotary_emb", None) is None:
            return False
        layer = layers[0]
        att, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        need_att = all(hasattr(att, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        need_mlp = all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn"))
        # Per-head q/k norms (Qwen3) run here; norms over a whole projection (OLMo2's) would need their own code.
        head_dim = getattr(model.config, "head_dim", None) \
            or model.config.hidden_size // model.config.num_attention_heads
        extra = any(getattr(getattr(att, n, None), "weight", torch.empty(head_dim)).shape != (head_dim,)
                    for n in ("q_norm", "k_norm"))
        # Norms after attention or MLP: Gemma 2's and 3's layout only, causal, windows only where its layer types
        # say so
        cfg = model.config
        if hasattr(layer, "pre_feedforward_layernorm") or hasattr(layer, "post_feedforward_layernorm"):
            types = getattr(cfg, "layer_types", None) or []
            extra = extra or not gemma_layout(model) \
                or bool(getattr(cfg, "use_bidirectional_attention", False)) or len(types) != len(layers) \
                or not set(types) <= {"full_attention", "sliding_attention"} \
                or ("sliding_attention" in types and not getattr(cfg, "sliding_window", None))
        return need_att and need_mlp and not extra

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, kv: KVBuffer, start: int,
                slots: torch.Tensor | None = None, logits: str = "last", n_layers: int | None = None,
                hidden: torch.Tensor | None = None, first_layer: int = 0, _single: bool = False):
        """Run tokens `ids` [M] at `positions` [M], writing their KV at buffer slots start..start+M-1, or at
        their own `slots` [M] (ascending; start is then ignored) among KV the buffer already holds.

        Attention is causal by slot (slot order = position order): a token attends every slot up to its
        own (semantic repair's recomputed tokens, scattered among reused ones, slot = position). Returns
        logits of the last token ("last"), of every token ("all"), or None ("none"); `n_layers` stops early (the
        deviation probe of semantic repair needs only the first layers' KV) and returns the hidden rows
        [M, E] after those layers. `hidden` [M, E] with `first_layer` resumes from there: the rows' KV of
        the layers below must already be in `kv` (semantic repair takes both from its early pass).
        """
        M = ids.shape[0]
        if M == 1 and not self.single_rows:  # one row alone would take the GEMV path, which rounds differently
            # (16-bit oneDNN products; see check_single_rows)
            # (with its own slot, the copy is the same token at the same slot: it writes the same KV there)
            before = kv.length
            out = self.forward(torch.cat([ids, ids]), torch.cat([positions, positions + (slots is None)]), kv, start,
                               None if slots is None else torch.cat([slots, slots]), logits, n_layers,
                               None if hidden is None else torch.cat([hidden, hidden]), first_layer, _single=True)
            kv.length = max(before, start + 1 if slots is None else int(slots[0]) + 1)
            return None if out is None else out[:1]
        if slots is not None:
            slots = slots.to(torch.long)
            start = int(slots[-1]) + 1 - M
        end = start + M
        if end > kv.capacity:
            raise ValueError(f"KV buffer holds {kv.capacity} tokens, {end} needed")
        h = self.embed(ids)[None] if hidden is None else hidden.to(self.dtype)[None]  # [1, M, E]
        cos, sin = self.steps.rope_tables(h, positions)
        G, D, Hkv = self.group, self.head_dim, self.n_kv
        # Query heads are grouped by their KV head: [1, Hkv, G*M, D], so a mask repeats G times; built once
        # here rather than in each layer. Causal by slot, every query may attend slots < start: only the
        # new tokens' own columns need masking (`first`: the column the mask starts at); with own slots, all.
        kernel = self.kernel
        blocked, first, plan = None, 0, None
        if kernel is not None:  # causal by slot inside the kernel
            plan = kernel.plan([(0, M, start, kv.k, kv.v) + (() if slots is None else (0, 0, slots))])
            attn = h.new_empty(M, self.n_heads, D)
        elif slots is not None:
            blocked = self.steps.slot_mask(slots, end)
        elif M > 1:
            own = torch.arange(start, end, device=ids.device)
            blocked, first = (own[None, :] > own[:, None]).repeat(G, 1), start
        last = len(self.layers) if n_layers is None else min(n_layers, len(self.layers))
        # Sliding-window layers: each row attends the last `window` slots up to its own (keys before stay in the
        # buffer; only what a row reads changes)
        wplan: Any = None  # a PassPlan (kernel) or {window: mask} (torch path) where the model has windows
        wblocked: Any = None
        if self.windowed and first_layer < last:
            if plan is not None:
                wplan = self.steps.window_plan([(0, M, start, kv.k, kv.v)]) if slots is None else \
                    self.steps.window_plan_at(slots, kv.k, kv.v)
            else:
                wblocked = self.steps.window_mask(start, M, slots)
        fused = self.fused if self.layers_in_c and plan is not None else None
        in_c = fused is not None
        if fused is not None and first_layer < last:
            h = h[0].clone() if hidden is not None else h[0]  # updated in place: never the caller's rows
            fused.run(h, first_layer, last, plan, cos, sin, wplan)
            h = h[None]
        layers = [] if in_c else self.layers[first_layer:n_layers]
        for li, (ln1, qkv_proj, o_proj, ln2, gate_up, down, act) in enumerate(layers, start=first_layer):
            x = ln1(h)
            if plan is not None and kernel is not None:
                q, k, v = self.steps.rotated_rows(qkv_proj(x)[0], cos, sin, li)  # [M, Hq, D], [M, Hkv, D] x 2
                o = kernel.attend(wplan if self.window[li] else plan, li, q, k, v, self.scale, attn,
                                       softcap=self.attn_softcap).view(1, M, -1)
            else:
                q, k, v = self.steps.split_rotated(qkv_proj(x)[0], cos, sin, li)  # [Hq, M, D], [Hkv, M, D] x 2
                at = slice(start, end) if slots is None else slots
                kv.k[li, :, at] = k
                kv.v[li, :, at] = v
                # [Hq, M, D] -> [Hkv, G*M, D]: query head h uses KV head h // G (HF's repeat_kv order).
                qg = (q * self.scale).reshape(Hkv, G * M, D)
                if self.window[li]:
                    o = self.steps.attention(qg, kv.k[li, :, :end], kv.v[li, :, :end], wblocked[self.window[li]], 0)
                else:
                    o = self.steps.attention(qg, kv.k[li, :, :end], kv.v[li, :, :end], blocked, first)
                o = o.reshape(Hkv * G, M, D).transpose(0, 1).reshape(1, M, Hkv * G * D)
            h = self.steps.mlp(self.steps.attended(h, o_proj(o), li), ln2, gate_up, down, act, li)
        kv.length = max(kv.length, end)
        if n_layers is not None:
            return h[0]
        if logits == "none":
            return None
        # A 16-bit lm_head never takes one row alone either: "last" keeps the last two rows (one-row products
        # round differently, see the module doc), a padded single token keeps both; ours takes one (_head_rows).
        if M == 1:  # a single row run as one (single_rows): a 16-bit LM head still gets two; ours takes one
            if self._head_rows == 1:
                return self.steps.capped(self.lm_head(self.norm(h[0])).float())
            return self.steps.capped(self.lm_head(self.norm(h[0].expand(2, -1))).float()[:1])
        h = self.norm(h[0] if logits == "all" or _single else h[0, -self._head_rows:])
        out = self.steps.capped(self.lm_head(h).float())
        return out if logits == "all" or _single else out[-1:]  # [M or 1, vocab]

    @torch.inference_mode()
    def forward_batch(self, seqs: list["Seq"]) -> list[torch.Tensor | None]:
        """Several sequences in one pass: each its own tokens, positions and KVBuffer (ragged lengths).

        Rows of all sequences are concatenated for the embedding, norms, projections, MLP and lm_head
        (one weight read for everyone: a decode step is memory-bound, so this is what batching buys);
        RoPE is per row, and attention runs per sequence over its own buffer, causal by slot. Each
        sequence gets what `forward` gives it alone, bitwise, on a batch-invariant platform (products of
        >= 2 rows are row-invariant; attention is per sequence anyway): a lone row in the whole pass takes
        `forward`'s padded path, and a 16-bit lm_head always runs >= 2 rows. Returns, per sequence, logits
        [M, vocab] ("all"), [1, vocab] ("last") or None ("none").
        """
        if not seqs:
            return []
        total = sum(int(s.ids.shape[0]) for s in seqs)
        if total == 1:  # one row in the whole pass: exactly the one-at-a-time path (padded to two rows)
            s = next(s for s in seqs if s.ids.shape[0])
            return [self.forward(s.ids, s.positions, s.kv, s.start, logits=s.logits) if x is s else None
                    for x in seqs]
        spans, off = [], 0
        for s in seqs:
            m = int(s.ids.shape[0])
            if s.start + m > s.kv.capacity:
                raise ValueError(f"KV buffer holds {s.kv.capacity} tokens, {s.start + m} needed")
            spans.append((off, off + m))
            off += m
        ids = torch.cat([s.ids for s in seqs])
        positions = torch.cat([s.positions for s in seqs])
        h = self.embed(ids)[None]  # [1, N, E]
        cos, sin = self.steps.rope_tables(h, positions)
        D, Hq = self.head_dim, self.n_heads
        kernel = self.kernel
        if kernel is not None:  # one call per layer for every sequence, each over its own buffer
            plan = kernel.plan(self.steps.shared_entries(seqs, spans))
            wplan: Any = self.steps.window_plan([(a, b - a, s.start, s.kv.k, s.kv.v) for s, (a, b) in zip(seqs, spans)
                                       if b > a]) if self.windowed else None
            if self.fused is not None and self.layers_in_c:
                self.fused.run(h[0], 0, len(self.layers), plan, cos, sin, wplan)
            else:
                attn = h.new_empty(total, Hq, D)
                for li, (ln1, qkv_proj, o_proj, ln2, gate_up, down, act) in enumerate(self.layers):
                    q, k, v = self.steps.rotated_rows(qkv_proj(ln1(h))[0], cos, sin, li)
                    o = kernel.attend(wplan if self.window[li] else plan, li, q, k, v, self.scale, attn,
                                           softcap=self.attn_softcap)
                    h = self.steps.attended(h, o_proj(o.view(1, total, Hq * D)), li)
                    h = self.steps.mlp(h, ln2, gate_up, down, act, li)
        else:
            h = self.steps.torch_batch_layers(seqs, spans, h, cos, sin, total)
        rows = []
        for s, (a, b) in zip(seqs, spans):
            s.kv.length = max(s.kv.length, s.start + b - a)
            if b > a and s.logits == "all":
                rows.append(torch.arange(a, b))
            elif b > a and s.logits == "last":
                rows.append(torch.tensor([b - 1]))
        if not rows:
            return [None] * len(seqs)
        sel = torch.cat(rows)
        n_sel = int(sel.shape[0])
        if n_sel < self._head_rows:  # a 16-bit lm_head never takes one row alone: a throwaway second row
            sel = torch.cat([sel, sel])
        out = self.steps.capped(self.lm_head(self.norm(h[0, sel.to(h.device)])).float())
        res, j = [], 0
        for s, (a, b) in zip(seqs, spans):
            n = (b - a) if s.logits == "all" else (1 if s.logits == "last" and b > a else 0)
            res.append(out[j:j + n] if n else None)
            j += n
        return res
