"""FP8 (e4m3fn) quantization ops: activations per token group (Triton), weights per 128x128 block (torch).

Activation ops write the scale layout the next GEMM reads directly (no transpose kernel):

================================  ============================================================
options                           scales of a `[.., T, K]` input (G = K / group_size)
================================  ============================================================
(default)                         float32 `[.., T, G]` row-major
``column_major_scales``           float32 `[.., T, G]`, T stride 1, column stride T
``tma_aligned_scales``            float32 `[.., T, G]`, T stride 1, column stride T rounded up
                                  to a multiple of 4 (16 bytes; what DeepGEMM's TMA loads)
``scale_ue8m0``                   int32 `[.., T, ceil(G / 4)]` row-major, group g's exponent byte
                                  in bits ``8 * (g % 4)``; with ``column_major_scales`` /
                                  ``tma_aligned_scales`` the same int32 tensor column-major
                                  (padded to a multiple of 4 rows with TMA)
================================  ============================================================

TMA padding: the rows ``T .. ceil4(T) - 1`` of every column of a TMA-aligned scale storage are
zeros. The kernel writes them itself (no memset) where the storage is the op's own or ends exactly
at the padded end (DeepGEMM's ``get_mn_major_tma_aligned_tensor``, a slice of ``torch.empty(G, ceil4(T))``).
Caller storage that stops short of it (vLLM's ``torch.empty_strided((T, G), (1, ceil4(T)))``) or goes on
past it (a workspace) gets the padding between its columns zeroed (it lies inside the tensor's extent;
one small fill after the kernel) and the last column's left untouched (it may be someone else's).

Keywords, as the engines name them:

- ``use_ue8m0`` is vLLM's: float32 power-of-two scales (the same as ``round_scale``; vLLM's
  ``per_token_group_quant_fp8(..., use_ue8m0=True)``). ``scale_ue8m0`` is SGLang's / DeepGEMM's: the
  same exponents packed four to an int32 word. ``scale_tma_aligned`` (SGLang) is ``tma_aligned_scales``
  (vLLM); here either alone also makes the scales column-major (vLLM ignores it without
  ``column_major_scales``: the values are the same, only the strides differ).
- The amax floor is 1e-4 (DeepGEMM's) by default; ``eps=1e-10`` takes vLLM's and SGLang's. An all-zero
  group gets scale ``float32(eps) / 448`` (tiny groups quantize to the same bytes either way; only the
  scale, and so the UE8M0 byte, differs). vLLM's kernels also floor a scale at 1e-10 before rounding it
  to a power of two: ``pow2_scale_floor=1e-10``.
- :func:`silu_and_mul_quant_fp8` quantizes ``silu(gate) * up`` in float32; SGLang rounds the product to
  BF16 first. Deliberate: one rounding instead of two, so an FP8 byte can differ by one step from
  SGLang's where the BF16 rounding crosses an e4m3 rounding boundary.
- SiLU: ``round_product=True`` rounds ``silu(gate)`` and the product to x's dtype before the
  quantization, as SGLang's masked kernel (and vLLM's CUDA kernel) do, so its UE8M0 words match theirs.
  ``bf16_math=True`` (BF16 input) also takes the scale and the scaled values through bf16 as vLLM's CUDA kernel
  (``persistent_masked_m_silu_mul_quant``) does: ``s = bf16(amax * bf16(1/448))`` (amax floor bf16(1e-10)),
  rounded up to a power of two from ``bf16(log2 s)`` with ``round_scale`` / UE8M0, ``q = bf16(y * bf16(1/s))``
  clamped to +-448: its bytes and scales, bit for bit (less exact than the default: three more roundings).
- Masked rows (``>= masked_m[l]``): their FP8 rows are never written; their scales are stored as zeros
  (float32 +0.0, all-zero UE8M0 words), what vLLM's and SGLang's masked kernels write and their tests
  compare, at 4 bytes per masked row and group (per UE8M0 word). DeepGEMM's masked GEMM never reads
  those rows, so ``zero_masked_scales=False`` skips the stores (moe-ep's own expert path does).

Numerics (bitwise equal to :func:`moe_ep.fp8.per_token_group_quant_fp8_ref`): float32
``amax = max|x_group|`` clamped to at least 1e-4, ``scale = amax / 448`` (rounded up to a power of
two with ``round_scale`` / ``use_ue8m0``; ``scale_ue8m0`` implies it), ``q = e4m3(x / scale)`` round-to-nearest-even,
saturating at +-448. A group holding a NaN gets a NaN scale and NaN bytes (0x7F or 0xFF: the sign of
a NaN is not specified); a group holding an inf gets an inf scale, NaN where x is +-inf and +-0 for
its finite values. UE8M0 stores 0xFF for NaN and inf scales.
"""

