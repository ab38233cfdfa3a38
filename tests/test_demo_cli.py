"""``python -m moe_ep demo`` option errors: argparse conventions (usage, one line naming the option, exit 2)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")


@pytest.mark.parametrize("args,option", [
    (["--device", "cuda"], "--device"),
    (["--ranks", "0"], "--ranks"),
    (["--tokens", "0"], "--tokens"),
    (["--repeat", "0"], "--repeat"),
    (["--hidden", "100"], "--hidden"),
    (["--ranks", "3"], "--experts"),
    (["--topk-groups", "9"], "--topk-groups"),
    (["--intermediate", "100"], "--intermediate"),
])
def test_demo_bad_option(args, option):
    p = subprocess.run([sys.executable, "-m", "moe_ep", "demo", *args], cwd=ROOT, env=ENV, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert lines[0].startswith("usage:")
    assert lines[-1].startswith("python -m moe_ep demo: error: argument " + option), lines[-1]
    assert sum("error:" in ln for ln in lines) == 1


def test_demo_help_shows_defaults():
    p = subprocess.run([sys.executable, "-m", "moe_ep", "demo", "--help"], cwd=ROOT, env=ENV, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0
    assert "(default: 4)" in p.stdout
    text = " ".join(p.stdout.split())  # argparse wraps lines
    assert "--experts-impl fp8" in text and "--experts-impl torch" in text
    assert "--experts fp8" not in text and "--experts torch" not in text
    assert "(default 4)" not in text and "(default: None)" not in text
    for opt in text.split(" --")[1:]:   # each option's help states its default at most once
        assert opt.count("default") <= 1, opt


def test_bench_torch_a2a_cuda_without_gpu():
    p = subprocess.run([sys.executable, os.path.join(ROOT, "perf", "bench_torch_a2a.py"), "--device", "cuda"],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("bench_torch_a2a.py: error: argument --device")
