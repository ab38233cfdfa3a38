"""Benchmark of the ``symm`` backend's combine (weighted BF16 reduction back to the source ranks).

The same harness as ``perf/bench_dispatch.py`` (virtual ranks on one device, copy bandwidth and a
torch baseline measured in the same run, DeepEP byte counting: selections x 2H):

    python perf/bench_combine.py                 # needs a CUDA GPU
    python perf/bench_combine.py --cpu-smoke     # every code path on CPU (interpreter), tiny shapes
    torchrun --nproc-per-node 8 perf/bench_combine.py --launcher torchrun   # real ranks: symm, torch, DeepEP
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

_common.smoke_env()  # TRITON_INTERPRET=1 before moe_ep is imported

from bench_dispatch import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(op="combine"))
