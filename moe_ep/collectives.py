"""Node-aware all-reduce over torch.distributed: tree (local / global masters), hierarchical
(reduce-scatter, all-reduce, all-gather), flat (the group's own) and a parameter-server baseline.

Ranks are grouped into nodes of ``ranks_per_node`` consecutive ranks of ``group`` (node ``h`` holds
ranks ``h*G .. h*G + G - 1``, local index ``g = rank % G``). Two families of subgroups are built once per
``(group, ranks_per_node)`` and cached, on every rank in the same order (``dist.new_group`` is
collective): the ``H`` node groups, then the ``G`` cross groups (cross group ``g`` holds local index
``g`` of every node; cross group ``local_master`` is the tree's group of local masters).

Numerics (the contract of ``torch.distributed.all_reduce``: the result has the input's dtype and is
accumulated in it, one rounding per addition). ``tree`` and ``hierarchical`` add in the same order,
so they agree bitwise with each other::

    out = (...((S_0 + S_1) + S_2) ... + S_{H-1}),   S_h = (...((x_{h,0} + x_{h,1}) + x_{h,2}) ... + x_{h,G-1})

``ps`` adds ``x_0 + x_1 + ... + x_{P-1}`` left to right (the same as the tree when ``G == 1`` or
``H == 1``); ``flat`` uses the backend's own algorithm and order (gloo: ring). For every algorithm
each element is reduced at exactly one rank and then copied, so all ranks hold identical bits.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch
import torch.distributed as dist

from .sync import ArrivalCheck

__all__ = ["ALGORITHMS", "SUM", "Tiers", "DEFAULT_TIERS", "Topology", "all_reduce", "choose_algorithm",
           "inter_node_bytes", "node_topology", "predict_time"]

ALGORITHMS = ("tree", "hierarchical", "flat", "ps")
SUM = dist.ReduceOp.SUM

_OPS = {  # in-place elementwise reduction of `b` into `a`
    "SUM": lambda a, b: a.add_(b),
    "PRODUCT": lambda a, b: a.mul_(b),
    "MIN": lambda a, b: torch.minimum(a, b, out=a),
    "MAX": lambda a, b: torch.maximum(a, b, out=a),
}


def _op_name(op) -> str:
    name = op.upper() if isinstance(op, str) else str(op).rsplit(".", 1)[-1].upper()
    if name not in _OPS:
        raise ValueError(f"op must be one of {sorted(_OPS)} (a dist.ReduceOp or its name), got {op!r}")
    return name


# ---------------------------------------------------------------------------------------- cost model
@dataclasses.dataclass(frozen=True)
class Tiers:
    """Latency (seconds) and bandwidth (bytes/s, one direction, per node link) of the two tiers.

    Defaults are the illustrative numbers of SEEDS.md C.4 for seed 002's testbed: 1 Gbit/s Ethernet
    between hosts (125 MB/s, 50 us), PCIe-class links inside a host (10 GB/s, 10 us).
    """

    alpha_intra: float = 10e-6
    bw_intra: float = 10e9
    alpha_inter: float = 50e-6
    bw_inter: float = 125e6


DEFAULT_TIERS = Tiers()


def predict_time(algorithm: str, nbytes: int, ranks_per_node: int, num_nodes: int,
                 tiers: Tiers = DEFAULT_TIERS) -> float:
    """Seconds for one all-reduce of ``nbytes`` per rank (SEEDS.md C.4; a star step is serialised at the
    receiver's link, the node link is shared by the node's ranks)."""
    G, H, M, t = ranks_per_node, num_nodes, float(nbytes), tiers
    P = G * H
    if P == 1:
        return 0.0
    a_min = t.alpha_inter if H > 1 else t.alpha_intra
    b_min = t.bw_inter if H > 1 else t.bw_intra
    if algorithm == "ps":
        # Server on node 0: the (H-1)G remote partials cross its node link, G-1 local ones do not.
        remote = (H - 1) * G
        return 2 * (remote * M / t.bw_inter + (G - 1) * M / t.bw_intra) + 2 * (P - 1) * a_min if H > 1 else \
            2 * ((P - 1) * M / t.bw_intra + (P - 1) * t.alpha_intra)
    if algorithm == "tree":
        return 2 * (G - 1) * (t.alpha_intra + M / t.bw_intra) + 2 * (H - 1) * (t.alpha_inter + M / t.bw_inter)
    if algorithm == "flat":  # ring over P ranks, the slowest link bounds every step
        return 2 * (P - 1) * (a_min + (M / P) / b_min)
    if algorithm == "hierarchical":  # G shard pairs share each node link
        return 2 * (G - 1) * (t.alpha_intra + (M / G) / t.bw_intra) + 2 * (H - 1) * (t.alpha_inter + M / (H * t.bw_inter))
    raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")


def inter_node_bytes(algorithm: str, nbytes: int, ranks_per_node: int, num_nodes: int) -> float:
    """Payload bytes leaving node 0 (one direction) per all-reduce, as implemented here (``flat``: ring)."""
    G, H, M = ranks_per_node, num_nodes, float(nbytes)
    if H == 1:
        return 0.0
    P = G * H
    if algorithm == "ps":  # server on node 0 sends the result to every remote rank
        return (H - 1) * G * M
    if algorithm == "tree":  # the GM (node 0) sends the result to H-1 local masters
        return (H - 1) * M
    if algorithm == "hierarchical":  # node 0's G ranks each send (H-1)/H of their shard, twice
        return 2 * (H - 1) / H * M
    if algorithm == "flat":  # a ring over P crosses each node boundary with 2(P-1)/P M
        return 2 * (P - 1) / P * M
    raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")


def choose_algorithm(nbytes: int, ranks_per_node: int, num_nodes: int, tiers: Tiers = DEFAULT_TIERS) -> str:
    """The algorithm with the least predicted time (ties: the earlier of tree, hierarchical, flat, ps)."""
    if num_nodes == 1 or ranks_per_node == 1:
        return "flat"  # one tier: the node-aware algorithms have nothing to exploit
    return min(ALGORITHMS, key=lambda a: predict_time(a, nbytes, ranks_per_node, num_nodes, tiers))


# ---------------------------------------------------------------------------------------- topology
@dataclasses.dataclass
class Topology:
    """This rank's place in ``H`` nodes of ``G`` ranks and the cached subgroups (``None`` when trivial)."""

    group: object
    granks: list  # global rank of each group rank
    rank: int
    ranks_per_node: int
    num_nodes: int
    node_groups: list  # [H] groups (or None when G == 1)
    cross_groups: list  # [G] groups (or None when H == 1)

    @property
    def node(self) -> int:
        return self.rank // self.ranks_per_node

    @property
    def local(self) -> int:
        return self.rank % self.ranks_per_node

    @property
    def node_group(self):
        return None if self.node_groups is None else self.node_groups[self.node]

    @property
    def cross_group(self):
        return None if self.cross_groups is None else self.cross_groups[self.local]

    def global_rank(self, node: int, local: int) -> int:
        return self.granks[node * self.ranks_per_node + local]


