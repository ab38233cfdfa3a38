"""Dispatch-time replica choice: logical top-k expert ids to physical slots, with failover.

Every policy is a fixed sequence of ops on fixed shapes (no ``.item()``, no ``nonzero``, no
data-dependent output size), so it runs on CPU and GPU and can be captured in a CUDA graph. On CUDA
the mapping runs on many CTAs in Triton (`eplb.kernels.map_topk_triton`: one gather launch for ``static`` /
``random``, three launches for the ranked policies); the torch path here is the
reference and the CPU implementation, and the two agree bitwise (all arithmetic is integer).

Failover: ``slot_mask`` (`[num_slots]` bool or int, nonzero = live; a device tensor, so it may change
between CUDA-graph replays) restricts every policy to an expert's *live* replicas, in slot order. A
selection whose expert has no live replica maps to -1 and is counted in ``lost_out``.

- ``static``: always the expert's first live replica.
- ``random``: a live replica drawn by a counter-based hash of (token, k, seed); deterministic given the
  seed, identical on CPU and GPU. ``seed`` may be a 0-dim int64 tensor (vary it inside a graph).
- ``round_robin`` (the default): the j-th selection of an expert in this batch (token-major order) goes
  to live replica ``(j + seed + rank) mod live_count``.
- ``balanced``: splits every expert's selections over its live replicas by damped water-filling on
  the GPU loads (``iters`` rounds, all experts at once, in fixed point: 1/2^20 selection units, int64,
  so every sum is exact and independent of reduction order), hands out the j-th selection of an expert
  to the replica whose cumulative share covers j, and keeps that only if its busiest GPU, counted in
  whole selections, carries no more than with the even split (the j-th of an expert's c selections to
  live replica ``j * n // c``). So ``balanced`` is never worse than that even split, exactly. Each
  expert's live replicas are taken in an order rotated by ``(seed + rank + expert) mod live_count``:
  ranks that each map only their own few tokens (32 per rank at EP144 decode) balance them against
  different replicas instead of all breaking ties (and the even split) towards the same ones.

``rank=`` (this rank's index in the EP group) makes ``random``, ``round_robin`` and ``balanced`` start
from rank-dependent replicas without any communication or host read (``rank=0``, the default, adds
nothing). As deployed, per rank at EP144 / 288 slots, ``balanced`` is then at least ``round_robin``
(perf/bench_eplb.py's per-rank table; README).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

__all__ = ["map_topk", "replica_shares", "live_replicas", "POLICIES", "IMPLS", "SCALE"]

POLICIES = ("static", "random", "round_robin", "balanced")
IMPLS = ("auto", "torch", "triton")
SCALE = 1 << 20  # fixed-point unit of ``balanced``'s shares: 1/SCALE of a selection
BIG = 1 << 62  # "no replica" sentinel of the water-filling (sorts last)


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


def _check_mask(slot_mask, device):
    if not isinstance(slot_mask, torch.Tensor):
        raise TypeError(f"slot_mask must be a torch.Tensor, got {type(slot_mask).__name__}")
    if slot_mask.dim() != 1:
        raise ValueError(f"slot_mask must be 1D [num_slots], got shape {tuple(slot_mask.shape)}")
    if slot_mask.dtype.is_floating_point or slot_mask.dtype.is_complex:
        raise TypeError(f"slot_mask must be bool or integer, got {slot_mask.dtype}")
    if slot_mask.device != device:
        raise ValueError(f"slot_mask must be on {device}, got {slot_mask.device}")


def live_replicas(log2phy: torch.Tensor, logcnt: torch.Tensor, slot_mask: Optional[torch.Tensor] = None,
                  width: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert's live replicas, compacted in slot order.

    Arguments:
        log2phy: `[E, X]` slots (-1 padded); logcnt: `[E]`; slot_mask: `[num_slots]` bool/int (nonzero =
            live) or None (all live); width: replicas considered (the first ``width`` columns; default X).

    Returns:
        live2phy: `[E, width]` int64, the live slots first, -1 after; livecnt: `[E]` int64.
    """
    E, X = log2phy.shape
    R = X if width is None else max(1, min(int(width), X))
    l2p = log2phy[:, :R].long()
    valid = (torch.arange(R, device=l2p.device)[None, :] < logcnt.long()[:, None]) & (l2p >= 0)
    if slot_mask is not None:
        valid &= slot_mask[l2p.clamp_min(0)] != 0
    livecnt = valid.sum(1)
    pos = torch.where(valid, torch.cumsum(valid, 1) - 1, torch.full_like(l2p, R))
    live2phy = torch.full((E, R + 1), -1, dtype=torch.int64, device=l2p.device)
    live2phy.scatter_(1, pos, torch.where(valid, l2p, torch.full_like(l2p, -1)))
    return live2phy[:, :R], livecnt


