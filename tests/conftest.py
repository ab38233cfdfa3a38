"""Test set-up: the Triton interpreter on machines without a GPU.

TRITON_INTERPRET must be set before any ``@triton.jit`` function is defined, so it is set here,
before the tests import anything from moe_ep. CUDA is never initialised in this process
(the multi-rank tests fork).
"""

import os
import shutil
import subprocess


def _has_gpu() -> bool:
    # Ask nvidia-smi rather than torch.cuda so the parent never initialises CUDA before forking.
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return False
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        return subprocess.run([smi, "-L"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


HAS_GPU = _has_gpu()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
