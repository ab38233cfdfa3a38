"""Grouped FP8 GEMMs with 1x128 activation scales and 128x128 weight scales (DeepGEMM's recipe).

One kernel, two layouts (a ``MASKED`` constexpr):

- contiguous (prefill): ``a`` `[M, K]` holds every expert's rows back to back in blocks aligned to
  128 rows; ``m_indices[M]`` names each row's expert (-1 on padding rows, written as zeros). A tile
  reads the expert of its rows, so tiles never straddle two experts (BLOCK_M divides 128).
- masked (decode): ``a`` `[G, T, K]` is the low-latency receive layout; ``masked_m[G]`` valid rows per
  expert, read on the device. Tiles past ``masked_m[g]`` exit at once; rows past it are not written.

Numerics: per 128-wide K block, the FP8 dot product is accumulated in float32 by the MMA, then scaled
by ``sfa[row, kb] * sfb[g, n // 128, kb]`` and added to a float32 accumulator (DeepGEMM's "promotion"
every 128 K: Hopper's FP8 MMA accumulates with fewer bits than float32, so long K chains are never
left inside the MMA). The output is cast once, at the end.

``SWAP_AB`` (small M): the MMA's M dimension must be 64 rows for wgmma; with 16-64 tokens per expert
the kernel computes ``D^T = B A^T`` instead (weights as the 128-row M operand, tokens as the narrow
N operand) and stores the tile transposed.

PDL: with ``USE_PDL`` the kernel first prefetches its first ``PREFETCH_K`` weight K blocks into L2
(``prefetch.global.L2``, one per 128-byte row segment), then ``griddepcontrol.wait``: nothing the
previous kernel writes (``a``, ``sfa``, ``m_indices``, ``masked_m``) is read before the wait. In the
masked layout the expert is the grid's second axis, so the prefetch is exact; in the contiguous
layout the expert comes from ``m_indices`` (written by the previous kernel), so the prefetch takes
the expert a balanced layout would give this row block (``pid_m * G // num_pid_m``): right in the
common case, one wasted L2 fill per program otherwise.

Bad routing data cannot be raised from the device, so it is made visible: a row whose ``m_indices``
entry is ``>= G``, or differs from the first row of its tile, is written as NaN.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .low_latency_common import _bf16_bits

__all__ = ["grouped_fp8_gemm_kernel", "prefetch_l2"]

OUT_FP32 = tl.constexpr(0)
OUT_BF16 = tl.constexpr(1)
OUT_BF16_BITS = tl.constexpr(2)  # bf16 rounded in integers, stored through an int16 view (interpreter)


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
def grouped_fp8_gemm_kernel(
    a_ptr, sfa_ptr, b_ptr, sfb_ptr, d_ptr, m_indices_ptr, masked_m_ptr,
    M, N, K, G,  # M: total rows (contiguous) or rows per expert T (masked)
    stride_ag, stride_am,  # a: [G?, M, K], K contiguous
    stride_sag, stride_sam, stride_sak,  # sfa: [G?, M, K/128] float32 or [G?, M, ceil(K/512)] int32
    stride_bg, stride_bn,  # b: [G, N, K], K contiguous
    stride_sbg, stride_sbn, stride_sbk,  # sfb: [G, N/128, K/128] float32
    stride_dg, stride_dm,  # d: [G?, M, N], N contiguous
    MASKED: tl.constexpr, SWAP_AB: tl.constexpr, SFA_UE8M0: tl.constexpr, OUT_MODE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    USE_PDL: tl.constexpr, PREFETCH_K: tl.constexpr,
):
    # Step 1: tile coordinates. Swizzled launch order: GROUP_M row blocks share each column block's
    # weights while they are in L2.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_pid_n
    first_m = (pid // width) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_rows
    pid_n = (pid % width) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N

    # Step 2 (PDL only): prefetch static weights, then wait for the previous kernel's outputs.
    if USE_PDL:
        if MASKED:
            g_guess = tl.program_id(1)
        else:
            g_guess = (pid_m * G) // num_pid_m
        row_base = b_ptr + g_guess.to(tl.int64) * stride_bg + offs_n.to(tl.int64) * stride_bn
        for kb in tl.static_range(PREFETCH_K):
            prefetch_l2(row_base + kb * BLOCK_K)
        tl.extra.cuda.gdc_wait()

    # Step 3: which expert, which rows.
    if MASKED:
        g = tl.program_id(1)
        # clamp in the loaded dtype first: an int64 count above 2**31 must not wrap before the clamp
        num_rows = tl.maximum(tl.minimum(tl.load(masked_m_ptr + g), M), 0).to(tl.int32)
        if pid_m * BLOCK_M >= num_rows:
            return
        row_ok = offs_m < num_rows
        row_bad = offs_m < 0  # all False
    else:
        in_range = offs_m < M
        expert = tl.load(m_indices_ptr + offs_m, mask=in_range, other=-1)
        # The tile's expert is its first row's (padding only follows valid rows); a tile that starts
        # with padding takes the largest in-range index it holds (none: an all-padding tile).
        first = tl.load(m_indices_ptr + pid_m * BLOCK_M)
        g = tl.max(tl.where(expert < G, expert, -1), axis=0)
        g = tl.where((first >= 0) & (first < G), first, g)
        row_ok = in_range & (expert >= 0) & (expert == g)
        row_bad = in_range & (expert >= 0) & (expert != g)
        g = tl.maximum(g, 0)  # an all-padding tile computes nothing useful but stays in bounds
    g64 = g.to(tl.int64)
    # a, sfa and d carry the expert as their leading dim only in the masked layout.
    if MASKED:
        batch = g64
    else:
        batch = g64 * 0

    # Step 4: K loop; one MMA per 128-wide K block, promoted to the float32 accumulator with scales.
    a_rows = a_ptr + batch * stride_ag + offs_m.to(tl.int64) * stride_am
    b_rows = b_ptr + g64 * stride_bg + offs_n.to(tl.int64) * stride_bn
    sfa_rows = batch * stride_sag + offs_m.to(tl.int64) * stride_sam
    sfb_rows = sfb_ptr + g64 * stride_sbg + (offs_n // 128) * stride_sbn
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    num_kb = K // BLOCK_K
    if not MASKED:
        # A tile of padding rows only (the tail of an expert's last 128-row block, or an empty block)
        # skips the MMAs and just writes its zeros.
        num_kb = tl.where(tl.max(row_ok.to(tl.int32), axis=0) > 0, num_kb, 0)
    for kb in range(0, num_kb):
        k0 = kb * BLOCK_K
        a = tl.load(a_rows[:, None] + (k0 + offs_k)[None, :], mask=row_ok[:, None], other=0.0)
        b = tl.load(b_rows[:, None] + (k0 + offs_k)[None, :], mask=n_ok[:, None], other=0.0)
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

    # Step 5: store. Padding rows (contiguous) are written as zeros, inconsistent rows as NaN; masked
    # rows past masked_m are left untouched.
    if MASKED:
        store_ok = row_ok[:, None] & n_ok[None, :]
    else:
        acc = tl.where(row_ok[:, None], acc, 0.0)
        acc = tl.where(row_bad[:, None], float("nan"), acc)
        store_ok = in_range[:, None] & n_ok[None, :]
    d_off = batch * stride_dg + offs_m.to(tl.int64)[:, None] * stride_dm + offs_n[None, :]
    if OUT_MODE == OUT_FP32:
        tl.store(d_ptr + d_off, acc, mask=store_ok)
    elif OUT_MODE == OUT_BF16:
        tl.store(d_ptr + d_off, acc.to(tl.bfloat16), mask=store_ok)
    else:
        tl.store(d_ptr + d_off, _bf16_bits(acc), mask=store_ok)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


def sm90_cases() -> list[dict]:
    """The shipped tiles specialised as real launches would be (DeepSeek-V3 expert shapes), for
    ``perf/sm90_report.py`` and the sm90 compile tests: dicts with ``name, config, kernel, signature,
    constexprs, num_warps, num_stages, attrs``."""
    from ..gemm import BLOCK_K, choose_gemm_config
    from ..testing.sm90 import launch_case

    cases = []
    variants = [(False, 4096, False, False), (False, 4096, False, True), (False, 4096, True, True)]
    variants += [(True, m, False, pdl) for m in (16, 32, 64, 256) for pdl in (False, True)]
    for masked, expected_m, ue8m0, pdl in variants:
        cfg = choose_gemm_config(masked, expected_m)
        n, k, g, t = 4096, 7168, 32, 1024
        # Scalars as a launch sees them: M-major scales give stride_sam == 1 (a constexpr), the rest are
        # multiples of 16 except the UE8M0 column count.
        scalars = {"M": t if masked else 8 * 4096, "N": n, "K": k, "G": g,
                   "stride_ag": t * k, "stride_am": k, "stride_sag": (k // 128) * t, "stride_sam": 1,
                   "stride_sak": t, "stride_bg": n * k, "stride_bn": k, "stride_sbg": (n // 128) * (k // 128),
                   "stride_sbn": k // 128, "stride_sbk": 1, "stride_dg": t * n, "stride_dm": n}
        ptrs = {"a_ptr": "*fp8e4nv", "sfa_ptr": "*i32" if ue8m0 else "*fp32", "b_ptr": "*fp8e4nv",
                "sfb_ptr": "*fp32", "d_ptr": "*bf16", "m_indices_ptr": "*i32", "masked_m_ptr": "*i32"}
        const = {"MASKED": masked, "SWAP_AB": cfg.swap_ab, "SFA_UE8M0": ue8m0, "OUT_MODE": OUT_BF16.value,
                 "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": BLOCK_K, "GROUP_M": cfg.group_m,
                 "USE_PDL": pdl, "PREFETCH_K": 4}
        label = (f"{'masked' if masked else 'contiguous'} N={n} K={k} "
                 f"{'expected_m=' + str(expected_m) + ' ' if masked else ''}"
                 f"{cfg.block_m}x{cfg.block_n}x{BLOCK_K}{' swapAB' if cfg.swap_ab else ''}"
                 f"{' UE8M0' if ue8m0 else ''}{' PDL' if pdl else ''}")
        cases.append(launch_case("grouped_gemm", label, grouped_fp8_gemm_kernel, ptrs, scalars, const,
                                 num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    return cases
