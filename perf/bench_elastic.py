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
  ``ElasticBuffer.dispatch(do_expand=True)`` vs ``Buffer.dispatch`` + ``moe_ep.layer.experts.permute_to_contiguous``
  + the two row gathers the contiguous layer does.

Layer (``MoELayer(mode="prefill")``, ``dispatch="permute"`` vs ``dispatch="expanded"``), counted on the receiving
rank of EP ``R`` (rank 0's sampled receive, run on a one-rank gloo group with ``E / R`` experts, so the
communication is a self-copy and every op past it sees that rank's real shapes), GEMM/quant kernels stubbed
(counted, not run; the same three kernels plus the input quant in both paths, reading the same aligned rows):

- ``layer launches``: Triton kernels + aten ops past the communication (each aten op a kernel launch on a GPU);
- ``layer glue bytes``: bytes the aten ops read and write past the communication (outputs written; inputs
  read, gathers counted by the rows they take; in-place scatters by the source); the kernels' own traffic is
  equal in both paths and left out; ``(expand kernels: the CUDA path)`` rows: the expanded path as it runs on
  GPUs, where the expanded layout's gathers and the expanded combine's sum are ``moe_ep.kernels.expand``
  launches (stubbed here, counted as kernels, their bytes counted as glue since they replace glue ops);
- ``symm receive copy``: bytes the ``symm`` normal receive copies out of the symmetric buffer (the gather into
  message rows, then the unpack of ``recv_x`` / scales into contiguous tensors): what ``recv_as_view=True``
  saves (its receive copies nothing: the senders wrote the rows where the views point);
- ``symm expanded receive``: bytes read + written after the link by the expanded dispatch on ``symm``: the copying
  receive, then the gather of each selection's row into the aligned expanded layout, vs ``recv_as_view=True``
  (the gather reads the selections straight from the buffer) vs a fused expanded kernel (the limit: writes the
  expanded layout only).

Memory per rank (computed, not measured): ``ElasticBuffer.memory_per_rank`` (what our constructor allocates:
the ``symm`` region sized by ``get_buffer_size_hint``, plus its signal words; the ``torch`` backend allocates
nothing persistent) vs DeepEP V2's ``get_buffer_size_hint`` restated in ``moe_ep.deepep.v2.memory`` (BF16 and FP8
dispatch; 8 GPUs per NVLink domain with hybrid mode, and one NVLink domain of all ranks) for DeepSeek-V3
(hidden 7168, 256 experts, top-8): prefill ``--memory-prefill-tokens``, decode ``--memory-decode-tokens``, EP
``--memory-ranks``.

Timed (``perf/_common.time_ranks``: a barrier before each iteration, the slowest rank per iteration):
``ElasticBuffer.dispatch`` normal and expanded (alignment 128, TMA-aligned scales) of FP8 input, each also with
``recv_as_view=True``, vs ``Buffer.get_dispatch_layout`` + ``Buffer.dispatch`` (the transport it wraps), and
``ElasticBuffer.combine``
normal and expanded vs ``Buffer.combine``, on the same ``Buffer`` (``ElasticBuffer.from_buffer``), per backend
(``--time-backends``). Every timed output is then checked (receive bitwise equal to ``Buffer``'s, expanded rows
equal to their received rows, both combines bitwise equal to ``Buffer.combine``). ``--launcher spawn`` (the
default): ``--time-ranks`` forked CPU ranks over gloo (``symm`` on shared memory): CPU numbers, for the code
paths and the Python overhead of this face only. ``--launcher torchrun``: one process per GPU over NCCL
(only the timed section runs; rank 0 prints and writes the JSON). ``--time-ranks 0`` skips the timing.

    python perf/bench_elastic.py [--tokens 4096] [--ranks 8 32] [--layer-tokens 1024] [--json out.jsonl]
    python perf/bench_elastic.py --cpu-smoke
    torchrun --nproc-per-node 8 perf/bench_elastic.py --launcher torchrun [--time-tokens 4096] --json t.jsonl
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
    from moe_ep.layer.experts import permute_to_contiguous
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


INTER = 2048  # DeepSeek-V3 moe_intermediate_size


