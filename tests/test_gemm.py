"""Grouped FP8 GEMMs (DeepGEMM names) against a float64 reference of the dequantized operands.

Tolerances: a float32 output is within ``1e-5 * sum_k |a_k w_k|`` of the float64 reference (the MMA sums
128 exact e4m3 products in float32 per K block; the blocks are summed in float32); a BF16 output is
within one BF16 ulp of the reference plus that float32 bound (the kernel rounds its float32 result to
nearest even once).
"""

from __future__ import annotations

import pytest
import torch

from moe_ep import gemm
from moe_ep.fp8 import FP8_DTYPE
from moe_ep.quant import dequant_block_fp8, dequant_fp8, per_block_quant_fp8, per_token_group_quant_fp8
from moe_ep.testing import ulp

POISON = 7.0


def _weights(g: int, n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(g, n, k, generator=gen) * torch.rand(g, n, 1, generator=gen)  # rows of varied scale
    wq, ws = per_block_quant_fp8(w)
    return wq, ws, dequant_block_fp8(wq, ws).double()


def _contiguous_inputs(counts: list[int], k: int, seed: int, **quant):
    align = gemm.get_m_alignment_for_contiguous_layout()
    m = sum(-(-c // align) * align for c in counts)
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=gen) * 4).to(torch.bfloat16)
    m_indices = torch.full((m,), -1, dtype=torch.int32)
    start = 0
    for e, c in enumerate(counts):
        m_indices[start:start + c] = e
        start += -(-c // align) * align
    xq, xs = per_token_group_quant_fp8(x, **quant)
    return xq, xs, m_indices


def _check(d: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    tol = bound * 1e-5 + 1e-30
    if d.dtype == torch.bfloat16:
        tol = tol + ulp(ref, torch.bfloat16)
    err = (d.double() - ref).abs()
    bad = err > tol
    assert not bool(bad.any()), (f"{what}: {int(bad.sum())} elements off; worst {float(err.max()):.3e} at "
                                 f"{tuple(int(i) for i in (err == err.max()).nonzero()[0])}")


def _contiguous_ref(xq, xs, wd, m_indices):
    xd = dequant_fp8(xq, xs).double()
    rows = m_indices.clamp(min=0).long()
    ref = torch.einsum("mk,mnk->mn", xd, wd[rows])
    bound = torch.einsum("mk,mnk->mn", xd.abs(), wd[rows].abs())
    pad = (m_indices < 0)[:, None]
    return ref.masked_fill(pad, 0.0), bound.masked_fill(pad, 0.0)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scales", ["tma", "row", "ue8m0"])
def test_contiguous_matches_reference(out_dtype, scales):
    n, k = 256, 384
    quant = {"tma": {"tma_aligned_scales": True}, "row": {},
             "ue8m0": {"tma_aligned_scales": True, "scale_ue8m0": True}}[scales]
    wq, ws, wd = _weights(3, n, k, seed=1)
    xq, xs, m_indices = _contiguous_inputs([100, 0, 129], k, seed=2, **quant)
    d = torch.full((xq.shape[0], n), POISON, dtype=out_dtype)
    gemm.m_grouped_fp8_gemm_nt_contiguous((xq, xs), (wq, ws), d, m_indices)
    ref, bound = _contiguous_ref(xq, xs, wd, m_indices)
    _check(d, ref, bound, f"contiguous {scales} {out_dtype}")
    # Padding rows are zeros (not the poison).
    assert bool((d[m_indices < 0] == 0).all())


def test_contiguous_v1_alias_and_small_tile():
    n, k = 128, 256
    wq, ws, wd = _weights(2, n, k, seed=3)
    xq, xs, m_indices = _contiguous_inputs([1, 127], k, seed=4, tma_aligned_scales=True)
    d = torch.full((xq.shape[0], n), POISON, dtype=torch.float32)
    cfg = gemm.GemmConfig(64, 128, False, 4, 3, group_m=2)
    gemm.m_grouped_gemm_fp8_fp8_bf16_nt_contiguous((xq, xs), (wq, ws), d, m_indices, config=cfg)
    ref, bound = _contiguous_ref(xq, xs, wd, m_indices)
    _check(d, ref, bound, "contiguous 64-row tile")


def test_contiguous_bad_indices_come_out_nan():
    n, k = 128, 128
    wq, ws, _ = _weights(2, n, k, seed=5)
    xq, xs, m_indices = _contiguous_inputs([128, 128], k, seed=6)
    m_indices[5] = 1  # differs from the rest of its 128-row block (expert 0)
    m_indices[200] = 9  # out of range (G = 2)
    d = torch.zeros(xq.shape[0], n)
    gemm.m_grouped_fp8_gemm_nt_contiguous((xq, xs), (wq, ws), d, m_indices)
    nan_rows = d.isnan().all(dim=1).nonzero().flatten().tolist()
    assert nan_rows == [5, 200]
    assert not bool(d[[0, 6, 128, 255]].isnan().any())


def _masked_inputs(g: int, t: int, k: int, seed: int, **quant):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(g, t, k, generator=gen) * 2).to(torch.bfloat16)
    return per_token_group_quant_fp8(x, **quant)


@pytest.mark.parametrize("expected_m", [1, 24, 48, 200])  # swap-AB 16 / 32 / 64 rows, then 128x128
@pytest.mark.parametrize("ue8m0", [False, True])
def test_masked_matches_reference_and_leaves_rows(expected_m, ue8m0):
    g, t, n, k = 3, 40, 256, 256
    wq, ws, wd = _weights(g, n, k, seed=7)
    xq, xs = _masked_inputs(g, t, k, seed=8, tma_aligned_scales=True, scale_ue8m0=ue8m0)
    masked_m = torch.tensor([5, 0, 40], dtype=torch.int32)
    d = torch.full((g, t, n), POISON, dtype=torch.bfloat16)
    gemm.m_grouped_fp8_gemm_nt_masked((xq, xs), (wq, ws), d, masked_m, expected_m)
    xd = dequant_fp8(xq, xs).double()
    ref = torch.einsum("gtk,gnk->gtn", xd, wd)
    bound = torch.einsum("gtk,gnk->gtn", xd.abs(), wd.abs())
    for e in range(g):
        c = int(masked_m[e])
        _check(d[e, :c], ref[e, :c], bound[e, :c], f"masked expert {e} expected_m={expected_m}")
        assert bool((d[e, c:] == POISON).all()), f"expert {e}: rows past masked_m={c} were written"


def test_masked_reads_dispatch_layout_directly():
    """The low-latency receive layout: scales column-major per expert with padded rows (T not a multiple
    of 4), masked_m beyond T clamped."""
    g, t, n, k = 2, 6, 128, 128
    wq, ws, wd = _weights(g, n, k, seed=9)
    xq, xs = _masked_inputs(g, t, k, seed=10, tma_aligned_scales=True)
    assert xs.stride()[-2] == 1
    d = torch.full((g, t, n), POISON)
    gemm.m_grouped_fp8_gemm_nt_masked((xq, xs), (wq, ws), d, torch.tensor([9, 3], dtype=torch.int32), 8)
    ref = torch.einsum("gtk,gnk->gtn", dequant_fp8(xq, xs).double(), wd)
    torch.testing.assert_close(d[0].double(), ref[0], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(d[1, :3].double(), ref[1, :3], rtol=1e-5, atol=1e-4)
    assert bool((d[1, 3:] == POISON).all())


def test_empty_inputs_return_at_once():
    wq, ws, _ = _weights(2, 128, 128, seed=11)
    x = torch.empty(0, 128, dtype=FP8_DTYPE)
    gemm.m_grouped_fp8_gemm_nt_contiguous((x, torch.empty(0, 1)), (wq, ws), torch.empty(0, 128, dtype=torch.bfloat16),
                                          torch.empty(0, dtype=torch.int32))
    xm = torch.empty(2, 0, 128, dtype=FP8_DTYPE)
    gemm.m_grouped_fp8_gemm_nt_masked((xm, torch.empty(2, 0, 1)), (wq, ws), torch.empty(2, 0, 128),
                                      torch.zeros(2, dtype=torch.int32), 0)


def test_tma_aligned_tensor_helper():
    s = torch.randn(6, 3)
    out = gemm.get_mn_major_tma_aligned_tensor(s)
    assert out.stride() == (1, 8) and torch.equal(out, s)
    assert gemm.get_mn_major_tma_aligned_tensor(out) is out
    b = gemm.get_mn_major_tma_aligned_tensor(torch.randn(2, 5, 3))
    assert b.stride() == (24, 1, 8)
    assert gemm.get_mk_alignment_for_contiguous_layout() == 128 and gemm.get_tma_aligned_size(5, 4) == 8


@pytest.mark.parametrize("shape", [(6, 3), (2, 5, 9), (257, 4)])
def test_packed_ue8m0_tensor_layout(shape):
    """DeepGEMM's ``get_mn_major_tma_aligned_packed_ue8m0_tensor``: exponent bytes, four per int32 along SF_K
    (little end first, zero past SF_K), MN-major with the MN stride padded to 16 bytes."""
    sf = gemm.utils.ceil_to_ue8m0(torch.rand(shape) * 8 + 1e-3)
    out = gemm.utils.get_mn_major_tma_aligned_packed_ue8m0_tensor(sf)
    mn, sf_k = shape[-2:]
    words, mp = -(-sf_k // 4), gemm.get_tma_aligned_size(mn, 4)
    assert out.dtype == torch.int32 and out.shape == (*shape[:-2], mn, words)
    assert out.stride()[-2:] == (1, mp) and (len(shape) == 2 or out.stride(0) == mp * words)
    got = torch.empty(out.shape, dtype=torch.int32).copy_(out).view(torch.uint8).view(*shape[:-1], 4 * words)
    assert torch.equal(got[..., :sf_k].long(), torch.log2(sf).long() + 127)
    assert not got[..., sf_k:].any()


def test_k_grouped_packed_ue8m0_tensor_layout():
    ks = [256, 640, 128]  # 2, 5, 1 scale rows: 1, 2, 1 packed rows
    sf = gemm.utils.ceil_to_ue8m0(torch.rand(8, 12) * 8 + 1e-3)
    out = gemm.utils.get_k_grouped_mn_major_tma_aligned_packed_ue8m0_tensor(
        sf, torch.tensor(ks, dtype=torch.int32), ks, 128, 128)
    assert out.shape == (4, 12) and out.dtype == torch.int32
    exp = (torch.log2(sf).long() + 127).T  # [MN, rows]
    b = out.T.contiguous().view(torch.uint8).view(12, 4, 4)  # [MN, packed row, byte]
    assert torch.equal(b[:, 0, :2].long(), exp[:, 0:2]) and not b[:, 0, 2:].any()
    assert torch.equal(b[:, 1].long(), exp[:, 2:6]) and torch.equal(b[:, 2, :1].long(), exp[:, 6:7])
    assert not b[:, 2, 1:].any() and torch.equal(b[:, 3, :1].long(), exp[:, 7:8]) and not b[:, 3, 1:].any()
    with pytest.raises(ValueError, match="rows"):
        gemm.utils.get_k_grouped_mn_major_tma_aligned_packed_ue8m0_tensor(
            sf, torch.tensor(ks[:2], dtype=torch.int32), ks[:2], 128, 128)


def _good_contiguous():
    wq, ws, _ = _weights(2, 128, 256, seed=12)
    xq, xs, mi = _contiguous_inputs([10], 256, seed=13, tma_aligned_scales=True)
    d = torch.full((xq.shape[0], 128), POISON, dtype=torch.bfloat16)
    return (xq, xs), (wq, ws), d, mi


def _replace(tup, i, v):
    return tuple(v if j == i else x for j, x in enumerate(tup))


@pytest.mark.parametrize("case, exc, match", [
    ("a_dtype", TypeError, "a\\[0\\] must be torch.float8_e4m3fn"),
    ("a_not_pair", TypeError, "a must be a"),
    ("k_mismatch", ValueError, "K mismatch"),
    ("k_tail_sfa", ValueError, "a\\[1\\] must have shape"),
    ("sfa_shape", ValueError, "a\\[1\\] must have shape"),
    ("sfa_dtype", TypeError, "float32 or packed UE8M0"),
    ("sfb_shape", ValueError, "b\\[1\\] must have shape"),
    ("d_dtype", TypeError, "d must be a bfloat16"),
    ("d_shape", ValueError, "d must have shape"),
    ("m_indices_dtype", TypeError, "grouped_layout \\(m_indices\\) must be an int32"),
    ("m_indices_len", ValueError, "grouped_layout \\(m_indices\\) must have shape"),
    ("recipe", ValueError, "recipe"),
    ("swap_tile", ValueError, "contiguous layout needs"),
])
def test_contiguous_errors_before_launch(case, exc, match):
    a, b, d, mi = _good_contiguous()
    kwargs = {}
    if case == "a_dtype":
        a = (a[0].float(), a[1])
    elif case == "a_not_pair":
        a = a[0]
    elif case == "k_mismatch":
        b = (b[0][:, :, :128].contiguous(), b[1][:, :, :1].contiguous())
    elif case == "k_tail_sfa":  # K 200 takes ceil(200 / 128) = 2 scale columns, not 1
        a = (a[0][:, :200], a[1][:, :1])
        b = (b[0][:, :, :200], b[1])
    elif case == "sfa_shape":
        a = (a[0], a[1][:, :1])
    elif case == "sfa_dtype":
        a = (a[0], a[1].half())
    elif case == "sfb_shape":
        b = (b[0], b[1][:1])
    elif case == "d_dtype":
        d = d.half()
    elif case == "d_shape":
        d = d[:-1]
    elif case == "m_indices_dtype":
        mi = mi.long()
    elif case == "m_indices_len":
        mi = mi[:-1]
    elif case == "recipe":
        kwargs["recipe"] = (1, 1, 128)
    elif case == "swap_tile":
        kwargs["config"] = gemm.GemmConfig(16, 128, True, 4, 4)
    before = d.clone()
    with pytest.raises(exc, match=match):
        gemm.m_grouped_fp8_gemm_nt_contiguous(a, b, d, mi, **kwargs)
    if d.shape == before.shape and d.dtype == before.dtype:
        assert torch.equal(d, before), "output written despite the error"


@pytest.mark.parametrize("case, exc, match", [
    ("groups", ValueError, "groups"),
    ("masked_m_dtype", TypeError, "masked_m must be an int32"),
    ("masked_m_shape", ValueError, "masked_m must have shape"),
    ("expected_m", TypeError, "expected_m"),
    ("a_2d", ValueError, "a\\[0\\] must be \\[G, T, K\\]"),
])
def test_masked_errors_before_launch(case, exc, match):
    wq, ws, _ = _weights(2, 128, 128, seed=14)
    xq, xs = _masked_inputs(2, 4, 128, seed=15)
    d = torch.full((2, 4, 128), POISON)
    mm, em = torch.tensor([1, 2], dtype=torch.int32), 4
    b = (wq, ws)
    a = (xq, xs)
    if case == "groups":
        b = (wq[:1], ws[:1])
    elif case == "masked_m_dtype":
        mm = mm.long()
    elif case == "masked_m_shape":
        mm = mm[:1]
    elif case == "expected_m":
        em = torch.tensor(4)
    elif case == "a_2d":
        a = (xq[0], xs[0])
    with pytest.raises(exc, match=match):
        gemm.m_grouped_fp8_gemm_nt_masked(a, b, d, mm, em)
    assert bool((d == POISON).all())
