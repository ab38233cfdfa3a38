"""moe_ep.gemm's import surface: the package is split by responsibility into submodules, and every name it
defined (public and private) stays importable from ``moe_ep.gemm`` as the very object its submodule defines;
the SM cap (``_num_sms``, rebound by ``set_num_sms`` in ``.runtime``) reads live through the package."""

from __future__ import annotations

import importlib

import pytest

from moe_ep import gemm

# Where each name that moe_ep.gemm defines lives now (written here as data).
HOMES = {
    "tiles": ["BLOCK_K", "BLOCK_K_BF16", "M_ALIGNMENT", "RECIPE", "GemmConfig", "choose_gemm_config",
              "_contiguous_config", "_dense_config"],
    "runtime": ["CPU_DEFAULT_NUM_SMS", "_device_num_sms", "get_num_sms", "set_num_sms", "_grid_size"],
    "checks": ["_pair", "_check_operands", "_check_index", "_as_tuple", "_check_recipe", "_check_compiled_dims",
               "_check_c", "_check_expected_m"],
    "launch": ["_out_mode", "_launch", "_dense", "_contiguous", "_masked", "_t"],
    "fp8_gemm": ["fp8_gemm_nt", "fp8_gemm_nn", "fp8_gemm_tn", "fp8_gemm_tt", "m_grouped_fp8_gemm_nt_contiguous",
                 "m_grouped_fp8_gemm_nn_contiguous", "m_grouped_fp8_gemm_nt_masked", "fp8_fp4_gemm_nt",
                 "fp8_fp4_gemm_nn", "fp8_fp4_gemm_tn", "fp8_fp4_gemm_tt", "m_grouped_fp8_fp4_gemm_nt_contiguous",
                 "m_grouped_fp8_fp4_gemm_nn_contiguous", "m_grouped_fp8_fp4_gemm_nt_masked",
                 "fp8_m_grouped_gemm_nt_masked", "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous",
                 "m_grouped_gemm_fp8_fp8_bf16_nt_masked", "gemm_fp8_fp8_bf16_nt"],
    "bf16_gemm": ["bf16_gemm_nt", "bf16_gemm_nn", "bf16_gemm_tn", "bf16_gemm_tt", "m_grouped_bf16_gemm_nt_contiguous",
                  "m_grouped_bf16_gemm_nn_contiguous", "m_grouped_bf16_gemm_nt_masked",
                  "bf16_m_grouped_gemm_nt_masked"],
    "scales": ["transform_sf_into_required_layout"],
    "sm90": ["sm90_cases"],
    "utils.layout": ["THEORETICAL_MK_ALIGNMENT", "get_theoretical_mk_alignment_for_contiguous_layout",
                     "get_mk_alignment_for_contiguous_layout", "set_mk_alignment_for_contiguous_layout",
                     "get_m_alignment_for_contiguous_layout", "get_k_alignment_for_contiguous_layout",
                     "get_mn_major_tma_aligned_tensor", "get_tma_aligned_size",
                     "get_mn_major_tma_aligned_packed_ue8m0_tensor",
                     "get_k_grouped_mn_major_tma_aligned_packed_ue8m0_tensor"],
}


@pytest.mark.parametrize("home", sorted(HOMES))
def test_names_importable_from_the_package(home):
    mod = importlib.import_module(f"moe_ep.gemm.{home}")
    assert mod.__doc__ and mod.__doc__.strip(), f"moe_ep.gemm.{home} has no module docstring"
    for name in HOMES[home]:
        assert getattr(gemm, name) is getattr(mod, name), name


def test_all_resolves():
    for name in gemm.__all__:
        assert getattr(gemm, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'not_a_gemm'"):
        gemm.not_a_gemm


def test_num_sms_reads_live_through_the_package():
    from moe_ep.gemm import runtime

    assert gemm._num_sms == 0 and gemm._grid_size(10) == 10
    gemm.set_num_sms(3)
    try:
        assert gemm._num_sms == runtime._num_sms == 3 == gemm.get_num_sms()
        assert gemm._grid_size(10) == 3 and gemm._grid_size(2) == 2
    finally:
        gemm.set_num_sms(0)
    assert gemm._num_sms == 0 and gemm._grid_size(10) == 10
