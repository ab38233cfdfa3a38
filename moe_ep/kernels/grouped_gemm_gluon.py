"""Warp-specialised sm90 FP8 GEMM in Gluon: DeepGEMM's sm90 structure for the grouped (contiguous by
``m_indices`` or by psum, masked) and dense FP8 GEMMs, with the numerics of the ``tl`` kernel
(:mod:`moe_ep.kernels.grouped_gemm`). A leaf module: imports only Triton, through
:mod:`moe_ep.kernels.gluon_compat` (where the differences between Triton releases live).

STATE: compiled for sm90 (Triton 3.6 and 3.9, ``perf/sm90_report.py``, ``tests/test_gemm_gluon_compile.py``);
checked against the reference on an H200 (2026-11-28, 13 shapes, ``perf/lease_gemm_gluon.py``). The host
(``moe_ep.gemm.gluon``) takes it where it measured faster than ``tl`` (``MOE_EP_GEMM_KERNEL=auto``, the
default) or everywhere (``gluon``). Gluon has no interpreter; the ``tl`` kernel is the CPU path.

Structure (one CTA per SM, persistent):

- partitions (``gl.warp_specialize``): the default partition is the consumers, ``num_warps`` warps (8 = two
  warpgroups for ``BLOCK_M`` 128, 64 rows each; 4 = one warpgroup for ``BLOCK_M`` 64); one worker warp is the
  TMA producer (40 registers: it only computes tile coordinates and issues copies).
- ring: ``STAGES`` stages of ``A [BLOCK_M, 128]``, ``B [BLOCK_N, 128]`` and the K block's activation-scale
  column ``sfa [BLOCK_M]`` (wgrad: also the weight-scale column ``sfb [BLOCK_N]``), all TMA loads completing on the
  stage's ``ready`` mbarrier (expect-tx); consumers arrive ``empty`` once they have read a stage.
- consumers: issue the ``wgmma`` of K block ``k`` (async), ``warpgroup_mma_wait(1)`` retires block ``k - 1`` while
  ``k`` runs, then promote it: ``acc = fma(part, sfa * sfb, acc)``, one FFMA per accumulator (``BLOCK_N`` 128: the
  weight scale is one scalar per tile and K block, loaded one block ahead).
- scheduler: tiles in GROUP_M-swizzled order within each expert; the masked layout walks only the row blocks
  below ``masked_m[g]`` (empty experts and tiles cost nothing); contiguous tiles whose first ``m_indices`` entry
  is padding, and psum tiles past their expert's end, skip the mainloop (their rows are written as zeros).
- epilogue: BF16 tiles whose rows are all written go out with a TMA store from shared memory, waited for only
  before the next tile's epilogue reuses the buffer (the store overlaps the next tile's mainloop); partial masked
  tiles, psum without zero padding, float32 output and ``c`` accumulation use masked register stores.

Numerics: as the ``tl`` kernel: per 128-wide K block the FP8 MMA sums in its own accumulator (no
``max_num_imprecise_acc`` promotion inside the block), the block is scaled by ``sfa[row, kb] * sfb[.., kb]`` and
added to a float32 accumulator, the output is cast once. The scale product is rounded once before the FFMA
(DeepGEMM's order); the ``tl`` kernel multiplies twice, so results agree to float32 rounding, not bitwise.

Layout constants are the ``tl`` kernel's (``CONTIG, MASKED, PSUM, DENSE``). Host contract (checked by the host
before it picks this kernel): ``a`` `[A_ROWS, K]`, ``b`` `[G * N, K]` and ``d`` `[A_ROWS, N]` contiguous (masked:
``A_ROWS = G * M``); activation scales M-major with leading dimension ``SFA_LD`` (a multiple of 4):
element ``(batch * K / 128 + kb) * SFA_LD + row``; wgrad weight scales likewise (``SFB_LD``); 128x128 weight scales
at ``sfb_ptr + g * stride_sbg + (n // 128) * stride_sbn + kb * stride_sbk``.
"""

from __future__ import annotations

from .gluon_compat import (fence_async_shared, gl, gluon, mbarrier, tma, tma_load, tma_store, warpgroup_mma,
                           warpgroup_mma_wait)

__all__ = ["grouped_fp8_gemm_ws_kernel", "CONTIG", "MASKED", "PSUM", "DENSE"]

CONTIG = gl.constexpr(0)
MASKED = gl.constexpr(1)
PSUM = gl.constexpr(2)
DENSE = gl.constexpr(3)
PSUM_CHUNK = gl.constexpr(128)


@gluon.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    """(pid_m, pid_n) of ``tile`` in the GROUP_M-swizzled order (the ``tl`` kernel's)."""
    width = GROUP_M * num_pid_n
    first_m = (tile // width) * GROUP_M
    group_rows = gl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % width) % group_rows
    pid_n = (tile % width) // group_rows
    return pid_m, pid_n


