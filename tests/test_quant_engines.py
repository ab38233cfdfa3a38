"""The quant ops called the way vLLM's and SGLang's own kernel tests call theirs, with their assertions.

CPU-sized sweeps of three engine test matrices, checked against references written here from the
engines' documented arithmetic:

1. vLLM's persistent masked SiLU-and-mul quant (DeepGEMM's masked layout, ``[E, T, 2H]`` input, rows
   ``>= tokens_per_expert[e]`` masked) in its three scale formats: float32, float32 rounded up to powers
   of two (vLLM's ``use_ue8m0``), and packed UE8M0 words, column-major ``[E, T, ceil(G / 4)]`` with
   strides ``(T * ceil(G / 4), 1, T)``, compared as whole per-expert byte images (zero words past the
   valid rows, zero bytes for the padding groups of the last word).
2. SGLang's per-token-group 8-bit quant with SGLang's keywords (``scale_tma_aligned``, ``scale_ue8m0``):
   the plain 2D matrix (row-major, column-major, TMA-aligned, TMA-aligned packed) and the fused masked
   SiLU quant on DeepEP low-latency shaped input (balanced / imbalanced / extreme ``masked_m``), whose
   packed scales are DeepGEMM's MN-major TMA-aligned words with zeros in masked rows and padding.
3. vLLM's per_token_group_quant_fp8 with vLLM's keywords (``use_ue8m0`` = float32 powers of two) and
   its packed DeepGEMM layout, including vLLM's own ``torch.empty_strided`` scale storage poisoned
   before the call: the padding rows between its columns must come back zero.

``bf16_math=True`` reproduces vLLM's CUDA SiLU-and-mul quant bit for bit (checked against a torch bf16
transcription of it). Deliberate differences kept by default (and so not asserted here): moe-ep divides (``x / scale``, correctly
rounded) where vLLM's references multiply by ``1 / scale`` (an e4m3 step apart on ties), and floors amax
at 1e-4 (vLLM / SGLang: 1e-10).
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from moe_ep.fp8 import FP8_DTYPE, pack_ue8m0
from moe_ep.quant import per_token_group_quant_fp8, silu_and_mul_quant_fp8

DEV = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
GS = 128
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def ceil4(n: int) -> int:
    return (n + 3) // 4 * 4


def group_quant(y: torch.Tensor, group_size: int = GS, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 groups -> (e4m3, float32 scales): amax floored at 1e-4, ``scale = amax / 448`` (optionally
    rounded up to a power of two), ``q = y / scale`` saturated."""
    g = y.float().reshape(*y.shape[:-1], y.shape[-1] // group_size, group_size)
    s = g.abs().amax(-1).clamp(min=1e-4) / torch.tensor(448.0)
    if pow2:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    q = (g / s[..., None]).clamp(-448.0, 448.0).to(FP8_DTYPE).reshape(y.shape)
    return q, s


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in row-major order as bytes (whatever its strides)."""
    return torch.empty(t.shape, dtype=t.dtype).copy_(t.cpu()).view(torch.uint8)


def step_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|byte(a) - byte(b)| of two e4m3 tensors, as int16."""
    return (a.cpu().view(torch.uint8).to(torch.int16) - b.cpu().view(torch.uint8).to(torch.int16)).abs()


def assert_q_matches(q: torch.Tensor, ref: torch.Tensor) -> None:
    """Bitwise in the interpreter; compiled, SiLU's exp is approximate: at most one e4m3 step, rarely."""
    d = step_diff(q, ref)
    if DEV == "cpu":
        assert int(d.max()) == 0 if d.numel() else True, f"{int((d > 0).sum())} bytes differ"
    else:
        assert int(d.max()) <= 1 and int((d > 0).sum()) <= max(1, d.numel() // 1000)


# ---------------------------------------------------------------------------------------------
# 1. vLLM: persistent masked SiLU-and-mul quant, three scale formats
# ---------------------------------------------------------------------------------------------

VLLM_FORMATS = {"float32": {}, "float32_pow2": {"use_ue8m0": True},
                "ue8m0_words": {"scale_ue8m0": True, "column_major_scales": True}}


def vllm_style_input(E: int, T: int, H: int, seed: int):
    """Token counts (expert 0 full, expert 1 empty, the rest random) and ``[E, T, 2H]`` bf16 rows, each
    valid row uniform in +-2**k for its own k in 1..19; the masked rows hold NaN (never to be read)."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, T, (E,), generator=gen, dtype=torch.int32)
    counts[0] = T
    if E > 1:
        counts[1] = 0
    y = torch.full((E, T, 2 * H), float("nan"), dtype=torch.bfloat16)
    for e in range(E):
        n = int(counts[e])
        span = 2.0 ** torch.randint(1, 20, (n, 1), generator=gen).float()
        y[e, :n] = ((torch.rand(n, 2 * H, generator=gen) * 2 - 1) * span).bfloat16()
    return counts, y


@pytest.mark.parametrize("E,T,H", [(1, 1, 128), (1, 4, 384), (2, 4, 256), (8, 16, 640), (8, 16, 896),
                                   (3, 31, 768), (4, 8, 1280)])
def test_vllm_masked_silu_quant(E, T, H):
    counts, y = vllm_style_input(E, T, H, seed=E * 1000 + T + H)
    gate, up = y[..., :H].float(), y[..., H:].float()
    prod = gate / (1 + torch.exp(-gate)) * up
    G, words = H // GS, (H // GS + 3) // 4
    for name, kw in VLLM_FORMATS.items():
        q, s = silu_and_mul_quant_fp8(y.to(DEV), GS, masked_m=counts.to(DEV), **kw)
        if name == "ue8m0_words":
            assert s.dtype == torch.int32 and s.shape == (E, T, words) and s.stride() == (T * words, 1, T)
        else:
            assert s.dtype == torch.float32 and s.shape == (E, T, G)
        for e in range(E):
            n = int(counts[e])
            rq, rs = group_quant(prod[e, :n], pow2=name != "float32")
            assert_q_matches(q[e, :n], rq)
            if name == "ue8m0_words":
                expect = torch.zeros(T, words, dtype=torch.int32)  # masked rows: all-zero words
                expect[:n] = pack_ue8m0(rs)
                assert torch.equal(bytes_of(s[e]), bytes_of(expect)), f"expert {e}: packed words differ"
            else:
                torch.testing.assert_close(s[e, :n].cpu(), rs)
                assert bool((s[e, n:] == 0).all()), f"expert {e}: masked rows' scales not zero"


def vllm_cuda_reference(gate: torch.Tensor, up: torch.Tensor, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's CUDA SiLU-and-mul quant as torch's bf16 ops compute it (each op in float32, rounded to bf16):
    SiLU, product, amax floored at bf16(1e-10), ``s = amax * (bf16(1) / bf16(448))``, optionally
    ``2^ceil(log2 s)`` with the log rounded to bf16, ``q = clamp(y * (1 / s))`` -> e4m3."""
    bf = torch.bfloat16
    g32 = gate.float()
    y = (g32 / (1 + torch.exp(-g32))).to(bf) * up.to(bf)
    yv = y.reshape(-1, GS)
    amax = yv.abs().amax(dim=1).clamp(min=torch.tensor(1e-10, dtype=bf))
    s = amax * (torch.tensor(1.0, dtype=bf) / torch.tensor(448.0, dtype=bf))
    if pow2:
        s = torch.exp2(torch.ceil(torch.log2(s).to(bf))).to(bf)
    q = torch.clamp(yv * (torch.tensor(1.0, dtype=bf) / s)[:, None], -448.0, 448.0).to(FP8_DTYPE)
    return q.reshape(y.shape), s.float().reshape(*y.shape[:-1], y.shape[-1] // GS)


@pytest.mark.parametrize("E,T,H", [(1, 4, 384), (8, 16, 640), (3, 31, 768)])
def test_vllm_cuda_arithmetic_is_bitwise(E, T, H):
    # bf16_math=True: vLLM's CUDA kernel's bytes and scales, bit for bit, in its three scale formats
    counts, y = vllm_style_input(E, T, H, seed=E * 7000 + T + H)
    words = (H // GS + 3) // 4
    for name, kw in VLLM_FORMATS.items():
        q, s = silu_and_mul_quant_fp8(y.to(DEV), GS, masked_m=counts.to(DEV), bf16_math=True, **kw)
        for e in range(E):
            n = int(counts[e])
            rq, rs = vllm_cuda_reference(y[e, :n, :H], y[e, :n, H:], pow2=name != "float32")
            assert_q_matches(q[e, :n], rq)
            if name == "ue8m0_words":
                expect = torch.zeros(T, words, dtype=torch.int32)
                expect[:n] = pack_ue8m0(rs)
                assert torch.equal(bytes_of(s[e]), bytes_of(expect)), f"expert {e}: packed words differ"
            else:
                assert torch.equal(s[e, :n].cpu(), rs), f"expert {e} {name}: scales differ"
    # and it is a different arithmetic from the default: some scale differs on these inputs
    _, s_exact = silu_and_mul_quant_fp8(y.to(DEV), GS, masked_m=counts.to(DEV))
    _, s_bf16 = silu_and_mul_quant_fp8(y.to(DEV), GS, masked_m=counts.to(DEV), bf16_math=True)
    assert not torch.equal(s_exact.cpu(), s_bf16.cpu())


@pytest.mark.parametrize("silu", [False, True], ids=["quant", "silu_quant"])
def test_eps_of_the_engines(silu):
    # eps=1e-10 (vLLM's, SGLang's amax floor): an all-zero group's UE8M0 byte is 0x55, 2^ceil(log2(1e-10 / 448))
    # as SGLang's kernel computes it (1e-4, the default: 0x69); every other byte and scale is the reference's with
    # that floor. (vLLM's kernels also floor the scale itself at 1e-10, 0x5E: pow2_scale_floor, the next test.)
    from moe_ep.fp8 import per_token_group_quant_fp8_ref
    from moe_ep.quant import silu_and_mul_fp32

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 2 * 256 if silu else 256, generator=gen).bfloat16()
    x[1] = 0.0  # every group of row 1 is zero (gate 0: SiLU 0)
    x[2, :128] = 1e-9  # a tiny group: under 1e-4 after SiLU and product or not
    op = silu_and_mul_quant_fp8 if silu else per_token_group_quant_fp8
    y = silu_and_mul_fp32(x) if silu else x.float()
    for eps, byte in ((1e-10, 0x55), (1e-4, 0x69)):
        q, s = op(x.to(DEV), GS, eps=eps)
        rq, rs = per_token_group_quant_fp8_ref(y, GS, eps=eps)
        if silu:  # SiLU's exp differs by an ulp between the kernel and torch (module notes): scales within that
            assert_q_matches(q, rq)
            torch.testing.assert_close(s.cpu(), rs)
        else:
            assert torch.equal(bytes_of(q), bytes_of(rq)) and torch.equal(s.cpu(), rs), eps
        assert float(s[1, 0]) == float(torch.tensor(eps, dtype=torch.float32) / 448), (eps, float(s[1, 0]))
        _, w = op(x.to(DEV), GS, eps=eps, scale_ue8m0=True)
        assert int(w[1, 0].cpu()) & 0xFF == byte, (eps, hex(int(w[1, 0])))
    with pytest.raises(ValueError, match="eps=0.001: the amax floor is 1e-4"):
        op(x.to(DEV), GS, eps=1e-3)


def test_vllm_pow2_scale_floor():
    # vLLM's per-token-group CUDA kernels (packed and unpacked) round a UE8M0 scale as
    # exp2(ceil(log2(max(|amax / 448|, 1e-10)))), amax floored at eps = 1e-10: pow2_scale_floor=1e-10. Groups with
    # amax < 448e-10 get 2^-33 (byte 0x5E) instead of their own power of two; the bytes are x / that scale.
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(5, 512, generator=gen)
    x[1] = 0.0  # all-zero groups
    x[2, :128] = 3e-9  # amax / 448 ~ 6.7e-12: floored
    x[3, 128:256] *= 1e-7  # amax / 448 ~ 8e-10: above the floor, its own power of two
    y = x.view(5, 4, 128)
    amax = y.abs().amax(-1).clamp(min=1e-10)
    ref_s = torch.exp2(torch.ceil(torch.log2((amax / 448.0).clamp(min=1e-10))))
    ref_q = (y / ref_s[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(5, 512)
    q, s = per_token_group_quant_fp8(x.to(DEV), GS, use_ue8m0=True, eps=1e-10, pow2_scale_floor=1e-10)
    assert torch.equal(s.cpu(), ref_s) and torch.equal(bytes_of(q), bytes_of(ref_q))
    assert float(s[1, 0]) == 2.0 ** -33 and float(s[2, 0]) == 2.0 ** -33 and float(s[3, 1]) > 2.0 ** -33
    _, w = per_token_group_quant_fp8(x.to(DEV), GS, scale_ue8m0=True, eps=1e-10, pow2_scale_floor=1e-10)
    assert int(w[1, 0].cpu()) == 0x5E5E5E5E, hex(int(w[1, 0]))
    # without rounding to a power of two the floor does nothing (vLLM's float scales have none)
    _, s_plain = per_token_group_quant_fp8(x.to(DEV), GS, eps=1e-10, pow2_scale_floor=1e-10)
    assert float(s_plain[1, 0]) == float(torch.tensor(1e-10) / 448)
    with pytest.raises(ValueError, match="pow2_scale_floor=1e-05: a power-of-two scale's floor is 0"):
        per_token_group_quant_fp8(x.to(DEV), GS, pow2_scale_floor=1e-5)


def test_bf16_math_takes_bf16_only():
    with pytest.raises(TypeError, match="bf16_math=True takes BF16"):
        silu_and_mul_quant_fp8(torch.zeros(2, 256, device=DEV), GS, bf16_math=True)


# ---------------------------------------------------------------------------------------------
# 2. SGLang: per_token_group_quant_8bit, plain matrix and the fused masked SiLU quant
# ---------------------------------------------------------------------------------------------

def deepgemm_packed(sf: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 scales `[.., mn, G]` (zeros allowed) in DeepGEMM's packed MN-major TMA-aligned
    layout: int32 `[.., mn, ceil(G / 4)]` over `[.., ceil(G / 4), ceil4(mn)]` storage, padding zero."""
    *lead, mn, _ = sf.shape
    words = pack_ue8m0(sf)
    store = torch.zeros(*lead, words.shape[-1], ceil4(mn), dtype=torch.int32)
    store[..., :mn] = words.transpose(-1, -2)
    return store.transpose(-1, -2)[..., :mn, :]


def padded_store(s: torch.Tensor) -> torch.Tensor:
    """The `[.., cols, ceil4(mn)]` storage under a TMA-aligned column-major scale tensor (padding included)."""
    *lead, mn, cols = s.shape
    return torch.as_strided(s, (*lead, cols, ceil4(mn)), (*s.stride()[:-2], ceil4(mn), 1)).cpu()


SGLANG_FLAGS = {
    "row": {},
    "col": {"column_major_scales": True},
    "col_tma": {"column_major_scales": True, "scale_tma_aligned": True},
    "col_tma_ue8m0": {"column_major_scales": True, "scale_tma_aligned": True, "scale_ue8m0": True},
}


@pytest.mark.parametrize("flags", list(SGLANG_FLAGS))
@pytest.mark.parametrize("num_tokens,hidden", [(1, 512), (4, 1536), (64, 1024), (127, 512)])
def test_sglang_plain(num_tokens, hidden, flags):
    gen = torch.Generator().manual_seed(num_tokens * 10000 + hidden)
    x = torch.randn(num_tokens, hidden, generator=gen)
    x[torch.randn(x.shape, generator=gen) < 0.001] *= 10  # a few outliers, as SGLang's data has
    x = x.bfloat16()
    kw = SGLANG_FLAGS[flags]
    q, s = per_token_group_quant_fp8(x.to(DEV), GS, **kw)
    packed = kw.get("scale_ue8m0", False)
    rq, rs = group_quant(x, pow2=packed)
    assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8))
    if packed:
        expect = deepgemm_packed(rs)
        assert s.stride() == expect.stride() and torch.equal(padded_store(s), padded_store(expect))
    else:
        if kw:
            assert s.stride()[0] == 1  # column-major, as SGLang allocates them
        torch.testing.assert_close(s.cpu(), rs, rtol=1e-3, atol=1e-5)


def sglang_masked_counts(mode: str, total: int, E: int, gen: torch.Generator) -> torch.Tensor:
    if mode == "balanced":
        return torch.tensor([total // E + (i < total % E) for i in range(E)], dtype=torch.int32)
    if mode == "extreme":
        return torch.tensor([total] + [0] * (E - 1), dtype=torch.int32)
    share = torch.rand(E, generator=gen) ** 3
    counts = (share / share.sum() * total).floor().to(torch.int32)
    counts[int(share.argmax())] += total - int(counts.sum())
    return counts


def sglang_fused_reference(x: torch.Tensor, counts: torch.Tensor):
    """SGLang's masked SiLU-and-mul quant: SiLU rounded to bf16, the product rounded to bf16, power-of-two
    scales stored as zeros past each expert's count, then packed DeepGEMM's way."""
    E, T, two_h = x.shape
    H = two_h // 2
    q = torch.zeros(E, T, H, dtype=FP8_DTYPE)
    sf = torch.zeros(E, T, H // GS)
    for e in range(E):
        n = int(counts[e])
        gate = x[e, :n, :H].float()
        act = (gate / (1 + torch.exp(-gate))).bfloat16().float()
        prod = (act * x[e, :n, H:].float()).bfloat16()
        q[e, :n], sf[e, :n] = group_quant(prod, pow2=True)
    return q, deepgemm_packed(sf)


@pytest.mark.parametrize("mode", ["balanced", "imbalanced", "extreme", "unmasked_2d"])
@pytest.mark.parametrize("num_tokens,num_ranks", [(1, 48), (8, 16), (40, 8), (96, 32)])
def test_sglang_masked_fused_silu(num_tokens, num_ranks, mode):
    E, T, H = 288 // num_ranks, 4 * num_ranks, 512  # SGLang: 768 tokens per rank, H = 2048
    gen = torch.Generator().manual_seed(num_tokens * 10000 + num_ranks)
    if mode == "unmasked_2d":
        x, counts = torch.randn(num_tokens, 2 * H, generator=gen).bfloat16().unsqueeze(0), None
        full = torch.tensor([num_tokens], dtype=torch.int32)
    else:
        x = torch.randn(E, T, 2 * H, generator=gen).bfloat16()
        counts = full = sglang_masked_counts(mode, min(num_tokens, T), E, gen)
    kw = {"column_major_scales": True, "scale_tma_aligned": True, "scale_ue8m0": True, "round_product": True}
    if counts is None:
        q, s = silu_and_mul_quant_fp8(x[0].to(DEV), GS, **kw)
        q, s = q.unsqueeze(0), s.unsqueeze(0)
    else:
        q, s = silu_and_mul_quant_fp8(x.to(DEV), GS, masked_m=counts.to(DEV), **kw)
    rq, rs = sglang_fused_reference(x, full)
    assert s.stride()[1:] == rs.stride()[1:], (s.stride(), rs.stride())  # [T, words]: MN-major, TMA-padded
    assert torch.equal(padded_store(s), padded_store(rs)), "packed words (masked rows: zero words)"
    for e in range(x.shape[0]):
        n = int(full[e])
        assert_q_matches(q[e, :n], rq[e, :n])


def test_round_product_is_what_separates_sglang_words():
    # SiLU(30) == 30 exactly; 30 * 14.9375 = 448.125 in float32 (scale 448.125 / 448 > 1: rounded up to 2)
    # but 448 in bf16 (scale exactly 1): the UE8M0 word differs between the two arithmetics.
    H = 128
    x = torch.zeros(2, 2 * H)
    x[:, :H] = 30.0
    x[0, H] = 14.9375
    x[1, H] = -3.0  # a row both agree on
    x = x.bfloat16()
    prod32 = 30.0 * x[:, H:].float()
    _, s32 = group_quant(prod32, pow2=True)
    _, s16 = group_quant(prod32.bfloat16().float(), pow2=True)
    assert float(s32[0, 0]) == 2.0 and float(s16[0, 0]) == 1.0 and float(s32[1, 0]) == float(s16[1, 0])
    kw = {"scale_ue8m0": True, "tma_aligned_scales": True}
    _, plain = silu_and_mul_quant_fp8(x.to(DEV), GS, **kw)
    _, sgl = silu_and_mul_quant_fp8(x.to(DEV), GS, round_product=True, **kw)
    assert torch.equal(sgl.cpu(), pack_ue8m0(s16)) and torch.equal(plain.cpu(), pack_ue8m0(s32))


# ---------------------------------------------------------------------------------------------
# 3. vLLM: per_token_group_quant_fp8 with vLLM's keywords, and its packed DeepGEMM layout
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("col,tma,ue8m0,group_size",
                         list(itertools.product([False, True], [False, True], [False, True], [64, 128])))
def test_vllm_keywords(col, tma, ue8m0, group_size):
    gen = torch.Generator().manual_seed(42)
    for shape in [(31, 128), (64, 256)]:
        x = (torch.randn(shape, generator=gen) * 8).bfloat16()
        q, s = per_token_group_quant_fp8(x.to(DEV), group_size, column_major_scales=col, tma_aligned_scales=tma,
                                         use_ue8m0=ue8m0)
        rq, rs = group_quant(x, group_size, pow2=ue8m0)
        assert s.dtype == torch.float32 and s.shape == rs.shape  # vLLM's use_ue8m0: float32, not words
        assert torch.allclose(q.float().cpu(), rq.float(), atol=0.15, rtol=0.15)
        assert torch.allclose(s.cpu(), rs, atol=0.01, rtol=0.01)
        if ue8m0:
            assert bool((s.cpu().view(torch.int32) & 0x7FFFFF == 0).all()), "not powers of two"


@pytest.mark.parametrize("storage", ["own", "vllm_empty_strided_poisoned"])
@pytest.mark.parametrize("mn,hidden", [(4, 7168), (1, 384), (3, 640), (4, 768), (127, 1024), (253, 640)])
def test_vllm_packed_for_deepgemm(mn, hidden, storage):
    gen = torch.Generator().manual_seed(mn + hidden)
    x = (torch.randn(mn, hidden, generator=gen) * 8).bfloat16()
    G = hidden // GS
    words, tmn = (G + 3) // 4, ceil4(mn)
    span = mn + (words - 1) * tmn  # vLLM's allocation: ends at the last column's last valid row
    out_scales = None
    if storage != "own":
        out_scales = torch.empty_strided((mn, words), (1, tmn), dtype=torch.int32, device=DEV)
        torch.as_strided(out_scales, (span,), (1,)).fill_(0x7F7F7F7F)
    q, s = per_token_group_quant_fp8(x.to(DEV), GS, scale_ue8m0=True, tma_aligned_scales=True, out_scales=out_scales)
    rq, rs = group_quant(x, pow2=True)
    assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8))
    expect = torch.zeros(words, tmn, dtype=torch.int32)
    expect[:, :mn] = pack_ue8m0(rs).t()
    got = torch.as_strided(s, (span,), (1,)).cpu()
    assert torch.equal(got, expect.flatten()[:span]), "packed storage (valid words + zero padding rows)"
