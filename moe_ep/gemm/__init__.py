"""GEMMs under DeepGEMM 2.6.1's names, signatures and layouts (Triton; any GPU Triton supports, or the CPU
interpreter): FP8 (1x128 activation scales x 128x128 weight scales, DeepGEMM's sm90 recipe) and BF16, dense
and m-grouped (contiguous by ``m_indices`` or by psum, and masked).

``D[m, :] = dequant(A)[m, :] @ dequant(B[g(m)])^T``; ``nt``: A is `[M, K]` K-major, B is `[G, N, K]` (or
`[N, K]`) K-major. Engine code written for DeepGEMM runs unchanged: the v2 names with DeepGEMM's positional
order, keywords and defaults (``recipe``, ``recipe_a`` / ``recipe_b``, ``compiled_dims``,
``disable_ue8m0_cast``, ``use_psum_layout``, ``ensure_zero_padding``, ``expected_m_for_psum_layout``), the
``fp8_fp4`` spellings, the legacy aliases (``fp8_m_grouped_gemm_nt_masked``, v1's
``m_grouped_gemm_fp8_fp8_bf16_nt_*``), the layout helpers (also as ``moe_ep.gemm.utils.layout``, like
``deep_gemm.utils.layout``) and ``get_num_sms`` / ``set_num_sms``. Keyword-only extensions: ``use_pdl``,
``config``.

Tiles, chosen from the shapes (``expected_m`` for the masked layout, ``M`` for the dense GEMMs):

=================  ==========================  ================  =====  ======  ==========================
layout             rows per expert             tile (M x N x K)  warps  stages  MMA on sm90
=================  ==========================  ================  =====  ======  ==========================
contiguous / psum  any (blocks of 128)         128 x 128 x 128   8      3       wgmma e4m3, m64 per warp group
masked / dense     ``expected_m`` / M > 64     128 x 128 x 128   8      3       wgmma e4m3
masked / dense     33 - 64                     64 x 128 x 128    4      4       wgmma e4m3, swap-AB
masked / dense     17 - 32                     32 x 128 x 128    4      4       wgmma e4m3, swap-AB
masked / dense     <= 16                       16 x 128 x 128    4      4       wgmma e4m3, swap-AB
=================  ==========================  ================  =====  ======  ==========================

BF16 takes the same tiles with K blocks of 64 (wgmma bf16). Swap-AB computes ``D^T = B A^T`` so the 128 weight
rows fill the MMA's M side and the few tokens its narrow N side (what SGLang does below 64 rows).
``perf/sm90_report.py`` prints each tile's registers, spills and MMA kind as compiled for sm90.

SMs: :func:`set_num_sms` caps the GEMMs' grid (a persistent loop over the tiles); by default (the device's SM
count) every tile gets its own program.

Limits: FP8: K a multiple of 128 (N any: the last weight-scale row covers a partial block); e4m3 operands;
activation scales float32 (any strides; M-major TMA-aligned as :func:`moe_ep.quant.per_token_group_quant_fp8`
writes is the fast one) or packed UE8M0 int32; weight scales float32 `[G, ceil(N/128), K/128]`; output BF16 (or
float32; float32 required with ``c``). No TMA: loads go through ``cp.async`` pipelining, so the grouped GEMMs
are expected below DeepGEMM's speed (see perf/RESULTS.md for what has been measured).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import triton

from ..fp8 import FP8_DTYPE, ceil_div
from ..kernels.grouped_gemm import CONTIG, DENSE, MASKED, OUT_BF16, OUT_BF16_BITS, OUT_FP32, PSUM, grouped_gemm_kernel
from ..kernels.pdl import INTERPRET, pdl_launch_kwargs
from . import utils
from .utils.layout import (
    THEORETICAL_MK_ALIGNMENT,
    get_k_alignment_for_contiguous_layout,
    get_m_alignment_for_contiguous_layout,
    get_mk_alignment_for_contiguous_layout,
    get_mn_major_tma_aligned_tensor,
    get_theoretical_mk_alignment_for_contiguous_layout,
    get_tma_aligned_size,
    set_mk_alignment_for_contiguous_layout,
)

if TYPE_CHECKING:  # resolved lazily by __getattr__ below (moe_ep.mega_moe imports this module)
    from ..mega_moe import (bf16_mega_moe, fp8_fp4_mega_moe, fp8_mega_moe, get_symm_buffer_for_mega_moe,
                            transform_weights_for_mega_moe)

__all__ = [
    "GemmConfig",
    "choose_gemm_config",
    "utils",
    # runtime
    "get_num_sms",
    "set_num_sms",
    # layout
    "get_theoretical_mk_alignment_for_contiguous_layout",
    "get_mk_alignment_for_contiguous_layout",
    "set_mk_alignment_for_contiguous_layout",
    "get_m_alignment_for_contiguous_layout",
    "get_k_alignment_for_contiguous_layout",
    "get_mn_major_tma_aligned_tensor",
    "get_tma_aligned_size",
    "transform_sf_into_required_layout",
    # FP8
    "fp8_gemm_nt", "fp8_gemm_nn", "fp8_gemm_tn", "fp8_gemm_tt",
    "fp8_fp4_gemm_nt", "fp8_fp4_gemm_nn", "fp8_fp4_gemm_tn", "fp8_fp4_gemm_tt",
    "m_grouped_fp8_gemm_nt_contiguous",
    "m_grouped_fp8_gemm_nn_contiguous",
    "m_grouped_fp8_gemm_nt_masked",
    "m_grouped_fp8_fp4_gemm_nt_contiguous",
    "m_grouped_fp8_fp4_gemm_nn_contiguous",
    "m_grouped_fp8_fp4_gemm_nt_masked",
    "fp8_m_grouped_gemm_nt_masked",
    "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous",
    "m_grouped_gemm_fp8_fp8_bf16_nt_masked",
    # BF16
    "bf16_gemm_nt", "bf16_gemm_nn", "bf16_gemm_tn", "bf16_gemm_tt",
    "m_grouped_bf16_gemm_nt_contiguous",
    "m_grouped_bf16_gemm_nn_contiguous",
    "m_grouped_bf16_gemm_nt_masked",
    "bf16_m_grouped_gemm_nt_masked",
    # mega MoE
    "fp8_fp4_mega_moe",
    "bf16_mega_moe",
    "fp8_mega_moe",
    "get_symm_buffer_for_mega_moe",
    "transform_weights_for_mega_moe",
]

BLOCK_K = 128  # FP8: one K block per 1x128 / 128x128 scale
BLOCK_K_BF16 = 64
M_ALIGNMENT = THEORETICAL_MK_ALIGNMENT  # the default contiguous-layout alignment (kept for older imports)
#: The only FP8 recipe (DeepGEMM's sm90 one): 1x128 activation scales, 128x128 weight scales.
RECIPE = (1, 128, 128)


@dataclass(frozen=True)
class GemmConfig:
    """One tile configuration of the GEMM kernel."""

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


def _contiguous_config(alignment: int) -> GemmConfig:
    """The contiguous layouts' tile: 128 rows, or 64 when the alignment is an odd multiple of 64."""
    if alignment % 128 == 0:
        return choose_gemm_config(False, alignment)
    return GemmConfig(64, 128, False, 4, 3, group_m=8)


