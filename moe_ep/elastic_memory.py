"""Memory per rank of :class:`moe_ep.ElasticBuffer`, and DeepEP V2's buffer size hint for the same shapes.

:func:`elastic_memory_per_rank` is what our constructor allocates (it calls the same sizing functions);
:func:`deepep_v2_buffer_size_hint` restates, for comparison only, how DeepEP V2 sizes its ``ElasticBuffer``
(``ElasticBuffer.get_buffer_size_hint``). Nothing here allocates or communicates.
"""

from __future__ import annotations

import math

__all__ = ["ALIGN_2MB", "align", "elastic_num_bytes", "elastic_memory_per_rank", "deepep_v2_buffer_size_hint"]

ALIGN_2MB = 2 << 20

# DeepEP V2 constants used by its sizing (see deepep_v2_buffer_size_hint)
_DEEPEP_ALIGN = 32  # every part of a token slot is padded to 32 bytes
_DEEPEP_MAX_CHANNELS = 8 * 160  # channels per SM x SMs: slack of the hybrid (scale-out) receive queues


def align(x: int, a: int) -> int:
    """``x`` rounded up to a multiple of ``a``."""
    return (x + a - 1) // a * a


def _check_ints(**kw) -> None:
    for name, v in kw.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{name} must be a non-negative int, got {v!r}")


def elastic_num_bytes(num_ranks: int, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0) -> int:
    """``num_bytes`` our ``ElasticBuffer`` asks the ``symm`` backend for when none is given (what
    :meth:`moe_ep.ElasticBuffer.get_buffer_size_hint` returns): the normal-mode size of the ``symm`` backend for
    these shapes (BF16 rows, so FP8 fits too; ``num_topk=0`` sizes for a top-k of 32), rounded up to 2 MB."""
    from .backends.symm import SymmBackend

    _check_ints(num_ranks=num_ranks, num_max_tokens_per_rank=num_max_tokens_per_rank, hidden=hidden,
                num_topk=num_topk)
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be at least 1, got {num_ranks}")
    hint = SymmBackend.get_normal_size_hint(num_max_tokens_per_rank, hidden, num_topk or 32, num_ranks)
    return align(hint, ALIGN_2MB)


def elastic_memory_per_rank(num_ranks: int, num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0,
                            *, backend: str = "symm", num_bytes: int | None = None) -> int:
    """Bytes one rank's :class:`moe_ep.ElasticBuffer` allocates at construction, for these shapes and backend.

    - ``"torch"``: 0 (the transport allocates per call, nothing persistent; ``num_bytes`` is ignored, as the
      constructor ignores it);
    - ``"symm"``: one symmetric region per rank (normal mode only; low-latency buffers stay on
      :class:`moe_ep.Buffer`): ``num_bytes`` (default :func:`elastic_num_bytes`) rounded up to 256, plus the
      normal path's int32 signal words (``moe_ep.kernels.intranode.signal_layout``) rounded up to 256.

    The small per-rank bookkeeping tensors (address tables, a status word array) are left out.
    """
    from .backends.symm import _normal_path
    from .symm import _align as symm_align

    if backend not in ("symm", "torch", "auto"):
        raise ValueError(f"backend must be 'symm', 'torch' or 'auto', got {backend!r}")
    _check_ints(num_ranks=num_ranks, num_max_tokens_per_rank=num_max_tokens_per_rank, hidden=hidden,
                num_topk=num_topk)
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be at least 1, got {num_ranks}")
    if backend in ("torch", "auto"):  # "auto" is the torch backend for ElasticBuffer
        return 0
    if num_bytes is None:
        if not (num_max_tokens_per_rank and hidden):
            raise ValueError("the symm backend needs num_bytes, or num_max_tokens_per_rank and hidden to size it")
        num_bytes = elastic_num_bytes(num_ranks, num_max_tokens_per_rank, hidden, num_topk)
    _check_ints(num_bytes=num_bytes)
    if num_bytes == 0:
        raise ValueError("the symm backend needs num_bytes > 0")
    signals = _normal_path().num_signals(num_ranks)
    return symm_align(num_bytes) + symm_align(4 * max(signals, 1))


