"""The expanded combine of :class:`moe_ep.ElasticBuffer` with one rounding (``allow_multiple_reduction=False``,
vLLM's default): every expanded row of a token is reduced in one float32 sum, cast once.

Each rank sums its expanded rows per received token in float32 (k ascending) and sends those float32 partials
(with the reduced top-k weights as extra columns) straight back to their source ranks (one ``all_to_all_single``
over the group); the source adds the bias terms, then the partials in ascending rank order, in float32, and casts
once. It synchronises with the host (the per-rank row counts), as the CPU-synced expanded dispatch it follows."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["combine_one_rounding"]


def _partials(x: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """`[M, H]` float32: per received row, the sum of its expanded rows ``src[m, :]`` (-1: none), k ascending."""
    acc = torch.zeros(src.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for j in range(src.shape[1]):
        col = src[:, j]
        acc.add_(torch.where((col >= 0).unsqueeze(1), x.index_select(0, col.clamp(min=0)).float(), 0.0))
    return acc


def combine_one_rounding(x: torch.Tensor, handle, w_rows: Optional[torch.Tensor], biases: tuple, group):
    """``(combined_x [N, H] of x's dtype, combined_topk_weights [N, K] float32 or None)`` for an expanded handle;
    ``w_rows``: `[M, K]` float32 weights per received row (0 where the expert is not on this rank)."""
    world = dist.get_world_size(group)
    hidden = handle._hidden
    payload = _partials(x, handle._comb_src)
    if w_rows is not None:
        payload = torch.cat([payload, w_rows.float()], dim=1)
    meta = handle.recv_src_metadata
    real = meta[:, 0] >= 0  # worst-case padding rows carry nothing back
    src_rank = meta[:, 1].to(torch.int64)
    # received rows are ordered by global token index (source rank first): one contiguous run per source
    send = payload[real].contiguous()
    send_counts = torch.bincount(src_rank[real], minlength=world).tolist()
    in_rank = handle._buffer_handle.is_token_in_rank
    recv_counts = in_rank.sum(0).tolist()
    recv = torch.empty(sum(recv_counts), payload.shape[1], dtype=torch.float32, device=x.device)
    dist.all_to_all_single(recv, send, output_split_sizes=recv_counts, input_split_sizes=send_counts, group=group)
    total = torch.zeros(in_rank.shape[0], payload.shape[1], dtype=torch.float32, device=x.device)
    for b in biases:
        total[:, :hidden] += b.float()
    at = 0
    for d in range(world):  # ascending rank order; each rank's rows arrive in token order, one row per token
        tokens = torch.nonzero(in_rank[:, d]).flatten()
        total.index_add_(0, tokens, recv[at:at + len(tokens)])
        at += len(tokens)
    combined = total[:, :hidden].add_(0.0).to(x.dtype)
    return combined, (total[:, hidden:].contiguous() if w_rows is not None else None)
