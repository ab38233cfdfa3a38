"""RCSD: PD resource configuration and strategy deployment (seed 000), as an offline planner.

Given a model, a cluster, a workload and SLOs, the planner

1. enumerates every instance size G that holds the weights and every parallel configuration
   ``TP x PP x DP x EP = G`` (the paper's eq. 17, per stage), for prefill and for decode;
2. rates each configuration with RCSD's latency model (eqs. 1-11, "consistent" reading, below) and
   the SLO (TTFT for prefill including queueing, TPOT for decode at the largest batch that meets it);
3. takes the best prefill configuration, sorts the decode configurations by rate and binary-searches
   the one closest to it (Algorithm 1, lines 14-16);
4. replicates both by the rate ratio (``n = ceil(R / rate_P)``, ``m = ceil(R / rate_D)`` for an offered
   rate R; without R, the largest ``(n, m)`` that fits the cluster with ``min(n rate_P, m rate_D)``
   maximal).

Rates are requests/s so that prefill and decode can be matched (SEEDS B.3). Throughput is reported as
output tokens/s per GPU of the cluster.

The latency model (SEEDS B.2, "consistent" reading; every term per GPU):
- compute per token per layer: ``24 h^2`` (paper, eq. 1; ``attention_cost="model"`` uses the model's
  own projection + score FLOPs instead) plus, on MoE layers, ``C^E x k x omega`` (eqs. 4-6) where
  ``omega = 1 + omega_frac x (|EP| - 1)`` in ``[1, |EP|]`` is the hottest EP rank over the mean; the
  stage's work is spread over its ``G / PP`` GPUs (eq. 5's ``/|EP|`` is not applied twice);
- decode is a roofline: ``max(FLOPs / peak, (weight + KV bytes) / HBM)`` (the paper has no HBM term;
  ``roofline=False`` drops it);
- transfer (eqs. 9-11): TP all-reduce (2 per layer), PP stage boundaries, EP dispatch
  ``k x (h + h/32 + 16)`` and combine ``k x 2h`` bytes per token to remote ranks, each split into its
  intra-node and inter-node part by where the group's ranks sit, over the matching bandwidth;
- prefill tokens are discounted by the cache hit rate (eq. 2).
Layout inside an instance: TP innermost (stride 1), then EP, DP, PP. Attention and dense weights are
sharded by TP x PP and replicated over DP x EP; expert weights sharded by EP x TP x PP.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field, replace

from serving.hardware import Hardware

__all__ = [
    "ModelSpec", "MODELS", "Cluster", "Workload", "SLO", "Knobs", "ParallelConfig", "StageRate",
    "PlanError", "enumerate_configs", "rate_prefill", "rate_decode", "rate_colocated", "stage_table",
    "pareto_by_rate", "closest_by_bisect", "closest_by_scan", "replicate", "best_pair_exhaustive", "plan", "format_plan",
]


class PlanError(ValueError):
    """Input the planner cannot serve (bad numbers, model too large, no configuration meets the SLO)."""


@dataclass(frozen=True)
class ModelSpec:
    """A model as the cost model sees it. ``weight_bytes`` is the deployed size (after quantisation)."""

    name: str
    hidden: int
    num_layers: int
    num_dense_layers: int  # layers with a dense MLP; the rest are MoE
    num_experts: int  # routed experts (0 for a dense model)
    top_k: int
    num_shared_experts: int
    expert_ffn: int
    dense_ffn: int
    attn_params_per_layer: float
    num_heads: int
    qk_head_dim: int
    v_head_dim: int
    kv_bytes_per_token: float  # all layers
    weight_bytes: float
    expert_weight_bytes: float  # part of weight_bytes held by routed experts

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    @property
    def expert_flops_per_token(self) -> float:
        """C^E: one expert's FLOPs per token (gate, up, down at 2 FLOPs/MAC)."""
        return 6.0 * self.hidden * self.expert_ffn


def _deepseek_r1() -> ModelSpec:
    # Public DeepSeek-V3/R1 config: hidden 7168, 61 layers (3 dense), 256 routed + 1 shared expert,
    # top-8, expert FFN 2048, dense FFN 18432, 128 heads MLA (q_lora 1536, kv_lora 512, rope 64,
    # qk_nope 128, v 128). Deployed in 8-bit: 671 GB (BF16 would need ~1.34 TB, SEEDS B.5).
    h = 7168
    attn = h * 1536 + 1536 * 128 * 192 + h * 576 + 512 * 128 * 256 + 128 * 128 * h
    experts = 58 * 256 * 3 * h * 2048
    return ModelSpec("deepseek-r1", h, 61, 3, 256, 8, 1, 2048, 18432, attn, 128, 192, 128,
                     kv_bytes_per_token=61 * 576 * 2, weight_bytes=671e9, expert_weight_bytes=float(experts))


