"""Fused ``SiLU(gate) * up`` + per-token-group FP8 quantization: one pass between the expert GEMMs.

Input `[L, T, 2N]`: ``gate = x[..., :N]``, ``up = x[..., N:]`` (the first GEMM's output). The
product is formed in float32 and quantized directly (rounded to the input dtype first, SiLU and
product each, only with ``ROUND_PRODUCT`` in ``HAS_MASK``: SGLang's arithmetic; with ``BF16_MATH`` the scale
and the scaled values in bf16 too: vLLM's CUDA arithmetic), then
stored through :func:`moe_ep.kernels.quant.quantize_tile`, so every output layout option of the plain
quant kernel applies unchanged (TMA padding rows zeroed; masked rows, ``>= masked_m[l]``, neither
read nor written, their scales zeroed with ``ZERO_MASKED_SCALES``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_cast import native_e4m3_supported, round_bf16
from .pdl import pdl_launch_kwargs
from .quant import choose_config, mask_flags, num_tiles, quantize_tile, tile_coords, tile_operands, zero_scale_rows

__all__ = ["launch_silu_and_mul_quant"]


@triton.jit
def _round_to_input_dtype(y, DTYPE: tl.constexpr):
    """float32 ``y`` rounded to nearest-even in ``DTYPE`` (bf16, fp16 or fp32), as float32. BF16 by integer
    arithmetic on the bits: the interpreter's float32 -> bf16 cast truncates, the GPU's rounds."""
    if DTYPE == tl.bfloat16:
        return round_bf16(y)
    elif DTYPE == tl.float16:
        return y.to(tl.float16).to(tl.float32)
    else:
        return y


@triton.jit
def _silu_and_mul_quant_kernel(
    x_ptr, q_ptr, s_ptr, masked_m_ptr,
    L, T, G, W,
    stride_xl, stride_xt,  # the last dim of x is contiguous (the wrapper guarantees it)
    stride_ql, stride_qt, stride_qk,
    stride_sl, stride_st, stride_sg,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, GROUPS_PER_PROG: tl.constexpr,
    ROUND_SCALE: tl.constexpr, USE_UE8M0: tl.constexpr, HAS_MASK: tl.constexpr, NATIVE_FP8: tl.constexpr,
    USE_PDL: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    _, _, _, per_expert = tile_coords(0, T, G, stride_st, stride_sg, HAS_MASK, BLOCK_M, GROUPS_PER_PROG)
    # Persistent, as the plain quant (moe_ep.kernels.quant): the next tiles' loads are in flight meanwhile.
    for tile in tl.range(tl.program_id(0), L * per_expert, tl.num_programs(0), num_stages=NUM_STAGES):
        # Steps 1-2: which rows of this expert exist; gate and up tiles [BLOCK_M, GROUPS_PER_PROG, GROUP_SIZE]
        # (up starts N = G * GROUP_SIZE columns after gate in the same row).
        pid_l, pid_g, offs_t, num_rows, row_ok, x_off, mask = tile_operands(
            tile, masked_m_ptr, T, G, stride_xl, stride_xt, stride_st, stride_sg,
            HAS_MASK, BLOCK_M, GROUPS_PER_PROG, GROUP_SIZE)
        gate = tl.load(x_ptr + x_off, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + x_off + G * GROUP_SIZE, mask=mask, other=0.0).to(tl.float32)

        # Step 3: SiLU(gate) * up in float32: gate * sigmoid(gate). exp(-gate) overflows to inf for
        # gate < -88, so sigmoid is 0 and the product -0.0 (the float32 limit); for gate >= 17,
        # 1 + exp(-gate) rounds to 1 and SiLU(gate) is exactly gate. NOTES: compiled, exp is ex2.approx
        # and 1 / d is div.full (a few ulp, far below FP8's 3 mantissa bits); an IEEE division here
        # would double the ALU work of a kernel that must run at HBM speed.
        if (HAS_MASK & 16) != 0:  # ROUND_PRODUCT: SiLU(gate), then the product, rounded to x's dtype
            # SGLang's expression, term for term (gate / (1 + exp(-gate))); act * up is exact in float32
            # for 16-bit inputs, so rounding it once more is the 16-bit multiply.
            act = _round_to_input_dtype(gate / (1.0 + tl.exp(-gate)), x_ptr.dtype.element_ty)
            y = _round_to_input_dtype(act * up, x_ptr.dtype.element_ty)
        else:
            y = gate * (1.0 / (1.0 + tl.exp(-gate))) * up

        # Step 4: quantize and store.
        zero_row = zero_scale_rows(offs_t, num_rows, T, stride_st, stride_sg, HAS_MASK)
        quantize_tile(y, pid_l, pid_g, offs_t, row_ok, zero_row, G, W,
                      q_ptr, stride_ql, stride_qt, stride_qk, s_ptr, stride_sl, stride_st, stride_sg,
                      GROUP_SIZE, BLOCK_M, GROUPS_PER_PROG, ROUND_SCALE, USE_UE8M0, NATIVE_FP8, HAS_MASK)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


def launch_silu_and_mul_quant(x: torch.Tensor, q: torch.Tensor, q_strides: tuple[int, int, int],
                              scales: torch.Tensor, masked_m: torch.Tensor | None, group_size: int,
                              round_scale: bool, use_ue8m0: bool, transpose_out: bool,
                              use_pdl: bool, s_strides: tuple[int, int, int] | None = None,
                              zero_masked_scales: bool = False, keep_padding: bool = False,
                              recip_multiply: bool = False, round_product: bool = False,
                              bf16_math: bool = False, small_eps: bool = False) -> None:
    """Launch on validated 3D views: ``x`` `[L, T, 2N]` (last dim contiguous), ``q`` addressed through
    ``q_strides`` (element strides of its logical `[L, T, N]`), ``scales`` `[L, T, G or ceil(G / 4)]`."""
    L, T, two_n = x.shape
    G = two_n // 2 // group_size
    W = scales.shape[-1] if use_ue8m0 else 0
    s_strides = tuple(scales.stride()) if s_strides is None else tuple(s_strides)
    # Column-major scales padded past T (TMA): the tiles cover the padding rows too (their scales are stored
    # as zeros, see zero_scale_rows).
    cfg = choose_config(L, T, G, group_size, use_ue8m0, transpose_out, x.device, inputs=2,
                        tiles_for=lambda bm, gp: num_tiles(L, T, G, bm, gp, s_strides, keep_padding))
    _silu_and_mul_quant_kernel[(cfg.programs,)](
        x, q.view(torch.uint8), scales, masked_m if masked_m is not None else x,
        L, T, G, W,
        x.stride(0), x.stride(1),
        *q_strides,
        *s_strides,
        GROUP_SIZE=group_size, BLOCK_M=cfg.block_m, GROUPS_PER_PROG=cfg.gpp,
        ROUND_SCALE=round_scale or use_ue8m0, USE_UE8M0=use_ue8m0,
        HAS_MASK=mask_flags(masked_m is not None, zero_masked_scales, keep_padding, recip_multiply, round_product,
                            bf16_math, small_eps),
        NATIVE_FP8=native_e4m3_supported(x.device), NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps,
        **pdl_launch_kwargs(use_pdl, x.device),
    )
