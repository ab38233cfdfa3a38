"""The GPU lease kit's first timed stage (``perf/lease_checks.py method``): what the earlier quant number was made of,
then quant, SiLU-and-mul quant and ``eplb.map_topk`` by the method of ``perf/_method.py``, each with its copy limit
measured by the same method on the same bytes, before anything else is timed.

1. ``split``: one quant call (prefill shape, TMA-aligned scales) timed four ways: ``eager-write-flush`` (the earlier
   method: eager call after a ``zero_()`` flush of 2x L2), ``eager-host`` (the same after a read-only flush),
   ``graph-single`` (a graph of the one call after a read-only flush: no host), ``graph-rotating`` (steady state),
   plus the per-kernel time from ``torch.profiler`` and the host wrapper's own time (``perf_counter`` per call with
   Triton's launch replaced by a no-op; launch included beside it). The differences are the parts:
   flush write-back = write-flush - eager; host gap = eager - graph-single; kernel = graph-single (cold L2) /
   graph-rotating (steady).
2. quant prefill and decode, SiLU-and-mul quant, ``map_topk`` (static and balanced over all tokens; the per-rank
   decode call with ``rank=``), every one bitwise against its reference.

Only the public entry points are called (``moe_ep.quant.per_token_group_quant_fp8`` / ``silu_and_mul_quant_fp8``,
``eplb.map_topk``), so the stage times whichever kernels are behind them.
"""

from __future__ import annotations

import time

import torch

import _common
from lease_cases import DEV, _bitwise, _gen, _placement, _quant_input

# name -> quant prefill M, decode M, hidden, SiLU M, SiLU intermediate, map_topk tokens, top-k, experts, GPUs,
# slots, per-rank decode tokens
SHAPES = {
    "tiny": dict(M=8, Md=4, H=256, Ms=8, I=128, N=16, K=2, E=8, G=2, P=12, Nd=4),
    "dsv3": dict(M=4096, Md=128, H=7168, Ms=4096, I=2048, N=4096, K=8, E=256, G=8, P=272, Nd=32),
}


def _small() -> dict:
    """Iteration counts: a dry run on the interpreter does the least that still runs every code path."""
    if DEV.type == "cuda":
        return dict(n=20, replays=5, iters=20)
    return dict(n=3, replays=1, iters=1)


def host_us(fn, iters: int = 50, stub_launch: bool = True) -> dict:
    """Host time per call of ``fn`` by ``perf_counter`` (the GPU is synchronised before and after the loop, not
    inside). ``stub_launch``: Triton's launch (``JITFunction.run``) replaced by a no-op for the loop, so only the
    wrapper's own Python and allocations remain; ``launches_stubbed`` says how many launches per call it caught
    (0: the launch was not excluded)."""
    import triton.runtime.jit as jit

    caught = [0]
    orig = jit.JITFunction.run

    def stub(self, *a, **k):
        caught[0] += 1

    if DEV.type == "cuda":
        torch.cuda.synchronize()
    if stub_launch:
        jit.JITFunction.run = stub
    try:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        us = (time.perf_counter() - t0) * 1e6 / iters
    finally:
        jit.JITFunction.run = orig
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    return {"us": us, "launches_stubbed": caught[0] / iters if stub_launch else None}


def split_parts(write_flush_us: float, eager_us: float, single_us: float) -> dict:
    """The parts of the earlier number: flush write-back, host gap, kernel (cold L2)."""
    return {"flush_writeback_us": write_flush_us - eager_us, "host_gap_us": eager_us - single_us,
            "kernel_cold_us": single_us}


def _row(meas: dict, what: str) -> dict:
    keep = ("us", "p10", "p90", "method", "method_detail", "limit_us", "limit_GBps", "GBps", "ratio", "bytes", "sets",
            "n", "total_bytes", "l2_bytes", "flush", "flush_bytes")
    out = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in meas.items() if k in keep}
    out["detail"] = (f"{what}: {meas['us']:.2f} us, copy of the same bytes {meas['limit_us']:.2f} us = "
                     f"{meas['ratio']:.2f} of copy ({meas['method_detail']})")
    return out


