"""The one command for a short GPU lease (``bash perf/gpu_lease.sh``): stages in priority order under one budget.

    bash perf/gpu_lease.sh [--budget SECONDS (540)] [--dry-run] [--only STAGE ...]

Each stage is a subprocess with a deadline taken from what is left of the budget (``min(cap, left - reserve)``);
it writes its rows as it goes and its summary row the moment it ends, so a timeout, a crash or a lost machine
still leaves every earlier answer. Stages (GPU):

1. ``env``: versions (python, torch, CUDA, triton, numpy, NVSHMEM, CuPy, nvcc) and the device (name, SMs, L2,
   memory, driver, clocks);
2. ``method`` (``perf/lease_method.py``): the first timed stage: the quant 4096x7168 call timed by the earlier
   method (eager after a ``zero_()`` flush) split into flush write-back, host gap and kernel, then quant (prefill
   4096x7168, decode 128x7168), SiLU-and-mul quant 4096x2048 (x2) and ``eplb.map_topk`` (4096x8, 272 slots / 8
   GPUs, static and balanced; the per-rank decode call, 32 tokens) by the method of ``perf/_method.py``, each
   with its copy limit measured by the same method on the same bytes;
3. ``ll`` (``perf/lease_ll.py``): per-kernel times (``profiler-kernels``) of low-latency dispatch send / receive
   and combine send / receive at 2, 4 and 8 virtual ranks, each phase's time per rank fitted as ``a + b*R``
   (least squares: ``a``, ``b`` = the cost of one more peer, the residual), then one decode ``MoELayer`` step
   (one rank holding 32 experts, T 128) captured in a CUDA graph (``graph-single``) beside its eager call;
4. ``gemm-gluon`` (``perf/lease_gemm_gluon.py --json gemm_gluon.jsonl --iters 10``): the Gluon FP8 GEMM and the
   ``tl`` one at the DeepSeek-V3 expert shapes, numerics first (a kernel that fails is not timed, the stage
   fails), then against ``torch._scaled_mm`` and BF16 ``bmm``; its rows go to ``gemm_gluon.jsonl``;
5. ``kernels-small``: compiled kernels against their references (``perf/lease_cases.py``): quant and SiLU quant
   (bitwise), grouped GEMMs contiguous and masked, low-latency and normal dispatch / combine and the combine
   formats on virtual ranks (bitwise), the expand gather, ``map_topk``, mega-MoE on a one-rank group;
6. ``graphs``: the CUDA-graph tests (``pytest -m gpu -k graph``: decode MoELayer, two-microbatch decode,
   symm low-latency virtual ranks, ``map_topk``), every replay equal to eager;
7. ``gemm-api``: DeepGEMM's dense / grouped / BF16 / psum surface (``perf/_gpu_check_gemm.py``);
8. ``time`` (``perf/lease_timings.py``): the headline numbers at short iteration counts, each with its limit measured
   in the same run;
9. ``kernels-dsv3``: stage 5's cases at DeepSeek-V3 shapes (host references: the slowest stage);
10. ``sanitizer``: compute-sanitizer memcheck then racecheck on the small low-latency case, then racecheck on it at
    DeepSeek-V3 shapes (both combine kernels included);
11. ``pytest-gpu``: the rest of ``pytest -m gpu`` (DeepSeek-V3 shapes, NaN/Inf, PDL, NCCL ranks), with what is left.

The default budget, 540 s, keeps the whole run inside one 10-minute device command; the caps of the stages up
to ``gemm-gluon`` fit in it (tests/test_gpu_lease.py checks both), the later stages get what is left.

Measured on an H200 with a cold Triton cache (budget 430 s, before the ``method`` stage existed): env 7 s,
kernels-small 69 s, graphs 49 s, gemm-api 24 s, time 21 s; the DeepSeek-V3 references and the full
``pytest -m gpu`` need more than one default budget, so they come last and report what they reached.

Exit status: 0 when every stage that ran passed; 1 when any failed (exit status not 0, or a timeout; pytest's 5,
"no tests collected", is not a failure): the summary's last line and stderr name them, and every row written
before stays written; 2 for a refusal (no GPU without ``--dry-run``; ``gpu_lease.sh`` also refuses a Python
without torch / triton).

``--dry-run`` (a CPU machine): the same machinery into the same files under the Triton interpreter at tiny
shapes (``ll``: 2 and 4 virtual ranks; ``gemm-gluon`` only prints its shape table: Gluon needs sm90), plus
``compile``: how long the kernels of each stage take to compile ahead of time for sm90 with a cold cache
(``perf/sm90_report.py --filter``; no Gluon), which is what a cold lease pays before its first row.

Output: ``$OUT`` when set, else ``perf/out/lease-<UTC time>/``; at most 8 plain files: ``env.txt``,
``records.jsonl`` (every row), ``gemm_gluon.jsonl`` (the ``gemm-gluon`` rows), ``summary.md``, ``stages.log``
(each stage's output), ``pytest.log``. The last lines printed are the summary table (stage, result, seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable  # the Python gpu_lease.sh picked (${PYTHON:-python3}) runs every stage
RESERVE_S = 5.0  # kept back for the summary
MIN_STAGE_S = 15.0  # a stage is not started with less than this left
MIN_BUDGET_S = 30.0
DEFAULT_BUDGET_S = 540.0  # 9 minutes: one 10-minute device command with room for start-up and the summary
FILES = ("env.txt", "records.jsonl", "summary.md", "stages.log", "pytest.log", "gemm_gluon.jsonl")
# kernel families each stage compiles (perf/sm90_report.py --filter), for the dry run's compile-time table
COMPILE_FILTERS = {
    "kernels": ["quant", "grouped_fp8", "_ll_", "_scatter_send", "_gather_recv", "_combine_recv_kernel", "_layout",
                "_expand_rows", "mega_moe"],
    "graphs": ["_ll_", "quant", "grouped_fp8"],
    "time": ["quant", "grouped_fp8", "_ll_"],
    "ll": ["_ll_", "quant", "grouped_fp8"],
    "method": ["quant"],
}


class Stage:
    def __init__(self, name: str, cap_s: float, cmd: list, log: str = "stages.log", env: dict | None = None,
                 parse=None):
        self.name, self.cap_s, self.cmd, self.log, self.env, self.parse = name, cap_s, cmd, log, env or {}, parse


def _lease_checks(what: str, out: str, *extra) -> list:
    return [PY, os.path.join(ROOT, "perf", "lease_checks.py"), what, "--json", os.path.join(out, "records.jsonl"),
            *extra]


def _pytest(*args) -> list:
    return [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-rfE", "--durations=5", *args]


def _rows_result(out: str, stage: str):
    def parse(rc: int, text: str) -> str:
        rows = [r for r in _records(out) if r.get("stage") == stage]
        bad = [r["case"] for r in rows if not r.get("ok")]
        if not rows:
            return f"no rows (exit {rc})"
        return f"{len(rows) - len(bad)}/{len(rows)} ok" + (f"; FAILED: {', '.join(bad)[:300]}" if bad else "")
    return parse


def _pytest_result(rc: int, text: str) -> str:
    tail = [ln for ln in text.strip().splitlines() if re.search(r"\b(passed|failed|skipped|error|no tests ran)\b", ln)]
    summary = tail[-1].strip("= ") if tail else f"exit {rc}"
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.M)
    return summary + (f"; FAILED: {', '.join(failed)[:300]}" if failed else "")


def _ok_lines(rc: int, text: str) -> str:
    """perf/_gpu_check_gemm.py prints ``OK   name`` / ``FAIL name`` per check."""
    ok, bad = re.findall(r"^OK +(\S.*)$", text, re.M), re.findall(r"^FAIL +(\S.*)$", text, re.M)
    if not ok and not bad:
        return f"no checks ran (exit {rc})"
    return f"{len(ok)}/{len(ok) + len(bad)} ok" + (f"; FAILED: {', '.join(bad)[:300]}" if bad else "")


def _gemm_gluon_result(path: str):
    """perf/lease_gemm_gluon.py's JSON lines: numerics rows (``check``, ``ok``) first, then timed rows (``us``,
    ``tflops``, ``of_scaled_mm``)."""
    def parse(rc: int, text: str) -> str:
        rows = []
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    try:
                        rows.append(json.loads(line))
                    except ValueError:
                        pass
        checks = [r for r in rows if "check" in r]
        if not checks:
            return f"no rows (exit {rc})"
        bad = [f"{r['shape']} {r['kernel']} {r['check']}" for r in checks if not r.get("ok")]
        timed = [r for r in rows if "us" in r]
        best = {}
        for r in timed:
            if r["kernel"] in ("gluon", "tl") and "of_scaled_mm" in r:
                best[r["kernel"]] = max(best.get(r["kernel"], 0.0), r["of_scaled_mm"])
        shapes = len({r["shape"] for r in checks})
        out = f"{len(checks) - len(bad)}/{len(checks)} checks ok over {shapes} shapes, {len(timed)} timed rows"
        if best:
            out += "; best of scaled_mm: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(best.items()))
        return out + (f"; FAILED: {', '.join(bad)[:300]}" if bad else "")
    return parse


def _gemm_gluon_dry(rc: int, text: str) -> str:
    """The dry run's gemm-gluon stage: ``lease_gemm_gluon.py --list`` (the shape table) instead of the GPU run."""
    if rc != 0:
        return f"exit {rc}"
    n = max(len(re.findall(r"^[|] \S", text, re.M)) - 1, 0)  # table rows, less the header
    return f"skipped: the Gluon GEMM compiles for and runs on a CUDA sm90 GPU only (dry run: --list, {n} shapes)"


