"""A GGUF file's own quantized weights (Q4_K, Q6_K, Q8_0, Q4_0, Q4_1) for the float32 vector kernel, read from the
file's blocks rather than guessed back from the dequantized float32 weights.

Why: a Q4_K_M file (what most users download) keeps attn_v and ffn_down in Q6_K beside Q4_K, and a Q4_K group's
levels need not include its minimum or maximum, so the min/max grid search that finds a Q4_1 file's grid again
(llama_runner.int4_codes) would re-quantize them. Read from the blocks, the codes and scales are the file's, and
each format maps onto a vector kernel product that computes with exactly those numbers:
- Q4_K, Q4_1, Q4_0: per group of 32, weight = step * code + base with code 0..15 (Q4_K: step = d * sub-scale,
  base = -dmin * sub-min): the 4-bit blob ("q4"); Q4_K in its own layout ("q4k": the sub-scales and sub-mins
  as bytes, d and dmin per 256, worked out by the kernel: the same numbers and bits in 4.75 bits a weight, not 6).
- Q8_0: int8 codes, one scale per 32: the 8-bit blob ("q8", as the LM head of the embedded model); IQ4_NL and IQ4_XS
  too, their codes the values of llama.cpp's table (IQ4_XS's scale per 32 d * (sub-scale - 32), exact in float32;
  on 8-bit rows IQ4_XS keeps its sub-scales and d, as the file: "iq4xs").
- Q6_K: codes -32..31, a scale per 16 (d * int8 sub-scale): the 16-input 8-bit blob ("q6"); Q5_0 (codes -16..15,
  d per 32) too, its scale given to both halves of a block.
With rows quantized to 8 bits (activation_bits 8) Q4_K, Q6_K, Q8_0, Q5_0 and Q4_0 take their own integer-product
layouts instead, at the file's bits (INT8_ROW_KINDS; `FileWeight.pack`).
`match` then checks, bit for bit, that step * code + base (one float32 rounding, as gguf's dequantize computes
it) is the float32 weight the model loaded (transformers dequantizes the same file), permuting rows where the
loader did (Llama's q and k): nothing runs on numbers other than the file's.
"""
from __future__ import annotations

import dataclasses
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..kernels.compute_threads import usable_cpus
from ..safe_io import describe_error, open_regular, pread_exact
from . import gguf_checks
from .gguf_blocks import BLOCKS

# GGUF types each kind of our products takes
KINDS = {"Q4_K": "q4k", "Q4_0": "q4", "Q4_1": "q4", "Q8_0": "q8", "Q6_K": "q6", "Q5_0": "q6", "Q5_K": "q5k",
         "Q3_K": "q6", "IQ4_NL": "q8", "IQ4_XS": "q8", "Q5_1": "q51"}
# ... and the kinds of those that take rows quantized to 8 bits (activation_bits 8)
INT8_ROW_KINDS = {"Q4_K": "q4k8", "Q6_K": "q6k8", "Q8_0": "q8r", "Q5_0": "q5r", "Q4_0": "q4r", "Q5_K": "q5k8",
                  "Q3_K": "q3k8", "IQ4_NL": "iq4r", "IQ4_XS": "iq4xs", "Q5_1": "q51r"}
# ... of which these have no product with float32 rows (activation_bits 32)
INT8_ROWS_ONLY = frozenset({"Q5_K", "Q5_1"})
# The projections of a Llama-family layer: GGUF name -> transformers module path within the layer
PROJECTIONS = {"attn_q": ("self_attn", "q_proj"), "attn_k": ("self_attn", "k_proj"),
               "attn_v": ("self_attn", "v_proj"), "attn_output": ("self_attn", "o_proj"),
               "ffn_gate": ("mlp", "gate_proj"), "ffn_up": ("mlp", "up_proj"), "ffn_down": ("mlp", "down_proj")}


class GGUFError(ValueError):
    """The file is not a GGUF this module can read (truncated, corrupt)."""


