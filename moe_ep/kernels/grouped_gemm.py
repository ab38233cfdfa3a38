"""Grouped (and dense) GEMMs: FP8 with 1x128 activation scales and 128x128 weight scales (DeepGEMM's sm90
recipe), or BF16 without scales. A leaf module: it imports nothing from its host (:mod:`moe_ep.gemm`).

One kernel, four row layouts (the ``LAYOUT`` constexpr):

- ``CONTIG`` (prefill, ``m_indices``): ``a`` `[M, K]` holds every expert's rows back to back in blocks
  aligned to the contiguous-layout alignment; ``layout[M]`` names each row's expert (-1 on padding rows,
  written as zeros). A tile reads the expert of its rows, so tiles never straddle two experts (BLOCK_M
  divides the alignment).
- ``PSUM`` (prefill, DeepGEMM's ``use_psum_layout=True``): ``layout[G]`` holds each expert's end row; expert
  ``g``'s rows are ``[align(layout[g-1], ALIGN), layout[g])`` (``0`` for ``g = 0``). A tile finds its expert
  by counting the aligned ends at or before its first row. Rows between an end and the next aligned start,
  and rows past the last expert, are padding: zeros with ``ZERO_PAD``, left untouched without.
- ``MASKED`` (decode): ``a`` `[G, T, K]` is the low-latency receive layout; ``layout[G]`` valid rows per
  expert, read on the device. Tiles past ``layout[g]`` compute nothing; rows past it are not written.
- ``DENSE``: one group, every row valid (``fp8_gemm_nt`` / ``bf16_gemm_nt``); ``ACCUMULATE`` adds the
  float32 ``d`` already there (DeepGEMM's ``c``, copied into ``d`` by the host).

Persistent grid: program ``p`` of ``P`` takes tiles ``p, p + P, ...`` (``P`` = the launch's grid, capped by
the host at the SM count the GEMMs may use); with one program per tile the loop runs once.

Numerics (FP8): per 128-wide K block, the FP8 dot product is accumulated in float32 by the MMA, then scaled
by ``sfa[row, kb] * sfb[g, n // SFB_GRAN_N, kb]`` (``SFB_GRAN_N`` 128: 128x128 weight scales; 1: DeepGEMM's
wgrad recipe ``(1, 1, 128)``, 1x128 scales on both operands) and added to a float32 accumulator (DeepGEMM's "promotion"
every 128 K: Hopper's FP8 MMA accumulates with fewer bits than float32, so long K chains are never
left inside the MMA). BF16 (``AB_BF16``): the MMA accumulates into the float32 accumulator directly. The
output is cast once, at the end. Operand strides along K are arguments (1 for the K-major layouts the
DeepGEMM ``nt`` names take: specialised as a constant at launch), so the ``nn`` / ``tn`` / ``tt`` names
pass transposed views.

``SWAP_AB`` (small M): the MMA's M dimension must be 64 rows for wgmma; with 16-64 tokens per expert
the kernel computes ``D^T = B A^T`` instead (weights as the 128-row M operand, tokens as the narrow
N operand) and stores the tile transposed.

PDL: with ``USE_PDL`` the kernel first prefetches its first tile's first ``PREFETCH_K`` weight K blocks into
L2 (``prefetch.global.L2``, one per 128-byte row segment), then ``griddepcontrol.wait``: nothing the
previous kernel writes (``a``, ``sfa``, ``layout``) is read before the wait. In the masked layout the
expert follows from the tile index, so the prefetch is exact; in the contiguous layouts the expert comes
from ``layout`` (written by the previous kernel), so the prefetch takes the expert a balanced layout
would give this row block (``pid_m * G // num_pid_m``): right in the common case, one wasted L2 fill per
program otherwise.

Bad routing data cannot be raised from the device, so it is made visible: a row whose ``m_indices``
entry is ``>= G``, or differs from the first row of its tile, is written as NaN.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .low_latency_common import _bf16_bits
from .pdl import INTERPRET

__all__ = ["grouped_fp8_gemm_kernel", "grouped_gemm_kernel", "prefetch_l2", "CONTIG", "MASKED", "PSUM", "DENSE"]

OUT_FP32 = tl.constexpr(0)
OUT_BF16 = tl.constexpr(1)
OUT_BF16_BITS = tl.constexpr(2)  # bf16 rounded in integers, stored through an int16 view (interpreter)

CONTIG = tl.constexpr(0)
MASKED = tl.constexpr(1)
PSUM = tl.constexpr(2)
DENSE = tl.constexpr(3)

PSUM_CHUNK = tl.constexpr(128)
# NOTES: Triton 3.9's interpreter multiplies BF16 tl.dot operands wrongly (garbage magnitudes); there the BF16
# operands are widened to float32 first (exact products either way). Compiled code keeps the BF16 MMA.
BF16_DOT_F32 = tl.constexpr(INTERPRET)  # psum entries read per step when a tile looks for its expert


@triton.jit
def prefetch_l2(ptrs):
    """``prefetch.global.L2`` on each address of ``ptrs`` (compiled CUDA only: never call it under the
    interpreter). The asm has a dummy output because Triton's inline asm needs one; ``is_pure=False``
    keeps it alive although the result is unused."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _sfa_column(sfa_ptr, row_off, row_ok, kb, stride_sak, SFA_UE8M0: tl.constexpr):
    """Activation scales of K block ``kb`` for the rows at ``row_off`` (float32; 0 where not ``row_ok``)."""
    if SFA_UE8M0:
        word = tl.load(sfa_ptr + row_off + (kb // 4) * stride_sak, mask=row_ok, other=0)
        exp = (word >> ((kb % 4) * 8)) & 0xFF
        return (exp << 23).to(tl.float32, bitcast=True)
    else:
        return tl.load(sfa_ptr + row_off + kb * stride_sak, mask=row_ok, other=0.0)


@triton.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of ``tile`` in the swizzled order: GROUP_M row blocks share each column block's
    weights while they are in L2."""
    width = GROUP_M * num_pid_n
    first_m = (tile // width) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % width) % group_rows
    pid_n = (tile % width) // group_rows
    return pid_m, pid_n


@triton.jit
def grouped_fp8_gemm_kernel(
    a_ptr, sfa_ptr, b_ptr, sfb_ptr, d_ptr, layout_ptr,
    M, N, K, G, ALIGN,  # M: total rows (contiguous, psum, dense) or rows per expert T (masked)
    stride_ag, stride_am, stride_ak,  # a: [G?, M, K]
    stride_sag, stride_sam, stride_sak,  # sfa: [G?, M, K/128] float32 or [G?, M, ceil(K/512)] int32
    stride_bg, stride_bn, stride_bk,  # b: [G, N, K]
    stride_sbg, stride_sbn, stride_sbk,  # sfb: [G, ceil(N/SFB_GRAN_N), K/128] float32
    stride_dg, stride_dm,  # d: [G?, M, N], N contiguous
    LAYOUT: tl.constexpr, SWAP_AB: tl.constexpr, SFA_UE8M0: tl.constexpr, OUT_MODE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    USE_PDL: tl.constexpr, PREFETCH_K: tl.constexpr,
    AB_BF16: tl.constexpr = False, EVEN_K: tl.constexpr = True, ZERO_PAD: tl.constexpr = True,
    ACCUMULATE: tl.constexpr = False, SFB_GRAN_N: tl.constexpr = 128,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    tiles_per_group = num_pid_m * num_pid_n
    if LAYOUT == MASKED:
        num_tiles = tiles_per_group * G
    else:
        num_tiles = tiles_per_group
    offs_k = tl.arange(0, BLOCK_K)

    # Step 1 (PDL only): prefetch the first tile's static weights, then wait for the previous kernel's outputs.
    if USE_PDL:
        pm0, pn0 = _tile_coords(pid % tiles_per_group, num_pid_m, num_pid_n, GROUP_M)
        if LAYOUT == MASKED:
            g_guess = pid // tiles_per_group
        elif LAYOUT == DENSE:
            g_guess = pid * 0
        else:
            g_guess = (pm0 * G) // num_pid_m
        offs_n0 = pn0 * BLOCK_N + tl.arange(0, BLOCK_N)
        row_base = b_ptr + g_guess.to(tl.int64) * stride_bg + offs_n0.to(tl.int64) * stride_bn
        for pk in tl.static_range(PREFETCH_K):
            prefetch_l2(row_base + pk * BLOCK_K * stride_bk)
        tl.extra.cuda.gdc_wait()

    for tile in range(pid, num_tiles, nprog):
        # Step 2: tile coordinates.
        pid_m, pid_n = _tile_coords(tile % tiles_per_group, num_pid_m, num_pid_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        in_range = offs_m < M

        # Step 3: which expert, which rows.
        row_bad = offs_m < 0  # all False (contiguous m_indices only)
        if LAYOUT == MASKED:
            g = tile // tiles_per_group
            # clamp in the loaded dtype first: an int64 count above 2**31 must not wrap before the clamp
            num_rows = tl.maximum(tl.minimum(tl.load(layout_ptr + g), M), 0).to(tl.int32)
            row_ok = offs_m < num_rows
        elif LAYOUT == CONTIG:
            expert = tl.load(layout_ptr + offs_m, mask=in_range, other=-1)
            # The tile's expert is its first row's (padding only follows valid rows); a tile that starts
            # with padding takes the largest in-range index it holds (none: an all-padding tile).
            first = tl.load(layout_ptr + pid_m * BLOCK_M)
            g = tl.max(tl.where(expert < G, expert, -1), axis=0)
            g = tl.where((first >= 0) & (first < G), first, g)
            row_ok = in_range & (expert >= 0) & (expert == g)
            row_bad = in_range & (expert >= 0) & (expert != g)
            g = tl.maximum(g, 0)  # an all-padding tile computes nothing useful but stays in bounds
        elif LAYOUT == PSUM:
            # Expert of the tile: how many experts' aligned ends lie at or before its first row.
            r0 = pid_m * BLOCK_M
            g = r0 * 0
            for i0 in range(0, G, PSUM_CHUNK):
                offs_g = i0 + tl.arange(0, PSUM_CHUNK)
                ends = tl.load(layout_ptr + offs_g, mask=offs_g < G, other=0)
                aligned = (ends + ALIGN - 1) // ALIGN * ALIGN
                g += tl.sum(((offs_g < G) & (aligned <= r0)).to(tl.int32), axis=0)
            end = tl.load(layout_ptr + tl.minimum(g, G - 1))
            # NOTES: g broadcast to the rows before the compare (the interpreter rejects a scalar-and-vector mask)
            row_ok = in_range & (offs_m < end) & ((offs_m * 0 + g) < G)
            g = tl.minimum(g, G - 1)
        else:
            g = pid_m * 0
            row_ok = in_range
        g64 = g.to(tl.int64)
        # a, sfa and d carry the expert as their leading dim only in the masked layout.
        if LAYOUT == MASKED:
            batch = g64
        else:
            batch = g64 * 0

        # Step 4: K loop. FP8: one MMA per 128-wide K block, promoted to the float32 accumulator with scales.
        a_rows = a_ptr + batch * stride_ag + offs_m.to(tl.int64) * stride_am
        b_rows = b_ptr + g64 * stride_bg + offs_n.to(tl.int64) * stride_bn
        sfa_rows = batch * stride_sag + offs_m.to(tl.int64) * stride_sam
        sfb_rows = sfb_ptr + g64 * stride_sbg + (offs_n // SFB_GRAN_N) * stride_sbn
        if SWAP_AB:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        num_kb = tl.cdiv(K, BLOCK_K)
        if LAYOUT != DENSE:
            # A tile without valid rows (padding, an empty expert, past masked_m) skips the MMAs.
            num_kb = tl.where(tl.max(row_ok.to(tl.int32), axis=0) > 0, num_kb, 0)
        for kb in range(0, num_kb):
            k_idx = kb * BLOCK_K + offs_k
            if EVEN_K:
                a_mask = row_ok[:, None]
                b_mask = n_ok[:, None]
            else:
                a_mask = row_ok[:, None] & (k_idx < K)[None, :]
                b_mask = n_ok[:, None] & (k_idx < K)[None, :]
            a = tl.load(a_rows[:, None] + k_idx[None, :] * stride_ak, mask=a_mask, other=0.0)
            b = tl.load(b_rows[:, None] + k_idx[None, :] * stride_bk, mask=b_mask, other=0.0)
            if AB_BF16:
                if BF16_DOT_F32:
                    a = a.to(tl.float32)
                    b = b.to(tl.float32)
                if SWAP_AB:
                    acc = tl.dot(b, tl.trans(a), acc)
                else:
                    acc = tl.dot(a, tl.trans(b), acc)
            else:
                sa = _sfa_column(sfa_ptr, sfa_rows, row_ok, kb, stride_sak, SFA_UE8M0)
                sb = tl.load(sfb_rows + kb * stride_sbk, mask=n_ok, other=0.0)
                if SWAP_AB:
                    part = tl.dot(b, tl.trans(a))
                    acc += part * sb[:, None] * sa[None, :]
                else:
                    part = tl.dot(a, tl.trans(b))
                    acc += part * sa[:, None] * sb[None, :]
        if SWAP_AB:
            acc = tl.trans(acc)

        # Step 5: store. m_indices padding rows are written as zeros, inconsistent rows as NaN; psum padding
        # as zeros with ZERO_PAD (else untouched); masked rows past masked_m are left untouched.
        if LAYOUT == CONTIG:
            acc = tl.where(row_ok[:, None], acc, 0.0)
            acc = tl.where(row_bad[:, None], float("nan"), acc)
            store_ok = in_range[:, None] & n_ok[None, :]
        elif LAYOUT == PSUM:
            acc = tl.where(row_ok[:, None], acc, 0.0)
            if ZERO_PAD:
                store_ok = in_range[:, None] & n_ok[None, :]
            else:
                store_ok = row_ok[:, None] & n_ok[None, :]
        else:
            store_ok = row_ok[:, None] & n_ok[None, :]
        d_off = batch * stride_dg + offs_m.to(tl.int64)[:, None] * stride_dm + offs_n[None, :]
        if ACCUMULATE:
            acc += tl.load(d_ptr + d_off, mask=store_ok, other=0.0)
        if OUT_MODE == OUT_FP32:
            tl.store(d_ptr + d_off, acc, mask=store_ok)
        elif OUT_MODE == OUT_BF16:
            tl.store(d_ptr + d_off, acc.to(tl.bfloat16), mask=store_ok)
        else:
            tl.store(d_ptr + d_off, _bf16_bits(acc), mask=store_ok)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


# One kernel for FP8 and BF16, dense and grouped; it keeps its first name (the sm90 report's rows name it).
grouped_gemm_kernel = grouped_fp8_gemm_kernel
