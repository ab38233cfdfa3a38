"""The shared case machinery of ``perf/sm90_report.py``: the sm90 target (:data:`H100`, :data:`TARGET_CC`), one
shipped configuration (:class:`Case`), :func:`_case` (a case specialised like a launch would be), the constants the
communication-kernel cases share, and :func:`_host_cases`, which collects ``sm90_cases()`` from the host modules that
build their kernels' cases.

Imported by the report (and :mod:`_sm90_families`) after its ``TRITON_INTERPRET`` check; not a script.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from typing import Any, Optional

# H100 SXM per-SM limits (CUDA C Programming Guide, "Compute capability 9.0" table; occupancy calculator).
H100 = {
    "regs_per_sm": 65536,
    "reg_alloc_unit": 256,  # registers are allocated per warp in units of 256
    "max_regs_per_thread": 255,
    "smem_per_sm": 228 * 1024,
    "smem_per_block": 227 * 1024,  # the most one block may use
    "smem_reserved_per_block": 1024,  # taken by the CUDA runtime from the SM's shared memory for every block
    "max_warps_per_sm": 64,
    "max_blocks_per_sm": 32,
    "num_sms": 132,
}
TARGET_CC = 90


@dataclasses.dataclass
class Case:
    """One shipped configuration: what a launcher passes for a given shape."""

    name: str  # the op, e.g. "quant"
    config: str  # shape and variant; contains "PDL" exactly when the launch uses PDL
    kernel: Any
    signature: dict
    constexprs: dict
    num_warps: int
    num_stages: int = 3
    attrs: Optional[dict] = None
    options: Optional[dict] = None
    error: Optional[str] = None  # set when the case could not even be built (reported as a FAILED row)


def _case(name: str, config: str, kernel, pointers: dict, scalars: dict, constexprs: dict, num_warps: int = 4,
          num_stages: int = 3, options: Optional[dict] = None) -> Case:
    """A case specialised like a launch would: :func:`moe_ep.testing.sm90.launch_case` (the rule the kernel
    modules' ``sm90_cases()`` hooks use too) as a :class:`Case`."""
    from moe_ep.testing.sm90 import launch_case

    return Case(**launch_case(name, config, kernel, pointers, scalars, constexprs, num_warps, num_stages, options))


_SYMM_PTRS = {"buffer_ptrs": "*i64", "signal_ptrs": "*i64", "status_ptr": "*i32"}
_TIMEOUT_NS = 100 * 10**9  # int64 at launch, as the symm buffer's default timeout is
_RANK = 3  # a rank that is neither 0 nor 1: no accidental specialisation


#: host modules whose ``sm90_cases()`` build their kernels' cases (kernel modules stay leaves: they import no
#: testing or host code), in report order
HOST_CASE_MODULES = ("moe_ep.deepep.v2.expand", "moe_ep.gemm", "moe_ep.gemm.gluon", "moe_ep.gemm.mega_moe")


def _host_cases() -> list[Case]:
    """Cases from ``sm90_cases()`` of every module in :data:`HOST_CASE_MODULES`.

    Each item is a dict with keys ``name, config, kernel, signature, constexprs, num_warps, num_stages`` and
    optional ``attrs`` / ``options``. A module that fails to import, or whose cases are malformed, gives one
    FAILED row (not a skip, and not a crash that would hide the other rows)."""
    cases: list[Case] = []
    for name in HOST_CASE_MODULES:
        try:
            mod = importlib.import_module(name)
            cases += [Case(**d) for d in mod.sm90_cases()]
        except Exception as exc:  # noqa: BLE001 - reported as a row
            short = name.rsplit(".", 1)[-1]
            cases.append(Case(short, "sm90_cases()", None, {}, {}, 0, error=f"{type(exc).__name__}: {exc}"))
    return cases

