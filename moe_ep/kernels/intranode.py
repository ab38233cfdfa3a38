"""Normal-mode (prefill) dispatch / combine kernels of the ``symm`` backend, over peer-pointer tables.

Messages are rows of int32 words (the caller packs payload | scales | top-k | weights into one row),
so one send kernel and one receive kernel serve dispatch, cached dispatch and combine:

- :func:`_scatter_send_kernel` (one launch per rank, grid ``(R destinations, token blocks)``): row ``t``
  goes to slot ``pos[t, d]`` of this rank's block in destination ``d``'s area (``pos = -1``: not sent).
  Before writing, every program waits until ``d`` has drained the previous message block (busy word);
  the last program of ``d`` sets the busy word and publishes ``count + 1`` in ``d``'s full word.
  A slot ``>= cap`` (past this rank's block) is not written: the status word reports
  ``STATUS_WORST_EXCEEDED - d`` (a single-round dispatch with ``num_worst_tokens`` whose caller broke its word).
- :func:`_recv_counts_kernel`: waits for every source and records its row count (the host reads them to
  size the outputs when ``num_worst_tokens`` is 0).
- :func:`_gather_recv_kernel` (grid ``(R sources, row blocks)``): copies source ``s``'s rows after the
  rows of sources ``< s`` (source-rank, then source-token order); the last program resets the full
  words and frees every source's block (busy = 0 on the source).
- :func:`_combine_recv_kernel`: per token, float32 sum of the initial value (bias terms), then the rows
  returned by each rank in ascending rank order (BF16 / FP16 rows, or FP8 rows with 1x128 scales decoded to
  float32), one round-to-nearest-even cast to BF16 or FP16; the reduced
  top-k weights likewise. Its last program also frees a dispatch area still held for a receive view.

Receive as a view (``VIEW``: the dispatch receive is handed out as views of the receiver's own buffer,
no copy): the send kernel then writes the receiver's area as *planes* ``[P rows][width_j words]``, one per
column segment of the message row (payload | scales | top-k ids | weights + padding), ``P`` = as many
rows as the area holds (at least ``R * cap``), each plane 64-byte aligned, and row ``t`` of this rank
lands at row ``prefix + pos[t, d]`` where ``prefix`` is the number of rows the lower ranks send to ``d``
(read from ``d``'s ``CNT`` words, which every sender writes before its rows). So rows are ordered by
source rank, then source token, with no gaps: ``plane_0[:M]`` is ``recv_x``. :func:`_view_recv_kernel`
only waits, counts and checks signatures; the area stays held (``HELD`` words set) until this rank's
next combine receive or its next dispatch (:func:`_release_held_kernel`, launched before the sends)
frees it.

Signals (int32 words of each rank's signal region, see :func:`signal_layout`)::

    FULL  + s   on receiver: source s's block is complete (value count + 1); receiver resets it
    BUSY  + d   on sender: d has not drained our block yet (1); d resets it to 0 after copying
    *_CNT       local arrive_last counters (nobody waits on them)
    DISP_CNT + s   on receiver: source s's dispatch row count + 1, written before its rows (view prefixes)
    DISP_HELD + s  on receiver: 1 while source s's rows are handed out as a receive view
    DISP_META + s, DISP_META + R + s   on receiver: source s's rows for us over the whole call and its token
                   count (written before FULL; they fix a chunked dispatch's offsets and number of rounds)
    REFUSED + s    on receiver, local: set to 1 by a receive that saw source s's refused signature (``SIG_REFUSED``:
                   s's own checks raised, it sent an empty block); zeroed by program (0, 0) of this rank's next send
                   (``REF``), so the host reads the current call's (copies queued earlier keep theirs)

Refusals (docs/protocols.md): a rank whose own checks refuse a call publishes, in place of it, a signature with
``SIG_REFUSED`` and an empty block (the send kernel with no rows) and drains its peers' blocks
(:func:`_gather_recv_kernel` with ``DRAIN``); the peers' receives note it, skip its (empty) block and complete.

Time-shared area (``BUSY2``): a copying dispatch and the combine that follows it may use the same bytes of the
receiver's buffer (source ``s``'s block of either operation is written only by ``s``). A send then waits on both of
its busy words for ``d``: each is reset by ``d``'s receive of that operation only after every source's rows were
read (the last program), so ``d``'s whole area is drained of the other operation before ``s`` writes it.

Rounds (a batch larger than the buffer, :mod:`moe_ep.backends.symm_normal`): each round is one send and one
receive launch of these kernels on a slice of the tokens; :func:`_gather_recv_kernel` with ``OFFS`` puts each
source's rows at given output rows, :func:`_scatter_send_kernel` with ``SEG`` sends each destination a
contiguous run of rows (a chunked combine), and :func:`_recv_counts_kernel` with ``META`` also returns the
whole-call sizes.

NOTES: a timed-out wait leaves ``status`` set; programs then mask their writes and the last program
does not publish, so peers time out too (naming this rank) instead of reading half-written rows.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .logfmt import e4m3_decode, fp16_bits
from .low_latency_common import _bf16_bits, _signature_differs, _status_ok
from .signals import STATUS_WORST_EXCEEDED, report_error, arrive_last, signal_release, wait_ne

assert STATUS_WORST_EXCEEDED == -16777216  # (written as a literal in the kernel)

__all__ = ["SIG_REFUSED", "signal_layout", "view_planes", "_scatter_send_kernel", "_recv_counts_kernel", "_gather_recv_kernel",
           "_view_recv_kernel", "_release_held_kernel", "_combine_recv_kernel", "_combine_recv_fmt_kernel"]


def signal_layout(world_size: int) -> dict:
    """Word offsets of the normal-mode signal arrays (dispatch and combine have their own)."""
    R = world_size
    # DISP_SIG / COMB_SIG: call signatures, 4 words per rank (the kernels compute the offsets with
    # _sig_base): entry r on a receiver holds what rank r sent, the receiver's own entry its own call.
    return {"DISP_FULL": 0, "DISP_BUSY": R, "COMB_FULL": 2 * R, "COMB_BUSY": 3 * R, "DISP_SEND_CNT": 4 * R,
            "COMB_SEND_CNT": 5 * R, "DISP_RECV_CNT": 6 * R, "COMB_RECV_CNT": 6 * R + 1,
            "DISP_SIG": 6 * R + 2, "COMB_SIG": 10 * R + 2, "DISP_CNT": 14 * R + 2, "DISP_HELD": 15 * R + 2,
            "DISP_META": 16 * R + 2, "REFUSED": 18 * R + 2, "WORDS": (19 * R + 2 + 7) // 8 * 8}


def view_planes(rows: int, bounds: tuple, words: int) -> tuple:
    """Word offsets of the receive-view planes: ``bounds = (S1, S2, S3)`` are the first columns of the
    scales, top-k ids and weights segments of a ``words``-wide message row; plane ``j`` holds ``rows`` rows
    of segment ``j`` and starts 64-byte aligned. Returns ``(O1, O2, O3, end)`` (plane 0 starts at 0)."""
    cols = (0, *bounds, words)
    offs, at = [], 0
    for j in range(4):
        if j:
            at = (at + 15) // 16 * 16
            offs.append(at)
        at += rows * (cols[j + 1] - cols[j])
    return (*offs, at)


@triton.jit
def _sig_base(R, FULL: tl.constexpr):
    """Word offset of the signature area of the operation whose full words start at ``FULL`` (0: dispatch,
    2R: combine)."""
    return 6 * R + 2 + 4 * R * ((FULL // 2) // R)



#: flags bit of a call signature that says "this rank refused its call" (its own input checks raised): the
#: rank publishes it with an empty block (FULL = 1) so that its peers' receives complete and name it.
SIG_REFUSED = 1 << 30


@triton.jit
def _refused(my_sig, base, s):
    """Whether source ``s``'s published signature (entry ``s`` of the area at ``base``) is a refusal."""
    return (tl.load(my_sig + base + 4 * s + 3, volatile=True) & 0x40000000) != 0  # SIG_REFUSED


