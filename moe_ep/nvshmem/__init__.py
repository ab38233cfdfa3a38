"""NVSHMEM host side of the ``nvshmem`` backend: device bitcode, availability checks, symmetric heap, module init.

The low-latency kernels reach peers on other nodes through NVSHMEM device calls (declared in
:mod:`moe_ep.kernels.nvshmem_device`). On a GPU that needs four things from the host, all importable from here
(each name lives in one of three modules, by responsibility):

- :mod:`moe_ep.nvshmem.bitcode`, the device library: :func:`find_device_bitcode` / :func:`extern_libs` /
  :func:`launch_options` (the NVSHMEM LLVM bitcode Triton links into every kernel that calls NVSHMEM),
  :func:`check_triton_link` (this Triton's LLVM can read it), :func:`check_ibgda_bitcode`, the version readers,
  :class:`NvshmemUnavailableError` and the pinned wheel (:data:`WHEEL`, :data:`WHEEL_VERSION`); its docstring has
  the table of which bitcode links with which Triton.
- :mod:`moe_ep.nvshmem.checks`, the environment: :func:`check_available` raises one
  :class:`NvshmemUnavailableError` naming everything that is missing (wheel, a Triton that links the bitcode, GPU,
  driver, torch build, IBGDA) and how to fix each, before anything is allocated; the ``check_*`` it gathers.
- :mod:`moe_ep.nvshmem.heap`: :func:`create_nvshmem_heap` (the symmetric heap from torch symmetric memory's NVSHMEM
  backend, as a :class:`moe_ep.symm.SymmBuffer` with ``provider="nvshmem"``) and :func:`register_kernels` (every
  compiled specialisation of the given ``@triton.jit`` functions gets its CUDA module initialised for NVSHMEM,
  ``nvshmemx_cumodule_init``, once per module).

The names here are the same objects as in those modules; a module reads its helpers from its own namespace, so
replace one (``monkeypatch.setattr``) in the module that calls it, not here. Nothing here imports Triton or touches
CUDA at import time.
"""

from __future__ import annotations

from .bitcode import (  # noqa: F401 - the private names too: every name of this module before the split
    _BC,
    _CHAR6,
    INSTALL_HINT,
    MAXNREG,
    NVSHMEM_BITCODE,
    TRITON_LLVM,
    WHEEL,
    WHEEL_VERSION,
    NvshmemUnavailableError,
    _arch_number,
    _Bits,
    _describe,
    _launch_options,
    _libtriton_llvm,
    _nvshmem_for,
    _owner_versions,
    _pick,
    _producer,
    _trial_link,
    _triton_for,
    _version_in_file,
    _vt,
    _wheel_lib_dir,
    bitcode_has_ibgda,
    bitcode_llvm_version,
    bitcode_nvshmem_version,
    check_ibgda_bitcode,
    check_triton_link,
    extern_libs,
    find_device_bitcode,
    launch_options,
    search_dirs,
    triton_llvm_version,
    triton_version,
)
from .checks import (  # noqa: F401
    DRIVER_PARAMS,
    GDRDRV,
    IBGDA_DRIVER_OPTIONS,
    MIN_DRIVER_BRANCH,
    _cuda_available,
    _driver_params,
    _ptxas_cuda_major,
    check_available,
    check_cuda_device,
    check_driver,
    check_host_library,
    check_ibgda,
    check_torch_nvshmem,
    check_wheel,
    driver_cuda_version,
    required_driver_cuda_version,
)
from .heap import (  # noqa: F401
    _INITIALISED,
    _PENDING,
    _REGISTERED,
    _STATE,
    _compiled_kernels,
    _cumodule_init,
    _heap_ready,
    _init_kernel,
    _on_unload,
    _PostCompileHook,
    _reset_for_tests,
    _select_backend,
    create_nvshmem_heap,
    register_kernels,
    registered_kernels,
)

__all__ = ["WHEEL", "WHEEL_VERSION", "INSTALL_HINT", "MIN_DRIVER_BRANCH", "NvshmemUnavailableError",
           "search_dirs", "find_device_bitcode", "extern_libs", "launch_options", "MAXNREG", "driver_cuda_version",
           "required_driver_cuda_version",
           "check_wheel", "check_cuda_device", "check_triton_link", "check_ibgda_bitcode",
           "bitcode_llvm_version", "triton_llvm_version", "bitcode_nvshmem_version", "bitcode_has_ibgda",
           "TRITON_LLVM", "NVSHMEM_BITCODE", "check_driver", "check_torch_nvshmem", "check_ibgda",
           "check_host_library", "check_available", "create_nvshmem_heap", "register_kernels", "registered_kernels"]
