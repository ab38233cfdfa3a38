"""Files of the CLI: load statistics, read and write placements (written atomically)."""

from __future__ import annotations

import csv
import json
import os
from typing import Callable

import numpy as np
import torch

from moe_ep.errors import MoEEPError

from ._checks import check_weight
from .files import _reason, _torch_load, atomic_write, atomic_write_all

__all__ = ["check_input_file", "load_stats", "save_stats", "stats_writer", "load_placement", "save_placement", "placement_writer",
           "atomic_write", "atomic_write_all"]

STATS_SUFFIXES = (".npy", ".pt", ".json", ".csv")


def _suffix(path: str, allowed: tuple) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext not in allowed:
        raise ValueError(f"{path}: unsupported file type {ext or '(none)'!r}; use one of {', '.join(allowed)}")
    return ext


def check_input_file(path: str, what: str) -> None:
    """A plain one-line reason when ``path`` is not a file to read: missing (and which folder is missing), or
    a folder. (OSError subclasses, so callers' ``except OSError`` still holds.)"""
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path} is a folder, not a {what} file")
    if not os.path.exists(path):
        folder = os.path.dirname(os.path.abspath(path))
        where = "" if os.path.isdir(folder) else f" (its folder {folder} does not exist either)"
        raise FileNotFoundError(f"{what} file {path} does not exist{where}")


def load_stats(path: str) -> np.ndarray:
    """Statistics `[L, E]` or `[S, L, E]` from .npy, .pt (weights-only: a tensor, a dict with ``counts``,
    or a `LoadRecorder` file, whose per-step window is used), .json (nested lists, or a dict with
    ``counts``) or .csv (one row per layer). Checked (finite, >= 0); returns float64."""
    check_input_file(path, "statistics")
    ext = _suffix(path, STATS_SUFFIXES)
    try:
        if ext == ".npy":
            data = _load_npy(path)
        elif ext == ".pt":
            obj = _torch_load(path)
            if isinstance(obj, dict) and "num_steps" in obj and ("steps" in obj or "buffer" in obj):
                from .recorder import LoadRecorder
                data = LoadRecorder.from_state_dict(obj).counts(per_step=True).numpy()
            elif isinstance(obj, dict) and "counts" in obj:
                data = obj["counts"]
            else:
                _not_a_placement(path, obj)
                data = obj
            if not isinstance(data, (torch.Tensor, np.ndarray)):
                raise ValueError(f"expected a tensor (or a dict with 'counts'), got {_kind(data)}")
        elif ext == ".json":
            with open(path) as f:
                obj = json.load(f)
            _not_a_placement(path, obj)
            data = obj["counts"] if isinstance(obj, dict) and "counts" in obj else obj
            if isinstance(data, dict):
                raise ValueError(f"expected nested lists of counts or a dict with 'counts', got {_kind(data)}")
            try:
                data = np.array(data, dtype=np.float64)
            except (TypeError, ValueError):
                raise ValueError("expected nested lists of numbers ([layers][experts] or [steps][layers][experts]) "
                                 "of equal lengths") from None
        else:
            with open(path, newline="") as f:
                rows = [r for r in csv.reader(f) if r and not r[0].lstrip().startswith("#")]
            if len({len(r) for r in rows}) > 1:
                raise ValueError("rows have different numbers of columns")
            data = np.array([[float(v) for v in r] for r in rows], dtype=np.float64)
    except OSError:
        raise  # missing file, a folder, no permission: the OS message names the path
    except _PlacementGiven as exc:
        raise ValueError(str(exc)) from None
    except Exception as exc:  # corrupt, truncated or garbage content: whatever the parser raised
        raise ValueError(f"{path}: cannot read statistics ({_reason(exc)})") from exc
    try:
        return check_weight(data)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path}: {exc}") from exc


class _PlacementGiven(MoEEPError, ValueError):
    pass


