"""Grouped FP8 GEMMs under DeepGEMM's names and layouts (Triton; any GPU Triton supports, or the CPU
interpreter).

``D[m, :] = dequant(A)[m, :] @ dequant(B[g(m)])^T`` with 1x128 activation scales and 128x128 weight
scales; ``nt``: A is `[M, K]` K-major, B is `[G, N, K]` K-major. Engine code written for DeepGEMM runs
unchanged: the v2 names, the v1 aliases (``m_grouped_gemm_fp8_fp8_bf16_nt_*``), the alignment helpers
and ``get_mn_major_tma_aligned_tensor``.

Tiles, chosen from the shapes (``expected_m`` for the masked layout):

=================  ==========================  ================  =====  ======  ==========================
layout             rows per expert             tile (M x N x K)  warps  stages  MMA on sm90
=================  ==========================  ================  =====  ======  ==========================
contiguous         any (blocks of 128)         128 x 128 x 128   8      3       wgmma e4m3, m64 per warp group
masked             ``expected_m`` > 64         128 x 128 x 128   8      3       wgmma e4m3
masked             33 - 64                     64 x 128 x 128    4      4       wgmma e4m3, swap-AB
masked             17 - 32                     32 x 128 x 128    4      4       wgmma e4m3, swap-AB
masked             <= 16                       16 x 128 x 128    4      4       wgmma e4m3, swap-AB
=================  ==========================  ================  =====  ======  ==========================

Swap-AB computes ``D^T = B A^T`` so the 128 weight rows fill the MMA's M side and the few tokens its
narrow N side (what SGLang does below 64 rows). ``perf/sm90_report.py`` prints each tile's registers,
spills and MMA kind as compiled for sm90.

Limits: K and N multiples of 128; FP8 e4m3 operands; activation scales float32 (any strides; M-major
TMA-aligned as :func:`moe_ep.quant.per_token_group_quant_fp8` writes is the fast one) or packed UE8M0
int32; weight scales float32 `[G, N/128, K/128]`; output BF16 (or float32). No TMA: loads go through
``cp.async`` pipelining, so the contiguous layout is expected below DeepGEMM's speed (see
perf/RESULTS.md for what has been measured).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton

from .fp8 import FP8_DTYPE, ceil_div, tma_aligned_size
from .kernels.grouped_gemm import OUT_BF16, OUT_BF16_BITS, OUT_FP32, grouped_fp8_gemm_kernel
from .kernels.pdl import INTERPRET, pdl_launch_kwargs

if TYPE_CHECKING:  # resolved lazily by __getattr__ below (moe_ep.mega_moe imports this module)
    from .mega_moe import fp8_mega_moe, get_symm_buffer_for_mega_moe, transform_weights_for_mega_moe

__all__ = [
    "GemmConfig",
    "choose_gemm_config",
    "get_m_alignment_for_contiguous_layout",
    "get_mk_alignment_for_contiguous_layout",
    "get_mn_major_tma_aligned_tensor",
    "get_tma_aligned_size",
    "m_grouped_fp8_gemm_nt_contiguous",
    "m_grouped_fp8_gemm_nt_masked",
    "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous",
    "m_grouped_gemm_fp8_fp8_bf16_nt_masked",
    "fp8_mega_moe",
    "get_symm_buffer_for_mega_moe",
    "transform_weights_for_mega_moe",
]

BLOCK_K = 128
M_ALIGNMENT = 128


@dataclass(frozen=True)
class GemmConfig:
    """One tile configuration of the grouped GEMM kernel."""

    block_m: int
    block_n: int
    swap_ab: bool
    num_warps: int
    num_stages: int
    group_m: int = 8


def choose_gemm_config(masked: bool, expected_m: int) -> GemmConfig:
    """The tile for a layout and an expected number of rows per expert (the module table)."""
    if masked and expected_m <= 64:
        block_m = 16 if expected_m <= 16 else 32 if expected_m <= 32 else 64
        return GemmConfig(block_m, 128, True, 4, 4, group_m=1)
    return GemmConfig(128, 128, False, 8, 3, group_m=8 if not masked else 1)


def get_m_alignment_for_contiguous_layout() -> int:
    """Rows each expert's block is padded to in the contiguous layout (DeepGEMM v1 name)."""
    return M_ALIGNMENT


