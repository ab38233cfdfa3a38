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
from moe_ep.testing.checks import assert_bitwise_equal, assert_close_ulp
from moe_ep.testing.inputs import make_all_inputs
from moe_ep.testing.refs import ref_combine, ref_dispatch


def hier_buffer(ranks_per_node: int, timeout_s: float = 30, **kwargs) -> moe_ep.Buffer:
    """A torch Buffer driving TorchHierBackend (collective: call on every rank)."""
    buf = moe_ep.Buffer(None, low_latency_mode=True, backend="torch", timeout_s=timeout_s)
    buf._impl = TorchHierBackend(buf.group, buf.rank, buf.group_size, num_nvl_bytes=0, num_rdma_bytes=0,
                                 low_latency_mode=True, timeout_s=timeout_s, ranks_per_node=ranks_per_node, **kwargs)
    return buf


def check_hier_case(rank, world, case, G):
    seed, n, hidden, E, k, routing = (case[key] for key in ("seed", "n", "hidden", "E", "k", "routing"))
    inputs = make_all_inputs(world, n, hidden, E, k, seed, routing)
    me = inputs[rank]
    xs, idxs, ws = [i.x for i in inputs], [i.topk_idx for i in inputs], [i.topk_weights for i in inputs]
    buf = hier_buffer(G)
    num_local = E // world
    # layout, with tokens per node
    per_rank, per_node, per_expert, in_rank, _ = buf.get_dispatch_layout(me.topk_idx, E)
    exp_in_rank = torch.zeros(me.topk_idx.shape[0], world, dtype=torch.bool)
    for t, row in enumerate(me.topk_idx.tolist()):
        for e in row:
            if e >= 0:
                exp_in_rank[t, e // num_local] = True
    assert_bitwise_equal(in_rank, exp_in_rank, "is_token_in_rank")
    assert_bitwise_equal(per_rank, exp_in_rank.sum(0).int(), "num_tokens_per_rank")
    assert_bitwise_equal(per_node, exp_in_rank.reshape(-1, world // G, G).any(2).sum(0).int(), "per node")
    valid = me.topk_idx[me.topk_idx >= 0]
    assert_bitwise_equal(per_expert, torch.bincount(valid, minlength=E).int(), "num_tokens_per_expert")
    # dispatch, BF16, alignment: bitwise the flat path's
    align = case.get("align", 1)
    recv_x, r_idx, r_w, per_list, handle, _ = buf.dispatch(
        me.x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=me.topk_idx, topk_weights=me.topk_weights, expert_alignment=align)
    ex_x, _, ex_idx, ex_w, ex_list = ref_dispatch(rank, xs, idxs, ws, E, expert_alignment=align)
    assert_bitwise_equal(recv_x, ex_x, "recv_x")
    assert_bitwise_equal(r_idx, ex_idx, "recv_topk_idx")
    assert_bitwise_equal(r_w, ex_w, "recv_topk_weights")
    assert per_list == ex_list

    # combine: rank r scales its received rows by (r + 1)
    def y_of(r, rx):
        return (rx.float() * (r + 1)).to(torch.bfloat16)

    all_recv = [ref_dispatch(r, xs, idxs, ws, E) for r in range(world)]
    ys = [y_of(r, all_recv[r][0]) for r in range(world)]
    bias = torch.randn(me.x.shape, generator=torch.Generator().manual_seed(seed + 77 + rank)).to(torch.bfloat16)
    comb, comb_w, _ = buf.combine(y_of(rank, recv_x), handle, topk_weights=r_w, bias=bias)
    ex_comb, ex_cw = ref_combine(rank, ys, idxs, E, [a[3] for a in all_recv], (bias,))
    if G == 1:
        assert_bitwise_equal(comb, ex_comb, "combined_x")
    else:
        assert_close_ulp(comb, ex_comb, 1, "combined_x", dtype=torch.bfloat16)
    num_diff = int((comb.view(torch.int16) != ex_comb.view(torch.int16)).sum())
    assert_bitwise_equal(comb_w, ex_cw, "combined_topk_weights")
    # cached dispatch with an FP8 payload
    if hidden % 128 == 0:
        (cx, cs), c_idx, c_w, c_list, _, _ = buf.dispatch((me.x_fp8, me.x_scales), handle=handle)
        assert c_idx is None and c_w is None and c_list == per_list
        ex_q, ex_s, *_ = ref_dispatch(rank, [i.x_fp8 for i in inputs], idxs, ws, E,
                                      x_scales=[i.x_scales for i in inputs])
        assert_bitwise_equal(cx, ex_q, "cached recv_x fp8")
        assert_bitwise_equal(cs, ex_s, "cached recv scales")
    # num_worst_tokens padding, combine without weights or bias
    worst = case.get("worst", 0)
    if worst:
        wx, w_idx, w_w, _, w_handle, _ = buf.dispatch(
            me.x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=me.topk_idx, topk_weights=me.topk_weights, num_worst_tokens=worst)
        m = ex_x.shape[0]
        assert wx.shape[0] == worst and w_idx.shape[0] == worst
        assert_bitwise_equal(wx[:m], ex_x, "worst recv_x")
        assert bool((w_idx[m:] == -1).all()) and bool((w_w[m:] == 0).all())
        wy = torch.zeros(worst, hidden, dtype=torch.bfloat16)
        wy[:m] = y_of(rank, ex_x)
        wc, _, _ = buf.combine(wy, w_handle)
        ref = ref_combine(rank, ys, idxs, E)[0]
        if G == 1:
            assert_bitwise_equal(wc, ref, "worst combine")
        else:
            assert_close_ulp(wc, ref, 1, "worst combine", dtype=torch.bfloat16)
    return num_diff, comb.numel()


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
    res = launch(check_hier_case, world, case, G, timeout_s=240)
    diff = sum(r[0] for r in res)
    total = sum(r[1] for r in res)
    if G == 1:
        assert diff == 0
    assert diff <= total // 20, f"{diff} of {total} combined values differ from the flat path (1 ulp each)"


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


def _suite_through_buffer(rank, world):
    from moe_ep.testing.suite import check_buffer_case

    return check_buffer_case(rank, world, dict(seed=7, n=[5, 0, 9, 3], hidden=128, E=8, k=3, routing="random"),
                             "torch", modes=("normal",), ranks_per_node=2)


def test_buffer_selects_the_node_aware_backend_and_passes_the_suite():
    assert launch(_suite_through_buffer, 4, timeout_s=240) == [True] * 4
