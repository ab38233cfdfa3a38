"""The signalling kernels compile for AMD too (``gfx942``, ahead of time, no GPU needed): their clock, fence, trap
and pause come from :mod:`moe_ep.kernels.target`, which picks the body for the target being compiled for, and
everything else they do is Triton's own. Also checks that the NVIDIA build still gets the PTX bodies."""

from __future__ import annotations

from moe_ep.testing.sm90 import compile_in_subprocess

# argv[1]: [target args, case names]; prints {case name: the AMD GCN or PTX text of its first configuration}
_SCRIPT = r"""
import json, os, sys
import moe_ep
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(moe_ep.__file__)), "perf"))
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import sm90_report as R
target, names = json.loads(sys.argv[1])
out = {}
for c in R.CASES:
    if c.kernel is None or c.name not in names or c.name in out or "PDL" in c.config:
        continue
    opts = {"num_warps": c.num_warps, "num_stages": c.num_stages,
            **{k: v for k, v in (c.options or {}).items() if k != "maxnreg"}}
    ck = triton.compile(ASTSource(c.kernel, c.signature, c.constexprs, c.attrs or {}), target=GPUTarget(*target),
                        options=opts)
    out[c.name] = ck.asm.get("amdgcn") or ck.asm.get("ptx")
print(json.dumps(out))
"""


def _compile(target_args, kernels: tuple[str, ...]) -> dict:
    """The named sm90-report cases (their first configuration each) compiled for a target, in a child process without
    TRITON_INTERPRET (the helpers are defined per build at import)."""
    return compile_in_subprocess(_SCRIPT, [list(target_args), list(kernels)], "the signalling kernels",
                                 target=str(target_args[1]))


_KERNELS = ("ll_dispatch_send", "ll_combine_send_fmt", "ll_combine_recv", "normal_send")


def test_signalling_kernels_compile_for_gfx942():
    asm = _compile(("hip", "gfx942", 64), _KERNELS)
    assert set(asm) == set(_KERNELS)
    for name, text in asm.items():
        assert "globaltimer" not in text and "fence.acq_rel" not in text, name  # no PTX left in an AMD build
    assert "s_memrealtime" in asm["ll_dispatch_send"]  # the clock of the bounded waits
    assert "buffer_wbl2" in asm["ll_combine_send_fmt"]  # the fence between the stamp headers and the rows
    assert "s_sleep" in asm["ll_combine_recv"]  # the pause between polls


def test_signalling_kernels_keep_their_ptx_bodies_on_sm90():
    asm = _compile(("cuda", 90, 32), ("ll_dispatch_send", "ll_combine_send_fmt"))
    assert "%globaltimer" in asm["ll_dispatch_send"] and "nanosleep" in asm["ll_dispatch_send"]
    assert "fence.acq_rel.sys" in asm["ll_combine_send_fmt"]
