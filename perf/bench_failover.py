"""Failover on CPU: DeepSeek-V3 decode at EP144 (288 and 432 slots), the share of routed selections lost
as 1, 2, 4, 8 GPUs die (GPUs 0..d-1: one node at 8), and the survivors' balancedness.

- ``none``: DeepEP-style masking, no failover: a selection mapped (``balanced`` policy, all slots live)
  to a slot on a dead GPU is lost;
- ``mask``: ``map_topk(..., slot_mask=live)``: lost only where the expert has no live replica;
- ``replan``: ``replan_on_survivors`` then ``map_topk`` with the mask.

Balancedness = mean / max selections over the live GPUs (1.0 = even). Routing from ``eplb.synthetic``,
placement from ``eplb.rebalance_experts`` on the workload's statistics.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402


def main(argv=None) -> int:
    p = _common.parser("bench_failover.py", __doc__)
    p.add_argument("--tokens", type=int, default=4608, help="decode tokens routed in the step")
    p.add_argument("--slots", type=int, nargs="+", default=[288, 432], help="physical slots per layer")
    p.add_argument("--gpus", type=int, default=144, help="EP size")
    p.add_argument("--dead", type=int, nargs="+", default=[1, 2, 4, 8], help="dead GPU counts (GPUs 0..d-1)")
    p.add_argument("--experts", type=int, default=256, help="routed experts")
    p.add_argument("--png", metavar="PATH", default=None, help="plot the lost share (needs matplotlib)")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        _common.smoke_defaults(args, p, argv, tokens=64, slots=[24], gpus=8, dead=[1, 2], experts=16)
    import json

    import numpy as np
    import torch

    import eplb
    from eplb.synthetic import Workload, sample_topk, simulate_counts

    groups = 8 if args.experts % 8 == 0 else 1
    wl = Workload(num_layers=1, num_experts=args.experts, num_groups=groups, topk_groups=min(4, groups),
                  topk=8 if args.experts >= 32 else 4)
    w = np.asarray(simulate_counts(wl, 1, seed=0)).reshape(-1, 1, args.experts).sum(0)
    topk = sample_topk(wl, args.tokens, seed=1)
    G = args.gpus
    rows, table = [], []
    for P in args.slots:
        phy2log, l2p, lc = eplb.rebalance_experts(w, P, groups, max(1, G // 8), G)
        spg = P // G
        kw = dict(num_gpus=G, num_slots=P)
        base = eplb.map_topk(topk, l2p[0], lc[0], "balanced", **kw)
        for d in args.dead:
            mask = torch.ones(P, dtype=torch.bool)
            mask[:d * spg] = False
            live_g = torch.arange(G) >= d
            n = int((topk >= 0).sum())
            lost_none = int(((base >= 0) & ~mask[base.clamp_min(0)]).sum())

            def bal(out):
                ok = out >= 0
                loads = torch.bincount(out[ok] // spg, minlength=G)[live_g].double()
                return float(loads.mean() / loads.max()) if loads.max() > 0 else 1.0
            lost = torch.zeros((), dtype=torch.int64)
            out = eplb.map_topk(topk, l2p[0], lc[0], "balanced", slot_mask=mask, lost_out=lost, **kw)
            assert not bool((~mask[out[out >= 0]]).any())
            new, l2p2, lc2 = eplb.replan_on_survivors(phy2log[0], range(d), G, w[0])
            lost2 = torch.zeros((), dtype=torch.int64)
            out2 = eplb.map_topk(topk, l2p2, lc2, "balanced", slot_mask=new >= 0, lost_out=lost2, **kw)
            moved = int(((new != phy2log[0]) & (new >= 0)).sum())
            r = dict(slots=P, dead=d, lost_none=lost_none / n, lost_mask=int(lost) / n, lost_replan=int(lost2) / n,
                     bal_mask=bal(out), bal_replan=bal(out2), moved=moved)
            table.append(r)
            for k in ("lost_none", "lost_mask", "lost_replan", "bal_mask", "bal_replan", "moved"):
                rows.append(dict(bench="bench_failover", case=f"P{P} dead{d}", metric=k, value=r[k],
                                 unit="share" if k.startswith("lost") else ("slots" if k == "moved" else "ratio"),
                                 p10=None, p90=None, iterations=1, baseline=r["lost_none"] if k != "lost_none" else None,
                                 limit=0.0 if k.startswith("lost") else 1.0, ratio=None, valid=True))
    print(f"{'slots':>5} {'dead':>4} {'lost none':>10} {'lost mask':>10} {'lost replan':>11} "
          f"{'bal mask':>8} {'bal replan':>10} {'moved':>5}")
    for r in table:
        print(f"{r['slots']:>5} {r['dead']:>4} {100 * r['lost_none']:>9.2f}% {100 * r['lost_mask']:>9.2f}% "
              f"{100 * r['lost_replan']:>10.2f}% {r['bal_mask']:>8.3f} {r['bal_replan']:>10.3f} {r['moved']:>5}")
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(_common.header("bench_failover", args.cpu_smoke, "cpu", argv)) + "\n")
            for row in rows:
                f.write(json.dumps({**{k: row.get(k) for k in _common.ROW_KEYS}, "method": _common.COUNTED}) + "\n")
    if args.png:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("--png: matplotlib is not installed; no plot")
            return 0
        fig, ax = plt.subplots(figsize=(6, 4))
        for P in args.slots:
            rs = [r for r in table if r["slots"] == P]
            ax.plot([r["dead"] for r in rs], [100 * r["lost_none"] for r in rs], "o--", label=f"{P} slots, no failover")
            ax.plot([r["dead"] for r in rs], [100 * r["lost_mask"] for r in rs], "o-", label=f"{P} slots, slot_mask")
        ax.set_xlabel("dead GPUs")
        ax.set_ylabel("routed selections lost (%)")
        ax.legend()
        fig.savefig(args.png, dpi=120, bbox_inches="tight")
    return 0


if __name__ == "__main__":
    sys.exit(main())
