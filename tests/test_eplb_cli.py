"""python -m eplb: simulate -> plan -> report round trips; malformed input gives one line, exit 2, no file."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from eplb.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--layers", "3", "--steps", "4", "--tokens", "512"]


def run(argv, capsys):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def stats(tmp_path_factory):
    d = tmp_path_factory.mktemp("stats")
    rc = main(["simulate", "-o", str(d / "s.npy"), "--later", str(d / "later.npy"), "--seed", "1", "--progress", "never",
               *SMALL])
    assert rc == 0
    return d


def test_simulate_plan_report_round_trip(stats, tmp_path, capsys):
    s = np.load(stats / "s.npy")
    assert s.shape == (4, 3, 256) and (s >= 0).all()
    plan = tmp_path / "p.json"
    rc, out, err = run(["plan", stats / "s.npy", "--replicas", 288, "--gpus", 144, "--nodes", 18, "--groups", 8,
                        "-o", plan, "--pt", tmp_path / "p.pt", "--progress", "always"], capsys)
    assert rc == 0, err
    assert "balancedness" in out and "same-GPU duplicate slots: 0" in out and "|" in out  # histogram
    assert "planning [" in err  # progress bar
    data = json.loads(plan.read_text())
    pt = torch.load(tmp_path / "p.pt", weights_only=True)
    assert torch.equal(pt["phy2log"], torch.tensor(data["phy2log"])) and pt["phy2log"].shape == (3, 288)
    assert data["meta"]["num_gpus"] == 144 and torch.equal(pt["logcnt"], torch.tensor(data["logcnt"]))

    rc, out, _ = run(["report", stats / "later.npy", plan], capsys)
    assert rc == 0 and "balancedness" in out and "144 GPUs" in out
    rc, out, _ = run(["report", stats / "later.npy", tmp_path / "p.pt"], capsys)
    assert rc == 0

    # Re-plan on the later window, sticking to the first plan.
    rc, out, _ = run(["plan", stats / "later.npy", "--replicas", 288, "--gpus", 144, "--nodes", 18, "--groups", 8,
                      "--previous", plan, "-o", tmp_path / "p2.json"], capsys)
    assert rc == 0 and "slots moved vs previous" in out and "before" in out


@pytest.mark.parametrize("fmt", [".npy", ".pt", ".json", ".csv"])
def test_stats_formats(fmt, tmp_path, capsys):
    w = np.random.default_rng(0).integers(0, 100, size=(2, 16))
    path = tmp_path / f"w{fmt}"
    if fmt == ".npy":
        np.save(path, w)
    elif fmt == ".pt":
        torch.save(torch.from_numpy(w), path)
    elif fmt == ".json":
        path.write_text(json.dumps(w.tolist()))
    else:
        path.write_text("\n".join(",".join(map(str, r)) for r in w))
    rc, out, err = run(["plan", path, "--replicas", 24, "--gpus", 8, "--nodes", 2, "--groups", 4, "-o",
                        tmp_path / "o.json"], capsys)
    assert rc == 0, err
    assert "before" in out  # 16 experts divide over 8 GPUs: the no-replica baseline is reported


def _write(path, arr):
    if str(path).endswith(".npy"):
        np.save(path, arr)
    else:
        path.write_text(arr)


@pytest.mark.parametrize("content, args, match", [
    (np.full((2, 16), np.nan), [], "NaN"),
    (-np.ones((2, 16)), [], "negative"),
    (np.ones(16), [], "shape"),
    (np.ones((2, 2, 2, 16)), [], "shape"),
    (np.ones((2, 16)), ["--replicas", "25"], "divisible by num_gpus"),
    (np.ones((2, 16)), ["--nodes", "4", "--groups", "2", "--policy", "hierarchical"], "divisible by num_nodes"),
    (np.ones((2, 16)), ["--nodes", "3"], "--gpus 8 does not divide over --nodes 3"),
    (np.ones((2, 16)), ["--experts", "15"], "--experts 15"),
    (np.ones((2, 16)), ["--layers", "3"], "--layers 3"),
    (np.ones((2, 16)), ["--replicas", "8"], ">= num_experts"),
    (np.ones((2, 16)), ["--policy", "best"], "invalid choice"),
    (np.ones((2, 16)), ["--output", "o.txt"], ".json or .pt"),
    ("1,2\n3\n", [], "columns"),
    ("1,x\n3,4\n", [], "cannot read"),
])
def test_errors_one_line_exit_2_no_file(content, args, match, tmp_path, capsys):
    src = tmp_path / ("w.npy" if isinstance(content, np.ndarray) else "w.csv")
    _write(src, content)
    out_file = tmp_path / "o.json"
    argv = ["plan", src, "--replicas", 24, "--gpus", 8, "--nodes", 2, "--groups", 4, "-o", out_file, *args]
    if "--output" in args:
        argv = ["plan", src, "--replicas", 24, "--gpus", 8, "--nodes", 2, "--groups", 4, *args]
    rc, out, err = run(argv, capsys)
    assert rc == 2
    assert err.startswith("error: ") and err.count("\n") == 1 and match in err, err
    assert out == ""
    assert sorted(os.listdir(tmp_path)) == [src.name], "no partial output"


def test_report_and_simulate_errors(stats, tmp_path, capsys):
    rc, _, err = run(["report", stats / "s.npy", tmp_path / "missing.json"], capsys)
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"phy2log": [[0, 1]], "meta": {}}))
    rc, _, err = run(["report", stats / "s.npy", bad], capsys)
    assert rc == 2 and "num_gpus" in err
    rc, _, err = run(["simulate", "-o", tmp_path / "x.npy", "--layers", "0"], capsys)
    assert rc == 2 and not (tmp_path / "x.npy").exists()
    rc, _, err = run(["plan", stats / "s.npy", "--replicas", 288, "--gpus", 144, "-o", tmp_path / "o.json",
                      "--previous", bad], capsys)
    assert rc == 2 and "previous" in err and not (tmp_path / "o.json").exists()


def test_module_entry_point(tmp_path):
    r = subprocess.run([sys.executable, "-m", "eplb", "plan", str(tmp_path / "nope.npy"), "--replicas", "8", "--gpus",
                        "2", "-o", str(tmp_path / "o.json")], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1
    r = subprocess.run([sys.executable, "-m", "eplb", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and "plan" in r.stdout


def test_png_only_with_matplotlib(stats, tmp_path, capsys):
    try:
        import matplotlib  # noqa: F401
        have = True
    except ImportError:
        have = False
    argv = ["plan", stats / "s.npy", "--replicas", 288, "--gpus", 144, "-o", tmp_path / "p.json", "--png",
            tmp_path / "p.png"]
    rc, out, err = run(argv, capsys)
    if have:
        assert rc == 0 and (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    else:
        assert rc == 2 and "matplotlib" in err and os.listdir(tmp_path) == []


def test_plan_deepseek_counts(tmp_path, capsys):
    # --deepseek-counts is rebalance_experts(..., one_copy_per_gpu=False): a hot expert with more copies than GPUs
    import eplb

    w = np.array([[1000, 1, 1, 1, 1, 1, 1, 1], [5, 90, 3, 2, 1, 1, 1, 1]], np.float64)
    np.save(tmp_path / "w.npy", w)
    for flag, one_copy in (([], True), (["--deepseek-counts"], False)):
        rc, out, err = run(["plan", tmp_path / "w.npy", "--replicas", 12, "--gpus", 4, "--nodes", 2, "--groups", 2,
                            "-o", tmp_path / "p.json", "--force", "--progress", "never", *flag], capsys)
        assert rc == 0, err
        want, _, cnt = eplb.rebalance_experts(w, 12, 2, 2, 4, one_copy_per_gpu=one_copy)
        assert json.loads((tmp_path / "p.json").read_text())["phy2log"] == want.tolist()
        assert int(cnt[0, 0]) == (2 if one_copy else 3)
        assert ("same-GPU duplicate slots: 0" in out) == one_copy, out
