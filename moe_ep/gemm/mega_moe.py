"""Mega MoE under DeepGEMM's names: the whole expert-parallel MoE layer (dispatch, GEMM1, SwiGLU + FP8
quant, GEMM2, combine) in one Triton kernel (:mod:`moe_ep.kernels.mega_moe`) over a symmetric buffer.

Usage (every rank; DeepGEMM's flow)::

    buf = get_symm_buffer_for_mega_moe(group, num_experts, num_max_tokens_per_rank, num_topk, hidden,
                                       intermediate_hidden)
    l1, l2 = transform_weights_for_mega_moe(l1, l2)        # once
    buf.x[:n].copy_(x_fp8); buf.x_sf[:n].copy_(x_scales)   # 1x128 groups (moe_ep.quant.per_token_group_quant_fp8)
    buf.topk_idx[:n].copy_(topk_idx); buf.topk_weights[:n].copy_(topk_weights)
    fp8_fp4_mega_moe(y, l1, l2, buf)                       # y: BF16 [n, hidden], n <= num_max_tokens_per_rank

``y[t] = sum_k topk_weights[t, k] * W2[e] @ FP8(silu(W1_gate[e] x_t) * (W1_up[e] x_t))`` with ``e = topk_idx[t, k]``
(-1: no expert), expert ``e`` on rank ``e // L``: the expert-path layer's numerics (:mod:`moe_ep.layer.experts`).
The token count ``n`` comes from ``y``'s shape (a host int); nothing is read from the device on the host.

Where it runs (``mode``): ``"fused"``: one launch, a persistent grid (each program sends, computes, combines);
``"phased"``: the same source as three launches (sends, experts, combine), the form the Triton interpreter
runs on CPU across forked ranks; ``"auto"``: fused on a GPU when the persistent grid is resident (checked
from the compiled kernel's registers and shared memory), else phased (said once, as a warning).

Symmetric memory per rank (bytes, each term rounded up to 256; :func:`mega_moe_symm_bytes`)::

    T*H  +  4*T*H/128  +  8*T*K  +  4*T*K      inputs the caller fills (x, x_sf, topk_idx, topk_weights)
    + 4*R*L  +  4*L*R*T                          per-(source, local expert) counts and token index lists
    + 2*T*K*H                                    combine area (one BF16 row per (token, k))
    + 4*(2R + 4)                                 signal words

Activation ring (local memory, not symmetric): ``S * BLOCK_M * (H + H/32 + I + I/32)`` bytes, ``S`` =
:func:`ring_slots` (the expert phase's programs, capped by the work items the shapes allow).
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.distributed as dist

from ..fp8 import FP8_DTYPE
from ..symm import SymmBuffer, _align, create_symm_buffer

import logging

_log = logging.getLogger(__name__)

__all__ = ["MegaMoEBuffer", "bf16_mega_moe", "fp8_fp4_mega_moe", "fp8_mega_moe", "get_symm_buffer_for_mega_moe",
           "mega_moe_symm_bytes", "ring_slots", "sm90_cases", "transform_weights_for_mega_moe"]

MMA_TYPES = ("fp8xfp8",)
ACTIVATIONS = ("swiglu",)
CPU_PROGRAMS = 2  # programs of the expert phase under the interpreter (the ring has as many slots)


def _pow2(n: int) -> int:
    return 1 << max(0, (max(int(n), 1) - 1).bit_length())


def choose_block_m(world: int, num_experts: int, tokens: int, topk: int) -> int:
    """Rows per expert work item: the balanced rows per expert (``R*T*K/E``) as a power of two in [16, 64]."""
    expected = -(-world * tokens * topk // num_experts)
    return min(64, max(16, _pow2(expected)))


def _max_items(world: int, num_local: int, tokens: int, topk: int, block_m: int) -> int:
    # Each local expert receives at most R*T rows (a token selects an expert once), all local experts together at
    # most R*T*min(K, L) rows; an expert's rows make ceil(rows / BLOCK_M) items.
    per_expert = num_local * -(-world * tokens // block_m)
    spread = -(-world * tokens * min(topk, num_local) // block_m) + num_local
    return max(1, min(per_expert, spread))


def ring_slots(num_programs: int, world: int, num_local: int, tokens: int, topk: int, block_m: int) -> int:
    """Activation ring size: one slot per program of the expert phase (program ``p`` owns slot ``p`` and reuses
    it for its items ``p, p + P, ..``), never more than the work items the shapes allow."""
    return max(1, min(num_programs, _max_items(world, num_local, tokens, topk, block_m)))


def _layout(world: int, num_experts: int, tokens: int, topk: int, hidden: int) -> dict:
    num_local = num_experts // world
    sizes = [("x", tokens * hidden), ("x_sf", 4 * tokens * (hidden // 128)), ("topk_idx", 8 * tokens * topk),
             ("topk_weights", 4 * tokens * topk), ("cnt", 4 * world * num_local),
             ("list", 4 * num_local * world * tokens), ("comb", 2 * tokens * topk * hidden)]
    off, lay = 0, {}
    for name, n in sizes:
        lay[name] = off
        off += _align(max(n, 1))
    lay["nbytes"] = off
    return lay


def mega_moe_symm_bytes(world: int, num_experts: int, num_max_tokens_per_rank: int, num_topk: int,
                        hidden: int) -> int:
    """Symmetric bytes per rank of a mega-MoE buffer (data and signal words; the module's formula)."""
    from ..kernels.mega_moe import signal_layout

    return _layout(world, num_experts, num_max_tokens_per_rank, num_topk, hidden)["nbytes"] + \
        _align(4 * signal_layout(world)["NUM_WORDS"])


class MegaMoEBuffer:
    """One rank's mega-MoE buffer (from :func:`get_symm_buffer_for_mega_moe`).

    Attributes the caller fills before :func:`fp8_mega_moe` (views into the symmetric region, rows ``< n``):
        x: `[T, hidden]` `torch.float8_e4m3fn`; x_sf: `[T, hidden/128]` float32 (1x128 groups);
        topk_idx: `[T, K]` int64 (-1 = no expert); topk_weights: `[T, K]` float32.
    Other attributes: ``symm`` (the :class:`moe_ep.symm.SymmBuffer`), ``ring`` (local activation slots),
    ``num_slots``, ``block_m``, and the sizes it was built for.
    """

    def __init__(self, symm: SymmBuffer, num_experts: int, tokens: int, topk: int, hidden: int, inter: int,
                 mma_type: str, activation: str, num_programs: int):
        self.symm = symm
        self.rank, self.world_size = symm.rank, symm.world_size
        self.num_experts, self.num_max_tokens_per_rank, self.num_topk = num_experts, tokens, topk
        self.hidden, self.intermediate_hidden = hidden, inter
        self.mma_type, self.activation = mma_type, activation
        self.num_local_experts = num_experts // self.world_size
        self.layout = _layout(self.world_size, num_experts, tokens, topk, hidden)
        b, lay = symm.buffer, self.layout
        self.x = b[lay["x"]:lay["x"] + tokens * hidden].view(FP8_DTYPE).view(tokens, hidden)
        self.x_sf = b[lay["x_sf"]:lay["x_sf"] + 4 * tokens * (hidden // 128)].view(torch.float32).view(tokens, -1)
        self.topk_idx = b[lay["topk_idx"]:lay["topk_idx"] + 8 * tokens * topk].view(torch.int64).view(tokens, topk)
        self.topk_weights = b[lay["topk_weights"]:lay["topk_weights"] + 4 * tokens * topk].view(
            torch.float32).view(tokens, topk)
        self.block_m = choose_block_m(self.world_size, num_experts, tokens, topk)
        self.num_slots = ring_slots(num_programs, self.world_size, self.num_local_experts, tokens, topk, self.block_m)
        slot_bytes = self.block_m * (hidden + hidden // 32 + inter + inter // 32)
        self.ring = torch.zeros(self.num_slots, slot_bytes, dtype=torch.uint8, device=symm.device)
        self.fused_ok: Optional[bool] = None  # decided at the first fused launch on a GPU
        self.fused_grid = 1

    @property
    def device(self) -> torch.device:
        return self.symm.device

    def destroy(self) -> None:
        """Drop the mappings; the views must not be used afterwards."""
        self.symm.close()


def _positive_int(v, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return v


def get_symm_buffer_for_mega_moe(group, num_experts: int, num_max_tokens_per_rank: int, num_topk: int, hidden: int,
                                 intermediate_hidden: int, mma_type: str = "fp8xfp8", activation: str = "swiglu", *,
                                 device: Optional[torch.device] = None, provider: str = "auto",
                                 timeout_s: float = 60.0, num_programs: Optional[int] = None) -> MegaMoEBuffer:
    """Collectively create a mega-MoE buffer over ``group`` (every rank, the same arguments; checked).

    Arguments (DeepGEMM's): ``num_experts`` E (a multiple of the group size; expert e on rank ``e // (E/R)``),
    ``num_max_tokens_per_rank`` T, ``num_topk`` K, ``hidden`` H and ``intermediate_hidden`` I (multiples of 128),
    ``mma_type`` (``"fp8xfp8"`` only: FP8 activations and weights), ``activation`` (``"swiglu"`` only).
    Keyword-only extensions: ``device``, ``provider`` and ``timeout_s`` of :func:`moe_ep.symm.create_symm_buffer`
    (``timeout_s`` bounds every wait of the kernel; without ``device`` the buffer goes to the current GPU when the
    group is NCCL, else to the CPU), ``num_programs``: programs of the expert phase, which is
    also the activation ring's slot count (default: the GPU's SM count; 2 under the interpreter).
    """
    if mma_type not in MMA_TYPES:
        raise ValueError(f"mma_type={mma_type!r} is not supported here: only {MMA_TYPES} (FP8 activations and FP8 "
                         "weights with 128x128 block scales; SM100's FP8 x FP4 has no Hopper/CPU counterpart)")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not supported: only {ACTIVATIONS}")
    for v, name in ((num_experts, "num_experts"), (num_max_tokens_per_rank, "num_max_tokens_per_rank"),
                    (num_topk, "num_topk"), (hidden, "hidden"), (intermediate_hidden, "intermediate_hidden")):
        _positive_int(v, name)
    if hidden % 128 or intermediate_hidden % 128:
        raise ValueError(f"hidden ({hidden}) and intermediate_hidden ({intermediate_hidden}) must be multiples of 128")
    if num_topk > num_experts:
        raise ValueError(f"num_topk ({num_topk}) exceeds num_experts ({num_experts})")
    if not dist.is_initialized():
        raise RuntimeError("get_symm_buffer_for_mega_moe needs torch.distributed to be initialised")
    world = dist.get_world_size(group)
    if num_experts % world:
        raise ValueError(f"num_experts ({num_experts}) must be a multiple of the group size ({world})")
    if num_programs is not None:
        _positive_int(num_programs, "num_programs")
    if device is not None:
        dev = torch.device(device)
    elif provider == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device())
    elif provider == "auto":  # as DeepGEMM is called (no device): the current GPU with NCCL groups, else CPU
        from ..backends.symm import _default_device
        dev = _default_device(group)
    else:
        dev = torch.device("cpu")
    if num_programs is None:
        num_programs = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" \
            else CPU_PROGRAMS
    # Every rank must build the same buffer (the kernel addresses peers with this rank's offsets).
    mine = (num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden, mma_type, activation)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    differ = [r for r, v in enumerate(everyone) if v != everyone[0]]
    if differ:
        raise ValueError(f"get_symm_buffer_for_mega_moe: rank(s) {differ} passed {[everyone[r] for r in differ]}, "
                         f"rank 0 passed {everyone[0]} (num_experts, tokens, topk, hidden, intermediate, mma, activation)")
    from ..kernels.mega_moe import signal_layout

    lay = _layout(world, num_experts, num_max_tokens_per_rank, num_topk, hidden)
    symm = create_symm_buffer(group, lay["nbytes"], signal_layout(world)["NUM_WORDS"], device=dev, provider=provider,
                              timeout_s=timeout_s)
    return MegaMoEBuffer(symm, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden,
                         mma_type, activation, num_programs)


def _check_weight_pair(w, name: str, shape: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(w, (tuple, list)) or len(w) != 2 or not all(isinstance(t, torch.Tensor) for t in w):
        raise TypeError(f"{name} must be a (fp8 weights, float32 block scales) pair, got {type(w).__name__}")
    q, s = w
    if q.dtype != FP8_DTYPE:
        raise TypeError(f"{name}[0] must be {FP8_DTYPE}, got {q.dtype}")
    if s.dtype != torch.float32:
        raise TypeError(f"{name}[1] (128x128 block scales) must be float32, got {s.dtype}")
    if shape and tuple(q.shape) != shape:
        raise ValueError(f"{name}[0] must have shape {list(shape)}, got {list(q.shape)}")
    if q.dim() != 3 or q.shape[1] % 128 or q.shape[2] % 128:
        raise ValueError(f"{name}[0] must be [L, N, K] with N and K multiples of 128, got {list(q.shape)}")
    want = (q.shape[0], q.shape[1] // 128, q.shape[2] // 128)
    if tuple(s.shape) != want:
        raise ValueError(f"{name}[1] must have shape {list(want)}, got {list(s.shape)}")
    return q, s


def transform_weights_for_mega_moe(l1_weights, l2_weights):
    """Weights as the kernel reads them: ``l1`` = (FP8 `[L, 2I, H]`, gate rows then up rows; float32
    `[L, 2I/128, H/128]`), ``l2`` = (FP8 `[L, H, I]`; float32 `[L, H/128, I/128]`), contiguous. The layout is the
    expert-path layer's (no interleaving), so untransformed weights work too; call it once, as with DeepGEMM."""
    q1, s1 = _check_weight_pair(l1_weights, "l1_weights", ())
    q2, s2 = _check_weight_pair(l2_weights, "l2_weights", ())
    if q1.shape[1] % 256 or tuple(q2.shape) != (q1.shape[0], q1.shape[2], q1.shape[1] // 2):
        raise ValueError(f"l1 {list(q1.shape)} / l2 {list(q2.shape)}: need l1 = [L, 2I, H] (2I a multiple of 256) and "
                         f"l2 = [L, H, I]")
    return (q1.contiguous(), s1.contiguous()), (q2.contiguous(), s2.contiguous())


_warned_phased = False


def _warn_phased_once(reason: str) -> None:
    global _warned_phased
    _log.info("fp8_mega_moe: %s; running the phased launches instead", reason)
    if not _warned_phased:
        _warned_phased = True
        warnings.warn(f"fp8_mega_moe: {reason}; running the phased launches instead", RuntimeWarning, stacklevel=3)


def _validate(y, l1, l2, buf, stats, activation, clamp):
    if not isinstance(buf, MegaMoEBuffer):
        raise TypeError(f"sym_buffer must come from get_symm_buffer_for_mega_moe, got {type(buf).__name__}")
    if activation != buf.activation:
        raise ValueError(f"activation={activation!r}, but the buffer was built for {buf.activation!r}")
    if clamp is not None and (isinstance(clamp, bool) or not isinstance(clamp, (int, float)) or not clamp > 0):
        raise ValueError(f"activation_clamp must be None or a positive number, got {clamp!r}")
    L, H, inter = buf.num_local_experts, buf.hidden, buf.intermediate_hidden
    q1, s1 = _check_weight_pair(l1, "l1_weights", (L, 2 * inter, H))
    q2, s2 = _check_weight_pair(l2, "l2_weights", (L, H, inter))
    if not isinstance(y, torch.Tensor) or y.dtype != torch.bfloat16:
        raise TypeError(f"y must be a torch.bfloat16 tensor, got {getattr(y, 'dtype', type(y).__name__)}")
    if y.dim() != 2 or y.shape[1] != H or y.shape[0] > buf.num_max_tokens_per_rank:
        raise ValueError(f"y must be [n, hidden={H}] with n <= num_max_tokens_per_rank="
                         f"{buf.num_max_tokens_per_rank}, got {list(y.shape)}")
    if not y.is_contiguous():
        raise ValueError("y must be contiguous")
    if stats is not None:
        if not isinstance(stats, torch.Tensor) or stats.dtype != torch.int32 or tuple(stats.shape) != (L,):
            raise ValueError(f"cumulative_local_expert_recv_stats must be int32 [{L}], got "
                             f"{getattr(stats, 'dtype', type(stats).__name__)} {list(getattr(stats, 'shape', []))}")
    for t, name in ((q1, "l1_weights"), (s1, "l1 scales"), (q2, "l2_weights"), (s2, "l2 scales"), (y, "y")) + \
            (((stats, "cumulative_local_expert_recv_stats"),) if stats is not None else ()):
        if t.device != buf.device:
            raise ValueError(f"{name} is on {t.device}, the buffer on {buf.device}")
    return q1.contiguous(), s1.contiguous(), q2.contiguous(), s2.contiguous()


def fp8_fp4_mega_moe(y: torch.Tensor, l1_weights, l2_weights, sym_buffer: MegaMoEBuffer,
                     cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None, recipe=None,
                     activation: str = "swiglu", activation_clamp: Optional[float] = None, fast_math: bool = True, *,
                     mode: str = "auto") -> None:
    """The MoE layer for the tokens in ``sym_buffer`` (rows ``< y.shape[0]`` of its x / x_sf / topk views),
    written into ``y`` (BF16 `[n, hidden]`). Every rank of the group calls it.

    Arguments:
        y: output, `torch.bfloat16` `[n, hidden]`, contiguous; ``n`` (this rank's tokens) may differ across ranks.
        l1_weights: (FP8 `[L, 2I, H]` gate rows then up rows, float32 `[L, 2I/128, H/128]`) of this rank's experts.
        l2_weights: (FP8 `[L, H, I]`, float32 `[L, H/128, I/128]`).
        sym_buffer: from :func:`get_symm_buffer_for_mega_moe`, inputs filled.
        cumulative_local_expert_recv_stats: optional int32 `[L]`: rows received per local expert are added to it
            (on the device).
        recipe: DeepGEMM 2.6.1's argument (its default there, ``(1, 1, 32)``, is sm100's FP4 recipe): ``None`` or
            ``(1, 128, 128)``, the one recipe this kernel has (1x128 activations, 128x128 weights); others ValueError.
        activation: ``"swiglu"``. activation_clamp: ``None`` or ``c > 0``: ``gate = min(gate, c)``,
            ``up = clamp(up, -c, c)`` before ``silu(gate) * up``.
        fast_math: DeepGEMM's; accepted, changes nothing (the kernel has one SiLU).
        mode: keyword-only extension, ``"auto"`` | ``"fused"`` | ``"phased"`` (module docstring).

    Raises ValueError / TypeError on bad arguments before anything is written; :class:`moe_ep.RankTimeoutError`
    naming the rank when a peer does not arrive within the buffer's ``timeout_s`` (``y`` is then NaN); RuntimeError
    for routing the device flagged (an expert id ``>= num_experts``, an expert repeated past the buffer's room).
    """
    if mode not in ("auto", "fused", "phased"):
        raise ValueError(f"mode must be 'auto', 'fused' or 'phased', got {mode!r}")
    if recipe is not None and tuple(recipe) != (1, 128, 128):
        raise ValueError(f"recipe={tuple(recipe)}: only (1, 128, 128) is supported (1x128 activation scales x "
                         f"128x128 weight scales)")
    del fast_math
    q1, s1, q2, s2 = _validate(y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats,
                               activation, activation_clamp)
    sym_buffer.symm.check_usable()
    _launch(sym_buffer, y, q1, s1, q2, s2, cumulative_local_expert_recv_stats, activation_clamp, mode)
    sym_buffer.symm.check_status("fp8_mega_moe")


def fp8_mega_moe(y: torch.Tensor, l1_weights, l2_weights, sym_buffer: MegaMoEBuffer,
                 cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None, activation: str = "swiglu",
                 activation_clamp: Optional[float] = None, *, mode: str = "auto") -> None:
    """The former name of :func:`fp8_fp4_mega_moe` (DeepGEMM's current one), with its former positional order
    (no ``recipe`` / ``fast_math``)."""
    fp8_fp4_mega_moe(y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats,
                     activation=activation, activation_clamp=activation_clamp, mode=mode)


def bf16_mega_moe(y: torch.Tensor, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats=None,
                  activation: str = "swiglu", activation_clamp: Optional[float] = None, fast_math: bool = True) -> None:
    """DeepGEMM 2.6.1's BF16-weight mega-MoE: not available here (the kernel multiplies FP8 operands with 128x128
    weight scales only). Raises NotImplementedError; quantize the weights (:func:`moe_ep.quant.per_block_quant_fp8`)
    and call :func:`fp8_fp4_mega_moe`."""
    raise NotImplementedError("bf16_mega_moe: the mega-MoE kernel here takes FP8 weights (128x128 scales) only, "
                              "not BF16 ones; quantize them and call fp8_fp4_mega_moe")


def _resident_programs(kernel, args, const, kw, device: torch.device) -> int:
    """Programs of the compiled fused kernel resident at once on the whole GPU (registers, shared memory, warps)."""
    import triton

    compiled = kernel.warmup(*args, grid=(1,), PHASE=0, **const, **kw)
    init = getattr(compiled, "_init_handles", None)
    if init is not None:  # registers are known once the binary is loaded (lazy in recent Triton)
        init()
    props = triton.runtime.driver.active.utils.get_device_properties(device.index or 0)
    # Registers are allocated per warp in units of 256; a block also reserves 1 KB of shared memory.
    regs_per_warp = -(-max(int(compiled.n_regs), 1) * 32 // 256) * 256
    by_regs = (props.get("max_num_regs", 65536) // regs_per_warp) // kw["num_warps"]
    by_smem = props["max_shared_mem"] // (int(compiled.metadata.shared) + 1024)
    by_warps = 64 // kw["num_warps"]
    return max(0, min(by_regs, by_smem, by_warps)) * props["multiprocessor_count"]


def _launch(buf: MegaMoEBuffer, y, q1, s1, q2, s2, stats, clamp, mode: str) -> None:
    from .. import events
    from ..kernels.fp8_cast import native_e4m3_supported
    from ..kernels.mega_moe import launch_warps, mega_moe_kernel, signal_layout
    from ..kernels.pdl import INTERPRET

    symm, dev, lay = buf.symm, buf.device, buf.layout
    R, E, T, K = buf.world_size, buf.num_experts, buf.num_max_tokens_per_rank, buf.num_topk
    H, L, n = buf.hidden, buf.num_local_experts, y.shape[0]
    sig = signal_layout(R)
    interp = INTERPRET or dev.type != "cuda"
    block_t = min(_pow2(n), 64) if interp else 16
    args = (symm.buffer_ptrs, symm.signal_ptrs, symm.status, q1, s1, q2, s2, buf.ring, y.view(torch.int16),
            stats if stats is not None else symm.status, symm.rank, n, T, R, L, E, symm.timeout_ns,
            float(clamp or 0.0), lay["x"], lay["x_sf"], lay["topk_idx"], lay["topk_weights"], lay["cnt"], lay["list"],
            lay["comb"])
    const = dict(H=H, INTER=buf.intermediate_hidden, K=K, KP=_pow2(K), BLOCK_M=buf.block_m, BLOCK_T=block_t,
                 RP=_pow2(R), LP=_pow2(L), GP=_pow2(H // 128), HAS_STATS=stats is not None,
                 HAS_CLAMP=clamp is not None, NATIVE_FP8=native_e4m3_supported(dev),
                 DISP_FULL=sig["DISP_FULL"], COMB_FULL=sig["COMB_FULL"], DISP_SEND_CNT=sig["DISP_SEND_CNT"],
                 COMB_SEND_CNT=sig["COMB_SEND_CNT"], COMB_RECV_CNT=sig["COMB_RECV_CNT"], ROUTE_ERR=sig["ROUTE_ERR"])
    kw = dict(num_warps=launch_warps(0), enable_fp_fusion=False)
    reads = (buf.x, buf.x_sf, buf.topk_idx, buf.topk_weights, q1, s1, q2, s2)
    writes = (y, buf.ring, symm.status) + ((stats,) if stats is not None else ())
    if mode == "auto":
        mode = "phased" if interp else "fused"
    if mode == "fused":
        # A grid of one program under the interpreter (a program never waits on a later one there); on a GPU the
        # persistent grid, as many programs as are resident at once (else the phases, said once).
        grid = 1
        if not interp:
            if buf.fused_ok is None:
                resident = _resident_programs(mega_moe_kernel, args, const, kw, dev)
                buf.fused_ok = resident >= 1
                buf.fused_grid = min(buf.num_slots, resident)
            if not buf.fused_ok:
                _warn_phased_once("the fused kernel's persistent grid does not fit on this GPU")
                mode = "phased"
            grid = buf.fused_grid
    if mode == "fused":
        mega_moe_kernel[(grid,)](*args, PHASE=0, **const, **kw)
        events.launch(reads=reads, writes=writes, what="fp8_mega_moe (fused)")
        return
    sends = min(E, CPU_PROGRAMS) if interp else E
    combines = min(CPU_PROGRAMS, -(-n // block_t)) if interp else -(-n // block_t)
    for phase, grid in ((1, sends), (2, buf.num_slots), (3, max(1, combines))):
        mega_moe_kernel[(grid,)](*args, PHASE=phase, **const, num_warps=launch_warps(phase), enable_fp_fusion=False)
    events.launch(reads=reads, writes=writes, what="fp8_mega_moe (phased)")


def sm90_cases() -> list[dict]:
    """The kernel specialised as ``fp8_mega_moe`` launches it on a GPU for DeepSeek-V3 on 8 ranks (hidden 7168,
    intermediate 2048, 256 experts, top-8): 2048 tokens per rank (64-row items) in every phase and the fused one,
    and decode (128 tokens per rank: 32-row items) in the fused and expert phases; for the sm90 compile checks and
    ``perf/sm90_report.py`` (built here, on the host side, so that the kernel module stays a leaf): dicts with
    ``name, config, kernel, signature, constexprs, num_warps, num_stages, attrs, options``. Integer arguments are
    specialised as a launch does (``tt.divisibility`` 16 when divisible by 16; the region offsets are multiples
    of 256)."""
    from ..kernels.mega_moe import launch_warps, mega_moe_kernel, signal_layout

    R, H, INTER_, K, E = 8, 7168, 2048, 8, 256
    L = E // R
    sig_words = signal_layout(R)
    names = mega_moe_kernel.arg_names
    ptrs = {"buffer_ptrs": "*i64", "signal_ptrs": "*i64", "status_ptr": "*i32", "w1_ptr": "*fp8e4nv",
            "w1s_ptr": "*fp32", "w2_ptr": "*fp8e4nv", "w2s_ptr": "*fp32", "ring_ptr": "*u8", "y_ptr": "*i16",
            "stats_ptr": "*i32"}
    cases = []
    for T, phases in ((2048, (0, 1, 2, 3)), (128, (0, 2))):
        lay = _layout(R, E, T, K, H)
        block_m = choose_block_m(R, E, T, K)
        ints = {"rank": 3, "N": T, "T": T, "R": R, "L": L, "E": E, "x_off": lay["x"], "xsf_off": lay["x_sf"],
                "idx_off": lay["topk_idx"], "w_off": lay["topk_weights"], "cnt_off": lay["cnt"],
                "list_off": lay["list"], "comb_off": lay["comb"]}
        for phase in phases:
            const = dict(PHASE=phase, H=H, INTER=INTER_, K=K, KP=_pow2(K), BLOCK_M=block_m, BLOCK_T=16, RP=_pow2(R),
                         LP=_pow2(L), GP=_pow2(H // 128), HAS_STATS=True, HAS_CLAMP=False, NATIVE_FP8=True,
                         **{k: sig_words[k] for k in ("DISP_FULL", "COMB_FULL", "DISP_SEND_CNT", "COMB_SEND_CNT",
                                                      "COMB_RECV_CNT", "ROUTE_ERR")})
            sig = {**ptrs, **{n: "i32" for n in ints}, "timeout_ns": "i64", "clamp": "fp32",
                   **{k: "constexpr" for k in const}}
            div16 = list(ptrs) + [n for n, v in ints.items() if v % 16 == 0]
            what = {0: "fused", 1: "dispatch sends", 2: "experts", 3: "combine"}[phase]
            cases.append({"name": "mega_moe",
                          "config": f"PHASE={phase} ({what}) H={H} I={INTER_} E={E} top-{K} EP{R} T={T} "
                                    f"{block_m}-row items",
                          "kernel": mega_moe_kernel, "signature": {n: sig[n] for n in names}, "constexprs": const,
                          "num_warps": launch_warps(phase), "num_stages": 1,
                          "attrs": {(names.index(n),): [["tt.divisibility", 16]] for n in div16},
                          "options": {"enable_fp_fusion": False}})
    return cases
