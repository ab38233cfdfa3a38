"""Code written for DeepEP V1 runs unchanged: positional arguments in DeepEP's order, the wait-cost statistics,
layout-only and cached dispatch, the handle fields DeepEP's tests index, and the small helpers (capture,
get_comm_stream, is_sm90_compiled, destroy, the mask API names)."""

from __future__ import annotations

import time

import pytest
import torch

from moe_ep.testing import launch
from moe_ep.testing.inputs import make_all_inputs

T, H, E, K = 8, 128, 8, 2


def _buffer(backend, world, ll=True, n=T):
    """A Buffer built with DeepEP's positional arguments: (group, num_nvl_bytes, num_rdma_bytes,
    low_latency_mode, num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl, use_fabric,
    explicitly_destroy, enable_shrink)."""
    import moe_ep
    from moe_ep.backends.symm import SymmBackend

    nvl = rdma = 0
    kw = {}
    if backend == "symm":
        nvl = SymmBackend.get_normal_size_hint(n, H, K, world)
        rdma = moe_ep.Buffer.get_low_latency_rdma_size_hint(T, H, world, E)
        kw = dict(provider="shm")
    if backend == "nvshmem":  # low-latency only
        rdma = moe_ep.Buffer.get_low_latency_rdma_size_hint(T, H, world, E)
    return moe_ep.Buffer(None, nvl, rdma, ll, 24, True, False, False, True, False, backend=backend, timeout_s=30,
                         **kw)


