"""``plan``: the RCSD PD planner on the command line.

    python -m serving plan --model deepseek-r1 --hardware B64 --nodes 16 --isl 1024 --osl 256
    python -m serving plan --config job.json     # same keys as the long options, "-" -> "_"
    python -m serving plan --paper               # the RCSD paper's six (ISL, OSL) panels, summary table

Bad input prints one ``error:`` line on stderr and exits 2; output is printed only once the whole plan
is computed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

from .hardware import HARDWARE
from .plan import MODELS, SLO, Cluster, Knobs, PlanError, Workload, format_plan, plan

__all__ = ["add_plan_parser", "build_parser", "run_plan", "main", "PAPER_PANELS"]

# The RCSD paper's (seed 000) Fig. 3 panels (ISL, OSL) and the best split it reports where the text says so.
PAPER_PANELS = [(512, 512, ""), (1024, 256, "10P6D (short)"), (1024, 1024, ""),
                (1024, 4096, "6P10D / 8P8D (long)"), (2048, 1024, ""), (2048, 2048, "")]
PAPER_SPLITS = ("4P12D", "6P10D", "8P8D", "10P6D")

# key in a config file -> (type, default)
_FIELDS = {
    "model": (str, "deepseek-r1"), "hardware": (str, "B64"), "nodes": (int, 16), "gpus_per_node": (int, None),
    "memory_gb": (float, None), "intra_gb_s": (float, None), "inter_gb_s": (float, None),
    "isl": (int, 1024), "osl": (int, 1024), "cache_hit": (float, 0.0), "rate": (float, None),
    "concurrency": (int, None), "ttft": (float, 1.0), "tpot": (float, 0.2),
    "attention_cost": (str, "paper"), "search": (str, "ratio"), "omega_frac": (float, 0.1),
    "compute_eff": (float, 0.5), "hbm_eff": (float, 0.7), "link_eff": (float, 0.7), "mem_util": (float, 0.8),
}


# --help text of each option, with its unit; "(default: X)" is added from _FIELDS.
_HELP = {
    "model": "model to plan for: " + ", ".join(MODELS),
    "hardware": "GPU type (serving.hardware): " + ", ".join(HARDWARE),
    "nodes": "nodes in the cluster (count)",
    "gpus_per_node": "GPUs per node (count; default: the hardware's)",
    "memory_gb": "HBM per GPU in GB (1e9 bytes; default: the hardware's)",
    "intra_gb_s": "GPU-to-GPU bandwidth inside a node, per GPU per direction, in GB/s (default: the hardware's)",
    "inter_gb_s": "network bandwidth between nodes, per GPU per direction, in GB/s (default: the hardware's)",
    "isl": "input (prompt) length per request, in tokens",
    "osl": "output length per request, in tokens",
    "cache_hit": "share of the prompt found in the prefix cache, a fraction in [0, 1)",
    "rate": "offered load in requests/s (default: from --concurrency, else none: the plan's own maximum)",
    "concurrency": "requests in flight (count); without --rate the offered load is concurrency / (ttft + osl "
                   "x tpot) requests/s (Little's law at the SLO)",
    "ttft": "time-to-first-token SLO in seconds",
    "tpot": "time-per-output-token SLO in seconds per token",
    "attention_cost": "attention FLOPs: 'paper' (24 h^2 per token per layer, as the RCSD paper) or 'model' "
                      "(from the model's configuration)",
    "search": "decode matching: 'paper' (one bisection at the prefill rate, the RCSD paper's Algorithm 1) or "
              "'ratio' (one per replication ratio)",
    "omega_frac": "expert-parallel overhead per extra EP rank, a fraction: the MoE time is scaled by "
                  "1 + omega_frac x (EP - 1)",
    "compute_eff": "achieved share of the GPU's peak tensor FLOP/s, a fraction in (0, 1]",
    "hbm_eff": "achieved share of the HBM bandwidth, a fraction in (0, 1]",
    "link_eff": "achieved share of the link bandwidths, a fraction in (0, 1]",
    "mem_util": "usable share of each GPU's HBM, a fraction in (0, 1]",
}


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE",
                   help="JSON file (YAML too when PyYAML is installed) with the options below as keys "
                        "(\"-\" written \"_\"); options given on the command line override it")
    for key, (typ, default) in _FIELDS.items():
        meta = {str: "NAME", int: "N", float: "X"}[typ]
        text = _HELP[key] + ("" if default is None or "default:" in _HELP[key] else f" (default: {default})")
        p.add_argument("--" + key.replace("_", "-"), dest=key, type=typ, default=None, metavar=meta,
                       help=text.replace("%", "%%"))
    p.add_argument("--degrade", action="store_true", help="relax an SLO nothing meets to the closest reachable")
    p.add_argument("--paper", action="store_true",
                   help="run the RCSD paper's six (ISL, OSL) panels and print the summary")
    p.set_defaults(func=run_plan)


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``plan`` on an argparse subparsers object; ``args.func(args)`` returns the exit code."""
    p = subparsers.add_parser("plan", help="RCSD PD planner: P:D split, instances and parallelism per stage",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    return p


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m serving.cli_plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    return p


def _load_config(path: str) -> dict:
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise PlanError(f"cannot read config {path!r}: {e.strerror}") from None
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError:
            raise PlanError(f"{path!r} is YAML but PyYAML is not installed; pip install pyyaml or use JSON") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise PlanError(f"malformed YAML in {path!r}: {str(e).splitlines()[0]}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"malformed JSON in {path!r}: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(data, dict):
        raise PlanError(f"config {path!r} must hold a mapping of options, got {type(data).__name__}")
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise PlanError(f"unknown key(s) {', '.join(unknown)} in {path!r}; known: {', '.join(_FIELDS)}")
    out = {}
    for key, value in data.items():
        typ = _FIELDS[key][0]
        if value is None:
            out[key] = None
            continue
        if isinstance(value, bool) or (typ is int and isinstance(value, float) and not value.is_integer()):
            raise PlanError(f"{key} in {path!r} must be {typ.__name__}, got {value!r}")
        try:
            out[key] = typ(value)
        except (TypeError, ValueError):
            raise PlanError(f"{key} in {path!r} must be {typ.__name__}, got {value!r}") from None
    return out


def _resolve(args: argparse.Namespace) -> dict:
    opts = {k: d for k, (_t, d) in _FIELDS.items()}
    if args.config:
        opts.update(_load_config(args.config))
    for key in _FIELDS:
        if getattr(args, key, None) is not None:
            opts[key] = getattr(args, key)
    return opts


def _inputs(opts: dict):
    if opts["model"] not in MODELS:
        raise PlanError(f"unknown model {opts['model']!r}; known: {', '.join(MODELS)}")
    if opts["hardware"] not in HARDWARE:
        raise PlanError(f"unknown hardware {opts['hardware']!r}; known: {', '.join(HARDWARE)}")
    hw = HARDWARE[opts["hardware"]]
    over = {}
    for key, fld, scale in (("gpus_per_node", "gpus_per_node", 1), ("memory_gb", "memory_bytes", 1e9),
                            ("intra_gb_s", "intra_node_bytes_per_s", 1e9), ("inter_gb_s", "inter_node_bytes_per_s", 1e9)):
        if opts[key] is not None:
            if not opts[key] > 0 or not math.isfinite(opts[key]):
                raise PlanError(f"{key} must be > 0 (got {opts[key]})")
            over[fld] = type(getattr(hw, fld))(opts[key] * scale)
    hw = dataclasses.replace(hw, **over)
    for key in ("compute_eff", "hbm_eff", "link_eff", "mem_util"):
        if not 0 < opts[key] <= 1:
            raise PlanError(f"{key} must be in (0, 1] (got {opts[key]})")
    if not opts["omega_frac"] >= 0:
        raise PlanError(f"omega_frac must be >= 0 (got {opts['omega_frac']})")
    if opts["search"] not in ("paper", "ratio"):
        raise PlanError(f"search must be 'paper' or 'ratio' (got {opts['search']!r})")
    knobs = Knobs(compute_eff=opts["compute_eff"], hbm_eff=opts["hbm_eff"], link_eff=opts["link_eff"],
                  mem_util=opts["mem_util"], omega_frac=opts["omega_frac"], attention_cost=opts["attention_cost"],
                  search=opts["search"])
    workload = Workload(opts["isl"], opts["osl"], opts["cache_hit"], opts["rate"], opts["concurrency"])
    return MODELS[opts["model"]], Cluster(opts["nodes"], hw), workload, SLO(opts["ttft"], opts["tpot"]), knobs


def paper_summary(model, cluster, slo, knobs, degrade=False) -> str:
    """RCSD's panels: best split ours vs the paper's, margins over the other splits and the baselines."""
    head = (f"{'ISL':>5} {'OSL':>5} {'best split':>10} {'paper':>20} {'RCSD tok/s/GPU':>15} "
            f"{'vs best other of 4P12D..10P6D':>30} {'vs colocated':>13} {'vs splitwise':>13} {'RCSD = oracle':>14}")
    lines = [head]
    for isl, osl, paper in PAPER_PANELS:
        res = plan(model, cluster, Workload(isl, osl), slo, knobs, degrade)
        by = {r.name: r.tok_s_per_gpu for r in res.splits}
        others = [by[s] for s in PAPER_SPLITS if s in by and s != res.best_split.name]
        nxt = max(others) if others else 0.0
        col, sw = res.baselines[0].tok_s_per_gpu, res.baselines[1].tok_s_per_gpu
        ratio = lambda a, b: f"{a / b:.2f}x" if b > 0 else "inf"  # noqa: E731
        lines.append(f"{isl:>5} {osl:>5} {res.best_split.name:>10} {paper or '-':>20} {res.tok_s_per_gpu:>15.1f} "
                     f"{ratio(res.tok_s_per_gpu, nxt):>30} {ratio(res.tok_s_per_gpu, col):>13} "
                     f"{ratio(res.tok_s_per_gpu, sw):>13} "
                     f"{str(abs(res.tok_s_per_gpu - res.exhaustive_tok_s_per_gpu) < 1e-6):>14}")
    return "\n".join(lines)


def run_plan(args: argparse.Namespace) -> int:
    try:
        model, cluster, workload, slo, knobs = _inputs(_resolve(args))
        if args.paper:
            text = paper_summary(model, cluster, slo, knobs, args.degrade)
        else:
            text = format_plan(plan(model, cluster, workload, slo, knobs, degrade=args.degrade))
    except (PlanError, KeyError) as e:
        print(f"error: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
