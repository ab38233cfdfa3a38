"""moe_ep.Buffer(backend="symm"): the backend semantic suite on forked CPU ranks (shm provider,
interpreter) and in virtual-rank mode (one process, phases launched rank by rank), against the
single-process references, bitwise."""

from __future__ import annotations

import os
import zlib

import pytest
import torch

from moe_ep.backends.symm import SymmBackend, virtual_backends
from moe_ep.backends.torch_a2a import layout_from_topk
from moe_ep.testing import assert_bitwise_equal, launch
from moe_ep.testing.inputs import make_all_inputs
from moe_ep.testing.refs import ref_combine, ref_dispatch, ref_low_latency_combine, ref_low_latency_dispatch
from moe_ep.testing.suite import check_buffer_case

# Kernels on CPU tensors need the Triton interpreter (tests/conftest.py sets it where no GPU exists); on a
# GPU machine run this file with `TRITON_INTERPRET=1`.
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU ranks run the symm kernels in the Triton interpreter")

CASES = [
    # world, tokens per rank, hidden, experts, topk, routing, extras
    (2, 0, 128, 4, 2, "random", {"T": 4}),
    (2, 7, 256, 8, 4, "random", {"align": 4, "worst": 24}),
    (4, [3, 9, 1, 0], 128, 8, 4, "skip_last_rank", {"T": 12}),
    (4, 5, 128, 16, 8, "one_expert", {"worst": 40}),
    # 8 ranks: 60-80 s per test on 2 cores, run with -m extended
    pytest.param(8, [1, 2, 3, 0, 5, 6, 7, 2], 128, 16, 8, "random", {"T": 8}, marks=pytest.mark.extended),
]
_IDS = [f"R{c[0]}-N{c[1]}-H{c[2]}-E{c[3]}-K{c[4]}-{c[5]}" for c in (getattr(c, "values", c) for c in CASES)]
# the low-latency-only Buffer at 4 and 8 ranks: -m slow (the 2-rank cases run by default, and test_suite_processes
# runs low latency at 4 ranks)
LL_ONLY_CASES = [c if getattr(c, "values", c)[0] < 4 else pytest.param(*getattr(c, "values", c), marks=pytest.mark.slow)
                 for c in CASES]



def _sizes(world, n, hidden, E, k, extra, normal=True):
    n_max = max(n) if isinstance(n, list) else n
    T = extra.get("T", max(n_max, 1))
    return dict(num_nvl_bytes=SymmBackend.get_normal_size_hint(max(n_max, 1), hidden, k, world) if normal else 0,
                num_rdma_bytes=SymmBackend.get_low_latency_size_hint(T, hidden, world, E, k))


def _case(world, n, hidden, E, k, routing, extra):
    return dict(seed=zlib.crc32(repr((world, n, hidden, E, k, routing)).encode()) % 10007, n=n, hidden=hidden, E=E,
                k=k, routing=routing, **extra)


@pytest.mark.parametrize("world,n,hidden,E,k,routing,extra", CASES,
                         ids=_IDS)
def test_suite_processes(world, n, hidden, E, k, routing, extra):
    case = _case(world, n, hidden, E, k, routing, extra)
    kwargs = _sizes(world, n, hidden, E, k, extra)
    assert launch(check_buffer_case, world, case, "symm", timeout_s=300, **kwargs) == [True] * world


@pytest.mark.parametrize("world,n,hidden,E,k,routing,extra", LL_ONLY_CASES, ids=_IDS)
def test_suite_processes_low_latency_only(world, n, hidden, E, k, routing, extra):
    """A low-latency-only Buffer (num_nvl_bytes=0), as decode engines create it."""
    case = _case(world, n, hidden, E, k, routing, extra)
    kwargs = _sizes(world, n, hidden, E, k, extra, normal=False)
    assert launch(check_buffer_case, world, case, "symm", modes=("low_latency",), timeout_s=300,
                  **kwargs) == [True] * world