@gluon.jit
def _group_rows(layout_ptr, gi, M, LAYOUT: gl.constexpr):
    """Rows the scheduler walks in group ``gi``: ``masked_m[gi]`` clamped to ``[0, M]`` (masked), else ``M``."""
    if LAYOUT == MASKED:
        return gl.maximum(gl.minimum(gl.load(layout_ptr + gi), M), 0).to(gl.int32)
    else:
        return M


@gluon.jit
def _tile_expert(layout_ptr, gi, pid_m, G, ALIGN, BLOCK_M: gl.constexpr, LAYOUT: gl.constexpr,
                 CHUNK_LAYOUT: gl.constexpr):
    """(expert, whether the tile runs the mainloop) of row block ``pid_m`` of group ``gi``."""
    if LAYOUT == MASKED:
        return gi, gi >= 0
    elif LAYOUT == CONTIG:
        e = gl.load(layout_ptr + pid_m * BLOCK_M)
        return e, (e >= 0) & (e < G)
    elif LAYOUT == PSUM:
        r0 = pid_m * BLOCK_M
        g = r0 * 0
        for i0 in range(0, G, PSUM_CHUNK):
            offs_g = i0 + gl.arange(0, PSUM_CHUNK, layout=CHUNK_LAYOUT)
            ends = gl.load(layout_ptr + offs_g, mask=offs_g < G, other=0)
            aligned = (ends + ALIGN - 1) // ALIGN * ALIGN
            g += gl.sum(((offs_g < G) & (aligned <= r0)).to(gl.int32), axis=0)
        end = gl.load(layout_ptr + gl.minimum(g, G - 1))
        return g, (g < G) & (r0 < end)
    else:
        return gi * 0, gi >= 0


