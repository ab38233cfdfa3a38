"""``python -m moe_ep demo``: a DeepSeek-V3-shaped MoE layer, scaled down, over N local ranks.

Each rank routes its tokens (sigmoid scores, 8 expert groups, top-4 groups, top-k experts), dispatches
them in FP8 to the ranks holding the experts, runs each expert's SiLU-gated MLP, and combines the
results in BF16, in both modes (normal: dispatch/combine; low-latency: masked layout, weighted
combine). The experts run on the FP8 grouped GEMMs by default (``--experts-impl fp8``: contiguous layout
after the normal dispatch, masked layout after the low-latency one, SiLU-and-mul fused with the FP8
quantization between the GEMMs); ``--experts-impl torch`` runs them as a float32 torch MLP instead. The
output is checked against a single-process dense float32 computation of the same layer (same FP8
rounding of the inputs, the experts' weights as the layer holds them: 128x128-block FP8 for
``fp8``), and rank 0 prints a table of stages, bytes and times.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from .fp8 import dequant_fp8_ref, per_token_group_quant_fp8_ref


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """``(default: X)`` once after each option's help, where there is a default and the help does not
    state it already."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is not None and action.default is not False and action.default != argparse.SUPPRESS \
                and "default" not in text:
            text += " (default: %(default)s)"
        return text


def _parser(prog: str = "python -m moe_ep demo") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=_Formatter)
    p.add_argument("--ranks", type=int, default=4, help="number of ranks to start on this machine")
    p.add_argument("--tokens", type=int, default=64, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=512, help="hidden size, a multiple of 128 (DeepSeek-V3: 7168)")
    p.add_argument("--intermediate", type=int, default=256, help="expert MLP width (DeepSeek-V3: 2048)")
    p.add_argument("--experts", type=int, default=32, help="routed experts, divisible by --ranks and 8 (V3: 256)")
    p.add_argument("--topk", type=int, default=8, help="experts per token (DeepSeek-V3: 8)")
    p.add_argument("--groups", type=int, default=8, help="expert groups for group-limited routing (V3: 8)")
    p.add_argument("--topk-groups", type=int, default=4, help="groups each token may use (V3: 4)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: one GPU per rank with NCCL if enough GPUs exist, else CPU with gloo")
    p.add_argument("--backend", choices=["torch", "symm"], default="torch", help="moe_ep.Buffer backend")
    p.add_argument("--mode", choices=["both", "normal", "low-latency"], default="both",
                   help="which dispatch/combine mode(s) to run: normal (prefill) and/or low-latency (decode)")
    p.add_argument("--experts-impl", choices=["fp8", "torch"], default="fp8",
                   help="fp8: FP8 grouped GEMMs (moe_ep.layer.experts); torch: a float32 torch MLP per expert")
    p.add_argument("--repeat", type=int, default=None,
                   help="timed repetitions, the median is printed (default 3 on GPUs, 1 on CPU: the interpreter is slow)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the weights and tokens")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a stuck run is stopped")
    return p


def _weights(args, device):
    g = torch.Generator().manual_seed(args.seed)
    h, i, e = args.hidden, args.intermediate, args.experts
    gate = torch.randn(e, h, generator=g) / h ** 0.5
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, generator=g) / i ** 0.5).to(torch.bfloat16)
    bias = torch.randn(e, generator=g) * 0.1
    return gate.to(device), w13.to(device), w2.to(device), bias.to(device)


