"""Ready-made two-microbatch schedules for a DeepSeek-like MoE layer.

The engine supplies the compute as callables on the microbatch state (see :mod:`microbatch.comm` for
the keys the communicator reads and writes):

- ``attention(state)``: ``state["hidden"]`` -> ``state["x"]`` (`[n, H]` BF16, the MoE input);
- ``gate(state)``: ``state["x"]`` -> ``state["topk_idx"]`` (`[n, K]` int64), ``state["topk_weights"]``;
- ``experts(state)``: ``state["recv_x"]`` (+ layout keys) -> ``state["expert_out"]``;
- ``shared_expert(state)`` (optional): ``state["x"]`` -> ``state["shared_out"]`` (`[n, H]`).

The layer output is ``state["out"] = combined + shared_out`` (float32 sum, one cast to BF16).

Schedules (stages separated by ``YIELD``; microbatch A runs a stage, then B runs the same stage):

- prefill, 3 stages: ``attention, gate, dispatch_send | dispatch_recv, experts, combine_send |
  shared_expert, combine_recv, output``: A's dispatch flies under B's attention and gate, A's combine
  under B's experts and A's shared expert.
- decode, 5 stages: ``attention | gate, dispatch_send | dispatch_recv, experts, combine_send |
  shared_expert | combine_recv, output``: with few tokens per microbatch, the shared expert is given
  a stage of its own so that it always sits under a combine (combine moves BF16, about twice the
  dispatch's FP8 bytes, so it is the transfer worth hiding). Run it with ``offset=1``: with B one stage
  behind A, every dispatch and combine is in flight under the other microbatch's compute (with
  ``offset=0`` only B's gate would cover A's dispatch).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .comm import Communicator
from .executor import YIELD

__all__ = ["moe_layer_schedule"]


def _output(state: dict) -> None:
    out = state["combined"].float()
    if "shared_out" in state:
        out = out + state["shared_out"].float()
    state["out"] = out.to(torch.bfloat16)


def moe_layer_schedule(comm: Communicator, *, attention: Callable, gate: Callable, experts: Callable,
                       shared_expert: Optional[Callable] = None, mode: str = "prefill") -> list:
    """The operation list of one MoE layer for :func:`microbatch.run_two_microbatches` (or
    :func:`microbatch.run_single`).

    Arguments:
        comm: a :class:`microbatch.Communicator`.
        attention, gate, experts, shared_expert: the engine's compute (module docstring).
        mode: ``"prefill"`` (3 stages) or ``"decode"`` (5 stages).

    Returns:
        a list of callables and ``YIELD`` markers.
    """
    if mode not in ("prefill", "decode"):
        raise ValueError(f"mode must be 'prefill' or 'decode', got {mode!r}")
    if not isinstance(comm, Communicator):
        raise TypeError(f"comm must be a microbatch.Communicator, got {type(comm).__name__}")
    shared = [shared_expert] if shared_expert is not None else []
    if mode == "prefill":
        return [attention, gate, comm.dispatch_send, YIELD,
                comm.dispatch_recv, experts, comm.combine_send, YIELD,
                *shared, comm.combine_recv, _output]
    return [attention, YIELD,
            gate, comm.dispatch_send, YIELD,
            comm.dispatch_recv, experts, comm.combine_send, YIELD,
            *shared, YIELD,
            comm.combine_recv, _output]
