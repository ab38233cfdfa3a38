"""RCSD: PD resource configuration and strategy deployment (seed 000), as an offline planner.

Given a model, a cluster, a workload and SLOs, the planner

1. enumerates every instance size G that holds the weights and every parallel configuration
   ``TP x PP x DP x EP = G`` (the paper's eq. 17, per stage), for prefill and for decode;
2. rates each configuration with RCSD's latency model (eqs. 1-11, "consistent" reading, in
   ``serving.plan_latency``) and the SLO (TTFT for prefill including queueing, TPOT for decode at the
   largest batch that meets it);
3. takes the best prefill configuration, sorts the decode configurations by rate and binary-searches
   the one closest to it (Algorithm 1, lines 14-16);
4. replicates both by the rate ratio (``n = ceil(R / rate_P)``, ``m = ceil(R / rate_D)`` for an offered
   rate R; without R, the largest ``(n, m)`` that fits the cluster with ``min(n rate_P, m rate_D)``
   maximal).

Rates are requests/s so that prefill and decode can be matched (SEEDS B.3). Throughput is reported as
output tokens/s per GPU of the cluster.

The latency model (SEEDS B.2, eqs. 1-11) and the layout inside an instance are described in
``serving.plan_latency``. The planner is split by purpose:

- ``serving.plan_model``: inputs and data model (``ModelSpec``, ``MODELS``, ``Cluster``, ``Workload``,
  ``SLO``, ``Knobs``, ``ParallelConfig``, ``StageRate``, ``PlanError``);
- ``serving.plan_latency``: configuration enumeration, memory and the latency model
  (``enumerate_configs``, ``rate_prefill``, ``rate_decode``, ``rate_colocated``);
- ``serving.plan_search``: the search (``stage_table``, ``pareto_by_rate``, ``closest_by_bisect``,
  ``replicate``, ``best_pair_exhaustive``, ``plan``);
- this module: every name above, re-exported, and the text report ``format_plan``.
"""

from __future__ import annotations

# Names outside ``__all__`` stay importable from here as before (``x as x`` marks the re-export).
from .plan_latency import _flops_per_token_layer as _flops_per_token_layer
from .plan_latency import _pow2_upto as _pow2_upto
from .plan_latency import _prefill_batch as _prefill_batch
from .plan_latency import _split as _split
from .plan_latency import _stage_time as _stage_time
from .plan_latency import _tpot as _tpot
from .plan_latency import enumerate_configs, rate_colocated, rate_decode, rate_prefill
from .plan_latency import kv_capacity_bytes as kv_capacity_bytes
from .plan_latency import weight_bytes_per_gpu as weight_bytes_per_gpu
from .plan_model import (MODELS, SLO, Cluster, Knobs, ModelSpec, ParallelConfig, PlanError, StageRate,
                                Workload)
from .plan_model import _deepseek_r1 as _deepseek_r1
from .plan_model import _qwen_32b as _qwen_32b
from .plan_search import (PlanResult, best_pair_exhaustive, closest_by_bisect, closest_by_scan, pareto_by_rate,
                                 plan, replicate, stage_table)
from .plan_search import SplitRow as SplitRow
from .plan_search import _best_per_size as _best_per_size
from .plan_search import _pool_best as _pool_best
from .plan_search import _split_row as _split_row
from .plan_search import _system_rate as _system_rate
from .plan_search import min_instance_gpus as min_instance_gpus
from .plan_search import validate as validate

__all__ = [
    "ModelSpec", "MODELS", "Cluster", "Workload", "SLO", "Knobs", "ParallelConfig", "StageRate",
    "PlanError", "enumerate_configs", "rate_prefill", "rate_decode", "rate_colocated", "stage_table",
    "pareto_by_rate", "closest_by_bisect", "closest_by_scan", "replicate", "best_pair_exhaustive", "plan", "format_plan",
]


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
