"""Mega MoE (``moe_ep.gemm.fp8_mega_moe``: dispatch, GEMM1, SwiGLU + FP8 quant, GEMM2 and combine in one kernel
source) against the expert-path layer (``moe_ep.MoELayer``: dispatch + grouped GEMMs + combine) and, when
importable, DeepEP + DeepGEMM, one process per GPU (torchrun), DeepSeek-V3 shapes on EP8 by default.

Cases, per ``--tokens`` T (tokens per rank; every rank has T tokens, top-K uniform routing by default):

- ``fused``: ``fp8_mega_moe(..., mode="fused")``: one persistent launch (the grid the compiled kernel's registers
  and shared memory allow; when it does not fit, the call runs the phases and the row says so);
- ``phased``: the same kernel source as three launches (sends, experts, combine);
- ``layer-decode``: ``MoELayer(mode="decode")`` over a ``symm`` low-latency Buffer (FP8 cast inside the send,
  masked grouped GEMMs, weighted combine); only for T <= ``--decode-max-tokens`` (its receive layout and
  buffer grow with R*T: 898 MiB of buffer per rank at T=2048 on EP8);
- ``layer-prefill``: ``MoELayer(mode="prefill")`` over a ``symm`` normal Buffer (quant, layout, dispatch,
  permute into 128-row expert blocks, contiguous grouped GEMMs, combine);
- ``deepep``: DeepEP's low-latency dispatch / combine with DeepGEMM's masked grouped FP8 GEMMs
  (``m_grouped_fp8_gemm_nt_masked``; the SwiGLU + FP8 quant between them is moe_ep's kernel: DeepGEMM has
  none on Hopper) when ``import deep_ep`` and ``import deep_gemm`` work, T <= ``--decode-max-tokens``;
  otherwise one line says it is skipped and why. (DeepGEMM's own Mega MoE is SM100 FP8 x FP4 only.)

Every case starts from the same BF16 ``x`` [T, H], ``topk_idx`` and ``topk_weights``: the mega cases' timed
region includes filling the symmetric buffer (``per_token_group_quant_fp8`` straight into ``buf.x`` /
``buf.x_sf`` and the two top-k copies), as the layer's includes its FP8 cast. Weights: random, quantized with
128x128 block scales, the same FP8 tensors for every case.

Timing (perf/_common.py ``time_ranks``): a barrier before every timed call, CUDA events per rank, L2 flushed
outside the events, ``--warmup`` untimed calls (compiles); per iteration the slowest rank's time; reported:
median, p10 and p90 over ``--iters`` iterations, and each rank's median. Eager launches.

Ratios: ``vs expert path`` = the faster valid expert-path layer case at that T / ours (``baseline``); ``vs
DeepEP`` = DeepEP + DeepGEMM / ours. Targets (issue 23): at T = 2048, ``fused`` at least 1.3x faster than the
expert-path layer, with no more symmetric memory (the ``symmetric memory`` rows: the mega buffer's bytes per
rank, data and signal words, against the bytes the expert-path layer's Buffer is created with). The local
(non-symmetric) activation ring of the mega kernel is reported next to it. ``roofline us`` (GPU): max(local
experts' weight bytes / measured copy bandwidth, FLOPs / measured FP8 TFLOPS) with FLOPs = 6 H I per received
selection (``_common.measure_limits``, same run).

``--graph`` times CUDA-graph replays instead (the capture is the graph-safety check: a case whose capture
fails is timed eagerly and its ``timed as`` column says why).

Checks, after timing, on the output of the last timed call of every case: all rows finite, and a sample of
``--check-tokens`` tokens per rank (0: all) within 1e-2 of max|ref| of an independent torch reference of the
expert-path numerics: the FP8 inputs and weights dequantized, GEMM1 in float64 rounded to BF16, SiLU-and-mul
quantized by the torch reference, GEMM2 rounded to BF16, the weighted sum in float64 (each expert rank
computes the sampled selections of its experts; summed over ranks). A failed check marks the row INVALID
(exit 1). The fused and phased outputs are also compared bit for bit (``fused_equals_phased``: the same
selections through the same per-row code, whatever the grid; reported, not a validity condition).

    torchrun --nproc-per-node 8 perf/bench_mega_moe.py --launcher torchrun --json mega8.jsonl   # EP8 (GPUs)
    torchrun --nproc-per-node 8 perf/bench_mega_moe.py --launcher torchrun --tokens 2048        # the target
    python perf/bench_mega_moe.py --cpu-smoke      # forked gloo CPU ranks, Triton interpreter, tiny shapes
"""

