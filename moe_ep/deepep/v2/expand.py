"""The expanded layout of :class:`moe_ep.ElasticBuffer` (DeepEP V2's ``do_expand=True``), as device-only torch ops: the
per-expert counts, where each (row, k) selection lands (the contiguous grouped GEMM's ``m_indices`` with it), the
combine's gather plan, and the deterministic per-row sum of the expanded combine. No host reads."""

from __future__ import annotations

from typing import List, Optional

import torch

from ...fp8 import FP8_DTYPE

__all__ = ["expert_counts", "expand_plan", "m_indices_from_psum", "combine_plan", "gather_rows", "expand_received",
           "sum_expanded", "USE_KERNELS", "uses_kernels", "sm90_cases"]

#: Run the expanded layout's row gathers and the expanded combine's sum as Triton kernels
#: (:mod:`moe_ep.kernels.expand`, one launch each): ``None`` = on CUDA tensors only (on CPU these torch ops run);
#: tests set ``True`` to run the kernels in the Triton interpreter and compare them with the torch ops, bitwise.
USE_KERNELS = None


def uses_kernels(t: torch.Tensor) -> bool:
    """Whether the expanded layout of ``t``'s device runs as kernels (see :data:`USE_KERNELS`)."""
    return t.is_cuda if USE_KERNELS is None else bool(USE_KERNELS)


def expert_counts(recv_topk_idx: torch.Tensor, num_local: int, alignment: int):
    """``(key, counts, aligned)``: each selection's local expert (``num_local`` for a hole), flattened in
    (row, k) order, and the real and aligned per-expert counts. Device ops only."""
    flat = recv_topk_idx.reshape(-1)
    key = torch.where(flat >= 0, flat, num_local)
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=flat.device).scatter_add_(
        0, key, torch.ones_like(key))[:num_local]
    aligned = (counts + alignment - 1) // alignment * alignment
    return key, counts, aligned


