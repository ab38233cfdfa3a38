"""``moe_ep.Buffer``: the DeepEP-compatible front end over every communication backend.

The Buffer checks every argument (raising ValueError/TypeError before any rank communicates),
applies DeepEP's stream/event semantics, and delegates the communication to a backend
(:mod:`moe_ep.backends`).
"""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from . import validate as V
from .backends.base import Backend, DispatchHandle, LowLatencyHandle
from . import events
from .events import EventOverlap, run_on_comm_stream

__all__ = ["Buffer", "Config"]

BACKENDS = ("auto", "torch", "symm", "nvshmem")


class Config:
    """DeepEP-style tuning config (``num_sms``, chunk sizes) and DeepEP's buffer size hints. The kernels of this
    release take no tuning from it (the ``torch`` backend allocates per call; ``symm`` sizes its work from the
    call's shapes); it is accepted everywhere so engine code written for DeepEP runs unchanged.

    ``num_max_tokens_per_rank`` and ``num_max_topk`` (keyword-only, an extension) are what
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
        # DeepEP's NVL buffer holds, per destination rank, num_sms / 2 channels of num_max_nvl_chunked_recv_tokens
        # tokens in flight; our normal-mode buffer holds a whole call, so that is the default call size sized for.
        self.num_max_tokens_per_rank = num_max_tokens_per_rank if num_max_tokens_per_rank is not None else \
            max(num_sms // 2, 1) * num_max_nvl_chunked_recv_tokens
        self.num_max_topk = num_max_topk

    @staticmethod
    def _check_hint_args(hidden_bytes, num_ranks) -> None:
        if not isinstance(hidden_bytes, int) or hidden_bytes <= 0:
            raise ValueError(f"hidden_bytes must be a positive int (hidden * bytes per element, e.g. hidden * 2 for "
                             f"BF16), got {hidden_bytes!r}")
        if not isinstance(num_ranks, int) or num_ranks <= 0:
            raise ValueError(f"num_ranks must be a positive int, got {num_ranks!r}")

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP: ``num_nvl_bytes`` for normal-mode calls. Here: the bytes per rank of the ``symm`` backend's
        normal-mode buffer (:meth:`moe_ep.backends.symm.SymmBackend.get_normal_size_hint`, the exact layout its
        kernels address: a dispatch area and a combine area, each ``num_ranks`` slots of whole calls) when every
        rank sends up to ``num_max_tokens_per_rank`` tokens per call, rows of ``hidden_bytes`` (BF16 payloads,
        ``hidden = ceil(hidden_bytes / 2)``; FP8 ones need less) with up to ``num_max_topk`` top-k entries.

        A call with more tokens than that moves through the buffer in rounds (``symm`` normal mode streams any
        batch; :mod:`moe_ep.backends.symm_normal`), one round per ``num_max_tokens_per_rank`` tokens of the largest
        rank. The ``torch`` backend ignores the number (it allocates per call)."""
        from .backends.symm_normal import SymmNormal

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


def _reports_refusal(what: str):
    """A call whose own checks raise (ValueError / TypeError) before it met its peers tells them
    (backends that meet on the host), so every rank raises at once instead of waiting out the timeout."""
    def deco(method):
        @functools.wraps(method)
        def wrapper(self, *args, **kwargs):
            if self._destroyed:
                raise RuntimeError(f"moe_ep.Buffer.{what}: this Buffer was destroyed")
            mark = self._impl.arrival_mark()
            try:
                return method(self, *args, **kwargs)
            except (ValueError, TypeError) as exc:
                self._impl.refuse(what, mark, f"{type(exc).__name__}: {exc}")
                raise
        return wrapper
    return deco