def receive_of_rank0(tokens: int, ranks: int, seed: int = 0):
    """Rank 0's receive under EP ``ranks``: local top-k ``[m, K]`` (local expert or -1) and weights ``[m, K]``."""
    g = torch.Generator().manual_seed(seed)
    local = EXPERTS // ranks
    topk = torch.rand(tokens * ranks, EXPERTS, generator=g).argsort(1)[:, :TOPK]
    mine = (topk // local) == 0
    rows = mine.any(1)
    idx = torch.where(mine, topk, -1)[rows]
    w = torch.rand(idx.shape, generator=g)
    return idx.to(torch.int64), torch.where(idx >= 0, w, 0.0), local


class _Counter:
    """A TorchDispatchMode counting aten ops and their bytes, with pauses (communication, stubbed kernels)."""

    GATHERS = {"index_select", "index", "gather", "embedding"}
    SCATTERS = {"index_copy_", "index_copy", "scatter_", "scatter", "index_put_", "index_put", "scatter_add_",
                "index_add_"}

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if not counter.paused:
                    counter.record(func, args, kwargs or {}, out)
                return out

        self.mode = Mode()
        self.paused = 0
        self.ops = self.kernels = self.comm = 0
        self.read = self.written = 0

    @staticmethod
    def _tensors(x):
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, (list, tuple)):
            for v in x:
                yield from _Counter._tensors(v)
        elif isinstance(x, dict):
            for v in x.values():
                yield from _Counter._tensors(v)

    def record(self, func, args, kwargs, out):
        name = func.__name__.split(".")[0]
        if name in ("view", "_unsafe_view", "as_strided", "t", "transpose", "unsqueeze", "squeeze", "reshape",
                    "expand", "select", "slice", "detach", "alias", "permute", "split", "chunk", "unbind",
                    "view_as_real", "lift_fresh", "_to_copy_noop", "sym_size", "sym_stride", "sym_numel"):
            return  # metadata only: no launch on a GPU
        self.ops += 1
        outs = list(self._tensors(out))
        ins = list(self._tensors(list(args) + list(kwargs.values())))
        w = sum(t.numel() * t.element_size() for t in outs)
        if name in self.GATHERS:
            r = w + sum(t.numel() * t.element_size() for t in ins if t.dtype in (torch.int64, torch.int32))
        elif name in self.SCATTERS:
            src = [t for t in ins[1:] if t.dtype not in (torch.int64,) or name.startswith("scatter")]
            r = sum(t.numel() * t.element_size() for t in ins[1:])
            w = max((t.numel() * t.element_size() for t in src[-1:]), default=0)
        elif name in ("zeros", "empty", "full", "new_zeros", "new_empty", "new_full", "empty_like", "zeros_like",
                      "full_like", "arange", "fill_", "zero_", "ones", "ones_like"):
            r = 0
            w = 0 if name.startswith("empty") or name.startswith("new_empty") else w
        else:
            r = sum(t.numel() * t.element_size() for t in ins)
        self.read += r
        self.written += w

    def paused_call(self, fn, kind):
        def wrapped(*a, **k):
            if not self.paused:  # a call made inside a paused one (a backend's own collective) is part of it
                setattr(self, kind, getattr(self, kind) + 1)
            self.paused += 1
            try:
                return fn(*a, **k)
            finally:
                self.paused -= 1
        return wrapped


