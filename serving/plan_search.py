"""RCSD's search (Algorithm 1): rate tables per stage, prefill-decode matching, replication, ``plan``.

``stage_table`` rates every configuration of every instance size (``serving.plan_latency``); ``plan``
takes the best prefill configuration, sorts the decode configurations by rate (``pareto_by_rate``) and
binary-searches the one closest to it (``closest_by_bisect``, Algorithm 1, lines 14-16), then
replicates both by the rate ratio (``replicate``). It also fills the table of every P:D split, the
colocated and Splitwise-style baselines, and the exhaustive optimum (``best_pair_exhaustive``) as a
check. The overview is ``serving.plan``; the result is printed by ``serving.plan.format_plan``.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from .hardware import Hardware
from .plan_latency import _pow2_upto, enumerate_configs, rate_colocated, rate_decode, rate_prefill
from .plan_model import SLO, Cluster, Knobs, ModelSpec, PlanError, StageRate, Workload

__all__ = ["min_instance_gpus", "stage_table", "pareto_by_rate", "closest_by_bisect", "closest_by_scan",
           "replicate", "best_pair_exhaustive", "SplitRow", "PlanResult", "validate", "plan"]


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
    """Run RCSD and its baselines; see the ``serving.plan`` docstring. Raises ``PlanError`` on bad input."""
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
