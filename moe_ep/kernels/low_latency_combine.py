"""Low-latency combine kernels (send: expert rows back to their sources' slots; receive: the weighted sum), both
transports; the protocol is described in :mod:`moe_ep.kernels.low_latency`, which re-exports these kernels."""

from __future__ import annotations

import triton
import triton.language as tl

from .logfmt import e4m3_decode, fp8_encode_groups, fp16_bits, logfmt_decode_values, logfmt_encode_groups
from .low_latency_common import (
    _bf16_bits,
    _comb_sig_word,
    _adopted_like,
    _decide_vec,
    _decided_live,
    _decision_base,
    _finish_receive,
    _decision_words,
    _done_word,
    _live,
    _masked_writer,
    _receiver_done,
    _live_like,
    _sig_payload_words,
    _sig_stride,
    _status_ok,
    _wait,
    _write_mask_bits,
    _write_signature,
)
from .signals import (
    SEQ_BAD_EXPERT,
    SEQ_LATE_MASKED,
    SEQ_MASK,
    SEQ_STALE_ROW,
    STATUS_BAD_EXPERT,
    STATUS_SEQ,
    STATUS_SHRINK,
    STATUS_STALE_ROW,
    arrive_last,
    fence_sys,
    now_ns,
    report_error,
    signal_release,
)
from .transport import NVSHMEM, PEER, copy_signature, mapped, publish, xfer
from .transport import peer_ptr as _peer

KBITS = tl.constexpr(32)  # top-k at most 32: one bit per selection in the combine receive
_BAD_EXPERT = tl.constexpr(STATUS_BAD_EXPERT)  # (jit code reads constexpr globals only)
_STALE_ROW = tl.constexpr(STATUS_STALE_ROW)

__all__ = ["_ll_combine_send_fmt_kernel", "_ll_combine_recv_fmt_kernel"]
# Every combine format (BF16 / FP16 as they are: FMT 0 / 1) and transport goes through these two kernels, thin
# wrappers over one body each, the format as constexprs (FMT, IN_F16 / OUT_F16, NATIVE_FP8).
#
# Combine slot (t, k) of a source's area (and a staging row on the NVSHMEM transport) is ``_cs(H)`` bytes: a 16-byte
# stamp header (int32 word 0 = ``stamp_s << 16 | writer + 1``, words 1..3 zero) then the row's wire bytes. The
# receive sums a row only when its stamp is the one this call expects (docs/protocols.md, "combine isolation").


@triton.jit
def _cs(H):
    """Bytes per combine slot / staging row: the 16-byte stamp header, then 2H bytes (16-aligned)."""
    return (2 * H + 15) // 16 * 16 + 16


