"""The NVSHMEM device library (LLVM bitcode) that Triton links into every kernel calling NVSHMEM: where it is, what
wrote it, whether this Triton can link it.

- :func:`find_device_bitcode` / :func:`extern_libs` / :func:`launch_options`: the bitcode Triton links into every
  kernel that calls NVSHMEM (declared in :mod:`moe_ep.kernels.nvshmem_device`). The ``nvidia-nvshmem-cu12`` 3.8.0
  wheel ships one file per architecture (``libnvshmem_device_sm_90.bc`` ...) and no ``libnvshmem_device.bc``; other
  installs ship the single file.
- :func:`check_triton_link`: this Triton's bundled LLVM can read that bitcode (an LLVM reads bitcode of its own or an
  older release only); :func:`extern_libs` and :func:`moe_ep.nvshmem.checks.check_available` raise
  :class:`NvshmemUnavailableError` naming both versions and what to install when it cannot.
- :func:`check_ibgda_bitcode`: the bitcode has NVSHMEM's IBGDA device code.

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

Also here: :class:`NvshmemUnavailableError` and the wheel this package pins (:data:`WHEEL`). Nothing here imports
Triton or touches CUDA at import time. Part of :mod:`moe_ep.nvshmem`, which re-exports every name.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import mmap
import os
import re
from typing import Optional

from ..errors import MoEEPError

__all__ = ["WHEEL", "WHEEL_VERSION", "INSTALL_HINT", "NvshmemUnavailableError",
           "search_dirs", "find_device_bitcode", "extern_libs", "launch_options", "MAXNREG",
           "check_triton_link", "check_ibgda_bitcode",
           "bitcode_llvm_version", "triton_llvm_version", "bitcode_nvshmem_version", "bitcode_has_ibgda",
           "TRITON_LLVM", "NVSHMEM_BITCODE"]

WHEEL = "nvidia-nvshmem-cu12"
WHEEL_VERSION = "3.8.0"
INSTALL_HINT = f"pip install 'moe-ep[nvshmem]' (it pins {WHEEL}=={WHEEL_VERSION})"


class NvshmemUnavailableError(MoEEPError, RuntimeError):
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


# ---------------------------------------------------------------------------------------------- NVSHMEM release
# (the host-library check in checks.py compares the same readings)
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


# ---------------------------------------------------------------------------------------------- the bitcode checks
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
