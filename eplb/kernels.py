"""`map_topk` on many CTAs: deterministic, fixed shapes, no host read (CUDA-graph capturable).

``static`` and ``random`` are one gather launch: every program maps its own block of selections straight from
``log2phy`` (each selection's row compacted to its live replicas in registers) and adds its lost count to the
output (zeroed before; integer adds, so the total does not depend on their order).

``round_robin`` and ``balanced`` need each selection's rank among its expert's selections (token-major), so
they take three launches, no program ever waiting on another program of its own launch:

1. `map_rank_kernel`, one program per chunk of ``CH`` selections: the in-chunk rank of each selection (pairwise
   compares over the chunk's earlier selections) and the chunk's per-expert histogram.
2. `map_plan_kernel`, one program: the live table (slot mask applied; ``balanced``: each expert's replicas
   rotated by ``(seed + rank + expert) mod live count``, as the torch path), an exclusive scan of the
   histograms over chunks (each chunk's per-expert offset, in place) and the per-expert totals, the lost count;
   ``balanced`` only: the damped water-filling in int64 fixed point (the torch path's arithmetic), the
   cumulative shares, and the busiest-GPU check in whole selections, computed per replica in closed form from
   the shares and the totals (the selections j of an expert with ``j * SCALE + SCALE / 2`` at or past a
   cumulative share), so no pass over the selections is needed.
3. `map_assign_kernel`, one program per block of selections: rank = chunk offset + in-chunk rank, the replica
   choice and the output.

All arithmetic is integer, so every launch equals the torch path (`eplb.dispatch`) bitwise whatever order the
programs run in. Workspace written by a program and read back by the same program (launch 2) is read with
``.cg`` loads (L2, not the incoherent L1) after a CTA barrier.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl


__all__ = ["map_topk_triton", "map_gather_kernel", "map_rank_kernel", "map_plan_kernel", "map_assign_kernel",
           "grid_sizes", "sm90_cases"]

_POLICY = {"static": 0, "random": 1, "round_robin": 2, "balanced": 3}
CHUNK = 256  # selections per histogram chunk (launches 1 and 3)


@triton.jit
def _hash(x):
    m = 0x7FFFFFFF
    x = x & m
    x = ((x >> 16) ^ x) * 0x45D9F3B & m
    x = ((x >> 16) ^ x) * 0x45D9F3B & m
    return (x >> 16) ^ x


@triton.jit
def map_gather_kernel(topk_ptr, log2phy_ptr, logcnt_ptr, mask_ptr, seed_ptr, out_ptr, lost_ptr, NK, X, R, RANK,
                      POLICY: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, R_PAD: tl.constexpr):
    """``static`` / ``random``: one program per ``BLOCK`` selections; ``lost_ptr`` must hold 0 before."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inr = offs < NK
    cols = tl.arange(0, R_PAD)
    ids = tl.load(topk_ptr + offs, mask=inr, other=-1).to(tl.int64)
    none = ids < 0
    safe = tl.where(none, 0, ids)
    real = inr & ~none
    lc = tl.load(logcnt_ptr + safe, mask=real, other=0).to(tl.int64)
    inc = real[:, None] & (cols[None, :] < R)
    l2p = tl.load(log2phy_ptr + safe[:, None] * X + cols[None, :], mask=inc, other=-1).to(tl.int64)
    valid = inc & (cols[None, :] < lc[:, None]) & (l2p >= 0)
    if HAS_MASK:
        m = tl.load(mask_ptr + tl.maximum(l2p, 0), mask=valid, other=0)
        valid = valid & (m != 0)
    vi = valid.to(tl.int32)
    pos = tl.cumsum(vi, axis=1) - 1
    nlive = tl.sum(vi, axis=1).to(tl.int64)
    if POLICY == 0:
        rep = tl.zeros([BLOCK], tl.int64)
    else:
        seed = tl.load(seed_ptr).to(tl.int64)
        rank64 = tl.full([], 0, tl.int64) + RANK
        rep = _hash(_hash(offs + seed * 0x9E3779B1) + rank64 * 0x9E3779B1) % tl.maximum(nlive, 1)
    phy = tl.sum(tl.where(valid & (pos.to(tl.int64) == rep[:, None]), l2p, 0), axis=1)
    tl.store(out_ptr + offs, tl.where(nlive == 0, -1, phy), mask=inr)
    tl.atomic_add(lost_ptr, tl.sum((real & (nlive == 0)).to(tl.int64), axis=0))


