"""microbatch: batch splitting, the stage executor, and two-microbatch MoE layers equal to one batch.

The layer's compute is written with per-row reductions only (broadcast multiply + sum over the hidden
dim, no GEMM whose blocking could depend on the batch size), and dispatch/combine reduce per token, so
running the layer as two microbatches must give the single-batch output bitwise.
"""

from __future__ import annotations

import os

import pytest
import torch

from microbatch import (
    YIELD,
    LowLatencyCommunicator,
    NormalCommunicator,
    TorchA2ACommunicator,
    moe_layer_schedule,
    run_single,
    run_two_microbatches,
    split_batch,
    stages,
)
from moe_ep.fp8 import dequant_fp8_ref
from moe_ep.testing import assert_bitwise_equal, launch


# ----------------------------------------------------------------------------- split_batch
def test_split_prefill_balances_at_sequence_boundary():
    s = split_batch([30, 20, 25, 25], "prefill")
    assert s.is_split and s.num_tokens == (50, 50) and not s.cut_inside_sequence
    assert s.seq_lens == ([30, 20], [25, 25]) and s.token_slices == (slice(0, 50), slice(50, 100))


def test_split_prefill_cuts_inside_a_sequence_below_threshold():
    s = split_batch([5, 3, 100], "prefill", threshold=0.48)
    assert s.cut_inside_sequence and s.num_tokens == (54, 54) and s.seq_lens == ([5, 3, 46], [54])
    loose = split_batch([40, 60], "prefill", threshold=0.3)  # 0.4 >= 0.3: keep the boundary
    assert loose.num_tokens == (40, 60) and not loose.cut_inside_sequence
    one = split_batch([9], "prefill")
    assert one.num_tokens == (4, 5) and one.seq_lens == ([4], [5])


def test_split_decode_halves_sequences():
    s = split_batch([1] * 7, "decode")
    assert s.num_tokens == (4, 3) and s.seq_lens == ([1] * 4, [1] * 3)
    assert s.num_tokens_tensor().dtype == torch.int32 and s.num_tokens_tensor().tolist() == [4, 3]


@pytest.mark.parametrize("lens,mode", [([], "prefill"), ([1], "prefill"), ([1], "decode"), ([0, 0], "prefill")])
def test_split_degenerate_batches_do_not_split(lens, mode):
    s = split_batch(lens, mode)
    assert not s.is_split and s.num_tokens == (sum(lens), 0)


def test_split_bad_arguments():
    with pytest.raises(ValueError, match="mode"):
        split_batch([1, 2], "train")
    with pytest.raises(ValueError, match="threshold"):
        split_batch([1, 2], threshold=0.7)
    with pytest.raises(ValueError, match="non-negative"):
        split_batch([1, -2])


def _rank_agree(rank, world):
    lens = [1] if rank == 1 else [3, 4]  # rank 1 would get an empty microbatch
    world_group = torch.distributed.group.WORLD
    return split_batch(lens, "decode").is_split, split_batch(lens, "decode", group=world_group).is_split


def test_split_ranks_agree():
    assert launch(_rank_agree, 2, timeout_s=60) == [(True, False), (False, False)]


