#!/usr/bin/env bash
# Set up a fresh machine (CPU torch wheel, Triton, test tools) and run the test suite.
# On a machine without a GPU the Triton kernels run under the interpreter (TRITON_INTERPRET=1).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install -q --disable-pip-version-check "torch==2.13.0" 2>/dev/null \
  || "$PY" -m pip install -q --disable-pip-version-check torch
"$PY" -m pip install -q --disable-pip-version-check "triton>=3.4" numpy pytest hypothesis
"$PY" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e .
exec "$PY" -m pytest -q "$@"
