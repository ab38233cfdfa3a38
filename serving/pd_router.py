"""PD load balancing (seed 004, RTP-LLM): which decode instance (or DP rank) takes a new request.

Policies (one decision method each, ``choose(batch, kv, rng) -> index``):
- ``KVBalance``: the instance with the least KV in use (RTP-LLM ``rank_factor=0``; ``roulette=True`` is
  its weighted random choice with weight = free KV).
- ``BSBalance``: the instance with the fewest running requests (``rank_factor=1``; roulette weight =
  ``max(batch) - batch``, computed on a copy: RTP-LLM's read version rewrites the cached counts in place).
- ``MixedBalance(alpha)``: argmin of ``alpha * b / mean(b) + (1 - alpha) * kv / mean(kv)``.
- ``RoundRobin``.

Why it matters (SEEDS D.3): in an EP decode step every instance waits for the slowest one, so

    step = max_r attention(kv_r) + dispatch/combine(max_r b_r) + grouped GEMM(sum_r b_r)

with attention memory-bound (KV bytes read / HBM), dispatch ``b x k x (H + H/32 + 16)`` bytes (FP8
activations, one float scale per 128 channels, 16 bytes of metadata per selection) and combine
``b x k x 2H`` (BF16) over the network. KV balance equalises ``kv_r`` and, when sequence lengths vary,
skews ``b_r`` (ranks of short sequences take more requests); batch balance does the opposite.
``simulate`` runs a closed-loop decode (constant concurrency: a finished request is replaced by a new one
routed by the policy) and reports the step time split into these three parts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .hardware import HARDWARE, Hardware

__all__ = ["KVBalance", "BSBalance", "MixedBalance", "RoundRobin", "make_policy", "dispatch_combine_bytes",
           "DecodeCost", "SimResult", "simulate", "scenario_table"]


def _roulette(weights: np.ndarray, rng: np.random.Generator) -> int:
    """RTP-LLM's weighted random pick: the first index whose running sum reaches U(0,1) x total."""
    total = float(weights.sum())
    if total <= 0:
        return int(rng.integers(len(weights)))
    return int(np.searchsorted(np.cumsum(weights), rng.random() * total, side="left"))


@dataclass
class KVBalance:
    """Least KV in use. ``kv_capacity`` (tokens per instance) is needed only for ``roulette``."""

    roulette: bool = False
    kv_capacity: float = 0.0
    name: str = "kv"

    def choose(self, batch: np.ndarray, kv: np.ndarray, rng: np.random.Generator) -> int:
        if self.roulette:
            return _roulette(np.maximum(self.kv_capacity - kv, 0.0), rng)
        return int(np.argmin(kv))


@dataclass
class BSBalance:
    """Fewest running requests."""

    roulette: bool = False
    name: str = "bs"

    def choose(self, batch: np.ndarray, kv: np.ndarray, rng: np.random.Generator) -> int:
        if self.roulette:
            return _roulette((batch.max() - batch).astype(float), rng)
        return int(np.argmin(batch))


@dataclass
class MixedBalance:
    """Weighted combination: ``alpha`` on batch-size balance, ``1 - alpha`` on KV balance."""

    alpha: float = 0.5
    name: str = "mixed"

    def choose(self, batch: np.ndarray, kv: np.ndarray, rng: np.random.Generator) -> int:
        mb, mk = max(float(batch.mean()), 1e-9), max(float(kv.mean()), 1e-9)
        return int(np.argmin(self.alpha * batch / mb + (1 - self.alpha) * kv / mk))


@dataclass
class RoundRobin:
    name: str = "rr"
    _next: int = 0

    def choose(self, batch: np.ndarray, kv: np.ndarray, rng: np.random.Generator) -> int:
        i = self._next % len(batch)
        self._next += 1
        return i


def make_policy(name: str, alpha: float = 0.5):
    """``kv``, ``bs``, ``mixed`` (with ``alpha``), ``rr``."""
    table = {"kv": KVBalance, "bs": BSBalance, "rr": RoundRobin}
    if name == "mixed":
        return MixedBalance(alpha)
    if name not in table:
        raise ValueError(f"unknown policy {name!r}; known: kv, bs, mixed, rr")
    return table[name]()


def dispatch_combine_bytes(num_tokens: int, hidden: int, top_k: int) -> tuple[float, float]:
    """Low-latency dispatch and combine bytes one rank sends for ``num_tokens`` tokens."""
    dispatch = num_tokens * top_k * (hidden + hidden / 32 + 16)
    combine = num_tokens * top_k * 2 * hidden
    return dispatch, combine


@dataclass(frozen=True)
class DecodeCost:
    """Per-rank decode step costs. Defaults: DeepSeek-V3 (MLA KV 70,272 B/token in BF16) on H800."""

    hidden: int = 7168
    top_k: int = 8
    num_moe_layers: int = 58
    num_layers: int = 61
    kv_bytes_per_token: float = 61 * 576 * 2
    expert_flops_per_token: float = 6.0 * 7168 * 2048
    hardware: Hardware = HARDWARE["H800"]
    comm_bytes_per_s: float | None = None  # default: the hardware's inter-node bandwidth
    hbm_eff: float = 0.7
    compute_eff: float = 0.5

    def attention_s(self, kv_tokens: np.ndarray) -> np.ndarray:
        return kv_tokens * self.kv_bytes_per_token / (self.hardware.hbm_bytes_per_s * self.hbm_eff)

    def comm_s(self, batch: np.ndarray) -> np.ndarray:
        d, c = dispatch_combine_bytes(batch, self.hidden, self.top_k)
        bw = self.comm_bytes_per_s or self.hardware.inter_node_bytes_per_s
        return (d + c) * self.num_moe_layers / bw

    def gemm_s(self, total_batch: float, num_ranks: int) -> float:
        flops = total_batch * self.top_k * self.expert_flops_per_token * self.num_moe_layers / num_ranks
        return flops / (self.hardware.peak_flops_fp8 * self.compute_eff)


