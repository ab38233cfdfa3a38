"""Compile Triton kernels for an H100 target (sm90) on a machine without a GPU, from tests.

The interpreter accepts code that compiled Triton refuses, so every kernel is also compiled ahead of
time with the installed Triton's own ptxas. That has to happen in a process without
``TRITON_INTERPRET`` (the flag is read when ``@triton.jit`` functions are defined), so tests pass a
script here; it receives the cases as JSON in ``sys.argv[1]`` and prints its results as JSON on its
last line of output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Optional

__all__ = ["compile_in_subprocess", "launch_case", "REPORT_PROLOGUE"]

#: Start of a compile script that needs ``perf/sm90_report.py`` (the checkout's, next to the ``moe_ep`` package):
#: imports it as ``report`` (registered in ``sys.modules``: its dataclasses look their module up), plus ``json``,
#: ``os``, ``re`` and ``sys``.
REPORT_PROLOGUE = r'''
import importlib.util, json, os, re, sys
import moe_ep
_root = os.path.dirname(os.path.dirname(os.path.abspath(moe_ep.__file__)))
_spec = importlib.util.spec_from_file_location("sm90_report", os.path.join(_root, "perf", "sm90_report.py"))
report = importlib.util.module_from_spec(_spec)
sys.modules["sm90_report"] = report
_spec.loader.exec_module(report)
'''


def compile_in_subprocess(script: str, cases: Any, what: str, timeout_s: float = 300.0, target: str = "sm90") -> Any:
    """Run ``script`` with ``cases`` in a fresh interpreter without ``TRITON_INTERPRET`` and return its
    JSON result (``target``: what the failure message says it compiled for). Skips the calling test when
    this Triton has no NVIDIA backend or the script reports a ``"skip"`` (an ASTSource API that differs);
    fails it, with the compiler's stderr, when compiling fails."""
    import pytest

    try:
        from triton.backends.nvidia import compiler  # noqa: F401
    except ImportError:
        pytest.skip("this Triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(cases)], env=env, capture_output=True, text=True,
                          timeout=timeout_s, check=False)
    if proc.returncode != 0:
        pytest.fail(f"compiling {what} for {target} failed:\n{proc.stderr[-4000:]}")
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    values = results.values() if isinstance(results, dict) else results
    if any(isinstance(r, dict) and "skip" in r for r in values):
        pytest.skip(f"ASTSource API differs in this Triton: {results}")
    return results


def launch_case(name: str, config: str, kernel, pointers: dict, scalars: dict, constexprs: dict, num_warps: int = 4,
                num_stages: int = 3, options: Optional[dict] = None) -> dict:
    """One shipped configuration specialised like a launch would be, as the dict ``sm90_cases()`` hooks return
    (the fields of ``perf/sm90_report.py``'s ``Case``): pointers (torch allocations, 256-byte aligned) and integers
    divisible by 16 get ``tt.divisibility`` 16, integers equal to 1 become constexpr, the rest i32 / i64;
    arguments with a default take it unless given. Every argument must be given exactly once."""
    names = list(kernel.arg_names)
    scalars, constexprs = dict(scalars), dict(constexprs)
    for prm in kernel.params:  # arguments with a default (e.g. TRANSPORT) take it unless the case says otherwise
        if prm.name not in pointers and prm.name not in scalars and prm.name not in constexprs and prm.has_default:
            (constexprs if prm.is_constexpr else scalars)[prm.name] = prm.default
    given = {**pointers, **scalars, **constexprs}
    missing, extra = set(names) - set(given), set(given) - set(names)
    if missing or extra:
        raise ValueError(f"{kernel.__name__}: case '{config}' misses {sorted(missing)} / has unknown {sorted(extra)}")
    sig, const, div16 = {}, dict(constexprs), []
    for n, v in scalars.items():
        if v == 1:
            const[n] = 1
        elif v % 16 == 0:
            div16.append(n)
    for n in names:
        if n in const:
            sig[n] = "constexpr"
        elif n in pointers:
            sig[n] = pointers[n]
            div16.append(n)
        else:
            sig[n] = "i32" if -2**31 <= scalars[n] < 2**31 else "i64"
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    return {"name": name, "config": config, "kernel": kernel, "signature": sig, "constexprs": const,
            "num_warps": num_warps, "num_stages": num_stages, "attrs": attrs, "options": options}
