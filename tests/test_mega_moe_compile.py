"""The mega-MoE kernel compiles for sm90 without a GPU, every phase and the fused one, as the launcher
specialises it (``sm90_cases``: DeepSeek-V3 on EP8, 2048 tokens per rank, and decode at 128): FP8 wgmma in the
expert phase with 64-row items, the hardware e4m3 cast for the intermediate, 16-byte row copies, signal waits as
system-scope acquire loads and signals as system-scope release atomics, and no spills (the same rows are in
``perf/sm90_report.py``)."""

from __future__ import annotations

import pytest

from moe_ep.testing.sm90 import REPORT_PROLOGUE, compile_in_subprocess

# sm90 ahead-of-time compiles of every configuration: minutes on 2 cores (`bash scripts/test.sh -m slow`; CI
# runs them)
pytestmark = pytest.mark.slow

SCRIPT = REPORT_PROLOGUE + r'''
from moe_ep.gemm.mega_moe import sm90_cases
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton
out = []
for c in sm90_cases():
    opts = {"num_warps": c["num_warps"], "num_stages": c["num_stages"], **c["options"]}
    ptx = triton.compile(ASTSource(c["kernel"], c["signature"], c["constexprs"], c["attrs"]),
                         target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]
    row = report.compile_report(c["kernel"], c["signature"], c["constexprs"], c["num_warps"], c["num_stages"],
                                c["attrs"], c["options"])
    row.update(phase=c["constexprs"]["PHASE"], block_m=c["constexprs"]["BLOCK_M"], config=c["config"],
               wgmma=sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.f32\.e4m3\.e4m3", ptx))),
               cvt_e4m3=sum("cvt.rn.satfinite.e4m3x2.f32" in l for l in ptx.splitlines()),
               acquire=sum(bool(re.search(r"\b(ld|atom)\.global\.sys\.acquire", l)) for l in ptx.splitlines()),
               release=sum(bool(re.search(r"\b(atom|red|st)\.global\.sys\.release", l)) for l in ptx.splitlines()),
               globaltimer="%globaltimer" in ptx)
    out.append(row)
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def cases():
    return compile_in_subprocess(SCRIPT, [], "the mega-MoE kernel", timeout_s=600)


@pytest.fixture(scope="module")
def rows(cases):
    """The 64-row-item cases (2048 tokens per rank) by phase."""
    return {r["phase"]: r for r in cases if r["block_m"] == 64}


def test_every_phase_compiles_with_the_expected_instructions(rows):
    assert sorted(rows) == [0, 1, 2, 3]
    for phase in (0, 2):
        r = rows[phase]
        assert r["mma"] == "wgmma e4m3" and r["wgmma"], r
        assert r["cvt_e4m3"] > 0, "the intermediate must use the hardware e4m3 cast on sm90"
    for phase in (1, 3):
        assert rows[phase]["mma"] == "-", rows[phase]
    for phase in (0, 2, 3):  # they wait: bounded (clock) acquire spins
        assert rows[phase]["acquire"] > 0 and rows[phase]["globaltimer"], rows[phase]
    for phase in (0, 1, 2):  # they publish
        assert rows[phase]["release"] > 0, rows[phase]


def test_no_spills_and_vector_copies(cases):
    """Every shipped configuration (decode included) fits the register file without spilling, one program per SM at
    least; the row pulls and the combine-slot stores are 16-byte vectors (row addresses said to be aligned)."""
    for r in cases:
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
        assert r["resident_blocks"] >= 1, r
        if r["phase"] in (0, 2, 3):
            assert r["ld_bytes"] == 16 and r["st_bytes"] == 16, r
