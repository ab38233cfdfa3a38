"""Low-latency (decode) dispatch / combine kernels of the ``symm`` and ``nvshmem`` backends.

Written once for both transports (``TRANSPORT``: peer-pointer stores, or NVSHMEM puts from this rank's own
symmetric memory; every difference lives in :mod:`moe_ep.kernels.transport`). Four launches, each one *phase* of
the signalling protocol (a launch only waits on signals written by earlier launches, DESIGN.md "Phase rule"),
the receives releasing their sources' slots themselves (on NVSHMEM with put-with-signal, so they link NVSHMEM's
bitcode like the sends); :func:`_ll_quiet_kernel` (NVSHMEM only) completes this PE's puts before a rejoin:

- :func:`_ll_dispatch_send_kernel` (source rank ``s``): casts BF16 tokens to FP8 (1x128 groups, DeepEP's numerics:
  :func:`moe_ep.kernels.fp8_cast.ll_group_scales`, bitwise equal to :func:`moe_ep.fp8.ll_dispatch_quant_ref`) and
  writes each token ONCE per destination rank (not per expert) into slot ``(s, t)`` of that rank's message area,
  with a header
  holding the token's top-k experts (+1; 0 = none) and, per k, its position among ``s``'s tokens of that expert
  (only ranks that hold one of its experts get the message; a receiver clears the headers it read);
  a token block's payload is shared by ``num_splits`` programs, whole column tiles each (peer stores only; split 0
  writes the headers: every byte has one writer, and every program waits for the slot to be free itself);
  extra "count" programs write ``s``'s per-expert token counts into each destination's count table.
- :func:`_ll_dispatch_recv_kernel` (destination ``d``): places row ``(s, t, k)`` of local expert ``e`` at
  ``sum_{s' < s} count[s'][e] + pos`` of ``recv_x[e]`` (source rank, then token order: the masked
  layout of the torch backend), copies the scales column-major, fills ``recv_count`` and the handle's
  ``slot_row`` table (where each ``(s, t, k)`` landed) for the combine.
- :func:`_ll_combine_send_fmt_kernel` (expert rank ``d``): copies each expert output row back to slot
  ``(t, k)`` of its source rank's combine area `[T, K, 2H bytes]` (each slot has exactly one writer rank; its
  columns may be shared by a few programs, each writing the slot's stamp header before its columns): BF16 or
  FP16 as it is, or encoded per channel group (``FMT``: FP8 with 1x128 scales, LogFMT-10 with 64-channel
  groups; formats in :mod:`moe_ep.kernels.logfmt`).
- :func:`_ll_combine_recv_fmt_kernel` (source ``s``): decodes each slot to float32, then ``out[t] = sum_k w[t, k] *
  y[t, k]`` in float32, k ascending, holes skipped, one rounding to BF16 or FP16
  (``OUT_F16``; compiled without FMA contraction, so equal to the torch reference bitwise).

Signals (int32 words of each rank's signal region; ``sig_off`` selects the double-buffer slot):

    DISP_FULL  + 2s  on receiver d: source s's tokens are in (value stamp_s << 16 | N_s + 1); receiver resets to 0
    DISP_BUSY  + 2d  on sender s: d has not drained s's slot yet (1); d resets it to 0 after reading
    COMB_FULL  + 2d  on source s: expert rank d's outputs are in (1); s resets to 0
    COMB_BUSY  + 2s  on expert rank d: s has not drained d's outputs yet (1); s resets to 0
    *_CNT            local arrive_last counters (nobody waits on them)
    DISP_SIG / COMB_SIG + SIG_STRIDE r   on every receiver: the call signature of rank r (hidden, T,
                     E * 256 + K, flags), then (enable_shrink) r's timeout-masked ranks as bits, copied there by r
                     before it releases FULL; the receiver compares the signature with its own entry (written by its
                     own send's publishing program, from the kernel's ``call_sig*`` arguments) and reports a mismatch in its
                     status word (``STATUS_SIG_MISMATCH - r``)
                     instead of reading rows laid out for another call; it adopts the mask bits of live senders
                     (docs/protocols.md, "Agreement across survivors")

NOTES: every data write precedes a ``tl.debug_barrier()`` and then the release of the signal by one
program (``arrive_last`` chains the other programs' writes to it), and every read follows an acquire
(``wait_ne``) plus a barrier. A timed-out wait leaves ``status`` set: the program masks its writes,
and the last program does not publish, so peers time out too (naming this rank) instead of reading
half-written data.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .fp8_cast import e4m3_byte, ll_group_scales
from .low_latency_common import (  # noqa: F401 - GROUP, LL_MAXNREG, SIG_WORDS, signal_layout: the API of this module
    GROUP,
    LL_MAXNREG,
    SIG_WORDS,
    _adopt_masks,
    _disp_sig_word,
    _live,
    _live_like,
    _live_vec,
    _reset_fulls,
    _scratch_word,
    _sig_payload_words,
    _sig_stride,
    _signature_differs,
    _clear_signature,
    _decide_vec,
    _decided_live,
    _decision_base,
    _decision_reset,
    _decision_words,
    _status_ok,
    _wait_vec,
    _write_mask_bits,
    _write_signature,
    signal_layout,
)
from .nvshmem_device import quiet
from .signals import (
    SEQ_BAD_EXPERT,
    SEQ_MASK,
    STATUS_SEQ,
    arrive_last,
)
from .transport import NVSHMEM, PEER, copy_signature, publish, xfer
from .transport import peer_ptr as _peer

__all__ = [
    "signal_layout",
    "LL_MAXNREG",
    "_ll_dispatch_send_kernel",
    "_ll_dispatch_recv_kernel",
    "_ll_combine_send_fmt_kernel",
    "_ll_combine_recv_fmt_kernel",
    "_ll_quiet_kernel",
]


@triton.jit
def _quant_groups(y, ROUND_SCALE: tl.constexpr, NATIVE_FP8: tl.constexpr):
    """``y`` float32 `[BT, GC, 128]` -> (e4m3 bytes uint8 `[BT, GC, 128]`, scales float32 `[BT, GC]`).

    DeepEP's cast (``scale_inv = amax * (1 / 448)``, bytes of ``x * (448 / amax)``;
    :func:`moe_ep.kernels.fp8_cast.ll_group_scales`), bitwise equal to :func:`moe_ep.fp8.ll_dispatch_quant_ref`."""
    v, scale_inv = ll_group_scales(y, ROUND_SCALE)
    return e4m3_byte(v, NATIVE_FP8), scale_inv


@triton.jit
def _dispatch_puts(topk_ptr, N, L, d, K: tl.constexpr, KP: tl.constexpr, CHUNK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """(``NVSHMEM``) how many data puts this launch sent to unmapped rank ``d``: one message per token with an expert
    on ``d`` (step 5b) and one count put per count program whose expert block meets ``d``'s experts (step 2')."""
    kk = tl.arange(0, KP)
    n = tl.zeros([CHUNK_T], dtype=tl.int32)
    for c0 in range(0, N, CHUNK_T):
        offs_c = c0 + tl.arange(0, CHUNK_T)
        ci = tl.load(topk_ptr + offs_c[:, None] * K + kk[None, :], mask=(offs_c < N)[:, None] & (kk < K)[None, :],
                     other=-1).to(tl.int32)
        n += (tl.max(((ci >= 0) & (ci // L == d)).to(tl.int32), axis=1) > 0).to(tl.int32)
    return tl.sum(n, axis=0) + (d * L + L - 1) // BLOCK_E - (d * L) // BLOCK_E + 1


@triton.jit
def _first_dests(topk_ptr, offs_t, send_ok, status_ptr, rank, L, E, R, K: tl.constexpr, TRANSPORT: tl.constexpr):
    """Per token, bit ``k`` set: the send writes selection ``k``'s destination rank (``PEER``: the first selection of
    each live destination rank, each selection's expert read as a [BLOCK_T] vector from global, compared
    element-wise with the earlier ones; ``NVSHMEM``: bit 0 = the token goes anywhere: staged once in this rank's own
    slot). Only tokens of ``send_ok``."""
    first = tl.zeros_like(offs_t)
    if TRANSPORT == PEER:
        for k in tl.static_range(K):
            e_k = tl.load(topk_ptr + offs_t * K + k, mask=send_ok, other=-1).to(tl.int32)
            d_k = tl.where((e_k >= 0) & (e_k < E), e_k // L, -1)
            dup = d_k < 0
            for j in tl.static_range(k):
                e_j = tl.load(topk_ptr + offs_t * K + j, mask=send_ok, other=-1).to(tl.int32)
                dup = dup | ((e_j >= 0) & (e_j // L == d_k))
            first = first | tl.where(~dup & _live_vec(status_ptr, rank, d_k, R), 1 << k, 0)
    else:
        for k in tl.static_range(K):
            e_k = tl.load(topk_ptr + offs_t * K + k, mask=send_ok, other=-1)
            first = first | tl.where(e_k >= 0, 1, 0)
        first = tl.where(_live_like(status_ptr, rank, rank, offs_t), first, 0)
    return first


@triton.jit
def _dest_row(buffer_ptrs, topk_ptr, offs_t, m_k, rank, row_b, L, K: tl.constexpr, k: tl.constexpr,
              TRANSPORT: tl.constexpr, DTYPE: tl.constexpr):
    """``DTYPE`` pointer (16-aligned: the compiler may vectorise through it) to byte ``row_b`` (per token) in the
    region of selection ``k``'s destination rank (``PEER``; lanes outside ``m_k``: 0) or of this rank (``NVSHMEM``:
    staging). The destination is re-read from global as a [BLOCK_T] vector each time (L1 hits), never extracted
    from a register tile."""
    if TRANSPORT == PEER:
        d = tl.load(topk_ptr + offs_t * K + k, mask=m_k, other=0) // L
    else:
        d = offs_t.to(tl.int64) * 0 + rank
    return tl.multiple_of((tl.load(buffer_ptrs + d, mask=m_k, other=0) + row_b).to(tl.pointer_type(DTYPE)), 16)


@triton.jit
def _ll_dispatch_send_kernel(
    x_ptr,  # [N, H] bf16 (int16 view when not IS_FP8)
    topk_ptr,  # [N, K] int64
    buffer_ptrs, signal_ptrs, status_ptr,
    stamp_ptr,  # [R + 1] int32 (the handle's call_stamps): entry R = this call's stamp (written here)
    rank, N, T, L, E, R,
    num_token_progs,  # token programs: ceil(N / BLOCK_T) token blocks x num_splits column splits
    num_splits,  # column splits of a token block's payload (1 with NVSHMEM: one staged message per token)
    timeout_ns,
    cnt_off, msg_off, sig_off,  # bytes / bytes / words of this slot
    H: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, MSG: tl.constexpr, HDR: tl.constexpr,
    BLOCK_T: tl.constexpr, CHUNK_T: tl.constexpr, BLOCK_E: tl.constexpr, GC: tl.constexpr, HC: tl.constexpr,
    IS_FP8: tl.constexpr, ROUND_SCALE: tl.constexpr, USE_UE8M0: tl.constexpr, NATIVE_FP8: tl.constexpr,
    DISP_BUSY: tl.constexpr, DISP_FULL: tl.constexpr, DISP_SEND_CNT: tl.constexpr,
    stage_off=0,  # bytes: [E] int32 count staging of this slot (TRANSPORT == NVSHMEM)
    TRANSPORT: tl.constexpr = 0, CH: tl.constexpr = 1024,  # PEER / NVSHMEM (moe_ep.kernels.transport); copy chunk
    sig_copy_off=0,  # bytes: this slot's 16-byte copy of the signature, the publish put's source (NVSHMEM)
    call_sig0=0, call_sig1=0, call_sig2=0, call_sig3=0,  # this call's signature (hidden, T, E * 256 + K, flags)
):
    pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    my_sig = _peer(signal_ptrs, rank, 0, tl.int32) + sig_off

    # Step 1: every destination has drained this slot (its receive reset our busy word): all of them polled at once,
    # one lane each (32 a step).
    for p0 in range(0, R, 32):
        pe = p0 + tl.arange(0, 32)
        _, _ = _wait_vec(my_sig + DISP_BUSY + 2 * pe, 1, pe < R, pe, status_ptr, rank, timeout_ns, signal_ptrs, R)
    tl.debug_barrier()

    kk = tl.arange(0, KP)
    k_ok = kk < K
    if pid < num_token_progs:
        # Step 2: this block's routing. Program (tb, sp): token block tb, column split sp of the payload; split 0 also
        # writes the headers. Every program writes only its own bytes (no program waits on another's work).
        tb = pid // num_splits
        sp = pid % num_splits
        offs_t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = offs_t < N
        ok = _status_ok(status_ptr, offs_t)
        tk_mask = t_ok[:, None] & k_ok[None, :]
        idx = tl.load(topk_ptr + offs_t[:, None] * K + kk[None, :], mask=tk_mask, other=-1).to(tl.int32)
        # An expert id >= E (host checks off / graph capture) goes nowhere; it is remembered in the status word's
        # SEQ_BAD_EXPERT bit and reported by this rank's next combine receive, once the step is complete on every
        # rank (reporting here would stop this rank's publish and make the peers time out).
        if tl.max(((idx >= E) & tk_mask).to(tl.int32)) > 0:
            tl.atomic_or(status_ptr + STATUS_SEQ, SEQ_BAD_EXPERT, sem="relaxed", scope="gpu")

        # Step 3: pos[t, k] = earlier tokens of this rank that selected the same expert (split 0 only: the header's).
        own = tl.reshape(idx, [BLOCK_T * KP])
        own_t = tl.reshape(offs_t[:, None] + kk[None, :] * 0, [BLOCK_T * KP])
        acc = tl.zeros([BLOCK_T * KP], dtype=tl.int32)
        for c0 in range(0, tl.where(sp == 0, tb * BLOCK_T + BLOCK_T, 0), CHUNK_T):
            offs_c = c0 + tl.arange(0, CHUNK_T)
            ci = tl.load(topk_ptr + offs_c[:, None] * K + kk[None, :], mask=(offs_c < N)[:, None] & k_ok[None, :],
                         other=-1).to(tl.int32)
            ci = tl.reshape(ci, [CHUNK_T * KP])
            ct = tl.reshape(offs_c[:, None] + kk[None, :] * 0, [CHUNK_T * KP])
            hit = (own[:, None] == ci[None, :]) & (ct[None, :] < own_t[:, None]) & (ci[None, :] >= 0)
            acc += tl.sum(hit.to(tl.int32), axis=1)
        pos = tl.reshape(acc, [BLOCK_T, KP])

        # Step 4: header (top-k experts + 1, 0 = none; positions) to every rank that holds any of the token's experts
        # (the receiver reads the headers of all its sources' tokens and clears the expert words after reading:
        # a token that did not come is an all-zero header). The destinations, per selection k: bit k of ``first``
        # (decided once per program, the live set read once, no cross-thread reduction), each destination's address
        # then re-read per k as a [BLOCK_T] vector from global (see _dest_row).
        # NVSHMEM: staged once, in this rank's own slot (rank, t) (the same offset as on every peer), see step 5b:
        # every token's header (all-zero experts for one that goes nowhere): the own receive does not clear these
        # rows, they are the sources of this slot's puts (see the receive, step 3).
        row = (rank * T + offs_t).to(tl.int64)
        row_b = msg_off + row * MSG
        send_ok = t_ok & ok
        first = _first_dests(topk_ptr, offs_t, send_ok, status_ptr, rank, L, E, R, K, TRANSPORT)
        if TRANSPORT == PEER:
            hfirst = tl.where(sp == 0, first, 0)
        else:
            hfirst = tl.where(send_ok & _live_like(status_ptr, rank, rank, offs_t), 1, 0)
        for k in tl.static_range(K if TRANSPORT == PEER else 1):
            m_k = ((hfirst >> k) & 1) != 0
            p = _dest_row(buffer_ptrs, topk_ptr, offs_t, m_k, rank, row_b + HDR, L, K, k, TRANSPORT,
                          tl.int32)[:, None] + kk[None, :]
            tl.store(p, idx + 1, mask=m_k[:, None] & k_ok[None, :])
            tl.store(p + K, pos, mask=m_k[:, None] & k_ok[None, :])

        # Step 5: payload, once per destination rank that holds any of the token's experts (NVSHMEM: staged once);
        # this program's share: whole GC-group (HC-column) tiles [sp * per, (sp + 1) * per).
        if IS_FP8:
            G = H // GROUP
            offs_c = tl.arange(0, GROUP)
            g_per = tl.cdiv(tl.cdiv(G, GC), num_splits) * GC
            for g0 in range(sp * g_per, tl.minimum(G, sp * g_per + g_per), GC):
                offs_g = g0 + tl.arange(0, GC)
                g_ok = offs_g < G
                cols = offs_g[:, None] * GROUP + offs_c[None, :]
                y = tl.load(x_ptr + offs_t.to(tl.int64)[:, None, None] * H + cols[None, :, :],
                            mask=t_ok[:, None, None] & g_ok[None, :, None], other=0.0).to(tl.float32)
                q, scale = _quant_groups(y, ROUND_SCALE, NATIVE_FP8)
                if USE_UE8M0:
                    # Groups 4w..4w+3 -> int32 word w (group g in byte g % 4); padding groups pack as 0.
                    exps = (scale.to(tl.int32, bitcast=True) >> 23) & 0xFF
                    exps = tl.where(g_ok[None, :], exps, 0)
                    exps = tl.reshape(exps, [BLOCK_T, GC // 4, 2, 2])
                    even, odd = tl.split(exps)
                    e0, e2 = tl.split(even)
                    e1, e3 = tl.split(odd)
                    words = e0 | (e1 << 8) | (e2 << 16) | (e3 << 24)
                    offs_w = g0 // 4 + tl.arange(0, GC // 4)
                    w_ok = offs_w < (G + 3) // 4
                for k in tl.static_range(K if TRANSPORT == PEER else 1):
                    m_k = ((first >> k) & 1) != 0
                    a_k = _dest_row(buffer_ptrs, topk_ptr, offs_t, m_k, rank, row_b, L, K, k, TRANSPORT, tl.uint8)
                    tl.store(a_k[:, None, None] + cols[None, :, :], q, mask=m_k[:, None, None] & g_ok[None, :, None])
                    s_at = (a_k + H).to(tl.pointer_type(tl.int32), bitcast=True)
                    if USE_UE8M0:
                        tl.store(s_at[:, None] + offs_w[None, :], words, mask=m_k[:, None] & w_ok[None, :])
                    else:
                        tl.store(s_at.to(tl.pointer_type(tl.float32), bitcast=True)[:, None] + offs_g[None, :], scale,
                                 mask=m_k[:, None] & g_ok[None, :])
        else:
            h_per = tl.cdiv(tl.cdiv(H, HC), num_splits) * HC
            for h0 in range(sp * h_per, tl.minimum(H, sp * h_per + h_per), HC):
                offs_h = h0 + tl.arange(0, HC)
                h_ok = offs_h < H
                v = tl.load(x_ptr + offs_t.to(tl.int64)[:, None] * H + offs_h[None, :],
                            mask=t_ok[:, None] & h_ok[None, :], other=0)
                for k in tl.static_range(K if TRANSPORT == PEER else 1):
                    m_k = ((first >> k) & 1) != 0
                    a_k = _dest_row(buffer_ptrs, topk_ptr, offs_t, m_k, rank, row_b, L, K, k, TRANSPORT, tl.int16)
                    tl.store(a_k[:, None] + offs_h[None, :], v, mask=m_k[:, None] & h_ok[None, :])
        if TRANSPORT == NVSHMEM:
            # Step 5b: the staged message of each token (payload, then the header at HDR: one put) to every other
            # live rank that holds any of its experts.
            tl.debug_barrier()
            for i in range(BLOCK_T):
                t = tb * BLOCK_T + i
                if (t < N) & (tl.load(status_ptr, volatile=True) == 0):
                    idx_i = tl.load(topk_ptr + t * K + kk, mask=k_ok, other=-1).to(tl.int32)
                    row_i = msg_off + (rank * T + t).to(tl.int64) * MSG
                    for d in range(R):
                        if (d != rank) & _live(status_ptr, rank, d):
                            if tl.max(((idx_i >= 0) & (idx_i // L == d)).to(tl.int32), axis=0) > 0:
                                xfer(buffer_ptrs, signal_ptrs, rank, d, row_i, row_i, HDR + 8 * K,
                                     sig_off + DISP_FULL + 2 * rank, CH)
    else:
        # Step 2': count programs: this rank's tokens per expert, into each owner's count table [R, L].
        offs_e = (pid - num_token_progs) * BLOCK_E + tl.arange(0, BLOCK_E)
        hist = tl.zeros([BLOCK_E], dtype=tl.int32)
        for c0 in range(0, N, CHUNK_T):
            offs_c = c0 + tl.arange(0, CHUNK_T)
            ci = tl.load(topk_ptr + offs_c[:, None] * K + kk[None, :], mask=(offs_c < N)[:, None] & k_ok[None, :],
                         other=-1).to(tl.int32)
            ci = tl.reshape(ci, [CHUNK_T * KP])
            hist += tl.sum((offs_e[:, None] == ci[None, :]).to(tl.int32), axis=1)
        # NOTES: the status word is read after the loop, not before: kept live across it, it was the one value
        # ptxas spilled (4 B) in the BF16 build. Reading it later only sees a timeout sooner.
        e_ok = (offs_e < E) & _status_ok(status_ptr, offs_e)
        if TRANSPORT == PEER:
            for d in range(R):
                m = e_ok & (offs_e // L == d) & _live_like(status_ptr, rank, d, offs_e)
                base = _peer(buffer_ptrs, d, 0, tl.int32)
                tl.store(base + cnt_off // 4 + rank * L + (offs_e - d * L), hist, mask=m)
        else:
            # staged in this rank's count staging area, then each owner's share of this block to its row ``rank``
            tl.store(_peer(buffer_ptrs, rank, 0, tl.int32) + stage_off // 4 + offs_e, hist, mask=e_ok)
            tl.debug_barrier()
            e0 = (pid - num_token_progs) * BLOCK_E
            if tl.load(status_ptr, volatile=True) == 0:
                for d in range(R):
                    lo = tl.maximum(e0, d * L)
                    hi = tl.minimum(tl.minimum(e0 + BLOCK_E, d * L + L), E)
                    if (lo < hi) & _live(status_ptr, rank, d):
                        xfer(buffer_ptrs, signal_ptrs, rank, d, cnt_off + (rank * L + lo - d * L).to(tl.int64) * 4,
                             stage_off + lo.to(tl.int64) * 4, (hi - lo) * 4, sig_off + DISP_FULL + 2 * rank, CH)

    # Step 6: the last program publishes: busy[d] = 1 here, then full[rank] = N + 1 on every d. NVSHMEM: no quiet
    # (a dead peer's puts never complete): the publish tells each unmapped d how many data puts to expect, and d
    # waits until that many have landed (docs/protocols.md, "NVSHMEM: no quiet on the hot path").
    tl.debug_barrier()
    if arrive_last(my_sig + DISP_SEND_CNT, num_progs):
        # This call's stamp: the rank's dispatch counter (status word STATUS_SEQ, 15 bits), read and advanced by the
        # last program only (every other program has arrived, so a CUDA-graph replay gets a fresh stamp too). It
        # travels in the FULL value's high half; expert ranks write it back into every combine row (docs/protocols.md).
        w = tl.load(status_ptr + STATUS_SEQ, volatile=True)
        seq = w & SEQ_MASK
        tl.store(status_ptr + STATUS_SEQ, (w - seq) | ((seq + 1) & SEQ_MASK))
        tl.store(stamp_ptr + R, seq)
        # This call's signature into this rank's own entry (this rank's receive compares every source's with it; the
        # publish below copies it to every peer): written here, no host write per call.
        sig_ss = _sig_stride(R)
        sig_sb = _disp_sig_word(R)
        _write_signature(my_sig, sig_sb, rank, sig_ss, call_sig0, call_sig1, call_sig2, call_sig3)
        if tl.load(status_ptr, volatile=True) == 0:
            # enable_shrink: the ranks this rank masked by timeout travel with the signature (docs/protocols.md,
            # "Agreement across survivors")
            _write_mask_bits(my_sig, sig_sb, rank, status_ptr, R, sig_ss)
            nw = _sig_payload_words(status_ptr, R)
            if TRANSPORT == NVSHMEM:
                copy_signature(signal_ptrs, buffer_ptrs, rank, sig_off, sig_sb, sig_copy_off, sig_ss, nw)
            for d in range(R):
                if _live(status_ptr, rank, d):
                    puts = 0
                    if TRANSPORT == NVSHMEM:
                        if (d != rank) & (tl.load(buffer_ptrs + d) == 0):
                            puts = _dispatch_puts(topk_ptr, N, L, d, K, KP, CHUNK_T, BLOCK_E)
                    tl.atomic_xchg(my_sig + DISP_BUSY + 2 * d, 1, sem="relaxed", scope="sys")
                    publish(signal_ptrs, rank, d, sig_off, sig_sb, DISP_FULL + 2 * rank,
                            (seq << 16) | (N + 1), TRANSPORT, buffer_ptrs, sig_copy_off, puts, sig_ss, nw)


@triton.jit
def _ll_quiet_kernel():
    """(``NVSHMEM`` transport) ``nvshmem_quiet``: every put this PE issued is complete when it returns. Not on the hot
    path (no low-latency kernel quiets: docs/protocols.md, "NVSHMEM: no quiet on the hot path"); launched by
    ``low_latency_clean_mask_buffer`` before the host barrier that precedes the zeroing, so no put of a returning
    rank's last (masked) call lands on a word after it was zeroed."""
    quiet()


# The dispatch receive and the combine kernels live in their own files; this module stays the one place callers import
# every low-latency kernel from.
from .low_latency_dispatch_recv import _ll_dispatch_recv_kernel  # noqa: E402
from .low_latency_combine import (  # noqa: E402
    _ll_combine_recv_fmt_kernel,
    _ll_combine_send_fmt_kernel,
)
