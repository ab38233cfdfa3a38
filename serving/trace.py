"""Request traces: plain arrays, a seeded synthetic generator, and JSON / CSV loading with validation.

A trace is one row per request: ``input_len``, ``output_len`` (tokens, >= 1) and optionally
``arrival_s`` (open loop, seconds), ``arrival_iter`` (the iteration it enters the queue; used by the
hand-checkable tests) and ``rank`` (pin to a DP rank, -1 = any). Without arrivals the simulator runs
closed loop at a given concurrency, as trtllm-bench does in the seed's experiment.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import ServingError

__all__ = ["Trace", "TraceError", "synthetic", "load_trace", "PAPER_TRACE"]


class TraceError(ServingError, ValueError):
    """A trace file or trace argument is invalid; the message says what and where."""


@dataclass(frozen=True)
class Trace:
    """Arguments:
        input_len: `[n]` int64 prompt tokens, >= 1.
        output_len: `[n]` int64 generated tokens, >= 1 (the first comes out of the context iteration).
        arrival_s: `[n]` float64 seconds, non-decreasing, or None (closed loop).
        arrival_iter: `[n]` int64 iteration index, or None.
        rank: `[n]` int64 pinned DP rank or -1, or None.
    """

    input_len: np.ndarray
    output_len: np.ndarray
    arrival_s: np.ndarray | None = None
    arrival_iter: np.ndarray | None = None
    rank: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.input_len)
        if n == 0:
            raise TraceError("trace is empty")
        for name in ("input_len", "output_len", "arrival_s", "arrival_iter", "rank"):
            a = getattr(self, name)
            if a is not None and len(a) != n:
                raise TraceError(f"trace column {name} has {len(a)} rows, input_len has {n}")
        for name in ("input_len", "output_len"):
            a = getattr(self, name)
            bad = np.flatnonzero(a < 1)
            if bad.size:
                raise TraceError(f"request {bad[0]}: {name}={a[bad[0]]} must be >= 1")
        if self.arrival_s is not None:
            if not np.all(np.isfinite(self.arrival_s)) or np.any(self.arrival_s < 0):
                raise TraceError("arrival_s must be finite and >= 0")
        if self.arrival_iter is not None and np.any(self.arrival_iter < 0):
            raise TraceError("arrival_iter must be >= 0")

    def __len__(self) -> int:
        return len(self.input_len)

    def summary(self) -> str:
        i, o = self.input_len, self.output_len
        return (f"{len(self)} requests, input mean {i.mean():.1f} (p50 {np.median(i):.0f}, max {i.max()}), "
                f"output mean {o.mean():.1f} (p50 {np.median(o):.0f}, p99 {np.percentile(o, 99):.0f}, max {o.max()})")


def _lognormal_with_mean(rng: np.random.Generator, n: int, mean: float, sigma: float, lo: int, hi: int) -> np.ndarray:
    """Integers in [lo, hi] from a lognormal shape whose clipped, rounded mean is ``mean`` (to ~0.1%)."""
    z = rng.standard_normal(n)
    scale = mean
    for _ in range(30):  # fixed-point on the scale so clipping does not move the mean
        x = np.clip(np.rint(scale * np.exp(sigma * z - sigma * sigma / 2)), lo, hi)
        m = x.mean()
        if abs(m - mean) < 1e-4 * mean:
            break
        scale *= mean / m
    return x.astype(np.int64)


def synthetic(num_requests: int = 16000, mean_input: float = 803.0, mean_output: float = 3653.0,
              sigma_input: float = 0.6, sigma_output: float = 1.0, max_input: int = 4096,
              max_output: int = 32768, seed: int = 0) -> Trace:
    """The seed's dataset statistics (16,000 requests, mean input 803, mean output 3,653, long-tailed
    output) as clipped lognormals. The seed gives no shape parameters; ``sigma_output`` sets the tail
    weight and is the parameter the result is most sensitive to."""
    for name, v in (("num_requests", num_requests), ("max_input", max_input), ("max_output", max_output)):
        if v < 1:
            raise TraceError(f"{name}={v} must be >= 1")
    if not (1 <= mean_input <= max_input) or not (1 <= mean_output <= max_output):
        raise TraceError(f"means must lie in [1, max]: mean_input={mean_input} (max {max_input}), "
                         f"mean_output={mean_output} (max {max_output})")
    if sigma_input < 0 or sigma_output < 0:
        raise TraceError("sigma_input and sigma_output must be >= 0")
    rng = np.random.default_rng(seed)
    inp = _lognormal_with_mean(rng, num_requests, mean_input, sigma_input, 1, max_input)
    out = _lognormal_with_mean(rng, num_requests, mean_output, sigma_output, 1, max_output)
    return Trace(inp, out)


PAPER_TRACE = dict(num_requests=16000, mean_input=803.0, mean_output=3653.0)

_COLUMNS = ("input_len", "output_len", "arrival_s", "arrival_iter", "rank")
_ALIASES = {"input_len": ("input_len", "input_tokens", "prompt_len", "isl"),
            "output_len": ("output_len", "output_tokens", "osl", "max_tokens"),
            "arrival_s": ("arrival_s", "arrival", "timestamp"), "arrival_iter": ("arrival_iter",), "rank": ("rank",)}


def _column(rows: list[dict], key: str, path: Path, required: bool, integer: bool) -> np.ndarray | None:
    names = [a for a in _ALIASES[key] if a in rows[0]]
    if not names:
        if required:
            raise TraceError(f"{path}: missing column {key!r} (accepted names: {', '.join(_ALIASES[key])})")
        return None
    name = names[0]
    vals = []
    for i, row in enumerate(rows):
        v = row.get(name)
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise TraceError(f"{path}: row {i}: {name}={v!r} is not a number") from None
        if not math.isfinite(f) or (integer and f != int(f)):
            raise TraceError(f"{path}: row {i}: {name}={v!r} must be a finite {'integer' if integer else 'number'}")
        vals.append(f)
    return np.asarray(vals, dtype=np.int64 if integer else np.float64)


def load_trace(path: str | Path) -> Trace:
    """Read a trace from ``.json`` (a list of objects, or ``{"requests": [...]}``) or ``.csv`` (header row).

    Raises:
        TraceError: unreadable file, unknown extension, missing / non-numeric / out-of-range values.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise TraceError(f"cannot read trace {path}: {e.strerror or e}") from None
    suffix = path.suffix.lower()
    if suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise TraceError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        if isinstance(data, dict):
            data = data.get("requests")
        if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
            raise TraceError(f"{path}: expected a list of request objects (or {{\"requests\": [...]}})")
        rows = data
    elif suffix == ".csv":
        rows = list(csv.DictReader(text.splitlines()))
    else:
        raise TraceError(f"{path}: unknown trace format {suffix!r}; use .json or .csv")
    if not rows:
        raise TraceError(f"{path}: trace has no requests")
    cols = {k: _column(rows, k, path, k in ("input_len", "output_len"), k != "arrival_s") for k in _COLUMNS}
    return Trace(**cols)
