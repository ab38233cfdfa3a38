"""The FP8 cast helpers of moe_ep.kernels.fp8_cast, bit for bit.

- ``div_by_scale`` (one reciprocal per group + two FMAs) against IEEE ``y / s``: an exact emulation of the
  scheme in numpy over a large sweep (every e4m3 rounding midpoint and its float32 neighbours, e4m3
  subnormals, random BF16 groups, the whole scale range the quant produces), then the Triton helper itself
  (the interpreter) on the cases that matter and the edge cases (infinite and NaN scales, signed zeros);
- ``ll_group_scales`` (the low-latency dispatch send) against ``ll_dispatch_quant_ref`` (DeepEP's cast),
  and that reference against a float32 numpy spelling of DeepEP's ``calculate_fp8_scales``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from moe_ep.fp8 import AMAX_MIN, FP8_DTYPE, FP8_MAX, ll_dispatch_quant_ref, per_token_group_quant_fp8_ref
from moe_ep.kernels.fp8_cast import EXACT_FMA, div_by_scale, e4m3_byte, ll_group_scales

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRETED else "cuda"
F32 = np.float32


# ---------------------------------------------------------------------------------------- exact emulation
def _fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 ``a * b + c`` rounded once: the float32 product is exact in float64, the float64 sum is
    made round-to-odd (TwoSum error, then one step towards it when the result is even), and round-to-odd
    at 53 bits followed by one rounding to 24 bits is the correctly rounded sum."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c = c.astype(np.float64)
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)
    even = (s.view(np.int64) & 1) == 0
    bump = (err != 0) & even
    s = np.where(bump, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def _markstein(y: np.ndarray, s: np.ndarray) -> np.ndarray:
    """The float32 steps of div_by_scale, emulated exactly."""
    with np.errstate(all="ignore"):
        r = F32(1) / s
        q0 = y * r
        s = np.where(s < np.inf, s, F32(0))
        rem = _fma32(-s, q0, y)
        q = _fma32(rem, r, q0)
        q = (q.view(np.int32) | (q0.view(np.int32) & np.int32(-(2**31)))).view(F32)
    return q


def _e4m3_grid() -> np.ndarray:
    """Every finite non-negative e4m3 value (0 .. 448)."""
    vals = torch.arange(0, 0x7F, dtype=torch.uint8).view(FP8_DTYPE).float().numpy()
    return np.unique(vals)


def _scales(n: int, rng: np.random.Generator) -> np.ndarray:
    """Scales as the quant produces them: amax / 448 with amax in [1e-4, FLT_MAX], log-uniform, plus the ends."""
    amax = np.exp(rng.uniform(np.log(AMAX_MIN), np.log(3.0e38), n)).astype(F32)
    amax = np.concatenate([amax, np.array([AMAX_MIN, 1.0, 448.0, 3.4028235e38], dtype=F32)])
    return (amax / F32(FP8_MAX)).astype(F32)


def _midpoint_values(s: np.ndarray) -> np.ndarray:
    """`[len(s), n]` values whose quotient by s lands on, or one float32 step beside, every e4m3 rounding
    midpoint (e4m3 subnormal midpoints included) and every e4m3 value, both signs."""
    grid = _e4m3_grid().astype(np.float64)
    mids = (grid[:-1] + grid[1:]) / 2  # exact in float32 (one bit more than e4m3)
    targets = np.concatenate([mids, grid, [448.0 + 16.0]])  # 464: the saturation midpoint
    with np.errstate(over="ignore"):
        y = (targets[None, :] * s[:, None].astype(np.float64)).astype(F32)
        y = np.concatenate([y, np.nextafter(y, F32(np.inf)), np.nextafter(y, F32(-np.inf))], axis=1)
    y = np.where(np.isfinite(y), y, F32(0))  # an infinite x makes its group's scale infinite: not this case
    return np.concatenate([y, -y], axis=1)


def test_markstein_emulation_equals_ieee_division_sweep():
    rng = np.random.default_rng(0)
    s = _scales(3000, rng)
    y = _midpoint_values(s)
    # plus random BF16 groups at each scale's magnitude, and float32 subnormal numerators
    bf16 = torch.randn(len(s), 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).float().numpy()
    with np.errstate(over="ignore"):
        y = np.concatenate([y, bf16 * (s[:, None] * F32(100.0)), bf16 * F32(1e-39)], axis=1).astype(F32)
    y = np.where(np.isfinite(y), y, F32(0))
    s2 = np.broadcast_to(s[:, None], y.shape)
    q = _markstein(y, s2)
    with np.errstate(all="ignore"):
        ieee = y / s2
    assert y.size > 2_000_000
    normal = np.abs(y) >= np.finfo(F32).tiny
    assert np.array_equal(q.view(np.int32)[normal], ieee.view(np.int32)[normal])
    # A subnormal x (its remainder underflows) may get a quotient some ulps off, below 2^-104 at these
    # scales: the same e4m3 byte (a signed zero) either way.
    assert (q.view(np.int32) != ieee.view(np.int32))[~normal].any()  # the sweep does reach that case
    assert np.abs(ieee[~normal]).max() < 2.0 ** -104

    def e4(v):
        return torch.from_numpy(np.clip(v, -448, 448)).to(FP8_DTYPE).view(torch.uint8)

    assert torch.equal(e4(q), e4(ieee))
    # the sweep reaches the cases that need the correction: a plain y * r is off for many of them
    with np.errstate(all="ignore"):
        naive = y * (F32(1) / s2)
    assert (naive.view(np.int32) != ieee.view(np.int32)).sum() > 10_000
    assert (e4(naive) != e4(ieee)).sum() > 100


def test_emulated_fma_rounds_once():
    # (1 + 2^-23)^2 - (1 + 2^-22) = 2^-46 exactly; a float32 multiply, then add, gives 0
    a = np.array([1 + 2.0 ** -23], dtype=F32)
    c = np.array([-(1 + 2.0 ** -22)], dtype=F32)
    assert _fma32(a, a, c)[0] == F32(2.0 ** -46)
    assert (a * a + c)[0] == F32(0)
    # ties to even at the float32 rounding: 1 + 2^-24 -> 1, 1 + 3 * 2^-24 -> 1 + 2^-22
    one = np.array([1.0], dtype=F32)
    assert _fma32(one, np.array([2.0 ** -24], dtype=F32), one)[0] == F32(1)
    assert _fma32(one, np.array([3 * 2.0 ** -24], dtype=F32), one)[0] == F32(1 + 2.0 ** -22)


# ------------------------------------------------------------------------------------------ the kernels
@triton.jit
def _div_kernel(y_ptr, s_ptr, q_ptr, b_ptr, G: tl.constexpr, NATIVE: tl.constexpr):
    row = tl.program_id(0)
    offs_g = tl.arange(0, G)
    offs = row * G * 128 + offs_g[None, :, None] * 128 + tl.arange(0, 128)[None, None, :]
    y = tl.load(y_ptr + offs)
    s = tl.load(s_ptr + row * G + offs_g)[None, :]
    q = div_by_scale(y, s)
    tl.store(q_ptr + offs, q)
    tl.store(b_ptr + offs, e4m3_byte(q, NATIVE))


@triton.jit
def _ll_kernel(y_ptr, q_ptr, s_ptr, G: tl.constexpr, ROUND_SCALE: tl.constexpr, NATIVE: tl.constexpr):
    row = tl.program_id(0)
    offs_g = tl.arange(0, G)
    offs = row * G * 128 + offs_g[None, :, None] * 128 + tl.arange(0, 128)[None, None, :]
    y = tl.load(y_ptr + offs)
    v, scale_inv = ll_group_scales(y, ROUND_SCALE)
    tl.store(q_ptr + offs, e4m3_byte(v, NATIVE))
    tl.store(s_ptr + row * G + offs_g[None, :], scale_inv)


def _native() -> bool:
    from moe_ep.kernels.fp8_cast import native_e4m3_supported
    return native_e4m3_supported(torch.device(DEV))


def _run_div(y: np.ndarray, s: np.ndarray):
    """y `[rows, G, 128]`, s `[rows, G]` float32 -> (q float32, e4m3 bytes) from the Triton helper."""
    rows, g, _ = y.shape
    yt = torch.from_numpy(np.ascontiguousarray(y)).to(DEV)
    st = torch.from_numpy(np.ascontiguousarray(s)).to(DEV)
    q = torch.empty_like(yt)
    b = torch.empty(yt.shape, dtype=torch.uint8, device=DEV)
    _div_kernel[(rows,)](yt, st, q, b, G=g, NATIVE=_native())
    return q.cpu(), b.cpu()


def _ieee(y: np.ndarray, s: np.ndarray):
    yt, st = torch.from_numpy(y), torch.from_numpy(s)[..., None]
    q = yt / st
    return q, q.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(torch.uint8)


def test_exact_fma_on_this_triton():
    # the correction path is the one the kernels run (compiled always; interpreted from Triton 3.7's fma)
    assert EXACT_FMA or INTERPRETED


@pytest.mark.parametrize("seed", [0, 1])
def test_div_by_scale_equals_ieee_division(seed):
    rng = np.random.default_rng(seed)
    s = _scales(63, rng)  # 67 scales
    y = _midpoint_values(s)  # [67, n]
    n = y.shape[1] // 128 * 128
    y = y[:, :n].reshape(len(s), n // 128, 128)
    s2 = np.repeat(s[:, None], n // 128, axis=1)
    # rows of 4 groups -> [rows, 4, 128]
    g = 4
    cut = (y.shape[1] // g) * g
    y = y[:, :cut].reshape(-1, g, 128).astype(F32)
    s2 = s2[:, :cut].reshape(-1, g).astype(F32)
    q, b = _run_div(y, s2)
    ref_q, ref_b = _ieee(y, s2)
    normal = torch.from_numpy(np.abs(y) >= np.finfo(F32).tiny)
    assert torch.equal(q.view(torch.int32)[normal], ref_q.view(torch.int32)[normal])
    assert torch.equal(b, ref_b)


def test_div_by_scale_edge_cases():
    specials = np.array([0.0, -0.0, 1.0, -3.5, 448.0, 1e-40, -1e-45, np.inf, -np.inf, np.nan], dtype=F32)
    y = np.resize(specials, (1, 4, 128)).astype(F32)
    # an infinite x makes its group's scale infinite: a finite scale never meets one (nor is a scale 0)
    y[0, 1:] = np.where(np.isinf(y[0, 1:]), F32(7.0), y[0, 1:])
    s = np.array([[np.inf, 1e-30, np.nan, 1.0]], dtype=F32)
    q, b = _run_div(y, s)
    with np.errstate(all="ignore"):
        ref = torch.from_numpy(y / s[..., None])
    same = (q.view(torch.int32) == ref.view(torch.int32)) | (torch.isnan(q) & torch.isnan(ref))
    assert bool(same.all()), (q[~same], ref[~same])


def _midpoint_groups(seed: int = 3):
    """`[rows, G * 128]` float32 groups whose quotients land on and beside the e4m3 rounding midpoints: each
    group holds its amax, 448 * s, so its scale is s; and the scales ``s`` `[rows]`."""
    rng = np.random.default_rng(seed)
    amax = (_scales(13, rng) * F32(448)).astype(F32)
    amax = amax[(amax >= F32(AMAX_MIN)) & (amax < F32(1e37))]
    sc = (amax / F32(448)).astype(F32)  # the scale the quant computes
    y = _midpoint_values(sc)
    y = np.where(np.abs(y) <= amax[:, None], y, F32(0))
    groups = y.shape[1] // 127
    y = y[:, : groups * 127].reshape(len(sc), groups, 127)
    y = np.concatenate([np.broadcast_to(amax[:, None, None], (len(sc), groups, 1)), y], axis=2).astype(F32)
    return np.ascontiguousarray(y.reshape(len(sc), groups * 128)), sc


def test_quant_kernel_bitwise_at_midpoints():
    """The whole per-token-group quant (its tile code is the SiLU face's too) at the e4m3 rounding midpoints."""
    from moe_ep.quant import per_token_group_quant_fp8
    y, sc = _midpoint_groups()
    groups = y.shape[1] // 128
    x = torch.from_numpy(y).to(DEV)
    q, s = per_token_group_quant_fp8(x, 128)
    rq, rs = per_token_group_quant_fp8_ref(x.cpu(), 128)
    assert torch.equal(rs, torch.from_numpy(np.repeat(sc[:, None], groups, axis=1)))
    assert torch.equal(s.cpu().contiguous().view(torch.int32), rs.view(torch.int32))
    assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8))


