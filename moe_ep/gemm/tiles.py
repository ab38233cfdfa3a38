"""The GEMMs' tiles: the scale block sizes, :class:`GemmConfig` and the table that picks a tile from a layout and
its rows (:func:`choose_gemm_config`, the contiguous and dense variants). Pure host-side data; no launches."""

from __future__ import annotations

from dataclasses import dataclass

from .utils.layout import THEORETICAL_MK_ALIGNMENT

BLOCK_K = 128  # FP8: one K block per 1x128 / 128x128 scale
BLOCK_K_BF16 = 64
M_ALIGNMENT = THEORETICAL_MK_ALIGNMENT  # the default contiguous-layout alignment (kept for older imports)
#: The only FP8 recipe (DeepGEMM's sm90 one): 1x128 activation scales, 128x128 weight scales.
RECIPE = (1, 128, 128)
#: DeepGEMM's wgrad recipe (dense GEMMs only): 1x128 scales on both operands.
WGRAD_RECIPE = (1, 1, 128)


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
