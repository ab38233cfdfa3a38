"""The torch FP8 reference against independent formulations."""

import pytest
import torch

from moe_ep.fp8 import (ceil_to_pow2, dequant_fp8_ref, pack_ue8m0, per_token_group_quant_fp8_ref, to_column_major,
                        unpack_ue8m0)
from moe_ep.testing import assert_bitwise_equal

# every finite e4m3fn value, sorted, with its code
_CODES = torch.arange(256, dtype=torch.uint8)
_VALS = _CODES.view(torch.float8_e4m3fn).float()
_FINITE = ~_VALS.isnan()


def _nearest_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Brute force: the nearest e4m3 value, ties to the even code, saturating at 448."""
    shape, v = v.shape, v.flatten()
    vals, codes = _VALS[_FINITE].double(), _CODES[_FINITE]
    d = (v.double().clamp(-448, 448).unsqueeze(1) - vals).abs()
    best = d.min(dim=1, keepdim=True).values
    tie = d == best
    even = tie & ((codes.to(torch.int64) & 1) == 0)
    pick = torch.where(even.any(1, keepdim=True), even, tie).to(torch.int64).argmax(1)
    # -0.0 and 0.0 both minimise; keep the sign of the input
    out = vals[pick].float()
    return torch.where(out == 0, torch.copysign(torch.zeros_like(out), v), out).reshape(shape)


@pytest.mark.parametrize("round_scale", [False, True])
def test_quant_matches_brute_force(round_scale):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 384, generator=g) * torch.tensor([1e-6, 1e-3, 1.0, 300.0, 1e4, 0.02, 5.0]).unsqueeze(1)
    x = x.to(torch.bfloat16)
    q, s = per_token_group_quant_fp8_ref(x, round_scale=round_scale)
    xg = x.float().reshape(7, 3, 128)
    amax = xg.abs().amax(-1).clamp(min=1e-4)
    scale = amax / 448
    if round_scale:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    assert_bitwise_equal(s, scale, "scales")
    expected = _nearest_e4m3((xg / scale.unsqueeze(-1)).reshape(7, 384))
    assert_bitwise_equal(q.float(), expected, "q")
    # dequantisation error is at most half an e4m3 step (2^-4 relative) of the scaled value
    err = (dequant_fp8_ref(q, s) - x.float()).abs()
    assert bool((err <= x.float().abs() * 2 ** -4 + s.repeat_interleave(128, 1) * 2 ** -10).all())


def test_ceil_to_pow2_exact():
    v = torch.tensor([1.0, 1.5, 0.75, 2 ** -20, 3 * 2 ** -20, 448.0, 1e-4 / 448, float("inf")])
    expected = torch.tensor([1.0, 2.0, 1.0, 2 ** -20, 2 ** -18, 512.0, 2 ** -22, float("inf")])
    assert_bitwise_equal(ceil_to_pow2(v), expected, "ceil_to_pow2")


def test_ue8m0_pack_roundtrip_and_layout():
    s = torch.exp2(torch.randint(-30, 10, (3, 7)).float())
    packed = pack_ue8m0(s)
    assert packed.shape == (3, 2) and packed.dtype == torch.int32
    assert int(packed[0, 0]) & 0xFF == ((s[0, 0].view(torch.int32) >> 23) & 0xFF).item()
    assert_bitwise_equal(unpack_ue8m0(packed, 7), s, "unpack")
    big = torch.full((1, 4), 2.0 ** 100)  # exponent byte 227 in byte 3 sets the int32 sign bit
    assert_bitwise_equal(unpack_ue8m0(pack_ue8m0(big), 4), big, "sign-bit byte")


def test_column_major_layout():
    s = torch.randn(2, 5, 3)
    cm = to_column_major(s)
    assert cm.shape == (2, 5, 3) and cm.stride(1) == 1 and cm.stride(2) == 8
    assert_bitwise_equal(cm, s, "values")


def test_nan_inf_and_bad_shapes():
    x = torch.ones(2, 128)
    x[0, 3] = float("nan")
    x[1, 5] = float("inf")
    q, s = per_token_group_quant_fp8_ref(x)
    assert s[0].isnan().all() and q[0].float().isnan().all()
    assert s[1].isinf().all() and q[1, 5].float().isnan() and (q[1, :5].float() == 0).all()
    with pytest.raises(ValueError, match="multiple of group_size"):
        per_token_group_quant_fp8_ref(torch.ones(2, 100))
    with pytest.raises(TypeError):
        per_token_group_quant_fp8_ref(torch.ones(2, 128, dtype=torch.int32))


def test_empty_inputs():
    for ue8m0 in (False, True):
        q, s = per_token_group_quant_fp8_ref(torch.zeros(0, 256), use_ue8m0=ue8m0)
        assert q.shape == (0, 256) and s.shape == ((0, 1) if ue8m0 else (0, 2))
    assert unpack_ue8m0(torch.zeros(0, 1, dtype=torch.int32), 2).shape == (0, 2)
