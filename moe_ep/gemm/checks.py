"""Argument checks of the GEMM entry points (operands, scales, index tensors, recipes, ``c``): every check runs
before any launch, so a bad call raises without touching ``d``."""

from __future__ import annotations

import torch

from ..fp8 import FP8_DTYPE, ceil_div
from ..kernels.pdl import INTERPRET
from .tiles import BLOCK_K, RECIPE, WGRAD_RECIPE

def _pair(v, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(v, (tuple, list)) or len(v) != 2 or not all(isinstance(t, torch.Tensor) for t in v):
        raise TypeError(f"{name} must be a (fp8 tensor, scales) pair, got {type(v).__name__}")
    return v[0], v[1]


def _check_operands(a, b, d, lead: tuple[int, ...], *, bf16: bool = False, dense: bool = False,
                    sfb_gran_n: int = BLOCK_K):
    """Validate a, b, d for a `[*lead, M, K]` A and a `[G, N, K]` (dense: `[N, K]`) B; return
    ``(x, sfa, w3, sfb3, ue8m0)`` with B and its scales as `[G, ...]` (scales ``None`` for BF16).
    ``sfb_gran_n``: rows of B per weight scale (128: 128x128 block scales; 1: 1x128 scales, the wgrad recipe)."""
    if bf16:
        for t, name in ((a, "a"), (b, "b")):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16:
                raise TypeError(f"{name} must be a torch.bfloat16 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
        x, w, sfa, sfb = a, b, None, None
    else:
        x, sfa = _pair(a, "a")
        w, sfb = _pair(b, "b")
        for t, name in ((x, "a[0]"), (w, "b[0]")):
            if t.dtype != FP8_DTYPE:
                raise TypeError(f"{name} must be {FP8_DTYPE} (FP4 operands are not supported), got {t.dtype}")
    an, bn = ("a", "b") if bf16 else ("a[0]", "b[0]")
    if x.dim() != len(lead) + 2:
        want = "[M, K]" if not lead else "[G, T, K]"
        raise ValueError(f"{an} must be {want}, got shape {tuple(x.shape)}")
    if w.dim() != (2 if dense else 3):
        raise ValueError(f"{bn} must be {'[N, K]' if dense else '[G, N, K]'}, got shape {tuple(w.shape)}")
    if dense:
        w = w.unsqueeze(0)
        sfb = sfb.unsqueeze(0) if sfb is not None else None
    m, k = x.shape[-2:]
    num_groups, n, kw = w.shape
    if kw != k:
        raise ValueError(f"K mismatch: {an} has K={k}, {bn} has K={kw}")
    ue8m0 = False
    if not bf16:
        # K need not be a multiple of 128 (DeepGEMM's dgrad rows have K 2112 and 576): the last scale column
        # covers the partial block, whose missing elements the kernel reads as zeros.
        kb, nb = ceil_div(k, BLOCK_K), ceil_div(n, sfb_gran_n)
        if sfa.dtype == torch.float32:
            want_sfa = (*lead, m, kb)
        elif sfa.dtype == torch.int32:
            want_sfa, ue8m0 = (*lead, m, ceil_div(kb, 4)), True
        else:
            raise TypeError(f"a[1] (activation scales) must be float32 or packed UE8M0 int32, got {sfa.dtype}")
        if tuple(sfa.shape) != want_sfa:
            raise ValueError(f"a[1] must have shape {list(want_sfa)} for a[0] of shape {list(x.shape)}, "
                             f"got {list(sfa.shape)}")
        if sfb.dtype != torch.float32:
            kind = "128x128 block" if sfb_gran_n == BLOCK_K else "1x128"
            raise TypeError(f"b[1] (weight scales) must be float32 {kind} scales, got {sfb.dtype}")
        if tuple(sfb.shape) != (num_groups, nb, kb):
            want = [nb, kb] if dense else [num_groups, nb, kb]
            raise ValueError(f"b[1] must have shape {want}, got {list(sfb.shape[1:] if dense else sfb.shape)}")
    if not isinstance(d, torch.Tensor) or d.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"d must be a bfloat16 (or float32) tensor, got {getattr(d, 'dtype', type(d).__name__)}")
    if tuple(d.shape) != (*lead, m, n):
        raise ValueError(f"d must have shape {[*lead, m, n]}, got {list(d.shape)}")
    if d.shape[-1] > 1 and d.stride(-1) != 1:
        raise ValueError(f"d must have a contiguous last dim (N-major), got strides {d.stride()}")
    named = [(w, bn), (d, "d")] + ([] if bf16 else [(sfa, "a[1]"), (sfb, "b[1]")])
    for t, name in named:
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but {an} is on {x.device}")
    if x.device.type == "cpu" and not INTERPRET:
        raise RuntimeError("CPU tensors run the Triton kernels only under the interpreter: set "
                           "TRITON_INTERPRET=1 before importing moe_ep.gemm, or pass CUDA tensors")
    return x, sfa, w, sfb, ue8m0


def _check_index(t, name: str, length: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
        raise TypeError(f"{name} must be an int32 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    if tuple(t.shape) != (length,):
        raise ValueError(f"{name} must have shape [{length}], got {list(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the operands are on {device}")


def _as_tuple(v, name: str) -> tuple:
    try:
        return tuple(int(i) for i in v)
    except TypeError:
        raise TypeError(f"{name} must be a tuple of ints, got {v!r}") from None


def _check_recipe(recipe, recipe_a, recipe_b, compiled_dims, *, allow_wgrad: bool = False) -> int:
    """DeepGEMM's sm90 FP8 recipe: ``recipe=(1, 128, 128)`` or ``recipe_a=(1, 128), recipe_b=(128, 128)`` (or
    none: the default, which is that recipe); with ``allow_wgrad`` (the dense GEMMs) also its wgrad recipe
    ``recipe=(1, 1, 128)`` / ``recipe_a=(1, 128), recipe_b=(1, 128)`` (1x128 scales on both operands).
    Returns the rows of B per weight scale: 128, or 1 for the wgrad recipe."""
    supported = ("only recipe=(1, 128, 128) is supported (1x128 activation scales x 128x128 weight scales, "
                 "DeepGEMM's sm90 FP8 recipe; equivalently recipe_a=(1, 128), recipe_b=(128, 128))")
    if allow_wgrad:
        supported += "; the dense GEMMs also take recipe=(1, 1, 128) (recipe_a=(1, 128), recipe_b=(1, 128))"
    if recipe is not None and (recipe_a is not None or recipe_b is not None):
        raise ValueError(f"pass either recipe or recipe_a + recipe_b, not both; {supported}")
    if (recipe_a is None) != (recipe_b is None):
        raise ValueError(f"recipe_a and recipe_b go together; {supported}")
    _check_compiled_dims(compiled_dims)
    if recipe is not None:
        rec = _as_tuple(recipe, "recipe")
        if rec == RECIPE:
            return BLOCK_K
        if allow_wgrad and rec == WGRAD_RECIPE:
            return 1
        raise ValueError(f"recipe={tuple(recipe)}: {supported}")
    if recipe_a is not None:
        ra, rb = _as_tuple(recipe_a, "recipe_a"), _as_tuple(recipe_b, "recipe_b")
        if ra == RECIPE[:2] and rb == RECIPE[1:]:
            return BLOCK_K
        if allow_wgrad and ra == WGRAD_RECIPE[::2] and rb == WGRAD_RECIPE[1:]:
            return 1
        raise ValueError(f"recipe_a={tuple(recipe_a)}, recipe_b={tuple(recipe_b)}: {supported}")
    return BLOCK_K


def _check_compiled_dims(compiled_dims) -> None:
    # DeepGEMM's JIT bakes these dims into the kernel; Triton specialises on its own, so the value only has
    # to be well formed.
    if not isinstance(compiled_dims, str) or set(compiled_dims) - set("mnk"):
        raise ValueError(f"compiled_dims must be a string of 'm', 'n', 'k', got {compiled_dims!r}")


def _check_c(c, d: torch.Tensor) -> bool:
    """DeepGEMM's ``c``: ``d = a @ b.T + c`` (``c`` may be ``d`` itself). Returns whether to accumulate."""
    if c is None:
        return False
    if not isinstance(c, torch.Tensor) or tuple(c.shape) != tuple(d.shape) or c.dtype != d.dtype:
        raise ValueError(f"c must be a tensor of d's shape {list(d.shape)} and dtype {d.dtype}, got "
                         f"{getattr(c, 'dtype', type(c).__name__)} {list(getattr(c, 'shape', []))}")
    if d.dtype != torch.float32:
        raise ValueError("accumulating c needs float32 c and d (the FP32 accumulation DeepGEMM's sm90 kernels do)")
    if c.device != d.device:
        raise ValueError(f"c is on {c.device} but d is on {d.device}")
    if c.data_ptr() == d.data_ptr() and c.stride() != d.stride():
        raise ValueError("c aliases d with different strides")
    return True


def _check_expected_m(v, name: str, allow_none: bool = False) -> None:
    if v is None and allow_none:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise TypeError(f"{name} must be a non-negative host int{' or None' if allow_none else ''}, got {v!r}")
