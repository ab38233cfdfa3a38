"""NVSHMEM device calls used by the ``nvshmem`` transport of the low-latency kernels, and their CPU emulation.

Compiled for a GPU, each name below is an extern call into NVSHMEM's device bitcode (``libnvshmem_device_sm_XX.bc``,
linked through Triton's ``extern_libs``, :func:`moe_ep.nvshmem.extern_libs`):

    putmem_nbi_block(dest, source, nbytes, pe)                         nvshmemx_putmem_nbi_block
    putmem_signal_nbi_block(dest, source, nbytes, sig, value, pe)      nvshmemx_putmem_signal_nbi_block (SIGNAL_SET)
    quiet()                                                            nvshmem_quiet

``dest``, ``source`` and ``sig`` are addresses (int64) in THIS rank's symmetric heap; NVSHMEM maps them to ``pe``'s
heap. Only block-scoped transfers are used: Triton issues a scalar extern call from every thread of a program (it
has no single-thread guard), so a thread-scoped put or signal would run ``32 * num_warps`` times; a ``*_block``
call is a collective of the block, which is what every thread calling it means. ``quiet`` is a PE-wide completion
call (every outstanding put of this PE is delivered when it returns), idempotent when every thread calls it. The
signal is NVSHMEM's 64-bit signal word, set (``NVSHMEM_SIGNAL_SET``) after the payload is delivered.

Under ``TRITON_INTERPRET=1`` (CPU tests) the same names are ``@triton.jit`` functions that emulate these calls over
the shared-memory peer table of :mod:`moe_ep.symm`: the host registers, per rank, the mapping from its symmetric
regions to every peer's (:func:`register_heap`), and a put copies bytes into the peer's mapping. Two orders:

- ``"eager"`` (default): a put is delivered at once.
- ``"deferred"`` (:func:`set_emulation_order`): non-blocking puts are held until ``quiet`` and then delivered in
  REVERSE order, and a put-with-signal delivers only its own payload before its signal. A protocol that reads a
  row it was not signalled for, or signals before its earlier puts are complete, reads stale bytes under this
  order: the tests run every low-latency case both ways.
"""

from __future__ import annotations

import ctypes

import triton
import triton.language as tl

from .pdl import INTERPRET

__all__ = ["putmem_nbi_block", "putmem_signal_nbi_block", "quiet", "register_heap", "unregister_heap",
           "set_emulation_order", "emulation_order", "DEVICE_CALLS"]

#: the NVSHMEM entry points the kernels call (all block-scoped, or PE-wide completion): perf/sm90_report.py checks that
#: the compiled PTX calls these and no thread-scoped transfer.
DEVICE_CALLS = ("nvshmemx_putmem_nbi_block", "nvshmemx_putmem_signal_nbi_block", "nvshmem_quiet")
SIGNAL_SET = 0  # NVSHMEM_SIGNAL_SET


# ---------------------------------------------------------------------------------------------- CPU emulation
# Each registered heap: (local base address, size in bytes, [peer base address per rank]); a rank's data region and
# its signal region are one mapping in moe_ep.symm, so one entry covers both.
_HEAPS: list = []
_PENDING: list = []  # deferred order: (dest address, bytes) held until quiet
_ORDER = ["eager"]


def register_heap(local_base: int, nbytes: int, peer_bases: list) -> None:
    """Make ``[local_base, local_base + nbytes)`` a symmetric heap for the emulation: address ``local_base + o`` names
    offset ``o`` of every rank's region, and ``peer_bases[r] + o`` is where rank ``r``'s copy is mapped here. A heap
    registered earlier over any of these addresses is dropped (its memory was freed and reused)."""
    lo, hi = int(local_base), int(local_base) + int(nbytes)
    _HEAPS[:] = [h for h in _HEAPS if h[0] + h[1] <= lo or h[0] >= hi]
    _HEAPS.append((lo, int(nbytes), [int(b) for b in peer_bases]))


def unregister_heap(local_base: int) -> None:
    _HEAPS[:] = [h for h in _HEAPS if h[0] != int(local_base)]


def set_emulation_order(order: str) -> None:
    """``"eager"`` or ``"deferred"`` (see the module docstring); pending puts are dropped."""
    if order not in ("eager", "deferred"):
        raise ValueError(f"emulation order must be 'eager' or 'deferred', not {order!r}")
    _ORDER[0] = order
    _PENDING.clear()


def emulation_order() -> str:
    return _ORDER[0]


def _scalar(v) -> int:
    h = getattr(v, "handle", None)
    data = getattr(h, "data", v)
    try:
        return int(data.reshape(-1)[0])
    except AttributeError:
        return int(data)


def _translate(addr: int, nbytes: int, pe: int) -> int:
    for base, size, peers in _HEAPS:
        if base <= addr and addr + nbytes <= base + size:
            if not 0 <= pe < len(peers):
                raise RuntimeError(f"emulated NVSHMEM: pe {pe} is not a rank of this heap ({len(peers)} ranks)")
            return peers[pe] + (addr - base)
    raise RuntimeError(f"emulated NVSHMEM: address {addr:#x} (+{nbytes} bytes) is not in a registered symmetric heap")