@triton.jit
def _check_source(my_sig, status_ptr, rank, R, s, FULL: tl.constexpr, REF: tl.constexpr):
    """After the FULL wait on source ``s``: a refusal is noted in this rank's local word ``REF + s`` (the host
    raises ``RemoteRankError`` naming ``s``; its block is empty) and not compared; any other signature that
    differs from this rank's is a call mismatch (status ``STATUS_SIG_MISMATCH - s``). (The words are zeroed by
    this rank's send of the same kind, a launch before this receive: see :func:`_scatter_send_kernel`.)"""
    if tl.load(status_ptr, volatile=True) == 0:
        base = _sig_base(R, FULL)
        if _refused(my_sig, base, s):
            if REF >= 0:
                tl.atomic_xchg(my_sig + REF + s, 1, sem="relaxed", scope="sys")
        elif _signature_differs(my_sig, base, rank, s):
            report_error(status_ptr, -16 - s)  # STATUS_SIG_MISMATCH - s


@triton.jit
def _words(ptrs, r):
    """Base of rank ``r``'s region as an int32 pointer."""
    # NOTES: regions are 256-byte aligned; saying so lets the compiler vectorise accesses through a
    # pointer loaded from memory (with W and the offsets divisible by 16, which launches specialise on).
    return tl.multiple_of(tl.load(ptrs + r).to(tl.pointer_type(tl.int32)), 16)


