"""Build script for moe-ep.

The package is pure Python + Triton. A CUDA extension is built from ``csrc/`` only when
``csrc`` holds sources, torch was built with CUDA and ``nvcc`` is on the PATH; a CPU-only
machine (or ``MOE_EP_NO_CUDA_EXT=1``) installs without it.
"""

import glob
import os
import shutil

import setuptools
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

# The importable top-level packages (each ships a py.typed marker), and the three command lines
# (tests/test_setup_scripts.py imports each callable). The serving/ folder installs as moe_ep_serving (a
# top-level "serving" would collide with engines' own modules); in the checkout it is also `serving`.
TOP_LEVEL = ["moe_ep", "eplb", "microbatch", "moe_ep_serving"]
FOLDER = {"moe_ep_serving": "serving"}
PACKAGES = [p for name in TOP_LEVEL if name not in FOLDER for p in (name, name + ".*")]
# setuptools >= 77 writes license="MIT" as an SPDX License-Expression and deprecates the licence classifier
# (a warning on every build); older ones need the classifier to show the licence on PyPI.
_ST = tuple(int(p) for p in setuptools.__version__.split(".")[:2] if p.isdigit())
LICENSE_CLASSIFIER = [] if _ST >= (77, 0) else ["License :: OSI Approved :: MIT License"]
CONSOLE_SCRIPTS = [
    "moe-ep = moe_ep.__main__:main",          # python -m moe_ep (demo)
    "moe-ep-eplb = eplb.cli:main",            # python -m eplb (plan / report / simulate)
    "moe-ep-serving = moe_ep_serving.__main__:main",  # python -m moe_ep_serving (adp / plan)
]

setup(
    name="moe-ep",
    version="0.1.0",
    description=("Expert-parallel dispatch/combine, FP8 kernels, EPLB, microbatch overlap and serving "
                 "policies for MoE inference"),
    long_description=open("README.md").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    license="MIT",
    license_files=["LICENSE"],
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        *LICENSE_CLASSIFIER,
        "Operating System :: POSIX :: Linux",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Programming Language :: Python :: 3.13",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: System :: Distributed Computing",
        "Typing :: Typed",
    ],
    packages=find_packages(include=PACKAGES) + list(FOLDER),
    package_dir=FOLDER,
    package_data={name: ["py.typed"] for name in TOP_LEVEL},
    entry_points={"console_scripts": CONSOLE_SCRIPTS},
    python_requires=">=3.10",
    # Every third-party module the packages import (tests/test_setup_scripts.py checks it). Triton ships
    # Linux wheels only; without a GPU its kernels run in the interpreter (TRITON_INTERPRET=1).
    # Supported (README "Support matrix"): torch >= 2.11 (GPU leases: 2.11.0+cu130; CI: 2.13), triton >= 3.6
    # (GPU leases: 3.6.0; CI: 3.9, plus the sm90 compile tests under 3.6.0: scripts/compile_oldest_triton.sh).
    # The CPU suite's interpreter needs triton >= 3.8, or numpy < 2.4 with triton 3.6-3.7 (tests/conftest.py).
    # No lower bound here pulls CUDA wheels: a CPU torch satisfies torch>=2.11.
    install_requires=["torch>=2.11", "numpy", 'triton>=3.6; platform_system == "Linux"'],
    extras_require={
        "test": ["pytest", "hypothesis"],          # moe_ep.testing.sm90 imports pytest
        "plot": ["matplotlib"],                    # python -m eplb plan --png, python -m serving adp's figures
        "serving": ["pyyaml", "matplotlib"],       # python -m serving plan's YAML configs, adp's figures
        "progress": ["tqdm"],
        # internode low-latency EP (backend="nvshmem"): the NVSHMEM device bitcode Triton links (moe_ep/nvshmem/bitcode.py).
        # 3.8.0's bitcode (LLVM 22.1.8) has the IBGDA device code and needs triton>=3.8 to link; with triton 3.6-3.7
        # use torch's nvidia-nvshmem-cu13 3.4.5 instead (links, no IBGDA: internode puts via the CPU proxy).
        "nvshmem": ["nvidia-nvshmem-cu12==3.8.0"],
        "gpu": [],                                 # kept for `pip install moe-ep[gpu]`: triton is now required
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
