"""moe-ep: expert-parallel dispatch/combine, FP8 kernels and overlap helpers for MoE inference.

Importing this package never touches CUDA, NCCL or the network.
"""

__version__ = "0.1.0"
