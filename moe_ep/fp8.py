"""Torch reference for the FP8 formats used everywhere in moe-ep.

These functions define the numerics that every kernel must reproduce bitwise:

- per-token-group quantization with groups of ``group_size`` (128) channels along the last dim:
  ``amax = max(|x_group|)`` clamped to at least ``1e-4``; ``scale = amax / 448``;
  with ``round_scale`` the scale is rounded *up* to a power of two; ``q = e4m3(clamp(x / scale,
  -448, 448))`` rounded to nearest even (all arithmetic in float32).
- UE8M0 scales: the biased float32 exponent byte of a power-of-two scale
  (``scale = 2 ** (e - 127)``), four groups packed per ``int32`` (group ``g`` in byte ``g % 4``).
- column-major scales: logical shape ``[.., M, G]`` with the ``M`` dimension contiguous; with TMA
  alignment the column stride is ``M`` rounded up to a multiple of 4 (16 bytes).

NaN inputs make their group's scale NaN and the group's FP8 values NaN; an ``inf`` makes its group's
scale ``inf``, the ``inf`` entries NaN (``inf / inf``) and the finite entries zero.

The low-latency dispatch casts as DeepEP's does instead (:func:`ll_dispatch_quant_ref`): a multiply
by ``448 / amax``, not a division by ``amax / 448``, so its scales and bytes differ from the above by an
ulp for some groups, and a NaN does not spread to its group.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
AMAX_MIN = 1e-4

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "AMAX_MIN",
    "ceil_div",
    "ceil_to_pow2",
    "per_token_group_quant_fp8_ref",
    "ll_dispatch_quant_ref",
    "dequant_fp8_ref",
    "pack_ue8m0",
    "unpack_ue8m0",
    "to_column_major",
    "tma_aligned_size",
]


def ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def tma_aligned_size(m: int, element_size: int = 4) -> int:
    """``m`` rounded up so that ``m * element_size`` is a multiple of 16 bytes."""
    align = 16 // element_size
    return ceil_div(m, align) * align


def ceil_to_pow2(scale: torch.Tensor) -> torch.Tensor:
    """Round positive float32 values up to the next power of two, exactly (bit manipulation).

    ``2 ** ceil(log2(s))``: a value whose mantissa bits are zero is already a power of two and is kept;
    otherwise the exponent is incremented and the mantissa cleared. NaN and inf pass through.
    """
    if scale.dtype != torch.float32:
        raise TypeError(f"ceil_to_pow2 expects float32, got {scale.dtype}")
    bits = scale.contiguous().view(torch.int32)
    mant = bits & 0x007FFFFF
    exp_bits = bits & 0x7F800000
    rounded = torch.where(mant != 0, exp_bits + 0x00800000, exp_bits)
    special = exp_bits == 0x7F800000  # inf / NaN: keep as is
    out = torch.where(special, bits, rounded)
    return out.view(torch.float32).reshape(scale.shape)


def _group_view(x: torch.Tensor, group_size: int) -> torch.Tensor:
    k = x.shape[-1]
    if k % group_size != 0:
        raise ValueError(f"last dim {k} must be a multiple of group_size={group_size} for FP8 quantization")
    return x.reshape(*x.shape[:-1], k // group_size, group_size)


def per_token_group_quant_fp8_ref(
    x: torch.Tensor,
    group_size: int = 128,
    round_scale: bool = False,
    use_ue8m0: bool = False,
    eps: float = AMAX_MIN,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` (`[..., K]`, float dtype) in groups of ``group_size`` along the last dim, each group's
    ``amax`` floored at ``eps``.

    Returns:
        q: `[..., K]` with `torch.float8_e4m3fn`.
        scales: `[..., K / group_size]` `torch.float32` (row-major), or, with ``use_ue8m0``,
            `[..., ceil(K / group_size / 4)]` `torch.int32` packed exponents (``use_ue8m0`` implies
            ``round_scale``).
    """
    if not x.is_floating_point() or x.dtype == FP8_DTYPE:
        raise TypeError(f"per_token_group_quant_fp8_ref expects a float input, got {x.dtype}")
    xg = _group_view(x.float(), group_size)
    # NOTES: amax and clamp both propagate NaN, so a group holding a NaN gets a NaN scale.
    amax = xg.abs().amax(dim=-1).clamp(min=eps)
    # NOTES: divided by a tensor, not the Python scalar: on CUDA, torch turns ``t / scalar`` into ``t * (1 / scalar)``
    # (1 ulp off IEEE division for some amax, measured on an H200), and the reference must be IEEE on every device.
    scale = amax / torch.full_like(amax, FP8_MAX)
    if round_scale or use_ue8m0:
        scale = ceil_to_pow2(scale)
    q = (xg / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.reshape(x.shape)
    if use_ue8m0:
        return q, pack_ue8m0(scale)
    return q, scale


def ll_dispatch_quant_ref(x: torch.Tensor, round_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The low-latency dispatch's cast of ``x`` `[..., K]` in 1x128 groups: DeepEP's
    (``csrc/kernels/internode_ll.cu``, ``calculate_fp8_scales``), all float32:

    - ``amax = fmaxf(1e-4, max|x_group|)``: a NaN is ignored (its own value still casts to NaN);
    - ``scale_inv = amax * fl(1/448)`` and ``q = e4m3_satfinite(x * fl(448 / amax))``;
    - with ``round_scale``: ``e = ceil(log2(amax * fl(1/448)))`` from the float's bits (exponent, +1 if
      any mantissa bit), ``scale_inv = 2^e``, ``q = e4m3_satfinite(x * 2^-e)`` (both built as bits,
      so an infinite amax gives ``scale_inv = inf`` and a multiplier of ``-inf``, as there).

    Returns ``(q float8_e4m3fn [..., K], scale_inv float32 [..., K / 128])`` (the receiver's scales; pack
    them with :func:`pack_ue8m0` for UE8M0).
    """
    if not x.is_floating_point() or x.dtype == FP8_DTYPE:
        raise TypeError(f"ll_dispatch_quant_ref expects a float input, got {x.dtype}")
    xg = _group_view(x.float(), 128)
    a = xg.abs()
    amax = torch.where(torch.isnan(a), torch.zeros_like(a), a).amax(dim=-1).clamp(min=AMAX_MIN)
    # NOTES: tensors, not Python scalars, so that CUDA runs the same float32 multiply / IEEE division.
    scale_inv = amax * torch.full_like(amax, 1.0 / FP8_MAX)  # the float32 constant: 1/448 rounded once
    if round_scale:
        bits = scale_inv.view(torch.int32)
        e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
        scale = ((127 - e) << 23).view(torch.float32)
        scale_inv = ((e + 127) << 23).view(torch.float32)
    else:
        scale = torch.full_like(amax, FP8_MAX) / amax
    q = (xg * scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(x.shape), scale_inv


def pack_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """Pack power-of-two float32 scales `[..., G]` into `[..., ceil(G / 4)]` int32 (byte ``g % 4``)."""
    if scale.dtype != torch.float32:
        raise TypeError(f"pack_ue8m0 expects float32 scales, got {scale.dtype}")
    g = scale.shape[-1]
    exps = ((scale.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.int64)
    pad = ceil_div(g, 4) * 4 - g
    if pad:
        exps = torch.nn.functional.pad(exps, (0, pad))
    exps = exps.reshape(*scale.shape[:-1], ceil_div(g, 4), 4)
    shifts = torch.tensor([0, 8, 16, 24], dtype=torch.int64, device=scale.device)
    packed = (exps << shifts).sum(dim=-1)
    # reinterpret as signed int32 (the top byte may set the sign bit)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32)


def unpack_ue8m0(packed: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Inverse of :func:`pack_ue8m0`: `[..., ceil(G / 4)]` int32 to `[..., G]` float32 scales."""
    if packed.dtype != torch.int32:
        raise TypeError(f"unpack_ue8m0 expects int32, got {packed.dtype}")
    p = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.tensor([0, 8, 16, 24], dtype=torch.int64, device=packed.device)
    exps = (p.unsqueeze(-1) >> shifts) & 0xFF
    exps = exps.reshape(*packed.shape[:-1], packed.shape[-1] * 4)[..., :num_groups]
    return (exps.to(torch.int32) << 23).view(torch.float32)


def dequant_fp8_ref(q: torch.Tensor, scales: torch.Tensor, group_size: int = 128) -> torch.Tensor:
    """``q.float() * scale`` per group. ``scales`` is float32 `[..., G]` (any strides) or packed UE8M0 int32."""
    if q.dtype != FP8_DTYPE:
        raise TypeError(f"dequant_fp8_ref expects {FP8_DTYPE}, got {q.dtype}")
    g = ceil_div(q.shape[-1], group_size)
    if scales.dtype == torch.int32:
        scales = unpack_ue8m0(scales, g)
    qg = _group_view(q.float(), group_size)
    return (qg * scales.unsqueeze(-1)).reshape(q.shape)


def to_column_major(scales: torch.Tensor, tma_aligned: bool = True) -> torch.Tensor:
    """Return ``scales`` (`[..., M, G]`) with the same values, laid out with the M dim contiguous.

    With ``tma_aligned`` the column stride is ``M`` rounded up to a multiple of 16 bytes; the
    logical shape stays `[..., M, G]`.
    """
    *lead, m, g = scales.shape
    mp = tma_aligned_size(m, scales.element_size()) if tma_aligned else m
    storage = torch.zeros(*lead, g, mp, dtype=scales.dtype, device=scales.device)
    out = storage[..., :m].transpose(-1, -2)
    out.copy_(scales)
    return out
