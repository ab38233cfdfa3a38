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

import argparse
import datetime
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
if "--cpu-smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before any @triton.jit below or in moe_ep

import torch
import triton
import triton.language as tl

ROTATE_BYTES = 256 << 20  # > L2 of H100/H200 (50-60 MB) several times over


@triton.jit
def _producer(src, dst, n, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    # The previous kernel of the PDL chain: writes the activations the quant kernel then reads.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    v = tl.load(src + offs, mask=offs < n)
    tl.store(dst + offs, v * 2.0, mask=offs < n)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--tokens", type=int, nargs="+", default=[1, 64, 128, 512, 4096, 16384], help="M values")
    p.add_argument("-k", "--hidden", type=int, nargs="+", default=[2048, 4096, 7168], help="K values")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baselines")
    p.add_argument("--no-silu", action="store_true", help="skip the fused SiLU-and-mul table")
    p.add_argument("--no-pdl", action="store_true", help="skip the PDL chain table")
    p.add_argument("--rep", type=int, default=50, help="do_bench repetition time per measurement (ms)")
    p.add_argument("--graph", action="store_true",
                   help="time CUDA-graph replays (do_bench_cudagraph): GPU time without Python launch overhead")
    p.add_argument("--out", default=None, help="append the tables as markdown to this file")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="exercise every code path on CPU under the Triton interpreter with wall-clock timing "
                        "(numbers meaningless; use tiny -m/-k)")
    return p.parse_args(argv)


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
    if SMOKE:
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    import triton.testing

    if GRAPH:
        return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e3  # us
    return triton.testing.do_bench(fn, warmup=max(rep // 4, 10), rep=rep, return_mode="median") * 1e3  # us


SMOKE = False
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
        return _bench(fn, rep)
    except Exception as exc:  # noqa: BLE001 - a failing baseline (e.g. torch.compile) must not stop the table
        print(f"  baseline failed: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
        return None


def _table(title, header, rows):
    lines = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _quant_rows(args, op_name, dev):
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

    def ref_c_t(x):
        q, s = ref_c(x)
        return q, to_column_major(s, tma_aligned=True)

    rows = []
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

            t_ours = _bench(inputs(lambda x: ours(x, tma_aligned_scales=True)), args.rep)
            t_copy = _bench(copies(lambda a, b: b.copy_(a)), args.rep)
            t_eager = _try_bench(inputs(ref), args.rep)
            t_eager_t = _try_bench(inputs(ref_t), args.rep)
            t_comp = _try_bench(inputs(ref_c), args.rep) if ref_c else None
            t_comp_t = _try_bench(inputs(ref_c_t), args.rep) if ref_c else None
            torch_times = [t for t in (t_eager, t_eager_t, t_comp, t_comp_t) if t is not None]
            gbs = total / t_ours / 1e3
            copy_gbs = 2 * half / t_copy / 1e3
            rows.append([str(m), str(k), f"{t_ours:.1f}", f"{gbs:.0f}", f"{100 * gbs / copy_gbs:.0f}%",
                         f"{copy_gbs:.0f}", _fmt(t_eager), _fmt(t_comp), _fmt(t_eager_t), _fmt(t_comp_t),
                         _fmt(t_comp_t / t_ours if t_comp_t else None, ".2f"),
                         _fmt(t_eager_t / t_ours if t_eager_t else None, ".2f"),
                         _fmt(min(torch_times) / t_ours if torch_times else None, ".2f")])
            print("  " + " | ".join(rows[-1]), file=sys.stderr, flush=True)
    header = ["M", "K", "ours us", "GB/s", "% copy", "copy GB/s", "eager us", "compile us", "eager+T us",
              "compile+T us", "x compile+T", "x eager+T", "x best torch"]
    what = "silu_and_mul_quant_fp8 (input [M, 2K])" if silu else "per_token_group_quant_fp8"
    return _table(f"{what}, BF16 in, TMA-aligned column-major scales", header, rows)


def _pdl_rows(args, dev):
    from moe_ep.kernels.pdl import pdl_supported
    from moe_ep.quant import per_token_group_quant_fp8

    supported = pdl_supported(dev)
    if not supported and not SMOKE:
        return "### PDL chain\n\nPDL not supported here (needs sm90+ and Triton >= 3.4).\n"
    rows = []
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
            t_on = _bench(bufs(lambda s, d: chain(s, d, True)), args.rep) if supported else None
            rows.append([str(m), str(k), f"{t_off:.1f}", _fmt(t_on), _fmt(t_off / t_on if t_on else None, ".2f")])
            print("  " + " | ".join(rows[-1]), file=sys.stderr, flush=True)
    return _table("PDL: producer -> per_token_group_quant_fp8 chain", ["M", "K", "no PDL us", "PDL us", "speedup"],
                  rows)


def main(argv=None) -> int:
    global SMOKE, GRAPH
    args = _parse(argv)
    GRAPH = args.graph
    if args.cpu_smoke:
        SMOKE = True
        dev, name = torch.device("cpu"), "CPU smoke run (Triton interpreter, numbers meaningless)"
        args.no_compile = True
    elif not torch.cuda.is_available():
        print("bench_quant.py needs a CUDA GPU (the kernels are only timed compiled); none found. "
              "Use --cpu-smoke to check the script itself.", file=sys.stderr)
        return 2
    else:
        dev = torch.device("cuda", torch.cuda.current_device())
        name = torch.cuda.get_device_name(dev)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    head = (f"## bench_quant.py: {name}, {stamp}, torch {torch.__version__}, triton {triton.__version__}\n\n"
            f"`python perf/bench_quant.py {' '.join(sys.argv[1:] if argv is None else argv)}`\n")
    parts = [head, _quant_rows(args, "quant", dev)]
    if not args.no_silu:
        parts.append(_quant_rows(args, "silu", dev))
    if not args.no_pdl:
        parts.append(_pdl_rows(args, dev))
    text = "\n".join(parts)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