def _dense_config(m: int) -> GemmConfig:
    """The dense GEMMs' tile: the masked table's for ``expected_m = M`` (swap-AB up to 64 rows), swizzled."""
    cfg = choose_gemm_config(True, m)
    return cfg if cfg.swap_ab else choose_gemm_config(False, m)


# ---------------------------------------------------------------------------------------------
# SMs (DeepGEMM's get_num_sms / set_num_sms)
# ---------------------------------------------------------------------------------------------

#: What :func:`get_num_sms` answers without a CUDA device (the interpreter runs programs one at a time).
CPU_DEFAULT_NUM_SMS = os.cpu_count() or 1
_num_sms = 0  # 0: the device's count (no cap)


def _device_num_sms() -> Optional[int]:
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def get_num_sms() -> int:
    """SMs the GEMMs may use: the value set by :func:`set_num_sms`, else the current CUDA device's SM count
    (``os.cpu_count()`` without a CUDA device)."""
    if _num_sms:
        return _num_sms
    dev = _device_num_sms()
    return dev if dev is not None else CPU_DEFAULT_NUM_SMS


def set_num_sms(new_num_sms: int) -> None:
    """Let the GEMMs use at most ``new_num_sms`` SMs (their grid becomes persistent: at most that many
    programs, each looping over tiles). ``0`` restores the default (the device's count, no cap). Bounded by
    the current device's SM count, as in DeepGEMM."""
    global _num_sms
    if isinstance(new_num_sms, bool) or not isinstance(new_num_sms, int) or new_num_sms < 0:
        raise ValueError(f"num_sms must be a non-negative int, got {new_num_sms!r}")
    dev = _device_num_sms()
    if dev is not None and new_num_sms > dev:
        raise ValueError(f"num_sms={new_num_sms} exceeds the device's {dev} SMs")
    _num_sms = new_num_sms


