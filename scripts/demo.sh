#!/usr/bin/env bash
# Set up a fresh machine and run the demo MoE layer (extra arguments go to `python -m moe_ep demo`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m moe_ep demo "$@"
