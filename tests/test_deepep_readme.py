"""DeepEP V1's README helpers (``get_buffer``, ``get_hidden_bytes``, ``dispatch_forward``, ``dispatch_backward``,
``combine_forward``, ``combine_backward``; the low-latency ``get_buffer``, ``low_latency_dispatch``,
``low_latency_combine``), pasted as DeepEP's README (docs/legacy.md, MIT licence) prints them, run through
``moe_ep.alias`` on 2 CPU ranks, several layers in a row (the second ``get_buffer`` call reads
``num_nvl_bytes`` / ``num_rdma_bytes``; a larger layer reallocates), on ``auto`` (torch here) and on ``symm``
(chosen by ``MOE_EP_BACKEND``, as for engine code that passes no backend); every output is checked against the
single-process references."""

# ruff: noqa: E501  (DeepEP's README lines, verbatim)
from __future__ import annotations

import os

import pytest
import torch

from moe_ep.testing import launch

# Kernels on CPU tensors need the Triton interpreter (tests/conftest.py sets it where no GPU exists); on a
# GPU machine run this file with `TRITON_INTERPRET=1`.
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU ranks run the symm kernels in the Triton interpreter")

# ----------------------------------------------------------------------------- DeepEP's README, normal kernels
README_NORMAL = '''
import torch
import torch.distributed as dist
from typing import List, Tuple, Optional, Union

from deep_ep import Buffer, EventOverlap

# Communication buffer (will allocate at runtime)
_buffer: Optional[Buffer] = None

# Set the number of SMs to use
# NOTES: this is a static variable
Buffer.set_num_sms(24)


# You may call this function at the framework initialization
def get_buffer(group: dist.ProcessGroup, hidden_bytes: int) -> Buffer:
    global _buffer

    # NOTES: you may also replace `get_*_config` with your auto-tuned results via all the tests
    num_nvl_bytes, num_rdma_bytes = 0, 0
    for config in (Buffer.get_dispatch_config(group.size()), Buffer.get_combine_config(group.size())):
        num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, group.size()), num_nvl_bytes)
        num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, group.size()), num_rdma_bytes)

    # Allocate a buffer if not existed or not enough buffer size
    if _buffer is None or _buffer.group != group or _buffer.num_nvl_bytes < num_nvl_bytes or _buffer.num_rdma_bytes < num_rdma_bytes:
        _buffer = Buffer(group, num_nvl_bytes, num_rdma_bytes)
    return _buffer


def get_hidden_bytes(x: torch.Tensor) -> int:
    t = x[0] if isinstance(x, tuple) else x
    return t.size(1) * max(t.element_size(), 2)


def dispatch_forward(x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                     topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                     num_experts: int, previous_event: Optional[EventOverlap] = None) -> \\
        Tuple[Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor, List, Tuple, EventOverlap]:
    # NOTES: an optional `previous_event` means a CUDA event captured that you want to make it as a dependency
    # of the dispatch kernel, it may be useful with communication-computation overlap. For more information, please
    # refer to the docs of `Buffer.dispatch`
    global _buffer

    # Calculate layout before actual dispatch
    num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, previous_event = \\
        _buffer.get_dispatch_layout(topk_idx, num_experts,
                                    previous_event=previous_event, async_finish=True,
                                    allocate_on_comm_stream=previous_event is not None)
    # Do MoE dispatch
    # NOTES: the CPU will wait for GPU's signal to arrive, so this is not compatible with CUDA graph
    # Unless you specify `num_worst_tokens`, but this flag is for intranode only
    # For more advanced usages, please refer to the docs of the `dispatch` function
    recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event = \\
        _buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights,
                         num_tokens_per_rank=num_tokens_per_rank, num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
                         is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert,
                         previous_event=previous_event, async_finish=True,
                         allocate_on_comm_stream=True)
    # For event management, please refer to the docs of the `EventOverlap` class
    return recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event


def dispatch_backward(grad_recv_x: torch.Tensor, grad_recv_topk_weights: torch.Tensor, handle: Tuple) -> \\
        Tuple[torch.Tensor, torch.Tensor, EventOverlap]:
    global _buffer

    # The backward process of MoE dispatch is actually a combine
    # For more advanced usages, please refer to the docs of the `combine` function
    combined_grad_x, combined_grad_recv_topk_weights, event = \\
        _buffer.combine(grad_recv_x, handle, topk_weights=grad_recv_topk_weights, async_finish=True)

    # For event management, please refer to the docs of the `EventOverlap` class
    return combined_grad_x, combined_grad_recv_topk_weights, event


def combine_forward(x: torch.Tensor, handle: Tuple, previous_event: Optional[EventOverlap] = None) -> \\
        Tuple[torch.Tensor, EventOverlap]:
    global _buffer

    # Do MoE combine
    # For more advanced usages, please refer to the docs of the `combine` function
    combined_x, _, event = _buffer.combine(x, handle, async_finish=True, previous_event=previous_event,
                                           allocate_on_comm_stream=previous_event is not None)

    # For event management, please refer to the docs of the `EventOverlap` class
    return combined_x, event


def combine_backward(grad_combined_x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                     handle: Tuple, previous_event: Optional[EventOverlap] = None) -> \\
        Tuple[Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], EventOverlap]:
    global _buffer

    # The backward process of MoE combine is actually a dispatch
    # For more advanced usages, please refer to the docs of the `dispatch` function
    grad_x, _, _, _, _, event = _buffer.dispatch(grad_combined_x, handle=handle, async_finish=True,
                                                 previous_event=previous_event,
                                                 allocate_on_comm_stream=previous_event is not None)

    # For event management, please refer to the docs of the `EventOverlap` class
    return grad_x, event
'''

