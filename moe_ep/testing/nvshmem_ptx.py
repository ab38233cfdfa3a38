"""What a kernel linked with NVSHMEM's device bitcode does, read from its compiled PTX (no GPU needed).

Triton issues a scalar extern call from every thread of a program, so the ``nvshmem`` backend may only call
block-scoped (``*_block``) or warp-scoped (``*_warp``, in one-warp programs) transfers: a thread-scoped put,
signal or atomic would run once per thread. :func:`scan_nvshmem_ptx` reports what the sm90 evidence checks
(``perf/sm90_report.py`` and the tests) assert:

- ``ibgda_doorbell``: the IBGDA path rings the NIC doorbell with ``st.mmio.relaxed.sys[.global].b64`` (the
  GPU posts its own RDMA work requests; no CPU proxy). ``doorbell_stores`` counts them.
- ``ibgda_state``: ``nvshmemi_ibgda_device_state_d`` (the IBGDA queue-pair state) is referenced.
- ``device_lib_version``: the NVSHMEM device library release linked in (``nvshmemi_device_lib_version_d``).
- ``entry_points``: the NVSHMEM API functions the kernel calls and their scope: ``block`` / ``warp`` /
  ``warpgroup`` by name suffix, ``ordering`` for the PE-wide ``nvshmem_fence`` / ``nvshmem_quiet``, else
  ``thread``. The bitcode is inlined into the kernel, so its PTX rarely names the API functions; pass the
  kernel's TTIR (``compiled.asm["ttir"]``: every ``tt.extern_elementwise`` symbol) for the exact list. From the
  PTX alone they come from call targets, ``.func`` definitions and LLVM's ``%<callee>.exit`` block labels.
- ``internal``: NVSHMEM's internal transfer routines left as PTX functions, templated on the thread group that
  issues them (``threadgroup_t``: 0 thread, 1 warp, 2 warpgroup, 3 block), e.g.
  ``nvshmemi_transfer_put_signal_dispatch -> ["block"]``. This is scope evidence from the PTX itself.
- ``thread_scoped``: thread-scoped puts / gets / signals / atomics, from the entry points and from the internal
  transfer routines instantiated for a single thread. Must be empty.
"""

from __future__ import annotations

import re
from typing import Optional

__all__ = ["scan_nvshmem_ptx", "entry_scope", "THREADGROUPS"]

#: NVSHMEM's threadgroup_t enumerators (the template argument of its internal routines)
THREADGROUPS = {0: "thread", 1: "warp", 2: "warpgroup", 3: "block"}
_DOORBELL = re.compile(r"\bst\.mmio\.relaxed\.sys(?:\.global)?\.b64\b")
_ORDERING = re.compile(r"^nvshmemx?_(?:fence|quiet)$")
# a transfer or remote update: put / get (bulk, single element _p / _g, strided iput / iget), signal updates,
# atomics; waits and tests are local polls and may be issued by every thread
_TRANSFER = re.compile(r"(put|get|signal_op|signal_add|signal_set|atomic|amo|_p$|_g$)")
_LOCAL = re.compile(r"(wait|test|fence|quiet|region|submit|proxy|barrier|sync)")
_API = re.compile(r"\b(nvshmemx?_[A-Za-z0-9_]+)\b")
_TTIR_SYMBOL = re.compile(r'symbol\s*=\s*"(nvshmemx?_[A-Za-z0-9_]+)"')
_PTX_CALL = re.compile(r"^\s*call(?:\.uni)?\s+(?:\([^)]*\)\s*,\s*)?([A-Za-z_$][\w$]*)", re.M)
_PTX_FUNC = re.compile(r"^\s*(?:\.visible\s+|\.weak\s+|\.extern\s+)*\.func\s+(?:\([^)]*\)\s*)?([A-Za-z_$][\w$]*)", re.M)
_PTX_EXIT = re.compile(r"//\s*%(nvshmemx?_[A-Za-z0-9_]+?)\.exit\b")
_MANGLED = re.compile(r"_Z(\d+)")
_VERSION = re.compile(r"nvshmemi_device_lib_version_d\[\d+\]\s*=\s*\{([\d,\s]+)\}")


