"""Stream order on a CPU: the virtual-stream checker (moe_ep.testing.streams) and the defects it
pins (numbers of the review list):

12. async Buffer calls must record_stream their inputs on the comm stream (caller may drop them);
13. NormalCommunicator.dispatch_send must not pass the layout's event as previous_event (it replaces
    the comm stream's wait for the FP8 quantization on the compute stream);
14. SymmBuffer.check_status must not query events while a graph is being captured.

Each defect has a test that runs the old logic (a reproduction kept here, or the fix flipped off by
a monkeypatch) and asserts the checker reports it, and a test that the fixed code runs clean.
"""

from __future__ import annotations

import os

import pytest
import torch

from moe_ep import events
from moe_ep.testing import launch
from moe_ep.testing.streams import StreamOrderError, checked_streams
from moe_ep.testing.streams import launch as report

H, E, K = 128, 8, 3


# ----------------------------------------------------------------------------- the checker itself
def test_unordered_read_and_its_fixes():
    with checked_streams(strict=False) as chk:
        side = chk.Stream()
        t = torch.ones(8)
        report(writes=t, what="producer")
        with chk.stream(side):
            report(reads=t, what="consumer")  # no edge from compute to side
        assert chk.messages("unordered-read") and "consumer on side" in chk.messages()[0]
        chk.violations.clear()
        side.wait_stream(chk.compute)
        with chk.stream(side):
            report(reads=t, what="consumer")
            report(writes=t[4:], what="side writer")
            ev = chk.Event()
            ev.record()
        report(reads=t[:4], what="disjoint bytes")  # never written on side: fine
        assert not chk.violations
        report(reads=t[4:], what="early reader")
        assert len(chk.messages("unordered-read")) == 1
        chk.violations.clear()
        ev.wait(chk.compute)
        report(reads=t, what="late reader")
        assert not chk.violations


def test_freed_in_use():
    with checked_streams(strict=False) as chk:
        side = chk.Stream()
        for mode in ("none", "record_stream", "waited", "host_sync"):
            t = torch.ones(16)
            report(writes=t, what="producer")  # first seen on compute: allocated there
            side.wait_stream(chk.compute)
            with chk.stream(side):
                report(reads=t, what="async reader")
            if mode == "record_stream":
                chk.record_stream(t, side)
            elif mode == "waited":
                chk.compute.wait_stream(side)
            elif mode == "host_sync":
                side.synchronize()
            del t
            found = chk.messages("freed-in-use")
            assert bool(found) == (mode == "none"), (mode, found)
            chk.violations.clear()


def test_host_query_in_capture_and_strict_mode():
    with pytest.raises(StreamOrderError, match="host-query-in-capture"):
        with checked_streams() as chk:
            ev = events.new_event()
            events.record(ev)
            assert events.query(ev)  # eager: fine
            with chk.capture():
                assert events.is_capturing()
                events.query(ev)
    assert isinstance(events.get_provider(), events.TorchCudaStreams)  # restored


def test_run_on_comm_stream_async_inputs():
    """The events layer alone: CPU tensors take the CUDA path under the checker; an async call's
    inputs are recorded on the comm stream (defect 12), outputs on the compute stream."""
    owner = object()
    with checked_streams() as chk:
        x = torch.randn(4, 8)
        report(writes=x, what="producer")
        out, ev = events.run_on_comm_stream(lambda x=x: x * 2, torch.device("cpu"), None, previous_event=None,
                                            async_finish=True, allocate_on_comm_stream=False, inputs=(x,),
                                            owner=owner)
        del x  # dropped before the wait: safe only with record_stream(comm)
        assert ev.event is not None and chk.num_launches == 2
        report(reads=out, what="too early")  # before the wait: flagged
        assert len(chk.messages("unordered-read")) == 1 and "too early on compute" in chk.messages()[0]
        chk.violations.clear()
        ev.current_stream_wait()
        report(reads=out, what="consumer")


# ----------------------------------------------------------------------------- 12: async Buffer inputs
def _old_record_stream(chk):
    """Defect 12 flipped back on: drop the record_stream of inputs on the comm stream (the old
    run_on_comm_stream only recorded outputs, on the compute stream)."""
    original = chk.record_stream

    def record_stream(t, stream):
        if stream is chk.compute:
            original(t, stream)

    return record_stream


