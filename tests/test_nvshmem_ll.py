"""moe_ep.Buffer(backend="nvshmem"): the low-latency semantic suite of the ``symm`` backend, run through the NVSHMEM
transport of the same kernels on forked CPU ranks, where the NVSHMEM device calls are emulated over the shm peer
table (moe_ep.kernels.nvshmem_device), in both emulation orders and with every peer remote or two ranks per node."""

from __future__ import annotations

import os
import zlib

import pytest
import torch
import triton
import triton.language as tl

from moe_ep.backends.nvshmem import NvshmemBackend
from moe_ep.kernels import nvshmem_device as nv
from moe_ep.testing import launch
from moe_ep.testing.suite import check_buffer_case

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU ranks run the kernels and the NVSHMEM emulation in the Triton interpreter")

CASES = [
    # world, tokens per rank, hidden, experts, topk, routing, extras, emulation order, ranks per node
    (2, 0, 128, 4, 2, "random", {"T": 4}, "eager", 1),
    (2, 7, 256, 8, 4, "random", {}, "deferred", 1),
    (4, [3, 9, 1, 0], 128, 8, 4, "skip_last_rank", {"T": 12}, "deferred", 2),
    (4, 5, 128, 16, 8, "one_expert", {}, "eager", 2),
    (4, [1, 2, 3, 0], 128, 16, 8, "random", {"T": 8}, "deferred", 1),
]


def _run(rank, world, case, order, **kwargs):
    from moe_ep.kernels import nvshmem_device
    nvshmem_device.set_emulation_order(order)
    ok = check_buffer_case(rank, world, case, "nvshmem", modes=("low_latency",), **kwargs)
    assert nvshmem_device.source_errors() == []  # (deferred: no put source changed before its delivery)
    return ok


@pytest.mark.parametrize("world,n,hidden,E,k,routing,extra,order,rpn", CASES,
                         ids=[f"R{c[0]}-N{c[1]}-H{c[2]}-E{c[3]}-K{c[4]}-{c[5]}-{c[7]}-rpn{c[8]}" for c in CASES])
def test_suite_low_latency(world, n, hidden, E, k, routing, extra, order, rpn):
    n_max = max(n) if isinstance(n, list) else n
    T = extra.get("T", max(n_max, 1))
    case = dict(seed=zlib.crc32(repr((world, n, hidden, E, k, routing)).encode()) % 10007, n=n, hidden=hidden, E=E,
                k=k, routing=routing, **extra)
    nbytes = NvshmemBackend.get_low_latency_size_hint(T, hidden, world, E, k)
    assert launch(_run, world, case, order, timeout_s=300, num_rdma_bytes=nbytes, ranks_per_node=rpn) == [True] * world


# ---------------------------------------------------------------------- the emulation holds non-blocking puts
@triton.jit
def _put_then_signal(buffer_ptrs, rank, peer, QUIET: tl.constexpr):
    own = tl.load(buffer_ptrs + rank)
    nv.putmem_nbi_block(own, own, 64, peer)  # bytes [0, 64) of this rank's region to the peer's
    nv.putmem_signal_nbi_block(own + 64, own + 64, 8, own + 128, 1, peer)  # then its signal word (byte 128)
    if QUIET:
        nv.quiet()


def _put_signal_rank(rank, world, order, with_quiet):
    import torch

    from moe_ep.backends.nvshmem import _emulated_heap

    nv.set_emulation_order(order)
    buf = _emulated_heap(None, rank, world, 4096, 64, 10.0, 1)
    table = torch.tensor([buf._nvshmem_heap_base if r == rank else 0 for r in range(world)], dtype=torch.int64)
    if rank == 0:
        buf.buffer[:64] = 7
        _put_then_signal[(1,)](table, 0, 1, QUIET=with_quiet)
    buf.barrier("sent")
    out = (int(buf.buffer[128:136].view(torch.int64)[0]), int(buf.buffer[:64].sum())) if rank == 1 else None
    buf.barrier("read")
    nv.unregister_heap(buf._nvshmem_heap_base)
    buf.close()
    return out


@pytest.mark.parametrize("order,with_quiet,seen", [("eager", False, True), ("manual", False, False),
                                                   ("manual", True, True)])
