"""Argument checks shared by the eplb modules (`EplbInputError`/TypeError naming the problem and the fix)."""

from __future__ import annotations

import numpy as np
import torch

from moe_ep.errors import MoEEPError

__all__ = ["EplbInputError", "as_numpy", "check_weight", "check_int", "check_layout"]


class EplbInputError(MoEEPError, ValueError, AssertionError):
    """A bad argument. Both a ValueError and an AssertionError: DeepSeek's EPLB asserts on its inputs, so its
    callers (and tests written against it, such as vLLM's) catch AssertionError; Python code catches ValueError."""


def as_numpy(x, name: str) -> np.ndarray:
    """A torch tensor or array-like as a numpy array (no copy for CPU tensors and arrays)."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        if x.dtype == torch.bfloat16 or x.dtype == torch.float16:
            x = x.float()
        return x.numpy()
    if isinstance(x, np.ndarray):
        return x
    try:
        return np.asarray(x)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} must be a torch.Tensor or numpy array, got {type(x).__name__}") from exc


def check_int(v, name: str, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v < minimum:
        raise EplbInputError(f"{name} must be >= {minimum}, got {v}")
    return int(v)


def check_weight(weight) -> np.ndarray:
    """Load statistics `[L, E]` or `[S, L, E]`: real, finite, non-negative. Returns float64."""
    w = as_numpy(weight, "weight")
    if w.dtype == np.bool_ or not (np.issubdtype(w.dtype, np.integer) or np.issubdtype(w.dtype, np.floating)):
        raise TypeError(f"weight must hold integer or float counts, got dtype {w.dtype}")
    if w.ndim not in (2, 3):
        raise EplbInputError(f"weight must be [layers, experts] or [steps, layers, experts], got shape {w.shape}")
    if w.size == 0:
        raise EplbInputError(f"weight must not be empty, got shape {w.shape}")
    w = w.astype(np.float64)
    if not np.isfinite(w).all():
        raise EplbInputError(f"weight holds {int((~np.isfinite(w)).sum())} NaN/inf entries; counts must be finite")
    if (w < 0).any():
        raise EplbInputError(f"weight holds {int((w < 0).sum())} negative entries; counts must be >= 0")
    return w


def check_layout(num_experts: int, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int) -> None:
    """What every policy needs: positive ints, a slot per expert, equal slots per GPU."""
    for name, v in (("num_replicas", num_replicas), ("num_groups", num_groups), ("num_nodes", num_nodes),
                    ("num_gpus", num_gpus)):
        check_int(v, name)
    if num_replicas < num_experts:
        raise EplbInputError(f"num_replicas={num_replicas} must be >= num_experts={num_experts} (every expert needs a slot)")
    if num_replicas % num_gpus != 0:
        raise EplbInputError(f"num_replicas={num_replicas} must be divisible by num_gpus={num_gpus} (equal slots per GPU)")
    # num_groups / num_nodes that do not divide experts / GPUs are no error: the hierarchical policy
    # needs them to, the global policy (the fallback, as in DeepSeek's EPLB) ignores them.
