"""symm normal mode: a copying dispatch and its combine time-share one area of the buffer (docs/protocols.md
"Time-shared area"). A sender waits until the receiver has read every row of the other operation: with a late
receiver it times out naming it and writes nothing; a buffer of ``R * C`` rows carries ``C`` tokens per source
per round for both operations; a combine while a receive view is held uses the other half."""

from __future__ import annotations

import os

import pytest
import torch

from moe_ep import RankTimeoutError
from moe_ep.backends.symm import SymmBackend, virtual_backends, virtual_combine_recv, virtual_dispatch_recv
from moe_ep.testing import assert_bitwise_equal
from moe_ep.testing.inputs import make_all_inputs
from moe_ep.testing.refs import ref_combine, ref_dispatch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernels need TRITON_INTERPRET=1")

H, E, K = 128, 4, 2


def _send(b, i, **kw):
    lay = b.get_dispatch_layout(i.topk_idx, E)
    return b.dispatch_send(i.x, None, handle=None, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3],
                           num_tokens_per_expert=lay[2], topk_idx=i.topk_idx, topk_weights=i.topk_weights,
                           num_experts=E, **kw)


def _buffers(bs):
    return [b.normal.symm.buffer.clone() for b in bs]


def test_combine_waits_for_a_late_receivers_dispatch():
    """Rank 1 has its dispatch and combines at once; rank 0 has not read its dispatch rows yet: rank 1's combine
    send must not write rank 0's (time-shared) area: it times out naming rank 0, rank 0's buffer unchanged."""
    inputs = make_all_inputs(2, [3, 4], H, E, K, seed=3)
    bs = virtual_backends(2, num_nvl_bytes=SymmBackend.get_normal_size_hint(None, H, K, 2, chunk_tokens=4),
                          timeout_s=0.5)
    states = [_send(b, i) for b, i in zip(bs, inputs)]
    res1 = bs[1].normal.dispatch_recv(states[1], expert_alignment=1, num_worst_tokens=0)
    before = _buffers(bs)[0]
    with pytest.raises(RankTimeoutError) as info:
        bs[1].combine_send(res1.recv_x, res1.handle, None)
    assert info.value.missing_ranks == [0]
    assert torch.equal(bs[0].normal.symm.buffer, before)  # rank 0's unread dispatch rows are intact


def test_next_dispatch_waits_for_a_late_receivers_combine():
    """Rank 0 finished its combine and dispatches again; rank 1 has not read its combine rows yet: rank 0's
    dispatch send times out naming rank 1 and leaves rank 1's buffer as it was."""
    inputs = make_all_inputs(2, [3, 4], H, E, K, seed=4)
    bs = virtual_backends(2, num_nvl_bytes=SymmBackend.get_normal_size_hint(None, H, K, 2, chunk_tokens=4),
                          timeout_s=0.5)
    states = [_send(b, i) for b, i in zip(bs, inputs)]
    res = virtual_dispatch_recv(bs, states)
    cs = [b.combine_send(o.recv_x, o.handle, None) for b, o in zip(bs, res)]
    bs[0].combine_recv(cs[0], ())
    before = _buffers(bs)[1]
    with pytest.raises(RankTimeoutError) as info:
        _send(bs[0], inputs[0])
    assert info.value.missing_ranks == [1]
    assert torch.equal(bs[1].normal.symm.buffer, before)


def test_the_whole_buffer_carries_a_round_of_both_operations():
    """A buffer of exactly R * C rows of the widest row (the fixed hint) moves C tokens per source per round of
    dispatch and of combine: rounds = ceil(max tokens / C), results bitwise the references', three calls in a row."""
    R, n, chunk = 2, [7, 5], 3
    inputs = make_all_inputs(R, n, H, E, K, seed=8)
    nbytes = SymmBackend.get_normal_size_hint(None, H, K, R, chunk_tokens=chunk)
    bs = virtual_backends(R, num_nvl_bytes=nbytes, timeout_s=20)
    assert [b.normal._cap(b.normal._dispatch_words(H, K, False), True) for b in bs] == [chunk] * R
    xs, idxs, ws = [i.x for i in inputs], [i.topk_idx for i in inputs], [i.topk_weights for i in inputs]
    recv = [ref_dispatch(r, xs, idxs, ws, E) for r in range(R)]
    for call in range(3):
        states = [_send(b, i) for b, i in zip(bs, inputs)]
        res = virtual_dispatch_recv(bs, states)
        assert states[0].rounds == 3
        ys = [(o.recv_x.float() * (call + 1)).to(torch.bfloat16) for o in res]
        comb = virtual_combine_recv(bs, [b.combine_send(y, o.handle, o.recv_topk_weights)
                                         for b, y, o in zip(bs, ys, res)])
        ref_ys = [(a[0].float() * (call + 1)).to(torch.bfloat16) for a in recv]
        for r in range(R):
            assert_bitwise_equal(res[r].recv_x, recv[r][0], f"call {call} rank {r} recv_x")
            want, want_w = ref_combine(r, ref_ys, idxs, E, [a[3] for a in recv])
            assert_bitwise_equal(comb[r][0], want, f"call {call} rank {r} combined_x")
            assert_bitwise_equal(comb[r][1], want_w, f"call {call} rank {r} combined weights")
