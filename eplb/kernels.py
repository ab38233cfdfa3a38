"""`map_topk` as one Triton launch: every policy, slot mask and lost count fused, fixed shapes, no host read.

One program does the whole mapping in phases separated by CTA barriers (the work is tiny: a decode step's
selections and one layer's replica table), so it is deterministic: ranks come from an in-block pairwise
count plus running per-expert counts, and every sum is integer (``balanced`` runs in the torch path's
int64 fixed point), so the result equals the torch path bitwise whatever the reduction order. Workspace
written inside the kernel is read back with ``.cg`` loads (L2, not the incoherent L1).

Phases: (1) compact each expert's live replicas (slot mask) into a table (``balanced``: rotated by ``(seed +
rank + expert) mod live count``, as the torch path); (2) ranks of selections within
their expert (round_robin, balanced); (3) balanced only: ``iters`` damped water-filling rounds over all
experts at once, the even-split fallback and cumulative shares; (4) replica choice, (5) balanced only:
the whole-selection busiest-GPU check, then the output and the lost count.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl


__all__ = ["map_topk_triton", "map_topk_kernel", "sm90_cases"]

_POLICY = {"static": 0, "random": 1, "round_robin": 2, "balanced": 3}


@triton.jit
def _hash(x):
    m = 0x7FFFFFFF
    x = x & m
    x = ((x >> 16) ^ x) * 0x45D9F3B & m
    x = ((x >> 16) ^ x) * 0x45D9F3B & m
    return (x >> 16) ^ x


@triton.jit
def map_topk_kernel(topk_ptr, log2phy_ptr, logcnt_ptr, mask_ptr, seed_ptr, out_ptr, lost_ptr,
                    live_ptr, livecnt_ptr, cnt_ptr, rank_ptr, s_ptr, load_ptr, rep_ptr, even_ptr,
                    NK, E, X, R, G, SPG, iters, RANK,
                    POLICY: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, BLOCK2: tl.constexpr,
                    BE: tl.constexpr, R_PAD: tl.constexpr, G_PAD: tl.constexpr):
    SCALE_: tl.constexpr = 1048576
    BIG_: tl.constexpr = 4611686018427387904
    cols = tl.arange(0, R_PAD)
    gidx = tl.arange(0, G_PAD)
    seed = tl.load(seed_ptr).to(tl.int64)
    rank64 = tl.full([], 0, tl.int64) + RANK  # int64 arithmetic whatever RANK was specialised to
    # (1) live table (balanced: each expert's rotated by (seed + RANK + e) mod live count), zeroed counters.
    for e0 in range(0, E + 1, BE):
        rows = e0 + tl.arange(0, BE)
        inb = rows < E
        tl.store(cnt_ptr + rows, tl.zeros([BE], tl.int64), mask=rows < E + 1)
        l2p = tl.load(log2phy_ptr + rows[:, None] * X + cols[None, :],
                      mask=inb[:, None] & (cols[None, :] < R), other=-1).to(tl.int64)
        lc = tl.load(logcnt_ptr + rows, mask=inb, other=0).to(tl.int64)
        valid = (cols[None, :] < lc[:, None]) & (l2p >= 0) & (cols[None, :] < R) & inb[:, None]
        if HAS_MASK:
            m = tl.load(mask_ptr + tl.maximum(l2p, 0), mask=valid, other=0)
            valid = valid & (m != 0)
        vi = valid.to(tl.int32)
        pos = (tl.cumsum(vi, axis=1) - 1).to(tl.int64)
        nlive = tl.sum(vi, axis=1).to(tl.int64)
        if POLICY == 3:
            n = tl.maximum(nlive, 1)
            o = ((seed + rank64 + rows) % n + n) % n
            pos = (pos - o[:, None] + n[:, None]) % n[:, None]
        tl.store(live_ptr + rows[:, None] * R_PAD + pos, l2p, mask=valid)
        tl.store(livecnt_ptr + rows, nlive, mask=inb)
    tl.debug_barrier()
    # (2) rank of each selection among its expert's selections, token-major.
    if POLICY >= 2:
        for i0 in range(0, NK, BLOCK):
            offs = i0 + tl.arange(0, BLOCK)
            ids = tl.load(topk_ptr + offs, mask=offs < NK, other=-1).to(tl.int64)
            flat = tl.where(ids < 0, E, ids)
            before = (flat[:, None] == flat[None, :]) & (tl.arange(0, BLOCK)[None, :] < tl.arange(0, BLOCK)[:, None])
            base = tl.load(cnt_ptr + flat, mask=offs < NK, other=0, cache_modifier=".cg")
            rank = base + tl.sum(before.to(tl.int32), axis=1).to(tl.int64)
            tl.store(rank_ptr + offs, rank, mask=offs < NK)
            tl.debug_barrier()
            tl.atomic_add(cnt_ptr + flat, tl.full([BLOCK], 1, tl.int64), mask=offs < NK)
            tl.debug_barrier()
    # (3) balanced: fixed-point water-filling, exactly the torch path's integer arithmetic.
    if POLICY == 3:
        for e0 in range(0, E, BE):
            rows = e0 + tl.arange(0, BE)
            inb = rows < E
            lc = tl.load(livecnt_ptr + rows, mask=inb, other=0, cache_modifier=".cg")
            c = tl.load(cnt_ptr + rows, mask=inb, other=0, cache_modifier=".cg") * SCALE_
            valid = cols[None, :] < lc[:, None]
            even = tl.where(valid, c[:, None] // tl.maximum(lc, 1)[:, None], 0)
            tl.store(s_ptr + rows[:, None] * R_PAD + cols[None, :], even, mask=inb[:, None])
        tl.debug_barrier()
        for _it in range(iters):
            tl.store(load_ptr + gidx, tl.zeros([G_PAD], tl.int64))
            tl.debug_barrier()
            for e0 in range(0, E, BE):
                rows = e0 + tl.arange(0, BE)
                inb = rows < E
                lc = tl.load(livecnt_ptr + rows, mask=inb, other=0, cache_modifier=".cg")
                valid = cols[None, :] < lc[:, None]
                sp = s_ptr + rows[:, None] * R_PAD + cols[None, :]
                s = tl.load(sp, mask=valid, other=0, cache_modifier=".cg")
                slot = tl.load(live_ptr + rows[:, None] * R_PAD + cols[None, :], mask=valid, other=0,
                               cache_modifier=".cg")
                tl.atomic_add(load_ptr + slot // SPG, s, mask=valid)
            tl.debug_barrier()
            for e0 in range(0, E, BE):
                rows = e0 + tl.arange(0, BE)
                inb = rows < E
                lc = tl.load(livecnt_ptr + rows, mask=inb, other=0, cache_modifier=".cg")
                c = tl.load(cnt_ptr + rows, mask=inb, other=0, cache_modifier=".cg") * SCALE_
                valid = cols[None, :] < lc[:, None]
                sp = s_ptr + rows[:, None] * R_PAD + cols[None, :]
                s = tl.load(sp, mask=valid, other=0, cache_modifier=".cg")
                slot = tl.load(live_ptr + rows[:, None] * R_PAD + cols[None, :], mask=valid, other=0,
                               cache_modifier=".cg")
                gl = tl.load(load_ptr + slot // SPG, mask=valid, other=0, cache_modifier=".cg")
                other = tl.where(valid, gl - s, BIG_)
                # Sorted position, prefix sum and next value of each replica's `other` (ties by index):
                # the torch path's sort + cumsum, element by element.
                pos = tl.zeros([BE, R_PAD], tl.int64)
                psum = tl.where(valid, other, 0)
                nxt = tl.full([BE, R_PAD], BIG_, tl.int64)
                for j in range(R_PAD):
                    oj = tl.sum(tl.where(cols[None, :] == j, other, 0), axis=1)[:, None]
                    vj = (j < lc)[:, None]
                    less = vj & ((oj < other) | ((oj == other) & (j < cols[None, :])))
                    more = vj & ((oj > other) | ((oj == other) & (j > cols[None, :])))
                    pos += less.to(tl.int64)
                    psum += tl.where(less, oj, 0)
                    nxt = tl.minimum(nxt, tl.where(more, oj, BIG_))
                lam_r = (c[:, None] + psum) // (pos + 1)
                ok = valid & (lam_r <= nxt)
                minpos = tl.min(tl.where(ok, pos, BIG_), axis=1)
                lam = tl.sum(tl.where(ok & (pos == minpos[:, None]), lam_r, 0), axis=1)
                tgt = tl.where(valid, tl.maximum(lam[:, None] - other, 0), 0)
                tl.store(sp, (s + tgt) >> 1, mask=valid)
            tl.debug_barrier()
        # Keep the balanced shares only if they lower the busiest GPU; then cumulative shares.
        tl.store(load_ptr + gidx, tl.zeros([G_PAD], tl.int64))
        tl.store(load_ptr + G_PAD + gidx, tl.zeros([G_PAD], tl.int64))
        tl.debug_barrier()
        for e0 in range(0, E, BE):
            rows = e0 + tl.arange(0, BE)
            inb = rows < E
            lc = tl.load(livecnt_ptr + rows, mask=inb, other=0, cache_modifier=".cg")
            c = tl.load(cnt_ptr + rows, mask=inb, other=0, cache_modifier=".cg") * SCALE_
            valid = cols[None, :] < lc[:, None]
            s = tl.load(s_ptr + rows[:, None] * R_PAD + cols[None, :], mask=valid, other=0, cache_modifier=".cg")
            even = tl.where(valid, c[:, None] // tl.maximum(lc, 1)[:, None], 0)
            slot = tl.load(live_ptr + rows[:, None] * R_PAD + cols[None, :], mask=valid, other=0,
                           cache_modifier=".cg")
            tl.atomic_add(load_ptr + slot // SPG, s, mask=valid)
            tl.atomic_add(load_ptr + G_PAD + slot // SPG, even, mask=valid)
        tl.debug_barrier()
        ls = tl.load(load_ptr + gidx, mask=gidx < G, other=0, cache_modifier=".cg")
        le = tl.load(load_ptr + G_PAD + gidx, mask=gidx < G, other=0, cache_modifier=".cg")
        better = tl.max(ls, axis=0) < tl.max(le, axis=0)
        for e0 in range(0, E, BE):
            rows = e0 + tl.arange(0, BE)
            inb = rows < E
            lc = tl.load(livecnt_ptr + rows, mask=inb, other=0, cache_modifier=".cg")
            c = tl.load(cnt_ptr + rows, mask=inb, other=0, cache_modifier=".cg") * SCALE_
            valid = cols[None, :] < lc[:, None]
            sp = s_ptr + rows[:, None] * R_PAD + cols[None, :]
            s = tl.load(sp, mask=valid, other=0, cache_modifier=".cg")
            even = tl.where(valid, c[:, None] // tl.maximum(lc, 1)[:, None], 0)
            tl.store(sp, tl.cumsum(tl.where(better, s, even), axis=1), mask=inb[:, None])
        tl.debug_barrier()
        tl.store(load_ptr + gidx, tl.zeros([G_PAD], tl.int64))
        tl.store(load_ptr + G_PAD + gidx, tl.zeros([G_PAD], tl.int64))
        tl.debug_barrier()
    # (4) replica choice.
    for i0 in range(0, NK, BLOCK2):
        offs = i0 + tl.arange(0, BLOCK2)
        inr = offs < NK
        ids = tl.load(topk_ptr + offs, mask=inr, other=-1).to(tl.int64)
        none = ids < 0
        safe = tl.where(none, 0, ids)
        lc = tl.load(livecnt_ptr + safe, mask=inr, other=0, cache_modifier=".cg")
        off = none | (lc == 0)
        cnt1 = tl.maximum(lc, 1)
        if POLICY == 0:
            rep = tl.zeros([BLOCK2], tl.int64)
        elif POLICY == 1:
            rep = _hash(_hash(offs.to(tl.int64) + seed * 0x9E3779B1) + rank64 * 0x9E3779B1) % cnt1
        elif POLICY == 2:
            rank = tl.load(rank_ptr + offs, mask=inr, other=0, cache_modifier=".cg")
            rep = ((rank + seed + rank64) % cnt1 + cnt1) % cnt1
        else:
            rank = tl.load(rank_ptr + offs, mask=inr, other=0, cache_modifier=".cg")
            cum = tl.load(s_ptr + safe[:, None] * R_PAD + cols[None, :], mask=inr[:, None] & (cols[None, :] < lc[:, None]),
                          other=BIG_, cache_modifier=".cg")
            rep = tl.sum(((rank * SCALE_ + SCALE_ // 2)[:, None] >= cum).to(tl.int64), axis=1)
            rep = tl.minimum(rep, cnt1 - 1)
            cexp = tl.load(cnt_ptr + safe, mask=inr, other=1, cache_modifier=".cg")
            even = tl.where(none, 0, rank * cnt1 // tl.maximum(cexp, 1))
            tl.store(rep_ptr + offs, rep, mask=inr)
            tl.store(even_ptr + offs, even, mask=inr)
            pr = tl.load(live_ptr + safe * R_PAD + rep, mask=inr & ~off, other=0, cache_modifier=".cg")
            pe = tl.load(live_ptr + safe * R_PAD + even, mask=inr & ~off, other=0, cache_modifier=".cg")
            one = tl.full([BLOCK2], 1, tl.int64)
            tl.atomic_add(load_ptr + pr // SPG, one, mask=inr & ~off)
            tl.atomic_add(load_ptr + G_PAD + pe // SPG, one, mask=inr & ~off)
        if POLICY != 3:
            phy = tl.load(live_ptr + safe * R_PAD + rep, mask=inr & ~off, other=-1, cache_modifier=".cg")
            tl.store(out_ptr + offs, tl.where(off, -1, phy), mask=inr)
    # (5) balanced: the busiest-GPU check in whole selections, then the output; the lost count.
    if POLICY == 3:
        tl.debug_barrier()
        br = tl.max(tl.load(load_ptr + gidx, mask=gidx < G, other=0, cache_modifier=".cg"), axis=0)
        be = tl.max(tl.load(load_ptr + G_PAD + gidx, mask=gidx < G, other=0, cache_modifier=".cg"), axis=0)
        for i0 in range(0, NK, BLOCK2):
            offs = i0 + tl.arange(0, BLOCK2)
            inr = offs < NK
            ids = tl.load(topk_ptr + offs, mask=inr, other=-1).to(tl.int64)
            none = ids < 0
            safe = tl.where(none, 0, ids)
            lc = tl.load(livecnt_ptr + safe, mask=inr, other=0, cache_modifier=".cg")
            off = none | (lc == 0)
            rep = tl.load(rep_ptr + offs, mask=inr, other=0, cache_modifier=".cg")
            even = tl.load(even_ptr + offs, mask=inr, other=0, cache_modifier=".cg")
            rep = tl.where(br <= be, rep, even)
            phy = tl.load(live_ptr + safe * R_PAD + rep, mask=inr & ~off, other=-1, cache_modifier=".cg")
            tl.store(out_ptr + offs, tl.where(off, -1, phy), mask=inr)
    lost = tl.zeros([BLOCK2], tl.int64)
    for i0 in range(0, NK, BLOCK2):
        offs = i0 + tl.arange(0, BLOCK2)
        inr = offs < NK
        ids = tl.load(topk_ptr + offs, mask=inr, other=-1).to(tl.int64)
        lc = tl.load(livecnt_ptr + tl.maximum(ids, 0), mask=inr & (ids >= 0), other=1, cache_modifier=".cg")
        lost += (lc == 0).to(tl.int64)
    tl.store(lost_ptr, tl.sum(lost, axis=0))


def _cfg(E: int, X: int, width: Optional[int], num_gpus: int):
    R = X if width is None else max(1, min(int(width), X))
    r_pad = triton.next_power_of_2(R)
    be = max(1, min(triton.next_power_of_2(E + 1), 512 // r_pad))
    block2 = max(16, min(128, 1024 // r_pad))
    return dict(R=R, R_PAD=r_pad, BE=be, BLOCK=64, BLOCK2=block2, G_PAD=triton.next_power_of_2(num_gpus + 1))


def map_topk_triton(topk_idx: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor, policy: str, *,
                    seed: Union[int, torch.Tensor] = 0, num_gpus: Optional[int] = None,
                    num_slots: Optional[int] = None, iters: int = 8, slot_mask: Optional[torch.Tensor] = None,
                    lost_out: Optional[torch.Tensor] = None, max_replicas: Optional[int] = None,
                    rank: int = 0) -> torch.Tensor:
    """One-launch `eplb.map_topk` (arguments checked there). ``max_replicas`` bounds the replica columns read
    (default all of ``log2phy``'s): pass the placement's ``logcnt.max()`` to keep the tiles small."""
    N, K = topk_idx.shape
    E, X = log2phy.shape
    dev = topk_idx.device
    NK = N * K
    G = num_gpus if policy == "balanced" else 1
    spg = num_slots // num_gpus if policy == "balanced" else 1
    cfg = _cfg(E, X, max_replicas, G)
    r_pad, g_pad = cfg["R_PAD"], cfg["G_PAD"]
    i64 = torch.int64
    ws = torch.empty(E * r_pad * 2 + (E + 1) * 2 + NK * 3 + 2 * g_pad, dtype=i64, device=dev)
    o = 0
    parts = []
    for n in (E * r_pad, E * r_pad, E + 1, E + 1, NK, NK, NK, 2 * g_pad):
        parts.append(ws[o:o + n])
        o += n
    live, s, livecnt, cnt, rank_ws, rep, even, load = parts
    out = torch.empty((N, K), dtype=i64, device=dev)
    lost = lost_out if lost_out is not None else torch.empty((), dtype=i64, device=dev)
    seed_t = seed.reshape(()).to(i64) if isinstance(seed, torch.Tensor) else torch.full((), int(seed), dtype=i64,
                                                                                         device=dev)
    mask = slot_mask if slot_mask is not None else out  # any pointer; unread without HAS_MASK
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    map_topk_kernel[(1,)](topk_idx.contiguous(), log2phy.contiguous(), logcnt.contiguous(), mask, seed_t, out, lost,
                          live, livecnt, cnt, rank_ws, s, load, rep, even, NK, E, X, cfg["R"], G, spg, iters, int(rank),
                          POLICY=_POLICY[policy], HAS_MASK=slot_mask is not None, BLOCK=cfg["BLOCK"],
                          BLOCK2=cfg["BLOCK2"], BE=cfg["BE"], R_PAD=r_pad, G_PAD=g_pad, num_warps=4)
    return out


def sm90_cases() -> list:
    """The shipped configurations for the sm90 compile test: every policy, with and without the mask,
    DeepSeek-V3 at EP144 (E=256, max replicas 16)."""
    cases = []
    for policy, pid in _POLICY.items():
        for has_mask in (False, True):
            cfg = _cfg(256, 177, 16, 144)
            sig = {"topk_ptr": "*i64", "log2phy_ptr": "*i64", "logcnt_ptr": "*i64", "mask_ptr": "*u8",
                   "seed_ptr": "*i64", "out_ptr": "*i64", "lost_ptr": "*i64", "live_ptr": "*i64",
                   "livecnt_ptr": "*i64", "cnt_ptr": "*i64", "rank_ptr": "*i64", "s_ptr": "*i64",
                   "load_ptr": "*i64", "rep_ptr": "*i64", "even_ptr": "*i64", "NK": "i32", "E": "i32", "X": "i32",
                   "R": "i32", "G": "i32", "SPG": "i32", "iters": "i32",
                   "RANK": "i32"}
            const = dict(POLICY=pid, HAS_MASK=has_mask, BLOCK=cfg["BLOCK"], BLOCK2=cfg["BLOCK2"], BE=cfg["BE"],
                         R_PAD=cfg["R_PAD"], G_PAD=cfg["G_PAD"])
            for k in const:
                sig[k] = "constexpr"
            cases.append(dict(kernel=map_topk_kernel, signature=sig, constexprs=const, num_warps=4, num_stages=1,
                              attrs={}, config=f"{policy}{' mask' if has_mask else ''}"))
    return cases