def _qwen_32b() -> ModelSpec:
    # Qwen2.5-32B / DeepSeek-R1-Distill-Qwen-32B: hidden 5120, 64 layers, 40 heads, 8 KV heads of 128,
    # FFN 27648, BF16 (~65.5 GB). Dense: every layer is a "dense" layer.
    h = 5120
    attn = h * 5120 + 2 * h * 1024 + 5120 * h
    return ModelSpec("qwen-32b", h, 64, 64, 0, 0, 0, 0, 27648, attn, 40, 128, 128,
                     kv_bytes_per_token=64 * 8 * 128 * 2 * 2, weight_bytes=65.5e9, expert_weight_bytes=0.0)


MODELS: dict[str, ModelSpec] = {"deepseek-r1": _deepseek_r1(), "qwen-32b": _qwen_32b()}


@dataclass(frozen=True)
class Cluster:
    """``num_nodes`` nodes of ``hardware.gpus_per_node`` GPUs each."""

    num_nodes: int
    hardware: Hardware

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.hardware.gpus_per_node


@dataclass(frozen=True)
class Workload:
    """Input/output lengths in tokens, prefix-cache hit rate in [0, 1), optional offered load."""

    isl: int
    osl: int
    cache_hit: float = 0.0
    rate: float | None = None  # requests/s
    concurrency: int | None = None


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float


@dataclass(frozen=True)
class Knobs:
    """Model constants the paper leaves open; the defaults are stated in the notes, not fitted per run."""

    compute_eff: float = 0.5  # achieved / peak tensor FLOPs
    hbm_eff: float = 0.7
    link_eff: float = 0.7
    mem_util: float = 0.8  # usable share of HBM (the paper holds memory at ~80%)
    omega_frac: float = 0.1  # omega = 1 + omega_frac * (EP - 1)
    attention_cost: str = "paper"  # "paper": 24 h^2 per token per layer; "model": from the config
    roofline: bool = True
    prefill_tokens: int = 8192  # prefill batch: enough requests to fill this many tokens
    max_util: float = 0.95  # highest utilisation a stage is planned at
    splitwise_ratio: tuple[int, int] = (1, 1)  # fixed P:D node ratio of the Splitwise-style baseline
    search: str = "ratio"  # "paper": one bisect at the prefill rate; "ratio": one per replication ratio
    colocated_gpus: int = 0  # instance size of the colocated baseline; 0 = the smallest that holds the weights


@dataclass(frozen=True)
class ParallelConfig:
    tp: int
    pp: int
    dp: int
    ep: int

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.ep

    def label(self) -> str:
        return f"TP{self.tp}PP{self.pp}DP{self.dp}EP{self.ep}"


@dataclass(frozen=True)
class StageRate:
    """One configuration of one stage: sustainable requests/s per instance and its latency."""

    stage: str  # "prefill" | "decode" | "colocated"
    cfg: ParallelConfig
    rate: float  # requests/s per instance at the SLO (0 when infeasible)
    latency_s: float  # TTFT (prefill, colocated) or TPOT (decode) at that rate
    batch: int
    feasible: bool

    @property
    def rate_per_gpu(self) -> float:
        return self.rate / self.cfg.num_gpus


# ---------------------------------------------------------------------------------------------
# Enumeration and memory
# ---------------------------------------------------------------------------------------------

def _pow2_upto(n: int) -> list[int]:
    out, v = [], 1
    while v <= n:
        out.append(v)
        v *= 2
    return out


