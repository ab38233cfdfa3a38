"""The NVSHMEM symmetric heap and the NVSHMEM initialisation of compiled kernel modules.

- :func:`create_nvshmem_heap`: the symmetric heap from torch symmetric memory's NVSHMEM backend, as a
  :class:`moe_ep.symm.SymmBuffer` (``provider="nvshmem"``), after :func:`moe_ep.nvshmem.checks.check_available`.
- :func:`register_kernels`: every compiled specialisation of the given ``@triton.jit`` functions gets its CUDA
  module initialised for NVSHMEM (``nvshmemx_cumodule_init``), once per module.

Nothing here imports Triton or touches CUDA at import time. Part of :mod:`moe_ep.nvshmem`, which re-exports every
name.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

from .bitcode import NvshmemUnavailableError
from .checks import check_available

__all__ = ["create_nvshmem_heap", "register_kernels", "registered_kernels"]


# ---------------------------------------------------------------------------------------------- heap
def _select_backend(symm_mem, device) -> None:
    """Make NVSHMEM torch symmetric memory's backend for ``device`` (a process-wide setting, fixed once any
    symmetric tensor has been allocated)."""
    current = None
    try:
        current = symm_mem.get_backend(device)
    except Exception:  # noqa: BLE001 - older torch: no get_backend
        pass
    if current == "NVSHMEM":
        return
    try:
        symm_mem.set_backend("NVSHMEM")
    except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError with its own wording
        raise NvshmemUnavailableError([("backend", (
            f"torch symmetric memory cannot switch to its NVSHMEM backend (current backend: {current!r}; {exc}): the "
            "backend is fixed once a symmetric tensor exists in this process, so create the nvshmem Buffer before "
            "any symm Buffer or other symmetric-memory user"))]) from exc


def create_nvshmem_heap(group, nbytes: int, num_signals: int, timeout_s: float = 60.0, *, device=None,
                        internode: bool = True):
    """Collectively allocate this rank's symmetric heap over ``group`` from torch symmetric memory's NVSHMEM
    backend (every rank calls it with the same sizes). GPUs only; :func:`check_available` runs first, so a
    missing piece raises before anything is allocated.

    Returns a :class:`moe_ep.symm.SymmBuffer` with ``provider == "nvshmem"``, the same layout as the other
    providers (data ``[0, nbytes)``, then ``num_signals`` int32 signal words at a 256-byte aligned offset, zeroed),
    and these NVSHMEM specifics:

    - ``buffer_ptrs[r]`` / ``signal_ptrs[r]``: rank ``r``'s region mapped into this process when ``r`` is reachable
      by loads and stores (same node, NVLink / P2P: ``nvshmem_ptr`` of the rendezvous handle), **0 otherwise**; a
      kernel takes the peer-pointer path for nonzero entries and NVSHMEM puts for the others.
    - ``symmetric_base``: this rank's own region address; NVSHMEM device calls take addresses in the caller's
      heap (``symmetric_base + offset``) and a PE, and write the same offset of that PE's heap.
    - ``pe``: int32 ``[world_size]`` on the device, the NVSHMEM PE of each group rank (torch initialises NVSHMEM
      over the default group, so the PE is the global rank); ``pe_list`` the same as Python ints.
    - ``reachable``: Python list of bools, ``buffer_ptrs[r] != 0``.

    Kernels registered with :func:`register_kernels` and compiled before this call are initialised now.
    """
    import torch
    import torch.distributed as dist

    from ..symm import SymmBuffer, _align, _create_cuda
    from ..sync import ArrivalCheck

    if not isinstance(nbytes, int) or nbytes < 0 or not isinstance(num_signals, int) or num_signals < 0:
        raise ValueError(f"nbytes and num_signals must be non-negative ints, got {nbytes!r}, {num_signals!r}")
    if not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
        raise ValueError(f"timeout_s must be a positive number, got {timeout_s!r}")
    if not dist.is_initialized():
        raise RuntimeError("create_nvshmem_heap needs torch.distributed to be initialised")
    check_available(device, internode=internode)
    from torch.distributed import _symmetric_memory as symm_mem

    group = group if group is not None else dist.group.WORLD
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    _select_backend(symm_mem, device)
    arrival = ArrivalCheck(group, rank, world_size, timeout_s)
    data = _align(nbytes)  # what every rank maps, compared as create_symm_buffer compares it
    total = data + _align(4 * max(num_signals, 1))
    arrival.arrive("nvshmem heap creation", fields={"nbytes (num_rdma_bytes rounded up to 256)": data,
                                                    "num_signals": num_signals})
    # the cuda provider's allocation (empty, zero, rendezvous), now over the NVSHMEM backend
    region, addrs, keepalive = _create_cuda(group, rank, world_size, total, device, arrival)
    if len(addrs) != world_size or addrs[rank] != region.data_ptr():
        raise RuntimeError(f"torch symmetric memory returned {len(addrs)} peer addresses (own: {addrs[rank:rank + 1]}) "
                           f"for a group of {world_size} (own region at {region.data_ptr():#x}): unexpected backend")
    buf = SymmBuffer(rank=rank, world_size=world_size, nbytes=data, num_signals=num_signals, region=region,
                     peer_addrs=addrs, provider="nvshmem", timeout_s=timeout_s, keepalive=(*keepalive, region),
                     arrival=arrival)
    reachable = [a != 0 for a in addrs]
    # SymmBuffer offsets every entry; a peer without a mapping keeps 0 in the signal table too.
    buf.signal_ptrs = torch.where(torch.tensor(reachable, device=device), buf.signal_ptrs,
                                  torch.zeros_like(buf.signal_ptrs))
    buf.reachable = reachable
    buf.symmetric_base = region.data_ptr()
    buf.pe_list = [dist.get_global_rank(group, r) for r in range(world_size)]
    buf.pe = torch.tensor(buf.pe_list, dtype=torch.int32, device=device)
    _heap_ready()
    return buf


# ---------------------------------------------------------------------------------------------- module init
# JITFunctions whose compiled modules need nvshmemx_cumodule_init, by id (JITFunction.__hash__ hashes its source)
_REGISTERED: dict = {}
_INITIALISED: set = set()  # CUmodule handles already initialised
_PENDING: list = []  # compiled kernels seen before NVSHMEM was initialised
_STATE = {"ready": False, "installed": None}


def _cumodule_init(module: int) -> None:
    try:
        from torch._C._distributed_c10d import _nvshmemx_cumodule_init
    except ImportError as exc:
        raise NvshmemUnavailableError([("torch", "this torch has no _nvshmemx_cumodule_init (built without NVSHMEM): "
                                        "use a PyPI CUDA build of torch >= 2.8")]) from exc
    _nvshmemx_cumodule_init(module)


def _init_kernel(kernel) -> None:
    """Initialise the CUDA module of one compiled kernel (loading it first), once per module."""
    if not _STATE["ready"]:
        if not any(k is kernel for k in _PENDING):
            _PENDING.append(kernel)
        return
    kernel.run  # noqa: B018 - the property loads the module (Triton loads lazily)
    module = kernel.module
    if module is None or module in _INITIALISED:
        return
    _cumodule_init(module)
    _INITIALISED.add(module)


def _heap_ready() -> None:
    """NVSHMEM is initialised in this process: initialise the modules compiled before."""
    _STATE["ready"] = True
    pending, _PENDING[:] = list(_PENDING), []
    for kernel in pending:
        _init_kernel(kernel)


def _compiled_kernels(fn) -> list:
    """Every compiled specialisation of a JITFunction, on every device."""
    out = []
    for entry in getattr(fn, "device_caches", {}).values():
        cache = entry[0] if isinstance(entry, tuple) else entry
        out += [k for k in cache.values() if hasattr(k, "asm")]
    return out


def _on_unload(module, *args, **kwargs) -> None:
    _INITIALISED.discard(module)


class _PostCompileHook:
    """Triton's ``jit_post_compile_hook``: calls the hook it replaced, then initialises the new kernel's module
    when its function is registered."""

    def __init__(self, previous: Optional[Callable]):
        self.previous = previous

    def __call__(self, *args, **kwargs):
        result = self.previous(*args, **kwargs) if self.previous is not None else None
        info = kwargs.get("fn")
        fn = getattr(info, "jit_function", None)
        if fn is not None and _REGISTERED.get(id(fn)) is fn:
            device = kwargs.get("compile", {}).get("device")
            entry = fn.device_caches[device]
            cache = entry[0] if isinstance(entry, tuple) else entry
            kernel = cache.get(kwargs.get("key"))
            if kernel is not None and hasattr(kernel, "asm"):
                _init_kernel(kernel)
        return result


def register_kernels(*jit_functions) -> None:
    """Initialise NVSHMEM (``nvshmemx_cumodule_init``) in the CUDA module of every compiled specialisation of
    ``jit_functions``: those compiled already, and every later one through Triton's
    ``triton.knobs.runtime.jit_post_compile_hook`` (installed once; a hook set before is kept and called first).
    Modules compiled before the NVSHMEM heap exists are initialised when :func:`create_nvshmem_heap` runs (NVSHMEM
    must be initialised first). Idempotent."""
    import triton
    from triton.runtime.jit import JITFunction

    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - every Triton with an interpreter has it
        InterpretedFunction = ()
    for fn in jit_functions:
        if not isinstance(fn, (JITFunction, InterpretedFunction)):
            raise TypeError(f"register_kernels takes @triton.jit functions, got {type(fn).__name__}")
    # Under TRITON_INTERPRET=1 nothing is compiled (the device calls are emulated): nothing to initialise.
    jit_functions = [fn for fn in jit_functions if isinstance(fn, JITFunction)]
    knobs = triton.knobs.runtime
    if _STATE["installed"] is None or knobs.jit_post_compile_hook is not _STATE["installed"]:
        _STATE["installed"] = _PostCompileHook(knobs.jit_post_compile_hook)
        knobs.jit_post_compile_hook = _STATE["installed"]
        unload = getattr(knobs, "kernel_unload_hook", None)
        if hasattr(unload, "add"):
            unload.add(_on_unload)
    for fn in jit_functions:
        _REGISTERED[id(fn)] = fn
        for kernel in _compiled_kernels(fn):
            _init_kernel(kernel)


def registered_kernels() -> list:
    """The functions passed to :func:`register_kernels` so far."""
    return sorted(_REGISTERED.values(), key=lambda f: getattr(f, "__name__", ""))


def _reset_for_tests(ready: bool = False, functions: Iterable = ()) -> None:
    """Forget registrations and initialised modules (tests only)."""
    _REGISTERED.clear()
    _REGISTERED.update({id(f): f for f in functions})
    _INITIALISED.clear()
    _PENDING.clear()
    _STATE["ready"] = ready
