"""Symmetric buffers: every rank holds a region of the same size, and every rank can address every
peer's region through a table of base addresses. The ``symm`` backend's kernels take those tables
(``buffer_ptrs``, ``signal_ptrs``: int64, one entry per rank) and cast the entries to typed pointers.

Three providers build the tables:

- ``"cuda"``: ``torch.distributed._symmetric_memory`` on GPUs that can map each other's memory (one
  node, NVLink or PCIe P2P): ``empty`` + ``rendezvous`` give each rank the peers' mapped addresses.
- ``"shm"``: CPU processes (tests, the CPU demo): each rank creates one POSIX shared-memory file,
  every rank maps every peer's file, and each builds its own table of *its* mapped addresses (the
  same shape as CUDA IPC). Kernels run under the Triton interpreter. The files are unlinked as soon
  as every rank has mapped them, so nothing is left in ``/dev/shm`` even when a rank is killed.
- ``"virtual"``: one process, ``N`` virtual ranks on one device (CPU or one GPU): one allocation
  sliced ``N`` ways (:func:`create_virtual_symm_buffers`). Each virtual rank's phase is a separate
  launch; this is how a single GPU measures the kernels.

Region of one rank (``SymmBuffer.buffer`` and ``SymmBuffer.signals`` are views into it)::

    [0, nbytes)                               data (uint8), carved by the backend
    [nbytes_aligned, + 4 * num_signals)       signals (int32), zero at creation

``status`` (int32 ``[4 + 5 R]``, local, never addressed by peers): word 0 is ``peer + 1`` of the first wait
that timed out (:mod:`moe_ep.kernels.signals`); :meth:`SymmBuffer.check_status` turns it into a
:class:`moe_ep.RankTimeoutError`. Word 1 = 1 turns rank masking on (``enable_shrink``) and words ``4 + r``
hold rank r's mask word (low-latency kernels read them; a timed-out wait sets one instead of word 0). Words
``4 + R + (2 kind + slot) R + p``: the low-latency receives' verdicts on source ``p`` (kind 0 dispatch, 1 combine,
double-buffer slot; 0 between launches, docs/protocols.md).
"""

from __future__ import annotations

import mmap
import os
import uuid
from typing import Optional

import torch
import torch.distributed as dist

from .sync import ArrivalCheck, RankTimeoutError

__all__ = ["SymmBuffer", "create_symm_buffer", "create_virtual_symm_buffers", "PROVIDERS"]

PROVIDERS = ("auto", "cuda", "shm", "virtual")
_ALIGN = 256


def _align(n: int, a: int = _ALIGN) -> int:
    return (n + a - 1) // a * a


