"""The quant kernels compile for sm90 (PTX + ptxas) on a machine without a GPU.

The interpreter accepts things compiled Triton refuses (e.g. globals annotated ``x: tl.constexpr = ..``),
so every kernel variant is also compiled ahead of time for an H100 target with the installed Triton's
own ptxas, in a subprocess without ``TRITON_INTERPRET``. The PTX is checked for what performance
needs: 16-byte vector loads (cp.async copies when the persistent loop is pipelined) and FP8 stores, the
hardware e4m3 cast, IEEE division per group only (none per element), and the PDL instructions only when
asked for.
"""

from __future__ import annotations


import pytest

from moe_ep.testing.sm90 import compile_in_subprocess

SCRIPT = r'''
import json, os, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moe_ep.kernels.quant import _per_token_group_quant_kernel
from moe_ep.kernels.silu_quant import _silu_and_mul_quant_kernel

KERNELS = {"quant": _per_token_group_quant_kernel, "silu": _silu_and_mul_quant_kernel}


def compile_variant(op, dtype, block_m, gpp, round_scale, ue8m0, mask, native, pdl, column_major, transpose,
                    stages):
    kern = KERNELS[op]
    names = kern.arg_names
    sig = {n: "i32" for n in names}
    sig.update({"x_ptr": "*" + dtype, "q_ptr": "*u8", "s_ptr": "*i32" if ue8m0 else "*fp32",
                "masked_m_ptr": "*i32" if mask else "*" + dtype, "stride_xl": "i64"})
    const = {"GROUP_SIZE": 128, "BLOCK_M": block_m, "GROUPS_PER_PROG": gpp, "ROUND_SCALE": round_scale or ue8m0,
             "USE_UE8M0": ue8m0, "HAS_MASK": mask, "NATIVE_FP8": native, "USE_PDL": pdl, "NUM_STAGES": stages}
    # What a launch specialises: unit strides become constexpr 1, the rest (K, M, ...) divisible by 16.
    unit = ["stride_qt" if transpose else "stride_qk", "stride_st" if column_major else "stride_sg"]
    for n in unit:
        const[n] = 1
    for n in const:
        sig[n] = "constexpr"
    div16 = [n for n in names if sig[n] != "constexpr" and n not in ("G", "W")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    try:
        src = ASTSource(kern, sig, const, attrs)
    except TypeError as exc:  # a Triton whose ASTSource API differs: not a kernel problem
        return {"skip": str(exc)}
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": 8 if block_m * gpp >= 64 else 4, "num_stages": stages})
    ptx = ck.asm["ptx"]
    ops = {}
    pattern = (r"\b((?:ld|st)\.global(?:\.v\d)?\.b\d+|cvt\.rn\.satfinite\.e4m3x2\.f32|div\.rn\.f32"
               r"|griddepcontrol\.\w+|cp\.async\.c[ag]\.shared\.global)")
    for m in re.findall(pattern, ptx):
        ops[m] = ops.get(m, 0) + 1
    return ops


cases = json.loads(sys.argv[1])
print(json.dumps([compile_variant(*c) for c in cases]))
'''

# (op, dtype, BLOCK_M, GROUPS_PER_PROG, round_scale, ue8m0, masked, native cast, PDL, column-major, transpose_out,
#  NUM_STAGES)
CASES = [
    ("quant", "bf16", 16, 4, False, False, False, True, False, True, False, 3),
    ("quant", "bf16", 16, 4, True, True, True, True, True, True, False, 3),
    ("quant", "fp32", 4, 1, False, False, False, False, False, False, False, 1),
    ("quant", "bf16", 64, 1, False, False, False, True, False, True, True, 3),
    ("quant", "bf16", 16, 1, False, False, False, True, False, True, False, 1),
    ("silu", "bf16", 16, 4, False, False, True, True, True, True, False, 3),
    ("silu", "fp16", 32, 4, True, True, False, True, False, True, True, 3),
]


@pytest.fixture(scope="module")
def compiled():
    results = compile_in_subprocess(SCRIPT, CASES, "the quant kernels")
    return dict(zip(range(len(CASES)), results, strict=True))


@pytest.mark.parametrize("index", range(len(CASES)),
                         ids=[f"{c[0]}-{c[1]}-bm{c[2]}-g{c[3]}-s{c[11]}" for c in CASES])
def test_compiles_for_sm90(compiled, index):
    _op, _dtype, _bm, _gpp, round_scale, ue8m0, _mask, native, pdl, _col, _transpose, stages = CASES[index]
    ops = compiled[index]
    if stages > 1:
        # pipelined: the tile loads are cp.async copies (the next tiles in flight while one is quantized)
        assert ops.get("cp.async.cg.shared.global", 0) + ops.get("cp.async.ca.shared.global", 0) > 0, ops
    else:
        assert ops.get("ld.global.v4.b32", 0) + ops.get("ld.global.v2.b32", 0) > 0, f"no vector loads: {ops}"
    assert ops.get("st.global.b8", 0) == 0, f"FP8 stored byte by byte: {ops}"
    if _bm * _gpp >= 16:
        assert ops.get("st.global.v4.b32", 0) > 0, f"FP8 stores not 16-byte vectors: {ops}"
    assert (ops.get("cvt.rn.satfinite.e4m3x2.f32", 0) > 0) == native, ops
    assert (ops.get("griddepcontrol.wait", 0) > 0) == pdl, ops
    assert (ops.get("griddepcontrol.launch_dependents", 0) > 0) == pdl, ops
    # IEEE divisions: per group (the scale and its reciprocal), none per element (32 per thread in the
    # 16 x 4 x 128 tiles of 8 warps if x / scale were divided element by element). A transposed tile's
    # threads hold up to one group per element (the layout that coalesces the [K, T] stores): no bound there.
    if not _transpose:
        assert ops.get("div.rn.f32", 0) <= 4, f"x / scale divided per element: {ops}"
    if not (round_scale or ue8m0):
        assert ops.get("div.rn.f32", 0) > 0, f"the scale must be IEEE amax / 448: {ops}"
