"""Benchmark of the ``torch`` backend (all_to_all_single): dispatch/combine time and bandwidth.

Runs N local ranks: gloo on CPU, NCCL with one GPU per rank (more ranks than GPUs is refused). The
process group is set up here with a TCPStore rendezvous (tcp://127.0.0.1:<free port>). Bytes are
counted as DeepEP does (per rank: normal mode per received token-rank row, recv rows x (H + H/32) for
the FP8 dispatch and recv rows x 2H for combine; low-latency mode per selection, selections x
(H + H/32 + 16) and selections x 2H). Every timed call's output is checked after timing (dispatch:
the received rows' sum; combine of identity experts: each token's rows summed / weighted back).

Times (perf/_common.py ``time_ranks``): a barrier before each timed iteration, CUDA events per rank (CPU:
perf_counter), the L2 flushed before each timed iteration, then per iteration the slowest rank's time:
median, p10, p90 over ``--iters`` (per-rank medians in ``per_rank_us``). The limit, measured by rank 0 at
the start of the same run and recorded in the JSON header (``limits``): with 2+ GPUs the peer copy
bandwidth (``peer_gbps``, ``.to('cuda:1')`` of 1 GiB), else the device copy bandwidth (``copy_gbps``);
every ``bandwidth`` row's ratio is per-rank GB/s (bytes of one rank over the slowest rank's time) over it.

    python perf/bench_torch_a2a.py                       # CPU defaults (small)
    python perf/bench_torch_a2a.py --device cuda --ranks 8 --tokens 128 512 4096

``--vs-raw``: side by side with the exchange a user would write instead, interleaved in one run (per iteration:
barrier, baseline; barrier, ours; ... so machine load hits every row alike): the baseline row is two
``all_to_all_single`` calls (the per-rank token counts, then the rows, of the same widths as the BF16
dispatch's: ``x`` | source index | top-k ids | weights); then ``get_dispatch_layout`` + ``dispatch`` (BF16, with
top-k), and ``combine``, each with its median time over the baseline's (``ratio``).

    python perf/bench_torch_a2a.py --vs-raw --ranks 2 --tokens 16 --hidden 256 --iters 200
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

if "--cpu-smoke" in sys.argv or "cuda" not in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU ranks: the interpreter (before moe_ep is imported)

import torch  # noqa: E402

PROG = "bench_torch_a2a.py"
SMOKE = dict(device="cpu", ranks=[2], tokens=[16], hidden=256, experts=16, topk=4, iters=2)
TOL = 2e-2


def _parse(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = _common.parser(PROG, __doc__, "tiny CPU run (2 ranks, 16 tokens, hidden 256, 16 experts, top-4) unless "
                                      "given explicitly")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: cuda when nvidia-smi lists a GPU, else cpu (gloo)")
    p.add_argument("--ranks", type=int, nargs="+", default=None, help="world sizes (CPU default 2 4; GPU: all GPUs)")
    p.add_argument("--tokens", type=int, nargs="+", default=None, help="tokens per rank (CPU default 64 256; GPU 128 512 4096)")
    p.add_argument("--hidden", type=int, default=7168, help="hidden size (a multiple of 128)")
    p.add_argument("--experts", type=int, default=256, help="routed experts (divisible by every world size)")
    p.add_argument("--topk", type=int, default=8, help="experts per token")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (median reported; CPU 5, GPU 20)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a stuck run is stopped")
    p.add_argument("--vs-raw", action="store_true", help="side-by-side: two all_to_all_single (counts, rows) as the "
                   "baseline row, then layout+dispatch and combine with their ratio to it (interleaved, medians)")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        _common.smoke_defaults(args, p, argv, **SMOKE)
    if args.ranks is not None and min(args.ranks) < 1:
        p.error(f"argument --ranks: must be >= 1, got {min(args.ranks)}")
    if args.tokens is not None and min(args.tokens) < 1:
        p.error(f"argument --tokens: must be >= 1, got {min(args.tokens)}")
    if args.hidden < 128 or args.hidden % 128:
        p.error(f"argument --hidden: must be a positive multiple of 128, got {args.hidden}")
    if args.topk < 1 or args.topk > args.experts:
        p.error(f"argument --topk: must be in 1..--experts ({args.experts}), got {args.topk}")
    if args.iters is not None and args.iters < 1:
        p.error(f"argument --iters: must be >= 1, got {args.iters}")
    if args.timeout <= 0:
        p.error(f"argument --timeout: must be > 0, got {args.timeout}")
    for r in args.ranks or []:
        if args.experts % r:
            p.error(f"argument --ranks: {r} does not divide --experts {args.experts}")
    n_gpu = _common.gpu_count()
    if args.device == "auto":
        args.device = "cuda" if n_gpu else "cpu"
    if args.device == "cuda" and not n_gpu:
        p.error("argument --device: cuda requested but no CUDA GPU found (use --device cpu)")
    if args.device == "cuda" and args.ranks and max(args.ranks) > n_gpu:
        p.error(f"argument --ranks: {max(args.ranks)} ranks need one GPU each, only {n_gpu} found")
    args._n_gpu = n_gpu
    return args


def _rank(rank, world, args):
    import torch.distributed as dist

    import moe_ep
    from moe_ep.fp8 import dequant_fp8_ref, ll_dispatch_quant_ref, per_token_group_quant_fp8_ref

    dev = torch.device("cuda", rank % torch.cuda.device_count()) if args.device == "cuda" else torch.device("cpu")
    buf = moe_ep.Buffer(None, explicitly_destroy=True, low_latency_mode=True, backend="torch", timeout_s=args.timeout)
    h, e, k = args.hidden, args.experts, args.topk
    limits = _common.measure_limits(dev, peer=world >= 2, fp8=False) if rank == 0 else None
    dist.barrier()  # the other ranks wait while rank 0 measures the limits

    def timeit(fn):
        return _common.time_ranks(fn, dev, iters=args.iters, warmup=1)
    rows = []
    for n in args.tokens:
        x, idx, w = _inputs(rank, n, h, e, k, dev)
        q, s = per_token_group_quant_fp8_ref(x)
        xq = dequant_fp8_ref(q, s)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, e)
        sel = n * k

        def disp():
            return buf.dispatch((q, s), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)

        (rx, rs), _, _, _, handle, _ = disp()
        recv_rows = int(rx.shape[0])
        y = dequant_fp8_ref(rx, rs).to(torch.bfloat16)  # identity experts
        t_d = timeit(disp)
        box = {}

        def comb():
            box["out"] = buf.combine(y, handle)[0]
        t_c = timeit(comb)
        ok_normal = _common.rel_err(box["out"], in_rank.sum(1, keepdim=True).float() * xq)
        ll = buf.low_latency_dispatch(x, idx, n, e)
        (lq, ls), count = ll[0], ll[1]
        yl = torch.zeros(lq.shape, dtype=torch.bfloat16, device=dev)
        for le in range(lq.shape[0]):
            c = int(count[le])
            if c:
                yl[le, :c] = dequant_fp8_ref(lq[le, :c], ls[le, :c]).to(torch.bfloat16)
        t_ld = timeit(lambda: buf.low_latency_dispatch(x, idx, n, e))

        def lcomb():
            box["ll"] = buf.low_latency_combine(yl, idx, w, ll[2])[0]
        t_lc = timeit(lcomb)
        # the low-latency dispatch casts as DeepEP does: its reference starts from that cast
        xq_ll = dequant_fp8_ref(*ll_dispatch_quant_ref(x))
        err_ll = _common.rel_err(box["ll"], w.sum(1, keepdim=True) * xq_ll)
        # normal mode: per received token-rank row (recv rows x row bytes); low-latency: per selection
        d_bytes, c_bytes = recv_rows * (h + h // 32), recv_rows * 2 * h
        ld_bytes, lc_bytes = sel * (h + h // 32 + 16), sel * 2 * h
        errs = torch.tensor([max(ok_normal, err_ll)], dtype=torch.float64)
        if dev.type == "cuda":
            errs = errs.to(dev)
        dist.all_reduce(errs, op=dist.ReduceOp.MAX)
        nb = torch.tensor([d_bytes, c_bytes, ld_bytes, lc_bytes], dtype=torch.float64, device=errs.device)
        dist.all_reduce(nb)  # summed over ranks: per-rank GB/s = sum / world / slowest time
        # t_*: (slowest-rank Timing, per-rank medians), the same on every rank
        rows.append(dict(n=n, d=float(nb[0]) / world, c=float(nb[1]) / world, ld=float(nb[2]) / world,
                         lc=float(nb[3]) / world, t_d=t_d, t_c=t_c, t_ld=t_ld, t_lc=t_lc, err=float(errs[0]),
                         recv_rows=recv_rows))
    buf.destroy()
    return rows, limits


def _inputs(rank: int, n: int, h: int, e: int, k: int, dev) -> tuple:
    """This rank's tokens (BF16 ``[n, h]``), top-``k`` of ``e`` experts and weights, seeded by rank and ``n``."""
    g = torch.Generator().manual_seed(rank * 7919 + n)
    x = torch.randn(n, h, generator=g).to(torch.bfloat16).to(dev)
    idx = torch.rand(n, e, generator=g).argsort(1)[:, :k].to(dev)
    return x, idx, torch.rand(n, k, generator=g).to(dev)


