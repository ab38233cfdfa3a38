"""Serving-level policies from the seed papers, pure Python + numpy, verified by simulation.

- ``serving.cost``: roofline cost model of a DeepSeek-V3/R1-class iteration under attention DP + MoE EP.
- ``serving.sim``: iteration-level simulator of DP ranks with in-flight batching.
- ``serving.adp``: ADP balance (routers, the per-iteration gate) and the seed-003 experiment.
- ``serving.trace``: request traces (synthetic, JSON, CSV).

Nothing here imports torch or touches a GPU; ``python -m serving --help`` lists the subcommands.
"""

import logging as _logging

import os as _os
import sys as _sys

__version__ = "0.1.0"

# The package's logger ("serving"; modules log to its children): silent unless the application configures logging.
_logging.getLogger(__name__).addHandler(_logging.NullHandler())

try:
    import numpy as _np  # noqa: F401
except ModuleNotFoundError:  # one line for a program (python -m serving, moe-ep-serving), an ImportError otherwise
    _msg = (f"moe-ep's serving needs numpy, which {_sys.executable} cannot import: run `bash scripts/setup.sh` in "
            "the checkout and use the Python it prints, or `pip install numpy`")
    if (_sys.argv[:1] == ["-m"]) or _os.path.basename(_sys.argv[0] if _sys.argv else "").startswith("moe-ep"):
        print(f"error: {_msg}", file=_sys.stderr)
        raise SystemExit(1) from None
    raise ModuleNotFoundError(_msg, name="numpy") from None


class ServingError(Exception):
    """Base of serving's error classes (``TraceError``, ``SimError``, ``PlanError``; each still a ``ValueError``)."""
