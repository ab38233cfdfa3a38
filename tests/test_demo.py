import os

import pytest

from moe_ep.__main__ import main as cli_main
from moe_ep.demo import main


@pytest.mark.parametrize("backend", ["torch", pytest.param("symm", marks=pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="symm kernels on CPU ranks need the Triton interpreter"))])
def test_demo_runs_and_matches_dense(capsys, backend):
    assert main(["--ranks", "2", "--tokens", "9", "--hidden", "256", "--intermediate", "128", "--experts", "16",
                 "--repeat", "1", "--device", "cpu", "--backend", backend]) == 0
    out = capsys.readouterr().out
    assert f"backend={backend}" in out
    assert out.count("OK") == 2 and "MISMATCH" not in out
    assert "normal: dispatch (FP8)" in out and "low-latency: combine (BF16)" in out


def test_cli_help_and_unknown(capsys):
    assert cli_main([]) == 2
    assert cli_main(["nope"]) == 2
    assert cli_main(["--help"]) == 0
