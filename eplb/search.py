"""Swap search on robust GPU loads, shared by the fresh planner and the sticky planner."""

from __future__ import annotations

from typing import Optional

import numpy as np

__all__ = ["improve", "robust_max"]


def _robust(mean, sq, z):
    return mean + z * np.sqrt(np.maximum(sq - mean * mean, 0.0)) if z > 0 else mean


def robust_max(phy: np.ndarray, ws: np.ndarray, z: float) -> np.ndarray:
    """Per row, the largest ``mean_s + z * std_s`` GPU load. ``phy`` `[X, G, m]`, ``ws`` `[X, S, n]` -> `[X]`."""
    X, G, m = phy.shape
    S = ws.shape[1]
    B = np.take_along_axis(ws, phy.reshape(X, 1, -1).repeat(S, 1), 2).reshape(X, S, G, m).sum(-1)  # [X, S, G]
    mV = B.mean(1)
    return _robust(mV, (B * B).mean(1), z).max(1)


def improve(phy: np.ndarray, ws: np.ndarray, z: float, max_iters: int, target: Optional[np.ndarray] = None,
            num_partners: int = 1 << 30) -> int:
    """Swap search in place on the robust GPU load ``mean_s + z * std_s`` over scenarios.

    ``phy`` `[X, G, m]` local ids; ``ws`` `[X, S, n]` load per replica in S scenarios (S = 1: the plain
    load). Each iteration takes every layer's most loaded GPU h and swaps one of its slots with the slot
    anywhere else that lowers ``max(robust(h), robust(other GPU))`` the most, while that beats
    ``robust(h)``. New loads follow from means of products, so one iteration costs O(S * m * P) per row.
    Partner slots are those of the ``num_partners`` least loaded GPUs (all GPUs by default). A row
    stops early once its robust maximum is <= ``target[row]``. Returns the iterations run.
    """
    X, G, m = phy.shape
    S, n = ws.shape[1:]
    rows = np.arange(X)
    pres = np.zeros((X, G, n), bool)
    pres[rows[:, None, None], np.arange(G)[None, :, None], phy] = True
    active = np.ones(X, bool)
    wt = np.ascontiguousarray(ws.transpose(0, 2, 1))  # [X, n, S]
    it = 0
    for it in range(max_iters):
        xs = np.nonzero(active)[0]
        if xs.size == 0:
            break
        k = np.arange(xs.size)
        ph = phy[xs].reshape(xs.size, -1)  # [x, P]
        B = wt[xs[:, None], ph]  # [x, P, S]
        V = B.reshape(xs.size, G, m, S).sum(2)  # [x, G, S]
        mV = V.mean(2)
        sqV = (V * V).mean(2) if z > 0 else mV
        rob = _robust(mV, sqV, z)
        h = rob.argmax(1)
        rh = rob[k, h]
        if target is not None:
            done = rh <= target[xs]
            active[xs[done]] = False
            if done.all():
                break
            xs, k, ph, B, V, mV, sqV, rob, h, rh = (a[~done] for a in (xs, k, ph, B, V, mV, sqV, rob, h, rh))
            k = np.arange(xs.size)
        A = B.reshape(xs.size, G, m, S)[k, h]  # [x, m, S]
        # Partners: the slots of the num_partners least loaded GPUs (the best swap almost always lands there).
        if num_partners < G:
            low = np.argpartition(rob, num_partners, axis=1)[:, :num_partners]  # [x, K]
            cs = (low[:, :, None] * m + np.arange(m)).reshape(xs.size, -1)  # [x, K*m] candidate slots
        else:
            cs = np.broadcast_to(np.arange(G * m), (xs.size, G * m))
        B = np.take_along_axis(B, cs[:, :, None], 1)  # [x, C, S]
        gcs = cs // m  # GPU of each candidate
        mA, mB = A.mean(2), B.mean(2)
        mean_h = mV[k, h][:, None, None] - mA[:, :, None] + mB[:, None, :]  # [x, m, C]
        mean_g = np.take_along_axis(mV, gcs, 1)[:, None, :] + mA[:, :, None] - mB[:, None, :]
        if z > 0:
            Vh = V[k, h]  # [x, S]
            As = A / S
            Bt = B.transpose(0, 2, 1)  # [x, S, P]
            AA, BB = (A * A).mean(2), (B * B).mean(2)
            AB = As @ Bt  # [x, m, P]
            VhA, VhB = (As @ Vh[:, :, None])[..., 0], (Vh[:, None, :] @ Bt)[:, 0] / S
            Vg = V[k[:, None], gcs]  # [x, C, S]
            VgA, VgB = As @ Vg.transpose(0, 2, 1), (Vg * B).mean(2)
            common = AA[:, :, None] + BB[:, None, :] - 2 * AB
            sq_h = sqV[k, h][:, None, None] + common - 2 * VhA[:, :, None] + 2 * VhB[:, None, :]
            sq_g = np.take_along_axis(sqV, gcs, 1)[:, None, :] + common + 2 * VgA - 2 * VgB[:, None, :]
            score = np.maximum(_robust(mean_h, sq_h, z), _robust(mean_g, sq_g, z))
        else:
            score = np.maximum(mean_h, mean_g)
        a_e, b_e = phy[xs, h], np.take_along_axis(ph, cs, 1)  # [x, m], [x, C]
        ok = np.broadcast_to((gcs != h[:, None])[:, None, :], score.shape).copy()
        ok &= ~pres[xs[:, None, None], gcs[:, None, :], a_e[:, :, None]]
        ok &= ~pres[xs[:, None], h[:, None], b_e][:, None, :]
        score = np.where(ok, score, np.inf).reshape(xs.size, -1)
        flat = score.argmin(1)
        gain = score[k, flat] < rh - 1e-9 * np.abs(rh)
        active[xs[~gain]] = False
        if not gain.any():
            break
        C = cs.shape[1]
        xs, flat, h, cs = xs[gain], flat[gain], h[gain], cs[gain]
        ai, ci = np.divmod(flat, C)
        g2, j2 = np.divmod(cs[np.arange(xs.size), ci], m)
        ea, eb = phy[xs, h, ai], phy[xs, g2, j2]
        phy[xs, h, ai], phy[xs, g2, j2] = eb, ea
        # (an expert with more copies than GPUs may stay on a GPU it leaves: recount there)
        pres[xs, h, ea] = (phy[xs, h] == ea[:, None]).any(1)
        pres[xs, h, eb] = True
        pres[xs, g2, eb] = (phy[xs, g2] == eb[:, None]).any(1)
        pres[xs, g2, ea] = True
    return it + 1
