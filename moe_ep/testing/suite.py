"""The semantic test suite every Buffer backend must pass, shipped so backends and users can run it."""

from __future__ import annotations

import contextlib

import torch

from .checks import assert_bitwise_equal, assert_close_ulp
from .inputs import make_all_inputs
from .refs import ref_combine, ref_dispatch, ref_low_latency_combine, ref_low_latency_dispatch

__all__ = ["check_buffer_case"]


def _check_combined(actual, expected, ulps: int, name: str) -> None:
    if ulps == 0:
        assert_bitwise_equal(actual, expected, name)
    else:
        assert_close_ulp(actual, expected, ulps, name, dtype=torch.bfloat16)


def check_buffer_case(rank: int, world: int, case: dict, backend: str = "torch", *,
                      modes: tuple = ("normal", "low_latency"), combine_ulps: int = 0, inference_mode: bool = True,
                      **buffer_kwargs) -> bool:
    """Normal dispatch (BF16 and FP8), combine, cached dispatch, num_worst_tokens, and low-latency
    dispatch/combine for one case on ``moe_ep.Buffer(backend=backend)``; every output is checked
    against :mod:`moe_ep.testing.refs` (bitwise). Run it on every rank, e.g. through
    :func:`moe_ep.testing.launch`. ``modes`` selects the normal and/or low-latency checks.
    ``combine_ulps``: BF16 ulps the normal combine may differ by (0: bitwise; backends that regroup the
    float32 sum, like the node-aware one, state theirs).
    ``inference_mode``: the Buffer is made outside it, the calls (and their inputs, inference tensors then)
    run inside ``torch.inference_mode()``, as serving engines run every forward (default); ``False``: plain
    autograd mode (tests/test_inference_mode.py checks both give the same bits).

    ``case`` keys: seed, n (int or per-rank list), hidden, E, k, routing (see
    :func:`moe_ep.testing.inputs.make_rank_inputs`), and optional align, worst (num_worst_tokens), T.
    """
    import moe_ep

    buf = moe_ep.Buffer(None, low_latency_mode=True, backend=backend, timeout_s=30, **buffer_kwargs)
    with torch.inference_mode() if inference_mode else contextlib.nullcontext():
        return _check_case(buf, rank, world, case, modes, combine_ulps)


