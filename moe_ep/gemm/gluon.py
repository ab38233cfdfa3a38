"""Which kernel runs the FP8 GEMMs, and the launch of the warp-specialised sm90 Gluon kernel
(:mod:`moe_ep.kernels.grouped_gemm_gluon`) when it is the one.

``MOE_EP_GEMM_KERNEL`` (read at each call):

- ``auto`` (the default): on sm90 the Gluon kernel for the shapes where it measured faster than ``tl`` (below),
  the ``tl`` kernel elsewhere; a Gluon compile failure falls back to ``tl`` for the rest of the process.
- ``gluon``: the Gluon kernel wherever it can run (a CUDA sm90 device, a Triton with Gluon, not the
  interpreter, operands it takes: below), at every shape; the ``tl`` kernel otherwise.
- ``tl``: the Triton ``tl`` kernel (:mod:`moe_ep.kernels.grouped_gemm`), on any GPU and under the CPU
  interpreter.

Where ``auto`` takes Gluon (:func:`auto_prefers_gluon`), from one H200 (2026-11-28, ``perf/lease_gemm_gluon.py``,
N 4096, K 7168, both kernels checked against the reference first): contiguous / psum layouts with at least 4,096
rows (Gluon 1.3-1.4x faster from 32 x 128 to 4 x 8192 rows), masked layouts with ``expected_m`` >= 512 (1.27x at
512, 1.44x at 1024). Below those ``tl`` is faster (masked ``expected_m`` 32-256: Gluon 1.35-3x slower) or the
size was not measured (contiguous under 4,096 rows, the dense ``fp8_gemm_nt``), and ``tl`` runs.

The Gluon kernel takes FP8 operands with float32 scales (not packed UE8M0: those stay on ``tl``), contiguous
``a`` / ``b`` / ``d`` with 16-byte aligned rows (``N`` a multiple of 8), no forced ``config``. Activation scales
(and wgrad weight scales) in another layout than the TMA-aligned MN-major one are copied into it first
(:func:`~moe_ep.gemm.utils.layout.get_mn_major_tma_aligned_tensor`), as DeepGEMM's host does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from ..kernels.pdl import INTERPRET
from .runtime import get_num_sms
from .tiles import BLOCK_K
from .utils.layout import get_mn_major_tma_aligned_tensor

__all__ = ["ENV", "auto_prefers_gluon", "gemm_kernel_choice", "GluonTile", "gluon_tile", "launch_gluon", "sm90_cases"]

ENV = "MOE_EP_GEMM_KERNEL"
_CHOICES = ("tl", "gluon", "auto")
_broken: Optional[str] = None  # set by an ``auto`` compile failure


@dataclass(frozen=True)
class GluonTile:
    """One tile of the Gluon kernel: ``num_warps`` consumer warps (one warpgroup per 64 rows) plus the producer."""

    block_m: int
    block_n: int
    num_warps: int
    stages: int
    group_m: int = 8


def gluon_tile(expected_m: int) -> GluonTile:
    """The tile per shape class (DeepGEMM's sm90 heuristic, in its 1D2D form): 64 rows (one consumer warpgroup,
    6 stages) up to 64 rows per expert, else 128 (two warpgroups, 5 stages). ``BLOCK_N`` stays 128: wider tiles
    need a second accumulator set that does not fit the consumers' 232 registers."""
    if expected_m <= 64:
        return GluonTile(64, 128, 4, 6)
    return GluonTile(128, 128, 8, 5)


# ``auto``: the smallest sizes at which the Gluon kernel measured faster than ``tl`` (module docstring)
AUTO_MIN_CONTIG_ROWS = 4096
AUTO_MIN_MASKED_M = 512


def auto_prefers_gluon(mode: int, rows: int, expected_m: int) -> bool:
    """Whether ``auto`` runs a launch of layout ``mode`` (the ``tl`` kernel's ``CONTIG`` 0, ``MASKED`` 1,
    ``PSUM`` 2, ``DENSE`` 3) on the Gluon kernel: ``rows`` rows in all (contiguous / psum), ``expected_m`` rows
    per expert (masked)."""
    if mode == 1:
        return expected_m >= AUTO_MIN_MASKED_M
    if mode in (0, 2):
        return rows >= AUTO_MIN_CONTIG_ROWS
    return False  # dense: not measured against tl


