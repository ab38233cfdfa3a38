"""moe_ep.gemm against DeepGEMM 2.6.1's API: signatures (written here as data), the psum layout, the dense
and BF16 GEMMs, the SM cap, the layout helpers and the recipe checks. Accuracy as DeepGEMM's own tests check
it: ``calc_diff`` (1 - 2 sum(xy) / sum(x^2 + y^2)) below 0.001 for FP8 (1e-5 here for BF16, whose products
are exact) against a float64 reference of the dequantized operands."""

from __future__ import annotations

import inspect

import pytest
import torch

from moe_ep import gemm
from moe_ep.quant import dequant_block_fp8, dequant_fp8, per_block_quant_fp8, per_token_group_quant_fp8

POISON = 7.0
FP8_MAX_DIFF = 0.001  # DeepGEMM's threshold for the FP8 recipe
BF16_MAX_DIFF = 1e-5

_E = inspect.Parameter.empty
# DeepGEMM 2.6.1 (csrc/apis/gemm.hpp, layout.hpp, runtime.hpp pybind11 definitions): (name, default) in order.
_FP8_DENSE = [("a", _E), ("b", _E), ("d", _E), ("c", None), ("recipe", None), ("recipe_a", None),
              ("recipe_b", None), ("compiled_dims", "nk"), ("disable_ue8m0_cast", False)]
_FP8_CONTIG = [("a", _E), ("b", _E), ("d", _E), ("grouped_layout", _E), ("recipe", None), ("recipe_a", None),
               ("recipe_b", None), ("compiled_dims", "nk"), ("disable_ue8m0_cast", False),
               ("use_psum_layout", False), ("ensure_zero_padding", True), ("expected_m_for_psum_layout", None)]
_FP8_MASKED = [("a", _E), ("b", _E), ("d", _E), ("masked_m", _E), ("expected_m", _E), ("recipe", None),
               ("recipe_a", None), ("recipe_b", None), ("compiled_dims", "nk"), ("disable_ue8m0_cast", False)]
_BF16_DENSE = [("a", _E), ("b", _E), ("d", _E), ("c", None), ("compiled_dims", "nk")]
_BF16_CONTIG = [("a", _E), ("b", _E), ("d", _E), ("grouped_layout", _E), ("compiled_dims", "nk"),
                ("use_psum_layout", False), ("ensure_zero_padding", True), ("expected_m_for_psum_layout", None)]
_MN = [("compiled_dims", "mn")]
DEEPGEMM_2_6_1 = {
    "fp8_gemm_nt": _FP8_DENSE, "fp8_gemm_nn": _FP8_DENSE,
    "fp8_gemm_tn": _FP8_DENSE[:7] + _MN + _FP8_DENSE[8:], "fp8_gemm_tt": _FP8_DENSE[:7] + _MN + _FP8_DENSE[8:],
    "fp8_fp4_gemm_nt": _FP8_DENSE,
    "m_grouped_fp8_gemm_nt_contiguous": _FP8_CONTIG, "m_grouped_fp8_fp4_gemm_nt_contiguous": _FP8_CONTIG,
    "m_grouped_fp8_gemm_nn_contiguous": _FP8_CONTIG[:-1], "m_grouped_fp8_fp4_gemm_nn_contiguous": _FP8_CONTIG[:-1],
    "m_grouped_fp8_gemm_nt_masked": _FP8_MASKED, "m_grouped_fp8_fp4_gemm_nt_masked": _FP8_MASKED,
    "fp8_m_grouped_gemm_nt_masked": _FP8_MASKED,
    "bf16_gemm_nt": _BF16_DENSE, "bf16_gemm_nn": _BF16_DENSE,
    "bf16_gemm_tn": _BF16_DENSE[:4] + _MN, "bf16_gemm_tt": _BF16_DENSE[:4] + _MN,
    "m_grouped_bf16_gemm_nt_contiguous": _BF16_CONTIG, "m_grouped_bf16_gemm_nn_contiguous": _BF16_CONTIG[:-1],
    "m_grouped_bf16_gemm_nt_masked": [("a", _E), ("b", _E), ("d", _E), ("masked_m", _E), ("expected_m", _E),
                                      ("compiled_dims", "nk")],
    "bf16_m_grouped_gemm_nt_masked": [("a", _E), ("b", _E), ("d", _E), ("masked_m", _E), ("expected_m", _E),
                                      ("compiled_dims", "nk")],
    "transform_sf_into_required_layout": [("sf", _E), ("mn", _E), ("k", _E), ("recipe", _E), ("num_groups", None),
                                          ("is_sfa", None), ("disable_ue8m0_cast", False), ("psum_layout", None)],
    "get_theoretical_mk_alignment_for_contiguous_layout": [("expected_m", None)],
    "set_num_sms": [("new_num_sms", _E)], "get_num_sms": [],
    "set_mk_alignment_for_contiguous_layout": [("new_value", _E)], "get_mk_alignment_for_contiguous_layout": [],
    "get_tma_aligned_size": [("x", _E), ("element_size", _E)],
    # deep_gemm/mega/__init__.py; the recipe default differs: DeepGEMM's (1, 1, 32) is sm100's FP4 recipe, ours
    # None means the one recipe here, (1, 128, 128).
    "fp8_fp4_mega_moe": [("y", _E), ("l1_weights", _E), ("l2_weights", _E), ("sym_buffer", _E),
                         ("cumulative_local_expert_recv_stats", None), ("recipe", None), ("activation", "swiglu"),
                         ("activation_clamp", None), ("fast_math", True)],
    "bf16_mega_moe": [("y", _E), ("l1_weights", _E), ("l2_weights", _E), ("sym_buffer", _E),
                      ("cumulative_local_expert_recv_stats", None), ("activation", "swiglu"),
                      ("activation_clamp", None), ("fast_math", True)],
}


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's ``deep_gemm.testing.calc_diff``."""
    x, y = x.double(), y.double()
    denominator = (x * x + y * y).sum()
    if denominator == 0:
        return 0.0
    return float(1 - 2 * (x * y).sum() / denominator)


