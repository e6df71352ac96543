#!/usr/bin/env bash
# The GPU path: run the core (ROS-free) model tests with device=cuda on a machine with an NVIDIA GPU.
#
#   scripts/gpu_check.sh [pytest args]
#
# Needs a CUDA build of torch 2.13.0 in the venv (the pinned set-up installs the CPU wheel; replace it with
# the CUDA wheel of the same version from PyTorch's CUDA wheel index). Every tensor must follow the model's
# device: the pool, semantic repair (positions, masks), grammar masks and the sampler. The tests that claim
# bitwise exactness (verified decoding) check the backend's batch invariance on this GPU; a failure there
# means reuse is approximate on it, which the engine then reports (exact=false), not a crash.
#
# Untested so far: no CUDA machine was available when this script was written (see README).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${VENV:-$REPO/.venv}/bin/python"
cd "$REPO"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST

if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "[gpu_check] torch $("$PY" -c 'import torch; print(torch.__version__)') sees no CUDA device:" \
       "install a CUDA build of torch 2.13.0 in $(dirname "$(dirname "$PY")") on a machine with an NVIDIA GPU" >&2
  exit 2
fi
"$PY" -c "import torch; p = torch.cuda.get_device_properties(0); print(f'[gpu_check] {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, bf16: {torch.cuda.is_bf16_supported()}')"

export SIMLLM_TEST_DEVICE=cuda
# The identity tests (cached answers equal empty-pool answers), the SEMANTIC repair, then the verified-decoding
# benchmark's smoke on the GPU: where the backend's batch-invariance probe fails there, answers say exact: false.
"$PY" -m pytest -q -s test/cache/test_exact_prefix.py test/cache/test_rope_repair.py test/cache/test_semantic_quality.py \
  test/cache/test_semantic_repair.py test/model/test_verified_decoding.py test/model/test_structured_output.py \
  test/serving/test_chat_and_streaming.py test/serving/test_engine_observer.py "$@"
exec "$PY" -m simllm_ros.cli.bench verified_decoding --smoke --device cuda --out "$REPO/benchmark/results/verified_decoding_cuda.md"
