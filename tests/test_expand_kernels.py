"""moe_ep.kernels.expand (the expanded layout's row gather and the expanded combine's sum, one launch each) in the
Triton interpreter against the torch ops ElasticBuffer runs on CPU, bitwise: FP8 / BF16 rows and float32 scales,
zero and unspecified padding, 1-D weights, holes, signed zeros and infinities in the sum."""

from __future__ import annotations

import os
import types

import pytest
import torch

from moe_ep.deepep.v2.expand import gather_rows, sum_expanded
from moe_ep.fp8 import FP8_DTYPE

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU tensors run the kernels in the Triton interpreter")


def _exp_src(m: int, n: int, g: torch.Generator) -> torch.Tensor:
    src = torch.randint(0, max(m, 1), (n,), generator=g)
    src[torch.rand(n, generator=g) < 0.3] = -1  # padding rows
    return src


@pytest.mark.parametrize("dtype,hidden", [(FP8_DTYPE, 256), (torch.bfloat16, 128), (torch.float32, 2)])
@pytest.mark.parametrize("zero", [True, False])
def test_expand_rows_equals_the_torch_gather(dtype, hidden, zero):
    from moe_ep.kernels.expand import expand_rows

    g = torch.Generator().manual_seed(hidden + zero)
    m, n, k = 11, 37, 4
    t = torch.randn(m, hidden, generator=g).to(dtype)
    src = _exp_src(m, n, g)
    ks = torch.randint(0, k, (n,), generator=g)
    w = torch.randn(m, k, generator=g)
    got, got_w = expand_rows(t, src, zero, w, ks)
    want = gather_rows(t, src, zero)
    rows = torch.ones(n, dtype=torch.bool) if zero else src >= 0  # unspecified padding without zero
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(got.view(torch.uint8)[rows], want.view(torch.uint8)[rows])
    assert torch.equal(got_w, torch.where(src >= 0, w[src.clamp(min=0), ks], 0.0))


def test_expand_rows_refuses_rows_that_are_not_whole_words():
    from moe_ep.kernels.expand import expand_rows

    with pytest.raises(ValueError, match="4-byte words"):
        expand_rows(torch.zeros(3, 3, dtype=torch.uint8), torch.zeros(2, dtype=torch.int64), True)


def _handle(src: torch.Tensor, hidden: int):
    return types.SimpleNamespace(_comb_src=src, _comb_order=None, _comb_sorted_src=None, _comb_rows=None,
                                 _hidden=hidden)


@pytest.mark.parametrize("P", [0, 1, 3, 8])
def test_sum_rows_equals_the_torch_sum_bitwise(P):
    from moe_ep.deepep.v2 import expand as elastic_expand
    from moe_ep.kernels.expand import sum_rows

    g = torch.Generator().manual_seed(P)
    m, n, hidden = 9, 40, 128
    # values whose float32 sum depends on the order, plus signed zeros and infinities
    x = (torch.randn(n, hidden, generator=g) * 2.0 ** torch.randint(-20, 20, (n, hidden), generator=g)).to(torch.bfloat16)
    x[0] = -0.0
    x[1, :4] = float("inf")
    src = torch.full((m, P), -1, dtype=torch.int64)
    for r in range(m):
        c = int(torch.randint(0, P + 1, (1,), generator=g)) if P else 0
        src[r, :c] = torch.randperm(n, generator=g)[:c]
    src[0, :min(P, 2)] = 0  # a row of -0.0 terms: the sum is +0.0
    got = sum_rows(x, src)
    assert elastic_expand.USE_KERNELS is None  # the CPU path below is the torch ops
    want = sum_expanded(x, _handle(src, hidden))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    # and the value it promises: 0 + x[s_1] + x[s_2] + ... in float32, one rounding
    ref = torch.zeros(m, hidden)
    for j in range(P):
        ref += torch.where((src[:, j] >= 0).unsqueeze(1), x[src[:, j].clamp(min=0)].float(), 0.0)
    assert torch.equal(got.view(torch.int16), ref.to(torch.bfloat16).view(torch.int16))
