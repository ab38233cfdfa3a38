"""symm normal mode: a call refused by one rank's own checks reaches its peers at once (RemoteRankError naming
it, not a timeout) and every rank's next call works and is exact; ranks calling different operations get
CallMismatchError naming the peer and both operations; a view dispatch replayed with the launches of the first
view ever (a CUDA graph captured then) still releases the previous hold."""

from __future__ import annotations

import os
import time

import pytest
import torch

from moe_ep import CallMismatchError, RemoteRankError
from moe_ep.backends.symm import SymmBackend, virtual_backends, virtual_combine_recv, virtual_dispatch_recv
from moe_ep.testing import assert_bitwise_equal, launch, outcome
from moe_ep.testing.inputs import make_all_inputs, make_rank_inputs
from moe_ep.testing.refs import ref_combine, ref_dispatch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU ranks run the symm kernels in the Triton interpreter")

E, K, H, N_MAX = 8, 2, 128, 8


def _send(b, inp, handle=None):
    if handle is not None:
        return b.dispatch_send(inp.x, None, handle=handle, num_tokens_per_rank=None, is_token_in_rank=None,
                               num_tokens_per_expert=None, topk_idx=None, topk_weights=None, num_experts=0)
    lay = b.get_dispatch_layout(inp.topk_idx, E)
    return b.dispatch_send(inp.x, None, handle=None, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3],
                           num_tokens_per_expert=lay[2], topk_idx=inp.topk_idx, topk_weights=inp.topk_weights,
                           num_experts=E)


def _exact_step(bs, ins):
    """A full dispatch + combine over every virtual rank, checked bitwise against the reference."""
    R = len(bs)
    res = virtual_dispatch_recv(bs, [_send(b, i) for b, i in zip(bs, ins)])
    xs, idxs, ws = [i.x for i in ins], [i.topk_idx for i in ins], [i.topk_weights for i in ins]
    ys = []
    for r in range(R):
        want_x, _, want_idx, want_w, want_list = ref_dispatch(r, xs, idxs, ws, E)
        assert_bitwise_equal(res[r].recv_x, want_x, f"recv_x of rank {r}")
        assert torch.equal(res[r].recv_topk_idx, want_idx) and res[r].num_recv_tokens_per_expert_list == want_list
        ys.append((res[r].recv_x.float() * (r + 2)).to(torch.bfloat16))
    sts = [b.combine_send(y, res[r].handle, res[r].recv_topk_weights) for r, (b, y) in enumerate(zip(bs, ys))]
    out = virtual_combine_recv(bs, sts)
    for r in range(R):
        want, want_w = ref_combine(r, ys, idxs, E, recv_weights=[x.recv_topk_weights for x in res])
        assert_bitwise_equal(out[r][0], want, f"combined of rank {r}")
        assert torch.equal(out[r][1], want_w)
    return res


