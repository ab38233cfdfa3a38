"""scripts/setup.sh (and demo.sh / test.sh through it), setup.py's requirements, moe_ep/_env.py.

The scripts run on copies of this working tree in tmp, with interpreters made for the test (a venv
in tmp, or Debian's externally managed /usr/bin/python3, whose .venv lands in the copy): the Python
running the tests is never installed into.
"""

import ast
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("moe_ep", "eplb", "microbatch", "moe_ep_serving")   # as installed
FOLDERS = ("moe_ep", "eplb", "microbatch", "serving")          # in the checkout (serving/ installs as moe_ep_serving)
OFFLINE = {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "",
           "PIP_EXTRA_INDEX_URL": ""}


def _load_env_module():
    # By file path, as setup.sh runs it (no torch, no moe_ep/__init__).
    spec = importlib.util.spec_from_file_location("_moe_ep_env_under_test", ROOT / "moe_ep" / "_env.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


env_mod = _load_env_module()


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "TRITON_INTERPRET", "PYTHON")}
    env.update(extra)
    return env


def _copy_checkout(dest: pathlib.Path) -> pathlib.Path:
    """This working tree (tracked and untracked, not ignored files) copied to dest."""
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                             capture_output=True, check=True).stdout
        files = [f for f in out.decode().split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        files = None
    if files is None:
        shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(".git", ".venv", ".cache", "__pycache__", "*.egg-info"))
        return dest
    for f in files:
        src = ROOT / f
        if src.is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f)
    return dest


def _run_setup(checkout, python, extra_env=None, timeout=600):
    env = _clean_env(PYTHON=str(python), **(extra_env or {}))
    t0 = time.monotonic()
    p = subprocess.run(["bash", "scripts/setup.sh", "--print-python"], cwd=checkout, env=env,
                       capture_output=True, text=True, timeout=timeout)
    return p, time.monotonic() - t0


def _resolve_from_root(python, checkout, extra_env=None):
    code = ("import importlib.util, os\n"
            f"print(' '.join(os.path.realpath(importlib.util.find_spec(n).origin) for n in {PACKAGES!r}))")
    p = subprocess.run([str(python), "-c", code], cwd="/", env=_clean_env(**(extra_env or {})),
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    real = os.path.realpath(checkout)
    return [os.path.dirname(os.path.dirname(o)) == real for o in p.stdout.split()]


# --------------------------------------------------------------------------------------------------
# Point 1: which Python (unit tests of the decision; the Debian run below)


def test_choose_python_active_venv_is_used(tmp_path):
    assert env_mod.choose_python(str(tmp_path), executable="/v/bin/python", in_venv=True,
                                 externally_managed=True) == ("active-venv", "/v/bin/python")
    venv = tmp_path / "act"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / "bin" / "python").chmod(0o755)
    assert env_mod.choose_python(str(tmp_path), executable="/usr/bin/python3", in_venv=False,
                                 externally_managed=True, virtual_env=str(venv)) == \
        ("active-venv", str(venv / "bin" / "python"))


def test_choose_python_externally_managed_gets_checkout_venv(tmp_path):
    kind, py = env_mod.choose_python(str(tmp_path), executable="/usr/bin/python3", in_venv=False,
                                     externally_managed=True, virtual_env=str(tmp_path / "gone"))
    assert kind == "checkout-venv" and py == str(tmp_path / ".venv" / "bin" / "python")


def test_choose_python_plain_interpreter_is_installed_into(tmp_path):
    assert env_mod.choose_python(str(tmp_path), executable="/opt/py/bin/python3", in_venv=False,
                                 externally_managed=False) == ("current", "/opt/py/bin/python3")


def test_externally_managed_marker(tmp_path):
    assert not env_mod.is_externally_managed(str(tmp_path))
    (tmp_path / "EXTERNALLY-MANAGED").write_text("[externally-managed]\nError=use a venv\n")
    assert env_mod.is_externally_managed(str(tmp_path))


