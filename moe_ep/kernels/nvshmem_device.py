"""NVSHMEM device calls used by the ``nvshmem`` transport of the low-latency kernels, and their CPU emulation.

Compiled for a GPU, each name below is an extern call into NVSHMEM's device bitcode (``libnvshmem_device_sm_XX.bc``,
linked through Triton's ``extern_libs``, :func:`moe_ep.nvshmem.extern_libs`):

    putmem_nbi_block(dest, source, nbytes, pe)                         nvshmemx_putmem_nbi_block
    putmem_signal_nbi_block(dest, source, nbytes, sig, value, pe)      nvshmemx_putmem_signal_nbi_block (SET / ADD)
    quiet()                                                            nvshmem_quiet

``dest``, ``source`` and ``sig`` are addresses (int64) in THIS rank's symmetric heap; NVSHMEM maps them to ``pe``'s
heap. Only block-scoped transfers are used: Triton issues a scalar extern call from every thread of a program (it
has no single-thread guard), so a thread-scoped put or signal would run ``32 * num_warps`` times; a ``*_block``
call is a collective of the block, which is what every thread calling it means. ``quiet`` is a PE-wide completion
call (every outstanding put of this PE is delivered when it returns), idempotent when every thread calls it. The
signal is NVSHMEM's 64-bit signal word, set (``NVSHMEM_SIGNAL_SET`` = 9) or increased (``NVSHMEM_SIGNAL_ADD`` = 10)
after the payload is delivered.

Under ``TRITON_INTERPRET=1`` (CPU tests) the same names are ``@triton.jit`` functions that emulate these calls over
the shared-memory peer table of :mod:`moe_ep.symm`: the host registers, per rank, the mapping from its symmetric
regions to every peer's (:func:`register_heap`), and a put copies bytes into the peer's mapping. Orders:

- ``"eager"`` (default): a put is delivered at once.
- ``"deferred"`` (:func:`set_emulation_order`): non-blocking puts (put-with-signal included) are held and delivered
  later in REVERSE order (whenever a wait of this process spins, from a background "NIC" thread every few ms, and at
  ``quiet``); a put-with-signal's signal lands after its own payload only. Sources are read at delivery, as a NIC
  does, and a source that changed since the call is recorded (:func:`source_errors`).
- ``"manual"``: as deferred, but delivered only by ``quiet`` and :func:`deliver` (tests order phases by hand).

:func:`set_dead_pes` emulates dead processes: puts to them never complete, and ``quiet`` raises (a NIC would block
until its retries run out). The kernels never call ``quiet`` on the hot path (docs/protocols.md, "NVSHMEM: no quiet
on the hot path"); it stays declared for completeness.
"""

from __future__ import annotations

import ctypes
import threading
import time

import triton
import triton.language as tl

from .pdl import INTERPRET
from .target import SPIN_HOOKS as _SPIN_HOOKS

__all__ = ["putmem_nbi_block", "putmem_signal_nbi_block", "quiet", "register_heap", "unregister_heap",
           "set_emulation_order", "emulation_order", "set_dead_pes", "source_errors", "deliver", "DEVICE_CALLS",
           "SIGNAL_SET", "SIGNAL_ADD"]

#: the NVSHMEM entry points the kernels call (all block-scoped, or PE-wide completion): perf/sm90_report.py checks that
#: the compiled PTX calls these and no thread-scoped transfer.
DEVICE_CALLS = ("nvshmemx_putmem_nbi_block", "nvshmemx_putmem_signal_nbi_block", "nvshmem_quiet")
SIGNAL_SET = 9  # NVSHMEM_SIGNAL_SET (nvshmem_common_transport.h)
SIGNAL_ADD = 10  # NVSHMEM_SIGNAL_ADD


# ---------------------------------------------------------------------------------------------- CPU emulation
# Each registered heap: (local base address, size in bytes, [peer base address per rank]); a rank's data region and
# its signal region are one mapping in moe_ep.symm, so one entry covers both.
_HEAPS: list = []
_PENDING: list = []  # non-eager orders: (pe, target, source, nbytes, snapshot, signal target, value, op) not delivered
_ORDER = ["eager"]
_DEAD: set = set()  # PEs whose NIC never acknowledges (set_dead_pes): puts to them never complete
_UNACKED: set = set()  # PEs with puts issued since the last quiet
_SOURCE_ERRORS: list = []  # nbi sources found changed at delivery (source_errors())
_LOCK = threading.RLock()
_NIC: list = []  # the deferred order's delivery thread, started on its first put