@pytest.mark.parametrize("world,refuser", [(2, 1), (4, 2)])
def test_virtual_refused_dispatch_and_combine_reach_every_peer_and_the_next_calls_are_exact(world, refuser):
    bs = virtual_backends(world, num_nvl_bytes=SymmBackend.get_normal_size_hint(N_MAX, H, K, world), timeout_s=20)
    ins = make_all_inputs(world, [5, 7, 0, 3][:world], H, E, K, seed=4)
    # dispatch: the refuser publishes its refusal in place of its send, then drains its peers' blocks
    sts = {}
    for r, b in enumerate(bs):
        if r == refuser:
            b.normal.refuse_send("dispatch")
        else:
            sts[r] = _send(b, ins[r])
    bs[refuser].normal.refuse_recv("dispatch")
    for r, st in sts.items():
        t0 = time.monotonic()
        with pytest.raises(RemoteRankError, match=rf"rank\(s\) \[{refuser}\] refused") as ei:
            bs[r].dispatch_recv(st, expert_alignment=1, num_worst_tokens=0)
        assert ei.value.failed_ranks == [refuser] and time.monotonic() - t0 < 5
    res = _exact_step(bs, ins)  # every rank's next call works and is exact
    # combine: the same with a refused combine
    ys = [r_.recv_x.clone() for r_ in res]
    csts = {}
    for r, b in enumerate(bs):
        if r == refuser:
            b.normal.refuse_send("combine")
        else:
            csts[r] = b.combine_send(ys[r], res[r].handle, res[r].recv_topk_weights)
    bs[refuser].normal.refuse_recv("combine")
    for r, st in csts.items():
        with pytest.raises(RemoteRankError, match=rf"rank\(s\) \[{refuser}\] refused"):
            bs[r].combine_recv(st, ())
        # the tokens that needed the refuser's rows are NaN (the GPU raises later: never a plausible wrong sum)
        got = st.out.float()
        needs = (ins[r].topk_idx // (E // world) == refuser).any(1)
        assert bool(torch.isnan(got[needs]).all()) and not bool(torch.isnan(got[~needs]).any())
    _exact_step(bs, ins)
    for b in bs:
        assert int(b.normal.symm.status[0]) == 0 and b.normal.symm.broken is None


def test_virtual_chunked_dispatch_stops_after_round_zero_on_every_rank():
    """A refusal in a dispatch of several rounds: every peer drains round 0, raises, and starts no later round."""
    from moe_ep.backends.symm_normal import SymmNormal

    world, refuser = 2, 0
    bs = virtual_backends(world, num_nvl_bytes=SymmNormal.size_hint(None, H, K, world, chunk_tokens=2), timeout_s=20)
    ins = make_all_inputs(world, [9, 7], H, E, K, seed=5)
    bs[refuser].normal.refuse_send("dispatch")
    st = _send(bs[1], ins[1])
    bs[refuser].normal.refuse_recv("dispatch")
    with pytest.raises(RemoteRankError):
        bs[1].normal.dispatch_recv_round(st, 0, num_worst_tokens=0)
    assert st.rounds == 1  # (the receive did not plan later rounds)
    _exact_step(bs, ins)  # 5 rounds, exact


def test_virtual_chunked_combine_stops_after_round_zero_on_every_rank():
    from moe_ep.backends.symm_normal import SymmNormal

    bs = virtual_backends(2, num_nvl_bytes=SymmNormal.size_hint(None, H, K, 2, chunk_tokens=2), timeout_s=20)
    ins = make_all_inputs(2, [9, 7], H, E, K, seed=7)
    res = _exact_step(bs, ins)
    assert res[1].handle.rounds > 1
    bs[0].normal.refuse_send("combine")
    st = bs[1].combine_send(res[1].recv_x, res[1].handle, None)
    bs[0].normal.refuse_recv("combine")
    with pytest.raises(RemoteRankError, match=r"rank\(s\) \[0\] refused"):
        bs[1].normal.combine_recv_round(st, 0)
    _exact_step(bs, ins)


def test_virtual_refusal_with_a_dead_peer_is_bounded_and_named_at_the_next_call():
    """The refusing rank's own send and drain wait like any call: a dead peer costs one timeout there, the refusal
    itself returns (the caller raises its own error), and the next call names the dead peer."""
    from moe_ep import RankTimeoutError

    bs = virtual_backends(2, num_nvl_bytes=SymmBackend.get_normal_size_hint(N_MAX, H, K, 2), timeout_s=0.5)
    t0 = time.monotonic()
    bs[1].normal.refuse("dispatch")  # rank 0 never calls
    assert time.monotonic() - t0 < 5 and int(bs[1].normal.symm.status[0]) == 1  # (peer 0 + 1)
    with pytest.raises(RankTimeoutError, match=r"rank\(s\) \[0\]"):
        _send(bs[1], make_all_inputs(2, 3, H, E, K, seed=1)[1])


def _view_refusal(rank, world):
    import moe_ep

    buf = moe_ep.Buffer(None, backend="symm", timeout_s=30, provider="shm",
                        num_nvl_bytes=SymmBackend.get_normal_size_hint(N_MAX, H, K, world))
    n = 3 * N_MAX if rank == 1 else 4  # rank 1's batch does not fit a receive view
    inp = make_rank_inputs(rank, n, H, E, K, seed=1, world_size=world)

    def dispatch(i, view):
        lay = buf.get_dispatch_layout(i.topk_idx, E)
        return buf.dispatch(i.x, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3], num_tokens_per_expert=lay[2],
                            topk_idx=i.topk_idx, topk_weights=i.topk_weights, recv_as_view=view)

    first = outcome(lambda: dispatch(inp, True))
    # the next calls work on every rank: a view dispatch that fits, its combine, and a copying dispatch
    ok = make_rank_inputs(rank, 4, H, E, K, seed=2, world_size=world)
    recv_x, _, recv_w, _, handle, _ = dispatch(ok, True)
    y = (recv_x.float() * (rank + 1)).to(torch.bfloat16)
    combined, _, _ = buf.combine(y, handle, topk_weights=recv_w)
    return first, combined


