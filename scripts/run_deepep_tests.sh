#!/usr/bin/env bash
# DeepEP V2's own tests/elastic/test_ep.py, unchanged, on CPU ranks through moe-ep's deep_ep alias
# (scripts/deepep_cpu.py: the device mapping, DeepEP's own test helpers from the checkout, a gloo init_dist).
#
#   bash scripts/run_deepep_tests.sh /path/to/DeepEP [extra test_ep.py arguments]
#
# Env: BACKENDS (default "torch symm"), RANKS (default 2), SETTINGS (default: the four scenario settings below,
# each a quoted set of test_ep.py flags), SHAPE (default: a CPU-sized MoE: 32 tokens, hidden 256, top-4 of 16
# experts). Every run enumerates test_ep.py's 144 modes; a run passes when the script exits 0 having tested every
# mode. The last line counts the passing runs and modes.
set -u
cd "$(dirname "$0")/.."
DEEPEP=${1:?usage: run_deepep_tests.sh /path/to/DeepEP [test_ep.py arguments]}
shift
BACKENDS=${BACKENDS:-torch symm}
RANKS=${RANKS:-2}
SHAPE=${SHAPE:---num-tokens 32 --hidden 256 --num-topk 4 --num-experts 16}
if [ -z "${SETTINGS:-}" ]; then
  SETTINGS=("--do-cpu-sync 1 --allow-multiple-reduction 1" "--do-cpu-sync 0 --allow-multiple-reduction 1"
            "--do-cpu-sync 1 --allow-multiple-reduction 0" "--do-cpu-sync 1 --deterministic --masked-ratio 0.2")
else
  IFS=';' read -r -a SETTINGS <<< "$SETTINGS"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
LOG=$(mktemp -d)
runs=0 ok=0 modes=0 port=$((20000 + RANDOM % 20000))
for backend in $BACKENDS; do
  for setting in "${SETTINGS[@]}"; do
    runs=$((runs + 1)) port=$((port + 1))
    log="$LOG/run$runs.log"
    # shellcheck disable=SC2086
    MOE_EP_BACKEND=$backend MASTER_PORT=$port python3 scripts/deepep_cpu.py "$DEEPEP" tests/elastic/test_ep.py \
      --num-processes "$RANKS" $SHAPE --skip-perf-test $setting "$@" >"$log" 2>&1
    rc=$?
    n=$(grep -c '> Testing with' "$log")
    # a mode is reached only after the previous one passed on every rank; the last one counts if the run ended well
    passed=$(( rc == 0 ? n : (n > 0 ? n - 1 : 0) ))
    modes=$((modes + passed))
    [ "$rc" = 0 ] && ok=$((ok + 1))
    echo "deepep test_ep: $backend, $RANKS ranks, $setting: $([ "$rc" = 0 ] && echo ok || echo FAIL) ($passed/144 modes)"
    [ "$rc" = 0 ] || { grep -E 'Error|assert' "$log" | grep -v '^ ' | tail -3; echo "  log: $log"; }
  done
done
echo "deepep test_ep: $ok/$runs runs passed, $modes/$((runs * 144)) modes"
[ "$ok" = "$runs" ]
