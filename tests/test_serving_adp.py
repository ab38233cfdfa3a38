"""ADP balance policies on small hand-checkable traces (seed 003's worked example, the gate's truth table)."""

import numpy as np
import pytest

from serving.adp import ADPGate, HeapRouter, RoundRobinRouter
from serving.cost import LinearCost
from serving.sim import SimConfig, simulate
from serving.trace import Trace


def worked_example(n_ranks: int, m: int, ctx: int, gate: ADPGate):
    """Seed 003: N ranks with M generation requests each; one request per rank finishes in turn and a new
    context of ``ctx`` tokens arrives on that rank the next iteration (closed loop, pinned)."""
    inp, out, arr, rank = [], [], [], []
    for r in range(n_ranks):
        for _ in range(m - 1):  # long generation requests
            inp.append(1), out.append(4 * n_ranks + 10), arr.append(0), rank.append(r)
        inp.append(1), out.append(r + 1), arr.append(0), rank.append(r)  # finishes after iteration r
        inp.append(ctx), out.append(2 * n_ranks), arr.append(r + 1), rank.append(r)  # the new context
    tr = Trace(np.array(inp), np.array(out), arrival_iter=np.array(arr), rank=np.array(rank))
    cfg = SimConfig(num_ranks=n_ranks, max_batch_size=4 * m, max_num_tokens=4 * m + ctx, concurrency=None)
    return simulate(tr, LinearCost(c0=0.0, c_tok=1.0), RoundRobinRouter(), gate, cfg)


@pytest.mark.parametrize("n_ranks,m,ctx", [(8, 64, 803), (4, 3, 50)])
def test_worked_example_baseline(n_ranks, m, ctx):
    res = worked_example(n_ranks, m, ctx, ADPGate(enabled=False))
    exact = (ctx + (m - 1) + m * (n_ranks - 1)) / (n_ranks * (ctx + m - 1))
    seed = (ctx + (m - 1) + m * (n_ranks - 1)) / (n_ranks * ctx)  # the seed approximates max by ctx
    b = res.balance[1:n_ranks + 1]  # iteration 0 runs the 1-token starters
    assert np.all(res.num_ctx[1:n_ranks + 1] == 1)
    np.testing.assert_allclose(b, exact)
    if (n_ranks, m, ctx) == (8, 64, 803):
        assert seed == pytest.approx(0.2045, abs=1e-4) and exact == pytest.approx(0.1897, abs=1e-4)


@pytest.mark.parametrize("n_ranks,m,ctx", [(8, 64, 803), (4, 3, 50)])
def test_worked_example_adp(n_ranks, m, ctx):
    res = worked_example(n_ranks, m, ctx, ADPGate(timeout_iters=n_ranks + 5, batching_wait_iters=0))
    ran = np.flatnonzero(res.num_ctx[1:]) + 1
    assert ran.tolist() == [n_ranks]  # N-1 generation-only iterations, then all N contexts together
    assert res.num_ctx[n_ranks] == n_ranks
    assert res.balance[n_ranks] == 1.0
    # Time: with a max-rank-token cost, the N-1 waits cost time(gen) each and the release time(ctx).
    base = worked_example(n_ranks, m, ctx, ADPGate(enabled=False))
    saved = base.dt[1:n_ranks + 1].sum() - res.dt[1:n_ranks + 1].sum()
    assert saved == pytest.approx((n_ranks - 1) * (ctx + m - 1 - m), rel=1e-9)  # (time(ctx)-time(gen))(N-1)


def test_gate_truth_table():
    g = ADPGate(timeout_iters=3, batching_wait_iters=2)
    assert g.decide([1, 1], [0, 0], 8)  # start-up: nobody generating -> release at once
    assert g.decide([1, 0], [0, 5], 8)  # a rank not generating -> release
    # all contexts, all generating: batching wait holds exactly 2 iterations, then releases
    assert [g.decide([1, 1], [2, 2], 8) for _ in range(3)] == [False, False, True]
    # one rank without a context: hold until the timeout (3)
    g = ADPGate(timeout_iters=3, batching_wait_iters=0)
    assert [g.decide([1, 0], [2, 2], 8) for _ in range(3)] == [False, False, True]
    # a rank with no free slot holds like a missing context
    g = ADPGate(timeout_iters=2, batching_wait_iters=0)
    assert [g.decide([1, 1], [8, 2], 8) for _ in range(2)] == [False, True]
    # a dummy generation request (counted as 1) keeps all_gen true, so the wait applies
    g = ADPGate(timeout_iters=4, batching_wait_iters=0)
    assert not g.decide([1, 0], [1, 3], 8)
    # disabled: always release
    assert ADPGate(enabled=False).decide([1, 0], [2, 2], 8)


def test_gate_seed_batching_variant_and_determinism():
    g = ADPGate(timeout_iters=5, batching_wait_iters=3, batching="seed")
    assert g.decide([2, 2], [1, 1], 8)  # equal batches: no wait in the seed's reading
    a, b = ADPGate(timeout_iters=7, batching_wait_iters=2), ADPGate(timeout_iters=7, batching_wait_iters=2)
    rng = np.random.default_rng(0)
    for _ in range(200):  # every rank runs the same code on the same gathered vectors
        ctx, gen = rng.integers(0, 3, 4).tolist(), rng.integers(0, 9, 4).tolist()
        assert a.decide(ctx, gen, 8) == b.decide(ctx, gen, 8)
    with pytest.raises(ValueError, match="must be >= 0"):
        ADPGate(timeout_iters=-1)


def test_routers():
    num_active, tokens = np.zeros(3, np.int64), np.zeros(3, np.int64)
    ranks = RoundRobinRouter().route(np.array([10, 30, 20, 5]), num_active, tokens, cap=2)
    assert ranks.tolist() == [2, 0, 1, 0]  # sorted longest first, dealt 0,1,2,0
    assert num_active.tolist() == [2, 1, 1]
    num_active, tokens = np.array([1, 0, 0]), np.array([100, 0, 50])
    ranks = HeapRouter().route(np.array([10, 30]), num_active, tokens, cap=4)
    assert ranks.tolist() == [2, 1]  # 30 -> fewest tokens (rank 1), 10 -> next fewest (rank 2: 50 < 100)
    full = RoundRobinRouter().route(np.array([1]), np.array([2, 2]), np.zeros(2, np.int64), cap=2)
    assert full.tolist() == [-1]
