"""DeepEP's rank-mask API on both backends (``Buffer(..., enable_shrink=True)``): mask a live rank on every rank,
check the defined outputs (recv_count excludes it, combine adds 0 for its experts, a self-masked rank serves only
itself), query the mask, clean it (rejoin) and check a full step again; refusals without enable_shrink."""

from __future__ import annotations

import os

import pytest
import torch

from moe_ep.testing import launch

WORLD, N, T, H, E, K = 3, 3, 4, 128, 6, 2
MASKED = 1


def _inputs(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(N, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)]).to(torch.int64)
    idx[0, 1] = -1  # a hole
    w = torch.rand(N, K, generator=g)
    return x, idx, w


def _scale(e):
    return 1.0 + 0.25 * e


def _expected(step, rank, live):
    """(combine output, recv_count) of ``rank`` when it exchanges with the ranks in ``live`` only."""
    L = E // WORLD
    x, idx, w = _inputs(step, rank)
    acc = torch.zeros(N, H)
    for k in range(K):
        e = idx[:, k]
        ok = (e >= 0) & torch.tensor([int(v) // L in live for v in e.clamp(min=0)])
        y = (x.float() * torch.tensor([_scale(int(v)) for v in e.clamp(min=0)]).unsqueeze(1)).to(torch.bfloat16)
        acc += torch.where(ok.unsqueeze(1), w[:, k:k + 1] * y.float(), torch.zeros_like(acc))
    count = torch.zeros(L, dtype=torch.int32)
    for src in live:
        _, sidx, _ = _inputs(step, src)
        for le in range(L):
            count[le] += int((sidx == rank * L + le).sum())
    return acc.to(torch.bfloat16), count


def _step(buf, step, rank):
    L = E // WORLD
    x, idx, w = _inputs(step, rank)
    recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
    scales = torch.tensor([_scale(rank * L + le) for le in range(L)]).view(L, 1, 1)
    out, _, _ = buf.low_latency_combine((recv_x.float() * scales).to(torch.bfloat16), idx, w, handle)
    return out, recv_count


def _rank(rank, world, backend):
    import torch.distributed as dist

    import moe_ep
    from moe_ep.backends.symm import SymmBackend

    kw = dict(provider="shm", num_rdma_bytes=SymmBackend.get_low_latency_size_hint(T, H, world, E, K)) \
        if backend == "symm" else {}
    if backend == "nvshmem":  # every peer remote (emulated NVSHMEM puts), but 0 and 1 share a node
        from moe_ep.backends.nvshmem import NvshmemBackend
        kw = dict(ranks_per_node=2, num_rdma_bytes=NvshmemBackend.get_low_latency_size_hint(T, H, world, E, K))
    buf = moe_ep.Buffer(None, low_latency_mode=True, enable_shrink=True, backend=backend, timeout_s=20, **kw)
    everyone = list(range(world))
    checks = []
    # step 0: nobody masked
    out, cnt = _step(buf, 0, rank)
    ref, ref_cnt = _expected(0, rank, everyone)
    checks.append(torch.equal(out.view(torch.int16), ref.view(torch.int16)) and torch.equal(cnt, ref_cnt))
    # steps 1-2: every rank masks MASKED (the masked rank itself too: it then exchanges with nobody else)
    buf.low_latency_update_mask_buffer(MASKED, True)
    status = torch.full((world,), -7, dtype=torch.int32)
    buf.low_latency_query_mask_buffer(status)
    checks.append(status.tolist() == [int(r == MASKED) for r in everyone])
    checks.append(buf.low_latency_masked_ranks() == [MASKED])
    live = [rank] if rank == MASKED else [r for r in everyone if r != MASKED]
    for step in (1, 2):
        out, cnt = _step(buf, step, rank)
        ref, ref_cnt = _expected(step, rank, live)
        checks.append(torch.equal(out.view(torch.int16), ref.view(torch.int16)) and torch.equal(cnt, ref_cnt))
    # rejoin: a barrier over the full group (the host step an operator runs), clean on every rank, full steps again
    dist.barrier()
    buf.low_latency_clean_mask_buffer()
    buf.low_latency_query_mask_buffer(status)
    checks.append(status.tolist() == [0] * world and buf.low_latency_masked_ranks() == [])
    for step in (3, 4):
        out, cnt = _step(buf, step, rank)
        ref, ref_cnt = _expected(step, rank, everyone)
        checks.append(torch.equal(out.view(torch.int16), ref.view(torch.int16)) and torch.equal(cnt, ref_cnt))
    # unmasking with mask=False also works (DeepEP's default argument)
    buf.low_latency_update_mask_buffer(MASKED, True)
    buf.low_latency_update_mask_buffer(MASKED)
    checks.append(buf.low_latency_masked_ranks() == [])
    return checks


@pytest.mark.parametrize("backend", ["torch", "symm", "nvshmem"])
def test_mask_api_live_ranks(backend):
    if backend != "torch" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU ranks run the symm kernels in the Triton interpreter")
    res = launch(_rank, WORLD, backend, timeout_s=300)
    for r, checks in enumerate(res):
        assert all(checks), (r, checks)


def _refusals(rank, world):
    import moe_ep

    out = []
    for kwargs in (dict(enable_shrink=True), dict(enable_shrink=True, low_latency_mode=False)):
        try:
            moe_ep.Buffer(None, backend="torch", **kwargs)
            out.append("built")
        except ValueError as exc:
            out.append("low_latency_mode=True" in str(exc))
    buf = moe_ep.Buffer(None, backend="torch", low_latency_mode=True)
    for call in (lambda: buf.low_latency_update_mask_buffer(0, True), buf.low_latency_clean_mask_buffer,
                 lambda: buf.low_latency_query_mask_buffer(torch.zeros(world, dtype=torch.int32))):
        try:
            call()
            out.append("ran")
        except ValueError as exc:
            out.append("enable_shrink=True" in str(exc))
    shrink = moe_ep.Buffer(None, backend="torch", low_latency_mode=True, enable_shrink=True)
    for call in (lambda: shrink.low_latency_update_mask_buffer(world, True),
                 lambda: shrink.low_latency_query_mask_buffer(torch.zeros(world + 1, dtype=torch.int32))):
        try:
            call()
            out.append("ran")
        except ValueError:
            out.append(True)
    # no rank leaves while a peer may still be connecting a group the Buffers set up (gloo would see the
    # closed socket as a crash)
    torch.distributed.barrier()
    return out


def test_refusals():
    assert launch(_refusals, 2, timeout_s=60) == [[True] * 7] * 2


# ---------------------------------------------------------------------- failure semantics (issue 33), virtual ranks
def _virtual(R, T_, H_, E_, K_, transport, timeout_s=0.3, shrink=True):
    """``R`` low-latency paths of one process (every phase ordered by hand)."""
    import warnings

    warnings.simplefilter("ignore")
    if transport == "symm":
        from moe_ep.backends.symm import virtual_backends
        from moe_ep.backends.symm_ll import SymmLowLatency

        bks = virtual_backends(R, num_nvl_bytes=0, num_rdma_bytes=SymmLowLatency.size_hint(T_, H_, R, E_, K_),
                               low_latency_mode=True, device=torch.device("cpu"), timeout_s=timeout_s)
        paths = [b.ll for b in bks]
    else:
        from moe_ep.backends.nvshmem import nvshmem_ll_size_hint, virtual_nvshmem_paths

        paths = virtual_nvshmem_paths(R, nvshmem_ll_size_hint(T_, H_, R, E_, K_), ranks_per_node=R,
                                      timeout_s=timeout_s)
    for p in paths:
        p.shrink = shrink
    return paths


def _send(p, x, idx, T_, E_):
    return p.dispatch_send(x, idx, T_, E_, use_fp8=False, round_scale=False, use_ue8m0=False)


def _late_writer(transport, past_gate):
    """A masked but still-running rank S whose OLD (call 0) combine send resumes in call 2, when a survivor P's slot
    (0, 1) holds a live rank D's row of call 2. ``past_gate``: S read P's ``COMB_DONE`` word before P finished call
    0 (emulated: the word reads 0 during S's send), so its row lands. Returns P's and D's paths, P's call-2 output,
    D's call-2 output and the call-3 outputs (S stopped)."""
    R, T_, H_, E_, K_ = 3, 1, 128, 3, 2
    P, D, S = 0, 1, 2
    paths = _virtual(R, T_, H_, E_, K_, transport)
    x = lambda v: torch.full((1, H_), float(v), dtype=torch.bfloat16)  # noqa: E731
    w = torch.ones(1, K_)
    idx0 = {P: torch.tensor([[0, 2]]), D: torch.tensor([[1, 0]]), S: torch.tensor([[2, 1]])}
    st = {r: _send(paths[r], x(10 + r), idx0[r], T_, E_) for r in range(R)}
    res0 = {r: paths[r].dispatch_recv(st[r]) for r in range(R)}
    cs = {r: paths[r].combine_send(res0[r].recv_x, idx0[r], w, res0[r].handle) for r in (P, D)}
    for r in (P, D):
        paths[r].combine_recv(cs[r])  # S never combined: masked by both
    assert paths[P].mask.tolist()[S] and paths[D].mask.tolist()[S]
    idx = {P: torch.tensor([[0, 1]]), D: torch.tensor([[1, 0]])}
    outs = []
    for call in (1, 2, 3):
        st = {r: _send(paths[r], x(20 + r), idx[r], T_, E_) for r in (P, D)}
        res = {r: paths[r].dispatch_recv(st[r]) for r in (P, D)}
        cs = {r: paths[r].combine_send(res[r].recv_x, idx[r], w, res[r].handle) for r in (P, D)}
        if call == 2:  # S's stalled call-0 combine send resumes now (same slot as call 0), into P's slot (0, 1)
            sig = paths[P].sig
            at = cs[P].slot * sig["SLOT_WORDS"] + sig.get("COMB_DONE", 0)
            done = int(paths[P].symm.signals[at]) if "COMB_DONE" in sig else None
            assert done is None or done >> 16 == 1  # P closed call 0 of this slot when its receive ended
            if past_gate and done is not None:
                paths[P].symm.signals[at] = 0
            paths[S].combine_send((res0[S].recv_x.float() * 100).to(torch.bfloat16), idx0[S], w, res0[S].handle)
            if done is not None:
                paths[P].symm.signals[at] = done
        outs.append({r: paths[r].combine_recv(cs[r]) for r in (P, D)})
    return paths[P], paths[D], outs


@pytest.mark.parametrize("transport", ["symm", "nvshmem"])
def test_late_writer_row_is_dropped_by_its_sender(transport):
    """A masked rank's combine send that resumes after the survivor finished that call's receive writes nothing
    there (the survivor's COMB_DONE word names the call): the survivor's later call is exact, no event, no error."""
    p, d, outs = _late_writer(transport, past_gate=False)
    assert [[o[r][0, 0].item() for r in (0, 1)] for o in outs] == [[40.0, 42.0]] * 3  # never 1020
    assert p.symm.broken is None and int(p.symm.status[0]) == 0 and not p.take_late_writes()


@pytest.mark.parametrize("transport", ["symm", "nvshmem"])
def test_late_writer_row_past_the_gate_is_a_masked_rank_event(transport):
    """A masked rank's late row that lands anyway (its sender read the gate before it closed) is never summed: the
    token is NaN, a masked-rank event is recorded once, and the survivor's Buffer stays usable (the failure
    enable_shrink survives); the next call is exact."""
    p, d, outs = _late_writer(transport, past_gate=True)
    assert [outs[0][r][0, 0].item() for r in (0, 1)] == [40.0, 42.0]
    assert torch.isnan(outs[1][0].float()).all() and outs[1][1][0, 0].item() == 42.0  # D's slots were not touched
    assert p.symm.broken is None and int(p.symm.status[0]) == 0
    assert p.take_late_writes() and not p.take_late_writes() and not d.take_late_writes()
    assert [outs[2][r][0, 0].item() for r in (0, 1)] == [40.0, 42.0]


@pytest.mark.parametrize("transport", ["symm", "nvshmem"])
def test_stale_row_of_an_unmasked_writer_stays_an_error(transport):
    """Only a MASKED writer's row is a masked-rank event: a slot whose header names a live rank other than the owner
    (here: combine's topk_idx is not the dispatch's) is still a device error naming the stamp."""
    R, T_, H_, E_, K_ = 2, 1, 128, 2, 2
    paths = _virtual(R, T_, H_, E_, K_, transport)
    x = torch.ones(1, H_, dtype=torch.bfloat16)
    w = torch.ones(1, K_)
    idx = torch.tensor([[0, 1]])
    st = {r: _send(paths[r], x, idx, T_, E_) for r in range(R)}
    res = {r: paths[r].dispatch_recv(st[r]) for r in range(R)}
    cs = {r: paths[r].combine_send(res[r].recv_x, idx, w, res[r].handle) for r in range(R)}
    cs[0].topk_idx = torch.tensor([[1, 0]])  # slot (0, 0) now "belongs" to rank 1, its header names rank 0
    with pytest.raises(RuntimeError, match="stamp"):
        paths[0].combine_recv(cs[0])
    assert not paths[0].take_late_writes()


@pytest.mark.parametrize("transport", ["symm", "nvshmem"])
def test_rank_dead_between_dispatch_and_combine_adds_zero(transport):
    """A rank that dies after its dispatch and before its combine: survivors mask it during the combine wait and
    add exactly 0 for its experts (not its rows of an earlier call in the same slot)."""
    R, T_, H_, E_, K_ = 3, 2, 128, 6, 2
    paths = _virtual(R, T_, H_, E_, K_, transport)

    def inputs(step, r):
        idx = torch.tensor([[r * 2 % E_, 4], [(r * 2 + 1) % E_, 5]])
        idx[idx[:, 0] == idx[:, 1], 1] = 3
        return torch.full((2, H_), float(step + 1), dtype=torch.bfloat16), idx

    for step in range(3):
        st = [_send(p, *inputs(step, r), T_, E_) for r, p in enumerate(paths)]
        res = [p.dispatch_recv(s) for p, s in zip(paths, st)]
        alive = range(R) if step < 2 else (0, 1)  # rank 2 dies between its step-2 dispatch and combine
        cs = {r: paths[r].combine_send(res[r].recv_x, inputs(step, r)[1], torch.ones(2, K_), res[r].handle)
              for r in alive}
        outs = {r: paths[r].combine_recv(cs[r])[:, 0].tolist() for r in alive}
    assert outs == {0: [3.0, 3.0], 1: [3.0, 3.0]}  # 3.0 from the live expert, 0 from rank 2's (stale: 1.0)
    assert [paths[r].mask.tolist()[2] for r in (0, 1)] == [2, 2]


@pytest.mark.parametrize("transport", ["symm", "nvshmem"])
def test_expert_id_out_of_range_unchecked(transport):
    """Host checks off (check_inputs=False, graph capture): an expert id >= E. The token's output is NaN (no stale
    row is summed), the step completes on every rank, and the status word says STATUS_BAD_EXPERT."""
    R, T_, H_, E_, K_ = 2, 2, 128, 4, 2
    paths = _virtual(R, T_, H_, E_, K_, transport, timeout_s=5, shrink=False)
    good = [torch.tensor([[0, 1], [2, 3]]), torch.tensor([[0, 2], [1, 3]])]

    def step(idxs, val):
        st = [_send(p, torch.full((2, H_), val, dtype=torch.bfloat16), i, T_, E_) for p, i in zip(paths, idxs)]
        res = [p.dispatch_recv(s) for p, s in zip(paths, st)]
        cs = [p.combine_send(r.recv_x, i, torch.ones(2, K_), r.handle) for p, r, i in zip(paths, res, idxs)]
        outs, errs = [], []
        for p, c in zip(paths, cs):
            try:
                outs.append(p.combine_recv(c))
                errs.append(None)
            except RuntimeError as exc:
                outs.append(c.out)
                errs.append(str(exc))
        return outs, errs

    step(good, 1.0)
    step(good, 2.0)
    outs, errs = step([torch.tensor([[0, 4], [2, 3]]), good[1]], 3.0)
    assert "expert id >= num_experts" in errs[0] and errs[1] is None
    assert torch.isnan(outs[0][0].float()).all() and outs[0][1, 0].item() == 6.0  # token 1 exact
    assert outs[1][:, 0].tolist() == [6.0, 6.0]


@pytest.mark.parametrize("transport", ["symm", "nvshmem"])
def test_dispatch_dtype_is_in_the_call_signature(transport):
    """BF16 on one rank and FP16 on another (use_fp8=False): the bits would be reinterpreted; CallMismatchError on
    both ranks, naming the flags field."""
    from moe_ep.sync import CallMismatchError

    paths = _virtual(2, 2, 128, 2, 1, transport, timeout_s=5, shrink=False)
    st = [_send(p, torch.full((1, 128), 1.5, dtype=dt), torch.tensor([[1 - r]]), 2, 2)
          for r, (p, dt) in enumerate(zip(paths, (torch.bfloat16, torch.float16)))]
    for p, s in zip(paths, st):
        with pytest.raises(CallMismatchError, match="flags"):
            p.dispatch_recv(s)


@pytest.mark.parametrize("transport", ["symm", "nvshmem"])
def test_rejoin_after_clean_realigns_double_buffers(transport):
    """Rank 1 taken out for one (odd) step, rank 0 serves alone, then the README's rejoin (clean on every rank):
    both ranks resume on the same slots and exchange again (no timeouts, no new masks)."""
    H_ = 128
    paths = _virtual(2, 1, H_, 2, 1, transport)
    x = torch.ones(1, H_, dtype=torch.bfloat16)
    w = torch.ones(1, 1)
    cross = {0: torch.tensor([[1]]), 1: torch.tensor([[0]])}

    def step(ranks, idx):
        st = {r: _send(paths[r], x * (r + 1), idx[r], 1, 2) for r in ranks}
        res = {r: paths[r].dispatch_recv(st[r]) for r in ranks}
        cs = {r: paths[r].combine_send(res[r].recv_x, idx[r], w, res[r].handle) for r in ranks}
        return {r: paths[r].combine_recv(cs[r])[0, 0].item() for r in ranks}

    assert step((0, 1), cross) == {0: 1.0, 1: 2.0}
    for p in paths:
        p.update_mask(1, True)
    assert step((0,), {0: torch.tensor([[0]])}) == {0: 1.0}
    for p in paths:
        p.clean_mask()
    assert step((0, 1), cross) == {0: 1.0, 1: 2.0}
    assert [p.mask.tolist() for p in paths] == [[0, 0], [0, 0]]
