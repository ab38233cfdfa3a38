"""Low-latency (decode) path of the ``symm`` backend: device-initiated intranode dispatch / combine.

Four Triton launches over the peers' address tables (:mod:`moe_ep.kernels.low_latency`), each one
phase: ``dispatch_send`` -> ``dispatch_recv`` (the hook of ``return_recv_hook``) -> ``combine_send``
-> ``combine_recv``. Nothing reads device data on the host, shapes are fixed by ``(N, T, H, K, E)``,
and every signal is back at zero after each dispatch + combine, so the whole sequence can be captured
in a CUDA graph and replayed.

Compared with DeepEP's low-latency buffers (every rank keeps ``E * T`` message slots, one per
(expert, source token)), a token travels once per destination *rank* and the receiver places its rows
from a header, so the receive area is ``R * T`` messages and the combine area ``T * K`` rows: 58.9 MB per
rank for DeepSeek-V3 decode at EP8 (T=128, hidden 7168, 256 experts, top-8), against 1.91 GB for
DeepEP's ``get_low_latency_rdma_size_hint`` (:func:`ll_buffer_bytes`, :func:`deepep_ll_buffer_bytes`).

Double buffering: dispatch and combine each alternate between two slots (a host-side toggle per
call, baked into a captured graph), so two dispatches (or two combines) may be in flight at once,
e.g. two micro-batches with ``return_recv_hook``; a third one in flight waits for the first to be
received (and times out if that never happens on this stream).

NOTES: the carving (:func:`~moe_ep.backends.symm_ll_layout._carve`) depends on ``(T, hidden, R, E, num_topk)``.
Changing those shapes between calls is safe once every rank has finished the previous step (e.g. after a host
barrier); changing them while a peer may still be inside the previous step's combine is not.

Layout and sizes live in :mod:`moe_ep.backends.symm_ll_layout`; the host side of the signal words (signatures, the
status check, the rank mask, slot geometry and launch options) in :mod:`moe_ep.backends.symm_ll_control`; this
module holds the handle and the four phases.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch
import triton

from ..fp8 import FP8_DTYPE, tma_aligned_size
from ..kernels.fp8_cast import native_e4m3_supported
from ..kernels.logfmt import FMT_BF16, FMT_FP16, check_hidden, row_bytes
from ..kernels.low_latency import (
    _ll_combine_recv_fmt_kernel,
    _ll_combine_send_fmt_kernel,
    _ll_dispatch_recv_kernel,
    _ll_dispatch_send_kernel,
    signal_layout,
)
from ..symm import SymmBuffer
from .base import LowLatencyDispatchResult, LowLatencyHandle
from .symm_ll_control import _LowLatencyControl
from .symm_ll_layout import (GROUP, _hdr, _Layout, _pow2, combine_recv_columns, deepep_ll_buffer_bytes, ll_buffer_bytes,
                             send_splits)
# names this module defined before its layout moved out (imported from here by perf/ and tests/)
from .symm_ll_layout import _ALIGN as _ALIGN, NUM_SLOTS as NUM_SLOTS, _align as _align, _carve as _carve
from .symm_ll_layout import comb_row_bytes as comb_row_bytes

__all__ = ["SymmLowLatency", "SymmLowLatencyHandle", "ll_buffer_bytes", "deepep_ll_buffer_bytes", "virtual_low_latency_step"]


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _index(dev: torch.device) -> int:
    return dev.index if dev.index is not None else torch.cuda.current_device()


@dataclasses.dataclass
class SymmLowLatencyHandle(LowLatencyHandle):
    """Low-latency handle of the ``symm`` backend (opaque to callers).

    slot_row: `[R, T, K]` `torch.int32`, where selection (source s, token t, k) landed on this rank:
        ``local_expert * R*T + row``, or -1 (filled by the dispatch receive).
    recv_tokens: `[R]` `torch.int32`, tokens each source sent (filled by the dispatch receive).
    call_stamps: `[R + 1]` `torch.int32`: entry ``s`` = source ``s``'s stamp of this call (filled by the dispatch
        receive, written back into every combine row), entry ``R`` = this rank's own (filled by the dispatch send,
        checked by the combine receive); docs/protocols.md.
    """

    num_topk: int = 0
    slot_row: Optional[torch.Tensor] = None
    recv_tokens: Optional[torch.Tensor] = None
    call_stamps: Optional[torch.Tensor] = None

    def selection_slots(self) -> torch.Tensor:
        return self.slot_row


@dataclasses.dataclass
class _DispatchState:
    result: LowLatencyDispatchResult
    x: torch.Tensor
    topk_idx: torch.Tensor
    slot: int
    layout: _Layout
    use_fp8: bool
    recv_done: bool = False


@dataclasses.dataclass
class _CombineState:
    out: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    handle: SymmLowLatencyHandle
    slot: int
    layout: _Layout
    recv_done: bool = False
    fmt: int = FMT_BF16


class SymmLowLatency(_LowLatencyControl):
    """Low-latency dispatch / combine of one rank over one :class:`~moe_ep.symm.SymmBuffer`.

    Arguments:
        symm: this rank's symmetric buffer: at least :meth:`size_hint` data bytes and :meth:`num_signals`
            signal words (zero-initialised).
        owner: written into every handle's ``owner``.
    """

    def __init__(self, symm: SymmBuffer, owner: int, shrink: bool = False, transport: int = 0):
        self.symm = symm
        self.owner = owner
        #: 0: peer pointers (``symm``); 1: NVSHMEM (``nvshmem``: staged writes, puts to unmapped peers)
        self.transport = int(transport)
        #: rank mask (``enable_shrink``): `[R]` int32 on the device, local to this rank (peers never read it);
        #: 0 = live, ``MASK_API`` = masked by the API, ``MASK_TIMEOUT`` = masked by a kernel whose wait timed out.
        self.mask = symm.status[4:4 + symm.world_size]  # words STATUS_MASK.. of the local status tensor
        self._api = [0] * symm.world_size  # host copy of the API's masks (known on the host, never read back)
        self.shrink = shrink
        self.sig = signal_layout(symm.world_size)
        self._dispatch_slot = 0
        self._combine_slot = 0
        self._combine_buffers: dict = {}
        self._msg_areas: dict = {}  # message areas dispatched into so far: (byte offset, T, msg bytes) per slot
        self._open = {"DISP": 0, "COMB": 0}  # sends of each kind whose receive has not run yet (hooks)
        self._timed_seen: set = set()  # peers masked by a timed-out wait, as of the last receive (enable_shrink)

    @property
    def shrink(self) -> bool:
        return self._shrink

    @shrink.setter
    def shrink(self, on: bool) -> None:
        self._shrink = bool(on)
        self.symm.status[1] = int(self._shrink)  # STATUS_SHRINK, read by the kernels at run time

    # ------------------------------------------------------------------ dispatch
    def dispatch_send(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                      num_experts: int, *, use_fp8: bool, round_scale: bool, use_ue8m0: bool) -> _DispatchState:
        """Send phase of low-latency dispatch (FP8 cast fused); allocates every output.

        Arguments:
            x: `[N, hidden]` `torch.bfloat16`, ``N <= T``; topk_idx: `[N, K]` `torch.int64` (-1: none).
            num_max_dispatch_tokens_per_rank: ``T``; num_experts: ``E``.
            use_fp8, round_scale, use_ue8m0: as :meth:`moe_ep.Buffer.low_latency_dispatch`.

        Returns:
            a state whose ``result`` (:class:`LowLatencyDispatchResult`) :meth:`dispatch_recv` fills in place.
        """
        symm = self.symm
        symm.check_usable()
        R, T, E = symm.world_size, num_max_dispatch_tokens_per_rank, num_experts
        n, hidden = x.shape
        K = topk_idx.shape[1]
        if use_fp8 and hidden % GROUP != 0:
            raise ValueError(f"hidden={hidden} must be a multiple of {GROUP} for FP8")
        if n > T:
            raise ValueError(f"{n} tokens exceed num_max_dispatch_tokens_per_rank={T}")
        if T > 0xFFFE:  # N + 1 travels in the low half of the FULL word (the call stamp in the high half)
            raise ValueError(f"num_max_dispatch_tokens_per_rank={T} exceeds 65534")
        lay = self._check_capacity(T, hidden, E, K, "low_latency_dispatch")
        round_scale = round_scale or use_ue8m0
        L, RT, dev = E // R, R * T, x.device
        slot = self._dispatch_slot

        # Outputs (filled by the receive). Scales: storage [L, G or W, RT padded to 4], viewed [L, RT, G or W].
        if use_fp8:
            G = hidden // GROUP
            recv_x = torch.empty(L, RT, hidden, dtype=FP8_DTYPE, device=dev)
            sg, s_dtype = ((G + 3) // 4, torch.int32) if use_ue8m0 else (G, torch.float32)
            s_store = torch.empty(L, sg, tma_aligned_size(RT), dtype=s_dtype, device=dev)
            recv_scales = s_store[:, :, :RT].transpose(1, 2)
        else:
            recv_x = torch.empty(L, RT, hidden, dtype=x.dtype, device=dev)  # BF16 or FP16, bits copied
            recv_scales = None
        recv_count = torch.empty(L, dtype=torch.int32, device=dev)
        handle = SymmLowLatencyHandle(owner=self.owner, num_tokens=n, hidden=hidden, num_max_dispatch_tokens_per_rank=T,
                                      num_experts=E, num_topk=K,
                                      slot_row=torch.empty(R, T, K, dtype=torch.int32, device=dev),
                                      recv_tokens=torch.empty(R, dtype=torch.int32, device=dev),
                                      call_stamps=torch.empty(R + 1, dtype=torch.int32, device=dev))
        result = LowLatencyDispatchResult(recv_x, recv_scales, recv_count, handle, None)

        # Launch: token-block programs, then count programs.
        x_c = x.contiguous()
        x_arg = x_c if use_fp8 else x_c.view(torch.int16)
        topk = topk_idx.contiguous()
        interp = self._interpreted(dev)
        G = max(hidden // GROUP, 1)
        if interp:
            # two payload tiles, so that the column splits below run in the interpreter too
            block_t = min(_pow2(n), 64)
            chunk_t, block_e, gc, hc, warps = block_t, min(_pow2(E), 256), max(_pow2(G) // 2, 1), max(_pow2(hidden) // 2, 1), 4
        else:
            block_t = 2 if n <= 256 else 4  # (2-4 tokens a program: 14-57 KB of FP8 rows at H 7168, top-8)
            chunk_t, block_e, gc, hc, warps = 32, 64, min(_pow2(G), 8), min(_pow2(hidden), 2048), 4
        if use_ue8m0:
            gc = max(gc, 4)
        blocks = triton.cdiv(n, block_t)
        # (the interpreter: as if 2 SMs, so that small batches split in two)
        sms = 2 if interp else _num_sms(_index(dev))
        splits = send_splits(triton.cdiv(G, gc) if use_fp8 else triton.cdiv(hidden, hc), blocks, sms, self.transport)
        num_token_progs = blocks * splits
        grid = (num_token_progs + triton.cdiv(E, block_e),)
        base = self._slot_base(slot, lay)
        s = self.sig
        self._msg_areas[slot] = (base + lay.msg_off, T, lay.msg)
        # flags: dispatch kind (1), FP8 / rounding / UE8M0, and the 16-bit dtype of a BF16/FP16 send (bits are copied
        # as they are, so BF16 on one rank and FP16 on another must not match)
        f16 = int(not use_fp8 and x.dtype == torch.float16)
        call_sig = (hidden, T, E * 256 + K, 1 | int(use_fp8) << 1 | int(round_scale) << 2 | int(use_ue8m0) << 3 | f16 << 4)
        _ll_dispatch_send_kernel[grid](
            x_arg, topk, symm.buffer_ptrs, symm.signal_ptrs, symm.status, handle.call_stamps,
            symm.rank, n, T, L, E, R, num_token_progs, splits, symm.timeout_ns,
            base + lay.cnt_off, base + lay.msg_off, slot * s["SLOT_WORDS"],
            H=hidden, K=K, KP=_pow2(K), MSG=lay.msg, HDR=_hdr(hidden, use_fp8), BLOCK_T=block_t, CHUNK_T=chunk_t, BLOCK_E=block_e,
            GC=gc, HC=hc, IS_FP8=use_fp8, ROUND_SCALE=round_scale, USE_UE8M0=use_ue8m0,
            NATIVE_FP8=use_fp8 and native_e4m3_supported(dev),
            DISP_BUSY=s["DISP_BUSY"], DISP_FULL=s["DISP_FULL"], DISP_SEND_CNT=s["DISP_SEND_CNT"],
            stage_off=self._stage_base(lay, slot) + lay.cnt_stage, TRANSPORT=self.transport, CH=self._copy_chunk(dev),
            sig_copy_off=self._stage_base(lay, slot), **self._call_signature(call_sig), num_warps=warps,
            **self._gpu_launch(dev))
        symm.check_status("low_latency_dispatch (send)")
        self._dispatch_slot ^= 1
        self._open["DISP"] += 1
        return _DispatchState(result, x_c, topk, slot, lay, use_fp8)

    def dispatch_recv(self, state: _DispatchState,
                      cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                      wait_recv_cost_stats: Optional[torch.Tensor] = None) -> LowLatencyDispatchResult:
        """Receive phase: fills ``state.result`` in place (``recv_x``, scales, ``recv_count``, the handle) and
        adds ``recv_count`` to ``cumulative_local_expert_recv_stats`` (`[L]` `torch.int32`) when given, and
        to ``wait_recv_cost_stats`` (`[R]` `torch.int64`) the nanoseconds (device clock) this receive waited
        from its start until each source rank had sent."""
        symm = self.symm
        symm.check_usable()
        res, lay = state.result, state.layout
        if state.recv_done:  # a hook called twice: the outputs are already there
            return res
        h = res.handle
        R, T, E, K, hidden = symm.world_size, h.num_max_dispatch_tokens_per_rank, h.num_experts, h.num_topk, h.hidden
        L = E // R
        dev = res.recv_x.device
        if state.use_fp8:
            x_view = res.recv_x.view(torch.uint8)
            s_store = res.recv_x_scales.transpose(1, 2)  # [L, W, RT] view of the padded storage
            s_arg = s_store.view(torch.int32) if s_store.dtype == torch.float32 else s_store
            stride_sl, stride_sg, sw = s_store.stride(0), s_store.stride(1), s_store.shape[1]
        else:
            x_view = res.recv_x.view(torch.int16)
            s_arg, stride_sl, stride_sg, sw = res.recv_count, 0, 0, 1
        stats = cumulative_local_expert_recv_stats
        if self._interpreted(dev):
            block_t, hc, warps = min(_pow2(T), 64), _pow2(hidden), 4
        else:
            block_t, hc, warps = 4, min(_pow2(hidden), 2048 if state.use_fp8 else 1024), 4
        grid = (R, triton.cdiv(T, block_t))
        base = self._slot_base(state.slot, lay)
        s = self.sig
        _ll_dispatch_recv_kernel[grid](
            symm.buffer, symm.signal_ptrs, symm.status,
            x_view, s_arg, stride_sl, stride_sg,
            res.recv_count, stats if stats is not None else res.recv_count,
            wait_recv_cost_stats if wait_recv_cost_stats is not None else h.recv_tokens,
            h.slot_row, h.recv_tokens, h.call_stamps,
            symm.rank, T, L, R, symm.timeout_ns,
            base + lay.cnt_off, base + lay.msg_off, state.slot * s["SLOT_WORDS"],
            H=hidden, K=K, KP=_pow2(K), MSG=lay.msg, HDR=_hdr(hidden, state.use_fp8), SW=sw, SWP=_pow2(sw),
            BLOCK_T=block_t, HC=hc,
            RP=_pow2(R), LP=_pow2(L), IS_FP8=state.use_fp8, HAS_STATS=stats is not None,
            HAS_WAIT_STATS=wait_recv_cost_stats is not None,
            DISP_BUSY=s["DISP_BUSY"], DISP_FULL=s["DISP_FULL"], DISP_RECV_CNT=s["DISP_RECV_CNT"],
            TRANSPORT=self.transport, num_warps=warps, **self._gpu_launch(dev))
        self._open["DISP"] = max(0, self._open["DISP"] - 1)
        self._check_status_naming_fields("low_latency_dispatch (receive)", state.slot, "DISP_SIG")
        state.recv_done = True
        return res

    # ------------------------------------------------------------------ combine
    def get_next_low_latency_combine_buffer(self, handle: SymmLowLatencyHandle) -> torch.Tensor:
        """`[L, R*T, hidden]` `torch.bfloat16` to write expert outputs into for ``zero_copy`` combine (one
        tensor per combine slot, so two combines in flight do not share it)."""
        R = self.symm.world_size
        L = handle.num_experts // R
        key = (self._combine_slot, L, R * handle.num_max_dispatch_tokens_per_rank, handle.hidden)
        buf = self._combine_buffers.get(key)
        if buf is None:
            buf = self._combine_buffers[key] = torch.empty(key[1:], dtype=torch.bfloat16, device=self.symm.device)
        return buf

    def combine_send(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                     handle: SymmLowLatencyHandle, *, zero_copy: bool = False,
                     out: Optional[torch.Tensor] = None, fmt: Optional[int] = None) -> _CombineState:
        """Send phase of low-latency combine: expert outputs ``x`` (`[L, R*T, hidden]` `torch.bfloat16` or
        `torch.float16`, rows as the dispatch placed them) go back to their source ranks. ``out``: optional
        `[N, hidden]` of ``x``'s dtype. ``fmt``: wire format (:mod:`moe_ep.kernels.logfmt` codes; default: ``x``'s
        16-bit dtype as it is); the output has ``x``'s dtype whatever the wire format.

        Returns a state whose ``out`` :meth:`combine_recv` fills in place."""
        symm = self.symm
        symm.check_usable()
        R, T, E, K, hidden = symm.world_size, handle.num_max_dispatch_tokens_per_rank, handle.num_experts, \
            handle.num_topk, handle.hidden
        if topk_idx.shape[1] != K:
            raise ValueError(f"topk_idx has {topk_idx.shape[1]} columns but the dispatch had {K}")
        if handle.slot_row is None or handle.call_stamps is None:
            raise ValueError("this handle does not come from SymmLowLatency.dispatch_send")
        lay = self._check_capacity(T, hidden, E, K, "low_latency_combine")
        n = handle.num_tokens
        dev = x.device
        in_f16 = x.dtype == torch.float16
        if fmt is None or fmt in (FMT_BF16, FMT_FP16):
            fmt = FMT_FP16 if in_f16 else FMT_BF16
        check_hidden(fmt, hidden)
        if out is None:
            out = torch.empty(n, hidden, dtype=x.dtype, device=dev)
        elif not out.is_contiguous() or out.dtype != x.dtype:
            raise ValueError(f"out must be a contiguous {x.dtype} [num_tokens, hidden] tensor")
        if x.stride(-1) != 1:
            x = x.contiguous()
        slot = self._combine_slot
        interp = self._interpreted(dev)
        if interp:  # two column tiles, so that the splits below run in the interpreter too
            block_t, hc, warps = min(_pow2(T), 64), max(_pow2(hidden) // 2, 128), 4
        else:
            block_t, hc, warps = 2, min(_pow2(hidden), 1024), 4
        blocks = R * triton.cdiv(T, block_t)
        splits = send_splits(triton.cdiv(hidden, hc), blocks, 2 if interp else _num_sms(_index(dev)), self.transport)
        base = self._slot_base(slot, lay)
        s = self.sig
        x16 = x.view(torch.int16)
        call_sig = (hidden, T, handle.num_experts * 256 + K, 16 | int(fmt) << 5 | int(in_f16) << 9)
        _ll_combine_send_fmt_kernel[(R, triton.cdiv(T, block_t), splits)](
            x16, x16.stride(0), x16.stride(1), handle.slot_row, handle.recv_tokens, handle.call_stamps,
            symm.buffer_ptrs, symm.signal_ptrs, symm.status,
            symm.rank, T, R, symm.timeout_ns, base + lay.comb_off, slot * s["SLOT_WORDS"],
            H=hidden, K=K, KP=_pow2(K), BLOCK_T=block_t, HC=hc,
            COMB_BUSY=s["COMB_BUSY"], COMB_FULL=s["COMB_FULL"], COMB_SEND_CNT=s["COMB_SEND_CNT"],
            FMT=fmt, IN_F16=in_f16, NATIVE_FP8=fmt == 2 and native_e4m3_supported(dev),
            stage_off=self._stage_base(lay, slot) + lay.comb_stage, TRANSPORT=self.transport, CH=self._copy_chunk(dev),
            ROW_BYTES=row_bytes(fmt, hidden), sig_copy_off=self._stage_base(lay, slot) + 4 * self.sig["SIG_STRIDE"],
            **self._call_signature(call_sig), num_warps=warps, **self._gpu_launch(dev))
        symm.check_status("low_latency_combine (send)")
        self._combine_slot ^= 1
        self._open["COMB"] += 1
        return _CombineState(out, topk_idx.contiguous(), topk_weights.contiguous(), handle, slot, lay, fmt=fmt)

    def combine_recv(self, state: _CombineState, out: Optional[torch.Tensor] = None,
                     wait_recv_cost_stats: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Receive phase: ``state.out[t] = sum_k w[t, k] * y(expert k, t)`` (float32, k ascending, holes
        skipped; a token with no expert gives zeros). ``out`` is ignored (pass it to :meth:`combine_send`).
        ``wait_recv_cost_stats`` (`[R]` `torch.int64`): nanoseconds waited for each expert rank are added."""
        symm = self.symm
        symm.check_usable()
        h, lay = state.handle, state.layout
        if state.recv_done:  # a hook called twice
            return state.out
        n, hidden, K, R = h.num_tokens, h.hidden, h.num_topk, symm.world_size
        dev = state.out.device
        if self._interpreted(dev):
            block_t, hc, warps = min(_pow2(n), 64), _pow2(hidden), 4
        else:
            block_t, hc, warps = 2, combine_recv_columns(hidden, state.fmt), 4
        grid = (triton.cdiv(max(n, 1), block_t), triton.cdiv(hidden, hc))
        base = self._slot_base(state.slot, lay)
        # Selections of experts on masked ranks (masked before or during this launch), with ids outside [0, E), or
        # whose slot does not carry this call's stamp are decided in the kernel after its waits (docs/protocols.md).
        s = self.sig
        _ll_combine_recv_fmt_kernel[grid](
            symm.buffer, state.topk_idx, state.topk_weights, state.out.view(torch.int16), symm.signal_ptrs, symm.status,
            wait_recv_cost_stats if wait_recv_cost_stats is not None else state.topk_idx, h.call_stamps,
            symm.rank, n, R, h.num_experts, symm.timeout_ns, base + lay.comb_off, state.slot * s["SLOT_WORDS"],
            H=hidden, K=K, BLOCK_T=block_t, HC=hc, HAS_WAIT_STATS=wait_recv_cost_stats is not None,
            COMB_BUSY=s["COMB_BUSY"], COMB_FULL=s["COMB_FULL"], COMB_RECV_CNT=s["COMB_RECV_CNT"],
            FMT=state.fmt, OUT_F16=state.out.dtype == torch.float16, TRANSPORT=self.transport, num_warps=warps,
            enable_fp_fusion=False, **self._gpu_launch(dev))
        self._open["COMB"] = max(0, self._open["COMB"] - 1)
        self._check_status_naming_fields("low_latency_combine (receive)", state.slot, "COMB_SIG")
        state.recv_done = True
        return state.out


