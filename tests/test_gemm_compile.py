"""The GEMM kernel compiles for sm90 without a GPU: wgmma on FP8 operands (BF16 ones for the BF16 GEMMs) for
every shipped tile (prefill by m_indices and by psum, decode, dense with and without ``c``), no spills,
16-byte ``cp.async`` operand loads, and with PDL the weight prefetch before
``griddepcontrol.wait`` with no other global access ahead of it (activations, scales, ``m_indices`` and
``masked_m`` are the previous kernel's outputs)."""

from __future__ import annotations

import pytest

from moe_ep.testing.sm90 import REPORT_PROLOGUE, compile_in_subprocess

# sm90 ahead-of-time compiles of every configuration: minutes on 2 cores (`bash scripts/test.sh -m slow`; CI
# runs them)
pytestmark = pytest.mark.slow

SCRIPT = REPORT_PROLOGUE + r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moe_ep.gemm import sm90_cases
out = []
for c in sm90_cases():
    row = report.compile_report(c["kernel"], c["signature"], c["constexprs"], c["num_warps"], c["num_stages"],
                                c["attrs"])
    ck = triton.compile(ASTSource(c["kernel"], c["signature"], c["constexprs"], c["attrs"]),
                        target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": c["num_warps"], "num_stages": c["num_stages"]})
    lines = ck.asm["ptx"].splitlines()
    wait = next((i for i, l in enumerate(lines) if "griddepcontrol.wait" in l), None)
    head = lines[:wait] if wait is not None else []
    glob = r"\b((ld|st|atom|red)\.global|cp\.async|prefetch)"
    row.update(config=c["config"],
               before_wait=sorted({l.split()[0] for l in head if re.search(glob, l)}),
               prefetches=sum("prefetch.global.L2" in l for l in head),
               cp_async_16=sum(bool(re.search(r"cp\.async\.cg\.shared\.global .*, 0x10", l)) for l in lines))
    out.append(row)
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def rows():
    return compile_in_subprocess(SCRIPT, [], "the grouped GEMM")


def test_every_tile_is_wgmma_fp8_without_spills(rows):
    configs = [r["config"] for r in rows]
    assert any(c.startswith("contiguous") for c in configs) and any("swapAB" in c for c in configs)
    for kind in ("psum", "dense", "BF16 contiguous", "BF16 psum", "BF16 masked", "BF16 dense"):
        assert any(c.startswith(kind) for c in configs), f"no {kind} row"
    assert any(c.startswith("dense") and c.endswith("+c FP32") for c in configs)
    for r in rows:
        assert r["mma"] == ("wgmma bf16" if r["config"].startswith("BF16") else "wgmma e4m3"), r
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
        assert r["regs"] <= 255, r
        assert r["cp_async_16"] > 0, f"operands not loaded with 16-byte cp.async: {r['config']}"


def test_pdl_prefetches_weights_before_wait_and_nothing_else(rows):
    for r in rows:
        if "PDL" in r["config"]:
            assert r["pdl"] == "wait+launch", r
            assert r["prefetches"] > 0, f"no weight prefetch before griddepcontrol.wait: {r['config']}"
            assert r["before_wait"] == ["prefetch.global.L2"], \
                f"{r['config']}: global accesses before griddepcontrol.wait: {r['before_wait']}"
        else:
            assert r["pdl"] == "-" and r["prefetches"] == 0, r
