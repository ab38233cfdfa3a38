"""The ``nvshmem`` backend: low-latency dispatch / combine across nodes, device-initiated (IBGDA), graph-capturable.

The kernels are the ``symm`` backend's (:mod:`moe_ep.kernels.low_latency`) with ``TRANSPORT = NVSHMEM``
(:mod:`moe_ep.kernels.transport`): a sender writes into its own symmetric memory, then moves the bytes to each peer
with a block-scoped NVSHMEM put-with-signal (peers on other nodes: each landed put is counted in the receiver's
signal word) or a block copy through the mapped pointer (peers whose memory this GPU can address: the same node,
and itself), and announces them with a put-with-signal carrying the count; no ``nvshmem_quiet`` on the hot path
(docs/protocols.md, "NVSHMEM: no quiet on the hot path"). Everything else (API, semantics, hooks, FP8 options,
combine formats, masks, status words, call signatures) is the ``symm`` backend's: :class:`NvshmemBackend` is a
:class:`~moe_ep.backends.symm.SymmBackend` whose low-latency path runs that transport over an NVSHMEM heap.

Heaps:

- GPU: torch symmetric memory's NVSHMEM backend (:func:`moe_ep.nvshmem.create_nvshmem_heap`), after
  :func:`moe_ep.nvshmem.check_available` has named anything missing (wheel, driver, IBGDA) before any allocation;
  every kernel module is initialised for NVSHMEM when Triton loads it (:func:`moe_ep.nvshmem.register_kernels`).
- CPU (tests, under the Triton interpreter): the ``shm`` provider of :mod:`moe_ep.symm`, registered with the
  emulated NVSHMEM calls of :mod:`moe_ep.kernels.nvshmem_device`. ``ranks_per_node`` (default 1: every peer is
  "remote") decides which peers keep their mapped pointer, so both paths of the transport run on CPU.

Normal (prefill) mode is not part of this backend: use ``backend="symm"`` inside a node or ``backend="torch"``
(NCCL, node-aware with ``ranks_per_node``) across nodes.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from .._env import require_triton_device
from ..kernels.pdl import INTERPRET
from ..symm import create_symm_buffer
from .symm import SymmBackend, _default_device

__all__ = ["NvshmemBackend", "nvshmem_ll_size_hint", "virtual_nvshmem_paths"]

NVSHMEM_TRANSPORT = 1


def nvshmem_ll_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int,
                         num_topk: int = 8) -> int:
    """``num_rdma_bytes`` of the ``nvshmem`` backend for low-latency calls up to these shapes: the ``symm`` size plus
    the staging area a sender writes before its puts (count staging + ``[L * R*T, 2 hidden]`` combine staging)."""
    from .symm_ll import ll_buffer_bytes
    return ll_buffer_bytes(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts, num_topk, NVSHMEM_TRANSPORT)


def _emulate_on(buf, ranks_per_node: int):
    """Make ``buf`` (one rank's shm or virtual symmetric buffer) an emulated NVSHMEM heap: its whole mapping is
    registered with :mod:`moe_ep.kernels.nvshmem_device`, and peers outside this rank's "node" lose their mapped
    pointer (table entry 0), so the kernels reach them through the emulated puts."""
    from ..kernels import nvshmem_device

    peers = [int(a) for a in buf.buffer_ptrs.tolist()]
    span = int(buf.signal_ptrs[buf.rank].item()) - peers[buf.rank] + 4 * buf.num_signals
    entry = nvshmem_device.register_heap(peers[buf.rank], span, peers)
    # Unregistered (its pending puts settled) when the Buffer is destroyed, or else before its mapping is freed with it.
    buf._nvshmem_unregister = weakref.finalize(buf, nvshmem_device.unregister_heap, peers[buf.rank], entry)
    keep = torch.tensor([r // ranks_per_node == buf.rank // ranks_per_node for r in range(buf.world_size)])
    buf.buffer_ptrs = torch.where(keep, buf.buffer_ptrs, torch.zeros_like(buf.buffer_ptrs))
    buf.signal_ptrs = torch.where(keep, buf.signal_ptrs, torch.zeros_like(buf.signal_ptrs))
    buf._nvshmem_heap_base = peers[buf.rank]
    return buf


def _emulated_heap(group, rank: int, world_size: int, nbytes: int, num_signals: int, timeout_s: float,
                   ranks_per_node: int):
    """CPU: this rank's shm symmetric buffer as an emulated NVSHMEM heap (:func:`_emulate_on`)."""
    buf = create_symm_buffer(group, nbytes, num_signals, device=torch.device("cpu"), provider="shm",
                             timeout_s=timeout_s)
    return _emulate_on(buf, ranks_per_node)


def virtual_nvshmem_paths(world_size: int, num_rdma_bytes: int, *, ranks_per_node: int = 1, owner: int = 0,
                          timeout_s: float = 60.0) -> list:
    """``world_size`` virtual ranks in this process (CPU, Triton interpreter) whose low-latency paths run the NVSHMEM
    transport over the emulated calls (eager order: one process cannot tell one virtual PE's ``quiet`` from another's).
    Peers outside a rank's ``ranks_per_node`` group are reached by emulated puts. Returns one
    :class:`~moe_ep.backends.symm_ll.SymmLowLatency` per rank (phases as in ``virtual_low_latency_step``)."""
    from ..symm import create_virtual_symm_buffers
    from .symm_ll import SymmLowLatency

    bufs = create_virtual_symm_buffers(world_size, num_rdma_bytes, SymmLowLatency.num_signals(world_size),
                                       device=torch.device("cpu"), timeout_s=timeout_s)
    return [SymmLowLatency(_emulate_on(b, ranks_per_node), owner, transport=NVSHMEM_TRANSPORT) for b in bufs]


class NvshmemBackend(SymmBackend):
    """``nvshmem`` backend of one rank (low-latency mode only; see the module docstring).

    Extra keyword arguments (through ``moe_ep.Buffer(..., backend="nvshmem", **kwargs)``):
        device: where the buffer lives (default: the current CUDA device with NCCL groups, else CPU).
        ranks_per_node: CPU emulation only: ranks ``r`` with the same ``r // ranks_per_node`` reach each other through
            mapped pointers, the others through (emulated) NVSHMEM puts (default 1). On GPUs the heap reports which
            peers are mapped (the same node).
    """

    name = "nvshmem"
    graph_safe_low_latency = True

    def __init__(self, group, rank: int, world_size: int, *, num_nvl_bytes: int, num_rdma_bytes: int,
                 low_latency_mode: bool, timeout_s: float, device: Optional[torch.device] = None,
                 ranks_per_node: Optional[int] = None, _symm_buffers: Optional[tuple] = None):
        if num_nvl_bytes > 0 or not low_latency_mode:
            raise ValueError("backend 'nvshmem' runs low-latency mode only (Buffer(group, 0, num_rdma_bytes, "
                             "low_latency_mode=True, backend='nvshmem')); for normal (prefill) mode use backend='symm' "
                             "inside a node or backend='torch' (NCCL; ranks_per_node= for the node-aware path) across nodes")
        if num_rdma_bytes <= 0:
            raise ValueError("backend 'nvshmem' needs num_rdma_bytes > 0 (see NvshmemBackend.get_low_latency_size_hint)")
        if ranks_per_node is not None and (not isinstance(ranks_per_node, int) or ranks_per_node < 1):
            raise ValueError(f"ranks_per_node must be a positive int, got {ranks_per_node!r}")
        from .symm_ll import SymmLowLatency

        device = torch.device(device) if device is not None else _default_device(group)
        num_signals = SymmLowLatency.num_signals(world_size)
        if _symm_buffers is None:
            if device.type == "cuda" and not INTERPRET:
                from .. import nvshmem as host

                host.check_available(device, internode=True)
                host.register_kernels(*_kernels())
                ll_buf = host.create_nvshmem_heap(group, num_rdma_bytes, num_signals, timeout_s, device=device)
                if ll_buf.pe_list != list(range(world_size)):
                    ll_buf.close()
                    raise ValueError("backend 'nvshmem' needs a group whose rank r is global rank r (the kernels pass "
                                     f"group ranks as NVSHMEM PEs, which are global ranks; this group's are "
                                     f"{ll_buf.pe_list}): build the Buffer over the default group")
            else:
                require_triton_device('moe_ep backend="nvshmem"')
                if device.type != "cpu":
                    raise ValueError(f"backend 'nvshmem' without a compiled GPU build runs on CPU only, not {device}")
                ll_buf = _emulated_heap(group, rank, world_size, num_rdma_bytes, num_signals, timeout_s,
                                        ranks_per_node or 1)
            _symm_buffers = (None, ll_buf)
        super().__init__(group, rank, world_size, num_nvl_bytes=0, num_rdma_bytes=num_rdma_bytes,
                         low_latency_mode=True, timeout_s=timeout_s, _symm_buffers=_symm_buffers)
        self.ll.transport = NVSHMEM_TRANSPORT

    @staticmethod
    def get_low_latency_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                  num_experts: int, num_topk: int = 8) -> int:
        """``num_rdma_bytes`` for low-latency calls up to these shapes (:func:`nvshmem_ll_size_hint`)."""
        return nvshmem_ll_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts, num_topk)

    def destroy(self) -> None:
        for b in self._buffers:
            unregister = getattr(b, "_nvshmem_unregister", None)
            if unregister is not None:
                unregister()
        super().destroy()


def _kernels() -> tuple:
    from ..kernels import low_latency as ll
    return (ll._ll_dispatch_send_kernel, ll._ll_dispatch_recv_kernel, ll._ll_combine_send_fmt_kernel,
            ll._ll_combine_recv_fmt_kernel, ll._ll_quiet_kernel)
