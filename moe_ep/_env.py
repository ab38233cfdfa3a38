"""Environment checks: which Python the set-up scripts use, and whether Triton kernels can run here.

Only the standard library is imported at module level (torch lazily): ``scripts/setup.sh`` runs this
file directly, before torch or this package are installed::

    python moe_ep/_env.py choose-python     # prints "<kind> <python>", see choose_python()
    python moe_ep/_env.py missing torch numpy ...   # prints the modules that cannot be found
    python moe_ep/_env.py installed ROOT    # exit 0 when moe_ep, eplb, microbatch and moe_ep_serving import from ROOT
    python moe_ep/_env.py owner             # prints the checkout this Python imports moe_ep from ("" if none)
    python moe_ep/_env.py torch-index       # prints "<index url or -> <why>", see torch_index_decision()
    python moe_ep/_env.py disk DIR ITEM...  # prints what ITEMs take installed and DIR's free space, see disk_check()
    python moe_ep/_env.py build-isolation   # prints "no" when the local setuptools can build an editable install
    python moe_ep/_env.py nvshmem           # prints "install <why>" or "skip <why>", see nvshmem_decision()
"""

from __future__ import annotations

import os
import sys
import sysconfig

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("moe_ep", "eplb", "microbatch", "moe_ep_serving")  # moe_ep_serving: the serving/ folder, installed


# --------------------------------------------------------------------------------------------------
# Third-party modules the packages need (a Python without them: one line, not a traceback)


def _run_as_program() -> bool:
    """This process is ``python -m <ours>`` (argv[0] is "-m" while runpy imports the package) or one of our
    console scripts (moe-ep, moe-ep-eplb, moe-ep-serving)."""
    arg0 = sys.argv[0] if sys.argv else ""
    return arg0 == "-m" or os.path.basename(arg0).startswith("moe-ep")


def require(*modules: str) -> None:
    """Check that ``modules`` can be imported (no import is done). Where some cannot: a program (``python -m``,
    a console script) prints one line saying how to get them and exits with status 1; an import in someone
    else's program raises ``ModuleNotFoundError`` with that line."""
    missing = missing_modules(modules)
    if not missing:
        return
    names = " and ".join(missing)
    msg = (f"moe-ep needs {names}, which {sys.executable} cannot import: run `bash scripts/setup.sh` in the "
           "checkout and use the Python it prints (on an externally managed system Python: `. .venv/bin/activate`),"
           f" or `{os.path.basename(sys.executable)} -m pip install {' '.join(missing)}` (a CPU-only torch: "
           "--index-url https://download.pytorch.org/whl/cpu)")
    if _run_as_program():
        print(f"error: {msg}", file=sys.stderr)
        raise SystemExit(1)
    raise ModuleNotFoundError(msg, name=missing[0])


def prog(module: str) -> str:
    """The program name for usage lines: the console script's name when run as one (``moe-ep-eplb``), else
    ``python -m <module>``."""
    arg0 = os.path.basename(sys.argv[0]) if sys.argv else ""
    return arg0 if arg0.startswith("moe-ep") else f"python -m {module}"


def write_stdout(text: str) -> int:
    """Print ``text``; a reader that went away (``... --help | head -1``) ends it quietly: returns 141 (the
    status a shell gives a tool ended by SIGPIPE) instead of a BrokenPipeError traceback, else 0."""
    try:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        sys.stdout.flush()
        return 0
    except BrokenPipeError:
        try:  # point stdout at /dev/null so that the interpreter's final flush stays quiet
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):
            pass
        return 141


# --------------------------------------------------------------------------------------------------
# Triton device


def require_triton_device(what: str) -> None:
    """Raise ``RuntimeError`` when Triton kernels cannot run: no CUDA (or ROCm) device and
    ``TRITON_INTERPRET`` is not ``"1"``. Without it Triton fails later with an internal
    "0 active drivers" error.
    """
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    import torch

    if torch.cuda.is_available():
        return
    raise RuntimeError(
        f"{what} runs Triton kernels, which need a GPU (torch.cuda.is_available() is False here) or "
        "Triton's interpreter on CPU: set TRITON_INTERPRET=1 in the environment before importing moe_ep "
        "(it must be set before any @triton.jit function is defined, so setting it later in the same "
        "process does not help), e.g. `TRITON_INTERPRET=1 python your_script.py`.")


# --------------------------------------------------------------------------------------------------
# Set-up decision (scripts/setup.sh)


