"""The correctness cases of the GPU lease kit (``perf/lease_checks.py``; the timed ones are in
``perf/lease_timings.py``): each returns ``{"ok": bool, "detail": str, ...}``.

They compare a compiled kernel (on a GPU; the interpreter on CPU) with its torch reference from ``moe_ep.fp8`` /
``moe_ep.testing.refs``: bitwise where the kernel is specified bitwise (FP8 quant, fused SiLU quant with SiLU-exact
gates, low-latency and normal dispatch / combine on virtual ranks, the expand gather, ``map_topk``), within the
float32 accumulation bound for the GEMMs (the bound of tests/test_gemm.py), and within 1e-2 of the emulated-FP8
reference for the whole-layer mega-MoE.
"""

from __future__ import annotations

import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = torch.device("cpu") if INTERPRET or not torch.cuda.is_available() else torch.device("cuda")

# name -> (world, T or M, hidden, experts, topk, intermediate)
SHAPES = {
    "tiny": dict(world=2, T=4, H=256, E=8, K=2, I=128, M=8),
    "small": dict(world=4, T=16, H=512, E=16, K=4, I=256, M=256),
    "dsv3": dict(world=8, T=128, H=7168, E=256, K=8, I=2048, M=4096),
}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits (any strides, any device): :func:`moe_ep.testing.assert_bitwise_equal` as a bool."""
    from moe_ep.testing import assert_bitwise_equal

    try:
        assert_bitwise_equal(a, b)
    except AssertionError:
        return False
    return True


def _fail(what: str) -> dict:
    return {"ok": False, "detail": what}


# ------------------------------------------------------------------------------------------- quant
QUANT_LAYOUTS = {"row": {}, "round": {"round_scale": True}, "ue8m0": {"scale_ue8m0": True}}


def _quant_input(m, k, seed):
    g = _gen(seed)
    mag = 10.0 ** torch.randint(-6, 4, (m, k // 128, 1), generator=g).float()
    return (torch.randn(m, k // 128, 128, generator=g) * mag).reshape(m, k).to(torch.bfloat16)


def quant(m, k, layout):
    from moe_ep.fp8 import per_token_group_quant_fp8_ref
    from moe_ep.quant import per_token_group_quant_fp8

    opts = QUANT_LAYOUTS[layout]
    x = _quant_input(m, k, m + k)
    q, s = per_token_group_quant_fp8(x.to(DEV), **opts)
    q_ref, s_ref = per_token_group_quant_fp8_ref(x.float(), 128, opts.get("round_scale", False) or
                                                 opts.get("scale_ue8m0", False), opts.get("scale_ue8m0", False))
    if not _bitwise(q, q_ref):
        return _fail(f"x_fp8 differs in {int((q.cpu().view(torch.uint8) != q_ref.view(torch.uint8)).sum())} bytes")
    if not _bitwise(s.contiguous(), s_ref):
        return _fail("scales differ")
    return {"detail": "bitwise"}


def silu_quant(m, i):
    from moe_ep.quant import silu_and_mul_quant_fp8, silu_and_mul_quant_fp8_ref

    g = _gen(m + i)
    # gates whose SiLU is exact in float32 everywhere: >= 20 (silu = g), 0, <= -104 (-0.0)
    choice = torch.tensor([20.0, 24.0, 0.0, -110.0])
    gate = choice[torch.randint(0, 4, (m, i), generator=g)]
    up = torch.randn(m, i, generator=g) * 3
    x = torch.cat([gate, up], dim=1).to(torch.bfloat16)
    q, s = silu_and_mul_quant_fp8(x.to(DEV))
    q_ref, s_ref = silu_and_mul_quant_fp8_ref(x)
    if not (_bitwise(q, q_ref) and _bitwise(s.contiguous(), s_ref)):
        return _fail("differs from silu_and_mul_quant_fp8_ref")
    return {"detail": "bitwise"}


# ------------------------------------------------------------------------------------------- GEMMs
def _weights(g, n, k, seed):
    from moe_ep.quant import dequant_block_fp8, per_block_quant_fp8

    gen = _gen(seed)
    w = torch.randn(g, n, k, generator=gen) * torch.rand(g, n, 1, generator=gen)
    wq, ws = per_block_quant_fp8(w)
    return wq, ws, dequant_block_fp8(wq, ws)


# |d - ref| <= ACC_BOUND * sum_k |a_k w_k| + one BF16 ulp. The interpreter sums each 128-deep K block exactly in
# float32 (1e-5, tests/test_gemm.py). Hopper's FP8 tensor cores keep about 14 bits in the accumulator inside a
# block (DeepSeek-V3 report, section 3.3.2), so compiled on sm90 the bound is 2^-12; measured on an H200 the
# worst case was 6.4e-5 (a quarter of it). DeepGEMM's own check, calc_diff < 1e-3, is reported beside it.
ACC_BOUND = 1e-5 if DEV.type == "cpu" else 2.0 ** -12


def calc_diff(x, y) -> float:
    """DeepGEMM's similarity check: 1 - 2 sum(x y) / sum(x^2 + y^2) (float64)."""
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum()
    return float(1 - 2 * (x * y).sum() / denom) if float(denom) > 0 else 0.0


