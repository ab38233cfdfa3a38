"""Expanded dispatch (``ElasticBuffer.dispatch(do_expand=True)``) vs dispatch + permute: bytes and launches.

Counted, not timed (valid on CPU). Per DeepSeek-V3 prefill shape (hidden 7168, 256 experts, top-8, FP8 rows
of ``H + 4 * H / 128`` bytes, ``--tokens`` per rank, EP ``--ranks``), from a sampled balanced routing:

- ``link``: bytes a rank receives (normal mode, DeepEP's count: received rows x row bytes), the same for both;
- ``recv HBM``: bytes the receiving rank writes and reads after the link. dispatch + permute: the receive rows are
  written, each selection's row is read back and the aligned expanded layout (128-row blocks) is written;
  a fused expanded dispatch (DeepEP V2's kernel; the limit column) writes the expanded layout only.
  This release's ``ElasticBuffer`` composes ``Buffer.dispatch`` with a gather, so its bytes are the
  dispatch + permute ones (the ratio column says what fusing would save);
- ``launches``: aten ops (each one kernel launch on a GPU) besides the communication, counted with a
  ``TorchDispatchMode`` on a one-rank gloo group at a small shape (the count does not depend on the size):
  ``ElasticBuffer.dispatch(do_expand=True)`` vs ``Buffer.dispatch`` + ``moe_ep.experts.permute_to_contiguous``
  + the two row gathers the contiguous layer does.

    python perf/bench_elastic.py [--tokens 4096] [--ranks 8 32] [--json out.jsonl]
    python perf/bench_elastic.py --cpu-smoke
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import _common as C  # noqa: E402

C.smoke_env()

import torch  # noqa: E402

HIDDEN, EXPERTS, TOPK, ALIGN = 7168, 256, 8, 128


def routing_counts(tokens: int, ranks: int, seed: int = 0):
    """Per receiving rank (rank 0 by symmetry of a balanced gate): received rows, selections, aligned rows."""
    g = torch.Generator().manual_seed(seed)
    local = EXPERTS // ranks
    topk = torch.rand(tokens * ranks, EXPERTS, generator=g).argsort(1)[:, :TOPK]
    mine = (topk // local) == 0
    recv_rows = int(mine.any(1).sum())
    per_expert = torch.bincount(topk[mine], minlength=local)[:local]
    selections = int(per_expert.sum())
    aligned = int(((per_expert + ALIGN - 1) // ALIGN * ALIGN).sum())
    return recv_rows, selections, aligned


def count_launches(world_tokens: int = 8, hidden: int = 256) -> tuple[int, int]:
    """Aten ops besides communication: (ElasticBuffer expanded dispatch, Buffer.dispatch + permute)."""
    import tempfile

    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    import moe_ep
    from moe_ep.experts import permute_to_contiguous
    from moe_ep.gemm import get_mn_major_tma_aligned_tensor
    from moe_ep.testing.inputs import make_rank_inputs

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    if not dist.is_initialized():
        store = tempfile.mktemp()
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    inp = make_rank_inputs(0, world_tokens, hidden, 8, 4, seed=1, world_size=1)
    x = (inp.x_fp8, inp.x_scales)
    eb = moe_ep.ElasticBuffer(None, num_max_tokens_per_rank=world_tokens, backend="torch")
    buf = eb.buffer
    # the communication itself (one Buffer.dispatch with its layout), counted once and subtracted
    with Count() as base:
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(inp.topk_idx, 8)
        recv, ridx, rw, lst, _, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                 num_tokens_per_expert=per_expert, topk_idx=inp.topk_idx,
                                                 topk_weights=inp.topk_weights)
    with Count() as perm:
        dst, m_indices, m_exp = permute_to_contiguous(ridx, 8, lst)
        src = torch.full((m_exp + 1,), -1, dtype=torch.int64)
        k = dst.shape[1]
        src.scatter_(0, torch.where(dst >= 0, dst, m_exp).reshape(-1), torch.arange(ridx.shape[0]).repeat_interleave(k))
        a = recv[0].view(torch.uint8).index_select(0, src[:m_exp].clamp(min=0))
        s = get_mn_major_tma_aligned_tensor(recv[1].index_select(0, src[:m_exp].clamp(min=0)))
        del a, s
    with Count() as ours:
        eb.dispatch(x, inp.topk_idx, inp.topk_weights, num_experts=8, expert_alignment=ALIGN, do_expand=True,
                    use_tma_aligned_col_major_sf=True)
    return ours.n - base.n, perm.n


def main(argv=None) -> int:
    p = C.parser("bench_elastic.py", __doc__)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 32], help="EP sizes")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        C.smoke_defaults(args, p, argv, tokens=256, ranks=[8])
    rec = C.Records("bench_elastic", args.json, args.cpu_smoke, device="cpu (counted)", argv=argv)
    row = HIDDEN + HIDDEN // 128 * 4
    print(C.table_header(["case", "metric", "dispatch+permute", "fused expanded", "ratio"]))
    for ranks in args.ranks:
        m, s, a = routing_counts(args.tokens, ranks)
        case = f"dsv3 prefill T={args.tokens} EP{ranks}"
        link = m * row
        unfused = (m + s + a) * row
        fused = a * row
        rec.add(case, "link bytes", link, "B", baseline=link, limit=link, ratio=1.0)
        rec.add(case, "recv HBM bytes", unfused, "B", baseline=unfused, limit=fused, ratio=unfused / fused,
                recv_rows=m, selections=s, expanded_rows=a)
        print(f"| {case} | link MB | {link / 1e6:.1f} | {link / 1e6:.1f} | 1.00 |")
        print(f"| {case} | recv HBM MB (rows {m}, selections {s}, expanded {a}) | {unfused / 1e6:.1f} | "
              f"{fused / 1e6:.1f} | {unfused / fused:.2f} |")
    ours, perm = count_launches()
    rec.add("launches (aten ops past the communication)", "ElasticBuffer expanded dispatch", ours, "ops",
            baseline=perm, limit=1, ratio=ours / max(perm, 1))
    print(f"| launches | aten ops past the communication: Buffer.dispatch + permute vs ElasticBuffer expand (a fused "
          f"kernel: 1) | {perm} | {ours} | {ours / max(perm, 1):.2f} |")
    return rec.finish("bench_elastic.py")


if __name__ == "__main__":
    sys.exit(main())
