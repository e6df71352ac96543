"""Which code computes each part of a model's passes (attention, 4-bit products, layer sequencing, norms): the
kinds the engine reports and the lines of the load log; the load-time checks' key names them. KernelPaths is a
part ModelBackend (model_backend.py) owns: it reads the runner's kernels and the load's weight and activation bits.
"""
from __future__ import annotations

from ..kernels import attention_kernel, int4_kernel, layer_kernel, norm_kernel
from . import gguf_weights
from .llama_runner import LlamaRunner


class KernelPaths:
    """ModelBackend's kernel paths: those of `runner` (None: transformers' own forward), with `weight_bits` and
    `activation_bits` as the load chose them."""

    def __init__(self, runner: LlamaRunner | None, weight_bits: int, activation_bits: int):
        self.runner = runner
        self.weight_bits = weight_bits
        self.activation_bits = activation_bits

    @property
    def attention_kind(self) -> str:
        """"kernel" (attention_kernel), "torch" (the runner's torch products) or "transformers" (no runner)."""
        if self.runner is None:
            return "transformers"
        return "kernel" if self.runner.kernel is not None else "torch"

    @property
    def attention_arithmetic(self) -> str:
        """"amx" (the kernel's AMX tiles, bf16), "vector" (its vector code) or "" (not the kernel)."""
        r = self.runner
        if r is None or r.kernel is None:
            return ""
        return "amx" if r.kernel.uses_amx(r.dtype, r.head_dim) else "vector"

    @property
    def attention_path(self) -> str:
        """Which attention computes this model's passes, for the load log (the two round differently)."""
        r = self.runner
        if r is None:
            return "transformers' own forward"
        if r.kernel is not None:
            return f"simllm_ros C kernel, {self.attention_arithmetic} ({r.kernel.path})"
        why = attention_kernel.why_not() or "the kernel does not take this dtype, head size or device"
        return f"torch products ({why})"

    @property
    def int4_kind(self) -> str:
        """"amx" (int4_kernel), "vector" (int4_vector_kernel), "aten" (ATen's int4 kernel) or "" (not 4-bit)."""
        if self.runner is None or self.weight_bits != 4:
            return ""
        return self.runner.int4.kind if self.runner.int4 is not None else "aten"

    @property
    def int4_path(self) -> str:
        """Which kernel computes the 4-bit products, for the load log (the two round differently)."""
        kind = self.int4_kind
        r = self.runner
        if kind in ("amx", "vector") and r is not None and r.int4 is not None:
            what = "AMX kernel, bf16" if kind == "amx" else "vector kernel, float32"
            ggml = getattr(r.lm_head, "ggml", None)
            if r.file is not None:  # the GGUF's own blocks, per tensor kind
                kinds = {"q4": "4-bit step/base per 32", "q4k": "4-bit Q4_K layout",
                         "q4k8": "4-bit Q4_K layout x 8-bit rows, integer dot products", "q8": "8-bit scale per 32",
                         "q6": "8-bit scale per 16", "q6k8": "Q6_K x 8-bit rows, integer dot products",
                         "q5k8": "Q5_K x 8-bit rows, integer dot products",
                         "q3k8": "Q3_K x 8-bit rows, integer dot products (4.625 bits a weight)",
                         "q8r": "8-bit scale per 32 x 8-bit rows, integer dot products",
                         "q5r": "5-bit Q5_0 layout x 8-bit rows, integer dot products",
                         "q4r": "4-bit Q4_0 layout x 8-bit rows, integer dot products",
                         "q51r": "5-bit Q5_1 layout x 8-bit rows, integer dot products",
                         "iq4r": "IQ4_NL table indices x 8-bit rows, integer dot products",
                         "iq4xs": "IQ4_XS table indices x 8-bit rows, integer dot products (4.3125 bits a weight)"}

                def kind_of(ggml_type: str) -> str:
                    k = gguf_weights.KINDS[ggml_type]
                    if self.activation_bits == 8 and ggml_type in gguf_weights.INT8_ROW_KINDS:
                        k = gguf_weights.INT8_ROW_KINDS[ggml_type]
                    return kinds[k]
                per = ", ".join(f"{name} {'/'.join(t)} -> {'/'.join(kind_of(x) for x in t)}"
                                for name, t in r.file.formats.items() if name in gguf_weights.PROJECTIONS)
                head = f"{ggml} ({kind_of(ggml)})" if ggml else "16-bit"
                embed = r.file.embed
                emb = f"{embed.ggml} blocks looked up from the file" if embed is not None else "float32"
                return (f"simllm_ros {what} ({r.int4.path}) on the file's own blocks: {per}; LM head {head}; "
                        f"token embedding {emb}")
            head = "8-bit (the file's Q8_0 codes)" if getattr(r.lm_head, "bits", 16) == 8 else "16-bit"
            return f"simllm_ros {what} ({r.int4.path}); LM head {head}"
        if kind == "aten":
            return f"ATen's int4 kernel ({int4_kernel.why_not() or 'the shapes do not fit ours'})"
        return "none (weights are not 4-bit)"

    @property
    def kernels_do_the_work(self) -> bool:
        """Whether a pass's products and attention are our C kernels (4-bit AMX or vector products, attention
        kernel): then the model's thread gives the cores to their workers rather than to torch's (compute_threads)."""
        return self.runner is not None and self.runner.int4 is not None and self.runner.kernel is not None

    @property
    def layers_kind(self) -> str:
        """"c" (layer_kernel: each pass's layers in one C call), "python" (layer by layer) or "" (no runner)."""
        if self.runner is None:
            return ""
        return "c" if self.runner.fused is not None else "python"

    @property
    def layers_path(self) -> str:
        """How the runner sequences a pass's layers, for the load log."""
        r = self.runner
        if r is not None and r.fused is not None:
            return f"one C call per pass ({r.fused.kernel.path})"
        if self.layers_kind == "python":
            why = layer_kernel.why_not() or "not a 4-bit configuration on our products, norms and attention"
            return f"Python, layer by layer ({why})"
        return "transformers' own forward"

    @property
    def norm_path(self) -> str:
        """Which code computes the RMSNorms, for the load log."""
        if self.runner is None:
            return "transformers' own forward"
        k = self.runner.norm.kernel
        return f"simllm_ros C kernel ({k.path})" if k is not None else \
            f"transformers' module ({norm_kernel.why_not() or 'not a bf16 or float32 CPU model'})"