def _gemm_err(d, xd, wd):
    """(max over elements of |d - ref| / (ACC_BOUND * sum|a w| + bf16 ulp(ref)): <= 1 passes, calc_diff)."""
    from moe_ep.testing import ulp

    xd, wd = xd.to(DEV, torch.float64), wd.to(DEV, torch.float64)
    ref = xd @ wd.T
    bound = xd.abs() @ wd.abs().T
    tol = bound * ACC_BOUND + 1e-30
    if d.dtype == torch.bfloat16:
        tol = tol + ulp(ref, torch.bfloat16)
    if not d.numel():
        return 0.0, 0.0
    return float(((d.double() - ref).abs() / tol).max()), calc_diff(d, ref)


def gemm_contiguous(groups, n, k, rows):
    from moe_ep import gemm
    from moe_ep.quant import dequant_fp8, per_token_group_quant_fp8

    wq, ws, wd = _weights(groups, n, k, 1)
    align = gemm.get_m_alignment_for_contiguous_layout()
    counts = [max(0, rows + (17 * g) % 37 - 18) for g in range(groups)]
    m = sum(-(-c // align) * align for c in counts)
    x = (torch.randn(m, k, generator=_gen(2)) * 4).to(torch.bfloat16)
    idx = torch.full((m,), -1, dtype=torch.int32)
    start = 0
    for g, c in enumerate(counts):
        idx[start:start + c] = g
        start += -(-c // align) * align
    xq, xs = per_token_group_quant_fp8(x.to(DEV), tma_aligned_scales=True)
    d = torch.full((m, n), 7.0, dtype=torch.bfloat16, device=DEV)
    gemm.m_grouped_fp8_gemm_nt_contiguous((xq, xs), (wq.to(DEV), ws.to(DEV)), d, idx.to(DEV))
    xd = dequant_fp8(xq, xs.contiguous()).float()
    worst, diff, start = 0.0, 0.0, 0
    for g, c in enumerate(counts):
        e, cd = _gemm_err(d[start:start + c], xd[start:start + c], wd[g])
        worst, diff = max(worst, e), max(diff, cd)
        start += -(-c // align) * align
    pad_zero = bool((d[idx.to(DEV) < 0] == 0).all())
    return {"ok": worst <= 1 and diff < 1e-3 and pad_zero,
            "detail": f"err/bound {worst:.3f} (<= 1, bound {ACC_BOUND:.1e}), calc_diff {diff:.1e} (< 1e-3), padding "
            f"zero {pad_zero}", "rows": m}


def gemm_masked(groups, n, k, t):
    from moe_ep import gemm
    from moe_ep.quant import dequant_fp8, per_token_group_quant_fp8

    wq, ws, wd = _weights(groups, n, k, 3)
    x = (torch.randn(groups, t, k, generator=_gen(4)) * 4).to(torch.bfloat16)
    masked = torch.tensor([(t * (g + 1)) // groups - (g % 2) for g in range(groups)], dtype=torch.int32).clamp(0, t)
    xq, xs = per_token_group_quant_fp8(x.to(DEV), column_major_scales=True, tma_aligned_scales=True)
    d = torch.full((groups, t, n), 7.0, dtype=torch.bfloat16, device=DEV)
    gemm.m_grouped_fp8_gemm_nt_masked((xq, xs), (wq.to(DEV), ws.to(DEV)), d, masked.to(DEV), t)
    worst, diff, untouched = 0.0, 0.0, True
    for g in range(groups):
        c = int(masked[g])
        xd = dequant_fp8(xq[g, :c], xs[g, :c].contiguous()).float()
        e, cd = _gemm_err(d[g, :c], xd, wd[g])
        worst, diff = max(worst, e), max(diff, cd)
        untouched &= bool((d[g, c:] == 7.0).all())
    return {"ok": worst <= 1 and diff < 1e-3 and untouched,
            "detail": f"err/bound {worst:.3f} (<= 1, bound {ACC_BOUND:.1e}), calc_diff {diff:.1e} (< 1e-3), rows past "
            f"masked_m untouched {untouched}"}


# ------------------------------------------------------------------------------ dispatch / combine
LL_FORMATS = {"bf16": (False, False, False), "fp8": (True, False, False), "ue8m0": (True, True, True)}


def _ll_paths(world, T, H, E, K):
    from moe_ep.backends.symm_ll import SymmLowLatency
    from moe_ep.symm import create_virtual_symm_buffers

    bufs = create_virtual_symm_buffers(world, SymmLowLatency.size_hint(T, H, world, E, K),
                                       SymmLowLatency.num_signals(world), device=DEV, timeout_s=30)
    return bufs, [SymmLowLatency(b, owner=0) for b in bufs]


def low_latency(world, T, H, E, K, fmt, combine_fmt=None):
    """Dispatch + combine of ``world`` virtual ranks (two steps: the signals must come back to zero) against
    ref_low_latency_dispatch / ref_low_latency_combine, bitwise; ``combine_fmt``: a low-bit combine format."""
    from moe_ep.testing.inputs import make_all_inputs
    from moe_ep.testing.refs import ref_low_latency_combine, ref_low_latency_dispatch
    from moe_ep.backends.symm_ll import virtual_low_latency_step

    use_fp8, rs, ue = LL_FORMATS[fmt]
    bufs, paths = _ll_paths(world, T, H, E, K)
    for step, n in enumerate(([T] * world, [T if r % 3 == 0 else (r * 7) % (T + 1) for r in range(world)])):
        inputs = make_all_inputs(world, n, H, E, K, 40 + step)
        xs, idxs, ws = [i.x for i in inputs], [i.topk_idx for i in inputs], [i.topk_weights for i in inputs]
        refs = [ref_low_latency_dispatch(r, xs, idxs, T, E, use_fp8, rs, ue) for r in range(world)]
        # stand-in expert outputs: each rank's received rows (FP8 codes as values) times rank + 1
        ys = [refs[r][0].float().mul(r + 1).to(torch.bfloat16) for r in range(world)]
        ys_dev = [y.to(DEV) for y in ys]
        results, outs = virtual_low_latency_step(
            paths, [x.to(DEV) for x in xs], [i.to(DEV) for i in idxs], [w.to(DEV) for w in ws], T, E,
            use_fp8=use_fp8, round_scale=rs, use_ue8m0=ue, expert_fn=lambda r, _res: ys_dev[r], fmt=combine_fmt)
        for r, b in enumerate(bufs):
            b.check_status("lease step", blocking=True)
            if int(b.signals.abs().sum()) != 0:
                return _fail(f"step {step} rank {r}: signal words not back to zero")
            ex_x, ex_s, ex_count, _ = refs[r]
            if not _bitwise(results[r].recv_count, ex_count):
                return _fail(f"step {step} rank {r}: recv_count")
            for e in range(E // world):
                c = int(ex_count[e])
                if not _bitwise(results[r].recv_x[e, :c], ex_x[e, :c]):
                    return _fail(f"step {step} rank {r} expert {e}: recv_x")
                if use_fp8 and not _bitwise(results[r].recv_x_scales[e, :c].contiguous(), ex_s[e, :c].contiguous()):
                    return _fail(f"step {step} rank {r} expert {e}: scales")
            want = ref_low_latency_combine(r, ys, idxs, ws, T, E, fmt=combine_fmt)
            got = outs[r].cpu()
            if not _bitwise(got.masked_fill(got.isnan(), 0), want.masked_fill(want.isnan(), 0)):
                return _fail(f"step {step} rank {r}: combined_x")
    return {"detail": "bitwise, 2 steps, signals reset"}


def normal(world, N, H, E, K, fp8):
    """symm normal-mode dispatch + combine on virtual ranks against ref_dispatch / ref_combine."""
    from moe_ep.backends.symm import SymmBackend, virtual_backends
    from moe_ep.testing.inputs import make_all_inputs
    from moe_ep.testing.refs import ref_combine, ref_dispatch

    bs = virtual_backends(world, num_nvl_bytes=SymmBackend.get_normal_size_hint(N, H, K, world), device=DEV,
                          timeout_s=30)
    inputs = make_all_inputs(world, [N if r != 1 else N // 3 for r in range(world)], H, E, K, 7)
    xs, idxs, ws = [i.x for i in inputs], [i.topk_idx for i in inputs], [i.topk_weights for i in inputs]
    layouts = [b.get_dispatch_layout(i.to(DEV), E) for b, i in zip(bs, idxs)]
    st = []
    for b, inp, lay in zip(bs, inputs, layouts):
        x, s = (inp.x_fp8, inp.x_scales) if fp8 else (inp.x, None)
        st.append(b.dispatch_send(x.to(DEV), s.to(DEV) if s is not None else None, handle=None,
                                  num_tokens_per_rank=lay[0], is_token_in_rank=lay[3], num_tokens_per_expert=lay[2],
                                  topk_idx=inp.topk_idx.to(DEV), topk_weights=inp.topk_weights.to(DEV), num_experts=E))
    res = [b.dispatch_recv(s, expert_alignment=1, num_worst_tokens=0) for b, s in zip(bs, st)]
    ys = []
    for r, out in enumerate(res):
        rx = [i.x_fp8 for i in inputs] if fp8 else xs
        ex = ref_dispatch(r, rx, idxs, ws, E, [i.x_scales for i in inputs] if fp8 else None)
        n = ex[0].shape[0]
        if not _bitwise(out.recv_x[:n], ex[0]):
            return _fail(f"rank {r}: recv_x ({tuple(out.recv_x.shape)} vs {tuple(ex[0].shape)})")
        if fp8 and not _bitwise(out.recv_x_scales[:n].contiguous(), ex[1]):
            return _fail(f"rank {r}: scales")
        if not (_bitwise(out.recv_topk_idx[:n], ex[2]) and _bitwise(out.recv_topk_weights[:n], ex[3])):
            return _fail(f"rank {r}: recv_topk_idx / weights")
        if list(out.num_recv_tokens_per_expert_list) != list(ex[4]):
            return _fail(f"rank {r}: num_recv_tokens_per_expert_list")
        ys.append((ex[0].float() * (r + 1)).to(torch.bfloat16))
    cst = [b.combine_send(y.to(DEV), o.handle, o.recv_topk_weights) for b, y, o in zip(bs, ys, res)]
    comb = [b.combine_recv(s, ()) for b, s in zip(bs, cst)]
    for r, c in enumerate(comb):
        want, _ = ref_combine(r, ys, idxs, E, [o.recv_topk_weights.cpu() for o in res])
        got = (c[0] if isinstance(c, tuple) else c).cpu()
        if not _bitwise(got, want):
            return _fail(f"rank {r}: combined_x")
    return {"detail": "bitwise (rows, scales, top-k, per-expert counts, combine)"}


# ------------------------------------------------------------------------------------------ others
def expand(m, n, hidden):
    from moe_ep.deepep.v2.expand import gather_rows
    from moe_ep.fp8 import FP8_DTYPE
    from moe_ep.kernels.expand import expand_rows

    g = _gen(m)
    t = torch.randn(m, hidden, generator=g).to(FP8_DTYPE)
    src = torch.randint(0, m, (n,), generator=g)
    src[torch.rand(n, generator=g) < 0.3] = -1
    ks = torch.randint(0, 8, (n,), generator=g)
    w = torch.randn(m, 8, generator=g)
    got, got_w = expand_rows(t.to(DEV), src.to(DEV), True, w.to(DEV), ks.to(DEV))
    ok = _bitwise(got, gather_rows(t, src, True)) and _bitwise(got_w, torch.where(src >= 0, w[src.clamp(min=0), ks], 0.0))
    return {"ok": ok, "detail": "bitwise vs the torch gather" if ok else "differs from the torch gather"}


def _placement(E, P, G, seed):
    import numpy as np

    import eplb

    rng = np.random.default_rng(seed)
    w = rng.random((1, E)) ** 3 * 100
    _, log2phy, logcnt = eplb.rebalance_experts(w, P, 1, 1, G)
    return log2phy[0], logcnt[0]


def map_topk(n, E, K, P, G):
    import eplb
    from eplb.dispatch import POLICIES

    log2phy, logcnt = _placement(E, P, G, 0)
    topk = torch.randint(0, E, (n, K), generator=_gen(n))
    bad = []
    for policy in POLICIES:
        kw = dict(seed=3, num_gpus=G, num_slots=P)
        a = eplb.map_topk(topk, log2phy, logcnt, policy, impl="torch", **kw)
        b = eplb.map_topk(topk.to(DEV), log2phy.to(DEV), logcnt.to(DEV), policy, impl="triton",
                          max_replicas=int(logcnt.max()), **kw)
        if not _bitwise(a, b):
            bad.append(policy)
    return {"ok": not bad, "detail": f"policies differing from torch: {bad}" if bad else f"bitwise, {len(POLICIES)} policies"}


def mega_moe(T, H, inter, E, K):
    """fp8_mega_moe on a one-rank group (the world one GPU holds) against the emulated-FP8 reference."""
    import torch.distributed as dist

    from moe_ep.gemm import fp8_mega_moe, get_symm_buffer_for_mega_moe, transform_weights_for_mega_moe
    from moe_ep.quant import per_block_quant_fp8, per_token_group_quant_fp8
    from moe_ep.testing.inputs import make_expert_weights
    from moe_ep.testing.refs import ref_moe

    if not dist.is_initialized():
        dist.init_process_group("gloo" if DEV.type == "cpu" else "nccl", init_method="tcp://127.0.0.1:29531",
                                rank=0, world_size=1)
    w13, w2 = (w.to(DEV) for w in make_expert_weights(E, H, inter, 5))
    l1, l2 = per_block_quant_fp8(w13), per_block_quant_fp8(w2)
    buf = get_symm_buffer_for_mega_moe(None, E, T, K, H, inter, device=DEV, timeout_s=30)
    g = _gen(T)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    q, s = per_token_group_quant_fp8(x.to(DEV))
    buf.x[:T].copy_(q)
    buf.x_sf[:T].copy_(s)
    buf.topk_idx[:T].copy_(idx.to(DEV))
    buf.topk_weights[:T].copy_(w.to(DEV))
    tl1, tl2 = transform_weights_for_mega_moe(l1, l2)
    y = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=DEV)
    fp8_mega_moe(y, tl1, tl2, buf)
    emulated, _dense = ref_moe(x.to(DEV), idx.to(DEV), w.to(DEV), w13, w2, l1, l2, None)
    scale = max(float(emulated.abs().max()), 1e-6)
    err = float((y.double() - emulated.double()).abs().max()) / scale
    buf.destroy()
    return {"ok": err < 1e-2 and bool(y.isfinite().all()), "detail": f"rel err vs emulated FP8 {err:.2e} (< 1e-2)"}


def check_cases(shapes: str):
    """(name, fn, kwargs) of one shape set, in priority order."""
    out = []
    for s in [shapes]:
        c = SHAPES[s]
        world, T, H, E, K, inter, M = (c[k] for k in ("world", "T", "H", "E", "K", "I", "M"))
        for layout in QUANT_LAYOUTS:
            out.append((f"quant {layout} {M}x{H}", quant, dict(m=M, k=H, layout=layout)))
        out.append((f"silu_quant {M}x{2 * inter}", silu_quant, dict(m=M, i=inter)))
        groups = E // world
        out.append((f"gemm contiguous G{groups} {2 * inter}x{H}", gemm_contiguous, dict(groups=groups, n=2 * inter, k=H,
                                                                                  rows=max(M // groups, 8))))
        out.append((f"gemm masked G{groups} {H}x{inter} T{world * T}", gemm_masked, dict(groups=groups, n=H, k=inter,
                                                                                     t=world * T)))
        # DeepSeek-V3: one format here (the torch references loop on the host); pytest-gpu runs the others
        for fmt in LL_FORMATS if s != "dsv3" else ["fp8"]:
            out.append((f"ll {fmt} EP{world} T{T} H{H}", low_latency, dict(world=world, T=T, H=H, E=E, K=K, fmt=fmt)))
        for cf in ("fp8", "logfmt") if s != "dsv3" else []:  # DeepSeek-V3 combine formats: pytest-gpu
            out.append((f"ll combine {cf} EP{world} T{T}", low_latency, dict(world=world, T=T, H=H, E=E, K=K,
                                                                              fmt="bf16", combine_fmt=_wire(cf))))
        n_norm = 4 * T if s != "dsv3" else 256  # the host reference loops over every route
        for fp8 in (False, True):
            out.append((f"normal {'fp8' if fp8 else 'bf16'} EP{world} N{n_norm}", normal,
                        dict(world=world, N=n_norm, H=H, E=E, K=K, fp8=fp8)))
        out.append((f"expand {M} rows H{H}", expand, dict(m=M, n=2 * M, hidden=H)))
        out.append((f"map_topk {M}x{K} E{E}", map_topk, dict(n=M, E=E, K=K, P=E + 2 * world,
                                                              G=world)))
        # one rank holds E/world experts; at DeepSeek-V3 hidden size 8 experts of I=512 keep the host reference short
        mE, mI = (8, 512) if s == "dsv3" else (E // world, inter)
        out.append((f"mega_moe 1 rank T{min(T, 32)} E{mE} H{H} I{mI}", mega_moe,
                    dict(T=min(T, 32), H=H, inter=mI, E=mE, K=min(K, mE // 2))))
    return out


def _wire(name):
    from moe_ep.kernels.logfmt import FORMATS

    return FORMATS[name]
