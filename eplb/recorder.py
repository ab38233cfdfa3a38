"""Load statistics for placement: per-layer per-expert counts over a sliding window of steps."""

from __future__ import annotations

import os
from typing import Optional, Union

import torch

__all__ = ["LoadRecorder"]

FORMAT = "eplb.LoadRecorder"
VERSION = 2  # 1: the whole ring buffer, int64; 2: the recorded steps only, smallest integer dtype


class LoadRecorder:
    """Accumulates `[L, E]` selection counts per step in a ring buffer of the last ``window`` steps.

    Record a step's counts with `record_topk` (from ``topk_idx``), `record_counts` (a logical count
    vector, e.g. a rank's ``num_recv_tokens_per_expert`` for its local experts at ``offset``) or
    `record_physical` (counts per physical slot, folded to logical experts with ``phy2log``), then
    close the step with `step`. Recording is device-side (scatter-adds, no host sync); `step`
    advances a Python counter. `counts` gives `[L, E]` (window sum) or `[S, L, E]` (per step, oldest
    first), which `rebalance_experts` accepts directly.

    Arguments:
        num_layers, num_experts: shape of the statistics.
        window: steps kept (older steps drop out).
        device: where the counters live (the device the top-k ids are on).
    """

    def __init__(self, num_layers: int, num_experts: int, window: int = 1000,
                 device: Union[str, torch.device] = "cpu"):
        for name, v in (("num_layers", num_layers), ("num_experts", num_experts), ("window", window)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self.num_layers, self.num_experts, self.window = num_layers, num_experts, window
        # window closed steps plus the open one: ring of window + 1 rows, the open step at num_steps % (window + 1)
        self.buffer = torch.zeros(window + 1, num_layers, num_experts, dtype=torch.int64, device=device)
        self.num_steps = 0  # steps closed so far

    @property
    def _cur(self) -> torch.Tensor:
        return self.buffer[self.num_steps % (self.window + 1)]

    def _layer(self, layer: int) -> int:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")
        return layer

    def record_topk(self, layer: int, topk_idx: torch.Tensor) -> None:
        """Add one layer's routing `[num_tokens, topk]` int64 logical ids (-1 ignored) to the open step."""
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dtype not in (torch.int64, torch.int32):
            raise TypeError("topk_idx must be an int64 (or int32) torch.Tensor")
        ids = topk_idx.reshape(-1).long().to(self.buffer.device)
        valid = (ids >= 0) & (ids < self.num_experts)  # no host check: ids out of range are not counted
        row = self._cur[self._layer(layer)]
        row.scatter_add_(0, torch.where(valid, ids, torch.zeros_like(ids)), valid.long())

    def record_counts(self, layer: int, counts: torch.Tensor, offset: int = 0) -> None:
        """Add counts `[n]` for logical experts ``offset .. offset + n - 1`` (a rank's local experts)."""
        counts = torch.as_tensor(counts).reshape(-1)
        if offset < 0 or offset + counts.numel() > self.num_experts:
            raise ValueError(f"counts of {counts.numel()} experts at offset {offset} exceed num_experts={self.num_experts}")
        self._cur[self._layer(layer), offset:offset + counts.numel()] += counts.to(self.buffer.device).long()

    def record_physical(self, layer: int, phy_counts: torch.Tensor, phy2log: torch.Tensor) -> None:
        """Add counts per physical slot `[P]`, folded to logical experts with one layer's ``phy2log`` `[P]`.

        Slots whose ``phy2log`` entry is not an expert id (-1 for an empty slot, or >= num_experts) are
        not counted, as `record_topk` ignores such ids (no host check)."""
        phy_counts = torch.as_tensor(phy_counts).reshape(-1).to(self.buffer.device).long()
        phy2log = torch.as_tensor(phy2log).reshape(-1).to(self.buffer.device).long()
        if phy_counts.shape != phy2log.shape:
            raise ValueError(f"phy_counts {tuple(phy_counts.shape)} and phy2log {tuple(phy2log.shape)} must match")
        valid = (phy2log >= 0) & (phy2log < self.num_experts)
        self._cur[self._layer(layer)].scatter_add_(0, torch.where(valid, phy2log, torch.zeros_like(phy2log)),
                                                   torch.where(valid, phy_counts, torch.zeros_like(phy_counts)))

    def step(self) -> None:
        """Close the open step; the next one overwrites the oldest step once the window is full."""
        self.num_steps += 1
        self._cur.zero_()

    def counts(self, per_step: bool = False) -> torch.Tensor:
        """Closed steps in the window: `[L, E]` summed, or `[S, L, E]` oldest first (int64, S <= window)."""
        s = min(self.num_steps, self.window)
        idx = (torch.arange(self.num_steps - s, self.num_steps) % (self.window + 1)).to(self.buffer.device)
        per = self.buffer.index_select(0, idx)
        return per if per_step else per.sum(0)

    def reset(self) -> None:
        self.buffer.zero_()
        self.num_steps = 0

    def state_dict(self) -> dict:
        """The closed steps in the window and the open step, oldest first, in the smallest integer dtype
        that holds them exactly (a recorder with one step saves one step, not the whole window)."""
        s = min(self.num_steps, self.window)
        idx = (torch.arange(self.num_steps - s, self.num_steps + 1) % (self.window + 1)).to(self.buffer.device)
        steps = self.buffer.index_select(0, idx).cpu()
        return {"format": FORMAT, "version": VERSION, "num_layers": self.num_layers, "num_experts": self.num_experts,
                "window": self.window, "num_steps": self.num_steps, "steps": steps.to(_smallest_int_dtype(steps))}

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the recorder atomically (a crash mid-save keeps the previous file): plain tensors and ints,
        load with `load` (or torch.load with weights_only=True)."""
        from .files import atomic_write
        state = self.state_dict()

        def write(tmp):
            with open(tmp, "wb") as f:  # a file object: torch.save would pick its format from the name
                torch.save(state, f)
        atomic_write(os.fspath(path), write)

    @classmethod
    def load(cls, path: Union[str, os.PathLike], device: Optional[Union[str, torch.device]] = None) -> "LoadRecorder":
        """A recorder written by `save`. A missing or unreadable file raises OSError; anything that is not
        a recorder file (corrupt, truncated, wrong keys, shapes or dtypes) raises ValueError naming it."""
        from .files import _torch_load
        try:
            state = _torch_load(path)
        except ValueError as exc:  # whatever the unpickler or zip reader raised on bad bytes
            raise ValueError(f"{os.fspath(path)} is not a LoadRecorder file: {exc}") from exc
        return cls.from_state_dict(state, device, name=os.fspath(path))

    @classmethod
    def from_state_dict(cls, state, device: Optional[Union[str, torch.device]] = None,
                        name: str = "state") -> "LoadRecorder":
        """A recorder from `state_dict` (also the older layout holding the whole ring ``buffer``)."""
        def bad(why):
            return ValueError(f"{name} is not a LoadRecorder file: {why}")
        if not isinstance(state, dict):
            raise bad(f"expected a dict, got {type(state).__name__}")
        dims = {}
        for key in ("num_layers", "num_experts", "window", "num_steps"):
            v = state.get(key)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if key == "num_steps" else 1):
                raise bad(f"{key!r} must be {'a non-negative' if key == 'num_steps' else 'a positive'} int, got {v!r}")
            dims[key] = v
        L, E, W, n = dims["num_layers"], dims["num_experts"], dims["window"], dims["num_steps"]
        key = "steps" if "steps" in state else "buffer"
        t = state.get(key)
        want = (min(n, W) + 1, L, E) if key == "steps" else (W + 1, L, E)
        if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise bad(f"{key!r} must be an integer tensor {list(want)}, got "
                      f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
        if tuple(t.shape) != want:
            raise bad(f"{key!r} has shape {list(t.shape)}, expected {list(want)}")
        rec = cls(L, E, W, device=device or "cpu")
        if key == "buffer":
            rec.buffer.copy_(t)
        else:
            idx = torch.arange(n - want[0] + 1, n + 1) % (W + 1)
            rec.buffer[idx.to(rec.buffer.device)] = t.to(torch.int64).to(rec.buffer.device)
        rec.num_steps = n
        return rec


def _smallest_int_dtype(t: torch.Tensor) -> torch.dtype:
    lo, hi = (int(t.min()), int(t.max())) if t.numel() else (0, 0)
    for dt in (torch.uint8, torch.int8, torch.int16, torch.int32):
        info = torch.iinfo(dt)
        if info.min <= lo and hi <= info.max:
            return dt
    return torch.int64
