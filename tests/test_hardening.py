"""Cross-rank safety: ranks that disagree, refuse or arrive late all raise, quickly and on every rank, before
any payload moves; sizes that decide peer writes are checked; odd row layouts and cached dispatches work."""

from __future__ import annotations

import time

import pytest
import torch

from moe_ep.testing import launch, outcome
from moe_ep.testing.inputs import make_rank_inputs


def _layout_args(buf, inp, num_experts):
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(inp.topk_idx, num_experts)
    return dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=inp.topk_idx, topk_weights=inp.topk_weights)


# ---------------------------------------------------------------------------------------------- 1: signatures
def _mismatched_hidden(rank, world):
    import moe_ep

    buf = moe_ep.Buffer(None, backend="torch", timeout_s=20)
    hidden = 256 if rank == 0 else 128
    inp = make_rank_inputs(rank, 6, hidden, 8, 2, seed=1, world_size=world)
    args = _layout_args(buf, inp, 8)
    first = outcome(lambda: buf.dispatch(inp.x, **args))
    # the Buffer stays in step: a matching call afterwards works on every rank
    inp2 = make_rank_inputs(rank, 6, 128, 8, 2, seed=2, world_size=world)
    recv = buf.dispatch(inp2.x, **_layout_args(buf, inp2, 8))[0]
    return first, tuple(recv.shape)


def test_ranks_with_different_hidden_all_raise_naming_the_field():
    results = launch(_mismatched_hidden, 2, timeout_s=60)
    for (kind, msg, secs), shape in results:
        assert kind == "CallMismatchError", msg
        assert "hidden" in msg and "rank 0=256" in msg and "rank 1=128" in msg, msg
        assert secs < 10
        assert shape[1] == 128


def _different_calls(rank, world):
    import moe_ep

    buf = moe_ep.Buffer(None, low_latency_mode=True, backend="torch", timeout_s=20)
    inp = make_rank_inputs(rank, 4, 128, 8, 2, seed=1, world_size=world)
    if rank == 0:
        return outcome(lambda: buf.dispatch(inp.x, **_layout_args(buf, inp, 8)))
    return outcome(lambda: buf.low_latency_dispatch(inp.x, inp.topk_idx, 8, 8))


def test_ranks_in_different_operations_all_raise():
    for kind, msg, secs in launch(_different_calls, 2, timeout_s=60):
        assert kind == "CallMismatchError", msg
        assert "rank 0: dispatch" in msg and "rank 1: low_latency_dispatch" in msg, msg
        assert secs < 10


def _mismatched_topk_ll(rank, world):
    import moe_ep

    buf = moe_ep.Buffer(None, low_latency_mode=True, backend="torch", timeout_s=20)
    k = 2 if rank == 0 else 3
    inp = make_rank_inputs(rank, 4, 128, 8, k, seed=1, world_size=world)
    return outcome(lambda: buf.low_latency_dispatch(inp.x, inp.topk_idx, 8, 8))


def test_low_latency_ranks_with_different_topk_all_raise():
    for kind, msg, _ in launch(_mismatched_topk_ll, 2, timeout_s=60):
        assert kind == "CallMismatchError" and "topk" in msg, msg


# ---------------------------------------------------------------------------------------------- 2/3: refusals
def _one_rank_refuses(rank, world, what):
    import moe_ep

    buf = moe_ep.Buffer(None, backend="torch", timeout_s=30)
    inp = make_rank_inputs(rank, 6, 128, 8, 2, seed=1, world_size=world)
    args = _layout_args(buf, inp, 8)
    if rank == 1 and what == "layout":
        args["num_tokens_per_rank"] = args["num_tokens_per_rank"] + 1  # disagrees with is_token_in_rank
    if rank == 1 and what == "weights":
        recv_x, _, recv_w, _, handle, _ = buf.dispatch(inp.x, **args)
        return outcome(lambda: buf.combine(recv_x, handle, topk_weights=torch.cat([recv_w, recv_w], 1)))
    if what == "weights":
        recv_x, _, recv_w, _, handle, _ = buf.dispatch(inp.x, **args)
        return outcome(lambda: buf.combine(recv_x, handle, topk_weights=recv_w))
    return outcome(lambda: buf.dispatch(inp.x, **args))


