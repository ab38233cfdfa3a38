"""Every file eplb writes survives a crash mid-write: the previous file is kept and still loads.

The crash is simulated inside the write (a serializer that writes half its bytes then dies) and after
it (the temporary file cut in half before the rename), and for `LoadRecorder.save` by killing a real
process mid-save."""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

import eplb
import eplb.files as efiles
import eplb.io as eio
from eplb.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Crash(BaseException):
    """Stands for the process dying: nothing catches it."""


def _placement(L=2):
    phy, l2p, cnt = eplb.rebalance_experts(np.arange(1, 17, dtype=float)[None].repeat(L, 0), 24, 1, 1, 8)
    return phy, l2p, cnt


def _recorder(n):
    rec = eplb.LoadRecorder(2, 16, window=4)
    rec.record_counts(0, torch.full((16,), n))
    rec.step()
    return rec


# name -> (write version n to path, load path -> comparable value, file suffix)
WRITERS = {
    "stats-npy": (lambda p, n: eio.save_stats(p, np.full((2, 16), n)), lambda p: eio.load_stats(p)[0, 0], ".npy"),
    "stats-pt": (lambda p, n: eio.save_stats(p, np.full((2, 16), n)), lambda p: eio.load_stats(p)[0, 0], ".pt"),
    "stats-json": (lambda p, n: eio.save_stats(p, np.full((2, 16), n)), lambda p: eio.load_stats(p)[0, 0], ".json"),
    "stats-csv": (lambda p, n: eio.save_stats(p, np.full((2, 16), n)), lambda p: eio.load_stats(p)[0, 0], ".csv"),
    "placement-json": (lambda p, n: eio.save_placement(p, *_placement(n), {"n": n}),
                       lambda p: eio.load_placement(p)[1]["n"], ".json"),
    "placement-pt": (lambda p, n: eio.save_placement(p, *_placement(n), {"n": n}),
                     lambda p: eio.load_placement(p)[1]["n"], ".pt"),
    "recorder": (lambda p, n: _recorder(n).save(p), lambda p: int(eplb.LoadRecorder.load(p).counts()[0, 0]), ".pt"),
    "cli-plan": (lambda p, n: _cli_plan(p, n), lambda p: eio.load_placement(p)[1]["num_replicas"] // 8, ".json"),
}


def _cli_plan(path, n):
    stats = os.path.join(os.path.dirname(path), "in.npy")
    np.save(stats, np.arange(1, 17)[None].repeat(2, 0))
    rc = main(["plan", stats, "--replicas", str(8 * n), "--gpus", "8", "-o", str(path), "--force",
               "--progress", "never"])
    assert rc == 0


def _leftovers(folder):
    return [f for f in os.listdir(folder) if f.startswith(".tmp-")]


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_crash_after_a_half_written_temp_file_keeps_the_previous(name, tmp_path, monkeypatch):
    write, read, ext = WRITERS[name]
    path = str(tmp_path / f"f{ext}")
    write(path, 2)
    assert read(path) == 2
    real_fsync = efiles._fsync

    def die(p, folder=False):
        if not folder and os.path.basename(p).startswith(".tmp-"):
            with open(p, "r+b") as f:  # the new content only half on disk
                f.truncate(os.path.getsize(p) // 2)
            raise Crash
        real_fsync(p, folder)
    monkeypatch.setattr(efiles, "_fsync", die)
    with pytest.raises(Crash):
        write(path, 3)
    monkeypatch.setattr(efiles, "_fsync", real_fsync)
    assert read(path) == 2
    write(path, 3)  # and the next write goes through
    assert read(path) == 3


@pytest.mark.parametrize("name", ["stats-pt", "placement-pt", "recorder", "stats-npy", "stats-json"])
def test_crash_inside_the_serializer_keeps_the_previous(name, tmp_path, monkeypatch):
    write, read, ext = WRITERS[name]
    path = str(tmp_path / f"f{ext}")
    write(path, 2)
    fn = {"stats-npy": (np, "save"), "stats-json": (json, "dump")}.get(name, (torch, "save"))
    real = getattr(*fn)

    def half_then_die(obj, f, *a, **k):
        import io
        buf = io.BytesIO() if "b" in getattr(f, "mode", "b") else io.StringIO()
        if fn[0] is np:
            real(buf, obj, *a, **k)
        else:
            real(obj, buf, *a, **k)
        f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
        f.flush()
        raise Crash
    if fn[1] == "save" and fn[0] is np:
        monkeypatch.setattr(np, "save", lambda f, arr, *a, **k: half_then_die(arr, f, *a, **k))
    else:
        monkeypatch.setattr(*fn, half_then_die)
    with pytest.raises(Crash):
        write(path, 3)
    monkeypatch.undo()
    assert read(path) == 2
    assert _leftovers(tmp_path) == []  # the temporary file is removed on the way out


def test_writer_fsyncs_file_and_folder(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd))[1])
    _recorder(1).save(tmp_path / "r.pt")
    assert any(os.path.basename(p).startswith(".tmp-") for p in synced), synced  # the new file, before the rename
    assert str(tmp_path) in synced, synced  # the folder, after it


def test_recorder_killed_mid_save_keeps_the_previous(tmp_path):
    path = tmp_path / "rec.pt"
    _recorder(2).save(path)
    code = f"""
import os, signal, torch, eplb
real = torch.save
def half_then_kill(obj, f, *a, **k):
    real(obj, f, *a, **k)
    f.flush(); f.truncate(f.tell() // 2); os.fsync(f.fileno())
    os.kill(os.getpid(), signal.SIGKILL)
torch.save = half_then_kill
rec = eplb.LoadRecorder(2, 16, window=4)
rec.record_counts(0, torch.full((16,), 3)); rec.step()
rec.save({str(path)!r})
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert r.returncode == -signal.SIGKILL
    assert int(eplb.LoadRecorder.load(path).counts()[0, 0]) == 2


def test_plan_outputs_all_or_none_when_a_later_write_fails(tmp_path, monkeypatch, capsys):
    # The second output (--pt) fails while being written (disk full): the -o file is not left behind
    # and the error names the user's path, not the temporary file.
    np.save(tmp_path / "in.npy", np.arange(1, 17)[None].repeat(2, 0))
    import errno
    real = efiles.tempfile.mkstemp
    calls = []

    def mkstemp(*a, **k):
        calls.append(1)
        fd, tmp = real(*a, **k)
        if len(calls) == 2:
            os.close(fd)
            os.unlink(tmp)
            raise OSError(errno.ENOSPC, "No space left on device", tmp)
        return fd, tmp
    monkeypatch.setattr(efiles.tempfile, "mkstemp", mkstemp)
    rc = main(["plan", str(tmp_path / "in.npy"), "--replicas", "24", "--gpus", "8", "-o", str(tmp_path / "o.json"),
               "--pt", str(tmp_path / "o.pt")])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert f"cannot write {tmp_path / 'o.pt'}: No space left on device" in err and ".tmp-" not in err, err
    assert sorted(os.listdir(tmp_path)) == ["in.npy"]
