"""Stickiness: a placement close to ``previous`` that is nearly as good as a fresh one.

Per layer, keeping the fresh plan's replica counts:

1. *Adjust*: start from ``previous``. An expert with more replicas than it now needs (or a second
   copy on one GPU) gives up the copies on its most loaded GPUs; the experts that need more replicas
   go, largest load per replica first, to the least loaded GPU with a freed slot that lacks them.
2. *Search*: the swap search of the fresh planner (same robust objective) runs only until the
   layer's robust maximum GPU load is within ``1 + stickiness`` of the fresh plan's; every swap
   moves two slots, so only swaps that pay are made.
3. If a layer still misses that bound, the fresh plan is used with its GPUs relabelled to match
   ``previous`` as far as possible (GPUs are interchangeable).

Finally every GPU's kept experts go back to their previous slot index.
"""

from __future__ import annotations

import numpy as np

from .search import improve, robust_max

__all__ = ["stick_to_previous"]


def _adjust(prev: np.ndarray, cnt: np.ndarray, per: np.ndarray, G: int, m: int):
    """``prev`` `[P]` to a placement `[G, m]` with replica counts ``cnt``, moving as little as possible."""
    slots = prev.reshape(G, m).copy()
    loads = per[slots].sum(1)
    have = np.zeros_like(cnt)
    free = np.zeros((G, m), bool)
    # Release second copies on one GPU, then surplus copies on the most loaded GPUs.
    for g in range(G):
        seen = set()
        for j in range(m):
            e = int(slots[g, j])
            if e in seen:
                free[g, j] = True
            else:
                seen.add(e)
                have[e] += 1
    surplus = np.nonzero(have > cnt)[0]
    for e in surplus:
        pos = np.argwhere((slots == e) & ~free)
        order = np.argsort(-loads[pos[:, 0]], kind="stable")[: have[e] - cnt[e]]
        for g, j in pos[order]:
            free[g, j] = True
        have[e] = cnt[e]
    loads = np.where(free, 0.0, per[slots]).sum(1)
    slots[free] = -1
    need = np.repeat(np.arange(len(cnt)), np.maximum(cnt - have, 0))
    need = need[np.argsort(-per[need], kind="stable")]
    nfree = free.sum(1)
    for e in need:
        ok = (nfree > 0) & ~(slots == e).any(1)
        if not ok.any():
            return None
        g = int(np.argmin(np.where(ok, loads, np.inf)))
        j = int(np.nonzero(slots[g] < 0)[0][0])
        slots[g, j] = e
        loads[g] += per[e]
        nfree[g] -= 1
    return slots


def _relabel(fresh: np.ndarray, prev: np.ndarray, G: int, m: int, E: int) -> np.ndarray:
    """``fresh`` `[P]` with whole GPUs permuted to overlap ``prev`` `[P]` the most (greedy matching)."""
    a = np.zeros((G, E))
    b = np.zeros((G, E))
    np.add.at(a, (np.repeat(np.arange(G), m), fresh), 1.0)
    np.add.at(b, (np.repeat(np.arange(G), m), prev), 1.0)
    overlap = np.minimum(a[:, None, :], b[None, :, :]).sum(-1)  # [fresh GPU, previous GPU]
    out = np.empty((G, m), np.int64)
    used_f, used_p = np.zeros(G, bool), np.zeros(G, bool)
    for k in np.argsort(-overlap, axis=None, kind="stable"):
        f, p = divmod(int(k), G)
        if not used_f[f] and not used_p[p]:
            out[p] = fresh[f * m:(f + 1) * m]
            used_f[f] = used_p[p] = True
    return out


def _keep_positions(slots: np.ndarray, prev: np.ndarray) -> np.ndarray:
    """Within each GPU, put experts that were there before back into their previous slot index."""
    G, m = slots.shape
    out = np.empty_like(slots)
    for g in range(G):
        rest = list(slots[g])
        row = [-1] * m
        for j, e in enumerate(prev[g]):
            if e in rest:
                row[j] = e
                rest.remove(e)
        for j in range(m):
            if row[j] < 0:
                row[j] = rest.pop(0)
        out[g] = row
    return out


def stick_to_previous(fresh: np.ndarray, previous: np.ndarray, w: np.ndarray, scen: np.ndarray, z: float,
                      num_gpus: int, stickiness: float, max_iters: int) -> np.ndarray:
    """Placement `[L, P]` near ``previous`` `[L, P]` whose robust max GPU load is within ``1 + stickiness`` of ``fresh``'s.

    ``w`` `[L, E]` planning load, ``scen`` `[L, S, E]` scenario loads, ``z`` the robustness weight.
    """
    L, P = fresh.shape
    E = w.shape[1]
    G, m = num_gpus, P // num_gpus
    cnt = np.zeros((L, E), np.int64)
    np.add.at(cnt, (np.arange(L)[:, None], fresh), 1)
    ws = scen / np.maximum(cnt, 1)[:, None, :]
    target = robust_max(fresh.reshape(L, G, m), ws, z) * (1 + stickiness) + 1e-12
    start = np.empty((L, G, m), np.int64)
    adjusted = np.ones(L, bool)
    for layer in range(L):
        s = _adjust(previous[layer], cnt[layer], w[layer] / np.maximum(cnt[layer], 1), G, m)
        if s is None:
            adjusted[layer] = False
            s = _relabel(fresh[layer], previous[layer], G, m, E)
        start[layer] = s
    if m > 1:
        improve(start, ws, z, max_iters, target=target)
    missed = robust_max(start, ws, z) > target
    out = np.empty_like(fresh)
    for layer in range(L):
        s = start[layer]
        if missed[layer] or not adjusted[layer]:
            s = _relabel(fresh[layer], previous[layer], G, m, E)
        out[layer] = _keep_positions(s, previous[layer].reshape(G, m)).reshape(-1)
    return out