def is_externally_managed(stdlib: str | None = None) -> bool:
    """PEP 668: the interpreter's installation is managed by the OS (Debian 12, Ubuntu 23.04+, ...)."""
    stdlib = sysconfig.get_path("stdlib") if stdlib is None else stdlib
    return os.path.isfile(os.path.join(stdlib, "EXTERNALLY-MANAGED"))


def in_virtualenv() -> bool:
    return sys.prefix != getattr(sys, "base_prefix", sys.prefix) or hasattr(sys, "real_prefix")


def venv_python(venv_dir: str) -> str:
    if os.name == "nt":
        return os.path.join(venv_dir, "Scripts", "python.exe")
    return os.path.join(venv_dir, "bin", "python")


def choose_python(checkout: str, *, executable: str, in_venv: bool, externally_managed: bool,
                  virtual_env: str | None = None) -> tuple[str, str]:
    """Which interpreter the set-up installs into and demo.sh / test.sh run: ``(kind, python)``.

    - ``"active-venv"``: the interpreter runs in a virtual environment (``sys.prefix !=
      sys.base_prefix``), or ``virtual_env`` (``$VIRTUAL_ENV`` when ``$PYTHON`` was not given)
      names one with a Python: use it.
    - ``"checkout-venv"``: the interpreter is externally managed (PEP 668), so pip refuses to
      install into it: use ``<checkout>/.venv`` (created with ``--system-site-packages``, so what the
      system already has, e.g. a vendor's CUDA torch, is reused and never replaced).
    - ``"current"``: install into the interpreter itself.
    """
    if in_venv:
        return "active-venv", executable
    if virtual_env:
        py = venv_python(virtual_env)
        if os.path.isfile(py) and os.access(py, os.X_OK):
            return "active-venv", py
    if externally_managed:
        return "checkout-venv", venv_python(os.path.join(checkout, ".venv"))
    return "current", executable


def missing_modules(names) -> list[str]:
    import importlib.util

    out = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append(name)
    return out


def installed_from(root: str) -> bool:
    """``moe_ep``, ``eplb``, ``microbatch`` and ``moe_ep_serving`` (the ``serving/`` folder) import from ``root``
    (editable install of this checkout)."""
    import importlib.util

    root = os.path.realpath(root)
    for name in PACKAGES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            return False
        if spec is None or not spec.origin:
            return False
        if os.path.dirname(os.path.dirname(os.path.realpath(spec.origin))) != root:
            return False
    return True


def owner_checkout() -> str:
    """The folder that this Python's ``import moe_ep`` comes from (its checkout or site folder), "" when none."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("moe_ep")
    except (ImportError, ValueError):
        return ""
    if spec is None or not spec.origin:
        return ""
    return os.path.dirname(os.path.dirname(os.path.realpath(spec.origin)))


CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"


def url_reachable(url: str, timeout: float = 5.0) -> bool:
    """An HTTP(S) HEAD of ``url`` answers (any status below 500) within ``timeout`` seconds."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout) as r:
            return r.status < 500
    except urllib.error.HTTPError as e:
        return e.code < 500
    except (OSError, ValueError):
        return False


def torch_index_decision(environ, gpu: bool, cpu_index_reachable) -> tuple[str, str]:
    """Where scripts/setup.sh takes torch from: ``(index_url, why)``, ``index_url == ""`` meaning pip's
    configured index.

    ``$TORCH_INDEX_URL`` when set; with a GPU, pip's configured index (on PyPI for Linux that is the CUDA
    build); without one, the CPU wheel index (~200 MB instead of ~4 GB of CUDA wheels) when it answers, else
    pip's configured index. ``cpu_index_reachable`` is called only when the answer depends on it; pip set to
    no index (``PIP_NO_INDEX``) is never probed.
    """
    if environ.get("TORCH_INDEX_URL"):
        return environ["TORCH_INDEX_URL"], "TORCH_INDEX_URL"
    if gpu:
        return "", "a GPU is present (nvidia-smi): the configured index's build"
    if environ.get("PIP_NO_INDEX", "").lower() in ("1", "true", "yes", "on"):
        return "", "no GPU, but pip is set to use no index (PIP_NO_INDEX)"
    if cpu_index_reachable():
        return CPU_TORCH_INDEX, "no GPU: the CPU build"
    return "", f"no GPU, and {CPU_TORCH_INDEX} does not answer: the configured index's build"


# Installed size (MB) of what setup may install, measured on Linux x86_64 with Python 3.11 (torch 2.13.0,
# triton 3.9.0); with pip's download cache while it runs. The CUDA torch is its nvidia-* wheels too.
INSTALLED_MB = {"torch-cpu": 900, "torch-cuda": 5500, "triton": 1000, "small": 250, "nvshmem": 600}


