"""The timing method of perf/ rows (perf/_method.py), checked without a GPU: the rotation plan against fake L2
sizes, the read-only flush, the call order of a graph of N, the per-kernel aggregation, the copy limit measured on
the same bytes by the same method, and every row naming its method."""

import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "perf"))
import _common  # noqa: E402
import _method  # noqa: E402

MIB = 1 << 20


@pytest.mark.parametrize("l2", [0, 50 * MIB, 60 * MIB, 96 * MIB])
@pytest.mark.parametrize("set_bytes", [1 * MIB, 2_752_512, 88_080_384, 300 * MIB])
def test_rotation_plan_exceeds_twice_l2_with_at_least_three_sets(l2, set_bytes):
    plan = _method.rotation_plan(set_bytes, l2)
    assert plan["sets"] >= 3
    assert plan["total_bytes"] == plan["sets"] * set_bytes > 2 * l2
    assert (plan["sets"] - 1) * set_bytes <= 2 * l2 or plan["sets"] == 3  # the fewest sets that do it
    assert plan["n"] >= 20 and plan["n"] % plan["sets"] == 0
    assert plan["order"] == [i % plan["sets"] for i in range(plan["n"])]
    # each replay touches every set equally often
    assert {plan["order"].count(s) for s in range(plan["sets"])} == {plan["n"] // plan["sets"]}


def test_rotation_plan_quant_shapes_on_a_60_mib_l2():
    # the 4096x7168 quant call moves 88 MiB (BF16 in, FP8 out, scales): 3 sets; the 128x7168 decode call 2.75 MB: 46
    big = _method.rotation_plan(4096 * 7168 * 3 + 4096 * 56 * 4, 60 * MIB)
    assert (big["sets"], big["n"]) == (3, 21)
    small = _method.rotation_plan(128 * 7168 * 3 + 128 * 56 * 4, 60 * MIB)
    assert small["sets"] == 2 * 60 * MIB // (128 * 7168 * 3 + 128 * 56 * 4) + 1 == 46 and small["n"] == 46
    with pytest.raises(ValueError):
        _method.rotation_plan(1024, 60 * MIB, max_sets=256)
    with pytest.raises(ValueError):
        _method.rotation_plan(0, 60 * MIB)


def test_flush_reads_and_never_writes():
    fl = _method.L2Flush("cpu", l2_bytes=1 * MIB, min_bytes=0)
    assert fl.kind == "read" and not fl.write
    assert fl.buf.numel() * fl.buf.element_size() >= 2 * fl.bytes == 2 * MIB
    fl.buf.fill_(7)
    before = fl.buf.clone()
    fl()
    assert torch.equal(fl.buf, before)  # not a byte written
    assert int(fl.sink) == 7 * fl.buf.numel()  # every element was read
    # the earlier flush writes: what this test tells apart
    w = _method.L2Flush("cpu", l2_bytes=1 * MIB, write=True, min_bytes=0)
    w.buf.fill_(7)
    w()
    assert not torch.equal(w.buf, before)
    # the minimum flush size, and no flush when the L2 size is unknown
    assert _method.flush_bytes(1 * MIB) == 64 * MIB and _method.flush_bytes(60 * MIB) == 120 * MIB
    assert _method.flush_bytes(0) == 0 and _method.L2Flush("cpu", l2_bytes=0).buf is None


def test_single_call_refuses_a_write_flush():
    w = _method.L2Flush("cpu", l2_bytes=1 * MIB, write=True, min_bytes=0)
    with pytest.raises(ValueError, match="read-only"):
        _method.time_single(lambda: None, "cpu", flush=w)


def test_graph_of_n_runs_the_plan_order():
    seen = []
    plan = _method.rotation_plan(10 * MIB, 16 * MIB, n=5)  # 4 sets, n 8
    assert (plan["sets"], plan["n"]) == (4, 8)
    calls = [lambda i=i: seen.append(i) for i in range(plan["sets"])]
    t, info = _method.time_graph_n(calls, torch.device("cpu"), plan, replays=2)
    # a warm-up of every set, then each replay in plan order
    assert seen == [0, 1, 2, 3] + plan["order"] * 2
    assert info["method"] == _method.CPU_WALL and info["sets"] == 4 and info["n"] == 8 and t.n == 2
    with pytest.raises(ValueError):
        _method.time_graph_n(calls[:3], "cpu", plan)


def test_copy_limit_moves_the_op_bytes_by_the_same_plan():
    op = 10 * MIB + 4
    payload = _method.copy_plan_bytes(op)
    assert 2 * payload >= op and 2 * payload - op < 32 and payload % 16 == 0
    lim = _method.copy_limit(op, torch.device("cpu"), l2_bytes=8 * MIB, n=4, replays=1)
    assert lim["sets"] == 3 and lim["total_bytes"] == 3 * 2 * payload > 16 * MIB
    assert lim["GBps"] == pytest.approx(2 * payload / lim["us"] / 1e3)


def test_measure_picks_the_method_and_times_the_limit_the_same_way():
    made = []

    def make_set(i):
        x = torch.full((1024,), float(i))
        made.append(i)
        return lambda: x * 2

    big = _method.measure(make_set, 4 * MIB, torch.device("cpu"), l2_bytes=5 * MIB, n=3, replays=1)
    assert made == [0, 1, 2] and big["sets"] == 3 and big["total_bytes"] > 10 * MIB
    assert big["ratio"] == pytest.approx(big["limit_us"] / big["us"])
    made.clear()
    small = _method.measure(make_set, 1024, torch.device("cpu"), l2_bytes=60 * MIB, max_sets=256, iters=2)
    assert made == [0] and "sets" not in small  # too many sets: one call after a read-only flush instead
    # on a GPU the two branches are graph-rotating / graph-single; the description says which
    assert _method.describe({"method": _method.GRAPH_N, "n": 21, "sets": 3, "total_bytes": 264 * MIB,
                             "l2_bytes": 60 * MIB}) == \
        "graph of 21 calls over 3 rotating sets (264 MiB > 2x L2 60 MiB), time / 21"
    assert _method.describe({"method": _method.GRAPH_SINGLE, "flush": "read", "flush_bytes": 120 * MIB}) == \
        "graph of 1 call after a read flush of 120 MiB"


def test_kernel_times_aggregate_per_call():
    recs = [("send", 10.0), ("fill_", 1.0), ("fill_", 1.5), ("recv", 20.0)] * 4
    got = _method.aggregate_kernels(recs, 4)
    assert got == {"recv": 20.0, "send": 10.0, "fill_": 2.5}
    assert list(got) == ["recv", "send", "fill_"]  # slowest first
    # the profiler path runs on CPU (top-level ops) and returns names with times
    x = torch.randn(64, 64)
    kt = _method.kernel_times(lambda: x @ x, "cpu", iters=2)
    assert kt and all(v >= 0 for v in kt.values()) and any("matmul" in k for k in kt)


def test_every_row_names_its_method(tmp_path):
    path = tmp_path / "r.jsonl"
    rec = _common.Records("bench_x", str(path), smoke=False, device="d", argv=[])
    with pytest.raises(ValueError, match="method"):
        rec.add("c", "time", 1.0, "us")
    rec.add("c", "time", 1.0, "us", method=_common.GRAPH_N)
    with pytest.raises(ValueError):
        rec.add("c", "time", 1.0, "us", method="events")
    rec2 = _common.Records("bench_x", None, smoke=False, device="d", argv=[], method=_common.EAGER)
    assert rec2.add("c", "time", 1.0, "us")["method"] == _common.EAGER
    smoke = _common.Records("bench_x", None, smoke=True, device="d", argv=[], method=_common.GRAPH_N)
    assert smoke.add("c", "time", 1.0, "us")["method"] == _common.CPU_WALL  # a CPU run never claims a GPU method
    assert smoke.add("c", "bytes", 1, "B", method=_common.COUNTED)["method"] == _common.COUNTED
    rows = [json.loads(ln) for ln in path.read_text().splitlines()[1:]]
    assert [r["method"] for r in rows] == [_common.GRAPH_N] and "method" in _common.ROW_KEYS
    assert rows[0]["method_detail"] == _common.METHODS[_common.GRAPH_N]


def test_how_lines_map_to_methods():
    assert _common.how_method("CUDA graph replay") == _common.GRAPH_SINGLE
    assert _common.how_method("CUDA graph replays") == _common.GRAPH_SINGLE
    assert _common.how_method("eager launches") == _common.EAGER
    assert _common.how_method("eager launches (CUDA graph capture failed: X)") == _common.EAGER
    assert _common.how_method("CPU (gloo ranks)") == _common.CPU_WALL
    assert _common.how_method("eager (CPU)") == _common.CPU_WALL


def test_lease_split_parts_and_host_stub():
    sys.path.insert(0, os.path.join(ROOT, "perf"))
    import lease_method

    assert lease_method.split_parts(139.0, 110.0, 40.0) == {"flush_writeback_us": 29.0, "host_gap_us": 70.0,
                                                            "kernel_cold_us": 40.0}
    assert lease_method.quant_bytes(4096, 7168) == 4096 * 7168 * 3 + 4096 * 56 * 4
    assert lease_method.quant_bytes(4096, 2048, 4096) == 4096 * 4096 * 2 + 4096 * 2048 + 4096 * 16 * 4
    # the host timer replaces Triton's launch and puts it back
    import triton
    import triton.language as tl
    import triton.runtime.jit as jit

    @triton.jit
    def k(p, BLOCK: tl.constexpr):
        tl.store(p + tl.arange(0, BLOCK), tl.arange(0, BLOCK))

    orig = jit.JITFunction.run
    if isinstance(k, jit.JITFunction):  # compiled Triton (not the interpreter): the launch is caught
        h = lease_method.host_us(lambda: k[(1,)](torch.empty(4), BLOCK=4), iters=3)
        assert h["launches_stubbed"] == 1.0
    h = lease_method.host_us(lambda: None, iters=3)
    assert h["launches_stubbed"] == 0.0 and jit.JITFunction.run is orig