def _mode() -> str:
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in _CHOICES:
        raise ValueError(f"{ENV}={mode!r}: expected one of {', '.join(_CHOICES)}")
    return mode


def gemm_kernel_choice(device: Optional[torch.device] = None) -> tuple[str, str]:
    """(``"tl"`` or ``"gluon"``, why) for FP8 GEMMs on ``device`` (operand formats aside)."""
    mode = _mode()
    if mode == "tl":
        return "tl", f"{ENV} is 'tl'"
    if _broken is not None:
        return "tl", f"the Gluon kernel failed to compile here: {_broken}"
    if INTERPRET:
        return "tl", "TRITON_INTERPRET=1: Gluon has no interpreter"
    from ..kernels.gluon_compat import GLUON_ERROR, HAVE_GLUON

    if not HAVE_GLUON:
        return "tl", f"this Triton has no Gluon ({GLUON_ERROR})"
    if device is None or device.type != "cuda":
        return "tl", "not a CUDA device"
    if torch.cuda.get_device_capability(device) != (9, 0):
        return "tl", f"sm{''.join(map(str, torch.cuda.get_device_capability(device)))}: the Gluon kernel is sm90's"
    return "gluon", f"{ENV} is {mode!r} on sm90"


def _aligned(*tensors) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def _ensure_allocator() -> None:
    """The kernel builds its TMA descriptors on the device, in Triton's global scratch: give Triton an allocator
    (torch's caching one) unless the application already set one."""
    import triton
    from triton.runtime import _allocation

    current = _allocation._allocator.get() if hasattr(_allocation._allocator, "get") else _allocation._allocator
    if isinstance(current, _allocation.NullAllocator):
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))