from __future__ import annotations

import functools

import torch

from .fp8 import (
    FP8_DTYPE,
    ceil_div,
    dequant_fp8_ref,
    per_token_group_quant_fp8_ref,
    tma_aligned_size,
)
from .kernels.pdl import INTERPRET
from .kernels.quant import launch_per_token_group_quant
from .kernels.silu_quant import launch_silu_and_mul_quant
from .quant_weights import dequant_block_fp8, per_block_quant_fp8

__all__ = [
    "dequant_block_fp8",
    "dequant_fp8",
    "per_block_quant_fp8",
    "per_token_group_quant_fp8",
    "scale_layout",
    "silu_and_mul_fp32",
    "silu_and_mul_quant_fp8",
    "silu_and_mul_quant_fp8_ref",
]

_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ---------------------------------------------------------------------------------------------
# Layout helpers
# ---------------------------------------------------------------------------------------------

def scale_layout(lead: tuple[int, ...], num_rows: int, num_groups: int, *, column_major: bool = False,
                 tma_aligned: bool = False, scale_ue8m0: bool = False,
                 use_ue8m0: bool = False) -> tuple[torch.dtype, tuple, tuple]:
    """``(dtype, shape, strides)`` of the scales for `[*lead, num_rows, num_groups * group_size]` input.

    Column-major means, per leading index, the row dim has stride 1 and the column stride is
    ``num_rows`` (rounded up to a multiple of 4 with ``tma_aligned``); leading dims are outermost.
    ``scale_ue8m0`` (here also spelled ``use_ue8m0``): the packed int32 words.
    """
    use_ue8m0 = scale_ue8m0 or use_ue8m0
    dtype = torch.int32 if use_ue8m0 else torch.float32
    cols = ceil_div(num_groups, 4) if use_ue8m0 else num_groups
    shape = (*lead, num_rows, cols)
    if column_major or tma_aligned:
        rows_padded = tma_aligned_size(num_rows, 4) if tma_aligned else num_rows
        inner = (1, rows_padded)
        block = cols * rows_padded
    else:
        inner = (cols, 1)
        block = num_rows * cols
    outer = []
    for n in reversed(lead):
        outer.insert(0, block)
        block *= n
    return dtype, shape, (*outer, *inner)


def _alloc_scales(lead, num_rows, num_groups, device, column_major, tma_aligned, use_ue8m0) -> torch.Tensor:
    dtype, shape, strides = scale_layout(lead, num_rows, num_groups, column_major=column_major,
                                         tma_aligned=tma_aligned, use_ue8m0=use_ue8m0)
    if not (column_major or tma_aligned):
        return torch.empty(shape, dtype=dtype, device=device)
    # Allocate the padded columns too, so a TMA box over the last column stays inside the allocation.
    rows_padded = strides[-1]
    storage = torch.empty(*lead, shape[-1], rows_padded, dtype=dtype, device=device)
    return storage[..., :num_rows].transpose(-1, -2)


def _owns_tma_padding(s3: torch.Tensor, strides: tuple) -> bool:
    """Whether the TMA padding rows under the scales ``s3`` `[L, T, cols]` (canonical ``strides``,
    column stride M_padded) are theirs to zero: the storage ends exactly where the last column's
    padding ends, as in _alloc_scales' and DeepGEMM's allocations (a slice of `[L, cols, M_padded]`).
    Storage that stops short (``torch.empty_strided``) or goes on past it (a scale tensor carved out of
    a larger workspace, where the bytes after it may be someone else's) is left alone. Host metadata
    only: no device access."""
    end = s3.storage_offset() + (s3.shape[0] - 1) * strides[0] + s3.shape[2] * strides[2]
    return end * s3.element_size() == s3.untyped_storage().nbytes()


