"""Shared helpers of the ``perf/bench_*.py`` scripts: argument parsing conventions, the JSON-lines
records (a header object, then one object per measured row), timing with median / p10 / p90, the
validity check of every timed case, progress lines and the exit status.

Conventions every bench follows:

- ``--cpu-smoke`` runs the CPU variant (Triton interpreter, tiny shapes picked by the bench, numbers
  meaningless) and never overrides an option the user gave explicitly;
- ``--json PATH`` writes JSON lines: first ``header(...)``, then one ``ROW_KEYS`` object per row;
- after timing, every case is checked against its reference; a mismatch prints ``INVALID`` and the
  bench exits 1; a bench that measured nothing exits 1 with one line on stderr; no GPU (and no
  ``--cpu-smoke``) exits 2 with one line on stderr.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

HEADER_KEYS = ("kind", "bench", "commit", "dirty", "date", "device", "python", "torch", "triton", "cuda",
               "driver", "nccl", "cpu-smoke", "argv")
ROW_KEYS = ("bench", "case", "metric", "value", "unit", "p10", "p90", "iterations", "baseline", "limit", "ratio",
            "valid")


def smoke_env(argv=None) -> bool:
    """Set TRITON_INTERPRET=1 when ``--cpu-smoke`` is on the command line; call before importing triton/moe_ep."""
    argv = sys.argv[1:] if argv is None else argv
    if "--cpu-smoke" in argv:
        os.environ["TRITON_INTERPRET"] = "1"
        return True
    return False


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Keeps the module docstring's layout and shows every option's default."""


def parser(prog: str, doc: str, smoke_help: str | None = None) -> argparse.ArgumentParser:
    """An ArgumentParser with the shared options ``--cpu-smoke`` and ``--json``."""
    p = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=HelpFormatter, allow_abbrev=False)
    p.add_argument("--cpu-smoke", action="store_true",
                   help=smoke_help or "run the CPU variant: Triton interpreter, tiny shapes picked by the bench "
                                      "unless given explicitly (numbers meaningless; checks the code paths)")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="also write JSON lines here: a header object (commit, date, device, versions), then one "
                        "object per row")
    return p


def given(p: argparse.ArgumentParser, argv=None) -> set:
    """The ``dest`` of every option the user wrote on the command line (abbreviations are disabled)."""
    argv = sys.argv[1:] if argv is None else argv
    flags = {a.split("=", 1)[0] for a in argv if a.startswith("-")}
    return {act.dest for act in p._actions if flags & set(act.option_strings)}


def smoke_defaults(args, p: argparse.ArgumentParser, argv=None, **tiny) -> None:
    """Under ``--cpu-smoke``, set each ``tiny`` value unless the user gave that option."""
    explicit = given(p, argv)
    for k, v in tiny.items():
        if k not in explicit:
            setattr(args, k, v)


def error(prog: str, msg: str, code: int = 1) -> int:
    """One line on stderr; returns ``code`` (``return error(...)`` from main)."""
    print(f"{prog}: error: {msg}", file=sys.stderr, flush=True)
    return code


def no_gpu(prog: str) -> int:
    return error(prog, "needs a CUDA GPU (none found); use --cpu-smoke to run the CPU variant", 2)


