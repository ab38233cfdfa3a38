"""Load statistics for placement: per-layer per-expert counts over a sliding window of steps."""

from __future__ import annotations

import os
from typing import Optional, Union

import torch

__all__ = ["LoadRecorder"]


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
        return {"num_layers": self.num_layers, "num_experts": self.num_experts, "window": self.window,
                "num_steps": self.num_steps, "buffer": self.buffer.cpu()}

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the recorder (torch.save of plain tensors and ints; load with weights_only=True)."""
        torch.save(self.state_dict(), path)

    @classmethod
    def load(cls, path: Union[str, os.PathLike], device: Optional[Union[str, torch.device]] = None) -> "LoadRecorder":
        state = torch.load(path, map_location="cpu", weights_only=True)
        try:
            rec = cls(int(state["num_layers"]), int(state["num_experts"]), int(state["window"]),
                      device=device or "cpu")
            buf = state["buffer"]
            if tuple(buf.shape) != tuple(rec.buffer.shape):
                raise ValueError(f"buffer shape {tuple(buf.shape)} does not match {tuple(rec.buffer.shape)}")
            rec.buffer.copy_(buf)
            rec.num_steps = int(state["num_steps"])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{path} is not a LoadRecorder file: {exc}") from exc
        return rec
