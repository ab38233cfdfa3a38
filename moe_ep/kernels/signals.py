"""Triton device helpers for cross-rank signalling over symmetric memory (the ``symm`` backend).

Every cross-rank kernel waits and signals through these helpers, so that the timeout rule and the
memory ordering are the same everywhere:

- :func:`now_ns` reads a nanosecond clock (one body per compile target, and the host's monotonic clock in the
  Triton interpreter, which runs the kernel body as Python on the host: :mod:`moe_ep.kernels.target`).
- :func:`wait_ne` spins (acquire loads, system scope) until a signal differs from a value, at most
  ``timeout_ns``; on timeout it records the peer in the rank's ``status`` word and returns the value
  it waited to leave, so the caller skips its work instead of hanging.
- :func:`wait_vec` waits on many peers' signals at once, one lane per peer (relaxed polls, then one acquire per
  lane), with the same timeout rule per lane.
- :func:`signal_release` stores a signal with release semantics (system scope): every write the
  program issued before it is visible to a peer that observes the signal with an acquire load.

Status word (``status_ptr``, int32, on the waiting rank): 0 = fine; ``peer + 1`` = the first peer
a wait of this rank gave up on; negative = a device-side error flag (``STATUS_*`` below: more rows received
than ``num_worst_tokens``, an expert id out of range when the host checks are off; ``STATUS_WORST_EXCEEDED - d``:
more rows sent to destination ``d`` than a one-round ``num_worst_tokens`` dispatch allows). The first report wins.
The host reads it (:meth:`moe_ep.symm.SymmBuffer.check_status`) and
raises :class:`moe_ep.RankTimeoutError` naming the peer.

NOTES: the phase rule (DESIGN.md): a kernel only waits on signals written by *earlier* launches
(of any rank), never by other programs of its own launch. Completion counters in the
"last program done" pattern (:func:`arrive_last`) are allowed: nobody waits on them. Launch-wide verdicts (the
low-latency receives' liveness per source) are published by whichever program reaches one first, with a
compare-and-swap, and adopted by the others; no program waits for a particular program.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .target import fence_sys, now_ns, pause, trap

__all__ = ["now_ns", "wait_ne", "wait_ne_masked", "peer_masked", "MASK_API", "MASK_TIMEOUT", "STATUS_SHRINK",
           "STATUS_MASK", "STATUS_TRAP", "wait_vec", "signal_release", "fence_sys", "load_acquire", "arrive_last",
           "report_timeout", "report_error", "STATUS_OVERFLOW", "STATUS_BAD_EXPERT", "STATUS_REPEATED_EXPERT",
           "STATUS_STALE_ROW", "STATUS_SEQ", "SEQ_MASK", "SEQ_BAD_EXPERT", "SEQ_STALE_ROW", "SEQ_LATE_MASKED",
           "STATUS_MESSAGES", "STATUS_WORST_EXCEEDED", "status_message"]

MASK_API = 1  # mask word: masked by Buffer.low_latency_update_mask_buffer
MASK_TIMEOUT = 2  # mask word: masked by a kernel whose wait on that rank timed out (enable_shrink)
STATUS_SHRINK = tl.constexpr(1)  # status word: 1 = enable_shrink (rank masking on)
STATUS_MASK = tl.constexpr(4)  # status words STATUS_MASK + r: rank r's mask word (MASK_API / MASK_TIMEOUT)
STATUS_TRAP = tl.constexpr(2)  # status word: 1 = trap the kernel on a timeout or device error (graph mode)
# status word 3 (low-latency): bits 0..14 = this rank's dispatch call counter (the per-call stamp, see
# docs/protocols.md), bit 30 / 29 = a bad expert id / a stale combine row was seen this step (reported as
# STATUS_BAD_EXPERT / STATUS_STALE_ROW at the end of the next combine receive, after it released its peers).
STATUS_SEQ = tl.constexpr(3)
SEQ_MASK = tl.constexpr(0x7FFF)
SEQ_BAD_EXPERT = tl.constexpr(1 << 30)
SEQ_STALE_ROW = tl.constexpr(1 << 29)
# Sticky, not an error: a combine row written by a rank this rank has masked (a masked rank still running) was found
# in a live slot; the token it hit is NaN. The host reads and clears it (masked-rank event, never a broken Buffer).
SEQ_LATE_MASKED = tl.constexpr(1 << 28)
HB_CAP = tl.constexpr(4)  # a beating (alive but waiting) peer is masked after HB_CAP timeouts all the same
STATUS_OVERFLOW = -1
STATUS_BAD_EXPERT = -2
STATUS_REPEATED_EXPERT = -3
STATUS_STALE_ROW = -4
#: ``STATUS_WORST_EXCEEDED - d``: this rank had more rows for destination ``d`` than a single-round dispatch with
#: ``num_worst_tokens <= C`` may send (they would have landed in the next source's block: not written). Below
#: every ``STATUS_SIG_MISMATCH - peer`` code (-16 - peer), so the two ranges never meet.
STATUS_WORST_EXCEEDED = -(1 << 24)
STATUS_MESSAGES = {
    STATUS_OVERFLOW: "a dispatch received more rows than num_worst_tokens (the extra rows were dropped)",
    STATUS_BAD_EXPERT: "topk_idx held an expert id >= num_experts (input checks were off)",
    STATUS_REPEATED_EXPERT: "topk_idx repeated an expert within tokens more often than the buffer holds (mega MoE: "
                            "at most num_max_tokens_per_rank selections of one expert per rank; those rows were dropped)",
    STATUS_STALE_ROW: "a low-latency combine row of a live expert rank carried another call's stamp (combine's "
                      "topk_idx differs from the dispatch's, or an unmasked rank wrote another call's row; a masked "
                      "rank's late row is only reported by take_late_writes()): those tokens are NaN",
}


def status_message(code: int):
    """The message of a negative device-side status code other than a signature mismatch (None: not one)."""
    if code <= STATUS_WORST_EXCEEDED:
        d = STATUS_WORST_EXCEEDED - code
        return (f"this rank sent more rows than num_worst_tokens for destination {d} (a dispatch with "
                "num_worst_tokens <= the rows of a per-source block sends every token in one round: the rows past "
                "the block were not written, and the destination times out on this rank)")
    if -16 < code < 0:
        return STATUS_MESSAGES.get(code, f"device error code {code}")
    return None


@triton.jit
def load_acquire(ptr):
    """Scalar acquire load (system scope) of an int32 signal."""
    return tl.atomic_add(ptr, 0, sem="acquire", scope="sys")


@triton.jit
def signal_release(ptr, value):
    """Scalar release store (system scope) of an int32 signal; returns the previous value."""
    return tl.atomic_xchg(ptr, value, sem="release", scope="sys")


@triton.jit
def _maybe_trap(status_ptr):
    """Trap (the context fails loudly, also inside a replayed graph) when the rank's status word ``STATUS_TRAP`` is
    set: the opt-in for graph mode, where no exception can be raised. (The interpreter build cannot trap: the status
    word reports as usual.)"""
    if tl.load(status_ptr + STATUS_TRAP, volatile=True) != 0:
        trap()


@triton.jit
def report_timeout(status_ptr, peer):
    """Record that a wait on ``peer`` timed out (the first report wins); trap when asked (``STATUS_TRAP``)."""
    tl.atomic_cas(status_ptr, 0, peer + 1, sem="relaxed", scope="sys")
    _maybe_trap(status_ptr)


@triton.jit
def report_error(status_ptr, code):
    """Record a device-side error (a negative ``STATUS_*`` code; the first report wins); trap when asked."""
    tl.atomic_cas(status_ptr, 0, code, sem="relaxed", scope="sys")
    _maybe_trap(status_ptr)


@triton.jit
def wait_ne(sig_ptr, value, status_ptr, peer, timeout_ns):
    """Spin until ``*sig_ptr != value`` (acquire); returns the signal, or ``value`` after a timeout
    (then ``status`` names ``peer``). A status already set by an earlier wait of this launch makes
    the wait give up at once, so one missing rank costs one timeout, not one per program."""
    v = load_acquire(sig_ptr)
    if v == value:
        start = now_ns()
        done = False
        while not done:
            v = load_acquire(sig_ptr)
            if v != value:
                done = True
            else:
                failed = tl.load(status_ptr, volatile=True) != 0
                if failed | (now_ns() - start > timeout_ns):
                    report_timeout(status_ptr, peer)
                    done = True
    return v


@triton.jit
def peer_masked(mask_ptr, rank, peer):
    """Whether ``peer`` is masked for this rank (``mask_ptr``: this rank's local `[R]` int32 effective mask,
    nonzero = masked; the host folds "this rank masked itself" into it: every other word set, its own never)."""
    return tl.load(mask_ptr + peer, volatile=True) != 0


@triton.jit
def wait_ne_masked(sig_ptr, value, status_ptr, mask_ptr, rank, peer, timeout_ns, my_hb_ptr, peer_hb_ptr):
    """:func:`wait_ne` for a maskable peer (``enable_shrink``): returns ``value`` at once when ``peer`` is
    masked (or becomes masked by another program meanwhile); on timeout it MASKS the peer (mask word =
    ``MASK_TIMEOUT``) instead of setting ``status``, so the call goes on without it. Callers decide what
    arrived by re-reading the mask after their waits.

    Heartbeat: while it spins, this rank stores its clock (ms) into its heartbeat word ``my_hb_ptr``; a change of
    the peer's word ``peer_hb_ptr`` restarts the timeout (a live peer that is itself waiting, e.g. on a dead
    rank, is not masked), up to ``HB_CAP`` timeouts in all. A dead rank's word never changes."""
    v = load_acquire(sig_ptr) * 0 + value  # (a tensor in both branches, for the compiler)
    if peer_masked(mask_ptr, rank, peer) == 0:
        v = load_acquire(sig_ptr)
        if v == value:
            start = now_ns()
            first = start
            last_hb = tl.load(peer_hb_ptr, volatile=True)
            done = False
            while not done:
                v = load_acquire(sig_ptr)
                if v != value:
                    done = True
                else:
                    now = now_ns()
                    tl.atomic_xchg(my_hb_ptr, (now >> 20).to(tl.int32), sem="relaxed", scope="sys")
                    hb = tl.load(peer_hb_ptr, volatile=True)
                    if hb != last_hb:
                        last_hb = hb
                        start = now
                    gone = tl.load(mask_ptr + peer, volatile=True) != 0
                    failed = tl.load(status_ptr, volatile=True) != 0
                    if gone | failed:
                        done = True
                    elif (now - start > timeout_ns) | (now - first > timeout_ns.to(tl.int64) * HB_CAP):
                        tl.atomic_cas(mask_ptr + peer, 0, 2, sem="relaxed", scope="sys")
                        done = True
    return v


