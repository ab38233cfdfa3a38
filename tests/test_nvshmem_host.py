"""Host side of the nvshmem backend (moe_ep/nvshmem/__init__.py, re-exporting moe_ep/nvshmem/{bitcode,checks,heap}.py): bitcode
finder, availability checks, module-init hook; and the sm90 evidence: a tiny kernel calling NVSHMEM compiled for sm90
and its PTX scanned."""

import os
import types

import pytest
import torch

from moe_ep import nvshmem
from moe_ep.nvshmem import bitcode, checks, heap
from moe_ep.nvshmem import NvshmemUnavailableError
from moe_ep.testing.sm90 import REPORT_PROLOGUE

# the real checks (fixtures below replace them on the module)
_real_check_driver = nvshmem.check_driver
_real_check_torch = nvshmem.check_torch_nvshmem
_real_check_ibgda = nvshmem.check_ibgda
_real_check_host = nvshmem.check_host_library
_real_check_triton_link = nvshmem.check_triton_link
_real_check_ibgda_bitcode = nvshmem.check_ibgda_bitcode


# ---------------------------------------------------------------------------------------------- bitcode finder
@pytest.fixture
def no_dirs(monkeypatch):
    """No environment variable, no wheel: search_dirs() is empty until a test adds a directory."""
    monkeypatch.delenv("NVSHMEM_LIB_DIR", raising=False)
    monkeypatch.delenv("NVSHMEM_HOME", raising=False)
    monkeypatch.setattr(bitcode, "_wheel_lib_dir", lambda: None)


def _lib(tmp_path, name, files):
    d = tmp_path / name
    d.mkdir(parents=True)
    for f in files:
        (d / f).write_bytes(b"BC\xc0\xde")
    return d


def test_finder_exact_arch_then_closest_lower_then_generic(tmp_path, no_dirs, monkeypatch):
    d = _lib(tmp_path, "lib", ["libnvshmem_device_sm_70.bc", "libnvshmem_device_sm_80.bc",
                               "libnvshmem_device_sm_90.bc", "libnvshmem_device_sm_100.bc", "libnvshmem_device.a"])
    monkeypatch.setenv("NVSHMEM_LIB_DIR", str(d))
    assert nvshmem.find_device_bitcode(90) == str(d / "libnvshmem_device_sm_90.bc")
    assert nvshmem.find_device_bitcode("sm_90a") == str(d / "libnvshmem_device_sm_90.bc")
    assert nvshmem.find_device_bitcode((8, 6)) == str(d / "libnvshmem_device_sm_80.bc")   # closest lower
    assert nvshmem.find_device_bitcode(120) == str(d / "libnvshmem_device_sm_100.bc")
    # below every per-arch file: the generic one when present, else an error
    with pytest.raises(FileNotFoundError):
        nvshmem.find_device_bitcode(60)
    (d / "libnvshmem_device.bc").write_bytes(b"BC")
    assert nvshmem.find_device_bitcode(60) == str(d / "libnvshmem_device.bc")
    assert nvshmem.extern_libs(89, check=False) == {"libnvshmem_device": str(d / "libnvshmem_device_sm_80.bc")}


def test_backend_launches_nvshmem_kernels_with_the_bitcode(tmp_path, no_dirs, monkeypatch):
    """Every NVSHMEM-calling launch of the low-latency path links the device bitcode (``extern_libs``), picked for
    the device's architecture, and lifts the register cap; on the peer-pointer transport every launch lifts the
    cap too (``LL_MAXNREG``: Triton 3.6's ptxas spills without it); the interpreter gets no option."""
    from moe_ep.backends import symm_ll
    from moe_ep.kernels.low_latency import LL_MAXNREG

    d = _lib(tmp_path, "lib", ["libnvshmem_device_sm_80.bc", "libnvshmem_device_sm_90.bc"])
    monkeypatch.setenv("NVSHMEM_LIB_DIR", str(d))
    monkeypatch.setattr(bitcode, "check_triton_link", lambda arch=90, trial=None: None)
    bitcode._launch_options.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    ll = symm_ll.SymmLowLatency.__new__(symm_ll.SymmLowLatency)
    monkeypatch.setattr(symm_ll.SymmLowLatency, "_interpreted", lambda self, device: False)
    ll.transport = 1
    opts = ll._gpu_launch(torch.device("cuda", 0))
    assert opts == {"extern_libs": {"libnvshmem_device": str(d / "libnvshmem_device_sm_90.bc")},
                    "maxnreg": nvshmem.MAXNREG} == nvshmem.launch_options(90)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    assert ll._gpu_launch(torch.device("cuda", 0))["extern_libs"]["libnvshmem_device"].endswith("sm_80.bc")
    ll.transport = 0
    assert ll._gpu_launch(torch.device("cuda", 0)) == {"maxnreg": LL_MAXNREG} == {"maxnreg": nvshmem.MAXNREG}
    monkeypatch.setattr(symm_ll.SymmLowLatency, "_interpreted", lambda self, device: True)
    assert ll._gpu_launch(torch.device("cuda", 0)) == {}
    bitcode._launch_options.cache_clear()


def test_finder_generic_only_install(tmp_path, no_dirs, monkeypatch):
    """torch's nvidia-nvshmem-cu13 wheel (and tarballs) ship one libnvshmem_device.bc."""
    home = tmp_path / "home"
    _lib(home, "lib", ["libnvshmem_device.bc"])
    monkeypatch.setenv("NVSHMEM_HOME", str(home))
    assert nvshmem.find_device_bitcode(90) == str(home / "lib" / "libnvshmem_device.bc")


