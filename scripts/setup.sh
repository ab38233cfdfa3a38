#!/usr/bin/env bash
# Install what moe-ep needs on a fresh machine: torch (the CPU wheel where no CUDA torch is present),
# Triton, numpy, pytest/hypothesis, and this package in editable mode. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pipq() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }
if ! "$PY" -c "import torch" 2>/dev/null; then
  pipq "torch==2.13.0" || pipq torch
fi
"$PY" -c "import triton" 2>/dev/null || pipq "triton>=3.4"
pipq numpy pytest hypothesis
pipq --no-deps -e .
