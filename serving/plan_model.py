"""The RCSD planner's inputs and data model: model, cluster, workload, SLOs, knobs, configurations.

``ModelSpec`` and the built-in ``MODELS`` (DeepSeek-R1, Qwen-32B), ``Cluster``, ``Workload``, ``SLO``, the
model constants ``Knobs``, one parallel configuration ``ParallelConfig`` (``TP x PP x DP x EP``), one
configuration's rating ``StageRate`` and ``PlanError``. Rates are requests/s.

The planner is ``serving.plan`` (overview, public names, report), ``serving.plan_latency`` (the latency
model that rates a configuration) and ``serving.plan_search`` (the search and ``plan``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .hardware import Hardware

from . import ServingError

__all__ = ["PlanError", "ModelSpec", "MODELS", "Cluster", "Workload", "SLO", "Knobs", "ParallelConfig", "StageRate"]


class PlanError(ServingError, ValueError):
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
