"""Availability checks of the ``nvshmem`` backend: everything besides the bitcode that must be in place (GPU, driver,
torch built with NVSHMEM, IBGDA, one NVSHMEM release), gathered by :func:`check_available`.

- :func:`check_available`: one :class:`~moe_ep.nvshmem.bitcode.NvshmemUnavailableError` naming everything that is
  missing (wheel, a Triton that links the bitcode, GPU, driver, torch build, IBGDA) and how to fix each, raised before
  anything is allocated.
- Each ``check_*`` returns ``None`` when fine, else one line: what is missing and how to fix it. The bitcode's own
  checks (:func:`~moe_ep.nvshmem.bitcode.check_triton_link`, :func:`~moe_ep.nvshmem.bitcode.check_ibgda_bitcode`)
  live in :mod:`moe_ep.nvshmem.bitcode`.

Nothing here imports Triton or touches CUDA at import time. Part of :mod:`moe_ep.nvshmem`, which re-exports every
name.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import re
import subprocess
from typing import Optional

from .bitcode import (
    WHEEL,
    NvshmemUnavailableError,
    _arch_number,
    _owner_versions,
    _version_in_file,
    check_ibgda_bitcode,
    check_triton_link,
    find_device_bitcode,
)

__all__ = ["MIN_DRIVER_BRANCH", "driver_cuda_version", "required_driver_cuda_version", "check_wheel",
           "check_cuda_device", "check_driver", "check_torch_nvshmem", "check_ibgda", "check_host_library",
           "check_available"]

#: CUDA 13.x runs on driver branch 580 or newer (minor version compatibility; NVIDIA, "CUDA Compatibility",
#: docs.nvidia.com/deploy/cuda-compatibility/minor-version-compatibility.html, table "CUDA Toolkit 11.x, 12.x, and
#: 13.x Minimum and Maximum Required Driver Versions": CUDA 13.x >= 580, CUDA 12.x >= 525).
MIN_DRIVER_BRANCH = {12: 525, 13: 580}
#: where the NVIDIA kernel module reports its load-time options (read for the IBGDA driver settings)
DRIVER_PARAMS = "/proc/driver/nvidia/params"
#: GDRCopy's device node: CPU-assisted IBGDA works without the driver options when gdrdrv is loaded
GDRDRV = "/dev/gdrdrv"
IBGDA_DRIVER_OPTIONS = 'options nvidia NVreg_EnableStreamMemOPs=1 NVreg_RegistryDwords="PeerMappingOverride=1;"'


# ---------------------------------------------------------------------------------------------- checks
# Each returns None when fine, else one line: what is missing and how to fix it. check_available gathers them.
def check_wheel(arch=90) -> Optional[str]:
    try:
        find_device_bitcode(arch)
    except FileNotFoundError as exc:
        return f"NVSHMEM device library: {exc}"
    return None


def _cuda_available() -> bool:
    import torch

    return torch.version.cuda is not None and torch.cuda.is_available()


def check_cuda_device(device=None) -> Optional[str]:
    import torch

    if torch.version.cuda is None:
        return (f"no CUDA device: this torch ({torch.__version__}) is a CPU build; the nvshmem backend needs NVIDIA "
                "GPUs and a CUDA build of torch (on CPU, its kernels run emulated under TRITON_INTERPRET=1 with the "
                "shm provider, as the tests do)")
    if not _cuda_available():
        return ("no CUDA device: torch.cuda.is_available() is False (no GPU visible: check nvidia-smi and "
                "CUDA_VISIBLE_DEVICES)")
    if device is not None:
        dev = torch.device(device)
        if dev.type != "cuda":
            return f"device {dev} is not a CUDA device; pass a cuda device"
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            return f"device {dev} does not exist: {torch.cuda.device_count()} CUDA device(s) visible"
    return None


def driver_cuda_version() -> Optional[int]:
    """The CUDA version the installed driver supports (``cuDriverGetVersion``: 13000 for 13.0), or ``None``
    when no driver library can be loaded. Does not initialise CUDA."""
    for name in ("libcuda.so.1", ctypes.util.find_library("cuda")):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        v = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(v)) == 0 and v.value > 0:
            return v.value
    return None


@functools.lru_cache(maxsize=None)
def _ptxas_cuda_major(arch: int = 90) -> Optional[int]:
    """CUDA major version of the ptxas Triton compiles ``arch`` with (Triton 3.9: its bundled ``ptxas`` 12.9 below
    sm_90, ``ptxas-blackwell`` 13.4 from sm_90 on; ``TRITON_PTXAS[_BLACKWELL]_PATH`` override them)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError:
        return None
    try:
        tool = get_ptxas(arch)
    except TypeError:  # older Triton: get_ptxas() takes no architecture
        tool = get_ptxas()
    except RuntimeError:  # no ptxas found
        return None
    version = getattr(tool, "version", None)
    if version is None:
        try:
            out = subprocess.run([tool.path, "--version"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            return None
        m = re.search(r"release (\d+)\.(\d+)", out)
        version = m.group(0).split()[-1] if m else None
    m = re.match(r"(\d+)", str(version or ""))
    return int(m.group(1)) if m else None


def required_driver_cuda_version(arch: int = 90) -> int:
    """Lowest ``cuDriverGetVersion`` value that loads the cubins this Triton emits for ``arch``: the CUDA major of
    the ptxas it uses (13 for sm_90 with Triton 3.9's bundled 13.4 ptxas) times 1000. Minor version
    compatibility lets a driver of the same major load cubins of a later minor release."""
    return (_ptxas_cuda_major(_arch_number(arch)) or 13) * 1000


def check_driver(arch=90) -> Optional[str]:
    have, need = driver_cuda_version(), required_driver_cuda_version(arch)
    major = need // 1000
    branch = MIN_DRIVER_BRANCH.get(major)
    branch_txt = f"driver branch {branch} or newer" if branch else f"a driver for CUDA {major}.x"
    if have is None:
        return (f"no CUDA driver: libcuda.so.1 cannot be loaded; install the NVIDIA driver ({branch_txt}, "
                f"for the CUDA {major}.x cubins Triton compiles)")
    if have < need:
        return (f"CUDA driver too old: it supports CUDA {have // 1000}.{have % 1000 // 10}, but Triton compiles "
                f"with a CUDA {major}.x ptxas and its cubins need {branch_txt} (NVIDIA's CUDA compatibility table: "
                f"CUDA 13.x needs >= 580, CUDA 12.x >= 525); upgrade the driver, or use a Triton whose ptxas matches "
                "it (TRITON_PTXAS_BLACKWELL_PATH / TRITON_PTXAS_PATH = an older CUDA's bin/ptxas)")
    return None


def check_torch_nvshmem() -> Optional[str]:
    try:
        from torch.distributed import _symmetric_memory as symm_mem
    except ImportError:
        return ("torch has no torch.distributed._symmetric_memory: install torch >= 2.8 built with CUDA (PyPI's "
                "Linux CUDA wheels include NVSHMEM)")
    if not hasattr(symm_mem, "is_nvshmem_available") or not symm_mem.is_nvshmem_available():
        return ("torch was built without NVSHMEM symmetric memory, or cannot load it "
                "(torch.distributed._symmetric_memory.is_nvshmem_available() is False): use a PyPI CUDA build of "
                "torch >= 2.8 on Linux (it depends on an nvidia-nvshmem wheel), and check that libnvshmem_host.so.3 "
                "loads")
    return None


def _driver_params() -> Optional[str]:
    try:
        with open(DRIVER_PARAMS) as f:
            return f.read()
    except OSError:
        return None


def check_ibgda() -> Optional[str]:
    """IBGDA (GPU-initiated RDMA) for internode traffic: the environment asks NVSHMEM for it, and the driver
    allows it (or GDRCopy's gdrdrv provides CPU-assisted IBGDA). The driver part is checked only where
    ``/proc/driver/nvidia/params`` can be read."""
    problems = []
    if os.environ.get("NVSHMEM_IB_ENABLE_IBGDA", "").strip().lower() not in ("1", "true", "yes", "on"):
        problems.append("NVSHMEM_IB_ENABLE_IBGDA=1 is not set: export it in every rank's environment before the "
                        "process starts (NVSHMEM reads it when the heap is created); without it internode puts go "
                        "through a CPU proxy thread")
    params = _driver_params()
    if params is not None and not os.path.exists(GDRDRV):
        mem_ops = re.search(r"EnableStreamMemOPs:\s*(\d+)", params)
        dwords = re.search(r"RegistryDwords:\s*\"?([^\n\"]*)", params)
        ok_ops = mem_ops is not None and mem_ops.group(1) == "1"
        ok_peer = dwords is not None and re.search(r"PeerMappingOverride\s*=\s*1", dwords.group(1)) is not None
        if not (ok_ops and ok_peer):
            problems.append(
                f"the NVIDIA driver is not loaded with the IBGDA options ({DRIVER_PARAMS}: EnableStreamMemOPs="
                f"{mem_ops.group(1) if mem_ops else '?'}, PeerMappingOverride {'set' if ok_peer else 'not set'}): "
                f"add `{IBGDA_DRIVER_OPTIONS}` to /etc/modprobe.d/nvidia.conf, run `update-initramfs -u` and reboot "
                "(as DeepEP's NVSHMEM install notes say), or install GDRCopy and load gdrdrv for CPU-assisted IBGDA")
    if not problems:
        return None
    return "IBGDA (internode RDMA without a CPU proxy) is not enabled: " + "; ".join(problems)


def check_host_library(arch=90) -> Optional[str]:
    """The bitcode and the NVSHMEM host library next to it (the one torch's PyPI build loads) come from the same
    release. ``nvidia-nvshmem-cu12`` and torch's ``nvidia-nvshmem-cu13`` install into the same directory, so
    having both leaves one release's bitcode beside the other's host library."""
    try:
        bitcode = find_device_bitcode(arch)
    except FileNotFoundError:
        return None  # check_wheel reports it
    host = os.path.join(os.path.dirname(bitcode), "libnvshmem_host.so.3")
    owners = _owner_versions(bitcode)
    host_v = _version_in_file(host) if os.path.exists(host) else None
    if not owners or host_v is None:
        return None  # not a wheel install, or no host library beside it: nothing to compare
    bc_v = owners[0][1]
    if bc_v.split(".")[:2] != host_v.split(".")[:2]:
        return (f"mixed NVSHMEM releases in {os.path.dirname(bitcode)}: the device bitcode {os.path.basename(bitcode)} "
                f"is {owners[0][0]} {bc_v} but libnvshmem_host.so.3 there is {host_v} (two nvidia-nvshmem wheels "
                "installed into the same directory, e.g. torch's nvidia-nvshmem-cu13 and moe-ep's "
                f"{WHEEL}): reinstall the one whose version torch was built against last (`pip install "
                "--force-reinstall --no-deps nvidia-nvshmem-cuXX==<version>`), or point NVSHMEM_LIB_DIR at a "
                "directory with matching files")
    return None


def check_available(device=None, *, internode: bool = True, arch=None) -> str:
    """Raise one :class:`NvshmemUnavailableError` naming everything that keeps the ``nvshmem`` backend from running
    here, with the fix for each; return the device bitcode path when nothing is missing. Allocates nothing.

    Arguments:
        device: the CUDA device the heap will live on (default: the current one).
        internode: the group spans nodes, so IBGDA is required too.
        arch: compute capability of the bitcode (default: the device's; 90 when there is no device).
    """
    problems = []
    cuda_msg = check_cuda_device(device)
    if cuda_msg is not None:
        problems.append(("cuda", cuda_msg))
    if arch is None:
        arch = 90
        if cuda_msg is None:
            import torch

            arch = torch.cuda.get_device_capability(device)
    msg = check_wheel(arch)
    if msg is not None:
        problems.append(("wheel", msg))
    else:
        for key, check in (("host-library", check_host_library), ("triton", check_triton_link)):
            msg = check(arch)
            if msg is not None:
                problems.append((key, msg))
        if internode:
            msg = check_ibgda_bitcode(arch)
            if msg is not None:
                problems.append(("ibgda", msg))
    if cuda_msg is None:
        for key, msg in (("driver", check_driver(arch)), ("torch", check_torch_nvshmem())):
            if msg is not None:
                problems.append((key, msg))
    if internode:
        msg = check_ibgda()
        if msg is not None:
            problems.append(("ibgda", msg))
    if problems:
        raise NvshmemUnavailableError(problems)
    return find_device_bitcode(arch)
