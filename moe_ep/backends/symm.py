"""The ``symm`` backend: device-initiated dispatch/combine, Triton kernels over symmetric memory.

Kernels write straight into the peers' buffers through tables of peer base addresses
(:mod:`moe_ep.symm`) and synchronise with signals in the peers' memory
(:mod:`moe_ep.kernels.signals`); nothing goes through a collective library, and the low-latency
path never reads device data on the host, so it can be captured in a CUDA graph.

Two independent symmetric allocations per rank, sized as in DeepEP:

- ``num_nvl_bytes`` (normal mode, :class:`~moe_ep.backends.symm_normal.SymmNormal`):
  size it with :meth:`SymmBackend.get_normal_size_hint`;
- ``num_rdma_bytes`` (low-latency mode, :class:`~moe_ep.backends.symm_ll.SymmLowLatency`):
  size it with :meth:`SymmBackend.get_low_latency_size_hint`.

A call whose shapes do not fit raises ``ValueError`` naming the size needed, before any kernel runs.

Each operation runs as two phases, a send launch and a receive launch (the phase rule of
DESIGN.md); :meth:`moe_ep.Buffer.dispatch` runs both, ``return_recv_hook=True`` returns the
receive as the hook, and :func:`virtual_backends` exposes the phases of ``N`` virtual ranks in one
process so one device can run (and time) every rank.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .._env import require_triton_device
from ..kernels.signals import STATUS_BAD_EXPERT
from ..symm import create_symm_buffer, create_virtual_symm_buffers
from .base import Backend, LowLatencyDispatchResult

__all__ = ["SymmBackend", "virtual_backends", "virtual_dispatch_recv", "virtual_combine_recv"]

# torch >= 2.13 renamed all_gather_into_tensor (the old name warns); torch 2.11 has only the old one.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _normal_path():
    from .symm_normal import SymmNormal
    return SymmNormal


def _ll_path():
    from .symm_ll import SymmLowLatency
    return SymmLowLatency


def _default_device(group) -> torch.device:
    backend = dist.get_backend(group) if group is not None else dist.get_backend()
    if "nccl" in str(backend).lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class SymmBackend(Backend):
    """``symm`` backend of one rank (see the module docstring).

    Extra keyword arguments (through ``moe_ep.Buffer(..., backend="symm", **kwargs)``):
        provider: ``"auto"`` (default: ``"cuda"`` on GPUs, ``"shm"`` on CPU), ``"cuda"`` or ``"shm"``.
        device: where the buffers live (default: the current CUDA device with NCCL groups, else CPU).
    """

    name = "symm"
    graph_safe_low_latency = True

    def __init__(self, group, rank: int, world_size: int, *, num_nvl_bytes: int, num_rdma_bytes: int,
                 low_latency_mode: bool, timeout_s: float, provider: str = "auto",
                 device: Optional[torch.device] = None, _symm_buffers: Optional[tuple] = None):
        require_triton_device('moe_ep backend="symm"')
        super().__init__(group, rank, world_size, num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=num_rdma_bytes,
                         low_latency_mode=low_latency_mode, timeout_s=timeout_s)
        if _symm_buffers is not None:  # virtual ranks
            normal_buf, ll_buf = _symm_buffers
        else:
            device = torch.device(device) if device is not None else _default_device(group)
            normal_buf = ll_buf = None
            if num_nvl_bytes > 0:
                normal_buf = create_symm_buffer(group, num_nvl_bytes, _normal_path().num_signals(world_size),
                                                device=device, provider=provider, timeout_s=timeout_s)
            if low_latency_mode:
                if num_rdma_bytes <= 0:
                    raise ValueError("backend 'symm' with low_latency_mode=True needs num_rdma_bytes > 0 (see "
                                     "SymmBackend.get_low_latency_size_hint)")
                ll_buf = create_symm_buffer(group, num_rdma_bytes, _ll_path().num_signals(world_size),
                                            device=device, provider=provider, timeout_s=timeout_s)
            if normal_buf is None and ll_buf is None:
                raise ValueError("backend 'symm' needs num_nvl_bytes > 0 (normal mode, see "
                                 "SymmBackend.get_normal_size_hint) and/or low_latency_mode=True with num_rdma_bytes > 0")
        self._buffers = [b for b in (normal_buf, ll_buf) if b is not None]
        self.device = self._buffers[0].device
        self._normal = _normal_path()(normal_buf, id(self)) if normal_buf is not None else None
        self.ll = _ll_path()(ll_buf, id(self)) if ll_buf is not None else None

    @property
    def normal(self):
        if self._normal is None:
            raise ValueError("normal-mode calls on backend 'symm' need num_nvl_bytes > 0 (see "
                             "SymmBackend.get_normal_size_hint)")
        return self._normal

    # ------------------------------------------------------------------ size hints
    @staticmethod
    def get_normal_size_hint(num_max_tokens: Optional[int], hidden: int, num_topk: int, num_ranks: int, *,
                             chunk_tokens: Optional[int] = None) -> int:
        """``num_nvl_bytes`` for normal mode (BF16 or FP8). ``num_max_tokens``: every rank's batch of up to that
        many tokens moves in one round (the whole receive fits; receive views need this). ``None`` (or
        ``chunk_tokens=C``): a fixed size independent of the batch; larger batches stream through it in rounds
        of ``C`` tokens per source (default ``max(64, 4096 // num_ranks)``)."""
        return _normal_path().size_hint(num_max_tokens, hidden, num_topk, num_ranks, chunk_tokens=chunk_tokens)

    @staticmethod
    def get_low_latency_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                  num_experts: int, num_topk: int = 8) -> int:
        """``num_rdma_bytes`` for low-latency calls up to these shapes."""
        return _ll_path().size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts, num_topk)

    def local_buffer(self, use_rdma_buffer: bool) -> torch.Tensor:
        """The message area of the low-latency (``use_rdma_buffer``) or normal-mode symmetric buffer; signal words
        and status live outside it. A size given without its mode (``num_rdma_bytes`` without
        ``low_latency_mode``) allocated nothing: then the base class's unread memory of that size."""
        part = self.ll if use_rdma_buffer else self._normal
        if part is None:
            return super().local_buffer(use_rdma_buffer)
        return part.symm.buffer

    def _check_device(self, t: torch.Tensor) -> None:
        if t.device.type != self.device.type or (t.device.index is not None and self.device.index is not None
                                                  and t.device.index != self.device.index):
            raise ValueError(f"inputs are on {t.device} but this symm Buffer's memory is on {self.device}")

    def _check_ll(self) -> None:
        if self.ll is None:
            raise ValueError("low-latency calls need Buffer(..., low_latency_mode=True)")

    # ------------------------------------------------------------------ normal mode
    def get_dispatch_layout(self, topk_idx, num_experts):
        self._check_device(topk_idx)
        bad = torch.zeros(1, dtype=torch.int32, device=topk_idx.device)
        per_rank, per_expert, in_rank = self.normal.layout(topk_idx, num_experts, bad)
        # An id >= num_experts (host checks off) raises the status flag on the device: the next status check
        # raises and combines come out NaN (no host read here).
        st = self.normal.symm.status[:1]
        st.copy_(torch.where((st == 0) & (bad > 0), torch.full_like(st, STATUS_BAD_EXPERT), st))
        return per_rank, None, per_expert, in_rank

    def dispatch_send(self, x, x_scales, **kwargs):
        self._check_device(x)
        return self.normal.dispatch_send(x, x_scales, **kwargs)

    def dispatch_recv(self, state, *, expert_alignment: int, num_worst_tokens: int):
        res = self.normal.dispatch_recv(state, expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens)
        if state.num_tokens_per_expert is not None and self.group is not None:
            # A layout-only dispatch (DeepEP's top-k-less call): as DeepEP, the per-expert list is the sum of
            # the senders' num_tokens_per_expert for this rank's experts. Its rows carry no top-k, so the counts
            # are gathered over the group (the ranks agreed on this call's kind in the receive's signature
            # check; without num_worst_tokens the receive has already read its counts on the host). Virtual
            # ranks (no group) keep the empty list.
            per_expert = self._gather_expert_counts(state.num_tokens_per_expert, expert_alignment)
            res.handle.num_recv_tokens_per_expert_list = per_expert
            res.num_recv_tokens_per_expert_list = list(per_expert)
        return res

    def _gather_expert_counts(self, num_tokens_per_expert: torch.Tensor, expert_alignment: int) -> list:
        R, E = self.world_size, num_tokens_per_expert.shape[0]
        L = E // R
        nccl = "nccl" in str(dist.get_backend(self.group)).lower()
        dev = num_tokens_per_expert.device if nccl else torch.device("cpu")
        mine = num_tokens_per_expert.to(device=dev, dtype=torch.int64).contiguous()
        every = torch.empty(R * E, dtype=torch.int64, device=dev)
        _all_gather(every, mine, group=self.group)
        counts = every.view(R, R, L)[:, self.rank].sum(0).tolist()  # [source, destination, local expert]
        return [(c + expert_alignment - 1) // expert_alignment * expert_alignment for c in counts]

    #: normal-mode dispatch can hand the receive out as views of this rank's buffer (``recv_view=True``)
    supports_recv_view = True

    def dispatch(self, x, x_scales, *, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                 topk_idx, topk_weights, num_experts, expert_alignment, num_worst_tokens, recv_view: bool = False):
        state = self.dispatch_send(x, x_scales, handle=handle, num_tokens_per_rank=num_tokens_per_rank,
                                   is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert,
                                   topk_idx=topk_idx, topk_weights=topk_weights, num_experts=num_experts,
                                   recv_view=recv_view, num_worst_tokens=num_worst_tokens)
        return self.dispatch_recv(state, expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens)

    def combine_send(self, x, handle, topk_weights, fmt=None):
        self._check_device(x)
        return self.normal.combine_send(x, handle, topk_weights, fmt=fmt)

    def combine_recv(self, state, bias: tuple):
        return self.normal.combine_recv(state, bias)

    def combine(self, x, handle, topk_weights, bias, fmt=None):
        return self.combine_recv(self.combine_send(x, handle, topk_weights, fmt=fmt), bias)

    # ------------------------------------------------------------------ refusals (normal mode)
    def arrival_mark(self):
        """Normal-mode send launches so far: a refusal with the same count wrote nothing to any peer."""
        return self._normal.sends if self._normal is not None else None

    def refuse(self, what: str, mark, message: str) -> None:
        """The Buffer's checks refused normal-mode ``what`` before any send of it: publish the refusal to every
        peer and drain their blocks (:mod:`moe_ep.backends.symm_refusal`), so they raise ``RemoteRankError`` at
        once and the Buffer stays in step. Low-latency refusals are not published (the peers time out)."""
        if what in ("dispatch", "combine") and mark is not None and self._normal.sends == mark:
            self._normal.refuse(what)

    # ------------------------------------------------------------------ low-latency mode
    def low_latency_dispatch_send(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, *,
                                  use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False):
        self._check_ll()
        self._check_device(x)
        return self.ll.dispatch_send(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8=use_fp8,
                                     round_scale=round_scale, use_ue8m0=use_ue8m0)

    def low_latency_dispatch_recv(self, state, cumulative_local_expert_recv_stats=None,
                                  wait_recv_cost_stats=None) -> LowLatencyDispatchResult:
        return self.ll.dispatch_recv(state, cumulative_local_expert_recv_stats, wait_recv_cost_stats)

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, *,
                             cumulative_local_expert_recv_stats, use_fp8, round_scale, use_ue8m0, return_recv_hook,
                             wait_recv_cost_stats=None):
        state = self.low_latency_dispatch_send(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                               use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0)
        if not return_recv_hook:
            return self.low_latency_dispatch_recv(state, cumulative_local_expert_recv_stats, wait_recv_cost_stats)
        res = state.result

        def hook():
            self.low_latency_dispatch_recv(state, cumulative_local_expert_recv_stats, wait_recv_cost_stats)

        return LowLatencyDispatchResult(res.recv_x, res.recv_x_scales, res.recv_count, res.handle, hook)

    def get_next_low_latency_combine_buffer(self, handle):
        self._check_ll()
        return self.ll.get_next_low_latency_combine_buffer(handle)

    def low_latency_combine_send(self, x, topk_idx, topk_weights, handle, *, zero_copy: bool = False, out=None,
                                 fmt=None):
        self._check_ll()
        self._check_device(x)
        return self.ll.combine_send(x, topk_idx, topk_weights, handle, zero_copy=zero_copy, out=out, fmt=fmt)

    def low_latency_combine_recv(self, state, wait_recv_cost_stats=None) -> torch.Tensor:
        return self.ll.combine_recv(state, wait_recv_cost_stats=wait_recv_cost_stats)

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, *, zero_copy, return_recv_hook, out,
                            wait_recv_cost_stats=None, fmt=None):
        state = self.low_latency_combine_send(x, topk_idx, topk_weights, handle, zero_copy=zero_copy, out=out,
                                              fmt=fmt)
        if not return_recv_hook:
            return self.low_latency_combine_recv(state, wait_recv_cost_stats), None
        return state.out, lambda: self.low_latency_combine_recv(state, wait_recv_cost_stats)

    def trap_on_error(self) -> None:
        """Opt-in for CUDA-graph mode: a kernel that times out or detects a device error executes ``trap``
        (the CUDA context fails loudly) instead of only setting the status word. Compiled kernels only; under
        the Triton interpreter the status word reports as usual."""
        for b in self._buffers:
            b.status[2] = 1  # STATUS_TRAP, read by the kernels at run time (no extra argument)

    # ------------------------------------------------------------------ rank mask (enable_shrink)
    def enable_shrink(self) -> None:
        self._check_ll()
        self.ll.shrink = True

    def ll_update_mask(self, rank: int, masked: bool) -> None:
        self._check_ll()
        self.ll.update_mask(rank, masked)

    def ll_query_mask(self, out: torch.Tensor) -> None:
        self._check_ll()
        api = self.ll.reported_mask()
        out.copy_(self.ll.mask if api is None else torch.tensor(api, dtype=torch.int32))

    def ll_clean_mask(self) -> None:
        self._check_ll()
        self.ll.clean_mask()

    def ll_mask_host(self) -> list:
        self._check_ll()
        api = self.ll.reported_mask()
        return api if api is not None else [int(v) for v in self.ll.mask.tolist()]

    def ll_take_late_writes(self) -> bool:
        self._check_ll()
        return self.ll.take_late_writes()

    # ------------------------------------------------------------------ status
    def check_status(self, blocking: bool = True) -> None:
        """Raise :class:`moe_ep.RankTimeoutError` if any wait of this rank timed out (after CUDA-graph
        replays, where the per-call check cannot run)."""
        for b in self._buffers:
            b.check_status("a CUDA-graph replay or earlier call", blocking=blocking)
        if self._normal is not None and self._buffers:  # a peer's refusal seen by an earlier receive (GPU)
            self._normal.poll_refused()
            if blocking:
                self._normal._check_refused("an earlier call", blocking=True)

    def destroy(self) -> None:
        for b in self._buffers:
            b.close()
        self._buffers = []


