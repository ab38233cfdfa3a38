"""NVSHMEM host side of the ``nvshmem`` backend: device bitcode, availability checks, symmetric heap, module init.

The low-latency kernels reach peers on other nodes through NVSHMEM device calls (declared in
:mod:`moe_ep.kernels.nvshmem_device`). On a GPU that needs four things from the host, all here:

- :func:`find_device_bitcode` / :func:`extern_libs`: the NVSHMEM device library (LLVM bitcode) Triton links into
  every kernel that calls NVSHMEM. The ``nvidia-nvshmem-cu12`` 3.8.0 wheel ships one file per architecture
  (``libnvshmem_device_sm_90.bc`` ...) and no ``libnvshmem_device.bc``; other installs ship the single file.
- :func:`check_triton_link`: this Triton's bundled LLVM can read that bitcode (an LLVM reads bitcode of its own or an
  older release only); :func:`extern_libs` and :func:`check_available` raise :class:`NvshmemUnavailableError` naming
  both versions and what to install when it cannot.
- :func:`check_available`: one :class:`NvshmemUnavailableError` naming everything that is missing (wheel, a Triton
  that links the bitcode, GPU, driver, torch build, IBGDA) and how to fix each, raised before anything is allocated.

Which combinations work (measured with the wheels; :data:`TRITON_LLVM`, :data:`NVSHMEM_BITCODE`):

===============================  ======================  ======================  ======================
bitcode                          Triton 3.6 (LLVM 22.0)  Triton 3.8 (LLVM 23.0)  Triton 3.9 (LLVM 24.0)
===============================  ======================  ======================  ======================
nvidia-nvshmem-cu12 3.8.0        cannot link             IBGDA path              IBGDA path
(LLVM 22.1.8, IBGDA code)
nvidia-nvshmem-cu13 3.4.5        links, no IBGDA         links, no IBGDA         links, no IBGDA
(LLVM 18.1.1, torch 2.11's)
===============================  ======================  ======================  ======================

GPU-initiated RDMA (IBGDA) from Triton kernels therefore needs NVSHMEM 3.8.0's bitcode with triton >= 3.8; with
3.4.5's bitcode internode puts go through NVSHMEM's CPU proxy (:func:`check_ibgda_bitcode` reports it for
``internode=True``).
- :func:`create_nvshmem_heap`: the symmetric heap from torch symmetric memory's NVSHMEM backend, as a
  :class:`moe_ep.symm.SymmBuffer` (``provider="nvshmem"``).
- :func:`register_kernels`: every compiled specialisation of the given ``@triton.jit`` functions gets its CUDA
  module initialised for NVSHMEM (``nvshmemx_cumodule_init``), once per module.

Nothing here imports Triton or touches CUDA at import time.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib.metadata
import importlib.util
import mmap
import os
import re
import subprocess
from typing import Callable, Iterable, Optional

__all__ = ["WHEEL", "WHEEL_VERSION", "INSTALL_HINT", "MIN_DRIVER_BRANCH", "NvshmemUnavailableError",
           "search_dirs", "find_device_bitcode", "extern_libs", "launch_options", "MAXNREG", "driver_cuda_version",
           "required_driver_cuda_version",
           "check_wheel", "check_cuda_device", "check_triton_link", "check_ibgda_bitcode",
           "bitcode_llvm_version", "triton_llvm_version", "bitcode_nvshmem_version", "bitcode_has_ibgda",
           "TRITON_LLVM", "NVSHMEM_BITCODE", "check_driver", "check_torch_nvshmem", "check_ibgda",
           "check_host_library", "check_available", "create_nvshmem_heap", "register_kernels", "registered_kernels"]

WHEEL = "nvidia-nvshmem-cu12"
WHEEL_VERSION = "3.8.0"
INSTALL_HINT = f"pip install 'moe-ep[nvshmem]' (it pins {WHEEL}=={WHEEL_VERSION})"
#: CUDA 13.x runs on driver branch 580 or newer (minor version compatibility; NVIDIA, "CUDA Compatibility",
#: docs.nvidia.com/deploy/cuda-compatibility/minor-version-compatibility.html, table "CUDA Toolkit 11.x, 12.x, and
#: 13.x Minimum and Maximum Required Driver Versions": CUDA 13.x >= 580, CUDA 12.x >= 525).
MIN_DRIVER_BRANCH = {12: 525, 13: 580}
#: where the NVIDIA kernel module reports its load-time options (read for the IBGDA driver settings)
DRIVER_PARAMS = "/proc/driver/nvidia/params"
#: GDRCopy's device node: CPU-assisted IBGDA works without the driver options when gdrdrv is loaded
GDRDRV = "/dev/gdrdrv"
IBGDA_DRIVER_OPTIONS = 'options nvidia NVreg_EnableStreamMemOPs=1 NVreg_RegistryDwords="PeerMappingOverride=1;"'


class NvshmemUnavailableError(RuntimeError):
    """NVSHMEM cannot be used here. ``missing`` lists the short names of what failed (``"wheel"``, ``"cuda"``,
    ``"driver"``, ``"torch"``, ``"ibgda"``, ``"host-library"``, ``"triton"``, ``"backend"``); the message says how to
    fix each."""

    def __init__(self, problems: list, what: str = "the nvshmem backend"):
        self.missing = [k for k, _ in problems]
        lines = "\n".join(f"  - {msg}" for _, msg in problems)
        super().__init__(f"{what} cannot run here:\n{lines}")


# ---------------------------------------------------------------------------------------------- bitcode
def _wheel_lib_dir() -> Optional[str]:
    """``nvidia/nvshmem/lib`` of the installed NVSHMEM wheel (without importing it), or ``None``."""
    try:
        spec = importlib.util.find_spec("nvidia.nvshmem")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        lib = os.path.join(loc, "lib")
        if os.path.isdir(lib):
            return lib
    return None


def search_dirs() -> list:
    """Directories searched for the device bitcode, in order: ``[(where, dir), ...]``.

    ``$NVSHMEM_LIB_DIR``, the lib directory of the installed ``nvidia.nvshmem`` package (the wheel), then
    ``$NVSHMEM_HOME/lib`` (a tarball / system install). Entries whose variable is unset or whose package is
    absent are left out."""
    dirs = []
    if os.environ.get("NVSHMEM_LIB_DIR"):
        dirs.append(("$NVSHMEM_LIB_DIR", os.environ["NVSHMEM_LIB_DIR"]))
    wheel = _wheel_lib_dir()
    if wheel is not None:
        dirs.append(("the nvidia.nvshmem package", wheel))
    if os.environ.get("NVSHMEM_HOME"):
        dirs.append(("$NVSHMEM_HOME/lib", os.path.join(os.environ["NVSHMEM_HOME"], "lib")))
    return dirs


def _arch_number(arch) -> int:
    """``90``, ``"90"``, ``"sm_90"``, ``"sm_90a"``, ``(9, 0)`` -> 90."""
    if isinstance(arch, tuple) and len(arch) == 2:
        return int(arch[0]) * 10 + int(arch[1])
    if isinstance(arch, int) and not isinstance(arch, bool) and arch > 0:
        return arch
    m = re.fullmatch(r"(?:sm_?)?(\d+)[af]?", str(arch).strip().lower())
    if m is None:
        raise ValueError(f"arch must be a compute capability like 90, 'sm_90' or (9, 0), got {arch!r}")
    return int(m.group(1))


_BC = re.compile(r"libnvshmem_device_sm_(\d+)\.bc")


def _pick(lib_dir: str, arch: int) -> Optional[str]:
    """The bitcode in ``lib_dir`` for ``arch``: exact, else the closest lower architecture, else the generic file."""
    try:
        names = os.listdir(lib_dir)
    except OSError:
        return None
    per_arch = {int(m.group(1)): n for n in names if (m := _BC.fullmatch(n))}
    lower = [a for a in per_arch if a <= arch]
    if lower:
        return os.path.join(lib_dir, per_arch[max(lower)])
    if "libnvshmem_device.bc" in names:
        return os.path.join(lib_dir, "libnvshmem_device.bc")
    return None


def _describe(lib_dir: str) -> str:
    try:
        found = sorted(n for n in os.listdir(lib_dir) if n.startswith("libnvshmem_device") and n.endswith(".bc"))
    except OSError:
        return "not a readable directory"
    return ", ".join(found) if found else "no libnvshmem_device*.bc"


def find_device_bitcode(arch=90) -> str:
    """Path of the NVSHMEM device bitcode for compute capability ``arch`` (default 90: H100 / H200).

    The first directory of :func:`search_dirs` that holds a usable file wins (files of different installs are
    never mixed); inside it: ``libnvshmem_device_sm_{arch}.bc``, else the closest lower architecture's file, else
    ``libnvshmem_device.bc``. Raises :class:`FileNotFoundError` listing every directory searched and what it held.
    """
    arch = _arch_number(arch)
    dirs = search_dirs()
    for _, d in dirs:
        path = _pick(d, arch)
        if path is not None:
            return path
    searched = "; ".join(f"{where} = {d} ({_describe(d)})" for where, d in dirs) or "none (no variable set, no wheel)"
    raise FileNotFoundError(
        f"no NVSHMEM device bitcode for sm_{arch} (libnvshmem_device_sm_{arch}.bc, a lower sm_XX, or "
        f"libnvshmem_device.bc). Searched: {searched}. Fix: {INSTALL_HINT}, or point NVSHMEM_LIB_DIR at a directory "
        "holding the bitcode.")


def extern_libs(arch=90, *, check: bool = True) -> dict:
    """``{"libnvshmem_device": path}``: what a Triton launch (``kernel[grid](..., extern_libs=...)``) or
    ``triton.compile(..., options={"extern_libs": ...})`` needs to link NVSHMEM's device functions.

    With ``check`` (the default) it first makes sure this Triton can link that bitcode (:func:`check_triton_link`)
    and raises :class:`NvshmemUnavailableError` (``missing == ["triton"]``) naming both versions and what to install
    when it cannot; :class:`FileNotFoundError` when there is no bitcode."""
    path = find_device_bitcode(arch)
    if check:
        msg = check_triton_link(arch)
        if msg is not None:
            raise NvshmemUnavailableError([("triton", msg)], what="linking NVSHMEM into Triton kernels")
    return {"libnvshmem_device": path}


#: ptxas caps a kernel linked with NVSHMEM's bitcode at 128 registers unless told otherwise; 255 lifts it (the
#: low-latency send kernels need ~130-200).
MAXNREG = 255


@functools.lru_cache(maxsize=None)
def _launch_options(arch: int) -> tuple:
    return tuple(extern_libs(arch).items())


def launch_options(arch=90) -> dict:
    """Launch keywords of every Triton kernel that calls NVSHMEM (``kernel[grid](..., **launch_options(90))``):
    ``extern_libs`` (the device bitcode, checked once per architecture as :func:`extern_libs` does) and
    ``maxnreg`` (:data:`MAXNREG`). The backends launch with exactly these; ``perf/sm90_report.py`` compiles with
    them."""
    return {"extern_libs": dict(_launch_options(_arch_number(arch))), "maxnreg": MAXNREG}


# ---------------------------------------------------------------------------------------------- Triton can link it
# Triton links the bitcode with the LLVM it bundles, and an LLVM reads bitcode written by its own or an older release
# only: NVSHMEM 3.8.0's per-arch files (written by LLVM 22.1.8) fail in Triton 3.6 (LLVM 22.0.0git) with
# "ValueError: Failed to parse library at ...". Measured on these wheels (``llvm.link_extern_libs`` of the sm_90 /
# generic file into an empty module):
#: LLVM that bundled Triton releases link with ("LLVM version ..." in ``triton/_C/libtriton.so``)
TRITON_LLVM = {"3.6": "22.0.0git", "3.8": "23.0.0git", "3.9": "24.0.0git"}
#: LLVM that wrote each NVSHMEM wheel's device bitcode (its IDENTIFICATION block), and whether that bitcode has the
#: IBGDA device code (``nvshmemi_ibgda_device_state_d``): without it, internode puts from Triton go through NVSHMEM's
#: CPU proxy thread, not GPU-initiated RDMA.
NVSHMEM_BITCODE = {"3.4.5": ("18.1.1", False), "3.8.0": ("22.1.8", True)}
_CHAR6 = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._"


class _Bits:
    """LLVM bitstream reader (32-bit little-endian words, least significant bit first)."""

    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def read(self, n: int) -> int:
        v = 0
        for i in range(n):
            v |= ((self.data[(self.pos + i) >> 3] >> ((self.pos + i) & 7)) & 1) << i
        self.pos += n
        return v

    def vbr(self, n: int) -> int:
        hi, v, shift = 1 << (n - 1), 0, 0
        while True:
            c = self.read(n)
            v |= (c & (hi - 1)) << shift
            shift += n - 1
            if not c & hi or shift > 64:
                return v

    def one(self, op) -> object:
        kind, width = op
        if kind == "literal":
            return width
        if kind == 1:
            return self.read(width)
        if kind == 2:
            return self.vbr(width)
        if kind == 4:
            return _CHAR6[self.read(6)]
        raise ValueError(f"operand encoding {kind}")


def _producer(data: bytes) -> Optional[str]:
    """The producer string (``"LLVM22.1.8"``) of the IDENTIFICATION block that starts a bitcode file, or ``None``."""
    if data[:4] == b"\xde\xc0\x17\x0b":  # wrapper header: offset, size of the bitcode
        off = int.from_bytes(data[8:12], "little")
        data = data[off:]
    if data[:4] != b"BC\xc0\xde":
        return None
    b = _Bits(data)
    b.pos = 32
    if b.read(2) != 1:  # ENTER_SUBBLOCK
        return None
    block, width = b.vbr(8), b.vbr(4)
    b.pos = (b.pos + 31) & ~31
    b.read(32)
    if block != 13:  # IDENTIFICATION_BLOCK_ID
        return None
    abbrevs = []
    for _ in range(64):
        a = b.read(width)
        if a == 0:  # END_BLOCK
            return None
        if a == 1:
            return None
        if a == 2:  # DEFINE_ABBREV
            ops, n = [], b.vbr(5)
            while len(ops) < n:
                if b.read(1):
                    ops.append(("literal", b.vbr(8)))
                else:
                    enc = b.read(3)
                    ops.append((enc, b.vbr(5) if enc in (1, 2) else None))
            abbrevs.append(ops)
            continue
        if a == 3:  # UNABBREV_RECORD
            code, n = b.vbr(6), b.vbr(6)
            vals = [b.vbr(6) for _ in range(n)]
        else:
            ops, vals, i = abbrevs[a - 4], [], 0
            while i < len(ops):
                if ops[i][0] == 3:  # array of the next operand
                    vals += [b.one(ops[i + 1]) for _ in range(b.vbr(6))]
                    i += 2
                elif ops[i][0] == 5:  # blob: not in this block
                    return None
                else:
                    vals.append(b.one(ops[i]))
                    i += 1
            code, vals = vals[0], vals[1:]
        if code == 1:  # IDENTIFICATION_CODE_STRING
            return "".join(v if isinstance(v, str) else chr(v) for v in vals)
    return None


def bitcode_llvm_version(path: str) -> Optional[str]:
    """The LLVM release that wrote a bitcode file (``"22.1.8"``), from its IDENTIFICATION block; ``None`` when the
    file has none (or cannot be read)."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
        producer = _producer(head)
    except (OSError, IndexError, ValueError):
        return None
    m = re.fullmatch(r"LLVM(\d+\.\d+(?:\.\d+)?\w*)", producer or "")
    return m.group(1) if m else None


