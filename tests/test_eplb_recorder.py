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


def test_save_writes_only_recorded_steps_in_the_smallest_dtype(tmp_path):
    rec = eplb.LoadRecorder(58, 256, window=1000)  # a 119 MB ring buffer
    rec.record_topk(3, torch.tensor([[1, 2], [2, 255]]))
    rec.step()
    rec.record_counts(4, torch.tensor([7]), offset=9)  # the open step is kept too
    path = tmp_path / "rec.pt"
    rec.save(path)
    assert path.stat().st_size < 100_000, path.stat().st_size
    state = torch.load(path, weights_only=True)
    assert state["steps"].dtype == torch.uint8 and state["steps"].shape == (2, 58, 256)
    back = eplb.LoadRecorder.load(path)
    assert back.num_steps == 1 and back.window == 1000 and torch.equal(back.buffer, rec.buffer)


@pytest.mark.parametrize("values, dtype", [([0, 254], torch.uint8), ([-1, 5], torch.int8), ([0, 300], torch.int16),
                                           ([0, 2**31], torch.int64), ([-2**20, 0], torch.int32)])
def test_save_load_round_trip_exact(values, dtype, tmp_path):
    rec = eplb.LoadRecorder(2, 3, window=2)
    for step in range(5):  # wraps the ring
        rec.record_counts(step % 2, torch.tensor(values) + step % 2, offset=1)
        rec.step()
    rec.record_counts(1, torch.tensor(values[:1]))
    rec.save(tmp_path / "r.pt")
    state = torch.load(tmp_path / "r.pt", weights_only=True)
    assert state["steps"].dtype == dtype
    back = eplb.LoadRecorder.load(tmp_path / "r.pt")
    assert back.num_steps == 5
    assert torch.equal(back.counts(per_step=True), rec.counts(per_step=True))
    assert torch.equal(back._cur, rec._cur)  # the open step
    back.step()
    rec.step()
    assert torch.equal(back.counts(per_step=True), rec.counts(per_step=True))


def test_load_reads_the_old_whole_buffer_layout(tmp_path):
    rec = eplb.LoadRecorder(1, 2, window=2)
    rec.record_counts(0, torch.tensor([1, 2]))
    rec.step()
    torch.save({"num_layers": 1, "num_experts": 2, "window": 2, "num_steps": 1, "buffer": rec.buffer}, tmp_path / "v1.pt")
    assert torch.equal(eplb.LoadRecorder.load(tmp_path / "v1.pt").counts(), rec.counts())


def _good_state():
    rec = eplb.LoadRecorder(2, 4, window=3)
    rec.record_counts(0, torch.tensor([1, 2, 3, 4]))
    rec.step()
    return rec.state_dict()


@pytest.mark.parametrize("make", [
    lambda p: p.write_bytes(b""),
    lambda p: p.write_bytes(b"garbage, not a torch file"),
    lambda p: (torch.save(_good_state(), p), p.write_bytes(p.read_bytes()[:200])),  # truncated
    lambda p: (torch.save(_good_state(), p), p.write_bytes(p.read_bytes()[:-30])),  # truncated end
    lambda p: torch.save([1, 2, 3], p),
    lambda p: torch.save({**_good_state(), "steps": torch.zeros(5, 2, 4, dtype=torch.uint8)}, p),  # wrong shape
    lambda p: torch.save({**_good_state(), "steps": torch.zeros(2, 2, 4)}, p),  # float
    lambda p: torch.save({**_good_state(), "window": 0}, p),
    lambda p: torch.save({**_good_state(), "num_steps": -1}, p),
    lambda p: torch.save({k: v for k, v in _good_state().items() if k != "steps"}, p),
])
def test_load_rejects_bad_files_with_value_error(make, tmp_path):
    path = tmp_path / "bad.pt"
    make(path)
    with pytest.raises(ValueError, match="bad.pt is not a LoadRecorder file"):
        eplb.LoadRecorder.load(path)
    with pytest.raises(FileNotFoundError):
        eplb.LoadRecorder.load(tmp_path / "missing.pt")
