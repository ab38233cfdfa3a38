"""Re-planning after GPU failures: a new placement on the surviving GPUs without a restart.

`replan_on_survivors` keeps every live slot's expert where it is and writes only the experts that lost
every copy, each into exactly one slot taken from an expert that still has a spare live copy. That is
the fewest slots any placement that keeps every expert can move (each lost expert needs one new copy),
and no live GPU ever holds two copies of one expert. Dead GPUs' slots are -1 in ``phy2log``; the
result is in the EPLB format (``phy2log``, ``log2phy``, ``logcnt``), so `eplb.map_topk` uses it as is.
"""

from __future__ import annotations

from typing import Iterable, Optional, Union

import numpy as np
import torch

__all__ = ["replan_on_survivors", "log2phy_with_holes"]


def _np(x, name):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x) if x is not None else None


def log2phy_with_holes(phy2log: np.ndarray, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``log2phy`` `[L, E, P - E + 1]` (slots ascending, -1 padded) and ``logcnt`` `[L, E]` from a
    ``phy2log`` whose dead slots are -1 (those slots appear nowhere)."""
    phy2log = np.asarray(phy2log, np.int64)
    L, P = phy2log.shape
    width = max(P - num_experts + 1, 1)
    logcnt = np.zeros((L, num_experts), np.int64)
    for layer in range(L):
        live = phy2log[layer] >= 0
        np.add.at(logcnt[layer], phy2log[layer][live], 1)
    width = max(width, int(logcnt.max()) if logcnt.size else 1)
    log2phy = np.full((L, num_experts, width), -1, np.int64)
    for layer in range(L):
        fill = np.zeros(num_experts, np.int64)
        for p in range(P):
            e = phy2log[layer, p]
            if e >= 0:
                log2phy[layer, e, fill[e]] = p
                fill[e] += 1
    return torch.from_numpy(log2phy), torch.from_numpy(logcnt)


def replan_on_survivors(phy2log: Union[torch.Tensor, np.ndarray], dead_gpus: Iterable[int], num_gpus: int,
                        weight: Optional[Union[torch.Tensor, np.ndarray]] = None, *,
                        num_experts: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A placement on the surviving GPUs that moves as few live slots as possible.

    Arguments:
        phy2log: `[L, P]` (or one layer `[P]`) the placement in force; entries already -1 are dead slots.
        dead_gpus: GPU ids that failed (slot p lives on GPU ``p // (P // num_gpus)``).
        num_gpus: GPUs of the placement.
        weight: optional `[L, E]` (or `[E]`, or `[S, L, E]` summed) load per expert; default uniform. It
            decides which lost experts come first when slots are short (the heaviest) and which spare
            copies are given up (the one whose expert keeps the least load per copy after losing it,
            then the least loaded GPU).
        num_experts: E (default: the largest id in ``phy2log`` + 1).

    Returns:
        phy2log `[L, P]` int64 (dead GPUs' slots -1), log2phy `[L, E, X]` int64 (-1 padded),
        logcnt `[L, E]` int64. Every expert is placed when the live slots number at least E (else the
        lightest lost experts get no slot, logcnt 0); only slots that held a spare copy are rewritten,
        one per lost expert; no GPU holds two copies of an expert.
    """
    p = _np(phy2log, "phy2log").astype(np.int64)
    one = p.ndim == 1
    if one:
        p = p[None]
    if p.ndim != 2:
        raise ValueError(f"phy2log must be [L, P] or [P], got shape {p.shape}")
    L, P = p.shape
    if num_gpus <= 0 or P % num_gpus != 0:
        raise ValueError(f"slots={P} must be a positive multiple of num_gpus={num_gpus}")
    spg = P // num_gpus
    dead = sorted({int(g) for g in dead_gpus})
    if any(g < 0 or g >= num_gpus for g in dead):
        raise ValueError(f"dead_gpus must be in [0, {num_gpus}), got {dead}")
    E = int(num_experts) if num_experts is not None else int(p.max()) + 1
    if p.max() >= E:
        raise ValueError(f"phy2log holds expert {int(p.max())} >= num_experts={E}")
    w = _np(weight, "weight")
    if w is None:
        w = np.ones((L, E))
    w = np.asarray(w, np.float64)
    if w.ndim == 3:
        w = w.sum(0)
    if w.ndim == 1:
        w = w[None]
    if w.shape != (L, E):
        raise ValueError(f"weight must be [L={L}, E={E}], got shape {w.shape}")
    out = p.copy()
    slot_gpu = np.arange(P) // spg
    for g in dead:
        out[:, g * spg:(g + 1) * spg] = -1
    for layer in range(L):
        row, wl = out[layer], w[layer]
        cnt = np.bincount(row[row >= 0], minlength=E)
        lost = [int(e) for e in np.argsort(-wl, kind="stable") if cnt[e] == 0]
        load = np.zeros(num_gpus)
        live = row >= 0
        np.add.at(load, slot_gpu[live], wl[row[live]] / cnt[row[live]])
        for e in lost:
            donors = np.flatnonzero((row >= 0) & (cnt[np.maximum(row, 0)] >= 2))
            if donors.size == 0:
                break  # no spare copy left: the remaining (lighter) lost experts stay unplaced
            d = row[donors]
            # Give up the copy whose expert keeps the least load per copy, then the least loaded GPU.
            key = np.lexsort((load[slot_gpu[donors]], wl[d] / (cnt[d] - 1)))
            s = int(donors[key[0]])
            old, g = int(row[s]), int(slot_gpu[s])
            # Re-book loads: the donor's copies each carry more, this GPU carries e instead.
            on = (row == old)
            load[slot_gpu[on]] += wl[old] / (cnt[old] - 1) - wl[old] / cnt[old]
            load[g] += wl[e] - wl[old] / (cnt[old] - 1)
            cnt[old] -= 1
            row[s] = e
            cnt[e] = 1
    log2phy, logcnt = log2phy_with_holes(out, E)
    res = torch.from_numpy(out), log2phy, logcnt
    return tuple(t[0] for t in res) if one else res