@pytest.mark.parametrize("name", sorted(DEEPGEMM_2_6_1))
def test_signature_matches_deepgemm_2_6_1(name):
    sig = inspect.signature(getattr(gemm, name))
    ours = [(p.name, p.default) for p in sig.parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    assert ours == DEEPGEMM_2_6_1[name]
    # Our extensions are keyword-only (use_pdl, config): positional calls mean what they mean in DeepGEMM.
    assert all(p.kind == p.KEYWORD_ONLY for p in sig.parameters.values() if (p.name, p.default) not in ours)


def test_aliases_and_layout_module():
    import moe_ep.gemm.utils.layout as layout
    from moe_ep.gemm import utils

    assert gemm.m_grouped_fp8_fp4_gemm_nt_contiguous is gemm.m_grouped_fp8_gemm_nt_contiguous
    assert gemm.fp8_m_grouped_gemm_nt_masked is gemm.m_grouped_fp8_gemm_nt_masked
    assert gemm.bf16_m_grouped_gemm_nt_masked is gemm.m_grouped_bf16_gemm_nt_masked
    for name in ("get_mn_major_tma_aligned_tensor", "get_tma_aligned_size", "get_mk_alignment_for_contiguous_layout",
                 "set_mk_alignment_for_contiguous_layout", "get_theoretical_mk_alignment_for_contiguous_layout",
                 "get_m_alignment_for_contiguous_layout", "get_k_alignment_for_contiguous_layout"):
        assert getattr(layout, name) is getattr(gemm, name) is getattr(utils, name)
    assert gemm.get_theoretical_mk_alignment_for_contiguous_layout() == 128
    assert gemm.get_theoretical_mk_alignment_for_contiguous_layout(16) == 128
    from moe_ep.gemm.mega_moe import fp8_fp4_mega_moe, fp8_mega_moe
    assert gemm.fp8_fp4_mega_moe is fp8_fp4_mega_moe and gemm.fp8_mega_moe is fp8_mega_moe
    with pytest.raises(NotImplementedError, match="BF16"):
        gemm.bf16_mega_moe(None, None, None, None)


@pytest.mark.parametrize("shape", [(6, 3), (5, 1), (4, 1), (1, 1), (2, 5, 3), (1, 7, 1)])
def test_mn_major_tma_aligned_strides(shape):
    sf = torch.randn(*shape)
    out = gemm.get_mn_major_tma_aligned_tensor(sf)
    mn, k = shape[-2:]
    mp = -(-mn // 4) * 4
    want = (1, mp) if len(shape) == 2 else (mp * k, 1, mp)
    assert out.stride() == want and torch.equal(out, sf)
    assert gemm.get_mn_major_tma_aligned_tensor(out) is out


def test_transform_sf_into_required_layout():
    sfa = torch.rand(5, 2)
    out = gemm.transform_sf_into_required_layout(sfa, 5, 256, (1, 128, 128), is_sfa=True)
    assert out.stride() == (1, 8) and torch.equal(out, sfa)
    assert gemm.transform_sf_into_required_layout(sfa, 5, 256, (1, 128)).stride() == (1, 8)
    sfb = torch.rand(3, 2, 2)
    assert gemm.transform_sf_into_required_layout(sfb, 256, 256, (1, 128, 128), num_groups=3, is_sfa=False) is sfb
    with pytest.raises(ValueError, match="not supported"):
        gemm.transform_sf_into_required_layout(sfa, 5, 256, (1, 64, 128), is_sfa=False)
    with pytest.raises(ValueError, match="is_sfa"):
        gemm.transform_sf_into_required_layout(sfa, 5, 256, (1, 128, 128))
    with pytest.raises(ValueError, match="shape"):
        gemm.transform_sf_into_required_layout(sfa, 6, 256, (1, 128))


def _weights(g: int, n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    wq, ws = per_block_quant_fp8(torch.randn(g, n, k, generator=gen))
    return wq, ws, dequant_block_fp8(wq, ws).double()


def _psum_inputs(counts, k, seed, align=128):
    """DeepGEMM's psum layout: expert e's rows at [align(psum[e-1]), psum[e]); m_indices of the same rows."""
    gen = torch.Generator().manual_seed(seed)
    starts, psum, s = [], [], 0
    for c in counts:
        starts.append(s)
        psum.append(s + c)
        s = -(-(s + c) // align) * align
    m = s
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    m_indices = torch.full((m,), -1, dtype=torch.int32)
    for e, (st, c) in enumerate(zip(starts, counts)):
        m_indices[st:st + c] = e
    x[m_indices < 0] = 0
    return x, torch.tensor(psum, dtype=torch.int32), m_indices


@pytest.mark.parametrize("ensure_zero_padding", [True, False])
def test_psum_layout_matches_m_indices_and_reference(ensure_zero_padding):
    n, k = 128, 256
    counts = [100, 0, 129, 3]  # an empty expert, a block crossing 128, a tail
    wq, ws, wd = _weights(len(counts), n, k, seed=1)
    x, psum, m_indices = _psum_inputs(counts, k, seed=2)
    xq, xs = per_token_group_quant_fp8(x, tma_aligned_scales=True)
    d = torch.full((x.shape[0], n), POISON, dtype=torch.bfloat16)
    gemm.m_grouped_fp8_gemm_nt_contiguous((xq, xs), (wq, ws), d, psum, use_psum_layout=True,
                                          ensure_zero_padding=ensure_zero_padding)
    ref = torch.einsum("mk,mnk->mn", dequant_fp8(xq, xs).double(), wd[m_indices.clamp(min=0).long()])
    start = 0
    for e, end in enumerate(psum.tolist()):  # group boundaries as DeepGEMM's test walks them
        if end > start:
            assert calc_diff(d[start:end], ref[start:end]) < FP8_MAX_DIFF, f"expert {e}"
        start = -(-end // 128) * 128
    pad = m_indices < 0
    if ensure_zero_padding:
        assert bool((d[pad] == 0).all())
        d_idx = torch.full_like(d, POISON)
        gemm.m_grouped_fp8_gemm_nt_contiguous((xq, xs), (wq, ws), d_idx, m_indices)
        assert torch.equal(d.view(torch.int16), d_idx.view(torch.int16)), "psum and m_indices differ"
    else:
        assert bool((d[pad] == POISON).all()), "padding rows written without ensure_zero_padding"


def test_psum_rows_past_last_expert_and_alignment_64():
    n, k = 128, 128
    wq, ws, _ = _weights(2, n, k, seed=3)
    gemm.set_mk_alignment_for_contiguous_layout(64)
    try:
        x, psum, m_indices = _psum_inputs([70, 10], k, seed=4, align=64)
        x = torch.cat([x, torch.zeros(64, k, dtype=torch.bfloat16)])  # rows past the last expert (worst-case M)
        m_indices = torch.cat([m_indices, torch.full((64,), -1, dtype=torch.int32)])
        xq, xs = per_token_group_quant_fp8(x)
        d1 = torch.full((x.shape[0], n), POISON)
        d2 = torch.full((x.shape[0], n), POISON)
        gemm.m_grouped_fp8_gemm_nt_contiguous((xq, xs), (wq, ws), d1, psum, use_psum_layout=True)
        gemm.m_grouped_fp8_gemm_nt_contiguous((xq, xs), (wq, ws), d2, m_indices)
        assert torch.equal(d1, d2) and bool((d1[m_indices < 0] == 0).all())
    finally:
        gemm.set_mk_alignment_for_contiguous_layout(128)
    with pytest.raises(ValueError, match="multiple of 64"):
        gemm.set_mk_alignment_for_contiguous_layout(32)


def test_num_sms_caps_the_grid_same_result():
    n, k = 256, 128
    wq, ws, _ = _weights(2, n, k, seed=5)
    x, psum, m_indices = _psum_inputs([130, 5], k, seed=6)
    xq, xs = per_token_group_quant_fp8(x)
    d1 = torch.full((x.shape[0], n), POISON)
    gemm.m_grouped_fp8_gemm_nt_contiguous((xq, xs), (wq, ws), d1, m_indices)
    assert gemm.get_num_sms() >= 1
    xm = torch.stack([xq[:8], xq[256:264]])  # rows of expert 0, of expert 1
    sm = torch.stack([xs[:8], xs[256:264]])
    masked_m = torch.tensor([8, 2], dtype=torch.int32)
    dm1 = torch.full((2, 8, n), POISON)
    gemm.m_grouped_fp8_gemm_nt_masked((xm, sm), (wq, ws), dm1, masked_m, 8)
    gemm.set_num_sms(1)  # one persistent program walks every tile
    try:
        assert gemm.get_num_sms() == 1
        d2 = torch.full_like(d1, POISON)
        gemm.m_grouped_fp8_gemm_nt_contiguous((xq, xs), (wq, ws), d2, m_indices)
        dm2 = torch.full_like(dm1, POISON)
        gemm.m_grouped_fp8_gemm_nt_masked((xm, sm), (wq, ws), dm2, masked_m, 8)
    finally:
        gemm.set_num_sms(0)
    assert torch.equal(d1, d2) and torch.equal(dm1, dm2)
    assert calc_diff(dm2[0], d1[:8]) < 1e-9 and calc_diff(dm2[1, :2], d1[256:258]) < 1e-9
    assert bool((dm2[1, 2:] == POISON).all())
    with pytest.raises(ValueError):
        gemm.set_num_sms(-1)


@pytest.mark.parametrize("m", [5, 130])  # swap-AB tile, 128-row tiles with a partial last one
def test_fp8_gemm_wgrad_recipe_as_deepgemm_tests_call_it(m):
    """DeepGEMM 2.6.1 ``tests/test_fp8_fp4.py::test_gemm``'s wgrad rows on sm90: both operands cast per token
    (1x128 float32 scales, row-major), ``c = d`` float32, ``recipe=(1, 1, 128)``, ``disable_ue8m0_cast=True``,
    through ``fp8_fp4_gemm_nt`` and the ``nt`` alias; checked against the FP32 reference with ``calc_diff``."""
    n, k = 200, 384  # N not a multiple of 128: per-row weight scales need no block padding
    gen = torch.Generator().manual_seed(21)
    a = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    for name in ("fp8_fp4_gemm_nt", "fp8_gemm_nt"):
        d = torch.randn(m, n, generator=gen) * 32
        ref = a.float() @ b.float().t() + d
        aq, bq = per_token_group_quant_fp8(a), per_token_group_quant_fp8(b)
        getattr(gemm, name)(aq, bq, d, c=d, disable_ue8m0_cast=True, recipe=(1, 1, 128), recipe_a=None,
                            recipe_b=None)
        assert calc_diff(d, ref) < FP8_MAX_DIFF, name
    # the exact per-element bound: dequantized operands in float64
    d = torch.zeros(m, n)
    gemm.fp8_gemm_nt(aq, bq, d, recipe_a=(1, 128), recipe_b=(1, 128))
    ref = dequant_fp8(*aq).double() @ dequant_fp8(*bq).double().T
    bound = dequant_fp8(*aq).double().abs() @ dequant_fp8(*bq).double().abs().T
    assert bool(((d.double() - ref).abs() <= bound * 1e-5 + 1e-30).all())
    # nn: B given as [K, N] with its scales [K/128, N]
    dn = torch.zeros(m, n)
    gemm.fp8_gemm_nn(aq, (bq[0].T.contiguous(), bq[1].T.contiguous()), dn, recipe=(1, 1, 128))
    assert torch.equal(dn, d)
    # the grouped layouts keep the one recipe; the dense one checks the wgrad scale shape
    with pytest.raises(ValueError, match="b\\[1\\] must have shape"):
        gemm.fp8_gemm_nt(aq, (bq[0], bq[1][:2]), d, recipe=(1, 1, 128))


@pytest.mark.parametrize("m, n, k", [(5, 200, 320), (130, 96, 192)])  # swap-AB / 128-row tiles, K % 128 = 64
def test_fp8_gemm_k_tail_as_deepgemm_dgrad_rows(m, n, k):
    """K not a multiple of 128, as DeepGEMM 2.6.1's dgrad rows (K 2112 and 576): the last 1x128 / 128x128 scale
    covers a partial block. Both recipes (1D2D and wgrad), dense and m-grouped contiguous, against FP32."""
    u = gemm.utils
    gen = torch.Generator().manual_seed(23)
    a = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    ref = a.float() @ b.float().t()
    aq = u.per_token_cast_to_fp8(a, use_ue8m0=False)
    assert aq[1].shape == (m, 3 if k == 320 else 2)
    d = torch.empty(m, n, dtype=torch.bfloat16)
    gemm.fp8_fp4_gemm_nt(aq, u.per_block_cast_to_fp8(b, use_ue8m0=False), d, disable_ue8m0_cast=True)
    assert calc_diff(d, ref) < FP8_MAX_DIFF
    c = torch.randn(m, n, generator=gen) * 32
    d32 = c.clone()
    gemm.fp8_fp4_gemm_nt(aq, u.per_token_cast_to_fp8(b, use_ue8m0=False), d32, c=d32, recipe=(1, 1, 128))
    assert calc_diff(d32, ref + c) < FP8_MAX_DIFF
    # m-grouped contiguous: two experts, the same K tail
    w = torch.randn(2, n, k, generator=gen).to(torch.bfloat16)
    wq = (torch.stack([u.per_block_cast_to_fp8(w[g], use_ue8m0=False)[0] for g in range(2)]),
          torch.stack([u.per_block_cast_to_fp8(w[g], use_ue8m0=False)[1] for g in range(2)]))
    rows = torch.randn(256, k, generator=gen).to(torch.bfloat16)
    mi = torch.cat([torch.zeros(100, dtype=torch.int32), torch.full((28,), -1, dtype=torch.int32),
                    torch.ones(128, dtype=torch.int32)])
    dg = torch.empty(256, n, dtype=torch.bfloat16)
    gemm.m_grouped_fp8_fp4_gemm_nt_contiguous(u.per_token_cast_to_fp8(rows, use_ue8m0=False), wq, dg, mi,
                                              disable_ue8m0_cast=True)
    for g, sl in ((0, slice(0, 100)), (1, slice(128, 256))):
        assert calc_diff(dg[sl], rows[sl].float() @ w[g].float().t()) < FP8_MAX_DIFF


@pytest.mark.parametrize("m", [5, 70])  # swap-AB tile, 128-row tile
def test_fp8_gemm_nt_and_transposes(m):
    n, k = 200, 256  # N not a multiple of 128: the last scale row covers a partial block
    wq, ws, wd = _weights(1, n, k, seed=7)
    wq, ws, wd = wq[0], ws[0], wd[0]
    gen = torch.Generator().manual_seed(8)
    xq, xs = per_token_group_quant_fp8(torch.randn(m, k, generator=gen).to(torch.bfloat16))
    ref = dequant_fp8(xq, xs).double() @ wd.T
    d = torch.full((m, n), POISON, dtype=torch.bfloat16)
    gemm.fp8_gemm_nt((xq, xs), (wq, ws), d)
    assert calc_diff(d, ref) < FP8_MAX_DIFF
    c = torch.randn(m, n, generator=gen)
    d32 = torch.empty(m, n)
    gemm.fp8_gemm_nt((xq, xs), (wq, ws), d32, c, recipe=(1, 128, 128))
    assert calc_diff(d32, ref + c.double()) < FP8_MAX_DIFF
    d32c = c.clone()
    gemm.fp8_gemm_nt((xq, xs), (wq, ws), d32c, d32c)  # c is d: accumulate in place
    assert torch.equal(d32c, d32)
    at = (xq.T.contiguous(), xs.T.contiguous())  # [K, M], [K/128, M]
    bt = (wq.T.contiguous(), ws.T.contiguous())  # [K, N], [K/128, N/128]
    for fn, aa, bb in ((gemm.fp8_gemm_nn, (xq, xs), bt), (gemm.fp8_gemm_tn, at, bt), (gemm.fp8_gemm_tt, at, (wq, ws))):
        dd = torch.full((m, n), POISON, dtype=torch.bfloat16)
        fn(aa, bb, dd)
        assert torch.equal(dd, d), fn.__name__


def test_bf16_gemms():
    gen = torch.Generator().manual_seed(9)
    m, n, k = 20, 96, 80  # K not a multiple of the 64-wide K block, N not of 128
    a = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    ref = a.double() @ b.double().T
    d = torch.empty(m, n, dtype=torch.bfloat16)
    gemm.bf16_gemm_nt(a, b, d)
    assert calc_diff(d, ref) < BF16_MAX_DIFF
    for fn, aa, bb in ((gemm.bf16_gemm_nn, a, b.T.contiguous()), (gemm.bf16_gemm_tn, a.T.contiguous(), b.T.contiguous()),
                       (gemm.bf16_gemm_tt, a.T.contiguous(), b)):
        dd = torch.empty_like(d)
        fn(aa, bb, dd)
        assert torch.equal(dd, d), fn.__name__
    c = torch.randn(m, n, generator=gen)
    d32 = torch.empty(m, n)
    gemm.bf16_gemm_nt(a, b, d32, c)
    assert calc_diff(d32, ref + c.double()) < BF16_MAX_DIFF


def test_bf16_grouped_contiguous_psum_and_masked():
    gen = torch.Generator().manual_seed(10)
    n, k, counts = 128, 64, [3, 130]
    x, psum, m_indices = _psum_inputs(counts, k, seed=11)
    w = torch.randn(2, n, k, generator=gen).to(torch.bfloat16)
    ref = torch.einsum("mk,mnk->mn", x.double(), w.double()[m_indices.clamp(min=0).long()])
    ref[m_indices < 0] = 0
    d1 = torch.full((x.shape[0], n), POISON, dtype=torch.bfloat16)
    d2 = torch.full_like(d1, POISON)
    gemm.m_grouped_bf16_gemm_nt_contiguous(x, w, d1, m_indices)
    gemm.m_grouped_bf16_gemm_nt_contiguous(x, w, d2, psum, use_psum_layout=True)
    assert calc_diff(d1, ref) < BF16_MAX_DIFF and torch.equal(d1, d2) and bool((d1[m_indices < 0] == 0).all())
    d3 = torch.full_like(d1, POISON)
    gemm.m_grouped_bf16_gemm_nn_contiguous(x, w.transpose(1, 2).contiguous(), d3, m_indices)
    assert torch.equal(d3, d1)
    xm = torch.randn(2, 6, k, generator=gen).to(torch.bfloat16)
    dm = torch.full((2, 6, n), POISON, dtype=torch.bfloat16)
    gemm.m_grouped_bf16_gemm_nt_masked(xm, w, dm, torch.tensor([6, 2], dtype=torch.int32), 4)
    refm = torch.einsum("gtk,gnk->gtn", xm.double(), w.double())
    assert calc_diff(dm[0], refm[0]) < BF16_MAX_DIFF and calc_diff(dm[1, :2], refm[1, :2]) < BF16_MAX_DIFF
    assert bool((dm[1, 2:] == POISON).all())


@pytest.mark.parametrize("kwargs, match", [
    ({"recipe": (1, 1, 128)}, "only recipe=\\(1, 128, 128\\)"),
    ({"recipe": (1, 128, 128), "recipe_a": (1, 128), "recipe_b": (128, 128)}, "either recipe"),
    ({"recipe_a": (1, 128)}, "go together"),
    ({"recipe_a": (1, 32), "recipe_b": (1, 32)}, "only recipe"),
    ({"compiled_dims": "xy"}, "compiled_dims"),
    ({"expected_m_for_psum_layout": 64}, "use_psum_layout=True only"),
])
def test_recipe_and_keyword_errors(kwargs, match):
    wq, ws, _ = _weights(1, 128, 128, seed=12)
    x, _, m_indices = _psum_inputs([4], 128, seed=13)
    xq, xs = per_token_group_quant_fp8(x)
    d = torch.full((x.shape[0], 128), POISON)
    with pytest.raises(ValueError, match=match):
        gemm.m_grouped_fp8_gemm_nt_contiguous((xq, xs), (wq, ws), d, m_indices, **kwargs)
    assert bool((d == POISON).all())
    gemm.m_grouped_fp8_gemm_nt_contiguous((xq, xs), (wq, ws), d, m_indices, recipe_a=(1, 128), recipe_b=(128, 128))
