"""Memory per rank of :class:`moe_ep.ElasticBuffer`, and DeepEP V2's buffer size hint for the same shapes.

:func:`elastic_memory_per_rank` is what our constructor allocates (it calls the same sizing functions);
:func:`deepep_v2_buffer_size_hint` restates, for comparison only, how DeepEP V2 sizes its ``ElasticBuffer``
(``ElasticBuffer.get_buffer_size_hint``). Nothing here allocates or communicates.
"""

from __future__ import annotations

import math

__all__ = ["ALIGN_2MB", "align", "elastic_num_bytes", "elastic_memory_per_rank", "deepep_v2_buffer_size_hint",
           "deepep_v1_buffer_size_hints", "prefill_memory_rows"]

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


def chunk_for(num_ranks: int, num_max_tokens_per_rank: int, chunk_tokens: int | None = None) -> int:
    """Tokens per source per round of the fixed size: ``chunk_tokens`` (default ``max(64, 4096 // num_ranks)``),
    at most ``num_max_tokens_per_rank`` (a batch that small takes one round)."""
    from ...backends.symm_normal import SymmNormal

    return SymmNormal.chunk(num_ranks, num_max_tokens_per_rank or None, chunk_tokens)  # (checks chunk_tokens)


def elastic_num_bytes(num_ranks: int, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0, *,
                      chunk_tokens: int | None = None, whole_batch: bool = False) -> int:
    """``num_bytes`` our ``ElasticBuffer`` asks the ``symm`` backend for when none is given (what
    :meth:`moe_ep.ElasticBuffer.get_buffer_size_hint` returns), rounded up to 2 MB; BF16 rows, so FP8 fits too;
    ``num_topk=0`` sizes for a top-k of 32.

    Default: a fixed size that does not grow with the batch: one time-shared area of ``R`` per-source blocks of
    :func:`chunk_for` tokens (dispatch, then combine, in the same bytes); larger batches move in rounds.
    ``whole_batch=True``: the one-round size of ``num_max_tokens_per_rank`` tokens with separate dispatch and
    combine halves (the fastest path at large batches, and what a receive view of the whole batch needs)."""
    from ...backends.symm import SymmBackend

    _check_ints(num_ranks=num_ranks, num_max_tokens_per_rank=num_max_tokens_per_rank, hidden=hidden,
                num_topk=num_topk)
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be at least 1, got {num_ranks}")
    chunk = chunk_for(num_ranks, num_max_tokens_per_rank, chunk_tokens)  # (refuses a bad one, whole_batch too)
    if whole_batch:
        hint = SymmBackend.get_normal_size_hint(num_max_tokens_per_rank, hidden, num_topk or 32, num_ranks)
    else:
        hint = SymmBackend.get_normal_size_hint(None, hidden, num_topk or 32, num_ranks, chunk_tokens=chunk)
    return align(hint, ALIGN_2MB)


def elastic_memory_per_rank(num_ranks: int, num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0,
                            *, backend: str = "symm", num_bytes: int | None = None, chunk_tokens: int | None = None,
                            whole_batch: bool = False) -> int:
    """Bytes one rank's :class:`moe_ep.ElasticBuffer` allocates at construction, for these shapes and backend.

    - ``"torch"``: 0 (the transport allocates per call, nothing persistent; ``num_bytes`` is ignored, as the
      constructor ignores it);
    - ``"symm"``: one symmetric region per rank (normal mode only; low-latency buffers stay on
      :class:`moe_ep.Buffer`): ``num_bytes`` (default :func:`elastic_num_bytes` with ``chunk_tokens`` and
      ``whole_batch``) rounded up to 256, plus the
      normal path's int32 signal words (``moe_ep.kernels.intranode.signal_layout``) rounded up to 256.

    The small per-rank bookkeeping tensors (address tables, a status word array) are left out.
    """
    from ...backends.symm import _normal_path
    from ...symm import _align as symm_align

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
        num_bytes = elastic_num_bytes(num_ranks, num_max_tokens_per_rank, hidden, num_topk, chunk_tokens=chunk_tokens,
                                      whole_batch=whole_batch)
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


