"""Arrival checks on the process group's store: a bounded wait that names the ranks that are missing,
and a comparison of what every rank called.

Collectives of torch.distributed time out with messages that do not say which peer is missing (or,
with NCCL, may not time out at all), and ranks that disagree on a call's shapes make gloo abort the
process or NCCL write out of bounds. Before each communication call, the ``torch`` backend writes its
call signature (kind, hidden size, dtype, top-k, experts, ...) into the rendezvous store and waits, at
most ``timeout_s``, for every rank of the group to arrive at the same call. Then every rank compares
all signatures, so all of them raise the same error before any payload moves:

- a rank that died or never called: :class:`RankTimeoutError` naming it (``missing_ranks``);
- ranks that called different things: :class:`CallMismatchError` (a ``ValueError``) naming the ranks
  and the fields that differ;
- a rank that refused its own call (bad input, raised locally): :class:`RemoteRankError` on the others,
  with that rank's message.

A rank that gives up waiting marks the missing ranks' slots as abandoned (an atomic compare-and-set),
so a rank that arrives later raises at once instead of entering a collective nobody else will join.

:meth:`ArrivalCheck.exchange` does the same checks without a store round trip: the signature (or a
refusal), the call number, the arrival time and ``timeout_s`` travel in a fixed-size header that every
rank sends to every rank (one small all-to-all, with up to ``world_size`` counts a dispatch needs anyway),
bounded by ``timeout_s``. The only store use per call is a one-way ``set`` of this rank's arrival (no
reply is awaited), read only when the exchange times out, to name the ranks that did not arrive
(docs/protocols.md, "Host arrival checks").
"""

from __future__ import annotations

import ctypes
import struct
import time
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from .errors import MoEEPError

__all__ = ["ArrivalCheck", "CallMismatchError", "RankMaskedWarning", "RankTimeoutError", "RemoteRankError", "host_group"]

_ABANDONED = "!abandoned"  # value a waiting rank puts in a late rank's slot when it gives up
_REFUSED = "!refused"  # prefix of the value a rank writes when its own checks refused the call

_instances: dict[tuple, int] = {}

# Header of the collective arrival check (int64 words): call number, arrival time (wall clock, ns), timeout
# (ms; 0 for a refusal, which waits for nobody), signature length in bytes, then the signature text.
_SIG_BYTES = 480
HEADER_WORDS = 4 + _SIG_BYTES // 8


def late_margin_ns(timeout_ms: int) -> int:
    """How close to a peer's deadline an arrival counts as too late (transfer time and clock skew): a quarter
    of the timeout, at most 0.5 s. Every rank computes it from the same gathered value (the smallest timeout)."""
    return int(min(0.25 * timeout_ms * 1e6, 0.5e9))


def host_group(group):
    """The group the arrival headers travel in: host memory, so a CPU (gloo) group. ``group`` itself when it
    has gloo (CPU runs, ``cpu:gloo,cuda:nccl``), else a gloo group of the same ranks, made here (every
    member constructs the Buffer, so every member calls this)."""
    if not dist.is_initialized() or "gloo" in str(dist.get_backend(group)):
        return group
    granks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    return dist.new_group(granks, backend="gloo", use_local_synchronization=True)


class RankTimeoutError(MoEEPError, TimeoutError):
    """A collective call timed out; ``missing_ranks`` are group ranks that did not arrive."""

    def __init__(self, message: str, missing_ranks: list[int]):
        super().__init__(message)
        self.missing_ranks = missing_ranks


class RankMaskedWarning(RuntimeWarning):
    """``enable_shrink``: a low-latency call masked rank(s) whose wait timed out instead of raising;
    ``masked_ranks`` names them."""

    def __init__(self, message: str, masked_ranks: list[int]):
        super().__init__(message)
        self.masked_ranks = masked_ranks