def _sanitizer_result(rc: int, text: str) -> str:
    """One entry per tool run: memcheck's ``ERROR SUMMARY: N errors``, racecheck's ``RACECHECK SUMMARY: N hazards
    displayed (E errors, W warnings)``, plus the cases that failed their check under the tool."""
    parts = []
    for m in re.finditer(r"ERROR SUMMARY: (\d+) error|RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) error", text):
        parts.append(f"memcheck {m.group(1)} errors" if m.group(1) is not None else
                     f"racecheck {m.group(2)} hazards ({m.group(3)} errors)")
    failed = re.findall(r"^FAIL +(.+?\])", text, re.M)
    if not parts:
        return f"no sanitizer summary (exit {rc})"
    return ", ".join(parts) + (f"; FAILED under the tool: {', '.join(failed)}" if failed else "")


def stages(out: str, dry: bool) -> list[Stage]:
    lc = os.path.join(ROOT, "perf", "lease_checks.py")
    rec = os.path.join(out, "records.jsonl")
    gemm_json = os.path.join(out, "gemm_gluon.jsonl")
    if dry:
        interp = {"TRITON_INTERPRET": "1"}
        return [
            Stage("env", 60, _lease_checks("env", out, "--text", os.path.join(out, "env.txt")), env=interp,
                  parse=lambda rc, t: "written" if rc == 0 else f"exit {rc}"),
            Stage("method", 120, _lease_checks("method", out, "--shapes", "tiny"), env=interp,
                  parse=_rows_result(out, "method")),
            Stage("ll", 150, _lease_checks("ll", out, "--shapes", "tiny"), env=interp, parse=_rows_result(out, "ll")),
            # Gluon compiles for sm90 only and needs the GPU to run: the dry run checks the script and its shape table
            Stage("gemm-gluon", 30, [PY, os.path.join(ROOT, "perf", "lease_gemm_gluon.py"), "--list"],
                  parse=_gemm_gluon_dry),
            Stage("kernels-tiny", 120, _lease_checks("checks", out, "--shapes", "tiny"), env=interp,
                  parse=_rows_result(out, "checks")),
            Stage("graphs", 60, _pytest("-m", "gpu", "-k", "graph", os.path.join(ROOT, "tests")),
                  log="pytest.log", parse=_pytest_result),
            Stage("gemm-api", 10, [PY, "-c", "print('perf/_gpu_check_gemm.py needs CUDA')"],
                  parse=lambda rc, t: "skipped: CUDA only (dry run)"),
            Stage("time", 90, _lease_checks("time", out, "--shapes", "tiny", "--iters", "2"), env=interp,
                  parse=_rows_result(out, "time")),
            Stage("compile", 180, [PY, os.path.join(ROOT, "perf", "gpu_lease.py"), "--compile-times", rec],
                  parse=_rows_result(out, "compile")),
            Stage("sanitizer", 30, [PY, "-c", "print('no GPU: compute-sanitizer needs one')"],
                  parse=lambda rc, t: "skipped: no GPU (dry run)"),
            Stage("pytest-gpu", 60, _pytest("-m", "gpu", "-k", "not graph", os.path.join(ROOT, "tests")),
                  log="pytest.log", parse=_pytest_result),
        ]
    san = []
    # memcheck and racecheck on the small low-latency case, then racecheck at DeepSeek-V3 shapes (8 virtual ranks,
    # H 7168, top-8: both combine kernels' shared-memory traffic as shipped)
    for tool, shapes in (("memcheck", "small"), ("racecheck", "small"), ("racecheck", "dsv3")):
        san += ["compute-sanitizer", "--tool", tool, "--error-exitcode", "0", "--print-limit", "20",
                PY, lc, "checks", "--shapes", shapes, "--only", "ll fp8", "--json", rec, "--tag", f"{tool} {shapes}", ";"]
    return [
        Stage("env", 30, _lease_checks("env", out, "--text", os.path.join(out, "env.txt")),
              parse=lambda rc, t: "written" if rc == 0 else f"exit {rc}"),
        Stage("method", 120, _lease_checks("method", out, "--shapes", "dsv3"), parse=_rows_result(out, "method")),
        Stage("ll", 140, _lease_checks("ll", out, "--shapes", "dsv3", "--iters", "10"), parse=_rows_result(out, "ll")),
        Stage("gemm-gluon", 240, [PY, os.path.join(ROOT, "perf", "lease_gemm_gluon.py"), "--json", gemm_json,
                                  "--iters", "10"], parse=_gemm_gluon_result(gemm_json)),
        Stage("kernels-small", 150, _lease_checks("checks", out, "--shapes", "small"), parse=_rows_result(out, "checks")),
        Stage("graphs", 120, _pytest("-m", "gpu", "-k", "graph", os.path.join(ROOT, "tests")), log="pytest.log",
              parse=_pytest_result),
        Stage("gemm-api", 90, [PY, os.path.join(ROOT, "perf", "_gpu_check_gemm.py")],
              parse=_ok_lines),
        Stage("time", 120, _lease_checks("time", out, "--iters", "10"), parse=_rows_result(out, "time")),
        Stage("kernels-dsv3", 120, _lease_checks("checks", out, "--shapes", "dsv3", "--stage", "checks-dsv3"),
              parse=_rows_result(out, "checks-dsv3")),
        Stage("sanitizer", 240, ["bash", "-c", " ".join(f"'{a}'" if a != ";" else ";" for a in san)],
              parse=_sanitizer_result),
        Stage("pytest-gpu", 240, _pytest("-m", "gpu", "-k", "not graph", os.path.join(ROOT, "tests")),
              log="pytest.log", parse=_pytest_result),
    ]