def launch_gluon(x3, sfa3, w, sfb, d3, layout, mode: int, *, expected_m: int, ue8m0: bool, zero_pad: bool = True,
                 accumulate: bool = False, sfb_gran_n: int = BLOCK_K, align: int = 128,
                 loads_only: bool = False) -> bool:
    """Launch the Gluon kernel if the choice and the operands allow it; False (nothing launched) otherwise."""
    global _broken
    if gemm_kernel_choice(x3.device)[0] != "gluon" or ue8m0:
        return False
    num_batches, rows, k = x3.shape
    if _mode() == "auto" and not auto_prefers_gluon(mode, rows, expected_m):
        return False
    num_groups, n, _ = w.shape
    if not (x3.is_contiguous() and w.is_contiguous() and d3.is_contiguous() and n % 8 == 0
            and d3.dtype in (torch.bfloat16, torch.float32) and _aligned(x3, w, d3) and k % BLOCK_K == 0):
        return False
    from ..kernels.grouped_gemm import MASKED
    from ..kernels.grouped_gemm_gluon import grouped_fp8_gemm_ws_kernel

    tile = gluon_tile(expected_m)
    if mode != MASKED.value and mode != 3 and align % tile.block_m:
        tile = gluon_tile(64)
    kb = k // BLOCK_K
    sfa = get_mn_major_tma_aligned_tensor(sfa3 if num_batches > 1 else sfa3[0])
    sfa_ld = sfa.stride(-1)
    if sfb_gran_n == 1:
        sfb_t = get_mn_major_tma_aligned_tensor(sfb[0])
        sfb_arg, sfb_len, sfb_ld, sfb_strides = sfb_t, sfb_t.stride(-1) * kb, sfb_t.stride(-1), (0, 0, 0)
    else:
        sfb_arg, sfb_len, sfb_ld, sfb_strides = sfb, 4, 4, sfb.stride()
    if not _aligned(sfa, sfb_arg):
        return False
    num_pid_n = -(-n // tile.block_n)
    tiles = -(-rows // tile.block_m) * num_pid_n * (num_groups if mode == MASKED.value else 1)
    grid = max(1, min(tiles, get_num_sms()))
    _ensure_allocator()
    try:
        grouped_fp8_gemm_ws_kernel[(grid,)](
            x3, sfa, w, sfb_arg, d3, layout if layout is not None else x3,
            rows, n, k, num_groups, align, num_batches * rows, sfa_ld * kb * num_batches, sfa_ld, sfb_len, sfb_ld,
            *sfb_strides,
            LAYOUT=mode, OUT_FP32=d3.dtype == torch.float32, ACCUMULATE=accumulate, ZERO_PAD=zero_pad,
            SFB_GRAN_N=sfb_gran_n, LOADS_ONLY=loads_only, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
            BLOCK_K=BLOCK_K, GROUP_M=tile.group_m, STAGES=tile.stages, NUM_WARPS=tile.num_warps,
            num_warps=tile.num_warps,
        )
    except Exception as exc:  # noqa: BLE001 - ``auto`` falls back to tl; ``gluon`` says so
        if _mode() != "auto":
            raise
        _broken = f"{type(exc).__name__}: {str(exc)[:200]}"
        return False
    return True


def sm90_cases() -> list[dict]:
    """The Gluon kernel's shipped tiles specialised as launches would be (DeepSeek-V3 expert shapes), for
    ``perf/sm90_report.py`` and ``tests/test_gemm_gluon_compile.py``; empty when this Triton has no Gluon."""
    from ..kernels.gluon_compat import HAVE_GLUON

    if not HAVE_GLUON:
        return []
    from ..kernels.grouped_gemm_gluon import CONTIG, DENSE, MASKED, PSUM, grouped_fp8_gemm_ws_kernel
    from ..testing.sm90 import launch_case

    cases = []
    # (layout, expected_m / M, N, K, float32 out + c, wgrad (1, 1, 128), loads only)
    variants = [("masked", 1024, 4096, 7168, False, False, False), ("masked", 64, 4096, 7168, False, False, False),
                ("masked", 1024, 4096, 7168, False, False, True),
                ("contiguous", 4096, 4096, 7168, False, False, False), ("psum", 4096, 4096, 7168, False, False, False),
                ("contiguous", 4096, 7168, 2048, False, False, False),
                ("dense", 4096, 7168, 2048, False, False, False), ("dense", 4096, 4096, 7168, True, True, False)]
    modes = {"contiguous": CONTIG.value, "masked": MASKED.value, "psum": PSUM.value, "dense": DENSE.value}
    for kind, em, n, k, acc32, wgrad, loads_only in variants:
        tile = gluon_tile(em)
        g, t = (32, 1024) if kind == "masked" else (8 if kind != "dense" else 1, 8 * 4096 if kind != "dense" else em)
        kb, tm = k // BLOCK_K, t
        scalars = {"M": t, "N": n, "K": k, "G": g, "ALIGN": 128, "A_ROWS": t * (g if kind == "masked" else 1),
                   "SFA_LEN": tm * kb * (g if kind == "masked" else 1), "SFA_LD": tm,
                   "SFB_LEN": n * kb if wgrad else 4, "SFB_LD": n if wgrad else 4,
                   "stride_sbg": 0 if wgrad else (n // 128) * kb, "stride_sbn": 0 if wgrad else kb,
                   "stride_sbk": 0 if wgrad else 1}
        ptrs = {"a_ptr": "*fp8e4nv", "sfa_ptr": "*fp32", "b_ptr": "*fp8e4nv", "sfb_ptr": "*fp32",
                "d_ptr": "*fp32" if acc32 else "*bf16", "layout_ptr": "*i32"}
        const = {"LAYOUT": modes[kind], "OUT_FP32": acc32, "ACCUMULATE": acc32, "ZERO_PAD": True,
                 "SFB_GRAN_N": 1 if wgrad else 128, "LOADS_ONLY": loads_only, "BLOCK_M": tile.block_m,
                 "BLOCK_N": tile.block_n, "BLOCK_K": BLOCK_K, "GROUP_M": tile.group_m, "STAGES": tile.stages,
                 "NUM_WARPS": tile.num_warps}
        shape = f"M={em} N={n} K={k} " if kind == "dense" else (
            f"G={g} N={n} K={k} expected_m={em} " if kind == "masked" else f"N={n} K={k} ")
        label = (f"gluon {kind} {shape}{tile.block_m}x{tile.block_n}x{BLOCK_K} x{tile.stages}"
                 f"{' wgrad(1,1,128)' if wgrad else ''}{' +c FP32' if acc32 else ''}{' loads-only' if loads_only else ''}")
        cases.append(launch_case("grouped_gemm_gluon", label, grouped_fp8_gemm_ws_kernel, ptrs, scalars, const,
                                 num_warps=tile.num_warps, num_stages=1))
    return cases