def _rank_async_buffer(rank, world, old):
    import moe_ep

    n = 6
    buf = moe_ep.Buffer(None, backend="torch", timeout_s=60)
    g = torch.Generator().manual_seed(rank)
    with checked_streams(strict=False) as chk:
        if old:
            chk.record_stream = _old_record_stream(chk)
        x = torch.randn(n, H, generator=g).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)])
        w = torch.rand(n, K, generator=g)
        report(writes=(x, idx, w), what="router")
        per_rank, _, per_expert, in_rank, ev = buf.get_dispatch_layout(idx, E, async_finish=True)
        recv_x, r_idx, r_w, counts, handle, ev = buf.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=idx, topk_weights=w, previous_event=ev, async_finish=True)
        del x, w  # the caller drops its inputs while the dispatch may still be in flight
        ev.current_stream_wait()
        y = (recv_x.float() * 2).to(torch.bfloat16)
        report(reads=(recv_x, r_w), writes=y, what="experts")
        combined, _, ev = buf.combine(y, handle, async_finish=True)
        del y
        ev.current_stream_wait()
        report(reads=combined, what="next layer")
        del recv_x, r_idx, r_w, handle, combined, idx, per_rank, per_expert, in_rank
    return chk.messages()


def test_async_buffer_inputs_old_code_flagged():
    msgs = launch(_rank_async_buffer, 2, True, timeout_s=120)
    for rank_msgs in msgs:
        freed = [m for m in rank_msgs if m.startswith("[freed-in-use]")]
        assert any("bfloat16[6, 128]" in m and "comm" in m for m in freed), rank_msgs  # x, and y of the combine
        assert any("float32[6, 3]" in m for m in freed), rank_msgs  # topk_weights
    print("\n".join(msgs[0]))


def test_async_buffer_dispatch_combine_clean():
    assert launch(_rank_async_buffer, 2, False, timeout_s=120) == [[], []]


# ----------------------------------------------------------------------------- 13: microbatch prefill
def _old_dispatch_send(self, state):
    """NormalCommunicator.dispatch_send before the fix: the layout's event as previous_event, the
    payload not kept."""
    from microbatch import comm as C

    x, idx = state["x"], state["topk_idx"]
    per_rank, _, per_expert, in_rank, ev = self.buffer.get_dispatch_layout(idx, self.num_experts,
                                                                          async_finish=self.async_finish)
    payload = C.per_token_group_quant_fp8(x) if self.use_fp8 else x
    recv_x, r_idx, r_w, counts, handle, ev = self.buffer.dispatch(
        payload, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=idx, topk_weights=state["topk_weights"], previous_event=ev if self.async_finish else None,
        async_finish=self.async_finish)
    state.update(layout="contiguous", recv_x=recv_x, recv_topk_idx=r_idx, recv_topk_weights=r_w,
                 num_recv_tokens_per_expert=counts, handle=handle, _event=ev)


def _prefill_ops(comm):
    from microbatch import moe_layer_schedule
    from microbatch import schedules
    from moe_ep.fp8 import dequant_fp8_ref

    def attention(s):
        s["x"] = (s["hidden"].float() * 1.5).to(torch.bfloat16)

    def gate(s):
        w, idx = s["x"].float()[:, :E].topk(K, dim=-1)
        s["topk_idx"], s["topk_weights"] = idx.to(torch.int64), torch.softmax(w, -1)

    def experts(s):
        rx = s["recv_x"]
        x = dequant_fp8_ref(*rx) if isinstance(rx, tuple) else rx.float()
        s["expert_out"] = (x * s["recv_topk_weights"].sum(-1, keepdim=True)).to(torch.bfloat16)

    def shared(s):
        s["shared_out"] = s["x"].float() * 0.5

    def op(fn, reads, writes):
        def run(s):
            report(reads=[s[k] for k in reads], what=fn.__name__)
            fn(s)
            report(writes=[s[k] for k in writes], what=fn.__name__)
        return run

    ops = moe_layer_schedule(comm, mode="prefill",
                             attention=op(attention, ["hidden"], ["x"]),
                             gate=op(gate, ["x"], ["topk_idx", "topk_weights"]),
                             experts=op(experts, ["recv_x", "recv_topk_idx", "recv_topk_weights"], ["expert_out"]),
                             shared_expert=op(shared, ["x"], ["shared_out"]))
    return [op(schedules._output, ["combined", "shared_out"], ["out"]) if o is schedules._output else o for o in ops]


