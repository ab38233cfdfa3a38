#!/usr/bin/env bash
# Set up a fresh machine and run the test suite (without a GPU, Triton kernels run in the interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m pytest -q "$@"
