"""Receive as a view (``Buffer.dispatch(..., recv_as_view=True)`` on ``symm``): the received rows are handed out
as views of the rank's own buffer, bitwise equal to the copying receive, valid until the rank's next dispatch
or combine; ranks that disagree on the mode all raise naming it; a view that cannot hold ``num_worst_tokens``
is refused before any communication; the sequential virtual-rank path (release phase first) works."""

from __future__ import annotations

import os
import time

import pytest
import torch

from moe_ep.testing import assert_bitwise_equal, launch, outcome
from moe_ep.testing.inputs import make_all_inputs, make_rank_inputs
from moe_ep.testing.refs import ref_combine, ref_dispatch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU ranks run the symm kernels in the Triton interpreter")

HIDDEN, E, K, N_MAX = 256, 8, 3, 8


def _buffer(world, backend="symm"):
    import moe_ep
    from moe_ep.backends.symm import SymmBackend

    kw = {"num_nvl_bytes": SymmBackend.get_normal_size_hint(N_MAX, HIDDEN, K, world)} if backend == "symm" else {}
    return moe_ep.Buffer(None, backend=backend, timeout_s=20, **kw)


def _layout(buf, inp):
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(inp.topk_idx, E)
    return dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=inp.topk_idx, topk_weights=inp.topk_weights)


def _in_buffer(buf, t) -> bool:
    region = buf._impl.normal.symm.buffer
    return region.data_ptr() <= t.data_ptr() < region.data_ptr() + region.numel()


def _view_steps(rank, world, backend):
    buf = _buffer(world, backend)
    tokens = [5, 7, 0, 3][:world]
    for step, fp8 in enumerate((False, True, False)):
        inp = make_rank_inputs(rank, tokens[rank], HIDDEN, E, K, seed=10 + step, world_size=world)
        x = (inp.x_fp8, inp.x_scales) if fp8 else inp.x
        want_x, want_idx, want_w, want_list, _, _ = buf.dispatch(x, **_layout(buf, inp))  # copying receive
        got_x, idx, w, lst, h, _ = buf.dispatch(x, **_layout(buf, inp), recv_as_view=True)
        for a, b in zip(got_x if fp8 else (got_x,), want_x if fp8 else (want_x,)):
            assert_bitwise_equal(a.view(torch.uint8) if fp8 and a.dtype != torch.float32 else a,
                                 b.view(torch.uint8) if fp8 and b.dtype != torch.float32 else b, "recv_x")
            if backend == "symm" and a.shape[0]:
                assert _in_buffer(buf, a), "recv_as_view returned a copy"
            assert a.is_contiguous()
        assert torch.equal(idx, want_idx) and torch.equal(w, want_w) and lst == want_list
        data = got_x[0] if fp8 else got_x
        before = data.clone()
        # the view holds until the next call: a cached dispatch of 2x overwrites it in place on symm
        x2 = (inp.x_fp8, inp.x_scales * 2) if fp8 else inp.x * 2
        got2 = buf.dispatch(x2, handle=h, recv_as_view=True)[0]
        data2 = got2[0] if fp8 else got2
        assert torch.equal(data2.view(torch.uint8), (before if fp8 else before * 2).view(torch.uint8))
        if backend == "symm" and data.shape[0]:
            assert data.data_ptr() == data2.data_ptr() and torch.equal(data.view(torch.uint8), data2.view(torch.uint8))
        # combine straight from the view (it frees the view's rows), against the combine of the copy
        y = (data2.float() * (rank + 1)).to(torch.bfloat16)
        combined, cw, _ = buf.combine(y.clone(), h, topk_weights=w)
        ref_y = ((want_x[0] if fp8 else want_x * 2).float() * (rank + 1)).to(torch.bfloat16)
        ref_c, ref_cw, _ = buf.combine(ref_y, h, topk_weights=want_w)
        assert_bitwise_equal(combined, ref_c, "combined from the view")
        assert torch.equal(cw, ref_cw)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_view_equals_the_copy_and_holds_until_the_next_call(world):
    assert launch(_view_steps, world, "symm", timeout_s=300) == [True] * world


def test_torch_backend_accepts_the_flag_and_returns_fresh_tensors():
    assert launch(_view_steps, 2, "torch", timeout_s=120) == [True, True]


def _mixed_modes(rank, world):
    buf = _buffer(world)
    inp = make_rank_inputs(rank, 4, HIDDEN, E, K, seed=3, world_size=world)
    return outcome(lambda: buf.dispatch(inp.x, **_layout(buf, inp), recv_as_view=rank == 0))


