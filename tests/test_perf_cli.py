"""perf/ command lines: run_all.sh without a GPU, each bench's --cpu-smoke --json records, error exits."""

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

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


# benches whose --cpu-smoke run has a test of its own below (it checks these common keys too)
OWN_SMOKE_TESTS = ("bench_internode_ll.py", "bench_mega_moe.py")


def _smoke(bench, out):
    """``bench --cpu-smoke --json out``: exit 0, no traceback, a header and valid rows with the common keys; returns
    (the process, header, rows)."""
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
    return p, head, rows


@pytest.mark.slow  # every bench's --cpu-smoke end to end: about 90 s in all (CI runs it)
@pytest.mark.parametrize("bench", [b for b in BENCHES if b not in OWN_SMOKE_TESTS])
def test_bench_cpu_smoke_json(bench, tmp_path):
    _smoke(bench, tmp_path / "rows.jsonl")


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


# ---------------------------------------------------------------- bench_internode_ll.py and perf/launch_internode.sh

FAKE_SMI = "#!/bin/sh\ni=0; while [ $i -lt ${FAKE_GPUS:-8} ]; do echo \"GPU $i: NVIDIA H800 (UUID: GPU-$i)\"; i=$((i+1)); done\n"
FAKE_ECHO = "#!/bin/sh\necho \"$(basename \"$0\") $*\"\n"


def _fake_bin(tmp_path, **scripts):
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    for name, text in scripts.items():
        (d / name).write_text(text)
        (d / name).chmod(0o755)
    return str(d)


