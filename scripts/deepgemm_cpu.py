"""Run DeepGEMM's own test functions, unchanged, on the CPU through moe-ep's ``deep_gemm`` alias, case by case.

    python scripts/deepgemm_cpu.py /path/to/DeepGEMM [test_fp8_fp4.py:test_gemm test_layout.py ...]

Each argument is ``tests/<file>`` (every test function of the file, in its ``__main__`` order) or
``<file>:<function>``; the default is ``test_fp8_fp4.py:test_gemm test_layout.py``. What it provides around the
test files (they and their ``generators.py`` are executed as written):

- ``import deep_gemm`` is moe-ep (:mod:`moe_ep.alias`: ``moe_ep.gemm``, ``deep_gemm.utils`` is ``moe_ep.gemm.utils``).
- ``deep_gemm.testing`` (pure PyTorch: ``calc_diff``, ``count_bytes``, ``bench_kineto`` ...) is loaded from the
  checkout under its own name. ``DG_USE_NVIDIA_TOOLS=1`` is set, DeepGEMM's own switch that makes
  ``bench_kineto`` return 1 s without running or profiling anything: there is no benchmark on the CPU, and the
  "Perf" lines the tests print are meaningless here.
- The architecture is sm90 (``torch.cuda.get_device_capability`` answers ``(9, 0)``): the generators enumerate the
  sm90 recipes (1D2D kernels, 128x128 weight blocks, the wgrad recipe ``(1, 1, 128)``, no FP4, no UE8M0 GEMMs).
- ``deep_gemm.utils`` names moe-ep does not provide and that only FP4 paths use (``per_token_cast_to_fp4``,
  ``transpose_packed_fp4``: sm100) are taken from the checkout's ``deep_gemm/utils/math.py`` so that
  ``generators.py`` imports; no sm90 case calls them. They are listed on the first output line.
- Device mapping: tensors asked on ``device='cuda'`` are made on the CPU (``scripts/deepep_cpu.py``'s mode);
  ``torch.cuda.synchronize`` is a no-op. ``TRITON_INTERPRET=1`` unless set.
- Shapes: DeepGEMM's shapes (M up to 4096, N up to 32768, K up to 16384) would take hours on the interpreter.
  The generator functions (``generators.enumerate_*``) are wrapped at import time: every case keeps its
  recipe, layout, majors, accumulation and output dtype, and each dimension above a cap is cut to
  ``cap + dim % mod`` (so unaligned tails, e.g. N 2112 = 16.5 x 128 or the 4097 / 7296 layout cases, keep
  their remainder). See ``SHRINK`` below.
- Per case: each test function is run once per case its generator yields (the generator is replayed up to that
  case, so its seeds and alignment settings are as in a whole run); a case passes when the function returns.
  Functions that skip themselves on sm90 (they print "Skipped") count their cases as skipped, with the reason.
"""

from __future__ import annotations

