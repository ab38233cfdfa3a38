"""Benchmark of eplb against DeepSeek's EPLB (the reference), side by side in the same run.

Placement (``rebalance_experts``), per configuration and seed, on synthetic routing statistics
(`eplb.synthetic`: Zipf skew, a few very hot experts, group-correlated domains, per-step noise,
drift between windows). Windows w0, w1, w2 follow each other:

- ``ref``: the reference planned on w1 (`[L, E]` sums; hierarchical iff groups divide over nodes,
  as DeepSeek's ``rebalance_experts`` does);
- ``ours LE``: eplb on the same `[L, E]` input; ``ours SLE``: eplb on w1's per-step `[S, L, E]`;
- ``sticky``: ``ours SLE`` with ``previous`` = our plan from w0;
- ``BF``: ``ours SLE`` with ``policy="balance_first"`` (per layer the better balanced of hierarchical and
  global), and ``x-node``: cross-node selections per token under the workload's group-limited routing
  (`eplb.metrics.cross_node_per_token`, on w2) of ``ours SLE`` (DeepSeek's policy rule) and of ``BF``.

Balancedness (mean / max per-GPU load, each expert's tokens split evenly over its replicas, layer
average) is measured on the *later* window w2 (``plan`` column: on w1 itself); ``dup`` counts slots
holding an expert already on that GPU; ``moved`` the share of slots whose expert was not on that
GPU in the previous plan (the reference: its own plan from w0); ``ms`` wall time, one CPU thread,
median of ``--repeat`` runs.

Dispatch (``map_topk``), per DeepSeek-V3 decode configuration: ``--tokens`` tokens routed by the
same workload, top-8 with 4 of 8 groups, placed by ``ours SLE``; per-step balancedness of static,
random, round_robin, the even split (fractional), ``balanced`` (its actual integer assignment) and
the optimum (fractional split minimising the maximum GPU load: bisection on that maximum with a
max-flow feasibility check, exact to 1e-6). ``gap closed`` = (balanced - even) / (optimum - even)
over the steps where the optimum beats the even split. Times: CPU wall time here; with a GPU,
CUDA-graph replay time on it.

    python perf/bench_eplb.py                      # full tables (about 3 minutes on 2 cores)
    python perf/bench_eplb.py --quick              # fewer layers, one seed (smoke test)
    python perf/bench_eplb.py --out results.md     # also append the tables as markdown
    python perf/bench_eplb.py --map-only           # only the map_topk tables (about 1 minute on 1 core)

The reference is ``sglang/srt/eplb/eplb_algorithms/deepseek.py`` inside the sglang wheel, loaded with
zipimport at run time (never vendored): ``--ref-wheel PATH``, else ``.whl/sglang-*.whl`` under the
repository (gitignored). Nothing is downloaded at run time: ``--fetch-reference`` fetches the wheel
(about 39 MB, ``pip download --no-deps sglang==0.5.23 -d .whl``) after saying so; without the wheel
the reference columns are skipped with one line.
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_v, "1")  # one CPU core, before numpy/torch load their thread pools

import dataclasses  # noqa: E402
import datetime  # noqa: E402
import glob  # noqa: E402
import importlib.util  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import zipimport  # noqa: E402
from collections import deque  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
import eplb  # noqa: E402
from eplb.metrics import balancedness, cross_node_per_token, same_gpu_duplicates, slots_moved  # noqa: E402
from eplb.synthetic import PRESETS, sample_topk, simulate_counts  # noqa: E402

REF_VERSION = "0.5.23"
REF_MODULE_DIR = "sglang/srt/eplb/eplb_algorithms/"

# name, preset, GPUs, nodes, slots, groups
CONFIGS = [
    ("V3 decode EP144 288", "deepseek-v3-decode", 144, 18, 288, 8),
    ("V3 decode EP144 432", "deepseek-v3-decode", 144, 18, 432, 8),
    ("V3 decode EP72 288", "deepseek-v3-decode", 72, 9, 288, 8),
    ("V3 decode EP64 320 (1 group/node)", "deepseek-v3-decode", 64, 8, 320, 8),
    ("V3 prefill EP32 288", "deepseek-v3-prefill", 32, 4, 288, 8),
    ("Qwen3 decode EP32 160", "qwen3-moe-decode", 32, 4, 160, 1),
    ("Qwen3 prefill EP16 144", "qwen3-moe-prefill", 16, 2, 144, 1),
]


PROG = "bench_eplb.py"
SMOKE = dict(layers=2, seeds=[0], steps=4, tokens=256, map_steps=1, repeat=1, configs=1)


def _parse(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = _common.parser(PROG, __doc__, "tiny run (first configuration, 2 layers, 1 seed, 4 steps, 256 tokens) unless "
                                      "given explicitly: checks the code paths in seconds")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="workload seeds (results are averaged)")
    p.add_argument("--layers", type=int, default=None, help="override every model's layer count")
    p.add_argument("--steps", type=int, default=32, help="steps per window")
    p.add_argument("--tokens", type=int, default=4608, help="tokens per map_topk step")
    p.add_argument("--map-steps", type=int, default=6, help="map_topk steps per configuration and seed")
    p.add_argument("--repeat", type=int, default=3, help="timing repetitions (median)")
    p.add_argument("--configs", type=int, default=len(CONFIGS), help="run only the first N configurations")
    p.add_argument("--quick", action="store_true", help="8 layers, one seed, 2 map steps")
    p.add_argument("--ref-wheel", default=None, help="path of the sglang wheel holding the reference")
    p.add_argument("--fetch-reference", action="store_true",
                   help=f"download the reference (sglang=={REF_VERSION} wheel, about 39 MB, no dependencies) into "
                        ".whl/ with pip before running; nothing is downloaded without this option")
    p.add_argument("--no-reference", action="store_true", help="skip the reference columns even if the wheel is there")
    p.add_argument("--map-only", action="store_true", help="skip the placement table: only the map_topk tables "
                   "(global and per rank)")
    p.add_argument("--out", default=None, help="append the tables as markdown to this file")
    a = p.parse_args(argv)
    if a.quick:
        a.layers, a.seeds, a.map_steps, a.repeat = a.layers or 8, a.seeds[:1], 2, 1
    if a.cpu_smoke:
        _common.smoke_defaults(a, p, argv, **SMOKE)
    for k in ("steps", "tokens", "map_steps", "repeat", "configs"):
        if getattr(a, k) < 1:
            p.error(f"argument --{k.replace('_', '-')}: must be >= 1, got {getattr(a, k)}")
    if a.layers is not None and a.layers < 1:
        p.error(f"argument --layers: must be >= 1, got {a.layers}")
    if a.ref_wheel and not os.path.isfile(a.ref_wheel):
        p.error(f"argument --ref-wheel: no such file: {a.ref_wheel}")
    return a


def fetch_reference():
    """pip download of the sglang wheel into .whl/ (only on --fetch-reference). Returns an error text or None."""
    dest = os.path.join(ROOT, ".whl")
    print(f"{PROG}: fetching the reference: pip download --no-deps sglang=={REF_VERSION} -d {dest} (about 39 MB; "
          f"DeepSeek's EPLB deepseek.py is read from it with zipimport, never installed)", file=sys.stderr, flush=True)
    r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"sglang=={REF_VERSION}",
                        "-d", dest], capture_output=True, text=True)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["pip failed"])[-1]
        return f"could not fetch the reference (pip exit {r.returncode}): {last}"
    return None


def load_reference(wheel):
    """DeepSeek's EPLB module from the sglang wheel, imported straight from the zip (not vendored); (None, why)
    when absent."""
    if wheel is None:
        found = sorted(glob.glob(os.path.join(ROOT, ".whl", "sglang-*.whl")))
        if not found:
            return None, (f"reference absent (no .whl/sglang-*.whl): reference columns skipped; "
                          f"--fetch-reference downloads it (sglang=={REF_VERSION}, about 39 MB)")
        wheel = found[-1]
    spec = zipimport.zipimporter(os.path.join(wheel, REF_MODULE_DIR)).find_spec("deepseek")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, os.path.basename(wheel)


def ref_rebalance(ref, weight, P, groups, nodes, G):
    # DeepSeek's rebalance_experts picks hierarchical iff groups divide over nodes; sglang's copy takes
    # that choice as a sixth argument (its "auto" makes the same choice).
    return ref.rebalance_experts(torch.from_numpy(weight).float(), P, groups, nodes, G, groups % nodes == 0)


def timed(fn, repeat):
    ts, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t)
    return out, 1e3 * float(np.median(ts))


# ---- per-step optimum of the replica split: bisection on the maximum GPU load + max-flow (Dinic) ----

def _max_flow(n, edges, s, t):
    graph = [[] for _ in range(n)]
    to, cap = [], []
    for u, v, c in edges:
        graph[u].append(len(to))
        to.append(v)
        cap.append(c)
        graph[v].append(len(to))
        to.append(u)
        cap.append(0.0)
    flow, eps = 0.0, 1e-9
    while True:
        level = [-1] * n
        level[s] = 0
        q = deque([s])
        while q:
            u = q.popleft()
            for e in graph[u]:
                if cap[e] > eps and level[to[e]] < 0:
                    level[to[e]] = level[u] + 1
                    q.append(to[e])
        if level[t] < 0:
            return flow
        it = [0] * n

        def push(u, f):
            if u == t:
                return f
            while it[u] < len(graph[u]):
                e = graph[u][it[u]]
                v = to[e]
                if cap[e] > eps and level[v] == level[u] + 1:
                    d = push(v, min(f, cap[e]))
                    if d > eps:
                        cap[e] -= d
                        cap[e ^ 1] += d
                        return d
                it[u] += 1
            return 0.0

        while True:
            f = push(s, float("inf"))
            if f <= eps:
                break
            flow += f


def optimal_max_load(counts, log2phy, logcnt, G, m, tol=1e-6):
    """Smallest achievable maximum GPU load when every expert's selections may be split freely over its replicas."""
    E = len(counts)
    total = float(counts.sum())
    s, t = E + G, E + G + 1
    edges = []
    even = np.zeros(G)
    for e in range(E):
        gpus = {int(log2phy[e, r]) // m for r in range(int(logcnt[e]))}
        for r in range(int(logcnt[e])):
            even[int(log2phy[e, r]) // m] += counts[e] / logcnt[e]
        if counts[e] > 0:
            edges.append((s, e, float(counts[e])))
            edges.extend((e, E + g, float("inf")) for g in gpus)
    lo, hi = total / G, float(even.max())
    while hi - lo > tol * hi:
        mid = 0.5 * (lo + hi)
        if _max_flow(E + G + 2, edges + [(E + g, t, mid) for g in range(G)], s, t) >= total * (1 - 1e-9):
            hi = mid
        else:
            lo = mid
    return hi


def _bal(loads):
    loads = np.asarray(loads, np.float64)
    return float(loads.mean() / loads.max()) if loads.max() > 0 else 1.0


# ---- tables ----

def _plan_ok(phy2log, E, P) -> bool:
    """A plan is valid when every slot holds an expert id in range and every expert has a slot, per layer."""
    p = torch.as_tensor(phy2log)
    if p.shape[-1] != P or p.min() < 0 or p.max() >= E:
        return False
    return all(torch.bincount(layer.long(), minlength=E).min() >= 1 for layer in p.reshape(-1, P))


def placement_rows(args, ref):
    rows = []
    cache = {}
    prog = _common.Progress(min(args.configs, len(CONFIGS)), "placement")
    for name, preset, G, nodes, P, groups in CONFIGS[:args.configs]:
        acc = []
        for seed in args.seeds:
            wl = PRESETS[preset]
            over = {"num_steps": args.steps}
            if args.layers:
                over["num_layers"] = args.layers
            wl = dataclasses.replace(wl, **over)
            key = (preset, seed)
            if key not in cache:
                cache.clear()
                cache[key] = simulate_counts(wl, 3, seed=seed)
            w0, w1, w2 = (x.astype(np.float64) for x in cache[key])
            r = {}
            if ref is not None:
                rp0 = ref_rebalance(ref, w0.sum(0), P, groups, nodes, G)[0]
                rp, r["ref ms"] = timed(lambda: ref_rebalance(ref, w1.sum(0), P, groups, nodes, G)[0], args.repeat)
            o2, r["LE ms"] = timed(lambda: eplb.rebalance_experts(w1.sum(0), P, groups, nodes, G)[0], args.repeat)
            o3, r["SLE ms"] = timed(lambda: eplb.rebalance_experts(w1, P, groups, nodes, G)[0], args.repeat)
            prev = eplb.rebalance_experts(w0, P, groups, nodes, G)[0]
            st, r["sticky ms"] = timed(lambda: eplb.rebalance_experts(w1, P, groups, nodes, G, previous=prev)[0],
                                       args.repeat)
            bf = eplb.rebalance_experts(w1, P, groups, nodes, G, policy="balance_first")[0]
            r["BF"] = balancedness(bf, w2, G)
            for k, p in (("SLE", o3), ("BF", bf)):  # the node-locality cost on the later window
                r[k + " xnode"] = cross_node_per_token(p, w2, G, nodes, groups, wl.topk, wl.topk_groups, num_tokens=256)
            plans = (("LE", o2), ("SLE", o3), ("sticky", st))
            if ref is not None:
                plans = (("ref", rp),) + plans
                r["ref moved"] = slots_moved(rp, rp0, G) / rp.numel()
            else:
                for k in ("ref", "ref plan", "ref dup", "ref moved", "ref ms"):
                    r[k] = float("nan")
            E = w1.shape[-1]
            r["valid"] = float(all(_plan_ok(p, E, P) for _, p in plans))
            for k, p in plans:
                r[k] = balancedness(p, w2, G)
                r[k + " plan"] = balancedness(p, w1, G)
                r[k + " dup"] = same_gpu_duplicates(p, G)
            r["SLE moved"] = slots_moved(o3, prev, G) / o3.numel()
            r["sticky moved"] = slots_moved(st, prev, G) / st.numel()
            acc.append(r)
        mean = {k: float(np.mean([a[k] for a in acc])) for k in acc[0]}
        rows.append((name, preset, wl.num_layers, mean))
        prog.step(name)
        print(f"  {name}: ref {mean['ref']:.3f}, ours LE {mean['LE']:.3f}, ours SLE {mean['SLE']:.3f}, "
              f"sticky {mean['sticky']:.3f} ({100 * mean['sticky moved']:.0f}% moved)", file=sys.stderr)
    return rows


def dispatch_rows(args):
    rows = []
    gpu = torch.cuda.is_available()
    for name, preset, G, nodes, P, groups in CONFIGS[:args.configs]:
        if "decode" not in preset or "V3" not in name:
            continue
        wl = PRESETS[preset]
        acc = {k: [] for k in ("static", "random", "round_robin", "even", "balanced", "optimum",
                               "static per-rank", "random per-rank", "round_robin per-rank", "balanced per-rank")}
        gaps, times = [], {}
        ok_map = True
        for seed in args.seeds:
            wl1 = dataclasses.replace(wl, num_layers=1, num_steps=args.steps)
            w = simulate_counts(wl1, 1, seed=seed)[0]
            phy2log, log2phy, logcnt = eplb.rebalance_experts(w, P, groups, nodes, G)
            l2p, cnt = log2phy[0], logcnt[0]
            for step in range(args.map_steps):
                topk = sample_topk(wl1, args.tokens, 0, seed=seed, step=step)
                counts = torch.bincount(topk.reshape(-1), minlength=wl.num_experts).double().numpy()
                for pol in ("static", "random", "round_robin", "balanced"):
                    out = eplb.map_topk(topk, l2p, cnt, pol, seed=step, num_gpus=G, num_slots=P)
                    ok_map &= bool((phy2log[0][out.long()] == topk.long()).all())
                    acc[pol].append(_bal(np.bincount(out.reshape(-1).numpy() // (P // G), minlength=G)))
                    # as deployed: every rank maps only its own tokens (tokens / G each), independently,
                    # with the same seed and its own rank
                    outs = [eplb.map_topk(chunk, l2p, cnt, pol, seed=step, rank=r, num_gpus=G, num_slots=P)
                            for r, chunk in enumerate(_rank_chunks(topk, G))]
                    out_r = torch.cat(outs)
                    ok_map &= bool((phy2log[0][out_r.long()] == topk.long()).all())
                    acc[pol + " per-rank"].append(_bal(np.bincount(out_r.reshape(-1).numpy() // (P // G), minlength=G)))
                even = _bal(eplb.gpu_loads(phy2log, counts[None], G)[0])
                opt = counts.sum() / G / optimal_max_load(counts, l2p.numpy(), cnt.numpy(), G, P // G)
                acc["even"].append(even)
                acc["optimum"].append(opt)
                if opt - even > 1e-4:
                    gaps.append((acc["balanced"][-1] - even) / (opt - even))
            topk = sample_topk(wl1, args.tokens, 0, seed=seed, step=0)
            for pol in ("static", "random", "round_robin", "balanced"):
                def call(pol=pol):
                    return eplb.map_topk(topk, l2p, cnt, pol, seed=1, num_gpus=G, num_slots=P)
                call()
                times.setdefault(pol, []).append(timed(call, max(5, args.repeat))[1] * 1e3)
                mine = _rank_chunks(topk, G)[0]  # one rank's own tokens (tokens / G)

                def call_rank(pol=pol, mine=mine):
                    return eplb.map_topk(mine, l2p, cnt, pol, seed=1, num_gpus=G, num_slots=P)
                call_rank()
                times.setdefault(pol + " per-rank", []).append(timed(call_rank, max(5, args.repeat))[1] * 1e3)
                if gpu:
                    times.setdefault(pol + " gpu", []).append(_gpu_time(topk, l2p, cnt, pol, G, P))
                    times.setdefault(pol + " per-rank gpu", []).append(_gpu_time(mine, l2p, cnt, pol, G, P))
        mean = {k: float(np.mean(v)) for k, v in acc.items()}
        mean["gap"] = float(np.mean(gaps)) if gaps else float("nan")
        mean["gap steps"] = len(gaps)
        mean["valid"] = float(ok_map)
        mean["steps"] = len(acc["even"])
        mean["G"] = G
        mean["tokens per rank"] = _rank_chunks(topk, G)[0].shape[0]
        mean.update({k + " us": float(np.median(v)) for k, v in times.items()})
        rows.append((name, mean))
        print(f"  map_topk {name}: even {mean['even']:.3f}, balanced {mean['balanced']:.3f}, "
              f"optimum {mean['optimum']:.3f}", file=sys.stderr)
    return rows


def _rank_chunks(topk, G):
    """The step's tokens split over the ``G`` ranks (each rank routes and maps its own ``tokens / G``)."""
    return list(torch.tensor_split(topk, G))


def _gpu_time(topk, l2p, cnt, pol, G, P):
    """Microseconds per map_topk, CUDA-graph replay (median of 200 replays timed with CUDA events)."""
    dev = torch.device("cuda")
    t, lp, c = topk.to(dev), l2p.to(dev), cnt.to(dev)
    seed = torch.tensor(1, device=dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        eplb.map_topk(t, lp, c, pol, seed=seed, num_gpus=G, num_slots=P)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        eplb.map_topk(t, lp, c, pol, seed=seed, num_gpus=G, num_slots=P)
    ts = []
    for _ in range(200):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return float(np.median(ts))


def render(args, ref_name, prow, drow):
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.processor() or platform.machine()})"
    lines = [f"### eplb vs DeepSeek EPLB ({ref_name}: deepseek.py), {datetime.date.today().isoformat()}, {dev}, "
             f"1 thread, seeds {args.seeds}, {args.steps} steps/window",
             "",
             "Balancedness on the later window (planned on the window before; `plan`: on the planning window), "
             "same-GPU duplicate slots (summed over layers), share of slots moved vs the previous plan, wall time.",
             "",
             "| config | layers | ref | ours LE | ours SLE | sticky | BF | x-node SLE / BF | ref plan | SLE plan "
             "| ref dup | ours dup | ref moved | sticky moved | ref ms | ours LE ms | ours SLE ms | sticky ms |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
             "| --- |"]
    if not prow:  # --map-only
        lines = lines[:1]
    for name, preset, L, r in prow:
        ours_dup = max(r["LE dup"], r["SLE dup"], r["sticky dup"])
        lines.append(f"| {name} | {L} | {r['ref']:.3f} | {r['LE']:.3f} | {r['SLE']:.3f} | {r['sticky']:.3f} | "
                     f"{r['BF']:.3f} | {r['SLE xnode']:.2f} / {r['BF xnode']:.2f} | {r['ref plan']:.3f} | "
                     f"{r['SLE plan']:.3f} | {r['ref dup']:.0f} | {ours_dup:.0f} | "
                     f"{100 * r['ref moved']:.0f}% | {100 * r['sticky moved']:.0f}% | {r['ref ms']:.0f} | "
                     f"{r['LE ms']:.1f} | {r['SLE ms']:.0f} | {r['sticky ms']:.0f} |")
    dec = [r for n, p, L, r in prow if "decode" in p]
    if dec:
        d_le = np.mean([r["LE"] - r["ref"] for r in dec])
        d_sle = np.mean([r["SLE"] - r["ref"] for r in dec])
        d_st = np.mean([r["SLE"] - r["sticky"] for n, p, L, r in prow])
        lines += ["", f"Decode average vs ref: ours LE {d_le:+.3f}, ours SLE {d_sle:+.3f}. "
                  f"Sticky vs fresh SLE: {d_st:+.3f} balancedness lost on average, "
                  f"{100 * max(r['sticky moved'] for n, p, L, r in prow):.0f}% slots moved at most."]
    if drow:
        gpu = torch.cuda.is_available()
        lines += ["", f"map_topk, {args.tokens} tokens x top-8 per step (DeepSeek-V3 decode, layer 0, "
                  f"{drow[0][1]['steps']} steps per config): per-step balancedness and time per call "
                  f"({'CUDA-graph replay on the GPU' if gpu else 'CPU wall time, 1 thread'})", "",
                  "| config | static | random | round_robin | even split | balanced | optimum | gap closed | "
                  "static us | random us | round_robin us | balanced us |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        sfx = " gpu us" if gpu else " us"
        for name, r in drow:
            gap = f"{100 * r['gap']:.0f}% ({r['gap steps']}/{r['steps']} steps)" if r["gap steps"] else "n/a (opt = even)"
            lines.append(f"| {name} | {r['static']:.3f} | {r['random']:.3f} | {r['round_robin']:.3f} | {r['even']:.3f} | "
                         f"{r['balanced']:.3f} | {r['optimum']:.3f} | {gap} | "
                         + " | ".join(f"{r[p + sfx]:.0f}" for p in ("static", "random", "round_robin", "balanced")) + " |")
        lines += ["", "As deployed, per rank: every rank maps only its own tokens (tokens / GPUs, e.g. 32 at EP144 "
                  "decode), independently; balancedness of the union of the GPUs' calls, time of one rank's call. "
                  "The global rows above (one call over all tokens) are the upper bound a cross-rank mapper could "
                  "reach, not what a rank sees.", "",
                  "| config | GPUs | tokens/rank | static | random | round_robin | balanced | even split | optimum | "
                  "static us | random us | round_robin us | balanced us |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for name, r in drow:
            lines.append(f"| {name} | {r['G']} | {r['tokens per rank']} | "
                         + " | ".join(f"{r[p + ' per-rank']:.3f}" for p in ("static", "random", "round_robin", "balanced"))
                         + f" | {r['even']:.3f} | {r['optimum']:.3f} | "
                         + " | ".join(f"{r[p + ' per-rank' + sfx]:.0f}"
                                      for p in ("static", "random", "round_robin", "balanced")) + " |")
    return "\n".join(lines)


def main(argv=None):
    args = _parse(argv)
    torch.set_num_threads(1)
    ref, ref_name = None, None
    if args.fetch_reference and not args.ref_wheel and not args.no_reference:
        why = fetch_reference()
        if why:
            return _common.error(PROG, why)
    if not args.no_reference:
        ref, ref_name = load_reference(args.ref_wheel)
        if ref is None:
            print(f"{PROG}: {ref_name}", file=sys.stderr, flush=True)
            ref_name = "no reference"
    rec = _common.Records("bench_eplb", args.json, args.cpu_smoke, argv=argv, method=_common.COUNTED)
    prow = []
    if not args.map_only:
        print("placement ...", file=sys.stderr, flush=True)
        prow = placement_rows(args, ref)
    print("map_topk ...", file=sys.stderr, flush=True)
    drow = dispatch_rows(args)
    text = render(args, ref_name or "no reference", prow, drow)
    if ref is None:
        import re
        text = re.sub(r"\bnan%?", "n/a", text)
    print(text)
    for name, preset, L, r in prow:
        for key, unit in (("LE", "balancedness"), ("SLE", "balancedness"), ("sticky", "balancedness")):
            base = None if ref is None else r["ref"]
            rec.add(f"placement {name}", f"ours {key} balancedness (later window)", r[key], "mean/max", baseline=base,
                    limit=1.0, ratio=None if base is None else r[key] / base, valid=r["valid"] == 1.0,
                    iterations=args.repeat, time_ms=r[f"{key} ms"], dup=r[f"{key} dup"])
    for name, r in drow:
        rec.add(f"map_topk {name}", "balanced balancedness per step", r["balanced"], "mean/max", baseline=r["even"],
                limit=r["optimum"], ratio=r["balanced"] / r["even"] if r["even"] else None, valid=r["valid"] == 1.0,
                iterations=r["steps"], time_us=r.get("balanced us"), gpu_time_us=r.get("balanced gpu us"),
                note=f"one global call over all {args.tokens} tokens: an upper bound, not the deployed per-rank use")
        rec.add(f"map_topk {name} per-rank", "balanced balancedness per step", r["balanced per-rank"], "mean/max",
                baseline=r["even"], limit=r["optimum"], ratio=r["balanced per-rank"] / r["even"] if r["even"] else None,
                valid=r["valid"] == 1.0, iterations=r["steps"], time_us=r.get("balanced per-rank us"),
                gpu_time_us=r.get("balanced per-rank gpu us"), tokens_per_rank=r["tokens per rank"], gpus=r["G"],
                note=f"as deployed: each of the {r['G']} ranks maps its own {r['tokens per rank']} tokens; time of one "
                     "rank's call (CUDA-graph replay on a GPU, else CPU wall time)")
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n\n")
    return rec.finish(PROG)


if __name__ == "__main__":
    sys.exit(main())