def get_mk_alignment_for_contiguous_layout() -> int:
    """Same as :func:`get_m_alignment_for_contiguous_layout` (DeepGEMM v2 name)."""
    return M_ALIGNMENT


def get_tma_aligned_size(x: int, element_size: int) -> int:
    """``x`` rounded up so that ``x * element_size`` is a multiple of 16 bytes."""
    return tma_aligned_size(x, element_size)


def get_mn_major_tma_aligned_tensor(x: torch.Tensor) -> torch.Tensor:
    """``x`` (`[M, G]` or `[B, M, G]` scales) with the same values, M-major with the column stride padded
    to 16 bytes: the layout the GEMM reads fastest. Returned as is when it already has that layout."""
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be [M, G] or [B, M, G], got shape {tuple(x.shape)}")
    m = x.shape[-2]
    mp = tma_aligned_size(m, x.element_size())
    if x.stride(-2) == 1 and (x.shape[-1] <= 1 or x.stride(-1) == mp) and \
            (x.dim() == 2 or x.shape[0] <= 1 or x.stride(0) == mp * x.shape[-1]):
        return x
    storage = torch.empty(*x.shape[:-2], x.shape[-1], mp, dtype=x.dtype, device=x.device)
    out = storage[..., :m].transpose(-1, -2)
    out.copy_(x)
    return out


# ---------------------------------------------------------------------------------------------
# Validation (every check runs before any launch)
# ---------------------------------------------------------------------------------------------

