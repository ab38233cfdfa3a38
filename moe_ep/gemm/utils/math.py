"""DeepGEMM's ``deep_gemm.utils.math`` helpers (integer rounding and the FP8 casts its tests and engines' tests
use to make GEMM operands), with its names, arguments and results.

The casts are the host-side reference recipe: per 1x``gran_k`` (token) or ``gran_k`` x ``gran_k`` (block) group,
``sf = max(amax, 1e-4) / 448`` (rounded up to a power of two with ``use_ue8m0``), ``q = e4m3(x * (1 / sf))``;
``moe_ep.quant`` has the device kernels.
"""

from __future__ import annotations

from typing import Tuple

import torch

__all__ = ["ceil_div", "align", "ceil_to_ue8m0", "pack_ue8m0_to_int", "per_token_cast_to_fp8",
           "per_channel_cast_to_fp8", "per_block_cast_to_fp8", "per_custom_dims_cast_to_fp8", "calc_diff"]

_E4M3_MAX = 448.0
_AMAX_FLOOR = 1e-4


def ceil_div(x: int, y: int) -> int:
    """``ceil(x / y)`` for positive ints."""
    return -(-x // y)


def align(x: int, y: int) -> int:
    """``x`` rounded up to a multiple of ``y``."""
    return ceil_div(x, y) * y


def ceil_to_ue8m0(x: torch.Tensor) -> torch.Tensor:
    """Each value's magnitude rounded up to a power of two (float32; exponents kept within [2^-126, 2^127])."""
    bits = x.abs().float().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    exponent = exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent.clamp(1, 254) << 23).view(torch.float32)


def pack_ue8m0_to_int(x: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 scales (last dim a multiple of 4) as their exponent bytes, four per int32."""
    if x.dtype != torch.float32 or x.shape[-1] % 4:
        raise ValueError(f"pack_ue8m0_to_int takes float32 with a last dim divisible by 4, got {x.dtype} "
                         f"{tuple(x.shape)}")
    bits = x.view(torch.int32)
    if bool((bits & 0x7FFFFF).any()):
        raise ValueError("pack_ue8m0_to_int: the scales must be powers of two (ceil_to_ue8m0)")
    return (bits >> 23).to(torch.uint8).view(torch.int32)


def _scale(amax: torch.Tensor, use_ue8m0: bool) -> torch.Tensor:
    sf = amax.clamp(min=_AMAX_FLOOR) / _E4M3_MAX
    return ceil_to_ue8m0(sf) if use_ue8m0 else sf


def per_token_cast_to_fp8(x: torch.Tensor, use_ue8m0: bool, gran_k: int = 128,
                          use_packed_ue8m0: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """``[m, n]`` -> e4m3 ``[m, n]`` and float32 scales ``[m, ceil(n / gran_k)]`` (one per 1 x ``gran_k``
    group; ``use_packed_ue8m0``: packed int32 words, see :func:`pack_ue8m0_to_int`)."""
    if x.dim() != 2:
        raise ValueError(f"per_token_cast_to_fp8 takes a 2D tensor, got shape {tuple(x.shape)}")
    m, n = x.shape
    width = align(n, gran_k)
    padded = x.new_zeros((m, width))
    padded[:, :n] = x
    groups = padded.view(m, width // gran_k, gran_k)
    sf = _scale(groups.abs().float().amax(dim=2), use_ue8m0)
    q = (groups * (1.0 / sf.unsqueeze(2))).to(torch.float8_e4m3fn).view(m, width)[:, :n].contiguous()
    return q, (pack_ue8m0_to_int(sf) if use_packed_ue8m0 else sf)


def per_channel_cast_to_fp8(x: torch.Tensor, use_ue8m0: bool, gran_k: int = 128) -> Tuple[torch.Tensor, torch.Tensor]:
    """``[m, n]`` (``m`` a multiple of ``gran_k``) -> e4m3 and float32 scales ``[m / gran_k, n]`` (one per
    ``gran_k`` x 1 group)."""
    if x.dim() != 2 or x.shape[0] % gran_k:
        raise ValueError(f"per_channel_cast_to_fp8 takes [m, n] with m a multiple of {gran_k}, got {tuple(x.shape)}")
    m, n = x.shape
    groups = x.view(m // gran_k, gran_k, n)
    sf = _scale(groups.abs().float().amax(dim=1), use_ue8m0)
    return (groups * (1.0 / sf.unsqueeze(1))).to(torch.float8_e4m3fn).view(m, n), sf


def per_block_cast_to_fp8(x: torch.Tensor, use_ue8m0: bool, gran_k: int = 128) -> Tuple[torch.Tensor, torch.Tensor]:
    """``[m, n]`` -> e4m3 ``[m, n]`` and float32 scales ``[ceil(m / gran_k), ceil(n / gran_k)]`` (one per
    ``gran_k`` x ``gran_k`` block, the weights' layout)."""
    if x.dim() != 2:
        raise ValueError(f"per_block_cast_to_fp8 takes a 2D tensor, got shape {tuple(x.shape)}")
    m, n = x.shape
    mp, np_ = align(m, gran_k), align(n, gran_k)
    padded = x.new_zeros((mp, np_))
    padded[:m, :n] = x
    blocks = padded.view(mp // gran_k, gran_k, np_ // gran_k, gran_k)
    sf = _scale(blocks.abs().float().amax(dim=(1, 3), keepdim=True), use_ue8m0)
    q = (blocks * (1.0 / sf)).to(torch.float8_e4m3fn).view(mp, np_)[:m, :n].contiguous()
    return q, sf.view(mp // gran_k, np_ // gran_k)


def per_custom_dims_cast_to_fp8(x: torch.Tensor, dims: Tuple, use_ue8m0: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """One scale per index of the dimensions ``dims`` (amax over all the others)."""
    keep = set(dims)
    reduce = tuple(i for i in range(x.dim()) if i not in keep)
    sf = _scale(x.abs().float().amax(dim=reduce, keepdim=True), use_ue8m0)
    return (x * (1.0 / sf)).to(torch.float8_e4m3fn), sf.squeeze()


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """DeepGEMM's test metric: ``1 - 2 <x, y> / (|x|^2 + |y|^2)`` in float64 (0 for equal tensors)."""
    x, y = x.double(), y.double()
    return 1 - 2 * (x * y).sum() / (x * x + y * y).sum()