from __future__ import annotations

import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

_common.smoke_env()  # TRITON_INTERPRET=1 before any @triton.jit in moe_ep

import torch  # noqa: E402

PROG = "bench_mega_moe.py"
CASES = ("fused", "phased", "layer-decode", "layer-prefill", "deepep")
MEGA_CASES = ("fused", "phased")
LAYER_CASES = ("layer-decode", "layer-prefill")
TOKENS = [64, 128, 256, 512, 1024, 2048, 4096, 8192]
TARGET_TOKENS, TARGET_SPEEDUP = 2048, 1.3
CHECK_TOL = 1e-2  # of max|ref|: BF16 roundings and the odd e4m3 tie (tests/test_mega_moe.py's bound)
SMOKE = dict(launcher="fork", ranks=2, tokens=[6], hidden=256, intermediate=256, experts=4, topk=2, iters=2, warmup=1,
             check_tokens=0)


def _parse(argv=None):
    from bench_dispatch import ROUTINGS

    argv = sys.argv[1:] if argv is None else list(argv)
    p = _common.parser(PROG, __doc__, smoke_help="run the CPU variant: forked gloo ranks (moe_ep.testing.launch), "
                       "Triton interpreter, 2 ranks, tiny shapes unless given explicitly (numbers meaningless; checks "
                       "the code paths)")
    p.add_argument("--launcher", choices=["torchrun", "fork"], default="torchrun",
                   help="torchrun: one process per GPU (RANK, WORLD_SIZE, LOCAL_RANK from torchrun); fork: forked "
                        "gloo CPU ranks, --cpu-smoke only")
    p.add_argument("--ranks", type=int, default=2, help="ranks under --launcher fork (torchrun: the world size)")
    p.add_argument("--tokens", type=int, nargs="+", default=TOKENS, help="T: tokens per rank, one case set each")
    p.add_argument("--hidden", type=int, default=7168, help="hidden size H (a multiple of 128)")
    p.add_argument("--intermediate", type=int, default=2048, help="expert intermediate size I (a multiple of 128)")
    p.add_argument("--experts", type=int, default=256, help="routed experts E (a multiple of the world size)")
    p.add_argument("--topk", type=int, default=8, help="experts per token K")
    p.add_argument("--routing", choices=ROUTINGS, default="uniform", help="routing of the tokens (see bench_dispatch.py)")
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES), help="what to time, in this order")
    p.add_argument("--decode-max-tokens", type=int, default=1024,
                   help="largest T for the low-latency cases (layer-decode, deepep): their receive layout is "
                        "[L, R*T, H] per rank")
    p.add_argument("--no-deepep", action="store_true", help="do not time DeepEP + DeepGEMM even when importable")
    p.add_argument("--iters", type=int, default=20, help="timed calls per case (median, p10, p90; --cpu-smoke: 2)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls before the timed ones (compiles)")
    p.add_argument("--graph", action="store_true",
                   help="time CUDA-graph replays of each case (capture failing falls back to eager launches, said in "
                        "the row's timed-as column)")
    p.add_argument("--check-tokens", type=int, default=32,
                   help="tokens per rank checked against the torch reference after timing (0: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs and weights (each rank adds its rank)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before forked ranks are killed (fork)")
    p.add_argument("--wait-timeout", type=float, default=60.0, help="timeout_s of the buffers (bounds every wait)")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        _common.smoke_defaults(args, p, argv, **SMOKE)
    if args.launcher == "fork" and not args.cpu_smoke:
        p.error("--launcher fork runs forked gloo CPU ranks: only with --cpu-smoke (on GPUs use torchrun)")
    for name in ("hidden", "intermediate", "experts", "topk", "iters", "ranks"):
        if getattr(args, name) < 1:
            p.error(f"argument --{name}: must be >= 1, got {getattr(args, name)}")
    if min(args.tokens) < 1:
        p.error(f"argument --tokens: must be >= 1, got {min(args.tokens)}")
    if args.warmup < 0 or args.check_tokens < 0:
        p.error("arguments --warmup and --check-tokens must be >= 0")
    if args.hidden % 128 or args.intermediate % 128:
        p.error(f"arguments --hidden ({args.hidden}) and --intermediate ({args.intermediate}) must be multiples of 128")
    if args.topk > args.experts:
        p.error(f"argument --topk: must be <= --experts ({args.experts}), got {args.topk}")
    return args


# ------------------------------------------------------------------------------------------------ inputs

