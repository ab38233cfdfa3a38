"""Shared helpers of the ``perf/bench_*.py`` scripts: argument parsing conventions, the JSON-lines
records (a header object, then one object per measured row), timing with median / p10 / p90, the
validity check of every timed case, progress lines and the exit status.

Conventions every bench follows:

- ``--cpu-smoke`` runs the CPU variant (Triton interpreter, tiny shapes picked by the bench, numbers
  meaningless) and never overrides an option the user gave explicitly;
- ``--json PATH`` writes JSON lines: first ``header(...)``, then one ``ROW_KEYS`` object per row, each naming how
  it was timed (``method``: one of ``perf/_method.py``'s ``METHODS``, re-exported here; see perf/README.md);
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

from _method import (COUNTED, CPU_WALL, EAGER, EAGER_WRITE_FLUSH, GRAPH_N, GRAPH_SINGLE, METHODS,  # noqa: F401
                     PROFILER, L2Flush, Timing, aggregate_kernels, copy_limit, copy_single, describe, kernel_times,
                     l2_bytes, measure, quantiles, rotation_plan, time_graph_n, time_single)

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

HEADER_KEYS = ("kind", "bench", "commit", "dirty", "date", "device", "python", "torch", "triton", "cuda",
               "driver", "nccl", "cpu-smoke", "argv")
ROW_KEYS = ("bench", "case", "metric", "value", "unit", "p10", "p90", "iterations", "baseline", "limit", "ratio",
            "valid", "l2_resident", "note", "method")
# the state of the GPU, queried before the first and after the last measurement (header keys gpu_before / gpu_after)
GPU_QUERY = ("clocks.sm", "clocks.mem", "power.limit", "temperature.gpu")
VIRTUAL_NOTE = "virtual ranks: no NVLink, no cross-GPU waits"


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


TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def torchrun_env_error(prog: str, example: str) -> int | None:
    """``None`` when torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``) is set; otherwise one line on
    stderr naming what is missing and how to run it (``example``), and exit status 2."""
    missing = [k for k in TORCHRUN_ENV if k not in os.environ]
    if missing:
        return error(prog, f"--launcher torchrun needs {', '.join(missing)} in the environment: run it as `{example}`", 2)
    return None


class torchrun_nccl:
    """``with torchrun_nccl() as (rank, world, device):`` one process per GPU under torchrun: this rank's GPU
    (``LOCAL_RANK``) made current, an NCCL process group over every rank, destroyed on exit."""

    def __enter__(self):
        import torch
        import torch.distributed as dist

        rank, world, local = (int(os.environ[k]) for k in TORCHRUN_ENV)
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return rank, world, device

    def __exit__(self, *exc):
        import torch.distributed as dist

        dist.destroy_process_group()
        return False


def torchrun_records(prog: str, json_path, argv, rank: int, world: int, device):
    """``(Records, say)`` of a torchrun bench rank: rank 0 writes the JSON (``json_path``) and prints to stderr, the
    other ranks do neither."""
    import torch

    name = torch.cuda.get_device_name(device)
    rec = Records(prog[:-3], json_path if rank == 0 else None, False, device=f"{world} x {name}", argv=argv)
    say = (lambda *a, **k: print(*a, file=sys.stderr, flush=True)) if rank == 0 else (lambda *a, **k: None)
    return rec, say


def deepep_probe(disabled: bool = False):
    """``(deep_ep module or None, one line saying which)``: DeepEP is the baseline of the torchrun benches when
    ``import deep_ep`` works (nothing is installed or downloaded here)."""
    if disabled:
        return None, "DeepEP baseline: skipped (--no-deepep); rows carry baseline=null"
    try:
        import deep_ep
    except Exception as exc:  # noqa: BLE001 - ImportError or a broken extension: skipped with one line
        return None, (f"DeepEP baseline: skipped, deep_ep is not importable ({type(exc).__name__}: "
                      f"{str(exc).splitlines()[0][:100] if str(exc) else ''}); rows carry baseline=null")
    if not hasattr(deep_ep, "Buffer"):
        return None, "DeepEP baseline: skipped, deep_ep has no Buffer; rows carry baseline=null"
    return deep_ep, f"DeepEP baseline: deep_ep {getattr(deep_ep, '__version__', '(version unknown)')} " \
                    f"({os.path.dirname(getattr(deep_ep, '__file__', '') or '')})"


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


def gpu_state(index: int | None = None) -> list | None:
    """Per GPU ``{clocks.sm, clocks.mem, power.limit, temperature.gpu}`` from nvidia-smi (a value it cannot give
    is ``None``; no nvidia-smi or no GPU: ``None``). ``index``: only that GPU (a one-element list)."""
    smi = shutil.which("nvidia-smi")
    if not smi or os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return None
    cmd = [smi, f"--query-gpu={','.join(GPU_QUERY)}", "--format=csv,noheader"]
    if index is not None:
        cmd.append(f"--id={index}")
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0 or not r.stdout.strip():
        return None
    return [parse_gpu_state(line) for line in r.stdout.strip().splitlines()]


def parse_gpu_state(line: str) -> dict:
    """One nvidia-smi CSV line (``1980 MHz, 2619 MHz, 700.00 W, 34``) -> numbers; ``[N/A]`` etc. -> ``None``."""
    out = {}
    cells = [c.strip() for c in line.split(",")]
    for key, cell in zip(GPU_QUERY, cells + [""] * (len(GPU_QUERY) - len(cells))):
        try:
            out[key] = float(cell.split()[0])
        except (ValueError, IndexError):
            out[key] = None
    return out


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
            "argv": list(sys.argv[1:] if argv is None else argv),
            "gpu_before": None if smoke else gpu_state(), "gpu_after": None, "limits": {}}


class Records:
    """Collects the rows of one run; writes JSON lines to ``path`` (header first) when given."""

    def __init__(self, bench: str, path: str | None, smoke: bool, device: str | None = None, argv=None,
                 method: str | None = None):
        self.bench, self.path, self.rows = bench, path, []
        self.method = method  # a row's method unless it names its own
        self.header = header(bench, smoke, device, argv)
        if path:
            d = os.path.dirname(os.path.abspath(path))
            os.makedirs(d, exist_ok=True)
            with open(path, "w") as f:
                f.write(json.dumps(self.header) + "\n")

    def update_header(self, **kw) -> None:
        """Add keys to the header (e.g. ``limits``, ``gpu_after``) and rewrite the file's first line."""
        self.header.update(kw)
        if self.path and os.path.exists(self.path):
            with open(self.path) as f:
                lines = f.readlines()
            lines[:1] = [json.dumps(self.header, default=float) + "\n"]
            with open(self.path, "w") as f:
                f.writelines(lines)

    def add(self, case: str, metric: str, value, unit: str, p10=None, p90=None, iterations=None, baseline=None,
            limit=None, ratio=None, valid=True, l2_resident=None, note=None, method=None, **extra) -> dict:
        """One row. ``l2_resident``: True when the timed working set stayed in L2 between iterations (no flush, or
        it fits), False when flushed / larger than L2, None when unknown (CPU). ``note``: caveats of the row,
        e.g. :data:`VIRTUAL_NOTE`. ``method``: how it was timed, one of :data:`METHODS` (default: the one given to
        the constructor; a CPU smoke run's timed rows are ``cpu-wall``); a row without one is refused."""
        method = method or self.method
        if self.header.get("cpu-smoke") and method != COUNTED:
            method = CPU_WALL
        if method not in METHODS:
            raise ValueError(f"row {case!r}: method {method!r} is not one of {', '.join(METHODS)}")
        row = {"bench": self.bench, "case": case, "metric": metric, "value": value, "unit": unit, "p10": p10,
               "p90": p90, "iterations": iterations, "baseline": baseline, "limit": limit, "ratio": ratio,
               "valid": bool(valid), "l2_resident": l2_resident, "note": note, "method": method,
               "method_detail": METHODS[method], **extra}
        self.rows.append(row)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(row, default=float) + "\n")
        return row

    def invalid(self) -> list:
        return [r for r in self.rows if not r["valid"]]

    def finish(self, prog: str) -> int:
        """Exit status: 1 with one stderr line when nothing was measured or a case was INVALID, else 0. Records the
        GPU state after the run in the header (``gpu_after``)."""
        if not self.header.get("cpu-smoke"):
            self.update_header(gpu_after=gpu_state())
        bad = self.invalid()
        if not self.rows:
            return error(prog, "measured nothing (no case ran)")
        if bad:
            cases = ", ".join(sorted({r["case"] for r in bad}))
            print(f"INVALID: {len(bad)} of {len(self.rows)} rows failed their check against the reference ({cases})")
            return error(prog, f"INVALID: {len(bad)} rows failed the check against the reference")
        return 0


