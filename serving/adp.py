"""ADP balance (seed 003: TensorRT-LLM's ADP balance blog): attention-DP scheduling policies, and the
experiment that reproduces the blog's table (``python -m serving adp``).

Policies: where a new request goes (routers) and whether the contexts the per-rank schedulers picked
run this iteration (the ADP balance gate). An engine calls ``router.route(...)`` when it admits
requests and ``gate.decide(...)`` once per iteration after its per-rank schedulers have picked; every
rank holds the same gathered vectors and runs the same deterministic code, so every rank reaches the
same decision with no extra broadcast.
"""

from __future__ import annotations

import argparse
import heapq
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

__all__ = ["RoundRobinRouter", "HeapRouter", "ADPGate", "make_router"]


class RoundRobinRouter:
    """The seed's baseline: sort the new requests by token count (longest first) and deal them to the
    ranks round-robin, skipping ranks at their active-request cap. The deal position persists across
    calls, so single arrivals rotate over the ranks too."""

    name = "rr"

    def __init__(self) -> None:
        self._next = 0

    def route(self, input_len: np.ndarray, num_active: np.ndarray, active_tokens: np.ndarray, cap: int) -> np.ndarray:
        """Arguments:
            input_len: `[k]` prompt tokens of the new requests.
            num_active: `[R]` active requests per rank (updated in place).
            active_tokens: `[R]` sum of active prompt tokens per rank (updated in place).
            cap: max active requests per rank.

        Returns:
            `[k]` int64 rank per request, -1 where every rank is full.
        """
        r = len(num_active)
        out = np.full(len(input_len), -1, dtype=np.int64)
        for i in np.argsort(-np.asarray(input_len), kind="stable"):
            for step in range(r):
                k = (self._next + step) % r
                if num_active[k] < cap:
                    out[i] = k
                    num_active[k] += 1
                    active_tokens[k] += input_len[i]
                    self._next = (k + 1) % r
                    break
            else:
                break
        return out


