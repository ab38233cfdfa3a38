"""Stream/event plumbing shared by the backends (DeepEP's ``EventOverlap`` semantics).

On CUDA, ``async_finish=True`` runs the communication on the Buffer's communication stream and
returns an event the caller waits on (``event.current_stream_wait()``) before using the outputs;
``previous_event`` makes the communication stream wait for it first. On CPU every call is
synchronous and the returned :class:`EventOverlap` holds no event (waiting is a no-op).

This module is the one place that waits on streams and records events. It does so through the
module-level provider ``_streams`` (default: :class:`TorchCudaStreams`, i.e. ``torch.cuda``). The
stream-order checker (:func:`moe_ep.testing.streams.checked_streams`) swaps in a virtual-stream model
that also takes CPU tensors down the CUDA code path and is told every launch's reads and writes, so
stream-order bugs show on a CPU.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch

__all__ = ["EventOverlap", "EventHandle", "run_on_comm_stream", "TorchCudaStreams", "set_provider", "get_provider",
           "uses_streams", "is_capturing", "launch", "new_event", "query", "synchronize", "empty_pinned"]


class TorchCudaStreams:
    """The default stream provider: plain ``torch.cuda``; ``launch`` reports go nowhere."""

    emulate_device = False  # a checker sets this: CPU tensors then take the CUDA code path
    reports_launches = False  # a checker sets this: launches are reported to it

    def uses_streams(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def on_device(self, t: torch.Tensor) -> bool:
        return t.is_cuda

    def current_stream(self, device=None):
        return torch.cuda.current_stream(device)

    def Stream(self, device=None):  # noqa: N802 - mirrors torch.cuda.Stream
        return torch.cuda.Stream(device=device)

    def Event(self):  # noqa: N802 - mirrors torch.cuda.Event
        return torch.cuda.Event()

    def stream(self, s):
        return torch.cuda.stream(s)

    def comm_stream_for(self, owner, device):
        raise RuntimeError(f"no communication stream for device {device}")

    def wait_event(self, stream, event) -> None:
        stream.wait_event(event)

    def wait_stream(self, stream, other) -> None:
        stream.wait_stream(other)

    def record(self, event, stream=None) -> None:
        event.record(stream)

    def record_stream(self, t: torch.Tensor, stream) -> None:
        t.record_stream(stream)

    def is_capturing(self, device=None) -> bool:
        return (device is None or device.type == "cuda") and torch.cuda.is_current_stream_capturing()

    def query(self, event) -> bool:
        return event.query()

    def synchronize(self, device=None) -> None:
        torch.cuda.current_stream(device).synchronize()

    def empty_pinned(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def launch(self, stream, reads, writes, what: str = "launch", alloc_stream=None) -> None:
        pass


_streams: Any = TorchCudaStreams()


def set_provider(provider) -> Any:
    """Install a stream provider (``None``: the default); returns the previous one."""
    global _streams
    previous = _streams
    _streams = provider if provider is not None else TorchCudaStreams()
    return previous


def get_provider():
    return _streams


def uses_streams(device: torch.device) -> bool:
    """Whether work on ``device`` goes through streams and events (CUDA, or any device under a checker)."""
    return _streams.uses_streams(device)


def is_capturing(device: Optional[torch.device] = None) -> bool:
    """Whether a CUDA graph is being captured on the current stream (or, under a checker, simulated)."""
    return _streams.is_capturing(device)


def launch(reads: Iterable = (), writes: Iterable = (), what: str = "launch") -> None:
    """Report a launch on the current stream (tensors it reads / writes) to the stream checker, if one
    is installed; free otherwise."""
    _streams.launch(None, list(_tensors_in(reads)), list(_tensors_in(writes)), what)


def new_event():
    return _streams.Event()


def record(event, stream=None) -> None:
    _streams.record(event, stream)


def query(event) -> bool:
    """``event.query()`` (a host query: never call it while a graph is being captured)."""
    return _streams.query(event)


def synchronize(device: Optional[torch.device] = None) -> None:
    """Block the host on the current stream of ``device`` (never while a graph is being captured)."""
    _streams.synchronize(device)


def empty_pinned(shape, dtype) -> torch.Tensor:
    return _streams.empty_pinned(shape, dtype)


class EventHandle:
    """DeepEP's ``EventHandle``: an event recorded on the current CUDA stream when it is made (nothing on a
    machine without CUDA, where every call is synchronous). ``EventOverlap(EventHandle())`` is what
    :meth:`moe_ep.Buffer.capture` returns."""

    def __init__(self):
        self.event = None
        if torch.cuda.is_available():
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        if self.event is not None:
            _streams.wait_event(_streams.current_stream(), self.event)


class EventOverlap:
    """A CUDA event (or nothing, on CPU) marking the end of a communication call.

    Use ``event.current_stream_wait()`` before reading the outputs of an ``async_finish`` call, or
    ``with event:`` to run compute in the block and wait at its end. ``event`` may be an :class:`EventHandle`.
    """

    def __init__(self, event: Optional["torch.cuda.Event"] = None, extra_tensors: Optional[tuple] = None):
        if isinstance(event, EventHandle):
            event = event.event
        self.event = event
        # Keeps tensors alive until the event completes (DeepEP keeps send buffers this way).
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        if self.event is not None:
            _streams.wait_event(_streams.current_stream(), self.event)

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.current_stream_wait()


def _tensors_in(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors_in(item)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            yield from _tensors_in(getattr(obj, name))


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _call_name(fn: Callable, owner: Any = None) -> str:
    """``Class.method`` of the call that made ``fn``, with ``owner``'s class (the object the call was made on, not
    the base class that defines the method)."""
    name = (getattr(fn, "__qualname__", None) or getattr(fn, "__name__", "communication")).split(".<locals>")[0]
    if owner is not None and "." in name:
        name = f"{type(owner).__name__}.{name.rsplit('.', 1)[1]}"
    return name


def run_on_comm_stream(fn: Callable[[], Any], device: torch.device, comm_stream, *,
                       previous_event: Optional[EventOverlap], async_finish: bool,
                       allocate_on_comm_stream: bool, inputs: Any = (), owner: Any = None) -> tuple[Any, EventOverlap]:
    """Run ``fn`` (which issues the communication) with DeepEP's stream semantics and return
    ``(result, event)``. On CPU ``fn`` simply runs.

    ``inputs``: the tensors ``fn`` reads (tensors, tuples / lists / dataclasses of them). With
    ``async_finish`` each is ``record_stream``-ed on the communication stream, so the caching allocator
    does not hand its memory to new work while the communication may still read it (DeepEP does the
    same); ``owner`` keys the virtual communication stream under the stream checker.
    """
    s = _streams
    if not s.uses_streams(device):
        if previous_event is not None and previous_event.event is not None:
            raise ValueError("previous_event holds a CUDA event but the tensors are on the CPU")
        return fn(), EventOverlap(None)
    if allocate_on_comm_stream and (not async_finish or previous_event is None):
        raise ValueError("allocate_on_comm_stream=True needs both previous_event and async_finish=True (as DeepEP)")
    if comm_stream is None:
        comm_stream = s.comm_stream_for(owner, device)
    compute_stream = s.current_stream(device)
    if previous_event is not None and previous_event.event is not None:
        s.wait_event(comm_stream, previous_event.event)
    else:
        s.wait_stream(comm_stream, compute_stream)
    in_tensors = [t for t in _tensors_in(inputs) if s.on_device(t)]
    with s.stream(comm_stream):
        result = fn()
        outputs = [t for t in _tensors_in(result) if s.on_device(t)]
        if s.reports_launches:  # a checker: reads = inputs, writes = outputs that are not inputs
            in_keys = {_storage_key(t) for t in in_tensors}
            s.launch(comm_stream, in_tensors, [t for t in outputs if _storage_key(t) not in in_keys],
                     _call_name(fn, owner), alloc_stream=compute_stream)
        event = s.Event()
        s.record(event, comm_stream)
    # Tensors made on the comm stream are used on the compute stream: keep the caching allocator
    # from recycling them early.
    for t in outputs:
        s.record_stream(t, compute_stream)
    if async_finish:
        # The caller may drop its inputs before waiting on the event: the comm stream still reads them.
        seen = set()
        for t in in_tensors:
            if id(t) not in seen:
                seen.add(id(t))
                s.record_stream(t, comm_stream)
    else:
        s.wait_event(compute_stream, event)
    return result, EventOverlap(event)