@triton.jit
def _free_source(my_sig, signal_ptrs, rank, sp, base, clear, FULL: tl.constexpr, BUSY: tl.constexpr,
                 CNT: tl.constexpr):
    """Source ``sp``'s block here is read: reset its full (and count) word and, unless an error left it for the
    host to name, its signature entry; then free it on ``sp`` (busy = 0 there, release: the resets come first, and
    ``sp`` writes nothing else of ours before its next send)."""
    tl.atomic_xchg(my_sig + FULL + sp, 0, sem="relaxed", scope="sys")
    if CNT >= 0:
        tl.atomic_xchg(my_sig + CNT + sp, 0, sem="relaxed", scope="sys")
    if clear:
        for w in tl.static_range(4):
            tl.store(my_sig + base + 4 * sp + w, 0)
    signal_release(_words(signal_ptrs, sp) + BUSY + rank, 0)


@triton.jit
def _release_blocks(my_sig, signal_ptrs, status_ptr, rank, R, FULL: tl.constexpr, BUSY: tl.constexpr,
                    CNT: tl.constexpr = -1):
    """Receiver done: free every source's block (:func:`_free_source`)."""
    base = _sig_base(R, FULL)
    clear = tl.load(status_ptr, volatile=True) == 0  # after an error the host names the differing fields
    for sp in range(R):
        _free_source(my_sig, signal_ptrs, rank, sp, base, clear, FULL, BUSY, CNT)


@triton.jit
def _release_held(my_sig, signal_ptrs, status_ptr, rank, R, FULL: tl.constexpr, BUSY: tl.constexpr,
                  CNT: tl.constexpr, HELD: tl.constexpr):
    """Free the dispatch blocks still held for a receive view (per source, only where ``HELD`` is set; the
    exchange makes a second release of the same hold a no-op)."""
    base = _sig_base(R, FULL)
    clear = tl.load(status_ptr, volatile=True) == 0
    for sp in range(R):
        if tl.atomic_xchg(my_sig + HELD + sp, 0, sem="acq_rel", scope="sys") != 0:
            _free_source(my_sig, signal_ptrs, rank, sp, base, clear, FULL, BUSY, CNT)


@triton.jit
def _release_held_kernel(signal_ptrs, status_ptr, rank, R, FULL: tl.constexpr, BUSY: tl.constexpr,
                         CNT: tl.constexpr, HELD: tl.constexpr):
    """One program: :func:`_release_held` (launched before a dispatch's sends when a view may be held)."""
    _release_held(_words(signal_ptrs, rank), signal_ptrs, status_ptr, rank, R, FULL, BUSY, CNT, HELD)


@triton.jit
def _copy_segment(src_ptr, dst_ptr, offs_t, rows, ok, W, c0, c1, BLOCK_W: tl.constexpr):
    """Columns ``[c0, c1)`` of the ``W``-wide source rows ``offs_t`` -> rows ``rows`` of a plane ``c1 - c0`` wide."""
    width = c1 - c0
    for w0 in range(c0, c1, BLOCK_W):
        offs_w = w0 + tl.arange(0, BLOCK_W)
        m = ok[:, None] & (offs_w < c1)[None, :]
        v = tl.load(src_ptr + offs_t.to(tl.int64)[:, None] * W + offs_w[None, :], mask=m)
        tl.store(dst_ptr + rows.to(tl.int64)[:, None] * width + (offs_w - c0)[None, :], v, mask=m)