def _vs_raw_rank(rank, world, args):
    """Interleaved timing of the raw exchange, layout+dispatch and combine; per iteration the slowest rank."""
    import torch.distributed as dist

    import moe_ep

    dev = torch.device("cuda", rank % torch.cuda.device_count()) if args.device == "cuda" else torch.device("cpu")
    buf = moe_ep.Buffer(None, explicitly_destroy=True, backend="torch", timeout_s=args.timeout)
    h, e, k = args.hidden, args.experts, args.topk
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rows = []
    for n in args.tokens:
        x, idx, w = _inputs(rank, n, h, e, k, dev)
        box = {}

        def raw():  # what a user writes: counts all_to_all, then the rows (same row bytes as our dispatch)
            in_rank = torch.zeros(n, world, dtype=torch.bool, device=dev)
            in_rank.scatter_(1, idx // (e // world), True)
            counts = in_rank.sum(0).to(torch.int64)
            recv_counts = torch.empty_like(counts)
            dist.all_to_all_single(recv_counts, counts)
            send_idx = in_rank.t().nonzero()[:, 1]
            send = torch.cat([x.index_select(0, send_idx).view(torch.uint8).reshape(-1, 2 * h),
                              send_idx.to(torch.int32).view(-1, 1).view(torch.uint8),
                              idx.index_select(0, send_idx).view(torch.uint8).reshape(-1, 8 * k),
                              w.index_select(0, send_idx).view(torch.uint8).reshape(-1, 4 * k)], dim=1)
            rc, sc = recv_counts.tolist(), counts.tolist()
            recv = torch.empty(sum(rc), send.shape[1], dtype=torch.uint8, device=dev)
            dist.all_to_all_single(recv, send, output_split_sizes=rc, input_split_sizes=sc)
            box["raw_rows"] = recv.shape[0]

        def ours():
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, e)
            out = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                               num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
            box["recv"], box["handle"], box["in_rank"] = out[0], out[4], in_rank

        def comb():
            box["out"] = buf.combine(box["recv"], box["handle"])[0]

        cases = (("raw", raw), ("dispatch", ours), ("combine", comb))
        for _, fn in cases:  # warm-up (and the handle for combine)
            fn()
        times = {name: [] for name, _ in cases}
        for _ in range(args.iters):
            for name, fn in cases:
                dist.barrier()
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                times[name].append((time.perf_counter() - t0) * 1e6)
        err = _common.rel_err(box["out"], box["in_rank"].sum(1, keepdim=True).float() * x.float())
        ok = torch.tensor([float(box["raw_rows"] == box["recv"].shape[0]), err], dtype=torch.float64)
        allt = torch.tensor([times[name] for name, _ in cases], dtype=torch.float64)
        if dev.type == "cuda":
            ok, allt = ok.to(dev), allt.to(dev)
        dist.all_reduce(allt, op=dist.ReduceOp.MAX)  # per iteration, the slowest rank
        ok[0] = 1.0 - ok[0]
        dist.all_reduce(ok, op=dist.ReduceOp.MAX)
        slow = allt.cpu().tolist()
        rows.append(dict(n=n, err=float(ok[1]), rows_match=float(ok[0]) == 0.0,
                         t={name: _common.quantiles(slow[i]) for i, (name, _) in enumerate(cases)}))
    buf.destroy()
    return rows, None


