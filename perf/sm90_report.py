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

HOST CASES: the modules of ``_sm90_case.HOST_CASE_MODULES`` (``moe_ep.deepep.v2.expand``, ``moe_ep.gemm``, ``moe_ep.gemm.gluon``,
``moe_ep.gemm.mega_moe``) build their kernels' cases in ``sm90_cases()`` (a list of dicts with keys ``name, config, kernel,
signature, constexprs, num_warps, num_stages`` and optional ``attrs``, ``options``), appended to :data:`CASES` in that
order (see :func:`_host_cases`); the kernel modules stay leaves.

LAYOUT: this file is the driver (compile and PTX scan, CLI, table, JSON); the cases are built in
``perf/_sm90_case.py`` (the target, :class:`Case`, :func:`_case`, the host cases) and ``perf/_sm90_families.py``
(one builder per kernel family), both re-exported here.
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
import datetime  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Optional  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the helper modules next to this script
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated (silences its warning)

import triton  # noqa: E402

# The target, the case machinery and the host cases (perf/_sm90_case.py), the per-kernel-family cases
# (perf/_sm90_families.py): re-exported, the tests and compile scripts reach them through this module.
from _sm90_case import (  # noqa: E402,F401
    _RANK, _SYMM_PTRS, _TIMEOUT_NS, H100, HOST_CASE_MODULES, TARGET_CC, Case, _case, _host_cases)
from _sm90_families import (  # noqa: E402,F401
    _all_cases, _intranode_cases, _layout_cases, _low_latency_cases, _nvshmem_cases, _quant_cases)

__all__ = ["H100", "Case", "CASES", "compile_report", "resident_warps", "main"]


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
        sys_acquire, sys_release, globaltimer, div_rn, cp_async, compile_s`` (``sys_acquire`` / ``sys_release``:
        :func:`_sys_sync`; ``globaltimer``: the kernel reads ``%globaltimer``, as the bounded waits do; ``div_rn``:
        IEEE float32 divisions (``div.rn.f32``) in the PTX; ``cp_async``: ``cp.async.ca/cg`` copies, the
        software-pipelined loads of ``tl.range(num_stages=...)``); plus ``nvshmem``
        (:func:`moe_ep.testing.nvshmem_ptx.scan_nvshmem_ptx` of the PTX and TTIR) when ``options["extern_libs"]``
        links ``libnvshmem_device``.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moe_ep.kernels.gluon_compat import GluonASTSource, is_gluon_kernel

    source = GluonASTSource if is_gluon_kernel(kernel) else ASTSource  # @gluon.jit kernels have their own
    opts = {"num_warps": num_warps, "num_stages": num_stages, **(options or {})}
    t0 = time.perf_counter()
    ck, ptxas_log = _compile_with_ptxas_log(source(kernel, signature, constexprs, attrs or {}),
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
        "sys_release": _sys_sync(ptx, "release"), "globaltimer": "%globaltimer" in ptx,
        "div_rn": ptx.count("div.rn.f32"), "cp_async": len(re.findall(r"\bcp\.async\.c[ag]\.", ptx)),
        "compile_s": round(compile_s, 2),
        # warp specialisation: the wgmma.wait_group pendings (1: an MMA stays in flight while the previous
        # block is consumed) and the setmaxnreg register moves between partitions ("dec 40" / "inc 232")
        "wgmma_wait": sorted({int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)}),
        "setmaxnreg": sorted({f"{op} {n}" for op, n in re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)",
                                                                    ptx)}),
    }
    if "libnvshmem_device" in dict(opts.get("extern_libs") or {}):
        from moe_ep.testing.nvshmem_ptx import scan_nvshmem_ptx

        row["nvshmem"] = scan_nvshmem_ptx(ptx, ck.asm.get("ttir"))
    return row


# ---------------------------------------------------------------------------------------------- cases
CASES: list[Case] = _all_cases()


# ---------------------------------------------------------------------------------------------- output
COLUMNS = [("kernel", "kernel"), ("config", "config"), ("num_warps", "warps"), ("regs", "regs/thread"),
           ("spills", "spill st+ld (B)"), ("shared", "smem dyn+static (B)"), ("resident_warps", "warps/SM"),
           ("resident_blocks", "blocks/SM"), ("mma", "MMA"), ("wgmma_wait", "wgmma wait"), ("setmaxnreg", "setmaxnreg"),
           ("tma", "TMA"), ("ld", "widest ld"), ("st", "widest st"),
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
    if key in ("wgmma_wait", "setmaxnreg"):
        return ", ".join(str(v) for v in row[key]) or "-"
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
