"""Expert placement: which logical expert every physical slot holds (DeepSeek EPLB interface).

Algorithm (vectorised over layers, numpy):

1. Planning load and scenarios. `[L, E]` statistics are used as they are (one scenario). Per-step
   statistics `[S, L, E]` are cut into up to 8 chunks of consecutive steps (the scenarios); the
   planning load is their mean plus ``hedge / 2`` standard deviations.
2. Replica counts: greedy water-filling, each extra slot to the expert with the highest load per
   replica (minimises the largest slot), at most ``max_replicas_per_expert`` and, by default, at most
   one replica per GPU of the scope (global: all GPUs, hierarchical: the node's GPUs): a second copy
   on a GPU takes no load off it, and with replicas chosen evenly it doubles that GPU's share of the
   expert. ``one_copy_per_gpu=False`` drops that cap: DeepSeek EPLB's counts.
3. Packing in rounds: slots sorted by load per replica, descending; round r gives the next
   ``num_gpus`` slots, largest first, to the GPUs in increasing order of their current load. Every
   GPU gets exactly one slot per round (equal slots per GPU by construction); with two slots per
   GPU this is the optimal largest-with-smallest pairing.
4. Same-GPU duplicates are swapped away (with the slot of closest load on a GPU that lacks the
   expert; only an expert with more replicas than the scope has GPUs keeps some), then a swap
   search (`eplb.search`) lowers every layer's most loaded GPU while it pays.
   It scores a GPU by its *robust* load, mean + ``hedge`` x standard deviation over the scenarios:
   experts whose loads rise and fall together are spread apart, so the plan holds when the traffic
   mix drifts (with `[L, E]` input: the plain load).
5. Policy: ``hierarchical`` packs expert groups to nodes first (each group on one node, so group-limited
   routing stays node-limited), then places each node's experts on its GPUs; ``global`` ignores nodes.
   ``auto`` (the default) is DeepSeek EPLB's rule: hierarchical when the groups divide over the nodes,
   else global. ``balance_first`` plans both where the layout allows hierarchical and keeps, per layer,
   whichever is more balanced (usually global): better balancedness, paid for in cross-node traffic
   (`eplb.metrics.cross_node_per_token`).
6. With ``previous`` (see `eplb.sticky`), experts stay on their GPU unless that leaves the robust
   maximum GPU load more than ``stickiness`` above a fresh plan's.
"""

from __future__ import annotations

from typing import Optional, Union

import numpy as np
import torch

from ._checks import EplbInputError, check_int, check_layout, check_weight
from .search import improve
from .sticky import stick_to_previous

__all__ = ["rebalance_experts", "planning_weight", "replica_counts", "log2phy_from_phy2log", "POLICIES"]

POLICIES = ("auto", "global", "hierarchical", "balance_first")
DEFAULT_HEDGE = 2.0
MAX_SCENARIOS = 8
NUM_PARTNERS = 1 << 30  # swap partners on all GPUs (fewer: faster, measurably less balanced)


def planning_weight(weight: np.ndarray, hedge: float = DEFAULT_HEDGE) -> tuple[np.ndarray, np.ndarray, float]:
    """Planning load `[L, E]`, scenarios `[L, K, E]` and the robustness weight z, all float64.

    `[L, E]` input: the load itself, one scenario, z = 0. `[S, L, E]`: mean + ``hedge / 2`` * std over
    steps, and the steps cut into K = min(S, 8) consecutive chunks (their mean loads) as scenarios
    with z = ``hedge``: a GPU is as loaded as its mean plus z standard deviations over the chunks.
    """
    if weight.ndim == 2:
        return weight, weight[:, None, :], 0.0
    S = weight.shape[0]
    k = min(S, MAX_SCENARIOS)
    bounds = np.linspace(0, S, k + 1).round().astype(int)
    scen = np.stack([weight[a:b].mean(0) for a, b in zip(bounds[:-1], bounds[1:])], 1)
    return weight.mean(0) + hedge / 2 * scen.std(1), scen, float(hedge)


