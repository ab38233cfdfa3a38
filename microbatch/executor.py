"""A layer as a list of operations with yield points, and a single-threaded two-microbatch executor.

A *schedule* is a flat list of callables ``op(state)`` (``state``: a dict per microbatch) with
:data:`YIELD` markers between stages. :func:`run_two_microbatches` runs stage 0 of microbatch A, then
stage 0 of B, stage 1 of A, and so on (B may start ``offset`` stages later). Stages that end with a
communication *send* (``dispatch_send``, ``combine_send``, whose receive sits in the next stage) leave
the transfer in flight while the other microbatch computes: that is the whole overlap mechanism, on
one thread and one compute stream, so it also captures into a single CUDA graph.

Writing your own schedule::

    ops = [attention, gate, comm.dispatch_send, YIELD,           # A's dispatch flies under B's attention
           comm.dispatch_recv, experts, comm.combine_send, YIELD,
           shared_expert, comm.combine_recv, add_shared]           # shared expert under combine
    out_a, out_b = run_two_microbatches(ops, {"x": x[:n0]}, {"x": x[n0:]})

Rules: every rank runs the same schedule (the microbatches' collectives pair up by order), and a stage
that receives must come after the stage that sent, for the same microbatch.
"""

from __future__ import annotations

from typing import Callable

__all__ = ["YieldPoint", "YIELD", "stages", "run_single", "run_two_microbatches"]


class YieldPoint:
    """Marker between stages of a schedule (use the instance :data:`YIELD`)."""

    def __repr__(self) -> str:
        return "YIELD"


YIELD = YieldPoint()


def stages(ops: list) -> list[list[Callable]]:
    """Split a schedule at its yield points: a list of stages, each a list of operations."""
    out: list[list[Callable]] = [[]]
    for op in ops:
        if isinstance(op, YieldPoint):
            out.append([])
        elif callable(op):
            out[-1].append(op)
        else:
            raise TypeError(f"a schedule holds callables and YIELD markers, got {type(op).__name__}")
    return out


def run_single(ops: list, state: dict) -> dict:
    """Run a schedule on one microbatch (no overlap); returns ``state``."""
    for stage in stages(ops):
        for op in stage:
            op(state)
    return state


def run_two_microbatches(ops: list, state_a: dict, state_b: dict, *, offset: int = 0) -> tuple[dict, dict]:
    """Run a schedule on two microbatches, interleaved stage by stage.

    Arguments:
        ops: the schedule (callables and :data:`YIELD` markers).
        state_a, state_b: the microbatches' state dicts (inputs in, outputs out).
        offset: microbatch B starts this many stages after A (0: A.s0, B.s0, A.s1, B.s1, ...).

    Returns:
        ``(state_a, state_b)``.
    """
    if not isinstance(offset, int) or offset < 0:
        raise ValueError(f"offset must be a non-negative int, got {offset!r}")
    st = stages(ops)
    for step in range(len(st) + offset):
        if step < len(st):
            for op in st[step]:
                op(state_a)
        j = step - offset
        if 0 <= j < len(st):
            for op in st[j]:
                op(state_b)
    return state_a, state_b