def quant_bytes(m: int, k: int, width: int | None = None) -> int:
    """Bytes a quant call reads + writes: BF16 input (``width`` columns, default ``k``), FP8 out, float32 scales."""
    return m * (width or k) * 2 + m * k + m * (k // 128) * 4


def split(m, k):
    from moe_ep.fp8 import per_token_group_quant_fp8_ref
    from moe_ep.quant import per_token_group_quant_fp8

    x = _quant_input(m, k, 1).to(DEV)
    call = lambda: per_token_group_quant_fp8(x, tma_aligned_scales=True)  # noqa: E731
    c = _small()
    dev = DEV if DEV.type == "cuda" else None
    old = _common.time_us(call, dev, iters=c["iters"], warmup=1, write_flush=True)
    eager = _common.time_us(call, dev, iters=c["iters"], warmup=1)
    single, s_info = _common.time_single(call, DEV, iters=c["iters"])
    meas = _common.measure(lambda i: (lambda xi=_quant_input(m, k, 1 + i).to(DEV):
                                      per_token_group_quant_fp8(xi, tma_aligned_scales=True)),
                           quant_bytes(m, k), DEV, n=c["n"], replays=c["replays"], iters=c["iters"])
    kernels = _common.kernel_times(call, DEV, iters=max(1, c["iters"] // 4))
    host = host_us(call, iters=max(1, c["iters"]))
    host_launch = host_us(call, iters=max(1, c["iters"]), stub_launch=False)
    q, _ = per_token_group_quant_fp8(x)
    ok = _bitwise(q, per_token_group_quant_fp8_ref(x.float().cpu(), 128)[0])
    parts = split_parts(old.median, eager.median, single.median)
    kernel_sum = sum(kernels.values())
    launch = "launch excluded" if host["launches_stubbed"] else "launch NOT excluded (no Triton launch caught)"
    cpu = DEV.type != "cuda"
    return {"ok": ok, "detail": (
        f"{m}x{k}: eager-write-flush {old.median:.1f} us = flush write-back {parts['flush_writeback_us']:.1f} + "
        f"host gap {parts['host_gap_us']:.1f} + kernel (cold L2, graph-single) {single.median:.1f}; steady "
        f"(graph-rotating) {meas['us']:.1f} us vs copy {meas['limit_us']:.1f} us ({meas['ratio']:.2f}); profiler "
        f"kernels {kernel_sum:.1f} us; host wrapper {host['us']:.1f} us ({launch}), {host_launch['us']:.1f} us with "
        f"launch"),
        "method": _common.CPU_WALL if cpu else _common.EAGER_WRITE_FLUSH, "write_flush_us": round(old.median, 3),
        "eager_us": round(eager.median, 3),
        "graph_single_us": round(single.median, 3), "graph_rotating_us": round(meas["us"], 3),
        "copy_us": round(meas["limit_us"], 3), "ratio": round(meas["ratio"], 3),
        **{k_: round(v, 3) for k_, v in parts.items()}, "profiler_kernels_us": {k_: round(v, 3) for k_, v in
                                                                                kernels.items()},
        "host_wrapper_us": round(host["us"], 3), "host_launches_stubbed": host["launches_stubbed"],
        "host_with_launch_us": round(host_launch["us"], 3),
        "methods": {k_: _common.CPU_WALL if cpu else v for k_, v in {
            "write_flush_us": _common.EAGER_WRITE_FLUSH, "eager_us": _common.EAGER,
            "graph_single_us": s_info["method"], "graph_rotating_us": meas["method"],
            "profiler_kernels_us": _common.PROFILER}.items()}}


def quant(m, k, single=False):
    from moe_ep.fp8 import per_token_group_quant_fp8_ref
    from moe_ep.quant import per_token_group_quant_fp8

    c = _small()
    meas = _common.measure(lambda i: (lambda xi=_quant_input(m, k, 1 + i).to(DEV):
                                      per_token_group_quant_fp8(xi, tma_aligned_scales=True)),
                           quant_bytes(m, k), DEV, n=c["n"], replays=c["replays"], iters=c["iters"])
    x = _quant_input(m, k, 7).to(DEV)
    call = lambda: per_token_group_quant_fp8(x, tma_aligned_scales=True)  # noqa: E731
    out = _row(meas, f"quant {m}x{k}")
    if single:
        t, info = _common.time_single(call, DEV, iters=c["iters"])
        lim = _common.copy_single(quant_bytes(m, k), DEV, iters=c["iters"])
        out.update(single_us=round(t.median, 3), single_copy_us=round(lim["us"], 3), single_method=info["method"])
        out["detail"] += f"; single call in a graph {t.median:.2f} us (copy {lim['us']:.2f} us, {info['method']})"
    out["eager_us"] = round(_common.time_us(call, DEV if DEV.type == "cuda" else None, iters=c["iters"]).median, 3)
    q, _ = per_token_group_quant_fp8(x)
    return {"ok": _bitwise(q, per_token_group_quant_fp8_ref(x.float().cpu(), 128)[0]), **out}


def _silu_input(m, i, seed):
    g = _gen(seed)
    choice = torch.tensor([20.0, 24.0, 0.0, -110.0])  # gates whose SiLU is exact in float32 (lease_cases.silu_quant)
    gate = choice[torch.randint(0, 4, (m, i), generator=g)]
    return torch.cat([gate, torch.randn(m, i, generator=g) * 3], dim=1).to(torch.bfloat16)


def silu_quant(m, i):
    from moe_ep.quant import silu_and_mul_quant_fp8, silu_and_mul_quant_fp8_ref

    c = _small()
    meas = _common.measure(lambda s: (lambda xi=_silu_input(m, i, 1 + s).to(DEV):
                                      silu_and_mul_quant_fp8(xi, tma_aligned_scales=True)),
                           quant_bytes(m, i, 2 * i), DEV, n=c["n"], replays=c["replays"], iters=c["iters"])
    x = _silu_input(m, i, 9)
    out = _row(meas, f"silu_and_mul quant {m}x{i}(x2)")
    out["eager_us"] = round(_common.time_us(lambda: silu_and_mul_quant_fp8(x.to(DEV), tma_aligned_scales=True),
                                            DEV if DEV.type == "cuda" else None, iters=c["iters"]).median, 3)
    q, s = silu_and_mul_quant_fp8(x.to(DEV))
    q_ref, s_ref = silu_and_mul_quant_fp8_ref(x)
    return {"ok": _bitwise(q, q_ref) and _bitwise(s.contiguous(), s_ref), **out}


def map_topk(n, K, E, P, G, policy, rank=None):
    """``eplb.map_topk`` over ``n`` tokens (``rank``: the per-rank call of that rank, timed as one call in a graph),
    bitwise against the torch path."""
    import eplb

    log2phy, logcnt = _placement(E, P, G, 0)
    mr = int(logcnt.max())
    l2p, lc = log2phy.to(DEV), logcnt.to(DEV)
    kw = dict(num_gpus=G, num_slots=P, max_replicas=mr, **({"rank": rank} if rank is not None else {}))
    c = _small()

    def topk(seed):
        return torch.randint(0, E, (n, K), generator=_gen(seed)).to(DEV)

    nbytes = 2 * n * K * 8 + l2p.numel() * 8 + lc.numel() * 8  # ids read, slots written, tables read
    if rank is None:
        meas = _common.measure(lambda i: (lambda t=topk(1 + i): eplb.map_topk(t, l2p, lc, policy, **kw)), nbytes, DEV,
                               n=c["n"], replays=c["replays"], iters=c["iters"])
        out = _row(meas, f"map_topk {n}x{K} {policy}")
    else:
        t0 = topk(1)
        t, info = _common.time_single(lambda: eplb.map_topk(t0, l2p, lc, policy, **kw), DEV, iters=c["iters"])
        lim = _common.copy_single(nbytes, DEV, iters=c["iters"])
        out = {"us": round(t.median, 3), "method": info["method"], "limit_us": round(lim["us"], 3),
               "detail": f"map_topk per-rank {n}x{K} {policy} rank {rank}: {t.median:.2f} us in a graph "
                         f"(copy of the same bytes {lim['us']:.2f} us; {_common.describe(info)})"}
    tk = topk(3)
    out["eager_us"] = round(_common.time_us(lambda: eplb.map_topk(tk, l2p, lc, policy, **kw),
                                            DEV if DEV.type == "cuda" else None, iters=c["iters"]).median, 3)
    a = eplb.map_topk(tk, l2p, lc, policy, **kw)
    b = eplb.map_topk(tk.cpu(), log2phy, logcnt, policy, impl="torch", **kw)
    return {"ok": _bitwise(a, b), **out}


def method_cases(shapes: str):
    """(name, fn, kwargs) of the stage, in order: the split first."""
    s = SHAPES["tiny" if shapes == "tiny" else "dsv3"]
    M, Md, H, Ms, inter, N, K, E, G, P, Nd = (s[k] for k in ("M", "Md", "H", "Ms", "I", "N", "K", "E", "G", "P", "Nd"))
    return [
        (f"split quant {M}x{H}", split, dict(m=M, k=H)),
        (f"quant {M}x{H}", quant, dict(m=M, k=H)),
        (f"quant decode {Md}x{H}", quant, dict(m=Md, k=H, single=True)),
        (f"silu_quant {Ms}x{inter}x2", silu_quant, dict(m=Ms, i=inter)),
        (f"map_topk {N}x{K} static P{P} G{G}", map_topk, dict(n=N, K=K, E=E, P=P, G=G, policy="static")),
        (f"map_topk {N}x{K} balanced P{P} G{G}", map_topk, dict(n=N, K=K, E=E, P=P, G=G, policy="balanced")),
        (f"map_topk per-rank {Nd}x{K} balanced", map_topk, dict(n=Nd, K=K, E=E, P=P, G=G, policy="balanced", rank=1)),
        (f"map_topk per-rank {Nd}x{K} static", map_topk, dict(n=Nd, K=K, E=E, P=P, G=G, policy="static", rank=1)),
    ]
