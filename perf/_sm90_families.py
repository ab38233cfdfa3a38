"""The per-kernel-family cases of ``perf/sm90_report.py``: the configurations each launcher picks for
DeepSeek-V3 shapes (quant and SiLU-and-mul quant, the dispatch layout, the normal-mode intranode kernels, the
low-latency kernels and their NVSHMEM-transport variants), built with :func:`_sm90_case._case`;
:func:`_all_cases` adds the cases the host modules build for their kernels (:func:`_sm90_case._host_cases`: the
expand kernels, the grouped GEMM, mega-MoE).

Imported by the report after its ``TRITON_INTERPRET`` check; not a script.
"""

from __future__ import annotations

import dataclasses
import sys

import triton
from _sm90_case import _RANK, _SYMM_PTRS, _TIMEOUT_NS, H100, TARGET_CC, Case, _case, _host_cases


def _quant_cases() -> list[Case]:
    """Per-token-group quant and SiLU-and-mul quant: BF16 in, column-major TMA-aligned scales (DeepGEMM's
    layout), the configuration ``choose_config`` picks on an H100 (tile ``BLOCK_M x GPP`` groups, warps, the
    persistent loop's stages ``S`` and programs ``P``)."""
    import torch

    from moe_ep.fp8 import tma_aligned_size
    from moe_ep.kernels import quant
    from moe_ep.kernels.silu_quant import _silu_and_mul_quant_kernel

    real_num_sms = quant._num_sms
    quant._num_sms = lambda index: H100["num_sms"]  # choose_config asks the device; there is none here
    try:
        cases = []
        # (op, L, T, K): DeepSeek-V3 hidden 7168 and 2048 at prefill (4096 tokens) and decode (128 tokens);
        # silu: the expert intermediate N=2048 (input 2N), contiguous prefill and masked decode (EP8: 32
        # local experts x 1024 rows).
        shapes = [("quant", 1, m, h, False) for h in (7168, 2048) for m in (4096, 128)]
        shapes += [("silu_quant", 1, 4096, 2048, False), ("silu_quant", 32, 1024, 2048, True)]
        for op, L, T, K, masked in shapes:
            G = K // 128
            for ue8m0 in (False, True):
                W = (G + 3) // 4 if ue8m0 else 0
                cfg = quant.choose_config(L, T, G, 128, ue8m0, False, torch.device("cuda", 0), interpret=False,
                                          inputs=1 if op == "quant" else 2,
                                          tiles_for=lambda bm, gp: quant.num_tiles(
                                              L, T, G, bm, gp, (0, 1, tma_aligned_size(T)), False))
                block_m, gpp, warps = cfg.block_m, cfg.gpp, cfg.num_warps
                for pdl in (False, True):
                    kern = quant._per_token_group_quant_kernel if op == "quant" else _silu_and_mul_quant_kernel
                    x_cols = K if op == "quant" else 2 * K
                    tm = tma_aligned_size(T)
                    cols = (W if ue8m0 else G)
                    label = (f"{'H' if op == 'quant' else 'N'}={K} {'L=%d ' % L if L > 1 else ''}M={T} "
                             f"{'masked ' if masked else ''}BM={block_m} GPP={gpp} S={cfg.num_stages} "
                             f"P={cfg.programs}{' UE8M0' if ue8m0 else ''}"
                             f"{' PDL' if pdl else ''}")
                    cases.append(_case(
                        op, label, kern,
                        {"x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*i32" if ue8m0 else "*fp32",
                         "masked_m_ptr": "*i32" if masked else "*bf16"},
                        {"L": L, "T": T, "G": G, "W": W, "stride_xl": T * x_cols, "stride_xt": x_cols,
                         "stride_ql": T * K, "stride_qt": K, "stride_qk": 1,
                         "stride_sl": cols * tm, "stride_st": 1, "stride_sg": tm},
                        {"GROUP_SIZE": 128, "BLOCK_M": block_m, "GROUPS_PER_PROG": gpp, "ROUND_SCALE": ue8m0,
                         "USE_UE8M0": ue8m0, "HAS_MASK": masked, "NATIVE_FP8": True, "USE_PDL": pdl,
                         "NUM_STAGES": cfg.num_stages},
                        num_warps=warps))
        # The bench-only variant (x * (1 / scale), reciprocal_multiply_quant_fp8) of the prefill quant: its
        # instruction mix next to the exact quotient's.
        exact = next(c for c in cases if c.name == "quant" and c.config.startswith("H=7168 M=4096")
                     and "UE8M0" not in c.config and "PDL" not in c.config)
        cases.append(dataclasses.replace(exact, config=exact.config + " RECIP_MULTIPLY",
                                         constexprs={**exact.constexprs, "HAS_MASK": quant.RECIP_MULTIPLY}))
        return cases
    finally:
        quant._num_sms = real_num_sms


