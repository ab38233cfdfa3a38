"""Run vLLM's and SGLang's own quant kernel test files, unchanged, against moe_ep.quant on a CPU machine.

Usage (from the checkout root; the test files are public engine code, saved outside the repo)::

    python scripts/run_engine_quant_tests.py TEST_FILE.py [TEST_FILE.py ...] [--vllm-platform cuda|triton]
        [--sys-path DIR] [-k EXPR] [--full] [--reciprocal] [--interpreter-cast gpu|as-is] [--timeout S]

Each file runs in its own subprocess, with the python of the engine venv it imports (``--vllm-python`` / ``--sglang-
python``, default ``~/.cache/moe-ep-engine-client/venv-{vllm-0.33.0,sglang-0.5.23}/bin/python``, as the engine-client
harness builds them), under ``TRITON_INTERPRET=1``. The engines' kernel entry points the files reach are bound to thin
adapters over moe_ep's ops (vLLM: ``persistent_masked_m_silu_mul_quant``, ``torch.ops._C.per_token_group_fp8_quant`` /
``per_token_group_fp8_quant_packed``; SGLang: ``fp8_kernel.per_token_group_quant``); the engines' references (their
Triton kernels, run by the interpreter, and the files' torch references) stay theirs. ``device="cuda"`` in the files
becomes "cpu"; vLLM's platform answers as a CUDA platform (``--vllm-platform cuda``: the files compare against vLLM's
CUDA-kernel arithmetic) or as a CUDA-alike platform without ``is_cuda()`` (``triton``: the files' float32 Triton-
fallback references). SGLang's reference needs DeepGEMM's ``transform_sf_into_required_layout``; it gets a torch
transcription of DeepGEMM's packed-UE8M0 rule written here (not moe_ep's). The interpreter's float -> e4m3 cast in
those references rounds ties away from zero; by default it gets the GPU's round-to-nearest-even (``--interpreter-cast
as-is`` keeps it). ``--reciprocal`` binds ``reciprocal_multiply_quant_fp8`` (``x * (1 / scale)``) in place of the
exact ops. Cases whose shapes take minutes in the interpreter are deselected unless ``--full`` (listed as "cut"); int8
cases (not an op of moe_ep) are always deselected. Prints per file the passed / failed / skipped / cut counts and, per
failing case, its first assertion message on one line. Not part of the pytest suite: it needs the engine venvs and the
saved files (SGLang's file also needs sgl-kernel's ``sgl_kernel/test_utils.py`` on ``--sys-path``)."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENVS = Path.home() / ".cache" / "moe-ep-engine-client"

# Cases whose inputs are too big for the interpreter on a shared CPU (well over 20 s each), by parameter id.
# vLLM silu-mul: E * T * H above 2**23 (8 x 512 x 7168 and up, 256 x 8 x 7168 and up); SGLang: every case of the
# masked sweep (its x is [288 / ranks, 768 * ranks, 4096] whatever num_tokens is) and hidden * tokens above 2**22.
def _too_slow(engine: str, name: str, params: dict) -> bool:
    if engine == "vllm" and "E" in params:
        return params["E"] * params["T"] * params["H"] > 2**23
    if engine == "vllm" and "num_tokens" in params:
        return params["num_tokens"] * params["hidden_dim"] > 2**20
    if engine == "sglang":
        flags = params.get("flags", {})
        if flags.get("masked_layout_mode") is not None:
            return True  # x is [288 / ranks, 768 * ranks, 4096] bf16 (1.8 GB) whatever num_tokens: > 300 s
        return params["num_tokens"] * params["hidden_dim"] * (2 if flags.get("fuse_silu_and_mul") else 1) > 2**22
    return False


def _not_ours(engine: str, name: str, params: dict) -> bool:
    import torch
    return "int8" in name or params.get("dst_dtype") is torch.int8


# ---------------------------------------------------------------------------------------------
# Child: patches, adapters, pytest
# ---------------------------------------------------------------------------------------------

def _cpu(d):
    import torch
    if isinstance(d, str) and d.startswith("cuda"):
        return "cpu"
    if isinstance(d, torch.device) and d.type == "cuda":
        return torch.device("cpu")
    return d


def _install_cpu_device() -> None:
    """``device="cuda"`` (strings, torch.device, ``torch.Generator(device=...)``) becomes the CPU."""
    import torch
    from torch.overrides import TorchFunctionMode

    class CudaToCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = {k: _cpu(v) for k, v in (kwargs or {}).items()}
            if func is torch.Tensor.cuda:
                return args[0]
            return func(*[_cpu(a) for a in args], **kwargs)

    CudaToCpu().__enter__()

    class Generator(torch.Generator):
        def __new__(cls, device="cpu"):
            return torch._C.Generator(_cpu(device))

    torch.Generator = Generator


def _ops(reciprocal: bool):
    """moe_ep's two ops, or both as ``reciprocal_multiply_quant_fp8`` (``x * (1 / scale)``; it has no
    ``round_product`` and no ``eps``: the product stays float32, the floor 1e-4)."""
    from moe_ep import quant

    if not reciprocal:
        return quant.per_token_group_quant_fp8, quant.silu_and_mul_quant_fp8

    def plain_quant(x, group_size=128, *, eps=1e-4, **kw):  # (its floor stays 1e-4)
        return quant.reciprocal_multiply_quant_fp8(x, group_size, **kw)

    def silu_quant(x, group_size=128, *, round_product=False, bf16_math=False, eps=1e-4, **kw):
        return quant.reciprocal_multiply_quant_fp8(x, group_size, silu=True, **kw)

    return plain_quant, silu_quant


def _install_gpu_fp8_cast() -> None:
    """The interpreter's float -> e4m3 cast (Triton 3.9 ``_convert_float``) rounds a tie away from zero (336 ->
    352, 17 -> 18) where the GPU's ``cvt.rn.satfinite.e4m3x2.f32`` rounds to nearest even; the engines' Triton
    references cast with ``.to(fp8)``, moe_ep's kernels do not. Give the references the GPU's rounding
    (torch's round-to-nearest-even cast)."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter as interp

    real = interp.InterpreterBuilder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        s, d = src.dtype.scalar, dst_type.scalar
        if d != tl.float8e4nv or s not in (tl.float32, tl.float16, tl.bfloat16):
            return real(self, src, dst_type, rounding_mode)
        f32 = src if s == tl.float32 else self.cast_impl(src, tl.float32) if s == tl.bfloat16 else \
            interp.TensorHandle(src.data.astype(np.float32), tl.float32)
        x = torch.from_numpy(np.ascontiguousarray(f32.data, dtype=np.float32))
        return interp.TensorHandle(x.to(torch.float8_e4m3fn).view(torch.uint8).numpy(), d)

    interp.InterpreterBuilder.create_fp_to_fp = create_fp_to_fp


def _vllm_adapters(platform_mode: str, reciprocal: bool) -> None:
    import torch
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    class CpuAsCuda(CpuPlatform):
        """vLLM's CPU platform answering the device checks as the files' GPU platform would (device_type stays
        "cpu"). ``is_cuda_alike()`` is derived from ``is_cuda()`` so that the files' ``patch(... is_cuda ...)``
        selects vLLM's Triton reference as on a CUDA build of vLLM."""
        def is_cuda(self):
            return platform_mode == "cuda"

        def is_cuda_alike(self):
            return self.is_cuda() or platform_mode == "triton"

        def is_xpu(self):
            return False

        def is_rocm(self):
            return False

        def has_device_capability(self, capability, device_id=0):
            return False  # sm90, not sm100: the files' DeepGEMM-sm100 transform stays off

        @classmethod
        def fp8_dtype(cls):
            return torch.float8_e4m3fn

    # Import on vLLM's CPU platform (import-time CUDA queries stay off), then swap the platform object in
    # vllm.platforms and in every vLLM module that bound it.
    from vllm.utils.deep_gemm import DeepGemmQuantScaleFMT
    import vllm.model_executor.layers.fused_moe.experts.batched_deep_gemm_moe as bdg
    import vllm.model_executor.layers.quantization.utils.fp8_utils  # noqa: F401
    import vllm.model_executor.layers.quantization.utils.int8_utils  # noqa: F401

    old, new = vllm.platforms.current_platform, CpuAsCuda()
    vllm.platforms._current_platform = new
    for name, mod in list(sys.modules.items()):
        if name.startswith("vllm") and getattr(mod, "current_platform", None) is old:
            mod.current_platform = new

    per_token_group_quant_fp8, silu_and_mul_quant_fp8 = _ops(reciprocal)

    def persistent_masked_m_silu_mul_quant(y, tokens_per_expert, num_parallel_tokens=16, group_size=128,
                                           quant_scale_fmt=DeepGemmQuantScaleFMT.FLOAT32):
        # vLLM's documented outputs: FLOAT32 -> f32 [E, T, G] strides (T*G, 1, T); FLOAT32_CEIL_UE8M0 -> the same,
        # powers of two; UE8M0 -> int32 [E, T, ceil(G/4)] strides (T*ceil(G/4), 1, T) (column-major, no TMA pad).
        # vLLM's CUDA kernel computes in bf16 (bf16_math); its Triton fallback (what the file's reference models on
        # a CUDA-alike platform without is_cuda()) keeps float32.
        kw = {"column_major_scales": True, "masked_m": tokens_per_expert}
        if platform_mode == "cuda":
            kw["bf16_math"] = True
        if quant_scale_fmt == DeepGemmQuantScaleFMT.FLOAT32_CEIL_UE8M0:
            kw["use_ue8m0"] = True
        elif quant_scale_fmt == DeepGemmQuantScaleFMT.UE8M0:
            kw["scale_ue8m0"] = True
        return silu_and_mul_quant_fp8(y, group_size, **kw)

    bdg.persistent_masked_m_silu_mul_quant = persistent_masked_m_silu_mul_quant

    def per_token_group_fp8_quant(x, x_q, x_s, group_size, eps, fp8_min, fp8_max, use_ue8m0,
                                  column_major_scales, tma_aligned_scales):
        # vLLM: use_ue8m0 = float32 powers of two; tma_aligned_scales only means something with column_major.
        # vLLM's CUDA kernels floor a UE8M0 scale at 1e-10 before rounding it (pow2_scale_floor).
        per_token_group_quant_fp8(x, group_size, column_major_scales=column_major_scales,
                                  tma_aligned_scales=column_major_scales and tma_aligned_scales,
                                  use_ue8m0=use_ue8m0, out=x_q, out_scales=x_s, eps=eps, pow2_scale_floor=1e-10)

    def per_token_group_fp8_quant_packed(x, x_q, x_s_packed, group_size, eps, fp8_min, fp8_max):
        # DeepGEMM's packed words, MN-major, TMA-aligned column stride (vLLM allocates them so).
        per_token_group_quant_fp8(x, group_size, scale_ue8m0=True, tma_aligned_scales=True, out=x_q,
                                  out_scales=x_s_packed, eps=eps, pow2_scale_floor=1e-10)

    torch.ops._C.per_token_group_fp8_quant = per_token_group_fp8_quant
    torch.ops._C.per_token_group_fp8_quant_packed = per_token_group_fp8_quant_packed


def _deepgemm_packed_ue8m0(sf, mn, k, recipe=None, num_groups=None, is_sfa=None, **_):
    """DeepGEMM's ``transform_sf_into_required_layout`` for float32 1x128 power-of-two activation scales on sm100:
    exponent bytes packed 4 to an int32 along K (padding groups 0), MN-major, MN padded to a multiple of 4."""
    import torch
    assert sf.dtype == torch.float32 and tuple(recipe)[-2:] == (128, 128) and is_sfa, (recipe, is_sfa)
    sf = sf if sf.dim() == 3 else sf.unsqueeze(0)
    lead, g = sf.shape[0], sf.shape[-1]
    words, mn4 = (g + 3) // 4, (mn + 3) // 4 * 4
    e = (sf.contiguous().view(torch.int32) >> 23) & 0xFF
    e = torch.nn.functional.pad(e, (0, 4 * words - g)).view(lead, mn, words, 4)
    packed = e[..., 0] | (e[..., 1] << 8) | (e[..., 2] << 16) | (e[..., 3] << 24)
    store = torch.zeros(lead, words, mn4, dtype=torch.int32, device=sf.device)
    store[..., :mn] = packed.transpose(-1, -2)
    out = store.transpose(-1, -2)[..., :mn, :]
    return out if num_groups is not None else out[0]


def _sglang_adapters(reciprocal: bool) -> None:
    import types

    from sglang.kernels.ops.quantization import fp8_kernel as fk
    from sglang.test.kernels import per_token_group_quant as ref_mod

    per_token_group_quant_fp8, silu_and_mul_quant_fp8 = _ops(reciprocal)

    def per_token_group_quant(input, output_q=None, output_s=None, group_size=128, scale_ue8m0=False,
                              fuse_silu_and_mul=False, masked_m=None, expected_m=None, **kw):
        # SGLang's kernel floors amax at 1e-10 (it bakes eps in): eps=1e-10 below
        # SGLang infers the layout from output_s: contiguous -> row-major; transposed -> column-major, its column
        # stride T padded to 4 (TMA) or not; int32 -> packed UE8M0 words. Legacy SiLU rounds act and product.
        assert output_q is not None and output_s is not None and not kw, kw
        m, g = output_s.shape[-2], output_s.shape[-1]
        col = (g > 1 and output_s.stride(-1) != 1) or (g == 1 and m > 1 and output_s.stride(-2) == 1)
        tma = col and g > 1 and output_s.stride(-1) != m
        opts = {"column_major_scales": col, "tma_aligned_scales": tma, "scale_ue8m0": scale_ue8m0,
                "out": output_q, "out_scales": output_s, "masked_m": masked_m, "eps": 1e-10}
        if fuse_silu_and_mul:
            silu_and_mul_quant_fp8(input, group_size, round_product=True, **opts)
        else:
            per_token_group_quant_fp8(input, group_size, **opts)

    fk.per_token_group_quant = per_token_group_quant
    # The file's import path at its commit; 0.5.23 moved the same functions (Triton reference and production
    # entry) to sglang.test.kernels.per_token_group_quant.
    mod = types.ModuleType("sglang.srt.layers.quantization.fp8_kernel")
    mod.per_token_group_quant_8bit = ref_mod.triton_per_token_group_quant_8bit
    mod.sglang_per_token_group_quant_8bit = ref_mod.sglang_per_token_group_quant_8bit
    sys.modules[mod.__name__] = mod
    dg = types.ModuleType("deep_gemm")
    dg.transform_sf_into_required_layout = _deepgemm_packed_ue8m0
    sys.modules["deep_gemm"] = dg


class _Collector:
    import pytest as _pytest

    def __init__(self, engine: str, full: bool, json_path: str = ""):
        self.engine, self.full, self.json = engine, full, json_path
        self.cases: dict[str, dict] = {}
        self.cut: list[str] = []
        self.not_ours: list[str] = []

    @_pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, session, config, items):  # after -k
        keep = []
        for it in items:
            params = getattr(getattr(it, "callspec", None), "params", {})
            if _not_ours(self.engine, it.name, params):
                self.not_ours.append(it.nodeid)
            elif not self.full and _too_slow(self.engine, it.name, params):
                self.cut.append(it.nodeid)
            else:
                keep.append(it)
        config.hook.pytest_deselected(items=[it for it in items if it not in keep])
        items[:] = keep

    def dump(self, path: str) -> None:
        Path(path).write_text(json.dumps({"cases": self.cases, "cut": self.cut, "not_ours": self.not_ours}))

    def pytest_runtest_logreport(self, report):
        if report.when == "teardown" and self.json:
            self.dump(self.json)  # partial results survive a timeout
        c = self.cases.setdefault(report.nodeid, {"outcome": "passed", "message": "", "seconds": 0.0})
        c["seconds"] += report.duration
        if report.skipped and c["outcome"] == "passed":
            c["outcome"] = "skipped"
        elif report.failed and c["outcome"] != "failed":
            c["outcome"] = "failed"
            crash = getattr(report.longrepr, "reprcrash", None)
            msg = crash.message if crash is not None else str(report.longrepr)
            c["message"] = re.sub(r"\s+", " ", msg)[:400]


