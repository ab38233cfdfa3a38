"""``moe_ep.Config``: DeepEP's tuning config and its normal-mode buffer size hints.

The kernels of this release take no tuning from it; :class:`moe_ep.Buffer` accepts it everywhere (and
``Buffer.get_dispatch_config`` / ``get_combine_config`` return one) so engine code written for DeepEP runs
unchanged. Its size hints are what such code passes as ``num_nvl_bytes`` / ``num_rdma_bytes``.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["Config"]


class Config:
    """DeepEP-style tuning config (``num_sms``, chunk sizes) and DeepEP's buffer size hints. The kernels of this
    release take no tuning from it (the ``torch`` backend allocates per call; ``symm`` sizes its work from the
    call's shapes); it is accepted everywhere so engine code written for DeepEP runs unchanged.

    ``num_max_tokens_per_rank`` (``None``: stream) and ``num_max_topk`` (keyword-only, an extension) are what
    :meth:`get_nvl_buffer_size_hint` sizes for; see there."""

    #: DeepEP's ``kNumMaxTopK``: the top-k its size hints assume (ours too, by default)
    NUM_MAX_TOPK = 128

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256, *, num_max_tokens_per_rank: Optional[int] = None,
                 num_max_topk: int = NUM_MAX_TOPK):
        for name, v in (("num_sms", num_sms), ("num_max_nvl_chunked_recv_tokens", num_max_nvl_chunked_recv_tokens),
                        ("num_max_topk", num_max_topk)):
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"Config: {name} must be a positive int, got {v!r}")
        if num_max_tokens_per_rank is not None and (not isinstance(num_max_tokens_per_rank, int)
                                                    or num_max_tokens_per_rank <= 0):
            raise ValueError(f"Config: num_max_tokens_per_rank must be a positive int or None, got "
                             f"{num_max_tokens_per_rank!r}")
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens
        # None: the size hint is the fixed buffer normal mode streams any batch through (as DeepEP's ring of
        # num_sms / 2 channels of num_max_nvl_chunked_recv_tokens tokens does); an int: one round per call of that
        # many tokens per rank (the whole receive in the buffer; receive views need it).
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_max_topk = num_max_topk

    @staticmethod
    def _check_hint_args(hidden_bytes, num_ranks) -> None:
        if not isinstance(hidden_bytes, int) or hidden_bytes <= 0:
            raise ValueError(f"hidden_bytes must be a positive int (hidden * bytes per element, e.g. hidden * 2 for "
                             f"BF16), got {hidden_bytes!r}")
        if not isinstance(num_ranks, int) or num_ranks <= 0:
            raise ValueError(f"num_ranks must be a positive int, got {num_ranks!r}")

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP: ``num_nvl_bytes`` for normal-mode calls. Here: the bytes per rank the ``symm`` backend's
        normal mode addresses (:meth:`moe_ep.backends.symm.SymmBackend.get_normal_size_hint`) for rows of
        ``hidden_bytes`` (BF16 payloads, ``hidden = ceil(hidden_bytes / 2)``; FP8 ones need less) with up to
        ``num_max_topk`` top-k entries:

        - ``num_max_tokens_per_rank=None`` (the default): the fixed buffer every batch streams through in rounds
          (:mod:`moe_ep.backends.symm_normal`), as DeepEP's channels stream through its ring; below DeepEP's hint
          for the same arguments (EP8, hidden 7168: 62 MiB against DeepEP's 320 MiB; docs/sizing.md);
        - ``num_max_tokens_per_rank=N``: every call of up to ``N`` tokens per rank in one round (the fastest path;
          what receive views need).

        The ``torch`` backend ignores the number (it allocates per call)."""
        from ...backends.symm_normal import SymmNormal

        self._check_hint_args(hidden_bytes, num_ranks)
        hidden = (hidden_bytes + 1) // 2
        hidden += hidden % 2  # symm rows are int32 words: an even number of BF16 channels
        return SymmNormal.size_hint(self.num_max_tokens_per_rank, hidden, self.num_max_topk, num_ranks)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP: ``num_rdma_bytes`` for normal-mode calls across nodes. Here ``0``: no normal-mode kernel of this
        release addresses an RDMA buffer (``symm`` is one node; the ``torch`` backend, node-aware or not, moves
        data through the process group). ``num_rdma_bytes`` sizes the low-latency buffer instead: take the max
        with :meth:`Buffer.get_low_latency_rdma_size_hint`, as DeepEP-based engines already do."""
        self._check_hint_args(hidden_bytes, num_ranks)
        return 0
