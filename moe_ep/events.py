"""Stream/event plumbing shared by the backends (DeepEP's ``EventOverlap`` semantics).

On CUDA, ``async_finish=True`` runs the communication on the Buffer's communication stream and
returns an event the caller waits on (``event.current_stream_wait()``) before using the outputs;
``previous_event`` makes the communication stream wait for it first. On CPU every call is
synchronous and the returned :class:`EventOverlap` holds no event (waiting is a no-op).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

__all__ = ["EventOverlap", "run_on_comm_stream"]


class EventOverlap:
    """A CUDA event (or nothing, on CPU) marking the end of a communication call.

    Use ``event.current_stream_wait()`` before reading the outputs of an ``async_finish`` call, or
    ``with event:`` to run compute in the block and wait at its end.
    """

    def __init__(self, event: Optional["torch.cuda.Event"] = None, extra_tensors: Optional[tuple] = None):
        self.event = event
        # Keeps tensors alive until the event completes (DeepEP keeps send buffers this way).
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

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


def run_on_comm_stream(fn: Callable[[], Any], device: torch.device, comm_stream, *,
                       previous_event: Optional[EventOverlap], async_finish: bool,
                       allocate_on_comm_stream: bool) -> tuple[Any, EventOverlap]:
    """Run ``fn`` (which issues the communication) with DeepEP's stream semantics and return
    ``(result, event)``. On CPU ``fn`` simply runs."""
    if device.type != "cuda":
        if previous_event is not None and previous_event.event is not None:
            raise ValueError("previous_event holds a CUDA event but the tensors are on the CPU")
        return fn(), EventOverlap(None)
    if allocate_on_comm_stream and not async_finish and previous_event is None:
        raise ValueError("allocate_on_comm_stream=True needs previous_event or async_finish")
    compute_stream = torch.cuda.current_stream(device)
    if previous_event is not None and previous_event.event is not None:
        comm_stream.wait_event(previous_event.event)
    else:
        comm_stream.wait_stream(compute_stream)
    with torch.cuda.stream(comm_stream):
        result = fn()
        event = torch.cuda.Event()
        event.record(comm_stream)
    # Tensors made on the comm stream are used on the compute stream: keep the caching allocator
    # from recycling them early.
    for t in _tensors_in(result):
        if t.is_cuda:
            t.record_stream(compute_stream)
    if not async_finish:
        compute_stream.wait_event(event)
    return result, EventOverlap(event)
