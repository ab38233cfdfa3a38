#!/usr/bin/env bash
# Make this checkout runnable; idempotent, and fast and offline once everything is there.
#
# 1. Pick the Python (moe_ep/_env.py choose-python): $PYTHON (default python3), or the active virtual
#    environment; if that Python is "externally managed" (PEP 668: Debian 12, Ubuntu 23.04+), where
#    pip refuses to install, ./.venv is created with --system-site-packages (packages the system
#    already has, e.g. a vendor's CUDA torch, are reused, never replaced) and used instead.
# 2. Install only what that Python lacks:
#    - torch: `torch==2.13.0` (falling back to `torch`) from pip's configured index, or from
#      $TORCH_INDEX_URL when set. On PyPI for Linux that is the CUDA build, which pulls several GB
#      of nvidia-* wheels; for the CPU build run
#      `TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/setup.sh`.
#    - triton>=3.4 (Linux only), numpy, pytest, hypothesis;
#    - on Linux x86_64, nvidia-nvshmem-cu12==3.8.0 when no NVSHMEM wheel is present (moe-ep[nvshmem]'s pin):
#      its device bitcode is what the sm90 NVSHMEM compile checks link. A ~280 MB wheel whose only
#      dependency is nvidia-cuda-cccl-cu12 (3 MB of headers); no CUDA runtime. A CUDA torch brings its own
#      NVSHMEM wheel (nvidia-nvshmem-cu13 for torch 2.11+): then nothing is added. MOE_EP_NO_NVSHMEM=1 skips
#      it; a failed download only warns (those checks then skip).
#    - this checkout in editable mode (--no-deps), unless moe_ep, eplb and microbatch already
#      import from it.
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
  if [ -n "${TORCH_INDEX_URL:-}" ]; then FROM=$TORCH_INDEX_URL; fi
  say "installing torch==2.13.0 from $FROM (PyPI's Linux wheel is the CUDA build; see scripts/setup.sh)"
  pipq ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==2.13.0" \
    || pipq ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch
fi
if [ "$(uname -s)" = Linux ] && [ -n "$(missing triton)" ]; then
  say "installing triton>=3.4"
  pipq "triton>=3.4"
fi
NEED=$(missing numpy pytest hypothesis)
if [ -n "$NEED" ]; then
  say "installing $NEED"
  # shellcheck disable=SC2086
  pipq $NEED
fi
if [ "$(uname -s)" = Linux ] && [ "$(uname -m)" = x86_64 ] && [ "${MOE_EP_NO_NVSHMEM:-0}" != 1 ] \
    && [ -n "$(missing nvidia.nvshmem)" ]; then
  say "installing nvidia-nvshmem-cu12==3.8.0 (~280 MB; NVSHMEM device bitcode for the sm90 checks; MOE_EP_NO_NVSHMEM=1 skips)"
  pipq "nvidia-nvshmem-cu12==3.8.0" \
    || say "could not install nvidia-nvshmem-cu12==3.8.0: the NVSHMEM sm90 checks will skip (pip install 'moe-ep[nvshmem]' later)"
fi
if ! (cd / && "$PY" "$ROOT/moe_ep/_env.py" installed "$ROOT"); then
  say "installing $ROOT in editable mode"
  if [ "$("$PY" moe_ep/_env.py build-isolation)" = no ]; then
    pipq --no-deps --no-build-isolation -e .
  else
    pipq --no-deps -e .
  fi
fi
if [ "${1:-}" = --print-python ]; then
  echo "$PY"
fi