def fits_l2(nbytes, device=None) -> bool | None:
    """Whether ``nbytes`` fit in the device's L2 (None on CPU / unknown). A row whose bytes fit in L2 and were not
    flushed must not be compared against the HBM copy limit without saying so."""
    lb = l2_bytes(device)
    return None if not lb else bool(nbytes <= lb)


def time_us(fn, device=None, iters: int = 5, warmup: int = 1, between=None, flush: bool = True,
            barrier=None, write_flush: bool = False) -> Timing:
    """``eager-host`` (a replayed graph's ``replay`` as ``fn``: see :func:`graph_fn`): median / p10 / p90
    microseconds of ``fn()`` over ``iters`` calls after ``warmup`` untimed calls.

    GPU: CUDA events around each call, so the host's Python and launch are inside; before each timed call (outside
    the events) the L2 is flushed by a read (``flush``, :class:`L2Flush`; ``write_flush``: the earlier ``zero_()``
    flush, ``eager-write-flush``), ``between()`` runs, then ``barrier()`` (multi-rank cases: every rank starts
    together). CPU: ``time.perf_counter``. The flush buffer is allocated once per call of this function."""

    cuda = device is not None and getattr(device, "type", device) == "cuda"
    return quantiles(_timed_samples(fn, device, cuda, iters, warmup, between, flush, barrier, write_flush))


