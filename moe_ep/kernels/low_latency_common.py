"""Shared pieces of the low-latency kernels (:mod:`moe_ep.kernels.low_latency` for dispatch,
:mod:`moe_ep.kernels.low_latency_combine` for combine): the signal layout of one double-buffer slot, the call
signature words, the rank-mask and status helpers, the bounded wait and the BF16 rounding."""

from __future__ import annotations

import triton
import triton.language as tl

from .signals import (
    MASK_TIMEOUT,
    STATUS_MASK,
    STATUS_SHRINK,
    load_acquire,
    peer_masked,
    report_error,
    wait_ne,
    wait_ne_masked,
    wait_vec,
    _lanes,
)
from .transport import peer_ptr as _peer
from .transport import release_peers

__all__ = ["GROUP", "LL_MAXNREG", "SIG_WORDS", "signal_layout", "sig_stride"]

GROUP = tl.constexpr(128)


#: ``maxnreg`` every low-latency kernel launches with on a GPU (and the sm90 report compiles with). Without an explicit
#: cap the ptxas of Triton 3.6 allocates 40-128 registers to the receive kernels and the LogFMT send and spills
#: 4-44 bytes per thread inside their wait and copy loops; with it none spills (56 -> 95 registers for the FP8
#: dispatch receive, 128 -> 168 for the combine receive). The same cap NVSHMEM-linked kernels need.
LL_MAXNREG = 255

SIG_WORDS = 4  # call signature words: hidden, T, E * 256 + K, kind and format flags
_TIMEOUT = tl.constexpr(MASK_TIMEOUT)  # (jit code reads constexpr globals only)