def _check_case(buf, rank: int, world: int, case: dict, modes: tuple, combine_ulps: int) -> bool:
    seed, n, hidden, num_experts, k, routing = (case[key] for key in ("seed", "n", "hidden", "E", "k", "routing"))
    inputs = make_all_inputs(world, n, hidden, num_experts, k, seed, routing)
    dev = torch.device(case.get("device", "cpu"))
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    me = inputs[rank]
    me = type(me)(*(None if t is None else t.to(dev) for t in (me.x, me.topk_idx, me.topk_weights, me.x_fp8, me.x_scales)))
    async_finish = dev.type == "cuda"  # exercise the comm-stream path where it means something
    xs = [i.x for i in inputs]
    idxs = [i.topk_idx for i in inputs]
    ws = [i.topk_weights for i in inputs]
    num_local = num_experts // world
    if "normal" in modes:
        # layout
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(me.topk_idx, num_experts)
        exp_in_rank = torch.zeros(me.topk_idx.shape[0], world, dtype=torch.bool)
        for t, row in enumerate(inputs[rank].topk_idx.tolist()):
            for e in row:
                if e >= 0:
                    exp_in_rank[t, e // num_local] = True
        if per_rdma is not None:  # node-aware backends: tokens per destination node
            nodes = per_rdma.shape[0]
            per_node = exp_in_rank.view(-1, nodes, world // nodes).any(2).sum(0).int()
            assert_bitwise_equal(per_rdma, per_node, "num_tokens_per_rdma_rank")
        assert_bitwise_equal(in_rank, exp_in_rank, "is_token_in_rank")
        assert_bitwise_equal(per_rank, exp_in_rank.sum(0).int(), "num_tokens_per_rank")
        valid = inputs[rank].topk_idx[inputs[rank].topk_idx >= 0]
        assert_bitwise_equal(per_expert, torch.bincount(valid, minlength=num_experts).int(), "num_tokens_per_expert")

        # normal dispatch, BF16, expert_alignment
        align = case.get("align", 1)
        recv_x, r_idx, r_w, per_list, handle, ev = buf.dispatch(
            me.x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=me.topk_idx, topk_weights=me.topk_weights, expert_alignment=align, async_finish=async_finish)
        ev.current_stream_wait()
        ex_x, _, ex_idx, ex_w, ex_list = ref_dispatch(rank, xs, idxs, ws, num_experts, expert_alignment=align)
        assert_bitwise_equal(recv_x, ex_x, "recv_x")
        assert_bitwise_equal(r_idx, ex_idx, "recv_topk_idx")
        assert_bitwise_equal(r_w, ex_w, "recv_topk_weights")
        assert per_list == ex_list

        # combine: every rank scales its received rows by (rank + 1)
        def y_of(r, rx):
            return (rx.float() * (r + 1)).to(torch.bfloat16)

        all_recv = [ref_dispatch(r, xs, idxs, ws, num_experts) for r in range(world)]
        ys = [y_of(r, all_recv[r][0]) for r in range(world)]
        bias = (torch.randn(me.x.shape, generator=torch.Generator().manual_seed(seed + 77 + rank)).to(torch.bfloat16),)
        comb, comb_w, _ = buf.combine(y_of(rank, recv_x), handle, topk_weights=r_w, bias=(bias[0].to(dev),))
        ex_comb, ex_cw = ref_combine(rank, ys, idxs, num_experts, [a[3] for a in all_recv], bias)
        _check_combined(comb, ex_comb, combine_ulps, "combined_x")
        assert_bitwise_equal(comb_w, ex_cw, "combined_topk_weights")
        # the reduced weights equal the originals, with 0 at the holes
        orig = inputs[rank]
        assert_bitwise_equal(comb_w, torch.where(orig.topk_idx >= 0, orig.topk_weights, 0.0), "combined weights = original")

        # cached dispatch with FP8 payload
        if hidden % 128 == 0:
            (cx, cs), c_idx, c_w, c_list, _, _ = buf.dispatch((me.x_fp8, me.x_scales), handle=handle)
            assert c_idx is None and c_w is None and c_list == per_list
            ex_q, ex_s, *_ = ref_dispatch(rank, [i.x_fp8 for i in inputs], idxs, ws, num_experts,
                                          x_scales=[i.x_scales for i in inputs])
            assert_bitwise_equal(cx, ex_q, "cached recv_x fp8")
            assert_bitwise_equal(cs, ex_s, "cached recv scales")

        # num_worst_tokens: static shapes, -1 padding
        worst = case.get("worst", 0)
        if worst:
            wx, w_idx, w_w, _, w_handle, _ = buf.dispatch(
                me.x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=me.topk_idx, topk_weights=me.topk_weights, num_worst_tokens=worst)
            m = ex_x.shape[0]
            assert wx.shape[0] == worst and w_idx.shape[0] == worst
            assert_bitwise_equal(wx[:m], ex_x, "worst recv_x")
            assert bool((w_idx[m:] == -1).all()) and bool((w_w[m:] == 0).all())
            wy = torch.zeros(worst, hidden, dtype=torch.bfloat16, device=dev)
            wy[:m] = y_of(rank, ex_x).to(dev)
            wc, _, _ = buf.combine(wy, w_handle)
            _check_combined(wc, ref_combine(rank, ys, idxs, num_experts)[0], combine_ulps, "worst combine")

    # low-latency dispatch / combine
    T = case.get("T", max(n if isinstance(n, int) else max(n), 1))
    if "low_latency" in modes and hidden % 128 == 0:
        for use_fp8, round_scale, use_ue8m0, hook in ((True, False, False, False), (True, True, False, True),
                                                      (True, True, True, False), (False, False, False, True)):
            stats = torch.zeros(num_local, dtype=torch.int32, device=dev)
            rx, count, ll_handle, _, rhook = buf.low_latency_dispatch(
                me.x, me.topk_idx, T, num_experts, cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8,
                round_scale=round_scale, use_ue8m0=use_ue8m0, return_recv_hook=hook)
            assert (rhook is not None) == hook
            if hook:
                rhook()
            ex_rx, ex_rs, ex_count, _ = ref_low_latency_dispatch(rank, xs, idxs, T, num_experts, use_fp8,
                                                                 round_scale, use_ue8m0)
            assert_bitwise_equal(count, ex_count, "recv_count")
            assert_bitwise_equal(stats, ex_count, "cumulative stats")
            data = rx[0] if use_fp8 else rx
            assert data.shape == (num_local, world * T, hidden)
            for e in range(num_local):
                c = int(ex_count[e])
                assert_bitwise_equal(data[e, :c], ex_rx[e, :c], f"ll recv_x expert {e}")
                if use_fp8:
                    sc = rx[1]
                    assert sc.stride(1) == 1, "scales must be column-major"
                    assert sc.stride(2) % 4 == 0, "scale column stride must be TMA aligned"
                    assert_bitwise_equal(sc[e, :c], ex_rs[e, :c], f"ll scales expert {e}")
        # combine: rank r's expert outputs are its BF16-received rows scaled by (r + 1)
        ys_ll = []
        for r in range(world):
            rrx, _, rc, _ = ref_low_latency_dispatch(r, xs, idxs, T, num_experts, use_fp8=False)
            ys_ll.append((rrx.float() * (r + 1)).to(torch.bfloat16))
        rx, count, ll_handle, _, _ = buf.low_latency_dispatch(me.x, me.topk_idx, T, num_experts, use_fp8=False)
        y = torch.full_like(rx, float("nan"))  # rows past recv_count must not matter
        for e in range(num_local):
            c = int(count[e])
            y[e, :c] = ys_ll[rank][e, :c].to(dev)
        expected = ref_low_latency_combine(rank, ys_ll, idxs, ws, T, num_experts)
        out, _, chook = buf.low_latency_combine(y, me.topk_idx, me.topk_weights, ll_handle, return_recv_hook=True)
        chook()
        assert_bitwise_equal(out, expected, "ll combined_x")
        zc = buf.get_next_low_latency_combine_buffer(ll_handle)
        zc.copy_(y)
        out2 = torch.empty_like(out)
        res, _, _ = buf.low_latency_combine(zc, me.topk_idx, me.topk_weights, ll_handle, zero_copy=True, out=out2)
        assert res is out2
        assert_bitwise_equal(out2, expected, "ll combined_x (zero copy, out=)")
    return True
