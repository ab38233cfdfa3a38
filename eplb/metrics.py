"""Scores of a placement: per-GPU load, balancedness, same-GPU duplicates, slots moved.

A placement is ``phy2log`` `[L, P]` (P physical slots, slot p on GPU ``p // (P // num_gpus)``).
Every expert's tokens are split evenly over its replicas (what a static dispatch achieves on
average), so slot p carries ``weight[l, phy2log[l, p]] / logcnt[l, phy2log[l, p]]``.
"""

from __future__ import annotations

import numpy as np

from ._checks import as_numpy

__all__ = ["gpu_loads", "balancedness", "same_gpu_duplicates", "slots_moved"]


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