def _debian_python():
    py = "/usr/bin/python3"
    if not os.path.exists(py):
        return None, "no /usr/bin/python3 (Debian/Ubuntu: apt-get install python3 python3-venv)"
    code = ("import sys, sysconfig, os; sys.exit(0 if sys.version_info >= (3, 10) and os.path.isfile("
            "os.path.join(sysconfig.get_path('stdlib'), 'EXTERNALLY-MANAGED')) and sys.prefix == sys.base_prefix "
            "else 1)")
    if subprocess.run([py, "-c", code], env=_clean_env()).returncode != 0:
        return None, "/usr/bin/python3 is not an externally managed (PEP 668) Python 3.10+"
    if subprocess.run([py, "-c", "import ensurepip"], env=_clean_env(), capture_output=True).returncode != 0:
        return None, "/usr/bin/python3 has no ensurepip (apt-get install python3-venv)"
    return py, ""


def _installed_something(stderr):
    """The lines setup prints before it installs (its "not installing ..." notes are not installs)."""
    return [ln for ln in stderr.splitlines() if ln.startswith("setup: installing ")]


def _site_dirs():
    return [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and os.path.isdir(p)]


def _check_externally_managed_setup(tmp_path, py, seed_env):
    checkout = _copy_checkout(tmp_path / "co")
    p, _ = _run_setup(checkout, py, seed_env)
    assert p.returncode == 0, p.stdout + p.stderr
    venv_py = checkout / ".venv" / "bin" / "python"
    assert p.stdout.strip().splitlines()[-1] == str(venv_py)
    assert "externally managed" in p.stderr
    cfg = (checkout / ".venv" / "pyvenv.cfg").read_text()
    assert "include-system-site-packages = true" in cfg
    assert all(_resolve_from_root(venv_py, checkout, seed_env))
    # the last lines say how to use it (README: the commands after the quick start need it)
    assert p.stderr.strip().splitlines()[-1].strip() == f". {checkout}/.venv/bin/activate", p.stderr
    # the system Python itself was not installed into
    assert subprocess.run([py, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('moe_ep') is None)"],
                          cwd="/", env=_clean_env(), capture_output=True).returncode != 0
    p2, dt = _run_setup(checkout, py, {**seed_env, **OFFLINE})
    assert p2.returncode == 0, p2.stdout + p2.stderr
    assert p2.stdout.strip() == str(venv_py) and dt < 20, dt
    assert not _installed_something(p2.stderr), p2.stderr
    assert f". {checkout}/.venv/bin/activate" in p2.stderr


def test_setup_on_externally_managed_python_uses_checkout_venv(tmp_path):
    """Debian's python3 (PEP 668): setup creates ./.venv (--system-site-packages), installs there and
    prints it for demo.sh / test.sh; a second run with no index is quick. torch & co come from the
    Python running the tests (PYTHONPATH, same minor version): a vendor container's preinstalled torch,
    with nothing downloaded."""
    py, why = _debian_python()
    if py is None:
        pytest.skip(why)
    v = subprocess.run([py, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True).stdout
    if v.strip() != str(sys.version_info[:2]):
        pytest.skip(f"/usr/bin/python3 is {v.strip()}, the tests run on {sys.version_info[:2]}: cannot lend it "
                    "torch without downloading it (see the network variant below)")
    seed = _seed_site(tmp_path / "seed")
    _check_externally_managed_setup(tmp_path, py, {"PYTHONPATH": str(seed)})


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("MOE_EP_NETWORK_TESTS") != "1",
                    reason="downloads torch, triton, numpy, pytest into a fresh .venv: set MOE_EP_NETWORK_TESTS=1 "
                           "(about 35 s with a local wheel mirror; several GB from PyPI)")
def test_setup_on_externally_managed_python_installs_everything(tmp_path):
    py, why = _debian_python()
    if py is None:
        pytest.skip(why)
    _check_externally_managed_setup(tmp_path, py, {})


# --------------------------------------------------------------------------------------------------
# Point 2: re-runs install nothing (and so work offline, in seconds)


def _seed_site(dest: pathlib.Path, leave_out=()) -> pathlib.Path:
    """A site folder with the test Python's packages but not any moe-ep install of it (an editable install of
    another checkout, whose finder module has the name the copy's will have), nor ``leave_out``."""
    dest.mkdir(parents=True, exist_ok=True)
    for d in _site_dirs():
        for entry in os.listdir(d):
            if entry.startswith(("__editable__", "moe_ep-", "moe-ep") + PACKAGES + FOLDERS + tuple(leave_out)) \
                    or (dest / entry).exists():
                continue
            (dest / entry).symlink_to(os.path.join(d, entry))
    return dest


