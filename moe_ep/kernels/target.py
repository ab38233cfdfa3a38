"""The few device operations Triton has no portable op for, each with one body per compile target.

The signalling kernels need a clock, a system-scope fence, a trap and a pause; everything else they do (loads,
stores, atomics with ``sem`` / ``scope``) is Triton's own and compiles for every backend. Each helper here picks its
body from the target the kernel is being compiled FOR (:func:`on_hip`, read from the compiler's options, so an
ahead-of-time compile for ``gfx942`` on a machine without a GPU takes the AMD body), and a third body under the Triton
interpreter, where the kernel runs as Python on the host:

=============  ====================================  ====================================================  ==========
helper         NVIDIA (PTX)                          AMD CDNA3 (gfx942)                                    interpreter
=============  ====================================  ====================================================  ==========
``now_ns``     ``%globaltimer`` (ns)                 ``s_memrealtime`` (100 MHz constant clock) x 10       host clock
``fence_sys``  ``fence.acq_rel.sys``                 ``buffer_wbl2 sc0 sc1`` + waits + ``buffer_inv``      nothing
``trap``       ``trap``                              ``s_trap 2``                                          nothing
``pause``      ``nanosleep.u32 32``                  ``s_sleep 1``                                         nothing
=============  ====================================  ====================================================  ==========

The clocks come from Triton itself (``triton.language.extra.{cuda,hip}.utils``); the AMD fence is the sequence the
LLVM AMDGPU memory model gives for a system-scope acquire-release fence on GFX942. ``tests/test_target_amd.py``
compiles the signalling kernels for ``gfx942`` on CPU.
"""

from __future__ import annotations

import time

import triton
import triton.language as tl
from triton.language.extra.cuda.utils import globaltimer as _globaltimer
from triton.language.extra.hip.utils import memrealtime as _memrealtime

from .pdl import INTERPRET

__all__ = ["on_hip", "now_ns", "fence_sys", "trap", "pause", "SPIN_HOOKS"]

SPIN_HOOKS: list = []  # interpreter only: called on every clock read (every spin of a wait), e.g. the emulated NIC


@tl.core.builtin
def on_hip(_semantic=None, _builder=None):
    """Compile-time bool: the kernel is being compiled for an AMD GPU (the compiler's options, not the machine's
    driver: an ahead-of-time compile for another target gets that target's answer)."""
    builder = _semantic.builder if _semantic is not None else _builder
    options = getattr(builder, "options", None)
    return tl.constexpr(type(options).__name__ == "HIPOptions")


def _host_monotonic_ns():
    for hook in SPIN_HOOKS:
        hook()
    return time.monotonic_ns()


if INTERPRET:
    @triton.jit
    def now_ns():
        """Nanoseconds from an arbitrary origin (host clock: this is the interpreter build)."""
        return _host_monotonic_ns()

    @triton.jit
    def fence_sys():
        """(Interpreter build: programs run one at a time, every store is visible at once.)"""
        pass

    @triton.jit
    def trap():
        """(Interpreter build: a kernel cannot trap; the status word reports as usual.)"""
        pass

    @triton.jit
    def pause():
        """(Interpreter build: nothing to yield to.)"""
        pass
else:
    @triton.jit
    def now_ns():
        """Nanoseconds from an arbitrary origin: ``%globaltimer`` (NVIDIA), the 100 MHz ``s_memrealtime`` counter x 10
        (AMD CDNA)."""
        if on_hip():
            t = _memrealtime() * 10
        else:
            t = _globaltimer()
        return t

    @triton.jit
    def fence_sys():
        """A system-scope acquire-release fence: this thread's earlier memory operations (and, after a
        ``tl.debug_barrier()``, its block's) are ordered before its later ones for every observer that orders its
        own reads with an acquire."""
        if on_hip():
            tl.inline_asm_elementwise("buffer_wbl2 sc0 sc1\n\ts_waitcnt vmcnt(0) lgkmcnt(0)\n\tbuffer_inv sc0 sc1\n\t"
                                      "v_mov_b32 $0, 0", "=v", [], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise("fence.acq_rel.sys;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                      is_pure=False, pack=1)

    @triton.jit
    def trap():
        """Abort the kernel: the CUDA / HIP context fails loudly, also inside a replayed graph."""
        if on_hip():
            tl.inline_asm_elementwise("s_trap 2\n\tv_mov_b32 $0, 0", "=v", [], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise("trap;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def pause():
        """Yield the issue slot for a moment between polls of a signal word (tens of ns)."""
        if on_hip():
            tl.inline_asm_elementwise("s_sleep 1\n\tv_mov_b32 $0, 0", "=v", [], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise("nanosleep.u32 32;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                      is_pure=False, pack=1)
