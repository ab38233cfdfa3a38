"""All-reduce (flat / tree / hierarchical / ps) and node-aware dispatch/combine on an emulated two-host
cluster (network namespaces, shaped veth; moe_ep.testing.netns) and on plain loopback.

    python perf/bench_collectives.py                       # 2 hosts x 2 ranks at 1 Gbit/s, and loopback
    python perf/bench_collectives.py --cpu-smoke           # tiny sizes, seconds
    python perf/bench_collectives.py --rate 100mbit --json out.jsonl --plot out.png

All-reduce rows: ``us | algbw GB/s | busbw GB/s | bytes A->B per call | model us | x ps``; busbw follows
nccl-tests (algbw * 2(P-1)/P). "bytes A->B" is what host A's veth transmitted per call (payload plus
TCP/IP headers and the arrival check's store traffic); ``-`` on loopback. Dispatch rows: normal-mode
dispatch + combine time and bytes across the host boundary, flat torch backend vs TorchHierBackend,
with DeepSeek-V3-like routing (top-8 of 256 experts, at most 4 nodes per token; sizes shrunk for CPU).
"""

from __future__ import annotations

import datetime
import os
import platform
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

ALGOS = ("flat", "tree", "hierarchical", "ps")
DTYPES = {"bf16": torch.bfloat16, "float32": torch.float32}