def triton_version() -> Optional[str]:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=None)
def _libtriton_llvm(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            i = m.find(b"LLVM version ")
            hit = re.match(rb"LLVM version (\d+\.\d+\.\d+\w*)", m[i:i + 40]) if i >= 0 else None
            return hit.group(1).decode() if hit else None
    except (OSError, ValueError):
        return None


def triton_llvm_version() -> Optional[str]:
    """The LLVM release bundled in the installed Triton (``"22.0.0git"`` for 3.6), read from ``libtriton.so``
    without loading it; ``None`` when it cannot be found."""
    try:
        spec = importlib.util.find_spec("triton._C.libtriton")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    return _libtriton_llvm(spec.origin)


def _vt(version: Optional[str]) -> Optional[tuple]:
    m = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def bitcode_nvshmem_version(path: str) -> Optional[str]:
    """The NVSHMEM release of a device bitcode: the version of the ``nvidia-nvshmem-cu1x`` wheel that installed it,
    else the ``NVSHMEM vX.Y.Z`` banner of the host library beside it; ``None`` when neither says."""
    owners = _owner_versions(path)
    if owners:
        return owners[0][1]
    host = os.path.join(os.path.dirname(path), "libnvshmem_host.so.3")
    return _version_in_file(host) if os.path.exists(host) else None


def bitcode_has_ibgda(path: str) -> Optional[bool]:
    """Whether the device bitcode holds NVSHMEM's IBGDA device code (its symbol table names
    ``nvshmemi_ibgda_device_state_d``); ``None`` when it cannot be read."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return m.find(b"nvshmemi_ibgda_device_state_d") >= 0
    except (OSError, ValueError):
        return None


@functools.lru_cache(maxsize=None)
def _trial_link(triton_key: tuple, path: str, size: int, mtime: float) -> Optional[str]:
    """Link ``path`` into an empty module with this Triton's LLVM (what compiling a kernel that calls NVSHMEM does):
    ``None`` when it links, else the error. Once per process and file (a success parses the whole file: ~1-10 s)."""
    try:
        from triton._C.libtriton import ir, llvm
    except ImportError:
        return None  # no compiled Triton: nothing to check against
    try:
        ctx = ir.context()
        ir.load_dialects(ctx)
        mod = llvm.to_module(ir.builder(ctx).create_module(), llvm.context())
    except Exception:  # noqa: BLE001 - a Triton whose bindings differ: cannot tell, the compile will say
        return None
    try:
        llvm.link_extern_libs(mod, [path])
    except Exception as exc:  # noqa: BLE001 - Triton raises ValueError("Failed to parse library at ...")
        return f"{type(exc).__name__}: {exc}"
    return None


def _triton_for(llvm_version: Optional[str]) -> Optional[str]:
    """Lowest Triton in :data:`TRITON_LLVM` whose LLVM is newer than ``llvm_version`` (so it reads that bitcode)."""
    want = _vt(llvm_version)
    ok = [t for t, v in TRITON_LLVM.items() if want is not None and _vt(v) > want]
    return min(ok, key=_vt) if ok else None


def _nvshmem_for(llvm_version: Optional[str]) -> list:
    """NVSHMEM releases in :data:`NVSHMEM_BITCODE` whose bitcode an LLVM of ``llvm_version`` reads, newest first."""
    have = _vt(llvm_version)
    ok = [n for n, (v, _) in NVSHMEM_BITCODE.items() if have is not None and _vt(v) < have]
    return sorted(ok, key=lambda n: tuple(int(x) for x in n.split(".")), reverse=True)


def check_triton_link(arch=90, *, trial: Optional[bool] = None) -> Optional[str]:
    """The installed Triton can link the NVSHMEM device bitcode for ``arch`` (its LLVM reads that file).

    Decided from versions when they settle it: bitcode written by an older LLVM release (major.minor) than Triton's
    links; otherwise (same or newer release, or a version unknown) one trial link, cached per process and file
    (``trial=True`` forces it, ``trial=False`` skips it and trusts the versions). Returns ``None`` when it links, else
    one line naming both versions and what to install."""
    try:
        path = find_device_bitcode(arch)
    except FileNotFoundError:
        return None  # check_wheel reports it
    tv, t_llvm, b_llvm = triton_version(), triton_llvm_version(), bitcode_llvm_version(path)
    known = _vt(b_llvm) is not None and _vt(t_llvm) is not None
    older = known and _vt(b_llvm) < _vt(t_llvm)
    error = None
    if trial or (trial is None and not older):
        st = os.stat(path)
        error = _trial_link((tv, t_llvm), path, st.st_size, st.st_mtime)
    elif trial is False and known and _vt(b_llvm) > _vt(t_llvm):
        error = "a newer LLVM release than Triton's"
    if error is None:
        return None
    nv = bitcode_nvshmem_version(path) or "unknown"
    fix_triton = _triton_for(b_llvm)
    fixes = [f"install triton>={fix_triton} for this NVSHMEM" if fix_triton else
             "install a newer Triton (one whose bundled LLVM is newer than the bitcode's) for this NVSHMEM"]
    fix_nv = _nvshmem_for(t_llvm)
    if fix_nv:
        fixes.append(f"or, for this Triton, NVSHMEM {fix_nv[0]} (e.g. nvidia-nvshmem-cu13=={fix_nv[0]}, torch "
                     "2.11's, or NVSHMEM_LIB_DIR at its lib/)" + ("" if NVSHMEM_BITCODE[fix_nv[0]][1] else
                                                        ": it links, but its bitcode has no IBGDA device code (internode "
                                                        "puts then go through NVSHMEM's CPU proxy)"))
    return (f"Triton {tv or '?'} (LLVM {t_llvm or '?'}) cannot link NVSHMEM {nv}'s device bitcode "
            f"{os.path.basename(path)} (written by LLVM {b_llvm or '?'}; {error}): " + "; ".join(fixes) +
            ". GPU-initiated RDMA (IBGDA) from Triton kernels needs NVSHMEM 3.8.0 with triton>=3.8")


def check_ibgda_bitcode(arch=90) -> Optional[str]:
    """The device bitcode has NVSHMEM's IBGDA device code (internode puts without a CPU proxy)."""
    try:
        path = find_device_bitcode(arch)
    except FileNotFoundError:
        return None  # check_wheel reports it
    if bitcode_has_ibgda(path) is not False:
        return None
    nv = bitcode_nvshmem_version(path) or "unknown"
    return (f"NVSHMEM {nv}'s device bitcode {path} has no IBGDA device code (no nvshmemi_ibgda_device_state_d): "
            "internode puts from Triton kernels would go through NVSHMEM's CPU proxy thread; install "
            f"{WHEEL}=={WHEEL_VERSION} (with triton>=3.8) and point NVSHMEM_LIB_DIR at its lib/")


# ---------------------------------------------------------------------------------------------- checks
# Each returns None when fine, else one line: what is missing and how to fix it. check_available gathers them.
def check_wheel(arch=90) -> Optional[str]:
    try:
        find_device_bitcode(arch)
    except FileNotFoundError as exc:
        return f"NVSHMEM device library: {exc}"
    return None


def _cuda_available() -> bool:
    import torch

    return torch.version.cuda is not None and torch.cuda.is_available()


def check_cuda_device(device=None) -> Optional[str]:
    import torch

    if torch.version.cuda is None:
        return (f"no CUDA device: this torch ({torch.__version__}) is a CPU build; the nvshmem backend needs NVIDIA "
                "GPUs and a CUDA build of torch (on CPU, its kernels run emulated under TRITON_INTERPRET=1 with the "
                "shm provider, as the tests do)")
    if not _cuda_available():
        return ("no CUDA device: torch.cuda.is_available() is False (no GPU visible: check nvidia-smi and "
                "CUDA_VISIBLE_DEVICES)")
    if device is not None:
        dev = torch.device(device)
        if dev.type != "cuda":
            return f"device {dev} is not a CUDA device; pass a cuda device"
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            return f"device {dev} does not exist: {torch.cuda.device_count()} CUDA device(s) visible"
    return None


def driver_cuda_version() -> Optional[int]:
    """The CUDA version the installed driver supports (``cuDriverGetVersion``: 13000 for 13.0), or ``None``
    when no driver library can be loaded. Does not initialise CUDA."""
    for name in ("libcuda.so.1", ctypes.util.find_library("cuda")):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        v = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(v)) == 0 and v.value > 0:
            return v.value
    return None


