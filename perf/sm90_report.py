"""Resource report for every shipped kernel configuration, compiled ahead of time for H100 (sm90) without a GPU.

Each configuration (the constexprs and ``num_warps`` its launcher picks for DeepSeek-V3 shapes) is compiled
with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))``, bypassing Triton's cache so that
its own ``ptxas -v`` log (spill stores and loads, registers) can be captured. The cubin
(``cuobjdump --dump-resource-usage``) gives the registers per thread (checked equal to the log) and the static
shared memory; the compiled metadata the dynamic shared memory a launch asks for. The PTX is scanned for
the MMA instruction kind and shape, TMA (``cp.async.bulk.tensor``), the widest global load and store, the PDL
instructions (``griddepcontrol``) and the cross-GPU synchronisation: system-scope acquire operations (the
waits: ``ld.acquire.sys`` loads, ``fence.acquire.sys``) and system-scope release operations (the signals:
``red`` / ``atom`` / ``st`` ``.sys.release``), counted per instruction kind. Kernels linked with NVSHMEM's device
bitcode (``options={"extern_libs": {"libnvshmem_device": ...}}``, :func:`moe_ep.nvshmem.extern_libs`) also get the
NVSHMEM scan of :func:`moe_ep.testing.nvshmem_ptx.scan_nvshmem_ptx`: the IBGDA doorbell, the NVSHMEM calls and
their scope, and any thread-scoped transfer (there must be none).

Resident warps per SM follow the CUDA occupancy rules for H100 (:data:`H100`): registers are allocated per
warp in units of 256; a block takes its dynamic shared memory plus the static size or, if larger, the 1 KB
the runtime reserves per block; at most 64 warps and 32 blocks per SM. ``blocks/SM`` is the same count in
programs (what a persistent launch may put on every SM at once).

    python perf/sm90_report.py                         # the table (markdown) for every case
    python perf/sm90_report.py --filter quant          # only cases whose name, kernel or config has "quant"
    python perf/sm90_report.py --json perf/out/sm90.json
    python perf/sm90_report.py --nvshmem --filter NVSHMEM   # the NVSHMEM-transport rows (IBGDA doorbell, call scopes)

Must run without ``TRITON_INTERPRET`` (the flag is read when ``@triton.jit`` functions are defined): run as a
script it re-executes itself without the variable; imported with it set, it raises.

HOOK: every module of ``moe_ep.kernels`` whose source defines ``sm90_cases()`` (a list of dicts with keys
``name, config, kernel, signature, constexprs, num_warps, num_stages`` and optional ``attrs``, ``options``;
today ``grouped_gemm`` and ``mega_moe``) has its cases appended to :data:`CASES` (see :func:`_hook_cases`).
"""

from __future__ import annotations

import os
import sys

# Step 0: no interpreter. Before importing triton: triton.language defines @jit functions at import.
if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    if __name__ == "__main__":
        _env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]], _env)
    raise RuntimeError("perf/sm90_report.py compiles kernels for sm90 and must be imported in a process without "
                       "TRITON_INTERPRET (it is set to "
                       f"{os.environ['TRITON_INTERPRET']!r}); run `python perf/sm90_report.py` or unset it first")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import importlib  # noqa: E402
import importlib.util  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any, Optional  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated (silences its warning)

import triton  # noqa: E402

__all__ = ["H100", "Case", "CASES", "compile_report", "resident_warps", "main"]

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


# ---------------------------------------------------------------------------------------------- tools
def _nvidia_bin(tool: str, env_var: str) -> str:
    """Path of a CUDA binary: ``env_var`` if set, else the one bundled with Triton, else ``PATH``."""
    path = os.environ.get(env_var)
    if path:
        return path
    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)
    if os.path.exists(bundled):
        return bundled
    found = shutil.which(tool)
    if found is None:
        raise FileNotFoundError(f"{tool} not found: set {env_var} or install a Triton with the NVIDIA backend")
    return found


def _cubin_usage(cubin: bytes, tmp: str) -> dict:
    """``REG``, ``STACK``, ``SHARED``, ``LOCAL`` of the cubin's kernel (``cuobjdump --dump-resource-usage``)."""
    path = os.path.join(tmp, "kernel.cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    out = subprocess.run([_nvidia_bin("cuobjdump", "TRITON_CUOBJDUMP_PATH"), "--dump-resource-usage", path],
                         capture_output=True, text=True, check=True).stdout
    usage = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out)}
    if "REG" not in usage:
        raise RuntimeError(f"no resource usage in cuobjdump output:\n{out}")
    return usage


def _parse_ptxas_log(log: str) -> dict:
    """Registers, stack frame and spill bytes from a ``ptxas -v`` log."""
    spill = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    regs = re.search(r"Used (\d+) registers", log)
    if spill is None or regs is None:
        raise RuntimeError(f"unexpected ptxas -v output:\n{log}")
    return {"stack": int(spill.group(1)), "spill_stores": int(spill.group(2)), "spill_loads": int(spill.group(3)),
            "regs": int(regs.group(1))}


def _compile_with_ptxas_log(src, target, options: dict):
    """``triton.compile`` with Triton's own ``ptxas -v`` log captured (cache bypassed so ptxas really runs).

    NOTES: re-running ptxas here with other flags is not the same compile: Triton adds its own options
    (e.g. ``--regAllocOptLevel=2`` in 3.9) that change register allocation and spills."""
    knobs = getattr(triton, "knobs", None)
    if knobs is None or not hasattr(knobs.nvidia, "dump_ptxas_log"):
        raise RuntimeError(f"triton {triton.__version__} has no knobs.nvidia.dump_ptxas_log; this report needs it")
    saved = (knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile)
    out = io.StringIO()
    try:
        knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = True, True
        with contextlib.redirect_stdout(out):
            ck = triton.compile(src, target=target, options=options)
    finally:
        knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = saved
    return ck, out.getvalue()