_topologies: dict = {}


def _default_ranks_per_node(world: int) -> int:
    for var in ("MOE_EP_RANKS_PER_NODE", "LOCAL_WORLD_SIZE"):
        if os.environ.get(var):
            return int(os.environ[var])
    return world


def node_topology(group=None, ranks_per_node: Optional[int] = None) -> Topology:
    """The cached :class:`Topology` of ``group``; the first call for a ``(group, ranks_per_node)`` is
    collective (every rank of ``group`` must make it, in the same order as its other group creations).

    ``ranks_per_node`` defaults to ``$MOE_EP_RANKS_PER_NODE``, then ``$LOCAL_WORLD_SIZE``, then the group
    size (one node)."""
    world = dist.get_world_size(group)
    G = ranks_per_node or _default_ranks_per_node(world)
    if G < 1 or world % G:
        raise ValueError(f"ranks_per_node={G} must divide the group size {world}")
    granks = list(dist.get_process_group_ranks(group)) if group is not None else list(range(world))
    key = (tuple(granks), G)
    topo = _topologies.get(key)
    if topo is None:
        H = world // G
        node_groups = [dist.new_group([granks[h * G + g] for g in range(G)]) for h in range(H)] if G > 1 else None
        cross_groups = [dist.new_group([granks[h * G + g] for h in range(H)]) for g in range(G)] if H > 1 else None
        topo = _topologies[key] = Topology(group, granks, dist.get_rank(group), G, H, node_groups, cross_groups)
    return topo


# ---------------------------------------------------------------------------------------- helpers
_WIRE = {torch.bfloat16: torch.float16}  # moved as raw bits (gloo copies, never reads, these)


def _wire(t: torch.Tensor) -> torch.Tensor:
    return t.view(_WIRE[t.dtype]) if t.dtype in _WIRE else t


