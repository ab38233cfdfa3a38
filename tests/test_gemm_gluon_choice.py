"""The FP8 GEMM kernel choice (``MOE_EP_GEMM_KERNEL``) and the Gluon lease stage's CPU-side parts.

On CPU every choice runs the ``tl`` kernel (Gluon has no interpreter): ``gluon`` and ``auto`` say why they fall
back, and the results are the ``tl`` kernel's bit for bit. ``perf/lease_gemm_gluon.py`` parses its arguments,
lists the target shapes, and its numerics check (run here through the ``tl`` kernel on a tiny shape) passes a
right result and fails a wrong one."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from moe_ep import gemm
from moe_ep.gemm.gluon import ENV, GluonTile, auto_prefers_gluon, gemm_kernel_choice, gluon_tile
from moe_ep.quant import per_block_quant_fp8, per_token_group_quant_fp8

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEASE = os.path.join(ROOT, "perf", "lease_gemm_gluon.py")


def _lease():
    spec = importlib.util.spec_from_file_location("lease_gemm_gluon", LEASE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["lease_gemm_gluon"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_default_is_auto_and_values_are_checked(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    kind, why = gemm_kernel_choice(torch.device("cpu"))
    assert kind == "tl" and ("interpreter" in why or "CUDA" in why), why
    monkeypatch.setenv(ENV, "tl")
    assert gemm_kernel_choice(torch.device("cpu")) == ("tl", f"{ENV} is 'tl'")
    monkeypatch.setenv(ENV, "cutlass")
    with pytest.raises(ValueError, match="MOE_EP_GEMM_KERNEL='cutlass'"):
        gemm_kernel_choice(torch.device("cpu"))


@pytest.mark.parametrize("mode", ["gluon", "auto"])
def test_gluon_request_falls_back_to_tl_on_cpu(monkeypatch, mode):
    monkeypatch.setenv(ENV, mode)
    kind, why = gemm_kernel_choice(torch.device("cpu"))
    assert kind == "tl" and ("interpreter" in why or "CUDA" in why), why
    gen = torch.Generator().manual_seed(3)
    wq, ws = per_block_quant_fp8(torch.randn(2, 128, 256, generator=gen))
    xq, xs = per_token_group_quant_fp8(torch.randn(2, 8, 256, generator=gen).to(torch.bfloat16))
    mm = torch.tensor([8, 3], dtype=torch.int32)
    d1 = torch.zeros(2, 8, 128, dtype=torch.bfloat16)
    gemm.m_grouped_fp8_gemm_nt_masked((xq, xs), (wq, ws), d1, mm, 8)
    monkeypatch.setenv(ENV, "tl")
    d2 = torch.zeros_like(d1)
    gemm.m_grouped_fp8_gemm_nt_masked((xq, xs), (wq, ws), d2, mm, 8)
    assert torch.equal(d1, d2) and bool(d1[0].abs().sum() > 0)


def test_auto_takes_gluon_where_it_measured_faster():
    # H200, 2026-11-28: masked tl wins up to expected_m 256, Gluon from 512; contiguous Gluon from 4,096 rows
    assert not auto_prefers_gluon(1, 32 * 1024, 256) and auto_prefers_gluon(1, 1024, 512)
    assert not auto_prefers_gluon(1, 32 * 128, 128)  # decode: rows in all do not count, rows per expert do
    assert auto_prefers_gluon(0, 4096, 0) and auto_prefers_gluon(2, 32768, 0)
    assert not auto_prefers_gluon(0, 4095, 0) and not auto_prefers_gluon(3, 1 << 16, 1 << 16)


def test_tiles_per_shape_class():
    assert gluon_tile(32) == GluonTile(64, 128, 4, 6) and gluon_tile(64).block_m == 64
    assert gluon_tile(65) == GluonTile(128, 128, 8, 5) and gluon_tile(4096).num_warps == 8


def test_lease_arguments_and_shape_table():
    mod = _lease()
    targets = {("masked", 32, 1024, 4096, 7168), ("contiguous", 4, 8192, 4096, 7168),
               ("contiguous", 4, 8192, 7168, 2048), ("contiguous", 8, 4096, 4096, 7168),
               ("contiguous", 8, 4096, 7168, 2048)}
    have = {(s.layout, s.groups, s.rows, s.n, s.k) for s in mod.SHAPES.values()}
    assert targets <= have
    assert sorted(s.rows for s in mod.SHAPES.values() if s.decode) == [32, 64, 128, 256]
    assert mod.SHAPES["masked_g32x1024"].flops == 2 * 32 * 1024 * 4096 * 7168
    args = mod.parse_args(["--shapes", "masked_g32x1024", "--iters", "3"])
    assert args.shapes == ["masked_g32x1024"] and args.iters == 3 and args.warmup == 2
    with pytest.raises(SystemExit):
        mod.parse_args(["--shapes", "nope"])
    with pytest.raises(SystemExit):
        mod.parse_args(["--iters", "0"])
    table = mod.shape_table(list(mod.SHAPES))
    assert "masked_g32x1024" in table and table.count("\n") == len(mod.SHAPES) + 1
    assert mod.main(["--list"]) == 0
    if not torch.cuda.is_available():
        assert mod.main(["--shapes", "masked_g32x1024"]) == 2


def test_lease_help_runs():
    proc = subprocess.run([sys.executable, LEASE, "--help"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0 and "--shapes" in proc.stdout and "loads-only" in proc.stdout


@pytest.mark.parametrize("layout", ["masked", "contiguous"])
def test_lease_numerics_check_passes_right_and_fails_wrong(layout):
    mod = _lease()
    s = mod.Shape("tiny", layout, 2, 128 if layout == "contiguous" else 5, 128, 256)
    inp = mod.make_inputs(s, torch.device("cpu"))
    rows = mod.check_shape(s, inp, kernels=("tl",))
    assert rows and all(r["ok"] for r in rows), rows

    def wrong(shape, data, kernel, psum=False):
        d = mod.run_kernel(shape, data, kernel, psum)
        d.view(-1)[7] += 1.0  # one element off
        return d

    bad = mod.check_shape(s, inp, kernels=("tl",), runner=wrong)
    assert not bad[0]["ok"] and bad[0]["err_over_bound"] > 1