@triton.jit
def map_rank_kernel(topk_ptr, lrank_ptr, hist_ptr, NK, E, CH: tl.constexpr, BLOCK: tl.constexpr,
                    E_PAD: tl.constexpr):
    """Launch 1: in-chunk ranks (`[NK]`) and the chunk's histogram (row ``pid`` of `[chunks, E]`)."""
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * CH
    ar = tl.arange(0, BLOCK)
    hist = tl.zeros([E_PAD], tl.int32)
    for i0 in range(0, CH, BLOCK):
        oi = base + i0 + ar
        mi = oi < NK
        fi = tl.load(topk_ptr + oi, mask=mi, other=-1).to(tl.int32)
        fi = tl.where(fi < 0, E, fi)  # "no expert" is one more bin, ranked like an expert (never read back)
        before = (fi[:, None] == fi[None, :]) & (ar[None, :] < ar[:, None])
        r = tl.sum(before.to(tl.int32), axis=1)
        for j0 in range(0, i0, BLOCK):
            oj = base + j0 + ar
            mj = oj < NK
            fj = tl.load(topk_ptr + oj, mask=mj, other=-1).to(tl.int32)
            fj = tl.where(mj, tl.where(fj < 0, E, fj), E + 1)  # E + 1 matches nothing
            r += tl.sum((fi[:, None] == fj[None, :]).to(tl.int32), axis=1)
        tl.store(lrank_ptr + oi, r, mask=mi)
        hist += tl.histogram(fi, E_PAD, mask=mi & (fi < E))
    ecol = tl.arange(0, E_PAD)
    tl.store(hist_ptr + pid.to(tl.int64) * E + ecol, hist.to(tl.int64), mask=ecol < E)


