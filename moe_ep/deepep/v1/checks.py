"""Call guards shared by :class:`moe_ep.Buffer`'s communication calls.

- :func:`_reports_refusal`: a call whose own argument checks raise tells its peers, so every rank raises at once.
- :class:`_CheckedLayout`: the routing tensors a :meth:`Buffer.get_dispatch_layout` has value-checked, so the
  dispatch that follows with the same, unmodified tensors skips the second (host-reading) value check.
"""

from __future__ import annotations

import functools
import weakref
from typing import Optional

import torch


def _reports_refusal(what: str):
    """A call whose own checks raise (ValueError / TypeError) before it met its peers tells them
    (backends that meet on the host), so every rank raises at once instead of waiting out the timeout."""
    def deco(method):
        @functools.wraps(method)
        def wrapper(self, *args, **kwargs):
            if self._destroyed:
                raise RuntimeError(f"moe_ep.Buffer.{what}: this Buffer was destroyed")
            mark = self._impl.arrival_mark()
            try:
                return method(self, *args, **kwargs)
            except (ValueError, TypeError) as exc:
                self._impl.refuse(what, mark, f"{type(exc).__name__}: {exc}")
                raise
        return wrapper
    return deco


class _CheckedLayout:
    """The routing tensors of the last value-checked :meth:`Buffer.get_dispatch_layout`: a dispatch given
    these very tensor objects, unmodified since (same version counter), needs no second value check.

    Tensor objects are held by weak reference and compared by identity, not address: a new tensor that
    the caching allocator placed at a freed one's address is a different object. Inference tensors (made
    under ``torch.inference_mode()``, as engines make every forward's tensors) have no version counter,
    so an in-place write since the check could not be told from no write: they are never remembered
    (:meth:`of` returns ``None``) and their dispatch checks the values again."""

    def __init__(self, num_experts: int, tensors: tuple):
        self.num_experts = num_experts
        self.refs = tuple(weakref.ref(t) for t in tensors)
        self.versions = tuple(t._version for t in tensors)

    @classmethod
    def of(cls, num_experts: int, *tensors: torch.Tensor) -> Optional["_CheckedLayout"]:
        if any(t.is_inference() for t in tensors):
            return None
        return cls(num_experts, tensors)

    def covers(self, num_experts: int, *tensors: torch.Tensor) -> bool:
        return (num_experts == self.num_experts and len(tensors) == len(self.refs)
                and all(r() is t for r, t in zip(self.refs, tensors))
                and all(not t.is_inference() and t._version == v for t, v in zip(tensors, self.versions)))