@gluon.jit
def _producer(a_desc, b_desc, sfa_desc, sfb_desc, a_bufs, b_bufs, sfa_bufs, sfb_bufs, ready, empty, layout_ptr,
              M, N, K, G, ALIGN, SFA_LD, SFB_LD,
              LAYOUT: gl.constexpr, SFB_GRAN_N: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    chunk_l: gl.constexpr = gl.BlockedLayout([PSUM_CHUNK // 32], [32], [1], [0])
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    num_kb = gl.cdiv(K, BLOCK_K)
    # bytes landing per stage (FP8 A and B, float32 scale columns)
    nbytes: gl.constexpr = (BLOCK_M + BLOCK_N) * BLOCK_K + 4 * BLOCK_M + (4 * BLOCK_N if SFB_GRAN_N == 1 else 0)
    num_groups = G if LAYOUT == MASKED else 1
    it = 0
    base = 0
    for gi in range(num_groups):
        num_pid_m = gl.cdiv(_group_rows(layout_ptr, gi, M, LAYOUT), BLOCK_M)
        count = num_pid_m * num_pid_n
        first = ((pid - base) % nprog + nprog) % nprog
        for t in range(first, count, nprog):
            pid_m, pid_n = _tile_coords(t, num_pid_m, num_pid_n, GROUP_M)
            g, run = _tile_expert(layout_ptr, gi, pid_m, G, ALIGN, BLOCK_M, LAYOUT, chunk_l)
            if run:
                batch = gi if LAYOUT == MASKED else 0
                row = batch * M + pid_m * BLOCK_M
                col = g * N + pid_n * BLOCK_N
                for kb in range(num_kb):
                    s = it % STAGES
                    mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                    mbarrier.expect(ready.index(s), nbytes)
                    tma_load(a_desc, [row, kb * BLOCK_K], ready.index(s), a_bufs.index(s))
                    tma_load(b_desc, [col, kb * BLOCK_K], ready.index(s), b_bufs.index(s))
                    tma_load(sfa_desc, [(batch * num_kb + kb) * SFA_LD + pid_m * BLOCK_M], ready.index(s),
                             sfa_bufs.index(s))
                    if SFB_GRAN_N == 1:
                        tma_load(sfb_desc, [kb * SFB_LD + pid_n * BLOCK_N], ready.index(s), sfb_bufs.index(s))
                    it += 1
        base += count


@gluon.jit
def _promote(part, acc, sa_buf, sfb_buf, sb, rows_l: gl.constexpr, cols_l: gl.constexpr,
             SFB_GRAN_N: gl.constexpr):
    """``acc + part * scales`` of one K block: one FFMA per accumulator (the per-row scale product is formed
    once per row; wgrad: per row and column)."""
    sa = sa_buf.load(rows_l)
    if SFB_GRAN_N == 1:
        sbv = sfb_buf.load(cols_l)
        return gl.fma(part, sa[:, None] * sbv[None, :], acc)
    else:
        return gl.fma(part, (sa * sb)[:, None], acc)


@gluon.jit
def _store_regs(d_ptr, out, rows, offs_n, row_ok, N, OUT_FP32: gl.constexpr, ACCUMULATE: gl.constexpr):
    """Masked register store of a tile (``+ d`` first with ``ACCUMULATE``)."""
    ptrs = d_ptr + rows.to(gl.int64)[:, None] * N + offs_n[None, :]
    mask = row_ok[:, None] & (offs_n < N)[None, :]
    if ACCUMULATE:
        out = out + gl.load(ptrs, mask=mask, other=0.0)
    if OUT_FP32:
        gl.store(ptrs, out, mask=mask)
    else:
        gl.store(ptrs, out.to(gl.bfloat16), mask=mask)


@gluon.jit
def _consumer(a_bufs, b_bufs, sfa_bufs, sfb_bufs, ready, empty, c_smem, d_desc, d_ptr, sfb_ptr, layout_ptr,
              M, N, K, G, ALIGN, stride_sbg, stride_sbn, stride_sbk,
              LAYOUT: gl.constexpr, OUT_FP32: gl.constexpr, ACCUMULATE: gl.constexpr, ZERO_PAD: gl.constexpr,
              SFB_GRAN_N: gl.constexpr, LOADS_ONLY: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, NUM_WARPS: gl.constexpr):
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                    instr_shape=[16, BLOCK_N, 32])
    rows_l: gl.constexpr = gl.SliceLayout(1, mma_l)
    cols_l: gl.constexpr = gl.SliceLayout(0, mma_l)
    chunk_l: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    num_kb = gl.cdiv(K, BLOCK_K)
    num_groups = G if LAYOUT == MASKED else 1
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_l)
    it = 0
    base = 0
    for gi in range(num_groups):
        rows_g = _group_rows(layout_ptr, gi, M, LAYOUT)
        num_pid_m = gl.cdiv(rows_g, BLOCK_M)
        count = num_pid_m * num_pid_n
        first = ((pid - base) % nprog + nprog) % nprog
        for t in range(first, count, nprog):
            pid_m, pid_n = _tile_coords(t, num_pid_m, num_pid_n, GROUP_M)
            g, run = _tile_expert(layout_ptr, gi, pid_m, G, ALIGN, BLOCK_M, LAYOUT, chunk_l)
            acc = zero
            if run:
                sfb_row = sfb_ptr + g.to(gl.int64) * stride_sbg + pid_n * stride_sbn
                if LOADS_ONLY:  # the feed ceiling: the same ring traffic, no MMA
                    for kb in range(num_kb):
                        s = it % STAGES
                        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                        mbarrier.arrive(empty.index(s), count=1)
                        it += 1
                else:
                    s = it % STAGES
                    if SFB_GRAN_N != 1:
                        sb = gl.load(sfb_row)
                    else:
                        sb = gl.to_tensor(1.0)
                    mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                    tok = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), zero, use_acc=False,
                                        is_async=True)
                    prev = s
                    it += 1
                    for kb in range(1, num_kb):
                        s = it % STAGES
                        if SFB_GRAN_N != 1:
                            sb_next = gl.load(sfb_row + kb * stride_sbk)
                        else:
                            sb_next = gl.to_tensor(1.0)
                        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                        tok2 = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), zero, use_acc=False,
                                             is_async=True)
                        part = warpgroup_mma_wait(num_outstanding=1, deps=[tok])  # block kb-1 done, kb in flight
                        acc = _promote(part, acc, sfa_bufs.index(prev), sfb_bufs.index(prev), sb, rows_l, cols_l,
                                       SFB_GRAN_N)
                        fence_async_shared()  # the scale reads are ordered before the producer's next TMA write
                        mbarrier.arrive(empty.index(prev), count=1)
                        tok = tok2
                        sb = sb_next
                        prev = s
                        it += 1
                    part = warpgroup_mma_wait(num_outstanding=0, deps=[tok])
                    acc = _promote(part, acc, sfa_bufs.index(prev), sfb_bufs.index(prev), sb, rows_l, cols_l,
                                   SFB_GRAN_N)
                    fence_async_shared()
                    mbarrier.arrive(empty.index(prev), count=1)

            # Epilogue: which rows this tile writes, and with what. NOTES: ``full`` stays a runtime value in every
            # layout: Triton 3.6's lowering to LLVM asserts (SmallVector index) on a TMA store that is not under an
            # scf.if in a warp-specialised partition.
            offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=rows_l)
            offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=cols_l)
            in_range = offs_m < rows_g
            out = acc
            write = run
            full = (pid_m + 1) * BLOCK_M <= rows_g
            if LAYOUT == CONTIG:
                e_rows = gl.load(layout_ptr + offs_m, mask=in_range, other=-1)
                ok = (e_rows == g) & (g < G) & in_range
                bad = (e_rows >= 0) & ((e_rows != g) | (e_rows >= G)) & in_range
                out = gl.where(ok[:, None], out, 0.0)
                out = gl.where(bad[:, None], float("nan"), out)
                write = True
                full = pid_m * BLOCK_M < rows_g  # every walked tile (rows past M are clipped by the TMA store)
                row_ok = in_range
            elif LAYOUT == PSUM:
                end = gl.load(layout_ptr + gl.minimum(g, G - 1))
                row_ok = in_range & (offs_m < end) & ((offs_m * 0 + g) < G)
                out = gl.where(row_ok[:, None], out, 0.0)
                if ZERO_PAD:
                    write = True
                    row_ok = in_range
                    full = pid_m * BLOCK_M < rows_g
                else:
                    full = False
            elif LAYOUT == MASKED:
                row_ok = in_range
            else:
                row_ok = in_range
                full = pid_m * BLOCK_M < rows_g
            if write:
                batch = gi if LAYOUT == MASKED else 0
                if OUT_FP32 or ACCUMULATE:
                    _store_regs(d_ptr, out, batch * M + offs_m, offs_n, row_ok, N, OUT_FP32, ACCUMULATE)
                elif full:
                    tma.store_wait(0)  # the previous tile's store has left c_smem
                    c_smem.store(out.to(gl.bfloat16))
                    fence_async_shared()
                    tma_store(d_desc, [batch * M + pid_m * BLOCK_M, pid_n * BLOCK_N], c_smem)
                else:
                    _store_regs(d_ptr, out, batch * M + offs_m, offs_n, row_ok, N, OUT_FP32, ACCUMULATE)
        base += count
    tma.store_wait(0)


