"""Drop-in behaviour of the quant ops for code written against vLLM's / SGLang's quant ops.

- TMA-aligned scales: the padding rows of the storage (M rounded up to 4 per column) are zeros.
- Masked 3D input: zero scales for rows at or past ``masked_m[l]`` by default (scale stores only; the
  FP8 rows stay unwritten); ``zero_masked_scales=False`` leaves them untouched.
- ``use_ue8m0=True`` is vLLM's (float32 power-of-two scales, = ``round_scale``); ``scale_ue8m0`` packs
  the exponents (SGLang / DeepGEMM).
- Deliberate numerics: amax floor 1e-4 (not vLLM's 1e-10), SiLU x up kept in float32 (not rounded to
  BF16 first as SGLang does).
"""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

from moe_ep.fp8 import AMAX_MIN, FP8_DTYPE, FP8_MAX, per_token_group_quant_fp8_ref, unpack_ue8m0
from moe_ep.quant import per_token_group_quant_fp8, scale_layout, silu_and_mul_quant_fp8

DEV = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
OPS = {"quant": per_token_group_quant_fp8, "silu": silu_and_mul_quant_fp8}
POISON_BYTE = 0x5A
NAN_BITS = 0x7FC00000  # float32 NaN; as an int32 UE8M0 word it is a poison too