@functools.lru_cache(maxsize=None)
def _ptxas_cuda_major(arch: int = 90) -> Optional[int]:
    """CUDA major version of the ptxas Triton compiles ``arch`` with (Triton 3.9: its bundled ``ptxas`` 12.9 below
    sm_90, ``ptxas-blackwell`` 13.4 from sm_90 on; ``TRITON_PTXAS[_BLACKWELL]_PATH`` override them)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError:
        return None
    try:
        tool = get_ptxas(arch)
    except TypeError:  # older Triton: get_ptxas() takes no architecture
        tool = get_ptxas()
    except RuntimeError:  # no ptxas found
        return None
    version = getattr(tool, "version", None)
    if version is None:
        try:
            out = subprocess.run([tool.path, "--version"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            return None
        m = re.search(r"release (\d+)\.(\d+)", out)
        version = m.group(0).split()[-1] if m else None
    m = re.match(r"(\d+)", str(version or ""))
    return int(m.group(1)) if m else None


def required_driver_cuda_version(arch: int = 90) -> int:
    """Lowest ``cuDriverGetVersion`` value that loads the cubins this Triton emits for ``arch``: the CUDA major of
    the ptxas it uses (13 for sm_90 with Triton 3.9's bundled 13.4 ptxas) times 1000. Minor version
    compatibility lets a driver of the same major load cubins of a later minor release."""
    return (_ptxas_cuda_major(_arch_number(arch)) or 13) * 1000


def check_driver(arch=90) -> Optional[str]:
    have, need = driver_cuda_version(), required_driver_cuda_version(arch)
    major = need // 1000
    branch = MIN_DRIVER_BRANCH.get(major)
    branch_txt = f"driver branch {branch} or newer" if branch else f"a driver for CUDA {major}.x"
    if have is None:
        return (f"no CUDA driver: libcuda.so.1 cannot be loaded; install the NVIDIA driver ({branch_txt}, "
                f"for the CUDA {major}.x cubins Triton compiles)")
    if have < need:
        return (f"CUDA driver too old: it supports CUDA {have // 1000}.{have % 1000 // 10}, but Triton compiles "
                f"with a CUDA {major}.x ptxas and its cubins need {branch_txt} (NVIDIA's CUDA compatibility table: "
                f"CUDA 13.x needs >= 580, CUDA 12.x >= 525); upgrade the driver, or use a Triton whose ptxas matches "
                "it (TRITON_PTXAS_BLACKWELL_PATH / TRITON_PTXAS_PATH = an older CUDA's bin/ptxas)")
    return None


def check_torch_nvshmem() -> Optional[str]:
    try:
        from torch.distributed import _symmetric_memory as symm_mem
    except ImportError:
        return ("torch has no torch.distributed._symmetric_memory: install torch >= 2.8 built with CUDA (PyPI's "
                "Linux CUDA wheels include NVSHMEM)")
    if not hasattr(symm_mem, "is_nvshmem_available") or not symm_mem.is_nvshmem_available():
        return ("torch was built without NVSHMEM symmetric memory, or cannot load it "
                "(torch.distributed._symmetric_memory.is_nvshmem_available() is False): use a PyPI CUDA build of "
                "torch >= 2.8 on Linux (it depends on an nvidia-nvshmem wheel), and check that libnvshmem_host.so.3 "
                "loads")
    return None


def _driver_params() -> Optional[str]:
    try:
        with open(DRIVER_PARAMS) as f:
            return f.read()
    except OSError:
        return None


def check_ibgda() -> Optional[str]:
    """IBGDA (GPU-initiated RDMA) for internode traffic: the environment asks NVSHMEM for it, and the driver
    allows it (or GDRCopy's gdrdrv provides CPU-assisted IBGDA). The driver part is checked only where
    ``/proc/driver/nvidia/params`` can be read."""
    problems = []
    if os.environ.get("NVSHMEM_IB_ENABLE_IBGDA", "").strip().lower() not in ("1", "true", "yes", "on"):
        problems.append("NVSHMEM_IB_ENABLE_IBGDA=1 is not set: export it in every rank's environment before the "
                        "process starts (NVSHMEM reads it when the heap is created); without it internode puts go "
                        "through a CPU proxy thread")
    params = _driver_params()
    if params is not None and not os.path.exists(GDRDRV):
        mem_ops = re.search(r"EnableStreamMemOPs:\s*(\d+)", params)
        dwords = re.search(r"RegistryDwords:\s*\"?([^\n\"]*)", params)
        ok_ops = mem_ops is not None and mem_ops.group(1) == "1"
        ok_peer = dwords is not None and re.search(r"PeerMappingOverride\s*=\s*1", dwords.group(1)) is not None
        if not (ok_ops and ok_peer):
            problems.append(
                f"the NVIDIA driver is not loaded with the IBGDA options ({DRIVER_PARAMS}: EnableStreamMemOPs="
                f"{mem_ops.group(1) if mem_ops else '?'}, PeerMappingOverride {'set' if ok_peer else 'not set'}): "
                f"add `{IBGDA_DRIVER_OPTIONS}` to /etc/modprobe.d/nvidia.conf, run `update-initramfs -u` and reboot "
                "(as DeepEP's NVSHMEM install notes say), or install GDRCopy and load gdrdrv for CPU-assisted IBGDA")
    if not problems:
        return None
    return "IBGDA (internode RDMA without a CPU proxy) is not enabled: " + "; ".join(problems)


def _version_in_file(path: str) -> Optional[str]:
    """The ``NVSHMEM vX.Y.Z`` banner inside a host library, read without loading it."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            i = m.find(b"NVSHMEM v")
            while i >= 0:
                hit = re.match(rb"NVSHMEM v(\d+\.\d+\.\d+)", m[i:i + 32])
                if hit:
                    return hit.group(1).decode()
                i = m.find(b"NVSHMEM v", i + 1)
            return None
    except (OSError, ValueError):
        return None


def _owner_versions(path: str) -> list:
    """``[(distribution, version)]`` of installed distributions whose RECORD lists ``path``."""
    owners = []
    real = os.path.realpath(path)
    for name in ("nvidia-nvshmem-cu12", "nvidia-nvshmem-cu13"):
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        for f in dist.files or ():
            if f.name == os.path.basename(path) and os.path.realpath(str(dist.locate_file(f))) == real:
                owners.append((name, dist.version))
                break
    return owners


def check_host_library(arch=90) -> Optional[str]:
    """The bitcode and the NVSHMEM host library next to it (the one torch's PyPI build loads) come from the same
    release. ``nvidia-nvshmem-cu12`` and torch's ``nvidia-nvshmem-cu13`` install into the same directory, so
    having both leaves one release's bitcode beside the other's host library."""
    try:
        bitcode = find_device_bitcode(arch)
    except FileNotFoundError:
        return None  # check_wheel reports it
    host = os.path.join(os.path.dirname(bitcode), "libnvshmem_host.so.3")
    owners = _owner_versions(bitcode)
    host_v = _version_in_file(host) if os.path.exists(host) else None
    if not owners or host_v is None:
        return None  # not a wheel install, or no host library beside it: nothing to compare
    bc_v = owners[0][1]
    if bc_v.split(".")[:2] != host_v.split(".")[:2]:
        return (f"mixed NVSHMEM releases in {os.path.dirname(bitcode)}: the device bitcode {os.path.basename(bitcode)} "
                f"is {owners[0][0]} {bc_v} but libnvshmem_host.so.3 there is {host_v} (two nvidia-nvshmem wheels "
                "installed into the same directory, e.g. torch's nvidia-nvshmem-cu13 and moe-ep's "
                f"{WHEEL}): reinstall the one whose version torch was built against last (`pip install "
                "--force-reinstall --no-deps nvidia-nvshmem-cuXX==<version>`), or point NVSHMEM_LIB_DIR at a "
                "directory with matching files")
    return None


def check_available(device=None, *, internode: bool = True, arch=None) -> str:
    """Raise one :class:`NvshmemUnavailableError` naming everything that keeps the ``nvshmem`` backend from running
    here, with the fix for each; return the device bitcode path when nothing is missing. Allocates nothing.

    Arguments:
        device: the CUDA device the heap will live on (default: the current one).
        internode: the group spans nodes, so IBGDA is required too.
        arch: compute capability of the bitcode (default: the device's; 90 when there is no device).
    """
    problems = []
    cuda_msg = check_cuda_device(device)
    if cuda_msg is not None:
        problems.append(("cuda", cuda_msg))
    if arch is None:
        arch = 90
        if cuda_msg is None:
            import torch

            arch = torch.cuda.get_device_capability(device)
    msg = check_wheel(arch)
    if msg is not None:
        problems.append(("wheel", msg))
    else:
        for key, check in (("host-library", check_host_library), ("triton", check_triton_link)):
            msg = check(arch)
            if msg is not None:
                problems.append((key, msg))
        if internode:
            msg = check_ibgda_bitcode(arch)
            if msg is not None:
                problems.append(("ibgda", msg))
    if cuda_msg is None:
        for key, msg in (("driver", check_driver(arch)), ("torch", check_torch_nvshmem())):
            if msg is not None:
                problems.append((key, msg))
    if internode:
        msg = check_ibgda()
        if msg is not None:
            problems.append(("ibgda", msg))
    if problems:
        raise NvshmemUnavailableError(problems)
    return find_device_bitcode(arch)


# ---------------------------------------------------------------------------------------------- heap
def _select_backend(symm_mem, device) -> None:
    """Make NVSHMEM torch symmetric memory's backend for ``device`` (a process-wide setting, fixed once any
    symmetric tensor has been allocated)."""
    current = None
    try:
        current = symm_mem.get_backend(device)
    except Exception:  # noqa: BLE001 - older torch: no get_backend
        pass
    if current == "NVSHMEM":
        return
    try:
        symm_mem.set_backend("NVSHMEM")
    except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError with its own wording
        raise NvshmemUnavailableError([("backend", (
            f"torch symmetric memory cannot switch to its NVSHMEM backend (current backend: {current!r}; {exc}): the "
            "backend is fixed once a symmetric tensor exists in this process, so create the nvshmem Buffer before "
            "any symm Buffer or other symmetric-memory user"))]) from exc


def create_nvshmem_heap(group, nbytes: int, num_signals: int, timeout_s: float = 60.0, *, device=None,
                        internode: bool = True):
    """Collectively allocate this rank's symmetric heap over ``group`` from torch symmetric memory's NVSHMEM
    backend (every rank calls it with the same sizes). GPUs only; :func:`check_available` runs first, so a
    missing piece raises before anything is allocated.

    Returns a :class:`moe_ep.symm.SymmBuffer` with ``provider == "nvshmem"``, the same layout as the other
    providers (data ``[0, nbytes)``, then ``num_signals`` int32 signal words at a 256-byte aligned offset, zeroed),
    and these NVSHMEM specifics:

    - ``buffer_ptrs[r]`` / ``signal_ptrs[r]``: rank ``r``'s region mapped into this process when ``r`` is reachable
      by loads and stores (same node, NVLink / P2P: ``nvshmem_ptr`` of the rendezvous handle), **0 otherwise**; a
      kernel takes the peer-pointer path for nonzero entries and NVSHMEM puts for the others.
    - ``symmetric_base``: this rank's own region address; NVSHMEM device calls take addresses in the caller's
      heap (``symmetric_base + offset``) and a PE, and write the same offset of that PE's heap.
    - ``pe``: int32 ``[world_size]`` on the device, the NVSHMEM PE of each group rank (torch initialises NVSHMEM
      over the default group, so the PE is the global rank); ``pe_list`` the same as Python ints.
    - ``reachable``: Python list of bools, ``buffer_ptrs[r] != 0``.

    Kernels registered with :func:`register_kernels` and compiled before this call are initialised now.
    """
    import torch
    import torch.distributed as dist

    from .symm import SymmBuffer, _align, _create_cuda
    from .sync import ArrivalCheck

    if not isinstance(nbytes, int) or nbytes < 0 or not isinstance(num_signals, int) or num_signals < 0:
        raise ValueError(f"nbytes and num_signals must be non-negative ints, got {nbytes!r}, {num_signals!r}")
    if not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
        raise ValueError(f"timeout_s must be a positive number, got {timeout_s!r}")
    if not dist.is_initialized():
        raise RuntimeError("create_nvshmem_heap needs torch.distributed to be initialised")
    check_available(device, internode=internode)
    from torch.distributed import _symmetric_memory as symm_mem

    group = group if group is not None else dist.group.WORLD
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    _select_backend(symm_mem, device)
    arrival = ArrivalCheck(group, rank, world_size, timeout_s)
    total = _align(nbytes) + _align(4 * max(num_signals, 1))
    # the cuda provider's allocation (empty, zero, rendezvous), now over the NVSHMEM backend
    region, addrs, keepalive = _create_cuda(group, rank, world_size, total, device, arrival)
    if len(addrs) != world_size or addrs[rank] != region.data_ptr():
        raise RuntimeError(f"torch symmetric memory returned {len(addrs)} peer addresses (own: {addrs[rank:rank + 1]}) "
                           f"for a group of {world_size} (own region at {region.data_ptr():#x}): unexpected backend")
    buf = SymmBuffer(rank=rank, world_size=world_size, nbytes=nbytes, num_signals=num_signals, region=region,
                     peer_addrs=addrs, provider="nvshmem", timeout_s=timeout_s, keepalive=(*keepalive, region),
                     arrival=arrival)
    reachable = [a != 0 for a in addrs]
    # SymmBuffer offsets every entry; a peer without a mapping keeps 0 in the signal table too.
    buf.signal_ptrs = torch.where(torch.tensor(reachable, device=device), buf.signal_ptrs,
                                  torch.zeros_like(buf.signal_ptrs))
    buf.reachable = reachable
    buf.symmetric_base = region.data_ptr()
    buf.pe_list = [dist.get_global_rank(group, r) for r in range(world_size)]
    buf.pe = torch.tensor(buf.pe_list, dtype=torch.int32, device=device)
    _heap_ready()
    return buf


# ---------------------------------------------------------------------------------------------- module init
# JITFunctions whose compiled modules need nvshmemx_cumodule_init, by id (JITFunction.__hash__ hashes its source)
_REGISTERED: dict = {}
_INITIALISED: set = set()  # CUmodule handles already initialised
_PENDING: list = []  # compiled kernels seen before NVSHMEM was initialised
_STATE = {"ready": False, "installed": None}


def _cumodule_init(module: int) -> None:
    try:
        from torch._C._distributed_c10d import _nvshmemx_cumodule_init
    except ImportError as exc:
        raise NvshmemUnavailableError([("torch", "this torch has no _nvshmemx_cumodule_init (built without NVSHMEM): "
                                        "use a PyPI CUDA build of torch >= 2.8")]) from exc
    _nvshmemx_cumodule_init(module)


def _init_kernel(kernel) -> None:
    """Initialise the CUDA module of one compiled kernel (loading it first), once per module."""
    if not _STATE["ready"]:
        if not any(k is kernel for k in _PENDING):
            _PENDING.append(kernel)
        return
    kernel.run  # noqa: B018 - the property loads the module (Triton loads lazily)
    module = kernel.module
    if module is None or module in _INITIALISED:
        return
    _cumodule_init(module)
    _INITIALISED.add(module)


def _heap_ready() -> None:
    """NVSHMEM is initialised in this process: initialise the modules compiled before."""
    _STATE["ready"] = True
    pending, _PENDING[:] = list(_PENDING), []
    for kernel in pending:
        _init_kernel(kernel)


def _compiled_kernels(fn) -> list:
    """Every compiled specialisation of a JITFunction, on every device."""
    out = []
    for entry in getattr(fn, "device_caches", {}).values():
        cache = entry[0] if isinstance(entry, tuple) else entry
        out += [k for k in cache.values() if hasattr(k, "asm")]
    return out


def _on_unload(module, *args, **kwargs) -> None:
    _INITIALISED.discard(module)


class _PostCompileHook:
    """Triton's ``jit_post_compile_hook``: calls the hook it replaced, then initialises the new kernel's module
    when its function is registered."""

    def __init__(self, previous: Optional[Callable]):
        self.previous = previous

    def __call__(self, *args, **kwargs):
        result = self.previous(*args, **kwargs) if self.previous is not None else None
        info = kwargs.get("fn")
        fn = getattr(info, "jit_function", None)
        if fn is not None and _REGISTERED.get(id(fn)) is fn:
            device = kwargs.get("compile", {}).get("device")
            entry = fn.device_caches[device]
            cache = entry[0] if isinstance(entry, tuple) else entry
            kernel = cache.get(kwargs.get("key"))
            if kernel is not None and hasattr(kernel, "asm"):
                _init_kernel(kernel)
        return result


def register_kernels(*jit_functions) -> None:
    """Initialise NVSHMEM (``nvshmemx_cumodule_init``) in the CUDA module of every compiled specialisation of
    ``jit_functions``: those compiled already, and every later one through Triton's
    ``triton.knobs.runtime.jit_post_compile_hook`` (installed once; a hook set before is kept and called first).
    Modules compiled before the NVSHMEM heap exists are initialised when :func:`create_nvshmem_heap` runs (NVSHMEM
    must be initialised first). Idempotent."""
    import triton
    from triton.runtime.jit import JITFunction

    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - every Triton with an interpreter has it
        InterpretedFunction = ()
    for fn in jit_functions:
        if not isinstance(fn, (JITFunction, InterpretedFunction)):
            raise TypeError(f"register_kernels takes @triton.jit functions, got {type(fn).__name__}")
    # Under TRITON_INTERPRET=1 nothing is compiled (the device calls are emulated): nothing to initialise.
    jit_functions = [fn for fn in jit_functions if isinstance(fn, JITFunction)]
    knobs = triton.knobs.runtime
    if _STATE["installed"] is None or knobs.jit_post_compile_hook is not _STATE["installed"]:
        _STATE["installed"] = _PostCompileHook(knobs.jit_post_compile_hook)
        knobs.jit_post_compile_hook = _STATE["installed"]
        unload = getattr(knobs, "kernel_unload_hook", None)
        if hasattr(unload, "add"):
            unload.add(_on_unload)
    for fn in jit_functions:
        _REGISTERED[id(fn)] = fn
        for kernel in _compiled_kernels(fn):
            _init_kernel(kernel)


def registered_kernels() -> list:
    """The functions passed to :func:`register_kernels` so far."""
    return sorted(_REGISTERED.values(), key=lambda f: getattr(f, "__name__", ""))


def _reset_for_tests(ready: bool = False, functions: Iterable = ()) -> None:
    """Forget registrations and initialised modules (tests only)."""
    _REGISTERED.clear()
    _REGISTERED.update({id(f): f for f in functions})
    _INITIALISED.clear()
    _PENDING.clear()
    _STATE["ready"] = ready
