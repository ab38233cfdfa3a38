"""``Buffer(backend="auto")``: the choice (moe_ep.backends.choose) on made-up topology facts, the once-only warning
of a low-latency Buffer left on the non-capturable ``torch`` backend, and the CPU / gloo case end to end."""

from __future__ import annotations

import warnings

import pytest

from moe_ep.backends import choose
from moe_ep.backends.choose import TopologyFacts, choose_backend
from moe_ep.testing import launch

ONE_NODE = TopologyFacts(cuda=True, num_nodes=1, peer_access=True)
NO_P2P = TopologyFacts(cuda=True, num_nodes=1, peer_access=False)
NODES = TopologyFacts(cuda=True, num_nodes=2, peer_access=True, nvshmem_usable=True)
NODES_NO_NVSHMEM = TopologyFacts(cuda=True, num_nodes=2, peer_access=True, nvshmem_usable=False)
CPU = TopologyFacts(cuda=False)


@pytest.mark.parametrize("facts,ll,nvl,rdma,want", [
    (ONE_NODE, True, 0, 1 << 20, "symm"),  # DeepEP decode Buffer on one node: capturable
    (ONE_NODE, True, 1 << 20, 1 << 20, "symm"),  # normal + low latency
    (ONE_NODE, False, 1 << 20, 0, "symm"),  # normal only
    (ONE_NODE, False, 0, 0, "torch"),  # normal mode without a size: symm could not run it
    (ONE_NODE, True, 1 << 20, 0, "torch"),  # low latency without num_rdma_bytes
    (NO_P2P, True, 0, 1 << 20, "torch"),
    (NODES, True, 0, 1 << 20, "nvshmem"),  # low-latency-only Buffer across nodes
    (NODES, True, 1 << 20, 1 << 20, "torch"),  # nvshmem has no normal mode in this release
    (NODES, False, 1 << 20, 0, "torch"),
    (NODES_NO_NVSHMEM, True, 0, 1 << 20, "torch"),
    (CPU, True, 1 << 20, 1 << 20, "torch"),  # CPU / gloo: always torch
])
def test_choose_backend(facts, ll, nvl, rdma, want):
    assert choose_backend(facts, low_latency_mode=ll, num_nvl_bytes=nvl, num_rdma_bytes=rdma) == want


def test_warning_once_names_the_capturable_backends(monkeypatch):
    monkeypatch.setattr(choose, "_warned", False)
    with pytest.warns(UserWarning, match="backend='symm'.*backend='nvshmem'") as rec:
        choose.warn_not_capturable(NODES_NO_NVSHMEM)
    assert "NVSHMEM is not usable" in str(rec[0].message) and "CUDA graph" in str(rec[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        choose.warn_not_capturable(NO_P2P)  # once per process: no second warning


def _auto_rank(rank: int, world: int) -> tuple:
    import moe_ep

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # CPU: torch without a warning (no CUDA graphs to lose)
        buf = moe_ep.Buffer(None, 0, 1 << 20, low_latency_mode=True)
    return buf.backend_name, choose.gather_facts(buf.group)


def test_auto_on_gloo_is_torch():
    import torch

    if torch.cuda.is_available():  # the machine decides, not the group: a gloo group on GPUs may get symm
        pytest.skip("a machine without CUDA: auto is torch there (the GPU choice: tests/test_setup_agreement.py)")
    assert launch(_auto_rank, 2, timeout_s=120) == [("torch", CPU)] * 2


def _fake_facts_rank(rank: int, world: int, facts: TopologyFacts) -> tuple:
    import moe_ep
    from moe_ep.backends.symm import SymmBackend

    choose.gather_facts = lambda group: facts  # this forked rank only
    choose._warned = False
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        buf = moe_ep.Buffer(None, 0, SymmBackend.get_low_latency_size_hint(2, 128, world, 4, 2), low_latency_mode=True)
    return buf.backend_name, [str(w.message) for w in rec if "cannot be captured" in str(w.message)]


def test_buffer_wires_the_choice_and_the_warning():
    # one node with peer access: the capturable symm backend (here on shared memory), no warning
    assert launch(_fake_facts_rank, 2, ONE_NODE, timeout_s=120) == [("symm", [])] * 2
    # across nodes without NVSHMEM: torch, and the warning once
    res = launch(_fake_facts_rank, 2, NODES_NO_NVSHMEM, timeout_s=120)
    assert [name for name, _ in res] == ["torch"] * 2 and all(len(w) == 1 for _, w in res)
