"""Stream-order checker: CUDA stream/event ordering bugs made visible on a CPU.

:func:`checked_streams` installs :class:`StreamChecker` as the stream provider of
:mod:`moe_ep.events` (the one place that creates streams and events, waits and records). While it is
installed, CPU tensors take the CUDA code path of :func:`moe_ep.events.run_on_comm_stream` (work
still runs synchronously; only the ordering is modelled), and every launch the events layer issues
reports the tensors it reads and writes. Compute launched by the caller is reported with
:func:`launch` (or a function wrapped by :func:`reporting`).

The model is a vector clock per virtual stream: a launch on stream ``s`` ticks ``s``'s own entry;
``Event.record`` copies the stream's clock into the event; ``wait_event`` / ``wait_stream`` join the
event's (the other stream's) clock into the waiting stream's; a host synchronisation joins into the
host's clock, which every later launch inherits. Per storage (tensor memory) it keeps the last
writes (byte range, stream, clock), every stream that accessed it, the stream it was allocated on
and the streams it was ``record_stream``-ed on. It reports:

- ``unordered-read``: a launch on stream ``s`` reads bytes whose last write (on another stream) has
  no happens-before edge to ``s`` (``s``'s clock of the writer < the write's clock);
- ``freed-in-use``: a storage is released (its last Python reference dies) while a stream other
  than its allocation stream may still access it: no ``record_stream`` on that stream and no edge
  from the access to the allocation stream (nor to the host);
- ``host-query-in-capture``: ``Event.query``, ``Event/Stream.synchronize`` or a device
  synchronisation while a graph capture is simulated (:meth:`StreamChecker.capture`).

Limits: reads and writes are only known where they are reported (Buffer calls through the events
layer, compute through :func:`launch`); a backend's internal kernels are one launch of the call.
Write-after-read hazards are not modelled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import weakref
from typing import Any, Callable, Iterable, Optional

import torch

from .. import events

from ..errors import MoEEPError

__all__ = ["StreamChecker", "StreamOrderError", "Violation", "VirtualStream", "VirtualEvent",
           "checked_streams", "active_checker", "launch", "reporting"]


class StreamOrderError(MoEEPError, AssertionError):
    """Violations found by a :func:`checked_streams` block (strict mode)."""


@dataclasses.dataclass
class Violation:
    kind: str  # "unordered-read" | "freed-in-use" | "host-query-in-capture"
    message: str

    def __str__(self) -> str:
        return f"[{self.kind}] {self.message}"


class VirtualStream:
    """A stream of the model; has the ``torch.cuda.Stream`` methods the code base calls."""

    def __init__(self, checker: "StreamChecker", name: str):
        self.checker = checker
        self.name = name

    def wait_event(self, event: "VirtualEvent") -> None:
        self.checker.wait_event(self, event)

    def wait_stream(self, other: "VirtualStream") -> None:
        self.checker.wait_stream(self, other)

    def synchronize(self) -> None:
        self.checker._host_sync(self, "Stream.synchronize")

    def query(self) -> bool:
        self.checker._host_sync(self, "Stream.query")
        return True

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


class VirtualEvent:
    """An event of the model; has the ``torch.cuda.Event`` methods the code base calls."""

    def __init__(self, checker: "StreamChecker"):
        self.checker = checker
        self.clock: Optional[dict] = None  # None: never recorded
        self.stream: Optional[VirtualStream] = None

    def record(self, stream: Optional[VirtualStream] = None) -> None:
        self.checker.record(self, stream)

    def query(self) -> bool:
        return self.checker.query(self)

    def synchronize(self) -> None:
        self.checker.query(self, "Event.synchronize")

    def wait(self, stream: Optional[VirtualStream] = None) -> None:
        self.checker.wait_event(stream or self.checker.current_stream(), self)


@dataclasses.dataclass
class _Write:
    lo: int
    hi: int
    stream: VirtualStream
    clock: int
    what: str


class _Storage:
    def __init__(self, alloc: VirtualStream, desc: str):
        self.alloc = alloc
        self.desc = desc
        self.writes: list[_Write] = []
        self.accesses: dict[VirtualStream, tuple[int, str]] = {}
        self.recorded: set[VirtualStream] = set()
        self.finalizer: Optional[weakref.finalize] = None


def _span(t: torch.Tensor) -> tuple[int, int]:
    size = t.element_size()
    lo = t.storage_offset() * size
    extent = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())) + 1 if t.numel() else 0
    return lo, lo + extent * size


def _desc(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"


class StreamChecker:
    """Vector-clock model of streams and events (see the module docstring). Also the stream
    provider :mod:`moe_ep.events` talks to while :func:`checked_streams` is active."""

    emulate_device = True
    reports_launches = True

    def __init__(self):
        self._clock: dict[VirtualStream, dict] = {}
        self.host_clock: dict = {}
        self.compute = self._new_stream("compute")
        self._current = [self.compute]
        self._comm: dict[int, VirtualStream] = {}
        self._storages: dict[int, _Storage] = {}
        self._seen: set = set()
        self.capturing = False
        self.violations: list[Violation] = []
        self.num_launches = 0

    # ---------------------------------------------------------------- streams and events
    def _new_stream(self, name: str) -> VirtualStream:
        s = VirtualStream(self, name)
        self._clock[s] = {}
        return s

    def current_stream(self, device=None) -> VirtualStream:
        return self._current[-1]

    def Stream(self, device=None) -> VirtualStream:  # noqa: N802
        return self._new_stream(f"side{len(self._clock)}")

    def Event(self) -> VirtualEvent:  # noqa: N802
        return VirtualEvent(self)

    def comm_stream_for(self, owner, device) -> VirtualStream:
        key = id(owner)
        if key not in self._comm:
            self._comm[key] = self._new_stream(f"comm{len(self._comm)}")
        return self._comm[key]

    @contextlib.contextmanager
    def stream(self, s: VirtualStream):
        self._current.append(s)
        try:
            yield s
        finally:
            self._current.pop()

    @staticmethod
    def _join(into: dict, other: dict) -> None:
        for k, v in other.items():
            if into.get(k, 0) < v:
                into[k] = v

    def record(self, event: VirtualEvent, stream: Optional[VirtualStream] = None) -> None:
        stream = stream or self.current_stream()
        self._join(self._clock[stream], self.host_clock)
        event.clock, event.stream = dict(self._clock[stream]), stream

    def wait_event(self, stream: VirtualStream, event) -> None:
        if not isinstance(event, VirtualEvent):
            raise TypeError(f"the stream checker got a {type(event).__name__}, not one of its events")
        if event.clock is not None:  # waiting on a never-recorded event does nothing (as in CUDA)
            self._join(self._clock[stream], event.clock)

    def wait_stream(self, stream: VirtualStream, other: VirtualStream) -> None:
        self._join(self._clock[stream], self._clock[other])
        self._join(self._clock[stream], self.host_clock)

    def _host_query(self, what: str) -> None:
        if self.capturing:
            self._report("host-query-in-capture", f"{what} while a CUDA graph is being captured: a host query "
                                                  f"is not allowed in a capture (it invalidates the capture)")

    def query(self, event: VirtualEvent, what: str = "Event.query") -> bool:
        self._host_query(what)
        if event.clock is not None:
            self._join(self.host_clock, event.clock)
        return True  # on a CPU the work is done

    def _host_sync(self, stream: VirtualStream, what: str) -> None:
        self._host_query(what)
        self._join(self.host_clock, self._clock[stream])

    def synchronize(self, device=None) -> None:
        self._host_query("synchronize")
        for clock in self._clock.values():
            self._join(self.host_clock, clock)

    def is_capturing(self, device=None) -> bool:
        return self.capturing

    @contextlib.contextmanager
    def capture(self):
        """Simulate ``torch.cuda.graph(...)``: ``is_capturing()`` is true in the block."""
        if self.capturing:
            raise RuntimeError("nested capture")
        self.capturing = True
        try:
            yield self
        finally:
            self.capturing = False

    # ---------------------------------------------------------------- devices and memory
    def uses_streams(self, device) -> bool:
        return True

    def on_device(self, t: torch.Tensor) -> bool:
        return True

    def empty_pinned(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def _storage(self, t: torch.Tensor, alloc: VirtualStream) -> Optional[_Storage]:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or storage.nbytes() == 0:
            return None
        rec = self._storages.get(key)
        if rec is None:
            rec = self._storages[key] = _Storage(alloc, _desc(t))
            rec.finalizer = weakref.finalize(storage, self._freed, key)
        return rec

    def record_stream(self, t: torch.Tensor, stream: VirtualStream) -> None:
        rec = self._storage(t, self.current_stream())
        if rec is not None:
            rec.recorded.add(stream)

    def _freed(self, key: int) -> None:
        rec = self._storages.pop(key, None)
        if rec is None:
            return
        alloc_clock = self._clock[rec.alloc]
        for stream, (clock, what) in rec.accesses.items():
            if stream is rec.alloc or stream in rec.recorded:
                continue
            if alloc_clock.get(stream, 0) >= clock or self.host_clock.get(stream, 0) >= clock:
                continue
            self._report("freed-in-use",
                         f"{rec.desc} (allocated on {rec.alloc.name}) was freed while {stream.name} may still "
                         f"access it ({what}): no record_stream({stream.name}) and no wait of {rec.alloc.name} "
                         f"on that access, so the caching allocator can hand the memory to new work on "
                         f"{rec.alloc.name} too early")

    # ---------------------------------------------------------------- launches
    def launch(self, stream: Optional[VirtualStream], reads: Iterable[torch.Tensor], writes: Iterable[torch.Tensor],
               what: str = "launch", alloc_stream: Optional[VirtualStream] = None) -> None:
        stream = stream or self.current_stream()
        clock = self._clock[stream]
        self._join(clock, self.host_clock)
        clock[stream] = clock.get(stream, 0) + 1
        now = clock[stream]
        self.num_launches += 1
        for t in reads:
            rec = self._storage(t, alloc_stream or self.current_stream())
            if rec is None:
                continue
            lo, hi = _span(t)
            for w in rec.writes:
                if w.lo < hi and lo < w.hi and clock.get(w.stream, 0) < w.clock:
                    key = (id(rec), w.stream, w.clock, stream)
                    if key not in self._seen:
                        self._seen.add(key)
                        self._report("unordered-read",
                                     f"{what} on {stream.name} reads {_desc(t)} written by {w.what} on "
                                     f"{w.stream.name} with no happens-before edge to that write "
                                     f"({stream.name} has seen {w.stream.name} up to {clock.get(w.stream, 0)}, "
                                     f"the write is at {w.clock}): wait on an event recorded after the write")
            self._access(rec, stream, now, what)
        for t in writes:
            rec = self._storage(t, stream)
            if rec is None:
                continue
            lo, hi = _span(t)
            rec.writes = [w for w in rec.writes if not (lo <= w.lo and w.hi <= hi)]
            rec.writes.append(_Write(lo, hi, stream, now, what))
            self._access(rec, stream, now, what)

    @staticmethod
    def _access(rec: _Storage, stream: VirtualStream, now: int, what: str) -> None:
        if rec.accesses.get(stream, (0, ""))[0] < now:
            rec.accesses[stream] = (now, what)

    # ---------------------------------------------------------------- reporting
    def _report(self, kind: str, message: str) -> None:
        self.violations.append(Violation(kind, message))

    def messages(self, kind: Optional[str] = None) -> list[str]:
        return [str(v) for v in self.violations if kind is None or v.kind == kind]

    def close(self) -> None:
        gc.collect()  # process the frees of everything the block dropped
        for rec in list(self._storages.values()):
            if rec.finalizer is not None:
                rec.finalizer.detach()
        self._storages.clear()


_active: list[StreamChecker] = []


def active_checker() -> Optional[StreamChecker]:
    return _active[-1] if _active else None


@contextlib.contextmanager
def checked_streams(strict: bool = True):
    """Run the block under a fresh :class:`StreamChecker` (yielded). With ``strict``, leaving the block
    raises :class:`StreamOrderError` listing the violations (frees are collected first)."""
    checker = StreamChecker()
    previous = events.set_provider(checker)
    _active.append(checker)
    try:
        yield checker
    finally:
        _active.pop()
        try:
            checker.close()
        finally:
            events.set_provider(previous)
    if strict and checker.violations:
        raise StreamOrderError("stream-order violations:\n" + "\n".join(checker.messages()))


def launch(reads: Any = (), writes: Any = (), what: str = "compute") -> None:
    """Report a compute launch on the current (virtual) stream: the tensors it reads and writes
    (tensors, or tuples / lists / dataclasses of them). Free when no checker is active."""
    events.launch(reads, writes, what)


def reporting(fn: Callable, what: Optional[str] = None) -> Callable:
    """Wrap ``fn`` so each call is reported as one launch: tensor arguments are read, the returned
    tensors written."""
    name = what or getattr(fn, "__name__", "compute")

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        out = fn(*args, **kwargs)
        launch(reads=[*args, *kwargs.values()], writes=out, what=name)
        return out

    return wrapper
