"""Iteration-level simulator of N attention-DP ranks with in-flight batching.

Per iteration: admit queued requests to ranks (a router), let each rank's scheduler pick its
generation requests and then whole (or chunked) contexts FCFS under ``max_num_tokens``, the batch
limit and its KV capacity, ask the gate whether the contexts run now, and advance the clock by the
cost model's iteration time. The loop knows neither the policy nor the cost model.

Request life: the context iteration ``s`` produces the first output token; the request then decodes
at iterations ``s+1 .. s+output_len-1`` with KV length ``input_len + (j - s)`` at iteration ``j``.
Per rank the loop keeps counts and sums only (``n_gen``, ``sum(input_len - s)``), and finishing
iterations sit in buckets, so an iteration costs O(ranks + events), not O(requests).

KV capacity follows TensorRT-LLM's default capacity policy (guaranteed no eviction): a context
starts only if ``input_len + output_len`` fits beside what the rank's started requests reserved.
A rank with no active request runs one dummy generation token while any request is in the system
(TensorRT-LLM pads empty ADP ranks so the collectives line up); the dummy counts in the gate.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from .trace import Trace

from . import ServingError

__all__ = ["SimConfig", "SimResult", "SimError", "simulate"]


class SimError(ServingError, ValueError):
    """The configuration cannot run the trace (a request that never fits, a deadlock)."""


class _Cost(Protocol):
    def iteration_time(self, num_tokens: np.ndarray, ctx_kv_sum: np.ndarray, gen_kv_sum: np.ndarray) -> float: ...


class _Router(Protocol):
    def route(self, input_len: np.ndarray, num_active: np.ndarray, active_tokens: np.ndarray, cap: int) -> np.ndarray: ...


class _Gate(Protocol):
    def decide(self, num_ctx: list[int], num_gen: list[int], max_batch_size: int) -> bool: ...


@dataclass(frozen=True)
class SimConfig:
    """Arguments:
        num_ranks: attention-DP ranks.
        max_batch_size: requests per rank per iteration; also the per-rank active-request cap.
        max_num_tokens: tokens per rank per iteration (generation tokens count first).
        concurrency: closed loop (a new request enters when one finishes); None = use the trace's
            ``arrival_iter`` or ``arrival_s``, or everything at t=0 if it has neither.
        kv_capacity_tokens: KV tokens per rank, None = unlimited.
        chunked_prefill: a context may run in chunks that fill the token budget.
    """

    num_ranks: int = 8
    max_batch_size: int = 512
    max_num_tokens: int = 4608
    concurrency: int | None = 5120
    kv_capacity_tokens: int | None = None
    chunked_prefill: bool = False

    def __post_init__(self) -> None:
        for name in ("num_ranks", "max_batch_size", "max_num_tokens"):
            if getattr(self, name) < 1:
                raise SimError(f"{name}={getattr(self, name)} must be >= 1")
        if self.concurrency is not None and self.concurrency < 1:
            raise SimError(f"concurrency={self.concurrency} must be >= 1")
        if self.kv_capacity_tokens is not None and self.kv_capacity_tokens < 1:
            raise SimError(f"kv_capacity_tokens={self.kv_capacity_tokens} must be >= 1")


@dataclass
class SimResult:
    """Per-iteration series and per-request times of one run.

    Arguments:
        tokens: `[iters, R]` int32 tokens per rank per iteration (dummies included).
        dt: `[iters]` float64 iteration seconds.
        num_ctx: `[iters]` int32 contexts (or chunks) that ran.
        t_arrive, t_first, t_finish: `[n]` float64 seconds per request.
        output_tokens: generated tokens in all; dummy_tokens: dummy generation tokens.
    """

    tokens: np.ndarray
    dt: np.ndarray
    num_ctx: np.ndarray
    t_arrive: np.ndarray
    t_first: np.ndarray
    t_finish: np.ndarray
    output_tokens: int
    dummy_tokens: int
    wall_s: float

    @property
    def elapsed_s(self) -> float:
        return float(self.t_finish.max())

    @property
    def balance(self) -> np.ndarray:
        """`[iters]` avg/max tokens over ranks (1.0 for an empty iteration)."""
        t = self.tokens.astype(np.float64)
        mx = t.max(axis=1)
        return np.where(mx > 0, t.mean(axis=1) / np.maximum(mx, 1), 1.0)

    def metrics(self, window: tuple[int, int] | None = None) -> dict[str, float]:
        """TPS (output tokens/s), mean balance (unweighted and time-weighted), SOL TPS (seed: every
        iteration at its average rank's load, ``sol_time = sum dt_i * balance_i``), TTFT percentiles."""
        b, dt = self.balance, self.dt
        tps = self.output_tokens / self.elapsed_s
        sol_time = float((dt * b).sum())
        ttft = self.t_first - self.t_arrive
        m = {"tps": tps, "mean_balance": float(b.mean()), "tw_balance": float((dt * b).sum() / dt.sum()),
             "sol_tps": self.elapsed_s / sol_time * tps, "iterations": float(len(dt)), "elapsed_s": self.elapsed_s,
             "ttft_p50": float(np.percentile(ttft, 50)), "ttft_p90": float(np.percentile(ttft, 90)),
             "ttft_p99": float(np.percentile(ttft, 99)), "ttft_mean": float(ttft.mean())}
        if window is not None:
            lo, hi = window
            m["window_balance"] = float(b[lo:hi].mean()) if hi > lo and lo < len(b) else float("nan")
        return m


def simulate(trace: Trace, cost: _Cost, router: _Router, gate: _Gate, cfg: SimConfig = SimConfig(),
             progress: Callable[[int, int, int], None] | None = None) -> SimResult:
    """Run ``trace`` to completion and return the series; raises ``SimError`` on a configuration that
    cannot run it. ``progress(iteration, finished, total)`` is called every 1,000 iterations."""
    wall0 = time.perf_counter()
    n, R = len(trace), cfg.num_ranks
    inp = trace.input_len.astype(np.int64)
    out = trace.output_len.astype(np.int64)
    inp_l, out_l = inp.tolist(), out.tolist()
    pin = trace.rank.tolist() if trace.rank is not None else None
    cap, mbs, mnt, kvcap = cfg.max_batch_size, cfg.max_batch_size, cfg.max_num_tokens, cfg.kv_capacity_tokens
    # Requests that could never run under this configuration are refused up front.
    if not cfg.chunked_prefill and int(inp.max()) > mnt - (mbs - 1):
        i = int(inp.argmax())
        raise SimError(f"request {i}: input_len={inp_l[i]} cannot run whole beside {mbs - 1} generation requests "
                       f"under max_num_tokens={mnt}; use chunked prefill or input_len <= {mnt - (mbs - 1)}")
    if kvcap is not None and int((inp + out).max()) > kvcap:
        i = int((inp + out).argmax())
        raise SimError(f"request {i}: input_len + output_len = {inp_l[i] + out_l[i]} exceeds the KV capacity "
                       f"of one rank ({kvcap} tokens)")
    if pin is not None and any(p >= R or p < -1 for p in pin):
        raise SimError(f"trace pins a request to a rank outside 0..{R - 1}")

    # --- arrivals ------------------------------------------------------------------------------
    t_arrive = np.zeros(n)
    t_first = np.full(n, np.nan)
    t_finish = np.full(n, np.nan)
    queue: deque[int] = deque()
    mode = "closed" if cfg.concurrency is not None else ("iter" if trace.arrival_iter is not None else
                                                          ("time" if trace.arrival_s is not None else "all"))
    if mode == "iter":
        order = np.argsort(trace.arrival_iter, kind="stable").tolist()
        arr_key = trace.arrival_iter.tolist()
    elif mode == "time":
        order = np.argsort(trace.arrival_s, kind="stable").tolist()
        arr_key = trace.arrival_s.tolist()
    else:
        order = list(range(n))
        arr_key = None
    nxt = 0  # next request (in ``order``) not yet in the queue
    if mode == "closed":
        nxt = min(cfg.concurrency, n)
        queue.extend(order[:nxt])
    elif mode == "all":
        nxt = n
        queue.extend(order)

    # --- per-rank state --------------------------------------------------------------------------
    rank_of = [-1] * n
    start_iter = [0] * n
    done = [0] * n  # prompt tokens already prefilled (chunked prefill)
    reserved_flag = [False] * n
    ctxq: list[deque[int]] = [deque() for _ in range(R)]
    n_gen = [0] * R
    kv_base = [0] * R  # sum over generating requests of input_len - start_iter
    reserved = [0] * R
    num_active = np.zeros(R, dtype=np.int64)
    active_tokens = np.zeros(R, dtype=np.int64)
    buckets: dict[int, list[int]] = {}

    rec_tokens: list[list[int]] = []
    rec_dt: list[float] = []
    rec_ctx: list[int] = []
    now = 0.0
    it = 0
    finished = 0
    output_tokens = 0
    dummy_tokens = 0
    zeros = np.zeros(R)

    while finished < n:
        # 1. arrivals (open loop)
        if mode == "iter":
            while nxt < n and arr_key[order[nxt]] <= it:
                queue.append(order[nxt])
                t_arrive[order[nxt]] = now
                nxt += 1
        elif mode == "time":
            while nxt < n and arr_key[order[nxt]] <= now:
                queue.append(order[nxt])
                t_arrive[order[nxt]] = arr_key[order[nxt]]
                nxt += 1

        # 2. admission to ranks
        if queue:
            free = R * cap - int(num_active.sum())
            if free > 0:
                if pin is None:
                    take = [queue.popleft() for _ in range(min(free, len(queue)))]
                    ranks = router.route(inp[take], num_active, active_tokens, cap).tolist()
                    back = []
                    for i, r in zip(take, ranks):
                        if r < 0:
                            back.append(i)
                        else:
                            rank_of[i] = r
                            ctxq[r].append(i)
                    queue.extendleft(reversed(back))
                else:
                    keep: deque[int] = deque()
                    while queue:
                        i = queue.popleft()
                        r = pin[i]
                        if r < 0:
                            r = int(router.route(inp[[i]], num_active, active_tokens, cap)[0])
                        elif num_active[r] < cap:
                            num_active[r] += 1
                            active_tokens[r] += inp_l[i]
                        else:
                            r = -1
                        if r < 0:
                            keep.append(i)
                        else:
                            rank_of[i] = r
                            ctxq[r].append(i)
                    queue = keep

        # 3. per-rank schedulers: generation first, then contexts FCFS
        any_active = bool(num_active.any())
        picks: list[list[tuple[int, int]]] = []
        ctx_tok = [0] * R
        ctx_kv = [0.0] * R
        num_ctx = [0] * R
        gen_eff = list(n_gen)
        for r in range(R):
            if num_active[r] == 0 and any_active:
                gen_eff[r] = 1  # dummy request
            budget = mnt - n_gen[r]
            slots = mbs - n_gen[r]
            picked: list[tuple[int, int]] = []
            used = 0
            kv_r = 0.0
            for i in ctxq[r]:
                if len(picked) >= slots or used >= budget:
                    break
                if not reserved_flag[i]:
                    need = inp_l[i] + out_l[i]
                    if kvcap is not None and reserved[r] + need > kvcap:
                        break
                    reserved[r] += need
                    reserved_flag[i] = True
                rem = inp_l[i] - done[i]
                take = rem if rem <= budget - used else (budget - used if cfg.chunked_prefill else 0)
                if take <= 0:
                    break
                picked.append((i, take))
                used += take
                kv_r += take * done[i] + take * (take + 1) / 2
                if take < rem:
                    break
            picks.append(picked)
            ctx_tok[r] = used
            ctx_kv[r] = kv_r
            num_ctx[r] = len(picked)

        # 4. the gate
        run_ctx = gate.decide(num_ctx, gen_eff, mbs) and any(num_ctx)
        tokens = [(ctx_tok[r] if run_ctx else 0) + gen_eff[r] for r in range(R)]
        if not any(tokens):
            if mode == "time" and nxt < n:
                now = max(now, arr_key[order[nxt]])
                continue
            if mode == "iter" and nxt < n:
                it += 1
                continue
            raise SimError(f"deadlock at iteration {it}: {n - finished} requests left, none can start "
                           f"(KV capacity {kvcap} tokens per rank too small for the queued contexts?)")

        # 5. time
        gen_kv = np.array([kv_base[r] + n_gen[r] * it + (1 if gen_eff[r] > n_gen[r] else 0) for r in range(R)],
                          dtype=np.float64)
        dt = cost.iteration_time(np.array(tokens, dtype=np.float64),
                                 np.array(ctx_kv, dtype=np.float64) if run_ctx else zeros, gen_kv)
        now += dt
        rec_tokens.append(tokens)
        rec_dt.append(dt)
        rec_ctx.append(sum(num_ctx) if run_ctx else 0)
        output_tokens += sum(n_gen)
        dummy_tokens += sum(gen_eff) - sum(n_gen)

        # 6. contexts that completed become generation requests
        if run_ctx:
            for r in range(R):
                for i, take in picks[r]:
                    done[i] += take
                    if done[i] < inp_l[i]:
                        continue
                    ctxq[r].popleft()
                    t_first[i] = now
                    output_tokens += 1
                    if out_l[i] == 1:
                        buckets.setdefault(it, []).append(i)
                        n_gen[r] += 1  # undone by the finish below
                        kv_base[r] += inp_l[i] - it
                        start_iter[i] = it
                    else:
                        n_gen[r] += 1
                        kv_base[r] += inp_l[i] - it
                        start_iter[i] = it
                        buckets.setdefault(it + out_l[i] - 1, []).append(i)

        # 7. finishes
        for i in buckets.pop(it, ()):
            r = rank_of[i]
            n_gen[r] -= 1
            kv_base[r] -= inp_l[i] - start_iter[i]
            reserved[r] -= inp_l[i] + out_l[i]
            num_active[r] -= 1
            active_tokens[r] -= inp_l[i]
            t_finish[i] = now
            finished += 1
            if mode == "closed" and nxt < n:
                queue.append(order[nxt])
                t_arrive[order[nxt]] = now
                nxt += 1
        it += 1
        if progress is not None and it % 1000 == 0:
            progress(it, finished, n)

    return SimResult(tokens=np.array(rec_tokens, dtype=np.int32).reshape(-1, R), dt=np.array(rec_dt),
                     num_ctx=np.array(rec_ctx, dtype=np.int32), t_arrive=t_arrive, t_first=t_first,
                     t_finish=t_finish, output_tokens=output_tokens, dummy_tokens=dummy_tokens,
                     wall_s=time.perf_counter() - wall0)


def stderr_progress(label: str) -> Callable[[int, int, int], None]:
    """A progress callback that rewrites one stderr line (only when stderr is a terminal)."""
    if not sys.stderr.isatty():
        return lambda it, fin, n: None

    def cb(it: int, fin: int, n: int) -> None:
        end = "\n" if fin >= n else ""
        sys.stderr.write(f"\r{label}: iteration {it}, {fin}/{n} requests finished{end}")
        sys.stderr.flush()
    return cb
