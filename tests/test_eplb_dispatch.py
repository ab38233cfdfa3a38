"""eplb.map_topk: every policy maps to a replica of the right expert; determinism; balance; fixed shapes."""

import numpy as np
import pytest
import torch

import eplb
from eplb.dispatch import replica_shares

POLICIES = ("static", "random", "round_robin", "balanced")


def _case(seed=0, N=257, K=8, E=64, P=96, G=16):
    g = torch.Generator().manual_seed(seed)
    w = torch.distributions.Dirichlet(torch.full((E,), 0.3)).sample((3,))  # skewed
    phy2log, log2phy, logcnt = eplb.rebalance_experts(w * 1000, P, 1, 1, G)
    scores = torch.log(w[0] + 1e-9)[None, :] - torch.log(-torch.log(torch.rand(N, E, generator=g)))
    topk = scores.topk(K, dim=1).indices
    topk[::7, -1] = -1  # some empty picks
    return topk, phy2log[0], log2phy[0], logcnt[0], G, P


def _gpu_loads(phy, G, P):
    v = phy[phy >= 0] // (P // G)
    return torch.bincount(v, minlength=G)


@pytest.mark.parametrize("policy", POLICIES)
def test_maps_to_a_replica_of_the_expert(policy):
    topk, phy2log, log2phy, logcnt, G, P = _case()
    out = eplb.map_topk(topk, log2phy, logcnt, policy, seed=3, num_gpus=G, num_slots=P)
    assert out.shape == topk.shape and out.dtype == torch.int64
    assert torch.equal(out < 0, topk < 0)
    ok = topk >= 0
    assert torch.equal(phy2log[out[ok]], topk[ok])
    again = eplb.map_topk(topk, log2phy, logcnt, policy, seed=3, num_gpus=G, num_slots=P)
    assert torch.equal(out, again), "deterministic given the seed"


def test_static_is_first_replica_and_seeds():
    topk, _, log2phy, logcnt, G, P = _case(1)
    out = eplb.map_topk(topk, log2phy, logcnt, "static")
    ok = topk >= 0
    assert torch.equal(out[ok], log2phy[topk[ok], 0])
    a = eplb.map_topk(topk, log2phy, logcnt, "random", seed=1)
    b = eplb.map_topk(topk, log2phy, logcnt, "random", seed=torch.tensor(1))
    c = eplb.map_topk(topk, log2phy, logcnt, "random", seed=2)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_round_robin_is_an_even_split():
    topk, _, log2phy, logcnt, G, P = _case(2)
    out = eplb.map_topk(topk, log2phy, logcnt, "round_robin")
    per_slot = torch.bincount(out[out >= 0], minlength=P)
    for e in range(log2phy.shape[0]):
        c = per_slot[log2phy[e, : logcnt[e]]]
        assert int(c.max() - c.min()) <= 1


@pytest.mark.parametrize("seed", range(4))
def test_balanced_never_worse_than_even_split(seed):
    topk, phy2log, log2phy, logcnt, G, P = _case(seed, N=1024)
    counts = torch.bincount(topk[topk >= 0], minlength=64).double()
    even = eplb.gpu_loads(phy2log[None], counts[None], G)[0]  # fractional even split
    bal = _gpu_loads(eplb.map_topk(topk, log2phy, logcnt, "balanced", num_gpus=G, num_slots=P), G, P)
    m = P // G
    assert bal.max().item() <= even.max() + m  # integer rounding: < 1 selection per slot


def test_balanced_uses_the_spare_replica():
    # GPU0 holds A and B, GPU1 holds A and C. A=10, B=10, C=0 selections: even split gives 15 / 5,
    # booking B first and then A on GPU1 gives 10 / 10.
    log2phy = torch.tensor([[0, 2], [1, -1], [3, -1]])
    logcnt = torch.tensor([2, 1, 1])
    topk = torch.tensor([[0], [1]] * 10)
    out = eplb.map_topk(topk, log2phy, logcnt, "balanced", num_gpus=2, num_slots=4)
    assert _gpu_loads(out, 2, 4).tolist() == [10, 10]
    shares = replica_shares(torch.tensor([10.0, 10.0, 0.0]), log2phy, logcnt, 2, 2, iters=16)
    np.testing.assert_allclose(shares.numpy(), [[0, 10], [10, 0], [0, 0]], atol=1e-2)


def test_empty_and_all_none():
    _, _, log2phy, logcnt, G, P = _case()
    for topk in (torch.empty(0, 8, dtype=torch.int64), torch.full((5, 8), -1)):
        for policy in POLICIES:
            out = eplb.map_topk(topk, log2phy, logcnt, policy, num_gpus=G, num_slots=P)
            assert out.shape == topk.shape and (out == -1).all()


def test_errors():
    topk, _, log2phy, logcnt, G, P = _case()
    with pytest.raises(ValueError, match="policy"):
        eplb.map_topk(topk, log2phy, logcnt, "best")
    with pytest.raises(ValueError, match="num_gpus"):
        eplb.map_topk(topk, log2phy, logcnt, "balanced")
    with pytest.raises(TypeError, match="int64"):
        eplb.map_topk(topk.float(), log2phy, logcnt)
    with pytest.raises(ValueError, match="2D"):
        eplb.map_topk(topk[0], log2phy, logcnt)
    with pytest.raises(ValueError, match="logcnt"):
        eplb.map_topk(topk, log2phy, logcnt[:-1])


