"""DeepGEMM's ``deep_gemm.utils`` names that ``moe_ep.gemm`` offers: :mod:`.layout` and :mod:`.math` (both also
re-exported here, as DeepGEMM does with ``from .layout import *`` / ``from .math import *``)."""

from . import layout, math
from .layout import *  # noqa: F401,F403
from .layout import __all__ as _layout_all
from .math import *  # noqa: F401,F403
from .math import __all__ as _math_all

__all__ = ["layout", "math", *_layout_all, *_math_all]
