#!/usr/bin/env bash
# Make this checkout runnable; idempotent, and fast and offline once everything is there.
#
# 1. Pick the Python (moe_ep/_env.py choose-python): $PYTHON (default python3), or the active virtual
#    environment; if that Python is "externally managed" (PEP 668: Debian 12, Ubuntu 23.04+), where
#    pip refuses to install, ./.venv is created with --system-site-packages (packages the system
#    already has, e.g. a vendor's CUDA torch, are reused, never replaced) and used instead.
# 2. Before anything is installed, say what will be and the disk it takes installed (with pip's cache
#    while it runs), against the free space there; stop when it does not fit (MOE_EP_SKIP_DISK_CHECK=1
#    goes on anyway).
# 3. Install only what that Python lacks, saying before each download what it is and roughly how big:
#    - torch==2.13.0 (falling back to torch), from (moe_ep/_env.py torch-index): $TORCH_INDEX_URL when
#      set; with a GPU (nvidia-smi works), pip's configured index; without one, the CPU wheel index
#      https://download.pytorch.org/whl/cpu (~200 MB) when it answers, else pip's configured index
#      (on PyPI for Linux that is the CUDA build: ~900 MB plus ~3 GB of nvidia-* wheels).
#    - triton>=3.6 (Linux only, ~150-250 MB download, ~1 GB installed), numpy (~20 MB), pytest,
#      hypothesis (~2 MB);
#    - nvidia-nvshmem-cu12==3.8.0 (moe-ep[nvshmem]'s pin, ~280-420 MB, Linux x86_64) only where it is
#      used: a GPU is present (nvidia-smi works), or MOE_EP_NVSHMEM=1 asks for it (its device bitcode is
#      what the sm90 NVSHMEM compile checks link; they skip without it). MOE_EP_NO_NVSHMEM=1 always skips
#      it; a present NVSHMEM wheel (a CUDA torch brings nvidia-nvshmem-cu13) is kept; a failed download
#      only warns.
#    - this checkout in editable mode (--no-deps), unless moe_ep, eplb, microbatch and serving already
#      import from it. A Python whose `import moe_ep` comes from somewhere else (another checkout, an
#      installed release) is not re-pointed here: demo.sh and test.sh run from this folder, where this
#      checkout's code comes first anyway; MOE_EP_REPOINT=1 re-points it.
# 4. At the end it prints the Python to use and, when that is ./.venv, the line that activates it
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

# What is missing, asked of the Python that will run (before ./.venv exists: of $BASE, whose packages it sees).
ASK=$PY
if [ "$KIND" = checkout-venv ] && ! "$PY" -c 'import sys' >/dev/null 2>&1; then ASK=$BASE; fi
missing() { "$ASK" moe_ep/_env.py missing "$@"; }
ITEMS=() WHAT=()
if [ -n "$(missing torch)" ]; then
  read -r TORCH_URL TORCH_WHY <<<"$("$ASK" moe_ep/_env.py torch-index)"
  [ "$TORCH_URL" = - ] && TORCH_URL=""
  case "$TORCH_URL" in
    */cpu|*/cpu/) TORCH_BUILD=cpu;;
    *) if [ "$TORCH_WHY" = TORCH_INDEX_URL ] || [ "${TORCH_WHY#a GPU}" != "$TORCH_WHY" ]; then TORCH_BUILD=cuda; else TORCH_BUILD=either; fi;;
  esac
  if [ "$TORCH_BUILD" = cuda ]; then ITEMS+=(torch-cuda); else ITEMS+=(torch-cpu); fi
  WHAT+=("torch")
fi
if [ "$(uname -s)" = Linux ] && [ -n "$(missing triton)" ]; then ITEMS+=(triton); WHAT+=(triton); fi
NEED=$(missing numpy pytest hypothesis)
if [ -n "$NEED" ]; then ITEMS+=(small); WHAT+=("$NEED"); fi
NVSHMEM=""
if [ -n "$(missing nvidia.nvshmem)" ]; then
  NVSHMEM=$("$ASK" moe_ep/_env.py nvshmem)
  case "$NVSHMEM" in install*) ITEMS+=(nvshmem); WHAT+=(nvidia-nvshmem-cu12);; esac
fi
if [ ${#ITEMS[@]} -gt 0 ]; then
  DEST=$ROOT
  [ "$KIND" = checkout-venv ] || DEST=$("$ASK" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  read -r DISK_OK DISK_NEED DISK_FREE DISK_AT <<<"$("$ASK" moe_ep/_env.py disk "$DEST" "${ITEMS[@]}")"
  say "to install: ${WHAT[*]}; needs about $DISK_NEED MB of disk under $DISK_AT ($DISK_FREE MB free)"
  if [ "$DISK_OK" != ok ] && [ "${MOE_EP_SKIP_DISK_CHECK:-}" != 1 ]; then
    say "not enough disk under $DISK_AT: free about $DISK_NEED MB there first (MOE_EP_SKIP_DISK_CHECK=1 goes on anyway)"
    exit 1
  fi
fi

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
ASK=$PY

pipq() { "$PY" -m pip install -q --disable-pip-version-check "$@" >&2; }

if [ -n "$(missing torch)" ]; then
  if [ -n "$TORCH_URL" ]; then FROM="$TORCH_URL ($TORCH_WHY)"; else FROM="pip's configured index ($TORCH_WHY)"; fi
  case "$TORCH_BUILD" in
    cpu) SIZE="the CPU build, ~200 MB";;
    cuda) SIZE="on PyPI for Linux the CUDA build, ~900 MB plus ~3 GB of nvidia-* wheels";;
    *) SIZE="the CPU build is ~200 MB; PyPI's Linux wheel is the CUDA build, ~900 MB plus ~3 GB of nvidia-* wheels";;
  esac
  say "installing torch==2.13.0 from $FROM: downloads $SIZE"
  pipq ${TORCH_URL:+--index-url "$TORCH_URL"} "torch==2.13.0" \
    || pipq ${TORCH_URL:+--index-url "$TORCH_URL"} torch
fi
if [ "$(uname -s)" = Linux ] && [ -n "$(missing triton)" ]; then
  say "installing triton>=3.6: downloads ~150-250 MB"
  pipq "triton>=3.6"
fi
if [ -n "$NEED" ]; then
  say "installing $NEED: downloads ~20 MB"
  # shellcheck disable=SC2086
  pipq $NEED
fi
if [ -n "$NVSHMEM" ]; then
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
  OWNER=$(cd / && "$PY" "$ROOT/moe_ep/_env.py" owner)
  if [ -n "$OWNER" ] && [ "$OWNER" != "$(cd "$ROOT" && pwd -P)" ] && [ "${MOE_EP_REPOINT:-}" != 1 ]; then
    say "$PY imports moe_ep from $OWNER, not from this checkout: not re-pointing it (MOE_EP_REPOINT=1 does)."
    say "scripts/demo.sh and scripts/test.sh run from $ROOT, where this checkout's code comes first; elsewhere"
    say "use PYTHONPATH=$ROOT, or a virtual environment of this checkout's own (python3 -m venv .venv)."
  else
    say "installing $ROOT in editable mode"
    if [ "$("$PY" moe_ep/_env.py build-isolation)" = no ]; then
      pipq --no-deps --no-build-isolation -e .
    else
      pipq --no-deps -e .
    fi
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
