"""Shared e4m3 device helpers, weight block quantization, dequant helpers, launch config and PDL."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from moe_ep.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    ceil_to_pow2,
    per_token_group_quant_fp8_ref,
    to_column_major,
)
from moe_ep.kernels import quant as quant_kernels
from moe_ep.kernels.fp8_cast import e4m3_byte, group_scale, native_e4m3_supported
from moe_ep.kernels.pdl import pdl_launch_kwargs, pdl_supported
from moe_ep.quant import (
    dequant_block_fp8,
    dequant_fp8,
    per_block_quant_fp8,
    per_token_group_quant_fp8,
)
from moe_ep.testing import assert_bitwise_equal

DEV = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"  # see tests/test_quant.py


@triton.jit
def _cast_kernel(v_ptr, out_ptr, n, NATIVE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(v_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, e4m3_byte(v, NATIVE), mask=offs < n)


@triton.jit
def _scale_kernel(a_ptr, out_ptr, n, ROUND_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    a = tl.load(a_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, group_scale(a, ROUND_SCALE, False, False), mask=offs < n)


def _e4m3_bits(v: torch.Tensor, native: bool = False) -> torch.Tensor:
    out = torch.empty(v.shape, dtype=torch.uint8, device=v.device)
    block = 1 << 14
    _cast_kernel[(triton.cdiv(v.numel(), block),)](v, out, v.numel(), NATIVE=native, BLOCK=block)
    return out


def _cast_inputs(device="cpu") -> torch.Tensor:
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE).float()
    grid = grid[grid.isfinite()].unique()
    mids = (grid[1:] + grid[:-1]) / 2  # exact ties in float32: round half to even
    nudged = torch.cat([mids.nextafter(mids + 1), mids.nextafter(mids - 1)])
    gen = torch.Generator().manual_seed(0)
    rand = torch.randn(1 << 14, generator=gen) * 10.0 ** torch.randint(-12, 4, (1 << 14,), generator=gen)
    special = torch.tensor([0.0, -0.0, 448.0, -448.0, 464.0, 480.0, 1e30, -1e30, float("inf"), float("-inf"),
                            2.0**-9, 2.0**-10, 3 * 2.0**-11, 2.0**-6, 1e-45])
    return torch.cat([grid, mids, nudged, rand, special]).float().to(device)


def _torch_cast_bits(v: torch.Tensor) -> torch.Tensor:
    return v.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(torch.uint8)


def test_e4m3_bits_matches_torch():
    v = _cast_inputs(DEV)
    assert_bitwise_equal(_e4m3_bits(v), _torch_cast_bits(v), "e4m3 bytes")


def test_e4m3_bits_nan():
    v = torch.tensor([float("nan"), -float("nan")], device=DEV)
    assert _e4m3_bits(v).tolist() == [0x7F, 0xFF]


def test_native_cast_off_on_cpu():
    assert not native_e4m3_supported(torch.device("cpu"))


@pytest.mark.parametrize("round_scale", [False, True])
def test_group_scale_matches_torch(round_scale):
    gen = torch.Generator().manual_seed(1)
    amax = (torch.rand(4096, generator=gen) * 10.0 ** torch.randint(-8, 6, (4096,), generator=gen)).float()
    amax = torch.cat([amax, torch.tensor([0.0, 1e-4, 448.0, 448.0 * 2**-20, float("inf"), float("nan")])]).to(DEV)
    out = torch.empty_like(amax)
    _scale_kernel[(1,)](amax, out, amax.numel(), ROUND_SCALE=round_scale, BLOCK=8192)
    ref = amax.clamp(min=1e-4) / FP8_MAX
    if round_scale:
        ref = ceil_to_pow2(ref)
    assert_bitwise_equal(out[:-1], ref[:-1], "scale")
    assert out[-1].isnan()


@pytest.mark.gpu
@pytest.mark.parametrize("native", [False, True], ids=["integer_path", "hardware_cvt"])
def test_gpu_e4m3_byte(native):
    # Compiled Triton: both paths of e4m3_byte match torch's cast (after the reference's clamp).
    if native and not native_e4m3_supported(torch.device("cuda")):
        pytest.skip("hardware e4m3 cast path needs sm90+")
    v = _cast_inputs("cuda")
    finite = ~v.isnan()
    got = _e4m3_bits(v, native)
    assert_bitwise_equal(got[finite], _torch_cast_bits(v)[finite], "e4m3 bytes")
    assert bool(((got[~finite] & 0x7F) == 0x7F).all()), "NaN must stay NaN"


# ---------------------------------------------------------------------------------------------
# Dequant helpers, every layout
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("opts", [{}, {"column_major_scales": True}, {"tma_aligned_scales": True},
                                  {"scale_ue8m0": True, "tma_aligned_scales": True}, {"transpose_out": True}],
                         ids=["row", "col", "tma", "ue8m0_tma", "transpose"])
def test_dequant_every_layout(opts):
    x = torch.randn(7, 640, dtype=torch.bfloat16, device=DEV)
    q, s = per_token_group_quant_fp8(x, **opts)
    q_ref, s_ref = per_token_group_quant_fp8_ref(x, use_ue8m0=opts.get("scale_ue8m0", False))
    deq = dequant_fp8(q, s, transposed=opts.get("transpose_out", False))
    assert deq.shape == (7, 640) and deq.dtype == torch.float32
    assert_bitwise_equal(deq, dequant_fp8(q_ref, s_ref), "dequant")
    err = (deq - x.float()).abs()
    assert bool((err <= x.float().abs() / 16 + 1e-6 * 448).all())  # within half an e4m3 step (3 bits)


def test_to_column_major_convention():
    # Our TMA-aligned scales have exactly moe_ep.fp8.to_column_major's strides.
    x = torch.randn(5, 512, dtype=torch.bfloat16, device=DEV)
    _, s = per_token_group_quant_fp8(x, tma_aligned_scales=True)
    _, s_ref = per_token_group_quant_fp8_ref(x)
    expected = to_column_major(s_ref, tma_aligned=True)
    assert s.stride() == expected.stride()
    assert_bitwise_equal(s, expected)


# ---------------------------------------------------------------------------------------------
# Weight block quantization (torch)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (3, 128, 260)])
@pytest.mark.parametrize("round_scale", [False, True])
def test_per_block_quant(shape, round_scale):
    w = torch.randn(shape, dtype=torch.bfloat16) * 0.02
    q, s = per_block_quant_fp8(w, round_scale=round_scale)
    nb, kb = -(-shape[-2] // 128), -(-shape[-1] // 128)
    assert q.shape == w.shape and q.dtype == FP8_DTYPE
    assert s.shape == (*shape[:-2], nb, kb) and s.dtype == torch.float32
    # Block (0, 0) by hand, bitwise.
    blk = w[..., :128, :128].float()
    amax = blk.abs().amax(dim=(-2, -1)).clamp(min=1e-4)
    scale = amax / FP8_MAX
    if round_scale:
        scale = ceil_to_pow2(scale)
    assert_bitwise_equal(s[..., 0, 0], scale, "block scale")
    assert_bitwise_equal(q[..., :128, :128], (blk / scale[..., None, None]).to(FP8_DTYPE), "block bytes")
    deq = dequant_block_fp8(q, s)
    assert deq.shape == w.shape
    assert bool(((deq - w.float()).abs() <= w.float().abs() / 16 + 1e-6).all())


def test_per_block_quant_refuses_bad_input():
    with pytest.raises(TypeError):
        per_block_quant_fp8(torch.zeros(4, 4, dtype=torch.int8))
    with pytest.raises(ValueError):
        per_block_quant_fp8(torch.zeros(4))
    with pytest.raises(TypeError):
        dequant_block_fp8(torch.zeros(4, 4), torch.ones(1, 1))


# ---------------------------------------------------------------------------------------------
# Launch configuration (GPU path, evaluated without a GPU) and PDL gating
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("transpose_out", [False, True])
def test_gpu_config_invariants(monkeypatch, ue8m0, transpose_out):
    monkeypatch.setattr(quant_kernels, "_num_sms", lambda index: 132)
    cuda = torch.device("cuda", 0)  # never touched: only its type is read
    for m in (1, 3, 64, 128, 512, 4096, 16384):
        for k in (128, 384, 2048, 4096, 7168):
            g = k // 128
            for inputs in (1, 2):
                block_m, gpp, num_warps, stages, programs = quant_kernels.choose_config(
                    1, m, g, 128, ue8m0, transpose_out, cuda, interpret=False, inputs=inputs)
                assert block_m & (block_m - 1) == 0 and 4 <= block_m <= 64
                assert gpp & (gpp - 1) == 0 and gpp >= (4 if ue8m0 else 1)
                assert num_warps in (4, 8)
                tiles = triton.cdiv(m, block_m) * triton.cdiv(g, gpp)
                # decode: one program per tile in one wave; else persistent and pipelined
                if tiles <= quant_kernels.SINGLE_WAVE_PER_SM * 132:
                    assert (programs, stages) == (tiles, 1)
                else:
                    assert (programs, stages) == (quant_kernels.PROGRAMS_PER_SM[inputs] * 132, 3)
                if m >= 4096 and k >= 2048 and not transpose_out:
                    assert block_m == (16 if inputs == 1 else 8) and block_m * gpp * 128 >= 2048 and stages == 3


def test_pdl_gating_on_cpu():
    cpu = torch.device("cpu")
    assert not pdl_supported(cpu)
    assert pdl_launch_kwargs(True, cpu) == {"USE_PDL": False}
    assert pdl_launch_kwargs(False, cpu) == {"USE_PDL": False}
