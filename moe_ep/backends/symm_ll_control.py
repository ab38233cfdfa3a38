"""Per-rank control of the ``symm`` backend's low-latency path: the host side of its cross-rank words.

:class:`_LowLatencyControl` is the base of :class:`~moe_ep.backends.symm_ll.SymmLowLatency` (which sets the
attributes it uses: ``symm``, ``sig``, ``transport``, ``mask``, ``_api``, ``_shrink``, the slot toggles, ``_open``,
``_msg_areas``, ``_timed_seen``). It holds what the four phases share but that is no phase itself:

- sizes: signal words and data bytes per rank, the capacity check of a call's shapes, where each slot and each
  nvshmem staging area starts in the data region;
- call signatures: the send kernels' signature arguments, and the status check that names the fields two ranks
  disagree on, or (error path, docs/protocols.md) the peer that called the other operation;
- launches: interpreter or compiled, the nvshmem launch options and copy chunk, the BUSY release of the nvshmem
  transport;
- the rank mask of ``enable_shrink``: update, report, and the rejoin clean-up.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import events
from ..kernels.low_latency import LL_MAXNREG, SIG_WORDS, _ll_quiet_kernel, signal_layout
from ..kernels.pdl import INTERPRET
from ..kernels.signals import MASK_API, MASK_TIMEOUT
from ..sync import CallMismatchError, RankTimeoutError
from .symm_ll_layout import _ALIGN, NUM_SLOTS, _Layout, check_capacity, ll_buffer_bytes


class _LowLatencyControl:
    """Sizes, call signatures, launch options and the rank mask of one rank's low-latency path (see the module)."""

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

    @staticmethod
    def _call_signature(values: tuple) -> dict:
        """The send kernels' arguments of this call's signature: the kernel's publishing program writes it into this
        rank's own entry of the slot before it copies it to the peers (no host write per call; the receive kernel
        compares)."""
        return {f"call_sig{w}": int(v) for w, v in enumerate(values)}

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
        lay = check_capacity(self.symm.nbytes, T, hidden, R, E, K, self.transport, what)
        need_sig = self.num_signals(R)
        if self.symm.num_signals < need_sig:
            raise ValueError(f"{what}: the symmetric buffer has {self.symm.num_signals} signal words, needs {need_sig}")
        return lay

    def _interpreted(self, device: torch.device) -> bool:
        return INTERPRET or device.type != "cuda"

    def _gpu_launch(self, device: torch.device) -> dict:
        """Launch options of every low-latency kernel on a GPU: the register cap lifted (:data:`LL_MAXNREG`) and, on
        the ``nvshmem`` transport, NVSHMEM's device bitcode to link (:func:`moe_ep.nvshmem.launch_options`); none in
        the interpreter."""
        if self._interpreted(device):
            return {}
        if not self.transport:
            return {"maxnreg": LL_MAXNREG}
        from .. import nvshmem

        return {**nvshmem.launch_options(torch.cuda.get_device_capability(device)), "maxnreg": LL_MAXNREG}

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

    def take_late_writes(self) -> bool:
        """Whether a combine receive since the last call found a row of a rank this rank has masked (a masked rank
        still running) in a live slot (the token it hit is NaN; docs/protocols.md, "A masked rank's late row"), and
        clear the flag. Not an error: the Buffer stays usable. A host read (one device synchronisation on GPUs)."""
        from ..kernels.signals import SEQ_LATE_MASKED
        bit = int(SEQ_LATE_MASKED.value if hasattr(SEQ_LATE_MASKED, "value") else SEQ_LATE_MASKED)
        seen = (int(self.symm.status[3]) & bit) != 0
        if seen:
            self.symm.status[3:4].bitwise_and_(~bit)
        return seen

    def reported_mask(self) -> Optional[list]:
        """The API's view for a self-masked rank (``None`` otherwise: the device words are the view)."""
        return list(self._api) if self._api[self.symm.rank] else None

    def clean_mask(self) -> None:
        """Unmask every rank and zero this rank's signal words of the ranks that were masked (a masked rank's
        busy / full words may be left set by the steps it missed). Call it on every rank between steps, once
        every rank has finished the previous step and before a returning rank's first call (e.g. after a host
        barrier that includes it). Every rank resumes on slot 0 of both double buffers (a CUDA graph captured
        before must be re-captured: its slots are baked in). Device ops only, except on the ``nvshmem`` transport:
        there every rank first completes its own puts (``nvshmem_quiet``, :func:`_ll_quiet_kernel`) and waits for
        the others to have done so (the buffer's bounded host barrier, naming a rank that does not come), so no put
        of a returning rank's last (masked) call lands on a word after it was zeroed."""
        R, sig = self.symm.world_size, self.sig
        if self.transport:
            _ll_quiet_kernel[(1,)](**self._gpu_launch(self.symm.device))  # (CPU: the emulation's quiet)
            if self.symm.device.type == "cuda":
                torch.cuda.current_stream(self.symm.device).synchronize()
            self.symm.barrier("low_latency_clean_mask_buffer (every rank's puts complete)")
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
