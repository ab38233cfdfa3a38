"""Benchmark of the grouped FP8 GEMMs (moe_ep.gemm) against what a user would run instead.

DeepSeek-V3 expert shapes, ``D = dequant(A) @ dequant(B[g])^T`` with 1x128 activation scales and 128x128
weight scales: GEMM1 (gate+up, N=4096, K=7168) and GEMM2 (down, N=7168, K=2048); G = 8 and 32 experts
per rank; 64 ... 4096 rows per expert; both layouts:

- ``contiguous``: m_grouped_fp8_gemm_nt_contiguous, each expert's rows padded to 128 (``m_indices`` -1
  on the padding), and ``masked``: m_grouped_fp8_gemm_nt_masked with T = masked_m = expected_m = rows;
  ``masked+PDL`` is the same call launched with use_pdl=True (alone, with no producer kernel before it:
  this shows what PDL costs or saves at launch, not the overlap it gives inside a chain).
- ``FP8 peak``: torch._scaled_mm on a dense 8192^3 e4m3 GEMM (per-tensor float32 scales, BF16 out,
  fast accumulation), measured in the same run: the best dense FP8 number a user gets from torch.
- ``BF16``: torch._grouped_mm on BF16 operands (offsets over the valid rows, no padding, for the
  contiguous layout; 3D x 3D for the masked one); a Python loop of torch.matmul per expert where
  torch has no _grouped_mm or it fails. Its operands are the dequantized FP8 values rounded to BF16,
  so every output has the same reference.
- ``DeepGEMM``: deep_gemm's functions of the same names on the same FP8 inputs, when importable
  (skipped with one line otherwise; nothing is downloaded).
- A second table, the dense and BF16 GEMMs: ``fp8_gemm_nt`` (1x128 x 128x128 scales) against torch._scaled_mm
  on the same e4m3 values (per-tensor scales: the cheaper recipe, so an upper bound), ``bf16_gemm_nt`` against
  torch.matmul, ``m_grouped_bf16_gemm_nt_masked`` (G=8) against torch.bmm; each checked against a float32 matmul.

TFLOPS count valid rows only: 2 * G * rows * N * K / t (the contiguous padding is not credited); every
``tflops`` row's ``ratio`` is its TFLOPS over the dense FP8 peak measured at the start of the same run
(recorded in the JSON header as ``limits.fp8_tflops``, with the device copy bandwidth ``limits.copy_gbps``).
Times (perf/_common.py ``time_us``, rows say ``method: eager-host``): CUDA events around each call, warm-up
outside, the L2 flushed by a read before every timed call (outside the events; rows say ``l2_resident: false``),
median with p10/p90 over ``--iters`` calls. The dense FP8 peak is timed the same way without the flush (it is
compute-bound).
After timing, every output (ours, PDL, BF16, DeepGEMM) is checked per expert against a float32 matmul
of the dequantized operands: max |d - ref| < 2e-2 * max |ref| per expert, and the contiguous padding
rows must be zeros. Rows that fail say FAILED and the script exits 1.

Targets (rows per expert >= 1024): >= 0.6x DeepGEMM's speed and >= 1.5x the BF16 grouped baseline.

    python perf/bench_gemm.py                       # full sweep (needs a CUDA GPU)
    python perf/bench_gemm.py --quick --json perf/out/gemm.json
    python perf/bench_gemm.py --cpu-smoke           # tiny shapes under the Triton interpreter
"""

from __future__ import annotations

import datetime
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

_common.smoke_env()  # TRITON_INTERPRET=1 before any @triton.jit in moe_ep is defined

import torch  # noqa: E402
import triton  # noqa: E402

SHAPES = {"gemm1": (4096, 7168), "gemm2": (7168, 2048)}  # name -> (N, K): gate+up, down
SMOKE_SHAPES = {"gemm1": (256, 256), "gemm2": (256, 128)}
GROUPS = (8, 32)
ROWS = (64, 128, 256, 512, 1024, 2048, 4096)
QUICK_GROUPS, QUICK_ROWS = (8,), (128, 1024, 4096)
SMOKE_GROUPS, SMOKE_ROWS = (2,), (16, 128)
DENSE_SHAPES = ((4096, 7168, 2048), (4096, 2112, 7168), (128, 4096, 7168), (16, 7168, 2048))  # (M, N, K)
SMOKE_DENSE_SHAPES = ((16, 256, 256), (130, 256, 128))
DENSE_GROUPS = 8
PEAK_SIZE, SMOKE_PEAK_SIZE = 8192, 256
MEM_LIMIT = 60e9  # bytes; combinations estimated above this (or above free memory) are skipped
TOL = 2e-2  # max |d - ref| / max |ref|, per expert
TARGET_ROWS, TARGET_DG, TARGET_BF16 = 1024, 0.6, 1.5
ALIGN = 128  # contiguous layout: rows per expert padded to this

