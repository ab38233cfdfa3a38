"""Dispatch-time replica choice: logical top-k expert ids to physical slots.

Every policy is a fixed sequence of torch ops on fixed shapes (no ``.item()``, no ``nonzero``, no
data-dependent output size), so it runs on CPU and GPU and can be captured in a CUDA graph.

- ``static``: always the expert's first replica.
- ``random``: a replica drawn by a counter-based hash of (token, k, seed); deterministic given the
  seed, identical on CPU and GPU. ``seed`` may be a 0-dim int64 tensor (vary it inside a graph).
- ``round_robin``: the j-th selection of an expert in this batch (token-major order) goes to replica
  ``(j + seed) % logcnt``.
- ``balanced``: books the load of single-replica experts on their GPUs first, then splits every
  replicated expert's selections over its replicas by damped water-filling on the GPU loads
  (``iters`` rounds, all experts at once), hands out the j-th selection of an expert to the replica
  whose cumulative share covers j, and keeps that only if its busiest GPU, counted in whole
  selections, carries no more than with the even split (the j-th of an expert's c selections to
  replica ``j * n // c``: each of its n replicas gets floor(c / n) or ceil(c / n)). So ``balanced`` is
  never worse than that even split, exactly, for every batch.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

__all__ = ["map_topk", "replica_shares", "POLICIES"]

POLICIES = ("static", "random", "round_robin", "balanced")


def _check(topk_idx, log2phy, logcnt):
    for name, t in (("topk_idx", topk_idx), ("log2phy", log2phy), ("logcnt", logcnt)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{name} must be int64 (or int32), got {t.dtype}")
    if topk_idx.dim() != 2:
        raise ValueError(f"topk_idx must be 2D [num_tokens, topk], got shape {tuple(topk_idx.shape)}")
    if log2phy.dim() != 2:
        raise ValueError(f"log2phy must be one layer's [num_experts, max_replicas], got shape {tuple(log2phy.shape)}")
    if logcnt.dim() != 1 or logcnt.shape[0] != log2phy.shape[0]:
        raise ValueError(f"logcnt must be [num_experts={log2phy.shape[0]}], got shape {tuple(logcnt.shape)}")
    if not (topk_idx.device == log2phy.device == logcnt.device):
        raise ValueError(f"topk_idx, log2phy and logcnt must share a device, got {topk_idx.device}, "
                         f"{log2phy.device}, {logcnt.device}")


def _rank_in_expert(flat: torch.Tensor, num_experts: int):
    """Per selection, its index among the batch's selections of the same expert; and per-expert counts."""
    sorted_ids, perm = torch.sort(flat, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    starts = torch.cumsum(counts, 0) - counts
    rank_sorted = torch.arange(flat.numel(), device=flat.device) - starts[sorted_ids]
    rank = torch.empty_like(flat).scatter_(0, perm, rank_sorted)
    return rank, counts


def _hash(x: torch.Tensor) -> torch.Tensor:
    # A 31-bit integer mix (lowbias32-style on int64 arithmetic), identical on every device.
    m = 0x7FFFFFFF
    x = x & m
    x = ((x >> 16) ^ x) * 0x45D9F3B & m
    x = ((x >> 16) ^ x) * 0x45D9F3B & m
    return (x >> 16) ^ x


def replica_shares(counts: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor, num_gpus: int,
                   slots_per_gpu: int, iters: int = 8) -> torch.Tensor:
    """Selections per replica for the ``balanced`` policy.

    Arguments:
        counts: `[E]` float, this step's selections per logical expert.
        log2phy: `[E, X]` int64 slots (-1 padded); logcnt: `[E]` int64.
        num_gpus, slots_per_gpu: slot p lives on GPU ``p // slots_per_gpu``.
        iters: water-filling rounds.

    Returns:
        shares: `[E, X]` float32, non-negative, each row summing to ``counts``, 0 at padding.
    """
    E, X = log2phy.shape
    dev = counts.device
    valid = torch.arange(X, device=dev)[None, :] < logcnt[:, None]  # [E, X]
    gpu = torch.where(valid, log2phy.clamp_min(0) // slots_per_gpu, torch.zeros_like(log2phy))
    # One-hot replica -> GPU map `[E * X, G]`: GPU loads and their gather back are one matmul each.
    onehot = (gpu.reshape(-1, 1) == torch.arange(num_gpus, device=dev)[None, :]) & valid.reshape(-1, 1)
    onehot = onehot.to(torch.float32)
    cnt = logcnt.clamp_min(1).to(torch.float32)
    c = counts.to(torch.float32)[:, None]
    zero = torch.zeros((), device=dev)
    big = torch.full((), 3.0e38, device=dev)
    even = torch.where(valid, c / cnt[:, None], zero)
    k = torch.arange(1, X + 1, device=dev, dtype=torch.float32)[None, :]
    last = torch.full((E, 1), 3.0e38, device=dev)

    s = even
    for _ in range(iters):
        on_gpu = (onehot @ (s.reshape(1, -1) @ onehot).reshape(-1, 1)).view(E, X)  # load of each replica's GPU
        other = torch.where(valid, on_gpu - s, big)  # ... without this expert's share
        # Water level lam with sum_r max(0, lam - other_r) = c over the expert's replicas.
        o_sorted = torch.sort(other, dim=1).values
        lam_k = (c + torch.cumsum(torch.where(o_sorted < big, o_sorted, zero), 1)) / k  # level filling the k lowest
        ok = (lam_k <= torch.cat([o_sorted[:, 1:], last], 1)) & (o_sorted < big)
        lam = lam_k.gather(1, torch.argmax(ok.to(torch.int8), dim=1, keepdim=True))
        s = torch.lerp(s, torch.where(valid, (lam - other).clamp_min(0), zero), 0.5)  # damped: all experts move at once
    # Keep the balanced split only where it lowers the maximum GPU load (else the even split).
    better = (s.reshape(1, -1) @ onehot).max() < (even.reshape(1, -1) @ onehot).max()
    return torch.where(better, s, even)


def _busiest(log2phy, safe, rep, is_none, num_gpus: int, slots_per_gpu: int) -> torch.Tensor:
    """Selections on the busiest GPU (0-dim int64) when selection (n, k) goes to replica rep[n, k]."""
    gpu = torch.where(is_none, torch.full_like(rep, num_gpus), log2phy[safe, rep].clamp_min(0) // slots_per_gpu)
    per_gpu = torch.zeros(num_gpus + 1, dtype=torch.int64, device=rep.device)  # the last bin: no expert
    per_gpu.scatter_add_(0, gpu.reshape(-1), torch.ones_like(gpu).reshape(-1))
    return per_gpu[:num_gpus].max()


def map_topk(topk_idx: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor, policy: str = "static", *,
             seed: Union[int, torch.Tensor] = 0, num_gpus: Optional[int] = None, num_slots: Optional[int] = None,
             iters: int = 8) -> torch.Tensor:
    """Map logical expert ids to physical slots (replicas) for one MoE layer.

    Arguments:
        topk_idx: `[num_tokens, topk]` with `torch.int64`, logical expert ids, -1 = no expert.
        log2phy: `[num_experts, max_replicas]` with `torch.int64`, one layer of `rebalance_experts`'s
            ``log2phy`` (slots, -1 padded); logcnt: `[num_experts]` with `torch.int64`.
        policy: ``"static"``, ``"random"``, ``"round_robin"`` or ``"balanced"`` (see the module doc).
        seed: int or 0-dim int64 tensor on the device; ``random`` and ``round_robin`` depend on it.
        num_gpus, num_slots: required by ``balanced`` (slot p lives on GPU ``p // (num_slots // num_gpus)``).
        iters: water-filling rounds of ``balanced``.

    Returns:
        phy_idx: `[num_tokens, topk]` with `torch.int64`, physical slot ids, -1 where ``topk_idx`` is -1.
    """
    _check(topk_idx, log2phy, logcnt)
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    N, K = topk_idx.shape
    E, X = log2phy.shape
    dev = topk_idx.device
    log2phy, logcnt = log2phy.long(), logcnt.long()
    ids = topk_idx.long()
    is_none = ids < 0
    safe = torch.where(is_none, torch.zeros_like(ids), ids)
    cnt = logcnt.clamp_min(1)[safe]  # [N, K]
    if policy == "static":
        rep = torch.zeros_like(ids)
    elif policy == "random":
        base = torch.arange(N * K, device=dev, dtype=torch.int64).view(N, K)
        rep = _hash(_hash(base + torch.as_tensor(seed, device=dev, dtype=torch.int64) * 0x9E3779B1)) % cnt
    else:
        flat = torch.where(is_none, torch.full_like(ids, E), ids).reshape(-1)
        rank, counts = _rank_in_expert(flat, E)
        rank = rank.view(N, K)
        if policy == "round_robin":
            rep = (rank + torch.as_tensor(seed, device=dev, dtype=torch.int64)) % cnt
        else:
            if num_gpus is None or num_slots is None:
                raise ValueError("policy='balanced' needs num_gpus= and num_slots= "
                                 "(slot p is on GPU p // (num_slots // num_gpus))")
            if num_slots % num_gpus != 0:
                raise ValueError(f"num_slots={num_slots} must be divisible by num_gpus={num_gpus}")
            spg = num_slots // num_gpus
            shares = replica_shares(counts[:E].to(torch.float32), log2phy, logcnt, num_gpus, spg, iters)
            # Replica r of expert e takes the selections j with cum[r-1] <= j + 0.5 < cum[r].
            cum = torch.cumsum(shares, 1)[safe]  # [N, K, X]
            rep = ((rank.to(torch.float32) + 0.5)[..., None] >= cum).sum(-1)
            rep = torch.minimum(rep, cnt - 1)
            # The even split in whole selections: the j-th of an expert's c selections goes to replica
            # j * n // c, so each of its n replicas gets floor(c / n) or ceil(c / n). Rounding the
            # balanced shares to whole selections can cost a token on the busiest GPU, so keep them only
            # where the busiest GPU is not above the even split's (exact integer counts, no host sync).
            even = torch.where(is_none, torch.zeros_like(rank), rank * cnt // counts[safe].clamp_min(1))
            rep = torch.where(_busiest(log2phy, safe, rep, is_none, num_gpus, spg)
                              <= _busiest(log2phy, safe, even, is_none, num_gpus, spg), rep, even)
    phy = log2phy[safe, rep]
    return torch.where(is_none, torch.full_like(phy, -1), phy)