def virtual_backends(world_size: int, *, num_nvl_bytes: int, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                     device=None, timeout_s: float = 60.0) -> list[SymmBackend]:
    """``world_size`` virtual ranks of the ``symm`` backend in this process, on one ``device``.

    Run each operation phase by phase over all ranks, e.g. for low-latency dispatch::

        states = [b.low_latency_dispatch_send(x[r], idx[r], T, E) for r, b in enumerate(backends)]
        results = [b.low_latency_dispatch_recv(s) for b, s in zip(backends, states)]

    (a receive launched before every rank's send raises :class:`moe_ep.RankTimeoutError`). Inputs
    are not validated here: pass what :class:`moe_ep.Buffer` would accept.
    """
    normal = [None] * world_size
    if num_nvl_bytes > 0:
        normal = create_virtual_symm_buffers(world_size, num_nvl_bytes, _normal_path().num_signals(world_size),
                                             device=device, timeout_s=timeout_s)
    ll = [None] * world_size
    if low_latency_mode:
        ll = create_virtual_symm_buffers(world_size, num_rdma_bytes, _ll_path().num_signals(world_size),
                                         device=device, timeout_s=timeout_s)
    return [SymmBackend(None, r, world_size, num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=num_rdma_bytes,
                        low_latency_mode=low_latency_mode, timeout_s=timeout_s, _symm_buffers=(normal[r], ll[r]))
            for r in range(world_size)]