def enumerate_configs(num_gpus: int, gpus_per_node: int, is_moe: bool = True) -> list[ParallelConfig]:
    """Every ``TP x PP x DP x EP = num_gpus`` with power-of-two degrees, TP inside one node."""
    out = []
    for tp in _pow2_upto(min(num_gpus, gpus_per_node)):
        for pp in _pow2_upto(num_gpus // tp):
            for dp in _pow2_upto(num_gpus // (tp * pp)):
                ep, rem = divmod(num_gpus, tp * pp * dp)
                if rem or (ep > 1 and not is_moe):
                    continue
                out.append(ParallelConfig(tp, pp, dp, ep))
    return out


def weight_bytes_per_gpu(model: ModelSpec, cfg: ParallelConfig) -> float:
    dense = model.weight_bytes - model.expert_weight_bytes
    return dense / (cfg.tp * cfg.pp) + model.expert_weight_bytes / (cfg.ep * cfg.tp * cfg.pp)


def kv_capacity_bytes(model: ModelSpec, hw: Hardware, cfg: ParallelConfig, knobs: Knobs) -> float:
    """KV bytes the instance can hold (<= 0 when the weights do not fit)."""
    free = hw.memory_bytes * knobs.mem_util - weight_bytes_per_gpu(model, cfg)
    return free * cfg.num_gpus


# ---------------------------------------------------------------------------------------------
# Latency model
# ---------------------------------------------------------------------------------------------

def _flops_per_token_layer(model: ModelSpec, knobs: Knobs, ctx: float, moe_layer: bool, omega: float) -> float:
    h = model.hidden
    if knobs.attention_cost == "paper":
        att = 24.0 * h * h  # eq. 1: the whole dense-layer forward as the paper writes it
        mlp = 0.0
    else:
        att = 2.0 * model.attn_params_per_layer + 2.0 * ctx * model.num_heads * (model.qk_head_dim + model.v_head_dim)
        mlp = 6.0 * h * model.dense_ffn
    if not moe_layer:
        return att + mlp
    c_e = model.expert_flops_per_token
    return att + c_e * (model.top_k * omega + model.num_shared_experts)


def _split(group: int, stride: int, gpn: int) -> tuple[float, float]:
    """Share of a rank's peers (out of ``group``) reached intra-node and inter-node."""
    if group <= 1:
        return 0.0, 0.0
    in_node = max(1, min(group, gpn // stride)) if stride < gpn else 1
    return (in_node - 1) / group, (group - in_node) / group


def _stage_time(model: ModelSpec, hw: Hardware, cfg: ParallelConfig, knobs: Knobs,
                tokens: float, ctx: float, kv_tokens: float, decode: bool) -> float:
    """Seconds for one PP stage of the instance to run ``tokens`` through its layers (one GPU's view)."""
    gpn = hw.gpus_per_node
    stage_gpus = cfg.num_gpus // cfg.pp
    omega = 1.0 + knobs.omega_frac * (cfg.ep - 1)
    n_moe = model.num_moe_layers / cfg.pp
    n_dense = model.num_dense_layers / cfg.pp
    flops = tokens * (n_dense * _flops_per_token_layer(model, knobs, ctx, False, omega)
                      + n_moe * _flops_per_token_layer(model, knobs, ctx, True, omega)) / stage_gpus
    peak = hw.peak_flops_fp8 * knobs.compute_eff
    t_compute = flops / peak
    if knobs.roofline:
        bytes_read = weight_bytes_per_gpu(model, cfg) + kv_tokens * model.kv_bytes_per_token / cfg.num_gpus
        t_mem = bytes_read / (hw.hbm_bytes_per_s * knobs.hbm_eff)
        t_compute = max(t_compute, t_mem)
    # Transfers (eq. 11): bytes by where the peers sit, over that link.
    intra_bw = hw.intra_node_bytes_per_s * knobs.link_eff
    inter_bw = hw.inter_node_bytes_per_s * knobs.link_eff
    h = model.hidden
    layers = (model.num_layers) / cfg.pp
    tok_tp = tokens / (cfg.dp * cfg.ep)  # tokens each TP group holds
    t_comm = 0.0
    if cfg.tp > 1:
        ar = 2 * 2.0 * (cfg.tp - 1) / cfg.tp * tok_tp * h * 2 * layers  # two BF16 all-reduces / layer
        t_comm += ar / (intra_bw if cfg.tp <= gpn else inter_bw)
    if cfg.ep > 1 and model.num_experts:
        fi, fo = _split(cfg.ep, cfg.tp, gpn)
        tok_rank = tok_tp / cfg.tp
        per_tok = model.top_k * ((h + h / 32 + 16) + 2 * h)  # dispatch FP8 + scales + meta, combine BF16
        vol = tok_rank * per_tok * n_moe
        t_comm += vol * fi / intra_bw + vol * fo / inter_bw
    if cfg.pp > 1:
        span = cfg.tp * cfg.ep * cfg.dp
        t_comm += tok_tp / cfg.tp * h * 2 / (intra_bw if span < gpn else inter_bw)
    return t_compute + t_comm


def _prefill_batch(workload: Workload, knobs: Knobs) -> tuple[int, float]:
    eff = max(1.0, workload.isl * (1.0 - workload.cache_hit))
    b = max(1, int(knobs.prefill_tokens // eff))
    return b, b * eff


def rate_prefill(model: ModelSpec, hw: Hardware, cfg: ParallelConfig, workload: Workload, slo: SLO,
                 knobs: Knobs, ttft_slo: float | None = None) -> StageRate:
    """Highest request rate whose TTFT (batch latency + M/D/1 queueing, eq. 15) meets the SLO."""
    ttft_slo = slo.ttft_s if ttft_slo is None else ttft_slo
    if kv_capacity_bytes(model, hw, cfg, knobs) < workload.isl * model.kv_bytes_per_token:
        return StageRate("prefill", cfg, 0.0, math.inf, 0, False)
    b, tokens = _prefill_batch(workload, knobs)
    t_stage = _stage_time(model, hw, cfg, knobs, tokens, workload.isl, 0.0, decode=False)
    latency = cfg.pp * t_stage
    slack = ttft_slo - latency
    if slack <= 0:
        return StageRate("prefill", cfg, 0.0, latency, b, False)
    rho = min(knobs.max_util, 2 * slack / (t_stage + 2 * slack))  # M/D/1: wait = rho S / (2 (1 - rho))
    return StageRate("prefill", cfg, rho * b / t_stage, latency + rho * t_stage / (2 * (1 - rho)), b, True)


def _tpot(model, hw, cfg, knobs, batch: int, ctx: float) -> float:
    micro = batch / cfg.pp
    return cfg.pp * _stage_time(model, hw, cfg, knobs, micro, ctx, micro * ctx, decode=True)


def rate_decode(model: ModelSpec, hw: Hardware, cfg: ParallelConfig, workload: Workload, slo: SLO,
                knobs: Knobs, tpot_slo: float | None = None) -> StageRate:
    """Largest batch whose TPOT (eq. 16) meets the SLO and whose KV fits; rate = batch / TPOT / OSL."""
    tpot_slo = slo.tpot_s if tpot_slo is None else tpot_slo
    ctx = workload.isl + workload.osl / 2.0
    b_mem = int(kv_capacity_bytes(model, hw, cfg, knobs) // (ctx * model.kv_bytes_per_token))
    if b_mem < 1:
        return StageRate("decode", cfg, 0.0, math.inf, 0, False)
    t1 = _tpot(model, hw, cfg, knobs, 1, ctx)
    if t1 > tpot_slo:
        return StageRate("decode", cfg, 0.0, t1, 1, False)
    lo, hi = 1, b_mem  # TPOT grows with the batch: binary search the largest batch under the SLO
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _tpot(model, hw, cfg, knobs, mid, ctx) <= tpot_slo:
            lo = mid
        else:
            hi = mid - 1
    t = _tpot(model, hw, cfg, knobs, lo, ctx)
    return StageRate("decode", cfg, lo / t / workload.osl, t, lo, True)


def rate_colocated(model: ModelSpec, hw: Hardware, cfg: ParallelConfig, workload: Workload, slo: SLO,
                   knobs: Knobs) -> StageRate:
    """Non-disaggregated instance: prefills (priority) stall the running decode batch.

    At rate r the prefill share of time is ``u = r / mu_P``; the decode batch B solves
    ``B = r x OSL x TPOT`` with ``TPOT = t_D(B) / (1 - u)``; TTFT = prefill latency + M/D/1 wait + one
    decode step. The largest r meeting both SLOs (and the KV capacity) is bisected.
    """
    none = StageRate("colocated", cfg, 0.0, math.inf, 0, False)
    pre = rate_prefill(model, hw, cfg, workload, slo, replace(knobs, max_util=0.999))
    if not pre.feasible:
        return none
    b_p, tokens = _prefill_batch(workload, knobs)
    t_p = _stage_time(model, hw, cfg, knobs, tokens, workload.isl, 0.0, decode=False)
    mu = b_p / t_p
    ctx = workload.isl + workload.osl / 2.0
    b_mem = int(kv_capacity_bytes(model, hw, cfg, knobs) // (ctx * model.kv_bytes_per_token))

    def check(r: float) -> tuple[bool, float, int]:
        u = r / mu
        if u >= 1:
            return False, math.inf, 0
        b = 1.0
        for _ in range(40):
            tpot = _tpot(model, hw, cfg, knobs, max(1, math.ceil(b)), ctx) / (1 - u)
            nb = r * workload.osl * tpot
            if nb > b_mem:
                return False, math.inf, 0
            if abs(nb - b) < 0.5:
                b = nb
                break
            b = nb
        bi = max(1, math.ceil(b))
        tpot = _tpot(model, hw, cfg, knobs, bi, ctx) / (1 - u)
        ttft = cfg.pp * t_p + u * t_p / (2 * (1 - u)) + tpot
        return tpot <= slo.tpot_s and ttft <= slo.ttft_s, ttft, bi

    lo, hi = 0.0, mu
    ok, ttft, b = False, math.inf, 0
    for _ in range(30):
        mid = 0.5 * (lo + hi)
        good, t_, b_ = check(mid)
        if good:
            lo, ok, ttft, b = mid, True, t_, b_
        else:
            hi = mid
    if not ok:
        return none
    return StageRate("colocated", cfg, lo, ttft, b, True)


# ---------------------------------------------------------------------------------------------
# Search
# ---------------------------------------------------------------------------------------------

def min_instance_gpus(model: ModelSpec, hw: Hardware, knobs: Knobs) -> int:
    return max(1, math.ceil(model.weight_bytes / (hw.memory_bytes * knobs.mem_util)))


def stage_table(stage: str, model: ModelSpec, cluster: Cluster, workload: Workload, slo: SLO, knobs: Knobs,
                max_gpus: int | None = None, ttft_slo: float | None = None,
                tpot_slo: float | None = None) -> list[StageRate]:
    """Rate every configuration of every instance size from the smallest that holds the weights."""
    hw = cluster.hardware
    max_gpus = cluster.num_gpus if max_gpus is None else max_gpus
    g_min = min_instance_gpus(model, hw, knobs)
    out = []
    for g in _pow2_upto(max_gpus):
        if g < g_min:
            continue
        for cfg in enumerate_configs(g, hw.gpus_per_node, model.num_experts > 0):
            if stage == "prefill":
                out.append(rate_prefill(model, hw, cfg, workload, slo, knobs, ttft_slo))
            elif stage == "decode":
                out.append(rate_decode(model, hw, cfg, workload, slo, knobs, tpot_slo))
            else:
                out.append(rate_colocated(model, hw, cfg, workload, slo, knobs))
    return out


def pareto_by_rate(rows: list[StageRate]) -> list[StageRate]:
    """Ascending by rate, dropping every config another beats with >= rate on <= GPUs."""
    out: list[StageRate] = []
    for r in sorted(rows, key=lambda r: (-r.rate, r.cfg.num_gpus)):
        if not out or r.cfg.num_gpus < out[-1].cfg.num_gpus:
            out.append(r)
    return out[::-1]


def closest_by_bisect(sorted_rates: list[float], target: float) -> int:
    """Index of the rate closest to ``target`` in an ascending list (Algorithm 1, line 16)."""
    j = bisect.bisect_left(sorted_rates, target)
    if j == 0:
        return 0
    if j == len(sorted_rates):
        return j - 1
    return j if sorted_rates[j] - target < target - sorted_rates[j - 1] else j - 1


def closest_by_scan(sorted_rates: list[float], target: float) -> int:
    """The exhaustive check of ``closest_by_bisect``: first index of minimal distance."""
    return min(range(len(sorted_rates)), key=lambda i: (abs(sorted_rates[i] - target), i))


def replicate(p: StageRate, d: StageRate, num_gpus: int, rate: float | None = None) -> tuple[int, int]:
    """Instance counts (n, m): ``ceil(R / rate)`` for an offered rate R, else the best fit in the budget."""
    gp, gd = p.cfg.num_gpus, d.cfg.num_gpus
    if rate is not None:
        return math.ceil(rate / p.rate), math.ceil(rate / d.rate)
    best, best_nm = -1.0, (0, 0)
    for n in range(1, (num_gpus - gd) // gp + 1):
        m_max = (num_gpus - n * gp) // gd
        # the smallest m that matches n prefill instances, capped by the budget
        m = min(m_max, max(1, math.ceil(n * p.rate / d.rate)))
        for mm in {m, max(1, m - 1)}:
            sys = min(n * p.rate, mm * d.rate)
            if sys > best + 1e-12:
                best, best_nm = sys, (n, mm)
    return best_nm


def _system_rate(p: StageRate, d: StageRate, nm: tuple[int, int]) -> float:
    return min(nm[0] * p.rate, nm[1] * d.rate)


def _best_per_size(rows: list[StageRate]) -> dict[int, StageRate]:
    best: dict[int, StageRate] = {}
    for r in rows:
        g = r.cfg.num_gpus
        if r.feasible and (g not in best or r.rate > best[g].rate):
            best[g] = r
    return best


def best_pair_exhaustive(pre: list[StageRate], dec: list[StageRate], num_gpus: int
                         ) -> tuple[StageRate, StageRate, tuple[int, int], float] | None:
    """The global optimum over every (prefill cfg, decode cfg, n, m) in the budget.

    For a fixed instance size a higher rate dominates, so only each size's best config is tried.
    """
    bp, bd = _best_per_size(pre), _best_per_size(dec)
    best = None
    for p in bp.values():
        for d in bd.values():
            if p.cfg.num_gpus + d.cfg.num_gpus > num_gpus:
                continue
            for n in range(1, (num_gpus - d.cfg.num_gpus) // p.cfg.num_gpus + 1):
                m = (num_gpus - n * p.cfg.num_gpus) // d.cfg.num_gpus
                sys = min(n * p.rate, m * d.rate)
                if best is None or sys > best[3] + 1e-12:
                    best = (p, d, (n, m), sys)
    return best


@dataclass
class SplitRow:
    name: str
    prefill_gpus: int
    decode_gpus: int
    prefill: StageRate | None
    decode: StageRate | None
    counts: tuple[int, int]
    rate: float  # requests/s of the whole system
    tok_s_per_gpu: float  # output tokens/s per GPU of the cluster


@dataclass
class PlanResult:
    model: ModelSpec
    cluster: Cluster
    workload: Workload
    slo: SLO
    knobs: Knobs
    prefill: StageRate
    decode: StageRate
    counts: tuple[int, int]
    rate: float
    tok_s_per_gpu: float
    splits: list[SplitRow] = field(default_factory=list)
    baselines: list[SplitRow] = field(default_factory=list)
    exhaustive_tok_s_per_gpu: float = 0.0
    bisect_matches_scan: bool = True
    degraded: str = ""

    @property
    def best_split(self) -> SplitRow | None:
        rows = [r for r in self.splits if r.rate > 0]
        return max(rows, key=lambda r: r.tok_s_per_gpu) if rows else None


def _pool_best(rows: list[StageRate], pool: int) -> tuple[StageRate | None, int]:
    """Best total rate of one stage's pool of ``pool`` GPUs filled with copies of one config."""
    best, count = None, 0
    for r in rows:
        if r.feasible and r.cfg.num_gpus <= pool:
            k = pool // r.cfg.num_gpus
            if best is None or k * r.rate > count * best.rate + 1e-12:
                best, count = r, k
    return best, count


def _split_row(name, pre, dec, p_gpus, d_gpus, n_gpus, osl) -> SplitRow:
    p, n = _pool_best(pre, p_gpus)
    d, m = _pool_best(dec, d_gpus)
    rate = min(n * p.rate, m * d.rate) if p and d else 0.0
    return SplitRow(name, p_gpus, d_gpus, p, d, (n, m), rate, rate * osl / n_gpus)


def validate(model: ModelSpec, cluster: Cluster, workload: Workload, slo: SLO, knobs: Knobs) -> None:
    """Raise ``PlanError`` with one clear sentence for input the planner cannot plan."""
    if workload.isl < 1 or workload.osl < 1:
        raise PlanError(f"input/output lengths must be >= 1 token (got isl={workload.isl}, osl={workload.osl})")
    if not 0.0 <= workload.cache_hit < 1.0:
        raise PlanError(f"cache hit rate must be in [0, 1) (got {workload.cache_hit})")
    if workload.rate is not None and workload.rate <= 0:
        raise PlanError(f"rate must be > 0 requests/s (got {workload.rate})")
    if workload.concurrency is not None and workload.concurrency < 1:
        raise PlanError(f"concurrency must be >= 1 (got {workload.concurrency})")
    if slo.ttft_s <= 0 or slo.tpot_s <= 0:
        raise PlanError(f"SLOs must be > 0 seconds (got TTFT {slo.ttft_s}, TPOT {slo.tpot_s})")
    if cluster.num_nodes < 1:
        raise PlanError(f"the cluster needs >= 1 node (got {cluster.num_nodes})")
    if knobs.attention_cost not in ("paper", "model"):
        raise PlanError(f"attention cost must be 'paper' or 'model' (got {knobs.attention_cost!r})")
    g_min = min_instance_gpus(model, cluster.hardware, knobs)
    if 2 * g_min > cluster.num_gpus:
        raise PlanError(
            f"{model.name} needs {g_min} GPUs of {cluster.hardware.memory_bytes / 1e9:.0f} GB at "
            f"{knobs.mem_util:.0%} use per instance; one prefill + one decode instance need {2 * g_min}, "
            f"the cluster has {cluster.num_gpus}")


def plan(model: ModelSpec, cluster: Cluster, workload: Workload, slo: SLO, knobs: Knobs = Knobs(),
         degrade: bool = False) -> PlanResult:
    """Run RCSD and its baselines; see the module docstring. Raises ``PlanError`` on bad input."""
    validate(model, cluster, workload, slo, knobs)
    hw, n_gpus = cluster.hardware, cluster.num_gpus
    g_min = min_instance_gpus(model, hw, knobs)
    max_stage = n_gpus - g_min
    pre = stage_table("prefill", model, cluster, workload, slo, knobs, max_stage)
    dec = stage_table("decode", model, cluster, workload, slo, knobs, max_stage)
    degraded = ""
    if not any(r.feasible for r in pre) or not any(r.feasible for r in dec):
        # Flexible degradation: the SLO that nothing meets is relaxed to the closest reachable latency.
        best_ttft = min(r.latency_s for r in pre)
        best_tpot = min(r.latency_s for r in dec)
        ttft = slo.ttft_s if any(r.feasible for r in pre) else best_ttft * 1.25
        tpot = slo.tpot_s if any(r.feasible for r in dec) else best_tpot * 1.25
        if not degrade or not (math.isfinite(ttft) and math.isfinite(tpot)):
            raise PlanError(
                f"no configuration meets the SLO (best reachable TTFT {best_ttft:.3g} s vs {slo.ttft_s} s, "
                f"TPOT {best_tpot:.3g} s vs {slo.tpot_s} s); relax the SLO or pass --degrade")
        degraded = f"SLO relaxed to the closest reachable: TTFT {ttft:.3g} s, TPOT {tpot:.3g} s"
        slo = SLO(ttft, tpot)
        pre = stage_table("prefill", model, cluster, workload, slo, knobs, max_stage, ttft_slo=ttft)
        dec = stage_table("decode", model, cluster, workload, slo, knobs, max_stage, tpot_slo=tpot)

    # Algorithm 1 lines 14-16: best prefill, decode sorted by rate, binary search for the closest.
    # "paper": the single best prefill (rate per GPU, then rate) and one bisect at its rate. "ratio":
    # the best prefill of every instance size, and one bisect per replication ratio n:m that fits
    # (target n x rate_P / m); the best system rate wins.
    offered = workload.rate
    if offered is None and workload.concurrency is not None:
        offered = workload.concurrency / (slo.ttft_s + workload.osl * slo.tpot_s)  # Little's law at the SLO
    p_ok = [r for r in pre if r.feasible]
    if knobs.search == "ratio":
        p_cands = sorted(_best_per_size(p_ok).values(), key=lambda r: r.cfg.num_gpus)
    else:
        p_cands = [max(p_ok, key=lambda r: (r.rate_per_gpu, r.rate))]
    best = None
    matches = True
    for best_p in p_cands:
        d_ok = pareto_by_rate([r for r in dec if r.feasible and r.cfg.num_gpus <= n_gpus - best_p.cfg.num_gpus])
        if not d_ok:
            continue
        rates = [r.rate for r in d_ok]
        ratios = [(1, 1)]
        if knobs.search == "ratio":
            m_max = n_gpus // d_ok[0].cfg.num_gpus
            ratios = [(n, m) for n in range(1, n_gpus // best_p.cfg.num_gpus + 1) for m in range(1, m_max + 1)]
        for n, m in ratios:
            target = best_p.rate * n / m
            j = closest_by_bisect(rates, target)
            matches &= closest_by_scan(rates, target) == j
            cand = d_ok[j]
            if n * best_p.cfg.num_gpus + m * cand.cfg.num_gpus > n_gpus:
                continue
            counts = replicate(best_p, cand, n_gpus, offered)
            sys_rate = _system_rate(best_p, cand, counts)
            if best is None or sys_rate > best[3] + 1e-12:
                best = (best_p, cand, counts, sys_rate)
    if best is None:
        raise PlanError("no prefill and decode configuration fit the cluster together")
    best_p, best_d, counts, sys_rate = best
    result = PlanResult(model, cluster, workload, slo, knobs, best_p, best_d, counts, sys_rate,
                        sys_rate * workload.osl / n_gpus, degraded=degraded, bisect_matches_scan=matches)
    ex = best_pair_exhaustive(pre, dec, n_gpus)
    result.exhaustive_tok_s_per_gpu = ex[3] * workload.osl / n_gpus if ex else 0.0

    # Every P:D split in steps of the smallest instance (in nodes), and the baselines.
    gpn = hw.gpus_per_node
    step = max(1, math.ceil(g_min / gpn))
    for p_nodes in range(step, cluster.num_nodes - step + 1, step):
        d_nodes = cluster.num_nodes - p_nodes
        result.splits.append(_split_row(f"{p_nodes}P{d_nodes}D", pre, dec, p_nodes * gpn, d_nodes * gpn,
                                        n_gpus, workload.osl))
    g_col = knobs.colocated_gpus or 2 ** math.ceil(math.log2(g_min))  # the paper: 8 services x 2 nodes
    col = [r for r in stage_table("colocated", model, cluster, workload, slo, knobs, g_col) if r.cfg.num_gpus == g_col]
    c, k = _pool_best(col, n_gpus)
    c_rate = k * c.rate if c else 0.0
    result.baselines.append(SplitRow("colocated", n_gpus, 0, c, None, (k, 0), c_rate,
                                     c_rate * workload.osl / n_gpus))
    # Splitwise-style: a fixed P:D ratio, and one parallel configuration (the colocated one) for both pools.
    sp, sd = knobs.splitwise_ratio
    p_nodes = max(step, round(cluster.num_nodes * sp / (sp + sd) / step) * step)
    p_nodes = min(p_nodes, cluster.num_nodes - step)
    same = c.cfg if c else best_p.cfg
    pre_same = [r for r in pre if r.cfg == same]
    dec_same = [r for r in dec if r.cfg == same]
    result.baselines.append(_split_row(f"splitwise {p_nodes}P{cluster.num_nodes - p_nodes}D ({same.label()})",
                                       pre_same, dec_same, p_nodes * gpn, (cluster.num_nodes - p_nodes) * gpn,
                                       n_gpus, workload.osl))
    return result


def _fmt_stage(r: StageRate | None, count: int) -> str:
    if r is None:
        return "-"
    return f"{count} x {r.cfg.label()} ({r.cfg.num_gpus} GPU, {r.rate:.2f} req/s each)"


def format_plan(res: PlanResult) -> str:
    """The chosen split, instances and parallelism per stage, tok/s/GPU and the table of splits."""
    n_gpus = res.cluster.num_gpus
    p, d, (n, m) = res.prefill, res.decode, res.counts
    used = n * p.cfg.num_gpus + m * d.cfg.num_gpus
    lines = [
        f"model {res.model.name} on {res.cluster.num_nodes} x {res.cluster.hardware.gpus_per_node} "
        f"{res.cluster.hardware.name} ({n_gpus} GPUs); ISL {res.workload.isl} OSL {res.workload.osl} "
        f"cache hit {res.workload.cache_hit:.0%}; SLO TTFT {res.slo.ttft_s} s TPOT {res.slo.tpot_s} s",
    ]
    if res.degraded:
        lines.append(f"degraded: {res.degraded}")
    lines += [
        f"chosen: {n * p.cfg.num_gpus} prefill GPUs : {m * d.cfg.num_gpus} decode GPUs ({used} of {n_gpus} used)",
        f"  prefill {_fmt_stage(p, n)}  TTFT {p.latency_s * 1e3:.0f} ms, batch {p.batch}",
        f"  decode  {_fmt_stage(d, m)}  TPOT {d.latency_s * 1e3:.1f} ms, batch {d.batch}",
        f"  system {res.rate:.2f} req/s, {res.tok_s_per_gpu:.1f} output tok/s per GPU "
        f"(exhaustive optimum {res.exhaustive_tok_s_per_gpu:.1f}; bisect == scan: {res.bisect_matches_scan})",
        "",
        f"{'split':<34} {'prefill':<44} {'decode':<44} {'req/s':>8} {'tok/s/GPU':>10}",
    ]
    best = res.best_split
    for r in res.splits + res.baselines:
        mark = " *" if r is best else ""
        lines.append(f"{r.name + mark:<34} {_fmt_stage(r.prefill, r.counts[0]):<44} "
                     f"{_fmt_stage(r.decode, r.counts[1]):<44} {r.rate:>8.2f} {r.tok_s_per_gpu:>10.1f}")
    lines.append(f"{'RCSD (chosen)':<34} {_fmt_stage(p, n):<44} {_fmt_stage(d, m):<44} "
                 f"{res.rate:>8.2f} {res.tok_s_per_gpu:>10.1f}")
    return "\n".join(lines)
