"""Layout helpers under DeepGEMM's names (``deep_gemm.utils.layout``): the contiguous-layout alignment and
the TMA-aligned, MN-major scale layout the grouped GEMMs read fastest.

As in DeepGEMM, :func:`get_m_alignment_for_contiguous_layout` and :func:`get_k_alignment_for_contiguous_layout`
are aliases of :func:`get_mk_alignment_for_contiguous_layout`.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...fp8 import tma_aligned_size
from .math import ceil_div

__all__ = [
    "get_tma_aligned_size",
    "get_mn_major_tma_aligned_tensor",
    "get_mn_major_tma_aligned_packed_ue8m0_tensor",
    "get_k_grouped_mn_major_tma_aligned_packed_ue8m0_tensor",
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


def _ue8m0_bytes(sf: torch.Tensor) -> torch.Tensor:
    """The exponent byte of each float32 scale (the UE8M0 value of a power of two; DeepGEMM takes the same bits)."""
    if sf.dtype != torch.float32:
        raise TypeError(f"UE8M0 packing takes float32 scales, got {sf.dtype}")
    return ((sf.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


def get_mn_major_tma_aligned_packed_ue8m0_tensor(sf: torch.Tensor, psum_layout: Optional[torch.Tensor] = None
                                                 ) -> torch.Tensor:
    """Float32 scales ``[MN, SF_K]`` / ``[B, MN, SF_K]`` -> their UE8M0 exponent bytes packed four per int32 along
    SF_K (zero bytes past SF_K), ``[.., MN, ceil(SF_K / 4)]``, MN-major and TMA-aligned as
    :func:`get_mn_major_tma_aligned_tensor` lays out (DeepGEMM's layout for its sm100 kernels)."""
    if psum_layout is not None:
        raise ValueError("the psum-layout pack (gaps between experts left unread) is DeepGEMM's sm100 path: "
                         "not provided")
    if not isinstance(sf, torch.Tensor) or sf.dim() not in (2, 3):
        raise ValueError(f"sf must be a [MN, SF_K] or [B, MN, SF_K] tensor, got "
                         f"{tuple(sf.shape) if isinstance(sf, torch.Tensor) else type(sf).__name__}")
    sf_k = sf.shape[-1]
    packed = sf.new_zeros((*sf.shape[:-1], 4 * ceil_div(sf_k, 4)), dtype=torch.uint8)
    packed[..., :sf_k] = _ue8m0_bytes(sf)
    return get_mn_major_tma_aligned_tensor(packed.view(torch.int32))


def get_k_grouped_mn_major_tma_aligned_packed_ue8m0_tensor(sf: torch.Tensor, grouped_layout: torch.Tensor,
                                                           ks_cpu, gran_k: int, k_alignment: int,
                                                           use_psum_layout: bool = False) -> torch.Tensor:
    """K-grouped float32 scales ``[sum_g ceil(k_g / gran_k), MN]`` (one row per ``gran_k`` x 1 block, groups one
    after the other) -> UE8M0 bytes packed four rows per int32, each group padded on its own:
    ``[sum_g ceil(k_g / (4 * gran_k)), MN]`` int32 (DeepGEMM's layout for its k-grouped sm100 wgrad)."""
    if use_psum_layout:
        raise ValueError("the psum k-grouped pack is DeepGEMM's sm100 path: not provided")
    if gran_k not in (32, 128) or k_alignment % 32:
        raise ValueError(f"gran_k must be 32 or 128 and k_alignment a multiple of 32, got {gran_k}, {k_alignment}")
    if not isinstance(sf, torch.Tensor) or sf.dim() != 2:
        raise ValueError("sf must be a [SF_K, MN] tensor")
    ks = [int(k) for k in (ks_cpu if ks_cpu is not None else [])]
    if len(ks) != grouped_layout.numel():
        raise ValueError(f"ks_cpu must have one K per group ({grouped_layout.numel()}), got {len(ks)}")
    rows = [ceil_div(k, gran_k) for k in ks]
    if sum(rows) != sf.shape[0]:
        raise ValueError(f"sf has {sf.shape[0]} rows, ks_cpu needs {sum(rows)} (ceil(k / {gran_k}) per group)")
    mn = sf.shape[1]
    bytes_ = _ue8m0_bytes(sf)
    words = [ceil_div(r, 4) for r in rows]
    out = torch.zeros((sum(words) * 4, mn), dtype=torch.uint8, device=sf.device)
    src = dst = 0
    for r, w in zip(rows, words):
        out[dst:dst + r] = bytes_[src:src + r]
        src, dst = src + r, dst + 4 * w
    # four consecutive rows of a group -> the four bytes (little end first) of one int32
    return out.view(-1, 4, mn).permute(0, 2, 1).contiguous().view(torch.int32).view(-1, mn)
