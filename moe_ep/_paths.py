"""The import paths of modules that moved into folders keep working: ``moe_ep.<old>`` is the module at its new
path, the same object (so ``monkeypatch.setattr`` through either path patches the one module).

:data:`MOVED` is the table, old path -> new path. :func:`install` (called by ``moe_ep/__init__.py``) puts a finder on
``sys.meta_path`` that answers the old names only; nothing is imported until a name is (``import moe_ep`` stays
light). Where to find what is written down in ``docs/architecture.md``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

__all__ = ["MOVED", "install", "old_attribute"]

MOVED = {
    # DeepEP V1's face: moe_ep/deepep/v1/
    "moe_ep.buffer": "moe_ep.deepep.v1.buffer",
    "moe_ep.buffer_checks": "moe_ep.deepep.v1.checks",
    "moe_ep.buffer_config": "moe_ep.deepep.v1.config",
    "moe_ep.buffer_ll": "moe_ep.deepep.v1.low_latency",
    "moe_ep.buffer_v1": "moe_ep.deepep.v1.compat",
    # DeepEP V2's face: moe_ep/deepep/v2/
    "moe_ep.elastic": "moe_ep.deepep.v2.buffer",
    "moe_ep.elastic_dispatch": "moe_ep.deepep.v2.dispatch",
    "moe_ep.elastic_handle": "moe_ep.deepep.v2.handle",
    "moe_ep.elastic_expand": "moe_ep.deepep.v2.expand",
    "moe_ep.elastic_memory": "moe_ep.deepep.v2.memory",
    "moe_ep.elastic_reduce": "moe_ep.deepep.v2.reduce",
    # the NVSHMEM host side: moe_ep/nvshmem/ (moe_ep.nvshmem itself kept its name: the package's __init__.py)
    "moe_ep.nvshmem_bitcode": "moe_ep.nvshmem.bitcode",
    "moe_ep.nvshmem_checks": "moe_ep.nvshmem.checks",
    "moe_ep.nvshmem_heap": "moe_ep.nvshmem.heap",
    # the MoE layer: moe_ep/layer/
    "moe_ep.moe": "moe_ep.layer.moe",
    "moe_ep.experts": "moe_ep.layer.experts",
    # DeepGEMM's faces together: moe_ep/gemm/
    "moe_ep.mega_moe": "moe_ep.gemm.mega_moe",
}


class _MovedLoader(importlib.abc.Loader):
    """Hands the import system the module at its new path (imported there, under its own name, once)."""

    def __init__(self, new: str):
        self.new = new
        self._spec = None

    def create_module(self, spec):
        module = importlib.import_module(self.new)
        self._spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        # Already executed under its new name. The import system has just set ``__spec__`` to the old name's
        # spec: give the module back its own, so that it still names its new path.
        module.__spec__ = self._spec


class _MovedFinder(importlib.abc.MetaPathFinder):
    """Answers the old paths of :data:`MOVED`; every other name is left to the finders after it."""

    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _MovedLoader(new), is_package=False)


_finder = _MovedFinder()


def install() -> None:
    """Puts the finder first on ``sys.meta_path`` (once): the old paths resolve before any file is looked for."""
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def old_attribute(name: str):
    """``moe_ep.<name>`` for an old module name (``moe_ep.buffer`` without importing it first, as before the
    move); ``None`` for a name that is not one."""
    old = f"moe_ep.{name}"
    if old not in MOVED:
        return None
    return importlib.import_module(old)