def disk_check(items, free_mb: float) -> tuple[int, bool]:
    """``(need_mb, enough)`` for installing ``items`` (keys of :data:`INSTALLED_MB`) with ``free_mb`` free."""
    need = sum(INSTALLED_MB[i] for i in items)
    return need, free_mb >= need


def local_build_ok() -> bool:
    """The local setuptools can build an editable install without fetching anything (PEP 660)."""
    try:
        from importlib.metadata import version

        parts = [int(p) for p in version("setuptools").split(".")[:2] if p.isdigit()]
    except Exception:
        return False
    if len(parts) < 2 or tuple(parts) < (64, 0):
        return False
    if tuple(parts) >= (70, 1):
        return True
    return not missing_modules(["wheel"])


def gpu_present() -> bool:
    """``nvidia-smi -L`` runs and lists a GPU (no torch needed: setup runs this before torch exists)."""
    import shutil
    import subprocess

    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        p = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return p.returncode == 0 and "GPU" in p.stdout


def nvshmem_decision(environ, system: str, machine: str, gpu: bool) -> tuple[bool, str]:
    """Whether scripts/setup.sh installs the NVSHMEM wheel (nvidia-nvshmem-cu12, ~280-420 MB), and why.

    Only where it is used: a GPU is present (``nvidia-smi`` works), or ``MOE_EP_NVSHMEM=1`` asks for it
    (the sm90 NVSHMEM compile checks link its device bitcode, no GPU needed). ``MOE_EP_NO_NVSHMEM=1``
    always skips it; there is no wheel outside Linux x86_64.
    """
    if system != "Linux" or machine != "x86_64":
        return False, f"no NVSHMEM wheel for {system} {machine}"
    if environ.get("MOE_EP_NO_NVSHMEM") == "1":
        return False, "MOE_EP_NO_NVSHMEM=1"
    if environ.get("MOE_EP_NVSHMEM") == "1":
        return True, "MOE_EP_NVSHMEM=1"
    if gpu:
        return True, "a GPU is present (nvidia-smi)"
    return False, ("no GPU (nvidia-smi missing or failing); MOE_EP_NVSHMEM=1 installs it for the sm90 NVSHMEM "
                   "compile checks, which skip without it")


def _main(argv: list[str]) -> int:
    # Run as a file, sys.path[0] is this folder: drop it so that its modules shadow nothing.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    cmd = argv[0] if argv else ""
    if cmd == "choose-python":
        venv = None if os.environ.get("PYTHON") else os.environ.get("VIRTUAL_ENV")
        kind, py = choose_python(argv[1] if len(argv) > 1 else CHECKOUT, executable=sys.executable,
                                 in_venv=in_virtualenv(), externally_managed=is_externally_managed(),
                                 virtual_env=venv)
        print(kind, py)
        return 0
    if cmd == "missing":
        print(" ".join(missing_modules(argv[1:])))
        return 0
    if cmd == "installed":
        return 0 if installed_from(argv[1] if len(argv) > 1 else CHECKOUT) else 1
    if cmd == "build-isolation":
        print("no" if local_build_ok() else "yes")
        return 0
    if cmd == "nvshmem":
        import platform

        env = os.environ
        if env.get("MOE_EP_NO_NVSHMEM") == "1" or env.get("MOE_EP_NVSHMEM") == "1":
            gpu = False  # decided by the variable: no need to run nvidia-smi
        else:
            gpu = gpu_present()
        ok, why = nvshmem_decision(env, platform.system(), platform.machine(), gpu)
        print(("install " if ok else "skip ") + why)
        return 0
    if cmd == "owner":
        print(owner_checkout())
        return 0
    if cmd == "torch-index":
        gpu = False if os.environ.get("TORCH_INDEX_URL") else gpu_present()
        url, why = torch_index_decision(os.environ, gpu, lambda: url_reachable(CPU_TORCH_INDEX + "/torch/"))
        print(url or "-", why)
        return 0
    if cmd == "disk" and len(argv) >= 2:
        import shutil

        target = os.path.abspath(argv[1])
        while not os.path.exists(target):
            target = os.path.dirname(target)
        free = shutil.disk_usage(target).free / 2**20
        need, ok = disk_check(argv[2:], free)
        print(f"{'ok' if ok else 'short'} {need} {free:.0f} {target}")
        return 0
    print(f"usage: {sys.argv[0]} choose-python [CHECKOUT] | missing MODULE... | installed [ROOT] | owner "
          "| build-isolation | nvshmem | torch-index | disk DIR ITEM...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
