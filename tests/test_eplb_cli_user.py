"""python3 -m eplb run as a user runs it (subprocesses): bad files and bad numbers give exactly one
`error:` line on stderr, exit 2, no traceback, no stdout and no output file; outputs are all or none;
a closed pipe exits quietly; no command shows usage. The subprocesses run four at a time."""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAN = ["--replicas", "24", "--gpus", "8", "--nodes", "2", "--groups", "4"]


def _files(d):
    """Input files, written once: good ones and every kind of bad one."""
    w = np.random.default_rng(0).integers(0, 100, size=(2, 16))
    np.save(d / "good.npy", w)
    good_pt = d / "good.pt"
    torch.save(torch.from_numpy(w), good_pt)
    placement = {"meta": {"num_gpus": 8}, "phy2log": [list(range(16)) + list(range(8))] * 2}
    (d / "good.json").write_text(json.dumps(placement))
    (d / "corrupt.pt").write_bytes(b"\x80\x04 this is not a torch file at all")
    (d / "trunc.pt").write_bytes(good_pt.read_bytes()[: len(good_pt.read_bytes()) // 2])
    (d / "trunc.npy").write_bytes((d / "good.npy").read_bytes()[:150])
    (d / "garbage.npy").write_bytes(b"\x93NUMPY\x01\x00garbage")
    (d / "noheader.npy").write_bytes(b"not an array at all")
    np.save(d / "objects.npy", np.array([{"a": 1}, None], dtype=object))
    (d / "garbage.json").write_text("{not json")
    (d / "deep.json").write_text("[" * 200_000)
    (d / "binary.csv").write_bytes(bytes(range(256)) * 4)
    (d / "hugefield.csv").write_text("1," + "9" * 200_000 + "\n3,4\n")  # field > csv's 131072 limit
    torch.save({"x": torch.zeros(2, 16)}, d / "wrongkeys.pt")
    np.save(d / "wrongshape.npy", np.ones(16))
    torch.save({"num_layers": 2, "num_experts": 16, "window": 4, "num_steps": 1,
                "steps": torch.zeros(9, 2, 16, dtype=torch.uint8)}, d / "badrecorder.pt")
    torch.save({"phy2log": torch.zeros(24, dtype=torch.int64), "meta": {"num_gpus": 8}}, d / "place1d.pt")
    (d / "placekeys.json").write_text(json.dumps({"foo": 1}))
    (d / "placemeta.json").write_text(json.dumps({"phy2log": [[0] * 24] * 2, "meta": {"num_gpus": 0}}))
    (d / "placement255.json").write_text(json.dumps({"meta": {"num_gpus": 8}, "phy2log": [list(range(24))] * 2}))
    (d / "folder.npy").mkdir()
    (d / "exists.json").write_text("{}")


# (case id, argv (paths relative to the folder), text the error must contain)
BAD = [
    ("corrupt-pt", ["plan", "corrupt.pt", *PLAN, "-o", "o.json"], "corrupt.pt"),
    ("truncated-pt", ["plan", "trunc.pt", *PLAN, "-o", "o.json"], "trunc.pt"),
    ("truncated-npy", ["plan", "trunc.npy", *PLAN, "-o", "o.json"], "trunc.npy"),
    ("garbage-npy", ["plan", "garbage.npy", *PLAN, "-o", "o.json"], "garbage.npy"),
    ("garbage-json", ["plan", "garbage.json", *PLAN, "-o", "o.json"], "garbage.json"),
    ("deep-json", ["plan", "deep.json", *PLAN, "-o", "o.json"], "deep.json"),
    ("binary-csv", ["plan", "binary.csv", *PLAN, "-o", "o.json"], "binary.csv"),
    ("huge-csv-field", ["plan", "hugefield.csv", *PLAN, "-o", "o.json"], "field larger than field limit"),
    ("wrong-keys-pt", ["plan", "wrongkeys.pt", *PLAN, "-o", "o.json"], "wrongkeys.pt"),
    ("wrong-shape", ["plan", "wrongshape.npy", *PLAN, "-o", "o.json"], "shape"),
    ("bad-recorder", ["plan", "badrecorder.pt", *PLAN, "-o", "o.json"], "not a LoadRecorder file"),
    ("previous-truncated", ["plan", "good.npy", *PLAN, "--previous", "trunc.pt", "-o", "o.json"], "trunc.pt"),
    ("report-corrupt-placement", ["report", "good.npy", "corrupt.pt"], "corrupt.pt"),
    ("report-placement-keys", ["report", "good.npy", "placekeys.json"], "phy2log"),
    ("report-placement-1d", ["report", "good.npy", "place1d.pt"], "place1d.pt"),
    ("report-meta-gpus-0", ["report", "good.npy", "placemeta.json"], "num_gpus"),
    ("report-truncated-stats", ["report", "trunc.npy", "good.json"], "trunc.npy"),
    # numpy's allow_pickle advice and float() messages never reach the user
    ("noheader-npy", ["plan", "noheader.npy", *PLAN, "-o", "o.json"], "not a NumPy .npy file"),
    ("object-npy", ["plan", "objects.npy", *PLAN, "-o", "o.json"], "Python objects, not numbers"),
    ("stats-is-placement-json", ["report", "good.json", "good.json"], "good.json: this is a placement file"),
    ("stats-is-placement-pt", ["plan", "place1d.pt", *PLAN, "-o", "o.json"], "place1d.pt: this is a placement file"),
    ("stats-json-strings", ["plan", "placekeys.json", *PLAN, "-o", "o.json"], "counts"),
    # Numeric options: checked before any work or output, argparse style (the option named).
    ("report-gpus-0", ["report", "good.npy", "good.json", "--gpus", "0"], "argument --gpus"),
    ("report-gpus-negative", ["report", "good.npy", "good.json", "--gpus", "-4"], "argument --gpus"),
    ("plan-gpus-0", ["plan", "good.npy", "--replicas", "24", "--gpus", "0", "-o", "o.json"], "argument --gpus"),
    ("plan-replicas-negative", ["plan", "good.npy", "--replicas", "-24", "--gpus", "8", "-o", "o.json"],
     "argument --replicas"),
    ("plan-nodes-0", ["plan", "good.npy", *PLAN, "--nodes", "0", "-o", "o.json"], "argument --nodes"),
    ("plan-groups-negative", ["plan", "good.npy", *PLAN, "--groups", "-1", "-o", "o.json"], "argument --groups"),
    ("plan-cap-0", ["plan", "good.npy", *PLAN, "--max-replicas-per-expert", "0", "-o", "o.json"],
     "argument --max-replicas-per-expert"),
    ("plan-hedge-nan", ["plan", "good.npy", *PLAN, "--hedge", "nan", "-o", "o.json"], "argument --hedge"),
    ("plan-stickiness-negative", ["plan", "good.npy", *PLAN, "--stickiness", "-0.1", "-o", "o.json"],
     "argument --stickiness"),
    ("simulate-tokens-0", ["simulate", "-o", "s.npy", "--tokens", "0"], "argument --tokens"),
    ("simulate-steps-negative", ["simulate", "-o", "s.npy", "--steps", "-2"], "argument --steps"),
    ("simulate-seed-negative", ["simulate", "-o", "s.npy", "--seed", "-1"], "argument --seed"),
    # Input files that are not there or not files, named plainly (no errno, no "file type").
    ("missing-stats", ["plan", "missing.npy", *PLAN, "-o", "o.json"], "statistics file missing.npy does not exist"),
    ("missing-folder", ["report", "good.npy", "gone/p.json"], "placement file gone/p.json does not exist (its folder"),
    ("folder-as-stats", ["plan", "folder.npy", *PLAN, "-o", "o.json"], "folder.npy is a folder"),
    # Shapes against --layers / --experts, GPUs over nodes, a placement for another expert count
    ("plan-experts-mismatch", ["plan", "good.npy", *PLAN, "--experts", "256", "-o", "o.json"],
     "good.npy has 16 experts"),
    ("report-layers-mismatch", ["report", "good.npy", "good.json", "--layers", "58"], "good.npy has 2 layers"),
    ("plan-gpus-over-nodes", ["plan", "good.npy", *PLAN, "--nodes", "3", "-o", "o.json"], "--nodes 3"),
    ("report-expert-mismatch", ["report", "good.npy", "placement255.json"], "placement255.json places expert ids"),
    # An existing output is replaced only with --force
    ("plan-exists", ["plan", "good.npy", *PLAN, "-o", "exists.json"], "exists.json exists; pass --force"),
    ("simulate-exists", ["simulate", "-o", "good.npy"], "good.npy exists; pass --force"),
    # All outputs or none: the .pt / .png go to a folder that does not exist; the error names it.
    ("plan-pt-unwritable", ["plan", "good.npy", *PLAN, "-o", "o.json", "--pt", "nodir/o.pt"], "nodir/o.pt"),
]


def _run(d, argv, stdout=subprocess.PIPE):
    return subprocess.run([sys.executable, "-m", "eplb", *argv], cwd=d, stdout=stdout, stderr=subprocess.PIPE,
                          text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)


# Run as subprocesses (a process costs seconds here: torch's import); the rest run main() in-process.
SUBPROCESS = {"corrupt-pt", "huge-csv-field", "report-gpus-0", "plan-pt-unwritable"}


class _Result:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def _run_in_process(d, argv):
    import contextlib
    import io

    from eplb.cli import main
    out, err = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    os.chdir(d)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(argv)
    finally:
        os.chdir(cwd)
    return _Result(rc, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory):
    """Every BAD case in its own copy of the input folder; the subprocess ones four at a time."""
    base = tmp_path_factory.mktemp("cli")
    dirs = []
    for name, _, _ in BAD:
        d = base / name
        d.mkdir()
        _files(d)
        dirs.append((d, sorted(os.listdir(d))))
    sub = [i for i, b in enumerate(BAD) if b[0] in SUBPROCESS]
    with ThreadPoolExecutor(4) as pool:
        results = dict(zip(sub, pool.map(lambda i: _run(dirs[i][0], BAD[i][1]), sub)))
    for i, b in enumerate(BAD):
        if i not in results:
            results[i] = _run_in_process(dirs[i][0], b[1])
    return {b[0]: (results[i], *dirs[i]) for i, b in enumerate(BAD)}


def test_subprocess_cases_exist():
    assert SUBPROCESS <= {b[0] for b in BAD}


@pytest.mark.parametrize("name, argv, match", BAD, ids=[b[0] for b in BAD])
def test_bad_input_one_error_line_exit_2(bad_runs, name, argv, match):
    r, d, before = bad_runs[name]
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
    assert match in r.stderr, r.stderr
    assert "allow_pickle" not in r.stderr and "float()" not in r.stderr, r.stderr
    assert ".tmp-" not in r.stderr  # never an internal temporary name
    assert r.stdout == ""
    assert sorted(os.listdir(d)) == before, "no output file (not even the -o one)"


def test_plan_writes_all_outputs_and_names_the_png(tmp_path):
    _files(tmp_path)
    try:
        import matplotlib  # noqa: F401
        outs = ["o.json", "o.pt", "o.png"]
    except ImportError:
        outs = ["o.json", "o.pt"]
    argv = ["plan", "good.npy", *PLAN, "-o", "o.json", "--pt", "o.pt"] + (["--png", "o.png"] if len(outs) == 3 else [])
    r = _run_in_process(tmp_path, argv)
    assert r.returncode == 0, r.stderr
    assert "written " + ", ".join(outs) in r.stdout
    assert set(outs) <= set(os.listdir(tmp_path))
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp-")]


def test_closed_pipe_exits_quietly(tmp_path):
    _files(tmp_path)
    # The reader is gone before the summary is printed (as with `| head` on a long report).
    p = subprocess.Popen([sys.executable, "-m", "eplb", "plan", "good.npy", *PLAN, "-o", "o.json"], cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": ROOT})
    p.stdout.close()
    err = p.stderr.read().decode()
    p.wait(timeout=120)
    assert err == "" and p.returncode == 141, (p.returncode, err)
    assert (tmp_path / "o.json").exists()  # the work was done and written


def test_report_mismatch_names_both_files(bad_runs):
    r = bad_runs["report-expert-mismatch"][0]
    assert "placement255.json" in r.stderr and "good.npy" in r.stderr, r.stderr


def test_force_replaces_and_plan_says_the_policy_per_layer(tmp_path):
    _files(tmp_path)
    r = _run_in_process(tmp_path, ["plan", "good.npy", *PLAN, "-o", "exists.json", "--force", "--policy", "hierarchical"])
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "exists.json").read_text())["phy2log"]
    assert "hierarchical (each group on one node) on 2 of 2 layers (0-1)" in r.stdout, r.stdout
    r = _run_in_process(tmp_path, ["plan", "good.npy", *PLAN, "-o", "g.json", "--policy", "global"])
    phy = np.array(json.loads((tmp_path / "g.json").read_text())["phy2log"])
    # read back from the placement itself: a layer keeps each group (16 experts / 4) on one node (24 slots / 2)
    kept = [all(len({p // 12 for p in np.flatnonzero(phy[layer] // 4 == g)}) == 1 for g in range(4)) for layer in range(2)]
    for name, want in (("hierarchical", sum(kept)), ("global", 2 - sum(kept))):
        if want:
            assert f"{name} (" in r.stdout and f"on {want} of 2 layers" in r.stdout, r.stdout
    r = _run_in_process(tmp_path, ["plan", "good.npy", "--replicas", "24", "--gpus", "8", "--nodes", "2", "-o", "one.json"])
    assert "--groups 1 does not divide over --nodes 2" in r.stdout and "on 2 of 2 layers" in r.stdout, r.stdout


def test_all_zero_loads_warn(tmp_path):
    np.save(tmp_path / "zero.npy", np.zeros((2, 16)))
    r = _run_in_process(tmp_path, ["plan", "zero.npy", *PLAN, "-o", "z.json"])
    assert r.returncode == 0 and r.stderr.startswith("warning: zero.npy: every load is zero"), r.stderr
    w = np.ones((2, 16))
    w[1] = 0
    np.save(tmp_path / "onezero.npy", w)
    r = _run_in_process(tmp_path, ["report", "onezero.npy", "z.json", "--gpus", "8"])
    assert r.returncode == 0 and "1 of 2 layers have zero load (layers 1)" in r.stderr, r.stderr


def test_version():
    r = _run(ROOT, ["--version"])
    assert r.returncode == 0 and r.stdout.split()[-1] == __import__("eplb").__version__, r.stdout + r.stderr


def test_no_command_shows_usage(tmp_path):
    r = _run(tmp_path, [])
    assert r.returncode == 2 and "usage: python -m eplb" in r.stderr and "{plan,report,simulate}" in r.stderr
    assert "cmd" not in r.stderr.replace("COMMAND", "") and "Traceback" not in r.stderr
    assert r.stderr.splitlines()[-1].startswith("error: ")


def test_readme_eplb_bash_lines_paste():
    # Every line of the bash blocks in the eplb page (docs/eplb.md) is a command the parser accepts as it
    # stands (no usage brackets such as "[--png load.png]") or a comment.
    import re
    import shlex

    from eplb.cli import _parser
    text = open(os.path.join(ROOT, "docs", "eplb.md")).read()
    section = text[text.index("## Expert placement (`eplb`)"):]
    section = section[: section.index("\n## ", 1)] if "\n## " in section[1:] else section
    lines = [ln for block in re.findall(r"```bash\n(.*?)```", section, re.S) for ln in block.splitlines()]
    commands = [ln for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    assert len(commands) >= 3
    for ln in commands:
        words = shlex.split(ln)
        assert words[:3] == ["python", "-m", "eplb"], ln
        assert not any(w.startswith("[") or w.endswith("]") for w in words), ln
        _parser().parse_args(words[3:])  # raises (CliError) on anything the CLI would reject
