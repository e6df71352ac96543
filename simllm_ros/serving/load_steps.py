"""The steps of Engine.load that stand on their own: the cores the model computes on, the model opened (again,
lighter, after a whole conversion) and what it reports about itself, the memory the pool's budget is a share of, the
first pass that no request should pay for, and the fleet store's connection. Each takes what it needs and hands
back what it made; the engine keeps the state (engine.py), so a reader of one step holds one function.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

from ..cache import fleet_store
from ..cache.fingerprint import Fingerprinter
from ..cache.fleet_store import FleetStore
from ..cache.kv_pool import KVPool
from ..kernels import compute_threads
from ..model.llama_runner import ONEDNN_ISA_CAP
from ..model.model_backend import ModelBackend
from ..model.model_files import release_heap
from ..settings import SettingError, Settings

def device_memory_bytes(device: str) -> int:
    if device.startswith("cuda") and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def max_token_bytes(tokenizer) -> int:
    """An upper bound on the bytes of text one token stands for: the longest vocabulary entry, in UTF-8 bytes
    of its token string (byte-level BPE writes each byte as one character of up to 2 UTF-8 bytes, so this
    can only overestimate)."""
    # the vocabulary's strings (added tokens too) as one dict: a list of every id through convert_ids_to_tokens
    # is slow on a large vocabulary
    return max([len(t.encode("utf-8", "surrogatepass")) for t in tokenizer.get_vocab() if isinstance(t, str)] + [1])


def arrange_cores(s: Settings, progress: Callable[[str], None]) -> list[int]:
    """compute_threads and compute_pinning: the thread count the model computes with (set before the load, whose
    pass-cost timing uses it) and the CPUs its workers keep to, returned (empty: unpinned); a count beyond this
    process's CPUs is refused."""
    try:
        n, why = compute_threads.choose(s.compute_threads)
    except ValueError as e:
        raise SettingError(str(e)) from None
    if n != torch.get_num_threads():
        torch.set_num_threads(n)
    order, _ = compute_threads.by_core(compute_threads.usable_cpus())
    pinned = order[:n] if s.compute_pinning and n > 1 else []
    progress(f"compute threads: {n} ({why})" + (f"; workers pinned to CPUs {pinned[1:]}, the caller "
                                                 "unpinned" if pinned else ""))
    return pinned


def _open_backend(s: Settings, progress: Callable[[str], None]) -> ModelBackend:
    # the longest prompt and answer at these settings: LongRoPE's factors are chosen by it, fixed for the load
    return ModelBackend(s.model, s.device, s.dtype, s.model_cache_dir, progress, s.weight_bits, s.activation_bits,
                        context_length=s.max_prompt_tokens + s.max_new_tokens_limit)


def open_backend(s: Settings, progress: Callable[[str], None]) -> ModelBackend:
    """The model of these settings, at the footprint a later load of it has."""
    backend = _open_backend(s, progress)
    if backend.reload_lighter:
        # A float32 load of a GGUF converted whole (for a dense load before, or where the tensor-at-a-time
        # conversion declined) held its dense float32 weights: loaded again as a later load is, from the
        # checked and packed blocks just kept, the node runs at that footprint. (A tensor-at-a-time
        # conversion never holds them: gguf_conversion.)
        del backend
        release_heap()
        progress("loading again from the blocks just checked and packed (the dense weights released)")
        backend = _open_backend(s, progress)
    return backend


def report_backend(backend: ModelBackend, progress: Callable[[str], None]) -> None:
    """What the load chose, for the operator: whether reuse and drafts are lossless here, and each path the model
    computes through."""
    if backend.exact_chunking:
        verdict = "verified: exact-prefix reuse and drafts are lossless"
    elif backend.runner is None:
        verdict = (f"NOT verified: transformers' own forward runs this {backend.model_type} model (the "
                   "batch-invariant runner does not take its layout): reuse and drafts are approximate")
    else:
        verdict = (f"NOT verified on this machine: reuse and drafts are approximate (a oneDNN ISA above "
                   f"{ONEDNN_ISA_CAP}, e.g. ONEDNN_MAX_CPU_ISA=ALL, causes this on AMX CPUs)")
    progress(f"model in {backend.dtype_name}, weights at {backend.weight_bits} bits, rows at "
             f"{backend.activation_bits} bits into the products; batch-invariant execution {verdict}")
    progress(f"dtype {backend.dtype_name}: {backend.dtype_why}")
    progress(f"attention: {backend.attention_path}")
    progress(f"norms: {backend.norm_path}")
    progress(f"layers: {backend.layers_path}")
    if backend.int4_kind:
        progress(f"4-bit products: {backend.int4_path}")
    if compute_threads.hands_over(backend.kernels_do_the_work):
        progress(f"threads: {torch.get_num_threads()} for our kernels' workers while the model runs, "
                 "torch one (compute_threads)")


def prime(backend: ModelBackend, fingerprinter: Fingerprinter, system_prompt: str) -> None:
    """One throwaway pass through both models: torch's first call is slow, and no user should pay for it."""
    # a few rows are enough to warm the prefill path; a whole chat prompt costs a large model's load more
    ids = backend.prompt_ids(system_prompt, "", "hello")[:4]
    logits, cache = backend.prefill(ids)
    backend.decode(logits, cache, 2)
    fingerprinter.embed(["hello"])


def prefill_seconds_per_token(backend: ModelBackend) -> float:
    """A short prefill, timed: what the fleet store weighs fetching a prefix against."""
    ids = list(range(100, 164))
    t0 = time.perf_counter()
    backend.prefill(ids)
    return (time.perf_counter() - t0) / len(ids)


def open_fleet(s: Settings, backend: ModelBackend, pool: KVPool, lossless: bool, log: logging.Logger) -> FleetStore:
    """The fleet store of fleet_store_url. Its digest is this node's arithmetic, so only nodes that compute the
    same bits share KV (and only where `lossless`: stored KV reused is bitwise a prefill's); answers are drafts,
    checked by the model."""
    digest = fleet_store.node_digest(backend.numerics, backend.dtype, backend.kv_shape, pool.store_dtype)
    return fleet_store.open_store(s, digest=digest, kv_shape=backend.kv_shape, dtype=backend.dtype, share_kv=lossless,
                                  log=log)


def report_fleet(fleet: FleetStore, s: Settings, lossless: bool, prefill_s_per_token: float, log: logging.Logger,
                 progress: Callable[[str], None]) -> None:
    """Whether the store answers now (its link measured when it does) and whether KV blocks are shared, and why
    not."""
    up = fleet.ping()
    if up:
        fleet.measure_link()
    if fleet.kv_off_reason and s.fleet_share_kv and lossless:
        log.warning(f"fleet store: KV blocks are not shared: {fleet.kv_off_reason}")
    why = ("fleet_share_kv is false" if not s.fleet_share_kv else "KV is not lossless here"
           if not lossless else fleet.kv_off_reason)
    kv = "shared" if fleet.share_kv else f"not shared ({why})"
    progress(f"fleet store {fleet.url}: "
             f"{'connected' if up else 'not reachable now (retried in the background)'}"
             f"; digest {fleet.digest}; KV blocks {kv}"
             f"; prefill {prefill_s_per_token * 1000:.2f} ms/token, "
             f"link {fleet.bytes_per_s / 1e6:.0f} MB/s")
