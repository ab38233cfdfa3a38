import os
import time

import pytest
import torch
import torch.distributed as dist

from moe_ep.testing import RankFailure, launch


def _sum_ranks(rank, world_size):
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return float(t.item())


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_launch_collective(world_size):
    results = launch(_sum_ranks, world_size, timeout_s=60)
    expected = world_size * (world_size + 1) / 2
    assert results == [expected] * world_size


def _raise_on_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom from rank one")
    return rank


def test_launch_reports_exception():
    with pytest.raises(RankFailure) as info:
        launch(_raise_on_one, 2, timeout_s=30)
    assert info.value.failed_ranks == [1]
    assert "boom from rank one" in str(info.value)


def _die(rank, world_size):
    if rank == 0:
        os._exit(3)
    return rank


def test_launch_reports_dead_rank():
    with pytest.raises(RankFailure) as info:
        launch(_die, 2, timeout_s=30)
    assert 0 in info.value.failed_ranks
    assert "exit code 3" in str(info.value)


def _hang(rank, world_size):
    if rank == 1:
        time.sleep(60)
    return rank


def test_launch_times_out_on_stuck_rank():
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        launch(_hang, 2, timeout_s=3)
    assert time.monotonic() - t0 < 20
    assert info.value.failed_ranks == [1]
    assert "did not finish" in str(info.value)