def test_emulation_delivers_nbi_puts_only_after_quiet(order, with_quiet, seen):
    """Non-eager orders hold every non-blocking put (put-with-signal included) until it is delivered: ``manual`` only
    at ``quiet`` (or ``deliver()``), so a protocol that reads what it was not signalled for reads stale bytes."""
    sig, total = launch(_put_signal_rank, 2, order, with_quiet, timeout_s=120)[1]
    assert (sig == 1) == seen and (total == 7 * 64) == seen, (sig, total)


def test_unmapped_peer_wait_is_a_plain_timeout():
    """enable_shrink, a peer on another node (no mapping, so no readable heartbeat) that never calls: it is masked
    after about timeout_s, not HB_CAP x timeout_s (the wait used to read this rank's own, ever-changing heartbeat)."""
    import time
    import warnings

    from moe_ep.backends.nvshmem import NvshmemBackend, virtual_nvshmem_paths

    warnings.simplefilter("ignore")
    timeout = 2.0  # (one timeout plus the interpreter's own time stays under 3 x timeout on a loaded machine)
    paths = virtual_nvshmem_paths(2, NvshmemBackend.get_low_latency_size_hint(1, 128, 2, 2, 1), ranks_per_node=1,
                                  timeout_s=timeout)
    for p in paths:
        p.shrink = True
    st = paths[0].dispatch_send(torch.ones(1, 128, dtype=torch.bfloat16), torch.tensor([[0]]), 1, 2, use_fp8=False,
                                round_scale=False, use_ue8m0=False)
    t0 = time.monotonic()
    paths[0].dispatch_recv(st)
    took = time.monotonic() - t0
    assert paths[0].mask.tolist() == [0, 2]
    assert took < 3 * timeout, took  # 4 x timeout_s before the fix


def _virtual_pair(timeout_s, shrink=False):
    import warnings

    from moe_ep.backends.nvshmem import NvshmemBackend, virtual_nvshmem_paths

    warnings.simplefilter("ignore")
    paths = virtual_nvshmem_paths(2, NvshmemBackend.get_low_latency_size_hint(1, 128, 2, 2, 1), ranks_per_node=1,
                                  timeout_s=timeout_s)
    for p in paths:
        p.shrink = shrink
    return paths


def _send(path, rank):
    x = torch.full((1, 128), float(rank + 1), dtype=torch.bfloat16)
    return path.dispatch_send(x, torch.tensor([[1 - rank]]), 1, 2, use_fp8=False, round_scale=False, use_ue8m0=False)


def test_rejoin_completes_in_flight_puts_before_zeroing():
    """Rejoin on NVSHMEM (``clean_mask``, every rank): a put of a returning rank's last call may still be in flight
    (``manual`` order: nothing delivers on its own). Zeroed first and landing after, it would leave FULL set (the next
    landed wait never completes). The call completes every put (``nvshmem_quiet``) before it zeroes: nothing is
    pending afterwards and every signal word of both slots is 0."""
    from moe_ep.backends.symm_ll_layout import NUM_SLOTS

    nv.set_emulation_order("manual")
    try:
        a, b = _virtual_pair(5.0, shrink=True)
        _send(b, 1)  # rank 1's dispatch to rank 0 (an unmapped peer): rows, counts and FULL as pending puts
        assert len(nv._PENDING) > 0
        for p in (a, b):
            p.clean_mask()
        assert nv._PENDING == []
        for p in (a, b):
            words = p.symm.signals[:NUM_SLOTS * p.sig["SLOT_WORDS"]].view(NUM_SLOTS, p.sig["SLOT_WORDS"])
            for name in ("DISP_FULL", "DISP_BUSY", "COMB_FULL", "COMB_BUSY"):
                assert int(words[:, p.sig[name]:p.sig[name] + 4].abs().sum()) == 0, name
    finally:
        nv.set_emulation_order("eager")


def test_put_sources_unchanged_until_complete():
    """Issue 33 #11: a non-blocking put's source may be read by the NIC until the put is complete. Rank 0's receive
    runs while its own puts to rank 1 are still undelivered (``manual`` order, delivered by hand afterwards); nothing
    it does may change their sources (it used to zero its own signature entry, the publish payload, and the headers
    of its own rows)."""
    nv.set_emulation_order("manual")
    try:
        a, b = _virtual_pair(5.0)
        st_b = _send(b, 1)
        st_a = _send(a, 0)
        nv.deliver(pe=0)  # rank 1's puts reach rank 0; rank 0's to rank 1 are still in flight
        res_a = a.dispatch_recv(st_a)
        nv.deliver()
        res_b = b.dispatch_recv(st_b)
        assert nv.source_errors() == []
        # and the data is right: each rank's one token went to the other's expert
        assert res_a.recv_count.tolist() == [1] and res_b.recv_count.tolist() == [1]
        assert float(res_a.recv_x[0, 0, 0]) == 2.0 and float(res_b.recv_x[0, 0, 0]) == 1.0
    finally:
        nv.set_emulation_order("eager")


