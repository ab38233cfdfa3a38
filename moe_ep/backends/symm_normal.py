"""Normal-mode (prefill) path of the ``symm`` backend: device-initiated intranode dispatch / combine (the
dispatch phases are :mod:`moe_ep.backends.symm_normal_dispatch`, mixed into :class:`SymmNormal`).

Each operation is a send launch and a receive launch (:mod:`moe_ep.kernels.intranode`). A token
travels once per destination rank as one message row of int32 words, packed on the sender by torch
ops on the device (payload | FP8 scales | top-k ids | top-k weights); the receiver unpacks views of
the received rows. Without ``num_worst_tokens``, dispatch reads the receive counts (to size ``recv_x``)
and the per-expert counts (for the Python list) on the host; with ``0 < num_worst_tokens <= C`` (below) no
call reads device data on the host; with ``num_worst_tokens > C`` dispatch reads the round-0 sizes once
(Rounds, below). The layout
(``get_dispatch_layout``) is one Triton kernel (:mod:`moe_ep.kernels.layout`), no host synchronisation.

Buffer carving (``num_nvl_bytes`` per rank, recomputed per call from the message width ``W``). A copying
dispatch and the combine after it time-share the whole buffer (docs/protocols.md "Time-shared area")::

    [0, nbytes)              dispatch area: [R sources][cap_d rows][W_d words]   cap_d = nbytes / (R * 4 * W_d)
    [0, nbytes)              combine area:  [R ranks][cap_c rows][W_c words]     W_c = H / 2 + K (bf16/fp16 row, weights;
                                                                                FP8 combine: H / 4 + H / 128 + K)

    (W_d, W_c rounded up to 16 words = 64 bytes so the kernels move rows in 16-byte vectors)

    while a receive view is held (a view dispatch, until the next combine receive or dispatch): halves,
    dispatch planes in [0, nbytes / 2), the combine area in [nbytes / 2, nbytes) with cap_c = nbytes / 2 / (R * 4 * W_c)

    receive as a view (``recv_view=True``): the dispatch area holds planes instead, P = as many rows as fit,
    [P][payload words] | [P][scale words] | [P][2K id words] | [P][K + padding words] (each plane 64-byte
    aligned); source s's rows start at row sum_{s' < s} count(s' -> d), so plane_0[:M] is recv_x

Rounds (a batch larger than the buffer). ``C = min(cap_d, cap_c)`` is the rows of a per-source block, the
most tokens a source can put there in one round. Round ``r`` sends each source's tokens ``[r C, (r + 1) C)``
(an empty block once a source has none left) and every receiver drains it into the final output before
its release lets the next round's send in (the busy words, as between calls). Source ``s``'s rows of round
``r`` land at row ``(rows of the sources < s) + (rows of s in rounds < r)``: the receive order is the
single-round one (source rank, then source token) and every output is bitwise the same. Round 0 carries
each source's whole-call sizes (rows per destination, token count) in the ``DISP_META`` words; the receive
reads them on the host with the receive counts it already read, so every rank derives the same number of
rounds ``T = ceil(max tokens of any rank / C)`` without another exchange (with ``num_worst_tokens > C`` this
is the one host read of the call; a cached dispatch reuses the handle's sizes: no read). ``T = 1`` is
exactly the single-round path. Combine uses the dispatch's rounds: round ``r`` carries back the rows of
the sources' round-``r`` tokens (every contribution of a token in one round: the float32 sum keeps its
rank order). Sends and receives of the rounds are separate host-driven launches (the phase rule).

``0 < num_worst_tokens <= C`` (not a receive view): every rank takes the single-round path with no host read
and sends all its tokens in round 0, whatever its token count. This is safe: the rows any source sends a
destination ``d`` are at most the rows ``d`` receives, which the ``num_worst_tokens`` contract bounds by
``num_worst_tokens <= C``, the rows of a source's block. The ranks agree on this path without an exchange
because ``num_worst_tokens`` must be the same on every rank: whether the rule applies is bit 6 of the
dispatch's call signature (``DISP_SIG`` flags), so ranks that disagree (one ``<= C``, one ``> C``) get the
signature mismatch (:class:`~moe_ep.CallMismatchError` naming ``flags``) instead of a wrong result. The
contract is guarded on the device: the send kernel never writes a slot past the sender's block (it would
land in the next source's block); the sender's status word then names the destination and its send raises
"more rows than num_worst_tokens for destination d" (the destination's receive times out on it), and a
receiver's gather drops rows past ``num_worst_tokens`` and flags them. The handle is a one-round handle
(its combine is one round too); a cached dispatch with ``num_worst_tokens <= C`` takes the same path.

A call refused by one rank's own checks is published to the peers as an empty "refused" block
(:mod:`moe_ep.backends.symm_refusal`): they raise ``RemoteRankError`` naming it and the Buffer stays in step.
A buffer below one token per source per round is refused with the minimum (:meth:`SymmNormal.min_bytes`);
a receive view must hold the whole receive (refused otherwise). :meth:`SymmNormal.size_hint` gives the
whole-batch size for a token count, or a fixed size for a chunk (``num_max_tokens=None`` /
``chunk_tokens=``: time-shared, ``R * C`` rows). DeepSeek-V3 prefill (4096 tokens per rank, hidden 7168, top-8,
EP8): whole batch 2 * 8 * 4096 * 14464 = 948 MB per rank (rows of 2 * 7168 + 96 bytes padded to 64; sized for
BF16 payloads; FP8 payloads use 491 MB of it); fixed (C = 512, 8 rounds) 8 * 512 * 14464 = 59 MB; DeepEP's NVL
hint with its default config is 336 MB, DeepEP V2's 474 MB.

Limits of this release: hidden must be even (rows are int32 words); dispatch's packing and
unpacking are extra passes over the data in torch (fusing them into the kernels is the next step); a
dispatch with ``num_worst_tokens > C`` reads the round-0 sizes on the host once (it is not CUDA-graph
capturable: size the buffer so that ``num_worst_tokens <= C``, e.g. ``get_normal_size_hint(num_worst_tokens,
...)`` or ``chunk_tokens=num_worst_tokens``).
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import triton

from ..kernels.intranode import _combine_recv_fmt_kernel, _scatter_send_kernel, signal_layout
from ..kernels.layout import dispatch_layout
from ..kernels.logfmt import FMT_BF16, FMT_FP8, FMT_FP16, FMT_LOGFMT, check_hidden, encode_rows
from ..kernels.pdl import INTERPRET
from ..symm import SymmBuffer
from ..sync import CallMismatchError, RankTimeoutError
from .symm_normal_dispatch import NormalDispatchMixin, SymmNormalHandle, _pad16, _rows, _words
from .symm_refusal import RefusalMixin

__all__ = ["SymmNormal", "SymmNormalHandle"]


@dataclasses.dataclass
class _CombineState:
    handle: SymmNormalHandle
    words: int
    cap: int
    has_w: bool
    fmt: int = FMT_BF16
    out_dtype: torch.dtype = torch.bfloat16
    rows: torch.Tensor = None  # [M, W] packed rows (chunked rounds)
    offs: torch.Tensor = None  # [T, R] first row of each source's rows per round (chunked rounds)
    sig: tuple = ()
    acc: torch.Tensor = None
    out: torch.Tensor = None
    wout: torch.Tensor = None
    cum0: torch.Tensor = None
    shared: bool = True  # the time-shared area (whole buffer, also waits for the dispatch's busy words); else halves


class SymmNormal(NormalDispatchMixin, RefusalMixin):
    """Normal-mode dispatch / combine of one rank over its :class:`~moe_ep.symm.SymmBuffer` (phases as
    methods; see :class:`moe_ep.backends.symm.SymmBackend`): sizes, call signatures, status checks and combine here;
    dispatch: :mod:`moe_ep.backends.symm_normal_dispatch`; refusals: :mod:`moe_ep.backends.symm_refusal`."""

    def __init__(self, symm: SymmBuffer, owner: int):
        self.symm = symm
        self.owner = owner
        self.sig = signal_layout(symm.world_size)
        self._interp = INTERPRET or symm.device.type != "cuda"
        self._view_used = False  # a receive view was handed out once: releases may be due (device-checked)
        self._held = False  # the last dispatch was a view, not yet released by a combine: the combine uses halves
        self.sends = 0  # send launches so far (a refusal with none since the Buffer's mark wrote nothing)
        self._ref_pending: list = []  # queued copies of the refusal words (GPU)

    @staticmethod
    def num_signals(world_size: int) -> int:
        return signal_layout(world_size)["WORDS"]

    @staticmethod
    def _dispatch_words(hidden: int, num_topk: int, fp8: bool, with_topk: bool = True) -> int:
        payload = (hidden + 4 * (hidden // 128)) if fp8 else 2 * hidden
        return _pad16((payload + (12 * num_topk if with_topk else 0)) // 4)

    #: rows one rank receives per round (all sources together) that the default chunk size aims at: large
    #: enough that a round's transfer (~60 MB at DeepSeek-V3 shapes) dwarfs its two launches and its wait
    ROUND_ROWS = 4096
    MIN_CHUNK = 64

    @staticmethod
    def default_chunk(world_size: int) -> int:
        """Tokens per source per round of the fixed-size hint: ``max(64, 4096 // world_size)``."""
        return max(SymmNormal.MIN_CHUNK, SymmNormal.ROUND_ROWS // max(world_size, 1))

    @staticmethod
    def chunk(world_size: int, num_max_tokens=None, chunk_tokens=None) -> int:
        """Tokens per source per round of a fixed size: ``chunk_tokens`` (default :meth:`default_chunk`), at most
        ``num_max_tokens`` when given (a batch that small takes one round), at least 1. The one check of
        ``chunk_tokens`` (:meth:`size_hint` and :mod:`moe_ep.deepep.v2.memory` both call this): None or a positive
        int (a bool, float or string is refused, not rounded)."""
        if chunk_tokens is None:
            c = SymmNormal.default_chunk(world_size)
        else:
            try:
                c = 0 if isinstance(chunk_tokens, bool) else operator.index(chunk_tokens)
            except TypeError:
                c = 0
            if c < 1:
                raise ValueError(f"chunk_tokens must be a positive int or None, got {chunk_tokens!r}")
        return max(1, c if num_max_tokens is None else min(num_max_tokens, c))

    @staticmethod
    def size_hint(num_max_tokens, hidden: int, num_topk: int, world_size: int, *, chunk_tokens=None) -> int:
        """``num_nvl_bytes`` for normal-mode calls (BF16 or FP8, with top-k).

        ``num_max_tokens`` given, no ``chunk_tokens``: every rank's batch of up to ``num_max_tokens`` tokens
        moves in one round (the whole receive in the buffer, the fastest path; needed by receive views).
        ``num_max_tokens=None`` and/or ``chunk_tokens=C``: a fixed size, independent of the batch: batches of
        more than ``C`` tokens move in rounds of ``C`` tokens per source (``C`` defaults to
        :meth:`default_chunk`). Either way the size covers a receive view's plane padding (its four planes start
        64-byte aligned: up to 3 x 64 bytes in the dispatch half), so a view holds the ``R * num_max_tokens``
        worst-case rows."""
        w = max(SymmNormal._dispatch_words(hidden, num_topk, False), _pad16(hidden // 2 + num_topk))
        if num_max_tokens is None or chunk_tokens is not None:
            c = SymmNormal.chunk(world_size, num_max_tokens, chunk_tokens)
            # copying calls time-share the whole buffer: one [R][C] block area serves dispatch, then combine
            return (world_size * c * 4 * w + 255) // 256 * 256
        return (2 * (world_size * max(num_max_tokens, 1) * 4 * w + 3 * 64) + 255) // 256 * 256

    @staticmethod
    def min_bytes(hidden: int, num_topk: int, world_size: int, words: int = 0) -> int:
        """The smallest ``num_nvl_bytes`` that moves one token per source per round of a copying receive (rows of
        ``words`` int32 words: the dispatch's message width; 0: BF16 with top-k; the area is time-shared)."""
        w = max(words or SymmNormal._dispatch_words(hidden, num_topk, False), _pad16(hidden // 2 + num_topk))
        return world_size * 4 * w

    _SIG_FIELDS = ("hidden", "row words (hidden, dtype, scales, top-k)", "num_experts * 256 + top-k", "flags")

    def _write_signature(self, which: str, values: tuple) -> None:
        """This rank's call signature into its own entry (device writes; the send kernel copies it to every
        peer before releasing FULL, the receive kernels compare)."""
        at = self.sig[which] + 4 * self.symm.rank
        for w, v in enumerate(values):
            self.symm.signals[at + w].fill_(int(v))

    def _check(self, what: str) -> None:
        """``check_status``; a timeout on a peer that called the other operation is a :class:`CallMismatchError`."""
        try:
            self.symm.check_status(what)
        except RankTimeoutError as exc:
            self._diagnose_kind(exc, what)
            raise

    def _check_status_naming_fields(self, what: str, which: str) -> None:
        try:
            self._check(what)
        except CallMismatchError as exc:
            if getattr(exc, "other_operation", None):  # (the peer is in the other operation: nothing to name)
                raise
            peer, me, base = exc.peer, self.symm.rank, self.sig[which]
            theirs = self.symm.signals[base + 4 * peer: base + 4 * peer + 4].tolist()
            mine = self.symm.signals[base + 4 * me: base + 4 * me + 4].tolist()
            bad = [(n, a, b) for n, a, b in zip(self._SIG_FIELDS, theirs, mine) if a != b]
            detail = "; ".join(f"{n}: rank {peer}={a}, rank {me}={b}" for n, a, b in bad)
            raise CallMismatchError(f"moe_ep {what}: ranks disagree on {detail} (nothing was read from rank {peer}; "
                                    "the Buffer is unusable: destroy it)", [n for n, _, _ in bad]) from None

    def _cap(self, words: int, shared: bool = False) -> int:
        """Rows of a per-source block: of the whole buffer (``shared``: time-shared, copying calls) or of a half."""
        area = self.symm.nbytes if shared else self.symm.nbytes // 2
        return area // (self.symm.world_size * 4 * max(words, 1))

    def _dispatch_cap(self, hidden: int, num_topk: int, words: int, shared: bool) -> int:
        """Tokens per source of a dispatch of ``words``-wide rows: its combine's 16-bit rows must fit too."""
        return min(self._cap(words, shared), self._cap(_pad16(hidden // 2 + num_topk), shared))

    def _blocks(self, words: int) -> tuple[int, int]:
        if self._interp:
            return 64, triton.next_power_of_2(max(words, 16))
        return 16, 256

    # ------------------------------------------------------------------ layout
    def layout(self, topk_idx: torch.Tensor, num_experts: int, bad_flag: torch.Tensor = None):
        return dispatch_layout(topk_idx, num_experts, self.symm.world_size, bad_flag)

    # ------------------------------------------------------------------ combine
    def combine_send(self, x: torch.Tensor, handle: SymmNormalHandle, topk_weights, fmt=None) -> _CombineState:
        """``x`` BF16 or FP16 rows; ``fmt`` (:mod:`moe_ep.kernels.logfmt`): None / BF16 / FP16 send ``x`` as it is,
        ``FMT_FP8`` sends e4m3 with 1x128 scales (quantized by torch ops on the sender, like dispatch's packing)."""
        if fmt == FMT_LOGFMT:
            raise ValueError("LogFMT combine is a low-latency combine format (use combine_dtype=torch.float8_e4m3fn "
                             "for a compressed normal combine)")
        if fmt != FMT_FP8:
            fmt = FMT_FP16 if x.dtype == torch.float16 else FMT_BF16
        check_hidden(fmt, handle.hidden)
        self.symm.check_usable()
        R, dev, L = self.symm.world_size, self.symm.device, self.sig
        m, h = handle.num_recv_tokens, handle.hidden
        counts = handle.recv_counts
        parts = [_words(encode_rows(x, FMT_FP8) if fmt == FMT_FP8 else x)]
        if topk_weights is not None:
            parts.append(_words(topk_weights))
        rows = _rows(parts)
        words = rows.shape[1]
        # time-shared unless a receive view still holds the first half (then halves: waiting for the view's
        # dispatch busy words would wait for this very combine's receive, which releases them)
        shared = not self._held
        cap = self._cap(_pad16(h // 2 + handle.num_topk), shared)  # the 16-bit row width: FP8 rows are narrower
        if handle.chunk > cap:
            raise ValueError(f"backend 'symm': this combine's handle comes from a dispatch of up to {handle.chunk} rows "
                             f"per source, but a receive view is held, so the combine has half the buffer ({cap} rows "
                             "per source): combine the view's handle first, or dispatch again without recv_as_view")
        sig = (h, words, handle.num_topk, 2 | int(fmt) << 2 | int(topk_weights is not None) << 6 | int(shared) << 7)
        self._held = False  # this combine's receive releases the view
        self._write_signature("COMB_SIG", sig)
        st = _CombineState(handle, words, cap, topk_weights is not None, fmt, x.dtype, sig=sig, shared=shared)
        if handle.rounds > 1:  # chunked: round r carries back the rows of the sources' round-r tokens
            rc = handle.round_counts
            prefix = counts.to(torch.int32).cumsum(0, dtype=torch.int32) - counts.to(torch.int32)
            st.rows = rows
            st.offs = (prefix[None, :] + rc.cumsum(0, dtype=torch.int32) - rc).contiguous()
            self._combine_send_round(st, 0)
            return st
        ends = counts.cumsum(0)
        rows_idx = torch.arange(m, device=dev)
        src = torch.searchsorted(ends, rows_idx, right=True)  # source rank of each received row
        valid = src < R
        src_c = src.clamp(max=R - 1)
        slot = rows_idx - (ends[src_c] - counts[src_c])
        pos = torch.full((m, R), -1, dtype=torch.int32, device=dev)
        pos[rows_idx, src_c] = torch.where(valid, slot, -1).to(torch.int32)  # no boolean indexing: no host sync
        bt, bw = self._blocks(words)
        self.sends += 1
        _scatter_send_kernel[(R, max(1, triton.cdiv(m, bt)))](
            rows, pos, counts, counts, self.symm.buffer_ptrs, self.symm.signal_ptrs, self.symm.status,
            self.symm.rank, m, R, words, self._comb_off(st) + self.symm.rank * cap * words, cap, self.symm.timeout_ns,
            0,
            words, words, words, words, words, words,
            FULL=L["COMB_FULL"], BUSY=L["COMB_BUSY"], SEND_CNT=L["COMB_SEND_CNT"], BLOCK_T=bt, BLOCK_W=bw,
            BUSY2=L["DISP_BUSY"] if shared else -1, REF=L["REFUSED"])
        self._check("combine (send)")
        return st

    def _comb_off(self, st: _CombineState) -> int:
        """Word offset of the combine area: 0 when time-shared, the second half otherwise."""
        return 0 if st.shared else self.symm.nbytes // 8

    def combine_send_round(self, st: _CombineState, r: int) -> None:
        """Send round ``r >= 1`` of a chunked combine (after this rank's combine receive of round ``r - 1``)."""
        self._combine_send_round(st, r)

    def _combine_send_round(self, st: _CombineState, r: int) -> None:
        R, L, w = self.symm.world_size, self.sig, st.words
        if r > 0:
            self._write_signature("COMB_SIG", st.sig)
        rc = st.handle.round_counts[r]
        bt, bw = self._blocks(w)
        self.sends += 1
        _scatter_send_kernel[(R, max(1, triton.cdiv(st.handle.chunk, bt)))](
            st.rows, st.offs[r], rc, rc, self.symm.buffer_ptrs, self.symm.signal_ptrs, self.symm.status,
            self.symm.rank, st.rows.shape[0], R, w, self._comb_off(st) + self.symm.rank * st.cap * w, st.cap,
            self.symm.timeout_ns, 0, w, w, w, w, w, w,
            FULL=L["COMB_FULL"], BUSY=L["COMB_BUSY"], SEND_CNT=L["COMB_SEND_CNT"], BLOCK_T=bt, BLOCK_W=bw, SEG=True,
            BUSY2=L["DISP_BUSY"] if st.shared else -1, REF=L["REFUSED"])
        self._check("combine (send)")

    def combine_recv_round(self, st: _CombineState, r: int, bias: tuple = ()) -> None:
        """Reduce round ``r`` (the original tokens ``[r C, (r + 1) C)``; all of them when the dispatch took one
        round) into the output; round 0 starts from the bias terms."""
        R, dev, L = self.symm.world_size, self.symm.device, self.sig
        handle = st.handle
        n, h, k = handle.num_tokens, handle.hidden, handle.num_topk
        if r == 0:
            st.acc = torch.zeros(n, h, dtype=torch.float32, device=dev)
            for b in bias:  # the reference order: bias terms first
                st.acc += b.float()
            st.out = torch.empty(n, h, dtype=st.out_dtype, device=dev)
            st.wout = torch.empty(n, k, dtype=torch.float32, device=dev) if st.has_w else st.acc
        if handle.rounds > 1:
            C = handle.chunk
            t0 = min(r * C, n)
            t1 = min(t0 + C, n)
            if st.cum0 is None:
                st.cum0 = self._cum0(handle.is_token_in_rank)
            p = handle.send_pos[t0:t1]
            pos = torch.where(p >= 0, p - st.cum0[t0], -1).to(torch.int32).contiguous()
        else:
            t0, t1, pos = 0, n, handle.send_pos
        nr = t1 - t0
        bt, hc = (64, triton.next_power_of_2(h)) if self._interp else (16, 256)
        _combine_recv_fmt_kernel[(max(1, triton.cdiv(nr, bt)), triton.cdiv(h, hc))](
            st.acc[t0:t1], st.out.view(torch.int16)[t0:t1], st.wout[t0:t1], pos, self.symm.buffer_ptrs,
            self.symm.signal_ptrs, self.symm.status, self.symm.rank, nr, R, st.words, st.cap, self._comb_off(st),
            self.symm.timeout_ns,
            H=h, K=max(k, 1), KP=triton.next_power_of_2(max(k, 1)), HAS_W=st.has_w,
            FULL=L["COMB_FULL"], BUSY=L["COMB_BUSY"], RECV_CNT=L["COMB_RECV_CNT"], BLOCK_T=bt, HC=hc,
            FMT=st.fmt, OUT_F16=st.out_dtype == torch.float16, enable_fp_fusion=False, REF=L["REFUSED"],
            **(dict(DFULL=L["DISP_FULL"], DBUSY=L["DISP_BUSY"], DCNT=L["DISP_CNT"], DHELD=L["DISP_HELD"])
               if self._release_due() else {}))
        self._check_status_naming_fields("combine (receive)", "COMB_SIG")
        if r == 0:  # (a refusal comes in round 0; later rounds must not start on any rank)
            self._check_refused("combine (receive)", blocking=handle.rounds > 1)

    def combine_finish(self, st: _CombineState):
        return st.out, (st.wout if st.has_w else None)

    def combine_recv(self, st: _CombineState, bias: tuple):
        """Every round of the combine receive (the sends of rounds >= 1 in between)."""
        rounds = st.handle.rounds
        if rounds > 1 and self.symm.provider == "virtual":
            raise ValueError("virtual ranks: a combine of a dispatch that took several rounds must run round by round "
                             "over every rank (moe_ep.backends.symm.virtual_combine_recv)")
        self.combine_recv_round(st, 0, bias)
        for r in range(1, rounds):
            self.combine_send_round(st, r)
            self.combine_recv_round(st, r)
        return self.combine_finish(st)
