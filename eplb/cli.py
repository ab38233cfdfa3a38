"""``python -m eplb``: plan a placement from statistics, score a placement, write synthetic statistics.

    python -m eplb simulate -o stats.npy --later later.npy --preset deepseek-v3-decode
    python -m eplb plan stats.npy --replicas 288 --gpus 144 --nodes 18 --groups 8 -o placement.json
    python -m eplb report later.npy placement.json

Bad input (a corrupt, truncated or garbage file, wrong keys or shapes, NaN or negative counts, an
option out of range such as ``--gpus 0``, slots not divisible by GPUs, ...) prints one
``error: ...`` line naming the file or option, exits with status 2 and writes nothing; so do a
missing file or a folder given as input, GPUs that do not divide over nodes, and statistics whose
shape differs from ``--layers`` / ``--experts`` when given. All-zero loads print a warning. An
existing output file is replaced only with ``--force``. A command's output files are written all or
none, each atomically. ``plan`` prints, per layer, the policy its placement follows (groups kept on
one node, or spread). A closed stdout (``... | head``) ends the
command quietly with status 141.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Optional

import numpy as np
import torch

from moe_ep.errors import MoEEPError

from . import metrics
from .io import atomic_write_all, load_placement, load_stats, placement_writer, stats_writer
from .placement import DEFAULT_HEDGE, POLICIES, rebalance_experts
from .synthetic import PRESETS, simulate_counts

__all__ = ["main"]

LAYER_CHUNK = 8  # layers planned per call (plans are per layer, so chunking changes nothing but the progress bar)


class CliError(MoEEPError):
    pass


class Progress:
    """A one-line text bar on stderr (only on a terminal unless forced)."""

    def __init__(self, label: str, mode: str):
        self.label = label
        self.on = mode == "always" or (mode == "auto" and sys.stderr.isatty())
        self.t0 = time.perf_counter()

    def __call__(self, done: int, total: int) -> None:
        if not self.on:
            return
        width = 30
        fill = int(width * done / max(total, 1))
        sys.stderr.write(f"\r{self.label} [{'#' * fill}{'.' * (width - fill)}] {done}/{total} "
                         f"{time.perf_counter() - self.t0:.1f}s")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _histogram(loads: np.ndarray, bins: int = 10, width: int = 40) -> list[str]:
    """Text histogram of per-GPU load relative to each layer's mean, pooled over layers."""
    rel = (loads / np.maximum(loads.mean(1, keepdims=True), 1e-300)).ravel()
    lo, hi = float(rel.min()), float(rel.max())
    if hi - lo < 1e-9:
        return [f"  {lo:5.2f}       |{'#' * width} {rel.size}"]
    counts, edges = np.histogram(rel, bins=bins, range=(lo, hi))
    top = max(int(counts.max()), 1)
    return [f"  {a:5.2f}-{b:5.2f} |{'#' * int(round(width * c / top)):<{width}} {c}"
            for a, b, c in zip(edges[:-1], edges[1:], counts)]


def _report_lines(phy2log: np.ndarray, stats: np.ndarray, num_gpus: int, before: Optional[np.ndarray],
                  previous: Optional[np.ndarray], label_before: str) -> list[str]:
    L, P = phy2log.shape
    per_layer = metrics.balancedness(phy2log, stats, num_gpus, per_layer=True)
    lines = []
    after = f"{per_layer.mean():.4f}"
    if before is not None:
        b0 = metrics.balancedness(before, stats, num_gpus)
        lines.append(f"balancedness (mean/max GPU load, layer average): before {b0:.4f} ({label_before}) -> after {after}")
    else:
        lines.append(f"balancedness (mean/max GPU load, layer average): {after} ({label_before})")
    worst = int(per_layer.argmin())
    lines.append(f"worst layer: {worst} ({per_layer[worst]:.4f}); best layer: {int(per_layer.argmax())} "
                 f"({per_layer.max():.4f})")
    lines.append(f"same-GPU duplicate slots: {metrics.same_gpu_duplicates(phy2log, num_gpus)}")
    if previous is not None:
        moved = metrics.slots_moved(phy2log, previous, num_gpus)
        lines.append(f"slots moved vs previous: {moved} of {L * P} ({100.0 * moved / (L * P):.1f}%)")
    lines.append("per-GPU load relative to the layer mean (all layers):")
    lines.extend(_histogram(metrics.gpu_loads(phy2log, stats, num_gpus)))
    return lines