def _deliver(dest: int, payload: bytes) -> None:
    if payload:
        ctypes.memmove(dest, payload, len(payload))


def _emu_put(dest, source, nbytes, pe):
    dest, source, nbytes, pe = _scalar(dest), _scalar(source), _scalar(nbytes), _scalar(pe)
    if nbytes <= 0:
        return 0
    target = _translate(dest, nbytes, pe)
    _translate(source, nbytes, 0)  # the source must be symmetric too (registered memory for the NIC)
    payload = ctypes.string_at(source, nbytes)  # copied out now: the source may be reused after the call
    if _ORDER[0] == "deferred":
        _PENDING.append((target, payload))
    else:
        _deliver(target, payload)
    return 0


def _emu_put_signal(dest, source, nbytes, sig, value, pe):
    _emu_put_now(dest, source, nbytes, pe)
    target = _translate(_scalar(sig), 8, _scalar(pe))
    ctypes.c_uint64.from_address(target).value = _scalar(value) & (2 ** 64 - 1)  # the signal after its payload
    return 0


def _emu_put_now(dest, source, nbytes, pe):
    dest, source, nbytes, pe = _scalar(dest), _scalar(source), _scalar(nbytes), _scalar(pe)
    if nbytes > 0:
        _translate(source, nbytes, 0)
        _deliver(_translate(dest, nbytes, pe), ctypes.string_at(source, nbytes))


def _emu_quiet():
    pending = _PENDING[::-1]
    _PENDING.clear()
    for target, payload in pending:
        _deliver(target, payload)
    return 0


# ---------------------------------------------------------------------------------------------- the device names
if INTERPRET:
    @triton.jit
    def putmem_nbi_block(dest, source, nbytes, pe):
        """(Emulation) non-blocking block put of ``nbytes`` from this rank's ``source`` to ``pe``'s ``dest``."""
        return _emu_put(dest, source, nbytes, pe)

    @triton.jit
    def putmem_signal_nbi_block(dest, source, nbytes, sig, value, pe):
        """(Emulation) block put, then ``pe``'s 64-bit signal word ``sig`` = ``value`` once the payload is there."""
        return _emu_put_signal(dest, source, nbytes, sig, value, pe)

    @triton.jit
    def quiet():
        """(Emulation) deliver every outstanding put of this process (PE)."""
        return _emu_quiet()
else:
    from triton.language import core

    @core.extern
    def _putmem_nbi_block(dest, source, nbytes, pe, _semantic=None):
        return core.extern_elementwise(
            "libnvshmem_device", "", [dest, source, nbytes, pe],
            {(core.dtype("int64"), core.dtype("int64"), core.dtype("int64"), core.dtype("int32")):
             ("nvshmemx_putmem_nbi_block", core.dtype("int32"))},
            is_pure=False, _semantic=_semantic)

    @core.extern
    def _putmem_signal_nbi_block(dest, source, nbytes, sig, value, sig_op, pe, _semantic=None):
        return core.extern_elementwise(
            "libnvshmem_device", "", [dest, source, nbytes, sig, value, sig_op, pe],
            {(core.dtype("int64"), core.dtype("int64"), core.dtype("int64"), core.dtype("int64"), core.dtype("uint64"),
              core.dtype("int32"), core.dtype("int32")):
             ("nvshmemx_putmem_signal_nbi_block", core.dtype("int32"))},
            is_pure=False, _semantic=_semantic)

    @core.extern
    def _quiet(_semantic=None):
        return core.extern_elementwise("libnvshmem_device", "", [], {(): ("nvshmem_quiet", core.dtype("int32"))},
                                       is_pure=False, _semantic=_semantic)

    @triton.jit
    def putmem_nbi_block(dest, source, nbytes, pe):
        """``nvshmemx_putmem_nbi_block``: non-blocking block put of ``nbytes`` to ``pe`` (addresses in this heap)."""
        return _putmem_nbi_block(dest.to(tl.int64), source.to(tl.int64), nbytes + tl.zeros([], tl.int64),
                                 (pe + tl.zeros([], tl.int32)).to(tl.int32))

    @triton.jit
    def putmem_signal_nbi_block(dest, source, nbytes, sig, value, pe):
        """``nvshmemx_putmem_signal_nbi_block`` with ``NVSHMEM_SIGNAL_SET``: the payload, then ``pe``'s 64-bit
        signal word ``sig`` = ``value``."""
        return _putmem_signal_nbi_block(dest.to(tl.int64), source.to(tl.int64), nbytes + tl.zeros([], tl.int64),
                                        sig.to(tl.int64), (value + tl.zeros([], tl.int64)).to(tl.uint64),
                                        tl.full([], 0, tl.int32), (pe + tl.zeros([], tl.int32)).to(tl.int32))

    @triton.jit
    def quiet():
        """``nvshmem_quiet``: every outstanding put of this PE is complete (delivered) when it returns."""
        return _quiet()