class _CheckedLayout:
    """The routing tensors of the last value-checked :meth:`Buffer.get_dispatch_layout`: a dispatch given
    these very tensor objects, unmodified since (same version counter), needs no second value check.

    Tensor objects are held by weak reference and compared by identity, not address: a new tensor that
    the caching allocator placed at a freed one's address is a different object. Inference tensors (made
    under ``torch.inference_mode()``, as engines make every forward's tensors) have no version counter,
    so an in-place write since the check could not be told from no write: they are never remembered
    (:meth:`of` returns ``None``) and their dispatch checks the values again."""

    def __init__(self, num_experts: int, tensors: tuple):
        self.num_experts = num_experts
        self.refs = tuple(weakref.ref(t) for t in tensors)
        self.versions = tuple(t._version for t in tensors)

    @classmethod
    def of(cls, num_experts: int, *tensors: torch.Tensor) -> Optional["_CheckedLayout"]:
        if any(t.is_inference() for t in tensors):
            return None
        return cls(num_experts, tensors)

    def covers(self, num_experts: int, *tensors: torch.Tensor) -> bool:
        return (num_experts == self.num_experts and len(tensors) == len(self.refs)
                and all(r() is t for r, t in zip(self.refs, tensors))
                and all(not t.is_inference() and t._version == v for t, v in zip(tensors, self.versions)))


def _capturing(device: torch.device) -> bool:
    return events.uses_streams(device) and events.is_capturing(device)


