"""per_token_group_quant_fp8 and silu_and_mul_quant_fp8 against the torch reference, bitwise.

Both ops are checked through one set of cases (``op`` = "quant" or "silu"). For the fused op the
gate is drawn from values whose SiLU is exact in float32 on every backend (gate >= 20: SiLU(g) = g;
gate = 0; gate <= -104: -0.0), so the FP8 bytes and scales must equal the reference quantization of
``gate * up`` bitwise; random gates are checked separately to the stated tolerance.
"""

from __future__ import annotations

import os

import pytest
import torch

from moe_ep.fp8 import FP8_DTYPE, per_token_group_quant_fp8_ref
from moe_ep.quant import (
    per_token_group_quant_fp8,
    scale_layout,
    silu_and_mul_fp32,
    silu_and_mul_quant_fp8,
    silu_and_mul_quant_fp8_ref,
)
from moe_ep.testing import assert_bitwise_equal, assert_close_ulp

# Without a GPU the kernels run in the interpreter on CPU tensors; where a GPU is present (no
# TRITON_INTERPRET) the same small cases run compiled on it.
DEV = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"

# SiLU's exp(-gate) overflows to inf on purpose for gate < -88 (numpy warns in the interpreter).
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

OPS = {"quant": per_token_group_quant_fp8, "silu": silu_and_mul_quant_fp8}

# name -> keyword options; every layout option of the issue, alone and combined.
LAYOUTS = {
    "row": {},
    "col": {"column_major_scales": True},
    "tma": {"tma_aligned_scales": True},
    "round": {"round_scale": True},
    "ue8m0": {"scale_ue8m0": True},
    "ue8m0_col": {"scale_ue8m0": True, "column_major_scales": True},
    "ue8m0_tma": {"scale_ue8m0": True, "tma_aligned_scales": True},
    "transpose": {"transpose_out": True},
    "transpose_tma_round": {"transpose_out": True, "tma_aligned_scales": True, "round_scale": True},
}

POISON_BYTE = 0x5A  # an e4m3 value no quantization of these inputs produces in masked rows
POISON_WORD = 0x12345678


