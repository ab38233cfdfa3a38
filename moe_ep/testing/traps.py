"""Host-read traps: prove on a CPU that a code path never reads the device from the host.

A CUDA graph cannot capture a host read of device memory (``Tensor.item``, ``tolist``, ``bool(t)``,
``nonzero``, copies to the host ...): on a GPU such a read breaks capture or silently freezes a value
into the graph. On a CPU every tensor lives on the host, so the reads succeed there; this module turns
them into errors while a block runs, so the graph-safety of a path is checked by any CPU test.

Two exemptions, both work that on a GPU involves no host read of device memory:
- Triton's interpreter reads tensors on the host to emulate a kernel: the device's work, not the
  caller's, so reads made inside an interpreted kernel launch are allowed.
- the symm backend's status-word poll (``check_status``) and its normal mode's refusal-word poll
  (``_check_refused`` / ``poll_refused``): on a CPU they read the words directly, on a GPU a pinned host copy
  queued earlier (and they queue nothing while a graph is being captured).

The ``torch`` backend's numpy bookkeeping of host tensors is off inside the block (CPU tensors stand in for device
memory there), so the torch ops a device runs are the path checked.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from ..errors import MoEEPError

__all__ = ["HostReadError", "host_reads_trapped"]


class HostReadError(MoEEPError, RuntimeError):
    """A host read of tensor data happened inside :func:`host_reads_trapped`."""


_state = threading.local()
_TENSOR_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy")
_TORCH_FUNCTIONS = ("nonzero", "argwhere", "masked_select", "unique", "bincount")


def _in_kernel() -> bool:
    return getattr(_state, "kernel_depth", 0) > 0


def _trapping(name: str, original):
    def wrapper(*args, **kwargs):
        if not _in_kernel():
            raise HostReadError(f"host read of tensor data ({name}) inside host_reads_trapped(): this breaks "
                                f"CUDA-graph capture and synchronises the stream")
        return original(*args, **kwargs)

    wrapper.__name__ = getattr(original, "__name__", name)
    return wrapper


def _is_cpu(device) -> bool:
    return (isinstance(device, str) and device.startswith("cpu")) or \
        (isinstance(device, torch.device) and device.type == "cpu")


def _trapping_to(original):
    def to(self, *args, **kwargs):
        target = kwargs.get("device", args[0] if args and not isinstance(args[0], (torch.dtype, torch.Tensor)) else None)
        if target is not None and _is_cpu(target) and not _in_kernel():
            raise HostReadError("host read of tensor data (Tensor.to('cpu')) inside host_reads_trapped()")
        return original(self, *args, **kwargs)

    return to


def _kernel_scope(original):
    def call(*args, **kwargs):
        _state.kernel_depth = getattr(_state, "kernel_depth", 0) + 1
        try:
            return original(*args, **kwargs)
        finally:
            _state.kernel_depth -= 1

    return call


@contextlib.contextmanager
def host_reads_trapped():
    """Within the block, host reads of tensor data raise :class:`HostReadError`.

    Trapped: ``Tensor.item / tolist / __bool__ / __int__ / __float__ / __index__ / nonzero / cpu / numpy``,
    ``Tensor.to`` a CPU device, and ``torch.nonzero / argwhere / masked_select / unique / bincount``
    (their output size depends on the data). Shapes, strides and host ints stay free to use.
    """
    saved = []
    for name in _TENSOR_METHODS:
        saved.append((torch.Tensor, name, getattr(torch.Tensor, name)))
    saved.append((torch.Tensor, "to", torch.Tensor.to))
    for name in _TORCH_FUNCTIONS:
        saved.append((torch, name, getattr(torch, name)))
    executor = None
    try:
        from triton.runtime import interpreter

        executor = interpreter.GridExecutor
        saved.append((executor, "__call__", executor.__call__))
    except ImportError:  # pragma: no cover - Triton without an interpreter
        pass
    from .. import topk_layout
    from ..backends.symm_refusal import RefusalMixin
    from ..symm import SymmBuffer

    saved.append((topk_layout, "host_numpy", topk_layout.host_numpy))

    polls = (SymmBuffer, RefusalMixin)
    saved.append((SymmBuffer, "check_status", SymmBuffer.check_status))
    saved += [(RefusalMixin, n, getattr(RefusalMixin, n)) for n in ("_check_refused", "poll_refused")]
    try:
        for owner, name, original in saved:
            if owner is topk_layout:
                setattr(owner, name, False)
            elif owner is executor or owner in polls:
                setattr(owner, name, _kernel_scope(original))
            elif name == "to":
                setattr(owner, name, _trapping_to(original))
            else:
                setattr(owner, name, _trapping(f"{getattr(owner, '__name__', owner)}.{name}", original))
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
