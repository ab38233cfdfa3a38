"""Lease stage: the warp-specialised Gluon FP8 GEMM against the ``tl`` kernel at DeepSeek-V3 expert shapes, each
row beside the same run's ceilings.

For every shape (``--list`` prints the table) the numerics come first: the Gluon kernel and the ``tl`` kernel
against a float64 reference of the dequantized operands, ``|d - ref| <= 2^-12 * sum|a w| + one BF16 ulp`` (the
sm90 FP8-accumulator bound of ``perf/lease_cases.py``) and DeepGEMM's ``calc_diff < 1e-3``; the contiguous shapes
also check psum against ``m_indices`` bitwise. A kernel that fails is not timed, and the script exits 1 at the end.
Then, timed with CUDA events after an L2 flush (median of ``--iters``):

- ``gluon`` / ``tl``: ``MOE_EP_GEMM_KERNEL=gluon`` / ``tl`` through the DeepGEMM-named entry point;
- ``gluon loads-only``: the same kernel with the MMAs and the promotion removed (the L2/HBM feed ceiling);
- ``scaled_mm 8192^3``: ``torch._scaled_mm`` e4m3, ``use_fast_accum=True`` (the FP8 ceiling, once per run);
- ``scaled_mm blockwise``: per expert, ``torch._scaled_mm`` with 1x128 / 128x128 block scales (the same recipe,
  cuBLASLt on CUDA >= 12.9); the row says ``skipped`` with the error when this torch refuses the call;
- ``bf16 bmm``: ``torch.bmm`` of the same shapes in BF16;
- decode shapes also print the weight-read floor: expert weight bytes / the measured device copy bandwidth.

    python perf/lease_gemm_gluon.py                      # every shape
    python perf/lease_gemm_gluon.py --shapes masked_g32x1024 --iters 20 --json out/gemm_gluon.jsonl
    python perf/lease_gemm_gluon.py --list               # the shape table (no GPU needed)

Needs a CUDA sm90 GPU for the timings (exits 2 without one).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

PROG = "lease_gemm_gluon"
ACC_BOUND = 2.0 ** -12  # sm90 FP8 MMA: ~14 accumulator bits inside a 128-deep K block
MAX_DIFF = 1e-3  # DeepGEMM's calc_diff threshold for FP8


@dataclass(frozen=True)
class Shape:
    """One row of the targets: ``layout`` masked (``groups`` x ``rows`` each, ``masked_m`` = ``rows``) or
    contiguous (``groups`` experts of ``rows`` rows back to back)."""

    name: str
    layout: str
    groups: int
    rows: int
    n: int
    k: int
    decode: bool = False

    @property
    def flops(self) -> int:
        return 2 * self.groups * self.rows * self.n * self.k

    @property
    def weight_bytes(self) -> int:
        return self.groups * self.n * self.k  # FP8: one byte per weight (scales: 1/16384 of it)


SHAPES = {s.name: s for s in [
    Shape("masked_g32x1024", "masked", 32, 1024, 4096, 7168),
    Shape("contig_4x8192_n4096_k7168", "contiguous", 4, 8192, 4096, 7168),
    Shape("contig_4x8192_n7168_k2048", "contiguous", 4, 8192, 7168, 2048),
    Shape("contig_8x4096_n4096_k7168", "contiguous", 8, 4096, 4096, 7168),
    Shape("contig_8x4096_n7168_k2048", "contiguous", 8, 4096, 7168, 2048),
    Shape("masked_decode_g32x32", "masked", 32, 32, 4096, 7168, decode=True),
    Shape("masked_decode_g32x64", "masked", 32, 64, 4096, 7168, decode=True),
    Shape("masked_decode_g32x128", "masked", 32, 128, 4096, 7168, decode=True),
    # between decode and prefill: where the tl / Gluon choice of MOE_EP_GEMM_KERNEL=auto changes
    Shape("masked_g32x256", "masked", 32, 256, 4096, 7168, decode=True),
    Shape("masked_g32x512", "masked", 32, 512, 4096, 7168),
    Shape("contig_32x256_n4096_k7168", "contiguous", 32, 256, 4096, 7168),
    Shape("contig_32x128_n4096_k7168", "contiguous", 32, 128, 4096, 7168),
]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), metavar="NAME",
                   help="shapes to run (default: all; --list names them)")
    p.add_argument("--iters", type=int, default=10, help="timed iterations per row (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls before timing (includes the JIT compile)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write one JSON object per row here")
    p.add_argument("--list", action="store_true", help="print the shape table and exit")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown:
        p.error(f"unknown shape(s) {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    return args


def shape_table(names) -> str:
    lines = ["| shape | layout | groups x rows | N | K | GFLOP | FP8 weight MB |", "|---|---|---|---|---|---|---|"]
    for n in names:
        s = SHAPES[n]
        lines.append(f"| {s.name} | {s.layout}{' (decode)' if s.decode else ''} | {s.groups} x {s.rows} | {s.n} | "
                     f"{s.k} | {s.flops / 1e9:.0f} | {s.weight_bytes / 1e6:.0f} |")
    return "\n".join(lines)


def calc_diff(x, y) -> float:
    """DeepGEMM's ``calc_diff``: 1 - 2 sum(x y) / sum(x^2 + y^2), in float64."""
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum()
    return float(1 - 2 * (x * y).sum() / denom) if float(denom) > 0 else 0.0


