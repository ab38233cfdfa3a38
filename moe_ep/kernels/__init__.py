"""Triton kernels, one family per file. Importing this package imports Triton but never touches CUDA."""
