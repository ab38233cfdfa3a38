"""The GPU lease kit's low-latency stage (``perf/lease_checks.py ll``): what each low-latency kernel costs per peer,
and one decode MoE layer step captured in a CUDA graph.

1. ``ll EP{R}`` for R in 8, 2, 4 (that order) virtual ranks on the one GPU (DeepSeek-V3 decode: T 128, H 7168,
   256 experts, top-8, FP8 dispatch, BF16 combine): each phase (dispatch send, dispatch receive, combine send, combine receive;
   every virtual rank's launch of it) is captured in its own CUDA graph and the graphs are replayed in order;
   each phase's replay runs inside its own ``torch.profiler`` session (``kernel_times``), so every kernel, fills
   included, is attributed to the phase that launched it whatever its name. The row gives per phase the kernels'
   microseconds per replay and per virtual rank (per replay / R); the combined outputs are checked bitwise against
   an eager ``virtual_low_latency_step`` of the same inputs.
2. ``ll fit {phase}``: per phase and per kernel, the time per virtual rank fitted as ``a + b*R`` by least squares
   over the R that ran (:func:`fit_linear`: ``a``, ``b`` = the cost of one more peer, the RMS residual).
3. ``layer decode``: ``moe_ep.MoELayer(mode="decode")`` over a ``symm`` low-latency ``Buffer`` on a one-rank group,
   holding the 32 experts one rank of DeepSeek-V3 EP8 holds (T 128, top-8 over them: the rows per expert of a
   balanced EP8 rank), timed ``graph-single`` (a graph of one layer call after a read-only L2 flush) beside its
   eager call; the replayed output equals the eager one bitwise and the first tokens are within 1e-2 of the
   emulated-FP8 reference.

Only the entry points the ``time`` stage uses are called (``SymmLowLatency`` send / receive over
``create_virtual_symm_buffers``, ``virtual_low_latency_step``, ``moe_ep.Buffer`` + ``MoELayer``), so the stage times
whichever kernels are behind them. CPU (``--shapes tiny``, interpreter): the same code paths, eager, ``cpu-wall``.
"""

from __future__ import annotations

import math
import os
import tempfile

import torch

import _common
from lease_cases import DEV, _bitwise, _gen, _ll_paths

PHASES = ("dispatch send", "dispatch recv", "combine send", "combine recv")
# name -> virtual EP sizes, tokens per rank, hidden, experts, top-k; the layer: its experts (one rank's) and
# intermediate size
SHAPES = {
    "tiny": dict(worlds=(2, 4), T=4, H=256, E=8, K=2, LE=4, I=128),
    # EP8 first: the stage's cap (140 s) ran out before it on 2026-11-28 (each size compiles and captures its own
    # kernels); then 2 and 4, for the fit
    "dsv3": dict(worlds=(8, 2, 4), T=128, H=7168, E=256, K=8, LE=32, I=2048),
}


def fit_linear(points) -> dict:
    """Least-squares ``y = a + b*x`` over ``points`` (``(x, y)`` pairs, at least two distinct x). Returns ``{"a",
    "b", "residual" (root mean square of y - (a + b*x)), "max_residual", "n"}``."""
    pts = [(float(x), float(y)) for x, y in points]
    n = len(pts)
    if n < 2 or len({x for x, _ in pts}) < 2:
        raise ValueError(f"a line needs two distinct x, got {pts}")
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    b = sum((x - mx) * (y - my) for x, y in pts) / sxx
    a = my - b * mx
    res = [y - (a + b * x) for x, y in pts]
    return {"a": a, "b": b, "residual": math.sqrt(sum(r * r for r in res) / n),
            "max_residual": max(abs(r) for r in res), "n": n}


def _iters() -> int:
    return 3 if DEV.type == "cuda" else 1


class _Phases:
    """The four phases of a low-latency step over ``paths`` as zero-argument calls that keep their results in
    ``self.box``, so a phase captured in a graph hands its (static) outputs to the next phase's capture."""

    def __init__(self, paths, xs, idxs, ws, T, E):
        self.paths, self.xs, self.idxs, self.ws, self.T, self.E = paths, xs, idxs, ws, T, E
        self.box, self.ys = {}, None

    def dispatch_send(self):
        self.box["ds"] = [p.dispatch_send(x, i, self.T, self.E, use_fp8=True, round_scale=False, use_ue8m0=False)
                          for p, x, i in zip(self.paths, self.xs, self.idxs)]

    def dispatch_recv(self):
        self.box["res"] = [p.dispatch_recv(s) for p, s in zip(self.paths, self.box["ds"])]
        if self.ys is None:  # the stand-in expert outputs: the first receive's rows as BF16, static from then on
            self.ys = [r.recv_x.to(torch.bfloat16) for r in self.box["res"]]

    def combine_send(self):
        self.box["cs"] = [p.combine_send(y, i, w, r.handle)
                          for p, y, i, w, r in zip(self.paths, self.ys, self.idxs, self.ws, self.box["res"])]

    def combine_recv(self):
        self.box["out"] = [p.combine_recv(s) for p, s in zip(self.paths, self.box["cs"])]

    def calls(self):
        return [self.dispatch_send, self.dispatch_recv, self.combine_send, self.combine_recv]


