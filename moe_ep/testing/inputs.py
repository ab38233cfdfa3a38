"""Random test inputs for dispatch/combine, drawn per rank from ``seed + rank``.

Every rank can rebuild every other rank's inputs (same seeds), so each process computes the
single-process reference for its own outputs without extra communication.
"""

from __future__ import annotations

import dataclasses

import torch

from ..fp8 import per_token_group_quant_fp8_ref

__all__ = ["RankInputs", "make_rank_inputs", "make_all_inputs", "make_expert_weights", "make_elastic_buffer"]


@dataclasses.dataclass
class RankInputs:
    x: torch.Tensor  # [N, H] bf16; column 0 = rank, column 1 = token index (exact in bf16 up to 256)
    topk_idx: torch.Tensor  # [N, K] int64, -1 holes
    topk_weights: torch.Tensor  # [N, K] float32
    x_fp8: torch.Tensor  # [N, H] e4m3 (quantized x)
    x_scales: torch.Tensor  # [N, H/128] float32


def make_rank_inputs(rank: int, num_tokens: int, hidden: int, num_experts: int, num_topk: int, seed: int,
                     world_size: int, routing: str = "random", hole_prob: float = 0.15) -> RankInputs:
    """``routing``: ``"random"`` (distinct experts per token, ``hole_prob`` of entries -1),
    ``"one_expert"`` (every token selects expert 0 only), ``"skip_last_rank"`` (no token selects an
    expert of the last rank, so it receives nothing)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = (torch.randn(num_tokens, hidden, generator=g) * 2).to(torch.bfloat16)
    if hidden >= 2:
        x[:, 0] = rank
        x[:, 1] = torch.arange(num_tokens).to(torch.bfloat16)
    num_local = num_experts // world_size
    allowed = num_experts - (num_local if routing == "skip_last_rank" and world_size > 1 else 0)
    if routing == "one_expert":
        topk_idx = torch.full((num_tokens, num_topk), -1, dtype=torch.int64)
        topk_idx[:, 0] = 0
    else:
        k = min(num_topk, allowed)
        scores = torch.rand(num_tokens, allowed, generator=g)
        topk_idx = torch.full((num_tokens, num_topk), -1, dtype=torch.int64)
        topk_idx[:, :k] = scores.argsort(dim=1)[:, :k]
        holes = torch.rand(num_tokens, num_topk, generator=g) < hole_prob
        topk_idx[holes] = -1
    topk_weights = torch.rand(num_tokens, num_topk, generator=g).float()
    q, s = per_token_group_quant_fp8_ref(x, 128) if hidden % 128 == 0 else (x.to(torch.float8_e4m3fn), None)
    return RankInputs(x, topk_idx, topk_weights, q, s)


def make_all_inputs(world_size: int, num_tokens, hidden: int, num_experts: int, num_topk: int, seed: int,
                    routing: str = "random") -> list:
    """Inputs of every rank; ``num_tokens`` is an int or a per-rank list."""
    if isinstance(num_tokens, int):
        num_tokens = [num_tokens] * world_size
    return [make_rank_inputs(r, num_tokens[r], hidden, num_experts, num_topk, seed, world_size, routing)
            for r in range(world_size)]


def make_expert_weights(num_experts: int, hidden: int, intermediate: int, seed: int):
    """Float32 weights of ``num_experts`` SwiGLU experts, the same on every rank for a seed: ``w13``
    `[E, 2I, H]` (gate rows, then up rows) and ``w2`` `[E, H, I]`, scaled by ``1/sqrt(fan-in)``."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, intermediate, generator=g) / intermediate ** 0.5
    return w13, w2


def make_elastic_buffer(backend: str, world_size: int, num_max_tokens_per_rank: int, hidden: int, num_topk: int,
                        **kwargs):
    """A :class:`moe_ep.ElasticBuffer` for forked CPU ranks: ``symm`` on shared memory sized by the size hint
    for these shapes, ``torch`` as is; a 30 s timeout unless ``kwargs`` says otherwise."""
    import moe_ep
    from moe_ep.backends.symm import SymmBackend

    if backend == "symm":
        kwargs.update(provider="shm", num_bytes=SymmBackend.get_normal_size_hint(num_max_tokens_per_rank, hidden,
                                                                                   num_topk, world_size))
    kwargs.setdefault("timeout_s", 30)
    return moe_ep.ElasticBuffer(None, num_max_tokens_per_rank=num_max_tokens_per_rank, hidden=hidden,
                                num_topk=num_topk, backend=backend, **kwargs)
