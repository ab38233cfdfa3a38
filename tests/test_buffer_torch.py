"""moe_ep.Buffer(backend="torch") against the single-process references, on 1-8 gloo ranks."""

import zlib

import pytest

from moe_ep.testing import launch
from moe_ep.testing.suite import check_buffer_case

CASES = [
    # world, tokens per rank, hidden, experts, topk, routing, extras
    (1, 7, 128, 4, 2, "random", {}),
    (2, 0, 128, 4, 2, "random", {"T": 4}),
    (2, 1, 256, 2, 1, "random", {"worst": 8}),
    (2, 129, 128, 8, 4, "random", {"align": 4, "worst": 300}),
    (2, [5, 0], 384, 64, 8, "random", {}),
    (4, 7, 128, 16, 8, "random", {"align": 128}),
    (4, [3, 9, 1, 0], 7168, 8, 4, "skip_last_rank", {"T": 12}),
    (4, 7, 256, 128, 8, "one_expert", {"worst": 40}),
    (8, [1, 2, 3, 4, 5, 6, 7, 8], 128, 16, 8, "random", {"T": 9}),
    (8, 7, 192, 8, 3, "skip_last_rank", {}),  # hidden 192: BF16 only (no FP8 / low-latency)
]


@pytest.mark.parametrize("world,n,hidden,E,k,routing,extra", CASES,
                         ids=[f"R{c[0]}-N{c[1]}-H{c[2]}-E{c[3]}-K{c[4]}-{c[5]}" for c in CASES])
def test_dispatch_combine(world, n, hidden, E, k, routing, extra):
    case = dict(seed=zlib.crc32(repr((world, n, hidden, E, k, routing)).encode()) % 10007, n=n, hidden=hidden, E=E, k=k,
                routing=routing, **extra)
    assert launch(check_buffer_case, world, case, "torch", timeout_s=240) == [True] * world


@pytest.mark.gpu
@pytest.mark.parametrize("world,n,hidden,E,k,routing,extra", CASES[:4] + [(1, 4096, 7168, 256, 8, "random", {"T": 4096})],
                         ids=lambda v: str(v))
def test_dispatch_combine_gpu(world, n, hidden, E, k, routing, extra):
    """Same checks on CUDA tensors with NCCL (one GPU per rank; needs `world` GPUs), async_finish on."""
    import subprocess

    n_gpu = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.count("GPU ")
    if n_gpu < world:
        pytest.skip(f"needs {world} GPUs")
    case = dict(seed=11, n=n, hidden=hidden, E=E, k=k, routing=routing, device="cuda", **extra)
    assert launch(check_buffer_case, world, case, "torch", timeout_s=600, backend="nccl") == [True] * world


@pytest.mark.parametrize("n,E,R,k", [(0, 16, 2, 4), (1, 4, 4, 1), (37, 64, 8, 8), (16, 16, 2, 4), (9, 256, 8, 8)])
def test_host_routing_math_equals_the_device_ops(n, E, R, k):
    """Host tensors take numpy for the layout and the top-k value flags; the torch ops (the GPU path) give the
    same values, -1 holes, duplicates and out-of-range ids included."""
    import torch

    from moe_ep import topk_layout as TL
    from moe_ep import validate as V

    g = torch.Generator().manual_seed(n * 1000 + E)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)]) if n else torch.empty(0, k).long()
    if n:
        idx[torch.rand(n, k, generator=g) < 0.3] = -1
        idx[0] = -1
    for got, want in zip(TL._layout_host(idx, E, R), TL._layout_torch(idx, E, R)):
        assert got.dtype == want.dtype and torch.equal(got, want)
    if not n:
        return
    cases = [idx]
    for bad in (E, E + 5, -2):
        c = idx.clone()
        c[n // 2, k - 1] = bad
        cases.append(c)
    if k > 1:
        c = idx.clone()
        c[n - 1, 0] = c[n - 1, 1] = E - 1
        cases.append(c)
        c = idx.clone()
        c[n - 1, 0] = c[n - 1, 1] = -1  # two holes are not a duplicate
        cases.append(c)
    for c in cases:
        assert V._topk_flags_host(c, E).tolist() == V._topk_flags_torch(c, E).tolist(), c


@pytest.mark.parametrize("m", [0, 1, 2, 37])
def test_host_row_packing_equals_the_device_ops(m, monkeypatch):
    """The dispatch's packing and unpacking helpers give the same tensors on the numpy (host) path and on the torch
    ops a device runs (forced on CPU tensors here): byte fields, one-row and empty receives included."""
    import torch

    from moe_ep.backends import torch_rows as TA

    g = torch.Generator().manual_seed(m)
    k, L, rank = 4, 8, 1
    recv = torch.randint(0, 256, (m, 7 + 4 + 12 * k), dtype=torch.uint8, generator=g)
    ids = torch.randint(-1, 3 * L, (m, k), generator=g)
    recv[:, 11:11 + 8 * k] = ids.view(torch.uint8).view(m, 8 * k) if m else recv[:, 11:11 + 8 * k]
    recv[:, 11 + 8 * k:] = torch.rand(m, k, generator=g).view(torch.uint8).view(m, 4 * k) if m else recv[:, 11 + 8 * k:]
    in_rank = torch.rand(m, 4, generator=g) < 0.5
    cols = [recv[:, :7].contiguous(), recv[:, 7:].contiguous()]
    idx = torch.randint(0, max(m, 1), (3 * m,), generator=g)

    def run():
        local, w = TA.localize_topk(recv, 11, k, rank, L)
        return (TA._from_bytes(recv[:, 7:11], torch.int32, 1), TA._from_bytes(recv[:, 3:7], torch.float16, 2),
                local, w, torch.tensor(TA._count_local(local, L)), TA._rows_by_rank(in_rank),
                TA._gather_rows(cols, idx) if m else None)

    host = run()
    monkeypatch.setattr(TA, "_on_host", lambda t: False)
    device = run()
    for got, want in zip(host, device):
        if want is None:
            continue
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.view(torch.uint8) if got.dtype.is_floating_point else got,
                           want.view(torch.uint8) if want.dtype.is_floating_point else want)
    if m:
        assert (host[2] == -1).any() and (host[2] >= 0).any()  # ids both here and elsewhere were exercised