# ---------------------------------------------------------------------------------------- rank side
def allreduce_worker(rank, world, ranks_per_node, hidden, tokens, dtypes, iters, rate_bytes_s):
    import torch.distributed as dist

    from moe_ep.collectives import Tiers, all_reduce, inter_node_bytes, predict_time
    from moe_ep.testing.netns import link_bytes

    G, H = ranks_per_node, world // ranks_per_node
    tiers = Tiers(bw_inter=rate_bytes_s) if rate_bytes_s else Tiers(alpha_inter=10e-6, bw_inter=10e9)
    rows = []
    for dname in dtypes:
        dtype = DTYPES[dname]
        for n in tokens:
            x0 = torch.randn(n, hidden).to(dtype)
            nbytes = x0.numel() * x0.element_size()
            reps = max(1, min(iters, int(iters * 2e6 / max(nbytes, 1)) or 1))
            for algo in ALGOS:
                x = x0.clone()
                all_reduce(x, algorithm=algo, ranks_per_node=G)  # warm-up (and group creation)
                dist.barrier()
                before = link_bytes()
                t0 = time.perf_counter()
                for _ in range(reps):
                    all_reduce(x, algorithm=algo, ranks_per_node=G)
                dt = (time.perf_counter() - t0) / reps
                dist.barrier()  # NOTES: a send returns once buffered; the counters are read after delivery
                after = link_bytes()
                t = torch.tensor([dt], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                rows.append(dict(kind="all_reduce", algorithm=algo, dtype=dname, tokens=n, hidden=hidden,
                                 bytes=nbytes, us=t.item() * 1e6, reps=reps,
                                 cross_bytes=None if before is None else (after[0] - before[0]) / reps,
                                 model_cross_bytes=inter_node_bytes(algo, nbytes, G, H),
                                 model_us=predict_time(algo, nbytes, G, H, tiers) * 1e6))
    return rows if rank == 0 else None


def _deepseek_routing(n, num_experts, k, num_nodes, max_nodes, gen):
    """Node-limited top-k: pick the best ``max_nodes`` nodes by their best expert score, then the top-k
    experts inside them (DeepSeek-V3's device-limited routing, random scores)."""
    scores = torch.rand(n, num_experts, generator=gen)
    per_node = scores.view(n, num_nodes, -1)
    best_nodes = per_node.max(2).values.topk(min(max_nodes, num_nodes), dim=1).indices
    keep = torch.zeros(n, num_nodes, dtype=torch.bool).scatter_(1, best_nodes, True)
    masked = torch.where(keep.repeat_interleave(num_experts // num_nodes, 1), scores, torch.full_like(scores, -1))
    w, idx = masked.topk(k, dim=1)
    return idx, (w / w.sum(1, keepdim=True)).float()


def dispatch_worker(rank, world, ranks_per_node, hidden, tokens, iters, num_experts, topk, max_nodes):
    import torch.distributed as dist

    import moe_ep
    from moe_ep.backends.torch_hier import TorchHierBackend
    from moe_ep.testing.netns import link_bytes

    G, H = ranks_per_node, world // ranks_per_node
    flat = moe_ep.Buffer(None, backend="torch", timeout_s=120)
    hier = moe_ep.Buffer(None, backend="torch", timeout_s=120)
    hier._impl = TorchHierBackend(hier.group, hier.rank, hier.group_size, num_nvl_bytes=0, num_rdma_bytes=0,
                                  low_latency_mode=False, timeout_s=120, ranks_per_node=G)
    rows = []
    for n in tokens:
        gen = torch.Generator().manual_seed(1000 + rank)
        x = torch.randn(n, hidden, generator=gen).to(torch.bfloat16)
        idx, w = _deepseek_routing(n, num_experts, topk, H, max_nodes, gen)
        outs = {}
        for name, buf in (("flat", flat), ("node-aware", hier)):
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)

            def step():
                rx, _, rw, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                       num_tokens_per_expert=per_expert, topk_idx=idx,
                                                       topk_weights=w)
                return buf.combine(rx, handle, topk_weights=rw)[0]

            outs[name] = step()  # warm-up
            dist.barrier()
            before = link_bytes()
            t0 = time.perf_counter()
            for _ in range(iters):
                step()
            dt = (time.perf_counter() - t0) / iters
            dist.barrier()
            after = link_bytes()
            t = torch.tensor([dt], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            # rows this rank sends across the host boundary per dispatch (combine returns as many)
            remote = torch.arange(world) // G != rank // G
            cross_rows = int(per_rank[remote].sum()) if name == "flat" else \
                int(in_rank.view(n, H, G).any(2)[:, torch.arange(H) != rank // G].sum())
            c = torch.tensor([cross_rows], dtype=torch.int64)
            dist.all_reduce(c)
            rows.append(dict(kind="dispatch_combine", path=name, tokens=n, hidden=hidden, experts=num_experts,
                             topk=topk, us=t.item() * 1e6, cross_rows=int(c), reps=iters,
                             cross_bytes=None if before is None else (after[0] - before[0]) / iters))
        diff = (outs["flat"].float() - outs["node-aware"].float()).abs().max().item()
        rows[-1]["max_abs_diff_vs_flat"] = diff
        rows[-1]["max_rel_diff_vs_flat"] = diff / max(outs["flat"].float().abs().max().item(), 1e-30)
    return rows if rank == 0 else None


# ---------------------------------------------------------------------------------------- driver side
def _rate_bytes(rate: str) -> float:
    units = {"kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8}
    for u, f in units.items():
        if rate.endswith(u):
            return float(rate[:-len(u)]) * f
    raise ValueError(f"rate must end in kbit/mbit/gbit, got {rate!r}")


def _fmt_bytes(b):
    return "-" if b is None else f"{b / 1e6:.3f} MB" if b >= 1e5 else f"{b / 1e3:.1f} kB"


def print_tables(rows, header):
    print(f"\n## {header}")
    ar = [r for r in rows if r["kind"] == "all_reduce"]
    if ar:
        world = ar[0]["world"]
        print("| dtype | tokens | MB | algorithm | us | algbw GB/s | busbw GB/s | bytes A->B / call | model A->B "
              "| model us | x ps |")
        print("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in ar:
            ps = next(q for q in ar if q["dtype"] == r["dtype"] and q["tokens"] == r["tokens"] and q["algorithm"] == "ps")
            alg = r["bytes"] / (r["us"] * 1e-6) / 1e9
            print(f"| {r['dtype']} | {r['tokens']} | {r['bytes'] / 1e6:.3f} | {r['algorithm']} | {r['us']:.0f} | "
                  f"{alg:.3f} | {alg * 2 * (world - 1) / world:.3f} | {_fmt_bytes(r['cross_bytes'])} | "
                  f"{_fmt_bytes(r['model_cross_bytes'])} | {r['model_us']:.0f} | {ps['us'] / r['us']:.2f} |")
    dc = [r for r in rows if r["kind"] == "dispatch_combine"]
    if dc:
        print("\n| tokens/rank | hidden | path | dispatch+combine us | rows across hosts | bytes across (A->B) "
              "/ step | x flat |")
        print("| ---: | ---: | --- | ---: | ---: | ---: | ---: |")
        for r in dc:
            f = next(q for q in dc if q["tokens"] == r["tokens"] and q["path"] == "flat")
            print(f"| {r['tokens']} | {r['hidden']} | {r['path']} | {r['us']:.0f} | {r['cross_rows']} | "
                  f"{_fmt_bytes(r['cross_bytes'])} | {f['us'] / r['us']:.2f} |")


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for cluster in sorted({r["cluster"] for r in rows if r["kind"] == "all_reduce"}):
        for algo in ALGOS:
            pts = [r for r in rows if r["kind"] == "all_reduce" and r["cluster"] == cluster and
                   r["algorithm"] == algo and r["dtype"] == "float32"]
            if pts:
                ax.loglog([p["bytes"] for p in pts], [p["us"] for p in pts], marker="o",
                          linestyle="-" if cluster == "netns" else ":", label=f"{algo} ({cluster})")
    ax.set_xlabel("message bytes (float32)")
    ax.set_ylabel("all-reduce us")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main(argv=None):
    import _common as C

    p = C.parser("bench_collectives.py", __doc__, smoke_help="tiny sizes")
    p.add_argument("--cluster", choices=("both", "netns", "loopback"), default="both",
                   help="two emulated hosts (network namespaces, needs root), plain loopback, or both")
    p.add_argument("--rate", default="1gbit", help="tc rate of the host link, each direction")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay on the host link (netem)")
    p.add_argument("--ranks-per-host", type=int, default=2, help="ranks in each emulated host")
    p.add_argument("--hidden", type=int, default=3200, help="all-reduce hidden (3200: LLaMA-3B)")
    p.add_argument("--tokens", default="1,16,128,512,2048", help="all-reduce rows (comma-separated)")
    p.add_argument("--dtypes", default="bf16,float32", help="all-reduce dtypes (comma-separated)")
    p.add_argument("--iters", type=int, default=5, help="timed repetitions per case")
    p.add_argument("--moe-hidden", type=int, default=1024, help="dispatch hidden (DeepSeek-V3: 7168; CPU: less)")
    p.add_argument("--moe-tokens", default="64,256", help="dispatch tokens per rank (comma-separated)")
    p.add_argument("--experts", type=int, default=256, help="routed experts")
    p.add_argument("--topk", type=int, default=8, help="experts per token")
    p.add_argument("--max-nodes", type=int, default=4, help="nodes a token may reach (DeepSeek-V3: 4)")
    p.add_argument("--skip-dispatch", action="store_true", help="all-reduce only")
    p.add_argument("--plot", default=None, help="PNG of all-reduce time vs size (needs matplotlib)")
    a = p.parse_args(argv)
    if a.cpu_smoke:
        a.tokens, a.dtypes, a.iters, a.moe_tokens, a.moe_hidden, a.hidden = "1,16", "float32", 2, "16", 256, 320

    from moe_ep.testing import netns

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the cluster's teardown runs
    G = a.ranks_per_host
    world = 2 * G
    ar_kw = dict(ranks_per_node=G, hidden=a.hidden, tokens=[int(t) for t in a.tokens.split(",")],
                 dtypes=a.dtypes.split(","), iters=a.iters)
    dc_kw = dict(ranks_per_node=G, hidden=a.moe_hidden, tokens=[int(t) for t in a.moe_tokens.split(",")],
                 iters=a.iters, num_experts=a.experts, topk=a.topk, max_nodes=a.max_nodes)
    me = os.path.abspath(__file__)
    stamp = dict(date=datetime.date.today().isoformat(), host=platform.node(), cpus=os.cpu_count(),
                 torch=torch.__version__, world=world, ranks_per_host=G)
    all_rows = []
    clusters = ("netns", "loopback") if a.cluster == "both" else (a.cluster,)
    for cluster in clusters:
        if cluster == "netns":
            ok, reason = netns.available()
            if not ok:
                print(f"netns cluster skipped: {reason}")
                continue
            with netns.TwoHostCluster(rate=a.rate, delay_ms=a.delay_ms) as c:
                desc = c.describe()
                rows = c.run(f"{me}:allreduce_worker", G, dict(ar_kw, rate_bytes_s=_rate_bytes(a.rate)),
                             timeout_s=1800)[0]
                if not a.skip_dispatch:
                    rows += c.run(f"{me}:dispatch_worker", G, dc_kw, timeout_s=1800, port=29613)[0]
        else:
            desc = f"loopback, {world} ranks on one host (no shaping; model: one tier)"
            rows = netns.run_local(f"{me}:allreduce_worker", world, dict(ar_kw, rate_bytes_s=0), timeout_s=1800)[0]
            if not a.skip_dispatch:
                rows += netns.run_local(f"{me}:dispatch_worker", world, dc_kw, timeout_s=1800)[0]
        for r in rows:
            r.update(stamp, cluster=cluster, link=desc)
        print_tables(rows, f"{cluster}: {desc}; {stamp['date']}, {stamp['cpus']} CPUs, torch {stamp['torch']}")
        all_rows += rows
    rec = C.Records("bench_collectives", a.json, a.cpu_smoke, device=f"cpu, {stamp['cpus']} cores (gloo)",
                    argv=argv, method=C.CPU_WALL)
    for r in all_rows:
        extra = {k: v for k, v in r.items() if k not in ("us",)}
        if r["kind"] == "all_reduce":
            ps = next(q for q in all_rows if q["kind"] == "all_reduce" and q["cluster"] == r["cluster"]
                      and q["dtype"] == r["dtype"] and q["tokens"] == r["tokens"] and q["algorithm"] == "ps")
            case = f"{r['cluster']} all_reduce {r['algorithm']} {r['dtype']} {r['tokens']}x{r['hidden']}"
            rec.add(case, "time", r["us"], "us", iterations=r["reps"], baseline=ps["us"], ratio=ps["us"] / r["us"],
                    note="baseline: parameter server (ps) in the same run", **extra)
        else:
            flat = next(q for q in all_rows if q["kind"] == "dispatch_combine" and q["cluster"] == r["cluster"]
                        and q["tokens"] == r["tokens"] and q["path"] == "flat")
            case = f"{r['cluster']} dispatch+combine {r['path']} {r['tokens']} tokens/rank"
            ok = r.get("max_rel_diff_vs_flat", 0.0) <= 2 ** -7  # node-aware combine: within a BF16 ulp of flat
            rec.add(case, "time", r["us"], "us", iterations=r["reps"], baseline=flat["us"], ratio=flat["us"] / r["us"],
                    valid=ok, note="baseline: flat dispatch/combine in the same run", **extra)
    if a.plot and all_rows:
        plot(all_rows, a.plot)
    code = rec.finish("bench_collectives.py")
    return code


if __name__ == "__main__":
    sys.exit(main())