def _vs_raw_report(rec, world, rows0, args):
    note = None if args.device == "cuda" else "CPU ranks (gloo): numbers meaningless for GPUs"
    for r0 in rows0:
        base = r0["t"]["raw"]
        valid = r0["rows_match"] and r0["err"] <= TOL
        for name, label in (("raw", "raw all_to_all_single x2 (counts, rows)"), ("dispatch", "get_dispatch_layout + "
                            "dispatch BF16"), ("combine", "combine BF16")):
            t = r0["t"][name]
            ratio = t.median / base.median
            print(f"{world:>5} {r0['n']:>6} | {label:<40} | {t.median:>9.0f} {t.p10:>9.0f} {t.p90:>9.0f} | "
                  f"{ratio:>5.2f} | {'ok' if valid else 'INVALID'} ({r0['err']:.1e})", flush=True)
            rec.add(f"vs raw: {label} {world} ranks {r0['n']} tokens/rank", "time", t.median, "us", p10=t.p10,
                    p90=t.p90, iterations=t.n, baseline=None if name == "raw" else base.median, ratio=ratio,
                    valid=valid, note=note, interleaved=True)


def _child(conn, port, rank, world, backend, args):
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        import datetime
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=args.timeout))
        out = (_vs_raw_rank if args.vs_raw else _rank)(rank, world, args)
        dist.barrier()
        dist.destroy_process_group()
        conn.send(("ok", out))
    except BaseException as exc:  # noqa: BLE001 - reported by the parent in one line
        conn.send(("error", f"rank {rank}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"))
    finally:
        conn.close()