def count_layer(tokens: int, ranks: int, hidden: int = HIDDEN, inter: int = INTER, seed: int = 0) -> dict:
    """Per layer call on EP ``ranks``'s rank 0 (see the module docstring): {path: (kernels, comm calls, aten ops,
    glue bytes read, glue bytes written)}."""
    import tempfile

    import torch.distributed as dist

    import moe_ep
    import moe_ep.deepep.v2.dispatch as ed  # its _masks_to_me is the face's one all_to_all_single
    import moe_ep.layer.experts as ex
    import moe_ep.layer.moe as mo
    from moe_ep.fp8 import FP8_DTYPE
    from moe_ep.gemm import get_mn_major_tma_aligned_tensor

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    idx, w, local = receive_of_rank0(tokens, ranks, seed)
    m = idx.shape[0]
    x = torch.randn(m, hidden).to(torch.bfloat16)

    def fake_weights():
        q = lambda *shape: torch.zeros(*shape, dtype=FP8_DTYPE)  # noqa: E731
        return ex.ExpertWeights((q(local, 2 * inter, hidden), torch.ones(local, 2 * inter // 128, hidden // 128)),
                                (q(local, hidden, inter), torch.ones(local, hidden // 128, inter // 128)))

    def quant(v, *a, **k):  # the input quant (a Triton kernel): stubbed
        return torch.empty(v.shape, dtype=FP8_DTYPE), torch.ones(v.shape[0], v.shape[1] // 128)

    def gemm(a, b, d, m_indices, *args, **kw):  # GEMMs: stubbed (the output is written by the kernel)
        return None

    def silu(h, *a, **k):
        return (torch.empty(h.shape[0], h.shape[1] // 2, dtype=FP8_DTYPE),
                get_mn_major_tma_aligned_tensor(torch.ones(h.shape[0], h.shape[1] // 256)))

    import types

    import moe_ep.deepep.v2.expand as ee
    import moe_ep.kernels.expand as ke

    def torch_path(fn, *a):  # the CPU path's torch ops, for a stubbed kernel (the switch is on while counting)
        ee.USE_KERNELS = False
        try:
            return fn(*a)
        finally:
            ee.USE_KERNELS = True

    def expand_kernel(c):  # the expand kernel (GPU path): run as the torch gather, counted as one kernel + its bytes
        def run(t, src, zero, w=None, exp_k=None):
            out, _, wo = torch_path(ee.expand_received, t, None, w, src, exp_k, zero)
            has = int((src >= 0).sum())
            row = t[0].numel() * t.element_size() if t.shape[0] else 0
            c.read += has * row + 8 * src.numel() + (16 * src.numel() if w is not None else 0)
            c.written += (src.numel() if zero else has) * row + (4 * src.numel() if w is not None else 0)
            return out, wo
        return run

    def sum_kernel(c):  # the expanded combine's sum kernel (GPU path), likewise
        def run(x, src):
            plan = types.SimpleNamespace(_comb_src=src, _comb_order=None, _comb_sorted_src=None, _comb_rows=None,
                                         _hidden=x.shape[1])  # the worst-case form of the handle's plan
            out = torch_path(ee.sum_expanded, x, plan)
            c.read += int((src >= 0).sum()) * x.shape[1] * 2 + 8 * src.numel()
            c.written += out.numel() * 2
            return out
        return run

    weights = fake_weights()
    buf = moe_ep.Buffer(None, backend="torch")
    results = {}
    saved = {}
    for path in ("permute", "expanded", "expanded+kernels"):
        c = _Counter()
        patches = [(mo, "per_token_group_quant_fp8", c.paused_call(quant, "kernels")),
                   (ex, "per_token_group_quant_fp8", c.paused_call(quant, "kernels")),
                   (ex, "m_grouped_fp8_gemm_nt_contiguous", c.paused_call(gemm, "kernels")),
                   (ex, "silu_and_mul_quant_fp8", c.paused_call(silu, "kernels")),
                   (moe_ep.Buffer, "dispatch", c.paused_call(moe_ep.Buffer.dispatch, "comm")),
                   (moe_ep.Buffer, "combine", c.paused_call(moe_ep.Buffer.combine, "comm")),
                   (moe_ep.Buffer, "get_dispatch_layout", c.paused_call(moe_ep.Buffer.get_dispatch_layout, "comm")),
                   (ed.dist, "all_to_all_single", c.paused_call(ed.dist.all_to_all_single, "comm"))]
        if path == "expanded+kernels":  # what runs on CUDA tensors: moe_ep.kernels.expand
            patches += [(ee, "USE_KERNELS", True), (ke, "expand_rows", c.paused_call(expand_kernel(c), "kernels")),
                        (ke, "sum_rows", c.paused_call(sum_kernel(c), "kernels"))]
        for mod, name, fn in patches:
            saved[(mod, name)] = getattr(mod, name)
            setattr(mod, name, fn)
        try:
            layer = mo.MoELayer(buf, weights, local, mode="prefill", dispatch=path.split("+")[0],
                                num_max_dispatch_tokens_per_rank=m)
            with c.mode:
                layer(x, idx, w)
        finally:
            for (mod, name), fn in saved.items():
                setattr(mod, name, fn)
        results[path] = (c.kernels, c.comm, c.ops, c.read, c.written)
    return results


def symm_receive_copy_bytes(recv_rows: int, hidden: int = HIDDEN, topk: int = TOPK) -> int:
    """Bytes the symm normal receive copies after the link (what ``recv_as_view=True`` saves): the gather
    kernel reads and writes each message row (``W_d`` int32 words: FP8 payload | scales | int64 top-k ids |
    float32 weights, padded to 16 words), then ``recv_x`` and the scales are unpacked contiguous (read + write)."""
    words = hidden // 4 + hidden // 128 + 2 * topk + topk
    words = (words + 15) // 16 * 16
    row = hidden + hidden // 128 * 4
    return recv_rows * (2 * 4 * words + 2 * row)


def memory_rows(rec, prefill_tokens, decode_tokens, ranks_list, hidden=HIDDEN, topk=TOPK) -> None:
    """The memory-per-rank table (see the module docstring), printed and recorded."""
    from moe_ep import ElasticBuffer
    from moe_ep.deepep.v2.memory import deepep_v2_buffer_size_hint as deepep

    MB = 2 ** 20
    print(C.table_header(["phase", "tokens/rank", "EP", "ours symm MiB (fixed, rounds)", "ours symm MiB (whole batch)",
                          "ours torch MiB", "DeepEP V2 BF16 MiB, 8/node",
                          "DeepEP V2 BF16 MiB, one domain", "DeepEP V2 FP8 MiB, 8/node", "DeepEP V2 FP8 MiB, one domain",
                          "ours / DeepEP BF16 one domain"]))
    for phase, tokens in [("prefill", t) for t in prefill_tokens] + [("decode", t) for t in decode_tokens]:
        for R in ranks_list:
            ours = ElasticBuffer.memory_per_rank(R, tokens, hidden, topk, backend="symm")
            whole = ElasticBuffer.memory_per_rank(R, tokens, hidden, topk, backend="symm", whole_batch=True)
            d = {(fp8, nvl): deepep(R, tokens, hidden, topk, fp8, nvlink_ranks=nvl)
                 for fp8 in (False, True) for nvl in (8, R)}
            ratio = ours / d[(False, R)]
            rec.add(f"dsv3 {phase} memory T={tokens} EP{R}", "ElasticBuffer bytes per rank (symm)", ours, "B",
                    baseline=d[(False, R)], ratio=ratio, ours_whole_batch=whole, ours_torch=0,
                    deepep_bf16_8_per_node=d[(False, 8)],
                    deepep_bf16_one_domain=d[(False, R)], deepep_fp8_8_per_node=d[(True, 8)],
                    deepep_fp8_one_domain=d[(True, R)],
                    note="computed: ElasticBuffer.memory_per_rank (the default fixed size; whole_batch=True: one round, "
                         "views) vs DeepEP V2 get_buffer_size_hint (restated in "
                         "moe_ep.deepep.v2.memory; its ~16 MB workspace not included); symm is intranode only")
            print(f"| {phase} | {tokens} | {R} | {ours / MB:.0f} | {whole / MB:.0f} | 0 | {d[(False, 8)] / MB:.0f} | "
                  f"{d[(False, R)] / MB:.0f} | {d[(True, 8)] / MB:.0f} | {d[(True, R)] / MB:.0f} | {ratio:.2f} |")


TIMED = ("Buffer dispatch (layout + dispatch)", "ElasticBuffer dispatch (normal)", "ElasticBuffer dispatch (expanded)",
         "ElasticBuffer dispatch (normal, recv_as_view)", "ElasticBuffer dispatch (expanded, recv_as_view)",
         "Buffer combine", "ElasticBuffer combine (normal)", "ElasticBuffer combine (expanded)")
BASELINES = {name: TIMED[0] if "dispatch" in name else TIMED[5] for name in TIMED}  # what each row is compared with


def time_rank(rank, world, backend, tokens, hidden, experts, topk, iters, device="cpu"):
    """One rank's part of the timed section: ``{metric: (Timing, per-rank medians)}`` for :data:`TIMED` (the same
    on every rank: :func:`_common.time_ranks` gathers them) and ``valid``: this rank's output checks."""
    import moe_ep
    from moe_ep.backends.symm import SymmBackend
    from moe_ep.fp8 import per_token_group_quant_fp8_ref

    device = torch.device(device)
    kw = {}
    if backend == "symm":
        kw = dict(num_nvl_bytes=SymmBackend.get_normal_size_hint(tokens, hidden, topk, world))
        if device.type == "cpu":
            kw["provider"] = "shm"
    buf = moe_ep.Buffer(None, backend=backend, timeout_s=300, **kw)
    eb = moe_ep.ElasticBuffer.from_buffer(buf, tokens)
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    idx = torch.rand(tokens, experts, generator=g).argsort(1)[:, :topk].to(device)
    w = torch.rand(tokens, topk, generator=g).to(device)
    q = per_token_group_quant_fp8_ref(x.to(device), 128)

    def buffer_dispatch():
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, experts)
        return buf.dispatch(q, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                            topk_idx=idx, topk_weights=w)

    def elastic(expand, view=False):
        return eb.dispatch(q, idx, w, num_experts=experts, expert_alignment=128 if expand else 1, do_expand=expand,
                           use_tma_aligned_col_major_sf=expand, recv_as_view=view)

    base = buffer_dispatch()
    normal, expanded = elastic(False), elastic(True)
    z = base[0][0].float().to(torch.bfloat16)  # BF16 rows to combine, one per received token
    slots = expanded[3].recv_src_metadata[:, 2:]
    # expanded combine input: each token's row on its first local selection, zeros elsewhere (the sum is exact)
    first = torch.where(slots >= 0, torch.arange(slots.shape[1], device=device), slots.shape[1]).min(1).values
    y = torch.zeros(expanded[3].num_expanded_tokens, hidden, dtype=torch.bfloat16, device=device)
    has = first < slots.shape[1]
    rows = torch.arange(slots.shape[0], device=device)[has]
    y[slots[rows, first[has]]] = z[rows]
    fns = [buffer_dispatch, lambda: elastic(False), lambda: elastic(True), lambda: elastic(False, True),
           lambda: elastic(True, True), lambda: buf.combine(z, base[4]), lambda: eb.combine(z, normal[3]),
           lambda: eb.combine(y, expanded[3])]
    out = {}
    # the combines of the copying handles run before the view dispatches: a combine while a view is held has half
    # the buffer (symm: a copying dispatch and its combine time-share the whole buffer)
    for i in (0, 1, 2, 5, 6, 7, 3, 4):
        out[TIMED[i]] = C.time_ranks(fns[i], device, iters=iters, warmup=1)
    # checks (outside the timed region): receive, expansion and combines against Buffer's own results; a view is
    # checked before the next call (which may reuse its rows)
    u8 = lambda t: t.view(torch.uint8)  # noqa: E731
    v = elastic(False, True)[0]
    ok = torch.equal(u8(v[0]), u8(base[0][0])) and torch.equal(v[1], base[0][1])
    v = elastic(True, True)[0]
    ok = ok and torch.equal(u8(v[0]), u8(expanded[0][0])) and torch.equal(v[1], expanded[0][1])
    elastic(False)  # a copying dispatch releases the held view before the combines of the older handles
    ref = buf.combine(z, base[4])[0]
    ex = expanded[0][0]
    ok = ok and torch.equal(u8(normal[0][0]), u8(base[0][0])) and torch.equal(normal[0][1], base[0][1])
    sel = slots >= 0
    ok = ok and torch.equal(u8(ex[slots[sel]]), u8(base[0][0]).unsqueeze(1).expand(-1, slots.shape[1], -1)[sel])
    ok = ok and torch.equal(u8(eb.combine(z, normal[3])[0]), u8(ref))
    ok = ok and torch.equal(u8(eb.combine(y, expanded[3])[0]), u8(ref))
    out["valid"] = bool(ok)
    return out


def timing_rows(rec, say, results, backend, world, tokens, hidden, experts, topk, where, note) -> None:
    """Rows of one backend's timed section; ``results`` per rank (or rank 0's only under torchrun)."""
    valid = all(r["valid"] for r in results)
    r0 = results[0]
    case = f"{backend} EP{world} T={tokens} H={hidden} E={experts} top-{topk} ({where})"
    for name in TIMED:
        t, per_rank = r0[name]
        base = r0[BASELINES[name]][0]
        is_base = BASELINES[name] == name
        rec.add(case, name, t.median, "us", p10=t.p10, p90=t.p90, iterations=t.n,
                baseline=None if is_base else base.median, ratio=None if is_base else t.median / base.median,
                valid=valid, per_rank_medians=per_rank, note=note,
                method=C.CPU_WALL if rec.method == C.COUNTED else rec.method)
        say(f"| {case} | {name} | {t.median:.0f} | {t.p10:.0f}-{t.p90:.0f} | "
            f"{'-' if is_base else f'{t.median / base.median:.2f}'} | {'' if valid else 'INVALID'} |")


def main_torchrun(args, prog, argv) -> int:
    """``--launcher torchrun``: the timed section only, one process per GPU over NCCL."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if k not in os.environ]
    if missing:
        return C.error(prog, f"--launcher torchrun needs {', '.join(missing)} in the environment: run it as "
                             f"`torchrun --nproc-per-node <GPUs> perf/{prog} --launcher torchrun`", 2)
    if args.cpu_smoke or not torch.cuda.is_available():
        return C.error(prog, "--launcher torchrun needs one CUDA GPU per rank (not --cpu-smoke)", 2)
    import torch.distributed as dist

    with C.torchrun_nccl() as (rank, world, device):
        name = torch.cuda.get_device_name(device)
        rec = C.Records("bench_elastic", args.json if rank == 0 else None, False, device=f"{world} x {name}",
                        argv=argv, method=C.EAGER)
        say = print if rank == 0 else (lambda *a, **k: None)
        say(C.table_header(["case", "metric", "slowest rank us (median)", "p10-p90 us", "vs Buffer", "check"]))
        for backend in args.time_backends:
            r = time_rank(rank, world, backend, args.time_tokens, args.time_hidden, args.time_experts,
                          args.time_topk, args.iters, device)
            flags = [None] * world
            dist.all_gather_object(flags, r["valid"])
            r["valid"] = all(flags)
            timing_rows(rec, say, [r], backend, world, args.time_tokens, args.time_hidden, args.time_experts,
                        args.time_topk, "torchrun", None)
            dist.barrier()
        return rec.finish(prog) if rank == 0 else 0


def main(argv=None) -> int:
    p = C.parser("bench_elastic.py", __doc__)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 32], help="EP sizes")
    p.add_argument("--layer-tokens", type=int, default=1024, help="tokens per rank for the layer counts")
    p.add_argument("--memory-prefill-tokens", type=int, nargs="+", default=[4096, 8192],
                   help="max tokens per rank of the prefill rows of the memory table")
    p.add_argument("--memory-decode-tokens", type=int, nargs="+", default=[128],
                   help="max tokens per rank of the decode rows of the memory table")
    p.add_argument("--memory-ranks", type=int, nargs="+", default=[8, 16, 32, 64], help="EP sizes of the memory table")
    p.add_argument("--launcher", choices=["spawn", "torchrun"], default="spawn",
                   help="timed section: spawn = forked CPU ranks over gloo; torchrun = one process per GPU (only the "
                        "timed section runs)")
    p.add_argument("--time-ranks", type=int, default=2, help="ranks forked for the timed section (spawn); 0: no timing")
    p.add_argument("--time-backends", nargs="+", choices=["torch", "symm"], default=["torch", "symm"],
                   help="backends of the timed section")
    p.add_argument("--time-tokens", type=int, default=4096, help="tokens per rank of the timed section")
    p.add_argument("--time-hidden", type=int, default=HIDDEN, help="hidden size of the timed section")
    p.add_argument("--time-experts", type=int, default=EXPERTS, help="experts of the timed section")
    p.add_argument("--time-topk", type=int, default=TOPK, help="top-k of the timed section")
    p.add_argument("--iters", type=int, default=10, help="timed iterations per call")
    args = p.parse_args(argv)
    prog = "bench_elastic.py"
    if args.cpu_smoke:
        C.smoke_defaults(args, p, argv, tokens=256, ranks=[8], layer_tokens=64, memory_ranks=[8, 16],
                         memory_prefill_tokens=[4096], time_tokens=16, time_hidden=256, time_experts=8,
                         time_topk=3, iters=2)
    if args.launcher == "torchrun":
        return main_torchrun(args, prog, argv)
    for name in ("tokens", "layer_tokens", "time_tokens", "time_hidden", "time_experts", "time_topk", "iters"):
        if getattr(args, name) < 1:
            return C.error(prog, f"--{name.replace('_', '-')} must be positive")
    if args.time_ranks < 0 or (args.time_ranks and args.time_experts % args.time_ranks) or args.time_hidden % 128:
        return C.error(prog, "--time-ranks must be >= 0 and divide --time-experts; --time-hidden a multiple of 128")
    if min(args.memory_prefill_tokens + args.memory_decode_tokens) < 1 or \
            any(r < 1 or (r > 8 and r % 8) for r in args.memory_ranks):
        return C.error(prog, "memory-table token counts must be positive and --memory-ranks at most 8 or multiples of "
                             "8 (8 GPUs per NVLink domain)")
    rec = C.Records("bench_elastic", args.json, args.cpu_smoke, device="cpu (counted)", argv=argv, method=C.COUNTED)
    memory_rows(rec, args.memory_prefill_tokens, args.memory_decode_tokens, args.memory_ranks)
    if args.time_ranks:  # before the counts: those initialise a process group in this process, the ranks fork
        from moe_ep.testing import launch

        print(C.table_header(["case", "metric", "slowest rank us (median)", "p10-p90 us", "vs Buffer", "check"]))
        for backend in args.time_backends:
            if backend == "symm" and os.environ.get("TRITON_INTERPRET") != "1":
                print("# symm: not timed on forked CPU ranks without the Triton interpreter (use --cpu-smoke or "
                      "TRITON_INTERPRET=1 on CPU, --launcher torchrun on GPUs)", flush=True)
                continue
            res = launch(time_rank, args.time_ranks, backend, args.time_tokens, args.time_hidden, args.time_experts,
                         args.time_topk, args.iters, timeout_s=1800)
            timing_rows(rec, print, res, backend, args.time_ranks, args.time_tokens, args.time_hidden,
                        args.time_experts, args.time_topk, "CPU, forked gloo ranks",
                        "CPU timing (forked gloo ranks on one machine): code paths and Python overhead, not GPU time")
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
    for ranks in args.ranks:
        case = f"dsv3 prefill layer T={args.layer_tokens} EP{ranks} (rank 0)"
        r = count_layer(args.layer_tokens, ranks)
        pk, pc, po, pr, pw = r["permute"]
        for path, label in (("expanded", ""), ("expanded+kernels", " (expand kernels: the CUDA path)")):
            ek, ec, eo, er, ew = r[path]
            rec.add(case + label, "layer launches (kernels + aten ops past the communication)", ek + eo, "launches",
                    baseline=pk + po, ratio=(ek + eo) / max(pk + po, 1), kernels=ek, aten_ops=eo, comm_calls=ec,
                    baseline_kernels=pk, baseline_aten_ops=po, baseline_comm_calls=pc)
            rec.add(case + label, "layer glue bytes (aten ops past the communication, read + written)", er + ew, "B",
                    baseline=pr + pw, ratio=(er + ew) / max(pr + pw, 1), read=er, written=ew, baseline_read=pr,
                    baseline_written=pw)
            print(f"| {case}{label} | launches: kernels + aten ops (comm calls) | {pk} + {po} ({pc}) | {ek} + {eo} "
                  f"({ec}) | {(ek + eo) / max(pk + po, 1):.2f} |")
            print(f"| {case}{label} | glue MB read + written | {pr / 1e6:.1f} + {pw / 1e6:.1f} | {er / 1e6:.1f} + "
                  f"{ew / 1e6:.1f} | {(er + ew) / max(pr + pw, 1):.2f} |")
    print(C.table_header(["case", "metric", "copying receive", "recv_as_view", "fused limit", "view / copy"]))
    for ranks in args.ranks:
        m, s, a = routing_counts(args.tokens, ranks)
        case = f"dsv3 prefill T={args.tokens} EP{ranks}"
        copy = symm_receive_copy_bytes(m)
        rec.add(case, "symm receive copy bytes (recv_as_view=True saves them)", 0, "B", baseline=copy, limit=0,
                ratio=0.0, recv_rows=m, note="counted: the copying receive's gather + unpack vs none with the view")
        expand = (s + a) * row  # the expansion reads each selection's row and writes the aligned layout
        rec.add(case, "symm expanded receive bytes after the link (read + written)", expand, "B",
                baseline=copy + expand, limit=a * row, ratio=expand / (copy + expand), recv_rows=m, selections=s,
                expanded_rows=a, note="counted: copy + expansion gather vs the gather from the view vs a fused kernel")
        print(f"| {case} | symm receive copy MB (rows {m}) | {copy / 1e6:.1f} | 0.0 | 0.0 | 0.00 |")
        print(f"| {case} | symm expanded receive MB after the link | {(copy + expand) / 1e6:.1f} | {expand / 1e6:.1f} "
              f"| {a * row / 1e6:.1f} | {expand / (copy + expand):.2f} |")
    return rec.finish(prog)


if __name__ == "__main__":
    sys.exit(main())
