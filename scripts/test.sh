#!/usr/bin/env bash
# Set up a fresh machine and run the test suite (without a GPU, Triton kernels run in the interpreter).
# The Python is the one scripts/setup.sh picks ($PYTHON, the active venv, or ./.venv on an
# externally managed system Python). Extra arguments go to pytest.
#
# The suite runs as MOE_EP_TEST_JOBS pytest processes side by side (default: the CPU count, at most 4), each
# taking a disjoint part of the selection (MOE_EP_SHARD=i/n, tests/conftest.py): a test process keeps about one
# core busy. The first process reports live, the others when they end; the exit status is pytest's (any failure
# fails the run; "no tests collected" only when no process collected any). MOE_EP_TEST_JOBS=1: one plain pytest
# (use it with --junitxml, --lf or --pdb).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash scripts/setup.sh --print-python)
JOBS=${MOE_EP_TEST_JOBS:-}
if [ -z "$JOBS" ]; then
  JOBS=$(nproc 2>/dev/null || echo 1)
  [ "$JOBS" -gt 4 ] && JOBS=4
fi
case "$JOBS" in ''|*[!0-9]*) echo "MOE_EP_TEST_JOBS must be a positive integer, not '$JOBS'" >&2; exit 2 ;; esac
if [ "$JOBS" -le 1 ]; then
  exec "$PY" -m pytest -q "$@"
fi
logs=$(mktemp -d)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; rm -rf "$logs"' EXIT
echo "scripts/test.sh: $JOBS pytest processes side by side (MOE_EP_TEST_JOBS=1 for one); process 1 reports live"
for ((i = 0; i < JOBS; i++)); do
  if [ "$i" -eq 0 ]; then
    MOE_EP_SHARD="$i/$JOBS" "$PY" -m pytest -q -p no:cacheprovider "$@" &
  else
    MOE_EP_SHARD="$i/$JOBS" "$PY" -m pytest -q -p no:cacheprovider "$@" > "$logs/$i.log" 2>&1 &
  fi
  pids+=($!)
done
rc=0
collected=0
for ((i = 0; i < JOBS; i++)); do
  r=0
  wait "${pids[$i]}" || r=$?
  if [ "$i" -gt 0 ]; then
    echo "---------------- pytest process $((i + 1)) of $JOBS (MOE_EP_SHARD=$i/$JOBS)"
    cat "$logs/$i.log"
  fi
  if [ "$r" -ne 5 ]; then
    collected=1
    [ "$rc" -eq 0 ] && rc=$r
  fi
done
pids=()
if [ "$collected" -eq 0 ]; then
  rc=5
fi
echo "scripts/test.sh: $JOBS processes, exit status $rc"
exit "$rc"