@triton.jit
def _combine_send_encoded(x_ptr, stride_xl, stride_xr, srow, t_ok, offs_t, dst8, RT, h_lo, h_hi,
                          H: tl.constexpr, K: tl.constexpr, BLOCK_T: tl.constexpr, HC: tl.constexpr,
                          FMT: tl.constexpr, IN_F16: tl.constexpr, NATIVE_FP8: tl.constexpr, GS: tl.constexpr,
                          STAGED: tl.constexpr):
    """Encode the rows of (t, k) selections (16-bit ``x`` as int16; ``srow``: the tokens' ``slot_row`` rows, ``t_ok``:
    the tokens to send) into slot ``(t, k)`` of ``dst8`` (``GS``: channels
    per group, 128 for FP8, 64 for LogFMT); ``STAGED``: into the staging row of the expert row instead (``2H`` bytes
    per row of ``x``'s ``[L, R*T]`` rows). Only the channels ``[h_lo, h_hi)`` (whole ``HC`` tiles: this program's
    column split)."""
    NG: tl.constexpr = HC // GS
    CS: tl.constexpr = (2 * H + 15) // 16 * 16 + 16
    dst32 = dst8.to(tl.pointer_type(tl.int32), bitcast=True)
    offs_c = tl.arange(0, GS)
    for k in tl.static_range(K):
        src = tl.load(srow + k, mask=t_ok, other=-1)  # (a vector read per k: see _comb_send_body_ll)
        v_ok = src >= 0
        e_k = tl.where(v_ok, src // RT, 0).to(tl.int64)
        r_k = tl.where(v_ok, src % RT, 0).to(tl.int64)
        if STAGED:
            sb = (e_k * RT + r_k) * CS + 16  # byte offset of the expert row's staging row (after its stamp header)
        else:
            sb = (offs_t.to(tl.int64) * K + k) * CS + 16  # byte offset of slot (t, k)'s row
        for g0 in range(h_lo // GS, h_hi // GS, NG):
            offs_g = g0 + tl.arange(0, NG)
            g_ok = offs_g < H // GS
            cols = offs_g[:, None] * GS + offs_c[None, :]
            m3 = v_ok[:, None, None] & g_ok[None, :, None]
            raw = tl.load(x_ptr + (e_k * stride_xl + r_k * stride_xr)[:, None, None] + cols[None, :, :], mask=m3,
                          other=0)
            if IN_F16:
                y = raw.to(tl.float16, bitcast=True).to(tl.float32)
            else:
                y = (raw.to(tl.int32) << 16).to(tl.float32, bitcast=True)
            m2 = v_ok[:, None] & g_ok[None, :]
            if FMT == 2:
                q, scale = fp8_encode_groups(y, NATIVE_FP8)
                tl.store(dst8 + sb[:, None, None] + cols[None, :, :], q, mask=m3)
                tl.store(dst32.to(tl.pointer_type(tl.float32), bitcast=True) + ((sb + H) // 4)[:, None] + offs_g[None, :],
                         scale, mask=m2)
            else:
                code, lo, step = logfmt_encode_groups(y)
                tl.store(dst8 + sb[:, None, None] + cols[None, :, :], (code & 0xFF).to(tl.uint8), mask=m3)
                c4 = tl.reshape((code >> 8) & 3, [BLOCK_T, NG, GS // 4, 4])
                sh = (tl.arange(0, 4) * 2)[None, None, None, :]
                hb = tl.sum(c4 << sh, axis=3).to(tl.uint8)  # disjoint bits: the sum is an OR
                offs_q = tl.arange(0, GS // 4)
                tl.store(dst8 + (sb + H)[:, None, None] + (offs_g[:, None] * (GS // 4) + offs_q[None, :])[None, :, :],
                         hb, mask=m3)
                w0 = (sb + H + H // 4) // 4
                tl.store(dst32 + w0[:, None] + offs_g[None, :], lo, mask=m2)
                tl.store(dst32 + (w0 + H // 64)[:, None] + offs_g[None, :], step, mask=m2)


@triton.jit
def _xfer_slots(slot_row_ptr, buffer_ptrs, signal_ptrs, status_ptr, rank, s, b, T, n_s, gone, comb_off, stage_off, at,
                nbytes, full_word, K: tl.constexpr, BLOCK_T: tl.constexpr, CS: tl.constexpr, CH: tl.constexpr):
    """(``NVSHMEM`` send, step 2b) bytes ``[at, at + nbytes)`` of each staged row of this block's tokens to its slot
    ``(t, k)`` on source ``s`` (:func:`moe_ep.kernels.transport.xfer`), while ``s`` is live and this rank's status
    clean; the header pass (``at`` 0, 16 bytes) and the row pass share it."""
    for i in range(BLOCK_T):
        t = b * BLOCK_T + i
        if (t < n_s) & (tl.load(status_ptr, volatile=True) == 0) & _live(status_ptr, rank, s) & (gone == 0):
            for k in tl.static_range(K):
                src = tl.load(slot_row_ptr + (s * T + t) * K + k)
                if src >= 0:
                    xfer(buffer_ptrs, signal_ptrs, rank, s, comb_off + (t * K + k).to(tl.int64) * CS + at,
                         stage_off + src.to(tl.int64) * CS + at, nbytes, full_word, CH)


@triton.jit
def _comb_send_body_ll(
    x_ptr, stride_xl, stride_xr,  # [L, R*T, H] bf16 as int16, last dim contiguous
    slot_row_ptr, recv_tokens_ptr, stamp_ptr,  # from the dispatch receive (stamp_ptr: each source's call stamp)
    buffer_ptrs, signal_ptrs, status_ptr,
    rank, T, R, timeout_ns,
    comb_off, sig_off,
    H: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BLOCK_T: tl.constexpr, HC: tl.constexpr,
    COMB_BUSY: tl.constexpr, COMB_FULL: tl.constexpr, COMB_SEND_CNT: tl.constexpr,
    FMT: tl.constexpr, IN_F16: tl.constexpr, NATIVE_FP8: tl.constexpr,
    stage_off, TRANSPORT: tl.constexpr, CH: tl.constexpr, ROW_BYTES: tl.constexpr, sig_copy_off=0,
    call_sig0=0, call_sig1=0, call_sig2=0, call_sig3=0,
):
    CS: tl.constexpr = (2 * H + 15) // 16 * 16 + 16
    s = tl.program_id(0)
    b = tl.program_id(1)
    # Column split (axis 2; 1 on NVSHMEM, where step 2b moves whole staged rows): this program's rows cover channels
    # [h_lo, h_hi), whole HC tiles. Every split writes the headers of its slots itself before its bytes (the same
    # value from each), so "header, fence, row" holds per program.
    h_per = tl.cdiv(tl.cdiv(H, HC), tl.num_programs(2)) * HC
    h_lo = tl.program_id(2) * h_per
    h_hi = tl.minimum(H, h_lo + h_per)
    my_sig = _peer(signal_ptrs, rank, 0, tl.int32) + sig_off

    # Step 1: source s has drained its combine area (it reset our busy word).
    _wait(my_sig + COMB_BUSY + 2 * s, 1, status_ptr, rank, s, timeout_ns, signal_ptrs, sig_off, R)
    tl.debug_barrier()

    # Step 2: rows of (s, t, k) selections that this rank's experts computed -> slot (t, k) on s.
    RT = R * T
    n_s = tl.load(recv_tokens_ptr + s)
    kk = tl.arange(0, KP)
    offs_t = b * BLOCK_T + tl.arange(0, BLOCK_T)
    # enable_shrink: nothing is written to a source that has already finished this call's combine receive (it masked
    # this rank, which is late): its slots may belong to live ranks of a later call by now.
    gone = _receiver_done(signal_ptrs, s, sig_off, R, tl.load(stamp_ptr + s), status_ptr)
    t_ok = (offs_t < n_s) & _status_ok(status_ptr, offs_t) & _live_like(status_ptr, rank, s, offs_t)
    t_ok = t_ok & ((offs_t * 0 + gone) == 0)
    # NOTES: each k's expert row is read from global as a [BLOCK_T] vector (``srow + k``), never extracted from a
    # [BLOCK_T, KP] tile by a cross-thread reduction (``tl.sum(tl.where(kk == k, ...))``): on an H200 with triton 3.6
    # those reductions raced in shared memory in the dispatch receive and sent rows to the wrong place.
    srow = slot_row_ptr + (s * T + offs_t).to(tl.int64) * K
    # NVSHMEM: every row is written to this rank's staging row of its expert row first (step 2b moves it).
    if TRANSPORT == PEER:
        dst_rank = s
        dst_off = comb_off
    else:
        dst_rank = rank
        dst_off = stage_off
    # Step 2a: the stamp header of every slot this block writes (source s's stamp of this call, this rank + 1), before
    # the rows: a late row (this rank masked by s meanwhile) then carries a stamp s no longer expects.
    stamp = (tl.load(stamp_ptr + s) << 16) | (rank + 1)
    dst32s = _peer(buffer_ptrs, dst_rank, dst_off, tl.int32)
    for k in tl.static_range(K):
        sel = tl.load(srow + k, mask=t_ok, other=-1)
        if TRANSPORT == PEER:
            at_s = offs_t.to(tl.int64) * K + k
        else:
            at_s = tl.where(sel >= 0, sel, 0).to(tl.int64)
        tl.store(dst32s + at_s * (CS // 4), stamp + offs_t * 0, mask=sel >= 0)
    # The headers are ordered before the rows for every observer (a CTA barrier alone orders nothing toward a peer
    # GPU): a receive that reads a row of this send, then fences, then reads the header, sees this header or a later
    # one (docs/protocols.md, "late rows").
    tl.debug_barrier()
    if TRANSPORT == PEER:
        fence_sys()
    if FMT < 2:
        # BF16 / FP16: the 16-bit rows as they are.
        dst16 = _peer(buffer_ptrs, dst_rank, dst_off, tl.int16)
        for h0 in range(h_lo, h_hi, HC):
            offs_h = h0 + tl.arange(0, HC)
            h_ok = offs_h < H
            for k in tl.static_range(K):
                src = tl.load(srow + k, mask=t_ok, other=-1)
                v_ok = src >= 0
                e_k = tl.where(v_ok, src // RT, 0).to(tl.int64)
                r_k = tl.where(v_ok, src % RT, 0).to(tl.int64)
                m = v_ok[:, None] & h_ok[None, :]
                y = tl.load(x_ptr + (e_k * stride_xl + r_k * stride_xr)[:, None] + offs_h[None, :], mask=m)
                if TRANSPORT == PEER:
                    at = offs_t.to(tl.int64) * K + k
                else:
                    at = e_k * RT + r_k
                tl.store(dst16 + (at * (CS // 2) + 8)[:, None] + offs_h[None, :], y, mask=m)
    else:
        # FP8 / LogFMT: encode per channel group inside the send (formats: moe_ep.kernels.logfmt); slot (t, k)
        # keeps its 2H bytes, the encoded row uses the first row_bytes(FMT, H) of them.
        dst8 = _peer(buffer_ptrs, dst_rank, dst_off, tl.uint8)
        if FMT == 2:
            _combine_send_encoded(x_ptr, stride_xl, stride_xr, srow, t_ok, offs_t, dst8, RT, h_lo, h_hi, H, K, BLOCK_T, HC, FMT,
                                  IN_F16, NATIVE_FP8, 128, TRANSPORT == NVSHMEM)
        else:
            _combine_send_encoded(x_ptr, stride_xl, stride_xr, srow, t_ok, offs_t, dst8, RT, h_lo, h_hi, H, K, BLOCK_T, HC, FMT,
                                  IN_F16, NATIVE_FP8, 64, TRANSPORT == NVSHMEM)
    if TRANSPORT == NVSHMEM:
        # Step 2b: each staged row (its wire bytes) to slot (t, k) of source s.
        # Mapped s: the headers first, a fence, then the rows (as PEER). Unmapped s: one put per slot (header and row;
        # their bytes land in no given order: the receive's stamp check and s's COMB_DONE gate are what remain).
        tl.debug_barrier()
        mp = mapped(buffer_ptrs, s)
        if mp:
            _xfer_slots(slot_row_ptr, buffer_ptrs, signal_ptrs, status_ptr, rank, s, b, T, n_s, gone, comb_off, stage_off,
                        0, 16, sig_off + COMB_FULL + 2 * rank, K, BLOCK_T, CS, CH)
            tl.debug_barrier()
            fence_sys()
        hb = tl.where(mp, 16, 0)
        _xfer_slots(slot_row_ptr, buffer_ptrs, signal_ptrs, status_ptr, rank, s, b, T, n_s, gone, comb_off, stage_off,
                    hb, 16 + ROW_BYTES - hb, sig_off + COMB_FULL + 2 * rank, K, BLOCK_T, CS, CH)

    # Step 3: the last program of source s publishes: busy[s] = 1 here, full[rank] = 1 on s. NVSHMEM: no quiet (a
    # dead peer's puts never complete): the publish tells an unmapped s how many row puts to expect, and s waits
    # until that many have landed (docs/protocols.md, "NVSHMEM: no quiet on the hot path").
    tl.debug_barrier()
    if arrive_last(my_sig + COMB_SEND_CNT + s, tl.num_programs(1) * tl.num_programs(2)):
        # This call's signature into this rank's own entry (the same four words from each source's publishing program;
        # this rank's receive compares every expert rank's with it, the publish below copies it to s).
        sig_ss = _sig_stride(R)
        sig_sb = _comb_sig_word(R)
        _write_signature(my_sig, sig_sb, rank, sig_ss, call_sig0, call_sig1, call_sig2, call_sig3)
        if ((tl.load(status_ptr, volatile=True) == 0) & _live(status_ptr, rank, s)
                & (_receiver_done(signal_ptrs, s, sig_off, R, tl.load(stamp_ptr + s), status_ptr) == 0)):
            # enable_shrink: the ranks this rank masked by timeout travel with the signature (docs/protocols.md)
            _write_mask_bits(my_sig, sig_sb, rank, status_ptr, R, sig_ss)
            nw = _sig_payload_words(status_ptr, R)
            puts = 0
            if TRANSPORT == NVSHMEM:
                if tl.load(buffer_ptrs + s) == 0:
                    # one put per (t, k) with t < n_s and a local row (step 2b), counted from the same table
                    for t0 in range(0, n_s, BLOCK_T):
                        tt = t0 + tl.arange(0, BLOCK_T)
                        sr = tl.load(slot_row_ptr + (s * T + tt)[:, None] * K + kk[None, :],
                                     mask=(tt < n_s)[:, None] & (kk < K)[None, :], other=-1)
                        puts += tl.sum(tl.sum((sr >= 0).to(tl.int32), axis=1), axis=0)
                # the signature's put source: a copy rewritten only after s released this slot (BUSY waits above)
                copy_signature(signal_ptrs, buffer_ptrs, rank, sig_off, sig_sb, sig_copy_off + 4 * sig_ss * s, sig_ss, nw)
            tl.atomic_xchg(my_sig + COMB_BUSY + 2 * s, 1, sem="relaxed", scope="sys")
            publish(signal_ptrs, rank, s, sig_off, sig_sb, COMB_FULL + 2 * rank, 1, TRANSPORT, buffer_ptrs,
                    sig_copy_off + 4 * sig_ss * s, puts, sig_ss, nw)


@triton.jit
def _comb_recv_body_ll(
    buf_ptr,  # this rank's data region (uint8)
    topk_ptr, w_ptr,  # [N, K] int64 / float32
    out_ptr,  # [N, H] bf16 as int16
    signal_ptrs, status_ptr,
    wait_stats_ptr,  # [R] int64: ns this receive waited for each expert rank (accumulated), if HAS_WAIT_STATS
    stamp_ptr,  # [R + 1] int32: the dispatch handle's call stamps (entry R: this rank's stamp of this call)
    rank, N, R, E, timeout_ns,
    comb_off, sig_off,
    H: tl.constexpr, K: tl.constexpr, BLOCK_T: tl.constexpr, HC: tl.constexpr, HAS_WAIT_STATS: tl.constexpr,
    COMB_BUSY: tl.constexpr, COMB_FULL: tl.constexpr, COMB_RECV_CNT: tl.constexpr,
    FMT: tl.constexpr, OUT_F16: tl.constexpr, TRANSPORT: tl.constexpr,
):
    CS: tl.constexpr = (2 * H + 15) // 16 * 16 + 16
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    num_progs = tl.num_programs(0) * tl.num_programs(1)
    my_sig = _peer(signal_ptrs, rank, 0, tl.int32) + sig_off

    # Step 1: every expert rank has published its outputs for us, or is not live. Each program polls every rank
    # itself; the launch's verdict on each rank is made once, by the first program to reach one (compare-and-swap in
    # the rank's decision word, after the call-signature check: a rank that combined a different call sets the status
    # word, the output below is then NaN and the host raises naming it), and adopted by the others (docs/protocols.md,
    # "A late or dead peer"): no program waits for another program of this launch.
    base = _decision_base(tl.load(stamp_ptr + R), 1)  # stamp_ptr[R]: this rank's stamp of this call
    dec = _decision_words(status_ptr, R, sig_off, 1)
    sig_ss = _sig_stride(R)
    sig_sb = _comb_sig_word(R)
    t_start = 0
    if HAS_WAIT_STATS:
        t_start = now_ns()
    for p0 in range(0, R, 32):  # all of them at once, one lane each (32 a step)
        pe = p0 + tl.arange(0, 32)
        _decide_vec(dec, base, my_sig, COMB_FULL, status_ptr, rank, pe, pe < R, timeout_ns, signal_ptrs, R, sig_sb,
                    sig_ss, t_start, wait_stats_ptr, HAS_WAIT_STATS, TRANSPORT)
    tl.debug_barrier()

    # Step 2: weighted sum over k ascending in float32; holes (-1) add exactly 0 like the reference.
    # NOTES: launched with enable_fp_fusion=False: an FMA of w * y + acc would round differently.
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = offs_t < N
    ok = _status_ok(status_ptr, offs_t)
    offs_h = pid_h * HC + tl.arange(0, HC)
    h_ok = offs_h < H
    if FMT == 1:
        comb = buf_ptr.to(tl.pointer_type(tl.float16), bitcast=True) + comb_off // 2
    else:
        comb = buf_ptr.to(tl.pointer_type(tl.bfloat16), bitcast=True) + comb_off // 2
    comb8 = buf_ptr + comb_off
    comb32 = comb8.to(tl.pointer_type(tl.int32), bitcast=True)
    acc = tl.zeros([BLOCK_T, HC], dtype=tl.float32)
    # Which selections count, decided AFTER the waits (docs/protocols.md): expert id in [0, E), its rank live in
    # this launch's decision (a rank masked during program (0, 0)'s waits included), and slot (t, k)'s stamp is
    # this call's (this rank's stamp, written by that rank). A live rank's slot with another stamp was overwritten by a late
    # writer (or never written): the token is NaN and SEQ_STALE_ROW is reported; an id >= E makes the token NaN
    # and reports SEQ_BAD_EXPERT (both at the end, after the peers are released).
    L = E // R
    own = tl.load(stamp_ptr + R) << 16
    # NOTES: decided once, vectorised over k (a [BLOCK_T, 32] block), into one bit per k (``use``): per-k mask /
    # stamp loads inside the sum loop below made the builds spill (the sum loop is the original one plus a bit test).
    kk = tl.arange(0, KBITS)
    tk = t_ok[:, None] & (kk < K)[None, :]
    e2 = tl.load(topk_ptr + offs_t[:, None] * K + kk[None, :], mask=tk, other=-1)
    in_e = (e2 >= 0) & (e2 < E) & tk
    d2 = tl.where(in_e, e2 // L, 0).to(tl.int32)
    # enable_shrink: the ranks the live expert ranks (same call) masked by timeout (bits with their signatures) count as
    # masked in this launch: every program ORs the same bits (fixed during the launch: a sender rewrites its entry only
    # after this receive released it); the last program writes them into the mask words.
    d2m = tl.where(in_e, d2, -1)
    live2 = in_e & _decided_live(dec, d2m) & ~_adopted_like(my_sig, sig_sb, sig_ss, dec, status_ptr, rank, R, d2m)
    slot2 = offs_t.to(tl.int64)[:, None] * K + kk[None, :]
    st2 = tl.load(comb32 + slot2 * (CS // 4), mask=live2, other=0, volatile=True)
    v2 = live2 & (st2 == (own | (d2 + 1)))
    use = tl.sum(tl.where(v2, 1 << kk[None, :], 0), axis=1)  # disjoint bits: the sum is an OR
    badx = tl.max(((e2 >= E) & tk).to(tl.int32), axis=1) > 0
    tl.debug_barrier()
    for k in tl.static_range(K):
        e_k = tl.load(topk_ptr + offs_t * K + k, mask=t_ok, other=-1)
        w_k = tl.load(w_ptr + offs_t * K + k, mask=t_ok, other=0.0)
        v_k = (e_k >= 0) & t_ok & (((use >> k) & 1) != 0)
        m = (v_k & ok)[:, None] & h_ok[None, :]
        if FMT < 2:
            y = tl.load(comb + (offs_t.to(tl.int64) * K + k)[:, None] * (CS // 2) + 8 + offs_h[None, :], mask=m,
                        other=0.0).to(tl.float32)
        else:
            sb = (offs_t.to(tl.int64) * K + k) * CS + 16  # byte offset of slot (t, k)'s row
            b = tl.load(comb8 + sb[:, None] + offs_h[None, :], mask=m, other=0)
            if FMT == 2:
                sc = tl.load(comb32.to(tl.pointer_type(tl.float32), bitcast=True) + ((sb + H) // 4)[:, None]
                             + (offs_h // 128)[None, :], mask=m, other=0.0)
                y = e4m3_decode(b) * sc
            else:
                hb = tl.load(comb8 + (sb + H)[:, None] + (offs_h // 4)[None, :], mask=m, other=0).to(tl.int32)
                code = b.to(tl.int32) | (((hb >> ((offs_h % 4) * 2)[None, :]) & 3) << 8)
                w0 = (sb + H + H // 4) // 4
                lo = tl.load(comb32 + w0[:, None] + (offs_h // 64)[None, :], mask=m, other=0)
                st = tl.load(comb32 + (w0 + H // 64)[:, None] + (offs_h // 64)[None, :], mask=m, other=0)
                y = logfmt_decode_values(code, lo, st)
        acc += tl.where(v_k[:, None], w_k[:, None] * y, 0.0)
    # A row rewritten while it was read (a late writer racing this read) shows a changed stamp now: its writer
    # fenced its header before its row, this read fences the row reads before the header read.
    tl.debug_barrier()
    fence_sys()
    st3 = tl.load(comb32 + slot2 * (CS // 4), mask=live2, other=0, volatile=True)
    bad = (live2 & ~v2) | (v2 & (st3 != st2))
    stale = tl.max(bad.to(tl.int32), axis=1) > 0
    # A timed-out wait (now or earlier: the status word stays set) poisons the output with NaN, never
    # plausible zeros: inside a replayed CUDA graph no exception can say so.
    acc = tl.where((ok & ~stale & ~badx)[:, None], acc, float("nan"))
    if OUT_F16:
        bits = fp16_bits(acc)
    else:
        bits = _bf16_bits(acc)
    tl.store(out_ptr + offs_t.to(tl.int64)[:, None] * H + offs_h[None, :], bits, mask=t_ok[:, None] & h_ok[None, :])
    # Which report (after the store: the sum's registers are free again). A slot whose header (before the sum, or
    # after it for a slot that was current) names another writer that this rank has masked holds a masked rank's
    # late row: the token is NaN (the live row it overwrote is gone) and a masked-rank event is recorded, never a
    # device error. Any other stale slot is a device error (SEQ_STALE_ROW).
    e2 = tl.load(topk_ptr + offs_t[:, None] * K + kk[None, :], mask=bad, other=0)
    late = bad & _masked_writer(status_ptr, tl.where(v2, st3, st2), (e2 // L).to(tl.int32), R)
    fatal = tl.max((bad & ~late).to(tl.int32), axis=1) > 0
    flags = (tl.where(tl.max(fatal.to(tl.int32), axis=0) > 0, SEQ_STALE_ROW, 0)
             | tl.where(tl.max((stale & ~fatal).to(tl.int32), axis=0) > 0, SEQ_LATE_MASKED, 0)
             | tl.where(tl.max(badx.to(tl.int32), axis=0) > 0, SEQ_BAD_EXPERT, 0))
    if flags != 0:
        tl.atomic_or(status_ptr + STATUS_SEQ, flags, sem="relaxed", scope="gpu")

    # Step 3: the last program resets the full words and frees our area on every expert rank.
    tl.debug_barrier()
    if arrive_last(my_sig + COMB_RECV_CNT, num_progs):
        if tl.load(status_ptr + STATUS_SHRINK, volatile=True) != 0:
            # this call's combine is read: a row for it from now on is late, its sender drops it (_receiver_done)
            signal_release(my_sig + _done_word(R), (1 << 16) | (own >> 16))
        _finish_receive(my_sig, dec, COMB_FULL, COMB_BUSY + 2 * rank, status_ptr, rank, R, sig_off, sig_sb, sig_ss,
                        signal_ptrs, TRANSPORT)
        # The step is complete here (peers released: they are not cut short): report what was seen in it.
        w = tl.atomic_and(status_ptr + STATUS_SEQ, SEQ_MASK | SEQ_LATE_MASKED, sem="relaxed", scope="gpu")
        if (w & SEQ_BAD_EXPERT) != 0:
            report_error(status_ptr, _BAD_EXPERT)
        elif (w & SEQ_STALE_ROW) != 0:
            report_error(status_ptr, _STALE_ROW)


@triton.jit
def _ll_combine_send_fmt_kernel(
    x_ptr, stride_xl, stride_xr,  # [L, R*T, H] bf16 as int16, last dim contiguous
    slot_row_ptr, recv_tokens_ptr, stamp_ptr,  # from the dispatch receive
    buffer_ptrs, signal_ptrs, status_ptr,
    rank, T, R, timeout_ns,
    comb_off, sig_off,
    H: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BLOCK_T: tl.constexpr, HC: tl.constexpr,
    COMB_BUSY: tl.constexpr, COMB_FULL: tl.constexpr, COMB_SEND_CNT: tl.constexpr,
    FMT: tl.constexpr, IN_F16: tl.constexpr, NATIVE_FP8: tl.constexpr,
    stage_off=0,  # bytes: [L * R*T, 16 + 2H] combine staging of this slot (stamp header + row) (NVSHMEM)
    TRANSPORT: tl.constexpr = 0, CH: tl.constexpr = 1024, ROW_BYTES: tl.constexpr = 0,  # ROW_BYTES: wire bytes per row
    sig_copy_off=0,  # bytes: this slot's [R, 4 sig_stride(R) bytes] signature copies, the publish puts' sources (NVSHMEM)
    call_sig0=0, call_sig1=0, call_sig2=0, call_sig3=0,  # this call's signature (hidden, T, E * 256 + K, flags)
):
    """Any combine format (``FMT``: :mod:`moe_ep.kernels.logfmt` codes) and transport: see :func:`_comb_send_body_ll`."""
    _comb_send_body_ll(x_ptr, stride_xl, stride_xr, slot_row_ptr, recv_tokens_ptr, stamp_ptr, buffer_ptrs,
                       signal_ptrs,
                       status_ptr, rank, T, R, timeout_ns, comb_off, sig_off, H, K, KP, BLOCK_T, HC, COMB_BUSY,
                       COMB_FULL, COMB_SEND_CNT, FMT, IN_F16, NATIVE_FP8, stage_off, TRANSPORT, CH, ROW_BYTES,
                       sig_copy_off, call_sig0, call_sig1, call_sig2, call_sig3)


@triton.jit
def _ll_combine_recv_fmt_kernel(
    buf_ptr,  # this rank's data region (uint8)
    topk_ptr, w_ptr,  # [N, K] int64 / float32
    out_ptr,  # [N, H] bf16 as int16
    signal_ptrs, status_ptr,
    wait_stats_ptr,  # [R] int64: ns this receive waited for each expert rank (accumulated), if HAS_WAIT_STATS
    stamp_ptr,  # [R + 1] int32: the dispatch handle's call stamps
    rank, N, R, E, timeout_ns,
    comb_off, sig_off,
    H: tl.constexpr, K: tl.constexpr, BLOCK_T: tl.constexpr, HC: tl.constexpr, HAS_WAIT_STATS: tl.constexpr,
    COMB_BUSY: tl.constexpr, COMB_FULL: tl.constexpr, COMB_RECV_CNT: tl.constexpr,
    FMT: tl.constexpr, OUT_F16: tl.constexpr, TRANSPORT: tl.constexpr = 0,
):
    """Any combine format (``FMT``: :mod:`moe_ep.kernels.logfmt` codes) and transport: see :func:`_comb_recv_body_ll`."""
    _comb_recv_body_ll(buf_ptr, topk_ptr, w_ptr, out_ptr, signal_ptrs, status_ptr, wait_stats_ptr, stamp_ptr,
                       rank, N, R, E, timeout_ns, comb_off, sig_off, H, K, BLOCK_T, HC, HAS_WAIT_STATS, COMB_BUSY, COMB_FULL,
                       COMB_RECV_CNT, FMT, OUT_F16, TRANSPORT)
