"""eplb.LoadRecorder: counting from top-k / counts / physical slots, the sliding window, save and load."""

import pytest
import torch

import eplb


def test_counts_and_window(tmp_path):
    rec = eplb.LoadRecorder(num_layers=2, num_experts=6, window=3)
    assert rec.counts().shape == (2, 6) and rec.counts(per_step=True).shape == (0, 2, 6)
    for step in range(5):
        rec.record_topk(0, torch.tensor([[step % 6, -1], [5, 7]]))  # -1 and out-of-range ids are ignored
        rec.record_counts(1, torch.tensor([1, 2]), offset=4)
        rec.step()
    per = rec.counts(per_step=True)
    assert per.shape == (3, 2, 6) and per.dtype == torch.int64
    # The window holds steps 2, 3, 4 (oldest first).
    assert per[:, 0, 5].tolist() == [1, 1, 1] and per[:, 0].sum(1).tolist() == [2, 2, 2]
    assert per[:, 0, 2:5].diagonal().tolist() == [1, 1, 1]
    assert rec.counts()[1].tolist() == [0, 0, 0, 0, 3, 6]
    assert rec.counts()[0, 5].item() == 3

    path = tmp_path / "rec.pt"
    rec.save(path)
    back = eplb.LoadRecorder.load(path)
    assert torch.equal(back.counts(per_step=True), per) and back.num_steps == 5
    back.record_topk(1, torch.tensor([[0, 1]]))
    back.step()
    assert back.counts(per_step=True)[-1, 1].tolist() == [1, 1, 0, 0, 0, 0]
    # The recorder's window feeds rebalance_experts directly.
    phy2log, _, _ = eplb.rebalance_experts(back.counts(per_step=True), 12, 1, 1, 4)
    assert phy2log.shape == (2, 12)


def test_record_physical():
    rec = eplb.LoadRecorder(1, 4, window=2)
    phy2log = torch.tensor([0, 1, 2, 3, 0, 0])
    rec.record_physical(0, torch.tensor([5, 1, 1, 1, 2, 3]), phy2log)
    rec.step()
    assert rec.counts()[0].tolist() == [10, 1, 1, 1]


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="window"):
        eplb.LoadRecorder(2, 4, window=0)
    rec = eplb.LoadRecorder(2, 4)
    with pytest.raises(ValueError, match="layer"):
        rec.record_topk(2, torch.zeros(1, 1, dtype=torch.int64))
    with pytest.raises(TypeError):
        rec.record_topk(0, torch.zeros(1, 1))
    with pytest.raises(ValueError, match="offset"):
        rec.record_counts(0, torch.ones(3), offset=2)
    bad = tmp_path / "bad.pt"
    torch.save({"x": torch.zeros(1)}, bad)
    with pytest.raises(ValueError, match="not a LoadRecorder"):
        eplb.LoadRecorder.load(bad)


def test_record_physical_ignores_empty_and_out_of_range_slots():
    rec = eplb.LoadRecorder(1, 4, window=2)
    phy2log = torch.tensor([0, -1, 2, 4, 3, 7])  # -1: empty slot; 4, 7 >= num_experts
    rec.record_physical(0, torch.tensor([5, 100, 1, 200, 2, 300]), phy2log)
    rec.step()
    assert rec.counts()[0].tolist() == [5, 0, 1, 2]
