"""Cost model of one DeepSeek-V3/R1-class decoder iteration under attention DP + MoE EP.

Pure functions over a hardware row (``serving.hardware``) and a model shape; the simulator calls
``CostModel.iteration_time`` once per iteration with per-rank vectors. Each component is a roofline
``max(flops / (peak * eff), bytes / (bw * eff))`` per layer, summed over layers:

- attention module (per DP rank, the slowest rank gates the iteration): MLA projections on the
  rank's tokens, the attention core (causal prefill sum, absorbed decode over each request's KV),
  weight and KV-cache reads;
- shared expert and the dense FFN of the first layers (per DP rank: each rank runs its own tokens);
- routed experts (EP): total selections / EP ranks times an imbalance factor (what EPLB leaves);
- dispatch + combine, bytes counted as ``moe_ep`` counts them (see ``a2a_bytes``), gated by the
  rank that sends the most rows.

What it leaves out (stated so the ADP numbers can be read correctly): kernel launch gaps beyond a
fixed per-layer overhead, overlap of communication with compute (two-microbatch), MTP draft tokens,
sampling / detokenisation, NVFP4 (the seed's GB200 run) since the hardware table has no FP4 rate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .hardware import Hardware

__all__ = ["ModelSpec", "DEEPSEEK_V3", "CostModel", "LinearCost", "a2a_bytes", "expected_ranks_per_token"]


@dataclass(frozen=True)
class ModelSpec:
    """Shape of an MLA + MoE decoder. Defaults: DeepSeek-V3 / R1 ``config.json`` (public on the HF hub)."""

    name: str = "DeepSeek-V3"
    hidden: int = 7168
    num_layers: int = 61
    num_dense_layers: int = 3  # first_k_dense_replace
    num_heads: int = 128
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    num_experts: int = 256  # n_routed_experts
    num_shared_experts: int = 1
    num_topk: int = 8  # num_experts_per_tok
    moe_inter: int = 2048  # moe_intermediate_size
    dense_inter: int = 18432  # intermediate_size
    vocab: int = 129280
    num_params: float = 671e9

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    @property
    def attn_proj_params(self) -> int:
        """MLA projection weights per layer (q_a, q_b, kv_a, kv_b / absorbed W_UK+W_UV, o)."""
        h, nh = self.hidden, self.num_heads
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        return (h * self.q_lora_rank + self.q_lora_rank * nh * qk + h * (self.kv_lora_rank + self.qk_rope_head_dim)
                + self.kv_lora_rank * nh * (self.qk_nope_head_dim + self.v_head_dim) + nh * self.v_head_dim * h)

    @property
    def kv_elems_per_token_layer(self) -> int:
        """Compressed MLA cache per token per layer: latent + rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.moe_inter  # gate, up, down


DEEPSEEK_V3 = ModelSpec()


def expected_ranks_per_token(num_topk: int, num_ranks: int) -> float:
    """Expected distinct EP ranks among a token's top-k experts (uniform routing, experts split evenly)."""
    if num_ranks <= 1:
        return 1.0
    return num_ranks * (1.0 - (1.0 - 1.0 / num_ranks) ** num_topk)


