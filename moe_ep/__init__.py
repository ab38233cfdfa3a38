"""moe-ep: expert-parallel dispatch/combine, FP8 kernels and overlap helpers for MoE inference.

Importing this package never touches CUDA, NCCL or the network.
"""

import logging as _logging

from . import _paths
from ._env import require as _require

_require("torch", "numpy")

import torch as _torch  # noqa: E402

from .deepep.v1.buffer import Buffer, Config
from .errors import MoEEPError
from .events import EventOverlap
from .sync import CallMismatchError, RankTimeoutError, RemoteRankError

_paths.install()  # the modules that moved into folders keep their old import paths (moe_ep/_paths.py)

__version__ = "0.1.0"

# The package's logger ("moe_ep"; modules log to its children): silent unless the application configures logging.
_logging.getLogger(__name__).addHandler(_logging.NullHandler())

#: dtype of ``topk_idx`` everywhere (DeepEP's ``deep_ep.topk_idx_t``)
topk_idx_t = _torch.int64

__all__ = ["Buffer", "CallMismatchError", "Config", "ElasticBuffer", "EPHandle", "EventOverlap", "MoEEPError", "MoELayer",
           "RankTimeoutError", "RemoteRankError", "__version__", "topk_idx_t"]


def __getattr__(name):
    # MoELayer pulls in the Triton kernels: imported on first use, so that ``import moe_ep`` stays light
    # and TRITON_INTERPRET can still be set after it on CPU machines.
    if name == "MoELayer":
        from .layer.moe import MoELayer
        return MoELayer
    if name in ("ElasticBuffer", "EPHandle"):  # DeepEP V2's face (moe_ep/deepep/v2/buffer.py, dispatch in dispatch.py)
        from .deepep.v2 import buffer as elastic
        return getattr(elastic, name)
    moved = _paths.old_attribute(name)  # moe_ep.buffer, moe_ep.elastic, ...: the module at its new path
    if moved is not None:
        return moved
    raise AttributeError(f"module 'moe_ep' has no attribute {name!r}")