def make_x(op, lead, k, seed):
    """Input and the float32 values quantized. SiLU gates >= 20 (SiLU(g) = g exactly everywhere)."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(*lead, k, generator=gen) * 10.0 ** torch.randint(-2, 3, (*lead, 1), generator=gen).float()
    if op == "quant":
        x = y.bfloat16()
        return x.to(DEV), x.float()
    gate = (20 + 40 * torch.rand(*lead, k, generator=gen)).bfloat16()
    up = y.bfloat16()
    return torch.cat([gate, up], -1).to(DEV), gate.float() * up.float()


def padded_storage(lead, rows, groups, use_ue8m0, fill_bits=NAN_BITS):
    """TMA-aligned out_scales as a slice of a poisoned `[*lead, cols, M_padded]` allocation."""
    dtype, shape, strides = scale_layout(lead, rows, groups, tma_aligned=True, use_ue8m0=use_ue8m0)
    cols, rows_padded = shape[-1], strides[-1]
    storage = torch.full((*lead, cols, rows_padded), fill_bits, dtype=torch.int32, device=DEV).view(dtype)
    return storage, storage[..., :rows].transpose(-1, -2)


def ref_scales(y, use_ue8m0=False, round_scale=False):
    return per_token_group_quant_fp8_ref(y, 128, round_scale, use_ue8m0)


# ---------------------------------------------------------------------------------------------
# 1. TMA padding rows are zeros
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("use_ue8m0", [False, True], ids=["f32", "ue8m0"])
@pytest.mark.parametrize("lead,rows", [((), 1), ((), 5), ((2,), 3)], ids=["m1", "m5", "l2m3"])
@pytest.mark.parametrize("op", list(OPS))
def test_tma_padding_zero(op, lead, rows, use_ue8m0):
    k = 256
    x, y = make_x(op, (*lead, rows), k, seed=rows)
    storage, out_scales = padded_storage(lead, rows, k // 128, use_ue8m0)
    q, s = OPS[op](x, tma_aligned_scales=True, scale_ue8m0=use_ue8m0, out_scales=out_scales)
    assert s is out_scales
    pad = storage.view(torch.int32)[..., rows:]
    assert pad.numel() > 0 and bool((pad == 0).all()), f"TMA padding rows not zeroed: {pad}"
    q_ref, s_ref = ref_scales(y, use_ue8m0)
    assert torch.equal(s.cpu().contiguous().view(torch.int32), s_ref.view(torch.int32))
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))
    # The ops' own allocation: same padding, read through the underlying storage.
    _, s2 = OPS[op](x, tma_aligned_scales=True, scale_ue8m0=use_ue8m0)
    full = torch.empty(0, dtype=s2.dtype, device=DEV).set_(s2.untyped_storage())
    cols, rows_padded = s2.shape[-1], s2.stride(-1)
    full = full.view(*lead, cols, rows_padded).view(torch.int32)
    assert bool((full[..., rows:] == 0).all())


def test_tma_padding_zero_with_mask():
    # Padding rows are storage, not data rows: zeroed whatever masked_m says; masked rows untouched.
    x, y = make_x("silu", (3, 5), 128, seed=3)
    masked_m = torch.tensor([0, 2, 9], dtype=torch.int32, device=DEV)
    storage, out_scales = padded_storage((3,), 5, 1, False)
    silu_and_mul_quant_fp8(x, tma_aligned_scales=True, out_scales=out_scales, masked_m=masked_m,
                           zero_masked_scales=False)
    bits = storage.view(torch.int32)
    assert bool((bits[..., 5:] == 0).all())
    assert bool((bits[0, :, :5] == NAN_BITS).all()) and bool((bits[1, :, 2:5] == NAN_BITS).all())


@pytest.mark.parametrize("extra", [-3, 2], ids=["stops_short", "goes_on"])
def test_tma_padding_in_foreign_storage(extra):
    # Storage that ends at the last valid row (torch.empty_strided, vLLM's allocation) has no room for the
    # last column's padding; storage that goes on past it (a workspace) may hold someone else's data there:
    # that padding is not written. The padding between columns lies inside the tensor: zeroed.
    dtype, shape, strides = scale_layout((), 5, 2, tma_aligned=True)
    backing = torch.full((2 * 8 + extra,), float("nan"), device=DEV)
    out_scales = backing.as_strided(shape, strides)
    x, y = make_x("quant", (5,), 256, seed=1)
    _, s = per_token_group_quant_fp8(x, tma_aligned_scales=True, out_scales=out_scales)
    assert torch.equal(s.cpu(), ref_scales(y)[1])
    assert bool((backing[5:8] == 0).all()) and bool(backing[13:].isnan().all())


# ---------------------------------------------------------------------------------------------
# 2. zero_masked_scales
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", [{}, {"tma_aligned_scales": True}, {"scale_ue8m0": True, "tma_aligned_scales": True},
                                    {"column_major_scales": True, "transpose_out": True}],
                         ids=["row", "tma", "ue8m0_tma", "col_transpose"])
@pytest.mark.parametrize("op", list(OPS))
def test_zero_masked_scales(op, layout):
    num_experts, rows, k = 4, 5, 256
    x, y = make_x(op, (num_experts, rows), k, seed=7)
    masked_m = torch.tensor([0, 2, rows, rows + 3], dtype=torch.int64, device=DEV)
    transpose = layout.get("transpose_out", False)
    q_shape = (num_experts, k, rows) if transpose else (num_experts, rows, k)
    out = torch.full(q_shape, POISON_BYTE, dtype=torch.uint8, device=DEV).view(FP8_DTYPE)
    dtype, shape, strides = scale_layout((num_experts,), rows, k // 128,
                                         column_major=layout.get("column_major_scales", False),
                                         tma_aligned=layout.get("tma_aligned_scales", False),
                                         use_ue8m0=layout.get("scale_ue8m0", False))
    out_scales = torch.empty_strided(shape, strides, dtype=dtype, device=DEV)
    out_scales.view(torch.int32).fill_(NAN_BITS)
    q, s = OPS[op](x, out=out, out_scales=out_scales, masked_m=masked_m, zero_masked_scales=True, **layout)
    q_ref, s_ref = ref_scales(y, layout.get("scale_ue8m0", False))
    q_log = (q.transpose(-1, -2) if transpose else q).cpu().view(torch.uint8)
    s_bits = s.cpu().view(torch.int32)
    for e in range(num_experts):
        n = min(int(masked_m[e]), rows)
        assert torch.equal(q_log[e, :n], q_ref[e, :n].view(torch.uint8))
        assert torch.equal(s_bits[e, :n], s_ref[e, :n].view(torch.int32))
        assert bool((q_log[e, n:] == POISON_BYTE).all()), f"expert {e}: masked FP8 rows written"
        assert bool((s_bits[e, n:] == 0).all()), f"expert {e}: masked scales not exactly 0"
    # Cost: the only extra stores are the masked rows' scales (4 bytes per group, or per UE8M0 word).


@pytest.mark.parametrize("op", list(OPS))
def test_masked_scales_zero_by_default_untouched_on_request(op):
    x, _ = make_x(op, (2, 4), 128, seed=2)
    masked_m = torch.tensor([1, 3], dtype=torch.int32, device=DEV)
    out_scales = torch.full((2, 4, 1), float("nan"), device=DEV)
    _, s = OPS[op](x, out_scales=out_scales, masked_m=masked_m, zero_masked_scales=False)
    assert bool(s[0, 1:].isnan().all()) and bool(s[1, 3:].isnan().all())
    assert not bool(s[0, :1].isnan().any()) and not bool(s[1, :3].isnan().any())
    out_scales.fill_(float("nan"))
    _, s = OPS[op](x, out_scales=out_scales, masked_m=masked_m)
    assert torch.equal(s[0, 1:].view(torch.int32).cpu(), torch.zeros(3, 1, dtype=torch.int32))
    assert torch.equal(s[1, 3:].view(torch.int32).cpu(), torch.zeros(1, 1, dtype=torch.int32))
    assert not bool(s.isnan().any())
    # Without masked_m the flag changes nothing; a non-bool is refused.
    _, s2 = OPS[op](x, zero_masked_scales=True)
    assert not bool((s2 == 0).any())
    with pytest.raises(TypeError):
        OPS[op](x, masked_m=masked_m, zero_masked_scales=1)


# ---------------------------------------------------------------------------------------------
# 3. use_ue8m0 = vLLM's (float32 powers of two, = round_scale); scale_ue8m0 packs them
# ---------------------------------------------------------------------------------------------

def test_round_scale_is_vllm_ue8m0():
    gen = torch.Generator().manual_seed(4)
    # One group per row with its own magnitude, 1e-7 .. 1e4 (the first below the 1e-4 amax floor).
    mag = 10.0 ** torch.arange(-7, 5, dtype=torch.float32)[:, None]
    x = (torch.randn(12, 128, generator=gen) * mag).to(DEV)
    _, s = per_token_group_quant_fp8(x, round_scale=True)
    s = s.cpu()
    amax = x.cpu().abs().amax(-1, keepdim=True).clamp(min=AMAX_MIN)
    ratio = (amax / FP8_MAX).double()  # float32 division, as the kernel does; log2 in float64
    expected = torch.tensor([[2.0 ** math.ceil(math.log2(r))] for r in ratio.flatten().tolist()])
    assert torch.equal(s.double(), expected)
    mant = s.view(torch.int32) & 0x7FFFFF
    assert bool((mant == 0).all()), "round_scale scales must be exact powers of two"
    _, s_vllm = per_token_group_quant_fp8(x, use_ue8m0=True)
    assert s_vllm.dtype == torch.float32 and torch.equal(s_vllm.cpu(), s)
    # scale_ue8m0 packs the same exponents (SGLang / DeepGEMM's int32 words).
    _, packed = per_token_group_quant_fp8(x, scale_ue8m0=True)
    assert packed.dtype == torch.int32
    assert torch.equal(unpack_ue8m0(packed.cpu(), 1), s)


# ---------------------------------------------------------------------------------------------
# 4. Deliberate numerics: amax floor 1e-4, float32 SiLU x up
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", list(OPS))
def test_amax_floor(op):
    floor = torch.tensor(AMAX_MIN, dtype=torch.float32) / FP8_MAX  # float32(1e-4) / 448 in float32
    k = 128 * 2
    x = torch.zeros(2, k * (2 if op == "silu" else 1))
    x[1, :128] = 1e-9  # below the floor too (vLLM's eps 1e-10 would give scale 1e-9 / 448)
    if op == "silu":
        x[1, 128:] = 0.0
        x[1, k:k + 128] = 1.0  # SiLU(gate) * up with gate 0: exactly 0
    q, s = OPS[op](x.bfloat16().to(DEV))
    assert torch.equal(s.cpu(), floor.expand(2, 2)), s
    assert bool((q.cpu().view(torch.uint8)[0] == 0).all())
    _, s_round = OPS[op](x.bfloat16().to(DEV), round_scale=True)
    assert torch.equal(s_round.cpu(), torch.full((2, 2), 2.0 ** -22))  # 1e-4 / 448 = 2.2e-7 -> 2^-22


def test_silu_float32_product():
    # gate >= 20: SiLU(gate) = gate exactly on every backend, so the product is gate * up, exact in
    # float32 (two 8-bit mantissas). Rounding it to BF16 first (SGLang) changes some FP8 bytes.
    gen = torch.Generator().manual_seed(9)
    gate = (20 + 40 * torch.rand(4, 256, generator=gen)).bfloat16()
    up = torch.randn(4, 256, generator=gen).bfloat16()
    x = torch.cat([gate, up], -1)
    prod32 = gate.float() * up.float()
    q_ref, s_ref = per_token_group_quant_fp8_ref(prod32, 128)
    q_bf16, s_bf16 = per_token_group_quant_fp8_ref(prod32.bfloat16().float(), 128)
    assert not torch.equal(q_ref.view(torch.uint8), q_bf16.view(torch.uint8)), "input does not separate the two"
    q, s = silu_and_mul_quant_fp8(x.to(DEV))
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s.cpu(), s_ref)


# ---------------------------------------------------------------------------------------------
# sm90: the zero_masked_scales variant compiles like the shipped ones (the others are in
# test_quant_compile.py and perf/sm90_report.py)
# ---------------------------------------------------------------------------------------------

def _compile_module():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "test_quant_compile.py")
    spec = importlib.util.spec_from_file_location("_quant_compile_for_dropin", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("keep_padding,round_product,bf16_math",
                         [(False, False, False), (True, False, False), (False, True, False), (False, False, True)],
                         ids=["zero_masked", "zero_masked_keep_padding", "zero_masked_round_product",
                              "zero_masked_bf16_math"])
def test_zero_masked_variant_compiles_for_sm90(keep_padding, round_product, bf16_math):
    """The variants engines' calls select (masked rows' scales zeroed, the default; SGLang's SiLU arithmetic;
    vLLM's CUDA bf16 arithmetic)."""
    from moe_ep.kernels.quant import mask_flags
    from moe_ep.testing.sm90 import compile_in_subprocess

    mod = _compile_module()
    flags = mask_flags(True, True, keep_padding, round_product=round_product, bf16_math=bf16_math)
    cases = [("silu", "bf16", 8, 4, True, True, flags, True, True, True, False, 3)]
    if not (round_product or bf16_math):  # the plain quant has no product to round
        cases.insert(0, ("quant", "bf16", 16, 4, False, False, flags, True, False, True, False, 3))
    for ops in compile_in_subprocess(mod.SCRIPT, cases, "the zero_masked_scales variants"):
        assert ops.get("cp.async.cg.shared.global", 0) + ops.get("cp.async.ca.shared.global", 0) > 0, ops
        assert ops.get("st.global.b8", 0) == 0 and ops.get("st.global.v4.b32", 0) > 0, ops
        assert ops.get("cvt.rn.satfinite.e4m3x2.f32", 0) > 0, ops


