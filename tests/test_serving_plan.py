"""RCSD planner: search against exhaustive oracles on toy clusters, the paper's directions, the CLI."""

import dataclasses
import json
import os
import random
import subprocess
import sys

import pytest

from serving.hardware import HARDWARE
from serving.plan import (MODELS, SLO, Cluster, Knobs, ParallelConfig, PlanError, StageRate, Workload, _split,
                          best_pair_exhaustive, closest_by_bisect, closest_by_scan, enumerate_configs,
                          pareto_by_rate, plan, replicate, stage_table)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
R1, QWEN = MODELS["deepseek-r1"], MODELS["qwen-32b"]
PAPER_CLUSTER = Cluster(16, HARDWARE["B64"])
PAPER_SLO = SLO(1.0, 0.2)
TOY = Cluster(2, dataclasses.replace(HARDWARE["H100"], gpus_per_node=4))


def test_enumerate_configs_products_and_counts():
    cfgs = enumerate_configs(8, 8)
    assert len(cfgs) == 20  # ordered factorisations of 2^3 into 4 powers of two
    assert all(c.num_gpus == 8 for c in cfgs)
    assert all(c.ep == 1 for c in enumerate_configs(8, 8, is_moe=False))
    assert max(c.tp for c in enumerate_configs(32, 4)) == 4  # TP stays inside a node


def test_peer_split_by_node():
    assert _split(16, 1, 8) == (7 / 16, 8 / 16)  # EP16 over 2 nodes: 7 peers local, 8 remote
    assert _split(4, 2, 8) == (3 / 4, 0.0)  # stride 2 x 4 = one node
    assert _split(4, 8, 8) == (0.0, 3 / 4)  # one rank per node
    assert _split(1, 1, 8) == (0.0, 0.0)


def test_bisect_matches_scan_on_random_lists():
    rng = random.Random(0)
    for _ in range(500):
        rates = sorted(rng.uniform(0, 100) for _ in range(rng.randint(1, 30)))
        target = rng.uniform(-10, 110)
        i, j = closest_by_bisect(rates, target), closest_by_scan(rates, target)
        assert abs(rates[i] - target) == abs(rates[j] - target)


def test_pareto_keeps_only_undominated():
    cfg = lambda g: ParallelConfig(g, 1, 1, 1)  # noqa: E731
    rows = [StageRate("decode", cfg(g), r, 0.1, 1, True) for g, r in [(2, 1.0), (4, 0.5), (4, 3.0), (8, 2.0), (8, 4.0)]]
    assert [(r.cfg.num_gpus, r.rate) for r in pareto_by_rate(rows)] == [(2, 1.0), (4, 3.0), (8, 4.0)]


def test_rate_matching_distserve_example():
    # Seed 001's DistServe case: prefill workers of 5.6 rps, one decode worker of 10 rps, R = 10.
    p = StageRate("prefill", ParallelConfig(1, 1, 1, 1), 5.6, 0.3, 1, True)
    d = StageRate("decode", ParallelConfig(1, 1, 1, 1), 10.0, 0.03, 1, True)
    n, m = replicate(p, d, num_gpus=3, rate=10.0)
    assert (n, m) == (2, 1)
    assert min(n * p.rate, m * d.rate) / (n + m) == pytest.approx(10 / 3)
    assert replicate(p, d, num_gpus=3) == (2, 1)  # budget mode finds the same split


@pytest.mark.parametrize("isl,osl", [(256, 64), (1024, 256), (512, 2048)])
@pytest.mark.parametrize("search", ["ratio", "paper"])
def test_toy_cluster_against_exhaustive(isl, osl, search):
    knobs = Knobs(search=search)
    res = plan(QWEN, TOY, Workload(isl, osl), SLO(2.0, 0.1), knobs)
    assert res.bisect_matches_scan
    pre = stage_table("prefill", QWEN, TOY, Workload(isl, osl), res.slo, knobs)
    dec = stage_table("decode", QWEN, TOY, Workload(isl, osl), res.slo, knobs)
    oracle = best_pair_exhaustive(pre, dec, TOY.num_gpus)
    assert res.exhaustive_tok_s_per_gpu == pytest.approx(oracle[3] * osl / TOY.num_gpus)
    assert res.tok_s_per_gpu <= res.exhaustive_tok_s_per_gpu + 1e-9
    if search == "ratio":  # closest-by-rate is not always best per GPU: the gap stays small
        assert res.tok_s_per_gpu >= 0.9 * res.exhaustive_tok_s_per_gpu
    n, m = res.counts
    assert n * res.prefill.cfg.num_gpus + m * res.decode.cfg.num_gpus <= TOY.num_gpus
    assert res.prefill.latency_s <= 2.0 and res.decode.latency_s <= 0.1