def test_ranks_that_disagree_on_the_view_all_raise_naming_it():
    for kind, msg, secs in launch(_mixed_modes, 2, timeout_s=120):
        assert kind == "CallMismatchError" and "flags" in msg, msg
        assert secs < 15


def _mismatch_after_a_view(rank, world):
    """The signature check still works on the calls after a view (the release must not clear this call's own
    signature): a view dispatch, then ranks that disagree on hidden."""
    buf = _buffer(world)
    inp = make_rank_inputs(rank, 4, HIDDEN, E, K, seed=5, world_size=world)
    buf.dispatch(inp.x, **_layout(buf, inp), recv_as_view=True)
    hidden = HIDDEN if rank == 0 else HIDDEN // 2
    bad = make_rank_inputs(rank, 4, hidden, E, K, seed=6, world_size=world)
    return outcome(lambda: buf.dispatch(bad.x, **_layout(buf, bad), recv_as_view=True))


def test_ranks_that_disagree_after_a_view_still_raise_naming_the_field():
    for kind, msg, secs in launch(_mismatch_after_a_view, 2, timeout_s=120):
        assert kind == "CallMismatchError" and "hidden" in msg, msg
        assert secs < 15


def _too_many_worst_rows(rank, world):
    buf = _buffer(world)
    inp = make_rank_inputs(rank, 4, HIDDEN, E, K, seed=4, world_size=world)
    first = outcome(lambda: buf.dispatch(inp.x, **_layout(buf, inp), num_worst_tokens=10**4, recv_as_view=True))
    # nothing was sent: the Buffer still works, a worst-case view that fits pads with -1 routing
    recv, idx, _, _, _, _ = buf.dispatch(inp.x, **_layout(buf, inp), num_worst_tokens=2 * N_MAX, recv_as_view=True)
    return first, recv.shape[0], bool((idx[int((idx >= 0).any(1).sum()):] == -1).all())


def test_a_view_too_small_for_num_worst_tokens_is_refused_before_communication():
    for (kind, msg, _), rows, pad_ok in launch(_too_many_worst_rows, 2, timeout_s=120):
        assert kind == "ValueError" and "num_worst_tokens=10000" in msg and "receive view" in msg, msg
        assert rows == 2 * N_MAX and pad_ok


@pytest.mark.parametrize("world", [2, 4])
def test_virtual_ranks_release_phase_then_sends(world):
    """One process, phases launched rank by rank: views back to back (no combine between), then a copying
    dispatch, then a combine; the release is its own phase, run for every rank before the sends."""
    from moe_ep.backends.symm import SymmBackend, virtual_backends

    n = [5, 0, 7, 1][:world]
    bs = virtual_backends(world, num_nvl_bytes=SymmBackend.get_normal_size_hint(N_MAX, HIDDEN, K, world),
                          timeout_s=20)
    for seed, view in ((1, True), (2, True), (3, False), (4, True)):
        ins = make_all_inputs(world, n, HIDDEN, E, K, seed)
        xs, idxs, ws = [i.x for i in ins], [i.topk_idx for i in ins], [i.topk_weights for i in ins]
        lays = [b.get_dispatch_layout(i.topk_idx, E) for b, i in zip(bs, ins)]
        for b in bs:
            b.normal.dispatch_release()
        sts = [b.dispatch_send(i.x, None, handle=None, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3],
                               num_tokens_per_expert=lay[2], topk_idx=i.topk_idx, topk_weights=i.topk_weights,
                               num_experts=E, recv_view=view, release=False) for b, i, lay in zip(bs, ins, lays)]
        res = [b.dispatch_recv(s, expert_alignment=1, num_worst_tokens=0) for b, s in zip(bs, sts)]
        for r, out in enumerate(res):
            ex_x, _, ex_idx, ex_w, ex_list = ref_dispatch(r, xs, idxs, ws, E)
            assert_bitwise_equal(out.recv_x, ex_x, f"rank {r} recv_x")
            assert_bitwise_equal(out.recv_topk_idx, ex_idx, f"rank {r} recv_topk_idx")
            assert_bitwise_equal(out.recv_topk_weights, ex_w, f"rank {r} recv_topk_weights")
            assert out.num_recv_tokens_per_expert_list == ex_list
            if view and out.recv_x.shape[0]:
                region = bs[r].normal.symm.buffer
                assert region.data_ptr() <= out.recv_x.data_ptr() < region.data_ptr() + region.numel()
    ys = [(o.recv_x.float() * (r + 1)).to(torch.bfloat16) for r, o in enumerate(res)]
    cs = [b.combine_send(y, o.handle, o.recv_topk_weights) for b, y, o in zip(bs, ys, res)]
    for r, (cx, _) in enumerate(b.combine_recv(s, ()) for b, s in zip(bs, cs)):
        assert_bitwise_equal(cx, ref_combine(r, ys, idxs, E, [o.recv_topk_weights for o in res])[0], f"rank {r}")