def _png_writer(phy2log: np.ndarray, stats: np.ndarray, num_gpus: int):
    """The function writing the per-GPU load heat map as PNG to a given (temporary) file name."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    loads = metrics.gpu_loads(phy2log, stats, num_gpus)
    rel = loads / np.maximum(loads.mean(1, keepdims=True), 1e-300)
    fig, ax = plt.subplots(figsize=(10, 4))
    im = ax.imshow(rel, aspect="auto", cmap="viridis")
    ax.set_xlabel("GPU")
    ax.set_ylabel("layer")
    ax.set_title("per-GPU load / layer mean")
    fig.colorbar(im, ax=ax)

    def write(tmp):
        try:
            fig.savefig(tmp, format="png", dpi=100)
        finally:
            plt.close(fig)
    return write


def _have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _baseline(L: int, E: int, P: int, num_gpus: int) -> Optional[np.ndarray]:
    """No replicas, experts in order (the placement without EPLB), when E slots divide over the GPUs."""
    if E % num_gpus != 0:
        return None
    return np.tile(np.arange(E), (L, 1))


def _check_outputs(force: bool, *opts) -> None:
    """Output paths usable before any work: (option, path) pairs; None paths are skipped. An existing file
    is replaced only with ``--force``."""
    for opt, path in opts:
        if path is None:
            continue
        if os.path.isdir(path):
            raise CliError(f"{opt} {path} is a directory; give a file name")
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise CliError(f"{opt} {path}: folder {folder} does not exist")
        if os.path.exists(path) and not force:
            raise CliError(f"{opt} {path} exists; pass --force to replace it")


def _check_shape(stats: np.ndarray, path: str, layers: Optional[int], experts: Optional[int]) -> None:
    """The statistics' [.., layers, experts] against --layers / --experts, when given."""
    L, E = stats.shape[-2:]
    for opt, want, got, what in (("--layers", layers, L, "layers"), ("--experts", experts, E, "experts")):
        if want is not None and got != want:
            raise CliError(f"{path} has {got} {what} (shape {list(stats.shape)}), but {opt} {want}")


def _warn_zero_loads(stats: np.ndarray, path: str) -> None:
    """A warning on stderr where loads are all zero: any placement then scores 1.0, which says nothing."""
    per_layer = stats.reshape(-1, *stats.shape[-2:]).sum(axis=(0, 2))
    zero = np.flatnonzero(per_layer == 0)
    if zero.size == per_layer.size:
        print(f"warning: {path}: every load is zero; the placement is arbitrary and its balancedness (1.0) "
              "means nothing", file=sys.stderr)
    elif zero.size:
        print(f"warning: {path}: {zero.size} of {per_layer.size} layers have zero load (layers "
              f"{_ranges(zero)}); their placement is arbitrary", file=sys.stderr)


def _ranges(idx) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    out, idx = [], [int(i) for i in idx]
    start = prev = idx[0] if idx else None
    for i in idx[1:] + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        start = prev = i
    return ", ".join(out)


def _policy_per_layer(phy2log: np.ndarray, E: int, requested: str, groups: int, nodes: int, gpus: int) -> str:
    """Which policy each layer's placement follows, read from the placement itself: "hierarchical" where every
    expert group sits on one node (group-limited routing stays node-limited), else "global"."""
    L, P = phy2log.shape
    if nodes == 1:
        return f"one node: node locality does not apply ({requested})"
    if E % groups != 0 or P % nodes != 0:
        kept = np.zeros(L, dtype=bool)
    else:
        node_of_slot = np.arange(P) // (P // nodes)
        group_of_slot = phy2log // (E // groups)
        kept = np.array([all(len(set(node_of_slot[group_of_slot[layer] == g].tolist())) <= 1 for g in range(groups))
                         for layer in range(L)])
    parts = []
    for name, sel in (("hierarchical (each group on one node)", kept), ("global (groups across nodes)", ~kept)):
        if sel.any():
            parts.append(f"{name} on {int(sel.sum())} of {L} layers ({_ranges(np.flatnonzero(sel))})")
    why = ""
    if groups % nodes != 0:
        why = f"; --groups {groups} does not divide over --nodes {nodes}, so no layer can keep groups on one node"
    return f"policy {requested}: " + "; ".join(parts) + why


