"""Weight-side FP8 quantization (torch, offline): one scale per ``block_size x block_size`` block, as DeepGEMM's
weights take them, and its inverse. Re-exported by :mod:`moe_ep.quant`."""

from __future__ import annotations

import torch

from .fp8 import AMAX_MIN, FP8_DTYPE, FP8_MAX, ceil_div, ceil_to_pow2

__all__ = ["dequant_block_fp8", "per_block_quant_fp8"]

_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def per_block_quant_fp8(w: torch.Tensor, block_size: int = 128, *,
                        round_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize weights with one scale per ``block_size x block_size`` block (torch; runs offline).

    Arguments:
        w: `[N, K]` or `[E, N, K]` float tensor; N and K need not be multiples of ``block_size``
            (partial edge blocks use their own amax).
        round_scale: round scales up to a power of two (what UE8M0 GEMMs need).

    Returns:
        w_fp8: same shape with `torch.float8_e4m3fn`.
        scales: `[ceil(N / block_size), ceil(K / block_size)]` (`[E, ...]` for 3D) `torch.float32`.
    """
    if not isinstance(w, torch.Tensor) or w.dtype not in _INPUT_DTYPES:
        raise TypeError(f"w must be a bfloat16, float16 or float32 tensor, got {getattr(w, 'dtype', type(w))}")
    if w.dim() not in (2, 3):
        raise ValueError(f"w must be [N, K] or [E, N, K], got shape {tuple(w.shape)}")
    *lead, n, k = w.shape
    nb, kb = ceil_div(n, block_size), ceil_div(k, block_size)
    wp = torch.nn.functional.pad(w.float(), (0, kb * block_size - k, 0, nb * block_size - n))
    blocks = wp.reshape(*lead, nb, block_size, kb, block_size)
    amax = blocks.abs().amax(dim=(-3, -1)).clamp(min=AMAX_MIN)  # [*lead, nb, kb]
    scales = amax / torch.full_like(amax, FP8_MAX)  # IEEE on CUDA too (moe_ep.fp8.per_token_group_quant_fp8_ref)
    if round_scale:
        scales = ceil_to_pow2(scales)
    q = (blocks / scales[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.reshape(*lead, nb * block_size, kb * block_size)[..., :n, :k].contiguous()
    return q, scales


def dequant_block_fp8(w_fp8: torch.Tensor, scales: torch.Tensor, block_size: int = 128) -> torch.Tensor:
    """Inverse of :func:`per_block_quant_fp8`.

    Arguments:
        w_fp8: `[N, K]` or `[E, N, K]` with `torch.float8_e4m3fn`.
        scales: `[ceil(N / block_size), ceil(K / block_size)]` (`[E, ...]`) `torch.float32`.

    Returns:
        `w_fp8` dequantized, same shape, `torch.float32`.
    """
    if w_fp8.dtype != FP8_DTYPE:
        raise TypeError(f"w_fp8 must be {FP8_DTYPE}, got {w_fp8.dtype}")
    n, k = w_fp8.shape[-2:]
    full = scales.repeat_interleave(block_size, dim=-2).repeat_interleave(block_size, dim=-1)
    return w_fp8.float() * full[..., :n, :k]
