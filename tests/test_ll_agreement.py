"""Survivors agree on the mask (docs/protocols.md, "Agreement across survivors"; ``enable_shrink``).

A late rank ``q`` whose FULL lands just after some survivors' timeouts and just before the others': the first
group masks it in that receive (phase n), the second keeps it. Each sender publishes the ranks it masked by timeout
with its FULL (signature entry words 4..: mapped peers by stores before the release, NVSHMEM in the put-with-signal
payload) and each receive ORs its live senders' bits into its mask. Guarantee checked here: after phase n + 1 every
survivor's ``low_latency_masked_ranks()`` is the same (``q`` masked everywhere), and each phase's outputs are exact
for the live set its receive decided (a combine receive decides after adopting its senders' bits; a dispatch receive
adopts them after its reads, for the phases that follow).

The boundary is staged as in ``tests/test_ll_liveness.py``: a hook on the masked wait makes chosen ranks' wait on
``q`` act as a timeout although ``q``'s FULL is there. ``q`` keeps running (it is late, not dead)."""

from __future__ import annotations

import random

import pytest
import torch
import triton

from moe_ep.kernels import low_latency_common as llc
from moe_ep.kernels.low_latency_common import _adopt_masks, _write_mask_bits, sig_stride
from moe_ep.kernels.signals import MASK_TIMEOUT

H, K = 128, 2


