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


@pytest.mark.slow  # the lease kit's whole dry run on CPU (40-50 s on 2 cores; CI runs -m slow)
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


def _ll():
    sys.path.insert(0, os.path.join(ROOT, "perf"))
    import lease_ll

    return lease_ll


def test_fit_linear_is_exact_on_a_line_and_least_squares_otherwise():
    fit = _ll().fit_linear
    f = fit([(r, 3.25 + 0.75 * r) for r in (2, 4, 8)])
    assert f["a"] == pytest.approx(3.25, abs=1e-12) and f["b"] == pytest.approx(0.75, abs=1e-12)
    assert f["residual"] == pytest.approx(0.0, abs=1e-12) and f["max_residual"] < 1e-12 and f["n"] == 3
    # off the line: (2, 1), (4, 4), (8, 6) by hand: mean x 14/3, mean y 11/3, Sxx 168/9, Sxy 132/9, so b = 11/14
    # and a = 11/3 - b * 14/3 = 0
    f = fit([(2, 1.0), (4, 4.0), (8, 6.0)])
    assert f["b"] == pytest.approx(11 / 14) and f["a"] == pytest.approx(0.0, abs=1e-12)
    res = [y - (f["a"] + f["b"] * x) for x, y in [(2, 1.0), (4, 4.0), (8, 6.0)]]
    assert sum(res) == pytest.approx(0.0, abs=1e-12)
    assert f["residual"] == pytest.approx((sum(r * r for r in res) / 3) ** 0.5)
    assert f["residual"] > 0.5
    for bad in ([(2, 1.0)], [(4, 1.0), (4, 2.0)]):
        with pytest.raises(ValueError):
            fit(bad)


def test_ll_fit_rows_per_phase_and_kernel():
    ll = _ll()
    # per virtual rank: a send kernel of 5 + 2 R us, a fill of 1 us (no R term) seen at every R, one seen once
    box = {r: {p: {"send_kernel": 5.0 + 2.0 * r, "fill": 1.0} for p in ll.PHASES} for r in (2, 4, 8)}
    box[8]["dispatch send"]["only_at_8"] = 9.0
    row = ll.ll_fit("dispatch send", box)
    assert row["ok"] and row["method"] in ("profiler-kernels", "cpu-wall")
    assert row["points"] == [[2, 10.0], [4, 14.0], [8, 31.0]]
    assert set(row["kernels"]) == {"send_kernel", "fill"}  # a kernel not seen at every R is not fitted
    assert row["kernels"]["send_kernel"] == {"a_us": 5.0, "b_us": 2.0, "residual_us": 0.0}
    assert row["kernels"]["fill"] == {"a_us": 1.0, "b_us": 0.0, "residual_us": 0.0}
    assert row["residual_us"] > 0  # the total is off the line by the kernel seen only at EP8
    exact = ll.ll_fit("combine recv", box)
    assert (exact["a_us"], exact["b_us"], exact["residual_us"]) == (6.0, 2.0, 0.0)
    assert not ll.ll_fit("combine recv", {2: box[2]})["ok"]


def test_plan_order_and_caps_fit_one_device_command(tmp_path):
    kit = _kit()
    first = ["env", "method", "ll", "gemm-gluon"]
    for dry in (False, True):
        names = [st.name for st in kit.stages(str(tmp_path), dry)]
        assert names[:4] == first, names
        assert len(names) == len(set(names))
    plan = kit.stages(str(tmp_path), False)
    assert [st.name for st in plan] == first + ["kernels-small", "graphs", "gemm-api", "time", "kernels-dsv3",
                                                "sanitizer", "pytest-gpu"]
    # the default budget bounds the whole run (every deadline is min(cap, what is left)): 9 minutes, so one
    # 10-minute device command holds it; the priority stages' caps fit in it together
    assert kit.DEFAULT_BUDGET_S <= 540
    assert sum(st.cap_s for st in plan[:4]) <= kit.DEFAULT_BUDGET_S - kit.RESERVE_S
    gemm = plan[3]
    assert gemm.cap_s == 240 and "--json" in gemm.cmd and gemm.cmd[gemm.cmd.index("--json") + 1] == \
        str(tmp_path / "gemm_gluon.jsonl") and gemm.cmd[gemm.cmd.index("--iters") + 1] == "10"
    assert "gemm_gluon.jsonl" in kit.FILES and len(kit.FILES) <= 8
    dry_gemm = kit.stages(str(tmp_path), True)[3]
    assert "--list" in dry_gemm.cmd and "--json" not in dry_gemm.cmd  # no Gluon compile on a CPU
    assert not any("gluon" in f for fs in kit.COMPILE_FILTERS.values() for f in fs)


