"""Benchmark of the ``symm`` backend's dispatch (and, with ``--op combine``, combine) on one device.

All ranks are *virtual ranks* in this process (``moe_ep.backends.symm.virtual_backends``): one
allocation sliced ``R`` ways, every rank's send launch then every rank's receive launch. They share
one HBM, so the physical limit is the device's copy bandwidth, measured in the same run.

Rows, per EP size ``R`` (DeepSeek-V3 shapes by default: hidden 7168, 256 experts, top-8):

- ``LL``: low-latency mode, ``T`` tokens per rank (default 128), FP8 cast fused into the send;
- ``normal``: normal mode, ``N`` tokens per rank (default 4096), FP8 payload, ``num_worst_tokens``
  set so no call reads device data on the host (only when the normal path is installed);
- ``torch``: the same bytes moved by torch ops in one process (quantize with the torch reference, then
  ``index_select`` into the receive layout; combine: ``index_select`` + weighted sum): what the
  ``torch`` backend costs without its collective, a lower bound for it on one device.

Bytes are counted as DeepEP's tests do. Low-latency rows: selections x (H + H/32 + 16) for dispatch,
selections x 2H for combine. Normal rows move each token once per destination rank, so (like DeepEP's
intranode test) they count received rows, i.e. token-rank pairs: rows x (H + H/32) for the FP8 dispatch,
rows x 2H for combine (counting selections there would overstate the bytes by the top-k duplication,
about 4x at EP2 and 1.5x at EP8 for top-8 of 256 experts). Summed over ranks; times are for all ``R``
ranks (one GPU plays every rank), CUDA-graph replays (kernel time without Python launch overhead),
median of ``triton.testing.do_bench`` with L2 flushed.
The memory tables compare the buffer bytes per rank with DeepEP's for the same shapes: low-latency
(DeepSeek-V3 decode, T=128) and normal (``--normal-tokens`` per rank; DeepEP's NVL size hint with its
default 20 SMs = 10 channels and 256-token receive queues, BF16 hidden bytes).

    python perf/bench_dispatch.py                 # needs a CUDA GPU
    python perf/bench_dispatch.py --op combine    # what perf/bench_combine.py runs
    python perf/bench_dispatch.py --cpu-smoke     # every code path on CPU (interpreter), tiny shapes
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
if "--cpu-smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before any @triton.jit in moe_ep

import torch


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", choices=["dispatch", "combine"], default="dispatch")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--ll-tokens", type=int, default=128, help="T: tokens per rank in low-latency mode")
    p.add_argument("--normal-tokens", type=int, default=4096, help="tokens per rank in normal mode")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time (ms)")
    p.add_argument("--no-graph", action="store_true", help="time eager launches instead of CUDA-graph replays")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU under the interpreter (numbers meaningless)")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.ranks, args.hidden, args.experts, args.topk = [2, 4], 256, 16, 4
        args.ll_tokens, args.normal_tokens = 4, 8
    return args


def _inputs(R, n, H, E, K, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    xs, idxs, ws = [], [], []
    for _ in range(R):
        xs.append(torch.randn(n, H, generator=g).to(torch.bfloat16).to(device))
        idxs.append(torch.rand(n, E, generator=g).argsort(dim=1)[:, :K].contiguous().to(device))
        ws.append(torch.rand(n, K, generator=g).to(device))
    return xs, idxs, ws


def _timer(device, rep, graph):
    """``time_us(fn)``: median microseconds of ``fn`` (CUDA-graph replays on a GPU unless disabled)."""
    if device.type != "cuda":
        def time_us(fn):
            fn()
            best = []
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                best.append(time.perf_counter() - t0)
            return sorted(best)[1] * 1e6
        return time_us
    import triton

    def time_us(fn):
        fn()
        torch.cuda.synchronize()
        if graph:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            return triton.testing.do_bench(g.replay, rep=rep, return_mode="median") * 1e3
        return triton.testing.do_bench(fn, rep=rep, return_mode="median") * 1e3
    return time_us


def _copy_gbps(device, time_us):
    n = (1 << 30) if device.type == "cuda" else (1 << 24)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return n / time_us(lambda: dst.copy_(src)) / 1e3


def _torch_baseline(op, xs, idxs, ws, E, per_token_rank=False):
    """One-process torch equivalent: quantize, then gather every rank's received rows (dispatch), or
    gather every selection's row and reduce it with its weight (combine). ``per_token_rank``: one row
    per (token, rank) pair (normal mode) instead of one per selection (low-latency mode)."""
    from moe_ep.fp8 import per_token_group_quant_fp8_ref

    R = len(xs)
    L = E // R
    H = xs[0].shape[1]
    allx = torch.cat(xs)
    alli = torch.cat(idxs)
    n = xs[0].shape[0]
    sel = alli.flatten()
    src_row = torch.arange(allx.shape[0], device=allx.device).repeat_interleave(alli.shape[1])
    per_rank = [src_row[(sel // L) == r] for r in range(R)]  # received rows of rank r (per selection)
    if per_token_rank:  # normal mode: a token's row travels once to each rank (sorted, unique source rows)
        per_rank = [torch.unique(rows) for rows in per_rank]
    if op == "dispatch":
        def run():
            q, s = per_token_group_quant_fp8_ref(allx, 128)
            return [(q.index_select(0, rows), s.index_select(0, rows)) for rows in per_rank]
        return run
    ys = [torch.randn(rows.numel(), H, device=allx.device).to(torch.bfloat16) for rows in per_rank]
    if per_token_rank:  # normal combine: unweighted sum of the returned rows per source token
        def run_normal():
            out = torch.zeros(R * n, H, dtype=torch.float32, device=allx.device)
            for y, rows in zip(ys, per_rank):
                out.index_add_(0, rows, y.float())
            return out.to(torch.bfloat16)
        return run_normal
    w = torch.cat(ws).flatten()
    order = torch.cat([torch.nonzero((sel // L) == r).flatten() for r in range(R)])

    def run():
        y = torch.cat(ys).float() * w[order].unsqueeze(1)
        out = torch.zeros(R * n, H, dtype=torch.float32, device=allx.device)
        out.index_add_(0, src_row[order], y)
        return out.to(torch.bfloat16)
    return run


def _ll_case(op, R, args, device, time_us):
    from moe_ep.backends.symm import SymmBackend, virtual_backends

    T, H, E, K = args.ll_tokens, args.hidden, args.experts, args.topk
    xs, idxs, ws = _inputs(R, T, H, E, K, device)
    bs = virtual_backends(R, num_nvl_bytes=0, num_rdma_bytes=SymmBackend.get_low_latency_size_hint(T, H, R, E, K),
                          low_latency_mode=True, device=device, timeout_s=60)

    def dispatch():
        st = [b.low_latency_dispatch_send(x, i, T, E, use_fp8=True) for b, x, i in zip(bs, xs, idxs)]
        return [b.low_latency_dispatch_recv(s) for b, s in zip(bs, st)]

    if op == "dispatch":
        return time_us(dispatch), R * T * K
    res = dispatch()
    ys = [r.recv_x[0].to(torch.bfloat16) if isinstance(r.recv_x, tuple) else r.recv_x.to(torch.bfloat16) for r in res]
    outs = [torch.empty(T, H, dtype=torch.bfloat16, device=device) for _ in range(R)]

    def combine():
        st = [b.low_latency_combine_send(y, i, w, r.handle, out=o) for b, y, i, w, r, o in zip(bs, ys, idxs, ws, res, outs)]
        return [b.low_latency_combine_recv(s) for b, s in zip(bs, st)]

    return time_us(combine), R * T * K


def _normal_case(op, R, args, device, time_us):
    from moe_ep.backends.symm import SymmBackend, virtual_backends
    from moe_ep.fp8 import per_token_group_quant_fp8_ref

    N, H, E, K = args.normal_tokens, args.hidden, args.experts, args.topk
    xs, idxs, ws = _inputs(R, N, H, E, K, device, seed=1)
    qs = [per_token_group_quant_fp8_ref(x, 128) for x in xs]
    bs = virtual_backends(R, num_nvl_bytes=SymmBackend.get_normal_size_hint(N, H, K, R), device=device, timeout_s=60)
    layouts = [b.get_dispatch_layout(i, E) for b, i in zip(bs, idxs)]
    worst = R * N

    def dispatch():
        st = [b.dispatch_send(q, s, handle=None, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3],
                              num_tokens_per_expert=lay[2], topk_idx=i, topk_weights=w, num_experts=E)
              for b, (q, s), i, w, lay in zip(bs, qs, idxs, ws, layouts)]
        return [b.dispatch_recv(s, expert_alignment=1, num_worst_tokens=worst) for b, s in zip(bs, st)]

    rows = sum(int(lay[0].sum()) for lay in layouts)  # token-rank pairs: the rows that travel (setup, not timed)
    if op == "dispatch":
        return time_us(dispatch), rows
    res = dispatch()
    ys = [torch.randn(worst, H, device=device).to(torch.bfloat16) for _ in res]

    def combine():
        st = [b.combine_send(y, r.handle, None) for b, y, r in zip(bs, ys, res)]
        return [b.combine_recv(s, ()) for b, s in zip(bs, st)]

    return time_us(combine), rows


def deepep_normal_nvl_bytes(hidden: int, num_ranks: int, num_sms: int = 20, num_recv_tokens: int = 256) -> int:
    """DeepEP's intranode ``Config.get_nvl_buffer_size_hint`` (BF16 hidden bytes, its top-k/scale maxima of
    128, 8-byte source metadata), restated here for the memory comparison."""
    channels, per_token = num_sms // 2, 2 * hidden + 8 + 128 * 8 + 128 * 4 + 128 * 4
    nbytes = channels * num_ranks * (2 + 3) * 4 + channels * num_ranks * num_recv_tokens * per_token
    return (nbytes + 127) // 128 * 128


def main(argv=None) -> int:
    args = _parse(argv)
    if args.cpu_smoke:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        print("bench_dispatch: no CUDA GPU (use --cpu-smoke to exercise the code on CPU)")
        return 0
    time_us = _timer(device, args.rep, graph=not args.no_graph)
    copy = _copy_gbps(device, time_us)
    H = args.hidden
    per_row = {"LL": H + H // 32 + 16 if args.op == "dispatch" else 2 * H,  # per selection
               "normal": H + H // 32 if args.op == "dispatch" else 2 * H}  # per token-rank row
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (interpreter)"
    print(f"# symm {args.op}, virtual ranks on {name}, {datetime.date.today()}; hidden {H}, {args.experts} experts, "
          f"top-{args.topk}; copy bandwidth {copy:.0f} GB/s; times for all ranks together")
    print("| mode | EP | tokens/rank | rows moved | us | us/rank | GB/s | % of copy | torch us | x torch |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    try:
        import moe_ep.backends.symm_normal  # noqa: F401
        modes = [("LL", args.ll_tokens, _ll_case), ("normal", args.normal_tokens, _normal_case)]
    except ImportError:
        modes = [("LL", args.ll_tokens, _ll_case)]
    for mode, n, case in modes:
        for R in args.ranks:
            if args.experts % R:
                continue
            us, rows = case(args.op, R, args, device, time_us)
            xs, idxs, ws = _inputs(R, n, H, args.experts, args.topk, device, seed=2)
            base = time_us(_torch_baseline(args.op, xs, idxs, ws, args.experts, per_token_rank=mode == "normal"))
            gbps = rows * per_row[mode] / us / 1e3
            print(f"| {mode} | {R} | {n} | {rows} | {us:.1f} | {us / R:.1f} | {gbps:.0f} | {100 * gbps / copy:.0f}% | "
                  f"{base:.1f} | {base / us:.2f} |")
    from moe_ep.backends.symm_ll import deepep_ll_buffer_bytes, ll_buffer_bytes

    print("\n| low-latency buffer per rank, DeepSeek-V3 decode (T=128, H=7168, 256 experts, top-8) | EP | ours MB | DeepEP MB |")
    print("| --- | --- | --- | --- |")
    for R in (8, 16, 32, 64):
        ours = ll_buffer_bytes(128, 7168, R, 256, 8) / 1e6
        print(f"| | {R} | {ours:.1f} | {deepep_ll_buffer_bytes(128, 7168, R, 256) / 1e6:.1f} |")
    if any(m == "normal" for m, _, _ in modes):
        from moe_ep.backends.symm_normal import SymmNormal

        N, K = args.normal_tokens, args.topk
        print(f"\n| normal buffer per rank (num_nvl_bytes), {N} tokens/rank, hidden {H}, top-{K} | EP | ours MB | DeepEP MB |")
        print("| --- | --- | --- | --- |")
        for R in args.ranks:  # ours grows with the token count (whole messages); DeepEP's queues do not
            print(f"| | {R} | {SymmNormal.size_hint(N, H, K, R) / 1e6:.2f} | {deepep_normal_nvl_bytes(H, R) / 1e6:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
