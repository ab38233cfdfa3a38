"""Low-latency path of the ``symm`` backend (moe_ep.backends.symm_ll + moe_ep.kernels.low_latency).

Virtual ranks (one process, phases launched rank by rank: the interpreter on CPU, compiled on a GPU
machine) and forked CPU ranks over shm (real concurrency, interpreter only); every output bitwise
against moe_ep.testing.refs. Also: timeouts naming the silent rank, capacity errors before any kernel,
buffer size vs DeepEP, sm90 compilation of every kernel (PTX checks), and on a GPU (``gpu`` marker) a
CUDA-graph capture/replay and DeepSeek-V3 decode shapes.

On a GPU machine: ``pytest tests/test_symm_ll.py`` (compiled) and
``TRITON_INTERPRET=1 pytest tests/test_symm_ll.py -m "not gpu"`` (the forked CPU ranks).
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from moe_ep import RankTimeoutError
from moe_ep.backends.symm_ll import (
    SymmLowLatency,
    deepep_ll_buffer_bytes,
    ll_buffer_bytes,
    virtual_low_latency_step,
)
from moe_ep.symm import create_symm_buffer, create_virtual_symm_buffers
from moe_ep.testing.sm90 import compile_in_subprocess
from moe_ep.testing import assert_bitwise_equal, launch
from moe_ep.testing.inputs import make_all_inputs
from moe_ep.testing.refs import ref_low_latency_combine, ref_low_latency_dispatch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Virtual ranks: the interpreter on CPU here; on a GPU machine (no TRITON_INTERPRET) the same cases run compiled.
DEV = torch.device("cpu") if INTERPRET else torch.device("cuda")
# Forked CPU ranks (shm provider) need the interpreter: on a GPU machine run `TRITON_INTERPRET=1 pytest -m "not gpu"`.
cpu_ranks = pytest.mark.skipif(not INTERPRET, reason="CPU ranks run kernels in the Triton interpreter (TRITON_INTERPRET=1)")
gpu_compiled = pytest.mark.skipif(INTERPRET, reason="compiled kernels on a GPU (TRITON_INTERPRET is set)")

FORMATS = {  # name: (use_fp8, round_scale, use_ue8m0)
    "bf16": (False, False, False),
    "fp8": (True, False, False),
    "fp8_rs": (True, True, False),
    "ue8m0": (True, True, True),
}


def _inputs(world, n, hidden, E, K, seed, routing="random", empty_token=True):
    inputs = make_all_inputs(world, n, hidden, E, K, seed, routing)
    if empty_token and inputs[0].topk_idx.shape[0] > 1:
        inputs[0].topk_idx[1] = -1  # a token with no expert: combines to zeros
    return inputs


def _expert_outputs(rank, xs, idxs, T, E):
    """Rank ``rank``'s stand-in expert outputs in the masked layout: its BF16 received rows times rank + 1."""
    ref = ref_low_latency_dispatch(rank, xs, idxs, T, E, use_fp8=False)[0]
    return (ref.float() * (rank + 1)).to(torch.bfloat16)


