"""The timing method of every perf row (re-exported by ``perf/_common.py``). Each row names its method in a
``method`` field, one of :data:`METHODS`:

- ``graph-rotating`` (bandwidth-bound rows): one CUDA graph of N back-to-back calls over S >= 3 rotating
  input/output sets whose total exceeds 2x L2 (:func:`rotation_plan`), replayed; time per replay / N. The copy
  limit beside such a row is measured the same way on the same bytes (:func:`copy_limit`: a graph of N
  ``copy_`` over rotating buffers that move the op's byte count).
- ``graph-single`` (single-call latency, decode): a graph of one call, replayed after a READ-only flush of
  >= 2x L2 (:class:`L2Flush`: a ``sum`` over the buffer; a write flush would leave dirty lines whose write-back
  the timed kernel pays).
- ``profiler-kernels`` (multi-kernel paths): per-kernel durations from ``torch.profiler`` CUDA activity
  (:func:`kernel_times`), so a send, a receive and any fill are attributed separately.
- ``eager-host``: CUDA events around each eager call after a read-only flush: the host's Python and launch
  included (what an engine that does not capture pays). Kept as its own column beside the others.
- ``eager-write-flush``: the earlier method (eager call after a ``zero_()`` flush); only in the method split.
- ``cpu-wall``: CPU runs (Triton interpreter, ``--cpu-smoke`` / dry run): wall time, numbers meaningless.
- ``counted``: rows that are counts or computed values (bytes, launches, balancedness, errors), not times.

The plans (set counts, flush sizes, call order) are plain functions of the L2 size, so they are checked without
a GPU (tests/test_perf_method.py).
"""

from __future__ import annotations

import time
from collections import defaultdict

GRAPH_N = "graph-rotating"
GRAPH_SINGLE = "graph-single"
PROFILER = "profiler-kernels"
EAGER = "eager-host"
EAGER_WRITE_FLUSH = "eager-write-flush"
CPU_WALL = "cpu-wall"
COUNTED = "counted"
METHODS = {
    GRAPH_N: "CUDA graph of N back-to-back calls over >= 3 rotating input/output sets totalling > 2x L2; "
             "replay time / N",
    GRAPH_SINGLE: "CUDA graph of one call, replayed after a read-only flush of >= 2x L2",
    PROFILER: "per-kernel durations from torch.profiler CUDA activity",
    EAGER: "CUDA events around each eager call after a read-only flush (host Python and launch included)",
    EAGER_WRITE_FLUSH: "CUDA events around each eager call after a zero_() flush of 2x L2 (the earlier method)",
    CPU_WALL: "CPU wall time (Triton interpreter; numbers meaningless)",
    COUNTED: "counted or computed (bytes, launches, balancedness, errors), not timed",
}
MIN_SETS = 3
DEFAULT_N = 20
MIN_FLUSH_BYTES = 64 << 20


class Timing(tuple):
    """``(median, p10, p90, iterations)`` in microseconds."""

    median = property(lambda s: s[0])
    p10 = property(lambda s: s[1])
    p90 = property(lambda s: s[2])
    n = property(lambda s: s[3])


def quantiles(samples) -> Timing:
    xs = sorted(samples)
    n = len(xs)

    def q(f):
        pos = f * (n - 1)
        lo = int(pos)
        hi = min(lo + 1, n - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
    return Timing((q(0.5), q(0.1), q(0.9), n))


def l2_bytes(device=None) -> int:
    """The L2 cache size of a CUDA device in bytes (0 on CPU or when torch does not say)."""
    import torch

    if device is None or getattr(device, "type", device) != "cuda":
        return 0
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0)


# the functions below take an ``l2_bytes`` argument (an override): the device's reading under another name
_device_l2 = l2_bytes


def _cuda(device) -> bool:
    return device is not None and getattr(device, "type", device) == "cuda"


