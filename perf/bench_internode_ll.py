"""Internode low-latency dispatch and combine at DeepEP's decode shapes, one process per GPU on N nodes x 8 GPUs.

Run it with ``perf/launch_internode.sh`` (torchrun on every node, the NVSHMEM/IBGDA environment set and
printed), or directly: ``torchrun --nnodes N --nproc-per-node 8 ... perf/bench_internode_ll.py``. Every rank
builds ``moe_ep.Buffer(group, 0, num_rdma_bytes, low_latency_mode=True, backend=B)`` for each ``--backend``
(``nvshmem`` by default: the RDMA transport; ``symm`` reaches only GPUs that share memory, so it is for one
node) and times ``low_latency_dispatch`` (FP8 cast fused into the send, ``--no-fp8``: BF16) and
``low_latency_combine`` (BF16, weighted; ``--zero-copy``: expert outputs written into the buffer from
``get_next_low_latency_combine_buffer`` before the timer). When ``import deep_ep`` works, DeepEP V1 runs
in the same invocation on the same inputs: ``deep_ep.Buffer(group, 0, get_low_latency_rdma_size_hint(T, H,
R, E), low_latency_mode=True, num_qps_per_rank=E / R)`` and its ``low_latency_dispatch`` /
``low_latency_combine``; otherwise one line says it is skipped and why. A backend this ``moe_ep`` does not
accept is skipped with one line.

Shapes (defaults = DeepEP's published low-latency setting): ``--tokens`` 128 per rank, ``--hidden`` 7168,
``--topk`` 8, ``--experts`` 256, routing ``--routing uniform`` (top-k of uniform scores; the other choices
are bench_dispatch.py's). Inputs are exactly representable in FP8 (small integers times 2^-6, and one
element of each 128-channel group at 448 x 2^-6, so every group's scale is a power of two): any correct FP8
cast, ours or DeepEP's, reproduces them, which keeps the checks tight.

Timing (perf/_common.py ``time_ranks``): a barrier before every timed call, CUDA events per rank, L2 flushed
outside the events, ``--warmup`` untimed calls; per iteration the slowest rank's time; reported: median,
p10 and p90 of those over ``--iters`` iterations, and each rank's median. Eager launches by default (the
events include the host's launch of the call); ``--graph`` times CUDA-graph replays of the call (kernel time
without launch overhead, closer to how DeepEP's figures were taken: kernel times from its profiler).

Bytes (DESIGN.md, Performance method; DeepEP's own count): per rank, dispatch = selections x (H + H/32 + 16)
with FP8 (2H with BF16), combine = selections x 2H, where selections are the rank's top-k entries that are not
-1. ``GB/s`` = the mean over ranks of those bytes / the slowest-rank median. ``internode GB/s`` counts only the
selections whose expert lives on another node (rank // gpus-per-node differs): the bytes that must cross the
NIC. ``--nic-gbps`` (the NIC's line rate in GB/s, e.g. 50 for a 400 Gb/s port) adds it as the bandwidth
rows' limit; the bench does not measure the NIC.

Targets: DeepEP's published H800 + ConnectX-7 InfiniBand 400 Gb/s figures (one NIC per GPU; 128 tokens per
rank, hidden 7168, top-8, 256 experts, FP8 dispatch, BF16 combine; pure RDMA: every peer through the NIC),
dispatch / combine latency in us: EP16 118 / 195, EP32 155 / 273, EP64 173 / 314, EP128 192 / 369. Source:
DeepEP V1 documentation, "Low-latency kernels with pure RDMA" table (github.com/deepseek-ai/DeepEP,
README.md of the V1 releases, now docs/legacy.md). Rows at those EP sizes and shapes carry ``published_us``
and ``published_over_ours`` (>= 1: at or better than the target); ``--pure-rdma`` (launch_internode.sh
``PURE_RDMA=1``) sends same-node peers through the NIC too, as those figures were taken.

Checks, after timing, on the output of the last timed call: dispatch: every rank's ``recv_count`` equals
the all-reduced per-expert count of selections, and per local expert the sum of its received rows (FP8
dequantized) equals the sum of the tokens that selected it (all-reduced from every rank's inputs);
combine: with expert outputs = received rows x 2^(e mod 3 - 1) (expert e), each token's output equals the
torch math of its dispatched rows, sum_k w_k x 2^(e_k mod 3 - 1) x token, rounded to BF16 once. A failed
check marks the rows INVALID (exit 1).

    bash perf/launch_internode.sh                      # on each node: NNODES, NODE_RANK, MASTER_ADDR set
    torchrun --nproc-per-node 8 perf/bench_internode_ll.py --backend nvshmem symm --json ll8.jsonl   # one node
    python perf/bench_internode_ll.py --cpu-smoke      # forked gloo CPU ranks, 2 emulated nodes, tiny shapes
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

_common.smoke_env()  # TRITON_INTERPRET=1 before any @triton.jit in moe_ep

import torch  # noqa: E402

PROG = "bench_internode_ll.py"
# DeepEP V1's published low-latency figures, H800 + CX7 400 Gb/s, pure RDMA: EP -> (dispatch us, combine us)
PUBLISHED = {16: (118.0, 195.0), 32: (155.0, 273.0), 64: (173.0, 314.0), 128: (192.0, 369.0)}
PUBLISHED_SHAPE = {"tokens": 128, "hidden": 7168, "topk": 8, "experts": 256}
PUBLISHED_SOURCE = ("DeepEP V1 docs, 'Low-latency kernels with pure RDMA' (github.com/deepseek-ai/DeepEP README.md of "
                    "the V1 releases, now docs/legacy.md): H800, CX7 InfiniBand 400 Gb/s per GPU, 128 tokens/rank, "
                    "hidden 7168, top-8, 256 experts, FP8 dispatch, BF16 combine")
BACKENDS = ("nvshmem", "symm", "none")
SMOKE = dict(launcher="fork", ranks=4, gpus_per_node=2, tokens=4, hidden=256, experts=16, topk=4, iters=2, warmup=1,
             backend=["symm", "nvshmem"])
DISPATCH_TOL = 1e-4  # float32 sums of exactly representable rows: only the summation order differs
COMBINE_TOL = 1e-2  # one BF16 rounding (2^-8) of the weighted sum, plus the summation order


def _parse(argv=None):
    from bench_dispatch import ROUTINGS

    argv = sys.argv[1:] if argv is None else list(argv)
    p = _common.parser(PROG, __doc__, smoke_help="run the CPU variant: forked gloo ranks (moe_ep.testing.launch) through "
                       "the real moe_ep.Buffer API, Triton interpreter, 4 ranks as 2 emulated nodes x 2, tiny shapes "
                       "unless given explicitly (numbers meaningless; checks the code paths)")
    p.add_argument("--launcher", choices=["torchrun", "fork"], default="torchrun",
                   help="torchrun: one process per GPU (RANK, WORLD_SIZE, LOCAL_RANK from torchrun; "
                        "perf/launch_internode.sh); fork: forked gloo CPU ranks, --cpu-smoke only")
    p.add_argument("--ranks", type=int, default=4, help="ranks under --launcher fork (torchrun: the world size)")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="ranks per node, for the internode byte count (default: torchrun's LOCAL_WORLD_SIZE, else 8)")
    p.add_argument("--backend", nargs="+", choices=BACKENDS, default=["nvshmem"],
                   help="moe_ep.Buffer backends to time, in this order (none: DeepEP only); one this moe_ep does not "
                        "accept is skipped with one line")
    p.add_argument("--no-deepep", action="store_true",
                   help="do not time DeepEP V1 (deep_ep.Buffer) even when it is importable")
    p.add_argument("--tokens", type=int, default=128, help="T: tokens per rank (num_max_dispatch_tokens_per_rank)")
    p.add_argument("--hidden", type=int, default=7168, help="hidden size H (a multiple of 128)")
    p.add_argument("--experts", type=int, default=256, help="routed experts E (a multiple of the world size)")
    p.add_argument("--topk", type=int, default=8, help="experts per token K")
    p.add_argument("--routing", choices=ROUTINGS, default="uniform", help="routing of the tokens (see bench_dispatch.py)")
    p.add_argument("--no-fp8", action="store_true", help="dispatch BF16 rows instead of FP8 (bytes: selections x 2H)")
    p.add_argument("--zero-copy", action="store_true",
                   help="combine from get_next_low_latency_combine_buffer (filled before the timer) with zero_copy=True")
    p.add_argument("--pure-rdma", action="store_true",
                   help="allow_nvlink_for_low_latency_mode=False: same-node peers go through the NIC too (as DeepEP's "
                        "published figures were taken); set NVSHMEM_DISABLE_P2P=1 too (launch_internode.sh PURE_RDMA=1)")
    p.add_argument("--graph", action="store_true",
                   help="time CUDA-graph replays of each call (falls back to eager launches, said in the row)")
    p.add_argument("--iters", type=int, default=50, help="timed calls per case (median, p10, p90; --cpu-smoke: 2)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls before the timed ones")
    p.add_argument("--nic-gbps", type=float, default=None,
                   help="the NIC's line rate per GPU in GB/s (e.g. 50 for 400 Gb/s): the limit of the bandwidth rows")
    p.add_argument("--rdma-bytes", type=int, default=None,
                   help="num_rdma_bytes of our Buffer (default: the exact low-latency size for these shapes)")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs (each rank adds its rank)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before forked ranks are killed (fork)")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        _common.smoke_defaults(args, p, argv, **SMOKE)
    if args.launcher == "fork" and not args.cpu_smoke:
        p.error("--launcher fork runs forked gloo CPU ranks: only with --cpu-smoke (on GPUs use torchrun, e.g. "
                "perf/launch_internode.sh)")
    for name in ("tokens", "hidden", "experts", "topk", "iters", "ranks"):
        if getattr(args, name) < 1:
            p.error(f"argument --{name}: must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"argument --warmup: must be >= 0, got {args.warmup}")
    if args.hidden % 128:
        p.error(f"argument --hidden: must be a multiple of 128, got {args.hidden}")
    if args.topk > args.experts:
        p.error(f"argument --topk: must be <= --experts ({args.experts}), got {args.topk}")
    if args.graph and args.zero_copy:
        p.error("--graph and --zero-copy together are not supported (the zero-copy buffer alternates between calls)")
    if "none" in args.backend and len(args.backend) > 1:
        p.error("--backend none (DeepEP only) cannot be combined with other backends")
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        p.error(f"argument --gpus-per-node: must be >= 1, got {args.gpus_per_node}")
    return args


# ------------------------------------------------------------------------------------------------ inputs

def make_inputs(rank: int, args, device):
    """``(x [T, H] BF16, topk_idx [T, K] int64, topk_weights [T, K] float32)`` of one rank. ``x`` is exactly
    representable in FP8 e4m3 with a power-of-two scale per 128 channels: integers in [-16, 16] times 2^-6, and
    one element of each group at +-7 (= 448 x 2^-6, the group's amax)."""
    from bench_dispatch import route

    T, H, E, K = args.tokens, args.hidden, args.experts, args.topk
    g = torch.Generator().manual_seed(args.seed * 100003 + rank)
    x = torch.randint(-16, 17, (T, H), generator=g).float() / 64
    col = torch.randint(0, 128, (T, H // 128), generator=g) + torch.arange(0, H, 128)
    sign = torch.where(torch.rand(T, H // 128, generator=g) < 0.5, -1.0, 1.0)
    x.scatter_(1, col, 7.0 * sign)
    idx = route(T, E, K, args.routing, g)
    w = torch.rand(T, K, generator=g)
    return x.to(torch.bfloat16).to(device), idx.to(device), w.to(device)


def expert_factor(e: torch.Tensor) -> torch.Tensor:
    """The stand-in expert's output scale, 2^(e mod 3 - 1): exact in BF16, different for neighbouring experts."""
    return torch.exp2((e.remainder(3) - 1).float())


def bytes_per_selection(op: str, hidden: int, fp8: bool) -> int:
    """DeepEP's low-latency count: dispatch H + H/32 + 16 (FP8 payload, scales, header) or 2H (BF16); combine 2H."""
    if op == "dispatch":
        return hidden + hidden // 32 + 16 if fp8 else 2 * hidden
    return 2 * hidden


def published(world: int, args) -> tuple | None:
    """DeepEP's published (dispatch us, combine us) for this EP size, or None (other sizes, shapes, routings or
    formats: DeepEP's test routes each token to the top-k of random scores, our ``uniform``)."""
    shape = {"tokens": args.tokens, "hidden": args.hidden, "topk": args.topk, "experts": args.experts}
    if args.cpu_smoke or args.no_fp8 or args.routing != "uniform" or shape != PUBLISHED_SHAPE:
        return None
    return PUBLISHED.get(world)


# ------------------------------------------------------------------------------------------------ per rank

class Ctx:
    """What one rank knows: rank, world, device, gpus per node, and small collective helpers (tensors on the
    device for NCCL, on the CPU for gloo)."""

    def __init__(self, rank, world, device, gpus_per_node):
        import torch.distributed as dist

        self.dist, self.rank, self.world, self.device = dist, rank, world, device
        self.cuda = device.type == "cuda"
        self.gpn = gpus_per_node
        self.nodes = world // gpus_per_node

    def all_reduce(self, t, op="sum"):
        ops = {"sum": self.dist.ReduceOp.SUM, "max": self.dist.ReduceOp.MAX, "min": self.dist.ReduceOp.MIN}
        self.dist.all_reduce(t, op=ops[op])
        return t

    def agree(self, ok: bool) -> bool:
        """True when every rank says True."""
        return bool(self.all_reduce(torch.tensor([int(ok)], device=self.device), "min").item())

    def worst(self, *vals) -> list:
        """Per value, the maximum over ranks."""
        return self.all_reduce(torch.tensor(vals, dtype=torch.float64, device=self.device), "max").tolist()

    def mean(self, *vals) -> list:
        return [v / self.world for v in self.all_reduce(torch.tensor(vals, dtype=torch.float64,
                                                                     device=self.device)).tolist()]


def _timed(fn, ctx, args, between=None):
    """``(Timing of the slowest rank per iteration, per-rank medians, output of the last timed call, how)``."""
    if ctx.cuda and args.graph:
        replay, out, note = _common.graph_fn(fn, ctx.device)
        t, per_rank = _common.time_ranks(replay, ctx.device, iters=args.iters, warmup=args.warmup, between=between)
        return t, per_rank, out, note or "CUDA graph replay"
    box = {}

    def run():
        box["out"] = fn()
    t, per_rank = _common.time_ranks(run, ctx.device, iters=args.iters, warmup=args.warmup, between=between)
    return t, per_rank, box["out"], "eager launches" if ctx.cuda else "CPU (gloo ranks)"


def _rows_of(recv_x, fp8: bool, le: int, c: int) -> torch.Tensor:
    """Local expert ``le``'s first ``c`` received rows as float32 (FP8 dequantized with its scales)."""
    from moe_ep.fp8 import dequant_fp8_ref

    if fp8:
        q, s = recv_x
        return dequant_fp8_ref(q[le, :c], s[le, :c])
    return recv_x[le, :c].float()


def check_dispatch(out, x, idx, args, ctx) -> tuple:
    """``(ok, rel_err, counts_ok)`` agreed over ranks (see the module doc)."""
    E, K, H = args.experts, args.topk, args.hidden
    L = E // ctx.world
    fp8 = not args.no_fp8
    recv_x, count = out[0], out[1]
    sel = idx >= 0
    counts = ctx.all_reduce(torch.bincount(idx[sel], minlength=E).to(torch.int64))
    mine = slice(ctx.rank * L, (ctx.rank + 1) * L)
    counts_ok = torch.equal(count.to(torch.int64).cpu(), counts[mine].cpu())
    ref = torch.zeros(E, H, dtype=torch.float32, device=x.device)
    ref.index_add_(0, idx[sel], x.float().unsqueeze(1).expand(-1, K, -1)[sel])
    ctx.all_reduce(ref)
    got = torch.zeros(L, H, dtype=torch.float32, device=x.device)
    if counts_ok:
        for le in range(L):
            c = int(count[le])
            if c:
                got[le] = _rows_of(recv_x, fp8, le, c).sum(0)
    err = _common.rel_err(got, ref[mine]) if counts_ok else float("inf")
    err, bad_counts = ctx.worst(err, float(not counts_ok))
    return err <= DISPATCH_TOL, err, not bad_counts


def expert_outputs(out, args, ctx) -> torch.Tensor:
    """``[L, R*T, H]`` BF16: each received row (dequantized) times its expert's factor (rows past the count: 0)."""
    L = args.experts // ctx.world
    fp8 = not args.no_fp8
    recv_x, count = out[0], out[1]
    y = torch.zeros(L, ctx.world * args.tokens, args.hidden, dtype=torch.bfloat16, device=count.device)
    f = expert_factor(torch.arange(ctx.rank * L, (ctx.rank + 1) * L, device=count.device))
    for le in range(L):
        c = int(count[le])
        if c:
            y[le, :c] = (_rows_of(recv_x, fp8, le, c) * f[le]).to(torch.bfloat16)
    return y


def check_combine(combined, x, idx, w, ctx) -> tuple:
    """``(ok, rel_err)`` agreed over ranks: out[t] = sum_k w[t, k] * factor(e_k) * x[t], rounded to BF16 once."""
    sel = idx >= 0
    coef = (w.float() * expert_factor(idx.clamp_min(0)) * sel).sum(1, keepdim=True)
    ref = (coef * x.float()).to(torch.bfloat16)
    err = ctx.worst(_common.rel_err(combined, ref))[0]
    return err <= COMBINE_TOL, err


def _ll_hint(args, world, backend: str = "nvshmem") -> int:
    """num_rdma_bytes of our Buffer: ``--rdma-bytes`` or the exact low-latency size of the backend's layout (the
    nvshmem backend adds a staging area to the symm layout)."""
    if args.rdma_bytes:
        return args.rdma_bytes
    if backend == "nvshmem":
        from moe_ep.backends.nvshmem import NvshmemBackend as Backend
    else:
        from moe_ep.backends.symm import SymmBackend as Backend

    return Backend.get_low_latency_size_hint(args.tokens, args.hidden, world, args.experts, args.topk)


def _make_ours(name, args, ctx):
    """``(Buffer or None, line or None)``: constructing it is the availability test (agreed over ranks)."""
    import moe_ep

    buf, err = None, None
    try:
        buf = moe_ep.Buffer(None, 0, _ll_hint(args, ctx.world, name), low_latency_mode=True, backend=name,
                            allow_nvlink_for_low_latency_mode=not args.pure_rdma, explicitly_destroy=True)
    except Exception as exc:  # noqa: BLE001 - a backend this moe_ep lacks, or missing NVSHMEM: one line, skipped
        err = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    if not ctx.agree(err is None):
        if buf is not None:
            buf.destroy()
        what = "not accepted by this moe_ep.Buffer" if err and "backend must be one of" in err else "unavailable"
        return None, f"backend {name}: {what} ({err or 'failed on another rank'}); skipped"
    return buf, None


class DeepEPLL:
    """DeepEP V1's low-latency path on the same inputs: ``Buffer(group, 0, get_low_latency_rdma_size_hint(T, H, R,
    E), low_latency_mode=True, num_qps_per_rank=E / R)`` (its documented decode setup)."""

    def __init__(self, deep_ep, args, ctx):
        import torch.distributed as dist

        B = deep_ep.Buffer
        self.hint = B.get_low_latency_rdma_size_hint(args.tokens, args.hidden, ctx.world, args.experts)
        kw = dict(low_latency_mode=True, num_qps_per_rank=max(1, args.experts // ctx.world))
        try:
            self.buf = B(dist.group.WORLD, 0, self.hint, allow_nvlink_for_low_latency_mode=not args.pure_rdma, **kw)
        except TypeError:  # a DeepEP without allow_nvlink_for_low_latency_mode
            self.buf = B(dist.group.WORLD, 0, self.hint, **kw)
        self.idx_dtype = getattr(deep_ep, "topk_idx_t", torch.int64)

    def low_latency_dispatch(self, x, idx, T, E, use_fp8):
        return self.buf.low_latency_dispatch(x, idx.to(self.idx_dtype), T, E, use_fp8=use_fp8)

    def low_latency_combine(self, y, idx, w, handle, zero_copy=False):
        return self.buf.low_latency_combine(y, idx.to(self.idx_dtype), w, handle, zero_copy=zero_copy)

    def get_next_low_latency_combine_buffer(self, handle):
        return self.buf.get_next_low_latency_combine_buffer(handle)

    def destroy(self):
        if hasattr(self.buf, "destroy") and getattr(self.buf, "explicitly_destroy", False):
            self.buf.destroy()
        self.buf = None


def measure(label, buf, inputs, args, ctx, say) -> list:
    """Dispatch then combine of one backend: a result dict per op (timings, bytes, checks), agreed over ranks."""
    x, idx, w = inputs
    T, E, H = args.tokens, args.experts, args.hidden
    fp8 = not args.no_fp8

    def dispatch():
        return buf.low_latency_dispatch(x, idx, T, E, use_fp8=fp8)

    say(f"  {label}: dispatch ...")
    t_d, per_d, out, how_d = _timed(dispatch, ctx, args)
    ok_d, err_d, counts_ok = check_dispatch(out, x, idx, args, ctx)
    out = dispatch()  # a fresh dispatch for the combine: its handle and received rows
    y = expert_outputs(out, args, ctx)
    handle = out[2]
    say(f"  {label}: combine ...")
    if args.zero_copy:
        box = {}

        def fill():
            box["z"] = buf.get_next_low_latency_combine_buffer(handle)
            box["z"].copy_(y)

        def combine():
            if "z" not in box:  # warm-up calls: the buffer is filled here, untimed anyway
                fill()
            z = box.pop("z")
            return buf.low_latency_combine(z, idx, w, handle, zero_copy=True)
        t_c, per_c, res, how_c = _timed(combine, ctx, args, between=fill)
    else:
        t_c, per_c, res, how_c = _timed(lambda: buf.low_latency_combine(y, idx, w, handle), ctx, args)
    ok_c, err_c = check_combine(res[0], x, idx, w, ctx)
    sel = idx >= 0
    cross = sel & ((idx // (E // ctx.world)) // ctx.gpn != ctx.rank // ctx.gpn)
    n_sel, n_cross = ctx.mean(float(sel.sum()), float(cross.sum()))
    out_rows = []
    for op, t, per, how, ok, err in (("dispatch", t_d, per_d, how_d, ok_d, err_d),
                                     ("combine", t_c, per_c, how_c, ok_c, err_c)):
        b = bytes_per_selection(op, H, fp8)
        out_rows.append(dict(backend=label, op=op, t=tuple(t), per_rank=per, how=how, valid=ok, rel_err=err,
                             counts_ok=counts_ok if op == "dispatch" else None, selections=n_sel,
                             internode_selections=n_cross, bytes=n_sel * b, internode_bytes=n_cross * b))
    return out_rows


def rank_body(rank, world, args, device, deep_ep, say=lambda *a, **k: None) -> dict:
    """Everything one rank runs; returns ``{"results": [...], "lines": [...]}`` (the same on every rank)."""
    gpn = args.gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", 0) or 8)
    gpn = min(gpn, world)
    if world % gpn:
        raise ValueError(f"the world size {world} is not a multiple of --gpus-per-node {gpn}")
    if args.experts % world:
        raise ValueError(f"--experts {args.experts} is not divisible by the world size {world}")
    ctx = Ctx(rank, world, device, gpn)
    inputs = make_inputs(rank, args, device)
    results, lines = [], []
    for name in args.backend:
        if name == "none":
            continue
        buf, line = _make_ours(name, args, ctx)
        if buf is None:
            lines.append(line)
            continue
        try:
            results += measure(name, buf, inputs, args, ctx, say)
        finally:
            buf.destroy()
        ctx.dist.barrier()
    if deep_ep is not None:
        case, err = None, None
        try:
            case = DeepEPLL(deep_ep, args, ctx)
        except Exception as exc:  # noqa: BLE001 - the baseline failing must not stop our rows
            err = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        if ctx.agree(err is None):
            results += measure("deep_ep", case, inputs, args, ctx, say)
            lines.append(f"DeepEP buffer: {case.hint / 1e6:.1f} MB per rank (its get_low_latency_rdma_size_hint)")
            case.destroy()
        else:
            lines.append(f"DeepEP baseline: failed to build its Buffer ({err or 'failed on another rank'}); skipped")
    return {"results": results, "lines": lines, "gpus_per_node": gpn, "world": world}


# ------------------------------------------------------------------------------------------------ report

def report(rec, body, args, deepep_line) -> None:
    """Print the table (the caller is rank 0 or the fork parent) and add the JSON rows."""
    world, gpn = body["world"], body["gpus_per_node"]
    pub = published(world, args)
    res = body["results"]
    dee = {r["op"]: r for r in res if r["backend"] == "deep_ep"}
    smoke = " (CPU smoke: numbers meaningless)" if args.cpu_smoke else ""
    print(f"# low-latency dispatch/combine, {world} ranks = {world // gpn} nodes x {gpn}, {rec.header['device']}, "
          f"commit {rec.header['commit']}{smoke}; T={args.tokens} tokens/rank, hidden {args.hidden}, "
          f"{args.experts} experts, top-{args.topk}, routing {args.routing}, dispatch {'BF16' if args.no_fp8 else 'FP8'}"
          f", combine BF16{' zero-copy' if args.zero_copy else ''}{', pure RDMA' if args.pure_rdma else ''}; "
          f"slowest rank per iteration, median of {args.iters}", flush=True)
    print(f"# {deepep_line}")
    for line in body["lines"]:
        print(f"# {line}")
    target = (f"EP{world} dispatch {pub[0]:.0f} us, combine {pub[1]:.0f} us" if pub else
              "n/a (published for EP16/32/64/128 at the default shapes, uniform routing, FP8 dispatch only)")
    print(f"# DeepEP published target: {target} ({PUBLISHED_SOURCE})")
    print(_common.table_header(["backend", "op", "EP", "us", "p10-p90 us", "per-rank medians us", "GB/s",
                                "internode GB/s", "DeepEP published us", "published/ours", "DeepEP us", "DeepEP/ours",
                                "timed as", "check"]), flush=True)
    nic = args.nic_gbps
    for r in res:
        t = _common.Timing(r["t"])
        gbps = r["bytes"] / t.median / 1e3
        inter = r["internode_bytes"] / t.median / 1e3
        p_us = (pub[0] if r["op"] == "dispatch" else pub[1]) if pub else None
        d = dee.get(r["op"]) if r["backend"] != "deep_ep" else None
        d_us = _common.Timing(d["t"]).median if d else None
        err = f"{r['rel_err']:.1e}"
        check = f"ok ({err})" if r["valid"] else f"INVALID ({'counts differ' if r['counts_ok'] is False else err})"
        pr = r["per_rank"]
        print(f"| {r['backend']} | {r['op']} | {world} | {t.median:.1f} | {t.p10:.1f}-{t.p90:.1f} | "
              f"{min(pr):.1f}-{max(pr):.1f} | {gbps:.2f} | {inter:.2f} | {f'{p_us:.0f}' if p_us else 'n/a'} | "
              f"{f'{p_us / t.median:.2f}' if p_us else 'n/a'} | {f'{d_us:.1f}' if d_us else 'n/a'} | "
              f"{f'{d_us / t.median:.2f}' if d_us else 'n/a'} | {r['how']} | {check} |", flush=True)
        case = f"LL {r['op']} {r['backend']} EP{world} {world // gpn}x{gpn} {args.tokens} tokens/rank"
        note = (("CPU smoke: forked gloo ranks, Triton interpreter, numbers meaningless; " if args.cpu_smoke else "")
                + "slowest rank per iteration; baseline = DeepEP V1 measured in the same run (ratio = DeepEP / ours)")
        resident = None if args.cpu_smoke else False
        extra = dict(backend=r["backend"], op=r["op"], world_size=world, nodes=world // gpn, gpus_per_node=gpn,
                     tokens=args.tokens, routing=args.routing, per_rank_us=pr, timed_as=r["how"], rel_err=r["rel_err"],
                     method=_common.how_method(r["how"]),
                     counts_ok=r["counts_ok"], selections_per_rank=r["selections"],
                     internode_selections_per_rank=r["internode_selections"], bytes_per_rank=r["bytes"],
                     internode_bytes_per_rank=r["internode_bytes"], published_us=p_us,
                     published_over_ours=(p_us / t.median) if p_us else None,
                     meets_published=(t.median <= p_us) if p_us else None, published_source=PUBLISHED_SOURCE if p_us
                     else None, baseline_name="deep_ep.Buffer" if d_us else None,
                     ours_over_deepep=(t.median / d_us) if d_us else None)
        rec.add(case, "time", t.median, "us", p10=t.p10, p90=t.p90, iterations=t.n, baseline=d_us,
                ratio=(d_us / t.median) if d_us else None, valid=r["valid"], l2_resident=resident, note=note, **extra)
        for metric, v, what in (("bandwidth", gbps, "every selection's bytes (DeepEP's count)"),
                                ("internode bandwidth", inter, "bytes of selections whose expert is on another node")):
            rec.add(case, metric, v, "GB/s", iterations=t.n, limit=nic, ratio=(v / nic) if nic else None,
                    method=_common.how_method(r["how"]),
                    valid=r["valid"], l2_resident=resident, note=f"per rank (mean), {what}, over the slowest-rank "
                    f"median; limit: --nic-gbps (the NIC's line rate, given, not measured)" + (
                        "; CPU smoke: numbers meaningless" if args.cpu_smoke else ""),
                    backend=r["backend"], op=r["op"], world_size=world, limit_name="nic_gbps" if nic else None)
    if not res:
        print("# nothing was measured: no backend could be built")


def _header_extra(args, world, deepep_line, launcher) -> dict:
    return dict(launcher=launcher, world_size=world, backends=args.backend, deepep=deepep_line,
                limits={"nic_gbps": args.nic_gbps, "nic_gbps_source": "--nic-gbps (given, not measured)"},
                published_source=PUBLISHED_SOURCE, nvshmem_env={k: v for k, v in sorted(os.environ.items())
                                                                if k.startswith("NVSHMEM_")},
                timing="time_ranks: barrier, CUDA events per rank, L2 flushed, slowest rank per iteration"
                + (", CUDA-graph replays" if args.graph else ""))


# ------------------------------------------------------------------------------------------------ launchers

def _fork_rank(rank, world, args):
    say = (lambda *a, **k: print(*a, file=sys.stderr, flush=True)) if rank == 0 else (lambda *a, **k: None)
    return rank_body(rank, world, args, torch.device("cpu"), None, say)


def main_fork(args, argv) -> int:
    from moe_ep.testing import RankFailure, launch

    deepep_line = "DeepEP baseline: skipped (CPU smoke: DeepEP V1 needs GPUs and NVSHMEM); rows carry baseline=null"
    rec = _common.Records(PROG[:-3], args.json, True, device=f"CPU, {args.ranks} forked gloo ranks (Triton "
                          f"interpreter)", argv=argv)
    rec.update_header(**_header_extra(args, args.ranks, deepep_line, "fork"))
    try:
        bodies = launch(_fork_rank, args.ranks, args, timeout_s=args.timeout)
    except RankFailure as exc:
        return _common.error(PROG, f"ranks failed: {str(exc).splitlines()[0][:300]}")
    report(rec, bodies[0], args, deepep_line)
    return rec.finish(PROG)


def main_torchrun(args, argv) -> int:
    bad = _common.torchrun_env_error(PROG, "bash perf/launch_internode.sh (or torchrun --nproc-per-node 8 "
                                           "perf/bench_internode_ll.py)")
    if bad:
        return bad
    deep_ep, deepep_line = _common.deepep_probe(args.no_deepep)
    if not torch.cuda.is_available():
        return _common.error(PROG, "--launcher torchrun needs one CUDA GPU per rank", 2)
    with _common.torchrun_nccl() as (rank, world, device):
        rec, say = _common.torchrun_records(PROG, args.json, argv, rank, world, device)
        rec.update_header(**_header_extra(args, world, deepep_line, "torchrun"))
        body = rank_body(rank, world, args, device, deep_ep, say)
        if rank != 0:
            return 0
        report(rec, body, args, deepep_line)
        return rec.finish(PROG)


def main(argv=None) -> int:
    args = _parse(argv)
    if not args.cpu_smoke and not _common.gpu_count():
        return _common.no_gpu(PROG)
    if args.launcher == "fork":
        return main_fork(args, argv)
    return main_torchrun(args, argv)


if __name__ == "__main__":
    sys.exit(main())
