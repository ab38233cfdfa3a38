"""The launch path shared by every GEMM entry point: the kernel launch (:func:`_launch`), the dense, contiguous
(m_indices / psum) and masked bodies that check, pick a tile and launch, and :func:`_t` (the transposed views
the nn / tn / tt names pass)."""

from __future__ import annotations

from typing import Optional

import torch
import triton

from ..kernels.grouped_gemm import CONTIG, DENSE, MASKED, OUT_BF16, OUT_BF16_BITS, OUT_FP32, PSUM, grouped_gemm_kernel
from ..kernels.pdl import INTERPRET, pdl_launch_kwargs
from .checks import _check_c, _check_expected_m, _check_index, _check_operands
from .gluon import launch_gluon
from .runtime import _grid_size
from .tiles import BLOCK_K, BLOCK_K_BF16, GemmConfig, _contiguous_config, _dense_config, choose_gemm_config
from .utils.layout import get_mk_alignment_for_contiguous_layout

def _out_mode(d: torch.Tensor) -> int:
    if d.dtype == torch.float32:
        return OUT_FP32.value
    # NOTES: the interpreter's fp32 -> bf16 cast truncates; round in integers there (same bits as torch).
    return OUT_BF16_BITS.value if (INTERPRET or d.device.type != "cuda") else OUT_BF16.value


def _launch(x3, sfa3, w, sfb, d3, layout, mode: int, cfg: GemmConfig, *, ue8m0: bool = False, bf16: bool = False,
            use_pdl: bool = False, zero_pad: bool = True, accumulate: bool = False, sfb_gran_n: int = BLOCK_K,
            expected_m: int = 0, forced: bool = False) -> None:
    # FP8 on sm90 (MOE_EP_GEMM_KERNEL auto at the sizes it wins, or gluon): the warp-specialised Gluon kernel (no PDL wait, so
    # it launches without PDL); a forced tile (``config``) keeps the tl kernel.
    if not bf16 and not forced and launch_gluon(
            x3, sfa3, w, sfb, d3, layout, mode, expected_m=expected_m or x3.shape[1], ue8m0=ue8m0, zero_pad=zero_pad,
            accumulate=accumulate, sfb_gran_n=sfb_gran_n, align=get_mk_alignment_for_contiguous_layout()):
        return
    num_batches, rows, k = x3.shape
    n = w.shape[1]
    tiles = triton.cdiv(rows, cfg.block_m) * triton.cdiv(n, cfg.block_n) * (num_batches if mode == MASKED.value else 1)
    out_mode = _out_mode(d3)
    d_arg = d3.view(torch.int16) if out_mode == OUT_BF16_BITS.value else d3
    block_k = BLOCK_K_BF16 if bf16 else BLOCK_K
    if bf16:  # no scales: any pointer, never read
        sfa3, sfb, sfa_strides, sfb_strides = x3, w, (0, 0, 0), (0, 0, 0)
    else:
        sfa_strides, sfb_strides = sfa3.stride(), sfb.stride()
    grouped_gemm_kernel[(_grid_size(tiles),)](
        x3, sfa3, w, sfb, d_arg, layout if layout is not None else x3,
        rows, n, k, w.shape[0], get_mk_alignment_for_contiguous_layout(),
        x3.stride(0), x3.stride(1), x3.stride(2),
        *sfa_strides,
        w.stride(0), w.stride(1), w.stride(2),
        *sfb_strides,
        d3.stride(0), d3.stride(1),
        LAYOUT=mode, SWAP_AB=cfg.swap_ab, SFA_UE8M0=ue8m0, OUT_MODE=out_mode,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, GROUP_M=cfg.group_m,
        PREFETCH_K=min(4, triton.cdiv(k, block_k)),
        AB_BF16=bf16, EVEN_K=k % block_k == 0, ZERO_PAD=zero_pad, ACCUMULATE=accumulate, SFB_GRAN_N=sfb_gran_n,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch_kwargs(use_pdl, x3.device),
    )


