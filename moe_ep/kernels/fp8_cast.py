"""Triton device helpers for the FP8 (e4m3fn) numerics shared by every quantizing kernel.

Every kernel that quantizes calls :func:`group_scale` and :func:`e4m3_byte` (or :func:`e4m3_bits`)
so that the compiled kernels, the Triton interpreter and :mod:`moe_ep.fp8` agree bitwise. Divide
``x / scale`` with ``tl.math.div_rn``: a plain float32 ``/`` compiles to ``div.full.f32``, which is
not correctly rounded.

NOTES: the interpreter's own ``float32 -> tl.float8e4nv`` cast is wrong (ties, large values and
subnormals), so under the interpreter (and wherever :func:`native_e4m3_supported` says no) kernels
compute the e4m3 bit pattern in integer arithmetic and store it as ``uint8`` into a ``uint8`` view of
the FP8 output. On sm90+ compiled Triton lowers the cast to one ``cvt.rn.satfinite.e4m3x2.f32`` per
two values (round to nearest even, saturating, NaN to NaN): the same bytes at a fraction of the
~30 integer instructions per value, which would otherwise bound the quant kernels below HBM speed.
(sm89 goes through an fp16 intermediate with round-toward-zero: double rounding, so not used there.)
"""

import os

import torch
import triton
import triton.language as tl

# NOTES: globals read inside @triton.jit must be constexpr *instances*; the annotation form
# (``FP8_MAX: tl.constexpr = 448.0``) runs in the interpreter but fails to compile.
FP8_MAX = tl.constexpr(448.0)
AMAX_MIN = tl.constexpr(1e-4)


@triton.jit
def ceil_pow2(scale):
    """``2 ** ceil(log2(scale))`` for positive float32, exact (no transcendental); NaN/inf pass."""
    bits = scale.to(tl.int32, bitcast=True)
    mant = bits & 0x007FFFFF
    exp_bits = bits & 0x7F800000
    rounded = tl.where(mant != 0, exp_bits + 0x00800000, exp_bits)
    out = tl.where(exp_bits == 0x7F800000, bits, rounded)
    return out.to(tl.float32, bitcast=True)


@triton.jit
def group_scale(amax, ROUND_SCALE: tl.constexpr):
    """Scale of one quantization group from its ``max|x|`` (float32)."""
    # NOTES: written as where() rather than maximum() so that NaN propagates the same way on every
    # backend (torch's clamp keeps NaN).
    amax = tl.where(amax < AMAX_MIN, AMAX_MIN, amax)
    # NOTES: div_rn, not ``/``: compiled Triton lowers a float32 ``/`` to div.full.f32 (up to 2 ulp
    # off), which would break bitwise agreement with torch on a GPU. The interpreter is IEEE either way.
    scale = tl.math.div_rn(amax, FP8_MAX)
    if ROUND_SCALE:
        scale = ceil_pow2(scale)
    return scale


@triton.jit
def e4m3_bits(v):
    """The e4m3fn byte (as int32 in [0, 255]) of float32 ``v``: saturate to +-448, round to nearest even.

    NaN maps to 0x7F (with the sign bit of the input), like torch's cast.
    """
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000  # exponent all ones, mantissa non-zero
    a = tl.abs(v)
    a = tl.where(a > FP8_MAX, FP8_MAX, a)
    a = tl.where(is_nan, 0.0, a)  # NaN handled at the end; keep the integer paths defined
    abits = a.to(tl.int32, bitcast=True)
    # Step 1: normal range (|v| >= 2^-6): keep 3 mantissa bits, round half to even; a carry
    # into the exponent field is the correct result.
    r = abits + 0x7FFFF + ((abits >> 20) & 1)
    r = r & -1048576  # clear the low 20 bits (0xFFF00000)
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
    # Step 2: subnormal range: multiples of 2^-9, round half to even (8 means 2^-6, byte 0x08).
    s = a * 512.0
    fl = tl.floor(s)
    frac = s - fl
    fli = fl.to(tl.int32)
    up = (frac > 0.5) | ((frac == 0.5) & ((fli & 1) == 1))
    sub = fli + up.to(tl.int32)
    out = tl.where(a < 0.015625, sub, normal)
    out = tl.where(is_nan, 0x7F, out)
    return out | sign


@triton.jit
def e4m3_byte(v, NATIVE: tl.constexpr):
    """The e4m3fn byte (uint8) of float32 ``v``, saturating at +-448: hardware cvt when ``NATIVE``."""
    if NATIVE:
        return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        return e4m3_bits(v).to(tl.uint8)


def native_e4m3_supported(device: torch.device) -> bool:
    """Whether :func:`e4m3_byte` may use the hardware cast on ``device`` (compiled, CUDA sm90+).

    ``MOE_EP_FP8_SOFT_CAST=1`` forces the integer path everywhere (for bitwise cross-checks).
    """
    if os.environ.get("TRITON_INTERPRET", "0") == "1" or device.type != "cuda" or torch.version.hip is not None:
        return False
    if os.environ.get("MOE_EP_FP8_SOFT_CAST", "0") == "1":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)[0] >= 9