def _child(args) -> int:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    # vLLM keeps Triton on (for its references) with no active GPU driver only when CUDA_VISIBLE_DEVICES is set
    # and empty (its distributed-init case); the interpreter needs no driver.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    for p in [str(ROOT), *args.sys_path]:
        sys.path.insert(0, p)
    import pytest
    import torch

    real_available = torch.cuda.is_available
    _install_cpu_device()
    if args.interpreter_cast == "gpu":
        _install_gpu_fp8_cast()
    if args.engine == "vllm":
        _vllm_adapters(args.vllm_platform, args.reciprocal)
    else:
        _sglang_adapters(args.reciprocal)
    torch.cuda.is_available = lambda: True  # the files' skipif(not torch.cuda.is_available()), read at import
    col = _Collector(args.engine, args.full, args.json)

    class Restore:
        def pytest_collection_finish(self, session):
            torch.cuda.is_available = real_available

    pytest_args = [args.file, "-q", "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning",
                   "--rootdir", str(Path(args.file).parent), "-o", "addopts=", "-s" if args.verbose else "-q"]
    if args.k:
        pytest_args += ["-k", args.k]
    pytest.main(pytest_args, plugins=[col, Restore()])
    col.dump(args.json)
    return 0


# ---------------------------------------------------------------------------------------------
# Parent: one subprocess per file, summary
# ---------------------------------------------------------------------------------------------

