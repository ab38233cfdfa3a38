"""Benchmark of the ``symm`` backend's dispatch (and, with ``--op combine``, combine) on one device.

All ranks are *virtual ranks* in this process (``moe_ep.backends.symm.virtual_backends``): one
allocation sliced ``R`` ways, every rank's send launch then every rank's receive launch. They share
one HBM, so the physical limit is the device's copy bandwidth, measured in the same run.

Rows, per EP size ``R`` (DeepSeek-V3 shapes by default: hidden 7168, 256 experts, top-8):

- ``LL``: low-latency mode, ``T`` tokens per rank (default 128), FP8 cast fused into the send;
- ``normal``: normal mode, ``N`` tokens per rank (default 4096), FP8 payload, ``num_worst_tokens`` set to
  each rank's exact receive count (from the layouts, outside the timer): no call reads device data on the
  host and the timed region fills only rows that are counted (only when the normal path is installed);
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

``--launcher torchrun`` (one process per GPU, the real path through ``moe_ep.Buffer``): ``--backend both``
(the default) times ``symm`` and ``torch`` (NCCL ``all_to_all_single``) in the same invocation on the same
inputs, and, when ``import deep_ep`` works, DeepEP's ``deep_ep.Buffer`` too (low-latency:
``low_latency_dispatch`` / ``low_latency_combine`` with ``num_max_dispatch_tokens_per_rank`` = tokens per rank
and its ``get_low_latency_rdma_size_hint``; normal: ``get_dispatch_layout`` before the timer, as ours, then
``dispatch`` / ``combine`` with its own configs and ``Config.get_nvl_buffer_size_hint``). Every row then has
``baseline`` = DeepEP's slowest-rank median (``ratio`` = DeepEP / ours, ``ours_over_deepep``) and ``torch_us``;
without DeepEP one line says it is skipped and why, and the rows carry ``baseline: null``.

    python perf/bench_dispatch.py                 # needs a CUDA GPU
    python perf/bench_dispatch.py --op combine    # what perf/bench_combine.py runs
    python perf/bench_dispatch.py --cpu-smoke     # every code path on CPU (interpreter), tiny shapes
    torchrun --nproc-per-node 8 perf/bench_dispatch.py --launcher torchrun --json d8.jsonl   # symm, torch, DeepEP
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

_common.smoke_env()  # TRITON_INTERPRET=1 before any @triton.jit in moe_ep

import torch  # noqa: E402

COMBINE_DOC = """Benchmark of the ``symm`` backend's combine (weighted BF16 reduction back to the source ranks).