def _kind(obj) -> str:
    if isinstance(obj, dict):
        keys = ", ".join(map(str, list(obj)[:5])) + (", ..." if len(obj) > 5 else "")
        return f"a dict with keys {keys}" if obj else "an empty dict"
    return type(obj).__name__


def _not_a_placement(path: str, obj) -> None:
    """A placement file (what ``plan`` writes) given where statistics are expected: say so in one line."""
    if isinstance(obj, dict) and "phy2log" in obj:
        raise _PlacementGiven(
            f"{path}: this is a placement file (it has phy2log), not statistics: give per-expert counts "
            "[layers, experts] or [steps, layers, experts] (python -m eplb simulate, LoadRecorder.save) first, "
            "as in python -m eplb report STATS PLACEMENT")


def _load_npy(path: str) -> np.ndarray:
    """A numeric .npy array (pickled object arrays are never loaded), with a plain reason otherwise."""
    with open(path, "rb") as f:
        magic = f.read(6)
    if magic != b"\x93NUMPY":
        raise ValueError("not a NumPy .npy file: no .npy header")
    try:
        return np.load(path, allow_pickle=False)
    except ValueError as exc:
        if "allow_pickle" in str(exc) or "pickle" in str(exc):
            raise ValueError("the array holds Python objects, not numbers; only numeric arrays are read") from None
        raise


def save_stats(path: str, counts: np.ndarray) -> None:
    """Statistics to .npy, .pt, .json or .csv (`[L, E]` only), atomically."""
    atomic_write(path, stats_writer(path, counts))


def stats_writer(path: str, counts: np.ndarray) -> Callable[[str], None]:
    """The function writing ``counts`` in ``path``'s format to a given (temporary) file name."""
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
    return write


def save_placement(path: str, phy2log: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor, meta: dict) -> None:
    """A placement as .json (lists plus ``meta``) or .pt (int64 tensors plus ``meta``), atomically."""
    atomic_write(path, placement_writer(path, phy2log, log2phy, logcnt, meta))


def placement_writer(path: str, phy2log: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor,
                     meta: dict) -> Callable[[str], None]:
    """The function writing a placement in ``path``'s format to a given (temporary) file name."""
    ext = _suffix(path, (".json", ".pt"))

    def write(tmp):
        if ext == ".pt":
            with open(tmp, "wb") as f:
                torch.save({"phy2log": phy2log, "log2phy": log2phy, "logcnt": logcnt, "meta": meta}, f)
        else:
            with open(tmp, "w") as f:
                json.dump({"meta": meta, "phy2log": phy2log.tolist(), "log2phy": log2phy.tolist(),
                           "logcnt": logcnt.tolist()}, f)
    return write


def load_placement(path: str) -> tuple[np.ndarray, dict]:
    """``phy2log`` `[L, P]` int64 and ``meta`` (may be empty) from a placement file (.json or .pt)."""
    check_input_file(path, "placement")
    ext = _suffix(path, (".json", ".pt"))
    try:
        if ext == ".pt":
            obj = _torch_load(path)
        else:
            with open(path) as f:
                obj = json.load(f)
        if isinstance(obj, dict):
            phy, meta = obj["phy2log"], obj.get("meta", {}) or {}
        else:
            phy, meta = obj, {}
        phy = np.array(torch.as_tensor(phy).tolist() if isinstance(phy, torch.Tensor) else phy)
        if not isinstance(meta, dict):
            raise ValueError(f"'meta' must be a dict, got {type(meta).__name__}")
    except OSError:
        raise
    except Exception as exc:
        raise ValueError(f"{path}: cannot read a placement ({_reason(exc)})") from exc
    if phy.ndim != 2 or phy.size == 0 or not np.issubdtype(phy.dtype, np.integer):
        raise ValueError(f"{path}: phy2log must be integer [layers, slots], got shape {phy.shape} dtype {phy.dtype}")
    return phy.astype(np.int64), dict(meta)
