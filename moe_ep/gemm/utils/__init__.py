"""DeepGEMM's ``deep_gemm.utils`` names that ``moe_ep.gemm`` offers: :mod:`.layout` (also re-exported here,
as DeepGEMM does with ``from .layout import *``)."""

from . import layout
from .layout import *  # noqa: F401,F403
from .layout import __all__ as _layout_all

__all__ = ["layout", *_layout_all]