def test_finder_order_first_usable_directory_wins(tmp_path, no_dirs, monkeypatch):
    env = _lib(tmp_path, "env", ["libnvshmem_device_sm_100.bc"])            # nothing usable for sm_90
    wheel = _lib(tmp_path, "wheel", ["libnvshmem_device_sm_80.bc"])
    home = tmp_path / "home"
    _lib(home, "lib", ["libnvshmem_device_sm_90.bc"])
    monkeypatch.setenv("NVSHMEM_LIB_DIR", str(env))
    monkeypatch.setattr(bitcode, "_wheel_lib_dir", lambda: str(wheel))
    monkeypatch.setenv("NVSHMEM_HOME", str(home))
    assert [w for w, _ in nvshmem.search_dirs()] == ["$NVSHMEM_LIB_DIR", "the nvidia.nvshmem package", "$NVSHMEM_HOME/lib"]
    # the wheel's sm_80 file beats $NVSHMEM_HOME's exact sm_90: directories are never mixed, earlier wins
    assert nvshmem.find_device_bitcode(90) == str(wheel / "libnvshmem_device_sm_80.bc")
    assert nvshmem.find_device_bitcode(100) == str(env / "libnvshmem_device_sm_100.bc")


def test_finder_error_lists_every_directory(tmp_path, no_dirs, monkeypatch):
    env = _lib(tmp_path, "env", ["libnvshmem_device_sm_100.bc"])
    monkeypatch.setenv("NVSHMEM_LIB_DIR", str(env))
    monkeypatch.setenv("NVSHMEM_HOME", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError) as ei:
        nvshmem.find_device_bitcode(90)
    msg = str(ei.value)
    assert "sm_90" in msg and str(env) in msg and "libnvshmem_device_sm_100.bc" in msg
    assert str(tmp_path / "missing" / "lib") in msg and "not a readable directory" in msg
    assert "pip install 'moe-ep[nvshmem]'" in msg and "nvidia-nvshmem-cu12==3.8.0" in msg
    monkeypatch.delenv("NVSHMEM_LIB_DIR")
    monkeypatch.delenv("NVSHMEM_HOME")
    with pytest.raises(FileNotFoundError, match="none \\(no variable set, no wheel\\)"):
        nvshmem.find_device_bitcode(90)


def test_finder_rejects_bad_arch():
    with pytest.raises(ValueError, match="compute capability"):
        nvshmem.find_device_bitcode("hopper")


def test_installed_wheel_has_sm90_bitcode():
    """The pinned wheel (when installed) gives the sm_90 file; skips in one line without it."""
    lib = bitcode._wheel_lib_dir()
    if lib is None:
        pytest.skip("nvidia-nvshmem-cu12 is not installed (pip install 'moe-ep[nvshmem]')")
    path = nvshmem.find_device_bitcode(90)
    assert os.path.basename(path) in ("libnvshmem_device_sm_90.bc", "libnvshmem_device.bc")
    assert os.path.getsize(path) > 1 << 20


# ---------------------------------------------------------------------------------------------- check_available
@pytest.fixture
def all_ok(monkeypatch, tmp_path):
    """Every check passes (a fake bitcode, a fake GPU); each test breaks one."""
    d = _lib(tmp_path, "ok", ["libnvshmem_device_sm_90.bc"])
    monkeypatch.setenv("NVSHMEM_LIB_DIR", str(d))
    monkeypatch.setattr(checks, "check_cuda_device", lambda device=None: None)
    monkeypatch.setattr(checks, "check_driver", lambda arch=90: None)
    monkeypatch.setattr(checks, "check_torch_nvshmem", lambda: None)
    monkeypatch.setattr(checks, "check_host_library", lambda arch=90: None)
    monkeypatch.setattr(checks, "check_ibgda", lambda: None)
    monkeypatch.setattr(checks, "check_triton_link", lambda arch=90, trial=None: None)
    monkeypatch.setattr(checks, "check_ibgda_bitcode", lambda arch=90: None)
    import torch
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    return d


def test_check_available_passes_and_returns_bitcode(all_ok):
    assert nvshmem.check_available() == str(all_ok / "libnvshmem_device_sm_90.bc")


def test_missing_wheel(all_ok, monkeypatch, no_dirs):
    with pytest.raises(NvshmemUnavailableError) as ei:
        nvshmem.check_available(internode=False)
    assert ei.value.missing == ["wheel"]
    assert "pip install 'moe-ep[nvshmem]'" in str(ei.value) and "NVSHMEM_LIB_DIR" in str(ei.value)


# ---------------------------------------------------------------------------------------------- Triton links it
@pytest.fixture
def triton36_nvshmem38(monkeypatch, tmp_path):
    """Triton 3.6 (LLVM 22.0.0git) and NVSHMEM 3.8.0's bitcode (LLVM 22.1.8), as on a GPU machine with torch 2.11's
    Triton and moe-ep[nvshmem]; the trial link fails as Triton 3.6's does."""
    d = _lib(tmp_path, "lib", ["libnvshmem_device_sm_90.bc"])
    monkeypatch.setenv("NVSHMEM_LIB_DIR", str(d))
    monkeypatch.setattr(bitcode, "triton_version", lambda: "3.6.0")
    monkeypatch.setattr(bitcode, "triton_llvm_version", lambda: "22.0.0git")
    monkeypatch.setattr(bitcode, "bitcode_llvm_version", lambda path: "22.1.8")
    monkeypatch.setattr(bitcode, "bitcode_nvshmem_version", lambda path: "3.8.0")
    trials = []

    def fake_trial(key, path, size, mtime):
        trials.append(path)
        return f"ValueError: Failed to parse library at {path}"
    monkeypatch.setattr(bitcode, "_trial_link", fake_trial)
    return trials