@triton.jit
def _lanes(cond, like):
    """The scalar bool ``cond`` as a bool tensor shaped like the int tensor ``like`` (see NOTES in the callers: the
    interpreter refuses a scalar ANDed into a block mask)."""
    return (like * 0 + cond.to(tl.int32)) != 0


@triton.jit
def _waiting(v, value, UNTIL_EQ: tl.constexpr):
    if UNTIL_EQ:
        w = v != value
    else:
        w = v == value
    return w


@triton.jit
def wait_vec(sig_ptrs, value, need, peers, status_ptr, mask_ptr, timeout_ns, shrink, my_hb_ptr, peer_hb_ptrs,
             hb_ok, UNTIL_EQ: tl.constexpr = False):
    """Wait on every lane of ``need`` at once (lane ``i``: peer ``peers[i]``'s signal word ``sig_ptrs[i]``) until it
    differs from ``value`` (``UNTIL_EQ``: until it equals it). Returns the words, read with ONE acquire per lane
    after the polls (a vector of system-scope acquire loads, in parallel; a lane that gave up returns ``value``), and
    per lane the clock (:func:`now_ns`) of the poll that saw it arrive.

    The polls are relaxed (volatile) loads of the lanes still pending, with a short :func:`pause` between rounds;
    every lane's clock starts with the wait, so ``n`` late peers cost one ``timeout_ns``, not ``n``. The rule per lane
    is :func:`wait_ne`'s, or with ``shrink`` :func:`wait_ne_masked`'s: a masked peer is skipped (also one masked by
    another program meanwhile); a peer whose heartbeat word (``peer_hb_ptrs``, readable where ``hb_ok``) moves gets
    its clock restarted, up to ``HB_CAP`` timeouts in all, while this rank beats in ``my_hb_ptr``; a lane that runs
    out is masked (``MASK_TIMEOUT``). Without ``shrink``, running out (or a status word set by another wait) ends
    the whole wait and names the lowest pending peer in the status word (the first report wins)."""
    safe = tl.where(need, peers, 0)
    t_arr = (peers * 0).to(tl.int64) + now_ns()
    v = tl.load(sig_ptrs, mask=need, other=0, volatile=True)
    gave = need & (peers < 0)  # (all false)
    if shrink:
        gave = need & (tl.load(mask_ptr + safe, mask=need, other=0, volatile=True) != 0)
    pending = need & ~gave & _waiting(v, value, UNTIL_EQ)
    if tl.max(pending.to(tl.int32), axis=0) > 0:
        start = now_ns()
        lane_start = (peers * 0).to(tl.int64) + start
        last_hb = tl.load(peer_hb_ptrs, mask=pending & hb_ok, other=0, volatile=True)
        while tl.max(pending.to(tl.int32), axis=0) > 0:
            v = tl.load(sig_ptrs, mask=pending, other=0, volatile=True)
            now = now_ns()
            t_arr = tl.where(pending & ~_waiting(v, value, UNTIL_EQ), now, t_arr)
            pending = pending & _waiting(v, value, UNTIL_EQ)
            failed = tl.load(status_ptr, volatile=True) != 0
            if shrink:
                tl.atomic_xchg(my_hb_ptr, (now >> 20).to(tl.int32), sem="relaxed", scope="sys")
                hb = tl.load(peer_hb_ptrs, mask=pending & hb_ok, other=0, volatile=True)
                lane_start = tl.where(hb != last_hb, now, lane_start)
                last_hb = hb
                gone = pending & (tl.load(mask_ptr + safe, mask=pending, other=0, volatile=True) != 0)
                out = (now - lane_start > timeout_ns) | _lanes(now - start > timeout_ns.to(tl.int64) * HB_CAP, peers)
                expired = pending & ~gone & out
                # masked here (0 -> MASK_TIMEOUT); lanes with nothing to mask compare against -1, which no mask
                # word holds, and so write nothing (Triton's compare-and-swap takes no mask)
                tl.atomic_cas(mask_ptr + safe, tl.where(expired, 0, -1), tl.zeros_like(peers) + 2, sem="relaxed",
                              scope="sys")
                stop = gone | expired | (pending & _lanes(failed, peers))
                gave = gave | stop
                pending = pending & ~stop
            elif failed | (now - start > timeout_ns):
                report_timeout(status_ptr, tl.min(tl.where(pending, peers, 1 << 30), axis=0))
                gave = gave | pending
                pending = pending & ~pending
            if tl.max(pending.to(tl.int32), axis=0) > 0:
                pause()
    got = need & ~gave
    v = tl.atomic_add(sig_ptrs, 0, mask=got, sem="acquire", scope="sys")
    return tl.where(got, v, value), t_arr


@triton.jit
def arrive_last(counter_ptr, total):
    """Count this program's arrival at a local completion counter (acq_rel); True for the program that
    arrives last (which also resets the counter to 0 for the next launch)."""
    old = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    is_last = old == total - 1
    if is_last:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
    return is_last
