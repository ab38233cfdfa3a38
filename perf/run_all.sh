#!/usr/bin/env bash
# The one command for a machine with a GPU: GPU-marked tests, then every perf/bench_*.py with its GPU
# defaults, all written to perf/out/<date>-<gpu>.md (also echoed). Usage: bash perf/run_all.sh [outfile]
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mkdir -p perf/out
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr ' ' '_')
out=${1:-perf/out/$(date -u +%Y-%m-%d)-${gpu:-nogpu}.md}
{
  echo "# moe-ep GPU run, $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo
  echo "device: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)"
  echo "torch $("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda)'), triton $("$PY" -c 'import triton; print(triton.__version__)')"
  echo
  echo '## pytest -m gpu'
  echo '```'
  "$PY" -m pytest -q -m gpu -p no:cacheprovider 2>&1 | tail -n 40
  echo '```'
  echo
  echo '## perf/sm90_report.py (ahead-of-time sm90 compile: registers, spills, smem, occupancy)'
  timeout 900 "$PY" perf/sm90_report.py --json perf/out/sm90_report.json 2>&1 | grep -v -e FutureWarning -e 'return func'
  for b in perf/bench_*.py; do
    echo
    echo "## $b"
    echo '```'
    timeout 900 "$PY" "$b" > perf/out/.bench.log 2>&1
    rc=$?
    grep -v -e FutureWarning -e 'return func' perf/out/.bench.log
    echo "(exit $rc)"
    echo '```'
  done
} | tee "$out"
echo "written to $out"
