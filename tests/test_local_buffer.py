"""DeepEP V1's ``Buffer.get_local_buffer_tensor(dtype, size=None, offset=0, use_rdma_buffer=False)`` on every
backend (vLLM's fault-tolerance retry zeroes it: the Buffer stays usable and the next call is exact),
``num_nvl_bytes`` / ``num_rdma_bytes``, and ``internode_dispatch`` / ``internode_combine`` (normal mode under
DeepEP's node-crossing names)."""

from __future__ import annotations

import inspect
import os

import pytest
import torch

from moe_ep.testing import launch
from moe_ep.testing.inputs import make_all_inputs

# Kernels on CPU tensors need the Triton interpreter (tests/conftest.py sets it where no GPU exists); on a
# GPU machine run this file with `TRITON_INTERPRET=1`.
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU ranks run the symm kernels in the Triton interpreter")

T, H, E, K = 8, 128, 8, 2


def _buffer(backend, world, ll):
    import moe_ep
    from moe_ep.backends.symm import SymmBackend

    nvl = 0 if backend == "nvshmem" or ll else SymmBackend.get_normal_size_hint(T, H, K, world)
    rdma = moe_ep.Buffer.get_low_latency_rdma_size_hint(T, H, world, E) if ll else 0
    kw = dict(provider="shm") if backend == "symm" else {}
    return moe_ep.Buffer(None, nvl, rdma, low_latency_mode=ll, backend=backend, timeout_s=60, **kw), nvl, rdma


def _ll_step(buf, me):
    recv, count, handle, _, _ = buf.low_latency_dispatch(me.x, me.topk_idx, T, E, use_fp8=False)
    y = recv * 2
    out, _, _ = buf.low_latency_combine(y, me.topk_idx, me.topk_weights, handle)
    return count.clone(), out.clone()


def _ll_rank(rank, world, backend):
    buf, nvl, rdma = _buffer(backend, world, ll=True)
    assert (buf.num_nvl_bytes, buf.num_rdma_bytes) == (nvl, rdma)
    me = make_all_inputs(world, [6, 5][:world], H, E, K, seed=3)[rank]
    with torch.inference_mode():
        first = _ll_step(buf, me)
        raw = buf.get_local_buffer_tensor(dtype=torch.int8, use_rdma_buffer=True)  # vLLM's clean_buffers()
        assert raw.dtype == torch.int8 and 0 < raw.numel() <= rdma
        # peers write into this memory: clear it while none is in a call (a retry's barriers)
        torch.distributed.barrier()
        raw.fill_(-1)  # garbage where the last call's rows were, then zero as vLLM does
        raw.zero_()
        torch.distributed.barrier()
        again = _ll_step(buf, me)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    # the signature and the slicing: offset in bytes, size in elements of dtype
    words = buf.get_local_buffer_tensor(torch.int32, torch.Size([2, 3]), 8, True)
    assert words.shape == (2, 3) and words.dtype == torch.int32
    assert words.data_ptr() == raw.data_ptr() + 8
    with pytest.raises(ValueError, match="needs"):
        buf.get_local_buffer_tensor(torch.int8, torch.Size([raw.numel() + 1]), 0, True)
    assert buf.get_local_buffer_tensor(torch.float32, use_rdma_buffer=False).numel() == 0  # no normal buffer
    return True


def _normal_rank(rank, world, backend):
    buf, nvl, _ = _buffer(backend, world, ll=False)
    assert buf.num_nvl_bytes == nvl and buf.num_rdma_bytes == 0
    inputs = make_all_inputs(world, [6, 5][:world], H, E, K, seed=4)
    me = inputs[rank]
    outs = []
    with torch.inference_mode():
        for step in range(2):
            per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(me.topk_idx, E)
            call = buf.internode_dispatch if step else buf.dispatch
            recv_x, recv_idx, recv_w, counts, handle, _ = call(
                me.x, None, per_rank, per_rdma, in_rank, per_expert, me.topk_idx, me.topk_weights)
            y = (recv_x.float() * 3).to(torch.bfloat16)
            comb = buf.internode_combine if step else buf.combine
            combined, combined_w, _ = comb(y, handle, recv_w)
            outs.append((recv_x, recv_idx, recv_w, counts, combined, combined_w))
            # zeroing the whole normal-mode buffer between calls (no peer in a call) leaves the next one exact
            torch.distributed.barrier()
            buf.get_local_buffer_tensor(torch.bfloat16).zero_()
            torch.distributed.barrier()
    a, b = outs
    assert all(torch.equal(u, v) if isinstance(u, torch.Tensor) else u == v for u, v in zip(a, b))
    return True


@pytest.mark.parametrize("backend", ["torch", "symm", "nvshmem"])
def test_local_buffer_zeroed_between_low_latency_calls(backend):
    assert launch(_ll_rank, 2, backend, timeout_s=300) == [True, True]


@pytest.mark.parametrize("backend", ["torch", "symm"])
def test_internode_names_and_zeroed_normal_buffer(backend):
    assert launch(_normal_rank, 2, backend, timeout_s=300) == [True, True]


def test_signatures_are_deepeps():
    from moe_ep import Buffer

    sig = inspect.signature(Buffer.get_local_buffer_tensor)
    assert [(p.name, p.default) for p in list(sig.parameters.values())[1:]] == [
        ("dtype", inspect.Parameter.empty), ("size", None), ("offset", 0), ("use_rdma_buffer", False)]
    names = [p for p in inspect.signature(Buffer.internode_dispatch).parameters][1:]
    assert names == ["x", "handle", "num_tokens_per_rank", "num_tokens_per_rdma_rank", "is_token_in_rank",
                     "num_tokens_per_expert", "topk_idx", "topk_weights", "expert_alignment", "num_worst_tokens",
                     "config", "previous_event", "async_finish", "allocate_on_comm_stream"]
    names = [p for p in inspect.signature(Buffer.internode_combine).parameters][1:]
    assert names == ["x", "handle", "topk_weights", "bias", "config", "previous_event", "async_finish",
                     "allocate_on_comm_stream"]


def _too_small_rank(rank, world, backend):
    import moe_ep

    kw = dict(provider="shm") if backend == "symm" else {}
    buf = moe_ep.Buffer(None, 0, 1024, low_latency_mode=True, backend=backend, timeout_s=30, **kw)
    me = make_all_inputs(world, [4, 4][:world], H, E, K, seed=5)[rank]
    with pytest.raises(ValueError) as exc:
        buf.low_latency_dispatch(me.x, me.topk_idx, T, E, use_fp8=False)
    # a Buffer sized by the hint runs the same call
    ok = moe_ep.Buffer(None, 0, moe_ep.Buffer.get_low_latency_rdma_size_hint(T, H, world, E), low_latency_mode=True,
                       backend=backend, timeout_s=30, **kw)
    ok.low_latency_dispatch(me.x, me.topk_idx, T, E, use_fp8=False)
    return str(exc.value)


def test_too_small_low_latency_buffer_refused_alike_on_every_backend():
    msgs = {b: launch(_too_small_rank, 2, b, timeout_s=300) for b in ("torch", "symm")}
    assert msgs["torch"] == msgs["symm"], msgs
    assert "num_rdma_bytes=1024" in msgs["torch"][0] and "use num_rdma_bytes >=" in msgs["torch"][0]