def deepep_v2_buffer_size_hint(num_ranks: int, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0,
                               use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                               allow_multiple_reduction: bool = True, *, nvlink_ranks: int = 8) -> int:
    """DeepEP V2's ``ElasticBuffer.get_buffer_size_hint`` for ``num_ranks`` ranks, ``nvlink_ranks`` of them per
    NVLink domain (8 on an H100/H200 node; ``nvlink_ranks >= num_ranks``: one domain, e.g. NVL72).

    Restated from DeepEP's sources (deepseek-ai/DeepEP, ``csrc/elastic/buffer.hpp``: the static
    ``calculate_buffer_size`` with its dispatch and combine helpers; ``deep_ep/include/deep_ep/common/layout.cuh``:
    the token and buffer layouts; ``csrc/kernels/backend/nccl.cu``: the domain sizes), read at the commits stored
    in November 2026. The buffer is shared in time by dispatch and combine, so the hint is the larger of the two
    layouts, rounded up to 2 MB. It excludes DeepEP's fixed workspace (counters and signals, about 16 MB, added
    at construction).

    - A top-k of 0 is sized as 32. Topology: ``S = num_ranks / nvlink_ranks`` scale-out domains of ``U``
      scale-up ranks with hybrid mode; without it one domain of all ranks (``S = 1``, ``U = num_ranks``), and
      that domain counts as NVLink only if every rank is in the same NVLink domain.
    - A dispatched token occupies a slot of three 32-byte-aligned parts: the payload (``hidden`` bytes for FP8,
      ``2 * hidden`` for BF16), the scales (FP8 only: one 4-byte pack per 32 channels, an upper bound) and the
      metadata (per top-k entry a 4-byte index and a 4-byte weight, then ``1 + K`` more 4-byte words: the
      source token index and one link per top-k entry). A combined token's slot is the 32-aligned BF16 payload plus the
      32-aligned top-k weights and indices (no scales, no source metadata).
    - Dispatch, one scale-out domain: a receive region of ``num_ranks`` blocks of ``T`` slots
      (``T = num_max_tokens_per_rank``), plus one send block of ``T`` slots when the domain is not NVLink.
      With ``S > 1``: ``U`` blocks of ``S * T`` (scale-up receive), one block of ``T`` (scale-out send) and
      ``S`` blocks of ``T + 1280`` (scale-out receive, 1280 = the most channels).
    - Combine, one scale-out domain: a receive region of ``min(num_ranks, K)`` blocks of ``T`` slots with
      multiple reduction allowed (``K`` blocks without), plus, when not NVLink, a send region of ``num_ranks``
      blocks of ``T`` (``T * K`` without multiple reduction). With ``S > 1``: ``min(U, K)`` blocks of
      ``S * T`` (scale-up receive), ``min(S, K)`` blocks of ``T`` (scale-out receive) and one block (``K``
      without multiple reduction) of ``S * (T + 1280)`` (scale-out send); each ``min(., K)`` is ``K`` without
      multiple reduction.
    """
    _check_ints(num_ranks=num_ranks, num_max_tokens_per_rank=num_max_tokens_per_rank, hidden=hidden,
                num_topk=num_topk, nvlink_ranks=nvlink_ranks)
    if num_ranks < 1 or nvlink_ranks < 1 or num_max_tokens_per_rank < 1 or hidden < 1:
        raise ValueError("num_ranks, nvlink_ranks, num_max_tokens_per_rank and hidden must be positive")
    nvl = min(nvlink_ranks, num_ranks)
    if num_ranks % nvl:
        raise ValueError(f"num_ranks={num_ranks} is not a multiple of nvlink_ranks={nvl}")
    a = lambda n: align(n, _DEEPEP_ALIGN)  # noqa: E731
    k = num_topk or 32
    T = num_max_tokens_per_rank
    rdma = num_ranks // nvl
    out, up = (rdma, nvl) if allow_hybrid_mode else (1, num_ranks)
    nvlink = up == nvl
    sf_packs = math.ceil(hidden / 32) if use_fp8_dispatch else 0
    slot_d = a(hidden * (1 if use_fp8_dispatch else 2)) + a(4 * sf_packs) + a(8 * k + 4 * (1 + k))
    slot_c = a(2 * hidden) + a(8 * k)
    amr = allow_multiple_reduction
    C = _DEEPEP_MAX_CHANNELS
    if out == 1:
        dispatch = slot_d * T * (num_ranks + (0 if nvlink else 1))
        combine = slot_c * ((0 if nvlink else num_ranks) * T * (1 if amr else k) + (min(num_ranks, k) if amr else k) * T)
    else:
        dispatch = slot_d * (up * out * T + T + out * (T + C))
        combine = slot_c * ((min(up, k) if amr else k) * out * T + (min(out, k) if amr else k) * T
                            + (1 if amr else k) * out * (T + C))
    return align(max(dispatch, combine), ALIGN_2MB)