def entry_scope(name: str) -> str:
    """Scope of an NVSHMEM API function by its name: ``ordering`` (fence / quiet), ``block``, ``warpgroup``,
    ``warp`` (suffixes ``_block``, ``_warpgroup``, ``_warp``), else ``thread``."""
    if _ORDERING.match(name):
        return "ordering"
    for suffix in ("block", "warpgroup", "warp"):
        if name.endswith("_" + suffix):
            return suffix
    return "thread"


def _is_transfer(name: str) -> bool:
    return bool(_TRANSFER.search(name)) and not _LOCAL.search(name)


def _internal_routines(ptx: str) -> dict:
    """``{routine: sorted scopes}`` of mangled ``nvshmemi_*`` routines instantiated for a threadgroup."""
    found: dict = {}
    for m in _MANGLED.finditer(ptx):
        n = int(m.group(1))
        start = m.end()
        name = ptx[start:start + n]
        if len(name) != n or not name.startswith("nvshmemi_"):
            continue
        tg = re.match(r"IL13threadgroup_t(\d)E", ptx[start + n:start + n + 20])
        if tg is None:
            continue
        scope = THREADGROUPS.get(int(tg.group(1)), f"threadgroup {tg.group(1)}")
        found.setdefault(name, set()).add(scope)
    return {k: sorted(v) for k, v in sorted(found.items())}


def _device_lib_version(ptx: str) -> Optional[str]:
    m = _VERSION.search(ptx)
    if m is None:
        return None
    raw = [int(b) for b in m.group(1).replace(" ", "").split(",") if b]
    raw += [0] * (12 - len(raw))  # trailing zero bytes of the initialiser are omitted
    words = [int.from_bytes(bytes(raw[i:i + 4]), "little") for i in range(0, 12, 4)]
    return ".".join(str(w) for w in words)


def scan_nvshmem_ptx(ptx: str, ttir: Optional[str] = None) -> dict:
    """Scan a kernel's PTX (and optionally its TTIR, for the exact API calls) for NVSHMEM; see the module doc.

    Returns ``links_nvshmem, device_lib_version, ibgda_doorbell, doorbell_stores, ibgda_state, entry_points
    {name: scope}, entry_source ("ttir" or "ptx"), ordering [names], internal {routine: [scopes]},
    thread_scoped [names]``."""
    if ttir is not None:
        names = set(_TTIR_SYMBOL.findall(ttir))
        source = "ttir"
    else:
        names = {n for n in _PTX_CALL.findall(ptx) + _PTX_FUNC.findall(ptx) if _API.fullmatch(n)}
        names |= set(_PTX_EXIT.findall(ptx))
        source = "ptx"
    entry_points = {n: entry_scope(n) for n in sorted(names)}
    internal = _internal_routines(ptx)
    thread_scoped = {n for n, s in entry_points.items() if s == "thread" and _is_transfer(n)}
    thread_scoped |= {f"{n}<thread>" for n, scopes in internal.items() if "thread" in scopes and _is_transfer(n)}
    doorbells = len(_DOORBELL.findall(ptx))
    return {
        "links_nvshmem": "nvshmemi_device_state_d" in ptx or bool(entry_points) or bool(internal),
        "device_lib_version": _device_lib_version(ptx),
        "ibgda_doorbell": doorbells > 0,
        "doorbell_stores": doorbells,
        "ibgda_state": "nvshmemi_ibgda_device_state_d" in ptx,
        "entry_points": entry_points,
        "entry_source": source,
        "ordering": sorted(n for n, s in entry_points.items() if s == "ordering"),
        "internal": internal,
        "thread_scoped": sorted(thread_scoped),
    }
