"""Node-aware normal-mode dispatch/combine for the ``torch`` backend: a token crosses nodes at most once
per destination node, then fans out inside it; combine reduces inside the node, then crosses once.

Ranks form ``H`` nodes of ``G = ranks_per_node`` consecutive ranks (:func:`moe_ep.collectives.node_topology`).
Rank ``o = (h_o, g_o)`` sends token ``t`` once to every node ``h`` holding one of its experts, to the
*relay* ``(h, g_o)`` (same local index: the transfer runs in cross group ``g_o``); the relay forwards it
to the ranks of node ``h`` that need it (node group). When ``h == h_o`` the relay is ``o`` itself.

Wire formats (``uint8`` rows, as in :mod:`moe_ep.backends.torch_a2a`):

- stage 1 (cross-node) dispatch row: the flat row (``x`` | FP8 scales | ``topk_idx`` | ``topk_weights``)
  followed by ``G`` bytes: which local ranks of the destination node take the token;
- stage 2 (intra-node) dispatch row: the flat row;
- stage 2 combine row: the wire row of ``x`` (BF16 / FP16 ``2H``, or FP8 with ``combine_dtype``) | ``topk_weights``
  ``4K``; stage 1 combine row: the node's partial
  sum, ``H`` values of ``partial_dtype`` (float32 by default) | ``4K`` weights.

Outputs equal the flat path's: dispatch bitwise (rows in (source rank, token) order, same counts);
combine adds ``bias`` then the node partials in node order, each partial the sum of its node's rows in
rank order, in float32, cast once. That regroups the flat path's left-to-right float32 sum, so it is
bitwise equal when ``G == 1`` and otherwise within float32 reassociation (at most one BF16 rounding
step, i.e. 1 BF16 ulp, apart from cancellation; the weights are exact: one nonzero term per column).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ..collectives import node_topology
from .base import DispatchResult
from ..kernels.logfmt import decode_rows, encode_rows
from ..kernels.logfmt import row_bytes as wire_row_bytes
from .torch_a2a import TorchBackend, TorchDispatchHandle
from .torch_rows import _bytes, _from_bytes, layout_from_topk, localize_topk, pad_to_worst, unpack_rows

__all__ = ["TorchHierBackend"]


@dataclasses.dataclass
class HierDispatchHandle(TorchDispatchHandle):
    send1_idx: torch.Tensor = None  # [S1] token index of each cross-node row, ordered by destination node
    send1_counts: list = None  # [H] rows to each node (cross group)
    recv1_counts: list = None  # [H] rows from each node (this rank as relay)
    send2_idx: torch.Tensor = None  # [S2] stage-1 row forwarded, ordered by local destination rank
    send2_counts: list = None  # [G]
    recv2_counts: list = None  # [G] rows from each relay of this node
    perm: torch.Tensor = None  # [S2'] flat (source rank, token) position of each stage-2 received row


def _a2a_rows(send: torch.Tensor, recv_counts: list, send_counts: list, group) -> torch.Tensor:
    recv = torch.empty(sum(recv_counts), send.shape[1], dtype=send.dtype, device=send.device)
    if group is None:  # a one-rank stage: the rows stay here
        recv.copy_(send)
    else:
        dist.all_to_all_single(recv, send, output_split_sizes=recv_counts, input_split_sizes=send_counts, group=group)
    return recv


def _counts(send: torch.Tensor, group) -> torch.Tensor:
    """All-to-all of one int64 row per peer (`[n, c]`)."""
    if group is None:
        return send.clone()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


class TorchHierBackend(TorchBackend):
    """:class:`~moe_ep.backends.torch_a2a.TorchBackend` with node-aware normal mode (low-latency mode is
    inherited unchanged). Construct it on every rank in the same order (it creates subgroups).

    Arguments:
        ranks_per_node: ``G``, dividing the group size (nodes are blocks of consecutive ranks).
        partial_dtype: dtype of the node partial sums that cross nodes in combine (``torch.float32``
            keeps the flat path's numerics up to reassociation; ``torch.bfloat16`` halves the bytes and
            adds one BF16 rounding per node).
    """

    name = "torch_hier"

    def __init__(self, group, rank: int, world_size: int, *, ranks_per_node: int,
                 partial_dtype: torch.dtype = torch.float32, **kwargs):
        super().__init__(group, rank, world_size, **kwargs)
        if ranks_per_node < 1 or world_size % ranks_per_node:
            raise ValueError(f"ranks_per_node={ranks_per_node} must divide the group size {world_size}")
        if partial_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"partial_dtype must be torch.float32 or torch.bfloat16, got {partial_dtype}")
        self.topo = node_topology(group, ranks_per_node)
        self.partial_dtype = partial_dtype

    # ------------------------------------------------------------------ layout
    def get_dispatch_layout(self, topk_idx, num_experts):
        """As the flat backend, plus ``num_tokens_per_rdma_rank``: `[num_nodes]` int32, tokens this rank
        sends to each node (each crosses once per node)."""
        per_rank, per_expert, in_rank = layout_from_topk(topk_idx, num_experts, self.world_size)
        H, G = self.topo.num_nodes, self.topo.ranks_per_node
        per_node = in_rank.reshape(-1, H, G).any(2).sum(0, dtype=torch.int32)
        return per_rank, per_node, per_expert, in_rank

    # ------------------------------------------------------------------ normal mode
    def dispatch(self, x, x_scales, *, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                 topk_idx, topk_weights, num_experts, expert_alignment, num_worst_tokens):
        topo = self.topo
        H, G = topo.num_nodes, topo.ranks_per_node
        n, hidden = x.shape
        is_fp8 = x_scales is not None
        dev = x.device
        self.arrival.exchange("dispatch", {
            "hidden": hidden, "x": "fp8" if is_fp8 else str(x.dtype).replace("torch.", ""),
            "cached": handle is not None, "topk": "-" if topk_idx is None else topk_idx.shape[1],
            "num_experts": num_experts or "-", "ranks_per_node": G})
        cached = handle is not None
        # Step 1: pack one row per (token, destination node), ordered by node, then token.
        if cached:
            send1_idx, send1_counts = handle.send1_idx, handle.send1_counts
        else:
            in_node = is_token_in_rank.reshape(n, H, G)
            node_hit = in_node.any(2)  # [n, H]
            node_t, send1_idx = node_hit.t().nonzero(as_tuple=True)
            send1_counts = node_hit.sum(0).tolist()
        parts = [_bytes(x.index_select(0, send1_idx))]
        if is_fp8:
            parts.append(_bytes(x_scales.index_select(0, send1_idx)))
        if not cached:
            k = topk_idx.shape[1]
            parts += [_bytes(topk_idx.index_select(0, send1_idx)), _bytes(topk_weights.index_select(0, send1_idx)),
                      in_node[send1_idx, node_t].to(torch.uint8)]  # the G-byte fan-out mask
        send1 = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        flat_bytes = send1.shape[1] - (0 if cached else G)
        # Step 2: cross nodes once (cross group of this local index).
        if cached:
            recv1_counts = handle.recv1_counts
        else:
            recv1_counts = _counts(torch.tensor(send1_counts, dtype=torch.int64, device=dev).reshape(H, 1),
                                   topo.cross_group).reshape(-1).tolist()
        recv1 = _a2a_rows(send1, recv1_counts, send1_counts, topo.cross_group)
        # Step 3: fan out inside the node; rows to local rank g keep (source node, token) order.
        if cached:
            send2_idx, send2_counts, recv2_counts, perm = (handle.send2_idx, handle.send2_counts,
                                                           handle.recv2_counts, handle.perm)
        else:
            mask = recv1[:, flat_bytes:].bool()  # [S1', G]
            src_node = torch.repeat_interleave(torch.arange(H, device=dev),
                                               torch.tensor(recv1_counts, dtype=torch.int64, device=dev))
            dst_g, send2_idx = mask.t().nonzero(as_tuple=True)
            # counts per (local destination g, source node), so receivers can restore rank order
            cnt = torch.zeros(G, H, dtype=torch.int64, device=dev)
            cnt.index_put_((dst_g, src_node[send2_idx]), torch.ones_like(dst_g), accumulate=True)
            recv_cnt = _counts(cnt, topo.node_group)  # [G relays, H source nodes]
            send2_counts = cnt.sum(1).tolist()
            recv2_counts = recv_cnt.sum(1).tolist()
            perm, recv_counts_flat = self._restore_order(recv_cnt.cpu())  # NOTES: host synchronisation
            perm = perm.to(dev)
        recv2 = _a2a_rows(recv1[:, :flat_bytes].index_select(0, send2_idx), recv2_counts, send2_counts,
                          topo.node_group)
        # Step 4: rows back to the flat path's (source rank, token) order, then unpack as it does.
        recv = torch.empty_like(recv2)
        recv[perm] = recv2
        num_recv = recv.shape[0]
        recv_x, recv_scales, off = unpack_rows(recv, x.dtype, hidden, x_scales)
        recv_topk_idx = recv_topk_weights = None
        if not cached:
            num_local = num_experts // self.world_size
            recv_topk_idx, recv_topk_weights = localize_topk(recv, off, k, self.rank, num_local)
            if num_worst_tokens > 0:
                per_expert_list = []  # as the flat path, DeepEP and symm: no counts with num_worst_tokens
            else:
                valid = recv_topk_idx[recv_topk_idx >= 0]
                per_expert = torch.bincount(valid, minlength=num_local).tolist()
                per_expert_list = [(c + expert_alignment - 1) // expert_alignment * expert_alignment
                                   for c in per_expert]
        else:
            per_expert_list = handle.num_recv_tokens_per_expert_list
        # Step 5: worst-case padding (static output shapes for the caller), as the flat path.
        num_rows = num_worst_tokens if num_worst_tokens > 0 else num_recv
        recv_x, recv_scales, _, recv_topk_idx, recv_topk_weights = pad_to_worst(
            self.rank, num_recv, num_worst_tokens, recv_x, recv_scales, None, recv_topk_idx, recv_topk_weights)
        if not cached:
            handle = HierDispatchHandle(
                owner=id(self), num_tokens=n, num_recv_tokens=num_rows, hidden=hidden,
                is_token_in_rank=is_token_in_rank, num_tokens_per_rank=num_tokens_per_rank,
                recv_counts=recv_counts_flat, num_recv_tokens_per_expert_list=per_expert_list,
                send1_idx=send1_idx, send1_counts=send1_counts, recv1_counts=recv1_counts, send2_idx=send2_idx,
                send2_counts=send2_counts, recv2_counts=recv2_counts, perm=perm)
        elif num_rows != handle.num_recv_tokens:
            raise ValueError(f"cached dispatch received {num_rows} rows but the handle expects "
                             f"{handle.num_recv_tokens} (num_worst_tokens must match the original call)")
        return DispatchResult(recv_x.contiguous(), None if recv_scales is None else recv_scales.contiguous(),
                              recv_topk_idx, recv_topk_weights, list(per_expert_list), handle)

    def _restore_order(self, recv_cnt: torch.Tensor):
        """Stage-2 rows arrive ordered (relay g, source node h, token); the flat order is source rank
        ``h*G + g``, then token. Returns ``(perm [S], recv_counts per source rank)``: received row ``i``
        goes to flat position ``perm[i]``."""
        G, H = recv_cnt.shape
        c = recv_cnt.tolist()
        flat_counts = [c[r % G][r // G] for r in range(G * H)]
        flat_start = [0] * (G * H)
        for r in range(1, G * H):
            flat_start[r] = flat_start[r - 1] + flat_counts[r - 1]
        pieces = [torch.arange(flat_start[h * G + g], flat_start[h * G + g] + c[g][h]) for g in range(G) for h in range(H)]
        perm = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)
        return perm, flat_counts

    def combine(self, x, handle, topk_weights, bias, fmt=None):
        """As the flat backend's: ``x`` BF16 or FP16 (the output has its dtype), ``fmt`` the stage-2 wire format of
        the rows (``FMT_FP8``: 1x128 FP8 rows as the flat path's ``encode_rows``; default: ``x``'s 16-bit dtype)."""
        topo = self.topo
        hidden, n = handle.hidden, handle.num_tokens
        num_valid = sum(handle.recv_counts)
        fmt = self._combine_arrive(x, hidden, topk_weights, fmt)
        # Step 1: rows back to their relays (reverse of the fan-out), in stage-2 receive order.
        rb = wire_row_bytes(fmt, hidden)
        parts = [encode_rows(x[:num_valid].index_select(0, handle.perm), fmt)]
        k = 0
        if topk_weights is not None:
            k = topk_weights.shape[1]
            parts.append(_bytes(topk_weights[:num_valid].index_select(0, handle.perm)))
        send = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        back2 = _a2a_rows(send, handle.send2_counts, handle.recv2_counts, topo.node_group)
        # Step 2: the relay sums its node's rows per stage-1 row, local rank ascending, in float32.
        # NOTES: index_add_ of one block per local rank pins that order (a row appears once per block).
        num_rows1 = sum(handle.recv1_counts)
        part = torch.zeros(num_rows1, hidden + k, dtype=torch.float32, device=x.device)
        rows = decode_rows(back2[:, :rb], fmt, hidden).float()
        if k:
            rows = torch.cat([rows, _from_bytes(back2[:, rb:], torch.float32, k)], dim=1)
        start = 0
        for cnt in handle.send2_counts:
            part.index_add_(0, handle.send2_idx[start:start + cnt], rows[start:start + cnt])
            start += cnt
        # Step 3: one partial per (token, node) crosses back to the token's rank.
        pdt = self.partial_dtype
        send1 = _bytes(part[:, :hidden].to(pdt))
        if k:
            send1 = torch.cat([send1, _bytes(part[:, hidden:])], dim=1)
        back1 = _a2a_rows(send1, handle.send1_counts, handle.recv1_counts, topo.cross_group)
        pb = hidden * pdt.itemsize
        partials = _from_bytes(back1[:, :pb], pdt, hidden).float()
        # Step 4: bias first, then the node partials in node order, float32, one cast.
        acc = torch.zeros(n, hidden, dtype=torch.float32, device=x.device)
        for b in bias:
            acc += b.float()
        w_acc = torch.zeros(n, k, dtype=torch.float32, device=x.device) if k else None
        wrows = _from_bytes(back1[:, pb:], torch.float32, k) if k else None
        start = 0
        for cnt in handle.send1_counts:
            idx = handle.send1_idx[start:start + cnt]
            acc.index_add_(0, idx, partials[start:start + cnt])
            if w_acc is not None:
                w_acc.index_add_(0, idx, wrows[start:start + cnt])
            start += cnt
        return acc.to(x.dtype), w_acc