def _rank_prefill(rank, world, old):
    import moe_ep
    from microbatch import NormalCommunicator, run_single, run_two_microbatches
    from microbatch import comm as C
    from moe_ep.testing.streams import reporting

    C.per_token_group_quant_fp8 = reporting(C.per_token_group_quant_fp8)  # this forked rank only
    if old:
        NormalCommunicator.dispatch_send = _old_dispatch_send
    buf = moe_ep.Buffer(None, backend="torch", timeout_s=60)
    ops = _prefill_ops(NormalCommunicator(buf, E))
    hidden = torch.randn(10, H, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    whole = run_single(ops, {"hidden": hidden})["out"]  # reference, unchecked (CPU path)
    with checked_streams(strict=False) as chk:
        a, b = run_two_microbatches(ops, {"hidden": hidden[:4]}, {"hidden": hidden[4:]})
        out = torch.cat([a["out"], b["out"]])
        del a, b
    assert torch.equal(out, whole)
    return chk.messages()


def test_microbatch_prefill_old_dispatch_send_flagged():
    msgs = launch(_rank_prefill, 2, True, timeout_s=120)
    for rank_msgs in msgs:
        assert any(m.startswith("[unordered-read] Buffer.dispatch on comm0 reads float8_e4m3fn[")
                   and "per_token_group_quant_fp8 on compute" in m for m in rank_msgs), rank_msgs
    print("\n".join(msgs[0]))


def test_microbatch_prefill_clean():
    assert launch(_rank_prefill, 2, False, timeout_s=120) == [[], []]


# ----------------------------------------------------------------------------- 14: check_status in capture
def _old_check_status(self, what, blocking=None):
    """SymmBuffer.check_status before the fix (its device path, through moe_ep.events so the checker
    sees it): it polls the events of earlier calls before looking for an ongoing capture."""
    self.check_usable()
    if not events.uses_streams(self.device):
        code = int(self.status[0])
        if code:
            self._raise_status(code, what)
        return
    still = []
    for ev, host, w in self._pending:
        if events.query(ev):
            if int(host[0]):
                self._pending = []
                self._raise_status(int(host[0]), w)
        else:
            still.append((ev, host, w))
    self._pending = still
    if blocking:
        events.synchronize(self.device)
        code = int(self.status[0])
        if code:
            self._raise_status(code, what)
    elif not events.is_capturing(self.device) and len(self._pending) < 64:
        host = events.empty_pinned(1, torch.int32)
        host.copy_(self.status[:1], non_blocking=True)
        ev = events.new_event()
        events.record(ev)
        self._pending.append((ev, host, what))


def _rank_ll_capture(rank, world, old):
    import moe_ep
    from moe_ep.backends.symm import SymmBackend
    from moe_ep.symm import SymmBuffer

    if old:
        SymmBuffer.check_status = _old_check_status  # this forked rank only
    n = 4
    buf = moe_ep.Buffer(None, low_latency_mode=True, explicitly_destroy=True, backend="symm", timeout_s=60,
                        num_rdma_bytes=SymmBackend.get_low_latency_size_hint(n, H, world, E, K))
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(n, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)])
    w = torch.rand(n, K, generator=g)

    def layer():
        recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, n, E, use_fp8=False)
        y = recv_x.clone()
        report(reads=recv_x, writes=y, what="experts")
        out, _, _ = buf.low_latency_combine(y, idx, w, handle)
        report(reads=out, what="next layer")
        return out

    with checked_streams(strict=False) as chk:
        eager = layer()  # warm-up: leaves status polls pending
        with chk.capture():
            captured = layer()
    assert torch.equal(eager, captured)
    buf.check_status()  # after the "replay": blocking check, no capture
    buf.destroy()
    return chk.messages()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU ranks run Triton kernels in the interpreter")
def test_low_latency_capture_old_check_status_flagged():
    msgs = launch(_rank_ll_capture, 2, True, timeout_s=180)
    for rank_msgs in msgs:
        assert rank_msgs and all(m.startswith("[host-query-in-capture] Event.query") for m in rank_msgs), rank_msgs
    print("\n".join(msgs[0]))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU ranks run Triton kernels in the interpreter")
def test_low_latency_capture_clean():
    assert launch(_rank_ll_capture, 2, False, timeout_s=180) == [[], []]