@pytest.mark.parametrize("world", [2, 4])
def test_a_view_that_does_not_fit_on_one_rank_reaches_its_peers_at_once(world):
    got = launch(_view_refusal, world, timeout_s=300)
    ins = [make_rank_inputs(r, 4, H, E, K, seed=2, world_size=world) for r in range(world)]
    xs, idxs, ws = [i.x for i in ins], [i.topk_idx for i in ins], [i.topk_weights for i in ins]
    ys = [(ref_dispatch(r, xs, idxs, ws, E)[0].float() * (r + 1)).to(torch.bfloat16) for r in range(world)]
    for r, ((kind, msg, secs), combined) in enumerate(got):
        if r == 1:
            assert kind == "ValueError" and "recv_as_view=True" in msg, msg
        else:
            assert kind == "RemoteRankError" and "rank(s) [1] refused" in msg, msg
            assert secs < 10, f"rank {r} waited {secs:.1f} s (timeout_s=30) instead of hearing of the refusal"
        assert_bitwise_equal(combined, ref_combine(r, ys, idxs, E)[0], f"combine after the refusal, rank {r}")


# ------------------------------------------------------------------ ranks calling different operations
def test_virtual_normal_dispatch_against_combine_names_the_peer_and_both_operations():
    bs = virtual_backends(2, num_nvl_bytes=SymmBackend.get_normal_size_hint(N_MAX, H, K, 2), timeout_s=0.5)
    ins = make_all_inputs(2, [5, 3], H, E, K, seed=6)
    res = _exact_step(bs, ins)
    st0 = _send(bs[0], ins[0])  # rank 0: the next dispatch
    st1 = bs[1].combine_send(res[1].recv_x, res[1].handle, None)  # rank 1: another combine
    with pytest.raises(CallMismatchError, match=r"rank 1: combine, rank 0: dispatch") as e0:
        bs[0].dispatch_recv(st0, expert_alignment=1, num_worst_tokens=0)
    with pytest.raises(CallMismatchError, match=r"rank 0: dispatch, rank 1: combine") as e1:
        bs[1].combine_recv(st1, ())
    assert e0.value.peer == 1 and e1.value.peer == 0


def _ll(shrink, timeout_s=0.5):
    from moe_ep.backends.symm_ll import SymmLowLatency

    bks = virtual_backends(2, num_nvl_bytes=0, num_rdma_bytes=SymmLowLatency.size_hint(1, H, 2, 2, 1),
                           low_latency_mode=True, timeout_s=timeout_s)
    if shrink:
        for b in bks:
            b.enable_shrink()
    x, idx, w = torch.ones(1, H, dtype=torch.bfloat16), torch.tensor([[0]]), torch.ones(1, 1)
    st = [b.low_latency_dispatch_send(x, idx, 1, 2, use_fp8=False) for b in bks]
    res = [b.low_latency_dispatch_recv(s) for b, s in zip(bks, st)]
    cs = [b.low_latency_combine_send(r.recv_x, idx, w, r.handle) for b, r in zip(bks, res)]
    [b.low_latency_combine_recv(c) for b, c in zip(bks, cs)]
    s0 = bks[0].low_latency_dispatch_send(x, idx, 1, 2, use_fp8=False)  # rank 0: the next dispatch
    c1 = bks[1].low_latency_combine_send(res[1].recv_x, idx, w, res[1].handle)  # rank 1: another combine
    return bks, s0, c1