@triton.jit
def _round_trip(sender_status, receiver_status, sig, rank, src, R):
    """Sender ``src`` writes its mask bits into its entry of ``sig``; receiver ``rank`` adopts them."""
    _write_mask_bits(sig, 0, src, sender_status, R, (4 + (R + 31) // 32 + 3) // 4 * 4)
    _adopt_masks(sig, 0, rank, src, receiver_status, R, (4 + (R + 31) // 32 + 3) // 4 * 4)


class _Boundary:
    """Wraps the receives' parallel FULL wait (``_wait_vec``): the first wait of rank ``r`` that includes ``q`` masks
    ``q`` (``MASK_TIMEOUT``, what a timed-out wait writes), for each armed ``(r, q)``, before it looks at the FULL
    words."""

    def __init__(self, monkeypatch, paths):
        self.paths, self.orig, self.armed = paths, llc._wait_vec, set()
        monkeypatch.setattr(llc, "_wait_vec", self)

    def __call__(self, sig_ptrs, value, need, peers, status_ptr, rank, *rest):
        r = _scalar(rank)
        waited = [int(p) for p, n in zip(_values(peers), _values(need)) if n]
        if not (rest[3:] and bool(getattr(rest[3], "value", rest[3]))):  # (not the landed waits: UNTIL_EQ)
            for q in waited:
                if (r, q) in self.armed:
                    self.armed.discard((r, q))
                    self.paths[r].mask[q] = MASK_TIMEOUT
        return self.orig(sig_ptrs, value, need, peers, status_ptr, rank, *rest)


def _scalar(v):
    return int(v.handle.data.item()) if hasattr(v, "handle") else int(v)


def _values(v):
    return v.handle.data.tolist() if hasattr(v, "handle") else list(v)


def _paths(R, E, T, transport):
    import warnings

    warnings.simplefilter("ignore")
    if transport == "symm":
        from moe_ep.backends.symm import virtual_backends
        from moe_ep.backends.symm_ll import SymmLowLatency

        bks = virtual_backends(R, num_nvl_bytes=0, num_rdma_bytes=SymmLowLatency.size_hint(T, H, R, E, K),
                               low_latency_mode=True, device=torch.device("cpu"), timeout_s=0.3)
        paths = [b.ll for b in bks]
    else:  # 3 ranks: every peer remote (the bits travel in the put-with-signal payload); 4: two per node (mixed)
        from moe_ep.backends.nvshmem import nvshmem_ll_size_hint, virtual_nvshmem_paths

        paths = virtual_nvshmem_paths(R, nvshmem_ll_size_hint(T, H, R, E, K), ranks_per_node=R - 2, timeout_s=0.3)
    for p in paths:
        p.shrink = True
    return paths


def _inputs(step, rank, n, E):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)]).to(torch.int64)
    return x, idx, torch.rand(n, K, generator=g)


def _scale(e):
    return 1.0 + 0.25 * e


def _masked(p):
    return [r for r, v in enumerate(p.mask.tolist()) if v]


def _check_dispatch(res, d, inputs, live, R, E):
    """recv_count / rows / recv_tokens of rank ``d`` are those of the sources in ``live`` (in order)."""
    L = E // R
    for le in range(L):
        rows = [inputs[s][0][t] for s in live for t in range(len(inputs[s][0])) if (inputs[s][1][t] == d * L + le).any()]
        assert int(res.recv_count[le]) == len(rows), (d, le, live)
        if rows:
            assert torch.equal(res.recv_x[le, :len(rows)].view(torch.int16), torch.stack(rows).view(torch.int16))
    for s in range(R):
        assert int(res.handle.recv_tokens[s]) == (len(inputs[s][0]) if s in live else 0), (d, s, live)


def _expected_combine(inp, live, R, E):
    x, idx, w = inp
    L = E // R
    ref = torch.zeros(x.shape[0], H)
    for k in range(K):
        e = idx[:, k]
        y = (x.float() * torch.tensor([_scale(int(v)) for v in e]).unsqueeze(1)).to(torch.bfloat16).float()
        ok = torch.tensor([int(v) // L in live for v in e]).unsqueeze(1)
        ref += torch.where(ok, w[:, k:k + 1] * y, torch.zeros_like(ref))
    return ref.to(torch.bfloat16)


def _expert(res, r, R, E):
    L = E // R
    scales = torch.tensor([_scale(r * L + le) for le in range(L)]).view(L, 1, 1)
    return (res.recv_x.float() * scales).to(torch.bfloat16)


def _step(paths, step, ranks, n, E, arm=None, hook=None, arm_phase=None):
    """One dispatch + combine of ``ranks`` (phases in rank order); ``arm`` is armed on ``hook`` just before the
    receives of ``arm_phase``. Returns (inputs, dispatch results, live set each receive decided, combine outputs)."""
    R = len(paths)
    inputs = {r: _inputs(step, r, n, E) for r in range(R)}
    st = {r: paths[r].dispatch_send(inputs[r][0], inputs[r][1], n, E, use_fp8=False, round_scale=False,
                                    use_ue8m0=False) for r in ranks}
    if arm_phase == "dispatch":
        hook.armed = set(arm)
    before = {r: _masked(paths[r]) for r in ranks}
    res = {r: paths[r].dispatch_recv(st[r]) for r in ranks}
    # the live set each dispatch receive decided: its mask before the call, plus what its own waits masked (an
    # adopted rank is masked after the reads, from the next phase on)
    hit = set(arm or ()) if arm_phase == "dispatch" else set()
    decided = {r: [s for s in range(R) if s not in before[r] and (r, s) not in hit or s == r] for r in ranks}
    cs = {r: paths[r].combine_send(_expert(res[r], r, R, E), inputs[r][1], inputs[r][2], res[r].handle)
          for r in ranks}
    if arm_phase == "combine":
        hook.armed = set(arm)
    out = {r: paths[r].combine_recv(cs[r]) for r in ranks}
    return inputs, res, decided, out


_CASES = [(tr, R, phase, seed) for tr in ("symm", "nvshmem") for R in (3, 4) for phase in ("dispatch", "combine")
          for seed in range(2)]


@pytest.mark.parametrize("transport,R,phase,seed", _CASES)
def test_survivors_agree_after_next_phase(monkeypatch, transport, R, phase, seed):
    """Some survivors mask late rank q at the boundary of phase n (a dispatch or a combine receive), the others keep
    it: after phase n + 1 every survivor masks q (equal ``low_latency_masked_ranks()``), and every output is exact
    for the live set its receive decided (q's rows / experts absent exactly where q was masked)."""
    rng = random.Random(100 * R + seed + (50 if phase == "combine" else 0))
    E, n = 2 * R, 3
    paths = _paths(R, E, n, transport)
    hook = _Boundary(monkeypatch, paths)
    q = rng.randrange(R)
    survivors = [r for r in range(R) if r != q]
    early = rng.sample(survivors, rng.randrange(1, len(survivors)))  # hit the boundary (mask q); the rest keep q
    arm = [(b, q) for b in early]
    everyone = list(range(R))

    # step 0: the boundary in phase n
    inputs, res, decided, out = _step(paths, 0, everyone, n, E, arm, hook, phase)
    assert not hook.armed
    for r in survivors:
        _check_dispatch(res[r], r, inputs, decided[r], R, E)
    if phase == "dispatch":
        # phase n + 1 = this step's combine: it adopted q before deciding, on every survivor
        for r in survivors:
            assert _masked(paths[r]) == [q], (r, early)
            live = [s for s in range(R) if s != q]
            assert torch.equal(out[r].view(torch.int16), _expected_combine(inputs[r], live, R, E).view(torch.int16))
        return
    for r in survivors:  # phase n = this combine: outputs exact for each survivor's own decision
        live = [s for s in range(R) if s != q] if r in early else everyone
        assert torch.equal(out[r].view(torch.int16), _expected_combine(inputs[r], live, R, E).view(torch.int16))
    assert sorted(r for r in survivors if _masked(paths[r])) == sorted(early)  # (the disagreement today)

    # step 1: phase n + 1 = its dispatch (q runs too: it is late, not dead); its combine among the survivors
    inputs1 = {r: _inputs(1, r, n, E) for r in range(R)}
    st = {r: paths[r].dispatch_send(inputs1[r][0], inputs1[r][1], n, E, use_fp8=False, round_scale=False,
                                    use_ue8m0=False) for r in everyone}
    res1 = {r: paths[r].dispatch_recv(st[r]) for r in everyone}
    for r in survivors:
        assert _masked(paths[r]) == [q], (r, early)
        # exact for the live set the receive decided: q's rows are in where q was still live at the decision
        _check_dispatch(res1[r], r, inputs1, everyone if r not in early else survivors, R, E)
    cs = {r: paths[r].combine_send(_expert(res1[r], r, R, E), inputs1[r][1], inputs1[r][2], res1[r].handle)
          for r in survivors}
    for r in survivors:
        got = paths[r].combine_recv(cs[r])
        assert torch.equal(got.view(torch.int16), _expected_combine(inputs1[r], survivors, R, E).view(torch.int16))
        assert _masked(paths[r]) == [q]


@pytest.mark.parametrize("R", [40, 144])
def test_mask_bits_round_trip_many_ranks(R):
    """The mask-bit words at EP sizes past 32 ranks (bit 31 and several words): what a sender writes from its
    MASK_TIMEOUT words is what a receiver adopts; API masks are not sent, the receiver's own rank never adopted."""
    def status(mask):
        st = torch.zeros(4 + R + 1, dtype=torch.int32)
        st[1] = 1  # STATUS_SHRINK
        st[4:4 + R] = torch.tensor(mask, dtype=torch.int32)
        return st

    timed_out = {0, 31, 32, 63, R - 1} & set(range(R))
    sender = status([MASK_TIMEOUT if r in timed_out else (1 if r == 5 else 0) for r in range(R)])  # 5: API mask
    rank, src = 31 if R > 40 else 7, 3
    receiver = status([1 if r == 0 else 0 for r in range(R)])  # an API mask already there stays as it is
    sig = torch.zeros(sig_stride(R) * R, dtype=torch.int32)
    _round_trip[(1,)](sender, receiver, sig, rank, src, R)
    words = sig[sig_stride(R) * src + 4: sig_stride(R) * src + 4 + (R + 31) // 32].tolist()
    want_bits = [sum(1 << (r - 32 * w) for r in timed_out if r // 32 == w and r < R) for w in range(len(words))]
    assert words == [b - (1 << 32) if b >= 1 << 31 else b for b in want_bits]  # as int32
    got = receiver[4:4 + R].tolist()
    want = [1 if r == 0 else (MASK_TIMEOUT if r in timed_out and r != rank else 0) for r in range(R)]
    assert got == want
