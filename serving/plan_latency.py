"""RCSD's latency model: enumerate an instance's parallel configurations and rate each one per stage.

``enumerate_configs`` lists every ``TP x PP x DP x EP = G`` (the paper's eq. 17, per stage);
``rate_prefill`` (TTFT including queueing), ``rate_decode`` (TPOT at the largest batch that meets it)
and ``rate_colocated`` (the non-disaggregated baseline) rate one configuration in requests/s per instance.
The search over these ratings is ``serving.plan_search``; the overview is ``serving.plan``.

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

import math
from dataclasses import replace

from .hardware import Hardware
from .plan_model import SLO, Knobs, ModelSpec, ParallelConfig, StageRate, Workload

__all__ = ["enumerate_configs", "weight_bytes_per_gpu", "kv_capacity_bytes", "rate_prefill", "rate_decode",
           "rate_colocated"]


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
