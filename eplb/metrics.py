"""Scores of a placement: per-GPU load, balancedness, cross-node traffic, same-GPU duplicates, slots moved.

A placement is ``phy2log`` `[L, P]` (P physical slots, slot p on GPU ``p // (P // num_gpus)``).
Every expert's tokens are split evenly over its replicas (what a static dispatch achieves on
average), so slot p carries ``weight[l, phy2log[l, p]] / logcnt[l, phy2log[l, p]]``.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ._checks import as_numpy

__all__ = ["gpu_loads", "balancedness", "cross_node_per_token", "same_gpu_duplicates", "slots_moved"]


def _phy(phy2log) -> np.ndarray:
    p = as_numpy(phy2log, "phy2log").astype(np.int64, copy=False)
    if p.ndim != 2:
        raise ValueError(f"phy2log must be 2D [layers, slots], got shape {p.shape}")
    return p


def gpu_loads(phy2log, weight, num_gpus: int) -> np.ndarray:
    """Per-GPU load of a placement under ``weight``.

    Arguments:
        phy2log: `[L, P]` integer, the logical expert of every slot.
        weight: `[L, E]` (or `[S, L, E]`, summed over steps) non-negative load per expert.
        num_gpus: GPUs; P must be a multiple of it.

    Returns:
        loads: `[L, num_gpus]` with `np.float64`.
    """
    p = _phy(phy2log)
    w = as_numpy(weight, "weight").astype(np.float64)
    if w.ndim == 3:
        w = w.sum(0)
    L, P = p.shape
    if w.ndim != 2 or w.shape[0] != L:
        raise ValueError(f"weight must be [L={L}, E] (or [S, L, E]), got shape {w.shape}")
    if P % num_gpus != 0:
        raise ValueError(f"slots={P} must be divisible by num_gpus={num_gpus}")
    E = w.shape[1]
    if p.min() < 0 or p.max() >= E:
        raise ValueError(f"phy2log entries must be in [0, {E}), got range [{p.min()}, {p.max()}]")
    cnt = np.zeros((L, E))
    np.add.at(cnt, (np.arange(L)[:, None], p), 1.0)
    per_slot = np.take_along_axis(w / np.maximum(cnt, 1.0), p, axis=1)
    return per_slot.reshape(L, num_gpus, P // num_gpus).sum(-1)


def balancedness(phy2log, weight, num_gpus: int, per_layer: bool = False):
    """Mean over max per-GPU load (1.0 = perfectly even), averaged over layers unless ``per_layer``.

    Returns:
        a float, or `[L]` `np.float64` with ``per_layer=True``. A layer with no load scores 1.0.
    """
    loads = gpu_loads(phy2log, weight, num_gpus)
    mx = loads.max(1)
    b = np.where(mx > 0, loads.mean(1) / np.where(mx > 0, mx, 1.0), 1.0)
    return b if per_layer else float(b.mean())


def same_gpu_duplicates(phy2log, num_gpus: int) -> int:
    """Slots that hold an expert already present on the same GPU (wasted slots), summed over layers."""
    p = _phy(phy2log)
    L, P = p.shape
    g = np.sort(p.reshape(L, num_gpus, P // num_gpus), axis=-1)
    return int((g[..., 1:] == g[..., :-1]).sum())


def slots_moved(phy2log, previous, num_gpus: int) -> int:
    """Slots whose expert was not on that GPU in ``previous`` (expert weights that must be copied in).

    Position inside a GPU does not count: an expert kept on its GPU costs nothing. Summed over layers.
    """
    p, q = _phy(phy2log), _phy(previous)
    if p.shape != q.shape:
        raise ValueError(f"previous must have the shape of phy2log {p.shape}, got {q.shape}")
    L, P = p.shape
    m = P // num_gpus
    a, b = p.reshape(L, num_gpus, m), q.reshape(L, num_gpus, m)
    E = int(max(p.max(), q.max())) + 1
    ca = np.zeros((L, num_gpus, E), np.int64)
    cb = np.zeros((L, num_gpus, E), np.int64)
    li, gi = np.arange(L)[:, None, None], np.arange(num_gpus)[None, :, None]
    np.add.at(ca, (li, gi, a), 1)
    np.add.at(cb, (li, gi, b), 1)
    return int(np.maximum(ca - cb, 0).sum())


def cross_node_per_token(phy2log, weight, num_gpus: int, num_nodes: int, num_groups: int = 1, topk: int = 8,
                         topk_groups: Optional[int] = None, num_tokens: int = 1024, seed: int = 0) -> float:
    """Node-locality cost: cross-node selections per token under group-limited routing, i.e. the remote nodes a
    token is sent to (a dispatch sends a token once per destination node, as DeepEP does), layer average.

    Tokens are drawn per layer from ``weight`` (an expert's share of the layer's load is its routing
    popularity, Gumbel top-``topk``), each limited to the ``topk_groups`` groups of highest top-2 score
    (DeepSeek-V3's group-limited routing; default half the groups, 4 of 8 as DeepSeek-V3). A selection goes to
    each replica of its expert with equal probability and a token starts on a uniformly drawn node: the
    expectation over both is exact, over the ``num_tokens`` tokens per layer a fixed-seed sample. When every
    group sits on one node (the hierarchical policy), a token reaches at most ``topk_groups`` nodes.

    Returns:
        a float in [0, min(topk, num_nodes - 1)]; 0.0 with one node.
    """
    import torch

    from .synthetic import _route

    p = _phy(phy2log)
    w = as_numpy(weight, "weight").astype(np.float64)
    if w.ndim == 3:
        w = w.sum(0)
    L, P = p.shape
    E = w.shape[-1]
    if w.ndim != 2 or w.shape[0] != L:
        raise ValueError(f"weight must be [L={L}, E] (or [S, L, E]), got shape {w.shape}")
    if P % num_gpus != 0 or num_gpus % num_nodes != 0:
        raise ValueError(f"slots={P} must divide over num_gpus={num_gpus}, and the GPUs over num_nodes={num_nodes}")
    if num_nodes == 1:
        return 0.0
    groups = num_groups if num_groups >= 1 and E % num_groups == 0 else 1
    tg = max(1, groups // 2) if topk_groups is None else min(max(1, int(topk_groups)), groups)
    k = min(topk, tg * (E // groups))
    node = np.arange(P) // (P // num_nodes)
    gen = torch.Generator().manual_seed(seed)
    total = 0.0
    for layer in range(L):
        on_node = np.zeros((E, num_nodes))
        np.add.at(on_node, (p[layer], node), 1.0)
        frac = torch.from_numpy(on_node / np.maximum(on_node.sum(1, keepdims=True), 1.0))  # [E, nodes]
        pop = torch.from_numpy(np.log(w[layer] / max(w[layer].sum(), 1e-300) + 1e-12))
        u = torch.rand(num_tokens, E, generator=gen, dtype=torch.float64).clamp_min(1e-12)
        sel = _route(pop[None, :] - torch.log(-torch.log(u)), k, groups, tg)  # [T, k]
        reached = 1.0 - torch.prod(1.0 - frac[sel], dim=1)  # [T, nodes]: P(node reached)
        total += float(reached.sum(1).mean()) * (1.0 - 1.0 / num_nodes)
    return total / L
