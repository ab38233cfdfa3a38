"""``moe_ep.ElasticBuffer`` (DeepEP V2 names) against single-process references: non-expanded and expanded
receive, BF16 and FP8, alignment 1 / 128, bias 0 / 1 / 2, CPU-synced and worst-case sizes, cached dispatch
without host reads, receive as a view (symm), the stream options under the stream-order checker, the training
pattern (autograd), bad input, both backends, 2 and 4 ranks (internals: tests/test_elastic_internals.py)."""

from __future__ import annotations

import contextlib

import time

import pytest
import torch

from moe_ep.testing import launch
from moe_ep.testing.inputs import make_all_inputs, make_elastic_buffer
from moe_ep.testing.refs import ref_combine, ref_dispatch, ref_routes

HIDDEN = 128
NUM_MAX = 8


def _make(backend: str, world: int, num_topk: int = 3, **kw):
    return make_elastic_buffer(backend, world, NUM_MAX, HIDDEN, num_topk, **kw)


def _ref_expand(recv_idx: torch.Tensor, num_local: int, alignment: int):
    """``(exp_src [rows], exp_k [rows], m_indices [rows], slot [M, K])`` by plain loops."""
    src, ks, m_idx = [], [], []
    slot = torch.full(recv_idx.shape, -1, dtype=torch.int64)
    for e in range(num_local):
        for i in range(recv_idx.shape[0]):
            for k in range(recv_idx.shape[1]):
                if int(recv_idx[i, k]) == e:
                    slot[i, k] = len(src)
                    src.append(i), ks.append(k), m_idx.append(e)
        while len(src) % alignment:
            src.append(-1), ks.append(0), m_idx.append(-1)
    return torch.tensor(src, dtype=torch.int64), torch.tensor(ks, dtype=torch.int64), \
        torch.tensor(m_idx, dtype=torch.int32), slot


