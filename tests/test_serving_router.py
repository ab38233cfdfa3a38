"""PD load balancing: the policies on hand-checkable states, and where each wins in simulation."""

import numpy as np
import pytest

from serving.pd_router import (BSBalance, DecodeCost, KVBalance, MixedBalance, RoundRobin, _lengths, _roulette,
                               dispatch_combine_bytes, make_policy, simulate)

B = np.array([1, 3, 2])
KV = np.array([10.0, 5.0, 7.0])
RNG = np.random.default_rng(0)


def test_argmin_policies_by_hand():
    assert KVBalance().choose(B, KV, RNG) == 1  # least KV
    assert BSBalance().choose(B, KV, RNG) == 0  # fewest requests
    # mixed 0.5: 0.5*[0.5,1.5,1.0] + 0.5*[1.364,0.682,0.955] = [0.932, 1.091, 0.977]
    assert MixedBalance(0.5).choose(B, KV, RNG) == 0
    assert MixedBalance(0.0).choose(B, KV, RNG) == 1 and MixedBalance(1.0).choose(B, KV, RNG) == 0
    rr = RoundRobin()
    assert [rr.choose(B, KV, RNG) for _ in range(4)] == [0, 1, 2, 0]


class _FixedU:
    def __init__(self, u):
        self.u = u

    def random(self):
        return self.u


def test_roulette_weights_like_rtp_llm():
    # BS weights = max(b) - b = [2, 0, 1], total 3: U*3 in (0,2] -> 0, (2,3] -> 2; the busiest never wins.
    bs = BSBalance(roulette=True)
    assert bs.choose(B, KV, _FixedU(0.5)) == 0
    assert bs.choose(B, KV, _FixedU(0.9)) == 2
    assert B.tolist() == [1, 3, 2]  # weights computed on a copy
    # KV weights = free KV = [2, 7, 5] for capacity 12: U*14 = 7 -> cumsum [2, 9, 14] -> index 1.
    assert KVBalance(roulette=True, kv_capacity=12).choose(B, KV, _FixedU(0.5)) == 1
    assert _roulette(np.zeros(3), np.random.default_rng(0)) in (0, 1, 2)


def test_dispatch_combine_bytes_by_hand():
    d, c = dispatch_combine_bytes(1, 7168, 8)
    assert d == 8 * (7168 + 224 + 16) and c == 8 * 2 * 7168
    cost = DecodeCost(num_moe_layers=1, comm_bytes_per_s=1e9)
    assert cost.comm_s(np.array([2]))[0] == pytest.approx(2 * (d + c) / 1e9)


def test_make_policy_names():
    assert make_policy("mixed", 0.3).alpha == 0.3
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("least-loaded")


def _run(policy, isl_m, isl_cv, osl_m, osl_cv, bw):
    rng = np.random.default_rng(0)
    isl, osl = _lengths(rng, 2048, isl_m, isl_cv), _lengths(rng, 2048, osl_m, osl_cv)
    return simulate(make_policy(policy), 8, 256, isl, osl, DecodeCost(comm_bytes_per_s=bw), num_steps=120)


def test_batch_balance_wins_under_heavy_ep_traffic():
    kv, bs, mixed = (_run(p, 2000, 1.5, 400, 0.5, 12.5e9) for p in ("kv", "bs", "mixed"))
    assert bs.cv_batch < kv.cv_batch and bs.comm_s < kv.comm_s
    assert bs.step_s < kv.step_s
    assert bs.step_s <= mixed.step_s <= kv.step_s


def test_kv_balance_wins_when_attention_dominates():
    kv, bs = (_run(p, 16000, 2.0, 400, 1.0, 200e9) for p in ("kv", "bs"))
    assert kv.cv_kv < bs.cv_kv and kv.attention_s < bs.attention_s
    assert kv.step_s < bs.step_s


def test_uniform_lengths_policies_agree():
    kv, bs = (_run(p, 2000, 0.0, 400, 0.0, None) for p in ("kv", "bs"))
    assert kv.step_s == pytest.approx(bs.step_s, rel=0.03)