# --------------------------------------------------------------------------------- low-latency dispatch
def _deepep_numpy(x: np.ndarray, round_scale: bool):
    """DeepEP's calculate_fp8_scales + cast, spelled in float32 numpy (groups of 128 on the last dim)."""
    g = x.reshape(*x.shape[:-1], -1, 128).astype(F32)
    a = np.abs(g)
    amax = np.fmax(F32(AMAX_MIN), np.fmax.reduce(a, axis=-1))  # fmaxf: NaN dropped
    inv = F32(1) / F32(448)
    with np.errstate(all="ignore"):
        if round_scale:
            bits = (amax * inv).view(np.int32)
            e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0)
            scale = ((127 - e) << 23).astype(np.int32).view(F32)
            scale_inv = ((e + 127) << 23).astype(np.int32).view(F32)
        else:
            scale_inv = amax * inv
            scale = F32(448) / amax
        v = g * scale[..., None]
    q = torch.from_numpy(np.clip(v, -448, 448).reshape(x.shape)).to(FP8_DTYPE)
    return q, torch.from_numpy(scale_inv.astype(F32))


def _ll_inputs(rows: int = 64, k: int = 512, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    mag = 10.0 ** torch.randint(-6, 4, (rows, k // 128, 1), generator=gen).float()
    x = (torch.randn(rows, k // 128, 128, generator=gen) * mag).reshape(rows, k).to(torch.bfloat16)
    return x


@pytest.mark.parametrize("round_scale", [False, True])
def test_ll_reference_is_deepeps_formula(round_scale):
    x = _ll_inputs().float()
    x[0, 5] = float("nan")
    x[1, 130] = float("inf")
    x[2, :128] = 0.0
    q, s = ll_dispatch_quant_ref(x, round_scale=round_scale)
    nq, ns = _deepep_numpy(x.numpy(), round_scale)
    assert torch.equal(s.view(torch.int32), ns.view(torch.int32))
    assert torch.equal(q.view(torch.uint8), nq.view(torch.uint8))
    if not round_scale:
        # not the per-token-group quant's numerics: a good share of the scales differ by an ulp
        _, ps = per_token_group_quant_fp8_ref(x[3:], 128)
        assert (ps.view(torch.int32) != s[3:].view(torch.int32)).sum() > ps.numel() // 10


@pytest.mark.parametrize("round_scale", [False, True])
def test_ll_group_scales_equals_reference(round_scale):
    x = _ll_inputs(rows=32, k=512, seed=int(round_scale)).float()
    x[0, 5] = float("nan")
    x[1, 130] = float("inf")
    x[2, 300] = float("-inf")
    x[3, :128] = 0.0
    # amax exactly 448 * 2^k: the product with fl(1/448) is not a power of two for every k
    x[4, :128] = 448.0 * 2.0 ** -5
    x[5, 128] = 448.0 * 2.0 ** 7
    rows, k = x.shape
    y = x.reshape(rows, k // 128, 128).contiguous().to(DEV)
    q = torch.empty(y.shape, dtype=torch.uint8, device=DEV)
    s = torch.empty(rows, k // 128, dtype=torch.float32, device=DEV)
    _ll_kernel[(rows,)](y, q, s, G=k // 128, ROUND_SCALE=round_scale, NATIVE=_native())
    rq, rs = ll_dispatch_quant_ref(x, round_scale=round_scale)
    assert torch.equal(s.cpu().view(torch.int32), rs.view(torch.int32))
    assert torch.equal(q.cpu().reshape(rows, k), rq.view(torch.uint8))


def test_reciprocal_multiply_variant_is_not_bitwise():
    """The bench-only x * (1 / s) variant: same scales, bytes one e4m3 step off at some midpoints (what the
    exact quotient buys), never more."""
    from moe_ep.quant import reciprocal_multiply_quant_fp8
    y, _ = _midpoint_groups()
    x = torch.from_numpy(y).to(DEV)
    q, s = reciprocal_multiply_quant_fp8(x, 128)
    rq, rs = per_token_group_quant_fp8_ref(x.cpu(), 128)
    assert torch.equal(s.cpu().view(torch.int32), rs.view(torch.int32))
    a, b = q.cpu().view(torch.uint8).long(), rq.view(torch.uint8).long()
    diff = a != b
    assert int(diff.sum()) > 0
    # one step: same sign bit, magnitudes one code apart
    assert bool(((a ^ b)[diff] & 0x80 == 0).all()) and int(((a & 0x7F) - (b & 0x7F)).abs().max()) == 1
    with pytest.raises(TypeError):
        reciprocal_multiply_quant_fp8(x, 128, exact=True)
