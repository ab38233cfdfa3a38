#!/usr/bin/env bash
# Make this checkout runnable; idempotent, and fast and offline once everything is there.
#
# 1. Pick the Python (moe_ep/_env.py choose-python): $PYTHON (default python3), or the active virtual
#    environment; if that Python is "externally managed" (PEP 668: Debian 12, Ubuntu 23.04+), where
#    pip refuses to install, ./.venv is created with --system-site-packages (packages the system
#    already has, e.g. a vendor's CUDA torch, are reused, never replaced) and used instead.
# 2. Install only what that Python lacks, saying before each download what it is and roughly how big:
#    - torch: `torch==2.13.0` (falling back to `torch`) from pip's configured index, or from
#      $TORCH_INDEX_URL when set. On PyPI for Linux that is the CUDA build (~900 MB plus ~3 GB of
#      nvidia-* wheels); for the CPU build (~200 MB) run
#      `TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/setup.sh`.
#    - triton>=3.6 (Linux only, ~150-250 MB), numpy (~20 MB), pytest, hypothesis (~2 MB);
#    - nvidia-nvshmem-cu12==3.8.0 (moe-ep[nvshmem]'s pin, ~280-420 MB, Linux x86_64) only where it is
#      used: a GPU is present (nvidia-smi works), or MOE_EP_NVSHMEM=1 asks for it (its device bitcode is
#      what the sm90 NVSHMEM compile checks link; they skip without it). MOE_EP_NO_NVSHMEM=1 always skips
#      it; a present NVSHMEM wheel (a CUDA torch brings nvidia-nvshmem-cu13) is kept; a failed download
#      only warns.
#    - this checkout in editable mode (--no-deps), unless moe_ep, eplb, microbatch and serving already
#      import from it.
# 3. At the end it prints the Python to use and, when that is ./.venv, the line that activates it
#    (`python -m eplb`, `python -m serving`, `python perf/...` need it: the system python3 has no torch).
# With --print-python, the Python to use is printed on stdout (everything else goes to stderr).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
say() { echo "setup: $*" >&2; }

BASE=${PYTHON:-python3}
if ! command -v "$BASE" >/dev/null 2>&1; then
  say "'$BASE' not found: install Python 3.10+ or point PYTHON at one"; exit 1
fi
if ! "$BASE" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  say "$BASE is $("$BASE" -V 2>&1); moe-ep needs Python 3.10+ (set PYTHON=/path/to/python3.1x)"; exit 1
fi
CHOICE=$("$BASE" moe_ep/_env.py choose-python "$ROOT")
KIND=${CHOICE%% *}
PY=${CHOICE#* }

if [ "$KIND" = checkout-venv ] && ! "$PY" -c 'import sys' >/dev/null 2>&1; then
  say "$BASE is externally managed (PEP 668): creating $ROOT/.venv (--system-site-packages: what $BASE already has is reused)"
  if "$BASE" -c 'import ensurepip' >/dev/null 2>&1; then
    "$BASE" -m venv --system-site-packages --clear .venv >&2
  elif "$BASE" -m pip --version >/dev/null 2>&1; then
    "$BASE" -m venv --system-site-packages --without-pip --clear .venv >&2   # the system's pip serves it
  else
    say "cannot create .venv: $BASE has neither ensurepip nor pip; on Debian/Ubuntu: apt-get install python3-venv"
    exit 1
  fi
fi

pipq() { "$PY" -m pip install -q --disable-pip-version-check "$@" >&2; }
missing() { "$PY" moe_ep/_env.py missing "$@"; }

if [ -n "$(missing torch)" ]; then
  FROM="pip's configured index"
  SIZE="the CPU build is ~200 MB; PyPI's Linux wheel is the CUDA build, ~900 MB plus ~3 GB of nvidia-* wheels (CPU build: TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu)"
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    FROM=$TORCH_INDEX_URL
    case "$TORCH_INDEX_URL" in */cpu|*/cpu/) SIZE="the CPU build, ~200 MB";; esac
  fi
  say "installing torch==2.13.0 from $FROM: downloads $SIZE"
  pipq ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==2.13.0" \
    || pipq ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch
fi
if [ "$(uname -s)" = Linux ] && [ -n "$(missing triton)" ]; then
  say "installing triton>=3.6: downloads ~150-250 MB"
  pipq "triton>=3.6"
fi
NEED=$(missing numpy pytest hypothesis)
if [ -n "$NEED" ]; then
  say "installing $NEED: downloads ~20 MB"
  # shellcheck disable=SC2086
  pipq $NEED
fi
if [ -n "$(missing nvidia.nvshmem)" ]; then
  NVSHMEM=$("$PY" moe_ep/_env.py nvshmem)
  case "$NVSHMEM" in
    install*)
      say "installing nvidia-nvshmem-cu12==3.8.0 (${NVSHMEM#install }): downloads ~280-420 MB (NVSHMEM device bitcode; MOE_EP_NO_NVSHMEM=1 skips)"
      pipq "nvidia-nvshmem-cu12==3.8.0" \
        || say "could not install nvidia-nvshmem-cu12==3.8.0: the NVSHMEM sm90 checks will skip (pip install 'moe-ep[nvshmem]' later)"
      ;;
    *) say "not installing NVSHMEM: ${NVSHMEM#skip }";;
  esac
fi
if ! (cd / && "$PY" "$ROOT/moe_ep/_env.py" installed "$ROOT"); then
  say "installing $ROOT in editable mode"
  if [ "$("$PY" moe_ep/_env.py build-isolation)" = no ]; then
    pipq --no-deps --no-build-isolation -e .
  else
    pipq --no-deps -e .
  fi
fi
if [ "$KIND" = checkout-venv ]; then
  say "ready: this checkout's Python is $ROOT/.venv ($BASE is externally managed: what setup installed is only in .venv)."
  say "before python -m moe_ep / eplb / serving or python perf/..., activate it in your shell:"
  echo "    . $ROOT/.venv/bin/activate" >&2
else
  say "ready: $PY"
fi
if [ "${1:-}" = --print-python ]; then
  echo "$PY"
fi
