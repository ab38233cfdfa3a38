"""sm90 report cases of the GEMM kernel (``perf/sm90_report.py``, ``tests/test_gemm_compile.py``): the shipped
tiles specialised as real launches would be. Host side, so that the kernel module stays a leaf."""

from __future__ import annotations

from ..kernels.grouped_gemm import CONTIG, DENSE, MASKED, OUT_BF16, OUT_FP32, PSUM, grouped_gemm_kernel
from .tiles import BLOCK_K, BLOCK_K_BF16, _contiguous_config, _dense_config, choose_gemm_config
from .utils.layout import THEORETICAL_MK_ALIGNMENT

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
