"""Files of the CLI: load statistics, read and write placements (written atomically)."""

from __future__ import annotations

import csv
import json
import os
import tempfile
from typing import Callable

import numpy as np
import torch

from ._checks import check_weight

__all__ = ["load_stats", "save_stats", "load_placement", "save_placement", "atomic_write"]

STATS_SUFFIXES = (".npy", ".pt", ".json", ".csv")


def _suffix(path: str, allowed: tuple) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext not in allowed:
        raise ValueError(f"{path}: unsupported file type {ext or '(none)'!r}; use one of {', '.join(allowed)}")
    return ext


def load_stats(path: str) -> np.ndarray:
    """Statistics `[L, E]` or `[S, L, E]` from .npy, .pt (weights-only: a tensor, a dict with ``counts``,
    or a `LoadRecorder` file, whose per-step window is used), .json (nested lists, or a dict with
    ``counts``) or .csv (one row per layer). Checked (finite, >= 0); returns float64."""
    ext = _suffix(path, STATS_SUFFIXES)
    try:
        if ext == ".npy":
            data = np.load(path, allow_pickle=False)
        elif ext == ".pt":
            obj = torch.load(path, map_location="cpu", weights_only=True)
            if isinstance(obj, dict) and "buffer" in obj and "num_steps" in obj:
                from .recorder import LoadRecorder
                data = LoadRecorder.load(path).counts(per_step=True).numpy()
            elif isinstance(obj, dict) and "counts" in obj:
                data = obj["counts"]
            else:
                data = obj
            if not isinstance(data, (torch.Tensor, np.ndarray)):
                raise ValueError(f"expected a tensor (or a dict with 'counts'), got {type(data).__name__}")
        elif ext == ".json":
            with open(path) as f:
                obj = json.load(f)
            data = obj["counts"] if isinstance(obj, dict) and "counts" in obj else obj
            data = np.array(data, dtype=np.float64)
        else:
            with open(path, newline="") as f:
                rows = [r for r in csv.reader(f) if r and not r[0].lstrip().startswith("#")]
            if len({len(r) for r in rows}) > 1:
                raise ValueError("rows have different numbers of columns")
            data = np.array([[float(v) for v in r] for r in rows], dtype=np.float64)
    except FileNotFoundError:
        raise
    except (ValueError, TypeError, KeyError, json.JSONDecodeError, RuntimeError, EOFError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"{path}: cannot read statistics ({msg})") from exc
    try:
        return check_weight(data)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path}: {exc}") from exc


def save_stats(path: str, counts: np.ndarray) -> None:
    ext = _suffix(path, STATS_SUFFIXES)
    if ext == ".csv" and counts.ndim != 2:
        raise ValueError(f"{path}: .csv holds [layers, experts] only, got shape {counts.shape}; use .npy or .pt")

    def write(tmp):
        if ext == ".npy":
            with open(tmp, "wb") as f:
                np.save(f, counts)
        elif ext == ".pt":
            with open(tmp, "wb") as f:
                torch.save(torch.from_numpy(np.ascontiguousarray(counts)), f)
        elif ext == ".json":
            with open(tmp, "w") as f:
                json.dump({"counts": counts.tolist()}, f)
        else:
            with open(tmp, "w", newline="") as f:
                csv.writer(f).writerows(counts.tolist())
    atomic_write(path, write)


def atomic_write(path: str, write: Callable[[str], None]) -> None:
    """Write through a temporary file in the same folder, renamed into place only on success."""
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=d)
    os.close(fd)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file the usual permissions
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def save_placement(path: str, phy2log: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor, meta: dict) -> None:
    """A placement as .json (lists plus ``meta``) or .pt (int64 tensors plus ``meta``)."""
    ext = _suffix(path, (".json", ".pt"))

    def write(tmp):
        if ext == ".pt":
            with open(tmp, "wb") as f:
                torch.save({"phy2log": phy2log, "log2phy": log2phy, "logcnt": logcnt, "meta": meta}, f)
        else:
            with open(tmp, "w") as f:
                json.dump({"meta": meta, "phy2log": phy2log.tolist(), "log2phy": log2phy.tolist(),
                           "logcnt": logcnt.tolist()}, f)
    atomic_write(path, write)


def load_placement(path: str) -> tuple[np.ndarray, dict]:
    """``phy2log`` `[L, P]` int64 and ``meta`` (may be empty) from a placement file (.json or .pt)."""
    ext = _suffix(path, (".json", ".pt"))
    try:
        if ext == ".pt":
            obj = torch.load(path, map_location="cpu", weights_only=True)
        else:
            with open(path) as f:
                obj = json.load(f)
        if isinstance(obj, dict):
            phy, meta = obj["phy2log"], obj.get("meta", {}) or {}
        else:
            phy, meta = obj, {}
        phy = np.array(torch.as_tensor(phy).tolist() if isinstance(phy, torch.Tensor) else phy)
    except FileNotFoundError:
        raise
    except (ValueError, TypeError, KeyError, json.JSONDecodeError, RuntimeError, EOFError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"{path}: cannot read a placement ({msg})") from exc
    if phy.ndim != 2 or not np.issubdtype(phy.dtype, np.integer):
        raise ValueError(f"{path}: phy2log must be integer [layers, slots], got shape {phy.shape} dtype {phy.dtype}")
    return phy.astype(np.int64), dict(meta)