SMOKE = False


def _parse(argv=None):
    p = _common.parser("bench_gemm.py", __doc__,
                       f"tiny shapes on CPU under the Triton interpreter (GEMMs {SMOKE_SHAPES}, G={list(SMOKE_GROUPS)}, "
                       f"rows {list(SMOKE_ROWS)} unless given explicitly; timings meaningless; proves the code path "
                       "runs and the checks pass)")
    p.add_argument("--quick", action="store_true",
                   help=f"a small subset: G={list(QUICK_GROUPS)}, rows per expert {list(QUICK_ROWS)}")
    p.add_argument("--groups", type=int, nargs="+", default=None, help="experts per rank (overrides the default)")
    p.add_argument("--rows", type=int, nargs="+", default=None, help="rows per expert (overrides the default)")
    p.add_argument("--gemm", choices=sorted(SHAPES), nargs="+", default=None, help="which shapes (default both)")
    p.add_argument("--no-deepgemm", action="store_true", help="do not import deep_gemm")
    p.add_argument("--no-dense", action="store_true", help="skip the dense / BF16 table")
    p.add_argument("--iters", type=int, default=50,
                   help="timed calls per measurement (CUDA events, L2 flushed before each; median, p10, p90)")
    args = p.parse_args(argv)
    for name in ("groups", "rows"):
        v = getattr(args, name)
        if v is not None and min(v) < 1:
            p.error(f"argument --{name}: must be >= 1, got {min(v)}")
    if args.iters < 1:
        p.error(f"argument --iters: must be >= 1, got {args.iters}")
    return args


# ---------------------------------------------------------------------------------------------
# Timing, checks, formatting
# ---------------------------------------------------------------------------------------------

DEV = None


def _time(fn, iters: int, flush: bool = True) -> tuple[float, float, float, int]:
    """(median, p10, p90 in microseconds, iterations) by perf/_common.py's ``time_us``: CUDA events, warm-up
    outside, the L2 flushed before each timed call unless ``flush`` is False (CPU: perf_counter)."""
    cuda = DEV is not None and DEV.type == "cuda"
    t = _common.time_us(fn, DEV if cuda else None, iters=1 if SMOKE else iters, warmup=1 if SMOKE else 3,
                        flush=flush)
    return t.median, t.p10, t.p90, t.n


def _rel_err(out3: torch.Tensor, ref3: torch.Tensor) -> float:
    """Worst over experts of max |out - ref| / max |ref| (inf where NaN/inf appear)."""
    worst = 0.0
    for g in range(ref3.shape[0]):
        err = float((out3[g].float() - ref3[g]).abs().max()) / max(float(ref3[g].abs().max()), 1e-30)
        worst = max(worst, err if err == err else float("inf"))
    return worst


def _fmt(v, spec=".1f") -> str:
    return "n/a" if v is None else format(v, spec)


def _fmt_tflops(v) -> str:
    return _fmt(v, ".0f" if v is None or v >= 10 else ".3g")


