"""The BF16 entry points under DeepGEMM's names (dense ``bf16_gemm_{nt,nn,tn,tt}``, m-grouped contiguous and
masked) and the legacy alias: the FP8 GEMMs' layouts, tiles and kernel without scales."""

from __future__ import annotations

from typing import Optional

import torch

from .checks import _check_compiled_dims
from .launch import _contiguous, _dense, _masked, _t
from .tiles import GemmConfig

def bf16_gemm_nt(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, c: Optional[torch.Tensor] = None,
                 compiled_dims: str = "nk", *, use_pdl: bool = False, config: Optional[GemmConfig] = None) -> None:
    """``d = a @ b.T`` (``+ c``, float32): ``a`` BF16 `[M, K]`, ``b`` BF16 `[N, K]`, ``d`` `[M, N]` BF16 or
    float32 (any K and N; operands any strides)."""
    _check_compiled_dims(compiled_dims)
    _dense(a, b, d, c, bf16=True, use_pdl=use_pdl, config=config)


def bf16_gemm_nn(a, b, d, c=None, compiled_dims: str = "nk", *, use_pdl: bool = False, config=None) -> None:
    """:func:`bf16_gemm_nt` with ``b`` `[K, N]`."""
    bf16_gemm_nt(a, _t(b), d, c, compiled_dims, use_pdl=use_pdl, config=config)


def bf16_gemm_tn(a, b, d, c=None, compiled_dims: str = "mn", *, use_pdl: bool = False, config=None) -> None:
    """:func:`bf16_gemm_nt` with ``a`` `[K, M]` and ``b`` `[K, N]`."""
    bf16_gemm_nt(_t(a), _t(b), d, c, compiled_dims, use_pdl=use_pdl, config=config)


def bf16_gemm_tt(a, b, d, c=None, compiled_dims: str = "mn", *, use_pdl: bool = False, config=None) -> None:
    """:func:`bf16_gemm_nt` with ``a`` `[K, M]`."""
    bf16_gemm_nt(_t(a), b, d, c, compiled_dims, use_pdl=use_pdl, config=config)


def m_grouped_bf16_gemm_nt_contiguous(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor,
                                      grouped_layout: torch.Tensor, compiled_dims: str = "nk",
                                      use_psum_layout: bool = False, ensure_zero_padding: bool = True,
                                      expected_m_for_psum_layout: Optional[int] = None, *, use_pdl: bool = False,
                                      config: Optional[GemmConfig] = None) -> None:
    """:func:`m_grouped_fp8_gemm_nt_contiguous` for BF16 ``a`` `[M, K]` and ``b`` `[G, N, K]` (no scales; the
    same layouts, tiles and Triton kernel with K blocks of 64)."""
    _check_compiled_dims(compiled_dims)
    _contiguous(a, b, d, grouped_layout, bf16=True, use_psum_layout=use_psum_layout,
                ensure_zero_padding=ensure_zero_padding, expected_m_for_psum_layout=expected_m_for_psum_layout,
                use_pdl=use_pdl, config=config)


def m_grouped_bf16_gemm_nn_contiguous(a, b, d, grouped_layout, compiled_dims: str = "nk",
                                      use_psum_layout: bool = False, ensure_zero_padding: bool = True, *,
                                      use_pdl: bool = False, config=None) -> None:
    """:func:`m_grouped_bf16_gemm_nt_contiguous` with ``b`` `[G, K, N]`."""
    m_grouped_bf16_gemm_nt_contiguous(a, _t(b), d, grouped_layout, compiled_dims, use_psum_layout,
                                      ensure_zero_padding, None, use_pdl=use_pdl, config=config)


def m_grouped_bf16_gemm_nt_masked(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, masked_m: torch.Tensor,
                                  expected_m: int, compiled_dims: str = "nk", *, use_pdl: bool = False,
                                  config: Optional[GemmConfig] = None) -> None:
    """:func:`m_grouped_fp8_gemm_nt_masked` for BF16 ``a`` `[G, T, K]` and ``b`` `[G, N, K]`."""
    _check_compiled_dims(compiled_dims)
    _masked(a, b, d, masked_m, expected_m, bf16=True, use_pdl=use_pdl, config=config)


bf16_m_grouped_gemm_nt_masked = m_grouped_bf16_gemm_nt_masked  # DeepGEMM's legacy alias