def test_triton_cannot_link_names_both_versions_and_the_fix(triton36_nvshmem38):
    msg = nvshmem.check_triton_link(90)
    assert triton36_nvshmem38, "a newer bitcode than Triton's LLVM is tried, not refused on versions alone"
    for part in ("Triton 3.6.0", "LLVM 22.0.0git", "NVSHMEM 3.8.0", "LLVM 22.1.8", "libnvshmem_device_sm_90.bc",
                 "Failed to parse library", "triton>=3.8", "NVSHMEM 3.4.5", "no IBGDA device code"):
        assert part in msg, (part, msg)
    with pytest.raises(NvshmemUnavailableError) as ei:
        nvshmem.extern_libs(90)
    assert ei.value.missing == ["triton"] and "Triton 3.6.0" in str(ei.value) and "NVSHMEM 3.8.0" in str(ei.value)
    assert nvshmem.extern_libs(90, check=False)["libnvshmem_device"].endswith("libnvshmem_device_sm_90.bc")
    # trial=False trusts the versions: a newer LLVM release than Triton's is refused without linking
    triton36_nvshmem38.clear()
    assert "LLVM 22.1.8" in nvshmem.check_triton_link(90, trial=False) and not triton36_nvshmem38


def test_triton_link_in_check_available(all_ok, triton36_nvshmem38, monkeypatch):
    monkeypatch.setattr(checks, "check_triton_link", _real_check_triton_link)
    with pytest.raises(NvshmemUnavailableError) as ei:
        nvshmem.check_available(internode=False)
    assert ei.value.missing == ["triton"] and "triton>=3.8" in str(ei.value)


def test_older_bitcode_links_without_a_trial(triton36_nvshmem38, monkeypatch):
    """Bitcode from an older LLVM release than Triton's is read (LLVM reads older bitcode): no trial link."""
    monkeypatch.setattr(bitcode, "bitcode_llvm_version", lambda path: "18.1.1")
    assert nvshmem.check_triton_link(90) is None and not triton36_nvshmem38
    monkeypatch.setattr(bitcode, "bitcode_llvm_version", lambda path: None)  # unknown: tried once
    assert "LLVM ?" in nvshmem.check_triton_link(90) and len(triton36_nvshmem38) == 1


def test_ibgda_bitcode_check(all_ok, monkeypatch):
    monkeypatch.setattr(checks, "check_ibgda_bitcode", _real_check_ibgda_bitcode)
    monkeypatch.setattr(bitcode, "bitcode_nvshmem_version", lambda path: "3.4.5")
    assert nvshmem.check_available(internode=False)  # a fake file without the symbol: fine inside a node
    with pytest.raises(NvshmemUnavailableError) as ei:
        nvshmem.check_available(internode=True)
    assert ei.value.missing == ["ibgda"] and "NVSHMEM 3.4.5" in str(ei.value) and "CPU proxy" in str(ei.value)
    (all_ok / "libnvshmem_device_sm_90.bc").write_bytes(b"BC\xc0\xde...nvshmemi_ibgda_device_state_d...")
    assert nvshmem.check_available(internode=True)


def test_version_readers_on_this_machine():
    """The real readers: Triton's bundled LLVM and, when a bitcode is installed, its producer, NVSHMEM release and
    the link verdict (measured combinations in TRITON_LLVM / NVSHMEM_BITCODE must agree with them)."""
    import triton

    t_llvm = nvshmem.triton_llvm_version()
    major_minor = ".".join(triton.__version__.split(".")[:2])
    if major_minor in nvshmem.TRITON_LLVM:
        assert t_llvm == nvshmem.TRITON_LLVM[major_minor]
    assert nvshmem.bitcode_llvm_version(os.devnull) is None
    try:
        path = nvshmem.find_device_bitcode(90)
    except FileNotFoundError:
        pytest.skip("no NVSHMEM device bitcode (pip install 'moe-ep[nvshmem]')")
    b_llvm, release = nvshmem.bitcode_llvm_version(path), nvshmem.bitcode_nvshmem_version(path)
    assert b_llvm is not None, path
    if release in nvshmem.NVSHMEM_BITCODE:
        assert (b_llvm, nvshmem.bitcode_has_ibgda(path)) == nvshmem.NVSHMEM_BITCODE[release]
    if t_llvm is None:
        return
    msg = nvshmem.check_triton_link(90)
    older = bitcode._vt(b_llvm) < bitcode._vt(t_llvm)
    assert (msg is None) == older or bitcode._vt(b_llvm) == bitcode._vt(t_llvm), msg
    if msg is not None:
        assert f"Triton {triton.__version__}" in msg and f"LLVM {b_llvm}" in msg


def test_no_cuda_device_cpu_torch(monkeypatch, tmp_path):
    import torch
    monkeypatch.setattr(torch.version, "cuda", None)
    msg = nvshmem.check_cuda_device()
    assert "CPU build" in msg and "TRITON_INTERPRET=1" in msg


def test_no_cuda_device_none_visible(monkeypatch):
    import torch
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(checks, "_cuda_available", lambda: False)
    assert "CUDA_VISIBLE_DEVICES" in nvshmem.check_cuda_device()


def test_no_cuda_device_in_check_available(all_ok, monkeypatch):
    monkeypatch.setattr(checks, "check_cuda_device", lambda device=None: "no CUDA device: test")
    monkeypatch.setattr(checks, "check_driver", lambda arch=90: pytest.fail("driver checked without a device"))
    with pytest.raises(NvshmemUnavailableError) as ei:
        nvshmem.check_available(internode=False)
    assert ei.value.missing == ["cuda"] and "no CUDA device: test" in str(ei.value)


