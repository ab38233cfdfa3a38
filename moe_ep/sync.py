"""Arrival checks on the process group's store: a bounded wait that names the ranks that are missing.

Collectives of torch.distributed time out with messages that do not say which peer is missing (or,
with NCCL, may not time out at all). Before each communication call, the ``torch`` backend marks
its arrival in the rendezvous store and waits, at most ``timeout_s``, for every rank of the group
to arrive at the same call; a rank that died or never called is named in the ``TimeoutError``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Optional

import torch.distributed as dist

__all__ = ["ArrivalCheck", "RankTimeoutError"]

_instances: dict[tuple, int] = {}


class RankTimeoutError(TimeoutError):
    """A collective call timed out; ``missing_ranks`` are group ranks that did not arrive."""

    def __init__(self, message: str, missing_ranks: list[int]):
        super().__init__(message)
        self.missing_ranks = missing_ranks


class ArrivalCheck:
    """Per-Buffer arrival barrier keyed ``moe_ep/<group ranks>/<instance>/<seq>/<rank>``.

    Buffers are created collectively, in the same order on every rank, so the instance counter agrees
    across ranks without communication.
    """

    def __init__(self, group, rank: int, world_size: int, timeout_s: float, store: Optional[dist.Store] = None):
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.store = store if store is not None else dist.distributed_c10d._get_default_store()
        granks = tuple(dist.get_process_group_ranks(group)) if group is not None else ("world",)
        ident = _instances.get(granks, 0)
        _instances[granks] = ident + 1
        self.prefix = f"moe_ep/{'-'.join(map(str, granks)) if len(granks) <= 16 else hash(granks)}/{ident}"
        self.seq = 0

    def _key(self, seq: int, rank: int) -> str:
        return f"{self.prefix}/{seq}/{rank}"

    def arrive(self, what: str) -> None:
        """Mark this rank's arrival at the next call ``what`` and wait for all ranks (bounded)."""
        if self.world_size == 1:
            return
        seq = self.seq
        self.seq += 1
        self.store.set(self._key(seq, self.rank), what)
        keys = [self._key(seq, r) for r in range(self.world_size)]
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout_s))
        except Exception as exc:  # DistStoreError / RuntimeError, depending on the torch version
            missing = [r for r in range(self.world_size) if not self.store.check([keys[r]])]
            if missing:  # (an empty list: everyone arrived just as the wait gave up)
                raise RankTimeoutError(
                    f"moe_ep {what}: rank(s) {missing} of the group did not arrive within {self.timeout_s:.1f} s "
                    f"(this is rank {self.rank}; a peer died, hangs, or skipped this call)", missing) from exc
        # Every rank has now finished call seq-1, so nobody waits on our key of seq-2 any more.
        if seq >= 2:
            self.store.delete_key(self._key(seq - 2, self.rank))