def _plain_venv(d: pathlib.Path, seed: pathlib.Path) -> pathlib.Path:
    """A venv that sees only ``seed`` (not the system's site folders, which may hold a moe-ep install)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(d)],
                   check=True, env=_clean_env())
    site = subprocess.run([str(d / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    pathlib.Path(site, "_parent_site.pth").write_text(f"import site; site.addsitedir({str(seed)!r})\n")
    return d / "bin" / "python"


@pytest.fixture(scope="module")
def venv_with_packages(tmp_path_factory):
    """A venv in tmp that sees the packages of the Python running the tests (torch, triton, ...), but not
    an install of moe-ep that Python may have."""
    return _plain_venv(tmp_path_factory.mktemp("venv"), _seed_site(tmp_path_factory.mktemp("seed")))


def test_setup_rerun_offline_is_quick(tmp_path, venv_with_packages):
    checkout = _copy_checkout(tmp_path / "co")
    p, _ = _run_setup(checkout, venv_with_packages)
    assert p.returncode == 0, p.stdout + p.stderr
    assert all(_resolve_from_root(venv_with_packages, checkout))          # editable install of the copy
    p2, dt = _run_setup(checkout, venv_with_packages, OFFLINE)
    assert p2.returncode == 0, p2.stdout + p2.stderr
    assert dt < 20, dt
    assert not _installed_something(p2.stderr), p2.stderr
    assert p2.stdout.strip() == str(venv_with_packages)                   # the active venv is used
    assert not (checkout / ".venv").exists()
    assert "activate" not in p2.stderr and f"ready: {venv_with_packages}" in p2.stderr


def test_setup_never_repoints_another_checkouts_python(tmp_path):
    """A Python whose ``import moe_ep`` comes from another checkout keeps it; the scripts still run this
    checkout's code from its folder."""
    other = tmp_path / "other"
    (other / "moe_ep").mkdir(parents=True)
    (other / "moe_ep" / "__init__.py").write_text("")
    py = _plain_venv(tmp_path / "venv", _seed_site(tmp_path / "seed"))
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    pathlib.Path(site, "other_checkout.pth").write_text(str(other) + "\n")
    checkout = _copy_checkout(tmp_path / "co")
    p, _ = _run_setup(checkout, py, OFFLINE)
    assert p.returncode == 0, p.stdout + p.stderr
    assert not _installed_something(p.stderr), p.stderr
    assert str(other) in p.stderr and "MOE_EP_REPOINT=1" in p.stderr, p.stderr
    where = "import moe_ep, os; print(os.path.dirname(os.path.dirname(os.path.realpath(moe_ep.__file__))))"
    elsewhere = subprocess.run([str(py), "-c", where], cwd="/", env=_clean_env(), capture_output=True, text=True)
    assert elsewhere.stdout.strip() == os.path.realpath(other), elsewhere.stderr
    here = subprocess.run([str(py), "-c", where], cwd=checkout, env=_clean_env(), capture_output=True, text=True)
    assert here.stdout.strip() == os.path.realpath(checkout), here.stderr


def test_setup_states_the_disk_before_installing(tmp_path):
    """With something to install, the first thing setup says is what and the disk it takes, against what is
    free; here the install itself then fails (no index), after that line."""
    py = _plain_venv(tmp_path / "venv", _seed_site(tmp_path / "seed", leave_out=("hypothesis",)))
    checkout = _copy_checkout(tmp_path / "co")
    p, _ = _run_setup(checkout, py, OFFLINE)
    assert p.returncode != 0, p.stderr
    lines = p.stderr.splitlines()
    first_install = next(i for i, ln in enumerate(lines) if ln.startswith("setup: installing "))
    plan = [ln for ln in lines[:first_install] if "hypothesis" in ln]
    assert plan, p.stderr
    need, free = [int(float(t)) for t in re.findall(r"(\d+(?:\.\d+)?) MB", plan[0])][:2]
    assert need == env_mod.INSTALLED_MB["small"] and free > 0, plan[0]


