"""Buffer layout of the ``symm`` backend's low-latency path (:mod:`moe_ep.backends.symm_ll`): how one rank's
data region is carved into double-buffer slots (counts, messages, combine rows; the nvshmem transport's staging
areas), the message header offset, and the sizes that follow from it (:func:`ll_buffer_bytes`, what
``SymmLowLatency.size_hint`` returns, and DeepEP's size for the same shapes, :func:`deepep_ll_buffer_bytes`).

Pure arithmetic on ``(T, hidden, R, E, num_topk, transport)``: no tensors, no launches.
"""

from __future__ import annotations

import dataclasses

import triton

from ..kernels.logfmt import FMT_FP8, FMT_LOGFMT
from ..kernels.low_latency_common import sig_stride

NUM_SLOTS = 2
GROUP = 128
_ALIGN = 256


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def combine_recv_columns(hidden: int, fmt: int) -> int:
    """Hidden columns per program of the compiled low-latency combine receive (4 warps, 2 tokens): 1024, and 256 for
    the FP8 and LogFMT-10 wire formats, whose decode keeps more live per column. At 512 columns (with the register
    cap lifted, ``LL_MAXNREG``) Triton 3.6's ptxas took 245-255 registers and spilled 24 bytes for LogFMT-10, 3.9 took
    240 and spilled 12 with a 240 cap; at 256 neither spills (168 / 186 registers under 3.6, 146 / 117 under 3.9)."""
    return min(_pow2(hidden), 256 if fmt in (FMT_FP8, FMT_LOGFMT) else 1024)


