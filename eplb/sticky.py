"""Stickiness: turn a fresh placement into one that keeps experts where ``previous`` had them.

Per layer, two candidates that both keep the fresh plan's replica counts:

- *keep and fill*: every GPU keeps the experts it already holds (while the expert still needs
  replicas), the other replicas go largest first to the least loaded GPU with a free slot that
  lacks the expert; a GPU left above the target load gives back its largest kept slot and the fill
  is redone;
- *relabelled fresh plan*: GPUs are interchangeable, so the fresh plan's GPU contents are matched
  to the previous GPUs with the largest overlap (greedy matching).

The target is the fresh plan's maximum GPU load times ``1 + stickiness``; the candidate meeting
it with fewer moved slots wins. Finally each GPU's kept experts return to their previous slot index.
"""

from __future__ import annotations

import numpy as np

__all__ = ["stick_to_previous"]


def _loads(sets: list, per: np.ndarray) -> np.ndarray:
    return np.array([sum(per[e] for e in s) for s in sets])


def _moves(sets: list, prev_sets: list) -> int:
    moved = 0
    for s, q in zip(sets, prev_sets):
        rest = list(q)
        for e in s:
            if e in rest:
                rest.remove(e)
            else:
                moved += 1
    return moved


def _keep_and_fill(prev_sets, cnt, per, m, target, max_rounds=64):
    G = len(prev_sets)
    banned = [set() for _ in range(G)]  # experts a GPU was asked to give back
    best = None
    for _ in range(max_rounds):
        remaining = cnt.copy()
        sets = [[] for _ in range(G)]
        kept = [[] for _ in range(G)]
        for g in range(G):
            for e in prev_sets[g]:
                if remaining[e] > 0 and e not in sets[g] and e not in banned[g]:
                    sets[g].append(e)
                    kept[g].append(e)
                    remaining[e] -= 1
        loads = _loads(sets, per)
        todo = np.repeat(np.arange(len(cnt)), remaining)
        todo = todo[np.argsort(-per[todo], kind="stable")]
        free = np.array([m - len(s) for s in sets])
        ok = True
        for e in todo:
            cand = np.where((free > 0) & np.array([e not in s for s in sets]), loads, np.inf)
            g = int(np.argmin(cand))
            if not np.isfinite(cand[g]):
                ok = False
                break
            sets[g].append(int(e))
            loads[g] += per[e]
            free[g] -= 1
        if not ok:
            return best
        best = sets
        over = np.nonzero(loads > target)[0]
        if over.size == 0:
            return sets
        progressed = False
        for g in over:
            ks = [e for e in kept[g]]
            if ks:
                banned[g].add(max(ks, key=lambda e: per[e]))
                progressed = True
        if not progressed:
            return sets
    return best


def _relabel(fresh_sets, prev_sets):
    G = len(fresh_sets)
    E = 1 + max(max(s) for s in fresh_sets + prev_sets)
    a = np.zeros((G, E))
    b = np.zeros((G, E))
    for g in range(G):
        np.add.at(a[g], fresh_sets[g], 1.0)
        np.add.at(b[g], prev_sets[g], 1.0)
    overlap = np.minimum(a[:, None, :], b[None, :, :]).sum(-1)  # [fresh GPU, previous GPU]
    out = [None] * G
    order = np.argsort(-overlap, axis=None, kind="stable")
    used_f, used_p = np.zeros(G, bool), np.zeros(G, bool)
    for k in order:
        f, p = divmod(int(k), G)
        if not used_f[f] and not used_p[p]:
            out[p] = fresh_sets[f]
            used_f[f] = used_p[p] = True
    return out


def _positions(sets, prev_sets, m):
    row = []
    for s, q in zip(sets, prev_sets):
        slot = [-1] * m
        rest = list(s)
        for j, e in enumerate(q):
            if e in rest:
                slot[j] = e
                rest.remove(e)
        for j in range(m):
            if slot[j] < 0:
                slot[j] = rest.pop(0)
        row.extend(slot)
    return row


def stick_to_previous(fresh: np.ndarray, previous: np.ndarray, w: np.ndarray, num_gpus: int,
                      stickiness: float) -> np.ndarray:
    """Placement `[L, P]` close to ``previous`` `[L, P]` with at most ``1 + stickiness`` times ``fresh``'s max load."""
    L, P = fresh.shape
    m = P // num_gpus
    out = np.empty_like(fresh)
    for layer in range(L):
        cnt = np.bincount(fresh[layer], minlength=w.shape[1])
        per = w[layer] / np.maximum(cnt, 1)
        fresh_sets = [list(map(int, fresh[layer, g * m:(g + 1) * m])) for g in range(num_gpus)]
        prev_sets = [list(map(int, previous[layer, g * m:(g + 1) * m])) for g in range(num_gpus)]
        target = _loads(fresh_sets, per).max() * (1 + stickiness) + 1e-12
        cands = [_relabel(fresh_sets, prev_sets)]
        kf = _keep_and_fill(prev_sets, cnt, per, m, target)
        if kf is not None:
            cands.append(kf)
        scored = [(_loads(s, per).max() > target, _moves(s, prev_sets), i) for i, s in enumerate(cands)]
        best = cands[min(scored)[2]]
        out[layer] = _positions(best, prev_sets, m)
    return out
