"""Two-microbatch overlap: one microbatch communicates while the other computes.

- :func:`split_batch` cuts a batch (prefill: balanced tokens, decode: halves by sequences).
- A layer is a list of operations with :data:`YIELD` points; :func:`run_two_microbatches` runs two
  microbatches stage by stage on one thread (:mod:`microbatch.executor`).
- :class:`Communicator` hides how dispatch / combine move data (low-latency hooks, normal-mode
  events, the torch all-to-all) behind send / receive halves (:mod:`microbatch.comm`).
- :func:`moe_layer_schedule` builds DeepSeek-like prefill and decode schedules (:mod:`microbatch.schedules`).
"""

import logging as _logging

try:
    import torch as _torch  # noqa: F401
except ModuleNotFoundError:
    from moe_ep._env import require as _require  # moe_ep stops first, with the same one line

    _require("torch", "numpy")
    raise

from .comm import Communicator, LowLatencyCommunicator, NormalCommunicator, TorchA2ACommunicator  # noqa: E402
from .executor import YIELD, YieldPoint, run_single, run_two_microbatches, stages  # noqa: E402
from .schedules import moe_layer_schedule  # noqa: E402
from .split import MicrobatchSplit, split_batch  # noqa: E402

__version__ = "0.1.0"

# The package's logger ("microbatch"; modules log to its children): silent unless the application configures logging.
_logging.getLogger(__name__).addHandler(_logging.NullHandler())

__all__ = ["split_batch", "MicrobatchSplit", "YIELD", "YieldPoint", "stages", "run_single", "run_two_microbatches",
           "Communicator", "LowLatencyCommunicator", "NormalCommunicator", "TorchA2ACommunicator",
           "moe_layer_schedule"]