def check_output(d, xd, wd, acc_bound: float = ACC_BOUND) -> dict:
    """``d`` `[..., rows, N]` against float64 ``xd @ wd.T`` per group: worst error over the bound (<= 1 passes)
    and calc_diff; ``ok`` when both hold."""
    import torch

    from moe_ep.testing import ulp

    worst, diffs = 0.0, []
    for g in range(xd.shape[0]):
        a, w = xd[g].double(), wd[g].double()
        ref = a @ w.T
        tol = (a.abs() @ w.abs().T) * acc_bound + 1e-30
        if d.dtype == torch.bfloat16:
            tol = tol + ulp(ref, torch.bfloat16)
        worst = max(worst, float(((d[g].double() - ref).abs() / tol).max()) if d[g].numel() else 0.0)
        diffs.append(calc_diff(d[g], ref))
    diff = max(diffs) if diffs else 0.0
    return {"ok": worst <= 1.0 and diff < MAX_DIFF, "err_over_bound": worst, "calc_diff": diff}


def make_inputs(s: Shape, device, seed: int = 0) -> dict:
    """FP8 operands (1x128 activation scales, TMA-aligned; 128x128 weight scales) and their dequantized copies."""
    import torch

    from moe_ep.quant import dequant_block_fp8, dequant_fp8, per_block_quant_fp8, per_token_group_quant_fp8

    gen = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(s.groups, s.n, s.k, device=device, generator=gen)
    wq, ws = per_block_quant_fp8(w)
    del w
    x = torch.randn(s.groups, s.rows, s.k, device=device, generator=gen).to(torch.bfloat16)
    xq, xs = per_token_group_quant_fp8(x if s.layout == "masked" else x.reshape(-1, s.k), tma_aligned_scales=True)
    out = {"wq": wq, "ws": ws, "xq": xq, "xs": xs, "xd": dequant_fp8(xq, xs).reshape(s.groups, s.rows, s.k),
           "wd": dequant_block_fp8(wq, ws), "x_bf16": x}
    if s.layout == "contiguous":
        out["m_indices"] = torch.arange(s.groups, device=device, dtype=torch.int32).repeat_interleave(s.rows)
        out["psum"] = torch.arange(1, s.groups + 1, device=device, dtype=torch.int32) * s.rows
    else:
        out["masked_m"] = torch.full((s.groups,), s.rows, device=device, dtype=torch.int32)
    return out


def run_kernel(s: Shape, inp: dict, kernel: str, psum: bool = False):
    """One call of the entry point with ``MOE_EP_GEMM_KERNEL=kernel``; returns ``d`` as `[groups, rows, N]`."""
    import torch

    from moe_ep import gemm

    os.environ["MOE_EP_GEMM_KERNEL"] = kernel
    if s.layout == "masked":
        d = torch.empty(s.groups, s.rows, s.n, device=inp["xq"].device, dtype=torch.bfloat16)
        gemm.m_grouped_fp8_gemm_nt_masked((inp["xq"], inp["xs"]), (inp["wq"], inp["ws"]), d, inp["masked_m"], s.rows)
        return d
    d = torch.empty(s.groups * s.rows, s.n, device=inp["xq"].device, dtype=torch.bfloat16)
    gemm.m_grouped_fp8_gemm_nt_contiguous((inp["xq"], inp["xs"]), (inp["wq"], inp["ws"]), d,
                                          inp["psum"] if psum else inp["m_indices"], use_psum_layout=psum)
    return d.view(s.groups, s.rows, s.n)


def check_shape(s: Shape, inp: dict, kernels=("gluon", "tl"), runner=run_kernel) -> list:
    """Correctness rows of ``s`` for each kernel (``runner(s, inp, kernel[, psum])`` gives ``d``)."""
    import torch

    rows = []
    for kern in kernels:
        d = runner(s, inp, kern)
        row = {"shape": s.name, "kernel": kern, "check": "reference", **check_output(d, inp["xd"], inp["wd"])}
        rows.append(row)
        if s.layout == "contiguous":
            same = bool(torch.equal(runner(s, inp, kern, psum=True), d))
            rows.append({"shape": s.name, "kernel": kern, "check": "psum == m_indices bitwise", "ok": same})
    return rows


