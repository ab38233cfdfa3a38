"""The interface every communication backend implements behind :class:`moe_ep.Buffer`.

:class:`moe_ep.Buffer` validates every argument (:mod:`moe_ep.validate`), handles events and
streams, and then calls one of the methods below with inputs that are already checked:

- ``x`` arrives split as ``x`` (`[N, H]`, BF16 or `torch.float8_e4m3fn`) and ``x_scales``
  (`[N, H / 128]` float32 for FP8, else ``None``);
- ``topk_idx`` is int64 `[N, K]` with values in ``[-1, num_experts)`` and no expert twice in a row;
- ``num_experts`` is divisible by the world size.

A backend returns plain tensors and its own handle type (a subclass of :class:`DispatchHandle` or
:class:`LowLatencyHandle`); the Buffer wraps events around them.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Callable, Optional

import torch

__all__ = ["Backend", "DispatchHandle", "LowLatencyHandle", "DispatchResult", "LowLatencyDispatchResult"]


@dataclasses.dataclass
class DispatchHandle:
    """Opaque to callers. Holds what combine and a cached dispatch need.

    Common fields (every backend fills them; backends add their own):
        owner: ``id`` of the backend object that made the handle (a handle from another Buffer is refused).
        num_tokens: ``N`` of the dispatching rank.
        num_recv_tokens: rows of ``recv_x`` (``num_worst_tokens`` when that was set).
        hidden: ``H``.
        is_token_in_rank: `[N, R]` bool.
        num_tokens_per_rank: `[R]` int32, tokens this rank sends to each rank.
    """

    owner: int
    num_tokens: int
    num_recv_tokens: int
    hidden: int
    is_token_in_rank: torch.Tensor
    num_tokens_per_rank: torch.Tensor


@dataclasses.dataclass
class LowLatencyHandle:
    """Opaque to callers. Common fields:

    owner: ``id`` of the backend object. num_tokens: ``N``. hidden: ``H``.
    num_max_dispatch_tokens_per_rank: ``T``. num_experts: ``E``.
    """

    owner: int
    num_tokens: int
    hidden: int
    num_max_dispatch_tokens_per_rank: int
    num_experts: int


@dataclasses.dataclass
class DispatchResult:
    recv_x: torch.Tensor
    recv_x_scales: Optional[torch.Tensor]
    recv_topk_idx: Optional[torch.Tensor]
    recv_topk_weights: Optional[torch.Tensor]
    num_recv_tokens_per_expert_list: list
    handle: DispatchHandle


@dataclasses.dataclass
class LowLatencyDispatchResult:
    """``recv_x`` is `[L, R*T, H]` (BF16 or FP8); ``recv_x_scales`` the column-major scales (FP8 only)."""

    recv_x: torch.Tensor
    recv_x_scales: Optional[torch.Tensor]
    recv_count: torch.Tensor
    handle: LowLatencyHandle
    hook: Optional[Callable[[], None]]


class Backend(abc.ABC):
    """One communication backend. ``group`` is a torch.distributed process group (or None = world)."""

    name: str = "abstract"
    #: whether the low-latency path runs without host synchronisation (CUDA-graph capturable)
    graph_safe_low_latency: bool = False

    def __init__(self, group, rank: int, world_size: int, *, num_nvl_bytes: int, num_rdma_bytes: int,
                 low_latency_mode: bool, timeout_s: float):
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.timeout_s = timeout_s

    @abc.abstractmethod
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int):
        """Returns ``(num_tokens_per_rank [R] int32, None, num_tokens_per_expert [E] int32,
        is_token_in_rank [N, R] bool)``."""

    @abc.abstractmethod
    def dispatch(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], *, handle: Optional[DispatchHandle],
                 num_tokens_per_rank: Optional[torch.Tensor], is_token_in_rank: Optional[torch.Tensor],
                 num_tokens_per_expert: Optional[torch.Tensor], topk_idx: Optional[torch.Tensor],
                 topk_weights: Optional[torch.Tensor], num_experts: int, expert_alignment: int,
                 num_worst_tokens: int) -> DispatchResult:
        """Normal-mode dispatch. With ``handle`` (cached dispatch) only ``x``/``x_scales`` move and the
        result's topk fields are ``None``; ``num_experts`` is derived by the Buffer from the layout."""

    @abc.abstractmethod
    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor],
                bias: tuple) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Normal-mode combine: returns ``(combined_x [N, H] bf16, combined_topk_weights [N, K] f32 or None)``."""

    @abc.abstractmethod
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, *, cumulative_local_expert_recv_stats: Optional[torch.Tensor],
                             use_fp8: bool, round_scale: bool, use_ue8m0: bool,
                             return_recv_hook: bool,
                             wait_recv_cost_stats: Optional[torch.Tensor] = None) -> LowLatencyDispatchResult:
        """Low-latency dispatch of BF16 ``x``. With ``return_recv_hook`` only the send runs now and the
        returned hook completes the receive (outputs are valid after ``hook()``). ``wait_recv_cost_stats``
        (`[R]` int64): the receive adds the nanoseconds it waited for each source rank."""

    @abc.abstractmethod
    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: LowLatencyHandle, *, zero_copy: bool, return_recv_hook: bool,
                            out: Optional[torch.Tensor], wait_recv_cost_stats: Optional[torch.Tensor] = None
                            ) -> tuple[torch.Tensor, Optional[Callable[[], None]]]:
        """Weighted low-latency combine; returns ``(combined_x [N, H] bf16, hook or None)``.
        ``wait_recv_cost_stats`` as in :meth:`low_latency_dispatch` (per expert rank)."""

    def arrival_mark(self):
        """An opaque position in this backend's host-side call sequence (``None``: it has none)."""
        return None

    def refuse(self, what: str, mark, message: str) -> None:
        """The Buffer's checks refused call ``what`` on this rank after ``arrival_mark()`` returned ``mark``:
        backends that meet their peers on the host tell them, so they raise at once instead of waiting
        (backends without a host-side sequence do nothing; their peers time out naming this rank)."""

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """The `[L, R*T, H]` bf16 tensor that ``zero_copy`` combine reads in place (backends with a
        registered buffer override this)."""
        raise NotImplementedError(f"backend {self.name!r} has no zero-copy combine buffer")

    def destroy(self) -> None:
        """Release communication resources (idempotent)."""
