"""GEMMs under DeepGEMM 2.6.1's names, signatures and layouts (Triton; any GPU Triton supports, or the CPU
interpreter): FP8 (1x128 activation scales x 128x128 weight scales, DeepGEMM's sm90 recipe) and BF16, dense
and m-grouped (contiguous by ``m_indices`` or by psum, and masked).

``D[m, :] = dequant(A)[m, :] @ dequant(B[g(m)])^T``; ``nt``: A is `[M, K]` K-major, B is `[G, N, K]` (or
`[N, K]`) K-major. Engine code written for DeepGEMM runs unchanged: the v2 names with DeepGEMM's positional
order, keywords and defaults (``recipe``, ``recipe_a`` / ``recipe_b``, ``compiled_dims``,
``disable_ue8m0_cast``, ``use_psum_layout``, ``ensure_zero_padding``, ``expected_m_for_psum_layout``), the
``fp8_fp4`` spellings, the legacy aliases (``fp8_m_grouped_gemm_nt_masked``, v1's
``gemm_fp8_fp8_bf16_nt``, ``m_grouped_gemm_fp8_fp8_bf16_nt_*`` with ``m_indices=``,
``get_col_major_tma_aligned_tensor``), the layout helpers (also as ``moe_ep.gemm.utils.layout``, like
``deep_gemm.utils.layout``), ``deep_gemm.utils.math``'s casts (``moe_ep.gemm.utils.math``) and
``get_num_sms`` / ``set_num_sms``. Keyword-only extensions: ``use_pdl``, ``config``.

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

Limits: FP8: K and N any (the last scale column / weight-scale row covers a partial block); e4m3 operands;
activation scales float32 (any strides; M-major TMA-aligned as :func:`moe_ep.quant.per_token_group_quant_fp8`
writes is the fast one) or packed UE8M0 int32; weight scales float32 `[G, ceil(N/128), K/128]`; output BF16 (or
float32; float32 required with ``c``). The dense GEMMs also take DeepGEMM's wgrad recipe ``(1, 1, 128)`` (1x128
float32 scales on B too, `[N, K/128]`). The default ``tl`` kernel has no TMA: loads go through ``cp.async``
pipelining, so the grouped GEMMs are expected below DeepGEMM's speed (see perf/RESULTS.md for what has been measured).

On sm90 the FP8 GEMMs run through a warp-specialised Gluon kernel (TMA producer warp, two consumer warpgroups
keeping one ``wgmma`` in flight, persistent masked-aware scheduler, TMA-store epilogue; :mod:`moe_ep.gemm.gluon`)
where it measured faster than ``tl`` on an H200 (contiguous from 4,096 rows, masked from ``expected_m`` 512:
``MOE_EP_GEMM_KERNEL=auto``, the default); ``MOE_EP_GEMM_KERNEL=gluon`` takes it at every shape, ``tl`` never.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

# The package is split by responsibility: tiles (GemmConfig and its table), runtime (SMs), checks (argument
# checks), launch (the shared launch path), fp8_gemm / bf16_gemm (the entry points), scales (scale layouts),
# sm90 (report cases). Every name stays importable from moe_ep.gemm.
from . import utils
from .bf16_gemm import (
    bf16_gemm_nn,
    bf16_gemm_nt,
    bf16_gemm_tn,
    bf16_gemm_tt,
    bf16_m_grouped_gemm_nt_masked,
    m_grouped_bf16_gemm_nn_contiguous,
    m_grouped_bf16_gemm_nt_contiguous,
    m_grouped_bf16_gemm_nt_masked,
)
from .checks import _as_tuple, _check_c, _check_compiled_dims, _check_expected_m  # noqa: F401
from .checks import _check_index, _check_operands, _check_recipe, _pair  # noqa: F401
from .fp8_gemm import (
    fp8_fp4_gemm_nn,
    fp8_fp4_gemm_nt,
    fp8_fp4_gemm_tn,
    fp8_fp4_gemm_tt,
    fp8_gemm_nn,
    fp8_gemm_nt,
    fp8_gemm_tn,
    fp8_gemm_tt,
    fp8_m_grouped_gemm_nt_masked,
    m_grouped_fp8_fp4_gemm_nn_contiguous,
    m_grouped_fp8_fp4_gemm_nt_contiguous,
    m_grouped_fp8_fp4_gemm_nt_masked,
    m_grouped_fp8_gemm_nn_contiguous,
    m_grouped_fp8_gemm_nt_contiguous,
    m_grouped_fp8_gemm_nt_masked,
    gemm_fp8_fp8_bf16_nt,
    m_grouped_gemm_fp8_fp8_bf16_nt_contiguous,
    m_grouped_gemm_fp8_fp8_bf16_nt_masked,
)
from .launch import _contiguous, _dense, _launch, _masked, _out_mode, _t  # noqa: F401
from .runtime import CPU_DEFAULT_NUM_SMS, _device_num_sms, _grid_size, get_num_sms, set_num_sms  # noqa: F401
from .scales import transform_sf_into_required_layout
from .sm90 import sm90_cases  # noqa: F401
from .tiles import BLOCK_K, BLOCK_K_BF16, M_ALIGNMENT, RECIPE, _contiguous_config, _dense_config  # noqa: F401
from .tiles import GemmConfig, choose_gemm_config
from .utils.layout import (
    THEORETICAL_MK_ALIGNMENT,  # noqa: F401
    get_k_alignment_for_contiguous_layout,
    get_k_grouped_mn_major_tma_aligned_packed_ue8m0_tensor,
    get_m_alignment_for_contiguous_layout,
    get_mk_alignment_for_contiguous_layout,
    get_mn_major_tma_aligned_packed_ue8m0_tensor,
    get_mn_major_tma_aligned_tensor,
    get_theoretical_mk_alignment_for_contiguous_layout,
    get_tma_aligned_size,
    set_mk_alignment_for_contiguous_layout,
)
from .utils.math import align, calc_diff, ceil_div, per_block_cast_to_fp8, per_token_cast_to_fp8  # noqa: F401

# DeepGEMM v1's name for the M-major, TMA-aligned scale layout
get_col_major_tma_aligned_tensor = get_mn_major_tma_aligned_tensor

if TYPE_CHECKING:  # resolved lazily by __getattr__ below (moe_ep.gemm.mega_moe)
    from .mega_moe import (bf16_mega_moe, fp8_fp4_mega_moe, fp8_mega_moe, get_symm_buffer_for_mega_moe,
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
    "get_mn_major_tma_aligned_packed_ue8m0_tensor",
    "get_k_grouped_mn_major_tma_aligned_packed_ue8m0_tensor",
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
    "gemm_fp8_fp8_bf16_nt",
    "get_col_major_tma_aligned_tensor",
    # utils (DeepGEMM: from .utils import *)
    "ceil_div", "align", "per_token_cast_to_fp8", "per_block_cast_to_fp8", "calc_diff",
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


# DeepGEMM's mega-MoE names (moe_ep/gemm/mega_moe.py: resolved on first use, so that importing this module stays light).
_MEGA_MOE_NAMES = ("fp8_fp4_mega_moe", "bf16_mega_moe", "fp8_mega_moe", "get_symm_buffer_for_mega_moe",
                   "transform_weights_for_mega_moe")


def __getattr__(name):
    if name in _MEGA_MOE_NAMES:
        from . import mega_moe
        return getattr(mega_moe, name)
    if name == "_num_sms":  # the SM cap lives in .runtime (set_num_sms rebinds it there); read it live
        from . import runtime
        return runtime._num_sms
    raise AttributeError(f"module 'moe_ep.gemm' has no attribute {name!r}")
