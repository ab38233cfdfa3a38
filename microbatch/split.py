"""Splitting a batch into two microbatches (prefill: by tokens, decode: by sequences)."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

__all__ = ["MicrobatchSplit", "split_batch"]


@dataclasses.dataclass
class MicrobatchSplit:
    """Where a batch was cut.

    Attributes:
        num_tokens: ``(n0, n1)`` tokens of the two microbatches (``(total, 0)`` when not split).
        token_slices: the two microbatches' rows of the batch's flattened tokens.
        seq_lens: per-microbatch sequence lengths; a sequence cut in two appears in both, with its parts.
        is_split: False when the batch runs as one microbatch (see :func:`split_batch`).
        cut_inside_sequence: the cut falls inside a sequence (prefill below ``threshold``).
    """

    num_tokens: tuple
    token_slices: tuple
    seq_lens: tuple
    is_split: bool
    cut_inside_sequence: bool = False

    def num_tokens_tensor(self, device=None) -> torch.Tensor:
        """``num_tokens`` as an `[2]` `torch.int32` device tensor (what a captured CUDA graph reads)."""
        return torch.tensor(self.num_tokens, dtype=torch.int32, device=device)


def _no_split(seq_lens: list) -> MicrobatchSplit:
    total = sum(seq_lens)
    return MicrobatchSplit((total, 0), (slice(0, total), slice(total, total)), (list(seq_lens), []), False)


def _at_token(seq_lens: list, cut: int) -> MicrobatchSplit:
    """Cut the flattened tokens at ``cut`` (possibly inside a sequence)."""
    first, second, seen, inside = [], [], 0, False
    for n in seq_lens:
        if seen + n <= cut:
            first.append(n)
        elif seen >= cut:
            second.append(n)
        else:  # the cut sequence: its head ends microbatch 0, its tail starts microbatch 1
            first.append(cut - seen)
            second.append(seen + n - cut)
            inside = True
        seen += n
    return MicrobatchSplit((cut, seen - cut), (slice(0, cut), slice(cut, seen)), (first, second), True, inside)


def split_batch(seq_lens: Sequence[int], mode: str = "prefill", threshold: float = 0.48, *,
                group=None) -> MicrobatchSplit:
    """Cut a batch into two microbatches for two-microbatch overlap.

    Arguments:
        seq_lens: tokens of each sequence in this step, in batch order (decode: usually 1 each).
        mode: ``"prefill"``: cut at the sequence boundary that best balances tokens; if the smaller side
            would then hold less than ``threshold`` of the tokens, cut inside a sequence at half the
            tokens instead. ``"decode"``: the first ``ceil(S / 2)`` sequences, then the rest.
        threshold: in ``[0, 0.5]``, see ``mode``.
        group: optional torch.distributed group: every rank must agree, since the microbatches' collectives
            pair up across ranks. If any rank would get an empty microbatch, no rank splits (one
            all-reduce of a flag, on the CPU for gloo and the current device for NCCL).

    Returns:
        :class:`MicrobatchSplit`.
    """
    if mode not in ("prefill", "decode"):
        raise ValueError(f"mode must be 'prefill' or 'decode', got {mode!r}")
    if not (0.0 <= threshold <= 0.5):
        raise ValueError(f"threshold must be in [0, 0.5], got {threshold!r}")
    seq_lens = [int(n) for n in seq_lens]
    if any(n < 0 for n in seq_lens):
        raise ValueError(f"seq_lens must be non-negative, got {seq_lens}")
    total = sum(seq_lens)
    split: Optional[MicrobatchSplit] = None
    if mode == "decode":
        if len(seq_lens) >= 2:
            half = (len(seq_lens) + 1) // 2
            split = _at_token(seq_lens, sum(seq_lens[:half]))
            split.seq_lens = (seq_lens[:half], seq_lens[half:])
    elif total >= 2:
        prefix, best, best_cost = 0, None, None
        for n in seq_lens[:-1]:
            prefix += n
            cost = abs(2 * prefix - total)
            if best_cost is None or cost < best_cost:
                best, best_cost = prefix, cost
        if best is not None and min(best, total - best) >= threshold * total and 0 < best < total:
            split = _at_token(seq_lens, best)
        else:
            split = _at_token(seq_lens, total // 2)
    ok = split is not None and split.num_tokens[0] > 0 and split.num_tokens[1] > 0
    if group is not None:
        import torch.distributed as dist

        backend = str(dist.get_backend(group)).lower()
        dev = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=dev)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        ok = bool(flag.item())
    return split if ok else _no_split(seq_lens)