def test_send_never_quiets_toward_a_dead_pe():
    """Issue 33 #12: with enable_shrink, a rank on another node dies; the survivor's next send puts to it (it is not
    masked yet). On a NIC ``nvshmem_quiet`` would then block until the retries run out (no timeout): the send must not
    quiet, and the receive's bounded wait masks the dead rank within about timeout_s."""
    import time

    nv.set_emulation_order("eager")
    nv.set_dead_pes([1])
    try:
        a, _ = _virtual_pair(0.5, shrink=True)
        t0 = time.monotonic()
        st = _send(a, 0)  # puts to rank 1 (the emulation raises if anything quiets them)
        a.dispatch_recv(st)
        assert a.mask.tolist() == [0, 2]
        assert time.monotonic() - t0 < 3.0
    finally:
        nv.set_dead_pes([])


def test_emulated_quiet_reports_a_dead_pe():
    """The emulation's dead-PE model itself: a quiet after a put to a dead PE raises (what the NIC would do: block)."""
    nv.set_emulation_order("eager")
    nv.set_dead_pes([1])
    try:
        a, _ = _virtual_pair(5.0)
        table = a.symm.buffer_ptrs.clone()
        table[0] = a.symm._nvshmem_heap_base
        with pytest.raises(Exception, match="quiet would block on pe 1"):
            _put_then_signal[(1,)](table, 0, 1, QUIET=True)
    finally:
        nv.set_dead_pes([])


@pytest.mark.parametrize("dead", [False, True])
def test_freeing_a_heap_settles_its_pending_puts(dead):
    """Freeing an emulated heap (``unregister_heap``, a Buffer's destroy) delivers the puts still pending into it first,
    as ``nvshmem_free`` quiets (a put to a dead PE is dropped): none is left for the deferred order's NIC thread to
    copy into memory unmapped afterwards (that copy crashed the process with a segfault)."""
    mem = torch.zeros(2, 64, dtype=torch.uint8)  # row 0: this rank's region, row 1: the peer's copy, mapped here
    base, peer = mem[0].data_ptr(), mem[1].data_ptr()
    nv.set_emulation_order("manual")  # nothing delivers on its own
    nv.set_dead_pes([1] if dead else [])
    try:
        nv.register_heap(base, 64, [base, peer])
        mem[0, :8] = torch.arange(1, 9, dtype=torch.uint8)
        nv._issue(base + 16, base, 8, 1, base + 32, 7, nv.SIGNAL_SET)
        assert len(nv._PENDING) == 1
        nv.unregister_heap(base)
        assert nv._PENDING == []
        want = [0] * 8 if dead else list(range(1, 9))
        assert mem[1, 16:24].tolist() == want and int(mem[1, 32]) == (0 if dead else 7)
    finally:
        nv.set_dead_pes([])
        nv.set_emulation_order("eager")


def test_a_heap_freed_without_destroy_settles_its_pending_puts():
    """An emulated heap whose buffer is garbage-collected without a destroy (a rank function that returns) is
    unregistered before its memory goes: its pending puts are delivered while the memory is still there, and a heap
    registered later at another address is not touched (test_processes_silent_rank_is_named's forked ranks died
    with a segfault in the NIC thread, which copied a pending put into a freed mapping)."""
    import gc

    nv.set_emulation_order("manual")
    other = torch.zeros(64, dtype=torch.uint8)
    kept = nv.register_heap(other.data_ptr(), 64, [other.data_ptr()])
    try:
        a, b = _virtual_pair(5.0)
        base = a.symm._nvshmem_heap_base
        nv._issue(base + 16, base, 8, 1)  # a pending put from rank 0's heap to rank 1's
        assert len(nv._PENDING) == 1
        del a, b
        gc.collect()
        assert nv._PENDING == []
        assert not any(h[0] == base for h in nv._HEAPS) and any(h is kept for h in nv._HEAPS)
    finally:
        nv.unregister_heap(other.data_ptr(), kept)
        nv.set_emulation_order("eager")
