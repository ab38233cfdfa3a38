"""The dispatch layout on the device: what each rank sends, per rank and per expert.

One program per block of tokens: ``is_token_in_rank[t, r]`` (any of the token's experts lives on
rank ``r``), and the block's counts added atomically into ``num_tokens_per_rank`` and (through a
histogram of the block's expert ids) ``num_tokens_per_expert``. Nothing is read on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import INTERPRET

__all__ = ["dispatch_layout"]


@triton.jit
def _layout_kernel(
    topk_ptr,  # [N, K] int64, -1 = no expert
    in_rank_ptr,  # [N, R] int8 out
    per_rank_ptr,  # [R] int32, zero-initialised
    per_expert_ptr,  # [E + 1] int32, zero-initialised; bin E collects the -1 holes
    bad_ptr,  # [1] int32, zero-initialised: set to 1 if an id is >= E (counted nowhere, never silently)
    N, E, L,
    K: tl.constexpr, KP: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, EB: tl.constexpr, BLOCK_T: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = offs_t < N
    kk = tl.arange(0, KP)
    m = t_ok[:, None] & (kk < K)[None, :]
    e = tl.load(topk_ptr + offs_t.to(tl.int64)[:, None] * K + kk[None, :], mask=m, other=-1)
    bad = (e >= E) & m
    valid = (e >= 0) & (e < E)
    tl.atomic_max(bad_ptr, tl.max(tl.max(bad.to(tl.int32), axis=1), axis=0))
    # Step 1: per-expert histogram of the block (holes and padding go to bin E).
    bins = tl.where(valid & m, e, E).to(tl.int32)
    hist = tl.histogram(tl.reshape(bins, [BLOCK_T * KP]), EB)
    eb = tl.arange(0, EB)
    tl.atomic_add(per_expert_ptr + eb, hist, mask=eb <= E)
    # Step 2: ranks touched by each token (NOTES: guard e >= 0: -1 // L is 0 in the interpreter).
    owner = tl.where(valid, e // L, -1)
    rr = tl.arange(0, RP)
    hit = tl.max((owner[:, :, None] == rr[None, None, :]).to(tl.int32), axis=1)  # [BLOCK_T, RP]
    tl.store(in_rank_ptr + offs_t.to(tl.int64)[:, None] * R + rr[None, :], hit.to(tl.int8),
             mask=t_ok[:, None] & (rr < R)[None, :])
    tl.atomic_add(per_rank_ptr + rr, tl.sum(tl.where(t_ok[:, None], hit, 0), axis=0), mask=rr < R)


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, world_size: int, bad_flag: torch.Tensor = None):
    """``(num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32, is_token_in_rank [N, R] bool)``
    for a validated ``topk_idx`` `[N, K]` int64 (bitwise what ``moe_ep.topk_layout.layout_from_topk``
    computes). Ids ``>= num_experts`` (possible only with the host checks off) are counted nowhere and set
    ``bad_flag`` (`[1]` int32, when given) to 1 on the device."""
    n, k = topk_idx.shape
    dev = topk_idx.device
    per_rank = torch.zeros(world_size, dtype=torch.int32, device=dev)
    per_expert = torch.zeros(num_experts + 1, dtype=torch.int32, device=dev)
    in_rank = torch.zeros(n, world_size, dtype=torch.int8, device=dev)
    if bad_flag is None:
        bad_flag = torch.zeros(1, dtype=torch.int32, device=dev)
    if n > 0:
        block_t = 64 if INTERPRET or dev.type != "cuda" else 32
        _layout_kernel[(triton.cdiv(n, block_t),)](
            topk_idx.contiguous(), in_rank, per_rank, per_expert, bad_flag, n, num_experts, num_experts // world_size,
            K=k, KP=triton.next_power_of_2(k), R=world_size, RP=triton.next_power_of_2(world_size),
            EB=triton.next_power_of_2(num_experts + 1), BLOCK_T=block_t)
    return per_rank, per_expert[:num_experts], in_rank.view(torch.bool)