def cmd_plan(a) -> int:
    if a.gpus % a.nodes != 0:
        raise CliError(f"--gpus {a.gpus} does not divide over --nodes {a.nodes} (GPUs per node must be whole)")
    _check_outputs(a.force, ("--output", a.output), ("--pt", a.pt), ("--png", a.png))
    if not a.output.lower().endswith((".json", ".pt")):
        raise CliError(f"--output {a.output}: use a .json or .pt file name")
    if a.pt is not None and not a.pt.lower().endswith(".pt"):
        raise CliError(f"--pt {a.pt}: use a .pt file name")
    if a.png is not None and not _have_matplotlib():
        raise CliError("--png needs matplotlib (pip install matplotlib); run without --png for the text report")
    stats = load_stats(a.stats)
    _check_shape(stats, a.stats, a.layers, a.experts)
    _warn_zero_loads(stats, a.stats)
    L, E = stats.shape[-2:]
    previous = None
    if a.previous is not None:
        previous, _ = load_placement(a.previous)
        if previous.shape != (L, a.replicas):
            raise CliError(f"--previous {a.previous}: phy2log shape {previous.shape} must be [{L}, {a.replicas}]")
    kw = dict(max_replicas_per_expert=a.max_replicas_per_expert, policy=a.policy, hedge=a.hedge,
              stickiness=a.stickiness, one_copy_per_gpu=not a.deepseek_counts)
    # Validate everything once on a single layer before the long run (errors before any output).
    rebalance_experts(stats[..., :1, :], a.replicas, a.groups, a.nodes, a.gpus, **kw,
                      previous=None if previous is None else previous[:1])
    bar = Progress("planning", a.progress)
    parts = []
    for lo in range(0, L, LAYER_CHUNK):
        hi = min(L, lo + LAYER_CHUNK)
        p, _, _ = rebalance_experts(stats[..., lo:hi, :], a.replicas, a.groups, a.nodes, a.gpus, **kw,
                                    previous=None if previous is None else previous[lo:hi])
        parts.append(p.numpy())
        bar(hi, L)
    phy2log = np.concatenate(parts, 0)
    from .placement import log2phy_from_phy2log
    log2phy, logcnt = log2phy_from_phy2log(phy2log, E)
    phy_t = torch.from_numpy(phy2log)
    meta = {"num_replicas": a.replicas, "num_groups": a.groups, "num_nodes": a.nodes, "num_gpus": a.gpus,
            "policy": a.policy, "stats": os.path.basename(a.stats)}
    outputs = [(a.output, placement_writer(a.output, phy_t, log2phy, logcnt, meta))]
    if a.pt is not None:
        outputs.append((a.pt, placement_writer(a.pt, phy_t, log2phy, logcnt, meta)))
    if a.png is not None:
        outputs.append((a.png, _png_writer(phy2log, stats, a.gpus)))
    before = previous if previous is not None else _baseline(L, E, a.replicas, a.gpus)
    label = "previous placement" if previous is not None else "no replicas, experts in order"
    if before is None:
        label = f"after; no baseline: {E} experts do not divide over {a.gpus} GPUs"
    lines = _report_lines(phy2log, stats, a.gpus, before, previous, label)
    if a.nodes > 1:  # the node-locality cost beside the balancedness
        tg = a.topk_groups if a.topk_groups is not None else max(1, a.groups // 2)
        x = metrics.cross_node_per_token(phy2log, stats, a.gpus, a.nodes, a.groups, a.topk, tg)
        lines.insert(1, f"cross-node selections per token: {x:.2f} (remote nodes a token is sent to; top-{a.topk} "
                        f"in {min(tg, a.groups)} of {a.groups} groups)")
    atomic_write_all(outputs)  # all files or none, after everything that can fail on the input
    written = ", ".join(p for p, _ in outputs)
    print(f"eplb plan: {L} layers x {E} experts -> {a.replicas} slots on {a.gpus} GPUs ({a.nodes} nodes, "
          f"{a.groups} groups), policy {a.policy}; written {written}")
    print(_policy_per_layer(phy2log, E, a.policy, a.groups, a.nodes, a.gpus))
    print("\n".join(lines))
    return 0


def cmd_report(a) -> int:
    stats = load_stats(a.stats)
    _check_shape(stats, a.stats, a.layers, a.experts)
    phy2log, meta = load_placement(a.placement)
    _warn_zero_loads(stats, a.stats)
    num_gpus = a.gpus if a.gpus is not None else meta.get("num_gpus")
    if num_gpus is None:
        raise CliError(f"{a.placement} does not record num_gpus; pass --gpus")
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1:
        raise CliError(f"{a.placement}: recorded num_gpus={num_gpus!r} is not a positive int; pass --gpus")
    L, E = stats.shape[-2:]
    if phy2log.shape[0] != L:
        raise CliError(f"{a.placement} has {phy2log.shape[0]} layers but {a.stats} has {L}")
    if phy2log.min() < 0 or phy2log.max() >= E:
        raise CliError(f"{a.placement} places expert ids {phy2log.min()}..{phy2log.max()}, but {a.stats} has {E} "
                       f"experts (ids 0..{E - 1}): were they made for the same model?")
    if phy2log.shape[1] % num_gpus != 0:
        raise CliError(f"slots={phy2log.shape[1]} must be divisible by num_gpus={num_gpus}")
    missing = int(sum(E - len(np.unique(row)) for row in phy2log))
    lines = [f"eplb report: {a.placement} ({phy2log.shape[1]} slots on {num_gpus} GPUs) on {a.stats} ({L} x {E})"]
    if missing:
        lines.append(f"experts without a slot: {missing} (summed over layers)")
    lines += _report_lines(phy2log, stats, int(num_gpus), None, None, "this placement")
    print("\n".join(lines))  # all or nothing: every check is done
    return 0


def cmd_simulate(a) -> int:
    for path in (a.output, a.later):
        if path is not None and not path.lower().endswith((".npy", ".pt", ".json")):
            raise CliError(f"{path}: use a .npy, .pt or .json file name ([steps, layers, experts])")
    _check_outputs(a.force, ("--output", a.output), ("--later", a.later))
    wl = PRESETS[a.preset]
    over = {k: v for k, v in (("num_layers", a.layers), ("num_steps", a.steps), ("tokens_per_step", a.tokens))
            if v is not None}
    try:
        wl = dataclasses.replace(wl, **over)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    counts = simulate_counts(wl, 2 if a.later else 1, seed=a.seed, progress=Progress("simulating", a.progress))
    outputs = [(a.output, stats_writer(a.output, counts[0]))]
    if a.later:
        outputs.append((a.later, stats_writer(a.later, counts[1])))
    atomic_write_all(outputs)
    print(f"eplb simulate: {a.preset}, {wl.num_steps} steps x {wl.num_layers} layers x {wl.num_experts} experts "
          f"({wl.tokens_per_step} tokens/step, top-{wl.topk}), seed {a.seed}; written {a.output}"
          + (f" and the next window {a.later}" if a.later else ""))
    return 0


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise CliError(message)


def _int_min(minimum: int):
    """argparse type: an int >= minimum (argparse names the option in the error)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
        return v
    parse.__name__ = f"int >= {minimum}"
    return parse


def _float_nonneg(text: str) -> float:
    """argparse type: a finite float >= 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}") from None
    if not np.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return v