@pytest.mark.parametrize("have,need,expect", [
    (12080, 13000, "CUDA driver too old: it supports CUDA 12.8"),
    (None, 13000, "no CUDA driver"),
    (13000, 13000, None),
    (13020, 13000, None),
    (12040, 12000, None),
])
def test_driver_check(monkeypatch, have, need, expect):
    monkeypatch.setattr(checks, "driver_cuda_version", lambda: have)
    monkeypatch.setattr(checks, "required_driver_cuda_version", lambda arch=90: need)
    msg = nvshmem.check_driver()
    if expect is None:
        assert msg is None
    else:
        assert expect in msg
        if need == 13000:
            assert "580" in msg


def test_required_driver_follows_tritons_ptxas(monkeypatch):
    monkeypatch.setattr(checks, "_ptxas_cuda_major", lambda arch: {90: 13, 80: 12}.get(arch))
    assert nvshmem.required_driver_cuda_version(90) == 13000
    assert nvshmem.required_driver_cuda_version("sm_80") == 12000
    assert nvshmem.required_driver_cuda_version(75) == 13000  # unknown: assume CUDA 13


def test_driver_in_check_available(all_ok, monkeypatch):
    monkeypatch.setattr(checks, "driver_cuda_version", lambda: 12040)
    monkeypatch.setattr(checks, "required_driver_cuda_version", lambda arch=90: 13000)
    monkeypatch.setattr(checks, "check_driver", _real_check_driver)
    with pytest.raises(NvshmemUnavailableError) as ei:
        nvshmem.check_available(internode=False)
    assert ei.value.missing == ["driver"] and "upgrade the driver" in str(ei.value)


def test_torch_without_nvshmem(all_ok, monkeypatch):
    from torch.distributed import _symmetric_memory as symm_mem
    monkeypatch.setattr(symm_mem, "is_nvshmem_available", lambda: False)
    monkeypatch.setattr(checks, "check_torch_nvshmem", _real_check_torch)
    with pytest.raises(NvshmemUnavailableError) as ei:
        nvshmem.check_available(internode=False)
    assert ei.value.missing == ["torch"]
    assert "is_nvshmem_available() is False" in str(ei.value) and "CUDA build" in str(ei.value)


def test_ibgda_env_missing(all_ok, monkeypatch, tmp_path):
    monkeypatch.delenv("NVSHMEM_IB_ENABLE_IBGDA", raising=False)
    monkeypatch.setattr(checks, "DRIVER_PARAMS", str(tmp_path / "no-params"))
    monkeypatch.setattr(checks, "check_ibgda", _real_check_ibgda)
    assert nvshmem.check_available(internode=False)  # intranode only: IBGDA not needed
    with pytest.raises(NvshmemUnavailableError) as ei:
        nvshmem.check_available(internode=True)
    assert ei.value.missing == ["ibgda"]
    assert "NVSHMEM_IB_ENABLE_IBGDA=1" in str(ei.value) and "export" in str(ei.value)
    monkeypatch.setenv("NVSHMEM_IB_ENABLE_IBGDA", "1")
    assert nvshmem.check_available(internode=True)


@pytest.mark.parametrize("params,gdrdrv,ok", [
    ('EnableStreamMemOPs: 1\nRegistryDwords: "PeerMappingOverride=1;"\n', False, True),
    ('EnableStreamMemOPs: 0\nRegistryDwords: ""\n', False, False),
    ('EnableStreamMemOPs: 1\nRegistryDwords: ""\n', False, False),
    ('EnableStreamMemOPs: 0\nRegistryDwords: ""\n', True, True),   # CPU-assisted IBGDA through GDRCopy
])
def test_ibgda_driver_options(monkeypatch, tmp_path, params, gdrdrv, ok):
    monkeypatch.setenv("NVSHMEM_IB_ENABLE_IBGDA", "1")
    p = tmp_path / "params"
    p.write_text(params)
    monkeypatch.setattr(checks, "DRIVER_PARAMS", str(p))
    g = tmp_path / "gdrdrv"
    if gdrdrv:
        g.write_text("")
    monkeypatch.setattr(checks, "GDRDRV", str(g))
    msg = nvshmem.check_ibgda()
    if ok:
        assert msg is None
    else:
        assert "NVreg_EnableStreamMemOPs=1" in msg and "PeerMappingOverride=1" in msg
        assert "/etc/modprobe.d/nvidia.conf" in msg and "gdrdrv" in msg


def test_all_problems_in_one_error(all_ok, monkeypatch, no_dirs):
    monkeypatch.setattr(checks, "check_driver", lambda arch=90: "CUDA driver too old: x")
    monkeypatch.setattr(checks, "check_torch_nvshmem", lambda: "torch was built without NVSHMEM: y")
    monkeypatch.setattr(checks, "check_ibgda", lambda: "IBGDA ... is not enabled: z")
    with pytest.raises(NvshmemUnavailableError) as ei:
        nvshmem.check_available()
    assert ei.value.missing == ["wheel", "driver", "torch", "ibgda"]
    assert isinstance(ei.value, RuntimeError)
    assert str(ei.value).count("\n  - ") == 4


def test_host_library_release_mismatch(monkeypatch, tmp_path, no_dirs):
    d = _lib(tmp_path, "lib", ["libnvshmem_device_sm_90.bc"])
    (d / "libnvshmem_host.so.3").write_bytes(b"\0ELF junk NVSHMEM v3.4.5\0 more")
    monkeypatch.setenv("NVSHMEM_LIB_DIR", str(d))
    assert bitcode._version_in_file(str(d / "libnvshmem_host.so.3")) == "3.4.5"
    monkeypatch.setattr(checks, "_owner_versions", lambda path: [("nvidia-nvshmem-cu12", "3.8.0")])
    msg = _real_check_host(90)
    assert "mixed NVSHMEM releases" in msg and "3.8.0" in msg and "3.4.5" in msg and "--force-reinstall" in msg
    monkeypatch.setattr(checks, "_owner_versions", lambda path: [("nvidia-nvshmem-cu13", "3.4.5")])
    assert _real_check_host(90) is None
    monkeypatch.setattr(checks, "_owner_versions", lambda path: [])      # not from a wheel: nothing to compare
    assert _real_check_host(90) is None


