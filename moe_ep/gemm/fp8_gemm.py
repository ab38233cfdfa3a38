"""The FP8 entry points under DeepGEMM's names (dense ``fp8_gemm_{nt,nn,tn,tt}``, m-grouped contiguous and
masked), their ``fp8_fp4`` spellings and the legacy / v1 aliases. FP8 operands only (1x128 x 128x128 scales)."""

from __future__ import annotations

from typing import Optional

import torch

from .checks import _check_recipe
from .launch import _contiguous, _dense, _masked, _t
from .tiles import GemmConfig

def fp8_gemm_nt(a, b, d: torch.Tensor, c: Optional[torch.Tensor] = None, recipe=None, recipe_a=None, recipe_b=None,
                compiled_dims: str = "nk", disable_ue8m0_cast: bool = False, *, use_pdl: bool = False,
                config: Optional[GemmConfig] = None) -> None:
    """``d = a @ b.T`` (``+ c``), in place.

    Arguments:
        a: ``(x_fp8 [M, K], sfa)``: float32 `[M, K/128]` 1x128 scales (any strides) or packed UE8M0 int32.
        b: ``(w_fp8 [N, K], sfb)``: float32 `[ceil(N/128), K/128]` 128x128 block scales, or with the wgrad recipe
            ``(1, 1, 128)`` float32 `[N, K/128]` 1x128 scales (any strides).
        d: `[M, N]` bfloat16 or float32, N-major.
        c: optional float32 `[M, N]` (``d`` then float32 too; may be ``d`` itself): accumulated in FP32.
        recipe, recipe_a, recipe_b: DeepGEMM's: its sm90 FP8 recipe (1, 128, 128) (the default) or its wgrad
            recipe (1, 1, 128) (``recipe_a=(1, 128), recipe_b=(1, 128)``): 1x128 scales on B too.
        compiled_dims, disable_ue8m0_cast: DeepGEMM's; they change nothing here (float32 scales are never cast).
        use_pdl, config: keyword-only extensions (:func:`m_grouped_fp8_gemm_nt_contiguous`).
    """
    del disable_ue8m0_cast
    gran_n = _check_recipe(recipe, recipe_a, recipe_b, compiled_dims, allow_wgrad=True)
    _dense(a, b, d, c, bf16=False, use_pdl=use_pdl, config=config, sfb_gran_n=gran_n)


def fp8_gemm_nn(a, b, d: torch.Tensor, c: Optional[torch.Tensor] = None, recipe=None, recipe_a=None, recipe_b=None,
                compiled_dims: str = "nk", disable_ue8m0_cast: bool = False, *, use_pdl: bool = False,
                config: Optional[GemmConfig] = None) -> None:
    """:func:`fp8_gemm_nt` with ``b = (w [K, N], sfb [K/128, ceil(N/128)])`` (read through transposed views)."""
    fp8_gemm_nt(a, _t(b), d, c, recipe, recipe_a, recipe_b, compiled_dims, disable_ue8m0_cast, use_pdl=use_pdl,
                config=config)


def fp8_gemm_tn(a, b, d: torch.Tensor, c: Optional[torch.Tensor] = None, recipe=None, recipe_a=None, recipe_b=None,
                compiled_dims: str = "mn", disable_ue8m0_cast: bool = False, *, use_pdl: bool = False,
                config: Optional[GemmConfig] = None) -> None:
    """:func:`fp8_gemm_nt` with ``a = (x [K, M], sfa [K/128, M])`` and ``b = (w [K, N], sfb [K/128, ceil(N/128)])``."""
    fp8_gemm_nt(_t(a), _t(b), d, c, recipe, recipe_a, recipe_b, compiled_dims, disable_ue8m0_cast, use_pdl=use_pdl,
                config=config)


def fp8_gemm_tt(a, b, d: torch.Tensor, c: Optional[torch.Tensor] = None, recipe=None, recipe_a=None, recipe_b=None,
                compiled_dims: str = "mn", disable_ue8m0_cast: bool = False, *, use_pdl: bool = False,
                config: Optional[GemmConfig] = None) -> None:
    """:func:`fp8_gemm_nt` with ``a = (x [K, M], sfa [K/128, M])``."""
    fp8_gemm_nt(_t(a), b, d, c, recipe, recipe_a, recipe_b, compiled_dims, disable_ue8m0_cast, use_pdl=use_pdl,
                config=config)


