"""symm normal mode in a fixed buffer (issue 32): a batch whose receive does not fit moves in rounds of at most
C tokens per source; every output is bitwise the single-round path's (and the references'), a rank that dies
between rounds is named, and a buffer below one round is refused with the exact minimum."""

from __future__ import annotations

import os

import pytest
import torch

from moe_ep import RankTimeoutError
from moe_ep.backends.symm import SymmBackend, virtual_backends, virtual_combine_recv, virtual_dispatch_recv
from moe_ep.backends.symm_normal import SymmNormal
from moe_ep.kernels.logfmt import FMT_FP8
from moe_ep.testing import assert_bitwise_equal
from moe_ep.testing.inputs import make_all_inputs
from moe_ep.testing.refs import ref_combine, ref_dispatch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernels need TRITON_INTERPRET=1")

H = 128


def _dispatch(bs, inputs, E, *, fp8=False, worst=0, handles=None, align=1):
    states = []
    for r, (b, i) in enumerate(zip(bs, inputs)):
        x, s = (i.x_fp8, i.x_scales) if fp8 else (i.x, None)
        if handles is not None:
            states.append(b.dispatch_send(x, s, handle=handles[r], num_tokens_per_rank=None, is_token_in_rank=None,
                                          num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                                          num_experts=0, num_worst_tokens=worst))
            continue
        lay = b.get_dispatch_layout(i.topk_idx, E)
        states.append(b.dispatch_send(x, s, handle=None, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3],
                                      num_tokens_per_expert=lay[2], topk_idx=i.topk_idx, topk_weights=i.topk_weights,
                                      num_experts=E, num_worst_tokens=worst))
    return states, virtual_dispatch_recv(bs, states, expert_alignment=align, num_worst_tokens=worst)


def _combine(bs, ys, res, fmt=None, biases=None, with_w=True):
    cs = [b.combine_send(y, o.handle, o.recv_topk_weights if with_w else None, fmt=fmt)
          for b, y, o in zip(bs, ys, res)]
    return virtual_combine_recv(bs, cs, biases)


def _step(bs, inputs, E, worst=0):
    """Everything a prefill step does: dispatch BF16 (+ top-k), combine BF16 with weights and bias, combine FP8,
    cached dispatch FP8, and (``worst``) a num_worst_tokens dispatch + combine. Returns every output."""
    R = len(bs)
    out = {}
    states, res = _dispatch(bs, inputs, E, align=4)
    out["rounds"] = states[0].rounds
    ys = [(o.recv_x.float() * (r + 1)).to(torch.bfloat16) for r, o in enumerate(res)]
    biases = [(torch.randn(i.x.shape, generator=torch.Generator().manual_seed(7 + r)).to(torch.bfloat16),)
              for r, i in enumerate(inputs)]
    comb = _combine(bs, ys, res, biases=biases)
    comb8 = _combine(bs, ys, res, fmt=FMT_FP8, with_w=False) if R == 2 else [(None, None)] * R
    _, cached = _dispatch(bs, inputs, E, fp8=True, handles=[o.handle for o in res])
    for r in range(R):
        o = res[r]
        out[r] = dict(recv_x=o.recv_x, idx=o.recv_topk_idx, w=o.recv_topk_weights, lst=o.num_recv_tokens_per_expert_list,
                      recv_counts=o.handle.recv_counts, m=o.handle.num_recv_tokens, pos=o.handle.send_pos,
                      comb=comb[r][0], comb_w=comb[r][1], comb8=comb8[r][0], cx=cached[r].recv_x,
                      cs=cached[r].recv_x_scales)
    if worst:
        _, wres = _dispatch(bs, inputs, E, worst=worst)
        wy = [(o.recv_x.float() * 3).to(torch.bfloat16) for o in wres]
        wcomb = _combine(bs, wy, wres)
        for r in range(R):
            out[r].update(wx=wres[r].recv_x, widx=wres[r].recv_topk_idx, ww=wres[r].recv_topk_weights,
                          wcomb=wcomb[r][0])
    return out