# ----------------------------------------------------------------------------- executor
def test_executor_interleaves_stages():
    log = []

    def op(name):
        return lambda s: log.append((s["id"], name))

    ops = [op("a"), YIELD, op("b"), op("c"), YIELD, op("d")]
    assert [len(s) for s in stages(ops)] == [1, 2, 1]
    run_two_microbatches(ops, {"id": 0}, {"id": 1})
    assert log == [(0, "a"), (1, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (0, "d"), (1, "d")]
    log.clear()
    run_two_microbatches(ops, {"id": 0}, {"id": 1}, offset=1)
    assert log == [(0, "a"), (0, "b"), (0, "c"), (1, "a"), (0, "d"), (1, "b"), (1, "c"), (1, "d")]
    with pytest.raises(TypeError):
        stages([op("a"), 3])


# ----------------------------------------------------------------------------- MoE layer
H, F, E, K = 128, 32, 8, 3


def _weights():
    g = torch.Generator().manual_seed(1234)
    return dict(wa=torch.randn(H, H, generator=g) / H ** 0.5, wg=torch.randn(E, H, generator=g),
                w1=torch.randn(E, F, H, generator=g) / H ** 0.5, w2=torch.randn(E, H, F, generator=g) / F ** 0.5,
                ws1=torch.randn(F, H, generator=g) / H ** 0.5, ws2=torch.randn(H, F, generator=g) / F ** 0.5)


def _rowdot(x, w):
    """``x @ w.T`` as a broadcast multiply and a sum per row: each row's result is independent of the batch."""
    return (x.unsqueeze(-2) * w).sum(-1)


def _compute(W, rank, world):
    L = E // world

    def attention(s):
        h = s["hidden"].float()
        s["x"] = (h + torch.tanh(_rowdot(h, W["wa"]))).to(torch.bfloat16)

    def gate(s):
        scores = _rowdot(s["x"].float(), W["wg"]).sigmoid()
        w, idx = scores.topk(K, dim=-1)
        s["topk_idx"], s["topk_weights"] = idx.to(torch.int64), (w / w.sum(-1, keepdim=True)).float()

    def mlp(x, e):
        return _rowdot(torch.nn.functional.silu(_rowdot(x, W["w1"][e])), W["w2"][e])

    def experts(s):
        rx = s["recv_x"]
        x = dequant_fp8_ref(*rx) if isinstance(rx, tuple) else rx.float()
        if s["layout"] == "masked":  # [L, R*T, H], the combine applies the weights
            s["expert_out"] = torch.stack([mlp(x[e], rank * L + e) for e in range(L)]).to(torch.bfloat16)
        else:  # [M, H] rows, weighted here
            out = torch.zeros(x.shape[0], H)
            for k in range(K):
                idx = s["recv_topk_idx"][:, k]
                for e in range(L):
                    rows = (idx == e).nonzero().flatten()
                    if rows.numel():
                        out[rows] += s["recv_topk_weights"][rows, k:k + 1] * mlp(x[rows], rank * L + e)
            s["expert_out"] = out.to(torch.bfloat16)

    def shared(s):
        s["shared_out"] = _rowdot(torch.nn.functional.silu(_rowdot(s["x"].float(), W["ws1"])), W["ws2"])

    return dict(attention=attention, gate=gate, experts=experts, shared_expert=shared)


def _rank_layer(rank, world, kind, mode, n):
    import moe_ep

    torch.manual_seed(rank)
    hidden = torch.randn(n, H).to(torch.bfloat16)
    if kind == "ll-symm":  # two low-latency dispatches in flight on the device-initiated backend
        from moe_ep.backends.symm import SymmBackend

        buf = moe_ep.Buffer(None, low_latency_mode=True, backend="symm", timeout_s=60,
                            num_rdma_bytes=SymmBackend.get_low_latency_size_hint(n, H, world, E, K))
    elif kind == "ll-nvshmem":  # the same over the (emulated) NVSHMEM transport
        from moe_ep.backends.nvshmem import NvshmemBackend

        buf = moe_ep.Buffer(None, 0, NvshmemBackend.get_low_latency_size_hint(n, H, world, E, K), True,
                            backend="nvshmem", timeout_s=60)
    else:
        buf = moe_ep.Buffer(None, low_latency_mode=kind == "ll", backend="torch", timeout_s=60)
    comm = {"ll": lambda: LowLatencyCommunicator(buf, n, E),
            "ll-symm": lambda: LowLatencyCommunicator(buf, n, E),
            "ll-nvshmem": lambda: LowLatencyCommunicator(buf, n, E),
            "normal": lambda: NormalCommunicator(buf, E),
            "a2a": lambda: TorchA2ACommunicator(buf, E)}[kind]()
    ops = moe_layer_schedule(comm, mode=mode, **_compute(_weights(), rank, world))
    whole = run_single(ops, {"hidden": hidden})["out"]
    split = split_batch([n] if mode == "prefill" else [1] * n, mode, group=torch.distributed.group.WORLD)
    assert split.is_split
    a, b = run_two_microbatches(ops, {"hidden": hidden[split.token_slices[0]]}, {"hidden": hidden[split.token_slices[1]]})
    assert_bitwise_equal(torch.cat([a["out"], b["out"]]), whole, f"rank {rank} two-microbatch output")
    assert bool(whole.abs().sum() > 0)
    return True


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU ranks run Triton kernels in the interpreter")
@pytest.mark.parametrize("world,kind,mode", [(2, "ll", "decode"), (2, "normal", "prefill"), (2, "a2a", "prefill"),
                                             (4, "ll", "prefill"), (4, "normal", "decode"), (2, "ll-symm", "decode"),
                                             (4, "ll-symm", "prefill"), (2, "ll-nvshmem", "decode")])
def test_two_microbatches_equal_one_batch(world, kind, mode):
    assert launch(_rank_layer, world, kind, mode, 9, timeout_s=240) == [True] * world


def _rank_llwrong(rank, world):
    import moe_ep

    buf = moe_ep.Buffer(None, low_latency_mode=True, backend="torch", timeout_s=30)
    comm = LowLatencyCommunicator(buf, 4, E)
    with pytest.raises(RuntimeError, match="before its send"):
        comm.dispatch_recv({})
    with pytest.raises(TypeError):
        moe_layer_schedule(object(), attention=None, gate=None, experts=None)
    return True


def test_communicator_order_errors():
    assert launch(_rank_llwrong, 1, timeout_s=60) == [True]


def _rank_graph(rank, world):
    """Decode layer, two microbatches over the symm low-latency path, captured in one CUDA graph and
    replayed with new data; every replay equals the eager single-batch layer."""
    import moe_ep
    from moe_ep.backends.symm import SymmBackend

    dev = torch.device("cuda", torch.cuda.current_device())
    n = 16
    buf = moe_ep.Buffer(None, low_latency_mode=True, backend="symm", device=dev, timeout_s=30,
                        num_rdma_bytes=SymmBackend.get_low_latency_size_hint(n, H, world, E, K))
    W = {k: v.to(dev) for k, v in _weights().items()}
    ops = moe_layer_schedule(LowLatencyCommunicator(buf, n, E), mode="decode", **_compute(W, rank, world))
    static = torch.randn(n, H, device=dev).to(torch.bfloat16)
    a, b = {"hidden": static[: n // 2]}, {"hidden": static[n // 2:]}
    run_two_microbatches(ops, a, b)  # warm-up (compiles the kernels)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_two_microbatches(ops, a, b)
    for step in range(3):
        static.copy_(torch.randn(n, H, device=dev).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        out = torch.cat([a["out"], b["out"]])
        expected = run_single(ops, {"hidden": static.clone()})["out"]
        assert_bitwise_equal(out, expected, f"replay {step}")
    buf.check_status()
    return True


@pytest.mark.gpu
def test_decode_two_microbatches_cuda_graph():
    assert launch(_rank_graph, 1, backend="nccl", timeout_s=300) == [True]