def _capture_phases(ph: _Phases) -> list:
    """GPU: one eager step on a side stream (compiles, fixes the expert outputs), then each phase captured in its
    own graph (capture runs nothing); returns the four replays. CPU: the eager calls."""
    calls = ph.calls()
    if DEV.type != "cuda":
        for c in calls:
            c()
        return calls
    s = torch.cuda.Stream(DEV)
    s.wait_stream(torch.cuda.current_stream(DEV))
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream(DEV).wait_stream(s)
    torch.cuda.synchronize(DEV)
    graphs = []
    for c in calls:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            c()
        graphs.append(g)
    for g in graphs:
        g.replay()
    torch.cuda.synchronize(DEV)
    return [g.replay for g in graphs]


def ll_world(world, T, H, E, K, box):
    """Per-phase kernel times of one low-latency step at ``world`` virtual ranks (``box[world]``: per phase,
    ``{kernel: us per virtual rank}``)."""
    from moe_ep.backends.symm_ll import virtual_low_latency_step
    from moe_ep.testing.inputs import make_all_inputs

    _, paths = _ll_paths(world, T, H, E, K)
    inputs = make_all_inputs(world, T, H, E, K, 17)
    xs, idxs, ws = ([getattr(i, a).to(DEV) for i in inputs] for a in ("x", "topk_idx", "topk_weights"))
    ph = _Phases(paths, xs, idxs, ws, T, E)
    replays = _capture_phases(ph)
    iters = _iters()
    tot = {p: {} for p in PHASES}
    for _ in range(iters):  # each phase in its own profiler session, the phases in order
        for name, rep in zip(PHASES, replays):
            for k, us in _common.kernel_times(rep, DEV, iters=1, warmup=0).items():
                tot[name][k] = tot[name].get(k, 0.0) + us / iters
    if DEV.type == "cuda":
        torch.cuda.synchronize(DEV)
    outs = [o.clone() for o in ph.box["out"]]
    counts = [r.recv_count.clone() for r in ph.box["res"]]
    ref_res, ref_out = virtual_low_latency_step(paths, xs, idxs, ws, T, E, use_fp8=True,
                                                expert_fn=lambda r, _res: ph.ys[r])
    ok = all(_bitwise(a, b) for a, b in zip(outs, ref_out)) and \
        all(_bitwise(a, b.recv_count) for a, b in zip(counts, ref_res))
    per_rank = {p: {k: v / world for k, v in tot[p].items()} for p in PHASES}
    box[world] = per_rank
    totals = {p: sum(v.values()) for p, v in per_rank.items()}
    how = "profiler, graph replays" if DEV.type == "cuda" else "CPU ops, eager, interpreter"
    return {"ok": ok, "detail": f"EP{world} virtual ranks, us per virtual rank ({how}): "
            + ", ".join(f"{p} {totals[p]:.1f}" for p in PHASES)
            + ("; outputs bitwise the eager step" if ok else "; OUTPUTS DIFFER from the eager step"),
            "method": _common.PROFILER if DEV.type == "cuda" else _common.CPU_WALL, "world": world, "virtual": True,
            "iterations": iters, "kernels_us_per_replay": {p: {k: round(v, 3) for k, v in tot[p].items()}
                                                           for p in PHASES},
            "per_rank_us": {p: round(t, 3) for p, t in totals.items()}}


def ll_fit(phase, box):
    """``a + b*R`` of ``phase``'s time per virtual rank (all its kernels) and of each kernel seen at every R."""
    worlds = sorted(box)
    if len(worlds) < 2:
        return {"ok": False, "detail": f"needs two EP sizes, got {worlds}"}
    tot = fit_linear([(r, sum(box[r][phase].values())) for r in worlds])
    names = set.intersection(*(set(box[r][phase]) for r in worlds))
    kernels = {}
    for k in sorted(names, key=lambda k: -box[worlds[-1]][phase][k]):
        f = fit_linear([(r, box[r][phase][k]) for r in worlds])
        kernels[k] = {"a_us": round(f["a"], 3), "b_us": round(f["b"], 4), "residual_us": round(f["residual"], 3)}
    top = ", ".join(f"{k[:40]} {v['a_us']:.1f} + {v['b_us']:.2f} R" for k, v in list(kernels.items())[:3])
    return {"ok": all(math.isfinite(tot[x]) for x in ("a", "b", "residual")),
            "detail": f"{phase} per virtual rank over EP {'/'.join(map(str, worlds))}: {tot['a']:.2f} + "
            f"{tot['b']:.3f} R us (RMS residual {tot['residual']:.2f} us); per kernel: {top}",
            "method": _common.PROFILER if DEV.type == "cuda" else _common.CPU_WALL, "a_us": round(tot["a"], 3),
            "b_us": round(tot["b"], 4), "residual_us": round(tot["residual"], 3),
            "points": [[r, round(sum(box[r][phase].values()), 3)] for r in worlds], "kernels": kernels}