def m_grouped_fp8_gemm_nt_contiguous(a, b, d: torch.Tensor, grouped_layout: torch.Tensor, recipe=None,
                                     recipe_a=None, recipe_b=None, compiled_dims: str = "nk",
                                     disable_ue8m0_cast: bool = False, use_psum_layout: bool = False,
                                     ensure_zero_padding: bool = True,
                                     expected_m_for_psum_layout: Optional[int] = None, *,
                                     use_pdl: bool = False, config: Optional[GemmConfig] = None) -> None:
    """Grouped GEMM over experts whose rows lie back to back (prefill), in place into ``d``.

    Arguments:
        a: ``(x_fp8, sfa)``: `[M, K]` `torch.float8_e4m3fn` and its 1x128 scales, float32 `[M, K/128]`
            (any strides) or packed UE8M0 int32 `[M, ceil(K/512)]`, as
            :func:`moe_ep.quant.per_token_group_quant_fp8` writes them.
        b: ``(w_fp8, sfb)``: `[G, N, K]` `torch.float8_e4m3fn` and float32 `[G, ceil(N/128), K/128]`.
        d: output `[M, N]` `torch.bfloat16` (or float32).
        grouped_layout: `torch.int32`, contiguous, one of DeepGEMM's two layouts:

            - ``use_psum_layout=False``: `[M]` m_indices, each row's expert, constant within each aligned
              block (:func:`get_mk_alignment_for_contiguous_layout`), -1 on padding rows (written as zeros).
              A row whose index is ``>= G`` or differs from the first row of its tile comes out NaN.
            - ``use_psum_layout=True``: `[G]` psum: ``grouped_layout[g]`` is the end row of expert ``g``,
              whose rows start at ``align(grouped_layout[g - 1], alignment)`` (0 for ``g = 0``); i.e. the
              prefix sum of the aligned counts of the experts before plus its own count (what DeepEP V2's
              expanded dispatch returns as ``psum_num_recv_tokens_per_expert``). Non-decreasing.
            Read on the device only (CUDA-graph safe).
        recipe, recipe_a, recipe_b: only (1, 128, 128) (ValueError otherwise).
        compiled_dims, disable_ue8m0_cast: DeepGEMM's; they change nothing here.
        use_psum_layout: see ``grouped_layout``.
        ensure_zero_padding: psum layout: write zeros on the padding rows (from an expert's end to the next
            aligned start, and past the last expert); ``False`` leaves them untouched. The m_indices layout
            always writes its -1 rows as zeros.
        expected_m_for_psum_layout: DeepGEMM's tile hint for the psum layout (psum only, as DeepGEMM
            asserts); the tile here is fixed by the alignment.
        use_pdl: keyword-only: programmatic dependent launch (Hopper+): weights are prefetched into L2 before
            waiting for the previous kernel.
        config: keyword-only: force a tile (:class:`GemmConfig`).
    """
    del disable_ue8m0_cast
    _check_recipe(recipe, recipe_a, recipe_b, compiled_dims)
    _contiguous(a, b, d, grouped_layout, bf16=False, use_psum_layout=use_psum_layout,
                ensure_zero_padding=ensure_zero_padding, expected_m_for_psum_layout=expected_m_for_psum_layout,
                use_pdl=use_pdl, config=config)


def m_grouped_fp8_gemm_nn_contiguous(a, b, d: torch.Tensor, grouped_layout: torch.Tensor, recipe=None,
                                     recipe_a=None, recipe_b=None, compiled_dims: str = "nk",
                                     disable_ue8m0_cast: bool = False, use_psum_layout: bool = False,
                                     ensure_zero_padding: bool = True, *, use_pdl: bool = False,
                                     config: Optional[GemmConfig] = None) -> None:
    """:func:`m_grouped_fp8_gemm_nt_contiguous` with ``b = (w [G, K, N], sfb [G, K/128, ceil(N/128)])``."""
    m_grouped_fp8_gemm_nt_contiguous(a, _t(b), d, grouped_layout, recipe, recipe_a, recipe_b, compiled_dims,
                                     disable_ue8m0_cast, use_psum_layout, ensure_zero_padding, None,
                                     use_pdl=use_pdl, config=config)