def _zero_inner_padding(s3: torch.Tensor, strides: tuple) -> None:
    """Zero the TMA padding rows between the columns of ``s3`` `[L, T, cols]` (column stride ``strides[2]``
    > T, expert stride ``cols * strides[2]``), every column's but the very last: inside the tensor's extent,
    so caller storage that does not hold the last column's padding holds these. One strided fill, no host
    synchronisation."""
    num_rows, col_stride = s3.shape[1], strides[2]
    columns = s3.shape[0] * s3.shape[2]  # the canonical layout: experts' columns follow one another
    if columns <= 1 or col_stride <= num_rows or s3.numel() == 0:
        return
    torch.as_strided(s3, (columns - 1, col_stride - num_rows), (col_stride, 1), s3.storage_offset() + num_rows).zero_()


def _same_strides(t: torch.Tensor, strides: tuple) -> bool:
    # Strides of size-0/1 dims carry no information (torch picks them freely).
    if t.numel() == 0:
        return True
    return all(n <= 1 or s == e for n, s, e in zip(t.shape, t.stride(), strides, strict=True))


# ---------------------------------------------------------------------------------------------
# Validation (every check runs before any launch)
# ---------------------------------------------------------------------------------------------

def _check_input(x: torch.Tensor, name: str, group_size: int, width_factor: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got {x.dtype}")
    if x.dim() not in (2, 3):
        raise ValueError(f"{name} must be 2D [M, K] or 3D [L, T, K], got shape {tuple(x.shape)}")
    if not isinstance(group_size, int) or group_size < 16 or group_size > 1024 or group_size & (group_size - 1):
        raise ValueError(f"group_size={group_size} must be a power of two in [16, 1024] (128 for DeepGEMM)")
    k = x.shape[-1]
    if k % (width_factor * group_size) != 0:
        what = "hidden" if width_factor == 1 else "2N (the gate and up halves)"
        raise ValueError(f"{name}: last dim {k} ({what}) must be a multiple of {width_factor * group_size} "
                         f"for FP8 groups of {group_size}; pad the features (no padded mode)")
    if x.device.type == "cpu" and not INTERPRET:
        raise RuntimeError("CPU tensors run the Triton kernels only under the interpreter: set "
                           "TRITON_INTERPRET=1 before importing moe_ep.quant, or pass CUDA tensors")


def _check_masked_m(masked_m: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    if masked_m is None:
        return None
    if x.dim() != 3:
        raise ValueError(f"masked_m needs 3D input [L, T, K], got shape {tuple(x.shape)}")
    if not isinstance(masked_m, torch.Tensor) or masked_m.dtype not in (torch.int32, torch.int64):
        got = masked_m.dtype if isinstance(masked_m, torch.Tensor) else type(masked_m).__name__
        raise TypeError(f"masked_m must be an int32 or int64 tensor, got {got}")
    if masked_m.shape != (x.shape[0],):
        raise ValueError(f"masked_m must have shape [L] = [{x.shape[0]}], got {tuple(masked_m.shape)}")
    if masked_m.device != x.device:
        raise ValueError(f"masked_m is on {masked_m.device} but x is on {x.device}")
    return masked_m.contiguous()


def _check_out(out: torch.Tensor, shape: tuple, device: torch.device) -> None:
    if not isinstance(out, torch.Tensor) or out.dtype != FP8_DTYPE:
        got = out.dtype if isinstance(out, torch.Tensor) else type(out).__name__
        raise TypeError(f"out must be a {FP8_DTYPE} tensor, got {got}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"out must have shape {list(shape)}, got {list(out.shape)}")
    if out.device != device:
        raise ValueError(f"out is on {out.device} but x is on {device}")
    if out.numel() == 0:
        return
    # Rows may be padded (a slice of a wider buffer) but must not overlap: last dim contiguous,
    # each outer stride covers the extent of the dims inside it.
    extent = 1
    for n, s in zip(reversed(out.shape), reversed(out.stride()), strict=True):
        if n > 1 and s < extent:
            raise ValueError(f"out must have a contiguous last dim and non-overlapping rows, got strides "
                             f"{out.stride()} for shape {list(out.shape)}")
        extent = max(extent, s * n) if n > 1 else extent
    if out.shape[-1] > 1 and out.stride(-1) != 1:
        raise ValueError(f"out must have a contiguous last dim, got strides {out.stride()}")


def _check_out_scales(out_scales: torch.Tensor, lead, num_rows, num_groups, device, column_major, tma_aligned,
                      use_ue8m0) -> None:
    dtype, shape, strides = scale_layout(lead, num_rows, num_groups, column_major=column_major,
                                         tma_aligned=tma_aligned, use_ue8m0=use_ue8m0)
    if not isinstance(out_scales, torch.Tensor) or out_scales.dtype != dtype:
        got = out_scales.dtype if isinstance(out_scales, torch.Tensor) else type(out_scales).__name__
        raise TypeError(f"out_scales must be {dtype} for these options, got {got}")
    if tuple(out_scales.shape) != shape:
        raise ValueError(f"out_scales must have shape {list(shape)}, got {list(out_scales.shape)}")
    if out_scales.device != device:
        raise ValueError(f"out_scales is on {out_scales.device} but x is on {device}")
    if not _same_strides(out_scales, strides):
        layout = "TMA-aligned column-major" if tma_aligned else "column-major" if column_major else "row-major"
        raise ValueError(f"out_scales must be {layout} with strides {strides}, got {out_scales.stride()}")


# ---------------------------------------------------------------------------------------------
# Shared driver of both activation ops
# ---------------------------------------------------------------------------------------------

def _quant_op(launch, x, width_factor, group_size, column_major_scales, tma_aligned_scales, round_scale,
              use_ue8m0, transpose_out, out, out_scales, masked_m, use_pdl, zero_masked_scales):
    """``use_ue8m0`` here: the packed words (the public ops' ``scale_ue8m0``)."""
    name = "x"
    _check_input(x, name, group_size, width_factor)
    masked_m = _check_masked_m(masked_m, x)
    if not isinstance(zero_masked_scales, bool):
        raise TypeError(f"zero_masked_scales must be a bool, got {type(zero_masked_scales).__name__}")
    lead, num_rows, k_out = tuple(x.shape[:-2]), x.shape[-2], x.shape[-1] // width_factor
    num_groups = k_out // group_size
    q_shape = (*lead, k_out, num_rows) if transpose_out else (*lead, num_rows, k_out)
    if out is None:
        out = torch.empty(q_shape, dtype=FP8_DTYPE, device=x.device)
    else:
        _check_out(out, q_shape, x.device)
    if out_scales is None:
        out_scales = _alloc_scales(lead, num_rows, num_groups, x.device, column_major_scales, tma_aligned_scales,
                                   use_ue8m0)
    else:
        _check_out_scales(out_scales, lead, num_rows, num_groups, x.device, column_major_scales,
                          tma_aligned_scales, use_ue8m0)

    # Empty input: nothing to launch.
    if x.numel() == 0:
        return out, out_scales

    # The kernels want a contiguous last dim (vector loads; gate and up in the same row) but take
    # any row/expert strides: only a strided last dim costs a copy.
    if x.stride(-1) != 1:
        x = x.contiguous()
    x3 = x if x.dim() == 3 else x.unsqueeze(0)
    q3 = out if out.dim() == 3 else out.unsqueeze(0)
    s3 = out_scales if out_scales.dim() == 3 else out_scales.unsqueeze(0)
    # Element strides of the logical [L, T, K] FP8 tensor (a transposed output is [L, K, T]).
    q_strides = (q3.stride(0), q3.stride(2), q3.stride(1)) if transpose_out else q3.stride()
    # The layout's own strides, not out_scales': they agree on every dim of size > 1, and a size-1
    # dim's stride (free in torch) would otherwise move the TMA padding rows the kernel zeroes.
    s_strides = scale_layout((x3.shape[0],), num_rows, num_groups, column_major=column_major_scales,
                             tma_aligned=tma_aligned_scales, use_ue8m0=use_ue8m0)[2]
    keep_padding = tma_aligned_scales and not _owns_tma_padding(s3, s_strides)
    launch(x3, q3, tuple(q_strides), s3, masked_m, group_size, round_scale, use_ue8m0, transpose_out, use_pdl,
           s_strides=s_strides, zero_masked_scales=zero_masked_scales and masked_m is not None,
           keep_padding=keep_padding)
    if keep_padding:
        _zero_inner_padding(s3, s_strides)
    return out, out_scales


def _small_eps(eps) -> bool:
    """The ops' ``eps``: True for 1e-10 (vLLM's, SGLang's), False for 1e-4 (DeepGEMM's); ValueError otherwise."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or float(eps) not in (1e-4, 1e-10):
        raise ValueError(f"eps={eps!r}: the amax floor is 1e-4 (DeepGEMM's, the default) or 1e-10 (vLLM's and "
                         "SGLang's)")
    return float(eps) == 1e-10


def _pow2_floor(floor) -> bool:
    """``pow2_scale_floor``: True for 1e-10 (vLLM's), False for 0 (the default); ValueError otherwise."""
    if isinstance(floor, bool) or not isinstance(floor, (int, float)) or float(floor) not in (0.0, 1e-10):
        raise ValueError(f"pow2_scale_floor={floor!r}: a power-of-two scale's floor is 0 (the default) or 1e-10 "
                         "(vLLM's kernels)")
    return float(floor) == 1e-10


def _flags(column_major_scales, tma_aligned_scales, scale_tma_aligned, round_scale, use_ue8m0, scale_ue8m0):
    """The engines' spellings onto the kernels' options: ``(column_major, tma_aligned, round_scale, packed)``."""
    for key, val in (("column_major_scales", column_major_scales), ("tma_aligned_scales", tma_aligned_scales),
                     ("scale_tma_aligned", scale_tma_aligned), ("round_scale", round_scale),
                     ("use_ue8m0", use_ue8m0), ("scale_ue8m0", scale_ue8m0)):
        if not isinstance(val, bool):
            raise TypeError(f"{key} must be a bool, got {type(val).__name__}")
    return (column_major_scales, tma_aligned_scales or scale_tma_aligned,
            round_scale or use_ue8m0 or scale_ue8m0, scale_ue8m0)


# ---------------------------------------------------------------------------------------------
# Public ops
# ---------------------------------------------------------------------------------------------

def per_token_group_quant_fp8(
    x: torch.Tensor,
    group_size: int = 128,
    *,
    column_major_scales: bool = False,
    tma_aligned_scales: bool = False,
    round_scale: bool = False,
    use_ue8m0: bool = False,
    scale_ue8m0: bool = False,
    scale_tma_aligned: bool = False,
    transpose_out: bool = False,
    out: torch.Tensor | None = None,
    out_scales: torch.Tensor | None = None,
    masked_m: torch.Tensor | None = None,
    use_pdl: bool = False,
    zero_masked_scales: bool = True,
    eps: float = 1e-4,
    pow2_scale_floor: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize activations to FP8 with one scale per ``group_size`` consecutive channels of a row.

    Arguments:
        x: `[M, K]` or `[L, T, K]` with `torch.bfloat16`, `torch.float16` or `torch.float32`; K a
            multiple of ``group_size`` (else ValueError). Any row/expert strides; a non-contiguous
            last dim is copied first.
        group_size: channels per scale, a power of two (128 for DeepGEMM).
        column_major_scales: scales column-major (the row dim has stride 1).
        tma_aligned_scales: column-major with the column stride padded to a multiple of 4 (also
            spelled ``scale_tma_aligned``, SGLang's name).
        round_scale: round scales up to a power of two.
        use_ue8m0: vLLM's meaning: float32 scales rounded up to a power of two (= ``round_scale``).
        scale_ue8m0: SGLang's / DeepGEMM's meaning: power-of-two scales packed as UE8M0 bytes, four
            per int32 word.
        transpose_out: write the FP8 tensor transposed, `[K, M]` (`[L, K, T]` for 3D), contiguous.
        out: optional FP8 output of the shape above; padded rows allowed, contiguous last dim.
        out_scales: optional scales output with exactly the layout the options select.
        masked_m: `[L]` int32/int64 on x's device, 3D input only: rows ``t >= masked_m[l]`` (values
            clamped to [0, T]) are neither read nor FP8-written; their scales are zeros (see
            ``zero_masked_scales``). Read on the device: no host synchronisation (CUDA-graph safe).
        use_pdl: launch with programmatic dependent launch where supported (Hopper+, Triton >= 3.4);
            ignored elsewhere. Results are identical either way.
        zero_masked_scales: with ``masked_m``, store zero scales (float32 +0.0, or all-zero UE8M0
            words) for the masked rows, as vLLM's and SGLang's masked ops do (the default). False
            leaves them unwritten (DeepGEMM's masked GEMM never reads them), saving 4 bytes per
            masked row and group. Ignored without ``masked_m``.
        eps: the floor of each group's ``amax``: 1e-4 (DeepGEMM's, the default) or 1e-10 (vLLM's and
            SGLang's); any other value is a ValueError. An all-zero group gets scale ``float32(eps) / 448``
            and zero bytes.
        pow2_scale_floor: the floor of a scale before it is rounded up to a power of two (``round_scale``,
            ``use_ue8m0``, ``scale_ue8m0``): 0 (DeepGEMM's, SGLang's; the default) or 1e-10 (vLLM's kernels,
            ``exp2(ceil(log2(max(s, 1e-10))))``); any other value is a ValueError. It only changes groups
            with ``amax < 448e-10``, so only with ``eps=1e-10``: an all-zero group's UE8M0 byte is then 0x5E
            (2^-33), where it is 0x55 without it.

    With ``tma_aligned_scales`` the padding rows of the storage (T rounded up to a multiple of 4, in
    every column) are zeros, written by the kernel, when the storage is the op's own or ends exactly at
    the padded end (a slice of a `[.., cols, ceil4(T)]` allocation); other caller storage keeps them.

    Returns:
        x_fp8: `[M, K]` (or `[K, M]` with ``transpose_out``; 3D likewise) with `torch.float8_e4m3fn`.
        scales: `[M, K / group_size]` `torch.float32`, or `[M, ceil(K / group_size / 4)]` `torch.int32`
            with ``scale_ue8m0``; leading `L` for 3D input; layout per the options.
    """
    col, tma, rnd, packed = _flags(column_major_scales, tma_aligned_scales, scale_tma_aligned, round_scale,
                                   use_ue8m0, scale_ue8m0)
    launch = functools.partial(launch_per_token_group_quant, small_eps=_small_eps(eps),
                               pow2_floor=_pow2_floor(pow2_scale_floor))
    return _quant_op(launch, x, 1, group_size, col, tma, rnd, packed, transpose_out, out,
                     out_scales, masked_m, use_pdl, zero_masked_scales)


def silu_and_mul_quant_fp8(
    x: torch.Tensor,
    group_size: int = 128,
    *,
    column_major_scales: bool = False,
    tma_aligned_scales: bool = False,
    round_scale: bool = False,
    use_ue8m0: bool = False,
    scale_ue8m0: bool = False,
    scale_tma_aligned: bool = False,
    transpose_out: bool = False,
    out: torch.Tensor | None = None,
    out_scales: torch.Tensor | None = None,
    masked_m: torch.Tensor | None = None,
    use_pdl: bool = False,
    zero_masked_scales: bool = True,
    round_product: bool = False,
    bf16_math: bool = False,
    eps: float = 1e-4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``per_token_group_quant_fp8(silu(gate) * up)`` in one pass, the product kept in float32.

    Arguments:
        x: `[M, 2N]` or `[L, T, 2N]` with `torch.bfloat16`, `torch.float16` or `torch.float32`:
            ``gate = x[..., :N]``, ``up = x[..., N:]``; N a multiple of ``group_size``.
        round_product: round ``silu(gate)`` to x's dtype, and ``silu(gate) * up`` to x's dtype, before
            quantizing: what SGLang's masked SiLU-and-mul quant (and vLLM's CUDA one) compute, so the
            scales (UE8M0 words) agree with theirs. Off by default: one rounding, of the float32 product.
        bf16_math: vLLM's CUDA arithmetic (module notes): ``round_product``, then the scale, its reciprocal
            and the scaled values each rounded to bf16. BF16 ``x`` only. Its amax floor is ``bf16(1e-10)``, whatever
            ``eps``.
        Every other argument as in :func:`per_token_group_quant_fp8` (with K = N).

    Returns:
        x_fp8: `[M, N]` (`[N, M]` with ``transpose_out``; 3D likewise) with `torch.float8_e4m3fn`.
        scales: as :func:`per_token_group_quant_fp8` for K = N.

    The quantization is bitwise the shared one; ``silu(gate) * up`` follows
    :func:`silu_and_mul_fp32` to float32 rounding (the exponential differs by a few ulp between
    torch, the interpreter and the GPU), so FP8 bytes can differ by one e4m3 step where the product
    sits on a rounding boundary.
    """
    for name, v in (("round_product", round_product), ("bf16_math", bf16_math)):
        if not isinstance(v, bool):
            raise TypeError(f"{name} must be a bool, got {type(v).__name__}")
    if bf16_math and x.dtype != torch.bfloat16:
        raise TypeError(f"bf16_math=True takes BF16 input (vLLM's CUDA kernel's), got {x.dtype}")
    col, tma, rnd, packed = _flags(column_major_scales, tma_aligned_scales, scale_tma_aligned, round_scale,
                                   use_ue8m0, scale_ue8m0)
    launch = functools.partial(launch_silu_and_mul_quant, round_product=round_product, bf16_math=bf16_math,
                               small_eps=_small_eps(eps))
    return _quant_op(launch, x, 2, group_size, col, tma, rnd, packed, transpose_out, out, out_scales, masked_m,
                     use_pdl, zero_masked_scales)


def reciprocal_multiply_quant_fp8(x: torch.Tensor, group_size: int = 128, *, silu: bool = False,
                                  **options) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`per_token_group_quant_fp8` (or, with ``silu``, :func:`silu_and_mul_quant_fp8`) with ``x * (1 / scale)``
    in place of ``x / scale``: the arithmetic of sgl-kernel's and vLLM's quant kernels, one rounding more, so
    NOT bitwise equal to the reference (an e4m3 step off where the quotient sits on a rounding boundary).
    For benchmarks only: its time next to the exact op's is the price of the IEEE quotient. ``options``: the
    keyword arguments of the exact op."""
    launch = launch_silu_and_mul_quant if silu else launch_per_token_group_quant
    o = {"column_major_scales": False, "tma_aligned_scales": False, "scale_tma_aligned": False, "round_scale": False,
         "use_ue8m0": False, "scale_ue8m0": False, "transpose_out": False, "out": None, "out_scales": None,
         "masked_m": None, "use_pdl": False, "zero_masked_scales": True}
    unknown = set(options) - set(o)
    if unknown:
        raise TypeError(f"reciprocal_multiply_quant_fp8: unknown options {sorted(unknown)}")
    o.update(options)
    col, tma, rnd, packed = _flags(o["column_major_scales"], o["tma_aligned_scales"], o["scale_tma_aligned"],
                                   o["round_scale"], o["use_ue8m0"], o["scale_ue8m0"])
    return _quant_op(functools.partial(launch, recip_multiply=True), x, 2 if silu else 1, group_size, col, tma, rnd,
                     packed, o["transpose_out"], o["out"], o["out_scales"], o["masked_m"], o["use_pdl"],
                     o["zero_masked_scales"])


def silu_and_mul_fp32(x: torch.Tensor) -> torch.Tensor:
    """Torch reference of the fused op's first step: ``silu(gate) * up`` in float32, `[.., 2N]` -> `[.., N]`."""
    gate, up = x.float().chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def silu_and_mul_quant_fp8_ref(x: torch.Tensor, group_size: int = 128, round_scale: bool = False,
                               use_ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`silu_and_mul_quant_fp8` (row-major scales; ``use_ue8m0`` here: packed words,
    as :func:`moe_ep.fp8.per_token_group_quant_fp8_ref`)."""
    return per_token_group_quant_fp8_ref(silu_and_mul_fp32(x), group_size, round_scale, use_ue8m0)


def dequant_fp8(q: torch.Tensor, scales: torch.Tensor, group_size: int = 128, *,
                transposed: bool = False) -> torch.Tensor:
    """Dequantize per-token-group FP8 in any of the layouts above.

    Arguments:
        q: `[.., M, K]` `torch.float8_e4m3fn`, or `[.., K, M]` with ``transposed``.
        scales: float32 `[.., M, K / group_size]` (any strides: row-major, column-major, TMA) or the
            UE8M0 int32 `[.., M, ceil(K / group_size / 4)]` (any strides).

    Returns:
        `[.., M, K]` `torch.float32` (always row-major orientation).
    """
    if transposed:
        q = q.transpose(-1, -2)
    return dequant_fp8_ref(q, scales, group_size)