def _layout_cases() -> list[Case]:
    """The dispatch layout kernel (``dispatch_layout`` on a GPU: BLOCK_T=32, 4 warps)."""
    from moe_ep.kernels.layout import _layout_kernel

    N, E, K, R = 4096, 256, 8, 8
    return [_case("layout", f"N={N} E={E} top-{K} EP{R}", _layout_kernel,
                  {"topk_ptr": "*i64", "in_rank_ptr": "*i8", "per_rank_ptr": "*i32", "per_expert_ptr": "*i32",
                   "bad_ptr": "*i32"},
                  {"N": N, "E": E, "L": E // R},
                  {"K": K, "KP": K, "R": R, "RP": R, "EB": triton.next_power_of_2(E + 1), "BLOCK_T": 32})]


def _intranode_cases() -> list[Case]:
    """Normal-mode (prefill) kernels, launched as ``SymmNormal`` does on a GPU: BLOCK_T=16, BLOCK_W=256,
    combine HC=256, default 4 warps; DeepSeek-V3 H=7168, top-8, EP8, 4096 tokens per rank."""
    from moe_ep.kernels import intranode as k

    R, N, H, KT = 8, 4096, 7168, 8
    sig = k.signal_layout(R)
    pad16 = lambda w: (w + 15) // 16 * 16  # noqa: E731
    w_disp = pad16((H + 4 * (H // 128)) // 4 + 3 * KT)  # FP8 payload | scales | top-k (int64) | weights
    w_comb = pad16(2 * H // 4 + KT)  # BF16 payload | weights
    nbytes = 2 << 30
    cap = nbytes // (R * 4 * w_disp)  # a copying dispatch and its combine time-share the whole buffer
    cases = []
    for what, words, full, busy, cnt in (("dispatch FP8", w_disp, "DISP_FULL", "DISP_BUSY", "DISP_SEND_CNT"),
                                         ("combine BF16", w_comb, "COMB_FULL", "COMB_BUSY", "COMB_SEND_CNT")):
        cases.append(_case("normal_send", f"{what} H={H} N={N} EP{R} W={words}", k._scatter_send_kernel,
                           {"src_ptr": "*i32", "pos_ptr": "*i32", "counts_ptr": "*i32", "tot_ptr": "*i32", **_SYMM_PTRS},
                           {"rank": _RANK, "N": N, "R": R, "W": words, "block_off": _RANK * cap * words, "cap": cap,
                            "timeout_ns": _TIMEOUT_NS, "ntok": N, **dict.fromkeys(("S1", "S2", "S3", "O1", "O2", "O3"), words)},
                           {"FULL": sig[full], "BUSY": sig[busy], "SEND_CNT": sig[cnt], "BLOCK_T": 16, "BLOCK_W": 256,
                            "CNT": sig["DISP_CNT"] if full == "DISP_FULL" else -1,
                            # as SymmNormal launches them: a copying dispatch's meta words, and both operations wait
                            # on the other's busy words too (the time-shared area)
                            "META": sig["DISP_META"] if full == "DISP_FULL" else -1,
                            "BUSY2": sig["COMB_BUSY" if full == "DISP_FULL" else "DISP_BUSY"], "REF": sig["REFUSED"]}))
    # receive as a view: the same rows written as planes (payload | scales | top-k ids | weights + padding)
    bounds = (H // 4, H // 4 + H // 128, H // 4 + H // 128 + 2 * KT)
    rows = (nbytes // 2 // 4) // w_disp
    planes = k.view_planes(rows, bounds, w_disp)[:3]
    cases.append(_case("normal_send", f"dispatch FP8 view H={H} N={N} EP{R} W={w_disp}", k._scatter_send_kernel,
                       {"src_ptr": "*i32", "pos_ptr": "*i32", "counts_ptr": "*i32", "tot_ptr": "*i32", **_SYMM_PTRS},
                       {"rank": _RANK, "N": N, "R": R, "W": w_disp, "block_off": 0, "cap": cap,
                        "timeout_ns": _TIMEOUT_NS, "ntok": N,
                        **dict(zip(("S1", "S2", "S3"), bounds)), **dict(zip(("O1", "O2", "O3"), planes))},
                       {"FULL": sig["DISP_FULL"], "BUSY": sig["DISP_BUSY"], "SEND_CNT": sig["DISP_SEND_CNT"],
                        "BLOCK_T": 16, "BLOCK_W": 256, "CNT": sig["DISP_CNT"], "VIEW": True, "BUSY2": sig["COMB_BUSY"],
                        "REF": sig["REFUSED"]}))
    cases.append(_case("normal_view_recv", f"EP{R}", k._view_recv_kernel,
                       {"counts_ptr": "*i32", "signal_ptrs": "*i64", "status_ptr": "*i32"},
                       {"rank": _RANK, "R": R, "M": R * N, "timeout_ns": _TIMEOUT_NS},
                       {"FULL": sig["DISP_FULL"], "HELD": sig["DISP_HELD"], "REF": sig["REFUSED"]}, num_warps=1))
    cases.append(_case("normal_release_held", f"EP{R}", k._release_held_kernel,
                       {"signal_ptrs": "*i64", "status_ptr": "*i32"}, {"rank": _RANK, "R": R},
                       {"FULL": sig["DISP_FULL"], "BUSY": sig["DISP_BUSY"], "CNT": sig["DISP_CNT"],
                        "HELD": sig["DISP_HELD"]}, num_warps=1))
    cases.append(_case("normal_recv_counts", f"EP{R}", k._recv_counts_kernel,
                       {"counts_ptr": "*i32", "signal_ptrs": "*i64", "status_ptr": "*i32"},
                       {"rank": _RANK, "timeout_ns": _TIMEOUT_NS}, {"FULL": sig["DISP_FULL"]}))
    cases.append(_case("normal_gather_recv", f"dispatch FP8 H={H} EP{R} W={w_disp}", k._gather_recv_kernel,
                       {"out_ptr": "*i32", "counts_ptr": "*i32", "dst_ptr": "*i32", **_SYMM_PTRS},
                       {"rank": _RANK, "R": R, "W": w_disp, "cap": cap, "area_off": 0, "M": R * N,
                        "timeout_ns": _TIMEOUT_NS},
                       {"FULL": sig["DISP_FULL"], "BUSY": sig["DISP_BUSY"], "RECV_CNT": sig["DISP_RECV_CNT"],
                        "BLOCK_T": 16, "BLOCK_W": 256, "CNT": sig["DISP_CNT"], "REF": sig["REFUSED"]}))
    # a refusing rank's drain (symm_refusal.py: one row block of 16 words, nothing read)
    cases.append(_case("normal_gather_recv", f"refusal drain EP{R}", k._gather_recv_kernel,
                       {"out_ptr": "*i32", "counts_ptr": "*i32", "dst_ptr": "*i32", **_SYMM_PTRS},
                       {"rank": _RANK, "R": R, "W": 16, "cap": 1, "area_off": 0, "M": 0, "timeout_ns": _TIMEOUT_NS},
                       {"FULL": sig["DISP_FULL"], "BUSY": sig["DISP_BUSY"], "RECV_CNT": sig["DISP_RECV_CNT"],
                        "BLOCK_T": 16, "BLOCK_W": 16, "CNT": sig["DISP_CNT"], "DRAIN": True}))
    cases.append(_case("normal_combine_recv", f"BF16 H={H} top-{KT} N={N} EP{R} +weights", k._combine_recv_kernel,
                       {"acc_ptr": "*fp32", "out_ptr": "*i16", "wout_ptr": "*fp32", "pos_ptr": "*i32", **_SYMM_PTRS},
                       {"rank": _RANK, "N": N, "R": R, "W": w_comb, "cap": cap, "area_off": nbytes // 8,
                        "timeout_ns": _TIMEOUT_NS},
                       {"H": H, "K": KT, "KP": KT, "HAS_W": True, "FULL": sig["COMB_FULL"], "BUSY": sig["COMB_BUSY"],
                        "RECV_CNT": sig["COMB_RECV_CNT"], "BLOCK_T": 16, "HC": 256, "REF": sig["REFUSED"]},
                       options={"enable_fp_fusion": False}))
    w_comb8 = pad16(H // 4 + H // 128 + KT)  # FP8 payload | scales | weights
    for what, fmt, words, f16 in (("FP8 combine", 2, w_comb8, False), ("FP16", 1, w_comb, True)):
        cases.append(_case("normal_combine_recv_fmt", f"{what} H={H} top-{KT} N={N} EP{R} +weights",
                           k._combine_recv_fmt_kernel,
                           {"acc_ptr": "*fp32", "out_ptr": "*i16", "wout_ptr": "*fp32", "pos_ptr": "*i32", **_SYMM_PTRS},
                           {"rank": _RANK, "N": N, "R": R, "W": words, "cap": cap, "area_off": nbytes // 8,
                            "timeout_ns": _TIMEOUT_NS},
                           {"H": H, "K": KT, "KP": KT, "HAS_W": True, "FULL": sig["COMB_FULL"],
                            "BUSY": sig["COMB_BUSY"], "RECV_CNT": sig["COMB_RECV_CNT"], "BLOCK_T": 16, "HC": 256,
                            "FMT": fmt, "OUT_F16": f16, "REF": sig["REFUSED"]},
                           options={"enable_fp_fusion": False}))
    return cases


def _low_latency_cases() -> list[Case]:
    """Low-latency (decode) kernels, launched as ``SymmLowLatency`` does on a GPU; DeepSeek-V3 decode:
    128 tokens per rank, H=7168, 256 experts, top-8, EP8; message offsets from the backend's own carving."""
    from moe_ep.backends.symm_ll import _carve, _hdr, combine_recv_columns
    from moe_ep.fp8 import tma_aligned_size
    from moe_ep.kernels import low_latency as k

    R, T, H, E, KT = 8, 128, 7168, 256, 8
    L, G, RT = E // R, H // 128, R * T
    sig = k.signal_layout(R)
    lay = _carve(T, H, R, E, KT)
    slot_base = lay.slot_bytes  # the second double-buffer slot
    offs = {"cnt_off": slot_base + lay.cnt_off, "msg_off": slot_base + lay.msg_off, "sig_off": sig["SLOT_WORDS"]}
    p2 = triton.next_power_of_2
    cases = []
    for fmt in ("FP8", "FP8 UE8M0", "BF16"):
        fp8, ue8m0 = fmt.startswith("FP8"), "UE8M0" in fmt
        gc = max(min(p2(G), 8), 4 if ue8m0 else 1)
        cases.append(_case(
            "ll_dispatch_send", f"{fmt} H={H} T={T} E={E} EP{R}", k._ll_dispatch_send_kernel,
            {"x_ptr": "*bf16" if fp8 else "*i16", "topk_ptr": "*i64", "stamp_ptr": "*i32", **_SYMM_PTRS},
            {"rank": _RANK, "N": T, "T": T, "L": L, "E": E, "R": R, "num_token_progs": T // 2 * 4, "num_splits": 4,
             "timeout_ns": _TIMEOUT_NS,
             **offs},
            {"H": H, "K": KT, "KP": KT, "MSG": lay.msg, "HDR": _hdr(H, fp8), "BLOCK_T": 2, "CHUNK_T": 32, "BLOCK_E": 64,
             "GC": gc, "HC": min(p2(H), 2048), "IS_FP8": fp8, "ROUND_SCALE": ue8m0, "USE_UE8M0": ue8m0,
             "NATIVE_FP8": fp8, "DISP_BUSY": sig["DISP_BUSY"], "DISP_FULL": sig["DISP_FULL"],
             "DISP_SEND_CNT": sig["DISP_SEND_CNT"]}))
        sw = ((G + 3) // 4 if ue8m0 else G) if fp8 else 1
        tm = tma_aligned_size(RT)
        cases.append(_case(
            "ll_dispatch_recv", f"{fmt} H={H} T={T} E={E} EP{R}", k._ll_dispatch_recv_kernel,
            {"buf_ptr": "*u8", "signal_ptrs": "*i64", "status_ptr": "*i32", "recv_x_ptr": "*u8" if fp8 else "*i16",
             "recv_s_ptr": "*i32", "recv_count_ptr": "*i32", "stats_ptr": "*i32", "wait_stats_ptr": "*i64",
             "slot_row_ptr": "*i32", "recv_tokens_ptr": "*i32", "stamp_ptr": "*i32"},
            {"stride_sl": sw * tm if fp8 else 0, "stride_sg": tm if fp8 else 0, "rank": _RANK, "T": T, "L": L, "R": R,
             "timeout_ns": _TIMEOUT_NS, **offs},
            {"H": H, "K": KT, "KP": KT, "MSG": lay.msg, "HDR": _hdr(H, fp8), "SW": sw, "SWP": p2(sw), "BLOCK_T": 4,
             "HC": min(p2(H), 2048 if fp8 else 1024), "RP": p2(R), "LP": p2(L), "IS_FP8": fp8, "HAS_STATS": True,
             "HAS_WAIT_STATS": True,
             "DISP_BUSY": sig["DISP_BUSY"], "DISP_FULL": sig["DISP_FULL"], "DISP_RECV_CNT": sig["DISP_RECV_CNT"]}))
    comb = {"comb_off": slot_base + lay.comb_off, "sig_off": sig["SLOT_WORDS"]}
    cases.append(_case(
        "ll_combine_send", f"BF16 H={H} T={T} E={E} EP{R}", k._ll_combine_send_fmt_kernel,
        {"x_ptr": "*i16", "slot_row_ptr": "*i32", "recv_tokens_ptr": "*i32", "stamp_ptr": "*i32", **_SYMM_PTRS},
        {"stride_xl": RT * H, "stride_xr": H, "rank": _RANK, "T": T, "R": R, "timeout_ns": _TIMEOUT_NS, **comb},
        {"H": H, "K": KT, "KP": KT, "BLOCK_T": 2, "HC": min(p2(H), 1024), "COMB_BUSY": sig["COMB_BUSY"],
         "COMB_FULL": sig["COMB_FULL"], "COMB_SEND_CNT": sig["COMB_SEND_CNT"], "FMT": 0, "IN_F16": False,
         "NATIVE_FP8": False}))
    cases.append(_case(
        "ll_combine_recv", f"BF16 H={H} T={T} top-{KT} EP{R}", k._ll_combine_recv_fmt_kernel,
        {"buf_ptr": "*u8", "topk_ptr": "*i64", "w_ptr": "*fp32", "out_ptr": "*i16", "signal_ptrs": "*i64",
         "status_ptr": "*i32", "wait_stats_ptr": "*i64", "stamp_ptr": "*i32"},
        {"rank": _RANK, "N": T, "R": R, "E": E, "timeout_ns": _TIMEOUT_NS, **comb},
        {"H": H, "K": KT, "BLOCK_T": 2, "HC": min(p2(H), 1024), "HAS_WAIT_STATS": True, "COMB_BUSY": sig["COMB_BUSY"],
         "COMB_FULL": sig["COMB_FULL"], "COMB_RECV_CNT": sig["COMB_RECV_CNT"], "FMT": 0, "OUT_F16": False},
        options={"enable_fp_fusion": False}))
    # combine formats (moe_ep.kernels.logfmt): FP8 1x128 and LogFMT-10 encoded in the send, decoded in the receive
    for what, fmt, f16 in (("FP8 wire, BF16 x", 2, False), ("LogFMT-10 wire, BF16 x", 3, False),
                           ("FP8 wire, FP16 x", 2, True)):
        cases.append(_case(
            "ll_combine_send_fmt", f"{what} H={H} T={T} E={E} EP{R}", k._ll_combine_send_fmt_kernel,
            {"x_ptr": "*i16", "slot_row_ptr": "*i32", "recv_tokens_ptr": "*i32", "stamp_ptr": "*i32", **_SYMM_PTRS},
            {"stride_xl": RT * H, "stride_xr": H, "rank": _RANK, "T": T, "R": R, "timeout_ns": _TIMEOUT_NS, **comb},
            {"H": H, "K": KT, "KP": KT, "BLOCK_T": 2, "HC": min(p2(H), 1024), "COMB_BUSY": sig["COMB_BUSY"],
             "COMB_FULL": sig["COMB_FULL"], "COMB_SEND_CNT": sig["COMB_SEND_CNT"], "FMT": fmt, "IN_F16": f16,
             "NATIVE_FP8": fmt == 2}))
    for what, fmt, f16 in (("FP8 wire", 2, False), ("LogFMT-10 wire", 3, False), ("FP16 wire + out", 1, True)):
        cases.append(_case(
            "ll_combine_recv_fmt", f"{what} H={H} T={T} top-{KT} EP{R}", k._ll_combine_recv_fmt_kernel,
            {"buf_ptr": "*u8", "topk_ptr": "*i64", "w_ptr": "*fp32", "out_ptr": "*i16", "signal_ptrs": "*i64",
             "status_ptr": "*i32", "wait_stats_ptr": "*i64", "stamp_ptr": "*i32"},
            {"rank": _RANK, "N": T, "R": R, "E": E, "timeout_ns": _TIMEOUT_NS, **comb},
            {"H": H, "K": KT, "BLOCK_T": 2, "HC": combine_recv_columns(H, fmt), "HAS_WAIT_STATS": True,
             "COMB_BUSY": sig["COMB_BUSY"], "COMB_FULL": sig["COMB_FULL"], "COMB_RECV_CNT": sig["COMB_RECV_CNT"],
             "FMT": fmt, "OUT_F16": f16},
            options={"enable_fp_fusion": False}))
    shipped = {c.kernel.__name__ for c in cases}
    jitted = {n for n, v in vars(k).items() if n.startswith("_ll_") and isinstance(v, triton.runtime.JITFunction)}
    jitted.discard("_ll_quiet_kernel")  # NVSHMEM transport only (rejoin): a row of _nvshmem_cases
    if jitted != shipped:
        raise RuntimeError(f"low_latency.py kernels without a case here: {sorted(jitted - shipped)}")
    # SymmLowLatency launches every one of them with the register cap lifted (k.LL_MAXNREG)
    return [dataclasses.replace(c, options={**(c.options or {}), "maxnreg": k.LL_MAXNREG}) for c in cases]


def _nvshmem_cases() -> list[Case]:
    """The low-latency kernels with ``TRANSPORT`` = NVSHMEM (the ``nvshmem`` backend), linked with NVSHMEM's sm_90
    device bitcode: DeepSeek-V3 decode shapes as in :func:`_low_latency_cases`, one configuration per kernel (each
    links the ~50 MB bitcode: 20-60 s to compile). Rows named ``nvshmem ...``. None, with one line on stderr, when no
    bitcode is installed (``pip install 'moe-ep[nvshmem]'``) or this Triton cannot link it
    (:func:`moe_ep.nvshmem.check_triton_link`)."""
    from moe_ep import nvshmem
    from moe_ep.kernels import logfmt
    from moe_ep.kernels.transport import NVSHMEM

    try:
        options = nvshmem.launch_options(TARGET_CC)  # what SymmLowLatency launches with
    except FileNotFoundError as exc:
        print(f"sm90_report: no NVSHMEM rows ({str(exc).split('. Searched')[0]})", file=sys.stderr)
        return []
    except nvshmem.NvshmemUnavailableError as exc:  # this Triton cannot link that bitcode: both versions named
        print(f"sm90_report: no NVSHMEM rows ({str(exc).splitlines()[-1].strip(' -')})", file=sys.stderr)
        return []
    from moe_ep.kernels import low_latency as k

    H, R = 7168, 8
    # Every low-latency kernel links the bitcode with this transport (the receives release their sources with
    # put-with-signal); _ll_quiet_kernel runs at rejoin only.
    picked = {("ll_dispatch_send", "FP8 H="), ("ll_dispatch_send", "BF16 H="), ("ll_combine_send_fmt", "FP8 wire, BF16 x"),
              ("ll_dispatch_recv", "FP8 H="), ("ll_combine_recv_fmt", "FP8 wire")}
    cases = [_case("ll_quiet", f"EP{R} NVSHMEM", k._ll_quiet_kernel, {}, {}, {}, num_warps=4, options=options)]
    for c in _low_latency_cases():
        if not any(c.name == n and c.config.startswith(p) for n, p in picked):
            continue
        const = {**c.constexprs, "TRANSPORT": NVSHMEM.value}
        if "ROW_BYTES" in const:
            const["ROW_BYTES"] = logfmt.row_bytes(const["FMT"], H)
        base = dataclasses.replace(c, name=f"nvshmem {c.name}", config=f"{c.config} NVSHMEM", constexprs=const,
                                   options={**(c.options or {}), **options})
        cases.append(base)
        if c.name == "ll_combine_send_fmt":  # the default combine: BF16 on the wire
            bf16 = {**const, "FMT": logfmt.FMT_BF16, "NATIVE_FP8": False, "ROW_BYTES": logfmt.row_bytes(logfmt.FMT_BF16, H)}
            cases.append(dataclasses.replace(base, config=c.config.replace("FP8 wire", "BF16 wire") + " NVSHMEM",
                                             constexprs=bf16))
    return cases


def _all_cases() -> list[Case]:
    return [*_quant_cases(), *_layout_cases(), *_intranode_cases(), *_low_latency_cases(), *_host_cases()]

