"""Mega MoE: a whole expert-parallel MoE layer (dispatch, GEMM1, SwiGLU, FP8 quant, GEMM2, combine) as ONE
Triton kernel source over the ``symm`` peer tables, with a ``PHASE`` constexpr:

=====  ==========================================================================================
PHASE  what a program does
=====  ==========================================================================================
0      fused (persistent grid): its share of 1, then of 2, then of 3, waiting between them
1      dispatch sends (source rank ``s``): for each global expert ``e`` it owns (``e = pid, pid + P, ..``)
       the selections ``t * K + k`` of ``s``'s tokens with ``topk_idx[t, k] == e`` in token order go to
       the owner ``d = e // L``'s index list ``LIST[e % L, s, :]`` and the count to ``CNT[s, e % L]``
       (computed on the device: a running cumsum); the last program publishes ``DISP_FULL[s] = 1`` on every d
2      experts (rank ``d``): waits for every source's ``DISP_FULL``, sums the counts per local expert, and
       takes work items (local expert, block of ``BLOCK_M`` rows; rows ordered by source, then token) in
       turn, ``item = pid, pid + P, ..``. Per item: the token rows are pulled from the sources' ``x`` /
       ``x_sf`` (the caller filled them in the symmetric buffer) into the program's activation slot of the
       ring, GEMM1 gate and up per 128 intermediate columns, rounded to BF16, ``silu(gate) * up`` in float32,
       quantized to FP8 in 1x128 groups into the slot, GEMM2 per 128 hidden columns, BF16 rows written
       straight into slot ``(t, k)`` of the source's combine area. The last program resets ``DISP_FULL``
       and publishes ``COMB_FULL[d] = 1`` on every source
3      combine (source rank ``s``): waits for every ``COMB_FULL``, ``y[t] = sum_k w[t, k] * out[t, k]`` in
       float32, k ascending, holes (-1) skipped, one rounding to BF16; the last program resets ``COMB_FULL``
=====  ==========================================================================================

Numerics are the expert-path layer's (:mod:`moe_ep.layer.experts`): per 128-wide K block an FP8 MMA in float32,
``acc += part * sa * sb`` (1x128 activation scales, 128x128 weight block scales), GEMM1's output rounded
to BF16 (the layer stores it as BF16), SiLU-and-mul as in :mod:`moe_ep.kernels.silu_quant`, FP8
quantization with the shared e4m3 helpers (bitwise equal to :mod:`moe_ep.fp8`), GEMM2's output rounded to
BF16, the weighted sum as the low-latency combine does it.

Activation ring: ``S`` slots, each ``BLOCK_M`` rows of received tokens (FP8 ``[BLOCK_M, H]`` + scales
``[BLOCK_M, H/128]``) and of the intermediate (FP8 ``[BLOCK_M, I]`` + scales). Program ``p`` of the
expert phase owns slot ``p`` (its items ``p, p + P, ..`` reuse it in turn), so ``S`` = the programs of the
expert phase, capped by the work items the shapes allow (``moe_ep.gemm.mega_moe.ring_slots``). The ring is
local scratch: only the program that fills a slot reads it.

Signals (int32 words of each rank's signal region, :func:`signal_layout`): ``DISP_FULL + s`` (set by source
s, reset by the receiver), ``COMB_FULL + d`` (set by expert rank d, reset by the source), three local
``arrive_last`` counters, and ``ROUTE_ERR`` (a routing error in this rank's input: an expert id ``>= E``, or
an expert repeated past the index list's room; moved into the status word at the end of the combine).
Every counter has one writer rank (the interpreter's atomics are not atomic across processes); a set and its
reset are ordered by the protocol: a source starts its next call only after its combine saw ``COMB_FULL`` of
every expert rank, which each expert rank releases after its last read of the source's ``x``, its index lists
and counts, and after resetting ``DISP_FULL``.

Every wait is :func:`moe_ep.kernels.signals.wait_ne` (bounded, reports the peer in the status word); after a
timeout a program skips its work, does not publish (peers time out naming this rank), and the combined
output is NaN. Phase rule (DESIGN.md): phases 1-3 only wait on earlier launches; the fused phase waits on
other programs of its own launch, so it runs only where the whole grid is resident (on CPU: a grid of 1).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .low_latency import _quant_groups
from .low_latency_common import _bf16_bits
from .transport import peer_ptr as _peer
from .signals import STATUS_BAD_EXPERT, STATUS_REPEATED_EXPERT, arrive_last, report_error, signal_release, wait_ne

__all__ = ["launch_warps", "mega_moe_kernel", "signal_layout"]

GROUP = tl.constexpr(128)
# NOTES: the status codes as constexpr instances (a plain int global runs in the interpreter, not compiled).
BAD_EXPERT = tl.constexpr(STATUS_BAD_EXPERT)
REPEATED_EXPERT = tl.constexpr(STATUS_REPEATED_EXPERT)


def signal_layout(world_size: int) -> dict:
    """Word offsets of the mega-MoE signal words, and how many there are."""
    R = world_size
    return {"DISP_FULL": 0, "COMB_FULL": R, "DISP_SEND_CNT": 2 * R, "COMB_SEND_CNT": 2 * R + 1,
            "COMB_RECV_CNT": 2 * R + 2, "ROUTE_ERR": 2 * R + 3, "NUM_WORDS": 2 * R + 4}


@triton.jit
def _bf16_round(v):
    """float32 -> the float32 value of its BF16 rounding (nearest even, as a BF16 store would keep it)."""
    return (_bf16_bits(v).to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _route_error(err_ptr, code):
    """Note a routing error of this rank's input in its local ``ROUTE_ERR`` word (first wins). It is moved into the
    status word only at the end of the combine: set earlier, it would cut this rank's waits short and keep it from
    publishing, and its peers, whose calls are fine, would time out."""
    tl.atomic_cas(err_ptr, 0, code, sem="relaxed", scope="gpu")


@triton.jit
def _dispatch_share(buffer_ptrs, err_ptr, rank, N, T, R, L, E, pid, nprog, idx_off, cnt_off, list_off,
                    K: tl.constexpr, KP: tl.constexpr, BLOCK_T: tl.constexpr):
    """Phase 1 work of one program: index lists and counts of the experts ``pid, pid + nprog, ..``."""
    idx_base = _peer(buffer_ptrs, rank, idx_off, tl.int64)
    kk = tl.arange(0, KP)
    k_ok = kk < K
    for e in range(pid, E, nprog):
        d = e // L
        le = e - d * L
        dst = _peer(buffer_ptrs, d, 0, tl.int32)
        lst = dst + list_off // 4 + (le * R + rank) * T
        run = tl.full([], 0, tl.int32)
        for c0 in range(0, N, BLOCK_T):
            offs_t = c0 + tl.arange(0, BLOCK_T)
            m = (offs_t < N)[:, None] & k_ok[None, :]
            idx = tl.load(idx_base + offs_t[:, None] * K + kk[None, :], mask=m, other=-1)
            hit = tl.reshape(((idx == e) & m).to(tl.int32), [BLOCK_T * KP])
            sel = tl.reshape(offs_t[:, None] * K + kk[None, :], [BLOCK_T * KP])
            pos = run + tl.cumsum(hit, 0) - hit  # exclusive: earlier selections (token, then k order)
            tl.store(lst + pos, sel, mask=(hit != 0) & (pos < T))
            run += tl.sum(hit, 0)
        if run > T:  # tokens named expert e twice (or more): more selections than the list holds
            _route_error(err_ptr, REPEATED_EXPERT)
        tl.store(dst + cnt_off // 4 + rank * L + le, tl.minimum(run, T))


@triton.jit
def _publish(signal_ptrs, rank, R, word):
    """Release ``word + rank`` = 1 on every rank (after this program's and, via arrive_last, every program's
    writes)."""
    for r in range(R):
        signal_release(_peer(signal_ptrs, r, 0, tl.int32) + word + rank, 1)


@triton.jit
def _gemm1_block(slot_f8, xsf, w_rows, w_sf, offs_m, offs_c, H: tl.constexpr, BLOCK_M: tl.constexpr):
    """One 128-column block of GEMM1 for the slot's rows: ``sum_kb (a_kb @ w_kb^T) * sa_kb * sw_kb`` in float32,
    rounded to BF16 (the expert-path layer stores GEMM1's output as BF16). ``w_rows``: [128, 1] pointers to the
    weight rows, ``w_sf``: the rows' 128x128 block scales (one per K block)."""
    acc = tl.zeros((BLOCK_M, 128), dtype=tl.float32)
    for kb in range(0, H // 128):
        a = tl.load(slot_f8 + offs_m[:, None] * H + kb * 128 + offs_c[None, :])
        sa = tl.load(xsf + offs_m * (H // 128) + kb)
        b = tl.load(w_rows + kb * 128 + offs_c[None, :])
        acc += tl.dot(a, tl.trans(b)) * sa[:, None] * tl.load(w_sf + kb)
    return _bf16_round(acc)


@triton.jit
def _expert_share(buffer_ptrs, signal_ptrs, status_ptr, w1_ptr, w1s_ptr, w2_ptr, w2s_ptr, ring_ptr, stats_ptr,
                  rank, T, R, L, pid, nprog, timeout_ns, clamp, x_off, xsf_off, cnt_off, list_off, comb_off,
                  H: tl.constexpr, INTER: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, RP: tl.constexpr,
                  LP: tl.constexpr, GP: tl.constexpr, HAS_STATS: tl.constexpr, HAS_CLAMP: tl.constexpr,
                  NATIVE_FP8: tl.constexpr, DISP_FULL: tl.constexpr):
    """Phase 2 work of one program (see the module docstring)."""
    my_sig = _peer(signal_ptrs, rank, 0, tl.int32)
    # Step 1: every source has published its index lists and counts.
    for sp in range(R):
        wait_ne(my_sig + DISP_FULL + sp, 0, status_ptr, sp, timeout_ns)
    tl.debug_barrier()
    ok = tl.load(status_ptr, volatile=True) == 0

    # Step 2: rows per local expert (the count table [R, L] on this rank, row s written by source s only).
    my32 = _peer(buffer_ptrs, rank, 0, tl.int32)
    rr = tl.arange(0, RP)
    ll = tl.arange(0, LP)
    cnt = tl.load(my32 + cnt_off // 4 + rr[:, None] * L + ll[None, :], mask=(rr < R)[:, None] & (ll < L)[None, :],
                  other=0)
    cnt = tl.where(ok, tl.minimum(tl.maximum(cnt, 0), T), 0)
    tot = tl.sum(cnt, axis=0)  # [LP]
    blocks = (tot + BLOCK_M - 1) // BLOCK_M
    cum = tl.cumsum(blocks, 0)
    total = tl.sum(blocks, 0)
    if HAS_STATS:
        if pid == 0:
            prev = tl.load(stats_ptr + ll, mask=ll < L, other=0)
            tl.store(stats_ptr + ll, prev + tot, mask=ll < L)

    # Ring slot of this program: [BLOCK_M, H] x | [BLOCK_M, H/128] scales | [BLOCK_M, I] act | [BLOCK_M, I/128].
    XS_B: tl.constexpr = BLOCK_M * H
    XSF_B: tl.constexpr = BLOCK_M * (H // 128) * 4
    AS_B: tl.constexpr = BLOCK_M * INTER
    SLOT_B: tl.constexpr = XS_B + XSF_B + AS_B + BLOCK_M * (INTER // 128) * 4
    slot8 = ring_ptr + pid.to(tl.int64) * SLOT_B
    slot_f8 = slot8.to(tl.pointer_type(tl.float8e4nv), bitcast=True)
    xsf = (slot8 + XS_B).to(tl.pointer_type(tl.float32), bitcast=True)
    act_f8 = slot_f8 + XS_B + XSF_B
    asf = (slot8 + XS_B + XSF_B + AS_B).to(tl.pointer_type(tl.float32), bitcast=True)
    offs_m = tl.arange(0, BLOCK_M)
    offs_c = tl.arange(0, GROUP)
    offs_g = tl.arange(0, GP)

    for item in range(pid, total, nprog):
        # Step 3: which expert and rows; each row's source rank and selection (t * K + k).
        le = tl.sum((cum <= item).to(tl.int32), 0)
        is_le = ll == le
        first_blk = tl.sum(tl.where(is_le, cum - blocks, 0), 0)
        n_le = tl.sum(tl.where(is_le, tot, 0), 0)
        cnt_le = tl.sum(tl.where(is_le[None, :], cnt, 0), axis=1)  # [RP]
        end = tl.cumsum(cnt_le, 0)
        rows = (item - first_blk) * BLOCK_M + offs_m
        r_ok = rows < n_le
        src = tl.sum(((end[None, :] <= rows[:, None]) & (rr < R)[None, :]).to(tl.int32), axis=1)
        src = tl.minimum(src, R - 1)
        j = rows - tl.sum(tl.where(rr[None, :] == src[:, None], (end - cnt_le)[None, :], 0), axis=1)
        sel = tl.load(my32 + list_off // 4 + (le * R + src) * T + j, mask=r_ok, other=0)
        sel = tl.where(r_ok & (sel >= 0) & (sel < T * K), sel, 0)
        t64 = (sel // K).to(tl.int64)
        base = tl.load(buffer_ptrs + src)  # [BLOCK_M] int64: each row's source region

        # Step 4: pull the rows (FP8 + 1x128 scales) into the slot. Row addresses are 16-byte aligned (256-byte
        # aligned regions and offsets, H a multiple of 128): said, so the compiled copies are 16-byte vectors.
        x_row = tl.multiple_of((base + x_off + t64 * H).to(tl.pointer_type(tl.float8e4nv)), 16)
        for h0 in range(0, H, GROUP):
            v = tl.load(x_row[:, None] + h0 + offs_c[None, :], mask=r_ok[:, None])
            tl.store(slot_f8 + offs_m[:, None] * H + h0 + offs_c[None, :], v)
        g_ok = offs_g < H // 128
        sv = tl.load((base + xsf_off + t64 * (H // 128) * 4)[:, None].to(tl.pointer_type(tl.float32)) + offs_g[None, :],
                     mask=r_ok[:, None] & g_ok[None, :], other=0.0)
        tl.store(xsf + offs_m[:, None] * (H // 128) + offs_g[None, :], sv, mask=g_ok[None, :])
        tl.debug_barrier()

        # Step 5: GEMM1 (gate and up of 128 intermediate columns) -> BF16 -> SiLU(gate) * up -> FP8 into the slot.
        le64 = le.to(tl.int64)
        for nb in range(0, INTER // 128):
            # Gate, then up: one float32 accumulator live at a time (sm90, 8 warps: 237 registers instead of 255, room
            # against spills), for a second read of the slot's 64x128 A tiles (L2) per block.
            wg = w1_ptr + (le64 * (2 * INTER) + nb * 128 + offs_c)[:, None] * H
            sg = w1s_ptr + (le64 * (2 * INTER // 128) + nb) * (H // 128)
            gate = _gemm1_block(slot_f8, xsf, wg, sg, offs_m, offs_c, H, BLOCK_M)
            up = _gemm1_block(slot_f8, xsf, wg + INTER * H, sg + (INTER // 128) * (H // 128), offs_m, offs_c, H,
                              BLOCK_M)
            if HAS_CLAMP:
                gate = tl.minimum(gate, clamp)
                up = tl.minimum(tl.maximum(up, -clamp), clamp)
            y = gate * (1.0 / (1.0 + tl.exp(-gate))) * up
            q, scale = _quant_groups(tl.reshape(y, [BLOCK_M, 1, 128]), False, NATIVE_FP8)
            tl.store((act_f8 + offs_m[:, None] * INTER + nb * 128 + offs_c[None, :]).to(tl.pointer_type(tl.uint8),
                                                                                     bitcast=True),
                     tl.reshape(q, [BLOCK_M, 128]))
            tl.store(asf + offs_m * (INTER // 128) + nb, tl.reshape(scale, [BLOCK_M]))
        tl.debug_barrier()

        # Step 6: GEMM2 per 128 hidden columns -> BF16 -> slot (t, k) of the source's combine area.
        # (16-byte aligned rows, as above: without saying so the BF16 stores were 2-byte ones, one 64-bit address
        # each, and the tile spilled on sm90.)
        dst16 = tl.multiple_of((base + comb_off + sel.to(tl.int64) * (2 * H)).to(tl.pointer_type(tl.int16)), 16)[:, None]
        for hb in range(0, H // 128):
            acc = tl.zeros((BLOCK_M, 128), dtype=tl.float32)
            w2row = w2_ptr + (le64 * H + hb * 128 + offs_c)[:, None] * INTER
            for kb in range(0, INTER // 128):
                a = tl.load(act_f8 + offs_m[:, None] * INTER + kb * 128 + offs_c[None, :])
                sa = tl.load(asf + offs_m * (INTER // 128) + kb)
                b = tl.load(w2row + kb * 128 + offs_c[None, :])
                sb = tl.load(w2s_ptr + (le64 * (H // 128) + hb) * (INTER // 128) + kb)
                acc += tl.dot(a, tl.trans(b)) * sa[:, None] * sb
            tl.store(dst16 + hb * 128 + offs_c[None, :], _bf16_bits(acc), mask=r_ok[:, None])
        tl.debug_barrier()


@triton.jit
def _combine_share(buffer_ptrs, signal_ptrs, status_ptr, err_ptr, y_ptr, rank, N, R, E, pid, nprog, timeout_ns,
                   idx_off, w_off, comb_off, H: tl.constexpr, K: tl.constexpr, BLOCK_T: tl.constexpr,
                   COMB_FULL: tl.constexpr):
    """Phase 3 work of one program: token blocks ``pid, pid + nprog, ..``."""
    my_sig = _peer(signal_ptrs, rank, 0, tl.int32)
    for d in range(R):
        wait_ne(my_sig + COMB_FULL + d, 0, status_ptr, d, timeout_ns)
    tl.debug_barrier()
    idx_base = _peer(buffer_ptrs, rank, idx_off, tl.int64)
    w_base = _peer(buffer_ptrs, rank, w_off, tl.float32)
    comb = _peer(buffer_ptrs, rank, comb_off, tl.int16)
    offs_c = tl.arange(0, GROUP)
    for tb in range(pid, tl.cdiv(N, BLOCK_T), nprog):
        offs_t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = offs_t < N
        bad = tl.full([BLOCK_T], 0, tl.int32)
        for k in tl.static_range(K):
            e_k = tl.load(idx_base + offs_t * K + k, mask=t_ok, other=-1)
            bad = bad | (t_ok & (e_k >= E)).to(tl.int32)
        if tl.max(bad, 0) > 0:
            _route_error(err_ptr, BAD_EXPERT)
        # NaN, never plausible numbers: every row once a wait of this rank timed out or selections were dropped
        # (ROUTE_ERR: a repeated expert), the rows of tokens with an expert id out of range.
        ok = ((offs_t * 0 + tl.load(status_ptr, volatile=True)) == 0) & (bad == 0)
        ok = ok & ((offs_t * 0 + tl.load(err_ptr, volatile=True)) != REPEATED_EXPERT)
        for h0 in range(0, H, GROUP):
            acc = tl.zeros([BLOCK_T, GROUP], dtype=tl.float32)
            for k in tl.static_range(K):
                e_k = tl.load(idx_base + offs_t * K + k, mask=t_ok, other=-1)
                w_k = tl.load(w_base + offs_t * K + k, mask=t_ok, other=0.0)
                v_k = t_ok & (e_k >= 0) & (e_k < E)
                raw = tl.load(comb + (offs_t.to(tl.int64) * K + k)[:, None] * H + h0 + offs_c[None, :],
                              mask=(v_k & ok)[:, None], other=0)
                val = (raw.to(tl.int32) << 16).to(tl.float32, bitcast=True)
                acc += tl.where(v_k[:, None], w_k[:, None] * val, 0.0)
            acc = tl.where(ok[:, None], acc, float("nan"))
            tl.store(y_ptr + offs_t.to(tl.int64)[:, None] * H + h0 + offs_c[None, :], _bf16_bits(acc),
                     mask=t_ok[:, None])


@triton.jit
def mega_moe_kernel(
    buffer_ptrs, signal_ptrs, status_ptr,  # symm tables ([R] int64) and this rank's status word
    w1_ptr, w1s_ptr,  # [L, 2I, H] fp8 (gate rows, then up rows), [L, 2I/128, H/128] float32
    w2_ptr, w2s_ptr,  # [L, H, I] fp8, [L, H/128, I/128] float32
    ring_ptr,  # local activation ring, uint8 [S, slot bytes]
    y_ptr,  # [N, H] bf16 as int16
    stats_ptr,  # [L] int32 cumulative received rows per local expert (HAS_STATS)
    rank, N, T, R, L, E, timeout_ns, clamp,
    x_off, xsf_off, idx_off, w_off, cnt_off, list_off, comb_off,  # byte offsets in every rank's data region
    PHASE: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, RP: tl.constexpr, LP: tl.constexpr, GP: tl.constexpr,
    HAS_STATS: tl.constexpr, HAS_CLAMP: tl.constexpr, NATIVE_FP8: tl.constexpr,
    DISP_FULL: tl.constexpr, COMB_FULL: tl.constexpr, DISP_SEND_CNT: tl.constexpr, COMB_SEND_CNT: tl.constexpr,
    COMB_RECV_CNT: tl.constexpr, ROUTE_ERR: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    my_sig = _peer(signal_ptrs, rank, 0, tl.int32)
    if (PHASE == 0) | (PHASE == 1):
        _dispatch_share(buffer_ptrs, my_sig + ROUTE_ERR, rank, N, T, R, L, E, pid, nprog, idx_off, cnt_off, list_off,
                        K, KP, BLOCK_T)
        # Phase 1 waits on nothing: it always publishes (a peer that waited in vain would only name this rank).
        tl.debug_barrier()
        if arrive_last(my_sig + DISP_SEND_CNT, nprog):
            _publish(signal_ptrs, rank, R, DISP_FULL)
    if (PHASE == 0) | (PHASE == 2):
        _expert_share(buffer_ptrs, signal_ptrs, status_ptr, w1_ptr, w1s_ptr, w2_ptr, w2s_ptr, ring_ptr, stats_ptr,
                      rank, T, R, L, pid, nprog, timeout_ns, clamp, x_off, xsf_off, cnt_off, list_off, comb_off,
                      H, INTER, K, BLOCK_M, RP, LP, GP, HAS_STATS, HAS_CLAMP, NATIVE_FP8, DISP_FULL)
        if arrive_last(my_sig + COMB_SEND_CNT, nprog):
            for sp in range(R):
                tl.atomic_xchg(my_sig + DISP_FULL + sp, 0, sem="relaxed", scope="sys")
            if tl.load(status_ptr, volatile=True) == 0:
                _publish(signal_ptrs, rank, R, COMB_FULL)
    if (PHASE == 0) | (PHASE == 3):
        _combine_share(buffer_ptrs, signal_ptrs, status_ptr, my_sig + ROUTE_ERR, y_ptr, rank, N, R, E, pid, nprog, timeout_ns,
                       idx_off, w_off, comb_off, H, K, BLOCK_T, COMB_FULL)
        tl.debug_barrier()
        if arrive_last(my_sig + COMB_RECV_CNT, nprog):
            for d in range(R):
                tl.atomic_xchg(my_sig + COMB_FULL + d, 0, sem="relaxed", scope="sys")
            err = tl.atomic_xchg(my_sig + ROUTE_ERR, 0, sem="relaxed", scope="gpu")
            if err != 0:
                report_error(status_ptr, err)


def launch_warps(phase: int) -> int:
    """Warps per program: 8 where the GEMMs run (two 64x128 float32 accumulators), 4 for the sends and the combine."""
    return 8 if phase in (0, 2) else 4
