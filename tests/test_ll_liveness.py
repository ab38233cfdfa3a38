"""Low-latency receives decide liveness once per launch (docs/protocols.md, "A late or dead peer").

A source whose FULL lands exactly when a wait on it times out must be live for every program of the launch or
masked for every program: ``recv_count``, the offsets, the copied rows, the handle (``recv_tokens``, ``slot_row``)
and every combined token agree with the rank's mask after the call. The race is staged with a hook on the receives'
parallel wait (``moe_ep.kernels.low_latency_common._wait_vec``): the ``c``-th wait call of one receive that includes
peer ``p`` acts as a timeout (masks ``p``) although ``p``'s FULL is there,
after earlier calls of the same launch saw it live. (The interpreter runs the programs one after another, so
without the hook the boundary cannot be hit.)"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_masking import _send, _virtual  # noqa: E402

from moe_ep.kernels import low_latency_common as llc  # noqa: E402
from moe_ep.kernels.signals import MASK_TIMEOUT  # noqa: E402

R, H, E, K = 3, 128, 6, 2
L = E // R


class _ForceTimeout:
    """Wraps the receives' parallel FULL wait (``_wait_vec``) while armed: the ``call``-th wait of rank ``rank`` that
    includes ``peer`` masks ``peer`` (``MASK_TIMEOUT``, what a timed-out wait writes) before it looks at the FULL
    words."""

    def __init__(self, monkeypatch, paths):
        self.paths, self.orig, self.armed, self.calls, self.fired = paths, llc._wait_vec, None, 0, False
        monkeypatch.setattr(llc, "_wait_vec", self)

    def arm(self, rank, peer, call):
        self.armed, self.calls, self.fired = (rank, peer, call), 0, False

    def __call__(self, sig_ptrs, value, need, peers, status_ptr, rank, *rest):
        until_eq = rest[3:] and bool(getattr(rest[3], "value", rest[3]))  # (the NVSHMEM landed waits: not counted)
        if self.armed is not None and not until_eq:
            r = int(rank.handle.data.item()) if hasattr(rank, "handle") else int(rank)
            waited = [int(p) for p, n in zip(peers.handle.data.tolist(), need.handle.data.tolist()) if n]
            r0, p0, c0 = self.armed
            if r == r0 and p0 in waited:
                self.calls += 1
                if self.calls == c0:
                    self.paths[r].mask[p0] = MASK_TIMEOUT
                    self.fired = True
        return self.orig(sig_ptrs, value, need, peers, status_ptr, rank, *rest)


def _inputs(seed, rank, n):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randn(n, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)]).to(torch.int64)
    return x, idx, torch.rand(n, K, generator=g)


def _check_dispatch(res, d, inputs, mask):
    """recv_count / rows / handle of rank ``d`` equal what its mask after the call says (sources in order)."""
    live = [s for s in range(R) if mask[s] == 0]
    h = res.handle
    for le in range(L):
        rows = [inputs[s][0][t] for s in live for t in range(len(inputs[s][0]))
                if (inputs[s][1][t] == d * L + le).any()]
        assert int(res.recv_count[le]) == len(rows), (le, live)
        if rows:
            got = res.recv_x[le, :len(rows)].view(torch.int16)
            assert torch.equal(got, torch.stack(rows).view(torch.int16)), (le, live)
    for s in range(R):
        if s not in live:
            assert int(h.recv_tokens[s]) == 0 and (h.slot_row[s] == -1).all(), (s, live)
        else:
            assert int(h.recv_tokens[s]) == len(inputs[s][0])


# every (peer, call) the old per-program waits could hit with R = 3 (peer p was waited on R - p times per launch)
_CASES = [(p, c, seed) for p in range(R) for c in range(1, R - p + 1) for seed in range(2)]


@pytest.mark.parametrize("peer,call,seed", _CASES)
def test_dispatch_recv_liveness_is_one_decision(monkeypatch, peer, call, seed):
    """A source masked at the boundary by one wait of the receive while another program saw it live: every
    program uses one decision, so recv_count, rows and handle match the mask after the call."""
    n = 4
    paths = _virtual(R, n, H, E, K, "symm")
    hook = _ForceTimeout(monkeypatch, paths)
    inputs = [_inputs(seed, r, n) for r in range(R)]
    st = [_send(paths[r], inputs[r][0], inputs[r][1], n, E) for r in range(R)]
    d = random.Random(seed).randrange(R)
    for r in range(R):
        if r == d:
            hook.arm(d, peer, call)
        res = paths[r].dispatch_recv(st[r])
        hook.armed = None
        mask = paths[r].mask.tolist()
        _check_dispatch(res, r, inputs, mask)
    assert hook.fired == (call == 1)  # one wait per source and launch: the deciding program's


@pytest.mark.parametrize("transport", ["symm", "nvshmem"])
@pytest.mark.parametrize("call", [1, 2])
def test_combine_recv_liveness_is_one_decision(monkeypatch, transport, call):
    """An expert rank masked at the boundary by one wait of the combine receive (two programs: 70 tokens): every
    token, in every program, adds exactly 0 for it, or every token uses its rows: what the mask after the call says."""
    n = 70  # > 64 tokens: two combine-receive programs (and two per source in the dispatch receive)
    paths = _virtual(R, n, H, E, K, transport)
    hook = _ForceTimeout(monkeypatch, paths)
    inputs = [_inputs(7, r, n) for r in range(R)]
    st = [_send(paths[r], inputs[r][0], inputs[r][1], n, E) for r in range(R)]
    res = [paths[r].dispatch_recv(s) for r, s in enumerate(st)]
    scale = [1.0 + 0.25 * e for e in range(E)]
    cs = []
    for r in range(R):
        y = (res[r].recv_x.float() * torch.tensor(scale[r * L:(r + 1) * L]).view(L, 1, 1)).to(torch.bfloat16)
        cs.append(paths[r].combine_send(y, inputs[r][1], inputs[r][2], res[r].handle))
    d, p = 0, 2
    hook.arm(d, p, call)
    out = paths[d].combine_recv(cs[d])
    mask = paths[d].mask.tolist()
    x, idx, w = inputs[d]
    ref = torch.zeros(n, H)
    for k in range(K):
        e = idx[:, k]
        y = (x.float() * torch.tensor([scale[int(v)] for v in e]).unsqueeze(1)).to(torch.bfloat16).float()
        live = torch.tensor([mask[int(v) // L] == 0 for v in e]).unsqueeze(1)
        ref += torch.where(live, w[:, k:k + 1] * y, torch.zeros_like(ref))
    assert torch.equal(out.view(torch.int16), ref.to(torch.bfloat16).view(torch.int16))
    assert hook.fired == (call == 1)  # one wait per expert rank and launch: the deciding program's