@pytest.mark.parametrize("shrink", [False, True])
def test_virtual_low_latency_dispatch_against_combine_names_the_peer_and_both_operations(shrink):
    """(review ll-nvshmem-fault-tolerance.md 9, rv/diff_ops.py) With enable_shrink the peer is masked by the wait
    (a kernel decision), and the receive still raises naming the operation instead of masking it silently."""
    bks, s0, c1 = _ll(shrink)
    with pytest.raises(CallMismatchError, match=r"rank 1: low_latency_combine, rank 0: low_latency_dispatch"):
        bks[0].low_latency_dispatch_recv(s0)
    with pytest.raises(CallMismatchError, match=r"rank 0: low_latency_dispatch, rank 1: low_latency_combine"):
        bks[1].low_latency_combine_recv(c1)


# ------------------------------------------------------------------ a view dispatch replayed as first captured
def _view_replays(rank, world):
    import moe_ep

    buf = moe_ep.Buffer(None, backend="symm", timeout_s=3, provider="shm",
                        num_nvl_bytes=SymmBackend.get_normal_size_hint(N_MAX, H, K, world))
    got = []
    for step in range(3):
        # every call launches what a CUDA graph captured at the first view dispatch ever recorded (review
        # elastic-view-mega.md 3: the host flag was still False then)
        buf._impl.normal._view_used = False
        inp = make_rank_inputs(rank, 4, H, E, K, seed=20 + step, world_size=world)
        lay = buf.get_dispatch_layout(inp.topk_idx, E)
        recv_x = buf.dispatch(inp.x, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3],
                              num_tokens_per_expert=lay[2], topk_idx=inp.topk_idx, topk_weights=inp.topk_weights,
                              recv_as_view=True)[0]
        got.append(recv_x.clone())
    return got


def test_view_dispatches_replayed_as_first_captured_release_their_hold():
    got = launch(_view_replays, 2, timeout_s=200)
    for step in range(3):
        ins = [make_rank_inputs(r, 4, H, E, K, seed=20 + step, world_size=2) for r in range(2)]
        for r in range(2):
            want = ref_dispatch(r, [i.x for i in ins], [i.topk_idx for i in ins], [i.topk_weights for i in ins], E)[0]
            assert_bitwise_equal(got[r][step], want, f"recv_x of rank {r}, step {step}")


def test_a_dispatch_and_a_combine_captured_before_the_first_view_release_a_later_hold():
    """A CUDA graph captured before any view has a release launch in its dispatch and its combine receive (simulated
    capture: moe_ep.testing.streams), so replaying it after an eager view dispatch does not wait on the hold."""
    from moe_ep.testing.streams import checked_streams

    bs = virtual_backends(2, num_nvl_bytes=SymmBackend.get_normal_size_hint(N_MAX, H, K, 2), timeout_s=3)
    ins = make_all_inputs(2, [4, 3], H, E, K, seed=8)
    # an eager view dispatch (nothing is held before it: no release needed): its rows stay held
    lays = [b.get_dispatch_layout(i.topk_idx, E) for b, i in zip(bs, ins)]
    sts = [b.dispatch_send(i.x, None, handle=None, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3],
                           num_tokens_per_expert=lay[2], topk_idx=i.topk_idx, topk_weights=i.topk_weights,
                           num_experts=E, recv_view=True, release=False) for b, i, lay in zip(bs, ins, lays)]
    virtual_dispatch_recv(bs, sts)
    for b in bs:  # what a graph captured before that view recorded: the host flag was False
        b.normal._view_used = False
    with checked_streams(strict=False) as checker, checker.capture():
        for b in bs:
            b.normal.dispatch_release()  # a capture launches it (a device-side no-op when nothing is held)
        res = virtual_dispatch_recv(bs, [_send(b, i) for b, i in zip(bs, ins)])
    xs, idxs, ws = [i.x for i in ins], [i.topk_idx for i in ins], [i.topk_weights for i in ins]
    for r in range(2):
        assert_bitwise_equal(res[r].recv_x, ref_dispatch(r, xs, idxs, ws, E)[0], f"recv_x of rank {r}")
    # a combine receive captured the same way frees a view taken before it (nothing held before that view)
    sts = [b.dispatch_send(i.x, None, handle=None, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3],
                           num_tokens_per_expert=lay[2], topk_idx=i.topk_idx, topk_weights=i.topk_weights,
                           num_experts=E, recv_view=True, release=False) for b, i, lay in zip(bs, ins, lays)]
    views = virtual_dispatch_recv(bs, sts)
    for b in bs:
        b.normal._view_used = False
    with checked_streams(strict=False) as checker, checker.capture():
        csts = [b.combine_send(v.recv_x.clone(), v.handle, None) for b, v in zip(bs, views)]
        virtual_combine_recv(bs, csts)
    for b in bs:
        held = b.normal.symm.signals[b.normal.sig["DISP_HELD"]:b.normal.sig["DISP_HELD"] + 2]
        assert held.tolist() == [0, 0], "the captured combine receive did not free the view"