@triton.jit
def _scatter_send_kernel(
    src_ptr,  # [N, W] int32 message rows
    pos_ptr,  # [N, R] int32 slot of row t at destination d, -1 = not sent
    counts_ptr,  # [R] int32 rows sent to each destination (this round)
    tot_ptr,  # META: [R] int32 rows of the whole call for each destination (all rounds)
    buffer_ptrs, signal_ptrs, status_ptr,
    rank, N, R, W, block_off, cap, timeout_ns,  # block_off: words from the region start to our block at d;
    # cap: rows of that block (a slot >= cap is never written: it is the next source's block)
    ntok,  # META: this rank's token count of the whole call
    S1, S2, S3, O1, O2, O3,  # VIEW: first column of segments 1-3 and word offsets of their planes
    FULL: tl.constexpr, BUSY: tl.constexpr, SEND_CNT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr,
    CNT: tl.constexpr = -1, VIEW: tl.constexpr = False,  # CNT: offset of d's count words (dispatch), -1 none
    META: tl.constexpr = -1,  # offset of d's words [R totals][R token counts] (dispatch), -1 none
    SEG: tl.constexpr = False,  # rows for d are src rows [pos_ptr[d], + counts[d]) (pos_ptr: [R] offsets)
    BUSY2: tl.constexpr = -1,  # the other operation's busy words (time-shared area): also wait for them, -1 none
    REF: tl.constexpr = -1,  # offset of this rank's local refusal words: zeroed here, before this call's receive
):
    d = tl.program_id(0)
    c = tl.program_id(1)
    my_sig = _words(signal_ptrs, rank)
    if REF >= 0:
        if (d == 0) & (c == 0):
            for s in range(R):
                tl.store(my_sig + REF + s, 0)

    # Step 1: d has drained our previous block (and, time-shared, its receive of the other operation is done).
    wait_ne(my_sig + BUSY + d, 1, status_ptr, d, timeout_ns)
    if BUSY2 >= 0:
        wait_ne(my_sig + BUSY2 + d, 1, status_ptr, d, timeout_ns)
    tl.debug_barrier()

    if SEG:  # a round of a chunked combine: slot i of d's block <- source row pos_ptr[d] + i
        slot = c * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = slot < tl.load(counts_ptr + d)
        offs_t = tl.load(pos_ptr + d) + slot
        pos = tl.where(t_ok, slot, -1)
    else:
        offs_t = c * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = offs_t < N
        pos = tl.load(pos_ptr + offs_t.to(tl.int64) * R + d, mask=t_ok, other=-1)
    if CNT >= 0:
        # Our row count for d, before any row (every program writes the same value: no program waits on
        # another of this launch). In VIEW mode our rows start after those of the lower ranks.
        tl.atomic_xchg(_words(signal_ptrs, d) + CNT + rank, tl.load(counts_ptr + d) + 1, sem="relaxed", scope="sys")
    if VIEW:
        prefix = 0
        for sp in range(rank):
            v = wait_ne(_words(signal_ptrs, d) + CNT + sp, 0, status_ptr, sp, timeout_ns)
            prefix += tl.maximum(v - 1, 0)
        tl.debug_barrier()
        ok = (pos >= 0) & t_ok & _status_ok(status_ptr, offs_t)
        # Step 2 (view): rows -> the planes of d's area, row prefix + pos.
        rows = prefix + tl.where(ok, pos, 0)
        area = _words(buffer_ptrs, d) + block_off
        _copy_segment(src_ptr, area, offs_t, rows, ok, W, 0, S1, BLOCK_W)
        _copy_segment(src_ptr, area + O1, offs_t, rows, ok, W, S1, S2, BLOCK_W)
        _copy_segment(src_ptr, area + O2, offs_t, rows, ok, W, S2, S3, BLOCK_W)
        _copy_segment(src_ptr, area + O3, offs_t, rows, ok, W, S3, W, BLOCK_W)
    else:
        # Step 2: rows -> our block of d's area: [R sources][cap rows][W words].
        ok = (pos >= 0) & t_ok & _status_ok(status_ptr, offs_t)
        # A slot past our block (a dispatch with num_worst_tokens <= cap sends every token in one round, on the
        # caller's word that d receives at most num_worst_tokens rows) would overwrite the next source's rows:
        # never written; the status word names d, and the last program does not publish.
        if tl.sum((ok & (pos >= cap)).to(tl.int32), axis=0) > 0:
            report_error(status_ptr, -16777216 - d)  # STATUS_WORST_EXCEEDED - d
        ok = ok & (pos < cap)
        dst = _words(buffer_ptrs, d) + block_off
        for w0 in range(0, W, BLOCK_W):
            offs_w = w0 + tl.arange(0, BLOCK_W)
            m = ok[:, None] & (offs_w < W)[None, :]
            v = tl.load(src_ptr + offs_t.to(tl.int64)[:, None] * W + offs_w[None, :], mask=m)
            tl.store(dst + pos.to(tl.int64)[:, None] * W + offs_w[None, :], v, mask=m)

    # Step 3: the last program for d publishes: busy[d] = 1 here, full[rank] = count + 1 on d.
    tl.debug_barrier()
    if arrive_last(my_sig + SEND_CNT + d, tl.num_programs(1)):
        if tl.load(status_ptr, volatile=True) == 0:
            tl.atomic_xchg(my_sig + BUSY + d, 1, sem="relaxed", scope="sys")
            base = _sig_base(R, FULL)  # our call signature travels before the release of FULL
            for w in tl.static_range(4):
                tl.store(_words(signal_ptrs, d) + base + 4 * rank + w,
                         tl.load(my_sig + base + 4 * rank + w, volatile=True))
            if META >= 0:  # the whole call's sizes (they fix the receiver's offsets and the number of rounds)
                tl.store(_words(signal_ptrs, d) + META + rank, tl.load(tot_ptr + d))
                tl.store(_words(signal_ptrs, d) + META + R + rank, ntok)
            signal_release(_words(signal_ptrs, d) + FULL + rank, tl.load(counts_ptr + d) + 1)


