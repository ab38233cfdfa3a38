"""Combine formats: FP16 payloads, FP8 (1x128) and LogFMT-10 combine (issue "combine in FP16 and fewer bits").

- the torch codecs (:mod:`moe_ep.kernels.logfmt`): error bounds, zeros, signs, NaN/inf handling;
- ``moe_ep.Buffer`` on both backends, 2 and 4 ranks (processes): normal combine (BF16 / FP16 / FP8, with bias and
  weights) and low-latency combine (BF16 / FP16 x native / FP8 / LogFMT, after FP8 and FP16 dispatches),
  bitwise against :mod:`moe_ep.testing.refs` (the same encode/decode math in torch);
- NaN/inf positions through the kernels; dtype mismatches are ValueErrors;
- sm90 compilation of the new kernel configurations (hardware e4m3 cvt in the FP8 send, no FMA contraction).
"""

from __future__ import annotations

import pytest
import torch

from moe_ep.backends.symm import SymmBackend
from moe_ep.kernels.logfmt import (FMT_BF16, FMT_FP8, FMT_FP16, FMT_LOGFMT, decode_rows, encode_rows, logfmt_decode,
                                   logfmt_encode, row_bytes)
from moe_ep.testing import assert_bitwise_equal, launch
from moe_ep.testing.inputs import make_all_inputs
from moe_ep.testing.refs import ref_combine, ref_dispatch, ref_low_latency_combine, ref_low_latency_dispatch
from moe_ep.testing.sm90 import compile_in_subprocess


# ---------------------------------------------------------------------- codecs
def test_logfmt_codec_error_zeros_signs():
    g = torch.Generator().manual_seed(0)
    y = torch.randn(16, 256, generator=g) * torch.logspace(-3, 3, 16)[:, None]
    y[0, :64] = 0.0  # an all-zero group
    y[1, 5] = 0.0
    y[2, 64:128] = 3.0  # a constant group
    low, high, lo, step = logfmt_encode(y)
    d = logfmt_decode(low, high, lo, step)
    assert torch.equal(d[0, :64], torch.zeros(64)) and d[1, 5] == 0
    assert torch.equal(d[2, 64:128], torch.full((64,), 3.0))
    assert bool(((d < 0) == (y < 0))[y != 0].all())
    # every value within half a code step (in log2, bit-pattern units) of the original, or flushed below the floor
    rel = ((d - y).abs() / y.abs().clamp(min=1e-30))[y != 0]
    assert float(rel.max()) < 0.012, float(rel.max())
    assert row_bytes(FMT_LOGFMT, 256) == 256 * 11 // 8 and row_bytes(FMT_FP8, 256) == 256 + 8


