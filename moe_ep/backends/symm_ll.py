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

NOTES: the carving below depends on ``(T, hidden, R, E, num_topk)``. Changing those shapes between
calls is safe once every rank has finished the previous step (e.g. after a host barrier); changing
them while a peer may still be inside the previous step's combine is not.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton

from ..fp8 import FP8_DTYPE, tma_aligned_size
from ..kernels.fp8_cast import native_e4m3_supported
from ..kernels.logfmt import FMT_BF16, FMT_FP16, check_hidden, row_bytes
from ..kernels.low_latency import (
    SIG_WORDS,
    _ll_combine_recv_fmt_kernel,
    _ll_combine_send_fmt_kernel,
    _ll_dispatch_recv_kernel,
    _ll_dispatch_send_kernel,
    _ll_release_kernel,
    signal_layout,
)
from ..kernels.low_latency_common import sig_stride
from ..kernels.pdl import INTERPRET
from .. import events
from ..kernels.signals import MASK_API, MASK_TIMEOUT
from ..symm import SymmBuffer
from ..sync import CallMismatchError, RankTimeoutError
from .base import LowLatencyDispatchResult, LowLatencyHandle

__all__ = ["SymmLowLatency", "SymmLowLatencyHandle", "ll_buffer_bytes", "deepep_ll_buffer_bytes", "virtual_low_latency_step"]

NUM_SLOTS = 2
GROUP = 128
_ALIGN = 256


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


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