def _bytes_needed(g: int, rows: int, n: int, k: int) -> int:
    """Device bytes one (G, rows, N, K) combination holds at once (upper estimate)."""
    rp = -(-rows // ALIGN) * ALIGN
    weights = g * n * k * 3 + 4 * n * k * 4 * 3          # FP8 + BF16 copies, quantization temporaries (4 experts)
    acts = g * rows * k * (2 + 2 + 1) + g * rp * k * (2 + 1)  # source, BF16 baseline, FP8 masked, padded
    ref = g * rows * n * 4
    outs = 2 * g * rp * n * 2
    return int(1.2 * (weights + acts + ref + outs)) + (256 << 20)


# ---------------------------------------------------------------------------------------------
# Baselines
# ---------------------------------------------------------------------------------------------

class Bf16Grouped:
    """The BF16 baseline: torch._grouped_mm, or a per-expert torch.matmul loop where that is missing/fails."""

    def __init__(self):
        self.impl = "torch._grouped_mm" if hasattr(torch, "_grouped_mm") else "torch.matmul loop"
        self.note = ""

    def _loop(self, x3: torch.Tensor, wb: torch.Tensor, out3: torch.Tensor) -> torch.Tensor:
        for g in range(wb.shape[0]):
            torch.matmul(x3[g], wb[g].t(), out=out3[g])
        return out3

    def make(self, x3: torch.Tensor, wb: torch.Tensor, offs: torch.Tensor, contiguous: bool):
        """A no-argument callable computing `[G, rows, N]` from BF16 ``x3`` `[G, rows, K]` and ``wb`` `[G, N, K]`."""
        g, rows, k = x3.shape
        wbt = wb.transpose(-2, -1)  # [G, K, N], column-major per expert (the "nt" operand)
        if self.impl == "torch._grouped_mm":
            if contiguous:
                x2 = x3.view(g * rows, k)

                def fn():
                    return torch._grouped_mm(x2, wbt, offs=offs).view(g, rows, -1)
            else:
                def fn():
                    return torch._grouped_mm(x3, wbt)
            try:
                fn()
                return fn
            except Exception as exc:  # noqa: BLE001 - e.g. no kernel for this GPU: fall back to the loop
                self.impl = "torch.matmul loop"
                self.note = f"torch._grouped_mm failed ({type(exc).__name__}: {str(exc)[:100]}); using the loop"
                print("  " + self.note, file=sys.stderr)
        out3 = torch.empty(g, rows, wb.shape[1], dtype=torch.bfloat16, device=x3.device)
        return lambda: self._loop(x3, wb, out3)


def _deep_gemm(disabled: bool):
    """((contiguous fn, masked fn) or None, one line saying what was found)."""
    if SMOKE:
        return None, "DeepGEMM: skipped (CPU smoke run)"
    if disabled:
        return None, "DeepGEMM: skipped (--no-deepgemm)"
    try:
        import deep_gemm
    except Exception as exc:  # noqa: BLE001 - ImportError or a broken extension: skip with one line
        return None, f"DeepGEMM: skipped, not importable ({type(exc).__name__}: {str(exc)[:80]})"
    contig = getattr(deep_gemm, "m_grouped_fp8_gemm_nt_contiguous", None) or \
        getattr(deep_gemm, "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous", None)
    masked = getattr(deep_gemm, "m_grouped_fp8_gemm_nt_masked", None) or \
        getattr(deep_gemm, "m_grouped_gemm_fp8_fp8_bf16_nt_masked", None)
    if contig is None or masked is None:
        return None, "DeepGEMM: skipped, deep_gemm has no m_grouped FP8 nt contiguous/masked functions"
    return (contig, masked), f"DeepGEMM: {getattr(deep_gemm, '__version__', 'version unknown')} " \
                             f"({contig.__name__}, {masked.__name__})"


def _dense_fp8_peak(dev: torch.device, size: int, iters: int) -> dict:
    """torch._scaled_mm on a dense size^3 e4m3 GEMM: TFLOPS and its check."""
    from moe_ep.fp8 import FP8_DTYPE

    a = torch.randn(size, size, device=dev).to(FP8_DTYPE)
    b = torch.randn(size, size, device=dev).to(FP8_DTYPE)  # [N, K] K-major; b.t() is the column-major operand
    one = torch.ones((), dtype=torch.float32, device=dev)

    def fn():
        return torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=True)

    med, p10, p90, n = _time(fn, iters, flush=False)  # compute-bound: operands stay in L2 as they would anyway
    out = fn()
    err = _rel_err(out[None], (a.float() @ b.float().t())[None])
    return {"size": size, "us": med, "p10_us": p10, "p90_us": p90, "iterations": n, "tflops": 2 * size ** 3 / med / 1e6,
            "rel_err": err, "ok": err < TOL}


# ---------------------------------------------------------------------------------------------
# One shape
# ---------------------------------------------------------------------------------------------

