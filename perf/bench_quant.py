"""Benchmark of the FP8 quantization kernels against the torch baselines a user would pick instead.

Per (M, K), BF16 input, DeepGEMM's scale layout (float32, column-major, M padded to a multiple of 4):

- ``ours``: per_token_group_quant_fp8(x, tma_aligned_scales=True), one kernel.
- ``eager`` / ``compile``: moe_ep.fp8.per_token_group_quant_fp8_ref in eager torch / torch.compile
  (row-major scales: the wrong layout for the GEMM), and ``eager+T`` / ``compile+T``: the same
  followed by the separate scale transpose the GEMM needs (moe_ep.fp8.to_column_major).
- ``copy``: a device-to-device copy of the same byte count, measured in the same run (the bound).

GB/s counts bytes read plus written (x, FP8 out, scales). Times: triton.testing.do_bench median,
warm, inputs rotated over > 256 MB of buffers and L2 flushed between calls, so nothing is served
from L2. Small M is bound by Python launch overhead in that mode (what an eager caller sees);
``--graph`` times CUDA-graph replays instead (GPU time only; baselines that cannot be captured
show n/a). A second table does the same for silu_and_mul_quant_fp8 (input `[M, 2K]`); a third runs a
chain of two dependent kernels (a BF16 producer writing x, then the quant kernel reading it) with
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
SMOKE = dict(tokens=[1, 8], hidden=[256], rep=2, no_compile=True)
TOL = 1e-2  # max |dequant(ours) - dequant(ref)| / max |dequant(ref)|

ROTATE_BYTES = 256 << 20  # > L2 of H100/H200 (50-60 MB) several times over


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
    p.add_argument("--rep", type=int, default=50,
                   help="do_bench repetition time per measurement (ms); timed calls per measurement on CPU")
    p.add_argument("--graph", action="store_true",
                   help="time CUDA-graph replays (do_bench_cudagraph): GPU time without Python launch overhead")
    p.add_argument("--out", default=None, help="append the tables as markdown to this file")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        _common.smoke_defaults(args, p, argv, **SMOKE)
    if min(args.tokens) < 1:
        p.error(f"argument -m/--tokens: must be >= 1, got {min(args.tokens)}")
    if any(k < 128 or k % 128 for k in args.hidden):
        p.error(f"argument -k/--hidden: must be positive multiples of 128, got {args.hidden}")
    if args.rep < 1:
        p.error(f"argument --rep: must be >= 1, got {args.rep}")
    return args


class Rotating:
    """Call ``fn(*bufs[i])`` with i cycling over enough buffer sets to defeat L2 residency."""

    def __init__(self, make, bytes_per_set):
        n = max(2, min(64, ROTATE_BYTES // max(bytes_per_set, 1)))
        self.sets = [make(i) for i in range(n)]
        self.i = 0

    def __call__(self, fn):
        def run():
            self.i = (self.i + 1) % len(self.sets)
            return fn(*self.sets[self.i])
        return run


def _bench(fn, rep):
    """Timing (median, p10, p90 us, iterations)."""
    if SMOKE_RUN:
        return _common.time_us(fn, None, iters=rep)
    import triton.testing

    if GRAPH:
        ts = triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="all")
    else:
        ts = triton.testing.do_bench(fn, warmup=max(rep // 4, 10), rep=rep, return_mode="all")
    return _common.quantiles([t * 1e3 for t in ts])


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


def _try_bench(fn, rep):
    try:
        fn()
        return _bench(fn, rep).median
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

    header = ["M", "K", "ours us", "p10-p90 us", "GB/s", "% copy", "copy GB/s", "eager us", "compile us",
              "eager+T us", "compile+T us", "x compile+T", "x eager+T", "x best torch", "check"]
    what = "silu_and_mul_quant_fp8 (input [M, 2K])" if silu else "per_token_group_quant_fp8"
    table = Table(f"{what}, BF16 in, TMA-aligned column-major scales", header)
    for k in args.hidden:
        for m in args.tokens:
            width = 2 * k if silu else k
            in_bytes = m * width * 2
            out_bytes = m * k + 4 * m * (k // 128)
            total = in_bytes + out_bytes
            inputs = Rotating(lambda i, m=m, w=width: (torch.randn(m, w, device=dev, dtype=torch.bfloat16),),
                              in_bytes)
            half = max(total // 2, 1)
            copies = Rotating(lambda i, n=half: (torch.empty(n, dtype=torch.uint8, device=dev),
                                                 torch.empty(n, dtype=torch.uint8, device=dev)), 2 * half)

            def run_ours(x):
                return ours(x, tma_aligned_scales=True)

            timing = _bench(inputs(run_ours), args.rep)
            t_ours = timing.median
            t_copy = _bench(copies(lambda a, b: b.copy_(a)), args.rep).median
            t_eager = _try_bench(inputs(ref), args.rep)
            t_eager_t = _try_bench(inputs(ref_t), args.rep)
            t_comp = _try_bench(inputs(ref_c), args.rep) if ref_c else None
            t_comp_t = _try_bench(inputs(ref_c_t), args.rep) if ref_c else None
            err = _check(run_ours, ref, lambda m=m, w=width: torch.randn(m, w, device=dev, dtype=torch.bfloat16))
            valid = err <= TOL
            torch_times = [t for t in (t_eager, t_eager_t, t_comp, t_comp_t) if t is not None]
            gbs = total / t_ours / 1e3
            copy_gbs = 2 * half / t_copy / 1e3
            best = min(torch_times) if torch_times else None
            table.row([str(m), str(k), f"{t_ours:.1f}", f"{timing.p10:.1f}-{timing.p90:.1f}", f"{gbs:.0f}",
                       f"{100 * gbs / copy_gbs:.0f}%", f"{copy_gbs:.0f}", _fmt(t_eager), _fmt(t_comp), _fmt(t_eager_t),
                       _fmt(t_comp_t), _fmt(t_comp_t / t_ours if t_comp_t else None, ".2f"),
                       _fmt(t_eager_t / t_ours if t_eager_t else None, ".2f"),
                       _fmt(best / t_ours if best else None, ".2f"),
                       f"ok ({err:.1e})" if valid else f"INVALID ({err:.1e} > {TOL})"])
            case = f"{op_name} M={m} K={k}"
            rec.add(case, "time", t_ours, "us", p10=timing.p10, p90=timing.p90, iterations=timing.n, baseline=best,
                    ratio=best / t_ours if best else None, valid=valid, rel_err=err, eager_us=t_eager,
                    eager_t_us=t_eager_t, compile_us=t_comp, compile_t_us=t_comp_t)
            rec.add(case, "bandwidth", gbs, "GB/s", iterations=timing.n, limit=copy_gbs, ratio=gbs / copy_gbs,
                    valid=valid)
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
            bufs = Rotating(lambda i, n=n: (torch.randn(n, device=dev, dtype=torch.bfloat16),
                                            torch.empty(n, device=dev, dtype=torch.bfloat16)), 4 * n)

            def chain(src, dst, pdl, m=m, k=k, n=n):
                block = 4096
                kw = {"launch_pdl": True} if pdl else {}
                _producer[(triton.cdiv(n, block),)](src, dst, n, BLOCK=block, USE_PDL=pdl, **kw)
                return per_token_group_quant_fp8(dst.view(m, k), tma_aligned_scales=True, use_pdl=pdl)

            t_off = _bench(bufs(lambda s, d: chain(s, d, False)), args.rep)
            t_on = _bench(bufs(lambda s, d: chain(s, d, True)), args.rep).median if supported else None
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
            rec.add(f"pdl chain M={m} K={k}", "time", t_on if t_on else t_off.median, "us", p10=None if t_on else t_off.p10,
                    p90=None if t_on else t_off.p90, iterations=t_off.n, baseline=t_off.median,
                    ratio=t_off.median / t_on if t_on else None, valid=valid, rel_err=err, pdl=bool(t_on))
    return table.text


def main(argv=None) -> int:
    global SMOKE_RUN, GRAPH
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
    rec = _common.Records("bench_quant", args.json, args.cpu_smoke, device=name, argv=argv)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    head = (f"## bench_quant.py: {name}, {stamp}, commit {rec.header['commit']}, torch {torch.__version__}, "
            f"triton {triton.__version__}\n\n"
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