# --------------------------------------------------------------------------------------- positional calls
def _positional(rank, world, backend):
    buf = _buffer(backend, world)
    assert buf.low_latency_mode and buf.explicitly_destroy and not buf.enable_shrink
    inputs = make_all_inputs(world, T, H, E, K, seed=4)
    me = inputs[rank]
    wait_d = torch.zeros(world, dtype=torch.int64)
    wait_c = torch.zeros(world, dtype=torch.int64)
    if rank == 1:
        time.sleep(1.5)  # rank 0's receive waits for this rank (long enough to stand out on a loaded machine)
    # (x, topk_idx, T, E, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8, ...)
    stats = torch.zeros(E // world, dtype=torch.int32)
    recv_x, count, handle, _, _ = buf.low_latency_dispatch(me.x, me.topk_idx, T, E, stats, wait_d, False)
    assert isinstance(recv_x, torch.Tensor) and recv_x.dtype == torch.bfloat16, "use_fp8=False went elsewhere"
    assert torch.equal(stats, count)
    y = recv_x.clone()
    # (x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish, return_recv_hook, out,
    #  combine_wait_recv_cost_stats)
    if rank == 1:
        time.sleep(1.5)
    out, _, hook = buf.low_latency_combine(y, me.topk_idx, me.topk_weights, handle, False, False, False, False, None,
                                           wait_c)
    assert hook is None and out.shape == (T, H)
    # DeepEP's low-latency handle fields
    src_info, layout_range = handle[0], handle[1]
    assert (handle[2], handle[3], handle[4]) == (T, H, E)
    mask = (1 << 32) - 1
    for le in range(E // world):
        c = int(count[le])
        assert int((layout_range[le] & mask).sum()) == c
        rows = recv_x[le, :c].float()
        assert torch.equal(rows[:, 1].long(), src_info[le, :c].long())  # column 1 holds the token index
        for s in range(world):
            begin, cnt = int(layout_range[le, s] >> 32), int(layout_range[le, s] & mask)
            assert torch.all(rows[begin:begin + cnt, 0] == s)  # column 0 holds the source rank
    buf.destroy()
    return wait_d.tolist(), wait_c.tolist()


@pytest.mark.parametrize("backend", ["torch", "symm", "nvshmem"])
def test_positional_low_latency_calls_and_wait_stats(backend):
    res = launch(_positional, 2, backend, timeout_s=120)
    (wd0, wc0), (wd1, wc1) = res
    assert all(v >= 0 for v in wd0 + wc0 + wd1 + wc1)
    # rank 0 waited for the late rank 1 in both receives; the stats name it
    assert wd0[1] > 0.5e9 and wc0[1] > 0.5e9, (wd0, wc0)
    assert wd0[1] > wd0[0] and wc0[1] > wc0[0]


# --------------------------------------------------------------------------------------- layout-only dispatch
def _layout_only(rank, world, backend):
    from moe_ep.testing.refs import ref_dispatch

    buf = _buffer(backend, world, ll=False)
    inputs = make_all_inputs(world, [5, 7, 1, 6][:world], H, E, K, seed=2)
    me = inputs[rank]
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(me.topk_idx, E)
    recv_x, r_idx, r_w, counts, handle, _ = buf.dispatch(me.x, None, per_rank, None, in_rank, per_expert)
    assert r_idx is None and r_w is None
    ex_x, _, _, _, ex_list = ref_dispatch(rank, [i.x for i in inputs], [i.topk_idx for i in inputs],
                                          [i.topk_weights for i in inputs], E)
    assert torch.equal(recv_x, ex_x)
    # as DeepEP (its tests/test_intranode.py checks it): the per-expert counts, from num_tokens_per_expert
    assert counts == ex_list and len(counts) == E // world, (counts, ex_list)
    # cached dispatch on the handle of a layout-only dispatch, then combine
    again = buf.dispatch(me.x * 2, handle)[0]
    assert torch.equal(again, ex_x * 2)
    combined, w, _ = buf.combine(recv_x, handle)
    assert w is None
    # every token comes back summed over the ranks that received it
    expected = (me.x.float() * in_rank.sum(1, keepdim=True)).to(torch.bfloat16)
    assert torch.equal(combined, expected)
    # handle fields: is_token_in_rank, and rank_prefix_matrix's column for this rank
    assert handle[4] is in_rank or torch.equal(handle[4], in_rank)
    rpm = handle[0]
    recv_from = torch.tensor([int(inputs[s].topk_idx.ge(0).logical_and(
        inputs[s].topk_idx // (E // world) == rank).any(1).sum()) for s in range(world)])
    assert torch.equal(rpm[:, rank].long(), recv_from.cumsum(0))
    if backend == "torch":
        sent = torch.stack([torch.tensor([int(((inputs[s].topk_idx >= 0) & (inputs[s].topk_idx // (E // world) == d))
                                               .any(1).sum()) for d in range(world)]) for s in range(world)])
        assert torch.equal(rpm.long(), sent.cumsum(0))
        assert torch.equal(handle[3].long(), ex_x[:, 1].float().long())  # recv_src_idx: the source token
    # with num_worst_tokens there is no host read, so no list (as DeepEP)
    worst = buf.dispatch(me.x, None, per_rank, None, in_rank, per_expert, num_worst_tokens=32)
    assert worst[3] == [] and worst[0].shape[0] == 32
    return True


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("backend", ["torch", "symm"])
def test_layout_only_dispatch_then_cached_dispatch_and_combine(backend, world):
    assert launch(_layout_only, world, backend, timeout_s=180) == [True] * world


# --------------------------------------------------------------------------------------- helpers
def _helpers(rank, world):
    import moe_ep

    assert moe_ep.topk_idx_t is torch.int64
    assert moe_ep.Buffer.is_sm90_compiled() is False  # no CUDA here
    ev = moe_ep.Buffer.capture()
    assert isinstance(ev, moe_ep.EventOverlap) and ev.event is None
    ev.current_stream_wait()
    buf = moe_ep.Buffer(None, backend="torch", timeout_s=30)
    assert buf.get_comm_stream() is None
    msgs = []
    for fn in (lambda: buf.destroy(), lambda: buf.low_latency_update_mask_buffer(1, True),
               lambda: buf.low_latency_query_mask_buffer(torch.zeros(world, dtype=torch.int32)),
               lambda: buf.low_latency_clean_mask_buffer(),
               lambda: moe_ep.Buffer(None, 0, 0, False, 24, True, False, False, False, True),  # shrink: LL only
               lambda: moe_ep.Buffer(None, comm=object())):
        with pytest.raises(ValueError) as info:
            fn()
        msgs.append(str(info.value))
    explicit = moe_ep.Buffer(None, explicitly_destroy=True, backend="torch", timeout_s=30)
    explicit.destroy()
    inputs = make_all_inputs(world, 3, H, E, K, seed=1)
    with pytest.raises(RuntimeError, match="destroyed"):
        explicit.low_latency_dispatch(inputs[rank].x, inputs[rank].topk_idx, T, E)
    # num_worst_tokens: the per-expert list is empty on the torch backend too (as DeepEP and symm)
    me = inputs[rank]
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(me.topk_idx, E)
    res = buf.dispatch(me.x, None, per_rank, None, in_rank, per_expert, me.topk_idx, me.topk_weights, 1, 16)
    assert res[3] == [] and res[0].shape == (16, H)
    return msgs


def test_deepep_helpers_and_refusals():
    msgs = launch(_helpers, 2, timeout_s=60)[0]
    assert "explicitly_destroy=True" in msgs[0]
    assert all("enable_shrink" in m for m in msgs[1:5]), msgs
    assert "mpi4py" in msgs[5]


def test_buffer_names_survive_the_module_split():
    """``moe_ep.Buffer`` is assembled from modules (``buffer``, ``low_latency``, ``config``, ``checks`` of moe_ep/deepep/v1):
    every closure a method hands to the stream machinery is reported as ``Buffer.<method>`` (the stream checker
    names a call after the object it was made on, not the base class defining it), and the names ``moe_ep.deepep.v1.buffer``
    held before the split still import from there."""
    import types

    import moe_ep
    from moe_ep import events
    from moe_ep.deepep.v1.buffer import BACKENDS, Buffer, Config, _CheckedLayout, _capturing, _reports_refusal

    assert (moe_ep.Buffer, moe_ep.Config) == (Buffer, Config) and BACKENDS[0] == "auto"
    assert callable(_capturing) and callable(_reports_refusal) and isinstance(_CheckedLayout, type)
    methods = {n: getattr(Buffer, n) for n in dir(Buffer)
               if not n.startswith("__") and isinstance(getattr(Buffer, n), types.FunctionType)}
    assert {"dispatch", "low_latency_dispatch", "low_latency_combine", "_wrap_hook",
            "low_latency_update_mask_buffer", "get_low_latency_rdma_size_hint"} <= set(methods)
    owner = object.__new__(Buffer)
    closures = {}
    for name, f in methods.items():
        code = getattr(f, "__wrapped__", f).__code__  # the method itself, not _reports_refusal's wrapper
        for c in code.co_consts:
            if isinstance(c, types.CodeType):
                fn = types.FunctionType(c, {}, closure=tuple(types.CellType() for _ in c.co_freevars))
                closures[c.co_qualname] = (name, events._call_name(fn, owner))
    assert {"Buffer.dispatch", "Buffer.low_latency_dispatch", "Buffer.low_latency_combine",
            "Buffer._wrap_hook"} <= {got for _, got in closures.values()}
    assert all(got == f"Buffer.{name}" for name, got in closures.values()), closures
