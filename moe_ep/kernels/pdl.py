"""Programmatic dependent launch (PDL) for Triton kernels: when it can be used, and how to launch.

PDL (Hopper and later, Triton >= 3.4) lets a kernel start while the previous kernel in the stream is
still draining. The dependent kernel calls ``tl.extra.cuda.gdc_wait()`` before its first read of
anything the previous kernel wrote, and ``tl.extra.cuda.gdc_launch_dependents()`` once it has issued
its last write, so the next kernel can in turn be scheduled early. Both instructions are no-ops when
the kernel was launched without PDL, so the kernel code is the same either way.

NOTES: the Triton interpreter implements neither GDC call, so kernels guard them with a ``USE_PDL``
constexpr and the launcher passes ``USE_PDL=False`` (and no ``launch_pdl``) everywhere PDL is not
supported: CPU tensors, the interpreter, pre-Hopper GPUs, Triton < 3.4, ROCm. PDL is a scheduling
hint only: results are identical with and without it.
"""

from __future__ import annotations

import functools
import os

import torch
import triton

__all__ = ["INTERPRET", "pdl_launch_kwargs", "pdl_supported"]

# Read once, when this module (and the kernels importing it) is imported: the same moment at which
# ``@triton.jit`` decides between compiling and interpreting.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _triton_version() -> tuple[int, int]:
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


@functools.cache
def _device_supports_pdl(index: int) -> bool:
    if torch.version.hip is not None:
        return False
    major, _ = torch.cuda.get_device_capability(index)
    return major >= 9


def pdl_supported(device: torch.device) -> bool:
    """True when a kernel on ``device`` can be launched with ``launch_pdl=True``."""
    if INTERPRET or device.type != "cuda" or _triton_version() < (3, 4):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_supports_pdl(index)


def pdl_launch_kwargs(use_pdl: bool, device: torch.device) -> dict:
    """Extra kernel-launch keywords: ``USE_PDL`` (the kernel's constexpr) and ``launch_pdl``.

    ``use_pdl=True`` on a device or Triton without PDL falls back to a plain launch (same results).
    """
    if use_pdl and pdl_supported(device):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}
