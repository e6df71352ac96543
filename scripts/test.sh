#!/usr/bin/env bash
# Command two: run the test suite (sets up first if needed; idempotent and quick when already set up).
#   scripts/test.sh [pytest args]
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$REPO/scripts/setup.sh" --setup-only
cd "$REPO"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST
exec "${VENV:-$REPO/.venv}/bin/python" -m pytest test -q "$@"
