"""Triton device helpers for the FP8 (e4m3fn) numerics shared by every quantizing kernel.

Every kernel that quantizes calls :func:`group_scale` and :func:`e4m3_bits` so that the compiled
kernels, the Triton interpreter and :mod:`moe_ep.fp8` agree bitwise.

NOTES: the interpreter's own ``float32 -> tl.float8e4nv`` cast is wrong (ties, large values and
subnormals), so kernels never cast to FP8: they compute the e4m3 bit pattern in integer arithmetic
and store it as ``uint8`` into a ``uint8`` view of the FP8 output.
"""

import triton
import triton.language as tl

FP8_MAX: tl.constexpr = 448.0
AMAX_MIN: tl.constexpr = 1e-4


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
