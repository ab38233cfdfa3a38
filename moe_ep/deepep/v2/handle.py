"""``EPHandle``: what :meth:`moe_ep.ElasticBuffer.dispatch` returns (DeepEP V2's fields, with their documented
meaning, plus this implementation's layout state for combine and cached dispatch)."""

from __future__ import annotations

from typing import List, Optional

import torch

__all__ = ["EPHandle"]


class EPHandle:
    """What :meth:`ElasticBuffer.dispatch` returns for :meth:`~ElasticBuffer.combine` and cached dispatch.

    V2's fields:
        do_expand, num_experts, expert_alignment, num_max_tokens_per_rank, num_sms (as passed; unused here).
        topk_idx: the dispatching rank's `[num_tokens, num_topk]` top-k (a clone with ``do_handle_copy``).
        num_recv_tokens: received rows (the worst case ``num_max_tokens_per_rank * num_ranks`` without CPU sync).
        num_expanded_tokens: rows of the expanded layout (worst case without CPU sync); 0 when not expanded.
        num_recv_tokens_per_expert_list: Python list, per local expert, of received selections rounded up to
            ``expert_alignment`` (``None`` without CPU sync).
        psum_num_recv_tokens_per_scaleup_rank: `[num_ranks]` int32, inclusive prefix sum of rows received
            from each source rank (a token counts once per rank); the last entry is the number received.
        psum_num_recv_tokens_per_expert: `[L]` int32. Not expanded: inclusive prefix sum of the aligned
            per-expert counts. Expanded: ``align(psum[i-1]) + count[i]`` (start of expert ``i``'s block plus its
            real count), so ``align(psum[i], expert_alignment)`` is where expert ``i+1`` starts.
        num_unaligned_recv_tokens_per_expert: `[L]` int32 real counts (expanded mode only, else ``None``).
        recv_src_metadata: `[num_recv_tokens, 2 + num_topk]` int64: column 0 the source global token index
            ``src_rank * num_max_tokens_per_rank + token`` (-1 on worst-case padding rows), column 1 the
            source rank, columns ``2 + k`` the row of ``recv_x`` that carries selection ``k`` (the same row when
            not expanded, its expanded row otherwise; -1 where the expert is not on this rank).
        dst_buffer_slot_idx: `[num_tokens, num_topk]` int32 (DeepEP V2's non-hybrid layout): at the first
            selection of each destination rank in a token's top-k, ``rank * num_max_tokens_per_rank + j`` (``j``:
            the tokens this rank sent to that destination before this one); -1 at the other selections.
        token_metadata_at_forward, channel_linked_list: V2's hybrid-mode internals with no counterpart here
            (``None``).

    Extensions: ``m_indices`` (`[num_expanded_tokens]` int32, local expert of each expanded row, -1 on
    padding; ``None`` when not expanded; built from the psum on first read),
    ``recv_topk_idx`` (`[num_recv_tokens, num_topk]` local / -1).
    """

    def __init__(self, do_expand: bool, num_experts: int, expert_alignment: int, num_max_tokens_per_rank: int,
                 num_sms: int, topk_idx: torch.Tensor, num_recv_tokens: int, num_expanded_tokens: int,
                 num_recv_tokens_per_expert_list: Optional[list],
                 psum_num_recv_tokens_per_scaleup_rank: torch.Tensor, psum_num_recv_tokens_per_expert: torch.Tensor,
                 num_unaligned_recv_tokens_per_expert: Optional[torch.Tensor], recv_src_metadata: torch.Tensor,
                 dst_buffer_slot_idx: Optional[torch.Tensor] = None,
                 token_metadata_at_forward: Optional[torch.Tensor] = None,
                 channel_linked_list: Optional[torch.Tensor] = None):
        self.do_expand = do_expand
        self.num_experts = num_experts
        self.expert_alignment = expert_alignment
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_sms = num_sms
        self.topk_idx = topk_idx
        self.num_recv_tokens = num_recv_tokens
        self.num_expanded_tokens = num_expanded_tokens
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        self.psum_num_recv_tokens_per_scaleup_rank = psum_num_recv_tokens_per_scaleup_rank
        self.psum_num_recv_tokens_per_expert = psum_num_recv_tokens_per_expert
        self.num_unaligned_recv_tokens_per_expert = num_unaligned_recv_tokens_per_expert
        self.recv_src_metadata = recv_src_metadata
        self.dst_buffer_slot_idx = dst_buffer_slot_idx
        self.token_metadata_at_forward = token_metadata_at_forward
        self.channel_linked_list = channel_linked_list
        # this implementation's state
        self._m_indices: Optional[torch.Tensor] = None
        self.recv_topk_idx: Optional[torch.Tensor] = None
        self._owner: Optional[int] = None
        self._buffer_handle = None
        self._slot: Optional[torch.Tensor] = None  # [M, K] row of the expanded layout per selection, -1 none
        self._exp_src: Optional[torch.Tensor] = None  # [num_expanded] received row of each expanded row, -1 pad
        self._exp_k: Optional[torch.Tensor] = None  # [num_expanded] top-k slot of each expanded row
        # expanded combine plan (ElasticBuffer._combine_plan / _sum_expanded): _comb_src [M, min(K, L)] the
        # expanded rows of each received row's selections, k ascending, packed to the left (-1 after them);
        # with host-known counts (a CPU-synced handle) also _comb_order (received rows by selection count,
        # descending), _comb_sorted_src (_comb_src in that order) and _comb_rows[j] (rows with more than j
        # selections); None otherwise
        self._comb_src: Optional[torch.Tensor] = None
        self._comb_order: Optional[torch.Tensor] = None
        self._comb_sorted_src: Optional[torch.Tensor] = None
        self._comb_rows: Optional[List[int]] = None
        self._hidden = 0

    @property
    def m_indices(self) -> Optional[torch.Tensor]:
        """Expanded handles: `[num_expanded_tokens]` int32 local expert of each expanded row, -1 on padding (the
        grouped GEMM's m_indices layout), built from ``psum_num_recv_tokens_per_expert`` on first read (the
        dispatch builds none: the expert GEMMs take the psum layout). ``None`` when not expanded."""
        if self._m_indices is None and self.do_expand:
            from .expand import m_indices_from_psum

            self._m_indices = m_indices_from_psum(self.psum_num_recv_tokens_per_expert, self.expert_alignment,
                                                  self.num_expanded_tokens)
        return self._m_indices

    @m_indices.setter
    def m_indices(self, value: Optional[torch.Tensor]) -> None:
        self._m_indices = value

    def deterministic_sort(self, do_cpu_sync: bool, is_cached_dispatch: bool, recv_x: torch.Tensor,
                           recv_sf: Optional[torch.Tensor], recv_topk_idx: Optional[torch.Tensor],
                           recv_topk_weights: Optional[torch.Tensor],
                           channel_linked_list: Optional[torch.Tensor] = None) -> None:
        """DeepEP V2's epilogue of ``deterministic=True``, in place: received rows sorted by the source's global token
        index (padding rows last). Not expanded: ``recv_x``, ``recv_sf``, ``recv_topk_idx``, ``recv_topk_weights``
        and (not cached) ``recv_src_metadata``. Expanded (not cached): the rows inside each expert's block
        (``recv_x``, ``recv_sf``, ``recv_topk_weights``), and the slot columns ``recv_src_metadata[:, 2:]`` (with this
        handle's combine plan) follow them. This implementation receives in that order already, so the sort finds
        the identity; it is kept for code that calls it. ``channel_linked_list``: V2's hybrid-mode state (none
        here; ignored)."""
        del do_cpu_sync, channel_linked_list
        meta = self.recv_src_metadata
        big = torch.iinfo(torch.int64).max
        gidx = meta[:, 0].to(torch.int64)
        if not self.do_expand:
            order = torch.sort(torch.where(gidx >= 0, gidx, big), stable=True).indices
            for t in (recv_x, recv_sf, recv_topk_idx, recv_topk_weights):
                if t is not None:
                    t.copy_(t[order])
            if not is_cached_dispatch:
                meta.copy_(meta[order])
                if self.recv_topk_idx is not None and self.recv_topk_idx is not recv_topk_idx:
                    self.recv_topk_idx.copy_(self.recv_topk_idx[order])
            return
        if is_cached_dispatch or self._exp_src is None:
            return  # a cached dispatch writes rows where the (already sorted) slots say
        rows = self._exp_src.shape[0]
        dev = self._exp_src.device
        psum = self.psum_num_recv_tokens_per_expert.to(torch.int64)
        a = self.expert_alignment
        starts = torch.cat([torch.zeros(1, dtype=torch.int64, device=dev), (psum[:-1] + a - 1) // a * a])
        block = torch.searchsorted(starts, torch.arange(rows, device=dev), right=True) - 1
        src = self._exp_src.to(torch.int64)
        key_tok = torch.where(src >= 0, gidx[src.clamp(min=0)], gidx.numel() and gidx.max() + 1)
        span = int(key_tok.max()) + 2 if rows else 1
        order = torch.sort(block * span + key_tok, stable=True).indices
        if bool((order == torch.arange(rows, device=dev)).all()):
            return
        inv = torch.empty_like(order)
        inv[order] = torch.arange(rows, device=dev)
        for t in (recv_x, recv_sf, recv_topk_weights):
            if t is not None:
                t.copy_(t[order])
        remap = lambda s: torch.where(s >= 0, inv[s.clamp(min=0)].to(s.dtype), s)  # noqa: E731
        meta[:, 2:] = remap(meta[:, 2:])
        self._exp_src, self._exp_k = self._exp_src[order], self._exp_k[order]
        for name in ("_slot", "_comb_src", "_comb_sorted_src"):
            if getattr(self, name) is not None:
                setattr(self, name, remap(getattr(self, name)))
        self._m_indices = None  # rebuilt from the psum on the next read
