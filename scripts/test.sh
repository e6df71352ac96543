#!/usr/bin/env bash
# Command two: run the test suite (sets up first if needed; idempotent and quick when already set up).
#   scripts/test.sh [pytest args]        e.g. scripts/test.sh test/cache/test_kv_pool.py -k budget
# One worker per core (pytest-xdist), each test file on one worker so a file's shared models load once;
# SIMLLM_TEST_WORKERS=0 runs in this process. Each worker takes its own ROS_DOMAIN_ID (test/conftest.py).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$REPO/scripts/setup.sh" --setup-only
cd "$REPO"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST
# scripts/test.sh --pythons [pytest args]: the whole ROS-free suite on Python 3.10 and 3.12 instead (their venvs:
# scripts/test_pythons.sh); the suite itself runs a part of it there (test/project/test_python_versions.py).
if [ "${1:-}" = "--pythons" ]; then shift; exec bash "$REPO/scripts/test_pythons.sh" "$@"; fi
exec "${VENV:-$REPO/.venv}/bin/python" -m pytest -q -n "${SIMLLM_TEST_WORKERS:-auto}" --dist loadfile "$@"
