"""DeepEP V2 names (``deep_ep.ElasticBuffer`` / ``deep_ep.EPHandle``): a second face over the same backends.

:class:`ElasticBuffer` holds a :class:`moe_ep.Buffer` and translates V2's arguments and layouts into
Buffer calls plus torch ops; the backends know neither face. What V2 documents and what this face does:

- one buffer for dispatch and combine (normal mode; the low-latency calls stay on :class:`moe_ep.Buffer`);
- non-expanded receive: one row per (token, rank holding any of its experts), ordered by the source's
  global token index ``src_rank * num_max_tokens_per_rank + token``; ``recv_topk_idx`` holds local
  expert indices or -1;
- expanded receive (``do_expand=True``): one row per (token, local expert), expert ``e``'s block starts at
  a multiple of ``expert_alignment``, rows inside a block ordered by global token index; with
  ``expert_alignment=128`` ``recv_x`` and ``handle.psum_num_recv_tokens_per_expert`` are exactly the ``a``
  operand and the psum ``grouped_layout`` of :func:`moe_ep.gemm.m_grouped_fp8_gemm_nt_contiguous`
  (``use_psum_layout=True``; ``handle.m_indices``, the same rows as m_indices, is built only when read);
- combine sums, per source token, the rows that came from it (expanded rows are first summed per
  received token in float32, then cast once and summed over ranks in float32: two roundings, as V2's
  ``allow_multiple_reduction=True``; with ``False`` one float32 sum per token, one rounding); top-k weights
  travel back as V2 describes (2-D, or 1-D per expanded row); 0, 1 or 2 bias tensors are added once;
- cached dispatch (``handle=``) moves only ``x`` (and ``topk_weights`` when given, for backward passes)
  and reads nothing on the host; ``do_cpu_sync=False`` sizes outputs for the worst case
  (``num_max_tokens_per_rank * num_ranks`` received rows);
- every layout op here is a gather/scatter or a fixed-order sum: results are bitwise identical run to run
  whether or not ``deterministic=True`` is asked for.

Out of scope in this release: Engram (``engram_*``), pipeline-parallel send/recv (``pp_*``), context
parallelism and all-gather reduce-scatter (``agrs_*``, ``all_gather``): those methods exist with V2's
names and raise ``NotImplementedError``. Hybrid (RDMA + NVLink) mode, QPs and SM counts have no
counterpart in these backends: their arguments are accepted and ignored.

Receive as a view of the symmetric buffer (``dispatch(..., recv_as_view=True)``, a keyword extension): on the
``symm`` backend the senders place the rows where the views point (row prefixes from count words, planes for
payload | scales | top-k | weights), so the receive copies nothing; the views stay valid until this rank's next
dispatch or combine. ``perf/bench_elastic.py`` counts the bytes saved and times both receives. A view needs the
whole receive of ``num_max_tokens_per_rank`` tokens per rank in half the buffer (``get_buffer_size_hint(...,
whole_batch=True)``); with a smaller (the default, fixed) buffer the dispatch falls back to the copying receive,
which streams any batch through the buffer in rounds (:func:`recv_view_fits`: every rank decides the same, from
``num_max_tokens_per_rank`` and the row shape, never from its own token count).

Construction allocates the communication buffers and meets every peer on the host: it is refused with a
``RuntimeError`` naming the capture while a CUDA graph is being captured (checked first, before any
allocation or rendezvous). Construct before capturing, or wrap a Buffer made before the capture with
:meth:`ElasticBuffer.from_buffer` (allocates nothing).

Where the code lives: this module holds construction, the queries and size hints, the out-of-scope stubs and
combine; dispatch (checks, source metadata, cached weights, the handle) is :mod:`moe_ep.deepep.v2.dispatch`, which
:class:`ElasticBuffer` inherits; the expanded layout is :mod:`moe_ep.deepep.v2.expand`, the handle
:mod:`moe_ep.deepep.v2.handle`, the sizes :mod:`moe_ep.deepep.v2.memory`.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from ... import validate as V
from ..v1.buffer import Buffer
from .dispatch import ElasticDispatchMixin, _align, recv_view_fits  # noqa: F401  (recv_view_fits: importable here)
from .expand import (combine_plan, expand_plan, expand_received, expert_counts,  # noqa: F401  (importable here)
                             sum_expanded, uses_kernels)
from .handle import EPHandle
from .memory import elastic_memory_per_rank, elastic_num_bytes
from ...events import EventOverlap

__all__ = ["ElasticBuffer", "EPHandle"]


def _capture_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _refuse_in_capture(what: str) -> None:
    """Raise a clear error when a CUDA graph is being captured on the current stream (or a capture is
    simulated by :func:`moe_ep.testing.streams.checked_streams`): construction allocates the communication
    buffers and meets the peers on the host, neither of which can be recorded into a graph."""
    from ...events import is_capturing, uses_streams

    dev = _capture_device()
    if uses_streams(dev) and is_capturing(dev):
        raise RuntimeError(f"{what} called while a CUDA graph is being captured: constructing an ElasticBuffer "
                           "allocates its communication buffers and rendezvouses with every peer rank on the host, "
                           "which cannot be captured. Construct it (or ElasticBuffer.from_buffer over a Buffer made "
                           "before the capture) before capturing, and capture only dispatch/combine.")


def _not_supported(name: str, hint_of: str = ""):
    """V2's ``name``, out of scope here: a method, or with ``hint_of`` (its feature) a static size hint. Either raises
    NotImplementedError naming itself."""
    def refuse(*args, **kwargs):
        if hint_of:
            raise NotImplementedError(f"ElasticBuffer.{name} ({hint_of}) is out of scope in this release")
        raise NotImplementedError(f"ElasticBuffer.{name} (Engram / pipeline-parallel / AGRS) is out of scope in this "
                                  "release; only expert-parallel dispatch and combine are provided")
    refuse.__name__ = name
    refuse.__doc__ = (f"V2's {hint_of + ' size hint ' if hint_of else ''}``{name}``: out of scope in this release "
                      "(raises NotImplementedError).")
    return staticmethod(refuse) if hint_of else refuse


class ElasticBuffer(ElasticDispatchMixin):
    """DeepEP V2's ``ElasticBuffer`` over :class:`moe_ep.Buffer` (normal-mode dispatch and combine).

    Arguments (V2's order and defaults):
        group: the process group (``None``: the default group).
        num_bytes: buffer bytes (the ``symm`` backend's ``num_nvl_bytes``); ``None``: computed from the MoE
            settings by :meth:`get_buffer_size_hint`. The ``torch`` backend ignores it.
        num_cpu_bytes: Engram's host storage: must be 0 (``NotImplementedError`` otherwise).
        num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch: MoE settings for the size and the default
            ``num_max_tokens_per_rank`` of :meth:`dispatch` (needed: it defines the global token index).
        deterministic: accepted; every path here is deterministic already.
        allow_hybrid_mode, prefer_overlap_with_compute, sl_idx, num_allocated_qps: RDMA / SM-count tuning with
            no counterpart here (ignored).
        allow_multiple_reduction: ``False`` asks combine for a single rounding; the non-expanded combine has
            one; the expanded one then sends float32 partial sums back (:mod:`moe_ep.deepep.v2.reduce`: one float32
            sum per token, cast once; host-synchronising), ``True`` sums expanded rows locally, casts, then sums
            over ranks (two roundings, the Buffer's own combine).
        num_cpu_timeout_secs, num_gpu_timeout_secs: the Buffer's ``timeout_s`` is the CPU one for ``torch``
            (waits on the host) and the GPU one for ``symm`` (waits on the device), unless ``timeout_s=`` is given.
        explicitly_destroy: as V2 (``True``: only :meth:`destroy` releases the resources).

    Keyword-only extensions: ``backend`` (``"auto"`` / ``"torch"`` / ``"symm"``), ``timeout_s`` and the
    backend's keyword arguments (``provider=``, ``device=``, ``ranks_per_node=``), passed to :class:`moe_ep.Buffer`.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, num_bytes: Optional[int] = None,
                 num_cpu_bytes: int = 0, num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0,
                 use_fp8_dispatch: bool = False, deterministic: bool = False, allow_hybrid_mode: bool = True,
                 allow_multiple_reduction: bool = True, prefer_overlap_with_compute: bool = True, sl_idx: int = 3,
                 num_allocated_qps: int = 0, num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100,
                 explicitly_destroy: bool = False, *, backend: str = "auto", timeout_s: Optional[float] = None,
                 **backend_kwargs):
        _refuse_in_capture("ElasticBuffer(...)")
        if num_cpu_bytes:
            raise NotImplementedError("num_cpu_bytes (Engram host storage) is out of scope in this release")
        for name, v in (("num_max_tokens_per_rank", num_max_tokens_per_rank), ("hidden", hidden),
                        ("num_topk", num_topk)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be a non-negative int, got {v!r}")
        if num_bytes is not None and (not isinstance(num_bytes, int) or num_bytes < 0):
            raise ValueError(f"num_bytes must be a non-negative int or None, got {num_bytes!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ElasticBuffer needs torch.distributed to be initialised (init_process_group)")
        group = group if group is not None else dist.group.WORLD
        from ...backends.choose import backend_from_env
        backend = backend_from_env(backend)  # MOE_EP_BACKEND, for engine code that passes no backend
        self.group = group
        self.rank_idx = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.allow_hybrid_mode = allow_hybrid_mode
        self.allow_multiple_reduction = allow_multiple_reduction
        self.prefer_overlap_with_compute = prefer_overlap_with_compute
        self.deterministic = deterministic
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_allocated_qps = 0  # no RDMA queue pairs in these backends
        self.explicitly_destroy = explicitly_destroy
        name = "torch" if backend == "auto" else backend
        if num_bytes is None:
            num_bytes = self.get_buffer_size_hint(group, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch) \
                if name == "symm" and num_max_tokens_per_rank and hidden else 0
        if name == "symm" and num_bytes == 0:
            raise ValueError("the symm backend needs num_bytes, or num_max_tokens_per_rank and hidden to size it")
        self.num_bytes = num_bytes
        if timeout_s is None:
            timeout_s = float(num_gpu_timeout_secs if name == "symm" else num_cpu_timeout_secs)
        self._buf = Buffer(group, num_nvl_bytes=num_bytes if name == "symm" else 0,
                           explicitly_destroy=explicitly_destroy, backend=backend, timeout_s=timeout_s,
                           **backend_kwargs)
        rpn = backend_kwargs.get("ranks_per_node") or self.num_ranks
        self._physical = (max(1, self.num_ranks // rpn), min(rpn, self.num_ranks))
        self.num_scaleout_ranks, self.num_scaleup_ranks = self.get_logical_domain_size()
        self.scaleout_rank_idx = self.rank_idx // self.num_scaleup_ranks
        self.scaleup_rank_idx = self.rank_idx % self.num_scaleup_ranks
        self.num_rdma_ranks, self.num_nvlink_ranks = self.get_physical_domain_size()

    @classmethod
    def from_buffer(cls, buffer: Buffer, num_max_tokens_per_rank: int, *, allow_multiple_reduction: bool = True,
                    deterministic: bool = False) -> "ElasticBuffer":
        """This face over an existing :class:`moe_ep.Buffer` (normal mode): no allocation, no rendezvous.

        ``num_max_tokens_per_rank`` (the same on every rank) defines the global token index of the receive
        order; ``num_bytes`` is the Buffer's. The Buffer stays the caller's: ``destroy`` here destroys it.
        Allowed during a CUDA graph capture (it only reads the Buffer's fields); the Buffer itself and the
        dispatch that follows are what must be capturable."""
        if not isinstance(buffer, Buffer):
            raise TypeError(f"buffer must be a moe_ep.Buffer, got {type(buffer).__name__}")
        if not isinstance(num_max_tokens_per_rank, int) or isinstance(num_max_tokens_per_rank, bool) or \
                num_max_tokens_per_rank <= 0:
            raise ValueError(f"num_max_tokens_per_rank must be a positive int, got {num_max_tokens_per_rank!r}")
        self = cls.__new__(cls)
        self.group = buffer.group
        self.rank_idx = buffer.rank
        self.num_ranks = buffer.group_size
        self.allow_hybrid_mode = True
        self.allow_multiple_reduction = allow_multiple_reduction
        self.prefer_overlap_with_compute = True
        self.deterministic = deterministic
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_allocated_qps = 0
        self.explicitly_destroy = buffer.explicitly_destroy
        self.num_bytes = getattr(buffer, "num_nvl_bytes", 0) or 0
        self._buf = buffer
        rpn = getattr(buffer._impl, "ranks_per_node", None) or getattr(buffer._impl, "G", None) or self.num_ranks
        self._physical = (max(1, self.num_ranks // rpn), min(rpn, self.num_ranks))
        self.num_scaleout_ranks, self.num_scaleup_ranks = self.get_logical_domain_size()
        self.scaleout_rank_idx = self.rank_idx // self.num_scaleup_ranks
        self.scaleup_rank_idx = self.rank_idx % self.num_scaleup_ranks
        self.num_rdma_ranks, self.num_nvlink_ranks = self.get_physical_domain_size()
        return self

    # ------------------------------------------------------------------------------------------ helpers
    @property
    def buffer(self) -> Buffer:
        """The :class:`moe_ep.Buffer` this face drives."""
        return self._buf

    def destroy(self) -> None:
        """Release the resources; needs ``explicitly_destroy=True`` (as V2). Later calls raise."""
        self._buf.destroy()

    @staticmethod
    def get_buffer_size_hint(group: Optional[dist.ProcessGroup], num_max_tokens_per_rank: int, hidden: int,
                             num_topk: int = 0, use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True, *, chunk_tokens: Optional[int] = None,
                             whole_batch: bool = False) -> int:
        """Bytes for ``num_bytes`` (2 MB-aligned, as V2) of the ``symm`` backend (BF16 rows, enough for FP8 too;
        ``num_topk=0`` sizes for a top-k of 32); see :func:`moe_ep.deepep.v2.memory.elastic_num_bytes`.

        Default: a fixed size that does not grow with ``num_max_tokens_per_rank``: ``chunk_tokens`` tokens per
        source per round (default ``max(64, 4096 // num_ranks)``) in one area that dispatch and combine
        time-share; a larger batch moves in rounds, with the same results. ``chunk_tokens=num_max_tokens_per_rank``:
        one round for every batch, copying receive. ``whole_batch=True`` (keyword extensions): the previous
        one-round size with separate dispatch and combine halves, which ``recv_as_view=True`` needs to stay a view
        (otherwise the receive falls back to a copy)."""
        world = dist.get_world_size(group if group is not None else dist.group.WORLD)
        return elastic_num_bytes(world, num_max_tokens_per_rank, hidden, num_topk, chunk_tokens=chunk_tokens,
                                 whole_batch=whole_batch)

    @staticmethod
    def memory_per_rank(num_ranks: int, num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0,
                        *, backend: str = "symm", num_bytes: Optional[int] = None, chunk_tokens: Optional[int] = None,
                        whole_batch: bool = False) -> int:
        """Bytes one rank's ElasticBuffer allocates at construction for these shapes and backend (``torch``: 0;
        ``symm``: the symmetric region, ``num_bytes`` defaulting to :meth:`get_buffer_size_hint` with
        ``chunk_tokens`` / ``whole_batch``, plus its signal words); no group needed. See
        :func:`moe_ep.deepep.v2.memory.elastic_memory_per_rank`, and
        :func:`moe_ep.deepep.v2.memory.deepep_v2_buffer_size_hint` for DeepEP V2's size of the same shapes."""
        return elastic_memory_per_rank(num_ranks, num_max_tokens_per_rank, hidden, num_topk, backend=backend,
                                       num_bytes=num_bytes, chunk_tokens=chunk_tokens, whole_batch=whole_batch)

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """A barrier over the group (a host-side ``torch.distributed.barrier``; the arguments are accepted)."""
        if with_cpu_sync and torch.cuda.is_available():
            torch.cuda.synchronize()
        dist.barrier(group=self.group)
        if with_cpu_sync and torch.cuda.is_available():
            torch.cuda.synchronize()

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current stream (an empty :class:`EventOverlap` without CUDA)."""
        return Buffer.capture()

    def get_comm_stream(self):
        """The Buffer's communication stream (``None`` without CUDA)."""
        return self._buf.get_comm_stream()

    def get_physical_domain_size(self) -> Tuple[int, int]:
        """``(num_rdma_ranks, num_nvlink_ranks)``: ``(num_ranks / ranks_per_node, ranks_per_node)`` for the
        node-aware ``torch`` backend, else ``(1, num_ranks)``."""
        return self._physical

    def get_logical_domain_size(self) -> Tuple[int, int]:
        """``(num_scaleout_ranks, num_scaleup_ranks)``: the physical domains (no hybrid remapping here)."""
        return self._physical

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, num_scaleout_topk: int = 0,
                                rdma_gbs: float = 0, nvlink_gbs: float = 0, sm_read_gbs: float = 200,
                                sm_write_gbs: float = 50) -> int:
        """SMs that keep the link busy for a balanced gate (an estimate; the backends here choose their own
        grids, so the value is advisory). Model: each received byte is written by the sending SMs once and
        each token is read once per expected destination rank; ``nvlink_gbs`` defaults to 450 (H100 NVLink,
        one direction). Even, at least 4, at most the device's SM count (132 without CUDA)."""
        if num_scaleout_topk != 0:
            raise NotImplementedError("num_scaleout_topk (group-limited gates) is not modelled")
        V.check_num_experts(num_experts, self.num_ranks)
        link = nvlink_gbs or 450.0
        r = self.num_ranks
        k = min(num_topk, num_experts)
        miss = math.comb(num_experts - num_experts // r, k) / math.comb(num_experts, k) if k else 1.0
        ranks_per_token = max(r * (1 - miss), 1e-9)
        remote = 1 - 1 / r
        device_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count \
            if torch.cuda.is_available() else 132
        if r == 1 or remote == 0:
            return device_sms
        need = max(link / remote * (1 / ranks_per_token) / sm_read_gbs, link / remote / sm_write_gbs)
        sms = _align(max(4, math.ceil(need * 1.25)), 2)
        if not self.prefer_overlap_with_compute:
            sms = max(sms, 64)
        return min(sms, device_sms)

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """RDMA queue pairs to use: 0 (these backends use none; V2's ``num_qps`` arguments are ignored)."""
        return 0

    engram_write = _not_supported("engram_write")
    engram_fetch = _not_supported("engram_fetch")

    get_engram_storage_size_hint = _not_supported("get_engram_storage_size_hint", "Engram")
    get_pp_buffer_size_hint = _not_supported("get_pp_buffer_size_hint", "pipeline-parallel")
    get_agrs_num_max_session_bytes = _not_supported("get_agrs_num_max_session_bytes", "AGRS")
    get_agrs_buffer_size_hint = _not_supported("get_agrs_buffer_size_hint", "AGRS")

    pp_set_config = _not_supported("pp_set_config")
    pp_send = _not_supported("pp_send")
    pp_recv = _not_supported("pp_recv")
    create_agrs_session = _not_supported("create_agrs_session")
    destroy_agrs_session = _not_supported("destroy_agrs_session")
    agrs_new_session = _not_supported("agrs_new_session")
    agrs_set_config = _not_supported("agrs_set_config")
    agrs_get_inplace_tensor = _not_supported("agrs_get_inplace_tensor")
    all_gather = _not_supported("all_gather")

    # ------------------------------------------------------------------------------------------ combine
    def combine(self, x: torch.Tensor, handle: EPHandle, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor], None] = None, num_sms: int = 0,
                num_qps: int = 0, previous_event: Optional[EventOverlap] = None,
                previous_event_before_epilogue: Optional[EventOverlap] = None,
                async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False):
        """Sum, per source token, the rows that came from it, and return them to the source rank.

        Arguments:
            x: BF16 `[num_recv_tokens, H]` in ``recv_x``'s order, or `[num_expanded_tokens, H]` when the handle is
                expanded (padding rows are ignored). No weights are applied here (apply them before).
            handle: from :meth:`dispatch`.
            topk_weights: optional float32 `[num_recv_tokens, K]`, or `[num_expanded_tokens]` when expanded:
                reduced back to `[N, K]` (entries whose expert is not on this rank are ignored).
            bias: 0, 1 or 2 BF16 `[N, H]` tensors added once.
            num_sms, num_qps, previous_event_before_epilogue: V2 tuning (ignored / waited on).

        Returns:
            combined_x BF16 `[N, H]`, combined_topk_weights float32 `[N, K]` (``None`` without ``topk_weights``),
            event.
        """
        def checks():
            if not isinstance(handle, EPHandle) or handle._owner != id(self):
                raise TypeError("handle must be an EPHandle from this ElasticBuffer's dispatch")
            rows = handle.num_expanded_tokens if handle.do_expand else handle.num_recv_tokens
            V.check_combine_x(x, rows, handle._hidden)
            if topk_weights is not None:
                want = (rows,) if handle.do_expand else (handle.num_recv_tokens, handle.topk_idx.shape[1])
                if not isinstance(topk_weights, torch.Tensor) or topk_weights.dtype != torch.float32 or \
                        tuple(topk_weights.shape) != want:
                    raise ValueError(f"topk_weights must be torch.float32 {list(want)} "
                                     f"({'1-D per expanded row' if handle.do_expand else 'per received token'}), got "
                                     f"{getattr(topk_weights, 'dtype', type(topk_weights).__name__)} "
                                     f"{list(getattr(topk_weights, 'shape', []))}")

        self._refusing("combine", checks)
        if previous_event_before_epilogue is not None:
            previous_event_before_epilogue.current_stream_wait()
        valid = handle.recv_topk_idx >= 0
        if handle.do_expand and not self.allow_multiple_reduction:  # one float32 sum per token, one rounding
            from .reduce import combine_one_rounding

            if previous_event is not None:
                previous_event.current_stream_wait()
            biases = V.check_bias(bias, handle._buffer_handle.num_tokens, handle._hidden, x.device, x.dtype)
            w = None if topk_weights is None else torch.where(valid, topk_weights[handle._slot.clamp(min=0)], 0.0)
            combined, combined_w = combine_one_rounding(x, handle, w, biases, self.group)
            return combined, combined_w, EventOverlap(None)
        if handle.do_expand:
            if previous_event is not None:  # the local sum runs on this stream: after the event, and the
                previous_event.current_stream_wait()  # communication after the sum
                previous_event = self.capture()
            rows = self._sum_expanded(x, handle)
            w = None if topk_weights is None else torch.where(valid, topk_weights[handle._slot.clamp(min=0)], 0.0)
        else:
            rows = x
            w = None if topk_weights is None else torch.where(valid, topk_weights, 0.0)
        combined, combined_w, event = self._buf.combine(
            rows, handle._buffer_handle, topk_weights=w, bias=bias, previous_event=previous_event,
            async_finish=async_with_compute_stream, allocate_on_comm_stream=allocate_on_comm_stream)
        return combined, combined_w, event