class Buffer:
    """Expert-parallel communication buffer for one process group (DeepEP ``deep_ep.Buffer`` API).

    Arguments:
        group: the torch.distributed process group of the EP ranks (``None``: the default group).
        num_nvl_bytes, num_rdma_bytes: buffer sizes as in DeepEP (size hints:
            :meth:`get_low_latency_rdma_size_hint`); the ``torch`` backend allocates per call and ignores them.
        low_latency_mode: enables ``low_latency_dispatch`` / ``low_latency_combine``.
        num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl, use_fabric: accepted for DeepEP
            compatibility (RDMA / fabric-memory settings of backends not in this release; ignored).
        explicitly_destroy: as DeepEP: ``True`` means resources are released only by :meth:`destroy`
            (which then must be called); ``False`` releases them when the Buffer is garbage-collected.
        enable_shrink: DeepEP's rank-masking mode, low-latency mode only (``low_latency_mode=True``, else
            ``ValueError``): enables the mask API (:meth:`low_latency_update_mask_buffer` ...), and a rank whose wait
            times out in a low-latency call is masked instead of failing the call (see :meth:`low_latency_masked_ranks`).
        comm: DeepEP's mpi4py alternative to ``group``; not supported (must be ``None``).
        backend: ``"torch"`` (all_to_all_single over gloo/NCCL, any topology), ``"symm"`` (Triton kernels
            over symmetric memory, one node), ``"nvshmem"`` (low-latency mode only: the ``symm`` kernels over
            NVSHMEM, across nodes; :mod:`moe_ep.backends.nvshmem`) or ``"auto"``: the CUDA-graph capturable
            backend where one fits (``"symm"`` when all ranks are on one node with CUDA peer access and the sizes
            it needs were given, ``"nvshmem"`` across nodes for a low-latency-only Buffer where NVSHMEM is usable),
            else ``"torch"`` (always on CPU / gloo; a low-latency Buffer on CUDA then warns once);
            :mod:`moe_ep.backends.choose`. The chosen one is ``buffer.backend_name``.
        timeout_s: bound on every wait; a rank that does not arrive makes the call raise
            :class:`moe_ep.sync.RankTimeoutError` (a ``TimeoutError``) naming it.
        check_inputs: value checks of ``topk_idx`` (range, duplicates) read the tensor on the host; they
            are skipped automatically while a CUDA graph is being captured, and can be turned off here.
        trap_on_error: ``symm`` and ``nvshmem`` only, the opt-in for CUDA-graph mode: a kernel that times out or detects a device
            error (call mismatch, overflow, bad expert id) executes ``trap``, so the failure cannot pass
            unnoticed inside replays (the CUDA context is lost: restart the process). Off: outputs turn NaN and
            :meth:`check_status` raises. Compiled kernels only (the Triton interpreter cannot trap).
        backend_kwargs: passed to the backend: ``provider=`` (``"cuda"`` / ``"shm"``) and ``device=`` for ``symm``;
            ``ranks_per_node=`` (and ``partial_dtype=``) for ``torch``: node-aware normal mode (a token crosses
            nodes once per destination node, then fans out inside it; ``num_tokens_per_rdma_rank`` is filled);
            ``device=`` and (CPU emulation) ``ranks_per_node=`` for ``nvshmem``.

    The ``symm`` backend needs its buffer sizes: ``num_nvl_bytes`` from
    :meth:`moe_ep.backends.symm.SymmBackend.get_normal_size_hint` and ``num_rdma_bytes`` from
    :meth:`~moe_ep.backends.symm.SymmBackend.get_low_latency_size_hint`.
    """

    num_sms: int = 20

    def __init__(self, group=None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 use_fabric: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False, comm=None, *,
                 backend: str = "auto", timeout_s: float = 60.0, check_inputs: bool = True, trap_on_error: bool = False,
                 **backend_kwargs: Any):
        if comm is not None:
            raise ValueError("comm= (an mpi4py communicator) is not supported: pass a torch.distributed process group")
        if enable_shrink and not low_latency_mode:
            raise ValueError("enable_shrink=True (rank masking) covers low-latency mode only: pass "
                             "low_latency_mode=True (normal-mode calls keep waiting for every rank and raise "
                             "moe_ep.RankTimeoutError naming a rank that does not arrive)")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("moe_ep.Buffer needs torch.distributed to be initialised (init_process_group)")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if not (timeout_s > 0):
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        for name, v in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a non-negative int, got {v!r}")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.group_size = dist.get_world_size(self.group)
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.check_inputs = check_inputs
        self.timeout_s = float(timeout_s)
        self.enable_shrink = enable_shrink
        self._destroyed = False
        if backend == "auto":
            backend = self._choose_backend(low_latency_mode, num_nvl_bytes, num_rdma_bytes, backend_kwargs)
        self.backend_name = backend
        common = dict(num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=num_rdma_bytes,
                      low_latency_mode=low_latency_mode, timeout_s=self.timeout_s)
        if self.backend_name == "torch":
            from .backends.torch_a2a import TorchBackend
            from .backends.torch_hier import TorchHierBackend
            # ranks_per_node=G: node-aware (a token crosses nodes once per destination node, then fans out)
            cls = TorchHierBackend if backend_kwargs.get("ranks_per_node") is not None else TorchBackend
            self._impl: Backend = cls(self.group, self.rank, self.group_size, **common, **backend_kwargs)
        elif self.backend_name == "nvshmem":
            from .backends.nvshmem import NvshmemBackend
            self._impl = NvshmemBackend(self.group, self.rank, self.group_size, **common, **backend_kwargs)
        else:
            from .backends.symm import SymmBackend
            self._impl = SymmBackend(self.group, self.rank, self.group_size, **common, **backend_kwargs)
        if enable_shrink:
            self._impl.enable_shrink()
        if trap_on_error:
            if self.backend_name not in ("symm", "nvshmem"):
                raise ValueError("trap_on_error=True is for the symm and nvshmem backends (their kernels run inside "
                                 "CUDA graphs)")
            self._impl.trap_on_error()
        self._mask_seen = [0] * self.group_size  # host copy of the mask after the last low-latency call
        self._comm_streams: dict = {}
        self._checked_layout: Optional[_CheckedLayout] = None  # the last value-checked get_dispatch_layout

    # ---------------------------------------------------------------- helpers
    def _choose_backend(self, low_latency_mode: bool, num_nvl_bytes: int, num_rdma_bytes: int,
                        backend_kwargs: dict) -> str:
        """``backend="auto"`` (:func:`moe_ep.backends.choose.choose_backend`): ``symm`` on one node with CUDA peer
        access, ``nvshmem`` across nodes for a low-latency-only Buffer where NVSHMEM is usable, else ``torch``
        (always on CPU / gloo, and with backend keyword arguments: name the backend they are for). A low-latency
        Buffer on CUDA that ends up on ``torch`` warns once (not CUDA-graph capturable)."""
        from .backends.choose import choose_backend, gather_facts, warn_not_capturable

        if backend_kwargs:
            return "torch"
        facts = gather_facts(self.group)
        name = choose_backend(facts, low_latency_mode=low_latency_mode, num_nvl_bytes=num_nvl_bytes,
                              num_rdma_bytes=num_rdma_bytes)
        if name == "torch" and low_latency_mode and facts.cuda:
            warn_not_capturable(facts)
        return name

    @staticmethod
    def is_sm90_compiled() -> bool:
        """DeepEP: whether the SM90 (Hopper) kernels were built. Here kernels are compiled by Triton at run
        time for the device present, so this is ``True`` when a CUDA device of compute capability 9.0 or
        newer is visible (FP8 MMA, PDL), ``False`` otherwise (CPU, older GPUs)."""
        return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9

    @staticmethod
    def capture() -> EventOverlap:
        """DeepEP: an event recorded on the current CUDA stream (wrapped in :class:`EventOverlap`, for
        ``previous_event=``). On a machine without CUDA: an empty :class:`EventOverlap` (waiting on it is a
        no-op, as every CPU call is synchronous)."""
        if not torch.cuda.is_available():
            return EventOverlap(None)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return EventOverlap(event)

    def get_comm_stream(self):
        """DeepEP: the communication stream ``async_finish`` calls run on (of the current CUDA device; made
        on first use). ``None`` without CUDA (CPU calls are synchronous and use no stream)."""
        if not torch.cuda.is_available():
            return None
        return self._comm_stream(torch.device("cuda", torch.cuda.current_device()))

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

    def _after_low_latency(self) -> None:
        """CPU only (a host read is free there): warn about ranks a timed-out wait has just masked."""
        if not self.enable_shrink or self._destroyed or events.uses_streams(getattr(self._impl, "device", None)
                                                                           or torch.device("cpu")):
            return
        now = self._impl.ll_mask_host()
        new = [r for r, v in enumerate(now) if v and not self._mask_seen[r]]
        self._mask_seen = now
        timed = [r for r in new if now[r] == 2]
        if timed:
            from .sync import RankMaskedWarning
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

    def get_local_buffer_tensor(self, *args, **kwargs):
        raise NotImplementedError("get_local_buffer_tensor is not part of this release")

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        if new_num_sms % 2 != 0 or new_num_sms <= 0:
            raise ValueError(f"num_sms must be a positive even number, got {new_num_sms}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """DeepEP: the normal-mode dispatch config for ``num_ranks`` (its size hints: :class:`Config`)."""
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """DeepEP: the normal-mode combine config for ``num_ranks`` (its size hints: :class:`Config`)."""
        return Config(Buffer.num_sms)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes per rank of a low-latency buffer that is enough for every backend and every top-k: the
        larger of DeepEP's formula (two alternating halves, each with a send region of ``T`` dispatch or
        ``E * T`` combine messages, a receive region of ``E * T`` messages and ``E`` int32 signals) and the
        ``symm`` layout at the largest possible top-k (``num_experts``; a smaller top-k needs less:
        :meth:`moe_ep.backends.symm.SymmBackend.get_low_latency_size_hint` gives the exact size)."""
        from .backends.symm_ll import ll_buffer_bytes

        t, e = num_max_dispatch_tokens_per_rank, num_experts
        dispatch_msg = 16 + max(hidden * 2, hidden + hidden // 128 * 4)  # header + BF16 or FP8+scales
        combine_msg = hidden // 128 * 4 + hidden * 2  # DeepEP's combine message: scales (nv_bfloat162) + BF16 row
        send = max(t * dispatch_msg, e * t * combine_msg)
        recv = e * t * max(dispatch_msg, combine_msg)
        deepep = 2 * (send + recv + e * 4)
        total = max(deepep, ll_buffer_bytes(t, hidden, num_ranks, e, num_topk=e, transport=1))  # symm or nvshmem
        return (total + 127) // 128 * 128

    def _comm_stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        key = device.index if device.index is not None else torch.cuda.current_device()
        if key not in self._comm_streams:
            self._comm_streams[key] = torch.cuda.Stream(device=device)
        return self._comm_streams[key]

    def _run(self, fn, device, previous_event, async_finish, allocate_on_comm_stream, inputs=()):
        """``inputs``: every tensor ``fn`` reads (recorded on the comm stream when ``async_finish``)."""
        if previous_event is not None and not isinstance(previous_event, EventOverlap):
            raise TypeError(f"previous_event must be an EventOverlap, got {type(previous_event).__name__}")
        return run_on_comm_stream(fn, device, self._comm_stream(device), previous_event=previous_event,
                                  async_finish=async_finish, allocate_on_comm_stream=allocate_on_comm_stream,
                                  inputs=inputs, owner=self)

    def _value_checks(self, device: torch.device) -> bool:
        return self.check_inputs and not _capturing(device)

    def _check_handle(self, handle, kind) -> None:
        if not isinstance(handle, kind):
            maker = "dispatch" if kind is DispatchHandle else "low_latency_dispatch"
            raise TypeError(f"handle must come from this Buffer's {maker}, got {type(handle).__name__}")
        if handle.owner != id(self._impl):
            raise ValueError("handle was produced by another Buffer (or another layout)")

    # ---------------------------------------------------------------- normal mode
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event: Optional[EventOverlap] = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Count, per rank and per expert, what this rank will send.

        Arguments:
            topk_idx: `[num_tokens, num_topk]` with `torch.int64`, ``-1`` for no expert.
            num_experts: total experts ``E`` (divisible by the group size).

        Returns:
            num_tokens_per_rank: `[num_ranks]` `torch.int32`, tokens with any expert on each rank.
            num_tokens_per_rdma_rank: ``None`` (single-level backends).
            num_tokens_per_expert: `[num_experts]` `torch.int32`, selections per expert.
            is_token_in_rank: `[num_tokens, num_ranks]` `torch.bool`.
            event: :class:`EventOverlap`.
        """
        V.check_num_experts(num_experts, self.group_size)
        if not isinstance(topk_idx, torch.Tensor):
            raise TypeError(f"topk_idx must be a torch.Tensor, got {type(topk_idx).__name__}")
        checked = self._value_checks(topk_idx.device)
        V.check_topk_idx(topk_idx, topk_idx.shape[0] if topk_idx.dim() == 2 else -1, num_experts, topk_idx.device,
                         checked)
        out, event = self._run(lambda: self._impl.get_dispatch_layout(topk_idx, num_experts), topk_idx.device,
                               previous_event, async_finish, allocate_on_comm_stream, inputs=(topk_idx,))
        # A dispatch with this topk_idx and these (unmodified) layout tensors needs no second value check.
        self._checked_layout = _CheckedLayout.of(num_experts, topk_idx, out[0], out[2], out[3]) if checked else None
        return (*out, event)

    @_reports_refusal("dispatch")
    def dispatch(self, x: Union[torch.Tensor, tuple], handle: Optional[DispatchHandle] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None, num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None, num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False, *, recv_as_view: bool = False):
        """Send each token once to every rank holding any of its experts (normal mode).

        Arguments:
            x: `[num_tokens, hidden]` `torch.bfloat16`, or ``(x_fp8, scales)``: `[num_tokens, hidden]`
                `torch.float8_e4m3fn` and `[num_tokens, hidden / 128]` `torch.float32`.
            handle: a handle from an earlier dispatch of the same routing (cached dispatch: only ``x``
                moves; the layout arguments and topk must then be ``None``).
            num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert: from :meth:`get_dispatch_layout`.
            topk_idx: `[num_tokens, num_topk]` `torch.int64`; topk_weights: same shape, `torch.float32`.
            expert_alignment: each entry of the returned per-expert list is rounded up to this.
            num_worst_tokens: if > 0, outputs have exactly this many rows (padding rows have
                ``recv_topk_idx == -1``); more received tokens than that is an error.
            recv_as_view: (keyword, an extension of DeepEP's call) on the ``symm`` backend, ``recv_x`` and its
                scales are views of this rank's communication buffer instead of fresh tensors (no receive
                copy). They stay valid until this rank's next dispatch or combine on this Buffer; work that
                reads them must be ordered before that call (same stream, or an event). With
                ``num_worst_tokens`` the padding rows of a view are NOT zeroed (stale rows; their
                ``recv_topk_idx`` is -1). Every rank must pass the same value. Other backends return fresh
                tensors as usual (their receive has no copy to remove).

        Returns:
            recv_x: `[num_recv_tokens, hidden]` (same dtype as ``x``; a tuple with scales for FP8), rows
                ordered by source rank, then source token index.
            recv_topk_idx: `[num_recv_tokens, num_topk]` `torch.int64` local expert ids, ``-1`` elsewhere.
            recv_topk_weights: `[num_recv_tokens, num_topk]` `torch.float32`, 0 where the index is -1.
            num_recv_tokens_per_expert_list: Python list of ``num_local_experts`` ints.
            handle: for :meth:`combine` and cached dispatch.
            event: :class:`EventOverlap`.
        """
        data, scales = V.split_x(x)
        n, hidden = data.shape
        if not isinstance(expert_alignment, int) or expert_alignment < 1:
            raise ValueError(f"expert_alignment must be a positive int, got {expert_alignment!r}")
        if not isinstance(num_worst_tokens, int) or num_worst_tokens < 0:
            raise ValueError(f"num_worst_tokens must be a non-negative int, got {num_worst_tokens!r}")
        if not isinstance(recv_as_view, bool):
            raise ValueError(f"recv_as_view must be a bool, got {recv_as_view!r}")
        view = {"recv_view": True} if recv_as_view and getattr(self._impl, "supports_recv_view", False) else {}
        if handle is not None:
            self._check_handle(handle, DispatchHandle)
            if any(a is not None for a in (num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                                           topk_idx, topk_weights)):
                raise ValueError("cached dispatch (handle given) takes no layout, topk_idx or topk_weights")
            if n != handle.num_tokens or hidden != handle.hidden:
                raise ValueError(f"x has shape [{n}, {hidden}] but the handle was made for "
                                 f"[{handle.num_tokens}, {handle.hidden}]")
            made_with = getattr(handle, "num_worst_tokens", 0)
            if num_worst_tokens == 0:
                num_worst_tokens = made_with  # outputs keep the shapes of the dispatch that made the handle
            elif num_worst_tokens != made_with:
                raise ValueError(f"cached dispatch: num_worst_tokens={num_worst_tokens} but the handle was made with "
                                 f"{made_with}")
            num_experts = 0
        else:
            if num_tokens_per_rank is None or is_token_in_rank is None or num_tokens_per_expert is None:
                raise ValueError("dispatch without a handle needs num_tokens_per_rank, is_token_in_rank and "
                                 "num_tokens_per_expert (from get_dispatch_layout)")
            if (topk_idx is None) != (topk_weights is None):
                raise ValueError("pass topk_idx and topk_weights together (or neither, for a layout-only dispatch)")
            if not isinstance(num_tokens_per_expert, torch.Tensor) or num_tokens_per_expert.dim() != 1:
                raise ValueError("num_tokens_per_expert must be a 1D tensor [num_experts]")
            num_experts = num_tokens_per_expert.shape[0]
            V.check_num_experts(num_experts, self.group_size)
            if topk_idx is not None:
                V.check_topk_shape(topk_idx, n, data.device)
                V.check_topk_weights(topk_weights, topk_idx)
            if not isinstance(num_tokens_per_rank, torch.Tensor) or tuple(num_tokens_per_rank.shape) != (self.group_size,):
                raise ValueError(f"num_tokens_per_rank must have shape [{self.group_size}], got "
                                 f"{tuple(getattr(num_tokens_per_rank, 'shape', ()))}")
            if not isinstance(is_token_in_rank, torch.Tensor) or is_token_in_rank.dtype != torch.bool or \
                    tuple(is_token_in_rank.shape) != (n, self.group_size):
                raise ValueError(f"is_token_in_rank must be torch.bool [{n}, {self.group_size}], got "
                                 f"{getattr(is_token_in_rank, 'dtype', type(is_token_in_rank).__name__)} "
                                 f"{tuple(getattr(is_token_in_rank, 'shape', ()))}")
            for name, t in (("num_tokens_per_rank", num_tokens_per_rank), ("is_token_in_rank", is_token_in_rank),
                            ("num_tokens_per_expert", num_tokens_per_expert), ("topk_weights", topk_weights)):
                if t is not None and t.device != data.device:
                    raise ValueError(f"{name} is on {t.device}, x on {data.device}")
            if topk_idx is None:  # layout only: the per-rank counts must still match the token mask
                if self._value_checks(data.device) and \
                        bool((num_tokens_per_rank.to(torch.int64) != is_token_in_rank.sum(0)).any()):
                    raise ValueError("num_tokens_per_rank disagrees with is_token_in_rank.sum(0)")
            else:
                done = self._checked_layout is not None and self._checked_layout.covers(
                    num_experts, topk_idx, num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank)
                if self._value_checks(data.device) and not done:
                    V.check_dispatch_values(topk_idx, num_experts, self.group_size, num_tokens_per_rank,
                                            is_token_in_rank, num_tokens_per_expert)

        def fn():
            return self._impl.dispatch(
                data, scales, handle=handle, num_tokens_per_rank=num_tokens_per_rank,
                is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx,
                topk_weights=topk_weights, num_experts=num_experts, expert_alignment=expert_alignment,
                num_worst_tokens=num_worst_tokens, **view)

        res, event = self._run(fn, data.device, previous_event, async_finish, allocate_on_comm_stream,
                               inputs=(data, scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                                       num_tokens_per_expert, handle))
        if handle is None:  # what later calls with this handle are checked against
            res.handle.num_topk = 0 if topk_idx is None else topk_idx.shape[1]
            res.handle.num_worst_tokens = num_worst_tokens
        recv_x = (res.recv_x, res.recv_x_scales) if res.recv_x_scales is not None else res.recv_x
        return (recv_x, res.recv_topk_idx, res.recv_topk_weights, res.num_recv_tokens_per_expert_list,
                res.handle, event)

    @_reports_refusal("combine")
    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, tuple, None] = None, config: Optional[Config] = None,
                previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False, *, combine_dtype: Optional[torch.dtype] = None):
        """Send the received rows back and sum them per source token (normal mode).

        Arguments:
            x: `[num_recv_tokens, hidden]` `torch.bfloat16` or `torch.float16`, rows in ``recv_x``'s order
                (weights already applied); its dtype is the output's.
            handle: from :meth:`dispatch`.
            topk_weights: optional `[num_recv_tokens, num_topk]` `torch.float32` (reduced back as well).
            bias: optional `[num_tokens, hidden]` tensor (``x``'s dtype) or tuple of two, added once.
            combine_dtype: keyword-only wire format: ``None`` (``x`` as it is) or ``torch.float8_e4m3fn`` (e4m3 with
                a float32 scale per 128 channels, ``amax / 448``; about half the bytes; see
                :mod:`moe_ep.kernels.logfmt` for accuracy and NaN/inf handling).

        Returns:
            combined_x: `[num_tokens, hidden]` of ``x``'s dtype: float32 sum of the bias terms, then of the
                (decoded) rows in ascending source-rank order, cast once.
            combined_topk_weights: `[num_tokens, num_topk]` `torch.float32` or ``None``.
            event: :class:`EventOverlap`.
        """
        self._check_handle(handle, DispatchHandle)
        V.check_combine_x(x, handle.num_recv_tokens, handle.hidden)
        if topk_weights is not None:
            if not isinstance(topk_weights, torch.Tensor) or topk_weights.dtype != torch.float32:
                got = getattr(topk_weights, 'dtype', type(topk_weights).__name__)
                raise TypeError(f"topk_weights must be a torch.float32 tensor, got {got}")
            want = (handle.num_recv_tokens, getattr(handle, "num_topk", topk_weights.shape[-1]))
            if tuple(topk_weights.shape) != want:
                raise ValueError(f"topk_weights must be [{want[0]}, {want[1]}] (the received tokens x the dispatch's "
                                 f"top-k), got shape {tuple(topk_weights.shape)}")
            if topk_weights.device != x.device:
                raise ValueError(f"topk_weights is on {topk_weights.device}, x on {x.device}")
        biases = V.check_bias(bias, handle.num_tokens, handle.hidden, x.device, x.dtype)
        fmt = V.combine_format(x.dtype, combine_dtype)
        if fmt == 2 and handle.hidden % 128:
            raise ValueError(f"FP8 combine needs hidden to be a multiple of 128, got {handle.hidden}")
        kw = {} if combine_dtype is None else {"fmt": fmt}
        (combined, combined_w), event = self._run(
            lambda: self._impl.combine(x, handle, topk_weights, biases, **kw), x.device, previous_event, async_finish,
            allocate_on_comm_stream, inputs=(x, handle, topk_weights, biases))
        return combined, combined_w, event

    # ---------------------------------------------------------------- low-latency mode
    def _check_wait_stats(self, t, name: str, device: torch.device) -> None:
        if t is not None and (not isinstance(t, torch.Tensor) or t.dtype != torch.int64
                              or tuple(t.shape) != (self.group_size,) or t.device != device):
            raise ValueError(f"{name} must be torch.int64 [{self.group_size}] on {device}, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")

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

    def check_status(self, blocking: bool = True) -> None:
        """Raise if a device-side wait of this rank timed out (:class:`moe_ep.RankTimeoutError` naming the
        silent rank) or a device-side error flag is set (``RuntimeError``: more rows than ``num_worst_tokens``,
        an expert id out of range with the checks off). ``symm`` only (other backends raise in the call).

        ``blocking=True`` synchronises: use it after CUDA-graph replays, where the per-call check cannot run.
        ``blocking=False`` is the cheap query for a serving loop: on a GPU it queues a copy of the status
        word to pinned memory and raises at a later call once an earlier copy shows a failure (never waits);
        on a CPU it reads the word directly."""
        check = getattr(self._impl, "check_status", None)
        if check is not None:
            check(blocking=blocking)

    def destroy(self) -> None:
        """Release the communication resources (DeepEP: only with ``explicitly_destroy=True``; otherwise
        they are released when the Buffer is garbage-collected). Every later call raises."""
        if not self.explicitly_destroy:
            raise ValueError("destroy() needs Buffer(..., explicitly_destroy=True) (as in DeepEP); without it the "
                             "resources are released when the Buffer is garbage-collected")
        self._release()

    def _release(self) -> None:
        if not self._destroyed:
            self._destroyed = True
            self._impl.destroy()

    def __del__(self):
        if not getattr(self, "explicitly_destroy", True) and hasattr(self, "_impl"):
            try:
                self._release()
            except Exception:  # noqa: BLE001 - never raise from a finaliser
                pass
