"""Per-token-group FP8 quantization kernels (1 x GROUP_SIZE groups along the last dim).

The unit of work is a tile of ``BLOCK_M`` rows x ``GROUPS_PER_PROG`` groups of one expert (``L`` experts;
1 for 2D input). The grid is persistent (:func:`choose_config`: as many programs as stay resident, at most
one per tile); program ``p`` takes tiles ``p, p + P, ...`` with the group block the fastest index, so the
programs running at once stream through consecutive columns of the same rows, and with ``NUM_STAGES >= 2``
``tl.range`` turns the next tiles' loads into ``cp.async`` prefetches while one tile is quantized (decode
shapes, one tile per program, load directly). Each tile's FP8 bytes and scales go straight into the layout
the consumer reads:

- FP8 out: any strides; ``transpose_out`` is just strides ``(.., 1, T)`` for the `[.., K, T]` tensor.
- float32 scales `[L, T, G]`: row-major, column-major (T stride 1) or column-major with the column
  stride padded to a multiple of 4 (TMA): again just strides, so no transpose kernel ever runs.
- UE8M0 scales `[L, T, ceil(G / 4)]` int32: four biased exponents per word, group ``g`` in bits
  ``8 * (g % 4)``; the program packs whole words, so ``GROUPS_PER_PROG`` is a multiple of 4 and the
  padding groups of the last word are zero (like ``moe_ep.fp8.pack_ue8m0``).

Numerics come from :mod:`moe_ep.kernels.fp8_cast` (shared with every quantizing kernel) and equal
``moe_ep.fp8.per_token_group_quant_fp8_ref`` bitwise: float32 amax (NaN propagates), IEEE division
for the scale and IEEE ``x / scale`` (one reciprocal per group and a two-FMA correction,
:func:`moe_ep.kernels.fp8_cast.div_by_scale`; a multiply by the exact reciprocal for power-of-two scales),
round-to-nearest-even onto the e4m3 grid (hardware cvt on sm90+, integer arithmetic elsewhere).

Masked 3D input: rows at or past ``masked_m[l]`` (clamped to [0, T]) are neither loaded nor stored,
except, with ``ZERO_MASKED_SCALES`` in ``HAS_MASK``, their scales, stored as zeros.

TMA-aligned scales (column-major, column stride ``ceil4(T) > T``): the programs of the last row block
also store zeros into the padding rows ``T .. ceil4(T) - 1`` of every column (unless ``KEEP_PADDING``),
so the storage the GEMM's TMA box reads holds no garbage, at no extra launch or memset.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .fp8_cast import (div_by_scale, div_by_scale_approx, e4m3_byte, group_scale, native_e4m3_supported,
                       quantize_bf16_math)
from .pdl import INTERPRET, pdl_launch_kwargs

__all__ = ["BF16_MATH", "KEEP_PADDING", "MASK_ROWS", "POW2_FLOOR", "RECIP_MULTIPLY", "ROUND_PRODUCT", "SMALL_EPS",
           "ZERO_MASKED_SCALES",
           "QuantConfig", "choose_config",
           "launch_per_token_group_quant", "mask_flags", "num_tiles", "quantize_tile", "tile_coords", "tile_operands",
           "zero_scale_rows"]


@triton.jit
def quantize_tile(
    y,  # float32 [BLOCK_M, GROUPS_PER_PROG, GROUP_SIZE]
    pid_l, pid_g, offs_t, row_ok,  # expert, group block, [BLOCK_M] row indices and their validity
    zero_row,  # [BLOCK_M]: rows (never row_ok) whose scales are stored as 0 (TMA padding, masked rows)
    G, W,  # groups per row, int32 words per row of UE8M0 scales
    q_ptr, stride_ql, stride_qt, stride_qk,
    s_ptr, stride_sl, stride_st, stride_sg,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, GROUPS_PER_PROG: tl.constexpr,
    ROUND_SCALE: tl.constexpr, USE_UE8M0: tl.constexpr, NATIVE_FP8: tl.constexpr, HAS_MASK: tl.constexpr,
):
    """Quantize one float32 tile and store its e4m3 bytes (``q_ptr`` is a uint8 view) and scales.

    From the launch's ``HAS_MASK`` bits (below): ``RECIP_MULTIPLY`` (8), ``y * (1 / scale)`` instead of
    ``y / scale`` (not bitwise: measuring only); ``BF16_MATH`` (32),
    :func:`~moe_ep.kernels.fp8_cast.quantize_bf16_math` (``y`` holds bf16 values); ``SMALL_EPS`` (64), amax
    floored at 1e-10 instead of 1e-4; ``POW2_FLOOR`` (128), a power-of-two scale floored at 1e-10 before its
    rounding."""
    offs_g = pid_g * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)
    offs_c = tl.arange(0, GROUP_SIZE)
    group_ok = offs_g < G
    rows64 = offs_t.to(tl.int64)
    l64 = pid_l.to(tl.int64)

    # Step 1: per-group amax -> scale -> e4m3 bytes.
    # NOTES: tl.max on floats ignores NaN (maxnum) but the reference's amax keeps it. |y|'s bit
    # pattern orders like its value as int32, and every NaN sorts above inf, so an integer max keeps
    # NaN on every backend (and stays a vectorised numpy max in the interpreter, unlike tl.reduce
    # with a custom combine function, which loops in Python).
    abs_bits = y.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    amax = tl.max(abs_bits, axis=2).to(tl.float32, bitcast=True)  # [BLOCK_M, GROUPS_PER_PROG]
    if (HAS_MASK & 32) != 0:  # BF16_MATH
        q, scale = quantize_bf16_math(y, amax, ROUND_SCALE)
    else:
        scale = group_scale(amax, ROUND_SCALE, (HAS_MASK & 64) != 0, (HAS_MASK & 128) != 0)  # SMALL_EPS, POW2_FLOOR
        if ROUND_SCALE:
            # 1 / 2^k is exact, and y * 2^-k rounds exactly like y / 2^k: same bits as the reference's
            # division at one multiply per value.
            q = y * tl.math.div_rn(1.0, scale)[:, :, None]
        elif (HAS_MASK & 8) != 0:  # RECIP_MULTIPLY
            q = div_by_scale_approx(y, scale)
        else:
            q = div_by_scale(y, scale)  # IEEE y / scale, one division per group
    byte = e4m3_byte(q, NATIVE_FP8)

    # Step 2: FP8 bytes. Column index k = g * GROUP_SIZE + c; with transpose_out stride_qt is 1.
    cols = (offs_g[None, :, None] * GROUP_SIZE + offs_c[None, None, :]).to(tl.int64)
    q_off = l64 * stride_ql + rows64[:, None, None] * stride_qt + cols * stride_qk
    tl.store(q_ptr + q_off, byte, mask=row_ok[:, None, None] & group_ok[None, :, None])

    # Step 3: scales, in whatever layout the strides describe (row- or column-major, TMA-padded).
    if USE_UE8M0:
        # Groups 4w..4w+3 form word w: split the [BLOCK_M, GROUPS_PER_PROG] exponents into four
        # [BLOCK_M, GROUPS_PER_PROG // 4] planes (j = 2a + b after the reshape) and OR them together.
        # Padding groups (g >= G) pack as zero bytes, like pack_ue8m0.
        exps = (scale.to(tl.int32, bitcast=True) >> 23) & 0xFF
        exps = tl.where(group_ok[None, :] & row_ok[:, None], exps, 0)
        exps = tl.reshape(exps, [BLOCK_M, GROUPS_PER_PROG // 4, 2, 2])
        even, odd = tl.split(exps)  # j in {0, 2}, j in {1, 3}
        e0, e2 = tl.split(even)
        e1, e3 = tl.split(odd)
        words = e0 | (e1 << 8) | (e2 << 16) | (e3 << 24)  # [BLOCK_M, GROUPS_PER_PROG // 4]
        offs_w = pid_g * (GROUPS_PER_PROG // 4) + tl.arange(0, GROUPS_PER_PROG // 4)
        s_off = l64 * stride_sl + rows64[:, None] * stride_st + offs_w[None, :] * stride_sg
        tl.store(s_ptr + s_off, words, mask=(row_ok | zero_row)[:, None] & (offs_w < W)[None, :])
    else:
        s_off = l64 * stride_sl + rows64[:, None] * stride_st + offs_g[None, :] * stride_sg
        tl.store(s_ptr + s_off, tl.where(zero_row[:, None], 0.0, scale),
                 mask=(row_ok | zero_row)[:, None] & group_ok[None, :])


# ``HAS_MASK`` is a constexpr bit set (a bool is fine: True == MASK_ROWS): the kernels' argument list is
# what the sm90 compile checks and perf/sm90_report.py build their signatures from, so new options ride
# on it instead of adding arguments. (The jit code spells the bits as literals: plain int globals are
# not constexprs there.)
MASK_ROWS = 1  # masked_m_ptr holds masked_m: rows >= masked_m[l] are neither read nor FP8-written
ZERO_MASKED_SCALES = 2  # ... and their scales are stored as zeros (zero_masked_scales=True)
KEEP_PADDING = 4  # leave the TMA padding rows alone (caller storage that ends at the last valid row)
RECIP_MULTIPLY = 8  # y * (1 / scale): one rounding more than IEEE y / scale (not bitwise; a bench row only)
ROUND_PRODUCT = 16  # SiLU quant: SiLU(gate) and SiLU(gate) * up rounded to x's dtype first (SGLang's arithmetic)
BF16_MATH = 32  # SiLU quant: ROUND_PRODUCT, then the scale and the scaled values in bf16 (vLLM's CUDA arithmetic)
SMALL_EPS = 64  # amax floored at 1e-10 (vLLM's and SGLang's eps) instead of 1e-4 (DeepGEMM's)
POW2_FLOOR = 128  # power-of-two scales floored at 1e-10 before the rounding (vLLM's kernels; matters with SMALL_EPS)


@triton.jit
def zero_scale_rows(offs_t, num_rows, T, stride_st, stride_sg, HAS_MASK: tl.constexpr):
    """``[BLOCK_M]`` mask of the rows whose scales are stored as zeros (never a valid row).

    TMA padding: column-major scales (``stride_st == 1``) whose column stride exceeds ``T`` have
    rows ``T .. stride_sg - 1`` in every column; the wrapper passes the layout's canonical strides
    and sets ``KEEP_PADDING`` where the storage does not hold them. With ``ZERO_MASKED_SCALES`` the
    masked rows ``num_rows .. T - 1`` too. A few scalar ops and one select on the scale tile: the
    zeros ride on the scale stores the program issues anyway.
    """
    pad_end = T
    if (HAS_MASK & 4) == 0:  # not KEEP_PADDING
        if stride_st == 1:
            pad_end = tl.maximum(stride_sg, T)
    zero_from = T
    if (HAS_MASK & 2) != 0:  # ZERO_MASKED_SCALES
        zero_from = num_rows
    return (offs_t >= zero_from) & (offs_t < pad_end)


def mask_flags(has_mask: bool, zero_masked_scales: bool, keep_padding: bool, recip_multiply: bool = False,
               round_product: bool = False, bf16_math: bool = False, small_eps: bool = False,
               pow2_floor: bool = False) -> int:
    """The ``HAS_MASK`` constexpr for a launch."""
    flags = MASK_ROWS if has_mask else 0
    if has_mask and zero_masked_scales:
        flags |= ZERO_MASKED_SCALES
    return (flags | (KEEP_PADDING if keep_padding else 0) | (RECIP_MULTIPLY if recip_multiply else 0)
            | (ROUND_PRODUCT if round_product or bf16_math else 0) | (BF16_MATH if bf16_math else 0)
            | (SMALL_EPS if small_eps else 0) | (POW2_FLOOR if pow2_floor else 0))


@triton.jit
def tile_coords(tile, T, G, stride_st, stride_sg, HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr,
                GROUPS_PER_PROG: tl.constexpr):
    """``(pid_l, pid_t, pid_g)`` of persistent tile ``tile``, and the tile count per expert: the group block
    is the fastest index, so the programs running at once walk consecutive columns of the same rows (one
    stream through memory), and the row blocks cover the TMA padding rows ``zero_scale_rows`` zeroes."""
    rows = T
    if (HAS_MASK & 4) == 0:  # not KEEP_PADDING
        if stride_st == 1:
            rows = tl.maximum(stride_sg, T)
    gb = tl.cdiv(G, GROUPS_PER_PROG)
    rb = tl.cdiv(rows, BLOCK_M)
    pid_g = tile % gb
    rest = tile // gb
    return rest // rb, rest % rb, pid_g, rb * gb


@triton.jit
def tile_operands(tile, masked_m_ptr, T, G, stride_xl, stride_xt, stride_st, stride_sg,
                  HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr, GROUPS_PER_PROG: tl.constexpr,
                  GROUP_SIZE: tl.constexpr):
    """Where persistent tile ``tile`` reads: ``(pid_l, pid_g, offs_t, num_rows, row_ok, x_off, mask)``, with
    ``num_rows`` the expert's rows (``masked_m`` clamped to ``[0, T]`` when rows are masked) and ``x_off`` /
    ``mask`` the element offsets and load mask of its ``[BLOCK_M, GROUPS_PER_PROG, GROUP_SIZE]`` input tile."""
    pid_l, pid_t, pid_g, _ = tile_coords(tile, T, G, stride_st, stride_sg, HAS_MASK, BLOCK_M, GROUPS_PER_PROG)
    num_rows = T
    if (HAS_MASK & 1) != 0:  # MASK_ROWS
        num_rows = tl.maximum(tl.minimum(tl.load(masked_m_ptr + pid_l), T), 0).to(tl.int32)  # clamp first
    offs_t = pid_t * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_t < num_rows
    offs_g = pid_g * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)
    cols = offs_g[None, :, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, None, :]
    x_off = pid_l.to(tl.int64) * stride_xl + offs_t.to(tl.int64)[:, None, None] * stride_xt + cols
    mask = row_ok[:, None, None] & (offs_g < G)[None, :, None]
    return pid_l, pid_g, offs_t, num_rows, row_ok, x_off, mask


def num_tiles(L: int, T: int, G: int, block_m: int, gpp: int, s_strides, keep_padding: bool) -> int:
    """Host twin of :func:`tile_coords`' count, times ``L``."""
    rows = max(T, s_strides[2]) if s_strides[1] == 1 and not keep_padding else T
    return L * triton.cdiv(rows, block_m) * triton.cdiv(G, gpp)


