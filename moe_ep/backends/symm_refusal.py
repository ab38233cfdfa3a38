"""Refusals and cross-kind diagnosis of the ``symm`` backend's normal mode (a mixin of
:class:`~moe_ep.backends.symm_normal.SymmNormal`; the rules are in docs/protocols.md, "Normal mode").

Refusal: a rank whose own checks raise (bad input, a receive view that does not fit, ...) before its call wrote
anything to a peer takes part in the call all the same, with nothing in it: it publishes a signature whose flags
say ``SIG_REFUSED`` with an empty block (``FULL = 1``) to every peer, drains the blocks its peers sent it (so
their ``BUSY`` words are released), then raises its own error. The peers' receives note the refusal in their
local ``REFUSED`` words, skip the (empty) block and complete; the host raises :class:`moe_ep.RemoteRankError`
naming the rank. Every rank has then consumed the call and the Buffer stays usable.

Cross-kind diagnosis (error path only): a wait on peer ``p`` that timed out during a dispatch while ``p``'s
combine FULL word (or the other way round) is set on this rank means ``p`` called the other operation:
:class:`moe_ep.CallMismatchError` naming ``p`` and both operations instead of :class:`moe_ep.RankTimeoutError`.
"""

from __future__ import annotations

import torch

from .. import events
from ..kernels.intranode import SIG_REFUSED, _gather_recv_kernel, _scatter_send_kernel
from ..sync import CallMismatchError, RankTimeoutError, RemoteRankError

__all__ = ["RefusalMixin"]

_KIND = {"dispatch": ("DISP", 1), "combine": ("COMB", 2)}  # signal prefix, kind bit of the signature flags
_OTHER = {"DISP": ("COMB", "combine"), "COMB": ("DISP", "dispatch")}