def make_weights(rank: int, world: int, args, device):
    """This rank's experts as ``moe_ep.layer.experts.ExpertWeights`` (FP8, 128x128 block scales), quantized expert by
    expert on the device (DeepSeek-V3 on EP8: 32 experts, 1.4 GB of FP8)."""
    from moe_ep.layer.experts import ExpertWeights
    from moe_ep.quant import per_block_quant_fp8

    H, inter, L = args.hidden, args.intermediate, args.experts // world
    g = torch.Generator(device=device).manual_seed(args.seed * 100003 + 7919 * rank + 1)
    q13, s13, q2, s2 = [], [], [], []
    for _ in range(L):
        a, sa = per_block_quant_fp8(torch.randn(2 * inter, H, generator=g, device=device) / H ** 0.5)
        b, sb = per_block_quant_fp8(torch.randn(H, inter, generator=g, device=device) / inter ** 0.5)
        q13.append(a), s13.append(sa), q2.append(b), s2.append(sb)
    return ExpertWeights((torch.stack(q13), torch.stack(s13)), (torch.stack(q2), torch.stack(s2)))


def make_inputs(rank: int, T: int, args, device):
    """``(x [T, H] BF16, topk_idx [T, K] int64, topk_weights [T, K] float32)`` of one rank for T tokens."""
    from bench_dispatch import route

    g = torch.Generator().manual_seed(args.seed * 100003 + 31 * T + rank)
    x = torch.randn(T, args.hidden, generator=g).to(torch.bfloat16)
    idx = route(T, args.experts, args.topk, args.routing, g)
    w = torch.rand(T, args.topk, generator=g)
    return x.to(device), idx.to(device), w.to(device)


# ------------------------------------------------------------------------------------------------ per rank

class Ctx:
    """Rank, world, device and small collective helpers (device tensors for NCCL, CPU tensors for gloo)."""

    def __init__(self, rank, world, device):
        import torch.distributed as dist

        self.dist, self.rank, self.world, self.device = dist, rank, world, device
        self.cuda = device.type == "cuda"

    def all_reduce(self, t, op="sum"):
        ops = {"sum": self.dist.ReduceOp.SUM, "max": self.dist.ReduceOp.MAX, "min": self.dist.ReduceOp.MIN}
        self.dist.all_reduce(t, op=ops[op])
        return t

    def agree(self, ok: bool) -> bool:
        """True when every rank says True."""
        return bool(self.all_reduce(torch.tensor([int(ok)], device=self.device), "min").item())

    def worst(self, v: float) -> float:
        return float(self.all_reduce(torch.tensor([v], dtype=torch.float64, device=self.device), "max").item())

    def all_gather(self, t):
        out = [torch.empty_like(t) for _ in range(self.world)]
        self.dist.all_gather(out, t.contiguous())
        return torch.cat(out)


def reference(ctx, xq, xs, idx, w, weights, sample):
    """The torch reference (module docstring) for this rank's tokens ``sample``: float64 ``[len(sample), H]``.
    Every rank gathers every rank's sampled FP8 rows and routing, computes the selections of its own experts, and
    the contributions are summed over ranks."""
    from moe_ep.quant import dequant_block_fp8, dequant_fp8, silu_and_mul_quant_fp8_ref

    L = weights.num_local_experts
    H = weights.hidden
    x_all = ctx.all_gather(dequant_fp8(xq[sample], xs[sample]).float())
    idx_all = ctx.all_gather(idx[sample])
    w_all = ctx.all_gather(w[sample].float())
    contrib = torch.zeros(x_all.shape[0], H, dtype=torch.float64, device=ctx.device)
    for le in range(L):
        rows, ks = (idx_all == ctx.rank * L + le).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        w13 = dequant_block_fp8(weights.w13[0][le], weights.w13[1][le]).double()
        h1 = (x_all[rows].double() @ w13.T).to(torch.bfloat16)
        del w13
        a = dequant_fp8(*silu_and_mul_quant_fp8_ref(h1)).double()
        w2 = dequant_block_fp8(weights.w2[0][le], weights.w2[1][le]).double()
        o = (a @ w2.T).to(torch.bfloat16).double()
        contrib.index_add_(0, rows, w_all[rows, ks].double()[:, None] * o)
    ctx.all_reduce(contrib)
    n = sample.numel()
    return contrib[ctx.rank * n:(ctx.rank + 1) * n]


def check(out, ref, sample, ctx) -> tuple[bool, float]:
    """``(valid, worst relative error over ranks)``: every row finite, the sampled rows within CHECK_TOL."""
    finite = bool(out.isfinite().all())
    err = _common.rel_err(out[sample].double(), ref) if sample.numel() else 0.0
    err = ctx.worst(err if finite else float("inf"))
    return ctx.agree(finite) and err <= CHECK_TOL, err