def virtual_low_latency_step(paths: list, xs: list, topk_idxs: list, topk_weights: list,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int, *, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, expert_fn=None, outs=None,
                             stats=None, fmt: Optional[int] = None) -> tuple[list, list]:
    """One low-latency dispatch + combine over ``N`` virtual ranks in this process, phase by phase.

    ``paths[r]`` is rank ``r``'s :class:`SymmLowLatency` (over ``create_virtual_symm_buffers``); the
    launch order is every rank's ``dispatch_send``, every rank's ``dispatch_recv``, then
    ``combine_send`` and ``combine_recv`` likewise (what a perf bench times, and what a CUDA graph
    captures). ``expert_fn(rank, result) -> [L, R*T, H] bf16`` makes the combine input (default: the
    BF16 ``recv_x``, or for FP8 ``recv_x`` cast to BF16 without scales). ``outs[r]``: optional
    combine outputs; ``stats[r]``: optional `[L]` int32 receive statistics.

    Returns ``(dispatch results, combined outputs)``, each indexed by rank.
    """
    T, E = num_max_dispatch_tokens_per_rank, num_experts
    states = [p.dispatch_send(x, i, T, E, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0)
              for p, x, i in zip(paths, xs, topk_idxs)]
    results = [p.dispatch_recv(s, stats[r] if stats is not None else None) for r, (p, s) in enumerate(zip(paths, states))]
    if expert_fn is None:
        def expert_fn(rank, res):
            return res.recv_x.to(torch.bfloat16)
    ys = [expert_fn(r, res) for r, res in enumerate(results)]
    cstates = [p.combine_send(y, i, w, res.handle, out=outs[r] if outs is not None else None, fmt=fmt)
               for r, (p, y, i, w, res) in enumerate(zip(paths, ys, topk_idxs, topk_weights, results))]
    combined = [p.combine_recv(c) for p, c in zip(paths, cstates)]
    return results, combined
