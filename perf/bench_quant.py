"""Benchmark of the FP8 quantization kernels against the torch baselines a user would pick instead.

Per (M, K), BF16 input, DeepGEMM's scale layout (float32, column-major, M padded to a multiple of 4):

- ``ours``: per_token_group_quant_fp8(x, tma_aligned_scales=True), one kernel.
- ``x*(1/s)``: the same kernel with ``x * (1 / scale)`` for ``x / scale`` (``reciprocal_multiply_quant_fp8``:
  sgl-kernel's and vLLM's arithmetic, not bitwise): beside ``ours``, the price of the exact quotient.
- ``eager`` / ``compile``: moe_ep.fp8.per_token_group_quant_fp8_ref in eager torch / torch.compile
  (row-major scales: the wrong layout for the GEMM), and ``eager+T`` / ``compile+T``: the same
  followed by the separate scale transpose the GEMM needs (moe_ep.fp8.to_column_major).
- ``copy``: the copy limit of each row, measured by the row's own method on the row's bytes (a graph of
  ``copy_`` calls moving the same bytes read + written): ``% copy`` = copy time / ours.

``ours`` is timed by perf/_method.py's ``measure`` (the row's ``method``): ``graph-rotating`` (one CUDA
graph of N back-to-back calls over >= 3 rotating input sets totalling > 2x L2, every call's output its own
buffer; time / N) when the rotation needs at most 256 sets, else ``graph-single`` (a graph of one call
replayed after a read-only L2 flush: the decode latency). ``ours eager us`` is the same call eagerly, CUDA
events around it after a read-only flush, host Python and launch included (``eager-host``: what an engine
that does not capture pays). The torch baselines are timed ``eager-host`` (``--graph``: graph replays,
``graph-single``; those that cannot be captured say so in the row's ``note``). GB/s counts bytes read plus
written (x, FP8 out, scales). A second table does the same for silu_and_mul_quant_fp8 (input `[M, 2K]`); a
third runs a chain of two dependent kernels (a BF16 producer writing x, then the quant kernel reading it) with
and without programmatic dependent launch (PDL).

    python perf/bench_quant.py                                  # full table (needs a CUDA GPU)
    python perf/bench_quant.py --graph                          # the same, CUDA-graph replays
    python perf/bench_quant.py -m 4096 16384 -k 7168 --out perf/RESULTS.md
"""

from __future__ import annotations

import datetime
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

_common.smoke_env()  # TRITON_INTERPRET=1 before any @triton.jit below or in moe_ep

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

PROG = "bench_quant.py"
SMOKE = dict(tokens=[1, 8], hidden=[256], iters=2, no_compile=True)
TOL = 1e-2  # max |dequant(ours) - dequant(ref)| / max |dequant(ref)|


@triton.jit
def _producer(src, dst, n, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    # The previous kernel of the PDL chain: writes the activations the quant kernel then reads.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    v = tl.load(src + offs, mask=offs < n)
    tl.store(dst + offs, (v.to(tl.float32) * 2.0).to(dst.dtype.element_ty), mask=offs < n)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


def _parse(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = _common.parser(PROG, __doc__, "run the CPU variant: Triton interpreter, wall-clock timing, -m 1 8 -k 256, "
                                      "no torch.compile, unless given explicitly (numbers meaningless)")
    p.add_argument("-m", "--tokens", type=int, nargs="+", default=[1, 64, 128, 512, 4096, 16384], help="M values")
    p.add_argument("-k", "--hidden", type=int, nargs="+", default=[2048, 4096, 7168],
                   help="K values (multiples of 128)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baselines")
    p.add_argument("--no-silu", action="store_true", help="skip the fused SiLU-and-mul table")
    p.add_argument("--no-pdl", action="store_true", help="skip the PDL chain table")
    p.add_argument("--iters", type=int, default=50,
                   help="timed calls per eager / single-call measurement (median, p10, p90)")
    p.add_argument("--graph", action="store_true",
                   help="time the torch baselines and the PDL chain as CUDA-graph replays (ours is always graph-timed)")
    p.add_argument("--out", default=None, help="append the tables as markdown to this file")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        _common.smoke_defaults(args, p, argv, **SMOKE)
    if min(args.tokens) < 1:
        p.error(f"argument -m/--tokens: must be >= 1, got {min(args.tokens)}")
    if any(k < 128 or k % 128 for k in args.hidden):
        p.error(f"argument -k/--hidden: must be positive multiples of 128, got {args.hidden}")
    if args.iters < 1:
        p.error(f"argument --iters: must be >= 1, got {args.iters}")
    return args


def _bench(fn, iters):
    """Timing (median, p10, p90 us, iterations) by perf/_common.py's ``time_us`` (CUDA events, L2 flushed before
    each timed call; CPU: perf_counter). ``--graph``: ``fn`` captured once in a CUDA graph and its replays timed;
    when capture fails the eager calls are timed and ``_bench.how`` says why."""
    dev = DEV if (DEV is not None and DEV.type == "cuda") else None
    _bench.how = "eager launches" if dev is not None else "CPU"
    if dev is not None and GRAPH:
        replay, _, note = _common.graph_fn(fn, dev)
        _bench.how = note or "CUDA graph replay"
        fn = replay
    return _common.time_us(fn, dev, iters=iters, warmup=0 if SMOKE_RUN else 3)


_bench.how = None
DEV = None
SMOKE_RUN = False
GRAPH = False


def _compile(fn):
    # torch.compile's defaults, as a user gets them: static first, dynamic shapes after the first
    # recompile (so a sweep over M costs a few compiles, not one per shape).
    cfg = torch._dynamo.config
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 64))
    return torch.compile(fn)


