#!/usr/bin/env bash
# Set up a fresh machine and run the test suite (without a GPU, Triton kernels run in the interpreter).
# The Python is the one scripts/setup.sh picks ($PYTHON, the active venv, or ./.venv on an
# externally managed system Python).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash scripts/setup.sh --print-python)
exec "$PY" -m pytest -q "$@"
