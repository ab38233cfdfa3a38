"""The order in which the Triton interpreter runs the programs of a launch: forward, reverse or random (seeded).

The interpreter runs a launch's programs one after another in grid order ``(0, 0, 0), (0, 0, 1), ...``
(``triton.runtime.interpreter.GridExecutor.__call__``: three nested ``range`` loops, each step calling
``interpreter_builder.set_grid_idx(x, y, z)`` and then the kernel body). A GPU promises no order at all: a kernel
that lets one program wait on work only another program of the same launch does passes in grid order and hangs
in another. :func:`set_program_order` replaces the builder's ``set_grid_idx`` with one that hands out the grid's
indices in the chosen order (the n-th call gets the n-th index of a permutation of the grid, drawn when the grid
is set), so every launch of the process runs its programs in that order; ``"forward"`` restores the original.

``MOE_EP_PROGRAM_ORDER`` selects it for a test run (read by :func:`set_program_order_from_env`, which the test
set-up calls, and inherited by forked ranks): ``forward`` (default), ``reverse``, ``random`` or ``random:SEED``.
"""

from __future__ import annotations

import contextlib
import os
import random

__all__ = ["ORDERS", "ENV", "set_program_order", "set_program_order_from_env", "program_order", "current_order"]

ORDERS = ("forward", "reverse", "random")
ENV = "MOE_EP_PROGRAM_ORDER"

_state = {"order": "forward", "seed": 0, "saved": None}


def _parse(order: str) -> tuple:
    name, _, seed = order.partition(":")
    if name not in ORDERS:
        raise ValueError(f"{ENV}={order!r}: expected one of {', '.join(ORDERS)} (random:SEED for a seed)")
    return name, int(seed) if seed else 0


def current_order() -> str:
    """The order in force (``forward``, ``reverse`` or ``random:SEED``)."""
    o = _state["order"]
    return f"random:{_state['seed']}" if o == "random" else o


def set_program_order(order: str) -> None:
    """Run every later interpreted launch of this process with its programs in ``order`` (see the module)."""
    from triton.runtime import interpreter

    name, seed = _parse(order)
    builder = interpreter.interpreter_builder
    if _state["saved"] is None:
        _state["saved"] = (builder.set_grid_dim, builder.set_grid_idx)
    set_dim, set_idx = _state["saved"]
    _state["order"], _state["seed"] = name, seed
    if name == "forward":
        for attr in ("set_grid_dim", "set_grid_idx"):
            builder.__dict__.pop(attr, None)
        return
    rng = random.Random(seed)
    plan = {"seq": [], "next": 0}

    def set_grid_dim(nx, ny, nz):
        set_dim(nx, ny, nz)
        seq = [(x, y, z) for x in range(nx) for y in range(ny) for z in range(nz)]
        if name == "reverse":
            seq.reverse()
        else:
            rng.shuffle(seq)
        plan["seq"], plan["next"] = seq, 0

    def set_grid_idx(x, y, z):
        # the n-th program the loop starts runs as the n-th index of the permutation (each index exactly once)
        i = plan["next"]
        plan["next"] = i + 1
        set_idx(*plan["seq"][i])

    builder.set_grid_dim = set_grid_dim
    builder.set_grid_idx = set_grid_idx


def set_program_order_from_env() -> str:
    """Apply ``MOE_EP_PROGRAM_ORDER`` (when set) and return the order in force."""
    order = os.environ.get(ENV, "").strip()
    if order:
        set_program_order(order)
    return current_order()


@contextlib.contextmanager
def program_order(order: str):
    """``set_program_order(order)`` inside the block, the previous order after it."""
    before = current_order()
    set_program_order(order)
    try:
        yield
    finally:
        set_program_order(before)