@pytest.mark.parametrize("what", ["layout", "weights"])
def test_a_refused_call_reaches_every_rank_at_once(what):
    (k0, m0, s0), (k1, m1, s1) = launch(_one_rank_refuses, 2, what, timeout_s=90)
    assert k1 == "ValueError", m1
    assert ("disagree" in m1) if what == "layout" else ("topk_weights must be" in m1), m1
    assert k0 == "RemoteRankError" and "rank 1 refused" in m0, m0
    assert s0 < 10, f"the peer waited {s0:.1f} s (timeout_s=30) instead of hearing of the refusal"


def _late_rank(rank, world):
    import moe_ep

    buf = moe_ep.Buffer(None, backend="torch", timeout_s=1.0)
    inp = make_rank_inputs(rank, 4, 128, 8, 2, seed=1, world_size=world)
    args = _layout_args(buf, inp, 8)
    if rank == 1:
        time.sleep(6.0)  # well past the peer's timeout, even when a loaded machine starts the peer's call late
    return outcome(lambda: buf.dispatch(inp.x, **args))


def test_a_rank_arriving_after_the_peers_gave_up_raises_instead_of_hanging():
    (k0, m0, _), (k1, m1, s1) = launch(_late_rank, 2, timeout_s=60)
    assert k0 == "RankTimeoutError" and "[1]" in m0, m0
    assert k1 == "RankTimeoutError" and "given up" in m1, m1
    assert s1 < 1.0


# ---------------------------------------------------------------------------------------------- 4: symm widths
def _symm_wide_weights(rank, world):
    import moe_ep
    from moe_ep.backends.symm import SymmBackend

    buf = moe_ep.Buffer(None, backend="symm", timeout_s=5, provider="shm",
                        num_nvl_bytes=SymmBackend.get_normal_size_hint(8, 128, 2, world))
    inp = make_rank_inputs(rank, 6, 128, 8, 2, seed=1, world_size=world)
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(inp.x, **_layout_args(buf, inp, 8))
    wide = outcome(lambda: buf.combine(recv_x, handle, topk_weights=torch.cat([recv_w, recv_w], 1)))
    out, w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)  # nothing was written by the refused call
    torch.testing.assert_close(w, torch.where(inp.topk_idx >= 0, inp.topk_weights, 0.0), rtol=0, atol=0)
    return wide


def test_symm_combine_refuses_wider_topk_weights_before_writing():
    for kind, msg, _ in launch(_symm_wide_weights, 2, timeout_s=120):
        assert kind == "ValueError" and "topk_weights must be" in msg, msg


# ---------------------------------------------------------------------------------------------- 7: odd words
def _one_row(rank, world, backend, hidden, fp8):
    from moe_ep.backends.symm import SymmBackend
    from moe_ep.testing.suite import check_buffer_case

    kw = {}
    if backend == "symm":
        kw = dict(provider="shm", num_nvl_bytes=SymmBackend.get_normal_size_hint(4, hidden, 2, world),
                  num_rdma_bytes=SymmBackend.get_low_latency_size_hint(4, hidden, world, 4, 2))
    # one token on rank 0 only: every rank that receives anything receives exactly one row
    return check_buffer_case(rank, world, dict(seed=5, n=[1, 0], hidden=hidden, E=4, k=2, routing="random"),
                             backend, modes=("normal",), **kw)


@pytest.mark.parametrize("backend", ["torch", "symm"])
@pytest.mark.parametrize("hidden", [130, 384])
def test_one_received_row_with_topk_on_an_odd_word(backend, hidden):
    launch(_one_row, 2, backend, hidden, hidden % 128 == 0, timeout_s=120)


# ---------------------------------------------------------------------------------------------- 9: cached dispatch
def _cached_dispatch(rank, world, backend):
    import moe_ep
    from moe_ep.backends.symm import SymmBackend
    from moe_ep.testing.traps import host_reads_trapped

    kw = {}
    if backend == "symm":
        kw = dict(provider="shm", num_nvl_bytes=SymmBackend.get_normal_size_hint(8, 128, 2, world))
    buf = moe_ep.Buffer(None, backend=backend, timeout_s=20, **kw)
    inp = make_rank_inputs(rank, 5, 128, 8, 2, seed=3, world_size=world)
    args = _layout_args(buf, inp, 8)
    x2 = inp.x * 2
    # after a num_worst_tokens dispatch: the cached dispatch keeps its shapes
    recv_x, _, _, _, handle, _ = buf.dispatch(inp.x, num_worst_tokens=16, **args)
    recv2 = buf.dispatch(x2, handle=handle)[0]
    assert recv2.shape == recv_x.shape == (16, 128)
    torch.testing.assert_close(recv2.float(), recv_x.float() * 2, rtol=0, atol=0)
    bad = outcome(lambda: buf.dispatch(x2, handle=handle, num_worst_tokens=32))
    # without num_worst_tokens: the handle knows the counts, so the cached dispatch reads nothing on the host
    recv_x, _, _, _, handle, _ = buf.dispatch(inp.x, **args)
    with host_reads_trapped():
        recv3 = buf.dispatch(x2, handle=handle)[0]
    torch.testing.assert_close(recv3.float(), recv_x.float() * 2, rtol=0, atol=0)
    return bad