@dataclass
class SimResult:
    policy: str
    step_s: float  # mean decode step (= TPOT)
    attention_s: float
    comm_s: float
    gemm_s: float
    cv_batch: float  # mean over steps of std/mean across instances
    cv_kv: float

    @property
    def tok_s(self) -> float:
        return 0.0 if self.step_s == 0 else 1.0 / self.step_s


def simulate(policy, num_instances: int, concurrency: int, isl: np.ndarray, osl: np.ndarray,
             cost: DecodeCost = DecodeCost(), num_steps: int = 400, seed: int = 0) -> SimResult:
    """Closed-loop decode across ``num_instances`` EP ranks at constant ``concurrency``.

    Arguments:
        policy: an object with ``choose(batch, kv, rng)``.
        isl, osl: `[num_requests]` int arrays, the request pool drawn in order (wraps around).
        num_steps: decode steps measured after a warm-up of ``num_steps // 2``.
    Returns:
        ``SimResult`` with the mean step time and its parts, and the mean CV of batch and KV.
    """
    rng = np.random.default_rng(seed)
    n_req = len(isl)
    owner = np.empty(concurrency, dtype=np.int64)
    ctx = np.empty(concurrency, dtype=np.float64)
    left = np.empty(concurrency, dtype=np.int64)
    batch = np.zeros(num_instances, dtype=np.int64)
    kv = np.zeros(num_instances, dtype=np.float64)
    nxt = 0

    def admit(slot: int) -> None:
        nonlocal nxt
        i = policy.choose(batch, kv, rng)
        owner[slot], ctx[slot], left[slot] = i, float(isl[nxt % n_req]), int(osl[nxt % n_req])
        batch[i] += 1
        kv[i] += ctx[slot]
        nxt += 1

    # Staggered start: requests enter part-way through their output so finishes spread over time.
    for s in range(concurrency):
        admit(s)
        done = int(rng.integers(0, left[s]))
        left[s] -= done
        ctx[s] += done
        kv[owner[s]] += done
    warm = num_steps // 2
    acc = np.zeros(5)
    for step in range(warm + num_steps):
        att = cost.attention_s(kv)
        com = cost.comm_s(batch)
        t_att, t_com, t_gemm = float(att.max()), float(com.max()), cost.gemm_s(float(batch.sum()), num_instances)
        if step >= warm:
            acc += (t_att, t_com, t_gemm, batch.std() / max(batch.mean(), 1e-9), kv.std() / max(kv.mean(), 1e-9))
        # One token for every running request.
        ctx += 1
        kv += np.bincount(owner, minlength=num_instances)
        left -= 1
        for s in np.flatnonzero(left <= 0):
            i = owner[s]
            batch[i] -= 1
            kv[i] -= ctx[s]
            admit(int(s))
    a = acc / num_steps
    return SimResult(getattr(policy, "name", type(policy).__name__), a[0] + a[1] + a[2], a[0], a[1], a[2], a[3], a[4])


def _lengths(rng: np.random.Generator, n: int, mean: float, cv: float) -> np.ndarray:
    if cv <= 0:
        return np.full(n, int(mean), dtype=np.int64)
    sigma = np.sqrt(np.log1p(cv * cv))
    return np.maximum(1, rng.lognormal(np.log(mean) - sigma * sigma / 2, sigma, n)).astype(np.int64)


SCENARIOS = {
    # name: (ISL mean, ISL CV, OSL mean, OSL CV, comm bytes/s or None for the hardware's inter-node)
    "uniform lengths": (2000, 0.0, 400, 0.0, None),
    "seq variance, heavy EP traffic": (2000, 1.5, 400, 0.5, 12.5e9),
    "seq variance, light EP traffic": (2000, 1.5, 400, 0.5, 400e9),
    "long-context variance, heavy EP": (8000, 1.5, 400, 0.5, None),
    "long-context variance, NVLink EP": (16000, 2.0, 400, 1.0, 200e9),
}


def scenario_table(num_instances: int = 8, concurrency: int = 512, num_steps: int = 300, seed: int = 0,
                   policies: tuple[str, ...] = ("kv", "bs", "mixed", "rr")) -> list[tuple[str, SimResult]]:
    """Every scenario x policy; the rows of the notes' table."""
    rows = []
    for name, (isl_m, isl_cv, osl_m, osl_cv, bw) in SCENARIOS.items():
        rng = np.random.default_rng(seed)
        isl, osl = _lengths(rng, 4096, isl_m, isl_cv), _lengths(rng, 4096, osl_m, osl_cv)
        cost = DecodeCost(comm_bytes_per_s=bw)
        for p in policies:
            rows.append((name, simulate(make_policy(p), num_instances, concurrency, isl, osl, cost, num_steps, seed)))
    return rows


def format_scenarios(rows: list[tuple[str, SimResult]]) -> str:
    lines = [f"{'scenario':<34} {'policy':<6} {'step ms':>8} {'attn ms':>8} {'comm ms':>8} {'gemm ms':>8} "
             f"{'CV(b)':>6} {'CV(kv)':>7}"]
    for name, r in rows:
        lines.append(f"{name:<34} {r.policy:<6} {r.step_s * 1e3:>8.2f} {r.attention_s * 1e3:>8.2f} "
                     f"{r.comm_s * 1e3:>8.2f} {r.gemm_s * 1e3:>8.2f} {r.cv_batch:>6.2f} {r.cv_kv:>7.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_scenarios(scenario_table()))
