"""Triton device helpers for the FP8 (e4m3fn) numerics shared by every quantizing kernel.

Every kernel that quantizes calls :func:`group_scale`, :func:`div_by_scale` and :func:`e4m3_byte` (or
:func:`e4m3_bits`) so that the compiled kernels, the Triton interpreter and :mod:`moe_ep.fp8` agree
bitwise; the low-latency dispatch send calls :func:`ll_group_scales` instead (DeepEP's cast, see
:func:`moe_ep.fp8.ll_dispatch_quant_ref`). Never write a float32 ``/``: compiled Triton lowers it to
``div.full.f32``, which is not correctly rounded.

``x / scale`` is correctly rounded (IEEE ``div.rn``) without a division per element:
:func:`div_by_scale` takes one IEEE reciprocal per group, ``r = 1 / s``, and per element
``q0 = x * r; rem = fma(-s, q0, x); q = fma(rem, r, q0)`` (Markstein's correction), then ``q0``'s sign
bit ORed into ``q`` so that ``x = -0`` gives ``-0``. With ``r``
correctly rounded, ``q0`` is within an ulp of ``x / s``, ``rem`` is exact and ``q`` is the correctly
rounded quotient, as long as ``r`` is normal and nothing underflows: the quant's scales lie in
``[1e-4 / 448, FLT_MAX / 448]`` and ``|q| <= 448``. A subnormal ``x`` (whose remainder underflows) may
get a quotient some ulps off ``div.rn``'s, below ``2^-104`` at these scales: the same e4m3 byte (a signed
zero) either way.
An infinite scale (an infinite ``x`` in the group) gives ``r = 0`` and is replaced by 0 in the remainder,
so ``q = q0``, the IEEE quotient (``+-0``; NaN for ``inf / inf``); a NaN scale gives NaN as IEEE does. A quant
scale is never 0 (amax is floored at 1e-4) nor meets an infinite ``x`` while finite (that ``x`` is its
group's amax): both are outside the helper's domain.

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
AMAX_MIN_SMALL = tl.constexpr(1e-10)  # vLLM's and SGLang's eps (the quant ops' eps=1e-10)
# float32(1) / float32(448), correctly rounded in float32 (C's ``1 / 448.0f``); exactly representable in a double.
FP8_MAX_INV = tl.constexpr(float.fromhex("0x1.24924ap-9"))
SIGN_BIT = tl.constexpr(-(2**31))  # 0x80000000 as an int32
# bf16 arithmetic (vLLM's CUDA SiLU-and-mul quant): bf16(1e-10) and bf16(1) / bf16(448), as float32 values
BF16_AMAX_MIN = tl.constexpr(float.fromhex("0x1.b8p-34"))
BF16_FP8_MAX_INV = tl.constexpr(float.fromhex("0x1.24p-9"))


def _fma_rounds_once() -> bool:
    """Whether ``tl.fma`` rounds once where these kernels run: always compiled (``fma.rn.f32``); in the
    interpreter only from the Triton that ships a float32 fma in it (older ones multiply, then add)."""
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return True
    try:
        from triton._C.libtriton import interpreter
    except ImportError:
        return False
    return hasattr(interpreter, "fma_fp32")


# NOTES: where tl.fma rounds twice, the correction is not exact: div_by_scale divides per element there
# (the interpreter only, where a division costs what a multiply does).
EXACT_FMA = tl.constexpr(_fma_rounds_once())


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
def group_scale(amax, ROUND_SCALE: tl.constexpr, SMALL_EPS: tl.constexpr, POW2_FLOOR: tl.constexpr):
    """Scale of one quantization group from its ``max|x|`` (float32), amax floored at 1e-4 (1e-10 with
    ``SMALL_EPS``); with ``ROUND_SCALE`` and ``POW2_FLOOR`` the scale is floored at 1e-10 before it is rounded
    up to a power of two (vLLM's kernels: ``exp2(ceil(log2(max(|s|, 1e-10))))``)."""
    # NOTES: written as where() rather than maximum() so that NaN propagates the same way on every
    # backend (torch's clamp keeps NaN).
    if SMALL_EPS:
        amax = tl.where(amax < AMAX_MIN_SMALL, AMAX_MIN_SMALL, amax)
    else:
        amax = tl.where(amax < AMAX_MIN, AMAX_MIN, amax)
    # NOTES: div_rn, not ``/``: compiled Triton lowers a float32 ``/`` to div.full.f32 (up to 2 ulp
    # off), which would break bitwise agreement with torch on a GPU. The interpreter is IEEE either way.
    scale = tl.math.div_rn(amax, FP8_MAX)
    if ROUND_SCALE:
        if POW2_FLOOR:
            scale = tl.where(scale < AMAX_MIN_SMALL, AMAX_MIN_SMALL, scale)
        scale = ceil_pow2(scale)
    return scale


@triton.jit
def round_bf16(y):
    """float32 ``y`` rounded to nearest-even bf16, as float32, by integer arithmetic on the bits (the
    interpreter's float32 -> bf16 cast truncates, the GPU's rounds); NaN stays NaN."""
    bits = y.to(tl.int32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return tl.where(y != y, y, rounded)  # a NaN's low bits could carry into inf


@triton.jit
def quantize_bf16_math(y, amax, ROUND_SCALE: tl.constexpr):
    """vLLM's CUDA SiLU-and-mul quant arithmetic, every step rounded to bf16 as torch's bf16 ops round it:
    ``s = bf16(max(amax, bf16(1e-10)) * bf16(1 / 448))``; with ``ROUND_SCALE`` ``s = 2^ceil(bf16(log2 s))``
    (the power of two built from bits); ``q = bf16(y * bf16(1 / s))``, which may exceed 448 when the rounded log
    lowers the scale: :func:`e4m3_byte` saturates it, as vLLM's clamp to +-448 does. ``y`` `[BT, G, GROUP]` holds
    bf16 values (as float32), ``amax`` `[BT, G]` their max |y|. Returns ``(q, s)``."""
    amax = tl.where(amax < BF16_AMAX_MIN, BF16_AMAX_MIN, amax)
    scale = round_bf16(amax * BF16_FP8_MAX_INV)
    if ROUND_SCALE:
        e = tl.ceil(round_bf16(tl.log2(scale))).to(tl.int32)
        scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
    inv = round_bf16(tl.math.div_rn(1.0, scale))
    return round_bf16(y * inv[:, :, None]), scale


@triton.jit
def div_by_scale(y, scale):
    """``y / scale`` correctly rounded (the bits of ``tl.math.div_rn(y, scale)``) for float32 ``y``
    `[BT, G, GROUP]` and its groups' ``scale`` `[BT, G]` (a quant scale: see the module notes), at one IEEE
    division per group and three float32 operations and a LOP3 per element."""
    if not EXACT_FMA:
        return tl.math.div_rn(y, scale[:, :, None])
    r = tl.math.div_rn(1.0, scale)[:, :, None]
    # NOTES: an infinite scale (r = 0) takes 0 in the remainder: rem = y and q = y * 0 + q0 = q0, IEEE's
    # y / inf (+-0; NaN for y = +-inf through q0 = inf * 0). Chosen per group: no per-element select.
    s = tl.where(scale < float("inf"), scale, 0.0)[:, :, None]
    q0 = y * r
    rem = tl.fma(-s, q0, y)  # exact: q0 is within an ulp of y / s
    q = tl.fma(rem, r, q0)  # the correctly rounded quotient...
    # ... except for y = -0: rem = -0 + 0 = +0 and q = +0 + -0 = +0. q0 has the quotient's sign whenever it
    # is a number, so its sign bit is ORed in (one LOP3). NOTES: not -y or -rem instead: Triton 3.6 lowers a
    # float negation to 0 - x, which is +0 for x = +0 and costs an FADD and registers per element.
    return (q.to(tl.int32, bitcast=True) | (q0.to(tl.int32, bitcast=True) & SIGN_BIT)).to(tl.float32, bitcast=True)


@triton.jit
def div_by_scale_approx(y, scale):
    """``y * (1 / scale)``: one rounding more than :func:`div_by_scale` (1 ulp off ``y / scale`` for
    some values, as sgl-kernel's and vLLM's quant kernels are). Only for measuring the price of the
    exact quotient; no shipped path uses it."""
    return y * tl.math.div_rn(1.0, scale)[:, :, None]


@triton.jit
def ll_group_scales(y, ROUND_SCALE: tl.constexpr):
    """DeepEP's low-latency dispatch cast of float32 groups ``y`` `[BT, G, GROUP]`: returns
    ``(v, scale_inv)`` with ``v`` the values to cast to e4m3 (saturating) and ``scale_inv`` `[BT, G]`
    the scale the receiver multiplies by (:func:`moe_ep.fp8.ll_dispatch_quant_ref`).

    ``amax = max(1e-4, max|y|)`` ignoring NaN (``fmaxf``); without ``ROUND_SCALE``
    ``scale_inv = amax * fl(1/448)`` and ``v = y * (448 / amax)``; with it ``e = ceil(log2(amax * fl(1/448)))``
    read off the float's bits, ``scale_inv = 2^e`` and ``v = y * 2^-e`` (both built from bits).
    """
    abs_bits = y.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    abs_bits = tl.where(abs_bits > 0x7F800000, 0, abs_bits)  # fmaxf drops NaN
    amax = tl.max(abs_bits, axis=2).to(tl.float32, bitcast=True)
    amax = tl.where(amax < AMAX_MIN, AMAX_MIN, amax)
    if ROUND_SCALE:
        bits = (amax * FP8_MAX_INV).to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        scale = ((127 - e) << 23).to(tl.float32, bitcast=True)
        scale_inv = ((e + 127) << 23).to(tl.float32, bitcast=True)
    else:
        scale_inv = amax * FP8_MAX_INV
        scale = tl.math.div_rn(FP8_MAX, amax)
    return y * scale[:, :, None], scale_inv


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