def _timed(fn, ctx, args):
    """``(Timing of the slowest rank per iteration, per-rank medians, output of the last timed call, how or None)``;
    with ``--graph`` on a GPU, replays of ``fn`` captured in a CUDA graph (``how`` says so, or why not)."""
    if ctx.cuda and args.graph:
        replay, out, note = _common.graph_fn(fn, ctx.device)
        t, per_rank = _common.time_ranks(replay, ctx.device, iters=args.iters, warmup=args.warmup)
        return t, per_rank, out, note or "CUDA graph replays"
    box = {}

    def run():
        box["out"] = fn()
    t, per_rank = _common.time_ranks(run, ctx.device, iters=args.iters, warmup=args.warmup)
    return t, per_rank, box["out"], None


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


def _build(ctx, make):
    """``(object or None, error line or None)``: ``make()`` on every rank, agreed (one failure skips the case)."""
    obj, err = None, None
    try:
        obj = make()
    except Exception as exc:  # noqa: BLE001 - out of memory, a missing backend ...: one line, skipped
        err = _short(exc)
    if not ctx.agree(err is None):
        _destroy(obj)
        return None, err or "failed on another rank"
    return obj, None


def _destroy(obj) -> None:
    if obj is None:
        return
    for name in ("destroy",):
        if hasattr(obj, name):
            getattr(obj, name)()


class Mega:
    """``fp8_mega_moe`` on a buffer for T tokens: ``__call__(mode)`` fills the buffer from the BF16 inputs and runs
    the layer into ``y``."""

    def __init__(self, args, ctx, T, weights, inputs):
        from moe_ep.gemm import fp8_mega_moe, get_symm_buffer_for_mega_moe, transform_weights_for_mega_moe
        from moe_ep.gemm.mega_moe import mega_moe_symm_bytes

        self.run_layer = fp8_mega_moe
        self.buf = get_symm_buffer_for_mega_moe(None, args.experts, T, args.topk, args.hidden, args.intermediate,
                                                device=ctx.device, timeout_s=args.wait_timeout)
        self.l1, self.l2 = transform_weights_for_mega_moe(weights.w13, weights.w2)
        self.x, self.idx, self.w = inputs
        self.T = T
        self.y = torch.empty(T, args.hidden, dtype=torch.bfloat16, device=ctx.device)
        self.symm_bytes = mega_moe_symm_bytes(ctx.world, args.experts, T, args.topk, args.hidden)
        self.local_bytes = self.buf.ring.numel()

    def fill(self) -> None:
        from moe_ep.quant import per_token_group_quant_fp8

        b, T = self.buf, self.T
        per_token_group_quant_fp8(self.x, out=b.x[:T], out_scales=b.x_sf[:T])
        b.topk_idx[:T].copy_(self.idx)
        b.topk_weights[:T].copy_(self.w)

    def __call__(self, mode: str):
        self.fill()
        self.run_layer(self.y, self.l1, self.l2, self.buf, mode=mode)
        return self.y

    def destroy(self) -> None:
        self.buf.destroy()


class Layer:
    """``moe_ep.MoELayer`` over a ``symm`` Buffer: decode (low-latency) or prefill (normal)."""

    def __init__(self, mode, args, ctx, T, weights):
        import moe_ep
        from moe_ep.backends.symm import SymmBackend
        from moe_ep.layer.moe import MoELayer

        if mode == "decode":
            self.symm_bytes = SymmBackend.get_low_latency_size_hint(T, args.hidden, ctx.world, args.experts, args.topk)
            kw = dict(num_rdma_bytes=self.symm_bytes, low_latency_mode=True)
        else:
            self.symm_bytes = SymmBackend.get_normal_size_hint(T, args.hidden, args.topk, ctx.world)
            kw = dict(num_nvl_bytes=self.symm_bytes)
        self.buf = moe_ep.Buffer(None, backend="symm", explicitly_destroy=True, timeout_s=args.wait_timeout, **kw)
        self.layer = MoELayer(self.buf, weights, args.experts, mode=mode, num_max_dispatch_tokens_per_rank=T)
        self.local_bytes = None

    def __call__(self, x, idx, w):
        return self.layer(x, idx, w)

    def destroy(self) -> None:
        self.buf.destroy()


