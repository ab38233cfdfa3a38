"""Expanded-layout kernels of :class:`moe_ep.ElasticBuffer` (DeepEP V2's ``do_expand=True``), one launch each:

- :func:`_expand_rows_kernel`: the aligned expanded layout from the received rows: expanded row ``r`` is received
  row ``exp_src[r]`` (rows moved as int32 words: FP8 payloads, BF16 rows and float32 scales alike), padding
  rows (``exp_src < 0``) zero with ``ZERO`` and left unwritten otherwise; with ``HAS_W`` also the 1-D weights
  ``w[exp_src[r], exp_k[r]]`` (0 on padding). Replaces the torch gathers, ``where`` and zero fills.
- :func:`_sum_expanded_kernel`: the expanded combine's per-received-row sum: ``0 + x[s_1] + x[s_2] + ...`` in
  float32 over the row's selections (``src`` `[M, P]`, k ascending, -1 after them), one round-to-nearest-even
  cast to BF16: bitwise :func:`moe_ep.deepep.v2.expand.sum_expanded`. A hole's load is masked, so only real
  selections are read, also for worst-case (not CPU-synced) handles, where the torch version makes
  ``min(K, L)`` passes over every row.

:class:`moe_ep.ElasticBuffer` runs these on CUDA tensors (``moe_ep.deepep.v2.expand`` picks); the torch ops stay
the CPU path and the reference the interpreter tests compare against, bitwise.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .low_latency_common import _bf16_bits
from .pdl import INTERPRET

__all__ = ["expand_rows", "sum_rows", "words_of", "_expand_rows_kernel", "_sum_expanded_kernel"]


@triton.jit
def _expand_rows_kernel(
    src_ptr,  # [M, W] int32 words of the received rows
    exp_src_ptr,  # [N] int64 received row of each expanded row, -1 = padding
    out_ptr,  # [N, W] int32
    w_ptr, exp_k_ptr, out_w_ptr,  # HAS_W: [M, K] float32 weights, [N] int64 top-k slot, [N] float32 out
    N, W, K,
    ZERO: tl.constexpr, HAS_W: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rows < N
    s = tl.load(exp_src_ptr + rows, mask=r_ok, other=-1)
    has = r_ok & (s >= 0)
    if ZERO:
        write = r_ok
    else:
        write = has
    s64 = tl.where(has, s, 0).to(tl.int64)
    r64 = rows.to(tl.int64)
    for w0 in range(0, W, BLOCK_W):
        offs = w0 + tl.arange(0, BLOCK_W)
        c_ok = (offs < W)[None, :]
        v = tl.load(src_ptr + s64[:, None] * W + offs[None, :], mask=has[:, None] & c_ok, other=0)
        tl.store(out_ptr + r64[:, None] * W + offs[None, :], v, mask=write[:, None] & c_ok)
    if HAS_W:
        k = tl.load(exp_k_ptr + rows, mask=has, other=0)
        wv = tl.load(w_ptr + s64 * K + k, mask=has, other=0.0)
        tl.store(out_w_ptr + rows, wv, mask=r_ok)


@triton.jit
def _sum_expanded_kernel(
    x_ptr,  # [N, H] bf16 expanded rows
    src_ptr,  # [M, P] int64 expanded rows of each received row's selections, k ascending, -1 after them
    out_ptr,  # [M, H] bf16 as int16
    M, H, P,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    r_ok = rows < M
    h_ok = (offs_h < H)[None, :]
    r64 = rows.to(tl.int64)
    acc = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
    for j in range(P):  # fixed order, k ascending: deterministic
        s = tl.load(src_ptr + r64 * P + j, mask=r_ok, other=-1)
        has = r_ok & (s >= 0)
        v = tl.load(x_ptr + tl.where(has, s, 0).to(tl.int64)[:, None] * H + offs_h[None, :],
                    mask=has[:, None] & h_ok, other=0.0)
        acc += v.to(tl.float32)  # a hole adds +0.0: no change (the sum starts at +0.0)
    tl.store(out_ptr + r64[:, None] * H + offs_h[None, :], _bf16_bits(acc), mask=r_ok[:, None] & h_ok)


def words_of(t: torch.Tensor) -> Optional[torch.Tensor]:
    """``t`` `[M, ...]` as `[M, words]` int32 (a view), or ``None`` when its rows are not whole, aligned words."""
    if t.dim() < 1 or not t.is_contiguous() or t.shape[0] == 0:
        return None
    row = t[0].numel() * t.element_size()
    if row % 4 or (t.storage_offset() * t.element_size()) % 4:
        return None
    return t.view(torch.uint8).reshape(t.shape[0], row).view(torch.int32)


def _blocks(width: int, interp: bool) -> tuple[int, int]:
    return (64, triton.next_power_of_2(max(width, 16))) if interp else (16, 256)


def expand_rows(t: torch.Tensor, exp_src: torch.Tensor, zero: bool, w: Optional[torch.Tensor] = None,
                exp_k: Optional[torch.Tensor] = None):
    """``(rows [N, ...] like t, weights [N] or None)``: expanded row ``r`` = ``t[exp_src[r]]``; padding rows zero
    with ``zero``, unwritten otherwise (DeepEP V2's ``do_zero_padding=False``: unspecified). ``t`` must give
    :func:`words_of`; ``w`` `[M, K]` float32 with ``exp_k`` for the 1-D weights."""
    words = words_of(t)
    if words is None:
        raise ValueError("expand_rows needs contiguous rows of whole 4-byte words")
    n, width = exp_src.shape[0], words.shape[1]
    out = (torch.zeros if zero else torch.empty)(n, width, dtype=torch.int32, device=t.device)
    out_w = torch.empty(n, dtype=torch.float32, device=t.device) if w is not None else None
    br, bw = _blocks(width, INTERPRET or t.device.type != "cuda")
    if n:
        has_w = w is not None
        _expand_rows_kernel[(triton.cdiv(n, br),)](
            words, exp_src.contiguous(), out, w.contiguous() if has_w else out, exp_k.contiguous() if has_w else exp_src,
            out_w if has_w else out, n, width, w.shape[1] if has_w else 1,
            ZERO=bool(zero), HAS_W=has_w, BLOCK_R=br, BLOCK_W=bw)
    rows = out.view(torch.uint8).view(t.dtype).reshape(n, *t.shape[1:])
    return rows, out_w


def sum_rows(x: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """BF16 `[M, H]`: per row of ``src`` `[M, P]`, the float32 sum of ``x``'s rows it names (k ascending, -1
    skipped), rounded once: :func:`moe_ep.deepep.v2.expand.sum_expanded`'s value, in one launch."""
    if x.dtype != torch.bfloat16 or x.dim() != 2:
        raise ValueError(f"sum_rows needs BF16 [N, H] rows, got {x.dtype} {tuple(x.shape)}")
    M, H = src.shape[0], x.shape[1]
    out = torch.empty(M, H, dtype=torch.bfloat16, device=x.device)
    if M == 0:
        return out
    if src.shape[1] == 0 or x.shape[0] == 0:
        return out.zero_()
    interp = INTERPRET or x.device.type != "cuda"
    br, bh = (16, triton.next_power_of_2(H)) if interp else (4, 512)
    _sum_expanded_kernel[(triton.cdiv(M, br), triton.cdiv(H, bh))](
        x.contiguous(), src.contiguous(), out.view(torch.int16), M, H, src.shape[1], BLOCK_R=br, BLOCK_H=bh)
    return out

