"""The Gluon (``triton.experimental.gluon``) names the sm90 kernels use, in one place: Gluon's API moves between
Triton releases, and every difference between the supported ones is resolved here, once, at import.

=====================  ==================================  ==================================
name here              Triton 3.6                          Triton 3.9
=====================  ==================================  ==================================
``tma_load``           ``tma.async_copy_global_to_shared``  ``tma.async_load`` (the old name raises)
``tma_store``          ``tma.async_copy_shared_to_global``  ``tma.async_store`` (the old name raises)
``GluonASTSource``     ``gluon._runtime.GluonASTSource``    same
=====================  ==================================  ==================================

``HAVE_GLUON`` is False (and ``GLUON_ERROR`` says why) when this Triton has no Gluon or no Hopper module; the
kernel module then cannot be imported, and the host keeps the ``tl`` kernel. A leaf: imports only Triton.
"""

from __future__ import annotations

__all__ = ["HAVE_GLUON", "GLUON_ERROR", "gluon", "gl", "tma", "mbarrier", "warpgroup_mma", "warpgroup_mma_wait",
           "fence_async_shared", "tma_load", "tma_store", "GluonASTSource", "is_gluon_kernel"]

GLUON_ERROR = ""
try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
except ImportError as exc:  # a Triton without Gluon (or without its Hopper module)
    HAVE_GLUON = False
    GLUON_ERROR = f"{type(exc).__name__}: {exc}"
    gluon = gl = GluonASTSource = tma = mbarrier = warpgroup_mma = warpgroup_mma_wait = fence_async_shared = None
    tma_load = tma_store = None
else:
    HAVE_GLUON = True
    # 3.9 renamed the TMA copies and made the old names raise, so the new names are looked up first.
    if hasattr(tma, "async_load"):
        tma_load, tma_store = tma.async_load, tma.async_store
    else:
        tma_load, tma_store = tma.async_copy_global_to_shared, tma.async_copy_shared_to_global


def is_gluon_kernel(kernel) -> bool:
    """Whether ``kernel`` is a ``@gluon.jit`` function (compiled through :data:`GluonASTSource`, not
    ``triton.compiler.ASTSource``)."""
    if not HAVE_GLUON:
        return False
    from triton.experimental.gluon._runtime import GluonJITFunction

    return isinstance(kernel, GluonJITFunction)
