"""Input checks shared by every backend. All raise ValueError/TypeError before any communication."""

from __future__ import annotations

from typing import Optional, Union

import numpy as np
import torch

from .fp8 import FP8_DTYPE, ceil_div
from .topk_layout import _on_host, layout_from_topk

__all__ = ["split_x", "check_topk_idx", "check_dispatch_values", "check_topk_weights", "check_num_experts", "check_low_latency_x",
           "check_combine_x", "check_bias", "combine_format"]

GROUP = 128
HALF_DTYPES = (torch.bfloat16, torch.float16)  # 16-bit payloads: accumulate in float32, one rounding at the end


def _check_tensor(t, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def split_x(x: Union[torch.Tensor, tuple], name: str = "x") -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``x`` is BF16 `[N, H]` or ``(x_fp8 e4m3 [N, H], scales)`` with float32 `[N, H/128]` or packed UE8M0 int32
    `[N, ceil(H/512)]` scales; returns ``(x, scales)``."""
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise TypeError(f"{name} as a tuple must be (x_fp8, scales), got {len(x)} items")
        data, scales = x
        _check_tensor(data, f"{name}[0]")
        _check_tensor(scales, f"{name}[1]")
        if data.dtype != FP8_DTYPE:
            raise TypeError(f"{name}[0] must be {FP8_DTYPE} when scales are given, got {data.dtype}")
        if data.dim() != 2:
            raise ValueError(f"{name}[0] must be 2D [num_tokens, hidden], got shape {tuple(data.shape)}")
        n, h = data.shape
        if h % GROUP != 0:
            raise ValueError(f"hidden={h} must be a multiple of {GROUP} for FP8")
        if scales.dtype == torch.float32:
            want = (n, h // GROUP)
        elif scales.dtype == torch.int32:  # packed UE8M0 exponents, four groups per word (DeepEP V2, SM100)
            want = (n, ceil_div(h // GROUP, 4))
        else:
            raise TypeError(f"{name}[1] (scales) must be torch.float32 or packed UE8M0 torch.int32, got {scales.dtype}")
        if tuple(scales.shape) != want:
            raise ValueError(f"{name}[1] ({scales.dtype} scales) must have shape [{want[0]}, {want[1]}], got "
                             f"{tuple(scales.shape)}")
        if data.device != scales.device:
            raise ValueError(f"{name} data and scales are on different devices ({data.device}, {scales.device})")
        return data, scales
    _check_tensor(x, name)
    if x.dtype not in HALF_DTYPES:
        raise TypeError(f"{name} must be torch.bfloat16 or torch.float16 (or a (float8_e4m3fn, float32 scales) tuple), "
                        f"got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2D [num_tokens, hidden], got shape {tuple(x.shape)}")
    return x, None


def check_num_experts(num_experts: int, world_size: int) -> int:
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts <= 0:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if num_experts % world_size != 0:
        raise ValueError(f"num_experts={num_experts} must be divisible by the world size {world_size}")
    return num_experts // world_size


def check_topk_idx(topk_idx, num_tokens: int, num_experts: int, device: torch.device, check_values: bool = True) -> None:
    """int64 `[N, K]`; with ``check_values`` also values in ``[-1, num_experts)`` and no expert twice in
    one row (one read of the device on the host)."""
    check_topk_shape(topk_idx, num_tokens, device)
    if check_values:
        raise_topk_value_errors(topk_idx, num_experts, topk_value_flags(topk_idx, num_experts).tolist())


def check_topk_shape(topk_idx, num_tokens: int, device: torch.device) -> None:
    _check_tensor(topk_idx, "topk_idx")
    if topk_idx.dtype != torch.int64:
        raise TypeError(f"topk_idx must be torch.int64, got {topk_idx.dtype}")
    if topk_idx.dim() != 2 or topk_idx.shape[0] != num_tokens:
        raise ValueError(f"topk_idx must have shape [{num_tokens}, num_topk], got {tuple(topk_idx.shape)}")
    if topk_idx.device != device:
        raise ValueError(f"topk_idx is on {topk_idx.device}, x on {device}")


def topk_value_flags(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """`[2]` bool on the device: (an entry outside ``[-1, num_experts)``, an expert twice in a row). Host tensors
    take numpy (:func:`moe_ep.topk_layout._on_host`; a test holds the two paths equal)."""
    if topk_idx.numel() == 0:
        return torch.zeros(2, dtype=torch.bool, device=topk_idx.device)
    if _on_host(topk_idx):
        return _topk_flags_host(topk_idx, num_experts)
    return _topk_flags_torch(topk_idx, num_experts)


def _topk_flags_host(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    srt = np.sort(topk_idx.numpy(), axis=1)
    return torch.tensor([bool(srt[:, 0].min() < -1 or srt[:, -1].max() >= num_experts),
                         bool(((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any())])


def _topk_flags_torch(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    out_of_range = ((topk_idx < -1) | (topk_idx >= num_experts)).any()
    if topk_idx.shape[1] > 1:
        srt = topk_idx.sort(dim=1).values
        dup = ((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any()
    else:
        dup = torch.zeros((), dtype=torch.bool, device=topk_idx.device)
    return torch.stack([out_of_range, dup])


def raise_topk_value_errors(topk_idx: torch.Tensor, num_experts: int, flags: list) -> None:
    """Raise the precise error for ``flags`` (host values of :func:`topk_value_flags`); reads more of the
    tensor only when something is wrong."""
    if flags[0]:
        bad = topk_idx[(topk_idx < -1) | (topk_idx >= num_experts)][0].item()
        raise ValueError(f"topk_idx holds {bad}, outside [-1, {num_experts}) (num_experts={num_experts})")
    if flags[1]:
        srt = topk_idx.sort(dim=1).values
        row = int(((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any(dim=1).nonzero()[0])
        raise ValueError(f"token {row} selects the same expert twice: topk_idx[{row}] = {topk_idx[row].tolist()}")


def check_dispatch_values(topk_idx: torch.Tensor, num_experts: int, world_size: int, num_tokens_per_rank: torch.Tensor,
                          is_token_in_rank: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> None:
    """The values of a dispatch's routing, in one read of the device on the host: ``topk_idx`` as in
    :func:`check_topk_idx`, and the layout tensors equal to what ``topk_idx`` implies (a layout that
    disagrees with the top-k would make ranks disagree on how many rows move)."""
    flags = topk_value_flags(topk_idx, num_experts)
    safe = topk_idx.clamp(-1, num_experts - 1)  # out-of-range entries are reported by the flags above
    per_rank, per_expert, in_rank = layout_from_topk(safe, num_experts, world_size)
    layout_flags = torch.stack([
        (is_token_in_rank != in_rank).any(),
        (num_tokens_per_rank.to(torch.int64) != is_token_in_rank.sum(0)).any(),
        (num_tokens_per_expert.to(torch.int64) != per_expert.to(torch.int64)).any()])
    host = torch.cat([flags, layout_flags]).tolist()
    raise_topk_value_errors(topk_idx, num_experts, host[:2])
    names = ("is_token_in_rank", "num_tokens_per_rank", "num_tokens_per_expert")
    bad = [name for name, f in zip(names, host[2:]) if f]
    if bad:
        raise ValueError(f"{', '.join(bad)} disagree(s) with topk_idx: pass the tensors get_dispatch_layout "
                         f"returned for this topk_idx (num_tokens_per_rank must equal is_token_in_rank.sum(0))")


def check_topk_weights(topk_weights, topk_idx: torch.Tensor, name: str = "topk_weights") -> None:
    _check_tensor(topk_weights, name)
    if topk_weights.dtype != torch.float32:
        raise TypeError(f"{name} must be torch.float32, got {topk_weights.dtype}")
    if topk_weights.shape != topk_idx.shape:
        raise ValueError(f"{name} must have the shape of topk_idx {tuple(topk_idx.shape)}, got "
                         f"{tuple(topk_weights.shape)}")


def check_low_latency_x(x, num_max_dispatch_tokens_per_rank: int, use_fp8: bool) -> None:
    _check_tensor(x, "x")
    if x.dtype not in HALF_DTYPES:
        raise TypeError(f"low_latency_dispatch takes torch.bfloat16 or torch.float16 x (it casts to FP8 itself), "
                        f"got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2D [num_tokens, hidden], got shape {tuple(x.shape)}")
    if not isinstance(num_max_dispatch_tokens_per_rank, int) or num_max_dispatch_tokens_per_rank <= 0:
        raise ValueError(f"num_max_dispatch_tokens_per_rank must be a positive int, got "
                         f"{num_max_dispatch_tokens_per_rank!r}")
    if x.shape[0] > num_max_dispatch_tokens_per_rank:
        raise ValueError(f"{x.shape[0]} tokens exceed num_max_dispatch_tokens_per_rank="
                         f"{num_max_dispatch_tokens_per_rank}")
    if use_fp8 and x.shape[1] % GROUP != 0:
        raise ValueError(f"hidden={x.shape[1]} must be a multiple of {GROUP} for FP8")


def check_combine_x(x, num_rows: int, hidden: int, name: str = "x") -> None:
    _check_tensor(x, name)
    if x.dtype not in HALF_DTYPES:
        raise TypeError(f"combine takes torch.bfloat16 or torch.float16 {name}, got {x.dtype}")
    if tuple(x.shape) != (num_rows, hidden):
        raise ValueError(f"{name} must have shape [{num_rows}, {hidden}] (the dispatch's received rows), got "
                         f"{tuple(x.shape)}")


def check_bias(bias, num_tokens: int, hidden: int, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> tuple:
    """``bias`` is None, a tensor or a tuple of up to two tensors, each `[N, H]` of ``dtype`` (combine's ``x``
    dtype: BF16 or FP16)."""
    if bias is None:
        return ()
    items = bias if isinstance(bias, (tuple, list)) else (bias,)
    if len(items) > 2:
        raise ValueError(f"bias takes at most two tensors, got {len(items)}")
    out = []
    for i, b in enumerate(items):
        if b is None:
            continue
        _check_tensor(b, f"bias[{i}]")
        if b.dtype != dtype or tuple(b.shape) != (num_tokens, hidden) or b.device != device:
            raise ValueError(f"bias[{i}] must be {dtype} [{num_tokens}, {hidden}] on {device} (the dtype of x), got "
                             f"{b.dtype} {tuple(b.shape)} on {b.device}")
        out.append(b)
    return tuple(out)


def num_scale_groups(hidden: int) -> int:
    return ceil_div(hidden, GROUP)


def combine_format(x_dtype: torch.dtype, combine_dtype, use_logfmt: bool = False, low_latency: bool = False) -> int:
    """Wire format code (:mod:`moe_ep.kernels.logfmt`) of a combine: ``combine_dtype`` None or ``x``'s dtype sends
    ``x`` as it is, ``torch.float8_e4m3fn`` FP8 with 1x128 scales; ``use_logfmt`` (low-latency only) LogFMT-10."""
    from .kernels.logfmt import FMT_BF16, FMT_FP8, FMT_FP16, FMT_LOGFMT

    if not isinstance(use_logfmt, bool):
        raise TypeError(f"use_logfmt must be a bool, got {type(use_logfmt).__name__}")
    if combine_dtype is not None and combine_dtype not in (x_dtype, FP8_DTYPE):
        raise ValueError(f"combine_dtype must be None, x's dtype ({x_dtype}) or {FP8_DTYPE}, got {combine_dtype!r}")
    if use_logfmt:
        if not low_latency:
            raise ValueError("use_logfmt is a low-latency combine format")
        if combine_dtype == FP8_DTYPE:
            raise ValueError("use_logfmt and combine_dtype=torch.float8_e4m3fn are two different formats: pass one")
        return FMT_LOGFMT
    if combine_dtype == FP8_DTYPE:
        return FMT_FP8
    return FMT_FP16 if x_dtype == torch.float16 else FMT_BF16
