"""``moe_ep.ElasticBuffer`` internals: memory per rank (vs the bytes mapped and DeepEP V2's hint), the ``symm``
source-index exchange (one all_to_all of bit-packed masks, no all_gather), and the expanded combine's float32
sum order (k ascending, bitwise, no host reads)."""

from __future__ import annotations

import pytest
import torch

from moe_ep.testing import launch
from moe_ep.testing.inputs import make_all_inputs, make_elastic_buffer

HIDDEN = 128
NUM_MAX = 8


def _make(backend: str, world: int, num_topk: int = 3, **kw):
    return make_elastic_buffer(backend, world, NUM_MAX, HIDDEN, num_topk, **kw)


# ---------------------------------------------------------------------------------------------- memory per rank
def _allocated(rank, world, num_topk, num_bytes):
    """Bytes of every symmetric region this rank's ElasticBuffer mapped (the storage behind each SymmBuffer)."""
    import moe_ep

    kw = {} if num_bytes is None else {"num_bytes": num_bytes}
    eb = moe_ep.ElasticBuffer(None, num_max_tokens_per_rank=NUM_MAX, hidden=HIDDEN, num_topk=num_topk,
                              backend="symm", provider="shm", timeout_s=30, **kw)
    regions = {b.buffer.untyped_storage().data_ptr(): b.buffer.untyped_storage().nbytes()
               for b in eb.buffer._impl._buffers}
    return sum(regions.values()), eb.num_bytes


@pytest.mark.parametrize("world,num_topk,num_bytes", [(2, 3, None), (4, 0, None), (2, 3, (6 << 20) + 100)])
def test_memory_per_rank_equals_the_bytes_allocated(world, num_topk, num_bytes):
    import moe_ep

    for allocated, nb in launch(_allocated, world, num_topk, num_bytes, timeout_s=60):
        want = moe_ep.ElasticBuffer.memory_per_rank(world, NUM_MAX, HIDDEN, num_topk, backend="symm",
                                                    num_bytes=num_bytes)
        assert allocated == want, (allocated, want)
        assert nb == (num_bytes if num_bytes is not None else
                      moe_ep.deepep.v2.memory.elastic_num_bytes(world, NUM_MAX, HIDDEN, num_topk))
    assert moe_ep.ElasticBuffer.memory_per_rank(world, NUM_MAX, HIDDEN, num_topk, backend="torch") == 0


