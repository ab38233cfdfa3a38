"""The GPU lease kit's in-process stages (``perf/gpu_lease.py`` runs each as a subprocess with a deadline).

    python perf/lease_checks.py env    --json R --text ENV     # versions, device, clocks, runtime
    python perf/lease_checks.py checks --json R [--shapes S]   # compiled kernels against their references
    python perf/lease_checks.py method --json R [--shapes S]   # the method split, then quant / map_topk
    python perf/lease_checks.py time   --json R [--shapes S]   # headline numbers, each with its limit
    python perf/lease_checks.py ll     --json R [--shapes S]   # low-latency kernels per peer (a + b*R), decode layer

Every case is one JSON line in ``R`` (appended and flushed as soon as it ends, so a timeout keeps every
earlier row): ``{"stage", "case", "ok", "seconds", "detail", ...}``. A failing or crashing case is a row
with ``ok: false``, never an exception out of this script. Without a GPU (``TRITON_INTERPRET=1``) the same
cases run in the interpreter on CPU tensors at the tiny shapes (``--shapes tiny``): the machinery is checked, the
timings mean nothing. Shapes: ``small`` (seconds to compile and run) and ``dsv3`` (DeepSeek-V3: hidden 7168,
256 experts, top-8, intermediate 2048, decode T=128 per rank, EP8 on virtual ranks of the one GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _common  # noqa: E402
import lease_cases as cases  # noqa: E402
import lease_ll  # noqa: E402
import lease_method  # noqa: E402
import lease_timings  # noqa: E402


class Sink:
    """Appends one JSON object per case to ``path`` (flushed at once) and prints a one-line summary."""

    def __init__(self, path: str | None, stage: str):
        self.path, self.stage = path, stage
        self.failed = 0

    def write(self, row: dict) -> None:
        row = {"stage": self.stage, **row}
        if not row.get("ok", False):
            self.failed += 1
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(row, default=str) + "\n")
                f.flush()
        extra = " ".join(f"{k}={v}" for k, v in row.items() if k not in ("stage", "case", "ok", "seconds", "detail"))
        print(f"{'ok  ' if row.get('ok') else 'FAIL'} {row['case']:<34} {row.get('seconds', 0):7.2f} s  "
              f"{row.get('detail', '')} {extra}".rstrip(), flush=True)

    def run(self, name: str, fn, *args, **kwargs) -> None:
        t0 = time.perf_counter()
        try:
            res = fn(*args, **kwargs) or {}
            ok, detail = bool(res.pop("ok", True)), res.pop("detail", "")
        except Exception as exc:  # noqa: BLE001 - a failure is a row
            res, ok = {}, False
            detail = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            traceback.print_exc(limit=6)
        sync()
        self.write({"case": name, "ok": ok, "seconds": round(time.perf_counter() - t0, 3), "detail": detail, **res})


def sync() -> None:
    import torch

    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - a sticky CUDA error is reported by the next case
            pass


def _cmd(*argv, timeout=20) -> str:
    if not shutil.which(argv[0]):
        return "not found"
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        return (p.stdout or p.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"failed: {exc}"


def _version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def env(args) -> int:
    import numpy
    import torch
    import triton

    lines = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "commit": _common._git("rev-parse", "--short=12", "HEAD") or "unknown",
        "python": platform.python_version(),
        "torch": torch.__version__, "torch.cuda": str(torch.version.cuda), "triton": triton.__version__,
        "numpy": numpy.__version__,
        "nvshmem": ", ".join(f"{d} {_version(d)}" for d in ("nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12")),
        "cupy": _version("cupy-cuda13x"),
        "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", ""),
        "nvcc": _cmd("nvcc", "--version").splitlines()[-1] if shutil.which("nvcc") else "not found",
        "compute-sanitizer": "found" if shutil.which("compute-sanitizer") else "not found",
    }
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        p = torch.cuda.get_device_properties(0)
        lines.update({
            "device": p.name, "sm": f"{p.major}.{p.minor}", "SMs": p.multi_processor_count,
            "L2 MiB": round(getattr(p, "L2_cache_size", 0) / 2 ** 20, 1), "memory GiB": round(p.total_memory / 2 ** 30, 1),
            "cuda runtime": torch.cuda.get_device_capability(0) and torch.version.cuda,
            "driver/clocks": _cmd("nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.max.sm,clocks.mem,"
                                  "power.limit,temperature.gpu", "--format=csv,noheader"),
            "peer access (one GPU)": "n/a",
        })
    else:
        lines["device"] = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores), Triton interpreter"
    text = "\n".join(f"{k}: {v}" for k, v in lines.items())
    print(text, flush=True)
    if args.text:
        with open(args.text, "w") as f:
            f.write(text + "\n")
    Sink(args.json, "env").write({"case": "env", "ok": True, "seconds": 0.0, "detail": lines["device"], **lines})
    return 0


def checks(args) -> int:
    sink = Sink(args.json, args.stage or "checks")
    for name, fn, kw in cases.check_cases(args.shapes):
        name = f"{name} [{args.tag}]" if args.tag else name
        if args.only and not any(o in name for o in args.only):
            continue
        sink.run(name, fn, **kw)
    return 1 if sink.failed else 0


def timings(args) -> int:
    sink = Sink(args.json, args.stage or "time")
    for name, fn, kw in lease_timings.time_cases(args.shapes, args.iters):
        if args.only and not any(o in name for o in args.only):
            continue
        sink.run(name, fn, **kw)
    return 1 if sink.failed else 0


def low_latency(args) -> int:
    sink = Sink(args.json, args.stage or "ll")
    for name, fn, kw in lease_ll.ll_cases(args.shapes, args.iters):
        if args.only and not any(o in name for o in args.only):
            continue
        sink.run(name, fn, **kw)
    return 1 if sink.failed else 0


def method(args) -> int:
    sink = Sink(args.json, args.stage or "method")
    for name, fn, kw in lease_method.method_cases(args.shapes):
        if args.only and not any(o in name for o in args.only):
            continue
        sink.run(name, fn, **kw)
    return 1 if sink.failed else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("env", "checks", "method", "time", "ll"))
    p.add_argument("--json", help="append one JSON line per case here")
    p.add_argument("--text", help="env: also write the lines here")
    p.add_argument("--shapes", choices=tuple(cases.SHAPES), default="small",
                   help="checks: this shape set (tiny: the CPU dry run); method, time, ll: tiny or DeepSeek-V3 "
                   "(any other)")
    p.add_argument("--stage", help="the stage name written in each row (default: the subcommand's)")
    p.add_argument("--tag", help="appended to each case name (e.g. the sanitizer tool running it)")
    p.add_argument("--iters", type=int, default=10, help="time, ll: timed calls per case")
    p.add_argument("--only", nargs="*", help="only cases whose name contains one of these")
    args = p.parse_args(argv)
    if args.what != "env" and os.environ.get("TRITON_INTERPRET") != "1":
        import torch

        if not torch.cuda.is_available():
            print("lease_checks.py: error: no CUDA device; set TRITON_INTERPRET=1 and pass --tiny for the CPU run",
                  file=sys.stderr)
            return 2
    return {"env": env, "checks": checks, "method": method, "time": timings, "ll": low_latency}[args.what](args)


if __name__ == "__main__":
    sys.exit(main())
