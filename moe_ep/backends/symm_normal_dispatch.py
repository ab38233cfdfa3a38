"""Dispatch phases of the ``symm`` backend's normal mode (a mixin of :class:`~moe_ep.backends.symm_normal.SymmNormal`):
the message rows, the handle, the send and the receive (one round, or rounds of ``C`` tokens per source) and the
unpacked result. The buffer carving, the rounds and the ``num_worst_tokens`` rule are described in
:mod:`moe_ep.backends.symm_normal`; the cross-rank rules in docs/protocols.md, "Normal mode"."""

from __future__ import annotations

import dataclasses

import torch
import triton

from .. import events
from ..kernels.intranode import (
    _gather_recv_kernel,
    _recv_counts_kernel,
    _release_held_kernel,
    _scatter_send_kernel,
    _view_recv_kernel,
    view_planes,
)
from .base import DispatchHandle, DispatchResult

__all__ = ["NormalDispatchMixin", "SymmNormalHandle"]


def _words(t: torch.Tensor) -> torch.Tensor:
    """Rows of ``t`` `[M, ...]` as `[M, words]` int32 (the row byte size must be a multiple of 4)."""
    t = t.contiguous()
    if t.shape[0] == 0:
        return torch.empty(0, (t.shape[1:].numel() * t.element_size()) // 4, dtype=torch.int32, device=t.device)
    return t.reshape(t.shape[0], -1).view(torch.int32)


def _pad16(words: int) -> int:
    """Message width rounded up to 16 int32 words (64 bytes): Triton specialises integer arguments on
    divisibility by 16, and only then moves the rows in 16-byte vectors on the GPU."""
    return (words + 15) // 16 * 16


def _rows(parts: list) -> torch.Tensor:
    """Concatenate word columns into `[M, W]` int32 message rows, W padded by :func:`_pad16`."""
    words = sum(p.shape[1] for p in parts)
    pad = _pad16(words) - words
    if pad:
        parts = [*parts, torch.zeros(parts[0].shape[0], pad, dtype=torch.int32, device=parts[0].device)]
    return torch.cat(parts, dim=1).contiguous() if len(parts) > 1 else parts[0].contiguous()


def _unwords(w: torch.Tensor, dtype: torch.dtype, cols: int) -> torch.Tensor:
    if w.shape[0] == 0:
        return torch.empty(0, cols, dtype=dtype, device=w.device)
    w = w.contiguous()  # a one-row slice is already "contiguous" but may start on an odd word
    if (w.storage_offset() * w.element_size()) % dtype.itemsize:
        w = w.clone()
    return w.view(dtype).reshape(w.shape[0], cols)


@dataclasses.dataclass
class SymmNormalHandle(DispatchHandle):
    send_pos: torch.Tensor = None  # [N, R] int32 slot of token t at rank d (-1: not sent)
    recv_counts: torch.Tensor = None  # [R] int32 rows received from each source (device)
    num_topk: int = 0
    num_recv_tokens_per_expert_list: list = None
    recv_counts_host: list = None  # the same counts on the host (None after a num_worst_tokens dispatch)
    rank: int = 0
    chunk: int = 0  # C: tokens per source per round of the dispatch that made the handle
    rounds: int = 1  # T: its rounds (every rank has the same); combine uses the same rounds
    round_counts: torch.Tensor = None  # [T, R] int32 rows received from each source per round (T > 1)
    ntok_max: int = None  # the largest token count of any rank (cached dispatches reuse it: no host read)

    def deepep_field(self, name: str):
        if name == "rank_prefix_matrix":
            # NOTES: only this rank's column is known here (what it received from each source); the other
            # entries would need another exchange and are -1, so a caller cannot mistake them for counts.
            R = self.recv_counts.shape[0]
            m = torch.full((R, R), -1, dtype=torch.int32, device=self.recv_counts.device)
            m[:, self.rank] = self.recv_counts.to(torch.int32).cumsum(0).to(torch.int32)
            return m
        return None


@dataclasses.dataclass
class _SendState:
    handle: object
    n: int
    hidden: int
    dtype: torch.dtype
    has_scales: bool
    num_topk: int
    num_experts: int
    words: int
    cap: int
    pos: torch.Tensor
    counts: torch.Tensor
    is_token_in_rank: torch.Tensor
    num_tokens_per_rank: torch.Tensor
    scale_dtype: torch.dtype = torch.float32  # float32 [.., H/128] or packed UE8M0 int32 [.., ceil(H/512)]
    scale_cols: int = 0
    view: bool = False  # rows written as planes of the receiver's area (receive as a view)
    bounds: tuple = ()  # (S1, S2, S3): first columns of the scales / top-k ids / weights segments
    planes: tuple = ()  # (O1, O2, O3): word offsets of their planes
    view_rows: int = 0  # P: rows of each plane
    num_tokens_per_expert: torch.Tensor = None  # [E] of a layout-only dispatch that exchanges it (flag bit 5)
    rows: torch.Tensor = None  # [N, W] packed message rows (all rounds)
    cum0: torch.Tensor = None  # [N + 1, R] int32 tokens before t that go to d (chunked rounds)
    sig: tuple = ()  # this rank's 4 signature words (rewritten before each later round)
    # receive side (filled by dispatch_recv_round)
    rounds: int = 0  # T, known after round 0's receive
    m: int = 0
    out: torch.Tensor = None
    rcounts: torch.Tensor = None  # [R] rows received from each source (whole call)
    host: list = None
    dst: torch.Tensor = None  # [R] next output row of each source's rows (chunked)
    round_counts: list = None
    ntok_max: int = None
    worst_fit: bool = False  # 0 < num_worst_tokens <= cap (not a view): one round, every token, no host read
    one_round: bool = False  # a cached dispatch of a one-round handle (a view's or a worst-fit one): likewise
    refused: bool = False  # round 0's host read saw a peer's refusal (the receive raises RemoteRankError)




class NormalDispatchMixin:
    """Dispatch of :class:`~moe_ep.backends.symm_normal.SymmNormal`. Needs from it: ``symm``, ``sig``, ``owner``,
    ``sends``, ``_view_used``, ``_held``, ``size_hint`` / ``min_bytes`` (sizes), ``_blocks`` / ``_cap`` /
    ``_dispatch_cap`` (launch blocks, rows per source), ``_write_signature``, ``_check`` /
    ``_check_status_naming_fields`` (status words) and ``_check_refused`` (:mod:`moe_ep.backends.symm_refusal`)."""

    _view_used: bool
    _held: bool
    sends: int


    # ------------------------------------------------------------------ receive views
    def recv_view_fits(self, hidden: int, elem_size: int, scale_cols: int, num_topk: int, with_topk: bool,
                       num_tokens: int, num_worst_tokens: int = 0) -> bool:
        """Whether a receive view of a dispatch of up to ``num_tokens`` tokens per rank fits this buffer (rows of
        ``hidden`` elements of ``elem_size`` bytes, ``scale_cols`` 4-byte scales, ``num_topk`` ids and weights when
        ``with_topk``): the refusal rule of :meth:`dispatch_send`, for callers that fall back to a copying receive."""
        s1 = hidden * elem_size // 4
        bounds = (s1, s1 + scale_cols, s1 + scale_cols + (2 * num_topk if with_topk and num_topk > 0 else 0))
        words = _pad16(bounds[2] + (num_topk if with_topk and num_topk > 0 else 0))
        cap, rows, _ = self._view_layout(self._dispatch_cap(hidden, num_topk, words, False), bounds, words)
        return 1 <= cap and num_tokens <= cap and num_worst_tokens <= rows

    def _view_layout(self, cap: int, bounds: tuple, words: int) -> tuple:
        """``(cap, P, planes)`` for a receive view: ``P`` rows, as many as the dispatch area holds at this row
        width with the planes' 64-byte alignment; a source may still send at most ``cap <= P / R`` rows."""
        area = (self.symm.nbytes // 2) // 4
        rows = area // words
        while rows > 0 and view_planes(rows, bounds, words)[3] > area:
            rows -= 1
        return min(cap, rows // self.symm.world_size), rows, view_planes(rows, bounds, words)[:3]

    # ------------------------------------------------------------------ dispatch
    def _release_due(self, view: bool = False) -> bool:
        """Whether a release launch is due: this call is a view, a view was handed out before, or a CUDA graph is
        being captured (its replays may follow views taken after the capture). The device checks ``HELD``."""
        return view or self._view_used or events.is_capturing(self.symm.device)

    def dispatch_release(self, view: bool = False) -> None:
        """Free the dispatch area a receive view of this rank still holds (a no-op on the device when none is
        held; launched for every view dispatch (``view``), once a view was handed out, and while capturing).
        Its own phase: :meth:`SymmBackend.dispatch` runs it before the sends, since a peer's sends wait for it."""
        if self._release_due(view):
            L = self.sig
            _release_held_kernel[(1,)](self.symm.signal_ptrs, self.symm.status, self.symm.rank, self.symm.world_size,
                                       FULL=L["DISP_FULL"], BUSY=L["DISP_BUSY"], CNT=L["DISP_CNT"],
                                       HELD=L["DISP_HELD"], num_warps=1)

    def dispatch_send(self, x, x_scales, *, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                      topk_idx, topk_weights, num_experts, recv_view: bool = False,
                      num_worst_tokens: int = 0, release: bool = True) -> _SendState:
        """``recv_view``: the receivers get views of their own buffer (every rank must ask; the area stays
        theirs until their next dispatch or combine). ``num_worst_tokens``: checked against the view's rows.
        ``release``: run :meth:`dispatch_release` after the checks, before the sends (callers that run the
        ranks' phases one after another in one process call it for every rank first and pass False, then send
        in ascending rank order: a view's sender waits for the lower ranks' count words)."""
        self.symm.check_usable()
        R, (n, hidden) = self.symm.world_size, x.shape
        if (hidden * x.element_size()) % 4:
            raise ValueError(f"backend 'symm' normal mode needs hidden * element size to be a multiple of 4 bytes, "
                             f"got hidden={hidden} with {x.dtype}")
        if handle is not None:
            pos, counts = handle.send_pos, handle.num_tokens_per_rank.to(torch.int32)
            is_token_in_rank, k = handle.is_token_in_rank, handle.num_topk
        else:
            in_rank = is_token_in_rank.to(torch.int32)
            pos = torch.where(is_token_in_rank, in_rank.cumsum(0, dtype=torch.int32) - 1, -1).to(torch.int32)
            counts, k = num_tokens_per_rank.to(torch.int32), (0 if topk_idx is None else topk_idx.shape[1])
        parts = [_words(x.view(torch.uint8) if x.element_size() == 1 else x)]
        if x_scales is not None:
            parts.append(_words(x_scales if x_scales.dtype == torch.int32 else x_scales.float()))
        if handle is None and k > 0:
            parts += [_words(topk_idx), _words(topk_weights)]
        rows = _rows(parts)
        words = rows.shape[1]
        cap = self._dispatch_cap(hidden, k, words, not recv_view)
        scale_cols = x_scales.shape[1] if x_scales is not None else 0
        s1 = parts[0].shape[1]
        bounds = (s1, s1 + scale_cols, s1 + scale_cols + (2 * k if handle is None and k > 0 else 0))
        planes, view_rows = (words, words, words), 0
        if recv_view:
            cap, view_rows, planes = self._view_layout(cap, bounds, words)
        if recv_view and n > cap:
            need = self.size_hint(n, hidden, k, R)
            raise ValueError(f"backend 'symm': recv_as_view=True needs the whole receive in the buffer, and {n} tokens "
                             f"do not fit this rank's normal-mode buffer (at most {cap} for hidden={hidden}, top-{k}): "
                             f"pass num_nvl_bytes >= {need} (SymmBackend.get_normal_size_hint), or recv_as_view=False, "
                             "which streams any batch through the buffer in rounds")
        if cap < 1:
            need = self.min_bytes(hidden, k, R, words)
            raise ValueError(f"backend 'symm': num_nvl_bytes={self.symm.nbytes} (rounded up to 256) is below the "
                             "minimum for one round of "
                             f"normal-mode dispatch/combine (hidden={hidden}, top-{k}, {R} ranks, {4 * words}-byte rows): "
                             f"pass num_nvl_bytes >= {need} (one token per source per round; "
                             "SymmBackend.get_normal_size_hint(None, hidden, num_topk, num_ranks) gives a fixed size "
                             "chosen for bandwidth)")
        if recv_view and num_worst_tokens > view_rows:
            raise ValueError(f"backend 'symm': a receive view holds at most {view_rows} rows of {4 * words} bytes, "
                             f"num_worst_tokens={num_worst_tokens} asks for more: pass a larger num_nvl_bytes or a "
                             "smaller num_worst_tokens")
        # bit 5: a layout-only dispatch (no top-k) without num_worst_tokens, whose per-expert counts the ranks
        # exchange on the host after the receive (SymmBackend.dispatch_recv): every rank must enter it
        exchange = handle is None and k == 0 and num_worst_tokens == 0
        # bit 6: 0 < num_worst_tokens <= C: one round with every token, no host read (the receive cannot learn the
        # rounds without one, so the ranks must agree on taking this path: a rank that would read and run rounds
        # while a peer sent everything at once gets the signature mismatch instead)
        worst_fit = not recv_view and 0 < num_worst_tokens <= cap
        # a cached dispatch of a handle made in one round without learning the rounds (a receive view's, or a
        # worst-fit one's: its ntok_max is unknown) repeats that one round: its rows per destination fitted then
        # (the handle, hence this choice, is the same on every rank)
        one_round = (handle is not None and not recv_view and not worst_fit
                     and getattr(handle, "ntok_max", 0) is None)
        flags = 1 | int(x_scales is not None) << 1 | int(x_scales is not None and x_scales.dtype == torch.int32) << 2 \
            | int(handle is not None) << 3 | int(bool(recv_view)) << 4 | int(exchange) << 5 | int(worst_fit) << 6
        if release:  # before the signature: the release clears the held sources' entries, this rank's own too
            self.dispatch_release(view=bool(recv_view))
        self._write_signature("DISP_SIG", (hidden, words, (num_experts or 0) * 256 + k, flags))
        if recv_view:
            self._view_used = True
        self._held = bool(recv_view)  # (ranks agree: recv_view is signature flag bit 4)
        st = _SendState(handle, n, hidden, x.dtype, x_scales is not None, k, num_experts, words, cap, pos, counts,
                        is_token_in_rank, num_tokens_per_rank,
                        scale_dtype=x_scales.dtype if x_scales is not None else torch.float32,
                        scale_cols=scale_cols, view=bool(recv_view), bounds=bounds, planes=planes,
                        view_rows=view_rows, num_tokens_per_expert=num_tokens_per_expert if exchange else None,
                        rows=rows, worst_fit=worst_fit, one_round=one_round)
        st.sig = (hidden, words, (num_experts or 0) * 256 + k, flags)  # later rounds rewrite it (receives clear it)
        self._dispatch_send_round(st, 0)
        return st

    @staticmethod
    def _cum0(is_token_in_rank: torch.Tensor) -> torch.Tensor:
        """`[N + 1, R]` int32: entry ``[t, d]`` = tokens before ``t`` that go to ``d``."""
        c = is_token_in_rank.to(torch.int32).cumsum(0, dtype=torch.int32)
        return torch.cat([torch.zeros(1, c.shape[1], dtype=torch.int32, device=c.device), c])

    def dispatch_send_round(self, st: _SendState, r: int) -> None:
        """Send round ``r >= 1`` of a chunked dispatch (after this rank's receive of round ``r - 1``)."""
        self._dispatch_send_round(st, r)

    def _dispatch_send_round(self, st: _SendState, r: int) -> None:
        """Tokens ``[r C, (r + 1) C)`` (``C = st.cap``) to every destination's area (an empty block when none
        are left). Round 0 of a batch that fits sends exactly what the single-round path sends; so does round 0
        of a ``num_worst_tokens <= C`` dispatch (``st.worst_fit``), with every token whatever their number."""
        R, L, n, C = self.symm.world_size, self.sig, st.n, st.cap
        t0 = min(r * C, n)
        t1 = n if st.worst_fit or st.one_round else min(t0 + C, n)
        if r == 0 and t1 == n:
            rows, pos, counts = st.rows, st.pos, st.counts
        else:
            if st.cum0 is None:
                st.cum0 = self._cum0(st.is_token_in_rank)
            base = st.cum0[t0]
            counts = st.cum0[t1] - base
            p = st.pos[t0:t1]
            pos = torch.where(p >= 0, p - base, -1).to(torch.int32)
            rows = st.rows[t0:t1]
        if r > 0:
            self._write_signature("DISP_SIG", st.sig)
        bt, bw = self._blocks(st.words)
        self.sends += 1
        _scatter_send_kernel[(R, max(1, triton.cdiv(t1 - t0, bt)))](
            rows, pos.contiguous(), counts.contiguous(), st.counts.contiguous(), self.symm.buffer_ptrs,
            self.symm.signal_ptrs, self.symm.status, self.symm.rank, t1 - t0, R, st.words,
            0 if st.view else self.symm.rank * st.cap * st.words, st.cap, self.symm.timeout_ns, n,
            *st.bounds, *st.planes,
            FULL=L["DISP_FULL"], BUSY=L["DISP_BUSY"], SEND_CNT=L["DISP_SEND_CNT"], BLOCK_T=bt, BLOCK_W=bw,
            CNT=L["DISP_CNT"], VIEW=st.view, META=-1 if st.view else L["DISP_META"], BUSY2=L["COMB_BUSY"],
            REF=L["REFUSED"])
        self._check("dispatch (send)")

    def dispatch_recv_round(self, st: _SendState, r: int, *, num_worst_tokens: int) -> None:
        """Receive round ``r`` into the final output. Round 0 also learns the whole call's sizes (rows from
        each source, every source's token count: the number of rounds ``st.rounds``, the same on every rank)."""
        R, dev, L = self.symm.world_size, self.symm.device, self.sig
        if st.view:
            counts = torch.zeros(R, dtype=torch.int32, device=dev)
            _view_recv_kernel[(1,)](counts, self.symm.signal_ptrs, self.symm.status, self.symm.rank, R,
                                    num_worst_tokens if num_worst_tokens > 0 else st.view_rows, self.symm.timeout_ns,
                                    FULL=L["DISP_FULL"], HELD=L["DISP_HELD"], REF=L["REFUSED"], num_warps=1)
            self._check_status_naming_fields("dispatch (receive)", "DISP_SIG")
            self._check_refused("dispatch (receive)")
            if num_worst_tokens > 0:
                st.m, st.host = num_worst_tokens, None
            else:
                h = st.handle
                st.host = h.recv_counts_host if h is not None and h.recv_counts_host is not None else counts.tolist()
                st.m = sum(st.host)
            st.rcounts, st.rounds = counts, 1
            return
        if r > 0:
            self._gather_round(st)
            return
        h = st.handle
        C = st.cap
        if st.worst_fit:  # 0 < num_worst_tokens <= C: every source sent everything in round 0; no host read
            st.ntok_max, st.host, st.rounds, st.m = None, None, 1, num_worst_tokens
            self._gather_single(st, num_worst_tokens)
            return
        if st.one_round:  # cached, of a one-round handle: its sizes, no host read
            st.ntok_max, st.rounds, st.host = None, 1, h.recv_counts_host
            st.m = num_worst_tokens if num_worst_tokens > 0 else (
                sum(st.host) if st.host is not None else h.num_recv_tokens)
            self._gather_single(st, num_worst_tokens)
            return
        if h is not None and h.ntok_max is not None:  # cached: the sizes of the dispatch that made the handle
            st.ntok_max = h.ntok_max
            st.host = h.recv_counts_host
            tot = h.recv_counts
            if num_worst_tokens == 0 and -(-h.ntok_max // C) <= 1:  # (as the single-round path always did)
                counts = torch.zeros(R, dtype=torch.int32, device=dev)
                _recv_counts_kernel[(R,)](counts, self.symm.signal_ptrs, self.symm.status, self.symm.rank,
                                          self.symm.timeout_ns, FULL=L["DISP_FULL"])
                self._check("dispatch (receive)")
        else:
            meta = torch.zeros(4 * R, dtype=torch.int32, device=dev)
            _recv_counts_kernel[(R,)](meta, self.symm.signal_ptrs, self.symm.status, self.symm.rank,
                                      self.symm.timeout_ns, FULL=L["DISP_FULL"], META=L["DISP_META"])
            self._check("dispatch (receive)")
            vals = meta.tolist()  # NOTES: the one host read of a dispatch (sizes the output, fixes the rounds)
            st.ntok_max = max(vals[2 * R:3 * R])
            st.refused = any(vals[3 * R:])
            if h is not None:
                st.host, tot = h.recv_counts_host, h.recv_counts
            else:
                st.host, tot = (None if num_worst_tokens > 0 else vals[R:2 * R]), meta[R:2 * R].clone()
        st.rounds = max(1, -(-st.ntok_max // C))
        st.m = num_worst_tokens if num_worst_tokens > 0 else (sum(st.host) if st.host is not None else sum(tot.tolist()))
        if st.rounds == 1:
            self._gather_single(st, num_worst_tokens)
            return
        if st.refused:  # a peer refused: drain round 0 (its release frees every block), then raise
            st.rounds = 1
            self._gather_single(st, num_worst_tokens)
            return
        # Chunked: source s's rows of round r land at (rows of the sources before s) + (rows of s in rounds < r).
        st.out = torch.zeros(st.m, st.words, dtype=torch.int32, device=dev)
        st.rcounts = tot.to(torch.int32)
        st.dst = (st.rcounts.cumsum(0, dtype=torch.int32) - st.rcounts).contiguous()
        st.round_counts = []
        self._gather_round(st)

    def _gather_single(self, st: _SendState, num_worst_tokens: int) -> None:
        """The single-round receive: every source's rows after those of the lower sources (``st.m`` rows)."""
        R, dev, L, C = self.symm.world_size, self.symm.device, self.sig, st.cap
        st.out = torch.zeros(st.m, st.words, dtype=torch.int32, device=dev)
        counts = torch.zeros(R, dtype=torch.int32, device=dev)
        max_rows = min(C, st.m) if num_worst_tokens > 0 or st.host is None else max(st.host)
        bt, bw = self._blocks(st.words)
        _gather_recv_kernel[(R, max(1, triton.cdiv(max_rows, bt)))](
            st.out, counts, counts, self.symm.buffer_ptrs, self.symm.signal_ptrs, self.symm.status,
            self.symm.rank, R, st.words, C, 0, st.m, self.symm.timeout_ns,
            FULL=L["DISP_FULL"], BUSY=L["DISP_BUSY"], RECV_CNT=L["DISP_RECV_CNT"], BLOCK_T=bt, BLOCK_W=bw,
            CNT=L["DISP_CNT"], REF=L["REFUSED"])
        self._check_status_naming_fields("dispatch (receive)", "DISP_SIG")
        self._check_refused("dispatch (receive)", blocking=st.refused)
        # (more rows than num_worst_tokens: the gather kernel drops them and sets the status flag, which the
        # check above reports; no host read)
        st.rcounts = counts

    def _gather_round(self, st: _SendState) -> None:
        R, dev, L = self.symm.world_size, self.symm.device, self.sig
        counts = torch.zeros(R, dtype=torch.int32, device=dev)
        max_rows = st.cap if st.host is None else max(1, min(st.cap, max(st.host)))
        bt, bw = self._blocks(st.words)
        _gather_recv_kernel[(R, max(1, triton.cdiv(max_rows, bt)))](
            st.out, counts, st.dst, self.symm.buffer_ptrs, self.symm.signal_ptrs, self.symm.status,
            self.symm.rank, R, st.words, st.cap, 0, st.m, self.symm.timeout_ns,
            FULL=L["DISP_FULL"], BUSY=L["DISP_BUSY"], RECV_CNT=L["DISP_RECV_CNT"], BLOCK_T=bt, BLOCK_W=bw,
            CNT=L["DISP_CNT"], OFFS=True, REF=L["REFUSED"])
        self._check_status_naming_fields("dispatch (receive)", "DISP_SIG")
        if not st.round_counts:  # (a refusal comes in round 0; later rounds must not start on any rank)
            self._check_refused("dispatch (receive)", blocking=True)
        st.round_counts.append(counts)
        st.dst = st.dst + counts

    def dispatch_recv(self, st: _SendState, *, expert_alignment: int, num_worst_tokens: int) -> DispatchResult:
        """Every round of the receive (the sends of rounds >= 1 in between), then the unpacked result."""
        self.dispatch_recv_round(st, 0, num_worst_tokens=num_worst_tokens)
        if st.rounds > 1 and self.symm.provider == "virtual":
            raise ValueError("virtual ranks: a dispatch that needs several rounds must run round by round over every "
                             "rank (moe_ep.backends.symm.virtual_dispatch_recv)")
        for r in range(1, st.rounds):
            self.dispatch_send_round(st, r)
            self.dispatch_recv_round(st, r, num_worst_tokens=num_worst_tokens)
        return self.dispatch_finish(st, expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens)

    def dispatch_finish(self, st: _SendState, *, expert_alignment: int, num_worst_tokens: int) -> DispatchResult:
        """The result of a received dispatch (views of the received words, or of this rank's buffer)."""
        R, dev = self.symm.world_size, self.symm.device
        m, counts = st.m, st.rcounts
        if st.view:
            P = st.view_rows
            words = self.symm.buffer[:(self.symm.nbytes // 2) // 4 * 4].view(torch.int32)
            cols, offs = (0, *st.bounds, st.words), (0, *st.planes)
            segs = [words[o:o + P * (cols[j + 1] - cols[j])].view(P, cols[j + 1] - cols[j])[:m]
                    for j, o in enumerate(offs)]
        else:
            out = st.out
            segs = [out[:, a:b] for a, b in zip((0, *st.bounds), (*st.bounds, st.words))]
        # Unpack the rows (views of the received words; with st.view, views of this rank's buffer).
        h = st.hidden
        recv_x = _unwords(segs[0], torch.uint8 if st.has_scales else st.dtype, h)
        if st.has_scales:
            recv_x = recv_x.view(st.dtype)
        recv_scales = None
        if st.has_scales:
            recv_scales = _unwords(segs[1], st.scale_dtype, st.scale_cols)
        valid = torch.arange(m, device=dev) < counts.sum()
        recv_idx = recv_w = None
        if st.handle is None:
            k, num_local = st.num_topk, st.num_experts // R
            if k > 0:
                gidx = _unwords(segs[2], torch.int64, k)
                w = _unwords(segs[3][:, :k], torch.float32, k)
                lo = self.symm.rank * num_local
                is_local = (gidx >= lo) & (gidx < lo + num_local) & valid[:, None]
                recv_idx = torch.where(is_local, gidx - lo, torch.full_like(gidx, -1))
                recv_w = torch.where(is_local, w, torch.zeros_like(w))
            if num_worst_tokens > 0 or k == 0:
                # NOTES: like DeepEP: no host read with num_worst_tokens, so no list; a layout-only dispatch
                # (no top-k) carries no per-expert information in its rows: SymmBackend.dispatch_recv fills
                # the list from the senders' num_tokens_per_expert
                per_expert = []
            else:
                c = torch.bincount(recv_idx[recv_idx >= 0], minlength=num_local).tolist()
                per_expert = [(v + expert_alignment - 1) // expert_alignment * expert_alignment for v in c]
            handle = SymmNormalHandle(owner=self.owner, num_tokens=st.n, num_recv_tokens=m, hidden=h,
                                      is_token_in_rank=st.is_token_in_rank, num_tokens_per_rank=st.num_tokens_per_rank,
                                      send_pos=st.pos, recv_counts=counts, num_topk=k,
                                      num_recv_tokens_per_expert_list=per_expert,
                                      recv_counts_host=None if num_worst_tokens > 0 else st.host, rank=self.symm.rank,
                                      chunk=st.cap, rounds=st.rounds, ntok_max=st.ntok_max,
                                      round_counts=torch.stack(st.round_counts) if st.rounds > 1 else None)
        else:
            handle = st.handle
            if m != handle.num_recv_tokens:
                raise ValueError(f"cached dispatch received {m} rows but the handle expects {handle.num_recv_tokens} "
                                 "(num_worst_tokens must match the original call)")
            per_expert = handle.num_recv_tokens_per_expert_list
        if num_worst_tokens > 0 and not st.view:  # padding rows: zeros (out was zero-initialised)
            recv_x = recv_x.clone()
        return DispatchResult(recv_x.contiguous(), None if recv_scales is None else recv_scales.contiguous(),
                              recv_idx, recv_w, list(per_expert), handle)
