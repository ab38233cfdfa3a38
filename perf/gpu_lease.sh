#!/usr/bin/env bash
# The one command for a short GPU lease: every stage in priority order under one budget (default 540 s),
# each stage's result written the moment it ends; output in $OUT or perf/out/lease-<UTC time>/ (at most 8
# files). Uses the python3 it finds ($PYTHON overrides) and installs nothing.
#
#   bash perf/gpu_lease.sh [--budget SECONDS] [--only STAGE ...]   # on the lent GPU
#   bash perf/gpu_lease.sh --dry-run                              # any CPU machine: same stages, interpreter
#
# Before anything it checks that its Python imports torch and triton and (without --dry-run) that torch sees a
# CUDA device: if not, one line on stderr and exit 2. Exit 1 when any stage failed (the summary names them;
# every row written before stays written), 0 when every stage that ran passed.
# perf/gpu_lease.py holds the stages and what each measures; perf/run_all.sh is the long run.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
dry=0
for a in "$@"; do
  case "$a" in
    --dry-run) dry=1 ;;
    -h|--help) exec "$PY" perf/gpu_lease.py "$@" ;;
  esac
done
if ! command -v "$PY" >/dev/null 2>&1; then
  echo "gpu_lease.sh: error: no Python '$PY' (set PYTHON=/path/to/python, e.g. the checkout's .venv/bin/python)" >&2
  exit 2
fi
why=$("$PY" - "$dry" 2>&1 <<'PYEOF'
import sys
dry = sys.argv[1] == "1"
try:
    import torch
except Exception as exc:
    sys.exit(f"cannot import torch ({type(exc).__name__}: {exc})")
try:
    import triton
except Exception as exc:
    sys.exit(f"cannot import triton ({type(exc).__name__}: {exc})")
if not dry and not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device; --dry-run runs the "
             "stages on CPU")
PYEOF
)
if [ $? -ne 0 ]; then
  echo "gpu_lease.sh: error: $PY: $(printf '%s' "$why" | tail -n 1); run it with a Python that has torch with CUDA and triton (PYTHON=.venv/bin/python after bash scripts/setup.sh)" >&2
  exit 2
fi
exec "$PY" perf/gpu_lease.py "$@"
