"""Simulator invariants, the cost model's byte counting, traces, and the CLI as a subprocess."""

import json
import subprocess
import sys

import numpy as np
import pytest

from serving.adp import ADPGate, make_router
from serving.cost import CostModel, LinearCost, a2a_bytes
from serving.hardware import HARDWARE
from serving.sim import SimConfig, SimError, simulate
from serving.trace import Trace, TraceError, load_trace, synthetic


def small_trace(n=300, seed=1):
    return synthetic(n, mean_input=200, mean_output=60, max_input=400, max_output=600, seed=seed)


@pytest.mark.parametrize("gate", [ADPGate(enabled=False), ADPGate(50, 10), ADPGate(5, 2, batching="seed")])
@pytest.mark.parametrize("router,chunked,kv", [("rr", False, None), ("heap", True, 3000)])
def test_conservation(gate, router, chunked, kv):
    tr = small_trace()
    cfg = SimConfig(num_ranks=4, max_batch_size=16, max_num_tokens=600, concurrency=48,
                    kv_capacity_tokens=kv, chunked_prefill=chunked)
    res = simulate(tr, LinearCost(), make_router(router), gate, cfg)
    assert np.all(np.isfinite(res.t_finish)) and np.all(res.t_first <= res.t_finish)
    assert np.all(res.t_arrive <= res.t_first)
    assert res.output_tokens == int(tr.output_len.sum())
    # every token processed is a prompt token, a decode token (output - 1 per request) or a dummy
    assert int(res.tokens.sum()) == int(tr.input_len.sum() + (tr.output_len - 1).sum()) + res.dummy_tokens
    m = res.metrics()
    assert 0 < m["mean_balance"] <= 1 and m["sol_tps"] >= m["tps"] * 0.999


def test_gate_off_equals_baseline_and_determinism():
    tr, cfg = small_trace(), SimConfig(num_ranks=4, max_batch_size=16, max_num_tokens=600, concurrency=48)
    a = simulate(tr, LinearCost(), make_router("rr"), ADPGate(enabled=False), cfg)
    b = simulate(tr, LinearCost(), make_router("rr"), ADPGate(enabled=False, timeout_iters=7), cfg)
    c = simulate(tr, LinearCost(), make_router("rr"), ADPGate(enabled=False), cfg)
    assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.tokens, c.tokens)


def test_open_loop_and_errors():
    tr = Trace(np.array([5, 5, 5]), np.array([3, 1, 2]), arrival_s=np.array([0.0, 1.0, 5.0]))
    res = simulate(tr, LinearCost(), make_router("rr"), ADPGate(), SimConfig(num_ranks=2, concurrency=None))
    assert res.output_tokens == 6 and res.t_first[2] >= 5.0
    with pytest.raises(SimError, match="cannot run whole"):
        simulate(Trace(np.array([5000]), np.array([1])), LinearCost(), make_router("rr"), ADPGate(), SimConfig())
    with pytest.raises(SimError, match="exceeds the KV capacity"):
        simulate(tr, LinearCost(), make_router("rr"), ADPGate(), SimConfig(kv_capacity_tokens=6))
    with pytest.raises(TraceError, match="output_len=0 must be >= 1"):
        Trace(np.array([5]), np.array([0]))


def test_synthetic_statistics():
    tr = synthetic(16000)
    assert abs(tr.input_len.mean() - 803) < 1 and abs(tr.output_len.mean() - 3653) < 4
    assert np.median(tr.output_len) < 0.75 * tr.output_len.mean()  # long tail


