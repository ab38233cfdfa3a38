"""perf/gpu_lease.sh: the dry run writes the promised files and summary; the stage machinery keeps every earlier
answer when a stage times out, crashes or the budget runs out."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _kit():
    spec = importlib.util.spec_from_file_location("gpu_lease", os.path.join(ROOT, "perf", "gpu_lease.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.join(ROOT, "perf"))
    spec.loader.exec_module(mod)
    return mod


def test_dry_run_files_and_summary(tmp_path):
    out = tmp_path / "lease"
    # PYTHON: the interpreter gpu_lease.sh runs (this test's, which has torch; a CI's PYTHON may be a bare base Python)
    env = {**os.environ, "OUT": str(out), "TRITON_INTERPRET": "1", "PYTHON": sys.executable}
    p = subprocess.run(["bash", "perf/gpu_lease.sh", "--dry-run", "--only", "kernels", "time"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-2000:]
    files = sorted(os.listdir(out))
    assert len(files) <= 8 and all((out / f).is_file() for f in files)
    assert {"env.txt", "records.jsonl", "summary.md", "stages.log"} <= set(files), files
    # the last lines printed are the summary table
    tail = p.stdout.strip().splitlines()
    assert tail[-4:-3] == ["| --- | --- | --- |"] and tail[-3].startswith("| env | written |"), tail[-6:]
    assert tail[-2].startswith("| kernels-tiny | ") and " ok" in tail[-2] and "FAILED" not in tail[-2], tail[-2]
    assert tail[-1].startswith("| time | 6/6 ok"), tail[-1]
    rows = [json.loads(ln) for ln in (out / "records.jsonl").read_text().splitlines()]
    checks = [r for r in rows if r["stage"] == "checks"]
    assert len(checks) >= 14 and all(r["ok"] for r in checks), [r for r in checks if not r["ok"]]
    assert {"quant", "silu_quant", "gemm", "ll", "normal", "expand", "map_topk", "mega_moe"} <= \
        {r["case"].split()[0] for r in checks}
    assert "triton" in (out / "env.txt").read_text()


def test_timeout_crash_and_budget_keep_earlier_answers(tmp_path, monkeypatch):
    kit = _kit()
    py = sys.executable
    plan = [
        kit.Stage("env", 10, [py, "-c", "print('hi')"]),
        kit.Stage("slow", 2, [py, "-c", "import time; time.sleep(30)"]),
        kit.Stage("crash", 10, [py, "-c", "raise SystemExit(3)"]),
        kit.Stage("late", 100, [py, "-c", "import time; time.sleep(30)"]),
        kit.Stage("never", 10, [py, "-c", "print('never')"]),
    ]
    monkeypatch.setattr(kit, "stages", lambda out, dry: plan)
    monkeypatch.setattr(kit, "MIN_STAGE_S", 1.0)
    monkeypatch.setattr(kit, "RESERVE_S", 0.5)
    monkeypatch.setattr(kit, "MIN_BUDGET_S", 1.0)
    monkeypatch.setenv("OUT", str(tmp_path))
    assert kit.main(["--dry-run", "--budget", "8"]) == 0
    summary = (tmp_path / "summary.md").read_text()
    assert "| env | exit 0 |" in summary
    assert "| slow | TIMEOUT after 2 s" in summary
    assert "| crash | exit 3" in summary
    assert "| late | TIMEOUT after" in summary  # cut at what was left of the 8 s, not its own cap
    assert "| never | skipped: " in summary
    assert "===== stage crash" in (tmp_path / "stages.log").read_text()


def test_budget_too_small_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        _kit().main(["--dry-run", "--budget", "5"])
    assert e.value.code == 2
    assert "at least 30 seconds" in capsys.readouterr().err


def test_result_parsers_read_what_the_tools_print():
    kit = _kit()
    san = ("========= ERROR SUMMARY: 0 errors\n========= Error: Race reported between Write access\n"
           "FAIL ll fp8 EP4 T16 H512 [racecheck]       1.92 s  step 0 rank 0 expert 0: recv_x\n"
           "========= RACECHECK SUMMARY: 20 hazards displayed (20 errors, 0 warnings)\n")
    assert kit._sanitizer_result(0, san) == ("memcheck 0 errors, racecheck 20 hazards (20 errors); FAILED under the "
                                             "tool: ll fp8 EP4 T16 H512 [racecheck]")
    assert kit._sanitizer_result(127, "bash: compute-sanitizer: command not found").startswith("no sanitizer summary")
    assert kit._ok_lines(0, "OK   a 1e-6\nOK   b\nFAILS: []\n") == "2/2 ok"
    assert kit._ok_lines(1, "OK   a\nFAIL b x\n") == "1/2 ok; FAILED: b x"
    py = "FAILED tests/t.py::test_a - AssertionError\n1 failed, 3 passed in 2.0s\n"
    assert kit._pytest_result(1, py) == "1 failed, 3 passed in 2.0s; FAILED: tests/t.py::test_a"
