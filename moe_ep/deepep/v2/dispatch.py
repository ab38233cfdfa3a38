"""The dispatch of :class:`moe_ep.ElasticBuffer` (DeepEP V2's ``ElasticBuffer.dispatch``), as a mixin the face
inherits: argument checks (refused on every rank together, :meth:`~ElasticDispatchMixin._refusing`), the call to
:meth:`moe_ep.Buffer.dispatch`, the source metadata of the receive (global token index, source rank, per-rank
prefix sums), the move of top-k weights along a cached layout, the expanded layout's plans
(:mod:`moe_ep.deepep.v2.expand`) and the :class:`~moe_ep.deepep.v2.handle.EPHandle` that combine and cached dispatch
reuse; and :func:`recv_view_fits`, the same-on-every-rank choice between a receive view and the copying receive.

The mixin holds no state of its own: it reads the attributes :class:`moe_ep.ElasticBuffer` sets (``_buf``,
``group``, ``rank_idx``, ``num_ranks``, ``num_max_tokens_per_rank``). Construction, queries and combine live in
:mod:`moe_ep.deepep.v2.buffer`.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from ... import validate as V
from ..v1.buffer import Buffer
from .expand import combine_plan, expand_plan, expand_received, expert_counts, sum_expanded, uses_kernels
from .handle import EPHandle
from ...events import EventOverlap, run_on_comm_stream

__all__ = ["ElasticDispatchMixin", "recv_view_fits"]


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


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


class ElasticDispatchMixin:
    """:meth:`dispatch` and its layout helpers for :class:`moe_ep.ElasticBuffer` (see the module docstring)."""

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

    def _dst_buffer_slot_idx(self, topk_idx: torch.Tensor, in_rank: torch.Tensor, num_local: int,
                             num_max: int) -> torch.Tensor:
        """DeepEP V2's ``dst_buffer_slot_idx`` (non-hybrid): `[N, K]` int32; at the first selection of each destination
        rank in a token's top-k, ``rank * num_max_tokens_per_rank + j`` where ``j`` counts the tokens this rank sent
        to that destination before it (its slot in the destination's region for this source); -1 elsewhere."""
        dst = torch.where(topk_idx >= 0, torch.div(topk_idx, num_local, rounding_mode="floor"), -1)
        k = topk_idx.shape[1]
        earlier = torch.ones(k, k, dtype=torch.bool, device=dst.device).tril(-1)  # [k, k'] k' < k
        repeat = ((dst.unsqueeze(2) == dst.unsqueeze(1)) & earlier).any(2)
        pos = in_rank.to(torch.int32).cumsum(0) - 1  # [N, R]: the token's order among those sent to each rank
        slot = pos.gather(1, dst.clamp(min=0))
        out = torch.where((dst >= 0) & ~repeat, self.rank_idx * num_max + slot, -1)
        return out.to(torch.int32).contiguous()

    # expanded layout: moe_ep/deepep/v2/expand.py
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
            use_tma_aligned_col_major_sf: FP8 scales returned M-major with the TMA-aligned column stride (BF16
                input has no scales: ignored, as V2).

            recv_as_view: (keyword; not in V2's signature) on the ``symm`` backend the receive stays in this
                rank's buffer: non-expanded ``recv_x`` and its scales are views of it (no copy; the scales
                too unless ``use_tma_aligned_col_major_sf`` asks for another layout), and the expanded layout
                is gathered straight from it. A view is valid until this rank's next ``dispatch`` or
                ``combine`` on this buffer (order work that reads it before that call); with
                ``do_cpu_sync=False`` its padding rows are stale, not zero (their ``recv_topk_idx`` is -1).
                Every rank must pass the same value. On the ``torch`` backend the receive is fresh tensors
                either way.

        Returns:
            recv_x (a ``(fp8, scales)`` tuple for FP8), recv_topk_idx `[M, K]` (per received token; ``None``
            when expanded, as DeepEP V2: ``handle.recv_topk_idx`` still has it), recv_topk_weights (`[M, K]`, or
            `[num_expanded]` when expanded, 0 on padding; ``None`` without ``topk_weights``), handle
            (:class:`EPHandle`), event.
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

        def epilogue():
            return self._dispatch_epilogue(recv_x, recv_idx, recv_w, bh, previous_event_before_epilogue, data,
                                           topk_idx, topk_weights, in_rank, num_experts, num_local, num_max,
                                           alignment, do_cpu_sync, do_expand, do_handle_copy, num_sms,
                                           cumulative_local_expert_recv_stats, do_zero_padding,
                                           use_tma_aligned_col_major_sf)

        return self._after_communication(epilogue, event, async_with_compute_stream, (recv_x, recv_idx, recv_w))

    def _after_communication(self, fn, event, async_finish: bool, inputs):
        """Run ``fn`` (work on a dispatch's outputs) once they are there: synchronous calls run it on the current
        stream (which waited already); ``async_with_compute_stream`` queues it on the communication stream behind
        the dispatch, so the current stream never waits, and returns the event recorded after it (on CPU: runs)."""
        if not async_finish:
            return fn() + (event,)
        device = self._buf_device(inputs)
        out, ev = run_on_comm_stream(fn, device, self._buf._comm_stream(device), previous_event=event,
                                     async_finish=True, allocate_on_comm_stream=False, inputs=inputs, owner=self._buf)
        return out + (ev,)

    @staticmethod
    def _buf_device(inputs) -> torch.device:
        first = inputs[0][0] if isinstance(inputs[0], tuple) else inputs[0]
        return first.device

    def _dispatch_epilogue(self, recv_x, recv_idx, recv_w, bh, previous_event_before_epilogue, data, topk_idx,
                           topk_weights, in_rank, num_experts, num_local, num_max, alignment, do_cpu_sync, do_expand,
                           do_handle_copy, num_sms, cumulative_local_expert_recv_stats, do_zero_padding,
                           use_tma_aligned_col_major_sf):
        """Everything after the communication of a non-cached dispatch: source metadata, per-expert counts (the
        CPU-synced host read), the expanded layout, the handle; returns ``(recv_x, recv_topk_idx, recv_topk_weights,
        handle)``."""
        if previous_event_before_epilogue is not None:
            previous_event_before_epilogue.current_stream_wait()
        K, hidden = topk_idx.shape[1], data.shape[1]
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
        h.dst_buffer_slot_idx = self._dst_buffer_slot_idx(topk_idx, in_rank, num_local, num_max)
        h.recv_topk_idx = recv_idx
        h._owner, h._buffer_handle, h._hidden = id(self), bh, hidden
        h._slot, h._exp_src, h._exp_k = slot, exp_src, exp_k
        h._comb_src, h._comb_order, h._comb_sorted_src, h._comb_rows = comb
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats.add_(counts.to(torch.int32))
        out_w = recv_w if topk_weights is not None else None
        return self._finish(h, recv_data, recv_scales, recv_idx, out_w, do_zero_padding, use_tma_aligned_col_major_sf)

    def _check_common(self, do_expand, do_zero_padding, async_with_compute_stream, use_tma_sf, scales,
                      stats, num_local, device):
        if do_zero_padding and not do_expand:
            raise ValueError("do_zero_padding needs do_expand=True (padding exists only in the expanded layout)")
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

        def epilogue():
            if previous_event_before_epilogue is not None:
                previous_event_before_epilogue.current_stream_wait()
            recv_data, recv_scales = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
            return self._finish(h, recv_data, recv_scales, h.recv_topk_idx, recv_w, do_zero_padding, use_tma_sf)

        return self._after_communication(epilogue, event, async_with_compute_stream, (recv_x,))

    def _finish(self, h, recv_data, recv_scales, recv_idx, recv_w, zero, use_tma_sf):
        if h.do_expand:
            recv_data, recv_scales, recv_w = expand_received(recv_data, recv_scales, recv_w, h._exp_src, h._exp_k,
                                                             zero)
        if recv_scales is not None and use_tma_sf:
            from ...gemm import get_mn_major_tma_aligned_tensor

            recv_scales = get_mn_major_tma_aligned_tensor(recv_scales)
        recv_x = (recv_data, recv_scales) if recv_scales is not None else recv_data
        if h.do_expand:  # as DeepEP V2: no per-token ids for the expanded layout (the rows' experts: the psum)
            recv_idx = None
        return recv_x, recv_idx, recv_w, h
