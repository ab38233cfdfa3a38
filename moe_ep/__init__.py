"""moe-ep: expert-parallel dispatch/combine, FP8 kernels and overlap helpers for MoE inference.

Importing this package never touches CUDA, NCCL or the network.
"""

from .buffer import Buffer, Config
from .events import EventOverlap
from .sync import RankTimeoutError

__version__ = "0.1.0"

__all__ = ["Buffer", "Config", "EventOverlap", "RankTimeoutError", "__version__"]
