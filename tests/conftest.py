"""Test set-up: the Triton interpreter on machines without a GPU.

TRITON_INTERPRET must be set before any ``@triton.jit`` function is defined, so it is set here,
before the tests import anything from moe_ep. CUDA is never initialised in this process
(the multi-rank tests fork).
"""

import os
import shutil
import subprocess
import zlib


def _has_gpu() -> bool:
    # Ask nvidia-smi rather than torch.cuda so the parent never initialises CUDA before forking.
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return False
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        return subprocess.run([smi, "-L"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


HAS_GPU = _has_gpu()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ.get("MOE_EP_PROGRAM_ORDER"):  # forward / reverse / random[:SEED]: moe_ep.testing.program_order
        from moe_ep.testing.program_order import set_program_order_from_env

        set_program_order_from_env()

import pytest  # noqa: E402


def _version(v: str) -> tuple:
    return tuple(int(p) for p in (v.split("+")[0].split(".") + ["0", "0"])[:2] if p.isdigit())


def _old_interpreter_with_new_numpy() -> bool:
    """Triton < 3.8's interpreter turns a 1-element array into an int with ``int(array)`` (``range(pid, n, nprog)``
    in a kernel), which NumPy >= 2.4 refuses; Triton 3.8 squeezes first."""
    import importlib.metadata

    try:
        tv, nv = importlib.metadata.version("triton"), importlib.metadata.version("numpy")
    except importlib.metadata.PackageNotFoundError:
        return False
    return _version(tv) < (3, 8) and _version(nv) >= (2, 4)


OLD_INTERPRETER_SKIP = (not HAS_GPU) and _old_interpreter_with_new_numpy()
OLD_INTERPRETER_ERROR = "only 0-dimensional arrays can be converted to Python scalars"
OLD_INTERPRETER_REASON = ("Triton < 3.8's interpreter calls int() on 1-element arrays, which NumPy >= 2.4 refuses: "
                          "run the interpreter tests with triton>=3.8 or numpy<2.4")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under Triton < 3.8 with NumPy >= 2.4 a test that fails on exactly that interpreter error is reported as
    skipped, with the reason; every other failure stays a failure."""
    outcome = yield
    if not OLD_INTERPRETER_SKIP or call.excinfo is None or call.when != "call":
        return
    if OLD_INTERPRETER_ERROR in str(call.excinfo.value):
        rep = outcome.get_result()
        rep.outcome = "skipped"
        rep.longrepr = (str(item.path), (item.location[1] or 0) + 1, f"Skipped: {OLD_INTERPRETER_REASON}")


def _shard_key(item) -> str:
    """What goes to one shard together: a test, or its whole file when the file defines a fixture wider than one test
    (a module's compile report, a built venv), which each shard would otherwise build again."""
    module = item.nodeid.split("::")[0]
    try:
        defs = [d for ds in item._fixtureinfo.name2fixturedefs.values() for d in ds]
    except AttributeError:  # a pytest without this (private) table: shard per test
        return item.nodeid
    wide = any(getattr(d, "scope", "function") != "function" and getattr(d, "baseid", "") == module for d in defs)
    return module if wide else item.nodeid


DURATIONS_FILE = os.path.join(os.path.dirname(__file__), "durations.json")


def _durations() -> dict:
    """Seconds per test id (setup + call + teardown) from ``tests/durations.json``, measured on the 2-core CI-sized
    machine (refresh: run the suite with ``MOE_EP_DURATIONS_OUT=<dir>``, then ``python tests/durations.py <dir>``).
    Only balances the shards: a missing or stale entry costs balance, never a test."""
    import json

    try:
        with open(DURATIONS_FILE) as f:
            return {k: float(v) for k, v in json.load(f).items()}
    except (OSError, ValueError):
        return {}


def _shard(config, items) -> None:
    """``MOE_EP_SHARD=i/n`` (set by scripts/test.sh, which runs n pytest processes side by side): keep the tests of
    part ``i``. The parts are disjoint, their union is the whole selection, and every process computes the same
    split: keys (``_shard_key``) by their recorded time, longest first, each to the part with the least time so far
    (a key without a record costs the median)."""
    spec = os.environ.get("MOE_EP_SHARD", "")
    if not spec:
        return
    try:
        i, n = (int(v) for v in spec.split("/"))
        if not 0 <= i < n:
            raise ValueError
    except ValueError:
        raise pytest.UsageError(f"MOE_EP_SHARD must be i/n with 0 <= i < n, not {spec!r}") from None
    known = _durations()
    typical = sorted(known.values())[len(known) // 2] if known else 1.0
    cost: dict = {}
    for item in items:
        key = _shard_key(item)
        cost[key] = cost.get(key, 0.0) + known.get(item.nodeid, typical)
    load, part = [0.0] * n, {}
    for key in sorted(cost, key=lambda k: (-cost[k], zlib.crc32(k.encode()), k)):
        j = min(range(n), key=lambda m: (load[m], m))
        part[key] = j
        load[j] += cost[key]
    keep, drop = [], []
    for item in items:
        (keep if part[_shard_key(item)] == i else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


_RECORDED: dict = {}


def pytest_runtest_logreport(report):
    """``MOE_EP_DURATIONS_OUT=<dir>``: add up each test's phases, written at the end as ``<dir>/<pid>.json``."""
    if os.environ.get("MOE_EP_DURATIONS_OUT"):
        _RECORDED[report.nodeid] = _RECORDED.get(report.nodeid, 0.0) + float(report.duration)


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get("MOE_EP_DURATIONS_OUT")
    if out and _RECORDED:
        import json

        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"{os.getpid()}.json"), "w") as f:
            json.dump({k: round(v, 2) for k, v in _RECORDED.items()}, f)


def pytest_collection_modifyitems(config, items):
    _shard(config, items)
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
