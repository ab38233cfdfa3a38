"""moe-ep: expert-parallel dispatch/combine, FP8 kernels and overlap helpers for MoE inference.

Importing this package never touches CUDA, NCCL or the network.
"""

from .buffer import Buffer, Config
from .events import EventOverlap
from .sync import RankTimeoutError

__version__ = "0.1.0"

__all__ = ["Buffer", "Config", "EventOverlap", "MoELayer", "RankTimeoutError", "__version__"]


def __getattr__(name):
    # MoELayer pulls in the Triton kernels: imported on first use, so that ``import moe_ep`` stays light
    # and TRITON_INTERPRET can still be set after it on CPU machines.
    if name == "MoELayer":
        from .moe import MoELayer
        return MoELayer
    raise AttributeError(f"module 'moe_ep' has no attribute {name!r}")