@gluon.jit
def grouped_fp8_gemm_ws_kernel(
    a_ptr, sfa_ptr, b_ptr, sfb_ptr, d_ptr, layout_ptr,
    M, N, K, G, ALIGN,  # M: rows (contiguous, psum, dense) or rows per expert T (masked)
    A_ROWS, SFA_LEN, SFA_LD, SFB_LEN, SFB_LD,  # a / d rows; scale vectors' lengths and leading dims
    stride_sbg, stride_sbn, stride_sbk,  # 128x128 weight scales (SFB_GRAN_N 128)
    LAYOUT: gl.constexpr, OUT_FP32: gl.constexpr, ACCUMULATE: gl.constexpr, ZERO_PAD: gl.constexpr,
    SFB_GRAN_N: gl.constexpr, LOADS_ONLY: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
    STAGES: gl.constexpr, NUM_WARPS: gl.constexpr,
):
    a_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.float8e4nv)
    b_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.float8e4nv)
    s_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    c_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.bfloat16)
    d_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N],
                                                             gl.float32 if OUT_FP32 else gl.bfloat16)
    a_desc = tma.make_tensor_descriptor(a_ptr, [A_ROWS, K], [K, 1], [BLOCK_M, BLOCK_K], a_l)
    b_desc = tma.make_tensor_descriptor(b_ptr, [G * N, K], [K, 1], [BLOCK_N, BLOCK_K], b_l)
    sfa_desc = tma.make_tensor_descriptor(sfa_ptr, [SFA_LEN], [1], [BLOCK_M], s_l)
    sfb_desc = tma.make_tensor_descriptor(sfb_ptr, [SFB_LEN], [1], [BLOCK_N], s_l)
    d_desc = tma.make_tensor_descriptor(d_ptr, [A_ROWS, N], [N, 1], [BLOCK_M, BLOCK_N], d_l)
    a_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, BLOCK_K], a_l)
    b_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, BLOCK_K], b_l)
    sfa_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], s_l)
    sfb_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N if SFB_GRAN_N == 1 else 4], s_l)
    c_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, BLOCK_N], c_l)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_consumer, (a_bufs, b_bufs, sfa_bufs, sfb_bufs, ready, empty, c_smem, d_desc, d_ptr, sfb_ptr, layout_ptr,
                     M, N, K, G, ALIGN, stride_sbg, stride_sbn, stride_sbk,
                     LAYOUT, OUT_FP32, ACCUMULATE, ZERO_PAD, SFB_GRAN_N, LOADS_ONLY, BLOCK_M, BLOCK_N, BLOCK_K,
                     GROUP_M, STAGES, NUM_WARPS)),
        (_producer, (a_desc, b_desc, sfa_desc, sfb_desc, a_bufs, b_bufs, sfa_bufs, sfb_bufs, ready, empty, layout_ptr,
                     M, N, K, G, ALIGN, SFA_LD, SFB_LD, LAYOUT, SFB_GRAN_N, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                     STAGES)),
    ], [1], [40])
