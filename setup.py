"""Build script for moe-ep.

The package is pure Python + Triton. A CUDA extension is built from ``csrc/`` only when
``csrc`` holds sources, torch was built with CUDA and ``nvcc`` is on the PATH; a CPU-only
machine (or ``MOE_EP_NO_CUDA_EXT=1``) installs without it.
"""

import glob
import os
import shutil

from setuptools import find_packages, setup


def _cuda_extensions():
    sources = sorted(glob.glob("csrc/**/*.cu", recursive=True) + glob.glob("csrc/**/*.cpp", recursive=True))
    if not sources or os.environ.get("MOE_EP_NO_CUDA_EXT") == "1" or shutil.which("nvcc") is None:
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CUDAExtension
    except ImportError:
        return [], {}
    if torch.version.cuda is None:
        return [], {}
    ext = CUDAExtension("moe_ep._C", sources, extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3"]})
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = _cuda_extensions()

setup(
    name="moe-ep",
    version="0.1.0",
    description="Expert-parallel dispatch/combine, FP8 kernels, EPLB and microbatch overlap for MoE inference",
    long_description=open("README.md").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["moe_ep", "moe_ep.*", "eplb", "eplb.*", "microbatch", "microbatch.*"]),
    python_requires=">=3.10",
    # Every third-party module the packages import (tests/test_setup_scripts.py checks it). Triton ships
    # Linux wheels only; without a GPU its kernels run in the interpreter (TRITON_INTERPRET=1).
    install_requires=["torch>=2.6", "numpy", 'triton>=3.4; platform_system == "Linux"'],
    extras_require={
        "test": ["pytest", "hypothesis"],          # moe_ep.testing.sm90 imports pytest
        "plot": ["matplotlib"],                    # python -m eplb plan --png
        "progress": ["tqdm"],
        # internode low-latency EP (backend="nvshmem"): the NVSHMEM device bitcode Triton links (moe_ep/nvshmem.py)
        "nvshmem": ["nvidia-nvshmem-cu12==3.8.0"],
        "gpu": [],                                 # kept for `pip install moe-ep[gpu]`: triton is now required
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
