"""The one-launch Triton `map_topk` equals the torch path bitwise (interpreter) for every policy, with and
without a slot mask (lost count included), and compiles for sm90 without spills."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import eplb
from eplb.dispatch import POLICIES
from moe_ep.testing.sm90 import REPORT_PROLOGUE, compile_in_subprocess


def _case(seed):
    rng = np.random.default_rng(seed)
    E, G = int(rng.integers(4, 20)), int(rng.integers(2, 6))
    P = G * int(rng.integers(-(-E // G), -(-E // G) + 3))
    w = rng.random((1, E)) ** 3 * 100
    _, log2phy, logcnt = eplb.rebalance_experts(w, P, 1, 1, G)
    N, K = int(rng.integers(1, 70)), int(rng.integers(1, min(E, 4) + 1))
    topk = torch.from_numpy(rng.integers(0, E, size=(N, K)))
    topk[torch.from_numpy(rng.random((N, K)) < 0.05)] = -1
    mask = torch.from_numpy(rng.random(P) > 0.3)
    return topk, log2phy[0], logcnt[0], G, P, mask


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", range(3))
def test_kernel_equals_torch_bitwise(policy, seed):
    topk, log2phy, logcnt, G, P, mask = _case(seed)
    for m in (None, mask, mask.to(torch.int32)):
        kw = dict(seed=seed + 1, num_gpus=G, num_slots=P, slot_mask=m, rank=5 * seed)  # rank 0, 5, 10
        la, lb = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
        a = eplb.map_topk(topk, log2phy, logcnt, policy, lost_out=la, impl="torch", **kw)
        b = eplb.map_topk(topk, log2phy, logcnt, policy, lost_out=lb, impl="triton", **kw)
        assert torch.equal(a, b), (policy, seed, m is not None)
        assert int(la) == int(lb)


def test_kernel_seed_tensor_and_width():
    topk, log2phy, logcnt, G, P, mask = _case(5)
    kw = dict(num_gpus=G, num_slots=P, slot_mask=mask)
    a = eplb.map_topk(topk, log2phy, logcnt, "round_robin", seed=torch.tensor(4), impl="triton", **kw)
    b = eplb.map_topk(topk, log2phy, logcnt, "round_robin", seed=4, impl="triton",
                      max_replicas=int(logcnt.max()), **kw)
    assert torch.equal(a, b)


SCRIPT = REPORT_PROLOGUE + r'''
from eplb.kernels import sm90_cases
out = []
for c in sm90_cases():
    row = report.compile_report(c["kernel"], c["signature"], c["constexprs"], c["num_warps"], c["num_stages"],
                                c["attrs"])
    row = {k: v for k, v in row.items() if isinstance(v, (int, float, str))}
    row["config"] = c["config"]
    out.append(row)
print(json.dumps(out))
'''


def test_sm90_compiles_without_spills():
    rows = compile_in_subprocess(SCRIPT, [], "the map_topk kernel")
    assert len(rows) == 2 * len(POLICIES)
    for r in rows:
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
        assert r["regs"] <= 255, r