@pytest.mark.parametrize("backend", ["torch", "symm"])
def test_cached_dispatch_keeps_num_worst_tokens_and_reads_nothing_on_the_host(backend):
    for kind, msg, _ in launch(_cached_dispatch, 2, backend, timeout_s=120):
        assert kind == "ValueError" and "num_worst_tokens" in msg, msg


def _count_host_reads(rank, world):
    import moe_ep

    buf = moe_ep.Buffer(None, backend="torch", timeout_s=20)
    inp = make_rank_inputs(rank, 6, 128, 8, 2, seed=1, world_size=world)
    reads = []
    orig = torch.Tensor.tolist

    def counting(self):
        reads.append(tuple(self.shape))
        return orig(self)

    torch.Tensor.tolist = counting
    try:
        args = _layout_args(buf, inp, 8)
        n_layout = len(reads)
        import moe_ep.validate as V
        calls = []
        orig_check = V.check_dispatch_values
        V.check_dispatch_values = lambda *a, **k: calls.append(1) or orig_check(*a, **k)
        try:
            buf.dispatch(inp.x, **args)
            edited = dict(args, topk_weights=args["topk_weights"].clone())
            buf.dispatch(inp.x, **edited)  # same routing tensors: still no second check
            edited = dict(args, topk_idx=args["topk_idx"].clone())
            buf.dispatch(inp.x, **edited)  # another topk tensor: checked again
        finally:
            V.check_dispatch_values = orig_check
    finally:
        torch.Tensor.tolist = orig
    return n_layout, len(calls)


def test_input_checks_run_once_per_step_with_one_host_read():
    for n_layout, checks in launch(_count_host_reads, 2, timeout_s=60):
        assert n_layout == 1, "get_dispatch_layout's value checks should read the device once"
        assert checks == 1, f"dispatch re-checked the layout get_dispatch_layout had checked ({checks} checks)"


# ---------------------------------------------------------------------------------------------- 10: size hint
def test_low_latency_size_hint_fits_the_symm_layout_for_every_topk():
    import moe_ep
    from moe_ep.backends.symm import SymmBackend

    for t, h, r, e in [(8, 128, 2, 2), (4, 256, 4, 4), (128, 7168, 8, 8), (16, 1024, 8, 16), (128, 7168, 8, 256)]:
        hint = moe_ep.Buffer.get_low_latency_rdma_size_hint(t, h, r, e)
        for k in sorted({1, 2, min(e, 8), min(e, 32)}):  # the symm kernels take top-k up to 32
            assert hint >= SymmBackend.get_low_latency_size_hint(t, h, r, e, k), (t, h, r, e, k)


# ---------------------------------------------------------------------------------------------- 5: loud failure
def _combine_without_peer(rank, world):
    import moe_ep
    from moe_ep.backends.symm import SymmBackend

    buf = moe_ep.Buffer(None, backend="symm", low_latency_mode=True, timeout_s=1.0, provider="shm",
                        num_rdma_bytes=SymmBackend.get_low_latency_size_hint(8, 128, world, 8, 2))
    inp = make_rank_inputs(rank, 6, 128, 8, 2, seed=1, world_size=world)
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(inp.x, inp.topk_idx, 8, 8, use_fp8=False)
    if rank == 1:
        return "skipped the combine"
    out = torch.zeros(6, 128, dtype=torch.bfloat16)
    kind, msg, _ = outcome(lambda: buf.low_latency_combine(recv_x, inp.topk_idx, inp.topk_weights, handle, out=out))
    return kind, msg, bool(torch.isnan(out.float()).all())