# ---------------------------------------------------------------------------------------------- PTX scan
_MEM_OP = re.compile(r"(?<![\w.%])((?:ld|st)(?:\.[\w:]+)+)")


def _widest(ptx: str, op: str) -> int:
    """Widest global ``ld`` / ``st`` in bytes (vector count x element bits / 8; 0 when there is none)."""
    best = 0
    for m in _MEM_OP.finditer(ptx):
        parts = m.group(1).split(".")
        if parts[0] != op or "global" not in parts:
            continue
        vec = next((int(p[1:]) for p in parts if re.fullmatch(r"v\d+", p)), 1)
        bits = next((int(p[1:]) for p in reversed(parts) if re.fullmatch(r"[bsuf]\d+", p)), 0)
        best = max(best, vec * bits // 8)
    return best


def _mma_kind(ptx: str) -> str:
    """``wgmma <input type>``, ``mma.sync <input type>`` or ``-``."""
    m = re.search(r"wgmma\.mma_async[\w.:]*", ptx)
    if m:
        kind = next((t for t in ("e4m3", "e5m2", "bf16", "f16", "tf32", "s8", "u8") if f".{t}" in m.group(0)), "?")
        return f"wgmma {kind}"
    m = re.search(r"\bmma\.sync[\w.:]*", ptx)
    if m:
        kind = next((t for t in ("e4m3", "e5m2", "bf16", "f16", "tf32", "s8", "u8") if f".{t}" in m.group(0)), "")
        return f"mma.sync {kind}".strip()
    return "-"


def _mma_shape(ptx: str) -> str:
    """The wgmma / mma.sync instruction shapes (``m64n128k32``; several joined by ``,``), or ``""``."""
    shapes = sorted(set(re.findall(r"\b(?:wgmma\.mma_async|mma\.sync)[\w.:]*?\.(m\d+n\d+k\d+)", ptx)))
    return ",".join(shapes)


_SYNC_OP = re.compile(r"(?<![\w.%])((?:ld|st|atom|red|fence)(?:\.[\w:]+)+)")


def _sys_sync(ptx: str, order: str) -> str:
    """System-scope ``order`` (``"acquire"`` or ``"release"``; ``acq_rel`` counts as both) operations by kind:
    ``"ld:2 fence:1"`` (sorted), or ``-``. Acquire at .sys scope is how a wait on another GPU's signal reads;
    release at .sys scope is how a signal to another GPU publishes the writes before it."""
    counts: dict = {}
    for m in _SYNC_OP.finditer(ptx):
        parts = m.group(1).split(".")
        if "sys" in parts and (order in parts or "acq_rel" in parts):
            counts[parts[0]] = counts.get(parts[0], 0) + 1
    return " ".join(f"{k}:{v}" for k, v in sorted(counts.items())) or "-"


def _pdl(ptx: str) -> str:
    """Which PDL instructions the kernel has: ``wait+launch``, ``wait``, ``launch`` or ``-``."""
    found = [s for s, i in (("wait", "griddepcontrol.wait"), ("launch", "griddepcontrol.launch_dependents"))
             if i in ptx]
    return "+".join(found) or "-"


# ---------------------------------------------------------------------------------------------- occupancy
def resident_warps(regs: int, smem_footprint: int, num_warps: int, hw: dict = H100) -> int:
    """Warps of one kernel resident per SM: blocks limited by registers, shared memory, warps and blocks.

    ``smem_footprint``: bytes of shared memory one block takes from the SM, the runtime's reservation included."""
    if smem_footprint - hw["smem_reserved_per_block"] > hw["smem_per_block"] or regs > hw["max_regs_per_thread"]:
        return 0
    unit = hw["reg_alloc_unit"]
    regs_per_warp = -(-max(regs, 1) * 32 // unit) * unit
    by_regs = (hw["regs_per_sm"] // regs_per_warp) // num_warps
    by_smem = hw["smem_per_sm"] // max(smem_footprint, 1)
    by_warps = hw["max_warps_per_sm"] // num_warps
    return min(by_regs, by_smem, by_warps, hw["max_blocks_per_sm"]) * num_warps


# ---------------------------------------------------------------------------------------------- compile
def compile_report(kernel, signature: dict, constexprs: dict, num_warps: int, num_stages: int = 3,
                   attrs: Optional[dict] = None, options: Optional[dict] = None) -> dict:
    """Compile ``kernel`` for sm90 and measure it.

    Arguments:
        kernel: a ``@triton.jit`` function; signature: every argument name -> Triton type (``"*bf16"``,
            ``"i32"``, ``"constexpr"``); constexprs: name -> value; attrs: ``{(arg index,): [["tt.divisibility",
            16]]}``; options: extra compile options (``enable_fp_fusion``, ``extern_libs`` ...).

    Returns:
        ``kernel, num_warps, num_stages, regs, spill_stores, spill_loads, stack, local, shared_dynamic,
        shared_static, shared, resident_warps, resident_blocks, mma, mma_shape, tma, ld_bytes, st_bytes, pdl,
        sys_acquire, sys_release, globaltimer, compile_s`` (``sys_acquire`` / ``sys_release``: :func:`_sys_sync`;
        ``globaltimer``: the kernel reads ``%globaltimer``, as the bounded waits do); plus ``nvshmem``
        (:func:`moe_ep.testing.nvshmem_ptx.scan_nvshmem_ptx` of the PTX and TTIR) when ``options["extern_libs"]``
        links ``libnvshmem_device``.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    opts = {"num_warps": num_warps, "num_stages": num_stages, **(options or {})}
    t0 = time.perf_counter()
    ck, ptxas_log = _compile_with_ptxas_log(ASTSource(kernel, signature, constexprs, attrs or {}),
                                            GPUTarget("cuda", TARGET_CC, 32), opts)
    compile_s = time.perf_counter() - t0
    ptx = ck.asm["ptx"]
    log = _parse_ptxas_log(ptxas_log)
    with tempfile.TemporaryDirectory(prefix="sm90_report_") as tmp:
        cubin = _cubin_usage(ck.asm["cubin"], tmp)
    if cubin["REG"] != log["regs"]:
        raise RuntimeError(f"ptxas log says {log['regs']} registers but the cubin {cubin['REG']}: not the same compile")
    # Dynamic shared memory Triton launches with, and the static shared memory of the cubin. NOTES: on sm90
    # ptxas puts the runtime's 1 KB per-block reservation into the static size when the kernel uses it
    # (``.nv.reservedSmem``), so a block's footprint is dynamic + max(static, 1 KB), not dynamic + static + 1 KB.
    dynamic, static = int(ck.metadata.shared), cubin.get("SHARED", 0)
    footprint = dynamic + max(static, H100["smem_reserved_per_block"])
    regs = cubin["REG"]
    warps = resident_warps(regs, footprint, num_warps)
    row = {
        "kernel": kernel.__name__, "num_warps": num_warps, "num_stages": num_stages, "regs": regs,
        "spill_stores": log["spill_stores"], "spill_loads": log["spill_loads"],
        "stack": max(log["stack"], cubin.get("STACK", 0)), "local": cubin.get("LOCAL", 0),
        "shared_dynamic": dynamic, "shared_static": static, "shared": dynamic + static,
        "resident_warps": warps, "resident_blocks": warps // num_warps, "mma": _mma_kind(ptx),
        "mma_shape": _mma_shape(ptx), "tma": "cp.async.bulk.tensor" in ptx, "ld_bytes": _widest(ptx, "ld"),
        "st_bytes": _widest(ptx, "st"), "pdl": _pdl(ptx), "sys_acquire": _sys_sync(ptx, "acquire"),
        "sys_release": _sys_sync(ptx, "release"), "globaltimer": "%globaltimer" in ptx, "compile_s": round(compile_s, 2),
    }
    if "libnvshmem_device" in dict(opts.get("extern_libs") or {}):
        from moe_ep.testing.nvshmem_ptx import scan_nvshmem_ptx

        row["nvshmem"] = scan_nvshmem_ptx(ptx, ck.asm.get("ttir"))
    return row


# ---------------------------------------------------------------------------------------------- cases
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
    """A case specialised like a launch would: pointers (torch allocations, 256-byte aligned) and integers
    divisible by 16 get ``tt.divisibility`` 16, integers equal to 1 become constexpr, the rest i32 / i64."""
    names = list(kernel.arg_names)
    scalars, constexprs = dict(scalars), dict(constexprs)
    for prm in kernel.params:  # arguments with a default (e.g. TRANSPORT) take it unless the case says otherwise
        if prm.name not in pointers and prm.name not in scalars and prm.name not in constexprs and prm.has_default:
            (constexprs if prm.is_constexpr else scalars)[prm.name] = prm.default
    given = {**pointers, **scalars, **constexprs}
    missing, extra = set(names) - set(given), set(given) - set(names)
    if missing or extra:
        raise ValueError(f"{kernel.__name__}: case '{config}' misses {sorted(missing)} / has unknown {sorted(extra)}")
    sig, const, div16 = {}, dict(constexprs), []
    for n, v in scalars.items():
        if v == 1:
            const[n] = 1
        elif v % 16 == 0:
            div16.append(n)
    for n in names:
        if n in const:
            sig[n] = "constexpr"
        elif n in pointers:
            sig[n] = pointers[n]
            div16.append(n)
        else:
            sig[n] = "i32" if -2**31 <= scalars[n] < 2**31 else "i64"
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    return Case(name, config, kernel, sig, const, num_warps, num_stages, attrs, options)


def _quant_cases() -> list[Case]:
    """Per-token-group quant and SiLU-and-mul quant: BF16 in, column-major TMA-aligned scales (DeepGEMM's
    layout), the ``(BLOCK_M, GROUPS_PER_PROG, num_warps)`` that ``choose_config`` picks on an H100."""
    import torch

    from moe_ep.fp8 import tma_aligned_size
    from moe_ep.kernels import quant
    from moe_ep.kernels.silu_quant import _silu_and_mul_quant_kernel

    real_num_sms = quant._num_sms
    quant._num_sms = lambda index: H100["num_sms"]  # choose_config asks the device; there is none here
    try:
        cases = []
        # (op, L, T, K): DeepSeek-V3 hidden 7168 and 2048 at prefill (4096 tokens) and decode (128 tokens);
        # silu: the expert intermediate N=2048 (input 2N), contiguous prefill and masked decode (EP8: 32
        # local experts x 1024 rows).
        shapes = [("quant", 1, m, h, False) for h in (7168, 2048) for m in (4096, 128)]
        shapes += [("silu_quant", 1, 4096, 2048, False), ("silu_quant", 32, 1024, 2048, True)]
        for op, L, T, K, masked in shapes:
            G = K // 128
            for ue8m0 in (False, True):
                W = (G + 3) // 4 if ue8m0 else 0
                block_m, gpp, warps = quant.choose_config(L, T, G, 128, ue8m0, False, torch.device("cuda", 0),
                                                          interpret=False)
                for pdl in (False, True):
                    kern = quant._per_token_group_quant_kernel if op == "quant" else _silu_and_mul_quant_kernel
                    x_cols = K if op == "quant" else 2 * K
                    tm = tma_aligned_size(T)
                    cols = (W if ue8m0 else G)
                    label = (f"{'H' if op == 'quant' else 'N'}={K} {'L=%d ' % L if L > 1 else ''}M={T} "
                             f"{'masked ' if masked else ''}BM={block_m} GPP={gpp}{' UE8M0' if ue8m0 else ''}"
                             f"{' PDL' if pdl else ''}")
                    cases.append(_case(
                        op, label, kern,
                        {"x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*i32" if ue8m0 else "*fp32",
                         "masked_m_ptr": "*i32" if masked else "*bf16"},
                        {"T": T, "G": G, "W": W, "stride_xl": T * x_cols, "stride_xt": x_cols,
                         "stride_ql": T * K, "stride_qt": K, "stride_qk": 1,
                         "stride_sl": cols * tm, "stride_st": 1, "stride_sg": tm},
                        {"GROUP_SIZE": 128, "BLOCK_M": block_m, "GROUPS_PER_PROG": gpp, "ROUND_SCALE": ue8m0,
                         "USE_UE8M0": ue8m0, "HAS_MASK": masked, "NATIVE_FP8": True, "USE_PDL": pdl},
                        num_warps=warps))
        return cases
    finally:
        quant._num_sms = real_num_sms


def _layout_cases() -> list[Case]:
    """The dispatch layout kernel (``dispatch_layout`` on a GPU: BLOCK_T=32, 4 warps)."""
    from moe_ep.kernels.layout import _layout_kernel

    N, E, K, R = 4096, 256, 8, 8
    return [_case("layout", f"N={N} E={E} top-{K} EP{R}", _layout_kernel,
                  {"topk_ptr": "*i64", "in_rank_ptr": "*i8", "per_rank_ptr": "*i32", "per_expert_ptr": "*i32",
                   "bad_ptr": "*i32"},
                  {"N": N, "E": E, "L": E // R},
                  {"K": K, "KP": K, "R": R, "RP": R, "EB": triton.next_power_of_2(E + 1), "BLOCK_T": 32})]


_SYMM_PTRS = {"buffer_ptrs": "*i64", "signal_ptrs": "*i64", "status_ptr": "*i32"}
_TIMEOUT_NS = 100 * 10**9  # int64 at launch, as the symm buffer's default timeout is
_RANK = 3  # a rank that is neither 0 nor 1: no accidental specialisation


def _intranode_cases() -> list[Case]:
    """Normal-mode (prefill) kernels, launched as ``SymmNormal`` does on a GPU: BLOCK_T=16, BLOCK_W=256,
    combine HC=256, default 4 warps; DeepSeek-V3 H=7168, top-8, EP8, 4096 tokens per rank."""
    from moe_ep.kernels import intranode as k

    R, N, H, KT = 8, 4096, 7168, 8
    sig = k.signal_layout(R)
    pad16 = lambda w: (w + 15) // 16 * 16  # noqa: E731
    w_disp = pad16((H + 4 * (H // 128)) // 4 + 3 * KT)  # FP8 payload | scales | top-k (int64) | weights
    w_comb = pad16(2 * H // 4 + KT)  # BF16 payload | weights
    nbytes = 2 << 30
    cap = (nbytes // 2) // (R * 4 * w_disp)
    cases = []
    for what, words, full, busy, cnt in (("dispatch FP8", w_disp, "DISP_FULL", "DISP_BUSY", "DISP_SEND_CNT"),
                                         ("combine BF16", w_comb, "COMB_FULL", "COMB_BUSY", "COMB_SEND_CNT")):
        cases.append(_case("normal_send", f"{what} H={H} N={N} EP{R} W={words}", k._scatter_send_kernel,
                           {"src_ptr": "*i32", "pos_ptr": "*i32", "counts_ptr": "*i32", **_SYMM_PTRS},
                           {"rank": _RANK, "N": N, "R": R, "W": words, "block_off": _RANK * cap * words,
                            "timeout_ns": _TIMEOUT_NS, **dict.fromkeys(("S1", "S2", "S3", "O1", "O2", "O3"), words)},
                           {"FULL": sig[full], "BUSY": sig[busy], "SEND_CNT": sig[cnt], "BLOCK_T": 16, "BLOCK_W": 256,
                            "CNT": sig["DISP_CNT"] if full == "DISP_FULL" else -1}))
    # receive as a view: the same rows written as planes (payload | scales | top-k ids | weights + padding)
    bounds = (H // 4, H // 4 + H // 128, H // 4 + H // 128 + 2 * KT)
    rows = (nbytes // 2 // 4) // w_disp
    planes = k.view_planes(rows, bounds, w_disp)[:3]
    cases.append(_case("normal_send", f"dispatch FP8 view H={H} N={N} EP{R} W={w_disp}", k._scatter_send_kernel,
                       {"src_ptr": "*i32", "pos_ptr": "*i32", "counts_ptr": "*i32", **_SYMM_PTRS},
                       {"rank": _RANK, "N": N, "R": R, "W": w_disp, "block_off": 0, "timeout_ns": _TIMEOUT_NS,
                        **dict(zip(("S1", "S2", "S3"), bounds)), **dict(zip(("O1", "O2", "O3"), planes))},
                       {"FULL": sig["DISP_FULL"], "BUSY": sig["DISP_BUSY"], "SEND_CNT": sig["DISP_SEND_CNT"],
                        "BLOCK_T": 16, "BLOCK_W": 256, "CNT": sig["DISP_CNT"], "VIEW": True}))
    cases.append(_case("normal_view_recv", f"EP{R}", k._view_recv_kernel,
                       {"counts_ptr": "*i32", "signal_ptrs": "*i64", "status_ptr": "*i32"},
                       {"rank": _RANK, "R": R, "M": R * N, "timeout_ns": _TIMEOUT_NS},
                       {"FULL": sig["DISP_FULL"], "HELD": sig["DISP_HELD"]}, num_warps=1))
    cases.append(_case("normal_release_held", f"EP{R}", k._release_held_kernel,
                       {"signal_ptrs": "*i64", "status_ptr": "*i32"}, {"rank": _RANK, "R": R},
                       {"FULL": sig["DISP_FULL"], "BUSY": sig["DISP_BUSY"], "CNT": sig["DISP_CNT"],
                        "HELD": sig["DISP_HELD"]}, num_warps=1))
    cases.append(_case("normal_recv_counts", f"EP{R}", k._recv_counts_kernel,
                       {"counts_ptr": "*i32", "signal_ptrs": "*i64", "status_ptr": "*i32"},
                       {"rank": _RANK, "timeout_ns": _TIMEOUT_NS}, {"FULL": sig["DISP_FULL"]}))
    cases.append(_case("normal_gather_recv", f"dispatch FP8 H={H} EP{R} W={w_disp}", k._gather_recv_kernel,
                       {"out_ptr": "*i32", "counts_ptr": "*i32", **_SYMM_PTRS},
                       {"rank": _RANK, "R": R, "W": w_disp, "cap": cap, "area_off": 0, "M": R * N,
                        "timeout_ns": _TIMEOUT_NS},
                       {"FULL": sig["DISP_FULL"], "BUSY": sig["DISP_BUSY"], "RECV_CNT": sig["DISP_RECV_CNT"],
                        "BLOCK_T": 16, "BLOCK_W": 256, "CNT": sig["DISP_CNT"]}))
    cases.append(_case("normal_combine_recv", f"BF16 H={H} top-{KT} N={N} EP{R} +weights", k._combine_recv_kernel,
                       {"acc_ptr": "*fp32", "out_ptr": "*i16", "wout_ptr": "*fp32", "pos_ptr": "*i32", **_SYMM_PTRS},
                       {"rank": _RANK, "N": N, "R": R, "W": w_comb, "cap": cap, "area_off": nbytes // 8,
                        "timeout_ns": _TIMEOUT_NS},
                       {"H": H, "K": KT, "KP": KT, "HAS_W": True, "FULL": sig["COMB_FULL"], "BUSY": sig["COMB_BUSY"],
                        "RECV_CNT": sig["COMB_RECV_CNT"], "BLOCK_T": 16, "HC": 256},
                       options={"enable_fp_fusion": False}))
    w_comb8 = pad16(H // 4 + H // 128 + KT)  # FP8 payload | scales | weights
    for what, fmt, words, f16 in (("FP8 combine", 2, w_comb8, False), ("FP16", 1, w_comb, True)):
        cases.append(_case("normal_combine_recv_fmt", f"{what} H={H} top-{KT} N={N} EP{R} +weights",
                           k._combine_recv_fmt_kernel,
                           {"acc_ptr": "*fp32", "out_ptr": "*i16", "wout_ptr": "*fp32", "pos_ptr": "*i32", **_SYMM_PTRS},
                           {"rank": _RANK, "N": N, "R": R, "W": words, "cap": cap, "area_off": nbytes // 8,
                            "timeout_ns": _TIMEOUT_NS},
                           {"H": H, "K": KT, "KP": KT, "HAS_W": True, "FULL": sig["COMB_FULL"],
                            "BUSY": sig["COMB_BUSY"], "RECV_CNT": sig["COMB_RECV_CNT"], "BLOCK_T": 16, "HC": 256,
                            "FMT": fmt, "OUT_F16": f16},
                           options={"enable_fp_fusion": False}))
    return cases


def _low_latency_cases() -> list[Case]:
    """Low-latency (decode) kernels, launched as ``SymmLowLatency`` does on a GPU; DeepSeek-V3 decode:
    128 tokens per rank, H=7168, 256 experts, top-8, EP8; message offsets from the backend's own carving."""
    from moe_ep.backends.symm_ll import _carve, _hdr
    from moe_ep.fp8 import tma_aligned_size
    from moe_ep.kernels import low_latency as k

    R, T, H, E, KT = 8, 128, 7168, 256, 8
    L, G, RT = E // R, H // 128, R * T
    sig = k.signal_layout(R)
    lay = _carve(T, H, R, E, KT)
    slot_base = lay.slot_bytes  # the second double-buffer slot
    offs = {"cnt_off": slot_base + lay.cnt_off, "msg_off": slot_base + lay.msg_off, "sig_off": sig["SLOT_WORDS"]}
    p2 = triton.next_power_of_2
    cases = []
    for fmt in ("FP8", "FP8 UE8M0", "BF16"):
        fp8, ue8m0 = fmt.startswith("FP8"), "UE8M0" in fmt
        gc = max(min(p2(G), 8), 4 if ue8m0 else 1)
        cases.append(_case(
            "ll_dispatch_send", f"{fmt} H={H} T={T} E={E} EP{R}", k._ll_dispatch_send_kernel,
            {"x_ptr": "*bf16" if fp8 else "*i16", "topk_ptr": "*i64", **_SYMM_PTRS},
            {"rank": _RANK, "N": T, "T": T, "L": L, "E": E, "R": R, "num_token_progs": T, "timeout_ns": _TIMEOUT_NS,
             **offs},
            {"H": H, "K": KT, "KP": KT, "MSG": lay.msg, "HDR": _hdr(H, fp8), "BLOCK_T": 1, "CHUNK_T": 32, "BLOCK_E": 64,
             "GC": gc, "HC": min(p2(H), 2048), "IS_FP8": fp8, "ROUND_SCALE": ue8m0, "USE_UE8M0": ue8m0,
             "NATIVE_FP8": fp8, "DISP_BUSY": sig["DISP_BUSY"], "DISP_FULL": sig["DISP_FULL"],
             "DISP_SEND_CNT": sig["DISP_SEND_CNT"]}))
        sw = ((G + 3) // 4 if ue8m0 else G) if fp8 else 1
        tm = tma_aligned_size(RT)
        cases.append(_case(
            "ll_dispatch_recv", f"{fmt} H={H} T={T} E={E} EP{R}", k._ll_dispatch_recv_kernel,
            {"buf_ptr": "*u8", "signal_ptrs": "*i64", "status_ptr": "*i32", "recv_x_ptr": "*u8" if fp8 else "*i16",
             "recv_s_ptr": "*i32", "recv_count_ptr": "*i32", "stats_ptr": "*i32", "wait_stats_ptr": "*i64",
             "slot_row_ptr": "*i32", "recv_tokens_ptr": "*i32"},
            {"stride_sl": sw * tm if fp8 else 0, "stride_sg": tm if fp8 else 0, "rank": _RANK, "T": T, "L": L, "R": R,
             "timeout_ns": _TIMEOUT_NS, **offs},
            {"H": H, "K": KT, "KP": KT, "MSG": lay.msg, "HDR": _hdr(H, fp8), "SW": sw, "SWP": p2(sw), "BLOCK_T": 4,
             "HC": min(p2(H), 2048 if fp8 else 1024), "RP": p2(R), "LP": p2(L), "IS_FP8": fp8, "HAS_STATS": True,
             "HAS_WAIT_STATS": True,
             "DISP_BUSY": sig["DISP_BUSY"], "DISP_FULL": sig["DISP_FULL"], "DISP_RECV_CNT": sig["DISP_RECV_CNT"]}))
    comb = {"comb_off": slot_base + lay.comb_off, "sig_off": sig["SLOT_WORDS"]}
    cases.append(_case(
        "ll_combine_send", f"BF16 H={H} T={T} E={E} EP{R}", k._ll_combine_send_kernel,
        {"x_ptr": "*i16", "slot_row_ptr": "*i32", "recv_tokens_ptr": "*i32", **_SYMM_PTRS},
        {"stride_xl": RT * H, "stride_xr": H, "rank": _RANK, "T": T, "R": R, "timeout_ns": _TIMEOUT_NS, **comb},
        {"H": H, "K": KT, "KP": KT, "BLOCK_T": 2, "HC": min(p2(H), 1024), "COMB_BUSY": sig["COMB_BUSY"],
         "COMB_FULL": sig["COMB_FULL"], "COMB_SEND_CNT": sig["COMB_SEND_CNT"]}))
    cases.append(_case(
        "ll_combine_recv", f"BF16 H={H} T={T} top-{KT} EP{R}", k._ll_combine_recv_kernel,
        {"buf_ptr": "*u8", "topk_ptr": "*i64", "w_ptr": "*fp32", "out_ptr": "*i16", "signal_ptrs": "*i64",
         "status_ptr": "*i32", "wait_stats_ptr": "*i64"},
        {"rank": _RANK, "N": T, "R": R, "timeout_ns": _TIMEOUT_NS, **comb},
        {"H": H, "K": KT, "BLOCK_T": 2, "HC": min(p2(H), 1024), "HAS_WAIT_STATS": True, "COMB_BUSY": sig["COMB_BUSY"],
         "COMB_FULL": sig["COMB_FULL"], "COMB_RECV_CNT": sig["COMB_RECV_CNT"]},
        options={"enable_fp_fusion": False}))
    # combine formats (moe_ep.kernels.logfmt): FP8 1x128 and LogFMT-10 encoded in the send, decoded in the receive
    for what, fmt, f16 in (("FP8 wire, BF16 x", 2, False), ("LogFMT-10 wire, BF16 x", 3, False),
                           ("FP8 wire, FP16 x", 2, True)):
        cases.append(_case(
            "ll_combine_send_fmt", f"{what} H={H} T={T} E={E} EP{R}", k._ll_combine_send_fmt_kernel,
            {"x_ptr": "*i16", "slot_row_ptr": "*i32", "recv_tokens_ptr": "*i32", **_SYMM_PTRS},
            {"stride_xl": RT * H, "stride_xr": H, "rank": _RANK, "T": T, "R": R, "timeout_ns": _TIMEOUT_NS, **comb},
            {"H": H, "K": KT, "KP": KT, "BLOCK_T": 2, "HC": min(p2(H), 1024), "COMB_BUSY": sig["COMB_BUSY"],
             "COMB_FULL": sig["COMB_FULL"], "COMB_SEND_CNT": sig["COMB_SEND_CNT"], "FMT": fmt, "IN_F16": f16,
             "NATIVE_FP8": fmt == 2}))
    for what, fmt, f16 in (("FP8 wire", 2, False), ("LogFMT-10 wire", 3, False), ("FP16 wire + out", 1, True)):
        cases.append(_case(
            "ll_combine_recv_fmt", f"{what} H={H} T={T} top-{KT} EP{R}", k._ll_combine_recv_fmt_kernel,
            {"buf_ptr": "*u8", "topk_ptr": "*i64", "w_ptr": "*fp32", "out_ptr": "*i16", "signal_ptrs": "*i64",
             "status_ptr": "*i32", "wait_stats_ptr": "*i64"},
            {"rank": _RANK, "N": T, "R": R, "timeout_ns": _TIMEOUT_NS, **comb},
            {"H": H, "K": KT, "BLOCK_T": 2, "HC": min(p2(H), 1024), "HAS_WAIT_STATS": True,
             "COMB_BUSY": sig["COMB_BUSY"], "COMB_FULL": sig["COMB_FULL"], "COMB_RECV_CNT": sig["COMB_RECV_CNT"],
             "FMT": fmt, "OUT_F16": f16},
            options={"enable_fp_fusion": False}))
    shipped = {c.kernel.__name__ for c in cases}
    jitted = {n for n, v in vars(k).items() if n.startswith("_ll_") and isinstance(v, triton.runtime.JITFunction)}
    jitted.discard("_ll_release_kernel")  # NVSHMEM transport only: a row of _nvshmem_cases
    if jitted != shipped:
        raise RuntimeError(f"low_latency.py kernels without a case here: {sorted(jitted - shipped)}")
    return cases


def _nvshmem_cases() -> list[Case]:
    """The low-latency kernels with ``TRANSPORT`` = NVSHMEM (the ``nvshmem`` backend), linked with NVSHMEM's sm_90
    device bitcode: DeepSeek-V3 decode shapes as in :func:`_low_latency_cases`, one configuration per kernel (each
    links the ~50 MB bitcode: 20-60 s to compile). Rows named ``nvshmem ...``. None, with one line on stderr, when no
    bitcode is installed (``pip install 'moe-ep[nvshmem]'``)."""
    from moe_ep import nvshmem
    from moe_ep.kernels import logfmt
    from moe_ep.kernels.transport import NVSHMEM

    try:
        options = {"extern_libs": nvshmem.extern_libs(TARGET_CC)}
    except FileNotFoundError as exc:
        print(f"sm90_report: no NVSHMEM rows ({str(exc).split('. Searched')[0]})", file=sys.stderr)
        return []
    from moe_ep.kernels import low_latency as k

    H, R = 7168, 8
    # The receives call no NVSHMEM function with this transport (the release is _ll_release_kernel): only the senders
    # and the release link the bitcode, launched with maxnreg=255 as SymmLowLatency does (the bitcode caps at 128).
    options = {**options, "maxnreg": 255}
    picked = {("ll_dispatch_send", "FP8 H="), ("ll_dispatch_send", "BF16 H="), ("ll_combine_send_fmt", "FP8 wire, BF16 x")}
    sig = k.signal_layout(R)
    cases = [_case("ll_release", f"EP{R} NVSHMEM", k._ll_release_kernel,
                   {"signal_ptrs": "*i64", "status_ptr": "*i32"}, {"rank": 3, "R": R, "sig_off": sig["SLOT_WORDS"]},
                   {"WORD": sig["DISP_BUSY"]}, num_warps=4, options=options)]
    for c in _low_latency_cases():
        if not any(c.name == n and c.config.startswith(p) for n, p in picked):
            continue
        const = {**c.constexprs, "TRANSPORT": NVSHMEM.value}
        if "ROW_BYTES" in const:
            const["ROW_BYTES"] = logfmt.row_bytes(const["FMT"], H)
        base = dataclasses.replace(c, name=f"nvshmem {c.name}", config=f"{c.config} NVSHMEM", constexprs=const,
                                   options={**(c.options or {}), **options})
        cases.append(base)
        if c.name == "ll_combine_send_fmt":  # the default combine: BF16 on the wire
            bf16 = {**const, "FMT": logfmt.FMT_BF16, "NATIVE_FP8": False, "ROW_BYTES": logfmt.row_bytes(logfmt.FMT_BF16, H)}
            cases.append(dataclasses.replace(base, config=c.config.replace("FP8 wire", "BF16 wire") + " NVSHMEM",
                                             constexprs=bf16))
    return cases


HOOK_PACKAGE = "moe_ep.kernels"


def _hook_modules() -> list[str]:
    """Modules of :data:`HOOK_PACKAGE` whose source defines ``sm90_cases()``, sorted by name (found by reading the
    sources, so modules without cases, e.g. ones that need an optional package, are never imported here)."""
    import pkgutil

    spec = importlib.util.find_spec(HOOK_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return []
    found = []
    for info in pkgutil.iter_modules(spec.submodule_search_locations):
        path = os.path.join(info.module_finder.path, info.name + ".py")
        try:
            with open(path, encoding="utf-8") as f:
                if re.search(r"^def sm90_cases\(", f.read(), re.MULTILINE):
                    found.append(f"{HOOK_PACKAGE}.{info.name}")
        except OSError:
            continue
    return sorted(found)


def _hook_cases() -> list[Case]:
    """HOOK: cases from ``sm90_cases()`` of every module :func:`_hook_modules` finds (the grouped GEMM, the
    mega-MoE kernel).

    Each item is a dict with keys ``name, config, kernel, signature, constexprs, num_warps, num_stages`` and
    optional ``attrs`` / ``options``. A module that fails to import, or whose cases are malformed, gives one
    FAILED row (not a skip, and not a crash that would hide the other rows)."""
    cases: list[Case] = []
    for name in _hook_modules():
        try:
            mod = importlib.import_module(name)
            cases += [Case(**d) for d in mod.sm90_cases()]
        except Exception as exc:  # noqa: BLE001 - reported as a row
            short = name.rsplit(".", 1)[-1]
            cases.append(Case(short, "sm90_cases()", None, {}, {}, 0, error=f"{type(exc).__name__}: {exc}"))
    return cases


def _all_cases() -> list[Case]:
    return [*_quant_cases(), *_layout_cases(), *_intranode_cases(), *_low_latency_cases(), *_hook_cases()]


CASES: list[Case] = _all_cases()


# ---------------------------------------------------------------------------------------------- output
COLUMNS = [("kernel", "kernel"), ("config", "config"), ("num_warps", "warps"), ("regs", "regs/thread"),
           ("spills", "spill st+ld (B)"), ("shared", "smem dyn+static (B)"), ("resident_warps", "warps/SM"),
           ("resident_blocks", "blocks/SM"), ("mma", "MMA"), ("tma", "TMA"), ("ld", "widest ld"), ("st", "widest st"),
           ("pdl", "PDL"), ("sys_acquire", "acquire .sys (waits)"), ("sys_release", "release .sys (signals)")]
# added when a row links NVSHMEM (--nvshmem)
NVSHMEM_COLUMNS = [("ibgda", "IBGDA doorbell"), ("nvshmem", "NVSHMEM calls (scope)")]


def _cell(row: dict, key: str) -> str:
    if "error" in row and key not in ("kernel", "config"):
        return "FAILED" if key == "num_warps" else ""
    if key == "spills":
        return f"{row['spill_stores']}+{row['spill_loads']}"
    if key in ("ld", "st"):
        return f"{row[key + '_bytes']} B" if row[key + "_bytes"] else "-"
    if key == "shared":
        return f"{row['shared_dynamic']}+{row['shared_static']}"
    if key == "tma":
        return "yes" if row["tma"] else "-"
    if key == "resident_warps":
        return f"{row['resident_warps']}/{H100['max_warps_per_sm']}"
    if key in ("ibgda", "nvshmem"):
        return _nvshmem_cell(row.get("nvshmem"), key)
    if key == "mma":
        return f"{row['mma']} {row['mma_shape']}".strip()
    if key == "sys_acquire" and row["sys_acquire"] != "-" and row.get("globaltimer"):
        return row["sys_acquire"] + " +timer"
    return str(row[key])


def _nvshmem_cell(scan: Optional[dict], key: str) -> str:
    """The NVSHMEM columns: ``-`` for kernels that do not link NVSHMEM."""
    if scan is None:
        return "-"
    if key == "ibgda":
        if scan["ibgda_doorbell"] and scan["ibgda_state"]:
            return f"yes ({scan['doorbell_stores']} st.mmio)"
        return "NO"
    calls = ", ".join(f"{n.replace('nvshmemx_', '').replace('nvshmem_', '')}: {s}"
                      for n, s in scan["entry_points"].items()) or "none"
    if scan["thread_scoped"]:
        calls += "; THREAD-SCOPED: " + ", ".join(scan["thread_scoped"])
    return calls


def format_table(rows: list[dict]) -> str:
    """The rows as one markdown table (with the NVSHMEM columns when a row links NVSHMEM)."""
    cols = COLUMNS + (NVSHMEM_COLUMNS if any("nvshmem" in r for r in rows) else [])
    lines = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(_cell(r, k) for k, _ in cols) + " |" for r in rows]
    return "\n".join(lines)


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_cases(cases: list[Case]) -> list[dict]:
    """One row per case (``kernel``, ``config`` plus :func:`compile_report`'s metrics, or ``error``)."""
    rows = []
    for c in cases:
        row = {"name": c.name, "config": c.config}
        if c.error is not None:
            row.update(kernel=c.name, error=c.error)
            rows.append(row)
            continue
        try:
            row.update(compile_report(c.kernel, c.signature, c.constexprs, c.num_warps, c.num_stages, c.attrs,
                                      c.options))
        except Exception as exc:  # noqa: BLE001 - one failing configuration must not hide the others
            row.update(kernel=getattr(c.kernel, "__name__", str(c.kernel)), error=f"{type(exc).__name__}: {exc}")
        rows.append(row)
    return rows


def main(argv: Optional[list[str]] = None) -> list[dict]:
    """Compile every case (or those matching ``--filter``), print the table, optionally write JSON; returns the rows."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="also write the rows (and triton version, date, commit) to this JSON file")
    ap.add_argument("--filter", default="", help="only cases whose name, kernel or config contains this substring")
    ap.add_argument("--nvshmem", action="store_true",
                    help="also the low-latency kernels with the NVSHMEM transport, linked with NVSHMEM's sm_90 bitcode "
                         "(rows 'nvshmem ...'; 20-60 s each; none without the bitcode)")
    args = ap.parse_args(argv)
    cases = CASES + (_nvshmem_cases() if args.nvshmem else [])
    sel = [c for c in cases if args.filter in f"{c.name} {getattr(c.kernel, '__name__', '')} {c.config}"]
    if not sel:
        raise SystemExit(f"no case matches --filter {args.filter!r}")
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"# sm90 resource report: triton {triton.__version__}, {date}, commit {_git_commit()}, "
          f"target sm_90a (H100: {H100['regs_per_sm']} regs, {H100['smem_per_sm'] // 1024} KB smem, "
          f"{H100['max_warps_per_sm']} warps per SM)\n")
    rows = run_cases(sel)
    print(format_table(rows))
    for r in rows:
        if "error" in r:
            print(f"\nFAILED {r['kernel']} [{r['config']}]: {r['error']}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "date": date, "commit": _git_commit(), "target": "sm_90a",
                       "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
