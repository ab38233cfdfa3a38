"""``moe_ep.Buffer``: the DeepEP-compatible front end over every communication backend.

The Buffer checks every argument (raising ValueError/TypeError before any rank communicates),
applies DeepEP's stream/event semantics, and delegates the communication to a backend
(:mod:`moe_ep.backends`).

This module holds the constructor (backend choice), the stream and handle helpers every call uses, normal mode
(``get_dispatch_layout`` / ``dispatch`` / ``combine``) and the lifecycle (``check_status``, ``destroy``). Its other
parts: :mod:`moe_ep.deepep.v1.low_latency` (low-latency mode and the rank-mask API, a base class of :class:`Buffer`),
:mod:`moe_ep.deepep.v1.config` (:class:`Config`, DeepEP's size hints), :mod:`moe_ep.deepep.v1.checks` (guards shared
by the calls).
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from ... import validate as V
from ...backends.base import Backend, DispatchHandle
from ... import events
from .checks import _CheckedLayout, _reports_refusal
from .config import Config
from .low_latency import LowLatencyCalls
from .compat import DeepEPV1Calls
from ...events import EventOverlap, run_on_comm_stream

_log = logging.getLogger(__name__)

__all__ = ["Buffer", "Config"]

BACKENDS = ("auto", "torch", "symm", "nvshmem")
log = logging.getLogger("moe_ep")


def _capturing(device: torch.device) -> bool:
    return events.uses_streams(device) and events.is_capturing(device)


class Buffer(LowLatencyCalls, DeepEPV1Calls):
    """Expert-parallel communication buffer for one process group (DeepEP ``deep_ep.Buffer`` API).

    Arguments:
        group: the torch.distributed process group of the EP ranks (``None``: the default group).
        num_nvl_bytes, num_rdma_bytes: buffer sizes as in DeepEP (size hints: :meth:`Config.get_nvl_buffer_size_hint`,
            :meth:`get_low_latency_rdma_size_hint`; docs/sizing.md), kept as ``self.num_nvl_bytes`` /
            ``self.num_rdma_bytes``. The ``torch`` backend allocates per call, but refuses a low-latency call that a
            nonzero ``num_rdma_bytes`` could not hold on ``symm`` (same message), so a CPU run catches a sizing bug.
        low_latency_mode: enables ``low_latency_dispatch`` / ``low_latency_combine``.
        num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl, use_fabric: accepted for DeepEP
            compatibility (RDMA / fabric-memory settings of backends not in this release; ignored).
        explicitly_destroy: as DeepEP: ``True`` means resources are released only by :meth:`destroy`
            (which then must be called); ``False`` releases them when the Buffer is garbage-collected.
        enable_shrink: DeepEP's rank-masking mode, low-latency mode only (``low_latency_mode=True``, else
            ``ValueError``): enables the mask API (:meth:`low_latency_update_mask_buffer` ...), and a rank whose wait
            times out in a low-latency call is masked instead of failing the call (see :meth:`low_latency_masked_ranks`).
        comm: DeepEP's mpi4py alternative to ``group``; not supported (must be ``None``).
        backend: ``"torch"`` (all_to_all_single over gloo/NCCL, any topology), ``"symm"`` (Triton kernels
            over symmetric memory, one node), ``"nvshmem"`` (low-latency mode only: the ``symm`` kernels over
            NVSHMEM, across nodes; :mod:`moe_ep.backends.nvshmem`) or ``"auto"``: the CUDA-graph capturable
            backend where one fits (``"symm"`` when all ranks are on one node with CUDA peer access and the sizes
            it needs were given, ``"nvshmem"`` across nodes for a low-latency-only Buffer where NVSHMEM is usable),
            else ``"torch"`` (always without CUDA; a low-latency Buffer on CUDA then warns once). The machine
            decides, not the group's backend (a gloo group on GPUs gets ``symm`` too, its memory on the current
            device); :mod:`moe_ep.backends.choose`, which logs the choice on ``logging.getLogger("moe_ep")``. The
            chosen one is ``buffer.backend_name``. The environment variable ``MOE_EP_BACKEND`` (``torch`` /
            ``symm`` / ``nvshmem``) replaces ``"auto"`` for code that cannot pass ``backend=``.
        timeout_s: bound on every wait; a rank that does not arrive makes the call raise
            :class:`moe_ep.sync.RankTimeoutError` (a ``TimeoutError``) naming it.
        check_inputs: value checks of ``topk_idx`` (range, duplicates) read the tensor on the host; they
            are skipped automatically while a CUDA graph is being captured, and can be turned off here.
        trap_on_error: ``symm`` and ``nvshmem`` only, the opt-in for CUDA-graph mode: a kernel that times out or detects a device
            error (call mismatch, overflow, bad expert id) executes ``trap``, so the failure cannot pass
            unnoticed inside replays (the CUDA context is lost: restart the process). Off: outputs turn NaN and
            :meth:`check_status` raises. Compiled kernels only (the Triton interpreter cannot trap).
        backend_kwargs: passed to the backend: ``provider=`` (``"cuda"`` / ``"shm"``) and ``device=`` for ``symm``;
            ``ranks_per_node=`` (and ``partial_dtype=``) for ``torch``: node-aware normal mode (a token crosses
            nodes once per destination node, then fans out inside it; ``num_tokens_per_rdma_rank`` is filled);
            ``device=`` and (CPU emulation) ``ranks_per_node=`` for ``nvshmem``.

    The ``symm`` backend needs its buffer sizes: ``num_nvl_bytes`` from
    :meth:`moe_ep.backends.symm.SymmBackend.get_normal_size_hint` and ``num_rdma_bytes`` from
    :meth:`~moe_ep.backends.symm.SymmBackend.get_low_latency_size_hint`.
    """

    num_sms: int = 20

    def __init__(self, group=None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 use_fabric: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False, comm=None, *,
                 backend: str = "auto", timeout_s: float = 60.0, check_inputs: bool = True, trap_on_error: bool = False,
                 **backend_kwargs: Any):
        if comm is not None:
            raise ValueError("comm= (an mpi4py communicator) is not supported: pass a torch.distributed process group")
        if enable_shrink and not low_latency_mode:
            raise ValueError("enable_shrink=True (rank masking) covers low-latency mode only: pass "
                             "low_latency_mode=True (normal-mode calls keep waiting for every rank and raise "
                             "moe_ep.RankTimeoutError naming a rank that does not arrive)")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("moe_ep.Buffer needs torch.distributed to be initialised (init_process_group)")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        from ...backends.choose import backend_from_env
        backend = backend_from_env(backend)
        if not (timeout_s > 0):
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        for name, v in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a non-negative int, got {v!r}")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.group_size = dist.get_world_size(self.group)
        self.num_nvl_bytes = num_nvl_bytes  # the sizes asked for (DeepEP's get_buffer() helpers compare them)
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.check_inputs = check_inputs
        self.timeout_s = float(timeout_s)
        self.enable_shrink = enable_shrink
        self._destroyed = False
        chosen = backend == "auto"
        if chosen:
            backend = self._choose_backend(low_latency_mode, num_nvl_bytes, num_rdma_bytes, backend_kwargs)
        self.backend_name = backend
        _log.info("Buffer on rank %d of %d: backend %r (%s), low_latency_mode=%s, num_nvl_bytes=%d, num_rdma_bytes=%d",
                  self.rank, self.group_size, backend, "chosen by backend='auto'" if chosen else "asked for",
                  low_latency_mode, num_nvl_bytes, num_rdma_bytes)
        common = dict(num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=num_rdma_bytes,
                      low_latency_mode=low_latency_mode, timeout_s=self.timeout_s)
        if self.backend_name == "torch":
            from ...backends.torch_a2a import TorchBackend
            from ...backends.torch_hier import TorchHierBackend
            # ranks_per_node=G: node-aware (a token crosses nodes once per destination node, then fans out)
            cls = TorchHierBackend if backend_kwargs.get("ranks_per_node") is not None else TorchBackend
            self._impl: Backend = cls(self.group, self.rank, self.group_size, **common, **backend_kwargs)
        elif self.backend_name == "nvshmem":
            from ...backends.nvshmem import NvshmemBackend
            self._impl = NvshmemBackend(self.group, self.rank, self.group_size, **common, **backend_kwargs)
        else:
            from ...backends.symm import SymmBackend
            self._impl = SymmBackend(self.group, self.rank, self.group_size, **common, **backend_kwargs)
        if enable_shrink:
            self._impl.enable_shrink()
        if trap_on_error:
            if self.backend_name not in ("symm", "nvshmem"):
                raise ValueError("trap_on_error=True is for the symm and nvshmem backends (their kernels run inside "
                                 "CUDA graphs)")
            self._impl.trap_on_error()
        self._mask_seen = [0] * self.group_size  # host copy of the mask after the last low-latency call
        self._comm_streams: dict = {}
        self._checked_layout: Optional[_CheckedLayout] = None  # the last value-checked get_dispatch_layout

    # ---------------------------------------------------------------- helpers
    def _choose_backend(self, low_latency_mode: bool, num_nvl_bytes: int, num_rdma_bytes: int,
                        backend_kwargs: dict) -> str:
        """``backend="auto"`` (:func:`moe_ep.backends.choose.choose_backend`): ``symm`` on one node with CUDA peer
        access, ``nvshmem`` across nodes for a low-latency-only Buffer where NVSHMEM is usable, else ``torch``
        (always without CUDA, and with backend keyword arguments: name the backend they are for). A low-latency
        Buffer on CUDA that ends up on ``torch`` warns once (not CUDA-graph capturable)."""
        from ...backends.choose import choose_backend, gather_facts, warn_not_capturable

        if backend_kwargs:
            log.info("moe_ep.Buffer(backend='auto'): backend keyword arguments given (%s): 'torch'",
                     ", ".join(sorted(backend_kwargs)))
            return "torch"
        facts = gather_facts(self.group)
        name = choose_backend(facts, low_latency_mode=low_latency_mode, num_nvl_bytes=num_nvl_bytes,
                              num_rdma_bytes=num_rdma_bytes)
        if name in ("symm", "nvshmem") and torch.cuda.is_available():
            # the machine decides, not the group: a gloo group on GPUs only exchanges handles; memory on the GPU
            backend_kwargs["device"] = torch.device("cuda", torch.cuda.current_device())
        log.info("moe_ep.Buffer(backend='auto') on rank %d: %r (%s, low_latency_mode=%s, num_nvl_bytes=%d, "
                 "num_rdma_bytes=%d)", self.rank, name, facts, low_latency_mode, num_nvl_bytes, num_rdma_bytes)
        if name == "torch" and low_latency_mode and facts.cuda:
            warn_not_capturable(facts)
        return name

    @staticmethod
    def is_sm90_compiled() -> bool:
        """DeepEP: whether the SM90 (Hopper) kernels were built. Here kernels are compiled by Triton at run
        time for the device present, so this is ``True`` when a CUDA device of compute capability 9.0 or
        newer is visible (FP8 MMA, PDL), ``False`` otherwise (CPU, older GPUs)."""
        return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9

    @staticmethod
    def capture() -> EventOverlap:
        """DeepEP: an event recorded on the current CUDA stream (wrapped in :class:`EventOverlap`, for
        ``previous_event=``). On a machine without CUDA: an empty :class:`EventOverlap` (waiting on it is a
        no-op, as every CPU call is synchronous)."""
        if not torch.cuda.is_available():
            return EventOverlap(None)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return EventOverlap(event)

    def get_comm_stream(self):
        """DeepEP: the communication stream ``async_finish`` calls run on (of the current CUDA device; made
        on first use). ``None`` without CUDA (CPU calls are synchronous and use no stream)."""
        if not torch.cuda.is_available():
            return None
        return self._comm_stream(torch.device("cuda", torch.cuda.current_device()))

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        if new_num_sms % 2 != 0 or new_num_sms <= 0:
            raise ValueError(f"num_sms must be a positive even number, got {new_num_sms}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """DeepEP: the normal-mode dispatch config for ``num_ranks`` (its size hints: :class:`Config`)."""
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """DeepEP: the normal-mode combine config for ``num_ranks`` (its size hints: :class:`Config`)."""
        return Config(Buffer.num_sms)

    def _comm_stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        key = device.index if device.index is not None else torch.cuda.current_device()
        if key not in self._comm_streams:
            self._comm_streams[key] = torch.cuda.Stream(device=device)
        return self._comm_streams[key]

    def _run(self, fn, device, previous_event, async_finish, allocate_on_comm_stream, inputs=()):
        """``inputs``: every tensor ``fn`` reads (recorded on the comm stream when ``async_finish``)."""
        if previous_event is not None and not isinstance(previous_event, EventOverlap):
            raise TypeError(f"previous_event must be an EventOverlap, got {type(previous_event).__name__}")
        return run_on_comm_stream(fn, device, self._comm_stream(device), previous_event=previous_event,
                                  async_finish=async_finish, allocate_on_comm_stream=allocate_on_comm_stream,
                                  inputs=inputs, owner=self)

    def _value_checks(self, device: torch.device) -> bool:
        return self.check_inputs and not _capturing(device)

    def _check_handle(self, handle, kind) -> None:
        if not isinstance(handle, kind):
            maker = "dispatch" if kind is DispatchHandle else "low_latency_dispatch"
            raise TypeError(f"handle must come from this Buffer's {maker}, got {type(handle).__name__}")
        if handle.owner != id(self._impl):
            raise ValueError("handle was produced by another Buffer (or another layout)")

    # ---------------------------------------------------------------- normal mode
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event: Optional[EventOverlap] = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Count, per rank and per expert, what this rank will send.

        Arguments:
            topk_idx: `[num_tokens, num_topk]` with `torch.int64`, ``-1`` for no expert.
            num_experts: total experts ``E`` (divisible by the group size).

        Returns:
            num_tokens_per_rank: `[num_ranks]` `torch.int32`, tokens with any expert on each rank.
            num_tokens_per_rdma_rank: ``None`` (single-level backends).
            num_tokens_per_expert: `[num_experts]` `torch.int32`, selections per expert.
            is_token_in_rank: `[num_tokens, num_ranks]` `torch.bool`.
            event: :class:`EventOverlap`.
        """
        V.check_num_experts(num_experts, self.group_size)
        if not isinstance(topk_idx, torch.Tensor):
            raise TypeError(f"topk_idx must be a torch.Tensor, got {type(topk_idx).__name__}")
        checked = self._value_checks(topk_idx.device)
        V.check_topk_idx(topk_idx, topk_idx.shape[0] if topk_idx.dim() == 2 else -1, num_experts, topk_idx.device,
                         checked)
        out, event = self._run(lambda: self._impl.get_dispatch_layout(topk_idx, num_experts), topk_idx.device,
                               previous_event, async_finish, allocate_on_comm_stream, inputs=(topk_idx,))
        # A dispatch with this topk_idx and these (unmodified) layout tensors needs no second value check.
        self._checked_layout = _CheckedLayout.of(num_experts, topk_idx, out[0], out[2], out[3]) if checked else None
        return (*out, event)

    @_reports_refusal("dispatch")
    def dispatch(self, x: Union[torch.Tensor, tuple], handle: Optional[DispatchHandle] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None, num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None, num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False, *, recv_as_view: bool = False):
        """Send each token once to every rank holding any of its experts (normal mode).

        Arguments:
            x: `[num_tokens, hidden]` `torch.bfloat16`, or ``(x_fp8, scales)``: `[num_tokens, hidden]`
                `torch.float8_e4m3fn` and `[num_tokens, hidden / 128]` `torch.float32`.
            handle: a handle from an earlier dispatch of the same routing (cached dispatch: only ``x``
                moves; the layout arguments and topk must then be ``None``).
            num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert: from :meth:`get_dispatch_layout`.
            topk_idx: `[num_tokens, num_topk]` `torch.int64`; topk_weights: same shape, `torch.float32`.
            expert_alignment: each entry of the returned per-expert list is rounded up to this.
            num_worst_tokens: if > 0, outputs have exactly this many rows (padding rows have
                ``recv_topk_idx == -1``); more received tokens than that is an error.
            recv_as_view: (keyword, an extension of DeepEP's call) on the ``symm`` backend, ``recv_x`` and its
                scales are views of this rank's communication buffer instead of fresh tensors (no receive
                copy). They stay valid until this rank's next dispatch or combine on this Buffer; work that
                reads them must be ordered before that call (same stream, or an event). With
                ``num_worst_tokens`` the padding rows of a view are NOT zeroed (stale rows; their
                ``recv_topk_idx`` is -1). Every rank must pass the same value. Other backends return fresh
                tensors as usual (their receive has no copy to remove).

        Returns:
            recv_x: `[num_recv_tokens, hidden]` (same dtype as ``x``; a tuple with scales for FP8), rows
                ordered by source rank, then source token index.
            recv_topk_idx: `[num_recv_tokens, num_topk]` `torch.int64` local expert ids, ``-1`` elsewhere.
            recv_topk_weights: `[num_recv_tokens, num_topk]` `torch.float32`, 0 where the index is -1.
            num_recv_tokens_per_expert_list: Python list of ``num_local_experts`` ints.
            handle: for :meth:`combine` and cached dispatch.
            event: :class:`EventOverlap`.
        """
        data, scales = V.split_x(x)
        n, hidden = data.shape
        if not isinstance(expert_alignment, int) or expert_alignment < 1:
            raise ValueError(f"expert_alignment must be a positive int, got {expert_alignment!r}")
        if not isinstance(num_worst_tokens, int) or num_worst_tokens < 0:
            raise ValueError(f"num_worst_tokens must be a non-negative int, got {num_worst_tokens!r}")
        if not isinstance(recv_as_view, bool):
            raise ValueError(f"recv_as_view must be a bool, got {recv_as_view!r}")
        view = {"recv_view": True} if recv_as_view and getattr(self._impl, "supports_recv_view", False) else {}
        if handle is not None:
            self._check_handle(handle, DispatchHandle)
            if any(a is not None for a in (num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                                           topk_idx, topk_weights)):
                raise ValueError("cached dispatch (handle given) takes no layout, topk_idx or topk_weights")
            if n != handle.num_tokens or hidden != handle.hidden:
                raise ValueError(f"x has shape [{n}, {hidden}] but the handle was made for "
                                 f"[{handle.num_tokens}, {handle.hidden}]")
            made_with = getattr(handle, "num_worst_tokens", 0)
            if num_worst_tokens == 0:
                num_worst_tokens = made_with  # outputs keep the shapes of the dispatch that made the handle
            elif num_worst_tokens != made_with:
                raise ValueError(f"cached dispatch: num_worst_tokens={num_worst_tokens} but the handle was made with "
                                 f"{made_with}")
            num_experts = 0
        else:
            if num_tokens_per_rank is None or is_token_in_rank is None or num_tokens_per_expert is None:
                raise ValueError("dispatch without a handle needs num_tokens_per_rank, is_token_in_rank and "
                                 "num_tokens_per_expert (from get_dispatch_layout)")
            if (topk_idx is None) != (topk_weights is None):
                raise ValueError("pass topk_idx and topk_weights together (or neither, for a layout-only dispatch)")
            if not isinstance(num_tokens_per_expert, torch.Tensor) or num_tokens_per_expert.dim() != 1:
                raise ValueError("num_tokens_per_expert must be a 1D tensor [num_experts]")
            num_experts = num_tokens_per_expert.shape[0]
            V.check_num_experts(num_experts, self.group_size)
            if topk_idx is not None:
                V.check_topk_shape(topk_idx, n, data.device)
                V.check_topk_weights(topk_weights, topk_idx)
            if not isinstance(num_tokens_per_rank, torch.Tensor) or tuple(num_tokens_per_rank.shape) != (self.group_size,):
                raise ValueError(f"num_tokens_per_rank must have shape [{self.group_size}], got "
                                 f"{tuple(getattr(num_tokens_per_rank, 'shape', ()))}")
            if not isinstance(is_token_in_rank, torch.Tensor) or is_token_in_rank.dtype != torch.bool or \
                    tuple(is_token_in_rank.shape) != (n, self.group_size):
                raise ValueError(f"is_token_in_rank must be torch.bool [{n}, {self.group_size}], got "
                                 f"{getattr(is_token_in_rank, 'dtype', type(is_token_in_rank).__name__)} "
                                 f"{tuple(getattr(is_token_in_rank, 'shape', ()))}")
            for name, t in (("num_tokens_per_rank", num_tokens_per_rank), ("is_token_in_rank", is_token_in_rank),
                            ("num_tokens_per_expert", num_tokens_per_expert), ("topk_weights", topk_weights)):
                if t is not None and t.device != data.device:
                    raise ValueError(f"{name} is on {t.device}, x on {data.device}")
            if topk_idx is None:  # layout only: the per-rank counts must still match the token mask
                if self._value_checks(data.device) and \
                        bool((num_tokens_per_rank.to(torch.int64) != is_token_in_rank.sum(0)).any()):
                    raise ValueError("num_tokens_per_rank disagrees with is_token_in_rank.sum(0)")
            else:
                done = self._checked_layout is not None and self._checked_layout.covers(
                    num_experts, topk_idx, num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank)
                if self._value_checks(data.device) and not done:
                    V.check_dispatch_values(topk_idx, num_experts, self.group_size, num_tokens_per_rank,
                                            is_token_in_rank, num_tokens_per_expert)

        def fn():
            return self._impl.dispatch(
                data, scales, handle=handle, num_tokens_per_rank=num_tokens_per_rank,
                is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx,
                topk_weights=topk_weights, num_experts=num_experts, expert_alignment=expert_alignment,
                num_worst_tokens=num_worst_tokens, **view)

        res, event = self._run(fn, data.device, previous_event, async_finish, allocate_on_comm_stream,
                               inputs=(data, scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                                       num_tokens_per_expert, handle))
        if handle is None:  # what later calls with this handle are checked against
            res.handle.num_topk = 0 if topk_idx is None else topk_idx.shape[1]
            res.handle.num_worst_tokens = num_worst_tokens
        recv_x = (res.recv_x, res.recv_x_scales) if res.recv_x_scales is not None else res.recv_x
        return (recv_x, res.recv_topk_idx, res.recv_topk_weights, res.num_recv_tokens_per_expert_list,
                res.handle, event)

    @_reports_refusal("combine")
    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, tuple, None] = None, config: Optional[Config] = None,
                previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False, *, combine_dtype: Optional[torch.dtype] = None):
        """Send the received rows back and sum them per source token (normal mode).

        Arguments:
            x: `[num_recv_tokens, hidden]` `torch.bfloat16` or `torch.float16`, rows in ``recv_x``'s order
                (weights already applied); its dtype is the output's.
            handle: from :meth:`dispatch`.
            topk_weights: optional `[num_recv_tokens, num_topk]` `torch.float32` (reduced back as well).
            bias: optional `[num_tokens, hidden]` tensor (``x``'s dtype) or tuple of two, added once.
            combine_dtype: keyword-only wire format: ``None`` (``x`` as it is) or ``torch.float8_e4m3fn`` (e4m3 with
                a float32 scale per 128 channels, ``amax / 448``; about half the bytes; see
                :mod:`moe_ep.kernels.logfmt` for accuracy and NaN/inf handling).

        Returns:
            combined_x: `[num_tokens, hidden]` of ``x``'s dtype: float32 sum of the bias terms, then of the
                (decoded) rows in ascending source-rank order, cast once.
            combined_topk_weights: `[num_tokens, num_topk]` `torch.float32` or ``None``.
            event: :class:`EventOverlap`.
        """
        self._check_handle(handle, DispatchHandle)
        V.check_combine_x(x, handle.num_recv_tokens, handle.hidden)
        if topk_weights is not None:
            if not isinstance(topk_weights, torch.Tensor) or topk_weights.dtype != torch.float32:
                got = getattr(topk_weights, 'dtype', type(topk_weights).__name__)
                raise TypeError(f"topk_weights must be a torch.float32 tensor, got {got}")
            want = (handle.num_recv_tokens, getattr(handle, "num_topk", topk_weights.shape[-1]))
            if tuple(topk_weights.shape) != want:
                raise ValueError(f"topk_weights must be [{want[0]}, {want[1]}] (the received tokens x the dispatch's "
                                 f"top-k), got shape {tuple(topk_weights.shape)}")
            if topk_weights.device != x.device:
                raise ValueError(f"topk_weights is on {topk_weights.device}, x on {x.device}")
        biases = V.check_bias(bias, handle.num_tokens, handle.hidden, x.device, x.dtype)
        fmt = V.combine_format(x.dtype, combine_dtype)
        if fmt == 2 and handle.hidden % 128:
            raise ValueError(f"FP8 combine needs hidden to be a multiple of 128, got {handle.hidden}")
        kw = {} if combine_dtype is None else {"fmt": fmt}
        (combined, combined_w), event = self._run(
            lambda: self._impl.combine(x, handle, topk_weights, biases, **kw), x.device, previous_event, async_finish,
            allocate_on_comm_stream, inputs=(x, handle, topk_weights, biases))
        return combined, combined_w, event

    def check_status(self, blocking: bool = True) -> None:
        """Raise if a device-side wait of this rank timed out (:class:`moe_ep.RankTimeoutError` naming the
        silent rank) or a device-side error flag is set (``RuntimeError``: more rows than ``num_worst_tokens``,
        an expert id out of range with the checks off). ``symm`` only (other backends raise in the call).

        ``blocking=True`` synchronises: use it after CUDA-graph replays, where the per-call check cannot run.
        ``blocking=False`` is the cheap query for a serving loop: on a GPU it queues a copy of the status
        word to pinned memory and raises at a later call once an earlier copy shows a failure (never waits);
        on a CPU it reads the word directly."""
        check = getattr(self._impl, "check_status", None)
        if check is not None:
            check(blocking=blocking)

    def destroy(self) -> None:
        """Release the communication resources (DeepEP: only with ``explicitly_destroy=True``; otherwise
        they are released when the Buffer is garbage-collected). Every later call raises."""
        if not self.explicitly_destroy:
            raise ValueError("destroy() needs Buffer(..., explicitly_destroy=True) (as in DeepEP); without it the "
                             "resources are released when the Buffer is garbage-collected")
        self._release()

    def _release(self) -> None:
        if not self._destroyed:
            self._destroyed = True
            self._impl.destroy()

    def __del__(self):
        if not getattr(self, "explicitly_destroy", True) and hasattr(self, "_impl"):
            try:
                self._release()
            except Exception:  # noqa: BLE001 - never raise from a finaliser
                pass
