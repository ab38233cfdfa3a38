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

    # DeepEP's intranode handle is a tuple (rank_prefix_matrix, channel_prefix_matrix,
    # recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head); engines and tests index it.
    _DEEPEP_FIELDS = ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix", "recv_src_idx",
                      "is_token_in_rank", "send_head")

    def __getitem__(self, i: int):
        """DeepEP's handle fields by position: 0 ``rank_prefix_matrix`` (`[R, R]` int32: entry ``[s, d]``
        is the number of tokens ranks ``0..s`` send to rank ``d``), 3 ``recv_src_idx`` (`[num_recv]` int32:
        source token index of each received row), 4 ``is_token_in_rank``. The channel matrices (1, 2) and
        ``send_head`` (5) describe DeepEP's kernel channels, which have no counterpart here."""
        name = self._DEEPEP_FIELDS[i]
        if name == "is_token_in_rank":
            return self.is_token_in_rank
        value = self.deepep_field(name)
        if value is None:
            raise NotImplementedError(f"handle[{i}] ({name}) is not available on this backend (see "
                                      "moe_ep.backends.base.DispatchHandle.__getitem__)")
        return value

    def deepep_field(self, name: str):
        """A DeepEP handle field this backend can provide (``None``: it cannot)."""
        return None


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

    def __getitem__(self, i: int):
        """DeepEP's low-latency handle fields by position: 0 ``packed_recv_src_info`` (`[L, R*T]` int32:
        source token index of each received row), 1 ``packed_recv_layout_range`` (`[L, R]` int64:
        ``begin << 32 | count`` of each source rank's rows in each local expert's block), 2 ``T``, 3
        ``hidden``, 4 ``num_experts``. Valid once the receive has completed; computed on the device."""
        fields = (None, None, self.num_max_dispatch_tokens_per_rank, self.hidden, self.num_experts)
        if i in (0, 1, -5, -4):
            return self.deepep_layout()[i % 5]
        return fields[i]

    def selection_slots(self) -> torch.Tensor:
        """`[R, T, K]` int32: for selection (source rank, token, k), ``local_expert * R*T + row`` where it
        landed on this rank, or -1 (backends fill this in)."""
        raise NotImplementedError(f"{type(self).__name__} does not expose its receive layout")

    def deepep_layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        slots = self.selection_slots()
        R, T, K = slots.shape
        RT = R * T
        L = self.num_experts // R
        dev = slots.device
        flat = slots.reshape(-1).to(torch.int64)
        valid = flat >= 0
        tok = torch.arange(T, device=dev).view(1, T, 1).expand(R, T, K).reshape(-1)
        src = torch.arange(R, device=dev).view(R, 1, 1).expand(R, T, K).reshape(-1)
        src_info = torch.full((L * RT + 1,), -1, dtype=torch.int32, device=dev)
        src_info.scatter_(0, torch.where(valid, flat, L * RT), tok.to(torch.int32))
        le = torch.where(valid, flat // RT, torch.full_like(flat, L))
        counts = torch.zeros((L + 1) * R, dtype=torch.int64, device=dev)
        counts.scatter_add_(0, le * R + src, torch.ones_like(le))
        counts = counts.view(L + 1, R)[:L]
        begin = counts.cumsum(1) - counts
        return src_info[:-1].view(L, RT), (begin << 32) | counts


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

    # ------------------------------------------------------------------ rank mask (enable_shrink, low-latency)
    def enable_shrink(self) -> None:
        """Turn on rank masking for the low-latency path (``Buffer(..., enable_shrink=True)``): masked ranks are
        neither sent to nor waited for, and a rank whose wait times out is masked instead of failing the call."""
        raise NotImplementedError(f"backend {self.name!r} does not support enable_shrink")

    def ll_update_mask(self, rank: int, masked: bool) -> None:
        raise NotImplementedError(f"backend {self.name!r} does not support rank masking")

    def ll_query_mask(self, out: torch.Tensor) -> None:
        """Write the mask (`[R]` int32, nonzero = masked: 1 by the API, 2 by a timeout) into ``out``."""
        raise NotImplementedError(f"backend {self.name!r} does not support rank masking")

    def ll_clean_mask(self) -> None:
        raise NotImplementedError(f"backend {self.name!r} does not support rank masking")

    def ll_mask_host(self) -> list:
        """The mask as a host list (a device read on GPUs)."""
        raise NotImplementedError(f"backend {self.name!r} does not support rank masking")

    def ll_take_late_writes(self) -> bool:
        """Whether a masked rank's late combine row was found (and dropped, its token NaN) since the last call;
        clears the flag. Backends whose combine slots have a single writer per call never see one."""
        return False

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """The `[L, R*T, H]` bf16 tensor that ``zero_copy`` combine reads in place (backends with a
        registered buffer override this)."""
        raise NotImplementedError(f"backend {self.name!r} has no zero-copy combine buffer")

    def local_buffer(self, use_rdma_buffer: bool) -> torch.Tensor:
        """This rank's ``num_rdma_bytes`` (``use_rdma_buffer``) or ``num_nvl_bytes`` buffer as uint8 bytes
        (``Buffer.get_local_buffer_tensor``). Backends that allocate per call have no such buffer: this is memory of
        the asked size that no call reads (made on first use; empty for a size of 0)."""
        nbytes = self.num_rdma_bytes if use_rdma_buffer else self.num_nvl_bytes
        spare = self.__dict__.setdefault("_spare_buffers", {})
        if use_rdma_buffer not in spare:
            spare[use_rdma_buffer] = torch.zeros(nbytes, dtype=torch.uint8, device=self.local_device())
        return spare[use_rdma_buffer]

    def local_device(self) -> torch.device:
        """Where this backend's buffers live (the current CUDA device on a machine with CUDA, else the CPU)."""
        dev = getattr(self, "device", None)
        if dev is not None:
            return torch.device(dev)
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def destroy(self) -> None:
        """Release communication resources (idempotent)."""