def test_installed_wheel_host_library_matches():
    if bitcode._wheel_lib_dir() is None:
        pytest.skip("nvidia-nvshmem-cu12 is not installed (pip install 'moe-ep[nvshmem]')")
    host = os.path.join(os.path.dirname(nvshmem.find_device_bitcode(90)), "libnvshmem_host.so.3")
    if os.path.exists(host):
        assert bitcode._version_in_file(host) is not None
    assert _real_check_host(90) is None


def test_import_is_light():
    import subprocess
    import sys
    code = "import sys, moe_ep.nvshmem; print('triton' in sys.modules, 'torch.cuda' in sys.modules and " \
           "__import__('torch').cuda.is_initialized())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


# ---------------------------------------------------------------------------------------------- register_kernels
class _FakeKernel:
    """What the hook touches of a triton CompiledKernel: ``asm``, the lazy ``run`` property, ``module``."""

    def __init__(self, module):
        self.asm = {}
        self._module = module
        self.module = None
        self.loads = 0

    @property
    def run(self):
        if self.module is None:
            self.module = self._module
            self.loads += 1
        return lambda *a: None


@pytest.fixture
def hook_env(monkeypatch):
    triton = pytest.importorskip("triton")
    from triton.runtime.jit import JITFunction  # noqa: F401
    saved = triton.knobs.runtime.jit_post_compile_hook
    inits = []
    monkeypatch.setattr(heap, "_cumodule_init", inits.append)
    monkeypatch.setitem(heap._STATE, "installed", None)
    heap._reset_for_tests()
    yield triton, inits
    triton.knobs.runtime.jit_post_compile_hook = saved
    heap._reset_for_tests()


def _jit(name):
    """A compiled-mode JITFunction (triton.jit gives an InterpretedFunction under TRITON_INTERPRET) whose
    per-device cache is a plain dict (creating Triton's binder needs a GPU driver)."""
    from triton.runtime.jit import JITFunction

    def body(x):
        pass

    body.__name__ = body.__qualname__ = name
    fn = JITFunction(body)
    fn.device_caches = {0: ({}, {}, None, None, None)}
    return fn


def _fire(triton, fn, key, kernel, device=0):
    fn.device_caches[device][0][key] = kernel
    triton.knobs.runtime.jit_post_compile_hook(key=key, repr="", fn=types.SimpleNamespace(jit_function=fn),
                                               compile={"key": key, "device": device}, is_manual_warmup=False,
                                               already_compiled=False)


def test_register_kernels_chains_and_inits_each_module_once(hook_env):
    triton, inits = hook_env
    seen = []
    triton.knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(kw["key"])
    f, g = _jit("f_nvshmem"), _jit("g_plain")
    heap._STATE["ready"] = True
    nvshmem.register_kernels(f)
    nvshmem.register_kernels(f)                     # idempotent: one hook, one registration
    assert isinstance(triton.knobs.runtime.jit_post_compile_hook, heap._PostCompileHook)
    assert nvshmem.registered_kernels() == [f]
    k1, k2, k3 = _FakeKernel(101), _FakeKernel(102), _FakeKernel(103)
    _fire(triton, f, "spec1", k1)
    _fire(triton, f, "spec2", k2)                   # every specialisation
    _fire(triton, f, "spec1", k1)                   # a module is initialised once
    _fire(triton, g, "spec1", k3)                   # not registered: untouched
    assert inits == [101, 102]
    assert k1.loads == 1 and k3.loads == 0
    assert seen == ["spec1", "spec2", "spec1", "spec1"]   # the previous hook still runs, for every kernel


def test_register_kernels_covers_earlier_compiles_and_defers_until_heap(hook_env):
    triton, inits = hook_env
    f = _jit("f_early")
    early = _FakeKernel(201)
    f.device_caches[0][0]["early"] = early          # compiled before registration
    nvshmem.register_kernels(f)                     # NVSHMEM not initialised yet: deferred
    _fire(triton, f, "later", _FakeKernel(202))
    assert inits == [] and early.loads == 0
    heap._heap_ready()                           # what create_nvshmem_heap calls after the rendezvous
    assert inits == [201, 202]
    _fire(triton, f, "after", _FakeKernel(203))
    assert inits == [201, 202, 203]


def test_register_kernels_rejects_plain_functions(hook_env):
    with pytest.raises(TypeError, match="@triton.jit"):
        nvshmem.register_kernels(lambda x: x)


def test_register_kernels_interpreted_is_a_no_op(hook_env):
    triton, inits = hook_env
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (CPU runs)")

    @triton.jit
    def interp_kernel(x):
        pass

    nvshmem.register_kernels(interp_kernel)
    assert nvshmem.registered_kernels() == [] and inits == []


# ---------------------------------------------------------------------------------------------- heap (GPU)
def test_create_heap_validates_before_anything(monkeypatch):
    with pytest.raises(ValueError, match="non-negative"):
        nvshmem.create_nvshmem_heap(None, -1, 4)
    with pytest.raises(ValueError, match="timeout_s"):
        nvshmem.create_nvshmem_heap(None, 16, 4, 0)


