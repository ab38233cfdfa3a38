"""``ElasticBuffer`` as vLLM's DeepEP V2 prefill calls it: the expanded dispatch returns ``recv_topk_idx`` ``None``
(as DeepEP V2), and the expanded combine under ``allow_multiple_reduction=False`` (vLLM's default) reduces every
expanded row of a token in one float32 sum, cast once; ``EPHandle.deterministic_sort`` as DeepEP V2's epilogue."""

from __future__ import annotations

import os

import pytest
import torch

from moe_ep.testing import launch
from moe_ep.testing.inputs import make_all_inputs, make_elastic_buffer

# Kernels on CPU tensors need the Triton interpreter (tests/conftest.py sets it where no GPU exists); on a
# GPU machine run this file with `TRITON_INTERPRET=1`.
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU ranks run the symm kernels in the Triton interpreter")

H, E, K, NUM_MAX = 128, 8, 3, 8


def _coef(e: torch.Tensor) -> torch.Tensor:
    return 0.75 + 0.125 * e.float()


def _one_rounding(rank, world, backend, amr):
    eb = make_elastic_buffer(backend, world, NUM_MAX, H, K, allow_multiple_reduction=amr)
    inp = make_all_inputs(world, [7, 5][:world], H, E, K, seed=13)[rank]
    L = E // world
    rx, ridx, rw, h, _ = eb.dispatch(inp.x, inp.topk_idx, inp.topk_weights, num_experts=E, expert_alignment=4,
                                     do_expand=True, do_zero_padding=True)
    assert ridx is None and h.recv_topk_idx is not None
    glob = torch.where(h.m_indices >= 0, h.m_indices.long() + rank * L, -1)
    y = (rx.float() * torch.where(glob >= 0, _coef(glob), 0.0).unsqueeze(1)).to(torch.bfloat16)  # the "experts"
    bias = torch.randn(inp.x.shape[0], H, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    c, cw, _ = eb.combine(y, h, topk_weights=rw, bias=bias)
    # reference on the source: bias, then per destination rank (ascending) the float32 sum of its expanded rows
    # (k ascending), all in float32, cast once
    idx = inp.topk_idx
    total = bias.float().clone()
    for d in range(world):
        part = torch.zeros(idx.shape[0], H)
        for k in range(K):
            e = idx[:, k]
            on_d = (e >= 0) & (e // L == d)
            row = (inp.x.float() * _coef(e.clamp(min=0)).unsqueeze(1)).to(torch.bfloat16).float()
            part += torch.where(on_d.unsqueeze(1), row, 0.0)
        total += part
    want = total.to(torch.bfloat16)
    want_w = torch.where(idx >= 0, inp.topk_weights, 0.0)
    exact = torch.equal(c.view(torch.int16), want.view(torch.int16))
    return exact, torch.equal(cw, want_w), (c.float() - want.float()).abs().max().item()


@pytest.mark.parametrize("backend", ["torch", "symm"])
def test_expanded_combine_one_rounding(backend):
    for exact, w_ok, err in launch(_one_rounding, 2, backend, False, timeout_s=300):
        assert exact and w_ok, err


def test_expanded_combine_two_roundings_still_the_default():
    # the default (True) keeps the Buffer's own combine: close to, not always equal to, the one-rounding sum
    for exact, w_ok, err in launch(_one_rounding, 2, "torch", True, timeout_s=300):
        assert w_ok and err <= 0.25  # a BF16 ulp or two at these magnitudes (|x| up to ~30)


def _sort(rank, world):
    eb = make_elastic_buffer("torch", world, NUM_MAX, H, K)
    inp = make_all_inputs(world, [7, 5][:world], H, E, K, seed=17)[rank]
    rx, ridx, rw, h, _ = eb.dispatch(inp.x, inp.topk_idx, inp.topk_weights, num_experts=E)
    want = (rx.clone(), ridx.clone(), rw.clone(), h.recv_src_metadata.clone())
    perm = torch.randperm(rx.shape[0], generator=torch.Generator().manual_seed(rank))
    for t in (rx, ridx, rw, h.recv_src_metadata):
        t.copy_(t[perm])
    h.deterministic_sort(True, False, rx, None, ridx, rw, None)
    got = (rx, ridx, rw, h.recv_src_metadata)
    ok = all(torch.equal(a, b) for a, b in zip(got, want))
    # expanded: already in the sorted order, the sort keeps every row and the combine plan where they are
    ex, _, ew, eh, _ = eb.dispatch(inp.x, inp.topk_idx, inp.topk_weights, num_experts=E, expert_alignment=4,
                                   do_expand=True, do_zero_padding=True)
    before = (ex.clone(), ew.clone(), eh.recv_src_metadata.clone())
    eh.deterministic_sort(True, False, ex, None, None, ew, None)
    ok = ok and all(torch.equal(a, b) for a, b in zip((ex, ew, eh.recv_src_metadata), before))
    c, _, _ = eb.combine(ex, eh)
    return ok and c.shape == inp.x.shape


def test_deterministic_sort():
    assert launch(_sort, 2, timeout_s=300) == [True, True]


def _async_expanded(rank, world, backend):
    """DeepEP V2's test matrix runs the expanded dispatch and combine with async_with_compute_stream and
    previous_event: same results as the synchronous calls; dst_buffer_slot_idx names each token's slot in the
    destination's region for this source, which the receiver's source metadata confirms."""
    eb = make_elastic_buffer(backend, world, NUM_MAX, H, K)
    inp = make_all_inputs(world, [7, 5][:world], H, E, K, seed=19)[rank]
    kw = dict(num_experts=E, expert_alignment=4, do_expand=True, use_tma_aligned_col_major_sf=True)  # BF16: ignored
    sx, _, sw, sh, _ = eb.dispatch(inp.x, inp.topk_idx, inp.topk_weights, **kw)
    ax, aidx, aw, ah, ev = eb.dispatch(inp.x, inp.topk_idx, inp.topk_weights, previous_event=eb.capture(),
                                       async_with_compute_stream=True, allocate_on_comm_stream=True, **kw)
    ev.current_stream_wait()
    same = aidx is None and torch.equal(ax, sx) and torch.equal(aw, sw)
    same = same and torch.equal(ah.recv_src_metadata, sh.recv_src_metadata)
    y = (sx.float() * 1.5).to(torch.bfloat16)
    sc, scw, _ = eb.combine(y, sh, topk_weights=sw)
    ac, acw, ev = eb.combine(y, ah, topk_weights=aw, previous_event=eb.capture(), async_with_compute_stream=True,
                             allocate_on_comm_stream=True)
    ev.current_stream_wait()
    same = same and torch.equal(ac, sc) and torch.equal(acw, scw)
    # slots: sent side [N, K] (first selection of each destination rank), received side in (source, token) order
    L = E // world
    slots = sh.dst_buffer_slot_idx
    sent = []
    for d in range(world):
        first = [next((int(slots[t, k]) for k in range(K) if inp.topk_idx[t, k] >= 0
                       and int(inp.topk_idx[t, k]) // L == d), None) for t in range(inp.x.shape[0])]
        first += [None] * (NUM_MAX - len(first))  # same size on every rank
        sent.append(torch.tensor([-1 if f is None else f for f in first], dtype=torch.int64))
    got = [torch.empty_like(s) for s in sent]
    torch.distributed.all_to_all(got, sent)  # got[s]: source s's slots toward this rank
    meta = sh.recv_src_metadata
    for s in range(world):
        rows = meta[meta[:, 1] == s, 0]  # global token index of source s's rows here, in receive order
        want = torch.full((NUM_MAX,), -1, dtype=torch.int64)
        want[rows - s * NUM_MAX] = torch.arange(rows.numel()) + s * NUM_MAX
        ok_s = torch.equal(got[s], want)
        same = same and ok_s and slots.dtype == torch.int32
    return same


@pytest.mark.parametrize("backend", ["torch", "symm"])
def test_async_expanded_and_slots(backend):
    assert launch(_async_expanded, 2, backend, timeout_s=300) == [True, True]