def _elastic_bad_expert(rank, world):
    from moe_ep.testing.inputs import make_elastic_buffer

    eb = make_elastic_buffer("symm", world, N_MAX, H, 3, timeout_s=30)
    inp = make_all_inputs(world, 5, H, E, 3, seed=2)[rank]
    idx = inp.topk_idx.clone()
    if rank == 0:
        idx[0, 0] = E  # == num_experts: refused by the layout checks
    first = outcome(lambda: eb.dispatch(inp.x, idx, inp.topk_weights, num_experts=E))
    again = outcome(lambda: eb.dispatch(inp.x, inp.topk_idx, inp.topk_weights, num_experts=E))  # still usable
    return first, again


def test_an_elastic_expert_id_refusal_on_symm_reaches_the_others_at_once():
    (f0, a0), (f1, a1) = launch(_elastic_bad_expert, 2, timeout_s=200)
    assert f0[0] == "ValueError" and "outside" in f0[1], f0
    assert f1[0] == "RemoteRankError" and "[0] refused" in f1[1] and f1[2] < 10, f1
    assert a0[0] == a1[0] == "ok", (a0, a1)


def test_gpu_path_reports_a_single_round_refusal_at_check_status_not_at_a_later_call():
    """Under the stream checker (the CUDA code path on a CPU) a one-round receive queues a copy of the refusal words
    instead of synchronising: the call completes, a later call works, and check_status() raises naming the rank."""
    from moe_ep.testing.streams import checked_streams

    bs = virtual_backends(2, num_nvl_bytes=SymmBackend.get_normal_size_hint(N_MAX, H, K, 2), timeout_s=20)
    ins = make_all_inputs(2, [4, 3], H, E, K, seed=9)
    res = _exact_step(bs, ins)
    with checked_streams(strict=False):
        bs[1].normal.refuse_send("combine")
        st = bs[0].combine_send(res[0].recv_x, res[0].handle, None)
        bs[1].normal.refuse_recv("combine")
        out, _ = bs[0].combine_recv(st, ())  # no raise here (no synchronisation on this path)
        needs = (ins[0].topk_idx // (E // 2) == 1).any(1)
        assert bool(torch.isnan(out.float()[needs]).all()) and not bool(torch.isnan(out.float()[~needs]).any())
        _exact_step(bs, ins)  # the next call on every rank works (and does not raise for the earlier refusal)
        bs[0].normal._check_refused("a later chunked call", blocking=True)  # its words are this call's: none
        with pytest.raises(RemoteRankError, match=r"rank\(s\) \[1\] refused"):
            bs[0].check_status(blocking=False)
        bs[0].check_status(blocking=True)  # reported once