POSITIVE = _int_min(1)


def _prog() -> str:
    arg0 = os.path.basename(sys.argv[0]) if sys.argv else ""
    return arg0 if arg0.startswith("moe-ep") else "python -m eplb"


def _parser() -> argparse.ArgumentParser:
    from . import __version__

    p = _Parser(prog=_prog(), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"eplb (moe-ep) {__version__}")
    sub = p.add_subparsers(dest="command", metavar="{plan,report,simulate}", parser_class=_Parser)
    pl = sub.add_parser("plan", help="plan a placement from statistics ([L, E] or [S, L, E])")
    pl.add_argument("stats", help="statistics file: .npy, .pt, .json or .csv")
    pl.add_argument("--replicas", type=POSITIVE, required=True, help="physical slots per layer (multiple of --gpus)")
    pl.add_argument("--gpus", type=POSITIVE, required=True)
    pl.add_argument("--nodes", type=POSITIVE, default=1)
    pl.add_argument("--groups", type=POSITIVE, default=1, help="expert groups (hierarchical policy)")
    pl.add_argument("--policy", choices=POLICIES, default="auto")
    pl.add_argument("--max-replicas-per-expert", type=POSITIVE, default=None)
    pl.add_argument("--deepseek-counts", action="store_true",
                    help="DeepSeek EPLB's replica counts (a hot expert may get more copies than GPUs; some share "
                         "a GPU) instead of at most one copy of an expert per GPU")
    pl.add_argument("--topk", type=POSITIVE, default=8, help="experts per token, for the cross-node line")
    pl.add_argument("--topk-groups", type=POSITIVE, default=None, help="groups per token (default: half)")
    pl.add_argument("--hedge", type=_float_nonneg, default=DEFAULT_HEDGE, help="robustness weight for [S, L, E] input")
    pl.add_argument("--previous", default=None, help="placement in force now (.json/.pt): keep experts in place")
    pl.add_argument("--stickiness", type=_float_nonneg, default=0.03,
                    help="keep experts in place while the robust max GPU load stays within 1 + this of a fresh plan")
    pl.add_argument("-o", "--output", required=True, help="placement file (.json or .pt)")
    pl.add_argument("--pt", default=None, help="also write the placement as .pt")
    pl.add_argument("--png", default=None, help="per-GPU load heat map (needs matplotlib)")
    pl.add_argument("--progress", choices=("auto", "always", "never"), default="auto")
    pl.add_argument("--force", action="store_true", help="replace output files that exist")
    pl.add_argument("--layers", type=POSITIVE, default=None, help="expected layers (checked against the statistics)")
    pl.add_argument("--experts", type=POSITIVE, default=None, help="expected experts (checked against the statistics)")
    pl.set_defaults(fn=cmd_plan)
    rp = sub.add_parser("report", help="score a placement file against statistics")
    rp.add_argument("stats")
    rp.add_argument("placement")
    rp.add_argument("--gpus", type=POSITIVE, default=None, help="GPUs (default: from the placement file)")
    rp.add_argument("--layers", type=POSITIVE, default=None, help="expected layers (checked against the statistics)")
    rp.add_argument("--experts", type=POSITIVE, default=None, help="expected experts (checked against the statistics)")
    rp.set_defaults(fn=cmd_report)
    sm = sub.add_parser("simulate", help="write synthetic per-step statistics [S, L, E]")
    sm.add_argument("-o", "--output", required=True)
    sm.add_argument("--later", default=None, help="also write the next (drifted) window here")
    sm.add_argument("--preset", choices=sorted(PRESETS), default="deepseek-v3-decode")
    sm.add_argument("--layers", type=POSITIVE, default=None)
    sm.add_argument("--steps", type=POSITIVE, default=None)
    sm.add_argument("--tokens", type=POSITIVE, default=None, help="tokens per step")
    sm.add_argument("--seed", type=_int_min(0), default=0)
    sm.add_argument("--progress", choices=("auto", "always", "never"), default="auto")
    sm.add_argument("--force", action="store_true", help="replace output files that exist")
    sm.set_defaults(fn=cmd_simulate)
    return p


def _quiet_stdout() -> None:
    """After a broken pipe: point stdout at /dev/null so the interpreter's final flush stays quiet."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout without a file descriptor (captured)
        pass


def main(argv=None) -> int:
    """Run one command; returns the exit status (0 ok, 2 bad input: one ``error:`` line on stderr)."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            sys.stderr.write(parser.format_usage())
            raise CliError("choose a command: plan, report or simulate (python -m eplb COMMAND --help)")
        rc = args.fn(args)
        sys.stdout.flush()  # a closed pipe shows up here, inside the handler below
        return rc
    except BrokenPipeError:
        # The reader went away (python -m eplb plan ... | head): the work is done and written; exit
        # quietly with the status a shell gives a tool ended by SIGPIPE (128 + 13).
        _quiet_stdout()
        return 141
    except (CliError, ValueError, TypeError, OSError, RuntimeError) as exc:
        msg = " ".join(str(exc).split()) or type(exc).__name__
        print(f"error: {msg}", file=sys.stderr)
        return 2
