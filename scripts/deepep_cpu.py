"""Run one of DeepEP's own test scripts, unchanged, on CPU ranks through moe-ep's ``deep_ep`` alias.

    python scripts/deepep_cpu.py /path/to/DeepEP tests/elastic/test_ep.py [the test's own arguments]

What it provides around the script (the script itself is executed as written, as ``__main__``):

- ``import deep_ep`` is moe-ep (:mod:`moe_ep.alias`); ``MOE_EP_BACKEND`` picks the backend (``torch`` / ``symm``).
- DeepEP's pure-PyTorch test helpers are loaded from the checkout under their own names: ``deep_ep.utils.math``,
  ``.gate``, ``.refs``, ``.testing`` (the references the script checks against are DeepEP's, not ours).
  ``deep_ep.utils.envs`` is the one module replaced, as its own comment invites ("you may rewrite this function
  with your own cluster settings"): DeepEP's imports its compiled extension and opens NCCL; here ``init_dist``
  opens a gloo group on localhost, with DeepEP's defaults (bfloat16 default dtype, the seeds).
- Device mapping: tensors the script asks on ``device='cuda'`` are made on the CPU (a ``TorchFunctionMode`` that
  rewrites the ``device`` argument); ``torch.cuda.synchronize`` is a no-op without CUDA.
- ``torch.multiprocessing.spawn`` forks (each rank inherits the above instead of re-importing the script).
- ``TRITON_INTERPRET=1`` (the kernels run on the interpreter) and ``torch.compile`` off (DeepEP's FP8 casts run
  eagerly: the same arithmetic, no C++ toolchain), unless set.
"""

from __future__ import annotations

import importlib.util
import os
import random
import runpy
import sys
import types

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as tmp  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

HELPERS = ("math", "gate", "refs", "testing")


def _is_cuda(dev) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.split(":")[0] == "cuda"
    return isinstance(dev, int)  # a bare index means a CUDA device


_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu") if hasattr(torch, n))


def _bytes(a):
    return a.view(torch.uint8) if isinstance(a, torch.Tensor) and a.dtype in _FP8 else a


class CudaToCpu(TorchFunctionMode):
    """``device='cuda'`` (any index) -> the CPU, for factory functions, ``.to(...)`` and ``.cuda()``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu") + tuple(args[2:])
        if getattr(func, "__module__", "").startswith("torch.distributed"):
            # NCCL moves FP8 as bytes; gloo refuses the dtype: hand it the same bytes
            args = tuple(_bytes(a) for a in args)
            kwargs = {k: _bytes(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


# ------------------------------------------------------------------------------ deep_ep.utils.envs on CPU ranks
_local_rank = None
_local_seed = 0
_global_seed = 0


def init_seed(global_seed: int) -> None:
    global _local_seed, _global_seed
    _local_seed = global_seed + dist.get_rank()
    _global_seed = global_seed
    torch.manual_seed(_local_seed)
    random.seed(_local_seed)


def get_local_seed() -> int:
    return _local_seed


def get_global_seed() -> int:
    return _global_seed


def dist_print(s: str = "", once_in_node: bool = False) -> None:
    assert _local_rank is not None
    if not once_in_node or _local_rank == 0:
        print(s, flush=True)
    dist.barrier()


def init_dist(local_rank: int, num_local_ranks: int, seed: int = 0):
    global _local_rank
    ip = os.getenv("MASTER_ADDR", "127.0.0.1")
    port = int(os.getenv("MASTER_PORT", "8361"))
    num_nodes = int(os.getenv("WORLD_SIZE", 1))
    node_rank = int(os.getenv("RANK", 0))
    _local_rank = local_rank
    dist.init_process_group(backend="gloo", init_method=f"tcp://{ip}:{port}", world_size=num_nodes * num_local_ranks,
                            rank=node_rank * num_local_ranks + local_rank)
    torch.set_default_dtype(torch.bfloat16)  # as DeepEP's init_dist
    init_seed(seed)
    return dist.get_rank(), dist.get_world_size(), dist.new_group(list(range(num_local_ranks * num_nodes)))


def _envs_module() -> types.ModuleType:
    mod = types.ModuleType("deep_ep.utils.envs", "deep_ep.utils.envs on CPU ranks (gloo), see scripts/deepep_cpu.py")
    for f in (init_seed, get_local_seed, get_global_seed, dist_print, init_dist):
        setattr(mod, f.__name__, f)
    mod.__package__ = "deep_ep.utils"
    return mod


def _load_helper(checkout: str, name: str) -> types.ModuleType:
    full = f"deep_ep.utils.{name}"
    spec = importlib.util.spec_from_file_location(full, os.path.join(checkout, "deep_ep", "utils", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "deep_ep.utils"
    sys.modules[full] = mod
    spec.loader.exec_module(mod)
    return mod


def _forking_spawn(fn, args=(), nprocs=1, join=True, daemon=False, start_method="spawn"):
    """torch.multiprocessing.spawn, forked: the ranks inherit the alias, the helpers and the device mapping."""
    def rank_main(i, *a):
        with CudaToCpu():
            return fn(i, *a)
    return tmp.start_processes(rank_main, args, nprocs, join, daemon, start_method="fork")


def setup(checkout: str) -> None:
    import moe_ep.alias

    moe_ep.alias.install(["deep_ep"])
    sys.modules["deep_ep.utils.envs"] = _envs_module()
    for name in HELPERS:
        _load_helper(checkout, name)
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda device=None: None
    tmp.spawn = _forking_spawn


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    checkout, script = argv[0], argv[1]
    if not os.path.isfile(os.path.join(checkout, "deep_ep", "utils", "refs.py")):
        print(f"{checkout} is not a DeepEP V2 checkout (no deep_ep/utils/refs.py)", file=sys.stderr)
        return 2
    path = script if os.path.isabs(script) else os.path.join(checkout, script)
    setup(checkout)
    sys.argv = [path] + argv[2:]
    with CudaToCpu():
        runpy.run_path(path, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
