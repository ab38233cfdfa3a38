"""One communication interface for every overlap schedule, over each way moe_ep.Buffer can move data.

A :class:`Communicator` has four operations on a microbatch's state dict; a schedule puts each
``*_send`` at the end of a stage and the matching ``*_recv`` in a later stage, so the other
microbatch's stage runs while the transfer is in flight:

- ``dispatch_send(state)``: reads ``x`` (`[n, H]` BF16), ``topk_idx`` (`[n, K]` int64) and
  ``topk_weights`` (`[n, K]` float32); starts the dispatch.
- ``dispatch_recv(state)``: completes it; sets ``layout`` (``"masked"`` or ``"contiguous"``),
  ``recv_x`` and, for ``"masked"``, ``recv_count``; for ``"contiguous"``, ``recv_topk_idx`` and
  ``recv_topk_weights``. The experts then write ``expert_out``: `[L, R*T, H]` BF16 rows per expert
  (masked; the combine applies the weights) or `[M, H]` BF16 rows already weighted (contiguous).
- ``combine_send(state)`` / ``combine_recv(state)``: return ``combined`` (`[n, H]` BF16).

Implementations: :class:`LowLatencyCommunicator` (low-latency mode, ``return_recv_hook``: the send
only issues the transfer, the hook receives), :class:`NormalCommunicator` (normal mode with
``async_finish``: the transfer runs on the Buffer's communication stream and the receive makes the
compute stream wait on its event), :class:`TorchA2ACommunicator` (normal mode of the ``torch``
backend, blocking: a baseline without overlap of the transfer itself).
"""

from __future__ import annotations

import abc

from moe_ep.quant import per_token_group_quant_fp8

__all__ = ["Communicator", "LowLatencyCommunicator", "NormalCommunicator", "TorchA2ACommunicator"]


class Communicator(abc.ABC):
    """Dispatch / combine split into send and receive halves (see the module docstring)."""

    @abc.abstractmethod
    def dispatch_send(self, state: dict) -> None: ...

    @abc.abstractmethod
    def dispatch_recv(self, state: dict) -> None: ...

    @abc.abstractmethod
    def combine_send(self, state: dict) -> None: ...

    @abc.abstractmethod
    def combine_recv(self, state: dict) -> None: ...


def _take_hook(state: dict, what: str):
    hook = state.pop("_hook", None)
    if hook is None:
        raise RuntimeError(f"{what} called before its send (schedule order is wrong)")
    return hook


class LowLatencyCommunicator(Communicator):
    """Low-latency dispatch / combine with ``return_recv_hook=True``.

    Arguments:
        buffer: a ``moe_ep.Buffer`` created with ``low_latency_mode=True``.
        num_max_dispatch_tokens_per_rank: ``T`` (each microbatch's token count must stay below it).
        num_experts: ``E``.
        use_fp8: FP8 dispatch (1x128 scales, cast inside the send).
    """

    def __init__(self, buffer, num_max_dispatch_tokens_per_rank: int, num_experts: int, *, use_fp8: bool = True):
        self.buffer = buffer
        self.T = num_max_dispatch_tokens_per_rank
        self.num_experts = num_experts
        self.use_fp8 = use_fp8

    def dispatch_send(self, state: dict) -> None:
        recv_x, recv_count, handle, _, hook = self.buffer.low_latency_dispatch(
            state["x"], state["topk_idx"], self.T, self.num_experts, use_fp8=self.use_fp8, return_recv_hook=True)
        state.update(layout="masked", recv_x=recv_x, recv_count=recv_count, handle=handle, _hook=hook)

    def dispatch_recv(self, state: dict) -> None:
        _take_hook(state, "dispatch_recv")()

    def combine_send(self, state: dict) -> None:
        combined, _, hook = self.buffer.low_latency_combine(state["expert_out"], state["topk_idx"], state["topk_weights"],
                                                            state["handle"], return_recv_hook=True)
        state.update(combined=combined, _hook=hook)

    def combine_recv(self, state: dict) -> None:
        _take_hook(state, "combine_recv")()


class NormalCommunicator(Communicator):
    """Normal-mode dispatch / combine with ``async_finish`` events.

    Arguments:
        buffer: a ``moe_ep.Buffer``.
        num_experts: ``E``.
        use_fp8: quantize ``x`` (1x128 groups, ``moe_ep.quant``) before the dispatch.
        async_finish: run the transfers on the Buffer's communication stream (CUDA); the receive waits on
            the event. (On CPU the calls complete synchronously.)
    """

    def __init__(self, buffer, num_experts: int, *, use_fp8: bool = True, async_finish: bool = True):
        self.buffer = buffer
        self.num_experts = num_experts
        self.use_fp8 = use_fp8
        self.async_finish = async_finish

    def dispatch_send(self, state: dict) -> None:
        x, idx = state["x"], state["topk_idx"]
        per_rank, _, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(idx, self.num_experts,
                                                                             async_finish=self.async_finish)
        payload = per_token_group_quant_fp8(x) if self.use_fp8 else x
        # No previous_event: the dispatch's comm stream then waits for the compute stream, i.e. for the
        # quantization just launched there (the layout's event, recorded on the comm stream before it,
        # would replace that wait). The layout ran on the same comm stream, so it is ordered before.
        recv_x, r_idx, r_w, counts, handle, ev = self.buffer.dispatch(
            payload, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=idx, topk_weights=state["topk_weights"], async_finish=self.async_finish)
        # The payload stays referenced until the receive (the Buffer also record_streams its inputs).
        state.update(layout="contiguous", recv_x=recv_x, recv_topk_idx=r_idx, recv_topk_weights=r_w,
                     num_recv_tokens_per_expert=counts, handle=handle, _event=ev, _payload=payload)

    def dispatch_recv(self, state: dict) -> None:
        state.pop("_event").current_stream_wait()
        state.pop("_payload", None)

    def combine_send(self, state: dict) -> None:
        combined, _, ev = self.buffer.combine(state["expert_out"], state["handle"], async_finish=self.async_finish)
        state.update(combined=combined, _event=ev)

    def combine_recv(self, state: dict) -> None:
        state.pop("_event").current_stream_wait()


class TorchA2ACommunicator(NormalCommunicator):
    """Normal mode of the ``torch`` backend (``all_to_all_single``), blocking: each send completes the
    transfer, each receive is a no-op. The no-overlap baseline of the same schedules."""

    def __init__(self, buffer, num_experts: int, *, use_fp8: bool = True):
        if getattr(buffer, "backend_name", None) != "torch":
            raise ValueError("TorchA2ACommunicator needs a moe_ep.Buffer with backend='torch'")
        super().__init__(buffer, num_experts, use_fp8=use_fp8, async_finish=False)