def _dense(a, b, d, c, *, bf16: bool, use_pdl: bool, config: Optional[GemmConfig], sfb_gran_n: int = BLOCK_K) -> None:
    x, sfa, w, sfb, ue8m0 = _check_operands(a, b, d, (), bf16=bf16, dense=True, sfb_gran_n=sfb_gran_n)
    accumulate = _check_c(c, d)
    m, n = d.shape
    if m == 0 or n == 0:
        return
    if accumulate and c.data_ptr() != d.data_ptr():
        d.copy_(c)
    cfg = config or _dense_config(m)
    _launch(x.unsqueeze(0), None if bf16 else sfa.unsqueeze(0), w, sfb, d.unsqueeze(0), None, DENSE.value, cfg,
            ue8m0=ue8m0, bf16=bf16, use_pdl=use_pdl, accumulate=accumulate, sfb_gran_n=sfb_gran_n, expected_m=m,
            forced=config is not None)


def _contiguous(a, b, d, grouped_layout, *, bf16: bool, use_psum_layout: bool, ensure_zero_padding: bool,
                expected_m_for_psum_layout, use_pdl: bool, config: Optional[GemmConfig]) -> None:
    x, sfa, w, sfb, ue8m0 = _check_operands(a, b, d, (), bf16=bf16)
    if use_psum_layout:
        _check_index(grouped_layout, "grouped_layout (psum layout)", w.shape[0], x.device)
        _check_expected_m(expected_m_for_psum_layout, "expected_m_for_psum_layout", allow_none=True)
    else:
        _check_index(grouped_layout, "grouped_layout (m_indices)", x.shape[0], x.device)
        if expected_m_for_psum_layout is not None:
            raise ValueError("expected_m_for_psum_layout is for use_psum_layout=True only")
    alignment = get_mk_alignment_for_contiguous_layout()
    cfg = config or _contiguous_config(alignment)
    if cfg.swap_ab or alignment % cfg.block_m:
        raise ValueError(f"contiguous layout needs a tile without swap-AB whose block_m divides the alignment "
                         f"({alignment})")
    if x.shape[0] == 0 or w.shape[1] == 0:
        return
    _launch(x.unsqueeze(0), None if bf16 else sfa.unsqueeze(0), w, sfb, d.unsqueeze(0), grouped_layout,
            PSUM.value if use_psum_layout else CONTIG.value, cfg, ue8m0=ue8m0, bf16=bf16, use_pdl=use_pdl,
            zero_pad=bool(ensure_zero_padding), expected_m=alignment, forced=config is not None)


def _masked(a, b, d, masked_m, expected_m, *, bf16: bool, use_pdl: bool, config: Optional[GemmConfig]) -> None:
    x0 = a if bf16 else (a[0] if isinstance(a, (tuple, list)) and len(a) == 2 else None)
    lead = (x0.shape[0],) if isinstance(x0, torch.Tensor) and x0.dim() == 3 else (0,)
    x, sfa, w, sfb, ue8m0 = _check_operands(a, b, d, lead, bf16=bf16)
    if x.shape[0] != w.shape[0]:
        raise ValueError(f"a has {x.shape[0]} groups but b has {w.shape[0]}")
    _check_index(masked_m, "masked_m", x.shape[0], x.device)
    _check_expected_m(expected_m, "expected_m")
    cfg = config or choose_gemm_config(True, expected_m)
    if x.numel() == 0 or w.shape[1] == 0:
        return
    _launch(x, sfa, w, sfb, d, masked_m, MASKED.value, cfg, ue8m0=ue8m0, bf16=bf16, use_pdl=use_pdl,
            expected_m=max(expected_m, 1), forced=config is not None)


def _t(pair_or_tensor, dims=(-2, -1)):
    """The transposed view of an operand (FP8: values and scales both), for the nn / tn / tt names."""
    if isinstance(pair_or_tensor, (tuple, list)) and len(pair_or_tensor) == 2:
        return tuple(t.transpose(*dims) if isinstance(t, torch.Tensor) else t for t in pair_or_tensor)
    return pair_or_tensor.transpose(*dims) if isinstance(pair_or_tensor, torch.Tensor) else pair_or_tensor