@triton.jit
def _recv_counts_kernel(counts_ptr, signal_ptrs, status_ptr, rank, timeout_ns, FULL: tl.constexpr,
                        META: tl.constexpr = -1):
    """Program s: wait for source s and record its row count (the full word stays set). ``META >= 0``:
    ``counts_ptr`` is `[4, R]`: this round's counts, then the whole call's rows and token count of s, then 1
    where s refused its call (read in the host read the receive makes anyway)."""
    s = tl.program_id(0)
    v = wait_ne(_words(signal_ptrs, rank) + FULL + s, 0, status_ptr, s, timeout_ns)
    tl.store(counts_ptr + s, tl.maximum(v - 1, 0))
    if META >= 0:
        R = tl.num_programs(0)
        ok = v != 0  # (a timed-out wait: the status word reports it, the words are not read)
        my_sig = _words(signal_ptrs, rank)
        tl.store(counts_ptr + R + s, tl.where(ok, tl.load(my_sig + META + s, volatile=True), 0))
        tl.store(counts_ptr + 2 * R + s, tl.where(ok, tl.load(my_sig + META + R + s, volatile=True), 0))
        tl.store(counts_ptr + 3 * R + s, tl.where(ok, _refused(my_sig, _sig_base(R, FULL), s).to(tl.int32), 0))