def _rank_in_expert(flat: torch.Tensor, num_experts: int):
    """Per selection, its index among the batch's selections of the same expert; and per-expert counts."""
    n = flat.numel()
    # Unique keys (expert, position): an unstable sort is the stable one, and faster.
    key = flat * n + torch.arange(n, device=flat.device)
    perm = torch.argsort(key)
    counts = torch.bincount(flat, minlength=num_experts + 1) if flat.device.type == "cpu" else \
        torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    starts = torch.cumsum(counts, 0) - counts
    rank_sorted = torch.arange(n, device=flat.device) - starts[flat[perm]]
    rank = torch.empty_like(flat).scatter_(0, perm, rank_sorted)
    return rank, counts


def _hash(x: torch.Tensor) -> torch.Tensor:
    # A 31-bit integer mix (lowbias32-style on int64 arithmetic), identical on every device.
    m = 0x7FFFFFFF
    x = x & m
    x = ((x >> 16) ^ x) * 0x45D9F3B & m
    x = ((x >> 16) ^ x) * 0x45D9F3B & m
    return (x >> 16) ^ x


def _gpu_sums(gpu: torch.Tensor, s: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """Per-GPU sums of ``s`` over replicas on GPU ``gpu`` (bin ``num_gpus`` = no replica), int64, exact."""
    out = torch.zeros(num_gpus + 1, dtype=torch.int64, device=s.device)
    return out.scatter_add_(0, gpu.reshape(-1), s.reshape(-1))


def replica_shares(counts: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor, num_gpus: int,
                   slots_per_gpu: int, iters: int = 8, slot_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Selections per replica for the ``balanced`` policy (`[E, X]` float32, 0 at padding and dead replicas;
    ``counts`` `[E]` are rounded to whole selections). The live replicas of each expert come first, in
    slot order (see `live_replicas`); with no ``slot_mask`` that is ``log2phy``'s order."""
    live2phy, livecnt = live_replicas(log2phy, logcnt, slot_mask)
    fx = _shares_fx(torch.round(counts.double()).long(), live2phy, livecnt, num_gpus, slots_per_gpu, iters)
    return (fx.double() / SCALE).float()


def _shares_fx(counts: torch.Tensor, live2phy: torch.Tensor, livecnt: torch.Tensor, num_gpus: int,
               slots_per_gpu: int, iters: int = 8) -> torch.Tensor:
    """Selections per live replica for the ``balanced`` policy, in fixed point (units of 1/SCALE).

    Arguments:
        counts: `[E]` int64, this step's selections per logical expert.
        live2phy: `[E, R]` int64 live slots (-1 padded), livecnt: `[E]` int64 (see `live_replicas`).
        num_gpus, slots_per_gpu: slot p lives on GPU ``p // slots_per_gpu``.
        iters: water-filling rounds.

    Returns:
        shares: `[E, R]` int64, non-negative, 0 at padding; each row sums to ``counts * SCALE`` up to
        rounding (at most R units short).

    All arithmetic is int64, so the Triton kernel reproduces it bitwise whatever its reduction order.
    """
    E, R = live2phy.shape
    dev = live2phy.device
    valid = torch.arange(R, device=dev)[None, :] < livecnt[:, None]
    gpu = torch.where(valid, live2phy.clamp_min(0) // slots_per_gpu, torch.full_like(live2phy, num_gpus))
    zero = torch.zeros((), dtype=torch.int64, device=dev)
    big = torch.full((), BIG, dtype=torch.int64, device=dev)
    c = counts.long()[:, None] * SCALE
    even = torch.where(valid, c // livecnt.clamp_min(1)[:, None], zero)
    k = torch.arange(1, R + 1, device=dev, dtype=torch.int64)[None, :]
    last = torch.full((E, 1), BIG, dtype=torch.int64, device=dev)
    s = even
    for _ in range(iters):
        other = torch.where(valid, _gpu_sums(gpu, s, num_gpus)[gpu] - s, big)  # GPU load without this expert
        # Water level lam with sum_r max(0, lam - other_r) ~= c over the expert's live replicas.
        o_sorted = torch.sort(other, dim=1).values
        lam_k = (c + torch.cumsum(torch.where(o_sorted < big, o_sorted, zero), 1)) // k  # level over the k lowest
        ok = (lam_k <= torch.cat([o_sorted[:, 1:], last], 1)) & (o_sorted < big)
        lam = lam_k.gather(1, torch.argmax(ok.to(torch.int8), dim=1, keepdim=True))
        s = (s + torch.where(valid, (lam - other).clamp_min(0), zero)) >> 1  # damped: all experts move at once
    # Keep the balanced split only where it lowers the maximum GPU load (else the even split).
    better = _gpu_sums(gpu, s, num_gpus)[:num_gpus].max() < _gpu_sums(gpu, even, num_gpus)[:num_gpus].max()
    return torch.where(better, s, even)


def _busiest(live2phy, safe, rep, off, num_gpus: int, slots_per_gpu: int) -> torch.Tensor:
    """Selections on the busiest GPU (0-dim int64) when selection (n, k) goes to live replica rep[n, k]."""
    gpu = torch.where(off, torch.full_like(rep, num_gpus), live2phy[safe, rep].clamp_min(0) // slots_per_gpu)
    per_gpu = torch.zeros(num_gpus + 1, dtype=torch.int64, device=rep.device)  # the last bin: no expert / lost
    per_gpu.scatter_add_(0, gpu.reshape(-1), torch.ones_like(gpu).reshape(-1))
    return per_gpu[:num_gpus].max()


def _rotate(live2phy: torch.Tensor, livecnt: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Each expert's live replicas rotated left by ``offset`` (`[E]` or a scalar) modulo its live count,
    -1 padding kept: row e becomes ``live[(r + offset[e]) % livecnt[e]]`` for r < livecnt[e]."""
    R = live2phy.shape[1]
    cols = torch.arange(R, device=live2phy.device)[None, :]
    n = livecnt.clamp_min(1)[:, None]
    src = (cols + offset.reshape(-1, 1) % n) % n
    return torch.where(cols < livecnt[:, None], live2phy.gather(1, src), torch.full_like(live2phy, -1))


def _map_torch(ids, log2phy, logcnt, policy, seed, num_gpus, num_slots, iters, slot_mask, width, ep_rank=0):
    N, K = ids.shape
    E = log2phy.shape[0]
    dev = ids.device
    live2phy, livecnt = live_replicas(log2phy, logcnt, slot_mask, width)
    seed_t = torch.as_tensor(seed, device=dev, dtype=torch.int64)
    if policy == "balanced":
        # Rank-dependent replica preference: ranks that map their own tokens independently start each
        # expert at a different replica (ties and the even split follow this order), not all at the
        # first; the expert id in the offset decorrelates the experts of one rank.
        live2phy = _rotate(live2phy, livecnt, seed_t + ep_rank + torch.arange(E, device=dev))
    is_none = ids < 0
    safe = torch.where(is_none, torch.zeros_like(ids), ids)
    lc = livecnt[safe]
    lost = (lc == 0) & ~is_none
    cnt = lc.clamp_min(1)  # [N, K]
    if policy == "static":
        rep = torch.zeros_like(ids)
    elif policy == "random":
        base = torch.arange(N * K, device=dev, dtype=torch.int64).view(N, K)
        rep = _hash(_hash(base + seed_t * 0x9E3779B1) + ep_rank * 0x9E3779B1) % cnt
    else:
        flat = torch.where(is_none, torch.full_like(ids, E), ids).reshape(-1)
        rank, counts = _rank_in_expert(flat, E)
        rank = rank.view(N, K)
        if policy == "round_robin":
            rep = (rank + seed_t + ep_rank) % cnt
        else:
            spg = num_slots // num_gpus
            shares = _shares_fx(counts[:E], live2phy, livecnt, num_gpus, spg, iters)
            # Live replica r takes the selections j with cum[r-1] <= j + 1/2 < cum[r] (fixed point).
            cum = torch.cumsum(shares, 1)[safe]  # [N, K, R]
            rep = ((rank * SCALE + SCALE // 2)[..., None] >= cum).sum(-1)
            rep = torch.minimum(rep, cnt - 1)
            # The even split in whole selections: the j-th of an expert's c selections goes to live
            # replica j * n // c (floor(c / n) or ceil(c / n) each). Keep the balanced choice only where
            # the busiest GPU is not above the even split's (exact integer counts, no host sync).
            even = torch.where(is_none, torch.zeros_like(rank), rank * cnt // counts[safe].clamp_min(1))
            off = is_none | lost
            rep = torch.where(_busiest(live2phy, safe, rep, off, num_gpus, spg)
                              <= _busiest(live2phy, safe, even, off, num_gpus, spg), rep, even)
    phy = live2phy[safe, rep]  # -1 where the expert has no live replica
    return torch.where(is_none, torch.full_like(phy, -1), phy), lost.sum()


def map_topk(topk_idx: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor, policy: str = "round_robin", *,
             seed: Union[int, torch.Tensor] = 0, num_gpus: Optional[int] = None, num_slots: Optional[int] = None,
             iters: int = 8, slot_mask: Optional[torch.Tensor] = None, lost_out: Optional[torch.Tensor] = None,
             max_replicas: Optional[int] = None, impl: str = "auto", rank: int = 0) -> torch.Tensor:
    """Map logical expert ids to physical slots (live replicas) for one MoE layer.

    Arguments:
        topk_idx: `[num_tokens, topk]` with `torch.int64`, logical expert ids, -1 = no expert.
        log2phy: `[num_experts, max_replicas]` with `torch.int64`, one layer of `rebalance_experts`'s
            ``log2phy`` (slots, -1 padded); logcnt: `[num_experts]` with `torch.int64`.
        policy: ``"round_robin"`` (default), ``"balanced"`` (best, needs ``num_gpus`` and ``num_slots``),
            ``"random"`` or ``"static"`` (always the first live replica), see the module doc.
        seed: int (>= 0) or 0-dim int64 tensor on the device; ``random`` and ``round_robin`` depend on it.
        num_gpus, num_slots: required by ``balanced`` (slot p lives on GPU ``p // (num_slots // num_gpus)``).
        iters: water-filling rounds of ``balanced``.
        slot_mask: `[num_slots]` bool or integer tensor on the device, nonzero = live; None = all live. No
            policy ever returns a dead slot; an expert with no live replica maps to -1.
        lost_out: optional 0-dim int64 tensor on the device; receives the number of selections (token, k)
            whose expert has no live replica (written on the device, no host read).
        max_replicas: optional bound on ``logcnt`` (known when the placement is made); only the first
            ``max_replicas`` columns of ``log2phy`` are read. The result does not depend on it as long
            as it bounds ``logcnt``; it only makes the kernel and the torch path cheaper. On CPU the torch
            path takes ``logcnt.max()`` when it is not given.
        impl: ``"auto"`` (the Triton kernel on CUDA, torch on CPU), ``"torch"`` or ``"triton"``.
        rank: this rank's index in the EP group (int >= 0) when every rank maps only its own tokens, as
            engines do. ``random``, ``round_robin`` and ``balanced`` then start from a rank-dependent
            replica (``balanced``: each expert's live replicas rotated by ``(seed + rank + expert) mod
            live count``; ``round_robin``: offset ``seed + rank``), so that the ranks do not all pick the
            same replicas for their few tokens. No communication, no host read. ``static`` ignores it.

    Returns:
        phy_idx: `[num_tokens, topk]` with `torch.int64`, physical slot ids, -1 where ``topk_idx`` is -1
        or the expert has no live replica.
    """
    _check(topk_idx, log2phy, logcnt)
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be an int >= 0 (this rank's index in the EP group), got {rank!r}")
    dev = topk_idx.device
    if slot_mask is not None:
        _check_mask(slot_mask, dev)
        if num_slots is not None and slot_mask.shape[0] != num_slots:
            raise ValueError(f"slot_mask must be [num_slots={num_slots}], got shape {tuple(slot_mask.shape)}")
    if lost_out is not None and (not isinstance(lost_out, torch.Tensor) or lost_out.dtype != torch.int64
                                 or lost_out.dim() != 0 or lost_out.device != dev):
        raise ValueError("lost_out must be a 0-dim int64 tensor on the device of topk_idx")
    if policy == "balanced":
        if num_gpus is None or num_slots is None:
            raise ValueError("policy='balanced' needs num_gpus= and num_slots= "
                             "(slot p is on GPU p // (num_slots // num_gpus))")
        if num_slots % num_gpus != 0:
            raise ValueError(f"num_slots={num_slots} must be divisible by num_gpus={num_gpus}")
    width = max_replicas
    use_triton = impl == "triton" or (impl == "auto" and dev.type == "cuda")
    if width is None and not use_triton and dev.type == "cpu" and logcnt.numel() > 0:
        width = int(logcnt.max())  # a CPU read; the result does not depend on the width
    if use_triton:
        from .kernels import map_topk_triton
        return map_topk_triton(topk_idx, log2phy, logcnt, policy, seed=seed, num_gpus=num_gpus,
                               num_slots=num_slots, iters=iters, slot_mask=slot_mask, lost_out=lost_out,
                               max_replicas=width, rank=rank)
    if topk_idx.numel() == 0 or log2phy.shape[0] == 0:
        if lost_out is not None:
            lost_out.zero_()
        return torch.full(topk_idx.shape, -1, dtype=torch.int64, device=dev)
    out, lost = _map_torch(topk_idx.long(), log2phy.long(), logcnt.long(), policy, seed, num_gpus, num_slots, iters,
                           slot_mask, width, rank)
    if lost_out is not None:
        lost_out.copy_(lost)
    return out
