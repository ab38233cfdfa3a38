#!/usr/bin/env bash
# DeepGEMM's own tests/test_fp8_fp4.py (test_gemm: the sm90 FP8 recipes) and tests/test_layout.py, unchanged, on
# the CPU through moe-ep's deep_gemm alias, case by case (scripts/deepgemm_cpu.py: sm90 recipes, DeepGEMM's own
# deep_gemm.testing from the checkout, benchmarks off via DG_USE_NVIDIA_TOOLS=1, shapes cut to CPU size by
# wrapping generators.enumerate_*; the test files are not edited).
#
#   bash scripts/run_deepgemm_tests.sh /path/to/DeepGEMM [test_file.py[:function] ...]
#
# Checked against DeepGEMM 2.6.1 (commit 54e2261). The last line counts the cases passed / failed / skipped;
# the exit status is 0 when none failed.
set -u
cd "$(dirname "$0")/.."
DEEPGEMM=${1:?usage: run_deepgemm_tests.sh /path/to/DeepGEMM [test_file.py[:function] ...]}
shift
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
version=$(sed -n "s/^__version__ = '\(.*\)'/\1/p" "$DEEPGEMM/deep_gemm/__init__.py" 2>/dev/null)
echo "DeepGEMM ${version:-?} tests at $DEEPGEMM"
exec python3 scripts/deepgemm_cpu.py "$DEEPGEMM" "$@"