def test_torch_index_follows_the_machine():
    d = env_mod.torch_index_decision
    cpu = env_mod.CPU_TORCH_INDEX

    def never():
        raise AssertionError("probed the CPU index where the answer did not depend on it")

    assert d({"TORCH_INDEX_URL": "http://mirror/x"}, gpu=False, cpu_index_reachable=never)[0] == "http://mirror/x"
    assert d({}, gpu=True, cpu_index_reachable=never)[0] == ""
    assert d({}, gpu=False, cpu_index_reachable=lambda: True)[0] == cpu
    url, why = d({}, gpu=False, cpu_index_reachable=lambda: False)
    assert url == "" and cpu in why
    assert d({"PIP_NO_INDEX": "1"}, gpu=False, cpu_index_reachable=never)[0] == ""
    # as setup.sh asks it
    p = subprocess.run([sys.executable, str(ROOT / "moe_ep" / "_env.py"), "torch-index"], capture_output=True,
                       text=True, env=_clean_env(TORCH_INDEX_URL="http://mirror/y"))
    assert p.stdout.split()[0] == "http://mirror/y", p.stdout + p.stderr


def test_disk_check_sums_what_is_installed():
    need, ok = env_mod.disk_check(["torch-cpu", "triton"], free_mb=10**6)
    assert need == env_mod.INSTALLED_MB["torch-cpu"] + env_mod.INSTALLED_MB["triton"] and ok
    assert env_mod.disk_check(["torch-cuda"], free_mb=100) == (env_mod.INSTALLED_MB["torch-cuda"], False)
    assert env_mod.INSTALLED_MB["torch-cuda"] > 4 * env_mod.INSTALLED_MB["torch-cpu"]


def test_missing_and_installed_helpers(tmp_path):
    assert env_mod.missing_modules(["os", "surely_not_a_module_xyz"]) == ["surely_not_a_module_xyz"]
    assert not env_mod.installed_from(str(tmp_path))


# --------------------------------------------------------------------------------------------------
# Point 3: setup.sh says what it installs; README tells CPU users how to get the CPU wheel


def test_setup_and_readme_name_the_torch_wheel():
    setup_sh = (ROOT / "scripts" / "setup.sh").read_text()
    assert "moe_ep/_env.py torch-index" in setup_sh          # the index is chosen for the machine
    assert "torch==2.13.0" in setup_sh
    # every download announced with its rough size
    for what in ("installing torch==2.13.0", "installing triton", "installing $NEED", "installing nvidia-nvshmem"):
        line = next(ln for ln in setup_sh.splitlines() if what in ln and "say " in ln)
        assert re.search(r"(~[\d.-]+ [MG]B|\$SIZE)", line), line
    readme = (ROOT / "README.md").read_text()
    quick = readme[readme.index("## Quick start"):readme.index("## API")]
    assert "https://download.pytorch.org/whl/cpu" in quick
    assert "TRITON_INTERPRET=1" in quick
    assert "bash scripts/demo.sh" in quick and "bash scripts/test.sh" in quick
    # the venv activation is in the quick start's first block, and setup prints it
    first_block = quick[quick.index("```bash"):quick.index("```", quick.index("```bash") + 3)]
    assert ". .venv/bin/activate" in first_block and "No module named 'torch'" in quick
    assert 'echo "    . $ROOT/.venv/bin/activate" >&2' in setup_sh
    assert "MOE_EP_NVSHMEM=1" in quick and "MOE_EP_NO_NVSHMEM=1" in quick
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
    # the oldest supported Triton's compile check runs after it, time-boxed, and the README documents it
    ci = (ROOT / ".ci" / "run").read_text()
    assert "timeout" in ci and "scripts/compile_oldest_triton.sh" in ci.split("bash scripts/test.sh", 1)[1]
    assert "scripts/compile_oldest_triton.sh" in (ROOT / "README.md").read_text()


# --------------------------------------------------------------------------------------------------
# Point 4: setup.py declares every third-party import


def _setup_py_requirements():
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup":
            kw = {k.arg: ast.literal_eval(k.value) for k in node.keywords
                  if k.arg in ("install_requires", "extras_require")}
            return kw.get("install_requires", []), kw.get("extras_require", {})
    raise AssertionError("no setup() call in setup.py")


