"""eplb: expert placement with redundant replicas, dispatch-time replica choice, load statistics.

- `rebalance_experts`: DeepSeek EPLB-compatible placement (plus per-step statistics, stickiness,
  replica caps, policy choice);
- `map_topk`: logical top-k ids to physical slots at dispatch time (static / random / round_robin /
  balanced), fixed shapes, no host synchronisation, dead slots masked (`slot_mask`);
- `replan_on_survivors`: a new placement on the surviving GPUs, moving as few slots as possible;
- `LoadRecorder`: per-layer per-expert counts over a sliding window, save/load;
- `eplb.metrics`: balancedness, same-GPU duplicates, slots moved; `eplb.synthetic`: workloads;
- `python -m eplb plan | report | simulate`: the offline CLI.

Importing eplb never touches CUDA.
"""

import logging as _logging

try:
    import numpy as _np  # noqa: F401
    import torch as _torch  # noqa: F401
except ModuleNotFoundError:
    from moe_ep._env import require as _require  # moe_ep stops first, with the same one line

    _require("torch", "numpy")
    raise

from ._checks import EplbInputError  # noqa: E402
from .dispatch import map_topk  # noqa: E402
from .failover import replan_on_survivors  # noqa: E402
from .metrics import balancedness, gpu_loads, same_gpu_duplicates, slots_moved  # noqa: E402
from .placement import rebalance_experts  # noqa: E402
from .recorder import LoadRecorder  # noqa: E402

__version__ = "0.1.0"

# The package's logger ("eplb"; modules log to its children): silent unless the application configures logging.
_logging.getLogger(__name__).addHandler(_logging.NullHandler())

__all__ = ["EplbInputError", "rebalance_experts", "map_topk", "replan_on_survivors", "LoadRecorder", "balancedness", "gpu_loads",
           "same_gpu_duplicates", "slots_moved"]