def _pair(v, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(v, (tuple, list)) or len(v) != 2 or not all(isinstance(t, torch.Tensor) for t in v):
        raise TypeError(f"{name} must be a (fp8 tensor, scales) pair, got {type(v).__name__}")
    return v[0], v[1]


def _check_k_contiguous(t: torch.Tensor, name: str) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be K-major (last dim contiguous), got strides {t.stride()}")


def _check_operands(a, b, d, lead: tuple[int, ...]):
    """Validate (a, sfa), (b, sfb), d for a `[*lead, M, K]` A; return (x, sfa, w, sfb, ue8m0)."""
    x, sfa = _pair(a, "a")
    w, sfb = _pair(b, "b")
    for t, name in ((x, "a[0]"), (w, "b[0]")):
        if t.dtype != FP8_DTYPE:
            raise TypeError(f"{name} must be {FP8_DTYPE}, got {t.dtype}")
    if x.dim() != len(lead) + 2:
        want = "[M, K]" if not lead else "[G, T, K]"
        raise ValueError(f"a[0] must be {want}, got shape {tuple(x.shape)}")
    if w.dim() != 3:
        raise ValueError(f"b[0] must be [G, N, K], got shape {tuple(w.shape)}")
    m, k = x.shape[-2:]
    num_groups, n, kw = w.shape
    if kw != k:
        raise ValueError(f"K mismatch: a[0] has K={k}, b[0] has K={kw}")
    if k % BLOCK_K or n % BLOCK_K:
        raise ValueError(f"K={k} and N={n} must be multiples of {BLOCK_K} (1x128 / 128x128 FP8 scales)")
    _check_k_contiguous(x, "a[0]")
    _check_k_contiguous(w, "b[0]")
    kb = k // BLOCK_K
    if sfa.dtype == torch.float32:
        want_sfa, ue8m0 = (*lead, m, kb), False
    elif sfa.dtype == torch.int32:
        want_sfa, ue8m0 = (*lead, m, ceil_div(kb, 4)), True
    else:
        raise TypeError(f"a[1] (activation scales) must be float32 or packed UE8M0 int32, got {sfa.dtype}")
    if tuple(sfa.shape) != want_sfa:
        raise ValueError(f"a[1] must have shape {list(want_sfa)} for a[0] of shape {list(x.shape)}, "
                         f"got {list(sfa.shape)}")
    if sfb.dtype != torch.float32:
        raise TypeError(f"b[1] (weight scales) must be float32 [G, N/128, K/128], got {sfb.dtype}")
    if tuple(sfb.shape) != (num_groups, n // BLOCK_K, kb):
        raise ValueError(f"b[1] must have shape {[num_groups, n // BLOCK_K, kb]}, got {list(sfb.shape)}")
    if not isinstance(d, torch.Tensor) or d.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"d must be a bfloat16 (or float32) tensor, got {getattr(d, 'dtype', type(d).__name__)}")
    if tuple(d.shape) != (*lead, m, n):
        raise ValueError(f"d must have shape {[*lead, m, n]}, got {list(d.shape)}")
    if d.shape[-1] > 1 and d.stride(-1) != 1:
        raise ValueError(f"d must have a contiguous last dim, got strides {d.stride()}")
    for t, name in ((sfa, "a[1]"), (w, "b[0]"), (sfb, "b[1]"), (d, "d")):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but a[0] is on {x.device}")
    if x.device.type == "cpu" and not INTERPRET:
        raise RuntimeError("CPU tensors run the Triton kernels only under the interpreter: set "
                           "TRITON_INTERPRET=1 before importing moe_ep.gemm, or pass CUDA tensors")
    return x, sfa, w, sfb, ue8m0


def _check_index(t, name: str, length: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
        raise TypeError(f"{name} must be an int32 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    if tuple(t.shape) != (length,):
        raise ValueError(f"{name} must have shape [{length}], got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but a[0] is on {device}")


def _check_recipe(recipe, disable_ue8m0_cast) -> None:
    if recipe is not None and tuple(recipe) != (1, 128, 128):
        raise ValueError(f"recipe={recipe}: only (1, 128, 128) (1x128 activations, 128x128 weights) is supported")
    del disable_ue8m0_cast  # float32 scales are never cast; UE8M0 is taken as given


def _out_mode(d: torch.Tensor) -> int:
    if d.dtype == torch.float32:
        return OUT_FP32.value
    # NOTES: the interpreter's fp32 -> bf16 cast truncates; round in integers there (same bits as torch).
    return OUT_BF16_BITS.value if (INTERPRET or d.device.type != "cuda") else OUT_BF16.value


def _launch(x3, sfa3, w, sfb, d3, m_indices, masked_m, ue8m0, masked, cfg: GemmConfig, use_pdl: bool) -> None:
    num_groups, rows, k = x3.shape
    n = w.shape[1]
    grid = (triton.cdiv(rows, cfg.block_m) * triton.cdiv(n, cfg.block_n), num_groups if masked else 1)
    out_mode = _out_mode(d3)
    d_arg = d3.view(torch.int16) if out_mode == OUT_BF16_BITS.value else d3
    grouped_fp8_gemm_kernel[grid](
        x3, sfa3, w, sfb, d_arg,
        m_indices if m_indices is not None else x3, masked_m if masked_m is not None else x3,
        rows, n, k, w.shape[0],
        x3.stride(0), x3.stride(1),
        sfa3.stride(0), sfa3.stride(1), sfa3.stride(2),
        w.stride(0), w.stride(1),
        sfb.stride(0), sfb.stride(1), sfb.stride(2),
        d3.stride(0), d3.stride(1),
        MASKED=masked, SWAP_AB=cfg.swap_ab, SFA_UE8M0=ue8m0, OUT_MODE=out_mode,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=BLOCK_K, GROUP_M=cfg.group_m,
        PREFETCH_K=min(4, k // BLOCK_K),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch_kwargs(use_pdl, x3.device),
    )


# ---------------------------------------------------------------------------------------------
# Public ops
# ---------------------------------------------------------------------------------------------

def m_grouped_fp8_gemm_nt_contiguous(a, b, d: torch.Tensor, m_indices: torch.Tensor, recipe=None,
                                     compiled_dims: str = "nk", disable_ue8m0_cast: bool = False, *,
                                     use_pdl: bool = False, config: GemmConfig | None = None) -> None:
    """Grouped GEMM over experts whose rows lie back to back (prefill).

    Arguments:
        a: ``(x_fp8, sfa)``: `[M, K]` `torch.float8_e4m3fn` and its 1x128 scales, float32 `[M, K/128]`
            (any strides) or packed UE8M0 int32 `[M, ceil(K/512)]`, as
            :func:`moe_ep.quant.per_token_group_quant_fp8` writes them.
        b: ``(w_fp8, sfb)``: `[G, N, K]` `torch.float8_e4m3fn` and float32 `[G, N/128, K/128]`.
        d: output `[M, N]` `torch.bfloat16` (or float32), written in place.
        m_indices: `[M]` `torch.int32`: each row's expert, constant within each 128-row block (see
            :func:`get_m_alignment_for_contiguous_layout`), -1 on padding rows (written as zeros).
            Read on the device only; a row whose index is ``>= G`` or differs from the first row of
            its tile comes out NaN.
        recipe, compiled_dims, disable_ue8m0_cast: DeepGEMM's arguments; only the (1, 128, 128)
            recipe exists here, the others change nothing.
        use_pdl: launch with programmatic dependent launch (Hopper+): weights are prefetched into L2
            before waiting for the previous kernel.
        config: force a tile (:class:`GemmConfig`); default from :func:`choose_gemm_config`.
    """
    del compiled_dims
    _check_recipe(recipe, disable_ue8m0_cast)
    x, sfa, w, sfb, ue8m0 = _check_operands(a, b, d, ())
    _check_index(m_indices, "m_indices", x.shape[0], x.device)
    cfg = config or choose_gemm_config(False, x.shape[0])
    if cfg.swap_ab or M_ALIGNMENT % cfg.block_m:
        raise ValueError(f"contiguous layout needs a tile without swap-AB whose block_m divides {M_ALIGNMENT}")
    if x.shape[0] == 0:
        return
    _launch(x.unsqueeze(0), sfa.unsqueeze(0), w, sfb, d.unsqueeze(0), m_indices, None, ue8m0, False, cfg, use_pdl)


def m_grouped_fp8_gemm_nt_masked(a, b, d: torch.Tensor, masked_m: torch.Tensor, expected_m: int, recipe=None,
                                 compiled_dims: str = "nk", disable_ue8m0_cast: bool = False, *,
                                 use_pdl: bool = False, config: GemmConfig | None = None) -> None:
    """Grouped GEMM over the masked layout (decode; the low-latency dispatch's receive layout).

    Arguments:
        a: ``(x_fp8, sfa)``: `[G, T, K]` `torch.float8_e4m3fn` and float32 `[G, T, K/128]` (any strides;
            the dispatch's column-major scales are what it reads fastest) or UE8M0 int32
            `[G, T, ceil(K/512)]`.
        b: ``(w_fp8, sfb)``: `[G, N, K]` and float32 `[G, N/128, K/128]`.
        d: output `[G, T, N]` `torch.bfloat16` (or float32). Rows ``t >= masked_m[g]`` are not written.
        masked_m: `[G]` `torch.int32` on the device: valid rows per expert (clamped to [0, T]). Never
            read on the host: the call is CUDA-graph safe.
        expected_m: rows per expert the caller expects (a host int); only picks the tile.
        use_pdl, config, recipe, compiled_dims, disable_ue8m0_cast: as in
            :func:`m_grouped_fp8_gemm_nt_contiguous`.
    """
    del compiled_dims
    _check_recipe(recipe, disable_ue8m0_cast)
    if isinstance(a, (tuple, list)) and len(a) == 2 and isinstance(a[0], torch.Tensor) and a[0].dim() == 3:
        lead = (a[0].shape[0],)
    else:
        lead = (0,)
    x, sfa, w, sfb, ue8m0 = _check_operands(a, b, d, lead)
    if x.shape[0] != w.shape[0]:
        raise ValueError(f"a[0] has {x.shape[0]} groups but b[0] has {w.shape[0]}")
    _check_index(masked_m, "masked_m", x.shape[0], x.device)
    if isinstance(expected_m, bool) or not isinstance(expected_m, int) or expected_m < 0:
        raise TypeError(f"expected_m must be a non-negative host int, got {expected_m!r}")
    cfg = config or choose_gemm_config(True, expected_m)
    if x.numel() == 0:
        return
    _launch(x, sfa, w, sfb, d, None, masked_m, ue8m0, True, cfg, use_pdl)


# DeepGEMM v1 names.
m_grouped_gemm_fp8_fp8_bf16_nt_contiguous = m_grouped_fp8_gemm_nt_contiguous
m_grouped_gemm_fp8_fp8_bf16_nt_masked = m_grouped_fp8_gemm_nt_masked


# DeepGEMM's mega-MoE names (moe_ep/mega_moe.py imports this module, so they are resolved on first use).
_MEGA_MOE_NAMES = ("fp8_mega_moe", "get_symm_buffer_for_mega_moe", "transform_weights_for_mega_moe")


def __getattr__(name):
    if name in _MEGA_MOE_NAMES:
        from . import mega_moe
        return getattr(mega_moe, name)
    raise AttributeError(f"module 'moe_ep.gemm' has no attribute {name!r}")