def test_memory_helpers_refuse_bad_input_and_match_deepep_hand_counts():
    from moe_ep.deepep.v2.memory import deepep_v2_buffer_size_hint as hint
    from moe_ep.deepep.v2.memory import elastic_memory_per_rank as mem

    for bad in (lambda: mem(0, 8, 128), lambda: mem(2, -1, 128), lambda: mem(2, 8, 128, backend="nccl"),
                lambda: mem(2, 0, 0, backend="symm"), lambda: mem(2, 8, 128, num_bytes=0),
                lambda: hint(12, 128, 7168, 8), lambda: hint(8, 0, 7168, 8), lambda: hint(8, 128, 7168, 1.5)):
        with pytest.raises(ValueError):
            bad()
    MB2 = 2 << 20
    # one NVLink domain, BF16, top-8: dispatch slot 14336 + 0 + align32(64 + 36) = 14464 bytes, 8 x T slots;
    # combine slot 14336 + 64 = 14400, min(8, 8) x T slots: dispatch is the larger
    assert hint(8, 4096, 7168, 8) == -(-14464 * 8 * 4096 // MB2) * MB2
    # FP8: 7168 + 224 * 4 + 128 = 8192 per dispatch slot: now combine (14400 x 8 x T) is the larger
    assert hint(8, 4096, 7168, 8, True) == -(-14400 * 8 * 4096 // MB2) * MB2
    # two nodes of 8 (hybrid): U = 8, S = 2; dispatch 14464 x (8*2*T + T + 2*(T + 1280))
    T = 128
    assert hint(16, T, 7168, 8) == -(-max(14464 * (16 * T + T + 2 * (T + 1280)),
                                          14400 * (8 * 2 * T + 2 * T + 2 * (T + 1280))) // MB2) * MB2



@pytest.mark.parametrize("bad", [0, -3, 2.5, 4.0, True, "4"])
def test_chunk_tokens_is_checked_once_the_same_way_by_every_sizing_entry_point(bad):
    """``chunk_tokens`` has one check (SymmNormal.chunk): the Buffer's size hint, ElasticBuffer's sizing (whole_batch
    too) and chunk_for refuse the same values with the same message; none rounds a float or takes a bool as 1."""
    from moe_ep.backends.symm import SymmBackend
    from moe_ep.backends.symm_normal import SymmNormal
    from moe_ep.deepep.v2.memory import chunk_for, elastic_num_bytes

    calls = (lambda: SymmNormal.size_hint(None, 256, 8, 4, chunk_tokens=bad),
             lambda: SymmBackend.get_normal_size_hint(4096, 256, 8, 4, chunk_tokens=bad),
             lambda: elastic_num_bytes(4, 4096, 256, 8, chunk_tokens=bad),
             lambda: elastic_num_bytes(4, 4096, 256, 8, chunk_tokens=bad, whole_batch=True),
             lambda: chunk_for(4, 4096, bad))
    for call in calls:
        with pytest.raises(ValueError) as exc:
            call()
        assert str(exc.value) == f"chunk_tokens must be a positive int or None, got {bad!r}"


def test_chunk_tokens_clamp_is_the_same_for_both_sizings():
    """The chunk (tokens per source per round): chunk_tokens or the default, at most the batch, at least 1; the
    ElasticBuffer size is the Buffer's size hint of that chunk, rounded up to 2 MB."""
    import numpy as np

    from moe_ep.backends.symm_normal import SymmNormal
    from moe_ep.deepep.v2.memory import ALIGN_2MB, align, chunk_for, elastic_num_bytes

    assert chunk_for(4, 4096) == 1024 and chunk_for(64, 4096) == 64  # max(64, 4096 // R)
    assert chunk_for(4, 3) == 3 and chunk_for(4, 3, 7) == 3 and chunk_for(4, 4096, 7) == 7
    assert chunk_for(4, 0) == 1024 and chunk_for(4, 0, 7) == 7  # no batch size: not clamped
    assert chunk_for(4, 4096, np.int64(7)) == 7  # an integer type other than int is an int
    for T in (1, 3, 100, 5000):
        for ct in (None, 1, 7, 512):
            assert elastic_num_bytes(4, T, 256, 8, chunk_tokens=ct) == align(
                SymmNormal.size_hint(T, 256, 8, 4, chunk_tokens=chunk_for(4, T, ct)), ALIGN_2MB)
            if ct is not None:  # size_hint clamps to the batch itself
                assert SymmNormal.size_hint(T, 256, 8, 4, chunk_tokens=ct) == SymmNormal.size_hint(
                    None, 256, 8, 4, chunk_tokens=chunk_for(4, T, ct))

def test_readme_prefill_memory_table_is_the_computed_one():
    """Every row of the prefill memory table (docs/deepep-v2.md) is what moe_ep.deepep.v2.memory computes (ours fixed, one round,
    whole batch; DeepEP V1 and V2 hints), and the fixed size stays within DeepEP V2's hint at the README's shapes."""
    import pathlib

    from moe_ep.deepep.v2.memory import (deepep_v1_buffer_size_hints, deepep_v2_buffer_size_hint,
                                       elastic_memory_per_rank, elastic_num_bytes, prefill_memory_rows)

    readme = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "deepep-v2.md").read_text()
    rows = prefill_memory_rows()
    assert len(rows) == 6 and [r for r in rows if r not in readme] == []
    # DeepEP V1's hints with its default configs (hand counts: 10 channels, 8 NVLink peers, 16392 bytes a token)
    assert deepep_v1_buffer_size_hints(8, 7168) == (-(-(10 * 8 * 5 * 4 + 10 * 8 * 256 * 16392) // 128) * 128, 0)
    for T in (4096, 8192, 32768):
        for R in (8, 32):
            v2 = deepep_v2_buffer_size_hint(R, T, 7168, 8, nvlink_ranks=R)
            assert elastic_memory_per_rank(R, T, 7168, 8) < v2
            # one round through the time-shared area: DeepEP V2's bytes (the same 14464-byte rows)
            assert elastic_num_bytes(R, T, 7168, 8, chunk_tokens=T) == v2
    assert elastic_num_bytes(8, 4096, 7168, 8) == elastic_num_bytes(8, 32768, 7168, 8)  # fixed: not the batch


# ---------------------------------------------------------------------------------------------- symm source index
def _symm_source_exchange(rank, world, num_max):
    """The symm handle has no ``recv_src_idx``: the source global index comes from one all_to_all of bit-packed mask
    columns (``R * ceil(num_max / 8)`` bytes each way), no all_gather; it equals the torch backend's (which reports
    ``recv_src_idx``) on the same input."""
    import torch.distributed as dist

    import moe_ep
    from moe_ep.backends.symm import SymmBackend

    ins = make_all_inputs(world, [5, 7, 2, 6][:world], HIDDEN, 8, 3, seed=21)
    inp = ins[rank]
    sym = moe_ep.ElasticBuffer(None, num_max_tokens_per_rank=num_max, backend="symm", provider="shm", timeout_s=30,
                               num_bytes=SymmBackend.get_normal_size_hint(num_max, HIDDEN, 3, world))
    tor = moe_ep.ElasticBuffer(None, num_max_tokens_per_rank=num_max, backend="torch", timeout_s=30)
    calls = {"all_gather": 0, "a2a_bytes": 0}
    real_gather, real_a2a = dist.all_gather, dist.all_to_all_single

    def gather(*a, **k):
        calls["all_gather"] += 1
        return real_gather(*a, **k)

    def a2a(out, inp_, *a, **k):
        calls["a2a_bytes"] += inp_.numel() * inp_.element_size()
        return real_a2a(out, inp_, *a, **k)

    dist.all_gather, dist.all_to_all_single = gather, a2a
    try:
        hs = [sym.dispatch(inp.x, inp.topk_idx, inp.topk_weights, num_experts=8, do_cpu_sync=s)[3] for s in (True, False)]
    finally:
        dist.all_gather, dist.all_to_all_single = real_gather, real_a2a
    ht = tor.dispatch(inp.x, inp.topk_idx, inp.topk_weights, num_experts=8)[3]
    M = ht.num_recv_tokens
    same = all(torch.equal(h.recv_src_metadata[:M, :2], ht.recv_src_metadata[:, :2]) for h in hs)
    pad = bool((hs[1].recv_src_metadata[M:, :2] == -1).all())
    return calls, same and pad


@pytest.mark.parametrize("world,num_max", [(2, 8), (4, 13)])
def test_symm_source_index_needs_no_all_gather(world, num_max):
    for calls, same in launch(_symm_source_exchange, world, num_max, timeout_s=120):
        assert same
        assert calls["all_gather"] == 0, calls
        assert calls["a2a_bytes"] == 2 * world * ((num_max + 7) // 8), calls  # two dispatches


# ---------------------------------------------------------------------------------------------- expanded combine sum
def _order_values(gid: int, count: int) -> torch.Tensor:
    """`[count, HIDDEN]` BF16 values of a token's selections (j-th selection, k ascending). Four or more:
    1, 2^-8, 2^-24, ... (times a power of two per column), whose float32 sum is 1 in k order but 1 + 2^-7 in
    reverse order; also -0.0 rows, (v, -v) and (-0.0, -0.0) pairs, and random rows."""
    col = torch.tensor([(-1.0) ** c * 2.0 ** (c % 7 - 3) for c in range(HIDDEN)])
    if count >= 4:
        base = torch.tensor([1.0, 2.0 ** -8] + [2.0 ** -24] * (count - 2))
        return (base.unsqueeze(1) * col).to(torch.bfloat16)
    if count == 1 and gid % 2 == 0:
        return torch.full((1, HIDDEN), -0.0, dtype=torch.bfloat16)
    if count == 2 and gid % 3 == 0:
        v = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(gid)).to(torch.bfloat16)
        return torch.stack([v, -v])
    if count == 2 and gid % 3 == 1:
        return torch.full((2, HIDDEN), -0.0, dtype=torch.bfloat16)
    return torch.randn(count, HIDDEN, generator=torch.Generator().manual_seed(gid)).to(torch.bfloat16)


def _sum_in_order(vals: torch.Tensor) -> torch.Tensor:
    acc = torch.zeros(HIDDEN)
    for v in vals:  # float32, one selection at a time, starting from +0.0
        acc = acc + v.float()
    return acc.to(torch.bfloat16)


def _expanded_sum_order(rank, world):
    """Each token's experts sit on one rank (so the combined row is that rank's local sum, exactly), 1-6 of the
    8 top-k slots used, the rest holes, experts descending along k (so expanded-row order is reverse k order)."""
    from moe_ep.deepep.v2.buffer import ElasticBuffer
    from moe_ep.testing.traps import host_reads_trapped

    K, E = 8, 16
    L = E // world
    eb = _make("torch", world, num_topk=K)
    g = torch.Generator().manual_seed(3 + rank)
    topk_idx = torch.full((NUM_MAX, K), -1, dtype=torch.int64)
    counts = []
    for t in range(NUM_MAX):
        c, d = 1 + (t + rank) % 6, (t + rank) % world
        experts = (d * L + torch.randperm(L, generator=g)[:c]).sort(descending=True).values
        topk_idx[t, torch.randperm(K, generator=g)[:c].sort().values] = experts
        counts.append(c)
    x = torch.randn(NUM_MAX, HIDDEN, generator=g).to(torch.bfloat16)
    out = {}
    for sync in (True, False):
        _, ridx, _, h, _ = eb.dispatch(x, topk_idx, None, num_experts=E, expert_alignment=4, do_cpu_sync=sync,
                                       do_expand=True)
        assert ridx is None  # as DeepEP V2 (expanded); the handle keeps the per-token ids
        ridx = h.recv_topk_idx
        meta = h.recv_src_metadata
        y = torch.full((h.num_expanded_tokens, HIDDEN), float("nan"), dtype=torch.bfloat16)  # padding: ignored
        want_rows = torch.zeros(h.num_recv_tokens, HIDDEN, dtype=torch.bfloat16)
        for i in range(h.num_recv_tokens):
            slots = [int(s) for s in meta[i, 2:] if int(s) >= 0]  # k ascending
            if not slots:
                continue
            vals = _order_values(int(meta[i, 0]), len(slots))
            y[torch.tensor(slots)] = vals
            want_rows[i] = _sum_in_order(vals)
            if len(slots) >= 4:  # the case can tell the order: reversed it gives another result
                assert not torch.equal(_sum_in_order(vals.flip(0)), want_rows[i])
        with host_reads_trapped():  # capturable: no host read, CPU-synced handle or worst-case sizes
            rows = ElasticBuffer._sum_expanded(y, h)
            combined = eb.combine(y, h)[0]
        assert torch.equal(rows.view(torch.int16), want_rows.view(torch.int16)), (sync, rows, want_rows)
        if sync:  # rows gathered = real selections, not num_recv_tokens * num_topk
            assert sum(h._comb_rows) == int((ridx >= 0).sum()) < h.num_recv_tokens * K
        out[sync] = combined
    want = torch.stack([_sum_in_order(_order_values(rank * NUM_MAX + t, c)) for t, c in enumerate(counts)])
    for sync, combined in out.items():
        assert torch.equal(combined.view(torch.int16), want.view(torch.int16)), (sync, combined, want)
    return True


def test_expanded_combine_sums_k_ascending_bitwise_without_host_reads():
    assert all(launch(_expanded_sum_order, 2, timeout_s=120))


def _expanded_sum_random(rank, world, seed):
    """Random routing with -1 entries (and every other rank's experts as holes), top-8 of 12 experts, so
    fewer local experts (6) than top-k slots: the rows before the cross-rank combine equal the plain K-pass
    sum bitwise, CPU-synced handle and worst-case sizes alike (the order itself is pinned by the test above)."""
    from moe_ep.deepep.v2.buffer import ElasticBuffer

    K, E = 8, 12
    eb = _make("torch", world, num_topk=K)
    g = torch.Generator().manual_seed(seed * 10 + rank)
    topk_idx = torch.rand(NUM_MAX, E, generator=g).argsort(1)[:, :K]
    topk_idx[torch.rand(NUM_MAX, K, generator=g) < 0.3] = -1
    topk_idx[0] = -1
    topk_idx[0, 5] = 0  # at least one token on rank 0
    x = torch.randn(NUM_MAX, HIDDEN, generator=g).to(torch.bfloat16)
    for sync in (True, False):
        _, ridx, _, h, _ = eb.dispatch(x, topk_idx, None, num_experts=E, expert_alignment=4, do_cpu_sync=sync,
                                       do_expand=True)
        assert ridx is None  # as DeepEP V2 (expanded); the handle keeps the per-token ids
        ridx = h.recv_topk_idx
        y = (torch.randn(h.num_expanded_tokens, HIDDEN, generator=g) * 2.0 ** torch.randint(
            -12, 12, (h.num_expanded_tokens, 1), generator=g)).to(torch.bfloat16)
        y[::5] = -0.0
        slot = h.recv_src_metadata[:, 2:]
        acc = torch.zeros(h.num_recv_tokens, HIDDEN)
        for k in range(K):  # the plain form: K full passes, holes add +0.0
            acc += torch.where((slot[:, k] >= 0).unsqueeze(1), y[slot[:, k].clamp(min=0)].float(), 0.0)
        want = acc.to(torch.bfloat16)
        got = ElasticBuffer._sum_expanded(y, h)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (sync, got, want)
        assert bool((ridx < 0).any())
    return True


@pytest.mark.parametrize("seed", [1, 2])
def test_expanded_combine_sum_equals_the_plain_k_pass_sum(seed):
    assert all(launch(_expanded_sum_random, 2, seed, timeout_s=120))
