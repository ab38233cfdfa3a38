"""The layout of a ``topk_idx`` (tokens per rank, tokens per expert, which rank gets each token), shared by the
input checks (:mod:`moe_ep.validate`) and the ``torch`` backends (:mod:`moe_ep.backends.torch_rows`), and the
switch that sends host tensors' routing bookkeeping to numpy (:func:`_on_host`).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["layout_from_topk"]


# Routing bookkeeping of host tensors takes numpy: a torch op costs ~5 us at routing sizes, a numpy one ~1 (same
# values: tests hold the two paths equal). moe_ep.testing.traps turns it off while host reads are trapped: there CPU
# tensors stand in for device memory, and the path checked must be the device's.
host_numpy = True


def _on_host(t: torch.Tensor) -> bool:
    return host_numpy and t.device.type == "cpu"


def layout_from_topk(topk_idx: torch.Tensor, num_experts: int, world_size: int):
    """Device-side layout: ``(num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32,
    is_token_in_rank [N, R] bool)``; no host synchronisation (host tensors: numpy, :func:`_on_host`)."""
    if _on_host(topk_idx):
        return _layout_host(topk_idx, num_experts, world_size)
    return _layout_torch(topk_idx, num_experts, world_size)


def _layout_host(topk_idx: torch.Tensor, num_experts: int, world_size: int):
    a = topk_idx.numpy()
    n, num_local = a.shape[0], num_experts // world_size
    valid = a >= 0
    hit = np.zeros((n, world_size + 1), dtype=np.bool_)  # column 0 collects the -1 holes and is dropped
    hit[np.arange(n)[:, None], np.where(valid, a // num_local + 1, 0)] = True  # an id >= E: IndexError here
    in_rank = np.ascontiguousarray(hit[:, 1:])
    per_expert = np.bincount(np.where(valid, a + 1, 0).ravel(), minlength=num_experts + 1)[1:]
    return (torch.from_numpy(in_rank.sum(0, dtype=np.int32)), torch.from_numpy(per_expert.astype(np.int32)),
            torch.from_numpy(in_rank))


def _layout_torch(topk_idx: torch.Tensor, num_experts: int, world_size: int):
    n, num_local = topk_idx.shape[0], num_experts // world_size
    valid = topk_idx >= 0
    # Column 0 collects the -1 holes and is dropped.
    rank_col = torch.where(valid, topk_idx // num_local + 1, torch.zeros_like(topk_idx))
    hit = torch.zeros(n, world_size + 1, dtype=torch.int32, device=topk_idx.device)
    hit.scatter_(1, rank_col, 1)
    is_token_in_rank = hit[:, 1:].bool()
    expert_col = torch.where(valid, topk_idx + 1, torch.zeros_like(topk_idx)).flatten()
    per_expert = torch.zeros(num_experts + 1, dtype=torch.int32, device=topk_idx.device)
    per_expert.scatter_add_(0, expert_col, torch.ones_like(expert_col, dtype=torch.int32))
    return is_token_in_rank.sum(0, dtype=torch.int32), per_expert[1:].contiguous(), is_token_in_rank
