"""Mega MoE (moe_ep.gemm.fp8_mega_moe) on 2 and 4 forked CPU ranks: the phased launches of the one kernel source
across processes sharing a POSIX shared-memory heap, and the fused launch with a grid of one program.

References, each rank for its own tokens:
- ``emulated``: the expert-path numerics in torch (FP8 inputs and weights dequantized, GEMMs in float64, GEMM1's
  output rounded to BF16, SiLU-and-mul quantized by the torch reference, GEMM2's output rounded to BF16, weighted
  sum in float64): within 1e-2 of max|dense| (what is left: BF16 roundings and the odd e4m3 tie).
- ``dense``: float32 weights and activations, no FP8 anywhere: within 0.12 of max|dense| (FP8's price: 7-8% seen
  with I = 256, the same as the expert-path layer's, to which the result is bitwise equal here).
- the expert-path layer (``MoELayer``, decode mode over the ``symm`` backend, same FP8 inputs): within 1e-2 (the
  GEMM's swap-AB order and float32 sums differ; BF16 roundings follow).
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from moe_ep.testing import launch
from moe_ep.testing.inputs import make_expert_weights
from moe_ep.testing.refs import ref_moe

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU ranks run the Triton kernels in the interpreter")

HIDDEN, INTER = 256, 256


def _weights(num_experts: int, seed: int):
    return make_expert_weights(num_experts, HIDDEN, INTER, seed)


def _routing(rank: int, n: int, num_experts: int, k: int, seed: int, kind: str):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randn(n, HIDDEN, generator=g).to(torch.bfloat16)
    if kind == "one_rank":  # every token's experts all live on rank 0; the other ranks' experts get nothing
        idx = torch.stack([torch.randperm(num_experts // 2, generator=g)[:k] for _ in range(n)]) if n else None
    elif kind == "skewed":  # most selections go to expert 1
        idx = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(n)]) if n else None
        if n:
            idx[:, 0] = 1
            idx[:, 1:] = torch.where(idx[:, 1:] == 1, 0, idx[:, 1:])
    else:
        idx = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(n)]) if n else None
    if idx is None:
        idx = torch.empty(0, k, dtype=torch.int64)
    if n > 2:
        idx[1, -1] = -1
        idx[2, :] = -1  # a token with no expert at all
    w = torch.rand(n, k, generator=g)
    return x, idx.to(torch.int64), w


def _references(x, idx, w, w13, w2, clamp=None):
    from moe_ep.quant import per_block_quant_fp8

    return ref_moe(x, idx, w, w13, w2, per_block_quant_fp8(w13), per_block_quant_fp8(w2), clamp)


def _errors(out, emulated, dense) -> dict:
    scale = max(float(dense.abs().max()), 1e-6)
    return {"emulated": float((out.double() - emulated).abs().max()) / scale,
            "dense": float((out.double() - dense).abs().max()) / scale}


def _fill(buf, x, idx, w):
    from moe_ep.quant import per_token_group_quant_fp8

    n = x.shape[0]
    if n:
        q, s = per_token_group_quant_fp8(x)
        buf.x[:n].copy_(q)
        buf.x_sf[:n].copy_(s)
        buf.topk_idx[:n].copy_(idx)
        buf.topk_weights[:n].copy_(w)


def _local_weights(rank, world, num_experts, seed):
    from moe_ep.gemm import transform_weights_for_mega_moe
    from moe_ep.quant import per_block_quant_fp8

    w13, w2 = _weights(num_experts, seed)
    L = num_experts // world
    l1 = per_block_quant_fp8(w13[rank * L:(rank + 1) * L])
    l2 = per_block_quant_fp8(w2[rank * L:(rank + 1) * L])
    return (w13, w2), transform_weights_for_mega_moe(l1, l2)


def _mega_rank(rank: int, world: int, case: dict) -> dict:
    from moe_ep.gemm import fp8_mega_moe, get_symm_buffer_for_mega_moe
    from moe_ep.testing.traps import host_reads_trapped

    E, k, ns, seed = case["E"], case["k"], case["n"], case["seed"]
    n = ns[rank]
    T = max(max(ns), 1)
    (w13, w2), (l1, l2) = _local_weights(rank, world, E, seed)
    buf = get_symm_buffer_for_mega_moe(None, E, T, k, HIDDEN, INTER, timeout_s=60)
    x, idx, w = _routing(rank, n, E, k, seed, case.get("routing", "random"))
    _fill(buf, x, idx, w)
    stats = torch.zeros(E // world, dtype=torch.int32)
    outs = []
    for mode in case.get("modes", ("phased",)):
        y = torch.full((n, HIDDEN), float("nan"), dtype=torch.bfloat16)  # poisoned: every row must be written
        with host_reads_trapped():  # nothing reads the device on the host (CUDA-graph safe)
            fp8_mega_moe(y, l1, l2, buf, cumulative_local_expert_recv_stats=stats,
                         activation_clamp=case.get("clamp"), mode=mode)
        outs.append(y)
    res = {"modes": list(case.get("modes", ("phased",))), "n": n,
           "same": [bool(torch.equal(o.view(torch.int16), outs[0].view(torch.int16))) for o in outs],
           "finite": bool(all(o.isfinite().all() for o in outs)), "stats": stats.tolist(),
           "signals_zero": bool((buf.symm.signals == 0).all())}
    if n:
        res.update(_errors(outs[0], *_references(x, idx, w, w13, w2, case.get("clamp"))))
    if case.get("layer"):
        res["layer"] = _layer_diff(rank, world, case, x, idx, w, outs[0], T)
    buf.destroy()
    return res


def _layer_diff(rank, world, case, x, idx, w, out, T) -> float:
    import moe_ep
    from moe_ep.backends.symm import SymmBackend
    from moe_ep.layer.experts import ExpertWeights
    from moe_ep.layer.moe import MoELayer

    E, k = case["E"], case["k"]
    w13, w2 = _weights(E, case["seed"])
    L = E // world
    weights = ExpertWeights.from_float(w13[rank * L:(rank + 1) * L], w2[rank * L:(rank + 1) * L])
    buf = moe_ep.Buffer(None, low_latency_mode=True, backend="symm", timeout_s=60, explicitly_destroy=True,
                        num_rdma_bytes=SymmBackend.get_low_latency_size_hint(T, HIDDEN, world, E, k))
    ref = MoELayer(buf, weights, E, mode="decode", num_max_dispatch_tokens_per_rank=T)(x, idx, w)
    buf.destroy()
    if x.shape[0] == 0:
        return 0.0
    return float((out.double() - ref.double()).abs().max()) / max(float(ref.double().abs().max()), 1e-6)


def _expected_stats(world, case):
    E, k = case["E"], case["k"]
    counts = torch.zeros(E, dtype=torch.int64)
    for r in range(world):
        _, idx, _ = _routing(r, case["n"][r], E, k, case["seed"], case.get("routing", "random"))
        for e in idx.flatten().tolist():
            if e >= 0:
                counts[e] += 1
    return counts * len(case.get("modes", ("phased",)))


def _check(world, case, results):
    L = case["E"] // world
    expect = _expected_stats(world, case)
    for rank, r in enumerate(results):
        assert r["finite"], r
        assert all(r["same"]), f"rank {rank}: modes {r['modes']} differ bitwise"
        assert r["signals_zero"], f"rank {rank}: signal words left set after the call"
        assert r["stats"] == expect[rank * L:(rank + 1) * L].tolist(), (rank, r["stats"])
        if r["n"]:
            assert r["emulated"] < 1e-2, f"rank {rank}: {r}"
            assert r["dense"] < 0.12, f"rank {rank}: {r}"
        if "layer" in r:
            assert r["layer"] < 1e-2, f"rank {rank}: vs MoELayer {r['layer']}"


def test_phased_two_ranks_matches_references_and_layer():
    # two phased calls (the second must find every counter reset) and the fused launch with a grid of one program
    case = dict(n=[6, 5], E=4, k=2, seed=3, layer=True, modes=("phased", "phased", "fused"))
    _check(2, case, launch(_mega_rank, 2, case, timeout_s=300))


def test_four_ranks_zero_token_rank_holes_and_fused():
    # rank 1 has no tokens; -1 entries and a token with no expert; fused (grid 1) equals phased bitwise
    case = dict(n=[5, 0, 7, 2], E=8, k=3, seed=11, modes=("phased", "fused"))
    _check(4, case, launch(_mega_rank, 4, case, timeout_s=300))


@pytest.mark.parametrize("world,n,E,k,routing", [
    (2, [7, 4], 4, 2, "one_rank"),  # every token's experts on rank 0: rank 1's experts are chosen by nobody
    (4, [9, 3, 1, 6], 8, 2, "skewed"),  # most selections on expert 1 (several row blocks), the rest sparse
])
def test_imbalanced_routing(world, n, E, k, routing):
    case = dict(n=n, E=E, k=k, seed=5 + world, routing=routing)
    _check(world, case, launch(_mega_rank, world, case, timeout_s=300))


def test_activation_clamp():
    case = dict(n=[6, 4], E=4, k=2, seed=9, clamp=0.25)
    _check(2, case, launch(_mega_rank, 2, case, timeout_s=300))


# ---------------------------------------------------------------------------------------------- bad input, failures
def _bad_inputs(rank: int, world: int) -> list:
    from moe_ep.gemm import fp8_mega_moe, get_symm_buffer_for_mega_moe
    from moe_ep.quant import per_block_quant_fp8

    E, k, T = 4, 2, 4
    (w13, w2), (l1, l2) = _local_weights(rank, world, E, 1)
    buf = get_symm_buffer_for_mega_moe(None, E, T, k, HIDDEN, INTER, timeout_s=20)
    x, idx, w = _routing(rank, 3, E, k, 1, "random")
    _fill(buf, x, idx, w)
    comb = buf.symm.buffer[buf.layout["comb"]:]
    comb.fill_(0x5A)  # poison: a rank that wrote anything would change it
    y = torch.empty(3, HIDDEN, dtype=torch.bfloat16)
    other = per_block_quant_fp8(torch.randn(E // world, 2 * INTER, 2 * HIDDEN))  # built for another hidden
    bad = {
        "n > T": lambda: fp8_mega_moe(torch.empty(T + 1, HIDDEN, dtype=torch.bfloat16), l1, l2, buf),
        "y dtype": lambda: fp8_mega_moe(y.float(), l1, l2, buf),
        "y hidden": lambda: fp8_mega_moe(torch.empty(3, 2 * HIDDEN, dtype=torch.bfloat16), l1, l2, buf),
        "weights for other sizes": lambda: fp8_mega_moe(y, other, l2, buf),
        "weight dtype": lambda: fp8_mega_moe(y, (l1[0].float(), l1[1]), l2, buf),
        "weight scales": lambda: fp8_mega_moe(y, (l1[0], l1[1][:, :1]), l2, buf),
        "activation": lambda: fp8_mega_moe(y, l1, l2, buf, activation="gelu"),
        "clamp": lambda: fp8_mega_moe(y, l1, l2, buf, activation_clamp=-1.0),
        "stats": lambda: fp8_mega_moe(y, l1, l2, buf, torch.zeros(E // world, dtype=torch.int64)),
        "buffer": lambda: fp8_mega_moe(y, l1, l2, object()),
        "mode": lambda: fp8_mega_moe(y, l1, l2, buf, mode="eager"),
        "mma_type": lambda: get_symm_buffer_for_mega_moe(None, E, T, k, HIDDEN, INTER, mma_type="fp8xfp4"),
        "hidden % 128": lambda: get_symm_buffer_for_mega_moe(None, E, T, k, 200, INTER),
        "experts % ranks": lambda: get_symm_buffer_for_mega_moe(None, 3, T, k, HIDDEN, INTER),
        "ranks disagree": lambda: get_symm_buffer_for_mega_moe(None, E, T + rank, k, HIDDEN, INTER),
    }
    out = []
    for name, call in bad.items():
        try:
            call()
            out.append((name, "no error"))
        except (ValueError, TypeError) as exc:
            out.append((name, type(exc).__name__))
    untouched = bool((comb == 0x5A).all()) and bool((buf.symm.signals == 0).all())
    # the buffer is still fine: a good call afterwards works
    fp8_mega_moe(y, l1, l2, buf)
    emulated, dense = _references(x, idx, w, w13, w2)
    return out, untouched, _errors(y, emulated, dense)["emulated"]


def test_bad_input_raises_before_any_rank_writes():
    for out, untouched, err in launch(_bad_inputs, 2, timeout_s=300):
        assert all(kind in ("ValueError", "TypeError") for _, kind in out), out
        assert untouched, "a refused call wrote into the symmetric buffer"
        assert err < 1e-2, err


def _missing_rank(rank: int, world: int):
    from moe_ep import RankTimeoutError
    from moe_ep.gemm import fp8_mega_moe, get_symm_buffer_for_mega_moe

    E, k, n = 2 * world, 2, 3
    _, (l1, l2) = _local_weights(rank, world, E, 2)
    buf = get_symm_buffer_for_mega_moe(None, E, n, k, HIDDEN, INTER, timeout_s=1.0)
    x, idx, w = _routing(rank, n, E, k, 2, "random")
    _fill(buf, x, idx, w)
    if rank == world - 1:
        return "skipped the call"
    y = torch.zeros(n, HIDDEN, dtype=torch.bfloat16)
    start = time.monotonic()
    try:
        fp8_mega_moe(y, l1, l2, buf)
        return "no error", "", 0.0, False
    except RankTimeoutError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start, bool(torch.isnan(y.float()).all())


def test_missing_rank_times_out_naming_it():
    *alive, skipped = launch(_missing_rank, 3, timeout_s=120)
    assert skipped == "skipped the call"
    for kind, msg, secs, all_nan in alive:
        assert kind == "RankTimeoutError" and "[2]" in msg, msg
        assert secs < 10, f"one timeout per missing rank (timeout_s=1), not one per wait: {secs:.1f} s"
        assert all_nan, "an output that missed a rank must be NaN, never plausible partial sums"


def _routing_flags(rank: int, world: int, what: str):
    from moe_ep.gemm import fp8_mega_moe, get_symm_buffer_for_mega_moe

    E, k, n = 4, 2, 2
    _, (l1, l2) = _local_weights(rank, world, E, 4)
    buf = get_symm_buffer_for_mega_moe(None, E, n, k, HIDDEN, INTER, timeout_s=20)
    x, idx, w = _routing(rank, n, E, k, 4, "random")
    if rank == 0:
        idx = torch.tensor([[E, 0], [1, 2]]) if what == "bad_expert" else torch.tensor([[0, 0], [0, 0]])
    _fill(buf, x, idx, w)
    y = torch.zeros(n, HIDDEN, dtype=torch.bfloat16)
    try:
        fp8_mega_moe(y, l1, l2, buf)
        return "ok", "", bool(y.isfinite().all())
    except RuntimeError as exc:
        return type(exc).__name__, str(exc), bool(y.isfinite().all())


@pytest.mark.parametrize("what", ["bad_expert", "repeated_expert"])
def test_bad_routing_is_reported_by_the_device(what):
    (kind0, msg0, _), (kind1, _, finite1) = launch(_routing_flags, 2, what, timeout_s=120)
    assert kind0 == "RuntimeError", (kind0, msg0)
    assert ("num_experts" if what == "bad_expert" else "repeated") in msg0, msg0
    assert kind1 == "ok" and finite1, "the other rank's call is unaffected"


def test_host_module_imports_without_triton():
    """The host module imports its kernels on first launch, never at import time (the package it lives in,
    moe_ep.gemm, loads Triton for its GEMMs; ``import moe_ep`` loads neither)."""
    import ast
    import subprocess
    import sys

    import moe_ep.gemm.mega_moe as host

    code = ("import sys, moe_ep; assert 'triton' not in sys.modules, 'triton loaded'; "
            "assert 'moe_ep.gemm.mega_moe' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "TRITON_INTERPRET": "1"})
    with open(host.__file__) as f:
        tree = ast.parse(f.read())
    top = [n.module or "" for n in tree.body if isinstance(n, ast.ImportFrom)]
    top += [a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in top if m.split(".")[0] == "triton" or "kernels" in m.split(".")], top
