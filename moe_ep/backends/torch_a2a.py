"""The ``torch`` backend: ``all_to_all_single`` / ``all_gather_into_tensor`` over torch.distributed.

Runs wherever torch.distributed runs (gloo on CPU, NCCL on GPUs, any number of nodes). It is the
vanilla baseline the device-initiated backends are measured against and the reference their tests
compare with.

Normal mode needs the receive counts on the host (one small all-to-all of counts, then the payload):
a host synchronisation per call. The cross-rank checks of every call (signature, refusal, arrival within
``timeout_s``) travel in that all-to-all's header (:meth:`moe_ep.sync.ArrivalCheck.exchange`); a cached
dispatch, a combine and a low-latency call exchange the header alone before their payload.

Low-latency mode moves fixed-size slabs (``T`` tokens per rank), so
its collectives have static shapes and it never reads device values on the host.

Wire formats (everything travels as ``uint8`` rows, so FP8 crosses gloo unharmed):

- normal dispatch row: ``x`` bytes (``H`` for FP8, ``2H`` for BF16) | FP8 scales ``4 * H/128`` |
  ``topk_idx`` ``8K`` | ``topk_weights`` ``4K`` (the topk fields only on a non-cached dispatch);
- normal combine row: BF16 / FP16 ``2H`` (or FP8 ``H`` + scales ``4 * H/128``) | ``topk_weights`` ``4K`` (only
  when given);
- low-latency dispatch: every rank all-gathers ``[T, row]`` with row = ``x`` bytes | FP8 scales |
  ``topk_idx`` ``8K`` (slot ``t`` holds token ``t``; slots past ``num_tokens`` carry ``topk_idx = -1``);
- low-latency combine: ``[R, T, K, row]`` all-to-all: slot ``(r, t, k)`` holds this rank's output
  for rank ``r``'s token ``t``, selection ``k``, in the wire format (BF16 / FP16 ``2H``, FP8 or LogFMT-10:
  :mod:`moe_ep.kernels.logfmt`, encoded and decoded by the same math as the ``symm`` kernels).
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import torch
import torch.distributed as dist

from ..fp8 import FP8_DTYPE, ll_dispatch_quant_ref, pack_ue8m0, tma_aligned_size
from ..kernels.logfmt import FMT_BF16, FMT_FP8, FMT_FP16, FMT_LOGFMT, check_hidden, decode_rows, encode_rows
from ..kernels.logfmt import row_bytes as wire_row_bytes
from ..sync import ArrivalCheck, RankTimeoutError, host_group
from .base import Backend, DispatchHandle, DispatchResult, LowLatencyDispatchResult, LowLatencyHandle
from .torch_rows import (
    _bytes,
    _count_local,
    _from_bytes,
    _gather_rows,
    _rows_by_rank,
    _token_index_bytes,
    layout_from_topk,
    localize_topk,
    pad_to_worst,
    unpack_rows,
)

__all__ = ["TorchBackend", "layout_from_topk", "localize_topk", "pad_to_worst", "unpack_rows"]


# torch >= 2.13 renamed all_gather_into_tensor (the old name warns); torch 2.11 has only the old one.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclasses.dataclass
class TorchDispatchHandle(DispatchHandle):
    send_token_idx: torch.Tensor = None  # [S] token index of each sent row, ordered by destination rank
    send_counts: list = None  # rows sent to each rank
    recv_counts: list = None  # rows received from each rank
    num_recv_tokens_per_expert_list: list = None
    counts: list = None  # [R][R] rows rank s sent to rank d (the dispatch's exchanged counts)
    recv_src_idx: torch.Tensor = None  # [num_recv] int32

    def deepep_field(self, name: str):
        if name == "rank_prefix_matrix":  # [R, R] int32: built when asked (most callers never do)
            return torch.tensor(self.counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(self.send_token_idx.device)
        return getattr(self, name, None)


@dataclasses.dataclass
class TorchLowLatencyHandle(LowLatencyHandle):
    sel_expert: torch.Tensor = None  # [R*T*K] int64: local expert of selection (src row, k), L if not here
    sel_pos: torch.Tensor = None  # [R*T*K] int64: its row inside that expert's slab
    recv_count: torch.Tensor = None  # [L] int32
    num_topk: int = 0
    device: torch.device = None

    def selection_slots(self) -> torch.Tensor:
        if self.sel_expert is None:
            raise ValueError("the dispatch of this handle has not been received yet: call its hook first")
        L = self.num_experts // (self.sel_expert.numel() // (self.num_max_dispatch_tokens_per_rank * self.num_topk))
        rt = self.sel_expert.numel() // self.num_topk
        slots = torch.where(self.sel_expert < L, self.sel_expert * rt + self.sel_pos, -1)
        return slots.to(torch.int32).view(-1, self.num_max_dispatch_tokens_per_rank, self.num_topk)


class TorchBackend(Backend):
    name = "torch"
    graph_safe_low_latency = False  # the arrival check talks to the store on the host

    def __init__(self, group, rank: int, world_size: int, **kwargs):
        super().__init__(group, rank, world_size, **kwargs)
        self.arrival = ArrivalCheck(group, rank, world_size, self.timeout_s, exchange_group=host_group(group))
        self._combine_buffers: dict = {}
        # rank mask (enable_shrink, low-latency mode): host list, 0 live / 1 API / 2 timed out
        self.shrink = False
        self._mask = [0] * world_size
        self._subgroups: dict = {}

    # ------------------------------------------------------------------ rank mask (enable_shrink)
    def enable_shrink(self) -> None:
        self.shrink = True

    def ll_update_mask(self, rank: int, masked: bool) -> None:
        self._mask[rank] = 1 if masked else 0

    def ll_query_mask(self, out: torch.Tensor) -> None:
        out.copy_(torch.tensor(self._mask, dtype=torch.int32))

    def ll_clean_mask(self) -> None:
        self._mask = [0] * self.world_size

    def ll_mask_host(self) -> list:
        return list(self._mask)

    def _live(self) -> list:
        if self._mask[self.rank]:  # this rank masked itself: it exchanges with nobody else
            return [self.rank]
        return [r for r in range(self.world_size) if not self._mask[r]]

    def _ll_arrive(self, what: str, fields: dict, wait_ns) -> list:
        """The arrival check over the live ranks; with ``enable_shrink`` ranks that time out are masked (2)
        (the store path: it can wait for a subset). Returns the live ranks the call runs over."""
        if not self.shrink:
            self.arrival.exchange(what, fields, wait_ns=wait_ns)
            return list(range(self.world_size))
        live = self._live()
        gone = self.arrival.arrive(what, fields, wait_ns, live=live, shrink=self.shrink)
        for r in gone:
            self._mask[r] = 2
        return self._live() if self.shrink else list(range(self.world_size))

    def _ll_group(self, live: list):
        """The process group of the live ranks: the Buffer's own group when every rank is live, else a subgroup
        made on first use with ``use_local_synchronization`` (only its members rendezvous: a dead rank cannot)."""
        if len(live) == self.world_size:
            return self.group
        key = tuple(live)
        if key not in self._subgroups:
            granks = dist.get_process_group_ranks(self.group) if self.group is not None else list(
                range(dist.get_world_size()))
            self._subgroups[key] = dist.new_group([granks[r] for r in live], use_local_synchronization=True,
                                                  timeout=timedelta(seconds=max(self.timeout_s, 30.0)))
        return self._subgroups[key]

    def arrival_mark(self):
        return self.arrival.seq

    def refuse(self, what: str, mark, message: str) -> None:
        if mark is None or self.arrival.seq != mark:  # the call reached its arrival: the peers know
            return
        if self.shrink and what.startswith("low_latency"):
            self.arrival.refuse(what, message)  # the store path of enable_shrink's low-latency calls
        else:
            self.arrival.refuse_exchange(what, message)

    # ------------------------------------------------------------------ collectives
    def _a2a(self, send: torch.Tensor, recv_counts: list, send_counts: list, row_bytes: int,
             async_op: bool = False):
        recv = torch.empty(sum(recv_counts), row_bytes, dtype=torch.uint8, device=send.device)
        work = dist.all_to_all_single(recv, send, output_split_sizes=recv_counts, input_split_sizes=send_counts,
                                      group=self.group, async_op=True)
        if not async_op:
            self._wait(work, "rows")
            work = None
        return recv, work

    def _wait(self, work, what: str) -> None:
        """Bound a payload collective by ``timeout_s`` too: every rank passed the call's arrival check, so only a
        peer that died (or gave up) since then makes it time out."""
        try:
            work.wait(timeout=timedelta(seconds=self.timeout_s))
        except Exception as exc:  # noqa: BLE001 - "Operation timed out!" or a peer's closed connection
            peers = [r for r in range(self.world_size) if r != self.rank]
            raise RankTimeoutError(
                f"moe_ep {what}: the exchange with rank(s) {peers} did not complete within {self.timeout_s:.1f} s "
                f"after every rank had arrived (this is rank {self.rank}; a peer died or gave up): destroy the "
                f"Buffer ({exc})", peers) from exc

    def get_dispatch_layout(self, topk_idx, num_experts):
        per_rank, per_expert, in_rank = layout_from_topk(topk_idx, num_experts, self.world_size)
        return per_rank, None, per_expert, in_rank

    # ------------------------------------------------------------------ normal mode
    def dispatch(self, x, x_scales, *, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                 topk_idx, topk_weights, num_experts, expert_alignment, num_worst_tokens):
        R = self.world_size
        n, hidden = x.shape
        is_fp8 = x_scales is not None
        fields = {"hidden": hidden, "x": "fp8" if is_fp8 else str(x.dtype).replace("torch.", ""),
                  "scales": "-" if x_scales is None else str(x_scales.dtype).replace("torch.", ""),
                  "cached": handle is not None, "topk": "-" if topk_idx is None else topk_idx.shape[1],
                  "num_experts": num_experts or "-"}
        per_expert = None
        if handle is not None:
            self.arrival.exchange("dispatch", fields)
            send_idx, send_counts, recv_counts = handle.send_token_idx, handle.send_counts, handle.recv_counts
            num_local = 0
        else:
            num_local = num_experts // R
            # Step 1: counts, in the arrival check's header: row s = tokens rank s sends to each rank (all of
            # them: DeepEP's rank_prefix_matrix needs the full [R, R]). NOTES: the host synchronisation.
            counts = self.arrival.exchange("dispatch", fields, counts=num_tokens_per_rank)  # [source][destination]
            send_counts = counts[self.rank]
            recv_counts = [row[self.rank] for row in counts]
            if topk_idx is None and num_worst_tokens <= 0:
                # layout only: no top-k travels to count from, so the per-expert counts do (the header
                # has checked that every rank has the same number of experts)
                local_counts = num_tokens_per_expert.reshape(R, num_local).to(torch.int64).contiguous()
                all_local = torch.empty(R * R, num_local, dtype=torch.int64, device=x.device)
                _all_gather(all_local, local_counts, group=self.group)
                per_expert = all_local.view(R, R, num_local)[:, self.rank].sum(0).tolist()
            # Rows ordered by destination rank, then token index.
            send_idx = _rows_by_rank(is_token_in_rank)
        # Step 2: pack the payload rows: each token's fields side by side as one byte row, then one gather of the
        # rows each destination gets.
        cols = [_bytes(x)]
        if is_fp8:
            cols.append(_bytes(x_scales))
        with_topk = handle is None and topk_idx is not None
        if handle is None:  # source token index (DeepEP's recv_src_idx), 4 bytes per row
            cols.append(_token_index_bytes(x))
        if with_topk:
            k = topk_idx.shape[1]
            cols += [_bytes(topk_idx), _bytes(topk_weights)]
        send = _gather_rows(cols, send_idx)
        row_bytes = send.shape[1]
        # Step 3: move them.
        recv, _ = self._a2a(send, recv_counts, send_counts, row_bytes)
        num_recv = recv.shape[0]
        # Step 4: unpack.
        recv_x, recv_scales, off = unpack_rows(recv, x.dtype, hidden, x_scales)
        recv_topk_idx = recv_topk_weights = None
        recv_src_idx = None
        if handle is None:
            recv_src_idx = _from_bytes(recv[:, off:off + 4], torch.int32, 1).view(-1)
            off += 4
        if with_topk:
            recv_topk_idx, recv_topk_weights = localize_topk(recv, off, k, self.rank, num_local)
            if num_worst_tokens <= 0:  # selections of each local expert among the received rows
                per_expert = _count_local(recv_topk_idx, num_local)
        if handle is None:
            if num_worst_tokens > 0:
                per_expert_list = []  # as DeepEP and the symm backend: outputs sized without the counts
            else:
                per_expert_list = [(c + expert_alignment - 1) // expert_alignment * expert_alignment for c in per_expert]
        else:
            per_expert_list = handle.num_recv_tokens_per_expert_list
        # Step 5: worst-case padding (static output shapes for the caller).
        num_rows = num_worst_tokens if num_worst_tokens > 0 else num_recv
        recv_x, recv_scales, recv_src_idx, recv_topk_idx, recv_topk_weights = pad_to_worst(
            self.rank, num_recv, num_worst_tokens, recv_x, recv_scales, recv_src_idx, recv_topk_idx, recv_topk_weights)
        if handle is None:
            handle = TorchDispatchHandle(
                owner=id(self), num_tokens=n, num_recv_tokens=num_rows, hidden=hidden,
                is_token_in_rank=is_token_in_rank, num_tokens_per_rank=num_tokens_per_rank,
                send_token_idx=send_idx, send_counts=send_counts, recv_counts=recv_counts,
                num_recv_tokens_per_expert_list=per_expert_list, counts=counts,
                recv_src_idx=recv_src_idx)
        elif num_rows != handle.num_recv_tokens:
            raise ValueError(f"cached dispatch received {num_rows} rows but the handle expects "
                             f"{handle.num_recv_tokens} (num_worst_tokens must match the original call)")
        return DispatchResult(recv_x.contiguous(), None if recv_scales is None else recv_scales.contiguous(),
                              recv_topk_idx, recv_topk_weights, list(per_expert_list), handle)

    def _combine_arrive(self, x, hidden: int, topk_weights, fmt):
        """The normal combine's wire format (FP8 on request, else ``x``'s 16-bit dtype; LogFMT refused) and its
        arrival check, shared by the flat and the node-aware combine."""
        if fmt == FMT_LOGFMT:
            raise ValueError("LogFMT combine is a low-latency combine format (use combine_dtype=torch.float8_e4m3fn "
                             "for a compressed normal combine)")
        if fmt != FMT_FP8:
            fmt = FMT_FP16 if x.dtype == torch.float16 else FMT_BF16
        check_hidden(fmt, hidden)
        self.arrival.exchange("combine", {"hidden": hidden, "x": str(x.dtype).replace("torch.", ""), "fmt": fmt,
                                          "topk_weights": "-" if topk_weights is None else topk_weights.shape[1]})
        return fmt

    def combine(self, x, handle, topk_weights, bias, fmt=None):
        hidden, n = handle.hidden, handle.num_tokens
        num_valid = sum(handle.recv_counts)
        fmt = self._combine_arrive(x, hidden, topk_weights, fmt)
        pb = wire_row_bytes(fmt, hidden)
        parts = [encode_rows(x[:num_valid], fmt)]
        if topk_weights is not None:
            k = topk_weights.shape[1]
            parts.append(_bytes(topk_weights[:num_valid]))
        send = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        row_bytes = send.shape[1]
        # Send back along the reverse of the dispatch's routes.
        recv, _ = self._a2a(send, handle.send_counts, handle.recv_counts, row_bytes)
        rows = decode_rows(recv[:, :pb], fmt, hidden)
        acc = torch.zeros(n, hidden, dtype=torch.float32, device=x.device)
        for b in bias:
            acc += b.float()
        # NOTES: ascending source-rank order, float32, one cast at the end (the pinned reduction order).
        w_acc = None
        if topk_weights is not None:
            wrows = _from_bytes(recv[:, pb:pb + 4 * k], torch.float32, k)
            w_acc = torch.zeros(n, k, dtype=torch.float32, device=x.device)
        start = 0
        for cnt in handle.send_counts:
            idx = handle.send_token_idx[start:start + cnt]
            acc.index_add_(0, idx, rows[start:start + cnt])
            if w_acc is not None:
                w_acc.index_add_(0, idx, wrows[start:start + cnt])
            start += cnt
        return acc.to(x.dtype), w_acc

    # ------------------------------------------------------------------ low-latency mode
    @staticmethod
    def _add_wait(stats, wait_ns):
        if stats is not None:
            stats.add_(torch.tensor(wait_ns, dtype=torch.int64).to(stats.device))

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, *,
                             cumulative_local_expert_recv_stats, use_fp8, round_scale, use_ue8m0, return_recv_hook,
                             wait_recv_cost_stats=None):
        R, T = self.world_size, num_max_dispatch_tokens_per_rank
        L = num_experts // R
        n, hidden = x.shape
        k = topk_idx.shape[1]
        dev = x.device
        # NOTES: the wait this backend can time per rank is the arrival at the call (host clock); the
        # collective's own transfer time is not attributed to ranks.
        wait_ns = [0] * R if wait_recv_cost_stats is not None else None
        live = self._ll_arrive("low_latency_dispatch", {
            "hidden": hidden, "T": T, "num_experts": num_experts, "topk": k, "use_fp8": use_fp8,
            "round_scale": round_scale, "use_ue8m0": use_ue8m0}, wait_ns)
        self._add_wait(wait_recv_cost_stats, wait_ns)
        # Step 1: quantize on the sender (1x128 groups) and build this rank's slab [T, row].
        if use_fp8:
            q, s = ll_dispatch_quant_ref(x, round_scale=round_scale)
            parts = [_bytes(q), _bytes(s)]
        else:
            parts = [_bytes(x)]
        idx_pad = torch.full((T, k), -1, dtype=torch.int64, device=dev)
        idx_pad[:n] = topk_idx
        row_bytes = sum(p.shape[1] for p in parts) + 8 * k
        slab = torch.zeros(T, row_bytes, dtype=torch.uint8, device=dev)
        off = 0
        for p in parts:
            slab[:n, off:off + p.shape[1]] = p
            off += p.shape[1]
        slab[:, off:] = _bytes(idx_pad)
        # Step 2: send (every rank receives every slab; receivers keep the rows routed to them).
        gathered = torch.empty(R * T, row_bytes, dtype=torch.uint8, device=dev)
        if len(live) == R:
            work = _all_gather(gathered, slab, group=self.group, async_op=True)
            sub = None
        else:
            # masked sources: all-0xFF rows (topk_idx = -1: no selection); the live ranks' slabs over a subgroup
            gathered.fill_(255)
            sub = torch.empty(len(live) * T, row_bytes, dtype=torch.uint8, device=dev)
            work = _all_gather(sub, slab, group=self._ll_group(live), async_op=True) if len(live) > 1 else None
            if work is None:
                sub.copy_(slab)
        rows = R * T
        # Outputs are views of staging tensors with one extra "sink" expert (index L) that absorbs the
        # writes of unselected (row, k) slots, so every scatter has a static size of R*T*K rows.
        if use_fp8:
            g = hidden // 128
            x_stage = torch.empty(L + 1, rows, hidden, dtype=FP8_DTYPE, device=dev)
            gs, s_dtype = ((g + 3) // 4, torch.int32) if use_ue8m0 else (g, torch.float32)
            # column-major scales: storage [L + 1, G, rows padded to 16 bytes], viewed as [L, rows, G]
            s_stage = torch.empty(L + 1, gs, tma_aligned_size(rows), dtype=s_dtype, device=dev)
            recv_scales = s_stage[:L, :, :rows].transpose(1, 2)
        else:
            x_stage = torch.empty(L + 1, rows, hidden, dtype=x.dtype, device=dev)  # BF16 or FP16
            recv_scales = None
        recv_x = x_stage[:L]
        recv_count = torch.empty(L, dtype=torch.int32, device=dev)
        handle = TorchLowLatencyHandle(owner=id(self), num_tokens=n, hidden=hidden,
                                       num_max_dispatch_tokens_per_rank=T, num_experts=num_experts,
                                       num_topk=k, device=dev)

        def recv_hook():
            # Step 3: receive: keep the (row, k) selections of local experts and place row j of
            # expert e at its rank among e's selections in (source rank, token) order; static
            # shapes only (no host synchronisation).
            if work is not None:
                work.wait()
            if sub is not None:
                gathered.view(R, T, row_bytes)[live] = sub.view(len(live), T, row_bytes)
            gidx = _from_bytes(gathered[:, row_bytes - 8 * k:], torch.int64, k)  # [R*T, K]
            lo = self.rank * L
            is_local = (gidx >= lo) & (gidx < lo + L)
            local = torch.where(is_local, gidx - lo, torch.full_like(gidx, L))  # L = sink
            sel = torch.zeros(rows, L + 1, dtype=torch.int32, device=dev)
            sel.scatter_(1, local, 1)  # a token never selects an expert twice
            pos_table = sel.cumsum(0, dtype=torch.int32) - 1  # [R*T, L + 1]
            pos = torch.gather(pos_table, 1, local).to(torch.int64)  # [R*T, K]
            count = sel[:, :L].sum(0, dtype=torch.int32)
            e_flat, p_flat = local.reshape(-1), pos.reshape(-1)
            src = torch.arange(rows, device=dev).repeat_interleave(k)  # source row of each (row, k)
            handle.sel_expert, handle.sel_pos = e_flat, p_flat
            handle.recv_count = count
            recv_count.copy_(count)
            if use_fp8:
                xq = gathered[:, :hidden].index_select(0, src).view(FP8_DTYPE)
                x_stage.index_put_((e_flat, p_flat), xq)
                sc = _from_bytes(gathered[:, hidden:hidden + 4 * g], torch.float32, g).index_select(0, src)
                if use_ue8m0:
                    sc = pack_ue8m0(sc)
                s_stage.permute(0, 2, 1).index_put_((e_flat, p_flat), sc)
            else:
                xb = _from_bytes(gathered[:, :2 * hidden], x.dtype, hidden).index_select(0, src)
                x_stage.index_put_((e_flat, p_flat), xb)
            if cumulative_local_expert_recv_stats is not None:
                cumulative_local_expert_recv_stats.add_(count)

        if return_recv_hook:
            return LowLatencyDispatchResult(recv_x, recv_scales, recv_count, handle, recv_hook)
        recv_hook()
        return LowLatencyDispatchResult(recv_x, recv_scales, recv_count, handle, None)

    def get_next_low_latency_combine_buffer(self, handle):
        L = handle.num_experts // self.world_size
        shape = (handle.device, L, self.world_size * handle.num_max_dispatch_tokens_per_rank, handle.hidden)
        buf = self._combine_buffers.get(shape)
        if buf is None:
            buf = self._combine_buffers[shape] = torch.empty(shape[1:], dtype=torch.bfloat16, device=handle.device)
        return buf

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, *, zero_copy, return_recv_hook, out,
                            wait_recv_cost_stats=None, fmt=None):
        R, T = self.world_size, handle.num_max_dispatch_tokens_per_rank
        L = handle.num_experts // R
        k, hidden, n = handle.num_topk, handle.hidden, handle.num_tokens
        dev = x.device
        if topk_idx.shape[1] != k:
            raise ValueError(f"topk_idx has {topk_idx.shape[1]} columns but dispatch had {k}")
        if handle.sel_expert is None:
            raise ValueError("the dispatch of this handle has not been received yet: call its hook first")
        wait_ns = [0] * R if wait_recv_cost_stats is not None else None
        if fmt is None or fmt in (FMT_BF16, FMT_FP16):
            fmt = FMT_FP16 if x.dtype == torch.float16 else FMT_BF16
        check_hidden(fmt, hidden)
        live = self._ll_arrive("low_latency_combine", {"hidden": hidden, "T": T, "num_experts": handle.num_experts,
                                                    "topk": k, "x": str(x.dtype).replace("torch.", ""), "fmt": fmt},
                            wait_ns)
        self._add_wait(wait_recv_cost_stats, wait_ns)
        # Step 1: slot (src_rank, token, k) of the send buffer takes this rank's output for that selection
        # (a gather of R*T*K rows; slots of other ranks' experts carry junk that the receiver masks).
        e_idx = torch.where(handle.sel_expert < L, handle.sel_expert, torch.zeros_like(handle.sel_expert))
        p_idx = torch.where(handle.sel_expert < L, handle.sel_pos, torch.zeros_like(handle.sel_pos))
        send = encode_rows(x[e_idx, p_idx], fmt)  # [R*T*K, row bytes] in the wire format
        # Step 2: all-to-all of the [R, T*K*row] slabs (bytes: gloo takes uint8).
        recv = torch.empty(R * T * k, send.shape[1], dtype=torch.uint8, device=dev)
        sub = None
        if len(live) == R:
            work = dist.all_to_all_single(recv, send, group=self.group, async_op=True)
        else:
            # only the live ranks exchange (a subgroup); rows of masked expert ranks stay zero and are skipped
            recv.zero_()
            send_sub = send.view(R, T * k, -1)[live].reshape(len(live) * T * k, -1)
            sub = torch.empty_like(send_sub)
            work = (dist.all_to_all_single(sub, send_sub, group=self._ll_group(live), async_op=True)
                    if len(live) > 1 else None)
            if work is None:
                sub.copy_(send_sub)
        live_rank = torch.zeros(R, dtype=torch.bool, device=dev)
        live_rank[live] = True
        combined = out if out is not None else torch.empty(n, hidden, dtype=x.dtype, device=dev)

        def recv_hook():
            # Step 3: weighted sum over k ascending, float32 accumulation, -1 holes skipped.
            if work is not None:
                work.wait()
            if sub is not None:
                recv.view(R, T * k, -1)[live] = sub.view(len(live), T * k, -1)
            r3 = decode_rows(recv, fmt, hidden).reshape(R, T, k, hidden)
            # selections of experts on masked ranks add 0 (with eplb slot_mask no token selects them)
            is_valid = (topk_idx >= 0) & live_rank[torch.where(topk_idx >= 0, topk_idx // L, 0)]
            src_rank = torch.where(is_valid, topk_idx // L, torch.zeros_like(topk_idx))
            t_idx = torch.arange(n, device=dev).unsqueeze(1).expand(n, k)
            k_idx = torch.arange(k, device=dev).unsqueeze(0).expand(n, k)
            y = r3[src_rank, t_idx, k_idx]  # [N, K, H]
            acc = torch.zeros(n, hidden, dtype=torch.float32, device=dev)
            for kk in range(k):
                term = topk_weights[:, kk:kk + 1] * y[:, kk].float()
                acc += torch.where(is_valid[:, kk:kk + 1], term, torch.zeros_like(term))
            combined.copy_(acc.to(x.dtype))

        if return_recv_hook:
            return combined, recv_hook
        recv_hook()
        return combined, None

    def destroy(self) -> None:
        self._combine_buffers.clear()
