#!/usr/bin/env bash
# Every measurement in one command.
#
#   bash perf/run_all.sh              # a machine with a CUDA GPU: pytest -m gpu, sm90_report, every bench
#   bash perf/run_all.sh --cpu-smoke  # any machine: every bench's CPU variant (interpreter, tiny shapes)
#
# bench_internode_ll.py runs under torchrun over all local GPUs as one node (perf/launch_internode.sh,
# backends nvshmem and symm, DeepEP when importable) when there are >= 2, else one line says it needs a
# cluster; its cluster runs are perf/launch_internode.sh on every node (perf/RESULTS.md, owed list).
# bench_mega_moe.py runs under torchrun (--standalone, one process per local GPU; EP8 on 8 GPUs) when there
# are >= 2, else one line says it needs them. bench_elastic.py likewise (its timed section: ElasticBuffer vs
# Buffer, copying receive vs recv_as_view); with fewer GPUs only its counted tables run.
#
# Writes perf/out/<UTC date-time>-<gpu name | cpu-smoke>.md (the report) and .jsonl (every bench's JSON
# lines: a header object, then one object per row), never overwriting a file (a -2, -3 ... suffix is
# added). Exits 2 at once without a GPU (unless --cpu-smoke), 1 when any step failed, timed out, measured
# nothing or was INVALID, 0 otherwise. Environment: PYTHON (python3), OUT_DIR (perf/out),
# BENCH_TIMEOUT (s per bench: 900, --cpu-smoke 300), PYTEST_TIMEOUT (s for pytest -m gpu: 1800),
# TORCHRUN (torchrun, for bench_mega_moe.py; launch_internode.sh reads it too).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
usage="usage: bash perf/run_all.sh [--cpu-smoke]"
smoke=0
for a in "$@"; do
  case "$a" in
    --cpu-smoke) smoke=1 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "$usage" >&2; echo "run_all.sh: error: unrecognized argument: $a" >&2; exit 2 ;;
  esac
done

if [ "$smoke" = 0 ]; then
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  if [ -z "$gpu" ]; then
    echo "run_all.sh: error: needs a CUDA GPU (nvidia-smi found none); use --cpu-smoke to run every bench's CPU variant" >&2
    exit 2
  fi
  label=$(printf '%s' "$gpu" | tr -c 'A-Za-z0-9.-' '_')
  title="GPU run on $gpu"
  flag=()
  bench_timeout=${BENCH_TIMEOUT:-900}
else
  label=cpu-smoke
  title="CPU smoke run (Triton interpreter, tiny shapes: the numbers are meaningless, the code paths run)"
  flag=(--cpu-smoke)
  export TRITON_INTERPRET=1
  bench_timeout=${BENCH_TIMEOUT:-300}
fi

outdir=${OUT_DIR:-perf/out}
mkdir -p "$outdir"
base="$outdir/$(date -u +%Y-%m-%d-%H%M%S)-$label"
stem=$base
n=1
# claim the name atomically (noclobber): a file that exists is never overwritten
while ! (set -o noclobber; : > "$stem.jsonl") 2>/dev/null || [ -e "$stem.md" ]; do
  n=$((n + 1)); stem="$base-$n"
done
json="$stem.jsonl"
md="$stem.md"
# the run's own record first: commit + dirty flag of the tree that produced every row below
commit=$(git rev-parse --short=12 HEAD 2>/dev/null)
dirty=false; [ -n "$(git status --porcelain 2>/dev/null)" ] && dirty=true
printf '{"kind": "run", "commit": "%s", "dirty": %s, "date": "%s", "cpu-smoke": %s}\n' "$commit" "$dirty" \
  "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$([ "$smoke" = 1 ] && echo true || echo false)" >> "$json"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=()
summary=()

say() { printf '%s\n' "$*" | tee -a "$md"; }

filter() { grep -v -e FutureWarning -e 'return func' -e '^\s*warnings.warn' "$1" || true; }

say "# moe-ep $title, $(date -u '+%Y-%m-%d %H:%M UTC')"
say ""
say "commit $(git rev-parse --short=12 HEAD 2>/dev/null)$(test -n "$(git status --porcelain 2>/dev/null)" && echo ' (dirty)')," \
    "python $("$PY" -c 'import platform; print(platform.python_version())')," \
    "torch $("$PY" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)' 2>/dev/null)," \
    "triton $("$PY" -c 'import triton; print(triton.__version__)' 2>/dev/null)"
[ "$smoke" = 0 ] && say "device: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)"
say "JSON lines: $json"

