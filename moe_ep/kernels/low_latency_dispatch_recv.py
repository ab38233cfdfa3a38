"""Low-latency dispatch receive (destination rank ``d``): places each source's rows at their expert's offsets, fills
``recv_count`` and the handle, then releases its sources; the protocol is described in
:mod:`moe_ep.kernels.low_latency`, which re-exports this kernel."""

from __future__ import annotations

import triton
import triton.language as tl

from .low_latency_common import (
    _decide_vec,
    _decided_live,
    _decision_base,
    _decision_words,
    _disp_sig_word,
    _finish_receive,
    _sig_stride,
    _status_ok,
)
from .signals import arrive_last, load_acquire, now_ns
from .transport import NVSHMEM
from .transport import peer_ptr as _peer

__all__ = ["_ll_dispatch_recv_kernel"]


@triton.jit
def _ll_dispatch_recv_kernel(
    buf_ptr,  # this rank's data region (uint8)
    signal_ptrs, status_ptr,
    recv_x_ptr,  # [L, R*T, H] contiguous: uint8 view (FP8) or int16 view (BF16)
    recv_s_ptr, stride_sl, stride_sg,  # int32 view of the column-major scales (row stride 1)
    recv_count_ptr, stats_ptr,  # [L] int32
    wait_stats_ptr,  # [R] int64: ns this receive waited for each source (accumulated), if HAS_WAIT_STATS
    slot_row_ptr,  # [R, T, K] int32 out: le * (R*T) + row of selection (s, t, k), or -1
    recv_tokens_ptr,  # [R] int32 out: tokens of each source
    stamp_ptr,  # [R + 1] int32 out (the handle's call_stamps): entry s = source s's call stamp
    rank, T, L, R, timeout_ns,
    cnt_off, msg_off, sig_off,
    H: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, MSG: tl.constexpr, HDR: tl.constexpr,
    SW: tl.constexpr, SWP: tl.constexpr, BLOCK_T: tl.constexpr, HC: tl.constexpr, RP: tl.constexpr,
    LP: tl.constexpr, IS_FP8: tl.constexpr, HAS_STATS: tl.constexpr, HAS_WAIT_STATS: tl.constexpr,
    DISP_BUSY: tl.constexpr, DISP_FULL: tl.constexpr, DISP_RECV_CNT: tl.constexpr,
    TRANSPORT: tl.constexpr = 0,
):
    s = tl.program_id(0)
    b = tl.program_id(1)
    num_progs = tl.num_programs(0) * tl.num_programs(1)
    my_sig = _peer(signal_ptrs, rank, 0, tl.int32) + sig_off
    buf32 = buf_ptr.to(tl.pointer_type(tl.int32), bitcast=True)

    # Step 1: sources 0..s (the offsets need the earlier sources' counts, this program copies source s's rows). Each
    # program polls them itself; the launch's verdict on each source is made once, by the first program to reach one
    # (compare-and-swap in the source's decision word), and adopted by the others (docs/protocols.md, "A late or dead
    # peer"): no program waits for another program of this launch.
    base = _decision_base(tl.load(stamp_ptr + R), 0)  # stamp_ptr[R]: this call's stamp (this rank's send wrote it)
    dec = _decision_words(status_ptr, R, sig_off, 0)
    sig_ss = _sig_stride(R)
    sig_sb = _disp_sig_word(R)
    t_start = 0
    if HAS_WAIT_STATS:
        t_start = now_ns()
    # All of them at once, one lane each (32 a step). (Program (R-1, 0) thus has every source decided: it counts their
    # rows, step 2.)
    for p0 in range(0, s + 1, 32):
        pe = p0 + tl.arange(0, 32)
        _decide_vec(dec, base, my_sig, DISP_FULL, status_ptr, rank, pe, pe <= s, timeout_ns, signal_ptrs, R, sig_sb,
                    sig_ss, t_start, wait_stats_ptr, HAS_WAIT_STATS, TRANSPORT)
    live_s = _decided_live(dec, s)
    v_s = load_acquire(my_sig + DISP_FULL + 2 * s)
    n_s = (v_s & 0xFFFF) - 1  # FULL = stamp << 16 | (N + 1)
    ok = (tl.load(status_ptr, volatile=True) == 0) & live_s
    n_s = tl.where(ok, tl.minimum(tl.maximum(n_s, 0), T), 0)
    tl.debug_barrier()
    RT = R * T

    # Step 2: valid rows per local expert (one program of the last source: it has seen every source).
    if (s == R - 1) & (b == 0):
        rr = tl.arange(0, RP)
        ll = tl.arange(0, LP)
        cnt = tl.load(buf32 + cnt_off // 4 + rr[:, None] * L + ll[None, :],
                      mask=((rr < R) & _status_ok(status_ptr, rr) & _decided_live(dec, tl.where(rr < R, rr, -1)))[:, None]
                      & (ll < L)[None, :],
                      other=0)
        total = tl.sum(cnt, axis=0)
        tl.store(recv_count_ptr + ll, total, mask=ll < L)
        if HAS_STATS:
            prev = tl.load(stats_ptr + ll, mask=ll < L, other=0)
            tl.store(stats_ptr + ll, prev + total, mask=ll < L)
    if b == 0:
        tl.store(recv_tokens_ptr + s, n_s)
        tl.store(stamp_ptr + s, v_s >> 16)

    # Step 3: headers -> destination row of each local selection.
    kk = tl.arange(0, KP)
    k_ok = kk < K
    offs_t = b * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = offs_t < n_s
    row_b = msg_off + (s * T + offs_t).to(tl.int64) * MSG
    hdr = (row_b + HDR) // 4
    tk_mask = t_ok[:, None] & k_ok[None, :]
    idx = tl.load(buf32 + hdr[:, None] + kk[None, :], mask=tk_mask, other=0) - 1  # (expert + 1, 0 = none)
    pos = tl.load(buf32 + hdr[:, None] + K + kk[None, :], mask=tk_mask, other=0)
    # cleared once read: the next call's sender writes only the headers of tokens it sends here. NVSHMEM: not this
    # rank's own rows, the sources of its puts of this call (a put's source is rewritten only after its peer released
    # the slot, docs/protocols.md); the send rewrites every own header instead.
    own_src = (TRANSPORT == NVSHMEM) & (s == rank)
    tl.store(buf32 + hdr[:, None] + kk[None, :], tl.zeros([BLOCK_T, KP], dtype=tl.int32),
             mask=tk_mask & (offs_t * 0 + own_src.to(tl.int32) == 0)[:, None])
    lo = rank * L
    is_local = (idx >= lo) & (idx < lo + L)
    le = tl.where(is_local, idx - lo, 0)
    off = tl.zeros([BLOCK_T, KP], dtype=tl.int32)
    for sp in range(s):
        off += tl.load(buf32 + cnt_off // 4 + sp * L + le, mask=is_local & _decided_live(dec, sp + le * 0), other=0)
    row = off + pos
    # NOTES: bounds-checked so that stale or missing data (after a timeout) never writes out of range.
    valid = is_local & (pos >= 0) & (row >= 0) & (row < RT)
    slot = tl.where(valid, le * RT + row, -1)
    tl.store(slot_row_ptr + (s * T + offs_t)[:, None] * K + kk[None, :], slot,
             mask=(offs_t < T)[:, None] & k_ok[None, :])

    # Step 4: copy the payload to every local selection's row (scales column-major).
    # NOTES: each selection's destination is read back from slot_row (written just above by this program) as
    # a [BLOCK_T] vector per k, never extracted from the [BLOCK_T, KP] tile by a cross-thread reduction inside
    # the copy loop: on an H200 with triton 3.6 those reductions raced in shared memory (compute-sanitizer
    # racecheck) and sent whole rows, or 16-word pieces of scale rows, to the wrong place at DeepSeek-V3 shapes.
    tl.debug_barrier()  # this program's slot_row stores are visible to all of its threads
    srow = slot_row_ptr + (s * T + offs_t).to(tl.int64) * K
    t_in = offs_t < T
    any_local = offs_t < 0
    for k in tl.static_range(K):
        any_local = any_local | (tl.load(srow + k, mask=t_in, other=-1) >= 0)
    for h0 in range(0, H, HC):
        offs_h = h0 + tl.arange(0, HC)
        h_ok = offs_h < H
        if IS_FP8:
            v = tl.load(buf_ptr + row_b[:, None] + offs_h[None, :], mask=any_local[:, None] & h_ok[None, :])
        else:
            v = tl.load(buf_ptr.to(tl.pointer_type(tl.int16), bitcast=True) + (row_b // 2)[:, None] + offs_h[None, :],
                        mask=any_local[:, None] & h_ok[None, :])
        for k in tl.static_range(K):
            dest = tl.load(srow + k, mask=t_in, other=-1)
            m = (dest >= 0)[:, None] & h_ok[None, :]
            tl.store(recv_x_ptr + dest.to(tl.int64)[:, None] * H + offs_h[None, :], v, mask=m)
    if IS_FP8:
        offs_w = tl.arange(0, SWP)
        w_ok = offs_w < SW
        sv = tl.load(buf32 + ((row_b + H) // 4)[:, None] + offs_w[None, :], mask=any_local[:, None] & w_ok[None, :])
        for k in tl.static_range(K):
            dest = tl.load(srow + k, mask=t_in, other=-1)
            d_ok = dest >= 0
            e_k = tl.where(d_ok, dest // RT, 0).to(tl.int64)
            r_k = tl.where(d_ok, dest % RT, 0).to(tl.int64)
            tl.store(recv_s_ptr + (e_k * stride_sl + r_k)[:, None] + offs_w[None, :] * stride_sg, sv,
                     mask=d_ok[:, None] & w_ok[None, :])

    # Step 5: the last program resets the full words and frees every source's slot (busy = 0 there).
    # NOTES: every program arrives after its verdicts and program (R-1, 0) needed every source, so when the last one
    # arrives every source is decided and every read is done.
    tl.debug_barrier()
    if arrive_last(my_sig + DISP_RECV_CNT, num_progs):
        # enable_shrink: the adopted masks count from the next phase on (this rank's combine neither sends to them
        # nor waits for them); adopted here, after every program's reads, so the launch kept one live set.
        _finish_receive(my_sig, dec, DISP_FULL, DISP_BUSY + 2 * rank, status_ptr, rank, R, sig_off, sig_sb, sig_ss,
                        signal_ptrs, TRANSPORT)
