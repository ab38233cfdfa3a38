"""The transport switch of the low-latency kernels: every difference between writing to peers through mapped
pointers (``TRANSPORT`` = :data:`PEER`, the ``symm`` backend) and NVSHMEM (``TRANSPORT`` = :data:`NVSHMEM`, the
``nvshmem`` backend) lives in these jit helpers; :mod:`moe_ep.kernels.low_latency` is written once over them.

With ``PEER`` a sender stores straight into the peer's region and releases the peer's signal word (system scope).
With ``NVSHMEM`` a sender writes its bytes into ITS OWN symmetric region first (a staging place whose offset is
the same on every rank, or a separate staging area), then :func:`xfer` moves them:

- to a peer whose region is mapped here (``buffer_ptrs[pe] != 0``: the same node, NVLink / P2P, as
  ``nvshmem_ptr`` reports it; and this rank itself) the block copies them with loads and stores: intranode bytes
  never take the NIC, and the signal is a release store like ``PEER``'s;
- to any other peer with ``nvshmemx_putmem_signal_nbi_block`` (IBGDA: the GPU rings the NIC's doorbell itself)
  whose signal ADDS one landed put to the high half of this rank's FULL word there; the announcing signal (the call
  signature entry, 16 bytes plus the mask bits with enable_shrink, or 8 dummy bytes as the payload) subtracts the
  number sent, so the receiver knows when every put has landed. No kernel calls ``nvshmem_quiet``, and a put's
  source is rewritten only after the peer released the slot: docs/protocols.md, "NVSHMEM: no quiet on the hot path".

Peer tables: ``buffer_ptrs`` / ``signal_ptrs`` entry ``r`` is rank ``r``'s region mapped in this process, or 0 when
it is not mapped; entry ``rank`` is this rank's own region, whose addresses NVSHMEM translates to ``pe``'s.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .nvshmem_device import SIGNAL_ADD as _ADD
from .nvshmem_device import SIGNAL_SET as _SET
from .nvshmem_device import putmem_signal_nbi_block
from .signals import fence_sys, signal_release

__all__ = ["PEER", "NVSHMEM", "LANDED", "peer_ptr", "mapped", "xfer", "publish", "release_remote", "release_peers",
           "publish_signature",
           "copy_signature"]

PEER = tl.constexpr(0)
SIGNAL_ADD = tl.constexpr(_ADD)
SIGNAL_SET = tl.constexpr(_SET)
LANDED = tl.constexpr(1 << 32)  # what one landed data put adds to its FULL word (the high half counts)
NVSHMEM = tl.constexpr(1)


@triton.jit
def peer_ptr(ptrs, r, byte_off, DTYPE: tl.constexpr):
    """Typed pointer ``byte_off`` bytes into rank ``r``'s region (``ptrs``: int64 address table)."""
    # NOTES: regions are 256-byte aligned and every offset used here is a multiple of 16: say so, or
    # the compiler cannot vectorise accesses through a pointer loaded from memory.
    return tl.multiple_of((tl.load(ptrs + r) + byte_off).to(tl.pointer_type(DTYPE)), 16)


@triton.jit
def mapped(ptrs, r):
    """Scalar bool: rank ``r``'s region is mapped in this process (load/store reach it)."""
    return tl.load(ptrs + r) != 0


@triton.jit
def publish_signature(my_sig, peer_sig, base, rank, stride, nw):
    """Copy the first ``nw`` words of this rank's signature entry (its own entry at ``base``; ``stride`` words per
    entry: the call signature, then the mask bits) into a peer's entry for this rank."""
    for w0 in range(0, nw, 16):  # (one vector copy up to 384 ranks)
        w = w0 + tl.arange(0, 16)
        tl.store(peer_sig + base + stride * rank + w, tl.load(my_sig + base + stride * rank + w, mask=w < nw,
                                                               volatile=True), mask=w < nw)


@triton.jit
def copy_signature(signal_ptrs, buffer_ptrs, rank, sig_off, sig_base, sig_copy_off, stride, nw):
    """(``NVSHMEM``) the first ``nw`` words of this rank's own signature entry -> its put source copy at byte
    ``sig_copy_off`` of its data region (the publishing program, after every program's BUSY waits: see
    :func:`publish`)."""
    my_sig = peer_ptr(signal_ptrs, rank, 0, tl.int32) + sig_off
    dst = peer_ptr(buffer_ptrs, rank, sig_copy_off, tl.int32)
    for w0 in range(0, nw, 16):
        w = w0 + tl.arange(0, 16)
        tl.store(dst + w, tl.load(my_sig + sig_base + stride * rank + w, mask=w < nw, volatile=True), mask=w < nw)
    tl.debug_barrier()


@triton.jit
def xfer(buffer_ptrs, signal_ptrs, rank, pe, dst_off, src_off, nbytes, full_word, CH: tl.constexpr):
    """(``NVSHMEM``) this rank's data bytes ``[src_off, src_off + nbytes)`` to ``[dst_off, ...)`` of ``pe``'s region:
    a block copy (int32 words: offsets and sizes are multiples of 4) when ``pe`` is mapped, else a non-blocking
    put-with-signal that ADDS ``2**32`` to ``pe``'s 64-bit signal word ``full_word`` (this rank's FULL word there,
    word offset from the signal region) once its bytes have landed: the receiver counts landed puts in the high half
    (:func:`publish` subtracts the number sent), so no ``quiet`` is needed. The caller has a ``tl.debug_barrier()``
    after writing the source, and rewrites the source only after ``pe`` released the slot (docs/protocols.md)."""
    own = tl.load(buffer_ptrs + rank)
    peer = tl.load(buffer_ptrs + pe)
    if peer != 0:
        src = (own + src_off).to(tl.pointer_type(tl.int32))
        dst = (peer + dst_off).to(tl.pointer_type(tl.int32))
        for o in range(0, nbytes // 4, CH):
            offs = o + tl.arange(0, CH)
            m = offs < nbytes // 4
            tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)
    else:
        sig = tl.load(signal_ptrs + rank) + full_word.to(tl.int64) * 4
        putmem_signal_nbi_block(own + dst_off, own + src_off, nbytes, sig, tl.zeros([], tl.int64) + LANDED, pe,
                                SIG_OP=SIGNAL_ADD)