def _engine_of(path: Path) -> str:
    text = path.read_text()
    if re.search(r"^\s*(from|import) vllm", text, re.M):
        return "vllm"
    if re.search(r"^\s*(from|import) (sglang|sgl_kernel)", text, re.M):
        return "sglang"
    raise SystemExit(f"{path}: imports neither vllm nor sglang")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*")
    ap.add_argument("--vllm-python", default=str(VENVS / "venv-vllm-0.33.0" / "bin" / "python"))
    ap.add_argument("--sglang-python", default=str(VENVS / "venv-sglang-0.5.23" / "bin" / "python"))
    ap.add_argument("--vllm-platform", choices=["cuda", "triton"], default="cuda")
    ap.add_argument("--sys-path", action="append", default=[], help="prepended to sys.path (e.g. sgl_kernel's dir)")
    ap.add_argument("-k", default="", help="pytest -k expression")
    ap.add_argument("--full", action="store_true", help="run the slow cases too")
    ap.add_argument("--reciprocal", action="store_true",
                    help="bind moe_ep.quant.reciprocal_multiply_quant_fp8 (x * (1/s), no round_product) instead")
    ap.add_argument("--interpreter-cast", choices=["gpu", "as-is"], default="gpu",
                    help="float -> e4m3 cast of the engines' Triton references: round to nearest even as the GPU "
                         "(default), or the Triton interpreter's own (ties away from zero)")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per file")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    ap.add_argument("--file", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return _child(args)
    status = 0
    for f in args.files:
        path = Path(f).resolve()
        engine = _engine_of(path)
        python = args.vllm_python if engine == "vllm" else args.sglang_python
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            cmd = [python, str(Path(__file__).resolve()), "--child", "--engine", engine, "--file", str(path),
                   "--json", str(out), "--vllm-platform", args.vllm_platform, "-k", args.k]
            cmd += [a for p in args.sys_path for a in ("--sys-path", str(Path(p).resolve()))]
            cmd += ["--interpreter-cast", args.interpreter_cast]
            cmd += ["--full"] * args.full + ["--verbose"] * args.verbose + ["--reciprocal"] * args.reciprocal
            try:
                proc = subprocess.run(cmd, capture_output=not args.verbose, text=True, timeout=args.timeout)
            except subprocess.TimeoutExpired:
                print(f"== {path.name} ({engine}): timed out after {args.timeout} s; the cases finished so far:")
                status = 1
            if not out.exists():
                print(f"== {path.name} ({engine}): no result (rc {proc.returncode})\n{(proc.stderr or '')[-3000:]}")
                status = 1
                continue
            res = json.loads(out.read_text())
        cases = res["cases"]
        count = {o: sum(c["outcome"] == o for c in cases.values()) for o in ("passed", "failed", "skipped")}
        plat = (f", vLLM platform {args.vllm_platform}" if engine == "vllm" else "") + \
            (", reciprocal_multiply_quant_fp8" if args.reciprocal else "") + \
            (", interpreter's own fp8 cast" if args.interpreter_cast == "as-is" else "")
        print(f"== {path.name} ({engine}{plat}): {count['passed']} passed, {count['failed']} failed, "
              f"{count['skipped']} skipped, {len(res['cut'])} cut (slow), {len(res['not_ours'])} not moe_ep's (int8)")
        for nodeid, c in cases.items():
            if c["outcome"] == "failed":
                print(f"  FAIL {nodeid.split('::')[-1]} ({c['seconds']:.1f} s): {c['message']}")
        for nodeid in res["cut"]:
            print(f"  cut  {nodeid.split('::')[-1]}")
        status |= count["failed"] > 0
    return status


if __name__ == "__main__":
    sys.exit(main())
