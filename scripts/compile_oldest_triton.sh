#!/usr/bin/env bash
# The sm90 compile tests under the OLDEST supported Triton (3.6.0, what the GPU machines run with torch 2.11).
# Triton 3.6.0 goes into a private directory (never the environment's own Triton); it is installed once and reused:
#   $MOE_EP_OLDEST_TRITON_DIR (default .cache/triton-3.6.0-<python tag>). Then the compile tests run with that
# Triton first on PYTHONPATH. Under 3.6 the NVSHMEM rows skip when the installed NVSHMEM bitcode is newer than
# Triton 3.6's LLVM (moe_ep.nvshmem.check_triton_link names both). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=3.6.0
# the Python scripts/test.sh runs (setup.sh reads $PYTHON as the base Python it may build ./.venv from)
PY=$(bash scripts/setup.sh --print-python 2>/dev/null)
TAG=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
DIR=${MOE_EP_OLDEST_TRITON_DIR:-$PWD/.cache/triton-$VERSION-$TAG}
have() { PYTHONPATH="$DIR" "$PY" -c "import triton, sys; sys.exit(triton.__version__ != '$VERSION' or not triton.__file__.startswith('$DIR'))" 2>/dev/null; }
if have; then
  echo "compile_oldest_triton: triton $VERSION already in $DIR" >&2
else
  echo "compile_oldest_triton: installing triton==$VERSION into $DIR (~150-250 MB, once)" >&2
  rm -rf "$DIR"
  "$PY" -m pip install -q --disable-pip-version-check --no-deps --target "$DIR" "triton==$VERSION" >&2
  have || { echo "compile_oldest_triton: triton $VERSION did not import from $DIR" >&2; exit 1; }
fi
export PYTHONPATH="$DIR:$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import triton; print('compile_oldest_triton: triton', triton.__version__, 'from', triton.__file__)" >&2
# (-o addopts: these files are `slow`-marked, which the default run leaves out)
# test_sm90_report: every shipped configuration (the whole report) compiles without spills under this Triton too
exec "$PY" -m pytest -q -p no:cacheprovider -o "addopts=-ra --strict-markers" \
  tests/test_gemm_compile.py tests/test_gemm_gluon_compile.py tests/test_quant_compile.py tests/test_mega_moe_compile.py tests/test_sm90_report.py tests/test_target_amd.py \
  "tests/test_nvshmem_host.py::test_version_readers_on_this_machine" \
  tests/test_nvshmem_host.py::test_sm90_block_put_signal_rings_the_ibgda_doorbell "$@"
