#!/usr/bin/env bash
# The one command for a short GPU lease: every stage in priority order under one budget (default 420 s),
# each stage's result written the moment it ends; output in $OUT or perf/out/lease-<UTC time>/ (at most 8
# files). Uses the python3 it finds ($PYTHON overrides) and installs nothing.
#
#   bash perf/gpu_lease.sh [--budget SECONDS] [--only STAGE ...]   # on the lent GPU
#   bash perf/gpu_lease.sh --dry-run                              # any CPU machine: same stages, interpreter
#
# perf/gpu_lease.py holds the stages and what each measures; perf/run_all.sh is the long run.
set -uo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" perf/gpu_lease.py "$@"