class RefusalMixin:
    """Needs ``self.symm`` (:class:`~moe_ep.symm.SymmBuffer`), ``self.sig`` (the signal layout),
    ``self.dispatch_release()``, ``self._held`` and ``self.sends`` (send launches so far: the Buffer's refusal mark)."""

    _ref_pending: list

    # ------------------------------------------------------------------ the refusing rank
    def refuse_send(self, kind: str) -> None:
        """Publish an empty refused block of call ``kind`` (``"dispatch"`` / ``"combine"``) to every peer."""
        R, L, dev = self.symm.world_size, self.sig, self.symm.device
        pre, bit = _KIND[kind]
        # A view still held here would keep the peers' sends waiting; and the peers' combine receives free their
        # views: a refused combine ends in their state (view released, ``_held`` clear), so the retried combine
        # agrees on every rank (time-shared area, flag bit 7).
        self.dispatch_release()
        if kind == "combine":
            self._held = False
        self._write_signature(f"{pre}_SIG", (0, 0, 0, bit | SIG_REFUSED))
        zeros = torch.zeros(R, dtype=torch.int32, device=dev)
        self.sends += 1
        _scatter_send_kernel[(R, 1)](
            torch.zeros(1, 16, dtype=torch.int32, device=dev), torch.full((1, R), -1, dtype=torch.int32, device=dev),
            zeros, zeros, self.symm.buffer_ptrs, self.symm.signal_ptrs, self.symm.status, self.symm.rank, 0, R, 16,
            0, 1, self.symm.timeout_ns, 0, 16, 16, 16, 16, 16, 16,
            FULL=L[f"{pre}_FULL"], BUSY=L[f"{pre}_BUSY"], SEND_CNT=L[f"{pre}_SEND_CNT"], BLOCK_T=16, BLOCK_W=16,
            CNT=L["DISP_CNT"] if kind == "dispatch" else -1, META=L["DISP_META"] if kind == "dispatch" else -1,
            REF=L["REFUSED"])

    def refuse_recv(self, kind: str) -> None:
        """Drain the blocks the peers sent for call ``kind`` (read nothing, free them all)."""
        R, L, dev = self.symm.world_size, self.sig, self.symm.device
        pre, _ = _KIND[kind]
        none = torch.zeros(R, dtype=torch.int32, device=dev)
        _gather_recv_kernel[(R, 1)](
            torch.zeros(1, 16, dtype=torch.int32, device=dev), none, none, self.symm.buffer_ptrs,
            self.symm.signal_ptrs, self.symm.status, self.symm.rank, R, 16, 1, 0, 0, self.symm.timeout_ns,
            FULL=L[f"{pre}_FULL"], BUSY=L[f"{pre}_BUSY"], RECV_CNT=L[f"{pre}_RECV_CNT"], BLOCK_T=16, BLOCK_W=16,
            CNT=L["DISP_CNT"] if kind == "dispatch" else -1, DRAIN=True)

    def refuse(self, kind: str) -> None:
        """This rank's checks refused call ``kind`` before any peer write: take part with nothing (both phases).
        A timed-out wait here leaves the status word set (the next call raises); the caller raises its own error."""
        if self.symm.broken is not None or events.is_capturing(self.symm.device):
            return  # (in a capture nothing runs: the kernels would only be recorded into a graph that is dropped)
        self.refuse_send(kind)
        self.refuse_recv(kind)

    # ------------------------------------------------------------------ the peers
    def _refused_words(self) -> torch.Tensor:
        at = self.sig["REFUSED"]
        return self.symm.signals[at:at + self.symm.world_size]

    def _raise_refused(self, what: str, flags: list) -> None:
        ranks = [r for r, f in enumerate(flags) if f]
        if not ranks:
            return
        self._refused_words().zero_()
        raise RemoteRankError(f"moe_ep {what}: rank(s) {ranks} refused this call (their own input checks raised; "
                              f"their error says why) (this is rank {self.symm.rank}; nothing of theirs was read, "
                              "the Buffer stays usable)", ranks)

    def _check_refused(self, what: str, blocking: bool = False) -> None:
        """Raise :class:`RemoteRankError` if a receive of this call saw a refusal. CPU: a direct read. GPU:
        ``blocking`` synchronises (a call with later rounds, which must not start, or one whose host read already
        saw the refusal); otherwise a copy is queued and :meth:`poll_refused` (``Buffer.check_status()``) raises
        once it has landed. A later call never raises for it: that would take the ranks out of step."""
        words = self._refused_words()
        if not events.uses_streams(self.symm.device):
            self._raise_refused(what, words.tolist())
            return
        if events.is_capturing(self.symm.device):
            return
        if blocking:
            events.synchronize(self.symm.device)
            self._raise_refused(what, words.tolist())
            return
        self._drain(raise_now=False)
        if len(self._ref_pending) < 64:
            host = events.empty_pinned(self.symm.world_size, torch.int32)
            host.copy_(words, non_blocking=True)
            events.launch(reads=(words,), writes=(host,), what="refusal words (copy)")
            ev = events.new_event()
            events.record(ev)
            self._ref_pending.append((ev, host, what))

    def _drain(self, raise_now: bool) -> None:
        """Drop the landed copies that saw no refusal; with ``raise_now``, raise for the first that saw one."""
        still = []
        for ev, host, what in self._ref_pending:
            if not events.query(ev):
                still.append((ev, host, what))
            elif any(host.tolist()):
                if raise_now:
                    self._ref_pending = []
                    self._raise_refused(what, host.tolist())
                still.append((ev, host, what))
        self._ref_pending = still

    def poll_refused(self) -> None:
        """Raise for a refusal seen by an earlier call whose queued copy has landed (GPU; CPU raises at the call)."""
        self._drain(raise_now=True)

    def _diagnose_kind(self, exc: RankTimeoutError, what: str) -> None:
        """Error path of a timed-out normal-mode wait on peer ``p``: if ``p`` published the other operation's
        FULL word here, ``p`` called that operation: raise :class:`CallMismatchError` naming both."""
        pre = "DISP" if what.startswith("dispatch") else "COMB"
        other, other_name = _OTHER[pre]
        for p in exc.missing_ranks:
            if 0 <= p < self.symm.world_size and int(self.symm.signals[self.sig[f"{other}_FULL"] + p]) != 0:
                mine = "dispatch" if pre == "DISP" else "combine"
                err = CallMismatchError(
                    f"moe_ep {what}: ranks called different operations (rank {p}: {other_name}, rank "
                    f"{self.symm.rank}: {mine}); this rank waited on rank {p}'s {mine} and found its {other_name} "
                    "instead (the Buffer is unusable: destroy it)", ["call"])
                err.peer, err.other_operation = p, other_name
                raise err from exc
