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

``mode="prefill", dispatch="expanded"`` replaces the permute with DeepEP V2's expanded receive: quant ->
``ElasticBuffer.dispatch(do_expand=True, expert_alignment=128)`` (one row per (token, local expert), already in
128-row expert blocks, with ``handle.psum_num_recv_tokens_per_expert``,
the GEMM's psum layout) -> :func:`moe_ep.layer.experts.expanded_experts` (GEMM1 ->
SiLU-and-mul-quant -> GEMM2 on those rows, each row weighted by its top-k weight) -> the expanded
``ElasticBuffer.combine`` (sums a token's rows, then over ranks). The default ``dispatch="permute"`` is the
table's prefill row. Output: the same sum, with one more BF16 rounding (each weighted row) than the permute
path; both are within the same bound of the dense reference (``tests/test_moe_layer.py``). On the ``symm``
backend both prefill dispatches receive as views of the buffer (``recv_as_view=True``: the expansion, or the
permute, reads the rows straight from where the senders wrote them, before the layer's combine frees them) when
the whole receive of ``num_max_dispatch_tokens_per_rank`` tokens per rank (the ElasticBuffer's
``num_max_tokens_per_rank`` on the expanded path) fits the buffer's view area; otherwise (a fixed, chunk-sized
buffer, or no token bound given to the permute path) they take the copying receive, which streams any batch
through the buffer in rounds: the same results (:func:`moe_ep.deepep.v2.dispatch.recv_view_fits`, the same decision on every
rank).

The same object plugs into the two-microbatch schedules: pass ``layer.experts`` as the ``experts=``
callable of :func:`microbatch.moe_layer_schedule` (it reads the state keys the communicators write).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .experts import ExpertWeights, contiguous_experts, expanded_experts, masked_experts
from ..gemm import get_m_alignment_for_contiguous_layout
from ..quant import per_token_group_quant_fp8

__all__ = ["MoELayer"]


class MoELayer:
    """Dispatch -> experts -> combine for one MoE layer's routed experts (plus an optional shared expert).

    Arguments:
        buffer: a :class:`moe_ep.Buffer` (``low_latency_mode=True`` for ``mode="decode"``), or, for
            ``mode="prefill"``, a :class:`moe_ep.ElasticBuffer` (its Buffer runs the permute path).
        weights: :class:`moe_ep.layer.experts.ExpertWeights` of this rank's ``L = num_experts / R`` experts.
        num_experts: ``E``, routed experts over all ranks.
        mode: ``"decode"`` (low-latency, masked layout) or ``"prefill"`` (normal, contiguous layout).
        num_max_dispatch_tokens_per_rank: ``T`` of the low-latency buffers (decode).
        shared_expert: optional callable `[N, H]` BF16 -> `[N, H]`, added to the combined output.
        expected_m: rows per expert the decode GEMM tiles are picked for (default ``R*T*K/E``, the
            balanced load).
        use_pdl: programmatic dependent launch between the expert kernels (Hopper+).
        dispatch: prefill only. ``"permute"`` (default): ``Buffer.dispatch`` then a permute into expert blocks.
            ``"expanded"``: ``ElasticBuffer.dispatch(do_expand=True, expert_alignment=128)`` feeds the GEMMs
            directly (no permute, no un-permute), combined by the expanded ``combine``. Given an
            :class:`moe_ep.ElasticBuffer` it is used as is; given a :class:`moe_ep.Buffer`, the layer builds
            ``ElasticBuffer.from_buffer(buffer, num_max_dispatch_tokens_per_rank)`` over it (no new allocation
            or rendezvous: the Buffer's resources serve both; ``num_max_dispatch_tokens_per_rank`` is then
            required, the same on every rank, and bounds the tokens per call).
    """

    def __init__(self, buffer, weights: ExpertWeights, num_experts: int, *, mode: str = "decode",
                 num_max_dispatch_tokens_per_rank: Optional[int] = None, shared_expert: Optional[Callable] = None,
                 expected_m: Optional[int] = None, use_pdl: bool = False, dispatch: str = "permute"):
        from ..deepep.v2.buffer import ElasticBuffer

        if mode not in ("decode", "prefill"):
            raise ValueError(f"mode must be 'decode' or 'prefill', got {mode!r}")
        if dispatch not in ("permute", "expanded"):
            raise ValueError(f"dispatch must be 'permute' or 'expanded', got {dispatch!r}")
        if dispatch == "expanded" and mode != "prefill":
            raise ValueError("dispatch='expanded' is a prefill path (mode='prefill'); decode uses the masked layout")
        if not isinstance(weights, ExpertWeights):
            raise TypeError(f"weights must be moe_ep.layer.experts.ExpertWeights, got {type(weights).__name__}")
        self.elastic = None
        if isinstance(buffer, ElasticBuffer):
            if mode == "decode":
                raise ValueError("mode='decode' needs a Buffer created with low_latency_mode=True, not an "
                                 "ElasticBuffer (its low-latency calls stay on moe_ep.Buffer)")
            self.elastic, buffer = buffer, buffer.buffer
        elif dispatch == "expanded":
            if not isinstance(num_max_dispatch_tokens_per_rank, int) or num_max_dispatch_tokens_per_rank <= 0:
                raise ValueError("dispatch='expanded' over a Buffer needs num_max_dispatch_tokens_per_rank (a positive "
                                 "int, the same on every rank: it defines the expanded receive order)")
            self.elastic = ElasticBuffer.from_buffer(buffer, num_max_dispatch_tokens_per_rank)
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
        self.dispatch = dispatch

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
        elif self.dispatch == "expanded":
            recv_x, _, recv_w, handle, _ = self.elastic.dispatch(
                per_token_group_quant_fp8(x), topk_idx, topk_weights, num_experts=self.num_experts,
                num_max_tokens_per_rank=self.T, expert_alignment=get_m_alignment_for_contiguous_layout(),
                do_expand=True, use_tma_aligned_col_major_sf=True, recv_as_view=True)
            y = expanded_experts(recv_x, handle.psum_num_recv_tokens_per_expert, self.weights, recv_w,
                                 use_psum_layout=True, use_pdl=self.use_pdl)
            out, _, _ = self.elastic.combine(y, handle)
        else:
            from ..deepep.v2.buffer import recv_view_fits

            per_rank, _, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(topk_idx, self.num_experts)
            q = per_token_group_quant_fp8(x)
            view = recv_view_fits(self.buffer, q[0], q[1], topk_idx.shape[1], self.T)
            recv_x, recv_idx, recv_w, counts, handle, _ = self.buffer.dispatch(
                q, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights, recv_as_view=view)
            y = contiguous_experts(recv_x, recv_idx, recv_w, self.weights, num_tokens_per_expert=counts or None,
                                   use_pdl=self.use_pdl)
            out, _, _ = self.buffer.combine(y, handle)
        if self.shared_expert is not None:
            out = (out.float() + self.shared_expert(x).float()).to(torch.bfloat16)
        return out