def _records(out: str) -> list:
    path = os.path.join(out, "records.jsonl")
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass
    return rows


def _append(path: str, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


def run_stage(st: Stage, out: str, timeout_s: float) -> tuple[str, int, float]:
    log = os.path.join(out, st.log)
    _append(log, f"\n===== stage {st.name} (deadline {timeout_s:.0f} s): {' '.join(st.cmd)}\n")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           **st.env}
    t0 = time.monotonic()
    with open(log, "a") as f:
        try:
            p = subprocess.Popen(st.cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
        except OSError as exc:
            return f"not run: {exc}", 127, 0.0
        try:
            rc = p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            rc = 124
    secs = time.monotonic() - t0
    with open(log) as f:
        text = f.read().split(f"===== stage {st.name} (deadline")[-1]
    try:
        result = st.parse(rc, text) if st.parse else f"exit {rc}"
    except Exception as exc:  # noqa: BLE001 - a broken parser is a result, not a crash of the kit
        result = f"exit {rc} (result unreadable: {exc})"
    if rc == 124:
        result = f"TIMEOUT after {timeout_s:.0f} s; {result}"
    elif rc not in (0, 1, 5) and "FAIL" not in result:
        result = f"exit {rc}; {result}"
    return result, rc, secs


def failed(rc: int) -> bool:
    """Whether a stage's exit status is a failure: anything but 0 and pytest's 5 (no tests collected); a timeout
    (124) is one."""
    return rc not in (0, 5)


def run_plan(plan: list, out: str, budget: float, start: float, header: list, only=None,
             runner=None) -> tuple[list, list]:
    """Runs ``plan``'s stages in order under what is left of ``budget`` (seconds since ``start``), the summary
    rewritten after each. Returns ``(table, failures)``: ``(stage, result, seconds)`` rows and the names of the
    stages that failed (:func:`failed`). ``runner``: :func:`run_stage` unless given."""
    runner = runner or run_stage
    table, failures = [], []
    for st in plan:
        if only and st.name != "env" and not any(st.name.startswith(o) for o in only):
            continue
        left = budget - (time.monotonic() - start) - RESERVE_S
        if left < MIN_STAGE_S:
            table.append((st.name, f"skipped: {max(left, 0):.0f} s of the budget left", 0.0))
            write_summary(out, header, table)
            continue
        print(f"gpu_lease: stage {st.name} (deadline {min(st.cap_s, left):.0f} s) ...", file=sys.stderr, flush=True)
        result, rc, secs = runner(st, out, min(st.cap_s, left))
        if failed(rc):
            failures.append(st.name)
            if not result.startswith(("FAILED", "TIMEOUT")):
                result = f"FAILED: {result}"
        table.append((st.name, result, secs))
        if st.name == "env" and os.path.exists(os.path.join(out, "env.txt")):
            with open(os.path.join(out, "env.txt")) as f:
                env = dict(ln.split(": ", 1) for ln in f.read().splitlines() if ": " in ln)
            header.append(f"{env.get('device', '?')}, commit {env.get('commit', '?')}, {env.get('date', '')}; python "
                          f"{env.get('python')}, torch {env.get('torch')} (CUDA {env.get('torch.cuda')}), triton "
                          f"{env.get('triton')}, NVSHMEM {env.get('nvshmem')}")
        write_summary(out, header, table)  # after every stage: a kill keeps what ended
    return table, failures


def write_summary(out: str, header: list, table: list) -> str:
    lines = [*header, "", "| stage | result | seconds |", "| --- | --- | --- |"]
    lines += [f"| {n} | {r.replace('|', '/')} | {s:.0f} |" for n, r, s in table]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text)
    return text


