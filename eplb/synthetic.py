"""Synthetic MoE routing statistics: skewed, group-correlated, noisy per step, drifting between windows.

The model, per layer:

- every expert has a base log-popularity from a Zipf law over a random rank order, plus a few very
  hot experts (``num_hot`` of them, boosted by ``hot_boost`` in log space);
- traffic is a mixture of ``num_domains`` domains (chat, code, math, ...). Each domain adds its own
  per-expert deviation and favours some expert groups (group-correlated load);
- each routed token draws Gumbel-perturbed scores and is routed like DeepSeek-V3: the best
  ``topk_groups`` groups by their top-2 score sum, then the top-k experts inside them. The per-domain
  marginal selection probabilities come from routing ``probe_tokens`` sample tokens;
- a *window* fixes the domain mixture (drawn around a base mixture) and adds a multiplicative random
  walk (step ``drift``) to every expert's selection probability, so window w+1 differs from window w;
- a *step* inside a window draws its own mixture from a Dirichlet around the window's and Poisson
  counts for ``tokens_per_step * topk`` selections (per-step noise).

``simulate_counts`` returns float32 `[W, S, L, E]` counts (windows, steps, layers, experts);
``sample_topk`` routes actual tokens of one step and layer for the dispatch-time benchmark.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

__all__ = ["Workload", "simulate_counts", "sample_topk", "PRESETS"]


@dataclass(frozen=True)
class Workload:
    """Shape and skew knobs of a synthetic workload (see the module docstring for the model)."""

    num_layers: int = 58
    num_experts: int = 256
    topk: int = 8
    num_groups: int = 8
    topk_groups: int = 4
    tokens_per_step: int = 18432
    num_steps: int = 32
    zipf: float = 0.4
    num_hot: int = 4
    hot_boost: float = 1.0
    num_domains: int = 4
    domain_spread: float = 0.3
    group_spread: float = 0.3
    mixture_concentration: float = 30.0
    step_concentration: float = 60.0
    drift: float = 0.05
    probe_tokens: int = 2048

    def __post_init__(self):
        if self.num_experts % self.num_groups != 0:
            raise ValueError(f"num_experts={self.num_experts} must be divisible by num_groups={self.num_groups}")
        if not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(f"topk_groups={self.topk_groups} must be in [1, num_groups={self.num_groups}]")
        if self.topk > self.topk_groups * (self.num_experts // self.num_groups):
            raise ValueError(f"topk={self.topk} exceeds the experts inside {self.topk_groups} groups")


PRESETS = {
    "deepseek-v3-decode": Workload(),
    "deepseek-v3-prefill": Workload(tokens_per_step=32 * 8192),
    "qwen3-moe-decode": Workload(num_layers=94, num_experts=128, num_groups=1, topk_groups=1, tokens_per_step=8192),
    "qwen3-moe-prefill": Workload(num_layers=94, num_experts=128, num_groups=1, topk_groups=1,
                                  tokens_per_step=16 * 8192),
}


def _route(logits: torch.Tensor, topk: int, num_groups: int, topk_groups: int) -> torch.Tensor:
    """Group-limited top-k of `[N, E]` scores (DeepSeek-V3 style); returns `[N, topk]` int64."""
    n, e = logits.shape
    if num_groups > 1 and topk_groups < num_groups:
        g = logits.view(n, num_groups, e // num_groups)
        group_score = g.topk(min(2, e // num_groups), dim=-1).values.sum(-1)
        keep = group_score.topk(topk_groups, dim=-1).indices
        mask = torch.ones(n, num_groups, dtype=torch.bool).scatter_(1, keep, False)
        logits = logits.masked_fill(mask.repeat_interleave(e // num_groups, dim=1), float("-inf"))
    return logits.topk(topk, dim=-1).indices


class _Model:
    def __init__(self, wl: Workload, seed: int):
        self.wl = wl
        self.rng = np.random.default_rng(seed)
        self.gen = torch.Generator().manual_seed(seed)
        L, E, D, G = wl.num_layers, wl.num_experts, wl.num_domains, wl.num_groups
        ranks = np.argsort(self.rng.random((L, E)), axis=1).argsort(axis=1) + 1.0
        base = -wl.zipf * np.log(ranks)
        hot = np.argsort(self.rng.random((L, E)), axis=1)[:, : wl.num_hot]
        np.put_along_axis(base, hot, np.take_along_axis(base, hot, 1) + wl.hot_boost, axis=1)
        group = np.repeat(self.rng.normal(0, wl.group_spread, (D, L, G)), E // G, axis=2)
        self.logpop = base[None] + self.rng.normal(0, wl.domain_spread, (D, L, E)) + group  # [D, L, E]
        self.base_mix = self.rng.dirichlet(np.full(D, 2.0))

        self.probs = None  # [D, L, E] per-domain selection probabilities, routed on first use
        self.walk = np.zeros_like(self.logpop)

    def _route_probs(self) -> np.ndarray:
        wl = self.wl
        D, L, E = self.logpop.shape
        probs = np.empty((D, L, E))
        for d in range(D):
            for lo in range(0, L, 8):  # 8 layers at a time bounds the memory of the probe
                lp = torch.from_numpy(self.logpop[d, lo:lo + 8]).float()  # [l, E]
                n = lp.shape[0]
                u = torch.rand(n, wl.probe_tokens, E, generator=self.gen).clamp_min(1e-20)
                idx = _route((lp[:, None, :] - torch.log(-torch.log(u))).reshape(-1, E), wl.topk, wl.num_groups,
                             wl.topk_groups)
                cnt = torch.zeros(n, E).scatter_add_(1, idx.view(n, -1), torch.ones(n, wl.probe_tokens * wl.topk))
                probs[d, lo:lo + n] = (cnt / cnt.sum(1, keepdim=True)).numpy()
        return probs

    def window(self) -> tuple[np.ndarray, np.ndarray]:
        """Advance the drift; return (mixture [D], per-domain selection probabilities [D, L, E])."""
        wl = self.wl
        if self.probs is None:
            self.probs = self._route_probs()
        self.walk += self.rng.normal(0, wl.drift, self.walk.shape)
        mix = self.rng.dirichlet(wl.mixture_concentration * self.base_mix + 1e-3)
        p = self.probs * np.exp(self.walk)
        return mix, p / p.sum(-1, keepdims=True)


def simulate_counts(workload: Workload, num_windows: int = 3, seed: int = 0,
                    progress: Optional[Callable[[int, int], None]] = None) -> np.ndarray:
    """Per-step routing counts of consecutive windows.

    Arguments:
        workload: a `Workload` (or one of `PRESETS`).
        num_windows: windows to draw; window w+1 drifts from window w.
        seed: everything is deterministic given the seed.
        progress: optional ``progress(done, total)`` called after each window.

    Returns:
        counts: `[num_windows, num_steps, num_layers, num_experts]` with `np.float32` (integral values);
            each step's counts sum to ``tokens_per_step * topk`` in expectation.
    """
    if num_windows < 1:
        raise ValueError(f"num_windows must be >= 1, got {num_windows}")
    wl = workload
    model = _Model(wl, seed)
    out = np.empty((num_windows, wl.num_steps, wl.num_layers, wl.num_experts), dtype=np.float32)
    sel = wl.tokens_per_step * wl.topk
    for w in range(num_windows):
        mix, probs = model.window()
        step_mix = model.rng.dirichlet(wl.step_concentration * mix + 1e-3, size=wl.num_steps)  # [S, D]
        p = np.einsum("sd,dle->sle", step_mix, probs)
        out[w] = model.rng.poisson(p * sel)
        if progress is not None:
            progress(w + 1, num_windows)
    return out


def sample_topk(workload: Workload, num_tokens: int, layer: int = 0, seed: int = 0, step: int = 0) -> torch.Tensor:
    """Route ``num_tokens`` tokens of one layer and one step of the workload drawn with ``seed``.

    The tokens' domains follow a step mixture drawn around the base mixture; ``step`` selects
    independent draws of the same workload (the one `simulate_counts` with this seed describes).

    Returns:
        topk_idx: `[num_tokens, topk]` with `torch.int64`, no expert twice per token.
    """
    wl = workload
    model = _Model(wl, seed)
    rng = np.random.default_rng([seed, step, 1])
    gen = torch.Generator().manual_seed(int(rng.integers(2**62)))
    mix = rng.dirichlet(wl.step_concentration * model.base_mix + 1e-3)
    dom = torch.from_numpy(rng.choice(len(mix), size=num_tokens, p=mix))
    lp = torch.from_numpy(model.logpop[:, layer]).float()[dom]  # [N, E]
    u = torch.rand(num_tokens, wl.num_experts, generator=gen).clamp_min(1e-20)
    return _route(lp - torch.log(-torch.log(u)), wl.topk, wl.num_groups, wl.topk_groups)
