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
    p = subprocess.run(["bash", "perf/gpu_lease.sh", "--dry-run", "--only", "method", "kernels", "time"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stderr[-2000:]
    files = sorted(os.listdir(out))
    assert len(files) <= 8 and all((out / f).is_file() for f in files)
    assert {"env.txt", "records.jsonl", "summary.md", "stages.log"} <= set(files), files
    # the last lines printed are the summary table
    tail = p.stdout.strip().splitlines()
    assert tail[-5:-4] == ["| --- | --- | --- |"] and tail[-4].startswith("| env | written |"), tail[-6:]
    assert tail[-3].startswith("| method | 8/8 ok"), tail[-3]
    assert tail[-2].startswith("| kernels-tiny | ") and " ok" in tail[-2] and "FAILED" not in tail[-2], tail[-2]
    assert tail[-1].startswith("| time | 6/6 ok"), tail[-1]
    rows = [json.loads(ln) for ln in (out / "records.jsonl").read_text().splitlines()]
    checks = [r for r in rows if r["stage"] == "checks"]
    assert len(checks) >= 14 and all(r["ok"] for r in checks), [r for r in checks if not r["ok"]]
    assert {"quant", "silu_quant", "gemm", "ll", "normal", "expand", "map_topk", "mega_moe"} <= \
        {r["case"].split()[0] for r in checks}
    assert "triton" in (out / "env.txt").read_text()
    # the method stage: the split first, every row naming its method (the CPU run: cpu-wall)
    method = [r for r in rows if r["stage"] == "method"]
    assert method[0]["case"].startswith("split quant") and {"flush_writeback_us", "host_gap_us", "kernel_cold_us",
                                                             "graph_rotating_us", "copy_us"} <= set(method[0])
    assert all(r["method"] == "cpu-wall" for r in method), [r["method"] for r in method]
    assert all("limit_us" in r for r in method[1:]) and all("eager_us" in r for r in method[1:])
    assert [r["case"].split()[0] for r in method] == ["split", "quant", "quant", "silu_quant"] + ["map_topk"] * 4


def test_timeout_crash_and_budget_keep_earlier_answers(tmp_path, monkeypatch, capsys):
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
    assert kit.main(["--dry-run", "--budget", "8"]) == 1  # stages failed: not a success
    summary = (tmp_path / "summary.md").read_text()
    assert "| env | exit 0 |" in summary
    assert "| slow | TIMEOUT after 2 s" in summary
    assert "| crash | FAILED: exit 3" in summary
    assert "| late | TIMEOUT after" in summary  # cut at what was left of the 8 s, not its own cap
    assert "| never | skipped: " in summary
    assert "===== stage crash" in (tmp_path / "stages.log").read_text()
    err = capsys.readouterr().err
    assert "3 stage(s) failed: slow, crash, late" in err


def test_a_failing_stage_exits_nonzero_and_keeps_earlier_rows(tmp_path, monkeypatch, capsys):
    kit = _kit()
    py = sys.executable
    rec = tmp_path / "records.jsonl"
    write = f"open({str(rec)!r}, 'a').write('{{\"stage\": \"a\", \"case\": \"x\", \"ok\": true}}\\n')"
    plan = [kit.Stage("env", 10, [py, "-c", "print('hi')"]),
            kit.Stage("a", 10, [py, "-c", write]),
            kit.Stage("b", 10, [py, "-c", "raise SystemExit(1)"]),
            kit.Stage("c", 10, [py, "-c", "print('after')"])]
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(kit, "stages", lambda out, dry: plan)
    assert kit.main(["--dry-run", "--budget", "60"]) == 1
    err = capsys.readouterr().err
    assert "1 stage(s) failed: b (" in err
    assert rec.read_text().count('"case": "x"') == 1  # the row written before stays (the run clears it only at start)
    summary = (tmp_path / "summary.md").read_text()
    assert "| b | FAILED: exit 1 |" in summary and "| c | exit 0 |" in summary  # the stages after still ran
    # every stage passing: exit 0
    plan[2] = kit.Stage("b", 10, [py, "-c", "print('fine')"])
    assert kit.main(["--dry-run", "--budget", "60"]) == 0
    # the runner is injectable: a stage that reports failure (a row with ok false exits 1) is named
    calls = []

    def fake(st, out, timeout_s):
        calls.append(st.name)
        return ("0/1 ok; FAILED: q" if st.name == "a" else "ok"), (1 if st.name == "a" else 0), 0.1
    table, failures = kit.run_plan(plan, str(tmp_path), 60.0, __import__("time").monotonic(), [], runner=fake)
    assert calls == ["env", "a", "b", "c"] and failures == ["a"]
    assert table[1] == ("a", "FAILED: 0/1 ok; FAILED: q", 0.1)
    assert kit.failed(5) is False and kit.failed(124) is True and kit.failed(0) is False


def _sh(env_extra, *args):
    env = {k: v for k, v in os.environ.items() if k not in ("OUT",)}
    env.update(env_extra)
    return subprocess.run(["bash", "perf/gpu_lease.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_sh_refuses_a_python_without_torch_or_cuda(tmp_path):
    # this machine's Python has torch and triton but no CUDA device: one line, exit 2, before any stage
    out = tmp_path / "o"
    p = _sh({"PYTHON": sys.executable, "OUT": str(out), "CUDA_VISIBLE_DEVICES": ""})
    assert p.returncode == 2, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "sees no CUDA device" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and not out.exists()
    # a Python whose torch does not import
    fake = tmp_path / "fake"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text("raise ImportError('No module named torch (test)')\n")
    p = _sh({"PYTHON": sys.executable, "OUT": str(out), "PYTHONPATH": str(fake)}, "--dry-run")
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "cannot import torch" in p.stderr and "PYTHON=" in p.stderr and not out.exists()
    # triton missing
    fake2 = tmp_path / "fake2"
    (fake2 / "triton").mkdir(parents=True)
    (fake2 / "triton" / "__init__.py").write_text("raise ImportError('no triton (test)')\n")
    p = _sh({"PYTHON": sys.executable, "PYTHONPATH": str(fake2)}, "--dry-run")
    assert p.returncode == 2 and "cannot import triton" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    # no such Python
    p = _sh({"PYTHON": str(tmp_path / "nope")})
    assert p.returncode == 2 and "no Python" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_method_stage_comes_first_among_timed_stages(tmp_path):
    kit = _kit()
    for dry in (False, True):
        names = [st.name for st in kit.stages(str(tmp_path), dry)]
        assert names[:2] == ["env", "method"], names
        assert names.index("method") < names.index("time")


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
