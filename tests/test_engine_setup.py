"""Engine-style Buffer set-up (written from SGLang's and vLLM's public DeepEP patterns, not copied) against moe_ep:
sizes from ``Config.get_nvl_buffer_size_hint`` / ``get_rdma_buffer_size_hint`` and
``Buffer.get_low_latency_rdma_size_hint``, then a dispatch/combine on the Buffer so sized (``symm``, the backend
that uses the sizes), checked against the references; and the hints' numbers against the symm layout."""

from __future__ import annotations

import functools
import os

import pytest
import torch

import moe_ep
from moe_ep.backends.symm import SymmBackend
from moe_ep.testing import launch
from moe_ep.testing.inputs import make_all_inputs
from moe_ep.testing.refs import ref_combine, ref_dispatch, ref_low_latency_dispatch

H, E, K, N, T = 128, 4, 2, 5, 8


def test_config_hints_cover_the_symm_layout():
    cfg = moe_ep.Buffer.get_dispatch_config(8)
    # the default: the fixed buffer every batch streams through (DeepEP's ring streams through its channels)
    assert cfg.num_max_tokens_per_rank is None
    for hidden, ranks in ((7168, 8), (4096, 4), (130, 2)):
        got = cfg.get_nvl_buffer_size_hint(hidden * 2, ranks)
        assert got == SymmBackend.get_normal_size_hint(None, hidden, 128, ranks)
        # never below what the streaming layout addresses, at any top-k up to DeepEP's 128
        assert got >= max(SymmBackend.get_normal_size_hint(None, hidden, k, ranks) for k in (1, 8, 128))
        # and below DeepEP's own hint for the same arguments (its ring: num_sms / 2 channels x NVL ranks x
        # num_max_nvl_chunked_recv_tokens slots of a row, its source meta, 128 top-k ids / weights, 128 scales)
        channels, nvl_ranks = cfg.num_sms // 2, min(ranks, 8)
        deepep = channels * nvl_ranks * cfg.num_max_nvl_chunked_recv_tokens * (hidden * 2 + 8 + 128 * (8 + 4 + 4))
        assert got <= deepep, (hidden, ranks, got, deepep)
        assert cfg.get_rdma_buffer_size_hint(hidden * 2, ranks) == 0
    small = moe_ep.Config(num_max_tokens_per_rank=T, num_max_topk=K)
    assert small.get_nvl_buffer_size_hint(H * 2, 2) == SymmBackend.get_normal_size_hint(T, H, K, 2)
    assert small.get_nvl_buffer_size_hint(H * 2 - 1, 2) == small.get_nvl_buffer_size_hint(H * 2, 2)
    for bad in (0, -1, 1.5, None):
        with pytest.raises(ValueError, match="hidden_bytes"):
            cfg.get_nvl_buffer_size_hint(bad, 8)
        with pytest.raises(ValueError, match="num_ranks"):
            cfg.get_rdma_buffer_size_hint(256, bad)
    with pytest.raises(ValueError, match="num_max_tokens_per_rank"):
        moe_ep.Config(num_max_tokens_per_rank=0)


# An engine that imports moe_ep in place of deep_ep; backend="symm" is the one difference (on CPU ranks "auto"
# picks "torch", which ignores the sizes).
def _sglang_style_buffer(group, hidden_size: int, param_bytes: int, num_max_dispatch_tokens_per_rank: int,
                         num_experts: int, normal: bool, low_latency: bool, config=None):
    Buffer = functools.partial(moe_ep.Buffer, backend="symm", timeout_s=60)
    num_nvl_bytes, num_rdma_bytes = 0, 0
    if normal:
        hidden_bytes = hidden_size * param_bytes
        for cfg in (config or moe_ep.Buffer.get_dispatch_config(group.size()),
                    config or moe_ep.Buffer.get_combine_config(group.size())):
            num_nvl_bytes = max(cfg.get_nvl_buffer_size_hint(hidden_bytes, group.size()), num_nvl_bytes)
            num_rdma_bytes = max(cfg.get_rdma_buffer_size_hint(hidden_bytes, group.size()), num_rdma_bytes)
    if low_latency:
        num_rdma_bytes = max(moe_ep.Buffer.get_low_latency_rdma_size_hint(
            num_max_dispatch_tokens_per_rank, hidden_size, group.size(), num_experts), num_rdma_bytes)
    return Buffer(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode=low_latency, num_qps_per_rank=20)


def _vllm_style_ll_buffer(group, hidden_size: int, num_max_dispatch_tokens_per_rank: int, num_experts: int):
    num_rdma_bytes = moe_ep.Buffer.get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank, hidden=hidden_size,
        num_ranks=group.size(), num_experts=num_experts)
    return moe_ep.Buffer(group=group, num_nvl_bytes=0, num_rdma_bytes=num_rdma_bytes, low_latency_mode=True,
                         num_qps_per_rank=num_experts // group.size(), backend="symm", timeout_s=60)


def _engine_rank(rank: int, world: int, engine: str) -> bool:
    import torch.distributed as dist

    group = dist.group.WORLD
    ins = make_all_inputs(world, N, H, E, K, seed=9)
    me = ins[rank]
    xs, idxs, ws = [i.x for i in ins], [i.topk_idx for i in ins], [i.topk_weights for i in ins]
    if engine == "vllm":
        buf = _vllm_style_ll_buffer(group, H, T, E)
    else:  # normal + low latency; the default config (2560 tokens per rank) and one sized for T tokens
        config = None if engine == "sglang" else moe_ep.Config(num_max_tokens_per_rank=T, num_max_topk=K)
        buf = _sglang_style_buffer(group, H, 2, T, E, normal=True, low_latency=True, config=config)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(me.topk_idx, E)
        rx, _, rw, _, handle, _ = buf.dispatch(me.x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                               num_tokens_per_expert=per_expert, topk_idx=me.topk_idx,
                                               topk_weights=me.topk_weights)
        assert torch.equal(rx, ref_dispatch(rank, xs, idxs, ws, E)[0])
        comb, _, _ = buf.combine(rx, handle, topk_weights=rw)
        recv = [ref_dispatch(r, xs, idxs, ws, E) for r in range(world)]
        assert torch.equal(comb, ref_combine(rank, [a[0] for a in recv], idxs, E, [a[3] for a in recv])[0])
    (lx, ls), count, _, _, _ = buf.low_latency_dispatch(me.x, me.topk_idx, T, E)
    ex_x, ex_s, ex_count, _ = ref_low_latency_dispatch(rank, xs, idxs, T, E, True, False, False)
    assert torch.equal(count, ex_count)
    for e in range(E // world):
        c = int(count[e])
        assert torch.equal(lx[e, :c].view(torch.uint8), ex_x[e, :c].view(torch.uint8))
        assert torch.equal(ls[e, :c], ex_s[e, :c])
    return True


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU ranks run the symm kernels in the interpreter")
@pytest.mark.parametrize("engine", ["sglang", "sglang-sized", "vllm"])
def test_engine_style_setup_then_dispatch_combine(engine):
    assert launch(_engine_rank, 2, engine, timeout_s=300) == [True, True]