def sig_stride(world_size: int) -> int:
    """Words per signature entry: the ``SIG_WORDS`` call signature, then ``ceil(R / 32)`` words of "ranks the sender
    has masked by timeout" bits (enable_shrink; docs/protocols.md "Agreement across survivors"), rounded up to 4
    words (16-byte aligned entries and put payloads). The kernels compute it as ``_sig_stride(R)``."""
    return (SIG_WORDS + (world_size + 31) // 32 + 3) // 4 * 4


def signal_layout(world_size: int) -> dict:
    """Word offsets (inside one double-buffer slot) of the signal arrays, and the slot's size.

    The four arrays that peers write (``DISP_FULL``, ``DISP_BUSY``, ``COMB_FULL``, ``COMB_BUSY``) hold one 64-bit,
    8-byte aligned word per rank (entry ``r`` at word ``X + 2 r``): NVSHMEM's signal words are 64-bit
    (``nvshmemx_putmem_signal_nbi_block`` sets all of it); kernels read and write the low 32 bits (little endian,
    values < 2**31, the high half stays 0). ``SCRATCH + 2 r``: where rank ``r``'s bare signals (no payload of their
    own) put their 8 dummy bytes on the ``nvshmem`` transport."""
    R = world_size
    lay = {"DISP_FULL": 0, "DISP_BUSY": 2 * R, "COMB_FULL": 4 * R, "COMB_BUSY": 6 * R, "COMB_SEND_CNT": 8 * R,
           "DISP_SEND_CNT": 9 * R, "DISP_RECV_CNT": 9 * R + 1, "COMB_RECV_CNT": 9 * R + 2,
           "HEARTBEAT": 9 * R + 3,  # kernels compute it as _hb_word(R)
           # enable_shrink: ``1 << 16 | stamp`` of the last combine this rank received in this slot (written by the
           # receive's last program; a sender reads it before writing rows: docs/protocols.md, "late rows")
           "COMB_DONE": 9 * R + 4,  # kernels compute it as _done_word(R)
           "SCRATCH": (9 * R + 6) // 2 * 2,
           # call signatures (SIG_WORDS words per rank; kernels compute the offsets as below): entry r on a
           # receiver holds what rank r called; the entry of the receiver itself holds its own call
           "DISP_SIG": (9 * R + 6) // 2 * 2 + 2 * R}
    lay["SIG_STRIDE"] = sig_stride(R)  # words per signature entry (entry r at X_SIG + SIG_STRIDE * r)
    lay["COMB_SIG"] = lay["DISP_SIG"] + lay["SIG_STRIDE"] * R  # (the jit twins below compute the same offsets)
    lay["SLOT_WORDS"] = (lay["COMB_SIG"] + lay["SIG_STRIDE"] * R + 7) // 8 * 8
    return lay


@triton.jit
def _hb_word(R):
    """Word of this rank's heartbeat inside a slot (``signal_layout``'s ``HEARTBEAT``)."""
    return 9 * R + 3


@triton.jit
def _done_word(R):
    """Word of this rank's "combine received" stamp inside a slot (``signal_layout``'s ``COMB_DONE``)."""
    return 9 * R + 4


@triton.jit
def _scratch_word(R):
    """First word of the dummy-payload area (``SCRATCH``): 8-byte aligned, 2 words per rank."""
    return (9 * R + 6) // 2 * 2


@triton.jit
def _disp_sig_word(R):
    """First word of the dispatch call signatures (``DISP_SIG``)."""
    return (9 * R + 6) // 2 * 2 + 2 * R


@triton.jit
def _sig_stride(R):
    """Words per signature entry (``sig_stride``): 4 signature words, ``ceil(R / 32)`` mask-bit words, 16-aligned.
    NOTES: callers compute it once per program and pass it on: each nested jit call costs ~1 ms in the
    interpreter (the CPU tests' time), nothing on a GPU."""
    return (4 + (R + 31) // 32 + 3) // 4 * 4


@triton.jit
def _comb_sig_word(R):
    """First word of the combine call signatures (``COMB_SIG``)."""
    return (9 * R + 6) // 2 * 2 + 2 * R + (4 + (R + 31) // 32 + 3) // 4 * 4 * R  # + _sig_stride(R) * R


@triton.jit
def _clear_signature(my_sig, base, r, stride):
    """Zero entry ``r`` (``stride`` words: ``_sig_stride(R)``) of a signature area (idle signal words are all zero
    between calls). Only the caller decides when: after an error the entries stay, so the host can name the fields
    that differ."""
    for w0 in range(0, stride, 16):  # (one vector store up to 352 ranks)
        w = w0 + tl.arange(0, 16)
        tl.store(my_sig + base + stride * r + w, tl.zeros([16], tl.int32), mask=w < stride)


@triton.jit
def _write_signature(my_sig, base, rank, stride, w0, w1, w2, w3):
    """This rank's call signature (4 words) into its own entry of a signature area (the send's publishing program,
    before it publishes: the publish copies the entry to the peers)."""
    at = my_sig + base + stride * rank
    tl.store(at, w0)
    tl.store(at + 1, w1)
    tl.store(at + 2, w2)
    tl.store(at + 3, w3)


@triton.jit
def _signature_differs(my_sig, base, rank, src, stride=4):
    """Whether source ``src``'s published call signature differs from this rank's (after the FULL acquire);
    ``stride``: words per entry (4 in normal mode, ``_sig_stride(R)`` in low latency)."""
    diff = tl.full([], 0, tl.int32)
    for w in tl.static_range(4):
        a = tl.load(my_sig + base + stride * src + w, volatile=True)
        b = tl.load(my_sig + base + stride * rank + w, volatile=True)
        diff = diff | (a != b).to(tl.int32)
    return diff != 0


# Masks travel with the calls (enable_shrink; docs/protocols.md, "Agreement across survivors"): the publishing
# program of a send writes, after the 4 signature words of its own entry, ceil(R / 32) words whose bit r says "this
# rank has masked r by timeout" (MASK_TIMEOUT), and publishes the entry with them (mapped peers: stores before the
# FULL release; NVSHMEM: the put-with-signal payload). A receive ORs the bits of every live sender into its mask.
@triton.jit
def _sig_payload_words(status_ptr, R):
    """Words of a signature entry a publish carries: 4, and the mask-bit words with enable_shrink."""
    shrink = tl.load(status_ptr + STATUS_SHRINK, volatile=True) != 0
    return tl.where(shrink, 4 + (R + 31) // 32, 4)


@triton.jit
def _write_mask_bits(my_sig, base, rank, status_ptr, R, stride):
    """(The publishing program, enable_shrink) this rank's timeout-masked ranks as bits after the signature words of
    its own entry: word ``4 + w`` bit ``i`` = rank ``32 w + i`` is masked here with ``MASK_TIMEOUT``."""
    if tl.load(status_ptr + STATUS_SHRINK, volatile=True) != 0:
        lane = tl.arange(0, 32)
        for w in range((R + 31) // 32):
            r = w * 32 + lane
            m = tl.load(status_ptr + STATUS_MASK + r, mask=r < R, other=0, volatile=True)
            bits = tl.xor_sum(tl.where(m == _TIMEOUT, 1 << lane, 0), axis=0)  # disjoint bits: the XOR is an OR
            tl.store(my_sig + base + stride * rank + 4 + w, bits)


@triton.jit
def _adopt_masks(my_sig, base, rank, src, status_ptr, R, stride):
    """(A receive's deciding program, enable_shrink, ``src`` live and its FULL acquired) mask, with ``MASK_TIMEOUT``,
    every rank that ``src`` published as masked by timeout and that is still live here (never this rank itself)."""
    if (tl.load(status_ptr + STATUS_SHRINK, volatile=True) != 0) & (src != rank):
        lane = tl.arange(0, 32)
        for w in range((R + 31) // 32):
            bits = tl.load(my_sig + base + stride * src + 4 + w, volatile=True)
            r = w * 32 + lane
            ok = (r < R) & (r != rank)
            m = tl.load(status_ptr + STATUS_MASK + r, mask=ok, other=1, volatile=True)
            tl.atomic_xchg(status_ptr + STATUS_MASK + r, tl.full([32], _TIMEOUT, tl.int32),
                           mask=ok & (m == 0) & (((bits >> lane) & 1) != 0), sem="relaxed", scope="sys")


@triton.jit
def _status_ok(status_ptr, like):
    """Bool tensor shaped like the int tensor ``like``: no wait of this rank has timed out.

    NOTES: built by broadcasting an int and comparing: in the interpreter a scalar compare ANDed with a
    bool block gives an int32 block that ``tl.store`` refuses as a mask."""
    return (like * 0 + tl.load(status_ptr, volatile=True)) == 0


# Rank mask (enable_shrink): it lives in this rank's local ``status`` tensor (:class:`moe_ep.symm.SymmBuffer`):
# word ``STATUS_SHRINK`` = 1 turns masked waits on, words ``STATUS_MASK + r`` = rank r's EFFECTIVE mask for this rank
# (0 live, nonzero masked; a self-masked rank has every other word set, its own word is never set; the host folds
# that in). Read at run time (no extra kernel argument); without enable_shrink the words stay 0.
@triton.jit
def _live(status_ptr, rank, peer):
    """Scalar bool: ``peer`` is not masked for this rank (always true without enable_shrink)."""
    return peer_masked(status_ptr + STATUS_MASK, rank, peer) == 0


@triton.jit
def _live_like(status_ptr, rank, peer, like):
    """``_live`` broadcast to a bool tensor shaped like the int tensor ``like`` (see ``_status_ok``)."""
    return (like * 0 + _live(status_ptr, rank, peer).to(tl.int32)) != 0


@triton.jit
def _live_vec(status_ptr, rank, peers, R):
    """Bool tensor: each rank of the int tensor ``peers`` (in ``[0, R)``) is not masked for this rank."""
    m = tl.load(status_ptr + STATUS_MASK + peers, mask=(peers >= 0) & (peers < R), other=0, volatile=True)
    return m == 0


@triton.jit
def _wait(sig_ptr, value, status_ptr, rank, peer, timeout_ns, signal_ptrs, sig_off, R):
    """``wait_ne``, or with enable_shrink ``wait_ne_masked``: skip masked peers, mask on timeout (the heartbeat
    words are word ``_hb_word(R)`` of slot 0, :func:`signal_layout`, whatever slot and kind the wait is in: a peer
    still waiting in the previous call, or in the other operation, beats in the word this wait reads)."""
    if tl.load(status_ptr + STATUS_SHRINK, volatile=True) != 0:
        hb = _hb_word(R)  # (one word per rank, not per slot: readable across the call boundary)
        # A peer with no load/store mapping (table entry 0: the nvshmem transport across nodes) has no readable
        # heartbeat: a word nobody writes during a launch is read instead (this rank's local STATUS_SHRINK word,
        # 1 here), so the wait is a plain timeout_s. (Not this rank's own heartbeat word: the wait itself rewrites
        # that one every ~1 ms, which restarted the timeout until HB_CAP.)
        peer_base = tl.load(signal_ptrs + peer)
        if peer_base != 0:
            peer_hb = tl.multiple_of(peer_base.to(tl.pointer_type(tl.int32)), 16) + hb
        else:
            peer_hb = status_ptr + STATUS_SHRINK
        v = wait_ne_masked(sig_ptr, value, status_ptr, status_ptr + STATUS_MASK, rank, peer, timeout_ns,
                           _peer(signal_ptrs, rank, 0, tl.int32) + hb, peer_hb)
    else:
        v = wait_ne(sig_ptr, value, status_ptr, peer, timeout_ns)
    return v


@triton.jit
def _wait_vec(sig_ptrs, value, need, peers, status_ptr, rank, timeout_ns, signal_ptrs, R, UNTIL_EQ: tl.constexpr = False):
    """:func:`_wait` on every lane of ``need`` at once (lane ``i``: peer ``peers[i]``, word ``sig_ptrs[i]``): the
    parallel wait :func:`moe_ep.kernels.signals.wait_vec`, with each mapped peer's heartbeat word (``_hb_word(R)``
    of slot 0) read on its lane; an unmapped peer (NVSHMEM across nodes) has no readable heartbeat: a plain
    ``timeout_s``. Returns the words (``value`` on lanes that gave up) and each lane's arrival clock."""
    shrink = tl.load(status_ptr + STATUS_SHRINK, volatile=True) != 0
    hb = _hb_word(R)
    pb = tl.load(signal_ptrs + tl.where(need, peers, 0), mask=need, other=0)
    peer_hb = (pb + hb * 4).to(tl.pointer_type(tl.int32))
    my_hb = _peer(signal_ptrs, rank, 0, tl.int32) + hb
    return wait_vec(sig_ptrs, value, need, peers, status_ptr, status_ptr + STATUS_MASK, timeout_ns, shrink, my_hb,
                    peer_hb, pb != 0, UNTIL_EQ)


# Liveness decided once per launch and source (docs/protocols.md, "A late or dead peer"): no program of a receive
# waits for another program of its launch. Every program polls the sources it needs itself; the first to reach a
# verdict on source p publishes it with a compare-and-swap in p's decision word (local status words, one per receive
# kind, double-buffer slot and source), every other program adopts it. Value: ``_decision_base(stamp, kind) | state``
# (1 live, 2 not); a value without this call's stamp, kind and bit 14 is not this receive's. The receive's last program
# zeroes the words of its kind and slot (every program has read the words it needs by then).
@triton.jit
def _decision_base(stamp, KIND: tl.constexpr):
    """High bits of this receive's decision words: this call's stamp (15 bits), the receive kind (0 dispatch,
    1 combine) and bit 14 set (a zeroed word is never this call's, stamp 0 included); the state is in the low 2 bits."""
    return ((stamp & 0x7FFF) << 16) | (KIND << 15) | (1 << 14)


@triton.jit
def _decision_words(status_ptr, R, sig_off, KIND: tl.constexpr):
    """This receive's ``R`` decision words: ``status[4 + R + (2 KIND + slot) R]`` (``sig_off`` is 0 for slot 0)."""
    slot = (sig_off > 0).to(tl.int32)
    return status_ptr + STATUS_MASK + R + (2 * KIND + slot) * R


@triton.jit
def _decide_vec(dec_ptr, base, my_sig, full_word, status_ptr, rank, peers, need, timeout_ns, signal_ptrs, R,
                sig_sb, sig_ss, t_start, wait_stats_ptr, HAS_WAIT_STATS: tl.constexpr, TRANSPORT: tl.constexpr):
    """Each source's verdict (live for this launch or not) for every lane of ``need`` at once (lane ``i``: source
    ``peers[i]``; ``full_word``: the FULL word of source 0, source ``p``'s at ``full_word + 2 p``): one vector read
    of the decision words; the lanes without this launch's verdict wait together (:func:`_wait_vec`; NVSHMEM: then
    the landed waits of the unmapped ones), check their call signatures as one ``[lanes, 4]`` read, and propose with
    one vector compare-and-swap (the first proposal of the launch wins, a loser adopts the winner's; lanes with
    nothing to propose compare against -1, which no decision word holds). Returns the verdicts (live) per lane."""
    safe = tl.where(need, peers, 0)
    w = tl.where(need, tl.atomic_add(dec_ptr + safe, 0, mask=need, sem="acquire", scope="gpu"), 0)
    und = need & ((w >> 14) != (base >> 14))
    if tl.max(und.to(tl.int32), axis=0) > 0:
        fulls = my_sig + full_word + 2 * safe
        v, t_arr = _wait_vec(fulls, 0, und, safe, status_ptr, rank, timeout_ns, signal_ptrs, R)
        if TRANSPORT == 1:
            # NVSHMEM: and every data put of an unmapped source has landed (the FULL word's high half is back to 0)
            # (a lane that runs out is masked or named in the status word, so ``came`` below is false for it)
            unmapped = und & (v != 0) & (tl.load(signal_ptrs + safe, mask=und, other=1) == 0)
            _, t_land = _wait_vec(fulls + 1, 0, unmapped, safe, status_ptr, rank, timeout_ns, signal_ptrs, R, True)
            t_arr = tl.where(unmapped, tl.maximum(t_arr, t_land), t_arr)
        came = und & (v != 0) & _lanes(tl.load(status_ptr, volatile=True) == 0, safe) & _live_vec(status_ptr, rank,
                                                                                                   safe, R)
        # Rows laid out for another call (hidden, T, experts, top-k, format) are never read: report it instead.
        ww = tl.arange(0, 4)
        theirs = tl.load(my_sig + sig_sb + sig_ss * safe[:, None] + ww[None, :], mask=came[:, None], other=0,
                         volatile=True)
        mine = tl.load(my_sig + sig_sb + sig_ss * rank + ww, volatile=True)
        differs = came & (tl.max((theirs != mine[None, :]).to(tl.int32), axis=1) > 0)
        if tl.max(differs.to(tl.int32), axis=0) > 0:
            report_error(status_ptr, -16 - tl.min(tl.where(differs, safe, 1 << 30), axis=0))  # STATUS_SIG_MISMATCH - p
        prop = base | tl.where(came & ~differs, 1, 2)
        old = tl.atomic_cas(dec_ptr + safe, tl.where(und, w, -1), prop, sem="acq_rel", scope="gpu")
        won = und & (old == w)
        w = tl.where(und, tl.where(won, prop, old), w)
        if HAS_WAIT_STATS:  # how long the deciding program waited (from its start) until each source had sent
            tl.atomic_add(wait_stats_ptr + safe, tl.maximum(t_arr - t_start, 0), mask=won, sem="relaxed", scope="gpu")
    return need & ((w & 3) == 1)


@triton.jit
def _decided_live(dec_ptr, p):
    """(``p`` decided by this program's ``_decide_vec`` already) whether the launch's verdict on ``p`` is live; ``p``
    may be a tensor of ranks (masked lanes: ``p < 0``)."""
    return (tl.load(dec_ptr + p, mask=p >= 0, other=0, volatile=True) & 3) == 1


@triton.jit
def _adopted_like(my_sig, base, stride, dec_ptr, status_ptr, rank, R, ranks):
    """(enable_shrink, every source decided) bool tensor shaped like the int tensor ``ranks``: the rank is among those
    a source with a live verdict in ``dec_ptr`` published as masked by timeout (its signature entry's mask bits), and
    is not this rank. Every program of a launch computes the same answer (the entries stay put during the launch)."""
    adopted = ranks < 0
    if tl.load(status_ptr + STATUS_SHRINK, volatile=True) != 0:
        ok = (ranks >= 0) & (ranks < R) & (ranks != rank)
        for src in range(R):
            if (src != rank) & _decided_live(dec_ptr, src):
                bits = tl.load(my_sig + base + stride * src + 4 + ranks // 32, mask=ok, other=0, volatile=True)
                adopted = adopted | (ok & (((bits >> (ranks % 32)) & 1) != 0))
    return adopted


@triton.jit
def _decision_reset(dec_ptr, R):
    """(The receive's last program, every program has read the words it needs) zero this receive's ``R`` words."""
    for r0 in range(0, R, 32):
        r = r0 + tl.arange(0, 32)
        tl.store(dec_ptr + r, tl.zeros([32], tl.int32), mask=r < R)


@triton.jit
def _finish_receive(my_sig, dec, full_word, busy_word, status_ptr, rank, R, sig_off, sig_sb, sig_ss, signal_ptrs,
                    TRANSPORT: tl.constexpr):
    """(A receive's last program: every program has read what it needs) with enable_shrink, adopt the ranks each live
    source masked by timeout (its bits came with its signature; they count from the next phase on, and get no
    release here); then zero this receive's decision words, FULL words and signature entries, and release every
    live source (``busy_word``: this rank's BUSY word on each source)."""
    if tl.load(status_ptr + STATUS_SHRINK, volatile=True) != 0:
        for sp in range(R):
            if (tl.load(status_ptr, volatile=True) == 0) & _decided_live(dec, sp):
                _adopt_masks(my_sig, sig_sb, rank, sp, status_ptr, R, sig_ss)
    _decision_reset(dec, R)
    _reset_fulls(my_sig, full_word, status_ptr, R, sig_sb, sig_ss)
    release_peers(signal_ptrs, status_ptr + STATUS_MASK, rank, R, sig_off, busy_word, 0, _scratch_word(R), TRANSPORT)


@triton.jit
def _reset_fulls(my_sig, full_word, status_ptr, R, sig_sb, sig_ss):
    """(A receive's last program) zero every source's FULL word (relaxed system-scope stores, one lane per source) and,
    unless the status word is set (then the host names the fields that differ), every signature entry: 32 sources
    a step. Before the BUSY releases, whose fence orders these stores before the next call's copies."""
    keep = tl.load(status_ptr, volatile=True) != 0
    for p0 in range(0, R, 32):
        pe = p0 + tl.arange(0, 32)
        tl.atomic_xchg(my_sig + full_word + 2 * pe, tl.zeros([32], tl.int32), mask=pe < R, sem="relaxed", scope="sys")
        w = tl.arange(0, 16)
        for w0 in range(0, sig_ss, 16):  # (one [32, 16] store up to 352 ranks)
            tl.store(my_sig + sig_sb + sig_ss * pe[:, None] + (w0 + w)[None, :], tl.zeros([32, 16], tl.int32),
                     mask=((pe < R) & _lanes(~keep, pe))[:, None] & ((w0 + w) < sig_ss)[None, :])


@triton.jit
def _bf16_bits(v):
    """float32 -> bfloat16 bit pattern (int16), round to nearest even; NaN -> 0x7FFF.

    NOTES: the interpreter's ``.to(tl.bfloat16)`` truncates; integer rounding gives torch's bits on every
    backend. NaN becomes the canonical 0x7FFF of ``cvt.rn.bf16.f32`` (torch's CUDA cast); torch's CPU cast
    gives 0xFFFF or 0x7FC0 depending on its code path, so NaN payloads are not part of the contract."""
    bits = v.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return tl.where(is_nan, 0x7FFF, rounded).to(tl.int16)


# Late rows (docs/protocols.md, "Late rows"): the combine send's gate and the receive's masked-writer test.
@triton.jit
def _receiver_done(signal_ptrs, s, sig_off, R, stamp_s, status_ptr):
    """1 when (enable_shrink, ``s`` mapped) ``s`` has finished, or given up on, the combine receive of its call
    ``stamp_s`` (or a later call of this slot): its ``COMB_DONE`` word of this slot carries that stamp or a later
    one. A row for ``s`` would then be a late row: the send drops it (docs/protocols.md, "late rows")."""
    done = tl.program_id(0) * 0  # (an int32 tensor in both branches)
    if tl.load(status_ptr + STATUS_SHRINK, volatile=True) != 0:
        base = tl.load(signal_ptrs + s)
        if base != 0:
            w = load_acquire(tl.multiple_of(base.to(tl.pointer_type(tl.int32)), 16) + sig_off + _done_word(R))
            done = (((w >> 16) != 0) & ((((w & 0x7FFF) - stamp_s) & 0x7FFF) < 0x4000)).to(tl.int32)
    return done


@triton.jit
def _masked_writer(status_ptr, hdr, owner, R):
    """Per slot: the header ``hdr`` (``stamp << 16 | writer + 1``) names a writer other than ``owner`` that this
    rank has masked (its mask word is set: by the API, a timed-out wait, or an adoption)."""
    wr = (hdr & 0xFFFF) - 1
    ok = (wr >= 0) & (wr < R) & (wr != owner)
    return ok & (tl.load(status_ptr + STATUS_MASK + tl.where(ok, wr, 0), mask=ok, other=0, volatile=True) != 0)