def _check_refs(out, inputs, E):
    xs, idxs, ws = [i.x for i in inputs], [i.topk_idx for i in inputs], [i.topk_weights for i in inputs]
    R = len(inputs)
    all_recv = [ref_dispatch(r, xs, idxs, ws, E) for r in range(R)]
    ys = [(a[0].float() * (r + 1)).to(torch.bfloat16) for r, a in enumerate(all_recv)]
    for r in range(R):
        ex_x, _, ex_idx, ex_w, ex_list = ref_dispatch(r, xs, idxs, ws, E, expert_alignment=4)
        o = out[r]
        assert_bitwise_equal(o["recv_x"], ex_x, f"rank {r} recv_x")
        assert_bitwise_equal(o["idx"], ex_idx, f"rank {r} recv_topk_idx")
        assert_bitwise_equal(o["w"], ex_w, f"rank {r} recv_topk_weights")
        assert o["lst"] == ex_list
        bias = (torch.randn(inputs[r].x.shape, generator=torch.Generator().manual_seed(7 + r)).to(torch.bfloat16),)
        ex_c, ex_cw = ref_combine(r, ys, idxs, E, [a[3] for a in all_recv], bias)
        assert_bitwise_equal(o["comb"], ex_c, f"rank {r} combined_x")
        assert_bitwise_equal(o["comb_w"], ex_cw, f"rank {r} combined_topk_weights")
        if o["comb8"] is not None:
            assert_bitwise_equal(o["comb8"], ref_combine(r, ys, idxs, E, fmt=FMT_FP8)[0], f"rank {r} FP8 combine")
        ex_q, ex_s, *_ = ref_dispatch(r, [i.x_fp8 for i in inputs], idxs, ws, E, x_scales=[i.x_scales for i in inputs])
        assert_bitwise_equal(o["cx"], ex_q, f"rank {r} cached recv_x fp8")
        assert_bitwise_equal(o["cs"], ex_s, f"rank {r} cached scales")


@pytest.mark.parametrize("R,n,E,K,routing,worst", [
    (2, [23, 9], 4, 2, "random", 48),
    (4, [11, 0, 7, 13], 8, 4, "random", 0),  # an empty rank
    (4, [6, 13, 0, 5], 8, 4, "one_expert", 0),  # every token to expert 0 (rank 0 receives everything)
])
def test_chunked_equals_single_round_and_refs(R, n, E, K, routing, worst):
    inputs = make_all_inputs(R, n, H, E, K, seed=sum(n) + R, routing=routing)
    chunk = 3
    small = SymmBackend.get_normal_size_hint(None, H, K, R, chunk_tokens=chunk)
    big = SymmBackend.get_normal_size_hint(max(n), H, K, R)
    assert small * 4 < big  # less than a quarter of what a single-round receive needs
    one = _step(virtual_backends(R, num_nvl_bytes=big, timeout_s=20), inputs, E, worst)
    many = _step(virtual_backends(R, num_nvl_bytes=small, timeout_s=20), inputs, E, worst)
    assert one["rounds"] == 1 and many["rounds"] == -(-max(n) // chunk) > 1
    for r in range(R):
        for key, want in one[r].items():
            got = many[r][key]
            if isinstance(want, torch.Tensor):
                assert_bitwise_equal(got, want, f"rank {r} {key}")
            else:
                assert got == want, (r, key)
    _check_refs(many, inputs, E)


def test_rank_dying_between_rounds_is_named():
    R, E, K = 3, 6, 2
    inputs = make_all_inputs(R, [7, 5, 6], H, E, K, seed=5)
    bs = virtual_backends(R, num_nvl_bytes=SymmBackend.get_normal_size_hint(None, H, K, R, chunk_tokens=2),
                          timeout_s=0.3)
    states = []
    for b, i in zip(bs, inputs):
        lay = b.get_dispatch_layout(i.topk_idx, E)
        states.append(b.dispatch_send(i.x, None, handle=None, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3],
                                      num_tokens_per_expert=lay[2], topk_idx=i.topk_idx, topk_weights=i.topk_weights,
                                      num_experts=E))
    for b, s in zip(bs, states):
        b.normal.dispatch_recv_round(s, 0, num_worst_tokens=0)
    assert states[0].rounds == 4
    alive = [0, 2]  # rank 1 dies after round 0
    for r in alive:
        bs[r].normal.dispatch_send_round(states[r], 1)
    for r in alive:
        with pytest.raises(RankTimeoutError) as info:
            bs[r].normal.dispatch_recv_round(states[r], 1, num_worst_tokens=0)
        assert info.value.missing_ranks == [1]