@dataclasses.dataclass
class FileWeight:
    """One tensor's codes and scales [N, K] as the file holds them. kind "q4": codes 0..15, step and base per 32
    inputs; "q8": codes -127..127, step per 32 (base None); "q6": codes -32..31, step per 16 (base None)."""

    ggml: str
    kind: str
    codes: torch.Tensor
    step: torch.Tensor
    base: torch.Tensor | None
    perm: torch.Tensor | None = None  # the file's row for each of the model's rows, where the loader permuted them
    raw: tuple | None = None  # Q4_K: sub-scales, sub-mins [N, K/32], d, dmin [N, K/256]; Q6_K: sub-scales [N, K/16], d

    @property
    def group(self) -> int:
        return 16 if self.kind == "q6" else 32

    def dequantized(self) -> torch.Tensor:
        """The float32 weights these codes stand for: step * code (exact in float32 for every format here), plus
        base rounded once (4-bit)."""
        n, k = self.codes.shape
        g = self.group
        w = self.codes.float().reshape(n, k // g, g) * self.step[..., None]
        if self.base is not None:
            w = w + self.base[..., None]
        return w.reshape(n, k)

    def rows(self, perm: torch.Tensor) -> "FileWeight":
        return FileWeight(self.ggml, self.kind, self.codes[perm], self.step[perm],
                          None if self.base is None else self.base[perm], perm,
                          None if self.raw is None else tuple(t[perm] for t in self.raw))

    def pack(self, kernel, int8_rows: bool = False) -> tuple[str, torch.Tensor, int]:
        """(kind, blob, outputs) for the vector kernel (int4_vector_kernel.VectorKernel); `int8_rows`: the blocks on
        rows quantized to 8 bits (kinds "q3k8", "q4k8", "q5k8", "q6k8", "q8r", "q5r", "q4r", "q51r", "iq4r", "iq4xs":
        integer dot products, at the file's bits or near them; Q5_K and Q5_1 have no other; Q3_K otherwise takes the
        16-input 8-bit product, "q6")."""
        raw = self.raw or ()  # the sub-scales of the K-quant and IQ4_XS kinds, which use them
        if self.kind == "q4k" and int8_rows:
            return "q4k8", kernel.pack_q4k8(self.codes, *raw), self.codes.shape[0]
        if self.kind == "q5k":
            if not int8_rows:
                raise ValueError("Q5_K blocks run on rows quantized to 8 bits only (activation_bits 0 or 8)")
            return "q5k8", kernel.pack_q5k8(self.codes, *raw), self.codes.shape[0]
        if self.ggml == "Q6_K" and int8_rows:
            return "q6k8", kernel.pack_q6k8(self.codes, *raw), self.codes.shape[0]
        if self.ggml == "Q3_K" and int8_rows:  # Q6_K's form: codes -4..3, int8 sub-scales per 16, d per 256
            return "q3k8", kernel.pack_q3k8(self.codes, *raw), self.codes.shape[0]
        if self.ggml == "Q8_0" and int8_rows:
            return "q8r", kernel.pack_q8r(self.codes, self.step), self.codes.shape[0]
        if self.ggml == "IQ4_NL" and int8_rows:  # table indices, the file's float16 d per 32
            return "iq4r", kernel.pack_iq4r(self.codes, self.step), self.codes.shape[0]
        if self.ggml == "IQ4_XS" and int8_rows:  # table indices, sub-scales per 32, d per 256: the file's
            return "iq4xs", kernel.pack_iq4xs(self.codes, *raw), self.codes.shape[0]
        if self.ggml == "Q5_0" and int8_rows:  # Q5_0's scale is kept per 16, the same for both halves
            return "q5r", kernel.pack_q5r(self.codes, self.step[:, ::2]), self.codes.shape[0]
        if self.kind == "q51":  # codes 0..31, step d, base m per 32: the file's values as they are
            if not int8_rows:
                raise ValueError("Q5_1 blocks run on rows quantized to 8 bits only (activation_bits 0 or 8)")
            return "q51r", kernel.pack_q51r(self.codes, self.step, self.base), self.codes.shape[0]
        if self.ggml == "Q4_0" and int8_rows:  # codes 0..15, step d, base -8d: the file's d and codes as they are
            return "q4r", kernel.pack_q4r(self.codes, self.step), self.codes.shape[0]
        if self.kind == "q4k":  # the file's Q4_K layout (4.75 bits a weight): the q4 product's bits
            blob = kernel.pack_q4k(self.codes, *raw)
        elif self.kind == "q4":
            blob = kernel.pack_affine(self.codes, self.step, self.base)
        elif self.kind == "q8":
            blob = kernel.pack8(self.codes, self.step)
        else:
            blob = kernel.pack6(self.codes, self.step)
        return self.kind, blob, self.codes.shape[0]




def decode(ggml: str, data: np.ndarray, shape: tuple[int, int], name: str = "") -> FileWeight:
    """A tensor's raw bytes (check_file's Tensor.data) in one of the formats above -> its FileWeight [N, K];
    GGUFError naming tensor `name` where a block's scale (its float16 d, dmin) is not finite: every scale and base
    a product reads is d or dmin times an integer, so a NaN or infinite d or dmin shows in them (checked here,
    on what decoding made anyway, not in a pass of its own)."""
    size, per, fn = BLOCKS[ggml]
    n, k = shape
    if k % per or np.asarray(data).size != n * (k // per) * size:
        raise GGUFError(f"a {ggml} tensor of shape [{n}, {k}] with {np.asarray(data).size} bytes")
    codes, step, base, *raw = fn(np.asarray(data).reshape(-1, size))
    what = f"tensor {name or '(unnamed)'}'s {ggml} block scales"
    gguf_checks.finite(step, what, GGUFError)
    if base is not None:
        gguf_checks.finite(base, what, GGUFError)
    g = 16 if KINDS[ggml] == "q6" else 32
    dtype = torch.uint8 if KINDS[ggml] in ("q4", "q4k", "q5k", "q51") else torch.int8
    kept: tuple[torch.Tensor, ...] | None = None
    if raw and ggml in ("Q4_K", "Q5_K"):  # sub-scales and sub-mins per 32, d and dmin per 256
        sc, mn, d, dmin = raw[0]
        kept = (sc.reshape(n, k // 32).contiguous(), mn.reshape(n, k // 32).contiguous(), d.reshape(n, k // 256),
                dmin.reshape(n, k // 256))
    elif raw and ggml == "IQ4_XS":  # sub-scales less 32 per 32, d per 256
        sub, d = raw[0]
        kept = (sub.reshape(n, k // 32).contiguous(), d.reshape(n, k // 256))
    elif raw:  # Q6_K, Q3_K: int8 sub-scales per 16, d per 256
        sc, d = raw[0]
        kept = (sc.reshape(n, k // 16).contiguous(), d.reshape(n, k // 256))
    return FileWeight(ggml, KINDS[ggml], codes.reshape(n, k).to(dtype), step.reshape(n, k // g).contiguous(),
                      None if base is None else base.reshape(n, k // g).contiguous(), raw=kept)


def match(fw: FileWeight, weight: torch.Tensor) -> FileWeight | None:
    """fw with its rows in the order of `weight` (the model's float32 weight [N, K]) where its dequantized rows are
    bitwise those rows (any order: the Llama loader permutes q and k for RoPE), else None."""
    if weight.dtype != torch.float32 or tuple(weight.shape) != tuple(fw.codes.shape):
        return None
    d = fw.dequantized()
    if torch.equal(d, weight):
        return fw
    where = {d[i].numpy().tobytes(): i for i in range(d.shape[0])}
    perm = [where.get(weight[i].numpy().tobytes()) for i in range(weight.shape[0])]
    if any(p is None for p in perm):
        return None
    return fw.rows(torch.tensor(perm))


@dataclasses.dataclass
class Tensor:
    name: str
    ggml: str
    shape: tuple[int, ...]  # outermost first: [N, K] for a weight
    data: np.ndarray  # its raw bytes, memory-mapped
    path: str = ""  # the file and where the bytes start in it
    offset: int = 0

    def read(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Bytes start..stop of the tensor read into memory of their own, not through the file's map: a load that
        goes through every tensor once would otherwise keep the whole file's pages in its resident set (the
        0.9 GB of a 1.5B Q4_K_M on top of what it builds from them)."""
        stop = self.data.size if stop is None else stop
        if not self.path:
            return np.asarray(self.data[start:stop])
        return np.fromfile(self.path, dtype=np.uint8, count=stop - start, offset=self.offset + start)


# Value types of GGUF metadata: fixed sizes (string 8, array 9 are read apart)
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def check_file(path: str) -> list[Tensor]:
    """The file's tensors (raw bytes memory-mapped), having checked that each lies inside the file; GGUFError if not
    (truncated or corrupt: say so at load, not as a numpy error mid-conversion). Our own reading of the header:
    gguf's GGUFReader decodes every metadata value (seconds for a tokenizer of 49k tokens), this skips them."""
    return read_header(path)[1]


HEADER_BYTES = 64 << 20  # metadata and tensor infos: a few MB even with a large vocabulary
MAX_TENSORS = 1 << 16
MAX_DIMS = 4  # GGML_MAX_DIMS


def read_header(path: str, fields: list | None = None) -> tuple[dict, list[Tensor]]:
    """(the file's scalar and string metadata, arrays left out; its tensors, as check_file gives them), the header
    read with every count and size bounded by the bytes there are, and held to its model (gguf_checks): GGUFError
    naming the key or tensor for anything that does not add up, before anything is allocated from it. `fields`: a
    list given to be filled with every key, arrays too, in the file's order, as (key, value types, values): a
    string as its bytes, a number as a 1-tuple (what transformers' GGUF reader makes of gguf's fields:
    gguf_conversion.HeaderFields)."""
    import gguf  # deferred: gguf is slow to import

    bad = gguf_checks.Bad(path, GGUFError)
    try:
        fd = open_regular(path)  # a FIFO named .gguf would block a plain open
    except OSError as e:
        raise GGUFError(f"'{path}' cannot be read: {describe_error(e)}") from None
    try:
        size = os.fstat(fd).st_size
        head = pread_exact(fd, min(size, HEADER_BYTES), 0)
    except OSError as e:
        raise GGUFError(f"'{path}' cannot be read: {describe_error(e)}") from None
    finally:
        os.close(fd)
    pos = 0
    q_at = struct.Struct("<Q").unpack_from

    def take(fmt):
        nonlocal pos
        v = struct.unpack_from("<" + fmt, head, pos)
        pos += struct.calcsize("<" + fmt)
        return v[0] if len(v) == 1 else v

    def left() -> int:
        return len(head) - pos

    def skip_text(what) -> int:  # a string passed over, bounded (an array's: a vocabulary's 150k not decoded)
        nonlocal pos
        (n,) = q_at(head, pos)
        if n > len(head) - pos - 8:
            bad(f"{what} is a string of {n} bytes, past the end of the header")
        pos += 8 + n
        return n

    def text(what):
        n = skip_text(what)
        return head[pos - n:pos].decode("utf-8", "replace")

    try:
        magic, version, n_tensors, n_kv = take("4sIQQ")
        if magic != b"GGUF" or version < 2:
            raise GGUFError(f"'{path}' is not a GGUF file (magic {magic!r}, version {version})")
        if fields is not None:  # as gguf's reader lists them, first
            fields += [("GGUF.version", [4], [(version,)]), ("GGUF.tensor_count", [10], [(n_tensors,)]),
                       ("GGUF.kv_count", [10], [(n_kv,)])]
        if version > 3:
            bad(f"GGUF version {version} is not one this package reads (2, 3)")
        if n_kv > left() // 12:  # a key of no bytes and a value type at least
            bad(f"the header says {n_kv} metadata keys, more than its {len(head)} header bytes can hold")
        if n_tensors > MAX_TENSORS:
            bad(f"the header says {n_tensors} tensors (at most {MAX_TENSORS})")
        meta: dict = {}
        for i in range(n_kv):
            key = text(f"metadata key #{i}")
            vtype = take("I")
            if vtype == 9:
                etype, count = take("IQ")
                if etype == 9:
                    bad(f"metadata {key} is an array of arrays, which GGUF readers (llama.cpp's) do not take")
                if etype == 8:
                    if count > left() // 8:
                        bad(f"metadata {key} says {count} strings, past the end of the header")
                    items: list | None = [] if fields is not None else None
                    for _ in range(count):
                        n = skip_text(key)
                        if items is not None:
                            items.append(head[pos - n:pos])
                elif etype in _FIXED:
                    if count > left() // _FIXED[etype]:
                        bad(f"metadata {key} says {count} values, past the end of the header")
                    if fields is not None:
                        values = np.frombuffer(head, "<" + _SCALAR[etype], count, pos).tolist()
                        items = [(v,) for v in values]
                    pos += _FIXED[etype] * count
                else:
                    bad(f"metadata {key} is an array of an unknown value type {etype}")
                if fields is not None:
                    fields.append((key, [9, etype], items))
            elif vtype == 8:
                n = skip_text(f"metadata {key}")
                meta[key] = head[pos - n:pos].decode("utf-8", "replace")
                if fields is not None:
                    fields.append((key, [8], [head[pos - n:pos]]))
            elif vtype in _SCALAR:
                meta[key] = take(_SCALAR[vtype])
                if fields is not None:
                    fields.append((key, [vtype], [(meta[key],)]))
            else:
                bad(f"metadata {key} has an unknown value type {vtype}")
        align = meta.get("general.alignment", 32)
        if isinstance(align, bool) or not isinstance(align, int) or align <= 0 or align & (align - 1):
            bad(f"general.alignment {align!r} is not a power of two")
        infos, names = [], set()
        for i in range(n_tensors):
            name = text(f"tensor #{i}'s name")
            if name in names:
                bad(f"the file has two tensors named {name}")
            names.add(name)
            dims = take("I")
            if not 1 <= dims <= MAX_DIMS:
                bad(f"tensor {name} has {dims} dimensions (GGUF tensors have 1 to {MAX_DIMS})")
            shape = tuple(reversed([take("Q") for _ in range(dims)]))
            if 0 in shape:
                bad(f"tensor {name} has a dimension of 0 ({list(shape)})")
            infos.append((name, take("I"), shape, take("Q")))
        data_start = -(-pos // align) * align
    except struct.error as e:
        raise GGUFError(f"'{path}' is not a readable GGUF file: its header ends early ({e})") from e
    except UnicodeError as e:
        raise GGUFError(f"'{path}' is not a readable GGUF file ({type(e).__name__}: {e})") from e
    spans, kinds = [], []
    for name, tcode, shape, offset in infos:
        try:
            qtype = gguf.GGMLQuantizationType(tcode)
        except ValueError:
            raise GGUFError(f"'{path}': tensor {name} has an unknown type {tcode}") from None
        block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        if shape[-1] % block:
            bad(f"tensor {name}'s rows of {shape[-1]} are not whole {qtype.name} blocks of {block}")
        n = 1
        for d in shape:  # Python integers: a product past the file's size is refused, never wrapped
            n *= d
            if n // block * nbytes > size:
                bad(f"tensor {name} of shape {list(shape)} ({qtype.name}) needs more bytes than the file's {size}")
        n = n // block * nbytes
        spans.append((name, offset, n))
        kinds.append(qtype.name)
    gguf_checks.check_layout(bad, spans, data_start, size, align)
    gguf_checks.check_metadata(bad, meta)
    mm = np.memmap(path, dtype=np.uint8, mode="r") if size else np.empty(0, dtype=np.uint8)
    out = [Tensor(name, kind, shape, mm[data_start + offset:data_start + offset + n], path, data_start + offset)
           for (name, _, shape, _), (_, offset, n), kind in zip(infos, spans, kinds)]
    gguf_checks.check_model(bad, meta, {t.name: t for t in out})
    gguf_checks.check_small_floats(bad, out)
    return meta, _unfused(meta, out)


def _unfused(meta: dict, tensors: list[Tensor]) -> list[Tensor]:
    """Phi-3's fused projections as the tensors of Llama's names they hold, each a view of its rows (a row of a
    weight is whole blocks, so no byte moves): `attn_qkv` as attn_q, attn_k and attn_v (q's heads, k's, v's), and
    `ffn_up`'s 2 x feed_forward_length rows as ffn_gate (the first half, which llama.cpp's SwiGLU gates with) and
    ffn_up. The check, the packing and the runner then see one tensor per projection, as for every other file."""
    arch = meta.get("general.architecture")
    if arch != "phi3":
        return tensors
    heads, kv_heads = int(meta[f"{arch}.attention.head_count"]), int(meta[f"{arch}.attention.head_count_kv"])
    inter = int(meta[f"{arch}.feed_forward_length"])
    out = []
    for t in tensors:
        parts = t.name.split(".")
        kind = parts[2] if parts[0] == "blk" and len(parts) == 4 and parts[3] == "weight" else ""
        n = t.shape[0] if len(t.shape) == 2 else 0
        if kind == "attn_qkv" and n % (heads + 2 * kv_heads) == 0:
            d = n // (heads + 2 * kv_heads)
            cuts: tuple[tuple[str, int, int], ...] = (
                ("attn_q", 0, heads * d), ("attn_k", heads * d, (heads + kv_heads) * d),
                ("attn_v", (heads + kv_heads) * d, n))
        elif kind == "ffn_up" and n == 2 * inter:
            cuts = (("ffn_gate", 0, inter), ("ffn_up", inter, n))
        else:
            out.append(t)
            continue
        per_row = t.data.size // n
        for name, a, b in cuts:
            out.append(Tensor(f"blk.{parts[1]}.{name}.weight", t.ggml, (b - a, t.shape[1]),
                              t.data[a * per_row:b * per_row], t.path, t.offset + a * per_row))
    return out


@dataclasses.dataclass
class PendingWeight:
    """A tensor of the file not decoded yet (rows already known): decoded when packed, so that a model's codes are
    never all in memory at once beside their packed copy (that pair set the peak of a load)."""

    tensor: Tensor
    shape: tuple[int, int]
    perm: torch.Tensor | None

    @property
    def ggml(self) -> str:
        return self.tensor.ggml

    @property
    def kind(self) -> str:
        return KINDS[self.tensor.ggml]

    def decoded(self) -> FileWeight:
        fw = decode(self.tensor.ggml, self.tensor.read(), self.shape, self.tensor.name)
        return fw if self.perm is None else fw.rows(self.perm)

    def pack(self, kernel, int8_rows: bool = False) -> tuple[str, torch.Tensor, int]:
        """Decoded and packed in chunks of CHUNK_ROWS outputs, a tensor of many rows (an LM head, packed alone before
        the layers) on this process's CPUs at once: every blob lays its outputs out in blocks of 16 (vector_blobs),
        so chunks of a multiple of 16 rows packed apart and put end to end are the same bytes, and each chunk's
        scales are checked for being finite as the whole tensor's were. A chunk's arrays stay in the CPU's caches,
        where a whole tensor's byte shuffles each went through memory."""
        n = self.shape[0]
        if n % 16 or n <= CHUNK_ROWS:
            return self.decoded().pack(kernel, int8_rows)
        per_row = self.tensor.data.size // self.tensor.shape[0]
        spans = [(a, min(n, a + CHUNK_ROWS)) for a in range(0, n, CHUNK_ROWS)]

        def chunk(span: tuple[int, int]) -> tuple[str, torch.Tensor]:
            a, b = span
            if self.perm is None:
                data = self.tensor.read(a * per_row, b * per_row)
            else:  # the file's rows of the model's rows a..b
                data = np.asarray(self.tensor.data).reshape(-1, per_row)[self.perm[a:b].numpy()].reshape(-1)
            kind, blob, _ = decode(self.tensor.ggml, data, (b - a, self.shape[1]), self.tensor.name).pack(
                kernel, int8_rows)
            return kind, blob

        if n >= PARALLEL_ROWS:  # numpy and torch let go of the GIL over whole arrays
            with ThreadPoolExecutor(max(1, min(len(spans), len(usable_cpus())))) as pool:
                done = list(pool.map(chunk, spans))
        else:  # a layer's part: build_all packs several at once already
            done = [chunk(span) for span in spans]
        return done[0][0], torch.cat([blob for _, blob in done]).contiguous(), n


CHUNK_ROWS = 1024  # outputs decoded and packed at once (a multiple of 16): ~6 MB of codes at 1,536 inputs
PARALLEL_ROWS = 32768  # a tensor this tall (an LM head) is packed on every CPU of the process's


class FileEmbedding:
    """The token embedding looked up from the file's blocks: the rows asked for are decoded to float32 on each call,
    bitwise the float32 embedding the model would hold (read_model checks that once per file). A model's embedding
    is then its file's size on disk, not 4 bytes a weight (a Qwen-sized vocabulary of 151,936 x 1,536: 0.9 GB in
    float32).

    The rows are read from the file (pread), not through a map: a mapped lookup brings the pages around each row
    into the process too (the kernel maps ~64-128 KB of neighbours a fault), so a 600-token prompt left ~80 MB of a
    1.5B Q8_0's embedding resident, growing toward the whole table with every new token. For a tied model that is a
    second copy of the LM head, whose packed blocks are resident already. Read, the rows pass through the page cache
    (reclaimable, not the process's) and the process keeps only what it decoded."""

    def __init__(self, tensor: Tensor, vocab: int, hidden: int):
        size, per, _ = BLOCKS[tensor.ggml]
        self.num_embeddings, self.embedding_dim = vocab, hidden
        self.row_bytes = hidden // per * size
        self._fd, self._rows = -1, None
        if tensor.path:
            self._fd = os.open(tensor.path, os.O_RDONLY)
            if hasattr(os, "posix_fadvise"):  # no readahead for a row here and there
                os.posix_fadvise(self._fd, tensor.offset, tensor.data.size, os.POSIX_FADV_RANDOM)
            # not the file's map (whose pages the load touched): it can then go
            tensor = dataclasses.replace(tensor, data=np.empty(0, dtype=np.uint8))
        else:
            self._rows = np.asarray(tensor.data).reshape(vocab, self.row_bytes)
        self.tensor = tensor

    @property
    def ggml(self) -> str:
        return self.tensor.ggml

    def _read(self, rows: np.ndarray) -> np.ndarray:
        """The raw blocks of `rows` (distinct ids) [len(rows), row_bytes]."""
        if self._rows is not None:
            return self._rows[rows]
        rb, at = self.row_bytes, self.tensor.offset
        out = np.empty((rows.size, rb), dtype=np.uint8)
        for i, r in enumerate(rows.tolist()):
            if os.preadv(self._fd, [out[i]], at + r * rb) != rb:
                raise GGUFError(f"'{self.tensor.path}' is shorter than when it was loaded (token {r}'s row)")
        return out

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() == 1:  # a decode step's one token: its row alone (no dedup, no gather; the same bits)
            i = int(ids.reshape(-1)[0])
            if not 0 <= i < self.num_embeddings:
                raise IndexError(f"token id out of range for a vocabulary of {self.num_embeddings}")
            row = decode(self.tensor.ggml, self._read(np.array([i])), (1, self.embedding_dim)).dequantized()
            return row.reshape(*ids.shape, self.embedding_dim)
        flat = ids.reshape(-1).cpu().numpy()
        if flat.size and (flat.min() < 0 or flat.max() >= self.num_embeddings):
            raise IndexError(f"token id out of range for a vocabulary of {self.num_embeddings}")
        distinct, where = np.unique(flat, return_inverse=True)
        rows = decode(self.tensor.ggml, self._read(distinct), (distinct.size, self.embedding_dim)).dequantized()
        return rows[torch.from_numpy(where.reshape(-1))].reshape(*ids.shape, self.embedding_dim)

    def __del__(self, _close=os.close):  # bound now: at interpreter exit the module's `os` may be gone already
        if getattr(self, "_fd", -1) >= 0:
            _close(self._fd)
            self._fd = -1


@dataclasses.dataclass
class ModelFile:
    """What a model's GGUF holds for our kernels: per layer and projection name (transformers' q_proj, ...) its
    FileWeight, the LM head's (output.weight, or the tied token_embd.weight), the GGUF types per tensor kind, and
    why the file's own formats cannot run (None where every projection can)."""

    layers: list[dict[str, "FileWeight | PendingWeight"]]
    head: "FileWeight | PendingWeight | None"
    formats: dict[str, list[str]]
    why_not: str | None
    embed: "FileEmbedding | None" = None  # token_embd looked up from the file's blocks, where checked

    def formats_only(self) -> "ModelFile":
        """This without the codes (the runner keeps its packed copy): what the load log needs."""
        return ModelFile([], None, self.formats, self.why_not, self.embed)

    def summary(self) -> str:
        return ", ".join(f"{k} {'/'.join(v)}" for k, v in self.formats.items())


def formats(path: str, tensors: list[Tensor] | None = None) -> dict[str, list[str]]:
    """GGUF types per tensor kind (attn_q, ..., token_embd, output), from the header alone."""
    out: dict[str, list[str]] = {}
    for t in tensors if tensors is not None else check_file(path):
        parts = t.name.split(".")
        kind = parts[2] if parts[0] == "blk" and len(parts) > 3 else parts[0]
        if parts[-1] == "bias":  # Qwen2's q/k/v biases (float32 beside the projections): their own kind
            kind += "_bias"
        lst = out.setdefault(kind, [])
        if t.ggml not in lst:
            lst.append(t.ggml)
    return out


def read_model(path: str, model, rows: "Rows | None" = None, listed: list[Tensor] | None = None) -> ModelFile:
    """The file's own weights for a Llama-family model. Without `rows`: each checked bit for bit against the loaded
    model's weights (float32, dequantized from this file) and its row order found. With `rows` (what that check
    found for this very file before, load_rows): the recorded row orders, and the model may be a skeleton whose
    projection weights were never loaded (load_skeleton). `listed`: check_file(path) where the caller has it."""
    listed = listed if listed is not None else check_file(path)
    tensors = {t.name: t for t in listed}
    fmts = formats(path, listed)
    layers: list[dict[str, FileWeight | PendingWeight]] = []
    why = None
    base = model.model

    def take(name: str, ggml: str, data, shape, weight):
        if rows is None:
            return match(decode(ggml, data, shape, name), weight)
        return PendingWeight(tensors[name], shape, rows.perms.get(name))

    for i, layer in enumerate(base.layers):
        got: dict[str, FileWeight | PendingWeight] = {}
        for gname, (sub, attr) in PROJECTIONS.items():
            name = f"blk.{i}.{gname}.weight"
            t = tensors.get(name)
            lin = getattr(getattr(layer, sub), attr)
            if t is None or t.ggml not in KINDS:
                why = why or (f"blk.{i}.{gname} is {t.ggml if t is not None else 'missing'} "
                              f"(our kernels take {', '.join(KINDS)})")
                continue
            fw = take(name, t.ggml, t.data, (lin.out_features, lin.in_features), lin.weight.data)
            if fw is None:
                why = why or f"blk.{i}.{gname}: the model's weights are not this file's {t.ggml} values"
                continue
            got[attr] = fw
        layers.append(got)
    head = None
    lm = model.lm_head
    t = tensors.get("output.weight") or tensors.get("token_embd.weight")
    if t is not None and t.ggml in KINDS and lm.bias is None and (rows is None or rows.head):
        head = take(t.name, t.ggml, t.data, (lm.out_features, lm.in_features), lm.weight.data)
    embed = None
    t, emb = tensors.get("token_embd.weight"), base.embed_tokens
    if t is not None and t.ggml in BLOCKS and tuple(t.shape) == (emb.num_embeddings, emb.embedding_dim):
        if rows is not None and rows.embed:
            embed = FileEmbedding(t, emb.num_embeddings, emb.embedding_dim)
        elif rows is None and emb.weight.dtype == torch.float32 and torch.equal(
                decode(t.ggml, t.data, (emb.num_embeddings, emb.embedding_dim), t.name).dequantized(), emb.weight.data):
            embed = FileEmbedding(t, emb.num_embeddings, emb.embedding_dim)
    return ModelFile(layers, head, fmts, why, embed)


ROWS_FILE = "simllm_file_rows.safetensors"


@dataclasses.dataclass
class Rows:
    """What read_model's check found for one GGUF (by content: `stamp`): every projection is the file's own values,
    with these row orders (tensor name -> the file's row per model row; identity where absent), and whether the LM
    head is too. Kept beside the converted model, so that later loads need neither the dense weights nor the check."""

    stamp: dict
    perms: dict[str, torch.Tensor]
    head: bool
    embed: bool = False  # the token embedding is the file's blocks too (FileEmbedding)


def rows_of(mf: ModelFile, stamp: dict, head_name: str) -> Rows | None:
    """The Rows to keep for a checked ModelFile; None where some projection is not the file's own (nothing kept)."""
    if mf.why_not is not None:
        return None
    perms = {}
    for i, got in enumerate(mf.layers):
        for gname, (_, attr) in PROJECTIONS.items():
            perm = got[attr].perm
            if perm is not None:
                perms[f"blk.{i}.{gname}.weight"] = perm.to(torch.int32)
    if mf.head is not None and mf.head.perm is not None:
        perms[head_name] = mf.head.perm.to(torch.int32)
    return Rows(stamp, perms, mf.head is not None, mf.embed is not None)


def save_rows(folder: str, rows: Rows) -> None:
    """Written atomically (a temp file renamed): a reader sees the old file or the whole new one."""
    tmp = os.path.join(folder, f".{ROWS_FILE}.{os.getpid()}.tmp")
    save_file({k: v.contiguous() for k, v in rows.perms.items()}, tmp,
              metadata={"stamp": json.dumps(rows.stamp, sort_keys=True), "head": "1" if rows.head else "0",
                        "embed": "1" if rows.embed else "0"})
    os.replace(tmp, os.path.join(folder, ROWS_FILE))


def load_rows(folder: str, stamp: dict) -> Rows | None:
    """The Rows kept for the GGUF whose content `stamp` describes; None if absent, for another file, or unreadable
    (then the check runs again)."""
    p = os.path.join(folder, ROWS_FILE)
    if not os.path.isfile(p):
        return None
    try:
        with safe_open(p, "pt") as f:
            meta = f.metadata() or {}
            if json.loads(meta.get("stamp", "null")) != json.loads(json.dumps(stamp, sort_keys=True)) \
                    or "embed" not in meta:  # another file's, or written before embeddings were checked
                return None
            perms = {k: f.get_tensor(k).long() for k in f.keys()}
        if not all(p.dim() == 1 and torch.equal(p.sort().values, torch.arange(p.numel())) for p in perms.values()):
            return None  # not a row order (a damaged value): check again
        return Rows(stamp, perms, meta.get("head") == "1", meta.get("embed") == "1")
    except Exception:  # a damaged file: check again rather than trust it
        return None