@pytest.mark.parametrize("fmt", [FMT_FP8, FMT_LOGFMT])
def test_codec_nan_inf_poison_their_group(fmt):
    y = torch.randn(3, 256)
    y[0, 3] = float("nan")
    y[1, 200] = float("inf")
    d = decode_rows(encode_rows(y, fmt), fmt, 256)
    gs = 128 if fmt == FMT_FP8 else 64
    bad = torch.zeros(3, 256, dtype=torch.bool)
    bad[0, :gs] = True
    bad[1, 200 // gs * gs:(200 // gs + 1) * gs] = True
    assert_bitwise_equal(d.isnan(), bad, "NaN positions")


def test_codec_16bit_is_exact():
    y = torch.randn(4, 64).to(torch.float16)
    assert torch.equal(decode_rows(encode_rows(y, FMT_FP16), FMT_FP16, 64), y.float())
    yb = torch.randn(4, 64).to(torch.bfloat16)
    assert torch.equal(decode_rows(encode_rows(yb, FMT_BF16), FMT_BF16, 64), yb.float())


# ---------------------------------------------------------------------- Buffer, both backends
def _round_trip(rank, world, backend, seed, n, hidden, E, k, T):
    import moe_ep

    inputs = make_all_inputs(world, n, hidden, E, k, seed, "random")
    me = inputs[rank]
    xs, idxs, ws = [i.x for i in inputs], [i.topk_idx for i in inputs], [i.topk_weights for i in inputs]
    kw = {}
    if backend == "symm":
        kw = dict(num_nvl_bytes=SymmBackend.get_normal_size_hint(T, hidden, k, world),
                  num_rdma_bytes=SymmBackend.get_low_latency_size_hint(T, hidden, world, E, k))
    buf = moe_ep.Buffer(None, low_latency_mode=True, backend=backend, timeout_s=30, **kw)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(me.topk_idx, E)
    lay = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    fp8 = torch.float8_e4m3fn
    # normal: FP16 dispatch payload, then combine in every format (bias of x's dtype)
    for dt, cdt in ((torch.float16, None), (torch.bfloat16, fp8), (torch.float16, fp8), (torch.bfloat16, None)):
        x16 = [x.to(dt) for x in xs]
        recv_x, r_idx, r_w, _, handle, _ = buf.dispatch(x16[rank], topk_idx=me.topk_idx, topk_weights=me.topk_weights,
                                                        **lay)
        ex_x = ref_dispatch(rank, x16, idxs, ws, E)[0]
        assert recv_x.dtype == dt
        assert_bitwise_equal(recv_x, ex_x.to(dt), f"{dt} recv_x")
        ys = [(ref_dispatch(r, x16, idxs, ws, E)[0].float() * (r + 1.5)).to(dt) for r in range(world)]
        bias = (torch.randn(me.x.shape, generator=torch.Generator().manual_seed(rank)) * 0.1).to(dt)
        out, cw, _ = buf.combine(ys[rank], handle, topk_weights=r_w, bias=bias, combine_dtype=cdt)
        fmt = FMT_FP8 if cdt == fp8 else None
        recv_ws = [ref_dispatch(r, x16, idxs, ws, E)[3] for r in range(world)]
        ex, ex_w = ref_combine(rank, ys, idxs, E, recv_ws, bias=(bias,), fmt=fmt)
        assert out.dtype == dt
        assert_bitwise_equal(out, ex, f"normal combine {dt} {cdt}")
        assert_bitwise_equal(cw, ex_w, "combined weights")
    # low-latency: dispatch FP8 or FP16, combine in every format with either 16-bit x dtype
    for use_fp8, dt, cfg in ((True, torch.bfloat16, dict(use_logfmt=True)), (False, torch.float16, {}),
                             (True, torch.float16, dict(use_logfmt=True)), (True, torch.bfloat16, dict(combine_dtype=fp8)),
                             (False, torch.float16, dict(combine_dtype=fp8))):
        xd = [x.to(torch.float16) for x in xs] if not use_fp8 else xs
        recv, count, h, _, _ = buf.low_latency_dispatch(xd[rank], me.topk_idx, T, E, use_fp8=use_fp8)
        if not use_fp8:
            assert recv.dtype == torch.float16
            ex_rx, _, ex_c, _ = ref_low_latency_dispatch(rank, xd, idxs, T, E, use_fp8=False)
            for e in range(E // world):
                assert_bitwise_equal(recv[e, :int(ex_c[e])], ex_rx[e, :int(ex_c[e])].to(torch.float16), "ll recv fp16")
        g = torch.Generator().manual_seed(7)
        ys = []
        for r in range(world):
            ref = ref_low_latency_dispatch(r, xs, idxs, T, E, use_fp8=False)[0].float()
            ys.append((ref * (r + 1) * torch.randn(ref.shape, generator=g).exp()).to(dt))
        out = torch.full((me.x.shape[0], hidden), float("nan"), dtype=dt)
        comb, _, _ = buf.low_latency_combine(ys[rank], me.topk_idx, me.topk_weights, h, out=out, **cfg)
        fmt = FMT_LOGFMT if cfg.get("use_logfmt") else FMT_FP8 if cfg.get("combine_dtype") == fp8 else None
        assert comb.dtype == dt and comb.data_ptr() == out.data_ptr()
        assert_bitwise_equal(comb, ref_low_latency_combine(rank, ys, idxs, ws, T, E, fmt=fmt), f"ll combine {cfg} {dt}")
    # mismatched dtypes are clear errors (on every rank, before any payload moves)
    errs = {}
    for name, fn in {
        "out": lambda: buf.low_latency_combine(ys[rank], me.topk_idx, me.topk_weights, h,
                                               out=torch.empty(me.x.shape[0], hidden, dtype=torch.bfloat16)),
        "both": lambda: buf.low_latency_combine(ys[rank], me.topk_idx, me.topk_weights, h, use_logfmt=True,
                                                combine_dtype=fp8),
        "dtype": lambda: buf.low_latency_combine(ys[rank], me.topk_idx, me.topk_weights, h, combine_dtype=torch.int8),
    }.items():
        try:
            fn()
        except (ValueError, TypeError) as exc:
            errs[name] = str(exc)
    x16 = xs[rank].to(torch.float16)
    _, _, r_w, _, handle, _ = buf.dispatch(x16, topk_idx=me.topk_idx, topk_weights=me.topk_weights, **lay)
    y16 = (ref_dispatch(rank, [x.to(torch.float16) for x in xs], idxs, ws, E)[0]).to(torch.float16)
    try:
        buf.combine(y16, handle, bias=torch.zeros(me.x.shape, dtype=torch.bfloat16))
    except ValueError as exc:
        errs["bias"] = str(exc)
    buf.combine(y16, handle)  # still in step after the refused calls
    return errs


@pytest.mark.parametrize("backend", ["torch", "symm"])
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 ranks: -m slow (CI runs it)
def test_buffer_combine_formats(backend, world):
    T = 6
    res = launch(_round_trip, world, backend, 11 + world, [5, 0, 6, 3][:world], 256, 2 * world, 3, T, timeout_s=300)
    for errs in res:
        assert "dtype of x" in errs["bias"] and "dtype of x" in errs["out"], errs
        assert "two different formats" in errs["both"] and "combine_dtype" in errs["dtype"], errs


# ---------------------------------------------------------------------- NaN / inf through the kernels
@pytest.mark.parametrize("transport", ["symm", "nvshmem"])
@pytest.mark.parametrize("fmt", [FMT_BF16, FMT_FP16, FMT_FP8, FMT_LOGFMT])
def test_virtual_ll_nan_inf_positions(fmt, transport):
    from moe_ep.backends.nvshmem import nvshmem_ll_size_hint, virtual_nvshmem_paths
    from moe_ep.backends.symm_ll import SymmLowLatency, virtual_low_latency_step
    from moe_ep.symm import create_virtual_symm_buffers

    world, n, H, E, K, T = 2, 3, 256, 4, 2, 3
    dt = torch.float16 if fmt == FMT_FP16 else torch.bfloat16
    inputs = make_all_inputs(world, n, H, E, K, 5, "random")
    xs, idxs, ws = [i.x for i in inputs], [i.topk_idx for i in inputs], [i.topk_weights for i in inputs]
    if transport == "symm":
        bufs = create_virtual_symm_buffers(world, SymmLowLatency.size_hint(T, H, world, E, K),
                                           SymmLowLatency.num_signals(world), device=torch.device("cpu"), timeout_s=10)
        paths = [SymmLowLatency(b, owner=1) for b in bufs]
    else:  # encoded rows staged, then put (emulated NVSHMEM) into the source's combine slots
        paths = virtual_nvshmem_paths(world, nvshmem_ll_size_hint(T, H, world, E, K), owner=1, timeout_s=10)
    ys = {}

    def expert_fn(r, res):
        y = ref_low_latency_dispatch(r, xs, idxs, T, E, use_fp8=False)[0].to(dt)
        y[0, 0, 70] = float("nan")  # first row of local expert 0: one NaN, one inf
        y[0, 0, 200] = float("inf")
        ys[r] = y
        return y

    _, comb = virtual_low_latency_step(paths, xs, idxs, ws, T, E, use_fp8=False, expert_fn=expert_fn, fmt=fmt)
    for r in range(world):
        ex = ref_low_latency_combine(r, [ys[i] for i in range(world)], idxs, ws, T, E, fmt=fmt)
        assert_bitwise_equal(comb[r].isnan(), ex.isnan(), f"rank {r} NaN positions")
        assert_bitwise_equal(comb[r].isinf(), ex.isinf(), f"rank {r} inf positions")
        assert_bitwise_equal(comb[r].nan_to_num(0, 0, 0), ex.nan_to_num(0, 0, 0), f"rank {r} values")
    if fmt in (FMT_FP8, FMT_LOGFMT):  # the whole channel group is poisoned (documented), not only channel 70
        gs = 128 if fmt == FMT_FP8 else 64
        any_nan = torch.stack([c.isnan() for c in comb]).reshape(-1, H).any(0)
        if bool(any_nan.any()):
            assert bool(any_nan[70 // gs * gs:(70 // gs + 1) * gs].all())


# ---------------------------------------------------------------------- sm90 compilation
COMPILE_SCRIPT = r'''
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moe_ep.kernels import low_latency as ll, intranode as im

H, K = 7168, 8
PTRS = {"x_ptr": "*i16", "topk_ptr": "*i64", "buffer_ptrs": "*i64", "signal_ptrs": "*i64", "status_ptr": "*i32",
        "buf_ptr": "*u8", "slot_row_ptr": "*i32", "recv_tokens_ptr": "*i32", "stamp_ptr": "*i32", "w_ptr": "*fp32",
        "out_ptr": "*i16",
        "wait_stats_ptr": "*i64", "acc_ptr": "*fp32", "wout_ptr": "*fp32", "pos_ptr": "*i32"}
I64 = ("timeout_ns", "comb_off", "stride_xl", "stride_xr", "area_off")
DIV16 = ("comb_off", "stride_xl", "stride_xr", "T", "W")


def variant(mod, name, fp_fusion=True, **const):
    kern = getattr(mod, name)
    names = kern.arg_names
    for prm in kern.params:  # constexprs with a default (TRANSPORT, CH, ...) take it
        if prm.is_constexpr and prm.has_default and prm.name not in const:
            const[prm.name] = prm.default
    sig = {n: "constexpr" if n in const else PTRS.get(n, "i64" if n in I64 else "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if sig[n] != "constexpr" and (sig[n].startswith("*") or n in DIV16)}
    ck = triton.compile(ASTSource(kern, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": 4, "enable_fp_fusion": fp_fusion})
    ptx = ck.asm["ptx"]
    ops = {"spills": int(getattr(ck.metadata, "n_spills", 0) or 0) if hasattr(ck, "metadata") else 0}
    for m in re.findall(r"\b(cvt\.rn\.satfinite\.e4m3x2\.f32|div\.rn\.f32|fma\.rn\.f32|cvt\.rn\.f16\.f32"
                        r"|cvt\.rn\.f16x2\.f32|st\.global\.v4\.b32|ld\.global\.v4\.b32)", ptx):
        ops[m] = ops.get(m, 0) + 1
    ops["local"] = len(re.findall(r"\b(?:ld|st)\.local", ptx))
    return ops


CS = dict(H=H, K=K, KP=8, BLOCK_T=2, HC=1024, COMB_BUSY=0, COMB_FULL=16, COMB_SEND_CNT=32)
CR = dict(H=H, K=K, BLOCK_T=2, HC=1024, COMB_BUSY=0, COMB_FULL=16, COMB_RECV_CNT=40, HAS_WAIT_STATS=False)
NR = dict(H=H, K=K, KP=8, HAS_W=True, FULL=0, BUSY=8, RECV_CNT=49, BLOCK_T=16, HC=256)
CASES = {
    "ll_send_fp8_native": lambda: variant(ll, "_ll_combine_send_fmt_kernel", FMT=2, IN_F16=False, NATIVE_FP8=True, **CS),
    "ll_send_fp8_f16in": lambda: variant(ll, "_ll_combine_send_fmt_kernel", FMT=2, IN_F16=True, NATIVE_FP8=True, **CS),
    "ll_send_logfmt": lambda: variant(ll, "_ll_combine_send_fmt_kernel", FMT=3, IN_F16=False, NATIVE_FP8=False, **CS),
    "ll_recv_fp16": lambda: variant(ll, "_ll_combine_recv_fmt_kernel", fp_fusion=False, FMT=1, OUT_F16=True, **CR),
    "ll_recv_fp8": lambda: variant(ll, "_ll_combine_recv_fmt_kernel", fp_fusion=False, FMT=2, OUT_F16=False, **CR),
    "ll_recv_logfmt": lambda: variant(ll, "_ll_combine_recv_fmt_kernel", fp_fusion=False, FMT=3, OUT_F16=False, **CR),
    "normal_recv_fp8": lambda: variant(im, "_combine_recv_fmt_kernel", fp_fusion=False, FMT=2, OUT_F16=False, **NR),
    "normal_recv_fp16": lambda: variant(im, "_combine_recv_fmt_kernel", fp_fusion=False, FMT=1, OUT_F16=True, **NR),
}
print(json.dumps({k: CASES[k]() for k in json.loads(sys.argv[1])}))
'''

COMPILE_CASES = ["ll_send_fp8_native", "ll_send_fp8_f16in", "ll_send_logfmt", "ll_recv_fp16", "ll_recv_fp8",
                 "ll_recv_logfmt", "normal_recv_fp8", "normal_recv_fp16"]


@pytest.fixture(scope="module")
def compiled():
    return compile_in_subprocess(COMPILE_SCRIPT, COMPILE_CASES, "the combine-format kernels")


@pytest.mark.slow  # an sm90 ahead-of-time compile (the sm90 report covers every shipped configuration; CI runs -m slow)
@pytest.mark.parametrize("case", COMPILE_CASES)
def test_compiles_for_sm90(compiled, case):
    ops = compiled[case]
    assert ops["local"] == 0 and ops["spills"] == 0, f"register spills: {ops}"
    if case.startswith("ll_send_fp8"):
        assert ops.get("cvt.rn.satfinite.e4m3x2.f32", 0) > 0, f"hardware e4m3 cast expected: {ops}"
        assert ops.get("div.rn.f32", 0) > 0, ops
    if "recv" in case:
        assert ops.get("fma.rn.f32", 0) == 0, f"w * y + acc must not contract to an FMA: {ops}"
    if case.endswith("fp16"):
        assert ops.get("cvt.rn.f16.f32", 0) + ops.get("cvt.rn.f16x2.f32", 0) > 0, ops