@triton.jit
def _gather_recv_kernel(
    out_ptr,  # [M, W] int32
    counts_ptr,  # [R] int32 out: rows received from each source
    dst_ptr,  # OFFS: [R] int32 first output row of each source's rows (a round of a chunked dispatch)
    buffer_ptrs, signal_ptrs, status_ptr,
    rank, R, W, cap, area_off, M, timeout_ns,
    FULL: tl.constexpr, BUSY: tl.constexpr, RECV_CNT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr,
    CNT: tl.constexpr = -1, OFFS: tl.constexpr = False,
    REF: tl.constexpr = -1,  # offset of this rank's local refusal words (see _check_source), -1: none
    DRAIN: tl.constexpr = False,  # this rank refused its call: wait, read nothing, free every block
):
    s = tl.program_id(0)
    c = tl.program_id(1)
    my_sig = _words(signal_ptrs, rank)

    # Step 1: every source's count; source s's rows go after those of the sources before it.
    offset = 0
    n_s = 0
    for sp in range(R):
        v = wait_ne(my_sig + FULL + sp, 0, status_ptr, sp, timeout_ns)
        n_sp = tl.maximum(v - 1, 0)
        offset += tl.where(sp < s, n_sp, 0)
        n_s = tl.where(sp == s, n_sp, n_s)
    if OFFS:
        offset = tl.load(dst_ptr + s)
    tl.debug_barrier()
    # Rows laid out for another call (hidden, dtype, top-k, experts) are never read: report it instead
    # (a refusal of s is noted, its block is empty).
    if DRAIN == 0:  # (== 0, not `not`: the sm90 checks also compile it as a runtime int)
        _check_source(my_sig, status_ptr, rank, R, s, FULL, REF)
        if c == 0:
            tl.store(counts_ptr + s, n_s)
            if offset + n_s > M:  # more rows than the worst-case size: dropped, but never silently
                report_error(status_ptr, -1)  # STATUS_OVERFLOW

    # Step 2: copy rows of s's block (rows past M, the worst-case size, are dropped).
    rows = c * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = (rows < n_s) & (offset + rows < M) & _status_ok(status_ptr, rows)
    if DRAIN:
        ok = ok & (rows < 0)
    src = _words(buffer_ptrs, rank) + area_off + s.to(tl.int64) * cap * W
    for w0 in range(0, W, BLOCK_W):
        offs_w = w0 + tl.arange(0, BLOCK_W)
        m = ok[:, None] & (offs_w < W)[None, :]
        v = tl.load(src + rows.to(tl.int64)[:, None] * W + offs_w[None, :], mask=m)
        tl.store(out_ptr + (offset + rows).to(tl.int64)[:, None] * W + offs_w[None, :], v, mask=m)

    # Step 3: the last program resets the full words and frees our block on every source.
    # NOTES: every program waited on every source before arriving, so the last one knows all reads are done.
    tl.debug_barrier()
    if arrive_last(my_sig + RECV_CNT, tl.num_programs(0) * tl.num_programs(1)):
        _release_blocks(my_sig, signal_ptrs, status_ptr, rank, R, FULL, BUSY, CNT)


@triton.jit
def _view_recv_kernel(
    counts_ptr,  # [R] int32 out: rows received from each source
    signal_ptrs, status_ptr,
    rank, R, M, timeout_ns,  # M: rows the caller will view (more received is an overflow)
    FULL: tl.constexpr, HELD: tl.constexpr, REF: tl.constexpr = -1,
):
    """One program, receive as a view: wait for every source, record its count, check its call signature,
    and mark its rows held (freed by :func:`_release_held`). The rows stay where the senders put them."""
    my_sig = _words(signal_ptrs, rank)
    total = 0
    for s in range(R):
        v = wait_ne(my_sig + FULL + s, 0, status_ptr, s, timeout_ns)
        n_s = tl.maximum(v - 1, 0)
        tl.store(counts_ptr + s, n_s)
        total += n_s
    tl.debug_barrier()
    for s in range(R):
        _check_source(my_sig, status_ptr, rank, R, s, FULL, REF)
    if total > M:
        report_error(status_ptr, -1)  # STATUS_OVERFLOW
    for s in range(R):
        tl.atomic_xchg(my_sig + HELD + s, 1, sem="relaxed", scope="sys")