def test_paper_directions():
    short = plan(R1, PAPER_CLUSTER, Workload(1024, 256), PAPER_SLO)
    long = plan(R1, PAPER_CLUSTER, Workload(1024, 4096), PAPER_SLO)
    share = lambda r: r.counts[0] * r.prefill.cfg.num_gpus / (  # noqa: E731
        r.counts[0] * r.prefill.cfg.num_gpus + r.counts[1] * r.decode.cfg.num_gpus)
    assert share(short) > 0.5 > share(long)  # prefill-heavy for short outputs, decode-heavy for long
    assert int(short.best_split.name.split("P")[0]) > int(long.best_split.name.split("P")[0])
    for res in (short, long):
        assert res.tok_s_per_gpu > res.baselines[0].tok_s_per_gpu  # beats colocated
        assert res.tok_s_per_gpu > res.baselines[1].tok_s_per_gpu  # beats the Splitwise-style ratio
        assert all(res.tok_s_per_gpu >= s.tok_s_per_gpu - 1e-9 for s in res.splits)
        assert res.tok_s_per_gpu == pytest.approx(res.exhaustive_tok_s_per_gpu)


def test_offered_rate_mode_counts():
    res = plan(R1, PAPER_CLUSTER, Workload(1024, 1024, rate=5.0), PAPER_SLO)
    n, m = res.counts
    assert n * res.prefill.rate >= 5.0 and m * res.decode.rate >= 5.0
    assert (n - 1) * res.prefill.rate < 5.0 and (m - 1) * res.decode.rate < 5.0


def test_cache_hit_cheapens_prefill():
    a = plan(R1, PAPER_CLUSTER, Workload(2048, 256), PAPER_SLO)
    b = plan(R1, PAPER_CLUSTER, Workload(2048, 256, cache_hit=0.5), PAPER_SLO)
    assert b.tok_s_per_gpu >= a.tok_s_per_gpu


@pytest.mark.parametrize("kwargs,msg", [
    (dict(workload=Workload(-1, 10)), "lengths"),
    (dict(workload=Workload(10, 10, cache_hit=1.0)), "cache hit"),
    (dict(slo=SLO(1.0, 1e-5)), "no configuration meets the SLO"),
    (dict(cluster=Cluster(1, HARDWARE["B64"])), "needs"),
])
def test_bad_input_raises(kwargs, msg):
    args = dict(model=R1, cluster=PAPER_CLUSTER, workload=Workload(512, 512), slo=PAPER_SLO) | kwargs
    with pytest.raises(PlanError, match=msg):
        plan(**args)


def test_degrade_relaxes_to_reachable():
    res = plan(R1, PAPER_CLUSTER, Workload(512, 512), SLO(1.0, 1e-5), degrade=True)
    assert res.degraded and res.slo.tpot_s > 1e-5 and res.rate > 0


# ---- the CLI as a subprocess -------------------------------------------------------------------

def _cli(*args):
    return subprocess.run([sys.executable, "-m", "serving.cli_plan", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": ROOT})


def test_cli_plan_prints_choice_and_table():
    r = _cli("--isl", "1024", "--osl", "256")
    assert r.returncode == 0, r.stderr
    for token in ("chosen:", "prefill", "decode", "tok/s per GPU", "10P6D", "4P12D", "colocated", "splitwise",
                  "RCSD (chosen)"):
        assert token in r.stdout


def test_cli_config_json_and_yaml(tmp_path):
    cfg = {"model": "qwen-32b", "hardware": "H100", "nodes": 2, "gpus_per_node": 4, "isl": 512, "osl": 128,
           "ttft": 2.0, "tpot": 0.1}
    (tmp_path / "job.json").write_text(json.dumps(cfg))
    r = _cli("--config", str(tmp_path / "job.json"))
    assert r.returncode == 0, r.stderr and "qwen-32b" in r.stdout
    yaml = pytest.importorskip("yaml")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(cfg))
    r2 = _cli("--config", str(tmp_path / "job.yaml"))
    assert r2.returncode == 0 and r2.stdout == r.stdout


def test_cli_paper_summary():
    r = _cli("--paper")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.strip().splitlines()) == 7 and "10P6D (short)" in r.stdout


@pytest.mark.parametrize("args,needle", [
    (("--isl", "-5"), "lengths"),
    (("--tpot", "0.00001"), "SLO"),
    (("--memory-gb", "4"), "needs"),
    (("--model", "gpt-9"), "unknown model"),
    (("--config", "/nonexistent/job.json"), "cannot read"),
])
def test_cli_errors_exit_2_one_line(args, needle):
    r = _cli(*args)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0]


@pytest.mark.parametrize("text,needle", [('{"isl": ', "malformed JSON"), ('[1, 2]', "mapping"),
                                         ('{"isl": "long"}', "isl"), ('{"islx": 3}', "unknown key")])
def test_cli_malformed_config(tmp_path, text, needle):
    (tmp_path / "bad.json").write_text(text)
    r = _cli("--config", str(tmp_path / "bad.json"))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("error:") and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_add_plan_parser_registers_subcommand():
    import argparse

    from serving.cli_plan import add_plan_parser
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["plan", "--isl", "512", "--osl", "512"])
    assert args.cmd == "plan" and args.func(args) == 0