@triton.jit
def _per_token_group_quant_kernel(
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
        # NOTES: x and masked_m may be the previous kernel's output: wait before the first read.
        tl.extra.cuda.gdc_wait()
    _, _, _, per_expert = tile_coords(0, T, G, stride_st, stride_sg, HAS_MASK, BLOCK_M, GROUPS_PER_PROG)
    # Persistent: with NUM_STAGES >= 2 the next tiles' loads are in flight (cp.async) while one is quantized.
    for tile in tl.range(tl.program_id(0), L * per_expert, tl.num_programs(0), num_stages=NUM_STAGES):
        # Steps 1-2: which rows of this expert exist; load the [BLOCK_M, GROUPS_PER_PROG, GROUP_SIZE] tile (rows
        # past masked_m never load).
        pid_l, pid_g, offs_t, num_rows, row_ok, x_off, mask = tile_operands(
            tile, masked_m_ptr, T, G, stride_xl, stride_xt, stride_st, stride_sg,
            HAS_MASK, BLOCK_M, GROUPS_PER_PROG, GROUP_SIZE)
        y = tl.load(x_ptr + x_off, mask=mask, other=0.0).to(tl.float32)

        # Step 3: quantize and store.
        zero_row = zero_scale_rows(offs_t, num_rows, T, stride_st, stride_sg, HAS_MASK)
        quantize_tile(y, pid_l, pid_g, offs_t, row_ok, zero_row, G, W,
                      q_ptr, stride_ql, stride_qt, stride_qk, s_ptr, stride_sl, stride_st, stride_sg,
                      GROUP_SIZE, BLOCK_M, GROUPS_PER_PROG, ROUND_SCALE, USE_UE8M0, NATIVE_FP8, HAS_MASK)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


class QuantConfig(NamedTuple):
    """A launch of the quant kernels: tile ``BLOCK_M x GROUPS_PER_PROG`` groups, ``num_warps``, the loop's
    ``NUM_STAGES`` (>= 2: the next tiles' loads are cp.async prefetches) and ``programs`` (the persistent grid)."""

    block_m: int
    gpp: int
    num_warps: int
    num_stages: int
    programs: int


# Persistent programs per SM (``inputs`` -> programs): what stays resident on an H100 with the sm90 compile of
# the pipelined loop under Triton 3.6 and 3.9 (perf/sm90_report.py: quant 16 x 4 x 128 tiles, 8 warps, 80-116
# registers, 33 KB shared; SiLU quant 8 x 4 x 128 tiles of gate and up, 54-91 registers, 33 KB): 2 CTAs, i.e.
# 4 prefetched 16 KB tiles in flight per SM while 2 are quantized.
PROGRAMS_PER_SM = {1: 2, 2: 2}
# Up to this many tiles per SM, one program per tile (no loop, no pipelining): the unpipelined decode programs
# (<= 4 warps, <= 64 registers) all fit on the SMs at once.
SINGLE_WAVE_PER_SM = 4


def choose_config(L: int, T: int, G: int, group_size: int, use_ue8m0: bool, transpose_out: bool,
                  device: torch.device, interpret: bool = INTERPRET, inputs: int = 1,
                  tiles_for=None) -> QuantConfig:
    """The launch over `[L, T, G]` groups; ``inputs``: tiles loaded per tile (2 for the SiLU quant's gate and
    up); ``tiles_for(block_m, gpp)``: the tile count (default ``L * ceil(T / block_m) * ceil(G / gpp)``; the
    TMA padding rows add row blocks)."""
    min_gpp = 4 if use_ue8m0 else 1  # UE8M0 programs pack whole int32 words
    max_gpp = max(triton.next_power_of_2(G), min_gpp)
    t_pow2 = triton.next_power_of_2(max(T, 1))

    def tiles(bm: int, gp: int) -> int:
        return tiles_for(bm, gp) if tiles_for is not None else L * triton.cdiv(T, bm) * triton.cdiv(G, gp)

    if interpret or device.type != "cuda":
        # Interpreter: every program instance costs ~0.6 ms of Python, so use a few big ones, one tile each.
        bm, gp = min(t_pow2, 64), max_gpp
        return QuantConfig(bm, gp, 4, 1, tiles(bm, gp))
    # GPU: ~8K elements (16 KB of BF16) per tile; 16+ rows so column-major scale stores and transposed FP8
    # stores coalesce, several groups per row block for long contiguous loads.
    if transpose_out:
        # 32-64 rows give 32-64 contiguous bytes per column of the [K, M] FP8 output.
        block_m, gpp = 64 // min_gpp * 2 if use_ue8m0 else 64, min_gpp
    else:
        block_m, gpp = 16, max(min_gpp, min(max(4 * 128 // group_size, 1), max_gpp))
    block_m = max(min(block_m, t_pow2), 4)
    # Small batches (decode): split finer until there are tiles for twice the SMs.
    num_sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    while gpp > min_gpp and tiles(block_m, gpp) < 2 * num_sms:
        gpp //= 2
    while block_m > 4 and not transpose_out and tiles(block_m, gpp) < 2 * num_sms:
        block_m //= 2
    num_warps = 8 if block_m * gpp * group_size >= 8192 else 4
    n = tiles(block_m, gpp)
    if n <= SINGLE_WAVE_PER_SM * num_sms:
        # Decode: one tile per program, all resident in one wave, plain loads (a cp.async stage would only add
        # a trip through shared memory to the latency).
        return QuantConfig(block_m, gpp, num_warps, 1, n)
    if inputs == 2 and not transpose_out and block_m * gpp * group_size >= 8192:
        # Gate and up: half the rows, so that 3 stages of both tiles fit in registers without spilling.
        block_m, num_warps = block_m // 2, 8
        n = tiles(block_m, gpp)
    return QuantConfig(block_m, gpp, num_warps, 3, min(n, PROGRAMS_PER_SM.get(inputs, 2) * num_sms))


def launch_per_token_group_quant(x: torch.Tensor, q: torch.Tensor, q_strides: tuple[int, int, int],
                                 scales: torch.Tensor, masked_m: torch.Tensor | None, group_size: int,
                                 round_scale: bool, use_ue8m0: bool, transpose_out: bool,
                                 use_pdl: bool, s_strides: tuple[int, int, int] | None = None,
                                 zero_masked_scales: bool = False, keep_padding: bool = False,
                                 recip_multiply: bool = False, small_eps: bool = False,
                                 pow2_floor: bool = False) -> None:
    """Launch on validated 3D views: ``x`` `[L, T, K]` (last dim contiguous), ``q`` the FP8 output
    (any shape, addressed through ``q_strides`` = element strides of its logical `[L, T, K]`),
    ``scales`` `[L, T, G]` float32 or `[L, T, ceil(G / 4)]` int32 with any strides. ``recip_multiply``:
    ``x * (1 / scale)`` (not bitwise; for measuring the price of the exact quotient only)."""
    L, T, K = x.shape
    G = K // group_size
    W = scales.shape[-1] if use_ue8m0 else 0
    s_strides = tuple(scales.stride()) if s_strides is None else tuple(s_strides)
    # Column-major scales padded past T (TMA): the tiles cover the padding rows too (their scales are stored
    # as zeros, see zero_scale_rows).
    cfg = choose_config(L, T, G, group_size, use_ue8m0, transpose_out, x.device,
                        tiles_for=lambda bm, gp: num_tiles(L, T, G, bm, gp, s_strides, keep_padding))
    _per_token_group_quant_kernel[(cfg.programs,)](
        x, q.view(torch.uint8), scales, masked_m if masked_m is not None else x,
        L, T, G, W,
        x.stride(0), x.stride(1),
        *q_strides,
        *s_strides,
        GROUP_SIZE=group_size, BLOCK_M=cfg.block_m, GROUPS_PER_PROG=cfg.gpp,
        ROUND_SCALE=round_scale or use_ue8m0, USE_UE8M0=use_ue8m0,
        HAS_MASK=mask_flags(masked_m is not None, zero_masked_scales, keep_padding, recip_multiply,
                            small_eps=small_eps, pow2_floor=pow2_floor),
        NATIVE_FP8=native_e4m3_supported(x.device),
        NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps, **pdl_launch_kwargs(use_pdl, x.device),
    )