@triton.jit
def _combine_recv_impl(
    acc_ptr,  # [N, H] float32: the bias terms' sum (the initial value)
    out_ptr,  # [N, H] bf16 as int16
    wout_ptr,  # [N, K] float32 (HAS_W)
    pos_ptr,  # [N, R] int32: slot of token t in rank d's block (-1: not sent there)
    buffer_ptrs, signal_ptrs, status_ptr,
    rank, N, R, W, cap, area_off, timeout_ns,
    H: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, HAS_W: tl.constexpr,
    FULL: tl.constexpr, BUSY: tl.constexpr, RECV_CNT: tl.constexpr,
    BLOCK_T: tl.constexpr, HC: tl.constexpr,
    FMT: tl.constexpr, OUT_F16: tl.constexpr,
    DFULL: tl.constexpr, DBUSY: tl.constexpr, DCNT: tl.constexpr, DHELD: tl.constexpr, REF: tl.constexpr,
):
    """Row payload by ``FMT`` (:mod:`moe_ep.kernels.logfmt`): 0 BF16 / 1 FP16 ``H`` values, 2 FP8 ``H`` e4m3
    bytes | ``H/128`` float32 scales; the weights follow the payload (word ``H/2``, or ``H/4 + H/128``)."""
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    my_sig = _words(signal_ptrs, rank)

    # Step 1: every rank has returned its rows (for the same call: else the status word says which rank).
    for d in range(R):
        wait_ne(my_sig + FULL + d, 0, status_ptr, d, timeout_ns)
    tl.debug_barrier()
    for d in range(R):
        _check_source(my_sig, status_ptr, rank, R, d, FULL, REF)

    # Step 2: float32 sum in ascending rank order, one cast (the torch backend's order, bitwise).
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = offs_t < N
    ok = _status_ok(status_ptr, offs_t) & t_ok
    offs_h = pid_h * HC + tl.arange(0, HC)
    h_ok = offs_h < H
    t64 = offs_t.to(tl.int64)
    acc = tl.load(acc_ptr + t64[:, None] * H + offs_h[None, :], mask=t_ok[:, None] & h_ok[None, :], other=0.0)
    kk = tl.arange(0, KP)
    wacc = tl.zeros([BLOCK_T, KP], dtype=tl.float32)
    base = _words(buffer_ptrs, rank) + area_off
    for d in range(R):
        p = tl.load(pos_ptr + t64 * R + d, mask=t_ok, other=-1)
        v = (p >= 0) & ok
        row = base + (tl.where(v, p, 0).to(tl.int64) + d * cap) * W  # int32 pointer per token
        m = v[:, None] & h_ok[None, :]
        if FMT == 2:
            q = tl.load(row.to(tl.pointer_type(tl.uint8), bitcast=True)[:, None] + offs_h[None, :], mask=m, other=0)
            sc = tl.load((row + H // 4).to(tl.pointer_type(tl.float32), bitcast=True)[:, None]
                         + (offs_h // 128)[None, :], mask=m, other=0.0)
            y = e4m3_decode(q) * sc
        elif FMT == 1:
            y = tl.load(row.to(tl.pointer_type(tl.float16), bitcast=True)[:, None] + offs_h[None, :], mask=m,
                        other=0.0).to(tl.float32)
        else:
            y = tl.load(row.to(tl.pointer_type(tl.bfloat16), bitcast=True)[:, None] + offs_h[None, :], mask=m,
                        other=0.0).to(tl.float32)
        acc += tl.where(v[:, None], y, 0.0)
        if HAS_W:
            if FMT == 2:
                wrow = row + (H // 4 + H // 128)
            else:
                wrow = row + H // 2
            wv = tl.load(wrow.to(tl.pointer_type(tl.float32), bitcast=True)[:, None] + kk[None, :],
                         mask=v[:, None] & (kk < K)[None, :], other=0.0)
            wacc += tl.where(v[:, None], wv, 0.0)
    # A wait of this rank timed out (now or at an earlier call: the status word stays set): the rows of the
    # silent rank are missing, so the output is poisoned with NaN rather than left as plausible partial sums.
    acc = tl.where(_status_ok(status_ptr, offs_t)[:, None], acc, float("nan"))
    # A rank that refused this call sent an empty block (the host raises RemoteRankError): the tokens that need
    # its rows (read above from its stale slots) are NaN, never a plausible partial sum. (Outside the hot loop: 64
    # registers as before; the reduced top-k weights of those tokens are not poisoned, that would cost 4 more.)
    refs = 0
    for d in range(R):
        refs += _refused(my_sig, _sig_base(R, FULL), d).to(tl.int32)
    if refs != 0:
        for d in range(R):
            if _refused(my_sig, _sig_base(R, FULL), d):
                p = tl.load(pos_ptr + t64 * R + d, mask=t_ok, other=-1)
                acc = tl.where((p >= 0)[:, None], float("nan"), acc)
    if OUT_F16:
        bits = fp16_bits(acc)
    else:
        bits = _bf16_bits(acc)
    tl.store(out_ptr + t64[:, None] * H + offs_h[None, :], bits, mask=t_ok[:, None] & h_ok[None, :])
    if HAS_W:
        if pid_h == 0:
            tl.store(wout_ptr + t64[:, None] * K + kk[None, :], wacc, mask=t_ok[:, None] & (kk < K)[None, :])

    # Step 3: the last program resets the full words and frees our block on every rank.
    tl.debug_barrier()
    if arrive_last(my_sig + RECV_CNT, tl.num_programs(0) * tl.num_programs(1)):
        _release_blocks(my_sig, signal_ptrs, status_ptr, rank, R, FULL, BUSY)
        if DHELD >= 0:  # a dispatch receive handed out as a view is no longer read: free its area
            _release_held(my_sig, signal_ptrs, status_ptr, rank, R, DFULL, DBUSY, DCNT, DHELD)


@triton.jit
def _combine_recv_kernel(
    acc_ptr,  # [N, H] float32: the bias terms' sum (the initial value)
    out_ptr,  # [N, H] bf16 as int16
    wout_ptr,  # [N, K] float32 (HAS_W)
    pos_ptr,  # [N, R] int32: slot of token t in rank d's block (-1: not sent there)
    buffer_ptrs, signal_ptrs, status_ptr,
    rank, N, R, W, cap, area_off, timeout_ns,
    H: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, HAS_W: tl.constexpr,
    FULL: tl.constexpr, BUSY: tl.constexpr, RECV_CNT: tl.constexpr,
    BLOCK_T: tl.constexpr, HC: tl.constexpr,
    DFULL: tl.constexpr = -1, DBUSY: tl.constexpr = -1, DCNT: tl.constexpr = -1, DHELD: tl.constexpr = -1,
    REF: tl.constexpr = -1,
):
    """BF16 payloads: see :func:`_combine_recv_impl`."""
    _combine_recv_impl(acc_ptr, out_ptr, wout_ptr, pos_ptr, buffer_ptrs, signal_ptrs, status_ptr, rank, N, R, W,
                       cap, area_off, timeout_ns, H, K, KP, HAS_W, FULL, BUSY, RECV_CNT, BLOCK_T, HC, 0, False,
                       DFULL, DBUSY, DCNT, DHELD, REF)


@triton.jit
def _combine_recv_fmt_kernel(
    acc_ptr,  # [N, H] float32: the bias terms' sum (the initial value)
    out_ptr,  # [N, H] bf16 as int16
    wout_ptr,  # [N, K] float32 (HAS_W)
    pos_ptr,  # [N, R] int32: slot of token t in rank d's block (-1: not sent there)
    buffer_ptrs, signal_ptrs, status_ptr,
    rank, N, R, W, cap, area_off, timeout_ns,
    H: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, HAS_W: tl.constexpr,
    FULL: tl.constexpr, BUSY: tl.constexpr, RECV_CNT: tl.constexpr,
    BLOCK_T: tl.constexpr, HC: tl.constexpr,
    FMT: tl.constexpr, OUT_F16: tl.constexpr,
    DFULL: tl.constexpr = -1, DBUSY: tl.constexpr = -1, DCNT: tl.constexpr = -1, DHELD: tl.constexpr = -1,
    REF: tl.constexpr = -1,
):
    """Any combine format (``FMT``: :mod:`moe_ep.kernels.logfmt` codes): see :func:`_combine_recv_impl`.
    ``DHELD >= 0``: the last program also frees a dispatch area held for a receive view (``D*``: the
    dispatch signal offsets)."""
    _combine_recv_impl(acc_ptr, out_ptr, wout_ptr, pos_ptr, buffer_ptrs, signal_ptrs, status_ptr, rank, N, R, W,
                       cap, area_off, timeout_ns, H, K, KP, HAS_W, FULL, BUSY, RECV_CNT, BLOCK_T, HC, FMT,
                       OUT_F16, DFULL, DBUSY, DCNT, DHELD, REF)