def _timed_samples(fn, device, cuda: bool, iters: int, warmup: int, between, flush: bool, barrier,
                   write_flush: bool = False) -> list:
    """Microseconds of each of ``iters`` timed calls of ``fn`` (the loop shared by :func:`time_us` and
    :func:`time_ranks`): warm-up, then per call an L2 flush, ``between()`` and ``barrier()`` outside the timed
    region, CUDA events on a GPU, ``time.perf_counter`` on a CPU."""
    import torch

    fl = L2Flush(device, write=write_flush) if (cuda and flush) else None
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize(device)
    out = []
    for _ in range(max(1, iters)):
        if fl is not None:
            fl()
        if between is not None:
            between()
        if barrier is not None:
            barrier()
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
    return out


def how_method(how: str | None) -> str:
    """The ``method`` of a row timed by :func:`time_us` / :func:`time_ranks`, from the bench's ``how`` line: a
    replayed CUDA graph (events around one replay after a read-only flush) is ``graph-single``; eager launches are
    ``eager-host``; CPU (or a capture that fell back to eager on CPU) is ``cpu-wall``."""
    h = (how or "").lower()
    if h.startswith("cuda graph"):
        return GRAPH_SINGLE
    if h.startswith("cpu") or "(cpu)" in h:
        return CPU_WALL
    return EAGER


def graph_fn(fn, device):
    """``(replay, out, note)``: ``fn`` captured in a CUDA graph (after one eager warm-up call on a side stream);
    ``replay()`` replays it and ``out`` is the captured call's output (refreshed by each replay). When capture
    fails, ``replay`` is ``fn`` itself, ``out`` its eager output and ``note`` says why (else ``note`` is None)."""
    import torch

    if getattr(device, "type", device) != "cuda":
        return fn, fn(), "eager (CPU)"
    s = torch.cuda.Stream(device)
    s.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream(device).wait_stream(s)
    torch.cuda.synchronize(device)
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            out = fn()
    except Exception as exc:  # noqa: BLE001 - any capture failure falls back to eager, said in the row
        torch.cuda.synchronize(device)
        return fn, fn(), f"eager launches (CUDA graph capture failed: {type(exc).__name__}: {str(exc)[:80]})"
    g.replay()
    torch.cuda.synchronize(device)
    return g.replay, out, None


