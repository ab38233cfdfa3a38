"""ADP balance (seed 003, TensorRT-LLM): attention-DP scheduling policies, and the experiment that
reproduces the seed's table (``python -m serving adp``).

Policies: where a new request goes (routers) and whether the contexts the per-rank schedulers picked
run this iteration (the ADP balance gate). An engine calls ``router.route(...)`` when it admits
requests and ``gate.decide(...)`` once per iteration after its per-rank schedulers have picked; every
rank holds the same gathered vectors and runs the same deterministic code, so every rank reaches the
same decision with no extra broadcast.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

__all__ = ["RoundRobinRouter", "HeapRouter", "ADPGate", "make_router"]


class RoundRobinRouter:
    """The seed's baseline: sort the new requests by token count (longest first) and deal them to the
    ranks round-robin, skipping ranks at their active-request cap. The deal position persists across
    calls, so single arrivals rotate over the ranks too."""

    name = "rr"

    def __init__(self) -> None:
        self._next = 0

    def route(self, input_len: np.ndarray, num_active: np.ndarray, active_tokens: np.ndarray, cap: int) -> np.ndarray:
        """Arguments:
            input_len: `[k]` prompt tokens of the new requests.
            num_active: `[R]` active requests per rank (updated in place).
            active_tokens: `[R]` sum of active prompt tokens per rank (updated in place).
            cap: max active requests per rank.

        Returns:
            `[k]` int64 rank per request, -1 where every rank is full.
        """
        r = len(num_active)
        out = np.full(len(input_len), -1, dtype=np.int64)
        for i in np.argsort(-np.asarray(input_len), kind="stable"):
            for step in range(r):
                k = (self._next + step) % r
                if num_active[k] < cap:
                    out[i] = k
                    num_active[k] += 1
                    active_tokens[k] += input_len[i]
                    self._next = (k + 1) % r
                    break
            else:
                break
        return out


class HeapRouter:
    """TensorRT-LLM's default admission: LPT on active prompt tokens. Requests sorted by input length,
    longest first; each goes to the rank with the fewest active prompt tokens (ties: fewer requests,
    lower rank) among ranks under ``expected = max(ceil((active + new) / R), max_r active_r)``, capped
    at ``cap``."""

    name = "heap"

    def route(self, input_len: np.ndarray, num_active: np.ndarray, active_tokens: np.ndarray, cap: int) -> np.ndarray:
        r = len(num_active)
        k = len(input_len)
        out = np.full(k, -1, dtype=np.int64)
        expected = min(cap, max(-(-(int(num_active.sum()) + k) // r), int(num_active.max())))
        heap = [(int(active_tokens[j]), int(num_active[j]), j) for j in range(r) if num_active[j] < expected]
        heapq.heapify(heap)
        for i in np.argsort(-np.asarray(input_len), kind="stable"):
            if not heap:
                break
            tok, n, j = heapq.heappop(heap)
            out[i] = j
            num_active[j] += 1
            active_tokens[j] += input_len[i]
            if n + 1 < expected:
                heapq.heappush(heap, (tok + int(input_len[i]), n + 1, j))
        return out


def make_router(name: str) -> RoundRobinRouter | HeapRouter:
    if name == "rr":
        return RoundRobinRouter()
    if name == "heap":
        return HeapRouter()
    raise ValueError(f"unknown router {name!r}; use 'rr' (seed: sorted round-robin) or 'heap' (TensorRT-LLM)")


@dataclass
class ADPGate:
    """The ADP balance gate: hold the scheduled contexts on *all* ranks until every rank has one
    (at most ``timeout_iters`` iterations), then hold ``batching_wait_iters`` more so contexts
    accumulate, then release them together.

    ``batching="code"`` is TensorRT-LLM's semantics: the batching wait is unconditional once every
    rank has a context and every rank is generating. ``batching="seed"`` is the seed's wording: hold
    only while some rank has fewer scheduled contexts than another. ``enabled=False`` always releases
    (the baseline). Counters persist across calls; the same inputs give the same decision everywhere.
    """

    enabled: bool = True
    timeout_iters: int = 50
    batching_wait_iters: int = 10
    batching: str = "code"
    wait_cnt: int = field(default=0, init=False)
    batch_cnt: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.timeout_iters < 0 or self.batching_wait_iters < 0:
            raise ValueError(f"timeout_iters={self.timeout_iters} and batching_wait_iters="
                             f"{self.batching_wait_iters} must be >= 0")
        if self.batching not in ("code", "seed"):
            raise ValueError(f"batching={self.batching!r} must be 'code' (TensorRT-LLM) or 'seed'")

    def decide(self, num_ctx: Sequence[int], num_gen: Sequence[int], max_batch_size: int) -> bool:
        """Return True to run the scheduled contexts this iteration, False to hold them on every rank.

        Arguments:
            num_ctx: `[R]` contexts each rank's scheduler picked this iteration.
            num_gen: `[R]` generation requests per rank, a dummy request counted as one.
            max_batch_size: per-rank batch limit (a rank at the limit has no slot for a context).
        """
        if not self.enabled:
            return True
        # NOTES: no early return when no rank has a context: as in TensorRT-LLM, the timeout counter
        # also runs through context-free iterations (wrapping at ``timeout_iters``), so a context that
        # arrives late in that cycle waits less than ``timeout_iters``.
        free = all(g < max_batch_size for g in num_gen)
        all_ctx = all(c > 0 for c in num_ctx)
        all_gen = all(g > 0 for g in num_gen)
        if free and all_ctx:
            self.wait_cnt = 0
            if not all_gen:
                return True
            hold = self.batch_cnt < self.batching_wait_iters
            if self.batching == "seed":
                hold = hold and min(num_ctx) < max(num_ctx)
            if hold:
                self.batch_cnt += 1
                return False
            self.batch_cnt = 0
            return True
        self.wait_cnt += 1
        if self.wait_cnt >= self.timeout_iters or not all_gen:
            self.wait_cnt = 0
            return True
        return False