def test_below_one_round_is_refused_with_the_exact_minimum():
    R, E, K = 2, 4, 2
    inputs = make_all_inputs(R, [3, 2], H, E, K, seed=9)
    need = SymmNormal.min_bytes(H, K, R)
    below = (need - 1) // 256 * 256  # each rank maps its size rounded up to 256 bytes: this maps less than need
    assert below > 0
    bs = virtual_backends(R, num_nvl_bytes=below, timeout_s=5)
    lay = bs[0].get_dispatch_layout(inputs[0].topk_idx, E)
    with pytest.raises(ValueError, match=f"num_nvl_bytes >= {need} "):
        bs[0].dispatch_send(inputs[0].x, None, handle=None, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3],
                            num_tokens_per_expert=lay[2], topk_idx=inputs[0].topk_idx,
                            topk_weights=inputs[0].topk_weights, num_experts=E)
    for b in bs:  # nothing was written
        assert int(b.normal.symm.buffer.abs().sum()) == 0 and int(b.normal.symm.signals.abs().sum()) == 0
    # exactly the minimum: one token per source per round
    bs = virtual_backends(R, num_nvl_bytes=need, timeout_s=5)
    states, res = _dispatch(bs, inputs, E)
    assert states[0].rounds == 3
    xs, idxs, ws = [i.x for i in inputs], [i.topk_idx for i in inputs], [i.topk_weights for i in inputs]
    for r in range(R):
        assert_bitwise_equal(res[r].recv_x, ref_dispatch(r, xs, idxs, ws, E)[0], f"rank {r} recv_x")


def test_recv_view_that_does_not_fit_is_refused():
    R, E, K = 2, 4, 2
    inputs = make_all_inputs(R, 9, H, E, K, seed=11)
    bs = virtual_backends(R, num_nvl_bytes=SymmBackend.get_normal_size_hint(None, H, K, R, chunk_tokens=4))
    lay = bs[0].get_dispatch_layout(inputs[0].topk_idx, E)
    with pytest.raises(ValueError, match="recv_as_view=True needs the whole receive"):
        bs[0].dispatch_send(inputs[0].x, None, handle=None, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3],
                            num_tokens_per_expert=lay[2], topk_idx=inputs[0].topk_idx,
                            topk_weights=inputs[0].topk_weights, num_experts=E, recv_view=True)


def test_size_hints():
    h, k = 7168, 8
    assert SymmBackend.get_normal_size_hint(4096, h, k, 8) == SymmNormal.size_hint(4096, h, k, 8)
    fixed = SymmBackend.get_normal_size_hint(None, h, k, 8)
    assert fixed == SymmBackend.get_normal_size_hint(None, h, k, 8, chunk_tokens=512)
    assert fixed == SymmBackend.get_normal_size_hint(32768, h, k, 8, chunk_tokens=512)
    # the fixed size is one time-shared [R][C] block area (rows of 2 * 7168 + 96 bytes padded to 14464):
    # 512 of 4096 tokens per source in half the bytes (no separate combine half): a sixteenth, up to the view padding
    assert fixed == 8 * 512 * 14464 and 15.9 < SymmBackend.get_normal_size_hint(4096, h, k, 8) / fixed < 16.001
    # the one-round size keeps the view's halves (and plane padding), rounded up to 256 bytes
    assert SymmNormal.size_hint(512, h, k, 8) == (2 * (fixed + 3 * 64) + 255) // 256 * 256
    assert SymmNormal.min_bytes(h, k, 8) == SymmBackend.get_normal_size_hint(None, h, k, 8, chunk_tokens=1) == 8 * 14464


def test_buffer_suite_in_rounds_forked():
    """moe_ep.Buffer on forked ranks (shm provider) with a buffer for 2 tokens per source per round: the normal-mode
    semantic suite (BF16 and FP8, combine, cached dispatch, num_worst_tokens) bitwise against the references."""
    from moe_ep.testing import launch
    from moe_ep.testing.suite import check_buffer_case

    R, n, E, K = 2, [9, 4], 4, 2
    case = dict(seed=21, n=n, hidden=H, E=E, k=K, routing="random", align=2, worst=24)
    kw = dict(num_nvl_bytes=SymmBackend.get_normal_size_hint(None, H, K, R, chunk_tokens=2),
              num_rdma_bytes=SymmBackend.get_low_latency_size_hint(max(n), H, R, E, K))
    assert launch(check_buffer_case, R, case, "symm", modes=("normal",), timeout_s=120, **kw) == [True] * R