def _grid_size(num_tiles: int) -> int:
    """Programs for ``num_tiles`` tiles: one each unless :func:`set_num_sms` capped the SMs."""
    return max(1, min(num_tiles, _num_sms)) if _num_sms else max(1, num_tiles)


# ---------------------------------------------------------------------------------------------
# Validation (every check runs before any launch)
# ---------------------------------------------------------------------------------------------

def _pair(v, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(v, (tuple, list)) or len(v) != 2 or not all(isinstance(t, torch.Tensor) for t in v):
        raise TypeError(f"{name} must be a (fp8 tensor, scales) pair, got {type(v).__name__}")
    return v[0], v[1]


def _check_operands(a, b, d, lead: tuple[int, ...], *, bf16: bool = False, dense: bool = False):
    """Validate a, b, d for a `[*lead, M, K]` A and a `[G, N, K]` (dense: `[N, K]`) B; return
    ``(x, sfa, w3, sfb3, ue8m0)`` with B and its scales as `[G, ...]` (scales ``None`` for BF16)."""
    if bf16:
        for t, name in ((a, "a"), (b, "b")):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16:
                raise TypeError(f"{name} must be a torch.bfloat16 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
        x, w, sfa, sfb = a, b, None, None
    else:
        x, sfa = _pair(a, "a")
        w, sfb = _pair(b, "b")
        for t, name in ((x, "a[0]"), (w, "b[0]")):
            if t.dtype != FP8_DTYPE:
                raise TypeError(f"{name} must be {FP8_DTYPE} (FP4 operands are not supported), got {t.dtype}")
    an, bn = ("a", "b") if bf16 else ("a[0]", "b[0]")
    if x.dim() != len(lead) + 2:
        want = "[M, K]" if not lead else "[G, T, K]"
        raise ValueError(f"{an} must be {want}, got shape {tuple(x.shape)}")
    if w.dim() != (2 if dense else 3):
        raise ValueError(f"{bn} must be {'[N, K]' if dense else '[G, N, K]'}, got shape {tuple(w.shape)}")
    if dense:
        w = w.unsqueeze(0)
        sfb = sfb.unsqueeze(0) if sfb is not None else None
    m, k = x.shape[-2:]
    num_groups, n, kw = w.shape
    if kw != k:
        raise ValueError(f"K mismatch: {an} has K={k}, {bn} has K={kw}")
    ue8m0 = False
    if not bf16:
        if k % BLOCK_K:
            raise ValueError(f"K={k} must be a multiple of {BLOCK_K} (1x128 / 128x128 FP8 scales)")
        kb, nb = k // BLOCK_K, ceil_div(n, BLOCK_K)
        if sfa.dtype == torch.float32:
            want_sfa = (*lead, m, kb)
        elif sfa.dtype == torch.int32:
            want_sfa, ue8m0 = (*lead, m, ceil_div(kb, 4)), True
        else:
            raise TypeError(f"a[1] (activation scales) must be float32 or packed UE8M0 int32, got {sfa.dtype}")
        if tuple(sfa.shape) != want_sfa:
            raise ValueError(f"a[1] must have shape {list(want_sfa)} for a[0] of shape {list(x.shape)}, "
                             f"got {list(sfa.shape)}")
        if sfb.dtype != torch.float32:
            raise TypeError(f"b[1] (weight scales) must be float32 128x128 block scales, got {sfb.dtype}")
        if tuple(sfb.shape) != (num_groups, nb, kb):
            want = [nb, kb] if dense else [num_groups, nb, kb]
            raise ValueError(f"b[1] must have shape {want}, got {list(sfb.shape[1:] if dense else sfb.shape)}")
    if not isinstance(d, torch.Tensor) or d.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"d must be a bfloat16 (or float32) tensor, got {getattr(d, 'dtype', type(d).__name__)}")
    if tuple(d.shape) != (*lead, m, n):
        raise ValueError(f"d must have shape {[*lead, m, n]}, got {list(d.shape)}")
    if d.shape[-1] > 1 and d.stride(-1) != 1:
        raise ValueError(f"d must have a contiguous last dim (N-major), got strides {d.stride()}")
    named = [(w, bn), (d, "d")] + ([] if bf16 else [(sfa, "a[1]"), (sfb, "b[1]")])
    for t, name in named:
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but {an} is on {x.device}")
    if x.device.type == "cpu" and not INTERPRET:
        raise RuntimeError("CPU tensors run the Triton kernels only under the interpreter: set "
                           "TRITON_INTERPRET=1 before importing moe_ep.gemm, or pass CUDA tensors")
    return x, sfa, w, sfb, ue8m0


def _check_index(t, name: str, length: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
        raise TypeError(f"{name} must be an int32 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    if tuple(t.shape) != (length,):
        raise ValueError(f"{name} must have shape [{length}], got {list(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the operands are on {device}")


def _as_tuple(v, name: str) -> tuple:
    try:
        return tuple(int(i) for i in v)
    except TypeError:
        raise TypeError(f"{name} must be a tuple of ints, got {v!r}") from None


def _check_recipe(recipe, recipe_a, recipe_b, compiled_dims) -> None:
    """DeepGEMM's sm90 FP8 recipe only: ``recipe=(1, 128, 128)`` or ``recipe_a=(1, 128), recipe_b=(128, 128)``
    (or none: the default, which is that recipe)."""
    supported = ("only recipe=(1, 128, 128) is supported (1x128 activation scales x 128x128 weight scales, "
                 "DeepGEMM's sm90 FP8 recipe; equivalently recipe_a=(1, 128), recipe_b=(128, 128))")
    if recipe is not None and (recipe_a is not None or recipe_b is not None):
        raise ValueError(f"pass either recipe or recipe_a + recipe_b, not both; {supported}")
    if (recipe_a is None) != (recipe_b is None):
        raise ValueError(f"recipe_a and recipe_b go together; {supported}")
    if recipe is not None and _as_tuple(recipe, "recipe") != RECIPE:
        raise ValueError(f"recipe={tuple(recipe)}: {supported}")
    if recipe_a is not None and (_as_tuple(recipe_a, "recipe_a") != RECIPE[:2] or
                                 _as_tuple(recipe_b, "recipe_b") != RECIPE[1:]):
        raise ValueError(f"recipe_a={tuple(recipe_a)}, recipe_b={tuple(recipe_b)}: {supported}")
    _check_compiled_dims(compiled_dims)


def _check_compiled_dims(compiled_dims) -> None:
    # DeepGEMM's JIT bakes these dims into the kernel; Triton specialises on its own, so the value only has
    # to be well formed.
    if not isinstance(compiled_dims, str) or set(compiled_dims) - set("mnk"):
        raise ValueError(f"compiled_dims must be a string of 'm', 'n', 'k', got {compiled_dims!r}")


def _check_c(c, d: torch.Tensor) -> bool:
    """DeepGEMM's ``c``: ``d = a @ b.T + c`` (``c`` may be ``d`` itself). Returns whether to accumulate."""
    if c is None:
        return False
    if not isinstance(c, torch.Tensor) or tuple(c.shape) != tuple(d.shape) or c.dtype != d.dtype:
        raise ValueError(f"c must be a tensor of d's shape {list(d.shape)} and dtype {d.dtype}, got "
                         f"{getattr(c, 'dtype', type(c).__name__)} {list(getattr(c, 'shape', []))}")
    if d.dtype != torch.float32:
        raise ValueError("accumulating c needs float32 c and d (the FP32 accumulation DeepGEMM's sm90 kernels do)")
    if c.device != d.device:
        raise ValueError(f"c is on {c.device} but d is on {d.device}")
    if c.data_ptr() == d.data_ptr() and c.stride() != d.stride():
        raise ValueError("c aliases d with different strides")
    return True


def _check_expected_m(v, name: str, allow_none: bool = False) -> None:
    if v is None and allow_none:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise TypeError(f"{name} must be a non-negative host int{' or None' if allow_none else ''}, got {v!r}")


def _out_mode(d: torch.Tensor) -> int:
    if d.dtype == torch.float32:
        return OUT_FP32.value
    # NOTES: the interpreter's fp32 -> bf16 cast truncates; round in integers there (same bits as torch).
    return OUT_BF16_BITS.value if (INTERPRET or d.device.type != "cuda") else OUT_BF16.value


def _launch(x3, sfa3, w, sfb, d3, layout, mode: int, cfg: GemmConfig, *, ue8m0: bool = False, bf16: bool = False,
            use_pdl: bool = False, zero_pad: bool = True, accumulate: bool = False) -> None:
    num_batches, rows, k = x3.shape
    n = w.shape[1]
    tiles = triton.cdiv(rows, cfg.block_m) * triton.cdiv(n, cfg.block_n) * (num_batches if mode == MASKED.value else 1)
    out_mode = _out_mode(d3)
    d_arg = d3.view(torch.int16) if out_mode == OUT_BF16_BITS.value else d3
    block_k = BLOCK_K_BF16 if bf16 else BLOCK_K
    if bf16:  # no scales: any pointer, never read
        sfa3, sfb, sfa_strides, sfb_strides = x3, w, (0, 0, 0), (0, 0, 0)
    else:
        sfa_strides, sfb_strides = sfa3.stride(), sfb.stride()
    grouped_gemm_kernel[(_grid_size(tiles),)](
        x3, sfa3, w, sfb, d_arg, layout if layout is not None else x3,
        rows, n, k, w.shape[0], get_mk_alignment_for_contiguous_layout(),
        x3.stride(0), x3.stride(1), x3.stride(2),
        *sfa_strides,
        w.stride(0), w.stride(1), w.stride(2),
        *sfb_strides,
        d3.stride(0), d3.stride(1),
        LAYOUT=mode, SWAP_AB=cfg.swap_ab, SFA_UE8M0=ue8m0, OUT_MODE=out_mode,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, GROUP_M=cfg.group_m,
        PREFETCH_K=min(4, triton.cdiv(k, block_k)),
        AB_BF16=bf16, EVEN_K=k % block_k == 0, ZERO_PAD=zero_pad, ACCUMULATE=accumulate,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch_kwargs(use_pdl, x3.device),
    )


# ---------------------------------------------------------------------------------------------
# Shared bodies
# ---------------------------------------------------------------------------------------------

def _dense(a, b, d, c, *, bf16: bool, use_pdl: bool, config: Optional[GemmConfig]) -> None:
    x, sfa, w, sfb, ue8m0 = _check_operands(a, b, d, (), bf16=bf16, dense=True)
    accumulate = _check_c(c, d)
    m, n = d.shape
    if m == 0 or n == 0:
        return
    if accumulate and c.data_ptr() != d.data_ptr():
        d.copy_(c)
    cfg = config or _dense_config(m)
    _launch(x.unsqueeze(0), None if bf16 else sfa.unsqueeze(0), w, sfb, d.unsqueeze(0), None, DENSE.value, cfg,
            ue8m0=ue8m0, bf16=bf16, use_pdl=use_pdl, accumulate=accumulate)


def _contiguous(a, b, d, grouped_layout, *, bf16: bool, use_psum_layout: bool, ensure_zero_padding: bool,
                expected_m_for_psum_layout, use_pdl: bool, config: Optional[GemmConfig]) -> None:
    x, sfa, w, sfb, ue8m0 = _check_operands(a, b, d, (), bf16=bf16)
    if use_psum_layout:
        _check_index(grouped_layout, "grouped_layout (psum layout)", w.shape[0], x.device)
        _check_expected_m(expected_m_for_psum_layout, "expected_m_for_psum_layout", allow_none=True)
    else:
        _check_index(grouped_layout, "grouped_layout (m_indices)", x.shape[0], x.device)
        if expected_m_for_psum_layout is not None:
            raise ValueError("expected_m_for_psum_layout is for use_psum_layout=True only")
    alignment = get_mk_alignment_for_contiguous_layout()
    cfg = config or _contiguous_config(alignment)
    if cfg.swap_ab or alignment % cfg.block_m:
        raise ValueError(f"contiguous layout needs a tile without swap-AB whose block_m divides the alignment "
                         f"({alignment})")
    if x.shape[0] == 0 or w.shape[1] == 0:
        return
    _launch(x.unsqueeze(0), None if bf16 else sfa.unsqueeze(0), w, sfb, d.unsqueeze(0), grouped_layout,
            PSUM.value if use_psum_layout else CONTIG.value, cfg, ue8m0=ue8m0, bf16=bf16, use_pdl=use_pdl,
            zero_pad=bool(ensure_zero_padding))


def _masked(a, b, d, masked_m, expected_m, *, bf16: bool, use_pdl: bool, config: Optional[GemmConfig]) -> None:
    x0 = a if bf16 else (a[0] if isinstance(a, (tuple, list)) and len(a) == 2 else None)
    lead = (x0.shape[0],) if isinstance(x0, torch.Tensor) and x0.dim() == 3 else (0,)
    x, sfa, w, sfb, ue8m0 = _check_operands(a, b, d, lead, bf16=bf16)
    if x.shape[0] != w.shape[0]:
        raise ValueError(f"a has {x.shape[0]} groups but b has {w.shape[0]}")
    _check_index(masked_m, "masked_m", x.shape[0], x.device)
    _check_expected_m(expected_m, "expected_m")
    cfg = config or choose_gemm_config(True, expected_m)
    if x.numel() == 0 or w.shape[1] == 0:
        return
    _launch(x, sfa, w, sfb, d, masked_m, MASKED.value, cfg, ue8m0=ue8m0, bf16=bf16, use_pdl=use_pdl)


def _t(pair_or_tensor, dims=(-2, -1)):
    """The transposed view of an operand (FP8: values and scales both), for the nn / tn / tt names."""
    if isinstance(pair_or_tensor, (tuple, list)) and len(pair_or_tensor) == 2:
        return tuple(t.transpose(*dims) if isinstance(t, torch.Tensor) else t for t in pair_or_tensor)
    return pair_or_tensor.transpose(*dims) if isinstance(pair_or_tensor, torch.Tensor) else pair_or_tensor


# ---------------------------------------------------------------------------------------------
# FP8 (DeepGEMM's fp8_fp4 entry points; FP8 operands only)
# ---------------------------------------------------------------------------------------------

def fp8_gemm_nt(a, b, d: torch.Tensor, c: Optional[torch.Tensor] = None, recipe=None, recipe_a=None, recipe_b=None,
                compiled_dims: str = "nk", disable_ue8m0_cast: bool = False, *, use_pdl: bool = False,
                config: Optional[GemmConfig] = None) -> None:
    """``d = a @ b.T`` (``+ c``), in place.

    Arguments:
        a: ``(x_fp8 [M, K], sfa)``: float32 `[M, K/128]` 1x128 scales (any strides) or packed UE8M0 int32.
        b: ``(w_fp8 [N, K], sfb)``: float32 `[ceil(N/128), K/128]` 128x128 block scales.
        d: `[M, N]` bfloat16 or float32, N-major.
        c: optional float32 `[M, N]` (``d`` then float32 too; may be ``d`` itself): accumulated in FP32.
        recipe, recipe_a, recipe_b: DeepGEMM's; only its sm90 FP8 recipe (1, 128, 128) exists here.
        compiled_dims, disable_ue8m0_cast: DeepGEMM's; they change nothing here (float32 scales are never cast).
        use_pdl, config: keyword-only extensions (:func:`m_grouped_fp8_gemm_nt_contiguous`).
    """
    del disable_ue8m0_cast
    _check_recipe(recipe, recipe_a, recipe_b, compiled_dims)
    _dense(a, b, d, c, bf16=False, use_pdl=use_pdl, config=config)


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
m_grouped_gemm_fp8_fp8_bf16_nt_contiguous = m_grouped_fp8_gemm_nt_contiguous
m_grouped_gemm_fp8_fp8_bf16_nt_masked = m_grouped_fp8_gemm_nt_masked


# ---------------------------------------------------------------------------------------------
# BF16
# ---------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------
# Scale layouts
# ---------------------------------------------------------------------------------------------

def transform_sf_into_required_layout(sf: torch.Tensor, mn: int, k: int, recipe, num_groups: Optional[int] = None,
                                      is_sfa: Optional[bool] = None, disable_ue8m0_cast: bool = False,
                                      psum_layout: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Scales in the layout the GEMMs read (DeepGEMM's sm90 rules): 1x128 float32 scales (``recipe`` 3-tuple
    with ``is_sfa=True``, or ``(1, 128)``) -> :func:`get_mn_major_tma_aligned_tensor`; 128x128 float32
    scales (``is_sfa=False`` / ``(128, 128)``) -> checked (contiguous, or contiguous once the last two dims
    are swapped) and returned as they are; packed UE8M0 int32 1x128 scales (which the GEMMs here read
    directly) -> returned as they are. Anything else: ValueError. ``disable_ue8m0_cast`` and
    ``psum_layout`` (sm100's UE8M0 packing) change nothing here."""
    del disable_ue8m0_cast, psum_layout
    rec = _as_tuple(recipe, "recipe")
    if len(rec) == 3:
        if is_sfa is None:
            raise ValueError("a 3-element recipe needs is_sfa (which operand's granularity to take)")
        gran_mn, gran_k = (rec[0] if is_sfa else rec[1]), rec[2]
    elif len(rec) == 2:
        if is_sfa is not None:
            raise ValueError("a 2-element recipe is (gran_mn, gran_k) of one operand: pass is_sfa=None")
        gran_mn, gran_k = rec
    else:
        raise ValueError(f"recipe must have 2 or 3 elements, got {rec}")
    if not isinstance(sf, torch.Tensor):
        raise TypeError(f"sf must be a tensor, got {type(sf).__name__}")
    lead = () if num_groups is None else (num_groups,)
    supported = "supported: float32 (1, 128) or (128, 128) scales, packed UE8M0 int32 (1, 128) scales"
    if gran_k != 128 or gran_mn not in (1, 128):
        raise ValueError(f"scale granularity ({gran_mn}, {gran_k}) is not supported; {supported}")
    kb = ceil_div(k, 128)
    if sf.dtype == torch.float32:
        want = (*lead, ceil_div(mn, gran_mn), kb)
    elif sf.dtype == torch.int32 and gran_mn == 1:
        want = (*lead, mn, ceil_div(kb, 4))
    else:
        raise ValueError(f"{sf.dtype} scales with granularity ({gran_mn}, {gran_k}): {supported}")
    if tuple(sf.shape) != want:
        raise ValueError(f"sf must have shape {list(want)} for mn={mn}, k={k}, got {list(sf.shape)}")
    if sf.dtype == torch.int32:
        return sf
    if gran_mn == 1:
        return get_mn_major_tma_aligned_tensor(sf)
    rows, cols = sf.shape[-2:]
    ok = (sf.stride(-1) == 1 and (rows <= 1 or sf.stride(-2) == cols)) or \
         (sf.stride(-2) == 1 and (cols <= 1 or sf.stride(-1) == rows))
    if num_groups is not None and num_groups > 1:
        ok = ok and sf.stride(0) == rows * cols
    if not ok:
        raise ValueError(f"128x128 scales must be contiguous (or contiguous with the last two dims swapped), got "
                         f"strides {sf.stride()}")
    return sf


# ---------------------------------------------------------------------------------------------
# sm90 report cases (perf/sm90_report.py, tests/test_gemm_compile.py)
# ---------------------------------------------------------------------------------------------

def sm90_cases() -> list[dict]:
    """The shipped tiles specialised as real launches would be (DeepSeek-V3 expert shapes), for
    ``perf/sm90_report.py`` and the sm90 compile tests: dicts with ``name, config, kernel, signature,
    constexprs, num_warps, num_stages, attrs``. Built here, on the host side, so that the kernel module
    stays a leaf."""
    from ..testing.sm90 import launch_case

    cases = []
    # (layout, expected_m / M, UE8M0, PDL, BF16 operands, accumulate)
    variants = [("contiguous", 4096, False, False), ("contiguous", 4096, False, True),
                ("contiguous", 4096, True, True)]
    variants += [("masked", m, False, pdl) for m in (16, 32, 64, 256) for pdl in (False, True)]
    variants = [(*v, False, False) for v in variants]
    variants += [("psum", 4096, False, False, False, False), ("psum", 4096, False, True, False, False),
                 ("dense", 4096, False, False, False, False), ("dense", 4096, False, False, False, True),
                 ("dense", 16, False, False, False, False),
                 ("contiguous", 4096, False, False, True, False), ("psum", 4096, False, False, True, False),
                 ("masked", 16, False, False, True, False), ("masked", 256, False, False, True, False),
                 ("dense", 4096, False, False, True, False), ("dense", 16, False, False, True, False)]
    modes = {"contiguous": CONTIG.value, "masked": MASKED.value, "psum": PSUM.value, "dense": DENSE.value}
    for kind, expected_m, ue8m0, pdl, bf16, accumulate in variants:
        masked = kind == "masked"
        cfg = {"masked": lambda: choose_gemm_config(True, expected_m), "dense": lambda: _dense_config(expected_m)
               }.get(kind, lambda: _contiguous_config(THEORETICAL_MK_ALIGNMENT))()
        n, k, g, t = 4096, 7168, 32, 1024
        if kind == "dense":
            n, k, g = 7168, 2048, 1
        block_k = BLOCK_K_BF16 if bf16 else BLOCK_K
        rows = t if masked else (expected_m if kind == "dense" else 8 * 4096)
        # Scalars as a launch sees them: M-major scales give stride_sam == 1 (a constexpr), K-major operands
        # stride_ak == stride_bk == 1, the rest are multiples of 16 except the UE8M0 column count.
        scalars = {"M": rows, "N": n, "K": k, "G": g, "ALIGN": THEORETICAL_MK_ALIGNMENT,
                   "stride_ag": t * k, "stride_am": k, "stride_ak": 1,
                   "stride_sag": (k // 128) * t, "stride_sam": 1, "stride_sak": t,
                   "stride_bg": n * k, "stride_bn": k, "stride_bk": 1,
                   "stride_sbg": (n // 128) * (k // 128), "stride_sbn": k // 128, "stride_sbk": 1,
                   "stride_dg": t * n, "stride_dm": n}
        if bf16:
            scalars.update(stride_sag=0, stride_sam=0, stride_sak=0, stride_sbg=0, stride_sbn=0, stride_sbk=0)
        op = "*bf16" if bf16 else "*fp8e4nv"
        ptrs = {"a_ptr": op, "sfa_ptr": op if bf16 else ("*i32" if ue8m0 else "*fp32"), "b_ptr": op,
                "sfb_ptr": op if bf16 else "*fp32", "d_ptr": "*fp32" if accumulate else "*bf16",
                "layout_ptr": "*i32"}
        const = {"LAYOUT": modes[kind], "SWAP_AB": cfg.swap_ab, "SFA_UE8M0": ue8m0,
                 "OUT_MODE": OUT_FP32.value if accumulate else OUT_BF16.value,
                 "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": block_k, "GROUP_M": cfg.group_m,
                 "USE_PDL": pdl, "PREFETCH_K": 4, "AB_BF16": bf16, "ACCUMULATE": accumulate}
        shape = {"masked": f"N={n} K={k} expected_m={expected_m} ", "dense": f"M={expected_m} N={n} K={k} "
                 }.get(kind, f"N={n} K={k} ")
        label = (f"{'BF16 ' if bf16 else ''}{kind} {shape}"
                 f"{cfg.block_m}x{cfg.block_n}x{block_k}{' swapAB' if cfg.swap_ab else ''}"
                 f"{' UE8M0' if ue8m0 else ''}{' PDL' if pdl else ''}{' +c FP32' if accumulate else ''}")
        cases.append(launch_case("grouped_gemm", label, grouped_gemm_kernel, ptrs, scalars, const,
                                 num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    return cases


# DeepGEMM's mega-MoE names (moe_ep/mega_moe.py imports this module, so they are resolved on first use).
_MEGA_MOE_NAMES = ("fp8_fp4_mega_moe", "bf16_mega_moe", "fp8_mega_moe", "get_symm_buffer_for_mega_moe",
                   "transform_weights_for_mega_moe")


def __getattr__(name):
    if name in _MEGA_MOE_NAMES:
        from .. import mega_moe
        return getattr(mega_moe, name)
    raise AttributeError(f"module 'moe_ep.gemm' has no attribute {name!r}")
