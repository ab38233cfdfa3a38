"""The warp-specialised Gluon FP8 GEMM compiles for sm90 without a GPU, under this Triton (and under Triton 3.6
through ``scripts/compile_oldest_triton.sh``): for every shipped case, and by name for the DeepSeek-V3 case
N=4096 K=7168 in each layout, ``wgmma.wait_group 1`` (an MMA kept in flight while the previous K block is
promoted), TMA loads (``cp.async.bulk.tensor`` into shared memory), ``setmaxnreg`` moving registers from the
producer warp to the consumer warpgroups, and no spills."""

from __future__ import annotations

import pytest

from moe_ep.testing.sm90 import REPORT_PROLOGUE, compile_in_subprocess

# sm90 ahead-of-time compiles (about 10 s each on 2 cores; `bash scripts/test.sh -m slow`; CI runs them)
pytestmark = pytest.mark.slow

SCRIPT = REPORT_PROLOGUE + r'''
from moe_ep.kernels.gluon_compat import GLUON_ERROR, HAVE_GLUON, GluonASTSource
if not HAVE_GLUON:
    print(json.dumps([{"skip": GLUON_ERROR}]))
    sys.exit(0)
import triton
from triton.backends.compiler import GPUTarget
from moe_ep.gemm.gluon import sm90_cases
out = []
for c in sm90_cases():
    row = report.compile_report(c["kernel"], c["signature"], c["constexprs"], c["num_warps"], c["num_stages"],
                                c["attrs"])
    ck = triton.compile(GluonASTSource(c["kernel"], c["signature"], c["constexprs"], c["attrs"]),
                        target=GPUTarget("cuda", 90, 32), options={"num_warps": c["num_warps"]})
    ptx = ck.asm["ptx"]
    row.update(config=c["config"], triton=triton.__version__,
               tma_loads=len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::\w+\.global", ptx)),
               tma_stores=len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::\w+", ptx)),
               ffma=len(re.findall(r"\bfma\.rn\.f32", ptx)))
    out.append(row)
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def rows():
    return compile_in_subprocess(SCRIPT, [], "the Gluon grouped GEMM", timeout_s=900)


def test_every_case_compiles_without_spills(rows):
    assert len(rows) >= 8
    for r in rows:
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack"] == 0, r
        assert r["tma"] and r["tma_loads"] >= 3, f"A, B and the scale column not TMA-loaded: {r['config']}"
        assert r["setmaxnreg"], f"no register reallocation between partitions: {r['config']}"


def _rows_for(rows, layout):
    return [r for r in rows if r["config"].startswith(f"gluon {layout} ") and "N=4096 K=7168" in r["config"]
            and "loads-only" not in r["config"]]


@pytest.mark.parametrize("layout", ["masked", "contiguous", "psum", "dense"])
def test_n4096_k7168_wait1_tma_setmaxnreg(rows, layout):
    picked = _rows_for(rows, layout)
    assert picked, f"no {layout} N=4096 K=7168 case"
    for r in picked:
        assert r["mma"] == "wgmma e4m3", r
        assert 1 in r["wgmma_wait"], f"{r['config']}: wgmma.wait_group pendings {r['wgmma_wait']}, want 1"
        assert r["tma_loads"] >= 3, r
        incs = [int(s.split()[1]) for s in r["setmaxnreg"] if s.startswith("inc")]
        decs = [int(s.split()[1]) for s in r["setmaxnreg"] if s.startswith("dec")]
        assert incs and decs and max(incs) >= 232 and min(decs) <= 40, r["setmaxnreg"]
        if "+c FP32" not in r["config"]:
            assert r["tma_stores"] >= 1, f"{r['config']}: no TMA-store epilogue"


def test_promotion_is_one_ffma_per_accumulator(rows):
    """128x128 tile, two consumer warpgroups: 64 accumulators per thread, so at least 64 FFMAs per promoted
    block (twice: in the loop and after it); the loads-only variant has none of them and no MMA."""
    for r in rows:
        if "loads-only" in r["config"]:
            assert r["mma"] == "-" and r["wgmma_wait"] == [], r
        elif r["config"].startswith("gluon") and "wgrad" not in r["config"]:
            assert r["ffma"] >= 128, r