def _die_between_rounds(rank, world):
    import moe_ep
    from moe_ep.backends.symm_normal import SymmNormal

    E, K = 6, 2
    inputs = make_all_inputs(world, 6, H, E, K, seed=3)
    if rank == 1:  # dies after its round-0 receive, before sending round 1
        SymmNormal.dispatch_send_round = lambda self, st, r: os._exit(0)
    buf = moe_ep.Buffer(None, backend="symm", timeout_s=1.0,
                        num_nvl_bytes=SymmBackend.get_normal_size_hint(None, H, K, world, chunk_tokens=2))
    me = inputs[rank]
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(me.topk_idx, E)
    try:
        buf.dispatch(me.x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                     topk_idx=me.topk_idx, topk_weights=me.topk_weights)
    except RankTimeoutError as exc:
        return exc.missing_ranks
    return "no error"


def test_rank_dying_between_rounds_forked():
    from moe_ep.testing import launch

    assert launch(_die_between_rounds, 3, timeout_s=120, allow_dead=(1,)) == [[1], None, [1]]


# ------------------------------------------------------------------ num_worst_tokens <= C: one round, no host read
def _routed(R, E, K, routes, seed):
    """Inputs whose token ``t`` of rank ``r`` selects the experts ``routes[r][t]`` (the rest of its top-k: -1)."""
    inputs = make_all_inputs(R, [len(rt) for rt in routes], H, E, K, seed=seed)
    for i, rt in zip(inputs, routes):
        idx = torch.full((len(rt), K), -1, dtype=torch.int64)
        for t, es in enumerate(rt):
            idx[t, :len(es)] = torch.tensor(es)
        i.topk_idx = idx
    return inputs


def _send_all(bs, inputs, E, worst, order=None):
    states = {}
    for r in (order or range(len(bs))):
        b, i = bs[r], inputs[r]
        lay = b.get_dispatch_layout(i.topk_idx, E)
        states[r] = b.dispatch_send(i.x, None, handle=None, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3],
                                    num_tokens_per_expert=lay[2], topk_idx=i.topk_idx, topk_weights=i.topk_weights,
                                    num_experts=E, num_worst_tokens=worst[r] if isinstance(worst, list) else worst)
    return [states[r] for r in sorted(states)]


def test_worst_tokens_within_a_block_take_one_round_without_host_reads():
    """num_worst_tokens <= C: every rank sends all its tokens in round 0 (rank 0 has more than C) and nothing is read
    on the host, as before rounds existed; the results are the single-round path's and the references'."""
    from moe_ep.testing.traps import host_reads_trapped

    R, E, K, chunk, worst = 2, 4, 2, 4, 4
    # rank 0: 7 tokens (> C = 4), 3 for rank 0 and 4 for rank 1; rank 1: one token for rank 0 (each receives 4)
    inputs = _routed(R, E, K, [[[0], [2], [1, 0], [3], [2], [0], [3]], [[1]]], seed=13)
    small = virtual_backends(R, num_nvl_bytes=SymmBackend.get_normal_size_hint(None, H, K, R, chunk_tokens=chunk),
                             timeout_s=20)
    big = virtual_backends(R, num_nvl_bytes=SymmBackend.get_normal_size_hint(8, H, K, R), timeout_s=20)
    with host_reads_trapped():
        states, res = _dispatch(small, inputs, E, worst=worst)
    assert states[0].cap == chunk and inputs[0].x.shape[0] > chunk
    assert [s.rounds for s in states] == [1, 1] and all(s.worst_fit for s in states)
    _, one = _dispatch(big, inputs, E, worst=worst)
    xs, idxs, ws = [i.x for i in inputs], [i.topk_idx for i in inputs], [i.topk_weights for i in inputs]
    ys, ys_ref = [], []
    for r in range(R):
        for name in ("recv_x", "recv_topk_idx", "recv_topk_weights"):
            assert_bitwise_equal(getattr(res[r], name), getattr(one[r], name), f"rank {r} {name}")
        ex_x, _, ex_idx, ex_w, _ = ref_dispatch(r, xs, idxs, ws, E)
        m = ex_x.shape[0]
        assert m <= worst and res[r].recv_x.shape[0] == worst
        assert_bitwise_equal(res[r].recv_x[:m], ex_x, f"rank {r} recv_x")
        assert_bitwise_equal(res[r].recv_topk_idx[:m], ex_idx, f"rank {r} recv_topk_idx")
        assert_bitwise_equal(res[r].recv_topk_weights[:m], ex_w, f"rank {r} recv_topk_weights")
        assert int(res[r].recv_x[m:].abs().sum()) == 0 and bool((res[r].recv_topk_idx[m:] == -1).all())
        ys_ref.append((ex_x.float() * (r + 1)).to(torch.bfloat16))
        ys.append(torch.cat([ys_ref[-1], torch.zeros(worst - m, H, dtype=torch.bfloat16)]))
    # the handle is a one-round handle whatever the token count: combine is one round, bitwise the references'
    with host_reads_trapped():
        comb = _combine(small, ys, res)
    all_w = [ref_dispatch(r, xs, idxs, ws, E)[3] for r in range(R)]
    for r in range(R):
        ex_c, ex_cw = ref_combine(r, ys_ref, idxs, E, all_w)
        assert_bitwise_equal(comb[r][0], ex_c, f"rank {r} combined_x")
        assert_bitwise_equal(comb[r][1], ex_cw, f"rank {r} combined_topk_weights")
    # a cached dispatch with the same num_worst_tokens: one round, no host read either
    with host_reads_trapped():
        _, cached = _dispatch(small, inputs, E, worst=worst, handles=[o.handle for o in res])
    for r in range(R):
        assert_bitwise_equal(cached[r].recv_x, res[r].recv_x, f"rank {r} cached recv_x")


