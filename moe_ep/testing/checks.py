"""Numeric checks with reports that point at the first wrong element."""

from __future__ import annotations

import torch

__all__ = ["assert_bitwise_equal", "assert_close_ulp", "ulp"]

_MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23, torch.float64: 52,
                  torch.float8_e4m3fn: 3}
_MIN_NORMAL_EXP = {torch.bfloat16: -126, torch.float16: -14, torch.float32: -126, torch.float64: -1022,
                   torch.float8_e4m3fn: -6}


def _index_str(flat_idx: int, shape: torch.Size) -> str:
    idx = []
    for dim in reversed(shape):
        idx.append(flat_idx % dim)
        flat_idx //= dim
    return str(tuple(reversed(idx)))


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    if t.is_floating_point():
        int_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        return t.contiguous().view(int_dtype)
    return t


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, name: str = "tensor") -> None:
    """Shapes, dtypes and every bit equal (NaN payloads included); reports the first mismatch."""
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{name}: dtype {actual.dtype} != expected {expected.dtype}")
    a, e = _as_bits(actual.detach().cpu()), _as_bits(expected.detach().cpu())
    neq = (a != e).flatten()
    if bool(neq.any()):
        first = int(neq.nonzero()[0])
        raise AssertionError(
            f"{name}: {int(neq.sum())} of {neq.numel()} elements differ; first at "
            f"{_index_str(first, actual.shape)}: got {actual.flatten()[first].item()!r}, "
            f"expected {expected.flatten()[first].item()!r}")


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of ``dtype`` at ``|x|`` (float64), with subnormals spaced like the smallest normal."""
    mbits, emin = _MANTISSA_BITS[dtype], _MIN_NORMAL_EXP[dtype]
    ax = x.double().abs()
    exp = torch.floor(torch.log2(torch.where(ax > 0, ax, torch.ones_like(ax))))
    exp = torch.where(ax > 0, exp, torch.full_like(exp, emin)).clamp(min=emin)
    return torch.exp2(exp - mbits)


def assert_close_ulp(actual: torch.Tensor, expected: torch.Tensor, ulps: float, name: str = "tensor",
                     dtype: torch.dtype | None = None) -> None:
    """``|actual - expected| <= ulps * ulp(expected)`` in units of ``dtype`` (default: expected's dtype).

    NaN and inf must sit at the same positions (inf with the same sign) before values are compared.
    """
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    dtype = dtype or expected.dtype
    a, e = actual.detach().cpu().double().flatten(), expected.detach().cpu().double().flatten()
    for what, fa, fe in (("NaN", a.isnan(), e.isnan()), ("+inf", a == float("inf"), e == float("inf")),
                         ("-inf", a == float("-inf"), e == float("-inf"))):
        diff = (fa != fe)
        if bool(diff.any()):
            first = int(diff.nonzero()[0])
            raise AssertionError(f"{name}: {what} positions differ; first at {_index_str(first, actual.shape)}: "
                                 f"got {a[first].item()}, expected {e[first].item()}")
    finite = e.isfinite()
    tol = ulps * ulp(e, dtype)
    bad = finite & ((a - e).abs() > tol)
    if bool(bad.any()):
        first = int(bad.nonzero()[0])
        worst = int(torch.where(finite, (a - e).abs() / tol, torch.zeros_like(a)).argmax())
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {bad.numel()} elements off by more than {ulps} ulp ({dtype}); "
            f"first at {_index_str(first, actual.shape)}: got {a[first].item()}, expected {e[first].item()}; "
            f"worst at {_index_str(worst, actual.shape)}: got {a[worst].item()}, expected {e[worst].item()}")


def outcome(fn) -> tuple:
    """Run ``fn()``: ``("ok", "", seconds)``, or ``(exception type name, message, seconds)`` when it raised (for
    multi-rank tests whose ranks report how a call ended instead of failing the launch)."""
    import time

    t0 = time.monotonic()
    try:
        fn()
        return ("ok", "", time.monotonic() - t0)
    except Exception as exc:  # noqa: BLE001 - the caller inspects the type by name
        return (type(exc).__name__, str(exc), time.monotonic() - t0)
