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

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

import torch  # noqa: E402

from microbatch import Communicator, moe_layer_schedule, run_single, run_two_microbatches, split_batch  # noqa: E402

PROG = "bench_microbatch.py"
SMOKE = dict(hidden=256, moe_inter=128, attn_width=256, iters=3, comm_scale=1.0, tokens=[16])
TOL = 2e-2  # two microbatches vs one batch: max |diff| / max |one batch|


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


def _time_ms(fn, device, iters, graph=True, hows=None):
    """Timing in milliseconds (median, p10, p90, iterations). On a GPU the whole schedule is captured in one CUDA
    graph and the replays are timed (decode sizes would otherwise time the CPU launch rate); when capture fails it
    falls back to eager launches. ``hows`` collects how each measurement was timed."""
    how = "CPU"
    if device.type == "cuda":
        if graph:
            fn, _, note = _common.graph_fn(fn, device)
            how = note or "CUDA graph replay"
        else:
            how = "eager launches (--no-graph)"
    if hows is not None:
        hows.append(how)
    t = _common.time_us(fn, device, iters=iters, warmup=2)
    return _common.Timing((t.median / 1e3, t.p10 / 1e3, t.p90 / 1e3, t.n))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = _common.parser(PROG, __doc__, "run the CPU variant: tiny shapes (hidden 256, 16 tokens, 3 iterations) "
                                      "unless given explicitly (numbers meaningless)")
    p.add_argument("--mode", choices=["decode", "prefill"], nargs="+", default=["decode", "prefill"],
                   help="which schedules to time")
    p.add_argument("--tokens", type=int, nargs="+", default=None,
                   help="batch sizes (default decode: 32..512, prefill: 1024..8192)")
    p.add_argument("--hidden", type=int, default=7168, help="hidden size")
    p.add_argument("--moe-inter", type=int, default=2048, help="expert MLP width")
    p.add_argument("--attn-width", type=int, default=16384, help="width of the emulated attention projections")
    p.add_argument("--topk", type=int, default=8, help="experts per token")
    p.add_argument("--comm-scale", type=float, default=8.0,
                   help="copy this many times the dispatch/combine bytes (HBM copy is ~10x faster than NVLink/RDMA)")
    p.add_argument("--no-graph", action="store_true",
                   help="time eager launches instead of CUDA-graph replays of the schedule (GPU)")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per measurement (median, p10, p90)")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        _common.smoke_defaults(args, p, argv, **SMOKE)
    for k in ("hidden", "moe_inter", "attn_width", "topk", "iters"):
        if getattr(args, k) < 1:
            p.error(f"argument --{k.replace('_', '-')}: must be >= 1, got {getattr(args, k)}")
    if args.tokens and min(args.tokens) < 2:
        p.error(f"argument --tokens: must be >= 2 (two microbatches), got {min(args.tokens)}")
    if args.comm_scale <= 0:
        p.error(f"argument --comm-scale: must be > 0, got {args.comm_scale}")
    if args.cpu_smoke:
        device = torch.device("cpu")
    elif _common.gpu_count() and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        return _common.no_gpu(PROG)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    rec = _common.Records("bench_microbatch", args.json, args.cpu_smoke, device=name, argv=argv)
    print(f"# two-microbatch overlap, {name}, {rec.header['date']}, commit {rec.header['commit']}; hidden {args.hidden}, "
          f"top-{args.topk}, communication emulated as {args.comm_scale}x the DeepEP bytes copied on a side stream; "
          f"median of {args.iters}; GPU: each schedule captured in one CUDA graph and replayed (--no-graph: eager), "
          "L2 flushed before each timed call", flush=True)
    print(_common.table_header(["mode", "tokens", "compute ms", "comm ms", "no split ms", "two mb ms",
                                "p10-p90 ms", "overlap eff.", "speedup", "timed as", "check"]), flush=True)
    compute = _layer(args, device)
    for mode in args.mode:
        sizes = args.tokens or ([32, 64, 128, 256, 512] if mode == "decode" else [1024, 2048, 4096, 8192])
        comm = EmulatedCommunicator(args.hidden, args.topk, device, args.comm_scale, max(sizes))
        ops = moe_layer_schedule(comm, mode=mode, **compute)
        comp_ops = moe_layer_schedule(_NoComm(), mode=mode, **compute)
        for n in sizes:
            hidden = torch.randn(n, args.hidden, device=device).to(torch.bfloat16)
            split = split_batch([n] if mode == "prefill" else [1] * n, mode)
            a, b = hidden[split.token_slices[0]], hidden[split.token_slices[1]]
            hows = []
            tm = dict(device=device, iters=args.iters, graph=not args.no_graph, hows=hows)
            t_comp = _time_ms(lambda: run_single(comp_ops, {"hidden": hidden}), **tm).median

            def comm_only():
                s = {"x": hidden, "expert_out": hidden}
                comm.dispatch_send(s)
                comm.dispatch_recv(s)
                comm.combine_send(s)
                comm.combine_recv(s)
            t_comm = _time_ms(comm_only, **tm).median
            t_one = _time_ms(lambda: run_single(ops, {"hidden": hidden}), **tm).median
            off = 1 if mode == "decode" else 0  # decode: B one stage behind, so every transfer sits under compute
            box = {}

            def two():
                box["out"] = run_two_microbatches(ops, {"hidden": a}, {"hidden": b}, offset=off)
            t2 = _time_ms(two, **tm)
            how = hows[-1] if len(set(hows)) == 1 else "; ".join(f"{k}: {h}" for k, h in
                                                                  zip(("compute", "comm", "no split", "two mb"), hows))
            t_two = t2.median
            # check: the two microbatches' outputs (of the last timed call) == the layer on the whole batch
            sa, sb = box["out"]
            one = run_single(ops, {"hidden": hidden})["out"]
            two_out = torch.empty_like(one)
            two_out[split.token_slices[0]] = sa["out"]
            two_out[split.token_slices[1]] = sb["out"]
            err = _common.rel_err(two_out, one)
            valid = err <= TOL
            eff = (t_comp + t_comm - t_two) / max(min(t_comp, t_comm), 1e-9)
            print(f"| {mode} | {n} | {t_comp:.3f} | {t_comm:.3f} | {t_one:.3f} | {t_two:.3f} | {t2.p10:.3f}-{t2.p90:.3f} | "
                  f"{100 * eff:.0f}% | {t_one / t_two:.2f} | {how} | "
                  f"{f'ok ({err:.1e})' if valid else f'INVALID ({err:.1e} > {TOL})'} |",
                  flush=True)
            rec.add(f"{mode} {n} tokens", "two-microbatch time", t_two, "ms", p10=t2.p10, p90=t2.p90,
                    iterations=t2.n, baseline=t_one, limit=max(t_comp, t_comm), ratio=t_one / t_two, valid=valid,
                    rel_err=err, compute_ms=t_comp, comm_ms=t_comm, overlap_efficiency=eff, timed_as=how,
                    method=_common.how_method(how),
                    l2_resident=None if device.type != "cuda" else False,
                    note="one GPU: communication emulated as a side-stream copy; L2 flushed before each timed call")
    return rec.finish(PROG)


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
