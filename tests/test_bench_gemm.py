"""perf/bench_gemm.py --cpu-smoke: the benchmark's code path runs under the Triton interpreter and every
timed result passes its reference check."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


@pytest.mark.slow  # a bench's --cpu-smoke end to end (15 s; CI runs -m slow)
def test_bench_gemm_cpu_smoke():
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "perf", "bench_gemm.py"), "--cpu-smoke"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "FAILED" not in out, out[-4000:]
    assert "| GEMM | N | K | G | rows/expert | layout | ours us |" in proc.stdout, proc.stdout[-4000:]
    assert "all checks passed" in proc.stdout
    for layout in ("contiguous", "masked", "masked+PDL"):
        assert f"| {layout} |" in proc.stdout