The same harness as ``perf/bench_dispatch.py`` (virtual ranks on one device, copy bandwidth and a
torch baseline measured in the same run). Bytes as DeepEP counts them: low-latency rows selections x
2H, normal rows received token-rank rows x 2H. After timing, every case's output is checked against a
torch reference (identity experts: each token's output is its weighted / summed returned rows).

    python perf/bench_combine.py                 # needs a CUDA GPU
    python perf/bench_combine.py --cpu-smoke     # every code path on CPU (interpreter), tiny shapes
"""

SMOKE = dict(ranks=[2, 4], hidden=256, experts=16, topk=4, ll_tokens=4, normal_tokens=8, iters=2,
             routing=["grouped-drop"])
ROUTINGS = ("uniform", "grouped", "zipf", "grouped-drop")
GROUPS, TOPK_GROUPS, ZIPF_S, DROP = 8, 4, 1.0, 0.05


def _parse(argv=None, op=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    prog = "bench_combine.py" if op == "combine" else "bench_dispatch.py"
    p = _common.parser(prog, COMBINE_DOC if op == "combine" else __doc__)
    if op is None:
        p.add_argument("--op", choices=["dispatch", "combine"], default="dispatch", help="which operation to time")
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64],
                   help="EP sizes (virtual ranks on one device; a size one GPU cannot hold is skipped with a line)")
    p.add_argument("--routing", nargs="+", choices=ROUTINGS, default=list(ROUTINGS),
                   help=f"uniform: top-K of uniform scores; grouped: DeepSeek group-limited ({GROUPS} groups, top-"
                        f"{TOPK_GROUPS} groups, then top-K experts); zipf: expert popularity ~ 1/rank^{ZIPF_S} (skewed); "
                        f"grouped-drop: grouped with {DROP * 100:.0f}%% of the entries -1 (no expert)")
    p.add_argument("--launcher", choices=["virtual", "torchrun"], default="virtual",
                   help="virtual: every rank in this process on one GPU; torchrun: one process per GPU on the real "
                        "path (needs RANK, WORLD_SIZE, LOCAL_RANK from torchrun; --ranks is then the world size)")
    p.add_argument("--backend", choices=["symm", "torch", "both"], default="both",
                   help="the moe_ep.Buffer backend timed under --launcher torchrun; both: symm and torch (NCCL "
                        "all_to_all_single) in the same invocation on the same inputs, so every row has its same-run "
                        "baseline")
    p.add_argument("--no-deepep", action="store_true",
                   help="under --launcher torchrun, do not time DeepEP (deep_ep.Buffer) as the baseline even when "
                        "it is importable")
    p.add_argument("--hidden", type=int, default=7168, help="hidden size H (a multiple of 128)")
    p.add_argument("--experts", type=int, default=256, help="routed experts E")
    p.add_argument("--topk", type=int, default=8, help="experts per token K")
    p.add_argument("--ll-tokens", type=int, default=128, help="T: tokens per rank in low-latency mode")
    p.add_argument("--normal-tokens", type=int, default=4096, help="tokens per rank in normal mode")
    p.add_argument("--iters", type=int, default=5,
                   help="timed calls per case (median, p10, p90; GPU default 50, CPU 5)")
    p.add_argument("--no-graph", action="store_true", help="time eager launches instead of CUDA-graph replays")
    args = p.parse_args(argv)
    if op is not None:
        args.op = op
    if args.cpu_smoke:
        _common.smoke_defaults(args, p, argv, **SMOKE)
    elif "iters" not in _common.given(p, argv):
        args.iters = 50
    for name in ("hidden", "experts", "topk", "ll_tokens", "normal_tokens", "iters"):
        if getattr(args, name) < 1:
            p.error(f"argument --{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if min(args.ranks) < 1:
        p.error(f"argument --ranks: must be >= 1, got {min(args.ranks)}")
    if args.hidden % 128:
        p.error(f"argument --hidden: must be a multiple of 128, got {args.hidden}")
    if args.topk > args.experts:
        p.error(f"argument --topk: must be <= --experts ({args.experts}), got {args.topk}")
    return args, prog


def route(n, E, K, routing, g):
    """``[n, K]`` int64 expert ids for one rank's ``n`` tokens (see ``--routing``)."""
    if routing == "zipf":
        perm = torch.randperm(E, generator=g)
        p = torch.empty(E)
        p[perm] = 1.0 / torch.arange(1, E + 1, dtype=torch.float32) ** ZIPF_S
        return torch.multinomial(p.expand(n, E), K, replacement=False, generator=g)
    scores = torch.rand(n, E, generator=g)
    if routing.startswith("grouped") and E % GROUPS == 0 and TOPK_GROUPS * (E // GROUPS) >= K:
        grp = scores.view(n, GROUPS, E // GROUPS).topk(min(2, E // GROUPS), dim=-1).values.sum(-1)  # DeepSeek: top-2 sum
        keep = torch.zeros(n, GROUPS, dtype=torch.bool).scatter_(1, grp.topk(TOPK_GROUPS, dim=1).indices, True)
        scores = scores.masked_fill(~keep.repeat_interleave(E // GROUPS, dim=1), -1.0)
    idx = scores.topk(K, dim=1).indices
    if routing.endswith("-drop"):
        idx = idx.masked_fill(torch.rand(n, K, generator=g) < DROP, -1)
    return idx.contiguous()


def _inputs(R, n, H, E, K, device, seed=0, routing="uniform"):
    g = torch.Generator().manual_seed(seed)
    xs, idxs, ws = [], [], []
    for _ in range(R):
        xs.append(torch.randn(n, H, generator=g).to(torch.bfloat16).to(device))
        idxs.append(route(n, E, K, routing, g).to(device))
        ws.append(torch.rand(n, K, generator=g).to(device))
    return xs, idxs, ws


def _timer(device, graph, iters):
    """``time_us(fn) -> (Timing, out)`` (``time_us.how``: how the last call was timed; ``time_us.kernels``: its
    per-kernel microseconds per replay from ``torch.profiler``, ``profiler-kernels``, when it was a graph, else
    None): microseconds of ``fn`` (median, p10, p90 over ``iters``; on a GPU CUDA
    events around CUDA-graph replays unless disabled, L2 flushed by a read before each, warm-up outside), the output
    of the last timed call (a graph's output tensors after its last replay) and how it was timed."""
    def time_us(fn):
        box = {}
        time_us.kernels = None
        if device.type == "cuda" and graph:
            replay, out, note = _common.graph_fn(fn, device)
            t = _common.time_us(replay, device, iters=iters, warmup=2)
            time_us.how = note or "CUDA graph replay"
            if note is None:  # send, receive and fills attributed separately
                time_us.kernels = _common.kernel_times(replay, device, iters=max(1, iters // 4), warmup=0)
            return t, (out if note is None else fn())

        def run():
            box["out"] = fn()
        t = _common.time_us(run, device, iters=iters, warmup=1 if device.type == "cuda" else 0)
        time_us.how = "eager launches" if device.type == "cuda" else "CPU"
        return t, box["out"]
    time_us.how = None
    time_us.kernels = None
    return time_us


def _torch_baseline(op, xs, idxs, ws, E, per_token_rank=False):
    """One-process torch equivalent: gather every rank's received rows (dispatch), or gather every selection's
    row and reduce it with its weight (combine). ``per_token_rank``: one row per (token, rank) pair (normal mode)
    instead of one per selection (low-latency mode). Fairness: the inputs match ours on both sides of the timer,
    so in normal mode (ours receives FP8 + scales) the baseline quantizes before the timer; in low-latency mode
    (ours receives BF16 and casts inside the send) it quantizes inside the timed region."""
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
        if per_token_rank:  # ours gets (FP8, scales): so does the baseline, quantized outside the timer
            q0, s0 = per_token_group_quant_fp8_ref(allx, 128)

            def run_fp8_in():
                return [(q0.index_select(0, rows), s0.index_select(0, rows)) for rows in per_rank]
            return run_fp8_in

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


def _deq_all(xs):
    """The tokens as the low-latency dispatch casts them (DeepEP's cast: ``ll_dispatch_quant_ref``), dequantized."""
    from moe_ep.fp8 import dequant_fp8_ref, ll_dispatch_quant_ref

    return [dequant_fp8_ref(*ll_dispatch_quant_ref(x)) for x in xs]


def _ll_case(op, R, args, device, time_us):
    """(Timing, selections, rel err of the timed output against the torch reference)."""
    from moe_ep.backends.symm import SymmBackend, virtual_backends
    from moe_ep.fp8 import dequant_fp8_ref, ll_dispatch_quant_ref

    T, H, E, K = args.ll_tokens, args.hidden, args.experts, args.topk
    L = E // R
    xs, idxs, ws = _inputs(R, T, H, E, K, device, routing=args.cur_routing)
    bs = virtual_backends(R, num_nvl_bytes=0, num_rdma_bytes=SymmBackend.get_low_latency_size_hint(T, H, R, E, K),
                          low_latency_mode=True, device=device, timeout_s=60)

    def dispatch():
        st = [b.low_latency_dispatch_send(x, i, T, E, use_fp8=True) for b, x, i in zip(bs, xs, idxs)]
        return [b.low_latency_dispatch_recv(s) for b, s in zip(bs, st)]

    if op == "dispatch":
        t, res = time_us(dispatch)
        # per expert: the sum of its received rows (dequantized) == the sum of the tokens that selected it
        xq = _deq_all(xs)
        ref = torch.zeros(E, H, dtype=torch.float32, device=device)
        for x, i in zip(xq, idxs):
            m = i.flatten() >= 0  # -1: no expert
            ref.index_add_(0, i.flatten()[m], x.repeat_interleave(K, dim=0)[m])
        got = torch.zeros(E, H, dtype=torch.float32, device=device)
        for r, res_r in enumerate(res):
            for le in range(L):
                c = int(res_r.recv_count[le])
                if c:
                    got[r * L + le] = dequant_fp8_ref(res_r.recv_x[le, :c], res_r.recv_x_scales[le, :c]).sum(0)
        return t, int(sum(int((i >= 0).sum()) for i in idxs)), _common.rel_err(got, ref)
    res = dispatch()
    ys = [r.recv_x.to(torch.bfloat16) for r in res]  # identity experts on the raw FP8 values
    outs = [torch.empty(T, H, dtype=torch.bfloat16, device=device) for _ in range(R)]

    def combine():
        st = [b.low_latency_combine_send(y, i, w, r.handle, out=o) for b, y, i, w, r, o in zip(bs, ys, idxs, ws, res, outs)]
        return [b.low_latency_combine_recv(s) for b, s in zip(bs, st)]

    t, _ = time_us(combine)
    ref = torch.cat([(w * (i >= 0)).sum(1, keepdim=True) * ll_dispatch_quant_ref(x)[0].float()
                     for x, w, i in zip(xs, ws, idxs)])
    return t, int(sum(int((i >= 0).sum()) for i in idxs)), _common.rel_err(torch.cat(outs), ref)


def _normal_case(op, R, args, device, time_us):
    from moe_ep.backends.symm import SymmBackend, virtual_backends
    from moe_ep.fp8 import dequant_fp8_ref, per_token_group_quant_fp8_ref

    N, H, E, K = args.normal_tokens, args.hidden, args.experts, args.topk
    xs, idxs, ws = _inputs(R, N, H, E, K, device, seed=1, routing=args.cur_routing)
    qs = [per_token_group_quant_fp8_ref(x, 128) for x in xs]
    bs = virtual_backends(R, num_nvl_bytes=SymmBackend.get_normal_size_hint(N, H, K, R), device=device, timeout_s=60)
    layouts = [b.get_dispatch_layout(i, E) for b, i in zip(bs, idxs)]
    # Output rows per destination: exactly what it receives (known from the layouts, outside the timer), so the
    # timed region allocates and fills only the rows that are counted (a worst-case R*N size would time a
    # zero-fill of rows that never travel); still no host read inside the timed calls.
    exact = [max(1, sum(int(lay[0][d]) for lay in layouts)) for d in range(R)]

    def dispatch():
        st = [b.dispatch_send(q, s, handle=None, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3],
                              num_tokens_per_expert=lay[2], topk_idx=i, topk_weights=w, num_experts=E)
              for b, (q, s), i, w, lay in zip(bs, qs, idxs, ws, layouts)]
        return [b.dispatch_recv(s, expert_alignment=1, num_worst_tokens=m) for b, s, m in zip(bs, st, exact)]

    rows = sum(int(lay[0].sum()) for lay in layouts)  # token-rank pairs: the rows that travel (setup, not timed)
    xq = [dequant_fp8_ref(q, s) for q, s in qs]
    in_rank = [lay[3].bool() for lay in layouts]
    if op == "dispatch":
        t, res = time_us(dispatch)
        # per destination rank: the sum of its received rows == the sum of the tokens sent to it
        got = torch.stack([dequant_fp8_ref(r.recv_x[:n], r.recv_x_scales[:n]).sum(0) for r, n in
                           zip(res, (sum(int(lay[0][d]) for lay in layouts) for d in range(R)))])
        ref = torch.stack([sum(x[m[:, d]].sum(0) for x, m in zip(xq, in_rank)) for d in range(R)])
        return t, rows, _common.rel_err(got, ref)
    res = dispatch()
    # identity experts: each rank returns its received rows dequantized (the padding rows are never read)
    ys = [dequant_fp8_ref(r.recv_x, r.recv_x_scales).to(torch.bfloat16) for r in res]

    def combine():
        st = [b.combine_send(y, r.handle, None) for b, y, r in zip(bs, ys, res)]
        return [b.combine_recv(s, ())[0] for b, s in zip(bs, st)]

    t, outs = time_us(combine)
    ref = torch.cat([m.sum(1, keepdim=True).float() * x for x, m in zip(xq, in_rank)])
    return t, rows, _common.rel_err(torch.cat(outs), ref)


TORCHRUN_ENV = _common.TORCHRUN_ENV
deepep_probe = _common.deepep_probe  # shared with bench_internode_ll.py (tests import it from here)


def main_torchrun(args, prog, argv) -> int:
    """``--launcher torchrun``: one process per GPU, the real path through ``moe_ep.Buffer`` (``--backend``),
    a barrier before each timed iteration, per-rank times and the slowest rank's reported (rank 0 prints and
    writes the JSON). Without torchrun's environment: one line on stderr, exit 2."""
    bad = _common.torchrun_env_error(prog, f"torchrun --nproc-per-node <GPUs> perf/{prog} --launcher torchrun")
    if bad:
        return bad
    deep_ep, line = deepep_probe(args.no_deepep)
    if os.environ.get("RANK") == "0":
        print(line, flush=True)
    if args.cpu_smoke or not torch.cuda.is_available():
        return _common.error(prog, "--launcher torchrun needs one CUDA GPU per rank (not --cpu-smoke)", 2)
    import torch.distributed as dist

    import moe_ep

    with _common.torchrun_nccl() as (rank, world, device):
        return _torchrun_body(args, prog, argv, rank, world, device, dist, moe_ep, deep_ep, line)


class DeepEPCase:
    """DeepEP on the same shapes and inputs as ours: ``fn`` (the timed call) and ``nbytes`` are set by
    ``__init__``; raises when DeepEP cannot run the case (the caller records baseline=null and says why).

    Low-latency: ``Buffer(group, 0, get_low_latency_rdma_size_hint(n, H, world, E), low_latency_mode=True,
    num_qps_per_rank=E // world)`` with ``num_max_dispatch_tokens_per_rank`` = tokens per rank, FP8 dispatch;
    combine of a BF16 ``[E/world, world*n, H]`` tensor with DeepEP's own handle. Normal: its dispatch/combine
    configs and ``Config.get_nvl_buffer_size_hint`` (BF16 hidden bytes; RDMA hint above 8 ranks),
    ``get_dispatch_layout`` once before the timer (as ours), then ``dispatch`` of the same FP8 (data, scales)
    input / ``combine`` of BF16 rows."""

    def __init__(self, deep_ep, group, op, mode, x, q, idx, w, n, H, E, world):
        B = deep_ep.Buffer
        idx = idx.to(getattr(deep_ep, "topk_idx_t", torch.int64))
        self.buf = None
        if mode == "LL":
            hint = B.get_low_latency_rdma_size_hint(n, H, world, E)
            self.buf = B(group, 0, hint, low_latency_mode=True, num_qps_per_rank=max(1, E // world))
            out = self.buf.low_latency_dispatch(x, idx, n, E, use_fp8=True)
            handle = out[2]
            y = torch.randn(E // world, world * n, H, device=x.device).to(torch.bfloat16)
            if op == "dispatch":
                self.fn = lambda: self.buf.low_latency_dispatch(x, idx, n, E, use_fp8=True)
            else:
                self.fn = lambda: self.buf.low_latency_combine(y, idx, w, handle)
            self.hint = hint
            return
        dcfg = B.get_dispatch_config(world) if hasattr(B, "get_dispatch_config") else None
        ccfg = B.get_combine_config(world) if hasattr(B, "get_combine_config") else None
        hidden_bytes = 2 * H
        if dcfg is not None and hasattr(dcfg, "get_nvl_buffer_size_hint"):
            nvl = max(c.get_nvl_buffer_size_hint(hidden_bytes, world) for c in (dcfg, ccfg) if c is not None)
            rdma = (max(c.get_rdma_buffer_size_hint(hidden_bytes, world) for c in (dcfg, ccfg) if c is not None)
                    if world > 8 else 0)
        else:  # no size hints in this DeepEP: its intranode formula restated (default 20 SMs)
            nvl, rdma = deepep_normal_nvl_bytes(H, world), 0
        self.buf = B(group, nvl, rdma)
        self.hint = nvl + rdma
        lay = self.buf.get_dispatch_layout(idx, E)
        kw = dict(num_tokens_per_rank=lay[0], num_tokens_per_rdma_rank=lay[1], num_tokens_per_expert=lay[2],
                  is_token_in_rank=lay[3], topk_idx=idx, topk_weights=w)
        if dcfg is not None:
            kw["config"] = dcfg
        out = self.buf.dispatch(q, **kw)
        recv_x, handle = out[0], out[4]
        yb = (recv_x[0] if isinstance(recv_x, tuple) else recv_x).float().to(torch.bfloat16)
        ckw = {"config": ccfg} if ccfg is not None else {}
        self.fn = ((lambda: self.buf.dispatch(q, **kw)) if op == "dispatch"
                   else (lambda: self.buf.combine(yb, handle, **ckw)))


def _torchrun_body(args, prog, argv, rank, world, device, dist, moe_ep, deep_ep=None, deepep_line="") -> int:
    from moe_ep.fp8 import per_token_group_quant_fp8_ref

    H, E, K = args.hidden, args.experts, args.topk
    if E % world:
        return _common.error(prog, f"--experts {E} is not divisible by the world size {world}", 2)
    backends = ["symm", "torch"] if args.backend == "both" else [args.backend]
    name = torch.cuda.get_device_name(device)
    rec = _common.Records(prog[:-3], args.json if rank == 0 else None, False, device=f"{world} x {name}", argv=argv,
                          method=_common.EAGER)
    limits = _common.measure_limits(device, peer=world >= 2, fp8=False) if rank == 0 else {}
    dist.barrier()  # the other ranks wait while rank 0 measures the limits
    rec.update_header(limits=limits, launcher="torchrun", world_size=world, backend=args.backend,
                      deepep=deepep_line, timing="time_ranks: barrier, CUDA events per rank, L2 flushed, slowest "
                      "rank per iteration")
    say = print if rank == 0 else (lambda *a, **k: None)
    peer = limits.get("peer_gbps")
    say(f"# {'+'.join(backends)} {args.op}, torchrun, {world} ranks x {name}, commit {rec.header['commit']}; hidden "
        f"{H}, {E} experts, top-{K}; barrier before each timed call, L2 flushed, slowest rank per iteration; limits "
        f"{limits}\n# {deepep_line}", flush=True)
    say(_common.table_header(["backend", "mode", "routing", "EP", "tokens/rank", "slowest us", "p10-p90 us",
                              "per-rank medians us", "GB/s (slowest)", "% of peer copy", "DeepEP us", "ours/DeepEP",
                              "torch us", "ours/torch"]), flush=True)
    group = dist.group.WORLD
    for mode, n in (("LL", args.ll_tokens), ("normal", args.normal_tokens)):
        for rt in args.routing:
            g = torch.Generator().manual_seed(1000 + rank)
            x = torch.randn(n, H, generator=g).to(torch.bfloat16).to(device)
            idx = route(n, E, K, rt, g).to(device)
            w = torch.rand(n, K, generator=g).to(device)
            q = per_token_group_quant_fp8_ref(x, 128)  # normal mode receives FP8: quantized before the timer
            results = {}
            for backend in backends:
                if mode == "LL":
                    buf = moe_ep.Buffer(None, 0, moe_ep.Buffer.get_low_latency_rdma_size_hint(n, H, world, E),
                                        low_latency_mode=True, backend=backend)
                    recv = buf.low_latency_dispatch(x, idx, n, E, use_fp8=True)
                    y = torch.randn(E // world, world * n, H, device=device).to(torch.bfloat16)
                    fn = ((lambda buf=buf: buf.low_latency_dispatch(x, idx, n, E, use_fp8=True))
                          if args.op == "dispatch" else (lambda buf=buf, recv=recv, y=y:
                                                         buf.low_latency_combine(y, idx, w, recv[2])))
                    sel = int((idx >= 0).sum())
                    nbytes = sel * (H + H // 32 + 16 if args.op == "dispatch" else 2 * H)
                else:
                    buf = moe_ep.Buffer(None, _normal_hint(n, H, K, world), 0, backend=backend)
                    lay = buf.get_dispatch_layout(idx, E)
                    kw = dict(num_tokens_per_rank=lay[0], is_token_in_rank=lay[3], num_tokens_per_expert=lay[2],
                              topk_idx=idx, topk_weights=w)
                    out = buf.dispatch(q, **kw)
                    handle, recv_x = out[4], out[0]
                    yb = (recv_x[0] if isinstance(recv_x, tuple) else recv_x).float().to(torch.bfloat16)
                    fn = ((lambda buf=buf, kw=kw: buf.dispatch(q, **kw)) if args.op == "dispatch"
                          else (lambda buf=buf, yb=yb, handle=handle: buf.combine(yb, handle)))
                    nbytes = int(lay[0].sum()) * (H + H // 32 if args.op == "dispatch" else 2 * H)
                torch.cuda.synchronize(device)
                t, per_rank = _common.time_ranks(fn, device, iters=args.iters)
                results[backend] = (t, per_rank, nbytes)
                del buf, fn
                dist.barrier()
            dee = None  # DeepEP: (Timing, per-rank medians) or None
            dee_note = deepep_line if deep_ep is None else None
            if deep_ep is not None:
                try:
                    case = DeepEPCase(deep_ep, group, args.op, mode, x, q, idx, w, n, H, E, world)
                    torch.cuda.synchronize(device)
                    dee = _common.time_ranks(case.fn, device, iters=args.iters)
                    dee_note = f"DeepEP buffer {case.hint / 1e6:.1f} MB per rank (its size hint)"
                    del case
                except Exception as exc:  # noqa: BLE001 - the baseline failing must not stop our rows
                    dee_note = f"DeepEP failed on this case: {type(exc).__name__}: {str(exc)[:120]}"
                    say(f"# {mode} {rt}: {dee_note}", flush=True)
                torch.cuda.synchronize(device)
                dist.barrier()
            for backend, (t, per_rank, nbytes) in results.items():
                total = torch.tensor([nbytes], dtype=torch.float64, device=device)
                dist.all_reduce(total)
                gbps = float(total) / world / t.median / 1e3  # per rank, against the slowest rank's time
                d_us = dee[0].median if dee else None
                tb = results.get("torch") if backend != "torch" else None
                t_us = tb[0].median if tb else None
                say(f"| {backend} | {mode} | {rt} | {world} | {n} | {t.median:.1f} | {t.p10:.1f}-{t.p90:.1f} | "
                    f"{' '.join(f'{v:.0f}' for v in per_rank)} | {gbps:.0f} | "
                    f"{f'{100 * gbps / peer:.0f}%' if peer else 'n/a'} | {f'{d_us:.1f}' if d_us else 'n/a'} | "
                    f"{f'{t.median / d_us:.2f}' if d_us else 'n/a'} | {f'{t_us:.1f}' if t_us else '-'} | "
                    f"{f'{t.median / t_us:.2f}' if t_us else '-'} |", flush=True)
                case_name = f"{args.op} {mode} {rt} EP{world} {n} tokens/rank torchrun {backend}"
                note = ("real ranks (torchrun); not checked against a reference here (pytest -m gpu checks the real "
                        "path); baseline: DeepEP on the same inputs (ratio = DeepEP / ours); " + (dee_note or ""))
                rec.add(case_name, "time", t.median, "us", p10=t.p10, p90=t.p90, iterations=t.n, baseline=d_us,
                        ratio=(d_us / t.median) if d_us else None, valid=True, l2_resident=False, note=note,
                        per_rank_us=per_rank, bytes_per_rank=float(total) / world, routing=rt, backend=backend,
                        baseline_name="deep_ep.Buffer" if d_us else None,
                        ours_over_deepep=(t.median / d_us) if d_us else None,
                        deepep_per_rank_us=dee[1] if dee else None, deepep_p10=dee[0].p10 if dee else None,
                        deepep_p90=dee[0].p90 if dee else None, torch_us=t_us,
                        ours_over_torch=(t.median / t_us) if t_us else None)
                rec.add(case_name, "bandwidth", gbps, "GB/s", iterations=t.n, limit=peer,
                        ratio=(gbps / peer) if peer else None, valid=True, l2_resident=False,
                        note="per-rank bytes over the slowest rank's time; limit: peer copy (header limits.peer_gbps)",
                        routing=rt, backend=backend, limit_name="peer_gbps")
            dist.barrier()
    return rec.finish(prog) if rank == 0 else 0


def _normal_hint(n, H, K, world):
    from moe_ep.backends.symm import SymmBackend

    return SymmBackend.get_normal_size_hint(n, H, K, world)


def deepep_normal_nvl_bytes(hidden: int, num_ranks: int, num_sms: int = 20, num_recv_tokens: int = 256) -> int:
    """DeepEP's intranode ``Config.get_nvl_buffer_size_hint`` (BF16 hidden bytes, its top-k/scale maxima of
    128, 8-byte source metadata), restated here for the memory comparison."""
    channels, per_token = num_sms // 2, 2 * hidden + 8 + 128 * 8 + 128 * 4 + 128 * 4
    nbytes = channels * num_ranks * (2 + 3) * 4 + channels * num_ranks * num_recv_tokens * per_token
    return (nbytes + 127) // 128 * 128


TOL = 2e-2  # max |out - ref| / max |ref| (BF16 rounding of the combine; dispatch sums are float32)


def _bytes_needed(mode, R, n, args) -> int:
    """Device bytes the virtual ranks of one case need (buffers, inputs, worst-case receive tensors, baseline)."""
    from moe_ep.backends.symm import SymmBackend

    H, E, K = args.hidden, args.experts, args.topk
    inputs = R * n * (2 * H + 16 * K) * 3  # BF16 x, routing; baseline copies of them
    if mode == "LL":
        recv = R * (E // R) * R * n * (2 * H)  # per rank [L, R*T, H] (BF16 upper bound)
        return R * SymmBackend.get_low_latency_size_hint(n, H, R, E, K) + 2 * recv + inputs
    worst = R * n
    return R * SymmBackend.get_normal_size_hint(n, H, K, R) + 3 * R * worst * (2 * H + 4 * K) + inputs


def main(argv=None, op=None) -> int:
    args, prog = _parse(argv, op)
    if args.launcher == "torchrun":
        return main_torchrun(args, prog, argv)
    if args.cpu_smoke:
        device = torch.device("cpu")
    elif _common.gpu_count():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        return _common.no_gpu(prog)
    bench = prog[:-3]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    rec = _common.Records(bench, args.json, args.cpu_smoke, device=name, argv=argv)
    time_us = _timer(device, not args.no_graph, args.iters)
    limits = _common.measure_limits(device, peer=False, fp8=False)
    rec.update_header(limits=limits, launcher="virtual")
    copy = limits["copy_gbps"]
    l2 = limits["l2_bytes"] or 0
    H = args.hidden
    per_row = {"LL": H + H // 32 + 16 if args.op == "dispatch" else 2 * H,  # per selection
               "normal": H + H // 32 if args.op == "dispatch" else 2 * H}  # per token-rank row
    try:
        import moe_ep.backends.symm_normal  # noqa: F401
        modes = [("LL", args.ll_tokens, _ll_case), ("normal", args.normal_tokens, _normal_case)]
    except ImportError:
        modes = [("LL", args.ll_tokens, _ll_case)]
    cases = [(m, n, c, R, rt) for m, n, c in modes for rt in args.routing for R in args.ranks if args.experts % R == 0]
    for R in args.ranks:
        if args.experts % R:
            print(f"{prog}: skipping EP{R}: --experts {args.experts} is not divisible by it", file=sys.stderr)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    print(f"# symm {args.op}, {_common.VIRTUAL_NOTE} (one process plays every rank on {name}), {rec.header['date']}, "
          f"commit {rec.header['commit']}; hidden {H}, {args.experts} experts, top-{args.topk}; copy bandwidth "
          f"{copy:.0f} GB/s (measured now, {'1 GiB' if device.type == 'cuda' else '16 MiB'} buffers); L2 "
          f"{l2 / 2**20:.0f} MiB, flushed before every timed call; times for all ranks together, median of {args.iters}; "
          f"bytes: LL per selection (-1 entries excluded), normal per received token-rank row", flush=True)
    print(_common.table_header(["mode", "routing", "EP", "tokens/rank", "rows moved", "us", "p10-p90 us", "us/rank",
                                "GB/s", "% of copy", "torch us", "x torch", "timed as", "notes", "check"]), flush=True)
    prog_bar = _common.Progress(len(cases), args.op) if len(cases) > 1 else None
    for mode, n, case, R, rt in cases:
        args.cur_routing = rt
        need = _bytes_needed(mode, R, n, args)
        if free is not None and need > 0.85 * free:
            print(f"| {mode} | {rt} | {R} | {n} | skipped: the virtual ranks need ~{need / 1e9:.0f} GB, "
                  f"{free / 1e9:.0f} GB free on one GPU (use --launcher torchrun) |||||||||||", flush=True)
            if prog_bar:
                prog_bar.step(f"{mode} {rt} EP{R} skipped")
            continue
        t, rows, err = case(args.op, R, args, device, time_us)
        how, kernels = time_us.how, time_us.kernels
        us = t.median
        xs, idxs, ws = _inputs(R, n, H, args.experts, args.topk, device, seed=2, routing=rt)
        base, _ = time_us(_torch_baseline(args.op, xs, idxs, ws, args.experts, per_token_rank=mode == "normal"))
        del xs, idxs, ws
        nbytes = rows * per_row[mode]
        gbps = nbytes / us / 1e3
        fits = bool(l2) and nbytes <= l2
        notes = [_common.VIRTUAL_NOTE]
        if fits:
            notes.append("payload fits in L2: the staged copy may stay in L2 between send and receive, so % of the "
                         "HBM copy limit is not a bound")
        note = "; ".join(notes)
        valid = err <= TOL
        check = f"ok ({err:.1e})" if valid else f"INVALID ({err:.1e} > {TOL})"
        if prog_bar:
            prog_bar.step(f"{mode} {rt} EP{R}")
        print(f"| {mode} | {rt} | {R} | {n} | {rows} | {us:.1f} | {t.p10:.1f}-{t.p90:.1f} | {us / R:.1f} | {gbps:.0f} | "
              f"{100 * gbps / copy:.0f}%{' (L2)' if fits else ''} | {base.median:.1f} | {base.median / us:.2f} | {how} | "
              f"{'V, L2' if fits else 'V'} | {check} |", flush=True)
        case_name = f"{args.op} {mode} {rt} EP{R} {n} tokens/rank"
        resident = None if device.type != "cuda" else False
        rec.add(case_name, "time", us, "us", p10=t.p10, p90=t.p90, iterations=t.n,
                baseline=base.median, limit=None, ratio=base.median / us, valid=valid, l2_resident=resident, note=note,
                rel_err=err, rows=rows, bytes=nbytes, routing=rt, timed_as=how, fits_l2=fits, method=_common.how_method(how),
                kernels_us=kernels, kernels_method=_common.PROFILER if kernels is not None else None,
                baseline_inputs="FP8 (quantized before the timer)" if mode == "normal" and args.op == "dispatch"
                else "BF16")
        rec.add(case_name, "bandwidth", gbps, "GB/s", iterations=t.n, limit=copy, ratio=gbps / copy, valid=valid,
                l2_resident=resident, note=note, limit_name="device copy bandwidth (HBM, 1 GiB buffers)",
                method=_common.how_method(how),
                routing=rt, fits_l2=fits)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if prog_bar:
        prog_bar.close()
    print(f"\nnotes: V = {_common.VIRTUAL_NOTE} (a real EP run adds NVLink transfers and waits for the slowest peer: "
          f"--launcher torchrun); L2 = the bytes moved fit in L2 ({l2 / 2**20:.0f} MiB). torch baseline: normal-mode "
          f"dispatch gets FP8 inputs quantized before the timer (as ours), low-latency dispatch quantizes inside "
          f"(as ours).")
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
    return rec.finish(prog)


if __name__ == "__main__":
    sys.exit(main())