def test_symm_timeout_poisons_the_combined_output():
    (kind, msg, all_nan), skipped = launch(_combine_without_peer, 2, timeout_s=120)
    assert skipped == "skipped the combine"
    assert kind == "RankTimeoutError" and "[1]" in msg, msg
    assert all_nan, "a combine that missed a rank must come out as NaN, never as plausible partial sums"


# ---------------------------------------------------------------------------------------------- 6: device flags
def _flags(rank, world, what):
    import moe_ep
    from moe_ep.backends.symm import SymmBackend

    buf = moe_ep.Buffer(None, backend="symm", timeout_s=5, provider="shm", check_inputs=False,
                        num_nvl_bytes=SymmBackend.get_normal_size_hint(8, 128, 2, world))
    inp = make_rank_inputs(rank, 6, 128, 8, 2, seed=1, world_size=world)
    if what == "bad_expert":
        idx = inp.topk_idx.clone()
        idx[0, 0] = 8 + rank  # >= num_experts; the host checks are off
        first = outcome(lambda: buf.get_dispatch_layout(idx, 8))
        second = outcome(lambda: buf.dispatch(inp.x, **_layout_args(buf, inp, 8)))
        return first[0], second[:2]
    args = _layout_args(buf, inp, 8)
    # one row of worst-case room: any rank receiving more must report it (the CPU guard or the device flag)
    return outcome(lambda: buf.dispatch(inp.x, num_worst_tokens=1, **args))[:2]


def test_expert_ids_out_of_range_with_checks_off_are_reported_not_silent():
    for first, (kind, msg) in launch(_flags, 2, "bad_expert", timeout_s=120):
        assert first == "ok"  # the layout itself reads nothing on the host
        assert kind == "RuntimeError" and "num_experts" in msg, msg


def test_more_rows_than_num_worst_tokens_is_reported():
    for kind, msg in launch(_flags, 2, "overflow", timeout_s=120):
        assert kind == "RuntimeError" and "num_worst_tokens" in msg, msg


# ---------------------------------------------------------------------------------------------- 8: UE8M0 scales
def _ue8m0_dispatch(rank, world, backend):
    import moe_ep
    from moe_ep.backends.symm import SymmBackend
    from moe_ep.fp8 import pack_ue8m0, per_token_group_quant_fp8_ref
    from moe_ep.testing.inputs import make_all_inputs
    from moe_ep.testing.refs import ref_dispatch

    H = 640  # 5 groups: the packed word count (2) is not H/512
    kw = {}
    if backend == "symm":
        kw = dict(provider="shm", num_nvl_bytes=SymmBackend.get_normal_size_hint(8, H, 2, world))
    buf = moe_ep.Buffer(None, backend=backend, timeout_s=30, **kw)
    inputs = make_all_inputs(world, [5, 3], H, 8, 2, seed=6)
    quant = [per_token_group_quant_fp8_ref(i.x, 128, round_scale=True) for i in inputs]
    packed = [(q, pack_ue8m0(s)) for q, s in quant]
    me = inputs[rank]
    args = _layout_args(buf, me, 8)
    (rq, rs), _, _, _, handle, _ = buf.dispatch(packed[rank], **args)
    assert rs.dtype == torch.int32 and rs.shape[1] == 2
    ex_q, *_ = ref_dispatch(rank, [q for q, _ in packed], [i.topk_idx for i in inputs],
                            [i.topk_weights for i in inputs], 8)
    ex_s, *_ = ref_dispatch(rank, [s.view(torch.float32) for _, s in packed], [i.topk_idx for i in inputs],
                            [i.topk_weights for i in inputs], 8)  # the words move as they are: bit views
    assert torch.equal(rq.view(torch.uint8), ex_q.view(torch.uint8))
    assert torch.equal(rs, ex_s.view(torch.int32))
    (cq, cs) = buf.dispatch(packed[rank], handle=handle)[0]  # cached dispatch keeps the scale dtype
    assert torch.equal(cs, rs)
    return True


@pytest.mark.parametrize("backend", ["torch", "symm"])
def test_normal_dispatch_accepts_packed_ue8m0_scales(backend):
    assert launch(_ue8m0_dispatch, 2, backend, timeout_s=120) == [True, True]


