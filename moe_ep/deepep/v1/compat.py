"""DeepEP V1 calls of :class:`moe_ep.Buffer` that map onto its other calls: ``internode_dispatch`` /
``internode_combine`` (normal mode, whatever the topology) and ``get_local_buffer_tensor`` (a view of this rank's
buffer memory, e.g. to clear it after a fault, as vLLM's fault tolerance does).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from ...events import EventOverlap

__all__ = ["DeepEPV1Calls"]


class DeepEPV1Calls:
    """A base class of :class:`moe_ep.Buffer` (it reads the Buffer's ``_impl``, ``dispatch`` and ``combine``)."""

    def internode_dispatch(self, x: Union[torch.Tensor, tuple], handle=None,
                           num_tokens_per_rank: Optional[torch.Tensor] = None,
                           num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                           is_token_in_rank: Optional[torch.Tensor] = None,
                           num_tokens_per_expert: Optional[torch.Tensor] = None,
                           topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                           expert_alignment: int = 1, num_worst_tokens: int = 0, config=None,
                           previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                           allocate_on_comm_stream: bool = False):
        """DeepEP V1's node-crossing dispatch (its arguments, its returns). Here it is :meth:`dispatch`: every
        backend's normal mode covers ranks on several nodes (``torch``; node-aware with ``ranks_per_node=``), so
        there is one path; ``num_tokens_per_rdma_rank`` is accepted and not needed. Returns ``(recv_x,
        recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event)``."""
        return self.dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                             num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
                             config, previous_event, async_finish, allocate_on_comm_stream)

    def internode_combine(self, x: torch.Tensor, handle, topk_weights: Optional[torch.Tensor] = None,
                          bias: Union[torch.Tensor, tuple, None] = None, config=None,
                          previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                          allocate_on_comm_stream: bool = False):
        """DeepEP V1's node-crossing combine: :meth:`combine` (see :meth:`internode_dispatch`). Returns
        ``(combined_x, combined_topk_weights, event)``."""
        return self.combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                            allocate_on_comm_stream)

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """DeepEP: this rank's buffer as a ``dtype`` tensor, starting ``offset`` bytes in; ``size`` (a shape):
        its first ``size.numel()`` elements in that shape. ``use_rdma_buffer=True``: the ``num_rdma_bytes``
        buffer (low-latency mode here), else the ``num_nvl_bytes`` one. A size of 0 gives an empty tensor.

        On ``symm`` / ``nvshmem`` it is the message area the kernels write (the signal words, stamps and status
        live outside it, so clearing it, e.g. ``.zero_()`` after a fault, leaves the Buffer usable and the next
        call exact); on ``torch``, which allocates per call, it is memory of the asked size that no call reads.
        Peers write into this memory: write to it only while no rank of the group is in a call (between two
        barriers of the group, as a fault-tolerance retry does), or a peer's next call loses its rows."""
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise ValueError(f"offset must be a non-negative int (bytes), got {offset!r}")
        raw = self._impl.local_buffer(bool(use_rdma_buffer))
        if offset > raw.numel():
            raise ValueError(f"offset={offset} is past the end of the {raw.numel()}-byte buffer")
        elem = torch.empty((), dtype=dtype).element_size()
        usable = (raw.numel() - offset) // elem * elem
        tensor = raw[offset:offset + usable].view(dtype)
        if size is None:
            return tensor
        size = torch.Size(size)
        if size.numel() > tensor.numel():
            raise ValueError(f"size {tuple(size)} needs {size.numel()} elements of {dtype}, the buffer has "
                             f"{tensor.numel()} from offset {offset}")
        return tensor[:size.numel()].view(size)