def _launch_sh(args, env_extra, timeout=30):
    env = {k: v for k, v in ENV.items() if not k.startswith("NVSHMEM_")}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.update(env_extra)
    return subprocess.run(["bash", os.path.join(PERF, "launch_internode.sh"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # a bench's --cpu-smoke end to end (20-35 s; CI runs -m slow)
def test_internode_ll_cpu_smoke_rows(tmp_path):
    """The smoke run goes through moe_ep.Buffer on 4 forked ranks as 2 emulated nodes: symm rows for dispatch and
    combine (time, bandwidth, internode bandwidth), checked, cross-node selections counted; nvshmem either runs or is
    skipped with one line; no published target at smoke shapes; DeepEP skipped with one line."""
    p, head, rows = _smoke("bench_internode_ll.py", tmp_path / "ll.jsonl")
    assert head["launcher"] == "fork" and head["world_size"] == 4 and "DeepEP" in head["deepep"]
    symm = [r for r in rows if r["backend"] == "symm"]
    assert {(r["op"], r["metric"]) for r in symm} == {(op, m) for op in ("dispatch", "combine")
                                                      for m in ("time", "bandwidth", "internode bandwidth")}
    for r in symm:
        assert r["valid"] is True
        if r["metric"] == "time":
            assert r["rel_err"] <= 1e-2 and r["published_us"] is None and r["nodes"] == 2
            assert 0 < r["internode_selections_per_rank"] < r["selections_per_rank"]
            assert len(r["per_rank_us"]) == 4 and "meaningless" in r["note"]
    if not any(r["backend"] == "nvshmem" for r in rows):
        assert sum("backend nvshmem:" in ln for ln in p.stdout.splitlines()) == 1
    assert sum(ln.startswith("# DeepEP baseline: skipped") for ln in p.stdout.splitlines()) == 1


def test_internode_ll_refusals():
    bench = os.path.join(PERF, "bench_internode_ll.py")
    p = _run([sys.executable, bench, "--launcher", "fork"], timeout=60)
    assert p.returncode == 2 and "only with --cpu-smoke" in p.stderr and "Traceback" not in p.stderr
    p = _run([sys.executable, bench, "--graph", "--zero-copy"], timeout=60)
    assert p.returncode == 2 and "not supported" in p.stderr
    p = _run([sys.executable, bench, "--backend", "none", "symm"], timeout=60)
    assert p.returncode == 2 and "DeepEP only" in p.stderr


def test_torchrun_env_error(monkeypatch, capsys):
    for k in _common.TORCHRUN_ENV:
        monkeypatch.delenv(k, raising=False)
    assert _common.torchrun_env_error("x.py", "torchrun x.py") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "RANK, WORLD_SIZE, LOCAL_RANK" in err[0] and "`torchrun x.py`" in err[0]
    for k in _common.TORCHRUN_ENV:
        monkeypatch.setenv(k, "0")
    assert _common.torchrun_env_error("x.py", "torchrun x.py") is None


def test_internode_ll_published_targets():
    import bench_internode_ll as b
    args = b._parse([])
    assert (args.tokens, args.hidden, args.topk, args.experts, args.backend) == (128, 7168, 8, 256, ["nvshmem"])
    assert b.published(16, args) == (118.0, 195.0) and b.published(128, args) == (192.0, 369.0)
    assert b.published(8, args) is None  # not in the table
    assert b.published(32, b._parse(["--hidden", "4096"])) is None
    assert b.published(32, b._parse(["--no-fp8"])) is None
    assert b.published(32, b._parse(["--cpu-smoke"])) is None
    assert b.published(32, b._parse(["--routing", "zipf"])) is None
    assert "docs/legacy.md" in b.PUBLISHED_SOURCE and "118 / 195" in b.__doc__
    assert b.bytes_per_selection("dispatch", 7168, True) == 7168 + 224 + 16
    assert b.bytes_per_selection("dispatch", 7168, False) == b.bytes_per_selection("combine", 7168, True) == 14336


def _checks_on_one_rank(rank, world):
    """check_dispatch / check_combine accept a correct receive and reject a wrong count, a wrong row, a wrong factor."""
    import torch

    import bench_internode_ll as b
    from moe_ep.fp8 import per_token_group_quant_fp8_ref

    args = b._parse(["--cpu-smoke", "--tokens", "6", "--hidden", "256", "--experts", "4", "--topk", "2"])
    ctx = b.Ctx(rank, world, torch.device("cpu"), 1)
    x, idx, w = b.make_inputs(rank, args, ctx.device)
    q, s = per_token_group_quant_fp8_ref(x, 128)
    L, T = args.experts, args.tokens
    rq = torch.zeros(L, T, args.hidden, dtype=q.dtype)
    rs = torch.zeros(L, T, args.hidden // 128)
    count = torch.zeros(L, dtype=torch.int32)
    pos = {}
    for t in range(T):
        for k in range(args.topk):
            e = int(idx[t, k])
            if e >= 0:
                pos[(t, k)] = (e, int(count[e]))
                rq[e, count[e]], rs[e, count[e]] = q[t], s[t]
                count[e] += 1
    good = ((rq, rs), count)
    res = {"dispatch_ok": b.check_dispatch(good, x, idx, args, ctx)}
    e0 = int(idx[0, 0])
    rs_bad = rs.clone()
    rs_bad[e0, 0] *= 2
    res["dispatch_bad_row"] = b.check_dispatch(((rq, rs_bad), count), x, idx, args, ctx)
    res["dispatch_bad_count"] = b.check_dispatch(((rq, rs), count + 1), x, idx, args, ctx)
    y = b.expert_outputs(good, args, ctx)

    def combine(ys):
        out = torch.zeros(T, args.hidden)
        for (t, k), (e, p) in pos.items():
            out[t] += w[t, k] * ys[e, p].float()
        return out.to(torch.bfloat16)
    res["combine_ok"] = b.check_combine(combine(y), x, idx, w, ctx)
    res["combine_bad_factor"] = b.check_combine(combine(b.expert_outputs(good, args, ctx) * 0 + rq.float().to(
        torch.bfloat16)), x, idx, w, ctx)
    return res


def test_internode_ll_checks_catch_errors():
    from moe_ep.testing import launch

    res = launch(_checks_on_one_rank, 1, timeout_s=120)[0]
    assert res["dispatch_ok"] == (True, 0.0, True)
    assert res["dispatch_bad_row"][0] is False and res["dispatch_bad_row"][2] is True
    assert res["dispatch_bad_count"][0] is False and res["dispatch_bad_count"][2] is False
    assert res["combine_ok"][0] is True and res["combine_ok"][1] < 1e-2
    assert res["combine_bad_factor"][0] is False


def test_launch_internode_help_and_refusals(tmp_path):
    p = _launch_sh(["-h"], {})
    assert p.returncode == 0 and "NNODES" in p.stdout and "MASTER_ADDR" in p.stdout and "set -" not in p.stdout
    p = _launch_sh([], {"TORCHRUN": "no-such-torchrun"})
    assert p.returncode == 2 and "not found" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    fake = _fake_bin(tmp_path, torchrun=FAKE_ECHO, **{"nvidia-smi": FAKE_SMI})
    path = f"{fake}:/usr/bin:/bin"
    p = _launch_sh([], {"PATH": path, "CUDA_VISIBLE_DEVICES": ""})
    assert p.returncode == 2 and "no CUDA GPU" in p.stderr
    p = _launch_sh([], {"PATH": "/usr/bin:/bin", "TORCHRUN": os.path.join(fake, "torchrun")})
    assert p.returncode == 2 and "no CUDA GPU" in p.stderr  # no nvidia-smi at all
    p = _launch_sh([], {"PATH": path, "FAKE_GPUS": "4"})
    assert p.returncode == 2 and "GPUS_PER_NODE=4" in p.stderr
    p = _launch_sh([], {"PATH": path, "NNODES": "2"})
    assert p.returncode == 2 and "MASTER_ADDR is required" in p.stderr
    p = _launch_sh([], {"PATH": path, "NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "10.0.0.1"})
    assert p.returncode == 2 and "NODE_RANK" in p.stderr


def test_launch_internode_command_and_nvshmem_env(tmp_path):
    fake = _fake_bin(tmp_path, torchrun=FAKE_ECHO, **{"nvidia-smi": FAKE_SMI})
    env = {"PATH": f"{fake}:/usr/bin:/bin", "NNODES": "4", "NODE_RANK": "3", "MASTER_ADDR": "10.0.0.1",
           "MASTER_PORT": "29999", "NVSHMEM_IBGDA_NIC_HANDLER": "auto"}
    p = _launch_sh(["--json", "ll.jsonl", "--experts", "64"], env)
    assert p.returncode == 0, p.stderr
    ran = p.stdout.strip().splitlines()[-1]  # the fake torchrun echoes its arguments
    assert ran.startswith("torchrun --nnodes 4 --node-rank 3 --nproc-per-node 8 --master-addr 10.0.0.1 --master-port 29999 "
                          "perf/bench_internode_ll.py --launcher torchrun --gpus-per-node 8 --json ll.jsonl --experts 64")
    assert "# NVSHMEM_IB_ENABLE_IBGDA=1" in p.stdout
    assert "# NVSHMEM_IBGDA_NIC_HANDLER=auto" in p.stdout  # a value already set is kept
    assert "# NVSHMEM_IBGDA_NUM_RC_PER_PE=2" in p.stdout  # 64 experts / 32 ranks
    assert "# NVSHMEM_DISABLE_P2P=0" in p.stdout and "--pure-rdma" not in ran
    p = _launch_sh(["--dry-run"], dict(env, PURE_RDMA="1"))
    assert p.returncode == 0 and "# NVSHMEM_DISABLE_P2P=1" in p.stdout and "--pure-rdma" in p.stdout
    assert not any(ln.startswith("torchrun ") for ln in p.stdout.splitlines())  # dry run: printed, not run
    text = open(os.path.join(PERF, "launch_internode.sh")).read()
    for knob in ("NVSHMEM_IB_ENABLE_IBGDA", "NVSHMEM_IBGDA_NIC_HANDLER", "NVSHMEM_IBGDA_NUM_RC_PER_PE", "NVSHMEM_QP_DEPTH",
                 "NVSHMEM_DISABLE_P2P", "NVSHMEM_DISABLE_NVLS"):
        i = text.index(f"export {knob}=")
        assert text[:i].rstrip().splitlines()[-1].lstrip().startswith("#"), f"{knob} has no comment above it"


def test_run_all_runs_internode_bench_with_torchrun_or_says_why(tmp_path):
    """GPU mode with faked nvidia-smi / python / torchrun: one GPU -> one line, the step is skipped (not failed);
    eight -> perf/launch_internode.sh over the 8 local GPUs with the bench's --json. The mega-MoE bench likewise:
    one GPU -> one skipped line; eight -> torchrun --standalone over the 8 GPUs."""
    fake = _fake_bin(tmp_path, fakepy=FAKE_ECHO, faketorchrun=FAKE_ECHO, **{"nvidia-smi": FAKE_SMI})
    for gpus in ("1", "8"):
        out = tmp_path / f"out{gpus}"
        env = dict(ENV, PATH=f"{fake}:/usr/bin:/bin", FAKE_GPUS=gpus, PYTHON=os.path.join(fake, "fakepy"),
                   TORCHRUN=os.path.join(fake, "faketorchrun"), OUT_DIR=str(out), PYTEST_TIMEOUT="30")
        env.pop("CUDA_VISIBLE_DEVICES")
        subprocess.run(["bash", os.path.join(PERF, "run_all.sh")], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
        md = next(out.glob("*.md")).read_text()
        sec = md.split("## bench_internode_ll.py", 1)[1].split("\n## ", 1)[0]
        if gpus == "1":
            assert "needs a cluster" in sec and "| bench_internode_ll.py | skipped" in md
        else:
            assert "faketorchrun --nnodes 1 --node-rank 0 --nproc-per-node 8" in sec
            assert "perf/bench_internode_ll.py --launcher torchrun --gpus-per-node 8 --backend nvshmem symm --json" in sec
        mega = md.split("## bench_mega_moe.py", 1)[1].split("\n## ", 1)[0]
        if gpus == "1":
            assert "needs at least 2 GPUs" in mega and "| bench_mega_moe.py | skipped" in md
        else:
            assert "faketorchrun --standalone --nproc-per-node 8 perf/bench_mega_moe.py --launcher torchrun --json" in mega


# ---------------------------------------------------------------- bench_mega_moe.py

@pytest.mark.slow  # a bench's --cpu-smoke end to end (15-25 s; CI runs -m slow)
def test_mega_moe_cpu_smoke_rows(tmp_path):
    """The smoke run: fused, phased and both expert-path layer modes on 2 forked ranks, each checked against the
    torch reference; a symmetric-memory row for the fused case; DeepEP + DeepGEMM skipped with one line."""
    p, head, rows = _smoke("bench_mega_moe.py", tmp_path / "mega.jsonl")
    assert head["launcher"] == "fork" and head["world_size"] == 2
    times = {r["op"]: r for r in rows if r["metric"] == "time"}
    assert set(times) == {"fused", "phased", "layer-decode", "layer-prefill"}
    for r in times.values():
        assert r["valid"] is True and r["rel_err"] <= 1e-2 and len(r["per_rank_us"]) == 2 and "meaningless" in r["note"]
    assert times["fused"]["baseline_name"] in ("layer-decode", "layer-prefill") and times["fused"]["ratio"] > 0
    assert times["fused"]["timed_as"].startswith("one launch") and times["phased"]["timed_as"] == "three launches"
    assert times["fused"]["fused_equals_phased"] is True and times["fused"]["fell_back"] is False
    mem = [r for r in rows if r["metric"] == "symmetric memory"]
    assert len(mem) == 1 and mem[0]["value"] > 0 and mem[0]["ratio"] > 1  # smaller than the layer's buffer
    assert sum(ln.startswith("# DeepEP + DeepGEMM baseline: skipped") for ln in p.stdout.splitlines()) == 1


def test_mega_moe_refusals():
    bench = os.path.join(PERF, "bench_mega_moe.py")
    p = _run([sys.executable, bench, "--launcher", "fork"], timeout=60)
    assert p.returncode == 2 and "only with --cpu-smoke" in p.stderr and "Traceback" not in p.stderr
    p = subprocess.run([sys.executable, bench, "--launcher", "torchrun"], cwd=ROOT, env=dict(ENV, RANK="0"),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2  # no GPU: refused before anything else
    p = _run([sys.executable, bench, "--cpu-smoke", "--hidden", "200"], timeout=60)
    assert p.returncode == 2 and "multiples of 128" in p.stderr


def _mega_checks_on_ranks(rank, world):
    """bench_mega_moe's check accepts the reference itself and rejects one element off by 5% of max|ref| and a NaN."""
    import bench_mega_moe as b
    from moe_ep.quant import per_token_group_quant_fp8

    args = b._parse(["--cpu-smoke", "--tokens", "5"])
    ctx = b.Ctx(rank, world, torch.device("cpu"))
    weights = b.make_weights(rank, world, args, ctx.device)
    x, idx, w = b.make_inputs(rank, 5, args, ctx.device)
    xq, xs = per_token_group_quant_fp8(x)
    sample = torch.arange(5)
    ref = b.reference(ctx, xq, xs, idx, w, weights, sample)
    good = ref.to(torch.bfloat16)
    bad_row = good.clone()
    if rank == 1:
        bad_row[3, 0] += 0.05 * float(ref.abs().max())
    nan = good.clone()
    if rank == 0:
        nan[4, 7] = float("nan")
    return {name: b.check(out, ref, sample, ctx) for name, out in (("good", good), ("bad_row", bad_row), ("nan", nan))}


def test_mega_moe_checks_catch_errors():
    from moe_ep.testing import launch

    for res in launch(_mega_checks_on_ranks, 2, timeout_s=120):
        assert res["good"][0] is True and res["good"][1] < 1e-2
        assert res["bad_row"][0] is False and res["nan"][0] is False


def test_torch_a2a_vs_raw_side_by_side(tmp_path):
    """--vs-raw: the raw exchange is the baseline row; layout+dispatch and combine carry their ratio to it."""
    out = tmp_path / "rows.jsonl"
    p = _run([sys.executable, os.path.join(PERF, "bench_torch_a2a.py"), "--cpu-smoke", "--vs-raw", "--iters", "3",
              "--json", str(out)])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "INVALID" not in p.stdout and "ratio" in p.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()][1:]
    assert [r["case"].split(":")[1].split(" 2 ranks")[0].strip() for r in rows] == [
        "raw all_to_all_single x2 (counts, rows)", "get_dispatch_layout + dispatch BF16", "combine BF16"]
    base = rows[0]["value"]
    assert rows[0]["ratio"] == 1.0 and rows[0]["baseline"] is None
    for r in rows[1:]:
        assert r["baseline"] == base and abs(r["ratio"] - r["value"] / base) < 1e-9
        assert r["valid"] and r["iterations"] == 3 and r["interleaved"] is True