def _req_name(req: str) -> str:
    name = req.split(";")[0]
    for sep in "<>=!~[ ":
        name = name.split(sep)[0]
    return name.strip().lower().replace("_", "-")


def _third_party_imports():
    stdlib = set(sys.stdlib_module_names)
    found = {}
    for pkg in FOLDERS:
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for n in names:
                    top = n.split(".")[0]
                    if top not in stdlib and top not in PACKAGES + FOLDERS and top != "__future__":
                        found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def test_setup_py_declares_every_third_party_import():
    install, extras = _setup_py_requirements()
    required = {_req_name(r) for r in install}
    declared = required | {_req_name(r) for reqs in extras.values() for r in reqs}
    dist_of = {"yaml": "pyyaml", "PIL": "pillow", "sklearn": "scikit-learn"}
    imports = _third_party_imports()
    assert {"torch", "numpy", "triton"} <= set(imports)
    missing = {m: where for m, where in imports.items() if dist_of.get(m, m).lower() not in declared}
    assert not missing, f"imported but not declared in setup.py: {missing}"
    assert {"torch", "numpy", "triton"} <= required
    triton = [r for r in install if _req_name(r) == "triton"][0]
    assert "platform_system" in triton or "sys_platform" in triton
    assert {"plot", "progress", "nvshmem", "test"} <= set(extras)
    assert {_req_name(r) for r in extras["test"]} >= {"pytest", "hypothesis"}
    assert [_req_name(r) for r in extras["plot"]] == ["matplotlib"]
    assert [_req_name(r) for r in extras["progress"]] == ["tqdm"]
    assert [_req_name(r) for r in extras["nvshmem"]] == ["nvidia-nvshmem-cu12"]


# --------------------------------------------------------------------------------------------------
# Point 5: backend="symm" without a GPU and without TRITON_INTERPRET says what to do


_SYMM_NO_INTERPRETER = r"""
import os, sys, tempfile
import torch, torch.distributed as dist
import moe_ep
if torch.cuda.is_available():
    print("HAS_CUDA"); sys.exit(0)
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
try:
    moe_ep.Buffer(dist.group.WORLD, num_rdma_bytes=1 << 20, low_latency_mode=True, backend="symm", timeout_s=10)
except RuntimeError as e:
    print("RAISED", e)
else:
    print("NO ERROR")
"""


def test_symm_without_gpu_or_interpreter_raises_clearly():
    p = subprocess.run([sys.executable, "-c", _SYMM_NO_INTERPRETER], cwd=ROOT, env=_clean_env(),
                       capture_output=True, text=True, timeout=300)
    if "HAS_CUDA" in p.stdout:
        pytest.skip("a CUDA device is available: Triton kernels compile")
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.startswith("RAISED"), p.stdout + p.stderr
    assert "TRITON_INTERPRET=1" in p.stdout and "before importing moe_ep" in p.stdout
    assert 'backend="symm"' in p.stdout


def test_require_triton_device_passes_with_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    env_mod.require_triton_device("x")
    monkeypatch.delenv("TRITON_INTERPRET")
    import torch
    if torch.cuda.is_available():
        env_mod.require_triton_device("x")
    else:
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            env_mod.require_triton_device("x")


# --------------------------------------------------------------------------------------------------
# Packaging (issue 30): licence, typed markers, serving in the package, console scripts


def _setup_kwargs(monkeypatch):
    """setup.py's setup() keywords, by running it with setuptools.setup replaced (no build, no metadata)."""
    import runpy

    import setuptools

    seen = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: seen.update(kw))
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("MOE_EP_NO_CUDA_EXT", "1")
    runpy.run_path(str(ROOT / "setup.py"), run_name="__main__")
    return seen