def time_ranks(fn, device, group=None, iters: int = 20, warmup: int = 3, flush: bool = True, between=None):
    """Multi-rank timing (one process per rank, torch.distributed initialised; CUDA or, with gloo, CPU tensors;
    ``between()`` runs before each barrier, outside the timed region): a barrier before each timed
    iteration, CUDA events per rank, then the per-iteration times are gathered and, per iteration, the slowest
    rank's time is taken. Returns ``(slowest: Timing, per_rank_medians: list[float])`` on every rank."""
    import torch
    import torch.distributed as dist

    cuda = getattr(device, "type", device) == "cuda"

    def barrier():
        dist.barrier(group=group)
        if cuda:
            torch.cuda.synchronize(device)
    samples = _timed_samples(fn, device, cuda, iters, warmup, between, flush, barrier)
    mine = torch.tensor(samples, dtype=torch.float64, device=device if cuda else "cpu")
    allt = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(allt, mine, group=group)
    allt = torch.stack(allt).cpu()  # [ranks, iters]
    return quantiles(allt.max(0).values.tolist()), [quantiles(r.tolist()).median for r in allt]


def measure_limits(device, peer: bool = True, fp8: bool = True, size: int = 1 << 30) -> dict:
    """The physical limits of this run, measured now (GPU; on CPU only a small ``copy_gbps``):

    - ``copy_gbps``: device-to-device copy of ``size`` bytes (read + write counted once, as a copy of the
      payload: bytes / time), far larger than L2;
    - ``peer_gbps``: ``tensor.to('cuda:1')`` of ``size`` bytes (peer copy over NVLink/PCIe; two or more GPUs), else None;
    - ``fp8_tflops``: ``torch._scaled_mm`` e4m3 x e4m3 -> BF16 on an 8192 square (None when unavailable);
    - ``l2_bytes``: the L2 size (rows whose bytes fit in it are not compared with ``copy_gbps`` unflushed)."""
    import torch

    cuda = getattr(device, "type", device) == "cuda"
    out = {"copy_gbps": None, "peer_gbps": None, "fp8_tflops": None, "l2_bytes": l2_bytes(device) or None}
    n = size if cuda else (1 << 24)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = time_us(lambda: dst.copy_(src), device, iters=10 if cuda else 3, warmup=2, flush=False)
    out["copy_gbps"] = n / t.median / 1e3
    del src, dst
    if not cuda:
        return out
    if peer and torch.cuda.device_count() >= 2:
        try:
            other = torch.device("cuda", (device.index + 1) % torch.cuda.device_count())
            src = torch.empty(size, dtype=torch.uint8, device=device)
            dst = torch.empty(size, dtype=torch.uint8, device=other)
            t = time_us(lambda: dst.copy_(src, non_blocking=True), device, iters=10, warmup=2, flush=False)
            torch.cuda.synchronize(other)
            out["peer_gbps"] = size / t.median / 1e3
            del src, dst
        except Exception as exc:  # noqa: BLE001 - recorded, never fatal
            out["peer_note"] = f"{type(exc).__name__}: {str(exc)[:80]}"
    if fp8 and hasattr(torch, "_scaled_mm") and hasattr(torch, "float8_e4m3fn"):
        try:
            m = 8192
            a = torch.randn(m, m, device=device).to(torch.float8_e4m3fn)
            b = torch.randn(m, m, device=device).to(torch.float8_e4m3fn)
            one = torch.ones((), device=device)
            t = time_us(lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                                 use_fast_accum=True), device, iters=10, warmup=3, flush=False)
            out["fp8_tflops"] = 2 * m ** 3 / t.median / 1e6
            del a, b
        except Exception as exc:  # noqa: BLE001
            out["fp8_note"] = f"{type(exc).__name__}: {str(exc)[:80]}"
    return out


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
