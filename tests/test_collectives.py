"""moe_ep.collectives.all_reduce: every algorithm, 1-8 ranks, 1/2/4 ranks per node, uneven sizes, dtypes."""

import time

import pytest
import torch

from moe_ep import RankTimeoutError
from moe_ep.collectives import (ALGORITHMS, Tiers, all_reduce, choose_algorithm, inter_node_bytes,
                                predict_time)
from moe_ep.testing import launch

DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64, torch.bfloat16)


def _input(rank: int, numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g).to(dtype)
    return torch.randint(-1000, 1000, (numel,), generator=g).to(dtype)


def _expected(world: int, G: int, numel: int, dtype, seed: int, algorithm: str) -> torch.Tensor:
    """The documented order: fold each node in local-rank order, then the nodes in node order (tree,
    hierarchical); ranks in rank order (ps)."""
    xs = [_input(r, numel, dtype, seed) for r in range(world)]
    if algorithm == "ps":
        G = world
    total = None
    for h in range(world // G):
        s = xs[h * G].clone()
        for g in range(1, G):
            s += xs[h * G + g]
        total = s if total is None else total.add_(s)
    return total


def _worker(rank, world, cases):
    out = []
    for algorithm, G, numel, dtype, seed, shape in cases:
        x = _input(rank, numel, dtype, seed).reshape(shape)
        res = all_reduce(x, algorithm=algorithm, ranks_per_node=G, timeout_s=30)
        assert res is x
        out.append(x.reshape(-1).clone())
    return out


def _cases(world):
    cases = []
    seed = 0
    for G in (1, 2, 4):
        if G > world or world % G:
            continue
        for algorithm in ALGORITHMS:
            for dtype in DTYPES:
                seed += 1
                numel = 37 if dtype != torch.float32 else 5  # uneven: not a multiple of G or H
                cases.append((algorithm, G, numel, dtype, seed, (numel,)))
        seed += 1
        cases.append(("auto", G, 24, torch.float32, seed, (2, 3, 4)))
        cases.append(("tree", G, 1, torch.float32, seed, (1,)))  # fewer elements than ranks
    return cases


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_all_reduce_matches_documented_order(world):
    cases = _cases(world)
    results = launch(_worker, world, cases, timeout_s=120)
    for i, (algorithm, G, numel, dtype, seed, _) in enumerate(cases):
        for r in range(1, world):  # identical bits on every rank
            assert torch.equal(results[r][i].view(torch.uint8) if dtype == torch.bfloat16 else results[r][i],
                               results[0][i].view(torch.uint8) if dtype == torch.bfloat16 else results[0][i]), \
                (algorithm, G, dtype, r)
        got = results[0][i]
        if algorithm == "flat" or algorithm == "auto":  # gloo's own order: compare with a tolerance
            ref = _expected(world, G, numel, torch.float64 if dtype.is_floating_point else dtype, seed, "tree")
            torch.testing.assert_close(got.double() if dtype.is_floating_point else got,
                                       ref if not dtype.is_floating_point else ref.double(),
                                       rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=0.1)
        else:  # tree / hierarchical / ps: bitwise the documented fold
            ref = _expected(world, G, numel, dtype, seed, algorithm)
            assert torch.equal(got.view(torch.uint8) if dtype == torch.bfloat16 else got,
                               ref.view(torch.uint8) if dtype == torch.bfloat16 else ref), (algorithm, G, dtype)


def _ops_worker(rank, world):
    x = torch.tensor([rank + 1.0, -rank, 2.0])
    mx = all_reduce(x.clone(), algorithm="tree", ranks_per_node=2, op="max")
    mn = all_reduce(x.clone(), algorithm="hierarchical", ranks_per_node=2, op=torch.distributed.ReduceOp.MIN)
    pr = all_reduce(x.clone(), algorithm="ps", op="product")
    return mx, mn, pr


def test_other_ops():
    mx, mn, pr = launch(_ops_worker, 4, timeout_s=60)[0]
    assert mx.tolist() == [4.0, 0.0, 2.0]
    assert mn.tolist() == [1.0, -3.0, 2.0]
    assert pr.tolist() == [24.0, 0.0, 16.0]


def _late_worker(rank, world):
    import torch.distributed as dist

    live = dist.new_group([r for r in range(world) if r != 2])  # every rank takes part in making it
    if rank == 2:
        time.sleep(6)  # never arrives in time
        return "skipped"
    dist.barrier(group=live)  # the live ranks start together: on a loaded machine one may otherwise come seconds late
    try:
        all_reduce(torch.ones(4), algorithm="tree", ranks_per_node=2, timeout_s=2)
    except RankTimeoutError as exc:
        return (exc.missing_ranks, str(exc))
    return "no error"


def test_missing_rank_raises_naming_it():
    res = launch(_late_worker, 4, timeout_s=60)
    for r in (0, 1, 3):
        missing, msg = res[r]
        assert missing == [2] and "rank(s) [2]" in msg


def test_cost_model_direction():
    t = Tiers()
    m = 32 * 3200 * 2  # one decode all-reduce of the seed's LLaMA-3B, fp16
    ps, tree = predict_time("ps", m, 4, 2, t), predict_time("tree", m, 4, 2, t)
    assert 3.0 < ps / tree < 5.0  # SEEDS.md C.4: ~3.9x
    big = 105e6
    assert predict_time("hierarchical", big, 4, 2, t) < predict_time("tree", big, 4, 2, t)
    assert inter_node_bytes("tree", 100, 4, 2) == 100 and inter_node_bytes("ps", 100, 4, 2) == 400
    assert choose_algorithm(big, 4, 2, t) == "hierarchical"
    assert choose_algorithm(big, 4, 1, t) == "flat"
    with pytest.raises(ValueError, match="algorithm must be"):
        predict_time("ring2", 1, 1, 2)


def netns_probe(rank, world, numel):
    """Bytes leaving host A per all-reduce, for each algorithm (run inside a TwoHostCluster)."""
    import torch.distributed as dist

    from moe_ep.testing.netns import link_bytes
    out = {}
    for algorithm in ("tree", "ps", "hierarchical", "flat"):
        x = torch.full((numel,), float(rank + 1))
        dist.barrier()
        before = link_bytes()
        all_reduce(x, algorithm=algorithm, ranks_per_node=2)
        dist.barrier()
        after = link_bytes()
        assert bool((x == world * (world + 1) / 2).all())
        out[algorithm] = after[0] - before[0]
    return out


def test_netns_two_hosts_bytes_across():
    from moe_ep.testing.netns import TwoHostCluster, available
    ok, reason = available()
    if not ok:
        pytest.skip(reason)
    numel = 1 << 18  # 1 MiB of float32
    with TwoHostCluster(rate="1gbit") as cluster:
        res = cluster.run(f"{__file__}:netns_probe", ranks_per_host=2, kwargs={"numel": numel}, timeout_s=120)
    m = numel * 4
    a = res[0]  # host A's veth, A -> B (payload plus TCP/IP headers, acks, barriers, arrival checks)
    assert m <= a["tree"] < 1.15 * m  # the GM sends the result once
    assert 2 * m <= a["ps"] < 2.3 * m  # the server sends it to both remote ranks
    assert m <= a["hierarchical"] < 1.15 * m  # two shards, (H-1)/H of each, twice
    assert a["flat"] > m


def _disagree(rank, world, what):
    from moe_ep.collectives import Tiers, all_reduce
    from moe_ep.sync import CallMismatchError

    x = torch.full((8,), float(rank + 1))
    try:
        if what == "local_master":
            all_reduce(x, algorithm="tree", ranks_per_node=2, local_master=1 if rank == 1 else 0, timeout_s=10)
        else:  # "auto" resolves to tree on ranks 0, 1 and to flat on ranks 2, 3
            t = Tiers(bw_inter=1e6) if rank < 2 else Tiers(bw_inter=1e12, alpha_inter=1e-9)
            all_reduce(x, algorithm="auto", ranks_per_node=2, tiers=t, timeout_s=10)
    except CallMismatchError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("what", ["local_master", "tiers"])
def test_disagreeing_masters_or_resolved_algorithm_raise_mismatch(what):
    """Arguments that change who talks to whom (the tree's masters, the algorithm "auto" picks) are compared at
    arrival: CallMismatchError on every rank at once, not a hang or a gloo timeout."""
    out = launch(_disagree, 4, what, timeout_s=60, pg_timeout_s=15)
    key = "local_master" if what == "local_master" else "algorithm"
    assert all(key in o for o in out), out