def test_gemm_gluon_parsers(tmp_path):
    kit = _kit()
    path = tmp_path / "gemm_gluon.jsonl"
    rows = [{"shape": "m", "kernel": "gluon", "check": "reference", "ok": True},
            {"shape": "m", "kernel": "tl", "check": "reference", "ok": False},
            {"shape": "c", "kernel": "gluon", "check": "psum == m_indices bitwise", "ok": True},
            {"shape": "m", "kernel": "gluon", "us": 10.0, "tflops": 700.0, "of_scaled_mm": 0.5},
            {"shape": "c", "kernel": "gluon", "us": 10.0, "tflops": 800.0, "of_scaled_mm": 0.61},
            {"shape": "m", "kernel": "bf16 bmm", "us": 20.0, "tflops": 350.0, "of_scaled_mm": 0.25}]
    parse = kit._gemm_gluon_result(str(path))
    assert parse(2, "error") == "no rows (exit 2)"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "{cut")
    assert parse(1, "") == ("2/3 checks ok over 2 shapes, 3 timed rows; best of scaled_mm: gluon 0.61; "
                            "FAILED: m tl reference")
    listed = subprocess.run([sys.executable, "perf/lease_gemm_gluon.py", "--list"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert listed.returncode == 0
    n = len(listed.stdout.strip().splitlines()) - 2
    assert kit._gemm_gluon_dry(0, listed.stdout).endswith(f"(dry run: --list, {n} shapes)") and n >= 8
    assert kit._gemm_gluon_dry(2, "") == "exit 2"


@pytest.mark.slow  # the ll and gemm stages' dry run (20-40 s; CI runs -m slow)
def test_dry_run_ll_and_gemm_stages(tmp_path):
    out = tmp_path / "lease"
    env = {**os.environ, "OUT": str(out), "TRITON_INTERPRET": "1", "PYTHON": sys.executable}
    p = subprocess.run(["bash", "perf/gpu_lease.sh", "--dry-run", "--only", "ll", "gemm-gluon"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stderr[-2000:]
    tail = p.stdout.strip().splitlines()
    assert tail[-2].startswith("| ll | 7/7 ok"), tail[-3:]
    listed = subprocess.run([sys.executable, "perf/lease_gemm_gluon.py", "--list"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    n = len(listed.stdout.strip().splitlines()) - 2  # the shape table, less its header
    assert tail[-1].startswith("| gemm-gluon | skipped: the Gluon GEMM") and f"{n} shapes" in tail[-1], tail[-1]
    rows = [json.loads(ln) for ln in (out / "records.jsonl").read_text().splitlines()]
    ll = [r for r in rows if r["stage"] == "ll"]
    assert [r["case"].split()[:2] for r in ll] == [["ll", "EP2"], ["ll", "EP4"]] + [["ll", "fit"]] * 4 + \
        [["layer", "decode"]]
    assert all(r["method"] == "cpu-wall" for r in ll)
    assert [r["world"] for r in ll[:2]] == [2, 4]
    assert all(set(r["per_rank_us"]) == set(_ll().PHASES) for r in ll[:2])
    assert all({"a_us", "b_us", "residual_us", "points", "kernels"} <= set(r) for r in ll[2:6])
    assert [pt[0] for pt in ll[2]["points"]] == [2, 4]
    assert "bitwise" in ll[6]["detail"] and "eager_us" in ll[6]
    assert not (out / "gemm_gluon.jsonl").exists()