def test_cost_model():
    h = 7168
    d, c = a2a_bytes(10, h, 8, 8, low_latency=True)
    assert d == 80 * (h + h // 32 + 16) and c == 80 * 2 * h
    d, c = a2a_bytes(10, h, 8, 1 << 30, low_latency=False)  # huge EP: ~8 distinct ranks per token
    assert d == pytest.approx(80 * (h + h // 32), rel=1e-6)
    cm = CostModel(HARDWARE["H200"])
    z = np.zeros(8)
    dec = np.full(8, 256.0)
    ctx = dec.copy()
    ctx[0] += 800
    kvc = z.copy()
    kvc[0] = 800 * 801 / 2
    t_dec = cm.iteration_time(dec, z, dec * 2000)
    t_ctx = cm.iteration_time(ctx, kvc, dec * 2000)
    assert 0.01 < t_dec < t_ctx < 1.0
    assert cm.iteration_time(dec, z, dec * 4000) > t_dec  # KV-length term
    assert 1e5 < cm.kv_capacity_tokens() < 1e7
    with pytest.raises(ValueError, match="does not fit"):
        CostModel(HARDWARE["H100"], num_ranks=1).kv_capacity_tokens()


def test_load_trace(tmp_path):
    p = tmp_path / "t.json"
    p.write_text(json.dumps([{"input_len": 10, "output_len": 3}, {"input_len": 4, "output_len": 1}]))
    assert load_trace(p).input_len.tolist() == [10, 4]
    q = tmp_path / "t.csv"
    q.write_text("isl,osl\n10,3\n4,x\n")
    with pytest.raises(TraceError, match="row 1: osl='x' is not a number"):
        load_trace(q)


def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "serving", *args], capture_output=True, text=True, timeout=60,
                          cwd=cwd)


@pytest.mark.parametrize("args,needle", [
    (["adp", "--requests", "-5"], "--requests=-5 must be >= 1"),
    (["adp", "--mean-input", "-3"], "means must lie in"),
    (["adp", "--timeout-iters", "-1"], "must be >= 0"),
    (["adp", "--router", "nope"], "invalid choice"),
    (["adp", "--trace", "/nonexistent/trace.json"], "cannot read trace"),
    (["nope"], "invalid choice"),
])
def test_cli_errors(args, needle, tmp_path):
    out = tmp_path / "o"
    r = run_cli(*args, "--out", str(out)) if args[0] == "adp" else run_cli(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr and not out.exists()


def test_cli_malformed_trace(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('[{"input_len": 10, "output_len": -2}]')
    r = run_cli("adp", "--trace", str(bad), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and r.stderr.strip() == "error: request 0: output_len=-2 must be >= 1"
    assert not (tmp_path / "o").exists()


def test_cli_small_run(tmp_path):
    r = run_cli("adp", "--requests", "200", "--concurrency", "256", "--mean-output", "500", "--max-output", "2000", "--no-plots")
    assert r.returncode == 0, r.stderr
    assert "| round-robin |" in r.stdout and "| full |" in r.stdout and "Traceback" not in r.stderr


SMALL_ADP = ("adp", "--requests", "60", "--concurrency", "16", "--mean-input", "100", "--mean-output", "32",
             "--max-output", "64", "--pareto-scale", "0")


def test_cli_writes_only_where_told(tmp_path):
    import os
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    watched = [root / "adp_out", root / "serving" / "adp_out"]
    before = [p.exists() for p in watched]

    def run(*args, cwd):
        return subprocess.run([sys.executable, "-m", "serving", *args], capture_output=True, text=True, timeout=60,
                              cwd=cwd, env=env)

    r = run(*SMALL_ADP, cwd=tmp_path)                       # default: ./adp_out of the current directory
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "adp_out" / "metrics.json").is_file()
    assert "simulating round-robin (1/3" in r.stderr        # progress lines on stderr, not in the table
    assert "simulating" not in r.stdout
    r = run(*SMALL_ADP, "--out", str(tmp_path / "elsewhere"), cwd=tmp_path)
    assert r.returncode == 0 and (tmp_path / "elsewhere" / "metrics.json").is_file(), r.stderr
    r = run(*SMALL_ADP, cwd=root / "serving")               # never into the package folder
    assert r.returncode == 2 and "inside the package folder" in r.stderr and "--out" in r.stderr
    assert [p.exists() for p in watched] == before