def _virtual_step(backends, inputs, E, T, use_fp8, round_scale, use_ue8m0, align, worst):
    """One normal dispatch/combine and one low-latency dispatch/combine over every virtual rank,
    phase by phase, checked against the references."""
    R = len(backends)
    L = E // R
    xs, idxs, ws = [i.x for i in inputs], [i.topk_idx for i in inputs], [i.topk_weights for i in inputs]
    # normal mode
    layouts = [b.get_dispatch_layout(i.topk_idx, E) for b, i in zip(backends, inputs)]
    for (per_rank, _, per_expert, in_rank), i in zip(layouts, inputs):
        ex = layout_from_topk(i.topk_idx, E, R)
        assert_bitwise_equal(per_rank, ex[0], "num_tokens_per_rank")
        assert_bitwise_equal(per_expert, ex[1], "num_tokens_per_expert")
        assert_bitwise_equal(in_rank, ex[2], "is_token_in_rank")
    states = [b.dispatch_send(i.x, None, handle=None, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3],
                              num_tokens_per_expert=lay[2], topk_idx=i.topk_idx, topk_weights=i.topk_weights,
                              num_experts=E) for b, i, lay in zip(backends, inputs, layouts)]
    res = [b.dispatch_recv(s, expert_alignment=align, num_worst_tokens=worst) for b, s in zip(backends, states)]
    ys = []
    for r, out in enumerate(res):
        ex_x, _, ex_idx, ex_w, ex_list = ref_dispatch(r, xs, idxs, ws, E, expert_alignment=align)
        m = ex_x.shape[0]
        assert out.recv_x.shape[0] == (worst or m)
        assert_bitwise_equal(out.recv_x[:m], ex_x, f"rank {r} recv_x")
        assert_bitwise_equal(out.recv_topk_idx[:m], ex_idx, f"rank {r} recv_topk_idx")
        assert_bitwise_equal(out.recv_topk_weights[:m], ex_w, f"rank {r} recv_topk_weights")
        if not worst:
            assert out.num_recv_tokens_per_expert_list == ex_list
        else:
            assert bool((out.recv_topk_idx[m:] == -1).all())
        ys.append((out.recv_x.float() * (r + 1)).to(torch.bfloat16))
    cstates = [b.combine_send(y, o.handle, o.recv_topk_weights) for b, y, o in zip(backends, ys, res)]
    combined = [b.combine_recv(s, ()) for b, s in zip(backends, cstates)]
    ms = [ref_dispatch(r, xs, idxs, ws, E)[0].shape[0] for r in range(R)]
    recv_ws = [o.recv_topk_weights[:m] for o, m in zip(res, ms)]
    for r, (cx, cw) in enumerate(combined):
        ex_c, ex_cw = ref_combine(r, [y[:m] for y, m in zip(ys, ms)], idxs, E, recv_ws)
        assert_bitwise_equal(cx, ex_c, f"rank {r} combined_x")
        assert_bitwise_equal(cw, ex_cw, f"rank {r} combined_topk_weights")
    # low-latency mode
    lstates = [b.low_latency_dispatch_send(i.x, i.topk_idx, T, E, use_fp8=use_fp8, round_scale=round_scale,
                                           use_ue8m0=use_ue8m0) for b, i in zip(backends, inputs)]
    lres = [b.low_latency_dispatch_recv(s) for b, s in zip(backends, lstates)]
    y_ll = []
    for r, out in enumerate(lres):
        ex_rx, ex_rs, ex_count, _ = ref_low_latency_dispatch(r, xs, idxs, T, E, use_fp8, round_scale, use_ue8m0)
        assert_bitwise_equal(out.recv_count, ex_count, f"rank {r} recv_count")
        for e in range(L):
            c = int(ex_count[e])
            assert_bitwise_equal(out.recv_x[e, :c], ex_rx[e, :c], f"rank {r} ll recv_x expert {e}")
            if use_fp8:
                assert out.recv_x_scales.stride(1) == 1 and out.recv_x_scales.stride(2) % 4 == 0
                assert_bitwise_equal(out.recv_x_scales[e, :c], ex_rs[e, :c], f"rank {r} ll scales expert {e}")
        ref_bf16 = ref_low_latency_dispatch(r, xs, idxs, T, E, use_fp8=False)[0]
        y_ll.append((ref_bf16.float() * (r + 1)).to(torch.bfloat16))
    cl = [b.low_latency_combine_send(y, i.topk_idx, i.topk_weights, o.handle)
          for b, y, i, o in zip(backends, y_ll, inputs, lres)]
    outs = [b.low_latency_combine_recv(s) for b, s in zip(backends, cl)]
    for r, out in enumerate(outs):
        assert_bitwise_equal(out, ref_low_latency_combine(r, y_ll, idxs, ws, T, E), f"rank {r} ll combined_x")


@pytest.mark.parametrize("world", [2, 4])
def test_virtual_ranks_repeated_steps(world):
    E, k, hidden = 4 * world, 4, 256
    n = [5, 0, 7, 1][:world]
    T = 8
    backends = virtual_backends(world, num_nvl_bytes=SymmBackend.get_normal_size_hint(8, hidden, k, world),
                                num_rdma_bytes=SymmBackend.get_low_latency_size_hint(T, hidden, world, E, k),
                                low_latency_mode=True, timeout_s=20)
    variants = [(True, False, False, 1, 0), (True, True, True, 4, 32), (False, False, False, 1, 0)]
    for step, (use_fp8, rs, ue, align, worst) in enumerate(variants):
        inputs = make_all_inputs(world, n, hidden, E, k, 100 + step)
        _virtual_step(backends, inputs, E, T, use_fp8, rs, ue, align, worst)