def gpu_count() -> int:
    """GPUs per nvidia-smi (CUDA stays uninitialised in this process, so ranks may still fork)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return 0
    smi = shutil.which("nvidia-smi")
    if not smi:
        return 0
    try:
        r = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return r.stdout.count("GPU ") if r.returncode == 0 else 0


def _git(*args) -> str:
    try:
        r = subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, timeout=20)
        return r.stdout.strip() if r.returncode == 0 else ""
    except (OSError, subprocess.TimeoutExpired):
        return ""


def header(bench: str, smoke: bool, device: str | None = None, argv=None) -> dict:
    """Where and with what a run happened: git commit and dirty flag, date, device, versions."""
    import torch

    try:
        import triton
        triton_v = triton.__version__
    except ImportError:
        triton_v = None
    cuda = driver = nccl = None
    if torch.version.cuda and not smoke:
        cuda = torch.version.cuda
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - optional information
            nccl = None
        smi = shutil.which("nvidia-smi")
        if smi:
            r = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                               text=True)
            driver = r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else None
    if device is None:
        device = (torch.cuda.get_device_name() if (not smoke and torch.cuda.is_available())
                  else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)")
    commit = _git("rev-parse", "--short=12", "HEAD") or None
    return {"kind": "header", "bench": bench, "commit": commit, "dirty": bool(_git("status", "--porcelain")),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "device": device,
            "python": platform.python_version(), "torch": torch.__version__, "triton": triton_v, "cuda": cuda,
            "driver": driver, "nccl": nccl, "cpu-smoke": bool(smoke),
            "argv": list(sys.argv[1:] if argv is None else argv)}


class Records:
    """Collects the rows of one run; writes JSON lines to ``path`` (header first) when given."""

    def __init__(self, bench: str, path: str | None, smoke: bool, device: str | None = None, argv=None):
        self.bench, self.path, self.rows = bench, path, []
        self.header = header(bench, smoke, device, argv)
        if path:
            d = os.path.dirname(os.path.abspath(path))
            os.makedirs(d, exist_ok=True)
            with open(path, "w") as f:
                f.write(json.dumps(self.header) + "\n")

    def add(self, case: str, metric: str, value, unit: str, p10=None, p90=None, iterations=None, baseline=None,
            limit=None, ratio=None, valid=True, **extra) -> dict:
        row = {"bench": self.bench, "case": case, "metric": metric, "value": value, "unit": unit, "p10": p10,
               "p90": p90, "iterations": iterations, "baseline": baseline, "limit": limit, "ratio": ratio,
               "valid": bool(valid), **extra}
        self.rows.append(row)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(row, default=float) + "\n")
        return row

    def invalid(self) -> list:
        return [r for r in self.rows if not r["valid"]]

    def finish(self, prog: str) -> int:
        """Exit status: 1 with one stderr line when nothing was measured or a case was INVALID, else 0."""
        bad = self.invalid()
        if not self.rows:
            return error(prog, "measured nothing (no case ran)")
        if bad:
            cases = ", ".join(sorted({r["case"] for r in bad}))
            print(f"INVALID: {len(bad)} of {len(self.rows)} rows failed their check against the reference ({cases})")
            return error(prog, f"INVALID: {len(bad)} rows failed the check against the reference")
        return 0


class Timing(tuple):
    """``(median, p10, p90, iterations)`` in microseconds."""

    median = property(lambda s: s[0])
    p10 = property(lambda s: s[1])
    p90 = property(lambda s: s[2])
    n = property(lambda s: s[3])


def quantiles(samples) -> Timing:
    xs = sorted(samples)
    n = len(xs)

    def q(f):
        pos = f * (n - 1)
        lo = int(pos)
        hi = min(lo + 1, n - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
    return Timing((q(0.5), q(0.1), q(0.9), n))


def time_us(fn, device=None, iters: int = 5, warmup: int = 1, between=None) -> Timing:
    """Median / p10 / p90 microseconds of ``fn()`` over ``iters`` calls after ``warmup`` (CUDA events on a GPU,
    ``time.perf_counter`` on CPU). ``between()`` runs untimed before each call (a barrier, an L2 flush)."""
    import torch

    cuda = device is not None and getattr(device, "type", device) == "cuda"
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(max(1, iters)):
        if between is not None:
            between()
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e6)
    return quantiles(out)


def rel_err(out, ref) -> float:
    """max |out - ref| / max |ref| (float32); ``inf`` on shape mismatch or non-finite values."""

    if tuple(out.shape) != tuple(ref.shape):
        return float("inf")
    o, r = out.float(), ref.float()
    err = (o - r).abs().max().item() if o.numel() else 0.0
    scale = r.abs().max().item() if r.numel() else 0.0
    val = err / max(scale, 1e-30) if scale > 0 else err
    return val if val == val else float("inf")


def close(out, ref, tol: float) -> bool:
    """The validity check: ``rel_err(out, ref) <= tol`` (tol 0: bitwise equal)."""
    return rel_err(out, ref) <= tol


class Progress:
    """``n/total desc`` progress on stderr: tqdm when installed, plain lines otherwise."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.i, self.t0 = total, desc, 0, time.monotonic()
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False)
        except ImportError:
            self.bar = None

    def step(self, what: str = "") -> None:
        self.i += 1
        if self.bar is not None:
            self.bar.set_postfix_str(what)
            self.bar.update(1)
        else:
            print(f"  [{self.i}/{self.total}] {self.desc} {what} ({time.monotonic() - self.t0:.0f} s)",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def table_header(cols) -> str:
    return "| " + " | ".join(cols) + " |\n" + "|" + " --- |" * len(cols)