def replica_counts(w: np.ndarray, num_slots: int, cap: int) -> np.ndarray:
    """Replicas per expert `[X, n]` int64 summing to ``num_slots`` per row, each in [1, cap].

    Greedy: every extra slot goes to the expert with the largest load per replica (ties: lowest id).
    """
    X, n = w.shape
    cnt = np.ones((X, n), np.int64)
    rows = np.arange(X)
    per = w.copy()
    for _ in range(num_slots - n):
        e = np.argmax(np.where(cnt < cap, per, -1.0), axis=1)
        cnt[rows, e] += 1
        per[rows, e] = w[rows, e] / cnt[rows, e]
    return cnt


def _fix_duplicates(phy: np.ndarray, per: np.ndarray) -> None:
    """Swap away same-GPU duplicates in place. ``phy`` `[X, G, m]` local ids, ``per`` `[X, n]` load per replica.

    Each swap trades the duplicate with the slot of closest load on a GPU that lacks the expert and
    whose expert is not on the duplicate's GPU, so it removes one duplicate and creates none.
    """
    X, G, m = phy.shape
    if m == 1:
        return
    s = np.sort(phy, axis=-1)
    xs, gs, js = np.nonzero(s[..., 1:] == s[..., :-1])
    for x, g, j in zip(xs.tolist(), gs.tolist(), js.tolist()):
        rowp = phy[x]
        e = int(s[x, g, j])
        if (rowp[g] == e).sum() < 2:  # already resolved (the row was laid out anew)
            continue
        slot = int(np.nonzero(rowp[g] == e)[0][-1])
        ok = ~(rowp == e).any(-1)[:, None] & ~np.isin(rowp, rowp[g])
        if not ok.any():
            # No single swap fixes it (few GPUs, most experts on all of them, or more copies of e than
            # GPUs): lay the row out anew, replicas grouped by expert dealt round-robin over the GPUs (an
            # expert's copies on as many GPUs as it has copies, up to all); the swap search rebalances it.
            cnt = np.bincount(rowp.ravel(), minlength=per.shape[1])
            order = np.argsort(-per[x], kind="stable")
            items = np.repeat(order, cnt[order])
            rowp[np.arange(items.size) % G, np.arange(items.size) // G] = items
            continue
        diff = np.where(ok, np.abs(per[x][rowp] - per[x][e]), np.inf)
        g2, j2 = np.unravel_index(int(np.argmin(diff)), diff.shape)
        rowp[g, slot], rowp[g2, j2] = rowp[g2, j2], rowp[g, slot]


def _pack(w: np.ndarray, cnt: np.ndarray, num_gpus: int, scen: np.ndarray, z: float, improve_iters: int) -> np.ndarray:
    """Slots `[X, P]` (GPU-major, P = cnt row sum) of local expert ids; no expert twice on one GPU.

    ``w`` `[X, n]` planning load, ``cnt`` `[X, n]` replicas, ``scen`` `[X, S, n]` scenario loads.
    """
    X, n = w.shape
    P = int(cnt[0].sum())
    m = P // num_gpus
    per = w / cnt
    order = np.argsort(-per, axis=1, kind="stable")
    items = np.repeat(order.ravel(), np.take_along_axis(cnt, order, 1).ravel()).reshape(X, P)
    iw = np.take_along_axis(per, items, 1)
    rows = np.arange(X)[:, None]
    loads = np.zeros((X, num_gpus))
    phy = np.empty((X, num_gpus, m), np.int64)
    for r in range(m):
        # Round r: the next num_gpus slots, largest to the least loaded GPU.
        gorder = np.argsort(loads, axis=1, kind="stable")
        seg = slice(r * num_gpus, (r + 1) * num_gpus)
        phy[rows, gorder, r] = items[:, seg]
        loads[rows, gorder] += iw[:, seg]
    _fix_duplicates(phy, per)
    if improve_iters > 0 and m > 1:
        improve(phy, scen / cnt[:, None, :], z, improve_iters, num_partners=NUM_PARTNERS)
    return phy.reshape(X, P)


def _plan_global(w, scen, z, num_replicas, num_gpus, cap, improve_iters):
    cnt = replica_counts(w, num_replicas, cap(num_gpus))
    return _pack(w, cnt, num_gpus, scen, z, improve_iters)


def _plan_hierarchical(w, scen, z, num_replicas, num_groups, num_nodes, num_gpus, cap, improve_iters):
    L, E = w.shape
    S = scen.shape[1]
    gs, gpn = E // num_groups, num_groups // num_nodes
    group_load = w.reshape(L, num_groups, gs).sum(-1)
    # Groups to nodes: the same round packing with one slot per group.
    ones = np.ones_like(group_load, np.int64)
    node_groups = _pack(group_load, ones, num_nodes, scen.reshape(L, S, num_groups, gs).sum(-1), z, improve_iters)
    mlog2log = (node_groups[:, :, None] * gs + np.arange(gs)).reshape(L, num_nodes, gpn * gs)
    rows = np.arange(L)[:, None, None]
    wn = w[rows, mlog2log].reshape(L * num_nodes, -1)
    sn = scen.transpose(0, 2, 1)[rows, mlog2log].reshape(L * num_nodes, gpn * gs, S).transpose(0, 2, 1)
    gpus_per_node = num_gpus // num_nodes
    cnt = replica_counts(wn, num_replicas // num_nodes, cap(gpus_per_node))
    local = _pack(wn, cnt, gpus_per_node, sn, z, improve_iters)
    return np.take_along_axis(mlog2log.reshape(L * num_nodes, -1), local, 1).reshape(L, num_replicas)


def log2phy_from_phy2log(phy2log: np.ndarray, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``log2phy`` `[L, E, P - E + 1]` (slots ascending, -1 padded) and ``logcnt`` `[L, E]`, int64 torch.

    The last dimension is the most replicas any expert can have (every other expert keeps one), as in
    DeepSeek's EPLB, so its shape depends on the layout only, never on the load."""
    L, P = phy2log.shape
    logcnt = np.zeros((L, num_experts), np.int64)
    np.add.at(logcnt, (np.arange(L)[:, None], phy2log), 1)
    maxcnt = max(P - num_experts + 1, int(logcnt.max()))  # larger only for a phy2log missing experts
    order = np.argsort(phy2log, axis=1, kind="stable")  # slots grouped by expert, ascending slot
    start = np.cumsum(logcnt, 1) - logcnt
    sorted_e = np.take_along_axis(phy2log, order, 1)
    rank = np.arange(P)[None, :] - np.take_along_axis(start, sorted_e, 1)
    log2phy = np.full((L, num_experts, maxcnt), -1, np.int64)
    log2phy[np.arange(L)[:, None], sorted_e, rank] = order
    return torch.from_numpy(log2phy), torch.from_numpy(logcnt)


def _score(phy, w, num_gpus):
    L, P = phy.shape
    cnt = np.zeros_like(w)
    np.add.at(cnt, (np.arange(L)[:, None], phy), 1.0)
    loads = np.take_along_axis(w / np.maximum(cnt, 1), phy, 1).reshape(L, num_gpus, -1).sum(-1)
    mx = loads.max(1)
    return np.where(mx > 0, loads.mean(1) / np.where(mx > 0, mx, 1), 1.0)


def _hierarchical_blocker(E: int, P: int, num_groups: int, num_nodes: int, num_gpus: int, cap) -> str:
    """Why the hierarchical policy cannot lay this out ("" when it can). DeepSeek's EPLB uses it exactly
    when groups divide over nodes; we also need whole groups, whole nodes of GPUs and slots per node
    that the node's experts can fill."""
    if num_groups % num_nodes != 0:
        return f"num_groups={num_groups} divisible by num_nodes={num_nodes}"
    if E % num_groups != 0:
        return f"num_experts={E} divisible by num_groups={num_groups}"
    if num_gpus % num_nodes != 0 or P % num_nodes != 0:
        return f"num_gpus={num_gpus} (and num_replicas={P}) divisible by num_nodes={num_nodes}"
    if E // num_nodes * cap(num_gpus // num_nodes) < P // num_nodes:
        return f"enough experts per node to fill {P // num_nodes} slots (at most {cap(num_gpus // num_nodes)} " \
               "replicas each)"
    return ""


def _deepseek_choice(E: int, num_groups: int, num_nodes: int, num_gpus: int, why_not: str) -> str:
    """DeepSeek EPLB's rule: hierarchical when the groups divide over the nodes (with one node that is the
    global plan), else global. Where DeepSeek's hierarchical policy asserts on the layout, so do we."""
    if num_groups % num_nodes != 0:
        return "global"
    for ok, need in ((E % num_groups == 0, f"num_experts={E} divisible by num_groups={num_groups}"),
                     (num_gpus % num_nodes == 0, f"num_gpus={num_gpus} divisible by num_nodes={num_nodes}")):
        if not ok:
            raise EplbInputError(f"num_groups={num_groups} divides over num_nodes={num_nodes}, so the default "
                                 f"policy is DeepSeek's hierarchical one, which needs {need}; pass "
                                 f"policy='global' to ignore the groups")
    if num_nodes == 1 or why_not:
        # One node: hierarchical is the global plan. Or a node's experts cannot fill its slots under
        # max_replicas_per_expert: global.
        return "global"
    return "hierarchical"


def rebalance_experts(weight: Union[torch.Tensor, np.ndarray], num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int, *, previous: Optional[Union[torch.Tensor, np.ndarray]] = None,
                      max_replicas_per_expert: Optional[int] = None, policy: str = "auto",
                      hedge: float = DEFAULT_HEDGE, stickiness: float = 0.03,
                      improve_iters: int = 128, one_copy_per_gpu: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Place ``num_replicas`` physical slots (hot experts replicated) on ``num_gpus`` GPUs.

    Drop-in for DeepSeek EPLB's ``rebalance_experts``; everything after ``num_gpus`` is keyword-only.

    Arguments:
        weight: `[L, E]` load per layer and logical expert (tokens routed), or per-step statistics
            `[S, L, E]`; torch tensor, numpy array or nested lists, any real dtype, finite and >= 0.
        num_replicas: physical slots P per layer, a multiple of ``num_gpus`` and >= E.
        num_groups: expert groups; used by the hierarchical policy.
        num_nodes: server nodes. With ``num_groups % num_nodes == 0`` the default policy is hierarchical,
            as in DeepSeek's EPLB, and needs E a multiple of ``num_groups`` and ``num_gpus`` of
            ``num_nodes`` (else `EplbInputError`, where DeepSeek's EPLB asserts); otherwise it is global.
        num_gpus: GPUs; slot p lives on GPU ``p // (P // num_gpus)``.
        previous: optional `[L, P]` ``phy2log`` in force now: experts stay on their GPU (and slot)
            unless keeping them leaves the maximum GPU load more than ``stickiness`` (relative) above
            a fresh plan's. The sticky plan keeps the fresh plan's replica counts but not the
            hierarchical policy's group-per-node layout.
        max_replicas_per_expert: optional cap on replicas of one expert (DeepSeek's EPLB has none).
        policy: ``"auto"`` (DeepSeek EPLB's choice: hierarchical when ``num_groups % num_nodes == 0``,
            else global; global also where a node's experts cannot fill its slots under
            ``max_replicas_per_expert``), ``"global"``, ``"hierarchical"`` (raises where the layout does not
            allow it) or ``"balance_first"`` (per layer the more balanced of the two; it drops the
            group-per-node layout wherever global balances better, so group-limited routing reaches more
            nodes).
        hedge: with `[S, L, E]` input, the robustness weight: GPUs are scored by mean + hedge * std of
            their load over chunks of steps (0: plan on the mean).
        stickiness: relative maximum-load slack allowed to keep experts in place (with ``previous``).
        improve_iters: swap-search iterations per layer (0 disables it).
        one_copy_per_gpu: at most one replica of an expert per GPU of the scope (the default). False gives
            DeepSeek EPLB's replica counts: a hot expert may get more replicas than its scope has GPUs, and
            then some share a GPU (vLLM's ``test_extreme_weight_imbalance`` expects that).

    Raises:
        EplbInputError (a ValueError and an AssertionError) on bad input; TypeError on wrong types.

    Returns:
        phy2log: `[L, P]` with `torch.int64`, the logical expert of every slot.
        log2phy: `[L, E, P - E + 1]` with `torch.int64` (the most replicas one expert can have); each
            expert's slots in ascending order, padded with -1.
        logcnt: `[L, E]` with `torch.int64`, replicas per expert (>= 1).
    """
    w_all = check_weight(weight)
    L, E = w_all.shape[-2:]
    check_layout(E, num_replicas, num_groups, num_nodes, num_gpus)
    if policy not in POLICIES:
        raise EplbInputError(f"policy must be one of {POLICIES}, got {policy!r}")
    user_cap = num_replicas if max_replicas_per_expert is None else check_int(max_replicas_per_expert,
                                                                                "max_replicas_per_expert")
    if not isinstance(one_copy_per_gpu, bool):
        raise TypeError(f"one_copy_per_gpu must be a bool, got {type(one_copy_per_gpu).__name__}")
    spread = one_copy_per_gpu

    def cap(scope_gpus: int) -> int:
        """Replicas one expert may get in a scope of ``scope_gpus`` GPUs."""
        return min(user_cap, scope_gpus) if spread else user_cap

    if E * cap(num_gpus) < num_replicas:
        raise EplbInputError(f"num_replicas={num_replicas} cannot be filled: {E} experts x at most {cap(num_gpus)} "
                             f"replicas each (max_replicas_per_expert={max_replicas_per_expert}"
                             f"{', one per GPU' if spread else ''})")
    if not np.isfinite(hedge) or hedge < 0:
        raise EplbInputError(f"hedge must be a finite number >= 0, got {hedge}")
    if not np.isfinite(stickiness) or stickiness < 0:
        raise EplbInputError(f"stickiness must be a finite number >= 0, got {stickiness}")
    prev = None
    if previous is not None:
        prev = np.asarray(torch.as_tensor(previous).cpu().numpy(), dtype=np.int64)
        if prev.shape != (L, num_replicas):
            raise EplbInputError(f"previous must be phy2log of shape [{L}, {num_replicas}], got {prev.shape}")
        if prev.min() < 0 or prev.max() >= E:
            raise EplbInputError(f"previous entries must be expert ids in [0, {E}), got range [{prev.min()}, {prev.max()}]")
    w, scen, z = planning_weight(w_all, hedge)

    why_not = _hierarchical_blocker(E, num_replicas, num_groups, num_nodes, num_gpus, cap)
    if policy == "hierarchical" and why_not:
        raise EplbInputError(f"policy='hierarchical' needs {why_not}; use policy='global'")
    if policy == "auto":
        policy = _deepseek_choice(E, num_groups, num_nodes, num_gpus, why_not)
    if policy == "hierarchical":
        phy = _plan_hierarchical(w, scen, z, num_replicas, num_groups, num_nodes, num_gpus, cap, improve_iters)
    else:
        phy = _plan_global(w, scen, z, num_replicas, num_gpus, cap, improve_iters)
        if policy == "balance_first" and not why_not and num_nodes > 1:
            hphy = _plan_hierarchical(w, scen, z, num_replicas, num_groups, num_nodes, num_gpus, cap, improve_iters)
            use_h = _score(hphy, w, num_gpus) >= _score(phy, w, num_gpus) - 1e-12
            phy = np.where(use_h[:, None], hphy, phy)
    if prev is not None:
        phy = stick_to_previous(phy, prev, w, scen, z, num_gpus, stickiness, max(improve_iters, 4 * num_gpus))
    log2phy, logcnt = log2phy_from_phy2log(phy, E)
    return torch.from_numpy(np.ascontiguousarray(phy)), log2phy, logcnt