SILENT_TIMEOUT_S = 8.0


def _silent_rank(rank, world, silent):
    import moe_ep
    from moe_ep.backends.symm import SymmBackend

    # the live ranks run the kernels in the interpreter, seconds apart on a loaded machine: the bound leaves room for
    # that, and the silent rank stays away well past it
    buf = moe_ep.Buffer(None, backend="symm", timeout_s=SILENT_TIMEOUT_S,
                        num_nvl_bytes=SymmBackend.get_normal_size_hint(N_MAX, HIDDEN, K, world))
    inp = make_rank_inputs(rank, 4, HIDDEN, E, K, seed=7, world_size=world)
    lay = _layout(buf, inp)
    if rank == silent:
        time.sleep(2 * SILENT_TIMEOUT_S + 4)  # never dispatches
        return None
    t0 = time.monotonic()
    try:
        buf.dispatch(inp.x, **lay, recv_as_view=True)
    except moe_ep.RankTimeoutError as exc:
        return exc.missing_ranks, time.monotonic() - t0
    return "no error"


@pytest.mark.parametrize("silent", [0, pytest.param(3, marks=pytest.mark.slow)])  # each waits out a timeout
def test_a_silent_rank_is_named_not_waited_for(silent):
    """Rank 0 silent: the others' view sends wait on its count words; the last rank silent: the others wait on its rows.
    Either way every waiting rank raises RankTimeoutError naming it within the timeout."""
    world = 4
    results = launch(_silent_rank, world, silent, timeout_s=60)
    for r, res in enumerate(results):
        if r != silent:
            assert res != "no error" and res[0] == [silent] and res[1] < SILENT_TIMEOUT_S + 6, (r, res)


@pytest.mark.parametrize("T,H,K", [(3, 256, 1), (5, 384, 2), (2, 128, 3)])
def test_size_hint_holds_T_tokens_as_a_view(T, H, K):
    """A buffer sized by get_normal_size_hint(T, ...) takes T BF16 tokens with a receive view (the planes' 64-byte
    alignment is in the hint) and a view holds the R*T worst-case rows."""
    from moe_ep.backends.symm import SymmBackend, virtual_backends
    from moe_ep.backends.symm_normal import SymmNormal

    R = 2
    sn = virtual_backends(R, num_nvl_bytes=SymmBackend.get_normal_size_hint(T, H, K, R), timeout_s=5)[0].normal
    words = SymmNormal._dispatch_words(H, K, False)
    cap = min(sn._cap(words), sn._cap((H // 2 + K + 15) // 16 * 16))
    view_cap, rows, _ = sn._view_layout(cap, (H // 2, H // 2, H // 2 + 2 * K), words)
    assert view_cap >= T and rows >= R * T


def test_low_latency_rdma_size_hint_is_ours_and_below_deepeps():
    """Buffer.get_low_latency_rdma_size_hint is what our layouts address (symm at any top-k up to 32, nvshmem up to
    DeepEP's 9), and at engine shapes no more than DeepEP's own hint."""
    import moe_ep
    from moe_ep.backends.nvshmem import NvshmemBackend
    from moe_ep.backends.symm import SymmBackend
    from moe_ep.backends.symm_ll import deepep_ll_buffer_bytes

    for T, H, R, E in [(128, 7168, 8, 256), (128, 7168, 16, 256), (128, 4096, 8, 64), (128, 2048, 2, 32),
                       (64, 4096, 4, 64)]:
        hint = moe_ep.Buffer.get_low_latency_rdma_size_hint(T, H, R, E)
        assert hint <= deepep_ll_buffer_bytes(T, H, R, E), (T, H, R, E)
        assert hint >= SymmBackend.get_low_latency_size_hint(T, H, R, E, min(E, 32))
        assert hint >= NvshmemBackend.get_low_latency_size_hint(T, H, R, E, min(E, 9))