def test_setup_py_ships_serving_licence_and_typed_markers(monkeypatch):
    kw = _setup_kwargs(monkeypatch)
    pkgs = set(kw["packages"])
    assert {"moe_ep", "eplb", "microbatch", "moe_ep_serving"} <= pkgs and "serving" not in pkgs
    assert kw["package_dir"] == {"moe_ep_serving": "serving"}
    assert not any(p.startswith(("tests", "perf", "scripts")) for p in pkgs)
    assert kw["license"] == "MIT" and (ROOT / "LICENSE").read_text().startswith("MIT License")
    assert "moe-ep authors" in (ROOT / "LICENSE").read_text()
    cls = kw["classifiers"]
    assert any(c.startswith("Programming Language :: Python :: 3.1") for c in cls)
    assert any(c.startswith("Operating System ::") for c in cls) and any(c.startswith("Topic ::") for c in cls)
    for name, folder in zip(PACKAGES, FOLDERS):
        assert kw["package_data"][name] == ["py.typed"] and (ROOT / folder / "py.typed").is_file()
    assert (ROOT / "CHANGELOG.md").read_text().startswith("# Changelog")


def test_console_scripts_resolve_to_callables(monkeypatch):
    import importlib

    scripts = dict(s.replace(" ", "").split("=") for s in _setup_kwargs(monkeypatch)["entry_points"]["console_scripts"])
    assert set(scripts) == {"moe-ep", "moe-ep-eplb", "moe-ep-serving"}
    for target in scripts.values():
        module, attr = target.split(":")
        top, _, rest = module.partition(".")
        module = dict(zip(PACKAGES, FOLDERS))[top] + (f".{rest}" if rest else "")   # this checkout's folder
        assert callable(getattr(importlib.import_module(module), attr)), target


# --------------------------------------------------------------------------------------------------
# NVSHMEM (~280-420 MB) only where a GPU is present or when asked


def test_nvshmem_only_with_a_gpu_or_when_asked():
    d = env_mod.nvshmem_decision
    assert d({}, "Linux", "x86_64", gpu=True)[0]
    ok, why = d({}, "Linux", "x86_64", gpu=False)
    assert not ok and "MOE_EP_NVSHMEM=1" in why and "no GPU" in why
    assert d({"MOE_EP_NVSHMEM": "1"}, "Linux", "x86_64", gpu=False) == (True, "MOE_EP_NVSHMEM=1")
    assert d({"MOE_EP_NO_NVSHMEM": "1"}, "Linux", "x86_64", gpu=True) == (False, "MOE_EP_NO_NVSHMEM=1")
    assert d({"MOE_EP_NO_NVSHMEM": "1", "MOE_EP_NVSHMEM": "1"}, "Linux", "x86_64", gpu=True)[0] is False
    assert not d({"MOE_EP_NVSHMEM": "1"}, "Darwin", "arm64", gpu=False)[0]
    assert not d({}, "Linux", "aarch64", gpu=True)[0]
    # as setup.sh asks it (the variables decide without running nvidia-smi)
    for var, want in (("MOE_EP_NO_NVSHMEM", "skip MOE_EP_NO_NVSHMEM=1"), ("MOE_EP_NVSHMEM", "install MOE_EP_NVSHMEM=1")):
        p = subprocess.run([sys.executable, str(ROOT / "moe_ep" / "_env.py"), "nvshmem"], capture_output=True,
                           text=True, env=_clean_env(**{var: "1"}))
        import platform
        if platform.system() == "Linux" and platform.machine() == "x86_64":
            assert p.stdout.strip() == want, p.stdout + p.stderr
    setup_sh = (ROOT / "scripts" / "setup.sh").read_text()
    assert 'moe_ep/_env.py nvshmem' in setup_sh


def test_shards_are_disjoint_and_cover_the_selection():
    """scripts/test.sh's parallel processes (MOE_EP_SHARD=i/n, tests/conftest.py): every test of the selection in
    exactly one part (the split is computed in each process: they must agree)."""
    import subprocess
    import sys

    def collect(shard):
        env = dict(os.environ, MOE_EP_SHARD=shard) if shard else {k: v for k, v in os.environ.items()
                                                                  if k != "MOE_EP_SHARD"}
        res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                              "tests/test_fp8_ref.py", "tests/test_eplb_search.py"], capture_output=True, text=True,
                             env=env, cwd=ROOT)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        return [ln for ln in res.stdout.splitlines() if "::" in ln]

    everything = collect(None)
    assert everything
    parts = [collect(f"{i}/2") for i in range(2)]
    assert sorted(parts[0] + parts[1]) == sorted(everything)
    assert parts[0] and parts[1]  # the split is balanced enough that no part is empty here