def _check_dispatch(rank, res, xs, idxs, T, E, fmt):
    use_fp8, rs, ue = FORMATS[fmt]
    ex_x, ex_s, ex_count, _ = ref_low_latency_dispatch(rank, xs, idxs, T, E, use_fp8, rs, ue)
    R, H = len(xs), xs[0].shape[1]
    L = E // R
    assert tuple(res.recv_x.shape) == (L, R * T, H)
    assert res.recv_x.dtype == (torch.float8_e4m3fn if use_fp8 else torch.bfloat16)
    assert_bitwise_equal(res.recv_count, ex_count, f"rank {rank} recv_count")
    if use_fp8:
        s = res.recv_x_scales
        assert s.dtype == (torch.int32 if ue else torch.float32)
        assert tuple(s.shape) == (L, R * T, (H // 128 + 3) // 4 if ue else H // 128)
        assert s.stride(1) == 1 and s.stride(2) % 4 == 0 and s.stride(2) >= R * T
    else:
        assert res.recv_x_scales is None
    for e in range(L):
        c = int(ex_count[e])
        assert_bitwise_equal(res.recv_x[e, :c], ex_x[e, :c], f"rank {rank} recv_x expert {e}")
        if use_fp8:
            assert_bitwise_equal(res.recv_x_scales[e, :c], ex_s[e, :c], f"rank {rank} scales expert {e}")
    return ex_count


def _check_combine(rank, out, ys, idxs, ws, T, E):
    """Bitwise, except that NaN payloads only have to sit in the same places (torch's own CPU / CUDA casts
    to bf16 disagree on them)."""
    expected, out = ref_low_latency_combine(rank, ys, idxs, ws, T, E), out.cpu()
    assert_bitwise_equal(out.isnan(), expected.isnan(), f"rank {rank} combined_x NaN positions")
    assert_bitwise_equal(out.masked_fill(out.isnan(), 0), expected.masked_fill(expected.isnan(), 0),
                         f"rank {rank} combined_x")


def _virtual(world, T, hidden, E, K, timeout_s=10.0, transport="symm"):
    if transport == "nvshmem":  # every peer remote: emulated NVSHMEM puts (CPU only)
        from moe_ep.backends.nvshmem import nvshmem_ll_size_hint, virtual_nvshmem_paths

        paths = virtual_nvshmem_paths(world, nvshmem_ll_size_hint(T, hidden, world, E, K), owner=7, timeout_s=timeout_s)
        return [p.symm for p in paths], paths
    nbytes = SymmLowLatency.size_hint(T, hidden, world, E, K)
    bufs = create_virtual_symm_buffers(world, nbytes, SymmLowLatency.num_signals(world), device=DEV, timeout_s=timeout_s)
    return bufs, [SymmLowLatency(b, owner=7) for b in bufs]


def _dev(ts):
    return [t.to(DEV) for t in ts]


# ---------------------------------------------------------------------- virtual ranks
VIRTUAL_CASES = [
    # world, tokens per rank, hidden, experts, topk, T, routing, formats of consecutive steps
    (2, 5, 256, 8, 4, 8, "random", ["bf16", "fp8", "ue8m0"]),
    (2, [1, 4], 384, 4, 3, 4, "random", ["ue8m0", "fp8_rs"]),  # G = 3: a padded UE8M0 word; K not a power of 2
    (4, [3, 9, 1, 0], 128, 16, 8, 12, "skip_last_rank", ["fp8_rs", "bf16"]),  # 0 tokens; a rank receiving nothing
    (4, 6, 256, 8, 2, 6, "one_expert", ["fp8", "bf16"]),  # every token to expert 0; N = T
    (2, 3, 128, 2, 1, 3, "random", ["ue8m0"]),  # K = 1, one expert per rank, a single scale group
    (2, 0, 256, 4, 2, 1, "random", ["fp8", "bf16"]),  # nobody sends anything, T = 1
    (3, [2, 1, 2], 130, 6, 5, 2, "random", ["bf16"]),  # BF16 hidden not a multiple of 128
]


@pytest.mark.parametrize("transport", ["symm", pytest.param("nvshmem", marks=pytest.mark.skipif(
    DEV.type != "cpu", reason="the emulated NVSHMEM calls run under the interpreter"))])
@pytest.mark.parametrize("world,n,hidden,E,K,T,routing,fmts", VIRTUAL_CASES,
                         ids=[f"R{c[0]}-N{c[1]}-H{c[2]}-E{c[3]}-K{c[4]}-{c[6]}" for c in VIRTUAL_CASES])
def test_virtual_ranks_steps(world, n, hidden, E, K, T, routing, fmts, transport):
    bufs, paths = _virtual(world, T, hidden, E, K, transport=transport)
    L = E // world
    stats = [torch.zeros(L, dtype=torch.int32, device=DEV) for _ in range(world)]
    expected_stats = [torch.zeros(L, dtype=torch.int32) for _ in range(world)]
    for step, fmt in enumerate(fmts):
        inputs = _inputs(world, n, hidden, E, K, 31 + step, routing)
        xs, idxs, ws = [i.x for i in inputs], [i.topk_idx for i in inputs], [i.topk_weights for i in inputs]
        ys = [_expert_outputs(r, xs, idxs, T, E) for r in range(world)]
        use_fp8, rs, ue = FORMATS[fmt]
        ys_d = _dev(ys)
        results, outs = virtual_low_latency_step(paths, _dev(xs), _dev(idxs), _dev(ws), T, E, use_fp8=use_fp8,
                                                 round_scale=rs, use_ue8m0=ue, expert_fn=lambda r, _res: ys_d[r],
                                                 stats=stats)
        for r in range(world):
            expected_stats[r] += _check_dispatch(r, results[r], xs, idxs, T, E, fmt)
            assert_bitwise_equal(stats[r], expected_stats[r], f"rank {r} cumulative stats")
            _check_combine(r, outs[r], ys, idxs, ws, T, E)
            if inputs[r].topk_idx.shape[0] > 1 and r == 0:
                assert not bool(outs[r][1].any())  # the token with no expert
        for b in bufs:  # idle again: the next step (or a graph replay) starts from zeros
            assert int(b.signals.abs().sum()) == 0 and int(b.status[0]) == 0


@pytest.mark.parametrize("fmt", ["fp8", "ue8m0", "bf16"])
def test_virtual_nan_inf_positions(fmt):
    """NaN / inf in a token's group: scales and FP8 bytes as moe_ep.fp8 gives them; NaN in an expert output
    reaches exactly the tokens that selected that row (bf16 NaN bits as torch's cast)."""
    world, T, hidden, E, K = 2, 4, 256, 4, 2
    bufs, paths = _virtual(world, T, hidden, E, K)
    inputs = _inputs(world, [3, 2], hidden, E, K, 77, empty_token=False)
    inputs[0].x[0, 5] = float("nan")
    inputs[0].x[1, 200] = float("inf")
    inputs[1].x[1, 0] = -float("inf")
    xs, idxs, ws = [i.x for i in inputs], [i.topk_idx for i in inputs], [i.topk_weights for i in inputs]
    ys = [_expert_outputs(r, xs, idxs, T, E) for r in range(world)]
    ys[1][0, 0, 3] = float("nan")
    ys_d = _dev(ys)
    use_fp8, rs, ue = FORMATS[fmt]
    results, outs = virtual_low_latency_step(paths, _dev(xs), _dev(idxs), _dev(ws), T, E, use_fp8=use_fp8,
                                             round_scale=rs, use_ue8m0=ue, expert_fn=lambda r, _res: ys_d[r])
    for r in range(world):
        _check_dispatch(r, results[r], xs, idxs, T, E, fmt)
        _check_combine(r, outs[r], ys, idxs, ws, T, E)


def test_virtual_two_in_flight_return_hook_order():
    """Two micro-batches: both sends before either receive (double buffering), zero-copy combine, and
    a caller-provided ``out``."""
    world, T, hidden, E, K = 2, 4, 256, 8, 4
    bufs, paths = _virtual(world, T, hidden, E, K)
    batches = [_inputs(world, [3, 4], hidden, E, K, 70), _inputs(world, [4, 0], hidden, E, K, 71)]
    fmts = ["fp8", "bf16"]
    states = []
    for b, fmt in zip(batches, fmts):
        use_fp8, rs, ue = FORMATS[fmt]
        states.append([p.dispatch_send(i.x.to(DEV), i.topk_idx.to(DEV), T, E, use_fp8=use_fp8, round_scale=rs,
                                       use_ue8m0=ue)
                       for p, i in zip(paths, b)])
    results = [[p.dispatch_recv(s) for p, s in zip(paths, st)] for st in states]
    cstates = []
    for m, b in enumerate(batches):
        xs, idxs = [i.x for i in b], [i.topk_idx for i in b]
        for r in range(world):
            _check_dispatch(r, results[m][r], xs, idxs, T, E, fmts[m])
        ys = [_expert_outputs(r, xs, idxs, T, E) for r in range(world)]
        row = []
        for r, p in enumerate(paths):
            buf = p.get_next_low_latency_combine_buffer(results[m][r].handle)
            buf.copy_(ys[r])
            out = torch.full((b[r].x.shape[0], hidden), float("nan"), dtype=torch.bfloat16, device=DEV)
            row.append(p.combine_send(buf, b[r].topk_idx.to(DEV), b[r].topk_weights.to(DEV), results[m][r].handle,
                                      zero_copy=True, out=out))
        cstates.append((row, ys))
    for m, (row, ys) in enumerate(cstates):
        b = batches[m]
        for r, p in enumerate(paths):
            out = p.combine_recv(row[r])
            assert out is row[r].out
            _check_combine(r, out, ys, [i.topk_idx for i in b], [i.topk_weights for i in b], T, E)
    for b in bufs:
        assert int(b.signals.abs().sum()) == 0


def test_virtual_receive_before_send_names_rank():
    bufs, paths = _virtual(2, 4, 128, 4, 2, timeout_s=0.3)
    inputs = _inputs(2, 3, 128, 4, 2, 5)
    st = paths[0].dispatch_send(inputs[0].x.to(DEV), inputs[0].topk_idx.to(DEV), 4, 4, use_fp8=False, round_scale=False,
                                use_ue8m0=False)
    with pytest.raises(RankTimeoutError) as info:  # rank 1 never sent
        paths[0].dispatch_recv(st)
        if DEV.type == "cuda":  # GPU status checks are non-blocking: force it
            torch.cuda.synchronize()
            bufs[0].check_status("test", blocking=True)
    assert info.value.missing_ranks == [1] and "rank(s) [1]" in str(info.value)


def test_capacity_checked_before_any_kernel():
    world, T, hidden, E, K = 2, 8, 256, 8, 4
    need = SymmLowLatency.size_hint(T, hidden, world, E, K)
    bufs = create_virtual_symm_buffers(world, need - 256, SymmLowLatency.num_signals(world), timeout_s=0.3)
    path = SymmLowLatency(bufs[0], owner=1)
    x = torch.zeros(3, hidden, dtype=torch.bfloat16)
    idx = torch.zeros(3, K, dtype=torch.int64)
    with pytest.raises(ValueError, match=f"num_rdma_bytes >= {need}"):
        path.dispatch_send(x, idx, T, E, use_fp8=True, round_scale=False, use_ue8m0=False)
    ok = SymmLowLatency(create_virtual_symm_buffers(world, need, SymmLowLatency.num_signals(world))[0], owner=1)
    with pytest.raises(ValueError, match="num_rdma_bytes"):  # more tokens per rank than the buffer was sized for
        ok.dispatch_send(torch.zeros(3, hidden, dtype=torch.bfloat16), idx, 2 * T, E, use_fp8=False, round_scale=False,
                         use_ue8m0=False)
    with pytest.raises(ValueError, match="num_rdma_bytes"):  # wider hidden
        ok.dispatch_send(torch.zeros(3, 2 * hidden, dtype=torch.bfloat16), idx, T, E, use_fp8=False,
                         round_scale=False, use_ue8m0=False)
    assert int(bufs[0].signals.abs().sum()) == 0 and int(bufs[0].status[0]) == 0  # nothing ran


def test_buffer_memory_vs_deepep():
    """DeepSeek-V3 decode shapes (T=128, hidden 7168, 256 experts, top-8): bytes per rank."""
    T, H, E, K = 128, 7168, 256, 8
    deepep = deepep_ll_buffer_bytes(T, H, 8, E)
    assert 1.8e9 < deepep < 2.0e9  # ~1.9 GB, independent of the number of ranks
    for world in (8, 16, 32):
        ours = ll_buffer_bytes(T, H, world, E, K)
        assert ours <= deepep, (world, ours, deepep)
    assert ll_buffer_bytes(T, H, 8, E, K) < 60e6  # 58.9 MB at EP8 (two slots of messages + combine rows)


# ---------------------------------------------------------------------- real processes (shm)
def _rank_steps(rank, world, n, hidden, E, K, T, routing, fmts, seed, transport="symm"):
    symm, path = _process_path(world, T, hidden, E, K, 30, 3, transport)
    stats = torch.zeros(E // world, dtype=torch.int32)
    for step, fmt in enumerate(fmts):
        inputs = _inputs(world, n, hidden, E, K, seed + step, routing)
        xs, idxs, ws = [i.x for i in inputs], [i.topk_idx for i in inputs], [i.topk_weights for i in inputs]
        use_fp8, rs, ue = FORMATS[fmt]
        me = inputs[rank]
        state = path.dispatch_send(me.x, me.topk_idx, T, E, use_fp8=use_fp8, round_scale=rs, use_ue8m0=ue)
        time.sleep(0.02 * ((rank + step) % world))  # return-hook style: the receive runs later, skewed per rank
        res = path.dispatch_recv(state, stats)
        assert res is state.result
        _check_dispatch(rank, res, xs, idxs, T, E, fmt)
        ys = [_expert_outputs(r, xs, idxs, T, E) for r in range(world)]
        cstate = path.combine_send(ys[rank], me.topk_idx, me.topk_weights, res.handle)
        time.sleep(0.02 * ((world - rank + step) % world))
        out = path.combine_recv(cstate)
        _check_combine(rank, out, ys, idxs, ws, T, E)
    # Every rank has finished its last receive: all signals must be idle (what a graph replay needs).
    symm.barrier("ll test end")
    assert int(symm.signals.abs().sum()) == 0, symm.signals
    return True


def _process_path(world, T, hidden, E, K, timeout_s, owner, transport):
    """This forked rank's low-latency path: ``symm`` over a shm buffer, or the NVSHMEM transport over the emulated
    calls (deferred order: non-blocking puts land only at ``quiet``, in reverse) with every peer remote."""
    if transport == "nvshmem":
        from moe_ep.backends.nvshmem import _emulated_heap, nvshmem_ll_size_hint
        from moe_ep.kernels import nvshmem_device

        nvshmem_device.set_emulation_order("deferred")
        symm = _emulated_heap(None, torch.distributed.get_rank(), world, nvshmem_ll_size_hint(T, hidden, world, E, K),
                              SymmLowLatency.num_signals(world), timeout_s, 1)
        return symm, SymmLowLatency(symm, owner=owner, transport=1)
    symm = create_symm_buffer(None, SymmLowLatency.size_hint(T, hidden, world, E, K), SymmLowLatency.num_signals(world),
                              timeout_s=timeout_s)
    return symm, SymmLowLatency(symm, owner=owner)


PROCESS_CASES = [
    (2, [4, 1], 256, 8, 4, 4, "random", ["bf16", "ue8m0", "fp8"]),
    (3, [2, 0, 5], 128, 6, 2, 5, "random", ["fp8_rs", "bf16"]),
    (4, [3, 6, 0, 2], 128, 16, 8, 6, "skip_last_rank", ["fp8", "bf16"]),
    pytest.param(8, [1, 2, 0, 3, 1, 0, 2, 1], 128, 16, 4, 3, "random", ["fp8"], marks=pytest.mark.slow),  # 8 ranks
]


@cpu_ranks
@pytest.mark.parametrize("transport", ["symm", "nvshmem"])
@pytest.mark.parametrize("world,n,hidden,E,K,T,routing,fmts", PROCESS_CASES,
                         ids=[f"R{c[0]}-H{c[2]}-E{c[3]}-K{c[4]}-{c[6]}"
                              for c in (getattr(c, "values", c) for c in PROCESS_CASES)])
def test_processes(world, n, hidden, E, K, T, routing, fmts, transport):
    if transport == "nvshmem" and world > 4:
        pytest.skip("the nvshmem transport's process runs stop at 4 ranks (suite time); virtual ranks cover more")
    assert launch(_rank_steps, world, n, hidden, E, K, T, routing, fmts, 90 + world, transport,
                  timeout_s=240) == [True] * world


def _rank_two_in_flight(rank, world, steps, transport="symm"):
    """Two micro-batches per step with real concurrency: send A, send B, receive A, receive B (dispatch and
    combine), no host barrier between steps, per-rank skew."""
    T, hidden, E, K = 4, 128, 2 * world, 3
    symm, path = _process_path(world, T, hidden, E, K, 30, 0, transport)
    for step in range(steps):
        batches = [_inputs(world, [(r + step + m) % (T + 1) for r in range(world)], hidden, E, K, 500 + 2 * step + m)
                   for m in range(2)]
        fmts = ["ue8m0", "bf16"] if step % 2 == 0 else ["bf16", "fp8"]
        states = [path.dispatch_send(b[rank].x, b[rank].topk_idx, T, E, use_fp8=FORMATS[f][0], round_scale=FORMATS[f][1],
                                     use_ue8m0=FORMATS[f][2]) for b, f in zip(batches, fmts)]
        time.sleep(0.01 * rank)
        results = [path.dispatch_recv(st) for st in states]
        cstates, all_ys = [], []
        for m, b in enumerate(batches):
            xs, idxs = [i.x for i in b], [i.topk_idx for i in b]
            _check_dispatch(rank, results[m], xs, idxs, T, E, fmts[m])
            ys = [_expert_outputs(r, xs, idxs, T, E) for r in range(world)]
            all_ys.append(ys)
            cstates.append(path.combine_send(ys[rank], b[rank].topk_idx, b[rank].topk_weights, results[m].handle))
        time.sleep(0.01 * (world - rank))
        for m, b in enumerate(batches):
            out = path.combine_recv(cstates[m])
            _check_combine(rank, out, all_ys[m], [i.topk_idx for i in b], [i.topk_weights for i in b], T, E)
    symm.barrier("two in flight end")
    assert int(symm.signals.abs().sum()) == 0, symm.signals
    return True


@cpu_ranks
@pytest.mark.parametrize("transport", ["symm", "nvshmem"])
def test_processes_two_micro_batches_in_flight(transport):
    assert launch(_rank_two_in_flight, 3, 3, transport, timeout_s=240) == [True] * 3


def _rank_silent(rank, world, transport="symm"):
    # The live ranks start their sends together (the barrier, which the silent rank joins too and then calls
    # nothing) and wait up to 5 s for each other: the interpreted send of a live rank takes well under that even on
    # a loaded machine, so only the silent rank is named.
    T, hidden, E, K = 4, 128, 2 * world, 2
    symm, path = _process_path(world, T, hidden, E, K, 5.0, 0, transport)
    torch.distributed.barrier()
    if rank == world - 1:
        return "silent"
    me = _inputs(world, 3, hidden, E, K, 11)[rank]
    state = path.dispatch_send(me.x, me.topk_idx, T, E, use_fp8=True, round_scale=False, use_ue8m0=False)
    try:
        path.dispatch_recv(state)
    except RankTimeoutError as exc:
        return exc.missing_ranks
    return None


@cpu_ranks
@pytest.mark.parametrize("transport", ["symm", "nvshmem"])
def test_processes_silent_rank_is_named(transport):
    assert launch(_rank_silent, 3, transport, timeout_s=60) == [[2], [2], "silent"]


# ---------------------------------------------------------------------- sm90 compilation
COMPILE_SCRIPT = r'''
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moe_ep.backends.symm_ll import _hdr
from moe_ep.kernels import low_latency as ll

SIG = ll.signal_layout(8)
H, K = 7168, 8
PTRS = {"x_ptr": "*bf16", "topk_ptr": "*i64", "buffer_ptrs": "*i64", "signal_ptrs": "*i64", "status_ptr": "*i32",
        "buf_ptr": "*u8", "recv_x_ptr": "*u8", "recv_s_ptr": "*i32", "recv_count_ptr": "*i32", "stats_ptr": "*i32",
        "slot_row_ptr": "*i32", "recv_tokens_ptr": "*i32", "stamp_ptr": "*i32", "w_ptr": "*fp32",
        "out_ptr": "*i16",
        "wait_stats_ptr": "*i64"}
I64 = ("timeout_ns", "cnt_off", "msg_off", "comb_off", "stride_xl", "stride_xr", "stride_sl", "stride_sg")
# What a launch specialises: ints and pointers divisible by 16 carry tt.divisibility (these are).
DIV16 = ("cnt_off", "msg_off", "comb_off", "stride_xl", "stride_xr", "stride_sl", "stride_sg", "T")


def variant(name, fp_fusion=True, ptrs=None, **const):
    kern = getattr(ll, name)
    names = kern.arg_names
    for prm in kern.params:  # constexprs with a default (TRANSPORT, CH, ...) take it
        if prm.is_constexpr and prm.has_default and prm.name not in const:
            const[prm.name] = prm.default
    types = dict(PTRS, **(ptrs or {}))
    sig = {n: "constexpr" if n in const else types.get(n, "i64" if n in I64 else "i32") for n in names}
    for n in const:
        if n.startswith(("DISP_", "COMB_")):
            const[n] = SIG[n]
    if "HDR" in const:  # the header offset the launcher passes for this payload
        const["HDR"] = _hdr(H, const["IS_FP8"])
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if sig[n] != "constexpr" and (sig[n].startswith("*") or n in DIV16)}
    try:
        src = ASTSource(kern, sig, const, attrs)
    except TypeError as exc:
        return {"skip": str(exc)}
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "enable_fp_fusion": fp_fusion})
    ops = {}
    ptx = ck.asm["ptx"]
    pattern = (r"\b(st\.global(?:\.v\d)?\.b\d+|ld\.global(?:\.v\d)?\.b\d+|cvt\.rn\.satfinite\.e4m3x2\.f32"
               r"|div\.rn\.f32|fma\.rn\.f32)")
    for m in re.findall(pattern, ptx):
        ops[m] = ops.get(m, 0) + 1
    # Qualifier order differs between Triton versions: count instruction lines by their qualifiers.
    lines = [ln.split("//")[0] for ln in ptx.splitlines()]
    ops["acquire.sys"] = sum(1 for ln in lines if ".acquire" in ln and ".sys" in ln)
    ops["release.sys"] = sum(1 for ln in lines if ".release" in ln and ".sys" in ln)
    ops["fence.sys"] = sum(1 for ln in lines if "fence." in ln and ".sys" in ln)
    ops["relaxed.sys"] = sum(1 for ln in lines if "atom" in ln and ".relaxed" in ln and ".sys" in ln)
    ops["barrier"] = sum(1 for ln in lines if "bar.sync" in ln or "barrier.sync" in ln)
    return ops


SEND = dict(H=H, K=K, KP=8, MSG=14400, HDR=14336, BLOCK_T=2, CHUNK_T=32, BLOCK_E=64, GC=8, HC=2048,
            DISP_BUSY=0, DISP_FULL=0, DISP_SEND_CNT=0)
RECV = dict(H=H, K=K, KP=8, MSG=14400, HDR=14336, BLOCK_T=4, HC=2048, RP=8, LP=32, DISP_BUSY=0, DISP_FULL=0,
            DISP_RECV_CNT=0, HAS_WAIT_STATS=False)
CSEND = dict(H=H, K=K, KP=8, BLOCK_T=2, HC=1024, COMB_BUSY=0, COMB_FULL=0, COMB_SEND_CNT=0)
CRECV = dict(H=H, K=K, BLOCK_T=2, HC=1024, COMB_BUSY=0, COMB_FULL=0, COMB_RECV_CNT=0, HAS_WAIT_STATS=False)
CASES = {
    "send_fp8_native": lambda: variant("_ll_dispatch_send_kernel", IS_FP8=True, ROUND_SCALE=False, USE_UE8M0=False,
                                       NATIVE_FP8=True, **SEND),
    "send_fp8_soft": lambda: variant("_ll_dispatch_send_kernel", IS_FP8=True, ROUND_SCALE=False, USE_UE8M0=False,
                                     NATIVE_FP8=False, **SEND),
    "send_ue8m0_native": lambda: variant("_ll_dispatch_send_kernel", IS_FP8=True, ROUND_SCALE=True, USE_UE8M0=True,
                                         NATIVE_FP8=True, **SEND),
    "send_bf16": lambda: variant("_ll_dispatch_send_kernel", ptrs={"x_ptr": "*i16"}, IS_FP8=False, ROUND_SCALE=False,
                                 USE_UE8M0=False, NATIVE_FP8=False, **SEND),
    "recv_fp8": lambda: variant("_ll_dispatch_recv_kernel", SW=56, SWP=64, IS_FP8=True, HAS_STATS=True, **RECV),
    "recv_bf16": lambda: variant("_ll_dispatch_recv_kernel", ptrs={"recv_x_ptr": "*i16"}, SW=1, SWP=1, IS_FP8=False,
                                 HAS_STATS=False, **dict(RECV, HC=1024)),
    "combine_send": lambda: variant("_ll_combine_send_fmt_kernel", ptrs={"x_ptr": "*i16"}, FMT=0, IN_F16=False,
                                    NATIVE_FP8=False, **CSEND),
    "combine_recv": lambda: variant("_ll_combine_recv_fmt_kernel", fp_fusion=False, FMT=0, OUT_F16=False, **CRECV),
    "combine_recv_fused": lambda: variant("_ll_combine_recv_fmt_kernel", fp_fusion=True, FMT=0, OUT_F16=False,
                                          **CRECV),
}
print(json.dumps({k: CASES[k]() for k in json.loads(sys.argv[1])}))
'''

COMPILE_CASES = ["send_fp8_native", "send_fp8_soft", "send_ue8m0_native", "send_bf16", "recv_fp8", "recv_bf16",
                 "combine_send", "combine_recv", "combine_recv_fused"]


@pytest.fixture(scope="module")
def compiled():
    return compile_in_subprocess(COMPILE_SCRIPT, COMPILE_CASES, "the low-latency kernels")


@pytest.mark.slow  # an sm90 ahead-of-time compile (the sm90 report covers every shipped configuration; CI runs -m slow)
@pytest.mark.parametrize("case", COMPILE_CASES)
def test_compiles_for_sm90(compiled, case):
    ops = compiled[case]
    # Signals: acquire loads (waits) and releases (publishing) at system scope, CTA barriers around them. A receive
    # releases its sources with the release pattern (one fence, then relaxed system-scope stores: release_peers).
    assert ops["acquire.sys"] > 0, ops
    if case.startswith("recv"):
        assert ops["fence.sys"] > 0 and ops["relaxed.sys"] > 0, ops
    else:
        assert ops["release.sys"] > 0, ops
    assert ops["barrier"] > 0, ops
    vec_st = ops.get("st.global.v4.b32", 0) + ops.get("st.global.v2.b32", 0)
    if case.startswith("send"):
        assert (ops.get("cvt.rn.satfinite.e4m3x2.f32", 0) > 0) == case.endswith("native"), ops
        assert vec_st > 0 and ops.get("st.global.b8", 0) == 0, f"payload not stored as vectors: {ops}"
        if case.startswith("send_fp8"):
            assert ops.get("div.rn.f32", 0) > 0, f"x / scale must be IEEE division: {ops}"
    if case.startswith(("recv", "combine")):
        assert ops.get("st.global.v4.b32", 0) > 0, f"rows not copied as 16-byte vectors: {ops}"
    if case == "combine_recv":
        assert ops.get("fma.rn.f32", 0) == 0, f"w * y + acc must not contract to an FMA: {ops}"
    if case == "combine_recv_fused":  # proves the check above can fail
        assert ops.get("fma.rn.f32", 0) > 0, ops


# ---------------------------------------------------------------------- CUDA graph (GPU only)
@pytest.mark.gpu
@gpu_compiled
@pytest.mark.parametrize("fmt", ["ue8m0", "bf16"])
def test_cuda_graph_capture_and_replay_virtual_ranks(fmt):
    """Capture dispatch send+recv and combine send+recv of 4 virtual ranks on one GPU in one CUDA graph, then
    replay it with new inputs copied into the captured tensors; every replay is checked against the refs."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dev = torch.device("cuda")
    world, T, hidden, E, K = 4, 16, 512, 16, 4
    use_fp8, rs, ue = FORMATS[fmt]
    bufs = create_virtual_symm_buffers(world, SymmLowLatency.size_hint(T, hidden, world, E, K),
                                       SymmLowLatency.num_signals(world), device=dev, timeout_s=10)
    paths = [SymmLowLatency(b, owner=0) for b in bufs]
    n = [T, 5, 0, 9]
    first = _inputs(world, n, hidden, E, K, 200)
    xs = [i.x.to(dev) for i in first]
    idxs = [i.topk_idx.to(dev) for i in first]
    ws = [i.topk_weights.to(dev) for i in first]
    ys = [torch.zeros(E // world, world * T, hidden, dtype=torch.bfloat16, device=dev) for _ in range(world)]
    outs = [torch.empty(x.shape[0], hidden, dtype=torch.bfloat16, device=dev) for x in xs]

    def step():
        return virtual_low_latency_step(paths, xs, idxs, ws, T, E, use_fp8=use_fp8, round_scale=rs, use_ue8m0=ue,
                                        expert_fn=lambda r, _res: ys[r], outs=outs)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up: compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for b in bufs:
        b.check_status("warm-up", blocking=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        results, combined = step()
    for rep in range(3):
        inputs = _inputs(world, n, hidden, E, K, 300 + rep)
        cx, cidx, cw = [i.x for i in inputs], [i.topk_idx for i in inputs], [i.topk_weights for i in inputs]
        cys = [_expert_outputs(r, cx, cidx, T, E) for r in range(world)]
        for r in range(world):
            xs[r].copy_(cx[r])
            idxs[r].copy_(cidx[r])
            ws[r].copy_(cw[r])
            ys[r].copy_(cys[r])
        graph.replay()
        torch.cuda.synchronize()
        for r, b in enumerate(bufs):
            b.check_status("graph replay", blocking=True)
            assert int(b.signals.abs().sum()) == 0
            _check_dispatch(r, results[r], cx, cidx, T, E, fmt)  # compares on the CPU
            _check_combine(r, combined[r], cys, cidx, cw, T, E)


@pytest.mark.gpu
@gpu_compiled
@pytest.mark.parametrize("fmt", ["fp8", "ue8m0", "bf16"])
def test_gpu_virtual_ranks_deepseek_shapes(fmt):
    """8 virtual ranks on one GPU at DeepSeek-V3 decode shapes (T=128, hidden 7168, 256 experts, top-8), compiled
    kernels (hardware e4m3 cast on sm90+), bitwise against the references; two steps (signals reset)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dev = torch.device("cuda")
    world, T, hidden, E, K = 8, 128, 7168, 256, 8
    use_fp8, rs, ue = FORMATS[fmt]
    bufs = create_virtual_symm_buffers(world, SymmLowLatency.size_hint(T, hidden, world, E, K),
                                       SymmLowLatency.num_signals(world), device=dev, timeout_s=10)
    paths = [SymmLowLatency(b, owner=0) for b in bufs]
    for step, n in enumerate(([T] * world, [T, 1, 0, 77, T, 5, 128, 64])):
        inputs = _inputs(world, n, hidden, E, K, 400 + step)
        xs, idxs, ws = [i.x for i in inputs], [i.topk_idx for i in inputs], [i.topk_weights for i in inputs]
        ys = [_expert_outputs(r, xs, idxs, T, E) for r in range(world)]
        ys_dev = [y.to(dev) for y in ys]
        results, outs = virtual_low_latency_step(
            paths, [x.to(dev) for x in xs], [i.to(dev) for i in idxs], [w.to(dev) for w in ws], T, E, use_fp8=use_fp8,
            round_scale=rs, use_ue8m0=ue, expert_fn=lambda r, _res: ys_dev[r])
        torch.cuda.synchronize()
        for r, b in enumerate(bufs):
            b.check_status("gpu step", blocking=True)
            assert int(b.signals.abs().sum()) == 0
            _check_dispatch(r, results[r], xs, idxs, T, E, fmt)
            _check_combine(r, outs[r], ys, idxs, ws, T, E)
