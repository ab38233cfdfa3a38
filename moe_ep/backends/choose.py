"""What ``moe_ep.Buffer(backend="auto")`` runs on: the CUDA-graph capturable backend where one fits.

:func:`choose_backend` is a pure function of topology facts (so it can be tested with made-up ones);
:func:`gather_facts` collects them collectively at Buffer creation (two small host exchanges over the group,
only where CUDA is available, whatever the group's backend; a machine without CUDA needs none and gets
``torch``). The choice is logged on the ``"moe_ep"`` logger (INFO).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import warnings
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["TopologyFacts", "choose_backend", "gather_facts", "warn_not_capturable", "backend_from_env"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TopologyFacts:
    """What the choice depends on, the same on every rank of the group.

    Attributes:
        cuda: this machine has CUDA devices (whatever the group's backend); ``False`` without CUDA.
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

    - no CUDA: ``"torch"``.
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


def _device_ids() -> tuple:
    """``(uuid of the current device, [uuid of each visible device])``, ``(None, [])`` where they cannot be read."""
    try:
        ids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
        return ids[torch.cuda.current_device()], ids
    except Exception:  # noqa: BLE001 - no uuid (old torch, stubbed CUDA): every peer is "unknown"
        return None, []


def _peer_reachable(mine: Optional[str], visible: list, theirs: Optional[str]) -> tuple:
    """``(reachable, why)`` for one same-host peer's device ``theirs`` (a uuid), asked of the CUDA driver."""
    if mine is None or theirs is None:
        return False, "device uuids unknown"
    if theirs == mine:
        return True, "the same device"
    if theirs not in visible:
        return False, "a peer's device is not visible in this process (per-process CUDA_VISIBLE_DEVICES: peer " \
                      "access cannot be queried; make every GPU visible and select one per rank)"
    me, peer = visible.index(mine), visible.index(theirs)
    if torch.cuda.can_device_access_peer(me, peer):
        return True, f"cuda:{me} -> cuda:{peer} peer access"
    return False, f"cuda:{me} cannot access cuda:{peer} (no P2P)"


def gather_facts(group) -> TopologyFacts:
    """Collective over ``group`` (every rank calls it): the facts of :class:`TopologyFacts`, from the machine.

    The group's own backend does not matter (a gloo group on GPUs, as vLLM passes, only exchanges these facts and
    the buffers' handles). Peer access is asked of the driver for every same-host peer's physical device (by
    uuid); a device this process cannot see counts as not reachable."""
    if not torch.cuda.is_available():
        return TopologyFacts(cuda=False)
    world = dist.get_world_size(group)
    mine, visible = _device_ids()
    me = (socket.gethostname(), mine)
    everyone = [None] * world
    dist.all_gather_object(everyone, me, group=group)
    hosts = {h for h, _ in everyone}
    peer_ok, whys = True, []
    for host, theirs in everyone:
        if host == me[0]:
            ok, why = _peer_reachable(mine, visible, theirs)
            peer_ok = peer_ok and ok
            if not ok:
                whys.append(why)
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
    if whys:
        log.info("moe_ep backend choice: no CUDA peer access from this rank: %s", "; ".join(sorted(set(whys))))
    return TopologyFacts(cuda=True, num_nodes=len(hosts), peer_access=all(p for p, _ in votes),
                         nvshmem_usable=all(n for _, n in votes))


def backend_from_env(backend: str) -> str:
    """``backend="auto"`` with ``MOE_EP_BACKEND`` set (``torch`` / ``symm`` / ``nvshmem``): that backend, for engine
    code that cannot pass ``backend=``; otherwise ``backend`` as given."""
    env = os.environ.get("MOE_EP_BACKEND", "").strip()
    if backend != "auto" or env in ("", "auto"):
        return backend
    if env not in ("torch", "symm", "nvshmem"):
        raise ValueError(f"MOE_EP_BACKEND must be one of auto, torch, symm, nvshmem; got {env!r}")
    return env


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
    log.info("backend='auto' fell back to 'torch' for a low-latency Buffer on CUDA (not CUDA-graph capturable): %s",
              why)
    warnings.warn(f"moe_ep.Buffer(backend='auto'): this low-latency Buffer runs on backend 'torch', which synchronises "
                  f"with the host and cannot be captured in a CUDA graph ({why}). For a capturable decode path pass "
                  "backend='symm' (one node, num_rdma_bytes from Buffer.get_low_latency_rdma_size_hint) or "
                  "backend='nvshmem' (across nodes, a low-latency-only Buffer).", UserWarning, stacklevel=3)