if [ "$smoke" = 0 ]; then
  say ""
  say "## pytest -m gpu (timeout ${PYTEST_TIMEOUT:-1800} s)"
  echo "running pytest -m gpu ..." >&2
  timeout "${PYTEST_TIMEOUT:-1800}" "$PY" -m pytest -q -m gpu -p no:cacheprovider > "$tmp/pytest.log" 2>&1
  rc=$?
  { echo '```'; tail -n 40 "$tmp/pytest.log"; echo "(exit $rc)"; echo '```'; } | tee -a "$md"
  if [ $rc -ne 0 ]; then failures+=("pytest -m gpu (exit $rc)"); summary+=("| pytest -m gpu | FAILED (exit $rc) |")
  else summary+=("| pytest -m gpu | ok |"); fi

  say ""
  say "## perf/sm90_report.py (ahead-of-time sm90 compile: registers, spills, smem, occupancy)"
  echo "running perf/sm90_report.py ..." >&2
  timeout 900 "$PY" perf/sm90_report.py --json "$stem-sm90.json" > "$tmp/sm90.log" 2>&1
  rc=$?
  { filter "$tmp/sm90.log"; echo "(exit $rc)"; } | tee -a "$md"
  if [ $rc -ne 0 ]; then failures+=("sm90_report.py (exit $rc)"); summary+=("| sm90_report.py | FAILED (exit $rc) |")
  else summary+=("| sm90_report.py | ok |"); fi
fi

ngpu=0  # local GPUs, for the benches that run one process per GPU (torchrun)
if [ "$smoke" = 0 ]; then ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true); fi
for b in perf/bench_*.py; do
  name=$(basename "$b")
  say ""
  say "## $name"
  say ""
  cmd=("$PY" "$b" "${flag[@]}")
  if [ "$smoke" = 0 ] && [ "$name" = bench_internode_ll.py ]; then
    # one process per GPU (torchrun): every local GPU as one node; a cluster run is perf/launch_internode.sh
    if [ "$ngpu" -lt 2 ]; then
      say "skipped: the internode low-latency bench needs a cluster (N nodes x 8 GPUs: perf/launch_internode.sh on" \
          "every node) or, for its single-node run here, at least 2 GPUs; this machine has $ngpu"
      summary+=("| $name | skipped (needs >= 2 GPUs or a cluster) |")
      continue
    fi
    cmd=(env NNODES=1 NODE_RANK=0 GPUS_PER_NODE="$ngpu" MASTER_PORT="${MASTER_PORT:-29517}" bash perf/launch_internode.sh
         --backend nvshmem symm)
  fi
  if [ "$smoke" = 0 ] && [ "$name" = bench_mega_moe.py ]; then
    # one process per GPU (torchrun) over the local GPUs: EP8 on an 8-GPU node
    if [ "$ngpu" -lt 2 ]; then
      say "skipped: the mega-MoE bench runs one process per GPU (torchrun; EP8 on 8 GPUs) and needs at least 2 GPUs;" \
          "this machine has $ngpu"
      summary+=("| $name | skipped (needs >= 2 GPUs) |")
      continue
    fi
    cmd=("${TORCHRUN:-torchrun}" --standalone --nproc-per-node "$ngpu" perf/bench_mega_moe.py --launcher torchrun)
  fi
  if [ "$smoke" = 0 ] && [ "$name" = bench_elastic.py ]; then
    # timed on GPUs: one process per GPU (torchrun, NCCL; torch and symm backends, copying receive and
    # recv_as_view); with fewer than 2 GPUs only the counted tables (bytes, launches, memory) run
    if [ "$ngpu" -ge 2 ]; then
      cmd=("${TORCHRUN:-torchrun}" --standalone --nproc-per-node "$ngpu" perf/bench_elastic.py --launcher torchrun)
    else
      say "timing skipped: the ElasticBuffer timing runs one process per GPU and needs at least 2 GPUs; this" \
          "machine has $ngpu (the counted tables run)"
      cmd=("$PY" "$b" --time-ranks 0)
    fi
  fi
  say "\`${cmd[*]} --json ...\` (timeout $bench_timeout s)"
  echo "running ${cmd[*]} ..." >&2
  rm -f "$tmp/rows.jsonl"
  timeout "$bench_timeout" "${cmd[@]}" --json "$tmp/rows.jsonl" > "$tmp/bench.log" 2>&1
  rc=$?
  [ -f "$tmp/rows.jsonl" ] && cat "$tmp/rows.jsonl" >> "$json"
  rows=0; invalid=0
  if [ -f "$tmp/rows.jsonl" ]; then
    rows=$(grep -c '"kind": "header"' -v "$tmp/rows.jsonl" || true)
    invalid=$(grep -c '"valid": false' "$tmp/rows.jsonl" || true)
  fi
  { echo '```'; filter "$tmp/bench.log"; echo "(exit $rc, $rows rows, $invalid invalid)"; echo '```'; } | tee -a "$md"
  if [ $rc -eq 124 ]; then status="TIMEOUT after $bench_timeout s"
  elif [ "$invalid" -gt 0 ] || grep -q INVALID "$tmp/bench.log"; then status="INVALID (exit $rc)"
  elif [ $rc -ne 0 ]; then status="FAILED (exit $rc)"
  elif [ "$rows" -eq 0 ]; then status="FAILED (no rows)"
  else status="ok ($rows rows)"; fi
  summary+=("| $name | $status |")
  case "$status" in ok*) ;; *) failures+=("$name: $status") ;; esac
done

say ""
say "## Summary"
say ""
say "| step | result |"
say "| --- | --- |"
for s in "${summary[@]}"; do say "$s"; done
echo "report: $md" >&2
echo "JSON lines: $json" >&2
if [ ${#failures[@]} -gt 0 ]; then
  echo "run_all.sh: error: ${#failures[@]} step(s) failed: ${failures[*]}" >&2
  exit 1
fi
exit 0