# ------------------------------------------------------------------------ DeepEP's README, low-latency kernels
README_LOW_LATENCY = '''
import torch
import torch.distributed as dist
from typing import Tuple, Optional

from deep_ep import Buffer

# Communication buffer (will allocate at runtime)
# NOTES: there is no SM control API for the low-latency kernels
_buffer: Optional[Buffer] = None


# You may call this function at the framework initialization
def get_buffer(group: dist.ProcessGroup, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> Buffer:
    # NOTES: the low-latency mode will consume much more space than the normal mode
    # So we recommend that `num_max_dispatch_tokens_per_rank` (the actual batch size in the decoding engine) should be less than 256
    global _buffer
    num_rdma_bytes = Buffer.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, group.size(), num_experts)

    # Allocate a buffer if not existed or not enough buffer size
    if _buffer is None or _buffer.group != group or not _buffer.low_latency_mode or _buffer.num_rdma_bytes < num_rdma_bytes:
        # NOTES: for the best performance, the QP number **must** be equal to the number of the local experts
        assert num_experts % group.size() == 0
        _buffer = Buffer(group, 0, num_rdma_bytes, low_latency_mode=True, num_qps_per_rank=num_experts // group.size())
    return _buffer


def low_latency_dispatch(hidden_states: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int, num_experts: int):
    global _buffer

    # Do MoE dispatch, compatible with CUDA graph (but you may restore some buffer status once you replay)
    recv_hidden_states, recv_expert_count, handle, event, hook = \\
        _buffer.low_latency_dispatch(hidden_states, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                     async_finish=False, return_recv_hook=True)

    # NOTES: the actual tensor will not be received only if you call `hook()`,
    # it is useful for double-batch overlapping, but **without any SM occupation**
    # If you don't want to overlap, please set `return_recv_hook=False`
    # Later, you can use our GEMM library to do the computation with this specific format
    return recv_hidden_states, recv_expert_count, handle, event, hook


def low_latency_combine(hidden_states: torch.Tensor,
                        topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: Tuple):
    global _buffer

    # Do MoE combine, compatible with CUDA graph (but you may restore some buffer status once you replay)
    combined_hidden_states, event_overlap, hook = \\
        _buffer.low_latency_combine(hidden_states, topk_idx, topk_weights, handle,
                                    async_finish=False, return_recv_hook=True)

    # NOTES: the same behavior as described in the dispatch kernel
    return combined_hidden_states, event_overlap, hook
'''

E, K = 8, 2
TOKENS = [6, 3]
LAYER_HIDDEN = [128, 256, 256]  # the second layer reallocates (larger hint), the third reuses the Buffer


def _readme(src: str) -> dict:
    import moe_ep.alias

    moe_ep.alias.install(["deep_ep"])
    ns = {"__name__": "deepep_readme"}
    exec(compile(src, "deepep_readme.py", "exec"), ns)  # noqa: S102 - DeepEP's README code, as engines paste it
    return ns


def _set_backend(backend: str) -> None:
    if backend == "auto":
        os.environ.pop("MOE_EP_BACKEND", None)
    else:
        os.environ["MOE_EP_BACKEND"] = backend


