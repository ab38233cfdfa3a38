"""Bad input is refused before any communication; a missing rank is named within the timeout."""

import os
import time

import pytest
import torch

from moe_ep.testing import RankFailure, launch
from moe_ep.testing.inputs import make_rank_inputs


def _bad_inputs(rank, world):
    """Every bad call raises on its own rank (no peer is waited for), then one good call still works."""
    import moe_ep

    buf = moe_ep.Buffer(None, low_latency_mode=False, backend="torch", timeout_s=10)
    ll = moe_ep.Buffer(None, low_latency_mode=True, backend="torch", timeout_s=10)
    inp = make_rank_inputs(rank, 5, 256, 8, 2, seed=3, world_size=world)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(inp.topk_idx, 8)
    good = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=inp.topk_idx, topk_weights=inp.topk_weights)
    msgs = {}

    def expect(exc_type, fn, key):
        with pytest.raises(exc_type) as info:
            fn()
        msgs[key] = str(info.value)

    expect(TypeError, lambda: buf.dispatch(inp.x.float(), **good), "dtype")
    expect(ValueError, lambda: buf.dispatch((inp.x_fp8[:, :200], torch.ones(5, 1)), **good), "fp8 hidden")
    bad_idx = inp.topk_idx.clone()
    bad_idx[0, 0] = 8
    expect(ValueError, lambda: buf.dispatch(inp.x, **{**good, "topk_idx": bad_idx}), "range")
    dup = inp.topk_idx.clone()
    dup[1] = torch.tensor([3, 3])
    expect(ValueError, lambda: buf.get_dispatch_layout(dup, 8), "dup")
    expect(ValueError, lambda: buf.get_dispatch_layout(inp.topk_idx, 7 if world > 1 else 0), "divisible")
    expect(ValueError, lambda: buf.dispatch(inp.x, **{**good, "topk_weights": inp.topk_weights[:, :1]}), "weights")
    expect(ValueError, lambda: buf.low_latency_dispatch(inp.x, inp.topk_idx, 8, 8), "ll mode")
    expect(ValueError, lambda: ll.low_latency_dispatch(inp.x, inp.topk_idx, 4, 8), "capacity")
    expect(ValueError, lambda: ll.low_latency_dispatch(inp.x[:, :200].contiguous(), inp.topk_idx, 8, 8), "ll hidden")
    # one good round trip, then a handle from the wrong Buffer and a wrong-shaped x for its combine
    recv_x, _, _, _, handle, _ = buf.dispatch(inp.x, **good)
    expect(ValueError, lambda: ll.combine(recv_x, handle), "foreign handle")
    expect(ValueError, lambda: buf.combine(recv_x[:, :128].contiguous(), handle), "combine shape")
    expect(ValueError, lambda: buf.dispatch(inp.x[:3], handle=handle), "cached shape")
    out, _, _ = buf.combine(recv_x, handle)  # still in step after all the refused calls
    assert out.shape == inp.x.shape
    # async_finish / previous_event are accepted on CPU and change nothing
    ev0 = moe_ep.EventOverlap()
    recv2, _, _, _, _, ev = buf.dispatch(inp.x, previous_event=ev0, async_finish=True, **good)
    with ev:
        pass
    ev.current_stream_wait()
    assert torch.equal(recv2, recv_x)
    expect(TypeError, lambda: buf.dispatch(inp.x, previous_event="not an event", **good), "event type")
    return msgs


def test_bad_inputs_raise_before_communication():
    msgs = launch(_bad_inputs, 2, timeout_s=60)[0]
    assert "torch.bfloat16" in msgs["dtype"]
    assert "multiple of 128" in msgs["fp8 hidden"] or "scales" in msgs["fp8 hidden"]
    assert "outside [-1, 8)" in msgs["range"]
    assert "same expert twice" in msgs["dup"]
    assert "divisible" in msgs["divisible"]
    assert "low_latency_mode=True" in msgs["ll mode"]
    assert "exceed num_max_dispatch_tokens_per_rank=4" in msgs["capacity"]
    assert "multiple of 128" in msgs["ll hidden"]
    assert "another Buffer" in msgs["foreign handle"]
    assert "received rows" in msgs["combine shape"]


def _one_rank_hangs(rank, world):
    import moe_ep

    import torch.distributed as dist

    buf = moe_ep.Buffer(None, low_latency_mode=True, backend="torch", timeout_s=2.0)
    inp = make_rank_inputs(rank, 4, 128, 6, 2, seed=5, world_size=world)
    live = dist.new_group(list(range(world - 1)))  # every rank takes part in making it
    if rank == world - 1:
        time.sleep(6)  # never calls
        return None
    # the live ranks start the call together: on a loaded machine one of them may otherwise come seconds later and
    # be named too
    dist.barrier(group=live)
    t0 = time.monotonic()
    try:
        buf.low_latency_dispatch(inp.x, inp.topk_idx, 4, 6)
    except moe_ep.RankTimeoutError as exc:
        return (exc.missing_ranks, str(exc), time.monotonic() - t0)
    return "no error"


def test_hanging_rank_is_named():
    world = 3
    results = launch(_one_rank_hangs, world, timeout_s=60)
    for r in range(world - 1):
        missing, msg, elapsed = results[r]
        assert missing == [world - 1]
        assert f"rank(s) [{world - 1}]" in msg
        assert elapsed < 10


def _dead_rank_named(rank, world):
    import moe_ep

    buf = moe_ep.Buffer(None, backend="torch", timeout_s=2.0)
    inp = make_rank_inputs(rank, 4, 128, 8, 2, seed=5, world_size=world)
    if rank == 1:
        os._exit(7)
    try:
        buf.get_dispatch_layout(inp.topk_idx, 8)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(inp.topk_idx, 8)
        buf.dispatch(inp.x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                     topk_idx=inp.topk_idx, topk_weights=inp.topk_weights)
    except moe_ep.RankTimeoutError as exc:
        assert exc.missing_ranks == [1], exc.missing_ranks
        return True
    raise AssertionError("rank 0 did not notice that rank 1 died")


def test_dead_rank_is_named_by_survivors():
    with pytest.raises(RankFailure) as info:
        launch(_dead_rank_named, 2, timeout_s=60)
    # rank 1 died; rank 0 finished (returned the missing ranks) so only rank 1 is reported failed
    assert info.value.failed_ranks == [1]
    assert "exit code 7" in str(info.value)