def _fold(rows: torch.Tensor, op: str) -> torch.Tensor:
    """Left-to-right reduction of ``rows`` (`[n, m]`) along dim 0, in its dtype."""
    acc = rows[0].clone()
    for i in range(1, rows.shape[0]):
        _OPS[op](acc, rows[i])
    return acc


def _splits(total: int, parts: int) -> list:
    q, r = divmod(total, parts)
    return [q + (i < r) for i in range(parts)]


def _a2a(send: torch.Tensor, out_splits: list, in_splits: list, group) -> torch.Tensor:
    recv = torch.empty(sum(out_splits), dtype=send.dtype, device=send.device)
    dist.all_to_all_single(_wire(recv), _wire(send), output_split_sizes=out_splits, input_split_sizes=in_splits,
                           group=group)
    return recv


def _reduce_scatter(flat: torch.Tensor, me: int, n: int, group, op: str) -> tuple[torch.Tensor, list]:
    """Shard ``me`` of ``n`` (uneven splits) reduced over ``group`` in group-rank order."""
    sizes = _splits(flat.numel(), n)
    recv = _a2a(flat, [sizes[me]] * n, sizes, group)
    return _fold(recv.view(n, sizes[me]), op), sizes


def _all_gather(shard: torch.Tensor, sizes: list, group) -> torch.Tensor:
    """Uneven all-gather as an all-to-all (gloo's all_gather wants equal sizes)."""
    n = len(sizes)
    return _a2a(shard.repeat(n), sizes, [shard.numel()] * n, group)


def _gather_fold(t: torch.Tensor, n: int, dst: int, is_dst: bool, group, op: str) -> Optional[torch.Tensor]:
    """Gather ``t`` at global rank ``dst`` of ``group`` (``n`` ranks) and fold in group-rank order."""
    if n == 1:
        return t.clone()
    buf = torch.empty(n, t.numel(), dtype=t.dtype, device=t.device) if is_dst else None
    dist.gather(_wire(t), list(_wire(buf).unbind(0)) if is_dst else None, dst=dst, group=group)
    return _fold(buf, op) if is_dst else None


def _broadcast(t: torch.Tensor, src: int, group, n: int) -> None:
    if n > 1:
        dist.broadcast(_wire(t), src=src, group=group)


_checks: dict = {}


def _arrival(group, rank: int, world: int, timeout_s: float) -> ArrivalCheck:
    key = tuple(dist.get_process_group_ranks(group)) if group is not None else ("world",)
    check = _checks.get(key)
    if check is None:
        check = _checks[key] = ArrivalCheck(group, rank, world, timeout_s)
    check.timeout_s = timeout_s
    return check


