"""Every public entry point under ``torch.inference_mode()`` and ``torch.no_grad()`` (how vLLM and SGLang run
every forward) gives the results it gives in normal mode, bitwise: Buffer (normal and low-latency, backends
``torch`` and ``symm``), ElasticBuffer, MoELayer, mega-MoE across forked ranks; moe_ep.quant, the GEMMs of
moe_ep.gemm and eplb.map_topk in one process. Objects (buffers, weights) are made outside the modes, as engines
make them at start-up; each step's inputs are made inside, so under inference_mode they are inference tensors.

Also: the layout-check cache never takes an inference tensor written in place since its check for checked
(a stale layout is caught), and DeepEP V1's top-k-less dispatch returns the per-expert counts on both backends."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from moe_ep.testing import launch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU ranks run the Triton kernels in the interpreter")

MODES = {"normal": contextlib.nullcontext, "no_grad": torch.no_grad, "inference": torch.inference_mode}
HIDDEN, E, K, N = 128, 4, 2, 5


def _same(results: dict) -> None:
    """Every mode's outputs equal the normal mode's, bitwise (same structure, dtypes and bits)."""
    base = results["normal"]
    for mode, got in results.items():
        assert len(got) == len(base), mode
        for i, (a, b) in enumerate(zip(got, base)):
            if isinstance(b, torch.Tensor):
                assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, (mode, i)
                if b.is_floating_point() and b.element_size() == 1:  # FP8: compare the bytes
                    a, b = a.view(torch.uint8), b.view(torch.uint8)
                assert torch.equal(a, b), f"{mode}: output {i} differs from normal mode"
            else:
                assert a == b, f"{mode}: output {i}: {a!r} != {b!r}"


def _inputs(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(N, HIDDEN, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    idx[1, 1] = -1
    return x, idx, torch.rand(N, K, generator=g)


def _buffer_rank(rank: int, world: int, backend: str, layers: bool) -> bool:
    """``layers``: also ElasticBuffer and MoELayer, and the no_grad mode (their Python logic is the same on
    every backend; on ``symm`` only the Buffer's calls run, in normal and inference mode, to keep the
    interpreter's time short)."""
    import moe_ep
    from moe_ep.backends.symm import SymmBackend
    from moe_ep.layer.experts import ExpertWeights
    from moe_ep.layer.moe import MoELayer
    from moe_ep.testing.inputs import make_elastic_buffer, make_expert_weights

    kw = {}
    if backend == "symm":
        kw = dict(num_nvl_bytes=SymmBackend.get_normal_size_hint(N, HIDDEN, K, world),
                  num_rdma_bytes=SymmBackend.get_low_latency_size_hint(N, HIDDEN, world, E, K))
    buf = moe_ep.Buffer(None, low_latency_mode=True, backend=backend, timeout_s=60, **kw)
    L = E // world
    if layers:
        eb = make_elastic_buffer(backend, world, N, HIDDEN, K)
        w13, w2 = make_expert_weights(E, HIDDEN, HIDDEN, seed=4)
        weights = ExpertWeights.from_float(w13[rank * L:(rank + 1) * L], w2[rank * L:(rank + 1) * L])
        prefill = MoELayer(buf, weights, E, mode="prefill")
        decode = MoELayer(buf, weights, E, mode="decode", num_max_dispatch_tokens_per_rank=N)
    x0, idx0, w0 = _inputs(rank)

    def step():
        x, idx, w = x0.clone(), idx0.clone(), w0.clone()  # made inside the mode
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        rx, ridx, rw, lst, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, **layout)
        comb, comb_w, _ = buf.combine(rx, handle, topk_weights=rw)
        (cx, cs), *_ = buf.dispatch(moe_ep.quant.per_token_group_quant_fp8(x), handle=handle)
        bare_x, _, _, bare_list, _, _ = buf.dispatch(x, **layout)  # DeepEP V1's top-k-less dispatch
        (lx, ls), count, ll_handle, _, _ = buf.low_latency_dispatch(x, idx, N, E)
        y = torch.zeros(L, world * N, HIDDEN, dtype=torch.bfloat16)
        valid = []  # rows past recv_count are unspecified
        for e in range(L):
            c = int(count[e])
            y[e, :c] = lx[e, :c].float().mul(ls[e, :c].repeat_interleave(128, 1)).to(torch.bfloat16)
            valid += [lx[e, :c], ls[e, :c]]
        ll_out, _, _ = buf.low_latency_combine(y, idx, w, ll_handle)
        out = [rx, ridx, rw, lst, comb, comb_w, cx, cs, bare_x, bare_list, count, ll_out, *valid]
        if layers:
            ex, eidx, ew, eh, _ = eb.dispatch(x, idx, w, num_experts=E)
            e_out, _, _ = eb.combine(ex, eh, ew)
            out += [ex, eidx, ew, e_out, prefill(x, idx, w), decode(x, idx, w)]
        return out

    results = {}
    for mode, ctx in MODES.items():
        if mode == "no_grad" and not layers:
            continue
        with ctx():
            results[mode] = step()
    _same(results)
    # the top-k-less dispatch reports DeepEP's per-expert counts (the top-k dispatch's list, alignment 1)
    assert results["normal"][9] == results["normal"][3] and sum(results["normal"][3]) > 0

    # A layout check is never taken from a stale cache: an inference topk_idx written in place after its
    # get_dispatch_layout (no version counter records it) is checked again, and the mismatch raises.
    with torch.inference_mode():
        x, idx, w = x0.clone(), idx0.clone(), w0.clone()
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        idx[0] = torch.tensor([e for e in range(E) if e not in idx[0].tolist()][:K])
        with pytest.raises(ValueError, match="disagree"):
            buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                         topk_idx=idx, topk_weights=w)
    return True