@pytest.mark.gpu
@pytest.mark.parametrize("policy", POLICIES)
def test_cuda_graph_capture(policy):
    # Fixed shapes, no host sync: capture once, replay on new routing written into the same buffer.
    topk, phy2log, log2phy, logcnt, G, P = _case(5, N=4608)
    dev = torch.device("cuda")
    topk_d, log2phy_d, logcnt_d = topk.to(dev), log2phy.to(dev), logcnt.to(dev)
    seed = torch.tensor(7, device=dev)
    kw = dict(seed=seed, num_gpus=G, num_slots=P)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        eplb.map_topk(topk_d, log2phy_d, logcnt_d, policy, **kw)  # warm-up
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = eplb.map_topk(topk_d, log2phy_d, logcnt_d, policy, **kw)
    for k in range(3):
        new = _case(10 + k, N=4608)[0]
        topk_d.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        ref = eplb.map_topk(new, log2phy, logcnt, policy, seed=7, num_gpus=G, num_slots=P)
        if policy == "balanced":  # float sums may round differently on the GPU: check validity only
            ok = new >= 0
            assert torch.equal(phy2log[out.cpu()[ok]], new[ok])
        else:
            assert torch.equal(out.cpu(), ref)


def _small_case(seed):
    rng = np.random.default_rng(seed)
    E, G, m = int(rng.integers(2, 9)), int(rng.integers(2, 5)), int(rng.integers(1, 4))
    P = G * m
    if P < E:
        return None
    w = rng.random((1, E)) * rng.integers(1, 100, size=(1, E))
    try:
        _, log2phy, logcnt = eplb.rebalance_experts(w, P, 1, 1, G)
    except ValueError:  # more slots than one copy per GPU can fill
        return None
    N, K = int(rng.integers(1, 40)), int(rng.integers(1, min(E, 3) + 1))
    return torch.from_numpy(rng.integers(0, E, size=(N, K))), log2phy[0], logcnt[0], G, P


def _even_split_busiest(topk, log2phy, logcnt, G, P):
    # Each expert's c selections dealt to its n replicas in whole tokens: floor(c / n) or ceil(c / n) each.
    flat = topk[topk >= 0]
    E = log2phy.shape[0]
    counts = torch.bincount(flat, minlength=E)
    rank = torch.zeros_like(flat)
    seen = [0] * E
    for i, e in enumerate(flat.tolist()):
        rank[i] = seen[e]
        seen[e] += 1
    n = logcnt[flat]
    rep = (rank * n // counts[flat] + flat) % n  # balanced takes expert e's replicas rotated by e (seed 0, rank 0)
    return _gpu_loads(log2phy[flat, rep], G, P).max().item()


# 949, 957, 1305, 2864: the busiest GPU carried one token more than the even split (before the fix;
# about 1 in 700 of these small random cases).
@pytest.mark.parametrize("seeds", [[949, 957, 1305, 2864], range(400)], ids=["known", "random"])
def test_balanced_never_above_the_even_split_in_whole_tokens(seeds):
    for seed in seeds:
        case = _small_case(seed)
        if case is None:
            continue
        topk, log2phy, logcnt, G, P = case
        bal = eplb.map_topk(topk, log2phy, logcnt, "balanced", num_gpus=G, num_slots=P)
        assert _gpu_loads(bal, G, P).max().item() <= _even_split_busiest(topk, log2phy, logcnt, G, P), seed


@pytest.mark.parametrize("policy", ["round_robin", "balanced"])
def test_ranks_mapping_their_own_tokens_spread_over_replicas(policy):
    # 4 experts x 2 replicas on 4 GPUs; 8 ranks each map one token selecting all 4 experts. Without
    # rank= every rank picks the same replica of each expert (8 / 0 per slot); with it, 4 / 4.
    _, log2phy, logcnt = eplb.rebalance_experts(torch.ones(1, 4), 8, 1, 1, 4)
    tok = torch.tensor([[0, 1, 2, 3]])

    def per_slot(use_rank):
        outs = [eplb.map_topk(tok, log2phy[0], logcnt[0], policy, num_gpus=4, num_slots=8, rank=r if use_rank else 0)
                for r in range(8)]
        return torch.bincount(torch.cat(outs).reshape(-1), minlength=8).tolist()

    assert sorted(per_slot(False)) == [0, 0, 0, 0, 8, 8, 8, 8]
    assert per_slot(True) == [4] * 8
    with pytest.raises(ValueError, match="rank"):
        eplb.map_topk(tok, log2phy[0], logcnt[0], policy, num_gpus=4, num_slots=8, rank=-1)


def test_default_policy_is_round_robin():
    topk, _, log2phy, logcnt, G, P = _case(3)
    assert torch.equal(eplb.map_topk(topk, log2phy, logcnt, seed=2, rank=1),
                       eplb.map_topk(topk, log2phy, logcnt, "round_robin", seed=2, rank=1))
