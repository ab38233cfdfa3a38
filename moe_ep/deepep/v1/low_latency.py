"""Low-latency mode of :class:`moe_ep.Buffer`: the decode calls and DeepEP's rank-mask API.

:class:`LowLatencyCalls` is a base class of :class:`moe_ep.deepep.v1.buffer.Buffer` (which holds the constructor, the stream
and handle helpers it uses, and normal mode); it is not for use on its own. The stream checker's reports name its
calls after the public class (``Buffer.low_latency_dispatch``).

Calls here: ``low_latency_dispatch`` / ``low_latency_combine`` (and their zero-copy buffer and clean calls), the
low-latency size hint, and with ``enable_shrink`` the mask API (``low_latency_update_mask_buffer``, ...) and the
warning about ranks a timed-out wait has masked.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from ... import validate as V
from ...backends.base import LowLatencyHandle
from ... import events
from .checks import _reports_refusal

__all__: list = []


class LowLatencyCalls:
    """The low-latency calls and mask API of :class:`moe_ep.Buffer` (a base class of it; see the module doc)."""

    def _check_shrink(self) -> None:
        if self._destroyed:
            raise RuntimeError("moe_ep.Buffer: this Buffer was destroyed")
        if not self.enable_shrink:
            raise ValueError("the low-latency mask API needs Buffer(..., low_latency_mode=True, enable_shrink=True) "
                             "(as in DeepEP)")

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """DeepEP's mask API: mask (``mask=True``) or unmask ``rank_to_mask`` on THIS rank; needs ``enable_shrink``.

        A rank masked here is neither sent to nor waited for by this rank's low-latency calls; its rows in the
        outputs: ``recv_count`` excludes its tokens (its source block of ``recv_x`` stays empty), and combine adds 0
        for selections of experts it holds (with ``eplb.map_topk(..., slot_mask=...)`` no token selects them).
        Call it with the same arguments on every live rank between steps. A rank that masks ITSELF exchanges
        with no other rank until cleaned (its calls only serve its own tokens with its own experts). Device write,
        no host read (CUDA-graph safe on ``symm``)."""
        self._check_shrink()
        if not isinstance(rank_to_mask, int) or not 0 <= rank_to_mask < self.group_size:
            raise ValueError(f"rank_to_mask must be an int in [0, {self.group_size}), got {rank_to_mask!r}")
        self._impl.ll_update_mask(rank_to_mask, bool(mask))

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """DeepEP's mask API: write this rank's mask into ``mask_status`` (`[num_ranks]` `torch.int32`): 0 = live,
        1 = masked by :meth:`low_latency_update_mask_buffer`, 2 = masked automatically because a wait on it timed
        out (nonzero = masked). A device copy, no host read."""
        self._check_shrink()
        if not isinstance(mask_status, torch.Tensor) or mask_status.dtype != torch.int32 \
                or tuple(mask_status.shape) != (self.group_size,):
            raise ValueError(f"mask_status must be a torch.int32 tensor [{self.group_size}], got "
                             f"{getattr(mask_status, 'dtype', type(mask_status).__name__)} "
                             f"{tuple(getattr(mask_status, 'shape', ()))}")
        self._impl.ll_query_mask(mask_status)

    def low_latency_clean_mask_buffer(self) -> None:
        """DeepEP's mask API: unmask every rank (a rank that came back rejoins). Call it on every rank, the returning
        one included, between steps: after every rank has finished the previous step and before anyone starts the
        next (e.g. after a host barrier over the full group). ``symm`` also zeroes this rank's signal words of the
        ranks that were masked (left set by the steps they missed)."""
        self._check_shrink()
        self._impl.ll_clean_mask()
        self._mask_seen = [0] * self.group_size

    def low_latency_masked_ranks(self) -> list:
        """The ranks this rank has masked (by the API or after a timed-out wait), sorted. With ``enable_shrink`` a
        low-latency call whose wait on a rank times out does not raise: it masks that rank and completes without
        it (that rank's tokens are absent from the outputs, its experts' combine contributions are 0); poll this
        after each step (a host read of the mask: one device synchronisation on GPUs, so poll it outside CUDA
        graphs) and, when it grows, re-map with ``eplb.map_topk(..., slot_mask=...)`` and re-run the step. On CPU
        the call that masked a rank also warns (:class:`moe_ep.sync.RankMaskedWarning`)."""
        self._check_shrink()
        return [r for r, v in enumerate(self._impl.ll_mask_host()) if v]

    def low_latency_take_late_writes(self) -> bool:
        """Whether a combine since the last poll found a row written late by a rank this rank has masked (a masked
        rank whose kernel was still running) and left it out (the tokens it hit are NaN; the Buffer stays usable),
        and clear the flag. A host read (one device synchronisation on GPUs): poll it with
        :meth:`low_latency_masked_ranks`, outside CUDA graphs; a True says: stop the masked rank, re-run the step."""
        self._check_shrink()
        return self._impl.ll_take_late_writes()

    def _after_low_latency(self) -> None:
        """CPU only (a host read is free there): warn about ranks a timed-out wait has just masked."""
        if not self.enable_shrink or self._destroyed or events.uses_streams(getattr(self._impl, "device", None)
                                                                           or torch.device("cpu")):
            return
        now = self._impl.ll_mask_host()
        new = [r for r, v in enumerate(now) if v and not self._mask_seen[r]]
        self._mask_seen = now
        timed = [r for r in new if now[r] == 2]
        if self._impl.ll_take_late_writes():
            from ...sync import RankMaskedWarning
            masked = [r for r, v in enumerate(now) if v]
            warnings.warn(RankMaskedWarning(
                f"moe_ep low-latency combine: a row written late by a masked rank (of {masked}; this is rank "
                f"{self.rank}) landed in a live slot and was not summed: the tokens it hit are NaN; stop the masked "
                "rank and re-run the step (the Buffer stays usable)", masked), stacklevel=3)
        if timed:
            from ...sync import RankMaskedWarning
            warnings.warn(RankMaskedWarning(
                f"moe_ep low-latency call: rank(s) {timed} did not arrive within {self.timeout_s:.1f} s and were masked "
                f"(this is rank {self.rank}); their tokens and experts were left out of this call: re-map with the "
                "live replicas (eplb.map_topk slot_mask) and re-run the step", timed), stacklevel=3)

    def _wrap_hook(self, hook):
        if hook is None or not self.enable_shrink:
            return hook

        def wrapped():
            out = hook()
            self._after_low_latency()
            return out
        return wrapped


    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """``num_rdma_bytes`` for low-latency calls up to these shapes, whatever the backend: what this release's
        layouts address (DeepEP's hint takes no top-k, and neither does this one): the ``symm`` layout at any top-k
        its kernels take (up to 32) and the ``nvshmem`` (across nodes) layout at any top-k DeepEP's low-latency
        kernels take (up to 9). At DeepEP's own shapes it is below DeepEP's hint (DeepSeek-V3 decode, T=128,
        hidden 7168, 256 experts: 1.00 GB against 1.91 GB; ``symm`` alone needs 58.9 MB at top-8:
        :meth:`moe_ep.backends.symm.SymmBackend.get_low_latency_size_hint`); docs/sizing.md has the numbers.
        Every backend refuses a buffer too small for a call, with the same message (``torch`` checks the
        ``symm`` layout)."""
        from ...backends.symm_ll import ll_buffer_bytes

        t, e = num_max_dispatch_tokens_per_rank, num_experts
        total = max(ll_buffer_bytes(t, hidden, num_ranks, e, num_topk=min(e, 32), transport=0),
                    ll_buffer_bytes(t, hidden, num_ranks, e, num_topk=min(e, 9), transport=1))
        return (total + 127) // 128 * 128


    # ---------------------------------------------------------------- low-latency mode
    def _check_wait_stats(self, t, name: str, device: torch.device) -> None:
        if t is not None and (not isinstance(t, torch.Tensor) or t.dtype != torch.int64
                              or tuple(t.shape) != (self.group_size,) or t.device != device):
            raise ValueError(f"{name} must be torch.int64 [{self.group_size}] on {device}, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")

    def _check_ll_size(self, T: int, hidden: int, E: int, K: int, what: str) -> None:
        """A backend without a registered buffer (``torch``) refuses what ``symm`` would refuse, with its message,
        so a CPU run catches a too-small ``num_rdma_bytes`` (``0``: not sized, the ``torch`` backend allocates per
        call; ``symm`` / ``nvshmem`` refuse 0 at creation and check their own layout in the call)."""
        if self.backend_name in ("symm", "nvshmem") or self.num_rdma_bytes == 0:
            return
        from ...backends.symm_ll_layout import check_capacity
        check_capacity(self.num_rdma_bytes, T, hidden, self.group_size, E, K, 0, what)

    def _check_low_latency(self) -> None:
        if not self.low_latency_mode:
            raise ValueError("low-latency calls need Buffer(..., low_latency_mode=True)")

    @_reports_refusal("low_latency_dispatch")
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False):
        """Dispatch for decode: fixed-size buffers, FP8 cast inside the send, masked receive layout.

        Arguments:
            x: `[num_tokens, hidden]` `torch.bfloat16`, ``num_tokens <= num_max_dispatch_tokens_per_rank``.
            topk_idx: `[num_tokens, num_topk]` `torch.int64`, ``-1`` for no expert.
            num_max_dispatch_tokens_per_rank: ``T``, the same on every rank.
            num_experts: ``E``; ``L = E / num_ranks`` local experts.
            cumulative_local_expert_recv_stats: optional `[L]` `torch.int32`, ``recv_count`` is added to it.
            dispatch_wait_recv_cost_stats: optional `[num_ranks]` `torch.int64`: the receive adds, per source
                rank, the nanoseconds it waited for that rank (``symm``: device clock, from the receive kernel's
                start until the rank's tokens had arrived; ``torch``: host clock, from this rank's arrival at the
                call until that rank's). A rank that keeps showing large values is slow or dying.
            use_fp8: cast to FP8 with 1x128 scales; round_scale: power-of-two scales; use_ue8m0: scales
                packed as UE8M0 exponents (implies ``round_scale``).
            return_recv_hook: only issue the send; the returned ``hook()`` completes the receive.

        Returns:
            recv_x: `[L, num_ranks * T, hidden]` `torch.bfloat16`, or for FP8 a tuple of
                `[L, num_ranks * T, hidden]` `torch.float8_e4m3fn` and scales, column-major: `[L, num_ranks * T,
                hidden / 128]` `torch.float32`, or `[L, num_ranks * T, hidden / 512]` `torch.int32` with
                ``use_ue8m0``. Expert ``e``'s rows are ordered by source rank, then source token;
                rows at or past ``recv_count[e]`` are unspecified.
            recv_count: `[L]` `torch.int32`, valid rows per local expert.
            handle: for :meth:`low_latency_combine`.
            event: :class:`EventOverlap`.
            hook: ``None`` unless ``return_recv_hook``.
        """
        self._check_low_latency()
        V.check_low_latency_x(x, num_max_dispatch_tokens_per_rank, use_fp8)
        num_local = V.check_num_experts(num_experts, self.group_size)
        if async_finish and return_recv_hook:
            raise ValueError("async_finish and return_recv_hook cannot both be set")
        if (round_scale or use_ue8m0) and not use_fp8:
            raise ValueError("round_scale / use_ue8m0 need use_fp8=True")
        V.check_topk_idx(topk_idx, x.shape[0], num_experts, x.device, self._value_checks(x.device))
        if cumulative_local_expert_recv_stats is not None:
            s = cumulative_local_expert_recv_stats
            if not isinstance(s, torch.Tensor) or s.dtype != torch.int32 or tuple(s.shape) != (num_local,):
                raise ValueError(f"cumulative_local_expert_recv_stats must be torch.int32 [{num_local}]")
        self._check_wait_stats(dispatch_wait_recv_cost_stats, "dispatch_wait_recv_cost_stats", x.device)
        self._check_ll_size(num_max_dispatch_tokens_per_rank, x.shape[1], num_experts, topk_idx.shape[1],
                            "low_latency_dispatch")
        res, event = self._run(
            lambda: self._impl.low_latency_dispatch(
                x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats, use_fp8=use_fp8,
                round_scale=round_scale or use_ue8m0, use_ue8m0=use_ue8m0, return_recv_hook=return_recv_hook,
                wait_recv_cost_stats=dispatch_wait_recv_cost_stats),
            x.device, None, async_finish, False,
            inputs=(x, topk_idx, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats))
        recv_x = (res.recv_x, res.recv_x_scales) if use_fp8 else res.recv_x
        if res.hook is None:
            self._after_low_latency()
        return recv_x, res.recv_count, res.handle, event, self._wrap_hook(res.hook)

    @_reports_refusal("low_latency_combine")
    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: LowLatencyHandle, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None, *,
                            combine_dtype: Optional[torch.dtype] = None):
        """Weighted combine for decode: ``out[t] = sum_k topk_weights[t, k] * y(expert topk_idx[t, k], t)``.

        Arguments:
            x: `[L, num_ranks * T, hidden]` `torch.bfloat16` or `torch.float16`, expert outputs in the dispatch's
                row order; its dtype is the output's (whatever the dispatch's format was).
            topk_idx, topk_weights: the dispatching rank's `[num_tokens, num_topk]` routing (int64 / float32).
            handle: from :meth:`low_latency_dispatch`.
            use_logfmt: send LogFMT-10 (11 bits per channel: 10-bit sign + log code, two int32 per 64 channels;
                encoded in the send, decoded in the receive; :mod:`moe_ep.kernels.logfmt`); hidden % 64 == 0.
            zero_copy: ``x`` is the tensor from :meth:`get_next_low_latency_combine_buffer`.
            out: optional `[num_tokens, hidden]` output of ``x``'s dtype.
            combine_wait_recv_cost_stats: optional `[num_ranks]` `torch.int64`, as ``dispatch_wait_recv_cost_stats``
                of :meth:`low_latency_dispatch`, per expert rank.
            combine_dtype: keyword-only: ``None`` or ``torch.float8_e4m3fn`` (e4m3 + float32 scale per 128 channels,
                encoded in the send); not together with ``use_logfmt``.

        Returns:
            combined_x: `[num_tokens, hidden]` of ``x``'s dtype (decoded payloads, float32 accumulation over k ascending; a token
                with no expert gives zeros); valid after ``hook()`` when ``return_recv_hook``.
            event: :class:`EventOverlap`.
            hook: ``None`` unless ``return_recv_hook``.
        """
        self._check_low_latency()
        self._check_handle(handle, LowLatencyHandle)
        if async_finish and return_recv_hook:
            raise ValueError("async_finish and return_recv_hook cannot both be set")
        num_local = handle.num_experts // self.group_size
        rows = self.group_size * handle.num_max_dispatch_tokens_per_rank
        if not isinstance(x, torch.Tensor) or x.dtype not in V.HALF_DTYPES or \
                tuple(x.shape) != (num_local, rows, handle.hidden):
            raise ValueError(f"x must be torch.bfloat16 or torch.float16 [{num_local}, {rows}, {handle.hidden}], got "
                             f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
        fmt = V.combine_format(x.dtype, combine_dtype, use_logfmt, low_latency=True)
        group = {2: 128, 3: 64}.get(fmt, 1)
        if handle.hidden % group:
            raise ValueError(f"{'FP8' if fmt == 2 else 'LogFMT'} combine needs hidden to be a multiple of {group}, "
                             f"got {handle.hidden}")
        kw = {"fmt": fmt} if fmt >= 2 else {}
        V.check_topk_idx(topk_idx, handle.num_tokens, handle.num_experts, x.device, self._value_checks(x.device))
        V.check_topk_weights(topk_weights, topk_idx)
        if out is not None and (not isinstance(out, torch.Tensor) or out.dtype != x.dtype
                                or tuple(out.shape) != (handle.num_tokens, handle.hidden)):
            raise ValueError(f"out must be {x.dtype} (the dtype of x) [{handle.num_tokens}, {handle.hidden}], got "
                             f"{getattr(out, 'dtype', type(out).__name__)} {tuple(getattr(out, 'shape', ()))}")
        self._check_wait_stats(combine_wait_recv_cost_stats, "combine_wait_recv_cost_stats", x.device)
        self._check_ll_size(handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts,
                            topk_idx.shape[1], "low_latency_combine")
        (combined, hook), event = self._run(
            lambda: self._impl.low_latency_combine(x, topk_idx, topk_weights, handle, zero_copy=zero_copy,
                                                   return_recv_hook=return_recv_hook, out=out,
                                                   wait_recv_cost_stats=combine_wait_recv_cost_stats, **kw),
            x.device, None, async_finish, False,
            inputs=(x, topk_idx, topk_weights, handle, out, combine_wait_recv_cost_stats))
        if hook is None:
            self._after_low_latency()
        return combined, event, self._wrap_hook(hook)

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """The `[L, num_ranks * T, hidden]` `torch.bfloat16` tensor to write expert outputs into for
        ``low_latency_combine(..., zero_copy=True)``."""
        self._check_low_latency()
        self._check_handle(handle, LowLatencyHandle)
        return self._impl.get_next_low_latency_combine_buffer(handle)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """DeepEP compatibility: buffers of this release need no cleaning between uses."""
        self._check_low_latency()