def _launch(world, args, backend):
    """Fork ``world`` ranks that rendezvous over a TCPStore on a free local port; their results, by rank."""
    import multiprocessing as mp
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("fork")
    procs, conns = [], []
    for r in range(world):
        a, b = ctx.Pipe(duplex=False)
        pr = ctx.Process(target=_child, args=(b, port, r, world, backend, args), daemon=True)
        pr.start()
        b.close()
        procs.append(pr)
        conns.append(a)
    deadline = time.monotonic() + args.timeout
    results = []
    try:
        for r, c in enumerate(conns):
            if not c.poll(max(0.0, deadline - time.monotonic())):
                raise RuntimeError(f"rank {r} did not finish within --timeout {args.timeout:.0f} s")
            status, val = c.recv()
            if status != "ok":
                raise RuntimeError(val)
            results.append(val)
    finally:
        for pr in procs:
            pr.join(timeout=5)
            if pr.is_alive():
                pr.kill()
    return results


def main(argv=None):
    args = _parse(argv)
    if args.device == "cpu":
        args.ranks = args.ranks or [2, 4]
        args.tokens = args.tokens or [64, 256]
        args.iters = args.iters or 5
    else:
        args.ranks = args.ranks or [args._n_gpu]
        args.tokens = args.tokens or [128, 512, 4096]
        args.iters = args.iters or 20
    backend = "nccl" if args.device == "cuda" else "gloo"
    # the device name from nvidia-smi: CUDA must stay uninitialised in this process before the ranks fork
    dev_name = None
    if args.device == "cuda":
        import subprocess
        r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
        dev_name = f"{args._n_gpu} x {(r.stdout.strip().splitlines() or ['GPU'])[0]}"
    else:
        import platform
        dev_name = f"CPU ({platform.machine()}, {os.cpu_count()} cores), gloo"
    rec = _common.Records("bench_torch_a2a", args.json, args.cpu_smoke, device=dev_name, argv=argv,
                          method=_common.EAGER if args.device == "cuda" else _common.CPU_WALL)
    if args.vs_raw:
        print(f"torch backend ({backend}, {args.device}) vs the raw exchange, hidden {args.hidden}, {args.experts} "
              f"experts, top-{args.topk}; interleaved per iteration, slowest rank, median of {args.iters}", flush=True)
        print(f"{'ranks':>5} {'tokens':>6} | {'case (interleaved, slowest rank per iteration)':<40} | "
              f"{'median us':>9} {'p10':>9} {'p90':>9} | ratio | check", flush=True)
        for world in args.ranks:
            try:
                res = _launch(world, args, backend)
            except RuntimeError as exc:
                return _common.error(PROG, f"{world} ranks: {exc}")
            _vs_raw_report(rec, world, res[0][0], args)
        return rec.finish(PROG)
    print(f"torch backend ({backend}, {args.device}), hidden {args.hidden}, {args.experts} experts, top-{args.topk}; "
          f"per-rank bytes: normal per received token-rank row, LL per selection; slowest rank per iteration, median "
          f"of {args.iters} (barrier before each, L2 flushed on GPUs); TCPStore rendezvous", flush=True)
    print(f"{'ranks':>5} {'tokens':>6} | {'dispatch us':>11} {'GB/s':>7} | {'combine us':>10} {'GB/s':>7} | "
          f"{'LL disp us':>10} {'GB/s':>7} | {'LL comb us':>10} {'GB/s':>7} | {'limit GB/s':>10} | check", flush=True)
    all_limits = {}
    for world in args.ranks:
        try:
            res = _launch(world, args, backend)
        except RuntimeError as exc:
            return _common.error(PROG, f"{world} ranks: {exc}")
        rows0, limits = res[0]  # every rank holds the same slowest-rank timings; rank 0 measured the limits
        all_limits[str(world)] = limits
        rec.update_header(limits=limits if len(args.ranks) == 1 else all_limits,
                          timing="time_ranks: barrier, CUDA events per rank, L2 flushed, slowest rank per iteration"
                          if args.device == "cuda" else "time_ranks: barrier, perf_counter per rank, slowest rank")
        peer = limits.get("peer_gbps")
        lim, lim_name = (peer, "peer copy bandwidth (limits.peer_gbps)") if peer else \
            (limits["copy_gbps"], "device copy bandwidth (limits.copy_gbps; no peer copy: " +
             ("one GPU)" if args.device == "cuda" else "CPU ranks)"))
        note = None if args.device == "cuda" else "CPU ranks (gloo): numbers meaningless for GPUs"
        resident = False if args.device == "cuda" else None
        for r0 in rows0:
            n = r0["n"]
            valid = r0["err"] <= TOL
            cells = []
            for key, bkey in (("t_d", "d"), ("t_c", "c"), ("t_ld", "ld"), ("t_lc", "lc")):
                t = r0[key][0]
                cells.append(f"{t.median:>10.0f} {r0[bkey] / t.median / 1e3:>7.2f}")
            print(f"{world:>5} {n:>6} | " + " | ".join(cells) + f" | {lim:>10.1f} | "
                  f"{'ok' if valid else 'INVALID'} ({r0['err']:.1e})", flush=True)
            for key, bkey, label in (("t_d", "d", "dispatch FP8"), ("t_c", "c", "combine BF16"),
                                     ("t_ld", "ld", "LL dispatch FP8"), ("t_lc", "lc", "LL combine BF16")):
                t, per_rank = r0[key]
                case = f"{label} {world} ranks {n} tokens/rank"
                gbps = r0[bkey] / t.median / 1e3
                rec.add(case, "time", t.median, "us", p10=t.p10, p90=t.p90, iterations=t.n, valid=valid,
                        l2_resident=resident, note=note, per_rank_us=per_rank, bytes_per_rank=r0[bkey],
                        rel_err=r0["err"])
                rec.add(case, "bandwidth", gbps, "GB/s", p10=r0[bkey] / t.p90 / 1e3, p90=r0[bkey] / t.p10 / 1e3,
                        iterations=t.n, limit=lim, ratio=gbps / lim if lim else None, valid=valid,
                        l2_resident=resident, note=note, limit_name=lim_name, bytes_per_rank=r0[bkey])
    return rec.finish(PROG)


if __name__ == "__main__":
    sys.exit(main())