def test_create_heap_raises_unavailable_before_allocating(monkeypatch):
    import torch.distributed as dist
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(checks, "check_cuda_device", lambda device=None: "no CUDA device: test")
    from torch.distributed import _symmetric_memory as symm_mem
    monkeypatch.setattr(symm_mem, "empty", lambda *a, **k: pytest.fail("allocated before the checks"))
    with pytest.raises(NvshmemUnavailableError, match="no CUDA device: test"):
        nvshmem.create_nvshmem_heap(None, 1024, 8, internode=False)


@pytest.mark.gpu
def test_nvshmem_heap_one_rank_gpu(tmp_path):
    """One rank on one GPU: the heap comes from NVSHMEM, its own entry is its region, signals are zero."""
    import tempfile

    import torch.distributed as dist
    try:
        nvshmem.check_available(internode=False)
    except NvshmemUnavailableError as exc:
        pytest.skip(str(exc).splitlines()[1])
    dist.init_process_group("nccl", init_method="file://" + tempfile.mktemp(dir=tmp_path), rank=0, world_size=1)
    try:
        buf = nvshmem.create_nvshmem_heap(dist.group.WORLD, 1 << 20, 64, 30.0, internode=False)
        assert buf.provider == "nvshmem" and buf.world_size == 1
        assert int(buf.buffer_ptrs[0]) == buf.symmetric_base == buf.buffer.data_ptr()
        assert buf.pe_list == [0] and buf.reachable == [True]
        assert int(buf.signals.abs().sum()) == 0
        from torch.distributed import _symmetric_memory as symm_mem
        assert symm_mem.get_backend(buf.device) == "NVSHMEM"
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- packaging
def test_pin_is_the_same_everywhere():
    """setup.py's nvshmem extra, scripts/setup.sh and moe_ep.nvshmem name one wheel and version."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    pin = f"{nvshmem.WHEEL}=={nvshmem.WHEEL_VERSION}"
    tree = ast.parse((root / "setup.py").read_text())
    extras = next(ast.literal_eval(k.value) for n in ast.walk(tree) if isinstance(n, ast.Call)
                  and getattr(n.func, "id", None) == "setup" for k in n.keywords if k.arg == "extras_require")
    assert extras["nvshmem"] == [pin]
    setup_sh = (root / "scripts" / "setup.sh").read_text()
    assert f'pipq "{pin}"' in setup_sh and "missing nvidia.nvshmem" in setup_sh and "x86_64" in setup_sh
    assert pin in nvshmem.INSTALL_HINT


# ---------------------------------------------------------------------------------------------- PTX scan
from moe_ep.testing.nvshmem_ptx import entry_scope, scan_nvshmem_ptx  # noqa: E402


@pytest.mark.parametrize("name,scope", [
    ("nvshmemx_putmem_signal_nbi_block", "block"), ("nvshmemx_putmem_nbi_warp", "warp"),
    ("nvshmemx_putmem_warpgroup", "warpgroup"), ("nvshmem_putmem_signal_nbi", "thread"), ("nvshmem_quiet", "ordering"),
    ("nvshmem_fence", "ordering"), ("nvshmemx_quiet", "ordering"), ("nvshmem_uint64_atomic_add", "thread"),
    ("nvshmemx_barrier_all_block", "block"),
])
def test_entry_scope(name, scope):
    assert entry_scope(name) == scope


_FAKE_PTX = """
.visible .const .align 8 .b8 nvshmemi_device_state_d[848];
.visible .const .align 8 .b8 nvshmemi_ibgda_device_state_d[8384];
.visible .const .align 4 .b8 nvshmemi_device_lib_version_d[12] = {3, 0, 0, 0, 8};
.func _Z37nvshmemi_transfer_put_signal_dispatchIL13threadgroup_t{TG}EEvPvS1_mS1_m14nvshmemi_amo_tibi(
.func _Z23nvshmemi_transfer_quietIL13threadgroup_t0EEvbiPii
.func _Z28nvshmemi_transfer_region_endIL13threadgroup_t0EEvPK22nvshmemi_region_info_t
.visible .entry kern(
	st.mmio.relaxed.sys.global.b64 	[%rd1], %rd2;
	call.uni _Z37nvshmemi_transfer_put_signal_dispatchIL13threadgroup_t{TG}EEvPvS1_mS1_m14nvshmemi_amo_tibi, (%rd3);
$L__BB0_65:                             // %{NAME}.exit
	call.uni (retval0), nvshmem_uint64_atomic_fetch_add, (param0);
"""


def test_scan_synthetic_block_and_thread():
    good = scan_nvshmem_ptx(_FAKE_PTX.replace("{TG}", "3").replace("{NAME}", "nvshmemx_putmem_signal_nbi_block")
                            .replace("nvshmem_uint64_atomic_fetch_add", "nvshmem_quiet"))
    assert good["links_nvshmem"] and good["ibgda_doorbell"] and good["doorbell_stores"] == 1 and good["ibgda_state"]
    assert good["device_lib_version"] == "3.8.0"
    assert good["entry_points"] == {"nvshmem_quiet": "ordering", "nvshmemx_putmem_signal_nbi_block": "block"}
    assert good["ordering"] == ["nvshmem_quiet"]
    # quiet / region_end instantiated for one thread are NVSHMEM's own bookkeeping, not transfers
    assert good["internal"]["nvshmemi_transfer_put_signal_dispatch"] == ["block"]
    assert good["internal"]["nvshmemi_transfer_quiet"] == ["thread"] and good["thread_scoped"] == []
    bad = scan_nvshmem_ptx(_FAKE_PTX.replace("{TG}", "0").replace("{NAME}", "nvshmem_putmem_signal_nbi"))
    assert bad["thread_scoped"] == ["nvshmem_putmem_signal_nbi", "nvshmem_uint64_atomic_fetch_add",
                                    "nvshmemi_transfer_put_signal_dispatch<thread>"]
    warp = scan_nvshmem_ptx(_FAKE_PTX.replace("{TG}", "1").replace("{NAME}", "nvshmemx_putmem_signal_nbi_warp")
                            .replace("nvshmem_uint64_atomic_fetch_add", "nvshmem_fence"))
    assert warp["thread_scoped"] == [] and warp["internal"]["nvshmemi_transfer_put_signal_dispatch"] == ["warp"]


def test_scan_ttir_gives_exact_entry_points():
    ttir = ('%3 = tt.extern_elementwise %0 {libname = "libnvshmem_device", pure = false, symbol = '
            '"nvshmemx_putmem_nbi_block"}\n%4 = tt.extern_elementwise {symbol = "nvshmem_quiet"}\n'
            '%5 = tt.extern_elementwise %1 {symbol = "__nv_expf"}')
    r = scan_nvshmem_ptx("no nvshmem here", ttir)
    assert r["entry_source"] == "ttir"
    assert r["entry_points"] == {"nvshmem_quiet": "ordering", "nvshmemx_putmem_nbi_block": "block"}
    assert not r["ibgda_doorbell"] and r["device_lib_version"] is None


def test_scan_plain_kernel():
    r = scan_nvshmem_ptx(".visible .entry k(\n\tst.global.b32 [%rd1], %r1;\n\tst.release.sys.global.b32 [%rd2], %r2;\n")
    assert not r["links_nvshmem"] and not r["ibgda_doorbell"] and r["entry_points"] == {} and r["thread_scoped"] == []


# The kernels declare the NVSHMEM entry points themselves (torch's pattern: impure externs, int64 addresses,
# a uint64 signal value, int32 signal op and PE). @triton.jit needs a source file: the script writes this one.
TINY_KERNELS = r'''
import triton
import triton.language as tl
from triton.language import core

I64, U64, I32 = core.dtype("int64"), core.dtype("uint64"), core.dtype("int32")
SIG = (I64, I64, I64, I64, U64, I32, I32)  # dest, source, bytes, signal address, signal value, signal op, pe


@core.extern
def put_signal_block(dest, source, nbytes, sig, value, op, pe, _semantic=None):
    return core.extern_elementwise("", "", [dest, source, nbytes, sig, value, op, pe],
                                   {SIG: ("nvshmemx_putmem_signal_nbi_block", I32)}, is_pure=False, _semantic=_semantic)


@core.extern
def put_signal_thread(dest, source, nbytes, sig, value, op, pe, _semantic=None):
    return core.extern_elementwise("", "", [dest, source, nbytes, sig, value, op, pe],
                                   {SIG: ("nvshmem_putmem_signal_nbi", I32)}, is_pure=False, _semantic=_semantic)


@triton.jit
def tiny_block(dest, source, sig, nbytes, pe):
    put_signal_block(dest.to(tl.int64), source.to(tl.int64), nbytes.to(tl.int64), sig.to(tl.int64),
                     tl.full((), 1, tl.uint64), tl.full((), 0, tl.int32), pe)


@triton.jit
def tiny_thread(dest, source, sig, nbytes, pe):
    put_signal_thread(dest.to(tl.int64), source.to(tl.int64), nbytes.to(tl.int64), sig.to(tl.int64),
                      tl.full((), 1, tl.uint64), tl.full((), 0, tl.int32), pe)
'''

TINY = r'''
import importlib, json, os, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton
from moe_ep.nvshmem import extern_libs

cases = json.loads(sys.argv[1])
with open(os.path.join(cases["out"], "tiny_nvshmem_kernels.py"), "w") as f:
    f.write(cases["source"])
sys.path.insert(0, cases["out"])
mod = importlib.import_module("tiny_nvshmem_kernels")
out = {}
for name in cases["kernels"]:
    sig = {"dest": "*u8", "source": "*u8", "sig": "*u64", "nbytes": "i64", "pe": "i32"}
    ck = triton.compile(ASTSource(getattr(mod, name), sig, {}), target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": 4, "extern_libs": extern_libs(90)})
    paths = {}
    for kind in ("ptx", "ttir"):
        paths[kind] = os.path.join(cases["out"], f"{name}.{kind}")
        with open(paths[kind], "w") as f:
            f.write(ck.asm[kind])
    out[name] = paths
print(json.dumps(out))
'''


def _linkable_bitcode_or_skip() -> str:
    """The sm_90 bitcode when this Triton can link it; else skip with one line naming both versions."""
    try:
        path = nvshmem.find_device_bitcode(90)
    except FileNotFoundError:
        pytest.skip("no NVSHMEM device bitcode (pip install 'moe-ep[nvshmem]')")
    if nvshmem.check_triton_link(90) is not None:
        import triton
        pytest.skip(f"Triton {triton.__version__} (LLVM {nvshmem.triton_llvm_version()}) cannot link NVSHMEM "
                    f"{nvshmem.bitcode_nvshmem_version(path)}'s bitcode (LLVM {nvshmem.bitcode_llvm_version(path)}): "
                    "moe_ep.nvshmem.check_triton_link")
    return path


def _no_ibgda_reason(path: str) -> str:
    return (f"NVSHMEM {nvshmem.bitcode_nvshmem_version(path)}'s bitcode {os.path.basename(path)} has no IBGDA device "
            "code (puts go through the CPU proxy): no doorbell to check")


#: NVSHMEM's put-with-signal routine: ``nvshmemi_transfer_put_signal_dispatch`` in 3.8, ``..._put_signal`` in 3.4
_PUT_SIGNAL = ("nvshmemi_transfer_put_signal_dispatch", "nvshmemi_transfer_put_signal")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    _linkable_bitcode_or_skip()
    from moe_ep.testing.sm90 import compile_in_subprocess

    out = tmp_path_factory.mktemp("nvshmem_ptx")
    paths = compile_in_subprocess(TINY, {"kernels": ["tiny_block", "tiny_thread"], "out": str(out), "source": TINY_KERNELS},
                                  "a tiny NVSHMEM kernel", timeout_s=600.0)
    read = lambda p: open(p).read()  # noqa: E731
    return {k: (read(v["ptx"]), read(v["ttir"])) for k, v in paths.items()}


def test_sm90_block_put_signal_rings_the_ibgda_doorbell(tiny):
    ptx, ttir = tiny["tiny_block"]
    for r in (scan_nvshmem_ptx(ptx, ttir), scan_nvshmem_ptx(ptx)):   # exact (TTIR) and PTX-only entry points
        assert r["entry_points"] == {"nvshmemx_putmem_signal_nbi_block": "block"}
        assert [r["internal"][n] for n in _PUT_SIGNAL if n in r["internal"]] == [["block"]], r["internal"]
        assert r["thread_scoped"] == []
    path = nvshmem.find_device_bitcode(90)
    if not nvshmem.bitcode_has_ibgda(path):
        pytest.skip(_no_ibgda_reason(path))
    for r in (scan_nvshmem_ptx(ptx, ttir), scan_nvshmem_ptx(ptx)):
        assert r["ibgda_doorbell"] and r["doorbell_stores"] > 0, "no st.mmio doorbell: not the IBGDA path"
        assert r["ibgda_state"]
    assert scan_nvshmem_ptx(ptx)["device_lib_version"] == nvshmem.WHEEL_VERSION or bitcode._wheel_lib_dir() is None \
        or os.environ.get("NVSHMEM_LIB_DIR")


def test_sm90_thread_scoped_put_signal_is_flagged(tiny):
    ptx, ttir = tiny["tiny_thread"]
    with_ttir, ptx_only = scan_nvshmem_ptx(ptx, ttir), scan_nvshmem_ptx(ptx)
    assert with_ttir["entry_points"] == {"nvshmem_putmem_signal_nbi": "thread"}
    assert "nvshmem_putmem_signal_nbi" in with_ttir["thread_scoped"]
    # from the PTX alone: NVSHMEM's put-with-signal routine instantiated for a single thread
    assert any(f"{n}<thread>" in ptx_only["thread_scoped"] for n in _PUT_SIGNAL), ptx_only["thread_scoped"]


# ---------------------------------------------------------------------------------------------- report rows
REPORT = REPORT_PROLOGUE + r'''
import contextlib, io
table = io.StringIO()
with contextlib.redirect_stdout(table):
    rows = report.main(json.loads(sys.argv[1]))
print(json.dumps({"rows": rows, "table": table.getvalue()}))
'''


@pytest.mark.slow
def test_sm90_report_nvshmem_rows():
    """perf/sm90_report.py --nvshmem: the low-latency kernels with TRANSPORT = NVSHMEM link the sm_90 bitcode, take
    the IBGDA path (doorbell), call only the block-scoped / PE-wide entry points the device module declares, and no
    thread-scoped transfer. About 40 s per row on two cores."""
    path = _linkable_bitcode_or_skip()
    if not nvshmem.bitcode_has_ibgda(path):
        pytest.skip(_no_ibgda_reason(path))
    from moe_ep.testing.sm90 import compile_in_subprocess

    out = compile_in_subprocess(REPORT, ["--nvshmem", "--filter", "NVSHMEM"], "the NVSHMEM report rows", timeout_s=1200.0)
    rows = out["rows"]
    failed = [f"{r['kernel']} [{r['config']}]: {r['error']}" for r in rows if "error" in r]
    assert not failed, "\n".join(failed)
    assert {r["kernel"] for r in rows} == {"_ll_dispatch_send_kernel", "_ll_dispatch_recv_kernel", "_ll_combine_send_fmt_kernel",
                                         "_ll_combine_recv_fmt_kernel", "_ll_quiet_kernel"}
    allowed = set(_device_calls())
    for r in rows:
        scan = r["nvshmem"]
        assert scan["ibgda_doorbell"] and scan["ibgda_state"], r
        assert scan["entry_source"] == "ttir" and scan["entry_points"], r
        assert set(scan["entry_points"]) <= allowed, (r["kernel"], scan["entry_points"])
        assert set(scan["entry_points"].values()) <= {"block", "warp", "ordering"}, scan["entry_points"]
        assert scan["thread_scoped"] == [], (r["kernel"], scan["thread_scoped"])
        assert 0 < r["regs"] <= 255 and r["resident_warps"] >= r["num_warps"], r
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (r["kernel"], r["config"], r["spill_stores"])
    senders = [r for r in rows if "quiet" not in r["kernel"]]
    # no completion wait on the hot path (a put to a dead PE would block it): docs/protocols.md
    assert senders and not any("nvshmem_quiet" in r["nvshmem"]["ordering"] for r in senders)
    assert "IBGDA doorbell" in out["table"] and "THREAD-SCOPED" not in out["table"]


def _device_calls():
    """The entry points moe_ep.kernels.nvshmem_device declares (read from its source: importing it here would
    define its @triton.jit functions under this process's interpreter setting)."""
    import ast
    import pathlib

    src = (pathlib.Path(nvshmem.__file__).parent / "kernels" / "nvshmem_device.py").read_text()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "DEVICE_CALLS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("moe_ep/kernels/nvshmem_device.py has no DEVICE_CALLS")