def _time_us(fn, iters: int, warmup: int) -> float:
    import torch

    flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")  # larger than the H200's L2
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def _timings(s: Shape, inp: dict, ok: dict, args) -> list:
    import torch

    from moe_ep.gemm.gluon import launch_gluon
    from moe_ep.kernels.grouped_gemm import CONTIG, MASKED

    rows = []

    def row(kind, us, **extra):
        r = {"shape": s.name, "kernel": kind, "us": round(us, 2), "tflops": round(s.flops / us / 1e6, 1), **extra}
        rows.append(r)
        return r

    for kern in ("gluon", "tl"):
        if ok.get(kern):
            row(kern, _time_us(lambda: run_kernel(s, inp, kern), args.iters, args.warmup))
    if ok.get("gluon"):  # the feed ceiling: same ring traffic, no MMA
        os.environ["MOE_EP_GEMM_KERNEL"] = "gluon"
        masked = s.layout == "masked"
        x3 = inp["xq"] if masked else inp["xq"].unsqueeze(0)
        s3 = inp["xs"] if masked else inp["xs"].unsqueeze(0)
        d = torch.empty(*x3.shape[:2], s.n, device="cuda", dtype=torch.bfloat16)
        lay = inp["masked_m"] if masked else inp["m_indices"]
        mode = MASKED.value if masked else CONTIG.value
        row("gluon loads-only", _time_us(lambda: launch_gluon(
            x3, s3, inp["wq"], inp["ws"], d, lay, mode, expected_m=s.rows, ue8m0=False, loads_only=True),
            args.iters, args.warmup))
    xb = inp["x_bf16"]
    wb = inp["wd"].to(torch.bfloat16)
    row("bf16 bmm", _time_us(lambda: torch.bmm(xb, wb.transpose(1, 2)), args.iters, args.warmup))
    wb = None  # free it before the next rows (the lambda above has run)
    try:  # the same recipe through cuBLASLt's blockwise kernels, one call per expert
        xq = inp["xq"].reshape(s.groups, s.rows, s.k)
        xs = inp["xs"].reshape(s.groups, s.rows, -1)

        def peer():
            for g in range(s.groups):
                torch._scaled_mm(xq[g], inp["wq"][g].t(), scale_a=xs[g], scale_b=inp["ws"][g].t(),
                                 out_dtype=torch.bfloat16)
        peer()
        row("scaled_mm blockwise", _time_us(peer, args.iters, args.warmup))
    except Exception as exc:  # noqa: BLE001 - a torch without the blockwise recipe: the row says so
        rows.append({"shape": s.name, "kernel": "scaled_mm blockwise", "skipped": f"{type(exc).__name__}: "
                     f"{str(exc).splitlines()[0][:160]}"})
    if s.decode:
        src = torch.empty(s.weight_bytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        copy_us = _time_us(lambda: dst.copy_(src), args.iters, args.warmup)
        floor_us = copy_us / 2  # copy moves the bytes twice (read + write); the GEMM reads them once
        for r in rows:
            if r.get("kernel") in ("gluon", "tl") and "us" in r:
                r["weight_read_floor_us"] = round(floor_us, 2)
                r["of_floor"] = round(floor_us / r["us"], 3)
    return rows


def _ceiling(args) -> dict:
    import torch

    a = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    us = _time_us(lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                           use_fast_accum=True), args.iters, args.warmup)
    return {"shape": "8192^3", "kernel": "scaled_mm fast-accum", "us": round(us, 2),
            "tflops": round(2 * 8192 ** 3 / us / 1e6, 1)}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        print(shape_table(args.shapes))
        return 0
    import torch

    if not torch.cuda.is_available():
        print(f"{PROG}: error: needs a CUDA GPU (none found); --list prints the shapes", file=sys.stderr)
        return 2
    from moe_ep.gemm.gluon import gemm_kernel_choice

    os.environ["MOE_EP_GEMM_KERNEL"] = "gluon"
    choice = gemm_kernel_choice(torch.device("cuda"))
    print(f"# {PROG}: {torch.cuda.get_device_name()}, torch {torch.__version__}, gluon choice: {choice}")
    out = open(args.json, "w") if args.json else None
    failed = []
    ceiling = _ceiling(args)
    print(json.dumps(ceiling))
    try:
        for name in args.shapes:
            s = SHAPES[name]
            inp = make_inputs(s, torch.device("cuda"))
            kernels = ("gluon", "tl") if choice[0] == "gluon" else ("tl",)
            checks = check_shape(s, inp, kernels)
            ok = {k: all(r["ok"] for r in checks if r["kernel"] == k) for k in kernels}
            failed += [f"{name} {r['kernel']} {r['check']}" for r in checks if not r["ok"]]
            rows = checks + _timings(s, inp, ok, args)
            for r in rows:
                if "tflops" in r:
                    r["of_scaled_mm"] = round(r["tflops"] / ceiling["tflops"], 3)
                line = json.dumps({"shape_def": asdict(s), **r} if out else r)
                print(json.dumps(r))
                if out:
                    out.write(line + "\n")
            del inp
            torch.cuda.empty_cache()
    finally:
        if out:
            out.close()
    if failed:
        print(f"{PROG}: NUMERICS FAILED: {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