# ---------------------------------------------------------------------------------------------- 1 on symm (device)
def _symm_ll_mismatch(rank, world, what, backend="symm"):
    import moe_ep
    from moe_ep.backends.nvshmem import NvshmemBackend
    from moe_ep.backends.symm import SymmBackend

    if backend == "symm":
        buf = moe_ep.Buffer(None, backend="symm", low_latency_mode=True, timeout_s=10, provider="shm",
                            num_rdma_bytes=SymmBackend.get_low_latency_size_hint(8, 256, world, 8, 3))
    else:  # the signature travels as the payload of the put-with-signal (emulated NVSHMEM)
        buf = moe_ep.Buffer(None, 0, NvshmemBackend.get_low_latency_size_hint(8, 256, world, 8, 3), True,
                            backend="nvshmem", timeout_s=10)
    hidden = 256 if (what == "hidden" and rank == 0) else 128
    k = 3 if (what == "topk" and rank == 1) else 2
    inp = make_rank_inputs(rank, 5, hidden, 8, k, seed=2, world_size=world)
    t0 = time.monotonic()
    try:
        buf.low_latency_dispatch(inp.x, inp.topk_idx, 8, 8, use_fp8=False)
        return "ok", "", time.monotonic() - t0
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc), time.monotonic() - t0


@pytest.mark.parametrize("what,backend", [("hidden", "symm"), ("topk", "symm"), ("topk", "nvshmem")])
def test_symm_low_latency_ranks_that_disagree_all_raise_naming_the_field(what, backend):
    for kind, msg, secs in launch(_symm_ll_mismatch, 2, what, backend, timeout_s=120):
        assert kind == "CallMismatchError", msg
        field = "hidden" if what == "hidden" else "top-k"
        assert field in msg and "rank 0=" in msg and "rank 1=" in msg, msg
        assert secs < 8, "detected on the device at the receive, not by a timeout"


def _symm_normal_mismatch(rank, world):
    import moe_ep
    from moe_ep.backends.symm import SymmBackend

    buf = moe_ep.Buffer(None, backend="symm", timeout_s=10, provider="shm",
                        num_nvl_bytes=SymmBackend.get_normal_size_hint(8, 256, 2, world))
    hidden = 256 if rank == 0 else 128
    inp = make_rank_inputs(rank, 5, hidden, 8, 2, seed=2, world_size=world)
    return outcome(lambda: buf.dispatch(inp.x, **_layout_args(buf, inp, 8)))


def test_symm_normal_ranks_with_different_hidden_all_raise_naming_the_field():
    for kind, msg, secs in launch(_symm_normal_mismatch, 2, timeout_s=120):
        assert kind == "CallMismatchError", msg
        assert "hidden: rank" in msg and "rank 0=256" in msg and "rank 1=128" in msg, msg
        assert secs < 8


# ---------------------------------------------------------------------------------------------- 5: trap opt-in
TRAP_SCRIPT = r'''
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moe_ep.kernels import intranode as k

sig = {"counts_ptr": "*i32", "signal_ptrs": "*i64", "status_ptr": "*i32", "rank": "i32", "timeout_ns": "i64",
       "FULL": "constexpr", "META": "constexpr"}
ptx = triton.compile(ASTSource(k._recv_counts_kernel, sig, {"FULL": 0, "META": -1}), target=GPUTarget("cuda", 90, 32)).asm["ptx"]
print(json.dumps({"trap": ptx.count("trap;")}))
'''


def test_trap_on_error_compiles_a_guarded_trap_into_the_waits():
    from moe_ep.testing.sm90 import compile_in_subprocess

    out = compile_in_subprocess(TRAP_SCRIPT, [], "the trap opt-in")
    assert out["trap"] >= 1, "no trap instruction behind the STATUS_TRAP guard"


def _trap_flag(rank, world):
    import moe_ep
    from moe_ep.backends.symm import SymmBackend

    buf = moe_ep.Buffer(None, backend="symm", low_latency_mode=True, provider="shm", trap_on_error=True,
                        num_rdma_bytes=SymmBackend.get_low_latency_size_hint(4, 128, world, 4, 2))
    flags = [int(b.status[2]) for b in buf._impl._buffers]
    refused = outcome(lambda: moe_ep.Buffer(None, backend="torch", trap_on_error=True))
    return flags, refused[0]


def test_trap_on_error_sets_the_status_flag_and_is_symm_only():
    for flags, refused in launch(_trap_flag, 2, timeout_s=60):
        assert flags and all(f == 1 for f in flags)
        assert refused == "ValueError"