def test_int64_masked_m_is_clamped_before_narrowing():
    """An int64 count of 2**32 + 1 means "all T rows", not 1 (it must not wrap to int32 first)."""
    from moe_ep.quant import per_token_group_quant_fp8

    x = torch.randn(2, 8, 128).to(torch.bfloat16)
    mm = torch.tensor([2**32 + 1, 3], dtype=torch.int64)
    q, s = per_token_group_quant_fp8(x, masked_m=mm)
    ref_q, ref_s = per_token_group_quant_fp8(x.reshape(16, 128))
    assert torch.equal(q[0].view(torch.uint8), ref_q[:8].view(torch.uint8))
    assert torch.equal(s[0], ref_s[:8])


def test_tma_padding_between_experts_in_foreign_storage():
    # 3D: the padding rows after every column but the very last (experts' columns follow one another) are
    # inside the tensor; storage stopping at the last valid row gets them zeroed, and nothing past its end.
    dtype, shape, strides = scale_layout((2,), 3, 2, tma_aligned=True)
    backing = torch.full((3 * 4 + 3,), float("nan"), device=DEV)
    out_scales = backing.as_strided(shape, strides)
    x, y = make_x("quant", (2, 3), 256, seed=6)
    _, s = per_token_group_quant_fp8(x, tma_aligned_scales=True, out_scales=out_scales)
    assert torch.equal(s.cpu(), ref_scales(y)[1])
    assert torch.equal(backing[3::4].cpu(), torch.zeros(3))