class SymmLowLatency:
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

    # ------------------------------------------------------------------ sizes
    @staticmethod
    def num_signals(world_size: int, num_experts_max: int = 1024) -> int:
        """Signal words per rank (independent of the number of experts: counts travel as data)."""
        return NUM_SLOTS * signal_layout(world_size)["SLOT_WORDS"]

    @staticmethod
    def size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int,
                  num_topk: int = 8, transport: int = 0) -> int:
        """Data bytes per rank (``num_rdma_bytes``) for calls up to these shapes (BF16 or FP8)."""
        return ll_buffer_bytes(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts, num_topk, transport)

    _SIG_FIELDS = ("hidden", "T (num_max_dispatch_tokens_per_rank)", "num_experts * 256 + top-k", "kind/format flags")

    def _write_signature(self, slot: int, which: str, values: tuple) -> None:
        """This rank's call signature into its own entry of the slot (device writes, no host read; the
        send kernel copies it to every peer before it releases FULL, the receive kernel compares)."""
        rank = self.symm.rank
        at = slot * self.sig["SLOT_WORDS"] + self.sig[which] + self.sig["SIG_STRIDE"] * rank
        for w, v in enumerate(values):
            self.symm.signals[at + w].fill_(int(v))

    def _check_status_naming_fields(self, what: str, slot: int, which: str) -> None:
        """``check_status``; a call-signature mismatch is re-raised naming the fields that differ (error path
        only: reads the signature words on the host)."""
        try:
            self.symm.check_status(what)
        except RankTimeoutError as exc:
            self._other_operation(exc.missing_ranks, which, what, exc)
            raise
        except CallMismatchError as exc:
            peer = exc.peer
            base = slot * self.sig["SLOT_WORDS"] + self.sig[which]
            at, me = base + self.sig["SIG_STRIDE"] * peer, base + self.sig["SIG_STRIDE"] * self.symm.rank
            theirs = self.symm.signals[at:at + SIG_WORDS].tolist()
            mine = self.symm.signals[me:me + SIG_WORDS].tolist()
            diffs = "; ".join(f"{name}: rank {peer}={a}, rank {self.symm.rank}={b}"
                              for name, a, b in zip(self._SIG_FIELDS, theirs, mine) if a != b)
            raise CallMismatchError(f"moe_ep {what}: ranks disagree on {diffs} (nothing was read from rank {peer}; "
                                    "the Buffer is unusable: destroy it)", [n for n, a, b in
                                                                           zip(self._SIG_FIELDS, theirs, mine)
                                                                           if a != b]) from None
        if self._shrink and not events.uses_streams(self.symm.device):  # CPU: a host read of the mask is free
            # only peers this very receive masked: a masked rank still running may publish any word later
            timed = {p for p, v in enumerate(self.mask.tolist()) if v == MASK_TIMEOUT}
            new, self._timed_seen = sorted(timed - self._timed_seen), timed
            self._other_operation(new, which, what)

    def _other_operation(self, peers: list, which: str, what: str, exc: Optional[Exception] = None) -> None:
        """Error path: a peer whose wait timed out (or that a wait masked) published the *other* operation's FULL
        word here while this rank has no call of that kind open: it called that operation. Raise
        :class:`CallMismatchError` naming it and both operations (host reads of a few signal words)."""
        mine, other = ("DISP", "COMB") if which.startswith("DISP") else ("COMB", "DISP")
        if self._open[other]:  # (this rank's own call of that kind is still open: its FULL words are expected)
            return
        names = {"DISP": "low_latency_dispatch", "COMB": "low_latency_combine"}
        sw, at = self.sig["SLOT_WORDS"], self.sig[f"{other}_FULL"]
        for p in peers:
            if any(int(self.symm.signals[slot * sw + at + 2 * p]) for slot in range(NUM_SLOTS)):
                err = CallMismatchError(
                    f"moe_ep {what}: ranks called different operations (rank {p}: {names[other]}, rank "
                    f"{self.symm.rank}: {names[mine]}); this rank found rank {p}'s {names[other]} where it waited for "
                    f"its {names[mine]} ({'it was masked' if self._shrink else 'the Buffer is unusable: destroy it'})",
                    ["call"])
                err.peer = p
                raise err from exc

    def _slot_span(self, lay: _Layout) -> int:
        """Bytes of one slot: the data region less the staging areas (nvshmem), halved."""
        return (self.symm.nbytes - NUM_SLOTS * lay.stage_bytes) // NUM_SLOTS // _ALIGN * _ALIGN

    def _slot_base(self, slot: int, lay: _Layout) -> int:
        return slot * self._slot_span(lay)

    def _stage_base(self, lay: _Layout, slot: int) -> int:
        """Offset of slot ``slot``'s staging area (nvshmem transport): the last ``NUM_SLOTS * stage_bytes`` of the
        data region hold one per slot."""
        return (self.symm.nbytes - NUM_SLOTS * lay.stage_bytes) // _ALIGN * _ALIGN + slot * lay.stage_bytes

    def _check_capacity(self, T: int, hidden: int, E: int, K: int, what: str) -> _Layout:
        R = self.symm.world_size
        if E % R != 0:
            raise ValueError(f"{what}: num_experts={E} must be divisible by the number of ranks {R}")
        if K > 32:  # the combine receive keeps one bit per selection in an int32
            raise ValueError(f"{what}: num_topk={K} exceeds 32")
        lay = _carve(T, hidden, R, E, K, self.transport)
        have = self._slot_span(lay) if self.symm.nbytes >= NUM_SLOTS * lay.stage_bytes else 0
        if lay.slot_bytes > have:
            need = self.size_hint(T, hidden, R, E, K, self.transport)
            raise ValueError(
                f"{what}: T={T}, hidden={hidden}, num_topk={K}, num_experts={E} on {R} ranks need "
                f"{lay.slot_bytes} bytes per buffer slot (plus {lay.stage_bytes} bytes of staging per slot) but the "
                f"low-latency buffer has {have} per slot "
                f"(num_rdma_bytes={self.symm.nbytes}); use num_rdma_bytes >= {need} "
                f"({'NvshmemBackend' if self.transport else 'SymmBackend'}.get_low_latency_size_hint)")
        need_sig = self.num_signals(R)
        if self.symm.num_signals < need_sig:
            raise ValueError(f"{what}: the symmetric buffer has {self.symm.num_signals} signal words, needs {need_sig}")
        return lay

    def _interpreted(self, device: torch.device) -> bool:
        return INTERPRET or device.type != "cuda"

    def _release(self, slot: int, word: str, device: torch.device) -> None:
        """nvshmem transport: free this rank's area on every live peer after a receive (``_ll_release_kernel``)."""
        if self.transport:
            symm = self.symm
            _ll_release_kernel[(1,)](symm.signal_ptrs, symm.status, symm.rank, symm.world_size,
                                     slot * self.sig["SLOT_WORDS"], WORD=self.sig[word], **self._nvshmem_launch(device))

    def _nvshmem_launch(self, device: torch.device) -> dict:
        """Launch options of kernels that call NVSHMEM on a GPU (:func:`moe_ep.nvshmem.launch_options`: the device
        bitcode to link, and the register cap lifted); none in the interpreter or with peer pointers."""
        if self._interpreted(device) or not self.transport:
            return {}
        from .. import nvshmem

        return nvshmem.launch_options(torch.cuda.get_device_capability(device))

    def _copy_chunk(self, device: torch.device) -> int:
        """int32 words per step of the nvshmem transport's block copies to mapped peers."""
        return 4096 if self._interpreted(device) else 1024

    # ------------------------------------------------------------------ rank mask (enable_shrink)
    def update_mask(self, rank: int, masked: bool) -> None:
        """Mask (``MASK_API``) or unmask ``rank`` on this rank: device writes, no host read (graph-safe). The words
        are the effective mask the kernels read: masking THIS rank sets every other rank's word (it then
        exchanges with nobody else); unmasking it restores the other API masks (and drops timeout masks)."""
        me = self.symm.rank
        self._api[rank] = int(bool(masked))
        if rank != me:
            if not self._api[me]:
                self.mask[rank] = MASK_API if masked else 0
            return
        if masked:
            others = torch.ones_like(self.mask, dtype=torch.bool)
            others[me] = False
            self.mask.copy_(torch.where(others & (self.mask == 0), torch.full_like(self.mask, MASK_API), self.mask))
        else:
            self.mask.copy_(torch.tensor([MASK_API if (a and r != me) else 0 for r, a in enumerate(self._api)],
                                         dtype=torch.int32))

    def reported_mask(self) -> Optional[list]:
        """The API's view for a self-masked rank (``None`` otherwise: the device words are the view)."""
        return list(self._api) if self._api[self.symm.rank] else None

    def clean_mask(self) -> None:
        """Unmask every rank and zero this rank's signal words of the ranks that were masked (a masked rank's
        busy / full words may be left set by the steps it missed). Call it on every rank between steps, once
        every rank has finished the previous step and before a returning rank's first call (e.g. after a host
        barrier that includes it). Every rank resumes on slot 0 of both double buffers (a CUDA graph captured
        before must be re-captured: its slots are baked in). Device ops only."""
        R, sig = self.symm.world_size, self.sig
        keep = (self.mask == 0).to(torch.int32)
        words = self.symm.signals[:NUM_SLOTS * sig["SLOT_WORDS"]].view(NUM_SLOTS, sig["SLOT_WORDS"])
        # Under the precondition (every rank done with its last call) a live rank's words are all 0 already, so every
        # FULL / BUSY word and signature entry of both slots is zeroed, and every rank restarts on slot 0 of both
        # double buffers: a rank that was out for an odd number of calls is back in step with the others.
        for name in ("DISP_FULL", "DISP_BUSY", "COMB_FULL", "COMB_BUSY"):
            words[:, sig[name]:sig[name] + 2 * R] = 0
        words[:, sig["DISP_SIG"]:sig["COMB_SIG"] + sig["SIG_STRIDE"] * R] = 0
        self._dispatch_slot = 0
        self._combine_slot = 0
        # A masked source's messages may sit unread here (headers a receive never cleared): zero its rows, so a later
        # call never reads a stale header as a token that came.
        for off, T, msg in self._msg_areas.values():
            self.symm.buffer[off:off + R * T * msg].view(R, T * msg).mul_(keep.to(torch.uint8)[:, None])
        self.mask.zero_()
        self._api = [0] * R
        self._timed_seen = set()

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
            block_t = min(_pow2(n), 64)
            chunk_t, block_e, gc, hc, warps = block_t, min(_pow2(E), 256), _pow2(G), _pow2(hidden), 4
        else:
            block_t = 1 if n <= 256 else 2
            chunk_t, block_e, gc, hc, warps = 32, 64, min(_pow2(G), 8), min(_pow2(hidden), 2048), 4
        if use_ue8m0:
            gc = max(gc, 4)
        num_token_progs = triton.cdiv(n, block_t)
        grid = (num_token_progs + triton.cdiv(E, block_e),)
        base = self._slot_base(slot, lay)
        s = self.sig
        self._msg_areas[slot] = (base + lay.msg_off, T, lay.msg)
        # flags: dispatch kind (1), FP8 / rounding / UE8M0, and the 16-bit dtype of a BF16/FP16 send (bits are copied
        # as they are, so BF16 on one rank and FP16 on another must not match)
        f16 = int(not use_fp8 and x.dtype == torch.float16)
        self._write_signature(slot, "DISP_SIG", (hidden, T, E * 256 + K,
                                                 1 | int(use_fp8) << 1 | int(round_scale) << 2 | int(use_ue8m0) << 3
                                                 | f16 << 4))
        _ll_dispatch_send_kernel[grid](
            x_arg, topk, symm.buffer_ptrs, symm.signal_ptrs, symm.status, handle.call_stamps,
            symm.rank, n, T, L, E, R, num_token_progs, symm.timeout_ns,
            base + lay.cnt_off, base + lay.msg_off, slot * s["SLOT_WORDS"],
            H=hidden, K=K, KP=_pow2(K), MSG=lay.msg, HDR=_hdr(hidden, use_fp8), BLOCK_T=block_t, CHUNK_T=chunk_t, BLOCK_E=block_e,
            GC=gc, HC=hc, IS_FP8=use_fp8, ROUND_SCALE=round_scale, USE_UE8M0=use_ue8m0,
            NATIVE_FP8=use_fp8 and native_e4m3_supported(dev),
            DISP_BUSY=s["DISP_BUSY"], DISP_FULL=s["DISP_FULL"], DISP_SEND_CNT=s["DISP_SEND_CNT"],
            stage_off=self._stage_base(lay, slot) + lay.cnt_stage, TRANSPORT=self.transport, CH=self._copy_chunk(dev),
            sig_copy_off=self._stage_base(lay, slot), num_warps=warps, **self._nvshmem_launch(dev))
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
            TRANSPORT=self.transport, num_warps=warps)
        self._release(state.slot, "DISP_BUSY", dev)
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
        if self._interpreted(dev):
            block_t, hc, warps = min(_pow2(T), 64), _pow2(hidden), 4
        else:
            block_t, hc, warps = 2, min(_pow2(hidden), 1024), 4
        base = self._slot_base(slot, lay)
        s = self.sig
        x16 = x.view(torch.int16)
        self._write_signature(slot, "COMB_SIG", (hidden, T, handle.num_experts * 256 + K,
                                                 16 | int(fmt) << 5 | int(in_f16) << 9))
        _ll_combine_send_fmt_kernel[(R, triton.cdiv(T, block_t))](
            x16, x16.stride(0), x16.stride(1), handle.slot_row, handle.recv_tokens, handle.call_stamps,
            symm.buffer_ptrs, symm.signal_ptrs, symm.status,
            symm.rank, T, R, symm.timeout_ns, base + lay.comb_off, slot * s["SLOT_WORDS"],
            H=hidden, K=K, KP=_pow2(K), BLOCK_T=block_t, HC=hc,
            COMB_BUSY=s["COMB_BUSY"], COMB_FULL=s["COMB_FULL"], COMB_SEND_CNT=s["COMB_SEND_CNT"],
            FMT=fmt, IN_F16=in_f16, NATIVE_FP8=fmt == 2 and native_e4m3_supported(dev),
            stage_off=self._stage_base(lay, slot) + lay.comb_stage, TRANSPORT=self.transport, CH=self._copy_chunk(dev),
            ROW_BYTES=row_bytes(fmt, hidden), sig_copy_off=self._stage_base(lay, slot) + 4 * self.sig["SIG_STRIDE"],
            num_warps=warps, **self._nvshmem_launch(dev))
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
            block_t, hc, warps = 2, min(_pow2(hidden), 1024), 4
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
            enable_fp_fusion=False)
        self._release(state.slot, "COMB_BUSY", dev)
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