def register_heap(local_base: int, nbytes: int, peer_bases: list) -> tuple:
    """Make ``[local_base, local_base + nbytes)`` a symmetric heap for the emulation: address ``local_base + o`` names
    offset ``o`` of every rank's region, and ``peer_bases[r] + o`` is where rank ``r``'s copy is mapped here. A heap
    registered earlier over any of these addresses is dropped (its memory was freed and reused). Returns the entry
    (for :func:`unregister_heap`)."""
    lo, hi = int(local_base), int(local_base) + int(nbytes)
    entry = (lo, int(nbytes), [int(b) for b in peer_bases])
    with _LOCK:
        freed = [h for h in _HEAPS if not (h[0] + h[1] <= lo or h[0] >= hi)]
        _HEAPS[:] = [h for h in _HEAPS if h[0] + h[1] <= lo or h[0] >= hi]
        _settle(freed, deliver_them=False)  # their memory is gone: a pending put into it is dropped
        _HEAPS.append(entry)
    return entry


def unregister_heap(local_base: int, entry: tuple = None) -> None:
    """Drop the heap at ``local_base`` (only ``entry``, :func:`register_heap`'s result, when given: a later heap at
    the same address stays) before its memory is unmapped: pending puts that touch it are delivered first, as
    ``nvshmem_free`` quiets (puts to a dead PE are dropped), so none lands in memory unmapped after this returns."""
    with _LOCK:
        gone = [h for h in _HEAPS if h[0] == int(local_base) and (entry is None or h is entry)]
        _HEAPS[:] = [h for h in _HEAPS if not any(h is g for g in gone)]
        _settle(gone, deliver_them=True)


def _settle(heaps: list, deliver_them: bool) -> None:
    """(Under ``_LOCK``) take the pending puts whose source, target or signal lies in ``heaps`` off the queue and
    deliver them (in reverse order of issue, as :func:`deliver`) or drop them."""
    def touches(op) -> bool:
        _, target, source, nbytes, _, sig, _, _ = op
        written = ([target] if nbytes else []) + ([sig] if sig is not None else [])
        return any((nbytes and base <= source < base + size) or any(p <= a < p + size for p in peers for a in written)
                   for base, size, peers in heaps)

    if not heaps or not _PENDING:
        return
    keep, done = [], []
    for op in _PENDING:
        (done if touches(op) else keep).append(op)
    _PENDING[:] = keep
    if deliver_them:
        for op in reversed(done):
            if op[0] not in _DEAD:
                _deliver_op(*op)


def set_emulation_order(order: str) -> None:
    """``"eager"``, ``"deferred"`` or ``"manual"`` (see the module docstring); pending puts, recorded source errors
    and dead PEs are dropped."""
    if order not in ("eager", "deferred", "manual"):
        raise ValueError(f"emulation order must be 'eager', 'deferred' or 'manual', not {order!r}")
    _ORDER[0] = order
    with _LOCK:
        _PENDING.clear()
    _SOURCE_ERRORS.clear()
    _DEAD.clear()
    _UNACKED.clear()


def emulation_order() -> str:
    return _ORDER[0]


def set_dead_pes(pes) -> None:
    """Emulate PEs whose process died: their NIC never acknowledges a put (an RC QP retries, then errors), so a put to
    one never completes: it is never delivered in the non-eager orders, and ``quiet`` raises instead of blocking."""
    _DEAD.clear()
    _DEAD.update(int(p) for p in pes)


def source_errors() -> list:
    """Messages of every non-blocking put whose source bytes changed between the call and the delivery (the NVSHMEM
    rule: an ``*_nbi`` source may be read any time until the put is complete); cleared by ``set_emulation_order``."""
    return list(_SOURCE_ERRORS)


def deliver(pe=None) -> int:
    """Deliver the pending puts (all, or those to ``pe``), in REVERSE order of issue; returns how many. Puts to a dead
    PE stay pending. The ``manual`` order delivers only here and in ``quiet``; ``deferred`` also whenever a wait of
    this process spins (the NIC progresses while the GPU waits)."""
    with _LOCK:
        keep, done = [], []
        for op in _PENDING:
            (done if (pe is None or op[0] == pe) and op[0] not in _DEAD else keep).append(op)
        _PENDING[:] = keep
        for op in reversed(done):
            _deliver_op(*op)
        return len(done)


def _progress() -> None:
    """(Called from the interpreter's clock, i.e. every spin of a wait.) The ``deferred`` order's NIC progress."""
    if _PENDING and _ORDER[0] == "deferred":
        deliver()


def _nic_loop() -> None:
    while True:  # a daemon: the NIC also progresses while this process is not waiting (e.g. done with its calls)
        time.sleep(0.005)
        if _PENDING and _ORDER[0] == "deferred":
            deliver()


_SPIN_HOOKS.append(_progress)


