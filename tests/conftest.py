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


def _shard(config, items) -> None:
    """``MOE_EP_SHARD=i/n`` (set by scripts/test.sh, which runs n pytest processes side by side): keep the tests
    whose key hashes to ``i``; the n processes run disjoint parts whose union is the whole selection."""
    spec = os.environ.get("MOE_EP_SHARD", "")
    if not spec:
        return
    try:
        i, n = (int(v) for v in spec.split("/"))
        if not 0 <= i < n:
            raise ValueError
    except ValueError:
        raise pytest.UsageError(f"MOE_EP_SHARD must be i/n with 0 <= i < n, not {spec!r}") from None
    keep, drop = [], []
    for item in items:
        (keep if zlib.crc32(_shard_key(item).encode()) % n == i else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_collection_modifyitems(config, items):
    _shard(config, items)
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
