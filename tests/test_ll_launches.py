"""Device work per low-latency call, counted on CPU in eager mode: the Triton launches (the interpreter's grid
executor, the entry point of every interpreted launch) and every torch op that reads or writes tensor memory
(fills, copies, arithmetic: ``TorchDispatchMode`` sees each ATen op; allocation, views and host reads of the status
word are not device work). The kernels write their own signal and signature words, so a phase is its send and
receive launches only, on both transports (the receives release their sources themselves)."""

from __future__ import annotations

import collections
import contextlib
import inspect
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

sys.path.insert(0, str(Path(__file__).parent))
from test_masking import _send, _virtual  # noqa: E402

# no device work: allocation, views / metadata, and the host's read of the status word (a scalar read on CPU)
_NOT_WORK = ("empty", "empty_strided", "view", "_unsafe_view", "transpose", "slice", "select", "as_strided", "alias",
             "t", "detach", "expand", "permute", "unsqueeze", "squeeze", "reshape", "lift_fresh", "_local_scalar_dense",
             "is_same_size", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "view_as", "unbind")


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__.rstrip("_")
        if name not in _NOT_WORK:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _counting(monkeypatch):
    from triton.runtime import interpreter

    launches = collections.Counter()
    orig = interpreter.GridExecutor.__call__

    def call(self, *args, **kwargs):
        launches[self.fn.__name__] += 1
        with _disable_current_modes():  # the interpreter's own host copies of the arguments are not the call's
            return orig(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", call)
    ops = _Ops()
    with ops:
        yield launches, ops.ops


@pytest.mark.parametrize("transport", ["symm", "nvshmem"])
def test_each_phase_is_its_kernels_only(monkeypatch, transport):
    R, T, H, E, K = 2, 3, 128, 4, 2
    paths = _virtual(R, T, H, E, K, transport, timeout_s=5, shrink=False)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(T, H, generator=g).to(torch.bfloat16) for _ in range(R)]
    idx = [torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) for _ in range(R)]
    w = torch.ones(T, K)
    for step in range(2):  # both double-buffer slots
        per = {}
        with _counting(monkeypatch) as (launches, ops):
            st = [_send(p, x, i, T, E) for p, x, i in zip(paths, xs, idx)]
        per["dispatch send"] = (dict(launches), dict(ops))
        with _counting(monkeypatch) as (launches, ops):
            res = [p.dispatch_recv(s) for p, s in zip(paths, st)]
        per["dispatch receive"] = (dict(launches), dict(ops))
        ys = [r.recv_x.to(torch.bfloat16) for r in res]  # (the caller's expert work: not counted)
        with _counting(monkeypatch) as (launches, ops):
            cs = [p.combine_send(y, i, w, r.handle) for p, y, i, r in zip(paths, ys, idx, res)]
        per["combine send"] = (dict(launches), dict(ops))
        with _counting(monkeypatch) as (launches, ops):
            outs = [p.combine_recv(c) for p, c in zip(paths, cs)]
        per["combine receive"] = (dict(launches), dict(ops))
        for phase, (launches, ops) in per.items():
            assert sum(launches.values()) == R, (phase, launches)  # one launch per rank and phase
            assert ops == {}, (phase, ops)  # no fill_, zero_, copy_ ... per call
        for r in range(R):  # (and the calls were right: every rank's token rows came back)
            assert torch.isfinite(outs[r].float()).all()


def test_send_splits_rule():
    from moe_ep.backends.symm_ll_layout import send_splits

    assert send_splits(7, 64, 132, 0) == 5  # FP8 H 7168 (7 tiles of 8 groups), 128 tokens: 64 blocks, ~2 per SM
    assert send_splits(4, 64, 132, 0) == 4  # BF16 (4 tiles of 2048 columns): one program per tile
    assert send_splits(7, 16, 132, 0) == 7 and send_splits(7, 512, 132, 0) == 1
    assert send_splits(7, 64, 132, 1) == 1 and send_splits(7, 0, 132, 0) == 1  # nvshmem; an empty batch


@pytest.mark.parametrize("transport,fp8,want", [("symm", True, 2), ("symm", False, 2), ("nvshmem", True, 1)])
def test_send_runs_column_splits_in_the_interpreter(monkeypatch, transport, fp8, want):
    # The interpreter launches the dispatch and combine sends with two column splits (two tiles, as if on 2 SMs), so
    # the split path is what every interpreted low-latency test checks bitwise; nvshmem stages whole rows: one.
    from triton.runtime import interpreter

    R, T, H, E, K = 2, 3, 256, 4, 2
    paths = _virtual(R, T, H, E, K, transport, timeout_s=5, shrink=False)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(T, H, generator=g).to(torch.bfloat16) for _ in range(R)]
    idx = [torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) for _ in range(R)]
    seen, combine_grids = [], []
    orig = interpreter.GridExecutor.__call__

    def call(self, *args, **kwargs):
        if self.fn.__name__ == "_ll_dispatch_send_kernel":
            a = dict(zip(inspect.signature(self.fn).parameters, args))
            seen.append((a["num_splits"], a["num_token_progs"]))
        if self.fn.__name__ == "_ll_combine_send_fmt_kernel":
            combine_grids.append(tuple(self.grid))
        return orig(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", call)
    st = [p.dispatch_send(x, i, T, E, use_fp8=fp8, round_scale=False, use_ue8m0=False)
          for p, x, i in zip(paths, xs, idx)]
    assert seen == [(want, want)] * R  # one token block of 3 tokens, `want` programs on it
    res = [p.dispatch_recv(s) for p, s in zip(paths, st)]
    assert all(int(r.recv_count.sum()) > 0 for r in res)
    # the combine send: a third grid axis over column tiles (two tiles of 128 at H 256), the same rule
    ys = [torch.randn(r.recv_x.shape, generator=g).to(torch.bfloat16) for r in res]
    cs = [p.combine_send(y, i, torch.ones(T, K), r.handle) for p, y, i, r in zip(paths, ys, idx, res)]
    outs = [p.combine_recv(c) for p, c in zip(paths, cs)]
    assert [gr[2] for gr in combine_grids] == [want] * R and all(torch.isfinite(o.float()).all() for o in outs)
