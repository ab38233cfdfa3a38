"""What ``moe_ep.Buffer(backend="auto")`` runs on: the CUDA-graph capturable backend where one fits.

:func:`choose_backend` is a pure function of topology facts (so it can be tested with made-up ones);
:func:`gather_facts` collects them collectively at Buffer creation (two small host exchanges over the group,
only on CUDA; a CPU / gloo group needs none and gets ``torch``).
"""

from __future__ import annotations

import dataclasses
import socket
import warnings

import torch
import torch.distributed as dist

import logging

_log = logging.getLogger(__name__)

__all__ = ["TopologyFacts", "choose_backend", "gather_facts", "warn_not_capturable"]


@dataclasses.dataclass(frozen=True)
class TopologyFacts:
    """What the choice depends on, the same on every rank of the group.

    Attributes:
        cuda: the group runs on CUDA devices (an NCCL group); ``False`` for CPU / gloo.
        num_nodes: distinct hosts among the group's ranks.
        peer_access: every rank's device can access every same-host rank's device (CUDA P2P), as the ``symm``
            backend's one-node symmetric memory needs.
        nvshmem_usable: :func:`moe_ep.nvshmem.check_available` passed on every rank (across nodes).
    """
    cuda: bool
    num_nodes: int = 1
    peer_access: bool = False
    nvshmem_usable: bool = False


def choose_backend(facts: TopologyFacts, *, low_latency_mode: bool, num_nvl_bytes: int, num_rdma_bytes: int) -> str:
    """The backend ``"auto"`` means for a Buffer with these sizes on this topology.

    - CPU / gloo: ``"torch"``.
    - one node with CUDA peer access: ``"symm"`` when the sizes it needs were given (``num_nvl_bytes > 0`` for a
      normal-mode Buffer, ``num_rdma_bytes > 0`` for a low-latency one, as DeepEP needs them too);
    - several nodes: ``"nvshmem"`` for a low-latency-only Buffer (``num_nvl_bytes == 0``, ``num_rdma_bytes > 0``)
      when NVSHMEM is usable (its normal mode is not in this release);
    - otherwise ``"torch"`` (host-synchronising, not capturable in a CUDA graph).
    """
    if not facts.cuda:
        return "torch"
    sized = (num_nvl_bytes > 0 or low_latency_mode) and (num_rdma_bytes > 0 or not low_latency_mode)
    if facts.num_nodes == 1 and facts.peer_access and sized:
        return "symm"
    if facts.num_nodes > 1 and facts.nvshmem_usable and low_latency_mode and num_rdma_bytes > 0 \
            and num_nvl_bytes == 0:
        return "nvshmem"
    return "torch"


def gather_facts(group) -> TopologyFacts:
    """Collective over ``group`` (every rank calls it): the facts of :class:`TopologyFacts`."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" not in backend or not torch.cuda.is_available():
        return TopologyFacts(cuda=False)
    world = dist.get_world_size(group)
    me = (socket.gethostname(), torch.cuda.current_device(), torch.cuda.device_count())
    everyone = [None] * world
    dist.all_gather_object(everyone, me, group=group)
    hosts = {h for h, _, _ in everyone}
    same_host = [(d, n) for h, d, n in everyone if h == me[0]]
    # Peer access is checked from this process; with per-process CUDA_VISIBLE_DEVICES the peers' devices are not
    # visible here (different device counts), and "unknown" counts as no.
    peer_ok = all(n == me[2] for _, n in same_host) and all(
        d == me[1] or torch.cuda.can_device_access_peer(me[1], d) for d, _ in same_host)
    nvshmem_ok = False
    if len(hosts) > 1:
        from .. import nvshmem
        try:
            nvshmem.check_available(internode=True)
            nvshmem_ok = True
        except Exception:  # noqa: BLE001 - any reason it cannot run means "not usable" here
            nvshmem_ok = False
    votes = [None] * world
    dist.all_gather_object(votes, (peer_ok, nvshmem_ok), group=group)
    return TopologyFacts(cuda=True, num_nodes=len(hosts), peer_access=all(p for p, _ in votes),
                         nvshmem_usable=all(n for _, n in votes))


_warned = False


def warn_not_capturable(facts: TopologyFacts) -> None:
    """Once per process: a low-latency Buffer on CUDA fell back to ``torch`` (not CUDA-graph capturable)."""
    global _warned
    if _warned:
        return
    _warned = True
    why = ("the ranks span nodes and NVSHMEM is not usable here (moe_ep.nvshmem.check_available says why), or the "
           "Buffer also has a normal-mode buffer (num_nvl_bytes > 0)" if facts.num_nodes > 1 else
           "CUDA peer access between the ranks' devices was not confirmed" if not facts.peer_access else
           "num_rdma_bytes is 0 (size it with Buffer.get_low_latency_rdma_size_hint)")
    _log.info("backend='auto' fell back to 'torch' for a low-latency Buffer on CUDA (not CUDA-graph capturable): %s",
              why)
    warnings.warn(f"moe_ep.Buffer(backend='auto'): this low-latency Buffer runs on backend 'torch', which synchronises "
                  f"with the host and cannot be captured in a CUDA graph ({why}). For a capturable decode path pass "
                  "backend='symm' (one node, num_rdma_bytes from Buffer.get_low_latency_rdma_size_hint) or "
                  "backend='nvshmem' (across nodes, a low-latency-only Buffer).", UserWarning, stacklevel=3)
