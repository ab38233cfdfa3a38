"""Set-up that cannot silently disagree: buffer sizes compared across ranks at creation (a mismatch is a
``CallMismatchError`` on every rank), a refused combine after a receive-view dispatch leaves every rank able to retry,
and ``backend="auto"`` decides from the machine (peer access asked of the driver, per physical device), logging its
choice on the ``"moe_ep"`` logger."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from moe_ep.backends import choose
from moe_ep.testing import launch

# Kernels on CPU tensors need the Triton interpreter (tests/conftest.py sets it where no GPU exists); on a
# GPU machine run this file with `TRITON_INTERPRET=1`.
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU ranks run the symm kernels in the Triton interpreter")

N, H, K, E = 3, 128, 2, 4


def _sizes_rank(rank, world, sizes):
    import moe_ep
    from moe_ep.sync import CallMismatchError

    try:
        moe_ep.Buffer(None, num_nvl_bytes=sizes[rank], backend="symm", provider="shm", timeout_s=20)
    except CallMismatchError as exc:
        return str(exc)
    return "created"


def test_buffer_sizes_compared_at_creation():
    # what is compared is what each rank maps: the size rounded up to 256 bytes (6000 -> 6144, 6400 -> 6400)
    msgs = launch(_sizes_rank, 2, (6400, 6000), timeout_s=120)
    assert all("ranks disagree on nbytes" in m and "rank 0=6400, rank 1=6144" in m for m in msgs), msgs
    assert launch(_sizes_rank, 2, (6400, 6400), timeout_s=120) == ["created"] * 2


def _rows_rank(rank, world, sizes):
    import moe_ep

    buf = moe_ep.Buffer(None, num_nvl_bytes=sizes[rank], backend="symm", provider="shm", timeout_s=20)
    g = torch.Generator().manual_seed(10 + rank)
    x = (torch.arange(N * H, dtype=torch.float32).view(N, H) / 64 + 100 * (rank + 1)).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)]).to(torch.int64)
    per_rank, _, per_exp, in_rank, _ = buf.get_dispatch_layout(idx, E)
    recv_x, _, _, _, _, _ = buf.dispatch(x, topk_idx=idx, topk_weights=torch.ones(N, K), num_tokens_per_rank=per_rank,
                                         is_token_in_rank=in_rank, num_tokens_per_expert=per_exp)
    return buf._impl.normal._dispatch_cap(H, K, 80, True), sorted(recv_x.float()[:, 0].tolist()), x, idx


def test_sizes_that_map_alike_carve_alike():
    # 6400 and 6300 bytes both map 6400: one per-source block size on both ranks, every row where it was sent
    res = launch(_rows_rank, 2, (6400, 6300), timeout_s=300)
    assert res[0][0] == res[1][0]
    for r in range(2):
        want = sorted(float(res[s][2][t, 0]) for s in range(2) for t in range(N)
                      if bool((res[s][3][t] // (E // 2) == r).any()))
        assert res[r][1] == want, (r, res[r][1], want)


def _refused_combine_rank(rank, world):
    import moe_ep
    from moe_ep.backends.symm import SymmBackend
    from moe_ep.sync import RemoteRankError

    buf = moe_ep.Buffer(None, num_nvl_bytes=SymmBackend.get_normal_size_hint(N, H, K, world), backend="symm",
                        provider="shm", timeout_s=10)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(N, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)]).to(torch.int64)
    w = torch.rand(N, K, generator=g)
    per_rank, _, per_exp, in_rank, _ = buf.get_dispatch_layout(idx, E)
    recv_x, _, r_w, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank,
                                                is_token_in_rank=in_rank, num_tokens_per_expert=per_exp,
                                                recv_as_view=True)
    y = recv_x.clone()
    with pytest.raises(TypeError if rank == 1 else RemoteRankError):  # rank 1 refuses: float32 rows
        buf.combine(y.float() if rank == 1 else y, handle, topk_weights=r_w)
    out, _, _ = buf.combine(y, handle, topk_weights=r_w)  # the retry, good inputs everywhere
    # and the Buffer goes on: a copying dispatch + combine of the same routing gives the same sums
    recv2, _, r_w2, _, handle2, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank,
                                                 is_token_in_rank=in_rank, num_tokens_per_expert=per_exp)
    out2, _, _ = buf.combine(recv2, handle2, topk_weights=r_w2)
    return torch.equal(out, out2)


def test_refused_combine_after_a_view_leaves_every_rank_able_to_retry():
    assert launch(_refused_combine_rank, 2, timeout_s=300) == [True, True]


class _Cuda:
    """torch.cuda as seen by one rank of 4 on one host: ``visible`` uuids, this rank's ``current``; P2P only
    between the pairs in ``p2p``."""

    def __init__(self, visible, current, p2p=()):
        self.visible, self.current, self.p2p, self.queries = visible, current, set(p2p), []

    def is_available(self):
        return True

    def current_device(self):
        return self.current

    def device_count(self):
        return len(self.visible)

    def get_device_properties(self, i):
        return type("P", (), {"uuid": self.visible[i]})()

    def can_device_access_peer(self, a, b):
        self.queries.append((a, b))
        return (a, b) in self.p2p or (b, a) in self.p2p


class _Dist:
    def __init__(self, reports):
        self.reports = reports

    def get_world_size(self, group):
        return len(self.reports)

    def all_gather_object(self, out, obj, group=None):
        for i in range(len(out)):  # the other ranks report their device; votes come back as this rank's own
            out[i] = self.reports[i] if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[0], str) else obj


@pytest.mark.parametrize("p2p,want", [((), False), (((0, 1), (0, 2), (0, 3)), True)])
def test_peer_access_is_queried_per_physical_device(monkeypatch, p2p, want):
    uuids = ["GPU-a", "GPU-b", "GPU-c", "GPU-d"]
    cuda = _Cuda(uuids, 0, p2p)
    monkeypatch.setattr(choose.torch, "cuda", cuda)
    monkeypatch.setattr(choose, "dist", _Dist([("node0", u) for u in uuids]))
    monkeypatch.setattr(choose.socket, "gethostname", lambda: "node0")
    facts = choose.gather_facts(None)
    assert sorted(cuda.queries) == [(0, 1), (0, 2), (0, 3)] and facts.peer_access is want


def test_peer_not_visible_here_counts_as_no_access(monkeypatch, caplog):
    # per-process CUDA_VISIBLE_DEVICES: every rank sees one device, cuda:0, each a different physical one
    cuda = _Cuda(["GPU-a"], 0)
    monkeypatch.setattr(choose.torch, "cuda", cuda)
    monkeypatch.setattr(choose, "dist", _Dist([("node0", u) for u in ["GPU-a", "GPU-b"]]))
    monkeypatch.setattr(choose.socket, "gethostname", lambda: "node0")
    with caplog.at_level(logging.INFO, logger="moe_ep"):
        facts = choose.gather_facts(None)
    assert not facts.peer_access and facts.cuda  # a gloo group or not: the machine has CUDA
    assert "not visible in this process" in caplog.text


def _logged_rank(rank, world):
    records = []

    class _H(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("moe_ep")
    logger.addHandler(_H())
    logger.setLevel(logging.INFO)
    import moe_ep

    buf = moe_ep.Buffer(None, 0, 0)
    return buf.backend_name, [m for m in records if "backend='auto'" in m]


def test_auto_logs_its_choice():
    if torch.cuda.is_available():
        pytest.skip("with CUDA, auto decides from the GPUs")
    for name, msgs in launch(_logged_rank, 2, timeout_s=120):
        choice = [m for m in msgs if "backend='auto') on rank" in m]  # the decision, with the facts it read
        assert name == "torch" and len(choice) == 1 and "'torch'" in choice[0] and "cuda=False" in choice[0], msgs