def m_grouped_fp8_gemm_nt_masked(a, b, d: torch.Tensor, masked_m: torch.Tensor, expected_m: int, recipe=None,
                                 recipe_a=None, recipe_b=None, compiled_dims: str = "nk",
                                 disable_ue8m0_cast: bool = False, *, use_pdl: bool = False,
                                 config: Optional[GemmConfig] = None) -> None:
    """Grouped GEMM over the masked layout (decode; the low-latency dispatch's receive layout).

    Arguments:
        a: ``(x_fp8, sfa)``: `[G, T, K]` `torch.float8_e4m3fn` and float32 `[G, T, K/128]` (any strides;
            the dispatch's column-major scales are what it reads fastest) or UE8M0 int32
            `[G, T, ceil(K/512)]`.
        b: ``(w_fp8, sfb)``: `[G, N, K]` and float32 `[G, ceil(N/128), K/128]`.
        d: output `[G, T, N]` `torch.bfloat16` (or float32). Rows ``t >= masked_m[g]`` are not written.
        masked_m: `[G]` `torch.int32` on the device: valid rows per expert (clamped to [0, T]). Never
            read on the host: the call is CUDA-graph safe.
        expected_m: rows per expert the caller expects (a host int); only picks the tile.
        recipe, recipe_a, recipe_b, compiled_dims, disable_ue8m0_cast, use_pdl, config: as in
            :func:`m_grouped_fp8_gemm_nt_contiguous`.
    """
    del disable_ue8m0_cast
    _check_recipe(recipe, recipe_a, recipe_b, compiled_dims)
    _masked(a, b, d, masked_m, expected_m, bf16=False, use_pdl=use_pdl, config=config)


# DeepGEMM's fp8_fp4 spellings (the same functions: FP8 operands only here), its legacy alias, and v1's names.
fp8_fp4_gemm_nt = fp8_gemm_nt
fp8_fp4_gemm_nn = fp8_gemm_nn
fp8_fp4_gemm_tn = fp8_gemm_tn
fp8_fp4_gemm_tt = fp8_gemm_tt
m_grouped_fp8_fp4_gemm_nt_contiguous = m_grouped_fp8_gemm_nt_contiguous
m_grouped_fp8_fp4_gemm_nn_contiguous = m_grouped_fp8_gemm_nn_contiguous
m_grouped_fp8_fp4_gemm_nt_masked = m_grouped_fp8_gemm_nt_masked
fp8_m_grouped_gemm_nt_masked = m_grouped_fp8_gemm_nt_masked


def gemm_fp8_fp8_bf16_nt(lhs, rhs, out: torch.Tensor, *, use_pdl: bool = False,
                         config: Optional[GemmConfig] = None) -> None:
    """DeepGEMM v1's dense name and arguments: :func:`fp8_gemm_nt` ``(lhs, rhs, out)``."""
    fp8_gemm_nt(lhs, rhs, out, use_pdl=use_pdl, config=config)


def m_grouped_gemm_fp8_fp8_bf16_nt_contiguous(lhs, rhs, out: torch.Tensor, m_indices: torch.Tensor, *,
                                              use_pdl: bool = False, config: Optional[GemmConfig] = None) -> None:
    """DeepGEMM v1's contiguous grouped name and arguments (``m_indices``: the expert of each row, -1 for
    padding): :func:`m_grouped_fp8_gemm_nt_contiguous`."""
    m_grouped_fp8_gemm_nt_contiguous(lhs, rhs, out, m_indices, use_pdl=use_pdl, config=config)


def m_grouped_gemm_fp8_fp8_bf16_nt_masked(lhs, rhs, out: torch.Tensor, masked_m: torch.Tensor,
                                          expected_m: int, *, use_pdl: bool = False,
                                          config: Optional[GemmConfig] = None) -> None:
    """DeepGEMM v1's masked grouped name and arguments: :func:`m_grouped_fp8_gemm_nt_masked`."""
    m_grouped_fp8_gemm_nt_masked(lhs, rhs, out, masked_m, expected_m, use_pdl=use_pdl, config=config)