def send_splits(tiles: int, token_blocks: int, num_sms: int, transport: int) -> int:
    """Column splits of a low-latency send (dispatch or combine): each of the ``token_blocks`` blocks' ``tiles`` column
    tiles are shared by this many programs, enough for about two programs per SM (``num_sms``; the sends are
    latency-bound: one program per few tokens copied its tiles one after another), at most one per tile. 1 on the
    ``nvshmem`` transport (a message or row is staged whole, then put by one program) and for an empty batch."""
    if transport or token_blocks <= 0:
        return 1
    return max(1, min(tiles, -(-2 * num_sms // token_blocks)))


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Byte offsets inside one double-buffer slot of a rank's data region (see :func:`_carve`)."""

    msg: int  # bytes per message (one token for one destination rank; the header offset is _hdr(hidden, fp8))
    cnt_off: int
    msg_off: int
    comb_off: int
    slot_bytes: int
    stage_bytes: int = 0  # nvshmem transport: staging area of ONE slot (NUM_SLOTS of them at the END of the region)
    comb_stage: int = 0  # offset of the combine staging inside a slot's staging area
    cnt_stage: int = 0  # offset of the count staging inside it (the signature copies are at 0)


def _carve(T: int, hidden: int, R: int, E: int, K: int, transport: int = 0) -> _Layout:
    # One slot of a rank's data region (NUM_SLOTS of them, each at ``slot * _slot_span``: the data region less the
    # nvshmem staging area, halved):
    #
    #   cnt_off   [R, L] int32                  count[s][e]: tokens of source s for local expert e   4 * E
    #   msg_off   [R, T, msg] uint8             message of source s's token t (slot fixed by t)       R * T * msg
    #             msg = payload | header, payload = BF16 2H, or FP8 H + scales 4 * H/128 (carved for BF16),
    #             header (at align16(payload): _hdr) = top-k experts + 1 (0 = none) K int32 | positions K int32,
    #             msg 16-aligned; payload and header are contiguous (one put per message on the nvshmem transport)
    #   comb_off  [T, K, CS] uint8              combine: expert output for (own token t, selection k)  T * K * CS
    #             CS = 16 + align16(2H): a 16-byte stamp header (int32 stamp_s << 16 | writer + 1) then the row
    #             (BF16 / FP16 2H bytes, or the FP8 / LogFMT wire bytes); docs/protocols.md "combine isolation"
    #
    # Regions start 256-byte aligned. DeepSeek-V3 decode (T=128, H=7168, E=256, K=8) at EP8:
    # msg = 14400 B, 14.7 MB of messages + 14.7 MB combine (16 KB of it stamp headers) = 29.4 MB per slot,
    # 58.9 MB per rank.
    L = E // R
    hdr = _align(2 * hidden, 16)
    msg = _align(hdr + 8 * K, 16)
    cnt_off = 0
    msg_off = _align(4 * R * L, _ALIGN)
    comb_off = _align(msg_off + R * T * msg, _ALIGN)
    slot_bytes = _align(comb_off + T * K * comb_row_bytes(hidden), _ALIGN)
    if not transport:
        return _Layout(msg, cnt_off, msg_off, comb_off, slot_bytes)
    # nvshmem transport: a sender writes into its own symmetric memory before a put. A put source may be rewritten
    # only once the peer's BUSY release proved it read the put (no quiet on the hot path, docs/protocols.md), and
    # only the release of the SAME slot is waited for, so each slot has its own staging area (as DeepEP's two
    # buffers); NUM_SLOTS of them follow the slots:
    #   [1 + R, 4 sig_stride(R) B] signature copies (dispatch; combine per source: the signature and the mask bits)
    #   | [E] int32 count staging
    #   | [L * R*T, CS] combine staging (stamp header + the expert rows' wire bytes)
    # DeepSeek-V3 decode (T=128, H=7168, E=256): 470 MB per slot whatever the EP size.
    cnt_stage = _align(4 * sig_stride(R) * (1 + R), _ALIGN)
    comb_stage = _align(cnt_stage + 4 * E, _ALIGN)
    stage_bytes = _align(comb_stage + L * R * T * comb_row_bytes(hidden), _ALIGN)
    return _Layout(msg, cnt_off, msg_off, comb_off, slot_bytes, stage_bytes, comb_stage, cnt_stage)


def comb_row_bytes(hidden: int) -> int:
    """Bytes of one combine slot ``(t, k)`` (and of one NVSHMEM combine staging row): the 16-byte stamp header, then
    ``2 * hidden`` bytes (16-aligned) for the row (the kernels' ``_cs(H)``)."""
    return _align(2 * hidden, 16) + 16


def _hdr(hidden: int, use_fp8: bool) -> int:
    """Header offset inside a message: right after the payload (FP8: H bytes + H/128 float32 scales; BF16: 2H)."""
    return _align(hidden + 4 * (hidden // GROUP) if use_fp8 else 2 * hidden, 16)


def ll_buffer_bytes(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int,
                    num_topk: int = 8, transport: int = 0) -> int:
    """Data bytes per rank of this path (both slots, plus the staging area of the nvshmem transport,
    ``transport=1``): what :meth:`SymmLowLatency.size_hint` returns."""
    lay = _carve(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts, num_topk, transport)
    return NUM_SLOTS * (lay.slot_bytes + lay.stage_bytes)


def deepep_ll_buffer_bytes(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                           num_experts: int) -> int:
    """DeepEP's ``get_low_latency_rdma_size_hint`` for the same shapes (its published layout: two
    slots of send + receive + signal buffers, ``E * T`` messages each), for comparison."""
    T, E = num_max_dispatch_tokens_per_rank, num_experts
    scales = hidden // 128
    msg_d = 16 + max(2 * hidden, hidden + 4 * scales)
    msg_c = 4 * scales + 2 * hidden
    send = max(T * msg_d, E * T * msg_c)
    recv = E * T * max(msg_d, msg_c)
    signal = 4 * E
    return _align(2 * (send + recv + signal), 128)



def slot_span(nbytes: int, lay: _Layout) -> int:
    """Bytes of one slot of an ``nbytes`` low-latency buffer: the data region less the staging areas (nvshmem),
    halved (0 when the staging alone does not fit)."""
    if nbytes < NUM_SLOTS * lay.stage_bytes:
        return 0
    return (nbytes - NUM_SLOTS * lay.stage_bytes) // NUM_SLOTS // _ALIGN * _ALIGN


def check_capacity(nbytes: int, T: int, hidden: int, R: int, E: int, K: int, transport: int, what: str) -> _Layout:
    """The layout of a low-latency call of these shapes in an ``nbytes`` buffer, or the ``ValueError`` every
    backend raises for a buffer that is too small (the ``torch`` backend checks the ``symm`` layout, so a CPU run
    refuses what a one-node GPU run would)."""
    if E % R != 0:
        raise ValueError(f"{what}: num_experts={E} must be divisible by the number of ranks {R}")
    if K > 32:  # the combine receive keeps one bit per selection in an int32
        raise ValueError(f"{what}: num_topk={K} exceeds 32")
    lay = _carve(T, hidden, R, E, K, transport)
    have = slot_span(-(-nbytes // _ALIGN) * _ALIGN, lay)  # the mapped size: num_rdma_bytes rounded up to 256
    if lay.slot_bytes > have:
        need = ll_buffer_bytes(T, hidden, R, E, K, transport)
        raise ValueError(
            f"{what}: T={T}, hidden={hidden}, num_topk={K}, num_experts={E} on {R} ranks need "
            f"{lay.slot_bytes} bytes per buffer slot (plus {lay.stage_bytes} bytes of staging per slot) but the "
            f"low-latency buffer has {have} per slot (num_rdma_bytes={nbytes}); use num_rdma_bytes >= {need} "
            f"({'NvshmemBackend' if transport else 'SymmBackend'}.get_low_latency_size_hint, or "
            f"Buffer.get_low_latency_rdma_size_hint for any backend and top-k)")
    return lay
