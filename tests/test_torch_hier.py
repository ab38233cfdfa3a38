"""Node-aware normal-mode dispatch/combine (TorchHierBackend) against the flat path's references.

The checks are the normal-mode part of moe_ep.testing.suite.check_buffer_case, on a torch Buffer whose
backend is swapped for TorchHierBackend (the Buffer wiring lives elsewhere). Differences from the suite:
``num_tokens_per_rdma_rank`` is filled in, and combine is bitwise only for ranks_per_node == 1 (otherwise
within 1 BF16 ulp: the node partials regroup the float32 sum).
"""

import pytest
import torch

import moe_ep
from moe_ep.backends.torch_hier import TorchHierBackend
from moe_ep.testing import launch
from moe_ep.testing.inputs import make_all_inputs


def hier_buffer(ranks_per_node: int, timeout_s: float = 30, **kwargs) -> moe_ep.Buffer:
    """A torch Buffer driving TorchHierBackend (collective: call on every rank)."""
    buf = moe_ep.Buffer(None, low_latency_mode=True, backend="torch", timeout_s=timeout_s)
    buf._impl = TorchHierBackend(buf.group, buf.rank, buf.group_size, num_nvl_bytes=0, num_rdma_bytes=0,
                                 low_latency_mode=True, timeout_s=timeout_s, ranks_per_node=ranks_per_node, **kwargs)
    return buf


def _hier_case(rank, world, case, G):
    """The shared semantic suite (normal mode) through Buffer(backend="torch", ranks_per_node=G), plus how
    many combined values differ from the flat path's bits."""
    from moe_ep.testing.suite import check_buffer_case

    return check_buffer_case(rank, world, case, "torch", modes=("normal",), combine_ulps=0 if G == 1 else 1,
                             ranks_per_node=G)


CASES = [
    # world, ranks_per_node, tokens per rank, hidden, experts, topk, routing, extras
    (4, 1, 6, 128, 8, 3, "random", {"worst": 40}),
    (4, 2, [5, 0, 7, 3], 128, 16, 4, "random", {"align": 4}),
    (4, 4, 6, 64, 8, 2, "skip_last_rank", {}),
    (8, 2, 4, 128, 16, 4, "random", {"worst": 40}),
    (8, 4, [3, 1, 0, 5, 2, 4, 1, 3], 64, 16, 3, "random", {}),
]


@pytest.mark.parametrize("world,G,n,hidden,E,k,routing,extra", CASES,
                         ids=[f"R{c[0]}-G{c[1]}-H{c[3]}-{c[6]}" for c in CASES])
def test_hier_dispatch_combine(world, G, n, hidden, E, k, routing, extra):
    case = dict(seed=world * 31 + G, n=n, hidden=hidden, E=E, k=k, routing=routing, **extra)
    assert launch(_hier_case, world, case, G, timeout_s=240) == [True] * world


def _bytes_worker(rank, world):
    """Dispatch/combine rows that cross nodes: node-aware <= flat."""
    inputs = make_all_inputs(world, 16, 64, 32, 6, 5, "random")
    me = inputs[rank]
    buf = hier_buffer(2)
    per_rank, per_node, per_expert, in_rank, _ = buf.get_dispatch_layout(me.topk_idx, 32)
    H, G, h = world // 2, 2, rank // 2
    flat_cross = int(per_rank.reshape(H, G).sum(1)[torch.arange(H) != h].sum())
    hier_cross = int(per_node[torch.arange(H) != h].sum())
    return flat_cross, hier_cross


def test_fewer_rows_cross_nodes():
    res = launch(_bytes_worker, 4, timeout_s=60)
    assert all(hc <= fc for fc, hc in res) and sum(hc for _, hc in res) < sum(fc for fc, _ in res)


def test_bad_ranks_per_node():
    def worker(rank, world):
        with pytest.raises(ValueError, match="must divide"):
            TorchHierBackend(None, rank, world, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False,
                             timeout_s=5, ranks_per_node=3)
        return True
    assert launch(worker, 2, timeout_s=60) == [True, True]



def _formats_worker(rank, world, G):
    """The issue-33 combine cases: FP16 ``x`` and ``combine_dtype=torch.float8_e4m3fn`` (``G=None``: flat)."""
    kw = {} if G is None else {"ranks_per_node": G}
    buf = moe_ep.Buffer(None, backend="torch", timeout_s=30, **kw)
    E, N, H, K = 4, 3, 128, 2
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(N, H, generator=g).to(torch.float16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)]).to(torch.int64)
    w = torch.rand(N, K, generator=g)
    per_rank, _, per_exp, in_rank, _ = buf.get_dispatch_layout(idx, E)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank,
                                              is_token_in_rank=in_rank, num_tokens_per_expert=per_exp)
    out16, _, _ = buf.combine(recv_x, handle)
    out8, _, _ = buf.combine(recv_x.to(torch.bfloat16), handle, combine_dtype=torch.float8_e4m3fn)
    return out16, out8


def test_hier_combine_fp16_and_fp8_wire():
    """The node-aware combine decodes rows in ``x``'s dtype (FP16 was read as BF16) and takes the FP8 wire format
    (``fmt=``, a TypeError before); results match the flat path up to float32 reassociation."""
    flat = launch(_formats_worker, 4, None, timeout_s=120)
    hier = launch(_formats_worker, 4, 2, timeout_s=120)
    for (f16, f8), (h16, h8) in zip(flat, hier):
        assert h16.dtype == torch.float16 and h8.dtype == torch.bfloat16
        torch.testing.assert_close(h16.float(), f16.float(), rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(h8.float(), f8.float(), rtol=1.6e-2, atol=1e-2)