def _normal_rank(rank: int, world: int, backend: str) -> list:
    import torch.distributed as dist

    from moe_ep.testing.inputs import make_all_inputs
    from moe_ep.testing.refs import ref_combine, ref_dispatch

    _set_backend(backend)
    ns = _readme(README_NORMAL)
    group = dist.group.WORLD
    buffers = []
    with torch.inference_mode():
        for layer, hidden in enumerate(LAYER_HIDDEN):
            inputs = make_all_inputs(world, TOKENS[:world], hidden, E, K, seed=11 + layer)
            me = inputs[rank]
            buf = ns["get_buffer"](group, ns["get_hidden_bytes"](me.x))
            buffers.append(buf)
            assert buf.backend_name == ("torch" if backend == "auto" else backend)
            recv_x, recv_idx, recv_w, counts, handle, event = ns["dispatch_forward"](
                me.x, me.topk_idx, me.topk_weights, E)
            event.current_stream_wait()
            xs, idxs, ws = [i.x for i in inputs], [i.topk_idx for i in inputs], [i.topk_weights for i in inputs]
            refs = [ref_dispatch(r, xs, idxs, ws, E) for r in range(world)]
            ex_x, _, ex_idx, ex_w, ex_counts = refs[rank]
            assert torch.equal(recv_x, ex_x) and torch.equal(recv_idx, ex_idx) and torch.equal(recv_w, ex_w)
            assert counts == ex_counts
            y = (recv_x.float() * (layer + 2)).to(torch.bfloat16)  # the "experts"
            combined, event = ns["combine_forward"](y, handle)
            event.current_stream_wait()
            ys = [(refs[r][0].float() * (layer + 2)).to(torch.bfloat16) for r in range(world)]
            want, _ = ref_combine(rank, ys, idxs, E)
            assert torch.equal(combined, want), f"layer {layer}: combine differs"
            # the backward helpers: combine_backward is a cached dispatch, dispatch_backward a combine
            grad_x, event = ns["combine_backward"](me.x, handle)
            assert torch.equal(grad_x, ex_x)
            grad, grad_w, event = ns["dispatch_backward"](y, recv_w, handle)
            assert torch.equal(grad, want) and grad_w.shape == me.topk_weights.shape
    return [id(b) for b in buffers]


def _ll_rank(rank: int, world: int, backend: str) -> list:
    import torch.distributed as dist

    from moe_ep.testing.inputs import make_all_inputs
    from moe_ep.testing.refs import ref_low_latency_combine, ref_low_latency_dispatch

    _set_backend(backend)
    ns = _readme(README_LOW_LATENCY)
    group = dist.group.WORLD
    T = 8
    buffers = []

    def experts(x, scales, le):  # dequantise, scale per local expert: row-wise, so the slot order does not matter
        deq = x.float() * scales.float().repeat_interleave(128, dim=-1)
        return (deq * (1 + 0.25 * le.view(-1, 1, 1))).to(torch.bfloat16)

    with torch.inference_mode():
        for layer, hidden in enumerate(LAYER_HIDDEN):
            inputs = make_all_inputs(world, TOKENS[:world], hidden, E, K, seed=21 + layer)
            me = inputs[rank]
            buf = ns["get_buffer"](group, T, hidden, E)
            buffers.append(buf)
            assert buf.backend_name == ("torch" if backend == "auto" else backend)
            (q, s), count, handle, event, hook = ns["low_latency_dispatch"](me.x, me.topk_idx, T, E)
            hook()
            xs, idxs = [i.x for i in inputs], [i.topk_idx for i in inputs]
            refs = [ref_low_latency_dispatch(r, xs, idxs, T, E) for r in range(world)]
            assert torch.equal(count.cpu(), refs[rank][2])
            le = torch.arange(E // world)
            y = experts(q, s, le)
            ys = [experts(r[0], r[1], le) for r in refs]
            out, event, hook = ns["low_latency_combine"](y, me.topk_idx, me.topk_weights, handle)
            hook()
            want = ref_low_latency_combine(rank, ys, idxs, [i.topk_weights for i in inputs], T, E)
            assert torch.equal(out, want), f"layer {layer}: low-latency combine differs"
    return [id(b) for b in buffers]


def _skip_auto_with_cuda(backend: str) -> None:
    if backend == "auto" and torch.cuda.is_available():
        pytest.skip("with CUDA, auto decides from the GPUs (these ranks use CPU tensors)")


def _check_reuse(ids: list) -> None:
    # layer 0 allocates, layer 1 (larger hidden) reallocates, layer 2 reuses layer 1's Buffer
    assert ids[0] != ids[1] and ids[1] == ids[2], ids


@pytest.mark.parametrize("backend", ["auto", "symm"])
def test_readme_normal_helpers_verbatim(backend):
    _skip_auto_with_cuda(backend)
    for ids in launch(_normal_rank, 2, backend, timeout_s=600):
        _check_reuse(ids)


@pytest.mark.parametrize("backend", ["auto", "symm"])
def test_readme_low_latency_helpers_verbatim(backend):
    _skip_auto_with_cuda(backend)
    for ids in launch(_ll_rank, 2, backend, timeout_s=600):
        _check_reuse(ids)