class HeapRouter:
    """TensorRT-LLM's default admission: LPT on active prompt tokens. Requests sorted by input length,
    longest first; each goes to the rank with the fewest active prompt tokens (ties: fewer requests,
    lower rank) among ranks under ``expected = max(ceil((active + new) / R), max_r active_r)``, capped
    at ``cap``."""

    name = "heap"

    def route(self, input_len: np.ndarray, num_active: np.ndarray, active_tokens: np.ndarray, cap: int) -> np.ndarray:
        r = len(num_active)
        k = len(input_len)
        out = np.full(k, -1, dtype=np.int64)
        expected = min(cap, max(-(-(int(num_active.sum()) + k) // r), int(num_active.max())))
        heap = [(int(active_tokens[j]), int(num_active[j]), j) for j in range(r) if num_active[j] < expected]
        heapq.heapify(heap)
        for i in np.argsort(-np.asarray(input_len), kind="stable"):
            if not heap:
                break
            tok, n, j = heapq.heappop(heap)
            out[i] = j
            num_active[j] += 1
            active_tokens[j] += input_len[i]
            if n + 1 < expected:
                heapq.heappush(heap, (tok + int(input_len[i]), n + 1, j))
        return out


def make_router(name: str) -> RoundRobinRouter | HeapRouter:
    if name == "rr":
        return RoundRobinRouter()
    if name == "heap":
        return HeapRouter()
    raise ValueError(f"unknown router {name!r}; use 'rr' (seed: sorted round-robin) or 'heap' (TensorRT-LLM)")


@dataclass
class ADPGate:
    """The ADP balance gate: hold the scheduled contexts on *all* ranks until every rank has one
    (at most ``timeout_iters`` iterations), then hold ``batching_wait_iters`` more so contexts
    accumulate, then release them together.

    ``batching="code"`` is TensorRT-LLM's semantics: the batching wait is unconditional once every
    rank has a context and every rank is generating. ``batching="seed"`` is the seed's wording: hold
    only while some rank has fewer scheduled contexts than another. ``enabled=False`` always releases
    (the baseline). Counters persist across calls; the same inputs give the same decision everywhere.
    """

    enabled: bool = True
    timeout_iters: int = 50
    batching_wait_iters: int = 10
    batching: str = "code"
    wait_cnt: int = field(default=0, init=False)
    batch_cnt: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.timeout_iters < 0 or self.batching_wait_iters < 0:
            raise ValueError(f"timeout_iters={self.timeout_iters} and batching_wait_iters="
                             f"{self.batching_wait_iters} must be >= 0")
        if self.batching not in ("code", "seed"):
            raise ValueError(f"batching={self.batching!r} must be 'code' (TensorRT-LLM) or 'seed'")

    def decide(self, num_ctx: Sequence[int], num_gen: Sequence[int], max_batch_size: int) -> bool:
        """Return True to run the scheduled contexts this iteration, False to hold them on every rank.

        Arguments:
            num_ctx: `[R]` contexts each rank's scheduler picked this iteration.
            num_gen: `[R]` generation requests per rank, a dummy request counted as one.
            max_batch_size: per-rank batch limit (a rank at the limit has no slot for a context).
        """
        if not self.enabled:
            return True
        # NOTES: no early return when no rank has a context: as in TensorRT-LLM, the timeout counter
        # also runs through context-free iterations (wrapping at ``timeout_iters``), so a context that
        # arrives late in that cycle waits less than ``timeout_iters``.
        free = all(g < max_batch_size for g in num_gen)
        all_ctx = all(c > 0 for c in num_ctx)
        all_gen = all(g > 0 for g in num_gen)
        if free and all_ctx:
            self.wait_cnt = 0
            if not all_gen:
                return True
            hold = self.batch_cnt < self.batching_wait_iters
            if self.batching == "seed":
                hold = hold and min(num_ctx) < max(num_ctx)
            if hold:
                self.batch_cnt += 1
                return False
            self.batch_cnt = 0
            return True
        self.wait_cnt += 1
        if self.wait_cnt >= self.timeout_iters or not all_gen:
            self.wait_cnt = 0
            return True
        return False


# --- the seed-003 experiment -------------------------------------------------------------------

# Seed 003 "性能结果" (DeepSeek-V3, 8x GB200, ADP8 EP8, 16,000 requests, ISL 803 / OSL 3,653).
PAPER_ROWS = {
    "round-robin": {"tps": 25664.0, "mean_balance": 0.5411, "sol_tps": 39552.0, "speedup": 1.00},
    "context wait": {"tps": 33499.0, "mean_balance": 0.8433, "sol_tps": 38312.0, "speedup": 1.31},
    "full": {"tps": 34140.0, "mean_balance": 0.8770, "sol_tps": 37912.0, "speedup": 1.33},
}
# Derived from the seed's table (SEEDS.md A.5): tps / sol_tps = time-weighted balance.
PAPER_TW = {k: v["tps"] / v["sol_tps"] for k, v in PAPER_ROWS.items()}


@dataclass(frozen=True)
class AdpConfig:
    """One row of the experiment: a name and the gate's parameters (``enabled=False``: baseline)."""

    name: str
    enabled: bool
    timeout_iters: int = 50
    batching_wait_iters: int = 0

    def gate(self, batching: str = "code") -> ADPGate:
        return ADPGate(self.enabled, self.timeout_iters, self.batching_wait_iters, batching)


def paper_configs(timeout_iters: int = 50, batching_wait_iters: int = 10) -> list[AdpConfig]:
    return [AdpConfig("round-robin", False), AdpConfig("context wait", True, timeout_iters, 0),
            AdpConfig("full", True, timeout_iters, batching_wait_iters)]


def format_table(rows: list[tuple[str, dict[str, float]]], compare: bool = True) -> str:
    """The seed's table, ours beside theirs (``ours / theirs``) when the row name is one of the seed's."""
    base = rows[0][1]["tps"]
    head = ("| config | TPS | speed-up | mean balance | time-weighted balance | SOL TPS | TTFT p50 / p99 (s) "
            "| iterations |")
    lines = [head, "|" + " --- |" * 8]
    for name, m in rows:
        p = PAPER_ROWS.get(name) if compare else None
        sp = m["tps"] / base
        cells = [(f"{m['tps']:,.0f}", p and f"{p['tps']:,.0f}"), (f"{sp:.2f}x", p and f"{p['speedup']:.2f}x"),
                 (f"{m['mean_balance']:.2%}", p and f"{p['mean_balance']:.2%}"),
                 (f"{m['tw_balance']:.2%}", p and f"{PAPER_TW[name]:.2%}"),
                 (f"{m['sol_tps']:,.0f}", p and f"{p['sol_tps']:,.0f}")]
        body = " | ".join(f"{o} / {t}" if t else o for o, t in cells)
        lines.append(f"| {name} | {body} | {m['ttft_p50']:.1f} / {m['ttft_p99']:.1f} | {m['iterations']:,.0f} |")
    return "\n".join(lines)


# The seed's own modelling assumption (attention-module time linear in the rank's tokens), fitted to
# its table: c_tok and c_total set so the baseline lands on 25,664 TPS with c_total / c_tok = 0.05
# (MoE/EP share ~30% of a balanced iteration); c0 covers per-iteration fixed work. Fitted, not quoted.
SEED_LINEAR = dict(c0=5.5e-3, c_tok=1.1e-4, c_total=5.5e-6)


def make_cost(kind: str, hardware: str = "H200", num_ranks: int = 8):
    """``"token"``: the seed's token-linear model fitted to its table; ``"roofline"``: ``serving.cost``'s
    first-principles model on a ``serving.hardware`` row."""
    from .cost import CostModel, LinearCost
    if kind == "token":
        return LinearCost(**SEED_LINEAR)
    if kind == "roofline":
        from .hardware import HARDWARE
        if hardware not in HARDWARE:
            raise ValueError(f"unknown hardware {hardware!r}; known: {', '.join(sorted(HARDWARE))}")
        return CostModel(HARDWARE[hardware], num_ranks=num_ranks)
    raise ValueError(f"unknown cost model {kind!r}; use 'token' or 'roofline'")


def run_configs(trace, cost, cfg, configs: list[AdpConfig], router: str = "rr", batching: str = "code",
                progress: bool = False, say=None):
    """Simulate each config on the same trace; return ``[(name, metrics, SimResult)]``. ``say(text)``, when
    given, is called before each simulation (the CLI's progress lines)."""
    from .sim import simulate, stderr_progress
    out = []
    for i, c in enumerate(configs):
        if say:
            say(f"simulating {c.name} ({i + 1}/{len(configs)}, {len(trace.input_len):,} requests)")
        res = simulate(trace, cost, make_router(router), c.gate(batching), cfg,
                       progress=stderr_progress(c.name) if progress else None)
        out.append((c.name, res.metrics(window=(100, 12000)), res))
    return out


PARETO_SETTINGS = [(0, 0), (10, 0), (50, 0), (50, 10), (100, 10), (100, 30)]
PARETO_LOADS = [512, 1024, 2048, 4096]


def pareto_sweep(make_trace, cost, cfg, router: str = "rr", settings=PARETO_SETTINGS, loads=PARETO_LOADS, say=None):
    """TPS per GPU and TTFT over (timeout_iters, batching_wait_iters) settings and closed-loop loads.
    ``make_trace(load)`` gives the trace for a load (enough requests to reach a steady state); ``(0, 0)``
    is the baseline (gate off). Returns ``[(setting, load, metrics)]``. ``say(text)``: progress lines."""
    from dataclasses import replace

    from .sim import simulate
    rows = []
    for i, load in enumerate(loads):
        c = replace(cfg, concurrency=load)
        trace = make_trace(load)
        if say:
            say(f"Pareto sweep: concurrency {load} ({i + 1}/{len(loads)}), {len(settings)} gate settings on "
                f"{len(trace.input_len):,} requests")
        for to, bw in settings:
            gate = ADPGate(enabled=(to, bw) != (0, 0), timeout_iters=to, batching_wait_iters=bw)
            m = simulate(trace, cost, make_router(router), gate, c).metrics()
            rows.append(((to, bw), load, m))
    return rows


def write_plots(out_dir, results, pareto_rows, num_gpus: int, say=None) -> list[str]:
    """Balance over iterations (one panel per config) and the Pareto plot; returns the paths written,
    or an empty list with a one-line note on stderr when matplotlib is missing. ``say(text)``: a progress
    line before each figure (drawing the per-iteration balance of 16,000 requests takes tens of seconds)."""
    import os
    import sys
    say = say or (lambda text: None)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; plots skipped (pip install matplotlib)", file=sys.stderr)
        return []
    os.makedirs(out_dir, exist_ok=True)
    written = []

    def save(fig, name):
        path = os.path.join(out_dir, name)
        tmp = path + ".tmp.png"
        fig.savefig(tmp, dpi=120)
        plt.close(fig)
        os.replace(tmp, path)
        written.append(path)

    say(f"plotting {os.path.join(out_dir, 'adp_balance.png')} (balance per iteration, {len(results)} panels)")
    fig, axes = plt.subplots(len(results), 1, figsize=(10, 2.6 * len(results)), sharex=True, squeeze=False)
    for ax, (name, m, res) in zip(axes[:, 0], results):
        b = res.balance
        k = 100
        smooth = np.convolve(b, np.ones(k) / k, mode="valid") if len(b) > k else b
        ax.plot(b, lw=0.3, alpha=0.35, color="tab:blue")
        ax.plot(np.arange(len(smooth)) + k // 2, smooth, lw=1.0, color="tab:red", label=f"mean of {k}")
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("balance")
        ax.set_title(f"{name}: mean {m['mean_balance']:.1%}, time-weighted {m['tw_balance']:.1%}", fontsize=9)
        ax.legend(loc="lower right", fontsize=7)
    axes[-1, 0].set_xlabel("iteration")
    fig.tight_layout()
    save(fig, "adp_balance.png")

    if pareto_rows:
        say(f"plotting {os.path.join(out_dir, 'adp_pareto.png')} (Pareto: TPS per GPU vs TTFT)")
        fig, ax = plt.subplots(figsize=(7, 5))
        settings = sorted({s for s, _, _ in pareto_rows})
        for s in settings:
            pts = sorted((load, m) for ss, load, m in pareto_rows if ss == s)
            x = [m["ttft_p50"] for _, m in pts]
            y = [m["tps"] / num_gpus for _, m in pts]
            label = "baseline" if s == (0, 0) else f"TO={s[0]} BW={s[1]}"
            ax.plot(x, y, marker="o", ms=4, lw=1, label=label, ls="--" if s == (0, 0) else "-")
        ax.set_xscale("log")
        ax.set_xlabel("TTFT p50 (s), closed loop; points are load levels")
        ax.set_ylabel("output TPS per GPU")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        save(fig, "adp_pareto.png")
    return written


class _DefaultsHelp(argparse.HelpFormatter):
    """``(default: X)`` after each option's help, once, and only where there is a default to state."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is not None and action.default is not False and action.default != argparse.SUPPRESS \
                and "default" not in text:
            text += " (default: %(default)s)"
        return text


def add_adp_parser(subparsers) -> None:
    """Register ``adp``: reproduce the table of TensorRT-LLM's ADP balance blog, write the balance and
    Pareto plots."""
    p = subparsers.add_parser(
        "adp", help="ADP balance: simulate round-robin vs ADP balance, print the table beside TensorRT-LLM's "
                    "published one, write plots",
        description="Simulate round-robin vs ADP balance (context wait, full) on the trace statistics of "
                    "TensorRT-LLM's ADP balance blog (DeepSeek-V3, 8 attention-DP ranks) and print the table "
                    "beside the blog's. Plots and metrics.json go to --out (default: ./adp_out in the current "
                    "directory); progress lines go to stderr.",
        formatter_class=_DefaultsHelp)
    g = p.add_argument_group("trace")
    g.add_argument("--trace", metavar="FILE",
                   help="JSON or CSV trace (input_len, output_len[, arrival_s, rank]) instead of the synthetic one")
    g.add_argument("--requests", type=int, default=16000, metavar="N", help="synthetic trace: number of requests")
    g.add_argument("--mean-input", type=float, default=803.0, metavar="TOKENS",
                   help="synthetic trace: mean input length in tokens")
    g.add_argument("--mean-output", type=float, default=3653.0, metavar="TOKENS",
                   help="synthetic trace: mean output length in tokens")
    g.add_argument("--sigma-input", type=float, default=0.6, metavar="X",
                   help="synthetic trace: lognormal sigma of the input lengths (unitless)")
    g.add_argument("--sigma-output", type=float, default=1.0, metavar="X",
                   help="synthetic trace: lognormal sigma of the output lengths (unitless; the tail weight)")
    g.add_argument("--max-output", type=int, default=32768, metavar="TOKENS",
                   help="synthetic trace: output lengths clipped to this many tokens")
    g.add_argument("--seed", type=int, default=0, help="random seed of the synthetic trace")
    g = p.add_argument_group("engine")
    g.add_argument("--ranks", type=int, default=8, metavar="N", help="attention data-parallel ranks (GPUs)")
    g.add_argument("--max-batch-size", type=int, default=512, metavar="N", help="requests per rank per iteration")
    g.add_argument("--max-num-tokens", type=int, default=4608, metavar="TOKENS",
                   help="tokens per rank per iteration (context + generation)")
    g.add_argument("--concurrency", type=int, default=5120, metavar="N",
                   help="requests in flight (closed loop), all ranks together")
    g.add_argument("--kv-tokens", type=int, default=None, metavar="TOKENS",
                   help="KV-cache capacity per rank in tokens (default: unlimited)")
    g.add_argument("--chunked-prefill", action="store_true", help="split long contexts over iterations")
    g.add_argument("--cost", choices=("token", "roofline"), default="token",
                   help="iteration time model. token: linear in tokens, fitted to the blog's table; roofline: "
                        "serving.cost on --hardware")
    g.add_argument("--hardware", default="H200", metavar="NAME", help="serving.hardware row for --cost roofline")
    g = p.add_argument_group("policy")
    g.add_argument("--router", choices=("rr", "heap"), default="rr",
                   help="where new requests go: rr (round-robin) or heap (fewest active prompt tokens)")
    g.add_argument("--timeout-iters", type=int, default=50, metavar="ITERATIONS",
                   help="ADP gate: hold contexts at most this many iterations until every rank has one")
    g.add_argument("--batching-wait-iters", type=int, default=10, metavar="ITERATIONS",
                   help="ADP gate: then hold this many iterations more")
    g.add_argument("--batching", choices=("code", "seed"), default="code",
                   help="batching-wait rule: code (TensorRT-LLM's implementation) or seed (the blog's wording)")
    g = p.add_argument_group("output")
    g.add_argument("--out", default=None, metavar="DIR",
                   help="folder for the PNG plots and metrics.json (default: adp_out in the current directory)")
    g.add_argument("--no-plots", action="store_true", help="print the table only: no Pareto sweep, nothing written")
    g.add_argument("--pareto-scale", type=float, default=3.0, metavar="X",
                   help="Pareto sweep: requests per point = X x concurrency, at least 1000 (0 skips the sweep)")
    g.add_argument("--progress", action="store_true", help="also per-iteration progress of each simulation "
                                                           "(stderr, on a terminal)")
    p.set_defaults(func=_cmd_adp)


def _package_dirs() -> list[str]:
    """The folders of this checkout's (or installation's) packages: no command writes into them."""
    import importlib.util
    import os

    out = []
    for name in ("serving", "moe_ep", "eplb", "microbatch"):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is not None and spec.origin:
            out.append(os.path.realpath(os.path.dirname(spec.origin)))
    return out


def output_dir(out: str | None, command: str) -> str:
    """Where ``command`` writes: ``out`` when given, else ``<cwd>/<command>_out``; an absolute path. Raises
    ``ValueError`` when that is inside a package folder of this project (an installed package or the
    checkout's ``serving/``, ``moe_ep/``, ...)."""
    import os

    path = os.path.abspath(out if out else os.path.join(os.getcwd(), f"{command}_out"))
    real = os.path.realpath(path)
    for pkg in _package_dirs():
        if real == pkg or real.startswith(pkg + os.sep):
            raise ValueError(f"output folder {path} is inside the package folder {pkg}: run from another "
                             f"directory or pass --out DIR")
    return path


def _cmd_adp(args) -> int:
    import json
    import os
    import sys
    import time

    def say(text: str) -> None:
        print(f"[{time.perf_counter() - t0:5.1f} s] {text}", file=sys.stderr, flush=True)

    from .sim import SimConfig
    from .trace import load_trace, synthetic

    for name in ("requests", "ranks", "max_batch_size", "max_num_tokens", "concurrency", "max_output"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if not args.pareto_scale >= 0:
        raise ValueError(f"--pareto-scale={args.pareto_scale} must be >= 0")
    if args.timeout_iters < 0 or args.batching_wait_iters < 0:
        raise ValueError("--timeout-iters and --batching-wait-iters must be >= 0")
    out_dir = None if args.no_plots else output_dir(args.out, "adp")
    t0 = time.perf_counter()
    if args.trace:
        trace = load_trace(args.trace)
    else:
        trace = synthetic(args.requests, args.mean_input, args.mean_output, args.sigma_input, args.sigma_output,
                          max_input=max(1, args.max_num_tokens - args.max_batch_size + 1),
                          max_output=args.max_output, seed=args.seed)
    cost = make_cost(args.cost, args.hardware, args.ranks)
    cfg = SimConfig(num_ranks=args.ranks, max_batch_size=args.max_batch_size, max_num_tokens=args.max_num_tokens,
                    concurrency=args.concurrency, kv_capacity_tokens=args.kv_tokens,
                    chunked_prefill=args.chunked_prefill)
    print(f"trace: {trace.summary()}")
    print(f"engine: {args.ranks} DP ranks, max_batch_size {args.max_batch_size}, max_num_tokens "
          f"{args.max_num_tokens}, concurrency {args.concurrency}, cost {args.cost}"
          + (f" ({args.hardware})" if args.cost == "roofline" else "") + f", router {args.router}")
    sys.stdout.flush()
    results = run_configs(trace, cost, cfg, paper_configs(args.timeout_iters, args.batching_wait_iters),
                          args.router, args.batching, args.progress, say=say)
    compare = not args.trace and args.requests == 16000 and (args.timeout_iters, args.batching_wait_iters) == (50, 10)
    print("\n" + format_table([(n, m) for n, m, _ in results], compare=compare))
    if compare:
        print("cells: ours / TensorRT-LLM's ADP balance blog; the blog's time-weighted balance derived as "
              "TPS / SOL TPS")
    t_main = time.perf_counter() - t0
    pareto_rows = []
    if not args.no_plots and args.pareto_scale:
        def make_trace(load):
            if args.trace:
                return trace
            return synthetic(max(1000, int(args.pareto_scale * load)), args.mean_input, args.mean_output,
                             args.sigma_input, args.sigma_output, max_output=args.max_output, seed=args.seed,
                             max_input=max(1, args.max_num_tokens - args.max_batch_size + 1))
        sys.stdout.flush()
        pareto_rows = pareto_sweep(make_trace, cost, cfg, args.router, say=say)
    written = [] if args.no_plots else write_plots(out_dir, results, pareto_rows, args.ranks, say=say)
    if not args.no_plots:
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "metrics.json")
        doc = {"table": {n: m for n, m, _ in results}, "seed": PAPER_ROWS,
               "pareto": [{"timeout_iters": s[0], "batching_wait_iters": s[1], "concurrency": load, **m}
                          for s, load, m in pareto_rows]}
        with open(path + ".tmp", "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(path + ".tmp", path)
        written.append(path)
    for w in written:
        print(f"wrote {w}")
    sys.stdout.flush()
    print(f"time: table {t_main:.1f} s, total {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0
