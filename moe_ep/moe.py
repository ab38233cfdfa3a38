"""A whole expert-parallel MoE layer: dispatch -> FP8 experts -> combine over a :class:`moe_ep.Buffer`.

=============  =================================  =========================================  ==============
mode           dispatch                           experts                                    combine
=============  =================================  =========================================  ==============
``"decode"``   ``low_latency_dispatch`` (FP8 cast masked GEMM1 -> SiLU-and-mul-quant -> masked  ``low_latency_
               inside the send) -> `[L, R*T, H]`  GEMM2 (no host read: CUDA-graph capturable) combine`` (weighted)
``"prefill"``  quant -> ``get_dispatch_layout``   permute into 128-row expert blocks -> GEMM1   ``combine``
               -> ``dispatch`` (FP8)              -> SiLU-and-mul-quant -> GEMM2 -> weighted
                                                  un-permute
=============  =================================  =========================================  ==============

The same object plugs into the two-microbatch schedules: pass ``layer.experts`` as the ``experts=``
callable of :func:`microbatch.moe_layer_schedule` (it reads the state keys the communicators write).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .experts import ExpertWeights, contiguous_experts, masked_experts
from .quant import per_token_group_quant_fp8

__all__ = ["MoELayer"]


class MoELayer:
    """Dispatch -> experts -> combine for one MoE layer's routed experts (plus an optional shared expert).

    Arguments:
        buffer: a :class:`moe_ep.Buffer` (``low_latency_mode=True`` for ``mode="decode"``).
        weights: :class:`moe_ep.experts.ExpertWeights` of this rank's ``L = num_experts / R`` experts.
        num_experts: ``E``, routed experts over all ranks.
        mode: ``"decode"`` (low-latency, masked layout) or ``"prefill"`` (normal, contiguous layout).
        num_max_dispatch_tokens_per_rank: ``T`` of the low-latency buffers (decode).
        shared_expert: optional callable `[N, H]` BF16 -> `[N, H]`, added to the combined output.
        expected_m: rows per expert the decode GEMM tiles are picked for (default ``R*T*K/E``, the
            balanced load).
        use_pdl: programmatic dependent launch between the expert kernels (Hopper+).
    """

    def __init__(self, buffer, weights: ExpertWeights, num_experts: int, *, mode: str = "decode",
                 num_max_dispatch_tokens_per_rank: Optional[int] = None, shared_expert: Optional[Callable] = None,
                 expected_m: Optional[int] = None, use_pdl: bool = False):
        if mode not in ("decode", "prefill"):
            raise ValueError(f"mode must be 'decode' or 'prefill', got {mode!r}")
        if not isinstance(weights, ExpertWeights):
            raise TypeError(f"weights must be moe_ep.experts.ExpertWeights, got {type(weights).__name__}")
        world = buffer.group_size
        if num_experts % world or weights.num_local_experts != num_experts // world:
            raise ValueError(f"num_experts={num_experts} over {world} ranks means {num_experts / world:g} local "
                             f"experts, but weights hold {weights.num_local_experts}")
        if mode == "decode":
            if not buffer.low_latency_mode:
                raise ValueError("mode='decode' needs a Buffer created with low_latency_mode=True")
            if not isinstance(num_max_dispatch_tokens_per_rank, int) or num_max_dispatch_tokens_per_rank <= 0:
                raise ValueError("mode='decode' needs num_max_dispatch_tokens_per_rank (a positive int)")
        self.buffer = buffer
        self.weights = weights
        self.num_experts = num_experts
        self.mode = mode
        self.T = num_max_dispatch_tokens_per_rank
        self.shared_expert = shared_expert
        self.expected_m = expected_m
        self.use_pdl = use_pdl

    def _expected_m(self, slots: int, topk: int) -> int:
        if self.expected_m is not None:
            return self.expected_m
        return max(1, -(-slots * topk // self.num_experts))

    def experts(self, state: dict) -> None:
        """The ``experts=`` callable of :func:`microbatch.moe_layer_schedule`: reads ``recv_x`` and the layout
        keys a :class:`microbatch.Communicator` wrote, writes ``state["expert_out"]``."""
        if state["layout"] == "masked":
            slots = state["recv_x"][0].shape[1] if isinstance(state["recv_x"], tuple) else state["recv_x"].shape[1]
            topk = state["topk_idx"].shape[1] if "topk_idx" in state else 1
            state["expert_out"] = masked_experts(state["recv_x"], state["recv_count"], self.weights,
                                                 expected_m=self._expected_m(slots, topk), use_pdl=self.use_pdl)
        else:
            state["expert_out"] = contiguous_experts(state["recv_x"], state["recv_topk_idx"], state["recv_topk_weights"],
                                                     self.weights,
                                                     num_tokens_per_expert=state.get("num_recv_tokens_per_expert"),
                                                     use_pdl=self.use_pdl)

    def __call__(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """One layer.

        Arguments:
            x: `[N, H]` `torch.bfloat16`.
            topk_idx: `[N, K]` `torch.int64` global expert indices, -1 for none.
            topk_weights: `[N, K]` `torch.float32`.

        Returns:
            `[N, H]` `torch.bfloat16`: ``sum_k w[n, k] * expert_{idx[n, k]}(x[n])`` (+ ``shared_expert(x)``).
        """
        if self.mode == "decode":
            recv_x, recv_count, handle, _, _ = self.buffer.low_latency_dispatch(
                x, topk_idx, self.T, self.num_experts, use_fp8=True)
            y = masked_experts(recv_x, recv_count, self.weights, use_pdl=self.use_pdl,
                               expected_m=self._expected_m(recv_x[0].shape[1], topk_idx.shape[1]))
            out, _, _ = self.buffer.low_latency_combine(y, topk_idx, topk_weights, handle)
        else:
            per_rank, _, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(topk_idx, self.num_experts)
            recv_x, recv_idx, recv_w, counts, handle, _ = self.buffer.dispatch(
                per_token_group_quant_fp8(x), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights)
            y = contiguous_experts(recv_x, recv_idx, recv_w, self.weights, num_tokens_per_expert=counts or None,
                                   use_pdl=self.use_pdl)
            out, _, _ = self.buffer.combine(y, handle)
        if self.shared_expert is not None:
            out = (out.float() + self.shared_expert(x).float()).to(torch.bfloat16)
        return out