class SymmBuffer:
    """One rank's view of a symmetric allocation.

    Attributes:
        rank, world_size: this rank and the number of ranks sharing the allocation.
        nbytes: usable data bytes per rank (the size asked for rounded up to 256 bytes, what every rank maps);
            num_signals: int32 signal words per rank.
        buffer: `[nbytes]` `torch.uint8`, this rank's data region.
        signals: `[num_signals]` `torch.int32`, this rank's signal words (zero at creation).
        buffer_ptrs, signal_ptrs: `[world_size]` `torch.int64` on ``device``: entry ``r`` is the address,
            valid in this process, of rank ``r``'s data / signal region.
        status: `[4]` `torch.int32`, local timeout report (word 0: ``peer + 1`` or 0).
        provider: ``"cuda"``, ``"shm"`` or ``"virtual"``.
    """

    def __init__(self, *, rank: int, world_size: int, nbytes: int, num_signals: int, region: torch.Tensor,
                 peer_addrs: list[int], provider: str, timeout_s: float, keepalive: tuple = (),
                 arrival: Optional[ArrivalCheck] = None):
        self.rank = rank
        self.world_size = world_size
        self.nbytes = nbytes
        self.num_signals = num_signals
        self.provider = provider
        self.timeout_s = timeout_s
        self.device = region.device
        sig_off = _align(nbytes)
        self.buffer = region[:nbytes]
        self.signals = region[sig_off:sig_off + 4 * num_signals].view(torch.int32)
        self.buffer_ptrs = torch.tensor(peer_addrs, dtype=torch.int64).to(self.device)
        self.signal_ptrs = torch.tensor([a + sig_off for a in peer_addrs], dtype=torch.int64).to(self.device)
        # word 0: timeout / error report; word 1: enable_shrink flag; words 4..4+R: the rank mask (low-latency);
        # word 4+R: the low-latency receives' per-launch liveness decision (zero between launches)
        self.status = torch.zeros(4 + 5 * world_size, dtype=torch.int32, device=self.device)
        self._keepalive = keepalive  # mmaps / symmetric-memory handles that must outlive the tables
        self._arrival = arrival
        self._pending: list = []  # (event, pinned status copy, what) for CUDA status checks
        self.broken: Optional[str] = None

    @property
    def timeout_ns(self) -> int:
        return int(self.timeout_s * 1e9)

    # ------------------------------------------------------------------ host-side coordination
    def barrier(self, what: str = "barrier") -> None:
        """Host barrier over the group's store, bounded by ``timeout_s`` (names missing ranks). On CPU, in the
        emulation's ``deferred`` order, it first completes this process's pending emulated NVSHMEM puts, as
        ``nvshmem_barrier_all`` quiets first (the ``manual`` order delivers only when a test says so)."""
        if self.device.type != "cuda":
            from .kernels import nvshmem_device

            if nvshmem_device.emulation_order() == "deferred":
                nvshmem_device.deliver()
        if self._arrival is not None:
            self._arrival.arrive(what)

    def check_usable(self) -> None:
        if self.broken is not None:
            raise RuntimeError(f"this symmetric buffer is unusable after an earlier error ({self.broken}); "
                               "destroy the Buffer and create a new one")

    def _raise_status(self, code: int, what: str) -> None:
        from .kernels.signals import STATUS_WORST_EXCEEDED, status_message

        if STATUS_WORST_EXCEEDED < code <= -16:  # STATUS_SIG_MISMATCH - peer: that peer's call signature differs
            from .sync import CallMismatchError
            peer = -16 - code
            self.broken = f"rank {peer} made a different call ({what})"
            exc = CallMismatchError(f"moe_ep {what}: rank {peer}'s call (hidden, T, experts, top-k or format) differs "
                                    f"from this rank's ({self.rank}); nothing was read from it", ["call"])
            exc.peer = peer
            raise exc
        if code < 0:  # a device-side error flag (see moe_ep.kernels.signals.STATUS_*)
            self.broken = status_message(code)
            raise RuntimeError(f"moe_ep {what}: {self.broken} (this is rank {self.rank}; outputs since then are "
                               "NaN; destroy the Buffer)")
        peer = code - 1
        self.broken = f"rank {peer} did not arrive at {what}"
        raise RankTimeoutError(
            f"moe_ep {what}: rank(s) [{peer}] did not signal within {self.timeout_s:.1f} s (this is rank "
            f"{self.rank}; a peer died, hangs, or skipped this call)", [peer])

    def check_status(self, what: str, blocking: Optional[bool] = None) -> None:
        """Raise :class:`RankTimeoutError` if a wait of this rank timed out.

        On CPU the check reads ``status`` directly. On a GPU a blocking check synchronises; the
        default (non-blocking) queues a copy to pinned memory and raises at a later call once that copy
        has landed, so the hot path never waits on the device. While a CUDA graph is being captured the
        check does nothing on the device (no event query, no synchronisation, nothing queued: any of
        them would abort the capture): call :meth:`check_status` with ``blocking=True`` after a replay.
        Events and streams go through :mod:`moe_ep.events` (the stream checker sees them).
        """
        from . import events

        self.check_usable()
        if not events.uses_streams(self.device):
            code = int(self.status[0])
            if code:
                self._raise_status(code, what)
            return
        if events.is_capturing(self.device):
            return
        still = []
        for ev, host, w in self._pending:
            if events.query(ev):
                if int(host[0]):
                    self._pending = []
                    self._raise_status(int(host[0]), w)
            else:
                still.append((ev, host, w))
        self._pending = still
        if blocking:
            events.synchronize(self.device)
            code = int(self.status[0])
            if code:
                self._raise_status(code, what)
        elif len(self._pending) < 64:
            host = events.empty_pinned(1, torch.int32)
            host.copy_(self.status[:1], non_blocking=True)
            events.launch(reads=(self.status,), writes=(host,), what="check_status (status copy)")
            ev = events.new_event()
            events.record(ev)
            self._pending.append((ev, host, what))

    def close(self) -> None:
        """Drop the mappings (idempotent). Tensors handed out earlier must not be used afterwards."""
        self._keepalive = ()
        self._pending = []


# ---------------------------------------------------------------------- providers
def _group_ranks(group) -> tuple:
    return tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))


def _create_shm(group, rank: int, world_size: int, total: int, timeout_s: float, arrival: ArrivalCheck):
    """POSIX shared memory: one file per rank in /dev/shm, mapped by every rank."""
    shm_dir = "/dev/shm"
    if not os.path.isdir(shm_dir):
        raise RuntimeError("the 'shm' provider needs /dev/shm (Linux POSIX shared memory)")
    name = os.path.join(shm_dir, f"moe_ep_{os.getpid()}_{uuid.uuid4().hex[:12]}")
    fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    maps: list = [None] * world_size
    try:
        os.ftruncate(fd, total)  # zero-filled
        maps[rank] = mmap.mmap(fd, total)
        os.close(fd)
        fd = -1
        names: list = [None] * world_size
        dist.all_gather_object(names, name, group=group)
        for r, peer_name in enumerate(names):
            if r == rank:
                continue
            pfd = os.open(peer_name, os.O_RDWR)
            try:
                maps[r] = mmap.mmap(pfd, total)
            finally:
                os.close(pfd)
        arrival.arrive("symm shm mapping")
    finally:
        if fd >= 0:
            os.close(fd)
        # NOTES: unlink as soon as every peer has mapped (or on any failure): the mappings stay valid,
        # and the memory is released when the last process holding one exits, however it exits.
        try:
            os.unlink(name)
        except FileNotFoundError:
            pass
    regions = [torch.frombuffer(m, dtype=torch.uint8) for m in maps]
    addrs = [t.data_ptr() for t in regions]
    return regions[rank], addrs, (maps, regions)


