"""Two-microbatch overlap on one GPU: the real schedules and executor, with the communication emulated.

With a single GPU there is no peer to talk to, so the communicator moves the bytes a real dispatch /
combine would move (DeepEP counting: dispatch selections x (H + H/32 + 16), combine selections x 2H,
scaled by ``--comm-scale`` to mimic a slower link) as a device-to-device copy on a second stream; the
compute is BF16 GEMMs shaped like a DeepSeek-V3 layer's per-GPU work (attention projections, routed
experts, shared expert). Per batch size it reports:

- ``compute`` and ``comm``: each part alone (one batch); ``serial`` = compute + comm;
- ``no split``: the layer as one batch (communication exposed); ``two mb``: two microbatches
  (:func:`microbatch.run_two_microbatches`), communication on the side stream;
- overlap efficiency = (serial - two mb) / min(compute, comm), and the speedup over no split.
The smallest batch where two microbatches win is the break-even point.

    python perf/bench_microbatch.py                # needs a CUDA GPU
    python perf/bench_microbatch.py --cpu-smoke    # the code paths on CPU, tiny shapes (numbers meaningless)
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch

from microbatch import Communicator, moe_layer_schedule, run_single, run_two_microbatches, split_batch


class EmulatedCommunicator(Communicator):
    """Moves the bytes of a dispatch / combine as a copy on a side stream (one GPU, no peers)."""

    def __init__(self, hidden: int, topk: int, device: torch.device, comm_scale: float, max_tokens: int):
        self.h, self.k, self.device, self.scale = hidden, topk, device, comm_scale
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        per_tok = int(topk * 2 * hidden * comm_scale) + 16
        self.src = torch.empty(max_tokens * per_tok, dtype=torch.uint8, device=device)
        self.dst = torch.empty_like(self.src)

    def _move(self, state, nbytes):
        if self.stream is None:
            self.dst[:nbytes].copy_(self.src[:nbytes])
            state["_ev"] = None
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.dst[:nbytes].copy_(self.src[:nbytes])
            ev = torch.cuda.Event()
            ev.record()
        state["_ev"] = ev

    def _wait(self, state):
        ev = state.pop("_ev")
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)

    def dispatch_send(self, s):
        n = s["x"].shape[0]
        self._move(s, int(n * self.k * (self.h + self.h // 32 + 16) * self.scale))
        s.update(layout="contiguous", recv_x=s["x"])

    def dispatch_recv(self, s):
        self._wait(s)

    def combine_send(self, s):
        self._move(s, int(s["x"].shape[0] * self.k * 2 * self.h * self.scale))
        s["combined"] = s["expert_out"]

    def combine_recv(self, s):
        self._wait(s)


def _layer(args, device):
    H, F, K = args.hidden, args.moe_inter, args.topk
    g = torch.Generator(device="cpu").manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(torch.bfloat16).to(device)

    wq, wo, w13, w2, ws13, ws2 = w(args.attn_width, H), w(H, args.attn_width), w(2 * F, H), w(H, F), w(2 * F, H), w(H, F)

    def attention(s):
        s["x"] = (s["hidden"] @ wq.t()) @ wo.t()

    def gate(s):
        s["topk_idx"] = None

    def mlp(x, a, b):
        gu = x @ a.t()
        return (torch.nn.functional.silu(gu[:, :F]) * gu[:, F:]) @ b.t()

    def experts(s):  # the routed experts' work of this GPU: K selections per token on average
        x = s["recv_x"].repeat(K, 1)
        s["expert_out"] = mlp(x, w13, w2)[: s["recv_x"].shape[0]]

    def shared(s):
        s["shared_out"] = mlp(s["x"], ws13, ws2)

    return dict(attention=attention, gate=gate, experts=experts, shared_expert=shared)


def _time_ms(fn, device, iters):
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(iters):
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
    else:
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["decode", "prefill"], nargs="+", default=["decode", "prefill"])
    p.add_argument("--tokens", type=int, nargs="+", default=None,
                   help="batch sizes (default decode: 32..512, prefill: 1024..8192)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--moe-inter", type=int, default=2048)
    p.add_argument("--attn-width", type=int, default=16384)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--comm-scale", type=float, default=8.0,
                   help="copy this many times the dispatch/combine bytes (HBM copy is ~10x faster than NVLink/RDMA)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--cpu-smoke", action="store_true")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        device = torch.device("cpu")
        args.hidden, args.moe_inter, args.attn_width, args.iters, args.comm_scale = 256, 128, 256, 3, 1.0
    elif torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        print("bench_microbatch: no CUDA GPU (use --cpu-smoke to exercise the code on CPU)")
        return 0
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"# two-microbatch overlap, {name}, {datetime.date.today()}; hidden {args.hidden}, top-{args.topk}, "
          f"communication emulated as {args.comm_scale}x the DeepEP bytes copied on a side stream")
    print("| mode | tokens | compute ms | comm ms | no split ms | two mb ms | overlap eff. | speedup |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    compute = _layer(args, device)
    for mode in args.mode:
        sizes = args.tokens or ([32, 64, 128, 256, 512] if mode == "decode" else [1024, 2048, 4096, 8192])
        if args.cpu_smoke:
            sizes = [16]
        comm = EmulatedCommunicator(args.hidden, args.topk, device, args.comm_scale, max(sizes))
        ops = moe_layer_schedule(comm, mode=mode, **compute)
        comp_ops = moe_layer_schedule(_NoComm(), mode=mode, **compute)
        for n in sizes:
            hidden = torch.randn(n, args.hidden, device=device).to(torch.bfloat16)
            split = split_batch([n] if mode == "prefill" else [1] * n, mode)
            a, b = hidden[split.token_slices[0]], hidden[split.token_slices[1]]
            t_comp = _time_ms(lambda: run_single(comp_ops, {"hidden": hidden}), device, args.iters)

            def comm_only():
                s = {"x": hidden, "expert_out": hidden}
                comm.dispatch_send(s)
                comm.dispatch_recv(s)
                comm.combine_send(s)
                comm.combine_recv(s)
            t_comm = _time_ms(comm_only, device, args.iters)
            t_one = _time_ms(lambda: run_single(ops, {"hidden": hidden}), device, args.iters)
            off = 1 if mode == "decode" else 0  # decode: B one stage behind, so every transfer sits under compute
            t_two = _time_ms(lambda: run_two_microbatches(ops, {"hidden": a}, {"hidden": b}, offset=off), device, args.iters)
            eff = (t_comp + t_comm - t_two) / max(min(t_comp, t_comm), 1e-9)
            print(f"| {mode} | {n} | {t_comp:.3f} | {t_comm:.3f} | {t_one:.3f} | {t_two:.3f} | {100 * eff:.0f}% | "
                  f"{t_one / t_two:.2f} |")
    return 0


class _NoComm(Communicator):
    """The schedule's compute alone."""

    def dispatch_send(self, s):
        s.update(layout="contiguous", recv_x=s["x"])

    def dispatch_recv(self, s):
        pass

    def combine_send(self, s):
        s["combined"] = s["expert_out"]

    def combine_recv(self, s):
        pass


if __name__ == "__main__":
    sys.exit(main())