def test_buffer_elastic_layer_under_inference_mode():
    assert launch(_buffer_rank, 2, "torch", True, timeout_s=300) == [True, True]


def test_symm_buffer_under_inference_mode():
    assert launch(_buffer_rank, 2, "symm", False, timeout_s=300) == [True, True]


def _mega_rank(rank: int, world: int) -> bool:
    from moe_ep.gemm import fp8_mega_moe, get_symm_buffer_for_mega_moe, transform_weights_for_mega_moe
    from moe_ep.quant import per_block_quant_fp8, per_token_group_quant_fp8
    from moe_ep.testing.inputs import make_expert_weights

    w13, w2 = make_expert_weights(E, 256, 256, seed=3)
    L = E // world
    l1, l2 = transform_weights_for_mega_moe(per_block_quant_fp8(w13[rank * L:(rank + 1) * L]),
                                            per_block_quant_fp8(w2[rank * L:(rank + 1) * L]))
    buf = get_symm_buffer_for_mega_moe(None, E, N, K, 256, 256, timeout_s=60)
    g = torch.Generator().manual_seed(7 + rank)
    x0 = torch.randn(N, 256, generator=g).to(torch.bfloat16)
    idx0 = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    w0 = torch.rand(N, K, generator=g)
    results = {}
    for mode in ("normal", "inference"):  # (no_grad changes nothing in a device-only path: interpreter time saved)
        with MODES[mode]():
            q, s = per_token_group_quant_fp8(x0.clone())
            buf.x[:N].copy_(q)
            buf.x_sf[:N].copy_(s)
            buf.topk_idx[:N].copy_(idx0.clone())
            buf.topk_weights[:N].copy_(w0.clone())
            y = torch.empty(N, 256, dtype=torch.bfloat16)
            stats = torch.zeros(L, dtype=torch.int32)
            fp8_mega_moe(y, l1, l2, buf, cumulative_local_expert_recv_stats=stats)
            results[mode] = [y, stats]
    _same(results)
    buf.destroy()
    return True


def test_mega_moe_under_inference_mode():
    assert launch(_mega_rank, 2, timeout_s=300) == [True, True]


def test_quant_gemm_map_topk_under_inference_mode():
    import eplb
    from moe_ep import gemm, quant

    g = torch.Generator().manual_seed(5)
    x0 = torch.randn(2, 8, 256, generator=g).to(torch.bfloat16)
    rows0 = torch.randn(128, 256, generator=g).to(torch.bfloat16)  # one 128-row block of the contiguous layout
    w0 = torch.randn(2, 128, 256, generator=g)
    wq, ws = quant.per_block_quant_fp8(w0)
    topk0 = torch.randint(0, 4, (6, 2), generator=g)
    _, log2phy, logcnt = eplb.rebalance_experts(torch.rand(1, 4) * 10, 6, 1, 1, 2)
    results = {}
    for mode, ctx in MODES.items():
        with ctx():
            x = x0.clone()
            q, s = quant.per_token_group_quant_fp8(x)
            q2, s2 = quant.silu_and_mul_quant_fp8(x)
            q3, s3 = quant.per_token_group_quant_fp8(x, column_major_scales=True, tma_aligned_scales=True)
            wq2, ws2 = quant.per_block_quant_fp8(w0.clone())
            d_masked = torch.zeros(2, 8, 128, dtype=torch.bfloat16)
            masked_m = torch.tensor([5, 8], dtype=torch.int32)
            gemm.m_grouped_fp8_gemm_nt_masked((q3, s3), (wq, ws), d_masked, masked_m, 8)
            d_contig = torch.zeros(128, 128, dtype=torch.bfloat16)
            m_indices = torch.full((128,), 1, dtype=torch.int32)
            m_indices[100:] = -1  # padding rows
            qc, sc = quant.per_token_group_quant_fp8(rows0.clone())
            gemm.m_grouped_fp8_gemm_nt_contiguous((qc, sc), (wq, ws), d_contig, m_indices)
            mapped = eplb.map_topk(topk0.clone(), log2phy[0], logcnt[0], "round_robin", seed=3, num_gpus=2,
                                   num_slots=6, impl="triton")
            results[mode] = [q, s, q2, s2, q3, s3, wq2, ws2, quant.dequant_fp8(q, s), d_masked, d_contig, mapped]
    _same(results)
    assert all(bool(t.isfinite().all()) for t in results["normal"][9:11])