class CallMismatchError(MoEEPError, ValueError):
    """Ranks of the group made different calls (kind or shapes); raised on every rank before any
    payload moves. The message lists each rank's value; ``fields`` names the fields that differ."""

    def __init__(self, message: str, fields: list[str]):
        super().__init__(message)
        self.fields = fields


class RemoteRankError(MoEEPError, RuntimeError):
    """Another rank refused this call (its own input checks raised); ``failed_ranks`` names it."""

    def __init__(self, message: str, failed_ranks: list[int]):
        super().__init__(message)
        self.failed_ranks = failed_ranks


def _encode(what: str, fields: Optional[dict]) -> str:
    items = ";".join(f"{k}={fields[k]}" for k in sorted(fields)) if fields else ""
    return f"{what}|{items}"


def _decode(value: str) -> tuple[str, dict]:
    what, _, items = value.partition("|")
    return what, dict(item.split("=", 1) for item in items.split(";") if item)


class ArrivalCheck:
    """Per-Buffer arrival barrier keyed ``moe_ep/<group ranks>/<instance>/<seq>/<rank>``.

    Buffers are created collectively, in the same order on every rank, so the instance counter agrees
    across ranks without communication.
    """

    def __init__(self, group, rank: int, world_size: int, timeout_s: float, store: Optional[dist.Store] = None,
                 exchange_group=None):
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.store = store if store is not None else dist.distributed_c10d._get_default_store()
        granks = tuple(dist.get_process_group_ranks(group)) if group is not None else ("world",)
        ident = _instances.get(granks, 0)
        _instances[granks] = ident + 1
        self.prefix = f"moe_ep/{'-'.join(map(str, granks)) if len(granks) <= 16 else hash(granks)}/{ident}"
        self.seq = 0
        self.exchange_group = exchange_group if exchange_group is not None else group  # a CPU (gloo) group
        self._inflight: list = []  # (work, tensor) of refusals posted without waiting, kept alive until done
        self._sig_cache: tuple = (None, 0, b"")  # (signature text, its length in bytes, padded to _SIG_BYTES)

    def _key(self, seq: int, rank: int) -> str:
        return f"{self.prefix}/{seq}/{rank}"

    def arrive(self, what: str, fields: Optional[dict] = None, wait_ns: Optional[list] = None, *,
               live: Optional[list] = None, shrink: bool = False) -> list:
        """Mark this rank's arrival at the next call ``what`` with its signature ``fields`` (values that
        must agree across ranks), wait for all ranks (bounded) and compare the signatures. With ``wait_ns``
        (a list of ``world_size`` ints), adds for each rank the nanoseconds this rank waited from its own
        arrival until that rank's (0 for ranks that were already there).

        ``live``: wait only for these ranks (masked ranks are not waited for). ``shrink``: ranks of ``live`` that
        do not arrive within the timeout (or that another rank already gave up on) are returned instead of
        raising :class:`RankTimeoutError`; every rank that arrives sees the same list (the first rank to give
        up marks the slot abandoned, the others find the mark). Returns ``[]`` without ``shrink``."""
        if self.world_size == 1:
            return []
        seq = self.seq
        self.seq += 1
        mine = _encode(what, fields)
        # compare_set on a missing key sets it and returns the value; a peer that gave up on this call
        # has already put _ABANDONED there.
        got = self.store.compare_set(self._key(seq, self.rank), "", mine).decode()
        if got != mine:
            raise RankTimeoutError(
                f"moe_ep {what}: this rank ({self.rank}) arrived after its peers had given up waiting for it "
                f"(timeout_s={self.timeout_s:.1f}); the Buffer's call sequence is broken: destroy it", [self.rank])
        ranks = list(range(self.world_size)) if live is None else sorted(live)
        if ranks == [self.rank]:
            return []
        keys = [self._key(seq, r) for r in ranks]
        try:
            if wait_ns is not None:
                self._timed_wait(keys, wait_ns, ranks)
            self.store.wait(keys, timedelta(seconds=self.timeout_s))
        except Exception as exc:  # DistStoreError / RuntimeError, depending on the torch version
            missing = [r for r, key in zip(ranks, keys)
                       if self.store.compare_set(key, "", _ABANDONED).decode() == _ABANDONED]
            if missing and not shrink:  # (an empty list: everyone arrived just as the wait gave up)
                raise RankTimeoutError(
                    f"moe_ep {what}: rank(s) {missing} of the group did not arrive within {self.timeout_s:.1f} s "
                    f"(this is rank {self.rank}; a peer died, hangs, or skipped this call)", missing) from exc
        values = [v.decode() for v in self.store.multi_get(keys)]
        gone = [r for r, v in zip(ranks, values) if v == _ABANDONED] if shrink else []
        kept = [(r, v) for r, v in zip(ranks, values) if r not in gone]
        self._compare(what, [v for _, v in kept], [r for r, _ in kept])
        # Every rank has now finished call seq-1, so nobody waits on our key of seq-2 any more.
        if seq >= 2:
            self.store.delete_key(self._key(seq - 2, self.rank))
        return gone

    # ------------------------------------------------------------------ collective path
    def _post(self, text: str, counts, deadline: bool = True):
        """Take the next call number, start the all-to-all of this rank's header (host memory, over the CPU group
        ``exchange_group``) and mark the arrival in the store (one-way ``set``, while the headers travel).
        Returns ``(seq, arrival ns, (gathered [R * (HEADER_WORDS + R)] int64, header), work)``."""
        self._inflight = [(w, t) for w, t in self._inflight if not w.is_completed()]
        seq = self.seq
        self.seq += 1
        now = time.time_ns()
        if self._sig_cache[0] != text:  # a step repeats the same calls: encode each signature once
            raw = text.encode()[:_SIG_BYTES]
            self._sig_cache = (text, len(raw), raw.ljust(_SIG_BYTES, b"\0"))
        _, nraw, padded = self._sig_cache
        R = self.world_size
        words = [0] * R if counts is None else counts.reshape(-1).tolist()
        head = bytearray(struct.pack("<4q", seq, now, max(1, int(self.timeout_s * 1000)) if deadline else 0,
                                     nraw) + padded + struct.pack(f"<{R}q", *words))
        head = torch.frombuffer(head * R, dtype=torch.int64)  # one copy per rank: an all-to-all (on gloo a
        out = torch.empty(R * (HEADER_WORDS + R), dtype=torch.int64)  # small one is cheaper than an all-gather)
        work = dist.all_to_all_single(out, head, group=self.exchange_group, async_op=True)
        # the arrival mark, read only after a timed-out exchange (_missing); set while the headers travel
        self.store.set(f"{self.prefix}/at/{self.rank}", f"{seq}:{now}")
        return seq, now, (out, head), work

    def exchange(self, what: str, fields: Optional[dict], counts=None, wait_ns: Optional[list] = None) -> list:
        """The arrival check folded into one small all-to-all: this rank's signature ``fields`` for call ``what`` and
        its ``counts`` (``world_size`` ints, e.g. tokens per destination rank; zeros if ``None``) go to every
        rank, bounded by ``timeout_s``. Raises as :meth:`arrive` does (every rank decides from the same gathered
        headers, so all raise the same error). Returns every rank's counts: ``R`` lists of ``R`` ints (row s:
        rank s's). ``wait_ns``: adds for each rank how much later than this rank it arrived (0 if earlier)."""
        R = self.world_size
        if R == 1:
            return [[0] if counts is None else [int(c) for c in counts.reshape(-1).tolist()]]
        seq, now, bufs, work = self._post(_encode(what, fields), counts)
        out = bufs[0]
        try:
            work.wait(timeout=timedelta(seconds=self.timeout_s))
        except Exception as exc:  # "Operation timed out!" (the collective itself stays posted)
            self._inflight.append((work, bufs))
            missing = self._missing(seq, now)
            raise RankTimeoutError(
                f"moe_ep {what}: rank(s) {missing} of the group did not arrive within {self.timeout_s:.1f} s "
                f"(this is rank {self.rank}; a peer died, hangs, or skipped this call)", missing) from exc
        # a host buffer (never device memory): read it as bytes
        raw = ctypes.string_at(out.data_ptr(), out.numel() * 8)
        return self._check_table(what, raw, now, wait_ns)

    def refuse_exchange(self, what: str, message: str) -> None:
        """:meth:`refuse` for the collective path: post a refusal header (no deadline) and return without
        waiting; the peers' exchange of this call completes with it and raises :class:`RemoteRankError`."""
        if self.world_size == 1:
            return
        _, _, bufs, work = self._post(f"{_REFUSED}|{what}|{message[:400]}", None, deadline=False)
        self._inflight.append((work, bufs))  # the tensors stay alive until the peers have read them

    def _missing(self, seq: int, now: int) -> list:
        """After a timed-out exchange of call ``seq``: the ranks whose last arrival mark is older, absent, or
        came after this rank's deadline (less the margin)."""
        late = now + int(self.timeout_s * 1e9) - late_margin_ns(int(self.timeout_s * 1000))
        missing = []
        for r in range(self.world_size):
            if r == self.rank:
                continue
            key = f"{self.prefix}/at/{r}"
            try:
                got_seq, got_at = map(int, self.store.get(key).decode().split(":")) if self.store.check([key]) \
                    else (-1, 0)
            except Exception:  # noqa: BLE001 - an unreadable mark counts as absent
                got_seq, got_at = -1, 0
            if got_seq < seq or (got_seq == seq and got_at >= late):
                missing.append(r)
        return missing or [r for r in range(self.world_size) if r != self.rank]

    def _check_table(self, what: str, raw: bytes, now: int, wait_ns: Optional[list]) -> list:
        R = self.world_size
        width = 8 * (HEADER_WORDS + R)
        rows = [raw[r * width:(r + 1) * width] for r in range(R)]
        seqs, arrived, tmo, lens = zip(*(struct.unpack_from("<4q", row) for row in rows))
        sigs = [row[32:32 + lens[r]] for r, row in enumerate(rows)]
        if wait_ns is not None:
            for r, at in enumerate(arrived):
                wait_ns[r] += max(0, at - now)
        # Deadlines: a rank arriving (within the margin) after a waiting peer's deadline found, or will
        # find, that peer gone; every rank sees the same table, so every rank raises.
        waiting = [r for r in range(len(seqs)) if tmo[r] > 0]
        if waiting:
            first = min(arrived[r] + tmo[r] * 10**6 for r in waiting)
            cut = first - late_margin_ns(min(tmo[r] for r in waiting))
            late = [r for r, at in enumerate(arrived) if at >= cut]
            if late:
                if self.rank in late:
                    msg = (f"moe_ep {what}: this rank ({self.rank}) arrived after its peers had given up waiting for "
                           f"it (timeout_s={self.timeout_s:.1f}); the Buffer's call sequence is broken: destroy it")
                else:
                    msg = (f"moe_ep {what}: rank(s) {late} of the group did not arrive within the timeout of the "
                           f"first rank (this is rank {self.rank}); the Buffer's call sequence is broken: destroy it")
                raise RankTimeoutError(msg, late)
        if len(set(seqs)) > 1:
            listing = ", ".join(f"rank {r}={s}" for r, s in enumerate(seqs))
            raise CallMismatchError(f"moe_ep {what}: ranks are at different calls of this Buffer (call number: "
                                    f"{listing}); a rank skipped or repeated a call (this is rank {self.rank}, "
                                    "nothing was sent)", ["call number"])
        if sigs.count(sigs[0]) != R or sigs[0].startswith(_REFUSED.encode()):  # all equal: nothing to compare
            self._compare(what, [v.decode(errors="replace") for v in sigs])
        return [list(struct.unpack_from(f"<{R}q", row, 8 * HEADER_WORDS)) for row in rows]

    def _timed_wait(self, keys: list, wait_ns: list, ranks: Optional[list] = None) -> None:
        """Poll the keys until all are present (or the timeout passes), adding to ``wait_ns[r]`` the time
        from the start until rank r's key was first seen (``ranks[i]``: the rank of ``keys[i]``)."""
        ranks = list(range(len(keys))) if ranks is None else ranks
        start = time.monotonic_ns()
        pending = set(range(len(keys)))
        pause = 1e-5
        while pending and (time.monotonic_ns() - start) < self.timeout_s * 1e9:
            for i in sorted(pending):
                if self.store.check([keys[i]]):
                    pending.discard(i)
                    wait_ns[ranks[i]] += time.monotonic_ns() - start
            if pending:
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)

    def refuse(self, what: str, message: str) -> None:
        """This rank's own checks refused call ``what``: take its place in the call sequence and tell the
        peers (who then raise :class:`RemoteRankError` at once instead of waiting out the timeout)."""
        if self.world_size == 1:
            return
        seq = self.seq
        self.seq += 1
        self.store.compare_set(self._key(seq, self.rank), "", f"{_REFUSED}|{what}|{message[:400]}")

    def _compare(self, what: str, values: list[str], ranks: Optional[list] = None) -> None:
        if ranks is not None and ranks != list(range(len(values))):  # a subset (masked ranks left out)
            try:
                self._compare(what, values)
            except (RankTimeoutError, RemoteRankError, CallMismatchError) as exc:
                # positions -> ranks in the message and the rank lists
                import re
                msg = re.sub(r"rank (\d+)", lambda m: f"rank {ranks[int(m.group(1))]}"
                             if int(m.group(1)) < len(ranks) else m.group(0), str(exc).split(" (this is rank")[0])
                msg += f" (this is rank {self.rank}; live ranks {ranks})"
                if isinstance(exc, RankTimeoutError):
                    raise RankTimeoutError(msg, [ranks[r] for r in exc.missing_ranks]) from None
                if isinstance(exc, RemoteRankError):
                    raise RemoteRankError(msg, [ranks[r] for r in exc.failed_ranks]) from None
                raise CallMismatchError(msg, exc.fields) from None
            return
        abandoned = [r for r, v in enumerate(values) if v == _ABANDONED]
        if abandoned:  # another peer gave up on them: they count as missing here too
            raise RankTimeoutError(f"moe_ep {what}: rank(s) {abandoned} of the group did not arrive within "
                                   f"{self.timeout_s:.1f} s (this is rank {self.rank})", abandoned)
        refused = [(r, v.split("|", 2)) for r, v in enumerate(values) if v.startswith(_REFUSED)]
        if refused:
            lines = "; ".join(f"rank {r} refused {parts[1]}: {parts[2]}" for r, parts in refused)
            raise RemoteRankError(f"moe_ep {what}: {lines} (this is rank {self.rank}; nothing was sent)",
                                  [r for r, _ in refused])
        calls = [_decode(v) for v in values]
        kinds = [c[0] for c in calls]
        if len(set(kinds)) > 1:
            listing = ", ".join(f"rank {r}: {k}" for r, k in enumerate(kinds))
            raise CallMismatchError(f"moe_ep {what}: ranks called different operations ({listing}); this is rank "
                                    f"{self.rank}, nothing was sent", ["call"])
        names = sorted(set().union(*(c[1] for c in calls)))
        diffs = []
        for name in names:
            got = [c[1].get(name, "-") for c in calls]
            if len(set(got)) > 1:
                diffs.append((name, got))
        if diffs:
            detail = "; ".join(f"{name}: " + ", ".join(f"rank {r}={v}" for r, v in enumerate(got)) for name, got in diffs)
            raise CallMismatchError(f"moe_ep {what}: ranks disagree on {detail} (this is rank {self.rank}; nothing "
                                    "was sent)", [name for name, _ in diffs])