def virtual_dispatch_recv(backends: list, states: list, *, expert_alignment: int = 1,
                          num_worst_tokens: int = 0) -> list:
    """The receive phase of a normal dispatch over virtual ranks (after every rank's ``dispatch_send``), round by
    round: every rank's receive of round 0, then per later round every rank's send, then every rank's receive.
    A batch that fits the buffer takes one round (then this equals calling ``dispatch_recv`` rank by rank)."""
    paths = [b.normal for b in backends]
    for p, s in zip(paths, states):
        p.dispatch_recv_round(s, 0, num_worst_tokens=num_worst_tokens)
    for r in range(1, states[0].rounds):
        for p, s in zip(paths, states):
            p.dispatch_send_round(s, r)
        for p, s in zip(paths, states):
            p.dispatch_recv_round(s, r, num_worst_tokens=num_worst_tokens)
    return [p.dispatch_finish(s, expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens)
            for p, s in zip(paths, states)]


def virtual_combine_recv(backends: list, states: list, biases: Optional[list] = None) -> list:
    """The receive phase of a normal combine over virtual ranks (after every rank's ``combine_send``), round by
    round like :func:`virtual_dispatch_recv`; ``biases``: per rank, a tuple of bias tensors."""
    paths = [b.normal for b in backends]
    for r in range(states[0].handle.rounds):
        if r:
            for p, s in zip(paths, states):
                p.combine_send_round(s, r)
        for i, (p, s) in enumerate(zip(paths, states)):
            p.combine_recv_round(s, r, (biases[i] if biases is not None else ()) if r == 0 else ())
    return [p.combine_finish(s) for p, s in zip(paths, states)]