def test_more_rows_than_worst_tokens_is_refused_without_writing_past_the_block():
    """A rank that sends one destination more rows than num_worst_tokens (<= C) breaks the contract: its send raises
    naming the destination, and the rows past its block (the next source's block) are never written."""
    R, E, K, chunk, worst = 2, 4, 2, 4, 4
    # rank 0: 6 tokens, all for rank 0 (6 > num_worst_tokens); rank 1: 2 tokens for rank 0
    inputs = _routed(R, E, K, [[[0]] * 6, [[1], [0]]], seed=17)
    bs = virtual_backends(R, num_nvl_bytes=SymmBackend.get_normal_size_hint(None, H, K, R, chunk_tokens=chunk),
                          timeout_s=0.5)
    _send_all(bs, inputs, E, worst, order=[1])  # rank 1's rows are in its block of rank 0's area first
    area = bs[0].normal.symm.buffer.clone()
    with pytest.raises(RuntimeError, match="more rows than num_worst_tokens for destination 0"):
        _send_all(bs, inputs, E, worst, order=[0])
    st_words = bs[0].normal._dispatch_words(H, K, False)
    block = chunk * st_words * 4  # bytes of one source's block
    assert bs[0].normal._cap(st_words, True) == chunk  # a copying dispatch: blocks over the time-shared buffer
    after = bs[0].normal.symm.buffer
    assert torch.equal(after[block:], area[block:])  # rank 1's block (and beyond) intact
    assert not torch.equal(after[:block], area[:block])  # rank 0's own rows within its block were written
    with pytest.raises(RuntimeError, match="unusable"):  # the Buffer is unusable after the error
        bs[0].normal.symm.check_usable()


def test_ranks_disagreeing_on_worst_tokens_get_the_signature_mismatch():
    """One rank takes the one-round path (num_worst_tokens <= C), the other would read the sizes and run rounds
    (num_worst_tokens > C): the receives refuse the call as a signature mismatch (flags) instead of mixing paths."""
    from moe_ep.sync import CallMismatchError

    R, E, K, chunk = 2, 4, 2, 4
    inputs = _routed(R, E, K, [[[0], [2]], [[1], [3]]], seed=19)
    bs = virtual_backends(R, num_nvl_bytes=SymmBackend.get_normal_size_hint(None, H, K, R, chunk_tokens=chunk),
                          timeout_s=5)
    states = _send_all(bs, inputs, E, [chunk, 2 * chunk])
    assert [s.worst_fit for s in states] == [True, False]
    for r, (b, s) in enumerate(zip(bs, states)):
        with pytest.raises(CallMismatchError, match="flags") as info:
            b.normal.dispatch_recv_round(s, 0, num_worst_tokens=[chunk, 2 * chunk][r])
        assert info.value.fields == ["flags"]