def _fmt(v, spec=".1f"):
    return "n/a" if v is None else format(v, spec)


def _try_bench(fn, iters):
    try:
        fn()
        return _bench(fn, iters).median
    except Exception as exc:  # noqa: BLE001 - a failing baseline (e.g. torch.compile) must not stop the table
        print(f"  baseline failed: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
        return None


class Table:
    """Prints the title and header at once, then each row as it is measured (stdout); ``text`` for --out."""

    def __init__(self, title, header):
        self.lines = [f"### {title}", "", _common.table_header(header)]
        print("\n" + "\n".join(self.lines), flush=True)

    def row(self, cells):
        line = "| " + " | ".join(cells) + " |"
        self.lines.append(line)
        print(line, flush=True)

    @property
    def text(self):
        return "\n".join(self.lines) + "\n"


def _check(ours_fn, ref_fn, make_x):
    """max |dequant(ours(x)) - dequant(ref(x))| / max |dequant(ref(x))| on a fresh input of the timed shape."""
    from moe_ep.fp8 import dequant_fp8_ref

    x = make_x()
    return _common.rel_err(dequant_fp8_ref(*ours_fn(x)), dequant_fp8_ref(*ref_fn(x)))


def _quant_rows(args, op_name, dev, rec):
    from moe_ep.fp8 import per_token_group_quant_fp8_ref, to_column_major
    from moe_ep.quant import (
        per_token_group_quant_fp8,
        reciprocal_multiply_quant_fp8,
        silu_and_mul_fp32,
        silu_and_mul_quant_fp8,
    )

    silu = op_name == "silu"
    ours = silu_and_mul_quant_fp8 if silu else per_token_group_quant_fp8

    def ref(x):
        return per_token_group_quant_fp8_ref(silu_and_mul_fp32(x) if silu else x)

    def ref_t(x):
        q, s = ref(x)
        return q, to_column_major(s, tma_aligned=True)

    ref_c = _compile(ref) if not args.no_compile else None
    # fairness: the column-major scale transpose is part of the compiled region (one graph, fusable), not an
    # eager op after it
    ref_c_t = _compile(ref_t) if not args.no_compile else None

    resident = None if dev.type != "cuda" else False  # rotated out of L2 / flushed before every timed call
    header = ["M", "K", "ours us", "p10-p90 us", "GB/s", "copy us", "% copy", "method", "ours eager us", "x*(1/s) us",
              "eager us", "compile us", "eager+T us", "compile+T us", "x compile+T", "x eager+T", "x best torch",
              "baselines timed as", "check"]
    what = "silu_and_mul_quant_fp8 (input [M, 2K])" if silu else "per_token_group_quant_fp8"
    table = Table(f"{what}, BF16 in, TMA-aligned column-major scales; % copy: the copy of the same bytes by the "
                  f"same method (copy us) / ours", header)
    for k in args.hidden:
        for m in args.tokens:
            width = 2 * k if silu else k
            in_bytes = m * width * 2
            out_bytes = m * k + 4 * m * (k // 128)
            total = in_bytes + out_bytes
            x = torch.randn(m, width, device=dev, dtype=torch.bfloat16)

            def run_ours(x=x):
                return ours(x, tma_aligned_scales=True)

            def make_set(i, m=m, width=width):
                xi = torch.randn(m, width, device=dev, dtype=torch.bfloat16)
                return lambda: ours(xi, tma_aligned_scales=True)

            meas = _common.measure(make_set, total, dev, iters=args.iters, n=3 if SMOKE_RUN else 20,
                                   replays=1 if SMOKE_RUN else 5)
            t_ours = meas["us"]
            t_ours_eager = _common.time_us(run_ours, dev if dev.type == "cuda" else None, iters=args.iters,
                                           warmup=0 if SMOKE_RUN else 3).median
            # the same kernel with x * (1 / scale) (sgl-kernel's / vLLM's arithmetic, not bitwise), by the same
            # method: what the IEEE quotient costs
            def make_recip(i, m=m, width=width):
                xi = torch.randn(m, width, device=dev, dtype=torch.bfloat16)
                return lambda: reciprocal_multiply_quant_fp8(xi, silu=silu, tma_aligned_scales=True)

            try:
                t_recip = _common.measure(make_recip, total, dev, iters=args.iters, n=3 if SMOKE_RUN else 20,
                                          replays=1 if SMOKE_RUN else 5)["us"]
            except Exception:  # noqa: BLE001 - a bench column, not a check
                t_recip = None
            _bench.how = None
            t_eager = _try_bench(lambda x=x: ref(x), args.iters)
            t_eager_t = _try_bench(lambda x=x: ref_t(x), args.iters)
            t_comp = _try_bench(lambda x=x: ref_c(x), args.iters) if ref_c else None
            t_comp_t = _try_bench(lambda x=x: ref_c_t(x), args.iters) if ref_c else None
            how = _bench.how
            err = _check(lambda x: ours(x, tma_aligned_scales=True), ref,
                         lambda m=m, w=width: torch.randn(m, w, device=dev, dtype=torch.bfloat16))
            valid = err <= TOL
            torch_times = [t for t in (t_eager, t_eager_t, t_comp, t_comp_t) if t is not None]
            gbs = meas["GBps"]
            best = min(torch_times) if torch_times else None
            fits = _common.fits_l2(total, dev)
            note = f"{meas['method_detail']}; baselines timed as {how}"
            table.row([str(m), str(k), f"{t_ours:.1f}", f"{meas['p10']:.1f}-{meas['p90']:.1f}", f"{gbs:.0f}",
                       f"{meas['limit_us']:.1f}", f"{100 * meas['ratio']:.0f}%", meas["method"],
                       f"{t_ours_eager:.1f}", _fmt(t_recip), _fmt(t_eager), _fmt(t_comp),
                       _fmt(t_eager_t), _fmt(t_comp_t), _fmt(t_comp_t / t_ours if t_comp_t else None, ".2f"),
                       _fmt(t_eager_t / t_ours if t_eager_t else None, ".2f"),
                       _fmt(best / t_ours if best else None, ".2f"), how,
                       f"ok ({err:.1e})" if valid else f"INVALID ({err:.1e} > {TOL})"])
            case = f"{op_name} M={m} K={k}"
            plan = {k: meas.get(k) for k in ("sets", "n", "set_bytes", "total_bytes", "l2_bytes", "flush",
                                             "flush_bytes") if k in meas}
            rec.add(case, "time", t_ours, "us", p10=meas["p10"], p90=meas["p90"], iterations=meas["iterations"],
                    baseline=best, ratio=best / t_ours if best else None, valid=valid, l2_resident=resident, note=note,
                    rel_err=err, method=meas["method"], ours_eager_us=t_ours_eager, recip_multiply_us=t_recip, eager_us=t_eager,
                    eager_t_us=t_eager_t, compile_us=t_comp, compile_t_us=t_comp_t, bytes=total,
                    baseline_method=_common.how_method(how), timed_as=meas["method_detail"], **plan)
            rec.add(case, "bandwidth", gbs, "GB/s", p10=total / meas["p90"] / 1e3, p90=total / meas["p10"] / 1e3,
                    iterations=meas["iterations"], limit=meas["limit_GBps"], ratio=meas["ratio"], valid=valid,
                    l2_resident=resident, note=note, method=meas["method"], limit_us=meas["limit_us"],
                    limit_name="copy_ of the same bytes, same method", bytes=total, fits_l2=fits, **plan)
    return table.text


def _pdl_rows(args, dev, rec):
    from moe_ep.fp8 import per_token_group_quant_fp8_ref
    from moe_ep.kernels.pdl import pdl_supported
    from moe_ep.quant import per_token_group_quant_fp8

    supported = pdl_supported(dev)
    if not supported and not SMOKE_RUN:
        text = "### PDL chain\n\nPDL not supported here (needs sm90+ and Triton >= 3.4).\n"
        print("\n" + text, flush=True)
        return text
    table = Table("PDL: producer -> per_token_group_quant_fp8 chain",
                  ["M", "K", "no PDL us", "p10-p90 us", "PDL us", "speedup", "check"])
    for k in args.hidden:
        for m in args.tokens:
            n = m * k
            src0 = torch.randn(n, device=dev, dtype=torch.bfloat16)
            dst0 = torch.empty(n, device=dev, dtype=torch.bfloat16)

            def chain(src, dst, pdl, m=m, k=k, n=n):
                block = 4096
                kw = {"launch_pdl": True} if pdl else {}
                _producer[(triton.cdiv(n, block),)](src, dst, n, BLOCK=block, USE_PDL=pdl, **kw)
                return per_token_group_quant_fp8(dst.view(m, k), tma_aligned_scales=True, use_pdl=pdl)

            t_off = _bench(lambda: chain(src0, dst0, False), args.iters)
            t_on_t = _bench(lambda: chain(src0, dst0, True), args.iters) if supported else None
            t_on = t_on_t.median if t_on_t else None
            errs = []
            for pdl in ([False, True] if supported else [False]):
                src = torch.randn(n, device=dev, dtype=torch.bfloat16)
                dst = torch.empty(n, device=dev, dtype=torch.bfloat16)
                errs.append(_check(lambda x, pdl=pdl: chain(src, dst, pdl), lambda x: per_token_group_quant_fp8_ref(
                    (src.float() * 2.0).to(torch.bfloat16).view(m, k)), lambda: None))
            err = max(errs)
            valid = err <= TOL
            table.row([str(m), str(k), f"{t_off.median:.1f}", f"{t_off.p10:.1f}-{t_off.p90:.1f}", _fmt(t_on),
                       _fmt(t_off.median / t_on if t_on else None, ".2f"),
                       f"ok ({err:.1e})" if valid else f"INVALID ({err:.1e} > {TOL})"])
            t_row = t_on_t or t_off
            rec.add(f"pdl chain M={m} K={k}", "time", t_row.median, "us", p10=t_row.p10, p90=t_row.p90,
                    iterations=t_row.n, baseline=t_off.median, ratio=t_off.median / t_on if t_on else None,
                    valid=valid, l2_resident=None if dev.type != "cuda" else False,
                    note=f"timed as {_bench.how}; baseline: the same chain without PDL", rel_err=err, pdl=bool(t_on),
                    method=_common.how_method(_bench.how))
    return table.text


LIMITS: dict = {}


def main(argv=None) -> int:
    global SMOKE_RUN, GRAPH, DEV, LIMITS
    args = _parse(argv)
    GRAPH = args.graph
    if args.cpu_smoke:
        SMOKE_RUN = True
        dev, name = torch.device("cpu"), "CPU smoke run (Triton interpreter, numbers meaningless)"
    elif not _common.gpu_count() or not torch.cuda.is_available():
        return _common.no_gpu(PROG)
    else:
        dev = torch.device("cuda", torch.cuda.current_device())
        name = torch.cuda.get_device_name(dev)
    DEV = dev
    rec = _common.Records("bench_quant", args.json, args.cpu_smoke, device=name, argv=argv)
    LIMITS = _common.measure_limits(dev, peer=False, fp8=False)
    rec.update_header(limits=LIMITS, timing="ours: graph-rotating (graph-single for small calls), copy limit by the "
                      "same method on the same bytes; baselines: " + ("graph-single" if GRAPH else "eager-host")
                      if dev.type == "cuda" else "CPU perf_counter")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    head = (f"## bench_quant.py: {name}, {stamp}, commit {rec.header['commit']}, torch {torch.__version__}, "
            f"triton {triton.__version__}; 1 GiB device copy "
            f"{LIMITS['copy_gbps']:.0f} GB/s (measured now; each row's limit is its own copy)\n\n"
            f"`python perf/bench_quant.py {' '.join(sys.argv[1:] if argv is None else argv)}`\n")
    print(head, flush=True)
    parts = [head, _quant_rows(args, "quant", dev, rec)]
    if not args.no_silu:
        parts.append(_quant_rows(args, "silu", dev, rec))
    if not args.no_pdl:
        parts.append(_pdl_rows(args, dev, rec))
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(parts) + "\n")
    return rec.finish(PROG)


if __name__ == "__main__":
    sys.exit(main())
