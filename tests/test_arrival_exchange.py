"""The ``torch`` backend's arrival check rides in the call's own exchange (docs/protocols.md, "Host arrival
checks"): no store round trip per call, and slow, dead, late or disagreeing ranks still end in the named errors."""

from __future__ import annotations

import os
import time

import pytest
import torch

from moe_ep.testing import RankFailure, launch, outcome
from moe_ep.testing.inputs import make_rank_inputs


def _layout_args(buf, inp, num_experts):
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(inp.topk_idx, num_experts)
    return dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=inp.topk_idx, topk_weights=inp.topk_weights)


class _CountingStore:
    """Forwards to the real store and records the name of every method called."""

    def __init__(self, store):
        self._store = store
        self.calls: list = []

    def __getattr__(self, name):
        self.calls.append(name)
        return getattr(self._store, name)


def _store_calls(rank, world):
    import moe_ep

    buf = moe_ep.Buffer(None, backend="torch", timeout_s=20)
    ll = moe_ep.Buffer(None, low_latency_mode=True, backend="torch", timeout_s=20)
    spies = []
    for b in (buf, ll):
        b._impl.arrival.store = _CountingStore(b._impl.arrival.store)
        spies.append(b._impl.arrival.store)
    inp = make_rank_inputs(rank, 6, 128, 8, 2, seed=1, world_size=world)
    recv_x, _, _, _, handle, _ = buf.dispatch(inp.x, **_layout_args(buf, inp, 8))
    out, _, _ = buf.combine(recv_x, handle)
    buf.dispatch(inp.x, handle=handle)  # cached
    res = ll.low_latency_dispatch(inp.x, inp.topk_idx, 8, 8, use_fp8=False)
    ll.low_latency_combine(res[0], inp.topk_idx, inp.topk_weights, res[2])
    return [s.calls for s in spies], tuple(out.shape)


def test_calls_make_no_store_round_trip():
    for (normal, low_latency), shape in launch(_store_calls, 2, timeout_s=60):
        # one one-way arrival mark per call (set sends without awaiting a reply); nothing that waits on the store
        assert normal == ["set"] * 3, normal
        assert low_latency == ["set"] * 2, low_latency
        assert shape == (6, 128)


def _slow_rank(rank, world):
    import moe_ep

    buf = moe_ep.Buffer(None, low_latency_mode=True, backend="torch", timeout_s=5.0)
    inp = make_rank_inputs(rank, 4, 128, 8, 2, seed=2, world_size=world)
    stats = torch.zeros(world, dtype=torch.int64)
    if rank == 1:
        time.sleep(1.0)  # slow, but well inside the timeout (and its margin)
    buf.low_latency_dispatch(inp.x, inp.topk_idx, 8, 8, dispatch_wait_recv_cost_stats=stats)
    args = _layout_args(buf, inp, 8)
    if rank == 0:
        time.sleep(1.0)
    recv = buf.dispatch(inp.x, **args)[0]
    return stats.tolist(), int(recv.shape[0])


def test_a_slow_rank_inside_the_timeout_is_waited_for_and_timed():
    (s0, n0), (s1, n1) = launch(_slow_rank, 2, timeout_s=60)
    assert n0 > 0 and n1 > 0
    assert s0[1] >= 0.8e9, s0  # rank 0 waited about a second for rank 1 (from the arrival times in the headers)
    assert s0[0] == 0 and s1 == [0, 0], (s0, s1)


def _dead_rank(rank, world, when):
    """The last rank dies ``"after_dispatch"`` (before the combine: its arrival mark is of the older call) or
    ``"before_rows"`` (it passed the dispatch's arrival check, then dies before its rows move); the survivors name
    it within the timeout, in the combine's check or in the dispatch's payload exchange."""
    import moe_ep
    from moe_ep.backends.torch_a2a import TorchBackend

    buf = moe_ep.Buffer(None, backend="torch", timeout_s=2.0)
    E = 3 * world
    inp = make_rank_inputs(rank, 4, 128, E, 2, seed=5, world_size=world)
    dies = rank == world - 1
    if when == "after_dispatch":
        recv_x, _, _, _, handle, _ = buf.dispatch(inp.x, **_layout_args(buf, inp, E))
        if dies:
            os._exit(7)
        call = lambda: buf.combine(recv_x, handle)  # noqa: E731
    else:
        if dies:
            TorchBackend._a2a = lambda *a, **k: os._exit(7)
        call = lambda: buf.dispatch(inp.x, **_layout_args(buf, inp, E))  # noqa: E731
    t0 = time.monotonic()
    try:
        call()
    except moe_ep.RankTimeoutError as exc:
        assert exc.missing_ranks == [world - 1] if when == "after_dispatch" else "rows" in str(exc), str(exc)
        assert str(world - 1) in str(exc) and time.monotonic() - t0 < 6, (str(exc), time.monotonic() - t0)
        return True
    raise AssertionError(f"rank {rank} did not notice that rank {world - 1} died")


@pytest.mark.parametrize("when,world", [("after_dispatch", 3), ("before_rows", 2)])
def test_a_dead_rank_is_named_within_the_timeout(when, world):
    """A rank dead since the last call is named by the next call's check; one that dies between a call's check and
    its rows is named by the payload exchange, which is bounded by timeout_s too."""
    with pytest.raises(RankFailure) as info:
        launch(_dead_rank, world, when, timeout_s=60)
    # only the dead rank is reported: the survivors named it (their asserts passed)
    assert info.value.failed_ranks == [world - 1], str(info.value)
    assert "exit code 7" in str(info.value)


def _late_in_combine(rank, world):
    import moe_ep

    buf = moe_ep.Buffer(None, backend="torch", timeout_s=1.0)
    inp = make_rank_inputs(rank, 4, 128, 9, 2, seed=5, world_size=world)
    recv_x, _, _, _, handle, _ = buf.dispatch(inp.x, **_layout_args(buf, inp, 9))
    if rank == 2:
        time.sleep(6.0)  # well past the peers' timeout, even when a loaded machine starts a peer's combine late
    return outcome(lambda: buf.combine(recv_x, handle))


def test_a_rank_late_for_a_combine_is_named_and_raises_at_once_itself():
    results = launch(_late_in_combine, 3, timeout_s=60)
    for kind, msg, secs in results[:2]:
        assert kind == "RankTimeoutError" and "[2]" in msg, msg
        assert secs < 4
    kind, msg, secs = results[2]
    assert kind == "RankTimeoutError" and "given up" in msg, msg
    assert secs < 1.0


def _disagree_on_cached(rank, world):
    import moe_ep

    buf = moe_ep.Buffer(None, backend="torch", timeout_s=20)
    inp = make_rank_inputs(rank, 4, 128, 8, 2, seed=5, world_size=world)
    recv_x, _, _, _, handle, _ = buf.dispatch(inp.x, **_layout_args(buf, inp, 8))
    # rank 0 repeats the dispatch from its handle, rank 1 goes on to the combine: different operations meet
    first = outcome(lambda: buf.dispatch(inp.x, handle=handle) if rank == 0 else buf.combine(recv_x, handle))
    out, _, _ = buf.combine(recv_x, handle)  # still in step
    return first, tuple(out.shape)


def test_a_cached_dispatch_meeting_a_combine_raises_on_both():
    for (kind, msg, secs), shape in launch(_disagree_on_cached, 2, timeout_s=60):
        assert kind == "CallMismatchError", msg
        assert "dispatch" in msg and "combine" in msg and secs < 10, msg
        assert shape == (4, 128)