def _one_rank_group() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        store = os.path.join(tempfile.mkdtemp(prefix="lease_ll_"), "store")
        dist.init_process_group("gloo" if DEV.type == "cpu" else "nccl", init_method=f"file://{store}", rank=0,
                                world_size=1)


def layer_decode(T, H, LE, K, inter, iters):
    """One decode ``MoELayer`` step on a one-rank group holding ``LE`` experts: ``graph-single`` and eager."""
    import moe_ep
    from moe_ep.backends.symm import SymmBackend
    from moe_ep.layer.experts import ExpertWeights
    from moe_ep.layer.moe import MoELayer
    from moe_ep.testing.refs import ref_moe

    _one_rank_group()
    gd = torch.Generator(device=DEV).manual_seed(5)
    w13 = torch.randn(LE, 2 * inter, H, device=DEV, generator=gd) / H ** 0.5
    w2 = torch.randn(LE, H, inter, device=DEV, generator=gd) / inter ** 0.5
    weights = ExpertWeights.from_float(w13, w2)
    g = _gen(7)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(DEV)
    idx = torch.stack([torch.randperm(LE, generator=g)[:K] for _ in range(T)]).to(DEV)
    w = torch.rand(T, K, generator=g).to(DEV)
    dev = torch.device("cuda", torch.cuda.current_device()) if DEV.type == "cuda" else DEV
    buf = moe_ep.Buffer(None, explicitly_destroy=True, low_latency_mode=True, backend="symm", timeout_s=60,
                        device=dev, num_rdma_bytes=SymmBackend.get_low_latency_size_hint(T, H, 1, LE, K))
    try:
        layer = MoELayer(buf, weights, LE, mode="decode", num_max_dispatch_tokens_per_rank=T)
        eager_out = layer(x, idx, w)
        box = {}
        t, info = _common.time_single(lambda: box.__setitem__("out", layer(x, idx, w)), DEV, iters=iters)
        te = _common.time_us(lambda: layer(x, idx, w), DEV, iters=iters)
        if DEV.type == "cuda":
            torch.cuda.synchronize(DEV)
        same = _bitwise(box["out"], eager_out)
        n = min(T, 8)  # the float64 reference loops over tokens: the first few
        emulated, _ = ref_moe(x[:n], idx[:n], w[:n], w13, w2, weights.w13, weights.w2)
        err = float((eager_out[:n].double() - emulated).abs().max()) / max(float(emulated.abs().max()), 1e-6)
        buf.check_status()
    finally:
        buf.destroy()
    ok = same and err < 1e-2 and bool(eager_out.isfinite().all())
    return {"ok": ok, "detail": f"{t.median:.1f} us ({_common.describe(info)}); eager {te.median:.1f} us; replay "
            f"{'bitwise' if same else 'DIFFERS from'} the eager call; rel err vs emulated FP8 (first {n} tokens) "
            f"{err:.1e}", "method": info["method"], "us": round(t.median, 2), "p10": round(t.p10, 2),
            "p90": round(t.p90, 2), "eager_us": round(te.median, 2), "method_detail": _common.describe(info),
            "experts": LE, "tokens": T, "topk": K}


def ll_cases(shapes: str, iters: int):
    """(name, fn, kwargs) of the stage, in order: each EP size, the fits, the layer."""
    c = SHAPES["tiny" if shapes == "tiny" else "dsv3"]
    T, H, E, K = c["T"], c["H"], c["E"], c["K"]
    box = {}
    out = [(f"ll EP{r} T{T} H{H} per-kernel", ll_world, dict(world=r, T=T, H=H, E=E, K=K, box=box))
           for r in c["worlds"]]
    out += [(f"ll fit {p} a+b*R", ll_fit, dict(phase=p, box=box)) for p in PHASES]
    out.append((f"layer decode 1 rank T{T} E{c['LE']} H{H} I{c['I']}", layer_decode,
                dict(T=T, H=H, LE=c["LE"], K=K, inter=c["I"], iters=iters if DEV.type == "cuda" else 1)))
    return out
