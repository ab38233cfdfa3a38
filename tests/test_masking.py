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