@triton.jit
def map_plan_kernel(log2phy_ptr, logcnt_ptr, mask_ptr, seed_ptr, lost_ptr, hist_ptr, live_ptr, livecnt_ptr, cnt_ptr,
                    s_ptr, load_ptr, flag_ptr, C, E, X, R, G, SPG, iters, RANK,
                    POLICY: tl.constexpr, HAS_MASK: tl.constexpr, BE: tl.constexpr, R_PAD: tl.constexpr,
                    G_PAD: tl.constexpr, CB: tl.constexpr, BS: tl.constexpr):
    """Launch 2 (one program): live table, scan over chunks, lost count; ``balanced``: shares and the check."""
    SCALE_: tl.constexpr = 1048576
    BIG_: tl.constexpr = 4611686018427387904
    cols = tl.arange(0, R_PAD)
    gidx = tl.arange(0, G_PAD)
    seed = tl.load(seed_ptr).to(tl.int64)
    rank64 = tl.full([], 0, tl.int64) + RANK  # int64 arithmetic whatever RANK was specialised to
    # Live table (balanced: each expert's rotated by (seed + RANK + e) mod live count).
    for e0 in range(0, E, BE):
        rows = e0 + tl.arange(0, BE)
        inb = rows < E
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
    # Exclusive scan of the chunk histograms over chunks (in place), per-expert totals, lost selections.
    lost = tl.zeros([BS], tl.int64)
    for e0 in range(0, E, BS):
        ecols = e0 + tl.arange(0, BS)
        ine = ecols < E
        carry = tl.zeros([BS], tl.int64)
        for c0 in range(0, C, CB):
            crows = c0 + tl.arange(0, CB)
            hp = hist_ptr + crows[:, None].to(tl.int64) * E + ecols[None, :]
            hm = (crows[:, None] < C) & ine[None, :]
            h = tl.load(hp, mask=hm, other=0)
            tl.store(hp, tl.cumsum(h, axis=0) - h + carry[None, :], mask=hm)
            carry += tl.sum(h, axis=0)
        tl.store(cnt_ptr + ecols, carry, mask=ine)
        lcs = tl.load(livecnt_ptr + ecols, mask=ine, other=1, cache_modifier=".cg")
        lost += tl.where(lcs == 0, carry, 0)
    tl.store(lost_ptr, tl.sum(lost, axis=0))
    tl.debug_barrier()
    # Balanced: fixed-point water-filling, exactly the torch path's integer arithmetic.
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
                s = tl.load(s_ptr + rows[:, None] * R_PAD + cols[None, :], mask=valid, other=0, cache_modifier=".cg")
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
        # The busiest-GPU check in whole selections, per replica in closed form: of an expert's c selections,
        # j goes to live replica >= k (k >= 1) iff j * SCALE + SCALE / 2 >= cum[k - 1] (the last replica takes
        # the rest), and to replica k of the even split iff k * c <= j * n < (k + 1) * c.
        tl.store(load_ptr + gidx, tl.zeros([G_PAD], tl.int64))
        tl.store(load_ptr + G_PAD + gidx, tl.zeros([G_PAD], tl.int64))
        tl.debug_barrier()
        for e0 in range(0, E, BE):
            rows = e0 + tl.arange(0, BE)
            inb = rows < E
            lc = tl.load(livecnt_ptr + rows, mask=inb, other=0, cache_modifier=".cg")
            c = tl.load(cnt_ptr + rows, mask=inb, other=0, cache_modifier=".cg")
            valid = cols[None, :] < lc[:, None]
            sp = s_ptr + rows[:, None] * R_PAD + cols[None, :]
            prev = tl.load(sp - 1, mask=valid & (cols[None, :] >= 1), other=0, cache_modifier=".cg") - SCALE_ // 2
            cur = tl.load(sp, mask=valid & (cols[None, :] < lc[:, None] - 1), other=0, cache_modifier=".cg") - SCALE_ // 2
            first_ge = tl.where(prev <= 0, 0, (prev + SCALE_ - 1) // SCALE_)  # first j at or past cum[k - 1]
            first_nx = tl.where(cur <= 0, 0, (cur + SCALE_ - 1) // SCALE_)
            ge = tl.where(cols[None, :] == 0, c[:, None], c[:, None] - tl.minimum(first_ge, c[:, None]))
            ge_next = tl.where(cols[None, :] < lc[:, None] - 1, c[:, None] - tl.minimum(first_nx, c[:, None]), 0)
            n1 = tl.maximum(lc, 1)[:, None]
            k = cols[None, :].to(tl.int64)
            n_even = ((k + 1) * c[:, None] + n1 - 1) // n1 - (k * c[:, None] + n1 - 1) // n1
            slot = tl.load(live_ptr + rows[:, None] * R_PAD + cols[None, :], mask=valid, other=0,
                           cache_modifier=".cg")
            tl.atomic_add(load_ptr + slot // SPG, ge - ge_next, mask=valid)
            tl.atomic_add(load_ptr + G_PAD + slot // SPG, n_even, mask=valid)
        tl.debug_barrier()
        br = tl.max(tl.load(load_ptr + gidx, mask=gidx < G, other=0, cache_modifier=".cg"), axis=0)
        be = tl.max(tl.load(load_ptr + G_PAD + gidx, mask=gidx < G, other=0, cache_modifier=".cg"), axis=0)
        tl.store(flag_ptr, (br <= be).to(tl.int64))


@triton.jit
def map_assign_kernel(topk_ptr, seed_ptr, out_ptr, lrank_ptr, hist_ptr, live_ptr, livecnt_ptr, cnt_ptr, s_ptr,
                      flag_ptr, NK, E, RANK, POLICY: tl.constexpr, CH: tl.constexpr, BLOCK: tl.constexpr,
                      R_PAD: tl.constexpr):
    """Launch 3: rank = chunk offset + in-chunk rank, the replica choice and the output."""
    SCALE_: tl.constexpr = 1048576
    BIG_: tl.constexpr = 4611686018427387904
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inr = offs < NK
    cols = tl.arange(0, R_PAD)
    ids = tl.load(topk_ptr + offs, mask=inr, other=-1).to(tl.int64)
    none = ids < 0
    safe = tl.where(none, 0, ids)
    lc = tl.load(livecnt_ptr + safe, mask=inr, other=0)
    off = none | (lc == 0)
    cnt1 = tl.maximum(lc, 1)
    rank = tl.load(hist_ptr + (offs // CH) * E + safe, mask=inr & ~none, other=0) \
        + tl.load(lrank_ptr + offs, mask=inr, other=0)
    if POLICY == 2:
        seed = tl.load(seed_ptr).to(tl.int64)
        rank64 = tl.full([], 0, tl.int64) + RANK
        rep = ((rank + seed + rank64) % cnt1 + cnt1) % cnt1
    else:
        cum = tl.load(s_ptr + safe[:, None] * R_PAD + cols[None, :], mask=inr[:, None] & (cols[None, :] < lc[:, None]),
                      other=BIG_)
        rep = tl.sum(((rank * SCALE_ + SCALE_ // 2)[:, None] >= cum).to(tl.int64), axis=1)
        rep = tl.minimum(rep, cnt1 - 1)
        cexp = tl.load(cnt_ptr + safe, mask=inr, other=1)
        even = tl.where(none, 0, rank * cnt1 // tl.maximum(cexp, 1))
        rep = tl.where(tl.load(flag_ptr) != 0, rep, even)
    phy = tl.load(live_ptr + safe * R_PAD + rep, mask=inr & ~off, other=-1)
    tl.store(out_ptr + offs, tl.where(off, -1, phy), mask=inr)


def _cfg(E: int, X: int, width: Optional[int], num_gpus: int, NK: int):
    R = X if width is None else max(1, min(int(width), X))
    r_pad = triton.next_power_of_2(R)
    return dict(R=R, R_PAD=r_pad, BE=max(1, min(triton.next_power_of_2(E), 512 // r_pad)),
                GBLOCK=max(16, min(256, 2048 // r_pad)), ABLOCK=max(16, min(256, 1024 // r_pad)),
                E_PAD=triton.next_power_of_2(E + 1), G_PAD=triton.next_power_of_2(num_gpus + 1),
                CHUNKS=max(1, triton.cdiv(NK, CHUNK)), BS=min(128, triton.next_power_of_2(E)), CB=16)


def grid_sizes(policy: str, num_tokens: int, topk: int, num_experts: int, max_replicas: int) -> list:
    """Programs per launch of ``map_topk_triton`` (in launch order), from the shapes alone."""
    NK = num_tokens * topk
    cfg = _cfg(num_experts, max_replicas, None, 1, NK)
    if _POLICY[policy] < 2:
        return [max(1, triton.cdiv(NK, cfg["GBLOCK"]))]
    return [cfg["CHUNKS"], 1, max(1, triton.cdiv(NK, cfg["ABLOCK"]))]


def map_topk_triton(topk_idx: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor, policy: str, *,
                    seed: Union[int, torch.Tensor] = 0, num_gpus: Optional[int] = None,
                    num_slots: Optional[int] = None, iters: int = 8, slot_mask: Optional[torch.Tensor] = None,
                    lost_out: Optional[torch.Tensor] = None, max_replicas: Optional[int] = None,
                    rank: int = 0) -> torch.Tensor:
    """Triton `eplb.map_topk` (arguments checked there): one launch for ``static`` / ``random``, three for
    ``round_robin`` / ``balanced``. ``max_replicas`` bounds the replica columns read (default all of
    ``log2phy``'s): pass the placement's ``logcnt.max()`` to keep the tiles small. Shapes alone decide the
    launches, so a call can be captured in a CUDA graph."""
    N, K = topk_idx.shape
    E, X = log2phy.shape
    dev = topk_idx.device
    NK = N * K
    i64 = torch.int64
    out = torch.empty((N, K), dtype=i64, device=dev)
    lost = lost_out if lost_out is not None else torch.empty((), dtype=i64, device=dev)
    if NK == 0 or E == 0 or X == 0:
        out.fill_(-1)
        lost.zero_()
        return out
    pol = _POLICY[policy]
    G = num_gpus if policy == "balanced" else 1
    spg = num_slots // num_gpus if policy == "balanced" else 1
    cfg = _cfg(E, X, max_replicas, G, NK)
    r_pad, g_pad = cfg["R_PAD"], cfg["G_PAD"]
    seed_t = seed.reshape(()).to(i64) if isinstance(seed, torch.Tensor) else torch.full((), int(seed), dtype=i64,
                                                                                         device=dev)
    mask = slot_mask if slot_mask is not None else out  # any pointer; unread without HAS_MASK
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    topk, l2p, lcnt = topk_idx.contiguous(), log2phy.contiguous(), logcnt.contiguous()
    if pol < 2:
        lost.zero_()
        map_gather_kernel[(triton.cdiv(NK, cfg["GBLOCK"]),)](
            topk, l2p, lcnt, mask, seed_t, out, lost, NK, X, cfg["R"], int(rank), POLICY=pol,
            HAS_MASK=slot_mask is not None, BLOCK=cfg["GBLOCK"], R_PAD=r_pad, num_warps=4)
        return out
    C = cfg["CHUNKS"]
    ws = torch.empty(C * E + E * r_pad * 2 + E * 2 + 2 * g_pad + 1, dtype=i64, device=dev)
    parts, o = [], 0
    for n in (C * E, E * r_pad, E * r_pad, E, E, 2 * g_pad, 1):
        parts.append(ws[o:o + n])
        o += n
    hist, live, s, livecnt, cnt, load, flag = parts
    lrank = torch.empty(NK, dtype=torch.int32, device=dev)
    map_rank_kernel[(C,)](topk, lrank, hist, NK, E, CH=CHUNK, BLOCK=64, E_PAD=cfg["E_PAD"], num_warps=4)
    map_plan_kernel[(1,)](l2p, lcnt, mask, seed_t, lost, hist, live, livecnt, cnt, s, load, flag, C, E, X, cfg["R"],
                          G, spg, iters, int(rank), POLICY=pol, HAS_MASK=slot_mask is not None, BE=cfg["BE"],
                          R_PAD=r_pad, G_PAD=g_pad, CB=cfg["CB"], BS=cfg["BS"], num_warps=4)
    map_assign_kernel[(triton.cdiv(NK, cfg["ABLOCK"]),)](
        topk, seed_t, out, lrank, hist, live, livecnt, cnt, s, flag, NK, E, int(rank), POLICY=pol, CH=CHUNK,
        BLOCK=cfg["ABLOCK"], R_PAD=r_pad, num_warps=4)
    return out


def sm90_cases() -> list:
    """The shipped configurations for the sm90 compile test: every launch of every policy, with and without the
    mask, DeepSeek-V3 at EP144 (E=256, max replicas 16, 4096 x 8 selections)."""
    cfg = _cfg(256, 177, 16, 144, 4096 * 8)
    cases = []

    def add(kernel, sig, const, config):
        sig = dict(sig)
        for k in const:
            sig[k] = "constexpr"
        cases.append(dict(kernel=kernel, signature=sig, constexprs=const, num_warps=4, num_stages=1, attrs={},
                          config=config))

    for policy in ("static", "random"):
        for has_mask in (False, True):
            add(map_gather_kernel, {"topk_ptr": "*i64", "log2phy_ptr": "*i64", "logcnt_ptr": "*i64",
                                    "mask_ptr": "*u8", "seed_ptr": "*i64", "out_ptr": "*i64", "lost_ptr": "*i64",
                                    "NK": "i32", "X": "i32", "R": "i32", "RANK": "i32"},
                dict(POLICY=_POLICY[policy], HAS_MASK=has_mask, BLOCK=cfg["GBLOCK"], R_PAD=cfg["R_PAD"]),
                f"gather {policy}{' mask' if has_mask else ''}")
    add(map_rank_kernel, {"topk_ptr": "*i64", "lrank_ptr": "*i32", "hist_ptr": "*i64", "NK": "i32", "E": "i32"},
        dict(CH=CHUNK, BLOCK=64, E_PAD=cfg["E_PAD"]), "rank")
    for policy in ("round_robin", "balanced"):
        for has_mask in (False, True):
            add(map_plan_kernel, {"log2phy_ptr": "*i64", "logcnt_ptr": "*i64", "mask_ptr": "*u8", "seed_ptr": "*i64",
                                  "lost_ptr": "*i64", "hist_ptr": "*i64", "live_ptr": "*i64", "livecnt_ptr": "*i64",
                                  "cnt_ptr": "*i64", "s_ptr": "*i64", "load_ptr": "*i64", "flag_ptr": "*i64",
                                  "C": "i32", "E": "i32", "X": "i32", "R": "i32", "G": "i32", "SPG": "i32",
                                  "iters": "i32", "RANK": "i32"},
                dict(POLICY=_POLICY[policy], HAS_MASK=has_mask, BE=cfg["BE"], R_PAD=cfg["R_PAD"], G_PAD=cfg["G_PAD"],
                     CB=cfg["CB"], BS=cfg["BS"]), f"plan {policy}{' mask' if has_mask else ''}")
        add(map_assign_kernel, {"topk_ptr": "*i64", "seed_ptr": "*i64", "out_ptr": "*i64", "lrank_ptr": "*i32",
                                "hist_ptr": "*i64", "live_ptr": "*i64", "livecnt_ptr": "*i64", "cnt_ptr": "*i64",
                                "s_ptr": "*i64", "flag_ptr": "*i64", "NK": "i32", "E": "i32", "RANK": "i32"},
            dict(POLICY=_POLICY[policy], CH=CHUNK, BLOCK=cfg["ABLOCK"], R_PAD=cfg["R_PAD"]), f"assign {policy}")
    return cases
