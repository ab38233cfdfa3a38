"""Layout helpers under DeepGEMM's names (``deep_gemm.utils.layout``): the contiguous-layout alignment and
the TMA-aligned, MN-major scale layout the grouped GEMMs read fastest.

As in DeepGEMM, :func:`get_m_alignment_for_contiguous_layout` and :func:`get_k_alignment_for_contiguous_layout`
are aliases of :func:`get_mk_alignment_for_contiguous_layout`.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...fp8 import tma_aligned_size

__all__ = [
    "get_tma_aligned_size",
    "get_mn_major_tma_aligned_tensor",
    "set_mk_alignment_for_contiguous_layout",
    "get_mk_alignment_for_contiguous_layout",
    "get_theoretical_mk_alignment_for_contiguous_layout",
    "get_m_alignment_for_contiguous_layout",
    "get_k_alignment_for_contiguous_layout",
]

#: DeepGEMM's alignment on sm90 (its ``kLegacyMKAlignmentForContiguousLayout``), and ours by default.
THEORETICAL_MK_ALIGNMENT = 128
#: What :func:`set_mk_alignment_for_contiguous_layout` accepts: multiples of this (a 64-row tile still
#: never straddles two experts; smaller tiles would not use wgmma without swap-AB).
MK_ALIGNMENT_UNIT = 64

_mk_alignment = THEORETICAL_MK_ALIGNMENT


def get_theoretical_mk_alignment_for_contiguous_layout(expected_m: Optional[int] = None) -> int:
    """The alignment DeepGEMM's sm90 kernels need (128 rows, whatever ``expected_m``: only its sm100 kernels
    shrink it for small ``expected_m``)."""
    if expected_m is not None and (isinstance(expected_m, bool) or not isinstance(expected_m, int) or expected_m < 0):
        raise TypeError(f"expected_m must be None or a non-negative int, got {expected_m!r}")
    return THEORETICAL_MK_ALIGNMENT


def set_mk_alignment_for_contiguous_layout(new_value: int) -> None:
    """Rows (or K) each group's block is padded to in the contiguous layouts: the psum layout's group starts
    (``align(grouped_layout[g - 1], alignment)``) and the tile of the m_indices / psum grouped GEMMs (128 rows
    when it divides the alignment, else 64). Process-wide, as in DeepGEMM. Multiples of 64 only."""
    global _mk_alignment
    if isinstance(new_value, bool) or not isinstance(new_value, int) or new_value <= 0 or \
            new_value % MK_ALIGNMENT_UNIT:
        raise ValueError(f"mk alignment must be a positive multiple of {MK_ALIGNMENT_UNIT} (the grouped GEMM's "
                         f"64- and 128-row tiles must not straddle two groups), got {new_value!r}")
    _mk_alignment = new_value


def get_mk_alignment_for_contiguous_layout() -> int:
    """Rows each expert's block is padded to in the contiguous layouts (128 unless set)."""
    return _mk_alignment


# DeepGEMM's aliases.
get_m_alignment_for_contiguous_layout = get_mk_alignment_for_contiguous_layout
get_k_alignment_for_contiguous_layout = get_mk_alignment_for_contiguous_layout


def get_tma_aligned_size(x: int, element_size: int) -> int:
    """``x`` rounded up so that ``x * element_size`` is a multiple of 16 bytes."""
    return tma_aligned_size(x, element_size)


def get_mn_major_tma_aligned_tensor(sf: torch.Tensor) -> torch.Tensor:
    """``sf`` (`[MN, SF_K]` or `[B, MN, SF_K]` scales) with the same values, MN-major (stride 1 along MN) with
    the stride of every other dim padded so that ``MN`` is a multiple of 16 bytes: strides
    ``(1, tma(MN))`` or ``(tma(MN) * SF_K, 1, tma(MN))`` for every shape, ``SF_K == 1`` included (as
    DeepGEMM's). Returned as is when it already has exactly those strides, else copied into new storage."""
    if not isinstance(sf, torch.Tensor) or sf.dim() not in (2, 3):
        raise ValueError(f"sf must be a [MN, SF_K] or [B, MN, SF_K] tensor, got "
                         f"{tuple(sf.shape) if isinstance(sf, torch.Tensor) else type(sf).__name__}")
    mn, sf_k = sf.shape[-2:]
    mp = tma_aligned_size(mn, sf.element_size())
    if sf.stride(-2) == 1 and sf.stride(-1) == mp and (sf.dim() == 2 or sf.stride(0) == mp * sf_k):
        return sf
    storage = torch.empty(*sf.shape[:-2], sf_k, mp, dtype=sf.dtype, device=sf.device)
    out = storage[..., :mn].transpose(-1, -2)
    out.copy_(sf)
    return out