def rotation_plan(set_bytes: int, l2_bytes: int, n: int = DEFAULT_N, min_sets: int = MIN_SETS,
                  max_sets: int = 4096) -> dict:
    """How many input/output sets of ``set_bytes`` a graph of N calls rotates over: the fewest sets (at least
    ``min_sets``) whose total exceeds ``2 * l2_bytes``, so a set is out of L2 by the time it comes round again.
    ``n`` is raised to a multiple of the set count (each replay touches every set equally). Returns
    ``{"sets", "n", "set_bytes", "total_bytes", "l2_bytes", "order"}`` (``order``: the set index of each call)."""
    if set_bytes <= 0:
        raise ValueError(f"set_bytes must be positive, got {set_bytes}")
    sets = max(min_sets, 2 * l2_bytes // set_bytes + 1)
    if sets > max_sets:
        raise ValueError(f"{sets} sets of {set_bytes} B needed to exceed 2x L2 ({l2_bytes} B); at most {max_sets}")
    n = max(n, sets)
    n = -(-n // sets) * sets
    return {"sets": sets, "n": n, "set_bytes": set_bytes, "total_bytes": sets * set_bytes, "l2_bytes": l2_bytes,
            "order": [i % sets for i in range(n)]}


def flush_bytes(l2_bytes: int, min_bytes: int = MIN_FLUSH_BYTES) -> int:
    """The bytes a flush reads: twice the L2 (at least ``min_bytes``); 0 when the L2 size is unknown (CPU)."""
    return max(2 * l2_bytes, min_bytes) if l2_bytes else 0


class L2Flush:
    """``flush()`` evicts the L2 before a timed call by READING a buffer of :func:`flush_bytes` (``write=True``: the
    earlier ``zero_()`` flush, kept only to measure what its dirty lines cost). No-op when the L2 size is unknown.
    ``l2_bytes`` overrides the device's (tests use a fake L2 on CPU). ``flush.bytes`` is the L2 size (0: none)."""

    def __init__(self, device=None, l2_bytes: int | None = None, write: bool = False,
                 min_bytes: int = MIN_FLUSH_BYTES):
        import torch

        self.bytes = _device_l2(device) if l2_bytes is None else int(l2_bytes)
        self.write = write
        self.kind = "write" if write else "read"
        nb = flush_bytes(self.bytes, min_bytes)
        self.buf = torch.empty(nb // 8, dtype=torch.int64, device=device) if nb else None
        self.sink = None

    def __call__(self) -> None:
        if self.buf is None:
            return
        if self.write:
            self.buf.zero_()
        else:
            self.sink = self.buf.sum()  # int64 sum, wraps on overflow: only the read matters

    def resident(self, working_set_bytes) -> bool | None:
        """``l2_resident`` of a row timed after this flush: None on CPU, else False (flushed before every call)."""
        return None if not self.bytes else False


def _events(device):
    import torch

    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def capture(calls, device):
    """A CUDA graph of ``calls`` (zero-argument callables) in order, after one eager warm-up of each on a side
    stream. Returns ``(graph, outputs)``."""
    import torch

    s = torch.cuda.Stream(device)
    s.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(s):
        for c in dict.fromkeys(calls):
            c()
    torch.cuda.current_stream(device).wait_stream(s)
    torch.cuda.synchronize(device)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = [c() for c in calls]
    g.replay()
    torch.cuda.synchronize(device)
    return g, outs


def time_graph_n(set_calls, device, plan: dict, replays: int = 5):
    """``graph-rotating``: ``set_calls[i]`` is the call on input/output set i (``len(set_calls) == plan["sets"]``);
    one graph of ``plan["order"]``'s calls, replayed ``replays`` times with CUDA events around each replay;
    per-call microseconds = replay time / N. CPU: the same calls eagerly, wall time. Returns ``(Timing, info)``;
    ``info`` carries the method and the plan's numbers (no ``order``)."""
    if len(set_calls) != plan["sets"]:
        raise ValueError(f"{len(set_calls)} call sets for a plan of {plan['sets']}")
    calls = [set_calls[i] for i in plan["order"]]
    info = {k: plan[k] for k in ("sets", "n", "set_bytes", "total_bytes", "l2_bytes")}
    out = []
    if not _cuda(device):
        for c in set_calls:
            c()
        for _ in range(max(1, replays)):
            t0 = time.perf_counter()
            for c in calls:
                c()
            out.append((time.perf_counter() - t0) * 1e6 / len(calls))
        return quantiles(out), {"method": CPU_WALL, **info}
    g, _ = capture(calls, device)
    for _ in range(max(1, replays)):
        a, b = _events(device)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / len(calls))
    return quantiles(out), {"method": GRAPH_N, **info}


def copy_plan_bytes(op_bytes: int) -> int:
    """The ``copy_`` payload that moves ``op_bytes`` (read + written) through memory: half of it, 16-byte rounded."""
    return max(16, -(-op_bytes // 32) * 16)


def copy_limit(op_bytes: int, device, l2_bytes: int | None = None, n: int = DEFAULT_N, replays: int = 5) -> dict:
    """The copy limit of a ``graph-rotating`` row, by the same method on the same bytes: a graph of N ``copy_``
    over rotating (src, dst) buffers whose copy reads + writes ``op_bytes``. Returns ``{"us", "GBps" (op bytes
    per second, read + written), "method", plan numbers}``; ``ratio = limit us / op us``."""
    import torch

    l2 = _device_l2(device) if l2_bytes is None else l2_bytes
    payload = copy_plan_bytes(op_bytes)
    plan = rotation_plan(2 * payload, l2, n=n)
    bufs = [(torch.empty(payload, dtype=torch.uint8, device=device), torch.empty(payload, dtype=torch.uint8,
                                                                                  device=device))
            for _ in range(plan["sets"])]
    t, info = time_graph_n([lambda s=s, d=d: d.copy_(s) for s, d in bufs], device, plan, replays=replays)
    return {"us": t.median, "GBps": 2 * payload / t.median / 1e3, **info}


def time_single(fn, device, iters: int = 20, flush: "L2Flush | None" = None):
    """``graph-single``: a graph of one ``fn()`` replayed ``iters`` times, each after ``flush()`` (read-only, outside
    the events). CPU: eager wall time. Returns ``(Timing, info)``."""
    if flush is not None and flush.write:
        raise ValueError("graph-single times after a read-only flush")
    out = []
    if not _cuda(device):
        fn()
        for _ in range(max(1, iters)):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e6)
        return quantiles(out), {"method": CPU_WALL, "flush": None}
    fl = flush if flush is not None else L2Flush(device)
    g, _ = capture([fn], device)
    for _ in range(max(1, iters)):
        fl()
        a, b = _events(device)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3)
    return quantiles(out), {"method": GRAPH_SINGLE, "flush": fl.kind, "flush_bytes": flush_bytes(fl.bytes)}


def copy_single(op_bytes: int, device, iters: int = 20) -> dict:
    """The copy limit of a ``graph-single`` row, by the same method on the same bytes: one ``copy_`` that reads +
    writes ``op_bytes``, a graph replayed after a read-only flush. Returns ``{"us", "GBps", "method", ...}``."""
    import torch

    payload = copy_plan_bytes(op_bytes)
    src = torch.empty(payload, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t, info = time_single(lambda: dst.copy_(src), device, iters=iters)
    return {"us": t.median, "GBps": 2 * payload / t.median / 1e3, **info}


def measure(make_set, op_bytes: int, device, l2_bytes: int | None = None, n: int = DEFAULT_N,
            max_sets: int = 256, iters: int = 20, replays: int = 5) -> dict:
    """One row's number and its copy limit by one method. ``make_set(i)`` allocates input/output set ``i`` and
    returns the zero-argument call on it; ``op_bytes``: bytes the call reads + writes. Bandwidth rows (the
    rotation needs at most ``max_sets`` sets): ``graph-rotating``; smaller calls, whose sets would have to be more
    than that: ``graph-single`` (latency). The copy limit is measured by the same method on the same bytes.
    Returns ``{"us", "p10", "p90", "iterations", "method", "method_detail", "limit_us", "limit_GBps", "GBps",
    "ratio" (limit us / us), plan numbers}``."""
    l2 = _device_l2(device) if l2_bytes is None else l2_bytes
    try:
        plan = rotation_plan(op_bytes, l2, n=n, max_sets=max_sets)
    except ValueError:
        plan = None
    if plan is not None:
        t, info = time_graph_n([make_set(i) for i in range(plan["sets"])], device, plan, replays=replays)
        lim = copy_limit(op_bytes, device, l2_bytes=l2, n=plan["n"], replays=replays)
    else:
        t, info = time_single(make_set(0), device, iters=iters)
        lim = copy_single(op_bytes, device, iters=iters)
    out = {"us": t.median, "p10": t.p10, "p90": t.p90, "iterations": t.n, **info, "method_detail": describe(info),
           "limit_us": lim["us"], "limit_GBps": lim["GBps"], "GBps": op_bytes / t.median / 1e3,
           "ratio": lim["us"] / t.median if t.median else None, "bytes": op_bytes}
    if lim["method"] != info["method"]:
        raise AssertionError(f"limit timed by {lim['method']}, row by {info['method']}")
    return out


def aggregate_kernels(records, calls: int) -> dict:
    """``{name: microseconds per call}`` from ``(name, microseconds)`` records of ``calls`` calls: every kernel of
    the same name within a call adds up (e.g. 4 ``fill_`` nodes), then the total is divided by ``calls``."""
    tot = defaultdict(float)
    for name, us in records:
        tot[name] += float(us)
    return {k: v / max(1, calls) for k, v in sorted(tot.items(), key=lambda kv: -kv[1])}


def kernel_times(fn, device, iters: int = 5, warmup: int = 1) -> dict:
    """``profiler-kernels``: per-kernel microseconds per call of ``fn`` (a callable or a graph's ``replay``) from
    ``torch.profiler`` CUDA activity over ``iters`` calls after ``warmup``. CPU: top-level CPU ops (the dry run's
    check of the machinery; numbers meaningless)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = _cuda(device)
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(max(1, iters)):
            fn()
        if cuda:
            torch.cuda.synchronize(device)
    recs = []
    for e in prof.events():
        if cuda and str(getattr(e, "device_type", "")).endswith("CUDA"):
            recs.append((e.name, e.time_range.elapsed_us()))
        elif not cuda and getattr(e, "cpu_parent", None) is None:
            recs.append((e.name, e.time_range.elapsed_us()))
    return aggregate_kernels(recs, max(1, iters))


def describe(info: dict) -> str:
    """One line saying how a row was timed, from the ``info`` of :func:`time_graph_n` / :func:`time_single` /
    :func:`copy_limit` (or ``{"method": ...}``)."""
    m = info.get("method")
    if m == GRAPH_N:
        return (f"graph of {info['n']} calls over {info['sets']} rotating sets "
                f"({info['total_bytes'] / 2 ** 20:.0f} MiB > 2x L2 {info['l2_bytes'] / 2 ** 20:.0f} MiB), time / "
                f"{info['n']}")
    if m == GRAPH_SINGLE:
        mib = info.get("flush_bytes", 0) / 2 ** 20
        return f"graph of 1 call after a {info.get('flush', 'read')} flush of {mib:.0f} MiB"
    return METHODS.get(m, str(m))
