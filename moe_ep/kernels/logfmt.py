"""Combine wire formats: FP8 (e4m3, 1x128 scales) and LogFMT-10, as Triton device helpers and the torch
functions with the same math (the ``torch`` backend and the references use the latter).

Every combine payload row is a float32 row ``y[H]`` (exact upcast of the BF16/FP16 expert output) and is
sent in one of four formats (``fmt`` codes below; the receiver decodes to float32 and sums in float32):

======== ===== ============================================================================ =============
fmt      code  per row of H channels on the wire                                          bytes/channel
======== ===== ============================================================================ =============
bf16     0     ``H`` x BF16                                                                  2
fp16     1     ``H`` x FP16                                                                  2
fp8      2     ``H`` x e4m3 byte | ``H/128`` x float32 scale                                 1.03125
logfmt   3     ``H`` x low byte | ``H/4`` x byte (4 x 2 high bits) | ``H/64`` x int32 base   1.375
               | ``H/64`` x int32 step
======== ===== ============================================================================ =============

FP8: ``amax = max|y_group|`` clamped to >= 1e-4, ``scale = amax / 448``, ``q = e4m3(y / scale)``
(nearest even, saturating: :func:`moe_ep.fp8.per_token_group_quant_fp8_ref`, groups of 128); decoded as
``float(q) * scale``. Any NaN/inf in a 128-channel group makes the whole group decode to NaN.

LogFMT-10 (this project's definition, after DeepSeek-V3's LogFMT-nBit: sign + a code linear in the log of
``|y|`` between the group's min and max, 0 reserved for zero). To keep the kernels and torch bitwise equal
there is no transcendental: the log is the IEEE bit pattern itself (``bits(|y|) / 2^23 - 127`` is a
piecewise-linear log2), so every step is integer arithmetic.

- Per 64-channel group: ``a = bits(|y|)`` (int32), ``hi = max a``; ``lo = max(min of a over non-zero
  entries, hi - 12 * 2^23)`` (the range is clamped to 12 octaves below the group max);
  ``step = max(ceil((hi - lo) / 510), 1)`` (int32). Sent: ``lo`` and ``step`` (two int32).
- Per element: 10 bits = sign bit (bit 9) | 9-bit code ``c``. ``c = 0`` for ``a == 0`` or ``a < lo - 2^23``
  (below half the floor), ``c = 1`` for other ``a < lo``, else ``c = 1 + (a - lo + step // 2) // step``
  (round half up in the log domain, at most 511). Decoded: ``c == 0 -> 0``, else
  ``+-float_from_bits(lo + (c - 1) * step)``.
- Packing: the low 8 bits of each code as one byte; the high 2 bits of channels ``4j..4j+3`` in byte ``j``
  of the second plane (channel ``4j + i`` in bits ``2i, 2i+1``). 11 bits per channel in all.
- NaN/inf: a group holding any non-finite value is sent with ``step = -1`` and decodes to NaN in all its
  64 channels (inf is not kept as inf).

The relative error of one decoded value is at most ``step / 2^24`` octaves (about ``0.5 * 12/510 * ln 2``
= 0.8 % at the full 12-octave range, less when the group's values span fewer octaves): between FP8 (e4m3,
up to 6.25 %) and BF16 (0.39 %); ``perf/bench_combine_accuracy.py`` measures it on expert outputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fp8 import FP8_DTYPE, per_token_group_quant_fp8_ref
from .fp8_cast import div_by_scale, e4m3_byte, group_scale

__all__ = ["FORMATS", "FMT_BF16", "FMT_FP16", "FMT_FP8", "FMT_LOGFMT", "row_bytes", "encode_rows", "decode_rows",
           "logfmt_encode", "logfmt_decode"]

FMT_BF16, FMT_FP16, FMT_FP8, FMT_LOGFMT = 0, 1, 2, 3
FORMATS = {"bf16": FMT_BF16, "fp16": FMT_FP16, "fp8": FMT_FP8, "logfmt": FMT_LOGFMT}
FP8_GROUP = 128
LOG_GROUP = 64
LOG_CODES = 510  # codes 1..511 cover [lo, hi]: 510 steps
LOG_RANGE = 12 << 23  # 12 octaves in bit-pattern units
_NEG_ONE = -1

LOG_GROUP_C = tl.constexpr(LOG_GROUP)
FP8_GROUP_C = tl.constexpr(FP8_GROUP)


def row_bytes(fmt: int, hidden: int) -> int:
    """Bytes one row of ``hidden`` channels takes on the wire in format ``fmt``."""
    if fmt in (FMT_BF16, FMT_FP16):
        return 2 * hidden
    if fmt == FMT_FP8:
        return hidden + 4 * (hidden // FP8_GROUP)
    return hidden + hidden // 4 + 8 * (hidden // LOG_GROUP)


def check_hidden(fmt: int, hidden: int) -> None:
    g = FP8_GROUP if fmt == FMT_FP8 else LOG_GROUP if fmt == FMT_LOGFMT else 1
    if hidden % g:
        name = {FMT_FP8: "FP8", FMT_LOGFMT: "LogFMT"}[fmt]
        raise ValueError(f"{name} combine needs hidden to be a multiple of {g}, got {hidden}")


# ---------------------------------------------------------------------------------------------- torch
def logfmt_encode(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 ``y`` `[M, H]` -> (low bytes uint8 [M, H], high planes uint8 [M, H/4], lo int32 [M, H/64],
    step int32 [M, H/64])."""
    M, H = y.shape
    a = y.contiguous().view(torch.int32) & 0x7FFFFFFF
    ag = a.reshape(M, H // LOG_GROUP, LOG_GROUP)
    bad = (ag >= 0x7F800000).any(dim=2)
    hi = ag.amax(dim=2)
    big = torch.full_like(ag, 0x7FFFFFFF)
    lo = torch.where(ag > 0, ag, big).amin(dim=2)
    lo = torch.maximum(lo, hi - LOG_RANGE)
    lo = torch.where(hi == 0, torch.zeros_like(lo), lo)
    step = torch.clamp(torch.div(hi - lo + (LOG_CODES - 1), LOG_CODES, rounding_mode="floor"), min=1)
    lo_e, st_e = lo[:, :, None], step[:, :, None]
    d = torch.clamp(ag - lo_e, min=0)
    c = 1 + torch.div(d + torch.div(st_e, 2, rounding_mode="floor"), st_e, rounding_mode="floor")
    c = torch.clamp(c, max=511)
    c = torch.where((ag == 0) | (ag < lo_e - (1 << 23)), torch.zeros_like(c), c)
    sign = (y.contiguous().view(torch.int32).reshape(M, H // LOG_GROUP, LOG_GROUP) < 0).to(torch.int32)
    code = (c | (sign << 9)).reshape(M, H)
    low = (code & 0xFF).to(torch.uint8)
    h2 = ((code >> 8) & 3).reshape(M, H // 4, 4)
    high = (h2[..., 0] | (h2[..., 1] << 2) | (h2[..., 2] << 4) | (h2[..., 3] << 6)).to(torch.uint8)
    step = torch.where(bad, torch.full_like(step, _NEG_ONE), step)
    lo = torch.where(bad, torch.zeros_like(lo), lo)
    return low, high, lo.to(torch.int32), step.to(torch.int32)


def logfmt_decode(low: torch.Tensor, high: torch.Tensor, lo: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`logfmt_encode` (float32 `[M, H]`)."""
    M, H = low.shape
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32, device=low.device)
    h2 = (high.to(torch.int32)[:, :, None] >> shifts) & 3
    code = low.to(torch.int32) | (h2.reshape(M, H) << 8)
    c = (code & 0x1FF).reshape(M, H // LOG_GROUP, LOG_GROUP)
    st = step[:, :, None]
    bits = lo[:, :, None] + (c - 1) * torch.clamp(st, min=0)
    bits = torch.where(c == 0, torch.zeros_like(bits), bits) | (((code >> 9) & 1) << 31).reshape(bits.shape)
    v = bits.to(torch.int32).view(torch.float32)
    v = torch.where(st < 0, torch.full_like(v, float("nan")), v)
    return v.reshape(M, H)


def encode_rows(y: torch.Tensor, fmt: int) -> torch.Tensor:
    """Rows ``y`` `[M, H]` (BF16 / FP16 / float32) -> wire bytes uint8 `[M, row_bytes(fmt, H)]`."""
    M, H = y.shape
    if fmt == FMT_BF16:
        return y.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(M, 2 * H)
    if fmt == FMT_FP16:
        return y.to(torch.float16).contiguous().view(torch.uint8).reshape(M, 2 * H)
    if fmt == FMT_FP8:
        q, s = per_token_group_quant_fp8_ref(y.float(), FP8_GROUP)
        return torch.cat([q.view(torch.uint8), s.contiguous().view(torch.uint8).reshape(M, 4 * s.shape[1])], dim=1)
    low, high, lo, step = logfmt_encode(y.float())
    return torch.cat([low, high, lo.contiguous().view(torch.uint8).reshape(M, lo.element_size() * lo.shape[1]),
                      step.contiguous().view(torch.uint8).reshape(M, step.element_size() * step.shape[1])], dim=1)


def decode_rows(b: torch.Tensor, fmt: int, hidden: int) -> torch.Tensor:
    """Wire bytes `[M, row_bytes]` -> float32 `[M, hidden]` (what the receive kernels compute)."""
    M, H = b.shape[0], hidden
    b = b.contiguous()
    if fmt == FMT_BF16:
        return b[:, :2 * H].contiguous().view(torch.bfloat16).float()
    if fmt == FMT_FP16:
        return b[:, :2 * H].contiguous().view(torch.float16).float()
    if fmt == FMT_FP8:
        q = b[:, :H].contiguous().view(FP8_DTYPE).float()
        s = b[:, H:H + 4 * (H // FP8_GROUP)].contiguous().view(torch.float32)
        return (q.reshape(M, H // FP8_GROUP, FP8_GROUP) * s[:, :, None]).reshape(M, H)
    G = H // LOG_GROUP
    o = H + H // 4
    return logfmt_decode(b[:, :H], b[:, H:o], b[:, o:o + 4 * G].contiguous().view(torch.int32),
                         b[:, o + 4 * G:o + 8 * G].contiguous().view(torch.int32))


# ---------------------------------------------------------------------------------------------- Triton
@triton.jit
def fp16_bits(v):
    """float32 -> float16 bit pattern (int16), round to nearest even (the interpreter's numpy cast and
    ``cvt.rn.f16.f32`` agree with torch)."""
    return v.to(tl.float16).to(tl.int16, bitcast=True)


@triton.jit
def e4m3_decode(b):
    """e4m3fn byte (any int type) -> float32, exact; 0x7F / 0xFF -> NaN (the interpreter's own FP8 cast
    decodes NaN bytes as +-480)."""
    b = b.to(tl.int32) & 0xFF
    e = (b >> 3) & 0xF
    m = b & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    v = tl.where((b & 0x7F) == 0x7F, float("nan"), v)
    return tl.where(b >= 128, -v, v)


@triton.jit
def fp8_encode_groups(y, NATIVE_FP8: tl.constexpr):
    """float32 `[BT, G, 128]` -> (e4m3 bytes uint8, scales float32 `[BT, G]`): numerics of
    :func:`moe_ep.fp8.per_token_group_quant_fp8_ref` (scale = amax / 448, IEEE division)."""
    abs_bits = y.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    amax = tl.max(abs_bits, axis=2).to(tl.float32, bitcast=True)
    scale = group_scale(amax, False, False, False)
    q = div_by_scale(y, scale)  # IEEE y / scale, one division per group
    return e4m3_byte(q, NATIVE_FP8), scale


@triton.jit
def logfmt_encode_groups(y):
    """float32 `[BT, G, 64]` -> (code int32 `[BT, G, 64]` (10 bits), lo int32 `[BT, G]`, step int32 `[BT, G]`)."""
    bits = y.to(tl.int32, bitcast=True)
    a = bits & 0x7FFFFFFF
    bad = tl.max((a >= 0x7F800000).to(tl.int32), axis=2) > 0
    hi = tl.max(a, axis=2)
    lo = tl.min(tl.where(a > 0, a, 0x7FFFFFFF), axis=2)
    lo = tl.maximum(lo, hi - (12 << 23))
    lo = tl.where(hi == 0, 0, lo)
    step = tl.maximum((hi - lo + 509) // 510, 1)
    lo_e = lo[:, :, None]
    st_e = step[:, :, None]
    d = tl.maximum(a - lo_e, 0)
    c = tl.minimum(1 + (d + st_e // 2) // st_e, 511)
    c = tl.where((a == 0) | (a < lo_e - (1 << 23)), 0, c)
    code = c | ((bits >> 22) & 0x200)  # sign bit 31 -> bit 9
    step = tl.where(bad, -1, step)
    lo = tl.where(bad, 0, lo)
    return code, lo, step


@triton.jit
def logfmt_decode_values(code, lo, step):
    """10-bit ``code`` and its group's ``lo`` / ``step`` (int32, broadcast alike) -> float32."""
    c = code & 0x1FF
    bits = lo + (c - 1) * tl.maximum(step, 0)
    bits = tl.where(c == 0, 0, bits) | ((code & 0x200) << 22)
    v = bits.to(tl.float32, bitcast=True)
    return tl.where(step < 0, float("nan"), v)
