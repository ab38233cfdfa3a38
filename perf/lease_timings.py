"""The timed cases of the GPU lease kit (``perf/lease_checks.py time``): each times a kernel or a path at the kit's
shapes, checks its output, and carries the limit measured in the same run (device copy bandwidth,
``torch._scaled_mm`` FP8 peak) as ``{"ok": bool, "detail": str, "method": str, ...}`` (``method``: one of
``perf/_method.py``'s; the low-latency rows add per-kernel times from ``torch.profiler``, ``profiler-kernels``).
Inputs and references are the correctness cases' (``perf/lease_cases.py``).
"""

from __future__ import annotations

import torch

import _common
from lease_cases import DEV, SHAPES, _bitwise, _fail, _gen, _ll_paths, _placement, _quant_input, _weights


def _limits():
    return _common.measure_limits(DEV, peer=False)


def time_quant(m, k, iters, limits):
    from moe_ep.fp8 import per_token_group_quant_fp8_ref
    from moe_ep.quant import per_token_group_quant_fp8

    x = _quant_input(m, k, 1).to(DEV)
    nbytes = m * k * 3 + m * k // 128 * 4  # BF16 read, FP8 + scales written
    meas = _common.measure(lambda i: (lambda xi=_quant_input(m, k, 1 + i).to(DEV):
                                      per_token_group_quant_fp8(xi, tma_aligned_scales=True)), nbytes, DEV,
                           n=20 if DEV.type == "cuda" else 3, replays=5 if DEV.type == "cuda" else 1, iters=iters)
    eager = _common.time_us(lambda: per_token_group_quant_fp8(x, tma_aligned_scales=True), DEV, iters=iters)
    q, _ = per_token_group_quant_fp8(x)
    ok = _bitwise(q, per_token_group_quant_fp8_ref(x.float().cpu(), 128)[0])
    return {"ok": ok, "detail": f"{meas['us']:.1f} us, {meas['GBps']:.0f} GB/s read+written = {meas['ratio']:.2f} "
            f"of the copy of the same bytes ({meas['limit_us']:.1f} us; {meas['method_detail']}); eager "
            f"{eager.median:.1f} us", "method": meas["method"], "us": round(meas["us"], 2),
            "GBps": round(meas["GBps"], 1), "limit_us": round(meas["limit_us"], 2),
            "limit_GBps": round(meas["limit_GBps"], 1), "eager_us": round(eager.median, 2)}


