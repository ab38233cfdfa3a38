"""Benchmark of the ``torch`` backend (all_to_all_single): dispatch/combine time and bandwidth.

Runs N local ranks: gloo on CPU, NCCL with one GPU per rank when enough GPUs exist. Bytes are
counted as DeepEP does (per rank: dispatch = selections x (H + H/32 + 16) for FP8, combine =
selections x 2H), and the table shows the same byte count moved by a local device copy
(``copy GB/s``) measured in the same run, the bound for anything that stays on one device.

    python perf/bench_torch_a2a.py                       # CPU defaults (small)
    python perf/bench_torch_a2a.py --device cuda --ranks 8 --tokens 128 512 4096
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--ranks", type=int, nargs="+", default=None, help="world sizes (CPU default 2 4; GPU: all GPUs)")
    p.add_argument("--tokens", type=int, nargs="+", default=None, help="tokens per rank (CPU default 64 256)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--iters", type=int, default=None, help="timed iterations (median reported)")
    p.add_argument("--timeout", type=float, default=600.0)
    return p.parse_args(argv)


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timeit(fn, dev, iters, group_barrier):
    fn()  # warm
    times = []
    for _ in range(iters):
        group_barrier()
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rank(rank, world, args):
    import torch.distributed as dist

    import moe_ep
    from moe_ep.fp8 import per_token_group_quant_fp8_ref

    dev = torch.device("cuda", rank % torch.cuda.device_count()) if args.device == "cuda" else torch.device("cpu")
    buf = moe_ep.Buffer(None, low_latency_mode=True, backend="torch", timeout_s=args.timeout)
    h, e, k = args.hidden, args.experts, args.topk
    rows = []
    for n in args.tokens:
        g = torch.Generator().manual_seed(rank * 7919 + n)
        x = torch.randn(n, h, generator=g).to(torch.bfloat16).to(dev)
        idx = torch.rand(n, e, generator=g).argsort(1)[:, :k].to(dev)
        w = torch.rand(n, k, generator=g).to(dev)
        q, s = per_token_group_quant_fp8_ref(x)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, e)
        sel = n * k

        def disp():
            return buf.dispatch((q, s), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)

        (rx, _), _, _, _, handle, _ = disp()
        y = torch.randn(rx.shape[0], h, generator=g).to(torch.bfloat16).to(dev)
        barrier = dist.barrier
        t_d = _timeit(disp, dev, args.iters, barrier)
        t_c = _timeit(lambda: buf.combine(y, handle), dev, args.iters, barrier)
        ll = buf.low_latency_dispatch(x, idx, n, e)
        yl = torch.zeros(ll[0][0].shape, dtype=torch.bfloat16, device=dev)
        t_ld = _timeit(lambda: buf.low_latency_dispatch(x, idx, n, e), dev, args.iters, barrier)
        t_lc = _timeit(lambda: buf.low_latency_combine(yl, idx, w, ll[2]), dev, args.iters, barrier)
        d_bytes, c_bytes = sel * (h + h // 32 + 16), sel * 2 * h
        src = torch.empty(d_bytes + c_bytes, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        t_copy = _timeit(lambda: dst.copy_(src), dev, args.iters, lambda: None)
        rows.append((n, d_bytes, c_bytes, t_d, t_c, t_ld, t_lc, (d_bytes + c_bytes) / t_copy))
    return rows


def main(argv=None):
    args = _parse(argv)
    if args.device == "auto":
        import shutil
        import subprocess
        n_gpu = 0
        if shutil.which("nvidia-smi"):
            r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
            n_gpu = r.stdout.count("GPU ") if r.returncode == 0 else 0
        args.device = "cuda" if n_gpu else "cpu"
        args._n_gpu = n_gpu
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.ranks = args.ranks or [2, 4]
        args.tokens = args.tokens or [64, 256]
        args.iters = args.iters or 5
    else:
        n_gpu = getattr(args, "_n_gpu", None) or int(os.environ.get("MOE_EP_NUM_GPUS", "1"))
        args.ranks = args.ranks or [n_gpu]
        args.tokens = args.tokens or [128, 512, 4096]
        args.iters = args.iters or 20
    from moe_ep.testing import launch

    backend = "nccl" if args.device == "cuda" else "gloo"
    print(f"torch backend ({backend}, {args.device}), hidden {args.hidden}, {args.experts} experts, top-{args.topk}; "
          f"per-rank bytes counted as DeepEP; median of {args.iters}")
    print(f"{'ranks':>5} {'tokens':>6} | {'dispatch us':>11} {'GB/s':>7} | {'combine us':>10} {'GB/s':>7} | "
          f"{'LL disp us':>10} {'GB/s':>7} | {'LL comb us':>10} {'GB/s':>7} | {'copy GB/s':>9}")
    for world in args.ranks:
        res = launch(_rank, world, args, timeout_s=args.timeout, backend=backend)
        for i, n in enumerate(args.tokens):
            # the slowest rank sets the pace
            n_, d_b, c_b, t_d, t_c, t_ld, t_lc, copy_bw = (max(r[i][j] for r in res) if j >= 3 else res[0][i][j]
                                                            for j in range(8))
            copy_bw = min(r[i][7] for r in res)
            print(f"{world:>5} {n:>6} | {t_d * 1e6:>11.0f} {d_b / t_d / 1e9:>7.2f} | {t_c * 1e6:>10.0f} "
                  f"{c_b / t_c / 1e9:>7.2f} | {t_ld * 1e6:>10.0f} {d_b / t_ld / 1e9:>7.2f} | {t_lc * 1e6:>10.0f} "
                  f"{c_b / t_lc / 1e9:>7.2f} | {copy_bw / 1e9:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