def _scalar(v) -> int:
    while hasattr(v, "value") and not hasattr(v, "handle"):  # a constexpr
        v = v.value
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


def _deliver_op(pe, target, source, nbytes, snapshot, sig, value, op) -> None:
    if nbytes > 0:
        now = ctypes.string_at(source, nbytes)  # the NIC reads the source now, not at the call
        if snapshot is not None and now != snapshot:
            _SOURCE_ERRORS.append(f"the source of a non-blocking put to pe {pe} ({nbytes} bytes at {source:#x}) "
                                  f"changed before the put was complete: {snapshot[:16].hex()} -> {now[:16].hex()}")
        ctypes.memmove(target, now, nbytes)
    if sig is not None:
        word = ctypes.c_uint64.from_address(sig)
        word.value = (value if op == SIGNAL_SET else word.value + value) & (2 ** 64 - 1)  # after its own payload


def _issue(dest, source, nbytes, pe, sig=None, value=0, op=SIGNAL_SET):
    dest, source, nbytes, pe = _scalar(dest), _scalar(source), _scalar(nbytes), _scalar(pe)
    if op not in (SIGNAL_SET, SIGNAL_ADD):
        raise RuntimeError(f"emulated NVSHMEM: unknown signal operation {op}")
    nbytes = max(nbytes, 0)
    target = _translate(dest, nbytes, pe) if nbytes else 0
    if nbytes:
        _translate(source, nbytes, 0)  # the source must be symmetric too (registered memory for the NIC)
    sig_t = None if sig is None else _translate(_scalar(sig), 8, pe)
    if nbytes == 0 and sig is None:
        return 0
    _UNACKED.add(pe)
    if _ORDER[0] == "eager":
        _deliver_op(pe, target, source, nbytes, None, sig_t, _scalar(value), op)
    else:
        snap = ctypes.string_at(source, nbytes) if nbytes else b""
        with _LOCK:
            _PENDING.append((pe, target, source, nbytes, snap, sig_t, _scalar(value), op))
        if _ORDER[0] == "deferred" and not _NIC:
            _NIC.append(threading.Thread(target=_nic_loop, name="emulated-nic", daemon=True))
            _NIC[0].start()
    return 0


def _emu_put(dest, source, nbytes, pe):
    return _issue(dest, source, nbytes, pe)


def _emu_put_signal(dest, source, nbytes, sig, value, pe, op=SIGNAL_SET):
    return _issue(dest, source, nbytes, pe, sig, value, _scalar(op))


def _emu_quiet():
    dead = sorted(_UNACKED & _DEAD)
    if dead:
        raise RuntimeError(f"emulated NVSHMEM: nvshmem_quiet would block on pe {dead[0]}: a put to it is never "
                           "acknowledged (dead process: the NIC retries until its retry count is exhausted, then the "
                           "QP goes to the error state); no timeout applies")
    deliver()
    _UNACKED.clear()
    return 0


# ---------------------------------------------------------------------------------------------- the device names
if INTERPRET:
    @triton.jit
    def putmem_nbi_block(dest, source, nbytes, pe):
        """(Emulation) non-blocking block put of ``nbytes`` from this rank's ``source`` to ``pe``'s ``dest``."""
        return _emu_put(dest, source, nbytes, pe)

    @triton.jit
    def putmem_signal_nbi_block(dest, source, nbytes, sig, value, pe, SIG_OP: tl.constexpr = 9):
        """(Emulation) block put, then ``pe``'s 64-bit signal word ``sig`` set to (``SIG_OP`` = 9) or increased by
        (10) ``value`` once the payload is there."""
        return _emu_put_signal(dest, source, nbytes, sig, value, pe, SIG_OP)

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
    def putmem_signal_nbi_block(dest, source, nbytes, sig, value, pe, SIG_OP: tl.constexpr = 9):
        """``nvshmemx_putmem_signal_nbi_block``: the payload, then ``pe``'s 64-bit signal word ``sig`` set to
        (``SIG_OP`` = ``NVSHMEM_SIGNAL_SET`` = 9) or increased by (``NVSHMEM_SIGNAL_ADD`` = 10) ``value``."""
        return _putmem_signal_nbi_block(dest.to(tl.int64), source.to(tl.int64), nbytes + tl.zeros([], tl.int64),
                                        sig.to(tl.int64), (value + tl.zeros([], tl.int64)).to(tl.uint64),
                                        tl.full([], SIG_OP, tl.int32), (pe + tl.zeros([], tl.int32)).to(tl.int32))

    @triton.jit
    def quiet():
        """``nvshmem_quiet``: every outstanding put of this PE is complete (delivered) when it returns."""
        return _quiet()