def _create_cuda(group, rank: int, world_size: int, total: int, device: torch.device, arrival: ArrivalCheck):
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as exc:  # pragma: no cover - depends on the torch build
        raise RuntimeError("the 'cuda' provider needs torch.distributed._symmetric_memory (torch >= 2.5)") from exc
    group = group if group is not None else dist.group.WORLD
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:
        try:
            enable(group.group_name)
        except Exception:  # noqa: BLE001 - newer torch deprecates/no-ops it
            pass
    region = symm_mem.empty(total, dtype=torch.uint8, device=device)
    region.zero_()
    torch.cuda.synchronize(device)
    handle = symm_mem.rendezvous(region, group)
    addrs = [int(p) for p in handle.buffer_ptrs]
    arrival.arrive("symm cuda rendezvous")
    return region, addrs, (handle,)


def create_symm_buffer(group, nbytes: int, num_signals: int, *, device: Optional[torch.device] = None,
                       provider: str = "auto", timeout_s: float = 60.0) -> SymmBuffer:
    """Collectively allocate a symmetric buffer over ``group`` (every rank calls it, same sizes).

    Arguments:
        group: torch.distributed process group (``None``: the default group).
        nbytes: data bytes per rank; num_signals: int32 signal words per rank.
        device: where the region lives (default: the current CUDA device for ``"cuda"``, else CPU).
        provider: ``"cuda"``, ``"shm"`` or ``"auto"`` (``"cuda"`` for a CUDA device, else ``"shm"``).
        timeout_s: bound of every wait on this buffer (host barrier and kernel signal waits).

    Returns:
        :class:`SymmBuffer` of this rank.
    """
    if provider not in PROVIDERS or provider == "virtual":
        raise ValueError(f"provider must be 'auto', 'cuda' or 'shm' (virtual ranks: create_virtual_symm_buffers), "
                         f"got {provider!r}")
    if not isinstance(nbytes, int) or nbytes < 0 or not isinstance(num_signals, int) or num_signals < 0:
        raise ValueError(f"nbytes and num_signals must be non-negative ints, got {nbytes!r}, {num_signals!r}")
    if not dist.is_initialized():
        raise RuntimeError("create_symm_buffer needs torch.distributed to be initialised")
    group = group if group is not None else dist.group.WORLD
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if provider == "cuda" else torch.device("cpu")
    device = torch.device(device)
    if provider == "auto":
        provider = "cuda" if device.type == "cuda" else "shm"
    if (provider == "cuda") != (device.type == "cuda"):
        raise ValueError(f"provider {provider!r} cannot place memory on {device}")
    # The data region every rank maps is ``nbytes`` rounded up to 256 bytes, and every layout offset (per-source
    # blocks, rounds, slot spans, the signal region) derives from that size: sizes that round alike (6,300 and
    # 6,400) give one layout, sizes that do not would address each other's memory differently, so the mapped
    # sizes are compared once, before any mapping.
    data = _align(nbytes)
    total = data + _align(4 * max(num_signals, 1))
    arrival = ArrivalCheck(group, rank, world_size, timeout_s)
    arrival.arrive("symm buffer creation", fields={"nbytes (num_nvl_bytes / num_rdma_bytes rounded up to 256)": data,
                                                   "num_signals": num_signals, "provider": provider})
    if provider == "shm":
        region, addrs, keep = _create_shm(group, rank, world_size, total, timeout_s, arrival)
    else:
        region, addrs, keep = _create_cuda(group, rank, world_size, total, device, arrival)
    return SymmBuffer(rank=rank, world_size=world_size, nbytes=data, num_signals=num_signals, region=region,
                      peer_addrs=addrs, provider=provider, timeout_s=timeout_s, keepalive=keep, arrival=arrival)


def create_virtual_symm_buffers(world_size: int, nbytes: int, num_signals: int, *,
                                device: Optional[torch.device] = None, timeout_s: float = 60.0) -> list[SymmBuffer]:
    """``world_size`` virtual ranks in this process: one allocation on ``device`` sliced ``world_size``
    ways. Returns one :class:`SymmBuffer` per virtual rank (they share the address tables).

    NOTES: virtual ranks run their phases as separate launches in order (every rank's send, then every
    rank's receive); a receive launched before the matching send times out instead of hanging.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    device = torch.device(device if device is not None else "cpu")
    per_rank = _align(nbytes) + _align(4 * max(num_signals, 1))
    slab = torch.zeros(world_size * per_rank, dtype=torch.uint8, device=device)
    base = slab.data_ptr()
    addrs = [base + r * per_rank for r in range(world_size)]
    return [SymmBuffer(rank=r, world_size=world_size, nbytes=_align(nbytes), num_signals=num_signals,
                       region=slab[r * per_rank:(r + 1) * per_rank], peer_addrs=addrs, provider="virtual",
                       timeout_s=timeout_s, keepalive=(slab,)) for r in range(world_size)]
