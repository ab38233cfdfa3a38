"""The base of every error class moe-ep defines: ``except moe_ep.MoEEPError`` catches any of them.

Each class keeps its standard base too (``RankTimeoutError`` is still a ``TimeoutError``, ``CallMismatchError`` a
``ValueError``, ...), so ``except`` clauses written for those keep working. Standard library only: ``eplb`` and
``microbatch`` import it without anything else of ``moe_ep``'s.
"""

from __future__ import annotations

__all__ = ["MoEEPError"]


class MoEEPError(Exception):
    """Base of the error classes of ``moe_ep``, ``eplb`` and ``microbatch`` (``serving``, which needs neither
    torch nor ``moe_ep``, has its own: ``serving.ServingError``)."""