def deepgemm_probe(disabled: bool = False):
    """``(deep_gemm module or None, one line)``: its masked grouped FP8 GEMM under either of its names."""
    if disabled:
        return None, "DeepGEMM: skipped (--no-deepep)"
    try:
        import deep_gemm
    except Exception as exc:  # noqa: BLE001 - ImportError or a broken extension
        return None, f"DeepGEMM: skipped, deep_gemm is not importable ({_short(exc)[:100]})"
    if _masked_gemm(deep_gemm) is None:
        return None, "DeepGEMM: skipped, deep_gemm has no m_grouped_fp8_gemm_nt_masked"
    return deep_gemm, f"DeepGEMM: deep_gemm {getattr(deep_gemm, '__version__', '(version unknown)')}"


def _masked_gemm(deep_gemm):
    return getattr(deep_gemm, "m_grouped_fp8_gemm_nt_masked", None) or \
        getattr(deep_gemm, "m_grouped_gemm_fp8_fp8_bf16_nt_masked", None)


class DeepEPDeepGEMM:
    """DeepEP V1 low-latency dispatch (FP8) -> DeepGEMM masked GEMM1 -> moe_ep SiLU-and-mul FP8 quant -> DeepGEMM
    masked GEMM2 -> DeepEP low-latency combine (weighted), with DeepEP's documented decode setup."""

    def __init__(self, deep_ep, deep_gemm, args, ctx, T, weights):
        import torch.distributed as dist

        B = deep_ep.Buffer
        self.symm_bytes = B.get_low_latency_rdma_size_hint(T, args.hidden, ctx.world, args.experts)
        self.buf = B(dist.group.WORLD, 0, self.symm_bytes, low_latency_mode=True,
                     num_qps_per_rank=max(1, args.experts // ctx.world))
        self.gemm = _masked_gemm(deep_gemm)
        self.idx_dtype = getattr(deep_ep, "topk_idx_t", torch.int64)
        self.T, self.E, self.weights = T, args.experts, weights
        self.expected_m = max(1, -(-ctx.world * T * args.topk // args.experts))
        self.local_bytes = None

    def __call__(self, x, idx, w):
        from moe_ep.quant import silu_and_mul_quant_fp8

        idx = idx.to(self.idx_dtype)
        (rq, rs), cnt, handle, _, _ = self.buf.low_latency_dispatch(x, idx, self.T, self.E, use_fp8=True)
        L, S, H = rq.shape
        inter = self.weights.intermediate
        h1 = torch.empty(L, S, 2 * inter, dtype=torch.bfloat16, device=rq.device)
        self.gemm((rq, rs), self.weights.w13, h1, cnt, self.expected_m)
        aq, as_ = silu_and_mul_quant_fp8(h1, tma_aligned_scales=True, masked_m=cnt, zero_masked_scales=False)
        out = torch.empty(L, S, H, dtype=torch.bfloat16, device=rq.device)
        self.gemm((aq, as_), self.weights.w2, out, cnt, self.expected_m)
        y, _, _ = self.buf.low_latency_combine(out, idx, w, handle)
        return y

    def destroy(self) -> None:
        if hasattr(self.buf, "destroy") and getattr(self.buf, "explicitly_destroy", False):
            self.buf.destroy()
        self.buf = None


def run_tokens(T, args, ctx, weights, deep, say) -> tuple[list, list]:
    """Every selected case at T tokens per rank: ``(results, lines)``, the same on every rank."""
    from moe_ep.fp8 import ll_dispatch_quant_ref
    from moe_ep.quant import per_token_group_quant_fp8

    results, lines = [], []
    x, idx, w = inputs = make_inputs(ctx.rank, T, args, ctx.device)
    xq, xs = per_token_group_quant_fp8(x)
    n_check = T if args.check_tokens == 0 else min(args.check_tokens, T)
    g = torch.Generator().manual_seed(args.seed + 17 * T + ctx.rank)
    sample = torch.randperm(T, generator=g)[:n_check].sort().values.to(ctx.device)
    ref = reference(ctx, xq, xs, idx, w, weights, sample)
    # the low-latency dispatch casts as DeepEP does (moe_ep.fp8.ll_dispatch_quant_ref), not as the per-token quant:
    # layer-decode's reference starts from that cast (every rank computes it: reference() is collective)
    ref_ll = reference(ctx, *ll_dispatch_quant_ref(x), idx, w, weights, sample) if "layer-decode" in args.cases else ref
    sel = ctx.all_reduce(torch.tensor([float((idx >= 0).sum())], dtype=torch.float64, device=ctx.device))
    recv_sel = float(sel.item()) / ctx.world  # selections each rank's experts receive, on average

    def record(case, t, per, out, obj, how, **extra):
        ok, err = check(out, ref_ll if case == "layer-decode" else ref, sample, ctx)
        results.append(dict(case=case, tokens=T, t=tuple(t), per_rank=per, valid=ok, rel_err=err, how=how,
                            symm_bytes=obj.symm_bytes, local_bytes=obj.local_bytes, recv_selections=recv_sel, **extra))

    mega, mega_out = None, {}
    if any(c in args.cases for c in MEGA_CASES):
        mega, err = _build(ctx, lambda: Mega(args, ctx, T, weights, inputs))
        if mega is None:
            lines.append(f"T={T}: mega-MoE buffer: {err}; fused and phased skipped")
    for case in args.cases:
        if case in MEGA_CASES:
            if mega is None:
                continue
            say(f"  T={T} {case} ...")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", RuntimeWarning)
                t, per, out, graph = _timed(lambda: mega(case), ctx, args)
            fell_back = case == "fused" and (mega.buf.fused_ok is False or any(
                "phased launches instead" in str(c.message) for c in caught))
            how = ("phased launches (the fused grid is not resident)" if fell_back else
                   f"one launch, grid {mega.buf.fused_grid}" if case == "fused" and ctx.cuda else
                   "one launch, grid 1 (interpreter)" if case == "fused" else "three launches")
            mega_out[case] = out.clone()
            record(case, t, per, out, mega, how + (f"; {graph}" if graph else ""), fell_back=fell_back)
        elif case in LAYER_CASES:
            mode = case.split("-")[1]
            if mode == "decode" and T > args.decode_max_tokens:
                lines.append(f"T={T}: layer-decode skipped (T > --decode-max-tokens {args.decode_max_tokens})")
                continue
            layer, err = _build(ctx, lambda: Layer(mode, args, ctx, T, weights))
            if layer is None:
                lines.append(f"T={T}: {case}: {err}; skipped")
                continue
            say(f"  T={T} {case} ...")
            try:
                t, per, out, graph = _timed(lambda: layer(x, idx, w), ctx, args)
                record(case, t, per, out, layer, graph or ("eager launches" if ctx.cuda else "CPU (gloo ranks)"))
            finally:
                layer.destroy()
        elif case == "deepep" and deep is not None:
            if T > args.decode_max_tokens:
                lines.append(f"T={T}: deepep skipped (T > --decode-max-tokens {args.decode_max_tokens})")
                continue
            pair, err = _build(ctx, lambda: DeepEPDeepGEMM(deep[0], deep[1], args, ctx, T, weights))
            if pair is None:
                lines.append(f"T={T}: DeepEP + DeepGEMM failed to build ({err}); skipped")
                continue
            say(f"  T={T} deepep ...")
            res, err = None, None
            try:
                res = _timed(lambda: pair(x, idx, w), ctx, args)
            except Exception as exc:  # noqa: BLE001 - the baseline failing must not stop our rows
                err = _short(exc)
            if ctx.agree(err is None):
                record("deepep", res[0], res[1], res[2], pair, res[3] or "eager launches")
            else:
                lines.append(f"T={T}: DeepEP + DeepGEMM failed ({err or 'on another rank'}); skipped")
            pair.destroy()
        ctx.dist.barrier()
    _destroy(mega)
    if len(mega_out) == 2:  # the same selections through the same per-row code: bitwise equal on every rank
        same = ctx.agree(torch.equal(mega_out["fused"].view(torch.int16), mega_out["phased"].view(torch.int16)))
        for r in results:
            if r["case"] in MEGA_CASES:
                r["fused_equals_phased"] = same
    return results, lines


def rank_body(rank, world, args, device, deep, say=lambda *a, **k: None) -> dict:
    """Everything one rank runs; returns ``{"results", "lines", "world", "limits"}`` (the same on every rank)."""
    if args.experts % world:
        raise ValueError(f"--experts {args.experts} is not divisible by the world size {world}")
    ctx = Ctx(rank, world, device)
    limits = _common.measure_limits(device, peer=False) if ctx.cuda else {}
    say(f"  weights ({args.experts // world} local experts) ...")
    weights = make_weights(rank, world, args, device)
    results, lines = [], []
    for T in args.tokens:
        r, ln = run_tokens(T, args, ctx, weights, deep, say)
        results += r
        lines += ln
    return {"results": results, "lines": lines, "world": world, "limits": limits}


# ------------------------------------------------------------------------------------------------ report

def roofline_us(args, world, recv_selections, limits) -> float | None:
    """max(local weight bytes / copy bandwidth, FLOPs / FP8 TFLOPS) in us (GPU limits measured in the run)."""
    copy, tflops = limits.get("copy_gbps"), limits.get("fp8_tflops")
    if not copy or not tflops:
        return None
    H, inter, L = args.hidden, args.intermediate, args.experts // world
    wbytes = L * 3 * H * inter * (1 + 4 / 128 ** 2)
    flops = 6 * H * inter * recv_selections
    return max(wbytes / copy / 1e3, flops / tflops / 1e6)


def _mib(nbytes: int) -> str:
    v = nbytes / 2 ** 20
    return f"{v:.1f}" if v >= 10 else f"{v:.3g}"


def report(rec, body, args, deep_lines) -> None:
    """Print the table (rank 0 or the fork parent) and add the JSON rows."""
    world, res, limits = body["world"], body["results"], body["limits"]
    smoke = " (CPU smoke: numbers meaningless)" if args.cpu_smoke else ""
    print(f"# mega MoE vs the expert-path layer, EP{world}, {rec.header['device']}, commit {rec.header['commit']}"
          f"{smoke}; hidden {args.hidden}, intermediate {args.intermediate}, {args.experts} experts, top-{args.topk}, "
          f"routing {args.routing}; slowest rank per iteration, median of {args.iters}", flush=True)
    for line in deep_lines + body["lines"]:
        print(f"# {line}")
    print(f"# target: at T={TARGET_TOKENS}, fused >= {TARGET_SPEEDUP}x the expert-path layer, symmetric memory no larger")
    print(_common.table_header(["T/rank", "case", "us", "p10-p90 us", "per-rank medians us", "TFLOPS", "roofline us",
                                "vs expert path", "vs DeepEP", "symm MiB/rank", "local MiB/rank", "timed as",
                                "check"]), flush=True)
    by_t: dict = {}
    for r in res:
        by_t.setdefault(r["tokens"], {})[r["case"]] = r
    for T in sorted(by_t):
        cases = by_t[T]
        layers = [cases[c] for c in LAYER_CASES if c in cases and cases[c]["valid"]]
        base = min(layers, key=lambda r: _common.Timing(r["t"]).median) if layers else None
        base_us = _common.Timing(base["t"]).median if base else None
        dee = cases.get("deepep") if cases.get("deepep", {}).get("valid") else None
        dee_us = _common.Timing(dee["t"]).median if dee else None
        for case in CASES:
            if case not in cases:
                continue
            r = cases[case]
            t = _common.Timing(r["t"])
            tflops = 6 * args.hidden * args.intermediate * r["recv_selections"] / t.median / 1e6
            roof = roofline_us(args, world, r["recv_selections"], limits)
            mine = case in MEGA_CASES
            vs_base = base_us / t.median if (mine and base_us) else None
            vs_dee = dee_us / t.median if (case != "deepep" and dee_us) else None
            mib = r["symm_bytes"] / 2 ** 20
            loc = _mib(r["local_bytes"]) if r["local_bytes"] is not None else "-"
            chk = f"ok ({r['rel_err']:.1e})" if r["valid"] else f"INVALID ({r['rel_err']:.1e})"
            pr = r["per_rank"]
            print(f"| {T} | {case} | {t.median:.1f} | {t.p10:.1f}-{t.p90:.1f} | {min(pr):.1f}-{max(pr):.1f} | "
                  f"{tflops:.2f} | {f'{roof:.1f}' if roof else 'n/a'} | {f'{vs_base:.2f}x' if vs_base else '-'} | "
                  f"{f'{vs_dee:.2f}x' if vs_dee else '-'} | {_mib(r['symm_bytes'])} | {loc} | {r['how']} | {chk} |", flush=True)
            note = ("CPU smoke: forked gloo ranks, Triton interpreter, numbers meaningless; " if args.cpu_smoke else "") \
                + "slowest rank per iteration; baseline = the faster valid expert-path layer case at this T (ratio = " \
                  "baseline / ours); mega cases include filling the symmetric buffer from BF16"
            resident = None if args.cpu_smoke else False
            at_target = mine and case == "fused" and T == TARGET_TOKENS
            extra = dict(op=case, tokens=T, world_size=world, routing=args.routing, per_rank_us=pr, timed_as=r["how"],
                         method=_common.how_method(r["how"] or ("eager launches" if torch.cuda.is_available() else "CPU")),
                         rel_err=r["rel_err"], symm_bytes=r["symm_bytes"], local_bytes=r["local_bytes"],
                         recv_selections_per_rank=r["recv_selections"], tflops=tflops, roofline_us=roof,
                         of_roofline=(roof / t.median) if roof else None,
                         baseline_name=base["case"] if (mine and base) else None,
                         baseline_symm_bytes=base["symm_bytes"] if (mine and base) else None,
                         deepep_us=dee_us if case != "deepep" else None, ours_over_deepep=(t.median / dee_us)
                         if (vs_dee and case != "deepep") else None,
                         fused_equals_phased=r.get("fused_equals_phased"), fell_back=r.get("fell_back"),
                         target_speedup=TARGET_SPEEDUP if at_target else None,
                         meets_target=(vs_base >= TARGET_SPEEDUP) if (at_target and vs_base) else None)
            case_name = f"{case} T={T} EP{world}"
            rec.add(case_name, "time", t.median, "us", p10=t.p10, p90=t.p90, iterations=t.n,
                    baseline=base_us if mine else None, limit=roof, ratio=vs_base, valid=r["valid"],
                    l2_resident=resident, note=note, **extra)
            if case == "fused":
                bmib = base["symm_bytes"] / 2 ** 20 if base else None
                rec.add(case_name, "symmetric memory", mib, "MiB", baseline=bmib, ratio=(bmib / mib) if bmib else None,
                        method=_common.COUNTED,
                        valid=r["valid"], note="per rank: the mega buffer (data + signal words) vs the bytes the "
                        "expert-path layer's Buffer is created with (ratio = baseline / ours, >= 1: no larger); "
                        f"local activation ring not included ({loc} MiB)", op=case, tokens=T, world_size=world,
                        symm_bytes=r["symm_bytes"], local_bytes=r["local_bytes"],
                        baseline_name=base["case"] if base else None,
                        meets_memory_target=(mib <= bmib) if (bmib and T == TARGET_TOKENS) else None)
    if not res:
        print("# nothing was measured")


def _header_extra(args, world, deep_lines, launcher) -> dict:
    return dict(launcher=launcher, world_size=world, cases=args.cases, tokens=args.tokens, deepep=" / ".join(deep_lines),
                target={"tokens": TARGET_TOKENS, "speedup": TARGET_SPEEDUP, "memory": "no larger"},
                timing="time_ranks: barrier, CUDA events per rank, L2 flushed, slowest rank per iteration")


# ------------------------------------------------------------------------------------------------ launchers

def _fork_rank(rank, world, args):
    say = (lambda *a, **k: print(*a, file=sys.stderr, flush=True)) if rank == 0 else (lambda *a, **k: None)
    return rank_body(rank, world, args, torch.device("cpu"), None, say)


def main_fork(args, argv) -> int:
    from moe_ep.testing import RankFailure, launch

    deep_lines = ["DeepEP + DeepGEMM baseline: skipped (CPU smoke: both need GPUs); rows carry deepep_us=null"]
    rec = _common.Records(PROG[:-3], args.json, True, device=f"CPU, {args.ranks} forked gloo ranks (Triton "
                          f"interpreter)", argv=argv)
    rec.update_header(**_header_extra(args, args.ranks, deep_lines, "fork"))
    try:
        bodies = launch(_fork_rank, args.ranks, args, timeout_s=args.timeout)
    except RankFailure as exc:
        return _common.error(PROG, f"ranks failed: {str(exc).splitlines()[0][:300]}")
    report(rec, bodies[0], args, deep_lines)
    return rec.finish(PROG)


def main_torchrun(args, argv) -> int:
    bad = _common.torchrun_env_error(PROG, "torchrun --nproc-per-node 8 perf/bench_mega_moe.py --launcher torchrun")
    if bad:
        return bad
    deep = None
    deep_lines = []
    if "deepep" in args.cases:
        deep_ep, line_ep = _common.deepep_probe(args.no_deepep)
        deep_gemm, line_gemm = deepgemm_probe(args.no_deepep)
        deep = (deep_ep, deep_gemm) if deep_ep is not None and deep_gemm is not None else None
        deep_lines = [line_ep, line_gemm] if deep is not None else [
            f"DeepEP + DeepGEMM baseline: skipped ({line_ep if deep_ep is None else line_gemm}); rows carry "
            "deepep_us=null"]
    if not torch.cuda.is_available():
        return _common.error(PROG, "--launcher torchrun needs one CUDA GPU per rank", 2)
    with _common.torchrun_nccl() as (rank, world, device):
        rec, say = _common.torchrun_records(PROG, args.json, argv, rank, world, device)
        rec.update_header(**_header_extra(args, world, deep_lines, "torchrun"))
        body = rank_body(rank, world, args, device, deep, say)
        if rank != 0:
            return 0
        rec.update_header(limits=body["limits"])
        report(rec, body, args, deep_lines)
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
