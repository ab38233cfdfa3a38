"""moe_ep.Buffer(backend="nvshmem"): the low-latency semantic suite of the ``symm`` backend, run through the NVSHMEM
transport of the same kernels on forked CPU ranks, where the NVSHMEM device calls are emulated over the shm peer
table (moe_ep.kernels.nvshmem_device), in both emulation orders and with every peer remote or two ranks per node."""

from __future__ import annotations

import os
import zlib

import pytest

from moe_ep.backends.nvshmem import NvshmemBackend
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
    return check_buffer_case(rank, world, case, "nvshmem", modes=("low_latency",), **kwargs)


@pytest.mark.parametrize("world,n,hidden,E,k,routing,extra,order,rpn", CASES,
                         ids=[f"R{c[0]}-N{c[1]}-H{c[2]}-E{c[3]}-K{c[4]}-{c[5]}-{c[7]}-rpn{c[8]}" for c in CASES])
def test_suite_low_latency(world, n, hidden, E, k, routing, extra, order, rpn):
    n_max = max(n) if isinstance(n, list) else n
    T = extra.get("T", max(n_max, 1))
    case = dict(seed=zlib.crc32(repr((world, n, hidden, E, k, routing)).encode()) % 10007, n=n, hidden=hidden, E=E,
                k=k, routing=routing, **extra)
    nbytes = NvshmemBackend.get_low_latency_size_hint(T, hidden, world, E, k)
    assert launch(_run, world, case, order, timeout_s=300, num_rdma_bytes=nbytes, ranks_per_node=rpn) == [True] * world