@triton.jit
def publish(signal_ptrs, rank, pe, sig_off, sig_base, word, value, TRANSPORT: tl.constexpr, buffer_ptrs=None,
            sig_copy_off=0, puts=0, stride=4, nw=4):
    """Copy this rank's call signature (the first ``nw`` words of entry ``rank`` of the area at word ``sig_base``,
    ``stride`` words per entry: the signature, then the mask bits) to ``pe``, then set ``pe``'s
    signal word ``word`` (both inside the slot at word ``sig_off``) to ``value`` with release semantics: every write
    before it is visible to ``pe`` first. ``NVSHMEM`` to an unmapped peer: one put-with-signal whose ``4 nw``-byte
    payload is this rank's copy of its entry at byte ``sig_copy_off`` of its data region (:func:`copy_signature`, after
    the BUSY waits: rewritten only once every live peer released the previous call of this slot) and whose signal
    ADDS ``value - puts * 2**32``: the low half reads ``value``, the high half is 0 again once the ``puts`` data puts
    of :func:`xfer` have landed too (docs/protocols.md, "NVSHMEM: no quiet on the hot path")."""
    if TRANSPORT == 0:
        _publish_mapped(signal_ptrs, rank, pe, sig_off, sig_base, word, value, stride, nw)
    elif mapped(signal_ptrs, pe):
        _publish_mapped(signal_ptrs, rank, pe, sig_off, sig_base, word, value, stride, nw)
    else:
        own = tl.load(signal_ptrs + rank)
        entry = own + (sig_off + sig_base + stride * rank).to(tl.int64) * 4
        src = tl.load(buffer_ptrs + rank) + sig_copy_off
        add = (value + tl.zeros([], tl.int64)) - (puts + tl.zeros([], tl.int64)) * LANDED
        putmem_signal_nbi_block(entry, src, 4 * nw, own + (sig_off + word).to(tl.int64) * 4, add, pe, SIG_OP=SIGNAL_ADD)


@triton.jit
def _publish_mapped(signal_ptrs, rank, pe, sig_off, sig_base, word, value, stride, nw):
    my_sig = peer_ptr(signal_ptrs, rank, 0, tl.int32) + sig_off
    peer_sig = peer_ptr(signal_ptrs, pe, 0, tl.int32) + sig_off
    publish_signature(my_sig, peer_sig, sig_base, rank, stride, nw)
    signal_release(peer_sig + word, value)


@triton.jit
def release_remote(signal_ptrs, rank, pe, sig_off, word, value, scratch, TRANSPORT: tl.constexpr):
    """Set ``pe``'s signal word ``word`` (inside the slot at ``sig_off``) to ``value`` with release semantics; for
    ``NVSHMEM`` to an unmapped peer a put-with-signal whose payload is 8 dummy bytes at ``pe``'s ``scratch + 2 rank``
    (this rank's own scratch pair there: one writer per location)."""
    if TRANSPORT == 0:
        signal_release(peer_ptr(signal_ptrs, pe, 0, tl.int32) + sig_off + word, value)
    elif mapped(signal_ptrs, pe):
        signal_release(peer_ptr(signal_ptrs, pe, 0, tl.int32) + sig_off + word, value)
    else:
        own = tl.load(signal_ptrs + rank)
        pad = own + (sig_off + scratch + 2 * rank).to(tl.int64) * 4
        putmem_signal_nbi_block(pad, pad, 8, own + (sig_off + word).to(tl.int64) * 4, value + tl.zeros([], tl.int64), pe,
                                SIG_OP=SIGNAL_SET)


@triton.jit
def release_peers(signal_ptrs, mask_ptr, rank, R, sig_off, word, value, scratch, TRANSPORT: tl.constexpr):
    """:func:`release_remote` of every peer that ``mask_ptr`` (this rank's `[R]` mask words, 0 = live) says is live,
    all at once: after a block barrier (every thread's earlier reads and writes) ONE system-scope fence per thread,
    then a relaxed store to each mapped peer's word from its own lane, 32 peers per step (a release store per
    peer, from one thread, costs a fence per peer, in series). A peer reading the word with acquire semantics sees
    everything this block did before, as with a release store. ``NVSHMEM``: unmapped peers then get their
    put-with-signal (block calls, one after another)."""
    tl.debug_barrier()
    fence_sys()
    off = (sig_off + word).to(tl.int64) * 4
    for p0 in range(0, R, 32):
        pe = p0 + tl.arange(0, 32)
        live = (pe < R) & (tl.load(mask_ptr + pe, mask=pe < R, other=1, volatile=True) == 0)
        base = tl.load(signal_ptrs + pe, mask=live, other=0)
        tl.atomic_xchg((base + off).to(tl.pointer_type(tl.int32)), tl.zeros([32], tl.int32) + value,
                       mask=live & (base != 0), sem="relaxed", scope="sys")
    if TRANSPORT == NVSHMEM:
        for pe in range(R):
            if (tl.load(mask_ptr + pe, volatile=True) == 0) & (tl.load(signal_ptrs + pe) == 0):
                release_remote(signal_ptrs, rank, pe, sig_off, word, value, scratch, TRANSPORT)
