"""Would storing a near-duplicate entry as 'reference + difference' save memory? Measured, not assumed.

For pairs of real requests whose prompts differ a little (a revised bulletin, a
paraphrased question), take the newer prompt's exact KV and the older entry's
KV aligned to it (the SEMANTIC tier's alignment and RoPE re-rotation), and
report how much of the difference is negligible per token and per element.
Block sharing already stores identical prefixes once; a delta scheme could
only save on the tokens after the first change, and only if their difference
is sparse (most tokens or elements below the 8-bit quantisation step).

Run: .venv/bin/simllm-bench delta_storage
(the last output is kept in benchmark/results/delta_storage.txt)
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from simllm_ros.model.model_backend import ModelBackend
from simllm_ros.cache.reuse_planner import align
from simllm_ros.settings import DEFAULT_MODEL

from .shared import REPO_ROOT as REPO


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args(argv)  # no options; --help
    reqs = [json.loads(line) for line in open(os.path.join(REPO, "config", "demo_workload.jsonl"))]
    b = ModelBackend(DEFAULT_MODEL, dtype="float32")
    system = "You are a helpful assistant on a robot. Answer briefly."
    # (old, new): same question, bulletin revised; paraphrase, same bulletin; paraphrase, revised bulletin
    pairs = [(0, 6), (2, 3), (3, 7), (4, 11)]
    print(f"{'pair':<8} {'tokens':>6} {'shared prefix':>13} {'after prefix':>12} "
          f"{'tok<step':>9} {'elem<step':>9} {'delta bytes / full bytes':>24}")
    totals = [0, 0]
    for i, j in pairs:
        a, c = reqs[i], reqs[j]
        ta = b.prompt_ids(system, a["context"], a["prompt"])
        tc = b.prompt_ids(system, c["context"], c["prompt"])
        ka, va = b.cache_tensors(b.prefill(ta)[1])
        kc, vc = b.cache_tensors(b.prefill(tc)[1])
        pairs_al = align(ta, tc, len(tc))
        lead = 0
        while lead < len(ta) and lead < len(tc) and ta[lead] == tc[lead]:
            lead += 1
        rest = [(p, q) for p, q in pairs_al if p >= lead]
        if not rest:
            continue
        newp = torch.tensor([p for p, _ in rest])
        oldp = torch.tensor([q for _, q in rest])
        k_old = b.rotate_keys(ka[:, :, oldp], newp - oldp)
        dk = (kc[:, :, newp] - k_old).abs()
        dv = (vc[:, :, newp] - va[:, :, oldp]).abs()
        # The 8-bit step of the new KV itself: a difference below it is invisible after quantisation.
        step_k = (kc[:, :, newp].amax(dim=2, keepdim=True) - kc[:, :, newp].amin(dim=2, keepdim=True)) / 255
        step_v = (vc[:, :, newp].amax(dim=-1, keepdim=True) - vc[:, :, newp].amin(dim=-1, keepdim=True)) / 255
        small_k = dk <= step_k
        small_v = dv <= step_v
        elem_small = float(torch.cat([small_k.flatten(), small_v.flatten()]).float().mean())
        tok_small = float((small_k.all(dim=(0, 1, 3)) & small_v.all(dim=(0, 1, 3))).float().mean())
        after = len(tc) - lead
        # A sparse delta stores (index, int8 value) for each element that is not negligible:
        # ~3 bytes/element vs 1 byte/element for the plain 8-bit KV of the same tokens.
        n_elem = dk.numel() + dv.numel()
        delta_bytes = (1 - elem_small) * n_elem * 3
        full_bytes = n_elem * 1
        totals[0] += delta_bytes
        totals[1] += full_bytes
        print(f"{i:>2}->{j:<5} {len(tc):>6} {lead:>13} {after:>12} {tok_small:>9.1%} {elem_small:>9.1%} "
              f"{delta_bytes / full_bytes:>24.2f}")
    print(f"overall: a sparse delta would take {totals[0] / totals[1]:.2f}x the bytes of plain 8-bit KV "
          f"for the tokens after the shared prefix")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