# ---------------------------------------------------------------------------------------- all-reduce
def all_reduce(tensor: torch.Tensor, group=None, *, algorithm: str = "auto", ranks_per_node: Optional[int] = None,
               op=SUM, local_master: int = 0, global_master: int = 0, tiers: Tiers = DEFAULT_TIERS,
               timeout_s: float = 60.0) -> torch.Tensor:
    """Reduce ``tensor`` over ``group`` in place (every rank ends with identical bits) and return it.

    Arguments:
        tensor: any shape and dtype gloo/NCCL carry (float32/float64/bfloat16/float16/int32/int64, ...).
        group: a torch.distributed group (``None``: the world).
        algorithm: ``"tree"`` (each node's local master gathers and sums its node, the global master sums
            the local masters and sends back, the local masters fan out: ``H - 1`` node-link crossings
            each way), ``"hierarchical"`` (reduce-scatter inside the node, reduce-scatter + all-gather of
            each shard across nodes, all-gather inside the node), ``"flat"`` (the group's own
            ``all_reduce``), ``"ps"`` (parameter server: group rank 0 gathers, reduces, broadcasts) or
            ``"auto"`` (least :func:`predict_time` under ``tiers``).
        ranks_per_node: ``G``; nodes are blocks of ``G`` consecutive group ranks (see :func:`node_topology`).
        op: ``dist.ReduceOp`` SUM / PRODUCT / MIN / MAX (or the name).
        local_master: local index of each node's master (tree); global_master: node of the global master.
        timeout_s: a rank that does not arrive within it makes the others raise
            :class:`moe_ep.RankTimeoutError` naming it (before any payload moves).

    Returns:
        ``tensor`` (same object), holding the reduction; the order of the additions is in the module doc.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    opn = _op_name(op)
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if algorithm != "auto" and algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be 'auto' or one of {ALGORITHMS}, got {algorithm!r}")
    # Everything the ranks must agree on is compared before any collective (a group creation included): the
    # algorithm as "auto" resolves it under this rank's tiers, and the tree's masters as the algorithm uses them.
    G = ranks_per_node or _default_ranks_per_node(world)
    if G < 1 or world % G:
        raise ValueError(f"ranks_per_node={G} must divide the group size {world}")
    resolved = algorithm
    if algorithm == "auto" and world > 1 and tensor.numel() > 0:
        resolved = choose_algorithm(tensor.numel() * tensor.element_size(), G, world // G, tiers)
    masters = f"{local_master % G}/{global_master % (world // G)}" if resolved == "tree" else "-"
    _arrival(group, rank, world, timeout_s).arrive("all_reduce", {
        "numel": tensor.numel(), "dtype": str(tensor.dtype).replace("torch.", ""), "op": opn,
        "algorithm": algorithm if resolved == algorithm else f"{algorithm} -> {resolved}",
        "ranks_per_node": ranks_per_node or "-", "local_master/global_master": masters})
    if world == 1 or tensor.numel() == 0:
        return tensor
    algorithm = resolved
    if algorithm in ("tree", "hierarchical"):
        topo = node_topology(group, ranks_per_node)
    flat = tensor.reshape(-1).contiguous()
    if algorithm == "flat":
        dist.all_reduce(flat, op=getattr(dist.ReduceOp, opn), group=group)
        out = flat
    elif algorithm == "ps":
        out = _ps(flat, group, world, rank, opn)
    elif algorithm == "tree":
        out = _tree(flat, topo, opn, local_master % topo.ranks_per_node, global_master % topo.num_nodes)
    else:
        out = _hierarchical(flat, topo, opn)
    if out.data_ptr() != tensor.data_ptr():
        tensor.copy_(out.view(tensor.shape))
    return tensor


def _ps(flat: torch.Tensor, group, world: int, rank: int, op: str) -> torch.Tensor:
    # Step 1: every rank -> the server (group rank 0), folded in rank order. Step 2: server -> everyone.
    server = _granks(group)[0]
    out = _gather_fold(flat, world, server, rank == 0, group, op)
    if out is None:
        out = torch.empty_like(flat)
    _broadcast(out, server, group, world)
    return out


def _granks(group) -> list:
    return list(dist.get_process_group_ranks(group)) if group is not None else list(range(dist.get_world_size()))


def _tree(flat: torch.Tensor, topo: Topology, op: str, lm: int, gm: int) -> torch.Tensor:
    G, H, h, g = topo.ranks_per_node, topo.num_nodes, topo.node, topo.local
    is_lm = g == lm
    my_lm = topo.global_rank(h, lm)
    # Step 1: every rank -> its local master (intra-node only); the LM folds in local-rank order.
    node_sum = _gather_fold(flat, G, my_lm, is_lm, topo.node_group, op)
    out = node_sum if node_sum is not None else torch.empty_like(flat)
    if is_lm:
        # Step 2: local masters -> global master (H - 1 node-link crossings); fold in node order.
        # Step 3: the global master sends the result back along the same links.
        gm_rank = topo.global_rank(gm, lm)
        total = _gather_fold(node_sum, H, gm_rank, h == gm, topo.cross_groups[lm] if H > 1 else None, op)
        if total is not None:
            out = total
        _broadcast(out, gm_rank, topo.cross_groups[lm] if H > 1 else None, H)
    # Step 4: each local master fans out inside its node.
    _broadcast(out, my_lm, topo.node_group, G)
    return out


def _hierarchical(flat: torch.Tensor, topo: Topology, op: str) -> torch.Tensor:
    G, H = topo.ranks_per_node, topo.num_nodes
    # Step 1: reduce-scatter inside the node: local rank g owns shard g of the node sum.
    shard, node_sizes = (flat, None) if G == 1 else _reduce_scatter(flat, topo.local, G, topo.node_group, op)
    if H > 1:
        # Step 2: shard g across nodes (cross group g): reduce-scatter in node order, then all-gather;
        # every element is reduced at exactly one rank. G such exchanges share each node link.
        sub, cross_sizes = _reduce_scatter(shard, topo.node, H, topo.cross_group, op)
        shard = _all_gather(sub, cross_sizes, topo.cross_group)
    # Step 3: all-gather the reduced shards inside the node.
    return shard if G == 1 else _all_gather(shard, node_sizes, topo.node_group)
