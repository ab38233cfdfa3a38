"""The low-latency kernels complete whatever order a launch's programs run in (docs/protocols.md, "A late or dead
peer": no program waits for another program of its launch). The interpreter runs them forward, in reverse and in a
seeded random order (:mod:`moe_ep.testing.program_order`); ``MOE_EP_PROGRAM_ORDER`` runs whole suites that way.
Before the per-source verdicts, every receive here timed out in reverse order (its programs waited for program
(0, 0), which the interpreter then ran last)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_masking import _send, _virtual  # noqa: E402

from moe_ep.testing.program_order import current_order, program_order  # noqa: E402


def test_orders_permute_the_grid():
    """Each order runs every program of a launch exactly once, forward as the interpreter does."""
    import triton
    import triton.language as tl

    @triton.jit
    def _log(out, counter):
        i = tl.atomic_add(counter, 1)
        tl.store(out + i, tl.program_id(0) * 4 + tl.program_id(1))

    seen = {}
    for order in ("forward", "reverse", "random:5"):
        out, counter = torch.full((12,), -1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
        with program_order(order):
            _log[(3, 4)](out, counter)
        seen[order] = out.tolist()
        assert sorted(seen[order]) == list(range(12)), order
    assert seen["forward"] == list(range(12)) and seen["reverse"] == list(range(11, -1, -1))
    assert seen["random:5"] not in (seen["forward"], seen["reverse"])
    assert current_order() in ("forward", "reverse") or current_order().startswith("random")


# reverse by default; a random order with -m extended
@pytest.mark.parametrize("order", ["reverse", pytest.param("random:11", marks=pytest.mark.extended)])
@pytest.mark.parametrize("transport", ["symm", "nvshmem"])
@pytest.mark.parametrize("shrink", [False, True])
def test_steps_complete_in_any_program_order(order, transport, shrink):
    """Two dispatch + combine steps (both double-buffer slots) of 3 ranks, 70 tokens (two programs per source in the
    dispatch receive, two in the combine receive), each launch's programs in ``order``: exact outputs, no timeout."""
    R, T, H, E, K = 3, 70, 128, 6, 2
    paths = _virtual(R, T, H, E, K, transport, timeout_s=5, shrink=shrink)
    g = torch.Generator().manual_seed(3)
    with program_order(order):
        for step in range(2):
            xs = [torch.randn(T, H, generator=g).to(torch.bfloat16) for _ in range(R)]
            idx = [torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) for _ in range(R)]
            ws = [torch.rand(T, K, generator=g) for _ in range(R)]
            st = [_send(p, x, i, T, E) for p, x, i in zip(paths, xs, idx)]
            res = [p.dispatch_recv(s) for p, s in zip(paths, st)]
            cs = [p.combine_send(r.recv_x, i, w, r.handle) for p, r, i, w in zip(paths, res, idx, ws)]
            outs = [p.combine_recv(c) for p, c in zip(paths, cs)]
            for r in range(R):
                ref = (ws[r][:, :, None] * xs[r].float()[:, None, :]).sum(1)  # every expert returns its input
                assert torch.equal(outs[r].view(torch.int16), ref.to(torch.bfloat16).view(torch.int16)), (step, r)
                assert paths[r].mask.tolist() == [0] * R
