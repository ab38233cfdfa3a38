"""Symmetric buffers (moe_ep.symm): address tables, cross-process visibility, timeouts, cleanup."""

from __future__ import annotations

import glob
import os
import signal
import time

import pytest
import torch
import triton
import triton.language as tl

from moe_ep import RankTimeoutError
from moe_ep.kernels.signals import signal_release, wait_ne
from moe_ep.symm import create_symm_buffer, create_virtual_symm_buffers
from moe_ep.testing import RankFailure, launch

# Kernels on CPU tensors need the Triton interpreter (tests/conftest.py sets it where no GPU exists); on a
# GPU machine run this file with `TRITON_INTERPRET=1`.
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU ranks run the symm kernels in the Triton interpreter")


@triton.jit
def _put_kernel(buffer_ptrs, signal_ptrs, rank, n, BLOCK: tl.constexpr):
    """Program r writes ``rank * 1000 + i`` into slot ``rank`` of rank r's data region, then signals."""
    r = tl.program_id(0)
    dst = tl.load(buffer_ptrs + r).to(tl.pointer_type(tl.int32))
    offs = tl.arange(0, BLOCK)
    tl.store(dst + rank * n + offs, rank * 1000 + offs, mask=offs < n)
    sig = tl.load(signal_ptrs + r).to(tl.pointer_type(tl.int32))
    signal_release(sig + rank, 1)


@triton.jit
def _wait_kernel(signal_ptrs, status_ptr, rank, out_ptr, timeout_ns):
    """Program s waits for source s's signal in this rank's region and resets it."""
    s = tl.program_id(0)
    sig = tl.load(signal_ptrs + rank).to(tl.pointer_type(tl.int32))
    v = wait_ne(sig + s, 0, status_ptr, s, timeout_ns)
    tl.store(out_ptr + s, v)
    signal_release(sig + s, 0)


def _put_get(symm, n=16):
    R = symm.world_size
    _put_kernel[(R,)](symm.buffer_ptrs, symm.signal_ptrs, symm.rank, n, BLOCK=16)


def _recv(symm):
    R = symm.world_size
    seen = torch.zeros(R, dtype=torch.int32)
    _wait_kernel[(R,)](symm.signal_ptrs, symm.status, symm.rank, seen, symm.timeout_ns)
    symm.check_status("test receive")
    return seen


def _expected(R, n=16):
    return torch.cat([r * 1000 + torch.arange(n, dtype=torch.int32) for r in range(R)])


def _rank_roundtrip(rank, world_size, steps):
    symm = create_symm_buffer(None, 4096, 16, timeout_s=20)
    assert symm.provider == "shm" and symm.buffer_ptrs.shape == (world_size,)
    assert int(symm.buffer_ptrs[rank]) == symm.buffer.data_ptr()
    for step in range(steps):
        _put_get(symm)
        seen = _recv(symm)
        assert seen.tolist() == [1] * world_size, (step, seen)
        got = symm.buffer.view(torch.int32)[:world_size * 16]
        assert torch.equal(got, _expected(world_size)), got
        symm.buffer.zero_()
        symm.barrier("step")  # nobody writes the next step before every rank checked this one
    assert int(symm.signals.abs().sum()) == 0  # signals are reset for the next step
    return True


@pytest.mark.parametrize("world_size", [2, 4])
def test_shm_roundtrip(world_size):
    assert launch(_rank_roundtrip, world_size, 3, timeout_s=60) == [True] * world_size


def test_virtual_ranks():
    R = 3
    bufs = create_virtual_symm_buffers(R, 4096, 16, timeout_s=5)
    assert all(torch.equal(b.buffer_ptrs, bufs[0].buffer_ptrs) for b in bufs)
    for b in bufs:  # every rank's send phase ...
        _put_get(b)
    for b in bufs:  # ... then every rank's receive phase
        assert _recv(b).tolist() == [1] * R
        assert torch.equal(b.buffer.view(torch.int32)[:R * 16], _expected(R))


def test_virtual_receive_before_send_times_out_naming_rank():
    bufs = create_virtual_symm_buffers(2, 1024, 4, timeout_s=0.2)
    _put_get(bufs[1])  # rank 0 never sends
    with pytest.raises(RankTimeoutError) as info:
        _recv(bufs[1])
    assert info.value.missing_ranks == [0] and "rank(s) [0]" in str(info.value)
    with pytest.raises(RuntimeError, match="unusable"):
        bufs[1].check_status("again")


def _rank_silent_peer(rank, world_size):
    symm = create_symm_buffer(None, 1024, 8, timeout_s=0.5)
    if rank == world_size - 1:
        return "silent"  # never sends
    _put_get(symm)
    try:
        _recv(symm)
    except RankTimeoutError as exc:
        return exc.missing_ranks
    return None


def test_shm_silent_rank_is_named():
    out = launch(_rank_silent_peer, 3, timeout_s=60)
    assert out == [[2], [2], "silent"]


def _rank_killed(rank, world_size, marker):
    symm = create_symm_buffer(None, 1 << 16, 8, timeout_s=1.0)
    with open(f"{marker}.{rank}", "w") as f:
        f.write(str(os.getpid()))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    _put_get(symm)
    _recv(symm)


def test_killed_rank_fails_fast_and_releases_segments(tmp_path):
    before = set(glob.glob("/dev/shm/moe_ep_*"))
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        launch(_rank_killed, 2, str(tmp_path / "pid"), timeout_s=30)
    assert info.value.failed_ranks == [0, 1] and time.monotonic() - t0 < 30
    # the survivor raised (naming the dead rank) rather than being killed by the launcher
    assert "RankTimeoutError" in str(info.value) and "rank(s) [1]" in str(info.value), str(info.value)
    assert set(glob.glob("/dev/shm/moe_ep_*")) <= before  # nothing left behind


def test_bad_arguments():
    with pytest.raises(ValueError, match="provider"):
        create_symm_buffer(None, 16, 1, provider="virtual")
    with pytest.raises(ValueError, match="world_size"):
        create_virtual_symm_buffers(0, 16, 1)


def _spawned_rank(rank, world_size, store_path, queue):
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
        queue.put((rank, _rank_roundtrip(rank, world_size, 2)))
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        queue.put((rank, repr(exc)))


def test_shm_with_spawned_processes(tmp_path):
    """The shm provider does not rely on fork: spawned ranks map each other's segments by name."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_spawned_rank, args=(r, 2, str(tmp_path / "store"), queue), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert results == {0: True, 1: True}, results