import importlib.util
import io
import os
import sys
import time
import traceback
import types
from contextlib import redirect_stdout

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ["DG_USE_NVIDIA_TOOLS"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from deepep_cpu import CudaToCpu  # noqa: E402

DEFAULT = ("test_fp8_fp4.py:test_gemm", "test_layout.py")
FP4_ONLY = ("per_token_cast_to_fp4", "transpose_packed_fp4")


def _cut(x: int, cap: int, mod: int) -> int:
    return x if x <= cap else cap + x % mod


def _mn(x):  # GEMM M / N: 4096 -> 256, 2112 -> 320, 1 and 128 unchanged
    return _cut(x, 256, 128)


def _k(x):  # GEMM K: two to three 128-blocks
    return _cut(x, 256, 128)


def _ks(ks):  # k-grouped K lists (multiples of the alignment, some 0)
    return [_cut(k, 512, 512) for k in ks]


# generator name -> function of one yielded case to the CPU-sized case (same arity, same non-shape fields)
SHRINK = {
    "enumerate_normal": lambda c: (c[0], c[1], _mn(c[2]), _mn(c[3]), _k(c[4])) + tuple(c[5:]),
    "enumerate_m_grouped_contiguous": lambda c: (c[0], c[1], min(c[2], 4), _cut(c[3], 96, 128),
                                                 _mn(c[4]), _k(c[5])) + tuple(c[6:]),
    "enumerate_m_grouped_masked": lambda c: (c[0], c[1], min(c[2], 4), 256, min(c[4], 160), _mn(c[5]), _k(c[6]), c[7]),
    "enumerate_k_grouped_contiguous": lambda c: (min(c[0], 4), _mn(c[1]), _mn(c[2]), c[3], c[4], _ks(c[5][:4]),
                                                 _ks(c[6][:4]), _cut(c[7], 512, 512)) + tuple(c[8:]),
    "enumerate_sf_layout": lambda c: (_cut(c[0], 256, 256), _cut(c[1], 512, 512)) + tuple(c[2:]),
    "enumerate_k_grouped_sf_layout": lambda c: (_cut(c[0], 256, 256), _ks(c[1]), c[2], c[3]),
    "enumerate_k_grouped_psum_sf_layout": lambda c: c,
}


def _load(name: str, path: str, package: bool = False) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(
        name, path, submodule_search_locations=[os.path.dirname(path)] if package else None)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def setup(checkout: str) -> list:
    import moe_ep.alias

    moe_ep.alias.install(["deep_gemm"])
    import deep_gemm.utils as dg_utils

    testing = os.path.join(checkout, "deep_gemm", "testing")
    for sub in ("bench", "numeric", "utils"):  # loaded first: the alias would look for them under moe_ep.gemm
        _load(f"deep_gemm.testing.{sub}", os.path.join(testing, f"{sub}.py"))
    _load("deep_gemm.testing", os.path.join(testing, "__init__.py"), package=True)
    filled = [n for n in FP4_ONLY if not hasattr(dg_utils, n)]
    if filled:
        theirs = _load("_deepgemm_checkout_math", os.path.join(checkout, "deep_gemm", "utils", "math.py"))
        for n in filled:
            setattr(dg_utils, n, getattr(theirs, n))
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda device=None: None
    sys.path.insert(0, os.path.join(checkout, "tests"))
    gen = _load("generators", os.path.join(checkout, "tests", "generators.py"))
    for name, shrink in SHRINK.items():
        orig = getattr(gen, name, None)
        if orig is not None:
            setattr(gen, name, (lambda o, s: lambda *a, **kw: (s(tuple(c)) for c in o(*a, **kw)))(orig, shrink))
    return filled


def _count(gen_fn) -> int:
    """Cases a generator yields (called as the test files call it: with the FP8 dtype, or with nothing)."""
    try:
        return sum(1 for _ in gen_fn(torch.float8_e4m3fn))
    except TypeError:
        return sum(1 for _ in gen_fn())


class _Stop(Exception):
    pass


def _only(gen_fn, index: int):
    """The generator replayed up to case ``index`` (its side effects: seeds, alignment), yielding that one."""
    def one(*a, **kw):
        for i, c in enumerate(gen_fn(*a, **kw)):
            if i == index:
                yield c
                return
    return one


def run_function(mod, fname: str, totals: dict) -> None:
    fn = getattr(mod, fname)
    gens = [n for n in SHRINK if fn.__code__.co_names and n in fn.__code__.co_names]
    if not gens:  # no generator: one case
        gens = [None]
    gname = gens[0]
    if gname is None:
        cases = [None]
    else:
        orig = getattr(mod, gname)
        # the arguments the function passes its generator: call it once with a recorder that stops it there
        seen = []

        def recording(*a, **kw):
            seen.append((a, kw))
            raise _Stop
        setattr(mod, gname, recording)
        buf = io.StringIO()
        early = None
        try:
            with redirect_stdout(buf), CudaToCpu():
                fn()
        except _Stop:
            pass
        except Exception as e:  # noqa: BLE001 - failed before its first case (e.g. a function the face lacks)
            early = e
        finally:
            setattr(mod, gname, orig)
        if early is not None:
            n = _count(orig)
            totals["failed"] += n
            print(f"{mod.__name__}.{fname}: 0/{n} cases passed, {n} failed before the first case: "
                  f"{type(early).__name__}: {str(early)[:200]}", flush=True)
            return
        if not seen:  # returned before enumerating (an sm100-only function): its cases count as skipped
            n = _count(orig)
            out = buf.getvalue().strip()
            reason = out.splitlines()[-1].strip(" >") if out else "returned without testing"
            totals["skipped"] += n
            print(f"{mod.__name__}.{fname}: {n} cases skipped ({reason})", flush=True)
            return
        cases = list(orig(*seen[0][0], **seen[0][1]))
    passed = failed = 0
    t0 = time.time()
    for i, case in enumerate(cases):
        if gname is not None:
            setattr(mod, gname, _only(orig, i))
        buf = io.StringIO()
        try:
            with redirect_stdout(buf), CudaToCpu():
                fn()
            passed += 1
        except Exception as e:  # noqa: BLE001 - a case fails on any error, reported with its case
            failed += 1
            where = traceback.extract_tb(e.__traceback__)[-1]
            print(f"  FAIL {fname} case {i}: {_fmt(case)}: {type(e).__name__}: {str(e)[:300]} "
                  f"({os.path.basename(where.filename)}:{where.lineno})", flush=True)
        finally:
            if gname is not None:
                setattr(mod, gname, orig)
    totals["passed"] += passed
    totals["failed"] += failed
    print(f"{mod.__name__}.{fname}: {passed}/{len(cases)} cases passed, {failed} failed "
          f"({time.time() - t0:.0f} s)", flush=True)


def _fmt(case) -> str:
    if case is None:
        return "-"
    case = tuple(f"gran_k={x.gran_k_a}/{x.gran_k_b}" if hasattr(x, "gran_k_a") else x for x in case)
    return "(" + ", ".join(getattr(x, "name", None) or (f"{x}" if not isinstance(x, list) or len(x) < 6
                                                     else f"[{len(x)} ks]") for x in case) + ")"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    checkout, targets = argv[0], argv[1:] or list(DEFAULT)
    if not os.path.isfile(os.path.join(checkout, "tests", "generators.py")):
        print(f"{checkout} is not a DeepGEMM checkout (no tests/generators.py)", file=sys.stderr)
        return 2
    filled = setup(checkout)
    print(f"deep_gemm = moe_ep.gemm; FP4-only names from the checkout: {filled or 'none'}", flush=True)
    torch.manual_seed(0)
    totals = {"passed": 0, "failed": 0, "skipped": 0}
    for target in targets:
        fname, _, func = target.partition(":")
        with CudaToCpu():
            mod = _load(fname[:-3], os.path.join(checkout, "tests", os.path.basename(fname)))
        funcs = [func] if func else [n for n in vars(mod) if n.startswith("test_") and callable(getattr(mod, n))
                                     and getattr(getattr(mod, n), "__module__", None) == mod.__name__]
        for f in funcs:
            run_function(mod, f, totals)
    print(f"deepgemm tests: {totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped")
    return 0 if totals["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