def _weights(g: int, n: int, k: int, dev: torch.device):
    """FP8 weights `[G, N, K]` + scales `[G, N/128, K/128]`, and their dequantized values in BF16."""
    from moe_ep.quant import dequant_block_fp8, per_block_quant_fp8

    wq = torch.empty(g, n, k, dtype=torch.float8_e4m3fn, device=dev)
    ws = torch.empty(g, n // 128, k // 128, dtype=torch.float32, device=dev)
    wb = torch.empty(g, n, k, dtype=torch.bfloat16, device=dev)
    for e in range(0, g, 4):  # chunks bound the float32 temporaries of the quantization
        w = torch.randn(min(4, g - e), n, k, device=dev, dtype=torch.bfloat16)
        q, s = per_block_quant_fp8(w)
        wq[e:e + 4], ws[e:e + 4] = q, s
        wb[e:e + 4] = dequant_block_fp8(q, s).to(torch.bfloat16)
    return wq, ws, wb


def _targets(rows: int, x_bf16: float | None, x_dg: float | None) -> tuple[str, dict]:
    if rows < TARGET_ROWS:
        return "-", {}
    flags, misses = {}, []
    if x_bf16 is not None:
        flags["meets_bf16"] = x_bf16 >= TARGET_BF16
        if not flags["meets_bf16"]:
            misses.append(f"BF16 {x_bf16:.2f}x<{TARGET_BF16}x")
    if x_dg is not None:
        flags["meets_deepgemm"] = x_dg >= TARGET_DG
        if not flags["meets_deepgemm"]:
            misses.append(f"DG {x_dg:.2f}x<{TARGET_DG}x")
    if misses:
        return "MISSES " + ", ".join(misses), flags
    return ("meets" if flags else "n/a") + ("" if x_dg is not None else " (DG n/a)"), flags


def _combo(name, n, k, g, rows, wq, ws, wb, dev, args, peak_tflops, bf16: Bf16Grouped, dg) -> list[dict]:
    """Time and check every variant of one (shape, G, rows); one record per table row."""
    from moe_ep.gemm import m_grouped_fp8_gemm_nt_contiguous, m_grouped_fp8_gemm_nt_masked
    from moe_ep.quant import dequant_block_fp8, dequant_fp8, per_token_group_quant_fp8

    rp = -(-rows // ALIGN) * ALIGN
    m_valid = g * rows
    flops = 2 * m_valid * n * k

    # Inputs: the same activations in both layouts (so one reference serves every output).
    x_src = torch.randn(g, rows, k, device=dev, dtype=torch.bfloat16)
    xpad = torch.zeros(g, rp, k, device=dev, dtype=torch.bfloat16)
    xpad[:, :rows] = x_src
    xc, sfc = per_token_group_quant_fp8(xpad.view(g * rp, k), tma_aligned_scales=True)
    del xpad
    m_indices = torch.full((g, rp), -1, dtype=torch.int32, device=dev)
    m_indices[:, :rows] = torch.arange(g, dtype=torch.int32, device=dev)[:, None]
    m_indices = m_indices.view(-1)
    xm, sfm = per_token_group_quant_fp8(x_src, tma_aligned_scales=True)  # [G, rows, K], [G, rows, K/128]
    del x_src
    masked_m = torch.full((g,), rows, dtype=torch.int32, device=dev)
    offs = torch.arange(1, g + 1, dtype=torch.int32, device=dev) * rows

    # Reference, per expert: float32 matmul of the dequantized operands; BF16 baseline operands from them.
    ref = torch.empty(g, rows, n, dtype=torch.float32, device=dev)
    xb = torch.empty(g, rows, k, dtype=torch.bfloat16, device=dev)
    for e in range(g):
        xd = dequant_fp8(xm[e], sfm[e])
        xb[e] = xd.to(torch.bfloat16)
        torch.matmul(xd, dequant_block_fp8(wq[e], ws[e]).t(), out=ref[e])

    dc = torch.empty(g * rp, n, dtype=torch.bfloat16, device=dev)
    dm = torch.empty(g, rows, n, dtype=torch.bfloat16, device=dev)

    def check_contiguous(d):
        d3 = d.view(g, rp, n)
        err = _rel_err(d3[:, :rows], ref)
        return err if rp == rows or bool((d3[:, rows:] == 0).all()) else float("inf")

    def timed(fn, out_check):
        """(median, p10, p90, rel err) or Nones with a message when the call raises; the iteration count goes to
        ``iters_box``."""
        try:
            *t, n_it = _time(fn, args.iters)
        except Exception as exc:  # noqa: BLE001 - a failing baseline must not stop the table
            print(f"  {name} G={g} rows={rows}: call failed: {type(exc).__name__}: {str(exc)[:160]}",
                  file=sys.stderr)
            return None, None, None, None
        iters_box.append(n_it)
        return (*t, out_check())

    iters_box = []

    res = {}
    res["contiguous"] = timed(lambda: m_grouped_fp8_gemm_nt_contiguous((xc, sfc), (wq, ws), dc, m_indices),
                              lambda: check_contiguous(dc))
    res["masked"] = timed(lambda: m_grouped_fp8_gemm_nt_masked((xm, sfm), (wq, ws), dm, masked_m, rows),
                          lambda: _rel_err(dm, ref))
    res["masked+PDL"] = timed(lambda: m_grouped_fp8_gemm_nt_masked((xm, sfm), (wq, ws), dm, masked_m, rows,
                                                                   use_pdl=True),
                              lambda: _rel_err(dm, ref))
    base = {}
    for layout in ("contiguous", "masked"):
        fn = bf16.make(xb, wb, offs, layout == "contiguous")
        box = {}

        def run(fn=fn, box=box):
            box["out"] = fn()

        base[("bf16", layout)] = (*timed(run, lambda box=box: _rel_err(box["out"], ref)), bf16.impl)
        del box
    if dg is not None:
        dg_contig, dg_masked = dg
        base[("dg", "contiguous")] = timed(lambda: dg_contig((xc, sfc), (wq, ws), dc, m_indices),
                                           lambda: check_contiguous(dc))
        base[("dg", "masked")] = timed(lambda: dg_masked((xm, sfm), (wq, ws), dm, masked_m, rows),
                                       lambda: _rel_err(dm, ref))

    records = []
    for layout, (us, p10, p90, err) in res.items():
        blayout = "contiguous" if layout == "contiguous" else "masked"
        b_us, _, _, b_err, b_impl = base[("bf16", blayout)]
        d_us, _, _, d_err = base.get(("dg", blayout), (None, None, None, None))
        tflops = flops / us / 1e6 if us else None
        x_bf16 = b_us / us if (us and b_us) else None
        x_dg = d_us / us if (us and d_us) else None
        failed = [what for what, e, t in (("ours", err, us), ("BF16", b_err, b_us), ("DeepGEMM", d_err, d_us))
                  if (t is not None and not e < TOL) or (what == "ours" and t is None)]
        target_text, flags = _targets(rows, x_bf16, x_dg)
        records.append({
            "kind": "grouped_fp8_gemm", "gemm": name, "n": n, "k": k, "groups": g, "rows_per_expert": rows,
            "layout": blayout, "use_pdl": layout.endswith("PDL"), "m_valid": m_valid,
            "m_total": g * rp if blayout == "contiguous" else m_valid,
            "us": us, "p10_us": p10, "p90_us": p90, "tflops": tflops, "iterations": iters_box[0] if iters_box else None,
            "x_fp8_peak": tflops / peak_tflops if (tflops and peak_tflops) else None,
            "bf16_us": b_us, "bf16_impl": b_impl, "x_bf16": x_bf16,
            "deepgemm_us": d_us, "x_deepgemm": x_dg,
            "rel_err": err, "bf16_rel_err": b_err, "deepgemm_rel_err": d_err,
            "ok": not failed, "failed": failed, "targets": target_text, **flags,
            "_layout_label": layout,
        })
    return records


def _row(r: dict) -> list[str]:
    check = f"ok ({r['rel_err']:.1e})" if r["ok"] else "**FAILED** " + ",".join(r["failed"]) + \
        (f" ({_fmt(r['rel_err'], '.1e')})" if r["rel_err"] is not None else "")
    spread = "n/a" if r["us"] is None else f"{r['p10_us']:.1f}-{r['p90_us']:.1f}"
    return [r["gemm"], str(r["n"]), str(r["k"]), str(r["groups"]), str(r["rows_per_expert"]), r["_layout_label"],
            _fmt(r["us"]), spread, _fmt_tflops(r["tflops"]), _fmt(r["x_fp8_peak"], ".2f"),
            _fmt(r["bf16_us"]), _fmt(r["x_bf16"], ".2f"), _fmt(r["deepgemm_us"]), _fmt(r["x_deepgemm"], ".2f"),
            check, r["targets"]]


HEADER = ["GEMM", "N", "K", "G", "rows/expert", "layout", "ours us", "p10-p90 us", "TFLOPS", "x FP8 peak",
          "BF16 us", "x BF16", "DeepGEMM us", "x DeepGEMM", "check", "targets"]


# ---------------------------------------------------------------------------------------------
# Dense and BF16 GEMMs
# ---------------------------------------------------------------------------------------------

DENSE_HEADER = ["GEMM", "M", "N", "K", "ours us", "TFLOPS", "baseline", "baseline us", "x baseline", "check"]


def _dense_table(dev: torch.device, args, rec) -> int:
    """The dense FP8 / BF16 and grouped BF16 rows (module docstring); returns how many failed their check."""
    from moe_ep.gemm import bf16_gemm_nt, fp8_gemm_nt, m_grouped_bf16_gemm_nt_masked
    from moe_ep.quant import dequant_block_fp8, dequant_fp8, per_block_quant_fp8, per_token_group_quant_fp8

    print("\n| " + " | ".join(DENSE_HEADER) + " |\n" + "|" + "---|" * len(DENSE_HEADER), flush=True)
    failed = 0
    one = torch.ones((), dtype=torch.float32, device=dev)
    for m, n, k in (SMOKE_DENSE_SHAPES if SMOKE else DENSE_SHAPES):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        xq, xs = per_token_group_quant_fp8(x, tma_aligned_scales=True)
        wq, ws = per_block_quant_fp8(w.float()[None])
        wq, ws = wq[0], ws[0]
        ref8 = dequant_fp8(xq, xs) @ dequant_block_fp8(wq[None], ws[None])[0].t()
        ref16 = x.float() @ w.float().t()
        d = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        g = DENSE_GROUPS
        xg = torch.randn(g, max(1, m // g), k, device=dev, dtype=torch.bfloat16)
        wg = torch.randn(g, n, k, device=dev, dtype=torch.bfloat16)
        dg_out = torch.empty(g, xg.shape[1], n, device=dev, dtype=torch.bfloat16)
        masked_m = torch.full((g,), xg.shape[1], dtype=torch.int32, device=dev)
        refg = torch.bmm(xg.float(), wg.float().transpose(1, 2))
        box = {}
        rows = [
            ("fp8_gemm_nt", m, lambda: fp8_gemm_nt((xq, xs), (wq, ws), d), lambda: _rel_err(d[None], ref8[None]),
             "torch._scaled_mm (per-tensor)",
             lambda: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)),
            ("bf16_gemm_nt", m, lambda: bf16_gemm_nt(x, w, d), lambda: _rel_err(d[None], ref16[None]),
             "torch.matmul", lambda: torch.matmul(x, w.t())),
            (f"m_grouped_bf16_gemm_nt_masked G={g}", g * xg.shape[1],
             lambda: m_grouped_bf16_gemm_nt_masked(xg, wg, dg_out, masked_m, xg.shape[1]),
             lambda: _rel_err(dg_out, refg), "torch.bmm", lambda: torch.bmm(xg, wg.transpose(1, 2))),
        ]
        for what, mm, fn, check, bname, bfn in rows:
            us = _time(fn, args.iters)[0]
            err = check()
            try:
                b_us = _time(lambda bfn=bfn: box.__setitem__("o", bfn()), args.iters)[0]
            except Exception as exc:  # noqa: BLE001 - a baseline torch lacks here (e.g. _scaled_mm on CPU)
                b_us, bname = None, f"{bname}: n/a ({type(exc).__name__})"
            flops = 2 * mm * n * k
            ok = err < TOL
            failed += not ok
            print("| " + " | ".join([what, str(mm), str(n), str(k), _fmt(us), _fmt_tflops(flops / us / 1e6), bname,
                                     _fmt(b_us), _fmt(b_us / us if b_us else None, ".2f"),
                                     f"ok ({err:.1e})" if ok else f"**FAILED** ({err:.1e})"]) + " |", flush=True)
            rec.add(f"{what} M={mm} N={n} K={k}", "time", us, "us", baseline=b_us, ratio=b_us / us if b_us else None,
                    valid=ok, rel_err=err, tflops=flops / us / 1e6, note=f"baseline: {bname}; ratio = baseline / ours")
            if not ok:
                print(f"FAILED: {what} M={mm} N={n} K={k}: rel err {err:.1e} >= {TOL}", file=sys.stderr, flush=True)
    return failed


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    global SMOKE, DEV
    args = _parse(argv)
    if args.cpu_smoke:
        SMOKE = True
        os.environ["TRITON_INTERPRET"] = "1"  # no-op when set at import (the script's own path)
        from moe_ep.kernels.pdl import INTERPRET
        if not INTERPRET:
            print("--cpu-smoke needs TRITON_INTERPRET=1 before moe_ep is imported: run the script directly",
                  file=sys.stderr)
            return 2
        dev, name = torch.device("cpu"), "CPU smoke run (Triton interpreter, timings meaningless)"
        shapes, groups, rows_list, peak_size = SMOKE_SHAPES, SMOKE_GROUPS, SMOKE_ROWS, SMOKE_PEAK_SIZE
    elif not _common.gpu_count() or not torch.cuda.is_available():
        return _common.no_gpu("bench_gemm.py")
    else:
        dev = torch.device("cuda", torch.cuda.current_device())
        name = torch.cuda.get_device_name(dev)
        shapes, peak_size = SHAPES, PEAK_SIZE
        groups, rows_list = (QUICK_GROUPS, QUICK_ROWS) if args.quick else (GROUPS, ROWS)
    groups = args.groups or groups
    rows_list = args.rows or rows_list
    if args.gemm:
        shapes = {s: shapes[s] for s in args.gemm}

    DEV = dev
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference stays float32
    torch.manual_seed(0)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    rec = _common.Records("bench_gemm", args.json, args.cpu_smoke, device=name, argv=argv, method=_common.EAGER)
    meta = {"commit": (rec.header["commit"] or "unknown") + ("+dirty" if rec.header["dirty"] else "")}
    dg, dg_line = _deep_gemm(args.no_deepgemm)
    bf16 = Bf16Grouped()
    limits = _common.measure_limits(dev, peer=False, fp8=False)  # copy bandwidth, L2 size
    peak = _dense_fp8_peak(dev, peak_size, args.iters)  # the FP8 limit, checked against a float32 matmul
    peak_tflops = peak["tflops"] if peak["ok"] else None
    limits.update(fp8_tflops=peak_tflops, fp8_size=peak_size,
                  fp8_note=None if peak["ok"] else f"check failed (rel err {peak['rel_err']:.1e})")
    rec.update_header(limits=limits, timing="CUDA events, L2 flushed before each timed call (dense FP8 peak: no "
                      "flush)" if dev.type == "cuda" else "CPU perf_counter")
    resident = False if dev.type == "cuda" else None

    cmd = " ".join(sys.argv[1:] if argv is None else argv)
    print(f"## bench_gemm.py: {name}, {date}, torch {torch.__version__}, triton {triton.__version__}, "
          f"commit {meta['commit']}\n\n`python perf/bench_gemm.py {cmd}`\n")
    print(f"- Dense FP8 peak (torch._scaled_mm {peak_size}^3, e4m3, per-tensor scales, BF16 out, fast accum): "
          f"{_fmt_tflops(peak['tflops'])} TFLOPS ({peak['us']:.1f} us, p10-p90 {peak['p10_us']:.1f}-{peak['p90_us']:.1f})"
          + ("" if peak["ok"] else f" **FAILED** check (rel err {peak['rel_err']:.1e}): ratios omitted"))
    print(f"- BF16 grouped baseline: {bf16.impl}" + ("" if hasattr(torch, "_grouped_mm") else " (torch has no "
                                                         "_grouped_mm)"))
    print(f"- {dg_line}")
    print(f"- Targets at >= {TARGET_ROWS} rows per expert: >= {TARGET_DG}x DeepGEMM, >= {TARGET_BF16}x the BF16 "
          f"grouped baseline (x = baseline time / ours)")
    print(f"- Check: per expert max |d - ref| < {TOL} * max |ref| (float32 matmul of the dequantized operands)\n",
          flush=True)

    rec.add("dense FP8 peak", "tflops", peak["tflops"], "TFLOPS", p10=2 * peak_size ** 3 / peak["p90_us"] / 1e6,
            p90=2 * peak_size ** 3 / peak["p10_us"] / 1e6, iterations=peak["iterations"], valid=peak["ok"],
            l2_resident=None if dev.type != "cuda" else True, time_us=peak["us"], rel_err=peak.get("rel_err"),
            note=f"torch._scaled_mm {peak_size}^3 e4m3 -> BF16, fast accumulation, no L2 flush (compute-bound): "
                 "the limit of every tflops row")
    print("| " + " | ".join(HEADER) + " |\n" + "|" + "---|" * len(HEADER), flush=True)
    records = []
    for sname, (n, k) in shapes.items():
        for g in groups:
            limit = MEM_LIMIT
            if dev.type == "cuda":
                limit = min(limit, 0.9 * torch.cuda.mem_get_info(dev)[0])
            wq = ws = wb = None
            for rows in rows_list:
                need = _bytes_needed(g, rows, n, k)
                if need > limit:
                    print(f"  skipped {sname} G={g} rows={rows}: needs ~{need / 1e9:.0f} GB > {limit / 1e9:.0f} GB",
                          file=sys.stderr)
                    continue
                if wq is None:
                    wq, ws, wb = _weights(g, n, k, dev)
                recs = _combo(sname, n, k, g, rows, wq, ws, wb, dev, args, peak_tflops, bf16, dg)
                for r in recs:
                    print("| " + " | ".join(_row(r)) + " |", flush=True)
                    case = f"{sname} G={g} rows={rows} {r['_layout_label']}"
                    note = "baseline: " + r["bf16_impl"] + " (BF16); ratio = baseline / ours"
                    rec.add(case, "time", r["us"], "us", p10=r["p10_us"], p90=r["p90_us"], baseline=r["bf16_us"],
                            limit=None, ratio=r["x_bf16"], valid=r["ok"], l2_resident=resident, note=note,
                            tflops=r["tflops"], x_fp8_peak=r["x_fp8_peak"], deepgemm_us=r["deepgemm_us"],
                            x_deepgemm=r["x_deepgemm"], rel_err=r["rel_err"], iterations=r["iterations"])
                    flops = 2 * g * rows * n * k
                    rec.add(case, "tflops", r["tflops"], "TFLOPS",
                            p10=flops / r["p90_us"] / 1e6 if r["p90_us"] else None,
                            p90=flops / r["p10_us"] / 1e6 if r["p10_us"] else None, iterations=r["iterations"],
                            limit=peak_tflops, ratio=r["x_fp8_peak"], valid=r["ok"], l2_resident=resident,
                            note="valid rows only; limit: dense FP8 peak (torch._scaled_mm) measured in this run",
                            limit_name="fp8_tflops")
                    if not r["ok"]:
                        print(f"FAILED: {sname} G={g} rows={rows} {r['_layout_label']}: {', '.join(r['failed'])} "
                              f"outside {TOL} of max |ref|", file=sys.stderr, flush=True)
                records += recs
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            del wq, ws, wb
            if dev.type == "cuda":
                torch.cuda.empty_cache()

    dense_failed = 0 if args.no_dense else _dense_table(dev, args, rec)
    if bf16.note:
        print(f"\nNote: {bf16.note}")
    failed = [r for r in records if not r["ok"]] + [{}] * dense_failed
    if failed or not peak["ok"]:
        print(f"\n{len(records)} rows, {len(failed)} FAILED" + ("" if peak["ok"] else ", dense FP8 peak check FAILED"))
    else:
        print(f"\n{len(records)} rows, all checks passed")

    if not records:
        return _common.error("bench_gemm.py", "measured nothing (every combination was skipped)")
    if failed or not peak["ok"]:
        print("INVALID: outputs outside the tolerance of the reference (see FAILED above)")
        return _common.error("bench_gemm.py", f"INVALID: {len(failed)} rows failed their check")
    return 0



if __name__ == "__main__":
    sys.exit(main())