def expand_plan(key: torch.Tensor, counts: torch.Tensor, aligned: torch.Tensor, num_topk: int, num_expanded: int):
    """Where each (row, k) selection lands in the expanded layout, device ops only: ``(slot [M*K] (-1 on a
    hole), exp_src, exp_k)`` (the last two ``[num_expanded]``; -1 / 0 on padding). No m_indices: the grouped GEMM
    takes the handle's psum layout (:func:`m_indices_from_psum` builds them on request)."""
    device = key.device
    num_local = counts.shape[0]
    # A stable sort by expert lists each expert's selections in (row, k) order = source global order (rows
    # are sorted by it and a row holds an expert at most once); holes (key num_local) come last. The i-th
    # sorted selection of expert e lands on expanded row starts[e] + (i - first[e]).
    sorted_key, order = torch.sort(key, stable=True)
    shift = torch.cat([(aligned.cumsum(0) - aligned) - (counts.cumsum(0) - counts), counts.new_zeros(1)])
    is_sel = sorted_key < num_local
    pos = torch.where(is_sel, torch.arange(key.numel(), device=device) + shift[sorted_key], -1)
    slot = torch.empty_like(pos).scatter_(0, order, pos)
    target = torch.where(is_sel, pos, num_expanded)  # holes go to a dropped extra row
    exp_flat = torch.full((num_expanded + 1,), -1, dtype=torch.int64, device=device).scatter_(
        0, target, order)[:num_expanded]
    is_row = exp_flat >= 0
    exp_src = torch.where(is_row, exp_flat // num_topk, -1)
    exp_k = torch.where(is_row, exp_flat % num_topk, 0)
    return slot, exp_src, exp_k


def m_indices_from_psum(psum: torch.Tensor, alignment: int, num_rows: int) -> torch.Tensor:
    """`[num_rows]` int32 local expert of each expanded row, -1 on padding, from DeepGEMM's psum layout (expert
    ``e``'s rows are ``[align(psum[e - 1]), psum[e])``): the ``m_indices`` of the same rows."""
    device = psum.device
    rows = torch.arange(num_rows, device=device)
    if psum.numel() == 0:
        return torch.full((num_rows,), -1, dtype=torch.int32, device=device)
    ends = psum.to(torch.int64)
    expert = torch.bucketize(rows, (ends + alignment - 1) // alignment * alignment, right=True)
    valid = (expert < ends.numel()) & (rows < ends[expert.clamp(max=ends.numel() - 1)])
    return torch.where(valid, expert, -1).to(torch.int32)


def combine_plan(slot: torch.Tensor, per_row: torch.Tensor, passes: int, pass_rows: Optional[List[int]]):
    """The expanded combine's gather plan: the handle's ``(_comb_src, _comb_order, _comb_sorted_src,
    _comb_rows)``. ``slot`` `[M, K]`, ``per_row`` `[M]` selections per received row, ``passes`` =
    min(K, local experts), ``pass_rows[j]`` = rows with more than ``j`` selections (host ints) or ``None``
    when not known on the host or not needed (the sum kernel; ``per_row`` may then be ``None``). Device ops only."""
    # each row's selections, k ascending, packed to the left: a stable sort that moves the holes right
    cols = torch.sort((slot < 0).to(torch.uint8), dim=1, stable=True).indices[:, :passes]
    src = slot.gather(1, cols).contiguous()
    if pass_rows is None:
        return src, None, None, None
    # rows by selection count, descending: the rows with a (j+1)-th selection are the first pass_rows[j]
    order = torch.sort(per_row, descending=True, stable=True).indices
    return src, order, src.index_select(0, order), pass_rows


def gather_rows(t: torch.Tensor, src: torch.Tensor, zero: bool) -> torch.Tensor:
    """Rows ``src`` of ``t`` (FP8 gathered as bytes); rows with ``src < 0`` are zeros when ``zero``, else row 0."""
    flat = t.view(torch.uint8) if t.dtype == FP8_DTYPE else t
    out = flat.index_select(0, src.clamp(min=0))
    if zero:
        out = torch.where((src >= 0).view(-1, *([1] * (out.dim() - 1))), out, torch.zeros_like(out))
    return out.view(t.dtype) if t.dtype == FP8_DTYPE else out


def expand_received(data: torch.Tensor, scales: Optional[torch.Tensor], weights: Optional[torch.Tensor],
                    exp_src: torch.Tensor, exp_k: torch.Tensor, zero: bool):
    """The received rows, their scales and 2-D top-k weights in the expanded layout: ``(data, scales, weights)``
    (weights 1-D per expanded row, 0 on padding). Padding rows of data / scales are zero with ``zero``, else
    unspecified. Kernels (one launch for rows + weights, one for scales) where :data:`USE_KERNELS` says so."""
    if uses_kernels(data):
        from ...kernels.expand import expand_rows, words_of

        if words_of(data) is not None and (scales is None or words_of(scales) is not None):
            out, w = expand_rows(data, exp_src, zero, weights, exp_k if weights is not None else None)
            return out, None if scales is None else expand_rows(scales, exp_src, zero)[0], w
    out = gather_rows(data, exp_src, zero)
    sc = None if scales is None else gather_rows(scales, exp_src, zero)
    w = None
    if weights is not None:
        w = torch.where(exp_src >= 0, weights[exp_src.clamp(min=0), exp_k], 0.0)
    return out, sc, w


def sum_expanded(x: torch.Tensor, h) -> torch.Tensor:  # h: an expanded EPHandle
    """BF16 `[M, H]`: per received row, the float32 sum ``0 + x[s_1] + x[s_2] + ...`` over its selections'
    expanded rows, k ascending, holes skipped, rounded once to BF16. Deterministic, no host read.

    Pass j adds every row's (j+1)-th selection. With host-known counts (a CPU-synced handle) pass j >= 1
    gathers only the ``_comb_rows[j]`` rows that have one and adds them with ``index_add_`` on distinct rows
    (one float32 add per element, so the order is still k ascending): rows gathered = real selections.
    Without them (worst-case sizes) each of the min(K, L) passes covers all rows and a hole adds +0.0,
    which changes nothing (a sum that starts at +0.0 is never -0.0). Starting from the first term instead
    of +0.0 can only differ in the sign of a zero; the final ``+ 0.0`` makes that +0.0 too."""
    src, order, sorted_src, pass_rows = h._comb_src, h._comb_order, h._comb_sorted_src, h._comb_rows
    if uses_kernels(x) and x.dtype == torch.bfloat16 and x.dim() == 2:
        from ...kernels.expand import sum_rows

        return sum_rows(x, src)
    M, H = src.shape[0], h._hidden
    if src.shape[1] == 0:
        return torch.zeros(M, H, dtype=torch.bfloat16, device=x.device)

    exact = pass_rows is not None
    acc = torch.empty(M, H, dtype=torch.float32, device=x.device)
    first = src[:, 0]
    acc.copy_(x.index_select(0, first.clamp(min=0)))
    if not exact or pass_rows[0] < M:
        acc.masked_fill_((first < 0).unsqueeze(1), 0.0)
    most = M if not exact else pass_rows[1] if src.shape[1] > 1 else 0
    gathered = torch.empty(most, H, dtype=x.dtype, device=x.device)  # reused by every pass
    term = torch.empty(most, H, dtype=torch.float32, device=x.device)
    for j in range(1, src.shape[1]):  # fixed order: deterministic
        n = pass_rows[j] if exact else M
        if n == 0:
            break
        col = sorted_src[:n, j] if exact else src[:, j]
        torch.index_select(x, 0, col.clamp(min=0), out=gathered[:n])
        term[:n].copy_(gathered[:n])
        if exact:
            acc.index_add_(0, order[:n], term[:n])
        else:
            acc.add_(term.masked_fill_((col < 0).unsqueeze(1), 0.0))
    return acc.add_(0.0).to(torch.bfloat16)  # -0.0 -> +0.0, then one rounding to BF16


def sm90_cases() -> list[dict]:
    """Both kernels as ElasticBuffer launches them on a GPU for DeepSeek-V3 prefill (FP8 rows of 7168 bytes =
    1792 words, 56 scale words, EP8: about 40K expanded rows; the sum over min(top-8, 32 local) = 8 columns)."""
    from ...kernels.expand import _expand_rows_kernel, _sum_expanded_kernel
    from ...testing.sm90 import launch_case

    ptrs = {"src_ptr": "*i32", "exp_src_ptr": "*i64", "out_ptr": "*i32", "w_ptr": "*fp32", "exp_k_ptr": "*i64",
            "out_w_ptr": "*fp32"}
    cases = []
    for what, width, zero, has_w in (("FP8 rows + weights", 1792, True, True), ("scales", 56, True, False),
                                     ("FP8 rows, no zero padding", 1792, False, True)):
        cases.append(launch_case("expand_rows", f"{what} W={width} N=40960", _expand_rows_kernel, ptrs,
                                 {"N": 40960, "W": width, "K": 8},
                                 {"ZERO": zero, "HAS_W": has_w, "BLOCK_R": 16, "BLOCK_W": 256}))
    cases.append(launch_case("sum_expanded", "BF16 H=7168 M=21545 P=8", _sum_expanded_kernel,
                             {"x_ptr": "*bf16", "src_ptr": "*i64", "out_ptr": "*i16"}, {"M": 21545, "H": 7168, "P": 8},
                             {"BLOCK_R": 4, "BLOCK_H": 512}))
    return cases
