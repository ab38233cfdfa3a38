"""perf/ command lines: run_all.sh without a GPU, each bench's --cpu-smoke --json records, error exits."""

import glob
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PERF = os.path.join(ROOT, "perf")
sys.path.insert(0, PERF)
import _common  # noqa: E402

ENV = dict(os.environ, CUDA_VISIBLE_DEVICES="")
ENV.pop("TRITON_INTERPRET", None)  # --cpu-smoke must set it itself
BENCHES = sorted(os.path.basename(p) for p in glob.glob(os.path.join(PERF, "bench_*.py")))


def _run(args, timeout=240):
    return subprocess.run(args, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def test_run_all_refuses_without_gpu(tmp_path):
    p = subprocess.run(["bash", os.path.join(PERF, "run_all.sh")], cwd=ROOT, capture_output=True, text=True,
                       timeout=30, env=dict(ENV, PATH="/usr/bin:/bin", OUT_DIR=str(tmp_path)))
    assert p.returncode == 2
    assert len(p.stderr.strip().splitlines()) == 1 and "needs a CUDA GPU" in p.stderr
    assert not os.listdir(tmp_path)


# benches whose subject is CPU work or counting (they run without a GPU by design)
CPU_BENCHES = ("bench_eplb.py", "bench_torch_a2a.py", "bench_failover.py", "bench_collectives.py", "bench_elastic.py",
               "bench_combine_accuracy.py")


@pytest.mark.parametrize("bench", BENCHES)
def test_bench_without_gpu_exits_nonzero(bench):
    if bench in CPU_BENCHES:
        pytest.skip("runs on CPU by design")
    p = _run([sys.executable, os.path.join(PERF, bench)], timeout=60)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "needs a CUDA GPU" in p.stderr


@pytest.mark.parametrize("bench", BENCHES)
def test_bench_cpu_smoke_json(bench, tmp_path):
    out = tmp_path / "rows.jsonl"
    p = _run([sys.executable, os.path.join(PERF, bench), "--cpu-smoke", "--json", str(out)])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "Traceback" not in p.stderr and "INVALID" not in p.stdout
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    head, rows = recs[0], recs[1:]
    assert set(_common.HEADER_KEYS) <= set(head) and head["kind"] == "header" and head["cpu-smoke"] is True
    assert head["bench"] == bench[:-3]
    assert rows
    for r in rows:
        assert set(_common.ROW_KEYS) <= set(r), r
        assert r["valid"] is True and r["bench"] == bench[:-3]


def test_bench_combine_has_its_own_help():
    p = _run([sys.executable, os.path.join(PERF, "bench_combine.py"), "--help"], timeout=60)
    assert p.returncode == 0
    assert p.stdout.startswith("usage: bench_combine.py")
    assert "Benchmark of the ``symm`` backend's combine" in p.stdout
    assert "--op" not in p.stdout and "(default: 7168)" in p.stdout


@pytest.mark.parametrize("bench", BENCHES)
def test_every_option_has_help_and_default(bench):
    p = _run([sys.executable, os.path.join(PERF, bench), "--help"], timeout=60)
    assert p.returncode == 0 and "--json" in p.stdout and "--cpu-smoke" in p.stdout
    assert "default:" in p.stdout


def test_cpu_smoke_keeps_explicit_options(tmp_path):
    out = tmp_path / "q.jsonl"
    p = _run([sys.executable, os.path.join(PERF, "bench_quant.py"), "--cpu-smoke", "-k", "128", "-m", "4",
              "--no-silu", "--no-pdl", "--json", str(out)])
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()][1:]
    assert {r["case"] for r in rows} == {"quant M=4 K=128"}


def test_smoke_defaults_helper():
    import argparse
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    argv = ["--hidden=512"]
    args = p.parse_args(argv)
    _common.smoke_defaults(args, p, argv, hidden=256, topk=4)
    assert (args.hidden, args.topk) == (512, 4)


def test_eplb_never_downloads(tmp_path):
    p = _run([sys.executable, os.path.join(PERF, "bench_eplb.py"), "--cpu-smoke", "--json", str(tmp_path / "e.jsonl")])
    assert p.returncode == 0
    assert "pip download" not in p.stderr or "--fetch-reference" in p.stderr
    assert not any("fetching" in ln for ln in p.stderr.splitlines())


def test_torchrun_launcher_refuses_without_env():
    env = {k: v for k, v in ENV.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    p = subprocess.run([sys.executable, os.path.join(PERF, "bench_dispatch.py"), "--launcher", "torchrun",
                        "--backend", "torch"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "RANK, WORLD_SIZE, LOCAL_RANK" in p.stderr
    p = _run([sys.executable, os.path.join(PERF, "bench_dispatch.py"), "--launcher", "mpi"], timeout=60)
    assert p.returncode == 2 and "invalid choice" in p.stderr


def test_torchrun_backend_both_and_deepep_skip_line():
    from bench_dispatch import _parse, deepep_probe
    args, _ = _parse(["--launcher", "torchrun"])
    assert args.backend == "both" and args.no_deepep is False
    args, prog = _parse(["--launcher", "torchrun", "--backend", "symm", "--no-deepep"], op="combine")
    assert (args.backend, args.no_deepep, args.op, prog) == ("symm", True, "combine", "bench_combine.py")
    p = _run([sys.executable, os.path.join(PERF, "bench_dispatch.py"), "--backend", "nccl"], timeout=60)
    assert p.returncode == 2 and "invalid choice" in p.stderr
    assert deepep_probe(True)[0] is None and "--no-deepep" in deepep_probe(True)[1]
    mod, line = deepep_probe()
    if mod is not None:
        pytest.skip("deep_ep is importable here")
    assert line.startswith("DeepEP baseline: skipped, deep_ep is not importable (") and "baseline=null" in line
    for bench in ("bench_dispatch.py", "bench_combine.py"):
        p = subprocess.run([sys.executable, os.path.join(PERF, bench), "--launcher", "torchrun"], cwd=ROOT,
                           env=dict(ENV, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"), capture_output=True, text=True,
                           timeout=60)
        assert p.returncode == 2 and "Traceback" not in p.stderr
        assert p.stdout.strip().splitlines() == [line]  # one line: skipped and why
        assert len(p.stderr.strip().splitlines()) == 1 and "one CUDA GPU per rank" in p.stderr


def test_gpu_state_parse_and_routing():
    assert _common.parse_gpu_state("1980 MHz, 2619 MHz, [N/A], 34") == {
        "clocks.sm": 1980.0, "clocks.mem": 2619.0, "power.limit": None, "temperature.gpu": 34.0}
    import torch
    from bench_dispatch import route
    g = torch.Generator().manual_seed(0)
    idx = route(64, 256, 8, "grouped", g)
    assert idx.shape == (64, 8)
    assert all(len({int(e) // 32 for e in row}) <= 4 for row in idx)  # top-4 of 8 groups
    drop = route(256, 256, 8, "grouped-drop", g)
    assert (drop == -1).any() and (drop >= -1).all()
    z = route(512, 256, 8, "zipf", g)
    assert all(len(set(row.tolist())) == 8 for row in z)
    assert torch.bincount(z.flatten(), minlength=256).max() > 3 * 512 * 8 / 256  # skewed
