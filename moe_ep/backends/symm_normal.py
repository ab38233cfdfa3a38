"""Normal-mode (prefill) path of the ``symm`` backend: device-initiated intranode dispatch / combine.

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

import torch
import triton

from .. import events
from ..kernels.intranode import (
    _combine_recv_fmt_kernel,
    _gather_recv_kernel,
    _recv_counts_kernel,
    _release_held_kernel,
    _scatter_send_kernel,
    _view_recv_kernel,
    signal_layout,
    view_planes,
)
from ..kernels.layout import dispatch_layout
from ..kernels.logfmt import FMT_BF16, FMT_FP8, FMT_FP16, FMT_LOGFMT, check_hidden, encode_rows
from ..kernels.pdl import INTERPRET
from ..symm import SymmBuffer
from ..sync import CallMismatchError, RankTimeoutError
from .base import DispatchHandle, DispatchResult
from .symm_refusal import RefusalMixin

__all__ = ["SymmNormal", "SymmNormalHandle"]


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


class SymmNormal(RefusalMixin):
    """Normal-mode dispatch / combine of one rank over its :class:`~moe_ep.symm.SymmBuffer` (phases as
    methods; see :class:`moe_ep.backends.symm.SymmBackend`; refusals: :mod:`moe_ep.backends.symm_refusal`)."""

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
            c = SymmNormal.default_chunk(world_size) if chunk_tokens is None else int(chunk_tokens)
            if c < 1:
                raise ValueError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")
            c = c if num_max_tokens is None else min(num_max_tokens, c)
            # copying calls time-share the whole buffer: one [R][C] block area serves dispatch, then combine
            return (world_size * max(c, 1) * 4 * w + 255) // 256 * 256
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

    def _blocks(self, words: int) -> tuple[int, int]:
        if self._interp:
            return 64, triton.next_power_of_2(max(words, 16))
        return 16, 256

    # ------------------------------------------------------------------ layout
    def layout(self, topk_idx: torch.Tensor, num_experts: int, bad_flag: torch.Tensor = None):
        return dispatch_layout(topk_idx, num_experts, self.symm.world_size, bad_flag)

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
            need = SymmNormal.size_hint(n, hidden, k, R)
            raise ValueError(f"backend 'symm': recv_as_view=True needs the whole receive in the buffer, and {n} tokens "
                             f"do not fit this rank's normal-mode buffer (at most {cap} for hidden={hidden}, top-{k}): "
                             f"pass num_nvl_bytes >= {need} (SymmBackend.get_normal_size_hint), or recv_as_view=False, "
                             "which streams any batch through the buffer in rounds")
        if cap < 1:
            need = SymmNormal.min_bytes(hidden, k, R, words)
            raise ValueError(f"backend 'symm': num_nvl_bytes={self.symm.nbytes} is below the minimum for one round of "
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
