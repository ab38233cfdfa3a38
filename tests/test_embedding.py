"""What an engine embedding moe-ep and a user at a shell meet: ``--version`` and the program name on every command
line, one line (not a traceback) without torch, a quiet closed pipe, one error base class beside the standard ones,
the packages' loggers (the backend choice at INFO) and no ``print`` in library code."""

from __future__ import annotations

import ast
import importlib
import logging
import os
import pathlib
import re
import subprocess
import sys

import pytest

from moe_ep.testing import launch

ROOT = pathlib.Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _setup_version() -> str:
    return re.search(r'version="([^"]+)"', (ROOT / "setup.py").read_text()).group(1)


@pytest.mark.parametrize("module", ["moe_ep", "eplb", "serving", "moe_ep.alias"])
def test_version_everywhere(module):
    p = subprocess.run([sys.executable, "-m", module, "--version"], cwd=ROOT, env=ENV, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert _setup_version() in p.stdout.split() and p.stdout.count("\n") == 1, p.stdout
    top = module.split(".")[0]
    assert importlib.import_module(top).__version__ == _setup_version()
    assert importlib.import_module("microbatch").__version__ == _setup_version()


@pytest.mark.parametrize("script, target", [("moe-ep", "moe_ep.__main__"), ("moe-ep-eplb", "eplb.cli"),
                                            ("moe-ep-serving", "serving.__main__")])
def test_console_script_help_names_itself(script, target):
    # what pip's console-script wrapper does: argv[0] is the script's path, then main()
    code = f"import sys; sys.argv[0] = '/venv/bin/{script}'; from {target} import main; sys.exit(main(['--help']))"
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(f"usage: {script} "), p.stdout


@pytest.mark.parametrize("argv", [["-m", "moe_ep", "demo"], ["-m", "eplb", "--help"], ["-m", "moe_ep.alias", "x.py"],
                                  ["-c", "import sys; sys.argv[0] = '/venv/bin/moe-ep-eplb'; import eplb.cli"]])
def test_without_torch_one_line(argv):
    # -S: no site-packages, so neither torch nor numpy (the checkout comes from PYTHONPATH)
    p = subprocess.run([sys.executable, "-S", *argv], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr and p.stderr.count("\n") == 1, p.stderr
    assert "torch" in p.stderr and "scripts/setup.sh" in p.stderr, p.stderr


def test_without_numpy_serving_one_line_and_imports_raise():
    p = subprocess.run([sys.executable, "-S", "-m", "serving", "--help"], cwd=ROOT, env=ENV, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "numpy" in p.stderr, p.stderr
    p = subprocess.run([sys.executable, "-S", "-c", "import eplb"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 1 and "ModuleNotFoundError: moe-ep needs torch" in p.stderr, p.stderr  # a library import


def test_alias_help_into_a_closed_pipe_is_quiet():
    p = subprocess.run(f"{sys.executable} -m moe_ep.alias --help | head -1", shell=True, cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=120)
    assert p.stdout.startswith("usage: "), p.stdout
    assert "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr, p.stderr


def _error_classes():
    """Every exception class defined in our packages' modules (imported where that needs no GPU)."""
    found = {}
    for pkg in ("moe_ep", "eplb", "microbatch", "serving"):
        for path in (ROOT / pkg).rglob("*.py"):
            tree = ast.parse(path.read_text())
            names = [n.name for n in tree.body if isinstance(n, ast.ClassDef)]
            if not names:
                continue
            mod = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            module = importlib.import_module(mod)
            for name in names:
                obj = getattr(module, name)
                if isinstance(obj, type) and issubclass(obj, BaseException) and not issubclass(obj, Warning):
                    found[f"{mod}.{name}"] = obj
    return found


def test_every_error_class_has_the_base_and_keeps_its_standard_one():
    import moe_ep
    import serving

    classes = _error_classes()
    assert {"moe_ep.sync.RankTimeoutError", "moe_ep.sync.CallMismatchError", "moe_ep.sync.RemoteRankError",
            "moe_ep.nvshmem.bitcode.NvshmemUnavailableError", "eplb.cli.CliError", "serving.sim.SimError"} <= set(classes)
    for name, cls in classes.items():
        base = serving.ServingError if name.startswith("serving.") else moe_ep.MoEEPError
        assert issubclass(cls, base) or cls is base, name
    assert issubclass(moe_ep.RankTimeoutError, TimeoutError) and issubclass(moe_ep.CallMismatchError, ValueError)
    assert issubclass(moe_ep.RemoteRankError, RuntimeError)
    assert issubclass(classes["serving.trace.TraceError"], ValueError)


def _backend_logged(rank, world):
    import moe_ep

    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append((record.name, record.levelno, record.getMessage()))

    log = logging.getLogger("moe_ep")
    log.addHandler(Keep())
    log.setLevel(logging.INFO)
    moe_ep.Buffer(None, low_latency_mode=True, timeout_s=60)
    return seen


def test_backend_choice_is_logged_at_info():
    seen = launch(_backend_logged, 1, timeout_s=120)[0]
    hits = [s for s in seen if "backend 'torch'" in s[2] and "backend='auto'" in s[2]]
    assert hits and hits[0][0].startswith("moe_ep.") and hits[0][1] == logging.INFO, seen


# Modules whose print() is a command line's output (or a subprocess protocol), not library code.
CLI_MODULES = {"moe_ep/__main__.py", "moe_ep/demo.py", "moe_ep/_env.py", "moe_ep/alias.py", "moe_ep/testing/netns.py",
               "eplb/cli.py", "serving/__init__.py", "serving/__main__.py", "serving/cli_plan.py", "serving/adp.py",
               "serving/pd_router.py"}


def test_no_print_in_library_code():
    offenders = []
    for pkg in ("moe_ep", "eplb", "microbatch", "serving"):
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            if rel in CLI_MODULES:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
                    offenders.append(f"{rel}:{node.lineno}")
    assert not offenders, offenders
    for pkg in ("moe_ep", "eplb", "microbatch", "serving"):
        importlib.import_module(pkg)
        assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger(pkg).handlers), pkg