# DeepEP V1 (deepseek-ai/DeepEP, csrc/config.hpp: Config::get_nvl_buffer_size_hint / get_rdma_buffer_size_hint;
# deep_ep/buffer.py: get_dispatch_config, 20 SMs): (num_max_nvl_chunked_recv_tokens, num_max_rdma_chunked_recv_tokens)
_DEEPEP_V1_CONFIGS = {2: (256, 128), 4: (256, 128), 8: (256, 128), 16: (288, 128), 24: (288, 128), 32: (288, 128),
                      64: (288, 128), 128: (560, 128), 144: (720, 128), 160: (720, 128)}


def deepep_v1_buffer_size_hints(num_ranks: int, hidden: int, *, num_sms: int = 20) -> tuple:
    """``(nvl_bytes, rdma_bytes)``: DeepEP V1's normal-mode hints with its default dispatch config for
    ``num_ranks`` (``get_nvl_buffer_size_hint`` / ``get_rdma_buffer_size_hint`` of ``get_dispatch_config(R)``,
    BF16 ``hidden_bytes = 2 * hidden``), restated for comparison: ``num_sms / 2`` channels, 8 NVLink peers a
    node, per buffered token the payload, 8 bytes of source metadata, 128 int64 top-k ids, 128 float32 weights
    and 128 float32 scales (RDMA: twice, send and receive, plus 16 bytes), plus the channels' int32 counters;
    rounded up to 128 bytes. Fixed sizes: DeepEP V1 streams any batch through them."""
    _check_ints(num_ranks=num_ranks, hidden=hidden, num_sms=num_sms)
    if num_ranks not in _DEEPEP_V1_CONFIGS:
        raise ValueError(f"DeepEP V1 has no default dispatch config for {num_ranks} ranks "
                         f"(it has {sorted(_DEEPEP_V1_CONFIGS)})")
    nvl_chunk, rdma_chunk = _DEEPEP_V1_CONFIGS[num_ranks]
    hb, ch = 2 * hidden, num_sms // 2
    rdma_ranks, nvl_ranks = max(num_ranks // 8, 1), min(num_ranks, 8)
    per_token = hb + 8 + 128 * 8 + 128 * 4 + 128 * 4
    nvl = ch * nvl_ranks * (2 * rdma_ranks + 3) * 4 + ch * nvl_ranks * nvl_chunk * per_token
    rdma = 0
    if num_ranks > 8:
        rdma = ch * rdma_ranks * (8 * 2 + 2) * 2 * 4 + ch * rdma_ranks * rdma_chunk * (per_token + 16) * 2
    return align(nvl, 128), align(rdma, 128) if rdma else 0


def prefill_memory_rows(tokens=(4096, 8192, 32768), ranks=(8, 32), hidden: int = 7168, num_topk: int = 8) -> list:
    """The README's prefill memory-per-rank table (MiB per rank, DeepSeek-V3 shapes by default), one markdown row
    per (tokens per rank, EP): our ElasticBuffer with the default fixed size (chunk, rounds), with one round
    of a copying receive (``chunk_tokens=T``, time-shared) and with the whole-batch size (halves, views),
    DeepEP V1's NVL (+ RDMA) hints, DeepEP V2's hint (8 GPUs a node, and one NVLink domain), and ours fixed /
    DeepEP V2 one domain."""
    MiB = 2 ** 20
    rows = []
    for t in tokens:
        for r in ranks:
            c = chunk_for(r, t)
            fixed = elastic_memory_per_rank(r, t, hidden, num_topk)
            one = elastic_memory_per_rank(r, t, hidden, num_topk, chunk_tokens=t)
            whole = elastic_memory_per_rank(r, t, hidden, num_topk, whole_batch=True)
            nvl, rdma = deepep_v1_buffer_size_hints(r, hidden)
            v1 = f"{nvl / MiB:.0f}" + (f" + {rdma / MiB:.0f} RDMA" if rdma else "")
            v2_node = deepep_v2_buffer_size_hint(r, t, hidden, num_topk)
            v2_one = deepep_v2_buffer_size_hint(r, t, hidden, num_topk, nvlink_ranks=r)
            rows.append(f"| {t} | {r} | {fixed / MiB:.0f} ({c}, {-(-t // c)}) | {one / MiB:.0f} | {whole / MiB:.0f} | {v1} | "
                        f"{v2_node / MiB:.0f} | {v2_one / MiB:.0f} | {fixed / v2_one:.3f} |")
    return rows
