"""Scale layouts: :func:`transform_sf_into_required_layout` (DeepGEMM's sm90 rules for which scale layouts the
GEMMs read)."""

from __future__ import annotations

from typing import Optional

import torch

from ..fp8 import ceil_div
from .checks import _as_tuple
from .utils.layout import get_mn_major_tma_aligned_tensor

def transform_sf_into_required_layout(sf: torch.Tensor, mn: int, k: int, recipe, num_groups: Optional[int] = None,
                                      is_sfa: Optional[bool] = None, disable_ue8m0_cast: bool = False,
                                      psum_layout: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Scales in the layout the GEMMs read (DeepGEMM's sm90 rules): 1x128 float32 scales (``recipe`` 3-tuple
    with ``is_sfa=True``, or ``(1, 128)``) -> :func:`get_mn_major_tma_aligned_tensor`; 128x128 float32
    scales (``is_sfa=False`` / ``(128, 128)``) -> checked (contiguous, or contiguous once the last two dims
    are swapped) and returned as they are; packed UE8M0 int32 1x128 scales (which the GEMMs here read
    directly) -> returned as they are. Anything else: ValueError. ``disable_ue8m0_cast`` and
    ``psum_layout`` (sm100's UE8M0 packing) change nothing here."""
    del disable_ue8m0_cast, psum_layout
    rec = _as_tuple(recipe, "recipe")
    if len(rec) == 3:
        if is_sfa is None:
            raise ValueError("a 3-element recipe needs is_sfa (which operand's granularity to take)")
        gran_mn, gran_k = (rec[0] if is_sfa else rec[1]), rec[2]
    elif len(rec) == 2:
        if is_sfa is not None:
            raise ValueError("a 2-element recipe is (gran_mn, gran_k) of one operand: pass is_sfa=None")
        gran_mn, gran_k = rec
    else:
        raise ValueError(f"recipe must have 2 or 3 elements, got {rec}")
    if not isinstance(sf, torch.Tensor):
        raise TypeError(f"sf must be a tensor, got {type(sf).__name__}")
    lead = () if num_groups is None else (num_groups,)
    supported = "supported: float32 (1, 128) or (128, 128) scales, packed UE8M0 int32 (1, 128) scales"
    if gran_k != 128 or gran_mn not in (1, 128):
        raise ValueError(f"scale granularity ({gran_mn}, {gran_k}) is not supported; {supported}")
    kb = ceil_div(k, 128)
    if sf.dtype == torch.float32:
        want = (*lead, ceil_div(mn, gran_mn), kb)
    elif sf.dtype == torch.int32 and gran_mn == 1:
        want = (*lead, mn, ceil_div(kb, 4))
    else:
        raise ValueError(f"{sf.dtype} scales with granularity ({gran_mn}, {gran_k}): {supported}")
    if tuple(sf.shape) != want:
        raise ValueError(f"sf must have shape {list(want)} for mn={mn}, k={k}, got {list(sf.shape)}")
    if sf.dtype == torch.int32:
        return sf
    if gran_mn == 1:
        return get_mn_major_tma_aligned_tensor(sf)
    rows, cols = sf.shape[-2:]
    ok = (sf.stride(-1) == 1 and (rows <= 1 or sf.stride(-2) == cols)) or \
         (sf.stride(-2) == 1 and (cols <= 1 or sf.stride(-1) == rows))
    if num_groups is not None and num_groups > 1:
        ok = ok and sf.stride(0) == rows * cols
    if not ok:
        raise ValueError(f"128x128 scales must be contiguous (or contiguous with the last two dims swapped), got "
                         f"strides {sf.stride()}")
    return sf