def make_input(op: str, lead: tuple, k: int, dtype: torch.dtype, device=DEV, seed=0):
    """Input of ``op`` and the float32 values its quantization sees (`[*lead, k]`)."""
    gen = torch.Generator().manual_seed(seed)
    # Magnitudes spread over 1e-6 .. 1e3 per group, so scales, subnormal FP8 codes and the amax
    # clamp (1e-4) are all exercised.
    mag = 10.0 ** torch.randint(-6, 4, (*lead, k // 128, 1), generator=gen).float()
    vals = (torch.randn(*lead, k // 128, 128, generator=gen) * mag).reshape(*lead, k)
    if op == "quant":
        x = vals.to(dtype).to(device)
        return x, x.float()
    # Gates whose SiLU is exact: 0 and >= 20 (SiLU = gate) everywhere; <= -104 (SiLU = -0.0 through
    # 1 / inf) only in the interpreter, where that division is IEEE (compiled, it is div.full).
    kinds = 3 if str(device) == "cpu" else 2  # 0: zero, 1: large positive, 2: large negative
    choice = torch.randint(0, kinds, (*lead, k), generator=gen)
    rnd = 50 * torch.rand(*lead, k, generator=gen)
    gate = torch.where(choice == 0, 0.0, torch.where(choice == 1, 20.0 + rnd, -104.0 - rnd)).to(dtype)
    up = vals.to(dtype)
    x = torch.cat([gate, up], dim=-1).to(device)
    return x, quantized_values(op, x)


def quantized_values(op: str, x: torch.Tensor) -> torch.Tensor:
    """The float32 tensor ``op`` quantizes (for "silu", x must hold make_input's exact gates)."""
    if op == "quant":
        return x.float()
    gate, up = x.float().chunk(2, dim=-1)
    silu = torch.where(gate > 0, gate, gate * 0.0)  # exact: g for g >= 20, +0 for 0, -0 for g <= -104
    return silu * up


def reference(y: torch.Tensor, opts: dict):
    if y.numel() == 0 and opts.get("scale_ue8m0"):
        # moe_ep.fp8.pack_ue8m0 cannot reshape an empty tensor (reported to the lead).
        words = (y.shape[-1] // 128 + 3) // 4
        return y.to(FP8_DTYPE), torch.empty(*y.shape[:-1], words, dtype=torch.int32, device=y.device)
    return per_token_group_quant_fp8_ref(y, 128, opts.get("round_scale", False), opts.get("scale_ue8m0", False))


def logical_q(q: torch.Tensor, opts: dict) -> torch.Tensor:
    return q.transpose(-1, -2) if opts.get("transpose_out") else q


def check_layout(scales: torch.Tensor, lead, rows, groups, opts: dict) -> None:
    dtype, shape, strides = scale_layout(lead, rows, groups, column_major=opts.get("column_major_scales", False),
                                         tma_aligned=opts.get("tma_aligned_scales", False),
                                         use_ue8m0=opts.get("scale_ue8m0", False))
    assert scales.dtype == dtype and tuple(scales.shape) == shape
    if scales.numel():
        assert all(n <= 1 or s == e for n, s, e in zip(scales.shape, scales.stride(), strides, strict=True)), \
            (scales.stride(), strides)


def poisoned_outputs(lead, rows, k, opts, device=DEV):
    q_shape = (*lead, k, rows) if opts.get("transpose_out") else (*lead, rows, k)
    out = torch.full(q_shape, POISON_BYTE, dtype=torch.uint8, device=device).view(FP8_DTYPE)
    dtype, shape, strides = scale_layout(lead, rows, k // 128, column_major=opts.get("column_major_scales", False),
                                         tma_aligned=opts.get("tma_aligned_scales", False),
                                         use_ue8m0=opts.get("scale_ue8m0", False))
    out_scales = torch.empty_strided(shape, strides, dtype=dtype, device=device)
    out_scales.view(torch.int32).fill_(POISON_WORD)
    return out, out_scales


# ---------------------------------------------------------------------------------------------
# 2D: every layout option, tiny shapes
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("k", [128, 384])
@pytest.mark.parametrize("m", [0, 1, 3, 5, 64])
@pytest.mark.parametrize("op", list(OPS))
def test_layouts_bitwise(op, m, k, layout):
    opts = LAYOUTS[layout]
    x, y = make_input(op, (m,), k, torch.bfloat16, seed=m * 1000 + k)
    q, s = OPS[op](x, **opts)
    q_ref, s_ref = reference(y, opts)
    check_layout(s, (), m, k // 128, opts)
    assert q.dtype == FP8_DTYPE
    assert logical_q(q, opts).shape == (m, k)
    if opts.get("transpose_out"):
        assert q.is_contiguous()
    assert_bitwise_equal(logical_q(q, opts), q_ref, "x_fp8")
    assert_bitwise_equal(s, s_ref, "scales")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("op", list(OPS))
def test_input_dtypes(op, dtype):
    for layout in ("row", "ue8m0_tma"):
        opts = LAYOUTS[layout]
        x, y = make_input(op, (37,), 640, dtype, seed=7)
        q, s = OPS[op](x, **opts)
        q_ref, s_ref = reference(y, opts)
        assert_bitwise_equal(q, q_ref, f"x_fp8 {layout}")
        assert_bitwise_equal(s, s_ref, f"scales {layout}")


@pytest.mark.parametrize("group_size", [64, 256])
def test_other_group_sizes(group_size):
    x, y = make_input("quant", (9,), 768, torch.bfloat16, seed=3)
    for opts in ({}, {"tma_aligned_scales": True, "scale_ue8m0": True}):
        q, s = per_token_group_quant_fp8(x, group_size, **opts)
        q_ref, s_ref = per_token_group_quant_fp8_ref(y, group_size, use_ue8m0=opts.get("scale_ue8m0", False))
        assert_bitwise_equal(q, q_ref, "x_fp8")
        assert_bitwise_equal(s, s_ref, "scales")


# ---------------------------------------------------------------------------------------------
# 3D masked layout: rows at or past masked_m[l] untouched (zero_masked_scales=False; the default zeroes
# their scales, tests/test_quant_dropin.py)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["row", "tma", "ue8m0_tma", "transpose", "col"])
@pytest.mark.parametrize("k", [128, 384])
@pytest.mark.parametrize("op", list(OPS))
def test_masked_poisoned(op, k, layout):
    opts = LAYOUTS[layout]
    num_experts, rows = 5, 5
    x, y = make_input(op, (num_experts, rows), k, torch.bfloat16, seed=k)
    # An expert with no rows, some, all, more than T (clamped to T), negative (clamped to 0).
    masked_m = torch.tensor([0, 3, rows, rows + 7, -2], dtype=torch.int32 if k == 128 else torch.int64, device=DEV)
    out, out_scales = poisoned_outputs((num_experts,), rows, k, opts)
    q, s = OPS[op](x, out=out, out_scales=out_scales, masked_m=masked_m, zero_masked_scales=False, **opts)
    assert q is out and s is out_scales
    check_layout(s, (num_experts,), rows, k // 128, opts)
    q_ref, s_ref = reference(y, opts)
    q_log = logical_q(q, opts)
    for e in range(num_experts):
        n = max(min(int(masked_m[e]), rows), 0)
        assert_bitwise_equal(q_log[e, :n], q_ref[e, :n], f"x_fp8 expert {e}")
        assert_bitwise_equal(s[e, :n], s_ref[e, :n], f"scales expert {e}")
        assert bool((q_log[e, n:].view(torch.uint8) == POISON_BYTE).all()), f"expert {e}: masked FP8 rows written"
        assert bool((s[e, n:].view(torch.int32) == POISON_WORD).all()), f"expert {e}: masked scale rows written"


@pytest.mark.parametrize("op", list(OPS))
def test_3d_without_mask(op):
    x, y = make_input(op, (2, 3), 256, torch.float16, seed=11)
    q, s = OPS[op](x, tma_aligned_scales=True)
    q_ref, s_ref = reference(y, {})
    assert s.stride() == (2 * 4, 1, 4)  # per expert [G=2, T padded to 4]
    assert_bitwise_equal(q, q_ref, "x_fp8")
    assert_bitwise_equal(s, s_ref, "scales")


def test_masked_rows_never_read():
    # NaN in every masked row: any read would not show in the outputs (rows are independent), but
    # a masked row that got quantized would overwrite the poison; the valid rows must be exact.
    x, y = make_input("quant", (2, 4), 256, torch.bfloat16, seed=5)
    x[0, 1:] = float("nan")
    x[1, 3:] = float("nan")
    masked_m = torch.tensor([1, 3], dtype=torch.int32, device=DEV)
    out, out_scales = poisoned_outputs((2,), 4, 256, {})
    q, s = per_token_group_quant_fp8(x, out=out, out_scales=out_scales, masked_m=masked_m)
    q_ref, s_ref = reference(y, {})
    assert_bitwise_equal(q[0, :1], q_ref[0, :1])
    assert_bitwise_equal(s[1, :3], s_ref[1, :3])
    assert bool((q[0, 1:].view(torch.uint8) == POISON_BYTE).all())
    assert not bool(s.isnan().any())


# ---------------------------------------------------------------------------------------------
# Strided inputs and caller-provided outputs
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", list(OPS))
def test_strided_inputs(op):
    width = 256 if op == "quant" else 512
    if op == "quant":
        base, _ = make_input(op, (6,), 2 * width, torch.bfloat16, seed=2)
    else:  # two valid [gate | up] inputs side by side
        base = torch.cat([make_input(op, (6,), width // 2, torch.bfloat16, seed=s)[0] for s in (2, 3)], dim=-1)
    cases = {
        "row_padded": base[:, :width],  # row stride 2 * width, handled without a copy
        "every_other_row": base[::2, width:],
        "transposed_storage": base[:, :width].t().contiguous().t(),  # last dim stride != 1: copied
        "3d_permuted": base[:, :width].reshape(2, 3, width).transpose(0, 1),
    }
    for name, x in cases.items():
        q, s = OPS[op](x, column_major_scales=True)
        q_ref, s_ref = reference(quantized_values(op, x), {})
        assert_bitwise_equal(q, q_ref, f"x_fp8 {name}")
        assert_bitwise_equal(s, s_ref, f"scales {name}")


def test_out_with_padded_rows():
    x, y = make_input("quant", (5,), 256, torch.bfloat16, seed=4)
    buf = torch.full((5, 384), POISON_BYTE, dtype=torch.uint8, device=DEV).view(FP8_DTYPE)
    out = buf[:, 64:320]
    q, _ = per_token_group_quant_fp8(x, out=out)
    q_ref, _ = reference(y, {})
    assert q is out
    assert_bitwise_equal(out, q_ref)
    assert bool((buf[:, :64].view(torch.uint8) == POISON_BYTE).all())
    assert bool((buf[:, 320:].view(torch.uint8) == POISON_BYTE).all())


def test_bad_outputs_refused():
    x = torch.randn(4, 256, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="out must have shape"):
        per_token_group_quant_fp8(x, out=torch.empty(4, 128, dtype=FP8_DTYPE, device=DEV))
    with pytest.raises(TypeError, match="out must be"):
        per_token_group_quant_fp8(x, out=torch.empty(4, 256, dtype=torch.uint8, device=DEV))
    with pytest.raises(ValueError, match="contiguous last dim"):
        per_token_group_quant_fp8(x, out=torch.empty(256, 4, dtype=FP8_DTYPE, device=DEV).t())
    with pytest.raises(ValueError, match="out_scales must be column-major"):
        per_token_group_quant_fp8(x, column_major_scales=True, out_scales=torch.empty(4, 2, device=DEV))
    with pytest.raises(ValueError, match="TMA-aligned"):
        per_token_group_quant_fp8(x, tma_aligned_scales=True, out_scales=torch.empty(2, 5, device=DEV)[:, :4].t())
    with pytest.raises(TypeError, match="out_scales must be torch.int32"):
        per_token_group_quant_fp8(x, scale_ue8m0=True, out_scales=torch.empty(4, 1, device=DEV))
    with pytest.raises(ValueError, match="out_scales must have shape"):
        per_token_group_quant_fp8(x, out_scales=torch.empty(4, 3, device=DEV))


def test_bad_inputs_refused():
    quant = per_token_group_quant_fp8
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        quant(torch.zeros(4, 128, dtype=torch.int32, device=DEV))
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        quant(torch.zeros(4, 128, device=DEV).to(FP8_DTYPE))
    with pytest.raises(ValueError, match="2D"):
        quant(torch.zeros(128, device=DEV))
    with pytest.raises(ValueError, match="multiple of 128"):
        quant(torch.zeros(4, 200, device=DEV))
    with pytest.raises(ValueError, match="multiple of 256"):
        silu_and_mul_quant_fp8(torch.zeros(4, 384, device=DEV))
    with pytest.raises(ValueError, match="power of two"):
        quant(torch.zeros(4, 384, device=DEV), 96)
    with pytest.raises(ValueError, match="needs 3D"):
        quant(torch.zeros(4, 128, device=DEV), masked_m=torch.zeros(4, dtype=torch.int32, device=DEV))
    with pytest.raises(TypeError, match="int32 or int64"):
        quant(torch.zeros(2, 4, 128, device=DEV), masked_m=torch.zeros(2, device=DEV))
    with pytest.raises(ValueError, match=r"shape \[L\]"):
        quant(torch.zeros(2, 4, 128, device=DEV), masked_m=torch.zeros(3, dtype=torch.int32, device=DEV))


def test_empty_input_does_not_launch(monkeypatch):
    import moe_ep.quant as quant_mod

    def boom(*args, **kwargs):
        raise AssertionError("launched on empty input")

    monkeypatch.setattr(quant_mod, "launch_per_token_group_quant", boom)
    monkeypatch.setattr(quant_mod, "launch_silu_and_mul_quant", boom)
    q, s = quant_mod.per_token_group_quant_fp8(torch.zeros(0, 256, device=DEV), tma_aligned_scales=True)
    assert q.shape == (0, 256) and s.shape == (0, 2) and s.dtype == torch.float32
    q, s = quant_mod.per_token_group_quant_fp8(torch.zeros(0, 640, device=DEV), scale_ue8m0=True, transpose_out=True)
    assert q.shape == (640, 0) and s.shape == (0, 2) and s.dtype == torch.int32
    masked_m = torch.zeros(3, dtype=torch.int32, device=DEV)
    q, s = quant_mod.silu_and_mul_quant_fp8(torch.zeros(3, 0, 512, device=DEV), masked_m=masked_m)
    assert q.shape == (3, 0, 256) and s.shape == (3, 0, 2)


def test_pdl_request_falls_back():
    x, y = make_input("quant", (3,), 256, torch.bfloat16, seed=9)
    q, s = per_token_group_quant_fp8(x, use_pdl=True)
    q_ref, s_ref = reference(y, {})
    assert_bitwise_equal(q, q_ref)
    assert_bitwise_equal(s, s_ref)


# ---------------------------------------------------------------------------------------------
# NaN / inf: the documented behaviour
# ---------------------------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf / inf, inf * 0
@pytest.mark.parametrize("opts", [{}, {"scale_ue8m0": True}], ids=["fp32_scales", "ue8m0"])
def test_nan_inf(opts):
    x = torch.randn(3, 512, dtype=torch.bfloat16, device=DEV)
    x[0, 5] = float("nan")            # row 0, group 0: NaN
    x[1, 130] = float("inf")          # row 1, group 1: +inf
    x[1, 300] = float("-inf")         # row 1, group 2: -inf
    q, s = per_token_group_quant_fp8(x, **opts)
    q_ref, s_ref = reference(x.float(), opts)
    qb = q.view(torch.uint8)
    is_nan = (qb & 0x7F) == 0x7F      # e4m3fn NaN is S.1111.111; its sign is not specified
    if opts.get("scale_ue8m0"):
        exps = (s.view(torch.uint8).reshape(3, -1)[:, :4]).int()
        assert exps[0, 0] == 0xFF and exps[1, 1] == 0xFF and exps[1, 2] == 0xFF
        assert_bitwise_equal(s, s_ref, "ue8m0 scales")
    else:
        assert s[0, 0].isnan() and s[1, 1] == float("inf") and s[1, 2] == float("inf")
        assert_close_ulp(s, s_ref, 0, "scales")
    assert bool(is_nan[0, :128].all()), "a NaN makes its whole group NaN"
    assert is_nan[1, 130] and is_nan[1, 300], "inf / inf is NaN"
    finite = torch.ones(512, dtype=torch.bool)
    finite[[130, 300]] = False
    assert bool((qb[1, 128:384][finite[128:384]] & 0x7F == 0).all()), "finite values in an inf group are +-0"
    # Everything outside the NaN/inf groups is bitwise the reference.
    clean = torch.ones(3, 512, dtype=torch.bool)
    clean[0, :128] = False
    clean[1, 128:384] = False
    assert torch.equal(qb[clean], q_ref.view(torch.uint8)[clean])
    assert bool((is_nan == ((q_ref.view(torch.uint8) & 0x7F) == 0x7F)).all())


# ---------------------------------------------------------------------------------------------
# Fused SiLU with random gates: to the stated tolerance
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("opts", [{}, {"tma_aligned_scales": True, "round_scale": True}], ids=["plain", "tma_round"])
def test_silu_random_gates(opts):
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(33, 768, generator=gen) * 3).to(torch.bfloat16).to(DEV)
    q, s = silu_and_mul_quant_fp8(x, **opts)
    q_ref, s_ref = silu_and_mul_quant_fp8_ref(x, round_scale=opts.get("round_scale", False))
    # exp differs by a few float32 ulp between backends: scales agree to ~2 ulp (exactly with
    # round_scale unless the amax sits on a power of two), FP8 values to one e4m3 step.
    assert_close_ulp(s, s_ref, 2, "scales")
    assert_close_ulp(q.float(), q_ref.float(), 1, "x_fp8", dtype=FP8_DTYPE)
    same = (q.view(torch.uint8) == q_ref.view(torch.uint8)).float().mean().item()
    assert same > 0.99, f"only {same:.4f} of the FP8 bytes equal the reference"
    deq = q.float().reshape(33, 3, 128) * s[:, :, None]
    y = silu_and_mul_fp32(x).reshape(33, 3, 128)
    assert bool(((deq - y).abs() <= s[:, :, None] * 16 + 1e-30).all())  # within e4m3 spacing at 448


# ---------------------------------------------------------------------------------------------
# GPU: the same cases at real sizes (compiled Triton; bitwise against torch on the GPU)
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("m,k", [(1, 7168), (129, 2048), (4096, 7168), (16384, 4096)])
@pytest.mark.parametrize("op", list(OPS))
def test_gpu_layouts_bitwise(op, m, k, layout):
    opts = LAYOUTS[layout]
    x, y = make_input(op, (m,), k, torch.bfloat16, device="cuda", seed=m + k)
    q, s = OPS[op](x, **opts)
    q_ref, s_ref = reference(y.cuda(), opts)
    check_layout(s, (), m, k // 128, opts)
    assert_bitwise_equal(logical_q(q, opts), q_ref, "x_fp8")
    assert_bitwise_equal(s, s_ref, "scales")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["row", "tma", "ue8m0_tma", "transpose"])
@pytest.mark.parametrize("op", list(OPS))
def test_gpu_masked_poisoned(op, layout):
    opts = LAYOUTS[layout]
    num_experts, rows, k = 8, 1024, 7168
    x, y = make_input(op, (num_experts, rows), k, torch.bfloat16, device="cuda", seed=1)
    masked_m = torch.tensor([0, 1, 17, 128, 500, 1023, 1024, 4096], dtype=torch.int32, device="cuda")
    out, out_scales = poisoned_outputs((num_experts,), rows, k, opts, device="cuda")
    q, s = OPS[op](x, out=out, out_scales=out_scales, masked_m=masked_m, zero_masked_scales=False, **opts)
    q_ref, s_ref = reference(y.cuda(), opts)
    q_log = logical_q(q, opts)
    for e in range(num_experts):
        n = min(int(masked_m[e]), rows)
        assert_bitwise_equal(q_log[e, :n], q_ref[e, :n], f"x_fp8 expert {e}")
        assert_bitwise_equal(s[e, :n], s_ref[e, :n], f"scales expert {e}")
        assert bool((q_log[e, n:].view(torch.uint8) == POISON_BYTE).all())
        assert bool((s[e, n:].view(torch.int32) == POISON_WORD).all())


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["row", "round", "ue8m0_tma"])
@pytest.mark.parametrize("op", list(OPS))
def test_gpu_native_cast_equals_soft_cast(monkeypatch, op, layout):
    # The hardware e4m3 cast (sm90+) and the integer path of e4m3_bits give the same bytes.
    opts = LAYOUTS[layout]
    x, _ = make_input(op, (4096,), 7168, torch.bfloat16, device="cuda", seed=8)
    q_native, s_native = OPS[op](x, **opts)
    monkeypatch.setenv("MOE_EP_FP8_SOFT_CAST", "1")
    q_soft, s_soft = OPS[op](x, **opts)
    assert_bitwise_equal(q_native, q_soft, "x_fp8")
    assert_bitwise_equal(s_native, s_soft, "scales")


@pytest.mark.gpu
@pytest.mark.parametrize("op", list(OPS))
def test_gpu_pdl_same_result(op):
    x, _ = make_input(op, (4096,), 7168, torch.bfloat16, device="cuda", seed=3)
    q0, s0 = OPS[op](x, tma_aligned_scales=True)
    q1, s1 = OPS[op](x, tma_aligned_scales=True, use_pdl=True)
    torch.cuda.synchronize()
    assert_bitwise_equal(q1, q0)
    assert_bitwise_equal(s1, s0)


@pytest.mark.gpu
@pytest.mark.parametrize("opts", [{}, {"scale_ue8m0": True}], ids=["fp32_scales", "ue8m0"])
def test_gpu_nan_inf(opts):
    x = torch.randn(4096, 7168, dtype=torch.bfloat16, device="cuda")
    x[0, 5] = float("nan")
    x[1, 130] = float("inf")
    q, s = per_token_group_quant_fp8(x, **opts)
    q_ref, s_ref = reference(x.float(), opts)
    is_nan = (q.view(torch.uint8) & 0x7F) == 0x7F
    assert bool((is_nan == ((q_ref.view(torch.uint8) & 0x7F) == 0x7F)).all())
    clean = ~is_nan
    assert torch.equal(q.view(torch.uint8)[clean], q_ref.view(torch.uint8)[clean])
    if opts:
        assert_bitwise_equal(s, s_ref)
    else:
        assert_close_ulp(s, s_ref, 0, "scales")


@pytest.mark.gpu
def test_gpu_silu_random_gates():
    x = (torch.randn(4096, 2 * 2048, device="cuda") * 3).to(torch.bfloat16)
    q, s = silu_and_mul_quant_fp8(x, tma_aligned_scales=True)
    q_ref, s_ref = silu_and_mul_quant_fp8_ref(x)
    # Compiled exp is ex2.approx and the SiLU division div.full: a few float32 ulp from torch.
    assert_close_ulp(s, s_ref, 8, "scales")
    assert_close_ulp(q.float(), q_ref.float(), 1, "x_fp8", dtype=FP8_DTYPE)