def compile_times(rec: str) -> int:
    """Dry run: cold-cache sm90 compile time of each stage's kernel families, one row per family."""
    import tempfile

    seen = {}
    for stage, filters in COMPILE_FILTERS.items():
        total = 0.0
        for flt in filters:
            if flt not in seen:
                with tempfile.TemporaryDirectory() as cache:
                    t0 = time.monotonic()
                    p = subprocess.run([PY, os.path.join(ROOT, "perf", "sm90_report.py"), "--filter", flt],
                                       capture_output=True, text=True, cwd=ROOT, env={**os.environ,
                                       "TRITON_CACHE_DIR": cache, "PYTHONPATH": ROOT})
                    n = sum(1 for ln in p.stdout.splitlines() if ln.startswith("|") and "---" not in ln) - 1
                    seen[flt] = (time.monotonic() - t0, p.returncode, max(n, 0))
                    row = {"stage": "compile", "case": f"sm90 {flt}", "ok": p.returncode == 0,
                           "seconds": round(seen[flt][0], 2), "kernels": seen[flt][2],
                           "detail": f"{seen[flt][2]} configurations" if p.returncode == 0 else p.stderr[-300:]}
                    _append(rec, json.dumps(row) + "\n")
                    print(f"compile {flt}: {seen[flt][0]:.1f} s, {seen[flt][2]} configurations", flush=True)
            total += seen[flt][0]
        _append(rec, json.dumps({"stage": "compile", "case": f"stage {stage}", "ok": True, "seconds": round(total, 2),
                                 "detail": f"cold-cache sm90 compile of {', '.join(filters)}"}) + "\n")
        print(f"compile stage {stage}: {total:.1f} s", flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="gpu_lease.sh", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds for every stage together")
    p.add_argument("--dry-run", action="store_true", help="CPU: the same machinery, interpreter, tiny shapes")
    p.add_argument("--only", nargs="*", help="run only these stages (env always runs)")
    p.add_argument("--compile-times", metavar="RECORDS", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.compile_times:
        return compile_times(args.compile_times)
    if args.budget < MIN_BUDGET_S:
        p.error(f"--budget {args.budget:g}: at least {MIN_BUDGET_S:g} seconds")
    start = time.monotonic()
    out = os.environ.get("OUT") or os.path.join(ROOT, "perf", "out",
                                                 "lease-" + time.strftime("%Y%m%d-%H%M%S", time.gmtime()))
    os.makedirs(out, exist_ok=True)
    for name in FILES:  # a fresh run: this run's rows only
        if os.path.exists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    if not args.dry_run:
        probe = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True) if shutil.which("nvidia-smi") else None
        if probe is None or probe.returncode != 0:
            print("gpu_lease.sh: error: no GPU (nvidia-smi found none); --dry-run runs the same stages on CPU",
                  file=sys.stderr)
            return 2
    header = [f"# moe-ep GPU lease kit{' (dry run: CPU, Triton interpreter, tiny shapes)' if args.dry_run else ''}",
              "", f"budget {args.budget:.0f} s, output {out}"]
    table, failures = run_plan(stages(out, args.dry_run), out, args.budget, start, header, args.only)
    text = write_summary(out, header, table)
    files = sorted(os.listdir(out))
    print(f"\n{len(files)} files in {out}: {', '.join(files)}\n")
    print(text, end="")
    if failures:
        print(f"gpu_lease.sh: {len(failures)} stage(s) failed: {', '.join(failures)} (rows written before stay in "
              f"{out}; stages.log has each stage's output)", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
