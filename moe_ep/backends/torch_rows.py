"""Byte rows of the ``torch`` backend: packing a dispatch's fields into ``uint8`` rows and back, the layout of a
``topk_idx``, and the worst-case padding of received rows.

Everything travels as ``uint8`` rows (so FP8 crosses gloo unharmed); the wire formats are listed in
:mod:`moe_ep.backends.torch_a2a`. Functions take torch tensors on any device; host tensors do the small routing
bookkeeping in numpy (:func:`moe_ep.topk_layout._on_host`), with the same values; the layout of a ``topk_idx``
(:func:`layout_from_topk`) lives in :mod:`moe_ep.topk_layout`, which the input checks share.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..topk_layout import _on_host, layout_from_topk  # noqa: F401  (layout_from_topk: importable here)

__all__ = ["layout_from_topk", "localize_topk", "pad_to_worst", "unpack_rows"]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """Rows of ``t`` (`[M, ...]`) as `[M, nbytes]` uint8 (a view when ``t`` is contiguous)."""
    if t.numel() == 0:  # views of empty tensors can carry strides that .view(uint8) refuses
        return torch.empty(t.shape[0], math.prod(t.shape[1:]) * t.element_size(), dtype=torch.uint8,
                           device=t.device)
    t = t.contiguous()
    return (t if t.dim() == 2 else t.reshape(t.shape[0], -1)).view(torch.uint8)


def _from_bytes(b: torch.Tensor, dtype: torch.dtype, cols: int) -> torch.Tensor:
    """Byte rows `[M, cols * itemsize]` (a column slice of received rows) as `[M, cols]` ``dtype``: always a new
    tensor on the host (numpy copies it), on a device a copy unless the slice is contiguous and aligned."""
    if b.shape[0] == 0:
        return torch.empty(0, cols, dtype=dtype, device=b.device)
    if _on_host(b):
        return torch.from_numpy(np.array(b.numpy(), order="C")).view(dtype)
    b = b.contiguous().reshape(-1)  # a one-row slice is already "contiguous" but may start misaligned
    if b.storage_offset() % dtype.itemsize:
        b = b.clone()
    return b.view(dtype).view(-1, cols)


def _gather_rows(cols: list, idx: torch.Tensor) -> torch.Tensor:
    """Byte columns ``cols`` (`[N, w_i]` uint8) side by side, rows ``idx``: `[len(idx), sum w_i]` (host: numpy)."""
    if _on_host(idx):
        return torch.from_numpy(np.concatenate([c.numpy() for c in cols], axis=1)[idx.numpy()])
    return (torch.cat(cols, dim=1) if len(cols) > 1 else cols[0]).index_select(0, idx)


def _rows_by_rank(is_token_in_rank: torch.Tensor) -> torch.Tensor:
    """Token index of each row a dispatch sends, ordered by destination rank, then token (host: numpy)."""
    if _on_host(is_token_in_rank):
        return torch.from_numpy(np.nonzero(is_token_in_rank.numpy().T)[1])
    return is_token_in_rank.t().nonzero()[:, 1]


def _token_index_bytes(x: torch.Tensor) -> torch.Tensor:
    """Token indices ``0 .. n-1`` of ``x`` (`[n, ...]`) as int32 byte rows `[n, 4]` (a dispatch's source-index
    column)."""
    n = x.shape[0]
    if _on_host(x):
        return torch.from_numpy(np.arange(n, dtype=np.int32).view(np.uint8).reshape(n, 4))
    return _bytes(torch.arange(n, dtype=torch.int32, device=x.device).view(n, 1))


def _count_local(local_idx: torch.Tensor, num_local: int) -> list:
    """Selections of each local expert among received local ids (-1 elsewhere), as a list (host: numpy)."""
    if _on_host(local_idx):
        return np.bincount(local_idx.numpy().ravel() + 1, minlength=num_local + 1)[1:].tolist()
    return torch.bincount(local_idx.view(-1) + 1, minlength=num_local + 1)[1:].tolist()


def unpack_rows(recv: torch.Tensor, x_dtype: torch.dtype, hidden: int, x_scales) -> tuple:
    """The payload and scale columns of received byte rows: ``(recv_x, recv_scales or None, next byte offset)``.
    Scales keep the dtype sent (float32 ``[.., H/128]`` or packed UE8M0 int32 ``[.., ceil(H/512)]``)."""
    xb = hidden * torch.empty((), dtype=x_dtype).element_size()
    recv_x = _from_bytes(recv[:, :xb], x_dtype, hidden)
    if x_scales is None:
        return recv_x, None, xb
    g = x_scales.shape[1]
    return recv_x, _from_bytes(recv[:, xb:xb + 4 * g], x_scales.dtype, g), xb + 4 * g


def localize_topk(recv: torch.Tensor, off: int, k: int, rank: int, num_local: int) -> tuple:
    """Received global top-k (int64 ids, float32 weights, from byte ``off``) as this rank's local ids (-1 for
    experts elsewhere) and weights (0 there)."""
    if _on_host(recv):
        rn = recv.numpy()
        local = np.array(rn[:, off:off + 8 * k]).view(np.int64) - rank * num_local
        w = np.array(rn[:, off + 8 * k:off + 12 * k]).view(np.float32)
        elsewhere = (local < 0) | (local >= num_local)
        np.putmask(local, elsewhere, -1)
        np.putmask(w, elsewhere, 0.0)
        return torch.from_numpy(local), torch.from_numpy(w)
    local = _from_bytes(recv[:, off:off + 8 * k], torch.int64, k) - rank * num_local  # a new tensor
    w = _from_bytes(recv[:, off + 8 * k:off + 12 * k], torch.float32, k)
    elsewhere = (local < 0) | (local >= num_local)
    return local.masked_fill_(elsewhere, -1), w.masked_fill(elsewhere, 0.0)


def pad_to_worst(rank: int, num_recv: int, num_worst_tokens: int, recv_x, recv_scales, recv_src_idx, recv_topk_idx,
                 recv_topk_weights):
    """Pad the received rows to ``num_worst_tokens`` (0: unchanged): zeros for data, scales and weights, -1 for
    indices. More received rows than that is an error (this backend reads the counts on the host anyway)."""
    if num_worst_tokens <= 0:
        return recv_x, recv_scales, recv_src_idx, recv_topk_idx, recv_topk_weights
    if num_recv > num_worst_tokens:
        raise RuntimeError(f"rank {rank} received {num_recv} tokens, more than num_worst_tokens={num_worst_tokens}")
    pad = num_worst_tokens - num_recv

    def grow(t, fill):
        return None if t is None else torch.cat([t, t.new_full((pad, *t.shape[1:]), fill)])

    return (grow(recv_x, 0), grow(recv_scales, 0), grow(recv_src_idx, -1), grow(recv_topk_idx, -1),
            grow(recv_topk_weights, 0))
