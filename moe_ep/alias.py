"""Opt-in aliases: ``import deep_ep`` / ``import deep_gemm`` resolve to moe-ep's faces in this process.

    import moe_ep.alias
    moe_ep.alias.install()          # before the engine imports deep_ep / deep_gemm
    import deep_ep, deep_gemm       # moe_ep (Buffer, Config, EventOverlap, ElasticBuffer, ...) and moe_ep.gemm

or, without editing the engine, ``MOE_EP_ALIAS=deep_ep,deep_gemm python -m moe_ep.alias engine.py [args]`` (runs
the script as ``__main__`` after installing the named aliases; ``torchrun --nproc-per-node 2 -m moe_ep.alias
engine.py`` too). On a machine without CUDA it sets ``TRITON_INTERPRET=1`` first (unless set), as ``python -m moe_ep
demo`` does. ``MOE_EP_BACKEND=symm`` (or ``torch`` / ``nvshmem``) picks the backend ``Buffer(backend="auto")`` means,
for engine code that passes none.

Submodules resolve to the module moe-ep already has, never a second copy: ``deep_ep.buffer`` is
``moe_ep.deepep.v1.buffer``, ``deep_ep.utils`` is :mod:`moe_ep.events` (``EventOverlap``, ``EventHandle``),
``deep_gemm.utils`` (``.layout``, ``.math``) is :mod:`moe_ep.gemm.utils`; ``from deep_ep import utils`` and
``from deep_gemm import utils`` give those modules too (installing ``deep_ep`` sets ``moe_ep.utils`` to
:mod:`moe_ep.events`, as the import system sets a package's attribute for each submodule).

A name is aliased only when no real package of that name can be imported: a user who has DeepEP or DeepGEMM
installed gets them (:func:`install` says so in its return value and warns once), unless ``force=True``. The
aliases are entries of ``sys.modules`` of this process only: nothing is written anywhere.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import logging
import os
import runpy
import sys
import warnings

_log = logging.getLogger(__name__)

__all__ = ["install", "ALIASES"]

# alias -> (module it resolves to, submodules whose moe-ep module has another name). Every other
# ``alias.X.Y`` resolves to ``target.X.Y``: the module object already imported under its own name (never executed
# a second time).
ALIASES = {
    "deep_ep": ("moe_ep", {"utils": "moe_ep.events", "buffer": "moe_ep.deepep.v1.buffer"}),
    "deep_gemm": ("moe_ep.gemm", {}),
}


def _target_of(fullname: str) -> str | None:
    """The moe-ep module an aliased name stands for (``None``: not an alias this process installed)."""
    top, _, rest = fullname.partition(".")
    if top not in _installed:
        return None
    target, subs = ALIASES[top]
    if not rest:
        return target
    for sub in sorted(subs, key=len, reverse=True):  # the longest renamed prefix
        if rest == sub or rest.startswith(sub + "."):
            return subs[sub] + rest[len(sub):]
    return f"{target}.{rest}"


class _AliasLoader(importlib.abc.Loader):
    """Hands the import system the moe-ep module itself (imported under its own name, once)."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module) -> None:
        pass  # already executed under its own name


class _AliasFinder(importlib.abc.MetaPathFinder):
    """``deep_ep.X`` / ``deep_gemm.X`` -> the module ``moe_ep.X`` / ``moe_ep.gemm.X`` (see :data:`ALIASES`)."""

    def find_spec(self, fullname, path=None, target=None):
        name = _target_of(fullname)
        if name is None or "." not in fullname:
            return None
        if importlib.util.find_spec(name) is None:
            return None
        mod = importlib.import_module(name)
        return importlib.util.spec_from_loader(fullname, _AliasLoader(name),
                                               is_package=hasattr(mod, "__path__"))


_installed: set = set()
_finder = _AliasFinder()


def _real_package(name: str) -> str | None:
    """Where a real (non-alias) package ``name`` would import from, or None."""
    mod = sys.modules.get(name)
    if mod is not None:
        return None if getattr(mod, "__moe_ep_alias__", False) else (getattr(mod, "__file__", None) or "<loaded>")
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return None if spec is None else (spec.origin or "<namespace package>")


def install(names=("deep_ep", "deep_gemm"), *, force: bool = False) -> dict:
    """Alias each of ``names`` (``"deep_ep"``, ``"deep_gemm"``) to moe-ep's module in ``sys.modules``.

    Returns ``{name: "moe_ep..." | "real package at <path> (not aliased)"}``. ``force=True`` aliases even where a
    real package is importable (this process then never sees it)."""
    out = {}
    for name in names:
        if name not in ALIASES:
            raise ValueError(f"unknown alias {name!r}: choose from {sorted(ALIASES)}")
        target, subs = ALIASES[name]
        real = _real_package(name)
        if real is not None and not force:
            _log.info("a real %r is installed (%s): used, not aliased", name, real)
            warnings.warn(f"moe_ep.alias: a real {name!r} is installed ({real}); it is used, not aliased "
                          "(install(force=True) aliases anyway)", stacklevel=2)
            out[name] = f"real package at {real} (not aliased)"
            continue
        mod = importlib.import_module(target)
        _log.info("import %s resolves to %s in this process", name, target)
        mod.__moe_ep_alias__ = True
        sys.modules[name] = mod
        _installed.add(name)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
        for sub, sub_target in subs.items():  # renamed submodules, there at once
            sys.modules[f"{name}.{sub}"] = sub_mod = importlib.import_module(sub_target)
            # ``from deep_ep import utils`` reads the attribute of the package object (``moe_ep``), as the import
            # system sets it for a submodule: the renamed one is set likewise (never over a name moe_ep has)
            if getattr(mod, sub, sub_mod) is sub_mod:
                setattr(mod, sub, sub_mod)
        out[name] = target
    return out


def main(argv=None) -> int:
    from . import __version__
    from ._env import write_stdout

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--version":
        return write_stdout(f"moe-ep {__version__} (moe_ep.alias)")
    if not argv or argv[0] in ("-h", "--help"):
        rc = write_stdout("usage: python -m moe_ep.alias [--version] SCRIPT [ARGS...]\n" + __doc__)
        return rc or (0 if argv else 2)
    import torch

    if not torch.cuda.is_available():  # as `python -m moe_ep demo`: the Triton kernels run on the interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")
    names = [n for n in os.environ.get("MOE_EP_ALIAS", "deep_ep,deep_gemm").split(",") if n]
    install(names)
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