def _y(seed: int, rank: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randn(rows, HIDDEN, generator=g).to(torch.bfloat16)


def _w(seed: int, rank: int, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100 + 50 + rank)
    return torch.rand(*shape, generator=g)


def _check_case(eb, rank, world, num_experts, case, seed, tokens):
    """One dispatch + combine (+ a cached dispatch) against the references; raises on mismatch."""
    from moe_ep.testing.traps import host_reads_trapped

    fp8, expand, align, nbias, sync = case["fp8"], case["expand"], case["align"], case["bias"], case["sync"]
    view = case.get("view", False)  # recv_as_view: the symm receive stays in the buffer
    num_topk = 3
    num_local = num_experts // world
    ins = make_all_inputs(world, tokens, HIDDEN, num_experts, num_topk, seed=seed, routing=case.get("routing", "random"))
    inp = ins[rank]
    x = (inp.x_fp8, inp.x_scales) if fp8 else inp.x
    rx, ridx, rw, h, _ = eb.dispatch(x, inp.topk_idx, inp.topk_weights, num_experts=num_experts,
                                     expert_alignment=align, do_cpu_sync=sync, do_expand=expand,
                                     do_zero_padding=expand, use_tma_aligned_col_major_sf=fp8 and expand,
                                     recv_as_view=view)
    assert (ridx is None) == expand  # DeepEP V2: no per-token ids for the expanded layout
    ridx = h.recv_topk_idx  # (kept on the handle)
    refs = [ref_dispatch(r, [i.x_fp8 if fp8 else i.x for i in ins], [i.topk_idx for i in ins],
                         [i.topk_weights for i in ins], num_experts,
                         x_scales=[i.x_scales for i in ins] if fp8 else None) for r in range(world)]
    ref_x, ref_s, ref_idx, ref_w, _ = refs[rank]
    M = ref_x.shape[0]
    data, scales = rx if fp8 else (rx, None)
    if view and not expand and eb.buffer.backend_name == "symm" and M:
        region = eb.buffer._impl.normal.symm.buffer
        lo = region.data_ptr()
        fits = case.get("view_fits", True)  # a view that does not fit the buffer falls back to a copy
        for t in (data,) if scales is None else (data, scales):
            assert (lo <= t.data_ptr() < lo + region.numel()) == fits, f"recv_as_view: a view expected: {fits}"
    if case.get("min_rounds"):  # the batch did not fit: it moved in rounds
        assert h._buffer_handle.rounds >= case["min_rounds"], h._buffer_handle.rounds
    # routing, order and metadata
    assert torch.equal(ridx[:M], ref_idx) and bool((ridx[M:] == -1).all())
    assert ridx.shape[0] == (M if sync else NUM_MAX * world) == h.num_recv_tokens
    routes = ref_routes([i.topk_idx for i in ins], num_experts)[rank]
    want_global = torch.tensor([s * NUM_MAX + t for s, t in routes], dtype=torch.int64)
    assert torch.equal(h.recv_src_metadata[:M, 0], want_global), (h.recv_src_metadata[:M, 0], want_global)
    assert bool((want_global[1:] > want_global[:-1]).all())  # ordered by global token index
    per_src = torch.tensor([sum(1 for s, _ in routes if s == r) for r in range(world)])
    assert torch.equal(h.psum_num_recv_tokens_per_scaleup_rank, per_src.cumsum(0).to(torch.int32))
    counts = torch.tensor([int((ref_idx == e).sum()) for e in range(num_local)])
    aligned = (counts + align - 1) // align * align
    if sync:
        assert h.num_recv_tokens_per_expert_list == aligned.tolist()
    if not expand:
        assert torch.equal(data[:M].view(torch.uint8), ref_x.view(torch.uint8))
        if fp8:
            assert torch.equal(scales[:M], ref_s)
        assert torch.equal(rw[:M], ref_w) and bool((rw[M:] == 0).all())
        assert torch.equal(h.psum_num_recv_tokens_per_expert, aligned.cumsum(0).to(torch.int32))
        assert h.m_indices is None and h.num_unaligned_recv_tokens_per_expert is None
    else:
        src, ks, m_idx, _ = _ref_expand(ref_idx, num_local, align)
        R = src.shape[0]
        if sync:
            assert h.num_expanded_tokens == R == data.shape[0]
        assert data.shape[0] == h.m_indices.shape[0] == rw.shape[0] and data.shape[0] % align == 0
        assert torch.equal(h.m_indices[:R], m_idx) and bool((h.m_indices[R:] == -1).all())
        ok = src >= 0
        want = torch.zeros(R, ref_x.view(torch.uint8).shape[1], dtype=torch.uint8)
        want[ok] = ref_x.view(torch.uint8)[src[ok]]
        assert torch.equal(data[:R].view(torch.uint8), want) and bool((data[R:].view(torch.uint8) == 0).all())
        if fp8:  # M-major, TMA-aligned scales that travelled with their rows
            assert scales.stride(0) == 1
            want_s = torch.zeros(R, HIDDEN // 128)
            want_s[ok] = ref_s[src[ok]]
            assert torch.equal(scales[:R], want_s)
        want_w = torch.zeros(R)
        want_w[ok] = ref_w[src[ok], ks[ok]]
        assert torch.equal(rw[:R], want_w) and bool((rw[R:] == 0).all())
        starts = aligned.cumsum(0) - aligned
        assert torch.equal(h.psum_num_recv_tokens_per_expert, (starts + counts).to(torch.int32))
        assert torch.equal(h.num_unaligned_recv_tokens_per_expert, counts.to(torch.int32))
        # the handle's slots point at the expanded rows
        assert torch.equal(h.recv_src_metadata[:M, 2:], _ref_expand(ref_idx, num_local, align)[3])
    if view:  # the view is valid until the next dispatch or combine: keep what the cached dispatch is checked against
        data, scales = data.clone(), None if scales is None else scales.clone()
    # combine: every rank's rows are a function of (seed, rank), so each rank rebuilds the others'
    ys, ws = [], []
    for r in range(world):
        r_idx = refs[r][2]
        if expand:
            src_r, _, _, slot_r = _ref_expand(r_idx, num_local, align)
            y, w = _y(seed, r, src_r.shape[0]), _w(seed, r, (src_r.shape[0],))
            acc = torch.zeros(r_idx.shape[0], HIDDEN)
            for k in range(r_idx.shape[1]):  # a received token's expanded rows, summed in float32, k ascending
                acc += torch.where((slot_r[:, k] >= 0).unsqueeze(1), y[slot_r[:, k].clamp(min=0)].float(), 0.0)
            ys.append(acc.to(torch.bfloat16))
            ws.append(torch.where(slot_r >= 0, w[slot_r.clamp(min=0)], 0.0))
        else:
            y, w = _y(seed, r, r_idx.shape[0]), _w(seed, r, (r_idx.shape[0], num_topk))
            ys.append(y)
            ws.append(torch.where(r_idx >= 0, w, 0.0))
        if r == rank:  # worst-case sizes: padded with rows the combine must ignore
            pad = data.shape[0] - y.shape[0]
            my_y = torch.cat([y, torch.full((pad, HIDDEN), 1e4, dtype=torch.bfloat16)])
            my_w = torch.cat([w, torch.full((pad, *w.shape[1:]), 1e4)])
    g = torch.Generator().manual_seed(seed + 7 + rank)
    biases = tuple(torch.randn(tokens if isinstance(tokens, int) else tokens[rank], HIDDEN,
                               generator=g).to(torch.bfloat16) for _ in range(nbias))
    bias = None if nbias == 0 else (biases[0] if nbias == 1 else biases)
    combined, combined_w, _ = eb.combine(my_y, h, topk_weights=my_w, bias=bias)
    want_x, want_cw = ref_combine(rank, ys, [i.topk_idx for i in ins], num_experts, ws, biases)
    torch.testing.assert_close(combined.float(), want_x.float(), rtol=0, atol=0)
    assert torch.equal(combined_w, want_cw)
    # cached dispatch: only x moves, nothing is read on the host
    x2 = (inp.x_fp8, inp.x_scales * 2) if fp8 else inp.x * 2
    # (symm_normal checks a worst-case receive's real count on the host on CPU only (dev.type == "cpu"): a
    # CPU-only guard of the backend, not a read of this face, so worst-case handles are trapped on torch only)
    trap = host_reads_trapped if sync or eb.buffer.backend_name == "torch" else contextlib.nullcontext
    with trap():
        rx2, ridx2, rw2, h2, _ = eb.dispatch(x2, handle=h, do_zero_padding=expand, recv_as_view=view)
    assert h2 is h and rw2 is None and (ridx2 is None if expand else torch.equal(ridx2, ridx))
    rows = data.shape[0] if expand or sync else M  # a view's worst-case padding rows are stale, not zero
    if fp8:
        assert torch.equal(rx2[0][:rows].view(torch.uint8), data[:rows].view(torch.uint8))
        assert torch.equal(rx2[1][:rows], scales[:rows] * 2)
    else:
        assert torch.equal(rx2[:rows], data[:rows] * 2)
    with trap():  # top-k weights along a cached layout (the backward of combine): no host read either
        rw3 = eb.dispatch(x2, handle=h, topk_weights=inp.topk_weights * 2, recv_as_view=view)[2]
    assert torch.equal(rw3, rw * 2)
    return True


CASES = [  # fp8, expand, alignment, bias, sync: the mode matrix (bias and sync rotate through the cases)
    dict(fp8=f, expand=e, align=a, bias=b, sync=s)
    for i, (f, e, a) in enumerate([(f, e, a) for f in (False, True) for e in (False, True) for a in (1, 128)])
    for b, s in [((i % 3), i % 2 == 0)]
] + [dict(fp8=False, expand=True, align=4, bias=2, sync=False), dict(fp8=True, expand=False, align=1, bias=1, sync=False)]


def _run_cases(rank, world, backend, cases, num_experts, tokens):
    eb = _make(backend, world)
    return [_check_case(eb, rank, world, num_experts, c, seed=11 + i, tokens=tokens) for i, c in enumerate(cases)]


@pytest.mark.parametrize("backend", ["torch", "symm"])
def test_mode_matrix_2_ranks(backend):
    launch(_run_cases, 2, backend, CASES, 8, [5, 7], timeout_s=300)


VIEW_CASES = [dict(c, view=True) for c in CASES]


def test_mode_matrix_2_ranks_receive_as_view():
    """The whole mode matrix with ``recv_as_view=True`` on symm: the same results, the receive in the buffer."""
    launch(_run_cases, 2, "symm", VIEW_CASES, 8, [5, 7], timeout_s=300)


@pytest.mark.parametrize("backend", ["torch", "symm"])
def test_expanded_cases_through_the_expand_kernels(backend, monkeypatch):
    """The expanded cases of the matrix with the expanded layout's gathers and the expanded combine's sum run as
    Triton kernels (as on GPUs; the forked ranks inherit the switch): the same references, bitwise."""
    from moe_ep.deepep.v2 import expand as elastic_expand

    monkeypatch.setattr(elastic_expand, "USE_KERNELS", True)
    launch(_run_cases, 2, backend, [c for c in CASES if c["expand"]], 8, [5, 7], timeout_s=300)


@pytest.mark.parametrize("backend", ["torch", "symm"])
def test_4_ranks(backend):
    cases = [dict(fp8=False, expand=True, align=128, bias=2, sync=True),
             dict(fp8=True, expand=False, align=1, bias=1, sync=False),
             dict(fp8=True, expand=True, align=4, bias=0, sync=False)]
    launch(_run_cases, 4, backend, cases, 8, [5, 1, 7, 3], timeout_s=300)


def _run_small_buffer(rank, world, cases, num_experts, tokens, chunk):
    """The cases on a symm ElasticBuffer of ``chunk`` tokens per source per round (dispatch and combine time-share
    it), less than a quarter of the one-round receive of NUM_MAX tokens per rank."""
    import moe_ep
    from moe_ep.backends.symm import SymmBackend

    small = SymmBackend.get_normal_size_hint(None, HIDDEN, 3, world, chunk_tokens=chunk)
    assert 4 * small < SymmBackend.get_normal_size_hint(NUM_MAX, HIDDEN, 3, world)
    eb = moe_ep.ElasticBuffer(None, num_bytes=small, num_max_tokens_per_rank=NUM_MAX, hidden=HIDDEN, num_topk=3,
                              backend="symm", provider="shm", timeout_s=30)
    return [_check_case(eb, rank, world, num_experts, c, seed=31 + i, tokens=tokens) for i, c in enumerate(cases)]


SMALL_CASES = [  # BF16 and FP8, expanded or not, CPU-synced or worst-case sizes, a view that does not fit
    dict(fp8=False, expand=False, align=1, bias=2, sync=True, min_rounds=2),
    dict(fp8=True, expand=True, align=128, bias=1, sync=False, min_rounds=2),
    dict(fp8=True, expand=False, align=1, bias=0, sync=True, view=True, view_fits=False, min_rounds=2)]


def test_mode_matrix_small_buffer_2_ranks():
    """Mode-matrix cases through a buffer of 3 tokens per source per round (3 rounds for 7 tokens): the same
    references bitwise; a receive view that does not fit falls back to a copy (same results)."""
    launch(_run_small_buffer, 2, SMALL_CASES, 8, [5, 7], 3, timeout_s=300)


@pytest.mark.slow  # 4 forked ranks through the mode matrix (30-50 s on 2 cores; the 2-rank matrix runs by default)
def test_mode_matrix_small_buffer_4_ranks_empty_rank_and_hot_expert():
    cases = [dict(fp8=False, expand=True, align=4, bias=2, sync=True, routing="one_expert", min_rounds=2),
             dict(fp8=True, expand=False, align=1, bias=1, sync=False, view=True, view_fits=False, min_rounds=2)]
    launch(_run_small_buffer, 4, cases, 8, [5, 0, 7, 3], 3, timeout_s=300)


# ---------------------------------------------------------------------------------------------- expanded = GEMM's a
def _gemm_operand(rank, world):
    from moe_ep.layer.experts import permute_to_contiguous

    eb = _make("torch", world)
    ins = make_all_inputs(world, 6, HIDDEN, 8, 3, seed=5)
    inp = ins[rank]
    rx, ridx, _, h, _ = eb.dispatch((inp.x_fp8, inp.x_scales), inp.topk_idx, inp.topk_weights, num_experts=8,
                                    expert_alignment=128, do_expand=True, do_zero_padding=True,
                                    use_tma_aligned_col_major_sf=True)
    assert ridx is None
    ridx = h.recv_topk_idx
    # the layer's own permutation of the non-expanded receive gives the same operand
    dst, m_indices, m_exp = permute_to_contiguous(ridx, 8 // world)
    assert m_exp == rx[0].shape[0] and torch.equal(m_indices, h.m_indices)
    assert torch.equal(h.recv_src_metadata[:, 2:], dst)
    # the experts on the handle's psum layout (what MoELayer feeds the GEMMs: no m_indices) = on m_indices, bitwise
    from moe_ep.layer.experts import ExpertWeights, expanded_experts

    g = torch.Generator().manual_seed(rank)
    num_local = 8 // world
    weights = ExpertWeights.from_float(torch.randn(num_local, 256, HIDDEN, generator=g) / 8,
                                       torch.randn(num_local, HIDDEN, 128, generator=g) / 8)
    rw = torch.rand(rx[0].shape[0], generator=g) * (h.m_indices >= 0)
    y_idx = expanded_experts(rx, h.m_indices, weights, rw)
    y_psum = expanded_experts(rx, h.psum_num_recv_tokens_per_expert, weights, rw, use_psum_layout=True)
    assert torch.equal(y_idx.view(torch.int16), y_psum.view(torch.int16))
    return True


def test_expanded_layout_is_the_contiguous_gemm_operand():
    launch(_gemm_operand, 2, timeout_s=120)


# ---------------------------------------------------------------------------------------------- determinism
def _deterministic(rank, world, backend):
    eb = _make(backend, world, deterministic=True)
    ins = make_all_inputs(world, 7, HIDDEN, 8, 3, seed=9)
    inp = ins[rank]
    outs = []
    for _ in range(2):
        rx, _, rw, h, _ = eb.dispatch(inp.x, inp.topk_idx, inp.topk_weights, num_experts=8, expert_alignment=4,
                                      do_expand=True, do_zero_padding=True)
        y = (rx.float() * torch.linspace(0.5, 1.5, rx.shape[0]).unsqueeze(1)).to(torch.bfloat16)
        c, cw, _ = eb.combine(y, h, topk_weights=rw)
        outs.append((rx, rw, h.recv_src_metadata, c, cw))
    for a, b in zip(*outs):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.bfloat16 else a,
                           b.view(torch.uint8) if b.dtype == torch.bfloat16 else b)
    return True


@pytest.mark.parametrize("backend", ["torch", "symm"])
def test_deterministic_bitwise_run_to_run(backend):
    launch(_deterministic, 2, backend, timeout_s=120)


# ---------------------------------------------------------------------------------------------- training pattern
def _autograd(rank, world, expand):
    """Layer: dispatch -> scale each received row by c(rank, local expert) -> combine. Backward of dispatch is
    combine with the handle; backward of combine is dispatch with the handle (weights too)."""
    eb = _make("torch", world)
    num_experts, num_local = 8, 8 // world

    class Dispatch(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, topk_weights, topk_idx, box):
            rx, ridx, rw, h, _ = eb.dispatch(x, topk_idx, topk_weights, num_experts=num_experts, do_expand=expand,
                                             do_zero_padding=expand, expert_alignment=4 if expand else 1)
            ctx.h = h
            box.append((h.recv_topk_idx, h))
            return rx, rw

        @staticmethod
        def backward(ctx, g_rx, g_rw):
            gx, gw, _ = eb.combine(g_rx.to(torch.bfloat16).contiguous(), ctx.h, topk_weights=g_rw.contiguous())
            return gx, gw, None, None

    class Combine(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y, w, h):
            ctx.h = h
            c, cw, _ = eb.combine(y, h, topk_weights=w)
            return c, cw

        @staticmethod
        def backward(ctx, g_c, g_cw):
            gy, _, gw, _, _ = eb.dispatch(g_c.to(torch.bfloat16).contiguous(), handle=ctx.h,
                                          topk_weights=g_cw.contiguous(), do_zero_padding=ctx.h.do_expand)
            return gy, gw, None

    ins = make_all_inputs(world, 6, HIDDEN, num_experts, 3, seed=21)
    inp = ins[rank]
    x = (inp.x.float() / 4).to(torch.bfloat16).requires_grad_()
    w = inp.topk_weights.clone().requires_grad_()
    box = []
    rx, rw = Dispatch.apply(x, w, inp.topk_idx, box)
    ridx, h = box[0]
    coef = torch.tensor([0.5 + 0.25 * (rank * num_local + e) for e in range(num_local)])  # per global expert
    if expand:
        scale = torch.where(h.m_indices >= 0, coef[h.m_indices.clamp(min=0).long()], 0.0)
    else:  # a row's scale: sum of its local experts' coefficients
        scale = torch.where(ridx >= 0, coef[ridx.clamp(min=0)], 0.0).sum(1)
    y = (rx.float() * scale.unsqueeze(1)).to(torch.bfloat16)
    c, cw = Combine.apply(y, rw * 3, h)
    g = torch.Generator().manual_seed(rank)
    gc, gcw = torch.randn(c.shape, generator=g), torch.randn(cw.shape, generator=g)
    ((c.float() * gc).sum() + (cw * gcw).sum()).backward()
    # dense reference: out[t] = x[t] * sum over selected experts of coef(e); combined weights = 3 * w (valid)
    xr = x.detach().clone().requires_grad_()
    wr = w.detach().clone().requires_grad_()
    all_coef = torch.tensor([0.5 + 0.25 * e for e in range(num_experts)])
    sel = inp.topk_idx >= 0
    s = torch.where(sel, all_coef[inp.topk_idx.clamp(min=0)], 0.0).sum(1)
    cr = (xr.float() * s.unsqueeze(1)).to(torch.bfloat16)
    cwr = torch.where(sel, wr * 3, 0.0)
    ((cr.float() * gc).sum() + (cwr * gcw).sum()).backward()
    torch.testing.assert_close(c.float(), cr.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(cw, cwr, rtol=0, atol=0)
    torch.testing.assert_close(x.grad.float(), xr.grad.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(w.grad, wr.grad, rtol=1e-6, atol=1e-6)
    return True


@pytest.mark.parametrize("expand", [False, True])
def test_training_pattern_matches_autograd_on_a_dense_reference(expand):
    launch(_autograd, 2, expand, timeout_s=120)


# ---------------------------------------------------------------------------------------------- bad input
def _outcome(fn):
    try:
        fn()
        return "ok"
    except Exception as exc:  # noqa: BLE001 - compared by name
        return f"{type(exc).__name__}: {exc}"


def _bad_input(rank, world, backend):
    eb = _make(backend, world)
    inp = make_all_inputs(world, 5, HIDDEN, 8, 3, seed=2)[rank]
    d = dict(num_experts=8)
    big = make_all_inputs(world, NUM_MAX + 1, HIDDEN, 8, 3, seed=2)[rank]
    res = {
        "dtype": _outcome(lambda: eb.dispatch(inp.x, inp.topk_idx.int(), **d)),
        "too_many": _outcome(lambda: eb.dispatch(big.x, big.topk_idx, **d)),
        "no_experts": _outcome(lambda: eb.dispatch(inp.x, inp.topk_idx)),
        "zero_pad": _outcome(lambda: eb.dispatch(inp.x, inp.topk_idx, do_zero_padding=True, **d)),
        "align": _outcome(lambda: eb.dispatch(inp.x, inp.topk_idx, expert_alignment=0, **d)),
        "stats": _outcome(lambda: eb.dispatch(inp.x, inp.topk_idx, cumulative_local_expert_recv_stats=torch.zeros(3),
                                              **d)),
    }
    rx, _, _, h, _ = eb.dispatch(inp.x, inp.topk_idx, inp.topk_weights, do_expand=True, **d)
    res["cached_topk"] = _outcome(lambda: eb.dispatch(inp.x, inp.topk_idx, handle=h))
    res["cached_sync"] = _outcome(lambda: eb.dispatch(inp.x, handle=h, do_cpu_sync=True))
    res["cached_experts"] = _outcome(lambda: eb.dispatch(inp.x, handle=h, num_experts=16))
    res["combine_w2d"] = _outcome(lambda: eb.combine(rx, h, topk_weights=torch.zeros(rx.shape[0], 3)))
    res["combine_rows"] = _outcome(lambda: eb.combine(rx[:1], h))
    # still in step afterwards
    eb.combine(rx, h)
    res["engram"] = _outcome(lambda: eb.engram_fetch(torch.zeros(1, 1, dtype=torch.int32)))
    res["pp"] = _outcome(lambda: eb.pp_send(rx, 0))
    return res


@pytest.mark.parametrize("backend", ["torch", "symm"])
def test_bad_input_raises_before_communication(backend):
    for res in launch(_bad_input, 2, backend, timeout_s=120):
        for key, msg in res.items():
            if key in ("engram", "pp"):
                assert msg.startswith("NotImplementedError"), (key, msg)
            else:
                assert msg.startswith(("ValueError", "TypeError")), (key, msg)
        assert "num_max_tokens_per_rank" in res["too_many"] and "do_zero_padding" in res["zero_pad"]


def _one_rank_refuses(rank, world):
    eb = _make("torch", world)
    inp = make_all_inputs(world, 5, HIDDEN, 8, 3, seed=2)[rank]
    topk = inp.topk_idx.int() if rank == 0 else inp.topk_idx
    return _outcome(lambda: eb.dispatch(inp.x, topk, num_experts=8))


def test_a_refusal_on_one_rank_reaches_the_others():
    res = launch(_one_rank_refuses, 2, timeout_s=60)
    assert all(r != "ok" for r in res), res


def _one_rank_bad_expert(rank, world):
    eb = _make("torch", world, timeout_s=20)
    inp = make_all_inputs(world, 5, HIDDEN, 8, 3, seed=2)[rank]
    idx = inp.topk_idx.clone()
    if rank == 0:
        idx[0, 0] = 8  # == num_experts
    t0 = time.monotonic()
    first = _outcome(lambda: eb.dispatch(inp.x, idx, inp.topk_weights, num_experts=8))
    took = time.monotonic() - t0
    again = _outcome(lambda: eb.dispatch(inp.x, inp.topk_idx, inp.topk_weights, num_experts=8))  # still usable
    return first, took, again


def test_an_expert_id_refusal_reaches_the_others_at_once():
    """An out-of-range expert id on one rank (checked by the layout): every rank raises at once, the peer naming
    the refusing rank, and the next call works (issue 33)."""
    res = launch(_one_rank_bad_expert, 2, timeout_s=90)
    assert res[0][0].startswith("ValueError") and "outside" in res[0][0], res
    assert "rank 0" in res[1][0] and "RankTimeoutError" not in res[1][0], res
    assert all(took < 10 for _, took, _ in res), res
    assert [again for _, _, again in res] == ["ok", "ok"], res


def _constructor(rank, world):
    import moe_ep

    out = {}
    out["cpu_bytes"] = _outcome(lambda: moe_ep.ElasticBuffer(None, num_cpu_bytes=2 << 20, backend="torch"))
    eb = moe_ep.ElasticBuffer(None, num_max_tokens_per_rank=NUM_MAX, backend="torch", explicitly_destroy=True,
                              sl_idx=1, num_allocated_qps=4, allow_hybrid_mode=False)
    out["domains"] = (eb.get_physical_domain_size(), eb.get_logical_domain_size())
    out["sms"] = eb.get_theoretical_num_sms(256, 8)
    out["qps"] = eb.get_theoretical_num_qps(24)
    out["hint"] = moe_ep.ElasticBuffer.get_buffer_size_hint(None, 4096, 7168, 8, True)
    eb.barrier()
    out["event"] = type(moe_ep.ElasticBuffer.capture()).__name__
    out["stream"] = eb.get_comm_stream()
    eb.destroy()
    out["after_destroy"] = _outcome(lambda: eb.dispatch(torch.zeros(1, HIDDEN, dtype=torch.bfloat16),
                                                        torch.zeros(1, 1, dtype=torch.int64), num_experts=2))
    return out


def test_constructor_and_helpers():
    for out in launch(_constructor, 2, timeout_s=60):
        assert out["cpu_bytes"].startswith("NotImplementedError") and "num_cpu_bytes" in out["cpu_bytes"]
        assert out["domains"] == ((1, 2), (1, 2))
        assert 4 <= out["sms"] <= 132 and out["sms"] % 2 == 0 and out["qps"] == 0
        assert out["hint"] % (2 << 20) == 0 and out["hint"] > 0
        assert out["event"] == "EventOverlap" and out["stream"] is None
        assert out["after_destroy"].startswith("RuntimeError"), out["after_destroy"]


def test_signature_matches_deepep_v2():
    import inspect

    import moe_ep

    d = inspect.signature(moe_ep.ElasticBuffer.dispatch).parameters
    assert list(d)[:19] == ["self", "x", "topk_idx", "topk_weights", "cumulative_local_expert_recv_stats",
                            "num_experts", "num_max_tokens_per_rank", "expert_alignment", "num_sms", "num_qps",
                            "previous_event", "previous_event_before_epilogue", "async_with_compute_stream",
                            "allocate_on_comm_stream", "handle", "do_handle_copy", "do_cpu_sync", "do_expand",
                            "do_zero_padding"]
    assert d["do_cpu_sync"].default is None and d["do_expand"].default is False
    c = inspect.signature(moe_ep.ElasticBuffer.combine).parameters
    assert list(c)[:5] == ["self", "x", "handle", "topk_weights", "bias"]
    i = inspect.signature(moe_ep.ElasticBuffer.__init__).parameters
    assert list(i)[:6] == ["self", "group", "num_bytes", "num_cpu_bytes", "num_max_tokens_per_rank", "hidden"]
    assert i["sl_idx"].default == 3 and i["num_cpu_timeout_secs"].default == 300


def test_out_of_scope_names_raise_clearly():
    # DeepEP V2's (@dd758ca) Engram / pipeline-parallel / AGRS names exist and raise NotImplementedError naming
    # themselves (engine code probing them gets a clear answer, not an AttributeError)
    import moe_ep

    E = moe_ep.ElasticBuffer
    hints = ("get_engram_storage_size_hint", "get_pp_buffer_size_hint", "get_agrs_num_max_session_bytes",
             "get_agrs_buffer_size_hint")
    methods = ("engram_write", "engram_fetch", "pp_set_config", "pp_send", "pp_recv", "create_agrs_session",
               "destroy_agrs_session", "agrs_new_session", "agrs_set_config", "agrs_get_inplace_tensor", "all_gather")
    for name in hints:  # static, as in V2: callable on the class
        with pytest.raises(NotImplementedError, match=f"ElasticBuffer.{name} .*out of scope"):
            getattr(E, name)(1, 2)
    for name in methods:
        with pytest.raises(NotImplementedError, match=f"ElasticBuffer.{name} .*out of scope"):
            getattr(E, name)(object())


# ----------------------------------------------------------------------------- construction during graph capture
def _construct_in_capture(rank, world):
    """A simulated capture (``checked_streams().capture()``, what ``moe_ep.events.is_capturing()`` reports):
    constructing an ElasticBuffer raises the capture error on every rank before any allocation or rendezvous
    (no generic backend failure, no hang); ``from_buffer`` over a Buffer made before the capture is allowed."""
    import moe_ep
    from moe_ep import events
    from moe_ep.testing.streams import checked_streams

    buf = moe_ep.Buffer(None, explicitly_destroy=True, backend="torch", timeout_s=30)
    out = {}
    with checked_streams(strict=False) as chk:
        with chk.capture():
            out["capturing"] = events.is_capturing()
            out["torch"] = _outcome(lambda: _make("torch", world))
            out["symm"] = _outcome(lambda: _make("symm", world))
            eb = moe_ep.ElasticBuffer.from_buffer(buf, NUM_MAX)
            out["wrapped"] = (type(eb).__name__, eb.num_ranks, eb.buffer is buf)
        out["violations"] = chk.messages()
    out["after"] = type(_make("torch", world)).__name__  # after the capture: constructs as usual
    buf.destroy()
    return out


def test_construction_during_graph_capture_raises_a_clear_error():
    for out in launch(_construct_in_capture, 2, timeout_s=120):
        assert out["capturing"] is True
        for name in ("torch", "symm"):
            assert out[name].startswith("RuntimeError") and "CUDA graph is being captured" in out[name] \
                and "before capturing" in out[name], out[name]
        assert out["wrapped"] == ("ElasticBuffer", 2, True)
        assert out["violations"] == [] and out["after"] == "ElasticBuffer"


# ---------------------------------------------------------------------------------------------- stream options
def _stream_options(rank, world, backend, view):
    """previous_event, async_with_compute_stream, allocate_on_comm_stream and do_handle_copy=False give the plain
    call's results, and the stream-order checker (streams modelled on CPU) finds no unordered read or early free."""
    from moe_ep.testing.streams import checked_streams
    from moe_ep.testing.streams import launch as report

    eb = _make(backend, world)
    ins = make_all_inputs(world, [5, 7, 2, 4][:world], HIDDEN, 8, 3, seed=21)
    inp = ins[rank]
    plain_x, plain_idx, plain_w, plain_h, _ = eb.dispatch(inp.x, inp.topk_idx, inp.topk_weights, num_experts=8)
    plain_x = plain_x.clone()  # (a view would be reused by the next call)
    y_plain = (plain_x.float() * (rank + 2)).to(torch.bfloat16)
    plain_c, plain_cw, _ = eb.combine(y_plain, plain_h, topk_weights=plain_w)
    with checked_streams(strict=False) as chk:
        x, idx, w = inp.x.clone(), inp.topk_idx.clone(), inp.topk_weights.clone()
        report(writes=(x, idx, w), what="router")
        rx, ridx, rw, h, ev = eb.dispatch(x, idx, w, num_experts=8, previous_event=eb.capture(),
                                          async_with_compute_stream=True, allocate_on_comm_stream=True,
                                          do_handle_copy=False, recv_as_view=view)
        assert h.topk_idx is idx  # do_handle_copy=False keeps the caller's tensor
        del x, w  # dropped while the dispatch may still be in flight
        ev.current_stream_wait()
        y = (rx.float() * (rank + 2)).to(torch.bfloat16)
        report(reads=(rx, rw), writes=y, what="experts")
        got = (rx.clone(), ridx.clone(), rw.clone())
        c, cw, ev = eb.combine(y, h, topk_weights=rw, previous_event=eb.capture(), async_with_compute_stream=True,
                               allocate_on_comm_stream=True)
        del y
        ev.current_stream_wait()
        report(reads=(c, cw), what="next layer")
        out = (got, c.clone(), cw.clone())
        del rx, ridx, rw, h, c, cw, ev, idx
    (rx, ridx, rw), c, cw = out
    assert torch.equal(rx.view(torch.uint8), plain_x.view(torch.uint8)) and torch.equal(ridx, plain_idx)
    assert torch.equal(rw, plain_w)
    assert torch.equal(c.view(torch.uint8), plain_c.view(torch.uint8)) and torch.equal(cw, plain_cw)
    return chk.messages()


@pytest.mark.parametrize("backend,view", [("torch", False), ("symm", False), ("symm", True)])
def test_stream_options_give_the_plain_results_in_stream_order(backend, view):
    assert launch(_stream_options, 2, backend, view, timeout_s=120) == [[], []]
