"""Single-process references of dispatch and combine, given every rank's inputs.

Written as plain loops over ranks and tokens so that they are obviously right; they reproduce the
reduction order every backend follows (see ``moe_ep.Buffer``'s docstrings), so dispatch is checked
bitwise and combine within a stated number of ulps.

Inputs are lists indexed by rank. ``E`` experts, ``R = len(xs)`` ranks, ``L = E / R`` local experts
on rank ``e // L``.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..fp8 import ll_dispatch_quant_ref, pack_ue8m0, per_token_group_quant_fp8_ref

__all__ = ["ref_dispatch", "ref_combine", "ref_low_latency_dispatch", "ref_low_latency_combine", "ref_routes",
           "ref_moe"]


def ref_routes(topk_idxs: list, num_experts: int) -> list:
    """``routes[dst]`` = list of ``(src_rank, token)`` that rank ``dst`` receives in normal mode, in order."""
    world = len(topk_idxs)
    num_local = num_experts // world
    routes = [[] for _ in range(world)]
    for src in range(world):
        for t, row in enumerate(topk_idxs[src].tolist()):
            for dst in sorted({e // num_local for e in row if e >= 0}):
                routes[dst].append((src, t))
    for dst in range(world):
        routes[dst].sort()
    return routes


def ref_dispatch(rank: int, xs: list, topk_idxs: list, topk_weights: list, num_experts: int,
                 x_scales: Optional[list] = None, expert_alignment: int = 1):
    """What rank ``rank`` receives: ``(recv_x, recv_scales or None, recv_topk_idx, recv_topk_weights,
    num_recv_tokens_per_expert_list)``."""
    world = len(xs)
    num_local = num_experts // world
    routes = ref_routes(topk_idxs, num_experts)[rank]
    hidden = xs[0].shape[1]
    k = topk_idxs[0].shape[1]
    recv_x = torch.empty(len(routes), hidden, dtype=xs[0].dtype)
    recv_s = torch.empty(len(routes), hidden // 128, dtype=torch.float32) if x_scales is not None else None
    recv_idx = torch.full((len(routes), k), -1, dtype=torch.int64)
    recv_w = torch.zeros(len(routes), k, dtype=torch.float32)
    per_expert = [0] * num_local
    for i, (src, t) in enumerate(routes):
        recv_x[i] = xs[src][t]
        if recv_s is not None:
            recv_s[i] = x_scales[src][t]
        for j in range(k):
            e = int(topk_idxs[src][t, j])
            if e >= 0 and e // num_local == rank:
                recv_idx[i, j] = e - rank * num_local
                recv_w[i, j] = topk_weights[src][t, j]
                per_expert[e - rank * num_local] += 1
    per_expert = [(c + expert_alignment - 1) // expert_alignment * expert_alignment for c in per_expert]
    return recv_x, recv_s, recv_idx, recv_w, per_expert


def _wire(y: torch.Tensor, fmt: Optional[int]) -> torch.Tensor:
    """float32 rows ``y`` `[M, H]` as the receiver sees them after the wire format ``fmt`` (None: as they are)."""
    from ..kernels.logfmt import decode_rows, encode_rows
    if fmt is None or y.shape[0] == 0:
        return y.float()
    return decode_rows(encode_rows(y, fmt), fmt, y.shape[1])


def ref_combine(rank: int, ys: list, topk_idxs: list, num_experts: int, recv_weights: Optional[list] = None,
                bias: tuple = (), fmt: Optional[int] = None):
    """What rank ``rank`` gets back from combine, given each rank's rows ``ys[r]`` (in that rank's
    ``recv_x`` order). Returns ``(combined_x in ys' dtype (BF16 / FP16), combined_topk_weights f32 or None)``.
    ``fmt``: the wire format (:mod:`moe_ep.kernels.logfmt`), rows are encoded and decoded as it says."""
    out_dtype = ys[0].dtype
    ys = [_wire(y, fmt) if y.dim() == 2 else y for y in ys]
    world = len(ys)
    routes = ref_routes(topk_idxs, num_experts)
    n = topk_idxs[rank].shape[0]
    hidden = ys[0].shape[1] if ys[0].dim() == 2 else 0
    acc = torch.zeros(n, hidden, dtype=torch.float32)
    for b in bias:
        acc += b.float()
    w = torch.zeros(n, topk_idxs[rank].shape[1], dtype=torch.float32) if recv_weights is not None else None
    for dst in range(world):  # ascending rank order
        for i, (src, t) in enumerate(routes[dst]):
            if src == rank:
                acc[t] += ys[dst][i].float()
                if w is not None:
                    w[t] += recv_weights[dst][i]
    return acc.to(out_dtype), w


def ref_low_latency_dispatch(rank: int, xs: list, topk_idxs: list, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, use_fp8: bool = True, round_scale: bool = False,
                             use_ue8m0: bool = False):
    """Rank ``rank``'s masked receive layout.

    Returns ``(recv_x [L, R*T, H], recv_scales [L, R*T, G] f32 / [L, R*T, ceil(G/4)] int32 or None,
    recv_count [L] int32, src [L][list of (src_rank, token, k)])``; only rows ``< recv_count[e]`` are
    defined (others are zero here).
    """
    world = len(xs)
    T = num_max_dispatch_tokens_per_rank
    num_local = num_experts // world
    hidden = xs[0].shape[1]
    rows = world * T
    dtype = torch.float8_e4m3fn if use_fp8 else torch.bfloat16
    recv_x = torch.zeros(num_local, rows, hidden, dtype=dtype)
    scales = torch.zeros(num_local, rows, hidden // 128, dtype=torch.float32) if use_fp8 else None
    count = [0] * num_local
    src_info = [[] for _ in range(num_local)]
    for src in range(world):
        if use_fp8:
            q, s = ll_dispatch_quant_ref(xs[src], round_scale=round_scale or use_ue8m0)
        for t in range(xs[src].shape[0]):
            for j in range(topk_idxs[src].shape[1]):
                e = int(topk_idxs[src][t, j])
                if e < 0 or e // num_local != rank:
                    continue
                le = e - rank * num_local
                pos = count[le]
                count[le] += 1
                src_info[le].append((src, t, j))
                if use_fp8:
                    recv_x[le, pos] = q[t]
                    scales[le, pos] = s[t]
                else:
                    recv_x[le, pos] = xs[src][t]
    if use_ue8m0:
        scales = pack_ue8m0(scales)
    return recv_x, scales, torch.tensor(count, dtype=torch.int32), src_info


def ref_low_latency_combine(rank: int, ys: list, topk_idxs: list, topk_weights: list,
                            num_max_dispatch_tokens_per_rank: int, num_experts: int,
                            fmt: Optional[int] = None) -> torch.Tensor:
    """Rank ``rank``'s combined output given each rank's expert outputs ``ys[r]`` `[L, R*T, H]` laid out
    as :func:`ref_low_latency_dispatch` orders rows. Each row goes through the wire format ``fmt`` (None:
    16-bit as it is), then float32 accumulation over k ascending, one rounding to ``ys``' dtype."""
    out_dtype = ys[0].dtype
    ys = [_wire(y.reshape(-1, y.shape[-1]), fmt).reshape(y.shape) for y in ys]
    world = len(ys)
    num_local = num_experts // world
    # Row of (src, t, k) inside its expert's slab on the owning rank.
    pos = {}
    for dst in range(world):
        count = [0] * num_local
        for src in range(world):
            for t in range(topk_idxs[src].shape[0]):
                for j in range(topk_idxs[src].shape[1]):
                    e = int(topk_idxs[src][t, j])
                    if e >= 0 and e // num_local == dst:
                        le = e - dst * num_local
                        pos[(src, t, j)] = (dst, le, count[le])
                        count[le] += 1
    n, k = topk_idxs[rank].shape
    hidden = ys[0].shape[-1]
    out = torch.zeros(n, hidden, dtype=torch.float32)
    for t in range(n):
        for j in range(k):
            if int(topk_idxs[rank][t, j]) < 0:
                continue
            dst, le, p = pos[(rank, t, j)]
            out[t] += topk_weights[rank][t, j] * ys[dst][le, p].float()
    return out.to(out_dtype)


def ref_moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
            w13_fp8: tuple, w2_fp8: tuple, clamp: Optional[float] = None) -> tuple:
    """Two float64 references of a routed MoE layer, ``(emulated, dense)`` `[N, H]`, token by token:

    - ``emulated``: the FP8 expert path step by step: 1x128 activation quant, GEMM1 with the block-quantized
      ``w13_fp8`` (``(q, scales)``) rounded to BF16, SiLU-and-mul + quant, GEMM2 with ``w2_fp8`` rounded to BF16,
      then ``sum_k w[t, k] * y``;
    - ``dense``: the same layer on the float weights ``w13`` `[E, 2I, H]` / ``w2`` `[E, H, I]`, no quantization.

    ``clamp``: SwiGLU clamp of the gate (max) and up (both sides) before the activation. Selections of -1 add
    nothing."""
    from ..quant import dequant_block_fp8, dequant_fp8, silu_and_mul_quant_fp8_ref

    xq = dequant_fp8(*per_token_group_quant_fp8_ref(x)).double()  # the torch reference: any device, no kernel
    w13q = dequant_block_fp8(*w13_fp8).double()
    w2q = dequant_block_fp8(*w2_fp8).double()
    emulated = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64, device=x.device)
    dense = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        for kk in range(topk_idx.shape[1]):
            e = int(topk_idx[t, kk])
            if e < 0:
                continue
            h1 = (xq[t:t + 1] @ w13q[e].T).to(torch.bfloat16)
            gate, up = (x[t:t + 1].double() @ w13[e].double().T).chunk(2, dim=-1)
            if clamp is not None:
                g1, u1 = h1.float().chunk(2, dim=-1)
                h1 = torch.cat([g1.clamp(max=clamp), u1.clamp(-clamp, clamp)], dim=-1)
                gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
            a = dequant_fp8(*silu_and_mul_quant_fp8_ref(h1)).double()
            emulated[t] += float(topk_weights[t, kk]) * (a @ w2q[e].T).to(torch.bfloat16).double()[0]
            dense[t] += float(topk_weights[t, kk]) * ((torch.nn.functional.silu(gate) * up) @ w2[e].double().T)[0]
    return emulated, dense