def a2a_bytes(num_tokens: float, hidden: int, num_topk: int, num_ranks: int, low_latency: bool) -> tuple[float, float]:
    """Bytes one rank sends for dispatch and for combine in one MoE layer, counted as ``moe_ep`` counts them.

    Normal mode moves one row per (token, destination rank): FP8 dispatch ``H + H/32`` (payload plus
    1x128 float32 scales), BF16 combine ``2H``. Low-latency mode moves one row per selection: dispatch
    ``H + H/32 + 16`` (payload, scales, source index / metadata), combine ``2H``.

    Returns:
        ``(dispatch_bytes, combine_bytes)`` as floats.
    """
    if low_latency:
        rows = num_tokens * num_topk
        return rows * (hidden + hidden // 32 + 16), rows * 2 * hidden
    rows = num_tokens * expected_ranks_per_token(num_topk, num_ranks)
    return rows * (hidden + hidden // 32), rows * 2 * hidden


@dataclass(frozen=True)
class CostModel:
    """Iteration time of an attention-DP x MoE-EP group of ``num_ranks`` GPUs.

    Arguments:
        hw: the GPU row.
        model: the model shape.
        num_ranks: DP size = EP size.
        weight_bytes / kv_bytes / act_bytes: bytes per element (FP8 weights and KV cache by default).
        eff_gemm, eff_attn, eff_bw, eff_link: achieved fraction of the peak for GEMMs (8-bit), the
            attention core (BF16), HBM and the links.
        moe_imbalance: max/mean expert load per rank left after EPLB.
        low_latency: dispatch/combine mode (per-selection rows) vs normal (per token-rank rows).
        layer_overhead_s: fixed time per layer (launches, norms, router, small kernels).
        iter_overhead_s: fixed time per iteration (scheduler, sampling, host work).
    """

    hw: Hardware
    model: ModelSpec = field(default=DEEPSEEK_V3)
    num_ranks: int = 8
    weight_bytes: float = 1.0
    kv_bytes: float = 1.0
    act_bytes: float = 2.0
    eff_gemm: float = 0.6
    eff_attn: float = 0.5
    eff_bw: float = 0.8
    eff_link: float = 0.7
    moe_imbalance: float = 1.1
    low_latency: bool = False
    layer_overhead_s: float = 20e-6
    iter_overhead_s: float = 2e-3

    # --- per-rank parts (vectorised over ranks) -------------------------------------------------

    def attention_time(self, num_tokens: np.ndarray, ctx_kv_sum: np.ndarray, gen_kv_sum: np.ndarray) -> np.ndarray:
        """Attention-module seconds per rank for one iteration (all layers).

        Arguments:
            num_tokens: `[R]` tokens the rank processes (context tokens + one per generation request).
            ctx_kv_sum: `[R]` sum over context tokens of the key length each attends to (causal).
            gen_kv_sum: `[R]` sum over generation requests of their KV length.
        """
        m, hw = self.model, self.hw
        nh = m.num_heads
        proj_flops = 2.0 * m.attn_proj_params * num_tokens
        # Prefill core (non-absorbed, per head q.k over nope+rope, p.v over v), decode core (absorbed,
        # q over latent+rope, p over latent): 2 FLOPs per MAC.
        core_flops = (2.0 * nh * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * ctx_kv_sum
                      + 2.0 * nh * (m.kv_elems_per_token_layer + m.kv_lora_rank) * gen_kv_sum)
        flops_t = proj_flops / (hw.peak_flops_fp8 * self.eff_gemm) + core_flops / (hw.peak_flops_bf16 * self.eff_attn)
        weights = np.where(num_tokens > 0, m.attn_proj_params * self.weight_bytes, 0.0)
        kv_read = gen_kv_sum * m.kv_elems_per_token_layer * self.kv_bytes
        bytes_t = (weights + kv_read + num_tokens * m.hidden * self.act_bytes * 4) / (hw.hbm_bytes_per_s * self.eff_bw)
        return m.num_layers * np.maximum(flops_t, bytes_t)

    def dp_ffn_time(self, num_tokens: np.ndarray) -> np.ndarray:
        """Seconds per rank of the FFN work each DP rank does on its own tokens: shared experts in the
        MoE layers, the dense FFN of the first layers, and the LM head."""
        m, hw = self.model, self.hw
        eff_f = hw.peak_flops_fp8 * self.eff_gemm
        eff_b = hw.hbm_bytes_per_s * self.eff_bw
        shared_p = m.num_shared_experts * m.expert_params
        dense_p = 3 * m.hidden * m.dense_inter
        head_p = m.hidden * m.vocab
        live = num_tokens > 0
        t_shared = np.maximum(2.0 * shared_p * num_tokens / eff_f, np.where(live, shared_p * self.weight_bytes, 0) / eff_b)
        t_dense = np.maximum(2.0 * dense_p * num_tokens / eff_f, np.where(live, dense_p * self.weight_bytes, 0) / eff_b)
        t_head = np.maximum(2.0 * head_p * num_tokens / eff_f, np.where(live, head_p * self.weight_bytes, 0) / eff_b)
        return m.num_moe_layers * t_shared + m.num_dense_layers * t_dense + t_head

    # --- EP parts (scalar: the group moves in lock step) ----------------------------------------

    def routed_expert_time(self, total_tokens: float) -> float:
        """Seconds of the routed experts on the busiest EP rank, all MoE layers."""
        m, hw, r = self.model, self.hw, self.num_ranks
        if total_tokens <= 0:
            return 0.0
        sel = total_tokens * m.num_topk / r * self.moe_imbalance
        flops = 2.0 * m.expert_params * sel
        local = m.num_experts / r
        # Only experts that receive a token are read; at large batches that is all of them.
        touched = local * (1.0 - np.exp(-sel / local))
        weights = touched * m.expert_params * self.weight_bytes
        t = max(flops / (hw.peak_flops_fp8 * self.eff_gemm), weights / (hw.hbm_bytes_per_s * self.eff_bw))
        return m.num_moe_layers * t

    def a2a_time(self, max_rank_tokens: float, total_tokens: float) -> float:
        """Seconds of dispatch + combine, all MoE layers: gated by the rank that sends (and, for
        combine, receives back) the most rows; receive side is the average with imbalance."""
        m, hw, r = self.model, self.hw, self.num_ranks
        if r <= 1 or total_tokens <= 0:
            return 0.0
        link = hw.intra_node_bytes_per_s if r <= hw.gpus_per_node else hw.inter_node_bytes_per_s
        send_d, send_c = a2a_bytes(max_rank_tokens, m.hidden, m.num_topk, r, self.low_latency)
        recv_d, recv_c = a2a_bytes(total_tokens / r * self.moe_imbalance, m.hidden, m.num_topk, r, self.low_latency)
        # Only the (r-1)/r share leaves the GPU.
        off = (r - 1) / r
        t = (max(send_d, recv_d) + max(send_c, recv_c)) * off / (link * self.eff_link)
        return m.num_moe_layers * t

    def iteration_time(self, num_tokens: np.ndarray, ctx_kv_sum: np.ndarray, gen_kv_sum: np.ndarray) -> float:
        """Seconds of one iteration: slowest rank's DP part + the EP part + fixed overheads."""
        num_tokens = np.asarray(num_tokens, dtype=np.float64)
        dp = self.attention_time(num_tokens, np.asarray(ctx_kv_sum, np.float64), np.asarray(gen_kv_sum, np.float64))
        dp = dp + self.dp_ffn_time(num_tokens)
        total = float(num_tokens.sum())
        ep = self.routed_expert_time(total) + self.a2a_time(float(num_tokens.max()), total)
        return float(dp.max()) + ep + self.model.num_layers * self.layer_overhead_s + self.iter_overhead_s

    def breakdown(self, num_tokens: np.ndarray, ctx_kv_sum: np.ndarray, gen_kv_sum: np.ndarray) -> dict[str, float]:
        """The iteration's parts in seconds (attention and DP FFN of the slowest rank)."""
        num_tokens = np.asarray(num_tokens, dtype=np.float64)
        att = self.attention_time(num_tokens, np.asarray(ctx_kv_sum, np.float64), np.asarray(gen_kv_sum, np.float64))
        ffn = self.dp_ffn_time(num_tokens)
        i = int(np.argmax(att + ffn))
        total = float(num_tokens.sum())
        return {"attention": float(att[i]), "dp_ffn": float(ffn[i]), "experts": self.routed_expert_time(total),
                "a2a": self.a2a_time(float(num_tokens.max()), total),
                "overhead": self.model.num_layers * self.layer_overhead_s + self.iter_overhead_s}

    # --- memory ---------------------------------------------------------------------------------

    def kv_bytes_per_token(self) -> float:
        return self.model.num_layers * self.model.kv_elems_per_token_layer * self.kv_bytes

    def kv_capacity_tokens(self, kv_cache_frac: float = 0.85, reserve_bytes: float = 4e9) -> int:
        """KV tokens one rank holds: ``kv_cache_frac`` of what is left after the weights (all experts
        split over EP, attention and dense parts replicated per DP rank) and an activation reserve."""
        m = self.model
        replicated = (m.num_layers * m.attn_proj_params + m.num_dense_layers * 3 * m.hidden * m.dense_inter
                      + m.num_moe_layers * m.num_shared_experts * m.expert_params + 2 * m.hidden * m.vocab)
        experts = m.num_moe_layers * m.num_experts * m.expert_params
        weights = (replicated + experts / self.num_ranks) * self.weight_bytes
        free = self.hw.memory_bytes - weights - reserve_bytes
        if free <= 0:
            raise ValueError(f"{m.name} does not fit on {self.num_ranks} x {self.hw.name}: weights need "
                             f"{weights / 1e9:.0f} GB of {self.hw.memory_bytes / 1e9:.0f} GB per GPU")
        return int(kv_cache_frac * free / self.kv_bytes_per_token())


@dataclass(frozen=True)
class LinearCost:
    """Token-linear iteration time: ``c0 + c_tok * max_r tokens_r + c_total * sum_r tokens_r``.

    The seed's own modelling assumption (attention time linear in tokens); used by the tests' worked
    example and as an ablation of the roofline model.
    """

    c0: float = 1e-3
    c_tok: float = 1e-5
    c_total: float = 0.0

    def iteration_time(self, num_tokens: np.ndarray, ctx_kv_sum: np.ndarray, gen_kv_sum: np.ndarray) -> float:
        t = np.asarray(num_tokens, dtype=np.float64)
        return self.c0 + self.c_tok * float(t.max()) + self.c_total * float(t.sum())
