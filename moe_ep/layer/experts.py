"""The routed experts of a MoE layer on FP8 grouped GEMMs: ``SiLU(x W_gate) * (x W_up) W_down`` per expert.

Two layouts, one per communication mode:

- :func:`masked_experts` (decode): the low-latency dispatch's receive layout `[L, R*T, H]` + counts ->
  GEMM1 masked -> SiLU-and-mul + quant (masked) -> GEMM2 masked -> BF16 `[L, R*T, H]` for
  ``low_latency_combine`` (which applies the top-k weights). No host read anywhere: CUDA-graph safe.
- :func:`contiguous_experts` (prefill): the normal dispatch's rows `[M, H]` + local top-k ->
  permute into 128-row-aligned expert blocks with ``m_indices`` -> GEMM1 -> SiLU-and-mul + quant ->
  GEMM2 -> weighted un-permute -> BF16 `[M, H]` for ``combine`` (which only sums over ranks).
- :func:`expanded_experts` (prefill over :class:`moe_ep.ElasticBuffer`): the expanded dispatch's rows
  (``do_expand=True, expert_alignment=128``: already the 128-row expert blocks) + the handle's psum layout
  (``psum_num_recv_tokens_per_expert``, fed to the grouped GEMM as it is) ->
  GEMM1 -> SiLU-and-mul + quant -> GEMM2 -> BF16 `[M_exp, H]`, one weighted row per (token, local expert),
  for the expanded ``combine``. No permute and no un-permute.

Every quant kernel writes the TMA-aligned M-major scales the GEMM reads, and with ``use_pdl`` each
kernel of the chain is launched with programmatic dependent launch (the GEMMs prefetch their weights
into L2 while the previous kernel drains).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..fp8 import FP8_DTYPE
from ..gemm import (
    M_ALIGNMENT,
    get_mn_major_tma_aligned_tensor,
    m_grouped_fp8_gemm_nt_contiguous,
    m_grouped_fp8_gemm_nt_masked,
)
from ..quant import per_block_quant_fp8, per_token_group_quant_fp8, silu_and_mul_quant_fp8

__all__ = ["ExpertWeights", "contiguous_experts", "expanded_experts", "masked_experts", "permute_to_contiguous"]


@dataclass
class ExpertWeights:
    """FP8 weights of ``L`` local experts with 128x128 block scales.

    Attributes:
        w13: ``(fp8 [L, 2I, H], float32 [L, 2I/128, H/128])``: gate rows ``[:I]``, up rows ``[I:]``.
        w2: ``(fp8 [L, H, I], float32 [L, H/128, I/128])``.
    """

    w13: tuple[torch.Tensor, torch.Tensor]
    w2: tuple[torch.Tensor, torch.Tensor]

    def __post_init__(self) -> None:
        (a, sa), (b, sb) = self.w13, self.w2
        if a.dtype != FP8_DTYPE or b.dtype != FP8_DTYPE:
            raise TypeError(f"expert weights must be {FP8_DTYPE}, got {a.dtype} and {b.dtype}")
        if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0]:
            raise ValueError(f"w13 must be [L, 2I, H] and w2 [L, H, I], got {tuple(a.shape)} and {tuple(b.shape)}")
        num_local, two_i, hidden = a.shape
        if two_i % 256 or hidden % 128 or tuple(b.shape) != (num_local, hidden, two_i // 2):
            raise ValueError(f"w13 {tuple(a.shape)} / w2 {tuple(b.shape)}: need 2I a multiple of 256, H of 128, "
                             f"and w2 = [L, H, I]")
        for s, w, name in ((sa, a, "w13"), (sb, b, "w2")):
            want = (w.shape[0], w.shape[1] // 128, w.shape[2] // 128)
            if s.dtype != torch.float32 or tuple(s.shape) != want:
                raise ValueError(f"{name} scales must be float32 {list(want)}, got {s.dtype} {list(s.shape)}")

    @classmethod
    def from_float(cls, w13: torch.Tensor, w2: torch.Tensor) -> "ExpertWeights":
        """Quantize BF16/float weights (``w13`` `[L, 2I, H]`, ``w2`` `[L, H, I]`) with
        :func:`moe_ep.quant.per_block_quant_fp8`."""
        return cls(per_block_quant_fp8(w13), per_block_quant_fp8(w2))

    @property
    def num_local_experts(self) -> int:
        return self.w13[0].shape[0]

    @property
    def hidden(self) -> int:
        return self.w13[0].shape[2]

    @property
    def intermediate(self) -> int:
        return self.w2[0].shape[2]


def _as_fp8(x, masked_m=None):
    """``x`` as (fp8, TMA-aligned M-major scales): BF16 is quantized here; an FP8 pair passes."""
    if isinstance(x, (tuple, list)):
        return x[0], x[1]
    return per_token_group_quant_fp8(x, tma_aligned_scales=True, masked_m=masked_m, zero_masked_scales=False)


def masked_experts(recv_x, recv_count: torch.Tensor, weights: ExpertWeights, *, expected_m: int | None = None,
                   use_pdl: bool = False) -> torch.Tensor:
    """Experts over the masked layout (the low-latency receive).

    Arguments:
        recv_x: ``(fp8 [L, S, H], scales [L, S, H/128])`` as ``low_latency_dispatch(use_fp8=True)`` returns
            it (any scale strides; UE8M0 int32 too), or BF16 `[L, S, H]` (quantized here).
        recv_count: `[L]` `torch.int32`: valid rows per local expert (read on the device only).
        weights: :class:`ExpertWeights` of the ``L`` local experts.
        expected_m: rows per expert to pick GEMM tiles for (default: ``S`` / 4, at least 1).
        use_pdl: programmatic dependent launch between the three kernels.

    Returns:
        `[L, S, H]` `torch.bfloat16`: expert outputs (unweighted); rows past ``recv_count`` are not written.
    """
    xq, xs = _as_fp8(recv_x, recv_count)
    if xq.dim() != 3 or xq.shape[0] != weights.num_local_experts or xq.shape[2] != weights.hidden:
        raise ValueError(f"recv_x must be [L={weights.num_local_experts}, S, H={weights.hidden}], "
                         f"got {tuple(xq.shape)}")
    num_local, slots, hidden = xq.shape
    if expected_m is None:
        expected_m = max(1, slots // 4)
    inter = weights.intermediate
    h1 = torch.empty(num_local, slots, 2 * inter, dtype=torch.bfloat16, device=xq.device)
    m_grouped_fp8_gemm_nt_masked((xq, xs), weights.w13, h1, recv_count, expected_m, use_pdl=use_pdl)
    aq, as_ = silu_and_mul_quant_fp8(h1, tma_aligned_scales=True, masked_m=recv_count, use_pdl=use_pdl,
                                    zero_masked_scales=False)
    out = torch.empty(num_local, slots, hidden, dtype=torch.bfloat16, device=xq.device)
    m_grouped_fp8_gemm_nt_masked((aq, as_), weights.w2, out, recv_count, expected_m, use_pdl=use_pdl)
    return out


def permute_to_contiguous(recv_topk_idx: torch.Tensor, num_local_experts: int,
                          num_tokens_per_expert: list[int] | None = None,
                          alignment: int = M_ALIGNMENT) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where each (row, k) selection goes in the contiguous layout.

    Arguments:
        recv_topk_idx: `[M, K]` int64 local expert per selection, -1 for none (the normal dispatch's).
        num_local_experts: ``L``.
        num_tokens_per_expert: the dispatch's ``num_recv_tokens_per_expert_list`` when known (no host
            read); else the counts are computed and read once on the host.
        alignment: rows per expert block (128, the GEMM's).

    Returns:
        dst: `[M, K]` int64 row of each selection in the expanded layout (-1 for none);
        m_indices: `[M_exp]` int32 expert of each expanded row, -1 on padding;
        M_exp: total expanded rows (each expert's count rounded up to ``alignment``).
    """
    num_rows, k = recv_topk_idx.shape
    device = recv_topk_idx.device
    flat = recv_topk_idx.reshape(-1)
    valid = (flat >= 0) & (flat < num_local_experts)
    key = torch.where(valid, flat, torch.full_like(flat, num_local_experts))
    one_hot = torch.nn.functional.one_hot(key, num_local_experts + 1)[:, :num_local_experts]
    counts = one_hot.sum(0)  # [L] on the device
    if num_tokens_per_expert is None or len(num_tokens_per_expert) != num_local_experts:
        host_counts = counts.tolist()
    else:
        host_counts = [int(c) for c in num_tokens_per_expert]
    padded = [-(-c // alignment) * alignment for c in host_counts]
    m_exp = sum(padded)
    starts = torch.tensor([0] + padded[:-1], dtype=torch.int64, device=device).cumsum(0)
    # Rank of each selection inside its expert, in (row, k) order: a stable sort by expert.
    order = torch.sort(key, stable=True).indices
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank_sorted = torch.arange(flat.numel(), device=device) - torch.cat(
        [first_of_expert, first_of_expert.new_zeros(1)])[key[order]]
    rank = torch.empty_like(rank_sorted).scatter_(0, order, rank_sorted)
    dst = torch.where(valid, starts[key.clamp(max=num_local_experts - 1)] + rank, torch.full_like(flat, -1))
    # No boolean indexing (a host sync on CUDA): invalid selections write to a scratch row past the end.
    scratch = torch.full((m_exp + 1,), -1, dtype=torch.int32, device=device)
    scratch.scatter_(0, torch.where(valid, dst, m_exp), torch.where(valid, key, -1).to(torch.int32))
    m_indices = scratch[:m_exp]
    return dst.view(num_rows, k), m_indices, m_exp


def contiguous_experts(recv_x, recv_topk_idx: torch.Tensor, recv_topk_weights: torch.Tensor, weights: ExpertWeights,
                       *, num_tokens_per_expert: list[int] | None = None, use_pdl: bool = False) -> torch.Tensor:
    """Experts over the normal dispatch's rows, weighted by the top-k weights (ready for ``combine``).

    Arguments:
        recv_x: ``(fp8 [M, H], scales [M, H/128])`` as the normal dispatch returns it, or BF16 `[M, H]`.
        recv_topk_idx: `[M, K]` int64 local expert indices, -1 for experts elsewhere.
        recv_topk_weights: `[M, K]` float32 (ignored where the index is -1).
        weights: :class:`ExpertWeights` of the ``L`` local experts.
        num_tokens_per_expert: the dispatch's ``num_recv_tokens_per_expert_list`` (saves a host read).
        use_pdl: programmatic dependent launch between the quant and GEMM kernels.

    Returns:
        `[M, H]` `torch.bfloat16`: ``sum_k w[m, k] * expert_{idx[m, k]}(x[m])``, summed in float32.
    """
    xq, xs = _as_fp8(recv_x)
    num_rows, hidden = xq.shape
    if hidden != weights.hidden:
        raise ValueError(f"recv_x hidden {hidden} != the experts' {weights.hidden}")
    if recv_topk_idx.shape != recv_topk_weights.shape or recv_topk_idx.shape[0] != num_rows:
        raise ValueError(f"recv_topk_idx {tuple(recv_topk_idx.shape)} and recv_topk_weights "
                         f"{tuple(recv_topk_weights.shape)} must both be [M={num_rows}, K]")
    out = torch.zeros(num_rows, hidden, dtype=torch.float32, device=xq.device)
    if num_rows == 0:
        return out.to(torch.bfloat16)
    dst, m_indices, m_exp = permute_to_contiguous(recv_topk_idx, weights.num_local_experts, num_tokens_per_expert)
    if m_exp == 0:
        return out.to(torch.bfloat16)
    k = dst.shape[1]
    valid = dst >= 0
    # Permute: every selection's row (FP8 bytes and its scales) into its expert's block; scales land
    # M-major (TMA-aligned) so the GEMM reads them directly. Padding rows stay zero.
    src_rows = torch.arange(num_rows, device=xq.device).repeat_interleave(k)
    target = torch.where(valid.reshape(-1), dst.reshape(-1), torch.full_like(src_rows, m_exp))
    x_exp = torch.zeros(m_exp + 1, hidden, dtype=torch.uint8, device=xq.device)
    x_exp.index_copy_(0, target, xq.view(torch.uint8).index_select(0, src_rows))
    s_exp = torch.zeros(m_exp + 1, xs.shape[1], dtype=xs.dtype, device=xq.device)
    s_exp.index_copy_(0, target, xs.index_select(0, src_rows))
    a = (x_exp[:m_exp].view(FP8_DTYPE), get_mn_major_tma_aligned_tensor(s_exp[:m_exp]))
    # GEMM1 -> SiLU-and-mul + quant -> GEMM2.
    h1 = torch.empty(m_exp, 2 * weights.intermediate, dtype=torch.bfloat16, device=xq.device)
    m_grouped_fp8_gemm_nt_contiguous(a, weights.w13, h1, m_indices, use_pdl=use_pdl)
    act = silu_and_mul_quant_fp8(h1, tma_aligned_scales=True, use_pdl=use_pdl)
    y_exp = torch.empty(m_exp, hidden, dtype=torch.bfloat16, device=xq.device)
    m_grouped_fp8_gemm_nt_contiguous(act, weights.w2, y_exp, m_indices, use_pdl=use_pdl)
    # Un-permute: a fixed k order (deterministic float32 sums, no atomics).
    w = torch.where(valid, recv_topk_weights.float(), 0.0)
    for kk in range(k):
        rows = y_exp.index_select(0, dst[:, kk].clamp(min=0)).float()
        out += torch.where(valid[:, kk:kk + 1], w[:, kk:kk + 1] * rows, 0.0)
    return out.to(torch.bfloat16)


def expanded_experts(recv_x, m_indices: torch.Tensor, weights: ExpertWeights,
                     recv_topk_weights: torch.Tensor | None = None, *, use_psum_layout: bool = False,
                     use_pdl: bool = False) -> torch.Tensor:
    """Experts over the expanded dispatch's rows (already in 128-row expert blocks): no permute.

    Arguments:
        recv_x: ``(fp8 [M_exp, H], scales [M_exp, H/128])`` as ``ElasticBuffer.dispatch(..., do_expand=True,
            expert_alignment=128)`` returns it (scales in any layout: M-major TMA-aligned ones, from
            ``use_tma_aligned_col_major_sf=True``, are used as they are), or BF16 `[M_exp, H]` (quantized here).
        m_indices: the grouped GEMM's ``grouped_layout``: `[M_exp]` `torch.int32` local expert of each row, -1 on
            padding (``handle.m_indices``), constant within each 128-row block; or, with ``use_psum_layout=True``,
            `[L]` `torch.int32` psum (``handle.psum_num_recv_tokens_per_expert``: expert ``e``'s rows are
            ``[align(psum[e-1], 128), psum[e])``), fed to the GEMMs as it is (no m_indices built). Both give
            the same bits.
        weights: :class:`ExpertWeights` of the ``L`` local experts.
        recv_topk_weights: optional `[M_exp]` float32, the top-k weight of each expanded row (the expanded
            dispatch's 1-D ``recv_topk_weights``; 0 on padding). ``None``: rows are not weighted.
        use_psum_layout: ``m_indices`` is the psum layout (above).
        use_pdl: programmatic dependent launch between the quant and GEMM kernels.

    Returns:
        `[M_exp, H]` `torch.bfloat16`: row ``i`` is ``w[i] * expert_{m_indices[i]}(x[i])``; padding rows are 0.

    The weight is folded into the FP8 activation's per-row scales before GEMM2 (the FP8 values are
    unchanged, ``M_exp * I/128`` floats are rescaled instead of an ``[M_exp, H]`` pass over the output);
    with UE8M0-packed scales (int32) it is applied to GEMM2's output instead. Each weighted row is rounded
    to BF16 once here; the expanded combine then sums a token's rows in float32 (the permute path sums the
    weighted rows before its single rounding: the two differ by BF16 rounding only).
    """
    xq, xs = _as_fp8(recv_x)
    num_rows, hidden = xq.shape
    if hidden != weights.hidden:
        raise ValueError(f"recv_x hidden {hidden} != the experts' {weights.hidden}")
    want = (weights.num_local_experts,) if use_psum_layout else (num_rows,)
    if not isinstance(m_indices, torch.Tensor) or m_indices.dtype != torch.int32 or tuple(m_indices.shape) != want:
        what = f"psum [L={want[0]}]" if use_psum_layout else f"m_indices [M_exp={num_rows}]"
        raise ValueError(f"{'psum' if use_psum_layout else 'm_indices'} must be torch.int32 {what} (the expanded "
                         f"handle's), got {getattr(m_indices, 'dtype', type(m_indices).__name__)} "
                         f"{list(getattr(m_indices, 'shape', []))}")
    if num_rows % M_ALIGNMENT:
        raise ValueError(f"expanded rows ({num_rows}) must come in blocks of {M_ALIGNMENT}: dispatch with "
                         f"expert_alignment=get_m_alignment_for_contiguous_layout()")
    if recv_topk_weights is not None and (recv_topk_weights.dtype != torch.float32 or
                                          tuple(recv_topk_weights.shape) != (num_rows,)):
        raise ValueError(f"recv_topk_weights must be torch.float32 [M_exp={num_rows}] (1-D, per expanded row), got "
                         f"{recv_topk_weights.dtype} {list(recv_topk_weights.shape)}")
    y = torch.empty(num_rows, hidden, dtype=torch.bfloat16, device=xq.device)
    if num_rows == 0:
        return y
    h1 = torch.empty(num_rows, 2 * weights.intermediate, dtype=torch.bfloat16, device=xq.device)
    m_grouped_fp8_gemm_nt_contiguous((xq, xs), weights.w13, h1, m_indices, use_psum_layout=use_psum_layout,
                                     use_pdl=use_pdl)
    aq, as_ = silu_and_mul_quant_fp8(h1, tma_aligned_scales=True, use_pdl=use_pdl)
    post = None
    if recv_topk_weights is not None:
        # psum: the dispatch's weights are 0 on padding already (and GEMM2 never reads padding rows' scales)
        w = recv_topk_weights if use_psum_layout else torch.where(m_indices >= 0, recv_topk_weights, 0.0)
        if as_.dtype == torch.float32:
            as_.mul_(w.unsqueeze(1))  # in place: the TMA-aligned M-major storage the GEMM reads stays as it is
        else:
            post = w
    m_grouped_fp8_gemm_nt_contiguous((aq, as_), weights.w2, y, m_indices, use_psum_layout=use_psum_layout,
                                     use_pdl=use_pdl)
    if post is not None:
        y = (y.float() * post.unsqueeze(1)).to(torch.bfloat16)
    return y
