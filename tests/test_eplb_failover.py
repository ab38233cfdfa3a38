"""Failover: dead slots are never chosen, experts with no live replica map to -1 and are counted exactly,
and `replan_on_survivors` keeps every expert, moves the fewest slots, never duplicates on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import eplb
from eplb.metrics import slots_moved

POLICIES = ("static", "random", "round_robin", "balanced")


def _case(seed=0, N=300, K=4, E=32, P=48, G=8):
    rng = np.random.default_rng(seed)
    w = rng.random((1, E)) ** 3 * 100
    phy2log, log2phy, logcnt = eplb.rebalance_experts(w, P, 1, 1, G)
    topk = torch.from_numpy(rng.integers(0, E, size=(N, K)))
    topk[rng.random((N, K)) < 0.05] = -1
    return topk, phy2log[0], log2phy[0], logcnt[0], G, P


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", range(4))
def test_dead_slots_never_chosen_and_lost_counted(policy, seed):
    topk, phy2log, log2phy, logcnt, G, P = _case(seed)
    rng = np.random.default_rng(100 + seed)
    mask = torch.from_numpy(rng.random(P) > 0.35)
    if seed % 2:
        mask = mask.to(torch.int32)  # int masks: nonzero = live
    lost = torch.zeros((), dtype=torch.int64)
    out = eplb.map_topk(topk, log2phy, logcnt, policy, seed=3, num_gpus=G, num_slots=P, slot_mask=mask,
                        lost_out=lost)
    live_of_expert = np.zeros(log2phy.shape[0], np.int64)
    for s in range(P):
        live_of_expert[phy2log[s]] += int(mask[s] != 0)
    ok = out >= 0
    assert bool((mask[out[ok]] != 0).all()), "a dead slot was chosen"
    assert torch.equal(phy2log[out[ok]], topk[ok])
    t = topk.numpy()
    want_lost = (t >= 0) & (live_of_expert[np.maximum(t, 0)] == 0)
    assert np.array_equal(out.numpy() == -1, (t < 0) | want_lost)
    assert int(lost) == int(want_lost.sum())


@pytest.mark.parametrize("policy", POLICIES)
def test_all_live_mask_is_no_mask(policy):
    topk, _, log2phy, logcnt, G, P = _case(7)
    kw = dict(seed=5, num_gpus=G, num_slots=P)
    ref = eplb.map_topk(topk, log2phy, logcnt, policy, **kw)
    lost = torch.full((), 99, dtype=torch.int64)
    out = eplb.map_topk(topk, log2phy, logcnt, policy, slot_mask=torch.ones(P, dtype=torch.bool), lost_out=lost, **kw)
    assert torch.equal(out, ref) and int(lost) == 0


def test_dead_gpu_goes_to_surviving_replicas_static():
    # Expert 0 on slots 0 (GPU0) and 2 (GPU1); GPU0 dead: static picks slot 2; expert 1 only on GPU0: lost.
    log2phy = torch.tensor([[0, 2], [1, -1], [3, -1]])
    logcnt = torch.tensor([2, 1, 1])
    mask = torch.tensor([False, False, True, True])
    lost = torch.zeros((), dtype=torch.int64)
    out = eplb.map_topk(torch.tensor([[0, 1], [2, -1]]), log2phy, logcnt, "static", slot_mask=mask, lost_out=lost)
    assert out.tolist() == [[2, -1], [3, -1]] and int(lost) == 1


def test_mask_errors():
    topk, _, log2phy, logcnt, G, P = _case(1)
    with pytest.raises(ValueError, match="slot_mask"):
        eplb.map_topk(topk, log2phy, logcnt, slot_mask=torch.ones(P + 1, dtype=torch.bool), num_slots=P)
    with pytest.raises(TypeError, match="slot_mask"):
        eplb.map_topk(topk, log2phy, logcnt, slot_mask=torch.ones(P))
    with pytest.raises(ValueError, match="lost_out"):
        eplb.map_topk(topk, log2phy, logcnt, lost_out=torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="impl"):
        eplb.map_topk(topk, log2phy, logcnt, impl="cuda")


def _gpu_sets(row, G):
    spg = row.shape[0] // G
    return [row[g * spg:(g + 1) * spg] for g in range(G)]


@pytest.mark.parametrize("dead", [[0], [1, 5], [0, 1, 2, 3], [2, 3, 4, 6]])
def test_replan_keeps_every_expert_and_moves_few(dead):
    rng = np.random.default_rng(len(dead))
    E, G, P = 32, 8, 64
    w = rng.random((2, E)) ** 3 * 100
    phy2log, _, _ = eplb.rebalance_experts(w, P, 1, 1, G)
    new, log2phy, logcnt = eplb.replan_on_survivors(phy2log, dead, G, w)
    spg = P // G
    for layer in range(2):
        row, old = new[layer].numpy(), phy2log[layer].numpy()
        dead_slots = np.concatenate([np.arange(g * spg, (g + 1) * spg) for g in dead])
        assert (row[dead_slots] == -1).all()
        live = np.setdiff1d(np.arange(P), dead_slots)
        survivors_have = set(old[live].tolist())
        lost = set(range(E)) - survivors_have
        if live.size >= E:
            assert set(row[live].tolist()) == set(range(E)), "an expert is missing"
        # Only lost experts were written, one slot each: the minimum.
        changed = live[row[live] != old[live]]
        assert len(changed) == len(lost) and set(row[changed].tolist()) == lost
        for g in range(G):
            if g not in dead:
                s = row[g * spg:(g + 1) * spg]
                assert len(set(s.tolist())) == s.size, "two copies of an expert on one GPU"
        # EPLB format consistent.
        for e in range(E):
            c = int(logcnt[layer, e])
            assert sorted(log2phy[layer, e, :c].tolist()) == sorted(np.flatnonzero(row == e).tolist())
            assert (log2phy[layer, e, c:] == -1).all()
    # slots_moved on the live part (dead slots compare as "expert 0" in neither).
    fill = np.where(new.numpy() < 0, phy2log.numpy(), new.numpy())
    assert slots_moved(fill, phy2log.numpy(), G) <= 2 * E


def test_replan_short_of_slots_keeps_heaviest():
    # 8 experts on 4 GPUs x 2 slots, no spare copies: any dead GPU loses its experts for good.
    phy2log = torch.arange(8)
    new, log2phy, logcnt = eplb.replan_on_survivors(phy2log, [1], 4)
    assert new.tolist() == [0, 1, -1, -1, 4, 5, 6, 7] and logcnt.tolist() == [1, 1, 0, 0, 1, 1, 1, 1]


def test_replan_then_map_loses_nothing():
    topk, phy2log, log2phy, logcnt, G, P = _case(3, E=32, P=48, G=8)
    dead = [2, 5]
    new, l2p, lc = eplb.replan_on_survivors(phy2log, dead, G)
    mask = new >= 0
    lost = torch.zeros((), dtype=torch.int64)
    out = eplb.map_topk(topk, l2p, lc, "balanced", num_gpus=G, num_slots=P, slot_mask=mask, lost_out=lost)
    assert int(lost) == 0 and torch.equal(new[out[topk >= 0]], topk[topk >= 0])
