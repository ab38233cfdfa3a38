"""The decode MoE layer never reads the device on the host (so it captures into one CUDA graph).

CPU: the layer (symm backend, low-latency mode, 2 and 4 forked ranks) and the two-microbatch decode
schedule built on it run with every host read trapped (:func:`moe_ep.testing.traps.host_reads_trapped`)
and give the same bits as an untrapped run. GPU (``gpu`` marker): both captured in a CUDA graph and
replayed with new data, each replay equal to the eager layer.
"""

from __future__ import annotations

import os

import pytest
import torch

from moe_ep.testing import assert_bitwise_equal, launch
from moe_ep.testing.traps import HostReadError, host_reads_trapped

H, INTER, E, K = 128, 128, 8, 2


def _layer(rank: int, world: int, n: int, device: torch.device, **buffer_kwargs):
    import moe_ep
    from moe_ep.backends.symm import SymmBackend
    from moe_ep.layer.experts import ExpertWeights
    from moe_ep.layer.moe import MoELayer

    g = torch.Generator().manual_seed(11)
    w13 = torch.randn(E, 2 * INTER, H, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, INTER, generator=g) / INTER ** 0.5
    num_local = E // world
    sl = slice(rank * num_local, (rank + 1) * num_local)
    weights = ExpertWeights.from_float(w13[sl].to(device), w2[sl].to(device))
    shared_w = (torch.randn(H, H, generator=g) / H ** 0.5).to(torch.bfloat16).to(device)
    buf = moe_ep.Buffer(None, explicitly_destroy=True, low_latency_mode=True, backend="symm", timeout_s=60, device=device,
                        num_rdma_bytes=SymmBackend.get_low_latency_size_hint(n, H, world, E, K), **buffer_kwargs)
    layer = MoELayer(buf, weights, E, mode="decode", num_max_dispatch_tokens_per_rank=n,
                     shared_expert=lambda x: (x.float() @ shared_w.float()).to(torch.bfloat16))
    return buf, layer


def _routing(n: int, seed: int, device: torch.device):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)]).to(torch.int64)
    w = torch.rand(n, K, generator=g)
    return x.to(device), idx.to(device), w.to(device)


def _schedule(layer, buf, n):
    from microbatch import LowLatencyCommunicator, moe_layer_schedule

    def attention(state):
        state["x"] = state["hidden"]

    def gate(state):
        state["topk_idx"], state["topk_weights"] = state["route"]

    return moe_layer_schedule(LowLatencyCommunicator(buf, n, E), attention=attention, gate=gate,
                              experts=layer.experts, shared_expert=lambda s: s.update(shared_out=layer.shared_expert(s["x"])),
                              mode="decode")


def _rank_trapped(rank: int, world: int) -> bool:
    from microbatch import run_single, run_two_microbatches

    n, cpu = 6, torch.device("cpu")
    buf, layer = _layer(rank, world, n, cpu)
    x, idx, w = _routing(n, 100 + rank, cpu)
    eager = layer(x, idx, w)
    # The Buffer's topk_idx value checks read the host; it skips them by itself while a CUDA graph is
    # being captured, which a CPU cannot detect: turn them off for the trapped runs.
    buf.check_inputs = False
    with host_reads_trapped():
        trapped = layer(x, idx, w)
    assert_bitwise_equal(trapped, eager, f"rank {rank}: trapped layer")
    assert bool(eager.abs().sum() > 0)
    # The two-microbatch decode schedule on the same layer, trapped too.
    ops = _schedule(layer, buf, n)
    whole = run_single(ops, {"hidden": x, "route": (idx, w)})["out"]
    half = n // 2
    a, b = {"hidden": x[:half], "route": (idx[:half], w[:half])}, {"hidden": x[half:], "route": (idx[half:], w[half:])}
    with host_reads_trapped():
        run_two_microbatches(ops, a, b, offset=1)
    assert_bitwise_equal(torch.cat([a["out"], b["out"]]), whole, f"rank {rank}: trapped two microbatches")
    buf.destroy()
    return True


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU ranks run the Triton kernels in the interpreter")
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 ranks: -m slow (CI runs it)
def test_decode_layer_has_no_host_reads(world):
    assert launch(_rank_trapped, world, timeout_s=300) == [True] * world


def test_trap_catches_host_reads():
    t = torch.ones(3)
    calls = [lambda: t.sum().item(), lambda: t.tolist(), lambda: bool(t[0]), lambda: t.nonzero(), lambda: int(t[0]),
             lambda: t.numpy(), lambda: t.cpu(), lambda: t.to("cpu"), lambda: torch.unique(t), lambda: float(t[1])]
    with host_reads_trapped():
        for i, call in enumerate(calls):
            with pytest.raises(HostReadError):
                call()
                pytest.fail(f"host read {i} was not trapped")
        t.to(torch.float16)  # dtype casts are not host reads
    assert t.sum().item() == 3.0  # restored afterwards


def test_trap_flags_the_prefill_path():
    """The contiguous experts read counts on the host when the dispatch gave none: the trap must see it."""
    from moe_ep.layer.experts import ExpertWeights, contiguous_experts

    weights = ExpertWeights.from_float(torch.randn(2, 256, 128), torch.randn(2, 128, 128))
    x = torch.randn(4, 128).to(torch.bfloat16)
    idx = torch.tensor([[0, 1], [1, -1], [0, -1], [-1, -1]])
    with host_reads_trapped(), pytest.raises(HostReadError):
        contiguous_experts(x, idx, torch.ones(4, 2), weights)


def _rank_graph(rank: int, world: int) -> bool:
    from microbatch import run_two_microbatches

    dev = torch.device("cuda", torch.cuda.current_device())
    n = 16
    buf, layer = _layer(rank, world, n, dev)
    x, idx, w = _routing(n, 1, dev)
    static_x, static_idx, static_w = x.clone(), idx.clone(), w.clone()
    layer(static_x, static_idx, static_w)  # warm-up: compiles the kernels
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer(static_x, static_idx, static_w)
    ops = _schedule(layer, buf, n)
    a = {"hidden": static_x[: n // 2], "route": (static_idx[: n // 2], static_w[: n // 2])}
    b = {"hidden": static_x[n // 2:], "route": (static_idx[n // 2:], static_w[n // 2:])}
    run_two_microbatches(ops, a, b, offset=1)
    torch.cuda.synchronize()
    graph2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph2):
        run_two_microbatches(ops, a, b, offset=1)
    for step in range(3):
        nx, nidx, nw = _routing(n, 50 + step, dev)
        static_x.copy_(nx)
        static_idx.copy_(nidx)
        static_w.copy_(nw)
        graph.replay()
        torch.cuda.synchronize()
        expected = layer(nx, nidx, nw)
        assert_bitwise_equal(static_out, expected, f"layer replay {step}")
        graph2.replay()
        torch.cuda.synchronize()
        assert_bitwise_equal(torch.cat([a["out"], b["out"]]), expected, f"two-microbatch replay {step}")
    buf.check_status()
    buf.destroy()
    return True


@pytest.mark.gpu
def test_decode_layer_cuda_graph():
    assert launch(_rank_graph, 1, backend="nccl", timeout_s=300) == [True]