def route(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, topk: int, groups: int, topk_groups: int):
    """DeepSeek-V3 routing: sigmoid scores, the best ``topk_groups`` groups by the sum of each group's top-2
    biased scores, then top-k experts inside them; weights are the unbiased scores renormalised."""
    scores = torch.sigmoid(x.float() @ gate.t())
    biased = scores + bias
    n, e = scores.shape
    grouped = biased.view(n, groups, e // groups)
    group_score = grouped.topk(min(2, e // groups), dim=-1).values.sum(-1)
    keep = torch.zeros_like(group_score).scatter_(1, group_score.topk(topk_groups, dim=-1).indices, 1.0)
    masked = biased.masked_fill(~keep.bool().repeat_interleave(e // groups, dim=1), float("-inf"))
    topk_idx = masked.topk(topk, dim=-1).indices
    w = scores.gather(1, topk_idx)
    return topk_idx.to(torch.int64), (w / w.sum(-1, keepdim=True)).float()


def expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """SiLU(x W_gate) * (x W_up) W_down in float32 with BF16 weights; `[M, H]` -> `[M, H]` float32."""
    gu = x.float() @ w13.float().t()
    gate, up = gu.chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ w2.float().t()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rank_main(rank: int, world: int, args) -> dict:
    import moe_ep

    device = torch.device(f"cuda:{rank % max(torch.cuda.device_count(), 1)}") if args.device == "cuda" else torch.device("cpu")
    gate, w13, w2, bias = _weights(args, device)
    num_local = args.experts // world
    lo = rank * num_local
    fp8_weights = None
    if args.experts_impl == "fp8":
        from .layer.experts import ExpertWeights
        from .quant import dequant_block_fp8

        # The layer holds 128x128-block FP8 weights (as DeepSeek-V3 ships them); the reference uses the same.
        all_fp8 = ExpertWeights.from_float(w13, w2)
        fp8_weights = ExpertWeights((all_fp8.w13[0][lo:lo + num_local], all_fp8.w13[1][lo:lo + num_local]),
                                    (all_fp8.w2[0][lo:lo + num_local], all_fp8.w2[1][lo:lo + num_local]))
        w13, w2 = dequant_block_fp8(*all_fp8.w13), dequant_block_fp8(*all_fp8.w2)
    g = torch.Generator().manual_seed(args.seed * 1000 + rank + 1)
    x = torch.randn(args.tokens, args.hidden, generator=g).to(torch.bfloat16).to(device)
    topk_idx, topk_w = route(x, gate, bias, args.topk, args.groups, args.topk_groups)
    q, s = per_token_group_quant_fp8_ref(x, 128)
    # Dense single-process reference for this rank's tokens: every expert on every token it selected,
    # with the same FP8 rounding of the input.
    xd = dequant_fp8_ref(q, s)
    ref = torch.zeros(args.tokens, args.hidden, dtype=torch.float32, device=device)
    for kk in range(args.topk):
        for e in topk_idx[:, kk].unique().tolist():
            rows = (topk_idx[:, kk] == e).nonzero().flatten()
            ref[rows] += topk_w[rows, kk:kk + 1] * expert_mlp(xd[rows], w13[e], w2[e])
    extra = {}
    if args.backend == "symm":
        from .backends.symm import SymmBackend
        extra = dict(num_nvl_bytes=SymmBackend.get_normal_size_hint(args.tokens, args.hidden, args.topk, args.ranks),
                     num_rdma_bytes=SymmBackend.get_low_latency_size_hint(args.tokens, args.hidden, args.ranks,
                                                                          args.experts, args.topk),
                     device=device)
    buf = moe_ep.Buffer(None, explicitly_destroy=True, low_latency_mode=args.mode != "normal", backend=args.backend,
                        timeout_s=args.timeout, **extra)
    selections = int((topk_idx >= 0).sum())
    stats: dict = {}

    def timed(name, fn):
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        stats.setdefault(name, []).append(time.perf_counter() - t0)
        return out

    results = {}
    for _ in range(args.repeat):
        if args.mode in ("both", "normal"):
            per_rank, _, per_expert, in_rank, _ = timed("normal: layout", lambda: buf.get_dispatch_layout(topk_idx, args.experts))
            (rx, rs), ridx, rw, counts, handle, _ = timed("normal: dispatch (FP8)", lambda: buf.dispatch(
                (q, s), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=topk_idx, topk_weights=topk_w))

            def experts_normal():
                if fp8_weights is not None:
                    from .layer.experts import contiguous_experts

                    return contiguous_experts((rx, rs), ridx, rw, fp8_weights, num_tokens_per_expert=counts or None)
                xin = dequant_fp8_ref(rx, rs)
                y = torch.zeros(rx.shape[0], args.hidden, dtype=torch.float32, device=device)
                for le in range(num_local):
                    sel = ridx == le
                    rows = sel.any(1).nonzero().flatten()
                    if rows.numel():
                        w = (rw * sel).sum(1)[rows].unsqueeze(1)
                        y[rows] += w * expert_mlp(xin[rows], w13[lo + le], w2[lo + le])
                return y.to(torch.bfloat16)

            y = timed("normal: experts", experts_normal)
            out, _, _ = timed("normal: combine (BF16)", lambda: buf.combine(y, handle))
            results["normal"] = (out, int(rx.shape[0]))
        if args.mode in ("both", "low-latency"):
            (lq, ls), count, handle, _, _ = timed("low-latency: dispatch (FP8)", lambda: buf.low_latency_dispatch(
                x, topk_idx, args.tokens, args.experts, use_fp8=True))

            def experts_ll():
                if fp8_weights is not None:
                    from .layer.experts import masked_experts

                    return masked_experts((lq, ls), count, fp8_weights, expected_m=max(1, selections // num_local))
                y = torch.zeros(num_local, lq.shape[1], args.hidden, dtype=torch.bfloat16, device=device)
                for le in range(num_local):
                    c = int(count[le])
                    if c:
                        xin = dequant_fp8_ref(lq[le, :c], ls[le, :c])
                        y[le, :c] = expert_mlp(xin, w13[lo + le], w2[lo + le]).to(torch.bfloat16)
                return y

            yl = timed("low-latency: experts", experts_ll)
            out, _, _ = timed("low-latency: combine (BF16)", lambda: buf.low_latency_combine(yl, topk_idx, topk_w, handle))
            results["low-latency"] = (out, int(count.sum()))
    errors = {}
    for mode, (out, _) in results.items():
        err = (out.float() - ref).abs().max().item()
        errors[mode] = err / max(ref.abs().max().item(), 1e-6)
    buf.destroy()
    return {"stats": {k: sorted(v)[len(v) // 2] for k, v in stats.items()}, "errors": errors,
            "selections": selections, "recv": {m: r[1] for m, r in results.items()}}


def _gpu_count() -> int:
    # NOTES: ask nvidia-smi, not torch.cuda: CUDA must stay uninitialised in the parent before forking.
    import shutil
    import subprocess
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "" or not shutil.which("nvidia-smi"):
        return 0
    res = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return res.stdout.count("GPU ") if res.returncode == 0 else 0


def _validate(p: argparse.ArgumentParser, args) -> None:
    """Each option on its own (argparse conventions: usage, one line naming the option, exit 2)."""
    for name in ("ranks", "tokens", "hidden", "intermediate", "experts", "topk", "groups", "topk_groups"):
        if getattr(args, name) < 1:
            p.error(f"argument --{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.repeat is not None and args.repeat < 1:
        p.error(f"argument --repeat: must be >= 1, got {args.repeat}")
    if args.timeout <= 0:
        p.error(f"argument --timeout: must be > 0, got {args.timeout}")
    if args.hidden % 128:
        p.error(f"argument --hidden: must be a multiple of 128, got {args.hidden}")
    if args.experts % args.ranks:
        p.error(f"argument --experts: must be divisible by --ranks ({args.ranks}), got {args.experts}")
    if args.experts % args.groups:
        p.error(f"argument --groups: must divide --experts ({args.experts}), got {args.groups}")
    if args.topk > args.experts:
        p.error(f"argument --topk: must be <= --experts ({args.experts}), got {args.topk}")
    if args.topk_groups > args.groups:
        p.error(f"argument --topk-groups: must be <= --groups ({args.groups}), got {args.topk_groups}")
    if args.topk > args.topk_groups * (args.experts // args.groups):
        p.error(f"argument --topk: must be <= --topk-groups x experts per group "
                f"({args.topk_groups * (args.experts // args.groups)}), got {args.topk}")
    if args.experts_impl == "fp8" and args.intermediate % 128:
        p.error(f"argument --intermediate: must be a multiple of 128 for the FP8 experts (1x128 scales between the "
                f"GEMMs; use --experts-impl torch for other sizes), got {args.intermediate}")


def main(argv=None, prog: str = "python -m moe_ep demo") -> int:
    p = _parser(prog)
    args = p.parse_args(argv)
    _validate(p, args)
    n_gpu = _gpu_count() if args.device != "cpu" else 0
    if args.device == "cuda" and n_gpu == 0:
        p.error("argument --device: cuda requested but no CUDA GPU found (use --device cpu or auto)")
    if args.device == "cuda" and args.backend == "torch" and n_gpu < args.ranks:
        p.error(f"argument --ranks: {args.ranks} ranks need one GPU each with --device cuda, {n_gpu} found")
    if args.device == "auto":
        args.device = "cuda" if n_gpu >= args.ranks else "cpu"
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.repeat is None:
        args.repeat = 3 if args.device == "cuda" else 1
    from .testing import launch

    backend = "nccl" if args.device == "cuda" and args.backend == "torch" else "gloo"
    t0 = time.perf_counter()
    print(f"moe_ep demo: starting {args.ranks} ranks on {args.device} ({args.repeat} repetition(s); on CPU the Triton "
          f"interpreter takes a while) ...", file=sys.stderr, flush=True)
    try:
        res = launch(_rank_main, args.ranks, args, timeout_s=args.timeout, backend=backend)
    except (RuntimeError, TimeoutError) as exc:
        msg = str(exc).strip().splitlines()
        print(f"python -m moe_ep demo: error: {msg[0] if msg else type(exc).__name__}", file=sys.stderr)
        return 1
    wall = time.perf_counter() - t0
    h = args.hidden
    sel = sum(r["selections"] for r in res)
    print(f"moe_ep demo: {args.ranks} ranks ({args.device}, {backend}, backend={args.backend}), {args.tokens} tokens/rank, "
          f"hidden {h}, {args.experts} experts top-{args.topk} ({args.groups} groups, {args.topk_groups} per token), "
          f"experts: {'FP8 grouped GEMMs' if args.experts_impl == 'fp8' else 'torch float32 MLP'}")
    print(f"{'stage':<30} {'rows moved':>11} {'MB moved':>9} {'ms (max over ranks)':>20}")
    names = list(res[0]["stats"])
    for name in names:
        ms = max(r["stats"][name] for r in res) * 1e3
        mode = "normal" if name.startswith("normal") else "low-latency"
        recv = sum(r["recv"][mode] for r in res)
        if "dispatch" in name:
            rows, nbytes = (recv, recv * (h + h // 32 + 16)) if mode == "normal" else (sel, sel * (h + h // 32 + 16))
        elif "combine" in name:
            rows, nbytes = (recv, recv * 2 * h) if mode == "normal" else (sel, sel * 2 * h)
        else:
            rows, nbytes = 0, 0
        rows_s = f"{rows:>11}" if rows else f"{'-':>11}"
        mb_s = f"{nbytes / 1e6:>9.2f}" if nbytes else f"{'-':>9}"
        print(f"{name:<30} {rows_s} {mb_s} {ms:>20.2f}")
    ok = True
    for mode in res[0]["errors"]:
        err = max(r["errors"][mode] for r in res)
        # torch experts: BF16 rounding of the expert outputs and the combine; FP8 experts add the FP8
        # quantization of the SiLU-and-mul activation between the GEMMs (the GEMMs themselves are exact
        # to float32 on the FP8 operands).
        tol = 2e-2 if args.experts_impl == "torch" else 5e-2
        good = err < tol
        ok &= good
        print(f"{mode:<12} max |out - dense| / max|dense| = {err:.2e}  {'OK' if good else 'MISMATCH'}")
    print(f"total wall time {wall:.1f} s (includes process start-up)")
    return 0 if ok else 1
