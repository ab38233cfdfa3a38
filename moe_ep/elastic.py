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
  ``allow_multiple_reduction=True``); top-k weights travel back as V2 describes (2-D, or 1-D per
  expanded row); 0, 1 or 2 bias tensors are added once;
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
"""

from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from . import validate as V
from .buffer import Buffer
from .elastic_handle import EPHandle
from .elastic_expand import combine_plan, expand_plan, expand_received, expert_counts, sum_expanded, uses_kernels
from .elastic_memory import elastic_memory_per_rank, elastic_num_bytes
from .events import EventOverlap

__all__ = ["ElasticBuffer", "EPHandle"]


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def _capture_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _refuse_in_capture(what: str) -> None:
    """Raise a clear error when a CUDA graph is being captured on the current stream (or a capture is
    simulated by :func:`moe_ep.testing.streams.checked_streams`): construction allocates the communication
    buffers and meets the peers on the host, neither of which can be recorded into a graph."""
    from .events import is_capturing, uses_streams

    dev = _capture_device()
    if uses_streams(dev) and is_capturing(dev):
        raise RuntimeError(f"{what} called while a CUDA graph is being captured: constructing an ElasticBuffer "
                           "allocates its communication buffers and rendezvouses with every peer rank on the host, "
                           "which cannot be captured. Construct it (or ElasticBuffer.from_buffer over a Buffer made "
                           "before the capture) before capturing, and capture only dispatch/combine.")


def recv_view_fits(buf: Buffer, data: torch.Tensor, scales: Optional[torch.Tensor], num_topk: int,
                   num_max_tokens_per_rank: Optional[int], num_worst_tokens: int = 0, *, with_topk: bool = True) -> bool:
    """Whether a dispatch of ``data`` rows (``scales``: FP8's) receives as a view of ``buf``'s buffer: on a backend
    with receive views, when every rank's batch of up to ``num_max_tokens_per_rank`` tokens (the same on every
    rank, so every rank decides the same) fits the buffer's view area; else the caller takes the copying receive
    (rounds through a fixed buffer). ``None`` tokens: no bound known, no view."""
    impl = buf._impl
    normal = getattr(impl, "_normal", None)
    if not getattr(impl, "supports_recv_view", False) or normal is None or not num_max_tokens_per_rank:
        return False
    scale_cols = 0 if scales is None else scales.shape[1]
    return normal.recv_view_fits(data.shape[1], data.element_size(), scale_cols, num_topk, with_topk,
                                 num_max_tokens_per_rank, num_worst_tokens)


def _not_supported(name: str):
    def method(self, *args, **kwargs):
        raise NotImplementedError(f"ElasticBuffer.{name} (Engram / pipeline-parallel / AGRS) is out of scope in this "
                                  "release; only expert-parallel dispatch and combine are provided")
    method.__name__ = name
    method.__doc__ = f"V2's ``{name}``: out of scope in this release (raises NotImplementedError)."
    return method


class ElasticBuffer:
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
            one, the expanded one two (it then raises ``NotImplementedError``).
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
        ``num_topk=0`` sizes for a top-k of 32); see :func:`moe_ep.elastic_memory.elastic_num_bytes`.

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
        :func:`moe_ep.elastic_memory.elastic_memory_per_rank`, and
        :func:`moe_ep.elastic_memory.deepep_v2_buffer_size_hint` for DeepEP V2's size of the same shapes."""
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

    @staticmethod
    def get_engram_storage_size_hint(*args, **kwargs):
        """V2's Engram size hint: out of scope in this release (raises NotImplementedError)."""
        raise NotImplementedError("ElasticBuffer.get_engram_storage_size_hint (Engram) is out of scope in this release")

    pp_set_config = _not_supported("pp_set_config")
    pp_send = _not_supported("pp_send")
    pp_recv = _not_supported("pp_recv")
    create_agrs_session = _not_supported("create_agrs_session")
    destroy_agrs_session = _not_supported("destroy_agrs_session")
    agrs_new_session = _not_supported("agrs_new_session")
    agrs_set_config = _not_supported("agrs_set_config")
    agrs_get_inplace_tensor = _not_supported("agrs_get_inplace_tensor")
    all_gather = _not_supported("all_gather")

    # ------------------------------------------------------------------------------------------ layout
    def _refusing(self, what: str, fn):
        """Run checks ``fn``; a ValueError/TypeError tells the peers (backends that meet on the host) too."""
        impl = self._buf._impl
        mark = impl.arrival_mark()
        try:
            return fn()
        except (ValueError, TypeError) as exc:
            impl.refuse(what, mark, f"{type(exc).__name__}: {exc}")
            raise

    def _source_metadata(self, bh, num_rows: int, num_max: int, is_token_in_rank: torch.Tensor, device):
        """``(psum per source rank [R] int32, src_global [rows] int64, src_rank [rows] int64)``."""
        R, me = self.num_ranks, self.rank_idx
        prefix = bh.deepep_field("rank_prefix_matrix")
        psum = prefix[:, me].to(torch.int32).contiguous()
        rows = torch.arange(num_rows, device=device)
        src_rank = torch.bucketize(rows, psum.to(torch.int64), right=True)  # R on padding rows
        src_idx = bh.deepep_field("recv_src_idx")
        if src_idx is None:
            # The backend does not report source token indices (symm: its message rows do not carry them): get
            # from every source its token->rank mask column for this rank and list, in (rank, token) order, what
            # came here.
            to_me = self._masks_to_me(is_token_in_rank, num_max, device)  # [R src, num_max] bool
            flat = torch.arange(R * num_max, device=device)
            key = torch.where(to_me.reshape(-1), flat, R * num_max)
            ordered = torch.sort(key).values
            if ordered.numel() < num_rows:
                ordered = torch.cat([ordered, ordered.new_full((num_rows - ordered.numel(),), R * num_max)])
            src_global = ordered[:num_rows]
        else:
            src_idx = src_idx.to(torch.int64)[:num_rows]
            src_global = src_rank.clamp(max=R - 1) * num_max + src_idx
        valid = src_rank < R
        src_global = torch.where(valid, src_global, -1)
        src_rank = torch.where(valid, src_rank, -1)
        return psum, src_global, src_rank

    def _masks_to_me(self, is_token_in_rank: torch.Tensor, num_max: int, device) -> torch.Tensor:
        """``[R src, num_max]`` bool: which of source ``s``'s tokens came to this rank. One ``all_to_all_single``
        where each rank sends each peer only that peer's column of its ``is_token_in_rank``, 8 tokens a byte:
        ``R * ceil(num_max / 8)`` bytes per rank each way (an all-gather of the whole masks moved ``R * R * num_max``
        bytes into every rank); device ops only, no host read."""
        R = self.num_ranks
        nbytes = (num_max + 7) // 8
        bits = torch.zeros(R, nbytes * 8, dtype=torch.uint8, device=device)
        bits[:, :is_token_in_rank.shape[0]] = is_token_in_rank.t().to(torch.uint8)
        shifts = torch.arange(8, dtype=torch.uint8, device=device)
        packed = (bits.view(R, nbytes, 8) << shifts).sum(-1).to(torch.uint8).contiguous()  # row d: for rank d
        got = torch.empty_like(packed)  # row s: from rank s
        dist.all_to_all_single(got, packed, group=self.group)
        return ((got.unsqueeze(-1) >> shifts) & 1).view(R, nbytes * 8)[:, :num_max] > 0

    # expanded layout: moe_ep/elastic_expand.py
    _expert_counts = staticmethod(expert_counts)
    _expand_plan = staticmethod(expand_plan)
    _combine_plan = staticmethod(combine_plan)
    _sum_expanded = staticmethod(sum_expanded)

    # ------------------------------------------------------------------------------------------ weights transport
    def _move_weights_cached(self, bh, topk_weights: torch.Tensor, hidden: int) -> torch.Tensor:
        """Send float32 `[N, K]` along a cached layout: each weight's 4 bytes as 4 BF16 integers 0..255
        (exact in BF16, no NaN patterns), one row of width ``hidden`` per token."""
        n, k = topk_weights.shape
        b = topk_weights.contiguous().view(torch.uint8).view(n, 4 * k)
        row = torch.zeros(n, hidden, dtype=torch.bfloat16, device=topk_weights.device)
        row[:, :4 * k] = b.to(torch.bfloat16)
        recv = self._buf.dispatch(row, handle=bh)[0]
        got = recv[:, :4 * k].to(torch.uint8).contiguous()
        return got.view(torch.float32).view(-1, k)

    # ------------------------------------------------------------------------------------------ dispatch
    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                 num_experts: Optional[int] = None, num_max_tokens_per_rank: Optional[int] = None,
                 expert_alignment: Optional[int] = None, num_sms: int = 0, num_qps: int = 0,
                 previous_event: Optional[EventOverlap] = None,
                 previous_event_before_epilogue: Optional[EventOverlap] = None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                 handle: Optional[EPHandle] = None, do_handle_copy: bool = True, do_cpu_sync: Optional[bool] = None,
                 do_expand: bool = False, do_zero_padding: bool = False, use_tma_aligned_col_major_sf: bool = False,
                 *, recv_as_view: bool = False):
        """Send each token to the ranks holding its experts (V2's argument order and defaults).

        Arguments:
            x: BF16 `[N, H]` or ``(x_fp8 e4m3 [N, H], scales float32 [N, H/128])``; scales travel with their rows.
            topk_idx: `[N, K]` int64, -1 = none; ``None`` with a ``handle``.
            topk_weights: optional `[N, K]` float32 (also allowed with a ``handle``, e.g. for a backward pass).
            cumulative_local_expert_recv_stats: optional `[L]` int32; the real per-expert counts are added.
            num_experts: ``E`` (from the handle when cached).
            num_max_tokens_per_rank: the same on every rank (default: the constructor's); ``N`` may not exceed it.
            expert_alignment: default 1; expanded blocks and the per-expert counts are rounded up to it.
            num_sms, num_qps, previous_event_before_epilogue, do_handle_copy (clones ``topk_idx``): V2 tuning;
                ``num_sms``/``num_qps`` ignored.
            previous_event, async_with_compute_stream, allocate_on_comm_stream: the Buffer's ``previous_event``,
                ``async_finish`` and ``allocate_on_comm_stream`` (async is refused with ``do_expand``).
            handle: cached dispatch (no host read; the layout, expansion and ``m_indices`` are reused).
            do_cpu_sync: ``None`` = ``True`` without a handle; ``False``: outputs sized for the worst case
                (``num_max_tokens_per_rank * num_ranks`` rows; padding rows have ``recv_topk_idx == -1``).
            do_expand: one row per (token, local expert); ``do_zero_padding``: padding rows are zero.
            use_tma_aligned_col_major_sf: FP8 scales returned M-major with the TMA-aligned column stride.

            recv_as_view: (keyword; not in V2's signature) on the ``symm`` backend the receive stays in this
                rank's buffer: non-expanded ``recv_x`` and its scales are views of it (no copy; the scales
                too unless ``use_tma_aligned_col_major_sf`` asks for another layout), and the expanded layout
                is gathered straight from it. A view is valid until this rank's next ``dispatch`` or
                ``combine`` on this buffer (order work that reads it before that call); with
                ``do_cpu_sync=False`` its padding rows are stale, not zero (their ``recv_topk_idx`` is -1).
                Every rank must pass the same value. On the ``torch`` backend the receive is fresh tensors
                either way.

        Returns:
            recv_x (a ``(fp8, scales)`` tuple for FP8), recv_topk_idx `[M, K]` (per received token, also when
            expanded), recv_topk_weights (`[M, K]`, or `[num_expanded]` when expanded, 0 on padding; ``None``
            without ``topk_weights``), handle (:class:`EPHandle`), event.
        """
        data, scales = self._refusing("dispatch", lambda: V.split_x(x))
        n, hidden = data.shape
        if handle is not None:
            self._refusing("dispatch", lambda: self._check_cached(handle, topk_idx, topk_weights, num_experts,
                                                                  num_max_tokens_per_rank, expert_alignment,
                                                                  do_cpu_sync, do_expand, n, hidden))
            return self._cached_dispatch(x, data, scales, handle, topk_weights, previous_event,
                                         previous_event_before_epilogue, async_with_compute_stream,
                                         allocate_on_comm_stream, do_zero_padding, use_tma_aligned_col_major_sf,
                                         recv_as_view)
        num_max = num_max_tokens_per_rank if num_max_tokens_per_rank is not None else self.num_max_tokens_per_rank
        alignment = 1 if expert_alignment is None else expert_alignment
        do_cpu_sync = True if do_cpu_sync is None else do_cpu_sync

        def checks():
            if topk_idx is None:
                raise ValueError("dispatch without a handle needs topk_idx")
            if num_experts is None:
                raise ValueError("dispatch without a handle needs num_experts")
            num_local = V.check_num_experts(num_experts, self.num_ranks)
            V.check_topk_shape(topk_idx, n, data.device)
            if topk_weights is not None:
                V.check_topk_weights(topk_weights, topk_idx)
            if not isinstance(num_max, int) or num_max <= 0:
                raise ValueError("num_max_tokens_per_rank must be a positive int (constructor or dispatch); it "
                                 f"defines the global token index, got {num_max!r}")
            if n > num_max:
                raise ValueError(f"x has {n} tokens, more than num_max_tokens_per_rank={num_max}")
            if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment < 1:
                raise ValueError(f"expert_alignment must be a positive int, got {alignment!r}")
            self._check_common(do_expand, do_zero_padding, async_with_compute_stream, use_tma_aligned_col_major_sf,
                               scales, cumulative_local_expert_recv_stats, num_local, data.device)
            return num_local

        def checks_and_layout():
            # the layout checks the expert ids' values (range, repeats): a refusal there reaches the peers too
            return checks(), self._buf.get_dispatch_layout(topk_idx, num_experts)

        num_local, (per_rank, _, per_expert, in_rank, _) = self._refusing("dispatch", checks_and_layout)
        K = topk_idx.shape[1]
        weights = topk_weights if topk_weights is not None else torch.zeros(n, K, dtype=torch.float32,
                                                                            device=data.device)
        worst = 0 if do_cpu_sync else num_max * self.num_ranks
        recv_as_view = recv_as_view and recv_view_fits(self._buf, data, scales, K, num_max, worst)
        recv_x, recv_idx, recv_w, _, bh, event = self._buf.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk_idx, topk_weights=weights, expert_alignment=1, num_worst_tokens=worst,
            previous_event=previous_event, async_finish=async_with_compute_stream,
            allocate_on_comm_stream=allocate_on_comm_stream, recv_as_view=recv_as_view)
        if previous_event_before_epilogue is not None:
            previous_event_before_epilogue.current_stream_wait()
        recv_data, recv_scales = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
        M = recv_data.shape[0]
        psum_rank, src_global, src_rank = self._source_metadata(bh, M, num_max, in_rank, data.device)
        passes = min(K, num_local)  # a row holds an expert at most once: at most this many selections a row
        key, counts, aligned = self._expert_counts(recv_idx, num_local, alignment)
        # the torch sum of the expanded combine takes its passes from the host; the sum kernel needs no plan
        exact_sum = do_expand and not uses_kernels(data)
        per_row = (recv_idx >= 0).sum(1) if exact_sum else None
        per_expert_list, pass_rows = None, None
        num_expanded = _align(M * passes + num_local * (alignment - 1), alignment)  # worst case
        if do_cpu_sync:  # the one host read of a CPU-synced dispatch: aligned counts (+ rows per combine pass)
            parts = [aligned]
            if exact_sum:
                parts.append((per_row.unsqueeze(1) > torch.arange(passes, device=data.device)).sum(0))
            host = torch.cat(parts).tolist()
            per_expert_list, pass_rows = host[:num_local], (host[num_local:] if exact_sum else None)
            num_expanded = sum(per_expert_list)
        if do_expand:
            slot, exp_src, exp_k = self._expand_plan(key, counts, aligned, K, num_expanded)
            slot = slot.view(M, K)
            comb = self._combine_plan(slot, per_row, passes, pass_rows)
            psum_expert = ((aligned.cumsum(0) - aligned) + counts).to(torch.int32)
            rows_of = slot
        else:
            slot = exp_src = exp_k = None
            comb = (None, None, None, None)
            psum_expert = aligned.cumsum(0).to(torch.int32)
            rows_of = torch.where(recv_idx >= 0, torch.arange(M, device=data.device).unsqueeze(1), -1)
            num_expanded = 0
        metadata = torch.cat([src_global.unsqueeze(1), src_rank.unsqueeze(1), rows_of], dim=1)
        h = EPHandle(do_expand, num_experts, alignment, num_max, num_sms,
                     topk_idx.clone() if do_handle_copy else topk_idx, M, num_expanded, per_expert_list,
                     psum_rank, psum_expert, counts.to(torch.int32) if do_expand else None, metadata)
        h.recv_topk_idx = recv_idx
        h._owner, h._buffer_handle, h._hidden = id(self), bh, hidden
        h._slot, h._exp_src, h._exp_k = slot, exp_src, exp_k
        h._comb_src, h._comb_order, h._comb_sorted_src, h._comb_rows = comb
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats.add_(counts.to(torch.int32))
        out_w = recv_w if topk_weights is not None else None
        return self._finish(h, recv_data, recv_scales, recv_idx, out_w, do_zero_padding,
                            use_tma_aligned_col_major_sf, event)

    def _check_common(self, do_expand, do_zero_padding, async_with_compute_stream, use_tma_sf, scales,
                      stats, num_local, device):
        if do_zero_padding and not do_expand:
            raise ValueError("do_zero_padding needs do_expand=True (padding exists only in the expanded layout)")
        if async_with_compute_stream and do_expand:
            raise NotImplementedError("async_with_compute_stream with do_expand is not supported in this release "
                                      "(the expansion runs on the compute stream)")
        if use_tma_sf and scales is None:
            raise ValueError("use_tma_aligned_col_major_sf needs FP8 input (x as (x_fp8, scales))")
        if stats is not None and (not isinstance(stats, torch.Tensor) or stats.dtype != torch.int32
                                  or tuple(stats.shape) != (num_local,) or stats.device != device):
            raise ValueError(f"cumulative_local_expert_recv_stats must be torch.int32 [{num_local}] on {device}")

    def _check_cached(self, handle, topk_idx, topk_weights, num_experts, num_max, alignment, do_cpu_sync, do_expand,
                      n, hidden):
        if not isinstance(handle, EPHandle):
            raise TypeError(f"handle must be an EPHandle from ElasticBuffer.dispatch, got {type(handle).__name__}")
        if handle._owner != id(self):
            raise ValueError("handle was produced by another ElasticBuffer")
        if topk_idx is not None:
            raise ValueError("cached dispatch (handle given) takes no topk_idx (it is reused from the handle)")
        if do_cpu_sync:
            raise ValueError("do_cpu_sync=True cannot be combined with a cached handle (it reads nothing on the host)")
        if do_expand and not handle.do_expand:
            raise ValueError("do_expand=True but the handle was made without it (the layout follows the handle)")
        for name, got, want in (("num_experts", num_experts, handle.num_experts),
                                ("num_max_tokens_per_rank", num_max, handle.num_max_tokens_per_rank),
                                ("expert_alignment", alignment, handle.expert_alignment)):
            if got is not None and got != want:
                raise ValueError(f"{name}={got} disagrees with the handle's {want}")
        if n != handle.topk_idx.shape[0] or hidden != handle._hidden:
            raise ValueError(f"x has shape [{n}, {hidden}] but the handle was made for "
                             f"[{handle.topk_idx.shape[0]}, {handle._hidden}]")
        if topk_weights is not None:
            V.check_topk_weights(topk_weights, handle.topk_idx)
            if 4 * topk_weights.shape[1] > hidden:
                raise ValueError(f"cached dispatch carries top-k weights as 4 bytes each in a row of hidden={hidden}: "
                                 f"num_topk={topk_weights.shape[1]} is too many")

    def _cached_dispatch(self, x, data, scales, h, topk_weights, previous_event, previous_event_before_epilogue,
                         async_with_compute_stream, allocate_on_comm_stream, do_zero_padding, use_tma_sf,
                         recv_as_view):
        self._refusing("dispatch", lambda: self._check_common(
            h.do_expand, do_zero_padding, async_with_compute_stream, use_tma_sf, scales, None, 0, data.device))
        recv_w = None
        if topk_weights is not None:  # first: a dispatch after a receive view would free the view's rows
            recv_w = self._move_weights_cached(h._buffer_handle, topk_weights, data.shape[1])
            recv_w = torch.where(h.recv_topk_idx >= 0, recv_w, 0.0)
        worst = 0 if h.num_recv_tokens_per_expert_list is not None else h.num_max_tokens_per_rank * self.num_ranks
        recv_as_view = recv_as_view and recv_view_fits(self._buf, data, scales, h.topk_idx.shape[1],
                                                       h.num_max_tokens_per_rank, worst, with_topk=False)
        recv_x, _, _, _, _, event = self._buf.dispatch(
            x, handle=h._buffer_handle, previous_event=previous_event, async_finish=async_with_compute_stream,
            allocate_on_comm_stream=allocate_on_comm_stream, recv_as_view=recv_as_view)
        if previous_event_before_epilogue is not None:
            previous_event_before_epilogue.current_stream_wait()
        recv_data, recv_scales = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
        return self._finish(h, recv_data, recv_scales, h.recv_topk_idx, recv_w, do_zero_padding, use_tma_sf, event)

    def _finish(self, h, recv_data, recv_scales, recv_idx, recv_w, zero, use_tma_sf, event):
        if h.do_expand:
            recv_data, recv_scales, recv_w = expand_received(recv_data, recv_scales, recv_w, h._exp_src, h._exp_k,
                                                             zero)
        if recv_scales is not None and use_tma_sf:
            from .gemm import get_mn_major_tma_aligned_tensor

            recv_scales = get_mn_major_tma_aligned_tensor(recv_scales)
        recv_x = (recv_data, recv_scales) if recv_scales is not None else recv_data
        return recv_x, recv_idx, recv_w, h, event

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
            if handle.do_expand and not self.allow_multiple_reduction:
                raise NotImplementedError("allow_multiple_reduction=False with an expanded combine: this release "
                                          "sums expanded rows locally, then across ranks (two roundings)")
            if handle.do_expand and async_with_compute_stream:
                raise NotImplementedError("async_with_compute_stream with an expanded combine is not supported")

        self._refusing("combine", checks)
        if previous_event_before_epilogue is not None:
            previous_event_before_epilogue.current_stream_wait()
        valid = handle.recv_topk_idx >= 0
        if handle.do_expand:
            rows = self._sum_expanded(x, handle)
            w = None if topk_weights is None else torch.where(valid, topk_weights[handle._slot.clamp(min=0)], 0.0)
        else:
            rows = x
            w = None if topk_weights is None else torch.where(valid, topk_weights, 0.0)
        combined, combined_w, event = self._buf.combine(
            rows, handle._buffer_handle, topk_weights=w, bias=bias, previous_event=previous_event,
            async_finish=async_with_compute_stream, allocate_on_comm_stream=allocate_on_comm_stream)
        return combined, combined_w, event