def time_gemm_masked(groups, n, k, t_rows, iters, limits):
    from moe_ep import gemm
    from moe_ep.quant import per_token_group_quant_fp8

    wq, ws, _ = _weights(groups, n, k, 3)
    wq, ws = wq.to(DEV), ws.to(DEV)
    x = (torch.randn(groups, t_rows, k) * 4).to(torch.bfloat16).to(DEV)
    xq, xs = per_token_group_quant_fp8(x, column_major_scales=True, tma_aligned_scales=True)
    masked = torch.full((groups,), t_rows, dtype=torch.int32, device=DEV)
    d = torch.empty(groups, t_rows, n, dtype=torch.bfloat16, device=DEV)
    t = _common.time_us(lambda: gemm.m_grouped_fp8_gemm_nt_masked((xq, xs), (wq, ws), d, masked, t_rows), DEV, iters=iters)
    tflops = 2 * groups * t_rows * n * k / t.median / 1e6
    wd = torch.stack([(wq[g].float().view(n // 128, 128, k // 128, 128) * ws[g][:, None, :, None]).reshape(n, k)
                      for g in range(groups)])
    ref_bf16 = torch.bmm(x.float(), wd.transpose(1, 2))
    bf16_w = wd.to(torch.bfloat16)
    tb = _common.time_us(lambda: torch.bmm(x, bf16_w.transpose(1, 2)), DEV, iters=iters)
    err = _common.rel_err(d, ref_bf16)
    peak = limits.get("fp8_tflops") or float("nan")
    return {"ok": err < 0.05, "method": _common.EAGER if DEV.type == "cuda" else _common.CPU_WALL,
            "detail": f"{t.median:.1f} us, {tflops:.0f} TFLOP/s = {tflops / peak:.2f} of _scaled_mm; "
            f"BF16 bmm {tb.median:.1f} us; rel err vs BF16 {err:.3f}", "us": round(t.median, 2),
            "tflops": round(tflops, 1), "fp8_peak_tflops": round(peak, 1), "bf16_bmm_us": round(tb.median, 2)}


def time_ll(world, T, H, E, K, iters, limits):
    from moe_ep.backends.symm_ll import virtual_low_latency_step
    from moe_ep.testing.inputs import make_all_inputs

    _, paths = _ll_paths(world, T, H, E, K)
    inputs = make_all_inputs(world, T, H, E, K, 9)
    xs = [i.x.to(DEV) for i in inputs]
    idxs = [i.topk_idx.to(DEV) for i in inputs]
    ws = [i.topk_weights.to(DEV) for i in inputs]
    T_, E_ = T, E

    def dispatch():
        st = [p.dispatch_send(x, i, T_, E_, use_fp8=True, round_scale=False, use_ue8m0=False)
              for p, x, i in zip(paths, xs, idxs)]
        return [p.dispatch_recv(s) for p, s in zip(paths, st)]

    res = dispatch()
    ys = [r.recv_x.to(torch.bfloat16) for r in res]

    def combine():
        st = [p.combine_send(y, i, w, r.handle) for p, y, i, w, r in zip(paths, ys, idxs, ws, res)]
        return [p.combine_recv(s) for p, s in zip(paths, st)]

    te = _common.time_us(lambda: (dispatch(), combine()), DEV, iters=iters)  # eager: with Python launch overhead
    # CUDA-graph replays (what a decode step runs): kernel time without Python launch overhead
    d_replay, _, d_note = _common.graph_fn(dispatch, DEV)
    td = _common.time_us(d_replay, DEV, iters=iters)
    c_replay, outs, c_note = _common.graph_fn(combine, DEV)
    tc = _common.time_us(c_replay, DEV, iters=iters)
    kd = _common.kernel_times(d_replay, DEV, iters=max(1, iters // 2), warmup=0)  # replays are warm
    kc = _common.kernel_times(c_replay, DEV, iters=max(1, iters // 2), warmup=0)
    c_replay()
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    _, ref_out = virtual_low_latency_step(paths, xs, idxs, ws, T, E, use_fp8=True)
    ok = all(_bitwise(a, b) for a, b in zip(outs, ref_out))
    sel = sum(int((i >= 0).sum()) for i in idxs)
    dbytes, cbytes = sel * (H + H // 32 + 16), sel * 2 * H
    floor_d = dbytes / limits["copy_gbps"] / 1e3
    how = d_note or c_note or "CUDA graph replays"

    def top(k):
        return ", ".join(f"{n[:40]} {v:.1f}" for n, v in list(k.items())[:4])
    return {"ok": ok, "detail": f"EP{world} virtual ranks (one GPU, no NVLink; {how}): dispatch {td.median:.1f} us "
            f"(copy floor {floor_d:.1f}), combine {tc.median:.1f} us (floor {cbytes / limits['copy_gbps'] / 1e3:.1f}); "
            f"eager launches both {te.median:.0f} us; per kernel (profiler, us per replay): dispatch {top(kd)}; "
            f"combine {top(kc)}", "method": _common.how_method(how), "dispatch_us": round(td.median, 2),
            "combine_us": round(tc.median, 2), "eager_us": round(te.median, 2), "virtual": True,
            "dispatch_kernels_us": {n: round(v, 3) for n, v in kd.items()},
            "combine_kernels_us": {n: round(v, 3) for n, v in kc.items()},
            "kernels_method": _common.PROFILER if DEV.type == "cuda" else _common.CPU_WALL}


def time_normal_rounds(world, N, H, E, K, iters, limits):
    """symm normal-mode FP8 dispatch + BF16 combine on virtual ranks through a whole-batch buffer (one round) and
    through fixed buffers of ``C`` tokens per source per round (issue 32's chunk rule): time per step, the extra
    time per extra round, every chunked output bitwise the one-round one. Virtual ranks run one after another on one
    GPU (no NVLink): the per-round overhead (launches, the round's host read) is what this measures."""
    from moe_ep.backends.symm import SymmBackend, virtual_backends, virtual_combine_recv, virtual_dispatch_recv
    from moe_ep.testing.inputs import make_all_inputs

    inputs = make_all_inputs(world, N, H, E, K, 11)
    dev_in = [(i.x_fp8.to(DEV), i.x_scales.to(DEV), i.topk_idx.to(DEV), i.topk_weights.to(DEV)) for i in inputs]
    chunks = [None] + sorted({max(1, N // 8), max(1, N // 2)} if N >= 64 else {max(1, N // 2)})

    def run(bs):
        lays = [b.get_dispatch_layout(i[2], E) for b, i in zip(bs, dev_in)]
        st = [b.normal.dispatch_send(x, s, handle=None, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3],
                                     num_tokens_per_expert=lay[2], topk_idx=i, topk_weights=w, num_experts=E)
              for b, (x, s, i, w), lay in zip(bs, dev_in, lays)]
        res = virtual_dispatch_recv(bs, st)
        ys = [o.recv_x.to(torch.bfloat16) for o in res]
        cst = [b.normal.combine_send(y, o.handle, o.recv_topk_weights) for b, y, o in zip(bs, ys, res)]
        comb = virtual_combine_recv(bs, cst)
        return st[0].rounds, [o.recv_x for o in res] + [c[0] if isinstance(c, tuple) else c for c in comb]

    out, rows, ref = {}, [], None
    for c in chunks:
        size = SymmBackend.get_normal_size_hint(N if c is None else None, H, K, world, chunk_tokens=c)
        bs = virtual_backends(world, num_nvl_bytes=size, device=DEV, timeout_s=60)
        rounds, got = run(bs)
        if ref is None:
            ref = got
        elif not all(_bitwise(a, b) for a, b in zip(got, ref)):
            return _fail(f"C={c}: outputs differ from the one-round path")
        t = _common.time_us(lambda bs=bs: run(bs), DEV, iters=iters)
        rows.append((c, rounds, size, t.median))
    base = rows[0][3]
    parts = []
    for c, rounds, size, us in rows:
        per = (us - base) / (rounds - 1) if rounds > 1 else 0.0
        tag = "whole" if c is None else f"C{c}"
        out[f"{tag}_us"], out[f"{tag}_rounds"], out[f"{tag}_MiB"] = round(us, 1), rounds, round(size / 2 ** 20, 1)
        parts.append(f"{tag}: {rounds} round(s) {size / 2 ** 20:.0f} MiB {us:.0f} us"
                     + (f" (+{per:.0f} us per extra round)" if rounds > 1 else ""))
    return {"ok": True, "detail": f"EP{world} virtual ranks, {N} tokens: " + "; ".join(parts) + "; bitwise equal",
            **out, "virtual": True, "method": _common.EAGER if DEV.type == "cuda" else _common.CPU_WALL}


def time_map_topk(n, E, K, P, G, iters, limits):
    import eplb

    log2phy, logcnt = _placement(E, P, G, 0)
    topk = torch.randint(0, E, (n, K), generator=_gen(1)).to(DEV)
    log2phy, logcnt = log2phy.to(DEV), logcnt.to(DEV)
    mr = int(logcnt.max())
    out = {}
    for policy in ("static", "balanced"):
        t = _common.time_us(lambda: eplb.map_topk(topk, log2phy, logcnt, policy, num_gpus=G, num_slots=P,
                                                  max_replicas=mr), DEV, iters=iters)
        out[f"{policy}_us"] = round(t.median, 2)
    out["method"] = _common.EAGER if DEV.type == "cuda" else _common.CPU_WALL  # graph-timed: the method stage
    a = eplb.map_topk(topk, log2phy, logcnt, "balanced", num_gpus=G, num_slots=P, max_replicas=mr)
    b = eplb.map_topk(topk.cpu(), log2phy.cpu(), logcnt.cpu(), "balanced", num_gpus=G, num_slots=P, impl="torch")
    return {"ok": _bitwise(a, b), "detail": " ".join(f"{k} {v}" for k, v in out.items()), **out}


def time_cases(shapes: str, iters: int):
    c = SHAPES["tiny" if shapes == "tiny" else "dsv3"]
    world, T, H, E, K, inter, M = (c[k] for k in ("world", "T", "H", "E", "K", "I", "M"))
    box = {}

    def limits():
        box["limits"] = _limits()
        lim = box["limits"]
        return {"detail": f"copy {lim['copy_gbps']:.0f} GB/s, FP8 _scaled_mm {lim.get('fp8_tflops') or 0:.0f} TFLOP/s",
                "method": _common.EAGER if DEV.type == "cuda" else _common.CPU_WALL,
                **{k: v for k, v in lim.items() if v is not None}}

    def lazy(fn):
        def run(**kw):
            return fn(**kw, limits=box.get("limits") or _limits())
        return run

    return [
        ("limits (copy, FP8 peak)", limits, {}),
        (f"quant {M}x{H}", lazy(time_quant), dict(m=M, k=H, iters=iters)),
        (f"gemm masked G{E // world} T{world * T} {2 * inter}x{H}", lazy(time_gemm_masked),
         dict(groups=E // world, n=2 * inter, k=H, t_rows=world * T, iters=iters)),
        (f"ll EP{world} T{T} dispatch+combine", lazy(time_ll), dict(world=world, T=T, H=H, E=E, K=K, iters=iters)),
        (f"map_topk {M}x{K}", lazy(time_map_topk), dict(n=M, E=E, K=K, P=E + 2 * world, G=world, iters=iters)),
        (f"normal EP{world} N{M} rounds", lazy(time_normal_rounds), dict(world=world, N=M, H=H, E=E, K=K, iters=iters)),
    ]
